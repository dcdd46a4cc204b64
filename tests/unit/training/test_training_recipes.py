"""The Medusa-1 and Medusa-2 recipes: one interface, no shared base class, and which parameters train."""

from __future__ import annotations

import pytest
import torch

from medusa_train.config import compose_config
from medusa_train.heads import MedusaHeads
from medusa_train.training.model import KLToOriginal
from medusa_train.training.recipes import RECIPES, Recipe, recipe_for
from medusa_train.training.trainer import Lambda0Callback
from tests.helpers.training import VOCAB, batch, tiny_llama

MEMBERS = set(Recipe.__annotations__) | {
    name for name, value in vars(Recipe).items() if callable(value) and not name.startswith("_")
}


@pytest.mark.parametrize("mode", ["medusa1", "medusa2"])
def test_each_mode_has_its_own_recipe_with_the_whole_interface(mode):
    recipe = recipe_for(compose_config([f"training={mode}"]))
    assert type(recipe) is RECIPES[mode]
    assert type(recipe).__bases__ == (object,)  # no recipe derives from another
    assert {name for name in MEMBERS if not hasattr(recipe, name)} == set()
    assert recipe.trains_backbone is (mode == "medusa2")


def _heads(backbone: torch.nn.Module) -> MedusaHeads:
    heads = MedusaHeads(32, VOCAB, 2, 1)
    heads.init_from_lm_head(backbone.get_output_embeddings().weight)
    return heads


def test_medusa1_module_freezes_the_backbone_outside_its_state():
    backbone = tiny_llama().train().requires_grad_(True)
    recipe = recipe_for(compose_config(["training=medusa1"]))
    module, callbacks, extra = recipe.training_module(_heads(backbone), backbone)
    assert (callbacks, extra) == ([], {})
    assert module.frozen_backbone is backbone and not backbone.training
    assert not any(p.requires_grad for p in backbone.parameters())
    assert all(name.startswith("heads.") for name in module.state_dict())
    assert recipe.trained_backbone(module) is None


def test_medusa2_module_trains_the_backbone_against_a_frozen_copy():
    backbone = tiny_llama()
    recipe = recipe_for(compose_config(["training=medusa2", "training.lm_loss=kl"]))  # full tuning
    module, callbacks, extra = recipe.training_module(_heads(backbone), backbone)
    assert isinstance(callbacks[0], Lambda0Callback)
    assert recipe.trained_backbone(module) is backbone and backbone.training
    assert all(p.requires_grad for p in backbone.parameters())
    assert extra == {"backbone_trainable_params": sum(p.numel() for p in backbone.parameters())}
    assert isinstance(module.lm_loss, KLToOriginal)
    teacher = module.lm_loss.teacher
    assert teacher is not backbone and not teacher.training
    assert not any(p.requires_grad for p in teacher.parameters())
    assert abs(module(**batch())["lm_loss"].item()) < 1e-5  # student == original before any step
