"""The codec and features on the wire: what encode emits decode accepts (non-finite activations,
zero-width rows), error bounds of half-precision tensors, shapes that overflow, one zstd frame per
blob, bounded feature replies, short error messages (QA findings 3, 4, 6-10 of the wire report)."""
from __future__ import annotations

import math

import pytest
import torch
import zstandard

from splitspec.shared import codec, features
from splitspec.shared.features import FeatureBatch, FeatureRequest
from splitspec.v1 import verify_pb2 as pb

QUANTIZED = [pb.QUANTIZATION_INT8, pb.QUANTIZATION_FP8_E4M3]
ALL_QUANTIZATIONS = [pb.QUANTIZATION_NONE, *QUANTIZED]
INF, NAN = float("inf"), float("nan")


# --- finding 3: non-finite values --------------------------------------------------------------

@pytest.mark.parametrize("quantization", QUANTIZED)
@pytest.mark.parametrize("bad", [INF, -INF, NAN])
def test_encode_refuses_to_quantize_non_finite_values(quantization, bad):
    """Quantizing NaN / +-inf would give a non-finite scale that decode refuses: encode says so."""
    t = torch.tensor([[1.0, bad, 2.0], [3.0, 4.0, 5.0]])
    with pytest.raises(codec.CodecError, match="NaN or \\+-inf"):
        codec.encode(t, quantization)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_unquantized_non_finite_values_stay_bit_exact(dtype):
    """QUANTIZATION_NONE still carries NaN / inf as they are (draft probabilities are sent so; the
    server's validation refuses them after decoding)."""
    t = torch.tensor([[NAN, INF, -INF, 1.0]]).to(dtype)
    back = codec.decode(codec.encode(t))
    assert back.dtype == dtype and torch.isnan(back[0, 0]) and back[0, 1:].tolist() == [INF, -INF, 1.0]


@pytest.mark.parametrize("quantization", QUANTIZED)
def test_rows_at_float32_max_decode_finite(quantization):
    """absmax = float32's largest value: 127 x (absmax / 127) must not round to inf on decoding."""
    t = torch.full((2, 3), torch.finfo(torch.float32).max)
    t[1] *= -1
    back = codec.decode(codec.encode(t, quantization))
    assert torch.isfinite(back).all()
    assert ((back - t).abs() <= t.abs() * 2**-4).all()


@pytest.mark.parametrize("quantization", ALL_QUANTIZATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_overflowing_activations_still_give_decodable_finite_features(quantization, dtype):
    """A target activation beyond fp16's range, inf or NaN: the features are clamped (NaN -> 0,
    beyond range -> the largest finite value), decodable and finite; the other rows are intact."""
    row = torch.tensor([70000.0, -1e5, 1.0, NAN, INF, -INF, 2.0, -3.0])
    good = torch.linspace(-4, 4, 8)
    hidden = torch.stack([row, good]).to(dtype)
    kv = torch.stack([hidden, good.expand(2, 8).to(dtype)])  # [Hkv 2, count 2, D 8]
    batch = FeatureBatch(3, 2, hidden={-1: hidden}, keys={0: kv}, values={0: kv.flip(0)}, lsa=hidden)
    request = FeatureRequest(hidden_layers=(-1,), kv_layers=(0,), quantization=quantization)
    back = FeatureBatch.from_pb(batch.to_pb(request))
    assert torch.isnan(hidden[0, 3]) and hidden[0, 4] == INF  # the batch itself is left as it was
    for t in (back.hidden[-1], back.keys[0], back.values[0], back.lsa):
        assert torch.isfinite(t).all()
    h = back.hidden[-1]
    assert torch.allclose(h[1], good, atol=0.05)
    if quantization == pb.QUANTIZATION_NONE:
        fp16_max = torch.finfo(torch.float16).max  # (in a float16 tensor 70000 and -1e5 are +-inf already)
        assert h[0].tolist() == [fp16_max, -fp16_max, 1.0, 0.0, fp16_max, -fp16_max, 2.0, -3.0]
    else:
        big = torch.finfo(dtype).max
        assert h[0, 4] >= big * (1 - 2**-4) and h[0, 5] <= -big * (1 - 2**-4) and h[0, 3] == 0


# --- finding 6: error bounds of float16 / bfloat16 tensors -----------------------------------------

def _activations(dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 576, generator=gen)
    x[:, 7] *= 40  # an outlier channel
    x[3] = 0.0
    return x.to(dtype)


def _bounds(x: torch.Tensor, quantization: int) -> torch.Tensor:
    """The module docstring's bound for each element of x (float32 arithmetic)."""
    x = x.float()
    absmax = x.abs().amax(-1, keepdim=True)
    if quantization == pb.QUANTIZATION_INT8:
        return (absmax / 254).expand_as(x)
    scale = absmax / 448
    normal = (x / scale.clamp_min(1e-30)).abs() >= 2**-6
    return torch.where(normal, 2**-4 * x.abs(), (2**-10 * scale).expand_as(x))


@pytest.mark.parametrize("quantization", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequantized_half_precision_tensors_meet_the_documented_bound(dtype, quantization):
    """decode(..., as_dtype=float32) returns q x scale itself: the stated bound holds for float16 and
    bfloat16 inputs, up to float32 rounding (2^-22 of the row's absmax)."""
    for seed in range(5):
        x = _activations(dtype, seed)
        back = codec.decode(codec.encode(x, quantization), as_dtype=torch.float32)
        assert back.dtype == torch.float32
        slack = x.float().abs().amax(-1, keepdim=True) * 2**-22
        assert ((back - x.float()).abs() <= _bounds(x, quantization) + slack).all()


@pytest.mark.parametrize("quantization", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decoding_to_half_precision_adds_at_most_half_an_ulp(dtype, quantization):
    """decode returns the message's dtype (callers such as the server's validation rely on it); the
    rounding to that dtype adds at most half an ulp of x_hat, as the module docstring states."""
    half_ulp = {torch.float16: 2**-11, torch.bfloat16: 2**-8}[dtype]
    tiny = {torch.float16: 2**-25, torch.bfloat16: 0.0}[dtype]
    for seed in range(5):
        x = _activations(dtype, seed)
        back = codec.decode(codec.encode(x, quantization))
        assert back.dtype == dtype
        slack = x.float().abs().amax(-1, keepdim=True) * 2**-22
        bound = _bounds(x, quantization) + half_ulp * back.float().abs() + tiny + slack
        assert ((back.float() - x.float()).abs() <= bound).all()


@pytest.mark.parametrize("quantization", QUANTIZED)
def test_features_of_a_bfloat16_target_decode_within_the_bound(quantization):
    """A bfloat16 server's int8 / fp8 features, decoded to float32 by the client, are rounded once
    (not through bfloat16 first): within the documented bound."""
    x = _activations(torch.bfloat16, 0)
    msg = FeatureBatch(0, 32, hidden={-1: x}).to_pb(FeatureRequest(hidden_layers=(-1,), quantization=quantization))
    back = FeatureBatch.from_pb(msg).hidden[-1]
    assert back.dtype == torch.float32
    slack = x.float().abs().amax(-1, keepdim=True) * 2**-22
    assert ((back - x.float()).abs() <= _bounds(x, quantization) + slack).all()


# --- finding 7: last axis 0 ----------------------------------------------------------------------

@pytest.mark.parametrize("quantization", QUANTIZED)
@pytest.mark.parametrize("compression", [pb.CODEC_NONE, pb.CODEC_ZSTD])
@pytest.mark.parametrize("shape", [(5, 0), (2, 3, 0), (0,), (0, 0)])
def test_quantized_tensors_with_an_empty_last_axis_round_trip(quantization, compression, shape):
    t = torch.zeros(shape)
    msg = codec.encode(t, quantization, compression)
    back = codec.decode(msg)
    assert back.shape == t.shape and back.dtype == torch.float32


# --- finding 8: overflowing shapes ---------------------------------------------------------------

@pytest.mark.parametrize("shape", [[2**62, 2**62, 0], [0, 2**62, 2**62], [0] + [2**20] * 7, [2**40, 0],
                                   [0, 2**29]])
@pytest.mark.parametrize("quantization", [pb.QUANTIZATION_NONE, pb.QUANTIZATION_INT8])
def test_shapes_that_overflow_are_refused_with_a_codec_error(shape, quantization):
    """Even when a 0 makes the element count 0, a dimension past the limits is refused with
    TensorTooLarge (a CodecError), never torch's RuntimeError."""
    msg = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=shape, quantization=quantization, codec=pb.CODEC_ZSTD)
    with pytest.raises(codec.TensorTooLarge):
        codec.decode(msg)


def test_empty_shapes_within_the_limits_still_decode():
    for shape in ([0, 5], [3, 0, 7], [0, 2**20]):
        assert codec.decode(pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=shape)).shape == tuple(shape)


# --- finding 9: one zstd frame per blob ------------------------------------------------------------

def _frame(data: bytes, **kwargs) -> bytes:
    return zstandard.ZstdCompressor(**kwargs).compress(data)


@pytest.mark.parametrize("field", ["data", "scales"])
@pytest.mark.parametrize("trailer", [_frame(b"\0" * 1000), b"garbage", b"\0",
                                     b"\x50\x2a\x4d\x18\x04\0\0\0abcd"])  # another frame, junk, a skippable frame
def test_bytes_after_the_first_zstd_frame_are_refused(field, trailer):
    msg = codec.encode(torch.randn(4, 8), pb.QUANTIZATION_INT8, pb.CODEC_ZSTD)
    setattr(msg, field, getattr(msg, field) + trailer)
    with pytest.raises(codec.CodecError):
        codec.decode(msg)


def test_a_skippable_frame_is_not_a_tensor():
    msg = pb.Tensor(dtype=pb.DTYPE_INT32, shape=[1], codec=pb.CODEC_ZSTD,
                    data=b"\x50\x2a\x4d\x18\x04\0\0\0abcd" + _frame(b"\0" * 4))
    with pytest.raises(codec.CodecError):
        codec.decode(msg)
    with pytest.raises(codec.CodecError, match="not a zstd frame"):
        codec._zstd_frame_size(msg.data)


@pytest.mark.parametrize("blocks", [3, 5000])
@pytest.mark.parametrize("trailer", [b"", b"x", _frame(b"")])
def test_frames_of_many_blocks_are_sized_exactly(blocks, trailer):
    """A frame of many empty raw blocks (past the blocks read in Python: sized by decompressing
    again), with or without bytes after it."""
    empty = _frame(b"")
    blob = empty[:zstandard.frame_header_size(empty)] + b"\0\0\0" * blocks + b"\x01\0\0"
    msg = pb.Tensor(dtype=pb.DTYPE_INT8, shape=[0], codec=pb.CODEC_ZSTD, data=blob + trailer)
    if trailer:
        with pytest.raises(codec.CodecError, match=f"{len(trailer)} bytes after the zstd frame"):
            codec.decode(msg)
    else:
        assert codec.decode(msg).shape == (0,)


@pytest.mark.parametrize("kwargs", [{}, {"write_checksum": True}, {"write_content_size": False}, {"level": 19}])
@pytest.mark.parametrize("payload", [b"", b"\0" * 300_000, bytes(range(256)) * 2000,
                                     torch.randn(50_000).numpy().tobytes()])
def test_single_frames_of_any_kind_are_accepted(kwargs, payload):
    """Checksummed frames, frames without a content size (streamed), raw / RLE / compressed blocks."""
    if kwargs.get("write_content_size") is False:
        stream = zstandard.ZstdCompressor(**kwargs).compressobj()
        blob = stream.compress(payload) + stream.flush()
    else:
        blob = _frame(payload, **kwargs)
    msg = pb.Tensor(dtype=pb.DTYPE_INT8, shape=[len(payload)], codec=pb.CODEC_ZSTD, data=blob)
    assert codec.decode(msg).numpy().tobytes() == payload


@pytest.mark.parametrize("quantization", ALL_QUANTIZATIONS)
def test_encode_writes_exactly_one_frame_per_blob(quantization):
    for t in (torch.randn(64, 576), torch.zeros(3, 4), torch.randn(1, 1)):
        msg = codec.encode(t, quantization, pb.CODEC_ZSTD)
        for blob in (msg.data, msg.scales):
            if blob:
                assert codec._zstd_frame_size(blob) == len(blob)
        assert codec.decode(msg).shape == t.shape


# --- finding 10: bounded feature replies -----------------------------------------------------------

def _features(count=3, width=8, hidden=(-1,), kv=(0,), quantization=pb.QUANTIZATION_INT8, lsa=True):
    torch.manual_seed(0)
    batch = FeatureBatch(5, count, hidden={layer: torch.randn(count, width) for layer in hidden},
                         keys={layer: torch.randn(2, count, 4) for layer in kv},
                         values={layer: torch.randn(2, count, 4) for layer in kv},
                         lsa=torch.randn(count, 6) if lsa else None)
    request = FeatureRequest(hidden_layers=tuple(hidden), kv_layers=tuple(kv), quantization=quantization,
                             lsa_id="x" if lsa else "")
    return batch, request


@pytest.fixture
def inflated(monkeypatch):
    """Counts the blobs codec._inflate is asked to decompress."""
    calls = []
    real = codec._inflate

    def counting(blob, compression, expected):
        calls.append(expected)
        return real(blob, compression, expected)

    monkeypatch.setattr(codec, "_inflate", counting)
    return calls


@pytest.mark.parametrize("quantization", ALL_QUANTIZATIONS)
@pytest.mark.parametrize("count", [0, 1, 3])
def test_well_formed_features_round_trip(quantization, count):
    batch, request = _features(count=count, quantization=quantization)
    back = FeatureBatch.from_pb(batch.to_pb(request), request=request, hidden_size=8)
    assert (back.start, back.count) == (5, count)
    assert back.hidden[-1].shape == (count, 8) and back.keys[0].shape == (2, count, 4) == back.values[0].shape
    assert back.lsa.shape == (count, 6) and back.lsa.dtype == torch.float32
    assert torch.allclose(back.hidden[-1], batch.hidden[-1], atol=0.3)
    empty = FeatureBatch.from_pb(FeatureBatch(0, 0).to_pb(FeatureRequest()))
    assert (empty.count, empty.hidden, empty.keys, empty.lsa) == (0, {}, {}, None)


def test_a_tensor_with_more_rows_than_count_is_refused_before_inflating(inflated):
    """The QA report's bomb: count 1, but a [116508, 576] tensor (a small zstd frame of zeros)."""
    rows = 116508
    frame = _frame(b"\0" * 1024)  # never inflated: the declared shape is refused first
    msg = pb.Features(start=0, count=1, hidden=[pb.LayerTensor(layer=-1, tensor=pb.Tensor(
        dtype=pb.DTYPE_FLOAT16, shape=[rows, 576], codec=pb.CODEC_ZSTD, data=frame))])
    with pytest.raises(codec.CodecError, match=r"is not \[count=1, E\]"):
        FeatureBatch.from_pb(msg)
    assert inflated == []


def test_the_total_a_reply_inflates_to_is_bounded(inflated):
    """Shapes that agree with count, each under the per-tensor limit, but many layers: refused from
    the declared shapes, before any frame is inflated."""
    count, width = 2**11, features.MAX_FEATURE_WIDTH
    layers = [pb.LayerTensor(layer=i, tensor=pb.Tensor(dtype=pb.DTYPE_FLOAT16, shape=[count, width],
                                                        codec=pb.CODEC_ZSTD, data=_frame(b"\0" * 16)))
              for i in range(5)]  # 5 x 2^27 elements, 2.5 GiB as float32
    with pytest.raises(codec.TensorTooLarge, match="features of 2048 positions"):
        FeatureBatch.from_pb(pb.Features(start=0, count=count, hidden=layers))
    assert inflated == []
    batch, request = _features()
    with pytest.raises(codec.TensorTooLarge):
        FeatureBatch.from_pb(batch.to_pb(request), max_bytes=100)


@pytest.mark.parametrize("mutate,message", [
    (lambda m: setattr(m, "count", -1), "must be >= 0"),
    (lambda m: setattr(m, "count", 4), r"is not \[count=4, E\]"),
    (lambda m: m.hidden.add(layer=-1).CopyFrom(m.hidden[0]), "sent twice"),
    (lambda m: m.hidden.add(layer=2, tensor=codec.encode(torch.zeros(3, 9))), "differs in width"),
    (lambda m: m.keys.add(layer=1, tensor=codec.encode(torch.zeros(4, 3, 4))), "different layers"),
    (lambda m: m.hidden[0].tensor.shape.__setitem__(1, features.MAX_FEATURE_WIDTH + 1), "wide per position"),
    (lambda m: m.keys[0].tensor.shape.extend([1] * 3000), r"\.\.\. \(3003 axes\)"),
    (lambda m: m.hidden[0].tensor.CopyFrom(codec.encode(torch.zeros(3, 8, dtype=torch.int32))), "float dtype"),
])
def test_features_that_disagree_with_count_or_each_other_are_refused(mutate, message, inflated):
    batch, request = _features()
    msg = batch.to_pb(request)
    mutate(msg)
    with pytest.raises(codec.CodecError, match=message) as err:
        FeatureBatch.from_pb(msg)
    assert len(str(err.value)) < 300
    assert inflated == []


def test_the_hidden_size_and_the_request_bound_the_reply_when_given():
    batch, request = _features()
    msg = batch.to_pb(request)
    with pytest.raises(codec.CodecError, match="differs in width"):
        FeatureBatch.from_pb(msg, hidden_size=576)
    with pytest.raises(codec.CodecError, match="not the ones requested"):
        FeatureBatch.from_pb(msg, request=FeatureRequest(hidden_layers=(-1,), kv_layers=(0, 1), lsa_id="x"))
    with pytest.raises(codec.CodecError, match="not the ones requested"):
        FeatureBatch.from_pb(msg, request=FeatureRequest(hidden_layers=(-1,), kv_layers=(0,)))
    assert FeatureBatch.from_pb(msg, request=request, hidden_size=8).hidden[-1].shape == (3, 8)


# --- finding 4 (codec): quoted shapes are truncated --------------------------------------------------

@pytest.mark.parametrize("shape", [[1] * 1999 + [-1], [-1] + [2] * 100_000])
def test_error_messages_quote_at_most_a_few_axes(shape):
    msg = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=shape)
    with pytest.raises(codec.CodecError) as err:
        codec.decode(msg)
    assert len(str(err.value)) < 200


def test_shapes_in_messages_are_truncated():
    assert codec.describe_shape((1, 2, 3)) == "(1, 2, 3)"
    text = codec.describe_shape(range(1_000_000))
    assert text == "(0, 1, 2, 3, 4, 5, 6, 7, ... (1000000 axes))"
    with pytest.raises(codec.TensorTooLarge) as err:
        codec.decode(pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2**40] * 8))
    assert len(str(err.value)) < 300 and math.prod([2**40] * 8) > 0
