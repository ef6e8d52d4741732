"""Tree verification in one forward equals sequential decoding of every root-to-leaf path, and
the compacted KV cache equals one recomputed from scratch."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from splitspec.server.runner import TargetRunner
from splitspec.shared import kv
from splitspec.shared.features import FeatureRequest
from splitspec.shared.sampling import SamplingParams
from splitspec.shared.tree import DraftTree, tree_buffers

TREE = DraftTree((10, 20, 30, 40, 50, 60, 70), (-1, -1, 0, 0, 1, 2, 5))
ATOL = 1e-4


def _sequential_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("fixture", ["tiny_random", "stories"])
def test_tree_forward_equals_paths(fixture, request):
    model, tokenizer, model_id = request.getfixturevalue(fixture)
    runner = TargetRunner(model, tokenizer, model_id)
    prompt = [1, 200, 33, 87, 5, 401]
    session, _, _ = runner.open(prompt, SamplingParams(), FeatureRequest())
    prefix = kv.cache_length(session.cache)
    buffers = tree_buffers(TREE.parents)
    ids = torch.tensor([[session.pending_token, *TREE.tokens]])
    with torch.inference_mode():
        out = model(input_ids=ids, cache=session.cache, use_cache=True,
                    attention_mask=buffers.attention_mask(prefix, torch.float32),
                    position_ids=buffers.position_ids(prefix))
    tree_logits = out.logits[0].float()
    rows = [session.pending_token, *TREE.tokens]
    for path in buffers.paths:
        seq = _sequential_logits(model, prompt + [rows[r] for r in path])[len(prompt):]
        torch.testing.assert_close(tree_logits[list(path)], seq, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("fixture", ["tiny_random", "stories"])
def test_kv_commit_equals_recompute(fixture, request):
    model, tokenizer, model_id = request.getfixturevalue(fixture)
    runner = TargetRunner(model, tokenizer, model_id)
    prompt = [1, 200, 33, 87, 5, 401]
    features = FeatureRequest(hidden_layers=(-1,), kv_layers=(0, model.config.num_hidden_layers - 1))
    session, _, _ = runner.open(prompt, SamplingParams(), features)
    committed = prompt + [session.pending_token]
    # force a deep accepted path through a non-first sibling: make the tree from the greedy truth
    truth = _sequential_greedy(model, committed, 3)
    tree = DraftTree((7, truth[0], 9, truth[1], truth[2]), (-1, -1, 1, 1, 3))
    step = runner.verify(session, tree)
    assert step.accept.accepted_nodes == (1, 3, 4)
    committed += list(step.accepted_tokens)
    cache = session.cache
    assert kv.cache_length(cache) == len(committed)
    fresh = kv.new_cache(model.config)
    with torch.inference_mode():
        ref = model(input_ids=torch.tensor([committed]), cache=fresh, use_cache=True,
                    output_hidden_states=True)
    for layer in range(model.config.num_hidden_layers):
        got_k, got_v = kv.layer_kv(cache, layer, 0, len(committed))
        want_k, want_v = kv.layer_kv(fresh, layer, 0, len(committed))
        torch.testing.assert_close(got_k, want_k, atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(got_v, want_v, atol=ATOL, rtol=1e-4)
    # features of the committed positions: the pending token and the 3 accepted nodes
    start = len(prompt)
    assert step.features.start == start and step.features.count == 4
    torch.testing.assert_close(step.features.hidden[-1], ref.hidden_states[-1][0, start:], atol=ATOL, rtol=1e-4)
    want_k, _ = kv.layer_kv(fresh, 0, start, start + 4)
    torch.testing.assert_close(step.features.keys[0], want_k, atol=ATOL, rtol=1e-4)
    assert session.pending_token == int(ref.logits[0, -1].argmax())


def _sequential_greedy(model, ids, n):
    out = []
    for _ in range(n):
        out.append(int(_sequential_logits(model, ids + out)[-1].argmax()))
    return out


def test_forced_tokens_replace_the_pending_token(tiny_random):
    """Forced tokens are committed as sent and the tree is verified below them: the result equals
    a session opened with them in the prompt, and features cover them."""
    from .helpers import reference_greedy

    model, tokenizer, model_id = tiny_random
    runner = TargetRunner(model, tokenizer, model_id)
    prompt, forced = [1, 200, 33, 87], [77, 5, 401]
    ref = reference_greedy(model, prompt + forced, 4)
    session, _, _ = runner.open(prompt, SamplingParams(), FeatureRequest(hidden_layers=(-1,), kv_layers=(0,)))
    out = runner.verify(session, DraftTree.chain(ref[:3]), {}, tuple(forced))
    assert list(out.accepted_tokens) == ref[:3] and out.accept.bonus_token == ref[3]
    assert kv.cache_length(session.cache) == len(prompt) + len(forced) + 3
    assert out.features.start == len(prompt) and out.features.count == len(forced) + 3
    fresh, _, _ = runner.open(prompt + forced, SamplingParams(), FeatureRequest(kv_layers=(0,)))
    span = (len(prompt), len(prompt) + len(forced))
    assert torch.allclose(kv.layer_kv(session.cache, 0, *span)[0], kv.layer_kv(fresh.cache, 0, *span)[0], atol=ATOL)
    assert torch.allclose(out.features.keys[0][:, : len(forced)], kv.layer_kv(fresh.cache, 0, *span)[0], atol=ATOL)


def test_truncate_cuts_each_layer_to_the_length():
    """Layers of different lengths (SWIFT's skipped layers hold fewer rows than its kept ones) are
    each cut to the first `length` positions; a shorter layer keeps all it holds."""
    cache = DynamicCache()
    for layer, rows in enumerate((9, 6, 9)):
        cache.update(torch.arange(rows, dtype=torch.float32).view(1, 1, rows, 1).clone(),
                     torch.arange(rows, dtype=torch.float32).view(1, 1, rows, 1).clone(), layer)
    kv.truncate(cache, 7)
    assert [layer.keys.shape[2] for layer in cache.layers] == [7, 6, 7]
    assert cache.layers[0].keys.flatten().tolist() == list(range(7))
    with pytest.raises(ValueError):
        kv.truncate(cache, 8)


def test_session_cache_equals_dynamic_cache_over_appends_commits_and_growth():
    """`kv.new_cache`'s preallocated layers give what transformers' concatenating DynamicCache gives
    through random verify-like steps (append tree rows, keep a non-contiguous path, truncate),
    across several storage growths; rows stay in place between growths (no context copy)."""
    gen = torch.Generator().manual_seed(0)
    ref, ours = DynamicCache(), kv.SessionCache()
    chunk = kv.PreallocatedLayer.CHUNK
    moves = 0
    for step in range(120):
        rows = 40 if step == 0 else int(torch.randint(1, 26, (1,), generator=gen))
        new = [(torch.randn(1, 2, rows, 4, generator=gen), torch.randn(1, 2, rows, 4, generator=gen))
               for _ in range(3)]
        prefix = kv.cache_length(ref)
        before = ours.layers[0].storage[0].data_ptr() if ours.layers else None
        capacity = ours.layers[0].capacity if ours.layers else 0
        for layer, (k, v) in enumerate(new):
            got_k, got_v = ours.update(k.clone(), v.clone(), layer)
            want_k, want_v = ref.update(k.clone(), v.clone(), layer)
            assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        if before is not None and ours.layers[0].storage[0].data_ptr() != before:
            moves += 1
            assert prefix + rows > capacity  # it moved only because the rows did not fit
        keep = sorted(torch.randperm(rows, generator=gen)[: int(torch.randint(0, rows + 1, (1,), generator=gen))].tolist())
        kv.keep_rows(ref, prefix, keep)
        kv.keep_rows(ours, prefix, keep)
        if step % 17 == 16:
            kv.truncate(ref, prefix)
            kv.truncate(ours, prefix)
        for a, b in zip(ref.layers, ours.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert ours.layers[0].capacity % chunk == 0 and ours.layers[0].capacity - kv.cache_length(ours) < chunk + 25
    assert kv.cache_length(ours) > 2 * chunk and moves >= 2  # the run crossed two chunk boundaries


def test_session_cache_refuses_states_of_another_shape():
    cache = kv.SessionCache()
    cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 0)
    with pytest.raises(ValueError, match="do not match"):
        cache.update(torch.zeros(1, 3, 1, 4), torch.zeros(1, 3, 1, 4), 0)
    assert kv.cache_length(cache) == 3  # nothing was written


def test_preallocated_write_at_fills_storage_without_moving_the_cached_end():
    """`write_at` (a fixed-shape forward's update) writes rows at given storage positions, leaves
    the cached length alone and returns the whole storage; `end_at` then exposes what was written."""
    cache = kv.SessionCache()
    cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 0)
    layer = cache.layers[0]
    layer.reserve(8)
    keys, values = torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4)
    storage_k, storage_v = layer.write_at(torch.tensor([5, 3]), keys, values)
    assert storage_k.shape[-2] == layer.capacity >= 8 and kv.cache_length(cache) == 3
    assert torch.equal(storage_k[..., 5, :], keys[..., 0, :]) and torch.equal(storage_v[..., 3, :], values[..., 1, :])
    layer.end_at(6)
    assert kv.cache_length(cache) == 6 and torch.equal(layer.keys[..., 3, :], keys[..., 1, :])
    assert torch.equal(layer.keys[..., :3, :], torch.zeros(1, 2, 3, 4))  # the cached rows are untouched
