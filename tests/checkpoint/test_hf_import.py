"""`entrypoint convert --from hf`: small randomly initialised HF GPT-2 and LLaMA models, saved locally.

Each is imported (GPT-2 with its own default GeLU, the tanh approximation: --openai-gelu), our forward
(built from the flags the import printed, loading the files it wrote)
must give HF's logits within 1e-4 (fp32; single process and TP=2 through real gloo ranks), export
must give back HF's tensors exactly, and `entrypoint train --load --finetune` must run from it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_helpers import ENTRYPOINT, Ranks, env

TP_LOGITS = Path(__file__).with_name("tp_logits.py")
VOCAB = 4096  # the embedded corpus's tokenizer, so the finetune run can use it


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """HF initialises norms to 1 and biases to 0: give every tensor random values, so nothing is tested trivially."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator) * 0.05
            p.copy_((1.0 + noise) if "ln" in name or "norm" in name else noise)


def save_gpt2(path: Path) -> Path:
    import transformers

    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                     activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    _randomise(model, 1)
    model.save_pretrained(path)
    return path


def save_llama(path: Path) -> Path:
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False)
    model = transformers.LlamaForCausalLM(config)
    _randomise(model, 2)
    model.save_pretrained(path)
    return path


MODELS = {"gpt2": (save_gpt2, "GPT2LMHeadModel"), "llama": (save_llama, "LlamaForCausalLM")}


def convert(*argv: str, fail: bool = False) -> subprocess.CompletedProcess:
    result = subprocess.run([ENTRYPOINT, "convert", *argv], capture_output=True, text=True, timeout=300)
    assert (result.returncode == 2) if fail else (result.returncode == 0), result.stdout + result.stderr
    return result


def printed_flags(stdout: str) -> list[str]:
    """The model flags the import told the user to train with."""
    import shlex

    line = next(line for line in stdout.splitlines() if line.strip().startswith("entrypoint train "))
    words = shlex.split(line)[2:]
    return words[:words.index("--load")]


def hf_logits(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir))
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


def our_logits(checkpoint: Path, tokens: torch.Tensor) -> torch.Tensor:
    """One process: GPTModel from the checkpoint's recorded flags, loading the file the import wrote."""
    from megatron_ds.arguments import settings_from_stored
    from megatron_ds.arguments.settings import model_config
    from megatron_ds.model.gpt import GPTModel
    from megatron_ds.precision import precision_from

    metadata = json.loads((checkpoint / "mds_checkpoint.json").read_text())
    settings = settings_from_stored(metadata["args"])
    module = torch.load(checkpoint / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    precision = precision_from(settings.precision, settings.model.transformer_impl)
    config = model_config(settings, module["embedding.word_embeddings.weight"].shape[0], precision.params_dtype)
    config.attention_backend = "reference"
    model = GPTModel(config)
    model.load_state_dict(module, strict=True)
    model.eval()
    with torch.no_grad():
        return model(tokens)


@pytest.fixture(scope="module", params=sorted(MODELS))
def imported(request, tmp_path_factory):
    """(name, HF directory, mds checkpoint directory at TP=1, convert's stdout)."""
    name = request.param
    root = tmp_path_factory.mktemp(f"hf-{name}")
    hf_dir = MODELS[name][0](root / "hf")
    result = convert("--from", "hf", str(hf_dir), "--to", str(root / "mds"))
    return name, hf_dir, root / "mds", result.stdout


def test_import_prints_the_flags_and_writes_a_weights_only_checkpoint(imported):
    name, _, mds, stdout = imported
    flags = printed_flags(stdout)
    assert f"wrote {MODELS[name][1]}" in stdout
    if name == "llama":
        for flag in ("--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights"):
            assert flag in flags
        assert flags[flags.index("--num-key-value-heads") + 1] == "2"
        assert flags[flags.index("--normalization") + 1] == "RMSNorm"
    else:
        assert "--swiglu" not in flags and "--untie-embeddings-and-output-weights" not in flags
        assert "--openai-gelu" in flags and "warning" not in stdout  # gelu_new: the tanh approximation, exactly
    assert (mds / "latest").read_text() == "iter_0000000"
    metadata = json.loads((mds / "iter_0000000" / "mds_checkpoint.json").read_text())
    assert (metadata["optimizer_saved"], metadata["rng_saved"], metadata["layout"]["tp"]) == (False, False, 1)
    assert metadata["model"]["vocab_size"] == VOCAB
    qkv = next(k for k in metadata["splits"] if k.startswith("layers.0.attention.qkv") and k.endswith("weight"))
    assert metadata["splits"][qkv]["dim"] == 0
    assert metadata["splits"][qkv]["parts"] == ([64, 64, 64] if name == "gpt2" else [64, 32, 32])


def test_our_logits_equal_hf_logits(imported):
    _, hf_dir, mds, _ = imported
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    ours = our_logits(mds / "iter_0000000", tokens)
    assert ours.shape == (2, 32, VOCAB)
    torch.testing.assert_close(ours, hf_logits(hf_dir, tokens), atol=1e-4, rtol=0)


def test_tp2_import_logits_equal_hf_logits(imported, tmp_path):
    """Imported at TP=2 (vocabulary padded to 128 x 2 = 4096): each rank loads its own shard file."""
    _, hf_dir, _, _ = imported
    convert("--from", "hf", str(hf_dir), "--to", str(tmp_path / "mds"), "--tensor-model-parallel-size", "2")
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    torch.save(tokens, tmp_path / "tokens.pt")
    ranks = Ranks([sys.executable, str(TP_LOGITS), str(tmp_path / "mds" / "iter_0000000"), str(tmp_path / "tokens.pt"),
                   str(tmp_path / "ours.pt")], 2, tmp_path, "logits")
    assert ranks.wait(180) == [0, 0], ranks.output()
    torch.testing.assert_close(torch.load(tmp_path / "ours.pt"), hf_logits(hf_dir, tokens), atol=1e-4, rtol=0)


def test_import_then_export_gives_back_the_hf_tensors_exactly(imported, tmp_path):
    from safetensors.torch import load_file

    _, hf_dir, mds, _ = imported
    convert("--to", "hf", "--load", str(mds), "--output", str(tmp_path / "back"), "--vocab-size", str(VOCAB))
    original, back = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(original) == sorted(back)
    for key, tensor in original.items():
        assert torch.equal(tensor, back[key]), key
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config.get("activation_function", "silu") == json.loads((hf_dir / "config.json").read_text()).get(
        "activation_function", "silu")  # GPT-2: gelu_new back (LLaMA has hidden_act instead)


def test_finetune_runs_two_iterations_from_the_import(imported, demo_corpus, tmp_path):
    _, _, mds, stdout = imported
    argv = [ENTRYPOINT, "train", *printed_flags(stdout), "--load", str(mds), "--finetune",
            "--data-path", demo_corpus.prefix, "--vocab-file", demo_corpus.vocab_file, "--merge-file",
            demo_corpus.merge_file, "--split", "98,2,0", "--micro-batch-size", "2", "--global-batch-size", "2",
            "--train-iters", "2", "--lr", "1e-4", "--lr-warmup-iters", "0", "--eval-iters", "0",
            "--log-interval", "1", "--metrics-file", "metrics.jsonl", "--save", "out"]
    result = subprocess.run(argv, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "--finetune: loaded weights of iteration 0" in result.stderr
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in lines if "lm_loss" in r] == [1, 2]
    assert (tmp_path / "out" / "latest").read_text() == "iter_0000002"


def test_without_finetune_the_missing_optimizer_state_is_named(imported, demo_corpus, tmp_path):
    _, _, mds, stdout = imported
    argv = [ENTRYPOINT, "train", *printed_flags(stdout), "--load", str(mds), "--data-path", demo_corpus.prefix,
            "--vocab-file", demo_corpus.vocab_file, "--merge-file", demo_corpus.merge_file, "--micro-batch-size", "2",
            "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-4", "--eval-iters", "0"]
    result = subprocess.run(argv, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "--no-save-optim: pass --no-load-optim (or --finetune)" in result.stderr


def test_unsupported_architecture_is_refused_and_nothing_written(tmp_path):
    import transformers

    config = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32)
    transformers.BertForMaskedLM(config).save_pretrained(tmp_path / "bert")
    result = convert("--from", "hf", str(tmp_path / "bert"), "--to", str(tmp_path / "mds"), fail=True)
    assert "architecture BertForMaskedLM (model_type 'bert') is not supported" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "mds").exists()
