"""Features: the target activations a drafter needs per committed position, and their wire form.

Hidden states of the committed positions (EAGLE's last hidden state), and per-layer keys/values
(MoA's Layer Self-Attention input, TLI's last layers). On the wire each is a `Tensor`, quantized
(fp16 reference, int8 absmax, fp8 e4m3) and zstd-compressed by shared/codec.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from splitspec.v1 import verify_pb2 as pb

from . import codec


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

    def to_pb(self, request: FeatureRequest) -> pb.Features:
        """Encode; unquantized floats travel as fp16.

        Raises:
            codec.CodecError: the request's quantization or codec is unknown (`codec.encode`).
        """
        def enc(t: torch.Tensor) -> pb.Tensor:
            if request.quantization == pb.QUANTIZATION_NONE:
                t = t.to(torch.float16)
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
    def from_pb(cls, msg: pb.Features, dtype: torch.dtype = torch.float32) -> "FeatureBatch":
        """Decode to `dtype`. Raises codec.CodecError on a malformed tensor."""
        def dec(items) -> dict[int, torch.Tensor]:
            return {item.layer: codec.decode(item.tensor).to(dtype) for item in items}

        lsa = codec.decode(msg.lsa).to(dtype) if msg.HasField("lsa") else None
        return cls(msg.start, msg.count, dec(msg.hidden), dec(msg.keys), dec(msg.values), lsa)
