"""Medusa-1 and Medusa-2: the two places where the recipes differ, named once.

Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads"
(arXiv:2401.10774), section 2.2: Medusa-1 trains the heads on a frozen backbone (2.2.1); Medusa-2
trains the backbone and the heads together (2.2.2).

A recipe answers the two questions in which the methods differ:

1. Which parameters train -- :meth:`Medusa1.trainable_backbone`: Medusa-1 trains nothing of the
   backbone (frozen, in eval mode, held outside the training module so checkpoints hold the heads
   only); Medusa-2 trains every weight (``backbone_tuning=full``) or LoRA/QLoRA adapters injected
   into it.
2. The loss -- :meth:`Medusa1.training_module` builds the module the Trainer optimises: Medusa-1
   ``sum_k lambda_k L_k`` of the heads (``L_k`` the ``training.head_loss``: CE on the generated
   token, or KL/TV to the backbone's distribution); Medusa-2 ``L_LM + lambda_0(t) * sum_k lambda_k L_k``
   (LM loss: KL to the frozen original or CE on the data), with the lambda_0 warm-up and the
   optional heads-only phase as Trainer callbacks and the heads at ``lr * head_lr_multiplier``.

stage=train takes the recipe of ``training.mode`` from :func:`recipe_for` and calls it; it never
branches on the mode. What follows from question 1 is answered by the same object, so the stage
stays one code path: ``trains_backbone`` (the backbone loads trainable), :meth:`~Medusa1.precision`
(mixed precision only for a trainable backbone), :meth:`~Medusa1.trained_backbone` (None, or the
module to publish beside the heads in ``heads/backbone`` and to calibrate with), and the published
folder's extra part (:meth:`~Medusa1.is_published`, :meth:`~Medusa1.published_backbone`).
Medusa-2 is Medusa-1 with those answers overridden (:class:`Medusa2`).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import TrainerCallback
from transformers.utils import CONFIG_NAME

from medusa_train.backbone import ADAPTER_CONFIG, load_configured_backbone, load_trained_backbone
from medusa_train.heads import MedusaHeads
from medusa_train.training import medusa2
from medusa_train.training.losses import HeadLoss
from medusa_train.training.model import MedusaTrainingModel
from medusa_train.training.trainer import Lambda0Callback
from medusa_train.workdir import TRAINED_BACKBONE

if TYPE_CHECKING:  # annotations only: config imports Hydra, which this module must not need
    from medusa_train.config import Config


class Medusa1:
    """Medusa-1: the heads train on a frozen backbone.

    Args:
        cfg: the whole config (``cfg.training``, ``cfg.model``, ``cfg.deepspeed``).
    """

    trains_backbone = False
    """Whether the backbone is among the trained parameters (loaded trainable, published, calibrated with)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg, self.tc = cfg, cfg.training

    def check(self) -> None:
        """Fail before any heavy work on settings this recipe does not run (Medusa-1: none)."""

    def precision(self, model_dtype: torch.dtype) -> torch.dtype:
        """The training precision: fp32 heads on (cast) hidden states of the frozen backbone, whatever
        its dtype (DeepSpeed's config and ``TrainingArguments(bf16=, fp16=)`` must agree on it)."""
        return torch.float32

    @property
    def head_lr_multiplier(self) -> float:
        """Heads lr = ``lr`` x this (only the heads train: ``training.lr`` is theirs)."""
        return 1.0

    # -- 1. which parameters train ---------------------------------------------------------------
    def trainable_backbone(self, backbone: nn.Module) -> nn.Module | None:
        """None: no backbone parameter trains (it is frozen and put in eval mode)."""
        backbone.eval().requires_grad_(False)
        return None

    # -- 2. the loss -----------------------------------------------------------------------------
    @property
    def head_loss(self) -> HeadLoss:
        """The heads' loss (``training.head_loss``, ``training.head_loss_temperature``)."""
        return HeadLoss.from_spec(self.tc.head_loss, self.tc.head_loss_temperature)

    def training_module(
        self, heads: MedusaHeads, backbone: nn.Module | None, lm_head: torch.Tensor | None = None
    ) -> tuple[MedusaTrainingModel, list[TrainerCallback], dict]:
        """The module the Trainer optimises: the heads' loss on the frozen backbone's hidden states.

        Args:
            heads: the heads to train.
            backbone: the loaded backbone, or None when training from the hidden-state cache.
            lm_head: ``(V, d)`` the frozen backbone's lm_head weight, when training from the cache
                (a soft head loss reads the backbone's distribution through it).

        Returns:
            ``(module, callbacks, extra result fields)``.
        """
        if backbone is not None:
            self.trainable_backbone(backbone)
        module = MedusaTrainingModel(
            heads,
            backbone,
            mode="medusa1",
            decay=self.tc.decay,
            chunk_size=self.tc.loss_chunk_size,
            head_loss=self.head_loss,
            lm_head=lm_head if backbone is None else None,
        )
        return module, [], {}

    # -- what follows from 1 -----------------------------------------------------------------------
    def trained_backbone(self, module: MedusaTrainingModel) -> nn.Module | None:
        """The backbone as training left it, to publish and calibrate with; None when it did not train."""
        return None

    def decoding_backbone(self, trained: nn.Module) -> nn.Module:
        """The plain causal LM to decode (and calibrate) with, from :meth:`trained_backbone`'s module."""
        return trained

    def is_published(self, heads_dir: Path) -> bool:
        """Whether ``heads_dir`` holds this recipe's part beyond the heads files (Medusa-1: nothing)."""
        return True

    def published_backbone(self, heads_dir: Path, base: nn.Module, device) -> nn.Module:
        """The backbone to calibrate published heads with: ``base``, the frozen backbone itself."""
        return base


class Medusa2(Medusa1):
    """Medusa-2: the backbone (full, LoRA or QLoRA) trains together with the heads."""

    trains_backbone = True

    def check(self) -> None:
        """Refuse combinations this implementation does not run (see ``medusa2.check_supported``)."""
        medusa2.check_supported(self.cfg)

    def precision(self, model_dtype: torch.dtype) -> torch.dtype:
        """The model dtype: bf16/fp16 mixed precision for the trainable backbone on GPU."""
        return model_dtype

    @property
    def head_lr_multiplier(self) -> float:
        """The heads are new, the backbone is trained already: heads lr = ``lr`` x this."""
        return self.tc.head_lr_multiplier

    # -- 1. which parameters train ---------------------------------------------------------------
    def trainable_backbone(self, backbone: nn.Module) -> nn.Module:
        """Every weight (full), or a peft model with LoRA adapters injected in place (lora, qlora)."""
        return medusa2.trainable_backbone(self.tc, backbone)

    # -- 2. the loss -----------------------------------------------------------------------------
    def training_module(
        self, heads: MedusaHeads, backbone: nn.Module | None, lm_head: torch.Tensor | None = None
    ) -> tuple[MedusaTrainingModel, list[TrainerCallback], dict]:
        """``L_LM + lambda_0(t) * L_heads``; the lambda_0 warm-up (and heads-only phase) as callbacks.

        The KL teacher is the frozen original: a copy taken before the backbone turns trainable
        (full tuning), or the same model with its adapters disabled (LoRA/QLoRA).
        """
        tc = self.tc
        teacher = None
        if tc.backbone_tuning == "full" and tc.lm_loss == "kl":
            teacher = copy.deepcopy(backbone).eval().requires_grad_(False)
        trainable = self.trainable_backbone(backbone)
        module = MedusaTrainingModel(
            heads,
            trainable,
            mode="medusa2",
            lm_loss=tc.lm_loss,
            teacher=teacher,
            lambda0=0.0,
            decay=tc.decay,
            chunk_size=tc.loss_chunk_size,
            head_loss=self.head_loss,
        )
        callbacks: list[TrainerCallback] = [
            Lambda0Callback(module, tc.lambda0, tc.lambda_warmup_steps, tc.lambda_warmup, tc.heads_only_steps)
        ]
        if tc.heads_only_steps > 0:
            callbacks.append(medusa2.HeadsOnlyCallback(module, tc.heads_only_steps))
        n_trainable = sum(p.numel() for p in trainable.parameters() if p.requires_grad)
        return module, callbacks, {"backbone_trainable_params": n_trainable}

    # -- what follows from 1 -----------------------------------------------------------------------
    def trained_backbone(self, module: MedusaTrainingModel) -> nn.Module:
        """The module that trained: a peft model with LoRA/QLoRA (``save_pretrained`` writes the
        adapter only), the backbone itself with full tuning."""
        return module.backbone

    def decoding_backbone(self, trained: nn.Module) -> nn.Module:
        """LoRA/QLoRA: the base model with the adapters applied in place (peft's wrapper is not a
        plain causal LM); full tuning: the trained model."""
        return trained if self.tc.backbone_tuning == "full" else trained.get_base_model()

    def rebuild_trained(self, state: dict[str, torch.Tensor], device) -> nn.Module:
        """The trained backbone as it trained (LoRA: the same peft wrapping), from the base checkpoint
        loaded again and the consolidated weights ``state`` of a ZeRO-3 run (adapters and base alike)."""
        base, _ = load_configured_backbone(self.cfg.model, device, trainable=True)
        backbone = self.trainable_backbone(base)
        backbone.load_state_dict(state)
        return backbone

    def is_published(self, heads_dir: Path) -> bool:
        """``heads_dir/backbone`` holds the trained model, or (LoRA/QLoRA) its adapter."""
        lora = self.tc.backbone_tuning in ("lora", "qlora")
        return (heads_dir / TRAINED_BACKBONE / (ADAPTER_CONFIG if lora else CONFIG_NAME)).is_file()

    def published_backbone(self, heads_dir: Path, base: nn.Module, device) -> nn.Module:
        """The trained backbone published in ``heads_dir/backbone``: LoRA/QLoRA adapters merged into
        ``base``; full tuning loads the trained model after releasing ``base``'s weights."""
        if self.tc.backbone_tuning == "full":
            if self.cfg.model.quantization == "none":
                base.to("meta")  # the base's memory goes before the trained copy loads
            base = None
        return load_trained_backbone(self.cfg.model, heads_dir / TRAINED_BACKBONE, device, base=base)


RECIPES: dict[str, type[Medusa1]] = {"medusa1": Medusa1, "medusa2": Medusa2}


def recipe_for(cfg: Config) -> Medusa1:
    """The recipe of ``cfg.training.mode`` (medusa1 | medusa2)."""
    return RECIPES[cfg.training.mode](cfg)
