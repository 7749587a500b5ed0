"""One node's behaviour at size: an in-job restart, and two node launchers presented as two nodes.

    python bench/node.py restart --name node_restart_gpt6_7b_tp2 --steps 8 --kill-at 7 --save-interval 5 -- \\
        --preset GPT6_7B --bf16 --micro-batch-size 4 --global-batch-size 16 --zero-stage 1 --nproc-per-node 2 \\
        --tensor-model-parallel-size 2 --sequence-parallel
    python bench/node.py two-nodes --name two_nodes_gpt1_3b_tp2 -- --preset GPT1_3B --bf16 \\
        --micro-batch-size 8 --global-batch-size 16 --tensor-model-parallel-size 2 --zero-stage 1

restart: two uninterrupted runs first (their largest relative loss difference is the bound a resumed run is held
to), then the run with --save/--load in --checkpoint-dir (a tmpfs such as /dev/shm by default: the disk's speed is
not the question), a checkpoint every --save-interval steps and --max-restarts 1; when iteration --kill-at is
logged, rank --kill-rank is SIGKILLed (its pid from the supervisor's progress files). ``restart_s``: from the kill
to the resumed run's first logged iteration (the one after the checkpoint). The harness stops each run once its
last step is logged.

two-nodes: the GPUs of the machine are split between two launchers (CUDA_VISIBLE_DEVICES), each spawning its half
(--nproc-per-node) with the variables a task of `srun -N2 --ntasks-per-node=1` sees (SLURM_NODEID 0 and 1, one
master), so the multi-node rendezvous, global ranks and groups are the real ones; against one launcher of all the
GPUs, the same flags. The record holds both loss curves, their largest relative difference and both tokens/s.

fits: one run with a site script's variables (`python bench/node.py fits --name alcf_gpt25b MODEL_SIZE_KEY=GPT25B
SEQ_LEN=4096 ... -- --bf16 --nproc-per-node 4`): trained (its MFU), or refused before any GPU work (exit 2).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_train import GPT2_VOCAB, synthetic_dataset, train_command
from bench.common import REPO, environment, write_record


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if '"lm_loss"' in line]


def _rank_pid(tmp: Path, rank: int) -> int | None:
    for directory in tmp.glob("mds-watchdog-*"):
        try:
            return json.loads((directory / f"rank{rank}.progress").read_bytes())["pid"]
        except (OSError, ValueError, KeyError):
            return None
    return None


def _run(cmd: list[str], work: Path, env: dict, last_step: int, timeout: float, kill_at: int | None = None,
         kill_rank: int = 1) -> dict:
    """Run until `last_step` is logged (then stop the job); with kill_at, SIGKILL one rank there."""
    work.mkdir(parents=True, exist_ok=True)
    metrics = Path(cmd[cmd.index("--metrics-file") + 1])
    metrics.unlink(missing_ok=True)
    log = open(work / "log.txt", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, env={**env, "TMPDIR": str(work)}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    start = time.monotonic()
    killed_at = resumed_at = None
    resumed_iteration = None
    try:
        while time.monotonic() - start < timeout and proc.poll() is None:
            records = _records(metrics)
            if kill_at is not None and killed_at is None and records and records[-1]["iteration"] >= kill_at:
                pid = _rank_pid(work, kill_rank)
                if pid:
                    os.kill(pid, signal.SIGKILL)
                    killed_at = time.monotonic()
            if killed_at is not None and resumed_at is None:
                later = [r for r in records[kill_at:] if r["iteration"] <= kill_at]  # logged again after the kill
                if later:
                    resumed_at, resumed_iteration = time.monotonic(), later[0]["iteration"]
            if records and records[-1]["iteration"] >= last_step and (kill_at is None or resumed_at is not None):
                break
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
    return {"records": _records(metrics), "wall_s": round(time.monotonic() - start, 1),
            "restart_s": round(resumed_at - killed_at, 1) if resumed_at else None,
            "first_resumed_iteration": resumed_iteration, "killed": killed_at is not None,
            "log_tail": (work / "log.txt").read_text()[-3000:]}


def _losses_by_iteration(records: list[dict]) -> dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in records}  # a repeated iteration: the resumed run's value


def _worst(a: dict[int, float], b: dict[int, float], steps) -> float | None:
    common = [i for i in steps if i in a and i in b]
    return max((abs(a[i] - b[i]) / abs(b[i]) for i in common), default=None) if common else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_env(node: int, gpus: list[str], port: int) -> dict[str, str]:
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(node), "SLURM_NTASKS": "2",
            "SLURM_LOCALID": "0", "SLURM_NODEID": str(node), "SLURM_STEP_NUM_NODES": "2",
            "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_STEP_NODELIST": "localhost,localhost",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "CUDA_VISIBLE_DEVICES": ",".join(gpus)}


def restart(argv: list[str]) -> int:
    """SIGKILL one rank mid-run under --max-restarts 1 and time the way back (module docstring)."""
    parser = argparse.ArgumentParser(prog="bench/node.py restart")
    parser.add_argument("--name", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--kill-at", type=int, default=7)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--save-interval", type=int, default=5)
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("/dev/shm") if Path("/dev/shm").is_dir()
                        else Path(tempfile.gettempdir()))
    parser.add_argument("--timeout", type=float, default=400)
    parser.add_argument("--data-prefix", type=Path, default=None, help="an indexed dataset (default: synthetic)")
    parser.add_argument("--work-dir", type=Path, default=Path(os.environ.get("MDS_BENCH_WORK", "/tmp/mds_bench")))
    parser.add_argument("--results-dir", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("flags", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    flags = [f for f in args.flags if f != "--"]
    work = args.work_dir / args.name
    data = args.data_prefix
    if data is None and "--data-path" not in flags:
        data = synthetic_dataset(args.work_dir / "synthetic_gpt2vocab_8M", 8_000_000, GPT2_VOCAB)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    ckpt = args.checkpoint_dir / f"mds_restart_{args.name}"
    shutil.rmtree(ckpt, ignore_errors=True)

    def command(kind: str, extra: list[str]) -> list[str]:
        return train_command([*flags, *extra], steps=args.steps, metrics_file=work / kind / "metrics.jsonl",
                             data_prefix=data)

    runs = {}
    for kind in ("uninterrupted_1", "uninterrupted_2"):
        runs[kind] = _run(command(kind, []), work / kind, env, args.steps, args.timeout)
    restart_flags = ["--save", str(ckpt), "--load", str(ckpt), "--save-interval", str(args.save_interval),
                     "--max-restarts", "1"]
    try:
        runs["restarted"] = _run(command("restarted", restart_flags), work / "restarted", env, args.steps,
                                 args.timeout, kill_at=args.kill_at, kill_rank=args.kill_rank)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    first, second = (_losses_by_iteration(runs[k]["records"]) for k in ("uninterrupted_1", "uninterrupted_2"))
    restarted = runs["restarted"]
    resumed_from = restarted["first_resumed_iteration"]
    after = range(resumed_from or args.steps + 1, args.steps + 1)
    resumed = {r["iteration"]: r["lm_loss"] for r in restarted["records"][args.kill_at:]}
    bound = _worst(second, first, range(1, args.steps + 1))
    worst = _worst(resumed, first, after)
    ok = (restarted["restart_s"] is not None and worst is not None and bound is not None and worst <= bound
          and all(i in resumed for i in after))
    record = {"kind": "node_restart", "name": args.name, "status": "ok" if ok else "failed", "flags": flags,
              "steps": args.steps, "kill_at": args.kill_at, "kill_rank": args.kill_rank,
              "save_interval": args.save_interval, "restart_s": restarted["restart_s"],
              "first_resumed_iteration": resumed_from, "max_rel_loss_diff_resumed": worst,
              "bound_two_uninterrupted_runs": bound,
              "losses": {k: _losses_by_iteration(r["records"]) for k, r in runs.items()},
              "runs": {k: {"wall_s": r["wall_s"], "killed": r["killed"], "log_tail": r["log_tail"]}
                       for k, r in runs.items()},
              "commands": {k: command(k, restart_flags if k == "restarted" else []) for k in runs},
              "environment": environment()}
    path = write_record(record, args.results_dir, args.name)
    print(f"[node_restart] {args.name}: {record['status']}; iteration {resumed_from} logged again "
          f"{restarted['restart_s']} s after the kill; resumed losses within {worst} of the uninterrupted run "
          f"(two uninterrupted runs differ by {bound}) -> {path}", flush=True)
    return 0 if ok else 1



def two_nodes(argv: list[str]) -> int:
    """Two node launchers as a 2-node Slurm step against one launcher of all the GPUs (module docstring)."""
    parser = argparse.ArgumentParser(prog="bench/node.py two-nodes")
    parser.add_argument("--name", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible, an even number)")
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--work-dir", type=Path, default=Path(os.environ.get("MDS_BENCH_WORK", "/tmp/mds_bench")))
    parser.add_argument("--results-dir", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("flags", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    flags = [f for f in args.flags if f != "--"]
    import torch

    gpus = [str(i) for i in range(args.gpus or torch.cuda.device_count())]
    half = len(gpus) // 2
    if half == 0 or len(gpus) % 2:
        print(f"two-nodes: needs an even number of GPUs (2 or more), found {len(gpus)}; the CPU twin of this "
              "check is tests/training/test_two_nodes.py", file=sys.stderr)
        return 2
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



def fits(argv: list[str]) -> int:
    """One `entrypoint train` with the variables a site script sets (KEY=VALUE before `--`): does it train, or is
    it refused before any GPU work (exit 2, nothing spawned) naming what it needs and a layout that fits?"""
    parser = argparse.ArgumentParser(prog="bench/node.py fits")
    parser.add_argument("--name", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--work-dir", type=Path, default=Path(os.environ.get("MDS_BENCH_WORK", "/tmp/mds_bench")))
    parser.add_argument("--results-dir", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="KEY=VALUE ... -- train flags")
    args = parser.parse_args(argv)
    split = args.rest.index("--") if "--" in args.rest else len(args.rest)
    variables = dict(v.split("=", 1) for v in args.rest[:split])
    flags = args.rest[split + 1:]
    work = args.work_dir / args.name
    work.mkdir(parents=True, exist_ok=True)
    data = synthetic_dataset(args.work_dir / "synthetic_gpt2vocab_8M", 8_000_000, GPT2_VOCAB)
    cmd = train_command(flags, steps=args.steps, metrics_file=work / "metrics.jsonl", data_prefix=data)
    (work / "metrics.jsonl").unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env.update(variables, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p))
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    steps = _records(work / "metrics.jsonl")
    refused = done.returncode == 2 and "spawning" not in done.stderr and not steps
    record = {"kind": "node_fits", "name": args.name, "variables": variables, "command": cmd,
              "exit_code": done.returncode, "seconds_to_exit": round(time.monotonic() - start, 1),
              "refused_before_gpu_work": refused, "trained_steps": len(steps),
              "mfu": sorted(r["mfu"] for r in steps[1:])[len(steps[1:]) // 2] if len(steps) > 1 else None,
              "stderr_tail": done.stderr[-2500:], "stdout_tail": done.stdout[-1500:], "environment": environment()}
    record["status"] = "ok" if refused or (done.returncode == 0 and steps) else "failed"
    path = write_record(record, args.results_dir, args.name)
    print(f"[fits] {args.name}: exit {done.returncode} after {record['seconds_to_exit']} s, "
          f"{'refused before any GPU work' if refused else f'{len(steps)} steps'} -> {path}\n"
          f"{done.stderr[-1200:]}", flush=True)
    return 0 if record["status"] == "ok" else 1


def main() -> int:
    commands = {"restart": restart, "two-nodes": two_nodes, "fits": fits}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        print(__doc__, file=sys.stderr)
        return 2
    return commands[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
