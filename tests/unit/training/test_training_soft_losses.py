"""Soft-label head losses (kl, tv, mixtures) == a naive full-softmax computation, in value and gradients.

Tolerances: the fused losses accumulate in float32 chunk by chunk, the references in one float32
softmax; they agree to ~1e-6 here, asserted at 1e-5 (values and gradients, absolute and relative).
"""

from __future__ import annotations

import math

import pytest
import torch

from medusa_train.errors import ConfigError
from medusa_train.head_loss import parse_head_loss
from medusa_train.head_targets import (
    IGNORE_INDEX,
    last_hidden_state,
    logit_map,
    medusa_targets,
    soft_target_sources,
)
from medusa_train.heads import MedusaHeads
from medusa_train.training.hidden_cache import build_hidden_cache
from medusa_train.training.losses import (
    HeadLoss,
    SoftTargets,
    chunked_soft_loss,
    medusa_head_loss,
    naive_medusa_head_loss,
)
from medusa_train.training.model import MedusaTrainingModel, lm_cross_entropy
from medusa_train.training.trainer import row_collator
from tests.helpers.training import LOGIT_STEP_ARCHS, VOCAB, batch, tiny_llama, tiny_logit_step_model

TOL = {"atol": 1e-5, "rtol": 1e-5}


def naive(z: torch.Tensor, u: torch.Tensor, kind: str, temperature: float = 1.0) -> torch.Tensor:
    """Mean loss of head logits ``z (N, V)`` against target logits ``u (N, V)``, written out."""
    q = torch.softmax(z, dim=-1)
    p = torch.softmax(u / temperature, dim=-1)
    if kind == "kl":
        return (p * (p.log() - q.log())).sum(-1).mean()
    return 0.5 * (p - q).abs().sum(-1).mean()


def test_golden_values_by_hand():
    # Head logits (0, 0): q = (1/2, 1/2); target logits (log 3, 0): p = (3/4, 1/4).
    x, w = torch.ones(1, 1), torch.zeros(2, 1)
    y, lm = torch.ones(1, 1), torch.tensor([[math.log(3.0)], [0.0]])
    kl = chunked_soft_loss(x, w, y, lm, "kl", chunk_size=1, vocab_chunk_size=1)
    tv = chunked_soft_loss(x, w, y, lm, "tv", chunk_size=1, vocab_chunk_size=1)
    assert kl.item() == pytest.approx(0.75 * math.log(1.5) + 0.25 * math.log(0.5), abs=1e-6)  # 0.130812
    assert tv.item() == pytest.approx(0.25, abs=1e-6)
    # Temperature 2: p = softmax((log 3, 0) / 2) = (sqrt 3, 1) / (sqrt 3 + 1).
    p0 = math.sqrt(3) / (math.sqrt(3) + 1)
    tv_t = chunked_soft_loss(x, w, y, lm, "tv", temperature=2.0)
    assert tv_t.item() == pytest.approx(p0 - 0.5, abs=1e-6)


@pytest.mark.parametrize("kind", ["kl", "tv"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize(("chunk", "vocab_chunk"), [(1, 1), (7, 5), (64, 4096)])
def test_soft_loss_matches_naive_value_and_grads(kind, temperature, chunk, vocab_chunk):
    torch.manual_seed(0)
    n, d, v = 23, 8, 37
    x = torch.randn(n, d, requires_grad=True)
    w = torch.randn(v, d, requires_grad=True)
    y, lm = torch.randn(n, d), torch.randn(v, d)
    out = chunked_soft_loss(
        x, w, y, lm, kind, temperature=temperature, chunk_size=chunk, vocab_chunk_size=vocab_chunk, scale=0.8
    )
    ref = 0.8 * naive(x @ w.t(), y @ lm.t(), kind, temperature)
    torch.testing.assert_close(out, ref, **TOL)
    for g, r in zip(torch.autograd.grad(out, (x, w)), torch.autograd.grad(ref, (x, w)), strict=True):
        torch.testing.assert_close(g, r, **TOL)


@pytest.mark.parametrize("kind", ["kl", "tv"])
def test_chunking_changes_nothing_beyond_rounding(kind):
    torch.manual_seed(1)
    x, w = torch.randn(50, 16, requires_grad=True), torch.randn(300, 16, requires_grad=True)
    y, lm = torch.randn(50, 16), torch.randn(300, 16)
    results = []
    for chunk, vocab_chunk in [(50, 300), (3, 7), (1, 64), (16, 1)]:
        loss = chunked_soft_loss(x, w, y, lm, kind, chunk_size=chunk, vocab_chunk_size=vocab_chunk)
        results.append((loss, *torch.autograd.grad(loss, (x, w))))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", ["kl", "tv"])
def test_truncated_target_is_renormalised_on_the_draft_vocabulary(kind):
    torch.manual_seed(2)
    token_map = torch.tensor([5, 0, 17, 3, 30, 11])
    x, w = torch.randn(9, 8, requires_grad=True), torch.randn(len(token_map), 8, requires_grad=True)
    y, lm = torch.randn(9, 8), torch.randn(40, 8)
    out = chunked_soft_loss(x, w, y, lm, kind, token_map=token_map, chunk_size=4, vocab_chunk_size=4)
    p_full = torch.softmax(y @ lm.t(), dim=-1)  # (9, 40)
    p = p_full[:, token_map] / p_full[:, token_map].sum(-1, keepdim=True)  # renormalised on the map
    q = torch.softmax(x @ w.t(), dim=-1)
    ref = (p * (p.log() - q.log())).sum(-1).mean() if kind == "kl" else 0.5 * (p - q).abs().sum(-1).mean()
    torch.testing.assert_close(out, ref, **TOL)
    for g, r in zip(torch.autograd.grad(out, (x, w)), torch.autograd.grad(ref, (x, w)), strict=True):
        torch.testing.assert_close(g, r, **TOL)


def test_head_loss_spec():
    assert parse_head_loss("ce") == (("ce", 1.0),)
    assert parse_head_loss("kl + 0.5ce") == (("kl", 1.0), ("ce", 0.5))
    assert parse_head_loss("0.25*kl+0.75*tv") == (("kl", 0.25), ("tv", 0.75))
    for bad in ("", "mse", "kl+kl", "0ce", "kl+", "-1kl"):
        with pytest.raises(ConfigError, match="training.head_loss"):
            parse_head_loss(bad)
    assert HeadLoss.from_spec("kl+0.5ce").soft and not HeadLoss.from_spec("ce").soft


# -- the head loss over K heads: soft targets at t+k -------------------------------------------------
def _heads(projection: str, d: int = 16, v: int = 40, k: int = 3) -> tuple[MedusaHeads, torch.Tensor]:
    torch.manual_seed(3)
    token_map = torch.tensor([1, 4, 9, 16, 25, 36, 2, 3]) if projection == "truncated" else None
    heads = MedusaHeads(d, v, k, 1, head_projection=projection, token_map=token_map)
    lm_head = torch.randn(v, d)
    heads.init_from_lm_head(lm_head)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return heads, lm_head


def _soft_batch(k: int = 3, v: int = 40, d: int = 16) -> tuple[torch.Tensor, torch.Tensor, SoftTargets]:
    """Rows of a (2, 12) batch with their targets and soft targets, as the training module selects them."""
    torch.manual_seed(4)
    ids = torch.randint(0, v, (2, 12))
    mask = torch.tensor([[0] * 3 + [1] * 9, [0] * 4 + [1] * 6 + [0] * 2])
    attn = torch.tensor([[1] * 12, [1] * 10 + [0] * 2])
    tgt = medusa_targets(ids, mask, attn, k)  # (2, 12, K)
    src = soft_target_sources(tgt)  # (2, 12, K)
    keep = (tgt != IGNORE_INDEX).any(-1).reshape(-1)  # (24,)
    h = torch.randn(24, d)  # (B*T, d)
    soft = SoftTargets(h, src.reshape(-1, k)[keep], torch.empty(0))
    return h[keep], tgt.reshape(-1, k)[keep], soft


@pytest.mark.parametrize("projection", ["own", "shared", "truncated"])
@pytest.mark.parametrize("spec", ["kl", "tv", "kl+0.5ce", "0.3tv+0.2kl+ce"])
def test_medusa_head_loss_matches_naive(projection, spec):
    heads, lm_head = _heads(projection)
    rows, targets, soft = _soft_batch()
    soft.lm_head = lm_head
    rows.requires_grad_(True)
    loss = HeadLoss.from_spec(spec, 0.8, vocab_chunk_size=7)
    params = [rows, *heads.parameters()]
    out = medusa_head_loss(heads, rows, targets, 0.8, 5, head_loss=loss, soft=soft)
    ref = naive_medusa_head_loss(heads, rows, targets, 0.8, head_loss=loss, soft=soft)
    torch.testing.assert_close(out.loss, ref, **TOL)
    for g, r in zip(torch.autograd.grad(out.loss, params), torch.autograd.grad(ref, params), strict=True):
        torch.testing.assert_close(g, r, **TOL)


def test_mixture_is_the_weighted_sum():
    heads, lm_head = _heads("own")
    rows, targets, soft = _soft_batch()
    soft.lm_head = lm_head

    def loss(spec: str) -> torch.Tensor:
        return medusa_head_loss(heads, rows, targets, 0.8, 5, head_loss=HeadLoss.from_spec(spec), soft=soft)

    mix = loss("kl+0.5ce+0.25tv")
    parts = [loss("kl"), loss("ce"), loss("tv")]
    torch.testing.assert_close(mix.loss, parts[0].loss + 0.5 * parts[1].loss + 0.25 * parts[2].loss, **TOL)
    torch.testing.assert_close(mix.ce, parts[0].ce + 0.5 * parts[1].ce + 0.25 * parts[2].ce, **TOL)


def test_soft_target_sources_point_at_t_plus_k():
    # Head k at t predicts token t+k+1, which the backbone predicts at position t+k.
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 0, 0]])
    attn = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    src = soft_target_sources(medusa_targets(ids, mask, attn, 2))  # (1, 8, 2)
    assert src[0, :, 0].tolist() == [-100, 2, 3, 4, -100, -100, -100, -100]
    assert src[0, :, 1].tolist() == [2, 3, 4, -100, -100, -100, -100, -100]


def _reference_model_loss(model: MedusaTrainingModel, b: dict, temperature: float) -> torch.Tensor:
    """The Medusa-1 KL loss written position by position from the backbone's logits at t+k."""
    heads, k = model.heads, model.heads.num_heads
    with torch.no_grad():
        logits = model.frozen_backbone(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        # what lm_head reads (Gemma 3n's hidden_states[-1] is its AltUp streams stacked)
        h = last_hidden_state(model.frozen_backbone, b["input_ids"], b["attention_mask"])  # (B, T, d)
    tgt = medusa_targets(b["input_ids"], b["loss_mask"], b["attention_mask"], k)  # (B, T, K)
    head_logits = heads(h)  # (K, B, T, V)
    total = torch.zeros(())
    for j in range(k):
        q_rows, p_rows = [], []
        for bi, t in (tgt[..., j] != IGNORE_INDEX).nonzero().tolist():
            q_rows.append(head_logits[j, bi, t])
            p_rows.append(logits[bi, t + j + 1])  # head j+1 at t <-> the backbone at t + (j+1)
        total = total + 0.8**j * naive(torch.stack(q_rows), torch.stack(p_rows), "kl", temperature)
    return total


def _model(head_loss: HeadLoss, cached: bool = False, arch: str = "llama") -> MedusaTrainingModel:
    backbone = tiny_llama() if arch == "llama" else tiny_logit_step_model(arch)
    torch.manual_seed(5)
    heads = MedusaHeads(32, VOCAB, 3, 1)
    heads.init_from_lm_head(backbone.get_output_embeddings().weight)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.05 * torch.randn_like(p))
    if cached:
        lm_head = backbone.get_output_embeddings().weight
        return MedusaTrainingModel(
            heads, None, chunk_size=8, head_loss=head_loss, lm_head=lm_head, logit_map=logit_map(backbone)
        )
    return MedusaTrainingModel(heads, backbone, chunk_size=8, head_loss=head_loss)


@pytest.mark.parametrize("arch", ["llama", *LOGIT_STEP_ARCHS])
def test_model_online_loss_is_the_backbone_distribution_at_t_plus_k(arch):
    """The target is the distribution the backbone's forward gives, also where that forward changes
    ``lm_head(h)`` (Gemma-2's softcap, Cohere's and Granite's scales): the reference reads its logits."""
    model = _model(HeadLoss.from_spec("kl", 0.7), arch=arch)
    b = batch()
    torch.testing.assert_close(model(**b)["loss"], _reference_model_loss(model, b, 0.7), **TOL)


@pytest.mark.parametrize("spec", ["kl", "tv+0.5ce"])
def test_model_from_hidden_cache_equals_online(tmp_path, spec):
    online = _model(HeadLoss.from_spec(spec))
    cached = _model(HeadLoss.from_spec(spec), cached=True)
    b = batch()
    records = []
    for i in range(b["input_ids"].shape[0]):
        n = int(b["attention_mask"][i].sum())
        records.append(
            {"input_ids": b["input_ids"][i, :n].tolist(), "loss_mask": b["loss_mask"][i, :n].tolist()}
        )
    cache = build_hidden_cache(
        online.frozen_backbone, records, tmp_path / "c", 3, {"v": 1}, batch_size=2, soft=True
    )
    rows = row_collator([cache[i] for i in range(len(cache))])
    want = online(**b)
    got = cached(**rows)
    torch.testing.assert_close(got["loss"], want["loss"], **TOL)
    torch.testing.assert_close(got["head_ce"], want["head_ce"], **TOL)
    assert torch.equal(got["head_count"], want["head_count"])


@pytest.mark.parametrize("arch", LOGIT_STEP_ARCHS)
def test_model_from_hidden_cache_reads_the_backbone_distribution_too(tmp_path, arch):
    online = _model(HeadLoss.from_spec("kl", 0.7), arch=arch)
    cached = _model(HeadLoss.from_spec("kl", 0.7), cached=True, arch=arch)
    b = batch()
    records = [
        {"input_ids": ids[: int(n)].tolist(), "loss_mask": mask[: int(n)].tolist()}
        for ids, mask, n in zip(b["input_ids"], b["loss_mask"], b["attention_mask"].sum(1), strict=True)
    ]
    cache = build_hidden_cache(
        online.frozen_backbone, records, tmp_path / "c", 3, {"v": 1}, batch_size=2, soft=True
    )
    got = cached(**row_collator([cache[i] for i in range(len(cache))]))["loss"]
    torch.testing.assert_close(got, _reference_model_loss(online, b, 0.7), **TOL)


def test_medusa2_heads_see_the_same_soft_loss_and_train():
    m1 = _model(HeadLoss.from_spec("kl"))
    backbone = m1.frozen_backbone.requires_grad_(True).train(False)
    m2 = MedusaTrainingModel(
        m1.heads,
        backbone,
        backbone_trainable=True,
        lm_loss=lm_cross_entropy,
        lambda0=0.5,
        chunk_size=8,
        head_loss=m1.head_loss,
    )
    b = batch()
    out = m2(**b)
    torch.testing.assert_close(out["head_ce"], m1(**b)["head_ce"], **TOL)
    out["loss"].backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m2.heads.parameters())
    assert backbone.get_output_embeddings().weight.grad is not None  # from the LM loss
