"""Shared fixtures (the helpers themselves live in the ``tests.helpers`` package).

``tiny_backbone_dir`` (session-scoped): a directory holding a random 2-layer Llama (hidden 32) and a
byte-level BPE tokenizer with the project's chat template (``medusa_train.data.tokenizer``), saved
with ``save_pretrained``, so ``load_backbone(path)`` / ``model=hf model.name_or_path=<path>`` load it
like any Hugging Face model (:func:`tests.helpers.models.build_tiny_backbone`). Built in well under a
second, nothing downloaded. Treat it as read-only (copy it to change it).
"""

from __future__ import annotations

import os
from pathlib import Path

# One intra-op thread per test process, and per process a test starts (inherited through the
# environment unless a test sets its own). The tests run tiny models, whose operations are too small
# to split: on CI's two cores under two pytest workers, torch's default (a thread per core in every
# process) oversubscribes them, and OpenMP's spinning threads made a tiny eval run 3.4x slower (10.5 s
# against 3.1 s with two at once; alone, 3.0 s against 2.7 s). Set OMP_NUM_THREADS to choose another.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Triton reads TRITON_INTERPRET when it is first imported (its own library is decorated then), and any
# test may import it first (torch.compile does): without a GPU the whole session runs Triton kernels in
# its CPU interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The tests that compile (torch.compile's inductor on the CPU) spend their time in g++, one
    # shared library per generated kernel. Scalar C++ kernels compile in about half the time of
    # vectorized ones (a tiny GPT-2's captured step: 13-14 s against 24-25 s, 2-core AMD EPYC VM,
    # 2026-12-07), and one compile thread per process spares a pool of compile workers fighting the
    # other test worker for two cores (27 s of CPU against 32 s). What they test is our decoder's
    # logic under compilation, not inductor's vector code; on a GPU inductor writes Triton kernels.
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402

from tests.helpers.models import build_tiny_backbone  # noqa: E402


@pytest.fixture(scope="session")
def tiny_backbone_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Path of a saved tiny random Llama + chat tokenizer (read-only; see the module docstring)."""
    return build_tiny_backbone(tmp_path_factory.mktemp("tiny_backbone") / "base_model")
