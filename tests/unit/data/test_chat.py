"""ChatRenderer: the template text between turns, as exact token ids."""

from __future__ import annotations

import pytest

from medusa_train.data.chat import ChatRenderer
from medusa_train.data.sources import Conversation
from medusa_train.data.tokenizer import train_tokenizer
from medusa_train.errors import UserError

LLAMA2_STYLE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)
"""Llama-2-chat's shape: a space between the reply and its end-of-turn token."""


@pytest.mark.parametrize("template", ["own", "llama2"])
def test_a_reply_ended_by_eos_is_followed_by_the_next_turn_only(template: str) -> None:
    """The generated EOS closes the reply: the continuation holds no second one (with Llama-2's
    ``' ' + eos_token`` too); a reply cut without EOS gets the template's own closing text."""
    tok = train_tokenizer(["why is the cat on the mat?", "tell me more about the dog."] * 20, 300)
    if template == "llama2":
        tok.chat_template = LLAMA2_STYLE
    renderer = ChatRenderer(tok)
    conv = Conversation("r", ["why is the cat big?", "and the dog?"])
    msgs = [{"role": "user", "content": conv.turns[0]}, {"role": "assistant", "content": "SENTINEL"}]
    full = tok.apply_chat_template(
        [*msgs, {"role": "user", "content": conv.turns[1]}], add_generation_prompt=True, tokenize=False
    )
    closing = full[full.index("SENTINEL") + len("SENTINEL") :]  # the template's text after the reply
    cut = renderer.continuation_ids(conv, ["it is"], None)
    ended = renderer.continuation_ids(conv, ["it is"], tok.eos_token_id)
    assert tok.decode(cut) == closing
    assert tok.decode(ended) == closing.lstrip().removeprefix(tok.eos_token)  # the next turn's text only


@pytest.mark.parametrize("template", ["own", "llama2"])
def test_spaced_eos_is_true_for_a_template_with_whitespace_before_its_eos_only(template: str) -> None:
    """What distill records in its settings: whether the whitespace before EOS is dropped with it."""
    tok = train_tokenizer(["why is the cat on the mat?", "tell me more about the dog."] * 20, 300)
    if template == "llama2":
        tok.chat_template = LLAMA2_STYLE
    conv = Conversation("r", ["why is the cat big?", "and the dog?"], system=None)
    assert ChatRenderer(tok).spaced_eos(conv, [tok.eos_token_id]) is (template == "llama2")
    assert not ChatRenderer(tok).spaced_eos(conv, [tok.bos_token_id])  # not the text the reply closes with


REFUSES_SYSTEM = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""Gemma's rule: no system message."""


def test_a_conversation_the_template_refuses_is_one_line_naming_the_record() -> None:
    tok = train_tokenizer(["why is the cat on the mat?", "tell me more about the dog."] * 20, 300)
    tok.chat_template = REFUSES_SYSTEM
    renderer = ChatRenderer(tok)
    assert renderer.prompt_ids(Conversation("data.jsonl:6", ["why?"]))
    with pytest.raises(
        UserError, match=r"^record data.jsonl:7: the chat template .* \(System role not supported\)"
    ):
        renderer.prompt_ids(Conversation("data.jsonl:7", ["why?"], system="Be brief."))
