"""The embedded corpus: deterministic, disjoint splits, well-formed and consistent conversations."""

from __future__ import annotations

import re
import time

import pytest

from medusa_train.data.embedded import (
    GLOSSARY,
    conversation_texts,
    embedded_conversations,
    embedded_prompts,
    generate_conversation,
    generate_conversations,
    split_of,
)


def test_same_seed_same_output_different_seed_different():
    assert generate_conversations(3, 50) == generate_conversations(3, 50)
    assert generate_conversations(3, 50) != generate_conversations(4, 50)
    assert embedded_conversations("eval", 20, seed=1) == embedded_conversations("eval", 20, seed=1)


def test_prefix_stable_in_n():
    """Conversation i does not depend on how many are asked for."""
    assert generate_conversations(0, 10) == generate_conversations(0, 40)[:10]
    assert generate_conversation("all", 0, 7) == generate_conversations(0, 8)[7]


def test_structure():
    convs = generate_conversations(0, 500)
    for conv in convs:
        assert len(conv) >= 2 and len(conv) % 2 == 0
        for i, message in enumerate(conv):
            assert set(message) == {"role", "content"}
            assert message["role"] == ("user" if i % 2 == 0 else "assistant")
            assert message["content"].strip() == message["content"] and message["content"]
    assert any(len(c) >= 4 for c in convs), "some conversations must be multi-turn"
    assert len({c[0]["content"] for c in convs}) > 400, "first prompts should be varied"


def test_splits_disjoint_and_labelled():
    train = embedded_conversations("train", 3000, seed=0)
    evals = embedded_conversations("eval", 300, seed=0) + embedded_conversations("eval", 100, seed=5)
    assert len(train) == 3000 and len(evals) == 400
    assert all(split_of(c) == "train" for c in train)
    assert all(split_of(c) == "eval" for c in evals)
    assert not {c[0]["content"] for c in train} & {c[0]["content"] for c in evals}
    assert embedded_prompts("eval", 10, seed=0) == embedded_conversations("eval", 10, seed=0)
    with pytest.raises(ValueError, match="unknown split"):
        embedded_conversations("test", 1)


def test_worked_arithmetic_is_correct():
    """Every worked 'a + b + c = d', 'a - b = c', 'a x b = c', 'a / b = c' in the corpus is true."""
    pattern = re.compile(r"((?:\d+ [-+x/] )+\d+) = (\d+)")
    found = 0
    for text in conversation_texts(generate_conversations(1, 2000)):
        for expr, result in pattern.findall(text):
            tokens = expr.split(" ")
            value = float(tokens[0])
            for op, num in zip(tokens[1::2], tokens[2::2], strict=True):
                value = {
                    "+": value + int(num),
                    "-": value - int(num),
                    "x": value * int(num),
                    "/": value / int(num),
                }[op]
            assert value == int(result), text
            found += 1
    assert found > 100


def test_followups_consistent_with_first_reply():
    """A 'Sort them alphabetically.' follow-up lists exactly the items of the first reply."""
    checked = 0
    for conv in generate_conversations(2, 3000):
        for i in range(2, len(conv), 2):
            if conv[i]["content"] == "Sort them alphabetically.":
                first = re.findall(r"^\d+\. (.+)$", conv[1]["content"], re.M)
                again = re.findall(r"^\d+\. (.+)$", conv[i + 1]["content"], re.M)
                assert again == sorted(first)
                checked += 1
    assert checked > 5


def test_glossary_fixed():
    assert len(GLOSSARY) == 120 and len({w for w, _, _ in GLOSSARY}) == 120


def test_fast_enough():
    start = time.perf_counter()
    generate_conversations(0, 5000)
    assert time.perf_counter() - start < 5.0
