"""The heads' training loss as a user writes it (``training.head_loss``): names, weights, parsing.

Without torch, so that the config checks the spelling before any work. The losses themselves are
computed in :mod:`medusa_train.training.losses`.

Grammar: one or more terms joined by ``+``; a term is ``[weight[*]]name`` with a name of
:data:`HEAD_LOSSES` and an optional positive weight (default 1). Examples: ``ce``, ``kl``,
``tv``, ``kl+0.5ce``, ``0.5*kl+0.5*tv``. Whitespace is ignored; a name may appear once.

- ``ce``: cross-entropy against the token the backbone generated (hard label).
- ``kl``: forward ``KL(p || q)``, p the backbone's next-token distribution at the position the head
  predicts (soft label, at ``training.head_loss_temperature``), q the head's.
- ``tv``: total variation ``0.5 * sum |p - q|`` against the same p.

A mixture is the weighted sum of its terms.
"""

from __future__ import annotations

import math
import re

from medusa_train.errors import ConfigError

HEAD_LOSSES = ("ce", "kl", "tv")
"""The loss names; ``kl`` and ``tv`` read the backbone's distribution (soft labels)."""
SOFT_LOSSES = ("kl", "tv")
"""Names whose target is the backbone's distribution instead of the generated token."""

_TERM = re.compile(r"^(?:(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?)\*?)?([a-z]+)$")


def parse_head_loss(spec: str) -> tuple[tuple[str, float], ...]:
    """``"kl+0.5ce"`` -> ``(("kl", 1.0), ("ce", 0.5))``: the terms of a head-loss spec, in order.

    Raises:
        ConfigError: an unknown name, a repeated name, a weight that is not a positive number, or
            an empty spec.
    """
    text = "".join(str(spec).split())
    terms: list[tuple[str, float]] = []
    for part in text.split("+") if text else [""]:
        match = _TERM.match(part)
        if match is None or match.group(2) not in HEAD_LOSSES:
            raise ConfigError(
                f"training.head_loss={spec!r}: {part!r} is not one of {'|'.join(HEAD_LOSSES)} with an optional "
                "weight; join terms with '+', e.g. kl+0.5ce"
            )
        weight = float(match.group(1)) if match.group(1) else 1.0
        name = match.group(2)
        if not 0 < weight < math.inf:  # 1e400 overflows to inf: every loss would be inf or NaN
            raise ConfigError(
                f"training.head_loss={spec!r}: the weight of {name} must be a finite number > 0"
            )
        if name in (n for n, _ in terms):
            raise ConfigError(f"training.head_loss={spec!r}: {name} must be given once (add its weights up)")
        terms.append((name, weight))
    return tuple(terms)


def is_soft(terms: tuple[tuple[str, float], ...]) -> bool:
    """Whether any term reads the backbone's distribution (needs the hidden state at t+k)."""
    return any(name in SOFT_LOSSES for name, _ in terms)
