#!/usr/bin/env bash
# Train on one node: one process per GPU (NCCL, FSDP2), or NPROC processes on CPU (gloo).
#
#   launch/single_node.sh CONFIG [mmtrain.train args: --set KEY=VALUE ... --run-dir DIR]
#
# Environment: NPROC (default: the GPUs of this node, else 2), MAX_RESTARTS (default 3: after a
# crash, or a rank the heartbeat names as silent (every other rank exits 70, train.heartbeat),
# torchrun restarts every rank and the run resumes from its newest committed checkpoint),
# PYTHON (default: .venv/bin/python if present, else python), MMTRAIN_SKIP_PLAN=1 (no `mmtrain plan`
# preflight; launch/preflight.sh), PLAN_GPU. See docs/DISTRIBUTED.md.
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${1:?usage: launch/single_node.sh CONFIG [--set KEY=VALUE ...]}
shift
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}
if [ -z "${NPROC:-}" ]; then
  NPROC=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
  [ "$NPROC" -gt 0 ] || NPROC=2
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
source launch/preflight.sh
source launch/flight_recorder.sh  # an NCCL timeout names its collective (docs/DISTRIBUTED.md, "Faults")
preflight "$CONFIG" "$NPROC" "$@"  # memory per GPU before the launch; MMTRAIN_SKIP_PLAN=1 skips it
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
  --max-restarts "${MAX_RESTARTS:-3}" -m mmtrain.train "$CONFIG" "$@"
