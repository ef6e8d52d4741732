#!/usr/bin/env bash
# The verify service's CUDA checks for a lent GPU machine (issue 11), for a call after the training
# job on the same warm machine (bootstrap done, /tmp/site in place), or after bootstrap in a call
# of its own (the call that carried .gpu-c copied it to /tmp/gpu-c). About 5-8 minutes; every
# result lands under $OUT as it is written. Order: 0, 2's first verify-cost, 1, the rest of 2, 3.
# 0. tests/test_cuda.py: the greedy-equality and batched-verification tests with the target on CUDA
#    (pytest and stories260K carried in .gpu-c; SPLITSPEC_TEST_DEVICE=cpu for a dry run here);
# 1. serve-bench: 1, 4, 8, 16 concurrent clients against the server on CUDA, batching off and on,
#    and one step per forward replayed from CUDA graphs (1:graphs, server --cuda-graphs, session 39)
#    (it needs grpcio >= 1.85.1 in /tmp/site, tools/gpu_site.sh; first measured on an H200 in
#    session 37, with the clients as threads of one process: 8 clients 2.23x one client);
# 2. SmolLM2-135M on CUDA, fp32 and bf16: verify-step time against tree size (1-25 positions),
#    against the copy-bandwidth floor, and greedy agreement of tree verification with the same
#    target's generate() on 6 Spec-Bench prompts (the lossless check on this device), and one verify
#    step of B = CLIENTS sessions scored together (T_verify(B), docs/scaling.md), and whole verify
#    steps eager beside CUDA-graph replay (--cuda-graphs, server/graphs.py);
#    then the same with cuDNN's attention allowed (off by default on CUDA since session 26: does it pay?);
# 3. the same timings for a Llama of Llama-3-8B's shape with random weights (shape figures only).
# At most 8 files come back from $OUT: this writes 7.
# Settings by environment (a dry run on a CPU: DEVICE=cpu SPLITSPEC_TEST_DEVICE=cpu SHAPE=llama-tiny CLIENTS=1,4
# BENCH_SECONDS=2 PROMPTS=1):
# DEVICE SHAPE CLIENTS BENCH_SECONDS (serve-bench's seconds per point; not SECONDS, which bash keeps as
# its own clock) PROMPTS CLIENT_PROCS CHECKS_S (the whole run's budget in seconds, default 540: each
# step's timeout is cut to what is left, and a step with under 30 s left is skipped, so the results
# written so far come back inside the call).
set -u
DEVICE=${DEVICE:-cuda}; SHAPE=${SHAPE:-llama-8b}; CLIENTS=${CLIENTS:-1,4,8,16}; SECONDS_PER=${BENCH_SECONDS:-6}
PROMPTS=${PROMPTS:-6}; CHECKS_S=${CHECKS_S:-540}
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
export SPLITSPEC_SPEC_BENCH=${SPLITSPEC_SPEC_BENCH:-/tmp/gpu-c/question.jsonl}  # carried in .gpu-c (gpu_prepare.sh)
mkdir -p "$OUT"
T0=$(date +%s)
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/checks.log"; }
# budget N: N seconds, or what is left of CHECKS_S if less; fails (the step is skipped) under 30 s
budget() {
  local left=$(( CHECKS_S - ($(date +%s) - T0) ))
  [ "$left" -lt 30 ] && { log "skipped: ${left}s left of CHECKS_S=$CHECKS_S" >&2; return 1; }
  echo $(( left < $1 ? left : $1 ))
}
log "tests/test_cuda.py"
t=$(budget 240) && SPLITSPEC_STORIES=${SPLITSPEC_STORIES:-/tmp/gpu-c/stories260K/hf} PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout "$t" python3 -m pytest -q -p no:cacheprovider -p pytest_timeout \
  tests/test_cuda.py > "$OUT/test-cuda.log" 2>&1; log "rc=$? ($(tail -1 "$OUT/test-cuda.log"))"
# first the step timings with CUDA graphs (new in session 39): the serve-bench below repeats session 37's
# figures apart from its 1:graphs points, so a short device window keeps what it has not measured yet
log "verify-cost smollm2-135m"
t=$(budget 180) && timeout "$t" splitspec verify-cost --device "$DEVICE" --prompts "$PROMPTS" --linear torch --repeats 20 --batches "$CLIENTS" --cuda-graphs \
  > "$OUT/verify-cost-smollm2-$DEVICE.md" 2>> "$OUT/checks.log"; log "rc=$?"
log "serve-bench"
# clients in up to 8 processes: session 37's H200 run had them as threads of one process, whose
# interpreter lock may have capped 8 clients at 2.23x one client (bench/serve_bench.py)
BATCHES=1,8; [ "$DEVICE" = cuda ] && BATCHES=1,8,1:graphs  # CUDA graphs: --device cuda only
t=$(budget 260) && timeout "$t" splitspec serve-bench --device "$DEVICE" --clients "$CLIENTS" --max-batch "$BATCHES" --seconds "$SECONDS_PER" \
  --client-processes "${CLIENT_PROCS:-8}" --out "$OUT/serve-bench-$DEVICE.md" > "$OUT/serve-bench.log" 2>&1; log "rc=$?"
log "verify-cost smollm2-135m with cuDNN attention allowed (shared/models.use_cudnn_attention; the run above has it off)"
t=$(budget 120) && SPLITSPEC_CUDNN_ATTENTION=1 timeout "$t" splitspec verify-cost --device "$DEVICE" --prompts 1 --linear torch --repeats 20 \
  > "$OUT/verify-cost-smollm2-$DEVICE-cudnn.md" 2>> "$OUT/checks.log"; log "rc=$?"
log "verify-cost random $SHAPE"
t=$(budget 180) && timeout "$t" splitspec verify-cost --device "$DEVICE" --target "random:$SHAPE" --prompts 0 --linear torch --repeats 10 --cuda-graphs \
  --context 1024 --batches "$CLIENTS" > "$OUT/verify-cost-$SHAPE-$DEVICE.md" 2>> "$OUT/checks.log"; log "rc=$?"
