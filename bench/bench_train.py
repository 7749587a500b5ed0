"""Benchmark `entrypoint train` end to end and record the result (optionally against the HF baseline).

    python bench/bench_train.py --name gpt1_3b_mbs8 --steps 30 --warmup-steps 10 --baseline -- \\
        --preset GPT1_3B --micro-batch-size 8 --bf16 --zero-stage 1

Everything after `--` goes to `entrypoint train` unchanged. The harness adds what a measurement needs:
real data through the real data path (a synthetic Megatron indexed dataset of uniform random tokens,
written once by our IndexedDatasetWriter, GPT-2's vocabulary size via NullTokenizer unless the flags name
--data-path), --train-iters, --log-interval 1 (unless the flags give one: with N > 1 each record averages N
steps and the device is synchronised once per N, as in real training) and --metrics-file. It drops the
records up to iteration --warmup-steps and reports medians of tokens/s, TFLOP/s per GPU, MFU, step time and peak
memory, and writes
bench/results/<name>.json (command, git commit, GPU, torch, DeepSpeed, date, per-step metrics, the console
tail) and refreshes the table in bench/RESULTS.md. With --baseline it then runs
bench/baseline_hf_deepspeed.py on the same shape, batch and ZeRO stage in the same call and reports
ours/baseline. A failed run (e.g. out of memory) is recorded too, with status "failed" and its error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, RESULTS, SUMMARY_KEYS, environment, median_summary, write_record

GPT2_VOCAB = 50256  # NullTokenizer adds EOD -> 50257 ids, padded to 50304 like GPT-2's embedding


def synthetic_dataset(prefix: Path, num_tokens: int, vocab: int = GPT2_VOCAB, seed: int = 0) -> Path:
    """Uniform random documents (lengths 256..4096, each ended by EOD = vocab) as an indexed dataset.

    Random tokens cost the model exactly what real text does; this keeps the benchmark free of downloads.
    Reused when it already holds at least `num_tokens` (callers put the size in the prefix, so the sample
    index caches next to it never outlive their data).
    """
    import numpy as np

    from megatron_ds.data.indexed import IndexedDataset, IndexedDatasetWriter, best_dtype, exists

    if exists(str(prefix)) and int(IndexedDataset(str(prefix)).sizes.sum()) >= num_tokens:
        return prefix
    rng = np.random.default_rng(seed)
    lengths = []
    total = 0
    while total < num_tokens:
        n = int(rng.integers(256, 4097))
        lengths.append(n)
        total += n
    lengths = np.asarray(lengths, dtype=np.int64)
    flat = rng.integers(0, vocab, size=total, dtype=np.int64)
    flat[np.cumsum(lengths) - 1] = vocab  # end of document
    with IndexedDatasetWriter(str(prefix), best_dtype(vocab + 1)) as writer:
        writer.add_documents(flat, lengths)
    return prefix


def _flag_given(flags: list[str], name: str) -> bool:
    return any(f == name or f.startswith(name + "=") for f in flags)


def _train_launcher() -> list[str]:
    """`python -m entrypoint train`; before the command is registered, its module directly (one rank only)."""
    import entrypoint

    if "train" in entrypoint.COMMANDS:
        return [sys.executable, "-m", "entrypoint", "train"]
    return [sys.executable, "-c", "import sys; from megatron_ds.training.cli import main; sys.exit(main(sys.argv[1:]))"]


def train_command(flags: list[str], *, steps: int, metrics_file: Path, data_prefix: Path | None) -> list[str]:
    cmd = [*_train_launcher(), *flags, "--train-iters", str(steps), "--metrics-file", str(metrics_file)]
    # --log-interval N in the flags: each record is an N-step average, timed with one device sync per N steps
    defaults = [("--log-interval", ["--log-interval", "1"]), ("--lr", ["--lr", "1e-4"]),
                ("--eval-iters", ["--eval-iters", "0"]),
                ("--split", ["--split", "100,0,0"])]
    if data_prefix is not None:
        defaults += [("--data-path", ["--data-path", str(data_prefix)]),
                     ("--tokenizer-type", ["--tokenizer-type", "NullTokenizer"]),
                     ("--vocab-size", ["--vocab-size", str(GPT2_VOCAB)])]
    for flag, value in defaults:
        if not _flag_given(flags, flag):
            cmd += value
    return cmd


def resolved_shape(flags: list[str]) -> dict:
    """The model/batch shape the train flags describe (parsed by the train CLI's own parser)."""
    from megatron_ds.arguments import parse_args

    a = parse_args(flags + ["--train-iters", "1"], env={})
    return {"num_layers": a.num_layers, "hidden_size": a.hidden_size, "num_attention_heads": a.num_attention_heads,
            "seq_length": a.seq_length, "micro_batch_size": a.micro_batch_size,
            "global_batch_size": a.global_batch_size, "hidden_dropout": a.hidden_dropout,
            "attention_dropout": a.attention_dropout, "zero_stage": a.zero_stage or 0,
            "nproc_per_node": a.nproc_per_node,
            "checkpoint_activations": bool(a.checkpoint_activations),
            "tensor_model_parallel_size": a.tensor_model_parallel_size,
            "pipeline_model_parallel_size": a.pipeline_model_parallel_size}


FIRST_ITERATION = re.compile(r"^\s*iteration\s+1/")  # the Megatron-style log line of iteration 1


def run_logged(cmd: list[str], log_path: Path, timeout: float, started: dict | None = None) -> tuple[int, str]:
    """Run cmd, teeing its output to the console and log_path; returns (exit code, output tail). ``started``, when
    given, gets ``startup_s``: seconds from the start of cmd to its iteration-1 line (what a user waits for)."""
    tail: list[str] = []
    t0 = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout
        try:
            for line in proc.stdout:
                if started is not None and "startup_s" not in started and FIRST_ITERATION.match(line):
                    started["startup_s"] = round(time.monotonic() - t0, 1)
                log.write(line)
                sys.stdout.write(line)
                tail = (tail + [line])[-40:]
                if time.monotonic() > deadline:
                    proc.kill()
                    tail.append(f"[bench] killed after {timeout:.0f} s\n")
                    break
        finally:
            code = proc.wait()
    return code, "".join(tail)


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "tokens_per_s" in r]  # training lines (eval lines carry val_loss)


def startup_lines(log: str) -> dict:
    """From the start-up log: ``build_s`` (model and engine built in N s), ``startup`` (where the wait before the
    datasets went: launch and imports, process groups, build, data), ``compile`` (what torch.compile built at
    start-up and what each part cost), ``fp8_engine`` and ``torch_compile`` (on/off), None where the run did not
    print them."""
    built = re.search(r"model and engine built in ([0-9.]+) s", log)
    phases = re.search(r"mds train: start-up: (.*)", log)
    compiled = re.search(r"torch\.compile at start-up: (.*?); first step", log)
    fp8 = re.search(r"mds train: world [^\n]*? \+ FP8 (\w+)", log)
    compile_on = re.search(r"mds train: world [^\n]*torch\.compile (on|off)", log)
    return {"build_s": float(built.group(1)) if built else None, "startup": phases.group(1) if phases else None,
            "compile": compiled.group(1) if compiled else None,
            "fp8_engine": fp8.group(1) if fp8 else None, "torch_compile": compile_on.group(1) if compile_on else None}


def estimated_gib(train_flags: list[str]) -> float | None:
    """The train CLI's own memory estimate for these flags (what --dry-run prints), held in each record against
    the measured ``mem_gib_max``; None where the flags do not validate here."""
    from megatron_ds.arguments import ConfigError, parse_args, validate
    from megatron_ds.training import memory_estimate

    try:
        args = parse_args(train_flags, env={})
        settings = validate(args, args.nproc_per_node or 1)
    except (ConfigError, SystemExit):
        return None
    return round(memory_estimate.estimate(*memory_estimate.for_settings(settings)).total_gib, 1)


def run_ours(args, flags: list[str]) -> dict:
    work = args.work_dir / args.name
    work.mkdir(parents=True, exist_ok=True)
    metrics = work / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    data = None
    if not _flag_given(flags, "--data-path"):
        shape = resolved_shape(flags)
        ranks = args.dp_hint or 1
        need = (args.steps + 2) * shape["micro_batch_size"] * ranks * 8 * (shape["seq_length"] + 1)
        millions = 1 << max(0, (need - 1) // 1_000_000).bit_length()  # 1, 2, 4, ... M tokens: one file per size
        data = synthetic_dataset(args.work_dir / f"synthetic_gpt2vocab_{millions}M", millions * 1_000_000)
    cmd = train_command(flags, steps=args.steps, metrics_file=metrics, data_prefix=data)
    t0 = time.time()
    started: dict = {}
    code, tail = run_logged(cmd, work / "train.log", args.timeout, started)
    steps = read_metrics(metrics)
    measured = [r for r in steps if r["iteration"] > args.warmup_steps]
    record = {"kind": "mds_train", "name": args.name, "status": "ok" if code == 0 and measured else "failed",
              "exit_code": code, "wall_s": round(time.time() - t0, 1), "command": cmd,
              "harness_command": [sys.executable] + sys.argv, "config": resolved_shape(flags),
              "warmup_steps": args.warmup_steps, "environment": environment(),
              "startup_s": started.get("startup_s"), **startup_lines((work / "train.log").read_text()),
              "estimated_gib": estimated_gib(cmd[len(_train_launcher()):]),
              "summary": median_summary(measured, SUMMARY_KEYS) if measured else None,
              "steps": steps, "log_tail": tail if code != 0 else tail[-3000:]}
    return record


def _gradient_accumulation(shape: dict) -> int:
    """Micro-batches per optimizer step, by the train CLI's own rule with DP from --nproc-per-node (else 1), so
    each GPU of the baseline does the same work per step. A shape that rule refuses failed our run already (its
    record says why); the baseline then takes one micro-batch per step."""
    from megatron_ds.arguments import ConfigError, accumulation_steps

    if not shape["global_batch_size"]:
        return 1
    dp = (shape["nproc_per_node"] or 1) // (shape["tensor_model_parallel_size"] * shape["pipeline_model_parallel_size"])
    try:
        return accumulation_steps(shape["global_batch_size"], shape["micro_batch_size"], max(1, dp))
    except ConfigError:
        return 1


def run_baseline(args, flags: list[str]) -> dict:
    shape = resolved_shape(flags)
    out = args.work_dir / f"{args.name}__hf_baseline.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(REPO / "bench" / "baseline_hf_deepspeed.py"),
           "--num-layers", str(shape["num_layers"]), "--hidden-size", str(shape["hidden_size"]),
           "--num-attention-heads", str(shape["num_attention_heads"]), "--seq-length", str(shape["seq_length"]),
           "--micro-batch-size", str(shape["micro_batch_size"]), "--zero-stage", str(shape["zero_stage"]),
           "--gradient-accumulation-steps", str(_gradient_accumulation(shape)),
           "--hidden-dropout", str(shape["hidden_dropout"]), "--attention-dropout", str(shape["attention_dropout"]),
           "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps), "--out", str(out),
           "--name", f"{args.name}__hf_baseline"]
    if shape["checkpoint_activations"]:
        cmd.append("--gradient-checkpointing")
    if args.baseline_dtype:
        cmd += ["--dtype", args.baseline_dtype]
    code, tail = run_logged(cmd, args.work_dir / f"{args.name}__hf_baseline.log", args.timeout)
    if code == 0 and out.exists():
        record = json.loads(out.read_text())
        record["status"] = "ok"
    else:
        record = {"kind": "baseline_hf_deepspeed", "name": f"{args.name}__hf_baseline", "status": "failed",
                  "exit_code": code, "command": cmd, "environment": environment(), "summary": None,
                  "log_tail": tail}
    return record


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        split = argv.index("--")
        own, flags = argv[:split], argv[split + 1:]
    else:
        own, flags = argv, []
    p = argparse.ArgumentParser(prog="bench_train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", required=True, help="record name: bench/results/<name>.json")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup-steps", type=int, default=10, help="iterations left out of the medians")
    p.add_argument("--baseline", action="store_true", help="also run the HF GPT-2 + DeepSpeed baseline")
    p.add_argument("--baseline-dtype", choices=("bf16", "fp32"), help="baseline dtype (fp32 for CPU plumbing)")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--work-dir", type=Path, default=Path(os.environ.get("MDS_BENCH_WORK", "/tmp/mds_bench")),
                   help="logs, metrics and the synthetic dataset")
    p.add_argument("--dp-hint", type=int, help="ranks that read data (sizes the synthetic dataset)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before a run is killed")
    p.add_argument("--no-report", action="store_true", help="do not refresh bench/RESULTS.md")
    args = p.parse_args(own)
    if not flags:
        p.error("give the `entrypoint train` flags after `--`")
    if args.warmup_steps >= args.steps:
        p.error(f"--warmup-steps ({args.warmup_steps}) must be below --steps ({args.steps})")
    args.work_dir.mkdir(parents=True, exist_ok=True)

    ours = run_ours(args, flags)
    records = [ours]
    if args.baseline:
        base = run_baseline(args, flags)
        records.append(base)
        if ours["summary"] and base.get("summary"):
            ratio = ours["summary"]["tokens_per_s"] / base["summary"]["tokens_per_s"]
            ours["vs_baseline"] = base["vs_baseline"] = {"baseline": base["name"], "ours": ours["name"],
                                                         "tokens_per_s_ratio": ratio}
    for rec in records:
        path = write_record(rec, args.results_dir, rec["name"])
        s = rec.get("summary") or {}
        print(f"[bench] {rec['name']}: {rec['status']}; median tokens/s {s.get('tokens_per_s')}, "
              f"TFLOP/s/GPU {s.get('tflops_per_gpu')}, MFU {s.get('mfu')}, step {s.get('step_time_s')} s, "
              f"mem {s.get('mem_gib_max') or s.get('mem_gib')} GiB (estimated {rec.get('estimated_gib')}), "
              f"start-up {rec.get('startup_s')} s (built in {rec.get('build_s')} s) "
              f"-> {path}", flush=True)
    if "vs_baseline" in ours:
        print(f"[bench] ours/baseline tokens/s = {ours['vs_baseline']['tokens_per_s_ratio']:.3f}", flush=True)
    if not args.no_report:
        from bench.report import write_report

        write_report(args.results_dir, REPO / "bench" / "RESULTS.md")
    return 0 if ours["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
