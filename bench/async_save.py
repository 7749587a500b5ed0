"""How long a checkpoint save stops training, synchronous against --async-save, on one GPU, in one call.

    python bench/async_save.py --name async_save_h200 --presets GPT1_3B GPT2_7B [-- more train flags]

Each preset runs in a child process of its own (its GPU memory freed after it): the model and engine that
`entrypoint train` builds (bench/in_process.py; bf16, ZeRO-1, micro batch 4, eager), a few steps, then
  sync:    one synchronous save: the stall is the whole save (writes and fsync of every file);
  async 1: one --async-save save: the stall is the host copy plus pinning the host buffers (the first save only);
  async 2: the next one, buffers reused: the stall of every later save;
after each async save the steps run on while the background writer writes, their median time set against the
steps before (what the writer costs a step), then the end of training waits for it (the write's own time).
Checkpoints go to --save-dir (default: under $MDS_BENCH_WORK, a local disk) and are deleted after each save.
Writes bench/results/<name>.json: per preset, the checkpoint's size, each stall, the write time, the steps, and the
peak host memory (the pinned copies: torch's host allocator rounds each to a power of two).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS, environment, write_record

FLAGS = ["--zero-stage", "1", "--micro-batch-size", "4", "--global-batch-size", "4", "--no-torch-compile"]


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _steps(engine, batches, n: int, until=None) -> list[float]:
    """Times of ``n`` training steps (or, with ``until``, of the steps until it says stop, at least one)."""
    times = []
    while (until is None and len(times) < n) or (until is not None and (not times or not until())):
        batch = batches[len(times) % len(batches)]
        _sync()
        t0 = time.perf_counter()
        loss = engine(batch[:, :-1], batch[:, 1:]).mean()
        engine.backward(loss)
        engine.step()
        _sync()
        times.append(time.perf_counter() - t0)
    return times


def _size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def measure(preset: str, flags: list[str], save_dir: Path, device: str = "cuda") -> dict:
    """One preset in this process: the stall of a synchronous save and of two async saves, and the steps."""
    import torch

    from bench.bench_train import GPT2_VOCAB
    from bench.in_process import build
    from megatron_ds.arguments.settings import replace_args
    from megatron_ds.checkpoint import Checkpointer
    from megatron_ds.training.state import TrainState

    shutil.rmtree(save_dir, ignore_errors=True)
    bf16 = ["--bf16"] if device == "cuda" else []  # the CPU check of this script runs fp32
    args, built = build(["--preset", preset, *FLAGS, *bf16, *flags, "--save", str(save_dir)], device=device)
    engine = built.engine
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, GPT2_VOCAB, (args.micro_batch_size, args.seq_length + 1), generator=g).to(device)
               for _ in range(4)]
    _steps(engine, batches, 3)  # warm up
    row = {"preset": preset, "parameters": sum(p.numel() for p in engine.module.parameters()),
           "step_s": statistics.median(_steps(engine, batches, 5))}
    state = TrainState()
    state.iteration = 1
    t0 = time.perf_counter()
    Checkpointer(engine, args).save(state)
    _sync()
    row["sync_stall_s"] = time.perf_counter() - t0
    row["checkpoint_bytes"] = _size(save_dir / "iter_0000001")
    shutil.rmtree(save_dir / "iter_0000001")

    background = Checkpointer(engine, replace_args(args, async_save=True))
    for label, iteration in (("async_first", 2), ("async", 3)):
        state.iteration = iteration
        t0 = time.perf_counter()
        background.save(state)
        _sync()
        stall = time.perf_counter() - t0
        writing = _steps(engine, batches, 0, until=lambda: not background.background.thread.is_alive())
        t1 = time.perf_counter()
        background.finish()
        row[f"{label}_stall_s"] = stall
        row[f"{label}_write_s"] = time.perf_counter() - t0 - stall  # from the copy's end to `latest` moved
        row[f"{label}_end_wait_s"] = time.perf_counter() - t1
        row[f"{label}_steps_while_writing"] = len(writing)
        row[f"{label}_step_s_while_writing"] = statistics.median(writing)
        shutil.rmtree(save_dir / f"iter_{iteration:07d}")
    row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    row["host_peak_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # the pinned copies count
    shutil.rmtree(save_dir, ignore_errors=True)
    return row


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", required=True, help="record name: bench/results/<name>.json")
    p.add_argument("--presets", nargs="+", default=["GPT1_3B", "GPT2_7B"])
    p.add_argument("--save-dir", type=Path,
                   default=Path(os.environ.get("MDS_BENCH_WORK", "/tmp/mds_bench")) / "async_save")
    p.add_argument("--one", help=argparse.SUPPRESS)  # the child: measure this preset, print its row
    p.add_argument("--timeout", type=float, default=200, help="seconds per preset")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a check of this script only")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    args = p.parse_args(own)
    if args.one:
        print("ROW " + json.dumps(measure(args.one, flags, args.save_dir, args.device)), flush=True)
        return 0
    rows = []
    for preset in args.presets:
        cmd = [sys.executable, __file__, "--name", args.name, "--one", preset, "--save-dir", str(args.save_dir),
               "--device", args.device, "--", *flags]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            out, code = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired as err:
            out, code = f"{err.stdout or ''}{err.stderr or ''}", "timeout"
        found = [line[4:] for line in out.splitlines() if line.startswith("ROW ")]
        row = json.loads(found[-1]) if found else {"preset": preset, "status": "failed", "exit": code,
                                                   "tail": out[-3000:]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    write_record({"kind": "async_save", "environment": environment(), "rows": rows, "flags": ["--bf16", *FLAGS, *flags],
                  "command": [sys.executable] + sys.argv}, args.results_dir, args.name)
    return 0 if all("status" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
