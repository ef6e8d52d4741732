"""Draft trees and the buffers a tree forward pass needs.

A draft tree holds N nodes; node i has a token id and a parent index (-1 = child of the pending
token, the last committed token whose key/values are not cached yet). Parents precede children.
For verification the pending token is prepended as node "root", so the target sees N + 1 query
positions: row 0 is the root, row i + 1 is node i.

The tree attention mask lets each row see the cached prefix and its own ancestors (itself
included); the position id of a row is prefix length + depth, the root having depth 0
(SpecInfer, Miao et al. 2024, §4.2; EAGLE-2, Li et al. 2024, §4).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache

import torch

ROOT = -1


class TreeError(ValueError):
    """A draft tree is malformed (raised before any model work)."""


class TreeLimitError(TreeError):
    """A well-formed draft tree larger than a limit allows (`validate_tree`'s max_nodes / max_depth)."""


@dataclass(frozen=True)
class DraftTree:
    """N draft nodes. `tokens`: [N] token ids; `parents`: [N] parent node index or -1.

    Raises:
        TreeError: at construction, what `validate_tree` refuses (lengths differ, a parent outside
            [-1, i), a negative token id).
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        validate_tree(self.tokens, self.parents)

    @property
    def size(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: list[int] | tuple[int, ...]) -> "DraftTree":
        """A chain: node i is the child of node i - 1."""
        return cls(tuple(int(t) for t in tokens), tuple(range(-1, len(tokens) - 1)))

    @classmethod
    def empty(cls) -> "DraftTree":
        return cls((), ())

    def depths(self) -> tuple[int, ...]:
        """Depth of each node, 1 for children of the root."""
        return _depths(self.parents)

    def children(self, node: int) -> list[int]:
        """Children of `node` (-1 = root) in index order, the order siblings are tried in."""
        return [i for i, p in enumerate(self.parents) if p == node]


def validate_tree(tokens, parents, *, vocab_size: int | None = None, max_nodes: int | None = None,
                  max_depth: int | None = None) -> None:
    """Check a tree without building anything.

    Raises:
        TreeError: lengths differ, a parent is not in [-1, i) (so cycles are impossible), or a token
            id is outside [0, vocab_size).
        TreeLimitError (a TreeError): the tree exceeds `max_nodes` (checked before any node is read)
            or `max_depth`.
    """
    if len(tokens) != len(parents):
        raise TreeError(f"tree has {len(tokens)} tokens but {len(parents)} parents")
    if max_nodes is not None and len(tokens) > max_nodes:
        raise TreeLimitError(f"tree has {len(tokens)} nodes; the limit is {max_nodes}")
    for i, (tok, par) in enumerate(zip(tokens, parents)):
        if not ROOT <= par < i:
            raise TreeError(f"node {i} has parent {par}; parents must lie in [-1, {i})")
        if tok < 0 or (vocab_size is not None and tok >= vocab_size):
            raise TreeError(f"node {i} has token id {tok} outside [0, {vocab_size})")
    if max_depth is not None and tokens and max(_depths(tuple(parents))) > max_depth:
        raise TreeLimitError(f"tree depth {max(_depths(tuple(parents)))} exceeds the limit {max_depth}")


@lru_cache(maxsize=1024)
def _depths(parents: tuple[int, ...]) -> tuple[int, ...]:
    depth: list[int] = []
    for par in parents:
        depth.append(1 if par == ROOT else depth[par] + 1)
    return tuple(depth)


@dataclass(frozen=True)
class TreeBuffers:
    """Per-shape buffers of a tree with the root prepended (M = N + 1 rows).

    Fields:
        ancestor_mask: [M, M] bool, True where row i may attend to row j (j is i or an ancestor).
        depth: [M] long, 0 for the root.
        paths: root-to-leaf paths as tuples of row indices (row 0 first), one per leaf.
    """

    ancestor_mask: torch.Tensor  # [M, M]
    depth: torch.Tensor  # [M]
    paths: tuple[tuple[int, ...], ...]

    def position_ids(self, prefix_len: int) -> torch.Tensor:
        """[1, M] position ids: prefix length + depth."""
        return (self.depth + prefix_len).unsqueeze(0)

    def attention_mask(self, prefix_len: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                       window: int | None = None) -> torch.Tensor:
        """[1, 1, M, prefix_len + M] additive float mask: 0 where visible, dtype-min elsewhere.

        `window`: sliding-window attention (Mistral, Gemma 2/3 local layers): a row at position p
        also sees only keys at positions q > p - window, as transformers' sliding-window mask does.
        """
        rows = self.ancestor_mask.shape[0]
        visible = torch.ones(rows, prefix_len + rows, dtype=torch.bool)
        visible[:, prefix_len:] = self.ancestor_mask
        if window is not None:
            query = self.depth + prefix_len  # [M]
            key = torch.cat([torch.arange(prefix_len), query])  # [prefix_len + M]
            visible &= key[None, :] > query[:, None] - window
        mask = torch.zeros(visible.shape, dtype=dtype)
        mask.masked_fill_(~visible, torch.finfo(dtype).min)
        return mask.to(device)[None, None]


# The buffers of recent tree shapes, kept while they fit a byte budget. A verify step hangs its
# forced tokens (up to max_prompt_tokens) above the draft tree as a chain, and such a shape's
# buffers take ~M^2 bytes: a count-bounded cache of them let one client make the server hold GBs
# outside every KV budget. A draft tree after a few forced tokens (the every-step case) stays cached.
TREE_CACHE_BYTES = 16 * 2**20  # all entries together
TREE_CACHE_ENTRY_BYTES = 256 * 2**10  # larger shapes (long forced chains) are built per call
_cache: OrderedDict[tuple[int, ...], tuple[TreeBuffers, int]] = OrderedDict()
_cache_bytes = 0
_cache_lock = threading.Lock()


def tree_buffers(parents: tuple[int, ...]) -> TreeBuffers:
    """Buffers for the tree with these parents (root prepended), built once per shape.

    `parents` must pass `validate_tree` (not checked here: a parent at or after its own index gives
    a wrong mask without an error). Cached per shape (least recently used first out, at most
    TREE_CACHE_BYTES; a shape over TREE_CACHE_ENTRY_BYTES is built anew each call and not kept):
    the returned tensors may be shared between callers and must never be modified in place."""
    global _cache_bytes
    parents = tuple(parents)
    with _cache_lock:
        hit = _cache.get(parents)
        if hit is not None:
            _cache.move_to_end(parents)
            return hit[0]
    buffers = _build_tree_buffers(parents)
    size = _entry_bytes(parents, buffers)
    if size > TREE_CACHE_ENTRY_BYTES:
        return buffers
    with _cache_lock:
        if parents not in _cache:
            _cache[parents] = (buffers, size)
            _cache_bytes += size
        while _cache_bytes > TREE_CACHE_BYTES:
            _, (_, dropped) = _cache.popitem(last=False)
            _cache_bytes -= dropped
    return buffers


def tree_cache_info() -> tuple[int, int, int]:
    """(entries, bytes, longest parents tuple) held by `tree_buffers`' cache."""
    with _cache_lock:
        return len(_cache), _cache_bytes, max(map(len, _cache), default=0)


def tree_cache_clear() -> None:
    """Empty `tree_buffers`' cache (tests)."""
    global _cache_bytes
    with _cache_lock:
        _cache.clear()
        _cache_bytes = 0


def _entry_bytes(parents: tuple[int, ...], buffers: TreeBuffers) -> int:
    """What a cache entry holds, roughly: the key, the mask and depths, and the path tuples (8-byte
    pointers; small ints are shared)."""
    paths = sum(56 + 8 * len(p) for p in buffers.paths)
    return (56 + 8 * len(parents) + buffers.ancestor_mask.numel() * buffers.ancestor_mask.element_size()
            + buffers.depth.numel() * buffers.depth.element_size() + paths)


def _build_tree_buffers(parents: tuple[int, ...]) -> TreeBuffers:
    """`tree_buffers` without the cache. A leading chain (the forced tokens a step hangs above its
    tree) is filled as one lower-triangular block, so a long chain costs no per-row Python work."""
    rows = len(parents) + 1
    row_parent = [ROOT] + [p + 1 for p in parents]  # parent row of each row; the root has none
    chain = 1  # rows [0, chain) form a path from the root: row r's parent is r - 1
    while chain < rows and row_parent[chain] == chain - 1:
        chain += 1
    ancestor = torch.zeros(rows, rows, dtype=torch.bool)
    ancestor[:chain, :chain] = torch.ones(chain, chain, dtype=torch.bool).tril()
    depth = list(range(chain))
    for row in range(chain, rows):
        par = row_parent[row]
        ancestor[row] = ancestor[par]
        ancestor[row, row] = True
        depth.append(depth[par] + 1)
    is_parent = set(row_parent[1:])
    paths = []
    for leaf in range(rows):
        if leaf in is_parent:
            continue
        path = [leaf]
        while path[-1] >= chain:
            path.append(row_parent[path[-1]])
        top = path.pop()  # a chain row: its path is the chain down to it
        paths.append(tuple(range(top + 1)) + tuple(reversed(path)))
    return TreeBuffers(ancestor, torch.tensor(depth, dtype=torch.long), tuple(paths))
