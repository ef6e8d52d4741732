"""The in-process verifier: single-device mode, the target runner beside the loop in one process.

`LocalVerifier` implements shared/verifier.py's `Verifier` on a `TargetRunner` directly: no
network, no serialization; call times are measured around the runner.
"""
from __future__ import annotations

import time

from splitspec.shared.config import ServerLimits
from splitspec.shared.models import eos_token_ids, load_model, tokenizer_fingerprint
from splitspec.shared.verifier import (CallStats, OpenCancelled, OpenResult, ServerInfo, StepResult, Verifier,
                                      VerifierSession)

from .runner import TargetRunner

# prompt tokens per forward of a cancellable open: the service's default `--prefill-chunk`
PREFILL_CHUNK = ServerLimits().prefill_chunk


class LocalVerifier(Verifier):
    """Single-device mode: the target runs in this process."""

    def __init__(self, runner: TargetRunner, max_tree_nodes: int = 64, max_tree_depth: int = 32) -> None:
        self.runner = runner
        self.target_model = runner.model
        self.info = ServerInfo(
            model_id=runner.model_id, tokenizer_fingerprint=tokenizer_fingerprint(runner.tokenizer),
            vocab_size=runner.vocab_size, num_layers=runner.num_layers, hidden_size=runner.config.hidden_size,
            max_context=runner.max_positions, max_tree_nodes=max_tree_nodes, max_tree_depth=max_tree_depth,
            max_draft_support=1 << 30, eos_token_ids=tuple(eos_token_ids(runner.model, runner.tokenizer)),
            lsa_ids=tuple(runner.lsa_modules))

    def open(self, prompt_ids, sampling, features, cancelled=None):
        """`Verifier.open`; with `cancelled`, a prompt longer than PREFILL_CHUNK tokens is prefilled
        in chunks of that many (server/runner.py `prefill_chunk`), `cancelled` asked before each."""
        if features.lsa_id and features.lsa_id not in self.runner.lsa_modules:
            raise ValueError("LSA placement 'server' needs a target runner hosting that drafter's LSA; "
                             "in single-device mode use --lsa-placement client")
        start = time.perf_counter()
        prefill = None
        if cancelled is not None:
            prefill = self.runner.start_prefill(list(prompt_ids), features)
            while True:
                if cancelled():
                    raise OpenCancelled("the open was cancelled during its prefill")
                if prefill.left <= PREFILL_CHUNK:
                    break
                self.runner.prefill_chunk(prefill, PREFILL_CHUNK)
        session, batch, forward_ms = self.runner.open(list(prompt_ids), sampling, features, prefill=prefill)
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


def load_local_verifier(target: str, device: str = "cpu", dtype: str = "float32"):
    """(LocalVerifier of `target` loaded in this process, its tokenizer): the LocalVerifierFactory
    single-device clients get from the composition root (client/build.py)."""
    model, tokenizer, model_id = load_model(target, device=device, dtype=dtype)
    return LocalVerifier(TargetRunner(model, tokenizer, model_id)), tokenizer
