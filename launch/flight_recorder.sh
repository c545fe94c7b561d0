# Sourced by launch/single_node.sh and launch/multi_node.sh: torch's flight recorder, so that an NCCL
# collective that times out is named. Each rank keeps a ring of its last collectives (op, group,
# sizes, dtypes, state: scheduled / started / completed); on a watchdog timeout every rank dumps
# it, and `python -m torch.distributed.flight_recorder.fr_trace FR_DUMP_DIR` names the collective
# that hung and the ranks that never joined it. Gloo runs (CPU) are named by mmtrain itself
# (mmtrain/parallel/calls.py: the collective, its group and its call site, on every rank). On
# either backend a rank whose process went silent (stopped, its node frozen) is named sooner, in
# about max(3 x median step, 10 s), by mmtrain's heartbeat (train.heartbeat), which needs no NCCL.
# A value already in the environment wins.
#   FR_DUMP_DIR   where the per-rank dumps go (default /tmp; on several nodes, each node's own)
export TORCH_FR_BUFFER_SIZE=${TORCH_FR_BUFFER_SIZE:-2000}
export TORCH_NCCL_TRACE_BUFFER_SIZE=${TORCH_NCCL_TRACE_BUFFER_SIZE:-$TORCH_FR_BUFFER_SIZE}  # older name
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
export TORCH_FR_DUMP_TEMP_FILE=${TORCH_FR_DUMP_TEMP_FILE:-${FR_DUMP_DIR:-/tmp}/mmtrain_fr_rank_}
export TORCH_NCCL_DEBUG_INFO_TEMP_FILE=${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-$TORCH_FR_DUMP_TEMP_FILE}  # older name
