"""FP8 (torchao) checkpoints through the real training loop on the CPU (fp8_train_driver.py: `entrypoint train`'s
rank path; only the "FP8 needs a GPU" rule is skipped), and `entrypoint convert --to hf` of them.

- Resume: a run resumed from iteration 5 logs the SAME losses (bitwise) at iterations 6..10 as the uninterrupted
  run. torchao's tensorwise dynamic scaling has no state to save (each scale comes from the current tensor), so
  the weights, the optimizer and the RNG states are all there is; one process, OMP_NUM_THREADS=1.
- Export: the HF tensors are the checkpoint's high-precision weights (bf16 module weights, which equal DeepSpeed's
  fp32 master weights rounded to bf16), never FP8-rounded values; the GEMM weights map back from `...local.weight`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ds.runtime.rendezvous import hosted_store

pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("fp8_train_driver.py")
ENTRYPOINT = os.path.join(os.path.dirname(sys.executable), "entrypoint")
LAUNCH_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "PMI_RANK", "OMPI_COMM_WORLD_RANK")
# GPT-2 style; every GEMM dimension a multiple of 16 (64 tokens per micro-batch); ZeRO-1 so DeepSpeed's fp32
# master weights are in the checkpoint's ZeRO files.
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--train-iters", "10", "--lr", "1e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
         "--min-lr", "1e-4", "--seed", "7", "--log-interval", "1", "--eval-interval", "5", "--eval-iters", "1",
         "--split", "98,2,0", "--tokenizer-type", "GPT2BPETokenizer", "--bf16", "--zero-stage", "1",
         "--metrics-file", "metrics.jsonl", "--fp8-format", "hybrid"]


def run_driver(cwd: Path, corpus, *extra: str, nproc: int = 1) -> str:
    """fp8_train_driver.py on ``nproc`` ranks (one process each, env:// as a launcher sets it); rank 0's output."""
    cwd.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, str(DRIVER), *FLAGS, "--data-path", corpus.prefix, "--vocab-file", corpus.vocab_file,
            "--merge-file", corpus.merge_file, *extra]
    procs = []
    with hosted_store() as store:
        for rank in range(nproc):
            env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
            env.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc),
                       MASTER_ADDR="127.0.0.1", **store.rank_env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
            procs.append(subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
        outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * nproc, "\n".join(out[-6000:] for out in outs)
    return outs[0]


def losses(cwd: Path) -> dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in map(json.loads, (cwd / "metrics.jsonl").read_text().splitlines())
            if "lm_loss" in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, demo_corpus):
    """The uninterrupted FP8 run: 10 iterations, saved at 5 and 10."""
    cwd = tmp_path_factory.mktemp("fp8-ref")
    out = run_driver(cwd, demo_corpus, "--save", "ckpt", "--save-interval", "5")
    return cwd, out


def test_the_driver_trains_in_float8(reference):
    cwd, out = reference
    assert "bf16 + FP8 torchao (float8 tensorwise dynamic scaling" in out, out[-3000:]
    state = torch.load(cwd / "ckpt" / "iter_0000005" / "mp_rank_00_model_states.pt", map_location="cpu",
                       weights_only=False)["module"]
    # the module state is the high-precision weights under their names; no FP8 state (dynamic scaling)
    assert state["layers.0.attention.qkv.local.weight"].dtype == torch.bfloat16
    assert not [k for k in state if k.endswith("_extra_state") or "float8" in k.lower() or "scale" in k.lower()]
    run = losses(cwd)
    assert sorted(run) == list(range(1, 11)) and run[10] < run[1]


def test_fp8_run_resumed_from_iteration_5_is_bitwise_exact(reference, demo_corpus, tmp_path):
    ref, _ = reference
    (tmp_path / "ckpt").mkdir()
    shutil.copytree(ref / "ckpt" / "iter_0000005", tmp_path / "ckpt" / "iter_0000005")
    (tmp_path / "ckpt" / "latest").write_text("iter_0000005")
    out = run_driver(tmp_path, demo_corpus, "--load", "ckpt", "--save", "ckpt")
    assert "resuming from iteration 5 (20 samples)" in out
    want, got = losses(ref), losses(tmp_path)
    assert sorted(got) == list(range(6, 11))
    assert got == {i: want[i] for i in range(6, 11)}  # bitwise


def test_export_of_an_fp8_checkpoint_is_its_high_precision_weights(reference, tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    ref, _ = reference
    result = subprocess.run([ENTRYPOINT, "convert", "--to", "hf", "--load", str(ref / "ckpt"), "--output",
                             str(tmp_path / "hf")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    module = torch.load(ref / "ckpt" / "iter_0000010" / "mp_rank_00_model_states.pt", map_location="cpu",
                        weights_only=False)["module"]
    master = get_fp32_state_dict_from_zero_checkpoint(str(ref / "ckpt"), tag="iter_0000010")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    gemms = {"attention.qkv": "attn.c_attn", "attention.proj": "attn.c_proj", "mlp.fc1": "mlp.c_fc",
             "mlp.fc2": "mlp.c_proj"}
    checked = 0
    for i in range(2):
        for ours, theirs in gemms.items():
            name = f"layers.{i}.{ours}.local.weight"  # the FP8-run GEMM weight (torchao Float8Linear's)
            hf = exported[f"transformer.h.{i}.{theirs}.weight"]  # GPT-2's Conv1D: (in, out)
            assert torch.equal(hf, module[name].t()), name
            assert torch.equal(hf, master[name].to(torch.bfloat16).t()), name  # the fp32 master, rounded once
            # not FP8-rounded: casting to e4m3 and back changes the weight
            scale = 448.0 / hf.float().abs().max()
            fp8_rounded = ((hf.float() * scale).to(torch.float8_e4m3fn).float() / scale).to(torch.bfloat16)
            assert not torch.equal(hf, fp8_rounded), name
            checked += 1
    vocab = exported["transformer.wte.weight"].shape[0]
    assert torch.equal(exported["transformer.wte.weight"], module["embedding.word_embeddings.weight"][:vocab])
    assert torch.equal(exported["transformer.h.0.ln_1.weight"], module["layers.0.input_norm.weight"])
    assert checked == 8


# ------------------------------------------------------------------ module extra state (Transformer Engine's FP8 state)

EXTRA_STATE_DRIVER = Path(__file__).with_name("extra_state_driver.py")


def run_ranks(world: int, *argv: str, cwd: Path) -> list[dict]:
    """One process per rank (what a launcher does); each prints one JSON line."""
    procs = []
    with hosted_store() as store:
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", **store.rank_env, OMP_NUM_THREADS="1",
                       PYTHONUNBUFFERED="1")
            procs.append(subprocess.Popen([sys.executable, str(EXTRA_STATE_DRIVER), *argv], cwd=cwd, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank}:\n{out[-4000:]}"
    return [json.loads(next(line for line in out.splitlines() if line.startswith('{"rank"'))) for out in outputs]


def test_module_extra_state_is_saved_and_restored_from_data_parallel_rank_0(tmp_path):
    """TE's amax history and scales are module extra state: DeepSpeed's module state dict carries the
    ``_extra_state`` keys and mds's load path restores them (strict: none dropped or refused). With DP > 1
    DeepSpeed writes data-parallel rank 0's module states only, so every DP rank resumes with rank 0's history."""
    saved = run_ranks(2, "save", "ckpt", cwd=tmp_path)
    history = {r["rank"]: r["history"] for r in saved}
    assert len(history[0]) == 8 and all(len(h) == 3 for h in history[0].values())
    assert history[0] != history[1]  # each DP rank saw its own data
    module = torch.load(tmp_path / "ckpt" / "iter_0000003" / "mp_rank_00_model_states.pt", map_location="cpu",
                        weights_only=False)["module"]
    extra = sorted(k for k in module if k.endswith("._extra_state"))
    assert extra == sorted(f"{name}._extra_state" for name in history[0])
    assert "layers.0.attention.qkv.local._extra_state" in extra
    assert not (tmp_path / "ckpt" / "iter_0000003" / "mp_rank_01_model_states.pt").exists()

    loaded = run_ranks(2, "load", "ckpt", cwd=tmp_path)
    for r in loaded:
        assert r["history"] == history[0], f"rank {r['rank']}"  # rank 0's, on both ranks

    # weights-only readers (convert --to hf) leave the FP8 engine state out
    from megatron_ds.checkpoint.shards import _rank_state_dicts

    weights = _rank_state_dicts(str(tmp_path / "ckpt" / "iter_0000003"), 1, 1, 2)[0]
    assert not [k for k in weights if k.endswith("_extra_state")]
    assert torch.equal(weights["layers.1.mlp.fc2.local.weight"], module["layers.1.mlp.fc2.local.weight"])
