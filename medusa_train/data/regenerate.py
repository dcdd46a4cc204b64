"""Regenerate every assistant turn of a conversation with a causal LM (self-distillation core).

Medusa (Cai et al., 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads", section 3.2.1) trains the heads on the backbone's own replies, so they learn the backbone's
distribution rather than that of the dataset's original answers. This module holds the side-effect
free part: chat rendering to exact token sequences, batched generation with left padding, and
per-record seeded sampling. ``medusa_train/stages/distill.py`` assembles it with files and ranks.

Exact token sequences: a record's ``input_ids`` are built by concatenation, never by re-tokenising
decoded text, so ``loss_mask`` is exactly the generated tokens:

    ids = prompt(turn 0)                       # chat template, add_generation_prompt=True
    ids += generated(turn 0)                   # mask 1, incl. the EOS when generation emitted it
    ids += continuation(turn 0 -> turn 1)      # template text between the reply and the next
    ids += generated(turn 1) ...               # generation prompt (mask 0), tokenised on its own

The continuation is found by rendering the conversation with a sentinel in place of the last reply
and taking the text after it; when the reply ended with an EOS whose text starts that continuation
(``<|end|>``, ``<|im_end|>``, ``<|eot_id|>``), that text is dropped since the generated EOS token
already closes the turn. A reply cut by ``max_new_tokens`` gets no EOS in its masked span; the
template's end-of-turn text follows unmasked when another turn comes. Turn ``t+1`` is generated from
exactly ``ids`` above, i.e. conditioned on the model's OWN earlier replies, token for token.

Sampling (temperature > 0) draws each token of row ``r`` with that record's own
``torch.Generator`` (seeded from ``seed``, ``source_id`` and the turn index), inside Hugging Face
``generate`` via a logits processor that keeps only the drawn token. A record's sample therefore does
not depend on which records share its batch or rank. Limitation: a padded batched forward differs
from an unpadded one in the last floating-point bits, so a draw that lands within ~1e-7 of a
boundary between two tokens' probability mass can still differ between batchings.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from medusa_train.data.sources import Conversation
from medusa_train.errors import UserError

_SENTINEL = "MEDUSAREPLYSENTINEL"


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

    @staticmethod
    def messages(conv: Conversation, replies: list[str], next_turn: bool) -> list[dict[str, str]]:
        """Chat messages: system, then user/assistant pairs for ``replies``, then the next user turn."""
        msgs = [{"role": "system", "content": conv.system}] if conv.system else []
        for user, reply in zip(conv.turns, replies, strict=False):
            msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        if next_turn:
            msgs.append({"role": "user", "content": conv.turns[len(replies)]})
        return msgs

    def _render(self, msgs: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, conv: Conversation) -> list[int]:
        """Tokens of the first turn's prompt, as the chat template renders it (generation prompt included)."""
        return self._encode(self._render(self.messages(conv, [], True)))

    def continuation_ids(self, conv: Conversation, replies: list[str], eos_id: int | None) -> list[int]:
        """Tokens between the end of reply ``len(replies) - 1`` and the generation of the next turn.

        Args:
            conv: the conversation; ``conv.turns[len(replies)]`` is the next user turn.
            replies: decoded replies so far (the last one is replaced by a sentinel when rendering).
            eos_id: the EOS token that ended the last reply, or None when it was cut by max_new_tokens.
        """
        text = self._render(self.messages(conv, [*replies[:-1], _SENTINEL], True))
        at = text.rfind(_SENTINEL)
        if at < 0:
            raise UserError(
                "the chat template drops earlier assistant turns: multi-turn distillation is impossible"
            )
        suffix = text[at + len(_SENTINEL) :]
        if eos_id is not None:
            eos_text = self.tokenizer.decode([eos_id])
            if eos_text and suffix.startswith(eos_text):
                suffix = suffix[len(eos_text) :]
        return self._encode(suffix)


def record_generator(seed: int, source_id: str, turn: int) -> torch.Generator:
    """A CPU generator seeded by (seed, record, turn): samples independent of batching and rank."""
    digest = hashlib.sha256(f"{seed}:{source_id}:{turn}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") & ((1 << 63) - 1))


class RecordSampler:
    """Logits processor that samples one token per row with that row's generator (temperature, top-p).

    Returns scores that are 0 at the drawn token and -inf elsewhere, so ``generate``'s greedy step
    picks exactly the drawn token.
    """

    def __init__(self, generators: list[torch.Generator], temperature: float, top_p: float) -> None:
        self.generators = generators
        self.temperature = temperature
        self.top_p = top_p

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        probs = torch.softmax(scores.float() / self.temperature, dim=-1)  # (B, V)
        sorted_p, order = probs.sort(dim=-1, descending=True)  # (B, V)
        keep = (sorted_p.cumsum(-1) - sorted_p) < self.top_p  # nucleus; the top token is always kept
        sorted_p = sorted_p * keep
        cum = sorted_p.cumsum(-1)  # (B, V)
        u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in self.generators])
        u = (u.to(cum.device, cum.dtype) * cum[:, -1]).unsqueeze(-1)  # (B, 1)
        pos = torch.searchsorted(cum, u, right=True).clamp(max=cum.shape[-1] - 1)  # (B, 1)
        token = order.gather(-1, pos)  # (B, 1)
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(-1, token, 0.0)


@torch.no_grad()
def generate_batch(
    model,
    contexts: list[list[int]],
    *,
    pad_id: int,
    eos_ids: list[int],
    max_new_tokens: int,
    generators: list[torch.Generator] | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> list[list[int]]:
    """One batched ``generate`` call with left padding and KV cache.

    Args:
        model: a causal LM in eval mode.
        contexts: token ids per row (different lengths; left-padded here).
        pad_id: padding id (masked out by the attention mask).
        eos_ids: ids that end a row.
        max_new_tokens: cap per row.
        generators: one per row when sampling (temperature > 0); None = greedy.
        temperature: sampling temperature (ignored when greedy).
        top_p: nucleus mass (ignored when greedy).

    Returns:
        The new tokens of every row, up to and including its first EOS (no EOS when cut by the cap).
    """
    from transformers import GenerationConfig, LogitsProcessorList

    width = max(len(c) for c in contexts)
    input_ids = torch.full((len(contexts), width), pad_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros_like(input_ids)  # (B, T)
    for row, ctx in enumerate(contexts):
        input_ids[row, width - len(ctx) :] = torch.tensor(ctx, dtype=torch.long)
        attention_mask[row, width - len(ctx) :] = 1
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_ids,
        pad_token_id=pad_id,
        use_cache=True,
    )
    processors = LogitsProcessorList([RecordSampler(generators, temperature, top_p)]) if generators else None
    out = model.generate(
        input_ids=input_ids.to(model.device),
        attention_mask=attention_mask.to(model.device),
        generation_config=config,
        logits_processor=processors,
    )  # (B, T + new)
    eos = set(eos_ids)
    result = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, tok in enumerate(row) if tok in eos), len(row))
        result.append(row[:end])
    return result


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
    replies: list[str] = field(default_factory=list)


def distill_records(
    model,
    renderer: ChatRenderer,
    records: list[Conversation],
    prompt_ids: list[list[int]],
    *,
    max_new_tokens: int,
    max_context: int,
    batch_size: int,
    eos_ids: list[int],
    pad_id: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    on_batch: Callable[[int], None] | None = None,
) -> list[DistilledRecord]:
    """Regenerate every assistant turn of ``records``, batching by turn index across records.

    Args:
        model: frozen causal LM in eval mode.
        renderer: chat rendering for the model's tokenizer.
        records: conversations (user turns).
        prompt_ids: first-turn prompt ids per record (already within ``max_context``).
        max_new_tokens: cap per assistant turn.
        max_context: a later turn whose context would exceed this many tokens is not answered
            (the conversation ends with the previous reply).
        batch_size: rows per ``generate`` call; rows are grouped by turn index, longest contexts first.
        eos_ids: ids that end a turn.
        pad_id: left-padding id.
        temperature: 0 = greedy; otherwise per-record seeded sampling with ``top_p``.
        top_p: nucleus mass.
        seed: sampling seed.
        on_batch: called with the number of tokens generated by each ``generate`` call.

    Returns:
        One :class:`DistilledRecord` per input record, in input order.
    """
    tok = renderer.tokenizer
    states = [
        DistilledRecord(c.source_id, list(p), [0] * len(p)) for c, p in zip(records, prompt_ids, strict=True)
    ]
    open_ = [True] * len(records)
    for turn in range(max((len(c.turns) for c in records), default=0)):
        active = [i for i in range(len(records)) if open_[i] and len(records[i].turns) > turn]
        active.sort(key=lambda i: -len(states[i].input_ids))  # similar lengths share a batch: less padding
        for start in range(0, len(active), batch_size):
            batch = active[start : start + batch_size]
            gens = None
            if temperature > 0:
                gens = [record_generator(seed, records[i].source_id, turn) for i in batch]
            outs = generate_batch(
                model,
                [states[i].input_ids for i in batch],
                pad_id=pad_id,
                eos_ids=eos_ids,
                max_new_tokens=max_new_tokens,
                generators=gens,
                temperature=temperature,
                top_p=top_p,
            )
            for i, new in zip(batch, outs, strict=True):
                st, conv = states[i], records[i]
                st.input_ids += new
                st.loss_mask += [1] * len(new)
                st.turns += 1
                ended = new[-1] if new and new[-1] in eos_ids else None
                st.cut += ended is None
                st.replies.append(tok.decode(new, skip_special_tokens=True))
                if turn + 1 >= len(conv.turns):
                    open_[i] = False
                    continue
                cont = renderer.continuation_ids(conv, st.replies, ended)
                if len(st.input_ids) + len(cont) > max_context:
                    open_[i] = False
                    st.turns_dropped = len(conv.turns) - turn - 1
                    continue
                st.input_ids += cont
                st.loss_mask += [0] * len(cont)
            if on_batch is not None:
                on_batch(sum(len(o) for o in outs))
    return states
