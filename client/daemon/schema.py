"""The OpenAI chat-completions and (legacy) completions requests the daemon accepts, checked field by
field, and the error objects it answers with ({"error": {"message", "type", "param", "code"}}, as
OpenAI's API does).

Fields the daemon does not use (presence_penalty, user, ...) are accepted and ignored; fields that
would change the answer in a way it cannot honour (n > 1, logprobs, tools) are refused. splitspec's
own extension objects (`splitspec` fields) refuse unknown fields: a misspelt `private` must not send
the text in clear.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from ..privacy import untagged

ROLES = ("system", "developer", "user", "assistant")


class ApiError(Exception):
    """A refusal: `status` is the HTTP status, the rest the OpenAI error object's fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Open(BaseModel):
    """Unknown fields are accepted (OpenAI clients send fields this daemon ignores)."""

    model_config = ConfigDict(extra="allow")


class _Closed(BaseModel):
    """Unknown fields are refused (splitspec's extension objects: a misspelt key fails closed)."""

    model_config = ConfigDict(extra="forbid")


class MessageExtension(_Closed):
    """A message's `splitspec` field: the whole message private, or private character spans
    [start, end) of its content (the same as <private> tags around them)."""

    private: bool = False
    private_spans: list[tuple[int, int]] = []


class Message(_Open):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | None = None  # a list of text parts arrives joined
    splitspec: MessageExtension | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, content):
        """Join a list of {"type": "text", "text": ...} parts; refuse other parts by name (a union
        type's error would name pydantic's branches, `content.str`, as if they were fields)."""
        if not isinstance(content, list):
            if content is None or isinstance(content, str):
                return content
            raise PydanticCustomError("content_type", "content must be a string, a list of text parts or null")
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise PydanticCustomError("content_part", "part {i} is {kind}: only text content parts "
                                          "(type 'text') are supported",
                                          {"i": i, "kind": f"of type {kind!r}" if kind else "not a content part"})
            if not isinstance(part.get("text"), str):
                raise PydanticCustomError("content_part", "part {i} has no string `text`", {"i": i})
        return "".join(part["text"] for part in content)


class StreamOptions(_Open):
    include_usage: bool = False


class RequestExtension(_Closed):
    """A request's `splitspec` field: the chat-history conversation the exchange is written to
    (the last user message and the answer, as tokens commit)."""

    conversation: StrictInt | None = Field(None, ge=1)  # strict: `true` wrote into conversation 1 (QA 58)


class ChatRequest(_Open):
    """null is the default of every optional field (OpenAI's schema makes them nullable); stream
    and the token limits are strict (OpenAI refuses "yes", "3" and 3.0)."""

    model: str
    messages: list[Message] = Field(min_length=1)
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    stop: list[str] | None = None  # a single string arrives as a list of one
    seed: int | None = Field(None, ge=0, lt=2**63)
    n: int | None = Field(None, ge=1, le=1)
    logprobs: bool | None = None
    tools: list | None = None
    splitspec: RequestExtension | None = None

    _stop_list = field_validator("stop", mode="before")(lambda stop: _stop_strings(stop))


class PromptExtension(_Closed):
    """A completions request's `splitspec` field: the whole prompt private, or private character
    spans [start, end) of it (the same as <private> tags around them), as a chat message's."""

    private: bool = False
    private_spans: list[tuple[int, int]] = []


class TextRequest(_Open):
    """POST /v1/completions: a raw prompt, no chat template. The fields that would change what is
    returned in a way the daemon cannot honour (echo, suffix, best_of > 1, logprobs) are refused."""

    model: str
    prompt: str | list[str]
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    stop: list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    n: int | None = Field(None, ge=1, le=1)
    best_of: int | None = Field(None, ge=1, le=1)
    logprobs: StrictInt | StrictBool | None = None  # false / null: none asked (0 asks for the chosen token's)
    echo: bool | None = None
    suffix: str | None = None
    splitspec: PromptExtension | None = None

    _stop_list = field_validator("stop", mode="before")(lambda stop: _stop_strings(stop))

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_text(cls, prompt):
        """One message naming what is accepted (a union's error would name pydantic's branches)."""
        if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(p, str) for p in prompt)):
            return prompt
        raise PydanticCustomError("prompt_type", "must be a string or a list of one string (token-id "
                                  "prompts are not supported)")


def _stop_strings(stop):
    """`stop` as a list: a single string arrives as a list of one."""
    if isinstance(stop, str):
        return [stop]
    if stop is None or (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        return stop
    raise PydanticCustomError("stop_type", "stop must be a string or a list of strings")


@dataclass(frozen=True)
class Completion:
    """A checked request. messages: role + content without tags and "private_spans" (chat); prompt:
    the same for a raw prompt (/v1/completions; messages is then empty); max_tokens: None = the
    daemon's default; temperature / top_p: None = the daemon's defaults."""

    model: str
    messages: list[dict[str, str]]
    stream: bool
    include_usage: bool
    temperature: float | None
    top_p: float | None
    max_tokens: int | None
    stop: tuple[str, ...]
    seed: int | None
    conversation: int | None = None  # write the exchange to this chat-history conversation
    prompt: dict | None = None  # /v1/completions: {"content", "private_spans"}, encoded as written


def parse_request(body: bytes) -> Completion:
    """The Completion of a chat-completions request body.

    Raises:
        ApiError: 400 for a body that is not JSON (or nested too deep to parse), a field out of
            range or of the wrong type, an unknown field in a `splitspec` extension object, n != 1,
            logprobs or tools, stream_options without stream, more than 4 stop strings, bad private
            spans, text that is not Unicode (a lone surrogate escape).
    """
    raw, req = _validated(body, ChatRequest)
    if req.logprobs:
        raise ApiError(400, "logprobs are not supported", param="logprobs", code="unsupported_value")
    if req.tools:
        raise ApiError(400, "tools are not supported", param="tools", code="unsupported_value")
    stop = _stop(req)
    messages = [_message(i, m) for i, m in enumerate(req.messages)]
    _unicode_body(raw)
    return Completion(req.model, messages, bool(req.stream), bool(req.stream_options and req.stream_options.include_usage),
                      req.temperature, req.top_p, req.max_completion_tokens or req.max_tokens, stop, req.seed,
                      req.splitspec.conversation if req.splitspec else None)


def parse_text_request(body: bytes) -> Completion:
    """The Completion of a (legacy) completions request body: one prompt, continued as written.

    Raises:
        ApiError: 400 as `parse_request`, and for several prompts, echo, suffix or logprobs
            (unsupported_value), best_of > 1 (invalid_value, as n > 1), or unmatched <private> tags
            in the prompt.
    """
    raw, req = _validated(body, TextRequest)
    prompt = req.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise ApiError(400, f"prompt: one prompt per request (got {len(prompt)})", param="prompt",
                           code="unsupported_value")
        prompt = prompt[0]
    for name, given in (("echo", req.echo), ("suffix", req.suffix), ("logprobs", req.logprobs is not None and req.logprobs is not False)):
        if given:
            raise ApiError(400, f"{name} is not supported", param=name, code="unsupported_value")
    stop = _stop(req)
    ext = req.splitspec or PromptExtension()
    spans = [(0, len(prompt))] if ext.private and prompt else sorted(ext.private_spans)
    _spans(_text(prompt, "prompt"), spans, "splitspec.private_spans")
    try:  # a wholly private prompt may mention a tag: read failing closed, as a chat message's
        content, private = untagged(prompt, strict=not ext.private, spans=spans)
    except ValueError as err:
        raise ApiError(400, f"prompt: {err}", param="prompt", code="invalid_value") from None
    _unicode_body(raw)
    return Completion(req.model, [], bool(req.stream), bool(req.stream_options and req.stream_options.include_usage),
                      req.temperature, req.top_p, req.max_tokens, stop, req.seed,
                      prompt={"content": content, "private_spans": private})


def _validated(body: bytes, model: type[BaseModel]):
    """(the parsed JSON, the request `model` validated from it).

    Raises ApiError 400: not JSON, a field's type or range, a lone surrogate anywhere."""
    try:
        raw = json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the body is not valid JSON: {err}") from None
    except RecursionError:
        raise ApiError(400, "the body is not valid JSON: nested too deeply") from None
    try:
        req = model.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        # pydantic words an unknown field "Extra inputs are not permitted"
        message = "unknown field" if first["type"] == "extra_forbidden" else first["msg"]
        raise ApiError(400, f"{param}: {message}" if param else message, param=param, code="invalid_value") from None
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options",
                       code="invalid_value")
    return raw, req


def _unicode_body(raw) -> None:
    """Raises ApiError 400 for a lone surrogate in a field the daemon ignores or only echoes (those
    it reads are checked by name first)."""
    if not _unicode(json.dumps(raw, ensure_ascii=False)):
        raise ApiError(400, "the body holds a lone surrogate (\\ud800-\\udfff): not Unicode text", code="invalid_value")


def _stop(req) -> tuple[str, ...]:
    stop = tuple(req.stop or ())
    if len(stop) > 4 or any(not s for s in stop):
        raise ApiError(400, "stop: at most 4 non-empty strings", param="stop", code="invalid_value")
    if not all(_unicode(s) for s in stop):
        raise ApiError(400, "stop: not Unicode text (a lone surrogate)", param="stop", code="invalid_value")
    return stop


def _text(content: str, param: str) -> str:
    """Raises ApiError 400 naming `param` for text that is not Unicode (the tokenizer would fail on it)."""
    if not _unicode(content):
        raise ApiError(400, f"{param}: not Unicode text (a lone surrogate)", param=param, code="invalid_value")
    return content


def _spans(content: str, spans: list[tuple[int, int]], param: str) -> list[tuple[int, int]]:
    """`spans`, checked. Raises ApiError 400 naming `param` unless they are non-empty, in order,
    non-overlapping and within `content`."""
    last = 0
    for start, end in spans:
        if not last <= start < end <= len(content):
            raise ApiError(400, f"{param}: spans must be non-empty, in order, non-overlapping and within the "
                                f"content ({len(content)} characters)", param=param, code="invalid_value")
        last = end
    return spans


def _message(index: int, message: Message) -> dict:
    """role, content without tags, and "private_spans": the character ranges [start, end) of that
    content that are private, from its `<private>` tags and its extension's fields together (the
    form client/privacy.py `encode_private_chat` takes). The spans are never written back as tags
    and parsed again: text holding a literal tag would end a span early."""
    param = f"messages.{index}"
    content = _text(message.content or "", f"{param}.content")
    ext = message.splitspec or MessageExtension()
    spans = [(0, len(content))] if ext.private and content else sorted(ext.private_spans)
    _spans(content, spans, f"{param}.splitspec.private_spans")
    # what a user typed must be well-formed; an answer (the model may write a tag as text) and a
    # wholly private message (it may mention a tag) are read failing closed (parse_private_tags)
    strict = message.role != "assistant" and not ext.private
    try:
        content, private = untagged(content, strict=strict, spans=spans)
    except ValueError as err:
        raise ApiError(400, f"{param}.content: {err}", param=f"{param}.content", code="invalid_value") from None
    role = "system" if message.role == "developer" else message.role
    return {"role": role, "content": content, "private_spans": private}


def _unicode(text: str) -> bool:
    """Whether `text` is Unicode text: JSON's \\ud800 escapes decode to lone surrogates, which are not."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
