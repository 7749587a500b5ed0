"""save() and load(): DeepSpeed's checkpoint files plus mds's metadata and per-rank RNG states.

The loop owns its TrainState and passes it in: save() records ``state.state_dict()`` (as DeepSpeed's
client state and at the top of mds_checkpoint.json), load() restores it with ``state.load_state_dict``.
``Checkpointer`` binds them to one run's engine and flags and says when a save is due.

DeepSpeed writes the model, optimizer and ZeRO partitions, LR scheduler and loss scaler into
``<dir>/<tag>/``. We give it a temporary tag, add our metadata and one RNG file per rank, make
every byte durable (each rank fsyncs the files it wrote), and only then does rank 0 rename the
directory into place and move ``latest``. See layout.py for why that ordering is crash-safe.
Every write goes through one sink (disk.py): a failed one is kept, the ranks agree on it, and the
partial save is removed (exit 74); with --async-save the sink keeps host copies that a thread
writes and commits the same way (background.py). A load takes the newest complete checkpoint when
the one `latest` names is not (choose).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from argparse import Namespace
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_ds.checkpoint import disk, ds_load, rng
from megatron_ds.checkpoint import layout as paths
from megatron_ds.checkpoint import metadata as meta
from megatron_ds.checkpoint import shape as model_shapes
from megatron_ds.checkpoint.disk import SaveError
from megatron_ds.checkpoint.metadata import CheckpointError, Layout

_last_saved: tuple[str, int] | None = None  # (save dir, iteration) of this process's last save


def _log(message: str) -> None:
    if _rank() == 0:
        print(f"[checkpoint] {message}", file=sys.stderr, flush=True)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def current_layout(engine) -> Layout:
    """This job's world, TP/PP/DP/SP sizes (from megatron_ds.parallel), ZeRO stage and pipeline split (from the
    engine)."""
    from megatron_ds.parallel import state as parallel

    world = dist.get_world_size() if dist.is_initialized() else 1
    if parallel.is_initialized():
        s = parallel.get_state()
        tp, pp, dp, sp = s.tp_size, s.pp_size, s.dp_size, s.sp_size
    else:
        tp, pp, dp, sp = 1, 1, world, 1
    split = getattr(engine.module, "stage_layers", None) if pp > 1 else None  # training/engine.pipeline_module
    return Layout(world_size=world, tp=tp, pp=pp, dp=dp, zero_stage=int(engine.zero_optimization_stage()), sp=sp,
                  stage_layers=tuple(split) if split else None)


@contextlib.contextmanager
def _patched(obj, name: str, replacement):
    """``obj.name`` is ``replacement`` inside the block (nothing when obj has no such attribute)."""
    if getattr(obj, name, None) is None:
        yield
        return
    own, original = name in vars(obj), getattr(obj, name)  # own: an instance attribute (someone wrapped it)
    setattr(obj, name, replacement(original))
    try:
        yield
    finally:
        if own:
            setattr(obj, name, original)
        else:
            delattr(obj, name)  # back to the class's


@contextlib.contextmanager
def _routed_writes(engine, sink, failures: disk.Failures, *, drop_optimizer: bool):
    """Route DeepSpeed's writes while saving: each file through ``sink(state_dict, path)`` (it writes and
    fsyncs it, or keeps a snapshot for the background writer), its directories and its recovery scripts
    through ``failures`` (a full or read-only disk becomes one kept error, and DeepSpeed's collectives still
    run on every rank); for --no-save-optim, the optimizer state left out."""
    ckpt_engine = getattr(engine, "checkpoint_engine", None)

    def routed_save(_):
        def save(state_dict, path, *args, **kwargs):
            if drop_optimizer and isinstance(state_dict, dict) and state_dict.get("optimizer") is not None:
                state_dict = {**state_dict, "optimizer": None}
            sink(state_dict, path)
        return save

    def guarded(original):
        return lambda path, *args, **kwargs: failures.attempt(path, original, path, *args, **kwargs)

    with contextlib.ExitStack() as patches:
        patches.enter_context(_patched(ckpt_engine, "save", routed_save))
        patches.enter_context(_patched(ckpt_engine, "makedirs", guarded))
        patches.enter_context(_patched(engine, "_copy_recovery_script", guarded))
        if drop_optimizer and getattr(engine, "save_zero_checkpoint", None) is not None:
            patches.enter_context(_patched(engine, "save_zero_checkpoint", lambda _: False))  # ZeRO partitions
        yield


def split_record(args: Namespace, shape: dict | None) -> dict | None:
    """How each parameter of the model these flags build is split over TP (splits.py); None when the
    flags describe no GPTModel, or one with experts (their layers are DeepSpeed's, never split over TP, and
    neither resharding nor export reads an MoE checkpoint: convert/cli.py refuses it)."""
    if shape is None or shape.get("padded_vocab_size") is None or max(getattr(args, "num_experts", None) or [1]) > 1:
        return None
    from megatron_ds.checkpoint import splits

    return splits.record(splits.meta_model(model_shapes.gpt_config(args, shape["padded_vocab_size"])))


@dataclass
class SaveJob:
    """One save in flight: where it goes, what it records, and the first write error of this rank."""

    args: Namespace
    save_dir: str
    iteration: int
    client_state: dict
    layout: Layout
    save_optim: bool
    save_rng: bool
    needed: int | None  # bytes, for the free-space warning and a failure's message
    failures: disk.Failures = field(default_factory=disk.Failures)
    started: float = field(default_factory=time.perf_counter)
    stalled_s: float | None = None  # --async-save: how long training waited (the host copy)

    @property
    def tag(self) -> str:
        return paths.tag_for(self.iteration)

    @property
    def tmp_dir(self) -> str:
        return os.path.join(self.save_dir, paths.tmp_tag_for(self.iteration))


def save(engine, args: Namespace, state, background=None) -> str | None:
    """Write a checkpoint of the train state ``state`` (a TrainState: its state_dict() holds
    ``iteration``) to ``args.save``; collective (every rank calls it).

    Returns the published directory (None when this iteration was already saved by this process). With
    ``background`` (a background.Writer: --async-save) the tensors are copied to host memory here and written
    by its thread, which commits the save as below; the previous background save is waited for first. A
    failed write on any rank raises SaveError on every rank (disk.py), the partial save removed.

    FP8 state (precision/): torchao's tensorwise dynamic scaling has none (each scale comes from the current
    tensor), so weights, optimizer and RNG states are all a resume needs (tests/precision/test_fp8_checkpoints.py:
    bitwise). Transformer Engine keeps its scales and amax history as module extra state (``..._extra_state`` in
    the module states DeepSpeed writes, restored by its strict load); DeepSpeed writes data-parallel rank 0's
    module states only, so after a resume every DP rank continues with rank 0's amax history (without amax
    reduction each rank's history was its own; they differ by the data each saw, and re-converge within
    --fp8-amax-history-len steps). MS-AMP: what its weights and LBAdamW save, and what not, is in fp8_msamp.py.
    """
    global _last_saved
    save_dir = os.path.abspath(args.save)
    client_state = state.state_dict()
    iteration = int(client_state["iteration"])
    if _last_saved == (save_dir, iteration):
        return None
    if background is not None:
        background.wait()  # one save at a time; raises the previous one's SaveError
    save_optim = not getattr(args, "no_save_optim", False)
    layout = current_layout(engine)
    job = SaveJob(args, save_dir, iteration, client_state, layout, save_optim,
                  save_rng=not getattr(args, "no_save_rng", False),
                  needed=_needed_bytes(engine, save_dir, layout, save_optim))
    if _rank() == 0:
        job.failures.attempt(save_dir, _prepare, job)
    _barrier()

    zipfile = getattr(getattr(engine, "checkpoint_engine", None), "zipfile_serialization", True)
    if background is None:
        def sink(state_dict, path):
            job.failures.attempt(path, disk.write_file, state_dict, path, zipfile=zipfile)
    else:
        sink = background.snapshot_sink(zipfile)
    with _routed_writes(engine, sink, job.failures, drop_optimizer=not save_optim):
        engine.save_checkpoint(save_dir, tag=paths.tmp_tag_for(iteration), client_state=client_state,
                               save_latest=False)
    if job.save_rng:
        sink(rng.capture(), os.path.join(job.tmp_dir, rng.rng_file_name(_rank())))
    _last_saved = (save_dir, iteration)
    if background is None:
        commit(job)
    else:
        background.start(job, lambda group: commit(job, group))
    return os.path.join(save_dir, job.tag)


def _prepare(job: SaveJob) -> None:
    """Rank 0, before any rank writes: the save directory exists, and no torn save of an earlier run is left."""
    os.makedirs(job.save_dir, exist_ok=True)
    removed = paths.remove_stale_temporaries(job.save_dir)
    if removed:
        _log(f"removed leftovers of interrupted saves: {', '.join(removed)}")


def _needed_bytes(engine, save_dir: str, layout: Layout, save_optim: bool) -> int | None:
    """The save's size: the last save's (its manifest), else estimated from the tensors; rank 0 warns when the
    disk has less free. Collective (one all_reduce) so that every rank takes the same path."""
    estimate = _estimated_bytes(engine, layout, save_optim)
    if _rank() != 0:
        return estimate
    needed = disk.last_save_bytes(save_dir) or estimate
    free = disk.free_bytes(save_dir)
    if free is not None and needed is not None and free < needed:
        _log(f"warning: the save needs about {disk.human(needed)} in {save_dir}, only {disk.human(free)} are free "
             "there: it will fail unless space is freed (or --save points elsewhere)")
    return needed


def _estimated_bytes(engine, layout: Layout, save_optim: bool) -> int | None:
    """Every model-parallel shard's parameters once, in their dtype, and with the optimizer its fp32 master
    weights and two Adam moments: 12 bytes a parameter (8 for fp32 parameters without ZeRO, their own master)."""
    module = getattr(engine, "module", None)
    if module is None:
        return None
    replicas = max(1, layout.world_size // (layout.tp * layout.pp))  # DP (x SP) copies of each shard
    local = 0
    for p in module.parameters():
        optimizer = 0 if not save_optim else 8 if p.element_size() == 4 and layout.zero_stage == 0 else 12
        local += getattr(p, "ds_numel", p.numel()) * (p.element_size() + optimizer)
    total = torch.tensor([local / replicas], dtype=torch.float64, device=_collective_device())
    if dist.is_initialized():
        dist.all_reduce(total)
    return int(total.item())


def _collective_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def commit(job: SaveJob, group=None) -> None:
    """Every rank's files are durable under the temporary name: rank 0 adds the metadata and publishes.
    Collective over ``group``; a write that failed on any rank raises SaveError on every rank."""
    _agree(job, group)
    if _rank() == 0:
        job.failures.attempt(job.tmp_dir, _publish, job)
    _agree(job, group)


def _publish(job: SaveJob) -> None:
    args, shape = job.args, model_shapes.model_shape(job.args)
    metadata = meta.build(args, job.layout, job.client_state, meta.manifest(job.tmp_dir),
                          optimizer_saved=job.save_optim, rng_saved=job.save_rng, model=shape)
    metadata["splits"] = split_record(args, shape)
    meta.write(job.tmp_dir, metadata)
    paths.fsync_dir(job.tmp_dir)
    paths.publish(job.save_dir, os.path.basename(job.tmp_dir), job.tag)
    took = time.perf_counter() - job.started
    _log(f"saved iteration {job.iteration} to {os.path.join(job.save_dir, job.tag)} in {took:.1f} s"
         + ("" if job.stalled_s is None else f" (in the background: training waited {job.stalled_s:.1f} s)"))
    pruned = paths.prune(job.save_dir, getattr(args, "keep_last_n_checkpoints", None) or 0)
    if pruned:
        _log(f"keep-last-{args.keep_last_n_checkpoints}: removed {', '.join(pruned)}")


def _agree(job: SaveJob, group) -> None:
    """Collective: return when no rank's write failed; otherwise rank 0 removes the partial save and names the
    first failure in one line, and every rank raises SaveError (after that line: no rank leaves before it)."""
    reports = [job.failures.first]
    if dist.is_initialized():
        reports = [None] * dist.get_world_size(group)
        dist.all_gather_object(reports, job.failures.first, group=group)
    failed = [(rank, what) for rank, what in enumerate(reports) if what]
    if not failed:
        return
    message = f"saving iteration {job.iteration} failed"
    if _rank() == 0:
        shutil.rmtree(job.tmp_dir, ignore_errors=True)
        message = failure_message(job, *failed[0])
        _log(message)
    _barrier(group)
    raise SaveError(message)


def failure_message(job: SaveJob, rank: int, what: str) -> str:
    """The one line of a failed save: what failed where, the space needed and free, what `latest` still names."""
    tag = paths.read_latest(job.save_dir)
    kept = os.path.join(job.save_dir, tag) if tag and os.path.isdir(os.path.join(job.save_dir, tag)) else None
    return (f"saving iteration {job.iteration} failed on rank {rank}: {what}; the save needs about "
            f"{disk.human(job.needed)}, {disk.human(disk.free_bytes(job.save_dir))} are free there; the partial "
            "save was removed and " + (f"`latest` still names the last complete checkpoint {kept}: free space (or "
                                       f"give --save another directory) and resume with --load {job.save_dir}"
                                       if kept else "no complete checkpoint was saved before it: free space (or "
                                       "give --save another directory) and run again")
            + f" (exit {disk.SAVE_FAILED_EXIT})")


def checkpoint_directory(load: str, iteration: int | None) -> str:
    """The checkpoint directory that --load DIR [--iteration N] names: iter_N, else the one `latest` names."""
    if iteration is not None:
        directory = os.path.join(load, paths.tag_for(iteration))
        if not os.path.isdir(directory):
            raise CheckpointError(f"--iteration {iteration}: {directory} does not exist")
        return directory
    tag = paths.read_latest(load)
    if tag is None:
        what = "does not exist" if not os.path.isdir(load) else "has no 'latest' checkpoint"
        raise CheckpointError(f"--load {load} {what}")
    directory = os.path.join(load, tag)
    if not os.path.isdir(directory):
        raise CheckpointError(f"--load {load}: 'latest' names {tag!r} but {directory} does not exist")
    return directory


def resolve(load_dir: str) -> tuple[str, str] | None:
    """(tag, directory) of the checkpoint ``latest`` names in load_dir, or None when there is none."""
    tag = paths.read_latest(load_dir)
    if tag is None:
        complete = paths.list_checkpoints(load_dir)
        if not complete:
            return None
        # killed between renaming the first checkpoint into place and writing `latest`: a directory
        # with its final name is complete (it is renamed only after every byte is durable)
        tag = complete[-1][1]
    if os.sep in tag or tag in (".", ".."):
        raise CheckpointError(f"--load {load_dir}: 'latest' holds {tag[:80]!r}, not a checkpoint's name")
    directory = os.path.join(load_dir, tag)
    if not os.path.isdir(directory):
        moved_aside = os.path.join(load_dir, paths.TRASH_PREFIX + tag)
        if os.path.isdir(moved_aside):  # killed between the two renames of a re-save: the old copy is whole
            return paths.TRASH_PREFIX + tag, moved_aside
        raise CheckpointError(f"--load {load_dir}: 'latest' names {tag!r} but {directory} does not exist")
    return tag, directory


def inspect(directory: str) -> tuple[dict | None, str | None]:
    """(metadata, None) of a complete checkpoint directory, else (None, what is wrong with it)."""
    if not os.path.isdir(directory):
        return None, f"{directory} does not exist"
    try:
        metadata = meta.read(directory)
        meta.check_complete(directory, metadata)
    except CheckpointError as err:
        return None, str(err)
    except (KeyError, TypeError, AttributeError) as err:
        return None, f"{os.path.join(directory, meta.METADATA_FILE)} is malformed ({type(err).__name__}: {err})"
    return metadata, None


def newest_complete(load_dir: str, *, other_than: str | None = None) -> tuple[str, str, dict] | None:
    """(tag, directory, metadata) of the newest complete checkpoint in load_dir (leaving out ``other_than``)."""
    for _, tag in reversed(paths.list_checkpoints(load_dir)):
        directory = os.path.join(load_dir, tag)
        metadata, _ = inspect(directory) if tag != other_than else (None, None)
        if metadata is not None:
            return tag, directory, metadata
    return None


def choose(load_dir: str, *, ckpt_step: int | None = None, fallback: bool = True) -> tuple[str, str, dict] | None:
    """The checkpoint a load reads, (tag, directory, metadata); None when load_dir holds none at all.

    --ckpt-step N: iter_N, complete, or an error naming the complete ones. Otherwise the one `latest` names;
    when that is partial or corrupt, or `latest` names nothing (missing, empty, garbage), the newest complete
    checkpoint, with a warning naming both (``fallback``), or an error that names it and the flag that loads it."""
    if ckpt_step is not None:
        tag = paths.tag_for(ckpt_step)
        metadata, problem = inspect(os.path.join(load_dir, tag))
        if problem is None:
            return tag, os.path.join(load_dir, tag), metadata
        complete = [str(i) for i, t in paths.list_checkpoints(load_dir) if inspect(os.path.join(load_dir, t))[0]]
        raise CheckpointError(f"--ckpt-step {ckpt_step}: {problem}; complete checkpoints in {load_dir}: "
                              + (f"iterations {', '.join(complete)}" if complete else "none"))
    named, metadata = paths.read_latest(load_dir), None
    try:
        found = resolve(load_dir)
    except CheckpointError as err:  # `latest` names a directory that is not there, or garbage
        found, problem = None, str(err)
    else:
        if found is None:
            return None
        metadata, problem = inspect(found[1])
        if problem is None and named is not None:
            return (*found, metadata)
        problem = problem or f"{load_dir} has no usable 'latest' (missing or empty)"
    complete = (*found, metadata) if metadata is not None else \
        newest_complete(load_dir, other_than=found[0] if found else None)
    if complete is None:
        raise CheckpointError(f"{problem}; {load_dir} holds no complete checkpoint to resume from instead")
    tag, directory, metadata = complete
    if not fallback:
        raise CheckpointError(f"{problem}; the newest complete checkpoint is {directory}: add --ckpt-step "
                              f"{metadata['iteration']} to resume from it")
    _log(f"warning: {problem}; resuming from the newest complete checkpoint {directory} instead "
         "(--no-ckpt-fallback: stop instead)")
    return complete


def load(engine, args: Namespace, state) -> bool:
    """Load the checkpoint ``latest`` names in ``args.load`` (choose: --ckpt-step, and the fallback to the
    newest complete one) into the engine and the train state ``state`` (through its load_state_dict); collective.

    Returns False when there is nothing to load (no --load, or --load equal to --save and still
    empty: the first run of a job that resumes itself); ``state`` is then left as it was.
    --finetune loads the weights only and leaves ``state`` alone (a fresh one starts at iteration 0);
    --no-load-optim skips the optimizer and LR scheduler; --no-load-rng skips the RNG states.
    """
    if not getattr(args, "load", None):
        return False
    load_dir = os.path.abspath(args.load)
    found = choose(load_dir, ckpt_step=getattr(args, "ckpt_step", None),
                   fallback=not getattr(args, "no_ckpt_fallback", False))
    if found is None:
        same_as_save = getattr(args, "save", None) and os.path.abspath(args.save) == load_dir
        if same_as_save:
            _log(f"no checkpoint in {load_dir} yet: starting from scratch")
            return False
        what = "does not exist" if not os.path.isdir(load_dir) else "holds no checkpoint (no 'latest', no iter_*)"
        raise CheckpointError(f"--load {load_dir} {what}")
    tag, directory, metadata = found
    finetune = bool(getattr(args, "finetune", False))
    load_optim = not finetune and not getattr(args, "no_load_optim", False)
    load_rng = not finetune and not getattr(args, "no_load_rng", False)
    resharded = metadata.get("resharded_from")
    if resharded and load_rng and not metadata.get("rng_saved", True):
        load_rng = False  # the per-rank RNG states of another world do not carry over (reshard.py)
        _log(f"{directory} was resharded from TP {resharded['layout']['tp']} x PP {resharded['layout']['pp']} x "
             f"DP {resharded['layout']['dp']}: the RNG states start from --seed")
    saved_state = None if finetune else meta.saved_train_state(metadata, state.state_dict(), directory)
    layout = current_layout(engine)
    saved_model = metadata.get("model") or model_shapes.model_shape(Namespace(**metadata["args"]))
    meta.check_compatible(metadata, args, layout, load_optim=load_optim, load_rng=load_rng, directory=directory,
                          saved_model=saved_model, model=model_shapes.model_shape(args))

    with _read_errors(load_dir, tag):
        loaded, _ = ds_load.load_checkpoint(engine, load_dir, tag, load_optim=load_optim, finetune=finetune)
        if loaded is None:
            raise CheckpointError(f"DeepSpeed found no model states in {directory}")
        if load_rng:
            rng.restore(torch.load(os.path.join(directory, rng.rng_file_name(_rank())), map_location="cpu",
                                   weights_only=False))
    _barrier()
    global _last_saved
    if getattr(args, "save", None) and os.path.abspath(args.save) == load_dir and not finetune:
        _last_saved = (load_dir, int(metadata["iteration"]))  # a run with nothing left to train need not re-save
    if finetune:
        _log(f"--finetune: loaded weights of iteration {metadata['iteration']} from {directory}; "
             "starting at iteration 0")
        return True
    state.load_state_dict(saved_state)
    # checkpoints written before --data-order existed were trained on mds's order
    saved_order, order = metadata["args"].get("data_order", "mds"), getattr(args, "data_order", None)
    if order is not None and saved_order != order:
        _log(f"warning: the checkpoint was trained on --data-order {saved_order}'s samples, this run serves "
             f"--data-order {order}'s; pass --data-order {saved_order} to continue on the same samples")
    _log(f"resuming from iteration {metadata['iteration']} ({metadata['consumed_train_samples']} samples) "
         f"of {directory}" + ("" if load_optim else " without optimizer state")
         + ("" if load_rng else " without RNG state"))
    return True


@contextlib.contextmanager
def _read_errors(load_dir: str, tag: str):
    """A checkpoint whose files pass the manifest (right names, right sizes) but do not read back: corrupt bytes
    (torch.load fails in ways as many as the bytes, so any error but ours). Named with the complete checkpoint
    before it, not fallen back from: the engine may hold part of the broken one by then."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - see above
        older = newest_complete(load_dir, other_than=tag)
        way_out = (f"; the newest complete checkpoint before it is {older[1]}: add --ckpt-step {older[2]['iteration']}"
                   " to resume from it" if older else f"; {load_dir} holds no other complete checkpoint")
        raise CheckpointError(f"checkpoint {os.path.join(load_dir, tag)} is corrupt (its files have the sizes the save "
                              f"wrote but do not read back: {type(err).__name__}: "
                              f"{(str(err).splitlines() or [''])[0][:200]}){way_out}") from err


class Checkpointer:
    """One run's checkpointing, from its flags: what to resume from (--load), where (--save) and how
    often (--save-interval) to save. The loop asks ``due(iteration)`` after each step.

    ``flags``: every validated setting by its flag's name (arguments/settings.py flags_of), a dict or a Namespace.
    By name because that is what a checkpoint stores (its metadata's "args") and what a load compares; this
    layer knows nothing of training's sections."""

    def __init__(self, engine, flags: dict | Namespace):
        args = Namespace(**flags) if isinstance(flags, dict) else flags
        self.engine, self.args = engine, args
        self.enabled = bool(getattr(args, "save", None))  # without --save nothing is ever saved
        self.interval = getattr(args, "save_interval", None) if self.enabled else None
        self.before_save = None  # called with the state before each save; raises to refuse it (a non-finite step)
        self.background = None
        if self.enabled and getattr(args, "async_save", False):
            from megatron_ds.checkpoint.background import Writer

            self.background = Writer()

    def load(self, state) -> bool:
        """Restore the engine and ``state`` from --load; False when there was nothing to load."""
        return load(self.engine, self.args, state)

    def due(self, iteration: int) -> bool:
        """A periodic save is due after this iteration."""
        return bool(self.interval) and iteration % self.interval == 0

    def save(self, state) -> str | None:
        """Save ``state`` and the engine to --save (collective); nothing without --save. With --async-save the
        files are written in the background: finish() waits for them."""
        if not self.enabled:
            return None
        if self.before_save is not None:
            self.before_save(state)
        return save(self.engine, self.args, state, self.background)

    def finish(self) -> None:
        """Wait for a background save in flight (the end of training); raises its SaveError."""
        if self.background is not None:
            self.background.wait()
