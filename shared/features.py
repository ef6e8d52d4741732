"""Features: the target activations a drafter needs per committed position, and their wire form.

Hidden states of the committed positions (EAGLE's last hidden state), and per-layer keys/values
(MoA's Layer Self-Attention input, TLI's last layers). On the wire each is a `Tensor`, quantized
(fp16 reference, int8 absmax, fp8 e4m3) and zstd-compressed by shared/codec.py.
Features are drafting hints (the target verifies every token), so activations that cannot travel
as they are (NaN, +-inf, beyond fp16's range for the fp16 reference) are clamped rather than
refused, and a reply's features are checked against its `count` before anything is inflated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from splitspec.v1 import verify_pb2 as pb

from . import codec

MAX_FEATURE_WIDTH = 2**16  # elements per position of one tensor (hidden E, or Hkv x D of keys / values)
MAX_FEATURE_BYTES = 2 * 2**30  # decoded bytes of one Features message, in the dtype asked of `from_pb`
_FLOAT_DTYPES = (pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16)


@dataclass(frozen=True)
class FeatureRequest:
    """Which activations to return per committed position (FeatureSpec in verify.proto).

    `hidden_layers` index transformers' `hidden_states` tuple: 0 = embeddings, i = output of
    decoder layer i, -1 (or L) = the last hidden state after the final norm. `kv_layers` are
    0-based decoder layers whose cached keys/values are returned.
    """

    hidden_layers: tuple[int, ...] = ()
    kv_layers: tuple[int, ...] = ()
    quantization: int = pb.QUANTIZATION_NONE
    codec: int = pb.CODEC_ZSTD
    lsa_id: str = ""  # run this MoA drafter's LSA on the server

    def to_pb(self) -> pb.FeatureSpec:
        return pb.FeatureSpec(hidden_layers=self.hidden_layers, kv_layers=self.kv_layers,
                              quantization=self.quantization, codec=self.codec, lsa_id=self.lsa_id)

    @classmethod
    def from_pb(cls, msg: pb.FeatureSpec) -> "FeatureRequest":
        return cls(tuple(msg.hidden_layers), tuple(msg.kv_layers),
                   msg.quantization or pb.QUANTIZATION_NONE, msg.codec or pb.CODEC_ZSTD, msg.lsa_id)


@dataclass
class FeatureBatch:
    """Activations for positions [start, start + count).

    hidden: layer -> [count, E]; keys / values: layer -> [Hkv, count, D]; lsa: [count, E] or None.
    """

    start: int
    count: int
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    lsa: torch.Tensor | None = None

    @classmethod
    def concat(cls, batches: list["FeatureBatch"]) -> "FeatureBatch":
        """Join the batches of consecutive positions (a chunked prefill's) into one.

        Raises:
            ValueError: no batch, positions that do not follow on, or batches holding different layers.
        """
        if not batches:
            raise ValueError("FeatureBatch.concat needs at least one batch")
        if len(batches) == 1:
            return batches[0]
        first = batches[0]
        for before, after in zip(batches, batches[1:]):
            if after.start != before.start + before.count:
                raise ValueError(f"feature batches must follow on: positions {before.start}+{before.count}, "
                                 f"then {after.start}")
        for b in batches[1:]:
            if (b.hidden.keys(), b.keys.keys(), b.values.keys(), b.lsa is None) != \
                    (first.hidden.keys(), first.keys.keys(), first.values.keys(), first.lsa is None):
                raise ValueError("feature batches to join must hold the same layers")
        return cls(first.start, sum(b.count for b in batches),
                   hidden={k: torch.cat([b.hidden[k] for b in batches]) for k in first.hidden},
                   keys={k: torch.cat([b.keys[k] for b in batches], dim=1) for k in first.keys},
                   values={k: torch.cat([b.values[k] for b in batches], dim=1) for k in first.values},
                   lsa=None if first.lsa is None else torch.cat([b.lsa for b in batches]))

    def to_pb(self, request: FeatureRequest) -> pb.Features:
        """Encode; unquantized floats travel as fp16. Values that cannot travel are clamped, so an
        overflowing activation still gives decodable features: NaN -> 0; for the fp16 reference,
        +-inf and values beyond +-65504 -> +-65504; when quantized, +-inf -> the largest finite
        value of the tensor's dtype (its row then carries little else).

        Raises:
            codec.CodecError: the request's quantization or codec is unknown (`codec.encode`).
        """
        def enc(t: torch.Tensor) -> pb.Tensor:
            if request.quantization == pb.QUANTIZATION_NONE:
                t = t.to(torch.float16)  # beyond +-65504 (+ half an ulp) -> +-inf, mapped below
            if t.is_floating_point() and not torch.isfinite(t).all():
                t = torch.nan_to_num(t, nan=0.0)  # +-inf -> +-finfo(t.dtype).max (65504 for fp16)
            return codec.encode(t, request.quantization, request.codec)

        msg = pb.Features(
            start=self.start, count=self.count,
            hidden=[pb.LayerTensor(layer=k, tensor=enc(v)) for k, v in self.hidden.items()],
            keys=[pb.LayerTensor(layer=k, tensor=enc(v)) for k, v in self.keys.items()],
            values=[pb.LayerTensor(layer=k, tensor=enc(v)) for k, v in self.values.items()])
        if self.lsa is not None:
            msg.lsa.CopyFrom(enc(self.lsa))
        return msg

    @classmethod
    def from_pb(cls, msg: pb.Features, dtype: torch.dtype = torch.float32, *,
                request: FeatureRequest | None = None, hidden_size: int | None = None,
                max_bytes: int = MAX_FEATURE_BYTES) -> "FeatureBatch":
        """Decode to `dtype` (quantized tensors are dequantized in float32 and rounded once).

        Every declared shape is checked before anything is inflated: hidden [count, E] with one E
        for all layers (= `hidden_size` when given), keys and values [Hkv, count, D] with one
        (Hkv, D) for all layers and the same layers for both, lsa [count, E'], float dtypes, no
        layer twice, E, E' and Hkv x D <= MAX_FEATURE_WIDTH, and in all at most `max_bytes` decoded
        in `dtype`; with `request`, the layers (and the lsa tensor) must be the requested ones.
        Each tensor is then decoded with max_numel = count x its checked width.

        Raises:
            codec.CodecError: a malformed tensor, or shapes / layers that disagree with the above
                (codec.TensorTooLarge when over MAX_FEATURE_WIDTH or `max_bytes`).
        """
        count = msg.count
        if count < 0 or msg.start < 0:
            raise codec.CodecError(f"features: start {msg.start} and count {count} must be >= 0")
        tensors = [("hidden", item.layer, item.tensor) for item in msg.hidden]
        tensors += [(kind, item.layer, item.tensor) for kind, items in (("keys", msg.keys), ("values", msg.values))
                    for item in items]
        if msg.HasField("lsa"):
            tensors.append(("lsa", None, msg.lsa))
        layers = {kind: [layer for k, layer, _ in tensors if k == kind] for kind in ("hidden", "keys", "values")}
        for kind, found in layers.items():
            if len(set(found)) != len(found):
                raise codec.CodecError(f"features: a {kind} layer is sent twice")
        if set(layers["keys"]) != set(layers["values"]):
            raise codec.CodecError("features: keys and values are sent for different layers")
        if request is not None and (set(layers["hidden"]) != set(request.hidden_layers)
                                    or set(layers["keys"]) != set(request.kv_layers)
                                    or msg.HasField("lsa") != bool(request.lsa_id)):
            raise codec.CodecError("features: the layers sent are not the ones requested")
        widths: dict[str, tuple[int, ...]] = {}  # per group: the declared shape without the count axis
        if hidden_size is not None:
            widths["hidden"] = (hidden_size,)
        total = 0
        for kind, layer, tensor in tensors:
            shape = tuple(tensor.shape)
            what = f"features: {kind}" + ("" if layer is None else f" of layer {layer}")
            if tensor.dtype not in _FLOAT_DTYPES:
                raise codec.CodecError(f"{what}: a feature tensor must have a float dtype")
            axis = 1 if kind in ("keys", "values") else 0
            if len(shape) != axis + 2 or shape[axis] != count:
                raise codec.CodecError(f"{what}: shape {codec.describe_shape(shape)} is not "
                                       f"{f'[Hkv, count={count}, D]' if axis else f'[count={count}, E]'}")
            width = shape[:axis] + shape[axis + 1:]
            group = "kv" if axis else kind
            if widths.setdefault(group, width) != width:
                raise codec.CodecError(f"{what}: shape {shape} differs in width from {widths[group]} "
                                       f"(of the other layers, or the hidden size)")
            if min(width) < 0 or math.prod(width) > MAX_FEATURE_WIDTH:
                raise codec.TensorTooLarge(f"{what}: shape {shape} is not 0..{MAX_FEATURE_WIDTH} elements "
                                           f"wide per position")
            total += count * math.prod(width) * dtype.itemsize
        if total > max_bytes:
            raise codec.TensorTooLarge(f"features of {count} positions need {total} bytes decoded; "
                                       f"the limit is {max_bytes}")

        def dec(tensor: pb.Tensor) -> torch.Tensor:
            return codec.decode(tensor, max_numel=math.prod(tensor.shape), as_dtype=dtype)

        out = cls(msg.start, count)
        groups = {"hidden": out.hidden, "keys": out.keys, "values": out.values}
        for kind, layer, tensor in tensors:
            if kind == "lsa":
                out.lsa = dec(tensor)
            else:
                groups[kind][layer] = dec(tensor)
        return out
