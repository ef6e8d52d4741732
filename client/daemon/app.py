"""The daemon's HTTP API (FastAPI): OpenAI's chat completions, (legacy) text completions, models and
a health check, with splitspec's additions in `splitspec` fields (docs/daemon.md).

    POST /v1/chat/completions   streaming (server-sent events) or not
    POST /v1/completions        a raw prompt continued as written (no chat template), the same ways
    GET  /v1/models, GET /v1/models/{model}
    GET  /health                no API key needed, any Host header
    GET  /                      the chat page (client/daemon/static/chat.html), no API key needed
    GET  /splitspec/conversations, POST /splitspec/conversations, GET /splitspec/conversations/{id}
                                the chat history the page lists (client/history.py)
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
import uuid
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from .cli import loopback_host
from .engine import Engine, Failed, Finished, server_error
from .schema import ApiError, Completion, parse_request, parse_text_request
from .text import Delta

log = logging.getLogger(__name__)


def create_app(engine: Engine, *, api_key: str | None = None, max_request_bytes: int = 1 << 20,
               mode: str = "", drafter: str = "", host: str = "127.0.0.1") -> FastAPI:
    """The API over `engine`. api_key: when set, /v1/* and /splitspec/* need `Authorization:
    Bearer <api_key>`; max_request_bytes: larger bodies are refused with 413; host: the address
    the daemon listens on; when it is a loopback one, requests whose Host header names another
    host are refused (403), all but /health."""
    app = FastAPI(title="splitspec daemon", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())
    check_host = loopback_host(host)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, err: ApiError) -> JSONResponse:
        return _error_response(err)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        """The framework's own refusals (unknown path, wrong method) as OpenAI error objects."""
        if err.status_code == 404:
            message, code = f"Invalid URL ({request.method} {request.url.path})", "unknown_url"
        elif err.status_code == 405:
            message, code = f"{request.method} is not allowed on {request.url.path}", "method_not_allowed"
        else:
            message, code = str(err.detail), None
        return _error_response(ApiError(err.status_code, message, code=code, headers=dict(err.headers or {})))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first["loc"][1:]) or None  # loc[0]: path / query / body
        return _error_response(ApiError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param,
                                        code="invalid_value"))

    @app.middleware("http")
    async def guard(request: Request, call_next):
        # A loopback daemon holds the private chat history: a web page that rebinds its own DNS
        # name to 127.0.0.1 would read it, and it still sends its own name as Host (the defence
        # of Jupyter, the Docker API and Ollama). /health stays open for health checkers.
        if check_host and request.url.path != "/health" and not _local_host(request.headers.get("host", ""), host):
            return _error_response(ApiError(403, "the Host header must name this device (localhost, 127.0.0.1, "
                                                 "[::1]); the daemon listens on loopback only", code="host_not_allowed"))
        if api_key and request.url.path.startswith(("/v1/", "/splitspec/")):
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
                err = ApiError(401, "missing or incorrect API key (Authorization: Bearer ...)", code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})
                return _error_response(err)
        try:
            return await call_next(request)
        except ClientDisconnect:  # it left while sending its body (a phone, a flaky link): no bug, nobody to answer
            log.info("%s %s: the client left while sending its request", request.method, request.url.path)
            return Response(status_code=499)
        except Exception as err:  # a bug: an OpenAI error object, and the keep-alive connection stays usable
            log.exception("%s %s failed", request.method, request.url.path)
            return _error_response(server_error(err))

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> dict:
        link = await run_in_threadpool(engine.link_up, 1.0)
        return {"status": "ok", "model": engine.config.model_ids[0], "mode": mode, "drafter": drafter,
                "link": "up" if link else "down", "defaults": {"temperature": engine.config.temperature,
                                                               "top_p": engine.config.top_p,
                                                               "top_k": engine.config.top_k,
                                                               "max_tokens": engine.config.max_new_tokens,
                                                               "seed": engine.config.seed},
                **engine.status()}

    page = resources.files("splitspec.client.daemon").joinpath("static/chat.html").read_text(encoding="utf-8")

    @app.api_route("/", methods=["GET", "HEAD"], response_class=HTMLResponse)  # HEAD: link checkers, curl -I
    async def chat_page() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    def history():
        if engine.history is None:
            raise ApiError(404, "this daemon keeps no chat history", code="history_disabled")
        return engine.history

    @app.get("/splitspec/conversations")
    async def conversations() -> dict:
        return {"object": "list", "data": await run_in_threadpool(history().conversations)}

    @app.post("/splitspec/conversations")
    async def new_conversation(request: Request) -> dict:
        if request.headers.get("content-type") or _has_body(request):  # it reads no body, but refuses forms
            _require_json(request)
        store = history()
        conversation = await run_in_threadpool(store.new_conversation, engine.config.model_ids[0], drafter)
        return {"id": conversation, "messages": []}

    @app.get("/splitspec/conversations/{conversation}")
    async def conversation_messages(conversation: str) -> dict:
        store = history()
        number = int(conversation) if conversation.isascii() and conversation.isdigit() else 0
        if not number or not await run_in_threadpool(store.has_conversation, number):
            raise ApiError(404, f"no conversation {conversation}", code="conversation_not_found")
        return {"id": number, "messages": await run_in_threadpool(store.messages, number)}

    def model_object(model: str) -> dict:
        return {"id": model, "object": "model", "created": created, "owned_by": "splitspec"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_object(engine.config.model_ids[0])]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> dict:
        engine.check_model(model)
        return model_object(model)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        _require_json(request)
        return await answer(request, parse_request(await _read_body(request, max_request_bytes)))

    @app.post("/v1/completions")
    async def completions(request: Request):
        _require_json(request)
        return await answer(request, parse_text_request(await _read_body(request, max_request_bytes)))

    async def answer(request: Request, completion: Completion):
        """The response to a checked request: an SSE stream, or one JSON object when it has finished."""
        loop, reports = asyncio.get_running_loop(), asyncio.Queue()

        def sink(item) -> None:  # from the worker thread
            try:
                loop.call_soon_threadsafe(reports.put_nowait, item)
            except RuntimeError:  # the event loop is gone (shutdown)
                pass

        job = await run_in_threadpool(engine.submit, completion, sink)
        ids = _Ids(engine.config.model_ids[0], text=completion.prompt is not None)
        if completion.stream:
            return StreamingResponse(_events(job, reports, ids, completion.include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            item = await _outcome(request, reports)
        finally:
            job.cancel()  # no effect once finished; ends the answer when the client left or this handler is cancelled
        if item is None:
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        if isinstance(item, Failed):
            raise item.error
        return ids.response(item)

    return app


async def _outcome(request: Request, reports: asyncio.Queue) -> Finished | Failed | None:
    """The job's Finished or Failed, or None once the client has gone away first (Starlette does
    not cancel a non-streaming handler when its client leaves)."""
    async def result() -> Finished | Failed:
        while not isinstance(item := await reports.get(), (Finished, Failed)):
            pass
        return item

    async def disconnect() -> None:  # the body is read: what the server says next is the disconnect
        try:
            while (await request.receive())["type"] != "http.disconnect":
                pass
        except Exception:  # the client cannot be watched here: wait for the answer alone
            log.exception("watching for the client's disconnect failed")
            await asyncio.Future()

    answer, gone = asyncio.ensure_future(result()), asyncio.ensure_future(disconnect())
    try:
        await asyncio.wait((answer, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        answer.cancel()
    return answer.result() if answer.done() and not answer.cancelled() else None


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _local_host(header: str, host: str) -> bool:
    """Whether a Host header ("name[:port]", "[v6]:port") names a loopback host or `host`."""
    name = header.strip().lower()
    if name.startswith("["):
        name = name[1:name.find("]")] if "]" in name else ""
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    name = name.rstrip(".")
    return bool(name) and (loopback_host(name) or name == host.lower().strip("[]"))


def _has_body(request: Request) -> bool:
    return request.headers.get("content-length", "0") != "0" or "transfer-encoding" in request.headers


def _require_json(request: Request) -> None:
    """Raises ApiError 415 unless the body is declared JSON: a web page can send a form or text/plain
    cross-site without the browser asking the daemon first (CORS), but not application/json."""
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != "application/json":
        raise ApiError(415, f"the body must be JSON sent as Content-Type: application/json, not "
                            f"{media or 'no Content-Type'}", code="unsupported_media_type")


async def _read_body(request: Request, limit: int) -> bytes:
    """Raises ApiError 413 for a body over `limit` bytes (read no further than that)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    return bytes(body)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body exceeds {limit} bytes", code="request_too_large")


class _Ids:
    """The id, creation time and model every object of one completion carries, and the shape of its
    objects: a chat completion's, or (`text`) a legacy text completion's (choices hold `text`)."""

    def __init__(self, model: str, text: bool = False) -> None:
        self.text, self.created, self.model = text, int(time.time()), model
        self.id = f"{'cmpl' if text else 'chatcmpl'}-{uuid.uuid4().hex}"

    def chunk(self, content: str | None, extension: dict | None = None, finish_reason: str | None = None,
              **extra) -> dict:
        """A stream's chunk adding `content` (None: nothing, as in the last chunk), with the token
        sources' `extension` (splitspec's) beside it."""
        if self.text:
            choice = {"text": content or "", "index": 0, "logprobs": None, "finish_reason": finish_reason}
            if extension is not None:
                choice["splitspec"] = extension
        else:
            delta = {} if content is None else {"content": content}
            if extension is not None:
                delta["splitspec"] = extension
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return self._object("text_completion" if self.text else "chat.completion.chunk", [choice], **extra)

    def first(self) -> dict | None:
        """A chat stream's opening chunk (the assistant's role); a text stream has none."""
        if self.text:
            return None
        return self._object("chat.completion.chunk", [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                       "logprobs": None, "finish_reason": None}])

    def response(self, done: Finished) -> dict:
        """The whole answer as one object (a request without `stream`)."""
        if self.text:
            choice = {"text": done.text, "index": 0, "logprobs": None, "finish_reason": done.finish_reason}
        else:
            choice = {"index": 0, "message": _message(done), "logprobs": None, "finish_reason": done.finish_reason}
        return self._object("text_completion" if self.text else "chat.completion", [choice], usage=_usage(done),
                            splitspec=_extension(done))

    def _object(self, kind: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices, **extra}


def _usage(done: Finished) -> dict:
    completion = done.completion_tokens
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": completion,
            "total_tokens": done.prompt_tokens + completion}


def _extension(done: Finished) -> dict:
    """The completion's `splitspec` field: the loop's stats (a value that is not a finite number
    is null: JSON has no NaN) and where the tokens came from."""
    gen = done.generation
    sources = {s: gen.sources.count(s) for s in ("target", "offline", "kept", "private")}
    stats = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in gen.stats.as_dict().items()}
    return {"stats": stats, "sources": sources, "private_prompt_tokens": done.private_prompt_tokens,
            "retracted": done.retracted, "private_spans": [list(span) for span in done.private_spans]}


def _message(done: Finished) -> dict:
    """The answer as an assistant message. Text the client wrote from private spans is named in the
    message's own `splitspec.private_spans`, so a client that appends the message to its history
    as it came sends those spans back private (the next turn's prompt holds the answer)."""
    message = {"role": "assistant", "content": done.text, "refusal": None}
    if done.private_spans:
        message["splitspec"] = {"private_spans": [list(span) for span in done.private_spans]}
    return message


async def _events(job, reports: asyncio.Queue, ids: _Ids, include_usage: bool):
    """The SSE stream of one completion: `data: <chunk JSON>\\n\\n` ... `data: [DONE]\\n\\n`.
    Leaving early (the client went away) cancels the job."""
    try:
        if (first := ids.first()) is not None:
            yield _sse(first)
        while True:
            item = await reports.get()
            if isinstance(item, Delta):
                yield _sse(ids.chunk(item.content, item.extension()))
                continue
            if isinstance(item, Failed):
                yield _sse(item.error.body())
            else:
                final = {"splitspec": {**_extension(item), **({"text": item.text} if item.retracted else {})}}
                yield _sse(ids.chunk(None, finish_reason=item.finish_reason, **final))
                if include_usage:
                    yield _sse({**ids.chunk(None), "choices": [], "usage": _usage(item)})
            yield "data: [DONE]\n\n"
            return
    finally:
        job.cancel()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
