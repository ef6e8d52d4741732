"""Prompt-lookup chains merged into another drafter's tree (`;lookup=K`, client/drafters/ngram.py)."""
from __future__ import annotations

import pytest
import torch

from splitspec.client.drafters import DraftModelDrafter
from splitspec.client.drafters.base import DraftLimits, Drafter, Proposal
from splitspec.client.drafters.ngram import PromptLookupMerge
from splitspec.client.loop import SpeculativeDecoder
from splitspec.client.transport import RemoteVerifier
from splitspec.server.local import LocalVerifier
from splitspec.server.runner import TargetRunner
from splitspec.shared.config import TreeConfig
from splitspec.shared.drafters.spec import DEFAULT_LOOKUP, DrafterSpec
from splitspec.shared.features import FeatureBatch
from splitspec.shared.models import load_model
from splitspec.shared.sampling import SamplingParams
from splitspec.shared.acceptance import SparseProbs
from splitspec.shared.tree import ROOT, DraftTree

from .helpers import OracleDrafter, reference_greedy

GREEDY = SamplingParams()
LIMITS = DraftLimits(max_depth=8, max_nodes=64)


class FixedDrafter(Drafter):
    """Always proposes `tree` (with `rows` as its draft probabilities); records what it was told."""

    def __init__(self, tree: DraftTree, rows: dict | None = None) -> None:
        self.fixed, self.rows = tree, rows or {}
        self.tree = TreeConfig()
        self.committed: list[tuple[int, ...]] = []

    def reset(self, prompt_ids, features) -> None:
        self.committed = []

    def propose(self, context, limits, sampling) -> Proposal:
        return Proposal(self.fixed, self.rows)

    def commit(self, new_tokens, features) -> None:
        self.committed.append(tuple(new_tokens))

    def report(self) -> dict:
        return {"inner": True}


# context ... 7 8 9 | 4 5 ... 7 8 -> the 3-gram (6, 7, 8) occurred before, followed by 9, 4, 5
CONTEXT = [1, 6, 7, 8, 9, 4, 5, 3, 6, 7, 8]


def test_chain_joins_the_tree_sharing_nodes():
    inner = FixedDrafter(DraftTree((9, 2, 4), (-1, -1, 0)))  # 9 -> 4 already drafted, 2 a sibling
    merged = PromptLookupMerge(inner, depth=4).propose(CONTEXT, LIMITS, GREEDY).tree
    assert merged.tokens[:3] == (9, 2, 4) and merged.parents[:3] == (-1, -1, 0)  # the inner nodes keep their places
    assert merged.tokens[3:] == (5, 3) and merged.parents[3:] == (2, 3)  # 9 4 shared, then 5 3 under them
    assert PromptLookupMerge(inner, depth=2).propose(CONTEXT, LIMITS, GREEDY).tree == inner.fixed  # 9 4: nothing new


def test_limits_bound_the_chain():
    inner = FixedDrafter(DraftTree((2,), (-1,)))
    lookup = PromptLookupMerge(inner, depth=6)
    assert lookup.propose(CONTEXT, DraftLimits(max_depth=2, max_nodes=64), GREEDY).tree.tokens == (2, 9, 4)
    assert lookup.propose(CONTEXT, DraftLimits(max_depth=8, max_nodes=3), GREEDY).tree.tokens == (2, 9, 4)
    assert lookup.propose([1, 2, 3, 4], LIMITS, GREEDY).tree == inner.fixed  # no earlier match: no chain


def test_sampling_never_adds_siblings_to_sampled_children():
    """Under sampling the chain follows the drafter's nodes and grows only below a node without a
    draft-probability row (one-hot proposals there keep acceptance lossless, shared/acceptance.py)."""
    row = SparseProbs(torch.tensor([2, 9]), torch.tensor([0.5, 0.5]))
    sampled = SamplingParams(temperature=0.8, seed=1)
    other = FixedDrafter(DraftTree((2,), (-1,)), {ROOT: row})  # the root's children were sampled: 9 may not join
    assert PromptLookupMerge(other, depth=4).propose(CONTEXT, LIMITS, sampled).tree == other.fixed
    same = FixedDrafter(DraftTree((9, 2), (-1, -1)), {ROOT: row})  # 9 was sampled; it has no row, so 4 5 3 grow below it
    merged = PromptLookupMerge(same, depth=4).propose(CONTEXT, LIMITS, sampled)
    assert merged.tree.tokens == (9, 2, 4, 5, 3) and merged.tree.parents == (-1, -1, 0, 2, 3)
    assert merged.draft_probs == {ROOT: row}
    deeper = FixedDrafter(DraftTree((9, 2, 7), (-1, -1, 0)), {ROOT: row, 0: row})  # 9's children were sampled too
    assert PromptLookupMerge(deeper, depth=4).propose(CONTEXT, LIMITS, sampled).tree == deeper.fixed


def test_counts_accepted_chain_tokens_and_forwards_the_rest():
    inner = FixedDrafter(DraftTree((9, 2), (-1, -1)))
    lookup = PromptLookupMerge(inner, depth=4)
    lookup.reset(CONTEXT, FeatureBatch(0, 0))
    lookup.propose(CONTEXT, LIMITS, GREEDY)  # adds 4 5 3 under the shared 9
    lookup.commit([9, 4, 5, 11], FeatureBatch(0, 0))  # 9 was the drafter's; 4 and 5 the chain's; 11 the bonus
    assert inner.committed == [(9, 4, 5, 11)]
    assert lookup.report() == {"inner": True, "lookup_steps": 1, "lookup_nodes": 3, "lookup_accepted": 2}
    lookup.tree = TreeConfig(depth=3, top_b=2, max_nodes=6)  # the network-aware planner's write reaches the drafter
    assert inner.tree == TreeConfig(depth=3, top_b=2, max_nodes=6) and lookup.tree is inner.tree


def test_spec_grammar():
    spec = DrafterSpec.parse("moa;lookup=4;tree=3x2x6")
    assert spec.lookup == 4 and str(spec) == "moa;lookup=4;tree=3x2x6"
    assert DrafterSpec.parse(str(spec)) == spec
    assert DrafterSpec.parse("eagle2").lookup_depth == DEFAULT_LOOKUP and str(DrafterSpec.parse("eagle2")) == "eagle2"
    assert DrafterSpec.parse("moa;lookup=0").lookup_depth == 0
    assert DrafterSpec.parse("ngram").lookup_depth == DrafterSpec.parse("none").lookup_depth == 0
    for bad in ("ngram;lookup=2", "none;lookup=2", "moa;lookup=-2", "moa;lookup=x"):
        with pytest.raises(ValueError, match="lookup"):
            DrafterSpec.parse(bad)
    assert DrafterSpec.parse("auto;lookup=4").resolve("no-such-target") == DrafterSpec("ngram")
    # options that do nothing for ngram / none made second bench arms of one drafter (QA 57)
    for bad, word in (("ngram;quant=fp8", "quant="), ("none;tree=2x2x4", "tree="), ("ngram;vocab=100", "vocab="),
                      ("swift;vocab=100", "vocab="), ("draft-model:x;vocab=9", "vocab="), ("eagle2;lsa=server", "lsa=")):
        with pytest.raises(ValueError, match=f"takes no {word}"):
            DrafterSpec.parse(bad)
    assert DrafterSpec.parse("ngram", quant="fp8", lsa="server").kind == "ngram"  # defaults fill in silently
    assert DrafterSpec.parse("moa;lsa=server;vocab=100").vocab == 100 and DrafterSpec.parse("auto;lsa=client").lsa == "client"


@pytest.mark.parametrize("mode", ["local", "split"])
def test_lossless_and_useful(stories, stories_path, serve, mode):
    """Greedy output equals target-only decoding; on repetitive text the chain carries accepted
    tokens that an always-wrong drafter never would."""
    model, tokenizer, model_id = stories
    prompt = tokenizer("Once upon a time, there was a little dog named Max. Max liked to")["input_ids"]
    ref = reference_greedy(model, prompt, 60)
    runner = TargetRunner(model, tokenizer, model_id)
    verifier = LocalVerifier(runner) if mode == "local" else RemoteVerifier(serve(runner).address)
    draft, _, _ = load_model(f"{stories_path}@layers=2")
    drafters = {"always-wrong": OracleDrafter(prompt, ref, 512, right=False, depth=3, wrong_siblings=2),
                "draft-model": DraftModelDrafter(draft, TreeConfig(depth=3, top_b=2, max_nodes=6))}
    for name, inner in drafters.items():
        lookup = PromptLookupMerge(inner, depth=4)
        gen = SpeculativeDecoder(verifier, lookup).generate(prompt, len(ref), stop_on_eos=False)
        assert gen.tokens == ref, name
        if name == "always-wrong":
            assert lookup.stats["lookup_accepted"] > 0
            assert gen.stats.target_calls == len(ref) - lookup.stats["lookup_accepted"]
