"""The start-up line's account of compiling: each compiled function's first call per input shape, timed once."""

from __future__ import annotations

import torch

from megatron_ds import compile_costs


def test_first_call_per_shape_is_timed_once_and_summarised_in_order():
    compile_costs.reset()
    calls = []

    def double(x):
        calls.append(tuple(x.shape))
        return 2 * x

    step = compile_costs.FirstCallTimer("flat AdamW step", double)
    kernel = compile_costs.FirstCallTimer("cross entropy", double)
    for _ in range(3):
        step(torch.ones(4))
    step(torch.ones(2))  # another parameter group's size: compiled again
    kernel(torch.ones(3))
    assert calls == [(4,), (4,), (4,), (2,), (3,)]  # every call still runs
    assert [len(compile_costs._seconds[w]) for w in ("flat AdamW step", "cross entropy")] == [2, 1]
    text = compile_costs.summary()
    assert text.startswith("flat AdamW step (2 shapes) ") and ", cross entropy " in text, text
    assert "(1 kernels)" not in text
    assert compile_costs.total_seconds() >= 0
    compile_costs.reset()
    assert compile_costs.summary() == ""
