"""The LLaMA path's attention inputs, checked against the formulations they replaced: grouped-query k, v handed to
SDPA unrepeated (``enable_gqa``) where torch's fused kernels take them, and rotary tables made once and passed
into the (compiled) layer instead of recomputed in it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_ds.model import attention
from megatron_ds.model.attention import CoreAttention, sdpa_takes_gqa
from megatron_ds.torch_support import torch_version


def close(actual: torch.Tensor, expected: torch.Tensor, what: str, rel: float = 1e-5) -> None:
    assert actual.shape == expected.shape, what
    tol = rel * expected.abs().max().item() + 1e-7
    err = (actual - expected).abs().max().item()
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.3g}"


class SDPACalls:
    """Records the keyword arguments and k's head count of every F.scaled_dot_product_attention call."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[dict, int]] = []
        real = F.scaled_dot_product_attention

        def recording(q, k, v, **kwargs):
            self.calls.append((kwargs, k.size(1)))
            return real(q, k, v, **kwargs)

        monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording)


# ---------------------------------------------------------------------------------------- grouped-query attention

def qkv_gqa(requires_grad: bool = True):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 12, 6, 8, generator=g)  # [b, s, nq, d], 3 query heads per kv head
    k, v = torch.randn(2, 12, 2, 8, generator=g), torch.randn(2, 12, 2, 8, generator=g)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def run_sdpa(native_gqa: bool):
    q, k, v = qkv_gqa()
    out = attention._sdpa(q, k, v, 0.0, native_gqa=native_gqa)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(6)))
    return out.detach(), q.grad, k.grad, v.grad


def test_sdpa_native_gqa_equals_the_repeated_kv(monkeypatch):
    """enable_gqa=True gives the outputs and q, k, v gradients of repeating each kv head first (fp32, CPU)."""
    calls = SDPACalls(monkeypatch)
    native, repeated = run_sdpa(native_gqa=True), run_sdpa(native_gqa=False)
    for what, a, b in zip(("output", "dq", "dk", "dv"), native, repeated):
        close(a, b, f"native GQA vs repeated kv: {what}")
    if torch_version() >= (2, 5):
        assert calls.calls == [({"dropout_p": 0.0, "is_causal": True, "enable_gqa": True}, 2),
                               ({"dropout_p": 0.0, "is_causal": True}, 6)]


def test_sdpa_without_the_enable_gqa_keyword_repeats_kv(monkeypatch):
    """Torch < 2.5 (the MS-AMP image's 2.1) has no enable_gqa: the kv heads are repeated, whatever was asked."""
    calls = SDPACalls(monkeypatch)
    monkeypatch.setattr(attention, "torch_version", lambda: (2, 1))
    old_torch = run_sdpa(native_gqa=True)
    assert calls.calls == [({"dropout_p": 0.0, "is_causal": True}, 6)]
    for what, a, b in zip(("output", "dq", "dk", "dv"), old_torch, run_sdpa(native_gqa=False)):
        assert torch.equal(a, b), what


def test_native_gqa_only_where_torchs_fused_kernels_take_it(monkeypatch):
    """flash and cuDNN take nkv < nq heads; fp32 (memory-efficient kernel), pre-sm80 GPUs, ROCm and torch < 2.5
    would land on the math kernel (or lack the keyword), so they keep the repeat."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(attention, "torch_version", lambda: (2, 11))
    assert sdpa_takes_gqa(torch.bfloat16, cuda=True) and sdpa_takes_gqa(torch.float16, cuda=True)
    assert not sdpa_takes_gqa(torch.float32, cuda=True)
    assert not sdpa_takes_gqa(torch.bfloat16, cuda=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    assert not sdpa_takes_gqa(torch.bfloat16, cuda=True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert not sdpa_takes_gqa(torch.bfloat16, cuda=True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(attention, "torch_version", lambda: (2, 1))
    assert not sdpa_takes_gqa(torch.bfloat16, cuda=True)


def test_core_built_for_gpu_repeats_kv_where_it_runs_on_cpu(monkeypatch):
    """A core built with native GQA still repeats kv when its inputs are not CUDA bf16/fp16 (a CPU run of a model
    built on a GPU machine, fp32 under autocast), and gives the same outputs."""
    calls = SDPACalls(monkeypatch)
    core = CoreAttention("sdpa")
    assert not core.native_gqa  # fp32 params here
    core.native_gqa = True  # as built on an sm90 GPU with bf16 params
    q, k, v = qkv_gqa(requires_grad=False)
    close(core(q, k, v), CoreAttention("reference")(q, k, v), "core on CPU vs reference")
    assert calls.calls == [({"dropout_p": 0.0, "is_causal": True}, 6)]
    assert "native_gqa=True" in repr(core)
