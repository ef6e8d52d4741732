#!/usr/bin/env bash
# The verify step's CUDA timings in ONE call of a lent GPU machine, for when too little device time
# is left for the three transfers the target's wheel needs (session 41: a fresh machine with 243 s
# left measured both shapes in 92 s of wall time). Carry [".gpu-e"] (tools/gpu_prepare.sh builds it:
# the wheels only, ~32 MB, no target, no data) and run `bash tools/gpu_shapes.sh`. Times whole
# verify steps eager beside replayed from CUDA graphs, and batched sessions, for Llama shapes with
# RANDOM weights (bench/verify_cost_bench.py RANDOM_SHAPES: smollm2-135m is the served target's
# shape, llama-8b Llama-3-8B's): shape figures, say so wherever they are written. Results land under
# $OUT as they are written (install.log, vc-smollm2-shape.md, vc-llama-8b.md).
# Settings by environment: BUDGET_S (seconds for the whole script, default 165), DEVICE.
set -u
T0=$(date +%s); BUDGET_S=${BUDGET_S:-165}; DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT" /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .gpu-e/*.whl > "$OUT/install.log" 2>&1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . >> "$OUT/install.log" 2>&1
export PYTHONPATH=/tmp/site
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
echo "installed in $(( $(date +%s) - T0 )) s" >> "$OUT/install.log"
nvidia-smi --query-gpu=name,memory.total --format=csv >> "$OUT/install.log" 2>&1
# the served shape first (fast): ~45 s on an H200 with the graphs captured
timeout $(( $(left) / 2 )) python3 -u -m splitspec.cli.main verify-cost --device "$DEVICE" --target random:smollm2-135m \
  --prompts 0 --linear torch --repeats 20 --cuda-graphs --context 512 --batches 1,4,8,16 > "$OUT/vc-smollm2-shape.md" 2>&1
echo "smollm2 shape rc=$? at $(( $(date +%s) - T0 )) s" >> "$OUT/install.log"
timeout $(( $(left) - 5 )) python3 -u -m splitspec.cli.main verify-cost --device "$DEVICE" --target random:llama-8b \
  --prompts 0 --linear torch --repeats 10 --cuda-graphs --context 1024 --batches 1,4,8 > "$OUT/vc-llama-8b.md" 2>&1
echo "llama-8b shape rc=$? at $(( $(date +%s) - T0 )) s" >> "$OUT/install.log"
