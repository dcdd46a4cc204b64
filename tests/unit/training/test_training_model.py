"""MedusaTrainingModel: what lm_head reads, frozen backbone, heads-only state, golden losses, cache."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaForCausalLM

from medusa_train.errors import UserError
from medusa_train.head_targets import (
    LogitMap,
    hidden_width,
    language_model,
    last_hidden_state,
    logit_map,
    medusa_targets,
    select_trained_rows,
)
from medusa_train.heads import MedusaHeads
from medusa_train.training.hidden_cache import HiddenCache, build_hidden_cache
from medusa_train.training.losses import HeadLoss
from medusa_train.training.model import (
    KLToOriginal,
    MedusaTrainingModel,
    lm_head_input_mismatch,
    logit_map_mismatch,
)
from medusa_train.training.optim import param_groups
from medusa_train.training.zero import SHM_OP, deepspeed_config, deepspeed_process
from tests.helpers.models import tiny_model
from tests.helpers.syncs import flushed_before, record_syncs
from tests.helpers.training import LOGIT_STEP_ARCHS, batch, tiny_llama, tiny_logit_step_model


def make_model(
    seed: int = 0, k: int = 3, arch: str = "llama"
) -> tuple[MedusaTrainingModel, LlamaForCausalLM]:
    backbone = tiny_llama(seed) if arch == "llama" else tiny_model(arch, seed, vocab=64, eos_token_id=1)
    torch.manual_seed(seed)
    heads = MedusaHeads(32, 64, k, 1)
    heads.init_from_lm_head(backbone.get_output_embeddings().weight)
    return MedusaTrainingModel(heads, backbone, decay=0.8, chunk_size=8), backbone


def tiny_mllama() -> torch.nn.Module:
    """Mllama's causal LM (its text model under an LM head; layer 1 cross-attends, to no image here)."""
    import transformers

    config = transformers.MllamaTextConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, pad_token_id=0, cross_attention_layers=[1],
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.MllamaForCausalLM(config).eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "llama4", "mllama"])
def test_last_hidden_state_is_what_lm_head_reads(arch):
    """Also for Llama 4's and Mllama's causal LMs, whose ``get_decoder()`` is the causal LM itself."""
    torch.manual_seed(0)
    if arch == "llama":
        model = tiny_llama()
    elif arch in ("qwen2", "llama4"):
        model = tiny_model(arch, vocab=64)
    elif arch == "mllama":
        model = tiny_mllama()
    else:
        model = tiny_model("gpt2", vocab=64, bos_token_id=1, eos_token_id=1)
    b = batch()
    with torch.no_grad():
        out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], output_hidden_states=True)
        h = last_hidden_state(model, b["input_ids"], b["attention_mask"])
    torch.testing.assert_close(model.get_output_embeddings()(h), out.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, out.hidden_states[-1])


def test_the_language_model_is_the_model_under_the_lm_head():
    """Where ``get_decoder()`` is a causal LM (Llama 4's multimodal model: its language model's causal
    LM, whose own ``get_decoder()`` is itself) or the LM head (ModernBERT's decoder), the model under
    it; through a PEFT wrapper too; a model without an LM head is its own; one with no one model under its
    LM head is refused in one line."""
    import transformers
    from peft import LoraConfig, get_peft_model

    text = tiny_model("llama4", vocab=64).config
    vision = dict(
        hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=16,
        patch_size=8, vision_output_dim=16, projector_input_dim=16, projector_output_dim=16,
    )  # fmt: skip
    multimodal = transformers.Llama4ForConditionalGeneration(
        transformers.Llama4Config(text_config=text.to_dict(), vision_config=vision)
    )
    assert multimodal.get_decoder() is multimodal.language_model  # a causal LM
    assert language_model(multimodal) is multimodal.language_model.model
    llama4 = tiny_model("llama4", vocab=64)
    assert llama4.get_decoder() is llama4 and language_model(llama4) is llama4.model
    lora = get_peft_model(llama4, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    assert language_model(lora) is llama4.model
    modernbert = transformers.ModernBertDecoderForCausalLM(
        transformers.ModernBertDecoderConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=64,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=1,
            cls_token_id=1,
            sep_token_id=1,
        )  # fmt: skip
    )
    assert modernbert.get_decoder() is modernbert.get_output_embeddings()
    assert language_model(modernbert) is modernbert.model
    plain = tiny_llama()
    assert language_model(plain) is plain.model and language_model(plain.model) is plain.model
    twice = tiny_llama()  # its own get_decoder(), holding two models: none is the one under its LM head
    twice.get_decoder = lambda: twice
    twice.other = copy.deepcopy(twice.model)
    with pytest.raises(
        UserError, match=r"^LlamaForCausalLM \(llama\): .* returns itself, with 2 models inside"
    ):
        language_model(twice)


_LOGIT_STEPS = {  # a config class and the step its forward takes after lm_head, sized to tiny logits
    "llama": ("LlamaConfig", {}),
    "gemma2": ("Gemma2Config", {"head_dim": 8, "final_logit_softcapping": 0.2}),
    "gemma3n": (  # lm_head reads its last_hidden_state, not its hidden_states[-1] (its AltUp streams)
        "Gemma3nTextConfig",
        {
            "head_dim": 8,
            "final_logit_softcapping": 0.2,
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 6,
            "num_kv_shared_layers": 0,
            "hidden_size_per_layer_input": 8,
            "vocab_size_per_layer_input": 64,
            "laurel_rank": 4,
            "activation_sparsity_pattern": [0.95, 0.0],
        },
    ),
    "cohere": ("CohereConfig", {"logit_scale": 4.0}),
    "cohere2": ("Cohere2Config", {"logit_scale": 4.0}),
    "granite": ("GraniteConfig", {"logits_scaling": 0.25}),
    "granitemoe": ("GraniteMoeConfig", {"logits_scaling": 0.25}),
    "minicpm3": ("MiniCPM3Config", {"num_key_value_heads": 4, "dim_model_base": 128}),
    "hyperclovax": ("HyperCLOVAXConfig", {"logits_scaling": 4.0}),
}


def _logit_steps_model(arch: str) -> torch.nn.Module:
    """A random model of ``arch`` in :data:`_LOGIT_STEPS`, its step after lm_head as given there."""
    import transformers

    name, step = _LOGIT_STEPS[arch]
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    ids = dict(vocab_size=64, pad_token_id=0, bos_token_id=None, eos_token_id=1)
    config = getattr(transformers, name)(**shape, **ids, **{"num_key_value_heads": 2, **step})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("arch", list(_LOGIT_STEPS))
def test_logit_map_of_lm_head_is_the_logits_of_the_backbone_forward(arch):
    """What the soft targets and the LM losses read as the backbone's logits: its forward's, also where
    that forward caps or scales ``lm_head(h)``; the map changes them there (not the identity)."""
    model = _logit_steps_model(arch)
    b = batch()
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        z = model.get_output_embeddings()(last_hidden_state(model, b["input_ids"], b["attention_mask"]))
    torch.testing.assert_close(logit_map(model)(z), logits, atol=1e-5, rtol=1e-5)
    assert logit_map(model).is_identity is (arch == "llama")


def _logits_after(monkeypatch, cls: type, factor: float = 1.0, shift: float = 0.0) -> None:
    """``cls``'s forward with a step after lm_head that ``logit_map`` does not know: ``* factor + shift``."""
    original = cls.forward

    def forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        out.logits = out.logits * factor + shift
        return out

    monkeypatch.setattr(cls, "forward", forward)


def _logit_step_model(arch: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    if arch == "llama4":
        return tiny_model("llama4", vocab=64, eos_token_id=1).to(dtype)
    return (tiny_llama() if arch == "llama" else tiny_logit_step_model(arch)).to(dtype)


_IDS = torch.tensor([[5, 9, 2, 33, 17, 60, 8, 41]])  # (1, T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "llama4", *LOGIT_STEP_ARCHS])
def test_the_logit_map_check_passes_the_families_it_knows(arch, dtype):
    """The families ``logit_map`` knows give their forward's distribution, in bfloat16 within the
    rounding of the forward's own cap or scale (Llama 4: the states its LM head reads found under its
    causal LM, which is its own ``get_decoder()``)."""
    assert logit_map_mismatch(_logit_step_model(arch, dtype), _IDS) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_logit_map_check_passes_a_softcap_at_the_logits_magnitude(dtype):
    """Gemma-2's real cap (30) on logits that reach it, where bfloat16's rounding of the forward's
    ``30 * tanh(z / 30)`` is largest."""
    model = tiny_logit_step_model("gemma2")
    model.config.final_logit_softcapping = 30.0
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(300.0)
    model = model.to(dtype)
    with torch.no_grad():
        assert model(input_ids=_IDS).logits.abs().amax() > 25
    assert logit_map_mismatch(model, _IDS) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_a_logit_step_the_map_does_not_know_is_found(monkeypatch, arch, dtype):
    """A forward that scales its logits after lm_head (an architecture outside the table): the check
    says by how much the map's logits differ from the forward's, and which map it applied."""
    model = _logit_step_model(arch, dtype)
    _logits_after(monkeypatch, type(model), factor=4.0)
    found = logit_map_mismatch(model, _IDS)
    step = "0.2 * tanh(lm_head(h) / 0.2)" if arch == "gemma2" else "lm_head(h)"
    assert found is not None and found.startswith(f"its logits differ from {step} by up to ")


def test_a_softcap_the_map_misses_is_found(monkeypatch):
    """Gemma-2's cap with a map that misses it (the identity): found."""
    import medusa_train.training.model as model_module

    monkeypatch.setattr(model_module, "logit_map", lambda model: LogitMap())
    assert "differ from lm_head(h)" in logit_map_mismatch(_logit_step_model("gemma2"), _IDS)


def test_a_constant_added_to_the_logits_is_no_mismatch(monkeypatch):
    """The same constant added to every logit of a position leaves its distribution as it is."""
    model = tiny_llama()
    _logits_after(monkeypatch, type(model), shift=7.0)
    assert logit_map_mismatch(model, _IDS) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "llama4", "opt350m", *_LOGIT_STEPS])
def test_an_lm_head_reading_the_last_hidden_state_is_found_to(arch, dtype):
    """The LM head of these families reads the decoder's last hidden state, the heads' input: MiniCPM3's
    divided by its ``logits_scaling`` (0.25 here) first, a positive factor; OPT-350m's projected to half
    the hidden size at the decoder's end (that projection is the last hidden state)."""
    if arch in ("opt350m", "llama4"):
        model = tiny_model(arch, vocab=64, eos_token_id=1)
    else:
        model = _logit_steps_model(arch)
    assert lm_head_input_mismatch(model.to(dtype), _IDS) is None


@pytest.mark.parametrize(
    ("arch", "found"),
    [
        ("electra", "its LM head reads 16-wide vectors, not its decoder's 32-wide last hidden state"),
        ("rembert", "its LM head reads 16-wide vectors, not its decoder's 32-wide last hidden state"),
        ("modernbert_decoder", "its LM head reads other vectors than its decoder's last hidden state"),
    ],
)
def test_an_lm_head_over_a_prediction_head_is_found(arch, found):
    """ELECTRA's and RemBERT's causal LMs put a prediction head to half the width between the decoder's
    last hidden state and their LM head, ModernBERT's decoder one of the same width: found, and the
    logit-map check says so for the first two (it applied their LM head to 32-wide vectors)."""
    model = tiny_model(arch, vocab=64, eos_token_id=1)
    assert lm_head_input_mismatch(model, _IDS) == found
    if arch != "modernbert_decoder":
        assert logit_map_mismatch(model, _IDS) == found


@pytest.mark.parametrize(
    ("arch", "width", "forwards"),
    [
        ("llama", 32, 0),
        ("modernbert_decoder", 32, 0),
        ("electra", 32, 1),
        ("rembert", 32, 1),
        ("opt350m", 16, 1),
    ],
)
def test_the_heads_width_is_the_last_hidden_states(arch, width, forwards):
    """What the heads read is the decoder's last hidden state, whatever the LM head reads (ELECTRA's and
    RemBERT's a prediction head's 16-wide output) and whatever the config's hidden_size (OPT-350m's: 32);
    one forward of one token says which where the two widths differ, none where they agree."""
    model = tiny_model(arch, vocab=64, eos_token_id=1)
    calls = []
    language_model(model).register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(1), with_kwargs=True
    )
    assert hidden_width(model) == width == last_hidden_state(model, _IDS, torch.ones_like(_IDS)).shape[-1]
    assert len(calls) == forwards + 1


@pytest.mark.parametrize(
    ("arch", "width"),
    [("llama", 32), ("modernbert_decoder", 32), ("electra", 32), ("rembert", 32), ("opt350m", 16)],
)
def test_the_heads_width_of_a_partitioned_backbone_is_read_from_its_shapes(arch, width):
    """ZeRO-3 partitions every parameter (``ds_shape`` its whole shape, its data empty), so no forward
    runs: the modules' shapes say the width, as the forward does (a prediction head reading the
    hidden_size-wide state outside the language model: ELECTRA, RemBERT; OPT-350m projects inside)."""
    model = tiny_model(arch, vocab=64, eos_token_id=1)
    for p in model.parameters():
        p.ds_shape = p.shape
        p.data = p.data.new_empty(0)
    calls = []
    language_model(model).register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(1), with_kwargs=True
    )
    assert hidden_width(model) == width and not calls


def test_the_logit_map_check_runs_one_forward_and_leaves_the_modes():
    """One decoder forward (its output caught on the way to lm_head), no gradient, every module's mode
    as it was (a trainable backbone stays in training mode)."""
    model = tiny_model("llama", vocab=64, attention_dropout=0.3).train()
    calls = []
    model.model.register_forward_pre_hook(lambda module, args: calls.append(module.training))
    assert logit_map_mismatch(model, _IDS) is None
    assert calls == [False]  # eval mode: dropout would make the forward a random draw
    assert all(m.training for m in model.modules())
    assert all(p.grad is None for p in model.parameters())


def test_the_logit_map_check_of_a_4bit_backbone_does_not_repack_it(tmp_path):
    """A bitsandbytes 4-bit backbone (QLoRA) is checked with its 4-bit layers in training mode: in eval
    mode on a CPU with AVX512-BF16 they repack their weight in place, which a ZeRO-3 checkpoint save
    then fails to unpack."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_model("llama", vocab=64, hidden=64, kv_heads=4).save_pretrained(tmp_path)
    quantized = AutoModelForCausalLM.from_pretrained(
        tmp_path,
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32),
        device_map={"": "cpu"},
    )
    four_bit = [m for m in quantized.modules() if type(m).__name__ == "Linear4bit"]
    assert four_bit and not quantized.training
    assert logit_map_mismatch(quantized, _IDS) is None
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in four_bit)
    assert not any(m.training for m in quantized.modules())


def test_medusa1_state_dict_and_parameters_are_heads_only():
    model, backbone = make_model()
    assert all(name.startswith("heads.") for name in model.state_dict())
    assert {id(p) for p in model.parameters()} == {id(p) for p in model.heads.parameters()}
    assert model.frozen_backbone is backbone and not any(p.requires_grad for p in backbone.parameters())


@pytest.mark.parametrize("arch", ["llama", "llama4"])
def test_backbone_bit_identical_and_every_head_parameter_moves(arch):
    """Medusa-1 steps; on Llama 4 too (its MoE backbone frozen, the heads reading what its LM head reads)."""
    model, backbone = make_model(arch=arch)
    before = {k: v.clone() for k, v in backbone.state_dict().items()}
    heads_before = {k: v.clone() for k, v in model.heads.state_dict().items()}
    opt = torch.optim.AdamW(param_groups(model, 1e-2), lr=1e-2)
    model.train()
    for step in range(3):
        out = model(**batch(step))
        out["loss"].backward()
        opt.step()
        opt.zero_grad()
    for k, v in backbone.state_dict().items():
        assert torch.equal(v, before[k]), k
    for k, v in model.heads.state_dict().items():
        assert not torch.equal(v, heads_before[k]), f"head parameter {k} did not change"
    assert all(p.grad is None for p in backbone.parameters())


# Golden values: produced by this exact setup (tiny_llama(seed=0), heads K=3 initialised from its
# lm_head, the same batch(seed=0) every step, AdamW lr=1e-2, decay 0.8, chunk 8) on torch 2.13 CPU fp32, by printing
# `out["loss"].item()` for steps 0..3. They only move if the loss definition, the target positions,
# the head initialisation or the model's init change.
GOLDEN = [10.1520786, 9.3837223, 8.6148891, 7.8249259]


def test_golden_losses():
    model, _ = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    losses = []
    for _ in range(4):
        out = model(**batch(0))
        losses.append(out["loss"].item())
        out["loss"].backward()
        opt.step()
        opt.zero_grad()
    assert losses == pytest.approx(GOLDEN, abs=1e-4), losses


def _accumulation_model(variant: str) -> MedusaTrainingModel:
    """Medusa-1 truncated heads with a CE + KL mixture (two denominators per head), or Medusa-2 with
    the KL to the frozen original as its LM loss (a third)."""
    backbone = tiny_llama()
    torch.manual_seed(0)
    if variant == "medusa1":
        token_map = torch.arange(2, 64, 3)  # a third of the vocabulary: the CE counts fewer targets
        heads = MedusaHeads(32, 64, 3, 1, head_projection="truncated", token_map=token_map)
        heads.init_from_lm_head(backbone.get_output_embeddings().weight)
        return MedusaTrainingModel(heads, backbone, chunk_size=8, head_loss=HeadLoss.from_spec("kl+0.5ce"))
    heads = MedusaHeads(32, 64, 3, 1)
    heads.init_from_lm_head(backbone.get_output_embeddings().weight)
    teacher = copy.deepcopy(backbone)
    with torch.no_grad():  # a student that already moved away from the original: the KL is not 0
        for p in backbone.parameters():
            p.add_(0.05 * torch.randn_like(p))
    backbone.requires_grad_(True)
    return MedusaTrainingModel(
        heads, backbone, backbone_trainable=True, lm_loss=KLToOriginal(teacher), lambda0=0.5, chunk_size=8
    )


@pytest.mark.parametrize("variant", ["medusa1", "medusa2"])
def test_micro_batches_add_up_to_the_whole_batch(variant):
    """Gradient accumulation: micro-batches with different numbers of targets, each divided by the
    step's counts (the trainer's ``step_counts``), give the loss and gradients of one batch holding
    them all (a mean of the micro-batches' means weighs their tokens unequally); the logged per-head
    mean stays each micro-batch's own."""
    model = _accumulation_model(variant).train()
    whole = batch(seed=5, b=4)  # lengths 14, 11, 8, 5: head 1 has 11 targets, then 8, 5 and 2
    parts = [{key: value[i:j] for key, value in whole.items()} for i, j in ((0, 1), (1, 4))]
    params = [p for p in model.parameters() if p.requires_grad]

    out = model(**whole)
    out["loss"].backward()
    want = [p.grad.clone() for p in params]
    model.zero_grad()
    counts = sum(model.loss_counts(part) for part in parts)
    assert torch.equal(counts, model.loss_counts(whole))
    loss = 0.0
    for part in parts:
        step = model(**part, step_counts=counts)
        step["loss"].backward()
        loss += step["loss"].item()
        with torch.no_grad():
            alone = model(**part)
        for key in ("head_ce", "lm_loss") if variant == "medusa2" else ("head_ce",):
            torch.testing.assert_close(step[key], alone[key], atol=1e-6, rtol=1e-5)
    assert loss == pytest.approx(out["loss"].item(), rel=1e-5)
    for p, w in zip(params, want, strict=True):
        torch.testing.assert_close(p.grad, w, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "llama4"])
def test_hidden_cache_rows_equal_online(tmp_path, arch):
    model, backbone = make_model(arch=arch)
    b = batch()
    records = []
    for i in range(b["input_ids"].shape[0]):
        n = int(b["attention_mask"][i].sum())
        records.append(
            {"input_ids": b["input_ids"][i, :n].tolist(), "loss_mask": b["loss_mask"][i, :n].tolist()}
        )
    cache = build_hidden_cache(backbone, records, tmp_path / "c", 3, {"v": 1}, batch_size=2)
    assert len(cache) == 3
    with torch.no_grad():
        h = last_hidden_state(backbone, b["input_ids"], b["attention_mask"])
        rows, tgt = select_trained_rows(
            h, medusa_targets(b["input_ids"], b["loss_mask"], b["attention_mask"], 3)
        )
    cached_rows = torch.cat([cache[i]["hidden_states"] for i in range(3)])
    cached_tgt = torch.cat([cache[i]["targets"] for i in range(3)])
    torch.testing.assert_close(cached_rows, rows, atol=1e-5, rtol=1e-5)
    assert torch.equal(cached_tgt, tgt)
    online = model(**b)["loss"]
    from_cache = model(hidden_states=cached_rows, targets=cached_tgt)["loss"]
    assert abs(online.item() - from_cache.item()) < 1e-5
    # Reopening with the same settings reuses the finished cache; a half-built one resumes.
    (tmp_path / "c" / "hidden.bin").touch()
    assert isinstance(build_hidden_cache(backbone, records, tmp_path / "c", 3, {"v": 1}), HiddenCache)


def _batch_records() -> list[dict]:
    """The rows of :func:`batch` as distilled records (``input_ids``, ``loss_mask``, padding cut)."""
    b = batch()
    lengths = b["attention_mask"].sum(1).tolist()
    return [
        {"input_ids": b["input_ids"][i, :n].tolist(), "loss_mask": b["loss_mask"][i, :n].tolist()}
        for i, n in enumerate(lengths)
    ]


def test_hidden_cache_resumes_from_progress(tmp_path):
    import json

    _, backbone = make_model()
    records = _batch_records()
    full = build_hidden_cache(backbone, records, tmp_path / "full", 3, {"v": 1}, batch_size=1)
    part = tmp_path / "part"
    build_hidden_cache(backbone, records, part, 3, {"v": 1}, batch_size=1)
    # Pretend the build was killed after the first record: drop meta, rewind progress, wipe later rows.
    (part / "meta.json").unlink()
    (part / "progress.json").write_text(json.dumps({"settings": {"v": 1}, "records_done": 1}))
    resumed = build_hidden_cache(backbone, records, part, 3, {"v": 1}, batch_size=1)
    assert torch.equal(torch.from_numpy(resumed.hidden[:].copy()), torch.from_numpy(full.hidden[:].copy()))


def test_hidden_cache_files_are_on_disk_before_progress_or_meta_counts_them(tmp_path, monkeypatch):
    """progress.json resumes a build and meta.json marks it complete: the arrays they vouch for are
    fsynced before either is renamed into place, so after a power loss they are there, whole."""
    _, backbone = make_model()
    records = _batch_records()
    events = record_syncs(monkeypatch)
    build_hidden_cache(backbone, records, tmp_path / "c", 3, {"v": 1}, batch_size=2, soft=True)
    cache = (tmp_path / "c").resolve()
    arrays = {cache / name for name in ("targets.npy", "sources.npy", "offsets.npy")}
    assert arrays <= flushed_before(events, cache / "progress.json")
    assert arrays | {cache / "hidden.bin"} <= flushed_before(events, cache / "meta.json")


def test_param_groups_head_multiplier():
    model, _ = make_model()
    groups = param_groups(model, 1e-3, weight_decay=0.1, head_lr_multiplier=4.0)
    assert {g["lr"] for g in groups} == {4e-3}
    assert sum(len(g["params"]) for g in groups) == len(list(model.heads.parameters()))
    assert {g["weight_decay"] for g in groups} == {0.0, 0.1}


def test_deepspeed_config_errors_and_shape():
    cfg = deepspeed_config(2, on_cpu=True)
    assert cfg["zero_optimization"]["stage"] == 2 and "bf16" not in cfg
    assert deepspeed_config(3, dtype=torch.bfloat16, on_cpu=False)["bf16"] == {"enabled": True}
    with pytest.raises(UserError, match="offload"):
        deepspeed_config(3, offload_param=True, on_cpu=True)
    # an offloaded optimizer is still the Trainer's (DeepSpeed would demand its CPU Adam and raise)
    offloaded = deepspeed_config(2, offload_optimizer=True, on_cpu=False)
    assert offloaded["zero_force_ds_cpu_optimizer"] is False and "zero_force_ds_cpu_optimizer" not in cfg


def test_a_deepspeed_run_on_a_cpu_compiles_no_op(tmp_path, monkeypatch):
    """DeepSpeed's CPU backend would compile its shared-memory all-reduce (used by tensor-parallel
    inference only) when its process group starts: 28 s on a 2-core machine, and a C++ compiler."""
    import importlib

    import deepspeed.ops

    ds_torch = importlib.import_module(
        "deepspeed.comm.torch"
    )  # the attribute `torch` of deepspeed.comm is torch

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, SHM_OP, True)  # as DeepSpeed probes it here
    with deepspeed_process(True):
        assert ds_torch.build_shm_op() is None  # what the backend calls when the group starts
    assert not (tmp_path / "extensions").exists()


def test_deepspeed_not_importable_is_a_user_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` now raises ImportError
    with pytest.raises(UserError, match="pip install deepspeed"):
        deepspeed_config(2)
