"""Stragglers: which rank makes the others wait.

With synchronous collectives every rank's wall time per step is the same (the fast ranks wait for
the slow one), so that is not what is compared. What is compared is each rank's *own work*: the
time from asking for a micro-batch until its forward pass has finished, summed over the step's
micro-batches. In the plain data-parallel engine this span contains no collective (the gradients
are reduced in backward/step), so it is exactly the work no other rank can speed up or slow down:
its data path and its compute. On CUDA it is measured with CUDA events (device time, including
the time the device sat idle waiting for the host's data), read only at log points, so it adds no
per-step synchronisation; at each log point one all_gather of one number per rank brings the
times to every rank.

A rank is named a straggler when its own work per step is more than --straggler-factor times the
median of the *other* ranks' (so that with two ranks the slow one is compared with the other rank,
not with a midpoint it pulls up itself) and the difference is at least MIN_STEP_SHARE of the step's
wall time (a 2x gap in a millisecond of a 100 ms step costs the job nothing worth a warning).

Not measured under the pipeline engine (its micro-batches and p2p waits are interleaved inside
DeepSpeed's schedule), nor where the forward pass itself holds collectives that wait for peers
(tensor parallelism, ZeRO-3 gathers): there the slow rank's peers share its time.

Test hook: MDS_TEST_SLOW_RANK=RANK:SECONDS makes that rank sleep SECONDS per step in its data path.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from statistics import median

import torch
import torch.distributed as dist

from megatron_ds.env_settings import TEST_SLOW_RANK

MIN_STEP_SHARE = 0.1  # a straggler's excess over the others' median must be >= this share of the step time


def slowdown_for_tests(rank: int, env: Mapping[str, str] | None = None) -> float:
    """Seconds this rank sleeps per step in its data path ($MDS_TEST_SLOW_RANK=RANK:SECONDS; tests only)."""
    slow = TEST_SLOW_RANK.get(env)
    if slow is None:
        return 0.0
    slow_rank, seconds = slow
    return seconds if slow_rank == rank else 0.0


class OwnWork:
    """Sums this rank's own-work spans: from asking for a micro-batch until forward_done().

    Host clock on CPU; CUDA events on GPU (recorded on the current stream, read in take()).
    Disabled (one rank, the pipeline engine, --straggler-factor 0): nothing is recorded."""

    def __init__(self, device: torch.device, *, enabled: bool, slowdown: float = 0.0):
        self.cuda, self.enabled, self.slowdown = device.type == "cuda", enabled, slowdown
        self.spans: list = []  # (start, end): perf_counter floats or CUDA event pairs
        self.start = None

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def batches(self, batches: Iterable) -> Iterator:
        """`batches`, each fetch opening a span; the test hook sleeps once per step, inside the first span."""
        for index, batch in enumerate(batches if not self.enabled else self._fetching(batches)):
            if index == 0 and self.slowdown:
                time.sleep(self.slowdown)
            yield batch

    def _fetching(self, batches: Iterable) -> Iterator:
        iterator = iter(batches)
        while True:
            self.start = self._mark()
            try:
                batch = next(iterator)
            except StopIteration:
                self.start = None
                return
            yield batch

    def forward_done(self) -> None:
        """The current micro-batch's forward pass is issued: close its span."""
        if self.start is not None:
            self.spans.append((self.start, self._mark()))
            self.start = None

    def take(self) -> float:
        """Seconds of own work since the last take (on CUDA this waits for the last span's end event)."""
        spans, self.spans = self.spans, []
        if not spans:
            return 0.0
        if self.cuda:
            spans[-1][1].synchronize()
            return sum(start.elapsed_time(end) for start, end in spans) / 1000.0
        return sum(end - start for start, end in spans)


def gather(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's values, in rank order: one all_gather of a few numbers per rank (collective: all ranks call
    it)."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [t.tolist() for t in everyone]


@dataclass(frozen=True)
class RankTimes:
    """Each rank's own work per step (seconds, index = rank) over one log interval."""

    times: list[float]

    @property
    def slowest(self) -> int:
        return max(range(len(self.times)), key=lambda rank: self.times[rank])

    @property
    def median_of_others(self) -> float:
        others = [t for rank, t in enumerate(self.times) if rank != self.slowest]
        return median(others) if others else self.times[0]

    def straggler(self, factor: float, step_time: float) -> int | None:
        """The slowest rank when it is more than `factor` x the others' median and the gap matters, else None."""
        if len(self.times) < 2 or not factor:
            return None
        slowest, others = self.times[self.slowest], self.median_of_others
        if slowest > factor * others and slowest - others >= MIN_STEP_SHARE * step_time:
            return self.slowest
        return None
