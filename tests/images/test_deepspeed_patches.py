"""patches/deepspeed/0002-0004: bf16 optimizer steps without host reads of the gradient norm, and (0004, with
megatron_ds's AdamW) from the flat bf16 gradient to both weights in one kernel; 0005: the norm's mask; 0007: ZeRO-1
with one data-parallel rank copies each gradient once; 0008: the MoE gates' token cumsum along the contiguous dim.

The patched step must be the same step: a real DeepSpeed bf16 engine (one gloo process, torch's fused
AdamW, clipping active) gives the same weights with and without the patches, for each optimizer DeepSpeed
picks for bf16 (BF16_Optimizer with fp32 gradient accumulation: bit-identical; DeepSpeedZeroOptimizer at
ZeRO-1 and ZeRO-2, what mds runs: to fp32 rounding, because the fused kernel divides by the clipping factor
where DeepSpeed multiplies by its reciprocal), and a step whose gradient is not finite moves nothing,
reports the norm as inf and leaves AdamW's step count alone.
The test venvs run the patched DeepSpeed, as the images do (`make setup`); the unpatched and the patched copies
compared here are made in temporary folders from the installed one (our patches reversed, then applied again).
The unpatched copy keeps 0001 (deepspeed/comm/torch.py: no JIT build of the shm comm extension at start-up),
which no step touches: without it the first driver spent ~25 s building that extension on every suite run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ds.runtime.rendezvous import hosted_store

REPO = Path(__file__).resolve().parents[2]
APPLY = REPO / "patches" / "apply"

DRIVER = r"""
import json, os, sys
import torch, deepspeed
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
flat_calls = []
if os.environ["OPT"] == "mds":  # megatron_ds's AdamW: patch 0004 hands it the flat bf16 gradient
    from megatron_ds.training.optimizer import AdamW
    step_flat_master = AdamW.step_flat_master
    def counted(self, *args):
        flat_calls.append(args[0])
        return step_flat_master(self, *args)
    AdamW.step_flat_master = counted
    opt = AdamW(model.parameters(), lr=1e-2, fused=True)
else:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
ga = int(os.environ.get("GA", "1"))
config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": ga, "gradient_clipping": 0.05,
          "bf16": {"enabled": True}, "zero_optimization": {"stage": int(os.environ["ZERO"])},
          "zero_allow_untested_optimizer": True}  # a subclass of torch's AdamW (mds's) is "untested" to DeepSpeed
if os.environ["ACCUM"] == "fp32":
    config["data_types"] = {"grad_accum_dtype": "fp32"}
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
# what the boundary moves (patch 0007): bucket reductions of a non-empty bucket, and the step's flattens
moves = {"bucket_reductions": 0, "flattens": 0, "bucket_elements": 0}
zero_opt = engine.optimizer
if hasattr(zero_opt, "average_tensor"):
    average_tensor = zero_opt.average_tensor
    def counted_average(tensor, *args, **kwargs):
        moves["bucket_reductions"] += tensor.numel() > 0
        return average_tensor(tensor, *args, **kwargs)
    zero_opt.average_tensor = counted_average
    for name in ("flatten", "flatten_dense_tensors_aligned"):
        def counted_flatten(*args, _inner=getattr(zero_opt, name), **kwargs):
            moves["flattens"] += 1
            return _inner(*args, **kwargs)
        setattr(zero_opt, name, counted_flatten)
x = torch.randn(5, ga, 8, 16)
out = {"device_path": None, "steps": []}
for i in range(5):
    for micro in range(ga):
        batch = x[i, micro].to(torch.bfloat16)
        if i == 3 and micro == ga - 1:
            batch[0, 0] = float("inf")  # a non-finite gradient
        loss = engine(batch).float().pow(2).mean()
        engine.backward(loss)
        if hasattr(zero_opt, "ipg_buckets"):  # what the reduction buckets hold after a backward
            moves["bucket_elements"] = max(moves["bucket_elements"], sum(
                buffer.numel() for bucket in zero_opt.ipg_buckets.values() for buffer in bucket.buffer))
        engine.step()
    opt_ = engine.optimizer
    master = (opt_.fp32_groups_flat_partition if hasattr(opt_, "fp32_groups_flat_partition")
              else opt_.single_partition_of_fp32_groups)[0]
    state = engine.optimizer.optimizer.state.get(master, {})
    out["steps"].append({"norm": float(engine.get_global_grad_norm()),
                         "weights": master.detach().tolist(),
                         "adam_step": float(state["step"]) if "step" in state else 0.0})
out["device_path"] = hasattr(engine.optimizer, "skipped_on_device")
out["skipped_on_device"] = int(engine.optimizer.skipped_on_device) if out["device_path"] else None
out["optimizer"] = type(engine.optimizer).__name__
out["flat_calls"] = len(flat_calls)
out.update(moves)
print("RESULT " + json.dumps(out))
"""


def copy_of_installed_deepspeed(site: Path) -> Path:
    import deepspeed

    shutil.copytree(Path(deepspeed.__file__).parent, site / "deepspeed", ignore=shutil.ignore_patterns("__pycache__"))
    return site


@pytest.fixture(scope="module")
def plain_site(tmp_path_factory) -> Path:
    """The installed DeepSpeed without our step patches: each one found applied is reversed, the last first; once
    the pristine copy has taken the whole series in order, 0001 (start-up only) goes back on."""
    from .test_patches import load_apply

    apply = load_apply()
    site = copy_of_installed_deepspeed(tmp_path_factory.mktemp("ds_plain"))
    _, patches = apply.read_series("deepspeed")
    for patch in reversed(patches):
        if apply.git(["apply", "--check", "--reverse", str(patch)], site).returncode == 0:
            done = apply.git(["apply", "--reverse", str(patch)], site)
            assert done.returncode == 0, done.stderr
    scratch = tmp_path_factory.mktemp("ds_series")
    shutil.copytree(site / "deepspeed", scratch / "deepspeed")
    for patch in patches:  # pristine now: the series applies forward, in order
        assert apply.git(["apply", str(patch)], scratch).returncode == 0, patch.name
    start_up_only = patches[0]
    assert start_up_only.name.startswith("0001-no-start-up-jit"), start_up_only.name
    assert apply.git(["apply", str(start_up_only)], site).returncode == 0
    return site


@pytest.fixture(scope="module")
def patched_site(plain_site, tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("ds_patched")
    shutil.copytree(plain_site / "deepspeed", site / "deepspeed")
    result = subprocess.run([sys.executable, str(APPLY), "deepspeed", "--source", str(site),
                             "--manifest", str(site / "manifest.json")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    return site


def run_on_site(code: str, site: Path, tmp_path: Path, env: dict | None = None, timeout: int = 120):
    """Run ``code`` in a fresh Python that imports DeepSpeed from ``site``; what it printed after "RESULT ", as JSON."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def run_driver(tmp_path: Path, site: Path, zero: int, accum: str, opt: str, ga: int = 1) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(ZERO=str(zero), ACCUM=accum, OPT=opt, GA=str(ga))
    with hosted_store() as store:
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", **store.rank_env)
        return run_on_site(DRIVER, site, tmp_path, env, timeout=300)


@pytest.mark.parametrize("zero,accum,optimizer,opt", [
    (1, "fp32", "BF16_Optimizer", "torch"), (1, "bf16", "DeepSpeedZeroOptimizer", "torch"),
    (2, "bf16", "DeepSpeedZeroOptimizer", "torch"),
    (1, "bf16", "DeepSpeedZeroOptimizer", "mds"), (2, "bf16", "DeepSpeedZeroOptimizer", "mds")])
def test_patched_bf16_step_is_the_same_step_without_host_reads(plain_site, patched_site, tmp_path, zero, accum,
                                                               optimizer, opt):
    """opt "mds": megatron_ds's AdamW, which patch 0004 steps from the flat bf16 gradient in one kernel."""
    plain = run_driver(tmp_path, plain_site, zero, accum, opt)
    patched = run_driver(tmp_path, patched_site, zero, accum, opt)
    assert plain["optimizer"] == patched["optimizer"] == optimizer
    assert plain["device_path"] is False and patched["device_path"] is True
    assert plain["flat_calls"] == 0
    # every step, the non-finite one too (found_inf skips it inside the kernel), one parameter group
    assert patched["flat_calls"] == (5 if opt == "mds" else 0)
    for i, (a, b) in enumerate(zip(plain["steps"], patched["steps"])):
        if optimizer == "BF16_Optimizer":
            assert a["weights"] == b["weights"], f"step {i}: weights differ"
        elif opt == "torch":  # x / c in the fused kernel against x * (1 / c): a last-bit difference
            assert b["weights"] == pytest.approx(a["weights"], rel=1e-5, abs=1e-7), f"step {i}: weights differ"
        elif i < 2:  # another kernel's fp32 rounding (2e-7 seen); leaving the clipping factor out moves
            # weights by 4e-5, the weight decay by 1e-5. tests/training/test_optimizer.py checks the flat step's
            # arithmetic against torch's AdamW directly.
            assert b["weights"] == pytest.approx(a["weights"], rel=1e-5, abs=1e-6), f"step {i}: weights differ"
        else:  # from here a bf16 weight may round the other way, and the next forward differs by its ulp
            assert b["weights"] == pytest.approx(a["weights"], rel=0, abs=1e-3), f"step {i}: weights differ"
        assert a["adam_step"] == b["adam_step"], f"step {i}: AdamW step count differs"
        assert a["norm"] == pytest.approx(b["norm"], rel=1e-6 if opt == "torch" else 1e-3) or a["norm"] == b["norm"]
    # clipping was active (norm above 0.05), so the clipped path is the one compared
    assert all(s["norm"] > 0.05 for s in patched["steps"] if s["norm"] != float("inf"))
    # the non-finite step (index 3): nothing moved, norm reported inf, AdamW's count unchanged
    before, bad = patched["steps"][2], patched["steps"][3]
    assert bad["norm"] == float("inf")
    assert bad["weights"] == before["weights"] and bad["adam_step"] == before["adam_step"] == 3.0
    assert patched["steps"][4]["adam_step"] == 4.0
    assert patched["skipped_on_device"] == 1


@pytest.fixture(scope="module")
def site_without_0007(plain_site, tmp_path_factory) -> Path:
    """The series up to 0006: what patch 0007 must give the same bits as."""
    from .test_patches import load_apply

    apply = load_apply()
    site = tmp_path_factory.mktemp("ds_upto_0006")
    shutil.copytree(plain_site / "deepspeed", site / "deepspeed")
    _, patches = apply.read_series("deepspeed")
    earlier = [patch for patch in patches if "0002" <= patch.name < "0007"]  # 0001 is on the plain copy already
    assert len(earlier) == 5
    for patch in earlier:
        assert apply.git(["apply", str(patch)], site).returncode == 0, patch.name
    return site


@pytest.mark.parametrize("zero,opt,ga", [(1, "mds", 1), (1, "mds", 2), (1, "torch", 2), (2, "mds", 2)])
def test_zero_at_one_rank_copies_each_gradient_once_and_steps_the_same_bits(site_without_0007, patched_site, tmp_path,
                                                                            zero, opt, ga):
    """patches/deepspeed 0007: with one data-parallel rank ZeRO-1 allocates and reduces no bucket, and megatron_ds's
    AdamW reads the partition buffer as its flat gradient (no flatten); weights and norms are the same bits as
    before it, with gradient accumulation (ga micro-batches per step) too. ZeRO-2 keeps its reductions, and
    its bits."""
    before = run_driver(tmp_path, site_without_0007, zero, "bf16", opt, ga)
    after = run_driver(tmp_path, patched_site, zero, "bf16", opt, ga)
    assert before["optimizer"] == after["optimizer"] == "DeepSpeedZeroOptimizer"
    assert before["bucket_reductions"] >= 5 and before["flattens"] >= 5
    if zero == 1:
        assert after["bucket_reductions"] == 0
        if ga > 1:  # held between micro-batches (DeepSpeed's default: 500M elements); at ga 1 freed within backward()
            assert before["bucket_elements"] >= 5e8 and after["bucket_elements"] == 0
        assert after["flattens"] == 0 if opt == "mds" else after["flattens"] <= before["flattens"]
    else:
        assert after["bucket_reductions"] == before["bucket_reductions"]
    assert [s["weights"] for s in after["steps"]] == [s["weights"] for s in before["steps"]]
    assert [s["norm"] for s in after["steps"]] == [s["norm"] for s in before["steps"]]
    assert after["steps"][3]["norm"] == float("inf") and after["skipped_on_device"] == 1


def test_norm_mask_gives_deepspeeds_values(plain_site, patched_site, tmp_path):
    """patches/deepspeed 0005: every non-finite norm still becomes -1 and a finite one stays (that it no longer
    waits for the GPU is tests/gpu's sync-debug test of a training step)."""
    probe = ("import torch; from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace as mask; "
             "t = torch.tensor([1.5, float('inf'), -float('inf'), float('nan'), 0.0]); mask(t, device=t.device); "
             "print('RESULT', t.tolist())")
    results = [run_on_site(probe, site, tmp_path) for site in (plain_site, patched_site)]
    assert results[0] == results[1] == [1.5, -1.0, -1.0, -1.0, 0.0]


GATES = r"""
import json, torch
from deepspeed.moe.sharded_moe import top1gating, top2gating, topkgating
torch.manual_seed(0)
logits = torch.randn(300, 8)  # 300 tokens, 8 experts: capacity 38 (top-1) drops some of the busiest expert's tokens
def plain(t):
    return t.tolist() if isinstance(t, torch.Tensor) else t
out = {}
for drop in (True, False):
    for sparse in (False, True):
        out[f"top1 {drop} {sparse}"] = [plain(t) for t in top1gating(logits.clone(), 1.0, 4, drop_tokens=drop,
                                                                     sparse_routes=sparse)]
        out[f"top2 {drop} {sparse}"] = [plain(t) for t in top2gating(logits.clone(), 1.0, 4, drop_tokens=drop,
                                                                     top2_2nd_expert_sampling=False,
                                                                     sparse_routes=sparse)]
        out[f"top3 {drop} {sparse}"] = [plain(t) for t in topkgating(logits.clone(), 3, 1.0, 4, drop_tokens=drop,
                                                                     sparse_routes=sparse)]
    out[f"kept {drop}"] = int(top1gating(logits.clone(), 1.0, 4, drop_tokens=drop)[2].sum())  # dispatched tokens
print("RESULT " + json.dumps(out))
"""


def test_moe_gates_place_every_token_where_deepspeed_does(plain_site, patched_site, tmp_path):
    """patches/deepspeed 0008: top-1, top-2 and top-k gating, with and without token dropping and sparse routes,
    give DeepSpeed's gate loss, capacity, dispatch and combine weights (or routes) exactly, tokens dropped included
    (that the scan is faster is bench/RESULTS.md's MoE row)."""
    results = [run_on_site(GATES, site, tmp_path) for site in (plain_site, patched_site)]
    assert len(results[0]) == 14 and results[0] == results[1]
    assert results[0]["kept False"] == 300 and results[0]["kept True"] < 300  # the capacity cut dropped tokens
