"""Our AdamW: torch's, plus what mds's training needs around it.

* ``norm_fn`` / ``max_norm``: measure (and clip by) the global gradient norm itself, where DeepSpeed hands the step
  straight to the optimizer (ZeRO-0, fp32): its own clipping there neither reports the norm nor knows which
  weights the pipeline duplicates. With ZeRO or bf16/fp16, DeepSpeed's optimizer wrapper measures and clips.
* ``step_flat_master``: under bf16 ZeRO-1/2, DeepSpeed's optimizer keeps each parameter group as one flat fp32
  partition and, per step, copies the flat bf16 gradient to fp32, runs AdamW, and copies the result back to the
  flat bf16 weights: three passes over memory where one does. patches/deepspeed 0004 calls this method instead
  (when ``steps_flat_master``): one compiled element-wise kernel reads the bf16 gradient, the fp32 weights and
  moments, and writes the fp32 weights, moments and bf16 weights, with the clipping factor (``grad_scale``) and
  the overflow skip (``found_inf``) inside. Its state is torch's fused AdamW's (``step``, ``exp_avg``,
  ``exp_avg_sq``), so checkpoints load either way.
"""

from __future__ import annotations

import sys

import torch

from megatron_ds.compile_costs import FirstCallTimer
from megatron_ds.model.compiled import compile_errors, describe_compile_error
from megatron_ds.torch_support import compile_problem

_flat_step = None  # the compiled _adamw_flat, or _adamw_flat itself once compiling failed


class AdamW(torch.optim.AdamW):
    """torch AdamW that can clip by a norm it measures and take the flat-master step (module docstring)."""

    norm_fn = None
    max_norm = 0.0
    _global_grad_norm = None

    @property
    def steps_flat_master(self) -> bool:
        """Whether DeepSpeed may hand this optimizer a flat low-precision gradient (patch 0004): torch's fused
        AdamW semantics without amsgrad/maximize, and a torch that compiles the step into one kernel."""
        d = self.defaults
        return (bool(d.get("fused")) and not d.get("amsgrad") and not d.get("maximize")
                and not d.get("differentiable") and compile_problem() is None)

    @torch.no_grad()
    def step(self, closure=None):
        if self.norm_fn is not None:
            norm = self.norm_fn()  # a device tensor: no host synchronisation per step
            self._global_grad_norm = norm
            if self.max_norm > 0:
                clip = torch.isfinite(norm) & (norm > self.max_norm)
                scale = torch.where(clip, self.max_norm / (norm + 1e-6), torch.ones_like(norm)).float()
                for group in self.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.grad.mul_(scale)
        return super().step(closure)

    @torch.no_grad()
    def step_flat_master(self, group_index: int, master: torch.Tensor, grad: torch.Tensor,
                         out: torch.Tensor) -> None:
        """One AdamW step of ``master`` (the fp32 flat partition of param group ``group_index``) with the flat
        ``grad`` of any dtype, writing ``out`` (the same partition of the low-precision weights).
        ``self.grad_scale`` divides the gradient and ``self.found_inf`` (non-zero) skips the step, as they do
        for torch's fused kernel."""
        group = self.param_groups[group_index]
        state = self.state[master]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
            state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        scalar = dict(dtype=torch.float32, device=master.device)
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        beta1, beta2 = group["betas"]
        _step_fn()(master, grad, state["exp_avg"], state["exp_avg_sq"], out, state["step"],
                   torch.full((), group["lr"], **scalar),  # a fill kernel: a host copy would wait for the GPU
                   torch.ones((), **scalar) if grad_scale is None else grad_scale.to(**scalar),
                   torch.zeros((), **scalar) if found_inf is None else found_inf.to(**scalar),
                   beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])


def _adamw_flat(param, grad, exp_avg, exp_avg_sq, out, step, lr, grad_scale, found_inf, *, beta1, beta2, eps,
                weight_decay):
    """torch's fused AdamW update, element-wise, in place; ``out`` gets the new weights in its dtype."""
    skip = found_inf != 0
    new_step = step + 1
    g = grad.float() / grad_scale
    m = beta1 * exp_avg + (1 - beta1) * g
    v = beta2 * exp_avg_sq + (1 - beta2) * g * g
    denom = v.sqrt() / (1 - beta2 ** new_step).sqrt() + eps
    p = param - lr * weight_decay * param
    p = p - (lr / (1 - beta1 ** new_step)) * m / denom
    p, m, v = (torch.where(skip, old, new) for old, new in ((param, p), (exp_avg, m), (exp_avg_sq, v)))
    param.copy_(p)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    out.copy_(p)
    step.copy_(torch.where(skip, step, new_step))


def _step_fn():
    """_adamw_flat compiled (one kernel on CUDA), or plain when compiling it fails (one warning)."""
    global _flat_step
    if _flat_step is None:
        # No benchmarking of kernel variants: inductor would run each variant of this memory-bound kernel on the
        # real flat tensors (billions of elements, restoring the ones it writes after each run), once per shape
        # and with a cold cache on every new node; its launch configuration is all that would change.
        compiled = FirstCallTimer("flat AdamW step", torch.compile(
            _adamw_flat, dynamic=False, options={"triton.autotune_pointwise": False}))

        def step_fn(*args, **kwargs):
            global _flat_step
            try:
                return compiled(*args, **kwargs)
            except compile_errors() as err:
                print(f"mds: WARNING: torch.compile of the flat AdamW step failed ({describe_compile_error(err)}); "
                      "it runs as separate kernels for the rest of this run", file=sys.stderr, flush=True)
                _flat_step = _adamw_flat
                return _adamw_flat(*args, **kwargs)

        _flat_step = step_fn
    return _flat_step
