"""What a launcher (``torchrun``, the ``deepspeed`` launcher) tells this process, read without torch.

A launcher starts every rank with ``WORLD_SIZE`` (the number of processes), ``RANK`` (this one's, from
0), ``LOCAL_RANK`` (its index on the node: its CUDA device) and the rendezvous address
(``MASTER_ADDR``, ``MASTER_PORT``). This module reads them with the standard library only, so that
the CLI checks them (:func:`launch_problem`) right after composing the config, before it imports a
stage, and torch with it: a variable left from another job, or a malformed one, is one line and exit
code 2 instead of a traceback after the backbone loaded. Without a launcher none is set: one process,
rank 0. A variable set empty is malformed, not unset: torch and transformers read it as set.

Called as a library, :func:`rank`, :func:`world_size` and :func:`local_rank` raise
:class:`~medusa_train.errors.UserError` with :func:`launch_problem`'s line when their own variable is
malformed (not an integer, negative, ``WORLD_SIZE`` below 1); whether the variables agree with one
another (``RANK`` below ``WORLD_SIZE``, the rendezvous variables set) is :func:`launch_problem`'s alone.
"""

from __future__ import annotations

import os

from medusa_train.errors import UserError

_START = "start the ranks with torchrun or the deepspeed launcher"
_LOWEST = {"RANK": 0, "WORLD_SIZE": 1, "LOCAL_RANK": 0}
"""The integers a launcher sets and the smallest value each may take."""


def _shown(name: str, value: str) -> str:
    """``NAME=value`` as the shell would print it (quoted when blank, spaced or not printable)."""
    plain = value and value.isprintable() and not any(c.isspace() for c in value)
    return f"{name}={value}" if plain else f"{name}={value!r}"


def _malformed(name: str) -> str | None:
    """Why ``name``'s value is no value a launcher sets (None: it is, or it is unset)."""
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        why = "is not an integer" if value.strip() else "is empty"
    else:
        lowest = _LOWEST[name]
        if number >= lowest:
            return None
        why = "is negative" if number < 0 else f"is below {lowest}"
    unset = f"unset {name} to run one process" if name == "WORLD_SIZE" else f"unset {name}"
    return f"{_shown(name, value)} {why}: {_START} (they set it), or {unset}"


def _integer(name: str, default: int) -> int:
    """The integer ``name`` holds (``default`` when unset); a malformed value raises :class:`UserError`."""
    problem = _malformed(name)
    if problem is not None:
        raise UserError(problem)
    return int(os.environ.get(name, default))


def rank() -> int:
    """Global rank of this process (0 without a launcher)."""
    return _integer("RANK", 0)


def world_size() -> int:
    """Number of processes of the launch (1 without a launcher)."""
    return _integer("WORLD_SIZE", 1)


def local_rank() -> int:
    """Rank on this node: the CUDA device index of this process."""
    return _integer("LOCAL_RANK", 0)


def is_main() -> bool:
    """Rank 0: the process that publishes artefacts and talks to the tracker."""
    return rank() == 0


def launched() -> bool:
    """A launcher (torchrun, deepspeed) started this process."""
    return "WORLD_SIZE" in os.environ


def launch_problem() -> str | None:
    """Why this process cannot join the launch its environment announces (None: it can, or none is),
    as one line naming the variable, its value and what to do: ``RANK``, ``WORLD_SIZE`` or
    ``LOCAL_RANK`` malformed (not an integer, negative, ``WORLD_SIZE`` below 1), ``RANK`` not below
    ``WORLD_SIZE`` (1 when unset), ``MASTER_PORT`` no port; or WORLD_SIZE above 1 without RANK,
    MASTER_ADDR or MASTER_PORT, which torchrun and the deepspeed launcher set with it and every
    rendezvous reads (a variable left from another job, a hand-made launch). Unchecked, they show in
    the stage, after the backbone loaded: a traceback at its first collective, or a process acting as
    a rank it is not."""
    for name in _LOWEST:
        problem = _malformed(name)
        if problem is not None:
            return problem
    if rank() >= world_size():
        shown = _shown("RANK", os.environ["RANK"])
        if "WORLD_SIZE" not in os.environ:
            return f"{shown} is set without WORLD_SIZE (one process: rank 0): {_START}, or unset RANK"
        return (
            f"{shown} is not below WORLD_SIZE={world_size()} (ranks count from 0): {_START} (they set "
            "both), or unset RANK and WORLD_SIZE to run one process"
        )
    if world_size() <= 1:
        return None
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        return (
            f"WORLD_SIZE={world_size()} is set but not {', '.join(missing)}: start the ranks with torchrun or "
            "the deepspeed launcher (they set every one), or unset WORLD_SIZE to run one process"
        )
    port = os.environ["MASTER_PORT"]
    if not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        return (
            f"{_shown('MASTER_PORT', port)} is no port (1 to 65535): {_START} (they set it), or unset "
            "WORLD_SIZE to run one process"
        )
    return None
