"""The module the trainer optimises: backbone + Medusa heads -> loss and per-head metrics.

Cai et al., "Medusa" (arXiv:2401.10774): Medusa-1 trains the heads on a frozen backbone; Medusa-2
trains both, with ``L = L_LM + lambda_0(t) * L_medusa``.

Medusa-1: the frozen backbone is held *outside* the module tree (see ``_Frozen``), so
``state_dict()``, ``parameters()``, DeepSpeed/DDP wrapping and every trainer checkpoint contain the
heads only -- checkpoints stay small and ZeRO never shards or touches the frozen weights. The
backbone runs under ``torch.no_grad()`` and its decoder's last hidden state (what ``lm_head`` reads,
checked per architecture in the tests; :func:`medusa_train.head_targets.last_hidden_state`) feeds the heads. With a hidden-state cache the module has no
backbone at all and takes ``hidden_states``/``targets`` rows directly (and, for a soft head loss,
``sources`` into those rows plus the frozen lm_head given at construction).

Soft head losses (``head_loss`` with ``kl``/``tv``): head k at position t compares with
``softmax(lm_head(h_{t+k}) / T)`` (:func:`medusa_train.head_targets.soft_target_sources`), read from the
same forward's hidden states, detached; in Medusa-2 that is the backbone as it trains.

Medusa-2: the backbone (optionally LoRA-wrapped) is a registered submodule; the LM loss is CE on
the data or KL to the frozen original (a frozen copy, or the LoRA model with adapters disabled);
``lambda0`` is set from outside each step (see ``training.trainer.Lambda0Callback``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from medusa_train.head_targets import (
    IGNORE_INDEX,
    last_hidden_state,
    medusa_targets,
    select_trained_rows,
    soft_target_sources,
)
from medusa_train.training.losses import (
    CE_LOSS,
    HeadLoss,
    SoftTargets,
    chunked_cross_entropy,
    chunked_kl_to_teacher,
    lm_targets,
    medusa_head_loss,
)


@dataclass
class _Frozen:
    """Holds a module without registering it as a submodule (not in state_dict / parameters)."""

    module: nn.Module | None


class MedusaTrainingModel(nn.Module):
    """Backbone + heads, returning the training loss and per-head metrics.

    Args:
        heads: :class:`medusa_train.heads.MedusaHeads`.
        backbone: the causal LM, or None when training from cached hidden states (Medusa-1 only).
        mode: medusa1 (frozen backbone, not registered) | medusa2 (trainable, registered).
        decay: head-loss weights lambda_k = decay^(k-1).
        chunk_size: rows per chunk of the fused cross-entropy.
        lm_loss: medusa2: kl | ce.
        teacher: medusa2 with lm_loss=kl and full tuning: the frozen original model (held unregistered).
            None with LoRA: the teacher is the same model with its adapters disabled.
        lambda0: medusa2: initial weight of the heads' loss (updated each step by the trainer).
        with_metrics: count top-1/top-5 hits in training forwards too (one extra no-grad logits pass).
        head_loss: the heads' loss terms and target temperature (:class:`HeadLoss`; default CE).
        lm_head: ``(V, d)`` the frozen backbone's lm_head weight, for a soft head loss trained from the
            hidden-state cache (held unregistered); with a backbone its own lm_head is read.

    ``forward`` returns a dict: ``loss`` (scalar), ``head_ce`` / ``head_count`` / ``head_top1`` /
    ``head_top5`` (each ``(K,)``, detached; top-k are hit counts), and for medusa2 ``lm_loss``.
    """

    def __init__(
        self,
        heads: nn.Module,
        backbone: nn.Module | None = None,
        *,
        mode: str = "medusa1",
        decay: float = 0.8,
        chunk_size: int = 1024,
        lm_loss: str = "kl",
        teacher: nn.Module | None = None,
        lambda0: float = 0.2,
        with_metrics: bool = True,
        head_loss: HeadLoss = CE_LOSS,
        lm_head: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if mode not in ("medusa1", "medusa2"):
            raise ValueError(f"mode={mode!r}")
        if mode == "medusa2" and backbone is None:
            raise ValueError("medusa2 needs the backbone")
        self.mode = mode
        self.heads = heads
        self.decay = decay
        self.chunk_size = chunk_size
        self.lm_loss = lm_loss
        self.lambda0 = lambda0
        self.with_metrics = with_metrics
        self.head_loss = head_loss
        if head_loss.soft and backbone is None and lm_head is None:
            raise ValueError("a soft head loss from cached hidden states needs the backbone's lm_head")
        self._lm_head = _Frozen(lm_head.detach() if lm_head is not None else None)
        self.backbone_frozen = False
        """medusa2 two-stage: True while only the heads train (backbone forward under no_grad, no LM loss)."""
        self._teacher = _Frozen(teacher)
        if mode == "medusa1":
            if backbone is not None:
                backbone.eval()
                backbone.requires_grad_(False)
            self._frozen = _Frozen(backbone)
        else:
            self.backbone = backbone

    @property
    def frozen_backbone(self) -> nn.Module | None:
        """The Medusa-1 backbone (None in medusa2 or when training from cached hidden states)."""
        return self._frozen.module if self.mode == "medusa1" else None

    def directly_read_weights(self) -> list[nn.Parameter]:
        """Weights the loss reads without calling their module (ZeRO-3 must gather them for it): each
        head's own ``(V, d)`` projection (the fused loss; shared heads have none), and in medusa2 the
        backbone's lm_head (LM loss)."""
        weights = [
            self.heads.proj(k).weight
            for k in range(self.heads.num_heads)
            if self.heads.head_projection != "shared"
        ]
        if self.mode == "medusa2":
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

        Returns:
            Dict described in the class docstring.
        """
        k = self.heads.num_heads
        soft = None
        if hidden_states is not None:
            rows, row_targets = hidden_states, targets  # (N, d), (N, K)
            lm_rows_targets = None
            if self.head_loss.soft:
                if sources is None:
                    raise ValueError(
                        "a soft head loss from cached rows needs their sources (a cache built soft)"
                    )
                soft = SoftTargets(hidden_states, sources, self._lm_head.module)
        else:
            if attention_mask is None:
                attention_mask = torch.ones_like(input_ids)
            tgt = medusa_targets(input_ids, loss_mask, attention_mask, k)  # (B, T, K)
            if self.mode == "medusa1":
                with torch.no_grad():
                    h = last_hidden_state(self.frozen_backbone, input_ids, attention_mask)  # (B, T, d)
                lm_rows_targets = None
            else:
                with torch.set_grad_enabled(torch.is_grad_enabled() and not self.backbone_frozen):
                    h = last_hidden_state(self.backbone, input_ids, attention_mask)  # (B, T, d)
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
                backbone = self.frozen_backbone if self.mode == "medusa1" else self.backbone
                lm_head = backbone.get_output_embeddings().weight.detach()  # (V, d)
                soft = SoftTargets(h.detach().reshape(-1, h.shape[-1]), row_sources, lm_head)
            if self.mode == "medusa2":
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
        )
        result = {
            "loss": out.loss,
            "head_ce": out.ce,
            "head_count": out.count,
            "head_top1": out.top1,
            "head_top5": out.top5,
        }
        if self.mode == "medusa2" and not self.backbone_frozen:
            lm = self._lm_loss(input_ids, attention_mask, rows, lm_rows_targets, tgt)
            result["lm_loss"] = lm.detach()
            result["loss"] = lm + self.lambda0 * out.loss
        return result

    # -- medusa2 ---------------------------------------------------------------------------------
    def _lm_loss(self, input_ids, attention_mask, rows, lm_rows_targets, tgt) -> torch.Tensor:
        lm_head = self.backbone.get_output_embeddings().weight  # (V, d)
        rows = rows.to(lm_head.dtype)
        if self.lm_loss == "ce":
            return chunked_cross_entropy(rows, lm_head, lm_rows_targets, self.chunk_size)
        keep_lm = lm_rows_targets != IGNORE_INDEX  # (N,)
        with torch.no_grad():
            teacher, ctx = self._teacher.module, contextlib.nullcontext()
            if teacher is None:  # LoRA: the original is the same model with adapters off
                teacher, ctx = self.backbone, self.backbone.disable_adapter()
            with ctx:
                t_h = last_hidden_state(teacher, input_ids, attention_mask)  # (B, T, d)
                t_w = teacher.get_output_embeddings().weight  # (V, d)
            t_rows, _ = select_trained_rows(t_h, tgt)  # (N, d), same rows as the student
        return chunked_kl_to_teacher(
            rows[keep_lm], lm_head, t_rows[keep_lm].to(rows.dtype), t_w, self.chunk_size
        )
