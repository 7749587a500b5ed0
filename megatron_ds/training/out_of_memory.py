"""What a rank says when its GPU runs out of memory: the numbers, and the flags that lower the peak.

torch's OutOfMemoryError names the allocation that failed, not what to change, and users meet it on the first
run of a new size. The message ends the rank's output (after the traceback), so it is the line they read.
"""

from __future__ import annotations

from megatron_ds.arguments.settings import Settings
from megatron_ds.parallel.pipeline_split import even_split

GIB = 1 << 30


def device_memory(device_index: int) -> dict[str, int]:
    """The numbers the message needs, read from torch's caching allocator (bytes)."""
    import torch

    return {"total": torch.cuda.get_device_properties(device_index).total_memory,
            "peak": torch.cuda.max_memory_allocated(device_index),
            "allocated": torch.cuda.memory_allocated(device_index),
            "reserved": torch.cuda.memory_reserved(device_index)}


def levers(settings: Settings, stage_layers: list[int] | None = None) -> list[str]:
    """The flags that lower this run's peak, cheapest first (those it does not use yet). ``stage_layers``: the
    built pipeline's layers per stage (None before it was built, or without PP)."""
    layout, zero_stage = settings.layout, settings.optimizer.zero_stage
    out = []
    if layout.micro_batch_size > 1:
        out.append(f"a smaller --micro-batch-size (now {layout.micro_batch_size}; the global batch "
                   f"{layout.global_batch_size} stays, through more accumulation steps)")
    if settings.model.recompute_granularity != "full":
        out.append("--checkpoint-activations (each layer recomputed in backward)")
    split = list(stage_layers) if stage_layers else None
    even = even_split(settings.model.num_layers, len(split)) if split else None
    if even and split != even and layout.decoder_last_pipeline_num_layers is None:
        out.append(f"--decoder-last-pipeline-num-layers {even[-1]} (equal layers per stage: the "
                   f"default {' | '.join(map(str, split))} gives the stages before the output head's more)")
    if layout.data_parallel_size > 1 and zero_stage < 3:
        out.append(f"--zero-stage {max(2, zero_stage + 1)} (shards more of the training state over the "
                   f"{layout.data_parallel_size} data-parallel ranks)")
    out.append(f"a larger --tensor-model-parallel-size (now {layout.tensor_model_parallel_size}) or "
               f"--pipeline-model-parallel-size (now {layout.pipeline_model_parallel_size})")
    return out


def message(settings: Settings, err: BaseException, rank: int, device_index: int, memory: dict[str, int],
            alloc_conf: str = "", stage_layers: list[int] | None = None) -> str:
    """One paragraph: where and how far over, torch's own first line, what to change."""
    said = (str(err).strip().splitlines() or [""])[0]
    text = (f"rank {rank} ran out of GPU memory (cuda:{device_index}, {memory['total'] / GIB:.1f} GiB; PyTorch's "
            f"peak {memory['peak'] / GIB:.1f} GiB) at micro batch {settings.layout.micro_batch_size} x sequence "
            f"{settings.model.seq_length}. PyTorch: {said}")
    idle = memory["reserved"] - memory["allocated"]
    if idle >= GIB and "expandable_segments:True" not in alloc_conf:
        text += (f" {idle / GIB:.1f} GiB were reserved but unused (fragmentation): "
                 "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, which mds's CUDA profiles set unless you set "
                 "PYTORCH_CUDA_ALLOC_CONF yourself, lets the allocator use them.")
    return text + " To fit, try " + "; or ".join(levers(settings, stage_layers)) + "."
