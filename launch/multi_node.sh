#!/usr/bin/env bash
# Train on several nodes: run this same command on every node (rendezvous from the environment).
#
#   NNODES=4 MASTER_ADDR=node001 launch/multi_node.sh CONFIG [--set KEY=VALUE ...]
#
# The mesh (docs/DISTRIBUTED.md): HSDP with one replica per node and expert parallelism inside it
#   NNODES=4 DP_REPLICATE=4 MASTER_ADDR=node001 launch/multi_node.sh configs/base.yaml  # EP(8): base.yaml
# and context parallelism: rows of 1M tokens split over 32 GPUs (4 nodes each):
#   NNODES=8 DP_REPLICATE=2 CP=32 MASTER_ADDR=node001 launch/multi_node.sh configs/long.yaml \
#     --set data.seq_len=1048576
#
# Environment:
#   NNODES          number of nodes (required)
#   MASTER_ADDR     a host every node can reach, which runs the c10d rendezvous (required)
#   MASTER_PORT     its port (default 29500)
#   RDZV_ID         a job id shared by all nodes (default: SLURM_JOB_ID, else "mmtrain")
#   NPROC_PER_NODE  processes per node (default: the GPUs of this node)
#   MAX_RESTARTS    whole-job restarts after a failure (default 3; each resumes from the newest
#                   checkpoint, so the run directory must be on a filesystem all nodes share); a
#                   rank silent past train.heartbeat's bound (a hung node) is a failure: the
#                   others exit 70 naming it
#   PYTHON          default .venv/bin/python if present, else python
#   MMTRAIN_SKIP_PLAN=1, PLAN_GPU
#                   the `mmtrain plan` preflight (launch/preflight.sh): skip it; the GPU model
#   DP_REPLICATE, DP_SHARD, CP, EP
#                   when set: --set dist.dp_replicate / dp_shard / cp / ep (before the arguments
#                   after CONFIG, so an explicit --set there still wins); unset: the config's
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${1:?usage: NNODES=N MASTER_ADDR=HOST launch/multi_node.sh CONFIG [--set KEY=VALUE ...]}
shift
: "${NNODES:?set NNODES}" "${MASTER_ADDR:?set MASTER_ADDR}"
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}
NPROC_PER_NODE=${NPROC_PER_NODE:-$("$PYTHON" -c 'import torch; print(max(1, torch.cuda.device_count()))')}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
MESH=()
for kv in dp_replicate="${DP_REPLICATE:-}" dp_shard="${DP_SHARD:-}" cp="${CP:-}" ep="${EP:-}"; do
  [ -n "${kv#*=}" ] && MESH+=(--set "dist.$kv")
done
source launch/preflight.sh  # memory per GPU before the launch; MMTRAIN_SKIP_PLAN=1 skips it
source launch/flight_recorder.sh  # an NCCL timeout names its collective (docs/DISTRIBUTED.md, "Faults")
preflight "$CONFIG" "$((NNODES * NPROC_PER_NODE))" ${MESH[@]+"${MESH[@]}"} "$@"
exec "$PYTHON" -m torch.distributed.run \
  --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" \
  --rdzv-id "${RDZV_ID:-${SLURM_JOB_ID:-mmtrain}}" \
  --max-restarts "${MAX_RESTARTS:-3}" \
  -m mmtrain.train "$CONFIG" ${MESH[@]+"${MESH[@]}"} "$@"
