"""data/: every sample file reads as documented, data/README.md lists them all, and its commands compose."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from medusa_train.config import compose_config
from medusa_train.data.sources import read_records

DATA = Path(__file__).resolve().parents[2] / "data"

# (format, path under data/) -> user turns per record, in order
EXPECTED = {
    ("sharegpt", "sharegpt/chat.json"): [2, 1, 1, 1],
    ("sharegpt", "sharegpt/chat.jsonl"): [2, 1, 1],
    ("sharegpt", "sharegpt"): [2, 1, 1, 1, 2, 1, 1],  # the folder: both files, in name order
    ("alpaca", "alpaca/instructions.json"): [1, 1, 1, 1, 1],
    ("mtbench", "mt_bench/question.jsonl"): [2, 2, 2, 2],
    ("jsonl", "prompts.jsonl"): [1, 1, 1, 2, 1, 1],
    ("text", "text/harbour.txt"): [1] * 14,
}


@pytest.mark.parametrize(("fmt", "name"), list(EXPECTED))
def test_every_sample_reads_cleanly(fmt: str, name: str) -> None:
    result = read_records(fmt, DATA / name)
    assert [len(c.turns) for c in result.records] == EXPECTED[fmt, name]
    assert not result.skipped
    assert all(t.strip() for c in result.records for t in c.turns)
    assert len({c.source_id for c in result.records}) == len(result.records)


def test_sharegpt_samples_show_the_documented_rules() -> None:
    array = read_records("sharegpt", DATA / "sharegpt/chat.json")
    assert array.records[1].system == "You are a patient maths tutor. Show every step."
    assert array.repaired == {"leading assistant turns dropped": [3]}  # the greeting of record 3
    assert array.records[2].turns == ["Write a two-line poem about a lighthouse in fog."]
    assert array.records[3].turns == [
        "I need to move Thursday's meeting with Priya.\n\n"
        "Draft a short, polite e-mail asking for Friday morning instead."
    ]
    openai_style = read_records("sharegpt", DATA / "sharegpt/chat.jsonl").records[2]
    assert openai_style.system == "Answer in one sentence."
    assert openai_style.turns == ["Why does bread dough need to rest?"]


def test_alpaca_and_text_samples() -> None:
    alpaca = read_records("alpaca", DATA / "alpaca/instructions.json").records
    assert alpaca[0].turns == ["List three ways to save water at home."]  # empty input: instruction only
    assert alpaca[2].turns == ["Translate to French.\n\nThe train leaves at seven."]
    text = (DATA / "text/harbour.txt").read_text()
    chunks = read_records("text", DATA / "text/harbour.txt", text_prompt_chars=400).records
    assert " ".join(" ".join(c.turns[0].split()) for c in chunks) == " ".join(text.split())


def test_readme_lists_every_sample_and_its_commands_compose() -> None:
    readme = (DATA / "README.md").read_text()
    files = sorted(str(p.relative_to(DATA)) for p in DATA.rglob("*") if p.is_file() and p.name != "README.md")
    assert files == sorted({name for _, name in EXPECTED if (DATA / name).is_file()})
    for name in files:
        assert f"`{name}`" in readme, f"data/README.md does not describe {name}"
    commands = re.findall(r"^python -m medusa_train (.+?)(?:\s+#.*)?$", readme, flags=re.M)
    assert len(commands) >= len(files)
    for command in commands:
        overrides = shlex.split(command)
        cfg = compose_config(overrides)  # every key exists and the combination is valid
        for value in (cfg.data.path, cfg.eval.path):
            if value:
                assert (DATA.parent / value).exists(), f"{command}: {value} does not exist"
