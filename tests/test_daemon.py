"""The client daemon (`splitspec up`) and its OpenAI-compatible API, spoken to by real clients: the
official `openai` package (streaming and not), httpx and curl. Greedy output through the API is
the target's own, in single-device and split mode and across a link failure; bad requests get
OpenAI-style errors; a second request waits or is refused, never interleaved; a client leaving
mid-stream cancels its answer and the daemon serves on."""
from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from splitspec.client.build import ClientConfig, ClientSetup, build_client  # noqa: E402
from splitspec.client.daemon.cli import DaemonServer, daemon_app  # noqa: E402
from splitspec.client.drafters import DraftModelDrafter, NgramDrafter  # noqa: E402
from splitspec.client.loop import OFFLINE, SpeculativeDecoder  # noqa: E402
from splitspec.server.local import LocalVerifier  # noqa: E402
from splitspec.server.runner import TargetRunner  # noqa: E402
from splitspec.shared.config import TreeConfig  # noqa: E402
from splitspec.shared.drafters.spec import DrafterSpec  # noqa: E402
from splitspec.shared.models import encode_chat, load_model  # noqa: E402
from splitspec.shared.sampling import SamplingParams  # noqa: E402

from .helpers import FAST, FlakyVerifier, reference_greedy  # noqa: E402

PROMPT = "Once upon a time"
N_NEW = 24


@pytest.fixture(scope="module")
def runner(stories):
    model, tokenizer, model_id = stories
    return TargetRunner(model, tokenizer, model_id)


def _local_setup(runner, decoder_cls=SpeculativeDecoder, verifier=None, drafter=None) -> ClientSetup:
    decoder = decoder_cls(verifier or LocalVerifier(runner), drafter or NgramDrafter(), FAST)
    return ClientSetup(decoder, runner.tokenizer, SamplingParams(0.7, 0.9), "single-device")


@pytest.fixture
def start(stories_path):
    """start(setup, **daemon_app kwargs) -> the running DaemonServer on a free port, stopped at teardown."""
    started = []

    def go(setup, **kw) -> DaemonServer:
        kw.setdefault("max_request_bytes", 64 * 1024)
        started.append(DaemonServer(daemon_app(setup, str(stories_path), **kw), port=0).start())
        return started[-1]

    yield go
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def expected(stories):
    """expected(content, n) -> the target's greedy answer text to one user message (EOS cut)."""
    model, tokenizer, _ = stories

    def answer(content: str, n: int = N_NEW) -> str:
        prompt = encode_chat(tokenizer, [{"role": "user", "content": content}])
        ref = reference_greedy(model, prompt, n)
        ref = ref[: ref.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in ref else ref
        return tokenizer.decode(ref, skip_special_tokens=True)

    return answer


def _client(server: DaemonServer, key: str = "unused") -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)


def _post(server: DaemonServer, body, **kw) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{server.url}/v1/chat/completions", content=content, timeout=120,
                      headers={"Content-Type": "application/json", **kw.pop("headers", {})}, **kw)


def _request(model: str, content: str = PROMPT, **fields) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": N_NEW, **fields}


def _replay(chunks: list[dict]) -> str:
    """The answer text a UI shows after applying every delta and retraction of a stream."""
    text = ""
    for chunk in chunks:
        for choice in chunk.get("choices", []):
            ext = choice["delta"].get("splitspec") or {}
            if ext.get("event") == "retract":
                text = text[: ext["offset"]]
            elif "source" in ext:
                assert ext["offset"] == len(text)
                text += choice["delta"]["content"]
    return text


def test_openai_client_greedy_equals_target_streaming_and_not(runner, start, stories_path, expected):
    server = start(_local_setup(runner))
    client, want = _client(server), expected(PROMPT)
    models = client.models.list()
    assert [m.id for m in models.data] == [runner.model_id]
    reply = client.chat.completions.create(model=str(stories_path), messages=[{"role": "user", "content": PROMPT}],
                                           temperature=0, max_tokens=N_NEW)
    assert reply.choices[0].message.content == want and reply.choices[0].finish_reason in ("stop", "length")
    ext = reply.model_extra["splitspec"]
    assert ext["stats"]["target_calls"] >= 1 and ext["stats"]["tau"] >= 1 and ext["sources"]["offline"] == 0
    assert reply.usage.completion_tokens == ext["stats"]["new_tokens"] and reply.usage.prompt_tokens > 0
    stream = client.chat.completions.create(model=runner.model_id, messages=[{"role": "user", "content": PROMPT}],
                                            temperature=0, max_tokens=N_NEW, stream=True,
                                            stream_options={"include_usage": True})
    chunks = [chunk.model_dump() for chunk in stream]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == want
    assert _replay(chunks) == want
    assert chunks[-2]["choices"][0]["finish_reason"] == reply.choices[0].finish_reason
    assert chunks[-2]["splitspec"]["stats"]["new_tokens"] == reply.usage.completion_tokens
    assert chunks[-1]["usage"]["completion_tokens"] == reply.usage.completion_tokens
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["link"] == "up" and health["requests"]["completed"] == 2


def test_curl_sees_sse_framing(runner, start, expected):
    if shutil.which("curl") is None:
        pytest.skip("curl not installed")
    server = start(_local_setup(runner))
    body = json.dumps(_request(runner.model_id, stream=True))
    out = subprocess.run(["curl", "-sS", "-N", "-X", "POST", f"{server.url}/v1/chat/completions", "-H",
                          "Content-Type: application/json", "-d", body], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("data: ") and out.stdout.endswith("data: [DONE]\n\n")
    events = out.stdout.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert _replay(chunks) == expected(PROMPT)


def test_stop_strings_cut_the_answer(runner, start, expected):
    server = start(_local_setup(runner))
    want = expected(PROMPT)
    stop = want[len(want) // 2: len(want) // 2 + 3]
    cut = want[: want.index(stop)]
    reply = _post(server, _request(runner.model_id, stop=[stop])).json()
    assert reply["choices"][0]["message"]["content"] == cut and reply["choices"][0]["finish_reason"] == "stop"
    chunks = [c.model_dump() for c in _client(server).chat.completions.create(
        **_request(runner.model_id, stop=stop), stream=True)]
    assert _replay(chunks) == cut and chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_private_spans_by_field_and_by_tag_alike(runner, start):
    server = start(_local_setup(runner))
    content = "Lily met a zqx cat"
    by_tag = _post(server, _request(runner.model_id, "Lily met a <private>zqx</private> cat")).json()
    field = {"model": runner.model_id, "temperature": 0, "max_tokens": 8, "messages": [
        {"role": "user", "content": content, "splitspec": {"private_spans": [[11, 14]]}}]}
    by_field = _post(server, field).json()
    assert by_field["splitspec"]["private_prompt_tokens"] == by_tag["splitspec"]["private_prompt_tokens"] > 0
    assert by_field["choices"][0]["message"]["content"] == by_tag["choices"][0]["message"]["content"][
        : len(by_field["choices"][0]["message"]["content"])]
    whole = _post(server, {**field, "messages": [{"role": "user", "content": content,
                                                 "splitspec": {"private": True}}]}).json()
    assert whole["splitspec"]["private_prompt_tokens"] > by_field["splitspec"]["private_prompt_tokens"]


@pytest.mark.parametrize("body, status, param, code", [
    (b"{not json", 400, None, None),
    ({"model": "M", "messages": []}, 400, "messages", "invalid_value"),
    ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "temperature": 3}, 400, "temperature",
     "invalid_value"),
    ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n", "invalid_value"),
    ({"model": "M", "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role", "invalid_value"),
    ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]}, 400, "stop",
     "invalid_value"),
    ({"model": "M", "messages": [{"role": "user", "content": "<private>hi"}]}, 400, "messages.0.content",
     "invalid_value"),
    ({"model": "M", "messages": [{"role": "user", "content": "hi", "splitspec": {"private_spans": [[1, 9]]}}]},
     400, "messages.0.splitspec.private_spans", "invalid_value"),
    ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404, "model", "model_not_found"),
    ({"model": "M", "messages": [{"role": "user", "content": "hi " * 2000}]}, 400, "messages",
     "context_length_exceeded"),
    ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}, 400, "messages",
     "context_length_exceeded"),
    ({"model": "M", "messages": [{"role": "user", "content": "x" * 70000}]}, 413, None, "request_too_large"),
])
def test_bad_requests_get_openai_errors(runner, start, body, status, param, code):
    server = start(_local_setup(runner))
    if isinstance(body, dict):
        body = {**body, "model": runner.model_id if body["model"] == "M" else body["model"]}
    reply = _post(server, body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["code"] == code


def test_openai_client_raises_on_refusals(runner, start):
    server = start(_local_setup(runner))
    with pytest.raises(openai.NotFoundError):
        _client(server).chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        _client(server).chat.completions.create(model=runner.model_id, messages=[{"role": "user", "content": "hi"}],
                                                top_p=0)


def test_api_key_is_required_when_set(runner, start):
    server = start(_local_setup(runner), api_key="s3cret")
    body = _request(runner.model_id, max_tokens=2)
    assert _post(server, body).status_code == 401
    assert _post(server, body, headers={"Authorization": "Bearer wrong"}).json()["error"]["code"] == "invalid_api_key"
    assert _post(server, body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        _client(server, "wrong").models.list()
    assert _client(server, "s3cret").models.list().data
    assert httpx.get(f"{server.url}/health").status_code == 200  # health needs no key


class GatedDecoder(SpeculativeDecoder):
    """Waits for `gate` before each answer, writes past EOS and takes `delay_s` per stream event,
    so that a test can hold an answer running."""

    gate = threading.Event()
    delay_s = 0.0

    def generate(self, prompt_ids, max_new_tokens, sampling=SamplingParams(), **kw):
        assert self.gate.wait(60)
        on_event = kw.pop("on_event")
        kw["on_event"] = lambda e: (time.sleep(self.delay_s), on_event(e))
        return super().generate(prompt_ids, max_new_tokens, sampling, stop_on_eos=False, **kw)


def _wait_for(server, predicate, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = httpx.get(f"{server.url}/health").json()
        if predicate(health):
            return health
        time.sleep(0.05)
    raise AssertionError(f"daemon never reached the state; last health {health}")


@pytest.fixture
def gated():
    GatedDecoder.gate, GatedDecoder.delay_s = threading.Event(), 0.0
    yield GatedDecoder
    GatedDecoder.gate.set()


def test_a_second_request_is_refused_or_queued_never_interleaved(runner, start, gated, stories):
    _, tokenizer, _ = stories
    model, n = runner.model_id, 12
    prompts = ["Once upon a time", "Tom had a red ball"]
    refs = []
    for p in prompts:
        ids = encode_chat(tokenizer, [{"role": "user", "content": p}])
        refs.append(tokenizer.decode(reference_greedy(stories[0], ids, n), skip_special_tokens=True))
    server = start(_local_setup(runner, gated), max_queue=0)
    results = {}
    first = threading.Thread(target=lambda: results.setdefault(0, _post(server, _request(model, prompts[0],
                                                                                         max_tokens=n))))
    first.start()
    _wait_for(server, lambda h: h["busy"])
    refused = _post(server, _request(model, prompts[1], max_tokens=n))
    assert refused.status_code == 429 and refused.headers["retry-after"]
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    gated.gate.set()
    first.join(60)
    assert results[0].json()["choices"][0]["message"]["content"] == refs[0]

    gated.gate.clear()
    queued = start(_local_setup(runner, gated), max_queue=1)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, _post(queued, _request(
        model, prompts[i], max_tokens=n)))) for i in range(2)]
    for t in threads:
        t.start()
    _wait_for(queued, lambda h: h["waiting"] == 1)
    gated.gate.set()
    for t in threads:
        t.join(60)
    assert [results[i].json()["choices"][0]["message"]["content"] for i in range(2)] == refs


def test_client_leaving_mid_stream_cancels_the_answer_and_the_daemon_serves_on(runner, start, gated, expected):
    gated.delay_s = 0.05
    server = start(_local_setup(runner, gated))
    body = json.dumps(_request(runner.model_id, max_tokens=200, stream=True))
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", content=body, timeout=60,
                      headers={"Content-Type": "application/json"}) as reply:
        lines = reply.iter_lines()
        assert next(lines).startswith("data: ")  # the role chunk
        gated.gate.set()
        while "content" not in next(lines):  # some text arrived
            pass
    health = _wait_for(server, lambda h: not h["busy"], timeout_s=30)
    assert health["requests"]["cancelled"] == 1 and health["requests"]["completed"] == 0
    gated.delay_s = 0.0
    reply = _post(server, _request(runner.model_id))
    assert reply.status_code == 200


@pytest.fixture(scope="module")
def draft(stories_path):
    model, _, _ = load_model(f"{stories_path}@layers=3")
    return model


def test_offline_text_is_marked_and_healed_through_the_api(runner, start, draft, expected):
    """The link fails on the second Verify call and returns once offline text reached the client:
    the stream marks them offline, then confirms or retracts them; greedy + heal gives the
    target's answer."""
    offline_written = []
    verifier = FlakyVerifier(runner, {2: "after"}, gate=lambda: len(offline_written) >= 1)
    drafter = DraftModelDrafter(draft, TreeConfig(depth=4, top_b=2, max_nodes=8))
    server = start(_local_setup(runner, verifier=verifier, drafter=drafter))
    stream = _client(server).chat.completions.create(**_request(runner.model_id, max_tokens=N_NEW), stream=True)
    chunks = []
    for chunk in stream:
        chunks.append(chunk.model_dump())
        ext = (chunk.choices[0].delta.model_extra or {}).get("splitspec", {}) if chunk.choices else {}
        if ext.get("source") == OFFLINE:
            offline_written.append(chunk)
    exts = [c["choices"][0]["delta"].get("splitspec") or {} for c in chunks]
    assert any(e.get("source") == "offline" for e in exts)
    assert any(e.get("event") in ("verified", "retract") for e in exts)
    assert _replay(chunks) == expected(PROMPT)
    assert chunks[-1]["splitspec"]["stats"]["disconnects"] == 1


def test_split_mode_through_the_verify_service(runner, serve, start, stories_path, expected):
    service = serve(runner)
    setup = build_client(ClientConfig(target=str(stories_path), drafter=DrafterSpec.parse("ngram"),
                                      server=service.address, sampling=SamplingParams(0.7, 0.9)))
    server = start(setup)
    reply = _client(server).chat.completions.create(**_request(runner.model_id))
    assert reply.choices[0].message.content == expected(PROMPT)
    assert reply.model_extra["splitspec"]["stats"]["bytes_sent"] > 0
    assert httpx.get(f"{server.url}/health").json()["mode"].startswith("split")
    service.stop()  # the verify service goes away: the daemon lives and says so
    assert _wait_for(server, lambda h: h["link"] == "down")["status"] == "ok"
    setup.decoder.verifier.close()


def test_up_builds_the_client_on_the_thread_that_writes_the_answers(runner, stories_path, monkeypatch, tmp_path):
    """`splitspec up` loads its models on the engine's answer thread, not on the main thread: a
    second thread running parallel torch kernels made small CPU steps ~1.7x slower
    (shared/compute.py)."""
    from splitspec.cli.main import build_parser
    from splitspec.client import build as client_build
    from splitspec.client.daemon import cli as daemon_cli

    seen = {}

    def build(config, local_verifier=None):
        seen["build"] = threading.current_thread()
        return _local_setup(runner)

    class Captured:
        def __init__(self, app, host, port):
            seen["worker"] = app.state.engine._worker.submit(threading.current_thread).result()
            self.url = "http://captured"

        def run(self):
            pass

    monkeypatch.setattr(client_build, "build_client", build)
    monkeypatch.setattr(daemon_cli, "DaemonServer", Captured)
    args = build_parser().parse_args(["up", "--local", "--target", str(stories_path), "--history",
                                      str(tmp_path / "chat.sqlite3")])
    daemon_cli.cmd_up(args)
    assert seen["build"] is seen["worker"] and seen["worker"] is not threading.main_thread()
