"""Medusa-1 and Medusa-2: two recipes behind one interface (:class:`Recipe`).

Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads"
(arXiv:2401.10774), section 2.2: Medusa-1 trains the heads on a frozen backbone (2.2.1); Medusa-2
trains the backbone and the heads together (2.2.2).

The methods differ in two questions, and a recipe answers both:

1. Which parameters train: Medusa-1 none of the backbone (the training module freezes it and holds
   it outside its tree, so checkpoints hold the heads only); Medusa-2 every weight
   (``backbone_tuning=full``) or LoRA/QLoRA adapters injected into it.
2. The loss (:meth:`Recipe.training_module`, the module the Trainer optimises): Medusa-1
   ``sum_k lambda_k L_k`` of the heads (``L_k`` the ``training.head_loss``: CE on the generated
   token, or KL/TV to the backbone's distribution); Medusa-2 ``L_LM + lambda_0(t) * sum_k lambda_k L_k``
   (LM loss: KL to the frozen original or CE on the data), with the lambda_0 warm-up and the
   optional heads-only phase as Trainer callbacks and the heads at ``lr * head_lr_multiplier``.

What follows from question 1 is answered by the same object, so stage=train stays one code path:
``trains_backbone`` (the backbone loads trainable), ``precision`` (mixed precision only for a
trainable backbone), ``trained_backbone`` (None, or the module to publish beside the heads in
``heads/backbone``), ``decoding_backbone`` (the model that folder holds, to calibrate with), and the
published folder's extra part (``is_published``, ``published_backbone``). From question 2,
``reads_distribution``: whether the loss reads the backbone's next-token distribution from
``lm_head(h)`` (the stage then checks that what it reads is what the backbone's forward gives).

:class:`Medusa1Recipe` and :class:`Medusa2Recipe` implement the interface independently (neither
derives from the other; Medusa-2's pieces are plain functions in ``training/medusa2.py``). The stage
takes the recipe of ``training.mode`` from :func:`recipe_for` (:data:`RECIPES`) once and never
branches on the mode; the training module takes the recipe's answers as data.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn
from transformers import TrainerCallback
from transformers.utils import CONFIG_NAME

from medusa_train.backbone import load_configured_backbone, load_trained_backbone
from medusa_train.backbone_source import ADAPTER_CONFIG
from medusa_train.heads import MedusaHeads
from medusa_train.training import medusa2
from medusa_train.training.losses import HeadLoss
from medusa_train.training.model import MedusaTrainingModel
from medusa_train.training.trainer import Lambda0Callback
from medusa_train.training.zero import whole_numel
from medusa_train.workdir import TRAINED_BACKBONE

if TYPE_CHECKING:  # annotations only: config imports Hydra, which this module must not need
    from medusa_train.config import Config
    from medusa_train.head_targets import LogitMap


class Recipe(Protocol):
    """What stage=train asks of a Medusa variant; built from the whole config (``recipe(cfg)``)."""

    trains_backbone: bool
    """Whether the backbone is among the trained parameters (loaded trainable, published, calibrated with)."""
    head_lr_multiplier: float
    """Heads lr = ``training.lr`` x this."""
    head_loss: HeadLoss
    """The heads' loss (``training.head_loss``, ``training.head_loss_temperature``)."""

    def check(self) -> None:
        """Fail before any heavy work on settings this recipe does not run."""
        ...

    def precision(self, model_dtype: torch.dtype) -> torch.dtype:
        """The training precision (DeepSpeed's config and ``TrainingArguments(bf16=, fp16=)`` agree on it)."""
        ...

    def training_module(
        self,
        heads: MedusaHeads,
        backbone: nn.Module | None,
        lm_head: torch.Tensor | None = None,
        logit_map: LogitMap | None = None,
    ) -> tuple[MedusaTrainingModel, list[TrainerCallback], dict]:
        """The module the Trainer optimises, its callbacks and extra result fields.

        Args:
            heads: the heads to train.
            backbone: the loaded backbone, or None when training from the hidden-state cache.
            lm_head: ``(V, d)`` the frozen backbone's lm_head weight, when training from the cache
                (a soft head loss reads the backbone's distribution through it).
            logit_map: with ``lm_head``: what the backbone's forward does to ``lm_head(h)``
                (:func:`medusa_train.head_targets.logit_map`).
        """
        ...

    def reads_distribution(self) -> tuple[str, str] | None:
        """What of the loss reads the backbone's next-token distribution from ``lm_head(h)`` through
        :func:`medusa_train.head_targets.logit_map` (soft head targets, Medusa-2's LM loss) and the
        settings that read none, each named for a message; None: nothing does (hard targets only)."""
        ...

    def trained_backbone(self, module: MedusaTrainingModel) -> nn.Module | None:
        """The backbone as training left it, to publish; None when it did not train."""
        ...

    def rebuild_trained(self, state: dict[str, torch.Tensor], device) -> nn.Module:
        """The trained backbone again, from the consolidated weights ``state`` of a ZeRO-3 run."""
        ...

    def decoding_backbone(self, trained: nn.Module) -> nn.Module:
        """The plain causal LM to calibrate with, from :meth:`trained_backbone`'s module: the weights
        export ships and eval decodes with. Called once ``trained`` is saved (it may be consumed)."""
        ...

    def is_published(self, heads_dir: Path) -> bool:
        """Whether ``heads_dir`` holds this recipe's part beyond the heads files."""
        ...

    def published_backbone(self, heads_dir: Path, base: nn.Module, device) -> nn.Module:
        """The backbone to calibrate the heads published in ``heads_dir`` with; ``base`` the loaded one."""
        ...


class Medusa1Recipe:
    """Medusa-1: the heads train on a frozen backbone.

    Args:
        cfg: the whole config (``cfg.training``).
    """

    trains_backbone = False
    head_lr_multiplier = 1.0  # only the heads train: ``training.lr`` is theirs

    def __init__(self, cfg) -> None:
        self.tc = cfg.training
        self.head_loss = HeadLoss.from_spec(self.tc.head_loss, self.tc.head_loss_temperature)

    def check(self) -> None:
        """Nothing to refuse: every setting the config accepts runs."""

    def precision(self, model_dtype: torch.dtype) -> torch.dtype:
        """fp32 heads on (cast) hidden states of the frozen backbone, whatever its dtype."""
        return torch.float32

    def training_module(
        self,
        heads: MedusaHeads,
        backbone: nn.Module | None,
        lm_head: torch.Tensor | None = None,
        logit_map: LogitMap | None = None,
    ) -> tuple[MedusaTrainingModel, list[TrainerCallback], dict]:
        """The heads' loss on the frozen backbone's (or the cache's) hidden states; no callbacks."""
        module = MedusaTrainingModel(
            heads,
            backbone,
            backbone_trainable=False,
            decay=self.tc.decay,
            chunk_size=self.tc.loss_chunk_size,
            head_loss=self.head_loss,
            lm_head=lm_head if backbone is None else None,
            logit_map=logit_map if backbone is None else None,
        )
        return module, [], {}

    def reads_distribution(self) -> tuple[str, str] | None:
        """The soft head targets of a soft ``training.head_loss``; None with ``ce`` alone."""
        if not self.head_loss.soft:
            return None
        return (
            f"the soft head targets of training.head_loss={self.tc.head_loss}",
            "train on hard targets (training.head_loss=ce)",
        )

    def trained_backbone(self, module: MedusaTrainingModel) -> None:
        """None: the backbone did not train."""
        return None

    def rebuild_trained(self, state: dict[str, torch.Tensor], device) -> nn.Module:
        """Not reached: with no trained backbone ZeRO-3 gathers no backbone state."""
        raise AssertionError("Medusa-1 trains no backbone to rebuild")

    def decoding_backbone(self, trained: nn.Module) -> nn.Module:
        """``trained`` itself (not reached: :meth:`trained_backbone` is None)."""
        return trained

    def is_published(self, heads_dir: Path) -> bool:
        """True: Medusa-1 publishes nothing beyond the heads files."""
        return True

    def published_backbone(self, heads_dir: Path, base: nn.Module, device) -> nn.Module:
        """``base``, the frozen backbone itself."""
        return base


class Medusa2Recipe:
    """Medusa-2: the backbone (full, LoRA or QLoRA) trains together with the heads.

    Args:
        cfg: the whole config (``cfg.training``, ``cfg.model``, ``cfg.deepspeed``).
    """

    trains_backbone = True

    def __init__(self, cfg) -> None:
        self.cfg, self.tc = cfg, cfg.training
        self.head_loss = HeadLoss.from_spec(self.tc.head_loss, self.tc.head_loss_temperature)
        self.head_lr_multiplier = self.tc.head_lr_multiplier  # the heads are new, the backbone trained
        self.loaded_dtypes: dict[str, torch.dtype] = {}
        """The backbone's parameter dtypes as loaded (set by :meth:`training_module`; QLoRA casts some)."""

    def check(self) -> None:
        """Refuse combinations this implementation does not run (see ``medusa2.check_supported``)."""
        medusa2.check_supported(self.cfg)

    def precision(self, model_dtype: torch.dtype) -> torch.dtype:
        """The model dtype: bf16/fp16 mixed precision for the trainable backbone on GPU."""
        return model_dtype

    def training_module(
        self,
        heads: MedusaHeads,
        backbone: nn.Module | None,
        lm_head: torch.Tensor | None = None,
        logit_map: LogitMap | None = None,
    ) -> tuple[MedusaTrainingModel, list[TrainerCallback], dict]:
        """``L_LM + lambda_0(t) * L_heads``; the lambda_0 warm-up (and heads-only phase) as callbacks.

        The backbone trains whole (full) or through LoRA/QLoRA adapters injected in place; the KL's
        frozen original is taken before it turns trainable (``medusa2.lm_loss``).
        """
        tc = self.tc
        self.loaded_dtypes = {name: param.dtype for name, param in backbone.named_parameters()}
        lm_loss = medusa2.lm_loss(tc, backbone)
        trainable = medusa2.trainable_backbone(tc, backbone)
        module = MedusaTrainingModel(
            heads,
            trainable,
            backbone_trainable=True,
            lm_loss=lm_loss,
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
        n_trainable = sum(whole_numel(p) for p in trainable.parameters() if p.requires_grad)
        return module, callbacks, {"backbone_trainable_params": n_trainable}

    def reads_distribution(self) -> tuple[str, str] | None:
        """The LM loss (CE on the data and KL to the original alike), and the soft head targets of a
        soft ``training.head_loss``."""
        soft = (
            f" and the soft head targets of training.head_loss={self.tc.head_loss}"
            if self.head_loss.soft
            else ""
        )
        return (
            f"Medusa-2's LM loss (training.lm_loss={self.tc.lm_loss}){soft}",
            "train Medusa-1 heads on hard targets (training=medusa1 training.head_loss=ce)",
        )

    def trained_backbone(self, module: MedusaTrainingModel) -> nn.Module:
        """The module that trained: a peft model with LoRA/QLoRA (``save_pretrained`` writes the
        adapter only), the backbone itself with full tuning."""
        return module.backbone

    def rebuild_trained(self, state: dict[str, torch.Tensor], device) -> nn.Module:
        """The trained backbone as it trained (LoRA: the same peft wrapping), from the base checkpoint
        loaded again and the consolidated weights ``state`` of a ZeRO-3 run (adapters and base alike)."""
        base, _ = load_configured_backbone(self.cfg.model, device, trainable=True)
        backbone = medusa2.trainable_backbone(self.tc, base)
        backbone.load_state_dict(state)
        return backbone

    def decoding_backbone(self, trained: nn.Module) -> nn.Module:
        """Full tuning: the trained model. LoRA/QLoRA: the adapters merged into the base in place, in
        the dtypes it loaded in (``medusa2.merged_backbone``): what export and eval make of the saved
        adapter (QLoRA: as eval, over the quantized base; export merges into an unquantized one), not
        the model with the adapters on the side, whose extra matmuls per layer time otherwise. Consumes
        ``trained``'s adapters: save it first."""
        if self.tc.backbone_tuning == "full":
            return trained
        return medusa2.merged_backbone(trained, self.loaded_dtypes)

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


RECIPES: dict[str, type[Medusa1Recipe] | type[Medusa2Recipe]] = {
    "medusa1": Medusa1Recipe,
    "medusa2": Medusa2Recipe,
}
"""The recipe of each ``training.mode``."""


def recipe_for(cfg: Config) -> Recipe:
    """The recipe of ``cfg.training.mode`` (medusa1 | medusa2)."""
    return RECIPES[cfg.training.mode](cfg)
