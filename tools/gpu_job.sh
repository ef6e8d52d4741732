#!/usr/bin/env bash
# splitspec's training job for a lent GPU machine (docs/training.md, "Session 24"). Runs from the
# checkout's root there, after ../shared/gpu/bootstrap.sh, with .gpu-a/.gpu-b/.gpu-c in place
# (tools/gpu_prepare.sh builds them; each call's working tree is a fresh copy, so a call that
# carries a folder copies it to /tmp and the last call links them back). In one command of < 10 min:
# 1. for DISTILL_S seconds, distil the target's answers to the DTURNS user turns of ShareGPT (default
#    middle: the 7,733 later turns of <= 768 tokens that are neither a conversation's first nor its deepest,
#    which no file answered before session 51) into data/smollm2-answers-$DTURNS-cuda.jsonl, resumed from
#    .gpu-b/.gpu-c/.gpu-d's data when an earlier GPU brought part of it home, up to prompt DLIMIT (default: all). The first-
#    turn prompts of <= 256 tokens are all answered since session 24, the deepest later turns since
#    sessions 42-43 (DTURNS=later DLIMIT=8600 extends smollm2-answers-later-cuda.jsonl, as before), the long
#    first turns since session 43. DCACHE=static (the default) generates into one preallocated cache,
#    which transformers compiles the decoding step for on a GPU; if that fails before writing a record,
#    the phase falls back to the growing cache for the time left (the header records which);
# 2. fine-tune DRAFTERS (default moa,eagle2: moa at tli 0) from INIT (default .gpu-c/init, the shipped
#    checkpoints) on every distilled file for TRAIN_MIN minutes, the lr decay and staircase on the
#    clock (--time-schedule); DRAFTERS=moa,eagle2,moa:tli=1 INIT=.gpu-c/init,moa-tli1=.gpu-d/moa-tli1
#    continues the shipped moa-tli1 as well (tools/gpu_prepare.sh with WITH_TLI1=1 builds .gpu-d);
# 3. copy what must survive under $OUT after each phase (at most 8 files of 16 MB come back: job.log,
#    the grown .gz, one checkpoint per drafter, small.tgz with the cards, histories and profile.txt, which
#    torch.profiler wrote over training steps 2-4, train.log; the call's bootstrap.log makes 7 with a pair).
# INIT=/tmp/run/train.prev continues the previous call's training on the same warm machine (its run is
# moved there, not deleted). Settings by environment: DEVICE DISTILL_S DBATCH DLIMIT DTURNS DCACHE TRAIN_MIN BATCH LR STAIRCASE MAXLEN EVALP R DRAFTERS INIT
# CALL_END. CALL_END (epoch seconds, e.g. `CALL_END=$(( $(date +%s) + 545 ))` set at the start of the call's
# command, before gpu_site.sh and bootstrap.sh) shortens TRAIN_MIN so that training, its final evaluation
# and the copies end before it: in session 41 the bootstrap's minute ran outside the job's clock and the
# call's timeout fell on the copies.
# LR and STAIRCASE default to a continuation's (sessions 31-35, docs/training.md): the shipped pair
# is past its start, so lr 1.5e-4 (between the CPU runs' 1e-4 and 2e-4 at this batch of 32; session
# 26's 3e-4 was the pair at 10M tokens) and no staircase (the SA ramp is for a drafter from scratch;
# on a continuation it trains half the steps on a mask the runtime never uses).
set -u
T0=$(date +%s)
DEVICE=${DEVICE:-cuda}; DISTILL_S=${DISTILL_S:-150}; DBATCH=${DBATCH:-384}; DLIMIT=${DLIMIT:-1000000}; TRAIN_MIN=${TRAIN_MIN:-4.3}
DTURNS=${DTURNS:-middle}; DCACHE=${DCACHE:-static}
# batch 128 fits the H200's 141 GB; on an 80 GB H100 it ran out of memory after 82 s in session 41
# (moa's step peaks at 37.6 GiB at batch 64), so the default follows the card's memory, and is halved
# when DRAFTERS names two MoA drafters (moa and moa:tli=1 at 128: ~150 GiB, more than an H200 holds)
GPU_GIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
DRAFTERS=${DRAFTERS:-moa,eagle2}; INIT=${INIT:-.gpu-c/init}
MOAS=$(echo "$DRAFTERS" | tr ',' '\n' | grep -c '^moa')
BATCH=${BATCH:-$(( $([ "${GPU_GIB:-0}" -gt 100000 ] 2>/dev/null && echo 128 || echo 64) / (MOAS > 1 ? 2 : 1) ))}; LR=${LR:-1.5e-4}; STAIRCASE=${STAIRCASE:-0.0}; MAXLEN=${MAXLEN:-1024}; EVALP=${EVALP:-2}
COMPILE=${COMPILE:-auto}  # train --compile: auto is off on a GPU; a CPU dry run sets off (its compile outlasts 0.3 min)
R=${R:-/tmp/run}; mkdir -p "$R" "$OUT"
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/job.log"; }
# what the job needs, before any minute is spent: a later call whose tree lacks a carried folder
# (or has a dangling link) would otherwise train on a subset of the data, or fail after loading
case "$DISTILL_S" in ''|*[!0-9]*) log "DISTILL_S must be whole seconds, not '$DISTILL_S'"; exit 2;; esac
for d in .gpu-b/data .gpu-c/data; do
  [ -d "$d" ] || { log "$d is missing (carry the folders as the plan says; .gpu-b through tools/gpu_site.sh)"; exit 2; }
done
# the last call's run, when it saved checkpoints, becomes $R/train.prev (INIT=$R/train.prev continues
# it on a warm machine); one that saved none is dropped (train refuses a folder holding a run)
if ls "$R"/train/*/model.safetensors > /dev/null 2>&1; then rm -rf "$R/train.prev"; mv "$R/train" "$R/train.prev"; fi
rm -rf "$R/train"
for spec in ${INIT//,/ }; do  # a folder, or name=folder for one drafter
  [ -e "${spec#*=}" ] || { log "INIT names ${spec#*=}, which is missing"; exit 2; }
done
nvidia-smi --query-gpu=name,memory.total --format=csv >> "$OUT/job.log" 2>&1
python3 -c "import torch, transformers; print('torch', torch.__version__, torch.cuda.is_available(), 'transformers', transformers.__version__)" >> "$OUT/job.log" 2>&1

GROWN=smollm2-answers-$DTURNS-cuda.jsonl
CARRIED=$(ls .gpu-b/data/$GROWN.xz .gpu-c/data/$GROWN.xz .gpu-d/data/$GROWN.xz 2>/dev/null | head -1)
if [ ! -f "$R/$GROWN" ] && [ -n "$CARRIED" ]; then  # distill-data extends a plain file
  python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)" \
    "$CARRIED" > "$R/$GROWN"
fi
records() { [ -f "$R/$GROWN" ] && echo $(( $(wc -l < "$R/$GROWN") - 1 )) || echo 0; }
if [ -s "$R/$GROWN" ] && ! head -1 "$R/$GROWN" | grep -q '"cache": "static"'; then
  DCACHE=dynamic  # a file an earlier fallback wrote: distill-data resumes only with the settings of its header
fi
distill() {  # $1 cache, $2 seconds; the header of the grown file fixes the settings (batch and device included)
  timeout "$2" splitspec distill-data --device "$DEVICE" --batch "$DBATCH" --turns "$DTURNS" --max-prompt-len 768 \
    --limit "$DLIMIT" --cache "$1" --out "$R/$GROWN" >> "$R/distill.log" 2>&1
}
if [ "$DISTILL_S" -gt 0 ]; then
  log "distill start (${DISTILL_S}s, $DTURNS turns, batch $DBATCH, $DCACHE cache, $(records) records so far)"
  D0=$(date +%s); distill "$DCACHE" "$DISTILL_S"; rc=$?
  left=$(( DISTILL_S - ($(date +%s) - D0) ))
  if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ "$DCACHE" = static ] && [ "$(records)" -le 0 ] && [ $left -gt 20 ]; then
    tail -c 1500 "$R/distill.log" >> "$OUT/job.log"  # in job.log: $OUT already holds 8 files at the end
    log "distill with the static cache failed (rc=$rc, nothing written): the growing cache for ${left}s"
    rm -f "$R/$GROWN"; distill dynamic "$left"; rc=$?
  fi
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && tail -c 1500 "$R/distill.log" >> "$OUT/job.log"  # why, in job.log
  log "distill rc=$rc records=$(records) ($(( $(date +%s) - D0 ))s)"
  [ "$(records)" -gt 0 ] && gzip -c "$R/$GROWN" > "$OUT/$GROWN.gz"
fi

if [ -n "${CALL_END:-}" ]; then  # leave ~100 s for loading, the final evaluation and the copies
  fit=$(python3 -c "print(round(max(0.5, min($TRAIN_MIN, ($CALL_END - $(date +%s) - 100) / 60)), 2))")
  if python3 -c "import sys; sys.exit(0 if $fit < $TRAIN_MIN else 1)"; then log "TRAIN_MIN $TRAIN_MIN -> $fit (CALL_END)"; TRAIN_MIN=$fit; fi
fi
DATA=$(ls .gpu-b/data/*.jsonl.xz .gpu-c/data/*.jsonl.xz .gpu-d/data/*.jsonl.xz 2>/dev/null | grep -v "/$GROWN.xz$" | paste -sd, -)
[ "$(records)" -gt 0 ] && DATA=$DATA,$R/$GROWN  # the grown file as it is now (no records: not at all)
train() {  # $1 dtype, $2 minutes, $3 run folder
  timeout $(python3 -c "print(int($2 * 60 + 150))") splitspec train --drafter "$DRAFTERS" --device "$DEVICE" \
    --dtype "$1" --init "$INIT" --data "$DATA" --max-len "$MAXLEN" --batch "$BATCH" --lr "$LR" --staircase "$STAIRCASE" \
    --compile "$COMPILE" \
    --epochs 200 --max-tokens 100000000 --max-minutes "$2" --time-schedule --eval-every 1000000 \
    --eval-prompts "$EVALP" --heldout 16 --profile-steps 3 --out "$3" > "$3.log" 2>&1
}
log "train start ($DRAFTERS from $INIT, ${TRAIN_MIN} min, batch $BATCH, lr $LR, staircase $STAIRCASE, max-len $MAXLEN; data $DATA)"
T1=$(date +%s); train bfloat16 "$TRAIN_MIN" "$R/train"; rc=$?  # train refuses a folder holding a run
log "train rc=$rc"
if [ $rc -eq 124 ] && ls "$R"/train/*/model.safetensors > /dev/null 2>&1; then
  # the clock stopped training and the checkpoints were written; what ran past the grace was the
  # final held-out evaluation (minutes on a CPU dry run, seconds on a GPU): not a failure to retry
  log "timed out after the checkpoints were saved (final evaluation cut short): kept"; rc=0
fi
saved() { ls "$R"/train/*/model.safetensors > /dev/null 2>&1; }
if [ $rc -ne 0 ]; then  # out of memory (any time): half the batch; a failure in the first 4 minutes with
  # COMPILE=on: eager; another early failure under autocast: fp32. Never once a checkpoint is saved (a
  # retry starts afresh: the saved weights would be deleted), nor with under a minute left of the call
  # (its copies must end inside it: CALL_END), and the failure's tail goes into job.log (at most 8 files
  # come back from $OUT: a ninth could push out a checkpoint)
  tr '\r' '\n' < "$R/train.log" | tail -c 3000 >> "$OUT/job.log"
  left=$(python3 -c "print(round(min($TRAIN_MIN - ($(date +%s) - $T1) / 60, (${CALL_END:-10**12} - $(date +%s) - 100) / 60), 2))")
  if saved; then
    log "train failed after checkpoints were saved: kept, not retried"
  elif python3 -c "import sys; sys.exit(0 if $left < 1 else 1)"; then
    log "train failed with $left min left of the call: not retried"
  elif [ "$COMPILE" = on ] && [ $(( $(date +%s) - T1 )) -lt 240 ] && ! grep -qi "out of memory" "$R/train.log"; then
    # --compile on CUDA had never run before session 48 (a missing triton or an inductor error, which
    # show in the first steps, would otherwise cost the call): the same run eager, on the time left;
    # a later failure is not retried, as the fp32 retry below, so the copies still end inside the call
    COMPILE=off; log "compiled training failed: retry eager (--compile off) for $left min"
    rm -rf "$R/train"; train bfloat16 "$left" "$R/train"; log "train rc=$?"
  elif grep -qi "out of memory" "$R/train.log"; then
    BATCH=$(( BATCH / 2 )); log "out of memory: retry at batch $BATCH for $left min"
    rm -rf "$R/train"; train bfloat16 "$left" "$R/train"; log "train rc=$?"
  elif [ $(( $(date +%s) - T1 )) -lt 90 ]; then
    log "retry in float32 for $left min"; rm -rf "$R/train"; train float32 "$left" "$R/train"; log "train rc=$?"
  fi
fi
# the checkpoints and their drafter.json first: in session 41 the call's timeout fell while this
# block ran, and only eagle2's weights came back (no moa-tli0, no small.tgz with the metadata)
for d in "$R"/train/*/; do  # one folder per drafter trained (moa-tli0, eagle2, moa-tli1, ...)
  [ -f "$d/model.safetensors" ] && cp "$d/model.safetensors" "$OUT/$(basename "$d").safetensors"
done
tar czf "$OUT/small.tgz" -C "$R" --exclude='*.safetensors' --exclude='*.pt' train 2>/dev/null
tr '\r' '\n' < "$R/train.log" | grep -v "^train " | tail -c 6000 > "$OUT/train.log"
tr '\r' '\n' < "$R/train.log" | grep "^train " | tail -3 >> "$OUT/train.log"
# where the step time went (--profile-steps): train/profile.txt, inside small.tgz
log "done; checkpoints: $(cd "$R/train" 2>/dev/null && ls -d */model.safetensors 2>/dev/null | cut -d/ -f1 | paste -sd' ' -)"
ls -la "$OUT" >> "$OUT/job.log"
files=$(find "$OUT" -type f | wc -l)
[ "$files" -gt 8 ] && log "WARNING: $OUT holds $files files; at most 8 come back (the bootstrap log counts too)"
true
