"""Medusa tree-attention decoding on an unmodified Hugging Face causal LM.

Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads"
(arXiv:2401.10774).

Each step: the K heads read the hidden state of the last token in the KV cache and propose their
top-k tokens; a tree of candidate continuations (the root is the token the backbone already chose)
is verified in ONE forward of the backbone through its own ``forward``: a 4-D float attention mask
``(1, 1, M, past + M)`` (0 where a node may attend, dtype-min elsewhere) and explicit position ids
``past + depth`` on top of a ``DynamicCache``. The accepted path is kept, its KV entries are moved
into place (no re-forward), and the logits/hidden state of its last node seed the next step.

Why ``model(..., output_hidden_states=True)`` rather than ``get_decoder()`` + ``lm_head``: the full
forward applies whatever the architecture does after the decoder (logit soft-capping or scaling in
Gemma-2, Cohere, Granite, ...), so the verification logits are exactly those ``generate`` sees;
``hidden_states[-1]`` is what ``lm_head`` reads (checked per architecture in the tests). The tuple
only holds references to activations computed anyway; the prefill keeps one position of logits
(``logits_to_keep=1``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F
from transformers import DynamicCache

from ..heads import MedusaHeads
from .acceptance import ACCEPTANCE_RULES, accept_greedy, accept_sample, accept_typical, first_token
from .tree import TreeBuffers, as_tree


@dataclass
class MedusaOutput:
    """What :func:`medusa_generate` produced.

    Attributes:
        tokens: ``(n,)`` long, the new tokens (CPU).
        accepted_lengths: tokens emitted per step: 1 (the step's root, chosen by the backbone) plus the
            number of accepted head candidates. ``sum(accepted_lengths) == len(tokens)``.
        num_forwards: verification forwards run (the last step may need none: a root that is EOS or
            the last allowed token is emitted without one). The prefill is not counted.
        stop_reason: ``"max_new_tokens"``, ``"eos"``, ``"context"`` (model's context limit) or
            ``"empty"`` (no room for any token).
        prefill_s: seconds in the prefill forward.
        forward_s: seconds in verification forwards (model only).
        total_s: wall-clock seconds of the whole call.
    """

    tokens: torch.Tensor
    accepted_lengths: list[int] = field(default_factory=list)
    num_forwards: int = 0
    stop_reason: str = "max_new_tokens"
    prefill_s: float = 0.0
    forward_s: float = 0.0
    total_s: float = 0.0

    @property
    def num_steps(self) -> int:
        """Decode steps (entries of ``accepted_lengths``)."""
        return len(self.accepted_lengths)

    @property
    def tau(self) -> float:
        """Mean tokens per step (plain decoding = 1.0, at most tree depth + 1)."""
        return len(self.tokens) / max(1, self.num_steps)

    @property
    def overhead_s(self) -> float:
        """Seconds outside the model's forwards (heads, candidates, acceptance, KV compaction)."""
        return max(0.0, self.total_s - self.prefill_s - self.forward_s)

    @property
    def overhead_fraction(self) -> float:
        """``overhead_s`` over the decode time (total minus prefill)."""
        decode = self.total_s - self.prefill_s
        return self.overhead_s / decode if decode > 0 else 0.0


class PackedHeads:
    """The K heads' weights stacked once, so one step's head logits are batched products.

    Stacking costs one copy of the heads' weights (``K * (L * d * d + V * d)`` values); pack once and
    pass the result to many :func:`medusa_generate` calls.

    Args:
        heads: trained :class:`MedusaHeads`.
    """

    def __init__(self, heads: MedusaHeads) -> None:
        self.num_heads = heads.num_heads
        self.num_layers = heads.num_layers
        with torch.no_grad():
            blocks = [
                [heads.blocks(k)[i].linear for i in range(heads.num_layers)] for k in range(heads.num_heads)
            ]
            d = heads.hidden_size
            ref = heads.proj(0).weight
            # Stored transposed and contiguous ((in, out) per head) so each step's batched products
            # read their right-hand side in order: measured ~25% faster than transposed views.
            self.w1t = (
                torch.stack([torch.stack([b.weight.t() for b in bl]) for bl in blocks]).detach().contiguous()
                if heads.num_layers
                else ref.new_zeros(heads.num_heads, 0, d, d)
            )  # (K, L, d_in, d_out)
            self.b1 = (
                torch.stack([torch.stack([b.bias for b in bl]) for bl in blocks]).detach()
                if heads.num_layers
                else ref.new_zeros(heads.num_heads, 0, d)
            )  # (K, L, d)
            self.w2t = heads.projection_weight().detach().transpose(1, 2).contiguous()  # (K, d, V)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of all heads at one position.

        Args:
            hidden: ``(d,)`` the backbone's last hidden state at that position.

        Returns:
            ``(K, V)``.
        """
        x = hidden.to(self.w2t.dtype).expand(self.num_heads, 1, -1)  # (K, 1, d)
        for i in range(self.num_layers):
            # x + SiLU(W1 x + b1) for all K heads in one batched product.
            x = x + F.silu(torch.baddbmm(self.b1[:, i, None, :], x, self.w1t[:, i]))  # (K, 1, d)
        return torch.bmm(x, self.w2t).squeeze(1)  # (K, V)

    @property
    def dtype(self) -> torch.dtype:
        return self.w2t.dtype


def context_limit(model: torch.nn.Module) -> int | None:
    """The model's maximum number of positions (``max_position_embeddings``), if it declares one."""
    return getattr(model.config, "max_position_embeddings", None)


def _sliding_window_kinds(config) -> tuple[int | None, str]:
    """(window, kind): kind is "full", "sliding" (every layer windowed) or "mixed" (per layer type)."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None, "full"
    types = getattr(config, "layer_types", None)
    if types is None:
        return window, "sliding"
    if all(t == "sliding_attention" for t in types):
        return window, "sliding"
    if any(t == "sliding_attention" for t in types):
        return window, "mixed"
    return None, "full"


def tree_attention_mask(
    model: torch.nn.Module, tree: TreeBuffers, past_len: int, dtype: torch.dtype
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The 4-D float mask for verifying ``tree`` on top of ``past_len`` cached tokens.

    Returns:
        ``(1, 1, M, past_len + M)`` with 0 where attention is allowed and ``finfo(dtype).min``
        elsewhere; a dict ``{"full_attention": ..., "sliding_attention": ...}`` for models whose
        layers mix full and sliding-window attention.
    """
    device = tree.depth.device
    m = tree.num_nodes
    allowed = torch.ones(m, past_len + m, dtype=torch.bool, device=device)  # (M, past + M)
    allowed[:, past_len:] = tree.attn_mask
    neg = torch.finfo(dtype).min

    def to_float(a: torch.Tensor) -> torch.Tensor:
        zero = torch.zeros((), dtype=dtype, device=device)
        return torch.where(a, zero, torch.full((), neg, dtype=dtype, device=device))[None, None]

    window, kind = _sliding_window_kinds(model.config)
    if kind == "full":
        return to_float(allowed)
    q_pos = past_len + tree.depth  # (M,)
    k_pos = torch.cat([torch.arange(past_len, device=device), q_pos])  # (past + M,)
    windowed = allowed & ((q_pos[:, None] - k_pos[None, :]) < window)  # (M, past + M)
    if kind == "sliding":
        return to_float(windowed)
    return {"full_attention": to_float(allowed), "sliding_attention": to_float(windowed)}


def verify_forward(
    model: torch.nn.Module,
    cache: DynamicCache,
    tree_tokens: torch.Tensor,
    tree: TreeBuffers,
    past_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One tree-attention forward through the model's own ``forward``; appends M entries to ``cache``.

    Args:
        tree_tokens: ``(M,)`` token of every node.
        tree: buffers on the model's device.
        past_len: tokens already in ``cache``.

    Returns:
        logits ``(M, V)`` and last hidden states ``(M, d)``.
    """
    dtype = next(model.parameters()).dtype
    mask = tree_attention_mask(model, tree, past_len, dtype)
    position_ids = (past_len + tree.depth)[None]  # (1, M)
    out = model(
        input_ids=tree_tokens[None],  # (1, M)
        attention_mask=mask,
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=True,
    )
    return out.logits[0], out.hidden_states[-1][0]  # (M, V), (M, d)


def compact_cache(cache: DynamicCache, past_len: int, path: Sequence[int]) -> None:
    """Keep the KV entries of the accepted ``path`` (tree node indices) right after ``past_len``.

    Layer tensors are ``(B, H, T, D)``; entry ``past_len + path[j]`` moves to ``past_len + j`` and
    the cache is cropped to ``past_len + len(path)``. Path nodes have strictly increasing depth and
    nodes are sorted by depth, so ``path[j] >= j``; the gather copies before it writes.
    """
    n = len(path)
    if list(path) != list(range(n)):  # a chain prefix is already in place
        index: dict[torch.device, torch.Tensor] = {}  # one host-to-device copy per device, not per layer
        for layer in cache.layers:
            dev = layer.keys.device
            if dev not in index:
                index[dev] = torch.as_tensor(path, device=dev) + past_len  # (n,)
            idx = index[dev]
            layer.keys[:, :, past_len : past_len + n] = layer.keys[:, :, idx]  # (B, H, n, D)
            layer.values[:, :, past_len : past_len + n] = layer.values[:, :, idx]  # (B, H, n, D)
    # A negative argument removes that many tokens, in every transformers 5.x release we support.
    surplus = cache.get_seq_length() - (past_len + n)
    if surplus > 0:
        cache.crop(-surplus)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _eos_set(eos_token_id: int | Sequence[int] | None) -> set[int]:
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(e) for e in eos_token_id}


@torch.inference_mode()
def medusa_generate(
    model: torch.nn.Module,
    heads: MedusaHeads | PackedHeads,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    tree: TreeBuffers | Sequence[Sequence[int]],
    acceptance: str = "greedy",
    temperature: float = 1.0,
    top_p: float = 1.0,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    eos_token_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
) -> MedusaOutput:
    """Generate with Medusa heads and tree verification (batch size 1).

    Args:
        model: a Hugging Face causal LM in eval mode whose forward accepts a 4-D float mask,
            ``position_ids`` and a ``DynamicCache`` (Llama, Qwen2, Mistral, GPT-2, ... with the
            "sdpa" or "eager" attention implementation; sliding-window layers are honoured).
        heads: the Medusa heads (or :class:`PackedHeads` built once from them).
        input_ids: ``(1, T)`` prompt.
        max_new_tokens: most tokens to generate; generation also stops before the model's
            ``max_position_embeddings`` (prompt + new tokens never exceed it).
        tree: :class:`TreeBuffers` or a list of index paths; depth must not exceed the number of heads.
        acceptance: "greedy" (identical to ``generate(do_sample=False)``), "typical" (Medusa's
            rule) or "sample" (same distribution as ``generate(do_sample=True)``); see
            :mod:`medusa_train.decoding.acceptance`.
        temperature: sampling temperature for "typical" and "sample" (0 means greedy).
        top_p: nucleus filtering for "sample".
        posterior_threshold: epsilon of typical acceptance.
        posterior_alpha: delta of typical acceptance (threshold = min(epsilon, delta * exp(-H))).
        eos_token_id: one id or several; an EOS inside an accepted path is emitted and ends generation.
        generator: random generator for "sample" (on the model's device); the typical rule is
            deterministic given the heads.

    Returns:
        :class:`MedusaOutput`.

    Raises:
        ValueError: batch size is not 1, an unknown acceptance rule, or bad sampling settings.
        TreeError: the tree is malformed or deeper than the number of heads.
    """
    t_start = time.perf_counter()
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(
            f"medusa_generate decodes one sequence: input_ids must be (1, T), got {tuple(input_ids.shape)}"
        )
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty: give at least one prompt token")
    if acceptance not in ACCEPTANCE_RULES:
        raise ValueError(f"acceptance must be one of {ACCEPTANCE_RULES}, got {acceptance!r}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature} and {top_p}")
    attn = getattr(model.config, "_attn_implementation", None) or "eager"
    if attn.startswith("flash"):
        raise ValueError(
            f"tree verification needs a 4-D float attention mask, which {attn} cannot take: "
            "load the model with attn_implementation='sdpa' or 'eager'"
        )
    device = input_ids.device
    tree = as_tree(tree).to(device)
    tree.check_heads(heads.num_heads)
    packed = heads if isinstance(heads, PackedHeads) else PackedHeads(heads)
    eos = _eos_set(eos_token_id)

    prompt_len = input_ids.shape[1]
    limit = context_limit(model)
    budget = max_new_tokens if limit is None else min(max_new_tokens, limit - prompt_len)
    if budget <= 0:
        return MedusaOutput(tokens=torch.empty(0, dtype=torch.long), stop_reason="empty")
    stop_at_limit = budget < max_new_tokens

    def accept(tree_tokens: torch.Tensor, logits: torch.Tensor, sub: TreeBuffers):
        if acceptance == "greedy":
            return accept_greedy(tree_tokens, logits, sub)
        if acceptance == "typical":
            return accept_typical(
                tree_tokens,
                logits,
                sub,
                temperature=temperature,
                posterior_threshold=posterior_threshold,
                posterior_alpha=posterior_alpha,
            )
        return accept_sample(
            tree_tokens, logits, sub, temperature=temperature, top_p=top_p, generator=generator
        )

    # 1. Prefill: the prompt goes into the cache; keep the last position's logits and hidden state.
    t0 = _now(device)
    cache = DynamicCache()
    out = model(
        input_ids=input_ids,
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=True,
        logits_to_keep=1,
    )
    hidden = out.hidden_states[-1][0, -1]  # (d,)
    # 2. The first root: the backbone's own choice after the prompt.
    root = first_token(
        out.logits[0, -1], acceptance, temperature=temperature, top_p=top_p, generator=generator
    )
    prefill_s = _now(device) - t0
    del out

    tokens: list[int] = []
    lengths: list[int] = []
    forward_s = 0.0
    num_forwards = 0
    stop_reason = "context" if stop_at_limit else "max_new_tokens"
    while True:
        past_len = prompt_len + len(tokens)  # tokens in the cache; the root is not yet in it
        room = budget - len(tokens)  # >= 1: tokens we may still emit, root included
        # 3. A root that is EOS or the last allowed token is emitted without a forward.
        if root in eos or room == 1:
            tokens.append(root)
            lengths.append(1)
            if root in eos:
                stop_reason = "eos"
            break
        # 4. Candidates: all K heads in one batched product on the last hidden state; nodes deeper
        #    than room - 1 could not be emitted (and might pass the position limit), so cut them.
        sub = tree.prefix(room - 1)
        root_t = torch.tensor([root], device=device)  # (1,)
        if sub.max_depth > 0:
            head_logits = packed.logits(hidden)[: sub.max_depth]  # (D, V)
            top = head_logits.topk(sub.topk, dim=-1).indices  # (D, topk)
            flat = torch.cat([root_t, top.reshape(-1)])  # (1 + D * topk,)
            tree_tokens = flat[sub.tree_indices]  # (M,)
        else:
            tree_tokens = root_t  # (1,)
        # 5. Verify the whole tree in one forward of the backbone.
        t0 = _now(device)
        logits, node_hidden = verify_forward(model, cache, tree_tokens, sub, past_len)  # (M, V), (M, d)
        forward_s += _now(device) - t0
        num_forwards += 1
        # 6. Acceptance: the path of nodes to keep and the token after it (the next root).
        result = accept(tree_tokens, logits, sub)
        path = result.path
        node_tokens = tree_tokens.tolist()  # one device-to-host copy of M ints
        path_tokens = [node_tokens[n] for n in path]
        # 7. EOS inside the path: emit up to and including it, then stop.
        cut = next((j + 1 for j, tok in enumerate(path_tokens) if tok in eos), None)
        if cut is not None:
            tokens.extend(path_tokens[:cut])
            lengths.append(cut)
            stop_reason = "eos"
            break
        tokens.extend(path_tokens)
        lengths.append(len(path))
        if len(tokens) >= budget:
            break
        # 8. Keep the accepted nodes' KV entries in place; no re-forward.
        compact_cache(cache, past_len, path)
        # 9. The last accepted node's hidden state feeds the heads; its successor is the next root.
        hidden = node_hidden[path[-1]]  # (d,)
        root = result.next_token

    return MedusaOutput(
        tokens=torch.tensor(tokens, dtype=torch.long),
        accepted_lengths=lengths,
        num_forwards=num_forwards,
        stop_reason=stop_reason,
        prefill_s=prefill_s,
        forward_s=forward_s,
        total_s=time.perf_counter() - t_start,
    )
