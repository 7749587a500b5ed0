"""Time `entrypoint convert --reshard` on the CPU for a GPT-3-sized model, as a user meets it.

    python bench/reshard_timing.py --name reshard_gpt1_3b_cpu --preset GPT1_3B --from-tp 2 --to-tp 1

Three commands, each run with the GPU hidden (CUDA_VISIBLE_DEVICES=""): the source checkpoint (fp32,
ZeRO-1, one iteration at a short sequence so that Adam state exists), the reshard (timed: wall clock,
its own gather/merge/scatter split, and the peak resident memory of the whole process tree, sampled every
0.5 s), and one more iteration at the target layout from the rewritten checkpoint (the check that it
resumes). The record goes to bench/results/<name>.json with the commands, the machine and the commit.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_train import GPT2_VOCAB, RESULTS, synthetic_dataset
from bench.common import environment, write_record


def tree_rss_bytes(root: int) -> int:
    """Resident memory of `root` and all its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry))
            rss[int(entry)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo.extend(children.get(pid, []))
    return total


def timed(argv: list[str], env: dict, log: Path) -> dict:
    """Run one command to the end; wall seconds, peak tree RSS, exit code and its output's tail."""
    print("+", " ".join(argv), flush=True)
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, tree_rss_bytes(proc.pid))
            time.sleep(0.5)
    wall = time.monotonic() - start
    text = log.read_text(errors="replace")
    print(f"  -> rc {proc.returncode} in {wall:.1f} s, tree peak RSS {peak / 2**30:.1f} GiB", flush=True)
    return {"command": " ".join(argv), "exit_code": proc.returncode, "wall_s": round(wall, 1),
            "tree_peak_rss_gib": round(peak / 2**30, 1), "log_tail": text[-3000:]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", required=True)
    p.add_argument("--preset", default="GPT1_3B")
    p.add_argument("--from-tp", type=int, default=2)
    p.add_argument("--to-tp", type=int, default=1)
    p.add_argument("--seq-length", type=int, default=128,
                   help="of the one source iteration (shapes do not depend on it)")
    p.add_argument("--work-dir", type=Path, default=Path(os.environ.get("MDS_BENCH_WORK", "/tmp/mds_bench")))
    p.add_argument("--machine", default="", help="words for the record (cores, memory, what else ran)")
    args = p.parse_args()

    work = args.work_dir / args.name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    data = synthetic_dataset(args.work_dir / "synthetic_gpt2vocab_2M", 2_000_000)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    entry = [sys.executable, "-m", "entrypoint"]
    model = ["--preset", args.preset, "--seq-length", str(args.seq_length), "--max-position-embeddings", "2048",
             "--data-path", str(data), "--tokenizer-type", "NullTokenizer", "--vocab-size", str(GPT2_VOCAB),
             "--split", "100,0,0", "--micro-batch-size", "1", "--global-batch-size", "1", "--lr", "1e-4",
             "--eval-iters", "0", "--zero-stage", "1", "--log-interval", "1"]
    src, dst = work / "src", work / "dst"
    record = {"kind": "convert_timing", "name": args.name, "environment": environment(),
              "machine": args.machine or f"{os.cpu_count()} CPU cores (GPU hidden)"}
    record["source"] = timed(entry + ["train", *model, "--train-iters", "1", "--tensor-model-parallel-size",
                                      str(args.from_tp), "--save", str(src), "--nproc-per-node", str(args.from_tp)],
                             env, work / "source.log")
    if record["source"]["exit_code"] == 0:
        record["checkpoint_gb"] = round(sum(f.stat().st_size for f in src.rglob("*") if f.is_file()) / 1e9, 1)
        record["reshard"] = timed(entry + ["convert", "--reshard", "--load", str(src), "--to", str(dst),
                                           "--tensor-model-parallel-size", str(args.to_tp), "--zero-stage", "1"],
                                  env, work / "reshard.log")
        phases = re.search(r"gather ([\d.]+)s, merge ([\d.]+)s, scatter ([\d.]+)s", record["reshard"]["log_tail"])
        if phases:
            record["reshard"]["phases_s"] = dict(zip(("gather", "merge", "scatter"), map(float, phases.groups())))
        if record["reshard"]["exit_code"] == 0:
            record["resume"] = timed(entry + ["train", *model, "--train-iters", "2", "--tensor-model-parallel-size",
                                              str(args.to_tp), "--load", str(dst),
                                              "--use-checkpoint-opt_param-scheduler",
                                              "--nproc-per-node",
                                              str(args.to_tp)], env, work / "resume.log")
    path = write_record(record, RESULTS, args.name)
    print(f"wrote {path}")
    shutil.rmtree(work, ignore_errors=True)
    ok = all(record.get(k, {}).get("exit_code") == 0 for k in ("source", "reshard", "resume"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
