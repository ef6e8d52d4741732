#!/usr/bin/env bash
# First step of the call that carries .gpu-c on a lent GPU machine (docs/training.md, "Session 26"),
# run from the checkout's root there before ../shared/gpu/bootstrap.sh. Each call's working tree is
# a fresh copy and only /tmp survives while the machine stays warm, so the calls that carried .gpu-a
# and .gpu-b copied them to /tmp: link them back, keep a copy of .gpu-c for later calls
# (tools/gpu_checks.sh reads its question.jsonl), and install the wheels the GPU image lacks or
# holds too old (.gpu-b: transformers 5.24 and what it checks at import; .gpu-c: grpcio >= 1.85.1,
# which the generated stubs demand) into /tmp/site, ahead of the image's own on PYTHONPATH.
set -euo pipefail
ln -sfn /tmp/gpu-a .gpu-a
ln -sfn /tmp/gpu-b .gpu-b
if [ -d /tmp/gpu-d ]; then ln -sfn /tmp/gpu-d .gpu-d; fi  # D_DATA files, WITH_TLI1=1 (tools/gpu_prepare.sh)
if [ -f .gpu-c/needs-gpu-d ] && [ ! -d /tmp/gpu-d ]; then  # without it the job would redo its distillation
  echo "gpu_site: .gpu-d was prepared ($(paste -sd' ' - < .gpu-c/needs-gpu-d)) but no call carried it:" \
       "run the call carrying [\".gpu-d\"] (rm -rf /tmp/gpu-d && cp -r .gpu-d /tmp/gpu-d), then this one again" >&2
  exit 3
fi
rm -rf /tmp/gpu-c && cp -r .gpu-c /tmp/gpu-c
mkdir -p /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .gpu-b/wheels/*.whl .gpu-c/wheels/*.whl
