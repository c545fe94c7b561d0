# Sourced by launch/single_node.sh and launch/multi_node.sh (and so launch/slurm.sbatch):
# `mmtrain plan` of the launch before torchrun starts, on the config and the --set pairs given.
# A plan whose peak does not fit the GPU stops the launch (exit 3) with its numbers.
#   MMTRAIN_SKIP_PLAN=1   skip it
#   PLAN_GPU              the GPU model for the plan (default: from CUDA's device name; no CUDA,
#                         or a model the plan does not know: skipped, with a note)
preflight() {
  local config=$1 gpus=$2
  shift 2
  [ "${MMTRAIN_SKIP_PLAN:-0}" = 1 ] && return 0
  local gpu=${PLAN_GPU:-$("$PYTHON" -c 'import torch
name = torch.cuda.get_device_name(0).lower() if torch.cuda.is_available() else ""
print(next((g for g in ("b200", "h200", "h100", "a100", "mi300x") if g in name), ""))')}
  if [ -z "$gpu" ]; then
    echo "preflight: no GPU the plan knows: not planned (set PLAN_GPU to plan anyway)" >&2
    return 0
  fi
  local sets=()
  while [ $# -gt 0 ]; do
    case $1 in
      --set) sets+=(--set "$2"); shift 2 ;;
      --set=*) sets+=("$1"); shift ;;
      *) shift ;;
    esac
  done
  "$PYTHON" -m mmtrain plan "$config" --gpus "$gpus" --gpu "$gpu" ${sets[@]+"${sets[@]}"}
}
