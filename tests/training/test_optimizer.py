"""megatron_ds.training.optimizer.AdamW's flat-master step (what patches/deepspeed 0004 calls under bf16 ZeRO-1/2)
against torch's own AdamW: the same arithmetic, the low-precision weights written from the new fp32 ones, the
clipping factor and the overflow skip inside, and a state torch's AdamW continues from."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megatron_ds.torch_support import compile_problem
from megatron_ds.training.optimizer import AdamW

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)


def groups(params: list[torch.Tensor]) -> list[dict]:
    return [{"params": [params[0]], "weight_decay": 0.1}, {"params": [params[1]], "weight_decay": 0.0}]


def test_flat_master_step_is_torchs_adamw():
    if compile_problem():  # torch 2.1: DeepSpeed keeps its own step (no one-kernel flat step there)
        assert not said_fused(AdamW([torch.zeros(3)])).steps_flat_master
        return
    check_flat_step("cpu")


def check_flat_step(device: str) -> None:
    """Six steps (the fourth skipped as non-finite, lr moving, grad_scale set) against torch's AdamW, then torch's
    AdamW continuing from the state. tests/gpu runs it on CUDA, where the step is one Triton kernel."""
    torch.manual_seed(0)
    start = [torch.randn(1000, device=device), torch.randn(300, device=device)]
    ref_params = [p.clone() for p in start]
    ref = torch.optim.AdamW(groups(ref_params), foreach=False, **HYPER)
    mine_params = [p.clone() for p in start]
    mine = AdamW(groups(mine_params), fused=True, **HYPER)
    assert mine.steps_flat_master and not AdamW(groups(start), **HYPER).steps_flat_master  # fused only
    outs = [torch.empty_like(p, dtype=torch.bfloat16) for p in start]
    for step in range(6):
        grads = [torch.randn_like(p).bfloat16() for p in start]
        scale, skip = torch.tensor(2.5 + step, device=device), step == 3
        for group in (*ref.param_groups, *mine.param_groups):
            group["lr"] = HYPER["lr"] * (1 - step / 10)  # the schedule moves lr every step
        mine.grad_scale, mine.found_inf = scale, torch.tensor(float(skip), device=device)
        before = [p.clone() for p in mine_params]
        for i, (p, g, out) in enumerate(zip(mine_params, grads, outs)):
            mine.step_flat_master(i, p, g, out)
            assert torch.equal(out, p.bfloat16()), "the bf16 weights are the new fp32 ones, rounded"
        if skip:  # a non-finite gradient: nothing moves, the step count stays
            assert all(torch.equal(a, b) for a, b in zip(before, mine_params))
            assert float(mine.state[mine_params[0]]["step"]) == step
            continue
        for p, g in zip(ref_params, grads):
            p.grad = g.float() / scale
        ref.step()
        for a, b in zip(mine_params, ref_params):
            torch.testing.assert_close(a, b, rtol=0, atol=2e-6)
    # torch's AdamW continues from the flat step's state exactly as from its own
    cont = [p.clone() for p in mine_params]
    theirs = torch.optim.AdamW(groups(cont), foreach=False, **HYPER)
    state = mine.state_dict()
    assert set(state["state"][0]) == {"step", "exp_avg", "exp_avg_sq"} and float(state["state"][0]["step"]) == 5
    theirs.load_state_dict(state)
    for opt, params in ((ref, ref_params), (theirs, cont)):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    for a, b in zip(cont, ref_params):
        torch.testing.assert_close(a, b, rtol=0, atol=4e-6)


def said_fused(opt: AdamW) -> AdamW:
    """As if built with fused=True (which torch 2.1 refuses on CPU): what steps_flat_master looks at."""
    opt.defaults["fused"] = True
    return opt


def test_flat_master_step_needs_fused_adamw_semantics():
    params = [torch.zeros(4)]
    assert not AdamW(params).steps_flat_master  # not fused: torch's foreach/for-loop semantics stay
    assert not said_fused(AdamW(params, amsgrad=True)).steps_flat_master
    assert not said_fused(AdamW(params, maximize=True)).steps_flat_master
    assert said_fused(AdamW(params)).steps_flat_master == (compile_problem() is None)
    with pytest.raises(IndexError):
        AdamW(params).step_flat_master(1, params[0], params[0], params[0])  # no such group


@pytest.mark.needs_torch_compile
def test_flat_master_step_falls_back_to_separate_kernels_when_compiling_fails(tmp_path):
    """A broken C++ compiler (inductor's CPU backend needs g++) and an empty inductor cache: the flat step warns
    once, naming the cause, and still takes torch's AdamW steps (as separate kernels)."""
    bad = tmp_path / "bin"
    bad.mkdir()
    (bad / "g++").write_text("#!/bin/sh\necho 'g++: broken on purpose (mds test)' >&2\nexit 1\n")
    (bad / "g++").chmod(0o755)
    env = {**os.environ, "PATH": f"{bad}:{os.environ['PATH']}", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run([sys.executable, "-c", "from tests.training.test_optimizer import check_flat_step; "
                          "check_flat_step('cpu'); print('checked')"], cwd=repo, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and "checked" in run.stdout, run.stderr[-4000:]
    warnings = [line for line in run.stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 1, run.stderr[-4000:]
    assert "flat AdamW step failed" in warnings[0] and "InvalidCxxCompiler" in warnings[0], warnings
