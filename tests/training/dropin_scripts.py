"""The flag sets of real Megatron-DeepSpeed and MS-AMP launch scripts, as data for the drop-in test (issue 20).

Each entry is what one script passes to `pretrain_gpt.py`, in its order, with every flag kept and only the
shell variables' values shrunk so the run fits a CPU test: 2 layers, hidden 64, 4 heads, sequence 64, a
few iterations (or the samples/tokens for a few), TP/PP/ZeRO as the script has them but at most 4 ranks.
Intervals (log, eval, save, exit) are shrunk too so that each fires within the short run. Where a script
needs more ranks than 4 its data-parallel size is cut first, then TP/PP (`changes` says what moved).

Placeholders the test formats (`render`):
  paths: {data} (indexed-dataset prefix), {vocab}, {merge}, {tokenizer_model}, {save} (the scripts give
  --save and --load the same directory), {tb}, {ds_config} (where the test writes `ds_config`).
  DeepSpeed config values: whole-string placeholders such as "{global_batch_size}" are replaced by the
  typed value in `sizes` (an int or bool), as the script's heredoc or sed template would.

Precision on CPU: DeepSpeed's fp16 optimizer is GPU-only (mds refuses --fp16 on CPU with exit 2), so a CPU
end-to-end run of an fp16 entry must either be run on a GPU or swap --fp16 for --bf16 and the config's
"fp16" section for {"enabled": true} under "bf16"; the entries themselves stay as the scripts wrote them.
Likewise several scripts pass --distributed-backend nccl, which a CPU-only run cannot honour as written.

The three end-to-end entries (`e2e_cpu`) are the Megatron-DeepSpeed-targeted scripts that need the fewest
ranks once shrunk: one rank (MS-AMP 345M), two (rebase 1.3B: TP 2, no pipeline) and two (MS-AMP 13B: TP 2,
ZeRO-1, bf16, sample-based schedule).

Sources were read at the commits recorded below; only flag names and values are carried over.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

MDS_REPO = "microsoft/Megatron-DeepSpeed"
MDS_COMMIT = "f4157bea69f3df8c6cb66f2ebcda66ba03d1288e"  # master, 2024-12-24
MSAMP_REPO = "Azure/MS-AMP-Examples"
MSAMP_COMMIT = "d836034390fca09dd67c3a488e44a1ccefcc17c0"  # main, 2025-07-17
# MS-AMP-Examples runs its *_megatron_ds.sh scripts against this Megatron-DeepSpeed (submodule
# third_party/Megatron-DeepSpeed) with gpt3/Megatron-DeepSpeed.patch applied, which adds --msamp and
# --msamp-opt-level; its *_megatron.sh scripts run NVIDIA Megatron-LM's pretrain_gpt.py instead.
MSAMP_MDS_SUBMODULE_COMMIT = "1f640c00c115eee9cd8515db80f8c92a4c24e9ca"


@dataclass(frozen=True)
class DropinScript:
    name: str
    repo: str
    path: str
    commit: str
    variant: str  # which branch of the script (its switches or its command-line argument)
    argv: tuple[str, ...]  # what the script passes to pretrain_gpt.py, in order
    world_size: int  # ranks the shrunk layout needs (TP x PP x SP x DP)
    ds_config: dict | None = None  # the DeepSpeed JSON the script writes (keys as the script has them)
    sizes: dict = field(default_factory=dict)  # values of the "{name}" placeholders in ds_config
    e2e_cpu: bool = False  # one of the three smallest: run end to end on CPU for a few iterations
    changes: str = ""  # how the shrunk layout differs from the script beyond sizes
    other_variants: dict = field(default_factory=dict)  # variant -> flags it adds (not run here)


# The template the rebase/ and sequence_parallel/ scripts fill with sed (ds_config_gpt_TEMPLATE.json;
# the two directories hold identical copies). prescale_gradients is true only at ZeRO-0.
GPT_TEMPLATE = {
    "train_batch_size": "{global_batch_size}",
    "train_micro_batch_size_per_gpu": "{micro_batch_size}",
    "steps_per_print": "{log_interval}",
    "zero_optimization": {"stage": "{zero_stage}"},
    "gradient_clipping": 1.0,
    "prescale_gradients": "{prescale_grad}",
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1,
             "initial_scale_power": 11},
    "wall_clock_breakdown": False,
}

# The heredoc of the llama scripts (pretrain_llama2_distributed.sh, universal_checkpointing/llama).
LLAMA_DS_CONFIG = {
    "train_batch_size": "{global_batch_size}",
    "train_micro_batch_size_per_gpu": "{micro_batch_size}",
    "steps_per_print": 1,
    "zero_optimization": {"stage": "{zero_stage}"},
    "bf16": {"enabled": True},
}


def _sizes(micro: int, global_: int, zero: int, log_interval: int = 1, **extra) -> dict:
    return {"micro_batch_size": micro, "global_batch_size": global_, "zero_stage": zero,
            "log_interval": log_interval, **extra}


# Shrunk duration of the rebase/ and sequence_parallel/ scripts (terminated by --train-tokens; the scripts
# set --train-samples to twice the tokens' worth so it never binds): global batch 4 x seq 64 = 256 tokens
# per iteration, 4 iterations, warm-up 1 iteration, decay over all of training.
_TRAIN_TOKENS = 4 * 4 * 64
_TRAIN_SAMPLES = _TRAIN_TOKENS * 2 // 64
_WARMUP_TOKENS = 4 * 64


def _rebase_megatron_options(tp: int, micro: int, global_: int, lr: str, min_lr: str, init_std: str,
                             extra: tuple[str, ...] = ()) -> list[str]:
    """rebase/ds_pretrain_gpt_*.sh: `megatron_options` with activation_checkpoint and log_optimizer_state
    on (the scripts' defaults); `extra` goes where the variant scripts insert their flags (after
    --no-async-tensor-model-parallel-allreduce)."""
    return [
        "--override-opt_param-scheduler",
        "--adam-beta1", "0.9",
        "--adam-beta2", "0.95",
        "--tensor-model-parallel-size", str(tp),
        "--init-method-std", init_std,
        "--lr-decay-tokens", str(_TRAIN_TOKENS),
        "--lr-warmup-tokens", str(_WARMUP_TOKENS),
        "--micro-batch-size", str(micro),
        "--exit-duration-in-mins", "30000000",
        "--global-batch-size", str(global_),
        "--num-layers", "2",
        "--hidden-size", "64",
        "--num-attention-heads", "4",
        "--seq-length", "64",
        "--max-position-embeddings", "64",
        "--train-tokens", str(_TRAIN_TOKENS),
        "--train-samples", str(_TRAIN_SAMPLES),
        "--lr", lr,
        "--min-lr", min_lr,
        "--lr-decay-style", "cosine",
        "--split", "949,50,1",
        "--log-interval", "1",
        "--eval-interval", "2",
        "--eval-iters", "1",
        "--save-interval", "2",
        "--weight-decay", "0.1",
        "--clip-grad", "1.0",
        "--hysteresis", "2",
        "--num-workers", "0",
        "--fp16",
        "--seed", "1234",
        "--load", "{save}",
        "--save", "{save}",
        "--no-async-tensor-model-parallel-allreduce",
        *extra,
        "--tensorboard-queue-size", "1",
        "--log-timers-to-tensorboard",
        "--log-batch-size-to-tensorboard",
        "--log-validation-ppl-to-tensorboard",
        "--tensorboard-dir", "{tb}",
        "--checkpoint-activations",
        "--log-optimizer-states-to-tensorboard",
    ]


_REBASE_DATA_OPTIONS = ["--vocab-file", "{vocab}", "--merge-file", "{merge}", "--data-path", "{data}",
                        "--data-impl", "mmap"]


def _rebase_deepspeed_options(zero: int, pp: int, no_pp: bool) -> list[str]:
    return ["--deepspeed", "--deepspeed_config", "{ds_config}", "--zero-stage", str(zero),
            "--pipeline-model-parallel-size", str(pp), *(["--no-pipeline-parallel"] if no_pp else []),
            "--deepspeed-activation-checkpointing"]


def _rebase(name: str, path: str, *, tp: int, pp: int, no_pp: bool, zero: int, lr: str, init_std: str,
            extra: tuple[str, ...] = (), e2e_cpu: bool = False, changes: str = "") -> DropinScript:
    micro, global_ = 2, 4
    return DropinScript(
        name=name, repo=MDS_REPO, path=path, commit=MDS_COMMIT,
        variant="as shipped (activation_checkpoint=true, log_optimizer_state=true)",
        argv=tuple(_rebase_megatron_options(tp, micro, global_, lr, "1.0e-6", init_std, extra)
                   + _REBASE_DATA_OPTIONS + _rebase_deepspeed_options(zero, pp, no_pp)),
        world_size=tp * pp,
        ds_config=GPT_TEMPLATE,
        sizes=_sizes(micro, global_, zero, prescale_grad=zero == 0),
        e2e_cpu=e2e_cpu, changes=changes,
    )


def _universal_gpt(dtype: str) -> DropinScript:
    """universal_checkpointing/megatron_gpt/run_{bf16,fp16}.sh at ZERO_STAGE=1 (no --no-pipeline-parallel)."""
    micro, global_ = 1, 4  # the script sets MICRO_BATCH = GLOBAL_BATCH / (TP*PP*DP*SP)
    precision = ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}} if dtype == "bf16" else
                 {"bf16": {"enabled": False},
                  "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 50, "hysteresis": 2,
                           "min_loss_scale": 1, "initial_scale_power": 12}})
    return DropinScript(
        name=f"uc_megatron_gpt_{dtype}", repo=MDS_REPO, commit=MDS_COMMIT,
        path=f"examples_deepspeed/universal_checkpointing/megatron_gpt/run_{dtype}.sh",
        variant="DEBUG_MODE=1, ZERO_STAGE=1, no extra command-line arguments",
        argv=(
            "--tensor-model-parallel-size", "2",
            "--pipeline-model-parallel-size", "2",
            "--ds-sequence-parallel-size", "1",
            "--num-layers", "2",
            "--hidden-size", "64",
            "--num-attention-heads", "4",
            "--seq-length", "64",
            "--loss-scale", "12",
            "--max-position-embeddings", "64",
            "--micro-batch-size", str(micro),
            "--global-batch-size", str(global_),
            "--train-iters", "8",
            "--lr", "6.0e-3",
            "--min-lr", "6.0e-4",
            "--lr-decay-style", "cosine",
            "--log-interval", "1",
            "--eval-iters", "1",
            "--eval-interval", "2",
            "--data-path", "{data}",
            "--vocab-file", "{vocab}",
            "--merge-file", "{merge}",
            "--save-interval", "2",
            "--split", "98,2,0",
            "--clip-grad", "1.0",
            "--weight-decay", "0.1",
            "--adam-beta1", "0.9",
            "--adam-beta2", "0.95",
            "--init-method-std", "0.006",
            f"--{dtype}",
            "--checkpoint-activations",
            "--exit-interval", "4",
            "--save", "{save}",
            "--load", "{save}",
            "--make-vocab-size-divisible-by", "256",
            "--tensorboard-dir", "{tb}",
            "--deepspeed",
            "--deepspeed_config={ds_config}",
            "--zero-stage=1",
            "--deepspeed-activation-checkpointing",
        ),
        world_size=4,
        ds_config={"train_batch_size": "{global_batch_size}", "train_micro_batch_size_per_gpu": "{micro_batch_size}",
                   "steps_per_print": 1, "zero_optimization": {"stage": "{zero_stage}"}, **precision,
                   "wall_clock_breakdown": False},
        sizes=_sizes(micro, global_, 1),
        changes="DP 2 -> 1 (world 8 -> 4); 32 heads -> 4 (hidden 64); EXIT_INTERVAL 200 < TRAIN_ITERS 100000 "
                "kept as exit 4 < train 8, so the run ends by --exit-interval as the script's does",
    )


def _llama_model_tail(kv_heads: bool) -> list[str]:
    """The LLaMA switches both llama scripts pass ("required for llama model as per llama paper")."""
    return ["--no-query-key-layer-scaling", "--attention-dropout", "0", "--hidden-dropout", "0",
            "--use-rotary-position-embeddings", "--untie-embeddings-and-output-weights", "--swiglu",
            "--normalization", "rmsnorm", "--disable-bias-linear",
            *(["--num-key-value-heads", "2"] if kv_heads else [])]


def _llama2_distributed(recompute: bool) -> DropinScript:
    """examples_deepspeed/pretrain_llama2_distributed.sh. Its ds_args is built by prepending, so the
    DeepSpeed flags come out as --zero-stage=.. --deepspeed_config=.. --deepspeed."""
    micro, global_ = 1, 4
    ds_args = ["--zero-stage=0", "--deepspeed_config={ds_config}", "--deepspeed"]
    if recompute:
        ds_args = ["--recompute-granularity", "full", "--recompute-method", "uniform",
                   "--deepspeed-activation-checkpointing", *ds_args]
    return DropinScript(
        name="llama2_distributed" + ("_recompute" if recompute else ""), repo=MDS_REPO, commit=MDS_COMMIT,
        path="examples_deepspeed/pretrain_llama2_distributed.sh",
        variant=f"activation_checkpoint={'true' if recompute else 'false'}, LOG_TO_WANDB=0",
        argv=(
            "--tensor-model-parallel-size", "2",
            "--pipeline-model-parallel-size", "2",
            "--num-layers", "2",
            "--hidden-size", "64",
            "--ffn-hidden-size", "172",  # the script's 5504/2048 ratio
            "--num-attention-heads", "4",
            "--micro-batch-size", str(micro),
            "--global-batch-size", str(global_),
            "--seq-length", "64",
            "--max-position-embeddings", "64",
            "--train-iters", "4",
            "--save", "{save}",
            "--load", "{save}",
            "--data-path", "1", "{data}",
            "--data-impl", "mmap",
            "--tokenizer-type", "GPTSentencePieceTokenizer",
            "--tokenizer-model", "{tokenizer_model}",
            "--split", "949,50,1",
            "--distributed-backend", "nccl",
            "--lr", "3e-4",
            "--lr-decay-style", "cosine",
            "--min-lr", "3e-5",
            "--weight-decay", "0.1",
            "--clip-grad", "1",
            "--lr-warmup-iters", "1",
            "--optimizer", "adam",
            "--adam-beta1", "0.9",
            "--adam-beta2", "0.95",
            "--log-interval", "1",
            "--save-interval", "2",
            "--eval-interval", "2",
            "--eval-iters", "1",
            "--bf16",
            *_llama_model_tail(kv_heads=True),
            *ds_args,
        ),
        world_size=4,
        ds_config=LLAMA_DS_CONFIG,
        sizes=_sizes(micro, global_, 0),
        changes="GPUS_PER_NODE 8 -> 4 (DP 2 -> 1); 16 heads / 4 KV heads -> 4 / 2 (KV heads must divide by TP 2)"
                + ("; activation_checkpoint flipped to true (the script ships it false) to cover the "
                   "--recompute-* flags" if recompute else ""),
    )


SCRIPTS: tuple[DropinScript, ...] = (
    _llama2_distributed(recompute=False),
    _llama2_distributed(recompute=True),
    _rebase("rebase_gpt_1.3B", "examples_deepspeed/rebase/ds_pretrain_gpt_1.3B.sh",
            tp=2, pp=1, no_pp=True, zero=0, lr="2.0e-4", init_std="0.013", e2e_cpu=True),
    _rebase("rebase_gpt_125M", "examples_deepspeed/rebase/ds_pretrain_gpt_125M.sh",
            tp=2, pp=2, no_pp=False, zero=1, lr="6.0e-4", init_std="0.02"),
    _rebase("rebase_gpt_125M_flashattn", "examples_deepspeed/rebase/ds_pretrain_gpt_125M_flashattn.sh",
            tp=2, pp=2, no_pp=False, zero=1, lr="6.0e-4", init_std="0.02", extra=("--use-flash-attn",)),
    _rebase("rebase_gpt_1.3B_rope", "examples_deepspeed/rebase/ds_pretrain_gpt_1.3B_rope.sh",
            tp=2, pp=2, no_pp=False, zero=1, lr="2.0e-4", init_std="0.013",
            extra=("--use-rotary-position-embeddings", "--rotary-percent", "0.25"),
            changes="mp_size 4 -> 2 and pp_size 8 -> 2 (world 32+ -> 4)"),
    DropinScript(
        name="seq_parallel_gpt_1.3B_32k", repo=MDS_REPO, commit=MDS_COMMIT,
        path="examples_deepspeed/sequence_parallel/ds_pretrain_gpt_1.3B_seq_parallel_32k.sh",
        variant="as shipped (activation_checkpoint=true, log_optimizer_state=true)",
        argv=(
            "--override-opt_param-scheduler",
            "--adam-beta1", "0.9",
            "--adam-beta2", "0.95",
            "--tensor-model-parallel-size", "1",
            "--ds-sequence-parallel-size", "2",
            "--init-method-std", "0.013",
            "--lr-decay-tokens", str(2 * 64 * 4),
            "--lr-warmup-tokens", str(2 * 64),
            "--micro-batch-size", "1",
            "--exit-duration-in-mins", "30000000",
            "--global-batch-size", "2",
            "--num-layers", "2",
            "--hidden-size", "64",
            "--num-attention-heads", "4",
            "--seq-length", "64",
            "--max-position-embeddings", "64",
            "--train-tokens", str(2 * 64 * 4),
            "--train-samples", str(2 * 64 * 4 * 2 // 64),
            "--lr", "2.0e-4",
            "--min-lr", "1.0e-6",
            "--lr-decay-style", "cosine",
            "--split", "949,50,1",
            "--log-interval", "1",
            "--eval-interval", "2",
            "--eval-iters", "1",
            "--save-interval", "2",
            "--weight-decay", "0.1",
            "--clip-grad", "1.0",
            "--hysteresis", "2",
            "--num-workers", "0",
            "--fp16",
            "--seed", "1234",
            "--load", "{save}",
            "--save", "{save}",
            "--no-async-tensor-model-parallel-allreduce",
            "--use-flash-attn-triton",
            "--tensorboard-queue-size", "1",
            "--log-timers-to-tensorboard",
            "--log-batch-size-to-tensorboard",
            "--log-validation-ppl-to-tensorboard",
            "--tensorboard-dir", "{tb}",
            "--checkpoint-activations",
            "--log-optimizer-states-to-tensorboard",
            *_REBASE_DATA_OPTIONS,
            "--deepspeed", "--deepspeed_config", "{ds_config}", "--zero-stage", "1",
            "--pipeline-model-parallel-size", "1", "--no-pipeline-parallel", "--deepspeed-activation-checkpointing",
        ),
        world_size=2,
        ds_config=GPT_TEMPLATE,
        sizes=_sizes(1, 2, 1, prescale_grad=False),
        changes="sp_size (DeepSpeed-Ulysses) 4 -> 2, seq 32768 -> 64; global batch 2 and micro 1 as shipped "
                "(4 iterations by --train-tokens)",
    ),
    _universal_gpt("bf16"),
    _universal_gpt("fp16"),
    DropinScript(
        name="uc_llama_bf16", repo=MDS_REPO, commit=MDS_COMMIT,
        path="examples_deepspeed/universal_checkpointing/llama/run_llama_bf16.sh",
        variant="DEBUG_MODE=1, activation_checkpoint=false, ZERO_STAGE=1",
        argv=(
            "--tensor-model-parallel-size", "2",
            "--pipeline-model-parallel-size", "2",
            "--ds-sequence-parallel-size", "1",
            "--num-layers", "2",
            "--hidden-size", "64",
            "--ffn-hidden-size", "172",
            "--num-attention-heads", "4",
            "--micro-batch-size", "1",
            "--global-batch-size", "4",
            "--seq-length", "64",
            "--max-position-embeddings", "64",
            "--train-iters", "8",
            "--save", "{save}",
            "--load", "{save}",
            "--data-path", "{data}",
            "--data-impl", "mmap",
            "--tokenizer-type", "GPTSentencePieceTokenizer",
            "--tokenizer-model", "{tokenizer_model}",
            "--split", "949,50,1",
            "--distributed-backend", "nccl",
            "--lr", "3e-4",
            "--lr-decay-style", "cosine",
            "--min-lr", "3e-5",
            "--weight-decay", "0.1",
            "--clip-grad", "1",
            "--lr-warmup-iters", "1",
            "--optimizer", "adam",
            "--adam-beta1", "0.9",
            "--adam-beta2", "0.95",
            "--log-interval", "1",
            "--save-interval", "2",
            "--eval-interval", "2",
            "--eval-iters", "1",
            "--exit-interval", "4",
            "--bf16",
            *_llama_model_tail(kv_heads=False),
            "--tensorboard-dir", "{tb}",
            "--zero-stage=1", "--deepspeed_config={ds_config}", "--deepspeed",
        ),
        world_size=4,
        ds_config={**LLAMA_DS_CONFIG, "wall_clock_breakdown": False},
        sizes=_sizes(1, 4, 1),
        changes="DP 2 -> 1 (world 8 -> 4); 16 heads -> 4; TRAIN_ITERS 250000 / EXIT_INTERVAL 200 -> 8 / 4",
    ),
    DropinScript(
        name="msamp_gpt3_13b_megatron_ds_bf16", repo=MSAMP_REPO, commit=MSAMP_COMMIT,
        path="gpt3/pretrain_13b_megatron_ds.sh",
        variant="argument bf16",
        argv=(
            "--tensor-model-parallel-size", "2",
            "--pipeline-model-parallel-size", "1",
            "--distributed-backend", "nccl",
            "--no-query-key-layer-scaling",
            "--seed", "43",
            "--num-layers", "2",
            "--hidden-size", "64",
            "--num-attention-heads", "4",
            "--seq-length", "64",
            "--max-position-embeddings", "64",
            "--train-samples", "16",  # 4 iterations of 4
            "--lr-decay-samples", "14",  # the script's 0.9 of training
            "--lr-warmup-samples", "4",  # one iteration
            "--lr", "2.0e-4",
            "--min-lr", "2.0e-5",
            "--lr-decay-style", "cosine",
            "--micro-batch-size", "2",
            "--global-batch-size", "4",
            "--clip-grad", "1.0",
            "--weight-decay", "0.1",
            "--attention-dropout", "0.0",
            "--hidden-dropout", "0.0",
            "--optimizer", "adam",
            "--adam-beta1", "0.9",
            "--adam-beta2", "0.95",
            "--init-method-std", "0.0099",
            "--num-workers", "1",
            "--bf16",
            "--checkpoint-activations",
            "--data-path", "1.0", "{data}",
            "--vocab-file", "{vocab}",
            "--merge-file", "{merge}",
            "--data-impl", "mmap",
            "--split", "949,50,1",
            "--log-interval", "1",
            "--eval-iters", "1",
            "--eval-interval", "2",
            "--save-interval", "2",
            "--save", "{save}",
            "--load", "{save}",
            "--deepspeed",
            "--deepspeed_config", "{ds_config}",
            "--zero-stage", "1",
            "--deepspeed-activation-checkpointing",
        ),
        world_size=2,
        ds_config={"train_micro_batch_size_per_gpu": "{micro_batch_size}", "train_batch_size": "{global_batch_size}",
                   "gradient_clipping": 1.0, "zero_optimization": {"stage": "{zero_stage}"},
                   "bf16": {"enabled": True}, "steps_per_print": "{log_interval}"},
        sizes=_sizes(2, 4, 1),
        e2e_cpu=True,
        changes="GPUS_PER_NODE 8 -> 2 (DP 4 -> 1)",
        other_variants={"msamp": ["--msamp", "--msamp-opt-level", "O3"]},  # after --load, before the DeepSpeed flags
    ),
    DropinScript(
        name="msamp_gpt3_345m_megatron_ds_fp16", repo=MSAMP_REPO, commit=MSAMP_COMMIT,
        path="gpt3/pretrain_345m_megatron_ds.sh",
        variant="argument fp16 (plain Megatron-DeepSpeed: no --deepspeed; the written ds_config.json is unused)",
        argv=(
            "--num-layers", "2",
            "--hidden-size", "64",
            "--num-attention-heads", "4",
            "--seq-length", "64",
            "--max-position-embeddings", "64",
            "--micro-batch-size", "2",
            "--global-batch-size", "4",
            "--lr", "0.00015",
            "--train-iters", "4",
            "--lr-decay-iters", "3",  # the script's 320000 of 500000
            "--lr-decay-style", "cosine",
            "--min-lr", "1.0e-5",
            "--weight-decay", "1e-2",
            "--lr-warmup-fraction", ".01",
            "--clip-grad", "1.0",
            "--fp16",
            "--data-path", "{data}",
            "--vocab-file", "{vocab}",
            "--merge-file", "{merge}",
            "--data-impl", "mmap",
            "--split", "949,50,1",
            "--log-interval", "1",
            "--save-interval", "2",
            "--eval-interval", "2",
            "--eval-iters", "1",
            "--save", "{save}",
            "--load", "{save}",
        ),
        world_size=1,
        e2e_cpu=True,
        changes="BS 4 / GLOBAL_BS 8 -> 2 / 4; one rank as the script's plain torchrun",
        other_variants={"msamp": ["--msamp", "--msamp-opt-level", "O2", "--deepspeed", "--deepspeed_config",
                                  "{ds_config}"]},  # ds_config: micro, global, gradient_clipping, fp16.enabled,
                                                    # steps_per_print 100
    ),
    DropinScript(
        name="msamp_gpt3_345m_megatron_lm_bf16", repo=MSAMP_REPO, commit=MSAMP_COMMIT,
        path="gpt3/pretrain_345m_megatron.sh",
        variant="argument bf16 (written for NVIDIA Megatron-LM's pretrain_gpt.py)",
        argv=(
            "--num-layers", "2",
            "--hidden-size", "64",
            "--num-attention-heads", "4",
            "--seq-length", "64",
            "--max-position-embeddings", "64",
            "--micro-batch-size", "2",
            "--global-batch-size", "4",
            "--lr", "0.00015",
            "--train-iters", "4",
            "--lr-decay-iters", "3",
            "--lr-decay-style", "cosine",
            "--min-lr", "1.0e-5",
            "--weight-decay", "1e-2",
            "--lr-warmup-fraction", ".01",
            "--clip-grad", "1.0",
            "--bf16",
            "--use-flash-attn",
            "--no-gradient-accumulation-fusion",
            "--use-distributed-optimizer",
            "--data-path", "{data}",
            "--vocab-file", "{vocab}",
            "--merge-file", "{merge}",
            "--data-impl", "mmap",
            "--split", "949,50,1",
            "--log-interval", "1",
            "--save-interval", "2",
            "--eval-interval", "2",
            "--eval-iters", "1",
            "--save", "{save}",
            "--load", "{save}",
        ),
        world_size=2,
        changes="GPUS_PER_NODE 8 -> 2 (DP 8 -> 2); micro 8 / global 64 -> 2 / 4",
        other_variants={"te": ["--fp8-hybrid", "--transformer-impl", "transformer_engine"],  # before --save
                        "msamp": ["--fp8-hybrid", "--transformer-impl", "transformer_engine", "--msamp"],
                        "fp4": ["--fp8-hybrid", "--transformer-impl", "transformer_engine", "--msamp"]},
    ),
    DropinScript(
        name="msamp_gpt3_6b7_megatron_lm_bf16", repo=MSAMP_REPO, commit=MSAMP_COMMIT,
        path="gpt3/pretrain_6b7_megatron.sh",
        variant="argument bf16 (written for NVIDIA Megatron-LM's pretrain_gpt.py)",
        argv=(
            "--tensor-model-parallel-size", "1",
            "--pipeline-model-parallel-size", "1",
            "--distributed-backend", "nccl",
            "--no-query-key-layer-scaling",
            "--seed", "43",
            "--num-layers", "2",
            "--hidden-size", "64",
            "--num-attention-heads", "4",
            "--seq-length", "64",
            "--max-position-embeddings", "64",
            "--train-samples", "16",
            "--lr-decay-samples", "14",
            "--lr-warmup-samples", "1",  # the script's 4% of training, rounded up
            "--lr", "3.0e-4",
            "--min-lr", "3.0e-5",
            "--lr-decay-style", "cosine",
            "--micro-batch-size", "1",
            "--global-batch-size", "4",
            "--clip-grad", "1.0",
            "--weight-decay", "0.1",
            "--attention-dropout", "0.0",
            "--hidden-dropout", "0.0",
            "--optimizer", "adam",
            "--adam-beta1", "0.9",
            "--adam-beta2", "0.95",
            "--init-method-std", "0.0099",
            "--num-workers", "1",
            "--bf16",
            "--sequence-parallel",  # with TP 1: Megatron turns it off silently
            "--use-flash-attn",
            "--no-gradient-accumulation-fusion",
            "--use-distributed-optimizer",
            "--data-path", "{data}",
            "--vocab-file", "{vocab}",
            "--merge-file", "{merge}",
            "--data-impl", "mmap",
            "--split", "949,50,1",
            "--log-interval", "1",
            "--save-interval", "2",
            "--eval-interval", "2",
            "--eval-iters", "1",
            "--save", "{save}",
            "--load", "{save}",
        ),
        world_size=2,
        changes="GPUS_PER_NODE 8 -> 2 (DP 8 -> 2); global 2048 -> 4",
        other_variants={"te": ["--fp8-hybrid", "--transformer-impl", "transformer_engine"],  # before --save
                        "msamp": ["--fp8-hybrid", "--transformer-impl", "transformer_engine", "--msamp"],
                        "fp4": ["--fp8-hybrid", "--transformer-impl", "transformer_engine", "--msamp"]},
    ),
)

BY_NAME = {s.name: s for s in SCRIPTS}


def _fill(value, sizes: dict):
    if isinstance(value, dict):
        return {k: _fill(v, sizes) for k, v in value.items()}
    if isinstance(value, str) and value.startswith("{") and value.endswith("}") and value[1:-1] in sizes:
        return sizes[value[1:-1]]
    return value


def render(script: DropinScript, **paths: str) -> tuple[list[str], dict | None]:
    """The script's argv with the path placeholders filled, and its DeepSpeed config with the sizes filled.

    paths: data, vocab, merge, tokenizer_model, save, tb, ds_config (only those the entry uses are needed).
    """
    argv = [arg.format(**paths) if "{" in arg else arg for arg in script.argv]
    config = _fill(copy.deepcopy(script.ds_config), script.sizes) if script.ds_config is not None else None
    return argv, config
