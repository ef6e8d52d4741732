"""Network-aware draft trees: the client picks each step's tree shape from what it measures as it
runs (issue 13; MoA, seed 001, names adapting the draft to the network as future work).

Measured online, per answer and carried across answers of one decoder:
- the link's cost per call: the client's round trip minus the server's own time (EWMA);
- the server's verify time against the positions scored, `a + b * positions`, a least-squares fit
  shrunk toward a prior slope (a fixed tree alone cannot identify the slope);
- the drafter's time against tree depth, `c + d * depth`, fitted the same way;
- the drafter's commit after each step against the tokens it took in, `e + f * tokens`, the same way;
- acceptance by depth and sibling rank: how often the accepted path's child at depth k was the
  r-th ranked child of its parent, among the times a parent on the path offered an r-th child.

Cost model (EAGLE-2's dynamic tree, Li et al. 2024, §4, with the expected-length argument of
Leviathan et al. 2023, §3.5 extended to trees): with a_k(r) the chance that the rank-r child at
depth k is accepted once the path reached its parent, a node's chance of being on the accepted path
is the product of a_k(r_k) along its path, and a tree yields the sum of those chances over its
nodes, plus the bonus token. The planner builds each shape as EAGLE-2 does, with these chances
standing in for the drafter's joint probabilities: the root's top-B children, then at each depth the
B best frontier nodes expanded into B children each, and of all nodes created the N best kept, so

    E[tokens] = 1 + G + sum over the N kept nodes v of prod_{k on the path to v} a_k(r_k)

per call (until session 31 it assumed every depth of a D-deep tree held N // D nodes, which
overrated deep trees: reranking keeps most nodes near the root) and costs draft(D) + link +
verify(N + 1 + X) + commit(E) milliseconds (commit: the drafter's work on the step's verified tokens
afterwards, at the expected tokens; MoA's LSA runs there, ~7.5 ms a step on an AVX2 CPU, session
46), X the rows a step's tree carries beyond the N it was asked for (a
merged prompt-lookup chain's own nodes, client/drafters/ngram.py `PromptLookupMerge`; an EWMA of
what the verified trees held) and G the tokens those rows got accepted (an EWMA too). The a_k are
learnt from the drafter's own nodes only: a token accepted through a lookup node is the chain's, not
a wider tree's, and crediting it to the drafter's lower-ranked children would make wide trees look
better than they are. The planner picks the (D, B, N) of a grid that maximises E[tokens] / cost, or
no tree at all (one token per call, no drafting) when even the smallest tree costs more than it
returns (never before `warmup_trees` trees were verified); after `probe_every` such steps in a
row it sends the best tree once anyway, since steps without a tree measure neither acceptance nor
tree costs, and the cost fits weight recent steps more.

How far that sum is from what the sent trees return is kept for the report: for every tree sent
the predicted chance of the accepted path reaching each depth (the kept nodes' chances there) and
whether it did, both decayed by `reach_half_life` steps. Session 47 tried scaling each depth's
chances by their ratio (a per-depth calibration): on 28 Spec-Bench prompts it made trees look worse
than sending none 71 times against 8, and the planner slower (0.92x the fixed 2x2x4 tree against
0.96x uncalibrated, docs/benchmarks.md "Session 47"), so the ratio is reported, not applied.

Every choice is a valid tree for the same drafter, so decoding stays lossless whatever is chosen.
When the link changes (4g -> lan), the EWMA of its cost follows within a few calls and so does the
choice.
"""
from __future__ import annotations

import collections
import functools
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from splitspec.shared.config import TreeConfig
from splitspec.shared.tree import ROOT, DraftTree
from splitspec.shared.verifier import CallStats

MAX_DEPTH = 8
MAX_RANK = 4
DEFAULT_STEP_MS = 40.0  # a one-position verify before anything is measured (SmolLM2-135M on the CPU)


@dataclass(frozen=True)
class PlannerConfig:
    """The grid the planner chooses from and its priors.

    depths, top_bs, node_counts: candidate tree shapes (N >= D and N <= D * B are kept).
    prior_accept: prior chance that the top-ranked child at depth 1 is accepted; rank r gets
        prior_accept * rank_decay ** r and depth k a factor depth_decay ** (k - 1); each prior
        counts as `prior_weight` observations.
    link_alpha: EWMA weight of the newest link cost.
    verify_slope_prior: prior verify cost per extra position, as a share of the one-position
        time (0.15: 5 positions ~1.6x one on the project's CPU, docs/benchmarks.md "Cost model").
    draft_slope_prior: prior drafting ms per level, as a share of the one-position verify time.
    commit_slope_prior: prior commit ms per extra token, as a share of a one-token commit (MoA on an
        AVX2 CPU: 5.9 ms for one, 7.9 for three, session 47). A proportional prior (1.0) priced a
        3-token commit at 3x one whenever most recent steps sent no tree (all their commits are of
        one token), which made trees look dear and kept the planner on one token a call.
    window, half_life: the cost fits keep the last `window` steps, each weighted by half per
        `half_life` newer steps, so a slow spell (another answer's long context, a busy machine)
        stops steering the choice within a few dozen steps.
    probe_every: after this many steps in a row without a tree, the best tree is sent once anyway.
        Sending none teaches the planner nothing about trees (no acceptance, no tree cost), so
        without probes one overrated cost kept it on one token per call for whole answers
        (session 46, an AVX2 laptop-class CPU: 325 of ~830 steps, 6 of 28 answers entirely).
    reach_half_life: steps until a step's weight halves in the reported reach by depth (module
        docstring).
    warmup_trees: a fresh planner sends its best tree, never none, until it has seen this many
        trees verified. Before that its acceptance is the prior's and the tokens prompt-lookup
        chains add (`lookup_gain`, ~1.5 a step for moa on Spec-Bench) are still 0, so trees look
        worth ~1.4 tokens and one plain token wins: session 47's first answers sent no tree for
        most of their steps, probing only every `probe_every`-th.
    """

    depths: tuple[int, ...] = (1, 2, 3, 4, 5, 6)
    top_bs: tuple[int, ...] = (1, 2, 3, 4)
    node_counts: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24)
    prior_accept: float = 0.35
    rank_decay: float = 0.4
    depth_decay: float = 0.9
    prior_weight: float = 4.0
    link_alpha: float = 0.3
    verify_slope_prior: float = 0.15
    draft_slope_prior: float = 0.15
    commit_slope_prior: float = 0.15
    window: int = 64
    half_life: float = 16.0
    probe_every: int = 8
    reach_half_life: float = 64.0
    warmup_trees: int = 16


def path_ranks(tree: DraftTree, accepted: Sequence[int], drafted: int | None = None
               ) -> list[tuple[int, int | None]]:
    """For each depth the accepted path reached a parent of: (children offered, rank of the
    accepted child or None). Siblings are ranked by index (the drafters order them by score).

    `accepted` are the accepted draft tokens, root first; a rejected depth ends the list.
    `drafted`: nodes 0 .. drafted-1 are the drafter's, the rest a prompt-lookup chain's
    (client/drafters/ngram.py `PromptLookupMerge` appends them): only the drafter's children are
    offered and ranked, and the list ends where the path leaves them (`lookup_tokens` counts what
    the chain got accepted after that).
    """
    out: list[tuple[int, int | None]] = []
    parent = ROOT
    limit = tree.size if drafted is None else drafted
    for depth in range(len(accepted) + 1):
        children = [c for c in tree.children(parent) if c < limit]
        if not children:
            break
        if depth == len(accepted):
            out.append((len(children), None))
            break
        token = accepted[depth]
        rank = next((r for r, c in enumerate(children) if tree.tokens[c] == token), None)
        out.append((len(children), rank))
        if rank is None:  # rejected, or accepted through a lookup node: nothing more to learn here
            break
        parent = children[rank]
    return out


def lookup_tokens(tree: DraftTree, accepted: Sequence[int], drafted: int | None) -> int:
    """How many of the `accepted` draft tokens lie on prompt-lookup nodes (index >= `drafted`) of
    `tree`: the tokens a step gained from the chain beyond the drafter's own tree."""
    if drafted is None or drafted >= tree.size:
        return 0
    parent, gained = ROOT, 0
    for token in accepted:
        node = next((c for c in tree.children(parent) if tree.tokens[c] == token), None)
        if node is None:
            break
        gained += node >= drafted
        parent = node
    return gained


def node_chances(rates: np.ndarray, depth: int, top_b: int) -> np.ndarray:
    """The nodes of an EAGLE-2 tree of `depth` levels and `top_b` children per expanded node, built
    with acceptance chances as scores (module docstring), as each node's chance of lying on the
    accepted path, best first: the first N are the N nodes that tree keeps (a child's chance never
    exceeds its parent's, so they form a tree).

    rates: [MAX_DEPTH, MAX_RANK] `TreePlanner.accept_rates`; at a depth whose top-B rates sum past 1
    (priors, few observations) they are scaled to sum to 1 (at most one sibling is accepted).
    Returns: [n] chances, n = top_b + (depth - 1) * top_b ** 2 at most.
    """
    return node_chances_by_depth(rates, depth, top_b)[0]


def node_chances_by_depth(rates: np.ndarray, depth: int, top_b: int) -> tuple[np.ndarray, np.ndarray]:
    """`node_chances` and, in the same order, each node's depth (0 = the root's children).

    Returns: ([n] chances best first, [n] int depths).
    """
    width = min(top_b, MAX_RANK)
    chances, depths, level = [], [], np.ones(1)
    for d in range(min(depth, MAX_DEPTH)):
        row = rates[d, :width]
        row = row / max(float(row.sum()), 1.0)
        frontier = np.sort(level)[::-1][:top_b]  # the B best frontier nodes are expanded
        level = (frontier[:, None] * row[None, :]).ravel()
        chances.append(level)
        depths.append(np.full(level.size, d))
    chances_all, depths_all = np.concatenate(chances), np.concatenate(depths)
    order = np.argsort(-chances_all, kind="stable")
    return chances_all[order], depths_all[order]


class _LinearFit:
    """y = a + b x by least squares over a window, newer points weighted more (half per `half_life`
    points), with the slope shrunk toward `slope_prior(a)`."""

    def __init__(self, window: int, half_life: float = float("inf")) -> None:
        self.points: collections.deque[tuple[float, float]] = collections.deque(maxlen=window)
        self.half_life = half_life

    def add(self, x: float, y: float) -> None:
        self.points.append((x, y))

    def predict(self, x: float, slope_share: float, default: float) -> float:
        return self.line(slope_share, default)(x)

    def line(self, slope_share: float, default: float) -> Callable[[float], float]:
        """The fitted line as a function of x, fitted once: the planner values every candidate
        shape on the same fit, so it fits once a choice, not once a shape. With no points, the
        prior line `default * (1 + slope_share * (x - 1))`."""
        if not self.points:
            return lambda x: default * (1.0 + slope_share * (x - 1))
        xs = np.array([p[0] for p in self.points])
        ys = np.array([p[1] for p in self.points])
        w = 0.5 ** (np.arange(len(xs))[::-1] / self.half_life)  # the newest point weighs 1
        # ridge toward the prior slope (a share of the intercept), weighted like 4 observations
        base = float(np.median(ys / (1.0 + slope_share * (xs - 1))))
        prior_b = slope_share * base
        lam = 4.0
        x_mean, y_mean = np.average(xs, weights=w), np.average(ys, weights=w)
        sxx = float((w * (xs - x_mean) ** 2).sum())
        sxy = float((w * (xs - x_mean) * (ys - y_mean)).sum())
        # never below 0: more positions (levels, rows) cannot cost less; timing noise that hit the
        # small calls gave a negative slope, and the largest tree then looked free (qa session 54)
        b = max((sxy + lam * prior_b) / (sxx + lam), 0.0)
        a = y_mean - b * x_mean
        return lambda x: max(a + b * x, 0.0)


@dataclass
class TreePlanner:
    """Chooses each step's TreeConfig from online measurements (see the module docstring)."""

    config: PlannerConfig = PlannerConfig()
    link_ms: float | None = None
    hits: np.ndarray = field(default_factory=lambda: np.zeros((MAX_DEPTH, MAX_RANK)))
    offered: np.ndarray = field(default_factory=lambda: np.zeros((MAX_DEPTH, MAX_RANK)))

    extra_rows: float = 0.0  # EWMA of the rows a verified tree held beyond the nodes chosen (lookup chains)
    lookup_gain: float = 0.0  # EWMA of the accepted tokens a step got from lookup nodes (credited to every tree)
    # decayed sums over the trees sent: predicted chance of the accepted path reaching each depth, and
    # how often it did (reported, module docstring)
    reach_predicted: np.ndarray = field(default_factory=lambda: np.zeros(MAX_DEPTH))
    reach_observed: np.ndarray = field(default_factory=lambda: np.zeros(MAX_DEPTH))

    def __post_init__(self) -> None:
        self.verify_fit = _LinearFit(self.config.window, self.config.half_life)
        self.draft_fit = _LinearFit(self.config.window, self.config.half_life)
        self.commit_fit = _LinearFit(self.config.window, self.config.half_life)
        self.chosen: collections.Counter[str] = collections.Counter()
        self.probes = 0  # trees sent although none was predicted to pay (`PlannerConfig.probe_every`)
        self._asked_nodes = 0  # max_nodes of the last tree `choose` returned (0: none)
        self._none_streak = 0  # steps in a row `choose` sent no tree
        self._asked_reach: np.ndarray | None = None  # [MAX_DEPTH] raw predicted reach of the last tree chosen
        self.trees_seen = 0  # verified steps that carried a tree (`PlannerConfig.warmup_trees`)

    # -- measurements ------------------------------------------------------------------------

    def observe(self, tree: DraftTree, accepted: Sequence[int], call: CallStats, draft_ms: float,
                drafted: int | None = None, commit_ms: float | None = None) -> None:
        """One Verify of `tree` (not an offline chain or a forced-token call) and its outcome;
        `drafted`: the tree's first nodes that the drafter proposed (the rest came from a
        prompt-lookup chain; None = all); `commit_ms`: the drafter's commit of the step's tokens
        (accepted + bonus) afterwards, None when it did not commit (a reopened session)."""
        if commit_ms is not None:
            self.commit_fit.add(len(accepted) + 1, commit_ms)
        link = max(call.rtt_ms - call.server_total_ms, 0.0)
        alpha = self.config.link_alpha
        self.link_ms = link if self.link_ms is None else (1 - alpha) * self.link_ms + alpha * link
        if call.server_forward_ms > 0:
            self.verify_fit.add(tree.size + 1, call.server_forward_ms)
        if self._asked_nodes and tree.size:  # rows the shape did not ask for: priced into every candidate
            extra = max(tree.size - self._asked_nodes, 0)
            self.extra_rows = (1 - alpha) * self.extra_rows + alpha * extra
        depth = max(tree.depths(), default=0)
        if depth:
            self.draft_fit.add(depth, draft_ms)
        if tree.size:
            self.lookup_gain = (1 - alpha) * self.lookup_gain + alpha * lookup_tokens(tree, accepted, drafted)
            self.trees_seen += 1
        ranks = path_ranks(tree, accepted, drafted)
        for d, (offered, rank) in enumerate(ranks[:MAX_DEPTH]):
            self.offered[d, : min(offered, MAX_RANK)] += 1
            if rank is not None and rank < MAX_RANK:
                self.hits[d, rank] += 1
        if self._asked_reach is not None and tree.size:
            reached = sum(rank is not None for _, rank in ranks)  # the drafter's nodes accepted
            decay = 0.5 ** (1.0 / self.config.reach_half_life)
            self.reach_predicted = decay * self.reach_predicted + self._asked_reach
            self.reach_observed = decay * self.reach_observed
            self.reach_observed[: min(reached, MAX_DEPTH)] += 1.0
        self._asked_reach = None

    # -- the model ---------------------------------------------------------------------------

    def accept_rates(self) -> np.ndarray:
        """[MAX_DEPTH, MAX_RANK]: chance that the rank-r child at depth d is the accepted one,
        given the path reached its parent and it was offered (priors blended in)."""
        cfg = self.config
        ranks = np.arange(MAX_RANK)[None, :]
        depths = np.arange(MAX_DEPTH)[:, None]
        prior = cfg.prior_accept * cfg.rank_decay ** ranks * cfg.depth_decay ** depths
        return (self.hits + cfg.prior_weight * prior) / (self.offered + cfg.prior_weight)

    def expected_tokens(self, tree: TreeConfig | None, kept: Callable[[int, int], np.ndarray] | None = None
                        ) -> float:
        """E[tokens per call] of a tree shape (module docstring; None = no tree: 1); the bonus
        token and what prompt-lookup chains have been adding per step (`lookup_gain`) included.
        `kept`: `kept_chances` of the current rates, where a caller values many shapes."""
        if tree is None:
            return 1.0
        sums = (kept or self.kept_chances())(tree.depth, tree.top_b)
        return 1.0 + self.lookup_gain + float(sums[min(tree.max_nodes, len(sums) - 1)])

    def kept_chances(self) -> Callable[[int, int], np.ndarray]:
        """(depth, top-B) -> [n + 1] the summed chances of the best 0 .. n nodes of that EAGLE-2
        tree (`node_chances` of the current `accept_rates`), built once per shape."""
        rates = self.accept_rates()
        return functools.cache(lambda d, b: np.concatenate([[0.0], np.cumsum(node_chances(rates, d, b))]))

    def predicted_reach(self, tree: TreeConfig) -> np.ndarray:
        """[MAX_DEPTH] the chance that the accepted path reaches each depth (index 0: the root's
        children) of the tree `tree` describes: the summed chances of its kept nodes at that depth
        (the drafter's nodes only; the bonus token and lookup chains are not in it)."""
        chances, depths = node_chances_by_depth(self.accept_rates(), tree.depth, tree.top_b)
        n = min(tree.max_nodes, chances.size)
        return np.bincount(depths[:n], weights=chances[:n], minlength=MAX_DEPTH)[:MAX_DEPTH]

    def step_ms(self) -> Callable[..., float]:
        """The predicted wall time of one step, ms, as a function of the tree (None: no tree) and
        the tokens it is expected to yield (default 1): drafting + link + verify + the drafter's
        commit of those tokens, from the fits as they are now (each evaluated once). The commit
        (MoA's LSA over the verified positions, a cache append for EAGLE-2) is 0 until measured."""
        cfg = self.config
        verify = self.verify_fit.line(cfg.verify_slope_prior, DEFAULT_STEP_MS)
        one = verify(1)
        link = self.link_ms or 0.0
        draft = self.draft_fit.line(1.0, cfg.draft_slope_prior * one)
        commit = self.commit_fit.line(cfg.commit_slope_prior, 0.0)
        extra = self.extra_rows

        def step(tree: TreeConfig | None, tokens: float = 1.0) -> float:
            if tree is None:
                return link + one + commit(tokens)
            return draft(tree.depth) + link + verify(tree.max_nodes + 1 + extra) + commit(tokens)
        return step

    def candidates(self, max_depth: int, max_nodes: int) -> list[TreeConfig]:
        """The shapes (depth D, top-B, nodes N) of the config's grid with D <= `max_depth`,
        N <= `max_nodes` and D <= N <= D * B (a tree of depth D holds at least D nodes and at most B
        per level); [1x1x1] when none fits, even for limits below 1."""
        cfg = self.config
        out = [TreeConfig(d, b, n) for d in cfg.depths for b in cfg.top_bs for n in cfg.node_counts
               if d <= max_depth and n <= max_nodes and d <= n <= d * b]
        return out or [TreeConfig(1, 1, 1)]

    def choose(self, max_depth: int = MAX_DEPTH, max_nodes: int = 64) -> TreeConfig | None:
        """The candidate tree with the most expected tokens per millisecond; None when no tree
        beats sending none (the loop then asks the target for one token, drafting nothing), except
        every `probe_every`-th step in a row, which sends the best tree to measure it again, and
        during the warm-up (`PlannerConfig.warmup_trees`)."""
        kept, step_ms = self.kept_chances(), self.step_ms()
        none_rate = 1.0 / max(step_ms(None), 1e-3)
        best, best_rate = None, 0.0
        for tree in self.candidates(max_depth, max_nodes):
            tokens = self.expected_tokens(tree, kept)
            rate = tokens / max(step_ms(tree, tokens), 1e-3)
            if rate > best_rate:
                best, best_rate = tree, rate
        if best_rate <= none_rate and self.trees_seen >= self.config.warmup_trees:
            self._none_streak += 1
            if self._none_streak < self.config.probe_every:
                best = None
            else:
                self.probes += 1
        if best is not None:
            self._none_streak = 0
        self.chosen["none" if best is None else f"{best.depth}x{best.top_b}x{best.max_nodes}"] += 1
        self._asked_nodes = 0 if best is None else best.max_nodes
        self._asked_reach = None if best is None else self.predicted_reach(best)
        return best

    def report(self) -> dict:
        """What the planner believes and chose so far (for stats and benchmarks)."""
        return {"link_ms": None if self.link_ms is None else round(self.link_ms, 2),
                "verify_ms_1": round(self.verify_fit.predict(1, self.config.verify_slope_prior, DEFAULT_STEP_MS), 2),
                "verify_ms_9": round(self.verify_fit.predict(9, self.config.verify_slope_prior, DEFAULT_STEP_MS), 2),
                "commit_ms_1": round(self.commit_fit.predict(1, self.config.commit_slope_prior, 0.0), 2),
                "commit_ms_3": round(self.commit_fit.predict(3, self.config.commit_slope_prior, 0.0), 2),
                "extra_rows": round(self.extra_rows, 2),
                "lookup_gain": round(self.lookup_gain, 3),
                "accept_top1_by_depth": [round(float(r), 3) for r in self.accept_rates()[:, 0]],
                "reach_predicted": [round(float(r), 1) for r in self.reach_predicted],
                "reach_observed": [round(float(r), 1) for r in self.reach_observed],
                "chosen": dict(self.chosen), "probes": self.probes}
