"""Medusa-2 pieces: trainable backbone, LM loss (CE / KL to the frozen original), lambda0, LoRA,
the heads-only phase's optimizer groups, combinations refused up front."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from medusa_train.config import compose_config
from medusa_train.errors import UserError
from medusa_train.head_targets import IGNORE_INDEX, last_hidden_state, select_trained_rows
from medusa_train.heads import MedusaHeads
from medusa_train.training.losses import lm_targets
from medusa_train.training.medusa2 import HeadsOnlyCallback, check_supported, trainable_backbone
from medusa_train.training.model import KLToOriginal, LMRows, MedusaTrainingModel, lm_cross_entropy
from medusa_train.training.optim import FreezableAdamW, param_groups
from tests.helpers.training import LOGIT_STEP_ARCHS, batch, tiny_llama, tiny_logit_step_model


def _model(lm_loss: str, lora: bool = False) -> MedusaTrainingModel:
    backbone = tiny_llama()
    heads = MedusaHeads(32, 64, 2, 1)
    heads.init_from_lm_head(backbone.get_output_embeddings().weight)
    teacher = None  # LoRA: the backbone itself with its adapters disabled
    if lora:
        from peft import LoraConfig, get_peft_model

        backbone = get_peft_model(
            backbone, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        )
    else:
        backbone.requires_grad_(True)
        teacher = copy.deepcopy(backbone)
    loss = KLToOriginal(teacher) if lm_loss == "kl" else lm_cross_entropy
    return MedusaTrainingModel(heads, backbone, backbone_trainable=True, lm_loss=loss, lambda0=0.5)


@pytest.mark.parametrize(("lm_loss", "lora"), [("kl", False), ("ce", False), ("kl", True)])
def test_medusa2_trains_backbone_and_heads(lm_loss, lora):
    model = _model(lm_loss, lora)
    out = model(**batch())
    if lm_loss == "kl":  # student == teacher before any step: KL is 0
        assert abs(out["lm_loss"].item()) < 1e-5
    assert out["loss"].item() == pytest.approx(
        out["lm_loss"].item() + 0.5 * out["head_ce"][0].item() + 0.4 * out["head_ce"][1].item(), rel=1e-5
    )
    out["loss"].backward()
    trainable = [p for n, p in model.backbone.named_parameters() if p.requires_grad]
    assert trainable and all(p.grad is not None for p in trainable)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.heads.parameters())
    if lora:
        assert all("lora_" in n for n, p in model.backbone.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("arch", ["llama", *LOGIT_STEP_ARCHS])
def test_the_lm_losses_compare_the_distribution_the_backbone_forward_gives(arch):
    """CE on the data and KL to the original, in value and gradient, are those of the logits the
    backbone's forward returns, also where it changes ``lm_head(h)`` (Gemma-2's softcap, Cohere's and
    Granite's scales): what the trained backbone decodes with."""
    teacher = tiny_llama() if arch == "llama" else tiny_logit_step_model(arch)
    backbone = copy.deepcopy(teacher).requires_grad_(True)
    with torch.no_grad():  # a student a few steps away from the original: KL > 0
        for p in backbone.parameters():
            p.add_(0.05 * torch.randn_like(p))
    b = batch()
    ids, attn = b["input_ids"], b["attention_mask"]
    selected_by = lm_targets(ids, b["loss_mask"], attn)[..., None]  # (B, T, 1)
    rows, targets = select_trained_rows(last_hidden_state(backbone, ids, attn), selected_by)
    lm_rows = LMRows(rows, targets[:, 0], ids, attn, selected_by)
    keep = selected_by[..., 0] != IGNORE_INDEX  # (B, T)
    logits = backbone(input_ids=ids, attention_mask=attn).logits[keep].float()  # (N, V)
    with torch.no_grad():
        original = teacher(input_ids=ids, attention_mask=attn).logits[keep].float()  # (N, V)
    ce_ref = F.cross_entropy(logits, selected_by[..., 0][keep])
    kl_ref = F.kl_div(
        F.log_softmax(logits, -1), F.log_softmax(original, -1), log_target=True, reduction="batchmean"
    )
    params = [p for p in backbone.parameters() if p.requires_grad]
    for loss, ref in (
        (lm_cross_entropy(backbone, lm_rows, 8), ce_ref),
        (KLToOriginal(teacher)(backbone, lm_rows, 8), kl_ref),
    ):
        grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        ref_grads = torch.autograd.grad(ref, params, retain_graph=True, allow_unused=True)
        torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
        for g, r in zip(grads, ref_grads, strict=True):
            if r is not None:
                torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


def test_the_lora_original_is_the_backbone_without_its_adapters_and_without_dropout():
    """``lm_loss=kl`` with LoRA: the original is the trained model with its adapters disabled, and a
    fixed function like the full-tuning teacher (a frozen copy): with the backbone's dropout on in
    that forward, the KL of the original to itself was not 0. The training mode comes back after."""
    from peft import LoraConfig, get_peft_model

    from medusa_train.head_targets import last_hidden_state, select_trained_rows
    from medusa_train.training.losses import lm_targets
    from medusa_train.training.model import LMRows
    from tests.helpers.models import tiny_model

    backbone = tiny_model("llama", vocab=64, attention_dropout=0.3)
    lora = get_peft_model(backbone, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    b = batch()
    ids, attn = b["input_ids"], b["attention_mask"]
    with torch.no_grad():  # the adapters start as zero: the LoRA model is the original
        h = last_hidden_state(lora.eval(), ids, attn)  # (B, T, d)
    lora.train()
    selected_by = lm_targets(ids, b["loss_mask"], attn)[..., None]  # (B, T, 1)
    rows, targets = select_trained_rows(h, selected_by)
    kl = KLToOriginal()(lora, LMRows(rows, targets[:, 0], ids, attn, selected_by), chunk_size=8)
    assert kl.item() == pytest.approx(0.0, abs=1e-7)
    assert all(m.training for m in lora.modules())


def test_the_qlora_original_keeps_the_4bit_layers_in_training_mode(tmp_path):
    """QLoRA ``lm_loss=kl``: the original's forward is in eval mode (no dropout) but for bitsandbytes'
    4-bit linear layers, which in eval mode on a CPU with AVX512-BF16 repack their weight in place (a
    ZeRO-3 checkpoint save then fails on the partitioned weight); they hold no dropout."""
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from medusa_train.head_targets import last_hidden_state, select_trained_rows
    from medusa_train.training.losses import lm_targets
    from medusa_train.training.model import LMRows
    from tests.helpers.models import tiny_model

    tiny_model("llama", vocab=64, hidden=64, kv_heads=4, attention_dropout=0.3).save_pretrained(tmp_path)
    quantized = AutoModelForCausalLM.from_pretrained(
        tmp_path,
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32),
        device_map={"": "cpu"},
    )
    lora = get_peft_model(quantized, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    lora.train()
    seen: dict[str, set[bool]] = {"4bit": set(), "attention": set()}

    def record(module, args):
        kind = "4bit" if type(module).__name__ == "Linear4bit" else "attention"
        seen[kind].add(module.training)

    for name, m in lora.named_modules():
        if name.endswith("self_attn") or (
            type(m).__name__ == "Linear4bit" and type(m).__module__.startswith("bitsandbytes")
        ):
            m.register_forward_pre_hook(record)
    b = batch()
    ids, attn = b["input_ids"], b["attention_mask"]
    with torch.no_grad():
        h = last_hidden_state(lora, ids, attn)  # (B, T, d)
    seen = {"4bit": set(), "attention": set()}  # the original's forward only, below
    selected_by = lm_targets(ids, b["loss_mask"], attn)[..., None]  # (B, T, 1)
    rows, targets = select_trained_rows(h, selected_by)
    KLToOriginal()(lora, LMRows(rows, targets[:, 0], ids, attn, selected_by), chunk_size=8)
    assert seen == {"4bit": {True}, "attention": {False}}
    assert all(m.training for m in lora.modules())
    assert not any(
        getattr(m.weight.quant_state, "packing_format_for_cpu", False)
        for m in lora.modules()
        if type(m).__name__ == "Linear4bit"
    )


def test_heads_only_phase_gives_backbone_no_gradient():
    model = _model("ce")
    model.heads_only = True
    out = model(**batch())
    assert "lm_loss" not in out
    out["loss"].backward()
    assert all(p.grad is None for p in model.backbone.parameters())


def test_heads_only_phase_leaves_the_backbone_groups_alone_even_with_zero_gradients():
    """DeepSpeed hands AdamW a zero gradient for the backbone in the heads-only phase: its groups
    must still get no update, no weight decay and no counted step (the bias correction of the first
    joint step), as without DeepSpeed, where those gradients are None."""
    model = _model("ce")
    optimizer = FreezableAdamW(param_groups(model, 1e-2, weight_decay=0.1, head_lr_multiplier=4.0), lr=1e-2)
    assert {g["backbone"] for g in optimizer.param_groups} == {True, False}
    callback = HeadsOnlyCallback(model, steps=1)
    backbone_before = [p.detach().clone() for p in model.backbone.parameters()]
    heads_before = [p.detach().clone() for p in model.heads.parameters()]
    callback.on_step_begin(None, SimpleNamespace(global_step=0), None, optimizer=optimizer)
    assert model.heads_only
    assert all(g["frozen"] == g["backbone"] for g in optimizer.param_groups)
    model(**batch())["loss"].backward()
    for p in model.backbone.parameters():
        p.grad = torch.zeros_like(p)  # what DeepSpeed's flat gradient holds for the backbone
    optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.backbone.parameters(), backbone_before, strict=True))
    assert not any(p in optimizer.state for p in model.backbone.parameters())
    assert all(not torch.equal(p, q) for p, q in zip(model.heads.parameters(), heads_before, strict=True))
    callback.on_step_begin(None, SimpleNamespace(global_step=1), None, optimizer=optimizer)
    assert not model.heads_only and not any(g["frozen"] for g in optimizer.param_groups)


def test_zero3_with_a_kl_teacher_copy_is_refused_and_the_rest_allowed():
    def cfg(*overrides):
        return compose_config(["training=medusa2", "deepspeed=zero3", *overrides])

    with pytest.raises(UserError, match="use deepspeed=zero2") as err:
        check_supported(cfg("training.lm_loss=kl"))  # with backbone_tuning=full, the conf default
    assert "\n" not in str(err.value)
    check_supported(cfg())  # lm_loss=ce, the conf default
    check_supported(cfg("training.backbone_tuning=lora"))
    check_supported(compose_config(["training=medusa2", "deepspeed=zero2"]))


def test_zero3_is_refused_for_8bit_qlora_and_allowed_for_4bit():
    """ZeRO-3 cannot shard an 8-bit backbone (each bitsandbytes 8-bit layer keeps its whole weight
    in its matmul state): one line naming what to use; 4-bit QLoRA under ZeRO-3 and 8-bit under
    ZeRO-2 or without DeepSpeed run."""

    def cfg(quantization, deepspeed):
        return compose_config(
            [
                "training=medusa2",
                "training.backbone_tuning=qlora",
                f"model.quantization={quantization}",
                f"deepspeed={deepspeed}",
            ]
        )

    with pytest.raises(UserError, match="use deepspeed=zero2, or model.quantization=4bit") as err:
        check_supported(cfg("8bit", "zero3"))
    assert "\n" not in str(err.value)
    check_supported(cfg("4bit", "zero3"))
    check_supported(cfg("8bit", "zero2"))
    check_supported(cfg("8bit", "none"))


def test_lora_target_modules_the_backbone_lacks_are_one_user_error():
    """peft's NoMatchingPeftModuleError becomes one UserError line that lists the linear layers."""
    tc = compose_config(
        ["training=medusa2", "training.backbone_tuning=lora", "training.lora_target_modules=[q_proj,nope]"]
    ).training
    with pytest.raises(
        UserError, match=r"lora_target_modules: nope not in the backbone \(its linear layers: .*q_proj"
    ):
        trainable_backbone(tc, tiny_llama())
    tc = compose_config(
        ["training=medusa2", "training.backbone_tuning=lora", "training.lora_target_modules=[q_proj]"]
    ).training
    assert any("lora_" in n for n, _ in trainable_backbone(tc, tiny_llama()).named_parameters())


def test_full_tuning_without_deepspeed_in_half_precision(caplog):
    """Without DeepSpeed the Trainer's AdamW updates the loaded weights in place: float16 is refused
    (its loss scaling raises on fp16 gradients), bfloat16 warns (no fp32 master copy), LoRA, float32
    and DeepSpeed pass silently."""

    def cfg(*overrides):
        return compose_config(["training=medusa2", "model.device=cpu", *overrides])

    with pytest.raises(UserError, match="cannot train float16 weights in place") as err:
        check_supported(cfg("model.dtype=float16"))
    assert "\n" not in str(err.value)
    with caplog.at_level("WARNING"):
        check_supported(cfg("model.dtype=bfloat16"))
    assert "no fp32 master copy" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        check_supported(cfg("model.dtype=float32"))
        check_supported(cfg("model.dtype=float16", "training.backbone_tuning=lora"))
        check_supported(cfg("model.dtype=bfloat16", "deepspeed=zero2"))
    assert "master copy" not in caplog.text
