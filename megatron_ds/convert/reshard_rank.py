"""One rank of `entrypoint convert --reshard`: build the engine as training does, then either read every
weight and Adam state of this rank out of it (``gather``) or fill it and save (``scatter``).

Going through a real DeepSpeed engine at each end means DeepSpeed reads and writes its own files
(ZeRO partitions, pipeline layer files, padding, param groups): we only use its documented
per-parameter accessors (``deepspeed.utils.safe_get/set_full_fp32_param``, ``..._optimizer_state``),
which hand out a parameter's full (TP-local) fp32 value and Adam moments at any ZeRO stage.

Run as ``python -m megatron_ds.convert.reshard_rank gather|scatter SPEC.json`` with the launcher's
RANK/WORLD_SIZE/MASTER_* variables; SPEC holds the flags (``args``) and the file paths (reshard.py).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

MOMENTS = ("exp_avg", "exp_avg_sq")


def _base_optimizer(engine):
    """The torch optimizer under DeepSpeed's wrappers (ours at ZeRO-0 fp32, over flat partitions with ZeRO)."""
    opt = engine.optimizer
    while hasattr(opt, "optimizer") and isinstance(getattr(opt, "optimizer"), torch.optim.Optimizer):
        opt = opt.optimizer
    return opt


def _masters(engine) -> dict[int, torch.Tensor]:
    """id(model param) -> its fp32 master copy, under DeepSpeed's fp16/bf16 wrapper without ZeRO
    (FP16_UnfusedOptimizer: the base optimizer steps, and keys its Adam state by, these copies)."""
    opt = engine.optimizer
    if not (hasattr(opt, "fp16_groups") and hasattr(opt, "fp32_groups")):
        return {}
    return {id(lp): hp for lps, hps in zip(opt.fp16_groups, opt.fp32_groups) for lp, hp in zip(lps, hps)}


# what a dynamic loss scaler (fp16) learns while training; its settings come from the target run's flags
SCALER_STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def scaler_state(optimizer) -> dict | None:
    """The loss scaler's learned state of DeepSpeed's optimizer wrapper (None without a dynamic one)."""
    scaler = getattr(optimizer, "loss_scaler", None)
    if scaler is None or not getattr(scaler, "dynamic", False):
        return None
    return {k: getattr(scaler, k) for k in SCALER_STATE if hasattr(scaler, k)}


def restore_scaler(optimizer, state: dict | None) -> None:
    """Put a gathered loss-scaler state into the target wrapper's scaler (both dynamic, or nothing to do)."""
    scaler = getattr(optimizer, "loss_scaler", None)
    if state is None or scaler is None or not getattr(scaler, "dynamic", False):
        return
    for key, value in state.items():
        setattr(scaler, key, value)


def _uses_zero_accessors(param) -> bool:
    return hasattr(param, "ds_id") or hasattr(param, "_hp_mapping")


def _link_optimizer_state(engine) -> None:
    """ZeRO 1/2: point each parameter's view of the flat Adam state at the current state tensors (DeepSpeed
    does this lazily at its first step; the accessors need it now)."""
    opt = engine.optimizer
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


def build(stored_flags: dict, padded_vocab: int):
    """The run a checkpoint's stored flags describe (an older checkpoint's missing flags at their defaults:
    settings_from_stored), built as training builds it (training/build.py), on gloo, for its engine."""
    from megatron_ds.arguments import settings_from_stored
    from megatron_ds.training.build import build_run

    return build_run(settings_from_stored(stored_flags), backend="gloo", padded_vocab=padded_vocab, training=False)


def local_parameters(engine, pipelined: bool, num_layers: int) -> dict[str, torch.nn.Parameter]:
    """{full-model (GPTModel) name: parameter} of this rank's model piece."""
    module = engine.module
    if not pipelined:
        return dict(module.named_parameters())
    from deepspeed.pipe import TiedLayerSpec

    def prefix(index: int) -> str:  # gpt_stage_specs' order (as writer.pipeline_piece)
        if index == 0:
            return "embedding."
        if index <= num_layers:
            return f"layers.{index - 1}."
        return "final_norm." if index == num_layers + 1 else "output_head."

    out = {}
    tied_prefix = {}
    for index, spec in enumerate(module._layer_specs):
        if isinstance(spec, TiedLayerSpec):
            tied_prefix.setdefault(spec.key, prefix(index))
    for key, tied in module.tied_modules.items():
        out.update({tied_prefix[key] + n: p for n, p in tied.named_parameters()})
    for offset, layer in enumerate(module.forward_funcs):
        if isinstance(layer, torch.nn.Module) and layer not in module.tied_modules.values():
            out.update({prefix(module._local_start + offset) + n: p for n, p in layer.named_parameters()})
    return out


def gather(spec: dict) -> None:
    """Load the source checkpoint at its own layout and write this rank's per-parameter state."""
    run = build(spec["args"], spec["padded_vocab"])
    engine, pipelined, parallel = run.engine, run.built.pipelined, run.parallel
    from megatron_ds.checkpoint import ds_load

    loaded, _ = ds_load.load_checkpoint(engine, spec["load_dir"], spec["tag"], load_optim=True)
    if loaded is None:
        raise RuntimeError(f"DeepSpeed found no model states in {spec['load_dir']}/{spec['tag']}")
    _link_optimizer_state(engine)
    base, masters = _base_optimizer(engine), _masters(engine)
    params = {}
    for name, param in local_parameters(engine, pipelined, run.settings.model.num_layers).items():
        if _uses_zero_accessors(param):  # ZeRO 1-3: collective over DP, every rank asks
            from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

            entry = {"param": safe_get_full_fp32_param(param)}
            entry.update({k: safe_get_full_optimizer_state(param, k) for k in MOMENTS})
        else:
            master = masters.get(id(param), param)
            state = base.state.get(master, {})
            entry = {"param": master.detach()}
            entry.update({k: state.get(k) for k in MOMENTS})
        params[name] = {k: None if v is None else v.detach().float().cpu().clone() for k, v in entry.items()}
    steps = {int(v["step"]) for v in base.state.values() if "step" in v}
    steps |= {int(g["step"]) for g in base.param_groups if "step" in g}
    if len(steps) > 1:
        raise RuntimeError(f"the optimizer's parameters were stepped unequally: steps {sorted(steps)}")
    if parallel.dp_rank == 0 and parallel.sp_rank == 0:  # the other DP/SP ranks hold the same full values
        scheduler = engine.lr_scheduler
        torch.save({"tp_rank": parallel.tp_rank, "pp_rank": parallel.pp_rank, "params": params,
                    "step": steps.pop() if steps else 0,
                    "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
                    "loss_scaler": scaler_state(engine.optimizer),
                    "engine": {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                               "skipped_steps": engine.skipped_steps}},
                   os.path.join(spec["staging"], f"gathered-rank{dist.get_rank():05d}.pt"))


def _fill_optimizer_state(engine, params: dict[str, torch.nn.Parameter], full: dict, entries: dict, tp: int,
                          tp_rank: int, step: int) -> None:
    from megatron_ds.checkpoint import splits

    base, masters = _base_optimizer(engine), _masters(engine)
    zero = any(_uses_zero_accessors(p) for p in params.values())
    # Adam's state is created by its first step: create it here (zeros, then the saved values below)
    if hasattr(engine.optimizer, "fp32_partitioned_groups_flat"):  # ZeRO-3 hands them to Adam only per step
        owners = list(engine.optimizer.fp32_partitioned_groups_flat)
    else:
        owners = ([p for g in base.param_groups for p in g["params"]] if zero
                  else [masters.get(id(p), p) for p in params.values()])
    for p in owners:
        base.state[p] = {"step": torch.tensor(float(step)), **{k: torch.zeros_like(p) for k in MOMENTS}}
    if zero:
        _link_optimizer_state(engine)
    for name, param in params.items():
        saved = full[name]
        # fp32, whatever the model's dtype: these are the master weights and Adam moments (a bf16 param's
        # dtype here would round them, and the resumed run would drift from the uninterrupted one)
        pieces = {k: splits.shard(saved[k], entries.get(name), tp, tp_rank).float() for k in ("param", *MOMENTS)}
        if zero:
            from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

            safe_set_full_fp32_param(param, pieces["param"])
            for k in MOMENTS:
                safe_set_full_optimizer_state(param, pieces[k], k)
        else:
            master = masters.get(id(param), param)
            if master is not param:
                master.data.copy_(pieces["param"].reshape(master.shape))
            for k in MOMENTS:
                base.state[master][k] = pieces[k].reshape(master.shape).clone()


def _set_weights(params: dict[str, torch.nn.Parameter], full: dict, entries: dict, tp: int, tp_rank: int) -> None:
    from megatron_ds.checkpoint import splits

    for name, param in params.items():
        value = splits.shard(full[name]["param"], entries.get(name), tp, tp_rank)
        if hasattr(param, "ds_id"):  # ZeRO-3: each rank holds a slice; gather, write, re-partition
            import deepspeed

            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                param.data.copy_(value.to(param.dtype))
        else:
            with torch.no_grad():
                param.data.copy_(value.to(param.dtype))


def scatter(spec: dict) -> None:
    """Fill a fresh engine at the target layout from the merged state and save it as a training run would."""
    from megatron_ds.training.state import TrainState

    run = build(spec["args"], spec["padded_vocab"])
    engine, pipelined, parallel = run.engine, run.built.pipelined, run.parallel
    merged = torch.load(spec["merged"], map_location="cpu", weights_only=False)
    full, entries = merged["params"], merged["splits"]
    params = local_parameters(engine, pipelined, run.settings.model.num_layers)
    missing = sorted(set(params) - set(full))
    if missing:
        raise RuntimeError(f"the source checkpoint has no value for {missing[:5]}")
    tp, tp_rank = parallel.tp_size, parallel.tp_rank
    _set_weights(params, full, entries, tp, tp_rank)
    _fill_optimizer_state(engine, params, full, entries, tp, tp_rank, merged["step"])
    restore_scaler(engine.optimizer, merged.get("loss_scaler"))
    if engine.lr_scheduler is not None and merged["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(merged["lr_scheduler"])
    for name, value in merged["engine"].items():
        setattr(engine, name, value)
    run.checkpointer.save(TrainState(**merged["train_state"]))  # to --save: the target directory


def main(argv: list[str]) -> int:
    phase, spec_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    {"gather": gather, "scatter": scatter}[phase](spec)
    if dist.is_initialized():
        dist.barrier()
    return 0


if __name__ == "__main__":
    from megatron_ds.runtime.bootstrap import leave_rank

    leave_rank(main(sys.argv[1:]))  # as training's ranks end: gloo's threads must not meet the interpreter's teardown
