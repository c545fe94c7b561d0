#!/usr/bin/env bash
# Train the `small` config for ~2 minutes in bf16 with FSDP2 on every GPU of this node, then print
# tokens/s per GPU, MFU and peak memory (from the run's summary.json; the first 3 steps, which
# allocate and warm up, are left out of throughput and MFU).
#
#   tools/bench/gpu_train_small.sh [--set KEY=VALUE ...]
#
# Environment: CONFIG (configs/small.yaml), NGPU (all visible GPUs), MINUTES (2),
# RUN (runs/bench_gpu_small; removed first, so the run starts fresh instead of resuming),
# PYTHON (.venv/bin/python if present, else python).
# MFU uses the dense bf16 peak of H100/H200 (989 TFLOP/s) when the GPU name says so; for other
# GPUs pass --set train.peak_tflops=... . With one GPU the run is a single process (no FSDP:
# autocast bf16), which is what one GPU should run anyway.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}
CONFIG=${CONFIG:-configs/small.yaml}
MINUTES=${MINUTES:-2}
RUN=${RUN:-runs/bench_gpu_small}
[ -f "$CONFIG" ] || { echo "gpu_train_small.sh: $CONFIG not found" >&2; exit 2; }
NGPU=${NGPU:-$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')}
[ "$NGPU" -ge 1 ] || { echo "gpu_train_small.sh: no CUDA device" >&2; exit 2; }
# configs/small.yaml reads the built-in corpus at data/shapes, synthesised at 224 px (its header);
# a corpus already there (e.g. the 64 px one of `make data`) is used as it is: fewer visual tokens.
[ -f data/shapes/manifest.json ] || \
  "$PYTHON" -m mmtrain.cli data synth --out data/shapes --image-size 224 --video-size 224
"$PYTHON" -c 'import json; c = json.load(open("data/shapes/manifest.json"))["config"]
print("corpus data/shapes: images %s px, video %s px" % (c["image_size"], c["video_size"]))'
rm -rf "$RUN"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
"$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" -m mmtrain.train "$CONFIG" \
  --run-dir "$RUN" \
  --set train.device=cuda --set train.dtype=bfloat16 --set dist.strategy=fsdp \
  --set train.time_limit_min="$MINUTES" --set train.steps=1000000 \
  --set train.eval_every=0 --set train.eval_batches=2 --set train.ckpt_every=0 --set train.log_every=20 \
  "$@"
"$PYTHON" - "$RUN/summary.json" "$NGPU" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
mfu = "n/a (unknown GPU: --set train.peak_tflops=...)" if s["mfu"] is None else f"{s['mfu']:.1%}"
print(f"small, bf16, {'FSDP2' if s['world_size'] > 1 else 'single GPU'} on {sys.argv[2]} GPU(s), "
      f"{s['steps']} steps: {s['tokens_per_s_per_device']:,.0f} tokens/s per GPU, MFU {mfu}, "
      f"peak memory {s['peak_mem_gib']:.1f} GiB")
PY
