#!/usr/bin/env bash
# Benchmark stages for a GPU machine. Each stage reproduces the rows of one table in bench/RESULTS.md, which
# names it; `make bench` runs the headline stage (one_gpu_reference) with the repo's venv.
#   bash bench/device.sh STAGE [STAGE...]      (results land in bench/results and, tarred, in $OUT)
#   PYTHON=.venv/bin/python RUN_TAG=x bash bench/device.sh one_gpu_reference
#   MDS_GIT_COMMIT=<sha> ...   on a machine given a copy of the tree whose .git may be stale (results record it)
# Wheels for what the machine lacks (DeepSpeed built with DS_BUILD_OPS=0, torchao, pydantic, hjson, ...) are
# installed from .whl/ when present. Each run has its own time limit, so that the results of the others still
# come back. NVLink multicast stays off (NCCL_NVLS_ENABLE=0). Record names end in $RUN_TAG (default: today's date).
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
# Transformer Engine where the `te` stage unpacked it (bench/te_carry.py): on the path of every stage after it
TE_SITE=${MDS_TE_SITE:-/tmp/te/site}
export PYTHONPATH=$TE_SITE:$PYTHONPATH
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MDS_BENCH_WORK=/tmp/mds_bench
LOGS=/tmp/mds_logs
mkdir -p "$LOGS"
TAG=${RUN_TAG:-$(date -u +%Y%m%d)}

B="$PYTHON bench/bench_train.py"                # one `entrypoint train` run, recorded in bench/results
R="$PYTHON bench/reference_gpt.py"              # the plain-PyTorch yardstick (GPT-1.3B shape by default)
F="$PYTHON bench/fp8_compare.py"                # FP8 against bf16, same flags, one call
GPT13="--preset GPT1_3B --bf16"
GPT13_16="$GPT13 --micro-batch-size 16 --zero-stage 1"
# GPT-6.7B TP=2+SP on two GPUs, micro batch 4, global batch 16, ZeRO-1
GPT67_TP2SP="--preset GPT6_7B --bf16 --micro-batch-size 4 --global-batch-size 16 --zero-stage 1 --nproc-per-node 2"
GPT67_TP2SP="$GPT67_TP2SP --tensor-model-parallel-size 2 --sequence-parallel"
# GPT-2.7B TP=2+SP on two GPUs, global batch 32, ZeRO-1 (the micro batch is the stage's)
GPT27_TP2SP="--preset GPT2_7B --bf16 --global-batch-size 32 --zero-stage 1 --nproc-per-node 2"
GPT27_TP2SP="$GPT27_TP2SP --tensor-model-parallel-size 2 --sequence-parallel"
# GPT-1.3B over DeepSpeed-Ulysses SP=2 on two GPUs, micro batch 1, ZeRO-1 (sequence and global batch the stage's)
ULYSSES2="$GPT13 --micro-batch-size 1 --zero-stage 1 --nproc-per-node 2 --ds-sequence-parallel-size 2"
NODROP="--hidden-dropout 0 --attention-dropout 0"
# GPT-13B on the four GPUs of one node, global batch 64, ZeRO-1; each layout's micro batch is the largest that fits
GPT13B_NODE="--preset GPT13B --bf16 --global-batch-size 64 --zero-stage 1 --nproc-per-node 4"
node_layout() {
  case $1 in
    tp2_sp_pp2) echo "--micro-batch-size 4 --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2" ;;
    tp4_sp) echo "--micro-batch-size 8 --tensor-model-parallel-size 4 --sequence-parallel" ;;
    pp4) echo "--micro-batch-size 4 --pipeline-model-parallel-size 4" ;;
    dp4) echo "--micro-batch-size 2" ;;
    *) echo "no layout '$1'" >&2; return 1 ;;
  esac
}

# LLaMA-style (SwiGLU, RMSNorm, RoPE, no biases, untied, GQA 8): the shape torchtitan's llama3 shares with ours
LLAMA="--swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear"
LLAMA="$LLAMA --untie-embeddings-and-output-weights --num-key-value-heads 8"
peer_row() {  # a row of the peers stage: our train flags ('+compile' in the name: torchtitan's compile on)
  case $1 in
    gpt13) echo "$GPT13_16" ;;
    gpt13_mbs4|gpt13_mbs4_nodrop) echo "$GPT13 --micro-batch-size 4 --global-batch-size 16 --zero-stage 1 $([ "$1" = gpt13_mbs4_nodrop ] && echo "$NODROP")" ;;
    gpt13_nodrop) echo "$GPT13_16 $NODROP" ;;
    llama13_nodrop|llama13_nodrop+compile) echo "$GPT13_16 $NODROP $LLAMA --ffn-hidden-size 5504" ;;
    llama13_nodrop_gbs128|llama13_nodrop_gbs128+compile) echo "$GPT13_16 --global-batch-size 128 $NODROP $LLAMA --ffn-hidden-size 5504" ;;
    gpt67_tp2_sp) echo "$GPT67_TP2SP" ;;
    gpt67_tp2_sp_mbs2) echo "${GPT67_TP2SP/--micro-batch-size 4/--micro-batch-size 2}" ;;
    llama67_tp2_sp_nodrop|llama67_tp2_sp_nodrop+compile) echo "$GPT67_TP2SP $NODROP $LLAMA --ffn-hidden-size 11008" ;;
    gpt13b_dp4|gpt13b_tp4_sp|gpt13b_tp2_sp_pp2) echo "$GPT13B_NODE $(node_layout "${1#gpt13b_}")" ;;
    *) echo "no peers row '$1'" >&2; return 1 ;;
  esac
}

t() { local limit=$1; shift; echo "+ [$limit s] $*"; timeout "$limit" "$@"; echo "  -> rc $?"; }
keep() { local n; for n in "$@"; do cp bench/results/"$n"*.json "$OUT"/ 2>/dev/null; done; }  # as each lands
bundle() {  # $1: a record name, the rest: records of one claim's runs -> one file bench/results/$1.json
  local name=$1; shift
  $PYTHON -c 'import json, sys; from pathlib import Path
json.dump({"kind": "bundle", "name": sys.argv[1], "runs": {Path(p).stem: json.load(open(p)) for p in sys.argv[2:]}},
          open(f"bench/results/{sys.argv[1]}.json", "w"), indent=1)' "$name" "$@" && keep "$name"
}
te_install() {  # Transformer Engine from the parts bench/te_carry.py made, where the last part came in .te/ (the
  # earlier parts copied to /tmp/te by earlier calls); once per machine, then on every stage's path (TE_SITE)
  if ls .te/p*/manifest.json >/dev/null 2>&1; then t 400 $PYTHON bench/te_carry.py install; fi
}
ds_patches() {  # patches/deepspeed onto the DeepSpeed this call imports (what the images do at build)
  $PYTHON patches/apply deepspeed --installed deepspeed --manifest "$LOGS/patch-manifest.json"
}
gpu_tests() {  # $1: the report's name, the rest: pytest's -k expression; the report lands in bench/results
  local name=$1; shift
  MDS_GPU_REPORT="bench/results/$name.json" t "${GPU_TESTS_LIMIT:-540}" $PYTHON -m pytest -m gpu tests/gpu -q -rA \
    -p no:cacheprovider ${1:+-k "$1"}
  keep "$name"
}

stage_one_gpu_reference() {  # GPT-1.3B, one GPU: the reference without and with Megatron's dropout, then our defaults
  ds_patches
  t 240 $R --which compile --mbs 16 --name "reference_gpt1_3b_$TAG"; keep "reference_gpt1_3b_$TAG"
  t 240 $R --which compile --mbs 16 --dropout 0.1 --name "reference_gpt1_3b_dropout_$TAG"
  keep "reference_gpt1_3b_dropout_$TAG"
  t 200 $B --steps 16 --warmup-steps 5 --name "gpt1_3b_s2048_mbs16_z1_default_flags_$TAG" -- $GPT13_16
  keep "gpt1_3b_s2048_mbs16_z1_default_flags_$TAG"
}

stage_one_gpu_gbs128() {  # GPT-1.3B, one GPU, global batch 128 without dropout (micro batch 16) twice; the reference
  local i
  ds_patches
  t 240 $R --which compile --mbs 16 --name "reference_gpt1_3b_gbs128_$TAG"; keep "reference_gpt1_3b_gbs128_$TAG"
  for i in 1 2; do
    t 150 $B --steps 7 --warmup-steps 2 --name "gpt1_3b_s2048_mbs16_gbs128_z1_nodrop_${TAG}_$i" -- $GPT13_16 \
      --global-batch-size 128 $NODROP
    keep "gpt1_3b_s2048_mbs16_gbs128_z1_nodrop_${TAG}_$i"
  done
}

stage_one_gpu_hf() {  # GPT-1.3B, one GPU: the default flags against HF GPT-2 + DeepSpeed ZeRO-1 in the same call
  ds_patches
  t 420 $B --steps 20 --warmup-steps 5 --baseline --name "gpt1_3b_s2048_mbs16_z1_vs_hf_$TAG" -- $GPT13_16
  keep "gpt1_3b_s2048_mbs16_z1_vs_hf_$TAG"
}

stage_dp2() {  # GPT-1.3B: DP=2 per GPU against one GPU, DeepSpeed's overlap_comm off (default) and on, A B A B;
  # the runs go into one record, dp2_$TAG
  local S="--steps 10 --warmup-steps 3" i cfg="$LOGS/ds_overlap_comm.json" runs="$LOGS/dp2_$TAG"
  printf '{"zero_optimization": {"stage": 1, "overlap_comm": true, "reduce_bucket_size": %s}}\n' \
    "${DP_BUCKET:-50000000}" > "$cfg"
  ds_patches
  rm -rf "$runs"
  t 120 $B $S --results-dir "$runs" --name "gpt1_3b_s2048_mbs16_z1_dp1_ovl_${TAG}_1" -- $GPT13_16 --nproc-per-node 1
  for i in 1 2; do
    t 120 $B $S --results-dir "$runs" --dp-hint 2 --name "gpt1_3b_s2048_mbs16_z1_dp2_default_${TAG}_$i" -- \
      $GPT13_16 --nproc-per-node 2
    t 120 $B $S --results-dir "$runs" --dp-hint 2 --name "gpt1_3b_s2048_mbs16_z1_dp2_overlap_comm_${TAG}_$i" -- \
      $GPT13_16 --nproc-per-node 2 --deepspeed_config "$cfg"
  done
  t 120 $B $S --results-dir "$runs" --name "gpt1_3b_s2048_mbs16_z1_dp1_ovl_${TAG}_2" -- $GPT13_16 --nproc-per-node 1
  bundle "dp2_$TAG" "$runs"/*.json
}

stage_pp2() {  # GPT-1.3B: PP=2 per GPU against one GPU (global batch 128, the default 13 | 11 split), one call
  local S="--steps 12 --warmup-steps 4"
  ds_patches
  t 150 $B $S --name "gpt1_3b_s2048_mbs16_z1_dp1_$TAG" -- $GPT13_16 --nproc-per-node 1
  t 200 $B $S --name "gpt1_3b_s2048_mbs16_gbs128_z1_pp2_$TAG" -- $GPT13_16 --global-batch-size 128 \
    --nproc-per-node 2 --pipeline-model-parallel-size 2
  keep "gpt1_3b_s2048_mbs16_z1_dp1_$TAG" "gpt1_3b_s2048_mbs16_gbs128_z1_pp2_$TAG"
}

stage_tp2_sp_gpt67() {  # GPT-6.7B TP=2+SP, the default flags (reorder), then --tp-comm-overlap wgrad (cold start first)
  local S="--steps 7 --warmup-steps 3"
  ds_patches
  t 300 $B $S --name "gpt6_7b_s2048_mbs4_gbs16_z1_tp2_sp_default_$TAG" -- $GPT67_TP2SP
  t 200 $B $S --name "gpt6_7b_s2048_mbs4_gbs16_z1_tp2_sp_wgrad_$TAG" -- $GPT67_TP2SP --tp-comm-overlap wgrad
  keep "gpt6_7b_s2048_mbs4_gbs16_z1_tp2_sp_"
}

stage_tp2_sp_gpt27() {  # GPT-2.7B TP=2+SP, default flags, micro batch 16: global batch 32 and 128; the step profiled
  ds_patches
  t 220 $B --steps 7 --warmup-steps 3 --name "gpt2_7b_s2048_mbs16_gbs32_z1_tp2_sp_default_$TAG" -- $GPT27_TP2SP \
    --micro-batch-size 16
  t 200 $B --steps 6 --warmup-steps 2 --name "gpt2_7b_s2048_mbs16_gbs128_z1_tp2_sp_default_$TAG" -- $GPT27_TP2SP \
    --micro-batch-size 16 --global-batch-size 128
  keep "gpt2_7b_s2048_"
  t 300 $PYTHON -m torch.distributed.run --standalone --nproc-per-node 2 bench/profile_train.py --steps 8 \
    --variant compile --out "bench/results/profile_tp2_sp_gpt2_7b_mbs16_$TAG.txt" -- $GPT27_TP2SP --micro-batch-size 16
  keep "profile_tp2_sp_gpt2_7b_mbs16_$TAG"
}

stage_ulysses() {  # Ulysses SP=2: its GPU tests, then GPT-1.3B at sequence 8192, compiled and eager
  local S="--steps 7 --warmup-steps 3" U="$ULYSSES2 --seq-length 8192 --max-position-embeddings 8192"
  U="$U --global-batch-size 8"
  ds_patches
  gpu_tests "gpu_tests_ulysses_$TAG" ulysses
  t 200 $B $S --name "gpt1_3b_s8192_ulysses2_compiled_$TAG" -- $U
  t 200 $B $S --name "gpt1_3b_s8192_ulysses2_eager_$TAG" -- $U --no-torch-compile
  keep "gpt1_3b_s8192_"
}

stage_ulysses_32k() {  # Ulysses SP=2 where it pays: GPT-1.3B at sequence 32768: compiled, eager, no dropout
  local S="--steps 6 --warmup-steps 2" U="$ULYSSES2 --seq-length 32768 --max-position-embeddings 32768"
  U="$U --global-batch-size 4"
  ds_patches
  t 200 $B $S --name "gpt1_3b_s32768_mbs1_gbs4_z1_ulysses2_default_$TAG" -- $U
  t 150 $B $S --name "gpt1_3b_s32768_mbs1_gbs4_z1_ulysses2_eager_$TAG" -- $U --no-torch-compile
  t 150 $B $S --name "gpt1_3b_s32768_mbs1_gbs4_z1_ulysses2_nodrop_$TAG" -- $U $NODROP
  keep "gpt1_3b_s32768_"
}

stage_fp8() {  # FP8 engines against bf16 on one GPU, one call: GPT-1.3B (default flags) in bf16, on Transformer
  # Engine compiled and eager, on torchao compiled; FP8_ROWS="gpt13 gpt27 reference" adds GPT-2.7B (no dropout) and the
  # reference (torchao)
  te_install
  ds_patches
  local E="--fp8-format hybrid --fp8-engine"
  for row in ${FP8_ROWS:-gpt13}; do
    case $row in
      gpt13) t 590 $F --steps 16 --warmup-steps 6 --timeout 200 --variant "te=$E te" --variant "te_eager=$E te \
        --no-torch-compile" --variant "torchao=$E torchao" --name "gpt1_3b_s2048_mbs16_z1_fp8_engines_$TAG" -- $GPT13_16
        keep "gpt1_3b_s2048_mbs16_z1_fp8_engines_$TAG" ;;
      gpt27) t 300 $F --steps 16 --warmup-steps 6 --name "gpt2_7b_s2048_mbs8_z1_nodrop_fp8_$TAG" -- --preset GPT2_7B \
        --bf16 --micro-batch-size 8 --zero-stage 1 $NODROP; keep "gpt2_7b_s2048_mbs8_z1_nodrop_fp8_$TAG" ;;
      reference) t 300 $R --which compile,compile_fp8 --mbs 16 --name "reference_gpt1_3b_fp8_$TAG"
        keep "reference_gpt1_3b_fp8_$TAG" ;;
    esac
  done
}

stage_fp8_loss() {  # FP8 against bf16, 300 steps on the embedded corpus: GPT-350M, GPT-1.3B, LLaMA-style 1.3B; the
  # engine FP8_LOSS_ENGINE (default torchao; te: Transformer Engine), the rows FP8_LOSS_ROWS (default all three)
  local engine=${FP8_LOSS_ENGINE:-torchao} row name
  local suffix=$([ "$engine" = torchao ] || echo "_$engine")
  local L="--loss --steps 300 --warmup-steps 10 --demo-corpus"
  local C="--bf16 --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 8 --global-batch-size 8"
  C="$C --zero-stage 1 --lr 2e-4 --min-lr 2e-5 --lr-decay-style cosine --lr-warmup-iters 30"
  local LLAMA_LOSS="--swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear"
  LLAMA_LOSS="$LLAMA_LOSS --untie-embeddings-and-output-weights --num-key-value-heads 8 --ffn-hidden-size 5504"
  te_install
  ds_patches
  for row in ${FP8_LOSS_ROWS:-gpt350m gpt13 llama13}; do
    case $row in
      gpt350m) name="gpt350m_s1024_mbs16_fp8_loss300$suffix" flags="--preset GPT350M --bf16 --seq-length 1024 \
        --max-position-embeddings 1024 --micro-batch-size 16 --zero-stage 1 --lr 3e-4 --min-lr 3e-5 \
        --lr-decay-style cosine --lr-warmup-iters 30 $NODROP --log-interval 10 --seed 1234" ;;
      gpt13) name="gpt1_3b_s1024_fp8_loss300$suffix" flags="--preset GPT1_3B $C --log-interval 10 --seed 1234" ;;
      llama13) name="llama_style_1_3b_s1024_fp8_loss300_seed4321$suffix"
        flags="--preset GPT1_3B $C --log-interval 1 --seed 4321 $LLAMA_LOSS" ;;
      *) echo "no fp8_loss row '$row'"; continue ;;
    esac
    t 420 $F $L --fp8-flags="--fp8-format hybrid --fp8-engine $engine" --name "${name}_$TAG" -- $flags
    keep "${name}_$TAG"
  done
}

stage_startup() {  # start to iteration 1: GPT-6.7B TP=2+SP with a cold then a warm compile cache, GPT-1.3B FP8 on
  # one GPU with a cold one; the runs go into one record, startup_$TAG
  local S="--steps 4 --warmup-steps 2" cold="/tmp/mds_compile_cold_$TAG" fp8="/tmp/mds_compile_fp8_$TAG"
  local runs="$LOGS/startup_$TAG"
  ds_patches
  rm -rf "$cold" "$fp8" "$runs"
  TORCHINDUCTOR_CACHE_DIR=$cold t 300 $B $S --results-dir "$runs" --name gpt6_7b_tp2_sp_cold -- $GPT67_TP2SP
  TORCHINDUCTOR_CACHE_DIR=$cold t 150 $B $S --results-dir "$runs" --name gpt6_7b_tp2_sp_warm -- $GPT67_TP2SP
  CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_CACHE_DIR=$fp8 t 150 $B --steps 8 --warmup-steps 3 --results-dir "$runs" \
    --name gpt1_3b_fp8_cold -- $GPT13_16 --fp8-format hybrid
  bundle "startup_$TAG" "$runs"/*.json
}

stage_whole_node() {  # GPT-13B on 4 GPUs: each run of $WHOLE_NODE (layout:cold starts from an empty compile cache
  # of its own, layout:warm from the one its cold run left), after ALCF's GPT25B variables; one record, whole_node_$TAG
  local S="--steps 6 --warmup-steps 2" run layout state cache runs="$LOGS/whole_node_$TAG"
  ds_patches
  rm -rf "$runs"
  [ -n "${ALCF-1}" ] && t 120 $PYTHON bench/node.py fits --name alcf_gpt25b --results-dir "$runs" \
    MODEL_SIZE_KEY=GPT25B SEQ_LEN=4096 MICRO_BATCH=1 SP_TYPE=megatron ZERO_STAGE=1 -- --bf16 --nproc-per-node 4 \
    --max-position-embeddings 4096
  for run in ${WHOLE_NODE:-tp2_sp_pp2:cold tp4_sp:cold pp4:cold dp4:cold tp2_sp_pp2:warm}; do
    layout=${run%%:*}; state=${run#*:}; cache="/tmp/mds_compile_node_$layout"
    [ "$state" = cold ] && rm -rf "$cache"
    TORCHINDUCTOR_CACHE_DIR=$cache t "${NODE_RUN_LIMIT:-150}" $B $S --results-dir "$runs" \
      --name "gpt13b_gbs64_${layout}_$state" -- $GPT13B_NODE $(node_layout "$layout") ${NODE_EXTRA:-}
    bundle "whole_node_$TAG" "$runs"/*.json
  done
}

stage_node_restart() {  # SIGKILL of rank 1 at step 7 under --max-restarts 1, checkpoints every 5 steps on /dev/shm:
  # the time from the kill to step 6 logged again, and the resumed losses against two uninterrupted runs.
  # Four GPUs: GPT-13B TP=2+SP x PP=2 (global batch 16); two: GPT-6.7B TP=2+SP
  local gpus name flags
  gpus=$($PYTHON -c "import torch; print(torch.cuda.device_count())")
  if [ "$gpus" -ge 4 ]; then
    name="node_restart_gpt13b_tp2_sp_pp2_$TAG"
    flags="$GPT13B_NODE $(node_layout tp2_sp_pp2) --global-batch-size 16"
  else
    name="node_restart_gpt6_7b_tp2_sp_$TAG" flags=$GPT67_TP2SP
  fi
  ds_patches
  t "${RESTART_LIMIT:-560}" $PYTHON bench/node.py restart --name "$name" --steps 8 --kill-at 7 --save-interval 5 \
    --timeout 250 -- $flags
}

stage_async_save() {  # the training stall per checkpoint save, synchronous against --async-save: GPT-1.3B, GPT-2.7B
  # on one GPU (bf16, ZeRO-1), checkpoints (19 and 38 GB) on /dev/shm (the fastest disk: the smallest sync stall)
  ds_patches
  t 420 $PYTHON bench/async_save.py --name "async_save_gpt1_3b_gpt2_7b_$TAG" --presets GPT1_3B GPT2_7B --timeout 200 \
    --save-dir /dev/shm/mds_async_save
  keep "async_save_gpt1_3b_gpt2_7b_$TAG"
}

stage_two_nodes() {  # two node launchers on one host as a 2-node Slurm step against one launcher: GPT-1.3B TP=2
  ds_patches
  t 400 $PYTHON bench/node.py two-nodes --name "two_nodes_gpt1_3b_tp2_$TAG" -- $GPT13 --micro-batch-size 8 \
    --global-batch-size 16 --zero-stage 1 --tensor-model-parallel-size 2 --hidden-dropout 0 --attention-dropout 0
}

stage_gpu_tests() {  # pytest -m gpu on 2 GPUs: every layout against the one-GPU curve, compiled against eager, FP8
  te_install  # tests/gpu/test_gpu_te.py
  ds_patches
  GPU_TESTS_LIMIT=${GPU_TESTS_LIMIT:-590} gpu_tests "gpu_tests_$TAG" "${GPU_TESTS:-}"
}

stage_compile_faults() {  # the upstream faults mds works around: compiled c10d collectives, ZeRO-3's linear
  OUT="$LOGS" t 280 $PYTHON bench/compile_tp_probe.py
  cp "$LOGS/compile_tp_probe.json" "bench/results/compile_tp_probe_$TAG.json"
  ds_patches
  t 280 $PYTHON bench/zero3_compile_probe.py --out "bench/results/zero3_compile_probe_$TAG.json"
  keep "compile_tp_probe_$TAG" "zero3_compile_probe_$TAG"
}

stage_moe() {  # DeepSpeed-MoE on 2 GPUs: GPT-350M with 16 experts on every other layer, top-2, expert parallel 2,
  # against the dense GPT-350M of the same active parameters (FFN 6h: half the layers run two 4h experts) in one call;
  # MFU on active parameters, MoE eager and compiled; one record, moe_$TAG. Micro batch 16: at 8 one GPU's MoE step
  # waited on the host
  local S="--steps 12 --warmup-steps 4" runs="$LOGS/moe_$TAG"
  local M="--preset GPT350M --bf16 --micro-batch-size 16 --global-batch-size 64 --zero-stage 1 --nproc-per-node 2"
  ds_patches
  rm -rf "$runs"
  t 240 $B $S --results-dir "$runs" --dp-hint 2 --name gpt350m_dense_ffn6h -- $M --ffn-hidden-size 6144
  local E="--num-experts 16 --topk 2 --moe-expert-parallel-size 2 --create-moe-param-group"
  t 240 $B $S --results-dir "$runs" --dp-hint 2 --name gpt350m_moe16_top2_ep2 -- $M $E
  # compiled: the dense layers whole, the expert layers' attention (off by default with MoE until this row says)
  t 240 $B $S --results-dir "$runs" --dp-hint 2 --name gpt350m_moe16_top2_ep2_compiled -- $M $E --torch-compile
  bundle "moe_$TAG" "$runs"/*.json
}

stage_peers() {  # upstream Megatron-DeepSpeed, Megatron-LM (megatron-core) and torchtitan against mds in one call:
  # each row of $PEER_ROWS for each of $PEERS, the peer then `entrypoint train` on the same flags and data (one GPU's
  # rows by default); the peers' pinned wheels and sources come carried in .peers/ (bench/peers/peers.py fetch)
  # (a row name ending in +fp8: both sides in FP8 hybrid, Megatron-LM through Transformer Engine as ours)
  local peer row rows flags extra
  te_install  # Megatron-LM runs on Transformer Engine where it imports, as its users run it
  ds_patches  # our DeepSpeed; the peers get the unpatched wheel in their own site (peers.py setup)
  extra=--no-apex; case " ${PEERS:-megatron-deepspeed megatron-lm torchtitan} " in *" megatron-deepspeed "*) extra= ;; esac
  t "${PEERS_SETUP_LIMIT:-480}" $PYTHON bench/peers/peers.py setup $extra
  for peer in ${PEERS:-megatron-deepspeed megatron-lm torchtitan}; do
    rows=${PEER_ROWS:-gpt13 gpt13_nodrop}
    [ "$peer" = torchtitan ] && rows=${PEER_ROWS:-llama13_nodrop llama13_nodrop+compile}
    for row in $rows; do
      flags=$(peer_row "${row%+*}") || continue
      [ "$row" != "${row%+fp8}" ] && flags="$flags --fp8-format hybrid"
      t "${PEER_RUN_LIMIT:-420}" $PYTHON bench/peers/peers.py run "$peer" --steps "${PEER_STEPS:-20}" \
        --warmup-steps "${PEER_WARMUP:-5}" --timeout "${PEER_TIMEOUT:-200}" --name "peers_${peer//-/_}_${row/+/_}_$TAG" \
        $([ "$row" != "${row%+compile}" ] && echo --peer-compile) -- $flags
      keep "peers_${peer//-/_}_${row/+/_}_$TAG"
    done
  done
}

stage_cpu_tools() {  # CPU only: preprocessing MB/s (1 and 2 workers), index build, token-range scan, TP=2 -> 1 reshard (GPT-350M, 1.3B)
  t 900 $PYTHON bench/bench_preprocess.py --mb 64 --repeat 5 --name "preprocess_cpu_$TAG"
  t 600 $PYTHON bench/bench_index.py --name "index_cpu_$TAG"
  t 900 $PYTHON bench/reshard_timing.py --name "reshard_gpt350m_cpu_$TAG" --preset GPT350M --from-tp 2 --to-tp 1
  t 1800 $PYTHON bench/reshard_timing.py --name "reshard_gpt1_3b_cpu_$TAG" --preset GPT1_3B --from-tp 2 --to-tp 1
  keep "preprocess_cpu_$TAG" "index_cpu_$TAG" "reshard_gpt350m_cpu_$TAG" "reshard_gpt1_3b_cpu_$TAG"
}

collect() {  # after every stage, so that a call cut off later still returns what finished
  $PYTHON bench/report.py
  tar czf "$OUT/results.tgz" bench/results bench/RESULTS.md "$LOGS" "$MDS_BENCH_WORK"/*/*.log 2>/dev/null
}

for stage in "$@"; do  # every name checked before anything runs
  if ! declare -F "stage_$stage" >/dev/null; then
    echo "no stage '$stage'; the stages: $(declare -F | sed -n 's/.* stage_//p' | xargs)"; exit 2
  fi
done
for stage in "$@"; do
  "stage_$stage" 2>&1 | tee "$LOGS/stage_$stage.log"
  collect
done
echo "done: $(ls "$OUT")"
