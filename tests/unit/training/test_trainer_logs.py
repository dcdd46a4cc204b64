"""MedusaTrainer's logs: what each logged figure covers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import TrainingArguments

from medusa_train.training.trainer import MetricsScheduleCallback


@pytest.mark.parametrize(
    ("logging_steps", "resumed_with", "first_step"), [(2, 2, False), (3, 3, True), (2, 3, False)]
)
def test_top_k_is_counted_on_exactly_the_steps_the_trainer_logs(
    tmp_path, logging_steps, resumed_with, first_step
):
    """Top-k is counted on the steps the Trainer logs (every ``state.logging_steps``-th, step 1 with
    ``logging_first_step``) and the last: a run resumed with another ``logging_steps`` logs on the
    checkpoint's (its trainer state's), and a step counted but not logged would be pooled into the next
    log."""
    from transformers.trainer_callback import DefaultFlowCallback, TrainerControl, TrainerState

    args = TrainingArguments(
        output_dir=str(tmp_path), logging_steps=resumed_with, logging_first_step=first_step, report_to="none"
    )
    state = TrainerState(max_steps=7, logging_steps=logging_steps)
    module = SimpleNamespace(with_metrics=True)
    schedule, flow = MetricsScheduleCallback(), DefaultFlowCallback()
    for step in range(1, 8):
        control = TrainerControl()
        schedule.on_step_begin(args, state, control, model=module)
        state.global_step = step
        control = flow.on_step_end(args, state, control)
        control = schedule.on_step_end(args, state, control)
        assert module.with_metrics == control.should_log, step
