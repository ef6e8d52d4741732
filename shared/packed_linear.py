"""Linear layers with oneDNN-prepacked weights for CPU inference.

On the x86 CPUs measured here (2-core AMD EPYC, torch 2.13 CPU build), `F.linear` goes to MKL's
sgemm, which is slow for the few-row products a decode step or a small tree verify makes (2-3 rows
cost 1.5-2x one row: the LM head alone, [V=49152, 576], dominates), while oneDNN's matmul on a
weight reordered once into its blocked layout runs 1-25 rows at 0.4-0.7x MKL's time and a
2048-row training batch at ~0.8x (`splitspec verify-cost` measures the whole forward both ways).
This is the weight-prepacking PyTorch's inductor does for CPU linears under `freezing`; here it is
applied to an eager model in place, so no compile step and no recompiles per tree shape.

`pack_linears(model)` turns every `nn.Linear` into a `PackedLinear` (same module, same `weight`
Parameter, so tied weights, `state_dict` and code that reads `.weight` are unchanged) that keeps a
prepacked copy beside the weight (memory: one more copy of the linear weights). Its forward takes
the prepacked path only where that computes the same function: CPU input of the weight's dtype, no
autograd through the layer, no autocast; a weight changed since it was packed (in place, or
replaced by `.to(dtype)`) is packed again first, unless this CPU's oneDNN cannot pack the new
dtype (`onednn_supports`: bf16 on an AVX2-only CPU), where the layer runs `F.linear`. Everywhere
else it is `nn.Linear.forward`.

Rounding: oneDNN sums in another order than MKL, so logits differ in the last bits (4e-5 to 8e-5 on
SmolLM2-135M fp32). Lossless decoding compares a verifier with the same model's own decoding, so
both sides must use the same kernels: `load_model` packs by default, and `--linear torch` (or
`SPLITSPEC_LINEAR=torch`) keeps MKL everywhere.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

LINEAR_BACKENDS = ("auto", "onednn", "torch")
_BATCH_HINT = 4  # rows oneDNN's weight layout is chosen for; 1-32 measured alike for 1-25 rows


def onednn_available() -> bool:
    """True when this torch build has the prepacked-linear ops (x86 CPU builds with mkldnn)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


_DTYPE_SUPPORT: dict[torch.dtype, bool] = {}


def onednn_supports(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN can prepack a linear weight of `dtype`, probed once per dtype and
    process. bf16 needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: on an AVX2-only CPU (most laptops;
    the project's session-45 EPYC) the reorder raises, and bf16 layers stay on `F.linear`."""
    if dtype not in _DTYPE_SUPPORT:
        supported = onednn_available()
        if supported:
            try:
                with torch.no_grad():
                    torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), _BATCH_HINT)
            except RuntimeError:
                supported = False
        _DTYPE_SUPPORT[dtype] = supported
    return _DTYPE_SUPPORT[dtype]


class PackedLinear(nn.Linear):
    """`nn.Linear` plus a oneDNN-prepacked copy of its weight for CPU inference (see module doc).

    Shapes as `nn.Linear`: x [..., in_features] -> [..., out_features].
    """

    _packed: torch.Tensor | None
    _packed_key: tuple  # the weight's storage, dtype and version when it was packed

    @classmethod
    def convert(cls, linear: nn.Linear) -> "PackedLinear":
        """Make `linear` a PackedLinear in place (its class changes; its parameters stay). Where this
        CPU cannot pack the weight's dtype (`onednn_supports`) it stays unpacked and runs `F.linear`."""
        linear.__class__ = cls
        linear._packed, linear._packed_key = None, None
        if onednn_supports(linear.weight.dtype):
            linear._pack()
        return linear

    def __getstate__(self) -> dict:
        """Copies (`copy.deepcopy`, pickling) leave the oneDNN copy out (an opaque tensor that can be
        neither copied nor pickled); the copy packs its own weight on its first forward."""
        state = self.__dict__.copy()
        state.pop("_packed", None)
        state["_packed_key"] = None
        return state

    def _pack(self) -> None:
        with torch.no_grad():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), _BATCH_HINT)
        self._packed_key = self._weight_key()

    def _weight_key(self) -> tuple:
        weight = self.weight
        return weight.data_ptr(), weight.dtype, weight._version

    def _usable(self, x: torch.Tensor) -> bool:
        weight = self.weight  # checked once per call: keep it to attribute reads (~14k calls per 100 tokens)
        if not (x.is_cpu and weight.is_cpu) or x.dtype != weight.dtype:
            return False
        if torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad):
            return False
        return not torch.is_autocast_enabled("cpu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._usable(x):
            return F.linear(x, self.weight, self.bias)
        if self._packed_key != self._weight_key():  # changed in place, or replaced by `.to(dtype)` / `load_state_dict`
            if not onednn_supports(self.weight.dtype):  # e.g. bf16 on an AVX2-only CPU: the same function via torch
                return F.linear(x, self.weight, self.bias)
            self._pack()
        shape = x.shape
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), self._packed, self.bias, "none", [], "")
        return out.view(*shape[:-1], self.out_features)


def pack_linears(module: nn.Module, backend: str = "auto") -> int:
    """Prepack every `nn.Linear` of a CPU `module` for oneDNN, in place; returns how many.

    backend: "auto" packs when the ops exist, the module is on the CPU in float32 or bfloat16 and a
    probe product agrees with `F.linear` (else leaves it, with a log line); "onednn" packs or raises;
    "torch" leaves every layer as it is. The environment variable SPLITSPEC_LINEAR overrides "auto".

    Raises:
        ValueError: an unknown backend.
        RuntimeError: backend "onednn" where it cannot be used.
    """
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear backend {backend!r}: expected one of {', '.join(LINEAR_BACKENDS)}")
    if backend == "auto":
        backend = os.environ.get("SPLITSPEC_LINEAR", "auto")
        if backend not in LINEAR_BACKENDS:
            raise ValueError(f"SPLITSPEC_LINEAR={backend!r}: expected one of {', '.join(LINEAR_BACKENDS)}")
    if backend == "torch":
        return 0
    linears = [m for m in module.modules() if type(m) is nn.Linear]
    if not linears:
        return 0
    reason = _unusable(linears)
    if reason:
        if backend == "onednn":
            raise RuntimeError(f"--linear onednn: {reason}")
        log.info("linear layers left to torch: %s", reason)
        return 0
    for linear in linears:
        PackedLinear.convert(linear)
    return len(linears)


def _unusable(linears: list[nn.Linear]) -> str | None:
    """Why the prepacked path cannot serve these layers, or None."""
    if not onednn_available():
        return "this torch build has no oneDNN prepacked linear"
    for linear in linears:
        if linear.weight.device.type != "cpu":
            return f"a weight on {linear.weight.device}"
        if linear.weight.dtype not in (torch.float32, torch.bfloat16):
            return f"a {linear.weight.dtype} weight"
        if linear.weight.is_inference():  # no version counter: a later in-place change could not be seen
            return "a weight created under torch.inference_mode (load the model outside it)"
    probe = linears[0]
    if not onednn_supports(probe.weight.dtype):
        return f"this CPU's oneDNN cannot prepack {probe.weight.dtype} weights (bf16 needs AVX-512 or AVX-NE-CONVERT)"
    try:
        with torch.no_grad():
            x = torch.randn(3, probe.in_features, generator=torch.Generator().manual_seed(0)).to(probe.weight.dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(probe.weight.detach(), _BATCH_HINT)
            got = torch.ops.mkldnn._linear_pointwise(x, packed, probe.bias, "none", [], "").float()
            want = F.linear(x, probe.weight, probe.bias).float()
    except RuntimeError as exc:
        return f"the probe product failed ({exc})"
    tolerance = 1e-3 if probe.weight.dtype == torch.float32 else 5e-2
    if not torch.allclose(got, want, rtol=tolerance, atol=tolerance):
        return f"the probe product differs from F.linear by {(got - want).abs().max().item():.3g}"
    return None
