"""What the speculative loop talks to: the `Verifier` interface, its sessions, and the small
dataclasses and errors they return.

Two implementations return the same types, so client/loop.py is one loop for both modes:
`LocalVerifier` (server/local.py) runs the target in-process (single-device: no network, no
serialization); `RemoteVerifier` (client/transport.py) speaks gRPC to the verify service (split).
The interface lives here, in shared/, so that the client imports no server code.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from splitspec.shared.acceptance import SparseProbs
from splitspec.shared.features import FeatureBatch, FeatureRequest
from splitspec.shared.sampling import SamplingParams
from splitspec.shared.tree import DraftTree


@dataclass(frozen=True)
class ServerInfo:
    """What the verify service reports (`Info`): the target's identity and sizes (vocab_size V,
    num_layers L, hidden_size E) and its limits: `max_context` tokens per session,
    `max_tree_nodes` / `max_tree_depth` per Verify, `max_draft_support` entries per draft-probability
    row, `max_prompt_tokens` per OpenSession (None: no limit but the context, single-device)."""

    model_id: str
    tokenizer_fingerprint: str
    vocab_size: int
    num_layers: int
    hidden_size: int
    max_context: int
    max_tree_nodes: int
    max_tree_depth: int
    max_draft_support: int
    eos_token_ids: tuple[int, ...]
    lsa_ids: tuple[str, ...] = ()
    max_prompt_tokens: int | None = None


@dataclass(frozen=True)
class CallStats:
    """One call's costs: round trip and server time in ms, serialized bytes each way."""

    rtt_ms: float
    server_total_ms: float
    server_forward_ms: float
    bytes_sent: int = 0
    bytes_received: int = 0


@dataclass(frozen=True)
class OpenResult:
    first_token: int
    features: FeatureBatch
    stats: CallStats


@dataclass(frozen=True)
class StepResult:
    """accepted_tokens: the accepted draft tokens; bonus_token: the new pending token."""

    accepted_tokens: tuple[int, ...]
    bonus_token: int
    recovered: bool
    features: FeatureBatch
    stats: CallStats

    @property
    def new_tokens(self) -> tuple[int, ...]:
        return (*self.accepted_tokens, self.bonus_token)


CANCEL_POLL_S = 0.05  # how often a remote open asks its `cancelled` while the server prefills


class OpenCancelled(Exception):
    """An open whose caller cancelled it (`Verifier.open`'s `cancelled`) before its prefill ended."""


class LinkDown(ConnectionError):
    """The verify service could not be reached or a call missed its deadline. The request may or may
    not have run on the server; `VerifierSession.resume` finds out."""


class SessionLost(RuntimeError):
    """The server no longer holds the session (restarted, or the session idled past its TTL)."""


class BadReply(RuntimeError):
    """The verify service's reply cannot be used: its features do not decode (a server of another
    version, or a bug). The step stays in flight on the client: nothing it accepted is lost."""


class VerifierSession(ABC):
    def resume(self) -> StepResult | None:
        """After LinkDown: re-send the step that failed, unchanged (same session id and step number,
        so a step the server already ran is answered from its record without model work).

        Returns:
            That step's result, or None when no step was in flight.
        Raises:
            LinkDown: still unreachable. SessionLost: the server lost the session.
        """
        return None

    @abstractmethod
    def verify(self, tree: DraftTree, draft_probs: dict[int, SparseProbs],
               forced_tokens: tuple[int, ...] = ()) -> StepResult:
        """Verify `tree` below the pending token, or below `forced_tokens` [F] (client-committed
        tokens replacing the pending token; see VerifyRequest.forced_tokens). `draft_probs`: the
        sampled nodes' proposal rows, keyed by parent node (-1 = root), each SparseProbs [S]; {}
        when greedy.

        Raises (remote sessions):
            LinkDown: unreachable or past the deadline. SessionLost: the server no longer holds the
                session. grpc.RpcError: any other refusal. RuntimeError: an earlier step is still
                unresolved (call `resume` first).
        """

    @abstractmethod
    def close(self) -> None: ...


class Verifier(ABC):
    info: ServerInfo
    #: the target model when it runs in this process (single-device), else None: self-drafting
    #: drafters (moa, eagle2) then reuse its frozen parts instead of loading their own copy
    target_model = None

    @abstractmethod
    def open(self, prompt_ids: list[int], sampling: SamplingParams, features: FeatureRequest,
             cancelled: Callable[[], bool] | None = None) -> tuple[VerifierSession, OpenResult]:
        """Prefill `prompt_ids` [P]: the session, the first token, the features of positions [0, P)
        and the call's timings. `cancelled`, when given, is polled while the prefill runs (between
        its chunks in-process; every `CANCEL_POLL_S` over gRPC, where the call is then cancelled
        and the service stops the prefill at its next chunk); True ends the open.

        Raises:
            OpenCancelled: `cancelled` returned True before the prefill was over (no session left).
            ValueError: (in-process) LSA placed on a server that does not host it.
            LinkDown, grpc.RpcError: (remote) unreachable, or refused (a full server only once
                `busy_wait_s` has run out).
        """

    def close(self) -> None:
        """Release connections; sessions are closed by their owners."""

    def probe(self, timeout_s: float = 1.0) -> bool:
        """True when the verify service answers (used to reconnect after LinkDown)."""
        return True
