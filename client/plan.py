"""What one Verify call sends, decided from the answer and the client's view of the server alone.

`plan_step` is pure: it reads the answer's tokens and provenance and what the server holds, and
names the forced tokens and the tree of the next call; the loop then asks the drafter (when the
plan says so) and sends it. Order of precedence:
1. forced tokens: the client's own tokens from the server's pending position on (private tokens
   the server saw as placeholders, offline text kept with --on-reconnect keep), or the client's
   token where it differs from the server's pending one; they replace the pending token.
2. offline tokens after them: verified as a chain (at most the server's tree depth and nodes),
   with the rows they were drawn from when the session samples and every row is known.
3. else, when the answer is finished, an empty tree to hand over the forced tokens, or no call;
   else a tree the drafter proposes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from splitspec.shared.acceptance import SparseProbs
from splitspec.shared.tree import ROOT, DraftTree

from .answer import FORCED, Answer, Provenance


@dataclass(frozen=True)
class ServerView:
    """The server's session as the client knows it: it caches the (redacted) context [0, cached)
    and holds `pending`, its own token for position `cached`."""

    cached: int
    pending: int


@dataclass(frozen=True)
class StepLimits:
    """The server's bounds on a tree, and whether the session samples (then offline tokens travel
    with the rows they were drawn from)."""

    max_tree_depth: int
    max_tree_nodes: int
    sampled: bool


@dataclass(frozen=True)
class StepPlan:
    """One Verify call. forced: [F] tokens committed in place of the pending token; tree: the
    offline chain or the empty tree to send, or None: the drafter proposes the tree."""

    forced: tuple[int, ...]
    tree: DraftTree | None
    draft_probs: dict[int, SparseProbs] = field(default_factory=dict)


def plan_step(answer: Answer, server: ServerView, limits: StepLimits) -> StepPlan | None:
    """The next Verify call (see the module docstring), or None when nothing needs sending."""
    forced, root = _forced_run(answer, server)
    if root + 1 < len(answer):
        return _offline_chain(answer, forced, root, limits)
    if answer.finished():
        return StepPlan(forced, DraftTree.empty()) if forced else None
    return StepPlan(forced, None)


def _forced_run(answer: Answer, server: ServerView) -> tuple[tuple[int, ...], int]:
    """(forced tokens [F], the position of the tree's root: the last forced token, or the pending one)."""
    pos = server.cached
    if pos >= len(answer):
        return (), pos
    differs = answer.view(pos) != server.pending
    if not differs and not (pos + 1 < len(answer) and answer.sources[pos + 1] in FORCED):
        return (), pos
    end = answer.run_end(pos + 1, FORCED)
    return tuple(answer.view(p) for p in range(pos, end)), end - 1


def _offline_chain(answer: Answer, forced: tuple[int, ...], root: int, limits: StepLimits) -> StepPlan:
    """The offline tokens after `root` as a chain, with their rows when every one is known and none
    names private text (client/privacy.py `rows_leak`)."""
    end = answer.run_end(root + 1, (Provenance.OFFLINE,), min(limits.max_tree_depth, limits.max_tree_nodes))
    tree = DraftTree.chain([answer.context[p] for p in range(root + 1, end)])
    rows = {i - 1 if i else ROOT: answer.rows.get(root + 1 + i) for i in range(tree.size)}
    known = limits.sampled and all(row is not None for row in rows.values())
    if known and answer.privacy is not None and answer.privacy.rows_leak(answer.context[:root + 1], tree, rows):
        known = False
    return StepPlan(forced, tree, rows if known else {})  # else one-hot rows on the server: verified exactly all the same
