"""The scheduling pass of --tp-comm-overlap wgrad (parallel/collective_windows.py) on stand-in scheduler nodes:
which GEMM it may move into a collective's window, and that it refuses an order that breaks a dependency. The
pass on inductor's real nodes (more collectives beside a GEMM, the eager sums) is tests/model and tests/training."""

from __future__ import annotations

from collections import namedtuple
from types import SimpleNamespace

import pytest

from megatron_ds.parallel import collective_windows as cw

Dep = namedtuple("Dep", "name")


class Node:
    """What the pass reads of an inductor scheduler node: names, dependencies, the kernel it calls."""

    def __init__(self, name: str, needs: tuple[str, ...] = (), kernel: str | None = None):
        self.name = name
        self.unmet_dependencies = {Dep(f"{n}_buf") for n in needs}
        self.node = SimpleNamespace(python_kernel_name=kernel)

    def get_name(self):
        return self.name

    def get_buffer_names(self):
        return {f"{self.name}_buf"}

    def get_operation_names(self):
        return {self.name}


def nodes(*specs) -> list[Node]:
    return [Node(name, needs, kernel) for name, needs, kernel in specs]


MM = "extern_kernels.mm"


def test_a_gemm_nothing_needs_until_the_collective_moves_later_into_its_window():
    # dgrad -> reduce-scatter -> wait, with the weight gradient computed before the collective and read by nobody
    order = nodes(("grad", (), None), ("wgrad", ("grad",), MM), ("dgrad", ("grad",), MM), ("rs", ("dgrad",), None),
                  ("wait", ("rs",), None), ("norm_bwd", ("wait",), None))
    needs = cw._dependencies(order)
    assert cw._gemm_before(order, 3, set(), needs) == 1  # wgrad; dgrad is closer, but the reduce-scatter needs it
    assert cw._gemm_before(order, 3, {order[1]}, needs) is None  # one GEMM per window: placed ones stay


def test_a_gemm_after_the_wait_moves_earlier_only_when_it_needs_nothing_from_the_collective_on():
    order = nodes(("x", (), None), ("ag", ("x",), None), ("wait", ("ag",), None), ("use", ("wait",), MM),
                  ("late", ("use",), MM), ("free", ("x",), MM))
    needs = cw._dependencies(order)
    assert cw._gemm_after(order, 1, 2, set(), needs) == 5  # "use" and "late" need the gathered tensor; "free" not
    assert cw._gemm_after(order, 1, 2, {order[5]}, needs) is None  # one GEMM per window: placed ones stay


def test_an_order_that_breaks_a_dependency_is_refused():
    order = nodes(("a", (), None), ("b", ("a",), MM))
    needs = cw._dependencies(order)
    cw._check(order, needs)
    with pytest.raises(RuntimeError, match="b would run before a, which it needs"):
        cw._check(order[::-1], needs)


def test_a_broken_order_keeps_the_schedule_it_was_given_with_one_warning(monkeypatch):
    # a pass that picked a GEMM the collective needs (a bug) must not compute wrong sums, nor cost the compile
    monkeypatch.setattr(cw, "_is_big_collective", lambda node: node.name == "rs")
    monkeypatch.setattr(cw, "_wait_index",
                        lambda order, at, needs: order.index(next(n for n in order if n.name == "wait")))
    monkeypatch.setattr(cw, "_gemm_before", lambda order, at, placed, needs: 1)  # dgrad, which rs reads
    order = nodes(("grad", (), None), ("dgrad", ("grad",), MM), ("rs", ("dgrad",), None), ("wait", ("rs",), None))
    with pytest.warns(RuntimeWarning, match="rs would run before dgrad, which it needs"
                                            ".*keeps --tp-comm-overlap reorder"):
        kept = cw.fill_collective_windows(order)
    assert kept == order


def test_a_dependency_torchs_passes_already_reordered_is_left_to_them():
    # inductor's own passes may put a wait after a collective that had an ordering-only dependency on it
    order = nodes(("ag", ("wait_of_ar",), None), ("wait_of_ar", (), None))
    needs = cw._dependencies(order)
    assert needs[order[0]] == set()
    cw._check(order, needs)


def test_a_window_keeps_the_gemm_it_already_has(monkeypatch):
    # two collectives; the first already has a GEMM in its window, the second none: the first keeps its GEMM
    monkeypatch.setattr(cw, "_is_big_collective", lambda node: node.name.startswith("rs"))
    monkeypatch.setattr(cw, "_wait_index", lambda order, at, needs: next(
        j for j in range(at + 1, len(order)) if order[at] in needs[order[j]] and order[j].name.startswith("wait")))
    order = nodes(("a", (), None), ("rs1", ("a",), None), ("beside", ("a",), MM), ("wait1", ("rs1",), None),
                  ("b", ("wait1",), None), ("rs2", ("b",), None), ("wait2", ("rs2",), None))
    assert [n.name for n in cw.fill_collective_windows(order)] == [n.name for n in order]
