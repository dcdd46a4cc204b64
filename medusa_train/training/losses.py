"""Medusa losses, computed in vocabulary chunks so no ``(T, V)`` logits tensor ever lives whole.

Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads"
(arXiv:2401.10774), section 2.2.

Medusa-1 loss::

    L = sum_k lambda_k * CE(head_k(h_t), y_{t+k+1}),   lambda_k = decay^(k-1),   k = 1..K

Which positions count: the prediction head k makes at position t is a prediction of token
``t+k+1``; it is trained iff ``loss_mask[t+k+1] == 1`` (the target is a token the backbone
generated), ``t+k+1`` lies inside the (unpadded) sequence and no reply ends within ``t .. t+k``
(:func:`medusa_train.head_targets.medusa_targets`, the one definition the held-out accuracy of
decoding/calibrate.py shares). Each head's CE is the
mean over its counted positions in the batch; a head with no counted position contributes 0. Under
gradient accumulation the batch is the optimizer step's: each micro-batch's summed loss is divided by
the step's count (``denominator``, counted over every micro-batch and rank by the trainer), so the
micro-batches add up to the per-token mean of the whole step, as one micro-batch of its size would
give, rather than a mean of the micro-batches' means (which weighs a token of a short micro-batch
more than one of a long one).

Memory: a naive implementation materialises ``(K, B, T, V)`` logits plus their softmax and
gradient. :class:`ChunkedLinearCrossEntropy` instead walks over ``chunk_size`` rows at a time,
computes the ``(chunk, V)`` logits, the loss *and already the gradient* w.r.t. the features and
the projection weight (the fused "linear + cross-entropy" trick), and drops the logits. Backward
then only scales the stored gradients by the incoming scalar. Peak extra memory is
O(chunk * V + V * d) instead of O(T * V), and the flop count equals the naive version's
(one logits matmul + two gradient matmuls), so it is not slower.

Precision in fp16: the gradients are made in forward, before the upstream gradient (an fp16 loss
scale, 65,536 at first under DeepSpeed or torch's GradScaler) is known. The gradient w.r.t. the
logits, ``softmax - onehot`` divided by the count, has most entries below fp16's smallest normal
number (6.1e-5): cast to fp16 as it is, they lose their precision or flush to zero, and the
gradients with them (percents of relative error; figures in docs/training.md). So for fp16 operands
(:func:`_add_logit_grads`) each row of that gradient is multiplied by its own power of two for the
features' product, each column by its own for the weight's, the largest that keeps every operand
and product entry below 2^14; the fp16 products are divided back in fp32 (exact: powers of two)
and accumulated in fp32 buffers, which stay fp32 until backward has multiplied them by the
upstream gradient and casts them once: as accurate as fp32 gradients scaled and cast once, up to
the operands' one extra rounding. The price, fp16 only: the stored ``(N, d)`` and ``(V, d)``
gradients take twice an fp16 copy's memory from forward to backward, and a chunk a few more
element-wise passes over its ``(chunk, V)`` block (the scales). bf16 (fp32's exponent range) and
fp32 keep buffers of their own dtype and no scaling. Computing the gradient products in fp32
instead is as accurate but needs an fp32 copy of the ``(V, d)`` weight and runs two of the three
matmuls off the GPU's fp16 tensor cores.

Head projection variants (:mod:`medusa_train.heads`): ``shared`` heads use the backbone's lm_head as
every head's projection (no gradient for it from the heads' loss, only the residual blocks train);
``truncated`` heads project to a draft vocabulary of N tokens, and a target outside that vocabulary
is **not counted** in the CE (the EAGLE-3 convention, where positions whose target falls outside the
draft vocabulary are masked out of the loss). An "other" bucket would teach the head to spend
probability on a candidate the decoder can never propose, and vLLM's layout has no row for one. It
still counts as a miss in the top-k metrics (``count`` covers every full-vocabulary target), so
accuracies compare across variants.

Soft-label head losses (``training.head_loss=kl|tv|<mixture>``, grammar in
:mod:`medusa_train.head_loss`): head k's prediction at position t is compared with the backbone's own
next-token distribution at position ``t+k``, ``p = softmax(map(lm_head(h_{t+k})) / T)`` -- the
distribution of exactly the token ``t+k+1`` that the hard label is a sample of (same positions
counted); ``map`` is what the backbone's forward does to ``lm_head(h)`` before its logits (a softcap or
a scale: :class:`medusa_train.head_targets.LogitMap`, which the LM losses read their logits through too). ``kl`` is
``KL(p || q)``, ``tv`` is ``0.5 * sum |p - q|``, q the head's softmax. Shared heads compare over the
full vocabulary; truncated heads compare with p renormalised on their draft vocabulary (p restricted
to ``token_map`` and divided by its mass there), so a head is never asked for a token it cannot
propose. The target carries no gradient (for Medusa-2 it is the backbone being trained, detached).
:class:`ChunkedLinearSoftLoss` walks over rows *and* vocabulary chunks: a first pass streams the two
log-sum-exps (head and target), a second computes the loss and the gradient w.r.t. the logits
(``q - p`` for KL; TV needs ``sum_i sign(q_i - p_i) q_i`` first, so it takes a third pass), so the
peak extra memory is O(chunk * vocab_chunk) whatever V is. With one vocabulary chunk the logits of
the first pass are kept and no pass recomputes them.

Also here: the LM losses Medusa-2 adds (CE on data, KL to
the frozen original), and the lambda_0 warm-up schedules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from medusa_train.head_loss import SOFT_LOSSES, is_soft, parse_head_loss
from medusa_train.head_targets import IGNORE_INDEX, LogitMap, chunked_topk_correct

# -- the gradients the fused losses make in forward ------------------------------------------------
_FP16_RANGE = 2.0**14
"""Bound on every entry of a pre-scaled fp16 gradient product, its operand and its output (fp16's
largest number is 65,504: a factor 4 of headroom for rounding)."""


def _grad_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a chunked loss keeps an input's gradient in from forward to backward: fp32 for fp16
    (the loss scale comes later; see the module docstring), the input's own otherwise."""
    return torch.float32 if dtype == torch.float16 else dtype


def _pow2_scales(bound: torch.Tensor) -> torch.Tensor:
    """The largest power of two ``s`` with ``s * bound <= _FP16_RANGE``, per entry, in ``[2^-60, 2^60]``
    (``2^60`` where ``bound`` is 0)."""
    return torch.exp2(torch.log2(_FP16_RANGE / bound).floor_().clamp_(-60, 60))


def _add_logit_grads(
    g: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    grad_feats: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
    w_max: torch.Tensor | None,
) -> None:
    """Back through ``logits = x @ w.T``: ``grad_feats += g @ w`` and ``grad_weight += g.T @ x``.

    Args:
        g: ``(c, vc)`` fp32 gradient w.r.t. the logits (already weighted by the loss's scale).
        x: ``(c, d)`` and w: ``(vc, d)``, the logits' operands, both in the matmul dtype.
        grad_feats: ``(c, d)`` rows of the features' gradient buffer, or None.
        grad_weight: ``(vc, d)`` rows of the weight's fp32 gradient buffer, or None.
        w_max: fp16 with grad_feats: ``max(max |weight|, 1)`` over the whole weight (fp32 scalar tensor).

    In fp16 the products run on row- and column-scaled copies of ``g`` (module docstring): with
    ``s_i = 2^k <= _FP16_RANGE / (|g_i|_1 * w_max)`` every entry of ``s_i g_i`` and of ``s_i g_i @ w``
    is at most ``_FP16_RANGE`` (w_max >= 1 bounds the first), and alike for the columns with ``x``.
    """
    if w.dtype != torch.float16:
        g = g.to(w.dtype)  # (c, vc)
        if grad_feats is not None:
            grad_feats += g @ w  # (c, d)
        if grad_weight is not None and w.dtype == torch.float32:
            grad_weight.addmm_(g.t(), x)  # (vc, d) in place: no (vc, d) temporary per chunk
        elif grad_weight is not None:
            grad_weight += (g.t() @ x).float()  # (vc, d), fp32 accumulation of bf16 products
        return
    h = torch.empty_like(g, dtype=torch.float16)  # (c, vc) the scaled fp16 operand, rows then columns
    if grad_feats is not None:
        s = _pow2_scales(torch.linalg.vector_norm(g, 1, dim=1) * w_max)  # (c,)
        torch.mul(g, s[:, None], out=h)  # rounded once, from fp32
        grad_feats.addcmul_(h @ w, s.reciprocal_()[:, None])  # (c, d) divided back in fp32
    if grad_weight is not None:
        x_max = torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32).clamp_min_(1)
        t = _pow2_scales(torch.linalg.vector_norm(g, 1, dim=0) * x_max)  # (vc,)
        torch.mul(g, t, out=h)
        grad_weight.addcmul_(h.t() @ x, t.reciprocal_()[:, None])  # (vc, d)


def _weight_max(weight: torch.Tensor) -> torch.Tensor | None:
    """``max(max |weight|, 1)`` as an fp32 scalar tensor for an fp16 weight (:func:`_add_logit_grads`)."""
    if weight.dtype != torch.float16:
        return None
    return torch.linalg.vector_norm(weight, float("inf"), dtype=torch.float32).clamp_min_(1)


def _stored_grads(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The (features, weight) gradients a chunked loss's forward computed, scaled by ``grad_out``.

    The usual upstream gradient is exactly 1 (the weight lambda_k is applied inside via ``scale``):
    then gradients kept in their input's dtype are handed over as they are, and the context drops its
    reference. Otherwise the product is taken in fp32 (an fp16 loss scale of 65,536 is inf in fp16
    itself, though the scaled gradients are not); fp32 buffers of fp16 inputs are cast once, here.
    """
    grads = ctx.grads
    del ctx.grads
    scale = None if bool(grad_out == 1) else grad_out.float()
    out = []
    for grad, dtype in zip(grads, ctx.dtypes, strict=True):
        if grad is not None and scale is not None:
            grad = grad.float().mul_(scale)  # a copy, or the buffer no one else holds now
        out.append(grad.to(dtype) if grad is not None else None)
    return out[0], out[1]


# -- fused chunked linear + cross-entropy -----------------------------------------------------------
class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean CE of ``feats @ weight.T`` against ``targets`` without materialising the logits.

    Forward computes, chunk by chunk, the loss and (if gradients are needed) the gradients w.r.t.
    ``feats`` and ``weight``; backward scales them by the incoming gradient. Rows whose target is
    ``IGNORE_INDEX`` contribute nothing. Returns the mean over counted rows (0 if none), or their sum
    divided by ``denominator`` when given. With a ``logit_map`` the logits are ``logit_map(feats @ weight.T)``.
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
        denominator: float | None = None,
        logit_map: LogitMap | None = None,
    ):
        # feats (N, d), weight (V, d), targets (N,)
        n = feats.shape[0]
        valid = targets != IGNORE_INDEX  # (N,)
        count = int(valid.sum())
        needs_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_feats = (
            torch.zeros_like(feats, dtype=_grad_dtype(feats.dtype)) if ctx.needs_input_grad[0] else None
        )
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        w_max = _weight_max(weight) if grad_feats is not None else None
        total = torch.zeros((), dtype=torch.float32, device=feats.device)
        scale = scale / max(count if denominator is None else denominator, 1)
        for start in range(0, n, chunk_size):
            x = feats[start : start + chunk_size]  # (c, d)
            y = targets[start : start + chunk_size]  # (c,)
            ok = y != IGNORE_INDEX  # (c,)
            if not bool(ok.any()):
                continue
            if x.dtype != weight.dtype:  # fp32 heads over a bf16 lm_head (shared heads): no (V, d) copy
                x = x.to(weight.dtype)
            logits, slope = (x @ weight.t()).float(), 1.0  # (c, V)
            if logit_map is not None:
                logits, slope = logit_map.with_slope_(logits)  # slope: d logits / d (x @ weight.T)
            lse = torch.logsumexp(logits, dim=-1)  # (c,)
            y_safe = y.clamp_min(0)
            target_logit = logits.gather(1, y_safe[:, None]).squeeze(1)  # (c,)
            total += ((lse - target_logit) * ok).sum()
            if needs_grad:
                # d CE / d logits = softmax - onehot, on counted rows only, pre-divided by the count.
                probs = logits.sub_(lse[:, None]).exp_()  # (c, V), reuses the logits buffer
                probs[torch.arange(len(y), device=y.device), y_safe] -= 1.0
                probs *= (ok.float() * scale)[:, None]
                if not isinstance(slope, float) or slope != 1.0:
                    probs *= slope
                rows = grad_feats[start : start + chunk_size] if grad_feats is not None else None
                _add_logit_grads(probs, x, weight, rows, grad_weight, w_max)
            del logits
        # Kept as plain attributes, not save_for_backward: backward hands them over and drops its
        # reference, so autograd can adopt them as .grad without another (V, d) copy.
        ctx.grads = (
            grad_feats,
            grad_weight.to(_grad_dtype(weight.dtype)) if grad_weight is not None else None,
        )
        ctx.dtypes = (feats.dtype, weight.dtype)
        return total * scale

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        return (*_stored_grads(ctx, grad_out), None, None, None, None, None)


def chunked_cross_entropy(
    feats: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int = 1024,
    scale: float = 1.0,
    denominator: float | None = None,
    logit_map: LogitMap | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of ``feats @ weight.T`` over rows whose target is not ``IGNORE_INDEX``.

    Args:
        feats: ``(N, d)`` features (a head's residual-block output, or the backbone's last hidden state).
        weight: ``(V, d)`` vocab projection.
        targets: ``(N,)`` long, ``IGNORE_INDEX`` = not counted.
        chunk_size: rows per chunk; peak extra memory ~ ``chunk_size * V`` floats.
        scale: multiply the loss by this (e.g. lambda_k) inside the fused op, so the upstream
            gradient is 1 and the stored gradients are handed over without a copy.
        denominator: divide the summed CE by this instead of by the counted rows (gradient
            accumulation: the counted rows of the whole optimizer step).
        logit_map: what the backbone's forward does to ``feats @ weight.T`` (the LM loss of a backbone
            whose logits are capped or scaled: :func:`medusa_train.head_targets.logit_map`); None: nothing.

    Returns:
        ``scale`` * scalar loss (0 when no row counts), differentiable w.r.t. ``feats`` and ``weight``.
    """
    if not torch.is_grad_enabled():  # evaluation: skip the gradient work inside forward
        feats, weight = feats.detach(), weight.detach()
    if logit_map is not None and logit_map.is_identity:
        logit_map = None
    return ChunkedLinearCrossEntropy.apply(feats, weight, targets, chunk_size, scale, denominator, logit_map)


# -- fused chunked linear + soft-label loss ---------------------------------------------------------
class ChunkedLinearSoftLoss(torch.autograd.Function):
    """Mean ``kl`` or ``tv`` of ``softmax(feats @ weight.T)`` against the backbone's distribution,
    chunked over rows and vocabulary, without materialising either ``(N, V)`` logits tensor.

    The target of row i is ``p_i = softmax(target_map(target_feats[i] @ target_weight[token_map].T) / temperature)``
    (``token_map`` None: every row of ``target_weight``). Gradients w.r.t. ``feats`` and ``weight`` are
    computed in forward, as in :class:`ChunkedLinearCrossEntropy`; the target gets none.
    """

    @staticmethod
    def forward(
        ctx,
        feats: torch.Tensor,
        weight: torch.Tensor,
        target_feats: torch.Tensor,
        target_weight: torch.Tensor,
        token_map: torch.Tensor | None,
        kind: str,
        temperature: float,
        chunk_size: int,
        vocab_chunk_size: int,
        scale: float,
        denominator: float | None = None,
        target_map: LogitMap | None = None,
    ):
        # feats (N, d), weight (V', d), target_feats (N, d), target_weight (V, d), token_map (V',)
        n, v = feats.shape[0], weight.shape[0]
        needs_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_feats = (
            torch.zeros_like(feats, dtype=_grad_dtype(feats.dtype)) if ctx.needs_input_grad[0] else None
        )
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        w_max = _weight_max(weight) if grad_feats is not None else None
        total = torch.zeros((), dtype=torch.float32, device=feats.device)
        scale = scale / max(n if denominator is None else denominator, 1)
        spans = [(v0, min(v0 + vocab_chunk_size, v)) for v0 in range(0, v, vocab_chunk_size)]
        for start in range(0, n, chunk_size):
            x = feats[start : start + chunk_size]  # (c, d)
            if x.dtype != weight.dtype:
                x = x.to(weight.dtype)
            y = target_feats[start : start + chunk_size].to(target_weight.dtype)  # (c, d)
            rows = grad_feats[start : start + chunk_size] if grad_feats is not None else None

            def add_grad(v0: int, v1: int, g: torch.Tensor, x=x, rows=rows) -> None:
                # g (c, vc): d loss / d head logits, unscaled
                cols = grad_weight[v0:v1] if grad_weight is not None else None
                _add_logit_grads(g.mul_(scale), x, weight[v0:v1], rows, cols, w_max)

            chunk = _SoftChunk(x, y, weight, target_weight, token_map, temperature, spans, target_map)
            total += chunk.run(kind, add_grad if needs_grad else None)
        ctx.grads = (
            grad_feats,
            grad_weight.to(_grad_dtype(weight.dtype)) if grad_weight is not None else None,
        )
        ctx.dtypes = (feats.dtype, weight.dtype)
        return total * scale

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        return (*_stored_grads(ctx, grad_out), None, None, None, None, None, None, None, None, None, None)


class _SoftChunk:
    """One row chunk of :class:`ChunkedLinearSoftLoss`: the two log-sum-exps streamed over vocabulary
    chunks (pass 1), then the loss and the gradient w.r.t. the head logits chunk by chunk.

    Args:
        x: ``(c, d)`` head features; y: ``(c, d)`` target hidden states; weight: ``(V', d)``;
        target_weight: ``(V, d)``; token_map: ``(V',)`` or None; spans: vocabulary chunks ``[(v0, v1)]``;
        target_map: applied to the target logits before the temperature, or None.
    """

    def __init__(
        self, x, y, weight, target_weight, token_map, temperature: float, spans, target_map=None
    ) -> None:
        self.x, self.y, self.weight, self.target_weight = x, y, weight, target_weight
        self.token_map, self.temperature, self.spans = token_map, temperature, spans
        self.target_map = target_map
        self.lse_z = x.new_full((x.shape[0],), float("-inf"), dtype=torch.float32)  # (c,)
        self.lse_u = self.lse_z.clone()  # (c,)
        self.kept = None  # one vocabulary chunk: its logits, reused by every later pass
        for v0, v1 in spans:
            z, u = self._logits(v0, v1)
            self.lse_z = torch.logaddexp(self.lse_z, torch.logsumexp(z, dim=-1))
            self.lse_u = torch.logaddexp(self.lse_u, torch.logsumexp(u, dim=-1))
        if len(spans) == 1:
            self.kept = (z, u)

    def _logits(self, v0: int, v1: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kept is not None:
            return self.kept
        tw = (
            self.target_weight[v0:v1] if self.token_map is None else self.target_weight[self.token_map[v0:v1]]
        )
        z = (self.x @ self.weight[v0:v1].t()).float()  # (c, vc) head logits
        u = (self.y @ tw.t()).float()  # (c, vc) target logits
        if self.target_map is not None:
            u = self.target_map(u)
        u = u / self.temperature
        return z, u

    def _probs(self, v0: int, v1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q, p)`` on ``[v0, v1)``, fresh tensors (the kept logits stay as they are)."""
        z, u = self._logits(v0, v1)
        return (z - self.lse_z[:, None]).exp_(), (u - self.lse_u[:, None]).exp_()  # (c, vc) each

    def run(self, kind: str, on_grad=None) -> torch.Tensor:
        """Summed loss of the chunk's rows, handing ``(v0, v1, d loss / d z[:, v0:v1])`` to ``on_grad``.

        ``kl`` = sum p (log p - log q), gradient ``q - p``, both in one pass over the vocabulary.
        ``tv`` = 0.5 sum |q - p|, gradient ``0.5 q_j (s_j - sum_i s_i q_i)`` with ``s = sign(q - p)``:
        the sum needs the whole vocabulary first, so the gradient takes a second pass.
        """
        total = torch.zeros((), dtype=torch.float32, device=self.x.device)
        if kind == "kl":
            for v0, v1 in self.spans:
                z, u = self._logits(v0, v1)  # used once more at most: normalised in place
                log_q, log_p = z.sub_(self.lse_z[:, None]), u.sub_(self.lse_u[:, None])  # (c, vc) each
                p = log_p.exp()
                total += (p * log_p.sub_(log_q)).sum()
                if on_grad is not None:
                    on_grad(v0, v1, log_q.exp_().sub_(p))  # q - p
            return total
        s_q = torch.zeros_like(self.lse_z)  # (c,) sum_i s_i q_i
        for v0, v1 in self.spans:
            q, p = self._probs(v0, v1)
            diff = q - p  # (c, vc)
            total += 0.5 * diff.abs().sum()
            s_q += (diff.sign_() * q).sum(dim=-1)
        if on_grad is not None:
            for v0, v1 in self.spans:
                q, p = self._probs(v0, v1)
                on_grad(v0, v1, (q - p).sign_().sub_(s_q[:, None]).mul_(q).mul_(0.5))
        return total


def chunked_soft_loss(
    feats: torch.Tensor,
    weight: torch.Tensor,
    target_feats: torch.Tensor,
    target_weight: torch.Tensor,
    kind: str,
    *,
    token_map: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    vocab_chunk_size: int = 32768,
    scale: float = 1.0,
    denominator: float | None = None,
    target_map: LogitMap | None = None,
) -> torch.Tensor:
    """Mean soft-label loss of the head ``feats @ weight.T`` against the backbone's distribution.

    Args:
        feats: ``(N, d)`` head features of the counted rows.
        weight: ``(V', d)`` the head's vocab projection (V' = V, or the draft vocabulary's N).
        target_feats: ``(N, d)`` backbone hidden states whose next-token distribution is each row's target.
        target_weight: ``(V, d)`` the backbone's lm_head (no gradient).
        kind: ``kl`` (forward ``KL(p || q)``) | ``tv`` (``0.5 * sum |p - q|``).
        token_map: ``(V',)`` full-vocabulary id of each draft index (truncated heads): the target is
            renormalised on these tokens; None: ``V' == V``.
        temperature: the target's softmax temperature (> 0).
        chunk_size: rows per chunk; vocab_chunk_size: vocabulary entries per chunk. Peak extra memory
            ~ a few ``chunk_size * vocab_chunk_size`` floats.
        scale: multiply the loss by this (lambda_k) inside the fused op.
        denominator: divide the summed loss by this instead of by N (gradient accumulation: the
            counted rows of the whole optimizer step).
        target_map: what the backbone's forward does to ``target_feats @ target_weight.T`` before its
            logits (:func:`medusa_train.head_targets.logit_map`), applied before the temperature; None: nothing.

    Returns:
        ``scale`` * scalar mean over the N rows (0 when N == 0), differentiable w.r.t. ``feats`` and ``weight``.
    """
    if kind not in SOFT_LOSSES:
        raise ValueError(f"soft loss {kind!r}: expected one of {SOFT_LOSSES}")
    if not torch.is_grad_enabled():
        feats, weight = feats.detach(), weight.detach()
    if token_map is not None:
        token_map = token_map.to(target_weight.device)
    return ChunkedLinearSoftLoss.apply(
        feats,
        weight,
        target_feats.detach(),
        target_weight.detach(),
        token_map,
        kind,
        temperature,
        chunk_size,
        vocab_chunk_size,
        scale,
        denominator,
        None if target_map is None or target_map.is_identity else target_map,
    )


def naive_soft_loss(
    logits: torch.Tensor, target_logits: torch.Tensor, kind: str, temperature: float = 1.0
) -> torch.Tensor:
    """Reference: mean ``kl``/``tv`` from whole ``(N, V')`` head and target logits (tests, benches).

    ``target_logits`` are already restricted to the head's vocabulary (truncated: its ``token_map``
    columns), so the softmax below is the renormalised target.
    """
    log_q = F.log_softmax(logits.float(), dim=-1)  # (N, V')
    log_p = F.log_softmax(target_logits.detach().float() / temperature, dim=-1)  # (N, V')
    if kind == "kl":
        per_row = (log_p.exp() * (log_p - log_q)).sum(-1)
    elif kind == "tv":
        per_row = 0.5 * (log_q.exp() - log_p.exp()).abs().sum(-1)
    else:
        raise ValueError(f"soft loss {kind!r}: expected one of {SOFT_LOSSES}")
    return per_row.mean() if per_row.numel() else per_row.sum()


# -- the Medusa-1 head loss -------------------------------------------------------------------------
@dataclass(frozen=True)
class HeadLoss:
    """Which loss each head trains with (``training.head_loss``, ``training.head_loss_temperature``).

    Attributes:
        terms: ``(name, weight)`` pairs from :func:`medusa_train.head_loss.parse_head_loss`; the loss is
            their weighted sum.
        temperature: softmax temperature of the backbone's distribution in the soft terms (> 0).
        vocab_chunk_size: vocabulary entries per chunk of the soft terms.
    """

    terms: tuple[tuple[str, float], ...] = (("ce", 1.0),)
    temperature: float = 1.0
    vocab_chunk_size: int = 32768

    @classmethod
    def from_spec(cls, spec: str, temperature: float = 1.0, **kwargs) -> HeadLoss:
        """``HeadLoss.from_spec("kl+0.5ce", 1.0)``."""
        return cls(parse_head_loss(spec), temperature, **kwargs)

    @property
    def soft(self) -> bool:
        """Whether a term reads the backbone's distribution (the caller must give :class:`SoftTargets`)."""
        return is_soft(self.terms)


CE_LOSS = HeadLoss()
"""The hard-label cross-entropy (``training.head_loss=ce``), the default of every head-loss argument."""


@dataclass
class SoftTargets:
    """Where head k's soft target at a row comes from: the backbone's next-token distribution at ``t+k``.

    Attributes:
        hidden: ``(M, d)`` backbone last hidden states (a pool; no gradient is taken through it).
        sources: ``(N, K)`` long: ``sources[i, k-1]`` is the row of ``hidden`` holding ``h_{t+k}`` for the
            loss row i at position t (:func:`medusa_train.head_targets.soft_target_sources`), ``IGNORE_INDEX``
            where head k does not train at row i.
        lm_head: ``(V, d)`` the backbone's lm_head weight.
        logit_map: what the backbone's forward does to ``lm_head(h)`` before its logits
            (:func:`medusa_train.head_targets.logit_map`): the target is ``softmax(logit_map(lm_head(h)) / T)``.
    """

    hidden: torch.Tensor
    sources: torch.Tensor
    lm_head: torch.Tensor
    logit_map: LogitMap = LogitMap()


@dataclass(frozen=True)
class StepCounts:
    """What each loss term is divided by under gradient accumulation: the rows it counts over the
    whole optimizer step (every micro-batch, every rank), so that the micro-batches' losses add up to
    the step's per-token mean (module docstring).

    Attributes:
        ce: per head (K), the targets its CE counts (truncated heads: those in the draft vocabulary).
        soft: per head (K), the rows its soft terms count (every target).
        lm: the rows the LM loss counts (Medusa-2; 0 without one).
    """

    ce: tuple[float, ...]
    soft: tuple[float, ...]
    lm: float

    @classmethod
    def from_tensor(cls, counts: torch.Tensor, num_heads: int) -> StepCounts:
        """From the ``(2K + 1,)`` layout ``[ce (K), soft (K), lm]`` the trainer sums and all-reduces."""
        values = [float(c) for c in counts.tolist()]
        return cls(tuple(values[:num_heads]), tuple(values[num_heads : 2 * num_heads]), values[2 * num_heads])


@dataclass
class HeadLossOutput:
    """Result of :func:`medusa_head_loss`.

    Attributes:
        loss: scalar, ``sum_k decay^(k-1) * loss_k``.
        ce: ``(K,)`` detached per-head mean of the head loss (the CE with ``head_loss=ce``).
        count: ``(K,)`` counted targets per head.
        top1: ``(K,)`` correct top-1 predictions per head (counts, not rates).
        top5: ``(K,)`` correct top-5 predictions per head.
        sums: ``(2, K)`` detached: per head, its CE term summed over the rows it counts, and its soft
            terms summed over theirs, each times its weight in ``head_loss`` (not lambda_k).
        rows: ``(2, K)`` the rows those sums count: the CE's (truncated heads: targets in the draft
            vocabulary), the soft terms' (every target). ``ce = sums[0] / rows[0] + sums[1] / rows[1]``;
            summed over several batches they give those batches' per-token mean (the trainer's logs).
    """

    loss: torch.Tensor
    ce: torch.Tensor
    count: torch.Tensor
    top1: torch.Tensor
    top5: torch.Tensor
    sums: torch.Tensor
    rows: torch.Tensor


def head_weights(num_heads: int, decay: float) -> list[float]:
    """``lambda_k = decay^(k-1)`` for k = 1..K."""
    return [decay**k for k in range(num_heads)]


def _soft_rows(soft: SoftTargets, k: int, feats_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Head k's (0-based) counted rows: its features ``(n, d)`` and the target rows ``h_{t+k+1}`` ``(n, d)``."""
    src = soft.sources[:, k]  # (N,)
    keep = (src != IGNORE_INDEX).nonzero(as_tuple=True)[0]  # (n,)
    return feats_k[keep], soft.hidden[src[keep]]


def medusa_head_loss(
    heads,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    decay: float = 0.8,
    chunk_size: int = 1024,
    with_metrics: bool = True,
    *,
    head_loss: HeadLoss = CE_LOSS,
    soft: SoftTargets | None = None,
    step_counts: StepCounts | None = None,
) -> HeadLossOutput:
    """Medusa-1 loss of ``heads`` (a :class:`medusa_train.heads.MedusaHeads`) on selected rows.

    Args:
        heads: the K heads.
        hidden: ``(N, d)`` backbone last hidden states (rows from :func:`select_trained_rows`).
        targets: ``(N, K)`` full-vocabulary ids; column k-1 is head k's target, ``IGNORE_INDEX`` = not
            counted (truncated heads: ids outside the draft vocabulary are left out of the CE).
        decay: lambda_k = decay^(k-1).
        chunk_size: rows per chunk in the fused losses.
        with_metrics: also count top-1 / top-5 hits (chunked, no grad; costs one more logits pass).
        head_loss: the terms (``ce`` and/or soft ``kl``, ``tv``) and the target temperature.
        soft: the backbone's hidden states the soft terms compare with (required when
            ``head_loss.soft``).
        step_counts: each term's counted rows over the optimizer step (gradient accumulation): the
            loss is then this micro-batch's share of the step's per-token mean; None: the mean over
            this batch. ``HeadLossOutput.ce``, ``sums`` and ``rows`` are this batch's either way.

    Returns:
        :class:`HeadLossOutput`.
    """
    if head_loss.soft and soft is None:
        raise ValueError(f"head loss {head_loss.terms} needs the backbone's hidden states (soft=SoftTargets)")
    num_heads = heads.num_heads
    feats = heads.hidden(hidden)  # (K, N, d)
    weights = head_weights(num_heads, decay)
    loss = hidden.new_zeros((), dtype=torch.float32)
    ce, count, top1, top5, sums, rows = [], [], [], [], [], []
    for k in range(num_heads):
        proj = heads.head_weight(k)  # (V_draft, d): own, the shared lm_head, or the truncated rows
        y = targets[:, k]  # (N,) full-vocabulary ids
        y_draft = heads.draft_targets(y)  # (N,) draft indices; outside a truncated map: not counted
        head_k = hidden.new_zeros((), dtype=torch.float32)
        # Per kind of term, the rows it counts here and its summed loss (logged): tensors, no host read.
        rows_k = torch.stack([(y_draft != IGNORE_INDEX).sum(), (y != IGNORE_INDEX).sum()])  # (2,) CE, soft
        sums_k = hidden.new_zeros(2, dtype=torch.float32)  # (2,) CE, soft
        for name, weight in head_loss.terms:
            kind = 0 if name == "ce" else 1  # row of sums_k / rows_k
            if name == "ce":
                denominator = step_counts.ce[k] if step_counts is not None else None
                term = chunked_cross_entropy(
                    feats[k], proj, y_draft, chunk_size, scale=weights[k] * weight, denominator=denominator
                )
            else:
                x, target_h = _soft_rows(soft, k, feats[k])  # (n, d), (n, d)
                denominator = step_counts.soft[k] if step_counts is not None else None
                term = chunked_soft_loss(
                    x,
                    proj,
                    target_h,
                    soft.lm_head,
                    name,
                    token_map=heads.token_map,
                    temperature=head_loss.temperature,
                    chunk_size=chunk_size,
                    vocab_chunk_size=head_loss.vocab_chunk_size,
                    scale=weights[k] * weight,
                    denominator=denominator,
                    target_map=soft.logit_map,
                )
            head_k = head_k + term  # lambda_k * weight * sum / (the step's rows, else this batch's)
            divided_by = rows_k[kind].clamp_min(1) if denominator is None else max(denominator, 1)
            sums_k[kind] += term.detach() * divided_by / weights[k]
        loss = loss + head_k
        ce.append((sums_k / rows_k.clamp_min(1)).sum())
        sums.append(sums_k)
        rows.append(rows_k)
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
        sums=torch.stack(sums, dim=1),
        rows=torch.stack(rows, dim=1),
    )


def naive_medusa_head_loss(
    heads,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    decay: float = 0.8,
    *,
    head_loss: HeadLoss = CE_LOSS,
    soft: SoftTargets | None = None,
) -> torch.Tensor:
    """Reference: full ``(K, N, V_draft)`` logits, ``F.cross_entropy`` and :func:`naive_soft_loss`
    (tests and benchmarks only)."""
    logits = heads(hidden)  # (K, N, V_draft)
    loss = hidden.new_zeros((), dtype=torch.float32)
    for k, w in enumerate(head_weights(heads.num_heads, decay)):
        y = heads.draft_targets(targets[:, k])
        for name, weight in head_loss.terms:
            if name == "ce":
                if bool((y != IGNORE_INDEX).any()):
                    loss = loss + w * weight * F.cross_entropy(
                        logits[k].float(), y, ignore_index=IGNORE_INDEX
                    )
                continue
            src = soft.sources[:, k]  # (N,)
            keep = src != IGNORE_INDEX
            lm = soft.lm_head if heads.token_map is None else soft.lm_head[heads.token_map]  # (V_draft, d)
            target_logits = soft.logit_map(soft.hidden[src[keep]].float() @ lm.float().t())  # (n, V_draft)
            loss = loss + w * weight * naive_soft_loss(
                logits[k][keep], target_logits, name, head_loss.temperature
            )
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


def _kl_chunk(
    student_h: torch.Tensor,
    w_s: torch.Tensor,
    teacher_h: torch.Tensor,
    w_t: torch.Tensor,
    logit_map: LogitMap,
) -> torch.Tensor:
    s = F.log_softmax(logit_map((student_h @ w_s.t()).float()), dim=-1)  # (c, V)
    with torch.no_grad():  # the teacher's logits: made here, so no chunk's outlives its own KL
        t = F.log_softmax(logit_map((teacher_h @ w_t.t()).float()), dim=-1)  # (c, V)
    return (t.exp() * (t - s)).sum()


def chunked_kl_to_teacher(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    chunk_size: int = 1024,
    denominator: float | None = None,
    logit_map: LogitMap | None = None,
) -> torch.Tensor:
    """Mean ``KL(p_teacher || p_student)`` of the next-token distributions over the given rows.

    Used by Medusa-2 on self-distilled data: the trainable backbone is kept close to the frozen
    original. Each chunk's student and teacher logits are made inside the checkpointed function and
    made again in backward (activation checkpointing), so the peak is O(chunk * V): teacher logits
    handed in from outside would be kept for every chunk until backward, O(N * V).

    Args:
        student_hidden: ``(N, d)`` trainable backbone's last hidden state on counted rows.
        student_weight: ``(V, d)`` its lm_head.
        teacher_hidden: ``(N, d)`` frozen original's last hidden state (no grad).
        teacher_weight: ``(V, d)`` frozen original's lm_head.
        denominator: divide the summed KL by this instead of by N (gradient accumulation: the rows
            of the whole optimizer step).
        logit_map: what the backbone's forward does to ``lm_head(h)`` before its logits (student and
            original alike: :func:`medusa_train.head_targets.logit_map`); None: nothing.

    Returns:
        Scalar mean KL (0 when N == 0).
    """
    logit_map = logit_map if logit_map is not None else LogitMap()
    n = student_hidden.shape[0]
    total = student_hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, n, chunk_size):
        sl = slice(start, start + chunk_size)
        args = (
            student_hidden[sl],
            student_weight,
            teacher_hidden[sl].detach(),
            teacher_weight.detach(),
            logit_map,
        )
        if torch.is_grad_enabled():
            total = total + checkpoint(_kl_chunk, *args, use_reentrant=False)
        else:
            total = total + _kl_chunk(*args)
    return total / max(n if denominator is None else denominator, 1)


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
