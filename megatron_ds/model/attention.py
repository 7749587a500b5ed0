"""Causal attention behind one interface, with the kernel chosen once when the model is built.

Backends: "flash2" (flash-attn 2, needs CUDA and bf16/fp16), "sdpa" (torch's
scaled_dot_product_attention, which itself picks flash / cuDNN / memory-efficient kernels),
"reference" (explicit softmax, for tests), "auto" (flash2 when importable and usable, else sdpa).

All take q [b, s, nq, d] and k, v [b, s, nkv, d] (grouped-query attention when nkv < nq; query
head i uses kv head i // (nq // nkv)) and return [b, s, nq, d].

``ulysses_attention(core, q, k, v, group)`` runs any of them under DeepSpeed-Ulysses sequence parallelism
with our own all-to-all pair (parallel/mappings.py): q, k, v arrive as this rank's sequence slice with all
heads, one all-to-all turns them into the full sequence with nq/sp and nkv/sp heads, the kernel runs, and the
inverse all-to-all returns the slice. Contiguous head blocks keep each query head with its kv head
as long as nkv divides by sp (checked by ``check_ulysses_heads``). The model needs nothing of DeepSpeed
for it, so it runs on every torch and DeepSpeed mds supports, and compiles like the TP collectives.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math

import torch
import torch.nn.functional as F

from megatron_ds.parallel.mappings import heads_to_sequence, sequence_to_heads, tp_size
from megatron_ds.torch_support import torch_version

BACKENDS = ("auto", "flash2", "sdpa", "reference")
HALF = (torch.float16, torch.bfloat16)
GQA_MAX_HEAD_DIM = 256  # the largest head dim that torch's flash kernel (the one after cuDNN) takes


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve_backend(requested: str, params_dtype: torch.dtype = torch.bfloat16,
                    cuda: bool | None = None) -> str:
    """The backend that will run for ``requested``; raises ValueError when it cannot run here."""
    if requested not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {requested!r}")
    cuda = torch.cuda.is_available() if cuda is None else cuda
    half = params_dtype in (torch.bfloat16, torch.float16)
    if requested == "auto":
        return "flash2" if cuda and half and flash_attn_available() else "sdpa"
    if requested == "flash2":
        problems = [why for bad, why in ((not flash_attn_available(), "the flash_attn package is not installed"),
                                         (not cuda, "no CUDA device is visible"),
                                         (not half, f"params are {params_dtype}, flash-attn needs bf16 or fp16"))
                    if bad]
        if problems:
            raise ValueError("attention backend flash2 cannot run: " + "; ".join(problems))
    return requested


def sdpa_takes_gqa(params_dtype: torch.dtype, cuda: bool | None = None) -> bool:
    """Whether the sdpa backend hands k, v over with their nkv heads (``enable_gqa=True``) instead of repeating each
    one nq / nkv times first: torch >= 2.5 (the keyword), CUDA (not ROCm) on sm80 or newer, bf16/fp16 params.

    There torch's flash and cuDNN kernels read the shared heads themselves, and the repeat costs a copy of k and v
    at nq heads in the forward (saved for the backward too) and a sum back over each group in the backward. Where
    neither kernel runs (fp32, older GPUs, ROCm, head dim > 256) SDPA would fall to its math kernel, which builds
    the s x s scores: its memory-efficient kernel takes no GQA in these torch versions. Those keep the repeat."""
    cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0 if cuda is None else cuda
    if torch_version() < (2, 5) or params_dtype not in HALF or not cuda or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability() >= (8, 0)


def _expand_kv(x: torch.Tensor, groups: int, head_dim: int) -> torch.Tensor:
    """Repeat each kv head ``groups`` times along ``head_dim`` (works on every torch >= 2.1)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=head_dim)


def _flash2(q, k, v, dropout_p: float) -> torch.Tensor:
    from flash_attn import flash_attn_func  # native GQA: nkv may divide nq

    return flash_attn_func(q, k, v, dropout_p=dropout_p, causal=True)


def cudnn_first(q: torch.Tensor):
    """SDPA's order of preference for an eager CUDA call: cuDNN's attention kernel first, then flash, memory-efficient
    and math. ATen's eager order puts flash (FA2) first; cuDNN's kernel, which the compiled layers already get, ran a
    GPT-1.3B step's attention (dropout 0.1) in 76.6 ms against FA2's 111 on an H200 (bench/RESULTS.md). Inside a
    compiled graph, on CPU and on torch < 2.6 (no priority order) SDPA's own choice stands."""
    if not q.is_cuda or torch_version() < (2, 6) or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    try:  # torch.nn.attention: torch >= 2.3 (the MS-AMP image's 2.1 has none)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                 SDPBackend.MATH]
        return sdpa_kernel(order, set_priority=True)
    except ImportError:
        return contextlib.nullcontext()


def _sdpa(q, k, v, dropout_p: float, native_gqa: bool = False) -> torch.Tensor:
    """``native_gqa``: k, v keep their nkv heads (see sdpa_takes_gqa); else each is repeated to nq heads."""
    groups = q.size(2) // k.size(2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, d]
    with cudnn_first(q):
        if groups > 1 and native_gqa and torch_version() >= (2, 5):
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=True)
        else:
            k, v = _expand_kv(k, groups, 1), _expand_kv(v, groups, 1)
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    return out.transpose(1, 2)


def _reference(q, k, v, dropout_p: float) -> torch.Tensor:
    groups = q.size(2) // k.size(2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, d]
    k, v = _expand_kv(k, groups, 1), _expand_kv(v, groups, 1)
    s = q.size(2)
    scores = (q @ k.transpose(-2, -1)).float() / math.sqrt(q.size(-1))  # [b, heads, s, s]
    future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1).to(v.dtype)
    probs = F.dropout(probs, p=dropout_p) if dropout_p > 0 else probs
    return (probs @ v).transpose(1, 2)


_KERNELS = {"flash2": _flash2, "sdpa": _sdpa, "reference": _reference}


class CoreAttention(torch.nn.Module):
    """softmax(q k^T / sqrt(d), causal) v with the backend resolved at construction (``resolved_backend``), and
    for sdpa whether grouped-query k, v go in unrepeated (``native_gqa``, see sdpa_takes_gqa)."""

    def __init__(self, backend: str = "auto", dropout: float = 0.0, params_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.requested_backend = backend
        self.resolved_backend = resolve_backend(backend, params_dtype)
        self.dropout = dropout
        self._kernel = _KERNELS[self.resolved_backend]
        self.native_gqa = self.resolved_backend == "sdpa" and sdpa_takes_gqa(params_dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.resolved_backend == "flash2" and not q.is_cuda:
            raise RuntimeError("attention backend flash2 was chosen at build time but the model runs on "
                               f"{q.device}; build with attention_backend='sdpa' for CPU")
        dropout = self.dropout if self.training else 0.0
        if self.native_gqa:  # the model may still run elsewhere (CPU) or in fp32 (autocast) than it was built for
            native = q.is_cuda and q.dtype in HALF and q.size(-1) <= GQA_MAX_HEAD_DIM
            return _sdpa(q, k, v, dropout, native_gqa=native)
        return self._kernel(q, k, v, dropout)

    def extra_repr(self) -> str:
        gqa = ", native_gqa=True" if self.native_gqa else ""
        return f"backend={self.resolved_backend}, dropout={self.dropout}{gqa}"


def check_ulysses_heads(num_query_heads: int, num_kv_heads: int, sp: int) -> None:
    """Ulysses hands each SP rank whole heads: query and kv heads must both divide by the SP size."""
    for what, count in (("--num-attention-heads", num_query_heads), ("--num-key-value-heads", num_kv_heads)):
        if count % sp:
            raise ValueError(f"{what} {count} is not divisible by --ds-sequence-parallel-size {sp} "
                             "(Ulysses gives every sequence-parallel rank whole attention heads)")


def ulysses_attention(core, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group) -> torch.Tensor:
    """``core`` on the whole sequence and this rank's heads: q, k, v [b, s/sp, n, d] -> [b, s/sp, nq, d].

    q, k and v travel in one all-to-all (each rank's block holds its q, k and v heads side by side): a rank's
    micro batch is small where Ulysses splits a short sequence, and there every collective's fixed cost shows.
    Each all-to-all's backward is the other one, so gradients flow back to the rank that owns each slice."""
    sp = tp_size(group)
    b, s, _, d = q.shape
    heads = [t.size(2) // sp for t in (q, k, v)]
    blocks = torch.cat([t.reshape(b, s, sp, n, d) for t, n in zip((q, k, v), heads)], dim=3)  # [b, s, sp, ., d]
    q, k, v = sequence_to_heads(blocks.reshape(b, s, sp * sum(heads), d), group).split(heads, dim=2)
    return heads_to_sequence(core(q, k, v), group)
