"""What stage=train trains and calibrates on: distilled records truncated to ``training.max_seq_len``.

The distilled data (``data/distilled.py``) is split into the training records and the held-out
ones the tree calibration measures on (:func:`training_data`); a record counts only when a head has
a target inside the truncation window. With ``training.head_projection=truncated`` the draft
vocabulary is the most frequent head targets of the training records (:func:`draft_vocabulary`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from medusa_train.data.distilled import split_heldout
from medusa_train.draft_vocab import draft_token_map
from medusa_train.errors import UserError

log = logging.getLogger(__name__)


class Records(torch.utils.data.Dataset):
    """Truncated ``input_ids``/``loss_mask`` records of a distilled split, read lazily."""

    def __init__(self, ds, indices: list[int], max_len: int) -> None:
        self.ds, self.indices, self.max_len = ds, indices, max_len

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict:
        record = self.ds[self.indices[i]]
        return {
            "input_ids": list(record["input_ids"][: self.max_len]),
            "loss_mask": list(record["loss_mask"][: self.max_len]),
        }

    def count_tokens(self) -> int:
        return sum(min(len(r), self.max_len) for r in self.ds.select(self.indices)["input_ids"])


def usable_indices(ds, max_len: int) -> list[int]:
    """Records with at least one head target inside the truncation window (head 1 needs index >= 2)."""
    if not len(ds):
        return []
    return [i for i, m in enumerate(ds["loss_mask"]) if sum(m[2:max_len]) > 0]


@dataclass
class TrainingData:
    """The training records and the records the tree calibration measures on."""

    train: Records
    calibration: list[dict]
    """At most ``calibration_max_records`` truncated records."""
    calibration_split: str
    """heldout, or train when nothing is held out."""


def training_data(ds, eval_fraction: float, max_len: int, calibration_max_records: int) -> TrainingData:
    """Split the distilled dataset ``ds``; the calibration falls back to training records (with a
    warning) when no usable record is held out.

    Raises:
        UserError: no usable training record.
    """
    train_ds, held_ds = split_heldout(ds, eval_fraction)
    train_idx = usable_indices(train_ds, max_len)
    if not train_idx:
        raise UserError(
            f"no training data: {len(ds)} distilled records, {len(train_ds)} after holding out "
            f"data.eval_fraction={eval_fraction}, none with a loss-masked token inside training.max_seq_len="
            f"{max_len}: lower data.eval_fraction or distill more data"
        )
    train = Records(train_ds, train_idx, max_len)
    held_idx = usable_indices(held_ds, max_len)
    if held_idx:
        calib, split = Records(held_ds, held_idx, max_len), "heldout"
    else:
        log.warning(
            "no held-out records (data.eval_fraction=%s): calibrating on training records", eval_fraction
        )
        calib, split = train, "train"
    return TrainingData(train, [calib[i] for i in range(min(len(calib), calibration_max_records))], split)


def target_counts(records: Records, vocab_size: int) -> torch.Tensor:
    """``(V,)`` how often each token is a head target in the training split: loss-masked tokens at
    positions 2 .. max_len - 1 of the truncated records (head 1 at position 0 predicts position 2)."""
    rows = records.ds.select(records.indices)
    picked = [
        np.asarray(ids[2 : records.max_len])[np.asarray(mask[2 : records.max_len], dtype=bool)]
        for ids, mask in zip(rows["input_ids"], rows["loss_mask"], strict=True)
    ]
    flat = np.concatenate(picked) if picked else np.zeros(0, dtype=np.int64)
    counts = np.bincount(flat.astype(np.int64), minlength=vocab_size)[:vocab_size]
    return torch.from_numpy(counts)


def check_draft_vocab_size(size: int, vocab_size: int) -> None:
    """Refuse a draft vocabulary of ``size`` tokens that is not smaller than the backbone's
    ``vocab_size``: truncated heads over the whole vocabulary have no serving layout (vLLM reads a
    token map only when ``truncated_vocab_size < vocab_size``), so export would refuse them.

    Raises:
        UserError: ``size >= vocab_size`` (one line saying what to set instead).
    """
    if size >= vocab_size:
        what = "the backbone's whole" if size == vocab_size else "larger than the backbone's"
        raise UserError(
            f"training.draft_vocab_size={size} is {what} vocabulary ({vocab_size} tokens): "
            f"truncated heads need fewer tokens (vLLM reads their token map only then): pick at most "
            f"{vocab_size - 1}, or train full-vocabulary heads with training.head_projection=own and "
            "training.draft_vocab_size unset"
        )


def draft_vocabulary(train: Records, vocab_size: int, size: int) -> tuple[torch.Tensor, float]:
    """``(token_map (size,), coverage)``: the ``size`` most frequent head targets of ``train`` and
    the fraction of the targets they cover (``training.head_projection=truncated``).

    Raises:
        UserError: ``size`` is not smaller than the backbone's vocabulary (:func:`check_draft_vocab_size`).
    """
    check_draft_vocab_size(size, vocab_size)
    token_map, coverage = draft_token_map(target_counts(train, vocab_size), size)
    log.info(
        "draft vocabulary: the %d most frequent target tokens cover %.2f%% of the training targets",
        size,
        100 * coverage,
    )
    return token_map, coverage
