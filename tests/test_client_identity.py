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


def test_chat_defaults_come_from_the_servers_target(stories, serve, stories_path, tmp_path):
    """`chat` / `up` without --temperature / --top-p sample with the server's target's generation
    config in split mode, not the default target's (which was loaded, or installed, for it)."""
    import json
    import shutil

    from splitspec.cli.main import build_parser
    from splitspec.client.cli import client_config

    folder = tmp_path / "model"
    shutil.copytree(stories_path, folder)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.2, "top_p": 0.5}))
    model, tokenizer, _ = stories
    service = serve(TargetRunner(model, tokenizer, str(folder)))
    args = build_parser().parse_args(["chat", "--server", service.address, "--drafter", "ngram"])
    config = client_config(args)
    assert config.chat_defaults == ("temperature", "top_p")
    setup = build_client(config)
    try:
        assert (setup.sampling.temperature, setup.sampling.top_p) == (0.2, 0.5)
    finally:
        setup.decoder.verifier.close()
    flagged = client_config(build_parser().parse_args(["chat", "--server", service.address, "--top-p", "0.8"]))
    assert flagged.chat_defaults == ("temperature",) and flagged.sampling.top_p == 0.8


def test_a_tokenizer_with_other_merges_is_refused(stories, serve, stories_path, tmp_path):
    """Same vocabulary and special tokens, a quarter of the BPE merges: the prompt splits into other
    ids, so the answer would not be the target's. The fingerprint covers how text tokenizes."""
    import json
    import shutil

    from splitspec.shared.models import load_tokenizer

    folder = tmp_path / "tweaked"
    shutil.copytree(stories_path, folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["model"]["merges"] = spec["model"]["merges"][: len(spec["model"]["merges"]) // 4]
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    model, tokenizer, model_id = stories
    tweaked = load_tokenizer(str(folder))
    assert tweaked.get_vocab() == tokenizer.get_vocab()
    assert tweaked.encode("Once upon a time") != tokenizer.encode("Once upon a time")
    assert tokenizer_fingerprint(tweaked) != tokenizer_fingerprint(tokenizer)
    service = serve(TargetRunner(model, tokenizer, model_id))
    with pytest.raises(ValueError, match="differs from the server's target"):
        build_client(_config(service.address, target=str(folder)))
