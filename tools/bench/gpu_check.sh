#!/usr/bin/env bash
# One prepared GPU check, sized for 10 minutes on one H200 (each step has its own time limit; the
# limits add up to 600 s: 120 + 150 + 120 + 50 + 60 + 100):
#   1. the CUDA tests (pytest -m gpu);
#   2. the first run: `small` for 12 steps in bf16, every block compiled, flex on sparse and full layers,
#      its loss held to an fp32 eager dense reference (relative tolerance 0.03 per step), recompiles
#      after warmup (0 expected), tokens/s, MFU, peak memory (gpu_first_run; FAIL exits 1);
#   3. flex sparse vs dense SDPA attention, forward + backward, at 16k / 32k / 128k (bench_attention);
#      the sparse layer's efficiency against the full layer (t_full x kept / t_sparse) at 16k / 64k
#      with the default settings (bench_efficiency);
#   4. MoE dispatch: grouped_mm vs the per-expert loop at 8 and 64 experts, bf16 (bench_moe);
#   5. up to 50 steps of `small` through the trainer (loader, pinned copies, grouped_mm's aligned
#      groups, the final checkpoint's per-device CUDA RNG) under torchrun, compiled; with >= 2 GPUs
#      FSDP2 + expert parallelism (ep=2) on NCCL, with one a single process (the table says so);
#      recompiles counted from TORCH_LOGS=recompiles (gpu_train_small.sh).
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
  DEV=(--device cpu); CFG=configs/tiny.yaml; DT=fp32; SEQS=(1024); EXPERTS=(8)
  NGPU=0
else
  DEV=(--device cuda); CFG=configs/small.yaml; DT=bf16; SEQS=(16384 32768 131072); EXPERTS=(8 64)
  NGPU=${NGPU:-$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')}
  "$PYTHON" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name())' \
    || exit 2
fi

step cuda_tests 120 "passed|failed|skipped|error|FAILED|ERROR" \
  "$PYTHON" -m pytest -q -rfE -m gpu tests/ -p no:cacheprovider -o addopts=--import-mode=importlib
if [ $DRY -eq 1 ]; then
  step first_run 150 "FIRST RUN|recompiles|tokens/s|Error" "$PYTHON" -m tools.bench.gpu_first_run --dry-run
else
  step first_run 150 "FIRST RUN|recompiles|tokens/s|Error" \
    "$PYTHON" -m tools.bench.gpu_first_run --config "$CFG" --device cuda --dtype bf16 --backend flex
fi
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
TRAIN_SETS=(--set train.steps=50 --set dist.compile=true)
[ "$NGPU" -ge 2 ] && TRAIN_SETS+=(--set dist.ep=2)
if [ $DRY -eq 1 ]; then
  ROWS+=("| train_small_50_steps | dry run: not run | - | NGPU=N MINUTES=1 tools/bench/gpu_train_small.sh ${TRAIN_SETS[*]} |")
else
  step train_small_50_steps 100 "tokens/s|Error|error" \
    env NGPU="$NGPU" MINUTES=1 TORCH_LOGS=recompiles tools/bench/gpu_train_small.sh "${TRAIN_SETS[@]}"
  ROWS+=("| (recompiles) | $(grep -c 'Recompiling function' "$LOG_DIR/train_small_50_steps.log") in the trainer run | | |")
  [ "$NGPU" -lt 2 ] && ROWS+=("| (note) | one GPU: FSDP2 + EP need 2 ranks, the step ran as a single process | | |")
fi
echo
echo "| step | status | time | key lines |"
echo "|---|---|---|---|"
printf '%s\n' "${ROWS[@]}"
