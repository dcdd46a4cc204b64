"""Chat tokenizers built without a download, with an added token that is not special (``<think>``, as
Qwen's): the project's fast byte-level BPE, and a slow one (transformers' Python backend); and Phi-3's
shape of chat (:func:`phi3_style`: a newline after each turn's EOS, which drops it).

A slow tokenizer's ``split_special_tokens=True`` ignores every added token, special or not; a fast
one only the special ones. These two let a test check that our encodings do not depend on which.
"""

from __future__ import annotations

from transformers import AddedToken, ByT5Tokenizer

from medusa_train.data.tokenizer import BOS, CHAT_TEMPLATE, END, PAD, SPECIAL_TOKENS, train_tokenizer

PHI3_STYLE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""Phi-3-instruct's shape: a newline after each role token and after each turn's ``<|end|>``."""

THINK = "<think>"
"""The added token that is not special."""


def fast_chat_tokenizer(**think: bool):
    """The project's byte-level BPE chat tokenizer (fast) with :data:`THINK` added, not special
    (``think``: its ``AddedToken`` flags, ``lstrip=True``, ...)."""
    tok = train_tokenizer(
        ["why is the cat on the mat?", "tell me more about the dog.", "it is big"] * 20, 300
    )
    tok.add_tokens([AddedToken(THINK, special=False, normalized=False, **think)])
    return tok


def slow_chat_tokenizer(**think: bool):
    """ByT5's byte tokenizer (transformers' Python backend: no files, nothing downloaded) with the
    project's chat special tokens and template, and :data:`THINK` added, not special (``think``: its
    ``AddedToken`` flags, ``lstrip=True``, ...)."""
    tok = ByT5Tokenizer(extra_ids=0)
    tok.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS], special_tokens=True
    )
    tok.add_tokens([AddedToken(THINK, special=False, normalized=False, **think)])
    tok.bos_token, tok.eos_token, tok.pad_token = BOS, END, PAD
    tok.chat_template = CHAT_TEMPLATE
    assert not tok.is_fast
    return tok


def phi3_style(tok):
    """``tok`` (fast or slow) with :data:`PHI3_STYLE` as its chat template and its EOS ``<|end|>`` with
    ``rstrip=True``, as Phi-3-instruct's tokenizer.json has it: its own call drops the newline after it."""
    tok.add_tokens([AddedToken(END, special=True, normalized=False, rstrip=True)], special_tokens=True)
    tok.chat_template = PHI3_STYLE
    assert tok.added_tokens_decoder[tok.eos_token_id].rstrip
    return tok
