"""Where a training step's time goes: the real model and DeepSpeed engine, random tokens, torch.profiler.

    python bench/profile_train.py --steps 12 --variant cudnn --out /tmp/prof.txt -- \\
        --preset GPT1_3B --micro-batch-size 8 --bf16 --zero-stage 1

Builds exactly what `entrypoint train` builds for those flags (parse_args/validate, init_parallel,
build_engine) in one process, times --steps steps with CUDA sync (median after 3 warm-up steps), then
profiles two steps and writes the top kernels/ops table. A --variant changes one thing, to measure a fix
before anyone writes it: "cudnn" (SDPA prefers the cuDNN attention kernel), "compile" (torch.compile of
each transformer layer; without it the layers run eager, whatever the CUDA default), "nodrop" (dropout off),
"autocast" (fp32 weights, no DeepSpeed bf16 wrapper, the
step under torch.autocast(bf16): what nanoGPT-style training does), "igu" (DeepSpeed's bf16
immediate_grad_update), or combinations joined by "+". Step time is reported twice: the median of
steps synchronised one by one, and the mean over the same number of steps run back to back (one
synchronisation, as training with --log-interval > 1 runs).

Under torchrun it profiles a TP layout (every rank steps on the same batches; rank 0 writes --out; TFLOP/s and
MFU are per GPU), or DeepSpeed-Ulysses (each SP rank steps on its slice of the same sequences):

    torchrun --nproc-per-node 2 bench/profile_train.py --variant compile --out /tmp/tp.txt -- \\
        --preset GPT6_7B --bf16 --micro-batch-size 4 --tensor-model-parallel-size 2 --sequence-parallel
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


# Kernel name -> what it does, first match wins (cuDNN's attention kernels also carry "sm90": attention first).
KERNEL_KINDS = (("attention", ("sdpa", "flash", "fmha", "attention")),
                ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas")),
                ("optimizer", ("multi_tensor_apply", "adam", "_foreach", "lamb")),
                ("communication", ("nccl",)),
                ("fused elementwise (inductor)", ("triton_",)),
                ("copies and fills", ("copy", "memcpy", "memset", "fill", "cat")))


def kernel_time_by_kind(prof, steps: int) -> dict:
    """GPU kernel time per step by kind, and the profiled wall time per step: what the step spends, idle included."""
    from torch.autograd import DeviceType

    spans = []
    for event in prof.events():
        if event.device_type != DeviceType.CUDA or getattr(event, "is_user_annotation", False):
            continue  # a GPU-side annotation (ProcessGroupNCCL's "nccl:all_gather...") spans kernels counted already
        spans.append((event.time_range.start, event.time_range.end, event.name))
    return kernels_summary(spans, steps)


def kernel_time_from_trace(trace: dict, steps: int = 1) -> dict:
    """kernel_time_by_kind for a Chrome trace another trainer wrote (torchtitan's --profiling): the two sides of a
    peers row profiled by one rule."""
    spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e.get("name", ""))
             for e in trace.get("traceEvents", [])
             if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    return kernels_summary(spans, steps) if spans else {}


def kernels_summary(spans: list[tuple[float, float, str]], steps: int, top: int = 25) -> dict:
    """Kernel spans (us) -> ms per step by kind, the heaviest kernels by name, the first-to-last span, idle gaps."""
    kinds: dict[str, float] = {}
    names: dict[str, list] = {}
    for start, end, name in spans:
        kind = next((k for k, keys in KERNEL_KINDS if any(key in name.lower() for key in keys)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + (end - start) / 1e3  # us -> ms
        entry = names.setdefault(name, [0.0, 0])
        entry[0] += (end - start) / 1e3
        entry[1] += 1
    first, last = min(s for s, _, _ in spans), max(e for _, e, _ in spans)
    heaviest = sorted(names.items(), key=lambda kv: -kv[1][0])[:top]
    return {"kernel_ms_per_step": {k: round(v / steps, 1) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "kernels_total_ms_per_step": round(sum(kinds.values()) / steps, 1),
            "first_to_last_kernel_ms_per_step": round((last - first) / 1e3 / steps, 1),
            "top_kernels_ms_per_step": [[round(ms / steps, 2), round(n / steps, 1), name[:120]]
                                        for name, (ms, n) in heaviest],
            **idle_gaps(list(spans), steps)}


def copies_by_caller(prof, steps: int, top: int = 12) -> list:
    """Device-to-device copies and fills per step, by the CPU ops that launched them (the op and three callers):
    a TP step spends ~15 ms in ~900 of them, and the kernel table cannot say whose they are."""
    callers: dict[str, list[float]] = {}
    for event in prof.events():
        copies = [k for k in getattr(event, "kernels", []) if "memcpy" in k.name.lower() or "memset" in k.name.lower()]
        if not copies or event.name == "Command Buffer Full":  # a runtime marker the profiler links to every kernel
            continue
        chain, parent = [event.name], event.cpu_parent
        while parent is not None and len(chain) < 4:
            chain.append(parent.name)
            parent = parent.cpu_parent
        entry = callers.setdefault(" < ".join(chain), [0.0, 0])
        entry[0] += sum(k.duration for k in copies) / 1e3  # us -> ms
        entry[1] += len(copies)
    ranked = sorted(callers.items(), key=lambda kv: -kv[1][0])[:top]
    return [[round(ms / steps, 2), round(n / steps, 1), chain] for chain, (ms, n) in ranked]


def idle_gaps(spans: list[tuple[float, float, str]], steps: int, top: int = 12) -> dict:
    """Where the GPU sits idle between kernels (us spans): the total per step, split into the gaps under 20 us
    (launch latency between queued kernels) and the longer ones (the GPU waited for the host), and the longest
    gaps with the kernels on either side."""
    spans.sort()
    gaps, busy_until, previous = [], None, ""
    for start, end, name in spans:
        if busy_until is not None and start > busy_until:
            gaps.append((start - busy_until, previous[:70], name[:70]))
        if busy_until is None or end >= busy_until:
            busy_until, previous = end, name
    short = sum(g for g, _, _ in gaps if g < 20)
    long = sum(g for g, _, _ in gaps if g >= 20)
    gaps.sort(reverse=True)
    return {"idle_ms_per_step": round((short + long) / 1e3 / steps, 3),
            "idle_short_gaps_ms_per_step": round(short / 1e3 / steps, 3),
            "idle_long_gaps_ms_per_step": round(long / 1e3 / steps, 3),
            "longest_gaps_us": [[round(g, 1), before, after] for g, before, after in gaps[:top]]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    own, flags = argv[:split], argv[split + 1:]
    p = argparse.ArgumentParser(prog="profile_train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--variant", default="base")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--profile-optimizer-step", action="store_true",
                   help="profile only engine.step() (after an unprofiled forward/backward) and write its Chrome "
                        "trace next to --out: where the optimizer's time goes, idle gaps included")
    p.add_argument("--out", type=Path, help="profiler table (text); a JSON summary goes next to it")
    args = p.parse_args(own)
    variants = set(args.variant.split("+"))

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from bench.bench_train import GPT2_VOCAB
    from bench.in_process import build

    def before_validate(train_args) -> None:
        if "nodrop" in variants:
            train_args.hidden_dropout = train_args.attention_dropout = 0.0
        if "autocast" in variants:
            train_args.bf16 = False
        train_args.torch_compile = "compile" in variants  # the variant decides, not the CUDA default

    def after_validate(train_args) -> dict:
        if "igu" in variants:  # after validate, which reads --deepspeed_config into ds_config_file
            return {"ds_config_file": {**(train_args.ds_config_file or {}), "bf16": {"immediate_grad_update": True}}}
        return {}

    train_args, built = build(flags, before_validate=before_validate, after_validate=after_validate)
    if train_args.pipeline_model_parallel_size > 1:
        raise SystemExit("profile_train steps the engine one micro batch at a time: PP > 1 is not supported")
    if torch.distributed.get_rank() != 0:
        args.out = None  # rank 0 writes
    engine = built.engine
    b, s = train_args.micro_batch_size, train_args.seq_length
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, GPT2_VOCAB, (b, s + 1), generator=g).cuda() for _ in range(4)]
    sp = train_args.ds_sequence_parallel_size
    if sp > 1:  # Ulysses: this rank's slice of each sequence (tokens and labels alike, as training/data.py cuts them)
        from megatron_ds.parallel.state import get_state

        r = get_state().sp_rank
        batches = [x[:, r * s // sp:(r + 1) * s // sp + 1] for x in batches]  # s/sp tokens, their s/sp labels

    def attention_context():
        if "cudnn" in variants:
            return sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH], set_priority=True)
        return contextlib.nullcontext()

    def step(i: int) -> None:
        batch = batches[i % len(batches)]
        autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if "autocast" in variants
                    else contextlib.nullcontext())
        with attention_context(), autocast:
            loss = engine(batch[:, :-1], batch[:, 1:]).mean()
            engine.backward(loss)
        engine.step()

    times = []
    torch.cuda.reset_peak_memory_stats()
    for i in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(i)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times[3:])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(3, args.steps):
        step(i)
    torch.cuda.synchronize()
    unsynced = (time.perf_counter() - t0) / max(1, args.steps - 3)
    phases = {"forward": [], "backward": [], "optimizer_step": []}  # each synchronised: where a step goes
    for i in range(3, args.steps):
        batch = batches[i % len(batches)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with attention_context():
            loss = engine(batch[:, :-1], batch[:, 1:]).mean()
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            engine.backward(loss)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        for key, value in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
            phases[key].append(value)
    world = train_args.world_size
    tokens = b * s * train_args.data_parallel_size  # every replica's micro batch
    fpt = built.config.flops_per_token()
    summary = {"variant": args.variant, "flags": flags, "step_time_s": med, "tokens_per_s": tokens / med,
               "tflops_per_gpu": tokens * fpt / world / med / 1e12, "mfu": tokens * fpt / world / med / 989e12,
               "mem_gib": torch.cuda.max_memory_allocated() / 2**30, "flops_per_token": fpt,
               "attention_backend": built.attention_backend, "step_time_unsynced_s": unsynced,
               "mfu_unsynced": tokens * fpt / world / unsynced / 989e12,
               "phases_s": {k: statistics.median(v) for k, v in phases.items()}, "times": times,
               "phases_per_step_s": {k: [round(x, 4) for x in v] for k, v in phases.items()}}
    print("[profile] " + json.dumps({k: v for k, v in summary.items() if k not in ("times", "phases_per_step_s")}),
          flush=True)
    if args.profile_optimizer_step:
        from torch.profiler import ProfilerActivity, profile

        for i in range(2):  # the second is the one kept: caches and allocator warm
            batch = batches[i % len(batches)]
            with attention_context():
                engine.backward(engine(batch[:, :-1], batch[:, 1:]).mean())
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                engine.step()
                torch.cuda.synchronize()
        kernels = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=90)
        ops = prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=90)
        if args.out:
            args.out.with_suffix(".step.txt").write_text(f"by self CUDA time:\n{kernels}\n\nby CPU time:\n{ops}\n")
            prof.export_chrome_trace(str(args.out.with_suffix(".step_trace.json")))
        print(kernels[:4000], flush=True)
    if not args.no_profile:
        from torch.profiler import ProfilerActivity, profile

        profiled_steps = 2
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(profiled_steps):
                step(i)
            torch.cuda.synchronize()
        try:
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=70)
        except (AttributeError, KeyError, ValueError):
            table = prof.key_averages().table(sort_by="device_time_total", row_limit=45, max_name_column_width=70)
        summary["by_kind"] = kernel_time_by_kind(prof, profiled_steps)
        summary["copies_by_caller"] = copies_by_caller(prof, profiled_steps)  # [ms per step, count per step, ops]
        print("[profile] by kind " + json.dumps(summary["by_kind"]), flush=True)
        if args.out:
            args.out.write_text(f"{json.dumps(summary)}\n\n{table}\n")
        kernels = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=90)
        if args.out:
            with args.out.open("a") as f:
                f.write(f"\nby self CUDA time (kernels):\n{kernels}\n")
        print(table[:6000], flush=True)
    if args.out:
        args.out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    from megatron_ds.training.cli import leave_rank

    leave_rank(main())  # as `entrypoint train` ends a rank: gloo's threads can abort the interpreter's teardown
