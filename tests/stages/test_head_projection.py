"""Head projection variants through the stages: train, export and eval of shared and
truncated heads on tiny models, and the one-line refusals of impossible settings."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from medusa_train.__main__ import main
from medusa_train.backbone import load_configured_backbone
from medusa_train.config import compose_config
from medusa_train.data.distilled import load_distilled, split_heldout
from medusa_train.decoding.calibrate import compute_head_accuracy
from medusa_train.errors import ConfigError, UserError
from medusa_train.formats import VLLM_WEIGHTS_NAME, load_heads
from medusa_train.heads import MedusaHeads
from medusa_train.stages import eval as eval_stage
from medusa_train.stages import export
from medusa_train.stages.train import run
from tests.helpers.tiny_workdir import make_workdir, tiny_cfg
from tests.helpers.train_workdir import VOCAB, make_train_workdir, train_cfg, train_overrides

DRAFT = 32


def _heldout(root: Path, heads: MedusaHeads, cfg) -> torch.Tensor:
    """Held-out top-1 per head ``(K,)``, full-vocabulary targets."""
    backbone, _ = load_configured_backbone(cfg.model, torch.device("cpu"))
    heads.attach(backbone)
    _, held = split_heldout(load_distilled(root / "distill"), cfg.data.eval_fraction)
    batches = [(torch.tensor([r["input_ids"]]), torch.tensor([r["loss_mask"]])) for r in held]
    return compute_head_accuracy(backbone, heads, batches, max_k=1)[:, 0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """One training run per variant on the same data."""
    out = {}
    for name, overrides in {
        "shared": ("stage=train", "training.head_projection=shared"),
        "truncated": (
            "stage=train",
            "training.head_projection=truncated",
            f"training.draft_vocab_size={DRAFT}",
        ),
    }.items():
        root = make_train_workdir(tmp_path_factory.mktemp(name))
        out[name] = root, run(train_cfg(root, *overrides))
    return out


def test_shared_heads_train_their_blocks_only(trained):
    root, result = trained["shared"]
    assert result["head_projection"] == "shared" and result["steps"] == 6
    keys = set(load_file(str(root / "heads" / "medusa_lm_head.safetensors")))
    assert keys == {f"{h}.0.linear.{p}" for h in range(3) for p in ("weight", "bias")}
    ckpt = load_file(str(root / "train" / "checkpoint-6" / "model.safetensors"))
    assert set(ckpt) == {f"heads.heads.{k}" for k in keys}  # no lm_head in checkpoints either
    config = json.loads((root / "heads" / "config.json").read_text())
    assert config["head_projection"] == "shared" and config["training"]["head_projection"] == "shared"
    cfg = train_cfg(root, "stage=train", "training.head_projection=shared")
    init = MedusaHeads(32, VOCAB, 3, 1, head_projection="shared")  # identity blocks: the lm_head itself
    before, after = (
        _heldout(root, init, cfg),
        _heldout(root, MedusaHeads.from_pretrained(root / "heads"), cfg),
    )
    assert (after > before).all(), (before.tolist(), after.tolist())
    torch.testing.assert_close(torch.tensor(result["heldout_top1"]), after, atol=1e-3, rtol=0)


def test_truncated_heads_map_the_most_frequent_targets(trained):
    root, result = trained["truncated"]
    assert result["draft_vocab_size"] == DRAFT
    cfg = train_cfg(
        root, "stage=train", "training.head_projection=truncated", f"training.draft_vocab_size={DRAFT}"
    )
    train_ds, _ = split_heldout(load_distilled(root / "distill"), cfg.data.eval_fraction)
    counts = Counter()
    for r in train_ds:
        seq = r["input_ids"][: cfg.training.max_seq_len]
        counts.update(t for i, t in enumerate(seq) if i >= 2 and r["loss_mask"][i])
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:DRAFT]
    heads = MedusaHeads.from_pretrained(root / "heads")
    assert heads.token_map.tolist() == sorted(ranked)
    covered = sum(counts[t] for t in ranked) / sum(counts.values())
    assert result["draft_vocab_coverage"] == pytest.approx(covered, abs=1e-6)
    assert load_file(str(root / "heads" / "medusa_lm_head.safetensors"))["0.1.weight"].shape == (DRAFT, 32)
    # The heads learn the in-map part of the pattern: held-out top-1 (over every target) rises well
    # above the start (lm_head rows of the map), and is what the stage reported.
    init = MedusaHeads(32, VOCAB, 3, 1, head_projection="truncated", token_map=heads.token_map)
    backbone, _ = load_configured_backbone(cfg.model, torch.device("cpu"))
    init.init_from_lm_head(backbone.get_output_embeddings().weight.detach().float())
    before, after = _heldout(root, init, cfg), _heldout(root, heads, cfg)
    assert (after > before + 0.15).all(), (before.tolist(), after.tolist())
    assert (after <= covered + 0.15).all()  # targets outside the map are misses
    torch.testing.assert_close(torch.tensor(result["heldout_top1"]), after, atol=1e-3, rtol=0)


def test_export_shared_both_layouts_and_truncated_vllm_only(trained, capsys):
    root, _ = trained["shared"]
    result = export.run(train_cfg(root, "stage=export"))
    assert result["roundtrip_identical"] and result["formats"] == ["medusa", "vllm"]
    vllm = json.loads((root / "export" / "vllm" / "config.json").read_text())
    assert vllm["original_lm_head"] is True
    backbone, _ = load_configured_backbone(train_cfg(root).model, torch.device("cpu"))
    tensors = load_file(str(root / "export" / "vllm" / VLLM_WEIGHTS_NAME))
    assert torch.equal(tensors["lm_heads.0.weight"], backbone.get_output_embeddings().weight)
    assert "lm_heads.1.weight" not in tensors
    assert "reuses the base model's lm_head" in (root / "export" / "README.md").read_text()
    _custom_generate_is_greedy_identical(root)

    root, _ = trained["truncated"]
    capsys.readouterr()
    assert main(train_overrides(root, "stage=export")) == 2  # the medusa layout has no token map
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "export.formats=[vllm]" in err[0]
    assert not (root / "export").exists()
    result = export.run(
        train_cfg(
            root,
            "stage=export",
            "export.formats=[vllm]",
            "training.head_projection=truncated",
            f"training.draft_vocab_size={DRAFT}",
        )
    )
    assert result["roundtrip_identical"]
    vllm = json.loads((root / "export" / "vllm" / "config.json").read_text())
    assert (vllm["truncated_vocab_size"], vllm["vocab_size"]) == (DRAFT, VOCAB)
    assert f"draft vocabulary of {DRAFT} tokens" in (root / "export" / "README.md").read_text()
    back = load_heads(root / "export" / "vllm")
    assert torch.equal(back.token_map, MedusaHeads.from_pretrained(root / "heads").token_map)
    _custom_generate_is_greedy_identical(root)


def _custom_generate_is_greedy_identical(root: Path) -> None:
    """The export decodes through `model.generate(custom_generate=...)` as plain greedy `generate` does."""
    model = AutoModelForCausalLM.from_pretrained(train_cfg(root).model.name_or_path).eval()
    ids = torch.tensor([[3, 17, 9, 40, 2, 11]])
    out = model.generate(ids, custom_generate=str(root / "export"), trust_remote_code=True, max_new_tokens=16)
    assert torch.equal(out, model.generate(ids, do_sample=False, max_new_tokens=16))


@pytest.mark.parametrize("kind", ["shared", "truncated"])
def test_eval_of_variant_heads_is_greedy_identical(tmp_path: Path, kind: str):
    workdir = make_workdir(tmp_path)
    own = MedusaHeads.from_pretrained(workdir / "heads")
    token_map = torch.arange(0, own.vocab_size, 3) if kind == "truncated" else None
    heads = MedusaHeads(
        own.hidden_size,
        own.vocab_size,
        own.num_heads,
        1,
        str(workdir / "base_model"),
        head_projection=kind,
        token_map=token_map,
    )
    state = {k: (v[token_map] if k.endswith(".1.weight") else v) for k, v in own.heads.state_dict().items()}
    heads.heads.load_state_dict({k: v for k, v in state.items() if k in heads.heads.state_dict()})
    heads.save_pretrained(workdir / "heads")
    report = eval_stage.run(tiny_cfg(workdir, "stage=eval", "eval.sweep_tree_sizes=[]"))
    assert report["greedy_identical"] == 1.0 and report["tau"] >= 1.0


def test_impossible_settings_are_one_line_exit_2(tmp_path: Path, capsys):
    root = make_train_workdir(tmp_path)
    capsys.readouterr()
    code = main(
        train_overrides(
            root,
            "stage=train",
            "training.head_projection=truncated",
            f"training.draft_vocab_size={VOCAB + 1}",
        )
    )
    # The error is one line (the backbone's loading progress bar may precede it on stderr).
    errors = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "larger than the backbone's vocabulary (64 tokens)" in errors[0]
    assert not (root / "heads").exists()
    for overrides, match in [
        (["training.draft_vocab_size=8"], "is for training.head_projection=truncated"),
        (["training.head_projection=truncated"], "needs training.draft_vocab_size"),
        (["training.head_projection=shared", "training.num_layers=0"], "num_layers >= 1"),
        (["training.head_projection=bogus"], "head_projection"),
        (
            ["stage=all", "training.head_projection=truncated", "training.draft_vocab_size=8"],
            "export.formats",
        ),
    ]:
        with pytest.raises(ConfigError, match=match):
            compose_config(overrides)


def test_a_draft_vocabulary_of_the_whole_vocabulary_is_refused_before_any_work(
    tmp_path: Path, capsys, monkeypatch
):
    """Truncated heads over all V tokens have no serving layout (export refuses them): stage=train
    refuses N >= V in one line before loading the backbone (the distilled data's manifest names V), or,
    with a manifest that does not, once it is loaded and before any data is read."""
    from medusa_train.stages import train as train_stage

    root = make_train_workdir(tmp_path)

    def no_work(*args, **kwargs):
        raise AssertionError("work started")

    overrides = ["stage=train", "training.head_projection=truncated"]
    with monkeypatch.context() as m:
        m.setattr(train_stage, "load_configured_backbone", no_work)
        for size, what in [(VOCAB, "the backbone's whole"), (VOCAB + 1, "larger than the backbone's")]:
            capsys.readouterr()
            assert main(train_overrides(root, *overrides, f"training.draft_vocab_size={size}")) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert (
                len(err) == 1 and f"draft_vocab_size={size} is {what} vocabulary ({VOCAB} tokens)" in err[0]
            )
            assert f"at most {VOCAB - 1}" in err[0] and "training.head_projection=own" in err[0]
    manifest = json.loads((root / "distill" / "manifest.json").read_text())
    del manifest["backbone"]["vocab_size"]
    (root / "distill" / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(train_stage, "training_data", no_work)
    with pytest.raises(UserError, match=f"is the backbone's whole vocabulary \\({VOCAB} tokens\\)"):
        run(train_cfg(root, *overrides, f"training.draft_vocab_size={VOCAB}"))
    assert not (root / "heads").exists() and not (root / "train").exists()


def test_shared_over_a_backbone_without_lm_head_is_a_user_error(tmp_path: Path, monkeypatch):
    from medusa_train.stages import train as train_stage

    root = make_train_workdir(tmp_path)
    cfg = train_cfg(root, "stage=train", "training.head_projection=shared")
    backbone, _ = load_configured_backbone(cfg.model, torch.device("cpu"))
    monkeypatch.setattr(type(backbone), "get_output_embeddings", lambda self: None)
    identity = {"hidden_size": 32, "vocab_size": VOCAB}
    with pytest.raises(UserError, match="no output embedding"):
        train_stage._initial_heads(cfg, backbone, identity)


def test_medusa2_shared_heads_export_the_trained_lm_head(tmp_path: Path):
    """Medusa-2 (full tuning) trains the lm_head through the LM loss; shared heads follow it, and the
    vLLM export carries the trained lm_head, not the base model's."""
    root = make_train_workdir(tmp_path)
    overrides = ("training=medusa2", "training.head_projection=shared", "training.cache_hidden_states=false")
    result = run(train_cfg(root, "stage=train", *overrides))
    assert result["head_projection"] == "shared" and result["steps"] == 6
    assert export.run(train_cfg(root, "stage=export", *overrides))["roundtrip_identical"]
    exported = load_file(str(root / "export" / "vllm" / VLLM_WEIGHTS_NAME))["lm_heads.0.weight"]
    trained = load_file(str(next((root / "heads" / "backbone").glob("*.safetensors"))))["lm_head.weight"]
    base = load_file(str(next((root / "base_model").glob("*.safetensors"))))["lm_head.weight"]
    assert torch.equal(exported, trained) and not torch.equal(trained, base)
