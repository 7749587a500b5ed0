"""Write a full model's weights as an mds checkpoint at a chosen TP x PP, for `entrypoint train --load --finetune`.

Importers (Hugging Face, Megatron-DeepSpeed) produce the full (TP=1, PP=1) state dict in GPTModel's
names, the flags of the model it is, and the split record (splits.py); this writes the files
DeepSpeed's engine reads back at that layout, as a save of the training loop would:
PP=1 ``mp_rank_{tp:02d}_model_states.pt`` holding ``module``; PP>1 one
``layer_{idx:02d}-model_{tp:02d}-model_states.pt`` per pipeline piece (0 embedding, 1..L layers,
L+1 final norm, L+2 untied head; a tied head has no file: DeepSpeed copies the embedding's weight)
and ``mp_rank_XX`` files without a module. The checkpoint holds no optimizer and no RNG state
(``mds_checkpoint.json`` says so), so a load without --finetune is refused with that reason. It is
written under a temporary name and published like any save (layout.publish): a failure leaves nothing.
"""

from __future__ import annotations

import os
import shutil
from argparse import Namespace

import torch

from megatron_ds.checkpoint import layout as paths
from megatron_ds.checkpoint import metadata as meta
from megatron_ds.checkpoint import splits as split_records
from megatron_ds.checkpoint.metadata import CheckpointError, Layout


def pipeline_piece(name: str, num_layers: int) -> tuple[int, str]:
    """(piece index, name inside the piece) of a full-model parameter name (gpt_stage_specs' order)."""
    head, _, rest = name.partition(".")
    if head == "embedding":
        return 0, rest
    if head == "layers":
        number, _, local = rest.partition(".")
        return int(number) + 1, local
    if head == "final_norm":
        return num_layers + 1, rest
    if head == "output_head":
        return num_layers + 2, rest
    raise CheckpointError(f"parameter {name!r} belongs to no pipeline piece")


def _ds_model_states(module, model_parallel: int) -> dict:
    """What DeepSpeed's load_checkpoint reads from mp_rank_XX_model_states.pt when loading weights only."""
    return {"module": module, "buffer_names": [], "optimizer": None, "param_shapes": None, "lr_scheduler": None,
            "skipped_steps": 0, "global_steps": 0, "global_samples": 0, "dp_world_size": 1,
            "mp_world_size": model_parallel, "iteration": 0}


def write(full: dict[str, torch.Tensor], args: Namespace, model_shape: dict, splits: dict[str, dict], save_dir: str,
          *, tp: int, pp: int, source: dict) -> str:
    """Write ``full`` at TP=tp, PP=pp into ``save_dir``/iter_0000000; returns that directory."""
    if os.path.exists(os.path.join(save_dir, paths.LATEST)) or paths.list_checkpoints(save_dir):
        raise CheckpointError(f"--to {save_dir} already holds a checkpoint; choose an empty directory")
    num_layers = args.num_layers
    ranks = split_records.shard_state_dict(full, splits, tp)
    os.makedirs(save_dir, exist_ok=True)
    tag, tmp_tag = paths.tag_for(0), paths.tmp_tag_for(0)
    tmp_dir = os.path.join(save_dir, tmp_tag)
    shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(tmp_dir)
    try:
        if pp == 1:
            for t, module in enumerate(ranks):
                torch.save(_ds_model_states(module, tp), os.path.join(tmp_dir, f"mp_rank_{t:02d}_model_states.pt"))
        else:
            for t, module in enumerate(ranks):
                pieces: dict[int, dict] = {}
                for name, tensor in module.items():
                    index, local = pipeline_piece(name, num_layers)
                    pieces.setdefault(index, {})[local] = tensor
                for index, piece in sorted(pieces.items()):
                    torch.save(piece, os.path.join(tmp_dir, f"layer_{index:02d}-model_{t:02d}-model_states.pt"))
            for r in range(tp * pp):
                torch.save(_ds_model_states(None, tp * pp), os.path.join(tmp_dir, f"mp_rank_{r:02d}_model_states.pt"))
        layout = Layout(world_size=tp * pp, tp=tp, pp=pp, dp=1, zero_stage=0)
        train_state = {"iteration": 0, "consumed_train_samples": 0, "consumed_valid_samples": 0}
        metadata = meta.build(args, layout, train_state, meta.manifest(tmp_dir), optimizer_saved=False,
                              rng_saved=False, model=model_shape)
        metadata["splits"] = splits
        metadata["imported_from"] = source
        meta.write(tmp_dir, metadata)
        paths.fsync_tree(tmp_dir)
        paths.publish(save_dir, tmp_tag, tag)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return os.path.join(save_dir, tag)
