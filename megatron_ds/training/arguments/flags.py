"""The `entrypoint train` flag table: Megatron-DeepSpeed's pretrain_gpt.py names and meanings, and the no-ops.

Flags that can be filled from elsewhere (sources.py) default to None so that "the user gave it" is visible.
"""

from __future__ import annotations

import argparse
import sys

from megatron_ds.data.tokenizers import TOKENIZER_TYPES
from megatron_ds.parallel.overlap import MODES as OVERLAP_MODES
from megatron_ds.training.presets import PRESETS


class ConfigError(ValueError):
    """A usage or configuration error: names the flag (or file/variable) and the rule it breaks."""

    def __init__(self, flag: str | None, rule: str):
        self.flag, self.rule = flag, rule
        super().__init__(f"{flag}: {rule}" if flag else rule)


# Megatron flags that change nothing here (the fusion or implementation they select does not exist
# in mds, or is always on). Accepted with a one-line notice so old launch scripts keep working.
QUERY_KEY_LAYER_SCALING = "query-key layer scaling only matters for fp16 overflow in Megatron's fused softmax"
NO_OP_SWITCHES = {
    "--no-masked-softmax-fusion": "softmax fusion is the attention backend's business",
    "--no-bias-gelu-fusion": "mds's GeLU is exact unless --openai-gelu (the tanh approximation, what Megatron's "
                             "fused bias-GeLU computes)",
    "--no-bias-dropout-fusion": "mds has no bias-dropout fusion kernel",
    "--no-gradient-accumulation-fusion": "mds has no gradient-accumulation fusion kernel",
    "--no-async-tensor-model-parallel-allreduce": "compiled layers overlap TP comms (off: --tp-comm-overlap none)",
    "--no-query-key-layer-scaling": QUERY_KEY_LAYER_SCALING,
    "--apply-query-key-layer-scaling": QUERY_KEY_LAYER_SCALING,
    "--attention-softmax-in-fp32": "attention softmax always runs in fp32 or inside the flash kernel",
    "--accumulate-allreduce-grads-in-fp32": "DeepSpeed owns gradient accumulation",
    "--use-contiguous-buffers-in-local-ddp": "DeepSpeed owns the gradient buffers",
    "--no-contiguous-buffers-in-local-ddp": "DeepSpeed owns the gradient buffers",
    "--log-timers-to-tensorboard": "step time is always logged",
    "--log-batch-size-to-tensorboard": "the batch size is fixed and printed at start",
    "--log-validation-ppl-to-tensorboard": "validation perplexity is always logged",
    "--log-memory-to-tensorboard": "memory is always logged",
    "--log-optimizer-states-to-tensorboard": "not recorded by mds",
    "--no-log-loss-scale-to-tensorboard": "the loss scale is logged with --fp16 only",
}
NO_OP_WITH_VALUE = {
    "--dataset-impl": ({"mmap", "infer"}, "mds reads the mmap indexed format"),
    "--data-impl": ({"mmap", "infer"}, "mds reads the mmap indexed format"),
    "--tensorboard-queue-size": (None, "TensorBoard events are flushed at every log point"),
    "--num-workers": (None, "samples are read in-process from the memory-mapped dataset"),
    "--timing-log-level": (None, "step time is always logged"),
    "--DDP-impl": ({"local", "torch"}, "DeepSpeed owns data parallelism"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would sys.exit(2); we raise so callers can test and format
        raise ConfigError(None, message)


class _NoOp(argparse.Action):
    """Accepts a flag that is a no-op here and remembers a notice for the start-up log."""

    def __init__(self, option_strings, dest, why=None, allowed=None, **kw):
        self.why, self.allowed = why, allowed
        super().__init__(option_strings, dest=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        if self.allowed is not None and values not in self.allowed:
            raise ConfigError(option_string, f"only {sorted(self.allowed)} supported (got {values!r})")
        shown = option_string if values in (None, []) else f"{option_string} {values}"
        notices = getattr(namespace, "notices", None) or []
        notices.append(f"note: {shown} accepted and ignored: {self.why}")
        namespace.notices = notices


class _FP8Format(argparse.Action):
    """--fp8-format FORMAT, or the older switches --fp8-e4m3 / --fp8-hybrid (Megatron-DeepSpeed, MS-AMP's
    scripts): each sets the format and remembers which flag turned FP8 on, for the messages that name it."""

    def __init__(self, option_strings, dest, const=None, **kw):
        self.fixed = const
        super().__init__(option_strings, dest, nargs=0 if const else None, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        value = self.fixed or values
        previous = getattr(namespace, "fp8_format", None)
        if previous is not None and previous != value:
            raise ConfigError(option_string, f"{value} conflicts with {namespace.fp8_format_flag} ({previous})")
        namespace.fp8_format, namespace.fp8_format_flag = value, option_string


def _str2norm(value: str) -> str:
    table = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}
    if value.lower() not in table:
        raise argparse.ArgumentTypeError(f"choose LayerNorm or RMSNorm (got {value!r})")
    return table[value.lower()]


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="entrypoint train",
        usage="entrypoint train [--preset NAME] [model, parallel, batch, data, checkpoint, logging flags]",
        allow_abbrev=False,  # a typo must never silently match a longer flag
        description="Pretrain a GPT with tensor/sequence/pipeline/data parallelism and ZeRO. Flags follow "
        "Megatron-DeepSpeed's pretrain_gpt.py; a launch script only needs `python pretrain_gpt.py` replaced "
        "by `entrypoint train`. Precedence: flag > ALCF env (MODEL_SIZE_KEY, SEQ_LEN, MICRO_BATCH, GAS, "
        "ZERO_STAGE, PPSIZE, MPSIZE, USE_FLASH_ATTN_V2, SP_TYPE, SP/SPSIZE) > --preset > default.",
    )
    g = p.add_argument_group("model")
    g.add_argument("--preset", help=f"named model size; explicit flags win. One of: {', '.join(PRESETS)}")
    g.add_argument("--num-layers", type=int)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--ffn-hidden-size", type=int, help="default 4 x hidden (SwiGLU: Megatron's 2/3 rule)")
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--num-key-value-heads", type=int, help="grouped-query attention (default: = heads)")
    g.add_argument("--seq-length", type=int)
    g.add_argument("--max-position-embeddings", type=int, help="default: --seq-length")
    g.add_argument("--normalization", type=_str2norm, help="LayerNorm (default) or RMSNorm")
    g.add_argument("--norm-epsilon", "--layernorm-epsilon", dest="norm_epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true", default=None)
    g.add_argument("--openai-gelu", action="store_true",
                   help="GeLU's tanh approximation (GPT-2's gelu_new; what Megatron's fused bias-GeLU computes) "
                        "instead of the exact (erf) GeLU")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"])
    g.add_argument("--use-rotary-position-embeddings", action="store_true", help="= --position-embedding-type rope")
    g.add_argument("--rotary-base", "--rope-theta", dest="rotary_base", type=float, default=10000.0)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None)
    g.add_argument("--disable-bias-linear", action="store_true", default=None)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--use-cpu-initialization", action="store_true",
                   help="draw the initial weights on the CPU (the numbers of a CPU run; ~35 s per rank for "
                        "GPT-6.7B) instead of on this rank's GPU")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this x TP (as Megatron does)")
    g.add_argument("--attention-backend", choices=["auto", "flash2", "sdpa", "reference"],
                   help="auto picks flash2 when installed on a GPU, else torch SDPA")
    g.add_argument("--use-flash-attn-v2", action="store_true", default=None, help="= --attention-backend flash2")
    g.add_argument("--use-flash-attn-v1", "--use-flash-attn", dest="use_flash_attn_v1", action="store_true",
                   help="not available: falls back to the best backend with a warning")
    g.add_argument("--use-flash-attn-triton", action="store_true",
                   help="not available: falls back to the best backend with a warning")
    g.add_argument("--checkpoint-activations", action="store_true",
                   help="recompute each transformer layer in backward (= --recompute-granularity full "
                        "--recompute-method uniform)")
    g.add_argument("--recompute-activations", action="store_true",
                   help="= --recompute-granularity selective (Megatron's meaning)")
    g.add_argument("--recompute-granularity", choices=["full", "selective"],
                   help="full: whole transformer layers; selective: only their core attention")
    g.add_argument("--recompute-method", choices=["uniform", "block"],
                   help="with full: uniform = every layer, in chunks of --recompute-num-layers (one chunk per "
                        "layer under pipeline parallelism); block = the first --recompute-num-layers layers of "
                        "each pipeline stage")
    g.add_argument("--recompute-num-layers", type=int, default=1)
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="fraction of each head's dimensions that rotary embeddings rotate")
    g.add_argument("--ds-sequence-parallel-size", type=int, default=None,
                   help="DeepSpeed-Ulysses sequence parallelism: split each sequence over N ranks (taken from "
                        "data parallelism; TP = PP = 1; heads divisible by N). Default 1 (off), or SP/SPSIZE "
                        "from the ALCF environment")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Megatron's sharded optimizer state: ZeRO-1 here (a notice says so)")
    g.add_argument("--deepspeed-activation-checkpointing", action="store_true",
                   help="Megatron-DeepSpeed: use DeepSpeed's checkpointing for --checkpoint-activations")
    g.add_argument("--torch-compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile each transformer layer with torch.compile: norms, GeLU, dropout and residual "
                        "adds fused (bench/RESULTS.md has the speed-up; the start-up log prints the compile time). "
                        "Default: on with a CUDA GPU, off on CPU (there the compile time dominates small runs and "
                        "CI) and on ROCm (untested); off, with a notice, where mds cannot compile yet "
                        "(MS-AMP), where the explicit "
                        "flag is refused. A compile failure falls back to the eager layers with one warning. "
                        "--no-torch-compile: eager")
    g.add_argument("--tp-comm-overlap", nargs="?", const="auto", choices=["auto", "none", *OVERLAP_MODES],
                   help="overlap tensor-parallel communication with compute in the compiled layers (needs TP > 1 "
                        "and torch.compile). reorder: inductor issues each TP collective early and waits for it "
                        "late. wgrad: reorder, then a pass that moves a weight-gradient GEMM between each "
                        "backward collective's issue and its wait. pipeline (with --sequence-parallel, CUDA): "
                        "also torch's asynchronous TP, which splits each all-gather -> GEMM and GEMM -> "
                        "reduce-scatter into chunks over symmetric memory. chunked (with --sequence-parallel): "
                        "reorder, and each sequence-parallel GEMM split by the ranks' sequence chunks so the "
                        "forward's gathers and scatters run beside a GEMM too. halves (micro batch >= 2): reorder, "
                        "and each layer runs the micro batch's two halves interleaved, so one half's collectives "
                        "run beside the other's GEMMs (dropout draws each half's masks: eager runs it too, as the "
                        "compiled run's twin). The bare flag: reorder. Default: reorder wherever the layers "
                        "compile with TP > 1 (GPT-6.7B TP=2+SP on 2 x H100: 1.03x none; pipeline 0.87-0.97x; "
                        "chunked 0.965x reorder), else off. none: off")

    g = p.add_argument_group("precision")
    g.add_argument("--bf16", action="store_true", default=None)
    g.add_argument("--fp16", action="store_true", default=None)
    g.add_argument("--loss-scale", type=float, help="fp16 static loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)

    g = p.add_argument_group("FP8 (beside --bf16 or --fp16: only the transformer layers' matrix multiplies are FP8)")
    g.add_argument("--fp8-format", action=_FP8Format, choices=["e4m3", "hybrid"],
                   help="turn FP8 on: e4m3 everywhere, or hybrid (e4m3 forward, e5m2 gradients)")
    g.add_argument("--fp8-e4m3", dest="fp8_format", action=_FP8Format, const="e4m3", help="= --fp8-format e4m3")
    g.add_argument("--fp8-hybrid", dest="fp8_format", action=_FP8Format, const="hybrid",
                   help="= --fp8-format hybrid")
    g.add_argument("--fp8-engine", choices=["auto", "te", "msamp", "torchao"], default="auto",
                   help="which library runs FP8: auto = Transformer Engine where it can run, else torchao "
                        "(the engine that ran is printed at start)")
    g.add_argument("--fp8-recipe", choices=["delayed", "tensorwise", "rowwise", "blockwise", "mxfp8"],
                   help="Megatron-LM's names: delayed (Transformer Engine's scaling), tensorwise (dynamic, per "
                        "tensor: torchao's default), rowwise (torchao, per row, e4m3 gradients); blockwise and mxfp8 "
                        "are refused (mds runs no block-scaling recipe). Default: the engine's own")
    g.add_argument("--fp8-margin", type=int, default=0, help="delayed scaling margin (Transformer Engine)")
    g.add_argument("--fp8-interval", type=int, default=1, help="delayed scaling update interval (Transformer Engine)")
    g.add_argument("--fp8-amax-history-len", type=int, default=1,
                   help="delayed scaling amax history length (Transformer Engine)")
    g.add_argument("--fp8-amax-compute-algo", choices=["most_recent", "max"], default="most_recent",
                   help="delayed scaling: amax from the most recent value or the history's max (Transformer Engine)")
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="local",
                   help="local: mds's layers; transformer_engine: FP8 through Transformer Engine (needs it installed)")
    g.add_argument("--msamp", action="store_true", help="FP8 through MS-AMP (MS-AMP's Megatron-DeepSpeed patch)")
    g.add_argument("--msamp-opt-level", choices=["O1", "O2", "O3"], default="O2",  # the MS-AMP patch's default
                   help="MS-AMP: O1 FP8 GEMMs, weights and weight gradients (LBAdamW, fp32 moments); O2 + uint8/fp16 "
                        "Adam moments; O3 + MS-AMP's FP8 ZeRO (--zero-stage 1 or 2). Default O2, as MS-AMP's "
                        "Megatron-DeepSpeed patch")

    g = p.add_argument_group("parallelism and DeepSpeed")
    g.add_argument("--tensor-model-parallel-size", type=int)
    g.add_argument("--pipeline-model-parallel-size", type=int)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, metavar="N",
                   help="transformer layers on the last pipeline stage; the others share the rest (default: fewer "
                        "on the last stage, by the output head's FLOPs: GPT-1.3B at PP=2 runs 13 | 11)")
    g.add_argument("--sequence-parallel", action="store_true", default=None)
    g.add_argument("--no-pipeline-parallel", action="store_true",
                   help="plain DeepSpeed engine, no pipeline engine (needs PP=1; allows ZeRO-2/3)")
    g.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3])
    g.add_argument("--deepspeed", action="store_true", help="accepted for compatibility: mds always uses DeepSpeed")
    g.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config",
                   help="DeepSpeed JSON; must agree with the flags on batch sizes, precision and ZeRO stage")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo", "ccl", "mpi"],
                   help="default: nccl on GPUs (RCCL on ROCm), gloo on CPU")
    g.add_argument("--nproc-per-node", type=int, help="ranks to spawn on this node (default: its GPUs, or 1)")
    g.add_argument("--dry-run", action="store_true",
                   help="validate the flags, print the launch plan and the estimated GPU memory per GPU (model "
                        "state, activations, logits), and exit without starting a rank")
    g.add_argument("--profile", help="site profile for the NCCL/RCCL environment (default: detected)")
    g.add_argument("--master-addr", help="overrides MASTER_ADDR (default: the first host of the job, torchrun's name)")
    g.add_argument("--master-port", type=int, help="overrides MASTER_PORT (default: derived from the job id; without a "
                                                   "launcher, the port of the store the launcher serves)")

    g = p.add_argument_group("mixture of experts", "Megatron-DeepSpeed's MoE flags, through DeepSpeed's MoE layer "
                             "(docs/training.md#mixture-of-experts)")
    g.add_argument("--num-experts", type=int, nargs="+", default=[1],
                   help="experts per expert layer: one number, or one per expert layer (PR-MoE). 1: dense")
    g.add_argument("--expert-interval", type=int, default=2,
                   help="layers n (from 1) with n %% interval == 0 carry experts (default 2)")
    g.add_argument("--moe-expert-parallel-size", type=int, default=1,
                   help="ranks each layer's experts are spread over, taken from data parallelism (default 1)")
    g.add_argument("--topk", type=int, default=1, help="experts per token: 1 or 2 (default 1)")
    g.add_argument("--moe-loss-coeff", type=float, default=0.1,
                   help="scale of the gates' load-balancing loss added to the LM loss (default 0.1)")
    g.add_argument("--moe-train-capacity-factor", type=float, default=1.0)
    g.add_argument("--moe-eval-capacity-factor", type=float, default=1.0)
    g.add_argument("--moe-min-capacity", type=int, default=4, help="token slots per expert at least (default 4)")
    g.add_argument("--disable-moe-token-dropping", dest="moe_token_dropping", action="store_false",
                   help="no capacity limit: every token reaches its experts")
    g.add_argument("--disable-moe-top2-2nd-expert-sampling", dest="moe_top2_2nd_expert_sampling",
                   action="store_false", help="top-2: the second expert is the gate's second best, not sampled")
    g.add_argument("--create-moe-param-group", action="store_true",
                   help="the experts' parameters in optimizer groups of their own (needed with ZeRO-1/2)")
    g.add_argument("--mlp-type", choices=["standard", "residual"], default="standard",
                   help="residual: PR-MoE, a dense MLP beside the experts")
    g.add_argument("--enable-expert-tensor-parallelism", action="store_true",
                   help="refused: mds does not split experts over tensor-parallel ranks yet")

    g = p.add_argument_group("batch, iterations, schedule")
    g.add_argument("--micro-batch-size", type=int)
    g.add_argument("--global-batch-size", type=int, help="default: micro batch x data-parallel size (x GAS)")
    g.add_argument("--train-iters", type=int)
    g.add_argument("--lr", type=float)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--train-samples", type=int,
                   help="train for this many samples instead of --train-iters (iterations = samples // global batch)")
    g.add_argument("--train-tokens", type=int, help="also stop once this many tokens are consumed")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root"],
                   default="linear")
    g.add_argument("--lr-decay-iters", type=int, help="default: --train-iters")
    g.add_argument("--lr-decay-samples", type=int, help="sample-based training: default --train-samples")
    g.add_argument("--lr-decay-tokens", type=int, help="decay by consumed tokens (overrides iterations/samples)")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-warmup-tokens", type=int, help="warm up over this many consumed tokens")
    g.add_argument("--lr-warmup-fraction", type=float, help="warmup as a fraction of the decay span")
    g.add_argument("--override-opt_param-scheduler", "--override-lr-scheduler", dest="override_opt_param_scheduler",
                   action="store_true", help="on resume, the schedule's shape comes from the flags")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-lr-scheduler",
                   dest="use_checkpoint_opt_param_scheduler", action="store_true",
                   help="on resume, the schedule's shape comes from the checkpoint (default: they must agree)")
    g.add_argument("--optimizer", choices=["adam", "adamw"], default="adam", help="Adam with decoupled weight decay")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0, help="gradient-norm clipping (0 disables)")
    g.add_argument("--check-for-nan-in-loss-and-grad", action=argparse.BooleanOptionalAction, default=True,
                   help="stop at a NaN/inf loss or gradient norm before saving it, exit 65, no restart (default on; "
                        "fp16 loss-scale skips are not stops)")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--exit-interval", type=int, help="exit after this iteration (saving first with --save)")
    g.add_argument("--exit-duration-in-mins", type=float, help="exit (saving first) after this many minutes")
    g.add_argument("--exit-signal-handler", action="store_true", help="on SIGTERM: save and exit cleanly")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", help="prefix, or weighted list: 0.3 a 0.7 b")
    g.add_argument("--split", default="969, 30, 1")
    g.add_argument("--data-cache-path", help="where sample indices are cached (default: next to the data)")
    g.add_argument("--data-order", choices=("megatron", "mds"), default="megatron",
                   help="megatron (default): Megatron-DeepSpeed's samples in its order (split, shuffles, blending); "
                        "mds: the order mds used before (a fresh permutation per epoch, its own blending), for runs "
                        "begun with it that must resume on the same samples (each order has its own index cache)")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default="GPT2BPETokenizer",
                   help="default GPT2BPETokenizer, as pretrain_gpt.py")
    g.add_argument("--vocab-file")
    g.add_argument("--merge-file")
    g.add_argument("--tokenizer-model", help="HFTokenizer: tokenizer.json or a directory with one; "
                   "SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer: the SentencePiece "
                   "tokenizer.model")
    g.add_argument("--vocab-size", type=int, help="NullTokenizer: its vocabulary size")

    g = p.add_argument_group("checkpoints")
    g.add_argument("--save")
    g.add_argument("--load")
    g.add_argument("--save-interval", type=int)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--finetune", action="store_true", help="load weights only; iteration restarts at 0")
    g.add_argument("--keep-last-n-checkpoints", type=int)
    g.add_argument("--ckpt-step", type=int, metavar="N", help="load iteration N of --load, not the one `latest` names")
    g.add_argument("--no-ckpt-fallback", action="store_true",
                   help="when `latest` names a partial or corrupt checkpoint (or nothing), exit 2 naming the newest "
                        "complete one instead of resuming from it with a warning")
    g.add_argument("--async-save", action="store_true",
                   help="copy each checkpoint to host memory and write it in the background while training goes on")

    g = p.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--tensorboard-dir")
    g.add_argument("--metrics-file", help="append one JSON object per logged iteration / evaluation")
    g.add_argument("--peak-tflops", type=float,
                   help="peak dense TFLOP/s per device for MFU (env MDS_PEAK_TFLOPS; default by device)")
    g.add_argument("--wandb-project", help="log to Weights & Biases under this project, from the last rank "
                   "(needs megatron_ds[wandb]; WANDB_MODE=offline keeps the run on disk)")
    g.add_argument("--wandb-exp-name", help="the W&B run name (default: WANDB_NAME, else one W&B makes up)")
    g.add_argument("--wandb-save-dir", help="where W&B keeps the run's files (default: WANDB_DIR, else <--save>/wandb, "
                   "else ./wandb)")
    g.add_argument("--wandb-entity", help="the W&B team or user (default: WANDB_ENTITY, else your default entity)")

    g = p.add_argument_group("hangs and restarts", "a rank with no progress within its allowance is a hang: "
                             "stacks dumped, the stuck rank named, exit 124 (README: Launching)")
    g.add_argument("--watchdog-timeout", type=float, metavar="SECONDS",
                   help="seconds a training step may go without progress (default: adaptive, max(180, 20 x the "
                        "median recent step time); 0 turns the watchdog off)")
    g.add_argument("--watchdog-slow-phase-timeout", type=float, default=1800.0, metavar="SECONDS",
                   help="allowance for start-up (up to the 4th step: compilation), evaluation and checkpoint saving "
                        "(default 1800)")
    g.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="restart the node's ranks up to N times after a failure or a hang, resuming from --load's "
                        "latest checkpoint; the same failure at the same iteration twice in a row stops (default 0). "
                        "A single rank then runs as a supervised child; under torchrun or one scheduler task per "
                        "rank that launcher owns the ranks, and mds says so")
    g.add_argument("--straggler-factor", type=float, default=1.5, metavar="X",
                   help="at each log point, name the rank whose own work per step (data path + forward) is more "
                        "than X times the other ranks' median (metrics: straggler_rank); 0 turns it off (default 1.5)")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0, metavar="MIN",
                   help="the process groups' own timeout for a collective (init_process_group), as Megatron "
                        "(default 10)")

    g = p.add_argument_group("accepted, no effect in mds")
    for flag, why in NO_OP_SWITCHES.items():
        g.add_argument(flag, action=_NoOp, nargs=0, why=why, help=f"no-op: {why}")
    for flag, (allowed, why) in NO_OP_WITH_VALUE.items():
        g.add_argument(flag, action=_NoOp, allowed=allowed, why=why, help=f"no-op: {why}")
    return p


def print_notices(args: argparse.Namespace, stream=sys.stderr) -> None:
    """The no-op and fallback notices parse_args collected, for the start-up log."""
    for line in args.notices:
        print(line, file=stream)
