"""How many transformer layers each pipeline stage holds (``--decoder-last-pipeline-num-layers``).

The last stage also runs the output head: the vocabulary GEMM and the loss. For GPT-1.3B that head costs about
1.75 layers of FLOPs, so with equal layer counts the first stage waits for the last one on every micro-batch
(PP=2: 12 layers against 12 + 1.75). By default the last stage holds fewer layers: the split that makes the
slowest stage, counting the head by its FLOPs, as fast as it can be. GPT-1.3B at PP=2 runs 13 | 11 and
GPT-2.7B 17 | 15. GPT-6.7B keeps 16 | 16, since its head costs about one layer.

``--decoder-last-pipeline-num-layers N`` (Megatron-LM's flag) sets the last stage's count by hand. The other
stages share the rest as evenly as possible, and any extra layer goes to a later stage. Under 1F1B the first
stage keeps the most micro-batches in flight, so a layer costs the most activation memory there. Setting the
flag to an equal share (12 for GPT-1.3B at PP=2) gives back the even split, which needs the least memory on
stage 0.
"""

from __future__ import annotations

from megatron_ds.parallel.state import ParallelConfigError

FLAG = "--decoder-last-pipeline-num-layers"


def spread(layers: int, stages: int) -> list[int]:
    """``layers`` over ``stages`` as evenly as possible; the extra layers go to the later stages, which keep fewer
    micro-batches in flight."""
    base, extra = divmod(layers, stages)
    return [base] * (stages - extra) + [base + 1] * extra


def stage_layers(num_layers: int, pp: int, *, last: int | None = None, head_layers: float = 0.0) -> list[int]:
    """Transformer layers per pipeline stage, first to last. ``last``: the flag's value (None: chosen here);
    ``head_layers``: the output head's cost in layers (GPTConfig.head_cost_in_layers). ParallelConfigError
    names the flag a split cannot satisfy."""
    if pp == 1:
        if last is not None:
            raise ParallelConfigError(f"{FLAG} {last} needs --pipeline-model-parallel-size > 1", FLAG)
        return [num_layers]
    if num_layers < pp:
        raise ParallelConfigError(f"--num-layers {num_layers} is fewer than --pipeline-model-parallel-size {pp}: "
                                  "every pipeline stage needs at least one transformer layer", "--num-layers")
    if last is not None:
        if not 1 <= last <= num_layers - (pp - 1):
            raise ParallelConfigError(
                f"{FLAG} {last}: the last stage needs at least one layer and the other {pp - 1} stage(s) at least "
                f"one each, out of --num-layers {num_layers} (so 1 to {num_layers - pp + 1})", FLAG)
        return [*spread(num_layers - last, pp - 1), last]

    def slowest(n: int) -> float:  # the busiest stage's work, in layers, with n layers on the last stage
        return max(max(spread(num_layers - n, pp - 1)), n + head_layers)

    # the fastest split; between equals, the most layers on the last stage (the nearest to the even split)
    best = min(range(1, num_layers - pp + 2), key=lambda n: (slowest(n), -n))
    return [*spread(num_layers - best, pp - 1), best]


def even_split(num_layers: int, pp: int) -> list[int] | None:
    """The split every checkpoint written before the split was recorded used (equal counts), or None where
    those versions refused the layout."""
    return [num_layers // pp] * pp if num_layers % pp == 0 else None
