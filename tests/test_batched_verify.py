"""Batched verification (issue 11): the Verify steps of several sessions scored in one target
forward give what verifying each alone gives — accepted tokens, bonus tokens and features — over
many steps, with prefixes and trees of different sizes, accepted paths that skip rows, forced
tokens, hidden-state and K/V features, and sliding-window / mixed-attention families."""
from __future__ import annotations

import copy
import random
import threading
import time

import pytest
import torch

from splitspec.server.runner import TargetRunner
from splitspec.shared.features import FeatureRequest
from splitspec.shared.models import load_model
from splitspec.shared.sampling import SamplingParams
from splitspec.shared.tree import DraftTree

from .helpers import reference_greedy
from .test_model_families import _model

PROMPTS = [[1, 45, 100, 17, 99, 4, 250, 33, 71, 12], [1, 7, 300], [1, 88, 23, 5, 61, 402, 9], [1, 11, 200, 37, 5]]
FEATURES = FeatureRequest(hidden_layers=(-1, 1), kv_layers=(0, 2))


def _tree(truth: list[int], rng: random.Random, vocab: int) -> DraftTree:
    """A tree whose right path (when `truth` is right) sits behind 0-2 wrong siblings per depth."""
    tokens, parents, parent = [], [], -1
    for token in truth:
        for _ in range(rng.randint(0, 2)):
            tokens.append((token + rng.randint(1, vocab - 1)) % vocab)
            parents.append(parent)
        tokens.append(token)
        parents.append(parent)
        parent = len(tokens) - 1
    return DraftTree(tuple(tokens), tuple(parents))


def _run(runner: TargetRunner, batched: bool, refs, steps: int = 6, seed: int = 0, sampling=None):
    """Open a session per prompt and verify `steps` steps; returns every step's outputs.
    `sampling`: each session's SamplingParams (default greedy)."""
    rng = random.Random(seed)
    sampling = sampling or [SamplingParams()] * len(PROMPTS)
    sessions = [runner.open(p, s, FEATURES)[0] for p, s in zip(PROMPTS, sampling)]
    lengths = [len(p) for p in PROMPTS]
    outputs = []
    for step in range(steps):
        items = []
        for i, session in enumerate(sessions):
            done = lengths[i] - len(PROMPTS[i]) + 1  # tokens known so far: committed + pending
            depth = rng.randint(0, 4)
            truth = refs[i][done: done + depth]
            if rng.random() < 0.3:  # a wrong guess at the first depth
                truth = [(truth[0] + 1) % 512] + truth[1:] if truth else truth
            forced = ()
            items.append((session, _tree(truth, rng, 512), None, forced))
        outs = runner.verify_batch(items) if batched else [runner.verify(*item) for item in items]
        for i, out in enumerate(outs):
            lengths[i] += len(out.accepted_tokens) + 1
        outputs.append(outs)
    return outputs, sessions


@pytest.mark.parametrize("ragged", [True, False], ids=["ragged", "padded"])
@pytest.mark.parametrize("family", ["llama-mqa-tied", "qwen2-sliding-mixed", "gemma3", "mistral-sliding"])
def test_batched_steps_equal_steps_alone(family, ragged, stories):
    """Both ways of batching (server/ragged.py, and the padded copy for models it cannot serve)."""
    check_batched_equals_alone(_model(family), family, ragged, stories[1])


def check_batched_equals_alone(model, family: str, ragged: bool, tokenizer) -> None:
    """Six steps of four sessions verified in batches equal the same steps verified one by one
    (accepted and bonus tokens, features, caches) and the target's greedy `generate()`, on the
    model's device (tests/test_cuda.py runs it on a GPU)."""
    refs = [reference_greedy(model, p, 40) for p in PROMPTS]  # before any runner switched the attention
    alone, alone_sessions = _run(TargetRunner(model, tokenizer, family), False, refs)
    runner = TargetRunner(model, tokenizer, family)
    assert runner.ragged  # every family here runs SDPA attention
    runner.ragged = ragged
    batched, batched_sessions = _run(runner, True, refs)
    assert_same_steps(family, alone, alone_sessions, batched, batched_sessions, refs)


@pytest.mark.parametrize("ragged", [True, False], ids=["ragged", "padded"])
def test_sampled_sessions_batched_draw_as_each_alone(ragged, stories):
    """Sessions with their own temperature, top-p and seed (one greedy among them) verified in one
    forward draw what each draws alone: acceptance and bonus tokens come from each session's own
    row, warping and random stream, never a neighbour's. (The trees carry no draft rows: one-hot
    proposals, lossless for any tree.)"""
    family = "llama-mqa-tied"
    model = _model(family)
    refs = [reference_greedy(model, p, 40) for p in PROMPTS]  # the trees' guesses: right often enough
    sampling = [SamplingParams(temperature=0.8, top_p=0.9, seed=1), SamplingParams(),
                SamplingParams(temperature=1.3, seed=2), SamplingParams(temperature=0.5, top_k=20, seed=3)]
    alone, _ = _run(TargetRunner(model, stories[1], family), False, refs, sampling=sampling)
    runner = TargetRunner(model, stories[1], family)
    runner.ragged = ragged
    batched, _ = _run(runner, True, refs, sampling=sampling)
    streams = [[t for out in outs for t in (*out.accepted_tokens, out.accept.bonus_token)] for outs in zip(*alone)]
    assert streams == [[t for out in outs for t in (*out.accepted_tokens, out.accept.bonus_token)]
                       for outs in zip(*batched)]
    assert streams[1] == refs[1][1: 1 + len(streams[1])]  # the greedy one is the target's own
    assert any(s != r[1: 1 + len(s)] for s, r in zip(streams, refs))  # and the sampled ones did sample


def assert_same_steps(family: str, a_steps, a_sessions, b_steps, b_sessions, refs) -> None:
    """Two runs of `_run` agree step by step (accepted and bonus tokens, features), end with the
    same caches, and each session's greedy stream is the target's own (`refs`)."""
    for step, (a_outs, b_outs) in enumerate(zip(a_steps, b_steps)):
        for i, (a, b) in enumerate(zip(a_outs, b_outs)):
            where = f"{family} step {step} session {i}"
            assert a.accepted_tokens == b.accepted_tokens and a.accept == b.accept, where
            assert (a.features.start, a.features.count) == (b.features.start, b.features.count), where
            for layer in FEATURES.hidden_layers:
                torch.testing.assert_close(a.features.hidden[layer], b.features.hidden[layer], atol=1e-4, rtol=1e-4)
            for layer in FEATURES.kv_layers:
                torch.testing.assert_close(a.features.keys[layer], b.features.keys[layer], atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(a.features.values[layer], b.features.values[layer], atol=1e-4, rtol=1e-4)
    for a, b in zip(a_sessions, b_sessions):  # the caches the next steps build on agree too
        assert a.pending_token == b.pending_token
        for la, lb in zip(a.cache.layers, b.cache.layers):
            torch.testing.assert_close(la.keys, lb.keys, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(la.values, lb.values, atol=1e-4, rtol=1e-4)
    for i, session_outs in enumerate(zip(*b_steps)):  # the greedy stream each session produced is the target's own
        tokens = [t for out in session_outs for t in (*out.accepted_tokens, out.accept.bonus_token)]
        assert tokens == refs[i][1: 1 + len(tokens)], f"{family} session {i}"


def test_a_failed_ragged_forward_leaves_every_cache_as_it_was(stories, monkeypatch):
    """A forward that dies in a middle layer (after earlier layers appended each session's rows)
    raises and crops every cache back; the same sessions then verify as if nothing had happened."""
    model = _model("llama-mqa-tied")
    runner = TargetRunner(model, stories[1], "llama-mqa-tied")
    ref = [reference_greedy(model, p, 8) for p in PROMPTS]
    sessions = [runner.open(p, SamplingParams(), FEATURES)[0] for p in PROMPTS]
    before = [[(layer.keys.clone(), layer.values.clone()) for layer in s.cache.layers] for s in sessions]

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(model.model.layers[1].mlp, "forward", boom)
    items = [(s, DraftTree.chain(r[1:4]), None, ()) for s, r in zip(sessions, ref)]
    with pytest.raises(RuntimeError, match="boom"):
        runner.verify_batch(items)
    for session, layers in zip(sessions, before):
        for layer, (keys, values) in zip(session.cache.layers, layers):
            assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
    monkeypatch.undo()
    outs = runner.verify_batch(items)
    assert [out.accepted_tokens for out in outs] == [tuple(r[1:4]) for r in ref]


def test_models_without_sdpa_attention_are_batched_padded(stories):
    """ragged.enable leaves a model on another attention (here eager) as it is; it still batches."""
    model = _model("qwen2")
    model.set_attn_implementation("eager")
    runner = TargetRunner(model, stories[1], "qwen2")
    assert not runner.ragged and model.config._attn_implementation == "eager"
    ref = reference_greedy(model, PROMPTS[0], 6)
    a, b = (runner.open(p, SamplingParams(), FEATURES)[0] for p in PROMPTS[:2])
    outs = runner.verify_batch([(a, DraftTree.chain(ref[1:4]), None, ()), (b, DraftTree.empty(), None, ())])
    assert outs[0].accepted_tokens == tuple(ref[1:4])


def test_forced_tokens_and_a_single_item(stories):
    model = _model("qwen2")
    runner = TargetRunner(model, stories[1], "qwen2")
    ref = reference_greedy(model, PROMPTS[0], 20)
    a = runner.open(PROMPTS[0], SamplingParams(), FEATURES)[0]
    b = copy.deepcopy(a)
    c = runner.open(PROMPTS[1], SamplingParams(), FEATURES)[0]
    forced = tuple(ref[:3])  # the client's own tokens replace the pending one
    alone = runner.verify(a, DraftTree.chain(ref[3:6]), None, forced)
    together = runner.verify_batch([(b, DraftTree.chain(ref[3:6]), None, forced), (c, DraftTree.empty(), None, ())])
    assert together[0].accepted_tokens == alone.accepted_tokens == tuple(ref[3:6])
    assert together[0].accept.bonus_token == alone.accept.bonus_token == ref[6]
    assert len(runner.verify_batch([(b, DraftTree.empty(), None, ())])) == 1


@pytest.mark.parametrize("ragged,copy_bound", [(True, None), (True, 1), (False, None), (False, 1)])
def test_the_service_batches_concurrent_sessions_and_stays_exact(stories, serve, monkeypatch, ragged, copy_bound):
    """Five clients decode at once through the gRPC service while the first step is held: the
    steps queued meanwhile are scored in one forward, and every client's output is the target's.
    With the bound on a padded batch's KV copy below any two sessions, every padded forward scores
    one; a ragged forward copies no prefix and is not bounded by it."""
    from splitspec.client.loop import SpeculativeDecoder
    from splitspec.client.transport import RemoteVerifier
    from splitspec.shared.config import ServerLimits

    from .helpers import OracleDrafter
    from .test_hardening import RunnerSpy

    from splitspec.server import service

    if copy_bound is not None:
        monkeypatch.setattr(service, "MAX_BATCH_PADDED_TOKENS", copy_bound)
    model, tokenizer, model_id = stories
    runner = TargetRunner(model, tokenizer, model_id)
    runner.ragged = ragged
    spy = RunnerSpy(runner)
    spy.gate = threading.Event()
    server = serve(runner, ServerLimits(max_batch=8))
    prompts = [tokenizer(t)["input_ids"] for t in ("Once upon a time", "The dog", "Lily and Ben", "One day, a",
                                                    "Tom had a big")]
    refs = [reference_greedy(model, p, 30) for p in prompts]
    outputs: dict[int, list[int]] = {}

    def client(i: int) -> None:
        drafter = OracleDrafter(prompts[i], refs[i], 512, right=i % 2 == 0, depth=3, wrong_siblings=1)
        verifier = RemoteVerifier(server.address)
        try:
            outputs[i] = SpeculativeDecoder(verifier, drafter).generate(prompts[i], 30, stop_on_eos=False).tokens
        finally:
            verifier.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(server.servicer._waiting) < len(prompts) - 1:  # one step held in the model, the rest waiting
        assert time.monotonic() < deadline, "the clients' steps never queued up"
        time.sleep(0.01)
    spy.gate.set()
    for t in threads:
        t.join(120)
    assert outputs == {i: refs[i] for i in range(len(prompts))}
    if ragged or copy_bound is None:
        assert max(_forwards(server)) >= len(prompts) - 1, _forwards(server)
    else:
        assert set(_forwards(server)) == {1}, _forwards(server)


def test_serve_bench_drives_concurrent_clients(stories, serve, stories_path, tmp_path):
    """The serve-bench's client driver: n clients with their own sessions share the service for a
    fixed time; the table reports each point against one client and against unbatched serving."""
    from types import SimpleNamespace

    from splitspec.bench.cli import parse_batch
    from splitspec.bench.serve_bench import ServeResult, render, run_client_processes, run_clients
    from splitspec.shared.config import ServerLimits
    from splitspec.shared.drafters.spec import DrafterSpec
    from splitspec.shared.models import tokenizer_fingerprint

    model, tokenizer, model_id = stories
    server = serve(TargetRunner(model, tokenizer, model_id), ServerLimits(max_batch=4))
    prompts = [tokenizer(t)["input_ids"] for t in ("Once upon a time", "The dog")]
    tokens, elapsed, rates, steps = run_clients(server.address, 3, prompts, DrafterSpec.parse("ngram"),
                                                tokenizer_fingerprint(tokenizer), str(stories_path), 1.0, 12)
    assert tokens > 0 and elapsed >= 1.0 and len(rates) == 3 and all(r > 0 for r in rates) and steps
    with pytest.raises(RuntimeError, match="could not be set up"):  # a drafter that does not load stops them all
        run_clients(server.address, 2, prompts, DrafterSpec.parse("moa:/no/such/checkpoint"),
                    tokenizer_fingerprint(tokenizer), str(stories_path), 1.0, 12)
    with pytest.raises(RuntimeError, match=r"could not be set up \(target: "):  # nor does a target that does not
        run_clients(server.address, 2, prompts, DrafterSpec.parse("moa"), tokenizer_fingerprint(tokenizer),
                    str(tmp_path / "no-such-target"), 1.0, 12)
    # --client-processes: the same 3 clients over 2 spawned processes (2 + 1), reported as one point
    tokens, elapsed, rates, steps = run_client_processes(server.address, 3, 2, prompts, "ngram",
                                                         tokenizer_fingerprint(tokenizer), str(stories_path), 1.0, 12)
    assert tokens > 0 and elapsed >= 1.0 and len(rates) == 3 and all(r > 0 for r in rates) and steps
    with pytest.raises(RuntimeError, match="a client process failed: .*"):  # a child's error reaches the parent
        run_client_processes(server.address, 2, 2, prompts, "no-such-drafter", tokenizer_fingerprint(tokenizer),
                             str(stories_path), 1.0, 12)
    table = render([ServeResult(1, "ragged", 1, 100, 1.0, 100.0, 5.0, 9.0),
                    ServeResult(8, "ragged", 1, 110, 1.0, 110.0, 5.0, 9.0),
                    ServeResult(8, "padded", 1, 105, 1.0, 105.0, 5.0, 9.0),
                    ServeResult(1, "ragged", 8, 200, 1.0, 25.0, 20.0, 40.0),
                    ServeResult(8, "ragged", 8, 480, 1.0, 60.0, 9.0, 20.0),
                    ServeResult(8, "padded", 8, 210, 1.0, 26.0, 30.0, 60.0)],
                   SimpleNamespace(target="t", drafter="ngram", seconds=1.0, max_new_tokens=12, threads=1,
                                   device="cpu"))
    assert "| 8 | 8 | 480.0 | 4.36x | 2.40x |" in table and "measured 4.36x (max batch 8) -> met" in table
    assert "| 8 (padded) | 8 | 210.0 | 2.00x | 1.05x |" in table
    assert "measured 2.00x (max batch 8 (padded)) -> missed" in table
    assert "server on cpu" in table and "clients in one process (threads)" in table
    alone = render([ServeResult(8, "ragged", 4, 280, 1.0, 70.0, 9.0, 20.0)],  # no 1-client, no unbatched point
                   SimpleNamespace(target="t", drafter="ngram", seconds=1.0, max_new_tokens=12, threads=1,
                                   device="cpu"))
    assert "| 8 | 4 | 280.0 | - | - | 70.0 |" in alone and "nan" not in alone
    assert [parse_batch(t) for t in ("1", "8", "8:padded", " 4:ragged", "1:graphs")] == [
        (1, "ragged"), (8, "ragged"), (8, "padded"), (4, "ragged"), (1, "graphs")]
    graphed = render([ServeResult(1, "ragged", 1, 100, 1.0, 100.0, 5.0, 9.0),
                      ServeResult(1, "graphs", 1, 150, 1.0, 150.0, 3.0, 6.0)],
                     SimpleNamespace(target="t", drafter="ngram", seconds=1.0, max_new_tokens=12, threads=1,
                                     device="cuda", dtype="bfloat16"))
    assert "| 1 (graphs) | 1 | 150.0 |" in graphed  # a row of its own, not the unbatched baseline
    assert graphed.splitlines()[-1].endswith("| - |")  # no steps-per-forward figure for it
    batched = render([ServeResult(8, "ragged", 8, 400, 1.0, 50.0, 9.0, 20.0, 6.25)],
                     SimpleNamespace(target="t", drafter="ngram", seconds=1.0, max_new_tokens=12, threads=1,
                                     device="cpu"))
    assert "| 8 | 8 | 400.0 | - | - | 50.0 | 9.0 | 20.0 | 6.25 |" in batched
    windowed = render([ServeResult(8, "ragged", 1, 100, 1.0, 100.0, 5.0, 9.0, 1.0, 0.0),
                       ServeResult(8, "ragged", 8, 450, 1.0, 56.0, 9.0, 20.0, 7.5, 0.0),
                       ServeResult(8, "ragged", 1, 100, 1.0, 100.0, 5.0, 9.0, 1.0, 5.0),
                       ServeResult(8, "ragged", 8, 500, 1.0, 62.0, 9.0, 20.0, 7.9, 5.0)],
                      SimpleNamespace(target="t", drafter="ngram", seconds=1.0, max_new_tokens=12, threads=1,
                                      device="cpu"))
    assert "| 8, window 0 ms | 8 | 450.0 | 4.50x |" in windowed and "| 8, window 5 ms | 8 | 500.0 | 5.00x |" in windowed
    assert "measured 5.00x (max batch 8, window 5 ms) -> met" in windowed
    assert ServeResult(1, "ragged", 1, 1, 1.0, 1.0, 1.0, 1.0, None, 5.0).label == "1"  # no window without batching
    assert "server on cuda (bfloat16)" in graphed
    for bad in ("0", "x", "8:wide", "-1"):
        with pytest.raises(ValueError, match="--max-batch"):
            parse_batch(bad)


@pytest.mark.parametrize("flags, message", [
    (["--clients", "1,0"], "client counts must be >= 1"),
    (["--clients", "four"], "expected comma-separated client counts"),
    (["--max-batch", "1,8:wide"], "--max-batch entries are N or N:ragged"),
    (["--seconds", "0"], "must be a finite number > 0"),
    (["--client-processes", "0"], "must be >= 1"),
    (["--batch-window-ms", "5,-1"], "windows must be finite and >= 0 ms"),
])
def test_serve_bench_refuses_bad_flags_before_loading_anything(flags, message, capsys):
    """A mistyped serve-bench flag is an argparse error naming the flag, not a traceback after the
    tokenizer and prompts have loaded."""
    from splitspec.cli.main import build_parser
    from splitspec.shared.config import ServerLimits

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve-bench", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    args = build_parser().parse_args(["serve-bench", "--clients", "2,8", "--max-batch", "1,8:padded"])
    assert args.clients == [2, 8] and args.max_batch == [(1, "ragged"), (8, "padded")]
    assert args.dtype == "float32"  # the service's own default
    assert args.batch_window_ms == [ServerLimits().batch_window_ms]
    assert build_parser().parse_args(["serve-bench", "--batch-window-ms", "0,5"]).batch_window_ms == [0.0, 5.0]
    assert build_parser().parse_args(["serve-bench", "--dtype", "bfloat16"]).dtype == "bfloat16"


def test_tree_attention_on_a_cpu_skips_repeating_grouped_keys(monkeypatch):
    """With grouped keys (GQA) a masked multi-row forward on a CPU runs SDPA with enable_gqa
    instead of transformers' repeat_kv: the same logits (to float rounding), and it is the path
    taken."""
    from splitspec.server import ragged

    model = _model("qwen2")
    assert model.config.num_attention_heads > model.config.num_key_value_heads
    assert ragged.enable(model)
    ids = torch.tensor([[1, 45, 100, 17, 99, 4]])
    lowest = torch.finfo(torch.float32).min
    mask = torch.full((6, 6), lowest).triu(1)
    mask[4, 3] = lowest  # a tree: row 4 branches off row 2, beside row 3
    mask = mask[None, None]
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("enable_gqa", False))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    logits = {}
    for flag in (True, False):
        monkeypatch.setattr(ragged, "CPU_MASKED_GQA", flag)
        calls.clear()
        logits[flag] = model(input_ids=ids, attention_mask=mask).logits
        assert set(calls) == {flag}, calls
    torch.testing.assert_close(logits[True], logits[False], atol=1e-5, rtol=1e-5)


def test_serve_bench_clients_share_one_copy_of_the_target(stories, serve, stories_path, tmp_path, monkeypatch):
    """Clients whose drafter is built on the target's frozen parts (here a moa checkpoint, untrained)
    take them from one target loaded by `run_clients`, not one load per client thread."""
    from splitspec.bench import serve_bench
    from splitspec.client.drafters import factory
    from splitspec.shared.config import ServerLimits
    from splitspec.shared.drafters.checkpoint import TargetIdentity, save_checkpoint
    from splitspec.shared.drafters.moa import MoAConfig, MoADrafter
    from splitspec.shared.drafters.spec import DrafterSpec
    from splitspec.shared.models import tokenizer_fingerprint

    model, tokenizer, model_id = stories
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "moa", "moa", MoADrafter(MoAConfig.from_target(model.config, tli=0)),
                    TargetIdentity.of(model, tokenizer, model_id), {})
    loads = []

    def counted(name, **kwargs):
        loads.append(name)
        return load_model(name, **kwargs)

    def refused(name, **kwargs):
        raise AssertionError(f"a client loaded its own copy of {name}")

    monkeypatch.setattr(serve_bench, "load_model", counted)
    monkeypatch.setattr(factory, "load_model", refused)
    server = serve(TargetRunner(model, tokenizer, model_id), ServerLimits(max_batch=4))
    prompts = [tokenizer(t)["input_ids"] for t in ("Once upon a time", "The dog")]
    tokens, elapsed, rates, steps = serve_bench.run_clients(
        server.address, 3, prompts, DrafterSpec.parse(f"moa:{tmp_path / 'moa'};vocab=0"),
        tokenizer_fingerprint(tokenizer), str(stories_path), 1.0, 12)
    assert loads == [str(stories_path)]
    assert tokens > 0 and len(rates) == 3 and all(r > 0 for r in rates) and steps
    tokens, *_ = serve_bench.run_clients(  # a target handed in (serve-bench's, loaded once per run) is not loaded again
        server.address, 2, prompts, DrafterSpec.parse(f"moa:{tmp_path / 'moa'};vocab=0"),
        tokenizer_fingerprint(tokenizer), str(stories_path), 1.0, 12, target_model=model)
    assert loads == [str(stories_path)] and tokens > 0


def test_serve_bench_reads_steps_per_forward_from_the_servers_metrics():
    """The steps-per-forward column comes from the service's own histogram, read over HTTP."""
    from splitspec.bench.serve_bench import forward_batches
    from splitspec.server.metrics import ServiceMetrics

    metrics = ServiceMetrics()
    port = metrics.serve_http(0)
    try:
        assert forward_batches(port) == (0.0, 0.0)
        for steps in (3, 5, 1):
            metrics.forward(steps)
        assert forward_batches(port) == (9.0, 3.0)
    finally:
        metrics.stop_http()


def _forwards(server, before=None) -> dict[int, int]:
    """{steps scored: target forwards} since `before` (a `batch_size_counts()` snapshot), read from
    the service's Prometheus histogram as an operator would."""
    now = server.servicer.metrics.batch_size_counts()
    return dict(now - before) if before is not None else dict(now)


def _window_service(stories, serve, window_ms: float):
    """(stub, fingerprint, server) of a service with max_batch 8 and this batching window."""
    import grpc

    from splitspec.shared.config import ServerLimits
    from splitspec.shared.models import tokenizer_fingerprint
    from splitspec.v1 import verify_pb2_grpc as pb_grpc

    model, tokenizer, model_id = stories
    server = serve(TargetRunner(model, tokenizer, model_id), ServerLimits(max_batch=8, batch_window_ms=window_ms))
    return pb_grpc.VerifyServiceStub(grpc.insecure_channel(server.address)), tokenizer_fingerprint(tokenizer), server


def _opened(stub, fingerprint, n: int) -> list[bytes]:
    from splitspec.v1 import verify_pb2 as pb

    return [stub.OpenSession(pb.OpenSessionRequest(prompt_ids=[1, 40 + i, 50, 60], tokenizer_fingerprint=fingerprint),
                             timeout=30).session_id for i in range(n)]


def _step(stub, session_id: bytes, step: int = 1) -> float:
    """Verify step `step` of a session (a 2-node chain); returns its round trip in seconds."""
    from splitspec.v1 import verify_pb2 as pb

    began = time.monotonic()
    stub.Verify(pb.VerifyRequest(session_id=session_id, step=step, tree=pb.DraftTree(tokens=[5, 6], parents=[-1, 0])),
                timeout=30)
    return time.monotonic() - began


def _warm(stub, server, sessions: list[bytes], steps: int = 2, gap_s: float = 0.0) -> None:
    """Steps 1..steps of each session one after another, ~`gap_s` between a session's reply and its
    next step: the service measures each session's turnaround from them (with the window off, which
    would otherwise hold each of these sequential steps for the others). Ends right after the last
    session's last reply."""
    import dataclasses

    limits = server.servicer.limits
    server.servicer.limits = dataclasses.replace(limits, batch_window_ms=0)
    try:
        for step in range(1, steps + 1):
            if step > 1:
                time.sleep(gap_s)
            for s in sessions:
                _step(stub, s, step)
    finally:
        server.servicer.limits = limits


def test_the_batching_window_waits_for_the_sessions_due_inside_it(stories, serve):
    """Three sessions whose clients answer at once: a step that finds the worker free waits (up to
    the window) for the other two, and the three are scored in one forward."""
    stub, fingerprint, server = _window_service(stories, serve, window_ms=1000)
    a, b, c = _opened(stub, fingerprint, 3)
    _warm(stub, server, [a, b, c])
    before = server.servicer.metrics.batch_size_counts()
    times: list[float] = []
    first = threading.Thread(target=lambda: times.append(_step(stub, a, 3)))
    first.start()
    time.sleep(0.3)  # the worker is holding a's step, waiting for b's and c's
    assert _forwards(server, before) == {}
    others = [threading.Thread(target=_step, args=(stub, s, 3)) for s in (b, c)]
    for t in others:
        t.start()
    for t in [first, *others]:
        t.join(30)
    assert _forwards(server, before) == {3: 1}, _forwards(server, before)
    assert 0.3 <= times[0] < 1.0  # it waited for them, and stopped waiting once they came


@pytest.mark.parametrize("case", ["lone", "idle", "slow clients", "window off"])
def test_a_step_does_not_wait_for_sessions_it_could_not_gather(stories, serve, monkeypatch, case):
    """No wait for a lone session, for sessions quiet longer than ACTIVE_SESSION_S, for sessions
    whose turnaround is longer than the window (a slow link), or with the window off."""
    from splitspec.server import service

    monkeypatch.setattr(service, "ACTIVE_SESSION_S", 0.4 if case == "idle" else 60.0)
    window = {"window off": 0, "slow clients": 300}.get(case, 1000)
    stub, fingerprint, server = _window_service(stories, serve, window_ms=window)
    sessions = _opened(stub, fingerprint, 1 if case == "lone" else 3)
    _warm(stub, server, sessions, gap_s=0.6 if case == "slow clients" else 0.0)
    if case == "idle":
        time.sleep(0.6)
    before = server.servicer.metrics.batch_size_counts()
    assert _step(stub, sessions[0], 3) < 0.25  # the window: 0.3 / 1 s
    assert _forwards(server, before) == {1: 1}


def test_the_window_stops_waiting_when_the_awaited_session_goes_quiet(stories, serve, monkeypatch):
    """A step waiting for a session that stopped sending (a client gone without closing) waits only
    until that session stops counting as active (ACTIVE_SESSION_S after its last reply), not for
    the whole window: nothing woke the worker, and a 10 s window held the step 10 s (qa56-srv F5)."""
    from splitspec.server import service

    monkeypatch.setattr(service, "ACTIVE_SESSION_S", 0.4)
    stub, fingerprint, server = _window_service(stories, serve, window_ms=1000)
    a, b = _opened(stub, fingerprint, 2)
    _warm(stub, server, [a, b])  # ends right after b's reply; b sends nothing more
    before = server.servicer.metrics.batch_size_counts()
    assert 0.15 <= _step(stub, a, 3) < 0.75  # waited for b until ~0.4 s after b's reply
    assert _forwards(server, before) == {1: 1}


def test_serve_flags_set_the_batching_window():
    """`serve --batch-window-ms` reaches ServerLimits (default 5 ms); a negative window is refused."""
    from splitspec.cli.main import build_parser
    from splitspec.server.cli import server_limits

    parse = build_parser().parse_args
    assert server_limits(parse(["serve"])).batch_window_ms == 5.0
    limits = server_limits(parse(["serve", "--batch-window-ms", "0", "--max-batch", "4"]))
    assert (limits.batch_window_ms, limits.max_batch) == (0.0, 4)
    with pytest.raises(ValueError, match="batch_window_ms"):
        server_limits(parse(["serve", "--batch-window-ms", "-1"]))
    with pytest.raises(ValueError, match="batch_window_ms must be <= 1000"):  # it gathers nothing more
        server_limits(parse(["serve", "--batch-window-ms", "1e9"]))
