"""Two node launchers on one host, presented as a 2-node Slurm step, against one launcher of all the GPUs.

    python bench/two_nodes.py --name two_nodes_gpt1_3b_tp2 -- --preset GPT1_3B --bf16 --micro-batch-size 8 \\
        --global-batch-size 16 --tensor-model-parallel-size 2 --zero-stage 1

The GPUs of the machine are split between the two launchers (CUDA_VISIBLE_DEVICES), each launcher spawns its
half (--nproc-per-node) with the variables a task of `srun -N2 --ntasks-per-node=1` sees (SLURM_NODEID 0 and 1,
one master), so the multi-node rendezvous, global ranks and groups are the real ones. The record holds both loss
curves, their largest relative difference, and both runs' tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_train import GPT2_VOCAB, synthetic_dataset, train_command
from bench.common import REPO, environment, write_record


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_env(node: int, gpus: list[str], port: int) -> dict[str, str]:
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(node), "SLURM_NTASKS": "2",
            "SLURM_LOCALID": "0", "SLURM_NODEID": str(node), "SLURM_STEP_NUM_NODES": "2",
            "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_STEP_NODELIST": "localhost,localhost",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "CUDA_VISIBLE_DEVICES": ",".join(gpus)}


def _records(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if "lm_loss" in r] if path.exists() else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible, an even number)")
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--work-dir", type=Path, default=Path(os.environ.get("MDS_BENCH_WORK", "/tmp/mds_bench")))
    parser.add_argument("--results-dir", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("flags", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    flags = [f for f in args.flags if f != "--"]
    import torch

    gpus = [str(i) for i in range(args.gpus or torch.cuda.device_count())]
    half = len(gpus) // 2
    work = args.work_dir / args.name
    work.mkdir(parents=True, exist_ok=True)
    data = synthetic_dataset(args.work_dir / "synthetic_gpt2vocab_8M", 8_000_000, GPT2_VOCAB)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    runs = {}
    for kind in ("one_launcher", "two_launchers"):
        (work / kind).mkdir(exist_ok=True)
        metrics = [work / kind / f"metrics{n}.jsonl" for n in range(2)]
        for m in metrics:
            m.unlink(missing_ok=True)
        start = time.monotonic()
        if kind == "one_launcher":
            cmds = [(train_command([*flags, "--nproc-per-node", str(len(gpus))], steps=args.steps,
                                   metrics_file=metrics[0], data_prefix=data), {})]
        else:
            port = _free_port()
            cmds = [(train_command([*flags, "--nproc-per-node", str(half)], steps=args.steps, metrics_file=metrics[n],
                                   data_prefix=data), _node_env(n, gpus[n * half:(n + 1) * half], port))
                    for n in range(2)]
        procs = [subprocess.Popen(cmd, cwd=REPO, env={**env, **extra}, stdout=open(work / kind / f"log{n}.txt", "w"),
                                  stderr=subprocess.STDOUT) for n, (cmd, extra) in enumerate(cmds)]
        codes = [p.wait(timeout=args.timeout) for p in procs]
        steps = _records(metrics[0])
        runs[kind] = {"exit_codes": codes, "wall_s": round(time.monotonic() - start, 1),
                      "commands": [c for c, _ in cmds], "node_env": [e for _, e in cmds],
                      "losses": [r["lm_loss"] for r in steps],
                      "tokens_per_s": sorted(r["tokens_per_s"] for r in steps[2:])[len(steps[2:]) // 2]
                      if len(steps) > 2 else None}
        print(f"[two_nodes] {kind}: exit {codes}, losses {runs[kind]['losses']}, tokens/s "
              f"{runs[kind]['tokens_per_s']}", flush=True)
    a, b = runs["one_launcher"]["losses"], runs["two_launchers"]["losses"]
    same = len(a) == len(b) == args.steps
    worst = max((abs(x - y) / abs(y) for x, y in zip(b, a)), default=None) if same else None
    record = {"kind": "two_nodes", "name": args.name, "status": "ok" if same and all(
        c == 0 for r in runs.values() for c in r["exit_codes"]) else "failed", "flags": flags,
        "gpus": len(gpus), "runs": runs, "max_rel_loss_diff": worst, "environment": environment()}
    path = write_record(record, args.results_dir, args.name)
    print(f"[two_nodes] {args.name}: {record['status']}; max relative loss difference {worst} -> {path}", flush=True)
    return 0 if record["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
