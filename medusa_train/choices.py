"""Medusa tree paths ("medusa choices"): their validation and canonical order, without torch.

Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads"
(arXiv:2401.10774), section 2.1.2 "Tree attention". A tree is a list of index paths: path
``(i1, ..., id)`` is the node at depth d holding head d's rank-``id`` candidate, whose parent is
``(i1, ..., i(d-1))``. :mod:`medusa_train.decoding.tree` builds the tensors tree attention needs from
them; this module only checks and sorts them, so that the config (``tree.choices``) can do so
without importing torch (``python -m medusa_train --cfg`` answers in a fraction of a second).
"""

from __future__ import annotations

from collections.abc import Sequence

from medusa_train.errors import UserError

TreePath = tuple[int, ...]
"""One node of a tree: the candidate ranks from head 1 down to its depth, e.g. ``(0, 1)``."""


# The 63-node tree of the Medusa repository (mc_sim_7b_63), as listed in seed 003.
MEDUSA_63: list[list[int]] = [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0],
    [0, 5], [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0],
    [0, 9], [8], [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5],
    [0, 0, 0, 0], [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9],
    [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2], [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0],
    [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0],
]  # fmt: skip


class TreeError(UserError, ValueError):
    """A tree (list of index paths) is malformed or does not fit the heads it is used with.

    A :class:`~medusa_train.errors.UserError`: the CLI shows it as one line (exit code 2).
    """


def normalise_choices(choices: Sequence[Sequence[int]]) -> list[TreePath]:
    """Validate paths and return them sorted canonically (depth, then lexicographic).

    Raises:
        TreeError: not a list of paths, or a path that is empty, has a negative or non-int entry, is
            duplicated, or lacks its parent; the message names the path.
    """
    if isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence):
        raise TreeError(f"a tree is a list of index paths such as [[0], [0, 0], [1]], got {choices!r}")
    paths: list[TreePath] = []
    seen: set[TreePath] = set()
    for raw in choices:
        if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence) or len(raw) == 0:
            raise TreeError(
                f"tree path {raw!r} is not a non-empty list of ints (a tree is a list of paths such as "
                "[[0], [0, 0], [1]])"
            )
        for i in raw:
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise TreeError(f"tree path {list(raw)} has entry {i!r}: entries must be non-negative ints")
        path = tuple(int(i) for i in raw)
        if path in seen:
            raise TreeError(f"tree path {list(path)} appears more than once")
        seen.add(path)
        paths.append(path)
    for path in paths:
        if len(path) > 1 and path[:-1] not in seen:
            raise TreeError(f"tree path {list(path)} has no parent: add {list(path[:-1])} to the tree")
    return sorted(paths, key=lambda p: (len(p), p))
