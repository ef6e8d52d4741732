"""Chunked prefill (issue 11; server/runner.py `prefill_chunk`, server/service.py `_prefill`): a
prompt prefilled as several forwards over the growing cache gives the session, the first token and
the features of one forward (up to fp32 rounding), decodes exactly, lets other sessions' verify
steps run between its chunks, and stops at the next chunk when its caller goes away."""
from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from splitspec.client.loop import SpeculativeDecoder
from splitspec.client.transport import RemoteVerifier, make_channel
from splitspec.server.cli import server_limits
from splitspec.server.local import LocalVerifier
from splitspec.server.runner import TargetRunner
from splitspec.shared import kv
from splitspec.shared.config import ServerLimits
from splitspec.shared.features import FeatureBatch, FeatureRequest
from splitspec.shared.models import tokenizer_fingerprint
from splitspec.shared.sampling import SamplingParams
from splitspec.v1 import verify_pb2 as pb
from splitspec.v1 import verify_pb2_grpc as pb_grpc

from .helpers import OracleDrafter, reference_greedy
from .test_model_families import FAMILIES, VOCAB, _model

FEATURES = FeatureRequest(hidden_layers=(-1, 1), kv_layers=(0, 3))
PROMPT = [1, 45, 100, 17, 99, 4, 250, 33, 71, 12, 300, 7, 18]  # longer than the families' window of 8


def _chunked(runner: TargetRunner, prompt, features, chunk: int):
    """A prefill of `prompt` with every chunk but the last run, as the service runs it."""
    prefill = runner.start_prefill(prompt, features)
    while prefill.left > chunk:
        runner.prefill_chunk(prefill, chunk)
    return prefill


@pytest.mark.parametrize("family", ["stories", *FAMILIES])
def test_chunked_prefill_equals_one_forward_and_decodes_exactly(family, stories):
    """For every family (sliding windows and mixed layers included, the prompt longer than the
    window and the chunks shorter than it): the chunked session's cache, first token and features
    equal the one-forward prefill's to fp32 rounding, and greedy decoding from it, with trees whose
    accepted paths are not contiguous, equals the target's own `generate()`."""
    model = stories[0] if family == "stories" else _model(family)
    runner = TargetRunner(model, stories[1], family)
    whole, whole_features, _ = runner.open(PROMPT, SamplingParams(), FEATURES)
    prefill = _chunked(runner, PROMPT, FEATURES, 3)
    assert prefill.done == 12 and len(prefill.batches) == 4
    parted, parted_features, _ = runner.open(PROMPT, SamplingParams(), FEATURES, prefill=prefill)
    assert parted.pending_token == whole.pending_token
    assert kv.cache_length(parted.cache) == kv.cache_length(whole.cache) == len(PROMPT)
    for layer in range(runner.num_layers):
        for a, b in zip(kv.layer_kv(parted.cache, layer, 0, len(PROMPT)), kv.layer_kv(whole.cache, layer, 0, len(PROMPT))):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert (parted_features.start, parted_features.count) == (0, len(PROMPT))
    for name in ("hidden", "keys", "values"):
        got, want = getattr(parted_features, name), getattr(whole_features, name)
        assert got.keys() == want.keys()
        for layer in want:
            torch.testing.assert_close(got[layer], want[layer], rtol=1e-4, atol=1e-4)

    ref = reference_greedy(model, PROMPT, 30)
    real_open = runner.open
    runner.open = lambda ids, s, f, prefill=None: real_open(ids, s, f, prefill=_chunked(runner, ids, f, 3))
    drafter = OracleDrafter(PROMPT, ref, VOCAB, right=True, depth=4, wrong_siblings=2)
    gen = SpeculativeDecoder(LocalVerifier(runner), drafter).generate(PROMPT, len(ref), stop_on_eos=False)
    assert gen.tokens == ref, f"{family}: chunked prefill changed the greedy answer"


def test_prefill_chunk_refuses_a_chunk_with_nothing_to_run(stories):
    runner = TargetRunner(*stories)
    prefill = runner.start_prefill([1, 2, 3], FeatureRequest())
    with pytest.raises(ValueError, match="max_tokens >= 1"):
        runner.prefill_chunk(prefill, 0)
    runner.prefill_chunk(prefill, 5)
    assert prefill.done == 3
    with pytest.raises(ValueError, match="positions left"):
        runner.prefill_chunk(prefill, 1)


def test_feature_batches_join_only_when_they_follow_on():
    def batch(start, count, layers=(0,)):
        return FeatureBatch(start, count, hidden={k: torch.full((count, 4), float(start)) for k in layers},
                            keys={1: torch.zeros(2, count, 3)}, values={1: torch.ones(2, count, 3)},
                            lsa=torch.zeros(count, 5))

    joined = FeatureBatch.concat([batch(4, 2), batch(6, 3), batch(9, 1)])
    assert (joined.start, joined.count) == (4, 6)
    assert joined.hidden[0][:, 0].tolist() == [4, 4, 6, 6, 6, 9]
    assert joined.keys[1].shape == (2, 6, 3) and joined.lsa.shape == (6, 5)
    with pytest.raises(ValueError, match="follow on"):
        FeatureBatch.concat([batch(0, 2), batch(3, 1)])
    with pytest.raises(ValueError, match="same layers"):
        FeatureBatch.concat([batch(0, 2), batch(2, 1, layers=(0, 1))])
    with pytest.raises(ValueError, match="at least one"):
        FeatureBatch.concat([])


def _open_request(fp: str, prompt, features: FeatureRequest = FeatureRequest()):
    return pb.OpenSessionRequest(prompt_ids=list(prompt), tokenizer_fingerprint=fp, features=features.to_pb())


def _chunked_service(stories, serve, **limits):
    """(runner, tokenizer fingerprint, server, channel, stub) of a service prefilling in chunks of 2."""
    model, tokenizer, model_id = stories
    runner = TargetRunner(model, tokenizer, model_id)
    server = serve(runner, ServerLimits(prefill_chunk=2, **limits))
    channel = make_channel(server.address)
    return runner, tokenizer_fingerprint(tokenizer), server, channel, pb_grpc.VerifyServiceStub(channel)


def test_service_prefills_in_chunks_with_the_same_reply(stories, serve):
    """The service's chunked prefill gives the first token and features of the one-forward prefill
    (as they travel: fp16), and split decoding over it is exact."""
    model, tokenizer, model_id = stories
    fp = tokenizer_fingerprint(tokenizer)
    replies = {}
    for chunk in (None, 4):
        runner = TargetRunner(model, tokenizer, model_id)
        calls = []
        real = runner.prefill_chunk
        runner.prefill_chunk = lambda p, n, real=real: (calls.append(n), real(p, n))[1]
        server = serve(runner, ServerLimits(prefill_chunk=chunk))
        channel = make_channel(server.address)
        stub = pb_grpc.VerifyServiceStub(channel)
        replies[chunk] = stub.OpenSession(_open_request(fp, PROMPT, FEATURES), timeout=30)
        stub.CloseSession(pb.CloseSessionRequest(session_id=replies[chunk].session_id), timeout=30)
        channel.close()
        # 13 positions in chunks of 4: three chunk jobs, then the job that runs the last one and opens
        assert calls == ([len(PROMPT)] if chunk is None else [4, 4, 4, 1]), calls
        if chunk == 4:
            ref = reference_greedy(model, PROMPT, 30)
            drafter = OracleDrafter(PROMPT, ref, VOCAB, right=True, depth=4, wrong_siblings=2)
            verifier = RemoteVerifier(server.address)
            gen = SpeculativeDecoder(verifier, drafter).generate(PROMPT, len(ref), stop_on_eos=False)
            verifier.close()
            assert gen.tokens == ref
            assert server.servicer.kv.tokens == 0  # every session closed, every reservation released
    assert replies[4].first_token == replies[None].first_token
    got, want = (FeatureBatch.from_pb(replies[c].features, request=FEATURES) for c in (4, None))
    assert (got.start, got.count) == (want.start, want.count) == (0, len(PROMPT))
    for name in ("hidden", "keys", "values"):
        for layer, tensor in getattr(want, name).items():
            torch.testing.assert_close(getattr(got, name)[layer], tensor, rtol=2e-3, atol=2e-3)


class _GatedRunner:
    """Logs the runner's model calls in order and holds the `hold_at`-th prefill chunk (counted from
    1; the chunks before it run) at a gate."""

    def __init__(self, runner: TargetRunner, hold_at: int = 1) -> None:
        self.log: list[str] = []
        self.gate = threading.Event()
        self.entered = threading.Event()
        chunk, verify, batch = runner.prefill_chunk, runner.verify, runner.verify_batch

        def gated_chunk(prefill, n):
            self.log.append("chunk")
            if self.log.count("chunk") == hold_at:
                self.entered.set()
                assert self.gate.wait(30), "the test never opened the gate"
            return chunk(prefill, n)

        def logged_verify(*args, **kwargs):
            self.log.append("verify")
            return verify(*args, **kwargs)

        def logged_batch(items):
            self.log.extend(["verify"] * len(items))
            return batch(items)

        runner.prefill_chunk, runner.verify, runner.verify_batch = gated_chunk, logged_verify, logged_batch


def test_other_sessions_steps_run_between_the_chunks_of_a_long_prefill(stories, serve):
    """A step of a decoding session that arrives during a long prefill is scored after the chunk
    running then, not after the whole prompt."""
    runner, fp, server, channel, stub = _chunked_service(stories, serve)
    decoding = stub.OpenSession(_open_request(fp, [1, 40, 50]), timeout=30).session_id
    spy = _GatedRunner(runner)
    long_open = stub.OpenSession.future(_open_request(fp, PROMPT), timeout=30)
    assert spy.entered.wait(10)
    step = stub.Verify.future(pb.VerifyRequest(session_id=decoding, step=1,
                                               tree=pb.DraftTree(tokens=[5, 6], parents=[-1, 0])), timeout=30)
    time.sleep(0.3)  # the step is queued behind the running chunk
    spy.gate.set()
    assert step.result().step == 1 and long_open.result().session_id
    # 13 positions in chunks of 2: six chunk jobs, the open job runs the last position
    assert spy.log.count("chunk") == 7
    assert spy.log.index("verify") == 1, spy.log  # right after the chunk that held the worker
    channel.close()


def test_a_chunked_prefill_counts_its_prompt_once_against_the_kv_budget(stories, serve):
    """While a prompt is prefilled in chunks, the server-wide KV count holds it once (its finished
    chunks in its cache, the rest reserved), so another session's step that fits the budget beside
    it is admitted; the finished chunks were counted both held and reserved, and such steps were
    refused with RESOURCE_EXHAUSTED (qa56-srv F4)."""
    decoding_prompt, tree = [1, 40, 50], pb.DraftTree(tokens=[5, 6], parents=[-1, 0])
    # room for both prompts and one step of the decoding session (its tree, forced rows, bonus), no more
    budget = len(PROMPT) + len(decoding_prompt) + 3
    runner, fp, server, channel, stub = _chunked_service(stories, serve, max_total_kv_tokens=budget)
    decoding = stub.OpenSession(_open_request(fp, decoding_prompt), timeout=30).session_id
    spy = _GatedRunner(runner, hold_at=2)  # the first chunk (2 positions) is in the cache
    long_open = stub.OpenSession.future(_open_request(fp, PROMPT), timeout=30)
    assert spy.entered.wait(10)
    assert server.servicer.kv.tokens == len(decoding_prompt) + len(PROMPT)  # not + 2
    step = stub.Verify.future(pb.VerifyRequest(session_id=decoding, step=1, tree=tree), timeout=30)
    time.sleep(0.3)  # admitted (or refused) on arrival, then queued behind the held chunk
    spy.gate.set()
    assert step.result().step == 1 and long_open.result().session_id
    held = sum(kv.cache_length(e.session.cache) + e.step_tokens for e in server.servicer.sessions.values())
    assert server.servicer.kv.tokens == held  # the caches and the decoding session's last features, no reservation
    channel.close()


def test_long_prompts_take_turns_and_a_short_one_goes_between(stories, serve):
    """Prompts of several chunks are prefilled one after another, oldest first (their chunks
    alternated, so all of them finished late together, and under load none met its deadline:
    qa56-srv F3), while a prompt of one chunk is prefilled between two chunks like a step."""
    runner, fp, server, channel, stub = _chunked_service(stories, serve)
    spy = _GatedRunner(runner)
    order: list[int] = []  # the prompt's first token of each chunk and each open, in the order run
    chunk, open_ = runner.prefill_chunk, runner.open
    runner.prefill_chunk = lambda prefill, n: (order.append(prefill.prompt_ids[0]), chunk(prefill, n))[1]
    runner.open = lambda prompt, *a, **kw: (order.append(prompt[0]), open_(prompt, *a, **kw))[1]
    first = stub.OpenSession.future(_open_request(fp, [1] + PROMPT[1:]), timeout=30)
    assert spy.entered.wait(10)  # the first long prompt holds the worker in its first chunk
    second = stub.OpenSession.future(_open_request(fp, [2] + PROMPT[1:]), timeout=30)
    time.sleep(0.2)
    short = stub.OpenSession.future(_open_request(fp, [3, 40]), timeout=30)
    time.sleep(0.2)
    spy.gate.set()
    assert first.result().session_id and second.result().session_id and short.result().session_id
    runs = [token for i, token in enumerate(order) if i == 0 or token != order[i - 1]]
    assert runs == [1, 3, 1, 2], order  # the short prompt after the running chunk; the long ones in turn
    channel.close()


def test_a_departed_callers_prefill_stops_at_the_next_chunk(stories, serve):
    """An OpenSession whose deadline passes during a chunk runs no further chunk, leaves no session,
    and its KV reservation is released once the running chunk is over."""
    runner, fp, server, channel, stub = _chunked_service(stories, serve)
    spy = _GatedRunner(runner)
    with pytest.raises(grpc.RpcError) as err:
        stub.OpenSession(_open_request(fp, PROMPT), timeout=0.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert server.servicer.kv.tokens == len(PROMPT)  # the chunk still runs: its reservation holds
    spy.gate.set()
    deadline = time.monotonic() + 10
    while server.servicer.kv.tokens and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.servicer.kv.tokens == 0
    time.sleep(0.3)
    assert spy.log == ["chunk"], spy.log
    assert not server.servicer.sessions
    assert stub.OpenSession(_open_request(fp, [1, 40, 50]), timeout=30).session_id  # still serving
    channel.close()


def test_serve_prefill_chunk_flag(stories):
    from splitspec.cli.main import build_parser

    parse = build_parser().parse_args
    assert server_limits(parse(["serve"])).prefill_chunk == ServerLimits().prefill_chunk == 512
    assert server_limits(parse(["serve", "--prefill-chunk", "0"])).prefill_chunk is None
    assert server_limits(parse(["serve", "--prefill-chunk", "64"])).prefill_chunk == 64
    with pytest.raises(ValueError, match="prefill_chunk"):
        server_limits(parse(["serve", "--prefill-chunk", "-1"]))


def test_a_cancelled_local_open_stops_between_chunks(stories, monkeypatch):
    """Single-device: with `cancelled`, a long prompt is prefilled in chunks and the open ends with
    OpenCancelled at the first chunk boundary after `cancelled` turns True; without it, one forward."""
    from splitspec.server import local
    from splitspec.shared.verifier import OpenCancelled

    monkeypatch.setattr(local, "PREFILL_CHUNK", 4)
    runner = TargetRunner(*stories)
    chunks: list[int] = []
    real = runner.prefill_chunk
    runner.prefill_chunk = lambda p, n: (chunks.append(n), real(p, n))[1]
    verifier = LocalVerifier(runner)
    with pytest.raises(OpenCancelled):
        verifier.open(PROMPT, SamplingParams(), FeatureRequest(), cancelled=lambda: len(chunks) >= 2)
    assert chunks == [4, 4]
    chunks.clear()
    session, opened = verifier.open(PROMPT, SamplingParams(), FeatureRequest(), cancelled=lambda: False)
    assert chunks == [4, 4, 4, 1]
    whole, first_whole = verifier.open(PROMPT, SamplingParams(), FeatureRequest())
    assert chunks == [4, 4, 4, 1, len(PROMPT)] and opened.first_token == first_whole.first_token


def test_a_cancelled_remote_open_cancels_the_call_and_the_servers_prefill(stories, serve):
    """Split: `cancelled` turning True while the server prefills ends the open at once (the server
    is still inside a chunk), the server runs no further chunk and keeps no session."""
    from splitspec.shared.verifier import OpenCancelled

    model, tokenizer, model_id = stories
    runner = TargetRunner(model, tokenizer, model_id)
    server = serve(runner, ServerLimits(prefill_chunk=2))
    spy = _GatedRunner(runner)
    verifier = RemoteVerifier(server.address)
    started = time.monotonic()
    with pytest.raises(OpenCancelled):
        verifier.open(PROMPT, SamplingParams(), FeatureRequest(), cancelled=spy.entered.is_set)
    assert time.monotonic() - started < 10 and not spy.gate.is_set()
    spy.gate.set()
    deadline = time.monotonic() + 10
    while server.servicer.kv.tokens and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)
    assert spy.log == ["chunk"] and not server.servicer.sessions and server.servicer.kv.tokens == 0
    verifier.close()


def test_an_answer_cancelled_during_its_prefill_ends_empty(stories, monkeypatch):
    """The loop hands `cancelled` to the open: an answer cancelled while its prompt is prefilled
    ends at once, with no tokens and no error."""
    from splitspec.server import local

    monkeypatch.setattr(local, "PREFILL_CHUNK", 4)
    model = stories[0]
    runner = TargetRunner(*stories)
    chunks: list[int] = []
    real = runner.prefill_chunk
    runner.prefill_chunk = lambda p, n: (chunks.append(n), real(p, n))[1]
    ref = reference_greedy(model, PROMPT, 8)
    drafter = OracleDrafter(PROMPT, ref, VOCAB, right=True, depth=2)
    decoder = SpeculativeDecoder(LocalVerifier(runner), drafter)
    gen = decoder.generate(PROMPT, 8, stop_on_eos=False, cancelled=lambda: bool(chunks))
    assert gen.tokens == [] and chunks == [4]
    gen = decoder.generate(PROMPT, 8, stop_on_eos=False, cancelled=lambda: False)
    assert gen.tokens == ref


@pytest.mark.parametrize("family", ["llama-mqa-tied", "gemma3"])
def test_fixed_shape_steps_after_a_chunked_prefill_stay_exact(family, stories):
    """`--cuda-graphs` steps (eager fixed-shape on a CPU, server/graphs.py) over a cache filled by a
    chunked prefill decode exactly as the target's own `generate()`."""
    model = _model(family)
    ref = reference_greedy(model, PROMPT, 24)
    runner = TargetRunner(model, stories[1], family, use_graphs=True)
    real_open = runner.open
    runner.open = lambda ids, s, f, prefill=None: real_open(ids, s, f, prefill=_chunked(runner, ids, f, 5))
    drafter = OracleDrafter(PROMPT, ref, VOCAB, right=True, depth=4, wrong_siblings=1)
    gen = SpeculativeDecoder(LocalVerifier(runner), drafter).generate(PROMPT, len(ref), stop_on_eos=False)
    assert runner.static.runs > 0 and gen.tokens == ref
