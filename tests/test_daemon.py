"""The client daemon (`splitspec up`) and its OpenAI-compatible API, spoken to by real clients: the
official `openai` package (streaming and not), httpx and curl. Greedy output through the API is
the target's own, in single-device and split mode and across a link failure; bad requests get
OpenAI-style errors; a second request waits or is refused, never interleaved; a client leaving
mid-stream cancels its answer and the daemon serves on."""
from __future__ import annotations

import json
import logging
import math
import shutil
import subprocess
import sys
import threading
import time

import grpc
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from splitspec.client.build import ClientConfig, ClientSetup, build_client  # noqa: E402
from splitspec.client.daemon.cli import DaemonServer, daemon_app  # noqa: E402
from splitspec.client.daemon.engine import refusal_error  # noqa: E402
from splitspec.client.daemon.schema import parse_request  # noqa: E402
from splitspec.client.drafters import DraftModelDrafter, NgramDrafter  # noqa: E402
from splitspec.client.history import ChatHistory  # noqa: E402
from splitspec.client.loop import OFFLINE, SpeculativeDecoder  # noqa: E402
from splitspec.client.reconnect import OfflinePolicy  # noqa: E402
from splitspec.client.transport import RemoteVerifier  # noqa: E402
from splitspec.server.auth import TokenSet  # noqa: E402
from splitspec.server.local import LocalVerifier  # noqa: E402
from splitspec.server.runner import TargetRunner  # noqa: E402
from splitspec.shared.config import ServerLimits, ServerSecurity, TreeConfig  # noqa: E402
from splitspec.shared.drafters.spec import DrafterSpec  # noqa: E402
from splitspec.shared.features import FeatureRequest  # noqa: E402
from splitspec.shared.models import encode_chat, load_model  # noqa: E402
from splitspec.shared.sampling import SamplingParams  # noqa: E402
from splitspec.shared.verifier import LinkDown  # noqa: E402

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
    return httpx.post(f"{server.url}/v1/chat/completions", content=content, timeout=kw.pop("timeout", 120),
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


class _RecordingVerifier(LocalVerifier):
    """A LocalVerifier that keeps the prompt ids of each open: what a verify service would receive."""

    def __init__(self, runner) -> None:
        super().__init__(runner)
        self.opened: list[list[int]] = []

    def open(self, prompt_ids, *args, **kw):
        self.opened.append(list(prompt_ids))
        return super().open(prompt_ids, *args, **kw)


def _complete_text(server: DaemonServer, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)


def test_text_completions_continue_the_raw_prompt_as_the_target_would(runner, start):
    """POST /v1/completions (OpenAI's legacy API, which code-completion tools speak): the prompt is
    continued as written, no chat template, and greedy output is the target's own."""
    server, tokenizer = start(_local_setup(runner)), runner.tokenizer
    text = "Once upon a"  # continued " time": its first token holds a leading space
    prompt = tokenizer(text)["input_ids"]  # as the tokenizer encodes by itself: stories260K adds BOS
    ref = reference_greedy(runner.model, prompt, N_NEW)
    ref = ref[: ref.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in ref else ref
    # the answer's text as the prompt's continuation: a SentencePiece tokenizer decoding the answer
    # alone drops its first token's leading space (QA 58)
    before = tokenizer.decode(prompt, skip_special_tokens=True)
    want = tokenizer.decode(prompt + ref, skip_special_tokens=True)[len(before):]
    assert want.startswith(" time")
    client = _client(server)
    reply = client.completions.create(model=runner.model_id, prompt=text, max_tokens=N_NEW, temperature=0)
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    assert reply.choices[0].text == want and reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == len(ref)
    assert reply.model_extra["splitspec"]["stats"]["target_calls"] >= 1
    stream = client.completions.create(model=runner.model_id, prompt=[text], max_tokens=N_NEW, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = [chunk.model_dump() for chunk in stream]
    assert {c["object"] for c in chunks} == {"text_completion"} and len({c["id"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want
    assert chunks[-2]["choices"][0]["finish_reason"] == reply.choices[0].finish_reason
    assert chunks[-1]["usage"]["completion_tokens"] == reply.usage.completion_tokens
    stop = want[len(want) // 2: len(want) // 2 + 3]
    reply = _complete_text(server, {"model": runner.model_id, "prompt": text, "max_tokens": N_NEW, "temperature": 0,
                                    "stop": stop}).json()
    cut = reply["choices"][0]
    assert cut["text"] == want[: want.index(stop)] and cut["finish_reason"] == "stop"
    # usage counts the tokens that hold the cut text, decoded after the prompt as the text is
    held = next(k for k in range(len(ref) + 1)
                if len(tokenizer.decode(prompt + ref[:k], skip_special_tokens=True)) - len(before) >= len(cut["text"]))
    assert reply["usage"]["completion_tokens"] == held
    two = tokenizer.decode(prompt + ref[:2], skip_special_tokens=True)[len(before):]  # a stop right after token 2
    reply = _complete_text(server, {"model": runner.model_id, "prompt": text, "max_tokens": N_NEW, "temperature": 0,
                                    "stop": want[len(two):len(two) + 3]}).json()
    assert reply["choices"][0]["text"] == two and reply["usage"]["completion_tokens"] == 2
    health = httpx.get(f"{server.url}/health").json()
    assert health["requests"]["completed"] == 4


def test_a_text_prompts_private_span_never_reaches_the_verifier(runner, start):
    verifier = _RecordingVerifier(runner)
    server = start(_local_setup(runner, verifier=verifier))
    # what ordinary clients send by default is accepted (QA 58: logprobs false was refused)
    defaults = {"model": runner.model_id, "max_tokens": 6, "temperature": 0, "logprobs": False, "echo": False,
                "n": 1, "best_of": 1, "suffix": None, "presence_penalty": 0, "user": "x"}
    for body in ({"prompt": "Lily met a <private>zqx</private> cat"},
                 {"prompt": "Lily met a zqx cat", "splitspec": {"private_spans": [[11, 14]]}}):
        reply = _complete_text(server, {**defaults, **body})
        assert reply.status_code == 200 and reply.json()["splitspec"]["private_prompt_tokens"] > 0, reply.text
    assert len(verifier.opened) == 2 and verifier.opened[0] == verifier.opened[1]
    sent = runner.tokenizer.decode(verifier.opened[0])
    assert "Lily met a" in sent and "cat" in sent and "zqx" not in sent and "zq" not in sent
    # a wholly private prompt, tags in it read as text of it (failing closed)
    whole = _complete_text(server, {**defaults, "prompt": "Type </private> or zqx", "splitspec": {"private": True}})
    assert whole.status_code == 200, whole.text
    sent = runner.tokenizer.decode(verifier.opened[-1])
    assert "zq" not in sent and "private" not in sent and "Type" not in sent


@pytest.mark.parametrize("fields, param, code", [
    ({"prompt": "hi", "echo": True}, "echo", "unsupported_value"),
    ({"prompt": "hi", "suffix": "}"}, "suffix", "unsupported_value"),
    ({"prompt": "hi", "logprobs": 2}, "logprobs", "unsupported_value"),
    ({"prompt": "hi", "logprobs": 0}, "logprobs", "unsupported_value"),  # 0: the chosen token's, still a logprob
    ({"prompt": "hi", "best_of": 2}, "best_of", "invalid_value"),
    ({"prompt": "hi", "n": 2}, "n", "invalid_value"),
    ({"prompt": ["a", "b"]}, "prompt", "unsupported_value"),
    ({"prompt": [1, 2, 3]}, "prompt", "invalid_value"),
    ({}, "prompt", "invalid_value"),
    ({"prompt": "a <private>b"}, "prompt", "invalid_value"),
    ({"prompt": "abc", "splitspec": {"private_spans": [[2, 9]]}}, "splitspec.private_spans", "invalid_value"),
    ({"prompt": "abc", "splitspec": {"privat_spans": [[0, 1]]}}, "splitspec.privat_spans", "invalid_value"),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "invalid_value"),
])
def test_text_completion_refusals_name_the_field(runner, start, fields, param, code):
    server = start(_local_setup(runner))
    reply = _complete_text(server, {"model": runner.model_id, **fields})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == param and error["code"] == code, reply.text
    assert httpx.get(f"{server.url}/health").json()["requests"]["completed"] == 0


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
    # usage counts the answer's tokens, not those the last step accepted past the stop string
    ids = reference_greedy(runner.model, encode_chat(runner.tokenizer, [{"role": "user", "content": PROMPT}]), N_NEW)
    answer_tokens = next(k for k in range(len(ids) + 1)
                         if len(runner.tokenizer.decode(ids[:k], skip_special_tokens=True)) >= len(cut))
    assert reply["usage"]["completion_tokens"] == answer_tokens
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
    # an answer sent back may hold a tag the model wrote as text: the conversation goes on
    later = {**field, "messages": [{"role": "user", "content": "How?"},
                                   {"role": "assistant", "content": "Type </private> after it."},
                                   {"role": "user", "content": "ok"}]}
    assert _post(server, later).status_code == 200



@pytest.mark.parametrize("role, ext, content", [
    ("assistant", {"private": True}, "Close it with </private>. Your card is 4929-7731-0082-5516."),
    ("assistant", {"private_spans": [[0, 59]]}, "Close it with </private>. Your card is 4929-7731-0082-5516."),
    ("assistant", {}, "Noted: <private>card 4929-7731-0082-5516"),  # an unclosed tag: the rest is private
    ("user", {"private": True}, "What does </private> do? My card is 4929-7731-0082-5516."),
    ("user", {"private": True}, "My PIN is <private>4711</private>, card 4929-7731-0082-5516"),
])
def test_a_private_message_stays_private_whatever_tags_it_holds(runner, role, ext, content):
    """QA 57 finding 1 (a leak): the daemon wrote a message's private fields as tags and parsed them
    again, so a literal </private> in the text ended the span and the rest, a card number, went to
    the verify service in clear; a whole-private message holding tags was refused (finding 6)."""
    from splitspec.client.privacy import encode_private_chat

    messages = [{"role": "user", "content": "What card did I give you?"},
                {"role": role, "content": content, **({"splitspec": ext} if ext else {})},
                {"role": "user", "content": "thanks"}]
    completion = parse_request(json.dumps({"model": runner.model_id, "messages": messages}).encode())
    ids, mask = encode_private_chat(runner.tokenizer, completion.messages)
    public = runner.tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    assert "4929" not in public and "0082" not in public and "card is" not in public
    assert "What card did I give you?" in public and "thanks" in public
    from splitspec.client.privacy import untagged, with_private_tags

    for m in completion.messages:  # the chat history keeps tags: they read back as the same spans, strictly
        assert untagged(with_private_tags(m["content"], m["private_spans"])) == (m["content"], m["private_spans"])

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
    # splitspec's extension objects fail closed: a misspelt key would send the text meant private in clear
    ({"model": "M", "messages": [{"role": "user", "content": "My PIN is 4711", "splitspec": {"privat": True}}]},
     400, "messages.0.splitspec.privat", "invalid_value"),
    ({"model": "M", "messages": [{"role": "user", "content": "My PIN is 4711",
                                  "splitspec": {"private_span": [[10, 14]]}}]},
     400, "messages.0.splitspec.private_span", "invalid_value"),
    ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "splitspec": {"conversaton": 1}}, 400,
     "splitspec.conversaton", "invalid_value"),
    # strict like max_tokens: `true` wrote into conversation 1 (QA 58)
    ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "splitspec": {"conversation": True}}, 400,
     "splitspec.conversation", "invalid_value"),
    ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "splitspec": {"conversation": "3"}}, 400,
     "splitspec.conversation", "invalid_value"),
    ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404, "model", "model_not_found"),
    ({"model": "M", "messages": [{"role": "user", "content": "hi " * 2000}]}, 400, "messages",
     "context_length_exceeded"),
    ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}, 400, "max_tokens",
     "context_length_exceeded"),
    ({"model": "M", "messages": [{"role": "user", "content": "x" * 70000}]}, 413, None, "request_too_large"),
    # a union type's error names the field, not pydantic's branch (`content.str`, `stop.str`)
    ({"model": "M", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages.0.content", "invalid_value"),
    ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "stop": 5}, 400, "stop", "invalid_value"),
    ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "stop": ["a", 5]}, 400, "stop", "invalid_value"),
    # strict types, as OpenAI's
    ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "stream", "invalid_value"),
    ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "3"}, 400, "max_tokens",
     "invalid_value"),
    ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "max_tokens": True}, 400, "max_tokens",
     "invalid_value"),
    ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3.0}, 400, "max_tokens",
     "invalid_value"),
    ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}},
     400, "stream_options", "invalid_value"),
    # input that is not a validation error: a lone surrogate (valid JSON, not Unicode), JSON too deep to parse
    ({"model": "M", "messages": [{"role": "user", "content": "a\ud800b"}]}, 400, "messages.0.content",
     "invalid_value"),
    ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "user": "\udfff"}, 400, None, "invalid_value"),
    (b'{"model": "M", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None, None),
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


def test_unknown_fields_are_refused_in_splitspec_objects_only(runner, start):
    """OpenAI's own objects take fields the daemon does not know (clients send them); splitspec's
    extension objects name an unknown one, so a typo in a privacy control fails closed."""
    server = start(_local_setup(runner))
    body = {**_request(runner.model_id, max_tokens=2), "presence_penalty": 0, "user": "u1",
            "messages": [{"role": "user", "content": "hi", "name": "bob", "splitspec": {"private": False}}]}
    assert _post(server, body).status_code == 200
    typo = {**body, "messages": [{"role": "user", "content": "My PIN is 4711", "splitspec": {"privat": True}}]}
    reply = _post(server, typo)
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == "messages.0.splitspec.privat: unknown field"


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
    assert _post(server, body, headers={"Authorization": "bearer s3cret"}).status_code == 200  # the scheme: any case
    assert _post(server, body).headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        _client(server, "wrong").models.list()
    assert _client(server, "s3cret").models.list().data
    assert httpx.get(f"{server.url}/health").status_code == 200  # health needs no key
    assert httpx.head(f"{server.url}/health").status_code == 200
    assert httpx.head(f"{server.url}/").status_code == 200  # the page too (QA 57: 405)


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


def test_stopping_the_daemon_ends_the_requests_in_flight_with_503(runner, start, gated):
    """What SIGINT / SIGTERM do (DaemonServer.stop, uvicorn's handle_exit): the running and the
    waiting request get a 503 `shutting_down` error object (the stream: an error event, then
    [DONE]) instead of a bare 500 or a cut connection when uvicorn cancels their handlers."""
    server = start(_local_setup(runner, gated), max_queue=1)
    results = {}

    def stream() -> None:
        body = json.dumps(_request(runner.model_id, stream=True))
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", content=body, timeout=60,
                          headers={"Content-Type": "application/json"}) as reply:
            results["stream"] = list(reply.iter_lines())

    running = threading.Thread(target=lambda: results.setdefault("post", _post(server, _request(runner.model_id))))
    running.start()
    _wait_for(server, lambda h: h["busy"])
    waiting = threading.Thread(target=stream)
    waiting.start()
    _wait_for(server, lambda h: h["waiting"] == 1)
    server.stop()
    running.join(30)
    waiting.join(30)
    assert results["post"].status_code == 503 and results["post"].json()["error"]["code"] == "shutting_down"
    events = [line for line in results["stream"] if line]
    assert '"shutting_down"' in events[-2] and events[-1] == "data: [DONE]", events


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


TOKEN, OTHER_TOKEN = "tok-" + "a1" * 12, "tok-" + "b2" * 12


def _split_setup(runner, address: str, **verifier_kw) -> ClientSetup:
    return ClientSetup(SpeculativeDecoder(RemoteVerifier(address, **verifier_kw), NgramDrafter(), FAST),
                       runner.tokenizer, SamplingParams(0.7, 0.9), "split")


def test_a_prompt_over_the_services_max_prompt_tokens_is_refused_like_one_over_the_context(runner, serve, start):
    """The service's Info reports max_prompt_tokens: a longer prompt gets 400 context_length_exceeded
    naming the limit, as one over the context does (it got 500 with the gRPC call's repr)."""
    service = serve(runner, ServerLimits(max_prompt_tokens=32))
    setup = _split_setup(runner, service.address)
    server = start(setup)
    reply = _post(server, _request(runner.model_id, "hi " * 40))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert "up to 32 tokens" in error["message"] and error["type"] == "invalid_request_error"
    assert _post(server, _request(runner.model_id, max_tokens=2)).status_code == 200  # a short one passes
    setup.decoder.verifier.close()


def test_verify_service_refusals_are_http_answers_with_its_words(runner, serve, start, caplog):
    """A refusal of the verify service is no daemon bug (500 with the call's repr and a traceback):
    a limit the request is over is 400, a service full for now 503 with its retry hint as
    Retry-After, a refused token 502 naming the daemon's credentials; each logs one warning."""
    service = serve(runner, ServerLimits(max_sessions=1, max_session_kv_tokens=30),
                    security=ServerSecurity(tokens=(TOKEN,)))
    setup = _split_setup(runner, service.address, token=TOKEN, busy_wait_s=0)
    server = start(setup)
    body = _request(runner.model_id)  # 19 prompt tokens: the answer outgrows the session's 30 KV tokens
    caplog.set_level("WARNING", logger="splitspec.client.daemon.engine")

    over = _post(server, body)
    assert over.status_code == 400, over.text
    error = over.json()["error"]
    assert error["code"] == "server_limit_exceeded" and error["type"] == "invalid_request_error"
    assert "RESOURCE_EXHAUSTED: session KV tokens budget exceeded" in error["message"]
    assert "Rendezvous" not in error["message"] and "debug_error_string" not in error["message"]

    other = RemoteVerifier(service.address, token=TOKEN)  # holds the service's one session
    session, _ = other.open([1, 2, 3], SamplingParams(0.0), FeatureRequest())
    busy = _post(server, _request(runner.model_id, max_tokens=2))
    assert busy.status_code == 503 and busy.headers["retry-after"] == "1", busy.text
    assert busy.json()["error"]["code"] == "verify_service_busy" and "1 sessions" in busy.json()["error"]["message"]
    session.close()
    other.close()

    service.servicer.auth.tokens = TokenSet([OTHER_TOKEN])  # the service's tokens rotated without the daemon's
    refused = _post(server, _request(runner.model_id, max_tokens=2))
    assert refused.status_code == 502, refused.text
    error = refused.json()["error"]
    assert error["code"] == "verify_service_auth_failed" and error["type"] == "server_error"
    assert "refused this daemon's credentials (UNAUTHENTICATED" in error["message"]

    records = [r for r in caplog.records if r.name == "splitspec.client.daemon.engine"]
    assert [r.levelname for r in records] == ["WARNING"] * 3 and not any(r.exc_info for r in records)
    assert httpx.get(f"{server.url}/health").json()["requests"]["failed"] == 3
    setup.decoder.verifier.close()


class _Refusal(grpc.RpcError):
    """A gRPC refusal as the channel raises it: code, details and trailing metadata."""

    def __init__(self, code: grpc.StatusCode, details: str, metadata=()) -> None:
        self._code, self._details, self._metadata = code, details, metadata

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._metadata


@pytest.mark.parametrize("refusal, status, code, retry_after", [
    (_Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "rate limit of 5 calls/s per client exceeded; retry in 1.400 s",
              (("grpc-retry-pushback-ms", "1400"),)), 503, "verify_service_busy", "2"),
    (_Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "prompt has 8181 tokens; the limit is 4096"), 400,
     "server_limit_exceeded", None),
    (_Refusal(grpc.StatusCode.PERMISSION_DENIED, "not allowed"), 502, "verify_service_auth_failed", None),
    (_Refusal(grpc.StatusCode.FAILED_PRECONDITION, "the client's tokenizer fingerprint differs"), 502,
     "verify_service_refused", None),
    (_Refusal(grpc.StatusCode.INVALID_ARGUMENT, "prompt token id 9999 outside [0, 512)"), 502,
     "verify_service_refused", None),
])
def test_each_refusal_has_its_http_status(refusal, status, code, retry_after):
    error = refusal_error(refusal)
    assert (error.status, error.code, error.headers.get("Retry-After")) == (status, code, retry_after)
    assert refusal.details() in error.message and refusal.code().name in error.message


class _DownVerifier(LocalVerifier):
    """A target whose link is down while `down` is set: opens fail, probes say so."""

    def __init__(self, runner) -> None:
        super().__init__(runner)
        self.down, self.opens = True, 0

    def open(self, *args, **kwargs):
        self.opens += 1
        if self.down:
            raise LinkDown("injected: unreachable")
        return super().open(*args, **kwargs)

    def probe(self, timeout_s: float = 1.0) -> bool:
        return not self.down


def test_a_request_while_the_link_is_known_down_gets_its_503_at_once(runner, start, caplog):
    """While the link is known down (/health found it so, or the last answer could not reach the
    service) a request is refused after one probe, not after the loop's wait for the link (30 s by
    default, holding the one answer worker); the first request after a drop still waits, for a
    service that may be restarting. Each failure is one warning, no traceback."""
    verifier = _DownVerifier(runner)
    wait_s = 4.0
    setup = ClientSetup(SpeculativeDecoder(verifier, NgramDrafter(), OfflinePolicy(backoff_initial_s=0.01,
                                                                                    backoff_max_s=0.05,
                                                                                    final_wait_s=wait_s)),
                        runner.tokenizer, SamplingParams(0.7, 0.9), "single-device")
    server = start(setup)
    caplog.set_level("WARNING", logger="splitspec.client.daemon.engine")
    body = _request(runner.model_id, max_tokens=2)

    tic = time.monotonic()
    first = _post(server, body)  # the daemon does not know yet: the loop waits for the link
    assert first.status_code == 503 and time.monotonic() - tic >= wait_s
    tic = time.monotonic()
    second = _post(server, body)  # known down from the first: no open, no wait
    assert second.status_code == 503 and time.monotonic() - tic < 2.0 and verifier.opens == 1
    assert second.json()["error"]["code"] == "verify_service_unreachable"

    verifier.down = False
    assert httpx.get(f"{server.url}/health").json()["link"] == "up"
    assert _post(server, body).status_code == 200
    verifier.down = True
    assert httpx.get(f"{server.url}/health").json()["link"] == "down"  # /health tells the daemon too
    tic = time.monotonic()
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60, headers={"Content-Type": "application/json"},
                      content=json.dumps({**body, "stream": True})) as stream:
        events = [line for line in stream.iter_lines() if line]
    assert time.monotonic() - tic < 2.0 and '"verify_service_unreachable"' in events[-2], events
    assert verifier.opens == 2  # only the answer that ran

    verifier.down = False  # it came back: the next request finds so with its probe
    assert _post(server, body).status_code == 200
    records = [r for r in caplog.records if r.name == "splitspec.client.daemon.engine"]
    assert [r.levelname for r in records] == ["WARNING"] * 3 and not any(r.exc_info for r in records)


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


def _strict_json(text: str):
    """json.loads refusing NaN and Infinity, as JavaScript's JSON.parse does."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_a_one_token_answer_is_valid_json(runner, start):
    """One token needs no verify call: tau is no number then, and the answer is still valid JSON."""
    server = start(_local_setup(runner))
    reply = _post(server, _request(runner.model_id, max_tokens=1))
    assert reply.status_code == 200, reply.text
    tau = _strict_json(reply.text)["splitspec"]["stats"]["tau"]
    assert tau is None or math.isfinite(tau)
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60, headers={"Content-Type": "application/json"},
                      content=json.dumps(_request(runner.model_id, max_tokens=1, stream=True))) as stream:
        events = [line[len("data: "):] for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and all(_strict_json(e) for e in events[:-1])


def test_null_n_and_stream_are_their_defaults(runner, start):
    server = start(_local_setup(runner))
    reply = _post(server, _request(runner.model_id, max_tokens=2, n=None, stream=None, stream_options=None))
    assert reply.status_code == 200, reply.text
    assert reply.json()["object"] == "chat.completion"


def test_foreign_host_and_non_json_bodies_are_refused(runner, start, tmp_path):
    """DNS rebinding (a page whose name now points at 127.0.0.1 reads the chat history) and a cross-site
    form or text/plain post (which a browser sends without asking the daemon first) are refused;
    real clients, the chat page and health checkers are not."""
    server = start(_local_setup(runner), history=ChatHistory(tmp_path / "chat.sqlite3"))
    port = server.port
    for host in (f"attacker.example:{port}", "attacker.example", f"127.0.0.1.attacker.example:{port}", ""):
        for path in ("/splitspec/conversations", "/v1/models", "/"):
            reply = httpx.get(f"{server.url}{path}", headers={"Host": host})
            assert reply.status_code == 403 and reply.json()["error"]["code"] == "host_not_allowed", (host, path)
    assert httpx.get(f"{server.url}/health", headers={"Host": "attacker.example"}).status_code == 200
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST", "127.0.0.2"):
        assert httpx.get(f"{server.url}/splitspec/conversations", headers={"Host": host}).status_code == 200, host

    body = json.dumps(_request(runner.model_id, max_tokens=2))
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {"Content-Type": content_type} if content_type else {}
        reply = httpx.post(f"{server.url}/v1/chat/completions", content=body, headers=headers, timeout=60)
        assert reply.status_code == 415 and reply.json()["error"]["code"] == "unsupported_media_type", content_type
        reply = httpx.post(f"{server.url}/splitspec/conversations", content="{}", headers=headers)
        assert reply.status_code == 415, content_type
    assert _post(server, body, headers={"Content-Type": "application/json; charset=utf-8"}).status_code == 200
    assert httpx.post(f"{server.url}/splitspec/conversations").status_code == 200  # curl -X POST: no body
    assert httpx.post(f"{server.url}/splitspec/conversations", json={}).status_code == 200  # the chat page
    assert httpx.get(f"{server.url}/health").json()["requests"] == {"completed": 1, "cancelled": 0, "failed": 0,
                                                                    "refused": 0}


def test_framework_refusals_are_openai_errors_and_models_retrieve(runner, start, tmp_path):
    server = start(_local_setup(runner), history=ChatHistory(tmp_path / "chat.sqlite3"))
    for method, path, status, code in [("POST", "/v1/embeddings", 404, "unknown_url"),
                                       ("GET", "/v1/chat/completions", 405, "method_not_allowed"),
                                       ("GET", "/splitspec/conversations/abc", 404, "conversation_not_found"),
                                       ("GET", "/splitspec/conversations/99999999999999999999999", 404,
                                        "conversation_not_found")]:
        reply = httpx.request(method, f"{server.url}{path}", json={"model": runner.model_id, "prompt": "hi"})
        assert reply.status_code == status, (path, reply.text)
        error = reply.json()["error"]
        assert error["message"] and error["type"] == "invalid_request_error" and error["code"] == code
    huge = _request(runner.model_id, max_tokens=2, splitspec={"conversation": 10**30})
    assert _post(server, huge).json()["error"]["code"] == "conversation_not_found"
    client = _client(server)
    assert client.models.retrieve(runner.model_id).id == runner.model_id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_an_unexpected_error_is_a_500_openai_error_and_the_daemon_serves_on(runner, start, monkeypatch):
    server = start(_local_setup(runner))
    engine = server.app.state.engine

    def broken(completion):
        raise RuntimeError("a bug")

    body = _request(runner.model_id, max_tokens=2)
    with httpx.Client(timeout=60) as client:
        with monkeypatch.context() as patch:
            patch.setattr(engine, "prepare", broken)
            reply = client.post(f"{server.url}/v1/chat/completions", json=body)
        assert reply.status_code == 500
        assert reply.json()["error"] == {"message": "RuntimeError: a bug", "type": "server_error", "param": None,
                                         "code": "internal_error"}
        assert client.post(f"{server.url}/v1/chat/completions", json=body).status_code == 200


def test_client_leaving_a_non_streaming_request_cancels_the_answer(runner, start, gated):
    gated.delay_s = 0.05
    server = start(_local_setup(runner, gated))
    with pytest.raises(httpx.ReadTimeout):  # the SDK's timeout: it closes the connection
        _post(server, _request(runner.model_id, max_tokens=200), timeout=1.0)
    gated.gate.set()
    health = _wait_for(server, lambda h: not h["busy"], timeout_s=30)
    assert health["requests"]["cancelled"] == 1 and health["requests"]["completed"] == 0


def test_a_request_cancelled_while_waiting_frees_its_place_at_once(runner, start, gated):
    server = start(_local_setup(runner, gated), max_queue=1)
    model, results = runner.model_id, {}
    first = threading.Thread(target=lambda: results.setdefault(0, _post(server, _request(model, max_tokens=4))))
    first.start()
    _wait_for(server, lambda h: h["busy"])
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60, headers={"Content-Type": "application/json"},
                      content=json.dumps(_request(model, max_tokens=4, stream=True))) as waiting:
        lines = waiting.iter_lines()  # kept: a dropped iterator closes the connection
        assert next(lines).startswith("data: ")  # the role chunk: it waits now
        assert httpx.get(f"{server.url}/health").json()["waiting"] == 1
    # the client gave up: its place is free while the first answer still runs
    _wait_for(server, lambda h: h["waiting"] == 0 and h["requests"]["cancelled"] == 1, timeout_s=10)
    second = threading.Thread(target=lambda: results.setdefault(1, _post(server, _request(model, max_tokens=4))))
    second.start()
    _wait_for(server, lambda h: h["waiting"] == 1)
    gated.gate.set()
    first.join(60)
    second.join(60)
    assert results[0].status_code == 200 and results[1].status_code == 200, results[1].text
    assert httpx.get(f"{server.url}/health").json()["requests"] == {"completed": 2, "cancelled": 1, "failed": 0,
                                                                    "refused": 0}


def test_an_answer_cut_short_is_stored_incomplete(runner, start, gated, tmp_path):
    gated.delay_s = 0.05
    server = start(_local_setup(runner, gated), history=ChatHistory(tmp_path / "chat.sqlite3"))
    conversation = httpx.post(f"{server.url}/splitspec/conversations").json()["id"]
    body = _request(runner.model_id, max_tokens=200, stream=True, splitspec={"conversation": conversation})
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", content=json.dumps(body), timeout=60,
                      headers={"Content-Type": "application/json"}) as reply:
        gated.gate.set()
        for line in reply.iter_lines():
            if line.startswith("data: {") and json.loads(line[len("data: "):])["choices"][0]["delta"].get("content"):
                break  # some text arrived
    _wait_for(server, lambda h: not h["busy"], timeout_s=30)
    gated.delay_s = 0.0
    _post(server, {**body, "stream": False, "max_tokens": 4})
    messages = httpx.get(f"{server.url}/splitspec/conversations/{conversation}").json()["messages"]
    assert [(m["role"], m["complete"]) for m in messages] == [("user", True), ("assistant", False), ("user", True),
                                                              ("assistant", True)]
    assert messages[1]["content"]


def test_up_sampling_flags_are_every_requests_defaults(runner, stories_path, monkeypatch, tmp_path):
    """--top-k and the contextual penalty apply to every request, as in `splitspec chat`; --seed is
    the seed of a request without one (unset: a random one per request)."""
    from splitspec.cli.main import build_parser
    from splitspec.client import build as client_build
    from splitspec.client.daemon import cli as daemon_cli

    engines = []

    def build(config, local_verifier=None):
        return ClientSetup(_local_setup(runner).decoder, runner.tokenizer, config.sampling, "single-device")

    class Captured:
        def __init__(self, app, host, port):
            engines.append(app.state.engine)
            self.url = "http://captured"

        def run(self):
            pass

    monkeypatch.setattr(client_build, "build_client", build)
    monkeypatch.setattr(daemon_cli, "DaemonServer", Captured)
    up = ["up", "--local", "--target", str(stories_path), "--history", str(tmp_path / "chat.sqlite3")]
    daemon_cli.cmd_up(build_parser().parse_args(up + ["--top-k", "3", "--contextual-penalty", "1.2",
                                                      "--penalty-window", "64", "--seed", "5"]))
    daemon_cli.cmd_up(build_parser().parse_args(up))
    flagged, plain = engines
    request = parse_request(json.dumps(_request(runner.model_id)).encode())
    seeded = parse_request(json.dumps(_request(runner.model_id, seed=9)).encode())
    sampling = flagged.sampling(request)
    assert (sampling.top_k, sampling.penalty, sampling.penalty_window, sampling.seed) == (3, 1.2, 64, 5)
    assert flagged.sampling(seeded).seed == 9
    first, second = plain.sampling(request), plain.sampling(request)
    assert (first.top_k, first.penalty) == (0, 1.0) and first.seed != second.seed
    assert plain.sampling(seeded).seed == 9
    for engine in engines:
        engine.close()


def test_up_refuses_a_port_outside_the_tcp_range(capsys):
    """Refused by the parser before the target loads, as serve's --port is (it was taken as given)."""
    from splitspec.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["up", "--local", "--port", "70000"])
    assert exit_.value.code == 2 and "70000 must lie in 0..65535" in capsys.readouterr().err


def test_up_refuses_a_system_prompt_that_is_not_unicode(stories_path, monkeypatch, capsys, tmp_path):
    """Bytes that are not UTF-8 in --system reach Python as lone surrogates: refused with one line
    before anything loads (the daemon started, then failed every request, blaming its messages)."""
    from splitspec.cli.main import main
    from splitspec.client import build as client_build

    def build(config, local_verifier=None):
        raise AssertionError("the client was built")

    monkeypatch.setattr(client_build, "build_client", build)
    status = main(["up", "--local", "--target", str(stories_path), "--history", str(tmp_path / "chat.sqlite3"),
                   "--system", "Be brief \udcff"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1
    assert err.startswith("splitspec: error: --system is not valid UTF-8 text (byte 0xff at character 10)")


def test_up_help_names_everything_the_api_key_protects(capsys):
    from splitspec.cli.main import main

    with pytest.raises(SystemExit):
        main(["up", "--help"])
    assert "on /v1/* and /splitspec/* (the chat history)" in " ".join(capsys.readouterr().out.split())


_SLOW_PREFILL_DAEMON = """
import sys, time
from splitspec.cli.main import build_parser
from splitspec.client.daemon import cli as daemon_cli
from splitspec.server.local import load_local_verifier

def slow(target, device, dtype):  # a prefill far longer than the test waits
    verifier, tokenizer = load_local_verifier(target, device, dtype)
    real = verifier.runner.open
    def open_(*args, **kwargs):
        print("prefill started", flush=True)
        time.sleep(300)
        return real(*args, **kwargs)
    verifier.runner.open = open_
    return verifier, tokenizer

args = build_parser().parse_args(["up", "--local", "--target", sys.argv[1], "--drafter", "ngram",
                                  "--port", "0", "--history", sys.argv[2]])
daemon_cli.cmd_up(args, local_verifier=slow)
"""


def test_ctrl_c_during_a_long_prefill_exits_promptly(stories_path, tmp_path):
    """SIGINT while one model step runs (a long prompt's prefill cannot be interrupted): the
    daemon gives it EXIT_GRACE_S, then exits 130 instead of joining the compute thread at exit."""
    import signal

    child = subprocess.Popen([sys.executable, "-c", _SLOW_PREFILL_DAEMON, str(stories_path),
                              str(tmp_path / "chat.sqlite3")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        url = None
        for line in child.stdout:
            if "OpenAI base URL" in line:
                url = line.split()[-1]
                break
        assert url is not None, child.stderr.read()
        replies = []
        request = threading.Thread(target=lambda: replies.append(httpx.post(f"{url}/chat/completions", timeout=60,
                                                                            json=_request(str(stories_path)))),
                                   daemon=True)
        request.start()
        assert any("prefill started" in line for line in child.stdout)
        start = time.monotonic()
        child.send_signal(signal.SIGINT)
        status = child.wait(timeout=60)
        elapsed = time.monotonic() - start
        assert status == 130 and elapsed < 30, (status, elapsed)
        assert "abandoned" in child.stderr.read()
        # the client in flight was told why (it got a bare 500 when uvicorn cancelled its handler)
        request.join(timeout=10)
        assert replies and replies[0].status_code == 503, replies and replies[0].text
        assert replies[0].json()["error"]["code"] == "shutting_down"
    finally:
        if child.poll() is None:
            child.kill()


class _ByteTokenizer:
    """Token id = one byte, decoded as a byte-level BPE tokenizer would (an incomplete character
    becomes U+FFFD)."""

    def decode(self, ids, skip_special_tokens=True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_an_answer_cut_inside_a_character_does_not_end_in_u_fffd():
    """QA 56 nit: a non-streaming answer cut by max_tokens in the middle of a multi-byte character
    ended in U+FFFD. The streamed deltas and the whole text now both leave the part character out."""
    from splitspec.client.answer import EventKind, StreamEvent
    from splitspec.client.daemon.text import AnswerText

    text = AnswerText(_ByteTokenizer())
    whole = "ハット".encode()
    deltas = text.feed(StreamEvent(EventKind.TOKENS, 0, tuple(whole[:-1])))  # the last character cut short
    assert "".join(d.content for d in deltas + text.finish()) == "ハッ" == text.text
    complete = AnswerText(_ByteTokenizer())
    deltas = complete.feed(StreamEvent(EventKind.TOKENS, 0, tuple(whole)))
    assert "".join(d.content for d in deltas + complete.finish()) == "ハット" == complete.text


def test_held_back_private_text_keeps_its_source():
    """QA 57 finding 4: text held back as a possible stop string's start went out with the next
    tokens' text under their source, so a locally written private name was streamed as 'target'."""
    from splitspec.client.answer import EventKind, Provenance, StreamEvent
    from splitspec.client.daemon.text import AnswerText

    text = AnswerText(_ByteTokenizer(), stop=("bush!",))
    pieces = []
    for source, words in [(Provenance.TARGET, "My name is"), (Provenance.PRIVATE, " Hortensia Quackenbush"),
                          (Provenance.TARGET, " and"), (Provenance.OFFLINE, " more")]:
        start = len(text.ids)
        pieces += text.feed(StreamEvent(EventKind.TOKENS, start, tuple(words.encode()), source))
    pieces += text.finish()
    by_source = {}
    for delta in pieces:
        by_source[delta.source] = by_source.get(delta.source, "") + delta.content
    assert by_source == {"target": "My name is and", "private": " Hortensia Quackenbush", "offline": " more"}
    assert [d.offset for d in pieces] == sorted(d.offset for d in pieces)
    # offline text verified while still held back goes out as the target's
    held = AnswerText(_ByteTokenizer(), stop=("ab",))
    out = held.feed(StreamEvent(EventKind.TOKENS, 0, tuple(b"xa"), Provenance.OFFLINE))
    out += held.feed(StreamEvent(EventKind.VERIFIED, 0, count=2))
    out += held.finish()
    assert [(d.content, d.source) for d in out if not d.event] == [("x", "offline"), ("a", "target")]


def test_the_chat_history_takes_writers_on_several_threads(tmp_path):
    """QA 58 ops finding 2: the daemon's answer worker and its HTTP threads shared one SQLite
    connection unguarded, whose transaction and lastrowid are not per thread: two clients were given
    one conversation id, and answers failed with "cannot commit - no transaction is active"."""
    from splitspec.client.answer import EventKind, StreamEvent

    history = ChatHistory(tmp_path / "chat.sqlite3")
    conversation = history.new_conversation("t", "d")
    answer = history.add_message(conversation, "assistant", "", complete=False)
    writer = history.answer_writer(answer)
    ids, errors = [], []

    def create() -> None:
        try:
            for _ in range(150):
                ids.append(history.new_conversation("t", "d"))
                history.conversations(limit=5)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    def write() -> None:
        try:
            for k in range(300):
                writer(StreamEvent(EventKind.TOKENS, k, (k,)))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=create) for _ in range(3)] + [threading.Thread(target=write)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and len(ids) == len(set(ids)) == 450
    assert [t for t, _ in history.tokens(answer)] == list(range(300))


def test_a_client_leaving_while_it_sends_its_body_is_no_error(runner, start, caplog):
    """QA 58 ops finding 4: each client that closed its connection part way through its request body
    put an ERROR and a 48-line traceback in the daemon's log, as a bug would (500 such: 24,000 lines)."""
    import socket

    server = start(_local_setup(runner))
    host, port = server.url.removeprefix("http://").split(":")
    for _ in range(3):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"model\":")
            time.sleep(0.2)
    time.sleep(0.3)
    assert _post(server, _request(runner.model_id, max_tokens=2)).status_code == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
