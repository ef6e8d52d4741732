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


@lru_cache(maxsize=256)
def tree_buffers(parents: tuple[int, ...]) -> TreeBuffers:
    """Buffers for the tree with these parents (root prepended), built once per shape.

    `parents` must pass `validate_tree` (not checked here: a parent at or after its own index gives
    a wrong mask without an error). Cached per shape: the returned tensors are shared between callers
    and must never be modified in place."""
    rows = len(parents) + 1
    row_parent = [ROOT] + [p + 1 for p in parents]  # parent row of each row; the root has none
    ancestor = torch.zeros(rows, rows, dtype=torch.bool)
    depth = torch.zeros(rows, dtype=torch.long)
    for row in range(rows):
        ancestor[row, row] = True
        par = row_parent[row]
        if par != ROOT:
            ancestor[row] |= ancestor[par]
            depth[row] = depth[par] + 1
    is_parent = set(row_parent[1:])
    paths = []
    for leaf in range(rows):
        if leaf in is_parent:
            continue
        path = [leaf]
        while row_parent[path[-1]] != ROOT:
            path.append(row_parent[path[-1]])
        paths.append(tuple(reversed(path)))
    return TreeBuffers(ancestor, depth, tuple(paths))
