"""The client takes the target's identity from the server's `Info` (issue 11): in split mode
`--target` is needed only where the server's model cannot be loaded here."""
from __future__ import annotations

import pytest

from splitspec.client.build import ClientConfig, build_client
from splitspec.shared.drafters.spec import DrafterSpec
from splitspec.server.runner import TargetRunner
from splitspec.shared.models import tokenizer_fingerprint, tokenizer_source


def test_tokenizer_source_maps_the_upstream_id_back_to_the_alias():
    assert tokenizer_source("HuggingFaceTB/SmolLM2-135M-Instruct") == "smollm2-135m"
    assert tokenizer_source("HuggingFaceTB/SmolLM2-135M-Instruct@layers=4") == "smollm2-135m@layers=4"
    assert tokenizer_source("/models/my-llama") == "/models/my-llama"


def _config(address, target=None):
    return ClientConfig(target, DrafterSpec.parse("ngram"), server=address, connect_timeout_s=30.0)


def test_split_mode_without_target_uses_the_servers_model(stories, serve):
    model, tokenizer, model_id = stories  # model_id: the folder the tokenizer loads from
    service = serve(TargetRunner(model, tokenizer, model_id))
    setup = build_client(_config(service.address))
    try:
        assert setup.target == model_id
        assert tokenizer_fingerprint(setup.tokenizer) == tokenizer_fingerprint(tokenizer)
        assert setup.decoder.generate(tokenizer.encode("Once upon a time"), 5).tokens
    finally:
        setup.decoder.verifier.close()


def test_a_server_model_unknown_here_asks_for_target(stories, serve):
    model, tokenizer, _ = stories
    service = serve(TargetRunner(model, tokenizer, "/no/such/model-folder"))
    with pytest.raises(ValueError, match="(?s)/no/such/model-folder.*pass --target"):
        build_client(_config(service.address))
    setup = build_client(_config(service.address, target=tokenizer.name_or_path))  # named: it works
    setup.decoder.verifier.close()
