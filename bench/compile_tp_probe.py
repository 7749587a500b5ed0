#!/usr/bin/env python
"""Issue 15 on one GPU: does a compiled TP=2 layer compute other gradients than the eager one?

On 2 x H200 (NCCL, torch 2.11, bf16) the compiled TP=2 model's first-step gradient norm was 1.98 against 6.38
eager; on CPU/gloo they are equal. Without a second GPU this probe puts both TP ranks on one GPU:
  fake:  one process, torch's fake process group at world size 2 (collectives copy locally, no second rank):
         shows a fault in the compiled graph itself (a dropped or reordered collective, a lost backward);
  gloo:  two processes on the same GPU, gloo on CUDA tensors (asynchronous copies and streams, as NCCL's):
         shows a fault that needs real communication.
each with the collectives parallel/mappings.py used before (MDS_TP_COLLECTIVES=inplace: the c10d calls that
write in place or into an output argument) and now (functional: torch's functional collectives), TP=2 with and
without sequence parallelism. Each case: one forward/backward of a bf16 GPTModel eager, again eager (the
baseline must repeat),
then with every TransformerLayer compiled; per rank the loss, the local gradient norm and the largest gradient
difference. A case is BAD when compiled and eager gradient norms differ by more than 5%.
Measured on CPU (--cpu): torch 2.13 every row ok; torch 2.11 the `inplace` rows BAD (compiled gradient norm
1.11 vs 1.40 eager: some gradients zero, pytorch#180642, fixed for 2.12) and the `functional` rows ok. On a
GPU with torch 2.11 the same split confirms the cause; `inplace` ok there would point at something else.
The fake process group of some torch versions leaves all-gather outputs unwritten (EAGER NOT REPEATABLE rows).

Usage, from the repo root:  python bench/compile_tp_probe.py          # CUDA, bf16 (about 2-4 min on an H100)
                            python bench/compile_tp_probe.py --cpu    # CPU, fp32, a smaller model (checks the script)
Options: --cases fake,gloo  --kinds inplace,functional  --layers N --hidden N --seq N --dropout P --timeout S
         --tp-comm-overlap reorder|pipeline (the compiled layers with that schedule: the fake group shows reorder's
         gradients on one GPU; pipeline needs real ranks, and two gloo ranks sharing a GPU segfault (H200,
         torch 2.11), so it waits for two GPUs).
Prints a table; writes $OUT/compile_tp_probe.json (or ./compile_tp_probe.json without $OUT).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--cpu", action="store_true", help="run on CPU in fp32 (a check of this script)")
    p.add_argument("--cases", default="fake,gloo")
    p.add_argument("--kinds", default="inplace,functional")
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.0, help="hidden and attention dropout (compiled masks differ)")
    p.add_argument("--tp-comm-overlap", choices=["reorder", "pipeline"],
                   help="compile with this --tp-comm-overlap mode (pipeline: the SP case only; the other gets reorder)")
    p.add_argument("--timeout", type=float, default=270.0, help="seconds for all of it (the pairs run at once)")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: pg,kind,rank,port,result path
    args = p.parse_args(argv)
    small = dict(layers=2, hidden=64, seq=32) if args.cpu else dict(layers=4, hidden=1024, seq=512)
    for key, value in small.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


# -- one rank (a child process) ---------------------------------------------------------------------------

def one_step(torch, config, group, device, tokens, labels) -> dict:
    from megatron_ds.model.gpt import GPTModel

    model = GPTModel(config, tp_group=group).to(device)
    torch.manual_seed(123)
    loss = model(tokens, labels).float().mean()
    loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    norm = torch.sqrt(sum((g * g).sum() for g in grads.values())).item()
    return {"loss": loss.item(), "grad_norm": norm, "grads": grads}


def compare(a: dict, b: dict) -> float:
    """Largest |a - b| of any gradient, relative to that gradient's largest |b|."""
    worst = 0.0
    for name, g in b["grads"].items():
        scale = g.abs().max().item() or 1.0
        worst = max(worst, (a["grads"][name] - g).abs().max().item() / scale)
    return worst


def worker(args: argparse.Namespace) -> None:
    pg, kind, rank, port, path = args.worker.split(",")
    rank = int(rank)
    os.environ["MDS_TP_COLLECTIVES"] = kind  # before megatron_ds imports mappings
    os.environ["MDS_ALLOW_TP_COMPILE"] = "1"
    import torch
    import torch.distributed as dist

    device = torch.device("cpu" if args.cpu else "cuda", 0)
    if not args.cpu:
        torch.cuda.set_device(device)
    if pg == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    import torch._dynamo
    from torch._dynamo.utils import counters

    from megatron_ds.model.compiled import compile_failure, first_call_seconds
    from megatron_ds.model.config import GPTConfig

    dtype = torch.float32 if args.cpu else torch.bfloat16
    g = torch.Generator().manual_seed(5)
    data = torch.randint(0, 4096, (args.batch, args.seq + 1), generator=g).to(device)
    tokens, labels = data[:, :-1], data[:, 1:]
    out = {"pg": pg, "kind": kind, "rank": rank, "torch": torch.__version__, "device": str(device),
           "gpu": None if args.cpu else torch.cuda.get_device_name(device), "cases": {}}
    for sp in (False, True):
        name = "tp2_sp" if sp else "tp2"
        base = dict(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8, vocab_size=4096,
                    seq_length=args.seq, hidden_dropout=args.dropout, attention_dropout=args.dropout,
                    attention_backend="sdpa", sequence_parallel=sp, params_dtype=dtype, seed=11)
        try:
            eager = one_step(torch, GPTConfig(**base), dist.group.WORLD, device, tokens, labels)
            again = one_step(torch, GPTConfig(**base), dist.group.WORLD, device, tokens, labels)
            torch._dynamo.reset()
            counters.clear()
            start = time.perf_counter()
            overlap = "reorder" if args.tp_comm_overlap == "pipeline" and not sp else args.tp_comm_overlap
            compiled = one_step(torch, GPTConfig(**base, torch_compile=True, tp_comm_overlap=overlap),
                                dist.group.WORLD, device, tokens, labels)
            out["cases"][name] = {
                "eager_loss": eager["loss"], "compiled_loss": compiled["loss"],
                "eager_grad_norm": eager["grad_norm"], "compiled_grad_norm": compiled["grad_norm"],
                "eager_repeat_max_rel": compare(again, eager), "compiled_max_rel": compare(compiled, eager),
                "tp_comm_overlap": overlap, "graphs": counters["stats"]["unique_graphs"],
                "compile_failure": compile_failure(),
                "first_call_s": first_call_seconds(), "step_s": time.perf_counter() - start}
        except Exception as err:  # noqa: BLE001 - one case's failure is a result, not the end of the probe
            out["cases"][name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    dist.destroy_process_group()


# -- the driver --------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: argparse.Namespace, pg: str, kind: str, outdir: str) -> tuple:
    """Start one (pg, kind) pair: one process (fake) or two on the same device (gloo)."""
    port, ranks = free_port(), (1 if pg == "fake" else 2)
    os.makedirs(os.path.join(outdir, "compile_tp_probe_ranks"), exist_ok=True)
    paths = [os.path.join(outdir, "compile_tp_probe_ranks", f"{pg}_{kind}_rank{r}.json") for r in range(ranks)]
    flags = [a for a in sys.argv[1:] if not a.startswith("--worker")]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *flags,
                               "--worker", f"{pg},{kind},{r},{port},{paths[r]}"], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(ranks)]
    return pg, kind, procs, paths


def collect(handle: tuple, deadline: float) -> list[dict]:
    """The results of a started pair; a rank still running at the deadline is killed and reported."""
    pg, kind, procs, paths = handle
    results = []
    for r, proc in enumerate(procs):
        try:
            log, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            log = "timed out (--timeout)"
        if os.path.exists(paths[r]):
            with open(paths[r]) as f:
                results.append(json.load(f))
        else:
            results.append({"pg": pg, "kind": kind, "rank": r, "error": f"exit {proc.returncode}: {log[-1500:]}"})
    return results


def verdict(case: dict) -> str:
    if "error" in case:
        return "ERROR"
    if case["compile_failure"] or not case["graphs"]:
        return "NOT COMPILED"
    if not (case["eager_repeat_max_rel"] <= 1e-3 and math.isfinite(case["eager_grad_norm"])):
        return "EAGER NOT REPEATABLE"  # e.g. a fake process group that leaves all-gather outputs unwritten
    off = abs(case["compiled_grad_norm"] - case["eager_grad_norm"]) / max(case["eager_grad_norm"], 1e-12)
    return "ok" if off <= 0.05 else "BAD"


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    outdir = os.environ.get("OUT") or os.getcwd()
    os.makedirs(outdir, exist_ok=True)
    rows, started = [], time.time()
    print(f"compile_tp_probe: {'CPU fp32' if args.cpu else 'CUDA bf16'}, {args.layers} layers, hidden {args.hidden}, "
          f"seq {args.seq}, batch {args.batch}, dropout {args.dropout}, --tp-comm-overlap {args.tp_comm_overlap}",
          flush=True)
    # every pair at once: compiling is CPU work, and the GPU work is small
    handles = [start(args, pg, kind, outdir) for pg in args.cases.split(",") for kind in args.kinds.split(",")]
    deadline = time.monotonic() + args.timeout
    for handle in handles:
        pg, kind = handle[:2]
        for result in collect(handle, deadline):
            for name, case in (result.get("cases") or {"-": {"error": result.get("error", "?")}}).items():
                rows.append({"pg": pg, "kind": kind, "rank": result["rank"], "case": name, **case,
                             "verdict": verdict(case), "torch": result.get("torch"), "gpu": result.get("gpu")})
        print(f"  {pg}/{kind}: done at {time.time() - started:.0f} s", flush=True)
    header = f"{'pg':5} {'collectives':11} {'rank':4} {'case':7} {'eager |g|':>10} {'compiled |g|':>12} " \
             f"{'max rel':>8} {'loss e/c':>17} verdict"
    print(header)
    for r in rows:
        if "error" in r:
            print(f"{r['pg']:5} {r['kind']:11} {r['rank']:<4} {r['case']:7} ERROR {r['error'][:300]}")
            continue
        print(f"{r['pg']:5} {r['kind']:11} {r['rank']:<4} {r['case']:7} {r['eager_grad_norm']:10.4f} "
              f"{r['compiled_grad_norm']:12.4f} {r['compiled_max_rel']:8.1e} "
              f"{r['eager_loss']:8.4f}/{r['compiled_loss']:8.4f} {r['verdict']}")
    path = os.path.join(outdir, f"compile_tp_probe{'_' + args.tp_comm_overlap if args.tp_comm_overlap else ''}.json")
    with open(path, "w") as f:
        json.dump({"argv": sys.argv[1:], "seconds": time.time() - started, "rows": rows}, f, indent=1)
    print(f"wrote {path} ({time.time() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
