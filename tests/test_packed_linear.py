"""oneDNN-prepacked linear layers (shared/packed_linear.py): the same function as nn.Linear, the
same parameters, torch's own path wherever the packed one would compute something else, and
greedy-exact speculative decoding on a packed target."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from splitspec.client.loop import SpeculativeDecoder
from splitspec.server.local import LocalVerifier
from splitspec.server.runner import TargetRunner
from splitspec.shared import packed_linear
from splitspec.shared.packed_linear import PackedLinear, onednn_available, onednn_supports, pack_linears

from .helpers import OracleDrafter, reference_greedy
from .test_model_families import VOCAB, _model

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN prepacked linear")


def _linear(dtype=torch.float32, bias=True) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(48, 80, bias=bias).to(dtype).requires_grad_(False)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 48), (3, 48), (25, 48), (2, 7, 48)])
def test_packed_forward_is_the_linear_function(dtype, tol, bias, shape):
    linear = _linear(dtype, bias)
    x = torch.randn(shape).to(dtype)
    want = F.linear(x, linear.weight, linear.bias)
    if not onednn_supports(dtype):  # bf16 on an AVX2-only CPU: a clear refusal, and "auto" leaves the layer
        with pytest.raises(RuntimeError, match="cannot prepack"):
            pack_linears(linear, "onednn")
        assert pack_linears(linear) == 0 and type(linear) is nn.Linear
        return
    assert pack_linears(linear, "onednn") == 1 and isinstance(linear, PackedLinear)
    with torch.inference_mode():
        got = linear(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_packing_keeps_parameters_ties_and_state_dict():
    model = _model("llama-mqa-tied")
    keys = {k: v.clone() for k, v in model.state_dict().items()}
    head = model.lm_head.weight
    count = pack_linears(model)
    assert count == 4 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the LM head
    assert all(isinstance(m, PackedLinear) for m in model.modules() if isinstance(m, nn.Linear))
    assert model.lm_head.weight is head and model.lm_head.weight is model.model.embed_tokens.weight
    state = model.state_dict()
    assert state.keys() == keys.keys() and all(torch.equal(state[k], v) for k, v in keys.items())


def test_a_weight_changed_in_place_is_repacked():
    linear = PackedLinear.convert(_linear())
    x = torch.randn(3, 48)
    with torch.no_grad():
        linear(x)
        linear.weight.mul_(2.0)
        got = linear(x)
    torch.testing.assert_close(got, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


def test_a_weight_replaced_by_a_dtype_change_is_repacked():
    model = _model("qwen2")
    pack_linears(model, "onednn")
    model.to(torch.bfloat16)
    x = torch.randn(2, 3, model.config.hidden_size).to(torch.bfloat16)
    head = model.lm_head
    with torch.no_grad():
        got = head(x)
    torch.testing.assert_close(got.float(), F.linear(x, head.weight).float(), rtol=3e-2, atol=3e-2)
    assert (head._packed_key[1] == torch.bfloat16) == onednn_supports(torch.bfloat16)


def test_a_dtype_this_cpu_cannot_pack_runs_through_torch(monkeypatch):
    """A packed fp32 model turned bf16 where oneDNN cannot pack bf16 (an AVX2-only CPU; simulated
    here) computes F.linear instead of failing in the forward, and keeps its fp32 packing unused."""
    monkeypatch.setitem(packed_linear._DTYPE_SUPPORT, torch.bfloat16, False)
    model = _model("qwen2")
    pack_linears(model, "onednn")
    head = model.lm_head
    key = head._packed_key
    model.to(torch.bfloat16)
    x = torch.randn(2, 3, model.config.hidden_size).to(torch.bfloat16)
    with torch.no_grad():
        got = head(x)
    assert torch.equal(got, F.linear(x, head.weight)) and head._packed_key == key
    with pytest.raises(RuntimeError, match="cannot prepack"):
        pack_linears(_linear(torch.bfloat16), "onednn")


def test_a_copied_packed_module_packs_its_own_weight():
    """copy.deepcopy (and pickling) of a module with packed linears works: the copy leaves the
    oneDNN copy behind and packs its own weight on first use; the original keeps its packing."""
    import copy
    import pickle

    model = _model("qwen2")
    pack_linears(model, "onednn")
    head = model.lm_head
    packed_before = head._packed
    clone = copy.deepcopy(head)
    assert "_packed" not in clone.__dict__ and head._packed is packed_before
    x = torch.randn(2, 3, model.config.hidden_size)
    with torch.no_grad():
        want, got = head(x), clone(x)
    assert clone._packed is not packed_before
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(pickle.loads(pickle.dumps(head))(x), want, rtol=0, atol=0)


def test_autograd_and_autocast_take_torchs_path():
    linear = PackedLinear.convert(_linear())
    linear.requires_grad_(True)
    x = torch.randn(4, 48, requires_grad=True)
    linear(x).sum().backward()
    assert x.grad is not None and linear.weight.grad is not None
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear(torch.randn(4, 48)).dtype == torch.bfloat16


def test_backend_choice():
    model = _model("qwen2")
    assert pack_linears(model, "torch") == 0
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    with pytest.raises(ValueError, match="linear backend"):
        pack_linears(model, "mkl")
    with pytest.raises(RuntimeError, match="float16"):
        pack_linears(_model("qwen2").half(), "onednn")
    assert pack_linears(_model("qwen2").half()) == 0, "auto leaves what it cannot serve to torch"


def test_inference_tensor_weights_are_left_to_torch():
    """Weights made under torch.inference_mode track no version, so an in-place change could not be
    detected: "auto" leaves them to F.linear, "onednn" refuses by saying why."""
    with torch.inference_mode():
        module = nn.Sequential(nn.Linear(8, 4))
    assert pack_linears(module) == 0 and type(module[0]) is nn.Linear
    with pytest.raises(RuntimeError, match="inference_mode"):
        pack_linears(module, "onednn")


def test_environment_overrides_auto(monkeypatch):
    monkeypatch.setenv("SPLITSPEC_LINEAR", "torch")
    assert pack_linears(_model("qwen2")) == 0
    monkeypatch.setenv("SPLITSPEC_LINEAR", "onednn")
    assert pack_linears(_model("qwen2")) > 0
    monkeypatch.setenv("SPLITSPEC_LINEAR", "fast")
    with pytest.raises(ValueError, match="SPLITSPEC_LINEAR"):
        pack_linears(_model("qwen2"))


@pytest.mark.parametrize("family", ["llama-mqa-tied", "gemma3"])
def test_a_packed_target_decodes_exactly(family, stories):
    """Tree verification on a packed target equals that target's own greedy generate()."""
    model = _model(family)
    assert pack_linears(model, "onednn") > 0
    prompt = [1, 45, 100, 17, 99, 4, 250, 33, 71, 12]
    ref = reference_greedy(model, prompt, 40)
    runner = TargetRunner(model, stories[1], family)
    for right in (True, False):
        drafter = OracleDrafter(prompt, ref, VOCAB, right=right, depth=4, wrong_siblings=2)
        gen = SpeculativeDecoder(LocalVerifier(runner), drafter).generate(prompt, len(ref), stop_on_eos=False)
        assert gen.tokens == ref, f"{family} ({drafter.name}): output differs from the packed target's generate()"
