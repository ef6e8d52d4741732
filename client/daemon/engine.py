"""The daemon's one decoder, shared by every request: answers run one at a time on a worker thread
(never interleaved into one session), later ones wait in a bounded queue, and a request beyond it
is refused (`Busy`, HTTP 429).

A job reports to its `sink` from the worker thread: `Delta`s as the answer grows, then one
`Finished` or one `Failed`. Cancelling a job (its listener went away) ends the answer at the next
token; a job cancelled while queued never starts and gives its place in the queue up at once.
"""
from __future__ import annotations

import logging
import math
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import grpc

from splitspec.shared.compute import compute_thread
from splitspec.shared.sampling import SamplingParams
from splitspec.shared.verifier import LinkDown

from ..build import ClientSetup
from ..history import ChatHistory
from ..loop import Generation
from ..privacy import (PrivacyGuard, encode_private_chat, encode_private_text, placeholder_token, private_answer_spans,
                       with_private_tags)
from ..transport import retry_hint_s
from .schema import ApiError, Completion
from .text import AnswerText

log = logging.getLogger(__name__)
CONTEXT_TOKENS = 8  # prompt tokens a text completion's answer is decoded after


@dataclass(frozen=True)
class EngineConfig:
    """model_ids: the names a request may ask for (the first is listed by /v1/models).
    max_new_tokens: a request's default max_tokens; temperature / top_p / seed: a request's
    defaults (temperature 0 = greedy; seed None = a random one per request). top_k, penalty,
    penalty_window: every request's (shared/sampling.py SamplingParams; OpenAI has no such
    fields). max_queue: requests that may wait behind the running one. private_ngram:
    client/privacy.py PrivacyGuard.ngram. system: the system prompt of a request without one."""

    model_ids: tuple[str, ...]
    max_new_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 0.9
    max_queue: int = 8
    private_ngram: int = 2
    system: str | None = None
    top_k: int = 0
    penalty: float = 1.0
    penalty_window: int = 1024
    seed: int | None = None


@dataclass(frozen=True)
class Finished:
    """The answer is complete. finish_reason: "stop" (EOS or a stop string) or "length".
    completion_tokens: the answer's tokens (those past a stop string not counted). private_spans:
    character spans of `text` reproduced from private prompt spans on this device; a client sends
    them back as the assistant message's `splitspec.private_spans` so the next turn keeps them here."""

    text: str
    finish_reason: str
    generation: Generation
    prompt_tokens: int
    private_prompt_tokens: int
    retracted: bool
    completion_tokens: int
    private_spans: tuple[tuple[int, int], ...] = ()  # [start, end) of `text` the client wrote from private spans


@dataclass(frozen=True)
class Failed:
    """The answer could not be written (the verify service unreachable at the start, a refusal)."""

    error: ApiError


Sink = Callable[[object], None]  # receives Delta, then Finished or Failed, from the worker thread


@dataclass(eq=False)  # hashed by identity: the engine keeps its live jobs in a set
class Job:
    """One accepted request; `cancel` ends it at the next token (or before it starts).
    `on_cancel` runs after each cancel (the engine frees a waiting job's queue place)."""

    completion: Completion
    prompt_ids: list[int]
    privacy: PrivacyGuard | None
    sink: Sink
    cancelled: threading.Event = field(default_factory=threading.Event)
    on_cancel: Callable[[], None] | None = None
    started: bool = False  # the worker took it; under the engine's lock, as is `left`
    left: bool = False  # counted out of the engine's pending requests

    def cancel(self) -> None:
        self.cancelled.set()
        if self.on_cancel is not None:
            self.on_cancel()


class Busy(ApiError):
    def __init__(self, waiting: int) -> None:
        super().__init__(429, f"the daemon is busy: one answer running and {waiting} waiting; retry later",
                         type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"})


class ShuttingDown(ApiError):
    def __init__(self) -> None:
        super().__init__(503, "the daemon is shutting down; an answer cut short keeps what was written in the "
                              "chat history", type="server_error", code="shutting_down")


class Engine:
    """Runs completions on `setup`'s decoder, one at a time."""

    def __init__(self, setup: ClientSetup, config: EngineConfig, history: ChatHistory | None = None,
                 worker: ThreadPoolExecutor | None = None) -> None:
        """`worker`: the `shared/compute.py` `compute_thread` that built `setup` (its models), which
        then writes every answer (one is made if None); the engine owns it."""
        self.setup, self.config, self.history = setup, config, history
        self.tokenizer = setup.tokenizer
        self.info = setup.decoder.verifier.info
        self._worker = worker if worker is not None else compute_thread("splitspec-answer")
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when the running answer ends
        self.running = 0  # 0 or 1: an answer the worker took and has not finished
        self.pending = 0  # running + waiting
        self._jobs: set[Job] = set()  # running and waiting, until counted out (`_leave`)
        self.closing = False  # `shut_down` was called: requests are refused
        self.link_down = False  # the last probe, or the last answer, found the verify service unreachable
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0, "refused": 0}

    # --- requests -----------------------------------------------------------------------------

    def check_model(self, model: str) -> None:
        """Raises ApiError 404 (model_not_found) for a model this daemon does not serve."""
        if model not in self.config.model_ids:
            raise ApiError(404, f"the model '{model}' does not exist here; this daemon serves "
                                f"{self.config.model_ids[0]!r} (GET /v1/models)", param="model", code="model_not_found")

    def prepare(self, completion: Completion) -> tuple[list[int], PrivacyGuard | None, int]:
        """(prompt ids [P], the privacy guard when a message holds private spans, max new tokens).

        Raises:
            ApiError: 400 for a chat the tokenizer cannot render with its private spans, or one
                that leaves no room in the target's context or is over the verify service's
                `max_prompt_tokens` (code context_length_exceeded).
        """
        param = "messages" if completion.prompt is None else "prompt"
        takes = "the messages take" if completion.prompt is None else "the prompt takes"
        try:
            if completion.prompt is None:
                messages = completion.messages
                if self.config.system and not any(m["role"] == "system" for m in messages):
                    messages = [{"role": "system", "content": self.config.system}, *messages]
                ids, mask = encode_private_chat(self.tokenizer, messages)
            else:  # /v1/completions: the text as written, no chat template, no system prompt
                ids, mask = encode_private_text(self.tokenizer, completion.prompt["content"],
                                                completion.prompt["private_spans"], rendered=False)
        except (ValueError, TypeError) as err:  # TypeError: text the tokenizer refuses
            raise ApiError(400, str(err), param=param, code="invalid_value") from None
        if not ids:
            raise ApiError(400, "the prompt is empty (no tokens to continue)", param=param, code="invalid_value")
        limit = self.info.max_prompt_tokens
        if limit is not None and len(ids) > limit:  # the service would refuse the open (RESOURCE_EXHAUSTED)
            raise ApiError(400, f"the verify service takes prompts of up to {limit} tokens; {takes} "
                                f"{len(ids)}", param=param, code="context_length_exceeded")
        room = self.info.max_context - len(ids)
        wanted = completion.max_tokens or self.config.max_new_tokens
        if room < 1 or (completion.max_tokens is not None and completion.max_tokens > room):
            raise ApiError(400, f"the target's context holds {self.info.max_context} tokens; {takes} "
                                f"{len(ids)} and max_tokens asks for {wanted}", param=param if room < 1 else "max_tokens",
                           code="context_length_exceeded")
        guard = PrivacyGuard(tuple(ids), tuple(mask), placeholder_token(self.tokenizer), self.config.private_ngram,
                             decode=self.tokenizer.decode)
        return ids, (guard if guard.active else None), min(wanted, room)

    def sampling(self, completion: Completion) -> SamplingParams:
        """The request's fields over the daemon's defaults (`splitspec up`'s sampling flags)."""
        config = self.config
        temperature = config.temperature if completion.temperature is None else completion.temperature
        top_p = config.top_p if completion.top_p is None else completion.top_p
        seed = completion.seed if completion.seed is not None else config.seed
        return SamplingParams(temperature, top_p, config.top_k, secrets.randbits(63) if seed is None else seed,
                              config.penalty, config.penalty_window)

    def submit(self, completion: Completion, sink: Sink) -> Job:
        """Queue a completion (prepare + sampling first, so a bad one is refused before it waits).

        Raises:
            ApiError: see `check_model`, `prepare`; Busy (429) when max_queue requests wait already.
        """
        self.check_model(completion.model)
        if completion.conversation is not None and (self.history is None
                                                    or not self.history.has_conversation(completion.conversation)):
            raise ApiError(404, f"no conversation {completion.conversation} in this daemon's chat history",
                           param="splitspec.conversation", code="conversation_not_found")
        prompt_ids, privacy, max_new = self.prepare(completion)
        sampling = self.sampling(completion)
        job = Job(completion, prompt_ids, privacy, sink)
        with self._lock:
            if self.closing:
                raise ShuttingDown()
            if self.pending > self.config.max_queue:
                self.counts["refused"] += 1
                raise Busy(self.pending - 1)
            self.pending += 1
            self._jobs.add(job)
        job.on_cancel = lambda: self._cancelled(job)
        self._worker.submit(self._run, job, sampling, max_new)
        return job

    def link_up(self, timeout_s: float = 1.0) -> bool:
        """Whether the verify service answers a health probe within `timeout_s` (always so with
        --local). Remembered: a request that begins while the link is known down gets its 503
        after one probe (`_answer`), not after the loop's wait for the link."""
        up = self.setup.decoder.verifier.probe(timeout_s)
        self.link_down = not up
        return up

    def status(self) -> dict:
        with self._lock:
            return {"busy": self.pending > 0, "waiting": max(0, self.pending - 1), "requests": dict(self.counts)}

    def shut_down(self) -> None:
        """The daemon is stopping: every running and waiting request ends now with 503
        (`ShuttingDown`) instead of being cut off by the HTTP server's shutdown, and later ones are
        refused. The running answer ends at its next token; what it wrote stays in the chat
        history (marked incomplete). Safe from any thread; not from a signal handler (it locks)."""
        with self._lock:
            self.closing = True
            jobs = list(self._jobs)
        for job in jobs:
            job.sink(Failed(ShuttingDown()))  # a listener reads the first Failed only
            job.cancel()

    def close(self) -> None:
        """Stop taking work; the running answer ends at its next token."""
        self._worker.shutdown(wait=False, cancel_futures=True)

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether no answer is running, waiting up to `timeout_s` seconds for the running one to
        end. One model step cannot be interrupted: a verify step, or one chunk of a prompt's prefill
        (a cancelled answer's prefill stops at the next chunk: `Verifier.open`'s `cancelled`)."""
        with self._idle:
            return self._idle.wait_for(lambda: self.running == 0, timeout_s)

    # --- the worker ---------------------------------------------------------------------------

    def _cancelled(self, job: Job) -> None:
        """A job cancelled before the worker took it leaves the queue now, not when its turn comes."""
        with self._lock:
            if not job.started:
                self._leave(job, "cancelled")

    def _leave(self, job: Job, outcome: str) -> None:
        """Count `job` out of the pending requests, once (call under the lock)."""
        if not job.left:
            job.left = True
            self._jobs.discard(job)
            self.pending -= 1
            self.counts[outcome] += 1

    def _run(self, job: Job, sampling: SamplingParams, max_new: int) -> None:
        with self._lock:
            if job.left:  # cancelled while waiting, and counted then
                return
            job.started = True
            self.running += 1
        outcome = "cancelled"
        try:
            if not job.cancelled.is_set():
                outcome = self._answer(job, sampling, max_new)
        except ApiError as err:
            outcome = "failed"
            job.sink(Failed(err))
        except Exception as err:  # the loop's LinkDown, a gRPC refusal, a bug: the daemon lives on
            outcome = "failed"
            error = server_error(err)
            if error.status == 500:
                log.exception("answer failed")
            else:  # expected: the verify service unreachable or refusing, which the message says
                log.warning("answer failed: %s", error.message)
            if isinstance(err, LinkDown):
                self.link_down = True
            job.sink(Failed(error))
        finally:
            with self._lock:
                self._leave(job, outcome)
                self.running -= 1
                self._idle.notify_all()

    def _answer(self, job: Job, sampling: SamplingParams, max_new: int) -> str:
        if self.link_down and not self.link_up():
            # known down and still so: 503 now, before the history is written. The loop would wait
            # its final_wait_s (30 s) for a service that may be restarting, holding the worker and
            # every request queued behind it; a link that drops mid-answer still goes offline.
            raise LinkDown("it did not answer a health probe (/health reports the link down); retry later")
        # a text completion continues the prompt's text: decoded after its last tokens (AnswerText)
        context = job.prompt_ids[-CONTEXT_TOKENS:] if job.completion.prompt is not None else ()
        text = AnswerText(self.tokenizer, job.completion.stop, context)
        writer, message = self._history_writer(job.completion)

        def on_event(event) -> None:
            if writer is not None:
                writer(event)
            for delta in text.feed(event):
                job.sink(delta)

        gen = None
        try:
            gen = self.setup.decoder.generate(job.prompt_ids, max_new, sampling, on_event=on_event,
                                              privacy=job.privacy,
                                              should_stop=lambda: text.stopped, cancelled=job.cancelled.is_set)
        finally:
            # what the client wrote from private spans, in the answer's text: stored tagged, and sent
            spans = None if gen is None else private_answer_spans(self.tokenizer, gen.tokens, gen.sources, text.text,
                                                                  decode=text.decode)
            if message is not None:  # what was written stays, also when the answer was cut short (complete = 0)
                if spans is None:  # the answer failed: what its committed token rows say
                    rows = self.history.tokens(message)
                    spans = private_answer_spans(self.tokenizer, [t for t, _ in rows], [s for _, s in rows],
                                                 text.text)
                self.history.finish(message, with_private_tags(text.text, spans),
                                    complete=gen is not None and not job.cancelled.is_set())
        if job.cancelled.is_set():
            return "cancelled"
        for delta in text.finish():
            job.sink(delta)
        reason = "stop" if text.stopped or gen.stopped_by_eos else "length"
        private = sum(job.privacy.mask) if job.privacy else 0
        tokens = text.tokens_holding(len(text.text)) if text.stopped else gen.stats.new_tokens
        job.sink(Finished(text.text, reason, gen, len(job.prompt_ids), private, text.retracted, tokens, tuple(spans)))
        return "completed"

    def _history_writer(self, completion):
        """(event consumer mirroring the answer into the history, its message id), or (None, None)
        for a request without `splitspec.conversation`. Writes the request's last user message."""
        if completion.conversation is None or self.history is None:
            return None, None
        users = [m for m in completion.messages if m["role"] == "user"]
        if users:
            last = users[-1]  # the history keeps tags (what the chat page shows and sends back)
            self.history.add_message(completion.conversation, "user",
                                     with_private_tags(last["content"], last.get("private_spans", ())))
        message = self.history.add_message(completion.conversation, "assistant", "", complete=False)
        return self.history.answer_writer(message), message


def server_error(err: Exception) -> ApiError:
    """The OpenAI error object of an error an answer (or a handler) ended with: 503 when the
    verify service is unreachable, the answer to its refusal (`refusal_error`), else (a bug) 500."""
    if isinstance(err, LinkDown):
        return ApiError(503, f"the verify service is unreachable: {err}", type="server_error",
                        code="verify_service_unreachable")
    if isinstance(err, grpc.RpcError):
        return refusal_error(err)
    return ApiError(500, f"{type(err).__name__}: {err}", type="server_error", code="internal_error")


def refusal_error(err: grpc.RpcError) -> ApiError:
    """A verify service's refusal as an HTTP answer, with the service's own words (`details()`).

    RESOURCE_EXHAUSTED with a retry hint (server/limits.py: the service full of sessions or KV for
    now, or this daemon over its call rate; `--busy-wait` retried it already) is 503 with
    Retry-After; without one (server/validation.py: a prompt, context, KV or reply over a limit of
    the service) waiting does not help: 400. A refused token or certificate is the daemon's
    setup, not the request: 502, as is any other refusal of what the daemon sent.
    """
    code, details = err.code(), err.details()
    said = f"the verify service answered {code.name}: {details}"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        hint = retry_hint_s(err)
        if hint is not None:
            return ApiError(503, f"{said}; retry later", type="server_error", code="verify_service_busy",
                            headers={"Retry-After": str(max(1, math.ceil(hint)))})
        return ApiError(400, f"{said} (a shorter conversation or max_tokens may fit)", code="server_limit_exceeded")
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return ApiError(502, f"the verify service refused this daemon's credentials ({code.name}: {details}); "
                             "check `splitspec up`'s --auth-token-file ($SPLITSPEC_AUTH_TOKEN) or TLS client "
                             "certificate", type="server_error", code="verify_service_auth_failed")
    return ApiError(502, said, type="server_error", code="verify_service_refused")
