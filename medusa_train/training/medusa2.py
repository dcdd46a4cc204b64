"""Medusa-2: joint training of the backbone (full, LoRA or QLoRA) and the heads.

Cai et al., "Medusa" (arXiv:2401.10774), section 2.2.2: ``L = L_LM + lambda_0(t) * L_medusa`` with
``L_LM`` = KL to the frozen original on self-distilled data (or CE on the data), lambda_0 warmed up,
heads learning ``head_lr_multiplier`` times faster than the backbone, and optionally a heads-only
warm start of ``heads_only_steps`` steps (the paper's two-stage recipe: the lambda_0 warm-up then
starts when joint training does).

The pieces of Medusa-2 its recipe (``training/recipes.py``) assembles: the supported combinations,
the LM loss, the trainable backbone, the heads-only phase, the LoRA backbone merged after training.
"""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING

import torch
from transformers import TrainerCallback

from medusa_train.backbone import frozen, resolve_device, resolve_dtype
from medusa_train.errors import UserError
from medusa_train.training.model import KLToOriginal, LMLoss, MedusaTrainingModel, lm_cross_entropy

if TYPE_CHECKING:  # annotations only: config imports Hydra, which this module must not need
    from medusa_train.config import Config, TrainingConfig

log = logging.getLogger(__name__)


def check_supported(cfg: Config) -> None:
    """Fail before any heavy work on combinations this implementation does not run."""
    tc = cfg.training
    zero3 = cfg.deepspeed.enabled and cfg.deepspeed.zero_stage == 3
    if zero3 and tc.lm_loss == "kl" and tc.backbone_tuning == "full":
        raise UserError(
            "training=medusa2 with lm_loss=kl and full tuning keeps a whole frozen copy of the backbone on every "
            "rank, which ZeRO-3 does not shard: use deepspeed=zero2, backbone_tuning=lora, or training.lm_loss=ce"
        )
    if tc.backbone_tuning in ("lora", "qlora"):
        try:
            import peft  # noqa: F401
        except ImportError:
            raise UserError(
                f"training.backbone_tuning={tc.backbone_tuning} needs peft: pip install peft"
            ) from None
    if tc.backbone_tuning == "qlora" and cfg.model.quantization == "none":
        raise UserError(
            "training.backbone_tuning=qlora needs a quantized backbone: model.quantization=4bit (or 8bit)"
        )
    if zero3 and tc.backbone_tuning == "qlora" and cfg.model.quantization == "8bit":
        # ZeRO-3 partitions the int8 weights, but each bitsandbytes 8-bit layer keeps the whole weight
        # in its matmul state and computes with that: every rank holds it whole beside its partition.
        raise UserError(
            "training.backbone_tuning=qlora with model.quantization=8bit cannot shard the backbone under "
            "deepspeed=zero3 (bitsandbytes keeps each 8-bit weight whole on every rank): use deepspeed=zero2, "
            "or model.quantization=4bit"
        )
    if tc.backbone_tuning == "full" and not cfg.deepspeed.enabled:
        # Without DeepSpeed the Trainer's AdamW updates the loaded weights in place: no fp32 master copy.
        dtype = resolve_dtype(cfg.model.dtype, resolve_device(cfg.model.device))
        if dtype == "float16":
            raise UserError(
                "training=medusa2 with full tuning cannot train float16 weights in place (the Trainer's loss "
                "scaling refuses fp16 gradients): use model.dtype=bfloat16 or float32, "
                "training.backbone_tuning=lora, or deepspeed=zero2 (fp32 master weights)"
            )
        if dtype == "bfloat16":
            log.warning(
                "training=medusa2 with full tuning updates the bfloat16 weights in place (no fp32 master copy): "
                "updates below bfloat16's resolution are lost at small learning rates; deepspeed=zero2 keeps "
                "fp32 master weights, model.dtype=float32 trains in fp32"
            )


class HeadsOnlyCallback(TrainerCallback):
    """Two-stage Medusa-2: for the first ``steps`` optimizer steps the backbone gets no gradient and
    the optimizer leaves its groups alone (see ``training.optim.FreezableAdamW``)."""

    def __init__(self, model: MedusaTrainingModel, steps: int) -> None:
        self.model, self.steps = model, steps

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        frozen = state.global_step < self.steps
        self.model.heads_only = frozen
        # Under DeepSpeed these are its optimizer's view of our groups (training.optim.param_groups).
        for group in optimizer.param_groups:
            group["frozen"] = frozen and group["backbone"]


def lm_loss(tc: TrainingConfig, backbone: torch.nn.Module) -> LMLoss:
    """The LM loss of ``tc.lm_loss``: CE on the data, or KL to the frozen original -- with full tuning a
    copy of ``backbone`` taken now (call this before the backbone turns trainable), with LoRA/QLoRA
    the trained model itself with its adapters disabled."""
    if tc.lm_loss == "ce":
        return lm_cross_entropy
    return KLToOriginal(copy.deepcopy(backbone) if tc.backbone_tuning == "full" else None)


def trainable_backbone(tc: TrainingConfig, backbone: torch.nn.Module) -> torch.nn.Module:
    """``backbone`` made trainable as ``tc.backbone_tuning`` says, in training mode: every weight
    (full), or a peft model with LoRA adapters injected into ``backbone`` in place (lora, qlora)."""
    if tc.backbone_tuning in ("lora", "qlora"):
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

        names = [name for name, _ in backbone.named_modules()]
        missing = [t for t in tc.lora_target_modules if not any(n == t or n.endswith(f".{t}") for n in names)]
        if missing:
            linears = sorted(
                {n.rsplit(".", 1)[-1] for n, m in backbone.named_modules() if isinstance(m, torch.nn.Linear)}
            )
            raise UserError(
                f"training.lora_target_modules: {', '.join(missing)} not in the backbone (its linear layers: "
                f"{', '.join(linears)})"
            )
        if tc.backbone_tuning == "qlora":
            backbone = prepare_model_for_kbit_training(backbone, use_gradient_checkpointing=False)
            _loads_own_checkpoints(backbone)
        lora = LoraConfig(
            r=tc.lora_r,
            lora_alpha=tc.lora_alpha,
            lora_dropout=tc.lora_dropout,
            target_modules=list(tc.lora_target_modules),
            task_type="CAUSAL_LM",
        )
        backbone = get_peft_model(backbone, lora)
    else:
        backbone.requires_grad_(True)
    return backbone.train()


def _loads_own_checkpoints(backbone: torch.nn.Module) -> None:
    """Let ``backbone``'s 4-bit layers load a state dict they saved themselves, strictly.

    A 4-bit layer (bitsandbytes ``Linear4bit``) saves its quantization statistics beside its packed
    weight, as ``weight.absmax``, ``weight.quant_map``, ... (``QuantState.as_dict``), but its
    ``load_state_dict`` knows no such keys: a strict load of the training module's own checkpoint --
    how DeepSpeed resumes (``load_module_strict``) -- stops at them as unexpected. They are the frozen
    base's statistics, which the layer already holds as the base checkpoint loaded (the stage resumes
    only the same backbone, quantized the same way), so they are dropped on load.
    """
    from bitsandbytes.nn import Linear4bit

    def drop_quant_state(module, state_dict, prefix, *args) -> None:
        for key in [k for k in state_dict if k.startswith(f"{prefix}weight.")]:
            del state_dict[key]

    for module in backbone.modules():
        if isinstance(module, Linear4bit):
            module.register_load_state_dict_pre_hook(drop_quant_state)


def merged_backbone(trained: torch.nn.Module, loaded_dtypes: dict[str, torch.dtype]) -> torch.nn.Module:
    """The LoRA/QLoRA model ``trained`` (a peft model) as a plain causal LM: the adapters merged into
    the base weights in place (peft's ``merge_and_unload``, ``W + scale * B @ A``; a 4-bit weight is
    dequantized, added to and quantized again), every base parameter back in its ``loaded_dtypes``
    entry (QLoRA's ``prepare_model_for_kbit_training`` cast the 16-bit ones to fp32 for training),
    frozen. The model ``backbone.merge_adapter`` makes of the saved adapter and a freshly loaded base,
    without a second copy of the base; the adapters are gone afterwards (save them first).

    Args:
        trained: the peft model that trained.
        loaded_dtypes: ``{name: dtype}`` of the base's parameters as loaded, before LoRA wrapping.
    """
    base = trained.merge_and_unload()
    for name, param in base.named_parameters():
        if param.dtype != loaded_dtypes[name]:
            param.data = param.data.to(loaded_dtypes[name])
    return frozen(base)
