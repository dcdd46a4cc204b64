"""The export's model card: what it tells a user about each engine's loader (docs/pipeline.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from medusa_train.heads import MedusaHeads
from medusa_train.report import model_card


def _card(
    num_heads: int, num_layers: int = 1, base: str = "meta-llama/Llama-3.1-8B", pickle: bool = False
) -> str:
    heads = MedusaHeads(16, 40, num_heads, num_layers, base_model_name_or_path=base)
    return model_card(
        heads=heads,
        heads_config={},
        formats=["medusa", "vllm"],
        tree_name="calibrated",
        tree_size=80,
        manifest=None,
        calibration=None,
        report=None,
        export_dir=Path("/srv/run/export"),
        pickle=pickle,
    )


@pytest.mark.parametrize(
    ("num_heads", "says"),
    [
        (4, "here head 5 stays random"),
        (3, "here heads 4..5 stay random"),
        (5, "every head loads"),
        (7, "heads 6..7 are dropped"),
    ],
)
def test_card_warns_that_fasterdecoding_assumes_five_heads(num_heads: int, says: str) -> None:
    card = _card(num_heads)
    assert says in card and "loads the weights non-strictly" in card
    assert ("Always pass `medusa_choices`" in card) == (num_heads < 5)
    assert f'"num_speculative_tokens": {num_heads}' in card and f"at most {num_heads}" in card
    assert f"--num_medusa_heads {num_heads} --max_medusa_token_len 80 " in card  # the tree has 80 nodes


def test_card_says_what_base_model_name_or_path_is_and_how_to_get_the_pickle() -> None:
    hub = _card(4)
    assert "is a Hugging Face Hub id" in hub and "--tokenizer-config-path" not in hub
    assert "re-run `python -m medusa_train stage=export export.write_pickle=true`" in hub
    local = _card(4, base="/models/llama", pickle=True)
    assert "is an absolute path on the machine that exported" in local
    assert "--tokenizer-config-path /models/llama/tokenizer_config.json" in local
    assert "which this export has" in local and "reads `medusa_lm_head.pt` when it is there" in local
    assert 'MedusaModel.from_pretrained("/srv/run/export/medusa"' in local
    assert "repeat one residual block" not in local and "repeat one residual block 2 times" in _card(4, 2)
