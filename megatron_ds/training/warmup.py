"""Compiling the transformer layer on every pipeline stage at once, before the first step.

torch.compile builds the layer graph at its first call. Under pipeline parallelism a stage's first call waits for
the previous stage's first activations, so the stages compiled one after another: GPT-13B PP=4 on 4 x H200 with a
cold cache took 61 s to its first step, four ~12 s compiles in a row. Here each stage calls its first layer once,
forward and backward, on a random input of the real shape (sequence shard, micro batch, hidden; the parameters'
dtype; grad on), so all stages compile side by side and the first step finds the graph built.

Nothing of the run changes: the random streams are restored (dropout draws the same masks as without it) and the
backward asks for the input's gradient only, so no parameter gradient is accumulated. Only pipeline runs do it
(elsewhere there is nothing to overlap) and not under FP8 engines that keep scaling state (Transformer Engine's
amax history would see the random input).
"""

from __future__ import annotations

import time

import torch

from megatron_ds.model.gpt import TransformerLayer


def layer_input_shape(*, seq_length: int, micro_batch: int, hidden: int, tp: int, sequence_parallel: bool,
                      ulysses: int) -> tuple[int, int, int]:
    """[s, b, h] as a transformer layer of this rank receives it: the sequence split over TP under sequence
    parallelism and over the Ulysses ranks."""
    return (seq_length // (tp if sequence_parallel else 1) // max(1, ulysses), micro_batch, hidden)


def compile_stage_layers(module: torch.nn.Module, shape: tuple[int, int, int], device: torch.device) -> float | None:
    """One forward and backward of the first TransformerLayer of ``module`` (this rank's stage) on a random input
    of ``shape``; the seconds it took, or None where the stage has no transformer layer."""
    layer = next((m for m in module.modules() if isinstance(m, TransformerLayer)), None)
    if layer is None:
        return None
    start = time.perf_counter()
    dtype = next(layer.parameters()).dtype
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        x = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
        out = layer(x)
        torch.autograd.grad(out, x, grad_outputs=torch.ones_like(out))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def wanted(*, torch_compile: bool, pipelined: bool, fp8_engine: str | None) -> bool:
    """Where compiling ahead pays and changes nothing: compiled pipeline stages, without stateful FP8 scaling."""
    return torch_compile and pipelined and fp8_engine in (None, "torchao")
