"""The lossless tests with the target on a GPU (issue 11): greedy decoding through tree verification,
one session at a time, batched (ragged and padded) and replayed from CUDA graphs, equals the target's own `generate()` on the
same device, for every model family of tests/test_model_families.py and for the real stories260K
Llama, locally and over gRPC. The drafters stay on the CPU, as a client's would.

Skipped where torch sees no CUDA device; `tools/gpu_checks.sh` runs this module on a lent GPU.
`SPLITSPEC_TEST_DEVICE=cpu` runs the same checks on the CPU (a dry run of this module)."""
from __future__ import annotations

import os

import pytest
import torch

from splitspec.client.transport import RemoteVerifier
from splitspec.server.local import LocalVerifier
from splitspec.server.runner import TargetRunner
from splitspec.shared.models import load_model

from .helpers import reference_greedy
from .test_batched_verify import check_batched_equals_alone
from .test_graphs import check_fixed_shape_equals_eager
from .test_greedy_equality import N_NEW, _check_all, _drafters
from .test_model_families import FAMILIES, _model, check_decodes_exactly

DEVICE = os.environ.get("SPLITSPEC_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("family", FAMILIES)
def test_family_decodes_exactly_on_the_device(family, stories):
    model = _model(family).to(DEVICE)
    assert next(model.parameters()).device.type == DEVICE
    check_decodes_exactly(model, family, stories[1])


@pytest.mark.parametrize("ragged", [True, False], ids=["ragged", "padded"])
@pytest.mark.parametrize("family", ["llama-mqa-tied", "qwen2-sliding-mixed", "gemma3", "mistral-sliding"])
def test_batched_steps_equal_steps_alone_on_the_device(family, ragged, stories):
    check_batched_equals_alone(_model(family).to(DEVICE), family, ragged, stories[1])


@pytest.mark.parametrize("family", ["llama-mqa-tied", "qwen2-sliding-mixed", "gemma3", "mistral-sliding"])
def test_graph_replayed_steps_equal_ordinary_steps_on_the_device(family, stories):
    """server/graphs.py: verify steps captured as CUDA graphs and replayed (eager on a CPU dry run)."""
    check_fixed_shape_equals_eager(_model(family).to(DEVICE), family, stories[1])


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("mode", ["local", "split"])
def test_stories260k_on_the_device(stories_path, serve, mode, graphs):
    model, tokenizer, model_id = load_model(str(stories_path), device=DEVICE)
    assert next(model.parameters()).device.type == DEVICE
    prompt = tokenizer("Once upon a time, there was a little dog named Max. Max liked to")["input_ids"]
    ref = reference_greedy(model, prompt, N_NEW)
    runner = TargetRunner(model, tokenizer, model_id, use_graphs=graphs)
    verifier = LocalVerifier(runner) if mode == "local" else RemoteVerifier(serve(runner).address)
    draft, _, _ = load_model(f"{stories_path}@layers=2")  # the client's drafter, on the CPU
    _check_all(verifier, _drafters(model_id, prompt, ref, 512, draft), prompt, ref,
               min_calls_right=1 + -(-(N_NEW - 1) // 5))
    if graphs:  # the fixed-shape steps ran, none failed over to the eager forward
        assert runner.static is not None and runner.static.runs > 0
