"""The three decoders on models whose attention masks or positions are not Llama's: chunked attention
(Llama 4: chunked layers and global NoPE layers), interleaved sliding windows (Gemma 2, 3, 3n and 4,
Cohere 2, gpt-oss, and Gemma 3's multimodal model, whose config nests the text one) and layers that read
an earlier layer's KV (Gemma 4's, Gemma 4 Unified's and Gemma 3n's ``num_kv_shared_layers``), each
decoded past its chunk or window (Gemma 3n, whose ``hidden_states[-1]`` is its AltUp streams stacked,
with heads that read what its LM head reads), the static decoder with one mask per layer type (eager,
compiled, and with the Triton kernel); multi-head latent attention (DeepSeek-V2 and V3, MiniCPM3), whose
cache keeps keys and values of different widths; a window or a chunk that only the config carries (a
Llama's ``sliding_window`` or ``attention_chunk_size``, which its code never reads: full attention, also
set per layer) against Mistral's window and Llama 4's chunk; and the models they refuse before any
forward: ALiBi (Bloom, Falcon with ``alibi``, MPT), layers of another type than full, sliding-window or
chunked attention (Qwen3-Next, RecurrentGemma, LFM2, Zaya, Mamba), models that keep a recurrent state
without naming layer types (RWKV, xLSTM), Dory run with more than one recurrent loop (with one, served),
models that take no position ids (Bart, Marian, TrOCR, ProphetNet, RoFormer, CpmAnt, XLNet;
WhisperForCausalLM, whose decoder takes them, is served), models that build their masks themselves (XLM,
Flaubert), the BERT family loaded without ``is_decoder=True``, which attends both ways (with it, served;
Llama, GPT-NeoX and Whisper, whose code never reads it, served), a window or chunk set per layer
(``per_layer_config``), and Llama 4 where its NoPE layers' query scaling would count positions from the
cache's length."""

from __future__ import annotations

import importlib.util
import inspect
import sys
import textwrap

import pytest
import torch
import transformers as tf
from transformers import DynamicCache

import medusa_train.decoding.attention.function as attention_function
import medusa_train.decoding.attention.support as attention_support
import medusa_train.decoding.static as static_module
from medusa_train.custom_generate import generate as custom_generate
from medusa_train.decoding import (
    StaticDecoder,
    TreeBuffers,
    chain_tree,
    measure_forward_latency,
    medusa_generate,
    medusa_generate_batch,
    tree_attention_mask,
)
from medusa_train.decoding.attention import (
    WRONG_IN_517,
    AttentionBackendError,
    attends_both_ways,
    attention_chunk,
    chunk_refusal,
    kernel_refusal,
    layer_positions,
    layers_dispatch,
    model_window,
    per_layer_attributes,
    resolve_attention,
    tree_refusal,
    unserved_layer_types,
)
from medusa_train.decoding.batched import _BatchMask, kv_reusing_layers
from medusa_train.decoding.generate import PackedHeads, last_hidden_state_tied
from medusa_train.head_targets import hidden_width, last_hidden_state
from medusa_train.hf_compat import NoKVLayer, cache_kwargs
from tests.helpers.models import ARCHS, MAX_POS, VOCAB, random_heads, random_tree, tiny_config
from tests.unit.decoding.test_decoding_greedy import OracleHeads

SHAPE = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=VOCAB, max_position_embeddings=MAX_POS, bos_token_id=0, eos_token_id=None, pad_token_id=0,
)  # fmt: skip
INTERLEAVED = ["sliding_attention", "full_attention"]
NEW_TOKENS = 20
PROMPT_LENGTHS = (5, 11, 3)  # + 20 new tokens: past every window (6) and chunk (8) below
TREES = {"chain4": chain_tree(4), "random8": random_tree(2, nodes=8)}


def llama4(
    chunk: int | None = 8, no_rope_layers: tuple[int, ...] = (1, 0), **overrides
) -> tf.PretrainedConfig:
    """Layer 0 chunked (RoPE), layer 1 global (NoPE) by default; ``no_rope_layers=(1, 1)``: both chunked."""
    return tf.Llama4TextConfig(
        **SHAPE, head_dim=8, intermediate_size_mlp=64, attention_chunk_size=chunk, num_local_experts=2,
        num_experts_per_tok=1, no_rope_layers=list(no_rope_layers), **{"initializer_range": 0.2, **overrides},
    )  # fmt: skip


def gemma3_multimodal() -> tf.PretrainedConfig:
    text = dict(SHAPE, head_dim=8, sliding_window=6, layer_types=INTERLEAVED)
    vision = dict(
        hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=16
    )
    return tf.Gemma3Config(
        text_config=text, vision_config={**vision, "patch_size": 8}, mm_tokens_per_image=1,
        image_token_index=VOCAB - 1, boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 3,
    )  # fmt: skip


def gemma3(window: int = 6) -> tf.PretrainedConfig:
    return tf.Gemma3TextConfig(**SHAPE, head_dim=8, sliding_window=window, layer_types=INTERLEAVED)


def gemma4(num_kv_shared_layers: int = 0) -> tf.PretrainedConfig:
    """Gemma 4's text model: its full layers' head_dim (global_head_dim) set per layer by transformers'
    ``per_layer_config``, on which ``config.head_dim`` raises; small per-layer token embeddings. With
    ``num_kv_shared_layers``: twice the layers, the last that many attending the KV of the last earlier
    layer of their type and keeping none of their own."""
    layers = 4 if num_kv_shared_layers else 2
    return tf.Gemma4TextConfig(
        **{**SHAPE, "num_hidden_layers": layers}, head_dim=8, global_head_dim=16, sliding_window=6,
        layer_types=INTERLEAVED * (layers // 2), num_kv_shared_layers=num_kv_shared_layers,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, initializer_range=0.2,
    )  # fmt: skip


def gemma3n() -> tf.PretrainedConfig:
    """Gemma 3n's text model: two AltUp streams (``hidden_states[-1]`` is them stacked,
    ``(altup_num_inputs, B, T, d)``; ``last_hidden_state``, what its LM head reads, unembeds and norms
    them), per-layer token embeddings, LAuReL blocks, activation sparsity on its first layer, sliding
    and full layers, the last two attending the KV of the first two (``num_kv_shared_layers``). Untied
    embeddings: with tied ones its greedy tokens repeat the last one."""
    return tf.Gemma3nTextConfig(
        **{**SHAPE, "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1}, head_dim=16,
        sliding_window=6, layer_types=INTERLEAVED * 2, num_kv_shared_layers=2, altup_num_inputs=2,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, laurel_rank=4,
        activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0], initializer_range=0.2, tie_word_embeddings=False,
    )  # fmt: skip


HAS_DORY = hasattr(tf, "DoryConfig")  # transformers 5.17 has no Dory


def dory(loops: int = 1, mode: str = "per_loop") -> tf.PretrainedConfig:
    """Dory (nGPT on the unit sphere, a recurrent section): an input, two recurrent and an output layer,
    sliding and full, the recurrent two run ``loops`` times in each forward, their KV kept per loop
    (``mode`` "per_loop": the forward appends cache layers) or by the last loop only ("last_loop": the
    earlier loops read the cache's keys beside its update)."""
    return tf.DoryConfig(
        **{**SHAPE, "num_hidden_layers": 4}, head_dim=8, sliding_window=6, layer_types=INTERLEAVED * 2,
        n_input_layers=1, n_recurrent_layers=2, n_output_layers=1, n_recurrent_loops=loops,
        recurrent_kv_cache_mode=mode, initializer_range=0.2,
    )  # fmt: skip


LATENT = dict(kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, initializer_range=1.0)
"""Multi-head latent attention (transformers 5.24): the cache holds, for each token, one head of its
compressed latent (16 wide, as the keys) and of its rotary key (8, as the values), which every layer
expands into 4 heads of keys 16 + 8 = 24 wide and values 12 wide for its attention. Dense layers
only; initializer_range 1.0: at 0.2 MiniCPM3 repeats one token."""
YARN = dict(
    rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16, beta_fast=32,
    beta_slow=1, mscale=1.0, mscale_all_dim=1.0,
)  # fmt: skip


def deepseek_v3() -> tf.PretrainedConfig:
    """DeepSeek-V3's architecture (also Kimi-K2's and Moonlight's): queries through a low-rank
    projection, YaRN positions whose ``mscale_all_dim`` scales the scores."""
    return tf.DeepseekV3Config(
        **{**SHAPE, "num_key_value_heads": 4}, **LATENT, q_lora_rank=16, first_k_dense_replace=2,
        rope_parameters=YARN,
    )  # fmt: skip


MODELS = {
    "llama4": llama4,
    "gemma3": gemma3,
    "gemma4": gemma4,
    "gemma4_kv_shared": lambda: gemma4(num_kv_shared_layers=2),
    # Gemma 4's text model of its unified multimodal checkpoints: the same KV sharing
    "gemma4_unified_kv_shared": lambda: tf.Gemma4UnifiedTextConfig(
        **{**SHAPE, "num_hidden_layers": 4}, head_dim=8, global_head_dim=16, sliding_window=6,
        layer_types=INTERLEAVED * 2, num_kv_shared_layers=2, initializer_range=0.2,
    ),  # fmt: skip
    # initializer_range 0.2: at the default 0.02 its tokens do not depend on the window
    "cohere2": lambda: tf.Cohere2Config(
        **SHAPE, sliding_window=6, layer_types=INTERLEAVED, initializer_range=0.2
    ),
    "gemma3_multimodal": gemma3_multimodal,
    "gemma3n": gemma3n,
    # nGPT, a recurrent section run once (n_recurrent_loops=1: a plain decoder; more are refused); from
    # transformers 5.24 on
    **({"dory": dory} if HAS_DORY else {}),
    # attention logit softcapping (eager attention)
    "gemma2": lambda: tf.Gemma2Config(**SHAPE, head_dim=8, sliding_window=6, layer_types=INTERLEAVED),
    # attention sinks (eager attention)
    "gpt_oss": lambda: tf.GptOssConfig(
        **SHAPE, head_dim=8, num_local_experts=2, num_experts_per_tok=1, sliding_window=6,
        layer_types=INTERLEAVED,
    ),
    # multi-head latent attention (no window): cached keys 16 wide and values 8 (LATENT)
    "deepseek_v3": deepseek_v3,
    # DeepSeek-V2(-Lite): queries without the low-rank projection
    "deepseek_v2": lambda: tf.DeepseekV2Config(
        **{**SHAPE, "num_key_value_heads": 4}, **LATENT, q_lora_rank=None, first_k_dense_replace=2
    ),
    "minicpm3": lambda: tf.MiniCPM3Config(**{**SHAPE, "num_key_value_heads": 4}, **LATENT, q_lora_rank=16),
}  # fmt: skip
LATENT_MODELS = ("deepseek_v3", "deepseek_v2", "minicpm3")
ALIBI = {
    "bloom": lambda: tf.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=VOCAB),
    "falcon": lambda: tf.FalconConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB, alibi=True
    ),
    "mpt": lambda: tf.MptConfig(d_model=32, n_layers=2, n_heads=4, vocab_size=VOCAB, max_seq_len=MAX_POS),
}


UNSERVED = {  # architectures with layers of types the decoders do not serve (UNSERVED_TYPES)
    # linear attention (gated delta rule) beside full layers
    "qwen3_next": lambda: tf.Qwen3NextConfig(
        **SHAPE, head_dim=8, layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2,
        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16,
    ),
    # recurrent blocks (named linear_attention) beside sliding-window attention
    "recurrent_gemma": lambda: tf.RecurrentGemmaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, lru_width=32, attention_window_size=6, block_types=["recurrent", "attention"],
        vocab_size=VOCAB, bos_token_id=0, eos_token_id=None, pad_token_id=0,
    ),
    # short convolutions beside full layers
    "lfm2": lambda: tf.Lfm2Config(**SHAPE, layer_types=["conv", "full_attention"]),
    # a sliding window under another name, and convolutions inside the attention of every layer
    "zaya": lambda: tf.ZayaConfig(
        **{**SHAPE, "intermediate_size": None, "num_hidden_layers": 3}, head_dim=8, moe_intermediate_size=16,
        num_experts=2, router_hidden_size=16, sliding_window=6, layer_types=["hybrid_sliding", "hybrid", "hybrid"],
    ),
    # selective state spaces only (its config names every layer linear_attention)
    "mamba": lambda: tf.MambaConfig(
        vocab_size=VOCAB, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2, time_step_rank=4,
    ),
}  # fmt: skip
UNSERVED_TYPES = {
    "qwen3_next": ["linear_attention"],
    "recurrent_gemma": ["linear_attention"],
    "lfm2": ["conv"],
    "zaya": ["hybrid_sliding", "hybrid"],
    "mamba": ["linear_attention"],
}
STATEFUL = {  # a recurrent state and no config.layer_types (transformers <= 5.24 marks them _is_stateful)
    "rwkv": lambda: tf.RwkvConfig(
        vocab_size=VOCAB, context_length=MAX_POS, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
        intermediate_size=64,
    ),
    "xlstm": lambda: tf.xLSTMConfig(
        vocab_size=VOCAB, hidden_size=32, embedding_dim=32, num_heads=2, num_blocks=2, num_hidden_layers=2,
        chunk_size=16,
    ),
}  # fmt: skip


def build(config: tf.PretrainedConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    if isinstance(config, tf.Gemma3Config):
        return tf.Gemma3ForConditionalGeneration(config).eval()
    return tf.AutoModelForCausalLM.from_config(config).eval()


def gemma3_attention_reading(model: torch.nn.Module, attribute: str, name: str) -> torch.nn.Module:
    """``model`` (Gemma 3) whose attention modules run Gemma 3's forward reading ``self.<name>`` where it
    reads ``self.<attribute>``, each module holding its value there too."""
    attention = tf.models.gemma3.modeling_gemma3.Gemma3Attention
    source = textwrap.dedent(inspect.getsource(attention.forward))
    scope: dict = {}
    exec(source.replace(f"self.{attribute}", f"self.{name}"), vars(sys.modules[attention.__module__]), scope)
    renamed = type(f"Gemma3AttentionReading_{name}", (attention,), {"forward": scope["forward"]})
    for module in model.modules():
        if type(module) is attention:
            module.__class__ = renamed
            setattr(module, name, getattr(module, attribute))
    return model


def without_layer_idx(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (Gemma 3) as a model of its own code may write it: no module has a ``layer_idx``, its
    attention modules keep their layer's index as ``layer_number`` (their forward is Gemma 3's,
    reading it there); the same weights, the same tokens."""
    gemma3_attention_reading(model, "layer_idx", "layer_number")
    for module in model.modules():
        if hasattr(module, "layer_idx"):
            del module.layer_idx
    return model


def without_attention_config(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (Gemma 3) as some remote code writes it: its attention modules keep no ``config`` (their
    forward is Gemma 3's, reading the model's config as ``model_config``) and pass their layer's
    ``sliding_window``; the same weights, the same tokens."""
    gemma3_attention_reading(model, "config", "model_config")
    for module in model.modules():
        if hasattr(module, "model_config"):
            del module.config
    return model


def plain_greedy(model, prompt: torch.Tensor, max_new_tokens: int = NEW_TOKENS) -> list[int]:
    out = model.generate(prompt[None], max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def prompts(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB - 4, (n,), generator=gen) for n in PROMPT_LENGTHS]


def count_forwards(model: torch.nn.Module) -> list:
    calls: list = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def lm_head_inputs(model: torch.nn.Module, seq: torch.Tensor) -> torch.Tensor:
    """``(T, d)``: what the LM head reads at each position of ``seq`` ``(T,)``, in a forward over it."""
    seen: list = []
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    try:
        model(seq[None])
    finally:
        hook.remove()
    return seen[0][0]


class RowsOracle(PackedHeads):
    """Heads that know the greedy continuation of several sequences: at the position t of a sequence
    whose last hidden state (what the decoders hand the heads and training reads: the decoder's
    ``last_hidden_state``, the LM head's input but for a scaling some models apply, MiniCPM3's, or a
    prediction head some put between the two, ELECTRA's and RemBERT's) is the given one, up to rounding,
    head k ranks that sequence's token t + k + 2 at ``rank`` (head 0; the others at 0); given other
    states, they know nothing (every logit 0). Tensor operations only (no host read): a step can hold
    them."""

    def __init__(self, model, sequences: list[torch.Tensor], num_heads: int = 4, rank: int = 0) -> None:
        self.num_heads, self.draft_vocab_size, self.rank = num_heads, VOCAB, rank
        hidden, targets = [], []
        with torch.no_grad():
            for seq in sequences:  # (T,)
                with last_hidden_state_tied(model):  # what every decoder hands the heads
                    hidden.append(model(seq[None], output_hidden_states=True).hidden_states[-1][0])  # (T, d)
                ahead = torch.cat([seq, seq.new_zeros(num_heads + 2)])  # (T + K + 2,)
                targets.append(torch.stack([ahead[k + 2 : k + 2 + len(seq)] for k in range(num_heads)], 1))
        self.hidden, self.targets = torch.cat(hidden), torch.cat(targets)  # (N, d), (N, K)

    def logits(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        return self.logits_rows(hidden[None], num_heads)[0]  # (k, V)

    def logits_rows(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        k = self.num_heads if num_heads is None else num_heads
        exact = "donot_use_mm_for_euclid_dist"  # the matrix-product form errs by ~1e-3 here
        distance, nearest = torch.cdist(hidden.float(), self.hidden.float(), compute_mode=exact).min(dim=1)
        target = self.targets[nearest, :k]  # (B, k)
        known = (distance < 1e-3)[:, None, None]  # (B, 1, 1): a state it recorded, up to rounding
        out = torch.zeros(*target.shape, VOCAB).scatter_(2, target[..., None], 10.0)  # (B, k, V)
        if self.rank:  # head 0: rank tokens target + 1 .. target + rank above its target
            above = (target[:, :1, None] + torch.arange(1, self.rank + 1)) % VOCAB  # (B, 1, rank)
            out[:, :1].scatter_(2, above, 11.0)
        return out * known


def assert_decoders_return(model, heads, rows: list[torch.Tensor], refs: list[list[int]], label: str) -> None:
    """On every tree of :data:`TREES`, ``medusa_generate`` (each row), ``medusa_generate_batch`` and the
    static decoder (the rows together) return ``refs``, each row's new tokens."""
    for tree_name, tree in TREES.items():
        for prompt, ref in zip(rows, refs, strict=True):
            out = medusa_generate(model, heads, prompt[None], max_new_tokens=NEW_TOKENS, tree=tree)
            assert out.tokens.tolist() == ref, (label, tree_name, len(prompt))
        batch = medusa_generate_batch(model, heads, rows, max_new_tokens=NEW_TOKENS, tree=tree)
        assert [r.tokens.tolist() for r in batch.rows] == refs, (label, tree_name)
        decoder = StaticDecoder(model, heads, tree, 2 * MAX_POS, batch_size=len(rows))
        static = decoder.generate_batch(rows, max_new_tokens=NEW_TOKENS)
        assert [r.tokens.tolist() for r in static.rows] == refs, (label, tree_name)


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_parity_past_the_chunk_or_window(name):
    """``medusa_generate``, ``medusa_generate_batch`` (ragged rows: left padding shifts no chunk) and the
    static decoder (three rows of different lengths, one mask per layer type) equal ``generate`` with
    contexts past the chunk (8) or window (6); the latent-attention models have neither."""
    model = build(MODELS[name]())
    heads = random_heads(model, seed=1)
    rows = prompts()
    refs = [plain_greedy(model, p) for p in rows]
    assert_decoders_return(model, heads, rows, refs, name)


@pytest.mark.parametrize("name", list(MODELS))
def test_static_decoder_accepts_whole_paths_past_the_chunk_or_window(name):
    """Heads that know each row's continuation: the static decoder accepts whole paths (a chain, and a
    path that is not contiguous in node order: head 0's target at rank 1), so every node's logits,
    under its layer types' masks, decide tokens; three rows of different lengths equal ``generate``."""
    model = build(MODELS[name]())
    rows = prompts()
    refs = [plain_greedy(model, p, NEW_TOKENS + 6) for p in rows]
    sequences = [torch.cat([p, torch.tensor(r)]) for p, r in zip(rows, refs, strict=True)]
    branching = [[0], [1], [0, 0], [1, 0], [1, 0, 0], [1, 0, 0, 0]]
    for tree, rank in ((chain_tree(4), 0), (branching, 1)):
        decoder = StaticDecoder(
            model, RowsOracle(model, sequences, rank=rank), tree, 2 * MAX_POS, batch_size=3
        )
        out = decoder.generate_batch(rows, max_new_tokens=NEW_TOKENS)
        assert [r.tokens.tolist() for r in out.rows] == [r[:NEW_TOKENS] for r in refs], (name, rank)
        assert all(r.accepted_lengths[:4] == [5] * 4 for r in out.rows), (name, rank)


def greedy_on_a_full_cache(model, prompt: torch.Tensor) -> list[int]:
    """Plain greedy ``generate`` on a cache built without the config (``DynamicCache()``), whose layers
    keep every position: the model's masks alone decide what a token attends. transformers' default cache
    gives every layer of a config with a ``sliding_window`` a sliding-window cache layer, whatever the
    model's code: a Llama whose config carries one would attend its whole prompt at the prefill and
    only the window after it."""
    out = model.generate(
        prompt[None],
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
        **cache_kwargs(model, DynamicCache()),
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(("arch", "applied"), [("llama", None), ("mistral", 6)])
def test_a_window_the_models_code_does_not_read_is_not_applied(arch, applied):
    """A Llama whose config carries ``sliding_window=6`` (some fine-tunes' config.json do), which its code
    never reads: its forward attends every position (the same weights without the key give the same
    tokens), and so do the three decoders' masks, each equal plain greedy ``generate`` with contexts past
    the window. Mistral with the same window applies it (without it the tokens differ), and so do the
    decoders."""
    model = build(tiny_config(arch, sliding_window=6, initializer_range=0.2))
    assert model_window(model) == applied
    heads = random_heads(model, seed=1)
    rows = prompts()
    refs = [greedy_on_a_full_cache(model, p) for p in rows]
    without_key = build(tiny_config(arch, sliding_window=None, initializer_range=0.2))
    assert ([greedy_on_a_full_cache(without_key, p) for p in rows] == refs) == (applied is None)
    assert_decoders_return(model, heads, rows, refs, arch)


@pytest.mark.parametrize(("arch", "applied"), [("llama", None), ("llama4", 6)])
def test_a_chunk_the_models_code_does_not_read_is_not_applied(arch, applied):
    """A Llama whose config carries ``attention_chunk_size=6`` and a "chunked_attention" layer type, which
    its code never reads: its forward attends every position (the same weights with a chunk past every
    position give the same tokens), and so do the three decoders' masks, each equal plain greedy
    ``generate`` with contexts past the chunk, and the tree kernels are not refused for its chunk. Llama 4
    with the same chunk and layer types applies it (with one past every position the tokens differ),
    and so do the decoders; the kernels are refused past its chunk.

    transformers' default cache gives every "chunked_attention" layer (and every layer of a config with
    an ``attention_chunk_size`` and no ``layer_types``) a cache of the chunk's last positions, whatever
    the model's code: the references run on a cache without the config, whose layers keep them all."""
    kw = dict(attention_chunk_size=6, initializer_range=0.2)
    if arch == "llama":
        kw["layer_types"] = ["chunked_attention", "full_attention"]  # Llama 4's, by its no_rope_layers
    model = build(tiny_config(arch, **kw))
    assert model.config.layer_types == ["chunked_attention", "full_attention"]
    assert attention_chunk(model) == applied
    assert (chunk_refusal(model, None) is None) == (applied is None)
    heads = random_heads(model, seed=1)
    rows = prompts()
    refs = [greedy_on_a_full_cache(model, p) for p in rows]
    unchunked = build(tiny_config(arch, **{**kw, "attention_chunk_size": 4 * MAX_POS}))
    assert ([greedy_on_a_full_cache(unchunked, p) for p in rows] == refs) == (applied is None)
    assert_decoders_return(model, heads, rows, refs, arch)


def doge_config(attn_implementation: str | None = None, **kw) -> tf.DogeConfig:
    """A tiny Doge config (``attn_implementation``: the one the model is built with; None, its default)."""
    config = tf.DogeConfig(
        **{
            **dict(
                hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=2 * MAX_POS,
                initializer_range=0.2, bos_token_id=0, eos_token_id=None, pad_token_id=0,
            ),
            **kw,
        }
    )  # fmt: skip
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    return config


def test_a_model_that_defines_its_own_mask_function_for_generate_is_not_chunked():
    """Doge defines a ``create_masks_for_generate`` of its own (for ``generate``, which calls it) and never
    reads a chunk: with ``attention_chunk_size=6`` and "chunked_attention" layer types its forward attends
    every position, and so do the decoders, each equal plain greedy ``generate`` on a cache that keeps
    every position (a definition of that name was taken for a use of transformers' masks, which chunk
    such layers: the decoders chunked where the model does not). Eager: causal in transformers 5.17 too
    (its SDPA forward is not)."""
    chunked = dict(layer_types=["chunked_attention", "chunked_attention"])
    model = build(doge_config("eager", attention_chunk_size=6, **chunked))
    assert attention_chunk(model) is None and chunk_refusal(model, None) is None
    heads = random_heads(model, seed=1)
    rows = prompts()
    refs = [greedy_on_a_full_cache(model, p) for p in rows]
    unchunked = build(doge_config("eager", attention_chunk_size=4 * MAX_POS, **chunked))
    assert [greedy_on_a_full_cache(unchunked, p) for p in rows] == refs
    assert_decoders_return(model, heads, rows, refs, "doge")


def test_a_model_whose_own_positions_start_past_zero():
    """RoBERTa as a decoder: given no position ids, its embeddings count positions from its pad id + 1;
    ``generate`` and the tree steps give them from 0. Every decoder's prefill gives them too (without,
    ``medusa_generate``'s prompt sat one position further than its tree nodes and ``generate``'s), and
    the three decoders equal plain greedy ``generate``."""
    config = tf.RobertaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
        max_position_embeddings=2 * MAX_POS, is_decoder=True, bos_token_id=0, eos_token_id=None,
        pad_token_id=0, initializer_range=1.0,
    )  # fmt: skip
    model = build(config)
    heads = random_heads(model, seed=1)
    rows = prompts()
    refs = [plain_greedy(model, p) for p in rows]
    assert_decoders_return(model, heads, rows, refs, "roberta")


@pytest.mark.parametrize(
    ("attribute", "types"),
    [("sliding_window", None), ("attention_chunk_size", ["chunked_attention", "full_attention"])],
)
def test_a_window_or_chunk_per_layer_the_models_code_does_not_read_is_served(attribute, types):
    """A Llama whose config sets ``sliding_window`` or ``attention_chunk_size`` per layer
    (``per_layer_config``; the chunk with "chunked_attention" layer types), which its code never reads:
    not refused (Mistral's window and Llama 4's chunk are: the masks cannot give its layers their own),
    and decoded with full attention, equal plain greedy ``generate``."""
    model = build(
        tiny_config("llama", **{attribute: 6}, per_layer_config={1: {attribute: 4}}, layer_types=types)
    )
    assert per_layer_attributes(model.config) == [attribute] and tree_refusal(model) is None
    assert model_window(model) is None and attention_chunk(model) is None
    heads = random_heads(model, seed=1)
    rows = prompts()
    refs = [greedy_on_a_full_cache(model, p) for p in rows]
    for prompt, ref in zip(rows, refs, strict=True):
        out = medusa_generate(model, heads, prompt[None], max_new_tokens=NEW_TOKENS, tree=TREES["random8"])
        assert out.tokens.tolist() == ref
    decoder = StaticDecoder(model, heads, TREES["random8"], 2 * MAX_POS, batch_size=3)
    assert [r.tokens.tolist() for r in decoder.generate_batch(rows, max_new_tokens=NEW_TOKENS).rows] == refs


@pytest.mark.parametrize(
    ("chunk", "no_rope_layers", "capacity"),
    [(6, (1, 1), 48), (40, (1, 0), 40)],
    ids=["every-layer-chunked", "mixed-within-the-chunk"],
)
def test_static_decoder_chunked_layers(chunk, no_rope_layers, capacity):
    """Every layer chunked (chunk 6, passed): the static decoder's masks cut each chunk; chunked and
    global layers with a capacity inside the chunk: nothing to cut, one mask serves both."""
    model = build(llama4(chunk, no_rope_layers))
    heads = random_heads(model, seed=1)
    for tree_name, tree in TREES.items():
        decoder = StaticDecoder(model, heads, tree, capacity, batch_size=2)
        for prompt in prompts(seed=1):
            out = decoder.generate(prompt[None], max_new_tokens=NEW_TOKENS)
            assert out.tokens.tolist() == plain_greedy(model, prompt), (tree_name, len(prompt))


def chunk_rule(tree: TreeBuffers, past: int, pad: int, width: int, chunk: int) -> torch.Tensor:
    """``(M, width)`` bool: the chunked layers' rule for M nodes at columns ``[pad + past, ...)`` after
    ``pad`` padding columns and ``past`` cached tokens (positions from 0 at the first real column)."""
    m, start = tree.num_nodes, pad + past
    col = torch.arange(width)
    allowed = ((col >= pad) & (col < start))[None].expand(m, width).clone()  # (M, W)
    allowed[:, start : start + m] = tree.attn_mask
    key = (col - pad).clone()
    key[start : start + m] = past + tree.depth
    query = past + tree.depth  # (M,)
    return allowed & (key[None, :] // chunk == query[:, None] // chunk)


@pytest.mark.parametrize(
    "no_rope_layers", [(1, 1), (1, 0)], ids=["every-layer-chunked", "chunked-and-global"]
)
def test_chunked_masks_follow_the_rule(no_rope_layers):
    """Each decoder's chunked-layer mask is the rule itself (a key visible only in its query's chunk of
    positions; a tree node's position is the past plus its depth, not its column) on a tree of 12
    nodes crossed by a chunk boundary at every past length: ``medusa_generate``'s, the batched
    decoder's (left-padded rows) and the static decoder's; with global layers too, the static
    decoder's masks are one per layer type, the global layers' without chunks (the prefill's too)."""
    chunk = 4
    model = build(llama4(chunk, no_rope_layers=no_rope_layers))
    tree = TreeBuffers.from_choices(random_tree(3, nodes=12, max_depth=4))
    m = tree.num_nodes
    for past in range(0, 20):
        mask = tree_attention_mask(model, tree, past, torch.float32)["chunked_attention"]  # (1, 1, M, W)
        assert torch.equal(mask[0, 0] == 0, chunk_rule(tree, past, 0, past + m, chunk)), past
    lens, pads = torch.tensor([9, 14, 5]), torch.tensor([2, 0, 5])  # cached columns, padding among them
    masks = _BatchMask(model, tree, 32, torch.float32).build(lens, pads, m, 30, reach=14 + tree.max_depth)
    for b in range(3):
        rule = chunk_rule(tree, int(lens[b] - pads[b]), int(pads[b]), 30, chunk)
        assert torch.equal(masks["chunked_attention"][b, 0] == 0, rule), b
    decoder = StaticDecoder(model, random_heads(model), tree, 40, batch_size=3)
    with torch.inference_mode():
        decoder.length.copy_(torch.tensor([3, 11, 17]))
        static_masks = decoder._tree_mask()  # (B, 1, M, C), or one per layer type
        prefill = decoder._prefill_mask(13)  # (1, 1, T, C), or one per layer type
    if no_rope_layers == (1, 1):
        static_masks, prefill = {"chunked_attention": static_masks}, {"chunked_attention": prefill}
    assert set(static_masks) == set(prefill) == set(model.config.layer_types)
    for b in range(3):
        past = int(decoder.length[b])
        rule = chunk_rule(tree, past, 0, 40, chunk)
        assert torch.equal(static_masks["chunked_attention"][b, 0] == 0, rule), b
        if "full_attention" in static_masks:
            full = chunk_rule(tree, past, 0, 40, chunk=10**6)
            assert torch.equal(static_masks["full_attention"][b, 0] == 0, full), b
    causal = torch.ones(13, 40, dtype=torch.bool).tril()  # (T, C)
    pos = torch.arange(40)
    assert torch.equal(
        prefill["chunked_attention"][0, 0] == 0, causal & (pos[None] // chunk == pos[:13, None] // chunk)
    )
    if "full_attention" in prefill:
        assert torch.equal(prefill["full_attention"][0, 0] == 0, causal)


def test_static_sliding_masks_are_the_dynamic_decoders_per_layer_type():
    """Gemma 3 with a window of 2 (a tree of depth 4 crosses it inside the tree): the static decoder's
    mask of each layer type is, at each row's cache length, ``medusa_generate``'s mask of that type
    (checked against ``generate`` by the parity tests), every column past the tree masked; its prefill
    masks are the causal mask, windowed for the sliding layers."""
    model = build(gemma3(window=2))
    tree = TreeBuffers.from_choices(random_tree(3, nodes=12, max_depth=4))
    m, width = tree.num_nodes, 40
    decoder = StaticDecoder(model, random_heads(model), tree, width, batch_size=3)
    with torch.inference_mode():
        decoder.length.copy_(torch.tensor([0, 5, 17]))
        masks = decoder._tree_mask()  # {type: (B, 1, M, C)}
        prefill = decoder._prefill_mask(9)  # {type: (1, 1, T, C)}
    assert set(masks) == set(prefill) == {"full_attention", "sliding_attention"}
    for b in range(3):
        past = int(decoder.length[b])
        dynamic = tree_attention_mask(model, tree, past, torch.float32)  # {type: (1, 1, M, past + M)}
        for kind, mask in masks.items():
            assert torch.equal(mask[b, 0, :, : past + m], dynamic[kind][0, 0]), (b, kind)
            assert bool((mask[b, 0, :, past + m :] < 0).all()), (b, kind)
    assert not torch.equal(dynamic["full_attention"], dynamic["sliding_attention"])
    causal = torch.ones(9, width, dtype=torch.bool).tril()  # (T, C)
    pos = torch.arange(width)
    assert torch.equal(prefill["full_attention"][0, 0] == 0, causal)
    assert torch.equal(prefill["sliding_attention"][0, 0] == 0, causal & (pos[:9, None] - pos[None] < 2))


def test_static_typical_acceptance_on_mixed_layers():
    """Typical acceptance inside the step on Gemma 3's sliding and full layers: three rows of different
    lengths, each the tokens of ``medusa_generate(acceptance="typical")``, some steps rejecting
    candidates and some accepting them (a low temperature peaks the tiny model's distributions)."""
    model = build(MODELS["gemma3"]())
    heads = random_heads(model, seed=1)
    rows = prompts()
    settings = dict(acceptance="typical", temperature=0.05)
    tree = TREES["random8"]
    decoder = StaticDecoder(model, heads, tree, 2 * MAX_POS, batch_size=3, **settings)
    out = decoder.generate_batch(rows, max_new_tokens=NEW_TOKENS)
    for prompt, row in zip(rows, out.rows, strict=True):
        ref = medusa_generate(model, heads, prompt[None], max_new_tokens=NEW_TOKENS, tree=tree, **settings)
        assert row.tokens.tolist() == ref.tokens.tolist()
    lengths = {n for r in out.rows for n in r.accepted_lengths}
    assert 1 in lengths and max(lengths) > 1, lengths


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_static_kernel_reads_each_layer_types_window(monkeypatch):
    """The Triton kernel (CPU: its interpreter) on Gemma 3's sliding and full layers: two rows of
    different lengths past the window equal ``generate``; the sliding layers read windowed ancestor
    bits and the full layers the tree's own, both built with the decoder and among the tensors its
    capture holds static (a replay reads them where they were at the capture)."""
    seen = []
    kernel = attention_function.triton_tree_attention

    def recorded(*args, **kwargs):
        seen.append((args[5], kwargs["window"]))  # the ancestor bits, the layer's window
        return kernel(*args, **kwargs)

    monkeypatch.setattr(attention_function, "triton_tree_attention", recorded)
    model = build(MODELS["gemma3"]())
    heads = random_heads(model, seed=1)
    rows = prompts()[:2]
    refs = [plain_greedy(model, p, 10) for p in rows]
    decoder = StaticDecoder(model, heads, TREES["random8"], 32, batch_size=2, attention="triton")
    static = {t.data_ptr() for t in decoder._static}
    out = decoder.generate_batch(rows, max_new_tokens=10)
    assert [r.tokens.tolist() for r in out.rows] == refs
    assert {window for _, window in seen} == {None, 6}
    assert len({bits.data_ptr() for bits, _ in seen}) == 2
    assert all(bits.data_ptr() in static for bits, _ in seen)


def _attention_without_layer_idx(model):
    model = without_layer_idx(model)
    assert not any(hasattr(m, "layer_idx") for m in model.modules())
    return model


def _attention_without_config(model):
    model = without_attention_config(model)
    sliding = model.model.layers[0].self_attn
    assert not hasattr(sliding, "config") and sliding.sliding_window == 6
    return model


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize(
    "strip", [_attention_without_layer_idx, _attention_without_config], ids=["layer_idx", "config"]
)
def test_kernel_places_attention_without_its_layer_idx_or_config(strip):
    """Gemma 3's sliding and full layers with no ``layer_idx`` on any module (the kernel takes each
    attention layer's type from its decoder layer's place in the model's list of layers, as the model's
    own forward pairs layers and masks), or attention modules without a ``config`` of their own, the
    sliding ones passing ``sliding_window=6`` (the kernel reads the window from the model's config, as
    the decoders' masks do). The static decoder with the Triton kernel (CPU: its interpreter) equals
    ``generate`` past the window, heads that know the continuation making every node's logits decide
    tokens; so do ``medusa_generate`` and ``medusa_generate_batch`` (one verification each)."""
    model = strip(build(MODELS["gemma3"]()))
    prompt = prompts()[1]  # 11 tokens: past the window of 6
    ref = plain_greedy(model, prompt, 10)
    oracle = RowsOracle(model, [torch.cat([prompt, torch.tensor(ref)])])
    decoder = StaticDecoder(model, oracle, chain_tree(4), 32, attention="triton")
    out = decoder.generate(prompt[None], max_new_tokens=10)
    assert out.tokens.tolist() == ref
    assert out.accepted_lengths[0] == 5
    heads, tree = random_heads(model, seed=1), chain_tree(2)
    one = medusa_generate(model, heads, prompt[None], max_new_tokens=2, tree=tree, attention="triton")
    batch = medusa_generate_batch(model, heads, [prompt], max_new_tokens=2, tree=tree, attention="triton")
    assert one.tokens.tolist() == batch.rows[0].tokens.tolist() == ref[:2]


def test_layer_positions_are_the_text_decoders_layers():
    """The layer of every module inside the text decoder's layers, none of the vision tower's (Gemma 3
    multimodal: its vision encoder has its own list of layers; Llama 4's chunked and global layers);
    nothing for a model whose layers all window and chunk alike (Llama 4 with every layer chunked)."""
    model = build(gemma3_multimodal())
    positions = layer_positions(model)
    for i, layer in enumerate(model.model.language_model.layers):
        assert {positions[id(m)] for m in layer.modules()} == {i}
    assert not any(id(m) in positions for m in model.model.vision_tower.modules())
    model = build(llama4())
    positions = layer_positions(model)
    for i, layer in enumerate(model.model.layers):
        assert {positions[id(m)] for m in layer.modules()} == {i}
    assert layer_positions(build(llama4(no_rope_layers=(1, 1)))) == {}


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kernels_refuse_mixed_layers_nothing_places_before_any_forward():
    """Sliding and full layers where neither a ``layer_idx`` nor a list of decoder layers tells which
    attention module is which: a kernel is refused before any forward (one line), ``auto`` keeps SDPA."""
    model = without_layer_idx(build(MODELS["gemma3"]()))
    model.model.layers = torch.nn.Sequential(*model.model.layers)  # no ModuleList of the layers
    calls = count_forwards(model)
    with pytest.raises(AttentionBackendError, match="cannot tell which is which"):
        StaticDecoder(model, random_heads(model), chain_tree(2), 32, attention="triton")
    assert not calls
    assert resolve_attention("auto", torch.device("cuda"), context=10**6, model=model) == "sdpa"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kernel_refuses_a_window_its_layers_masks_do_not_apply():
    """Gemma 3's sliding layer passing its attention a window of 5 where ``config.sliding_window`` (6)
    windows its masks (a model with windows of its own per layer would): the kernel is refused in the
    step, one line, not run on a window the decoders' masks and ancestor bits do not know; SDPA
    decodes it as ``generate`` does (transformers' SDPA reads the masks, not the window passed)."""
    model = build(MODELS["gemma3"]())
    model.model.layers[0].self_attn.sliding_window = 5
    heads = random_heads(model, seed=1)
    prompt = prompts()[1]
    decoder = StaticDecoder(model, heads, chain_tree(2), 32, attention="triton")
    with pytest.raises(AttentionBackendError, match=r"passes sliding_window=5 .*masks window by 6"):
        decoder.generate(prompt[None], max_new_tokens=4)
    out = StaticDecoder(model, heads, chain_tree(2), 32).generate(prompt[None], max_new_tokens=4)
    assert out.tokens.tolist() == plain_greedy(model, prompt, 4)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3", "deepseek_v3"])
def test_static_compiled_on_mixed_layers_and_latent_attention(name):
    """The step under torch.compile (inductor, default mode) with Gemma 3's per-layer-type masks, and on
    DeepSeek-V3's latent attention (cached keys and values of different widths): one graph, no break,
    three rows of different lengths equal ``generate`` (Gemma 3: about 2 min on 2 cores)."""
    import torch._dynamo.utils

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = build(MODELS[name]())
    rows = prompts()
    decoder = StaticDecoder(
        model, random_heads(model, seed=1), TREES["random8"], 2 * MAX_POS, batch_size=3, capture="compile"
    )
    out = decoder.generate_batch(rows, max_new_tokens=NEW_TOKENS)
    assert [r.tokens.tolist() for r in out.rows] == [plain_greedy(model, p) for p in rows]
    counters = torch._dynamo.utils.counters
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1, dict(counters)


def decoder_calls(model, heads) -> list:
    """One short call of each tree decoder (one row, two rows, static shapes) on ``model``: for the
    tests that each refuses a model before any forward."""
    prompt = torch.tensor([3, 5, 7])
    return [
        lambda: medusa_generate(model, heads, prompt[None], max_new_tokens=4, tree=chain_tree(2)),
        lambda: medusa_generate_batch(
            model, heads, [prompt, prompt[1:]], max_new_tokens=4, tree=chain_tree(2)
        ),
        lambda: StaticDecoder(model, heads, chain_tree(2), 32),
    ]


def refusals_before_any_forward(model, heads, tmp_path, match: str) -> list[str]:
    """Each tree decoder (:func:`decoder_calls`) and ``generate`` of an export's ``custom_generate``,
    before it looks for the export, refuse ``model`` with an :class:`AttentionBackendError` of one line
    matching ``match``, and no forward runs: their messages."""
    calls = count_forwards(model)
    prompt = torch.tensor([3, 5, 7])
    decoders = [
        *decoder_calls(model, heads),
        lambda: custom_generate(model, prompt[None], export_dir=str(tmp_path / "no_export")),
    ]
    messages = []
    for decode in decoders:
        with pytest.raises(AttentionBackendError, match=match) as err:
            decode()
        messages.append(str(err.value))
    assert not any("\n" in message for message in messages)
    assert not calls
    return messages


@pytest.mark.parametrize("name", list(ALIBI))
def test_alibi_models_are_refused_before_any_forward(name):
    """Bloom, Falcon with ``alibi`` and MPT build their biases themselves, from a 2-D padding mask (Bloom
    and Falcon failed mid-decoding on the tree's 4-D mask) or by cache column (MPT: a tree node's
    column is not its position): every decoder refuses them in one line naming the model type, before
    the prefill; Falcon without ALiBi decodes."""
    config = ALIBI[name]()
    model = build(config)
    heads = random_heads(model, seed=1)
    calls = count_forwards(model)
    for decode in decoder_calls(model, heads):
        with pytest.raises(AttentionBackendError, match=rf"\({config.model_type}\) adds ALiBi") as err:
            decode()
        assert "\n" not in str(err.value)
    assert not calls
    if name == "falcon":
        plain = build(tf.FalconConfig(**{**config.to_dict(), "alibi": False}))
        heads = random_heads(plain, seed=1)
        for p in prompts():
            out = medusa_generate(plain, heads, p[None], max_new_tokens=NEW_TOKENS, tree=TREES["random8"])
            assert out.tokens.tolist() == plain_greedy(plain, p)


@pytest.mark.parametrize("name", list(UNSERVED))
def test_models_with_layers_of_other_types_are_refused_before_any_forward(name, tmp_path):
    """A layer type the decoders' masks do not know (Zaya's sliding "hybrid_sliding" would get no
    window) or a layer keeping a state a tree step cannot roll back (linear attention, recurrent blocks,
    convolutions: each crashed deep inside ``medusa_generate``): every decoder, and ``generate`` of an
    export's ``custom_generate`` before it looks for the export, refuses the model in one line naming
    the types, before any forward."""
    model = build(UNSERVED[name]())
    heads = random_heads(model, seed=1)
    if getattr(model.config, "layer_types", None) is None:
        # transformers 5.17's RecurrentGemmaConfig names no layer types (its block_types only): the model
        # is refused for the recurrent state transformers marks
        assert name == "recurrent_gemma" and unserved_layer_types(model.config) == []
        refusals_before_any_forward(
            model, heads, tmp_path, r"keeps a recurrent state \(transformers' _is_stateful\)"
        )
        return
    assert unserved_layer_types(model.config) == UNSERVED_TYPES[name]
    named = ", ".join(repr(t) for t in UNSERVED_TYPES[name])
    match = rf"has layers of type {named} \(config.layer_types\)"
    for message in refusals_before_any_forward(model, heads, tmp_path, match):
        assert "serve models whose layers are full, sliding-window or chunked attention" in message


@pytest.mark.skipif(not HAS_DORY, reason="this transformers has no Dory")
@pytest.mark.parametrize("mode", ["per_loop", "last_loop"])
def test_models_that_loop_their_layers_are_refused_before_any_forward(mode, tmp_path):
    """Dory run with two recurrent loops, whose forward keeps KV the decoders' caches do not hold (per
    loop: cache layers it appends, which the batched decoder's deep copies cut off from the cache it
    sets; the last loop's: the earlier loops read every preallocated column beside the update; each
    crashed or parted from ``generate``): every decoder refuses it in one line, before any forward;
    with one loop it decodes (:data:`MODELS`)."""
    model = build(dory(loops=2, mode=mode))
    heads = random_heads(model, seed=1)
    match = r"\(dory\) runs its recurrent layers 2 times in each forward \(config.n_recurrent_loops\)"
    for message in refusals_before_any_forward(model, heads, tmp_path, match):
        assert "with n_recurrent_loops=1 they serve it" in message


def _peft_wrapped(model: torch.nn.Module) -> torch.nn.Module:
    """RWKV under LoRA on its time-mixing keys and values (a Medusa-2 backbone)."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=2, target_modules=["key", "value"]))


def _language_model_marked(model: torch.nn.Module) -> torch.nn.Module:
    """A Llama whose language model (``get_decoder()``) alone is marked stateful, as a wrapper's (a
    multimodal model's) would be where only its language model keeps a state."""
    model.model._is_stateful = True
    assert not getattr(type(model), "_is_stateful", False) and model.get_decoder() is model.model
    return model


@pytest.mark.parametrize(
    ("name", "wrap", "refused"),
    [
        ("rwkv", None, "RwkvForCausalLM"),
        ("xlstm", None, "xLSTMForCausalLM"),
        ("rwkv", _peft_wrapped, "RwkvForCausalLM"),
        ("llama", _language_model_marked, "LlamaModel"),
    ],
    ids=["rwkv", "xlstm", "rwkv-peft", "stateful-language-model"],
)
def test_stateful_models_without_layer_types_are_refused_before_any_forward(name, wrap, refused, tmp_path):
    """A model that keeps a recurrent state and names no layer types (RWKV: ``medusa_generate`` returned
    other tokens than ``generate``; xLSTM crashed in every decoder), also under a PEFT wrapper, or whose
    language model alone is marked: every decoder, and ``generate`` of an export's ``custom_generate``
    before it looks for the export, refuses it in one line naming the model (transformers'
    ``_is_stateful``), before any forward."""
    model = build(STATEFUL[name]() if name in STATEFUL else tiny_config(name))
    assert unserved_layer_types(model.config) == []
    heads = random_heads(model, seed=1)
    model = wrap(model) if wrap else model
    match = rf"^{refused} \(\w+\) keeps a recurrent state"
    for message in refusals_before_any_forward(model, heads, tmp_path, match):
        assert "cannot verify trees on it (decode it with model.generate)" in message


SEQ2SEQ_DECODER = dict(
    d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
    encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB, max_position_embeddings=MAX_POS, bos_token_id=0,
    eos_token_id=None, pad_token_id=0, decoder_start_token_id=0,
)  # fmt: skip
POSITIONLESS = {  # neither the forward nor its decoder's names position_ids: positions from cache columns
    # learned positions (Bart), sinusoidal ones (Marian, TrOCR), each offset by the cache's length
    "bart": lambda: tf.BartConfig(**SEQ2SEQ_DECODER),
    "marian": lambda: tf.MarianConfig(**SEQ2SEQ_DECODER),
    "trocr": lambda: tf.TrOCRConfig(
        vocab_size=VOCAB, d_model=32, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64,
        max_position_embeddings=MAX_POS, bos_token_id=0, eos_token_id=None, pad_token_id=0,
    ),
    "prophetnet": lambda: tf.ProphetNetConfig(
        vocab_size=VOCAB, hidden_size=32, num_encoder_layers=2, num_decoder_layers=2, num_encoder_attention_heads=4,
        num_decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=MAX_POS,
        ngram=2, pad_token_id=0, bos_token_id=0, eos_token_id=None,
    ),
    # rotary positions counted from the cache's length
    "roformer": lambda: tf.RoFormerConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=MAX_POS, is_decoder=True, pad_token_id=0, eos_token_id=None,
        initializer_range=0.2,
    ),
    # relative position buckets from the cache's length (CpmAnt), relative attention over memories (XLNet)
    "cpmant": lambda: tf.CpmAntConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, dim_head=8, dim_ff=64,
        prompt_length=2, position_bias_max_distance=MAX_POS,
    ),
    "xlnet": lambda: tf.XLNetConfig(vocab_size=VOCAB, d_model=32, n_layer=2, n_head=4, d_inner=64, pad_token_id=0),
}  # fmt: skip


def test_models_that_take_no_kv_cache_are_refused_before_any_forward(tmp_path):
    """GPT-1's forward (and its decoder's) names no KV cache, ``cache`` or ``past_key_values``: it
    recomputes every position at each call (it crashed in every decoder on the tree's 4-D mask): every
    decoder, and ``generate`` of an export's ``custom_generate``, refuses it in one line, before any
    forward."""
    model = build(tf.OpenAIGPTConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=MAX_POS))
    heads = random_heads(model, seed=1)
    match = r"^OpenAIGPTLMHeadModel \(openai-gpt\) takes no KV cache .*model\.generate\)$"
    refusals_before_any_forward(model, heads, tmp_path, match)


def _bart_peft_wrapped(model: torch.nn.Module) -> torch.nn.Module:
    """Bart's ForCausalLM under LoRA on its query projections (a Medusa-2 backbone): PEFT's forward names
    no position_ids for any model."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))


@pytest.mark.parametrize(
    ("name", "wrap"),
    [*((name, None) for name in POSITIONLESS), ("bart", _bart_peft_wrapped)],
    ids=[*POSITIONLESS, "bart-peft"],
)
def test_models_that_take_no_position_ids_are_refused_before_any_forward(name, wrap, tmp_path):
    """A model whose forward, and its decoder's, name no ``position_ids`` drops the positions a tree's
    nodes are given (its logits do not move with them) and places the nodes by their cache columns:
    every decoder, and ``generate`` of an export's ``custom_generate`` before it looks for the export,
    refuses it in one line naming the model, before any forward; also under a PEFT wrapper."""
    config = POSITIONLESS[name]()
    model = build(config)
    prompt = torch.tensor([3, 5, 7])
    with torch.no_grad():
        shifted = model(prompt[None], position_ids=torch.arange(3)[None] + 7).logits
        assert torch.equal(shifted, model(prompt[None]).logits)
    heads = random_heads(model, seed=1)
    refused = type(model).__name__
    model = wrap(model) if wrap else model
    match = rf"^{refused} \({config.model_type}\) takes no position_ids"
    for message in refusals_before_any_forward(model, heads, tmp_path, match):
        assert "cannot verify trees on it (decode it with model.generate)" in message


@pytest.mark.parametrize("name", ["marian", "roformer"])
def test_models_that_take_no_position_ids_decode_other_tokens_unrefused(name, monkeypatch):
    """Why they are refused: let through, with heads that know the continuation (a path not contiguous
    in node order), the batched decoder returns other tokens than ``generate``."""
    monkeypatch.setattr(attention_support, "positionless_model", lambda model: None)
    model = build(POSITIONLESS[name]())
    rows = prompts()
    refs = [plain_greedy(model, p, NEW_TOKENS + 6) for p in rows]
    sequences = [torch.cat([p, torch.tensor(r)]) for p, r in zip(rows, refs, strict=True)]
    branching = [[0], [1], [0, 0], [1, 0], [1, 0, 0], [1, 0, 0, 0]]
    heads = RowsOracle(model, sequences, rank=1)
    out = medusa_generate_batch(model, heads, rows, max_new_tokens=NEW_TOKENS, tree=branching)
    assert [r.tokens.tolist() for r in out.rows] != [r[:NEW_TOKENS] for r in refs]


def tiny_whisper_config() -> tf.WhisperConfig:
    """A tiny Whisper, whose ``AutoModelForCausalLM`` is WhisperForCausalLM (its decoder alone)."""
    return tf.WhisperConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_target_positions=MAX_POS,
        max_source_positions=16, num_mel_bins=8, pad_token_id=0, bos_token_id=0, eos_token_id=None,
        decoder_start_token_id=0, begin_suppress_tokens=None, suppress_tokens=None,
    )  # fmt: skip


def test_whisper_causal_lm_is_served_its_decoder_takes_the_positions():
    """WhisperForCausalLM's forward names no ``position_ids`` but hands them to its decoder, whose
    forward does (its learned positions follow them): served, and with heads that know the continuation
    (a path not contiguous in node order) every decoder accepts whole paths and equals ``generate``."""
    model = build(tiny_whisper_config())
    assert isinstance(model, tf.WhisperForCausalLM)
    assert "position_ids" not in inspect.signature(model.forward).parameters
    rows = prompts()
    refs = [plain_greedy(model, p, NEW_TOKENS + 6) for p in rows]
    sequences = [torch.cat([p, torch.tensor(r)]) for p, r in zip(rows, refs, strict=True)]
    branching = [[0], [1], [0, 0], [1, 0], [1, 0, 0], [1, 0, 0, 0]]
    heads = RowsOracle(model, sequences, rank=1)
    expected = [r[:NEW_TOKENS] for r in refs]
    for prompt, sequence, ref in zip(rows, sequences, expected, strict=True):
        one = OracleHeads(model, sequence[None], rank=1)
        out = medusa_generate(model, one, prompt[None], max_new_tokens=NEW_TOKENS, tree=branching)
        assert out.tokens.tolist() == ref and out.accepted_lengths[:4] == [5] * 4
    batch = medusa_generate_batch(model, heads, rows, max_new_tokens=NEW_TOKENS, tree=branching)
    static = StaticDecoder(model, heads, branching, 2 * MAX_POS, batch_size=3).generate_batch(
        rows, max_new_tokens=NEW_TOKENS
    )
    for out in (batch, static):
        assert [r.tokens.tolist() for r in out.rows] == expected
        assert all(r.accepted_lengths[:4] == [5] * 4 for r in out.rows)


BERT_SHAPE = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
    max_position_embeddings=MAX_POS, bos_token_id=0, eos_token_id=None, pad_token_id=0, initializer_range=1.0,
)  # fmt: skip
BOTH_WAYS = {  # the BERT family's causal LMs: a causal or a bidirectional mask by config.is_decoder
    "bert": lambda **kw: tf.BertConfig(**{**BERT_SHAPE, **kw}),
    "roberta": lambda **kw: tf.RobertaConfig(**{**BERT_SHAPE, **kw}),
    "megatron-bert": lambda **kw: tf.MegatronBertConfig(
        **{**BERT_SHAPE, **kw}
    ),  # no is_causal on its modules
}


def earlier_logits_move_with_the_last_token(model) -> bool:
    """Whether ``model``'s logits at positions 0..T-2 of a prompt change when its last token does."""
    ids = prompts()[1][None]  # (1, 11)
    other = ids.clone()
    other[0, -1] = (ids[0, -1] + 1) % VOCAB
    with torch.no_grad():
        return not torch.allclose(model(ids).logits[:, :-1], model(other).logits[:, :-1])


@pytest.mark.parametrize("name", list(BOTH_WAYS))
def test_models_that_attend_both_ways_are_refused_before_any_forward(name, tmp_path):
    """The BERT family's causal LMs loaded with ``is_decoder=False`` (every config's default) attend both
    ways (each token's logits move with the tokens after it): every decoder, and ``generate`` of an
    export's ``custom_generate``, refuses them in one line saying to load them with
    ``is_decoder=True``, before any forward."""
    config = BOTH_WAYS[name](is_decoder=False)
    model = build(config)
    assert earlier_logits_move_with_the_last_token(model)
    heads = random_heads(model, seed=1)
    match = rf"^{type(model).__name__} \({config.model_type}\) attends both ways \(config.is_decoder=False"
    for message in refusals_before_any_forward(model, heads, tmp_path, match):
        assert message.endswith(
            "load it with is_decoder=True (from_pretrained(..., is_decoder=True), or in its "
            "config.json) to make it a causal decoder"
        )


@pytest.mark.parametrize("name", ["bert", "roberta"])
def test_models_that_attend_both_ways_decode_other_tokens_unrefused(name, monkeypatch):
    """Why they are refused: let through, the batched and static decoders return other tokens than
    ``generate`` (which recomputes every position at each step: such a model takes no cache)."""
    monkeypatch.setattr(attention_support, "attends_both_ways", lambda model: False)
    model = build(BOTH_WAYS[name](is_decoder=False))
    rows = prompts()
    refs = [plain_greedy(model, p) for p in rows]
    heads = random_heads(model, seed=1)
    batch = medusa_generate_batch(model, heads, rows, max_new_tokens=NEW_TOKENS, tree=TREES["random8"])
    static = StaticDecoder(model, heads, TREES["random8"], 2 * MAX_POS, batch_size=3)
    assert [r.tokens.tolist() for r in batch.rows] != refs
    assert [r.tokens.tolist() for r in static.generate_batch(rows, max_new_tokens=NEW_TOKENS).rows] != refs


@pytest.mark.parametrize("name", list(BOTH_WAYS))
def test_models_that_attend_both_ways_are_served_with_is_decoder(name):
    """The same models loaded with ``is_decoder=True`` attend one way and are served: the three decoders
    equal plain greedy ``generate``, with a static capacity five times the model's 24 positions (their
    position tables and token-type buffers end there) and rows that reach them."""
    model = build(BOTH_WAYS[name](is_decoder=True, max_position_embeddings=24))
    if _both_ways_here(name):
        pytest.skip(f"transformers {tf.__version__}'s {name} attends both ways with is_decoder=True: refused")
    assert tree_refusal(model) is None and not earlier_logits_move_with_the_last_token(model)
    rows = prompts()
    refs = [plain_greedy(model, p, min(NEW_TOKENS, 24 - len(p))) for p in rows]
    assert [len(r) for r in refs] == [19, 13, 20]  # two rows stop at the model's last position
    assert_decoders_return(model, random_heads(model, seed=1), rows, refs, name)


def _both_ways_here(kind: str) -> bool:
    """Whether the installed transformers builds ``kind``'s causal LM bidirectional whatever
    ``is_decoder`` says (5.17's MegatronBERT, RemBERT and BigBird: refused)."""
    return kind in WRONG_IN_517 and not WRONG_IN_517[kind][1] and tf.__version__.startswith("5.17.")


def one_token_forwards_move_their_positions(model) -> bool:
    """Whether a one-token forward after a prompt in the cache gives other logits than the same token at
    the end of the whole sequence's forward, given the same positions (5.17's GIT adds the cache's
    length to them)."""
    ids = prompts()[1][None]  # (1, 11)
    t, cache = ids.shape[1], DynamicCache()

    def forward(cols: slice, **kw) -> torch.Tensor:
        positions = torch.arange(t)[None, cols]
        mask = torch.ones(1, positions[0, -1] + 1, dtype=torch.long)  # as generate passes it
        return model(ids[:, cols], position_ids=positions, attention_mask=mask, use_cache=True, **kw).logits

    with torch.no_grad():
        whole = forward(slice(0, t))[:, -1]
        forward(slice(0, t - 1), **cache_kwargs(model, cache))
        last = forward(slice(t - 1, t), **cache_kwargs(model, cache))[:, -1]
    return not torch.allclose(last, whole, atol=1e-5)


_WRONG_IN_517_BUILT = {  # tiny configs of the causal LMs 5.17 computes otherwise, and a right one
    "megatron-bert": lambda **kw: BOTH_WAYS["megatron-bert"](is_decoder=True, **kw),
    "rembert": lambda **kw: tiny_config("rembert", **kw),
    "big_bird": lambda **kw: tf.BigBirdConfig(**{**BERT_SHAPE, "is_decoder": True, **kw}),
    "doge": doge_config,
    "git": lambda **kw: tf.GitConfig(
        **{
            **BERT_SHAPE,
            "vision_config": {
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
            },
            **kw,
        }
    ),
    "bert": lambda **kw: BOTH_WAYS["bert"](is_decoder=True, **kw),
}


@pytest.mark.parametrize(
    ("kind", "implementation"), [*((k, None) for k in _WRONG_IN_517_BUILT), ("doge", "eager")]
)
def test_models_transformers_5_17_computes_otherwise_are_refused_there(kind, implementation, monkeypatch):
    """transformers 5.17's MegatronBERT, RemBERT and BigBird causal LMs attend both ways with
    ``is_decoder=True`` too, and Doge with SDPA (its forward skips the causal mask it adds its dynamic one
    to; eager builds it): their earlier logits move with the last token; GIT moves a one-token forward's
    positions by its cache's length (all fixed in 5.18). Refused there in one line saying to upgrade
    (Doge: or to load it eager), before any forward; BERT, right there, is served, and so is Doge loaded
    eager; on the installed transformers each is refused exactly where it computes otherwise."""
    config = _WRONG_IN_517_BUILT[kind]()
    if implementation is not None:
        config._attn_implementation = implementation
    model = build(config)
    wrong = (
        one_token_forwards_move_their_positions if kind == "git" else earlier_logits_move_with_the_last_token
    )
    assert (tree_refusal(model) is not None) == wrong(model)
    # the transformers the refusal reads (patched there: the suite's other tests may leave another in tf)
    monkeypatch.setattr(tree_refusal.__globals__["transformers"], "__version__", "5.17.0")
    says = tree_refusal(model)
    if kind == "bert" or implementation == "eager":
        assert says is None
        return
    assert says is not None and "\n" not in says
    assert ", fixed in transformers 5.18, so the Medusa tree decoders cannot verify trees on it" in says
    if kind == "doge":
        assert "of transformers 5.17.0 attends both ways with attn_implementation='sdpa'" in says
        assert says.endswith(
            """pip install 'transformers>=5.18') or load it with attn_implementation="eager\""""
        )
        return
    assert says.endswith("upgrade transformers (pip install 'transformers>=5.18')")
    if kind == "git":
        assert (
            "of transformers 5.17.0 adds its cache's length to the positions of a one-token forward" in says
        )
    else:
        assert "of transformers 5.17.0 attends both ways even with is_decoder=True" in says


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_kernels_refuse_a_model_whose_decoder_layers_compute_their_attention_themselves():
    """GIT's text layers compute their attention themselves (its vision encoder's, in the same Python
    module, call transformers' attention functions): under the kernel's implementation they would get
    no mask and attend the tree whole. The kernels are refused for it in one line before any forward
    (on transformers 5.17 every decoder refuses GIT first, for its positions); a Llama's layers call
    the attention functions."""
    model = build(_WRONG_IN_517_BUILT["git"]())
    assert layers_dispatch(model) is False and hasattr(
        sys.modules[type(model).__module__], "ALL_ATTENTION_FUNCTIONS"
    )
    assert "GitForCausalLM computes its attention itself" in kernel_refusal(model)
    assert layers_dispatch(build(tiny_config("llama"))) is True
    if tree_refusal(model) is None:
        calls = count_forwards(model)
        with pytest.raises(
            AttentionBackendError, match="attention=triton cannot run here: .*computes its attention itself"
        ):
            StaticDecoder(model, random_heads(model), chain_tree(2), 32, attention="triton")
        assert not calls
        assert resolve_attention("auto", torch.device("cuda"), context=10**6, model=model) == "sdpa"


@pytest.mark.parametrize("arch", ["electra", "rembert"])
def test_models_whose_lm_head_reads_a_prediction_heads_output_of_another_width_are_served(arch):
    """ELECTRA's and RemBERT's causal LMs (``is_decoder=True``) map the decoder's last hidden state
    through a prediction head to half its width before their LM head: the heads read that last hidden
    state (32 wide, not 16), and the three decoders, with random heads of its width and with heads that
    know each row's continuation, return ``generate``'s tokens (the static decoder sized its rows'
    states by what the LM head reads, and failed)."""
    if _both_ways_here(arch):
        pytest.skip(f"transformers {tf.__version__}'s {arch} attends both ways with is_decoder=True: refused")
    model = build(tiny_config(arch, initializer_range=0.2))
    assert tree_refusal(model) is None
    assert model.get_output_embeddings().weight.shape[1] == 16 and hidden_width(model) == 32
    rows = prompts()
    refs = [plain_greedy(model, p) for p in rows]
    assert_decoders_return(model, random_heads(model, seed=1), rows, refs, arch)
    assert_every_decoder_reads_what_lm_head_reads(model)


@pytest.mark.parametrize(
    "build_model",
    [
        lambda: build(tiny_config("llama")),
        lambda: build(tf.GPTNeoXConfig(**BERT_SHAPE)),  # mentions config.is_decoder in a docstring only
        lambda: build(tiny_whisper_config()),
    ],
    ids=["llama", "gpt-neox", "whisper"],
)
def test_is_decoder_false_is_served_where_the_code_never_reads_it(build_model):
    """Models whose code never reads ``is_decoder`` attend one way whatever their config says (or where it
    has none) and are served: Llama, GPT-NeoX (whose config has it, False, and whose source names
    ``config.is_decoder`` in a docstring's example) and WhisperForCausalLM (cross-attention modules
    marked ``is_causal=False``)."""
    model = build_model()
    assert not getattr(model.config.get_text_config(), "is_decoder", False)
    assert not attends_both_ways(model) and tree_refusal(model) is None
    assert not earlier_logits_move_with_the_last_token(model)


XLM_SHAPE = dict(vocab_size=VOCAB, emb_dim=32, n_layers=2, n_heads=4, max_position_embeddings=MAX_POS)


@pytest.mark.parametrize(
    ("config", "model_class", "causal"),
    [
        (tf.XLMConfig, tf.XLMWithLMHeadModel, False),
        (tf.XLMConfig, tf.XLMWithLMHeadModel, True),
        (tf.FlaubertConfig, tf.FlaubertWithLMHeadModel, False),
    ],
    ids=["xlm", "xlm-causal", "flaubert"],
)
def test_models_that_build_their_masks_themselves_are_refused_before_any_forward(
    config, model_class, causal, tmp_path
):
    """XLM (and Flaubert, its code) builds its masks from its tokens' lengths or a 2-D padding mask (each
    decoder failed on the tree's 4-D mask with an AssertionError), and attends both ways unless
    ``config.causal``: every decoder, and ``custom_generate``'s ``generate``, refuses it in one line
    saying so, before any forward."""
    config = config(**XLM_SHAPE, causal=causal)
    torch.manual_seed(0)
    model = model_class(config).eval()
    assert earlier_logits_move_with_the_last_token(model) is not causal
    heads = random_heads(model, seed=1)
    match = rf"^{type(model).__name__} \({config.model_type}\) builds its attention masks itself"
    for message in refusals_before_any_forward(model, heads, tmp_path, match):
        assert ("attends both ways (config.causal=False)" in message) is not causal


def assert_every_decoder_reads_what_lm_head_reads(model: torch.nn.Module) -> None:
    """Heads that know the continuation of three rows, keyed by the last hidden state every decoder hands
    them (:class:`RowsOracle`: what ``model``'s LM head reads, but for a scaling or a prediction head), get
    whole paths accepted at the first four steps of ``medusa_generate``, ``medusa_generate_batch`` and
    the static decoder (past the window), whose tokens are ``generate``'s."""
    rows = prompts()
    refs = [plain_greedy(model, p, NEW_TOKENS + 6) for p in rows]
    oracle = RowsOracle(model, [torch.cat([p, torch.tensor(r)]) for p, r in zip(rows, refs, strict=True)])
    refs = [r[:NEW_TOKENS] for r in refs]
    tree = chain_tree(4)
    one = [medusa_generate(model, oracle, p[None], max_new_tokens=NEW_TOKENS, tree=tree) for p in rows]
    batch = medusa_generate_batch(model, oracle, rows, max_new_tokens=NEW_TOKENS, tree=tree).rows
    static = StaticDecoder(model, oracle, tree, 2 * MAX_POS, batch_size=3)
    for outs in (one, batch, static.generate_batch(rows, max_new_tokens=NEW_TOKENS).rows):
        assert [o.tokens.tolist() for o in outs] == refs
        assert all(o.accepted_lengths[:4] == [5] * 4 for o in outs)


def test_gemma3n_heads_read_what_its_lm_head_reads():
    """Gemma 3n's ``hidden_states[-1]`` is its AltUp streams stacked, ``(altup_num_inputs, B, T, d)``
    (every decoder crashed in the heads reading it); its LM head reads its ``last_hidden_state``, which
    training reads: every decoder hands the heads those."""
    model = build(gemma3n())
    assert tree_refusal(model) is None
    ids = torch.tensor([[3, 5, 7]])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        states = last_hidden_state(model, ids, torch.ones_like(ids))  # (1, 3, d)
    assert out.hidden_states[-1].shape == (2, 1, 3, 32)  # the streams, not (B, T, d)
    cap = model.config.final_logit_softcapping
    torch.testing.assert_close(torch.tanh(model.lm_head(states) / cap) * cap, out.logits)
    assert_every_decoder_reads_what_lm_head_reads(model)


class _TextOnlyTowers:
    """``AutoModel`` for Gemma 3n's multimodal model with its vision tower (a timm MobileNet, which
    needs timm, and which text never reaches) an empty module."""

    @staticmethod
    def from_config(config, **kwargs) -> torch.nn.Module:
        if isinstance(config, tf.Gemma3nVisionConfig):
            return torch.nn.Module()
        return tf.AutoModel.from_config(config, **kwargs)


def test_gemma3n_multimodal_heads_read_what_its_lm_head_reads(monkeypatch):
    """Gemma 3n's checkpoints load as ``Gemma3nForConditionalGeneration`` (its text model the language
    model of its multimodal one, ``get_decoder()``): on text, heads that know the continuation, keyed by
    what its LM head reads (training's ``last_hidden_state`` too), get whole paths accepted at every
    step of ``medusa_generate``, ``medusa_generate_batch`` and the static decoder (three rows past the
    window), whose tokens are ``generate``'s."""
    monkeypatch.setattr(tf.models.gemma3n.modeling_gemma3n, "AutoModel", _TextOnlyTowers)
    audio = dict(hidden_size=16, conf_num_attention_heads=2, conf_num_hidden_layers=1, vocab_size=8)
    config = tf.Gemma3nConfig(
        text_config=gemma3n().to_dict(), audio_config={**audio, "sscp_conv_channel_size": [4, 4]},
        vision_config=dict(hidden_size=16, vocab_size=8),
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.Gemma3nForConditionalGeneration(config).eval()
    ids = prompts()[0][None]
    with torch.no_grad():
        torch.testing.assert_close(
            last_hidden_state(model, ids, torch.ones_like(ids))[0], lm_head_inputs(model, ids[0])
        )
    assert_every_decoder_reads_what_lm_head_reads(model)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_gemma3n_decodes_with_the_kernel():
    """Gemma 3n with the Triton kernel (CPU: its interpreter): heads that know the continuation get
    whole paths accepted in the static decoder's two rows (one prompt past the window, the other
    passing it) and in ``medusa_generate_batch``'s, whose tokens equal ``generate``'s; so do
    ``medusa_generate``'s with random heads."""
    model = build(gemma3n())
    rows = prompts()[:2]
    refs = [plain_greedy(model, p, 14) for p in rows]
    oracle = RowsOracle(model, [torch.cat([p, torch.tensor(r)]) for p, r in zip(rows, refs, strict=True)])
    refs = [r[:8] for r in refs]
    decoder = StaticDecoder(model, oracle, chain_tree(4), 24, batch_size=2, attention="triton")
    batch = medusa_generate_batch(
        model, oracle, rows, max_new_tokens=8, tree=chain_tree(4), attention="triton"
    )
    for outs in (decoder.generate_batch(rows, max_new_tokens=8).rows, batch.rows):
        assert [o.tokens.tolist() for o in outs] == refs
        assert all(o.accepted_lengths == [5, 3] for o in outs)
    heads = random_heads(model, seed=1)
    out = medusa_generate(
        model, heads, rows[1][None], max_new_tokens=4, tree=TREES["random8"], attention="triton"
    )
    assert out.tokens.tolist() == refs[1][:4]


@pytest.mark.slow
def test_static_compiled_gemma3n():
    """The step under torch.compile (inductor, default mode) on Gemma 3n: the hook that ties its
    ``hidden_states[-1]`` to its ``last_hidden_state`` is traced into one graph, no break, and a second
    call, hooked again, compiles nothing more; heads that know the continuation get whole paths
    accepted and three rows of different lengths equal ``generate`` (about 2 min on 2 cores)."""
    import torch._dynamo.utils

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = build(gemma3n())
    rows = prompts()
    refs = [plain_greedy(model, p, NEW_TOKENS + 6) for p in rows]
    oracle = RowsOracle(model, [torch.cat([p, torch.tensor(r)]) for p, r in zip(rows, refs, strict=True)])
    decoder = StaticDecoder(model, oracle, chain_tree(4), 2 * MAX_POS, batch_size=3, capture="compile")
    for _ in range(2):
        out = decoder.generate_batch(rows, max_new_tokens=NEW_TOKENS)
        assert [r.tokens.tolist() for r in out.rows] == [r[:NEW_TOKENS] for r in refs]
        assert all(r.accepted_lengths[:4] == [5] * 4 for r in out.rows)
    counters = torch._dynamo.utils.counters
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1, dict(counters)


PER_LAYER = {  # a window or a chunk set per layer (transformers' per_layer_config): layers differ in it
    "mistral": lambda: tf.MistralConfig(
        **SHAPE, sliding_window=6, per_layer_config={1: {"sliding_window": 4}}
    ),
    "llama4": lambda: llama4(per_layer_config={0: {"attention_chunk_size": 4}}),
}
PER_LAYER_ATTRIBUTE = {"mistral": "sliding_window", "llama4": "attention_chunk_size"}


@pytest.mark.parametrize("name", list(PER_LAYER))
def test_models_with_a_window_or_chunk_per_layer_are_refused_before_any_forward(name, tmp_path):
    """A config that sets the window or the chunk per layer, which reading it off the whole config raises
    (``AmbiguousGlobalPerLayerAttributeError``, not an AttributeError: the static decoder raised it from
    inside), while the decoders' masks give every layer of a type one: every decoder, and
    ``custom_generate``'s ``generate``, refuses the model in one line naming the attribute, before any
    forward."""
    model = build(PER_LAYER[name]())
    assert per_layer_attributes(model.config) == [PER_LAYER_ATTRIBUTE[name]]
    heads = random_heads(model, seed=1)
    match = rf"sets {PER_LAYER_ATTRIBUTE[name]} per layer \(config.per_layer_config\)"
    for message in refusals_before_any_forward(model, heads, tmp_path, match):
        assert "set it once for the whole model" in message


def test_gemma4_head_dim_per_layer_is_served():
    """Gemma 4 sets its full layers' head_dim per layer: the decoders serve it (greedy parity past the
    window: ``MODELS``), and the kernels' check reads each layer's head widths instead of raising on
    ``config.head_dim``."""
    model = build(gemma4())
    assert per_layer_attributes(model.config) == ["head_dim"]
    assert kernel_refusal(model) is None


def test_gemma4_kv_shared_layers_keep_no_kv():
    """Gemma 4's last two layers read the KV of layers 0 and 1: the batched and static decoders' caches
    keep none for them (``NoKVLayer``: transformers' ``DummyLayer``), and moving entries or rows moves the
    others' (greedy parity past the window: ``MODELS``): a row leaving the batch at its EOS moves the
    other rows down, whose tokens stay ``generate``'s."""
    model = build(gemma4(num_kv_shared_layers=2))
    assert kv_reusing_layers(model) == {2, 3}
    heads = random_heads(model, seed=1)
    decoder = StaticDecoder(model, heads, chain_tree(2), 32)
    assert [type(layer) for layer in decoder.cache.layers] == [static_module._StaticLayer] * 2 + [
        NoKVLayer
    ] * 2
    assert decoder.cache.kv_layers == decoder.cache.layers[:2]
    rows = prompts()
    full = [plain_greedy(model, p) for p in rows]
    eos = next(t for t in full[0][2:] if all(t not in r for r in full[1:]))  # row 0's alone
    refs = [full[0][: full[0].index(eos) + 1], *full[1:]]
    out = medusa_generate_batch(
        model, heads, rows, max_new_tokens=NEW_TOKENS, tree=TREES["random8"], eos_token_id=eos
    )
    assert [r.tokens.tolist() for r in out.rows] == refs


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_gemma4_decodes_with_the_kernel():
    """Gemma 4 (head_dim 8 on its sliding layers, 16 on its full ones) with the Triton kernel (CPU: its
    interpreter): the static decoder's two rows and ``medusa_generate`` past the window equal
    ``generate``."""
    model = build(gemma4())
    heads = random_heads(model, seed=1)
    rows = prompts()[:2]
    refs = [plain_greedy(model, p, 10) for p in rows]
    decoder = StaticDecoder(model, heads, TREES["random8"], 32, batch_size=2, attention="triton")
    assert [r.tokens.tolist() for r in decoder.generate_batch(rows, max_new_tokens=10).rows] == refs
    out = medusa_generate(
        model, heads, rows[1][None], max_new_tokens=10, tree=TREES["random8"], attention="triton"
    )
    assert out.tokens.tolist() == refs[1]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_gemma4_kv_shared_layers_decode_with_the_kernel():
    """Gemma 4 with its last two layers reading the first two's KV, with the Triton kernel (CPU: its
    interpreter): the static decoder's and ``medusa_generate_batch``'s two rows (one prompt past the
    window, the other passing it) equal ``generate``; the shared layers' calls get the KV their source
    layers wrote, windowed by their own layer type."""
    model = build(gemma4(num_kv_shared_layers=2))
    heads = random_heads(model, seed=1)
    rows = prompts()[:2]
    refs = [plain_greedy(model, p, 4) for p in rows]
    decoder = StaticDecoder(model, heads, TREES["chain4"], 24, batch_size=2, attention="triton")
    assert [r.tokens.tolist() for r in decoder.generate_batch(rows, max_new_tokens=4).rows] == refs
    batch = medusa_generate_batch(
        model, heads, rows, max_new_tokens=4, tree=TREES["chain4"], attention="triton"
    )
    assert [r.tokens.tolist() for r in batch.rows] == refs


@pytest.mark.parametrize("name", LATENT_MODELS)
def test_latent_attention_keeps_values_at_their_width(name):
    """Multi-head latent attention caches one head of keys 16 wide and values 8 (``LATENT``; greedy parity
    of the three decoders and oracle heads: ``MODELS``): the static decoder's cache holds each layer's
    at their own widths (in tensors of their own: no storage shared by keys and values), a row leaving
    the batched decoder at its EOS moves the other rows' keys and values down, whose tokens stay
    ``generate``'s; the CUDA kernel refuses the attention's values, 12 wide, narrower than its keys, 24
    (the Triton kernel computes them, and ``auto`` takes it); the calibration's latency measurement runs
    on it, and the hidden states the heads train on are the model's own."""
    model = build(MODELS[name]())
    heads = random_heads(model, seed=1)
    rows = prompts()
    decoder = StaticDecoder(model, heads, chain_tree(2), 40, batch_size=3)
    decoder.generate_batch(rows, max_new_tokens=2)
    widths = {(layer.keys.shape, layer.values.shape) for layer in decoder.cache.kv_layers}
    assert widths == {((3, 1, 40, 16), (3, 1, 40, 8))} and decoder.cache.storage is None
    full = [plain_greedy(model, p) for p in rows]
    eos = next(t for t in full[0][2:] if all(t not in r for r in full[1:]))  # row 0's alone
    refs = [full[0][: full[0].index(eos) + 1], *full[1:]]
    out = medusa_generate_batch(
        model, heads, rows, max_new_tokens=NEW_TOKENS, tree=TREES["random8"], eos_token_id=eos
    )
    assert [r.tokens.tolist() for r in out.rows] == refs and len(refs[0]) < NEW_TOKENS
    assert "value heads (12)" in kernel_refusal(model, "cuda") and kernel_refusal(model, "triton") is None
    if importlib.util.find_spec("triton") is not None:
        assert resolve_attention("auto", torch.device("cuda"), context=10**6, model=model) == "triton"
    assert set(measure_forward_latency(model, [4], context_len=8, warmup=0, repeats=1)) == {1, 4}
    ids = torch.tensor([[3, 5, 7, 9], [0, 0, 4, 6]])
    mask = (ids != 0).long()
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
        torch.testing.assert_close(last_hidden_state(model, ids, mask), expected)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("name", LATENT_MODELS)
def test_latent_attention_through_the_triton_kernel(name):
    """The Triton kernel on values narrower than the keys (12 against 24): the three decoders (ragged
    rows in the batched and static decoders, the one-row decoder on the longest) return ``generate``'s
    tokens, and the static decoder with heads that know the continuation accepts whole paths (every
    node's output decides a token)."""
    model = build(MODELS[name]())
    heads = random_heads(model, seed=1)
    rows = prompts()
    refs = [plain_greedy(model, p, 8) for p in rows]
    tree = TREES["random8"]
    longest = max(range(len(rows)), key=lambda i: len(rows[i]))
    out = medusa_generate(model, heads, rows[longest][None], max_new_tokens=8, tree=tree, attention="triton")
    assert out.tokens.tolist() == refs[longest]
    batch = medusa_generate_batch(model, heads, rows, max_new_tokens=8, tree=tree, attention="triton")
    assert [r.tokens.tolist() for r in batch.rows] == refs
    longer = [plain_greedy(model, p, 14) for p in rows]
    oracle = RowsOracle(model, [torch.cat([p, torch.tensor(r)]) for p, r in zip(rows, longer, strict=True)])
    static = StaticDecoder(model, oracle, chain_tree(4), 32, batch_size=3, attention="triton")
    out = static.generate_batch(rows, max_new_tokens=8)
    assert [r.tokens.tolist() for r in out.rows] == [r[:8] for r in longer]
    assert all(r.accepted_lengths[0] == 5 for r in out.rows)


def test_the_architectures_the_decoders_serve_are_not_refused():
    """Every architecture the decoder tests run, each layer type among full, sliding-window and chunked
    attention or no ``layer_types`` at all, has no layer type the decoders refuse."""
    configs = [make() for make in MODELS.values()] + [tiny_config(arch) for arch in ARCHS]
    configs += [
        llama4(no_rope_layers=(1, 1)),
        llama4(chunk=None),
        tiny_config("qwen2", layer_types=INTERLEAVED),
    ]
    assert any(getattr(c.get_text_config(), "layer_types", None) is None for c in configs)
    for config in configs:
        assert unserved_layer_types(config) == [], config.model_type


def test_llama4_query_scaling_by_cache_length_is_refused(monkeypatch):
    """Llama 4's NoPE layers scale their queries by positions counted from the cache's length; from
    ``floor_scale - 1`` on that scale is not 1, and a tree node's index, the batched decoder's cache
    width or the static decoder's capacity is not the position: each decoder refuses a call that could
    get there (floor_scale 4) before any forward; the static decoder would decode it wrongly. A chain's
    node indices are its depths: ``medusa_generate`` decodes it as ``generate`` does."""
    # A chunk no position reaches: its RoPE layer attends as a full one (transformers 5.17 runs no Llama 4
    # without attention_chunk_size).
    model = build(llama4(chunk=4 * MAX_POS, floor_scale=4, attn_scale=1.0, initializer_range=0.3))
    heads = random_heads(model, seed=1)
    calls = count_forwards(model)
    rows = prompts()
    decoders = [
        lambda: medusa_generate(model, heads, rows[0][None], max_new_tokens=8, tree=TREES["random8"]),
        lambda: medusa_generate_batch(model, heads, rows, max_new_tokens=8, tree=chain_tree(4)),
        lambda: StaticDecoder(model, heads, chain_tree(4), 48),
    ]
    for decode in decoders:
        with pytest.raises(
            AttentionBackendError, match=r"attn_temperature_tuning.*position 3 \(floor_scale - 1\)"
        ):
            decode()
    assert not calls
    for p in rows:
        out = medusa_generate(model, heads, p[None], max_new_tokens=NEW_TOKENS, tree=chain_tree(4))
        assert out.tokens.tolist() == plain_greedy(model, p)
    # Sanity: the scaling matters for this model (the static decoder unchecked diverges from generate).
    monkeypatch.setattr(static_module, "check_cache_positions", lambda *_: None)
    decoder = StaticDecoder(model, heads, chain_tree(4), 48)
    outs = [decoder.generate(p[None], max_new_tokens=NEW_TOKENS).tokens.tolist() for p in rows]
    assert outs != [plain_greedy(model, p) for p in rows]


def test_the_context_limit_of_a_multimodal_model_is_its_text_configs():
    """Gemma 3 from 4B on loads as Gemma3ForConditionalGeneration, its positions in the text config: the
    decoders stop each row there as for the text model."""
    from medusa_train.decoding.generate import context_limit

    model = build(gemma3_multimodal())
    assert context_limit(model) == model.config.get_text_config().max_position_embeddings


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("attention", ["sdpa", "triton"])
def test_gpu_captured_step_on_mixed_layers(attention):
    """The CUDA-graph step on Gemma 3's sliding and full layers (fp32), one mask per layer type or the
    kernel with each layer type's bits: three rows of different lengths, and a second call replaying
    the same graph, each equal their plain greedy."""
    model = build(MODELS["gemma3"]()).cuda()
    rows = [p.cuda() for p in prompts()]
    refs = [plain_greedy(model, p) for p in rows]
    decoder = StaticDecoder(
        model, random_heads(model, seed=1).cuda(), TREES["random8"], 2 * MAX_POS, batch_size=3,
        capture="cuda_graph", attention=attention,
    )  # fmt: skip
    for _ in range(2):
        out = decoder.generate_batch(rows, max_new_tokens=NEW_TOKENS)
        assert [r.tokens.tolist() for r in out.rows] == refs


def test_a_window_spanning_the_capacity_adds_no_mask():
    """Gemma 3's sliding layers with a window at least the static decoder's capacity see every cached
    position: one mask for every layer (no second mask built per step); a narrower window: one per
    layer type."""
    model = build(MODELS["gemma3"]())
    assert static_module.layer_mask_rules(model, 6) == {
        "sliding_attention": (None, None),
        "full_attention": (None, None),
    }
    assert static_module.layer_mask_rules(model, 7)["sliding_attention"] == (6, None)
    decoder = StaticDecoder(model, random_heads(model), chain_tree(2), 6)
    with torch.inference_mode():
        assert isinstance(decoder._tree_mask(), torch.Tensor)
        assert isinstance(decoder._prefill_mask(3), torch.Tensor)
