"""Model + optimizer + DeepSpeed engine, in one commented order.

PP > 1: DeepSpeed's PipelineModule from the model's stage specs (tied embeddings via TiedLayerSpec,
PipeModelDataParallelTopology in the same rank order as megatron_ds.parallel.state) and its pipeline
engine (ZeRO-0/1). PP = 1: the plain GPTModel on a plain DeepSpeed engine (ZeRO 0-3), which is also
what --no-pipeline-parallel asks for. Ulysses (--ds-sequence-parallel-size, PP = TP = 1): the GPTModel
gets the SP group; DeepSpeed learns it from our mpu and reduces (ZeRO: partitions) over DP x SP; under
ZeRO-3 we partition the module over DP x SP ourselves and scale the backward (training/ulysses_zero.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist

from megatron_ds.arguments.lr_schedule import ScheduledLR, schedule_from
from megatron_ds.arguments.settings import Settings, model_config
from megatron_ds.model.config import GPTConfig
from megatron_ds.model.gpt import FinalNorm, GPTModel, TransformerLayer, gpt_stage_specs, lm_loss
from megatron_ds.parallel.layers import weights_drawn_on
from megatron_ds.parallel.pipeline_split import stage_layers
from megatron_ds.parallel.state import ParallelState, local_device_index
from megatron_ds.precision import Precision
from megatron_ds.training.ds_config import build_ds_config, optimizer_from_config, scheduler_from_config
from megatron_ds.training.moe import expert_param_groups, moe_mlp_builder
from megatron_ds.training.optimizer import AdamW
from megatron_ds.training.ulysses_zero import backward_scale, partition_over_sequence_data_parallel


def pipeline_module(config: GPTConfig, state: ParallelState, last_stage_layers: int | None = None):
    """DeepSpeed PipelineModule: one LayerSpec per stage spec; the tied embedding/head as TiedLayerSpec.

    The specs carry ``state.tp_group`` and each layer's recompute mode (it counts layers within a stage) in
    their keyword arguments; DeepSpeed passes them unchanged to the constructors when it builds this rank's
    stage. The stages hold the layer counts of parallel/pipeline_split.py (``last_stage_layers``: the flag's
    value), kept as ``module.stage_layers``."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    tp_group = state.tp_group
    split = stage_layers(config.num_layers, state.pp_size, last=last_stage_layers,
                         head_layers=config.head_cost_in_layers())
    layers = []
    for spec in gpt_stage_specs(config, tp_group=tp_group, stage_layers=split):
        if spec.tied_key is not None:
            layers.append(TiedLayerSpec(spec.tied_key, spec.module_class, *spec.args, forward_fn=spec.forward_fn,
                                        tied_weight_attr=spec.tied_weight_attr, **spec.kwargs))
        else:
            layers.append(LayerSpec(spec.module_class, *spec.args, **spec.kwargs))
    # axes pipe, data, model: model fastest -> rank = pp*(dp*tp) + dp*tp + tp, as parallel.state.
    topology = PipeModelDataParallelTopology(num_pp=state.pp_size, num_mp=state.tp_size, num_dp=state.dp_size)

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # mean per-token loss of this micro-batch; the last stage's logits serve nothing after it
        return lm_loss(logits, labels, tp_group, overwrite_logits=True).mean()

    # spec indices where each stage starts: the embedding and stage 0's layers, ..., the last layers and the head
    bounds = [0, *(1 + sum(split[:s]) for s in range(1, len(split))), len(layers)]

    class SplitPipelineModule(PipelineModule):
        """DeepSpeed's PipelineModule with our stage boundaries in place of its partition methods."""

        def _partition_layers(self, method="uniform"):
            self.parts = bounds
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=bounds[stage], stop=bounds[stage + 1])

        def _synchronize_tied_weights(self):
            # An in-place broadcast of the tied embedding/head weight (at build and after a load), not part of any
            # graph: with grad mode on torch warns that c10d::broadcast_ has no autograd rule.
            with torch.no_grad():
                super()._synchronize_tied_weights()

    module = SplitPipelineModule(layers=layers, loss_fn=loss_fn, topology=topology, activation_checkpoint_interval=0)
    module.stage_layers = split
    return module


def _param_groups(module: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Megatron's split: weight decay on matrices, none on biases and norm weights (1-D). (len(shape): MS-AMP's
    FP8 weights are ScalingParameters, which have a shape but no dim().)"""
    decay, no_decay = [], []
    for p in module.parameters():
        if p.requires_grad:
            (decay if len(p.shape) >= 2 else no_decay).append(p)
    return [g for g in ({"params": decay, "weight_decay": weight_decay},
                        {"params": no_decay, "weight_decay": 0.0}) if g["params"]]


def grad_norm_fn(module: torch.nn.Module, state: ParallelState, pipelined: bool):
    """Global L2 norm of the gradients, each distinct weight counted once across TP and PP.

    TP-replicated weights (no ``tensor_model_parallel`` attribute) count on TP rank 0 only; a tied
    embedding repeated on the last pipeline stage counts on the first stage only.
    """
    counted, experts = [], []
    for name, p in module.named_parameters():
        if not getattr(p, "tensor_model_parallel", False) and state.tp_rank != 0:
            continue
        if pipelined and name.startswith("tied_modules.") and state.pp_rank != 0:
            continue
        (experts if getattr(p, "allreduce", True) is False else counted).append(p)  # DeepSpeed marks experts

    def squares(params) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64, device=params[0].device if params else "cpu")
        for p in params:
            if p.grad is not None:
                total += p.grad.detach().double().pow(2).sum()
        return total

    def norm() -> torch.Tensor:
        total = squares(counted)
        if experts:  # each expert-parallel rank holds other experts: their squares are summed over the EP group
            from deepspeed.utils import groups

            expert_group = groups._get_expert_parallel_group(experts[0].group_name)  # made in deepspeed.initialize
            expert_total = squares(experts)
            if dist.get_world_size(expert_group) > 1:
                dist.all_reduce(expert_total, group=expert_group)
            total = total + expert_total
        for size, group in ((state.tp_size, state.tp_group), (state.pp_size, state.pp_group)):
            if size > 1:
                dist.all_reduce(total, group=group)
        return total.sqrt()  # 0-dim fp64 on the gradients' device

    return norm


@dataclass
class Built:
    engine: object
    pipelined: bool
    config: GPTConfig
    attention_backend: str
    backward_scale: float = 1.0  # on the loss given to engine.backward (ZeRO-3 under Ulysses: SP)
    weights_drawn_on: str = "the CPU"  # where the initial weights were drawn, for the start-up line
    import_seconds: float = 0.0  # of the build: importing DeepSpeed (the first import in a rank)
    engine_seconds: float = 0.0  # of the build: DeepSpeed's initialize (the rest: the model and its weights)


def _device_args():
    """DeepSpeed sets its device from LOCAL_RANK unless told: a rank that sees only its own GPU (a site's
    --gpus-per-task, LUMI's per-task ROCR_VISIBLE_DEVICES) then asks for a GPU it cannot see. Ours is
    local_device_index() (LOCAL_RANK modulo the GPUs seen), the one the rank already uses."""
    return None if not torch.cuda.is_available() else SimpleNamespace(device_rank=local_device_index())


def build_engine(settings: Settings, precision: Precision, state: ParallelState, padded_vocab_size: int) -> Built:
    """The model, our optimizer and LR schedule (unless the DeepSpeed config brings its own) and DeepSpeed's engine,
    for this rank of ``state``."""
    started = time.perf_counter()
    import deepspeed

    import_seconds = time.perf_counter() - started

    optim = settings.optimizer
    config = model_config(settings, padded_vocab_size, precision.params_dtype)
    pipelined = state.pp_size > 1
    # DeepSpeed's comm layer wraps the process group that parallel.state created (PipelineModule needs it).
    deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)
    # 1. the model (TP-sliced layers for this rank's TP group; initial weights drawn on this rank's GPU, if any)
    on_gpu = torch.cuda.is_available() and not settings.model.use_cpu_initialization
    with weights_drawn_on(torch.device("cuda", local_device_index()) if on_gpu else None):
        last_stage_layers = settings.layout.decoder_last_pipeline_num_layers
        moe_mlp = moe_mlp_builder(state.dp_rank % config.moe_expert_parallel_size) if config.moe else None
        module = (pipeline_module(config, state, last_stage_layers) if pipelined else
                  GPTModel(config, tp_group=state.tp_group, sp_group=state.sp_group if state.sp_size > 1 else None,
                           moe_mlp=moe_mlp))
    if on_gpu:
        torch.cuda.empty_cache()  # the drawn matrices' blocks: not kept to fragment a tight run's memory
    # 2. the precision seam (FP8 wraps linears here; bf16/fp16/fp32: DeepSpeed casts)
    module = precision.wrap_model(module, state)
    # 3. the DeepSpeed config and our optimizer + LR schedule (unless the user's config defines them)
    ds_config = build_ds_config(settings, precision, on_cpu=not torch.cuda.is_available())
    optimizer = lr_scheduler = None
    own_lr = not scheduler_from_config(ds_config)
    param_groups = _param_groups(module, optim.weight_decay)  # by shape: before any ZeRO-3 partitioning
    if config.moe and optim.create_moe_param_group:
        param_groups = expert_param_groups(param_groups)
    if not optimizer_from_config(ds_config):
        kwargs = dict(lr=optim.lr, betas=(optim.adam_beta1, optim.adam_beta2), eps=optim.adam_eps)
        # an FP8 engine may bring its optimizer (MS-AMP: LBAdamW, which steps its FP8 weights)
        optimizer = precision.fp8.build_optimizer(param_groups, **kwargs) if precision.fp8 is not None else None
        if optimizer is None:
            if torch.cuda.is_available():
                kwargs["fused"] = True
            optimizer = AdamW(param_groups, **kwargs)
        if optim.zero_stage == 0 and precision.name == "fp32" and isinstance(optimizer, AdamW):
            optimizer.norm_fn = grad_norm_fn(module, state, pipelined)
            optimizer.max_norm = optim.clip_grad
            ds_config["gradient_clipping"] = 0.0  # we clip, with the correct norm
    schedule = schedule_from(settings)
    if optimizer is not None:
        # DeepSpeed's fp16/bf16 wrappers without ZeRO take a start-up optimizer.step() on zero gradients:
        # with lr 0 it moves no weight (AdamW's decoupled decay would), and its state is dropped below.
        for group in optimizer.param_groups:
            group["lr"] = 0.0
    if own_lr:
        lr_scheduler = (ScheduledLR(optimizer, schedule, apply_now=False) if optimizer is not None
                        else (lambda opt: ScheduledLR(opt, schedule)))
    if optim.zero_stage == 3:
        gather_whole_layers(module)
    scale = backward_scale(optim.zero_stage, state.sp_size)
    if scale != 1.0:
        partition_over_sequence_data_parallel(module, state, ds_config)
    # 4. DeepSpeed: the pipeline engine takes its grid from the PipelineModule, the plain one our mpu
    #    (MS-AMP: its DeepSpeed integration, same arguments, which wraps LBAdamW in its FP8 (ZeRO) optimizer)
    initialize = precision.fp8.deepspeed_initialize() if precision.fp8 is not None else deepspeed.initialize
    started = time.perf_counter()
    engine, _, _, _ = initialize(
        args=_device_args(),
        model=module, optimizer=optimizer, lr_scheduler=lr_scheduler, config=ds_config,
        model_parameters=None if optimizer is not None else param_groups,
        mpu=None if pipelined else state.mpu(), dist_init_required=False)
    engine_seconds = time.perf_counter() - started
    if optimizer is not None:
        if optimizer.state:
            # That start-up step advanced AdamW's step count, mis-scaling every early update (bias
            # correction); no real step has happened yet, so start the state afresh.
            optimizer.state.clear()
        if isinstance(lr_scheduler, ScheduledLR):
            lr_scheduler.apply()
        else:
            for group in optimizer.param_groups:
                group["lr"] = optim.lr
    return Built(engine, pipelined, config, _resolved_backend(module), scale, "the GPU" if on_gpu else "the CPU",
                 import_seconds, engine_seconds)


def gather_whole_layers(module: torch.nn.Module) -> None:
    """ZeRO-3 gathers each transformer layer's parameters once at the layer (a DeepSpeed "leaf module"), not at
    each of its norms and linears: the layer body then holds none of ZeRO-3's hooks, which DeepSpeed keeps out of
    torch.compile (each would split a compiled layer into small graphs), and one gather per layer replaces
    six smaller ones. The final norm likewise (compiled too when it is an RMSNorm)."""
    from deepspeed.utils import set_z3_leaf_modules

    leaves = [cls for cls in (TransformerLayer, FinalNorm) if any(isinstance(m, cls) for m in module.modules())]
    if leaves:
        set_z3_leaf_modules(module, leaves)


def unpatched_step_notice(engine) -> str | None:
    """A start-up notice where DeepSpeed's bf16 step on CUDA still reads the gradient norm on the host.

    patches/deepspeed (0002, 0003; applied in every image) keep that step on the device: GPT-1.3B on an H200
    runs 7% faster with them (bench/RESULTS.md). A pip install outside the images runs DeepSpeed as released.
    """
    optimizer = getattr(engine, "optimizer", None)
    on_cuda = torch.cuda.is_available()
    if not on_cuda or optimizer is None or type(optimizer).__name__ not in ("DeepSpeedZeroOptimizer", "BF16_Optimizer"):
        return None
    if hasattr(optimizer, "_can_step_on_device"):
        return None
    return ("notice: DeepSpeed without patches/deepspeed: each bf16 optimizer step waits for the host to read the "
            "gradient norm (7% of a GPT-1.3B step on an H200); the images apply them, elsewhere run "
            "`python patches/apply deepspeed --installed deepspeed` from the mds source tree")


def _resolved_backend(module: torch.nn.Module) -> str:
    for sub in module.modules():
        backend = getattr(sub, "resolved_backend", None)
        if backend is not None:
            return backend
    return "unknown"
