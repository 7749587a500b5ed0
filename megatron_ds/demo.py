"""`make demo`: prepare the embedded corpus and train a small GPT on it with `entrypoint train`.

Runs the command exactly as a user would (a subprocess, printed first), on CPU or the GPU if there
is one, in a few minutes; then summarises the loss curve, the throughput and where the logs are,
says what a healthy run looks like (loss ~8 -> ~5.0, validation ~5.5) and whether this one was,
and how to get `entrypoint` on PATH.

    python -m megatron_ds.demo [--iters 300] [--minutes 4] [--out runs/demo]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time

SPLIT = "95,5,0"  # train, validation, test documents; the corpus is shuffled, so both span the library
# Measured with the defaults (300 iterations, CPU, Python 3.11's stdlib, torch 2.13; CPU runs repeat exactly):
# training 5.02 (mean of iterations 291-300), validation 5.50: what a newcomer should see (tests/test_demo.py
# holds the demo to them). Megatron's sample order (--data-order megatron, the default since issue 46) draws the
# 2400 samples from the whole epoch; the earlier order (--data-order mds: 4.48 and 5.29) from a contiguous
# quarter of the shuffled documents, whole files whose repetitions are easier to predict. Before the schedule
# counted samples (warmup from lr 0; a bisect put the change in
# 702f240..187f46d, f89a366 the schedule commit among them): 5.14-5.20 and 5.75-5.84.
EXPECTED_FINAL_LOSS = 5.0
EXPECTED_VALIDATION_LOSS = 5.5


def _has_gpu() -> bool:
    from megatron_ds.runtime.bootstrap import visible_gpus

    return visible_gpus() > 0


def build_command(corpus, out: str, iters: int, gpu: bool, minutes: float) -> list[str]:
    entrypoint = shutil.which("entrypoint", path=os.path.dirname(sys.executable)) or "entrypoint"
    command = [
        entrypoint, "train",
        # model: a 4-layer GPT-2-style network (~0.8M weights + embeddings of the 4k BPE vocabulary)
        "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
        "--seq-length", "128", "--max-position-embeddings", "128",
        "--hidden-dropout", "0", "--attention-dropout", "0",
        # batch and schedule
        "--micro-batch-size", "8", "--global-batch-size", "8", "--train-iters", str(iters),
        "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", str(max(1, iters // 15)),
        "--weight-decay", "0.01", "--clip-grad", "1.0", "--seed", "1234",
        # data: the embedded corpus, tokenised with its own BPE
        "--data-path", corpus.prefix, "--vocab-file", corpus.vocab_file, "--merge-file", corpus.merge_file,
        "--tokenizer-type", "GPT2BPETokenizer", "--split", SPLIT,
        # logging
        "--log-interval", "10", "--eval-interval", str(max(1, iters // 3)), "--eval-iters", "10",
        "--metrics-file", os.path.join(out, "metrics.jsonl"), "--tensorboard-dir", os.path.join(out, "tensorboard"),
        # a time budget, so a busy machine still finishes in minutes (all ranks stop at the same step)
        "--exit-duration-in-mins", f"{minutes:g}",
    ]
    if gpu:
        command += ["--bf16", "--nproc-per-node", "1"]
    return command


def summarise(out: str, seconds: float) -> str:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    train = [r for r in records if "lm_loss" in r]
    evals = [r for r in records if "val_loss" in r]
    if not train:
        return "no metrics were written"
    # Time-weighted over the logged intervals after the first one (which includes warm-up).
    steady = list(zip(train, train[1:])) or [({"iteration": 0}, train[0])]
    steps = sum(r["iteration"] - prev["iteration"] for prev, r in steady)
    seconds_in_steps = sum((r["iteration"] - prev["iteration"]) * r["step_time_s"] for prev, r in steady)
    tokens_per_step = train[-1]["tokens_per_s"] * train[-1]["step_time_s"]
    tokens_per_s = steps * tokens_per_step / seconds_in_steps
    step_ms = 1000 * seconds_in_steps / steps
    lines = [
        "",
        "demo summary",
        f"  training loss   {train[0]['lm_loss']:.3f} (mean of iterations 1-{train[0]['iteration']}) -> "
        f"{train[-1]['lm_loss']:.3f} (iterations {train[-2]['iteration'] + 1 if len(train) > 1 else 1}-"
        f"{train[-1]['iteration']})",
    ]
    if evals:
        lines.append(f"  validation      loss {evals[-1]['val_loss']:.3f}, perplexity {evals[-1]['val_ppl']:.1f} "
                     f"(iteration {evals[-1]['iteration']})")
    lines += [
        f"  throughput      {tokens_per_s:,.0f} tokens/s, {step_ms:.0f} ms per step (mean after the first log)",
        f"  wall time       {seconds:.0f} s including start-up",
        f"  metrics         {os.path.join(out, 'metrics.jsonl')} (one JSON object per logged step)",
        f"  tensorboard     tensorboard --logdir {os.path.join(out, 'tensorboard')}",
    ]
    return "\n".join(lines + expectations(train, evals))


def expectations(train: list[dict], evals: list[dict]) -> list[str]:
    """What a healthy demo looks like, and whether this run did."""
    first, last = train[0]["lm_loss"], train[-1]["lm_loss"]
    problems = []
    if not math.isfinite(last) or first - last < 1.5:
        problems.append(f"the training loss did not fall enough ({first:.2f} -> {last:.2f})")
    if evals and not abs(evals[-1]["val_loss"] - last) <= 1.0:
        problems.append(f"validation ({evals[-1]['val_loss']:.2f}) is far from training ({last:.2f})")
    verdict = ("  this run        as expected" if not problems else
               "  this run        NOT as expected: " + "; ".join(problems))
    return [
        "",
        "what to expect",
        f"  The training loss starts near ln(4096) = {math.log(4096):.1f} (a uniform guess over the 4096-token",
        f"  vocabulary) and falls to about {EXPECTED_FINAL_LOSS:.1f} by iteration 300; the validation loss (held-out",
        f"  stdlib files from across the library) ends a little above it, about {EXPECTED_VALIDATION_LOSS:.1f}. Fewer",
        "  iterations (the --minutes budget on a slow machine) end higher. A failure is a non-zero exit",
        "  with a traceback or \"mds launch: root cause\" above, a loss that stays near 8 or becomes nan,",
        "  or a validation loss more than 1 away from the training loss.",
        verdict,
        "",
        "next",
        f"  {_path_hint()}",
        "  entrypoint --help            # train, launch, env, doctor, preprocess, convert, sbatch",
    ]


def _path_hint() -> str:
    """How to get `entrypoint` on PATH in this shell: activate the virtual environment it is in."""
    if sys.prefix != sys.base_prefix:  # a virtual environment (make's .venv)
        activate = os.path.join(sys.prefix, "bin", "activate")
        relative = os.path.relpath(activate)
        return f"source {activate if relative.startswith('..') else relative}   # puts entrypoint on PATH"
    return f'export PATH="{os.path.dirname(sys.executable)}:$PATH"   # puts entrypoint on PATH'


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_ds.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=300, help="training iterations (default 300)")
    parser.add_argument("--minutes", type=float, default=4.0,
                        help="stop training after this many minutes even if --iters is not reached (default 4)")
    parser.add_argument("--out", default=os.path.join("runs", "demo"), help="where metrics and TensorBoard logs go")
    parser.add_argument("--data", default=os.path.join("data", "demo"), help="where the embedded corpus is prepared")
    args = parser.parse_args(argv)

    from megatron_ds.data.demo_corpus import prepare

    print(f"preparing the embedded corpus in {args.data} ...", flush=True)
    corpus = prepare(args.data)
    print(f"corpus: {corpus.num_documents} documents, {corpus.num_tokens:,} tokens, vocabulary {corpus.vocab_size}")
    if os.path.exists(os.path.join(args.out, "metrics.jsonl")):
        os.remove(os.path.join(args.out, "metrics.jsonl"))  # a fresh curve per demo run
    shutil.rmtree(os.path.join(args.out, "tensorboard"), ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    gpu = _has_gpu()
    command = build_command(corpus, args.out, args.iters, gpu, args.minutes)
    env, prefix = dict(os.environ), ""
    if not gpu and "OMP_NUM_THREADS" not in env:
        # Matrices this small gain little from a second thread, and on a shared machine spinning
        # OpenMP threads make steps 2-4x slower (measured); one thread is the robust choice.
        env["OMP_NUM_THREADS"], prefix = "1", "OMP_NUM_THREADS=1 "
    print("\n$ " + prefix + " ".join(shlex.quote(part) for part in command) + "\n", flush=True)
    start = time.time()
    code = subprocess.call(command, env=env)
    if code != 0:
        print(f"demo: entrypoint train exited with {code}: the cause is in its output above", file=sys.stderr)
        return code
    print(summarise(args.out, time.time() - start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
