"""User mistakes at `splitspec serve` and model loading that the QA pass of the verify service found
(notes/qa-server.md findings 3, 4 and 6): each is refused with a one-line error that names the
flag or the model, at once and before any model loads."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

from splitspec.cli.main import main
from splitspec.server import cli as server_cli
from splitspec.shared import models
from splitspec.shared.config import ServerLimits


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fails the test if `splitspec serve` gets as far as loading its model."""
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the mistake was refused")

    monkeypatch.setattr(server_cli, "load_model", load)


@pytest.mark.parametrize("flag,value,message", [
    ("--port", "99999", "99999 must lie in 0..65535"),  # gRPC listened on 99999 - 65536 = 34463
    ("--port", "-1", "-1 must lie in 0..65535"),
    ("--port", "http", "'http' is not a port number"),
    ("--metrics-port", "65536", "65536 must lie in 0..65535"),
])
def test_serve_refuses_a_port_outside_the_tcp_range(flag, value, message, no_model_loads, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["serve", flag, value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: {message}" in err and "Traceback" not in err
    assert server_cli.port_number("0") == 0 and server_cli.port_number("65535") == 65535


def test_the_service_refuses_a_port_outside_the_tcp_range_before_binding():
    from splitspec.server.service import serve

    with pytest.raises(ValueError, match="port 70000 must lie in 0..65535"):
        asyncio.run(serve(None, "127.0.0.1", 70000, ServerLimits()))
    with pytest.raises(ValueError, match="metrics port 65536"):
        asyncio.run(serve(None, "127.0.0.1", 0, ServerLimits(), metrics_port=65536))


def test_device_cuda_without_cuda_is_a_user_error_before_the_model_loads(stories_path, no_model_loads, monkeypatch,
                                                                         capsys):
    """torch raised AssertionError ("Torch not compiled with CUDA enabled") after the model had
    loaded, and the command ended with a traceback and status 1."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["serve", "--port", "0", "--target", str(stories_path), "--device", "cuda"]) == 2
    assert capsys.readouterr().err.strip() == \
        "splitspec: error: --device cuda: this torch has no CUDA (torch.cuda.is_available() is False)"
    with pytest.raises(ValueError, match="no CUDA"):  # wherever a model loads: --local, drafters, training
        models.load_model(str(stories_path), device="cuda")
    assert main(["generate", "--local", "--target", str(stories_path), "--drafter", "ngram", "--prompt", "Once",
                 "--max-new-tokens", "2", "--device", "cuda"]) == 2
    assert "--device cuda: this torch has no CUDA" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    models.check_device("cuda:0")
    with pytest.raises(ValueError, match="--device cuda:3: this machine has 1 CUDA device"):
        models.check_device("cuda:3")
    with pytest.raises(ValueError, match="--device gpu"):
        models.check_device("gpu")
    models.check_device("cpu")


@pytest.fixture
def hub_unreachable(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(models, "hub_reachable", lambda timeout_s=models.HUB_PROBE_TIMEOUT_S: False)


def test_a_model_that_is_nowhere_fails_at_once_naming_itself(hub_unreachable, capsys):
    """Without network, transformers retried the hub for ~47 s and then blamed the connection
    without naming the model. Now the local cache is looked at first and the hub only when it
    answers."""
    name = "nonexistent-model-xyz"
    tic = time.monotonic()
    for load in (models.load_model, models.load_tokenizer):
        with pytest.raises(ValueError, match=f"model {name}: not an alias, a local folder .* the hub is unreachable"):
            load(name)
    assert models.chat_sampling_defaults(name) == (models.CHAT_TEMPERATURE, models.CHAT_TOP_P)
    assert main(["generate", "--local", "--target", name, "--drafter", "ngram", "--prompt", "hi",
                 "--max-new-tokens", "2"]) == 2
    assert f"splitspec: error: model {name}: " in capsys.readouterr().err
    assert time.monotonic() - tic < 20


def test_a_hub_id_not_in_the_cache_still_comes_from_the_hub(tmp_path, monkeypatch):
    """Any Hugging Face id still loads where the hub answers: the cache first, then the hub; what
    the hub refuses is named; a local folder and a cached id never touch the network."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    calls = []

    def loader(cached: bool, hub_error: str | None = None):
        def load(path, local_files_only=False, **kwargs):
            calls.append((path, local_files_only, kwargs))
            if local_files_only and not cached:
                raise OSError("not in the cache")
            if hub_error is not None:
                raise OSError(hub_error)
            return "loaded"
        return load

    def probe_forbidden(timeout_s=0.0):
        raise AssertionError("the hub was probed")

    monkeypatch.setattr(models, "hub_reachable", probe_forbidden)
    assert models._from_pretrained(loader(cached=False), str(tmp_path), "mine", dtype="x") == "loaded"
    assert calls == [(str(tmp_path), False, {"dtype": "x"})]
    calls.clear()
    assert models._from_pretrained(loader(cached=True), "org/model", "org/model") == "loaded"
    assert calls == [("org/model", True, {})]
    calls.clear()
    monkeypatch.setattr(models, "hub_reachable", lambda timeout_s=0.0: True)
    assert models._from_pretrained(loader(cached=False), "org/model", "org/model@layers=2", dtype="x") == "loaded"
    assert calls == [("org/model", True, {"dtype": "x"}), ("org/model", False, {"dtype": "x"})]
    with pytest.raises(ValueError, match="model org/nope: .* hub could not provide it: 401 Client Error"):
        models._from_pretrained(loader(cached=False, hub_error="401 Client Error\nmore"), "org/nope", "org/nope")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE"):
        models._from_pretrained(loader(cached=False), "org/model", "org/model")


def test_hub_reachable_reports_a_closed_endpoint_quickly(monkeypatch):
    import socket

    from huggingface_hub import constants

    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key in ("https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    tic = time.monotonic()
    assert not models.hub_reachable(timeout_s=2.0)
    assert time.monotonic() - tic < 3
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{listening.getsockname()[1]}")
        assert models.hub_reachable(timeout_s=2.0)


def test_pull_obtains_something_or_says_why_not(hub_unreachable, tmp_path, capsys, stories_path):
    """`splitspec pull` printed a path and exited 0 for a name it could not obtain."""
    assert main(["pull", "nosuch-model-xyz"]) == 2
    assert "model nosuch-model-xyz: not an alias" in capsys.readouterr().err
    assert main(["pull", str(tmp_path / "missing.gguf")]) == 2
    assert "no such .gguf file" in capsys.readouterr().err
    assert main(["pull", f"{stories_path}@layers=2"]) == 0  # a local folder, with an option: as it is
    assert capsys.readouterr().out.strip().endswith(str(stories_path))


def test_a_local_folder_may_hold_an_at_sign(tmp_path, stories_path):
    import shutil

    folder = tmp_path / "st@ries"
    shutil.copytree(stories_path, folder)
    assert models.ModelSpec.parse(str(folder)) == models.ModelSpec(str(folder))
    assert models.ModelSpec.parse(f"{folder}@layers=2") == models.ModelSpec(str(folder), 2)
    assert models.ModelSpec.parse("org/model@layers=3") == models.ModelSpec("org/model", 3)
    with pytest.raises(ValueError, match="bad model option"):
        models.ModelSpec.parse("org/model@layers=0")
    with pytest.raises(ValueError, match="bad model option"):  # int() reads it, but it is no N
        models.ModelSpec.parse("org/model@layers=\uff13")
    with pytest.raises(ValueError, match="one @layers=N option at most"):
        models.ModelSpec.parse("org/model@layers=3@layers=2")
    models.load_tokenizer(str(folder))
