#!/usr/bin/env bash
# The verify service's CUDA checks for a lent GPU machine (issue 11), for a call after the training
# job on the same warm machine (bootstrap done, /tmp/site in place), or after bootstrap in a call
# of its own. About 6 minutes; every result lands under $OUT as it is written.
# 1. SmolLM2-135M on CUDA, fp32 and bf16: verify-step time against tree size (1-25 positions),
#    against the copy-bandwidth floor, and greedy agreement of tree verification with the same
#    target's generate() on 6 Spec-Bench prompts (the lossless check on this device);
# 2. the same timings for a Llama of Llama-3-8B's shape with random weights (shape figures only);
# 3. serve-bench: 1, 4, 8, 16 concurrent clients against the server on CUDA, batching off and on.
set -u
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
mkdir -p "$OUT"
T0=$(date +%s)
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/checks.log"; }
log "verify-cost smollm2-135m"
timeout 150 splitspec verify-cost --device cuda --prompts 6 --linear torch --repeats 20 \
  > "$OUT/verify-cost-smollm2-cuda.md" 2>> "$OUT/checks.log"; log "rc=$?"
log "verify-cost random llama-8b"
timeout 150 splitspec verify-cost --device cuda --target random:llama-8b --prompts 0 --linear torch --repeats 10 \
  --context 1024 > "$OUT/verify-cost-llama8b-cuda.md" 2>> "$OUT/checks.log"; log "rc=$?"
log "serve-bench"
timeout 240 splitspec serve-bench --device cuda --clients 1,4,8,16 --max-batch 1,8 --seconds 8 \
  --out "$OUT/serve-bench-cuda.md" > "$OUT/serve-bench.log" 2>&1; log "rc=$?"
