"""The module the trainer optimises: backbone + Medusa heads -> loss and per-head metrics.

Cai et al., "Medusa" (arXiv:2401.10774): Medusa-1 trains the heads on a frozen backbone; Medusa-2
trains both, with ``L = L_LM + lambda_0(t) * L_medusa``. The module knows no recipe: it takes what
differs as data (``backbone_trainable``, an ``lm_loss`` or None), which ``training/recipes.py``
chooses.

A frozen backbone (``backbone_trainable=False``) is held *outside* the module tree (see
``_Frozen``), so ``state_dict()``, ``parameters()``, DeepSpeed/DDP wrapping and every trainer
checkpoint contain the heads only -- checkpoints stay small and ZeRO never shards or touches the
frozen weights. It is frozen by :func:`medusa_train.backbone.frozen` and runs without gradient; its
decoder's last hidden state (what ``lm_head`` reads, checked per architecture in the tests;
:func:`medusa_train.head_targets.last_hidden_state`) feeds the heads. With a hidden-state cache the module
has no backbone at all and takes ``hidden_states``/``targets`` rows directly (and, for a soft head
loss, ``sources`` into those rows plus the frozen lm_head given at construction).

Soft head losses (``head_loss`` with ``kl``/``tv``): head k at position t compares with
``softmax(map(lm_head(h_{t+k})) / T)`` (:func:`medusa_train.head_targets.soft_target_sources`), read from
the same forward's hidden states, detached; with a trainable backbone that is the backbone as it trains.
``map`` is what the backbone's forward does to ``lm_head(h)`` before its logits (Gemma-2's softcap,
Cohere's and Granite's scales: :func:`medusa_train.head_targets.logit_map`), so the target is the
distribution the backbone decodes from; the LM losses read their logits through it too.

A trainable backbone (optionally LoRA-wrapped) is a registered submodule. With an ``lm_loss``
(:func:`lm_cross_entropy`, or :class:`KLToOriginal`: KL to the frozen original) the loss is
``lm_loss + lambda0 * heads' loss``; ``lambda0`` is set from outside each step (see
``training.trainer.Lambda0Callback``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from medusa_train.backbone import frozen
from medusa_train.head_targets import (
    IGNORE_INDEX,
    LogitMap,
    language_model,
    last_hidden_state,
    logit_map,
    medusa_targets,
    select_trained_rows,
    soft_target_sources,
)
from medusa_train.training.losses import (
    CE_LOSS,
    HeadLoss,
    SoftTargets,
    StepCounts,
    chunked_cross_entropy,
    chunked_kl_to_teacher,
    lm_targets,
    medusa_head_loss,
)


@dataclass
class _Frozen:
    """Holds a module without registering it as a submodule (not in state_dict / parameters)."""

    module: nn.Module | None


@dataclass(frozen=True)
class LMRows:
    """One batch's trained rows, as an :class:`LMLoss` reads them."""

    rows: torch.Tensor
    """``(N, d)`` the backbone's last hidden state at the trained positions."""
    targets: torch.Tensor
    """``(N,)`` their next tokens (``IGNORE_INDEX``: no LM target)."""
    input_ids: torch.Tensor
    """``(B, T)`` the batch."""
    attention_mask: torch.Tensor
    """``(B, T)``, 0 on padding."""
    selected_by: torch.Tensor
    """``(B, T, C)`` the targets ``rows`` were selected by (selects the same rows again)."""
    denominator: float | None = None
    """What the summed loss is divided by: the LM rows of the whole optimizer step (gradient
    accumulation; :class:`StepCounts`), or None: this batch's counted rows."""


class LMLoss(Protocol):
    """Medusa-2's ``L_LM`` of one batch: :func:`lm_cross_entropy` or :class:`KLToOriginal`."""

    def __call__(self, backbone: nn.Module, batch: LMRows, chunk_size: int) -> torch.Tensor:
        """The loss (a scalar) of ``backbone`` (as it trains) on ``batch``, ``chunk_size`` rows per chunk."""
        ...


def lm_cross_entropy(backbone: nn.Module, batch: LMRows, chunk_size: int) -> torch.Tensor:
    """``L_LM`` = CE of the backbone's next-token prediction on the data (an :class:`LMLoss`)."""
    lm_head = backbone.get_output_embeddings().weight  # (V, d)
    return chunked_cross_entropy(
        batch.rows.to(lm_head.dtype),
        lm_head,
        batch.targets,
        chunk_size,
        denominator=batch.denominator,
        logit_map=logit_map(backbone),
    )


@contextlib.contextmanager
def _eval_mode(module: nn.Module) -> Iterator[None]:
    """``module`` in eval mode inside the block, but for bitsandbytes' 4-bit linear layers, which are in
    training mode there (no dropout in them: their mode only decides whether they repack); every
    submodule's own mode back afterwards."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    for m, _ in modes:
        if _repacks_in_eval(m):
            m.training = True
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def _repacks_in_eval(module: nn.Module) -> bool:
    """bitsandbytes' ``Linear4bit``: its first eval-mode forward without gradients on a CPU with
    AVX512-BF16 repacks its weight in place for another kernel, which ZeRO-3's checkpoint save then
    fails to unpack from the partitioned (empty) weight; in training mode it computes the same."""
    return type(module).__module__.startswith("bitsandbytes.") and hasattr(
        module, "support_avx512bf16_for_cpu"
    )


@torch.no_grad()
def lm_head_input_mismatch(backbone: nn.Module, input_ids: torch.Tensor) -> str | None:
    """Whether ``backbone``'s LM head reads its decoder's last hidden state ``h``, what the heads read
    (:func:`~medusa_train.head_targets.last_hidden_state`), as its forward runs on ``input_ids``: None
    when it does (or a positive multiple of it: MiniCPM3 divides ``h`` by its ``logits_scaling`` first;
    or the forward does not call its LM head as a module, where nothing says otherwise), else what it
    reads instead (a clause for a message): the output of a prediction head between the two (ELECTRA,
    RemBERT, ModernBERT's decoder, the BERT family's causal LMs), of the same width or not.

    One forward, as :func:`logit_map_mismatch`'s. Compared in float32 within 8 rounding steps of the
    LM head's input dtype at its magnitude.

    Args:
        backbone: a Hugging Face causal LM (or a peft model around one), whole (not ZeRO-3 partitioned).
        input_ids: ``(1, T)`` a few tokens, on the backbone's device.
    """
    _, h, x = _lm_head_forward(backbone, input_ids)
    if x is None:
        return None
    h = h[:, -x.shape[1] :] if x.dim() == h.dim() else h  # (1, T', d): logits_to_keep keeps the last T'
    if x.shape != h.shape:
        width = f"{x.shape[-1]}-wide vectors, not its decoder's {h.shape[-1]}-wide last hidden state"
        return f"its LM head reads {width}"
    xf, hf = x.float(), h.float()  # (1, T', d)
    factor = float((xf * hf).sum() / (hf * hf).sum().clamp_min(torch.finfo(torch.float32).tiny))
    err = float((xf - factor * hf).abs().amax())
    if factor > 0 and err <= 8 * torch.finfo(x.dtype).eps * float(xf.abs().amax()):
        return None
    return "its LM head reads other vectors than its decoder's last hidden state"


@torch.no_grad()
def logit_map_mismatch(backbone: nn.Module, input_ids: torch.Tensor) -> str | None:
    """Whether ``logit_map(backbone)(lm_head(h))``, the logits the soft head targets and the LM losses
    read, gives the distribution ``backbone``'s own forward gives on ``input_ids``: None when it does,
    else by how much it does not (a clause for a message).

    One forward (:func:`_lm_head_forward`); ``h`` is what the language model under its LM head
    (:func:`~medusa_train.head_targets.language_model`, which :func:`last_hidden_state` calls) returned
    inside it. An LM head that reads vectors of another width than ``h`` is that clause
    (:func:`lm_head_input_mismatch`).
    Compared in float32 up to a constant per position (the softmax does not see one), within 8 rounding
    steps of the coarser of the logits' and ``lm_head``'s dtype at the logits' magnitude: a bfloat16
    forward rounds its own cap or scale, and a step whose effect stays below that is lost in it anyway.

    Args:
        backbone: a Hugging Face causal LM (or a peft model around one), whole (not ZeRO-3 partitioned).
        input_ids: ``(1, T)`` a few tokens, on the backbone's device.
    """
    logits, h, _ = _lm_head_forward(backbone, input_ids)
    lm_head = backbone.get_output_embeddings()
    if h.shape[-1] != lm_head.weight.shape[1]:
        width = (
            f"{lm_head.weight.shape[1]}-wide vectors, not its decoder's {h.shape[-1]}-wide last hidden state"
        )
        return f"its LM head reads {width}"
    z = lm_head(h[:, -logits.shape[1] :])  # (1, T', V)
    if z.shape != logits.shape:
        return f"its logits are {tuple(logits.shape)}, lm_head(h) {tuple(z.shape)}"
    mapped, got = logit_map(backbone)(z.float()), logits.float()  # (1, T', V)
    scale = float(torch.maximum(mapped.abs().amax(), got.abs().amax()))
    # a constant per position changes no distribution
    mapped, got = mapped - mapped.amax(dim=-1, keepdim=True), got - got.amax(dim=-1, keepdim=True)
    err = float((mapped - got).abs().amax())
    eps = max(torch.finfo(z.dtype).eps, torch.finfo(logits.dtype).eps)
    if err <= 8 * eps * scale:
        return None
    step = _formula(logit_map(backbone))
    return f"its logits differ from {step} by up to {err:.3g} where they reach {scale:.3g}"


def _lm_head_forward(
    backbone: nn.Module, input_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One forward of ``backbone`` on ``input_ids`` ``(1, T)``, in eval mode (4-bit layers in training
    mode: they would repack in eval mode): ``(logits (1, T', V), h (1, T, d), x)``, ``h`` the last
    hidden state its language model returned inside it (or, for a forward that does not call it, the
    one training reads, apart), ``x`` ``(1, T', d')`` what its LM head read (None: not called as a
    module)."""
    mask = torch.ones_like(input_ids)  # (1, T)
    caught: list[torch.Tensor] = []
    read: list[torch.Tensor] = []
    decoder = language_model(backbone)
    hook = decoder.register_forward_hook(lambda m, args, out: caught.append(out.last_hidden_state))
    head_hook = backbone.get_output_embeddings().register_forward_pre_hook(
        lambda m, args, kwargs: read.append(args[0] if args else next(iter(kwargs.values()))),
        with_kwargs=True,
    )
    try:
        with _eval_mode(backbone):
            logits = backbone(input_ids=input_ids, attention_mask=mask, use_cache=False).logits  # (1, T', V)
            if not caught:  # a forward that does not call its decoder: the state training reads, apart
                caught.append(last_hidden_state(backbone, input_ids, mask))
    finally:
        hook.remove()
        head_hook.remove()
    return logits, caught[0], read[0] if read else None


def _formula(step: LogitMap) -> str:
    """``step`` of ``lm_head(h)`` as a formula: ``30 * tanh(lm_head(h) / 30)``, ``0.0625 * lm_head(h)``."""
    z = "lm_head(h)" if step.scale == 1.0 else f"{step.scale:g} * lm_head(h)"
    return f"{step.softcap:g} * tanh({z} / {step.softcap:g})" if step.softcap is not None else z


class KLToOriginal:
    """``L_LM`` = KL from the frozen original's next-token distribution to the backbone's (an
    :class:`LMLoss`; the paper's choice on self-distilled data).

    Args:
        teacher: the original, frozen here and held outside the training module (full tuning: a
            copy taken before the backbone turns trainable), or None: the backbone itself with its
            LoRA adapters disabled, in eval mode for that forward (the original is a fixed function,
            as the frozen copy is: with the backbone's dropout on, its distribution would be a random
            draw, and the KL of the original to itself not 0).
    """

    def __init__(self, teacher: nn.Module | None = None) -> None:
        self.teacher = frozen(teacher) if teacher is not None else None

    def __call__(self, backbone: nn.Module, batch: LMRows, chunk_size: int) -> torch.Tensor:
        lm_head = backbone.get_output_embeddings().weight  # (V, d)
        rows = batch.rows.to(lm_head.dtype)  # (N, d)
        keep_lm = batch.targets != IGNORE_INDEX  # (N,)
        with torch.no_grad():
            teacher = self.teacher
            with contextlib.ExitStack() as original:
                if teacher is None:  # LoRA: the original is the same model with adapters off, no dropout
                    teacher = backbone
                    original.enter_context(backbone.disable_adapter())
                    original.enter_context(_eval_mode(backbone))
                t_h = last_hidden_state(teacher, batch.input_ids, batch.attention_mask)  # (B, T, d)
                t_w = teacher.get_output_embeddings().weight  # (V, d)
            t_rows, _ = select_trained_rows(t_h, batch.selected_by)  # (N, d), same rows as the student
        return chunked_kl_to_teacher(
            rows[keep_lm],
            lm_head,
            t_rows[keep_lm].to(rows.dtype),
            t_w,
            chunk_size,
            batch.denominator,
            logit_map(backbone),  # the original's: the same architecture
        )


class MedusaTrainingModel(nn.Module):
    """Backbone + heads, returning the training loss and per-head metrics.

    Args:
        heads: :class:`medusa_train.heads.MedusaHeads`.
        backbone: the causal LM, or None when training from cached hidden states (frozen only).
        backbone_trainable: False: the backbone is frozen (:func:`frozen`), held unregistered and
            run without gradient (Medusa-1); True: a registered submodule that trains (Medusa-2).
        decay: head-loss weights lambda_k = decay^(k-1).
        chunk_size: rows per chunk of the fused cross-entropy.
        lm_loss: None (the heads' loss only), or the backbone's :class:`LMLoss` added to it
            (needs a trainable backbone): ``loss = lm_loss + lambda0 * heads' loss``.
        lambda0: with ``lm_loss``: initial weight of the heads' loss (updated each step by the trainer).
        with_metrics: count top-1/top-5 hits in training forwards too (one extra no-grad logits pass).
        head_loss: the heads' loss terms and target temperature (:class:`HeadLoss`; default CE).
        lm_head: ``(V, d)`` the frozen backbone's lm_head weight, for a soft head loss trained from the
            hidden-state cache (held unregistered); with a backbone its own lm_head is read.
        logit_map: with ``lm_head``: what the backbone's forward does to ``lm_head(h)`` before its logits
            (:func:`medusa_train.head_targets.logit_map` of the backbone); with a backbone it is read from it.

    ``forward`` returns a dict: ``loss`` (scalar), ``head_ce`` / ``head_count`` / ``head_top1`` /
    ``head_top5`` (each ``(K,)``, detached; top-k are hit counts), with ``lm_loss`` ``lm_loss``
    (this batch's mean, detached), and ``loss_sums`` / ``loss_rows`` (each ``(2K + 1,)``, detached, in
    :meth:`loss_counts`' layout): every loss term summed over this batch's rows it counts (the head
    terms times their weight in ``head_loss``; the LM loss 0 when not trained) and those rows, which
    summed over batches give the per-token means the trainer logs.

    Gradient accumulation: the trainer counts every loss term's rows over the whole optimizer step
    (:meth:`loss_counts` of each micro-batch, summed over them and over ranks) and hands the sums to
    ``forward`` (``step_counts``): each micro-batch's loss is then its share of the step's per-token
    mean, and the shares add up to what one micro-batch of the step's size gives.
    """

    accepts_loss_kwargs = True
    """Tells the Hugging Face Trainer that the loss is normalised over the optimizer step already
    (``step_counts``), so it must not divide it by the accumulation steps again."""

    def __init__(
        self,
        heads: nn.Module,
        backbone: nn.Module | None = None,
        *,
        backbone_trainable: bool = False,
        decay: float = 0.8,
        chunk_size: int = 1024,
        lm_loss: LMLoss | None = None,
        lambda0: float = 0.2,
        with_metrics: bool = True,
        head_loss: HeadLoss = CE_LOSS,
        lm_head: torch.Tensor | None = None,
        logit_map: LogitMap | None = None,
    ) -> None:
        super().__init__()
        if backbone_trainable and backbone is None:
            raise ValueError("a trainable backbone needs the backbone")
        if lm_loss is not None and not backbone_trainable:
            raise ValueError("an LM loss trains the backbone: backbone_trainable=True")
        if head_loss.soft and backbone is None and lm_head is None:
            raise ValueError("a soft head loss from cached hidden states needs the backbone's lm_head")
        self.heads = heads
        self.backbone_trainable = backbone_trainable
        self.decay = decay
        self.chunk_size = chunk_size
        self.lm_loss = lm_loss
        self.lambda0 = lambda0
        self.with_metrics = with_metrics
        self.head_loss = head_loss
        self._lm_head = _Frozen(lm_head.detach() if lm_head is not None else None)
        self._logit_map = logit_map if logit_map is not None else LogitMap()
        self.heads_only = False
        """Two-stage Medusa-2: True while only the heads train (backbone forward without gradient, no LM loss)."""
        if backbone_trainable:
            self.backbone = backbone
        else:
            self._frozen = _Frozen(frozen(backbone) if backbone is not None else None)

    @property
    def frozen_backbone(self) -> nn.Module | None:
        """The frozen backbone (None with a trainable one, or when training from cached hidden states)."""
        return None if self.backbone_trainable else self._frozen.module

    def _backbone(self) -> nn.Module:
        """The backbone, frozen or trainable."""
        return self.backbone if self.backbone_trainable else self._frozen.module

    def directly_read_weights(self) -> list[nn.Parameter]:
        """Weights the loss reads without calling their module (ZeRO-3 must gather them for it): each
        head's own ``(V, d)`` projection (the fused loss; shared heads have none), and with an LM
        loss the backbone's lm_head."""
        weights = [
            self.heads.proj(k).weight
            for k in range(self.heads.num_heads)
            if self.heads.head_projection != "shared"
        ]
        if self.lm_loss is not None:
            weights.append(self.backbone.get_output_embeddings().weight)
        return weights

    def train(self, mode: bool = True) -> MedusaTrainingModel:
        super().train(mode)
        if self.frozen_backbone is not None:
            self.frozen_backbone.eval()  # dropout off: the frozen backbone is a fixed function
        return self

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        sources: torch.Tensor | None = None,
        step_counts: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Loss of one batch.

        Args:
            input_ids: ``(B, T)`` right-padded tokens (online training).
            attention_mask: ``(B, T)``, 0 on padding.
            loss_mask: ``(B, T)``, 1 on tokens the backbone generated.
            hidden_states: ``(N, d)`` cached last hidden states of trained rows (instead of input_ids).
            targets: ``(N, K)`` their head targets (with ``hidden_states``).
            sources: ``(N, K)`` rows of ``hidden_states`` holding each head's soft-target state
                (with ``hidden_states`` and a soft head loss; ``IGNORE_INDEX`` = not counted).
            step_counts: ``(2K + 1,)`` the summed :meth:`loss_counts` of the optimizer step's
                micro-batches (all ranks), or None: each term is this batch's mean.

        Returns:
            Dict described in the class docstring.
        """
        k = self.heads.num_heads
        counts = StepCounts.from_tensor(step_counts, k) if step_counts is not None else None
        soft = None
        if hidden_states is not None:
            rows, row_targets = hidden_states, targets  # (N, d), (N, K)
            lm_rows_targets = None
            if self.head_loss.soft:
                if sources is None:
                    raise ValueError(
                        "a soft head loss from cached rows needs their sources (a cache built soft)"
                    )
                soft = SoftTargets(hidden_states, sources, self._lm_head.module, self._logit_map)
        else:
            if attention_mask is None:
                attention_mask = torch.ones_like(input_ids)
            tgt = medusa_targets(input_ids, loss_mask, attention_mask, k)  # (B, T, K)
            backbone = self._backbone()
            grad = self.backbone_trainable and not self.heads_only
            with torch.set_grad_enabled(torch.is_grad_enabled() and grad):
                h = last_hidden_state(backbone, input_ids, attention_mask)  # (B, T, d)
            if self.lm_loss is not None:
                lm_t = lm_targets(input_ids, loss_mask, attention_mask)  # (B, T)
                tgt = torch.cat([lm_t[..., None], tgt], dim=-1)  # (B, T, 1+K)
            src = None
            if self.head_loss.soft:  # the same rows' soft-target positions, as extra columns
                src = soft_target_sources(tgt[..., -k:])  # (B, T, K)
                tgt = torch.cat([tgt, src], dim=-1)  # (B, T, [1+]K+K)
            rows, all_targets = select_trained_rows(h, tgt)  # (N, d), (N, [1+]K[+K])
            if src is not None:
                all_targets, row_sources = all_targets[:, :-k], all_targets[:, -k:]  # ..., (N, K)
                tgt = tgt[..., :-k]
                lm_head = backbone.get_output_embeddings().weight.detach()  # (V, d)
                soft = SoftTargets(
                    h.detach().reshape(-1, h.shape[-1]), row_sources, lm_head, logit_map(backbone)
                )
            if self.lm_loss is not None:
                lm_rows_targets, row_targets = all_targets[:, 0], all_targets[:, 1:]  # (N,), (N, K)
            else:
                row_targets = all_targets
        head_rows = rows.to(self.heads.dtype)
        out = medusa_head_loss(
            self.heads,
            head_rows,
            row_targets,
            self.decay,
            self.chunk_size,
            self.with_metrics,
            head_loss=self.head_loss,
            soft=soft,
            step_counts=counts,
        )
        result = {
            "loss": out.loss,
            "head_ce": out.ce,
            "head_count": out.count,
            "head_top1": out.top1,
            "head_top5": out.top5,
        }
        lm_sum, lm_rows = out.sums.new_zeros(()), out.rows.new_zeros(())
        if self.lm_loss is not None and not self.heads_only:
            denominator = counts.lm if counts is not None else None
            batch = LMRows(rows, lm_rows_targets, input_ids, attention_mask, tgt, denominator)
            lm = self.lm_loss(self.backbone, batch, self.chunk_size)
            # lm = its sum / (the step's rows, else this batch's): the sum back, as a tensor (no host read)
            lm_rows = (lm_rows_targets != IGNORE_INDEX).sum()
            lm_sum = lm.detach() * (lm_rows.clamp_min(1) if denominator is None else max(denominator, 1))
            result["lm_loss"] = lm_sum / lm_rows.clamp_min(1)
            result["loss"] = lm + self.lambda0 * out.loss
        result["loss_sums"] = torch.cat([out.sums.flatten(), lm_sum[None]])  # (2K + 1,)
        result["loss_rows"] = torch.cat([out.rows.flatten(), lm_rows[None]])  # (2K + 1,)
        return result

    def loss_counts(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The rows each loss term counts in ``batch`` (the collated inputs of :meth:`forward`).

        Returns:
            ``(2K + 1,)`` float: per head the targets its CE counts (truncated heads: those in the draft
            vocabulary), per head the rows its soft terms count, the rows the LM loss counts (0 without
            one); the layout of :class:`StepCounts`.
        """
        k = self.heads.num_heads
        lm = None
        if "targets" in batch:  # rows of the hidden-state cache
            targets = batch["targets"]  # (N, K)
        else:
            ids, loss_mask = batch["input_ids"], batch["loss_mask"]
            attention_mask = batch.get("attention_mask")
            if attention_mask is None:
                attention_mask = torch.ones_like(ids)
            targets = medusa_targets(ids, loss_mask, attention_mask, k).reshape(-1, k)  # (B*T, K)
            if self.lm_loss is not None:
                lm = lm_targets(ids, loss_mask, attention_mask)  # (B, T)
        ce = (self.heads.draft_targets(targets) != IGNORE_INDEX).sum(dim=0)  # (K,)
        soft = (targets != IGNORE_INDEX).sum(dim=0)  # (K,)
        lm_rows = (lm != IGNORE_INDEX).sum() if lm is not None else soft.new_zeros(())
        return torch.cat([ce, soft, lm_rows[None]]).float()
