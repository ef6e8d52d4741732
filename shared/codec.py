"""The tensor codec: torch tensor <-> `splitspec.v1.Tensor` (quantize, then zstd).

Quantizations (rows are all axes but the last; one float32 scale per row):
- NONE: the tensor's own dtype, bit-exact (NaN and +-inf included).
- INT8: symmetric absmax, scale = absmax(row) / 127, q = round(x / scale).
  Error bound: |x - x_hat| <= scale / 2 = absmax(row) / 254 for every element.
- FP8_E4M3: scale = absmax(row) / 448, q = float8_e4m3fn(x / scale) (round to nearest even).
  Error bound: |x - x_hat| <= 2^-4 |x| for |x / scale| >= 2^-6 (normal range, 3 mantissa bits),
  and <= 2^-10 scale below it (subnormal spacing 2^-9).
The bounds are those of the dequantized float32 x_hat = q x scale (up to float32 rounding of
scale and of the product; a row whose absmax is below ~1e-36 has a subnormal float32 scale and
loses relative precision, one below ~1.8e-43 gets scale 0 and decodes to zeros). `decode` returns
the message's dtype: for float16 / bfloat16 that rounds x_hat once more, adding up to half an ulp,
2^-11 |x_hat| (float16; 2^-25 absolute in its subnormal range) or 2^-8 |x_hat| (bfloat16).
`decode(..., as_dtype=torch.float32)` returns x_hat itself, within the bounds above.
Only finite values can be quantized (a non-finite value would make its row's scale non-finite,
which `decode` refuses): `encode` raises CodecError for them.
Compression: one zstd frame each for data and scales (Codec.ZSTD), gRPC compression stays off.
Decoding validates everything that came over the wire before touching it: the declared shape is
checked against the caller's element limit (and MAX_DECODED_BYTES) before anything is inflated,
and zstd output is capped at the byte size that shape needs, so a small message cannot make the
decoder allocate more than the limits allow (a decompression bomb); a blob must be exactly one
zstd frame (bytes after it are refused).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import zstandard

from splitspec.v1 import verify_pb2 as pb

MAX_DECODED_BYTES = 256 * 2**20  # refuse to inflate a single tensor past this
_MAX_AXES = 8  # torch handles more, but no tensor of the protocol has over 3
_QUOTED_AXES = 8  # error messages quote at most this many axes of a shape

_DTYPES = {
    pb.DTYPE_FLOAT32: torch.float32,
    pb.DTYPE_FLOAT16: torch.float16,
    pb.DTYPE_BFLOAT16: torch.bfloat16,
    pb.DTYPE_INT8: torch.int8,
    pb.DTYPE_INT32: torch.int32,
    pb.DTYPE_INT64: torch.int64,
}
_PB_DTYPES = {v: k for k, v in _DTYPES.items()}
_FP8_MAX = 448.0
_ZSTD_LEVEL = 3


class CodecError(ValueError):
    """A Tensor message is malformed: unknown dtype, byte length that does not match the shape,
    non-finite scales, or a corrupt zstd frame."""


class TensorTooLarge(CodecError):
    """A Tensor message declares more elements than the caller allows, or more than
    MAX_DECODED_BYTES once decoded; nothing was inflated."""


def encode(tensor: torch.Tensor, quantization: int = pb.QUANTIZATION_NONE,
           codec: int = pb.CODEC_ZSTD) -> pb.Tensor:
    """Encode `tensor` (any shape with >= 1 axis for quantized formats).

    `quantization`: QUANTIZATION_NONE, _INT8 or _FP8_E4M3; `codec`: CODEC_NONE or CODEC_ZSTD
    (UNSPECIFIED: NONE).

    Raises:
        CodecError: unsupported dtype, quantizing a non-float / 0-d tensor or one holding NaN or
            +-inf (replace them first, e.g. torch.nan_to_num), an unknown quantization or an
            unknown codec.
    """
    if tensor.dtype not in _PB_DTYPES:
        raise CodecError(f"unsupported dtype {tensor.dtype}")
    if codec not in (pb.CODEC_UNSPECIFIED, pb.CODEC_NONE, pb.CODEC_ZSTD):  # else stored raw under a label decode refuses
        raise CodecError(f"unknown codec {codec}")
    tensor = tensor.detach().cpu().contiguous()
    quantization = quantization or pb.QUANTIZATION_NONE
    scales = b""
    if quantization == pb.QUANTIZATION_NONE:
        stored = tensor
    else:
        if not tensor.is_floating_point() or tensor.dim() == 0:
            raise CodecError("only float tensors with >= 1 axis can be quantized")
        if not torch.isfinite(tensor).all():
            raise CodecError("cannot quantize NaN or +-inf (its row's scale would be non-finite, which "
                             "decode refuses); replace them first, e.g. with torch.nan_to_num")
        stored, scale = _quantize(tensor.float(), quantization)
        scales = scale.numpy().astype("<f4").tobytes()
    data = _raw_bytes(stored)
    if codec == pb.CODEC_ZSTD:
        cctx = zstandard.ZstdCompressor(level=_ZSTD_LEVEL)
        data = cctx.compress(data)
        scales = cctx.compress(scales) if scales else b""
    return pb.Tensor(dtype=_PB_DTYPES[tensor.dtype], shape=list(tensor.shape), quantization=quantization,
                     codec=codec or pb.CODEC_NONE, data=data, scales=scales)


def decode(msg: pb.Tensor, max_numel: int | None = None, *, as_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Decode and validate a Tensor message: a tensor of the declared shape, of dtype `as_dtype`
    (default: the message's dtype).

    `max_numel`: the most elements the caller accepts; a larger declared shape is refused before
    any byte is inflated. Whatever the limit, a tensor needs at most MAX_DECODED_BYTES decoded (the
    nonzero dimensions of a shape with a 0 are held to it too), and zstd output never exceeds the
    bytes the declared shape needs (+1 to detect overlong frames).
    A quantized tensor is dequantized in float32 and rounded once to `as_dtype` (see the module
    docstring for the error bounds); an unquantized one is converted with `Tensor.to`.

    Raises:
        TensorTooLarge: the declared shape exceeds `max_numel` or MAX_DECODED_BYTES.
        CodecError: see the class docstring.
    """
    if msg.dtype not in _DTYPES:
        raise CodecError(f"unknown dtype {msg.dtype}")
    dtype = _DTYPES[msg.dtype]
    shape = tuple(msg.shape)
    if len(shape) > _MAX_AXES:
        raise CodecError(f"{len(shape)} axes; at most {_MAX_AXES} are supported")
    if any(d < 0 for d in shape):
        raise CodecError(f"negative dimension in shape {describe_shape(shape)}")
    nonzero = math.prod(d for d in shape if d)  # bounds every dimension and stride, even when numel is 0
    if nonzero * dtype.itemsize > MAX_DECODED_BYTES:
        raise TensorTooLarge(f"shape {describe_shape(shape)} of {dtype}: its nonzero dimensions span "
                             f"{_count(nonzero * dtype.itemsize)} bytes; the limit is {MAX_DECODED_BYTES}")
    numel = math.prod(shape)
    if max_numel is not None and numel > max_numel:
        raise TensorTooLarge(f"shape {describe_shape(shape)} holds {_count(numel)} elements; the limit is {max_numel}")
    quantization = msg.quantization or pb.QUANTIZATION_NONE
    if quantization not in (pb.QUANTIZATION_NONE, pb.QUANTIZATION_INT8, pb.QUANTIZATION_FP8_E4M3):
        raise CodecError(f"unknown quantization {msg.quantization}")
    if quantization != pb.QUANTIZATION_NONE and (not dtype.is_floating_point or not shape):
        # before the size check, which would name the storage dtype the sender never chose
        raise CodecError("a quantized tensor must decode to a float dtype with >= 1 axis")
    storage = dtype if quantization == pb.QUANTIZATION_NONE else (
        torch.int8 if quantization == pb.QUANTIZATION_INT8 else torch.float8_e4m3fn)
    itemsize = torch.empty((), dtype=storage).element_size()
    # numel * dtype.itemsize <= MAX_DECODED_BYTES now (numel <= nonzero): the stored form is never larger
    data = _inflate(msg.data, msg.codec, numel * itemsize)
    if len(data) != numel * itemsize:
        raise CodecError(f"data holds {len(data)} bytes; shape {describe_shape(shape)} of {storage} "
                         f"needs {numel * itemsize}")
    values = _from_bytes(data, storage, shape)
    if quantization == pb.QUANTIZATION_NONE:
        if msg.scales:
            raise CodecError("scales given for an unquantized tensor")
        return values if as_dtype is None else values.to(as_dtype)
    rows = math.prod(shape[:-1])  # <= nonzero, so bounded too; a last axis of 0 still has its rows
    raw_scales = _inflate(msg.scales, msg.codec, rows * 4)
    if len(raw_scales) != rows * 4:
        raise CodecError(f"scales hold {len(raw_scales)} bytes; {rows} rows need {rows * 4}")
    scale = torch.from_numpy(np.frombuffer(raw_scales, dtype="<f4").copy())
    if not torch.isfinite(scale).all() or (scale < 0).any():
        raise CodecError("scales must be finite and >= 0")
    return (values.float() * scale.reshape(*shape[:-1], 1)).to(dtype if as_dtype is None else as_dtype)


def describe_shape(shape) -> str:
    """`shape` for an error message: its first _QUOTED_AXES axes, then how many there are."""
    shape = tuple(shape)
    if len(shape) <= _QUOTED_AXES:
        return str(shape)
    return f"({', '.join(map(str, shape[:_QUOTED_AXES]))}, ... ({len(shape)} axes))"


def _quantize(x: torch.Tensor, quantization: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., C] float32 -> (q [..., C], scale [...] float32)."""
    absmax = x.abs().amax(dim=-1) if x.shape[-1] else torch.zeros(x.shape[:-1])
    if quantization == pb.QUANTIZATION_INT8:
        scale = _finite_product(absmax / 127.0, 127.0)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
        return torch.round(x / safe).clamp(-127, 127).to(torch.int8), scale
    if quantization == pb.QUANTIZATION_FP8_E4M3:
        scale = _finite_product(absmax / _FP8_MAX, _FP8_MAX)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
        return (x / safe).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn), scale
    raise CodecError(f"unknown quantization {quantization}")


def _count(n: int) -> str:
    """`n` for an error message: exact up to 2^64, else its order of magnitude."""
    return str(n) if n < 2**64 else f"about 2^{n.bit_length() - 1}"


def _finite_product(scale: torch.Tensor, qmax: float) -> torch.Tensor:
    """`scale` [...], one float32 ulp lower where qmax x scale (what decode computes for the largest
    code) would round past float32's largest value (rows with absmax near 3.4e38)."""
    over = torch.isinf(scale * qmax)
    return torch.where(over, torch.nextafter(scale, torch.zeros_like(scale)), scale) if over.any() else scale


def _raw_bytes(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _from_bytes(data: bytes, storage: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return raw.view(storage).reshape(shape)


def _inflate(blob: bytes, codec: int, expected: int) -> bytes:
    """`blob` decompressed by `codec`: at most `expected` + 1 bytes are ever produced (a frame
    declaring more is refused from its header; one that does not say is cut off at the cap). A zstd
    blob must be exactly one frame: bytes after it (another frame, garbage) are refused.

    Raises:
        TensorTooLarge: `expected` exceeds MAX_DECODED_BYTES. CodecError: unknown codec, corrupt
            or overlong frame, bytes after the frame.
    """
    codec = codec or pb.CODEC_NONE
    if codec == pb.CODEC_NONE:
        return blob
    if codec != pb.CODEC_ZSTD:
        raise CodecError(f"unknown codec {codec}")
    if not blob:
        return b""
    if expected > MAX_DECODED_BYTES:
        raise TensorTooLarge(f"tensor of {expected} bytes exceeds the {MAX_DECODED_BYTES}-byte limit")
    try:
        declared = zstandard.frame_content_size(blob)  # -1 when the header does not say
        if declared > expected:
            raise CodecError(f"zstd frame declares {declared} bytes; {expected} expected")
        out = zstandard.ZstdDecompressor().decompress(blob, max_output_size=expected + 1)
        size = _zstd_frame_size(blob)
        if size != len(blob):
            raise CodecError(f"{len(blob) - size} bytes after the zstd frame; a blob is one frame")
        return out
    except zstandard.ZstdError as err:
        raise CodecError(f"corrupt zstd frame: {err}") from err


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_ZSTD_BLOCK_RLE, _ZSTD_BLOCK_RESERVED = 1, 3  # block types (0 raw and 2 compressed: `size` bytes follow)
_ZSTD_WALK_BLOCKS = 4096  # blocks read in Python; 2048 full 128 KiB blocks make MAX_DECODED_BYTES


def _zstd_frame_size(blob: bytes) -> int:
    """Compressed size in bytes of the zstd frame at the start of `blob`, which must decompress
    within the caller's bound (call it after a bounded `decompress`): read from the block headers
    (RFC 8878 section 3.1.1: magic and frame header, 3-byte block headers, optional 4-byte
    checksum), or, for a frame of over _ZSTD_WALK_BLOCKS blocks (many tiny ones: not what a
    compressor writes), by decompressing it again with a decompression object.

    Raises:
        CodecError: not a zstd frame (a skippable frame included), a reserved block type, or a
            frame cut short. zstandard.ZstdError: an invalid frame.
    """
    if blob[:4] != _ZSTD_MAGIC:
        raise CodecError("not a zstd frame")
    checksum = 4 if len(blob) > 4 and blob[4] & 0x04 else 0  # Content_Checksum_flag of the descriptor
    pos = zstandard.frame_header_size(blob)  # magic included
    for _ in range(_ZSTD_WALK_BLOCKS):
        if pos + 3 > len(blob):
            raise CodecError("zstd frame cut short")
        header = int.from_bytes(blob[pos:pos + 3], "little")
        last, kind, size = header & 1, (header >> 1) & 3, header >> 3
        if kind == _ZSTD_BLOCK_RESERVED:
            raise CodecError("corrupt zstd frame: reserved block type")
        pos += 3 + (1 if kind == _ZSTD_BLOCK_RLE else size)
        if last:
            break
    else:  # in C: its output is the frame's, which the caller's bounded decompress already allowed
        stream = zstandard.ZstdDecompressor().decompressobj()
        stream.decompress(blob)
        if not stream.eof:
            raise CodecError("zstd frame cut short")
        return len(blob) - len(stream.unused_data)
    pos += checksum
    if pos > len(blob):
        raise CodecError("zstd frame cut short")
    return pos
