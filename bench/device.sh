#!/usr/bin/env bash
# Run benchmark stages on a GPU machine (`make bench` runs the headline stage with the repo's venv).
#   bash bench/device.sh STAGE [STAGE...]      (stages below; results land in bench/results and $OUT)
#   PYTHON=.venv/bin/python bash bench/device.sh headline
#   MDS_GIT_COMMIT=<sha> ...   on a machine given a copy of the tree whose .git may be stale (results record it)
# Wheels for what the machine lacks (DeepSpeed built with DS_BUILD_OPS=0, pydantic, hjson, ...) are
# installed from .whl/ when present. Each stage runs under its own time limit so that the results of the
# others still come back. NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/mds_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MDS_BENCH_WORK=/tmp/mds_bench
LOGS=/tmp/mds_logs
mkdir -p "$LOGS"

B="$PYTHON bench/bench_train.py"
GPT13="--preset GPT1_3B --bf16"
# GPT-6.7B TP=2+SP on two GPUs, micro batch 4, ZeRO-1: the issue-15 TP layout
GPT67_TP2SP="--preset GPT6_7B --bf16 --micro-batch-size 4 --zero-stage 1 --nproc-per-node 2"
GPT67_TP2SP="$GPT67_TP2SP --tensor-model-parallel-size 2 --sequence-parallel"
# GPT-2.7B TP=2+SP on two GPUs, global batch 32, ZeRO-1 (the micro batch is the stage's)
GPT27_TP2SP="--preset GPT2_7B --bf16 --global-batch-size 32 --zero-stage 1 --nproc-per-node 2"
GPT27_TP2SP="$GPT27_TP2SP --tensor-model-parallel-size 2 --sequence-parallel"
# GPT-1.3B over DeepSpeed-Ulysses SP=2 on two GPUs at sequence 8192, micro batch 1, global batch 8, ZeRO-1
GPT13_S8K_SP2="--preset GPT1_3B --bf16 --seq-length 8192 --max-position-embeddings 8192 --micro-batch-size 1"
GPT13_S8K_SP2="$GPT13_S8K_SP2 --global-batch-size 8 --zero-stage 1 --nproc-per-node 2 --ds-sequence-parallel-size 2"

t() { local limit=$1; shift; echo "+ [$limit s] $*"; timeout "$limit" "$@"; echo "  -> rc $?"; }
overlap_flag() { [ "$1" = default ] || echo "--tp-comm-overlap $1"; }  # a stage's mode name -> its flag

stage_headline() {  # GPT-1.3B, one GPU, against the HF baseline in the same call: defaults, then the best settings
  t 300 $B --steps 20 --warmup-steps 5 --baseline --name gpt1_3b_s2048_mbs16_z1_vs_hf -- $GPT13 \
    --micro-batch-size 16 --zero-stage 1
  stage_headline3
}

stage_single1() {  # GPT-1.3B on one GPU: ours vs HF in one call, then what a step spends its time on
  t 240 $B --name gpt1_3b_s2048_mbs8_z1_1gpu --baseline -- $GPT13 --micro-batch-size 8 --zero-stage 1
  t 150 $B --name gpt1_3b_s2048_mbs16_z1_1gpu -- $GPT13 --micro-batch-size 16 --zero-stage 1
  for v in base cudnn compile+cudnn nodrop+cudnn; do
    t 150 $PYTHON bench/profile_train.py --variant "$v" --out "$LOGS/profile_${v/+/_}.txt" -- $GPT13 --micro-batch-size 8 --zero-stage 1
  done
}

stage_single2() {  # batch size, ZeRO stage, dropout, activation checkpointing; what fusion would buy
  local S="--steps 20 --warmup-steps 5"
  t 120 $B $S --name gpt1_3b_s2048_mbs16_z0_1gpu -- $GPT13 --micro-batch-size 16 --zero-stage 0
  t 120 $B $S --name gpt1_3b_s2048_mbs24_z1_1gpu -- $GPT13 --micro-batch-size 24 --zero-stage 1
  t 120 $B $S --name gpt1_3b_s2048_mbs16_z1_nodrop_1gpu -- $GPT13 --micro-batch-size 16 --zero-stage 1 \
    --hidden-dropout 0 --attention-dropout 0
  t 120 $B $S --name gpt1_3b_s2048_mbs16_z1_ckpt_1gpu -- $GPT13 --micro-batch-size 16 --zero-stage 1 --checkpoint-activations
  t 120 $PYTHON bench/profile_train.py --no-profile --variant compile --out "$LOGS/profile16_compile.txt" -- \
    $GPT13 --micro-batch-size 16 --zero-stage 1
  t 150 $PYTHON bench/profile_train.py --variant compile+nodrop --out "$LOGS/profile16_compile_nodrop.txt" -- \
    $GPT13 --micro-batch-size 16 --zero-stage 1
}

stage_longseq() {  # the longest sequence GPT-1.3B trains at on one GPU with activation checkpointing
  local S="--steps 6 --warmup-steps 2"
  for seq in 8192 16384 32768 65536 131072; do
    local mbs=$(( seq >= 16384 ? 1 : 16384 / seq ))
    [ $seq -ge 131072 ] && S="--steps 3 --warmup-steps 1"
    t 200 $B $S --name gpt1_3b_s${seq}_mbs${mbs}_z1_ckpt_1gpu -- $GPT13 --micro-batch-size $mbs --zero-stage 1 \
      --seq-length $seq --max-position-embeddings $seq --checkpoint-activations
  done
}

stage_scaling() {  # GPT-1.3B: data parallel 1/2/4 GPUs (per-GPU tokens/s), TP=2, TP=2+SP, PP=2 on one host
  local S="--steps 12 --warmup-steps 4" M="$GPT13 --micro-batch-size 16 --zero-stage 1"
  t 120 $B $S --name gpt1_3b_s2048_mbs16_z1_dp1 -- $M --nproc-per-node 1
  t 150 $B $S --dp-hint 2 --name gpt1_3b_s2048_mbs16_z1_dp2 -- $M --nproc-per-node 2
  t 150 $B $S --dp-hint 4 --name gpt1_3b_s2048_mbs16_z1_dp4 -- $M --nproc-per-node 4
  t 150 $B $S --name gpt1_3b_s2048_mbs16_z1_tp2 -- $M --nproc-per-node 2 --tensor-model-parallel-size 2
  t 150 $B $S --name gpt1_3b_s2048_mbs16_z1_tp2_sp -- $M --nproc-per-node 2 --tensor-model-parallel-size 2 \
    --sequence-parallel
  t 150 $B $S --name gpt1_3b_s2048_mbs8_gbs64_z1_pp2 -- $GPT13 --micro-batch-size 8 --global-batch-size 64 \
    --zero-stage 1 --nproc-per-node 2 --pipeline-model-parallel-size 2
}

stage_mfu() {  # GPT-1.3B one GPU: fused cross entropy (A/B in one call), log interval, gradient accumulation
  local S="--steps 20 --warmup-steps 5" M="$GPT13 --micro-batch-size 16 --zero-stage 1"
  t 200 $B $S --baseline --name gpt1_3b_s2048_mbs16_z1_vs_hf_fusedce -- $M
  MDS_FUSED_CROSS_ENTROPY=0 t 100 $B $S --name gpt1_3b_s2048_mbs16_z1_eagerce -- $M
  t 120 $B --steps 40 --warmup-steps 10 --name gpt1_3b_s2048_mbs16_z1_log5 -- $M --log-interval 5
  t 200 $B --steps 12 --warmup-steps 3 --baseline --name gpt1_3b_s2048_mbs16_gbs64_z1_vs_hf -- $M \
    --global-batch-size 64
  t 150 $PYTHON bench/profile_train.py --variant compile+nodrop --out "$LOGS/profile16_compile_nodrop_fusedce.txt" -- $M
}

stage_levers() {  # GPT-1.3B one GPU, profile harness: where a step goes now, and what each lever buys
  local M="$GPT13 --micro-batch-size 16" P="$PYTHON bench/profile_train.py"
  t 120 $P --variant base --out "$LOGS/lever_base.txt" -- $M --zero-stage 1
  t 120 $P --variant autocast --out "$LOGS/lever_autocast.txt" -- $M --zero-stage 0
  t 100 $P --no-profile --variant igu --out "$LOGS/lever_igu.txt" -- $M --zero-stage 1
  t 120 $P --no-profile --variant compile+nodrop --out "$LOGS/lever_compile_nodrop.txt" -- $M --zero-stage 1
  t 120 $P --no-profile --variant autocast+compile+nodrop --out "$LOGS/lever_autocast_compile_nodrop.txt" -- \
    $M --zero-stage 0
  t 200 $B --steps 12 --warmup-steps 3 --baseline --name gpt1_3b_s2048_mbs16_gbs64_z1_vs_hf -- $M --zero-stage 1 \
    --global-batch-size 64
}

stage_headline2() {  # GPT-1.3B one GPU with --torch-compile: dropout on / off, one step per micro-batch / four
  local M="$GPT13 --micro-batch-size 16 --zero-stage 1 --torch-compile" S="--steps 20 --warmup-steps 5"
  t 240 $B $S --baseline --name gpt1_3b_s2048_mbs16_z1_compile_vs_hf -- $M
  t 300 $B --steps 10 --warmup-steps 3 --baseline --name gpt1_3b_s2048_mbs16_gbs64_z1_compile_nodrop_vs_hf -- $M \
    --global-batch-size 64 --hidden-dropout 0 --attention-dropout 0
}

stage_headline3() {  # as headline2 without dropout, eight micro-batches per step (global batch 128)
  t 330 $B --steps 8 --warmup-steps 3 --baseline --name gpt1_3b_s2048_mbs16_gbs128_z1_compile_nodrop_vs_hf -- \
    $GPT13 --micro-batch-size 16 --zero-stage 1 --torch-compile --global-batch-size 128 --hidden-dropout 0 \
    --attention-dropout 0
}

stage_confirm() {  # headline3 again, more steps; and sixteen micro-batches per step (global batch 256)
  local M="$GPT13 --micro-batch-size 16 --zero-stage 1 --torch-compile --hidden-dropout 0 --attention-dropout 0"
  t 330 $B --steps 12 --warmup-steps 3 --baseline --name gpt1_3b_s2048_mbs16_gbs128_z1_compile_nodrop_vs_hf_rerun -- \
    $M --global-batch-size 128
  t 200 $B --steps 6 --warmup-steps 2 --name gpt1_3b_s2048_mbs16_gbs256_z1_compile_nodrop -- $M --global-batch-size 256
}

stage_compile_tp() {  # GPT-1.3B on 2 GPUs, TP=2 and TP=2+SP, eager then --torch-compile in the same call
  local S="--steps 10 --warmup-steps 3" M="$GPT13 --micro-batch-size 16 --zero-stage 1 --nproc-per-node 2"
  for c in "" "--torch-compile"; do
    local tag=${c:+_compile}
    t 140 $B $S --name gpt1_3b_s2048_mbs16_z1_tp2${tag} -- $M --tensor-model-parallel-size 2 $c
    t 140 $B $S --name gpt1_3b_s2048_mbs16_z1_tp2_sp${tag} -- $M --tensor-model-parallel-size 2 --sequence-parallel $c
  done
}

stage_compile_pp() {  # GPT-1.3B on 2 GPUs, PP=2 (8 micro-batches of 8), eager then --torch-compile in the same call
  local S="--steps 10 --warmup-steps 3"
  local M="$GPT13 --micro-batch-size 8 --global-batch-size 64 --zero-stage 1 --nproc-per-node 2 --pipeline-model-parallel-size 2"
  t 200 $B $S --name gpt1_3b_s2048_mbs8_gbs64_z1_pp2 -- $M
  t 200 $B $S --name gpt1_3b_s2048_mbs8_gbs64_z1_pp2_compile -- $M --torch-compile
}

stage_gpu1() {  # the one-GPU tests: bf16 ZeRO-0 vs ZeRO-1, --torch-compile, eager vs fused cross entropy, fp16
  MDS_GPU_REPORT="$LOGS/gpu_tests_1gpu.json" t 400 $PYTHON -m pytest -m gpu tests/gpu -q -rA -p no:cacheprovider \
    -k "zero0 or speed_paths or fp16 or metrics"
}

stage_gpucompile() {  # the --torch-compile GPU tests: 1 GPU, TP=2, TP=2+SP, PP=2, and TP=2 with dropout
  MDS_GPU_REPORT="$LOGS/gpu_tests_compile.json" t 280 $PYTHON -m pytest -m gpu tests/gpu -q -rA -p no:cacheprovider \
    -k compile
}

stage_big() {  # GPT-13B on 4 GPUs with ZeRO-3 and activation checkpointing
  t 330 $B --steps 8 --warmup-steps 3 --dp-hint 4 --name gpt13b_s2048_mbs8_z3_ckpt_dp4 -- --preset GPT13B --bf16 \
    --micro-batch-size 8 --zero-stage 3 --checkpoint-activations --nproc-per-node 4
}

stage_gputests() {  # pytest -m gpu: layouts reproduce the single-GPU bf16 curve; fp16 loss scaling trains
  MDS_GPU_REPORT="$LOGS/gpu_tests.json" t 400 $PYTHON -m pytest -m gpu tests/gpu -q -rA -p no:cacheprovider
}

stage_fp8() {  # FP8 (torchao float8, tensorwise) vs bf16 on one GPU, each pair in this one call (~8 min):
  # GPT-1.3B and GPT-2.7B speed (--torch-compile), a 300-step loss comparison on real text, the plain-PyTorch
  # reference's float8 speed-up. Needs torchao: carry .whl/ with its wheel (installed above) and, for the
  # reference, .whl/reference_gpt.py (a copy of ../shared/bench/reference_gpt.py).
  local F="$PYTHON bench/fp8_compare.py" S="--steps 24 --warmup-steps 10"
  $PYTHON -c "import torch, torchao.float8; print('torch', torch.__version__, 'torchao', torchao.__version__, \
    'capability', torch.cuda.get_device_capability())" || { echo "torchao not importable: carry .whl/"; return 1; }
  t 160 $F $S --name gpt1_3b_s2048_mbs16_z1_compile_fp8 -- $GPT13 --micro-batch-size 16 --zero-stage 1 --torch-compile
  t 180 $F $S --name gpt2_7b_s2048_mbs8_z1_compile_fp8 -- --preset GPT2_7B --bf16 --micro-batch-size 8 \
    --zero-stage 1 --torch-compile
  stage_fp8loss
}

stage_fp8loss() {  # the FP8 stage's second half: 300-step loss comparison, the plain-PyTorch reference's float8 ratio
  local F="$PYTHON bench/fp8_compare.py"
  t 420 $F --loss --steps 300 --warmup-steps 10 --demo-corpus --name gpt350m_s1024_mbs16_fp8_loss300 -- \
    --preset GPT350M --bf16 --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 16 --zero-stage 1 \
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 30 --hidden-dropout 0 --attention-dropout 0 \
    --log-interval 10 --seed 1234
  if [ -f .whl/reference_gpt.py ]; then  # the plain-PyTorch yardstick, GPT-1.3B shape, same machine and call
    OUT="$LOGS" t 300 $PYTHON .whl/reference_gpt.py --which compile,compile_fp8 --mbs 16 --steps 10 --warmup 3
    cp "$LOGS/anchor.json" "$OUT/reference_gpt_fp8.json" 2>/dev/null
  fi
}

stage_defaults() {  # issue 15, one GPU, one call: GPT-1.3B with the default flags (dropout 0.1, global batch =
  # micro batch 16), compiled, with DeepSpeed as released and then with patches/deepspeed (bf16 steps with no
  # host read of the norm); eager; compile + dropout 0 + global batch 128; the phases of a step; the compiled
  # plain-PyTorch reference. Carry .whl/ (DeepSpeed wheel + reference_gpt.py).
  local S="--steps 20 --warmup-steps 5" M="$GPT13 --micro-batch-size 16 --zero-stage 1"
  if [ -f .whl/reference_gpt.py ]; then
    OUT="$LOGS" t 200 $PYTHON .whl/reference_gpt.py --which compile --mbs 16 --steps 10 --warmup 3
    cp "$LOGS/anchor.json" "$OUT/reference_gpt_defaults.json" 2>/dev/null
  fi
  t 150 $B $S --name gpt1_3b_s2048_mbs16_z1_compile_ds_released -- $M --torch-compile
  ds_patches
  t 150 $B $S --name gpt1_3b_s2048_mbs16_z1_compile_ds_patched -- $M --torch-compile
  t 120 $B $S --name gpt1_3b_s2048_mbs16_z1_eager_ds_patched -- $M --no-torch-compile
  t 240 $B --steps 8 --warmup-steps 3 --name gpt1_3b_s2048_mbs16_gbs128_z1_compile_nodrop_ds_patched -- $M \
    --torch-compile --global-batch-size 128 --hidden-dropout 0 --attention-dropout 0
  t 120 $PYTHON bench/profile_train.py --no-profile --variant compile --out "$LOGS/defaults_phases_patched.txt" -- $M
  cp "$LOGS"/defaults_phases_* "$OUT"/ 2>/dev/null
}

stage_defaults_profile() {  # where a default-flags GPT-1.3B step goes now (patched DeepSpeed): phases and kernels
  local M="$GPT13 --micro-batch-size 16 --zero-stage 1" P="$PYTHON bench/profile_train.py"
  ds_patches
  t 150 $P --variant compile --out "$LOGS/defaults_profile_compile.txt" -- $M
  t 150 $P --variant compile+nodrop --out "$LOGS/defaults_profile_compile_nodrop.txt" -- $M
  t 120 $P --no-profile --variant compile+igu --out "$LOGS/defaults_profile_compile_igu.txt" -- $M
  cp "$LOGS"/defaults_profile_* "$OUT"/ 2>/dev/null
}

stage_fp8a() {  # issue 14, one call: GPT-1.3B FP8 vs bf16 (patched DeepSpeed, --torch-compile), the phases of
  # the FP8 step, and the plain-PyTorch reference's bf16 and float8 in the same call. Carry .whl/ (torchao).
  local F="$PYTHON bench/fp8_compare.py" S="--steps 24 --warmup-steps 10"
  ds_patches
  t 200 $F $S --name gpt1_3b_s2048_mbs16_z1_compile_fp8 -- $GPT13 --micro-batch-size 16 --zero-stage 1 --torch-compile
  t 120 $PYTHON bench/profile_train.py --no-profile --variant compile --out "$LOGS/fp8_phases_gpt1_3b.txt" -- \
    $GPT13 --micro-batch-size 16 --zero-stage 1 --fp8-format hybrid --fp8-engine torchao
  if [ -f .whl/reference_gpt.py ]; then
    OUT="$LOGS" t 240 $PYTHON .whl/reference_gpt.py --which compile,compile_fp8 --mbs 16 --steps 10 --warmup 3
    cp "$LOGS/anchor.json" "$OUT/reference_gpt_fp8_gpt1_3b.json" 2>/dev/null
  fi
  cp "$LOGS"/fp8_phases_* "$OUT"/ 2>/dev/null
}

stage_fp8b() {  # issue 14, one call: GPT-2.7B (32 x 2560, micro batch 8) FP8 vs bf16, and the reference's pair
  local F="$PYTHON bench/fp8_compare.py" S="--steps 24 --warmup-steps 10"
  ds_patches
  t 240 $F $S --name gpt2_7b_s2048_mbs8_z1_compile_fp8 -- --preset GPT2_7B --bf16 --micro-batch-size 8 \
    --zero-stage 1 --torch-compile
  if [ -f .whl/reference_gpt.py ]; then
    OUT="$LOGS" t 280 $PYTHON .whl/reference_gpt.py --which compile,compile_fp8 --layers 32 --hidden 2560 --heads 32 \
      --mbs 8 --steps 10 --warmup 3
    cp "$LOGS/anchor.json" "$OUT/reference_gpt_fp8_gpt2_7b.json" 2>/dev/null
  fi
}

stage_fp8ref27() {  # issue 14, one call: GPT-2.7B FP8 vs bf16 without dropout (as mds runs it now: compiled, tuned)
  # and the plain-PyTorch reference's bf16 and float8 pair, for the same-call ratio the issue asks of a missed target
  local F="$PYTHON bench/fp8_compare.py" S="--steps 14 --warmup-steps 5"
  ds_patches
  t 280 $F $S --name gpt2_7b_s2048_mbs8_z1_compile_nodrop_fp8_s8 -- --preset GPT2_7B --bf16 --micro-batch-size 8 \
    --zero-stage 1 --torch-compile --hidden-dropout 0 --attention-dropout 0
  OUT="$LOGS" t 260 $PYTHON .whl/reference_gpt.py --which compile,compile_fp8 --layers 32 --hidden 2560 --heads 32 \
    --mbs 8 --steps 8 --warmup 3
  cp "$LOGS/anchor.json" "$OUT/reference_gpt_fp8_gpt2_7b_s8.json" 2>/dev/null
}

stage_fp8loss13() {  # issue 14: GPT-1.3B, GPT-style and LLaMA-style, 300 steps on the embedded corpus, FP8 vs bf16
  local F="$PYTHON bench/fp8_compare.py --loss --steps 300 --warmup-steps 10 --demo-corpus"
  local C="--bf16 --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 8 --global-batch-size 8 \
    --zero-stage 1 --torch-compile --lr 2e-4 --min-lr 2e-5 --lr-decay-style cosine --lr-warmup-iters 30 \
    --log-interval 10 --seed 1234"
  ds_patches
  t 280 $F --name gpt1_3b_s1024_fp8_loss300 -- --preset GPT1_3B $C
  t 280 $F --name llama_style_1_3b_s1024_fp8_loss300 -- --preset GPT1_3B $C --swiglu --normalization RMSNorm \
    --position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights \
    --num-key-value-heads 8 --ffn-hidden-size 5504
}

stage_llamacheck() {  # the LLaMA-style 1.3B FP8 run trained lower than bf16 (5%): which of compile or FP8 moves it?
  local F="$PYTHON bench/fp8_compare.py --loss --steps 150 --warmup-steps 10 --demo-corpus"
  local C="--preset GPT1_3B --bf16 --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 8 \
    --global-batch-size 8 --zero-stage 1 --lr 2e-4 --min-lr 2e-5 --lr-decay-style cosine --lr-warmup-iters 30 \
    --log-interval 10 --seed 1234 --swiglu --normalization RMSNorm --position-embedding-type rope \
    --disable-bias-linear --untie-embeddings-and-output-weights --num-key-value-heads 8 --ffn-hidden-size 5504 \
    --no-torch-compile"
  ds_patches
  t 200 $F --name llama_style_1_3b_eager_vs_compile_loss150 --fp8-flags=--torch-compile -- $C
  [ -n "${MDS_LLAMACHECK_FP8:-}" ] && t 260 $F --name llama_style_1_3b_eager_bf16_vs_fp8_loss150 -- $C
  t 200 $F --name gpt1_3b_eager_vs_compile_loss150 --fp8-flags=--torch-compile -- --preset GPT1_3B --bf16 \
    --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 8 --global-batch-size 8 --zero-stage 1 \
    --lr 2e-4 --min-lr 2e-5 --lr-decay-style cosine --lr-warmup-iters 30 --log-interval 10 --seed 1234 \
    --no-torch-compile
}

stage_llamaseed() {  # issue 14: the LLaMA-style 300-step FP8/bf16 pair again with another seed, every step logged
  # (iteration 1 shows whether both start from the same weights), to tell a systematic offset from this seed's
  local F="$PYTHON bench/fp8_compare.py --loss --steps 300 --warmup-steps 10 --demo-corpus"
  ds_patches
  t 400 $F --name llama_style_1_3b_s1024_fp8_loss300_seed4321 -- --preset GPT1_3B --bf16 --seq-length 1024 \
    --max-position-embeddings 1024 --micro-batch-size 8 --global-batch-size 8 --zero-stage 1 --torch-compile \
    --lr 2e-4 --min-lr 2e-5 --lr-decay-style cosine --lr-warmup-iters 30 --log-interval 1 --seed 4321 --swiglu \
    --normalization RMSNorm --position-embedding-type rope --disable-bias-linear \
    --untie-embeddings-and-output-weights --num-key-value-heads 8 --ffn-hidden-size 5504
}

stage_fp8c() {  # issue 14, one call: GPT-1.3B FP8 vs bf16 without dropout (fused-norm optimizer step), the
  # reference's bf16 and float8 pair, and the kernels of our FP8 step (where the FP8 step's time goes)
  local N="--hidden-dropout 0 --attention-dropout 0"
  ds_patches
  t 220 $PYTHON bench/fp8_compare.py --steps 24 --warmup-steps 10 --name gpt1_3b_s2048_mbs16_z1_compile_nodrop_fp8_v2 \
    -- $GPT13 --micro-batch-size 16 --zero-stage 1 --torch-compile $N
  if [ -f .whl/reference_gpt.py ]; then
    OUT="$LOGS" t 240 $PYTHON .whl/reference_gpt.py --which compile,compile_fp8 --mbs 16 --steps 10 --warmup 3
    cp "$LOGS/anchor.json" "$LOGS/reference_gpt_fp8c.json" 2>/dev/null
  fi
  t 150 $PYTHON bench/profile_train.py --variant compile+nodrop --out "$LOGS/fp8c_profile_gpt1_3b.txt" -- $GPT13 \
    --micro-batch-size 16 --zero-stage 1 --fp8-format hybrid --fp8-engine torchao
}

stage_compiledefault() {  # issue 15 on one GPU: the TP compile probe (fake process group; two gloo ranks on one
  # GPU), the compile start-up cost of GPT-1.3B and GPT-13B layers, and GPT-1.3B with no precision-independent
  # flags at all (compiled by default now), patched DeepSpeed
  OUT="$OUT" t 280 $PYTHON bench/compile_tp_probe.py
  OUT="$OUT" t 150 $PYTHON bench/compile_startup.py
  ds_patches
  t 150 $B --steps 20 --warmup-steps 5 --name gpt1_3b_s2048_mbs16_z1_default_flags -- $GPT13 --micro-batch-size 16 \
    --zero-stage 1
}

stage_ulysses() {  # issue 19 on 2 GPUs: GPT-1.3B with DeepSpeed-Ulysses 2 at 64k and 128k tokens (activation
  # checkpointing, ZeRO-1), then longer until one does not fit; the one-GPU rows are stage_longseq's
  local S="--steps 4 --warmup-steps 1" M="$GPT13 --micro-batch-size 1 --zero-stage 1 --checkpoint-activations"
  ds_patches
  for seq in 65536 131072 262144; do
    t 240 $B $S --dp-hint 1 --name gpt1_3b_s${seq}_mbs1_z1_ckpt_sp2 -- $M --seq-length $seq \
      --max-position-embeddings $seq --ds-sequence-parallel-size 2 --nproc-per-node 2 || break
  done
}

stage_reshard13() {  # issue 17: GPT-1.3B (fp32, ZeRO-1) TP=2 -> TP=1 reshard on this host's CPUs (GPU hidden),
  # pinned to the upper half of the cores so that a GPU stage can run beside it (`reshard13_bg`)
  local cores=$(nproc) 
  t 560 taskset -c $((cores / 2))-$((cores - 1)) $PYTHON bench/reshard_timing.py --name reshard_gpt1_3b_cpu \
    --preset GPT1_3B --from-tp 2 --to-tp 1 --machine "the device host's CPUs: $((cores / 2)) of its $cores cores \
(taskset), GPU hidden, $(free -g | awk '/Mem:/ {print $2}') GiB memory; a GPU benchmark ran on the other cores"
}

stage_optstep() {  # issues 14/15, one GPU: where the patched bf16 ZeRO-1 optimizer step goes (GPT-1.3B, GPT-2.7B
  # at their benchmark batches; Chrome traces gzipped straight to $OUT, tables in the logs)
  local P="$PYTHON bench/profile_train.py --no-profile --profile-optimizer-step --variant compile"
  ds_patches
  t 150 $P --out "$LOGS/optstep_gpt1_3b.txt" -- $GPT13 --micro-batch-size 16 --zero-stage 1
  t 180 $P --out "$LOGS/optstep_gpt2_7b.txt" -- --preset GPT2_7B --bf16 --micro-batch-size 8 --zero-stage 1
  for f in "$LOGS"/optstep_*.step_trace.json; do gzip -c "$f" > "$OUT/$(basename "$f").gz" && rm -f "$f"; done
}

stage_fp8nodrop() {  # issue 14: FP8 vs bf16 with dropout 0 (the reference has none), GPT-1.3B and GPT-2.7B
  local F="$PYTHON bench/fp8_compare.py" S="--steps 24 --warmup-steps 10" N="--hidden-dropout 0 --attention-dropout 0"
  ds_patches
  t 200 $F $S --name gpt1_3b_s2048_mbs16_z1_compile_nodrop_fp8 -- $GPT13 --micro-batch-size 16 --zero-stage 1 \
    --torch-compile $N
  t 240 $F $S --name gpt2_7b_s2048_mbs8_z1_compile_nodrop_fp8 -- --preset GPT2_7B --bf16 --micro-batch-size 8 \
    --zero-stage 1 --torch-compile $N
}

defaults_vs_reference() {  # issue 15, one call: GPT-1.3B default flags (compiled by default), the compiled
  # plain-PyTorch reference, and global batch 128 without dropout, with the current patches/deepspeed.
  # $1: the call's label, $2: the suffix of the result names
  ds_patches
  if [ -f .whl/reference_gpt.py ]; then
    OUT="$LOGS" t 200 $PYTHON .whl/reference_gpt.py --which compile --mbs 16 --steps 10 --warmup 3
    cp "$LOGS/anchor.json" "$OUT/reference_gpt_$1.json" 2>/dev/null
  fi
  t 150 $B --steps 20 --warmup-steps 5 --name "gpt1_3b_s2048_mbs16_z1_default_flags_$2" -- $GPT13 \
    --micro-batch-size 16 --zero-stage 1
  t 240 $B --steps 8 --warmup-steps 3 --name "gpt1_3b_s2048_mbs16_gbs128_z1_compile_nodrop_$2" -- $GPT13 \
    --micro-batch-size 16 --zero-stage 1 --global-batch-size 128 --hidden-dropout 0 --attention-dropout 0
  cp bench/results/gpt1_3b_s2048_mbs16_*_"$2".json "$OUT"/ 2>/dev/null
}

stage_defaults18() { defaults_vs_reference defaults18 "${RUN_TAG:-s18}"; }  # the one-GPU targets again, one call

stage_defaults2() { defaults_vs_reference defaults2 foreach_norm; }

stage_session6b() {  # one call, nothing beside it: the defaults (issue 15), then GPT-2.7B FP8 vs bf16 without dropout
  stage_defaults2
  local F="$PYTHON bench/fp8_compare.py" S="--steps 24 --warmup-steps 10"
  t 240 $F $S --name gpt2_7b_s2048_mbs8_z1_compile_nodrop_fp8 -- --preset GPT2_7B --bf16 --micro-batch-size 8 \
    --zero-stage 1 --torch-compile --hidden-dropout 0 --attention-dropout 0
}

stage_session6() {  # one call: the CPU reshard beside the GPU stages
  ds_patches  # before either imports DeepSpeed
  ( stage_reshard13 > "$LOGS/stage_reshard13.log" 2>&1 ) &
  local bg=$!
  stage_optstep
  stage_defaults2
  wait $bg
  cat "$LOGS/stage_reshard13.log"
  $PYTHON -c "import json; d = json.load(open('bench/results/reshard_gpt1_3b_cpu.json')); \
    [print(k, d[k].get('exit_code'), d[k]['log_tail'][-1500:]) for k in ('source', 'reshard', 'resume') if k in d]"
}

stage_zero3compile() {  # issue 15, one GPU, one call: ZeRO-3 compiled (whole-layer gathers, torch's linear): the
  # per-parameter gradient probe (with DeepSpeed's linear Function: the bug), the compiled-vs-eager tests, and
  # GPT-1.3B ZeRO-3 eager vs compiled speed
  local S="--steps 12 --warmup-steps 4" M="$GPT13 --micro-batch-size 16 --zero-stage 3"
  ds_patches
  t 200 $PYTHON bench/zero3_compile_probe.py --out "$LOGS/zero3_compile_probe.json" \
    --variants eager,inductor,inductor+dslinear,dynamo_eager+dslinear
  MDS_GPU_REPORT="$LOGS/gpu_tests_zero3_compile.json" t 300 $PYTHON -m pytest -m gpu tests/gpu -q -rA \
    -p no:cacheprovider -k "zero3_compile_1gpu"
  t 150 $B $S --name gpt1_3b_s2048_mbs16_z3_eager_1gpu -- $M --no-torch-compile
  t 150 $B $S --name gpt1_3b_s2048_mbs16_z3_compile_1gpu -- $M
}

stage_gelu() {  # issues 14/15, one call: GPT-1.3B without dropout, exact GeLU vs its tanh approximation
  # (--openai-gelu: Megatron's fused bias-GeLU, the plain-PyTorch reference's), bf16 and FP8 (torchao) each; and
  # the one-process profile harness once (bench/in_process.py)
  local F="$PYTHON bench/fp8_compare.py" S="--steps 20 --warmup-steps 8" N="--hidden-dropout 0 --attention-dropout 0"
  ds_patches
  t 230 $F $S --name gpt1_3b_s2048_mbs16_z1_compile_nodrop_fp8_erf -- $GPT13 --micro-batch-size 16 --zero-stage 1 \
    --torch-compile $N
  t 230 $F $S --name gpt1_3b_s2048_mbs16_z1_compile_nodrop_fp8_tanh -- $GPT13 --micro-batch-size 16 --zero-stage 1 \
    --torch-compile $N --openai-gelu
  t 120 $PYTHON bench/profile_train.py --no-profile --steps 5 --variant compile --out "$LOGS/profile_check.txt" -- \
    $GPT13 --micro-batch-size 8 --zero-stage 1
}

stage_fp8cdt() {  # issue 14, one call: GPT-1.3B FP8 vs bf16 without dropout, plain and with inductor's
  # coordinate-descent tuning of its fused kernels (torchao's amax/cast kernels ran ~3x off memory bandwidth)
  local F="$PYTHON bench/fp8_compare.py" S="--steps 20 --warmup-steps 8" N="--hidden-dropout 0 --attention-dropout 0"
  ds_patches
  t 230 $F $S --name gpt1_3b_s2048_mbs16_z1_compile_nodrop_fp8_s7 -- $GPT13 --micro-batch-size 16 --zero-stage 1 \
    --torch-compile $N
  TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 t 330 $F $S --name gpt1_3b_s2048_mbs16_z1_compile_nodrop_fp8_cdt -- \
    $GPT13 --micro-batch-size 16 --zero-stage 1 --torch-compile $N
}

stage_fp8tuned() {  # issue 14, one call: GPT-2.7B FP8 vs bf16 without dropout, FP8 with inductor's kernel tuning
  # (the torchao default on CUDA since this commit) and without it (TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=0)
  local F="$PYTHON bench/fp8_compare.py" S="--steps 16 --warmup-steps 6" N="--hidden-dropout 0 --attention-dropout 0"
  local M="--preset GPT2_7B --bf16 --micro-batch-size 8 --zero-stage 1 --torch-compile $N"
  ds_patches
  t 280 $F $S --name gpt2_7b_s2048_mbs8_z1_compile_nodrop_fp8_tuned -- $M
  TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=0 t 240 $F $S --name gpt2_7b_s2048_mbs8_z1_compile_nodrop_fp8_s7 -- $M
}

stage_session7x2() {  # issue 15 on 2 GPUs, one call: ZeRO-3 DP=2 and PP=2 compiled reproduce the one-GPU curve
  # and their eager selves (dropout on and off); GPT-1.3B TP=2 eager vs compiled (now the default)
  local S="--steps 10 --warmup-steps 3" M="$GPT13 --micro-batch-size 16 --zero-stage 1"
  ds_patches
  MDS_GPU_REPORT="$LOGS/gpu_tests_session7x2.json" t 300 $PYTHON -m pytest -m gpu tests/gpu -q -rA \
    -p no:cacheprovider -k "zero3_dp2_compile or pp2_compile"
  t 110 $B $S --name gpt1_3b_s2048_mbs16_z1_tp2_eager_s7 -- $M --nproc-per-node 2 --tensor-model-parallel-size 2 \
    --no-torch-compile
  t 130 $B $S --name gpt1_3b_s2048_mbs16_z1_tp2_compile_s7 -- $M --nproc-per-node 2 --tensor-model-parallel-size 2
}

stage_fp8x2() {  # issue 14 on 2 GPUs: FP8 (torchao) under TP=2 (+SP), PP=2, ZeRO-1/2/3 DP=2 against one GPU's FP8
  # curve (pytest -m gpu; needs torchao from .whl)
  ds_patches
  MDS_GPU_REPORT="$LOGS/gpu_tests_fp8x2.json" t 420 $PYTHON -m pytest -m gpu tests/gpu -q -rA -p no:cacheprovider \
    -k "fp8_layout"
}

tp_overlap_levers() {  # PRESET MICRO_BATCH NAME_STEM LIMIT_S: TP=2 + SP with the default flags (compiled, dropout
  # 0.1) and each --tp-comm-overlap lever: none, reorder (inductor moves the collectives), pipeline (torch's async TP)
  local S="--steps 8 --warmup-steps 3"
  local M="--preset $1 --bf16 --micro-batch-size $2 --zero-stage 1 --nproc-per-node 2 --tensor-model-parallel-size 2"
  ds_patches
  t $(( $4 + 90 )) $B $S --name "$3_tp2_sp" -- $M --sequence-parallel --tp-comm-overlap none  # cold start: ~95 s more
  t "$4" $B $S --name "$3_tp2_sp_reorder" -- $M --sequence-parallel --tp-comm-overlap reorder
  t $(( $4 + 20 )) $B $S --name "$3_tp2_sp_pipeline" -- $M --sequence-parallel --tp-comm-overlap pipeline
}

stage_tpoverlap() {  # issue 15 on 2 GPUs, one call: the levers on GPT-2.7B (micro batch 8)
  tp_overlap_levers GPT2_7B 8 gpt2_7b_s2048_mbs8_z1 130
}

stage_tpoverlapnosp() {  # issue 15 on 2 GPUs, one call: GPT-2.7B TP=2 without SP, compiled, without and with reorder
  local S="--steps 8 --warmup-steps 3"
  local M="--preset GPT2_7B --bf16 --micro-batch-size 8 --zero-stage 1 --nproc-per-node 2 --tensor-model-parallel-size 2"
  ds_patches
  t 130 $B $S --name gpt2_7b_s2048_mbs8_z1_tp2 -- $M --tp-comm-overlap none
  t 130 $B $S --name gpt2_7b_s2048_mbs8_z1_tp2_reorder -- $M --tp-comm-overlap reorder
}

stage_tpoverlap67() {  # as tpoverlap for GPT-6.7B (micro batch 4; the issue's TP=2 measurement: MFU 0.375, SP 0.391)
  tp_overlap_levers GPT6_7B 4 gpt6_7b_s2048_mbs4_z1 170
}

stage_profiledefault() {  # issues 14/15, one GPU, one call: where the GPT-1.3B step of the default flags goes, by
  # kernel kind (GEMM, attention, fused element-wise, optimizer, copies) and idle, with and without dropout
  local P="$PYTHON bench/profile_train.py --steps 10"
  ds_patches
  t 200 $P --variant compile --out "$LOGS/profile_default_s8.txt" -- $GPT13 --micro-batch-size 16 --zero-stage 1
  t 200 $P --variant compile+nodrop --out "$LOGS/profile_nodrop_s8.txt" -- $GPT13 --micro-batch-size 16 --zero-stage 1
  cp "$LOGS"/profile_*_s8.* "$OUT"/ 2>/dev/null
}

stage_inductorlevers() {  # issue 15, one GPU, one call: inductor's own tuning switches on the default-flags step
  # (GPT-1.3B, micro batch 16, dropout 0.1, compiled), whose fused element-wise kernels take 77 of its 556 ms
  local P="$PYTHON bench/profile_train.py --no-profile --steps 10 --variant compile"
  ds_patches
  for lever in NONE TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE TORCHINDUCTOR_MULTI_KERNEL TORCHINDUCTOR_BENCHMARK_FUSION; do
    ( export "$lever=1"; t 170 $P --out "$LOGS/inductor_lever_$lever.txt" -- $GPT13 --micro-batch-size 16 --zero-stage 1 )
  done
  cp "$LOGS"/inductor_lever_*.json "$OUT"/ 2>/dev/null
}

stage_tpoverlaptests() {  # issue 15 on 2 GPUs: compiled TP=2 (+SP) with each --tp-comm-overlap (reorder, the
  # default; none; pipeline with SP) against their eager selves, dropout on and off (pytest -m gpu)
  ds_patches
  MDS_GPU_REPORT="$LOGS/gpu_tests_tpoverlap.json" t 400 $PYTHON -m pytest -m gpu tests/gpu -q -rA \
    -p no:cacheprovider -k "tp2_compile or tp2_sp_compile"
}

stage_elementwise() {  # issue 15, one GPU, one call: the default-flags step (GPT-1.3B, micro batch 16, dropout 0.1)
  # under inductor's random-number choices, the clipping factor folded into fused AdamW (patch 0003 now) against
  # the previous patch 0003 (.whl/old0003.patch, when carried), and the element-wise pieces alone
  local P="$PYTHON bench/profile_train.py --no-profile --steps 10 --variant compile"
  ds_patches
  t 150 $PYTHON bench/probe_elementwise.py --out "$OUT/probe_elementwise_h200.json"
  t 120 $P --out "$LOGS/random_inductor.txt" -- $GPT13 --micro-batch-size 16 --zero-stage 1
  MDS_INDUCTOR_OPTIONS='{"fallback_random": true}' t 120 $P --out "$LOGS/random_fallback.txt" -- $GPT13 \
    --micro-batch-size 16 --zero-stage 1
  if [ -f .whl/old0003.patch ]; then
    local site
    site=$($PYTHON -c "import deepspeed, os; print(os.path.dirname(os.path.dirname(deepspeed.__file__)))")
    GIT_CEILING_DIRECTORIES="$(dirname "$site")" git -C "$site" apply --reverse "$PWD/patches/deepspeed/0003-zero-bf16-step-on-device.patch" \
      && GIT_CEILING_DIRECTORIES="$(dirname "$site")" git -C "$site" apply "$PWD/.whl/old0003.patch" \
      && t 120 $P --out "$LOGS/random_inductor_old0003.txt" -- $GPT13 --micro-batch-size 16 --zero-stage 1
  fi
  cp "$LOGS"/random_*.json "$OUT"/ 2>/dev/null
}

stage_fallbackrandom() {  # issue 15, one GPU, one call: inductor's own dropout random numbers against ATen's dropout
  # kernel (fallback_random) on the default-flags GPT-1.3B step, alternated twice, then each profiled by kernel kind
  local P="$PYTHON bench/profile_train.py --steps 10 --variant compile" A="-- $GPT13 --micro-batch-size 16 --zero-stage 1"
  local F='{"fallback_random": true}'
  ds_patches
  for round in 1 2; do
    t 120 $P --no-profile --out "$LOGS/rng_inductor_$round.txt" $A
    MDS_INDUCTOR_OPTIONS="$F" t 120 $P --no-profile --out "$LOGS/rng_fallback_$round.txt" $A
  done
  t 150 $P --out "$LOGS/rng_inductor_profile.txt" $A
  MDS_INDUCTOR_OPTIONS="$F" t 150 $P --out "$LOGS/rng_fallback_profile.txt" $A
  cp "$LOGS"/rng_*.json "$LOGS"/rng_*profile.txt "$OUT"/ 2>/dev/null
}

stage_defaults9() {  # session 9: ATen's dropout in the compiled layers, the clipping factor inside fused AdamW
  defaults_vs_reference defaults9 s9
}

stage_gpupp() {  # on 2 GPUs: the PP=2 GPU tests (eager and compiled against the one-GPU curve, compiled against eager
  # with dropout on and off) with the head-aware stage split that is the default since session 20
  ds_patches
  MDS_GPU_REPORT="$LOGS/gpu_tests_pp.json" t 500 $PYTHON -m pytest -m gpu tests/gpu -q -rA -p no:cacheprovider \
    -k "pp2 and not fp8"
  cp "$LOGS/gpu_tests_pp.json" "$OUT"/ 2>/dev/null
}

stage_gpucompile1() {  # the one-GPU --torch-compile test against eager, dropout on and off
  MDS_GPU_REPORT="$LOGS/gpu_tests_compile1.json" t 400 $PYTHON -m pytest -m gpu tests/gpu -q -rA -p no:cacheprovider \
    -k "compile_matches_eager and 1gpu"
  cp "$LOGS/gpu_tests_compile1.json" "$OUT"/ 2>/dev/null
}

stage_gemmautotune() {  # issue 15, one GPU, one call: inductor's GEMM autotuning (Triton templates against cuBLAS,
  # epilogues fused into them) on the default-flags GPT-1.3B step, both profiled by kernel kind
  local P="$PYTHON bench/profile_train.py --steps 10 --variant compile" A="-- $GPT13 --micro-batch-size 16 --zero-stage 1"
  ds_patches
  t 150 $P --out "$LOGS/gemm_aten.txt" $A
  TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1 t 420 $P --out "$LOGS/gemm_autotune.txt" $A
  cp "$LOGS"/gemm_*.json "$OUT"/ 2>/dev/null
  for f in "$LOGS"/gemm_*.txt; do head -c 60000 "$f" > "$OUT/$(basename "$f")"; done
}

stage_fp8default9() {  # GPT-1.3B FP8 vs bf16 with the default flags (dropout 0.1), one call
  ds_patches
  t 420 $PYTHON bench/fp8_compare.py --steps 24 --warmup-steps 10 --name gpt1_3b_s2048_mbs16_z1_default_fp8_s9 \
    -- $GPT13 --micro-batch-size 16 --zero-stage 1
  cp bench/results/gpt1_3b_s2048_mbs16_z1_default_fp8_s9*.json "$OUT"/ 2>/dev/null
}

stage_fp8drop9() {  # issues 14/15, one GPU, one call: GPT-1.3B FP8 vs bf16 with the default flags' dropout 0.1
  # (session 9: ATen's dropout inside the compiled FP8 layers), then the one-GPU GPU tests
  stage_fp8default9
  MDS_GPU_REPORT="$LOGS/gpu_tests_1gpu_s9.json" t 300 $PYTHON -m pytest -m gpu tests/gpu -q -rA -p no:cacheprovider \
    -k "zero0 or speed_paths or fp16 or metrics"
  cp bench/results/gpt1_3b_s2048_mbs16_z1_default_fp8_s9*.json "$LOGS/gpu_tests_1gpu_s9.json" "$OUT"/ 2>/dev/null
}

stage_flatstep() {  # issue 15, one GPU, one call: patch 0004 (the bf16 ZeRO step from the flat bf16 gradient to both
  # weights in one kernel) against 0001-0003 alone on the default-flags GPT-1.3B step, alternated, the optimizer
  # phase profiled; then the GPU tests that run the flat step (its kernel against torch's AdamW, training curves)
  local P="$PYTHON bench/profile_train.py --steps 10 --variant compile" A="-- $GPT13 --micro-batch-size 16 --zero-stage 1"
  ds_patches
  toggle() { ds_patch_toggle 0004-zero-bf16-flat-master-step.patch "$1"; }
  MDS_GPU_REPORT="$LOGS/gpu_tests_flatstep.json" t 240 $PYTHON -m pytest -m gpu tests/gpu -q -rA -p no:cacheprovider \
    -k "${FLAT_TESTS:-flat_master or speed_paths or zero0}"
  for round in 1 2; do
    t 120 $P --no-profile --out "$LOGS/flat_0004_$round.txt" $A
    toggle --reverse && t 120 $P --no-profile --out "$LOGS/flat_0003_$round.txt" $A; toggle ""
  done
  t 150 $P --no-profile --profile-optimizer-step --out "$LOGS/flat_0004_optstep.txt" $A
  t 150 $P --out "$LOGS/flat_0004_profile.txt" $A
  rm -f "$LOGS"/flat_*.step_trace.json
  cp "$LOGS"/flat_*.json "$LOGS"/flat_*optstep*.txt "$LOGS/gpu_tests_flatstep.json" "$OUT"/ 2>/dev/null
}

stage_defaults9end() {  # session 9's last state (the flat step without a host copy) against the reference, one call
  defaults_vs_reference defaults9end s9end
}

stage_defaults9final() {  # session 9's end state in one call: the defaults against the reference, then the default
  # step profiled by kernel kind
  defaults_vs_reference defaults9final s9final
  t 150 $PYTHON bench/profile_train.py --steps 10 --variant compile --out "$LOGS/profile_default_s9final.txt" -- \
    $GPT13 --micro-batch-size 16 --zero-stage 1
  cp "$LOGS"/profile_default_s9final.* "$OUT"/ 2>/dev/null
}

gpu_monitor() {  # $1: a CSV under $LOGS sampling the GPU's clocks, power and temperature every 0.5 s until
  # gpu_monitor_stop: a step that slows down as the GPU heats shows up there, not as our code
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
    --format=csv -lms 500 > "$LOGS/$1" 2>&1 &
  MONITOR=$!
}

gpu_monitor_stop() { kill "$MONITOR" 2>/dev/null; wait "$MONITOR" 2>/dev/null; }

stage_hostwait() {  # issue 15, one GPU, one call: does a training step ever wait for the GPU (the sync-debug GPU
  # tests), and where the GPU idles inside the default-flags GPT-1.3B step (profile: idle gaps, per-phase times)
  ds_patches
  gpu_monitor smi_hostwait.csv
  MDS_GPU_REPORT="$LOGS/gpu_tests_hostwait.json" t 300 $PYTHON -m pytest -m gpu tests/gpu -q -rA -p no:cacheprovider \
    -k "never_waits or flat_master"
  t 200 $PYTHON bench/profile_train.py --steps 14 --variant compile --out "$LOGS/profile_hostwait.txt" -- \
    $GPT13 --micro-batch-size 16 --zero-stage 1
  gpu_monitor_stop
  cp "$LOGS"/profile_hostwait.* "$LOGS/gpu_tests_hostwait.json" "$LOGS/smi_hostwait.csv" "$OUT"/ 2>/dev/null
}

stage_likeforlike() {  # issue 15, one GPU, one call: the reference, our default flags, the same without dropout
  # (the reference's math: like for like), and the default flags timed once per 5 steps (as training logs)
  gpu_monitor smi_likeforlike.csv
  defaults_vs_reference likeforlike s10
  local M="$GPT13 --micro-batch-size 16 --zero-stage 1"
  t 150 $B --steps 20 --warmup-steps 5 --name gpt1_3b_s2048_mbs16_z1_nodrop_s10 -- $M --hidden-dropout 0 \
    --attention-dropout 0
  cp bench/results/gpt1_3b_s2048_mbs16_*_s10.json "$OUT"/ 2>/dev/null
  t 150 $B --steps 25 --warmup-steps 5 --name gpt1_3b_s2048_mbs16_z1_default_flags_log5_s10 -- $M --log-interval 5
  gpu_monitor_stop
  cp bench/results/gpt1_3b_s2048_mbs16_*_s10.json "$LOGS/smi_likeforlike.csv" "$OUT"/ 2>/dev/null
}

ds_patches() {  # patches/deepspeed onto the DeepSpeed this call imports (what the images do at build)
  $PYTHON patches/apply deepspeed --installed deepspeed --manifest "$LOGS/patch-manifest.json"
}

stage_sharedgpu() {  # issue 15, one GPU standing in for two: the two-rank GPU tests with both ranks on GPU 0 over
  # gloo (tests/gpu: MDS_GPU_TESTS_SHARE_GPU). Not PP (gloo cannot send CUDA tensors) nor SP (its asynchronous
  # all-gather segfaults on CUDA tensors); not NCCL, not speed. ~8 minutes on an H100: split it across calls.
  ds_patches
  MDS_GPU_TESTS_SHARE_GPU=1 MDS_GPU_REPORT="$LOGS/gpu_tests_sharedgpu.json" t 590 $PYTHON -m pytest -m gpu tests/gpu -q \
    -rA -p no:cacheprovider -k "${SHARED_TESTS:-(test_compile_matches_eager and (tp2_compile or zero3_dp2) and not sp \
    and not pipeline) or (test_layout_matches_single_gpu_bf16 and (tp2 or dp2) and not sp and not compile)}"
  cp "$LOGS/gpu_tests_sharedgpu.json" "$OUT"/ 2>/dev/null
}

ds_patch_toggle() {  # $1: a patch of patches/deepspeed, $2: --reverse (take it out of the installed DeepSpeed) or ""
  local site
  site=$($PYTHON -c "import deepspeed, os; print(os.path.dirname(os.path.dirname(deepspeed.__file__)))" 2>/dev/null)
  # shellcheck disable=SC2086
  GIT_CEILING_DIRECTORIES="$(dirname "$site")" git -C "$site" apply $2 "$PWD/patches/deepspeed/$1"
}

without_ds_patch() {  # $1: a patch of patches/deepspeed; the rest: a command, run with that patch taken out of the
  # installed DeepSpeed, which gets it back afterwards
  local patch=$1; shift
  ds_patch_toggle "$patch" --reverse || return
  "$@"
  ds_patch_toggle "$patch" ""
}

stage_dppp() {  # issue 15 on 2 GPUs, one call: DP and PP against one GPU with today's defaults (compiled, dropout
  # 0.1, patched DeepSpeed); the issue asks DP per GPU >= 0.95x one GPU and PP=2 >= 0.88x (session 3, eager).
  # Results are named by $RUN_TAG (default s12); on an 80 GB card (H100) one GPU and DP=2 run micro batch 8,
  # since 16 does not fit there with the default flags
  local mbs=16
  [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -lt 100000 ] && mbs=8
  local S="--steps 12 --warmup-steps 4" M="$GPT13 --micro-batch-size $mbs --zero-stage 1" tag=${RUN_TAG:-s12}
  ds_patches
  t 150 $B $S --name "gpt1_3b_s2048_mbs${mbs}_z1_dp1_$tag" -- $M --nproc-per-node 1
  t 170 $B $S --dp-hint 2 --name "gpt1_3b_s2048_mbs${mbs}_z1_dp2_$tag" -- $M --nproc-per-node 2
  t 200 $B $S --name "gpt1_3b_s2048_mbs8_gbs64_z1_pp2_$tag" -- $GPT13 --micro-batch-size 8 --global-batch-size 64 \
    --zero-stage 1 --nproc-per-node 2 --pipeline-model-parallel-size 2
}

stage_pp16() {  # issue 15 on 2 x H200, one call: PP=2 at one GPU's micro batch (16) against one GPU, eight micro-batches
  # per step as dppp's PP=2 run (global batch 128: the 1F1B bubble, (p - 1) / m = 1/8, is the same), then 16 (256)
  local S="--steps 12 --warmup-steps 4" tag=${RUN_TAG:-s20}
  local P="$GPT13 --micro-batch-size 16 --zero-stage 1 --nproc-per-node 2 --pipeline-model-parallel-size 2"
  ds_patches
  t 150 $B $S --name "gpt1_3b_s2048_mbs16_z1_dp1_pp16_$tag" -- $GPT13 --micro-batch-size 16 --zero-stage 1 \
    --nproc-per-node 1
  t 200 $B $S --name "gpt1_3b_s2048_mbs16_gbs128_z1_pp2_$tag" -- $P --global-batch-size 128
  t 200 $B --steps 8 --warmup-steps 3 --name "gpt1_3b_s2048_mbs16_gbs256_z1_pp2_$tag" -- $P --global-batch-size 256
}

stage_ppsplit() {  # issue 15 on 2 GPUs, one call: PP=2 with the default split (the last stage relieved of layers by
  # its output head's FLOPs: GPT-1.3B 13 | 11, parallel/pipeline_split.py) against the even split (12 | 12, what
  # ran before) and one GPU, eight micro-batches per step; micro batch 16 on a 141 GB card, else 8
  local S="--steps 12 --warmup-steps 4" tag=${RUN_TAG:-s20} mbs=8
  [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -gt 100000 ] && mbs=16
  local P="$GPT13 --micro-batch-size $mbs --global-batch-size $((mbs * 8)) --zero-stage 1 --nproc-per-node 2"
  P="$P --pipeline-model-parallel-size 2"
  ds_patches
  t 150 $B $S --name "gpt1_3b_s2048_mbs${mbs}_z1_dp1_ppsplit_$tag" -- $GPT13 --micro-batch-size $mbs --zero-stage 1 \
    --nproc-per-node 1
  t 200 $B $S --name "gpt1_3b_s2048_mbs${mbs}_gbs$((mbs * 8))_z1_pp2_split13_11_$tag" -- $P
  t 200 $B $S --name "gpt1_3b_s2048_mbs${mbs}_gbs$((mbs * 8))_z1_pp2_even_$tag" -- $P --decoder-last-pipeline-num-layers 12
  [ $mbs = 16 ] && t 200 $B $S --name "gpt1_3b_s2048_mbs8_gbs64_z1_pp2_split13_11_$tag" -- $GPT13 --micro-batch-size 8 \
    --global-batch-size 64 --zero-stage 1 --nproc-per-node 2 --pipeline-model-parallel-size 2
}

stage_ppsplit16() {  # issue 15 on 2 x H200, one short call (the budget's last minutes): one GPU at micro batch 16,
  # then PP=2 with the default split (13 | 11) at micro batch 16, global batch 128; each record copied out at once
  local S="--steps 8 --warmup-steps 3" tag=${RUN_TAG:-s20}
  ds_patches
  t 110 $B $S --name "gpt1_3b_s2048_mbs16_z1_dp1_ppsplit16_$tag" -- $GPT13 --micro-batch-size 16 --zero-stage 1 \
    --nproc-per-node 1
  cp bench/results/gpt1_3b_s2048_mbs16_z1_dp1_ppsplit16_$tag.json "$OUT"/ 2>/dev/null
  t 120 $B $S --name "gpt1_3b_s2048_mbs16_gbs128_z1_pp2_split13_11_$tag" -- $GPT13 --micro-batch-size 16 \
    --global-batch-size 128 --zero-stage 1 --nproc-per-node 2 --pipeline-model-parallel-size 2
  cp bench/results/gpt1_3b_s2048_mbs16_gbs128_z1_pp2_split13_11_$tag.json "$OUT"/ 2>/dev/null
}

stage_dppp16() {  # issue 15 on 2 x H200, one call: the DP and PP targets again at HEAD, micro batch 16 throughout:
  # one GPU, DP=2 (per GPU >= 0.95x one GPU) and PP=2 at global batch 128 (>= 0.88x; the default 13 | 11 split)
  local S="--steps 12 --warmup-steps 4" tag=${RUN_TAG:-s26} M="$GPT13 --micro-batch-size 16 --zero-stage 1"
  ds_patches
  t 150 $B $S --name "gpt1_3b_s2048_mbs16_z1_dp1_$tag" -- $M --nproc-per-node 1
  cp bench/results/gpt1_3b_s2048_mbs16_z1_dp1_$tag.json "$OUT"/ 2>/dev/null
  t 170 $B $S --dp-hint 2 --name "gpt1_3b_s2048_mbs16_z1_dp2_$tag" -- $M --nproc-per-node 2
  cp bench/results/gpt1_3b_s2048_mbs16_z1_dp2_$tag.json "$OUT"/ 2>/dev/null
  t 200 $B $S --name "gpt1_3b_s2048_mbs16_gbs128_z1_pp2_$tag" -- $M --global-batch-size 128 --nproc-per-node 2 \
    --pipeline-model-parallel-size 2
  cp bench/results/gpt1_3b_s2048_mbs16_gbs128_z1_pp2_$tag.json "$OUT"/ 2>/dev/null
}

stage_dpoverlap() {  # issue 15 on 2 GPUs, one call: DP=2 (GPT-1.3B, micro batch 16, ZeRO-1) with DeepSpeed's
  # overlap_comm (gradients reduced on a side stream during backward, in buckets of $DP_BUCKET elements) against
  # the default (reduced after backward on the compute stream), A B A B between two one-GPU runs
  local S="--steps 10 --warmup-steps 3" tag=${RUN_TAG:-s26} M="$GPT13 --micro-batch-size 16 --zero-stage 1" i
  local cfg="$LOGS/ds_overlap_comm.json"
  printf '{"zero_optimization": {"stage": 1, "overlap_comm": true, "reduce_bucket_size": %s}}\n' \
    "${DP_BUCKET:-50000000}" > "$cfg"
  ds_patches
  keep() { cp bench/results/gpt1_3b_s2048_mbs16_z1_dp*_"$tag"*.json "$OUT"/ 2>/dev/null; }
  t 120 $B $S --name "gpt1_3b_s2048_mbs16_z1_dp1_ovl_${tag}_1" -- $M --nproc-per-node 1; keep
  for i in 1 2; do
    t 120 $B $S --dp-hint 2 --name "gpt1_3b_s2048_mbs16_z1_dp2_default_${tag}_$i" -- $M --nproc-per-node 2; keep
    t 120 $B $S --dp-hint 2 --name "gpt1_3b_s2048_mbs16_z1_dp2_overlap_comm_${tag}_$i" -- $M --nproc-per-node 2 \
      --deepspeed_config "$cfg"; keep
  done
  t 120 $B $S --name "gpt1_3b_s2048_mbs16_z1_dp1_ovl_${tag}_2" -- $M --nproc-per-node 1; keep
}

stage_dppp80() {  # as dppp where one 80 GB card cannot hold micro batch 16 with the default flags (H100):
  # micro batch 8 for one GPU and DP=2; then GPT-6.7B TP=2+SP without an overlap lever, given the time its cold
  # start needs
  local S="--steps 12 --warmup-steps 4" M="$GPT13 --micro-batch-size 8 --zero-stage 1"
  ds_patches
  t 130 $B $S --name gpt1_3b_s2048_mbs8_z1_dp1_s12 -- $M --nproc-per-node 1
  t 150 $B $S --dp-hint 2 --name gpt1_3b_s2048_mbs8_z1_dp2_s12 -- $M --nproc-per-node 2
  t 260 $B --steps 8 --warmup-steps 3 --name gpt6_7b_s2048_mbs4_z1_tp2_sp -- --preset GPT6_7B --bf16 \
    --micro-batch-size 4 --zero-stage 1 --nproc-per-node 2 --tensor-model-parallel-size 2 --sequence-parallel
}

stage_tpdrop67() {  # issue 15 on 2 GPUs: GPT-6.7B TP=2+SP with the default flags (dropout 0.1), no overlap lever
  # and pipeline, in one call, since the attention core runs eagerly between two graphs (SelfAttention.core_for)
  local S="--steps 8 --warmup-steps 3"
  local M="--preset GPT6_7B --bf16 --micro-batch-size 4 --zero-stage 1 --nproc-per-node 2 --tensor-model-parallel-size 2"
  ds_patches
  t 270 $B $S --name gpt6_7b_s2048_mbs4_z1_tp2_sp_2graphs -- $M --sequence-parallel --tp-comm-overlap none  # cold
  t 180 $B $S --name gpt6_7b_s2048_mbs4_z1_tp2_sp_pipeline_2graphs -- $M --sequence-parallel --tp-comm-overlap pipeline
}

stage_tppipelinetests() {  # issue 15 on 2 GPUs: compiled TP=2+SP with --tp-comm-overlap pipeline against eager,
  # dropout on and off (pytest -m gpu; the report is written after every run)
  ds_patches
  MDS_GPU_REPORT="$OUT/gpu_tests_tppipeline.json" t ${PIPE_LIMIT:-160} $PYTHON -m pytest -m gpu tests/gpu -q -rA \
    -p no:cacheprovider -k "tp2_sp_compile_pipeline"
}

stage_tpprofile() {  # issue 15 on 2 GPUs: where the GPT-6.7B TP=2+SP step with the default flags goes (GEMM,
  # attention, NCCL, fused element-wise, idle), profiled on both ranks as `entrypoint train` builds it (session 13
  # profiled it before reorder became the default). TP_OVERLAP=chunked (or another mode) profiles that mode.
  local mode=${TP_OVERLAP:-default}
  ds_patches
  t ${PROFILE_LIMIT:-360} $PYTHON -m torch.distributed.run --standalone --nproc-per-node 2 bench/profile_train.py \
    --steps 10 --variant compile --out "$LOGS/profile_tp2_sp_gpt6_7b_$mode.txt" -- --preset GPT6_7B --bf16 \
    --micro-batch-size 4 --zero-stage 1 --tensor-model-parallel-size 2 --sequence-parallel $(overlap_flag $mode)
  cp "$LOGS"/profile_tp2_sp_gpt6_7b_$mode.* "$OUT"/ 2>/dev/null
}

stage_tpprofile27() {  # issue 15 on 2 x H200: where the GPT-2.7B TP=2+SP step (micro batch 16, global batch 32, the
  # default flags) goes, by kernel kind on both ranks: the 0.457 against 0.50 (session 18)
  local tag=${RUN_TAG:-s21}
  ds_patches
  t ${PROFILE_LIMIT:-300} $PYTHON -m torch.distributed.run --standalone --nproc-per-node 2 bench/profile_train.py \
    --steps 8 --variant compile --out "$LOGS/profile_tp2_sp_gpt2_7b_mbs16_$tag.txt" -- --preset GPT2_7B --bf16 \
    --micro-batch-size 16 --global-batch-size 32 --zero-stage 1 --tensor-model-parallel-size 2 --sequence-parallel
  cp "$LOGS"/profile_tp2_sp_gpt2_7b_mbs16_$tag.* "$OUT"/ 2>/dev/null
}

stage_tp27gbs() {  # issue 15 on 2 x H200, one call: GPT-2.7B TP=2+SP with the default flags at the global batches
  # training runs use (GPT-3 2.7B: 512 sequences), where the optimizer step is paid once per many micro-batches:
  # micro batch 16 at global batch 128, micro batch 24 at global batch 96
  local S="--steps 6 --warmup-steps 2" tag=${RUN_TAG:-s21}
  local base="--preset GPT2_7B --bf16 --zero-stage 1 --nproc-per-node 2 --tensor-model-parallel-size 2 --sequence-parallel"
  ds_patches
  t 200 $B $S --name "gpt2_7b_s2048_mbs16_gbs128_z1_tp2_sp_default_$tag" -- $base --micro-batch-size 16 \
    --global-batch-size 128
  cp bench/results/gpt2_7b_s2048_mbs16_gbs128_z1_tp2_sp_default_$tag.json "$OUT"/ 2>/dev/null
  t 200 $B $S --name "gpt2_7b_s2048_mbs24_gbs96_z1_tp2_sp_default_$tag" -- $base --micro-batch-size 24 \
    --global-batch-size 96
  cp bench/results/gpt2_7b_s2048_mbs24_gbs96_z1_tp2_sp_default_$tag.json "$OUT"/ 2>/dev/null
}

stage_zero3x2() {  # issue 15 on 2 GPUs: ZeRO-3 DP=2 compiled over NCCL against the one-GPU curve and against
  # ZeRO-3 DP=2 eager, dropout on and off
  ds_patches
  MDS_GPU_REPORT="$OUT/gpu_tests_zero3x2.json" t ${ZERO3_LIMIT:-540} $PYTHON -m pytest -m gpu tests/gpu -q -rA \
    -p no:cacheprovider -k "zero3_dp2_compile"
}

stage_ncclprobe() {  # issue 15 on 2 GPUs: NCCL's all-gather / reduce-scatter of a sequence-parallel layer's
  # tensors, alone and beside a GEMM, under each NCCL setting worth trying (bench/probe_nccl.py)
  local P="$PYTHON -m torch.distributed.run --standalone --nproc-per-node ${NPROC:-2} bench/probe_nccl.py"
  $PYTHON -c "import torch; print('nccl', torch.cuda.nccl.version())"
  t 60 $P --label default --out "$OUT/nccl_probe.jsonl"
  NCCL_MIN_NCHANNELS=16 t 60 $P --label min_channels_16 --out "$OUT/nccl_probe.jsonl"
  NCCL_MIN_NCHANNELS=32 t 60 $P --label min_channels_32 --out "$OUT/nccl_probe.jsonl"
  NCCL_MAX_NCHANNELS=8 t 60 $P --label max_channels_8 --out "$OUT/nccl_probe.jsonl"
  NCCL_PROTO=Simple t 60 $P --label proto_simple --out "$OUT/nccl_probe.jsonl"
  NCCL_BUFFSIZE=16777216 t 60 $P --label buffsize_16m --out "$OUT/nccl_probe.jsonl"
  NCCL_P2P_LEVEL=NVL NCCL_MIN_NCHANNELS=32 NCCL_BUFFSIZE=16777216 t 60 $P --label min32_buff16m \
    --out "$OUT/nccl_probe.jsonl"
}

stage_ceprobe() {  # issue 15 on 2 GPUs, one short call: GPT-2.7B's sequence-parallel gather/scatter (micro batch 8:
  # 80 MiB gathered, hidden 2560) by NCCL's kernels and by the copy engines (torch symmetric memory's
  # low-contention ops), alone and beside the MLP GEMM (bench/probe_nccl.py --transport)
  local P="$PYTHON -m torch.distributed.run --standalone --nproc-per-node ${NPROC:-2} bench/probe_nccl.py"
  local transport
  for transport in nccl ce-workspace ce-symmetric; do
    t 60 $P --label "$transport" --transport "$transport" --hidden 2560 --sizes-mib 80 --out "$OUT/ce_probe.jsonl"
  done
}

stage_ctaprobe() {  # issue 15 on 2 GPUs, one call: fewer NCCL CTAs, so that a collective beside a GEMM leaves it more
  # SMs (on H200 NCCL beside the GEMM hid 0.03 of its 0.2 ms, session 20)
  nccl_settings_then_step cta "${RUN_TAG:-s21}" default NCCL_MAX_CTAS=16 NCCL_MAX_CTAS=8 NCCL_MAX_CTAS=4 \
    NCCL_CTA_POLICY=1 NCCL_CTA_POLICY=2
}

stage_p2pmemcpy() {  # issue 15 on 2 GPUs, one call: NCCL's P2P transport with copy-engine copies (its proxy thread
  # calls cudaMemcpyAsync for the sends) and with P2P reads off, against the default
  nccl_settings_then_step p2p "${RUN_TAG:-s23}" default NCCL_P2P_USE_CUDA_MEMCPY=1 NCCL_P2P_READ_ENABLE=0 \
    NCCL_P2P_READ_ENABLE=1
}

nccl_settings_then_step() {  # LABEL TAG SETTING...: GPT-2.7B's gathers and scatters (80 and 160 MiB, hidden 2560)
  # alone and beside the MLP GEMM under each NCCL setting (bench/probe_nccl.py); then the GPT-2.7B TP=2+SP step (micro
  # batch 16, global batch 32) with the setting whose pair beside the GEMM was fastest, against the default
  local P="$PYTHON -m torch.distributed.run --standalone --nproc-per-node ${NPROC:-2} bench/probe_nccl.py"
  local label=$1 tag=$2 S="--steps 7 --warmup-steps 3" setting
  shift 2
  for setting in "$@"; do
    ( [ "$setting" = default ] || export "$setting"
      export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P  # the transport each connection took, in the log
      t 60 $P --label "$setting" --hidden 2560 --sizes-mib 80 160 --out "$OUT/${label}_probe_$tag.jsonl" \
        > "$LOGS/${label}_probe_${setting//=/}.log" 2>&1
      grep -v "NCCL INFO" "$LOGS/${label}_probe_${setting//=/}.log" | tail -8
      grep "NCCL INFO" "$LOGS/${label}_probe_${setting//=/}.log" | grep -E " via |CE|memcpy|Memcpy" | sort | uniq -c \
        | sort -rn | head -4 )
  done
  local best
  best=$($PYTHON - "$OUT/${label}_probe_$tag.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
pairs = {}
for r in rows:
    if r["size_mib"] == 160:
        pairs[r["label"]] = r["all_gather_with_gemm_ms"] + r["reduce_scatter_with_gemm_ms"]
print(min(pairs, key=pairs.get))
PY
)
  echo "[bench] fastest pair beside the GEMM: $best"
  ds_patches
  local name="gpt2_7b_s2048_mbs16_gbs32_z1_tp2_sp_default_${label}_$tag"
  t 240 $B $S --name "$name" -- $GPT27_TP2SP --micro-batch-size 16
  cp "bench/results/$name.json" "$OUT"/ 2>/dev/null
  if [ "$best" != default ]; then
    name="gpt2_7b_s2048_mbs16_gbs32_z1_tp2_sp_${best,,}_$tag"
    ( export "$best"; t 200 $B $S --name "${name//=/}" -- $GPT27_TP2SP --micro-batch-size 16 )
    cp "bench/results/${name//=/}.json" "$OUT"/ 2>/dev/null
  fi
}

stage_linkprobe() {  # issue 15 on 2 GPUs, one short call: the link's own speed against NCCL's. Peer copies by the
  # copy engines one way and both ways (bench/probe_nvlink.py), the links nvidia-smi reports, and NCCL's gather and
  # scatter of GPT-2.7B's tensors in the same call, with NCCL's channel choice logged
  nvidia-smi topo -m
  nvidia-smi nvlink -s | head -40
  t 60 $PYTHON bench/probe_nvlink.py --sizes-mib 80 160 640 --out "$OUT/nvlink_probe_${RUN_TAG:-s22}.jsonl"
  local P="$PYTHON -m torch.distributed.run --standalone --nproc-per-node ${NPROC:-2} bench/probe_nccl.py"
  NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING NCCL_DEBUG_FILE="$OUT/nccl_debug_%p.txt" t 60 $P --label default \
    --hidden 2560 --sizes-mib 80 160 640 --out "$OUT/nvlink_probe_nccl_${RUN_TAG:-s22}.jsonl"
  grep -h "NCCL version\|channels\|nChannels" "$OUT"/nccl_debug_*.txt | sort | uniq -c | head -20
}

stage_regprobe() {  # issue 15 on 2 GPUs, one short call: NCCL with its buffers registered. The link moves about 1.85x
  # what NCCL's two-rank gather does (session 22, linkprobe); registered buffers let NCCL copy straight between
  # them (ncclCommRegister), symmetric windows (ncclCommWindowRegister) its symmetric kernels and, under
  # NCCL_CTA_POLICY=2, its copy-engine collectives. GPT-2.7B's gathers and scatters, alone and beside the GEMM
  local P="$PYTHON -m torch.distributed.run --standalone --nproc-per-node ${NPROC:-2} bench/probe_nccl.py"
  local A="--hidden 2560 --sizes-mib 80 160 --out $OUT/reg_probe_${RUN_TAG:-s22}.jsonl" transport
  for transport in nccl nccl-registered nccl-window; do
    t 60 $P --label "$transport" --transport $transport $A
  done
  NCCL_CTA_POLICY=2 t 60 $P --label "nccl-registered cta2" --transport nccl-registered $A
  NCCL_CTA_POLICY=2 NCCL_DEBUG=INFO NCCL_DEBUG_FILE="$OUT/nccl_debug_window_%p.txt" t 60 $P \
    --label "nccl-window cta2" --transport nccl-window $A
  grep -h -i "symmetric\|window\|CTA\|copy engine\|CE " "$OUT"/nccl_debug_window_*.txt | sort | uniq -c | head -20
}

stage_pushprobe() {  # issue 15 on 2 GPUs, one short call: what a hand-written copy-engine transport could reach for
  # GPT-2.7B's gathers and scatters (bench/probe_nccl.py --transport ce-push: peer memcpy into symmetric memory, one
  # barrier), against NCCL and torch's low-contention ops in the same call
  local P="$PYTHON -m torch.distributed.run --standalone --nproc-per-node ${NPROC:-2} bench/probe_nccl.py"
  local transport
  for transport in nccl ce-symmetric ce-push; do
    t 60 $P --label "$transport" --transport $transport --hidden 2560 --sizes-mib 80 160 \
      --out "$OUT/push_probe_${RUN_TAG:-s22}.jsonl"
  done
}

stage_refdrop() {  # issue 15, one GPU, one call: like for like with dropout. The compiled reference without and with
  # Megatron's dropout (bench/reference_dropout.py), and our default flags (dropout 0.1), in one call
  local tag=${RUN_TAG:-s22}
  ds_patches
  [ -f .whl/reference_gpt.py ] || { echo "refdrop needs .whl/reference_gpt.py"; return 1; }
  OUT="$LOGS" t 200 $PYTHON .whl/reference_gpt.py --which compile --mbs 16 --steps 10 --warmup 3
  cp "$LOGS/anchor.json" "$OUT/reference_gpt_refdrop_$tag.json" 2>/dev/null
  OUT="$LOGS" t 200 $PYTHON bench/reference_dropout.py .whl/reference_gpt.py --which compile --mbs 16 --steps 10 \
    --warmup 3
  cp "$LOGS/anchor.json" "$OUT/reference_gpt_dropout_$tag.json" 2>/dev/null
  local name="gpt1_3b_s2048_mbs16_z1_default_flags_$tag"
  t 150 $B --steps 16 --warmup-steps 5 --name "$name" -- $GPT13 --micro-batch-size 16 --zero-stage 1
  cp "bench/results/$name.json" "$OUT"/ 2>/dev/null
}

stage_regstep() {  # issue 15 on 2 GPUs, one call: GPT-2.7B TP=2+SP (global batch 32; micro batch 16 on a 141 GB card,
  # else 8) with every allocator segment registered with NCCL (TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1,
  # which torch turns off under expandable segments, so both runs go without them), against NCCL's default
  local S="--steps 7 --warmup-steps 3" tag=${RUN_TAG:-s22} mbs=8
  [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -gt 100000 ] && mbs=16
  ds_patches
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False
  t 240 $B $S --name "gpt2_7b_s2048_mbs${mbs}_gbs32_z1_tp2_sp_noexpand_$tag" -- $GPT27_TP2SP --micro-batch-size $mbs
  TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1 t 200 $B $S \
    --name "gpt2_7b_s2048_mbs${mbs}_gbs32_z1_tp2_sp_reghook_$tag" -- $GPT27_TP2SP --micro-batch-size $mbs
  unset PYTORCH_CUDA_ALLOC_CONF
}

stage_tpaccum67() {  # issue 15 on 2 GPUs, one call: GPT-6.7B TP=2+SP with gradient accumulation (micro batch 4,
  # global batch 16), so the optimizer step (45 ms at global batch 4) is paid once per 4 micro-batches; each lever
  local S="--steps 7 --warmup-steps 3"
  local M="$GPT67_TP2SP --global-batch-size 16"
  ds_patches
  t 270 $B $S --name gpt6_7b_s2048_mbs4_gbs16_z1_tp2_sp_none -- $M --tp-comm-overlap none  # cold start
  t 170 $B $S --name gpt6_7b_s2048_mbs4_gbs16_z1_tp2_sp_reorder -- $M  # the default
  t 190 $B $S --name gpt6_7b_s2048_mbs4_gbs16_z1_tp2_sp_chunked -- $M --tp-comm-overlap chunked
  t 190 $B $S --name gpt6_7b_s2048_mbs4_gbs16_z1_tp2_sp_pipeline -- $M --tp-comm-overlap pipeline
}

overlap_vs_reorder() {  # GPT-6.7B TP=2+SP, global batch 16: reorder (the default) against --tp-comm-overlap $1 in
  # one call, then that mode's GPU tests (tp2_sp_compile_$1; $2 bounds them)
  local S="--steps 7 --warmup-steps 3"
  local M="$GPT67_TP2SP --global-batch-size 16"
  ds_patches
  t 270 $B $S --name gpt6_7b_s2048_mbs4_gbs16_z1_tp2_sp_reorder -- $M  # cold start
  t 170 $B $S --name "gpt6_7b_s2048_mbs4_gbs16_z1_tp2_sp_$1" -- $M --tp-comm-overlap "$1"
  MDS_GPU_REPORT="$OUT/gpu_tests_$1.json" t "$2" $PYTHON -m pytest -m gpu tests/gpu -q -rA -p no:cacheprovider \
    -k "tp2_sp_compile_$1"
}

stage_chunked67() {  # issue 15 on 2 GPUs, one short call: chunked (each SP GEMM split by sequence chunk,
  # parallel/chunked.py) against reorder, then its GPU tests
  overlap_vs_reorder chunked "${CHUNKED_LIMIT:-150}"
}

stage_wgrad67() {  # issue 15 on 2 GPUs, one short call: wgrad (weight-gradient GEMMs moved into the backward
  # collectives' windows, parallel/collective_windows.py) against reorder, then its GPU tests
  # (TP_OVERLAP=wgrad bash bench/device.sh tpprofile profiles its step)
  overlap_vs_reorder wgrad "${WGRAD_LIMIT:-150}"
}

stage_tpgbs() {  # issue 15 on 2 GPUs, one call: GPT-6.7B TP=2+SP with the default flags (reorder) at global
  # batch 16 and 64: the boundary (optimizer step 43 ms, ZeRO-1's gradient copies ~19 ms) paid once per 4 or 16
  # micro-batches, as training runs with Megatron's global batches (GPT-3 6.7B: 1024 sequences)
  local S="--steps 6 --warmup-steps 2"
  local M="$GPT67_TP2SP"
  ds_patches
  t 270 $B $S --name gpt6_7b_s2048_mbs4_gbs16_z1_tp2_sp_reorder -- $M --global-batch-size 16  # cold start
  t 200 $B $S --name gpt6_7b_s2048_mbs4_gbs64_z1_tp2_sp_reorder -- $M --global-batch-size 64
}

stage_pp2compile() {  # issue 15 on 2 GPUs, one short call: PP=2 compiled against the one-GPU eager curve, then
  # against PP=2 eager with dropout 0.1 (NCCL point-to-point; gloo on one GPU cannot run PP). The report is written
  # after every run, so what finished comes back when the time limit cuts the call short.
  ds_patches
  MDS_GPU_REPORT="$OUT/gpu_tests_pp2compile.json" t ${PP2_LIMIT:-140} $PYTHON -m pytest -m gpu tests/gpu -q -rA \
    -p no:cacheprovider -k "pp2_compile and not nodrop"
}

stage_syncfree() {  # issue 15, one GPU, one call: patch 0005 (the gradient norm's non-finite mask without host
  # round trips) against 0001-0004 on the default-flags GPT-1.3B step, alternated; the sync-debug GPU tests; the
  # step profiled for idle gaps
  local P="$PYTHON bench/profile_train.py --steps 12 --variant compile" A="-- $GPT13 --micro-batch-size 16 --zero-stage 1"
  ds_patches
  gpu_monitor smi_syncfree.csv
  MDS_GPU_REPORT="$LOGS/gpu_tests_syncfree.json" t 240 $PYTHON -m pytest -m gpu tests/gpu -q -rA -p no:cacheprovider \
    -k "never_waits"
  for round in 1 2; do
    t 120 $P --no-profile --out "$LOGS/syncfree_0005_$round.txt" $A
    without_ds_patch 0005-norm-mask-without-host-sync.patch t 120 $P --no-profile --out "$LOGS/syncfree_0004_$round.txt" $A
  done
  t 150 $P --out "$LOGS/syncfree_profile.txt" $A
  gpu_monitor_stop
  cp "$LOGS"/syncfree_*.json "$LOGS/gpu_tests_syncfree.json" "$LOGS/smi_syncfree.csv" "$OUT"/ 2>/dev/null
}

stage_tpnext() {  # issue 15 on 2 GPUs, one call (~7 minutes): GPT-6.7B TP=2+SP, global batch 16, the default
  # (reorder, patches 0001-0007; cold start 186 s in session 14), then --tp-comm-overlap wgrad, then the default
  # without patch 0007: both new levers against the default in one call (wgrad's GPU tests: wgrad67)
  local S="--steps 7 --warmup-steps 3"
  local M="$GPT67_TP2SP --global-batch-size 16"
  ds_patches
  t 240 $B $S --name gpt6_7b_s2048_mbs4_gbs16_z1_tp2_sp_reorder_0007 -- $M  # cold start
  t 200 $B $S --name gpt6_7b_s2048_mbs4_gbs16_z1_tp2_sp_wgrad_0007 -- $M --tp-comm-overlap wgrad
  without_ds_patch 0007-zero1-one-rank-no-bucket-copies.patch \
    t 120 $B $S --name gpt6_7b_s2048_mbs4_gbs16_z1_tp2_sp_reorder_0006 -- $M
}

stage_tpdefault() {  # issue 15 on 2 GPUs, one call: the default flags (reorder, patches 0001-0007) under TP=2+SP,
  # GPT-6.7B (micro batch 4, global batch 16; a cold start needs ~230 s) and GPT-2.7B (micro batch 8, global batch 32)
  local S="--steps 7 --warmup-steps 3" tag=${RUN_TAG:-s16}
  ds_patches
  t 300 $B $S --name "gpt6_7b_s2048_mbs4_gbs16_z1_tp2_sp_default_$tag" -- $GPT67_TP2SP --global-batch-size 16
  t 220 $B $S --name "gpt2_7b_s2048_mbs8_gbs32_z1_tp2_sp_default_$tag" -- $GPT27_TP2SP --micro-batch-size 8
}
stage_startup() {  # 2 GPUs, one call: GPT-6.7B TP=2+SP start-up with the weights drawn on the GPU (the default)
  # and on the CPU (--use-cpu-initialization; ~63 s to the engine in session 16): the start-up line's "model and
  # engine built in N s" of each (in the stage's output), then the GPU tests of the two draws
  local S="--steps 3 --warmup-steps 1" M="$GPT67_TP2SP --global-batch-size 16"
  ds_patches
  t 300 $B $S --name gpt6_7b_startup_gpu_draw -- $M
  t 200 $B $S --name gpt6_7b_startup_cpu_draw -- $M --use-cpu-initialization
  t 150 $PYTHON -m pytest -m gpu tests/gpu -q -rA -p no:cacheprovider -k "drawn or cpu_initialization"
}
stage_tp27mbs() {  # issue 15 on 2 x H200, one call: GPT-2.7B TP=2+SP with the default flags at micro batch 8 and
  # 16 (global batch 32): at hidden 2560 the sequence-parallel collectives are ~17% of a micro-batch (0.425 on
  # H100, session 16); larger GEMMs run closer to their peak while the collectives' share stays (an 80 GB card
  # may not hold 16: 49 GiB at 8)
  local S="--steps 7 --warmup-steps 3" tag=${RUN_TAG:-s17}
  ds_patches
  t 240 $B $S --name "gpt2_7b_s2048_mbs8_gbs32_z1_tp2_sp_default_$tag" -- $GPT27_TP2SP --micro-batch-size 8  # cold
  t 180 $B $S --name "gpt2_7b_s2048_mbs16_gbs32_z1_tp2_sp_default_$tag" -- $GPT27_TP2SP --micro-batch-size 16
}
stage_tpsched() {  # issue 15 on 2 GPUs, one call: GPT-2.7B TP=2+SP (micro batch 8, global batch 32), the default
  # (reorder) against torch's overlap scheduler (inductor's aten_distributed_optimizations: it moves compute,
  # not only collectives, into each collective's window by estimated runtimes; needs Triton, so GPU only) with
  # our reordering off; on an H200 (141 GB) micro batch 16 with the default as well
  local S="--steps 7 --warmup-steps 3" tag=${RUN_TAG:-s18}
  local SCHED='{"aten_distributed_optimizations.enable_overlap_scheduling": true}'
  ds_patches
  $PYTHON -c "import torch._inductor.config as c; print('[bench] overlap scheduler in this torch:', c.aten_distributed_optimizations.enable_overlap_scheduling is not None)"
  t 220 $B $S --name "gpt2_7b_s2048_mbs8_gbs32_z1_tp2_sp_default_$tag" -- $GPT27_TP2SP --micro-batch-size 8  # cold
  MDS_INDUCTOR_OPTIONS="$SCHED" t 200 $B $S --name "gpt2_7b_s2048_mbs8_gbs32_z1_tp2_sp_sched_$tag" -- $GPT27_TP2SP \
    --micro-batch-size 8 --tp-comm-overlap none
  if [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -gt 100000 ]; then
    t 160 $B $S --name "gpt2_7b_s2048_mbs16_gbs32_z1_tp2_sp_default_$tag" -- $GPT27_TP2SP --micro-batch-size 16
  fi
}
stage_halves27() {  # issue 15 on 2 GPUs, one call: GPT-2.7B TP=2+SP (global batch 32) with the default (reorder)
  # against --tp-comm-overlap halves (each layer runs the micro batch's two halves interleaved, so one half's
  # collectives run beside the other's GEMMs), micro batch 8; on an H200 (141 GB) micro batch 16 as well
  local S="--steps 7 --warmup-steps 3" tag=${RUN_TAG:-s19}
  ds_patches
  t 220 $B $S --name "gpt2_7b_s2048_mbs8_gbs32_z1_tp2_sp_default_$tag" -- $GPT27_TP2SP --micro-batch-size 8  # cold
  t 200 $B $S --name "gpt2_7b_s2048_mbs8_gbs32_z1_tp2_sp_halves_$tag" -- $GPT27_TP2SP --micro-batch-size 8 \
    --tp-comm-overlap halves
  if [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -gt 100000 ]; then
    t 160 $B $S --name "gpt2_7b_s2048_mbs16_gbs32_z1_tp2_sp_halves_$tag" -- $GPT27_TP2SP --micro-batch-size 16 \
      --tp-comm-overlap halves
  fi
}
stage_halvesprofile() {  # issue 15 on 2 GPUs, one call: where GPT-2.7B TP=2+SP's step goes (micro batch 8, global
  # batch 8) with the default (reorder) and with halves, profiled on both ranks as `entrypoint train` builds it
  ds_patches
  local mode
  for mode in default halves; do
    t ${PROFILE_LIMIT:-260} $PYTHON -m torch.distributed.run --standalone --nproc-per-node 2 bench/profile_train.py \
      --steps 8 --variant compile --out "$LOGS/profile_tp2_sp_gpt2_7b_$mode.txt" -- --preset GPT2_7B --bf16 \
      --micro-batch-size 8 --zero-stage 1 --tensor-model-parallel-size 2 --sequence-parallel $(overlap_flag $mode)
    cp "$LOGS"/profile_tp2_sp_gpt2_7b_$mode.* "$OUT"/ 2>/dev/null
  done
}
stage_halvesfr() {  # issue 15 on 2 GPUs, one call: GPT-2.7B TP=2+SP (micro batch 8, global batch 32), the default
  # and halves, each with torch's collective flight recorder on (as `entrypoint` sets it) and off
  # (TORCH_FR_BUFFER_SIZE=0, the user's setting wins): halves issues twice the collectives, each recorded on the host
  local S="--steps 6 --warmup-steps 2" tag=${RUN_TAG:-s19} mode
  ds_patches
  for mode in default halves; do
    t 200 $B $S --name "gpt2_7b_s2048_mbs8_gbs32_z1_tp2_sp_${mode}_fr_$tag" -- $GPT27_TP2SP --micro-batch-size 8 \
      $(overlap_flag $mode)
    TORCH_FR_BUFFER_SIZE=0 t 160 $B $S --name "gpt2_7b_s2048_mbs8_gbs32_z1_tp2_sp_${mode}_nofr_$tag" -- $GPT27_TP2SP \
      --micro-batch-size 8 $(overlap_flag $mode)
  done
}
stage_halvestests() {  # issue 15 on 2 GPUs: halves' GPU tests alone (compiled TP=2+SP against its eager twin, dropout
  # on and off)
  ds_patches
  MDS_GPU_REPORT="$OUT/gpu_tests_halves.json" t "${HALVES_LIMIT:-400}" $PYTHON -m pytest -m gpu tests/gpu -q -rA \
    -p no:cacheprovider -k "tp2_sp_compile_halves"
}
stage_tpgraphs() {  # issue 15 on 2 GPUs, one call: GPT-2.7B TP=2+SP (micro batch 8, global batch 32) with the compiled
  # layers launched from CUDA graphs (inductor's cudagraph trees, through MDS_INDUCTOR_OPTIONS) against the default:
  # the profiles of session 19 put the default's host near the GPU's pace
  local S="--steps 6 --warmup-steps 2" tag=${RUN_TAG:-s19}
  ds_patches
  MDS_INDUCTOR_OPTIONS='{"triton.cudagraphs": true}' t 200 $B $S \
    --name "gpt2_7b_s2048_mbs8_gbs32_z1_tp2_sp_cudagraphs_$tag" -- $GPT27_TP2SP --micro-batch-size 8
  t 170 $B $S --name "gpt2_7b_s2048_mbs8_gbs32_z1_tp2_sp_default_g_$tag" -- $GPT27_TP2SP --micro-batch-size 8
}
stage_arbucket() {  # issue 15 on 2 GPUs, one call: GPT-2.7B TP=2+SP (global batch 32; micro batch 16 on a 141 GB
  # card, else 8), the default against inductor's all-reduce bucketing (through MDS_INDUCTOR_OPTIONS), which merges a
  # compiled layer's six small all-reduces of its norm and bias gradients into one; alternated A B A B
  local S="--steps 7 --warmup-steps 3" tag=${RUN_TAG:-s20} mbs=8 round
  [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -gt 100000 ] && mbs=16
  $PYTHON -c "import torch, torch._inductor.config as c; print('torch', torch.__version__, 'bucket_all_reduces_fx', getattr(c, 'bucket_all_reduces_fx', 'MISSING'))"
  ds_patches
  for round in 1 2; do
    t 220 $B $S --name "gpt2_7b_s2048_mbs${mbs}_gbs32_z1_tp2_sp_default_ar${round}_$tag" -- $GPT27_TP2SP \
      --micro-batch-size $mbs
    MDS_INDUCTOR_OPTIONS='{"bucket_all_reduces_fx": "all"}' t 200 $B $S \
      --name "gpt2_7b_s2048_mbs${mbs}_gbs32_z1_tp2_sp_arbucket${round}_$tag" -- $GPT27_TP2SP --micro-batch-size $mbs
  done
}
stage_halves67() {  # issue 15 on 2 GPUs, one call: GPT-6.7B TP=2+SP, reorder against halves (global batch 16), then
  # halves' GPU tests (compiled against its eager twin, dropout on and off)
  overlap_vs_reorder halves "${HALVES_LIMIT:-200}"
}
stage_memory18() {  # one GPU, one call: session 18's memory changes on GPUs. The out-of-memory paragraph end to end
  # (a small model at micro batch 512 through entrypoint train); GPT-1.3B at micro batch 24 with the default flags,
  # which the logits' gradient written over the logits (72.0 GiB at 16 on an H100) may let fit on an H200
  local tag=${RUN_TAG:-s19}
  ds_patches
  MDS_GPU_REPORT="$LOGS/gpu_tests_oom.json" t 200 $PYTHON -m pytest -m gpu tests/gpu -q -rA -p no:cacheprovider \
    -k too_large
  t 200 $B --steps 20 --warmup-steps 5 --name "gpt1_3b_s2048_mbs24_z1_default_flags_$tag" -- $GPT13 \
    --micro-batch-size 24 --zero-stage 1
  cp "$LOGS/gpu_tests_oom.json" "$OUT"/ 2>/dev/null
}
stage_zero1once1() {  # issue 15, one GPU, one call: patch 0007 against 0001-0006 on the default-flags GPT-1.3B step
  # (global batch = micro batch 16: every step is a boundary), alternated A B A B
  local P="$PYTHON bench/profile_train.py --steps 12 --variant compile" A="-- $GPT13 --micro-batch-size 16 --zero-stage 1"
  ds_patches
  for round in 1 2; do
    t 120 $P --no-profile --out "$LOGS/zero1once_0007_$round.txt" $A
    without_ds_patch 0007-zero1-one-rank-no-bucket-copies.patch t 120 $P --no-profile --out "$LOGS/zero1once_0006_$round.txt" $A
  done
  cp "$LOGS"/zero1once_*.json "$OUT"/ 2>/dev/null
}

stage_s23checks() {  # on 2 GPUs, one call: what session 22 changed, on GPUs. FP8 (torchao) under every layout against
  # one GPU's FP8 curve (the --fp8-recipe default is now the engine's own), one GPU under --max-restarts (a supervised
  # child, restarted after a SIGKILL), the never-waits and metrics tests; then --fp8-recipe rowwise and delayed
  # (torchao runs tensorwise and says so) for 10 steps each
  ds_patches
  MDS_GPU_REPORT="$LOGS/gpu_tests_s23.json" t 470 $PYTHON -m pytest -m gpu tests/gpu -q -rA -p no:cacheprovider \
    -k "fp8 or max_restarts or never_waits or metrics"
  local D=data/demo R="--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256"
  R="$R --max-position-embeddings 256 --micro-batch-size 4 --train-iters 10 --lr 1e-3 --bf16 --fp8-format hybrid"
  R="$R --fp8-engine torchao --no-torch-compile --eval-iters 0 --log-interval 5 --tokenizer-type GPT2BPETokenizer"
  R="$R --data-path $D/stdlib_text_document --vocab-file $D/vocab.json --merge-file $D/merges.txt --split 98,2,0"
  for recipe in rowwise delayed; do
    t 120 $PYTHON -m entrypoint train $R --fp8-recipe $recipe 2>&1 | grep -E "FP8|fp8|note|iteration +10/|error" | head -8
  done
  cp "$LOGS/gpu_tests_s23.json" "$OUT"/ 2>/dev/null
}

stage_gpurestart() {  # one GPU under --max-restarts: a supervised child, restarted on the GPU after a SIGKILL
  ds_patches
  MDS_GPU_REPORT="$LOGS/gpu_tests_restart.json" t 300 $PYTHON -m pytest -m gpu tests/gpu -q -rA -p no:cacheprovider \
    -k max_restarts
}

stage_ulysses() {  # on 2 GPUs, one call: DeepSpeed-Ulysses through mds's own all-to-all pair (session 24). The GPU
  # tests (SP=2 ZeRO-1 and 3 against the one-GPU bf16 curve, compiled against eager with and without dropout), then
  # GPT-1.3B at SP=2 (sequence 8192, micro batch 1, global batch 8), compiled (now the default) and eager
  local S="--steps 7 --warmup-steps 3" tag=${RUN_TAG:-s24}
  local U="$GPT13_S8K_SP2"
  ds_patches
  MDS_GPU_REPORT="$LOGS/gpu_tests_ulysses_$tag.json" t 420 $PYTHON -m pytest -m gpu tests/gpu -q -rA \
    -p no:cacheprovider -k ulysses
  cp "$LOGS/gpu_tests_ulysses_$tag.json" "$OUT"/ 2>/dev/null
  t 300 $B $S --name "gpt1_3b_s8192_mbs1_gbs8_z1_ulysses2_default_$tag" -- $U
  t 240 $B $S --name "gpt1_3b_s8192_mbs1_gbs8_z1_ulysses2_eager_$tag" -- $U --no-torch-compile
  cp bench/results/gpt1_3b_s8192_*_ulysses2_*_"$tag".json "$OUT"/ 2>/dev/null
}

stage_ulyssesspeed() {  # after `ulysses` found the compiled SP=2 step slower than eager (session 24): the same
  # GPT-1.3B sequence-8192 shape on one GPU (compiled and eager), and at SP=2 without dropout (compiled and eager)
  local S="--steps 7 --warmup-steps 3" tag=${RUN_TAG:-s24}
  local M="--preset GPT1_3B --bf16 --seq-length 8192 --max-position-embeddings 8192 --micro-batch-size 1"
  M="$M --global-batch-size 8 --zero-stage 1"
  local U="$M --nproc-per-node 2 --ds-sequence-parallel-size 2 --hidden-dropout 0 --attention-dropout 0"
  ds_patches
  CUDA_VISIBLE_DEVICES=0 t 240 $B $S --name "gpt1_3b_s8192_mbs1_gbs8_z1_1gpu_default_$tag" -- $M
  CUDA_VISIBLE_DEVICES=0 t 200 $B $S --name "gpt1_3b_s8192_mbs1_gbs8_z1_1gpu_eager_$tag" -- $M --no-torch-compile
  t 240 $B $S --name "gpt1_3b_s8192_mbs1_gbs8_z1_ulysses2_nodrop_$tag" -- $U
  t 200 $B $S --name "gpt1_3b_s8192_mbs1_gbs8_z1_ulysses2_nodrop_eager_$tag" -- $U --no-torch-compile
  cp bench/results/gpt1_3b_s8192_*_"$tag".json "$OUT"/ 2>/dev/null
}

stage_ulysses32k() {  # DeepSpeed-Ulysses where it is meant to run: GPT-1.3B at sequence 32768 over SP=2 (16k tokens
  # per rank; at 8192 a rank's micro batch is small enough that eager launches bound the step), compiled and eager,
  # with the default flags' dropout and without
  local S="--steps 6 --warmup-steps 2" tag=${RUN_TAG:-s24}
  local U="--preset GPT1_3B --bf16 --seq-length 32768 --max-position-embeddings 32768 --micro-batch-size 1"
  U="$U --global-batch-size 4 --zero-stage 1 --nproc-per-node 2 --ds-sequence-parallel-size 2"
  local N="--hidden-dropout 0 --attention-dropout 0"
  ds_patches
  t 200 $B $S --name "gpt1_3b_s32768_mbs1_gbs4_z1_ulysses2_default_$tag" -- $U
  t 150 $B $S --name "gpt1_3b_s32768_mbs1_gbs4_z1_ulysses2_eager_$tag" -- $U --no-torch-compile
  t 150 $B $S --name "gpt1_3b_s32768_mbs1_gbs4_z1_ulysses2_nodrop_$tag" -- $U $N
  t 150 $B $S --name "gpt1_3b_s32768_mbs1_gbs4_z1_ulysses2_nodrop_eager_$tag" -- $U $N --no-torch-compile
  cp bench/results/gpt1_3b_s32768_*_"$tag".json "$OUT"/ 2>/dev/null
}

ab_old_bench() {  # the bench harness of an archived tree (AB_OLD=DIR: `git archive COMMIT megatron_ds entrypoint.py
  # bench cuda/profiles pyproject.toml | tar -x -C DIR`), run as $B runs ours; its results are copied by keep_qkv_ab
  echo "env PYTHONPATH=/tmp/site:$PWD/${AB_OLD:-.cache/ab/old} MDS_GIT_COMMIT=${AB_OLD_COMMIT:-fd14be4}" \
    "$PYTHON ${AB_OLD:-.cache/ab/old}/bench/bench_train.py"
}

keep_qkv_ab() {  # $1: the tag. Each result as it lands: a call cut off by its limit still brings back what finished
  cp "${AB_OLD:-.cache/ab/old}"/bench/results/*.json bench/results/ 2>/dev/null
  cp bench/results/gpt1_3b_s8192_ulysses2_qkv*_"$1"*.json "$OUT"/ 2>/dev/null
}

stage_ulyssesfused() {  # q, k and v in one all-to-all (session 24) against three: GPT-1.3B SP=2 at sequence 8192,
  # eager and compiled, dropout on, alternated A B A B. The three-all-to-all code runs from an archived tree of
  # fd14be4 (ab_old_bench)
  local S="--steps 7 --warmup-steps 3" tag=${RUN_TAG:-s24} A i
  local U="$GPT13_S8K_SP2"
  A=$(ab_old_bench)
  ds_patches
  for i in 1 2; do
    t 150 $A $S --name "gpt1_3b_s8192_ulysses2_qkv3_eager_${tag}_$i" -- $U --no-torch-compile; keep_qkv_ab "$tag"
    t 150 $B $S --name "gpt1_3b_s8192_ulysses2_qkv1_eager_${tag}_$i" -- $U --no-torch-compile; keep_qkv_ab "$tag"
  done
  t 150 $A $S --name "gpt1_3b_s8192_ulysses2_qkv3_compiled_$tag" -- $U; keep_qkv_ab "$tag"
  t 150 $B $S --name "gpt1_3b_s8192_ulysses2_qkv1_compiled_$tag" -- $U; keep_qkv_ab "$tag"
}

stage_ulyssesfusedcompiled() {  # ulyssesfused's compiled pair, which session 24 ran out of time for: the default
  # flags (compiled, dropout 0.1), three all-to-alls in (archived fd14be4) against one, A B A B
  local S="--steps 7 --warmup-steps 3" tag=${RUN_TAG:-s26} A i
  A=$(ab_old_bench)
  ds_patches
  for i in 1 2; do
    t 130 $A $S --name "gpt1_3b_s8192_ulysses2_qkv3_compiled_${tag}_$i" -- $GPT13_S8K_SP2; keep_qkv_ab "$tag"
    t 130 $B $S --name "gpt1_3b_s8192_ulysses2_qkv1_compiled_${tag}_$i" -- $GPT13_S8K_SP2; keep_qkv_ab "$tag"
  done
}

stage_a2aprobe() {  # NCCL's all-to-all between two GPUs under its P2P channel settings (session 24 measured ~37 GB/s
  # for Ulysses' 16 MiB exchanges, grouped send/receive on NCCL's default P2P channels), beside its all-gather of
  # the same tensor; then GPT-1.3B SP=2 at sequence 8192 (default flags) under the setting with the fastest
  # 16 MiB all-to-all, against the default
  local P="$PYTHON -m torch.distributed.run --standalone --nproc-per-node 2 bench/probe_nccl.py"
  local tag=${RUN_TAG:-s25} S="--steps 7 --warmup-steps 3" setting best
  for setting in default NCCL_MIN_P2P_NCHANNELS=8 NCCL_MIN_P2P_NCHANNELS=32 NCCL_NCHANNELS_PER_PEER=8; do
    ( [ "$setting" = default ] || export "$setting"
      t 60 $P --label "$setting" --hidden 2048 --sizes-mib 16 64 --all-to-all --out "$OUT/a2a_probe_$tag.jsonl" \
        2>&1 | tail -3 )
  done
  best=$($PYTHON -c "import json, sys; rows = [json.loads(l) for l in open(sys.argv[1])]; \
print(min((r for r in rows if r['size_mib'] == 16), key=lambda r: r['all_to_all_ms'])['label'])" \
    "$OUT/a2a_probe_$tag.jsonl")
  echo "[bench] fastest 16 MiB all-to-all: $best"
  local U="$GPT13_S8K_SP2"
  ds_patches
  t 150 $B $S --name "gpt1_3b_s8192_ulysses2_default_a2a_default_$tag" -- $U
  [ "$best" = default ] || ( export "$best"; t 150 $B $S --name "gpt1_3b_s8192_ulysses2_default_a2a_best_$tag" -- $U )
  cp bench/results/gpt1_3b_s8192_ulysses2_default_a2a_*_"$tag".json "$OUT"/ 2>/dev/null
}

stage_ulyssesprofile() {  # where the SP=2 step goes (GPT-1.3B, sequence 8192, micro batch 1): eager and compiled,
  # dropout on (the default flags) and off; bench/profile_train.py under torchrun, each SP rank on its slice
  local tag=${RUN_TAG:-s24} v
  local U="--preset GPT1_3B --bf16 --seq-length 8192 --max-position-embeddings 8192 --micro-batch-size 1"
  U="$U --global-batch-size 1 --zero-stage 1 --ds-sequence-parallel-size 2"
  ds_patches
  for v in ${ULYSSES_VARIANTS:-base compile nodrop compile+nodrop}; do
    t 150 $PYTHON -m torch.distributed.run --nproc-per-node 2 bench/profile_train.py --steps 10 --variant $v \
      --out "$LOGS/profile_ulysses2_s8192_${v/+/_}_$tag.txt" -- $U 2>&1 | grep -E "^\[profile\]|Error|error" \
      | cut -c1-900
  done
  cp "$LOGS"/profile_ulysses2_s8192_*_"$tag".* "$OUT"/ 2>/dev/null
}

stage_gbs128mbs() {  # issue 15, one GPU (141 GB), one call: the global-batch-128 target (dropout 0) at micro batch
  # 16 (as measured since session 5) and 32 (half the accumulation steps, GEMMs twice as tall), A B A B, beside the
  # compiled reference
  local tag=${RUN_TAG:-s25} i
  local M="$GPT13 --zero-stage 1 --global-batch-size 128 --hidden-dropout 0 --attention-dropout 0"
  ds_patches
  OUT="$LOGS" t 200 $PYTHON .whl/reference_gpt.py --which compile --mbs 16 --steps 10 --warmup 3
  cp "$LOGS/anchor.json" "$OUT/reference_gpt_gbs128mbs_$tag.json" 2>/dev/null
  for i in 1 2; do
    t 150 $B --steps 7 --warmup-steps 2 --name "gpt1_3b_s2048_mbs16_gbs128_z1_nodrop_${tag}_$i" -- $M \
      --micro-batch-size 16
    t 150 $B --steps 7 --warmup-steps 2 --name "gpt1_3b_s2048_mbs32_gbs128_z1_nodrop_${tag}_$i" -- $M \
      --micro-batch-size 32
    cp bench/results/gpt1_3b_s2048_mbs*_gbs128_z1_nodrop_"$tag"_*.json "$OUT"/ 2>/dev/null
  done
}

stage_eagertp() {  # on 2 GPUs, one call: the eager TP layers (--no-torch-compile; what Transformer Engine FP8 and
  # MS-AMP run) with torch's functional collectives (every layer's before session 25; compiled layers need them)
  # against c10d's (MDS_TP_COLLECTIVES=inplace; the eager default since): session 24's profile showed ~0.9 ms of
  # host time per eager functional collective. GPT-2.7B TP=2+SP, micro batch 8, global batch 32, A B A B
  local tag=${RUN_TAG:-s25} i kind
  ds_patches
  for i in 1 2; do
    for kind in functional inplace; do
      MDS_TP_COLLECTIVES=$kind t 120 $B --steps 6 --warmup-steps 2 \
        --name "gpt2_7b_s2048_mbs8_gbs32_z1_tp2_sp_eager_${kind}_${tag}_$i" -- $GPT27_TP2SP --micro-batch-size 8 \
        --no-torch-compile
    done
    cp bench/results/gpt2_7b_s2048_mbs8_gbs32_z1_tp2_sp_eager_*_"$tag"_*.json "$OUT"/ 2>/dev/null
  done
}

stage_eagerc10d() {  # on 2 GPUs: the GPU tests of what session 25 moved to c10d's collectives (eager TP, TP+SP and
  # Ulysses layers against the one-GPU curve; compiled, still on functional collectives, against those eager runs)
  ds_patches
  MDS_GPU_REPORT="$LOGS/gpu_tests_eagerc10d_${RUN_TAG:-s25}.json" t ${EAGERC10D_LIMIT:-480} $PYTHON -m pytest -m gpu \
    tests/gpu -q -rA -p no:cacheprovider \
    -k "(tp2 or ulysses2) and not (pipeline or chunked or wgrad or halves or no_overlap or zero3 or fp8)"
  cp "$LOGS/gpu_tests_eagerc10d_${RUN_TAG:-s25}.json" "$OUT"/ 2>/dev/null
}

stage_eagerulysses() {  # on 2 GPUs, one call: eager Ulysses (GPT-1.3B SP=2, sequence 8192, --no-torch-compile) on
  # c10d's all-to-all (the eager default since session 25) against the functional one, A B A B
  local tag=${RUN_TAG:-s25} i kind
  ds_patches
  for i in 1 2; do
    for kind in functional c10d; do
      ( [ $kind = c10d ] || export MDS_TP_COLLECTIVES=functional
        t 90 $B --steps 7 --warmup-steps 3 --name "gpt1_3b_s8192_ulysses2_eager_${kind}_${tag}_$i" -- \
          $GPT13_S8K_SP2 --no-torch-compile )
      cp bench/results/gpt1_3b_s8192_ulysses2_eager_*_"$tag"_*.json "$OUT"/ 2>/dev/null
    done
  done
}

collect() {  # after every stage, so that a call cut off later still returns what finished
  $PYTHON bench/report.py
  tar czf "$OUT/results.tgz" bench/results bench/RESULTS.md "$LOGS" "$MDS_BENCH_WORK"/*/*.log 2>/dev/null
}

for stage in "$@"; do
  "stage_$stage" 2>&1 | tee "$LOGS/stage_$stage.log"
  collect
done
echo "done: $(ls "$OUT")"
