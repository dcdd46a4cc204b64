"""stage=train's skip/resume settings come from the config dataclasses: every field counts unless it
is declared with ``run_only``, so a new field is compared without anyone listing it."""

from __future__ import annotations

import dataclasses

from medusa_train.config import (
    DataConfig,
    DistillConfig,
    TrainingConfig,
    TreeConfig,
    compose_config,
    run_only,
)
from medusa_train.stages.train import calibration_settings, train_settings
from medusa_train.workdir import RUN_ONLY, settings_of

IDENTITY = {"fingerprint": "0123456789abcdef"}
MANIFEST = {"settings": {"max_new_tokens": 8}, "counts": {"records": 3}, "backbone": IDENTITY, "seconds": 1.5}
INPUTS = {
    "model_dtype",
    "model_quantization",
    "global_batch_size",
    "eval_fraction",
    "backbone_fingerprint",
    "distill",
}
RUN_ONLY_FIELDS = {
    DataConfig: {"strict"},
    DistillConfig: {"overwrite", "batch_size", "engine", "server"},
    TrainingConfig: {
        "per_device_batch_size",
        "gradient_accumulation_steps",
        "max_minutes",
        "loss_chunk_size",
        "logging_steps",
        "save_steps",
        "save_total_limit",
        "fsync_checkpoints",
        "cache_hidden_states",
        "overwrite",
        "calibration_max_records",
    },
    TreeConfig: {"name", "choices", "chain_depth"},
}
"""The fields each settings class leaves out of its stage's settings: marking one more is a decision
(it stops redoing work when that field changes), so it shows up here."""


def _cfg(*overrides: str):
    return compose_config(["model=hf", "model.name_or_path=some/model", *overrides])


def _run_only(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.metadata.get(RUN_ONLY)}


def test_the_run_only_fields_are_declared_on_the_fields_themselves():
    for cls, expected in RUN_ONLY_FIELDS.items():
        assert _run_only(cls) == expected, cls.__name__
        assert not hasattr(cls, "RUN_ONLY"), cls.__name__
        assert "run_only" in (cls.__doc__ or ""), f"{cls.__name__}'s docstring states the rule"
        everything = {f.name for f in dataclasses.fields(cls)}
        assert set(settings_of(part=cls())["part"]) == everything - expected, cls.__name__


def test_train_settings_hold_every_training_field_but_run_only_and_the_inputs():
    settings = train_settings(_cfg(), IDENTITY, MANIFEST)
    fields = {f.name for f in dataclasses.fields(TrainingConfig)}
    assert set(settings) == (fields - _run_only(TrainingConfig)) | INPUTS
    assert settings["global_batch_size"] == 8 * 1
    assert settings["backbone_fingerprint"] == IDENTITY["fingerprint"]


def test_train_settings_follow_what_changes_the_heads():
    settings = train_settings(_cfg(), IDENTITY, MANIFEST)
    for override in ("training.lr=0.5", "training.num_heads=2", "training=medusa2", "model.dtype=float16"):
        assert train_settings(_cfg(override), IDENTITY, MANIFEST) != settings, override
    # how the run goes, not what it trains; the same global batch split otherwise
    for override in ("training.logging_steps=1", "training.save_steps=7", "training.overwrite=true"):
        assert train_settings(_cfg(override), IDENTITY, MANIFEST) == settings, override
    split = _cfg("training.per_device_batch_size=4", "training.gradient_accumulation_steps=2")
    assert train_settings(split, IDENTITY, MANIFEST) == settings
    # when the data was written is not what it is
    assert train_settings(_cfg(), IDENTITY, {**MANIFEST, "seconds": 99.0}) == settings
    assert train_settings(_cfg(), IDENTITY, {**MANIFEST, "counts": {"records": 4}}) != settings


def test_a_new_training_field_is_compared_unless_declared_run_only():
    @dataclasses.dataclass
    class WithNewFields(TrainingConfig):
        new_option: int = 3
        new_run_option: int = run_only(5)

    cfg = _cfg()
    cfg.training = WithNewFields()
    settings = train_settings(cfg, IDENTITY, MANIFEST)
    assert settings["new_option"] == 3 and "new_run_option" not in settings
    cfg.training = WithNewFields(new_option=4)
    assert train_settings(cfg, IDENTITY, MANIFEST) != settings
    cfg.training = WithNewFields(new_run_option=6)
    assert train_settings(cfg, IDENTITY, MANIFEST) == settings


def test_calibration_settings_are_the_tree_fields_the_calibration_reads():
    settings = calibration_settings(_cfg())
    tree_fields = {f.name for f in dataclasses.fields(TreeConfig)} - _run_only(TreeConfig)
    assert set(settings) == {f"tree_{name}" for name in tree_fields} | {"calibration_max_records"}
    assert calibration_settings(_cfg("tree=medusa63")) == settings  # decoding-only choice
    assert calibration_settings(_cfg("tree.max_nodes=3")) != settings
    assert calibration_settings(_cfg("training.calibration_max_records=2")) != settings
