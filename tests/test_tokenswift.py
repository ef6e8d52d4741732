"""TokenSwift (seed 003): residual-chained heads, n-gram token reutilization merged into the
tree, exact decoding through the speculative loop."""
from __future__ import annotations

import pytest
import torch

from splitspec.client.drafters import DraftLimits
from splitspec.client.drafters.ngram import merge_chains
from splitspec.client.drafters.tokenswift import NgramIndex, TokenSwiftRuntime
from splitspec.client.loop import SpeculativeDecoder
from splitspec.server.local import LocalVerifier
from splitspec.server.runner import TargetRunner
from splitspec.shared.config import TreeConfig
from splitspec.shared.drafters.spec import DrafterSpec
from splitspec.shared.drafters.target_parts import TargetParts
from splitspec.shared.drafters.tokenswift import TokenSwiftConfig, TokenSwiftHeads
from splitspec.shared.features import FeatureBatch
from splitspec.shared.sampling import SamplingParams
from splitspec.shared.tree import DraftTree

from .helpers import check_seeded_sampling, reference_greedy


def test_heads_chain_with_residuals():
    heads = TokenSwiftHeads(TokenSwiftConfig(vocab_size=10, hidden_size=4, heads=3))
    h0 = torch.randn(2, 4)
    assert torch.equal(heads(h0), h0[:, None].expand(2, 3, 4))  # zero-initialised: h_i = h_0
    for layer in heads.layers:
        torch.nn.init.normal_(layer.weight)
    out, h = heads(h0), h0
    for i, layer in enumerate(heads.layers):
        h = h @ layer.weight.T + h
        torch.testing.assert_close(out[:, i], h)


def test_ngram_index_counts_continuations_by_first_token():
    index = NgramIndex(3)
    index.update([1, 2, 3, 1, 2, 4, 1, 2, 3])
    assert index.continuations(1, 2) == [(2, 3), (2, 4)]
    assert index.continuations(9, 2) == []
    index.update([1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2, 4, 1, 2, 4])  # counted incrementally
    assert index.continuations(1, 1) == [(2, 4)]


def test_merge_chains_shares_prefixes_within_the_node_limit():
    tree = DraftTree((5, 6, 7), (-1, 0, -1))
    merged = merge_chains(tree, [(5, 6, 9), (8, 1)], max_nodes=5)
    assert merged.tokens == (5, 6, 7, 9, 8) and merged.parents == (-1, 0, -1, 1, -1)


def test_greedy_trees_get_ngram_chains_sampled_ones_do_not(stories):
    model, tokenizer, _ = stories
    heads = TokenSwiftHeads(TokenSwiftConfig.from_target(model.config))
    runtime = TokenSwiftRuntime(heads, TargetParts(model, 0), TreeConfig(depth=3, top_b=2, max_nodes=8), ngram=3)
    context = [7, 8, 9, 7, 8, 10, 7]
    runtime.reset(context[:-1], FeatureBatch(0, 6, {-1: torch.randn(6, model.config.hidden_size)}))
    greedy = runtime.propose(context, DraftLimits(max_depth=3, max_nodes=8), SamplingParams()).tree
    assert len(greedy.tokens) <= 8 and {(8, 9), (8, 10)} <= _chains(greedy)
    sampled = runtime.propose(context, DraftLimits(max_depth=3, max_nodes=8), SamplingParams(temperature=1.0)).tree
    assert len(sampled.tokens) == 8 and not {(8, 9), (8, 10)} & _chains(sampled)  # the heads' tree alone


def _chains(tree: DraftTree) -> set[tuple[int, ...]]:
    """Every root-to-node token path of `tree`."""
    paths = {}
    for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        paths[i] = (paths[parent] if parent >= 0 else ()) + (token,)
    return set(paths.values())


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, seed=3)], ids=["greedy", "sampled"])
def test_decoding_with_tokenswift_is_exact(stories, sampling):
    """Random heads and n-gram chains on a repetitive story: drafts accepted and rejected, output exact
    (greedy: the target's own tokens; sampled: seeded, see `check_seeded_sampling`)."""
    model, tokenizer, model_id = stories
    torch.manual_seed(0)
    heads = TokenSwiftHeads(TokenSwiftConfig.from_target(model.config))
    for layer in heads.layers:
        torch.nn.init.normal_(layer.weight, std=0.02)
    prompt = tokenizer("Tom had a big red ball. Tom had a big red ball. Tom had a big red ball. Tom")["input_ids"]

    def generate(sampling):
        runtime = TokenSwiftRuntime(heads, TargetParts(model, 0), TreeConfig(depth=3, top_b=2, max_nodes=10))
        return SpeculativeDecoder(LocalVerifier(TargetRunner(model, tokenizer, model_id)), runtime).generate(
            prompt, 48, sampling, stop_on_eos=False)

    if sampling.greedy:
        gen = generate(sampling)
        assert gen.tokens == reference_greedy(model, prompt, 48)
        assert gen.stats.new_tokens > gen.stats.target_calls  # some drafts were accepted
    else:
        check_seeded_sampling(generate, sampling)


def test_spec_names_tokenswift():
    spec = DrafterSpec.parse("tokenswift;tree=3x2x8")
    assert spec.kind == "tokenswift" and spec.checkpoint("smollm2-135m").name == "tokenswift"


@pytest.mark.parametrize("mode", ["local", "split"])
def test_contextual_penalty_is_exact_for_the_penalised_target(stories, serve, mode):
    """--contextual-penalty changes the answer (it is meant to) and the speculative output equals
    the penalised target's own greedy output, with drafts accepted along non-contiguous paths."""
    from splitspec.client.transport import RemoteVerifier

    model, tokenizer, model_id = stories
    runner = TargetRunner(model, tokenizer, model_id)
    verifier = LocalVerifier(runner) if mode == "local" else RemoteVerifier(serve(runner).address)
    torch.manual_seed(0)
    heads = TokenSwiftHeads(TokenSwiftConfig.from_target(model.config))
    prompt = tokenizer("Tom had a big red ball. Tom had a big red ball. Tom had a big red ball. Tom")["input_ids"]
    sampling = SamplingParams(penalty=1.3, penalty_window=24)
    reference = reference_greedy(model, prompt, 48)
    penalised = _penalised_greedy(model, prompt, 48, 1.3, 24)
    assert penalised != reference
    runtime = TokenSwiftRuntime(heads, TargetParts(model, 0), TreeConfig(depth=3, top_b=2, max_nodes=10))
    gen = SpeculativeDecoder(verifier, runtime).generate(prompt, 48, sampling, stop_on_eos=False)
    assert gen.tokens == penalised
    assert gen.stats.new_tokens > gen.stats.target_calls


def _penalised_greedy(model, prompt, n, penalty, window):
    from splitspec.shared.reference import target_greedy

    return target_greedy(model, prompt, n, penalty=penalty, penalty_window=window)


@pytest.mark.parametrize("bad", [dict(penalty=0.9), dict(penalty=float("inf")), dict(penalty_window=0)])
def test_bad_penalties_are_refused(bad):
    with pytest.raises(ValueError, match="penalty"):
        SamplingParams(**bad)


def test_contextual_penalty_is_ctrls_repetition_penalty_over_the_window():
    """The penalty itself, against a hand computation and against transformers' own repetition
    penalty (CTRL's rule over the whole sequence) when the window holds the whole sequence; the
    exactness tests above share this function with their reference, so they cannot see its rule."""
    from transformers import RepetitionPenaltyLogitsProcessor

    from splitspec.shared.sampling import apply_contextual_penalty

    out = apply_contextual_penalty(torch.tensor([[2.0, -2.0, 1.0], [2.0, -2.0, 1.0]]), [[0, 1, 1], []], 2.0)
    assert out.tolist() == [[1.0, -4.0, 1.0], [2.0, -2.0, 1.0]]  # repeats count once; an empty window changes nothing
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=generator)
    sequences = torch.randint(0, 50, (3, 12), generator=generator)
    expected = RepetitionPenaltyLogitsProcessor(penalty=1.3)(sequences, logits.clone())
    torch.testing.assert_close(apply_contextual_penalty(logits, sequences.tolist(), 1.3), expected)
    last4 = apply_contextual_penalty(logits, [row[-4:] for row in sequences.tolist()], 1.3)
    assert not torch.equal(last4, expected)  # only the window's tokens are penalised
