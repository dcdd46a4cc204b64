"""Medusa losses, computed in vocabulary chunks so no ``(T, V)`` logits tensor ever lives whole.

Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads"
(arXiv:2401.10774), section 2.2.

Medusa-1 loss::

    L = sum_k lambda_k * CE(head_k(h_t), y_{t+k+1}),   lambda_k = decay^(k-1),   k = 1..K

Which positions count: the prediction head k makes at position t is a prediction of token
``t+k+1``; it is trained iff ``loss_mask[t+k+1] == 1`` (the target is a token the backbone
generated) and ``t+k+1`` lies inside the (unpadded) sequence (:func:`medusa_train.heads.medusa_targets`,
the one definition the held-out accuracy of decoding/calibrate.py shares). Each head's CE is the
mean over its counted positions in the batch; a head with no counted position contributes 0.

Memory: a naive implementation materialises ``(K, B, T, V)`` logits plus their softmax and
gradient. :class:`ChunkedLinearCrossEntropy` instead walks over ``chunk_size`` rows at a time,
computes the ``(chunk, V)`` logits, the loss *and already the gradient* w.r.t. the features and
the projection weight (the fused "linear + cross-entropy" trick), and drops the logits. Backward
then only scales the stored gradients by the incoming scalar. Peak extra memory is
O(chunk * V + V * d) instead of O(T * V), and the flop count equals the naive version's
(one logits matmul + two gradient matmuls), so it is not slower.

Head projection variants (:mod:`medusa_train.heads`): ``shared`` heads use the backbone's lm_head as
every head's projection (no gradient for it from the heads' loss, only the residual blocks train);
``truncated`` heads project to a draft vocabulary of N tokens, and a target outside that vocabulary
is **not counted** in the CE (the EAGLE-3 convention, where positions whose target falls outside the
draft vocabulary are masked out of the loss). An "other" bucket would teach the head to spend
probability on a candidate the decoder can never propose, and vLLM's layout has no row for one. It
still counts as a miss in the top-k metrics (``count`` covers every full-vocabulary target), so
accuracies compare across variants.

Also here: the LM losses Medusa-2 adds (CE on data, KL to
the frozen original), and the lambda_0 warm-up schedules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from medusa_train.heads import IGNORE_INDEX, chunked_topk_correct


# -- fused chunked linear + cross-entropy -----------------------------------------------------------
class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean CE of ``feats @ weight.T`` against ``targets`` without materialising the logits.

    Forward computes, chunk by chunk, the loss and (if gradients are needed) the gradients w.r.t.
    ``feats`` and ``weight``; backward scales them by the incoming gradient. Rows whose target is
    ``IGNORE_INDEX`` contribute nothing. Returns the mean over counted rows (0 if none).
    Backward runs once per forward (no ``retain_graph`` double backward): it hands its stored
    gradients over.
    """

    @staticmethod
    def forward(
        ctx,
        feats: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk_size: int,
        scale: float = 1.0,
    ):
        # feats (N, d), weight (V, d), targets (N,)
        n = feats.shape[0]
        valid = targets != IGNORE_INDEX  # (N,)
        count = int(valid.sum())
        needs_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_feats = torch.zeros_like(feats) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        total = torch.zeros((), dtype=torch.float32, device=feats.device)
        scale = scale / max(count, 1)
        for start in range(0, n, chunk_size):
            x = feats[start : start + chunk_size]  # (c, d)
            y = targets[start : start + chunk_size]  # (c,)
            ok = y != IGNORE_INDEX  # (c,)
            if not bool(ok.any()):
                continue
            if x.dtype != weight.dtype:  # fp32 heads over a bf16 lm_head (shared heads): no (V, d) copy
                x = x.to(weight.dtype)
            logits = (x @ weight.t()).float()  # (c, V)
            lse = torch.logsumexp(logits, dim=-1)  # (c,)
            y_safe = y.clamp_min(0)
            target_logit = logits.gather(1, y_safe[:, None]).squeeze(1)  # (c,)
            total += ((lse - target_logit) * ok).sum()
            if needs_grad:
                # d CE / d logits = softmax - onehot, on counted rows only, pre-divided by the count.
                probs = logits.sub_(lse[:, None]).exp_()  # (c, V), reuses the logits buffer
                probs[torch.arange(len(y), device=y.device), y_safe] -= 1.0
                probs *= (ok.float() * scale)[:, None]
                g = probs.to(weight.dtype)  # (c, V)
                if grad_feats is not None:
                    grad_feats[start : start + chunk_size] = g @ weight  # (c, d)
                if grad_weight is not None and weight.dtype == torch.float32:
                    grad_weight.addmm_(g.t(), x)  # (V, d) in place: no (V, d) temporary per chunk
                elif grad_weight is not None:
                    grad_weight += (g.t() @ x).float()  # (V, d), fp32 accumulation of bf16/fp16 products
            del logits
        # Kept as plain attributes, not save_for_backward: backward hands them over and drops its
        # reference, so autograd can adopt them as .grad without another (V, d) copy.
        ctx.grads = (grad_feats, grad_weight.to(weight.dtype) if grad_weight is not None else None)
        return total * scale

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_feats, grad_weight = ctx.grads
        del ctx.grads
        # The usual upstream gradient is exactly 1 (the weight lambda_k is applied inside via
        # ``scale``): hand the stored gradients over as they are.
        if bool(grad_out != 1):
            grad_feats = grad_feats * grad_out.to(grad_feats.dtype) if grad_feats is not None else None
            grad_weight = grad_weight * grad_out.to(grad_weight.dtype) if grad_weight is not None else None
        return grad_feats, grad_weight, None, None, None


def chunked_cross_entropy(
    feats: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int = 1024,
    scale: float = 1.0,
) -> torch.Tensor:
    """Mean cross-entropy of ``feats @ weight.T`` over rows whose target is not ``IGNORE_INDEX``.

    Args:
        feats: ``(N, d)`` features (a head's residual-block output, or the backbone's last hidden state).
        weight: ``(V, d)`` vocab projection.
        targets: ``(N,)`` long, ``IGNORE_INDEX`` = not counted.
        chunk_size: rows per chunk; peak extra memory ~ ``chunk_size * V`` floats.
        scale: multiply the loss by this (e.g. lambda_k) inside the fused op, so the upstream
            gradient is 1 and the stored gradients are handed over without a copy.

    Returns:
        ``scale`` * scalar loss (0 when no row counts), differentiable w.r.t. ``feats`` and ``weight``.
    """
    if not torch.is_grad_enabled():  # evaluation: skip the gradient work inside forward
        feats, weight = feats.detach(), weight.detach()
    return ChunkedLinearCrossEntropy.apply(feats, weight, targets, chunk_size, scale)


# -- the Medusa-1 head loss -------------------------------------------------------------------------
@dataclass
class HeadLossOutput:
    """Result of :func:`medusa_head_loss`.

    Attributes:
        loss: scalar, ``sum_k decay^(k-1) * ce_k``.
        ce: ``(K,)`` detached per-head mean CE.
        count: ``(K,)`` counted targets per head.
        top1: ``(K,)`` correct top-1 predictions per head (counts, not rates).
        top5: ``(K,)`` correct top-5 predictions per head.
    """

    loss: torch.Tensor
    ce: torch.Tensor
    count: torch.Tensor
    top1: torch.Tensor
    top5: torch.Tensor


def head_weights(num_heads: int, decay: float) -> list[float]:
    """``lambda_k = decay^(k-1)`` for k = 1..K."""
    return [decay**k for k in range(num_heads)]


def medusa_head_loss(
    heads,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    decay: float = 0.8,
    chunk_size: int = 1024,
    with_metrics: bool = True,
) -> HeadLossOutput:
    """Medusa-1 loss of ``heads`` (a :class:`medusa_train.heads.MedusaHeads`) on selected rows.

    Args:
        heads: the K heads.
        hidden: ``(N, d)`` backbone last hidden states (rows from :func:`select_trained_rows`).
        targets: ``(N, K)`` full-vocabulary ids; column k-1 is head k's target, ``IGNORE_INDEX`` = not
            counted (truncated heads: ids outside the draft vocabulary are left out of the CE).
        decay: lambda_k = decay^(k-1).
        chunk_size: rows per chunk in the fused CE.
        with_metrics: also count top-1 / top-5 hits (chunked, no grad; costs one more logits pass).

    Returns:
        :class:`HeadLossOutput`.
    """
    num_heads = heads.num_heads
    feats = heads.hidden(hidden)  # (K, N, d)
    weights = head_weights(num_heads, decay)
    loss = hidden.new_zeros((), dtype=torch.float32)
    ce, count, top1, top5 = [], [], [], []
    for k in range(num_heads):
        proj = heads.head_weight(k)  # (V_draft, d): own, the shared lm_head, or the truncated rows
        y = targets[:, k]  # (N,) full-vocabulary ids
        y_draft = heads.draft_targets(y)  # (N,) draft indices; outside a truncated map: not counted
        weighted = chunked_cross_entropy(
            feats[k], proj, y_draft, chunk_size, scale=weights[k]
        )  # lambda_k * CE_k
        loss = loss + weighted
        ce.append(weighted.detach() / weights[k])
        count.append((y != IGNORE_INDEX).sum())
        if with_metrics:
            hits = chunked_topk_correct(feats[k].detach(), proj.detach(), y_draft, 5, chunk_size)
            top1.append(hits[0])
            top5.append(hits[4] if hits.numel() >= 5 else hits[-1])
    zeros = torch.zeros(num_heads, dtype=torch.long, device=hidden.device)
    return HeadLossOutput(
        loss=loss,
        ce=torch.stack(ce),
        count=torch.stack(count),
        top1=torch.stack(top1) if with_metrics else zeros,
        top5=torch.stack(top5) if with_metrics else zeros,
    )


def naive_medusa_head_loss(
    heads, hidden: torch.Tensor, targets: torch.Tensor, decay: float = 0.8
) -> torch.Tensor:
    """Reference: full ``(K, N, V_draft)`` logits + ``F.cross_entropy`` (tests and benchmarks only)."""
    logits = heads(hidden)  # (K, N, V_draft)
    loss = hidden.new_zeros((), dtype=torch.float32)
    for k, w in enumerate(head_weights(heads.num_heads, decay)):
        y = heads.draft_targets(targets[:, k])
        if bool((y != IGNORE_INDEX).any()):
            loss = loss + w * F.cross_entropy(logits[k].float(), y, ignore_index=IGNORE_INDEX)
    return loss


# -- Medusa-2 pieces --------------------------------------------------------------------------------
def lm_targets(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """Next-token targets for the LM head: ``[b, t] = input_ids[b, t+1]`` where ``loss_mask[b, t+1]``.

    Returns:
        ``(B, T)`` long with ``IGNORE_INDEX`` where not trained.
    """
    valid = loss_mask.bool() & attention_mask.bool()  # (B, T)
    out = torch.full_like(input_ids, IGNORE_INDEX)
    out[:, :-1] = torch.where(valid[:, 1:], input_ids[:, 1:], IGNORE_INDEX)
    return out


def _kl_chunk(student_h: torch.Tensor, w_s: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    s = F.log_softmax((student_h @ w_s.t()).float(), dim=-1)  # (c, V)
    t = F.log_softmax(teacher_logits.float(), dim=-1)  # (c, V)
    return (t.exp() * (t - s)).sum()


def chunked_kl_to_teacher(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """Mean ``KL(p_teacher || p_student)`` of the next-token distributions over the given rows.

    Used by Medusa-2 on self-distilled data: the trainable backbone is kept close to the frozen
    original. Each chunk's student logits are recomputed in backward (activation checkpointing),
    so the peak is O(chunk * V).

    Args:
        student_hidden: ``(N, d)`` trainable backbone's last hidden state on counted rows.
        student_weight: ``(V, d)`` its lm_head.
        teacher_hidden: ``(N, d)`` frozen original's last hidden state (no grad).
        teacher_weight: ``(V, d)`` frozen original's lm_head.

    Returns:
        Scalar mean KL (0 when N == 0).
    """
    n = student_hidden.shape[0]
    total = student_hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, n, chunk_size):
        sl = slice(start, start + chunk_size)
        with torch.no_grad():
            t_logits = teacher_hidden[sl] @ teacher_weight.t()  # (c, V)
        if torch.is_grad_enabled():
            total = total + checkpoint(
                _kl_chunk, student_hidden[sl], student_weight, t_logits, use_reentrant=False
            )
        else:
            total = total + _kl_chunk(student_hidden[sl], student_weight, t_logits)
    return total / max(n, 1)


def lambda0_schedule(step: int, final: float, warmup_steps: int, kind: str) -> float:
    """Medusa-2 weight of the heads' loss at optimizer step ``step``.

    ``p = min(step / warmup_steps, 1)``; constant: ``final``; linear: ``final * p``;
    sine: ``final * sin(p * pi / 2)`` (fast start, slow finish); sine_r: ``final * (1 - cos(p * pi / 2))``
    (slow start, fast finish). All reach ``final`` at ``warmup_steps`` and stay there.
    """
    if kind == "constant" or warmup_steps <= 0:
        return final
    p = min(max(step, 0) / warmup_steps, 1.0)
    if kind == "linear":
        return final * p
    if kind == "sine":
        return final * math.sin(p * math.pi / 2)
    if kind == "sine_r":
        return final * (1.0 - math.cos(p * math.pi / 2))
    raise ValueError(f"unknown lambda0 schedule {kind!r}: constant | linear | sine | sine_r")
