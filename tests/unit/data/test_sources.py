"""Readers of every data.format, and the documented bad-input rules."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from medusa_train.data.sources import Conversation, read_records
from medusa_train.errors import UserError
from medusa_train.stages import pretrain


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


SHAREGPT = [
    {
        "conversations": [
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello"},
            {"from": "human", "value": "More"},
        ]
    },
    {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "user", "value": "Q"},
            {"from": "assistant", "value": "A"},
        ]
    },
]


def test_sharegpt_jsonl_and_json_array_read_the_same_user_turns(tmp_path: Path) -> None:
    a = read_records("sharegpt", _jsonl(tmp_path / "a.jsonl", SHAREGPT))
    (tmp_path / "b.json").write_text(json.dumps(SHAREGPT, indent=1))
    b = read_records("sharegpt", tmp_path / "b.json")
    for res in (a, b):
        assert [r.turns for r in res.records] == [["Hi", "More"], ["Q"]]
        assert res.records[1].system == "Be brief."
        assert res.records[0].system is None
        assert not res.skipped
    assert [r.source_id for r in a.records] == ["a.jsonl:1", "a.jsonl:2"]
    assert [r.source_id for r in b.records] == ["b.json:1", "b.json:2"]


def test_sharegpt_leading_assistant_dropped_consecutive_users_joined(tmp_path: Path) -> None:
    rows = [
        {
            "conversations": [
                {"from": "gpt", "value": "Welcome"},
                {"from": "human", "value": "Q1"},
                {"from": "gpt", "value": "x"},
            ]
        },
        {
            "conversations": [
                {"from": "human", "value": "a"},
                {"from": "human", "value": "b"},
                {"from": "gpt", "value": "x"},
            ]
        },
        {"messages": [{"role": "user", "content": "openai style"}]},
    ]
    res = read_records("sharegpt", _jsonl(tmp_path / "s.jsonl", rows))
    assert [r.turns for r in res.records] == [["Q1"], ["a\n\nb"], ["openai style"]]
    assert res.repaired == {"leading assistant turns dropped": [1]}
    with pytest.raises(UserError, match=r"s.jsonl:1.*leading assistant"):
        read_records("sharegpt", tmp_path / "s.jsonl", strict=True)


def test_bad_lines_are_skipped_with_one_warning_or_raise_in_strict_mode(tmp_path: Path, caplog) -> None:
    rows = [
        SHAREGPT[0],
        "{not json",
        {"conversations": []},
        {"conversations": [{"from": "gpt", "value": "only the assistant"}]},
        {"other": 1},
        {"conversations": [{"from": "robot", "value": "?"}]},
        {"conversations": [{"from": "human", "value": "   "}]},
        SHAREGPT[1],
    ]
    path = _jsonl(tmp_path / "bad.jsonl", rows)
    res = read_records("sharegpt", path)
    assert [r.source_id for r in res.records] == ["bad.jsonl:1", "bad.jsonl:8"]
    assert res.skipped == {
        "malformed JSON": [2],
        "empty conversation": [3, 4, 7],
        "no 'conversations' field": [5],
        "unknown role 'robot'": [6],
    }
    assert res.num_skipped == 6
    with caplog.at_level(logging.WARNING):
        res.log_warning()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "malformed JSON; lines 2" in warnings[0].getMessage()
    assert warnings[0].getMessage().endswith("data.strict=true makes these errors")
    assert "strict" not in res.warning_text(strict_option=None)  # eval's prompts: no such setting
    with pytest.raises(UserError, match=r"bad.jsonl:2: malformed JSON"):
        read_records("sharegpt", path, strict=True)


def test_alpaca(tmp_path: Path) -> None:
    rows = [
        {"instruction": "Translate", "input": "chat", "output": "cat"},
        {"instruction": "Say hi", "input": "", "output": "hi"},
        {"input": "no instruction"},
    ]
    res = read_records("alpaca", _jsonl(tmp_path / "al.jsonl", rows))
    assert [r.turns for r in res.records] == [["Translate\n\nchat"], ["Say hi"]]
    assert res.skipped == {"no 'instruction' field": [3]}


def test_mtbench_keeps_every_turn(tmp_path: Path) -> None:
    rows = [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},
        {"question_id": 82, "turns": ["One turn."]},
    ]
    res = read_records("mtbench", _jsonl(tmp_path / "question.jsonl", rows))
    assert [r.turns for r in res.records] == [["Write a poem.", "Now shorter."], ["One turn."]]


def test_jsonl_prompt_key_and_max_records(tmp_path: Path) -> None:
    rows = [{"q": "first"}, {"prompt": "wrong key"}, {"q": ["t1", "t2"]}, {"q": "fourth"}]
    path = _jsonl(tmp_path / "p.jsonl", rows)
    res = read_records("jsonl", path, prompt_key="q")
    assert [r.turns for r in res.records] == [["first"], ["t1", "t2"], ["fourth"]]
    assert res.skipped == {"no 'q' field": [2]}
    assert [r.turns for r in read_records("jsonl", path, prompt_key="q", max_records=2).records] == [
        ["first"],
        ["t1", "t2"],
    ]


def test_text_chunks_at_line_boundaries(tmp_path: Path) -> None:
    lines = [f"line {i} " + "x" * 20 for i in range(10)]  # 28 characters + newline each
    path = tmp_path / "t.txt"
    path.write_text("\n".join(lines) + "\n")
    res = read_records("text", path, text_prompt_chars=60)
    chunks = [r.turns[0] for r in res.records]
    assert "\n".join(chunks) == "\n".join(lines)  # nothing lost, cut only at line ends
    assert all(len(c) >= 59 for c in chunks[:-1]) and all(c.count("\n") <= 2 for c in chunks)
    assert [r.source_id for r in res.records][:2] == ["t.txt:1", "t.txt:4"]


@pytest.mark.parametrize("newline", ["\n", "\r\n", "\r"])
def test_text_records_of_an_ordinary_file(tmp_path: Path, newline: str) -> None:
    """The records and line numbers of a text file, whichever line end it uses."""
    path = tmp_path / "t.txt"
    text = "alpha beta\ngamma\n\ndelta epsilon zeta\neta\n"
    path.write_bytes(text.replace("\n", newline).encode())
    res = read_records("text", path, text_prompt_chars=12)
    assert [(r.source_id, r.turns) for r in res.records] == [
        ("t.txt:1", ["alpha beta\ngamma"]),
        ("t.txt:3", ["\ndelta epsilon zeta"]),
        ("t.txt:5", ["eta"]),
    ]


def test_text_lines_end_at_line_feeds_only(tmp_path: Path) -> None:
    """A form feed, vertical tab, information separator, U+0085, U+2028 or U+2029 inside a line of a
    text file stays there (``str.splitlines`` would cut at each): the line numbers after it are the
    file's, and stage=pretrain trains its tokenizer on the same lines."""
    path = tmp_path / "t.txt"
    path.write_bytes("page one\fstill one\r\nsep\u2028same\x85line\vtoo\x1cx\u2029y\nlast\n".encode())
    res = read_records("text", path, text_prompt_chars=1)
    assert [(r.source_id, r.turns) for r in res.records] == [
        ("t.txt:1", ["page one\fstill one"]),
        ("t.txt:2", ["sep\u2028same\x85line\vtoo\x1cx\u2029y"]),
        ("t.txt:3", ["last"]),
    ]
    *_, tokenizer_texts = pretrain._text_documents(str(path), heldout_fraction=0.05)
    assert tokenizer_texts == ["page one\fstill one\n", "sep\u2028same\x85line\vtoo\x1cx\u2029y\n"]


def test_directory_of_files(tmp_path: Path) -> None:
    _jsonl(tmp_path / "b.jsonl", [{"prompt": "b"}])
    _jsonl(tmp_path / "a.jsonl", [{"prompt": "a"}])
    (tmp_path / "notes.md").write_text("ignored")
    res = read_records("jsonl", tmp_path)
    assert [(r.source_id, r.turns) for r in res.records] == [("a.jsonl:1", ["a"]), ("b.jsonl:1", ["b"])]


def test_hub_from_local_json_and_save_to_disk(tmp_path: Path) -> None:
    import datasets

    path = _jsonl(tmp_path / "sg.jsonl", SHAREGPT)
    res = read_records("hub", path, name="json", hub_format="sharegpt")
    assert [r.turns for r in res.records] == [["Hi", "More"], ["Q"]]
    assert res.records[0].source_id == "json:train:0"
    saved = tmp_path / "saved"
    datasets.Dataset.from_list([{"instruction": "Do it", "input": "", "output": "ok"}]).save_to_disk(
        str(saved)
    )
    res = read_records("hub", None, name=str(saved), hub_format="alpaca")
    assert [r.turns for r in res.records] == [["Do it"]]
    with pytest.raises(UserError, match="could not load dataset"):
        read_records("hub", tmp_path / "missing.jsonl", name="json")


def test_embedded_prompts_are_user_turns() -> None:
    res = read_records("embedded", None, num_prompts=5, seed=0)
    assert len(res.records) == 5
    assert all(
        isinstance(r, Conversation) and r.turns and all(t.strip() for t in r.turns) for r in res.records
    )
    assert [r.source_id for r in res.records] == [f"embedded:{i}" for i in range(5)]
    assert len(read_records("embedded", None, num_prompts=5, max_records=2).records) == 2


def test_missing_unreadable_and_empty_sources_fail_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        read_records("sharegpt", tmp_path / "nope.json")
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(UserError, match="not a UTF-8"):
        read_records("jsonl", tmp_path / "bin.jsonl")
    (tmp_path / "broken.json").write_text('[{"conversations": [}')
    with pytest.raises(UserError, match="does not parse"):
        read_records("sharegpt", tmp_path / "broken.json")
    _jsonl(tmp_path / "alpaca_as_sharegpt.jsonl", [{"instruction": "x"}])
    with pytest.raises(UserError, match=r"no usable record.*1 x no 'conversations' field") as err:
        read_records("sharegpt", tmp_path / "alpaca_as_sharegpt.jsonl")
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="data.format"):
        read_records("csv", tmp_path / "x")


def test_hostile_json_is_a_bad_record_not_a_crash(tmp_path: Path) -> None:
    """Nesting deeper than the parser recurses, a lone surrogate (valid JSON that no tokenizer can
    encode: refused here, not at tokenisation) and an integer too long to convert."""
    path = _jsonl(
        tmp_path / "hostile.jsonl",
        [
            '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}",
            '{"prompt": "ok \\ud800"}',
            '{"prompt": ["fine", "\\udfff"]}',
            '{"prompt": ' + "9" * 5000 + "}",
            {"prompt": "a good one"},
            {"prompt": "emoji \U0001f600 are fine"},
        ],
    )
    result = read_records("jsonl", path)
    assert [r.turns for r in result.records] == [["a good one"], ["emoji \U0001f600 are fine"]]
    assert result.skipped == {
        "JSON nested too deeply": [1],
        "'prompt' is not valid Unicode (a lone surrogate)": [2, 3],
        "malformed JSON": [4],
    }
    with pytest.raises(
        UserError, match=r"record hostile.jsonl:1: JSON nested too deeply \(data.strict=true\)"
    ):
        read_records("jsonl", path, strict=True)
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(UserError, match="nests too deeply"):
        read_records("sharegpt", tmp_path / "deep.json")


def test_jsonl_strings_holding_unicode_line_separators_are_one_record(tmp_path: Path) -> None:
    """U+2028, U+2029 and U+0085 are valid as they are inside a JSON string (``ensure_ascii=False``
    writes them so, and scraped chat text holds them): the record is read whole, and the line numbers
    of the records after it are the file's."""
    path = tmp_path / "seps.jsonl"
    rows = [{"prompt": "one\u2028two"}, {"prompt": ["a\u2029b", "c\x85d"]}, {"prompt": "plain"}]
    path.write_text("\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n", encoding="utf-8")
    result = read_records("jsonl", path, strict=True)
    assert [(r.source_id, r.turns) for r in result.records] == [
        ("seps.jsonl:1", ["one\u2028two"]),
        ("seps.jsonl:2", ["a\u2029b", "c\x85d"]),
        ("seps.jsonl:3", ["plain"]),
    ]
