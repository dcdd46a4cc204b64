"""Medusa heads: K small residual MLPs that read the backbone's last hidden state.

Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads"
(arXiv:2401.10774). Head k (k = 1..K) reads h_t and predicts token t+k+1; the backbone's own
lm_head predicts t+1.

Each head is L residual blocks ``h + SiLU(W1 h + b1)`` (every block has its own weights) followed by
a ``d -> V`` projection without bias. W1 starts at zero so every block is the identity at init, and
the projection starts as a copy of the backbone's lm_head, so an untrained head predicts what the
backbone predicts for t+1 -- a far better start than random for t+k+1.

On disk we use the FasterDecoding layout (also read by TGI and TensorRT-LLM):
``config.json`` + ``medusa_lm_head.safetensors`` with keys ``{h}.{l}.linear.weight``,
``{h}.{l}.linear.bias`` (l < L) and ``{h}.{L}.weight``. That naming falls out of the module tree
below (``ModuleList[Sequential[ResBlock..., Linear]]``), so ``self.heads.state_dict()`` *is* the file format.

This module never imports Hydra or training code: decoding and export use it in a bare
torch + transformers environment.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from medusa_train.workdir import HEADS_CONFIG, HEADS_WEIGHTS, atomic_write, atomic_write_json


class HeadsFormatError(ValueError):
    """A heads directory is missing, incomplete or does not match the expected shapes."""


def safetensors_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from a safetensors file's header, checking that the file holds all the
    bytes the header announces (a truncated or foreign file fails here without reading the data).

    Raises:
        HeadsFormatError: missing, unreadable, not safetensors (e.g. a pickle), or truncated.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n <= 0 or 8 + n > size or n > 100 << 20:
                raise HeadsFormatError(
                    f"cannot read {path}: truncated, or not a safetensors file ({size} bytes)"
                )
            header = json.loads(fh.read(n))
    except FileNotFoundError:
        raise HeadsFormatError(f"cannot read {path}: it is missing") from None
    except OSError as err:
        raise HeadsFormatError(f"cannot read {path}: {err.strerror or err}") from None
    except ValueError:  # the header is no JSON
        raise HeadsFormatError(
            f"cannot read {path}: truncated, or not a safetensors file (its header does not parse)"
        ) from None
    if not isinstance(header, dict):
        raise HeadsFormatError(f"cannot read {path}: not a safetensors file (its header is not an object)")
    shapes, end = {}, 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            shapes[name] = tuple(int(d) for d in info["shape"])
            end = max(end, int(info["data_offsets"][1]))
        except (KeyError, TypeError, ValueError, IndexError):
            raise HeadsFormatError(
                f"cannot read {path}: damaged (tensor '{name}' has no valid shape/offsets)"
            ) from None
    if 8 + n + end != size:
        raise HeadsFormatError(
            f"cannot read {path}: truncated or damaged ({size} bytes, its header says {8 + n + end})"
        )
    return shapes


class ResBlock(nn.Module):
    """``h + SiLU(W1 h + b1)``; W1 and b1 start at zero so the block starts as the identity."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """K Medusa heads.

    Args:
        hidden_size: d, the backbone's hidden size.
        vocab_size: V, the backbone's vocabulary size (rows of its lm_head).
        num_heads: K, number of heads; head k predicts token t+k+1.
        num_layers: L, residual blocks per head.
        base_model_name_or_path: recorded in config.json for serving engines.

    Calling the module on hidden states ``(B, T, d)`` returns logits ``(K, B, T, V)``.
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        num_heads: int = 4,
        num_layers: int = 1,
        base_model_name_or_path: str | None = None,
    ) -> None:
        super().__init__()
        if num_heads < 1 or num_layers < 0 or hidden_size < 1 or vocab_size < 1:
            raise HeadsFormatError(
                f"invalid heads shape: num_heads={num_heads} num_layers={num_layers} "
                f"hidden_size={hidden_size} vocab_size={vocab_size}"
            )
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.num_heads = num_heads
        self.num_layers = num_layers
        self.base_model_name_or_path = base_model_name_or_path
        self.heads = nn.ModuleList(
            [
                nn.Sequential(
                    *[ResBlock(hidden_size) for _ in range(num_layers)],
                    nn.Linear(hidden_size, vocab_size, bias=False),
                )
                for _ in range(num_heads)
            ]
        )

    # -- structure -----------------------------------------------------------------------------
    def blocks(self, k: int) -> nn.Sequential:
        """The residual blocks of head k (0-based), without its vocab projection."""
        return self.heads[k][: self.num_layers]

    def proj(self, k: int) -> nn.Linear:
        """The ``d -> V`` projection of head k (0-based)."""
        return self.heads[k][self.num_layers]

    def init_from_lm_head(self, lm_head_weight: torch.Tensor) -> None:
        """Copy the backbone's lm_head ``(V, d)`` into every head's projection."""
        if tuple(lm_head_weight.shape) != (self.vocab_size, self.hidden_size):
            raise HeadsFormatError(
                f"lm_head weight has shape {tuple(lm_head_weight.shape)}, heads expect "
                f"({self.vocab_size}, {self.hidden_size})"
            )
        with torch.no_grad():
            for k in range(self.num_heads):
                self.proj(k).weight.copy_(lm_head_weight.to(self.proj(k).weight))

    # -- compute -------------------------------------------------------------------------------
    def hidden(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Run only the residual blocks.

        Args:
            hidden_states: ``(..., d)``.

        Returns:
            ``(K, ..., d)``: each head's pre-projection features (what chunked losses consume).
        """
        outs = []
        for k in range(self.num_heads):
            outs.append(self.blocks(k)(hidden_states))
        return torch.stack(outs, dim=0)

    def projection_weight(self) -> torch.Tensor:
        """All vocab projections stacked: ``(K, V, d)``."""
        return torch.stack([self.proj(k).weight for k in range(self.num_heads)], dim=0)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits of every head.

        Args:
            hidden_states: ``(B, T, d)`` (any leading shape works).

        Returns:
            ``(K, B, T, V)``.
        """
        feats = self.hidden(hidden_states)  # (K, B, T, d)
        weight = self.projection_weight()  # (K, V, d)
        k, *lead, d = feats.shape
        # One batched matmul for all heads instead of K separate projections.
        logits = torch.bmm(feats.reshape(k, -1, d), weight.transpose(1, 2))  # (K, B*T, V)
        return logits.reshape(k, *lead, self.vocab_size)

    # -- persistence ---------------------------------------------------------------------------
    def config_dict(self) -> dict:
        """The FasterDecoding-style config.json content."""
        return {
            "medusa_num_heads": self.num_heads,
            "medusa_num_layers": self.num_layers,
            "base_model_name_or_path": self.base_model_name_or_path,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
        }

    def save_pretrained(self, directory: str | os.PathLike, extra_config: dict | None = None) -> Path:
        """Write ``config.json`` + ``medusa_lm_head.safetensors`` atomically.

        Both files are written under temporary names in the target directory and renamed into
        place, so a killed process never leaves a half-written file under the final name.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {name: t.detach().to("cpu").contiguous() for name, t in self.heads.state_dict().items()}
        config = self.config_dict()
        if extra_config:
            config.update(extra_config)
        atomic_write(directory / HEADS_WEIGHTS, lambda p: save_file(state, str(p), metadata={"format": "pt"}))
        atomic_write_json(directory / HEADS_CONFIG, config)
        return directory

    @classmethod
    def from_pretrained(
        cls,
        directory: str | os.PathLike,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
    ) -> MedusaHeads:
        """Load heads saved by :meth:`save_pretrained` (or by FasterDecoding's Medusa)."""
        directory = Path(directory)
        config_path, weights_path = directory / HEADS_CONFIG, directory / HEADS_WEIGHTS
        if not config_path.is_file() or not weights_path.is_file():
            raise HeadsFormatError(
                f"{directory} is not a Medusa heads directory (needs {HEADS_CONFIG} and {HEADS_WEIGHTS})"
            )
        try:
            config = json.loads(config_path.read_bytes())
        except (ValueError, RecursionError):
            raise HeadsFormatError(f"{config_path} is damaged (not valid JSON)") from None
        if not isinstance(config, dict):
            raise HeadsFormatError(f"{config_path} is damaged (not a JSON object)")
        safetensors_shapes(weights_path)
        try:
            state = load_file(str(weights_path))
        except SafetensorError as err:
            raise HeadsFormatError(f"cannot read {weights_path}: {err}") from None
        try:
            num_heads = int(config["medusa_num_heads"])
            num_layers = int(config["medusa_num_layers"])
        except KeyError as err:
            raise HeadsFormatError(f"{config_path} lacks {err.args[0]}") from None
        except (TypeError, ValueError):
            raise HeadsFormatError(
                f"{config_path} has a non-integer medusa_num_heads/medusa_num_layers"
            ) from None
        # hidden/vocab sizes are not in every FasterDecoding config: read them off the weights.
        proj = state.get(f"0.{num_layers}.weight")
        if proj is None:
            raise HeadsFormatError(f"{weights_path} lacks key '0.{num_layers}.weight'")
        vocab_size, hidden_size = proj.shape
        heads = cls(
            hidden_size=int(config.get("hidden_size", hidden_size)),
            vocab_size=int(config.get("vocab_size", vocab_size)),
            num_heads=num_heads,
            num_layers=num_layers,
            base_model_name_or_path=config.get("base_model_name_or_path"),
        )
        expected = heads.heads.state_dict()
        for name, tensor in state.items():
            if name in expected and tuple(tensor.shape) != tuple(expected[name].shape):
                raise HeadsFormatError(
                    f"{weights_path}: '{name}' has shape {tuple(tensor.shape)}, its config implies "
                    f"{tuple(expected[name].shape)}"
                )
        missing, unexpected = heads.heads.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise HeadsFormatError(
                f"{weights_path} does not match its config: missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}"
            )
        return heads.to(device=device, dtype=dtype) if dtype is not None else heads.to(device)


# -- what the heads are trained and scored on -------------------------------------------------------
# One definition of the targets, shared by the training loss (training/losses.py), the hidden-state
# cache and the held-out accuracy that calibrates the tree (decoding/calibrate.py).
IGNORE_INDEX = -100
"""Target value of a position that is not trained (nor scored) for a head."""


def medusa_targets(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, attention_mask: torch.Tensor, num_heads: int
) -> torch.Tensor:
    """Per-head targets of every position, ``IGNORE_INDEX`` where the prediction is not trained.

    Head k (1-based) at position t predicts token ``t+k+1``; that prediction counts iff
    ``loss_mask[t+k+1] == 1`` (a token the backbone generated) and ``t+k+1`` is a real position.

    Args:
        input_ids: ``(B, T)``.
        loss_mask: ``(B, T)``, 1 on tokens the backbone generated.
        attention_mask: ``(B, T)``, 0 on padding.
        num_heads: K.

    Returns:
        ``(B, T, K)`` long: ``[b, t, k-1] = input_ids[b, t+k+1]`` when ``loss_mask[b, t+k+1] == 1`` and
        that position is real (not padding, inside T), else ``IGNORE_INDEX``.
    """
    b, t = input_ids.shape
    valid = (loss_mask.bool() & attention_mask.bool()).to(input_ids.device)  # (B, T)
    targets = torch.full((b, t, num_heads), IGNORE_INDEX, dtype=torch.long, device=input_ids.device)
    for k in range(1, num_heads + 1):
        shift = k + 1
        if shift >= t:
            break
        tgt = torch.where(valid[:, shift:], input_ids[:, shift:], IGNORE_INDEX)  # (B, T-shift)
        targets[:, : t - shift, k - 1] = tgt
    return targets


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


def last_hidden_state(
    backbone: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """The decoder's final (post-norm) hidden state, i.e. exactly what ``lm_head`` and the heads read.

    Calls the decoder submodule (``get_decoder()``) so the ``(B, T, V)`` logits are never computed.

    Args:
        backbone: a Hugging Face causal LM (or a peft model around one).
        input_ids: ``(B, T)``; attention_mask: ``(B, T)``.

    Returns:
        ``(B, T, d)``.
    """
    base = backbone.get_base_model() if hasattr(backbone, "get_base_model") else backbone  # peft
    decoder = base.get_decoder()
    return decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state


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
        logits = feats[start : start + chunk_size][ok] @ weight.t()  # (c', V)
        top = logits.topk(min(topk, logits.shape[-1]), dim=-1).indices  # (c', topk)
        hit = top == y[ok][:, None]  # (c', topk): at most one True per row
        correct[: hit.shape[1]] += hit.long().cumsum(dim=-1).sum(dim=0)
    return correct
