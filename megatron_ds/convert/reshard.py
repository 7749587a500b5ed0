"""`entrypoint convert --reshard`: a checkpoint saved at one TP x PP x DP (ZeRO 0-3) rewritten at another.

Why an explicit offline step instead of resharding inside ``--load``: the training path keeps loading
only same-layout checkpoints (DeepSpeed reads its own files, every check stays as it is), and a
reshard that fails leaves the source untouched and writes nothing. The new checkpoint is a normal one;
``entrypoint train --load NEW`` at the target layout resumes it exactly like a same-layout resume.

How (three phases; the first and last run as ranks on the CPU over gloo, reshard_rank.py):
1. gather, at the SOURCE layout: build the engine as training does, load the checkpoint, and read each
   parameter's fp32 value and Adam moments (exp_avg, exp_avg_sq) through DeepSpeed's per-parameter
   accessors (any ZeRO stage); DP rank 0 of every (TP, PP) rank writes them with the optimizer step,
   the LR scheduler's state and the engine's counters.
2. merge, here: the TP pieces joined by the checkpoint's split record (splits.py, never by names);
   the vocabulary rows padded with zeros or trimmed to the target padding (rows past the real
   vocabulary only: a trim that would cut a real token is refused).
3. scatter, at the TARGET layout: a fresh engine, every rank's slice of weights and moments set, the
   step and LR schedule restored, and checkpointing.save() with the source's train state (iteration,
   consumed samples): DeepSpeed writes its own files for the new layout.

The RNG states are per rank and do not carry over to another world: the new checkpoint holds none
(``rng_saved`` false, ``resharded_from`` set), and its load starts the RNG from the seed.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from argparse import Namespace

import torch

from megatron_ds.checkpoint import layout as paths
from megatron_ds.checkpoint import metadata as meta
from megatron_ds.checkpoint import splits as split_records
from megatron_ds.checkpoint.metadata import CheckpointError
from megatron_ds.runtime.rendezvous import hosted_store


def _log(message: str) -> None:
    print(f"convert: {message}", flush=True)


def target_args(source_args: dict, *, tp: int, pp: int, dp: int, zero_stage: int,
                make_vocab_size_divisible_by: int | None, save: str, sp: int = 1) -> Namespace:
    """The source run's flags at the target layout, a new Namespace (the checkpoint's flags are read, never
    written); CheckpointError naming the flag a layout breaks."""
    from megatron_ds.arguments import ConfigError
    from megatron_ds.arguments.rules import accumulation_steps, check_ulysses
    from megatron_ds.model.config import ModelConfigError, check_shape, shape_of
    from megatron_ds.parallel.pipeline_split import stage_layers
    from megatron_ds.parallel.state import ParallelConfigError, ParallelDims

    world = tp * pp * dp * sp
    changes = {"zero_stage": zero_stage, "ds_sequence_parallel_size": sp}
    if pp != source_args["pipeline_model_parallel_size"] or "decoder_last_pipeline_num_layers" not in source_args:
        changes["decoder_last_pipeline_num_layers"] = None  # the source's split means nothing at another PP: default
    for flag, value in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                        ("--data-parallel-size", dp), ("--ds-sequence-parallel-size", sp)):
        if value < 1:
            raise CheckpointError(f"{flag} must be >= 1, got {value}")
    if zero_stage not in (0, 1, 2, 3):
        raise CheckpointError(f"--zero-stage must be 0, 1, 2 or 3, got {zero_stage}")
    if zero_stage >= 2 and pp > 1:
        raise CheckpointError(f"--zero-stage {zero_stage} cannot be combined with --pipeline-model-parallel-size "
                              f"{pp}: DeepSpeed's pipeline engine supports ZeRO-0/1 only")
    args = Namespace(**{**source_args, **changes})  # the model's flags as the checks below read them
    what = f"TP {tp} x PP {pp} x DP {dp}" + (f" x SP {sp}" if sp > 1 else "")
    try:
        dims = ParallelDims(world, tp, pp, sp)
        check_shape(**shape_of(args), tp=tp)
        stage_layers(args.num_layers, pp, last=args.decoder_last_pipeline_num_layers)
        check_ulysses(args, dims)  # whole heads and equal sequence slices per SP rank, as training validates
        accumulation = accumulation_steps(args.global_batch_size, args.micro_batch_size, dp)
    except (ModelConfigError, ParallelConfigError, ConfigError) as err:
        raise CheckpointError(f"the target layout {what} does not fit this model: {err}") from None
    changes.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, world_size=world,
                   data_parallel_size=dp, gradient_accumulation_steps=accumulation,
                   no_pipeline_parallel=pp == 1 and bool(source_args.get("no_pipeline_parallel", False)),
                   save=save, load=None, save_interval=None, keep_last_n_checkpoints=0,
                   no_save_optim=False, no_save_rng=True)  # the RNG states of another world mean nothing here
    if make_vocab_size_divisible_by is not None:
        changes["make_vocab_size_divisible_by"] = make_vocab_size_divisible_by
    if tp == 1:
        changes["sequence_parallel"] = False
    return Namespace(**{**source_args, **changes})


def run_ranks(phase: str, spec: dict, world: int, staging: str, timeout: float) -> None:
    """Start ``world`` rank processes of reshard_rank.py on this machine (gloo) and wait for all of them."""
    spec_path = os.path.join(staging, f"{phase}.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    logs, procs = [], []
    with hosted_store() as store:
        for rank in range(world):
            log = open(os.path.join(staging, f"{phase}.rank{rank}.log"), "w")
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", **store.rank_env,
                       CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
            procs.append(subprocess.Popen([sys.executable, "-m", "megatron_ds.convert.reshard_rank", phase,
                                           spec_path], env=env, stdout=log, stderr=subprocess.STDOUT))
            logs.append(log)
        deadline = time.time() + timeout
        codes = []
        try:
            for p in procs:
                codes.append(p.wait(timeout=max(1.0, deadline - time.time())))
        except subprocess.TimeoutExpired:
            codes = None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for log in logs:
                log.close()
    if codes is None or any(codes):
        failed = 0 if codes is None else next(r for r, c in enumerate(codes) if c)
        with open(os.path.join(staging, f"{phase}.rank{failed}.log")) as f:
            tail = f.read()[-3000:]
        what = f"did not finish in {timeout:.0f}s" if codes is None else f"rank {failed} exited {codes[failed]}"
        raise CheckpointError(f"reshard {phase} at {world} ranks failed ({what}):\n{tail}")


def _resize_vocab(tensor: torch.Tensor, entry: dict, rows: int, real_vocab: int | None, name: str) -> torch.Tensor:
    """``tensor`` with ``rows`` rows along the vocabulary dimension: zeros appended, or padding rows cut."""
    dim, have = entry["dim"], tensor.size(entry["dim"])
    if have == rows:
        return tensor
    if rows < have:
        if real_vocab is None or rows < real_vocab:
            raise CheckpointError(f"{name}: trimming {have} vocabulary rows to {rows} would cut real tokens "
                                  f"(vocabulary {real_vocab})")
        return tensor.narrow(dim, 0, rows).clone()
    shape = list(tensor.shape)
    shape[dim] = rows - have
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)


def needed_bytes(directory: str) -> int:
    """Disk the reshard needs beside --to: its staging files (at most what the source holds) and the new
    checkpoint (about the source's size)."""
    size = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(directory) for f in files)
    return 2 * size


def room_problem(need: int, free: int, where: str) -> str | None:
    """The message when the filesystem of --to cannot hold the reshard: said before the work, not after a
    disk-full error hours into it."""
    if free >= need:
        return None
    return (f"{where} has {free / 1e9:.1f} GB free; the reshard needs about {need / 1e9:.1f} GB there (staging "
            f"files and the new checkpoint, each about the source checkpoint's size): free space or choose --to "
            f"on another filesystem")


def merge(staging: str, source_splits: dict, source_padded: int, target_padded: int,
          real_vocab: int | None) -> dict:
    """One full (TP=1, PP=1) entry {param, exp_avg, exp_avg_sq} per parameter from the gathered pieces."""
    pieces: dict[str, dict[int, dict]] = {}
    common = None
    for path in sorted(glob.glob(os.path.join(staging, "gathered-rank*.pt"))):
        part = torch.load(path, map_location="cpu", weights_only=False)
        for name, entry in part["params"].items():
            pieces.setdefault(name, {}).setdefault(part["tp_rank"], entry)  # a tied weight: the first stage's
        if common is None:
            common = {k: part.get(k) for k in ("step", "lr_scheduler", "engine", "loss_scaler")}
        elif part["step"] != common["step"]:
            raise CheckpointError(f"optimizer steps differ between ranks: {part['step']} vs {common['step']}")
    if common is None:
        raise CheckpointError("the gather phase wrote nothing")
    full = {}
    for name, by_rank in pieces.items():
        ranks = [by_rank[r] for r in sorted(by_rank)]
        entry = source_splits.get(name)
        merged = {}
        for key in ranks[0]:
            if ranks[0][key] is None:
                raise CheckpointError(f"the checkpoint holds no {key} for {name} (saved before any optimizer step?)")
            value = split_records.merge([r[key] for r in ranks], entry)
            if entry is not None and entry["parts"] == [source_padded]:  # the vocabulary dimension
                value = _resize_vocab(value, entry, target_padded, real_vocab, name)
            merged[key] = value
        full[name] = merged
    return {"params": full, **common}


def reshard(load: str, to: str, *, tp: int, pp: int, dp: int, zero_stage: int,
            make_vocab_size_divisible_by: int | None = None, iteration: int | None = None,
            timeout: float = 1800, sp: int = 1) -> str:
    """Rewrite the checkpoint in ``load`` (``latest``, or iter_N) at TP x PP x DP (x SP), ZeRO ``zero_stage``
    into the empty directory ``to``; returns the new checkpoint's directory. Nothing is left in ``to``
    (nor created) on failure."""
    from megatron_ds.checkpoint.checkpointing import checkpoint_directory
    from megatron_ds.checkpoint.shape import padded_vocab_size

    load, to = os.path.abspath(load), os.path.abspath(to)
    directory = checkpoint_directory(load, iteration)
    metadata = meta.read(directory)
    meta.check_complete(directory, metadata)
    if not metadata.get("optimizer_saved", True):
        raise CheckpointError(f"{directory} was saved without optimizer state (--no-save-optim): nothing to reshard "
                              "but the weights; load it with --finetune or --no-load-optim instead")
    if metadata["args"].get("fp16"):
        raise CheckpointError(f"{directory} was trained with --fp16: the reshard runs DeepSpeed engines on the CPU, "
                              "where DeepSpeed has no fp16 optimizer; fp32 and --bf16 checkpoints reshard")
    if metadata.get("splits") is None or metadata.get("model") is None:
        raise CheckpointError(f"{directory} records no per-parameter split record ('splits' in "
                              f"{meta.METADATA_FILE}): it was written by an older mds; resharding needs it")
    if os.path.exists(os.path.join(to, paths.LATEST)) or paths.list_checkpoints(to):
        raise CheckpointError(f"--to {to} already holds a checkpoint; choose an empty directory")
    src_layout, model = metadata["layout"], metadata["model"]
    args = target_args(metadata["args"], tp=tp, pp=pp, dp=dp, zero_stage=zero_stage,
                       make_vocab_size_divisible_by=make_vocab_size_divisible_by, save=to, sp=sp)
    real_vocab = model.get("vocab_size")
    source_padded = model["padded_vocab_size"]
    target_padded = padded_vocab_size(real_vocab, args) if real_vocab is not None else source_padded
    src_sp = src_layout.get("sp", 1)
    _log(f"{directory} (iteration {metadata['iteration']}, TP {src_layout['tp']} x PP {src_layout['pp']} x "
         f"DP {src_layout['dp']}" + (f" x SP {src_sp}" if src_sp > 1 else "") + f", ZeRO-{src_layout['zero_stage']})"
         f" -> TP {tp} x PP {pp} x DP {dp}" + (f" x SP {sp}" if sp > 1 else "") + f", ZeRO-{zero_stage}"
         + (f"; vocabulary rows {source_padded} -> {target_padded}" if target_padded != source_padded else ""))

    created = not os.path.exists(to)
    parent = os.path.dirname(to)
    os.makedirs(parent, exist_ok=True)
    problem = room_problem(needed_bytes(directory), shutil.disk_usage(parent).free, parent)
    if problem:
        raise CheckpointError(problem)
    staging = tempfile.mkdtemp(prefix=".reshard-", dir=parent)
    started = time.time()
    try:
        # the source engine as it was saved: its stages hold the checkpoint's layer counts
        source_split = meta.saved_stage_layers(metadata)
        source_args = dict(metadata["args"], load=None, save=None,
                           decoder_last_pipeline_num_layers=source_split[-1] if source_split else None)
        run_ranks("gather", {"args": source_args, "padded_vocab": source_padded, "load_dir": os.path.dirname(directory),
                             "tag": os.path.basename(directory), "staging": staging},
                  src_layout["world_size"], staging, timeout)
        gathered = time.time()
        merged = merge(staging, metadata["splits"], source_padded, target_padded, real_vocab)
        for path in glob.glob(os.path.join(staging, "gathered-rank*.pt")):  # merged holds it all now: free the disk
            os.remove(path)
        merged["splits"] = metadata["splits"]
        merged["train_state"] = meta.saved_train_state(metadata, _train_state_fields(), directory)
        merged_path = os.path.join(staging, "merged.pt")
        torch.save(merged, merged_path)
        del merged
        merged_at = time.time()
        run_ranks("scatter", {"args": meta.jsonable(vars(args)), "padded_vocab": target_padded,
                              "merged": merged_path}, tp * pp * dp * sp, staging, timeout)
        result = os.path.join(to, paths.tag_for(int(metadata["iteration"])))
        _stamp(result, directory, src_layout)
    except BaseException:
        if created:
            shutil.rmtree(to, ignore_errors=True)
        else:
            for name in os.listdir(to):  # it was empty of checkpoints: remove what the scatter phase left
                if name.startswith((paths.TMP_PREFIX, "iter_")) or name in (paths.LATEST, paths.MEGATRON_TRACKER):
                    target = os.path.join(to, name)
                    shutil.rmtree(target, ignore_errors=True) if os.path.isdir(target) else os.remove(target)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _log(f"wrote {result} (gather {gathered - started:.1f}s, merge {merged_at - gathered:.1f}s, "
         f"scatter {time.time() - merged_at:.1f}s)")
    return result


def _train_state_fields() -> list[str]:
    from dataclasses import fields

    from megatron_ds.training.state import TrainState

    return [f.name for f in fields(TrainState)]


def _stamp(result: str, source: str, source_layout: dict) -> None:
    """Record where the checkpoint came from (its manifest does not list mds_checkpoint.json itself)."""
    metadata = meta.read(result)
    metadata["resharded_from"] = {"directory": source, "layout": source_layout}
    tmp = os.path.join(result, meta.METADATA_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(metadata, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(result, meta.METADATA_FILE))
    paths.fsync_dir(result)
