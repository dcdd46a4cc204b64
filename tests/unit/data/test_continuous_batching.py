"""ContinuousBatcher (distill's generation): every reply equals unbatched greedy ``generate``.

Rows join and leave the batch at different steps, the slot cache is re-laid out (a tiny headroom
forces it every few steps), follow-up requests re-enter the queue, and the batch is compacted for
the tail; none of it may change a single token, also where keys and values differ in width
(multi-head latent attention). Models whose cache cannot be edited (sliding windows, alone or beside
full layers, chunked attention, layers that read an earlier layer's KV) take the static ``generate``
fallback with the same results, on prompts longer than the window or chunk.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers as tf

from medusa_train.engines import inprocess
from medusa_train.engines.base import GenRequest
from medusa_train.engines.inprocess import ContinuousBatcher
from tests.helpers.models import tiny_model

VOCAB = 96
MAX_NEW = 9


SHAPE = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=VOCAB, max_position_embeddings=128, bos_token_id=0, eos_token_id=None, pad_token_id=0,
    initializer_range=0.2,  # at the default 0.02 their tokens hardly depend on the window
)  # fmt: skip
INTERLEAVED = ["sliding_attention", "full_attention"]
UNUSUAL = {  # window 6 and chunk 8, well inside the prompts (up to 41 tokens) and their second turns
    # multi-head latent attention: its cache keeps keys and values of different widths (continuous)
    "deepseek_v3": lambda: tf.DeepseekV3Config(
        **{**SHAPE, "num_key_value_heads": 4}, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=4, n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=2,
    ),
    # Gemma 4: the last two of four layers read the KV of the last earlier layer of their type
    "gemma4-kv-shared": lambda: tf.Gemma4TextConfig(
        **{**SHAPE, "num_hidden_layers": 4}, head_dim=8, global_head_dim=16, sliding_window=6,
        layer_types=INTERLEAVED * 2, num_kv_shared_layers=2, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB,
    ),
    "gemma3": lambda: tf.Gemma3TextConfig(**SHAPE, head_dim=8, sliding_window=6, layer_types=INTERLEAVED),
    # layers from max_window_layers on slide: a full layer, then a sliding one
    "qwen2-window": lambda: tf.Qwen2Config(
        **SHAPE, use_sliding_window=True, sliding_window=6, max_window_layers=1
    ),
    # Llama 4: a chunked layer (RoPE), then a global one (NoPE)
    "llama4": lambda: tf.Llama4TextConfig(
        **SHAPE, head_dim=8, intermediate_size_mlp=64, attention_chunk_size=8, num_local_experts=2,
        num_experts_per_tok=1, no_rope_layers=[1, 0],
    ),
}  # fmt: skip


def _model(arch: str) -> torch.nn.Module:
    if arch in UNUSUAL:
        torch.manual_seed(0)
        return tf.AutoModelForCausalLM.from_config(UNUSUAL[arch]()).eval()
    if arch == "gpt2":
        return tiny_model("gpt2", vocab=VOCAB, max_pos=128, bos_token_id=1, eos_token_id=1)
    window = {"sliding_window": 6} if arch == "mistral-window" else {}
    return tiny_model(arch.removesuffix("-window"), vocab=VOCAB, max_pos=128, **window)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(rng.choice([1, 2, 5, 9, 17, 30, 41]))] for _ in range(n)]


def _pick_eos(model, prompts: list[list[int]]) -> list[int]:
    """Three tokens that greedy replies (run without EOS) emit at steps 2..6: rows end at varied steps."""
    counts: dict[int, int] = {}
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW
        )
        for t in out[0, len(p) + 2 : len(p) + 7].tolist():
            counts[t] = counts.get(t, 0) + 1
    return sorted(counts, key=lambda t: -counts[t])[:3]


def _reference(model, context: list[int], eos: list[int], max_new: int = MAX_NEW) -> list[int]:
    ids = torch.tensor([context])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new,
        eos_token_id=eos,
        pad_token_id=0,
    )[0, len(context) :].tolist()
    end = next((i + 1 for i, t in enumerate(out) if t in eos), len(out))
    return out[:end]


def _run(
    model, prompts, eos: list[int], batch_size: int, refill_min: int | None = None, pad_id: int = 0, **kw
) -> dict:
    """Generate; every first reply queues a second turn built on it (key ``("turn2", i)``)."""
    replies: dict = {}

    def on_done(req: GenRequest, new: list[int]):
        replies[req.key] = (req.context, new)
        if isinstance(req.key, int):
            return GenRequest(("turn2", req.key), req.context + new + [7, 8, 9], req.seed)
        return None

    batcher = ContinuousBatcher(
        model,
        batch_size=batch_size,
        pad_id=pad_id,
        eos_ids=eos,
        max_new_tokens=MAX_NEW,
        refill_min=refill_min,
        **kw,
    )
    batcher.run([GenRequest(i, p, seed=100 + i) for i, p in enumerate(prompts)], on_done)
    return replies


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "deepseek_v3"])
def test_replies_equal_unbatched_generate(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inprocess, "_HEADROOM", 3)  # re-lay the slot cache out every few steps
    model = _model(arch)
    prompts = _prompts(19)
    eos = _pick_eos(model, prompts)
    assert ContinuousBatcher(model, batch_size=4, pad_id=0, eos_ids=eos, max_new_tokens=MAX_NEW).continuous
    reference = {i: _reference(model, p, eos) for i, p in enumerate(prompts)}
    lengths = [len(r) for r in reference.values()]
    assert min(lengths) < MAX_NEW and MAX_NEW in lengths  # rows leave at EOS and at the cap
    for batch_size, refill_min in [(1, None), (4, 1), (6, 3), (32, None)]:
        replies = _run(model, prompts, eos, batch_size, refill_min)
        assert len(replies) == 2 * len(prompts)
        for key, (context, new) in replies.items():
            expected = reference[key] if isinstance(key, int) else _reference(model, context, eos)
            assert new == expected, (arch, batch_size, key)


def test_first_token_eos_and_single_token_cap() -> None:
    model = _model("llama")
    prompts = _prompts(7, seed=3)
    eos = _pick_eos(model, prompts)
    batcher = ContinuousBatcher(model, batch_size=3, pad_id=0, eos_ids=eos, max_new_tokens=1)
    out: dict = {}
    batcher.run([GenRequest(i, p) for i, p in enumerate(prompts)], lambda r, n: out.__setitem__(r.key, n))
    assert out == {i: _reference(model, p, eos, max_new=1) for i, p in enumerate(prompts)}
    assert batcher.stats["decode_steps"] == 0  # every row finished at its prefill


@pytest.mark.parametrize("arch", ["mistral-window", "gemma4-kv-shared", "gemma3", "qwen2-window", "llama4"])
def test_models_whose_cache_cannot_be_edited_take_the_static_fallback(arch: str) -> None:
    model = _model(arch)
    prompts = _prompts(6, seed=1)
    eos = _pick_eos(model, prompts)
    assert not ContinuousBatcher(
        model, batch_size=4, pad_id=0, eos_ids=eos, max_new_tokens=MAX_NEW
    ).continuous
    for key, (context, new) in _run(model, prompts, eos, 4).items():
        assert new == _reference(model, context, eos), key


def test_sampled_rows_do_not_depend_on_the_batch() -> None:
    model = _model("llama")
    prompts = _prompts(9, seed=2)
    eos = _pick_eos(model, prompts)
    one, five = (_run(model, prompts, eos, bs, temperature=0.9, top_p=0.95) for bs in (1, 5))
    assert one == five
    assert any(new != _reference(model, context, eos) for context, new in one.values())  # it really sampled


@pytest.mark.parametrize("arch", ["llama", "mistral-window"])
def test_the_models_repetition_penalty_applies_as_in_generate(arch: str) -> None:
    """A generation config's repetition penalty (Qwen2.5-Instruct sets 1.05) is applied over each row's
    own context and reply: greedy replies equal the model's own ``generate``, which applies it, in a
    batch of rows of different lengths too (the static fallback's padding is not counted)."""
    model = _model(arch)
    prompts = _prompts(8, seed=4)
    eos = _pick_eos(model, prompts)
    unpenalised = {i: _reference(model, p, eos) for i, p in enumerate(prompts)}
    counts: dict[int, int] = {}
    for reply in unpenalised.values():
        for t in reply:
            counts[t] = counts.get(t, 0) + 1
    pad = max(counts, key=counts.get)  # padding that a penalty counting it would change replies with
    model.generation_config.repetition_penalty = 1.8
    for batch_size in (1, 4):
        replies = _run(model, prompts, eos, batch_size, pad_id=pad, repetition_penalty=1.8)
        for key, (context, new) in replies.items():
            assert new == _reference(model, context, eos), (arch, batch_size, key)
    assert any(replies[i][1] != unpenalised[i] for i in unpenalised)  # the penalty changed replies


def test_sampled_rows_with_a_penalty_do_not_depend_on_the_batch() -> None:
    model = _model("llama")
    prompts = _prompts(9, seed=5)
    eos = _pick_eos(model, prompts)
    kw = dict(temperature=0.9, top_p=0.95, repetition_penalty=1.8)
    one, five = (_run(model, prompts, eos, bs, **kw) for bs in (1, 5))
    assert one == five
    plain = _run(model, prompts, eos, 5, temperature=0.9, top_p=0.95)
    assert one != plain  # the penalty changed draws


@pytest.mark.parametrize(("top_k", "min_p"), [(1, 0.0), (0, 1.0), (3, 0.0)])
def test_draws_come_from_the_filtered_distribution(top_k, min_p) -> None:
    """Draws land only on tokens ``generate``'s warpers keep: top-k 1 and min-p 1 leave the argmax
    alone; with top-k 3 every draw is one of the 3 highest scores, and all three are drawn."""
    torch.manual_seed(0)
    scores = torch.randn(4, 50) * 0.1  # (B, V): nearly flat, unfiltered draws would land anywhere
    generators = [torch.Generator().manual_seed(i) for i in range(4)]
    draws = torch.stack(
        [inprocess.sample_rows(scores, generators, 1.0, 1.0, top_k, min_p) for _ in range(60)]
    )
    allowed = scores.topk(max(top_k, 1), dim=-1).indices  # (B, k)
    assert (draws.T.unsqueeze(-1) == allowed.unsqueeze(1)).any(-1).all()  # every draw in its row's set
    assert all(len(set(row)) == allowed.shape[-1] for row in draws.T.tolist())


def test_a_draw_at_the_top_of_the_mass_never_lands_on_a_filtered_token(monkeypatch) -> None:
    """A float64 draw within 2**-25 of 1 rounds to 1.0 in float32, i.e. to the whole mass: it takes the
    last token the filters kept, not the least likely one of those they removed."""
    scores = torch.tensor([[3.0, 2.0, 1.0, -5.0, -6.0]])  # (1, V)
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor(1 - 2**-30, dtype=torch.float64))
    assert inprocess.sample_rows(scores, [torch.Generator()], 1.0, 1.0, top_k=2).tolist() == [1]
    assert inprocess.sample_rows(scores, [torch.Generator()], 1.0, 0.5).tolist() == [0]


def test_sampled_rows_with_top_k_and_min_p_do_not_depend_on_the_batch() -> None:
    model = _model("llama")
    prompts = _prompts(9, seed=6)
    eos = _pick_eos(model, prompts)
    kw = dict(temperature=1.0, top_p=1.0, top_k=3, min_p=0.2)
    one, five = (_run(model, prompts, eos, bs, **kw) for bs in (1, 5))
    assert one == five
    window = _model("mistral-window")  # the static generate batches
    assert _run(window, prompts, eos, 5, **kw) == _run(window, prompts, eos, 1, **kw)
    assert one != _run(model, prompts, eos, 5, temperature=1.0, top_p=1.0)  # the filters changed draws


@pytest.mark.parametrize("arch", ["llama", "mistral-window"])
def test_settings_the_engine_does_not_apply_are_unapplied_on_both_paths(arch: str) -> None:
    """A generation config's ``no_repeat_ngram_size`` (one of ``UNAPPLIED_SETTINGS``) changes
    ``generate``'s replies; the continuous path and the static fallback (which calls ``generate``)
    both leave it unapplied, so they agree."""
    model = _model(arch)
    prompts = _prompts(6, seed=7)
    eos = _pick_eos(model, prompts)
    plain = _run(model, prompts, eos, 3)
    model.generation_config.no_repeat_ngram_size = 2
    assert any(new != _reference(model, context, eos) for context, new in plain.values())  # it would bite
    assert _run(model, prompts, eos, 3) == plain
    assert "no_repeat_ngram_size" in inprocess.UNAPPLIED_SETTINGS


def test_the_float64_draws_are_cast_on_the_cpu_before_they_move_to_the_scores_device() -> None:
    """MPS has no float64: the draws become float32 while still on the CPU, and only then move (a
    single ``.to(device, dtype)`` leaves the order to the backend's copy)."""
    from torch.overrides import TorchFunctionMode

    moved: list[torch.dtype] = []

    class RecordMoves(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.to and (
                "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args[1:])
            ):
                moved.append(args[0].dtype)
            return func(*args, **kwargs)

    scores = torch.randn(3, 20)  # (B, V)
    with RecordMoves():
        inprocess.sample_rows(scores, [torch.Generator().manual_seed(i) for i in range(3)], 0.9, 0.95)
    assert moved and torch.float64 not in moved
