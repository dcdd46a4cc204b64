"""Optimizer parameter groups: heads and backbone learn at different rates (Medusa-2).

Cai et al., "Medusa" (arXiv:2401.10774), section 2.2.2: the heads are new and the backbone is
already trained, so the heads get a larger learning rate (``lr * head_lr_multiplier``).
"""

from __future__ import annotations

import torch
from torch import nn


def param_groups(
    model: nn.Module, lr: float, weight_decay: float = 0.0, head_lr_multiplier: float = 1.0
) -> list[dict]:
    """AdamW groups of the trainable parameters of a :class:`MedusaTrainingModel`.

    Heads get ``lr * head_lr_multiplier``, everything else (the backbone in medusa2) ``lr``. Biases
    and 1-D parameters (norms) get no weight decay. Empty groups are dropped. Each group says
    whether it is the backbone's (``"backbone"``; see :class:`FreezableAdamW`).

    Returns:
        A list of dicts for ``torch.optim.AdamW`` / :class:`FreezableAdamW`.
    """
    groups: dict[tuple[bool, bool], list] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        is_head = name.startswith("heads.")
        decay = param.ndim >= 2
        groups.setdefault((is_head, decay), []).append(param)
    out = []
    for (is_head, decay), params in sorted(groups.items()):
        out.append(
            {
                "params": params,
                "lr": lr * (head_lr_multiplier if is_head else 1.0),
                "weight_decay": weight_decay if decay else 0.0,
                "backbone": not is_head,
            }
        )
    return out


class FreezableAdamW(torch.optim.AdamW):
    """AdamW that leaves every parameter group marked ``"frozen": True`` as it is: no update, no
    weight decay, no step counted (Medusa-2's heads-only phase marks the backbone's groups).

    Without DeepSpeed this changes nothing: the backbone runs under ``no_grad`` in that phase, its
    gradients stay None and AdamW skips it anyway. DeepSpeed (ZeRO-2/3) hands AdamW one flat
    gradient per group, zeros for the backbone: AdamW would then count those steps (a different
    bias correction once joint training starts) and apply weight decay, and the trained backbone
    would differ from a run without DeepSpeed.
    """

    def step(self, closure=None):
        for group in self.param_groups:
            if group.get("frozen", False):
                for param in group["params"]:
                    param.grad = None
        return super().step(closure)
