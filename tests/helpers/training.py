"""The tiny backbone and padded batch the training unit tests share (tests/unit/training)."""

from __future__ import annotations

import torch
from transformers import LlamaForCausalLM

from medusa_train.training.trainer import PadCollator
from tests.helpers.models import tiny_model

VOCAB = 64


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """A random 2-layer, 32-wide Llama over 64 tokens (pad 0, EOS 1, no BOS), in eval mode."""
    return tiny_model("llama", seed, vocab=VOCAB, max_pos=128, eos_token_id=1, bos_token_id=None)


def batch(seed: int = 0, b: int = 3, t: int = 14) -> dict[str, torch.Tensor]:
    """``b`` random records of lengths ``t, t-3, ...`` (3 prompt tokens with loss_mask 0), padded."""
    g = torch.Generator().manual_seed(seed)
    records = []
    for i in range(b):
        n = t - 3 * i
        ids = torch.randint(2, VOCAB, (n,), generator=g).tolist()
        records.append({"input_ids": ids, "loss_mask": [0] * 3 + [1] * (n - 3)})
    return PadCollator(0)(records)
