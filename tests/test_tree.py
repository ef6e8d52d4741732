"""Tree buffers against a brute-force oracle, and tree validation."""
from __future__ import annotations

import random

import pytest
import torch

from splitspec.shared import tree as tree_module
from splitspec.shared.tree import DraftTree, TreeError, TreeLimitError, tree_buffers, validate_tree


def _random_parents(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(-1, i) for i in range(n))


def _oracle_ancestors(parents, row):
    """Rows visible from `row` (root prepended as row 0), walking parent pointers."""
    seen = {row, 0}
    node = row - 1
    while node >= 0:
        seen.add(node + 1)
        node = parents[node]
    return seen


@pytest.mark.parametrize("seed", range(20))
def test_buffers_match_oracle(seed):
    rng = random.Random(seed)
    parents = _random_parents(rng, rng.randrange(0, 30))
    buf = tree_buffers(parents)
    rows = len(parents) + 1
    for r in range(rows):
        expected = _oracle_ancestors(parents, r)
        assert set(torch.nonzero(buf.ancestor_mask[r]).flatten().tolist()) == expected
        assert buf.depth[r] == len(expected) - 1
    leaves = [r for r in range(rows) if (r - 1) not in parents]
    assert sorted(p[-1] for p in buf.paths) == leaves
    for path in buf.paths:
        assert path[0] == 0
        assert all(parents[b - 1] == a - 1 for a, b in zip(path, path[1:]))


def _hung(forced: int, tree: tuple[int, ...]) -> tuple[int, ...]:
    """Parents of `tree` hung below a chain of `forced - 1` nodes, as server/runner.py `_hang_tree`
    builds a step with forced tokens."""
    links = forced - 1
    return tuple(range(-1, links - 1)) + tuple(links - 1 if p == -1 else p + links for p in tree)


@pytest.mark.parametrize("seed", range(10))
def test_buffers_below_a_chain_match_oracle(seed):
    """The leading chain is filled as one block; rows, depths and paths still equal the oracle's."""
    rng = random.Random(seed)
    parents = _hung(rng.randrange(1, 40), _random_parents(rng, rng.randrange(0, 20)))
    buf = tree_buffers(parents)
    for r in range(len(parents) + 1):
        expected = _oracle_ancestors(parents, r)
        assert set(torch.nonzero(buf.ancestor_mask[r]).flatten().tolist()) == expected
        assert buf.depth[r] == len(expected) - 1
    leaves = [r for r in range(len(parents) + 1) if (r - 1) not in parents]
    assert [p[-1] for p in buf.paths] == leaves
    for path in buf.paths:
        assert path[0] == 0 and all(parents[b - 1] == a - 1 for a, b in zip(path, path[1:]))


def test_the_cache_keeps_draft_trees_but_not_long_forced_chains():
    """QA finding 2: each (forced length, tree) shape of a step with ~4000 forced tokens made a
    ~19 MB cache entry, 256 of them kept for good. Long chains are built per call; a 64-node draft
    tree after a few forced tokens stays cached; the whole cache stays within its byte budget."""
    tree_module.tree_cache_clear()
    siblings = (-1,) * 64
    for forced in range(3000, 2990, -1):
        buf = tree_buffers(_hung(forced, siblings))
        assert buf.ancestor_mask.shape == (forced + 64, forced + 64) and len(buf.paths) == 64
    entries, held, longest = tree_module.tree_cache_info()
    assert entries == 0 and held == 0 and longest == 0
    for forced in (1, 2, 3, 8):
        parents = _hung(forced, siblings)
        assert tree_buffers(parents) is tree_buffers(parents)  # built once, then shared
    entries, held, longest = tree_module.tree_cache_info()
    assert entries == 4 and held <= tree_module.TREE_CACHE_BYTES and longest == 64 + 7


def test_the_cache_drops_the_least_recently_used_shapes_past_its_byte_budget(monkeypatch):
    tree_module.tree_cache_clear()
    monkeypatch.setattr(tree_module, "TREE_CACHE_BYTES", 40_000)
    first = tree_buffers(_hung(1, (-1,) * 30))
    for forced in range(2, 40):
        tree_buffers(_hung(forced, (-1,) * 30))
        tree_buffers(_hung(1, (-1,) * 30))  # kept in use: never the oldest
        assert tree_module.tree_cache_info()[1] <= 40_000
    assert tree_buffers(_hung(1, (-1,) * 30)) is first
    assert tree_module.tree_cache_info()[0] < 38
    tree_module.tree_cache_clear()


def test_mask_and_positions():
    buf = tree_buffers((-1, -1, 0))  # root -> {a, b}, a -> c
    assert buf.position_ids(10).tolist() == [[10, 11, 11, 12]]
    mask = buf.attention_mask(3, torch.float32)
    assert mask.shape == (1, 1, 4, 7)
    visible = (mask[0, 0] == 0).int().tolist()
    assert visible == [[1, 1, 1, 1, 0, 0, 0],
                       [1, 1, 1, 1, 1, 0, 0],
                       [1, 1, 1, 1, 0, 1, 0],
                       [1, 1, 1, 1, 1, 0, 1]]


@pytest.mark.parametrize("tokens,parents,kwargs,message", [
    ((1, 2), (-1,), {}, "parents"),
    ((1, 2), (-1, 1), {}, "parent 1"),          # self-loop / cycle
    ((1, 2), (0, -1), {}, "parent 0"),          # forward reference
    ((1, 2), (-1, -2), {}, "parent -2"),
    ((1, 600), (-1, 0), {"vocab_size": 512}, "token id 600"),
    ((1, -5), (-1, 0), {}, "token id -5"),
    ((1,) * 5, (-1, 0, 1, 2, 3), {"max_depth": 4}, "depth 5"),
    ((1,) * 5, (-1,) * 5, {"max_nodes": 4}, "5 nodes"),
])
def test_validation_rejects(tokens, parents, kwargs, message):
    with pytest.raises(TreeError, match=message) as refused:
        validate_tree(tokens, parents, **kwargs)
    # a limit (the service answers RESOURCE_EXHAUSTED) is told apart from a malformed tree by type
    assert isinstance(refused.value, TreeLimitError) == bool({"max_depth", "max_nodes"} & set(kwargs))


def test_draft_tree_helpers():
    tree = DraftTree((5, 6, 7, 8), (-1, -1, 0, 0))
    assert tree.children(-1) == [0, 1] and tree.children(0) == [2, 3]
    assert tree.depths() == (1, 1, 2, 2)
    assert DraftTree.chain([3, 4, 5]).parents == (-1, 0, 1)
