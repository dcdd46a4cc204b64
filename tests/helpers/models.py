"""Tiny random models, heads and trees: the one builder the tests and the bench scripts share.

Needs only torch + transformers (the bench scripts import it without Hydra); ``build_tiny_backbone``
also uses the project's tokenizer trainer.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
import transformers as tf

from medusa_train.head_targets import hidden_width
from medusa_train.heads import MedusaHeads

VOCAB = 128
MAX_POS = 64
ARCHS = ("llama", "qwen2", "mistral", "gpt2", "llama4")

_WORDS = (
    "the a cat dog sat on mat red blue green one two three tell me story about why how what is are you "
    "I we they run jump big small happy sad day night sun moon tree river write list name count"
).split()


def tiny_config(
    arch: str = "llama",
    *,
    vocab: int = VOCAB,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    max_pos: int = MAX_POS,
    **overrides,
) -> tf.PretrainedConfig:
    """A small random-model config of ``arch`` (2 layers, 32 wide, 128 tokens, 64 positions by default).

    Args:
        arch: llama | qwen2 | mistral (sliding window 8 unless overridden) | gpt2 | llama4 (its text model:
            a mixture of 2 experts, 1 per token, in every layer; attention in chunks of 8 with RoPE and
            global without, alternating, unless overridden) | electra, rembert (causal, ``is_decoder=True``;
            a prediction head maps the last hidden state to half its width before the LM head) |
            modernbert_decoder (a prediction head of its own width) | opt350m (OPT-350m's shape: the
            decoder's last hidden state projected to half the hidden size, which the LM head reads).
        vocab, hidden, layers, heads, kv_heads, max_pos: the shape (gpt2: no grouped KV heads).
        intermediate: MLP width; defaults to ``2 * hidden`` (gpt2: its own 4x).
        **overrides: any field of the transformers config. Token ids default to bos 0, pad 0 and no
            EOS (gpt2: no pad); pass ``bos_token_id``/``eos_token_id``/``pad_token_id`` to change them.
    """
    if arch == "gpt2":
        fields = dict(n_embd=hidden, n_layer=layers, n_head=heads, vocab_size=vocab, n_positions=max_pos)
        return tf.GPT2Config(**{**fields, "bos_token_id": 0, "eos_token_id": None, **overrides})
    fields = dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden if intermediate is None else intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=max_pos,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=0,
    )
    if arch == "llama":
        return tf.LlamaConfig(**{**fields, **overrides})
    if arch == "qwen2":
        return tf.Qwen2Config(**{**fields, **overrides})
    if arch == "mistral":
        return tf.MistralConfig(**{**fields, "sliding_window": 8, **overrides})
    if arch == "llama4":
        experts = dict(
            head_dim=hidden // heads,
            intermediate_size_mlp=fields["intermediate_size"],
            num_local_experts=2,
            num_experts_per_tok=1,
            attention_chunk_size=8,
            no_rope_layer_interval=2,
        )
        return tf.Llama4TextConfig(**{**fields, **experts, **overrides})
    shape = {k: v for k, v in fields.items() if k != "num_key_value_heads"}
    if arch == "electra":  # causal; a prediction head maps h to half its width before the LM head
        return tf.ElectraConfig(**{**shape, "embedding_size": hidden // 2, "is_decoder": True, **overrides})
    if arch == "rembert":  # causal; the LM head's own dense layer maps h to half its width first
        widths = {"input_embedding_size": hidden // 2, "output_embedding_size": hidden // 2}
        return tf.RemBertConfig(
            **{**shape, **widths, "is_decoder": True, "tie_word_embeddings": False, **overrides}
        )
    if arch == "modernbert_decoder":  # a prediction head of h's own width before the LM head; no None ids
        given = {k: v for k, v in {**shape, **overrides}.items() if v is not None}
        return tf.ModernBertDecoderConfig(
            **{"global_attn_every_n_layers": 1, "cls_token_id": 0, "sep_token_id": 0, **given}
        )
    if arch == "opt350m":  # OPT-350m's shape: the decoder projects h to half its width at its end
        opt = dict(
            hidden_size=hidden, word_embed_proj_dim=hidden // 2, ffn_dim=fields["intermediate_size"],
            num_hidden_layers=layers, num_attention_heads=heads, vocab_size=vocab,
            max_position_embeddings=max_pos, bos_token_id=0, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
        return tf.OPTConfig(**{**opt, **overrides})
    raise ValueError(f"unknown arch {arch!r}: one of {', '.join(ARCHS)}")


def llama8b_config(**overrides) -> tf.LlamaConfig:
    """Llama-3-8B's shape (for random weights: the GPU benchmarks); ``overrides`` shrink it for dry runs."""
    shape = dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    )
    return tf.LlamaConfig(**{**shape, **overrides})


def tiny_model(arch: str = "llama", seed: int = 0, **kwargs) -> torch.nn.Module:
    """A random model of :func:`tiny_config` (``kwargs`` go there), in eval mode."""
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(tiny_config(arch, **kwargs)).eval()


def build_tiny_backbone(directory: Path, seed: int = 0) -> Path:
    """Write a random tiny Llama + byte-level BPE chat tokenizer to ``directory``; returns it.

    Loadable like any Hugging Face model (``load_backbone(path)``, ``model=hf model.name_or_path=``).
    The lm_head row of the EOS token (``<|end|>``) points along the embeddings of a fixed 1/12 of the
    vocabulary, so greedy replies end with EOS after a few tokens for some prompts and run to
    ``max_new_tokens`` for others.
    """
    from medusa_train.data.tokenizer import train_tokenizer

    rng = random.Random(seed)
    texts = [
        " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12))) + rng.choice([".", "?", "!"])
        for _ in range(400)
    ]
    tok = train_tokenizer(texts, 384)
    config = tiny_config(
        vocab=len(tok),
        max_pos=256,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        pick = torch.randperm(len(tok), generator=torch.Generator().manual_seed(seed + 1))[: len(tok) // 12]
        direction = torch.nn.functional.normalize(model.model.embed_tokens.weight[pick], dim=-1).sum(0)
        model.lm_head.weight[tok.eos_token_id] = 0.2 * torch.nn.functional.normalize(direction, dim=0)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def add_remote_code(directory: Path) -> Path:
    """Give the saved tiny Llama in ``directory`` remote code: config.json's ``auto_map`` names
    ``modeling_x.XForCausalLM``, a ``LlamaForCausalLM`` that adds nothing (the same model loaded with
    ``trust_remote_code`` or as the built-in class), so its fingerprint counts that code with
    ``model.trust_remote_code`` only. Returns ``directory``."""
    config = json.loads((directory / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "modeling_x.py").write_text(
        "from transformers import LlamaForCausalLM\n\n\nclass XForCausalLM(LlamaForCausalLM):\n    pass\n"
    )
    return directory


def random_heads(model: torch.nn.Module, num_heads: int = 4, seed: int = 0, std: float = 0.5) -> MedusaHeads:
    """Heads with random (not identity) blocks and random projections, sized for ``model``."""
    torch.manual_seed(seed)
    d = hidden_width(model)
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
