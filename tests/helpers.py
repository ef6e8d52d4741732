"""Helpers the tests share (fixtures live in conftest.py): paths of the data beside the checkout,
the target-only greedy reference, an oracle drafter, a verifier whose link fails on cue, a
stream-event log, and zstd decompression bombs."""
from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

import zstandard

from splitspec.client.drafters import Drafter, Proposal
from splitspec.client.loop import KEPT, OFFLINE, TARGET, OfflinePolicy
from splitspec.server.local import LocalVerifier
from splitspec.shared.reference import target_greedy
from splitspec.shared.tree import DraftTree
from splitspec.shared.verifier import LinkDown, SessionLost, VerifierSession

SHARED = Path(__file__).resolve().parents[2] / "shared"
STORIES = Path(os.environ.get("SPLITSPEC_STORIES", SHARED / "models" / "stories260K" / "hf"))
SPEC_BENCH = SHARED / "data" / "spec_bench" / "question.jsonl"
FAST = OfflinePolicy(backoff_initial_s=0.01, backoff_max_s=0.05, final_wait_s=20)


@functools.lru_cache(maxsize=None)
def zstd_zeros(nbytes: int, declare_size: bool) -> bytes:
    """One zstd frame of `nbytes` zero bytes (a decompression bomb: 256 MiB make ~10 KB), compressed
    1 MiB at a time so the test never holds them whole; its header states the size when
    `declare_size`."""
    compressor = zstandard.ZstdCompressor(level=1, write_content_size=declare_size)
    stream = compressor.compressobj(size=nbytes if declare_size else -1)
    chunk = bytes(2**20)
    parts = [stream.compress(chunk[:min(len(chunk), nbytes - at)]) for at in range(0, nbytes, len(chunk))]
    return b"".join(parts) + stream.flush()


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Target-only greedy decoding with transformers' generate(), EOS disabled: `n` tokens."""
    return target_greedy(model, prompt, n)


def check_seeded_sampling(generate, sampling) -> None:
    """What a sampled speculative answer can be checked for one answer at a time (the distribution
    itself is tests/test_sampling_e2e.py's): `generate(sampling)` (a fresh decoder each call, so the
    drafter's own random stream starts over) gives the same tokens again for the same seed and other
    tokens for another seed, and drafts were accepted (fewer target calls than tokens)."""
    first, again = generate(sampling), generate(sampling)
    other = generate(dataclasses.replace(sampling, seed=sampling.seed + 1))
    assert first.tokens == again.tokens
    assert first.tokens != other.tokens
    assert first.stats.new_tokens > first.stats.target_calls


class OracleDrafter(Drafter):
    """Knows the reference continuation. `right=True`: each depth holds the correct token, placed
    after `wrong_siblings` wrong ones; `right=False`: every proposed token is wrong."""

    def __init__(self, prompt: list[int], reference: list[int], vocab: int, *, right: bool,
                 depth: int = 4, wrong_siblings: int = 1) -> None:
        self.full = list(prompt) + list(reference)
        self.vocab, self.right, self.depth, self.wrong = vocab, right, depth, wrong_siblings
        self.name = "always-right" if right else "always-wrong"

    def reset(self, prompt_ids, features) -> None:
        pass

    def propose(self, context, limits, sampling) -> Proposal:
        depth = min(self.depth, limits.max_depth, limits.max_nodes // (self.wrong + 1))  # within the node limit
        truth = self.full[len(context): len(context) + depth]
        tokens, parents, parent = [], [], -1
        for tok in truth:
            wrongs = [(tok + k) % self.vocab for k in range(1, self.wrong + 1)]
            for w in wrongs:
                tokens.append(w)
                parents.append(parent)
            if not self.right:
                parent = len(tokens) - 1  # descend through a wrong node: nothing below is reachable
                continue
            tokens.append(tok)
            parents.append(parent)
            parent = len(tokens) - 1
        return Proposal(DraftTree(tuple(tokens), tuple(parents)))


class FlakyVerifier(LocalVerifier):
    """A local target whose link fails on chosen Verify calls (counted across sessions).

    `fail`: call number -> "before" (the request never reached the server) or "after" (the server
    ran it; the reply was lost), or "lost" (the server restarted: SessionLost). `down_probes`:
    how many reconnect probes fail after each failure.
    """

    def __init__(self, runner, fail: dict[int, str], down_probes: int = 3, gate=None) -> None:
        """`gate`: optional callable; the link stays down until it returns True as well."""
        super().__init__(runner)
        self.fail, self.down_probes, self.gate = dict(fail), down_probes, gate
        self.calls = 0
        self.probes_left = 0
        self.replays = 0

    def open(self, prompt_ids, sampling, features, **kwargs):
        session, opened = super().open(prompt_ids, sampling, features, **kwargs)
        return _FlakySession(self, session), opened

    def probe(self, timeout_s: float = 1.0) -> bool:
        self.probes_left -= 1
        return self.probes_left < 0 and (self.gate is None or self.gate())


class _FlakySession(VerifierSession):
    def __init__(self, owner: FlakyVerifier, inner) -> None:
        self.owner, self.inner = owner, inner
        self.in_flight = None  # (args, result or None)

    def verify(self, tree, draft_probs, forced_tokens=()):
        assert self.in_flight is None, "a new step while one is unresolved"
        self.owner.calls += 1
        how = self.owner.fail.pop(self.owner.calls, None)
        if how == "lost":
            raise SessionLost("unknown or expired session")
        if how is None:
            return self.inner.verify(tree, draft_probs, forced_tokens)
        result = self.inner.verify(tree, draft_probs, forced_tokens) if how == "after" else None
        self.in_flight = ((tree, draft_probs, forced_tokens), result)
        self.owner.probes_left = self.owner.down_probes
        raise LinkDown("injected: link down")

    def resume(self):
        if self.in_flight is None:
            return None
        args, result = self.in_flight
        self.in_flight = None
        if result is not None:
            self.owner.replays += 1
            return result  # the server's record of a step it already ran
        return self.inner.verify(*args)

    def close(self) -> None:
        self.inner.close()


class EventLog:
    """Applies stream events to a copy of the answer, checking each token arrives exactly once."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.sources: list[str] = []
        self.kinds: list[str] = []

    def __call__(self, event) -> None:
        self.kinds.append(event.kind)
        if event.kind == "tokens":
            assert event.start == len(self.tokens), "a token delivered twice or out of order"
            self.tokens += event.tokens
            self.sources += [event.source] * len(event.tokens)
        elif event.kind == "retract":
            assert 0 <= event.start < len(self.tokens)
            del self.tokens[event.start:], self.sources[event.start:]
        else:
            span = range(event.start, event.start + event.count)
            assert all(self.sources[i] == OFFLINE for i in span), "only offline tokens are confirmed or kept"
            for i in span:
                self.sources[i] = TARGET if event.kind == "verified" else KEPT
