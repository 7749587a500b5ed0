"""Which collectives parallel/mappings.py calls: torch's functional ones inside a compiled graph (torch 2.11's dynamo
mis-differentiates the c10d calls there, pytorch#180642), c10d's in eager layers (the functional wrappers cost host
time per call: eager GPT-2.7B TP=2+SP ran 1.011-1.021x faster on c10d's, bench/RESULTS.md)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_ds.env_settings import SettingError
from megatron_ds.parallel import mappings, state
from megatron_ds.parallel.testing import run_on_ranks


class _OpNamespaces(TorchDispatchMode):
    """Records the namespace of every op dispatched under it (``c10d``, ``_c10d_functional``, ``aten``, ...)."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(func.name().split("::")[0])
        return func(*args, **(kwargs or {}))


def _sequence_parallel_step() -> set[str]:
    """Every TP helper once each way, eagerly on this rank's shard, under the recorder."""
    group = state.get_state().tp_group
    x = torch.randn(4, 2, 6, generator=torch.Generator().manual_seed(state.get_state().tp_rank), requires_grad=True)
    with _OpNamespaces() as ops:
        full = mappings.all_gather_sequence(x, group)
        y = mappings.reduce_scatter_sequence(full * 2, group)
        z = mappings.reduce_from_tp(mappings.copy_to_tp(y, group), group)
        z = mappings.gather_from_tp(mappings.scatter_to_tp(z, group), group)
        mappings.exchange_rows(z, [2, 2], [2, 2], group).sum().backward()
    return ops.seen


def test_eager_layers_call_c10d_collectives(monkeypatch):
    monkeypatch.delenv("MDS_TP_COLLECTIVES", raising=False)
    for r, seen in enumerate(run_on_ranks(_sequence_parallel_step, 2, tp=2)):
        assert "c10d" in seen, f"rank {r}: no c10d collective ran: {seen}"
        # torch 2.1 named the functional ops' namespace c10d_functional
        assert not seen & {"_c10d_functional", "c10d_functional"}, f"rank {r}: a functional one ran: {seen}"


class _Branch(torch.autograd.Function):
    """Forward and backward scale by 2 where mappings takes the functional collectives, by 3 where c10d's: the
    place our collectives' Functions make the same choice."""

    @staticmethod
    def forward(ctx, x):
        return x * (2.0 if mappings._functional() else 3.0)

    @staticmethod
    def backward(ctx, grad):
        return grad * (2.0 if mappings._functional() else 3.0)


@pytest.mark.needs_torch_compile
def test_compiled_graphs_take_the_functional_branch_forward_and_backward(monkeypatch):
    monkeypatch.setattr(mappings, "_forced", "")
    x = torch.ones(3, requires_grad=True)
    _Branch.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 3.0)), "eager took the functional branch"
    x.grad = None
    out = torch.compile(lambda t: _Branch.apply(t), backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(out, torch.full((3,), 2.0)), "the compiled forward took the c10d branch"
    out.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0)), "the compiled backward took the c10d branch"


@pytest.mark.needs_torch_compile
def test_the_forced_kind_is_read_at_the_first_collective_even_inside_a_compiled_graph(monkeypatch):
    """MDS_TP_COLLECTIVES is read at first use, not at import, and kept: the first use may be a compiled layer's
    trace (Ulysses' first all-to-all), which must take it in without a graph break."""
    monkeypatch.setenv("MDS_TP_COLLECTIVES", "inplace")
    monkeypatch.setattr(mappings, "_forced", None)  # as in a fresh process
    x = torch.ones(3, requires_grad=True)
    out = torch.compile(lambda t: _Branch.apply(t), backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(out, torch.full((3,), 3.0)), "the forced c10d branch was not taken"
    monkeypatch.setenv("MDS_TP_COLLECTIVES", "sideways")
    assert mappings.forced_kind() == "inplace", "read again after the first use"
    with pytest.raises(SettingError, match=r"MDS_TP_COLLECTIVES='sideways' must be one of functional, inplace"):
        mappings.forced_kind(reread=True)
