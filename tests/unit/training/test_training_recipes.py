"""The Medusa-1 and Medusa-2 recipes: one interface, no shared base class, and which parameters train."""

from __future__ import annotations

import pytest
import torch

from medusa_train.backbone import load_configured_backbone, load_trained_backbone
from medusa_train.config import compose_config
from medusa_train.heads import MedusaHeads
from medusa_train.training.model import KLToOriginal
from medusa_train.training.recipes import RECIPES, Recipe, recipe_for
from medusa_train.training.trainer import Lambda0Callback
from tests.helpers.train_workdir import make_backbone, train_cfg
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


@pytest.mark.parametrize("tuning", ["lora", "qlora"])
def test_medusa2_decodes_with_the_adapter_merged_as_eval_merges_the_saved_one(tmp_path, tuning):
    """After LoRA/QLoRA training the recipe's decoding backbone (the calibration's) is the adapter
    merged into the weights in place: no peft layer left, and the model ``load_trained_backbone``
    makes of the saved adapter and a freshly loaded base (eval, a recalibration) -- every parameter
    in the same dtype, the same logits bit for bit. QLoRA over a bf16 4-bit base: the weights
    ``prepare_model_for_kbit_training`` cast to fp32 for training (embeddings, norms, lm_head) are
    bf16 again."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    if tuning == "qlora":
        pytest.importorskip("bitsandbytes")
    make_backbone(tmp_path / "base_model", hidden=64, kv_heads=4)  # 4-bit CPU blocks span 64 values
    quantized = ("model.quantization=4bit",) if tuning == "qlora" else ()
    cfg = train_cfg(
        tmp_path,
        "training=medusa2",
        f"training.backbone_tuning={tuning}",
        "model.dtype=bfloat16",
        *quantized,
    )
    recipe = recipe_for(cfg)
    cpu = torch.device("cpu")
    backbone, _ = load_configured_backbone(cfg.model, cpu, trainable=True)
    module, _, _ = recipe.training_module(MedusaHeads(64, VOCAB, 2, 1), backbone)
    trained = recipe.trained_backbone(module)
    torch.manual_seed(0)
    with torch.no_grad():  # a trained adapter: B = 0 would merge to nothing
        for name, param in trained.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    trained.save_pretrained(tmp_path / "adapter")
    upcast = {p.dtype for p in trained.parameters() if not p.requires_grad and p.is_floating_point()}
    assert (torch.float32 in upcast) is (tuning == "qlora")

    merged = recipe.decoding_backbone(trained)
    assert not any(isinstance(m, BaseTunerLayer) for m in merged.modules())
    fresh = load_trained_backbone(cfg.model, tmp_path / "adapter", cpu)
    dtypes = {name: p.dtype for name, p in merged.named_parameters()}
    assert dtypes == {name: p.dtype for name, p in fresh.named_parameters()}
    ids = torch.tensor([[5, 17, 3, 40, 42, 7, 60, 11]])  # (1, 8)
    with torch.no_grad():
        assert torch.equal(merged(input_ids=ids).logits, fresh(input_ids=ids).logits)
        base = load_configured_backbone(cfg.model, cpu)[0](input_ids=ids).logits
    assert not torch.equal(merged(input_ids=ids).logits.detach(), base)  # the adapter changed it
