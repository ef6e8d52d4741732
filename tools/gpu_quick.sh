#!/usr/bin/env bash
# splitspec's CUDA checks in ONE call of a lent GPU machine, for when too little device time is left
# for the three transfers the target's wheel needs (session 41: a fresh machine with 243 s left timed
# both shapes below in 92 s of wall time). Carry [".gpu-e"] (tools/gpu_prepare.sh builds it: the
# wheels, pytest and the tiny stories260K Llama, ~43 MB; no SmolLM2, no data) and run
# `bash tools/gpu_quick.sh`. In order, each result under $OUT as it is written:
# 1. tests/test_cuda.py (test-cuda.log): greedy equality on the GPU for six tiny families and
#    stories260K, one session, batched (ragged and padded) and replayed from CUDA graphs;
# 2. verify-cost on RANDOM weights (bench/verify_cost_bench.py RANDOM_SHAPES; shape figures, say so
#    wherever they are written): the served target's shape (smollm2-135m, vc-smollm2-shape.md), then
#    Llama-3-8B's (vc-llama-8b.md): the forward against tree size, batched sessions, and whole runner
#    steps eager beside replayed from CUDA graphs (with the replay's forward / host-work split, the first
#    step's capture time and the steps after which replay pays it back).
# Settings by environment: BUDGET_S (seconds for the whole script, default 270), DEVICE, SHAPE (the large
# shape, default llama-8b; a CPU dry run: DEVICE=cpu SHAPE=llama-tiny OUT=/tmp/quick bash tools/gpu_quick.sh).
set -u
T0=$(date +%s); BUDGET_S=${BUDGET_S:-270}; DEVICE=${DEVICE:-cuda}; SHAPE=${SHAPE:-llama-8b}
mkdir -p "$OUT" /tmp/site
log() { echo "[$(( $(date +%s) - T0 ))s] $*" >> "$OUT/quick.log"; }
# seconds left of BUDGET_S, at least 1: `timeout 0` would mean no limit at all
left() { local n=$(( BUDGET_S - ($(date +%s) - T0) )); echo $(( n > 1 ? n : 1 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .gpu-e/wheels/*.whl >> "$OUT/quick.log" 2>&1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . >> "$OUT/quick.log" 2>&1
export PYTHONPATH=/tmp/site
log "installed"
nvidia-smi --query-gpu=name,memory.total --format=csv >> "$OUT/quick.log" 2>&1
SPLITSPEC_TEST_DEVICE=$DEVICE SPLITSPEC_STORIES=.gpu-e/stories260K/hf PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 \
  timeout $(( $(left) / 3 + 1 )) python3 -m pytest -q -p no:cacheprovider -p pytest_timeout tests/test_cuda.py > "$OUT/test-cuda.log" 2>&1
log "tests/test_cuda.py rc=$? ($(tail -1 "$OUT/test-cuda.log"))"
timeout $(( $(left) / 3 + 1 )) python3 -u -m splitspec.cli.main verify-cost --device "$DEVICE" --target random:smollm2-135m \
  --prompts 0 --linear torch --repeats 20 --cuda-graphs --context 512 --batches 1,4,8,16 > "$OUT/vc-smollm2-shape.md" 2>&1
log "smollm2 shape rc=$?"
timeout $(( $(left) > 6 ? $(left) - 5 : 1 )) python3 -u -m splitspec.cli.main verify-cost --device "$DEVICE" --target "random:$SHAPE" \
  --prompts 0 --linear torch --repeats 10 --cuda-graphs --context 1024 --batches 1,4,8 > "$OUT/vc-$SHAPE.md" 2>&1
log "$SHAPE shape rc=$?"
