"""The static shape of a speculation tree: which draft positions follow which.

A tree is given as vLLM's `speculative_token_tree`: a list of paths of child ranks from
the root, e.g. [(0,), (1,), (0, 0), (0, 1), (1, 0)]: (0,) is the root's first (most
likely) child, (0, 1) the second child of (0,). Position 0 is the root, the request's
next token, already chosen: its logits score the first drafts. The nodes follow in BFS
order (by depth, then by path), so every ancestor has a lower position:

            0                 depth 0   (the root)
          /   \\
         1     2              depth 1   (0,)   (1,)
        / \\     \\
       3   4     5            depth 2   (0, 0) (0, 1) (1, 0)

A chain of k drafts is the tree [(0,), (0, 0), ...]. A tree is a jit static argument:
hashed and compared by its paths; its arrays are host NumPy, read while tracing and for
building the attention mask.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Sequence

import numpy as np

WORD_BITS = 32  # the ancestor mask's words are int32: positions 32w .. 32w + 31 in word w
MAX_POSITIONS = 128  # the root and up to 127 nodes: at most 4 words a position

Path = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class DraftTree:
    paths: tuple[Path, ...]  # node i's path of child ranks is paths[i - 1], in BFS order
    parent: np.ndarray = dataclasses.field(init=False, compare=False, repr=False)  # i32 [N+1]: -1 for the root
    depth: np.ndarray = dataclasses.field(init=False, compare=False, repr=False)  # i32 [N+1]
    rank: np.ndarray = dataclasses.field(init=False, compare=False, repr=False)  # i32 [N+1]: among its siblings
    # i32 [N+1, W], W = mask_words: bit j % 32 of word j // 32 set iff position j is i or an
    # ancestor of i (the tree attention mask)
    ancestor_mask: np.ndarray = dataclasses.field(init=False, compare=False, repr=False)
    children: tuple[tuple[int, ...], ...] = dataclasses.field(init=False, compare=False, repr=False)  # rank order

    @classmethod
    def from_choices(cls, choices: Sequence[Sequence[int]]) -> DraftTree:
        """The tree of vLLM's `speculative_token_tree` (lists as from JSON, any order)."""
        paths = [_as_path(choice) for choice in choices]
        return cls(tuple(sorted(paths, key=lambda path: (len(path), path))))

    @classmethod
    def chain(cls, k: int) -> DraftTree:
        """k drafts one after the other: what `rejection_sampler.verify` verifies."""
        return cls.from_choices([(0,) * depth for depth in range(1, k + 1)])

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return len(self.paths[-1])

    @property
    def mask_words(self) -> int:
        """The int32 words of each position's ancestor mask: one per 32 positions."""
        return -(-(self.num_nodes + 1) // WORD_BITS)

    @property
    def is_chain(self) -> bool:
        """One draft after another: plain causal attention verifies it."""
        return self.max_depth == self.num_nodes

    def nodes_within(self, depth: int) -> int:
        """How many nodes lie at most `depth` deep: the BFS prefix a request can keep when
        only that many more tokens fit (its max_tokens, the context)."""
        return int(np.searchsorted(self.depth[1:], max(depth, 0), side="right"))

    @functools.cached_property
    def path_table(self) -> np.ndarray:
        """i32 [N+1, D+1]: the positions from the root to each position, then it repeated."""
        table = np.zeros((self.num_nodes + 1, self.max_depth + 1), np.int32)
        for i in range(1, self.num_nodes + 1):
            table[i] = table[self.parent[i]]
            table[i, self.depth[i] :] = i
        return table

    def __post_init__(self) -> None:
        _check(self.paths)
        position = {(): 0} | {path: i + 1 for i, path in enumerate(self.paths)}
        parent = [-1] + [position[path[:-1]] for path in self.paths]
        mask = [1]
        children: list[list[int]] = [[] for _ in position]
        for i in range(1, len(position)):
            mask.append(mask[parent[i]] | (1 << i))
            children[parent[i]].append(i)  # BFS order is rank order among siblings
        fields = dict(
            parent=np.array(parent, np.int32),
            depth=np.array([0] + [len(path) for path in self.paths], np.int32),
            rank=np.array([0] + [path[-1] for path in self.paths], np.int32),
            ancestor_mask=_as_words(mask, -(-len(mask) // WORD_BITS)),
            children=tuple(tuple(c) for c in children),
        )
        for name, value in fields.items():
            object.__setattr__(self, name, value)


def _as_words(masks: list[int], words: int) -> np.ndarray:
    """i32 [len(masks), words]: each mask's bits 32w .. 32w + 31 in word w (bit 31 is the sign bit)."""
    low = (1 << WORD_BITS) - 1
    table = [[(mask >> (WORD_BITS * w)) & low for w in range(words)] for mask in masks]
    return np.array(table, np.uint32).view(np.int32)


def _as_path(choice: object) -> Path:
    if (
        not isinstance(choice, Sequence)
        or isinstance(choice, str)
        or not all(isinstance(rank, numbers.Integral) and not isinstance(rank, bool) for rank in choice)
    ):
        raise ValueError(f"a tree path is a sequence of int child ranks, got {choice!r}")
    return tuple(int(rank) for rank in choice)


def _check(paths: tuple[Path, ...]) -> None:
    """Clear errors for what would make the positions ambiguous or the mask overflow."""
    if not paths:
        raise ValueError("a draft tree needs at least one node")
    if len(paths) > MAX_POSITIONS - 1:
        raise ValueError(f"a draft tree has at most {MAX_POSITIONS - 1} nodes, got {len(paths)}")
    if () in paths:
        raise ValueError("the root is implicit: the empty path is not a node")
    if len(set(paths)) != len(paths):
        raise ValueError(f"duplicate paths in {paths}")
    if list(paths) != sorted(paths, key=lambda path: (len(path), path)):
        raise ValueError(f"paths must be in BFS order (DraftTree.from_choices sorts them): {paths}")
    known = set(paths) | {()}
    siblings: dict[Path, list[int]] = {}
    for path in paths:
        if path[:-1] not in known:
            raise ValueError(f"path {path} has no parent {path[:-1]}")
        siblings.setdefault(path[:-1], []).append(path[-1])
    for parent, ranks in siblings.items():
        if ranks != list(range(len(ranks))):
            raise ValueError(f"the children of {parent} have ranks {ranks}, not 0, 1, ... in order")
