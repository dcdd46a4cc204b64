"""In-process generation engine: continuous batching over a slot KV cache, with a static fallback.

Implements :class:`medusa_train.engines.base.Engine` on a Hugging Face causal LM held in this
process. :class:`ContinuousBatcher` keeps up to ``batch_size`` rows decoding on one preallocated KV
cache; a row leaves the batch the moment its reply ends and waiting requests join, which is
continuous batching as in Orca (Yu et al., 2022, "Orca: A Distributed Serving System for
Transformer-Based Generative Models", iteration-level scheduling). Models whose cache layers it
cannot edit run static ``generate`` batches instead (:func:`generate_batch`), with the same results.

Sampling (temperature > 0) draws each token of a request with that request's own
``torch.Generator`` (seeded from ``GenRequest.seed``), one draw per token (:func:`sample_rows`), so
a reply does not depend on which requests share its batch. Limitation: a padded batched forward
differs from an unpadded one in the last floating-point bits, so a draw that lands within ~1e-7 of
a boundary between two tokens' probability mass can still differ between batchings.

The model's repetition penalty (``repetition_penalty`` of its generation config, e.g. 1.05 for
Qwen2.5-Instruct) is applied as ``generate`` applies it, over each row's own tokens (its context and
its reply so far, never another row's or the padding), before the greedy pick or the draw: so
greedy replies equal ``model.generate(do_sample=False)`` with the model's own generation config, as
a server's do. When sampling, the stage also passes the generation config's top-k and min-p, which
vLLM applies too; the temperature and top-p are ``distill.temperature`` and ``distill.top_p``, which
a request to a server overrides the model's with as well. The other settings a generation config
may set (:data:`UNAPPLIED_SETTINGS`) are applied on neither path.
"""

from __future__ import annotations

import inspect
from collections import deque
from dataclasses import dataclass

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList
from transformers.cache_utils import DynamicLayer

from medusa_train.decoding.acceptance import warp_probs
from medusa_train.decoding.processors import penalize
from medusa_train.engines.base import GenRequest, OnDone
from medusa_train.hf_compat import cache_kwargs

UNAPPLIED_SETTINGS = {
    "no_repeat_ngram_size": 0,
    "encoder_repetition_penalty": 1.0,
    "bad_words_ids": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "sequence_bias": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "min_new_tokens": None,
    "min_length": 0,
}
"""Generation-config settings that change ``generate``'s replies and that this engine does not
apply, on either path, with their off values (the stage warns about any a model sets)."""
UNAPPLIED_SAMPLING_SETTINGS = {"typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None}
"""The same for sampling filters (a greedy reply does not depend on them)."""


def request_generator(seed: int | None) -> torch.Generator:
    """The CPU generator a request's sampled tokens are drawn with (seed None counts as 0)."""
    return torch.Generator().manual_seed(0 if seed is None else seed)


def sample_rows(
    scores: torch.Tensor,
    generators: list[torch.Generator],
    temperature: float,
    top_p: float,
    top_k: int = 0,
    min_p: float = 0.0,
) -> torch.Tensor:
    """Draw one token per row of ``scores`` (B, V) with that row's generator, from the distribution
    ``generate``'s warpers leave (:func:`~medusa_train.decoding.acceptance.warp_probs`: temperature,
    top-k (0 = off), top-p, min-p (0 = off), in its order; the decoders' sampling uses it too).

    Each row consumes exactly one float64 draw from its own generator, so a request's sample does
    not depend on which rows share its batch. A draw that rounds up to the whole mass in float32
    (about one in 2**24) takes the last token with any probability, never one the filters removed.
    """
    probs = warp_probs(scores, temperature, top_p, top_k, min_p)  # (B, V)
    sorted_p, order = probs.sort(dim=-1, descending=True)  # (B, V)
    cum = sorted_p.cumsum(-1)  # (B, V)
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])
    u = u.to(cum.dtype).to(cum.device)  # (B,) cast on the CPU first: MPS has no float64
    u = (u * cum[:, -1]).unsqueeze(-1)  # (B, 1)
    last = (sorted_p > 0).sum(-1, keepdim=True) - 1  # (B, 1): the last token with any probability
    pos = torch.minimum(torch.searchsorted(cum, u, right=True), last)  # (B, 1)
    return order.gather(-1, pos).squeeze(-1)  # (B,)


class RowPenalty:
    """Logits processor for ``generate``: the repetition penalty over each row's own tokens.

    ``generate``'s own penalty also counts a left-padded row's padding; this one skips the first
    ``pads[b]`` columns of row b, so a batched row is penalised as it would be alone (used by the
    static fallback).
    """

    def __init__(self, penalty: float, pads: list[int]) -> None:
        self.penalty = penalty
        self.pads = torch.tensor(pads)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        real = (
            torch.arange(input_ids.shape[1], device=input_ids.device)
            >= self.pads.to(input_ids.device)[:, None]
        )
        seen = torch.zeros(scores.shape, dtype=torch.int32, device=scores.device)  # (B, V)
        seen.scatter_reduce_(1, input_ids, real.int(), reduce="amax")  # a token seen at any real column
        return penalize(scores, seen.bool(), self.penalty)


def _seen_tokens(contexts: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``(rows, vocab)`` bool: the tokens of each row's context."""
    seen = torch.zeros(len(contexts), vocab, dtype=torch.bool, device=device)
    for row, ctx in enumerate(contexts):
        seen[row, torch.tensor(ctx, dtype=torch.long, device=device)] = True
    return seen


class RecordSampler:
    """Logits processor for ``generate``: :func:`sample_rows`, as scores 0 at the drawn token, -inf elsewhere.

    ``generate``'s greedy step then picks exactly the drawn token (used by the static fallback).
    """

    def __init__(
        self, generators: list[torch.Generator], temperature: float, top_p: float, top_k: int, min_p: float
    ) -> None:
        self.generators = generators
        self.filters = (temperature, top_p, top_k, min_p)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        token = sample_rows(scores, self.generators, *self.filters).unsqueeze(-1)  # (B, 1)
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(-1, token, 0.0)


def _left_pad(contexts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and the matching attention mask, both (rows, longest context)."""
    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, ctx in enumerate(contexts):
        ids[row, width - len(ctx) :] = torch.tensor(ctx, dtype=torch.long)
        mask[row, width - len(ctx) :] = 1
    return ids, mask


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
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
) -> list[list[int]]:
    """One static batched ``generate`` call with left padding and KV cache.

    The fallback of :class:`ContinuousBatcher` for models whose KV cache it cannot edit (see there).

    Args:
        model: a causal LM in eval mode.
        contexts: token ids per row (different lengths; left-padded here).
        pad_id: padding id (masked out by the attention mask).
        eos_ids: ids that end a row.
        max_new_tokens: cap per row.
        generators: one per row when sampling (temperature > 0); None = greedy.
        temperature: sampling temperature (ignored when greedy).
        top_p: nucleus mass (ignored when greedy).
        top_k: keep the k most likely tokens, 0 = off (ignored when greedy).
        min_p: keep tokens at least this fraction of the top one's probability, 0 = off (ignored
            when greedy).
        repetition_penalty: over each row's own tokens (:class:`RowPenalty`); 1 = off.

    Returns:
        The new tokens of every row, up to and including its first EOS (no EOS when cut by the cap).
    """
    input_ids, attention_mask = _left_pad(contexts, pad_id)  # (B, T), (B, T)
    width = input_ids.shape[1]
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_ids,
        pad_token_id=pad_id,
        use_cache=True,
    )
    processors = LogitsProcessorList()
    if repetition_penalty != 1.0:
        processors.append(RowPenalty(repetition_penalty, [width - len(c) for c in contexts]))
    if generators:
        processors.append(RecordSampler(generators, temperature, top_p, top_k, min_p))
    # generate fills what a config leaves unset from the model's generation config: with a neutral
    # one in its place for the call, it applies only the settings above and the processors, as the
    # continuous path does (generate's own penalty would also count the padding; RowPenalty applies
    # the model's, and settings the engine does not apply stay unapplied on both paths).
    own, model.generation_config = model.generation_config, GenerationConfig()
    try:
        out = model.generate(
            input_ids=input_ids.to(model.device),
            attention_mask=attention_mask.to(model.device),
            generation_config=config,
            logits_processor=processors or None,
        )  # (B, T + new)
    finally:
        model.generation_config = own
    eos = set(eos_ids)
    result = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, tok in enumerate(row) if tok in eos), len(row))
        result.append(row[:end])
    return result


@dataclass
class _Row:
    request: GenRequest
    slot: int
    """Row of the slot cache this request occupies."""
    length: int
    """Tokens of this row in the KV cache: its real entries are the last ``length`` columns."""
    new: list[int]
    """Tokens generated so far; the last one is not in the cache yet (it is the next input)."""
    generator: torch.Generator | None = None
    """The request's sampling generator (None when greedy)."""
    seen: torch.Tensor | None = None
    """``(V,)`` bool, the row's tokens so far (context and reply), when a repetition penalty applies."""


_HEADROOM = 128
"""Free time columns a slot cache is (re)allocated with, so ~128 decode steps pass between copies."""


class _SlotCache:
    """Preallocated KV buffers (slots, heads, capacity, dim) per layer, shared by all rows.

    Each layer's keys and values keep the heads and dim its prefill gave them: they may differ
    between layers, and between a layer's keys and values (multi-head latent attention, e.g.
    DeepSeek-V2/V3, caches a latent of one width as keys and another as values).

    Every row is right-aligned: its real entries are the last ``length`` columns of the live window
    ``[start, end)``, and a decode step writes every slot's new entry at column ``end``. So a step
    copies nothing (``DynamicLayer`` concatenates, i.e. copies the whole cache, every step), a
    finished row just frees its slot, and trimming the columns no live row uses moves ``start``.
    Buffers start zeroed and only receive finite keys/values, so masked-out stale columns cannot
    inject NaN into attention.
    """

    def __init__(self, prefill_cache, slots: int) -> None:
        first = prefill_cache.layers[0].keys  # (n, H, W, D)
        # (heads, dim) of each layer's keys and of its values
        self.shapes = [
            ((layer.keys.shape[1], layer.keys.shape[3]), (layer.values.shape[1], layer.values.shape[3]))
            for layer in prefill_cache.layers
        ]
        self.dtype, self.device = first.dtype, first.device
        self.num_layers = len(prefill_cache.layers)
        self.start = self.end = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._allocate(slots, first.shape[-2] + _HEADROOM)
        owner = self

        class SlotLayer(DynamicLayer):
            """A ``DynamicLayer`` whose update writes at column ``end`` of the owner's buffers."""

            def __init__(self, index: int) -> None:
                super().__init__()
                self.index = index
                self.is_initialized = True
                self.dtype, self.device = owner.dtype, owner.device

            def update(self, key_states, value_states, *args, **kwargs):
                q = key_states.shape[-2]
                k, v = owner.k[self.index], owner.v[self.index]
                k[:, :, owner.end : owner.end + q] = key_states
                v[:, :, owner.end : owner.end + q] = value_states
                self.keys = k[:, :, owner.start : owner.end + q]
                self.values = v[:, :, owner.start : owner.end + q]
                return self.keys, self.values

            def get_seq_length(self) -> int:
                return owner.end - owner.start

        self.cache = DynamicCache()
        self.cache.layers = [SlotLayer(i) for i in range(self.num_layers)]

    @property
    def slots(self) -> int:
        return self.k[0].shape[0]

    def _allocate(self, slots: int, capacity: int, keep: torch.Tensor | None = None) -> None:
        """New zeroed buffers; the live window (of the rows ``keep``) is copied right-aligned at ``capacity - _HEADROOM``."""
        width = self.end - self.start
        end = max(capacity - _HEADROOM, width)
        new_k, new_v = [], []
        for i, ((k_heads, k_dim), (v_heads, v_dim)) in enumerate(self.shapes):
            k = torch.zeros((slots, k_heads, end + _HEADROOM, k_dim), dtype=self.dtype, device=self.device)
            v = torch.zeros((slots, v_heads, end + _HEADROOM, v_dim), dtype=self.dtype, device=self.device)
            if self.k and width:
                old_k, old_v = self.k[i][:, :, self.start : self.end], self.v[i][:, :, self.start : self.end]
                if keep is not None:
                    old_k, old_v = old_k.index_select(0, keep), old_v.index_select(0, keep)
                k[: old_k.shape[0], :, end - width : end] = old_k
                v[: old_v.shape[0], :, end - width : end] = old_v
            new_k.append(k)
            new_v.append(v)
        self.k, self.v = new_k, new_v
        self.start, self.end = end - width, end

    def reserve_step(self) -> None:
        """Make room for one more column at ``end`` (shift the window left, or grow)."""
        if self.end < self.k[0].shape[-2]:
            return
        self._allocate(self.slots, self.end - self.start + _HEADROOM)

    def install(self, slots: list[int], prefill_cache, lengths: list[int]) -> None:
        """Copy the prefilled rows (right-aligned, as a left-padded prefill leaves them) into ``slots``."""
        width = max(lengths)
        if width > self.end:  # not enough columns left of the window: re-lay it out further right
            self._allocate(self.slots, max(width, self.end - self.start) + _HEADROOM)
        self.start = min(self.start, self.end - width)
        index = torch.tensor(slots, device=self.device)
        for i, layer in enumerate(prefill_cache.layers):
            self.k[i][:, :, self.end - width : self.end].index_copy_(0, index, layer.keys[:, :, -width:])
            self.v[i][:, :, self.end - width : self.end].index_copy_(0, index, layer.values[:, :, -width:])

    def trim(self, longest: int) -> None:
        """Drop the window's columns left of the longest live row."""
        self.start = max(self.start, self.end - longest)

    def compact(self, keep: list[int]) -> None:
        """Keep only the slots ``keep`` (in that order), e.g. when few rows remain and no request waits."""
        self._allocate(len(keep), self.end - self.start + _HEADROOM, torch.tensor(keep, device=self.device))


class ContinuousBatcher:
    """Generate replies for a queue of requests, keeping up to ``batch_size`` rows busy every step.

    The in-process :class:`medusa_train.engines.base.Engine`: :meth:`run` takes the requests and
    the ``on_done`` callback; ``max_new_tokens``, the end-of-turn ids and the sampling settings are
    fixed at construction.

    Why: a static batch keeps stepping until its longest reply ends; with the ragged reply lengths
    of chat data most of its row-steps then carry no real token (measured: 613 of 1,024 on the
    embedded backbone). Here a row leaves the batch the moment it emits EOS or reaches
    ``max_new_tokens``, and waiting requests join it, so the batch stays full.

    How: one preallocated KV cache (:class:`_SlotCache`) holds every active row in a slot of its
    own, right-aligned so that each row's real entries are the last ``length`` columns of the time
    axis. A decode step feeds each row's last token with ``position_ids = length`` and a 2-D
    attention mask that is 1 on that suffix, i.e. exactly what ``generate`` does for a left-padded
    batch. A finished row frees its slot; columns that are padding for every remaining row are
    trimmed. Joining rows are prefilled together in one forward (left-padded among themselves) and
    copied into free slots. Rows join once ``refill_min`` slots are free (or the batch ran empty): a prefill is a forward
    of its own, so refilling one slot at a time would add a forward nearly every step.

    Greedy rows equal unbatched ``generate(do_sample=False)`` token for token (a padded forward
    differs from an unpadded one only in the last floating-point bits, as in ``generate``'s own
    batching); sampled rows draw with their own generator (:func:`sample_rows`: ``temperature``,
    ``top_k``, ``top_p``, ``min_p`` as ``generate`` applies them). ``repetition_penalty`` (the stage
    passes the model's) applies over each row's own tokens (see the module docstring).

    Models whose cache layers are not plain ``DynamicLayer`` (sliding-window or hybrid caches, e.g.
    Mistral with ``sliding_window`` set, Gemma 2/3; chunked attention, Llama 4; layers that read an
    earlier layer's KV, Gemma 4's ``num_kv_shared_layers``) cannot be edited this way; for them
    requests run in static ``generate`` batches of ``batch_size`` (:func:`generate_batch`), with the
    same results.
    """

    def __init__(
        self,
        model,
        *,
        batch_size: int,
        pad_id: int,
        eos_ids: list[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        refill_min: int | None = None,
    ) -> None:
        self.model = model
        self.batch_size = batch_size
        self.pad_id = pad_id
        self.eos = set(eos_ids)
        self.eos_ids = list(eos_ids)
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.min_p = min_p
        self.repetition_penalty = repetition_penalty
        # A quarter of the batch. At batch 16 on the embedded backbone, joining at 1, 2 or 4 free slots
        # gave tokens/s within 3% of each other and 8 was 10% slower; 4 runs 3.5x fewer prefills than
        # 1 (each a forward of its own), which matters more where a forward costs more.
        self.refill_min = refill_min if refill_min is not None else max(1, batch_size // 4)
        self.continuous = self._cache_is_editable()
        self.stats = {"prefills": 0, "decode_steps": 0, "row_steps": 0}
        """Forwards run so far: prefills, decode steps, and rows summed over decode steps."""
        self._keep_one = "logits_to_keep" in inspect.signature(model.forward).parameters

    def _cache_is_editable(self) -> bool:
        try:
            cache = DynamicCache(config=self.model.config)
        except Exception:  # noqa: BLE001 - any model whose config the cache cannot read: static fallback
            return False
        return all(type(layer) is DynamicLayer for layer in cache.layers)

    @torch.no_grad()
    def run(
        self,
        requests: list[GenRequest],
        on_done: OnDone,
    ) -> None:
        """Generate every request; ``on_done(request, new_tokens)`` may return a follow-up request.

        A follow-up (e.g. the next turn of the same conversation) is queued ahead of requests not
        started yet, so conversations finish early and their memory is released.
        """
        queue = deque(requests)
        if self.continuous:
            self._run_continuous(queue, on_done)
        else:
            self._run_static(queue, on_done)

    def _run_static(self, queue: deque[GenRequest], on_done: OnDone) -> None:
        while queue:
            batch = [queue.popleft() for _ in range(min(self.batch_size, len(queue)))]
            gens = [request_generator(r.seed) for r in batch] if self.temperature > 0 else None
            outs = generate_batch(
                self.model,
                [r.context for r in batch],
                pad_id=self.pad_id,
                eos_ids=self.eos_ids,
                max_new_tokens=self.max_new_tokens,
                generators=gens,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                repetition_penalty=self.repetition_penalty,
            )
            follow = [f for r, o in zip(batch, outs, strict=True) if (f := on_done(r, o)) is not None]
            queue.extendleft(reversed(follow))

    def _choose(self, logits: torch.Tensor, rows: list[_Row]) -> list[int]:
        """Next token per row from its last-position logits (B, V), penalised over the row's own tokens."""
        penalised = self.repetition_penalty != 1.0
        if penalised:
            logits = penalize(logits, torch.stack([r.seen for r in rows]), self.repetition_penalty)
        if self.temperature > 0:
            generators = [r.generator for r in rows]
            tokens = sample_rows(logits, generators, self.temperature, self.top_p, self.top_k, self.min_p)
        else:
            tokens = logits.argmax(dim=-1)
        chosen = tokens.tolist()
        if penalised:
            for row, token in zip(rows, chosen, strict=True):
                row.seen[token] = True
        return chosen

    def _prefill(self, requests: list[GenRequest]):
        """One forward over the joining requests, left-padded among themselves; their first tokens chosen."""
        device = self.model.device
        ids, mask = _left_pad([r.context for r in requests], self.pad_id)  # (n, W), (n, W)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (n, W): 0.. on each row's real tokens
        cache = DynamicCache(config=self.model.config)
        extra = {"logits_to_keep": 1} if self._keep_one else {}
        out = self.model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=positions.to(device),
            use_cache=True,
            **cache_kwargs(self.model, cache),
            **extra,
        )
        self.stats["prefills"] += 1
        sampled = self.temperature > 0
        rows = [
            _Row(r, -1, len(r.context), [], request_generator(r.seed) if sampled else None) for r in requests
        ]
        logits = out.logits[:, -1].float()  # (n, V)
        if self.repetition_penalty != 1.0:
            seen = _seen_tokens([r.context for r in requests], logits.shape[-1], logits.device)
            for row, row_seen in zip(rows, seen, strict=True):
                row.seen = row_seen
        for row, tok in zip(rows, self._choose(logits, rows), strict=True):
            row.new.append(tok)
        return cache, rows

    def _decode_step(self, slots: _SlotCache, rows: list[_Row]) -> None:
        """Feed every row's last token; free slots get a pad token that attends only to itself."""
        device = self.model.device
        slots.reserve_step()
        width = slots.end - slots.start
        ids = torch.full((slots.slots, 1), self.pad_id, dtype=torch.long)  # (S, 1)
        lengths = torch.zeros(slots.slots, dtype=torch.long)  # (S,): 0 on free slots
        live = torch.tensor([r.slot for r in rows])
        ids[live, 0] = torch.tensor([r.new[-1] for r in rows])
        lengths[live] = torch.tensor([r.length for r in rows])
        mask = (torch.arange(width + 1) >= (width - lengths).unsqueeze(-1)).long()  # (S, W + 1)
        out = self.model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=lengths.unsqueeze(-1).to(device),
            use_cache=True,
            **cache_kwargs(self.model, slots.cache),
        )
        slots.end += 1
        self.stats["decode_steps"] += 1
        self.stats["row_steps"] += len(rows)
        logits = out.logits[:, -1].float()[live.to(device)]  # (B, V)
        for row, tok in zip(rows, self._choose(logits, rows), strict=True):
            row.length += 1
            row.new.append(tok)

    def _run_continuous(self, queue: deque[GenRequest], on_done: OnDone) -> None:
        slots: _SlotCache | None = None
        rows: list[_Row] = []
        while queue or rows:
            capacity = self.batch_size if slots is None else slots.slots
            free = capacity - len(rows)
            if queue and (not rows or free >= min(self.refill_min, len(queue))):
                joining = [queue.popleft() for _ in range(min(free, len(queue)))]
                cache, new_rows = self._prefill(joining)
                if slots is None:
                    slots = _SlotCache(cache, self.batch_size)
                taken = {r.slot for r in rows}
                open_slots = [i for i in range(slots.slots) if i not in taken]
                for row, slot in zip(new_rows, open_slots[: len(new_rows)], strict=True):
                    row.slot = slot
                slots.install([r.slot for r in new_rows], cache, [r.length for r in new_rows])
                rows += new_rows
            else:
                self._decode_step(slots, rows)
            done = [r for r in rows if r.new[-1] in self.eos or len(r.new) >= self.max_new_tokens]
            if not done:
                continue
            follow = [f for r in done if (f := on_done(r.request, r.new)) is not None]
            queue.extendleft(reversed(follow))
            finished = {id(r) for r in done}
            rows = [r for r in rows if id(r) not in finished]
            if not rows:
                slots.trim(0)
                continue
            slots.trim(max(r.length for r in rows))
            # The tail (nothing waits): stop computing empty slots. Never needs growing back: a
            # finished row queues at most one follow-up, so the queue stays within the free slots.
            if not queue and len(rows) <= slots.slots // 2:
                rows.sort(key=lambda r: r.slot)
                slots.compact([r.slot for r in rows])
                for i, r in enumerate(rows):
                    r.slot = i
