"""How much GPU memory a run needs per GPU, from its shape and layout alone: checked before any GPU work, printed
by `entrypoint train --dry-run`, and the reason a size that cannot fit is refused (exit 2) with a layout that fits.

Per GPU, the largest pipeline stage's:
- training state (bytes per parameter of the stage's TP slice): bf16/fp16 weights 2 and gradients 2, fp32 master
  weights and Adam moments 12 (fp32 runs: weights 4, gradients 4, moments 8); ZeRO-1 shards the 12 over the
  data-parallel ranks, ZeRO-2 the gradients too, ZeRO-3 everything;
- activations (Megatron's count for a layer with fused attention, 34 bytes per hidden element per token in 16-bit
  for GPT with dropout, taken element by element so that GQA, SwiGLU and the FFN width count (``layer_bytes``),
  divided by TP under sequence parallelism, plus the two inputs the compiled TP layers keep gathered: 4 bytes;
  with full recompute, each layer's 16-bit input and one layer's activations; Ulysses: q, k, v and the attention
  output at full sequence, 8 bytes), for each micro-batch a stage holds at once (1F1B: PP - stage), over the
  tokens of this rank (Ulysses divides the sequence); an expert layer adds what DeepSpeed's gated dispatch keeps
  (``moe_layer_bytes``: the experts run on their capacity's slots instead of the tokens);
- the output head's logits (16-bit, vocab / TP), on the last stage.
torch's caching allocator peak (``mem_gib`` of the metrics) is what this predicts; the CUDA context and NCCL's
buffers come on top (about 1-3 GiB).
"""

from __future__ import annotations

import math
import shutil
import subprocess
from dataclasses import dataclass, replace

from megatron_ds.arguments.settings import Settings, model_config
from megatron_ds.model.config import GPTConfig, pad_vocab_size
from megatron_ds.model.moe import capacity
from megatron_ds.parallel.pipeline_split import stage_layers

GIB = 1 << 30
GATHERED_INPUT_BYTES = 4  # QKV and FC1 inputs kept all-gathered by the compiled TP layers under SP
ULYSSES_BYTES = 8  # Ulysses: q, k, v and the attention output kept at full sequence (heads / SP): 4 x 2 bytes


@dataclass(frozen=True)
class Layout:
    """What the estimate depends on beyond the model's shape."""

    tp: int = 1
    pp: int = 1
    dp: int = 1  # data-parallel ranks (Ulysses ranks included: ZeRO shards over them too)
    ulysses: int = 1
    zero_stage: int = 0
    micro_batch: int = 1
    micro_batches: int = 1  # per optimizer step and data-parallel rank
    dtype_bytes: int = 2  # 2: bf16/fp16, 4: fp32
    sequence_parallel: bool = False
    recompute: bool = False
    last_stage_layers: int | None = None
    ep: int = 1  # MoE expert-parallel ranks: each holds 1/ep of every MoE layer's experts


@dataclass(frozen=True)
class Estimate:
    state_gib: float
    activations_gib: float
    logits_gib: float
    stage: int  # the pipeline stage with the largest need

    @property
    def total_gib(self) -> float:
        return self.state_gib + self.activations_gib + self.logits_gib

    def describe(self) -> str:
        where = f" (pipeline stage {self.stage})" if self.stage else ""
        return (f"{self.total_gib:.1f} GiB per GPU{where}: training state {self.state_gib:.1f}, activations "
                f"{self.activations_gib:.1f}, logits {self.logits_gib:.1f}")


def _state_bytes_per_parameter(layout: Layout) -> float:
    if layout.dtype_bytes == 4:
        weights, grads, optimizer = 4.0, 4.0, 8.0
    else:
        weights, grads, optimizer = 2.0, 2.0, 12.0
    shard = max(1, layout.dp)
    if layout.zero_stage >= 1:
        optimizer /= shard
    if layout.zero_stage >= 2:
        grads /= shard
    if layout.zero_stage >= 3:
        weights /= shard
    return weights + grads + optimizer


def layer_bytes(config: GPTConfig) -> float:
    """16-bit bytes per hidden element per token that a compiled dense layer keeps for backward, with fused attention
    (no [s, s] scores). Megatron's 34 for GPT with dropout, counted by what each tensor is: the two norms' inputs (4);
    attention's input (2), q, k and v (2 x (h + 2 kv) / h: 6 without GQA) and its output (2); the MLP's input (2),
    fc1's output and fc2's input (2 x 2f / h; SwiGLU's gate, up and their product 2 x 3f / h: the compiled layer
    recomputes silu(gate)); a 1-byte mask per hidden dropout. Measured on one H200 (bench/RESULTS.md tables 1, 2,
    20): GPT-1.3B 32.9 with dropout (34 here), 32.5 without (32); LLaMA-style 1.3B, GQA 16/8, SwiGLU 5504, no
    dropout, 28.9 (30.1)."""
    h = config.hidden_size
    kv = config.num_key_value_heads * config.head_dim
    fc = (3 if config.swiglu else 2) * config.ffn_hidden_size
    masks = 2 if config.hidden_dropout > 0 else 0
    return 4 + 2 + 2 * (h + 2 * kv) / h + 2 + 2 + 2 * fc / h + masks


def moe_layer_bytes(config: GPTConfig, experts: int, tokens: float, dtype_bytes: int) -> float:
    """Bytes an expert layer of ``experts`` keeps for backward beyond the dense layer's MLP (which ``layer_bytes``
    counts), for ``tokens`` tokens of one micro-batch on this rank: what autograd saves in DeepSpeed's MoE as installed
    (deepspeed/moe/sharded_moe.py, whose MOELayer routes sparsely: no [tokens, experts, capacity] dispatch or
    combine mask is built), counted from its shapes:

    - the gate, in fp32: its GEMM's input (an fp32 copy of the [tokens, h] input, 4h) and weight (a copy in 16-bit
      runs, once per layer), the softmax probabilities [tokens, experts] (4e); top-1 keeps its one-hot mask in
      int64 (8e), top-2 both one-hot masks in fp32 (8e; the first expert's bool mask that masks the logits for the
      second pick is freed with that pick, which has no gradient) and four [tokens] fp32 vectors (16);
    - the dispatch: the experts' input [experts, capacity, h] (after the all-to-all under expert parallelism; the
      buffer before it is not kept) and every expert MLP's activations on its capacity slots, where the dense MLP
      had them on the tokens: top-2 doubles them, and --moe-min-capacity can raise them; the gather's int64 index
      per slot (8);
    - the combine: each of the top-k routes' expert output [k, tokens, h] (weighted by its fp32 gate value in
      fp32, 4) and its int64 slot (8);
    - PR-MoE (--mlp-type residual): the dense MLP beside the experts, the two outputs it mixes and their two
      coefficients.
    Capacity = max(ceil(tokens / experts x factor x k), --moe-min-capacity), slots = experts x capacity, on every
    expert-parallel rank alike (it receives capacity slots of each of its experts from each rank). Without token
    dropping the busiest expert sets the capacity; this counts the balanced load (factor 1), a lower bound.
    """
    h, e, k, d = config.hidden_size, experts, config.topk, dtype_bytes
    mlp = (h + (4 if config.swiglu else 2) * config.ffn_hidden_size) * d  # MLP input, fc1 output(s), fc2 input
    if config.moe_token_dropping:
        slots = e * capacity(tokens, e, config.moe_train_capacity_factor, k, config.moe_min_capacity)
    else:
        slots = e * capacity(tokens, e, 1.0, k, 0)
    residual = config.mlp_type == "residual"
    gate_input = 0 if d == 4 and residual else 4 * h  # fp32: the input itself, which the residual MLP keeps too
    gate = gate_input + 4 * e + (8 * e if k == 1 else 8 * e + 16)
    combine = k * (h * d + 4 + 8)
    beside = mlp + 2 * h * d + 2 * d if residual else 0
    gate_weight = 4 * e * h if d != 4 else 0  # its fp32 copy, once per layer
    return tokens * (gate + combine + beside - mlp) + slots * (mlp + 8) + gate_weight


def estimate(config: GPTConfig, layout: Layout) -> Estimate:
    """The peak of the pipeline stage that needs most (see the module docstring)."""
    t = layout.tp
    experts = config.expert_parameters()  # whole MLPs on each TP rank; 1/ep of them on each expert-parallel rank
    layer_params = (config.num_parameters(include_embeddings=False) - config.hidden_size - experts) / config.num_layers
    expert_state = _state_bytes_per_parameter(replace(layout, dp=max(1, layout.dp // layout.ep)))
    vocab_params = config.vocab_size * config.hidden_size / t
    position_params = (config.max_position_embeddings * config.hidden_size
                       if config.position_embedding_type == "learned_absolute" else 0)
    tokens = layout.micro_batch * config.seq_length / max(1, layout.ulysses)
    per_layer = layer_bytes(config) * layout.dtype_bytes / 2 / (t if layout.sequence_parallel else 1)
    if layout.sequence_parallel and t > 1:
        per_layer += GATHERED_INPUT_BYTES
    if layout.ulysses > 1:
        per_layer += ULYSSES_BYTES * layout.dtype_bytes / 2
    split = stage_layers(config.num_layers, layout.pp, last=layout.last_stage_layers,
                         head_layers=config.head_cost_in_layers())
    best = None
    moe_extra = [moe_layer_bytes(config, n, tokens, layout.dtype_bytes) if n > 1 else 0.0
                 for n in config.experts_per_layer]
    for stage, layers in enumerate(split):
        first, last = stage == 0, stage == len(split) - 1
        stage_moe = moe_extra[sum(split[:stage]):sum(split[:stage + 1])]
        params = layers * layer_params / t
        if first:
            params += vocab_params + position_params
        if last and (not first or not config.tied_embeddings):
            params += vocab_params  # the output head (a tied copy on the last stage too)
        in_flight = min(layout.pp - stage, layout.micro_batches)
        hidden = tokens * config.hidden_size
        if layout.recompute:  # each layer's input kept, one layer's activations alive at a time
            acts = in_flight * layers * hidden * layout.dtype_bytes / (t if layout.sequence_parallel else 1)
            acts += hidden * per_layer + max(stage_moe, default=0.0)
        else:
            acts = in_flight * (layers * hidden * per_layer + sum(stage_moe))
        logits = tokens * config.vocab_size / t * layout.dtype_bytes if last else 0.0
        expert_params = experts * layers / config.num_layers / layout.ep  # MoE has no PP: one stage holds them all
        state = params * _state_bytes_per_parameter(layout) + expert_params * expert_state
        found = Estimate(state / GIB, acts / GIB, logits / GIB, stage)
        if best is None or found.total_gib > best.total_gib:
            best = found
    return best


def gpu_memory_gib() -> float | None:
    """The smallest GPU's memory on this node, from nvidia-smi (no CUDA context in this process: ranks are
    spawned after validation), or None where it cannot tell (no NVIDIA GPU, no nvidia-smi)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    sizes = [float(x) for x in out.stdout.split() if x.strip().replace(".", "", 1).isdigit()]
    return min(sizes) / 1024 if out.returncode == 0 and sizes else None  # MiB -> GiB


def layout_that_fits(config: GPTConfig, layout: Layout, world: int, limit_gib: float) -> str | None:
    """The first change (cheapest first) whose estimate fits in limit_gib, as flags, or None."""
    candidates = []
    if layout.micro_batch > 1:
        candidates.append(("--micro-batch-size 1", replace(layout, micro_batch=1,
                                                            micro_batches=layout.micro_batches * layout.micro_batch)))
    if not layout.recompute:
        candidates.append(("--checkpoint-activations", replace(layout, recompute=True)))
    for stage in (2, 3):
        if layout.dp > 1 and layout.zero_stage < stage and layout.pp == 1:
            candidates.append((f"--zero-stage {stage}", replace(layout, zero_stage=stage)))
    model_parallel = layout.tp * layout.pp
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8, 16):
            if tp * pp <= model_parallel or world % (tp * pp) or config.num_attention_heads % tp \
                    or config.num_layers < pp:
                continue
            dp = world // (tp * pp)
            candidates.append((f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp}"
                               + (" --sequence-parallel" if tp > 1 else ""),
                               replace(layout, tp=tp, pp=pp, dp=dp, sequence_parallel=tp > 1,
                                       micro_batches=max(1, math.ceil(layout.micro_batches * layout.dp / dp)))))
    candidates.sort(key=lambda c: 0 if c[0].startswith("--micro") else 1)
    for flags, changed in candidates:
        for extra_flags, extra in (("", {}), (" --checkpoint-activations", {"recompute": True}),
                                   (" --micro-batch-size 1 --checkpoint-activations",
                                    {"recompute": True, "micro_batch": 1})):
            trial = replace(changed, **extra)
            if estimate(config, trial).total_gib <= limit_gib:
                return (flags + extra_flags).strip()
    return None


def for_settings(settings: Settings) -> tuple[GPTConfig, Layout]:
    """The model a run builds (settings.model_config, as the engine builds it) and its layout (the vocabulary as
    padded for GPT-2's 50,257 tokens where the tokenizer, not yet loaded, decides it: the estimate's logits and
    embedding move by well under 1%)."""
    model, lay, optim = settings.model, settings.layout, settings.optimizer
    tp, pp = lay.tensor_model_parallel_size, lay.pipeline_model_parallel_size
    config = model_config(settings, pad_vocab_size(model.vocab_size or 50257, model.make_vocab_size_divisible_by, tp))
    layout = Layout(tp=tp, pp=pp, dp=max(1, lay.world_size // (tp * pp)),  # Ulysses ranks shard ZeRO's state too
                    ulysses=lay.ds_sequence_parallel_size or 1, zero_stage=optim.zero_stage or 0,
                    micro_batch=lay.micro_batch_size, micro_batches=lay.gradient_accumulation_steps,
                    dtype_bytes=2 if (settings.precision.bf16 or settings.precision.fp16) else 4,
                    sequence_parallel=bool(lay.sequence_parallel), recompute=model.recompute_granularity == "full",
                    last_stage_layers=lay.decoder_last_pipeline_num_layers, ep=lay.moe_expert_parallel_size or 1)
    return config, layout


REFUSE_ABOVE = 1.10  # the estimate is within ~6% of measured peaks: a run is refused only when clearly too large


def unestimated(settings: Settings) -> str | None:
    """Why the estimate does not bound this run (then it is printed but refuses nothing), or None."""
    if settings.precision.fp8_format or settings.precision.msamp:
        return "FP8 keeps less than the 16-bit count (GPT-1.3B: 54 against 72 GiB)"
    section = (settings.optimizer.ds_config_file or {}).get("zero_optimization") or {}
    if "offload_optimizer" in section or "offload_param" in section:
        return "ZeRO offload (the DeepSpeed config) keeps state in host memory"
    return None


def check_fits(settings: Settings, gpu_gib: float | None) -> Estimate:
    """The estimate; ConfigError (exit 2, before any GPU work) when it exceeds the GPUs' memory by more than its
    own error, naming what is needed, what the GPUs have and a layout that fits. A borderline run starts (and
    meets the out-of-memory message if it does not fit); FP8 and offloaded runs are not refused."""
    from megatron_ds.arguments import ConfigError

    config, layout = for_settings(settings)
    found = estimate(config, layout)
    if gpu_gib is not None and found.total_gib > REFUSE_ABOVE * gpu_gib and unestimated(settings) is None:
        fits = layout_that_fits(config, layout, settings.layout.world_size, gpu_gib)
        way_out = (f"a layout that fits: {fits}" if fits else
                   "no layout of these GPUs fits it: use more GPUs (nodes) or a smaller model")
        raise ConfigError("--micro-batch-size" if layout.micro_batch > 1 else "--tensor-model-parallel-size",
                          f"this run needs about {found.describe()}, and the GPUs here have {gpu_gib:.1f} GiB "
                          f"each; {way_out} (`entrypoint train ... --dry-run` prints the estimate of a layout)")
    return found
