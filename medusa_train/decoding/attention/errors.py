"""The tree attention's error, in a module of its own so that every module of the package can raise
it: a requested tree attention that cannot run here or cannot compute a model's attention, or a model no
tree attention can verify."""

from __future__ import annotations

from ...errors import UserError


class AttentionBackendError(UserError, ValueError):
    """The requested tree attention cannot run here (no triton, no CUDA device, no nvcc)."""
