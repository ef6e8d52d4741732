"""The daemon's HTTP API (FastAPI): OpenAI's chat completions, models and a health check, with
splitspec's additions in `splitspec` fields (docs/daemon.md).

    POST /v1/chat/completions   streaming (server-sent events) or not
    GET  /v1/models
    GET  /health                no API key needed
    GET  /                      the chat page (client/daemon/static/chat.html), no API key needed
    GET  /splitspec/conversations, POST /splitspec/conversations, GET /splitspec/conversations/{id}
                                the chat history the page lists (client/history.py)
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from .engine import Engine, Failed, Finished
from .schema import ApiError, parse_request
from .text import Delta

def create_app(engine: Engine, *, api_key: str | None = None, max_request_bytes: int = 1 << 20,
               mode: str = "", drafter: str = "") -> FastAPI:
    """The API over `engine`. api_key: when set, /v1/* needs `Authorization: Bearer <api_key>`;
    max_request_bytes: larger bodies are refused with 413."""
    app = FastAPI(title="splitspec daemon", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        if api_key and request.url.path.startswith(("/v1/", "/splitspec/")):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                err = ApiError(401, "missing or incorrect API key (Authorization: Bearer ...)", code="invalid_api_key")
                return JSONResponse(err.body(), status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict:
        link = await run_in_threadpool(engine.setup.decoder.verifier.probe, 1.0)
        return {"status": "ok", "model": engine.config.model_ids[0], "mode": mode, "drafter": drafter,
                "link": "up" if link else "down", "defaults": {"temperature": engine.config.temperature,
                                                               "top_p": engine.config.top_p,
                                                               "max_tokens": engine.config.max_new_tokens},
                **engine.status()}

    page = resources.files("splitspec.client.daemon").joinpath("static/chat.html").read_text(encoding="utf-8")

    @app.get("/", response_class=HTMLResponse)
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
    async def new_conversation() -> dict:
        store = history()
        conversation = await run_in_threadpool(store.new_conversation, engine.config.model_ids[0], drafter)
        return {"id": conversation, "messages": []}

    @app.get("/splitspec/conversations/{conversation}")
    async def conversation_messages(conversation: int) -> dict:
        store = history()
        if not await run_in_threadpool(store.has_conversation, conversation):
            raise ApiError(404, f"no conversation {conversation}", code="conversation_not_found")
        return {"id": conversation, "messages": await run_in_threadpool(store.messages, conversation)}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": engine.config.model_ids[0], "object": "model", "created": created,
                                            "owned_by": "splitspec"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _read_body(request, max_request_bytes)
        completion = parse_request(body)
        loop, reports = asyncio.get_running_loop(), asyncio.Queue()

        def sink(item) -> None:  # from the worker thread
            try:
                loop.call_soon_threadsafe(reports.put_nowait, item)
            except RuntimeError:  # the event loop is gone (shutdown)
                pass

        job = await run_in_threadpool(engine.submit, completion, sink)
        ids = _Ids(engine.config.model_ids[0])
        if completion.stream:
            return StreamingResponse(_events(job, reports, ids, completion.include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            while not isinstance(item := await reports.get(), (Finished, Failed)):
                pass
        finally:
            job.cancel()  # no effect once finished; ends the answer when this handler is cancelled
        if isinstance(item, Failed):
            raise item.error
        return _response(ids, item)

    return app


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
    """The id, creation time and model every object of one completion carries."""

    def __init__(self, model: str) -> None:
        self.id, self.created, self.model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model

    def chunk(self, delta: dict, finish_reason: str | None = None, **extra) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "system_fingerprint": None,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}], **extra}


def _usage(done: Finished) -> dict:
    completion = done.generation.stats.new_tokens
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": completion,
            "total_tokens": done.prompt_tokens + completion}


def _extension(done: Finished) -> dict:
    """The completion's `splitspec` field: the loop's stats and where the tokens came from."""
    gen = done.generation
    sources = {s: gen.sources.count(s) for s in ("target", "offline", "kept", "private")}
    return {"stats": gen.stats.as_dict(), "sources": sources, "private_prompt_tokens": done.private_prompt_tokens,
            "retracted": done.retracted}


def _response(ids: _Ids, done: Finished) -> dict:
    return {"id": ids.id, "object": "chat.completion", "created": ids.created, "model": ids.model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": done.text, "refusal": None},
                         "logprobs": None, "finish_reason": done.finish_reason}],
            "usage": _usage(done), "splitspec": _extension(done)}


async def _events(job, reports: asyncio.Queue, ids: _Ids, include_usage: bool):
    """The SSE stream of one completion: `data: <chunk JSON>\\n\\n` ... `data: [DONE]\\n\\n`.
    Leaving early (the client went away) cancels the job."""
    try:
        yield _sse(ids.chunk({"role": "assistant", "content": ""}))
        while True:
            item = await reports.get()
            if isinstance(item, Delta):
                yield _sse(ids.chunk({"content": item.content, "splitspec": item.extension()}))
                continue
            if isinstance(item, Failed):
                yield _sse(item.error.body())
            else:
                final = {"splitspec": {**_extension(item), **({"text": item.text} if item.retracted else {})}}
                yield _sse(ids.chunk({}, item.finish_reason, **final))
                if include_usage:
                    yield _sse({**ids.chunk({}), "choices": [], "usage": _usage(item)})
            yield "data: [DONE]\n\n"
            return
    finally:
        job.cancel()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
