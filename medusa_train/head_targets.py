"""What the heads read, are trained on and are scored on.

One definition of the targets (head k at position t predicts token t+k+1), shared by the training
loss (``training/losses.py``), the hidden-state cache (``training/hidden_cache.py``) and the held-out
accuracy that calibrates the tree (``decoding/calibrate.py``); the backbone's last hidden state the
heads read, and the language model that returns it; what the backbone's forward does to ``lm_head`` of
it before its logits (:class:`LogitMap`: the soft targets and Medusa-2's LM losses are the distribution
that forward gives); and the top-k correctness count both training metrics and calibration use.

Torch and the project's errors only (no Hydra, no training code): decoding imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from medusa_train.errors import UserError

IGNORE_INDEX = -100
"""Target value of a position that is not trained (nor scored) for a head."""


def medusa_targets(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, attention_mask: torch.Tensor, num_heads: int
) -> torch.Tensor:
    """Per-head targets of every position, ``IGNORE_INDEX`` where the prediction is not trained.

    Head k (1-based) at position t predicts token ``t+k+1``; that prediction counts iff
    ``loss_mask[t+k+1] == 1`` (a token the backbone generated), ``t+k+1`` is a real position and no
    generated span ends within ``t .. t+k`` (a generated token followed by one that is not): Medusa
    asks head k for the token after ``t+1 .. t+k`` of the same reply, never for a later reply's token
    across the end of this one and the user turn after it.

    Args:
        input_ids: ``(B, T)``.
        loss_mask: ``(B, T)``, 1 on tokens the backbone generated.
        attention_mask: ``(B, T)``, 0 on padding.
        num_heads: K.

    Returns:
        ``(B, T, K)`` long: ``[b, t, k-1] = input_ids[b, t+k+1]`` when ``loss_mask[b, t+k+1] == 1``,
        that position is real (not padding, inside T) and no generated span ends in ``t .. t+k``, else
        ``IGNORE_INDEX``.
    """
    b, t = input_ids.shape
    valid = (loss_mask.bool() & attention_mask.bool()).to(input_ids.device)  # (B, T)
    ends = valid[:, :-1] & ~valid[:, 1:]  # (B, T-1): j is generated, j+1 is not
    # before[:, j] = generated spans ending at positions < j; those ending in t..t+k: before[t+k+1] - before[t]
    before = torch.nn.functional.pad(ends.long().cumsum(dim=1), (1, 0))  # (B, T)
    targets = torch.full((b, t, num_heads), IGNORE_INDEX, dtype=torch.long, device=input_ids.device)
    for k in range(1, num_heads + 1):
        shift = k + 1
        if shift >= t:
            break
        same_turn = before[:, shift:t] == before[:, : t - shift]  # (B, T-shift)
        tgt = torch.where(valid[:, shift:] & same_turn, input_ids[:, shift:], IGNORE_INDEX)  # (B, T-shift)
        targets[:, : t - shift, k - 1] = tgt
    return targets


def soft_target_sources(targets: torch.Tensor) -> torch.Tensor:
    """Where each head's soft target comes from: the position whose next-token distribution predicts
    the same token as the head.

    Head k at position t predicts token ``t+k+1``, which the backbone predicts at position ``t+k``:
    the soft target of head k at t is the backbone's distribution at ``t+k``.

    Args:
        targets: ``(B, T, K)`` from :func:`medusa_targets`.

    Returns:
        ``(B, T, K)`` long: the flat index ``b * T + t + k`` into ``hidden.reshape(B * T, d)`` where
        ``targets`` counts, ``IGNORE_INDEX`` elsewhere.
    """
    b, t, k = targets.shape
    flat = torch.arange(b * t, device=targets.device).view(b, t, 1)  # (B, T, 1)
    shift = torch.arange(1, k + 1, device=targets.device)  # (K,)
    return torch.where(targets != IGNORE_INDEX, flat + shift, IGNORE_INDEX)  # (B, T, K)


def select_trained_rows(hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep only positions where at least one head has a target (the rest cost compute, add nothing).

    Args:
        hidden: ``(B, T, d)``.
        targets: ``(B, T, K)`` from :func:`medusa_targets`.

    Returns:
        ``(N, d)`` hidden rows and ``(N, K)`` targets.
    """
    d, k = hidden.shape[-1], targets.shape[-1]
    flat_t = targets.reshape(-1, k)  # (B*T, K)
    keep = (flat_t != IGNORE_INDEX).any(dim=-1).nonzero(as_tuple=True)[0]  # (N,)
    return hidden.reshape(-1, d)[keep], flat_t[keep]  # (N, d), (N, K)


def language_model(model: nn.Module) -> nn.Module:
    """The language model of ``model`` without its LM head: the module whose forward returns as
    ``last_hidden_state`` what ``lm_head`` reads.

    ``get_decoder()``, followed while what it returns has an LM head of its own (a multimodal model's
    language model that is a causal LM: Llama 4's). Where transformers' lookup finds no submodule, as
    for a causal LM whose ``base_model_prefix`` names the attribute of its multimodal parent (Llama 4's
    and Mllama's ``language_model``: ``get_decoder()`` is the causal LM itself), or finds a layer
    (ModernBERT's decoder: its output embeddings), the one model inside it.

    Args:
        model: a Hugging Face causal LM (or a peft model around one).

    Raises:
        UserError: no one such model (none inside the causal LM, or several): its architecture is not
            one medusa_train can train or score heads on, in one line naming its class.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    module = base
    while (head := _output_embeddings(module)) is not None:
        decoder = module.get_decoder()
        if decoder is module or decoder is head:
            inner = [m for m in module.children() if callable(getattr(m, "get_decoder", None))]
            if len(inner) != 1:
                kind = getattr(getattr(base, "config", None), "model_type", None)
                names = ", ".join(type(m).__name__ for m in inner)
                found = f"{len(inner)} models inside ({names})" if inner else "no model inside"
                raise UserError(
                    f"{type(base).__name__}{f' ({kind})' if kind else ''}: medusa_train cannot train or "
                    "score Medusa heads on this architecture: the heads read the last_hidden_state of the one "
                    f"language model under its LM head, and {type(module).__name__}'s get_decoder() returns "
                    f"{'itself' if decoder is module else 'its LM head'}, with {found}: use a model whose "
                    "get_decoder() returns its language model, or report the architecture to medusa_train"
                )
            decoder = inner[0]
        module = decoder
    return module


def _output_embeddings(module: nn.Module) -> nn.Module | None:
    """``module``'s LM head (``get_output_embeddings()``); None for a module without one."""
    get = getattr(module, "get_output_embeddings", None)
    return get() if callable(get) else None


def _reads_h_outside(model: nn.Module, hidden_size: int) -> bool:
    """Whether a parameter of ``model`` outside its language model (:func:`language_model`) and its LM
    head has a dimension of ``hidden_size``: a prediction head between the two that reads the last
    hidden state at that width (ELECTRA's ``generator_predictions``, RemBERT's ``cls.predictions``),
    where the language model of an LM head of another width projects to it inside (OPT-350m's
    ``project_out``) and nothing else reads ``h``. Shapes only (ZeRO-3's ``ds_shape`` where partitioned):
    no forward. On the causal LMs of transformers 5.24 whose LM head reads another width than
    ``hidden_size`` (ELECTRA, RemBERT; OPT with ``word_embed_proj_dim``), it says what a forward says."""
    inside = {id(p) for p in language_model(model).parameters()}
    inside |= {id(p) for p in _output_embeddings(model).parameters()}
    return any(
        hidden_size in tuple(getattr(p, "ds_shape", p.shape))
        for p in model.parameters()
        if id(p) not in inside
    )


def last_hidden_state(
    backbone: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """The decoder's final (post-norm) hidden state, i.e. exactly what ``lm_head`` and the heads read.

    Calls the language model under the LM head (:func:`language_model`) so the ``(B, T, V)`` logits are
    never computed.

    Args:
        backbone: a Hugging Face causal LM (or a peft model around one).
        input_ids: ``(B, T)``; attention_mask: ``(B, T)``.

    Returns:
        ``(B, T, d)``.
    """
    decoder = language_model(backbone)
    return decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state


def hidden_width(model: nn.Module) -> int:
    """d, the width of what the heads read: the :func:`last_hidden_state` of ``model``'s language model,
    which the decoders' forwards return as ``hidden_states[-1]``.

    The width of the vectors its LM head reads where that is the config's ``hidden_size`` (the latter
    for a model without an LM head). Where the two differ, the LM head reads either the last hidden
    state itself, projected at the decoder's end (OPT-350m's ``project_out``, to its
    ``word_embed_proj_dim``), or the output of a prediction head of another width (ELECTRA's generators,
    RemBERT: their ``embedding_size``, ``output_embedding_size``): a forward of one token of the language
    model says which. A model ZeRO-3 loaded partitioned runs no forward outside its engine: its modules
    say which (:func:`_reads_h_outside`).

    Args:
        model: a Hugging Face causal LM (or a peft model around one).
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    hidden_size = int(base.config.get_text_config().hidden_size)
    weight = getattr(_output_embeddings(base), "weight", None)
    if weight is None:  # no LM head to compare with (a remote-code model's)
        return hidden_size
    head_width = int(getattr(weight, "ds_shape", weight.shape)[1])  # ds_shape: a ZeRO-3 partition's whole
    if head_width == hidden_size:
        return head_width
    if hasattr(weight, "ds_shape"):
        return hidden_size if _reads_h_outside(base, hidden_size) else head_width
    ids = torch.zeros(1, 1, dtype=torch.long, device=base.get_input_embeddings().weight.device)  # (1, 1)
    with torch.no_grad():
        return int(last_hidden_state(base, ids, torch.ones_like(ids)).shape[-1])


@dataclass(frozen=True)
class LogitMap:
    """What a backbone's forward does to ``z = lm_head(h)`` before it returns its logits:
    ``softcap * tanh(scale * z / softcap)``, or ``scale * z`` without a softcap.

    The backbone's next-token distribution is ``softmax(map(z))``; ``z`` alone is it only for the
    identity. Top-k and argmax are the same either way (the map is increasing), a softmax is not.
    """

    scale: float = 1.0
    softcap: float | None = None

    @property
    def is_identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        """``map(z)`` of float logits ``z`` (``(..., V)``); ``z`` itself for the identity."""
        if self.softcap is not None:
            return torch.tanh(z * (self.scale / self.softcap)) * self.softcap
        return z * self.scale if self.scale != 1.0 else z

    def with_slope_(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | float]:
        """``(map(z), d map / d z)``, the first written into ``z`` (float logits ``(..., V)``); the
        slope is a tensor like ``z`` under a softcap, else the number ``scale``."""
        if self.softcap is None:
            return (z.mul_(self.scale) if self.scale != 1.0 else z), self.scale
        t = z.mul_(self.scale / self.softcap).tanh_()  # (..., V)
        slope = (1.0 - t * t) * self.scale  # (..., V)
        return t.mul_(self.softcap), slope


def logit_map(model: nn.Module) -> LogitMap:
    """What ``model``'s forward does to ``lm_head(h)``, from its config: the final softcap of the Gemma
    family (``final_logit_softcapping``), Cohere's ``* logit_scale``, Granite's and MiniCPM3's
    ``/ logits_scaling`` and HyperCLOVA X's ``* logits_scaling``; the identity for other models.

    Args:
        model: a Hugging Face causal LM (or a peft model around one).
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    config = base.config.get_text_config()
    kind = str(getattr(config, "model_type", ""))
    scale = 1.0
    if kind.startswith("cohere") and getattr(config, "logit_scale", None) is not None:
        scale = float(config.logit_scale)
    elif (kind.startswith("granite") or kind == "minicpm3") and getattr(config, "logits_scaling", None):
        scale = 1.0 / float(config.logits_scaling)
    elif kind == "hyperclovax" and getattr(config, "logits_scaling", None) is not None:
        scale = float(config.logits_scaling)
    softcap = getattr(config, "final_logit_softcapping", None)
    return LogitMap(scale, float(softcap) if softcap else None)


@torch.no_grad()
def chunked_topk_correct(
    feats: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, topk: int, chunk_size: int = 1024
) -> torch.Tensor:
    """How many counted rows have their target within the top-1, top-2, ..., top-``topk`` logits.

    The logits ``feats @ weight.T`` are formed ``chunk_size`` rows at a time, never whole.

    Args:
        feats: ``(N, d)``; weight: ``(V, d)``; targets: ``(N,)`` with ``IGNORE_INDEX`` = not counted.

    Returns:
        ``(topk,)`` long cumulative counts: ``[i]`` = rows whose target ranks within the top ``i+1``.
    """
    correct = torch.zeros(topk, dtype=torch.long, device=feats.device)
    for start in range(0, feats.shape[0], chunk_size):
        y = targets[start : start + chunk_size]  # (c,)
        ok = y != IGNORE_INDEX
        if not bool(ok.any()):
            continue
        logits = feats[start : start + chunk_size][ok].to(weight.dtype) @ weight.t()  # (c', V)
        top = logits.topk(min(topk, logits.shape[-1]), dim=-1).indices  # (c', topk)
        hit = top == y[ok][:, None]  # (c', topk): at most one True per row
        correct[: hit.shape[1]] += hit.long().cumsum(dim=-1).sum(dim=0)
    return correct
