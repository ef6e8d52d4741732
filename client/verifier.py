"""What the speculative loop talks to: a verifier session, local (single-device) or remote (split).

Both implementations return the same small dataclasses, so client/loop.py is one loop for both
modes. `LocalVerifier` runs the server's TargetRunner in-process (no network, no serialization);
`RemoteVerifier` (client/transport.py) speaks gRPC to the verify service.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

from splitspec.server.runner import TargetRunner
from splitspec.shared.acceptance import SparseProbs
from splitspec.shared.features import FeatureBatch, FeatureRequest
from splitspec.shared.models import eos_token_ids, tokenizer_fingerprint
from splitspec.shared.sampling import SamplingParams
from splitspec.shared.tree import DraftTree


@dataclass(frozen=True)
class ServerInfo:
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


class LinkDown(ConnectionError):
    """The verify service could not be reached or a call missed its deadline. The request may or may
    not have run on the server; `VerifierSession.resume` finds out."""


class SessionLost(RuntimeError):
    """The server no longer holds the session (restarted, or the session idled past its TTL)."""


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
        tokens replacing the pending token; see VerifyRequest.forced_tokens)."""

    @abstractmethod
    def close(self) -> None: ...


class Verifier(ABC):
    info: ServerInfo

    @abstractmethod
    def open(self, prompt_ids: list[int], sampling: SamplingParams, features: FeatureRequest
             ) -> tuple[VerifierSession, OpenResult]: ...

    def close(self) -> None:
        """Release connections; sessions are closed by their owners."""

    def probe(self, timeout_s: float = 1.0) -> bool:
        """True when the verify service answers (used to reconnect after LinkDown)."""
        return True


class LocalVerifier(Verifier):
    """Single-device mode: the target runs in this process."""

    def __init__(self, runner: TargetRunner, max_tree_nodes: int = 64, max_tree_depth: int = 32) -> None:
        self.runner = runner
        self.info = ServerInfo(
            model_id=runner.model_id, tokenizer_fingerprint=tokenizer_fingerprint(runner.tokenizer),
            vocab_size=runner.vocab_size, num_layers=runner.num_layers, hidden_size=runner.config.hidden_size,
            max_context=runner.max_positions, max_tree_nodes=max_tree_nodes, max_tree_depth=max_tree_depth,
            max_draft_support=1 << 30, eos_token_ids=tuple(eos_token_ids(runner.model, runner.tokenizer)),
            lsa_ids=tuple(runner.lsa_modules))

    def open(self, prompt_ids, sampling, features):
        if features.lsa_id and features.lsa_id not in self.runner.lsa_modules:
            raise ValueError("LSA placement 'server' needs a target runner hosting that drafter's LSA; "
                             "in single-device mode use --lsa-placement client")
        start = time.perf_counter()
        session, batch, forward_ms = self.runner.open(list(prompt_ids), sampling, features)
        elapsed = (time.perf_counter() - start) * 1e3
        handle = _LocalSession(self.runner, session)
        return handle, OpenResult(session.pending_token, batch, CallStats(elapsed, elapsed, forward_ms))


class _LocalSession(VerifierSession):
    def __init__(self, runner: TargetRunner, session) -> None:
        self.runner = runner
        self.session = session

    def verify(self, tree, draft_probs, forced_tokens=()):
        start = time.perf_counter()
        out = self.runner.verify(self.session, tree, draft_probs, tuple(forced_tokens))
        elapsed = (time.perf_counter() - start) * 1e3
        return StepResult(out.accepted_tokens, out.accept.bonus_token, out.accept.recovered, out.features,
                          CallStats(elapsed, elapsed, out.forward_ms))

    def close(self) -> None:
        self.session = None
