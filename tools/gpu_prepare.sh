#!/usr/bin/env bash
# Build the three transfer folders for a lent GPU machine (../shared/gpu/prepare.sh), plus what
# splitspec's own GPU job needs on top of that kit (docs/training.md, "Session 24"):
#   .gpu-b/wheels  transformers >= 5.24 and the versions it checks at import (the GPU image's 5.17
#                  would take `cache=` silently into **kwargs: shared/models.check_transformers)
#   .gpu-b/data    the distilled answers, xz-compressed (a third smaller than the gzip copies in data/:
#                  .gpu-b is ~60 MB of its 64 with the target's second part and the wheels; `train --data`
#                  reads .jsonl.xz as it is); those named in C_DATA (default: the CPU's later-turn answers
#                  of sessions 42-43 and its long first-turn answers of session 43) go to .gpu-c/data
#                  instead, where there is room
#   .gpu-c/init    the shipped moa-tli0 and eagle2 checkpoints (the fine-tuning start)
#   .gpu-c/wheels  the venv's grpcio: the GPU image's 1.84 refuses the generated stubs (they need
#                  >= 1.85.1), which stopped serve-bench there in session 26 (.gpu-b has no room left);
#                  and pytest (with pytest-timeout, which pyproject's timeout setting names) and their
#                  dependencies, for tests/test_cuda.py (tools/gpu_checks.sh)
#   .gpu-c/stories260K  the tiny real Llama the tests use (../shared/models/stories260K)
#   .gpu-c/job.sh  tools/gpu_job.sh
#   .gpu-c/question.jsonl  Spec-Bench's prompts, for tools/gpu_checks.sh
#   .gpu-e         the wheels of .gpu-a, .gpu-b and .gpu-c and stories260K, without SmolLM2 or data
#                  (~43 MB): one transfer for tools/gpu_quick.sh, tests/test_cuda.py and the CUDA timings
#                  on random weights of the served shape and an 8B one, when too little device time is
#                  left for the three above
#   .gpu-d/moa-tli1  only with WITH_TLI1=1: the shipped moa-tli1, for DRAFTERS=moa,eagle2,moa:tli=1
#                  (tools/gpu_job.sh). It has no room in .gpu-c (58 MB without it), so it travels in a
#                  fourth call before .gpu-c's, carry [".gpu-d"], `rm -rf /tmp/gpu-d && cp -r .gpu-d /tmp/gpu-d`.
#   .gpu-d/data    the distilled files named in D_DATA (default: the middle-turn answers a GPU brings
#                  home, session 51's tools/gpu_job.sh): .gpu-b and .gpu-c are full (62-63 MiB of 64 with
#                  the checkout in session 51), so these travel in that fourth call too, whenever one exists
# Run from the checkout with `../shared/gpu/slim.sh on` first (and `off` before any commit).
# Each folder must stay under the 64 MiB a transfer carries (printed at the end).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
[ -f .git/splitspec-slim.list ] || { echo "gpu_prepare: run ../shared/gpu/slim.sh on first (the checkpoints must not travel)" >&2; exit 1; }
bash "$root/../shared/gpu/prepare.sh"
py=.venv/bin/python
mkdir -p .gpu-b/wheels .gpu-b/data .gpu-c/init .gpu-c/wheels
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu-b/wheels \
  "transformers==$("$py" -c 'import transformers; print(transformers.__version__)')" \
  huggingface-hub==1.33.0 `# not the venv's 2.x: it needs httpx2, which the GPU image lacks` \
  "tokenizers==$("$py" -c 'import tokenizers; print(tokenizers.__version__)')" \
  "safetensors==$("$py" -c 'import safetensors; print(safetensors.__version__)')" \
  "regex==$("$py" -c 'import regex; print(regex.__version__)')" 2>&1 | grep -vi warning || true
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu-c/wheels \
  "grpcio==$("$py" -c 'import grpc; print(grpc.__version__)')" 2>&1 | grep -vi warning || true
"$py" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu-c/wheels \
  "pytest==$("$py" -c 'import pytest; print(pytest.__version__)')" \
  "pytest-timeout==$("$py" -c 'from importlib.metadata import version; print(version("pytest-timeout"))')" 2>&1 | grep -vi warning || true
cp -r "$root/../shared/models/stories260K" .gpu-c/
rm -rf .gpu-b/data .gpu-c/data && mkdir -p .gpu-b/data .gpu-c/data  # no earlier session's copy stays behind
C_DATA=${C_DATA:-smollm2-answers-later-cpu smollm2-answers-long-cpu}
D_DATA=${D_DATA:-smollm2-answers-middle-cuda}
rm -rf .gpu-d
shopt -s nullglob  # either kind of file may be absent
for f in data/smollm2-answers*.jsonl data/smollm2-answers*.jsonl.gz; do
  name=$(basename "$f" .gz)
  dest=.gpu-b/data; case " $C_DATA " in *" ${name%.jsonl} "*) dest=.gpu-c/data;; esac
  case " $D_DATA " in *" ${name%.jsonl} "*) dest=.gpu-d/data; mkdir -p "$dest";; esac
  case "$f" in *.gz) gunzip -c "$f";; *) cat "$f";; esac | xz -9 -T2 -c > "$dest/$name.xz"
done
shopt -u nullglob
cp -r client/checkpoints/smollm2-135m/moa-tli0 client/checkpoints/smollm2-135m/eagle2 .gpu-c/init/
if [ "${WITH_TLI1:-0}" = 1 ]; then mkdir -p .gpu-d && cp -r client/checkpoints/smollm2-135m/moa-tli1 .gpu-d/; fi
rm -f .gpu-c/needs-gpu-d
if [ -d .gpu-d ]; then  # tools/gpu_site.sh refuses to go on without it (the job would redo what it holds)
  echo "gpu_prepare: .gpu-d holds $(ls .gpu-d | paste -sd' ' -): carry it in a fourth call before .gpu-c's"
  (cd .gpu-d && find . -type f | sort) > .gpu-c/needs-gpu-d
fi
rm -rf .gpu-e && mkdir -p .gpu-e/wheels && cp .gpu-a/*.whl .gpu-b/wheels/*.whl .gpu-c/wheels/*.whl .gpu-e/wheels/
cp -r .gpu-c/stories260K .gpu-e/
cp tools/gpu_job.sh .gpu-c/job.sh  # a fallback: the plan runs tools/gpu_job.sh, which the tree carries fresh
cp "$root/../shared/data/spec_bench/question.jsonl" .gpu-c/  # tools/gpu_checks.sh's prompts (no ../shared there)
du -sh .gpu-a .gpu-b .gpu-c .gpu-e $([ -d .gpu-d ] && echo .gpu-d)
# a call carries the checkout's tracked files (what slim.sh leaves: ~2.6 MB) with the folder: 64 MiB in all
tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -n1 | cut -f1)
for d in .gpu-a .gpu-b .gpu-c .gpu-e $([ -d .gpu-d ] && echo .gpu-d); do
  total=$(( $(du -sb "$d" | cut -f1) + tree ))
  echo "$d + the checkout: $(( total / 1048576 )) MiB of 64"
  [ "$total" -lt $(( 64 * 1024 * 1024 )) ] || { echo "gpu_prepare: $d and the checkout are over the 64 MiB a call carries" >&2; exit 1; }
done
