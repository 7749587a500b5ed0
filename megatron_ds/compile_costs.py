"""What torch.compile cost at start-up, per compiled function: the first step's log line reads it.

Compiling happens inside the first call of a compiled function for each input shape (tracing, lowering, building
or loading the kernels, and inductor's benchmarking of its kernel variants); later calls only launch kernels. So
each compiled function of mds is called through ``FirstCallTimer``, which times that first call per shape (with
one device synchronisation, once), and ``summary()`` tells the user where the first step's minutes went.
"""

from __future__ import annotations

import time

import torch

_seconds: dict[str, list[float]] = {}  # what -> wall time of its first call, one entry per input shape


def record(what: str, seconds: float) -> None:
    """Add one first call of ``what`` (e.g. "layer graph") that took ``seconds``."""
    _seconds.setdefault(what, []).append(seconds)


def summary() -> str:
    """'layer graph 11.9 s, cross entropy (3 kernels) 2.0 s, flat AdamW step (2 shapes) 1.1 s', in first-call order;
    empty when nothing compiled."""
    parts = []
    for what, times in _seconds.items():
        count = f" ({len(times)} {'shapes' if what.endswith('step') else 'kernels'})" if len(times) > 1 else ""
        parts.append(f"{what}{count} {sum(times):.1f} s")
    return ", ".join(parts)


def total_seconds() -> float:
    return sum(sum(times) for times in _seconds.values())


def reset() -> None:
    """Forget the recorded calls (tests; a second run in one process)."""
    _seconds.clear()


def _sync(tensors) -> None:
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            torch.cuda.synchronize(t.device)
            return


class FirstCallTimer:
    """``fn`` (a compiled function), timing its first call per input signature under ``what``."""

    def __init__(self, what: str, fn):
        self.what, self.fn, self._seen = what, fn, set()

    def __call__(self, *args, **kwargs):
        key = tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else type(a) for a in args)
        if key in self._seen:
            return self.fn(*args, **kwargs)
        start = time.perf_counter()
        out = self.fn(*args, **kwargs)
        _sync(args)
        self._seen.add(key)
        record(self.what, time.perf_counter() - start)
        return out
