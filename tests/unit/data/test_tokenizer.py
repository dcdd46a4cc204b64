"""The embedded byte-level BPE tokenizer: exact round trip, chat template, save/load."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from medusa_train.data.embedded import conversation_texts, generate_conversations
from medusa_train.data.tokenizer import ASSISTANT, BOS, END, PAD, USER, train_tokenizer


@pytest.fixture(scope="module")
def convs():
    return generate_conversations(0, 600)


@pytest.fixture(scope="module")
def tok(convs):
    return train_tokenizer(conversation_texts(convs), vocab_size=600)


@pytest.mark.parametrize(
    "text",
    [
        "Hello world.",
        "  leading and trailing spaces  ",
        "tabs\tand\nnew lines\r\n\n",
        "Ünïcödé: naïve café, 中文字符, 日本語, emoji 😀👍🏽, Ελληνικά, עברית",
        "numbers 12345 and 3.14159, punctuation !?;:'\"()[]{}",
        "",
    ],
)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_special_tokens(tok):
    assert tok.eos_token == END and tok.bos_token == BOS and tok.pad_token == PAD
    assert len({tok.eos_token_id, tok.bos_token_id, tok.pad_token_id}) == 3
    assert len(tok) <= 600
    # digits are single tokens
    assert len(tok.encode("2026", add_special_tokens=False)) == 4


def test_chat_template(tok, convs):
    conv = next(c for c in convs if len(c) >= 4)
    text = tok.apply_chat_template(conv, tokenize=False)
    assert text.startswith(BOS + USER + conv[0]["content"] + END + ASSISTANT + conv[1]["content"] + END)
    assert text.endswith(conv[-1]["content"] + END)
    prompt = tok.apply_chat_template(conv[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == BOS + USER + conv[0]["content"] + END + ASSISTANT
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert ids.count(tok.eos_token_id) == len(conv)  # one end-of-turn per message


def test_assistant_mask(tok, convs):
    conv = convs[0]
    out = tok.apply_chat_template(conv, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    trained = [i for i, m in zip(ids, mask, strict=True) if m]
    assert tok.decode(trained) == "".join(m["content"] + END for m in conv if m["role"] == "assistant")


def test_save_load(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "Tell me a story about Anna. 😀"
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.decode(loaded.encode(text)) == text
    assert loaded.eos_token == END and loaded.pad_token == PAD and loaded.bos_token == BOS
    messages = [{"role": "user", "content": "Hi"}]
    assert (
        loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        == BOS + USER + "Hi" + END + ASSISTANT
    )


def test_vocab_too_small():
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["abc"], vocab_size=100)
