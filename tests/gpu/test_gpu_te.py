"""Transformer Engine FP8 on a GPU: the engine against bf16 on the same weights, and its FP8 state across a resume.

Needs a GPU of compute capability >= 8.9 and Transformer Engine importable (bench/te_carry.py puts it there on the
benchmark machines); without either the tests fail naming what is missing. Bounds, measured on one H200 with TE 2.20
(bench/results/gpu_tests_te.json has the values each run saw):
- one forward and backward of a 2-layer GPT after two warm-up passes (delayed scaling starts from scale 1 and needs
  an amax history): the loss within 1% of bf16's, the logits within 10% (relative L2), every GEMM weight's gradient
  at cosine >= 0.95 to bf16's and its norm within 10%.
- a run resumed from its iteration-5 checkpoint logs iteration 6's loss bit for bit (same weights, same data, same
  amax history and scales: a fresh history would scale by 1 and change it), and the later ones within 1e-3.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.gpu.test_gpu_training import LAUNCH_VARS, MODEL, REPORT, write_report

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")


def needs_te_and_fp8() -> None:
    """Fail, naming the missing piece: these tests are selected only where FP8 on TE is the point."""
    assert torch.cuda.is_available(), "no CUDA GPU visible: the Transformer Engine tests need one"
    cap = torch.cuda.get_device_capability()
    assert cap >= (8, 9), f"compute capability {cap}: FP8 GEMMs need >= 8.9"
    assert importlib.util.find_spec("transformer_engine") is not None, (
        "transformer_engine is not importable: install it (bench/te_carry.py) or deselect with -k 'not te'")


def test_te_fp8_forward_and_gradients_match_bf16_on_the_same_weights():
    needs_te_and_fp8()
    from megatron_ds.model.config import GPTConfig
    from megatron_ds.model.gpt import GPTModel
    from megatron_ds.precision.fp8 import FP8Options, local_gemms
    from megatron_ds.precision.fp8_te import TransformerEngine

    config = GPTConfig(num_layers=2, hidden_size=256, num_attention_heads=8, vocab_size=512, seq_length=128,
                       hidden_dropout=0.0, attention_dropout=0.0, seed=5, params_dtype=torch.bfloat16)
    bf16 = GPTModel(config).cuda()
    fp8 = TransformerEngine(FP8Options(format="hybrid")).convert(copy.deepcopy(bf16))
    names = sorted(local_gemms(bf16))
    assert {type(m).__name__ for n, m in fp8.named_modules() if n in names} == {"AutocastLinear"}
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, config.vocab_size, (4, config.seq_length + 1), generator=g).cuda()

    def loss_and_grads(model):
        model.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        grads = {n: model.get_parameter(f"{n}.weight").grad.float() for n in names}
        return loss.item(), logits.float(), grads

    for _ in range(2):  # the amax history of every GEMM, so that the third pass scales by what it saw
        loss_and_grads(fp8)
    want_loss, want_logits, want_grads = loss_and_grads(bf16)
    got_loss, got_logits, got_grads = loss_and_grads(fp8)
    loss_rel = abs(got_loss - want_loss) / want_loss
    logits_rel = ((got_logits - want_logits).norm() / want_logits.norm()).item()
    cosines = {n: torch.nn.functional.cosine_similarity(got_grads[n].flatten(), want_grads[n].flatten(), dim=0).item()
               for n in names}
    norms = {n: abs(got_grads[n].norm().item() / want_grads[n].norm().item() - 1) for n in names}
    REPORT["te_vs_bf16_same_weights"] = {"loss_rel": loss_rel, "logits_rel_l2": logits_rel, "grad_cosine": cosines,
                                         "grad_norm_rel": norms}
    write_report()
    assert loss_rel <= 1e-2, (got_loss, want_loss)
    assert logits_rel <= 0.1, logits_rel
    assert min(cosines.values()) >= 0.95, cosines
    assert max(norms.values()) <= 0.1, norms


def train(demo_corpus, cwd, *extra: str) -> dict[int, float]:
    metrics = cwd / "metrics.jsonl"
    argv = [sys.executable, "-m", "entrypoint", "train", *MODEL, "--data-path", demo_corpus.prefix,
            "--vocab-file", demo_corpus.vocab_file, "--merge-file", demo_corpus.merge_file, "--tokenizer-type",
            "GPT2BPETokenizer", "--split", "98,2,0", "--micro-batch-size", "4", "--global-batch-size", "8",
            "--train-iters", "10", "--lr", "1e-3", "--lr-warmup-iters", "2", "--seed", "7", "--log-interval", "1",
            "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0", "--bf16", "--zero-stage", "1",
            "--fp8-format", "hybrid", "--fp8-engine", "te", "--metrics-file", str(metrics), *extra]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    assert "te (Transformer Engine delayed scaling" in result.stdout + result.stderr, result.stdout[-2000:]
    return {r["iteration"]: r["lm_loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "lm_loss" in r}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_te_fp8_state_saves_and_resumes_exactly(tmp_path, demo_corpus, compiled):
    needs_te_and_fp8()
    mode = "--torch-compile" if compiled else "--no-torch-compile"
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    whole.mkdir()
    resumed.mkdir()
    want = train(demo_corpus, whole, mode, "--save", str(whole / "ckpt"), "--save-interval", "5")
    ckpt = resumed / "ckpt"  # the iteration-5 checkpoint of the same run, as `latest`
    shutil.copytree(whole / "ckpt", ckpt)
    shutil.rmtree(ckpt / "iter_0000010")
    (ckpt / "latest").write_text("iter_0000005")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("5")
    states = torch.load(ckpt / "iter_0000005" / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    extra = [k for k in states["module"] if k.endswith("local._extra_state")]
    assert len(extra) == 4 * int(MODEL[MODEL.index("--num-layers") + 1]), sorted(states["module"])[:20]
    got = train(demo_corpus, resumed, mode, "--load", str(ckpt))
    REPORT[f"te_resume_{'compiled' if compiled else 'eager'}"] = {"whole": want, "resumed": got}
    write_report()
    assert sorted(got) == list(range(6, 11)), got
    assert got[6] == want[6], (got, want)  # the restored amax history and scales, the restored weights
    assert all(abs(got[i] - want[i]) <= 1e-3 * want[i] for i in got), (got, want)


def test_te_and_torchao_both_train_the_bf16_curve(tmp_path_factory, demo_corpus):
    """The two FP8 engines on the same flags: each within the layouts' FP8 bound of the bf16 curve."""
    needs_te_and_fp8()
    from tests.gpu.test_gpu_training import run_train

    if importlib.util.find_spec("torchao") is None:
        raise AssertionError("torchao is not importable: carry its wheel (.whl/) or deselect this test")
    base = ["--bf16", "--zero-stage", "1"]
    bf16 = [r["lm_loss"] for r in run_train(tmp_path_factory, demo_corpus, "engines_bf16", base)]
    for engine in ("te", "torchao"):
        got = [r["lm_loss"] for r in run_train(tmp_path_factory, demo_corpus, f"engines_{engine}",
                                               base + ["--fp8-format", "hybrid", "--fp8-engine", engine])]
        rel = max(abs(a - b) / b for a, b in zip(got, bf16))
        REPORT[f"engines_{engine}"]["max_rel_to_bf16"] = rel
        write_report()
        assert rel <= 0.03, (engine, got, bf16)
