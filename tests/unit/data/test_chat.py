"""ChatRenderer: the template text between turns, as exact token ids."""

from __future__ import annotations

import inspect

import pytest

from medusa_train.data.chat import ChatRenderer, text_ids
from medusa_train.data.regenerate import distill_records
from medusa_train.data.sources import Conversation
from medusa_train.data.tokenizer import CHAT_TEMPLATE, train_tokenizer
from medusa_train.errors import UserError
from tests.helpers.tokenizers import PHI3_STYLE, THINK, fast_chat_tokenizer, phi3_style, slow_chat_tokenizer

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


@pytest.mark.parametrize("kind", ["fast", "slow"])
def test_stripped_eos_is_true_for_whitespace_after_an_eos_with_rstrip_only(kind: str) -> None:
    """What distill records in its settings: whether the whitespace after EOS is dropped (Phi-3's
    ``<|end|>`` and newline with ``rstrip``); not where the token keeps it, nor where the template writes
    none after it, nor for an id that is not the text the reply closes with; a token that keeps it keeps
    it in the continuation."""
    make = fast_chat_tokenizer if kind == "fast" else slow_chat_tokenizer
    conv = Conversation("r", ["why is the cat big?", "and the dog?"], system=None)
    phi3 = phi3_style(make())
    assert ChatRenderer(phi3).stripped_eos(conv, [phi3.eos_token_id])
    assert not ChatRenderer(phi3).stripped_eos(conv, [phi3.bos_token_id])
    phi3.chat_template = CHAT_TEMPLATE  # the project's: <|user|> right after EOS
    assert not ChatRenderer(phi3).stripped_eos(conv, [phi3.eos_token_id])
    kept = make()  # its own template: no whitespace after EOS
    assert not ChatRenderer(kept).stripped_eos(conv, [kept.eos_token_id])
    kept.chat_template = PHI3_STYLE  # a newline after EOS, which the token keeps
    assert not ChatRenderer(kept).stripped_eos(conv, [kept.eos_token_id])
    assert not ChatRenderer(kept).spaced_eos(conv, [kept.eos_token_id])
    cont = ChatRenderer(kept).continuation_ids(conv, ["it is"], kept.eos_token_id)
    assert kept.decode(cont) == "\n<|user|>\nand the dog?<|end|>\n<|assistant|>\n"  # as its own call keeps it


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


class _Scripted:
    """An engine that answers turn i of every conversation with ``replies[i]``, its EOS appended."""

    def __init__(self, tok, replies: list[str]) -> None:
        self.tok, self.replies = tok, replies

    def run(self, requests, on_done) -> None:
        queue = list(requests)
        while queue:
            req = queue.pop(0)
            turn = sum(m["role"] == "assistant" for m in req.messages)
            new = self.tok(self.replies[turn], add_special_tokens=False)["input_ids"] + [
                self.tok.eos_token_id
            ]
            follow = on_done(req, new)
            if follow is not None:
                queue.append(follow)


def test_a_distilled_record_is_the_template_rendering_with_its_generation_mask() -> None:
    """A multi-turn record built turn by turn (prompt, reply, continuation, ...) is the chat template's
    rendering of the whole conversation, and its loss mask is the template's ``{% generation %}`` mask:
    each reply with its EOS, nothing of the system, user or generation-prompt text."""
    tok = train_tokenizer(
        ["why is the cat on the mat?", "tell me more about the dog.", "it is big"] * 20, 300
    )
    renderer, conv, replies, record = _three_turn_record(tok)
    rendered = tok.apply_chat_template(
        renderer.messages(conv, replies, False), return_dict=True, return_assistant_tokens_mask=True
    )
    assert record.input_ids == rendered["input_ids"]
    assert record.loss_mask == rendered["assistant_masks"] and sum(record.loss_mask) == sum(
        len(tok(r, add_special_tokens=False)["input_ids"]) + 1 for r in replies
    )


def _three_turn_record(tok):
    """A system prompt and three turns answered by scripted replies, each ending with EOS: the renderer,
    the conversation, the replies and its one distilled record."""
    renderer = ChatRenderer(tok)
    conv = Conversation("r", ["why is the cat big?", "and the dog?", "ok"], system="be brief")
    replies = ["it is big", "the dog is red", "more"]
    (record,) = distill_records(
        _Scripted(tok, replies),
        renderer,
        [conv],
        [renderer.prompt_ids(conv)],
        max_context=10_000,
        eos_ids=[tok.eos_token_id],
    )
    return renderer, conv, replies, record


@pytest.mark.parametrize("kind", ["fast", "slow"])
def test_a_record_drops_the_whitespace_after_an_eos_with_rstrip_as_the_tokenizer_does(kind: str) -> None:
    """Phi-3's ``<|end|>`` has ``rstrip=True``: the tokenizer's own call on the whole conversation drops
    the newline the template writes after it. A multi-turn record (prompt, reply and its EOS,
    continuation, ...) is that call's ids, with a fast and a slow tokenizer; a reply cut without EOS
    keeps the template's own closing text, which the tokenizer encodes with the same rule."""
    tok = phi3_style(fast_chat_tokenizer() if kind == "fast" else slow_chat_tokenizer())
    renderer, conv, replies, record = _three_turn_record(tok)
    whole = tok.apply_chat_template(renderer.messages(conv, replies, False), tokenize=True, return_dict=True)
    assert record.input_ids == whole["input_ids"]
    assert "\n" not in tok.decode(record.input_ids).replace("|>\n", "")  # no newline after an EOS
    assert sum(record.loss_mask) == sum(
        len(tok(r, add_special_tokens=False)["input_ids"]) + 1 for r in replies
    )
    cut = renderer.continuation_ids(conv, ["it is"], None)
    assert (
        cut
        == tok("<|end|>\n<|user|>\nand the dog?<|end|>\n<|assistant|>\n", add_special_tokens=False)[
            "input_ids"
        ]
    )
    assert cut[0] == tok.eos_token_id and cut[1:] == renderer.continuation_ids(
        conv, ["it is"], tok.eos_token_id
    )


def _special_ids(tok, ids: list[int]) -> list[int]:
    """The special ids of ``ids``, in order."""
    special = set(tok.all_special_ids)
    return [i for i in ids if i in special]


def test_special_token_strings_in_messages_are_text_and_the_templates_markup_is_special() -> None:
    """A prompt quoting ``<|end|>`` (the EOS), ``<|assistant|>`` or ``<|bos|>`` gets no special id for it
    (it tokenised to the EOS id: a fake end of turn inside the user's message); the template's own
    markup keeps its ids. The text is unchanged, and the ids are what transformers'
    ``apply_chat_template(..., sanitize_control_tokens=True)`` gives where it has that option."""
    tok = train_tokenizer(["why is the cat on the mat?", "tell me more about the dog."] * 20, 300)
    renderer = ChatRenderer(tok)
    quoted = Conversation(
        "r", ["why <|end|> is<|assistant|>the cat?", "and <|bos|><|end|>"], system="be <|user|> brief"
    )
    plain = Conversation("r", ["why is the cat?", "and"], system="be brief")
    for ids, reference in [
        (renderer.prompt_ids(quoted), renderer.prompt_ids(plain)),
        (renderer.turn_prompt_ids(quoted, ["it <|end|> is"]), renderer.turn_prompt_ids(plain, ["it is"])),
        (renderer.continuation_ids(quoted, ["it"], None), renderer.continuation_ids(plain, ["it"], None)),
    ]:
        assert _special_ids(tok, ids) == _special_ids(tok, reference)  # the template's markup alone
        assert tok.decode(ids).count("<|end|>") > _special_ids(tok, ids).count(tok.eos_token_id)
    rendered = tok.apply_chat_template(
        renderer.messages(quoted, [], True), add_generation_prompt=True, tokenize=False
    )
    assert tok.decode(renderer.prompt_ids(quoted)) == rendered
    if "sanitize_control_tokens" in inspect.signature(tok.apply_chat_template).parameters:
        for replies in ([], ["it <|end|> is"]):
            sanitized = tok.apply_chat_template(
                renderer.messages(quoted, replies, True),
                add_generation_prompt=True,
                sanitize_control_tokens=True,
            )["input_ids"]
            assert renderer.turn_prompt_ids(quoted, replies) == sanitized


def test_a_later_user_turn_quoting_the_eos_adds_no_eos_to_the_record() -> None:
    """The record of a conversation whose second user turn quotes the EOS: its special ids are the
    template's markup and the replies' EOS, exactly those of the same conversation without the quote."""
    tok = train_tokenizer(["why is the cat on the mat?", "tell me more about the dog."] * 20, 300)
    renderer = ChatRenderer(tok)
    records = [
        Conversation("q", ["why is the cat big?", "what does <|end|> mean?"]),
        Conversation("p", ["why is the cat big?", "what does mean?"]),
    ]
    quoted, plain = distill_records(
        _Scripted(tok, ["it is big", "a word"]),
        renderer,
        records,
        [renderer.prompt_ids(c) for c in records],
        max_context=10_000,
        eos_ids=[tok.eos_token_id],
    )
    assert _special_ids(tok, quoted.input_ids) == _special_ids(tok, plain.input_ids)
    assert tok.decode(quoted.input_ids).count("<|end|>") == 1 + _special_ids(tok, plain.input_ids).count(
        tok.eos_token_id
    )


def test_a_tokenizer_that_encodes_a_newline_as_nothing_keeps_every_piece(monkeypatch) -> None:
    """``_encode`` encodes a piece after a marked string behind a newline it then cuts off; a tokenizer
    that gives no id for the newline alone must not lose the first piece (it matched an empty prefix)."""
    tok = train_tokenizer(["why is the cat on the mat?", "tell me more about the dog."] * 20, 300)
    renderer = ChatRenderer(tok)
    whole = renderer.prompt_ids(Conversation("r", ["why <|end|> is the cat?"]))
    encode = renderer._encode_piece
    monkeypatch.setattr(
        renderer, "_encode_piece", lambda text, plain: [] if text == "\n" else encode(text, plain)
    )
    assert renderer.prompt_ids(Conversation("r", ["why <|end|> is the cat?"])) == whole


@pytest.mark.parametrize("kind", ["fast", "slow"])
def test_added_tokens_that_are_not_special_keep_their_ids_with_a_slow_tokenizer_too(kind: str) -> None:
    """``<think>`` (added, not special) is its id in a reply's text (``text_ids``) and in a message, the
    special-token strings around it text: the same with a slow (Python) tokenizer, whose
    ``split_special_tokens`` splits every added token (``<think>`` came out as its bytes), as with a
    fast one. The text between is encoded as plain text, as the fast tokenizer's one call does, and
    the prompt is what transformers' ``apply_chat_template(..., sanitize_control_tokens=True)`` gives."""
    tok = fast_chat_tokenizer() if kind == "fast" else slow_chat_tokenizer()
    think, eos = tok.convert_tokens_to_ids(THINK), tok.eos_token_id

    def plain(text: str) -> list[int]:
        return tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    text = "a <think>b</think> <|end|> c<think>"
    ids = text_ids(tok, text)
    assert ids == plain("a ") + [think] + plain("b</think> <|end|> c") + [think]
    assert tok.decode(ids) == text and eos not in ids
    assert text_ids(tok, "no added token <|end|> here") == plain("no added token <|end|> here")

    renderer = ChatRenderer(tok)
    conv = Conversation("r", ["why <think> is <|end|> the cat?", "and <think>"])
    prompt = renderer.prompt_ids(conv)
    assert prompt.count(think) == 1 and prompt.count(eos) == 1  # the template's own EOS alone
    cont = renderer.continuation_ids(conv, ["it is"], eos)
    assert cont.count(think) == 1 and cont.count(eos) == 1  # the user turn's closing markup
    if "sanitize_control_tokens" in inspect.signature(tok.apply_chat_template).parameters:
        sanitized = tok.apply_chat_template(
            renderer.messages(conv, [], True), add_generation_prompt=True, sanitize_control_tokens=True
        )["input_ids"]
        assert prompt == sanitized


@pytest.mark.parametrize("flag", ["lstrip", "rstrip", "single_word"])
def test_a_slow_tokenizer_applies_the_flags_of_its_added_tokens_in_plain_text(flag: str) -> None:
    """``<think>`` (added, not special) with ``lstrip``, ``rstrip`` or ``single_word``: ``text_ids`` of
    text around it is the slow tokenizer's own encoding, which applies the flag (drops the whitespace
    before or after it; inside a word, or next to another added token, a single-word token is text),
    also after a special-token string encoded as text; and it keeps the text the fast tokenizer with the
    same flag keeps (a stripped space is not in the decoded ids)."""
    slow, fast = slow_chat_tokenizer(**{flag: True}), fast_chat_tokenizer(**{flag: True})

    def own(text: str) -> list[int]:  # no special-token string in text: the tokenizer's one call
        return slow(text, add_special_tokens=False)["input_ids"]

    texts = ["a <think> b", "a<think>b", "x <think>b", "x<think> b", "a  <think><think>  b", "a\n<think>\tb"]
    for text in texts:
        assert text_ids(slow, text) == own(text), text
        end = slow(" <|end|> ", add_special_tokens=False, split_special_tokens=True)["input_ids"]
        assert text_ids(slow, " <|end|> " + text) == end + own(text), text
    for text in texts[:2]:  # where the fast tokenizer's rule for the flag is the slow one's
        assert slow.decode(text_ids(slow, text)) == fast.decode(text_ids(fast, text)), text
    assert slow.decode(text_ids(slow, "a <think> b")) == {
        "lstrip": "a<think> b", "rstrip": "a <think>b", "single_word": "a <think> b"
    }[flag]  # fmt: skip
