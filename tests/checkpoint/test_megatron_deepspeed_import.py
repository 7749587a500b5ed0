"""`entrypoint convert --from megatron-deepspeed`: tiny checkpoints in Megatron-DeepSpeed's two layouts.

The checkpoints are written here from the key names Megatron-DeepSpeed documents in its sources
(megatron/checkpointing.py: mp_rank_XX[_YYY]/model_optim_rng.pt with 'model', 'args',
'checkpoint_version' 3.0; megatron/model/language_model.py: language_model -> embedding
{word_embeddings, position_embeddings}, encoder {layers.<i>..., final_layernorm}, output_layer;
megatron/model/transformer.py: input_layernorm, self_attention.query_key_value, self_attention.dense,
post_attention_layernorm, mlp.dense_h_to_4h, mlp.dense_4h_to_h; gpt_model.py's GPTModelPipe: pieces
layer_01 embedding ... lm_head), from the weights of a GPTModel we build, at source TP=2 (PP=2).
The import (at TP=1, and at TP=2) must give that model's logits.
"""

from __future__ import annotations

import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from ckpt_helpers import Ranks
from megatron_ds.checkpoint import splits
from megatron_ds.model.config import GPTConfig
from megatron_ds.model.gpt import GPTModel
from test_hf_import import our_logits
from test_train_checkpoints import ENTRYPOINT

TP_LOGITS = Path(__file__).with_name("tp_logits.py")
LAYER_NAMES = {"input_layernorm": "input_norm", "self_attention.query_key_value": "attention.qkv",
               "self_attention.dense": "attention.proj", "post_attention_layernorm": "post_attention_norm",
               "mlp.dense_h_to_4h": "mlp.fc1", "mlp.dense_4h_to_h": "mlp.fc2"}
STYLES = {
    "llama": dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, num_key_value_heads=2,
                  ffn_hidden_size=96, add_bias_linear=False, untie_embeddings_and_output_weights=True),
    "gpt2": dict(),
}


def build_model(style: str) -> GPTModel:
    config = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=4096, seq_length=32,
                       hidden_dropout=0.0, attention_dropout=0.0, attention_backend="reference", seed=3,
                       **STYLES[style])
    model = GPTModel(config)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():  # norms are 1 and biases 0 at init: make every tensor count
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    return model.eval()


def megatron_args(model: GPTModel, tp: int, pp: int) -> Namespace:
    c = model.config
    return Namespace(num_layers=c.num_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                     num_key_value_heads=c.num_key_value_heads, ffn_hidden_size=c.ffn_hidden_size,
                     seq_length=c.seq_length, max_position_embeddings=c.max_position_embeddings,
                     layernorm_epsilon=c.norm_epsilon, normalization=c.normalization.lower(), swiglu=c.swiglu,
                     use_rotary_position_embeddings=c.position_embedding_type == "rope",
                     add_position_embedding=c.position_embedding_type == "learned_absolute", rope_theta=10000,
                     add_bias_linear=c.add_bias_linear,
                     untie_embeddings_and_output_weights=c.untie_embeddings_and_output_weights,
                     padded_vocab_size=c.vocab_size, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                     kv_channels=c.head_dim, num_experts=[1], tokenizer_type="GPT2BPETokenizer")


def _tp_shard(model: GPTModel, param: torch.nn.Parameter, tp: int, rank: int) -> torch.Tensor:
    name = splits.name_of(model)(param)
    return splits.shard(param.detach(), splits.record(model).get(name), tp, rank)


def megatron_pieces(model: GPTModel, tp: int, rank: int) -> dict:
    """This TP rank's weights in Megatron's names: {"embedding": {...}, "layers": [{...}], "final": {...}, "head": ...}."""
    def shard(p):
        return _tp_shard(model, p, tp, rank)

    embedding = {"word_embeddings.weight": shard(model.embedding.word_embeddings.weight)}
    if model.embedding.position_embeddings is not None:
        embedding["position_embeddings.weight"] = shard(model.embedding.position_embeddings)
    layers = []
    for layer in model.layers:
        entry = {}
        for megatron, ours in LAYER_NAMES.items():
            module = layer
            for part in ours.split("."):
                module = getattr(module, part)
            entry[f"{megatron}.weight"] = shard(module.weight)
            if module.bias is not None:
                entry[f"{megatron}.bias"] = shard(module.bias)
        layers.append(entry)
    norm = model.final_norm.norm
    final = {"weight": shard(norm.weight), **({"bias": shard(norm.bias)} if norm.bias is not None else {})}
    head = None if model.output_head is None else shard(model.output_head.linear.weight)
    return {"embedding": embedding, "layers": layers, "final": final, "head": head}


def write_megatron(model: GPTModel, root: Path, tp: int, pp: int) -> Path:
    """<root>/iter_0000010/mp_rank_{t:02d}_{p:03d}/model_optim_rng.pt and Megatron's tracker file."""
    per_stage = model.config.num_layers // pp
    for t in range(tp):
        pieces = megatron_pieces(model, tp, t)
        for p in range(pp):
            encoder = {}
            for local, layer in enumerate(pieces["layers"][p * per_stage:(p + 1) * per_stage]):
                encoder.update({f"layers.{local}.{k}": v for k, v in layer.items()})
            language_model = {}
            if p == 0:
                language_model["embedding"] = {key.split(".")[0]: {"weight": v} for key, v in pieces["embedding"].items()}
            if p == pp - 1:
                encoder.update({f"final_layernorm.{k}": v for k, v in pieces["final"].items()})
                if pieces["head"] is not None:
                    language_model["output_layer"] = {"weight": pieces["head"]}
            language_model["encoder"] = encoder
            state = {"model": {"language_model": language_model}, "args": megatron_args(model, tp, pp),
                     "checkpoint_version": 3.0, "iteration": 10}
            if p == pp - 1 and pp > 1 and pieces["head"] is None:
                state["model"]["word_embeddings_for_head"] = {"weight": pieces["embedding"]["word_embeddings.weight"]}
            directory = root / "iter_0000010" / (f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else ""))
            directory.mkdir(parents=True)
            torch.save(state, directory / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("10")
    return root


def write_deepspeed_pipeline(model: GPTModel, root: Path, tp: int) -> Path:
    """<root>/global_step10/layer_XX-model_YY-model_states.pt (GPTModelPipe's spec order: 00 is the
    fp16 cast, 01 the embedding, then the layers, the final norm, the untied lm_head) and 'latest'."""
    directory = root / "global_step10"
    directory.mkdir(parents=True)
    n = model.config.num_layers
    for t in range(tp):
        pieces = megatron_pieces(model, tp, t)
        files = {1: pieces["embedding"], n + 2: pieces["final"]}
        files.update({2 + i: layer for i, layer in enumerate(pieces["layers"])})
        if pieces["head"] is not None:
            files[n + 3] = {"lm_head.weight": pieces["head"]}
        for index, piece in files.items():
            torch.save(piece, directory / f"layer_{index:02d}-model_{t:02d}-model_states.pt")
    torch.save({"module": None, "args": megatron_args(model, tp, 1), "iteration": 10},
               directory / "mp_rank_00_model_states.pt")
    (root / "latest").write_text("global_step10")
    return root


def convert(*argv: str, fail: bool = False) -> subprocess.CompletedProcess:
    result = subprocess.run([ENTRYPOINT, "convert", *argv], capture_output=True, text=True, timeout=300)
    assert (result.returncode == 2) if fail else (result.returncode == 0), result.stdout + result.stderr
    return result


LAYOUTS = {"megatron-tp2-pp2": lambda m, root: write_megatron(m, root, 2, 2),
           "megatron-tp2": lambda m, root: write_megatron(m, root, 2, 1),
           "deepspeed-pipeline-tp2": lambda m, root: write_deepspeed_pipeline(m, root, 2)}


@pytest.mark.parametrize("style", sorted(STYLES))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_import_gives_the_models_logits(style, layout, tmp_path):
    model = build_model(style)
    source = LAYOUTS[layout](model, tmp_path / "src")
    result = convert("--from", "megatron-deepspeed", str(source), "--to", str(tmp_path / "mds"))
    assert "entrypoint train " in result.stdout
    tokens = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(tokens)
    torch.testing.assert_close(our_logits(tmp_path / "mds" / "iter_0000000", tokens), want, atol=1e-5, rtol=0)


def test_import_at_tp2_gives_the_models_logits(tmp_path):
    model = build_model("llama")
    source = write_megatron(model, tmp_path / "src", 2, 2)
    convert("--from", "megatron-deepspeed", str(source), "--to", str(tmp_path / "mds"),
            "--tensor-model-parallel-size", "2")
    tokens = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(6))
    torch.save(tokens, tmp_path / "tokens.pt")
    ranks = Ranks([sys.executable, str(TP_LOGITS), str(tmp_path / "mds" / "iter_0000000"), str(tmp_path / "tokens.pt"),
                   str(tmp_path / "ours.pt")], 2, tmp_path, "logits")
    assert ranks.wait(180) == [0, 0], ranks.output()
    with torch.no_grad():
        want = model(tokens)
    torch.testing.assert_close(torch.load(tmp_path / "ours.pt"), want, atol=1e-5, rtol=0)


def test_partial_and_old_checkpoints_are_refused_and_nothing_written(tmp_path):
    model = build_model("gpt2")
    source = write_megatron(model, tmp_path / "src", 2, 2)
    (source / "iter_0000010" / "mp_rank_01_001" / "model_optim_rng.pt").unlink()
    (source / "iter_0000010" / "mp_rank_01_001").rmdir()
    result = convert("--from", "megatron-deepspeed", str(source), "--to", str(tmp_path / "mds"), fail=True)
    assert "is partial: mp_rank_01_001 missing" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "mds").exists()

    old = write_megatron(model, tmp_path / "old", 1, 1)
    path = old / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt"
    torch.save(dict(torch.load(path, weights_only=False), checkpoint_version=1.0), path)
    result = convert("--from", "megatron-deepspeed", str(old), "--to", str(tmp_path / "mds"), fail=True)
    assert "checkpoint_version 1.0; mds reads version 3.0" in result.stderr
    assert not (tmp_path / "mds").exists()
