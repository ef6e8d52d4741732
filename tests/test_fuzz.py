"""Property-based fuzz of the verify service's request messages (hypothesis, bounded examples).

Whatever a client sends, as well-typed but arbitrary fields or as random bytes on the wire, the
server answers OK or refuses with a client-error status (never INTERNAL or UNKNOWN), and it stays
healthy: health says SERVING and a good session verifies afterwards. Sampling parameters are drawn
from the whole float32 range (subnormals, the largest float, inf, NaN), tensors include
decompression bombs, and a session survives any refused Verify.
"""
from __future__ import annotations

import math
import os

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitspec.server.runner import TargetRunner
from splitspec.server.service import SERVICE_NAME
from splitspec.shared import codec
from splitspec.shared.config import ServerLimits
from splitspec.shared.models import tokenizer_fingerprint
from splitspec.v1 import verify_pb2 as pb
from splitspec.v1 import verify_pb2_grpc as pb_grpc

from .helpers import zstd_zeros

C = grpc.StatusCode
SERVER_FAULTS = (C.INTERNAL, C.UNKNOWN)
LIMITS = ServerLimits(max_tree_nodes=16, max_tree_depth=8, max_prompt_tokens=96, max_context=256,
                      max_sessions=64, max_draft_support=32, max_receive_bytes=256 * 1024)
FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])

int32 = st.integers(-2**31, 2**31 - 1)
small_ids = st.integers(-3, 600)  # near the 512-token vocabulary, on both sides of its edges
floats = st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True, width=32)
# float32 values at the edges of the sampling code: subnormals, the smallest normal, near the greedy
# floor (1e-5), the largest finite float
edge_floats = st.sampled_from([0.0, -0.0, 1e-45, 1e-38, 3e-38, 1.1754942e-38, 9.99e-6, 1e-5, 1.0001e-5, 1.0,
                               3.4028234663852886e38, -1e-45, math.inf, -math.inf, math.nan])
any_float = st.one_of(floats, edge_floats)
BOMB_BYTES = 2**24  # each bomb frame inflates to 16 MiB (4 M int32 / float32 elements)


def mostly(valid, anything):
    """Three parts in four from `valid`, so that deep code paths run too, not only the first check."""
    return st.one_of(valid, valid, valid, anything)


@pytest.fixture
def target(stories, serve):
    """(stub, fingerprint, server, spy-free runner) around stories260K with small limits."""
    model, tokenizer, model_id = stories
    server = serve(TargetRunner(model, tokenizer, model_id), LIMITS)
    channel = grpc.insecure_channel(server.address)
    yield pb_grpc.VerifyServiceStub(channel), tokenizer_fingerprint(tokenizer), server, channel
    _assert_healthy(channel, tokenizer_fingerprint(tokenizer), server)
    channel.close()


def _assert_healthy(channel, fp: str, server) -> None:
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10)
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    stub = pb_grpc.VerifyServiceStub(channel)
    opened = stub.OpenSession(pb.OpenSessionRequest(prompt_ids=[1, 40, 50], tokenizer_fingerprint=fp), timeout=30)
    sid = opened.session_id
    tree = pb.DraftTree(tokens=[5], parents=[-1])
    reply = stub.Verify(pb.VerifyRequest(session_id=sid, step=1, tree=tree), timeout=30)
    assert reply.step == 1
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)


def _call(fn):
    """Run one call; a refusal must carry a client-error status. Returns the reply or None."""
    try:
        return fn()
    except grpc.RpcError as err:
        assert err.code() not in SERVER_FAULTS, (err.code(), err.details())
        return None


@st.composite
def bombs(draw):
    """Small Tensor messages whose zstd frames inflate to BOMB_BYTES (header stating the size or not)
    under a declared shape that matches, is small, is huge, or has too many axes."""
    frame = zstd_zeros(BOMB_BYTES, declare_size=draw(st.booleans()))
    shape = draw(st.sampled_from([[1, BOMB_BYTES // 4], [BOMB_BYTES // 4], [1, 2], [2**20, 4], [1] * 70,
                                  [BOMB_BYTES // 16, 4]]))
    msg = pb.Tensor(dtype=draw(st.sampled_from([pb.DTYPE_INT32, pb.DTYPE_FLOAT32])), shape=shape,
                    codec=pb.CODEC_ZSTD, data=frame)
    if msg.dtype == pb.DTYPE_FLOAT32 and draw(st.booleans()):
        msg.quantization = pb.QUANTIZATION_INT8
        msg.data = draw(st.sampled_from([frame, codec.encode(torch.zeros(1, 2, dtype=torch.int8)).data]))
        msg.scales = zstd_zeros(BOMB_BYTES, declare_size=draw(st.booleans()))
    return msg


@st.composite
def tensors(draw):
    """Tensor messages: arbitrary fields, a real encoding of a random tensor (maybe corrupted), or
    a decompression bomb."""
    kind = draw(st.sampled_from(["fields", "encoded", "encoded", "bomb"]))
    if kind == "bomb":
        return draw(bombs())
    if kind == "fields":
        shape = draw(st.lists(st.integers(-2, 2**40), max_size=3) | st.lists(st.just(1), min_size=60, max_size=90))
        return pb.Tensor(dtype=draw(st.integers(0, 9)), shape=shape, quantization=draw(st.integers(0, 4)),
                         codec=draw(st.integers(0, 3)), data=draw(st.binary(max_size=64)),
                         scales=draw(st.binary(max_size=16)))
    rows, cols = draw(st.integers(0, 3)), draw(st.integers(0, 6))
    dtype = draw(st.sampled_from([torch.int32, torch.int64, torch.float32, torch.float16]))
    if dtype.is_floating_point:
        values = torch.rand(rows, cols).to(dtype)
    else:
        values = torch.randint(-5, 600, (rows, cols)).to(dtype)
    quantization = pb.QUANTIZATION_NONE
    if dtype.is_floating_point and cols and draw(st.booleans()):
        quantization = draw(st.sampled_from([pb.QUANTIZATION_INT8, pb.QUANTIZATION_FP8_E4M3]))
    msg = codec.encode(values, quantization=quantization, codec=draw(st.sampled_from([pb.CODEC_NONE, pb.CODEC_ZSTD])))
    if draw(st.booleans()):
        msg.data = draw(st.binary(max_size=32)) + msg.data[draw(st.integers(0, 8)):]
    return msg


@st.composite
def open_requests(draw, fp: str):
    sampling = pb.SamplingParams(temperature=draw(mostly(st.sampled_from([0.0, 0.7, 1.0]), any_float)),
                                 top_p=draw(mostly(st.sampled_from([0.0, 0.9, 1.0]), any_float)),
                                 top_k=draw(mostly(st.integers(0, 40), int32)), seed=draw(st.integers(0, 2**64 - 1)))
    features = pb.FeatureSpec(
        hidden_layers=draw(mostly(st.lists(st.integers(-1, 5), max_size=3, unique=True), st.lists(int32, max_size=4))),
        kv_layers=draw(mostly(st.lists(st.integers(0, 4), max_size=3, unique=True), st.lists(int32, max_size=4))),
        quantization=draw(mostly(st.integers(0, 3), st.integers(-1, 5))),
        codec=draw(mostly(st.integers(0, 2), st.integers(-1, 4))),
        lsa_id=draw(mostly(st.just(""), st.text(max_size=8))))
    return pb.OpenSessionRequest(
        prompt_ids=draw(mostly(st.lists(st.integers(0, 511), min_size=1, max_size=100),
                               st.lists(small_ids | int32, max_size=120))),
        sampling=sampling, features=features, tokenizer_fingerprint=draw(mostly(st.just(fp), st.text(max_size=8))))


@st.composite
def verify_requests(draw):
    nodes = draw(mostly(st.integers(0, 6), st.integers(0, 20)))
    tokens = draw(mostly(st.lists(st.integers(0, 511), min_size=nodes, max_size=nodes),
                         st.lists(small_ids, min_size=nodes, max_size=nodes)))
    parents = draw(mostly(st.tuples(*(st.integers(-1, i - 1) for i in range(nodes))).map(list),
                          st.lists(st.integers(-5, 25), min_size=max(nodes - 1, 0), max_size=nodes + 1)))
    request = pb.VerifyRequest(step=draw(mostly(st.just(1), st.sampled_from([0, 2, 2**64 - 1]))),
                               tree=pb.DraftTree(tokens=tokens, parents=parents))
    if "forced_tokens" in pb.VerifyRequest.DESCRIPTOR.fields_by_name and draw(st.booleans()):
        forced = mostly(st.lists(st.integers(0, 511), max_size=8), st.lists(small_ids, max_size=8))
        request.forced_tokens.extend(draw(forced))
    if draw(st.booleans()):
        request.draft_probs.CopyFrom(pb.DraftProbs(rows=draw(st.lists(st.integers(-3, 20), max_size=4)),
                                                   token_ids=draw(tensors()), probs=draw(tensors())))
    return request


def test_fuzz_open_session(target):
    stub, fp, server, _ = target

    @FUZZ
    @given(request=open_requests(fp))
    def run(request):
        reply = _call(lambda: stub.OpenSession(request, timeout=30))
        if reply is not None:
            stub.CloseSession(pb.CloseSessionRequest(session_id=reply.session_id), timeout=10)

    run()
    assert not server.servicer.sessions


def test_fuzz_verify(target):
    stub, fp, server, _ = target

    @FUZZ
    @given(request=verify_requests(), sampled=st.booleans(),
           session=st.sampled_from(["real", "real", "real", "random", "short"]))
    def run(request, sampled, session):
        opened = stub.OpenSession(pb.OpenSessionRequest(
            prompt_ids=[1, 40, 50, 60], tokenizer_fingerprint=fp,
            sampling=pb.SamplingParams(temperature=1.0 if sampled else 0.0, seed=7)), timeout=30)
        request.session_id = {"real": opened.session_id, "random": os.urandom(16), "short": b"\x01\x02"}[session]
        reply = _call(lambda: stub.Verify(request, timeout=30))
        if reply is not None:
            assert reply.step == request.step
            again = _call(lambda: stub.Verify(request, timeout=30))  # a replay of an accepted step
            assert again.timings.forward_ms == 0  # the replay's own timings: no model work
            again.ClearField("timings")
            reply.ClearField("timings")
            assert again == reply
        _call(lambda: stub.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id), timeout=10))

    run()
    assert not server.servicer.sessions


@st.composite
def sampling_params(draw):
    """Any SamplingParams the proto can carry: temperature and top_p over all float32 values."""
    return pb.SamplingParams(temperature=draw(any_float), top_p=draw(any_float),
                             top_k=draw(st.integers(0, 600) | int32), seed=draw(st.integers(0, 2**64 - 1)))


def test_fuzz_sampling_and_refused_steps(target):
    """A session opened with any sampling parameters (or refused with INVALID_ARGUMENT) takes any
    Verify, and whatever that Verify got, the session goes on with the next good step."""
    stub, fp, server, _ = target
    good_probs = pb.DraftProbs(rows=[-1], token_ids=codec.encode(torch.tensor([[5, 6]], dtype=torch.int32)),
                               probs=codec.encode(torch.tensor([[0.5, 0.5]])))

    @FUZZ
    @given(sampling=sampling_params(), request=verify_requests())
    def run(sampling, request):
        opened = _call(lambda: stub.OpenSession(pb.OpenSessionRequest(
            prompt_ids=[1, 40, 50, 60], tokenizer_fingerprint=fp, sampling=sampling), timeout=30))
        if opened is None:
            return
        request.session_id = opened.session_id
        reply = _call(lambda: stub.Verify(request, timeout=30))
        step = 2 if reply is not None else 1
        follow = pb.VerifyRequest(session_id=opened.session_id, step=step, tree=pb.DraftTree(tokens=[5], parents=[-1]),
                                  draft_probs=good_probs)
        assert stub.Verify(follow, timeout=30).step == step  # the session survived the fuzzed step
        stub.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id), timeout=10)

    run()
    assert not server.servicer.sessions


def test_fuzz_random_bytes(target):
    stub, fp, server, channel = target
    methods = {name: channel.unary_unary(f"/{SERVICE_NAME}/{name}")  # raw bytes in, raw bytes out
               for name in ("Info", "OpenSession", "Verify", "CloseSession")}
    valid_verify = pb.VerifyRequest(session_id=os.urandom(16), step=1,
                                    tree=pb.DraftTree(tokens=[5, 6], parents=[-1, 0])).SerializeToString()

    @FUZZ
    @given(method=st.sampled_from(sorted(methods)),
           payload=st.binary(max_size=300) | st.builds(lambda cut, junk: valid_verify[:cut] + junk,
                                                       st.integers(0, len(valid_verify)), st.binary(max_size=12)))
    def run(method, payload):
        _call(lambda: methods[method](payload, timeout=30))

    run()
