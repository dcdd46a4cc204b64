"""scripts/bench_distill.py's full-batch step ceiling runs end to end on a tiny model."""

from __future__ import annotations

import pytest

from medusa_train.engines.base import GenRequest
from medusa_train.engines.inprocess import ContinuousBatcher
from tests.helpers.models import tiny_model
from tests.helpers.scripts import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_distill")


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=1, vocab=64)


def test_without_eos_every_row_runs_to_the_cap(model):
    """The ceiling's timing runs rely on this: no EOS id, so every row makes exactly max_new_tokens."""
    replies = {}
    batcher = ContinuousBatcher(model, batch_size=4, pad_id=0, eos_ids=[], max_new_tokens=7)
    batcher.run(
        [GenRequest(i, [5 + i, 9, 11]) for i in range(4)], lambda r, new: replies.__setitem__(r.key, new)
    )
    assert sorted(replies) == [0, 1, 2, 3] and all(len(v) == 7 for v in replies.values())
    assert batcher.stats == {"prefills": 1, "decode_steps": 6, "row_steps": 24}


def test_step_ceiling_reports_every_batch_size(bench, model):
    result = bench.step_ceiling(model, 0, [1, 4], context=8, tokens=17, repeats=1)
    assert result["context"] == 8
    assert set(result["step_ms"]) == {1, 4} and all(ms > 0 for ms in result["step_ms"].values())
    assert result["ceiling_vs_first"][1] == 1.0
    # The ratio recomputed from the reported (rounded) step times: rounding both sides can move it by 0.1.
    expected = 4 * result["step_ms"][1] / result["step_ms"][4]
    assert result["ceiling_vs_first"][4] == pytest.approx(expected, abs=0.15)


def test_library_batch_and_ours_equal_unbatched_generate(bench, model):
    """The --library comparison: transformers' generate_batch and our batcher, both greedy-exact."""
    prompts = [[5 + i, 9, 11, 3 + 2 * i][: 2 + i % 3] for i in range(6)]
    reference = bench.generate_reference(model, prompts, [7], 0, 6)
    theirs, seconds = bench.library_batch(model, prompts, [7], 0, 4, 6)
    ours = {}
    ContinuousBatcher(model, batch_size=4, pad_id=0, eos_ids=[7], max_new_tokens=6).run(
        [GenRequest(i, p) for i, p in enumerate(prompts)], lambda r, new: ours.__setitem__(r.key, new)
    )
    assert theirs == reference == ours and seconds > 0
