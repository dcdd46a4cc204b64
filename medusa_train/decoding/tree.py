"""Medusa candidate trees: from index paths to the tensors tree attention needs.

Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads"
(arXiv:2401.10774), section 2.1.2 "Tree attention".

A tree is a list of index paths ("medusa choices"). Path ``(i1, i2, ..., id)`` is the node at depth d
whose token is head d's rank-``id`` candidate and whose parent is ``(i1, ..., i(d-1))``. The root
(depth 0, the empty path) is the token the backbone itself chose. Paths are sorted canonically (by
depth, then lexicographically) so that the buffers are deterministic and, because depth comes first,
the nodes up to any depth are a prefix of the node list (:meth:`TreeBuffers.prefix`).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from medusa_train.choices import MEDUSA_63, TreeError, TreePath, normalise_choices
from medusa_train.errors import UserError
from medusa_train.heads import MedusaHeads
from medusa_train.heads_layout import layout_dir
from medusa_train.workdir import CHOICES, atomic_write_text

if TYPE_CHECKING:  # annotations only: config imports Hydra, which this module must not need
    from medusa_train.config import TreeConfig


@dataclass(eq=False)
class TreeBuffers:
    """Everything the decoder needs about one tree. M = N + 1 nodes (node 0 is the root).

    Attributes:
        choices: the N paths, canonically sorted; node ``n`` (n >= 1) is ``choices[n - 1]``.
        attn_mask: ``(M, M)`` bool, True where node i may attend to node j (j is i or an ancestor).
        depth: ``(M,)`` long, depth of each node (root 0): position id = cache length + depth.
        tree_indices: ``(M,)`` long, index of each node's token in the flat candidate vector
            ``[root, head1 top-k (topk entries), head2 top-k, ...]``.
        retrieve_indices: ``(L, D + 1)`` long, one row per leaf: node indices of the root-to-leaf
            path, padded with -1.
        parents: ``(M,)`` long, parent node index (-1 for the root).
        children: ``(M, C)`` long, child node indices of each node, padded with -1 (C >= 1).
        topk: candidates taken from each head (largest rank in the tree + 1).
        max_depth: D, the deepest node's depth (the number of heads the tree needs).
    """

    choices: tuple[TreePath, ...]
    attn_mask: torch.Tensor
    depth: torch.Tensor
    tree_indices: torch.Tensor
    retrieve_indices: torch.Tensor
    parents: torch.Tensor
    children: torch.Tensor
    topk: int
    max_depth: int
    _prefixes: dict[int, TreeBuffers] = field(default_factory=dict, repr=False)
    _on_device: dict[str, TreeBuffers] = field(default_factory=dict, repr=False)
    _child_lists: tuple[tuple[int, ...], ...] | None = field(default=None, repr=False)

    @classmethod
    def from_choices(cls, choices: Sequence[Sequence[int]]) -> TreeBuffers:
        """Build the buffers of a tree.

        Args:
            choices: index paths, e.g. ``[[0], [0, 0], [1]]``; any order, sorted here.

        Raises:
            TreeError: a path is empty, has a negative or non-int entry, is duplicated, or lacks
                its parent; the message names the path.
        """
        paths = normalise_choices(choices)
        m = len(paths) + 1
        index = {(): 0} | {p: n + 1 for n, p in enumerate(paths)}
        topk = max((max(p) for p in paths), default=-1) + 1
        max_depth = max((len(p) for p in paths), default=0)

        attn_mask = torch.eye(m, dtype=torch.bool)  # (M, M)
        depth = torch.zeros(m, dtype=torch.long)  # (M,)
        tree_indices = torch.zeros(m, dtype=torch.long)  # (M,)
        parents = torch.full((m,), -1, dtype=torch.long)  # (M,)
        kids: list[list[int]] = [[] for _ in range(m)]
        for path in paths:
            n = index[path]
            depth[n] = len(path)
            tree_indices[n] = 1 + (len(path) - 1) * topk + path[-1]
            parents[n] = index[path[:-1]]
            kids[index[path[:-1]]].append(n)
            for d in range(len(path)):  # the root and every proper prefix are ancestors
                attn_mask[n, index[path[:d]]] = True

        max_kids = max(1, max(len(k) for k in kids))
        children = torch.full((m, max_kids), -1, dtype=torch.long)  # (M, C)
        for n, k in enumerate(kids):
            children[n, : len(k)] = torch.tensor(k, dtype=torch.long)

        leaves = [n for n in range(m) if not kids[n]]
        retrieve = torch.full((len(leaves), max_depth + 1), -1, dtype=torch.long)  # (L, D + 1)
        for row, leaf in enumerate(leaves):
            path = ([()] + paths)[leaf]
            nodes = [index[path[:d]] for d in range(len(path) + 1)]
            retrieve[row, : len(nodes)] = torch.tensor(nodes, dtype=torch.long)

        return cls(
            choices=tuple(paths),
            attn_mask=attn_mask,
            depth=depth,
            tree_indices=tree_indices,
            retrieve_indices=retrieve,
            parents=parents,
            children=children,
            topk=topk,
            max_depth=max_depth,
        )

    @property
    def num_nodes(self) -> int:
        """M = N + 1, the nodes verified per step including the root."""
        return len(self.choices) + 1

    @property
    def num_leaves(self) -> int:
        """L, the number of root-to-leaf paths."""
        return self.retrieve_indices.shape[0]

    def child_lists(self) -> tuple[tuple[int, ...], ...]:
        """``children`` as host-side tuples without the padding (cached): what the decoder walks."""
        if self._child_lists is None:
            self._child_lists = tuple(tuple(c for c in row if c >= 0) for row in self.children.tolist())
        return self._child_lists

    def check_heads(self, num_heads: int, vocab_size: int | None = None) -> None:
        """Raise :class:`TreeError` if the tree does not fit the heads.

        Args:
            num_heads: K; the tree may be at most K deep.
            vocab_size: the tokens one head can propose, when known: its draft vocabulary (N of
                truncated heads, V of the others); a rank must be below it.
        """
        if self.max_depth > num_heads:
            deepest = next(p for p in self.choices if len(p) == self.max_depth)
            raise TreeError(
                f"tree path {list(deepest)} has depth {self.max_depth} but there are only {num_heads} "
                f"Medusa heads: use a tree of depth <= {num_heads}"
            )
        if vocab_size is not None and self.topk > vocab_size:
            widest = next(p for p in self.choices if max(p) == self.topk - 1)
            raise TreeError(
                f"tree path {list(widest)} asks for rank {self.topk - 1} but the heads give only "
                f"{vocab_size} candidates (their vocabulary): use ranks < {vocab_size}"
            )

    def prefix(self, max_depth: int) -> TreeBuffers:
        """The sub-tree of nodes with depth <= ``max_depth`` (cached; on this tree's device)."""
        if max_depth >= self.max_depth:
            return self
        if max_depth not in self._prefixes:
            sub = TreeBuffers.from_choices([p for p in self.choices if len(p) <= max_depth])
            self._prefixes[max_depth] = sub.to(self.depth.device)
        return self._prefixes[max_depth]

    def to(self, device: torch.device | str) -> TreeBuffers:
        """The same tree with its tensors on ``device`` (cached)."""
        device = torch.device(device)
        if self.depth.device == device:
            return self
        key = str(device)
        if key not in self._on_device:
            self._on_device[key] = TreeBuffers(
                choices=self.choices,
                attn_mask=self.attn_mask.to(device),
                depth=self.depth.to(device),
                tree_indices=self.tree_indices.to(device),
                retrieve_indices=self.retrieve_indices.to(device),
                parents=self.parents.to(device),
                children=self.children.to(device),
                topk=self.topk,
                max_depth=self.max_depth,
                _child_lists=self._child_lists,
            )
        return self._on_device[key]


_BUILT: dict[tuple[tuple[int, ...], ...], TreeBuffers] = {}  # recent lists of paths -> their buffers
_BUILT_MAX = 16
# Decoder calls on one model are serialised by that model's lock, but calls on two models may run in
# two threads at once: the eviction below (read the oldest key, then pop it) must not interleave.
_BUILT_LOCK = threading.Lock()


def as_tree(tree: TreeBuffers | Sequence[Sequence[int]]) -> TreeBuffers:
    """Accept either built buffers or a list of paths.

    Buffers built from a list are remembered (the last 16 distinct lists), so passing the same list
    to many :func:`~medusa_train.decoding.medusa_generate` calls builds it once; the cache key is the
    paths exactly as given, and only lists of plain ints are remembered (anything else is validated
    and built every time).
    """
    if isinstance(tree, TreeBuffers):
        return tree
    key = None
    if isinstance(tree, (list, tuple)) and all(
        isinstance(p, (list, tuple)) and all(type(i) is int for i in p) for p in tree
    ):
        key = tuple(tuple(p) for p in tree)
        with _BUILT_LOCK:
            if key in _BUILT:
                return _BUILT[key]
    built = TreeBuffers.from_choices(tree)
    if key is not None:
        with _BUILT_LOCK:
            while len(_BUILT) >= _BUILT_MAX:
                _BUILT.pop(next(iter(_BUILT)))
            _BUILT[key] = built
    return built


def chain_tree(depth: int) -> list[list[int]]:
    """The chain ``[[0], [0, 0], ...]`` of ``depth`` nodes: each head's top-1 only."""
    if depth < 0:
        raise TreeError(f"chain depth must be >= 0, got {depth}")
    return [[0] * d for d in range(1, depth + 1)]


def save_choices(path: str | os.PathLike, choices: Sequence[Sequence[int]]) -> Path:
    """Write a tree as JSON (a list of paths, canonically sorted) after validating it.

    The file is written atomically (temp file, fsync, rename): a failed write leaves the previous
    tree, never half a list.
    """
    paths = normalise_choices(choices)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(path, json.dumps([list(p) for p in paths]) + "\n")


def load_choices(path: str | os.PathLike) -> list[list[int]]:
    """Read a tree written by :func:`save_choices` (or any JSON list of paths) and validate it."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as err:  # JSONDecodeError, bad UTF-8, too deep
        raise TreeError(f"cannot read a tree from {path}: {err}") from None
    if isinstance(raw, dict) and "medusa_choices" in raw:
        raw = raw["medusa_choices"]
    return [list(p) for p in normalise_choices(raw)]


def resolve_tree(
    name: str,
    heads_dir: Path,
    num_heads: int,
    *,
    vocab_size: int | None = None,
    chain_depth: int = 0,
    choices: Sequence[Sequence[int]] = (),
) -> list[list[int]]:
    """The tree a ``tree=`` setting names, checked against the number of heads it will run with.

    Args:
        name: calibrated (``medusa_choices.json`` next to the heads, or one folder up for an export's
            ``medusa/``/``vllm/`` folder) | medusa63 | chain | custom.
        heads_dir: the heads' folder.
        num_heads: K; the tree may be at most K deep.
        vocab_size: V of the heads, when known: every rank in the tree must be below it.
        chain_depth: nodes of the ``chain`` tree.
        choices: the paths of the ``custom`` tree.

    Raises:
        UserError: the calibrated tree is missing, or the tree is malformed or deeper than the heads.
    """
    try:
        if name == "calibrated":
            found = [p for p in (heads_dir / CHOICES, heads_dir.parent / CHOICES) if p.is_file()]
            if not found:
                raise UserError(
                    f"no calibrated tree at {heads_dir / CHOICES}: run `python -m medusa_train stage=train` "
                    "first (it calibrates the tree), or choose tree=medusa63|chain|custom"
                )
            try:
                paths = load_choices(found[0])
            except TreeError as err:  # a damaged file: stage=train writes it again, stage=export its copy
                # the heads' own: beside them, in a folder that holds no serving layout (an export does)
                own = found[0].parent == heads_dir and layout_dir(heads_dir) == heads_dir
                again = (
                    "run `python -m medusa_train stage=train` to calibrate again"
                    if own
                    else "run `python -m medusa_train stage=export` to copy the heads' tree into the export "
                    "again (stage=train first if theirs is damaged too)"
                )
                raise TreeError(f"{err} ({again}, or choose tree=medusa63|chain|custom)") from None
        elif name == "medusa63":
            paths = [list(p) for p in MEDUSA_63]
        elif name == "chain":
            paths = chain_tree(chain_depth)
        else:
            paths = [list(p) for p in normalise_choices(choices)]
        TreeBuffers.from_choices(paths).check_heads(num_heads, vocab_size)
    except TreeError as err:
        raise UserError(f"tree={name}: {err}") from None
    return paths


def tree_for_heads(tree_cfg: TreeConfig, heads_dir: Path, heads: MedusaHeads) -> list[list[int]]:
    """:func:`resolve_tree` for a stage: the tree the ``tree=`` settings name, checked against ``heads``.

    Args:
        tree_cfg: the ``tree`` settings (``name``, ``chain_depth``, ``choices``; the config's tree group).
        heads_dir: the heads' folder (where a calibrated tree is looked for).
        heads: the heads the tree will run with (its depth and ranks are checked against them: ranks
            below their draft vocabulary, the N tokens of truncated heads).

    Raises:
        UserError: as :func:`resolve_tree`.
    """
    return resolve_tree(
        tree_cfg.name,
        heads_dir,
        heads.num_heads,
        vocab_size=heads.draft_vocab_size,
        chain_depth=tree_cfg.chain_depth,
        choices=tree_cfg.choices or (),
    )
