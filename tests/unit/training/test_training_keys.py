"""stage=train's skip/resume keys come from the config dataclasses: every field counts unless the
class names it in ``RUN_ONLY``, so a new field is compared without anyone listing it."""

from __future__ import annotations

import dataclasses

from medusa_train.config import TrainingConfig, TreeConfig, compose_config
from medusa_train.stages.train import calibration_key, run_key

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


def _cfg(*overrides: str):
    return compose_config(["model=hf", "model.name_or_path=some/model", *overrides])


def test_run_key_holds_every_training_field_but_run_only_and_the_inputs():
    key = run_key(_cfg(), IDENTITY, MANIFEST)
    fields = {f.name for f in dataclasses.fields(TrainingConfig)}
    assert set(TrainingConfig.RUN_ONLY) <= fields
    assert set(key) == (fields - set(TrainingConfig.RUN_ONLY)) | INPUTS
    assert key["global_batch_size"] == 8 * 1 and key["backbone_fingerprint"] == IDENTITY["fingerprint"]


def test_run_key_follows_what_changes_the_heads():
    key = run_key(_cfg(), IDENTITY, MANIFEST)
    for override in ("training.lr=0.5", "training.num_heads=2", "training=medusa2", "model.dtype=float16"):
        assert run_key(_cfg(override), IDENTITY, MANIFEST) != key, override
    # how the run goes, not what it trains; the same global batch split otherwise
    for override in ("training.logging_steps=1", "training.save_steps=7", "training.overwrite=true"):
        assert run_key(_cfg(override), IDENTITY, MANIFEST) == key, override
    split = _cfg("training.per_device_batch_size=4", "training.gradient_accumulation_steps=2")
    assert run_key(split, IDENTITY, MANIFEST) == key
    # when the data was written is not what it is
    assert run_key(_cfg(), IDENTITY, {**MANIFEST, "seconds": 99.0}) == key
    assert run_key(_cfg(), IDENTITY, {**MANIFEST, "counts": {"records": 4}}) != key


def test_a_new_training_field_is_compared_without_being_listed():
    @dataclasses.dataclass
    class WithNewField(TrainingConfig):
        new_option: int = 3

    cfg = _cfg()
    cfg.training = WithNewField()
    key = run_key(cfg, IDENTITY, MANIFEST)
    assert key["new_option"] == 3
    cfg.training = WithNewField(new_option=4)
    assert run_key(cfg, IDENTITY, MANIFEST) != key


def test_calibration_key_is_the_tree_fields_the_calibration_reads():
    key = calibration_key(_cfg())
    tree_fields = {f.name for f in dataclasses.fields(TreeConfig)} - set(TreeConfig.RUN_ONLY)
    assert set(key) == {f"tree_{name}" for name in tree_fields} | {"calibration_max_records"}
    assert calibration_key(_cfg("tree=medusa63")) == key  # decoding-only choice
    assert calibration_key(_cfg("tree.max_nodes=3")) != key
    assert calibration_key(_cfg("training.calibration_max_records=2")) != key
