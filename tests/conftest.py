"""Shared fixtures.

``tiny_backbone_dir`` (session-scoped): a directory holding a random 2-layer Llama (hidden 32) and a
byte-level BPE tokenizer with the project's chat template (``medusa_train.data.tokenizer``), saved
with ``save_pretrained``, so ``load_backbone(path)`` / ``model=hf model.name_or_path=<path>`` load it
like any Hugging Face model. Built in well under a second, nothing downloaded. Its lm_head row of
the EOS token (``<|end|>``) points along the embeddings of a fixed 1/12 of the vocabulary, so greedy
replies end with EOS after a few tokens for some prompts and run to ``max_new_tokens`` for others.
Treat it as read-only (copy it to change it).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

_WORDS = (
    "the a cat dog sat on mat red blue green one two three tell me story about why how what is are you "
    "I we they run jump big small happy sad day night sun moon tree river write list name count"
).split()


def build_tiny_backbone(directory: Path, seed: int = 0) -> Path:
    """Write a random tiny Llama + chat tokenizer to ``directory`` (see the module docstring)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from medusa_train.data.tokenizer import train_tokenizer

    rng = random.Random(seed)
    texts = [
        " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12))) + rng.choice([".", "?", "!"])
        for _ in range(400)
    ]
    tok = train_tokenizer(texts, 384)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        pick = torch.randperm(len(tok), generator=torch.Generator().manual_seed(seed + 1))[: len(tok) // 12]
        direction = torch.nn.functional.normalize(model.model.embed_tokens.weight[pick], dim=-1).sum(0)
        model.lm_head.weight[tok.eos_token_id] = 0.2 * torch.nn.functional.normalize(direction, dim=0)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_backbone_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Path of a saved tiny random Llama + chat tokenizer (read-only; see the module docstring)."""
    return build_tiny_backbone(tmp_path_factory.mktemp("tiny_backbone") / "backbone")
