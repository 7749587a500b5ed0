"""What a rank says when its GPU runs out of memory: the numbers, and the flags that lower the peak.

torch's OutOfMemoryError names the allocation that failed, not what to change, and users meet it on the first
run of a new size. The message ends the rank's output (after the traceback), so it is the line they read.
"""

from __future__ import annotations

from megatron_ds.parallel.pipeline_split import even_split

GIB = 1 << 30


def device_memory(device_index: int) -> dict[str, int]:
    """The numbers the message needs, read from torch's caching allocator (bytes)."""
    import torch

    return {"total": torch.cuda.get_device_properties(device_index).total_memory,
            "peak": torch.cuda.max_memory_allocated(device_index),
            "allocated": torch.cuda.memory_allocated(device_index),
            "reserved": torch.cuda.memory_reserved(device_index)}


def levers(args, stage_layers: list[int] | None = None) -> list[str]:
    """The flags that lower this run's peak, cheapest first (those it does not use yet). ``stage_layers``: the
    built pipeline's layers per stage (None before it was built, or without PP)."""
    out = []
    if args.micro_batch_size > 1:
        out.append(f"a smaller --micro-batch-size (now {args.micro_batch_size}; the global batch "
                   f"{args.global_batch_size} stays, through more accumulation steps)")
    if args.recompute_granularity != "full":
        out.append("--checkpoint-activations (each layer recomputed in backward)")
    split = list(stage_layers) if stage_layers else None
    even = even_split(args.num_layers, len(split)) if split else None
    if even and split != even and args.decoder_last_pipeline_num_layers is None:
        out.append(f"--decoder-last-pipeline-num-layers {even[-1]} (equal layers per stage: the "
                   f"default {' | '.join(map(str, split))} gives the stages before the output head's more)")
    if args.data_parallel_size > 1 and args.zero_stage < 3:
        out.append(f"--zero-stage {max(2, args.zero_stage + 1)} (shards more of the training state over the "
                   f"{args.data_parallel_size} data-parallel ranks)")
    out.append(f"a larger --tensor-model-parallel-size (now {args.tensor_model_parallel_size}) or "
               f"--pipeline-model-parallel-size (now {args.pipeline_model_parallel_size})")
    return out


def message(args, err: BaseException, rank: int, device_index: int, memory: dict[str, int],
            alloc_conf: str = "", stage_layers: list[int] | None = None) -> str:
    """One paragraph: where and how far over, torch's own first line, what to change."""
    said = (str(err).strip().splitlines() or [""])[0]
    text = (f"rank {rank} ran out of GPU memory (cuda:{device_index}, {memory['total'] / GIB:.1f} GiB; PyTorch's "
            f"peak {memory['peak'] / GIB:.1f} GiB) at micro batch {args.micro_batch_size} x sequence "
            f"{args.seq_length}. PyTorch: {said}")
    idle = memory["reserved"] - memory["allocated"]
    if idle >= GIB and "expandable_segments:True" not in alloc_conf:
        text += (f" {idle / GIB:.1f} GiB were reserved but unused (fragmentation): "
                 "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, which mds's CUDA profiles set unless you set "
                 "PYTORCH_CUDA_ALLOC_CONF yourself, lets the allocator use them.")
    return text + " To fit, try " + "; or ".join(levers(args, stage_layers)) + "."
