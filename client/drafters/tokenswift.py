"""Runtime of TokenSwift drafting (seed 003 §2.2): multi-token heads plus token reutilization.

The server's verification already computes h_0, the target's final hidden state at the last
verified position (it picked the pending token), and returns it as a feature. The gamma heads
(shared/drafters/tokenswift.py) turn it into the logits of the gamma tokens after the pending
one; as in Medusa, depth d of the tree draws from head d whatever its parent, and the tree is
grown and reranked by joint probability (client/drafters/dynamic_tree.py). Token reutilization:
the n-grams of the text so far that start with the pending token (TokenSwift retrieves those
starting with argmax p_0, which is the pending token here), the `ngram_top_k` most frequent
first, are merged into the tree as chains, sharing prefixes with the heads' nodes.

Departures from the paper, each because split decoding makes it moot or unsafe:
- no drafting forward of the target: TokenSwift runs the target (with a partial KV cache) to get
  h_0 and p_0; here both come with the verification the server already ran with its full cache,
  so the client needs no target weights and the partial KV cache has nothing to speed up;
- n-gram chains join greedy trees only: under sampling a draft must be drawn from the rows it is
  judged against (shared/acceptance.py), which reused n-grams are not;
- the contextual penalty (§2.4) is not the drafter's: it changes the target's distribution, so the
  server applies it before acceptance (`SamplingParams.penalty`, `--contextual-penalty`) and the
  output is exact for the penalised target; the heads draft as they were trained.
Without features for the position before the pending token (offline or private tokens) the
heads cannot draft; only n-gram chains are proposed then.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Sequence

import torch

from splitspec.shared.config import TreeConfig
from splitspec.shared.drafters.target_parts import TargetParts
from splitspec.shared.drafters.tokenswift import TokenSwiftHeads
from splitspec.shared.features import FeatureBatch, FeatureRequest
from splitspec.shared.sampling import SamplingParams, Stream, make_generator
from splitspec.shared.tree import DraftTree
from splitspec.v1 import verify_pb2 as pb

from .base import DraftLimits, Drafter, Growing, Proposal, check_contiguous
from .dynamic_tree import build_tree
from .ngram import merge_chains


class NgramIndex:
    """Counts of the n-grams of a growing token sequence, by first token (token reutilization)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.reset()

    def reset(self) -> None:
        self.grams: dict[int, Counter] = {}
        self.indexed = 0  # n-grams starting before this position are counted

    def update(self, tokens: Sequence[int]) -> None:
        for i in range(self.indexed, len(tokens) - self.n + 1):
            self.grams.setdefault(tokens[i], Counter())[tuple(tokens[i + 1: i + self.n])] += 1
        self.indexed = max(self.indexed, len(tokens) - self.n + 1)

    def continuations(self, first: int, k: int) -> list[tuple[int, ...]]:
        """The k most frequent continuations of `first` (ties: the one seen first)."""
        return [gram for gram, _ in self.grams.get(first, Counter()).most_common(k)]


class TokenSwiftRuntime(Drafter):
    """TokenSwift's heads over the target's final hidden state plus n-gram chains (module
    docstring). `ngram`: the n of the reused n-grams; `ngram_top_k`: how many of the most frequent
    ones join a greedy tree. `tree`: the dynamic tree's depth, top-B and node count; `quantization`: the
    feature format asked of the server (pb.QUANTIZATION_*); `seed`: the user's seed, from which the
    drafter's own random stream (`Stream.DRAFTER`, sampled drafts) is derived."""

    name = "tokenswift"

    def __init__(self, module: TokenSwiftHeads, parts: TargetParts, tree: TreeConfig = TreeConfig(), *,
                 ngram: int = 4, ngram_top_k: int = 2, quantization: int = pb.QUANTIZATION_NONE,
                 seed: int = 0) -> None:
        self.module, self.parts, self.tree = module, parts, tree
        self.ngram_top_k = ngram_top_k
        self.index = NgramIndex(ngram)
        self.feature_request = FeatureRequest(hidden_layers=(-1,), quantization=quantization)
        self.dtype = parts.dtype
        self.generator = make_generator(seed, Stream.DRAFTER)
        self.reset((), FeatureBatch(0, 0))

    def reset(self, prompt_ids, features: FeatureBatch) -> None:
        self.features = Growing(torch.zeros(0, self.module.config.hidden_size, dtype=self.dtype))  # [verified, E]
        self.index.reset()
        if features.count:
            self.commit((), features)

    def commit(self, new_tokens, features: FeatureBatch) -> None:
        check_contiguous(features, len(self.features))
        self.features.append(features.hidden[-1])

    def rollback(self, length: int) -> None:
        self.index.reset()  # recounted from the context at the next proposal

    @torch.inference_mode()
    def propose(self, context: Sequence[int], limits: DraftLimits, sampling: SamplingParams) -> Proposal:
        pending = len(context) - 1
        max_nodes = min(self.tree.max_nodes, limits.max_nodes)
        self.index.update(context)
        chains = []
        if sampling.greedy:
            chains = [c[: limits.max_depth] for c in self.index.continuations(context[-1], self.ngram_top_k)]
        chain_nodes = len(merge_chains(DraftTree.empty(), chains, max_nodes).tokens)
        if len(self.features) < pending or pending < 1:  # no h_0: n-gram chains only
            return Proposal(merge_chains(DraftTree.empty(), chains, max_nodes))
        logits = self.parts.head(self.module(self.features[pending - 1])).float()  # [gamma, V]: depths 1..gamma
        tree = replace(self.tree, depth=min(self.tree.depth, len(logits)),
                       max_nodes=max(1, max_nodes - min(chain_nodes, max_nodes // 2)))

        def expand(frontier: list[int], pool) -> torch.Tensor:
            return logits[pool[frontier[0]].depth].expand(len(frontier), -1)

        proposal = build_tree(logits[0], expand, tree, limits, sampling, self.generator)
        if not chains:
            return proposal
        return Proposal(merge_chains(proposal.tree, chains, max_nodes), proposal.draft_probs)
