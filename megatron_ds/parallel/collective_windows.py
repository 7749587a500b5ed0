"""An inductor scheduling pass that gives each TP collective a GEMM to run beside (``--tp-comm-overlap wgrad``).

In a compiled layer's backward the TP collectives wait at once: the reduce-scatter (or all-reduce) of a
column-parallel linear's input gradient, and the all-gather of a row-parallel linear's output gradient, each feed
the very next kernel. Yet the weight-gradient GEMMs need none of them. Inductor schedules them elsewhere: its
peak-memory pass moves them to the end of the backward (their outputs are the graph's), and torch's
reordering passes only move collectives and waits, never compute. So nothing runs beside a collective (bench/
RESULTS.md). This pass moves one independent GEMM into each collective's window, between its issue
and its wait. It may take a GEMM from before the collective (when nothing up to the collective needs it) or from
after the wait (when it depends on neither), so the fc2, fc1 and attention-projection weight gradients fill the
windows of the three collectives that follow them. The forward has no such GEMM and stays as it was.

The pass runs after torch's passes (parallel/overlap.py lists it last) and is registered by name in inductor's
comms module, so the compile options stay a list of names and the FX graph cache keeps working. Bump the
version in ``PASS_NAME`` whenever the schedule it makes changes.
"""

from __future__ import annotations

PASS_NAME = "mds_fill_collective_windows_v2"
_GEMMS = ("extern_kernels.mm", "extern_kernels.addmm", "extern_kernels.bmm")


def register() -> str:
    """Make the pass known to inductor by name; returns the name for ``reorder_for_compute_comm_overlap_passes``."""
    from torch._inductor import comms

    setattr(comms, PASS_NAME, fill_collective_windows)
    return PASS_NAME


def fill_collective_windows(snodes: list) -> list:
    """Inductor's scheduler nodes, reordered so that each big collective has a GEMM between its issue and wait.
    Should the new order break a dependency (a bug of ours), the layers keep the order they were given, which
    is ``reorder``'s, with one warning: slower, never wrong, and still compiled."""
    try:
        return _filled(snodes)
    except _BrokenOrder as broken:
        import warnings

        warnings.warn(f"{broken}; this graph keeps --tp-comm-overlap reorder's schedule", RuntimeWarning, stacklevel=2)
        return list(snodes)


class _BrokenOrder(RuntimeError):
    """A schedule that would run a node before one it needs."""


def _filled(snodes: list) -> list:
    order, placed = list(snodes), set()
    needs = _dependencies(order)
    i = 0
    while i < len(order):
        collective = order[i]
        wait = _wait_index(order, i, needs) if _is_big_collective(collective) else None
        if wait is None:
            i += 1
            continue
        beside = [node for node in order[i + 1:wait] if _is_gemm(node)]
        placed.update(beside)  # a window that has its GEMM keeps it: no later window takes it away
        if not beside:
            pick = _gemm_before(order, i, placed, needs)
            if pick is None:
                pick = _gemm_after(order, i, wait, placed, needs)
            if pick is not None:
                gemm = order.pop(pick)
                placed.add(gemm)
                i = order.index(collective)
                order.insert(i + 1, gemm)
        i += 1
    _check(order, needs)
    return order


def _dependencies(order: list) -> dict:
    """What each node must follow: the producers of what it depends on (inductor's dependencies, reads, writes after
    reads and ordering ones) that it does follow in the schedule it is given. One that torch's own passes already
    reordered (they may, for some ordering-only ones) is theirs to answer for and left as it is."""
    producer = {}
    for node in order:
        for name in (*node.get_buffer_names(), *node.get_operation_names()):
            producer[name] = node
    position = {node: k for k, node in enumerate(order)}
    return {node: {producer[dep.name] for dep in node.unmet_dependencies
                   if dep.name in producer and position[producer[dep.name]] < position[node]}
            for node in order}


def _gemm_before(order: list, at: int, placed: set, needs: dict) -> int | None:
    """The closest GEMM before the collective at ``at`` that nothing up to the collective needs: moved later, into
    the window."""
    needed = set(needs[order[at]])  # what the nodes from the candidate on, up to the collective, need
    for j in range(at - 1, -1, -1):
        node = order[j]
        if _is_gemm(node) and node not in placed and node not in needed:
            return j
        needed |= needs[node]
    return None


def _gemm_after(order: list, at: int, wait: int, placed: set, needs: dict) -> int | None:
    """The first GEMM after the wait that needs nothing from the collective on: moved earlier, into the window."""
    passed = set(order[at:wait + 1])  # the nodes a candidate would move ahead of
    for j in range(wait + 1, len(order)):
        node = order[j]
        if _is_gemm(node) and node not in placed and not needs[node] & passed:
            return j
        passed.add(node)
    return None


def _wait_index(order: list, at: int, needs: dict) -> int | None:
    """Where the wait of the collective at ``at`` is: the first wait that needs it."""
    from torch._inductor.utils import contains_wait

    return next((j for j in range(at + 1, len(order)) if contains_wait(order[j]) and order[at] in needs[order[j]]),
                None)


def _is_big_collective(snode) -> bool:
    """A collective worth a GEMM: any but the all-reduce of a 1-D tensor (a sequence-parallel norm's or bias's
    gradient, a few kilobytes; the activations' collectives are 2-D or more)."""
    from torch._inductor.utils import is_collective

    node = getattr(snode, "node", None)
    if not is_collective(node):
        return False
    if "all_reduce" not in str(getattr(node, "python_kernel_name", "")):
        return True
    try:
        return len(node.inputs[0].get_size()) > 1
    except (AttributeError, IndexError, TypeError):
        return True


def _is_gemm(snode) -> bool:
    return getattr(getattr(snode, "node", None), "python_kernel_name", None) in _GEMMS


def _check(order: list, needs: dict) -> None:
    """Every node still after all it must follow: a schedule that broke this would compute wrong numbers, so stop."""
    position = {node: k for k, node in enumerate(order)}
    for node in order:
        late = [dep for dep in needs[node] if position[dep] > position[node]]
        if late:
            raise _BrokenOrder(f"{PASS_NAME}: {node.get_name()} would run before {late[0].get_name()}, which it needs")
