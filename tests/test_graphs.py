"""Fixed-shape verify steps (server/graphs.py), the form a CUDA graph replays: on the CPU they run
eagerly and must give what the ordinary verify gives (accepted and bonus tokens, features, caches)
over many steps with paths that skip rows, for full, sliding-window and mixed-attention families,
across a growth of the session's storage, and whatever the storage held past the cached positions.
tests/test_cuda.py runs the same check with the graphs captured and replayed on a GPU."""
from __future__ import annotations

import pytest
import torch

from splitspec.server import graphs
from splitspec.server.runner import TargetRunner
from splitspec.shared import kv
from splitspec.shared.features import FeatureRequest
from splitspec.shared.sampling import SamplingParams
from splitspec.shared.tree import DraftTree

from .helpers import reference_greedy
from .test_batched_verify import PROMPTS, _run, assert_same_steps
from .test_model_families import _model


def test_rows_are_padded_to_a_power_of_two_up_to_the_largest_bucket():
    assert [graphs.bucket(n) for n in (1, 2, 3, 5, 17, 64)] == [1, 2, 4, 8, 32, 64]
    assert graphs.bucket(graphs.MAX_ROWS + 1) is None
    with pytest.raises(ValueError):
        graphs.bucket(0)


def check_fixed_shape_equals_eager(model, family: str, tokenizer, steps: int = 8) -> None:
    """Eight steps of four sessions through fixed-shape forwards equal the same steps through the
    ordinary forward, and the target's greedy `generate()` (tests/test_cuda.py: on a GPU)."""
    refs = [reference_greedy(model, p, 48) for p in PROMPTS]
    eager, eager_sessions = _run(TargetRunner(model, tokenizer, family), False, refs, steps=steps)
    runner = TargetRunner(model, tokenizer, family, use_graphs=True)
    fixed, fixed_sessions = _run(runner, False, refs, steps=steps)
    assert runner.static is not None, "a fixed-shape step failed and the runner fell back to eager"
    assert runner.static.runs == steps * len(PROMPTS)
    if next(model.parameters()).device.type == "cuda":  # every step was replayed from a captured graph
        for session in fixed_sessions:
            built = graphs.session_steps(session.cache)
            assert built and all(step.graph is not None for step in built)
    assert_same_steps(family, eager, eager_sessions, fixed, fixed_sessions, refs)


@pytest.mark.parametrize("family", ["llama-mqa-tied", "qwen2-sliding-mixed", "gemma3", "mistral-sliding"])
def test_fixed_shape_steps_equal_ordinary_steps(family, stories):
    check_fixed_shape_equals_eager(_model(family), family, stories[1])


def test_fixed_shape_steps_survive_storage_growth_and_garbage_past_the_cache(stories, monkeypatch):
    """A prompt that ends just short of a storage chunk, so the steps cross into a grown storage,
    and storage that holds NaN past the cached positions (what uninitialised memory may hold): the
    fixed-shape forward reads the whole storage under its mask, so it must clear what it reads."""
    grow = kv.PreallocatedLayer._grow

    def grow_with_nan(layer, needed):
        grow(layer, needed)
        length = layer.keys.shape[-2]
        layer.storage[0][..., length:, :] = float("nan")
        layer.storage[1][..., length:, :] = float("nan")

    monkeypatch.setattr(kv.PreallocatedLayer, "_grow", grow_with_nan)
    model = _model("llama-mqa-tied")
    prompt = [1 + (7 * i) % 400 for i in range(kv.PreallocatedLayer.CHUNK - 20)]  # grows on the 3rd step
    ref = reference_greedy(model, prompt, 24)
    runner = TargetRunner(model, stories[1], "llama", use_graphs=True)
    session, _, _ = runner.open(prompt, SamplingParams(), FeatureRequest())
    capacities, tokens = set(), []
    while len(tokens) < 20:
        done = len(tokens) + 1  # the pending token is ref[len(tokens)]
        truth = ref[done: done + 4]
        # a wrong sibling before the right first token: the accepted path skips row 0
        tokens_ = [(truth[0] + 1) % 512] + truth
        parents = [-1, -1] + list(range(1, len(truth)))
        tree = DraftTree(tuple(tokens_), tuple(parents))
        out = runner.verify(session, tree)
        tokens += [*out.accepted_tokens, out.accept.bonus_token]
        capacities.add(session.cache.layers[0].capacity)
    assert len(capacities) == 2, "the steps never crossed into a grown storage"
    assert runner.static is not None and runner.static.runs > 0
    assert tokens == ref[1: 1 + len(tokens)]


def test_a_failing_fixed_shape_step_falls_back_to_eager_and_stays_exact(stories, monkeypatch, caplog):
    """The third fixed-shape step raises (as a capture a model does not allow would): that step and
    every later one run eagerly, the session's cache is untouched by the failed attempt, its steps
    are dropped, and the answer is still the target's own."""
    model = _model("qwen2-sliding-mixed")
    prompt = PROMPTS[0]
    ref = reference_greedy(model, prompt, 30)
    runner = TargetRunner(model, stories[1], "qwen2", use_graphs=True)
    session, _, _ = runner.open(prompt, SamplingParams(), FeatureRequest())
    run, calls = graphs.StaticStep.run, []

    def flaky(step, *args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("capture refused")
        return run(step, *args)

    monkeypatch.setattr(graphs.StaticStep, "run", flaky)
    tokens = []
    while len(tokens) < 24:
        truth = ref[len(tokens) + 1: len(tokens) + 5]
        out = runner.verify(session, DraftTree(tuple([(truth[0] + 1) % 512] + truth),
                                               tuple([-1, -1] + list(range(1, len(truth))))))
        tokens += [*out.accepted_tokens, out.accept.bonus_token]
        if len(calls) == 3:
            assert runner.static is None and not hasattr(session.cache, "_static_steps")
    assert len(calls) == 3 and "verifies eagerly from now on" in caplog.text
    assert tokens == ref[1: 1 + len(tokens)]


def test_rows_a_step_wrote_and_dropped_are_cleared(stories):
    """After a commit, the storage from the cached length to the end of the padded step is zero:
    later steps read it under their mask, which would not hide a NaN there."""
    model = _model("llama-mqa-tied")
    ref = reference_greedy(model, PROMPTS[0], 8)
    runner = TargetRunner(model, stories[1], "llama", use_graphs=True)
    session, _, _ = runner.open(PROMPTS[0], SamplingParams(), FeatureRequest())
    wrong = [(t + 1) % 512 for t in ref[1:6]]  # five rejected rows: 6 rows, padded to 8
    runner.verify(session, DraftTree.chain(wrong))
    length = kv.cache_length(session.cache)
    assert length == len(PROMPTS[0]) + 1
    for layer in session.cache.layers:
        for buffer in layer.storage:
            assert buffer[..., length: len(PROMPTS[0]) + 8, :].abs().sum() == 0


def test_a_target_with_dynamic_rotary_scaling_is_refused_graphs(stories):
    """Dynamic RoPE picks its frequencies on the host per call: no graph can replay that."""
    model = _model("llama-mqa-tied")
    model.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="dynamic rotary"):
        TargetRunner(model, stories[1], "llama", use_graphs=True)
    TargetRunner(model, stories[1], "llama")  # without graphs it is served as before


def test_a_step_out_of_memory_sends_only_its_session_to_eager(stories, monkeypatch):
    """Running out of memory is one session's trouble, not the model's: that session verifies
    eagerly from then on, exactly; another session keeps its fixed-shape steps."""
    model = _model("llama-mqa-tied")
    refs = [reference_greedy(model, p, 24) for p in PROMPTS[:2]]
    runner = TargetRunner(model, stories[1], "llama", use_graphs=True)
    sessions = [runner.open(p, SamplingParams(), FeatureRequest())[0] for p in PROMPTS[:2]]
    run = graphs.StaticStep.run
    victim = sessions[0].cache.layers[0]

    def out_of_memory(step, *args):
        if step._cache.session_layers[0] is victim:
            raise torch.OutOfMemoryError("no room")
        return run(step, *args)

    monkeypatch.setattr(graphs.StaticStep, "run", out_of_memory)
    streams = [[], []]
    for _ in range(4):
        for session, ref, stream in zip(sessions, refs, streams):
            out = runner.verify(session, DraftTree.chain(ref[len(stream) + 1: len(stream) + 3]))
            stream += [*out.accepted_tokens, out.accept.bonus_token]
    assert runner.static is not None and runner.static.runs == 4  # the other session's steps only
    assert getattr(sessions[0].cache, "_static_off", False) and not hasattr(sessions[0].cache, "_static_steps")
    for ref, stream in zip(refs, streams):
        assert stream == ref[1: 1 + len(stream)]


def test_serve_refuses_cuda_graphs_without_a_gpu_before_loading_anything(capsys):
    """`serve --cuda-graphs` on the CPU is a usage error (exit 2), said before any model loads."""
    from splitspec.cli.main import main

    assert main(["serve", "--target", "/nonexistent/model", "--cuda-graphs"]) == 2
    assert "--cuda-graphs needs --device cuda" in capsys.readouterr().err


def test_a_step_counts_the_memory_it_holds(stories):
    """`StaticStep.nbytes` / `graphs.held_bytes`: a step's fixed inputs [rows] x 3, its column index
    [capacity] and one mask [1, 1, rows, capacity] per attention kind (outputs once captured, on CUDA)."""
    model, tokenizer, model_id = stories
    runner = TargetRunner(model, tokenizer, model_id, use_graphs=True)
    session, _, _ = runner.open([1, 40, 50, 60], SamplingParams(), FeatureRequest())
    assert graphs.held_bytes(session.cache) == 0
    runner.verify(session, DraftTree(tokens=(5, 6, 7), parents=(-1, 0, 1)))
    (step,) = graphs.session_steps(session.cache)
    capacity = session.cache.layers[0].capacity
    element = torch.empty((), dtype=next(model.parameters()).dtype).element_size()
    assert step.rows == 4 and step.graph is None
    assert step.nbytes == 8 * (3 * step.rows + capacity) + len(runner.windows) * step.rows * capacity * element
    assert graphs.held_bytes(session.cache) == runner.step_bytes(session) == step.nbytes
    graphs.forget(session.cache)
    assert graphs.held_bytes(session.cache) == 0
