"""Tiny random backbones and heads for the decoder tests (nothing downloads)."""

from __future__ import annotations

import random

import torch
import transformers as tf

from medusa_train.heads import MedusaHeads

VOCAB = 128
MAX_POS = 64


def tiny_config(arch: str, vocab: int = VOCAB, max_pos: int = MAX_POS, **extra) -> tf.PretrainedConfig:
    """A 2-layer, 32-wide random config of ``arch``; Mistral gets a small sliding window."""
    common = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=max_pos,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=0,
    )
    common.update(extra)
    if arch == "llama":
        return tf.LlamaConfig(**common)
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    if arch == "mistral":
        return tf.MistralConfig(sliding_window=8, **common)
    if arch == "gpt2":
        return tf.GPT2Config(
            n_embd=32,
            n_layer=2,
            n_head=4,
            vocab_size=vocab,
            n_positions=max_pos,
            bos_token_id=0,
            eos_token_id=None,
        )
    raise ValueError(arch)


def tiny_model(arch: str, seed: int = 0, **kwargs) -> torch.nn.Module:
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(tiny_config(arch, **kwargs)).eval()


def random_heads(model: torch.nn.Module, num_heads: int = 4, seed: int = 0, std: float = 0.5) -> MedusaHeads:
    """Heads with random (not identity) blocks and random projections."""
    torch.manual_seed(seed)
    d = model.get_output_embeddings().weight.shape[1]
    v = model.get_output_embeddings().weight.shape[0]
    heads = MedusaHeads(d, v, num_heads=num_heads, num_layers=1)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0.0, std)
    return heads.eval()


def random_tree(seed: int, nodes: int = 20, max_depth: int = 4, max_rank: int = 5) -> list[list[int]]:
    """A random valid tree: every node's parent is present."""
    rng = random.Random(seed)
    tree: list[tuple[int, ...]] = []
    while len(tree) < nodes:
        parent = rng.choice([()] + [p for p in tree if len(p) < max_depth])
        child = parent + (rng.randrange(max_rank),)
        if child not in tree:
            tree.append(child)
    return [list(p) for p in tree]
