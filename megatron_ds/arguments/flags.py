"""The `entrypoint train` flag table: Megatron-DeepSpeed's pretrain_gpt.py names and meanings, and the no-ops.

Flags that can be filled from elsewhere (sources.py) default to None so that "the user gave it" is visible.
"""

from __future__ import annotations

import argparse

from megatron_ds.arguments.presets import PRESETS
from megatron_ds.data.tokenizers import TOKENIZER_TYPES
from megatron_ds.parallel.overlap import MODES as OVERLAP_MODES


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


def flag(*names: str, **options) -> tuple[tuple[str, ...], dict]:
    """One row of the flag table: argparse's add_argument arguments."""
    return names, options


# The flag table: (group title, group description), then its flags, in --help's order.
FLAGS: list[tuple[tuple[str, str | None], list[tuple[tuple[str, ...], dict]]]] = [
    (("model", None), [
        flag("--preset", help=f"named model size; explicit flags win. One of: {', '.join(PRESETS)}"),
        flag("--num-layers", type=int),
        flag("--hidden-size", type=int),
        flag("--ffn-hidden-size", type=int, help="default 4 x hidden (SwiGLU: Megatron's 2/3 rule)"),
        flag("--num-attention-heads", type=int),
        flag("--num-key-value-heads", type=int, help="grouped-query attention (default: = heads)"),
        flag("--seq-length", type=int),
        flag("--max-position-embeddings", type=int, help="default: --seq-length"),
        flag("--normalization", type=_str2norm, help="LayerNorm (default) or RMSNorm"),
        flag("--norm-epsilon", "--layernorm-epsilon", dest="norm_epsilon", type=float, default=1e-5),
        flag("--swiglu", action="store_true", default=None),
        flag("--openai-gelu", action="store_true",
             help="GeLU's tanh approximation (GPT-2's gelu_new; what Megatron's fused bias-GeLU computes) "
                  "instead of the exact (erf) GeLU"),
        flag("--position-embedding-type", choices=["learned_absolute", "rope"]),
        flag("--use-rotary-position-embeddings", action="store_true", help="= --position-embedding-type rope"),
        flag("--rotary-base", "--rope-theta", dest="rotary_base", type=float, default=10000.0),
        flag("--untie-embeddings-and-output-weights", action="store_true", default=None),
        flag("--disable-bias-linear", action="store_true", default=None),
        flag("--init-method-std", type=float, default=0.02),
        flag("--use-cpu-initialization", action="store_true",
             help="draw the initial weights on the CPU (the numbers of a CPU run; slower for large models) "
                  "instead of on this rank's GPU"),
        flag("--hidden-dropout", type=float, default=0.1),
        flag("--attention-dropout", type=float, default=0.1),
        flag("--make-vocab-size-divisible-by", type=int, default=128,
             help="pad the vocabulary to a multiple of this x TP (as Megatron does)"),
        flag("--attention-backend", choices=["auto", "flash2", "sdpa", "reference"],
             help="auto picks flash2 when installed on a GPU, else torch SDPA"),
        flag("--use-flash-attn-v2", action="store_true", default=None, help="= --attention-backend flash2"),
        flag("--use-flash-attn-v1", "--use-flash-attn", dest="use_flash_attn_v1", action="store_true",
             help="not available: falls back to the best backend with a warning"),
        flag("--use-flash-attn-triton", action="store_true",
             help="not available: falls back to the best backend with a warning"),
        flag("--checkpoint-activations", action="store_true",
             help="recompute each transformer layer in backward (= --recompute-granularity full "
                  "--recompute-method uniform)"),
        flag("--recompute-activations", action="store_true",
             help="= --recompute-granularity selective (Megatron's meaning)"),
        flag("--recompute-granularity", choices=["full", "selective"],
             help="full: whole transformer layers; selective: only their core attention"),
        flag("--recompute-method", choices=["uniform", "block"],
             help="with full: uniform = every layer, in chunks of --recompute-num-layers (one chunk per "
                  "layer under pipeline parallelism); block = the first --recompute-num-layers layers of "
                  "each pipeline stage"),
        flag("--recompute-num-layers", type=int, default=1),
        flag("--rotary-percent", type=float, default=1.0,
             help="fraction of each head's dimensions that rotary embeddings rotate"),
        flag("--ds-sequence-parallel-size", type=int, default=None,
             help="DeepSpeed-Ulysses sequence parallelism: split each sequence over N ranks (taken from "
                  "data parallelism; TP = PP = 1; heads divisible by N). Default 1 (off), or SP/SPSIZE "
                  "from the ALCF environment"),
        flag("--use-distributed-optimizer", action="store_true",
             help="Megatron's sharded optimizer state: ZeRO-1 here (a notice says so)"),
        flag("--deepspeed-activation-checkpointing", action="store_true",
             help="Megatron-DeepSpeed: use DeepSpeed's checkpointing for --checkpoint-activations"),
        flag("--torch-compile", action=argparse.BooleanOptionalAction, default=None,
             help="compile each transformer layer with torch.compile: norms, GeLU, dropout and residual "
                  "adds fused (the start-up log prints the compile time). Default: on with a CUDA GPU, off on "
                  "CPU (there the compile time dominates small runs) and on ROCm; off, with a notice, where "
                  "mds does not compile "
                  "(MS-AMP), where the explicit "
                  "flag is refused. A compile failure falls back to the eager layers with one warning. "
                  "--no-torch-compile: eager"),
        flag("--tp-comm-overlap", nargs="?", const="auto", choices=["auto", "none", *OVERLAP_MODES],
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
                  "compile with TP > 1, else off. none: off"),
    ]),
    (("precision", None), [
        flag("--bf16", action="store_true", default=None),
        flag("--fp16", action="store_true", default=None),
        flag("--loss-scale", type=float, help="fp16 static loss scale (default: dynamic)"),
        flag("--initial-loss-scale", type=float, default=2.0**32),
        flag("--min-loss-scale", type=float, default=1.0),
        flag("--loss-scale-window", type=int, default=1000),
        flag("--hysteresis", type=int, default=2),
    ]),
    (("FP8 (beside --bf16 or --fp16: only the transformer layers' matrix multiplies are FP8)", None), [
        flag("--fp8-format", action=_FP8Format, choices=["e4m3", "hybrid"],
             help="turn FP8 on: e4m3 everywhere, or hybrid (e4m3 forward, e5m2 gradients)"),
        flag("--fp8-e4m3", dest="fp8_format", action=_FP8Format, const="e4m3", help="= --fp8-format e4m3"),
        flag("--fp8-hybrid", dest="fp8_format", action=_FP8Format, const="hybrid",
             help="= --fp8-format hybrid"),
        flag("--fp8-engine", choices=["auto", "te", "msamp", "torchao"], default="auto",
             help="which library runs FP8: auto = Transformer Engine where it can run, else torchao "
                  "(the engine that ran is printed at start)"),
        flag("--fp8-recipe", choices=["delayed", "tensorwise", "rowwise", "blockwise", "mxfp8"],
             help="Megatron-LM's names: delayed (Transformer Engine's scaling), tensorwise (dynamic, per "
                  "tensor: torchao's default), rowwise (torchao, per row, e4m3 gradients); blockwise and mxfp8 "
                  "are refused (mds runs no block-scaling recipe). Default: the engine's own"),
        flag("--fp8-margin", type=int, default=0, help="delayed scaling margin (Transformer Engine)"),
        flag("--fp8-interval", type=int, default=1, help="delayed scaling update interval (Transformer Engine)"),
        flag("--fp8-amax-history-len", type=int, default=1,
             help="delayed scaling amax history length (Transformer Engine)"),
        flag("--fp8-amax-compute-algo", choices=["most_recent", "max"], default="most_recent",
             help="delayed scaling: amax from the most recent value or the history's max (Transformer Engine)"),
        flag("--transformer-impl", choices=["local", "transformer_engine"], default="local",
             help="local: mds's layers; transformer_engine: FP8 through Transformer Engine (needs it installed)"),
        flag("--msamp", action="store_true", help="FP8 through MS-AMP (MS-AMP's Megatron-DeepSpeed patch)"),
        flag("--msamp-opt-level", choices=["O1", "O2", "O3"], default="O2",  # the MS-AMP patch's default
             help="MS-AMP: O1 FP8 GEMMs, weights and weight gradients (LBAdamW, fp32 moments); O2 + uint8/fp16 "
                  "Adam moments; O3 + MS-AMP's FP8 ZeRO (--zero-stage 1 or 2). Default O2, as MS-AMP's "
                  "Megatron-DeepSpeed patch"),
    ]),
    (("parallelism and DeepSpeed", None), [
        flag("--tensor-model-parallel-size", type=int),
        flag("--pipeline-model-parallel-size", type=int),
        flag("--decoder-last-pipeline-num-layers", type=int, metavar="N",
             help="transformer layers on the last pipeline stage; the others share the rest (default: fewer "
                  "on the last stage, by the output head's FLOPs: GPT-1.3B at PP=2 runs 13 | 11)"),
        flag("--sequence-parallel", action="store_true", default=None),
        flag("--no-pipeline-parallel", action="store_true",
             help="plain DeepSpeed engine, no pipeline engine (needs PP=1; allows ZeRO-2/3)"),
        flag("--zero-stage", type=int, choices=[0, 1, 2, 3]),
        flag("--deepspeed", action="store_true", help="accepted for compatibility: mds always uses DeepSpeed"),
        flag("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config",
             help="DeepSpeed JSON; must agree with the flags on batch sizes, precision and ZeRO stage"),
        flag("--distributed-backend", choices=["nccl", "gloo", "ccl", "mpi"],
             help="default: nccl on GPUs (RCCL on ROCm), gloo on CPU"),
        flag("--nproc-per-node", type=int, help="ranks to spawn on this node (default: its GPUs, or 1)"),
        flag("--dry-run", action="store_true",
             help="validate the flags, print the launch plan and the estimated GPU memory per GPU (model "
                  "state, activations, logits), and exit without starting a rank"),
        flag("--profile", help="site profile for the NCCL/RCCL environment (default: detected)"),
        flag("--master-addr", help="overrides MASTER_ADDR (default: the first host of the job, torchrun's name)"),
        flag("--master-port", type=int, help="overrides MASTER_PORT (default: derived from the job id; without a "
                                             "launcher, the port of the store the launcher serves)"),
    ]),
    (("mixture of experts", "Megatron-DeepSpeed's MoE flags, through DeepSpeed's MoE layer "
                            "(docs/training.md#mixture-of-experts)"), [
        flag("--num-experts", type=int, nargs="+", default=[1],
             help="experts per expert layer: one number, or one per expert layer (PR-MoE). 1: dense"),
        flag("--expert-interval", type=int, default=2,
             help="layers n (from 1) with n %% interval == 0 carry experts (default 2)"),
        flag("--moe-expert-parallel-size", type=int, default=1,
             help="ranks each layer's experts are spread over, taken from data parallelism (default 1)"),
        flag("--topk", type=int, default=1, help="experts per token: 1 or 2 (default 1)"),
        flag("--moe-loss-coeff", type=float, default=0.1,
             help="scale of the gates' load-balancing loss added to the LM loss (default 0.1)"),
        flag("--moe-train-capacity-factor", type=float, default=1.0),
        flag("--moe-eval-capacity-factor", type=float, default=1.0),
        flag("--moe-min-capacity", type=int, default=4, help="token slots per expert at least (default 4)"),
        flag("--disable-moe-token-dropping", dest="moe_token_dropping", action="store_false",
             help="no capacity limit: every token reaches its experts"),
        flag("--disable-moe-top2-2nd-expert-sampling", dest="moe_top2_2nd_expert_sampling",
             action="store_false", help="top-2: the second expert is the gate's second best, not sampled"),
        flag("--create-moe-param-group", action="store_true",
             help="the experts' parameters in optimizer groups of their own (needed with ZeRO-1/2)"),
        flag("--mlp-type", choices=["standard", "residual"], default="standard",
             help="residual: PR-MoE, a dense MLP beside the experts"),
        flag("--enable-expert-tensor-parallelism", action="store_true",
             help="refused: mds does not split experts over tensor-parallel ranks yet"),
    ]),
    (("batch, iterations, schedule", None), [
        flag("--micro-batch-size", type=int),
        flag("--global-batch-size", type=int, help="default: micro batch x data-parallel size (x GAS)"),
        flag("--train-iters", type=int),
        flag("--lr", type=float),
        flag("--min-lr", type=float, default=0.0),
        flag("--train-samples", type=int,
             help="train for this many samples instead of --train-iters (iterations = samples // global batch)"),
        flag("--train-tokens", type=int, help="also stop once this many tokens are consumed"),
        flag("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root"],
             default="linear"),
        flag("--lr-decay-iters", type=int, help="default: --train-iters"),
        flag("--lr-decay-samples", type=int, help="sample-based training: default --train-samples"),
        flag("--lr-decay-tokens", type=int, help="decay by consumed tokens (overrides iterations/samples)"),
        flag("--lr-warmup-iters", type=int, default=0),
        flag("--lr-warmup-samples", type=int, default=0),
        flag("--lr-warmup-tokens", type=int, help="warm up over this many consumed tokens"),
        flag("--lr-warmup-fraction", type=float, help="warmup as a fraction of the decay span"),
        flag("--override-opt_param-scheduler", "--override-lr-scheduler", dest="override_opt_param_scheduler",
             action="store_true", help="on resume, the schedule's shape comes from the flags"),
        flag("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-lr-scheduler",
             dest="use_checkpoint_opt_param_scheduler", action="store_true",
             help="on resume, the schedule's shape comes from the checkpoint (default: they must agree)"),
        flag("--optimizer", choices=["adam", "adamw"], default="adam", help="Adam with decoupled weight decay"),
        flag("--adam-beta1", type=float, default=0.9),
        flag("--adam-beta2", type=float, default=0.999),
        flag("--adam-eps", type=float, default=1e-8),
        flag("--weight-decay", type=float, default=0.01),
        flag("--clip-grad", type=float, default=1.0, help="gradient-norm clipping (0 disables)"),
        flag("--check-for-nan-in-loss-and-grad", action=argparse.BooleanOptionalAction, default=True,
             help="stop at a NaN/inf loss or gradient norm before saving it, exit 65, no restart (default on; "
                  "fp16 loss-scale skips are not stops)"),
        flag("--seed", type=int, default=1234),
        flag("--exit-interval", type=int, help="exit after this iteration (saving first with --save)"),
        flag("--exit-duration-in-mins", type=float, help="exit (saving first) after this many minutes"),
        flag("--exit-signal-handler", action="store_true", help="on SIGTERM: save and exit cleanly"),
    ]),
    (("data", None), [
        flag("--data-path", nargs="*", help="prefix, or weighted list: 0.3 a 0.7 b"),
        flag("--split", default="969, 30, 1"),
        flag("--data-cache-path", help="where sample indices are cached (default: next to the data)"),
        flag("--data-order", choices=("megatron", "mds"), default="megatron",
             help="megatron (default): Megatron-DeepSpeed's samples in its order (split, shuffles, blending); "
                  "mds: mds's own order (a fresh permutation per epoch, its own blending). A run resumes on the "
                  "same samples with the order it began with (each order has its own index cache)"),
        flag("--tokenizer-type", choices=TOKENIZER_TYPES, default="GPT2BPETokenizer",
             help="default GPT2BPETokenizer, as pretrain_gpt.py"),
        flag("--vocab-file"),
        flag("--merge-file"),
        flag("--tokenizer-model", help="HFTokenizer: tokenizer.json or a directory with one; "
             "SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer: the SentencePiece "
             "tokenizer.model"),
        flag("--vocab-size", type=int, help="NullTokenizer: its vocabulary size"),
    ]),
    (("checkpoints", None), [
        flag("--save"),
        flag("--load"),
        flag("--save-interval", type=int),
        flag("--no-load-optim", action="store_true"),
        flag("--no-load-rng", action="store_true"),
        flag("--no-save-optim", action="store_true"),
        flag("--no-save-rng", action="store_true"),
        flag("--finetune", action="store_true", help="load weights only; iteration restarts at 0"),
        flag("--keep-last-n-checkpoints", type=int),
        flag("--ckpt-step", type=int, metavar="N", help="load iteration N of --load, not the one `latest` names"),
        flag("--no-ckpt-fallback", action="store_true",
             help="when `latest` names a partial or corrupt checkpoint (or nothing), exit 2 naming the newest "
                  "complete one instead of resuming from it with a warning"),
        flag("--async-save", action="store_true",
             help="copy each checkpoint to host memory and write it in the background while training goes on"),
    ]),
    (("logging and evaluation", None), [
        flag("--log-interval", type=int, default=100),
        flag("--eval-interval", type=int, default=1000),
        flag("--eval-iters", type=int, default=100),
        flag("--tensorboard-dir"),
        flag("--metrics-file", help="append one JSON object per logged iteration / evaluation"),
        flag("--peak-tflops", type=float,
             help="peak dense TFLOP/s per device for MFU (env MDS_PEAK_TFLOPS; default by device)"),
        flag("--wandb-project", help="log to Weights & Biases under this project, from the last rank "
             "(needs megatron_ds[wandb]; WANDB_MODE=offline keeps the run on disk)"),
        flag("--wandb-exp-name", help="the W&B run name (default: WANDB_NAME, else one W&B makes up)"),
        flag("--wandb-save-dir", help="where W&B keeps the run's files (default: WANDB_DIR, else <--save>/wandb, "
             "else ./wandb)"),
        flag("--wandb-entity", help="the W&B team or user (default: WANDB_ENTITY, else your default entity)"),
    ]),
    (("hangs and restarts", "a rank with no progress within its allowance is a hang: stacks dumped, the stuck "
                            "rank named, exit 124 (README: Launching)"), [
        flag("--watchdog-timeout", type=float, metavar="SECONDS",
             help="seconds a training step may go without progress (default: adaptive, max(180, 20 x the "
                  "median recent step time); 0 turns the watchdog off)"),
        flag("--watchdog-slow-phase-timeout", type=float, default=1800.0, metavar="SECONDS",
             help="allowance for start-up (up to the 4th step: compilation), evaluation and checkpoint saving "
                  "(default 1800)"),
        flag("--max-restarts", type=int, default=0, metavar="N",
             help="restart the node's ranks up to N times after a failure or a hang, resuming from --load's "
                  "latest checkpoint; the same failure at the same iteration twice in a row stops (default 0). "
                  "A single rank then runs as a supervised child; under torchrun or one scheduler task per "
                  "rank that launcher owns the ranks, and mds says so"),
        flag("--straggler-factor", type=float, default=1.5, metavar="X",
             help="at each log point, name the rank whose own work per step (data path + forward) is more "
                  "than X times the other ranks' median (metrics: straggler_rank); 0 turns it off (default 1.5)"),
        flag("--distributed-timeout-minutes", type=float, default=10.0, metavar="MIN",
             help="the process groups' own timeout for a collective (init_process_group), as Megatron "
                  "(default 10)"),
    ]),
]


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
    for (title, description), rows in FLAGS:
        group = p.add_argument_group(title, description)
        for names, options in rows:
            group.add_argument(*names, **options)
    group = p.add_argument_group("accepted, no effect in mds")
    for name, why in NO_OP_SWITCHES.items():
        group.add_argument(name, action=_NoOp, nargs=0, why=why, help=f"no-op: {why}")
    for name, (allowed, why) in NO_OP_WITH_VALUE.items():
        group.add_argument(name, action=_NoOp, allowed=allowed, why=why, help=f"no-op: {why}")
    return p
