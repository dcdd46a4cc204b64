"""The three decoders on models whose attention masks or positions are not Llama's: chunked attention
(Llama 4: chunked layers and global NoPE layers), interleaved sliding windows (Gemma 3, Cohere 2, and
Gemma 3's multimodal model, whose config nests the text one), each decoded past its chunk or window;
and the models they refuse before any forward: ALiBi (Bloom, Falcon with ``alibi``, MPT), and Llama 4
where its NoPE layers' query scaling would count positions from the cache's length."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import medusa_train.decoding.static as static_module
from medusa_train.decoding import (
    StaticDecoder,
    TreeBuffers,
    chain_tree,
    medusa_generate,
    medusa_generate_batch,
    tree_attention_mask,
)
from medusa_train.decoding.attention import AttentionBackendError
from medusa_train.decoding.batched import _BatchMask
from tests.helpers.models import MAX_POS, VOCAB, random_heads, random_tree

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


MODELS = {
    "llama4": llama4,
    "gemma3": lambda: tf.Gemma3TextConfig(**SHAPE, head_dim=8, sliding_window=6, layer_types=INTERLEAVED),
    "cohere2": lambda: tf.Cohere2Config(**SHAPE, sliding_window=6, layer_types=INTERLEAVED),
    "gemma3_multimodal": gemma3_multimodal,
}
ALIBI = {
    "bloom": lambda: tf.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=VOCAB),
    "falcon": lambda: tf.FalconConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB, alibi=True
    ),
    "mpt": lambda: tf.MptConfig(d_model=32, n_layers=2, n_heads=4, vocab_size=VOCAB, max_seq_len=MAX_POS),
}


def build(config: tf.PretrainedConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    if isinstance(config, tf.Gemma3Config):
        return tf.Gemma3ForConditionalGeneration(config).eval()
    return tf.AutoModelForCausalLM.from_config(config).eval()


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


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_parity_past_the_chunk_or_window(name):
    """``medusa_generate`` and ``medusa_generate_batch`` (ragged rows: left padding shifts no chunk)
    equal ``generate`` with contexts past the chunk (8) or window (6); the static decoder refuses the
    mixed layers up front (a capacity past Llama 4's chunk)."""
    model = build(MODELS[name]())
    heads = random_heads(model, seed=1)
    rows = prompts()
    refs = [plain_greedy(model, p) for p in rows]
    for tree_name, tree in TREES.items():
        for prompt, ref in zip(rows, refs, strict=True):
            out = medusa_generate(model, heads, prompt[None], max_new_tokens=NEW_TOKENS, tree=tree)
            assert out.tokens.tolist() == ref, (name, tree_name, len(prompt))
        batch = medusa_generate_batch(model, heads, rows, max_new_tokens=NEW_TOKENS, tree=tree)
        assert [r.tokens.tolist() for r in batch.rows] == refs, (name, tree_name)
    with pytest.raises(ValueError, match="mixes"):
        StaticDecoder(model, heads, chain_tree(4), 2 * MAX_POS)


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


def test_chunked_masks_follow_the_rule():
    """Each decoder's chunked-layer mask is the rule itself (a key visible only in its query's chunk of
    positions; a tree node's position is the past plus its depth, not its column) on a tree of 12
    nodes crossed by a chunk boundary at every past length: ``medusa_generate``'s, the batched
    decoder's (left-padded rows) and the static decoder's."""
    chunk = 4
    model = build(llama4(chunk, no_rope_layers=(1, 1)))
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
        static_masks = decoder._tree_mask()  # (B, 1, M, C)
    for b, mask in enumerate(static_masks):
        assert torch.equal(mask[0] == 0, chunk_rule(tree, int(decoder.length[b]), 0, 40, chunk)), b


def test_static_decoder_refuses_mixed_chunked_layers_past_the_chunk():
    model = build(llama4(chunk=8))
    calls = count_forwards(model)
    with pytest.raises(ValueError, match=r"mixes chunked layers \(attention_chunk_size=8\).*capacity <= 8"):
        StaticDecoder(model, random_heads(model), chain_tree(4), 64)
    assert not calls


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
    prompt = torch.tensor([3, 5, 7])
    decoders = [
        lambda: medusa_generate(model, heads, prompt[None], max_new_tokens=4, tree=chain_tree(2)),
        lambda: medusa_generate_batch(
            model, heads, [prompt, prompt[1:]], max_new_tokens=4, tree=chain_tree(2)
        ),
        lambda: StaticDecoder(model, heads, chain_tree(2), 32),
    ]
    for decode in decoders:
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


def test_llama4_query_scaling_by_cache_length_is_refused(monkeypatch):
    """Llama 4's NoPE layers scale their queries by positions counted from the cache's length; from
    ``floor_scale - 1`` on that scale is not 1, and a tree node's index, the batched decoder's cache
    width or the static decoder's capacity is not the position: each decoder refuses a call that could
    get there (floor_scale 4) before any forward; the static decoder would decode it wrongly. A chain's
    node indices are its depths: ``medusa_generate`` decodes it as ``generate`` does."""
    model = build(llama4(chunk=None, floor_scale=4, attn_scale=1.0, initializer_range=0.3))
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
