#!/usr/bin/env bash
# One prepared GPU check, sized for 10 minutes on one H200 (each step has its own time limit; the
# limits add up to 600 s):
#   1. the CUDA tests (pytest -m gpu);
#   2. `small` in bf16 with every block compiled: tokens/s, MFU, peak memory (bench_model);
#   3. flex sparse vs dense SDPA attention, forward + backward, at 16k / 32k / 128k (bench_attention);
#      the sparse layer's efficiency against the full layer (t_full x kept / t_sparse) at 16k / 64k
#      with the default settings (bench_efficiency);
#   4. MoE dispatch: grouped_mm vs the per-expert loop at 8 and 64 experts, bf16 (bench_moe);
#   5. 50 steps of `small` under torchrun with FSDP2 on NCCL (gpu_train_small.sh; FSDP2 needs >= 2
#      GPUs: with one GPU it is a single process, which the table says).
# Every step's full output goes to $LOG_DIR/<step>.log; a table of the key lines is printed last.
#
#   tools/bench/gpu_check.sh             # on the GPU machine
#   tools/bench/gpu_check.sh --dry-run   # anywhere: the same plumbing on CPU at tiny sizes
#
# Environment: PYTHON (.venv/bin/python if present), LOG_DIR (runs/gpu_check), NGPU (all visible).
set -uo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}
LOG_DIR=${LOG_DIR:-runs/gpu_check}
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
mkdir -p "$LOG_DIR"
ROWS=()

# step NAME LIMIT_S PATTERN CMD...: run CMD with a time limit, keep the lines matching PATTERN.
step() {
  local name=$1 limit=$2 pattern=$3
  shift 3
  local t0=$SECONDS rc
  echo "== $name: $*" >&2
  timeout "$limit" "$@" >"$LOG_DIR/$name.log" 2>&1
  rc=$?
  local key
  key=$(grep -E "$pattern" "$LOG_DIR/$name.log" | tail -n 6 | tr '\n' ';' | cut -c1-400)
  [ $rc -eq 124 ] && key="TIMED OUT after ${limit}s; $key"
  ROWS+=("| $name | rc $rc | $((SECONDS - t0)) s | ${key:-see $LOG_DIR/$name.log} |")
}

if [ $DRY -eq 1 ]; then
  DEV=(--device cpu); CFG=configs/tiny.yaml; DT=fp32; SEQS=(1024); EXPERTS=(8); COMPILE=()
  NGPU=0
else
  DEV=(--device cuda); CFG=configs/small.yaml; DT=bf16; SEQS=(16384 32768 131072); EXPERTS=(8 64)
  COMPILE=(--compile)
  NGPU=${NGPU:-$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')}
  "$PYTHON" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name())' \
    || exit 2
fi

step cuda_tests 120 "passed|failed|skipped|error|FAILED|ERROR" \
  "$PYTHON" -m pytest -q -rfE -m gpu tests/ -p no:cacheprovider -o addopts=--import-mode=importlib
step small_bf16_compiled 160 "tokens/s|Error" \
  "$PYTHON" -m tools.bench.bench_model --config "$CFG" "${DEV[@]}" --dtype "$DT" --batch 4 \
  --seq-len $([ $DRY -eq 1 ] && echo 256 || echo 4096) --steps 5 --warmup 3 "${COMPILE[@]}"
if [ $DRY -eq 1 ]; then
  step attention 120 "^\||gather|dense|Error" \
    "$PYTHON" -m tools.bench.bench_attention "${DEV[@]}" --seq "${SEQS[@]}" --repeats 1 --backends gather dense
else
  step attention 120 "^\||flex|dense|Error" \
    "$PYTHON" -m tools.bench.bench_attention "${DEV[@]}" --seq "${SEQS[@]}" --repeats 3 --backends flex dense \
    --budget-gib 120 --timeout 28
fi
step efficiency 50 "^\| default|Error" \
  "$PYTHON" -m tools.bench.bench_efficiency "${DEV[@]}" --settings default --repeats 3 \
  --seq $([ $DRY -eq 1 ] && echo 1024 || echo 16384 65536)
step moe 60 "experts|^ *[0-9]|Error" \
  "$PYTHON" -m tools.bench.bench_moe "${DEV[@]}" --dtype "$DT" --experts "${EXPERTS[@]}" --iters 5
if [ $DRY -eq 1 ]; then
  ROWS+=("| fsdp2_small_50_steps | dry run: not run | - | NGPU=N MINUTES=1 tools/bench/gpu_train_small.sh --set train.steps=50 |")
else
  step fsdp2_small_50_steps 90 "tokens/s|Error|error" \
    env NGPU="$NGPU" MINUTES=1 tools/bench/gpu_train_small.sh --set train.steps=50
  [ "$NGPU" -lt 2 ] && ROWS+=("| (note) | one GPU: FSDP2 needs 2 ranks, the step ran as a single process | | |")
fi

echo
echo "| step | status | time | key lines |"
echo "|---|---|---|---|"
printf '%s\n' "${ROWS[@]}"
