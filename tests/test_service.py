"""The verify service in-process on port 0: each bad input gets its status code, no model work is
done for it, and the server goes on serving the next good request."""
from __future__ import annotations

import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitspec.server.runner import TargetRunner
from splitspec.shared import codec
from splitspec.shared.config import ServerLimits
from splitspec.shared.models import tokenizer_fingerprint
from splitspec.v1 import verify_pb2 as pb
from splitspec.v1 import verify_pb2_grpc as pb_grpc

LIMITS = ServerLimits(max_tree_nodes=8, max_tree_depth=4, max_prompt_tokens=64, max_context=100,
                      max_sessions=3, session_idle_ttl_s=60, max_draft_support=16)


class Counted:
    """Counts forward passes of the wrapped model; `delay_s` makes each one that much slower."""

    def __init__(self, model):
        self.calls = 0
        self.delay_s = 0.0
        original = model.forward

        def forward(*args, **kwargs):
            self.calls += 1
            time.sleep(self.delay_s)
            return original(*args, **kwargs)

        model.forward = forward


@pytest.fixture
def service(stories, serve):
    model, tokenizer, model_id = stories
    counter = Counted(model)
    server = serve(TargetRunner(model, tokenizer, model_id), LIMITS)
    channel = grpc.insecure_channel(server.address)
    stub = pb_grpc.VerifyServiceStub(channel)
    yield stub, counter, tokenizer_fingerprint(tokenizer), server
    channel.close()
    del model.forward  # restore the class method


def _open(stub, fp, prompt=(1, 40, 50, 60), temperature=0.0, **kw):
    return stub.OpenSession(pb.OpenSessionRequest(prompt_ids=list(prompt), tokenizer_fingerprint=fp,
                                                  sampling=pb.SamplingParams(temperature=temperature, **kw)), timeout=30)


def _verify(stub, sid, step, tokens=(5, 6), parents=(-1, 0), probs=None):
    req = pb.VerifyRequest(session_id=sid, step=step, tree=pb.DraftTree(tokens=list(tokens), parents=list(parents)))
    if probs is not None:
        req.draft_probs.CopyFrom(probs)
    return stub.Verify(req, timeout=30)


def _expect(code, fn, counter):
    before = counter.calls
    with pytest.raises(grpc.RpcError) as err:
        fn()
    assert err.value.code() == code, err.value.details()
    assert counter.calls == before, "the server did model work for a refused request"
    return err.value.details()


def test_info_and_health(service):
    stub, _, fp, server = service
    info = stub.Info(pb.InfoRequest(), timeout=10)
    assert info.vocab_size == 512 and info.tokenizer_fingerprint == fp and info.max_tree_nodes == 8
    channel = grpc.insecure_channel(server.address)
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="splitspec.v1.VerifyService"))
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    channel.close()


def test_bad_open_requests(service):
    stub, counter, fp, _ = service
    C = grpc.StatusCode
    _expect(C.FAILED_PRECONDITION, lambda: _open(stub, "not-the-tokenizer"), counter)
    _expect(C.INVALID_ARGUMENT, lambda: _open(stub, fp, prompt=()), counter)
    _expect(C.INVALID_ARGUMENT, lambda: _open(stub, fp, prompt=(1, 512)), counter)
    _expect(C.INVALID_ARGUMENT, lambda: _open(stub, fp, prompt=(1, -3)), counter)
    _expect(C.RESOURCE_EXHAUSTED, lambda: _open(stub, fp, prompt=[1] * 65), counter)
    _expect(C.INVALID_ARGUMENT, lambda: _open(stub, fp, temperature=-1.0), counter)
    _expect(C.INVALID_ARGUMENT, lambda: _open(stub, fp, temperature=float("nan")), counter)
    _expect(C.INVALID_ARGUMENT, lambda: _open(stub, fp, temperature=1.0, top_p=1.5), counter)
    _expect(C.INVALID_ARGUMENT, lambda: _open(stub, fp, contextual_penalty=0.5), counter)
    _expect(C.INVALID_ARGUMENT, lambda: _open(stub, fp, contextual_penalty=1.2, penalty_window=-1), counter)
    _expect(C.INVALID_ARGUMENT, lambda: _open(stub, fp, contextual_penalty=float("nan")), counter)
    bad_features = pb.OpenSessionRequest(prompt_ids=[1, 2], tokenizer_fingerprint=fp,
                                         features=pb.FeatureSpec(kv_layers=[99]))
    _expect(C.INVALID_ARGUMENT, lambda: stub.OpenSession(bad_features, timeout=10), counter)
    layers = stub.Info(pb.InfoRequest(), timeout=10).num_layers
    for hidden in ([-1, layers], [layers, -1], [2, 2]):  # -1 is layer L: the same tensor twice (QA finding 11)
        twice = pb.OpenSessionRequest(prompt_ids=[1, 2], tokenizer_fingerprint=fp,
                                      features=pb.FeatureSpec(hidden_layers=hidden))
        assert "repeat" in _expect(C.INVALID_ARGUMENT, lambda: stub.OpenSession(twice, timeout=10), counter)
    assert _open(stub, fp).session_id  # still serving


def test_bad_verify_requests(service):
    stub, counter, fp, _ = service
    C = grpc.StatusCode
    sid = _open(stub, fp).session_id
    _expect(C.NOT_FOUND, lambda: _verify(stub, b"\x00" * 16, 1), counter)
    _expect(C.INVALID_ARGUMENT, lambda: _verify(stub, b"short", 1), counter)
    _expect(C.RESOURCE_EXHAUSTED, lambda: _verify(stub, sid, 1, tokens=[3] * 9, parents=[-1] * 9), counter)
    _expect(C.RESOURCE_EXHAUSTED, lambda: _verify(stub, sid, 1, tokens=[3] * 5, parents=[-1, 0, 1, 2, 3]), counter)
    _expect(C.INVALID_ARGUMENT, lambda: _verify(stub, sid, 1, tokens=(5, 6), parents=(-1, 1)), counter)  # cycle
    _expect(C.INVALID_ARGUMENT, lambda: _verify(stub, sid, 1, tokens=(5, 6), parents=(1, -1)), counter)
    _expect(C.INVALID_ARGUMENT, lambda: _verify(stub, sid, 1, tokens=(5, 6), parents=(-1,)), counter)
    _expect(C.INVALID_ARGUMENT, lambda: _verify(stub, sid, 1, tokens=(5, 512), parents=(-1, 0)), counter)
    _expect(C.FAILED_PRECONDITION, lambda: _verify(stub, sid, 2), counter)  # step out of order
    reply = _verify(stub, sid, 1)  # the session is intact after all that
    assert reply.step == 1
    calls = counter.calls
    again = _verify(stub, sid, 1)  # a retried step: same reply (but its own timings), no model work
    assert _untimed(again) == _untimed(reply) and counter.calls == calls
    _expect(C.FAILED_PRECONDITION, lambda: _verify(stub, sid, 5), counter)
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)
    _expect(C.NOT_FOUND, lambda: _verify(stub, sid, 2), counter)


def test_context_limit(service):
    stub, counter, fp, _ = service
    sid = _open(stub, fp, prompt=[1] * 60).session_id
    step = 1
    while True:  # LIMITS.max_context = 100: grow the session with one-token steps until refused
        try:
            _verify(stub, sid, step, tokens=[3] * 8, parents=[-1] * 8)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "exceeds" in err.details()
            break
        step += 1
        assert step < 50


def test_bad_draft_probs(service):
    stub, counter, fp, _ = service
    C = grpc.StatusCode
    sid = _open(stub, fp, temperature=1.0).session_id
    ids = torch.tensor([[5, 6, 7, 0]], dtype=torch.int32)
    good = torch.tensor([[0.5, 0.25, 0.25, 0.0]])

    def probs(i=ids, p=good, rows=(-1,)):
        return pb.DraftProbs(rows=list(rows), token_ids=codec.encode(i), probs=codec.encode(p))

    _expect(C.INVALID_ARGUMENT, lambda: _verify(stub, sid, 1, probs=probs(p=good * 2)), counter)
    _expect(C.INVALID_ARGUMENT, lambda: _verify(stub, sid, 1, probs=probs(p=torch.tensor([[float("nan"), 1, 0, 0]]))), counter)
    _expect(C.INVALID_ARGUMENT, lambda: _verify(stub, sid, 1, probs=probs(i=ids.long())), counter)
    _expect(C.INVALID_ARGUMENT, lambda: _verify(stub, sid, 1, probs=probs(rows=(-1, -1))), counter)
    _expect(C.INVALID_ARGUMENT, lambda: _verify(stub, sid, 1, probs=probs(rows=(7,))), counter)
    _expect(C.INVALID_ARGUMENT, lambda: _verify(stub, sid, 1, tokens=(9,), parents=(-1,), probs=probs()), counter)
    wide = torch.zeros(1, 17, dtype=torch.int32)
    _expect(C.RESOURCE_EXHAUSTED, lambda: _verify(stub, sid, 1, tokens=(0,), parents=(-1,),
                                                  probs=probs(i=wide, p=torch.full((1, 17), 1 / 17))), counter)
    reply = _verify(stub, sid, 1, tokens=(5,), parents=(-1,), probs=probs())
    assert reply.step == 1


def test_session_limit_and_ttl(stories, serve):
    model, tokenizer, model_id = stories
    server = serve(TargetRunner(model, tokenizer, model_id),
                   ServerLimits(max_sessions=2, session_idle_ttl_s=5.0))  # 0.5 s expired between two opens on a loaded VM
    channel = grpc.insecure_channel(server.address)
    stub = pb_grpc.VerifyServiceStub(channel)
    fp = tokenizer_fingerprint(tokenizer)
    first = _open(stub, fp).session_id
    _open(stub, fp)
    with pytest.raises(grpc.RpcError) as err:
        _open(stub, fp)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    time.sleep(5.5)
    with pytest.raises(grpc.RpcError) as err:
        _verify(stub, first, 1)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert _open(stub, fp).session_id  # the idle sessions were evicted, so there is room again
    channel.close()


def test_oversize_message_refused(service):
    stub, counter, fp, _ = service
    huge = pb.OpenSessionRequest(prompt_ids=[1] * 2_000_000, tokenizer_fingerprint=fp)
    _expect(grpc.StatusCode.RESOURCE_EXHAUSTED, lambda: stub.OpenSession(huge, timeout=30), counter)
    assert _open(stub, fp).session_id


def test_retry_after_client_deadline(service):
    """A call whose client gave up still completes on the server; the retry of that step gets the
    recorded reply and the session goes on in order."""
    stub, counter, fp, _ = service
    sid = _open(stub, fp).session_id
    counter.delay_s = 0.5  # the forward outlasts the client's deadline however fast the machine is
    with pytest.raises(grpc.RpcError) as err:
        _verify_with_timeout(stub, sid, 1, 0.05)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    counter.delay_s = 0.0
    first = _verify(stub, sid, 1)
    assert _untimed(_verify(stub, sid, 1)) == _untimed(first)
    assert _verify(stub, sid, 2).step == 2


def test_a_replayed_step_reports_its_own_timings(service):
    """QA finding 7: the recorded reply of a repeated step carried the first call's timings, so the
    client saw ~300 ms of server time inside a ~2 ms round trip (and a 0 ms link). The replay keeps
    the answer and reports its own time: no forward, total within its round trip."""
    stub, counter, fp, _ = service
    sid = _open(stub, fp).session_id
    counter.delay_s = 0.3
    first = _verify(stub, sid, 1)
    counter.delay_s = 0.0
    assert first.timings.forward_ms >= 300
    tic = time.perf_counter()
    again = _verify(stub, sid, 1)
    rtt_ms = (time.perf_counter() - tic) * 1e3
    assert _untimed(again) == _untimed(first)
    assert again.timings.forward_ms == 0 and again.timings.total_ms <= rtt_ms
    assert again.timings.queue_ms <= again.timings.total_ms


def _untimed(reply: pb.VerifyReply) -> pb.VerifyReply:
    """`reply` without its timings (a replay's are its own)."""
    copy = pb.VerifyReply()
    copy.CopyFrom(reply)
    copy.ClearField("timings")
    return copy


def _verify_with_timeout(stub, sid, step, timeout):
    req = pb.VerifyRequest(session_id=sid, step=step, tree=pb.DraftTree(tokens=[5, 6], parents=[-1, 0]))
    return stub.Verify(req, timeout=timeout)


def test_the_model_loads_and_every_step_runs_on_one_worker_thread(stories, stories_path, monkeypatch):
    """`splitspec serve` loads the model on the thread that runs its steps and hands that thread to
    the service, and the prompt's features are encoded there too, not on the event loop: a second
    thread running parallel torch kernels gives the process a second OpenMP pool, which made a small
    CPU step ~1.7x slower (shared/compute.py)."""
    import asyncio
    import threading

    from splitspec.cli.main import build_parser
    from splitspec.server import cli as server_cli
    from splitspec.server import service as service_module
    from splitspec.shared.features import FeatureBatch

    seen = {"encode": []}

    def load(*args, **kwargs):
        seen["load"] = threading.current_thread()
        return stories

    encode = FeatureBatch.to_pb

    def encoding(self, request):
        seen["encode"].append(threading.current_thread())
        return encode(self, request)

    async def serve_once(runner, host, port, limits, worker=None, **kwargs):
        server, bound, servicer, health = await service_module.create_server(runner, "127.0.0.1:0", limits,
                                                                             worker=worker)
        try:
            seen["worker"] = await asyncio.wrap_future(servicer.worker.submit(threading.current_thread))
            async with grpc.aio.insecure_channel(f"127.0.0.1:{bound}") as channel:
                reply = await pb_grpc.VerifyServiceStub(channel).OpenSession(pb.OpenSessionRequest(
                    prompt_ids=[1, 40, 50, 60], tokenizer_fingerprint=tokenizer_fingerprint(stories[1]),
                    features=pb.FeatureSpec(hidden_layers=[-1], kv_layers=[0])), timeout=30)
            assert reply.features.ByteSize() > 0
        finally:
            await service_module.shutdown(server, servicer, health, 0.1)

    monkeypatch.setattr(server_cli, "load_model", load)
    monkeypatch.setattr(service_module, "serve", serve_once)
    monkeypatch.setattr(FeatureBatch, "to_pb", encoding)
    server_cli.cmd_serve(build_parser().parse_args(["serve", "--target", str(stories_path)]))
    assert seen["load"] is seen["worker"] and seen["encode"] == [seen["worker"]]
    assert seen["worker"] is not threading.main_thread()


def test_a_load_on_the_compute_thread_returns_its_result_or_raises_its_error():
    """`loaded_on_compute_thread`: the loader runs on the returned worker's thread, not the caller's,
    and its error reaches the caller."""
    import threading

    from splitspec.shared.compute import loaded_on_compute_thread

    def load(path):
        raise FileNotFoundError(path)

    with pytest.raises(FileNotFoundError, match="no-such-model"):
        loaded_on_compute_thread("failing-load", load, "no-such-model")
    worker, (thread, value) = loaded_on_compute_thread("good-load", lambda x: (threading.current_thread(), x), 7)
    assert value == 7 and thread is not threading.main_thread()
    assert worker.submit(threading.current_thread).result() is thread
    worker.shutdown(wait=True)
