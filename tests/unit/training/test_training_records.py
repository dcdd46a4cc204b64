"""The records stage=train trains and calibrates on: truncation, usable records, the split, the
draft vocabulary's target counts."""

from __future__ import annotations

import datasets
import pytest
import torch

from medusa_train.errors import UserError
from medusa_train.training.records import (
    Records,
    draft_vocabulary,
    target_counts,
    training_data,
    usable_indices,
)


def _ds(rows: list[tuple[list[int], list[int]]]) -> datasets.Dataset:
    return datasets.Dataset.from_dict(
        {
            "source_id": [f"r{i}" for i in range(len(rows))],
            "input_ids": [ids for ids, _ in rows],
            "loss_mask": [mask for _, mask in rows],
        }
    )


ROWS = [
    ([1, 2, 3, 4, 5], [0, 0, 1, 1, 1]),  # targets at 2..4
    ([1, 2, 3, 4, 5], [0, 1, 0, 0, 0]),  # no head target (head 1 needs position >= 2)
    ([6, 7, 8, 8, 9], [0, 0, 0, 1, 1]),  # targets at 3..4: outside a window of 3
]


def test_usable_records_have_a_head_target_inside_the_window():
    ds = _ds(ROWS)
    assert usable_indices(ds, 5) == [0, 2]
    assert usable_indices(ds, 3) == [0]
    assert usable_indices(ds.select([]), 5) == []


def test_records_are_truncated_and_counted():
    records = Records(_ds(ROWS), [0, 2], 4)
    assert len(records) == 2
    assert records[1] == {"input_ids": [6, 7, 8, 8], "loss_mask": [0, 0, 0, 1]}
    assert records.count_tokens() == 8


def test_target_counts_are_the_loss_masked_tokens_from_position_two():
    counts = target_counts(Records(_ds(ROWS), [0, 2], 5), vocab_size=10)
    expected = torch.zeros(10, dtype=counts.dtype)
    for token in (3, 4, 5, 8, 9):
        expected[token] += 1
    assert torch.equal(counts, expected)


def test_without_held_out_records_the_calibration_uses_training_records():
    data = training_data(_ds(ROWS), eval_fraction=0.0, max_len=5, calibration_max_records=1)
    assert data.calibration_split == "train" and len(data.train) == 2
    assert data.calibration == [data.train[0]]
    held = training_data(_ds(ROWS * 20), eval_fraction=0.5, max_len=5, calibration_max_records=100)
    assert held.calibration_split == "heldout"
    assert 0 < len(held.calibration) and len(held.calibration) + len(held.train) == 40


def test_no_usable_record_and_a_draft_vocabulary_too_large_are_user_errors():
    with pytest.raises(UserError, match="no training data"):
        training_data(_ds(ROWS[1:2]), eval_fraction=0.0, max_len=5, calibration_max_records=4)
    records = Records(_ds(ROWS), [0, 2], 5)
    with pytest.raises(UserError, match="draft_vocab_size=11 is larger than the backbone's vocabulary"):
        draft_vocabulary(records, vocab_size=10, size=11)
    # All V tokens: no serving layout (vLLM reads a token map only when N < V), so refused too.
    with pytest.raises(UserError, match=r"draft_vocab_size=10 is the backbone's whole .*at most 9.*=own"):
        draft_vocabulary(records, vocab_size=10, size=10)
    token_map, coverage = draft_vocabulary(records, vocab_size=10, size=5)
    assert token_map.tolist() == [3, 4, 5, 8, 9] and coverage == 1.0
