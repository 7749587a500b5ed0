"""save() and load(): DeepSpeed's checkpoint files plus mds's metadata and per-rank RNG states.

The loop owns its TrainState and passes it in: save() records ``state.state_dict()`` (as DeepSpeed's
client state and at the top of mds_checkpoint.json), load() restores it with ``state.load_state_dict``.
``Checkpointer`` binds them to one run's engine and flags and says when a save is due.

DeepSpeed writes the model, optimizer and ZeRO partitions, LR scheduler and loss scaler into
``<dir>/<tag>/``. We give it a temporary tag, add our metadata and one RNG file per rank, make
every byte durable (each rank fsyncs the files it wrote), and only then does rank 0 rename the
directory into place and move ``latest``. See layout.py for why that ordering is crash-safe.
"""

from __future__ import annotations

import contextlib
import os
import sys
from argparse import Namespace

import torch
import torch.distributed as dist

from megatron_ds.checkpoint import ds_load, rng
from megatron_ds.checkpoint import layout as paths
from megatron_ds.checkpoint import metadata as meta
from megatron_ds.checkpoint import shape as model_shapes
from megatron_ds.checkpoint.metadata import CheckpointError, Layout

_last_saved: tuple[str, int] | None = None  # (save dir, iteration) of this process's last save


def _log(message: str) -> None:
    if _rank() == 0:
        print(f"[checkpoint] {message}", file=sys.stderr, flush=True)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


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
def _writes_through(engine, *, drop_optimizer: bool):
    """Route DeepSpeed's writes through us while saving: fsync every file this rank writes (only the
    writer can make its bytes durable) and, for --no-save-optim, leave the optimizer state out."""
    ckpt_engine = getattr(engine, "checkpoint_engine", None)
    original = getattr(ckpt_engine, "save", None)
    saves_zero = getattr(engine, "save_zero_checkpoint", None)
    own_attribute = "save" in getattr(ckpt_engine, "__dict__", {})  # someone already wrapped it
    if original is None:
        yield
        return

    def save_and_fsync(state_dict, path, *args, **kwargs):
        if drop_optimizer and isinstance(state_dict, dict) and state_dict.get("optimizer") is not None:
            state_dict = {**state_dict, "optimizer": None}
        result = original(state_dict, path, *args, **kwargs)
        if isinstance(path, str) and os.path.isfile(path):
            paths.fsync_file(path)
        return result

    ckpt_engine.save = save_and_fsync
    if drop_optimizer and saves_zero is not None:
        engine.save_zero_checkpoint = False  # the ZeRO partitions are the optimizer state
    try:
        yield
    finally:
        if own_attribute:
            ckpt_engine.save = original
        else:
            del ckpt_engine.save  # back to the class's method
        if saves_zero is not None:
            engine.save_zero_checkpoint = saves_zero


def split_record(args: Namespace, shape: dict | None) -> dict | None:
    """How each parameter of the model these flags build is split over TP (splits.py); None when the
    flags describe no GPTModel, or one with experts (their layers are DeepSpeed's, never split over TP, and
    neither resharding nor export reads an MoE checkpoint: convert/cli.py refuses it)."""
    if shape is None or shape.get("padded_vocab_size") is None or max(getattr(args, "num_experts", None) or [1]) > 1:
        return None
    from megatron_ds.checkpoint import splits

    return splits.record(splits.meta_model(model_shapes.gpt_config(args, shape["padded_vocab_size"])))


def save(engine, args: Namespace, state) -> str | None:
    """Write a checkpoint of the train state ``state`` (a TrainState: its state_dict() holds
    ``iteration``) to ``args.save``; collective (every rank calls it).

    Returns the published directory (None when this iteration was already saved by this process).

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
    rank = _rank()
    tag, tmp_tag = paths.tag_for(iteration), paths.tmp_tag_for(iteration)
    tmp_dir = os.path.join(save_dir, tmp_tag)
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        removed = paths.remove_stale_temporaries(save_dir)
        if removed:
            _log(f"removed leftovers of interrupted saves: {', '.join(removed)}")
    _barrier()

    save_optim = not getattr(args, "no_save_optim", False)
    save_rng = not getattr(args, "no_save_rng", False)
    with _writes_through(engine, drop_optimizer=not save_optim):
        engine.save_checkpoint(save_dir, tag=tmp_tag, client_state=client_state, save_latest=False)
    if save_rng:
        rng_path = os.path.join(tmp_dir, rng.rng_file_name(rank))
        torch.save(rng.capture(), rng_path)
        paths.fsync_file(rng_path)
    _barrier()  # every rank's files are durable under the temporary name

    if rank == 0:
        layout = current_layout(engine)
        shape = model_shapes.model_shape(args)
        metadata = meta.build(args, layout, client_state, meta.manifest(tmp_dir),
                              optimizer_saved=save_optim, rng_saved=save_rng, model=shape)
        metadata["splits"] = split_record(args, shape)
        meta.write(tmp_dir, metadata)
        paths.fsync_dir(tmp_dir)
        paths.publish(save_dir, tmp_tag, tag)
        _log(f"saved iteration {iteration} to {os.path.join(save_dir, tag)}")
        pruned = paths.prune(save_dir, getattr(args, "keep_last_n_checkpoints", None) or 0)
        if pruned:
            _log(f"keep-last-{args.keep_last_n_checkpoints}: removed {', '.join(pruned)}")
    _barrier()
    _last_saved = (save_dir, iteration)
    return os.path.join(save_dir, tag)


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
    directory = os.path.join(load_dir, tag)
    if not os.path.isdir(directory):
        moved_aside = os.path.join(load_dir, paths.TRASH_PREFIX + tag)
        if os.path.isdir(moved_aside):  # killed between the two renames of a re-save: the old copy is whole
            return paths.TRASH_PREFIX + tag, moved_aside
        raise CheckpointError(f"--load {load_dir}: 'latest' names {tag!r} but {directory} does not exist")
    return tag, directory


def load(engine, args: Namespace, state) -> bool:
    """Load the checkpoint ``latest`` names in ``args.load`` into the engine and the train state
    ``state`` (through its load_state_dict); collective.

    Returns False when there is nothing to load (no --load, or --load equal to --save and still
    empty: the first run of a job that resumes itself); ``state`` is then left as it was.
    --finetune loads the weights only and leaves ``state`` alone (a fresh one starts at iteration 0);
    --no-load-optim skips the optimizer and LR scheduler; --no-load-rng skips the RNG states.
    """
    if not getattr(args, "load", None):
        return False
    load_dir = os.path.abspath(args.load)
    found = resolve(load_dir)
    if found is None:
        same_as_save = getattr(args, "save", None) and os.path.abspath(args.save) == load_dir
        if same_as_save:
            _log(f"no checkpoint in {load_dir} yet: starting from scratch")
            return False
        what = "does not exist" if not os.path.isdir(load_dir) else "holds no checkpoint (no 'latest', no iter_*)"
        raise CheckpointError(f"--load {load_dir} {what}")
    tag, directory = found
    finetune = bool(getattr(args, "finetune", False))
    load_optim = not finetune and not getattr(args, "no_load_optim", False)
    load_rng = not finetune and not getattr(args, "no_load_rng", False)

    metadata = meta.read(directory)
    meta.check_complete(directory, metadata)
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


class Checkpointer:
    """One run's checkpointing, from its flags: what to resume from (--load), where (--save) and how
    often (--save-interval) to save. The loop asks ``due(iteration)`` after each step.

    ``flags``: every validated setting by its flag's name (training/settings.py flags_of), a dict or a Namespace.
    By name because that is what a checkpoint stores (its metadata's "args") and what a load compares; this
    layer knows nothing of training's sections."""

    def __init__(self, engine, flags: dict | Namespace):
        args = Namespace(**flags) if isinstance(flags, dict) else flags
        self.engine, self.args = engine, args
        self.enabled = bool(getattr(args, "save", None))  # without --save nothing is ever saved
        self.interval = getattr(args, "save_interval", None) if self.enabled else None
        self.before_save = None  # called with the state before each save; raises to refuse it (a non-finite step)

    def load(self, state) -> bool:
        """Restore the engine and ``state`` from --load; False when there was nothing to load."""
        return load(self.engine, self.args, state)

    def due(self, iteration: int) -> bool:
        """A periodic save is due after this iteration."""
        return bool(self.interval) and iteration % self.interval == 0

    def save(self, state) -> str | None:
        """Save ``state`` and the engine to --save (collective); nothing without --save."""
        if not self.enabled:
            return None
        if self.before_save is not None:
            self.before_save(state)
        return save(self.engine, self.args, state)
