"""The OpenAI chat-completions request the daemon accepts, checked field by field, and the error
objects it answers with ({"error": {"message", "type", "param", "code"}}, as OpenAI's API does).

Fields the daemon does not use (presence_penalty, user, ...) are accepted and ignored; fields that
would change the answer in a way it cannot honour (n > 1, logprobs, tools) are refused.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..privacy import parse_private_tags

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


class TextPart(_Open):
    type: Literal["text"]
    text: str


class MessageExtension(_Open):
    """A message's `splitspec` field: the whole message private, or private character spans
    [start, end) of its content (the same as <private> tags around them)."""

    private: bool = False
    private_spans: list[tuple[int, int]] = []


class Message(_Open):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    splitspec: MessageExtension | None = None


class StreamOptions(_Open):
    include_usage: bool = False


class RequestExtension(_Open):
    """A request's `splitspec` field: the chat-history conversation the exchange is written to
    (the last user message and the answer, as tokens commit)."""

    conversation: int | None = Field(None, ge=1)


class ChatRequest(_Open):
    model: str
    messages: list[Message] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    n: int = Field(1, ge=1, le=1)
    logprobs: bool | None = None
    tools: list | None = None
    splitspec: RequestExtension | None = None


@dataclass(frozen=True)
class Completion:
    """A checked request. messages: role + content, private spans as <private> tags; max_tokens:
    None = the daemon's default; temperature / top_p: None = the daemon's defaults."""

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


def parse_request(body: bytes) -> Completion:
    """The Completion of a request body.

    Raises:
        ApiError: 400 for a body that is not JSON, a field out of range or of the wrong type,
            n != 1, logprobs or tools, more than 4 stop strings, bad private spans.
    """
    try:
        raw = json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the body is not valid JSON: {err}") from None
    try:
        req = ChatRequest.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise ApiError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param,
                       code="invalid_value") from None
    if req.logprobs:
        raise ApiError(400, "logprobs are not supported", param="logprobs", code="unsupported_value")
    if req.tools:
        raise ApiError(400, "tools are not supported", param="tools", code="unsupported_value")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if len(stop) > 4 or any(not s for s in stop):
        raise ApiError(400, "stop: at most 4 non-empty strings", param="stop", code="invalid_value")
    messages = [_message(i, m) for i, m in enumerate(req.messages)]
    return Completion(req.model, messages, req.stream, bool(req.stream_options and req.stream_options.include_usage),
                      req.temperature, req.top_p, req.max_completion_tokens or req.max_tokens, stop, req.seed,
                      req.splitspec.conversation if req.splitspec else None)


def _message(index: int, message: Message) -> dict[str, str]:
    """role + content with the private spans of the message's extension written as tags."""
    param = f"messages.{index}"
    content = message.content
    if isinstance(content, list):
        content = "".join(part.text for part in content)
    content = content or ""
    ext = message.splitspec or MessageExtension()
    spans = [(0, len(content))] if ext.private and content else sorted(ext.private_spans)
    last = 0
    for start, end in spans:
        if not last <= start < end <= len(content):
            raise ApiError(400, f"{param}.splitspec.private_spans: spans must be non-empty, in order, "
                                f"non-overlapping and within the content ({len(content)} characters)",
                           param=f"{param}.splitspec.private_spans", code="invalid_value")
        last = end
    for start, end in reversed(spans):
        content = f"{content[:start]}<private>{content[start:end]}</private>{content[end:]}"
    try:
        parse_private_tags(content)
    except ValueError as err:
        raise ApiError(400, f"{param}.content: {err}", param=f"{param}.content", code="invalid_value") from None
    role = "system" if message.role == "developer" else message.role
    return {"role": role, "content": content}
