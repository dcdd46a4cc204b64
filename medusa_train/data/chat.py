"""Chat rendering to exact token sequences, and the ids that end an assistant turn.

Self-distillation (Medusa, Cai et al., 2024, section 3.2.1) regenerates every assistant turn with the
backbone and trains on the exact tokens it produced. A record's ``input_ids`` are therefore built by
concatenation, never by re-tokenising decoded text, so its ``loss_mask`` is exactly the generated
tokens:

    ids = prompt(turn 0)                       # chat template, add_generation_prompt=True
    ids += generated(turn 0)                   # mask 1, incl. the EOS when generation emitted it
    ids += continuation(turn 0 -> turn 1)      # template text between the reply and the next
    ids += generated(turn 1) ...               # generation prompt (mask 0), tokenised on its own

The continuation is found by rendering the conversation with a sentinel in place of the last reply
and taking the text after it; when the reply ended with an EOS whose text starts that continuation
(``<|end|>``, ``<|im_end|>``, ``<|eot_id|>``; after whitespace in Llama-2's ``' ' + eos_token``),
that text is dropped, with the whitespace before it, since the generated EOS token already closes
the turn; so is the whitespace after it where the EOS token has ``rstrip`` (Phi-3's ``<|end|>`` and
newline), which the tokenizer's own call on the whole conversation drops. A reply cut by
``max_new_tokens`` gets no EOS in its masked span; the template's end-of-turn text follows unmasked
when another turn comes.
Special-token strings inside a message (a prompt or an earlier reply that quotes ``<|im_end|>``,
``</s>``) are text, not markup: they are encoded as plain text (``split_special_tokens``), so a
record holds a special id only where the chat template itself writes one, and the model never sees
a fake end of turn inside a message. Messages are rendered with such strings wrapped in private-use
marker characters; :meth:`ChatRenderer._encode` encodes the text between them as usual and each
marked string as plain text on its own, as transformers'
``apply_chat_template(..., sanitize_control_tokens=True)`` does (tested equal). A rendering with
no such string is one tokenizer call. Added tokens that are not special (Qwen's ``<think>``) keep
their ids in a message, also with a slow (Python) tokenizer (:func:`text_ids`, which applies their
``lstrip``, ``rstrip`` and ``single_word`` as the tokenizer does); transformers'
``sanitize_control_tokens`` encodes as text those its chat template writes too.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from jinja2.exceptions import TemplateError

from medusa_train.data.sources import Conversation
from medusa_train.errors import UserError

_SENTINEL = "MEDUSAREPLYSENTINEL"
_OPEN, _CLOSE = "\U000f0000", "\U000f0001"
"""Private-use characters wrapped around a special-token string inside a message (the ones
transformers' ``mark_control_tokens`` uses): they mark it as text to encode as text."""


def text_ids(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as plain text, as a model writes it: a special-token string (``<|im_end|>``)
    as text (``split_special_tokens``), an added token that is not special (Qwen's ``<think>``) as its id.

    A fast tokenizer does both in one call. A slow (Python) one ignores every added token under
    ``split_special_tokens``, special or not: its text is cut at the added tokens that are not
    special, with their ``lstrip``, ``rstrip`` and ``single_word`` applied as the tokenizer's own call
    applies them (:func:`_added_token_pieces`), each token kept as its id and the text between encoded
    as plain text (:func:`_encode_after_cut` after a cut).
    """
    if not tokenizer.is_fast:
        added = {t.content: t for t in tokenizer.added_tokens_decoder.values() if not t.special and t.content}
        pieces = _added_token_pieces(text, added)
        if pieces != [(text, False)]:  # cut at an added token (or one's flags changed the text)

            def plain(piece: str) -> list[int]:
                return _tokenize(tokenizer, piece, plain=True)

            newline, ids = plain("\n"), []
            for i, (piece, is_token) in enumerate(pieces):
                if is_token:
                    ids.append(tokenizer.convert_tokens_to_ids(piece))
                else:
                    ids += _encode_after_cut(plain, piece, newline) if i else plain(piece)
            return ids
    return _tokenize(tokenizer, text, plain=True)


def _added_token_pieces(text: str, added: dict) -> list[tuple[str, bool]]:
    """``text`` cut at the strings of ``added`` (content -> ``AddedToken``; longest first: a token takes
    priority over one it contains): ``(piece, is_token)`` in order, no empty piece.

    Each token's flags as transformers' Python tokenizers apply them (``PreTrainedTokenizer.tokenize``,
    transformers 5.24), token by token from the left: ``rstrip`` drops the whitespace at the start of the
    piece after it, ``lstrip`` at the end of the piece before it, and a ``single_word`` token next to a
    piece (text or another token) that does not end, or start, with a space (the one before it is looked
    at first, as it was before this token's strips) is text, joined to that piece (still cut from the other).
    """
    if not added:
        return [(text, False)] if text else []
    kept = sorted(added, key=len, reverse=True)
    split = re.split(f"({'|'.join(map(re.escape, kept))})", text)  # [text, token, text, ..., text]
    pieces = [[piece, i % 2 == 1] for i, piece in enumerate(split) if piece]
    for i, (piece, is_token) in enumerate(pieces):
        if not is_token:
            continue
        token = added[piece]
        left = pieces[i - 1][0] if i > 0 else None
        right = pieces[i + 1][0] if i + 1 < len(pieces) else None
        if token.rstrip and right:
            pieces[i + 1][0] = right.lstrip()
        if token.lstrip and left:
            pieces[i - 1][0] = left.rstrip()
        if token.single_word:
            if left and left[-1] != " ":
                pieces[i - 1] = [pieces[i - 1][0] + piece, False]
                pieces[i][0] = ""
            elif right and right[0] != " ":
                pieces[i + 1] = [piece + pieces[i + 1][0], False]
                pieces[i][0] = ""
    return [(piece, is_token) for piece, is_token in pieces if piece]


def _tokenize(tokenizer, text: str, plain: bool) -> list[int]:
    """``text`` tokenised; ``plain``: special-token strings as text (``split_special_tokens``)."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=plain)["input_ids"]


def _encode_after_cut(encode: Callable[[str], list[int]], piece: str, newline: list[int]) -> list[int]:
    """Token ids of ``piece``, text that follows a cut: encoded after a newline (``newline``: its ids)
    that is then removed, so a SentencePiece tokenizer adds no prefix space at the cut (the piece alone
    where the newline merges with it), as transformers does."""
    after = encode("\n" + piece)
    if newline and after[: len(newline)] == newline:
        return after[len(newline) :]
    return encode(piece)


def _encode_pieces(pieces: list[str | None], encode: Callable[[str, bool], list[int]]) -> list[int]:
    """Token ids of ``pieces``, ``[text, odd, text, odd, ..., text]``, each encoded on its own by
    ``encode(piece, odd)`` (an empty or None piece: nothing), a piece after the first as text after a
    cut (:func:`_encode_after_cut`).
    """
    newline = {odd: encode("\n", odd) for odd in (False, True)}
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if not piece:
            continue
        odd = i % 2 == 1
        if i:
            ids += _encode_after_cut(lambda text, odd=odd: encode(text, odd), piece, newline[odd])
        else:
            ids += encode(piece, odd)
    return ids


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends an assistant turn: the generation config's EOS ids plus the tokenizer's."""
    ids: set[int] = set()
    gen_eos = model.generation_config.eos_token_id
    if gen_eos is not None:
        ids.update([gen_eos] if isinstance(gen_eos, int) else gen_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise UserError("the backbone defines no EOS token: generation could not stop at the end of a turn")
    return sorted(ids)


class ChatRenderer:
    """Token ids of the first prompt and of the continuations between turns (see the module docstring)."""

    def __init__(self, tokenizer) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(
                f"the tokenizer of {tokenizer.name_or_path} has no chat template: distillation needs a chat model"
            )
        self.tokenizer = tokenizer
        # What `split_special_tokens` encodes as text: the special added tokens, longest first (a token
        # takes priority over one it contains); whitespace tokens are ordinary text in any message.
        specials = sorted(
            {t.content for t in tokenizer.added_tokens_decoder.values() if t.special and t.content.strip()},
            key=len,
            reverse=True,
        )
        pattern = "|".join(map(re.escape, specials)) or "(?!)"  # (?!): matches nothing
        self._special = re.compile(pattern)
        self._marked = re.compile(f"{_OPEN}({pattern}){_CLOSE}|[{_OPEN}{_CLOSE}]")

    @staticmethod
    def messages(conv: Conversation, replies: list[str], next_turn: bool) -> list[dict[str, str]]:
        """Chat messages: system, then user/assistant pairs for ``replies``, then the next user turn."""
        msgs = [{"role": "system", "content": conv.system}] if conv.system else []
        for user, reply in zip(conv.turns, replies, strict=False):
            msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        if next_turn:
            msgs.append({"role": "user", "content": conv.turns[len(replies)]})
        return msgs

    def _render(self, conv: Conversation, msgs: list[dict[str, str]]) -> str:
        """The chat template applied to ``msgs`` (of ``conv``), special-token strings inside a message
        marked (see the module docstring); a conversation the template refuses is the user's error."""
        msgs = [{**m, "content": self._mark(m["content"])} for m in msgs]
        try:
            return self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        except TemplateError as err:  # raise_exception in the template (Gemma: no system role), bad syntax
            raise UserError(
                f"record {conv.source_id}: the chat template of {self.tokenizer.name_or_path} refuses it "
                f"({err}): use data the template accepts or another model"
            ) from None

    def quotes_special(self, content: str) -> bool:
        """Whether ``content`` (a message) holds a special-token string, which it encodes as text."""
        return self._special.search(content) is not None

    def _mark(self, content: str) -> str:
        """``content`` with every special-token string wrapped in the markers (markers already in it
        dropped, so a message cannot forge one)."""
        content = content.replace(_OPEN, "").replace(_CLOSE, "")
        return self._special.sub(lambda m: f"{_OPEN}{m.group(0)}{_CLOSE}", content)

    def _encode(self, text: str) -> list[int]:
        """Token ids of rendered ``text``: the template's special tokens as their ids, marked strings
        as plain text.

        ``re.split`` gives ``[text, marked, text, marked, ..., text]`` (None for a lone marker, which a
        template's string methods left: dropped), encoded piece by piece (:func:`_encode_pieces`).
        """
        if _OPEN not in text and _CLOSE not in text:
            return self._encode_piece(text, plain=False)
        return _encode_pieces(
            self._marked.split(text), lambda piece, marked: self._encode_piece(piece, marked)
        )

    def _encode_piece(self, text: str, plain: bool) -> list[int]:
        """``text`` tokenised; ``plain``: as plain text (:func:`text_ids`)."""
        return text_ids(self.tokenizer, text) if plain else _tokenize(self.tokenizer, text, plain=False)

    def prompt_ids(self, conv: Conversation) -> list[int]:
        """Tokens of the first turn's prompt, as the chat template renders it (generation prompt included)."""
        return self._encode(self._render(conv, self.messages(conv, [], True)))

    def turn_prompt_ids(self, conv: Conversation, replies: list[str]) -> list[int]:
        """Tokens of turn ``len(replies)``'s prompt after the earlier turns and ``replies``, rendered whole.

        What ``stage=eval`` feeds both decoders: the chat template applied to the full history at once
        (a model's own earlier answers as text), generation prompt included.
        """
        return self._encode(self._render(conv, self.messages(conv, replies, True)))

    def continuation_ids(self, conv: Conversation, replies: list[str], eos_id: int | None) -> list[int]:
        """Tokens between the end of reply ``len(replies) - 1`` and the generation of the next turn.

        Args:
            conv: the conversation; ``conv.turns[len(replies)]`` is the next user turn.
            replies: decoded replies so far (the last one is replaced by a sentinel when rendering).
            eos_id: the EOS token that ended the last reply, or None when it was cut by max_new_tokens.
        """
        suffix = self._closing(conv, replies)
        if eos_id is not None:
            after = self._after_eos(suffix, eos_id)
            if after is not None:
                suffix = after.lstrip() if self._rstrips(eos_id) else after
        return self._encode(suffix)

    def _after_eos(self, suffix: str, eos_id: int) -> str | None:
        """``suffix`` (a closing text) after the text of ``eos_id`` that starts it after whitespace
        (Llama-2's template closes a reply with ``' ' + eos_token``); None where it does not start so."""
        eos_text = self.tokenizer.decode([eos_id])
        head = suffix.lstrip()
        return head[len(eos_text) :] if eos_text and head.startswith(eos_text) else None

    def _rstrips(self, eos_id: int) -> bool:
        """Whether the tokenizer's own call drops the whitespace after ``eos_id``'s text (an added token
        with ``rstrip=True``: Phi-3's ``<|end|>``), as it does in the text of a whole conversation."""
        token = self.tokenizer.added_tokens_decoder.get(eos_id)
        return token is not None and token.rstrip

    def spaced_eos(self, conv: Conversation, eos_ids: list[int]) -> bool:
        """Whether the template closes the first reply of ``conv`` (which has a second user turn) with
        whitespace before the text of one of ``eos_ids``, as Llama-2's ``' ' + eos_token`` does: the
        whitespace :meth:`continuation_ids` drops with that text after a reply the EOS ended."""
        suffix = self._closing(conv, [""])
        return suffix[:1].isspace() and any(self._after_eos(suffix, eos_id) is not None for eos_id in eos_ids)

    def stripped_eos(self, conv: Conversation, eos_ids: list[int]) -> bool:
        """Whether the template follows the text of one of ``eos_ids`` that closes the first reply of
        ``conv`` (which has a second user turn) with whitespace the token's ``rstrip`` drops, as Phi-3's
        ``<|end|>`` + newline: the whitespace :meth:`continuation_ids` drops after a reply the EOS ended,
        as the tokenizer's own call on the whole conversation does."""
        suffix = self._closing(conv, [""])
        for eos_id in eos_ids:
            after = self._after_eos(suffix, eos_id)
            if after is not None and after[:1].isspace() and self._rstrips(eos_id):
                return True
        return False

    def _closing(self, conv: Conversation, replies: list[str]) -> str:
        """The template's text after reply ``len(replies) - 1`` up to the next turn's generation prompt."""
        text = self._render(conv, self.messages(conv, [*replies[:-1], _SENTINEL], True))
        at = text.rfind(_SENTINEL)
        if at < 0:
            raise UserError(
                "the chat template drops earlier assistant turns: multi-turn distillation is impossible"
            )
        return text[at + len(_SENTINEL) :]
