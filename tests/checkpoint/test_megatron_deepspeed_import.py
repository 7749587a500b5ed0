"""`entrypoint convert --from megatron-deepspeed`: tiny checkpoints in Megatron-DeepSpeed's two layouts.

The checkpoints are written here from the key names Megatron-DeepSpeed uses in its sources
(megatron/checkpointing.py: mp_rank_XX[_YYY]/model_optim_rng.pt with 'model', 'args',
'checkpoint_version'; megatron/model/language_model.py: language_model -> embedding
{word_embeddings, position_embeddings}, encoder {layers.<i>..., final_layernorm}, output_layer;
megatron/model/transformer.py: input_layernorm, self_attention.query_key_value, self_attention.dense,
post_attention_layernorm, mlp.dense_h_to_4h, mlp.dense_4h_to_h; gpt_model.py's GPTModelPipe: pieces
layer_01 embedding ... lm_head). The weights are random per source TP rank, in upstream's own row orders,
and the expected logits come from megatron_reference.py (upstream's per-rank forward, not our model):
the import (at TP=1, and at TP=2) must give them.
"""

from __future__ import annotations

import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import megatron_reference as reference
import pytest
import torch
from ckpt_helpers import ENTRYPOINT, Ranks
from test_hf_import import our_logits

TP_LOGITS = Path(__file__).with_name("tp_logits.py")
# Megatron's saved args: 8 query heads over 4 KV heads, so at TP=2 each rank holds 2 KV groups and the
# grouped order differs from [q; k; v] (with one group per rank the two coincide)
STYLES = {
    "llama": dict(use_rotary_position_embeddings=True, normalization="rmsnorm", swiglu=True, num_attention_heads=8,
                  num_key_value_heads=4, ffn_hidden_size=96, add_bias_linear=False,
                  untie_embeddings_and_output_weights=True),
    "gpt2": dict(),
}


def megatron_args(style: str, tp: int, pp: int, **extra) -> Namespace:
    """The args Megatron-DeepSpeed pickles into its checkpoints (the fields the importer reads)."""
    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, ffn_hidden_size=256,
                  seq_length=32, max_position_embeddings=32, layernorm_epsilon=1e-5, normalization="layernorm",
                  swiglu=False, use_rotary_position_embeddings=False, rope_theta=10000, add_bias_linear=True,
                  untie_embeddings_and_output_weights=False, padded_vocab_size=4096, tensor_model_parallel_size=tp,
                  pipeline_model_parallel_size=pp, kv_channels=None, num_experts=[1], bias_gelu_fusion=False,
                  tokenizer_type="GPT2BPETokenizer")
    fields.update(STYLES[style], **extra)
    fields["add_position_embedding"] = not fields["use_rotary_position_embeddings"]
    fields["kv_channels"] = fields["hidden_size"] // fields["num_attention_heads"]
    return Namespace(**fields)


def write_megatron(ranks: list[dict], args: Namespace, root: Path, pp: int, version: float = 3.0) -> Path:
    """<root>/iter_0000010/mp_rank_{t:02d}_{p:03d}/model_optim_rng.pt and Megatron's tracker file."""
    per_stage = args.num_layers // pp
    for t, pieces in enumerate(ranks):
        for p in range(pp):
            encoder = {}
            for local, layer in enumerate(pieces["layers"][p * per_stage:(p + 1) * per_stage]):
                encoder.update({f"layers.{local}.{k}": v for k, v in layer.items()})
            language_model = {}
            if p == 0:
                language_model["embedding"] = {key.split(".")[0]: {"weight": v}
                                              for key, v in pieces["embedding"].items()}
            if p == pp - 1:
                encoder.update({f"final_layernorm.{k}": v for k, v in pieces["final"].items()})
                if pieces["head"] is not None:
                    language_model["output_layer"] = {"weight": pieces["head"]}
            language_model["encoder"] = encoder
            state = {"model": {"language_model": language_model}, "args": args,
                     "checkpoint_version": version, "iteration": 10}
            if p == pp - 1 and pp > 1 and pieces["head"] is None:
                state["model"]["word_embeddings_for_head"] = {"weight": pieces["embedding"]["word_embeddings.weight"]}
            directory = root / "iter_0000010" / (f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else ""))
            directory.mkdir(parents=True)
            torch.save(state, directory / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("10")
    return root


def write_deepspeed_pipeline(ranks: list[dict], args: Namespace, root: Path) -> Path:
    """<root>/global_step10/layer_XX-model_YY-model_states.pt (GPTModelPipe's spec order: 00 is the
    fp16 cast, 01 the embedding, then the layers, the final norm, the untied lm_head) and 'latest'."""
    directory = root / "global_step10"
    directory.mkdir(parents=True)
    n = args.num_layers
    for t, pieces in enumerate(ranks):
        files = {1: pieces["embedding"], n + 2: pieces["final"]}
        files.update({2 + i: layer for i, layer in enumerate(pieces["layers"])})
        if pieces["head"] is not None:
            files[n + 3] = {"lm_head.weight": pieces["head"]}
        for index, piece in files.items():
            torch.save(piece, directory / f"layer_{index:02d}-model_{t:02d}-model_states.pt")
    torch.save({"module": None, "args": args, "checkpoint_version": 3.0, "iteration": 10},
               directory / "mp_rank_00_model_states.pt")
    (root / "latest").write_text("global_step10")
    return root


def convert(*argv: str, fail: bool = False) -> subprocess.CompletedProcess:
    result = subprocess.run([ENTRYPOINT, "convert", *argv], capture_output=True, text=True, timeout=300)
    assert (result.returncode == 2) if fail else (result.returncode == 0), result.stdout + result.stderr
    return result


LAYOUTS = {"megatron-tp2-pp2": lambda ranks, args, root: write_megatron(ranks, args, root, 2),
           "megatron-tp2": lambda ranks, args, root: write_megatron(ranks, args, root, 1),
           "deepspeed-pipeline-tp2": lambda ranks, args, root: write_deepspeed_pipeline(ranks, args, root)}
TOKENS = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(4))
# fp32 logits of magnitude ~10, summed in another order than the reference's: 1e-4 absolute; reading the
# query_key_value rows in the wrong order scrambles heads and moves the logits by O(1)


@pytest.mark.parametrize("style", sorted(STYLES))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_import_gives_upstreams_logits(style, layout, tmp_path):
    """checkpoint_version 3.0 written before Dec 2024: query_key_value grouped per KV group."""
    args = megatron_args(style, 2, 2 if "pp2" in layout else 1)
    ranks = reference.random_pieces(args, 2, "grouped")
    source = LAYOUTS[layout](ranks, args, tmp_path / "src")
    result = convert("--from", "megatron-deepspeed", str(source), "--to", str(tmp_path / "mds"))
    assert "entrypoint train " in result.stdout and "query_key_value order grouped" in result.stdout
    torch.testing.assert_close(our_logits(tmp_path / "mds" / "iter_0000000", TOKENS),
                               reference.logits(ranks, args, "grouped", TOKENS), atol=1e-4, rtol=1e-5)


# (style, order the weights are in, checkpoint_version, extra saved args, convert flags)
ORDERS = {
    "fpdt-era thirds, auto": ("gpt2", "thirds", 3.0, dict(ds_sequence_parallel_fpdt=False), []),
    "thirds forced": ("gpt2", "thirds", 3.0, {}, ["--qkv-order", "thirds"]),
    "grouped forced over fpdt args": ("gpt2", "grouped", 3.0, dict(ds_sequence_parallel_fpdt=False),
                                      ["--qkv-order", "grouped"]),
    "fpdt args with GQA stay grouped": ("llama", "grouped", 3.0, dict(ds_sequence_parallel_fpdt=False), []),
    "version 2.0": ("gpt2", "grouped", 2.0, {}, []),
    "version 1.0": ("gpt2", "v1", 1.0, {}, []),
    "version 0": ("gpt2", "thirds", 0, {}, []),
    "pre-2023 GQA query + key_value": ("llama", "split", 3.0, {}, []),
}


@pytest.mark.parametrize("case", sorted(ORDERS))
def test_every_upstream_qkv_order_imports(case, tmp_path):
    style, order, version, extra, flags = ORDERS[case]
    args = megatron_args(style, 2, 1, **extra)
    ranks = reference.random_pieces(args, 2, order, seed=7)
    source = write_megatron(ranks, args, tmp_path / "src", 1, version=version)
    convert("--from", "megatron-deepspeed", str(source), "--to", str(tmp_path / "mds"), *flags)
    torch.testing.assert_close(our_logits(tmp_path / "mds" / "iter_0000000", TOKENS),
                               reference.logits(ranks, args, order, TOKENS), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("gelu, tanh", [({"bias_gelu_fusion": True}, True), ({"openai_gelu": True}, True),
                                        ({}, False)], ids=["fused-bias-gelu", "openai-gelu", "exact"])
def test_megatron_gelu_imports_as_the_same_activation(gelu, tanh, tmp_path):
    """Megatron's fused bias-GeLU (its default) and --openai-gelu compute GeLU's tanh approximation: the
    import says --openai-gelu for them (exact GeLU otherwise) and the logits agree."""
    args = megatron_args("gpt2", 2, 1, **gelu)
    ranks = reference.random_pieces(args, 2, "grouped", seed=3)
    source = write_megatron(ranks, args, tmp_path / "src", 1)
    result = convert("--from", "megatron-deepspeed", str(source), "--to", str(tmp_path / "mds"))
    assert ("--openai-gelu" in result.stdout) == tanh and "warning" not in result.stdout + result.stderr
    torch.testing.assert_close(our_logits(tmp_path / "mds" / "iter_0000000", TOKENS),
                               reference.logits(ranks, args, "grouped", TOKENS), atol=1e-4, rtol=1e-5)


def test_import_at_tp2_gives_upstreams_logits(tmp_path):
    args = megatron_args("llama", 2, 2)
    ranks = reference.random_pieces(args, 2, "grouped")
    source = write_megatron(ranks, args, tmp_path / "src", 2)
    convert("--from", "megatron-deepspeed", str(source), "--to", str(tmp_path / "mds"),
            "--tensor-model-parallel-size", "2")
    torch.save(TOKENS, tmp_path / "tokens.pt")
    procs = Ranks([sys.executable, str(TP_LOGITS), str(tmp_path / "mds" / "iter_0000000"), str(tmp_path / "tokens.pt"),
                   str(tmp_path / "ours.pt")], 2, tmp_path, "logits")
    assert procs.wait(180) == [0, 0], procs.output()
    torch.testing.assert_close(torch.load(tmp_path / "ours.pt"), reference.logits(ranks, args, "grouped", TOKENS),
                               atol=1e-4, rtol=1e-5)


def test_bad_checkpoints_are_refused_and_nothing_written(tmp_path):
    args = megatron_args("gpt2", 2, 2)
    source = write_megatron(reference.random_pieces(args, 2, "grouped"), args, tmp_path / "src", 2)
    (source / "iter_0000010" / "mp_rank_01_001" / "model_optim_rng.pt").unlink()
    (source / "iter_0000010" / "mp_rank_01_001").rmdir()
    result = convert("--from", "megatron-deepspeed", str(source), "--to", str(tmp_path / "mds"), fail=True)
    assert "is partial: mp_rank_01_001 missing" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "mds").exists()

    gqa = megatron_args("llama", 1, 1)
    old = write_megatron(reference.random_pieces(gqa, 1, "grouped"), gqa, tmp_path / "old", 1, version=1.0)
    result = convert("--from", "megatron-deepspeed", str(old), "--to", str(tmp_path / "mds"), fail=True)
    assert "checkpoint_version 1.0 with --num-key-value-heads 4" in result.stderr, result.stderr
    assert not (tmp_path / "mds").exists()
    result = convert("--from", "megatron-deepspeed", str(old), "--to", str(tmp_path / "mds"), "--qkv-order",
                     "thirds", fail=True)
    assert not (tmp_path / "mds").exists()

    mha = megatron_args("gpt2", 1, 1)
    unknown = write_megatron(reference.random_pieces(mha, 1, "grouped"), mha, tmp_path / "unknown", 1, version=1.5)
    result = convert("--from", "megatron-deepspeed", str(unknown), "--to", str(tmp_path / "mds"), fail=True)
    assert "checkpoint_version 1.5 is unknown" in result.stderr
    assert not (tmp_path / "mds").exists()
