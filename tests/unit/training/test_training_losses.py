"""Chunked Medusa loss == naive loss (value and gradients); targets; top-k counts; KL; lambda0."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from medusa_train.decoding.calibrate import head_topk_accuracy
from medusa_train.head_targets import IGNORE_INDEX, chunked_topk_correct, medusa_targets, select_trained_rows
from medusa_train.heads import MedusaHeads
from medusa_train.training.losses import (
    ChunkedLinearCrossEntropy,
    ChunkedLinearSoftLoss,
    chunked_cross_entropy,
    chunked_kl_to_teacher,
    lambda0_schedule,
    lm_targets,
    medusa_head_loss,
    naive_medusa_head_loss,
    naive_soft_loss,
)


def _heads(d: int = 16, v: int = 50, k: int = 3, seed: int = 0) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(d, v, k, 1)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.2)
    return heads


@pytest.mark.parametrize("chunk", [1, 7, 64, 4096])
def test_chunked_head_loss_matches_naive_value_and_grads(chunk):
    heads = _heads()
    x = torch.randn(37, 16, requires_grad=True)
    y = torch.randint(0, 50, (37, 3))
    y[::3, 1] = IGNORE_INDEX
    y[5:, 2] = IGNORE_INDEX
    params = [x, *heads.parameters()]
    out = medusa_head_loss(heads, x, y, decay=0.8, chunk_size=chunk)
    grads = torch.autograd.grad(out.loss, params)
    ref = naive_medusa_head_loss(heads, x, y, decay=0.8)
    ref_grads = torch.autograd.grad(ref, params)
    assert abs(out.loss.item() - ref.item()) < 1e-5
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    assert out.count.tolist() == [37, 37 - 13, 5]


def test_chunked_ce_all_ignored_is_zero_with_zero_grads():
    feats = torch.randn(5, 8, requires_grad=True)
    weight = torch.randn(11, 8, requires_grad=True)
    loss = chunked_cross_entropy(feats, weight, torch.full((5,), IGNORE_INDEX), 2)
    loss.backward()
    assert loss.item() == 0.0 and feats.grad.abs().sum() == 0 and weight.grad.abs().sum() == 0


def test_chunked_ce_scales_with_upstream_gradient():
    feats = torch.randn(6, 4, requires_grad=True)
    weight = torch.randn(9, 4, requires_grad=True)
    y = torch.randint(0, 9, (6,))
    (3.0 * chunked_cross_entropy(feats, weight, y, 4)).backward()
    f2, w2 = feats.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    (3.0 * F.cross_entropy(f2 @ w2.t(), y)).backward()
    torch.testing.assert_close(feats.grad, f2.grad)
    torch.testing.assert_close(weight.grad, w2.grad)


def test_chunked_ce_no_grad_mode():
    feats, weight = torch.randn(6, 4, requires_grad=True), torch.randn(9, 4, requires_grad=True)
    y = torch.randint(0, 9, (6,))
    with torch.no_grad():
        loss = chunked_cross_entropy(feats, weight, y, 4)
    assert not loss.requires_grad
    assert abs(loss.item() - F.cross_entropy(feats @ weight.t(), y).item()) < 1e-5


def test_medusa_targets_positions():
    # Head k at position t is trained on token t+k+1 iff loss_mask[t+k+1] == 1 and it is not padding.
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 0, 0]])
    attn = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])  # mask on padding must not count
    tgt = medusa_targets(ids, mask, attn, 2)  # (1, 8, 2)
    assert tgt[0, :, 0].tolist() == [-100, 13, 14, 15, -100, -100, -100, -100]
    assert tgt[0, :, 1].tolist() == [13, 14, 15, -100, -100, -100, -100, -100]
    rows, row_t = select_trained_rows(torch.arange(8.0).reshape(1, 8, 1), tgt)
    assert rows[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert row_t.tolist() == [[-100, 13], [13, 14], [14, 15], [15, -100]]
    assert lm_targets(ids, mask, attn)[0].tolist() == [-100, -100, 13, 14, 15, -100, -100, -100]


def test_medusa_targets_never_span_the_end_of_a_generated_turn():
    """Head k at t is scored on token t+k+1 as the continuation of t+1..t+k, as Medusa decodes: never
    across the end of a reply into a later one (tokens after the reply's end that are not generated, a
    user turn among them, come before the target). By hand, K = 3, a two-token user turn between two
    replies (P: prompt, G: generated, E: the EOS ending a reply, U: the next turn's template text)."""
    #                   P   P   P   G   G   E  U   U   G   G   E
    ids = torch.tensor([[10, 11, 12, 20, 21, 1, 30, 31, 40, 41, 1]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1]])
    tgt = medusa_targets(ids, mask, torch.ones_like(ids), 3)  # (1, 11, 3)
    x = IGNORE_INDEX
    assert tgt[0, :, 0].tolist() == [x, 20, 21, 1, x, x, 40, 41, 1, x, x]
    assert tgt[0, :, 1].tolist() == [20, 21, 1, x, x, x, 41, 1, x, x, x]  # t=5 (E): 40 is past the user turn
    assert tgt[0, :, 2].tolist() == [21, 1, x, x, x, x, 1, x, x, x, x]  # t=4, 5: 40, 41 past it
    # Padding right after a reply (a batch's shorter record) and a turn cut without EOS end alike.
    padded = medusa_targets(
        torch.cat([ids, torch.zeros(1, 3, dtype=torch.long)], 1),
        torch.cat([mask, torch.ones(1, 3, dtype=torch.long)], 1),
        torch.cat([torch.ones_like(ids), torch.zeros(1, 3, dtype=torch.long)], 1),
        3,
    )
    assert torch.equal(padded[:, :11], tgt) and bool((padded[:, 11:] == x).all())


def test_topk_counts_match_calibrate():
    torch.manual_seed(1)
    feats, weight = torch.randn(40, 8), torch.randn(30, 8)
    y = torch.randint(0, 30, (40,))
    y[::4] = IGNORE_INDEX
    hits = chunked_topk_correct(feats, weight, y, 10, chunk_size=7)
    ref = head_topk_accuracy((feats @ weight.t())[None], y[None], 10)[0]
    torch.testing.assert_close(hits.float() / 30, ref)


def test_chunked_kl_matches_direct():
    """Value and gradients equal the direct KL; between forward and backward nothing of vocabulary
    width is kept (every chunk's teacher logits are made inside its checkpoint: O(chunk * V))."""
    torch.manual_seed(2)
    hs = torch.randn(13, 8, requires_grad=True)
    ws = torch.randn(20, 8, requires_grad=True)
    ht, wt = torch.randn(13, 8), torch.randn(20, 8)
    kept = []

    def pack(t):
        kept.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        kl = chunked_kl_to_teacher(hs, ws, ht, wt, chunk_size=4)
    assert kept and not [shape for shape in kept if shape[-1] == 20]  # (c, V) never; the weights are (V, d)
    g = torch.autograd.grad(kl, [hs, ws])
    ref = F.kl_div(
        F.log_softmax(hs @ ws.t(), -1), F.log_softmax(ht @ wt.t(), -1), log_target=True, reduction="batchmean"
    )
    g_ref = torch.autograd.grad(ref, [hs, ws])
    assert abs(kl.item() - ref.item()) < 1e-5
    for a, b in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["constant", "linear", "sine", "sine_r"])
def test_lambda0_schedules(kind):
    values = [lambda0_schedule(s, 0.2, 10, kind) for s in range(0, 15)]
    assert all(b >= a - 1e-12 for a, b in zip(values, values[1:], strict=False))
    assert math.isclose(values[10], 0.2) and math.isclose(values[14], 0.2)
    if kind != "constant":
        assert values[0] == 0.0
    if kind == "sine":  # concave: above linear half-way
        assert values[5] > 0.1
    if kind == "sine_r":  # convex: below linear half-way
        assert values[5] < 0.1


def test_a_half_precision_loss_scale_does_not_overflow_the_fused_gradients():
    """fp16 loss scaling starts at 65,536 (DeepSpeed, torch's GradScaler), which is inf in fp16: the
    fused loss applies the upstream gradient in fp32, so the scaled gradients stay finite (and the
    fp32 path is unchanged)."""
    torch.manual_seed(0)
    x, w = torch.randn(256, 16), torch.randn(512, 16) * 0.02
    y = torch.randint(0, 512, (256,))
    grads = {}
    for dtype in (torch.float32, torch.float16):
        xs, ws = x.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
        loss = ChunkedLinearCrossEntropy.apply(xs, ws, y, 64, 1.0)
        grads[dtype] = torch.autograd.grad(loss * 65536.0, [xs, ws])
    for half, full in zip(grads[torch.float16], grads[torch.float32], strict=True):
        assert torch.isfinite(half).all()
        assert (half.float() - full).norm() / full.norm() < 0.1


def _fused_fp16_loss(kind: str, x, w, targets, target_x, target_w, scale: float) -> torch.Tensor:
    """One of the two fused Functions on fp16 inputs: 4 row chunks, the soft loss in 2 vocabulary chunks."""
    if kind == "ce":
        return ChunkedLinearCrossEntropy.apply(x, w, targets, 16, scale)
    return ChunkedLinearSoftLoss.apply(x, w, target_x, target_w, None, kind, 1.0, 16, 32, scale)


def _fp16_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` in fp32 with the values an fp16 matmul rounds to, and the exact gradient."""
    z = x @ w.t()  # (N, V)
    return z + ((x.detach() @ w.detach().t()).half().float() - z).detach()


CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("kind", ["ce", "kl", "tv"])
def test_fp16_gradients_under_a_loss_scale_are_as_accurate_as_fp32_ones_cast_once(kind, device):
    """The fused losses make their gradients in forward, before the fp16 loss scale (65,536) is known.
    Unscaled, most entries of the logits' gradient are below fp16's smallest normal number; the
    gradients must still match an fp32 reference (same fp16-rounded logits, gradients through a plain
    linear + F.cross_entropy / the soft loss in fp32): one fp16 rounding costs ~2e-4 relative error.
    ``scale`` (a head's lambda) = 2^-12 stands in for the count x vocabulary of a real batch (4,096
    rows x 32,000 tokens put the entries near 1e-8), at a 64 x 64 shape. On CUDA too (gpu): the
    mixed-dtype ``mul(out=)`` / ``addcmul_`` and cuBLAS's fp16 products."""
    torch.manual_seed(0)
    n, v, d, scale, loss_scale = 64, 64, 8, 2.0**-12, 65536.0
    x, w = torch.randn(n, d).half(), (torch.randn(v, d) * 0.5).half()
    target_x, target_w = torch.randn(n, d).half(), (torch.randn(v, d) * 0.5).half()
    targets = torch.randint(0, v, (n,))
    x, w, target_x, target_w, targets = (t.to(device) for t in (x, w, target_x, target_w, targets))
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = _fused_fp16_loss(kind, xs, ws, targets, target_x, target_w, scale)
    (loss * loss_scale).backward()
    xr, wr = x.float().requires_grad_(), w.float().requires_grad_()
    logits = _fp16_logits(xr, wr)  # (N, V)
    if kind == "ce":
        ref = F.cross_entropy(logits, targets)
    else:
        ref = naive_soft_loss(logits, _fp16_logits(target_x.float(), target_w.float()), kind)
    (ref * scale).backward()
    for got, want in ((xs.grad, xr.grad), (ws.grad, wr.grad)):
        assert got.dtype == torch.float16 and torch.isfinite(got).all()
        # Here ~3e-4; an fp16 cast of the unscaled gradient: 3.4% (ce), 6% (kl), 47% (tv).
        assert (got.float() / loss_scale - want).norm() / want.norm() < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_only_fp16_keeps_fp32_gradient_buffers_until_backward(dtype):
    """The stored (N, d) and (V, d) gradients cost fp32 memory for fp16 inputs only (their loss scale
    comes in backward); fp32 and bf16 keep them in their own dtype."""
    x, w = (
        torch.randn(8, 4, dtype=dtype, requires_grad=True),
        torch.randn(16, 4, dtype=dtype, requires_grad=True),
    )
    loss = ChunkedLinearCrossEntropy.apply(x, w, torch.randint(0, 16, (8,)), 4, 1.0)
    kept = torch.float32 if dtype == torch.float16 else dtype
    assert [g.dtype for g in loss.grad_fn.grads] == [kept, kept]
    loss.backward()
    assert x.grad.dtype == w.grad.dtype == dtype
