"""Benchmark `entrypoint preprocess`: text MB/s per worker, and the speed-up of 2 workers over 1.

    python bench/bench_preprocess.py [--mb 32] [--vocab-size 50257] [--workers 1 2] [--name NAME]

The input is the standard library's .py sources as JSON lines (sorted paths, cycled up to --mb MB);
the tokenizer a GPT-2-sized byte-level BPE (--vocab-size, default 50257) trained on the first 8 MB of
them with `tokenizers`, or GPT-2's own files via --vocab-file/--merge-file. Each worker count runs the
real CLI in a fresh process (`python -m entrypoint preprocess ... --append-eod`); MB/s is input bytes
over the command's wall time (start-up included), over its own tokenizing loop (as it prints), and
per CPU-second of the command and its workers (what one worker does on a core of its own: the figure
that does not depend on other load on a shared machine).
Each worker count runs --repeat times, interleaved; the speed-up target is judged on the medians, the
fastest runs are recorded beside them (other load on a
shared machine only ever slows a run down). The outputs of all runs must be byte-identical.
Writes bench/results/<name>.json with the command, machine, load average and date. Targets (issue 2): >= 5 MB/s per
worker, 2 workers >= 1.6x.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and `megatron_ds` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, environment, write_record


def stdlib_sources() -> list[str]:
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        paths += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    texts = []
    for path in sorted(paths):
        try:
            texts.append(Path(path).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            pass
    return texts


def write_input(path: Path, texts: list[str], megabytes: float) -> int:
    written, limit = 0, int(megabytes * 1e6)
    with open(path, "w", encoding="utf-8") as f:
        while written < limit:
            for text in texts:
                line = json.dumps({"text": text}) + "\n"
                f.write(line)
                written += len(line.encode("utf-8"))
                if written >= limit:
                    break
    return written


def tokenizer_only(src: Path, vocab: str, merges: str, limit: int = 4_000_000) -> tuple[float, str]:
    """MB per CPU-second of the tokenizer by itself on the first ``limit`` bytes (the ceiling for a worker), and
    its backend (tiktoken or tokenizers)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from megatron_ds.data.tokenizers import build_tokenizer

    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    texts, size = [], 0
    with open(src, "rb") as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            size += len(line)
            if size >= limit:
                break
    tok.tokenize_batch(texts[:20])
    start = time.process_time()
    tok.tokenize_batch(texts)
    return size / 1e6 / (time.process_time() - start), tok.backend


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_preprocess", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=32.0, help="input size in MB of JSON lines")
    p.add_argument("--vocab-size", type=int, default=50257, help="size of the BPE trained for the benchmark")
    p.add_argument("--vocab-file", help="use these GPT-2 files instead of training a BPE")
    p.add_argument("--merge-file")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeat", type=int, default=3,
                   help="runs per worker count, interleaved; the fastest counts (the machine may be shared)")
    p.add_argument("--work-dir", type=Path, default=REPO / "data" / "bench-preprocess")
    p.add_argument("--name", default="preprocess_cpu")
    args = p.parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)

    texts = stdlib_sources()
    src = args.work_dir / f"stdlib_{args.mb:g}mb.jsonl"
    size = src.stat().st_size if src.exists() else write_input(src, texts, args.mb)
    if args.vocab_file:
        vocab, merges = args.vocab_file, args.merge_file
    else:
        from megatron_ds.data.demo_corpus import train_bpe

        bpe_dir = args.work_dir / f"bpe{args.vocab_size}"
        vocab, merges = str(bpe_dir / "vocab.json"), str(bpe_dir / "merges.txt")
        if not os.path.exists(merges):
            bpe_dir.mkdir(exist_ok=True)
            budget, subset = 8_000_000, []
            for t in texts:
                subset.append(t)
                budget -= len(t)
                if budget <= 0:
                    break
            train_bpe(subset, str(bpe_dir), vocab_size=args.vocab_size)

    runs, outputs = [], {}
    for attempt, workers in [(a, w) for a in range(args.repeat) for w in args.workers]:  # interleaved
        prefix = args.work_dir / f"out_w{workers}"
        cmd = [sys.executable, "-m", "entrypoint", "preprocess", "--input", str(src), "--output-prefix", str(prefix),
               "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
               "--append-eod", "--workers", str(workers), "--no-progress"]
        load_before = os.getloadavg()
        cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        wall = time.perf_counter() - start
        cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the command and its (reaped) workers
        cpu_s = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
        if r.returncode != 0:
            print(r.stderr, file=sys.stderr)
            return 1
        loop = float(re.search(r"\(([\d.]+) MB/s", r.stdout).group(1))
        tokens = int(re.search(r"documents, (\d+) tokens", r.stdout).group(1))
        run = {"attempt": attempt, "workers": workers, "command": " ".join(cmd), "wall_s": round(wall, 3),
               "mb_per_s_wall": round(size / 1e6 / wall, 3), "mb_per_s_loop": loop,
               "mb_per_s_per_worker_wall": round(size / 1e6 / wall / workers, 3), "tokens": tokens,
               "tokens_per_s_wall": round(tokens / wall), "cpu_s": round(cpu_s, 3),
               "mb_per_cpu_s": round(size / 1e6 / cpu_s, 3), "loadavg_before": load_before,
               "loadavg_after": os.getloadavg()}
        runs.append(run)
        outputs[(attempt, workers)] = [(prefix.parent / f"{prefix.name}_text_document{ext}").read_bytes()
                                       for ext in (".bin", ".idx")]
        print(f"run {attempt}, workers={workers}: {run['wall_s']:.2f} s, {run['mb_per_s_wall']:.2f} MB/s wall "
              f"({run['mb_per_s_loop']:.2f} MB/s in the loop), {run['tokens_per_s_wall']:,} tokens/s, "
              f"{run['mb_per_cpu_s']:.2f} MB per CPU-second, "
              f"load {load_before[0]:.1f}")
    ceiling, backend = tokenizer_only(src, vocab, merges)
    print(f"the tokenizer alone ({backend}, one thread, no pipeline): {ceiling:.2f} MB per CPU-second")
    identical = all(o == outputs[(0, args.workers[0])] for o in outputs.values())
    by_workers = {w: min((r for r in runs if r["workers"] == w), key=lambda r: r["wall_s"]) for w in args.workers}
    speedup = (by_workers[1]["wall_s"] / by_workers[2]["wall_s"]) if 1 in by_workers and 2 in by_workers else None
    median_wall = {w: statistics.median(r["wall_s"] for r in runs if r["workers"] == w) for w in args.workers}
    median_speedup = median_wall[1] / median_wall[2] if 1 in median_wall and 2 in median_wall else None
    record = {
        "kind": "preprocess", "name": args.name, "command": " ".join([sys.executable, *sys.argv]),
        "machine": {"cpu": cpu_model(), "cpus": os.cpu_count()}, **environment(),
        "input": {"path": str(src), "bytes": size, "documents_source": "stdlib .py sources, sorted, cycled"},
        "tokenizer": {"vocab_file": vocab, "merge_file": merges, "vocab_size": args.vocab_size},
        "tokenizer_backend": backend, "tokenizer_only_mb_per_cpu_s": round(ceiling, 3), "runs": runs,
        "best": list(by_workers.values()), "outputs_identical": identical,
        "speedup_2_over_1": round(speedup, 3) if speedup else None,
        "median_wall_s": median_wall, "median_speedup_2_over_1": round(median_speedup, 3) if median_speedup else None,
        "targets": {"mb_per_s_per_worker": 5.0, "speedup_2_over_1": 1.6},
    }
    record["meets_targets"] = bool(identical and all(r["mb_per_s_per_worker_wall"] >= 5.0 for r in by_workers.values())
                                   and (median_speedup is None or median_speedup >= 1.6))
    path = write_record(record, REPO / "bench" / "results", args.name)
    print(f"outputs identical: {identical}; speed-up 2 over 1: {speedup and round(speedup, 2)} fastest runs, "
          f"{median_speedup and round(median_speedup, 2)} medians; "
          f"meets targets: {record['meets_targets']}; wrote {path}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
