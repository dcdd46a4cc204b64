"""The multi-turn self-distillation loop: regenerate every assistant turn with the backbone.

Medusa (Cai et al., 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads", section 3.2.1) trains the heads on the backbone's own replies, so they learn the backbone's
distribution rather than that of the dataset's original answers. :func:`distill_records` builds
each conversation turn by turn: the first prompt and the template text between turns come from
:class:`medusa_train.data.chat.ChatRenderer` (exact token sequences, see there), the replies from an
engine (:class:`medusa_train.engines.base.Engine`). Turn ``t+1`` is generated from exactly the ids
built so far, i.e. conditioned on the model's OWN earlier replies, token for token, and is queued
the moment turn ``t`` ends, so turns of different conversations share the engine's batch freely.
``medusa_train/stages/distill.py`` assembles this with files and ranks.

Sampling seeds are per record and turn (:func:`record_seed`, from ``seed``, ``source_id`` and the
turn index), so a record's sample does not depend on which records share its batch, shard or rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

from medusa_train.data.chat import ChatRenderer
from medusa_train.data.sources import Conversation
from medusa_train.engines.base import Engine, GenRequest


def record_seed(seed: int, source_id: str, turn: int) -> int:
    """The sampling seed of one reply, from (seed, record, turn): independent of batching and rank."""
    digest = hashlib.sha256(f"{seed}:{source_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


@dataclass
class DistilledRecord:
    """One regenerated conversation: the exact token sequence and which tokens were generated."""

    source_id: str
    input_ids: list[int]
    loss_mask: list[int]
    turns: int = 0
    """Assistant turns generated."""
    turns_dropped: int = 0
    """User turns left unanswered because the context would exceed ``max_context``."""
    cut: int = 0
    """Turns that hit ``max_new_tokens`` without EOS."""
    inexact: int = 0
    """Replies the engine could not give token-exactly (None from a text engine); the conversation
    ended before such a reply."""
    replies: list[str] = field(default_factory=list)


def distill_records(
    engine: Engine,
    renderer: ChatRenderer,
    records: list[Conversation],
    prompt_ids: list[list[int]],
    *,
    max_context: int,
    eos_ids: list[int],
    seed: int = 0,
    on_reply: Callable[[int, bool], None] | None = None,
) -> list[DistilledRecord]:
    """Regenerate every assistant turn of ``records`` with ``engine`` (see the module docstring).

    Args:
        engine: generates the replies (its cap per turn, sampling settings and batching are its own).
        renderer: chat rendering for the model's tokenizer.
        records: conversations (user turns).
        prompt_ids: first-turn prompt ids per record (already within ``max_context``).
        max_context: a later turn whose context would exceed this many tokens is not answered
            (the conversation ends with the previous reply).
        eos_ids: ids that end a turn (a reply without one was cut at the engine's cap).
        seed: sampling seed (per record and turn: :func:`record_seed`; greedy engines ignore it).
        on_reply: called after each generated reply with its number of tokens and whether it was
            the record's last (the record is then complete).

    Returns:
        One :class:`DistilledRecord` per input record, in input order.
    """
    tok = renderer.tokenizer
    states = [
        DistilledRecord(c.source_id, list(p), [0] * len(p)) for c, p in zip(records, prompt_ids, strict=True)
    ]
    answered = [len(p) for p in prompt_ids]  # per record: its tokens up to its last reply

    def request(i: int) -> GenRequest:
        st = states[i]
        turn_seed = record_seed(seed, records[i].source_id, st.turns)
        messages = renderer.messages(records[i], st.replies, True)  # the same context, for text engines
        return GenRequest(i, list(st.input_ids), turn_seed, messages)

    def on_done(req: GenRequest, new: list[int] | None) -> GenRequest | None:
        i = req.key
        st, conv = states[i], records[i]
        if new is None:  # a text engine could not give this reply exactly: the conversation ends here,
            st.inexact += 1  # after the last reply (the user turn this one answers is dropped too)
            del st.input_ids[answered[i] :], st.loss_mask[answered[i] :]
            if on_reply is not None:
                on_reply(0, True)
            return None
        st.input_ids += new
        st.loss_mask += [1] * len(new)
        st.turns += 1
        ended = new[-1] if new and new[-1] in eos_ids else None
        st.cut += ended is None
        st.replies.append(tok.decode(new, skip_special_tokens=True))
        answered[i] = len(st.input_ids)
        follow = None
        if st.turns < len(conv.turns):
            cont = renderer.continuation_ids(conv, st.replies, ended)
            if len(st.input_ids) + len(cont) > max_context:
                st.turns_dropped = len(conv.turns) - st.turns
            else:
                st.input_ids += cont
                st.loss_mask += [0] * len(cont)
                follow = request(i)
        if on_reply is not None:
            on_reply(len(new), follow is None)
        return follow

    engine.run([request(i) for i, c in enumerate(records) if c.turns], on_done)
    return states
