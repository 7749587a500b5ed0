"""FP8 against bf16 in one call: the same `entrypoint train` flags twice, the second with FP8 added.

    python bench/fp8_compare.py --name gpt1_3b_fp8 --steps 30 --warmup-steps 10 -- --preset GPT1_3B --bf16 ...
    python bench/fp8_compare.py --name gpt350m_fp8_loss --loss --steps 300 --demo-corpus -- --preset GPT350M ...
    python bench/fp8_compare.py --name gpt1_3b_engines --variant "te=--fp8-format hybrid --fp8-engine te" \
        --variant "torchao=--fp8-format hybrid --fp8-engine torchao" -- --preset GPT1_3B ...

Each --variant LABEL=FLAGS is one more run beside bf16, in the same call (default: one, `fp8`, from --fp8-flags).

Speed (default): both runs go through bench_train.py (records <name>__bf16 and <name>__fp8 with medians of
tokens/s, MFU and peak memory); the comparison record <name>.json holds the ratios.
Loss (--loss): both runs train on real text (--demo-corpus: the embedded corpus of Python sources, its
BPE, built here), same seed and data; the record holds the relative difference of the FP8 loss to the
bf16 loss at every log point and its maximum after --after (step 50): the issue's bound is 1.5%.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, RESULTS, environment, write_record


def loss_difference(bf16_steps: list[dict], fp8_steps: list[dict], after: int) -> dict:
    """Relative difference |fp8 - bf16| / bf16 of the training loss at each log point both runs logged."""
    bf16 = {s["iteration"]: s["lm_loss"] for s in bf16_steps if s.get("lm_loss") is not None}
    fp8 = {s["iteration"]: s["lm_loss"] for s in fp8_steps if s.get("lm_loss") is not None}
    points = sorted(set(bf16) & set(fp8))
    relative = {i: abs(fp8[i] - bf16[i]) / bf16[i] for i in points}
    later = [relative[i] for i in points if i > after]
    return {"log_points": points, "bf16_loss": [bf16[i] for i in points], "fp8_loss": [fp8[i] for i in points],
            "relative_difference": [relative[i] for i in points], "after": after,
            "max_relative_difference_after": max(later) if later else None,
            "final": {"bf16": bf16[points[-1]], "fp8": fp8[points[-1]]} if points else None}


def speed_ratios(bf16: dict, fp8: dict) -> dict | None:
    a, b = bf16.get("summary"), fp8.get("summary")
    if not a or not b:
        return None
    return {"tokens_per_s": b["tokens_per_s"] / a["tokens_per_s"],
            "mfu": {"bf16": a.get("mfu"), "fp8": b.get("mfu")},
            "mem_gib": {"bf16": a.get("mem_gib"), "fp8": b.get("mem_gib")},
            "tokens_per_s_abs": {"bf16": a["tokens_per_s"], "fp8": b["tokens_per_s"]}}


def demo_corpus_flags(work: Path) -> list[str]:
    from megatron_ds.data.demo_corpus import prepare

    corpus = prepare(str(work / "demo_corpus"))
    return ["--data-path", corpus.prefix, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", corpus.vocab_file,
            "--merge-file", corpus.merge_file]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    own, flags = argv[:split], argv[split + 1:]
    p = argparse.ArgumentParser(prog="fp8_compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--fp8-flags", default="--fp8-format hybrid --fp8-engine torchao",
                   help="what the FP8 run adds to the flags")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=FLAGS",
                   help="an FP8 run: its label and what it adds to the flags (repeatable; default fp8=--fp8-flags)")
    p.add_argument("--loss", action="store_true", help="compare losses (else speed)")
    p.add_argument("--after", type=int, default=50, help="--loss: the bound applies to log points after this step")
    p.add_argument("--demo-corpus", action="store_true", help="train on the embedded corpus (real text)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--work-dir", type=Path, default=Path(os.environ.get("MDS_BENCH_WORK", "/tmp/mds_bench")))
    args = p.parse_args(own)
    if not flags:
        p.error("give the `entrypoint train` flags after `--`")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    if args.demo_corpus:
        flags = flags + demo_corpus_flags(args.work_dir)

    if any("=" not in v or v.startswith("bf16=") for v in args.variant):
        p.error("--variant takes LABEL=FLAGS with a label other than bf16")
    variants = dict(v.split("=", 1) for v in args.variant) or {"fp8": args.fp8_flags}
    records = {}
    for label, extra in (("bf16", ""), *variants.items()):
        name = f"{args.name}__{label}"
        cmd = [sys.executable, str(REPO / "bench" / "bench_train.py"), "--name", name, "--steps", str(args.steps),
               "--warmup-steps", str(args.warmup_steps), "--timeout", str(args.timeout), "--no-report",
               "--results-dir", str(args.results_dir), "--work-dir", str(args.work_dir), "--", *flags, *extra.split()]
        print("+ " + " ".join(cmd), flush=True)
        subprocess.run(cmd, cwd=REPO)
        path = args.results_dir / f"{name}.json"
        records[label] = json.loads(path.read_text()) if path.exists() else {"status": "failed", "summary": None}

    record = {"kind": "fp8_compare", "name": args.name, "harness_command": [sys.executable, *sys.argv],
              "flags": flags, "variants": {label: extra.split() for label, extra in variants.items()},
              "environment": environment(), "runs": {label: f"{args.name}__{label}" for label in records},
              "status": "ok" if all(r.get("status") == "ok" for r in records.values()) else "failed"}
    for label in variants:
        one = {}
        if args.loss:
            one["loss"] = loss_difference(records["bf16"].get("steps") or [], records[label].get("steps") or [],
                                          args.after)
            one["max_relative_loss_difference_after"] = one["loss"]["max_relative_difference_after"]
            print(f"[fp8] {args.name} {label}: max relative loss difference after step {args.after}: "
                  f"{one['max_relative_loss_difference_after']}", flush=True)
        one["speed"] = speed_ratios(records["bf16"], records[label])
        if one["speed"]:
            one["tokens_per_s_ratio"] = one["speed"]["tokens_per_s"]
            print(f"[fp8] {args.name} {label}: {label}/bf16 tokens/s = {one['speed']['tokens_per_s']:.3f}, memory "
                  f"{one['speed']['mem_gib']}, MFU {one['speed']['mfu']}", flush=True)
        record[label] = one
    if len(variants) == 1:  # one FP8 run: its results at the top, as a reader of a single comparison expects
        record.update(record.pop(next(iter(variants))))
    path = write_record(record, args.results_dir, args.name)
    out = os.environ.get("OUT")
    if out:
        Path(out, f"{args.name}.json").write_text(json.dumps(record, indent=1))
    print(f"[fp8] -> {path}", flush=True)
    return 0 if record["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
