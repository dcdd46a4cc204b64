"""Medusa heads: K small residual MLPs that read the backbone's last hidden state.

Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads"
(arXiv:2401.10774). Head k (k = 1..K) reads h_t and predicts token t+k+1; the backbone's own
lm_head predicts t+1.

Each head is L residual blocks ``h + SiLU(W1 h + b1)`` (every block has its own weights) followed by
a ``d -> V`` projection without bias. W1 starts at zero so every block is the identity at init, and
the projection starts as a copy of the backbone's lm_head, so an untrained head predicts what the
backbone predicts for t+1 -- a far better start than random for t+k+1.

The vocabulary projection comes in three variants (``head_projection`` in config.json), because at
Llama-3 scale (V = 128,256, d = 4,096) one ``d -> V`` projection is 1 GB in bf16 per head:

- ``own`` (default): every head has its own ``d -> V`` projection (the Medusa paper).
- ``shared``: every head reuses the backbone's lm_head (FasterDecoding PR #97 "medusa2" heads, vLLM's
  ``original_lm_head``). Nothing but the residual blocks is stored or trained; the lm_head weight is
  bound at load/attach time (:meth:`MedusaHeads.attach`), never copied.
- ``truncated``: every head projects to a draft vocabulary of N tokens, the N most frequent targets
  of the distilled data (vLLM's ``truncated_vocab_size`` + ``token_map``, EAGLE-3's draft vocabulary).
  ``token_map`` ``(N,)`` gives the full-vocabulary id of every draft index and is saved with the heads;
  the decoder maps candidates back through it (:meth:`MedusaHeads.full_vocab_logits`). The tree's root
  always comes from the backbone's full lm_head, so greedy output stays that of plain decoding.

On disk we use the FasterDecoding layout (also read by TGI and TensorRT-LLM):
``config.json`` + ``medusa_lm_head.safetensors`` with keys ``{h}.{l}.linear.weight``,
``{h}.{l}.linear.bias`` (l < L) and ``{h}.{L}.weight``. That naming falls out of the module tree
below (``ModuleList[Sequential[ResBlock..., Linear]]``), so ``self.heads.state_dict()`` *is* the file format.
Shared heads store no ``{h}.{L}.weight`` (and say ``"version": "2"``, as FasterDecoding's medusa2 heads
do); truncated heads store ``{h}.{L}.weight`` of shape ``(N, d)`` and a ``token_map`` tensor.

Beside this module: the draft vocabulary (``draft_vocab.py``: choosing and checking a token map),
the safetensors header/size check (``safetensors_check.py``), and the heads' inputs, targets and
top-k correctness (``head_targets.py``). This module never imports Hydra or training code: decoding
and export use it in a bare torch + transformers environment.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

from medusa_train.draft_vocab import TOKEN_MAP, check_token_map
from medusa_train.errors import HeadsFormatError
from medusa_train.head_targets import IGNORE_INDEX, hidden_width
from medusa_train.heads_layout import check_heads_directory
from medusa_train.workdir import HEADS_CONFIG, HEADS_WEIGHTS, atomic_write, atomic_write_json

OWN, SHARED, TRUNCATED = "own", "shared", "truncated"
PROJECTIONS = (OWN, SHARED, TRUNCATED)
"""Head projection variants (``training.head_projection``; ``head_projection`` in config.json)."""


class _Unregistered:
    """Holds a tensor (or a module) without making it a parameter, buffer or submodule of the module
    that owns the holder: a shared head's lm_head stays out of ``state_dict()``, ``parameters()``,
    checkpoints and ``.to()`` (it lives where the backbone lives)."""

    def __init__(self, tensor: torch.Tensor | nn.Module | None = None) -> None:
        self.tensor = tensor


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
        head_projection: ``own`` | ``shared`` | ``truncated`` (module docstring).
        token_map: ``truncated`` only: ``(N,)`` distinct full-vocabulary ids, draft index -> token id.

    Calling the module on hidden states ``(B, T, d)`` returns logits ``(K, B, T, V_draft)`` over the
    draft vocabulary: V (``own``, ``shared``) or N (``truncated``: column j is token ``token_map[j]``).

    Raises:
        HeadsFormatError: impossible shapes, an unknown variant, or a token map that is not N distinct
            ids below V.
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        num_heads: int = 4,
        num_layers: int = 1,
        base_model_name_or_path: str | None = None,
        *,
        head_projection: str = OWN,
        token_map: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if num_heads < 1 or num_layers < 0 or hidden_size < 1 or vocab_size < 1:
            raise HeadsFormatError(
                f"invalid heads shape: num_heads={num_heads} num_layers={num_layers} "
                f"hidden_size={hidden_size} vocab_size={vocab_size}"
            )
        if head_projection not in PROJECTIONS:
            raise HeadsFormatError(f"head_projection={head_projection!r}: expected one of {PROJECTIONS}")
        if head_projection == SHARED and num_layers == 0:
            raise HeadsFormatError(
                "shared heads need num_layers >= 1: with none they would all be the lm_head"
            )
        if (token_map is not None) != (head_projection == TRUNCATED):
            raise HeadsFormatError("a token_map goes with head_projection='truncated' and only with it")
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.num_heads = num_heads
        self.num_layers = num_layers
        self.base_model_name_or_path = base_model_name_or_path
        self.head_projection = head_projection
        self.draft_vocab_size = vocab_size
        if token_map is not None:
            token_map = check_token_map(token_map, vocab_size)
            self.draft_vocab_size = int(token_map.numel())
        self.heads = nn.ModuleList(
            [
                nn.Sequential(
                    *[ResBlock(hidden_size) for _ in range(num_layers)],
                    *(
                        []
                        if head_projection == SHARED
                        else [nn.Linear(hidden_size, self.draft_vocab_size, bias=False)]
                    ),
                )
                for _ in range(num_heads)
            ]
        )
        # token_map: saved with the heads; draft_index: its inverse, full id -> draft index or IGNORE_INDEX.
        # Both on the parameters' device: heads built under `with torch.device("cuda")` are whole there
        # (check_token_map returns a CPU tensor, which index_copy_ on CUDA logits refuses).
        draft_index = None
        if token_map is not None:
            device = next(self.parameters()).device  # truncated heads always own a projection
            token_map = token_map.to(device)
            draft_index = torch.full((vocab_size,), IGNORE_INDEX, dtype=torch.long, device=device)
            draft_index[token_map] = torch.arange(self.draft_vocab_size, device=device)
        self.register_buffer(TOKEN_MAP, token_map)
        self.register_buffer("draft_index", draft_index, persistent=False)
        self._lm_head = _Unregistered()

    # -- structure -----------------------------------------------------------------------------
    def blocks(self, k: int) -> nn.Sequential:
        """The residual blocks of head k (0-based), without its vocab projection."""
        return self.heads[k][: self.num_layers]

    def proj(self, k: int) -> nn.Linear:
        """The ``d -> V_draft`` projection of head k (0-based); shared heads have none of their own."""
        if self.head_projection == SHARED:
            raise HeadsFormatError("shared heads have no projection of their own (see head_weight)")
        return self.heads[k][self.num_layers]

    @property
    def is_bound(self) -> bool:
        """False for shared heads whose lm_head weight is not bound yet (always True otherwise)."""
        return self.head_projection != SHARED or self._lm_head.tensor is not None

    def head_weight(self, k: int) -> torch.Tensor:
        """Head k's ``(V_draft, d)`` projection weight: its own, or (shared) the bound lm_head's, detached."""
        if self.head_projection != SHARED:
            return self.proj(k).weight
        bound = self._lm_head.tensor
        if bound is None:
            raise HeadsFormatError(
                "shared heads use the backbone's lm_head, which is not bound: call attach(backbone) first"
            )
        return (bound.weight if isinstance(bound, nn.Module) else bound).detach()

    @property
    def dtype(self) -> torch.dtype:
        """dtype of the heads' own weights (blocks, projections), else of the bound lm_head."""
        first = next(self.parameters(), None)
        return first.dtype if first is not None else self.head_weight(0).dtype

    @property
    def device(self) -> torch.device:
        """Device of the heads' own weights, else of the bound lm_head."""
        first = next(self.parameters(), None)
        return first.device if first is not None else self.head_weight(0).device

    def bind_lm_head(self, lm_head: torch.Tensor | nn.Module) -> None:
        """Shared heads: use ``lm_head`` (a ``(V, d)`` weight, or the backbone's output-embedding module,
        whose ``.weight`` is then read at every use, so it follows the backbone through training, dtype
        casts and in-place updates) as every head's projection. Never copied; no gradient reaches it
        through the heads."""
        if self.head_projection != SHARED:
            raise HeadsFormatError(f"only shared heads bind an lm_head, these are {self.head_projection!r}")
        weight = lm_head.weight if isinstance(lm_head, nn.Module) else lm_head
        if tuple(weight.shape) != (self.vocab_size, self.hidden_size):
            raise HeadsFormatError(
                f"lm_head weight has shape {tuple(weight.shape)}, heads expect ({self.vocab_size}, {self.hidden_size})"
            )
        self._lm_head.tensor = lm_head if isinstance(lm_head, nn.Module) else lm_head.detach()

    def attach(self, backbone: nn.Module) -> MedusaHeads:
        """Check the heads fit ``backbone`` and bind its lm_head to shared heads.

        The hidden size is that of what the heads read, the backbone's last hidden state
        (:func:`~medusa_train.head_targets.hidden_width`), which is not the width of the vectors its
        lm_head reads where a prediction head of another width sits between the two (ELECTRA, RemBERT):
        shared heads, which project with that lm_head, need both.

        Raises:
            HeadsFormatError: other hidden/vocab sizes, a token map with ids outside the backbone's
                vocabulary, or shared heads over a backbone without an output embedding (lm_head) or
                whose lm_head reads vectors of another width than its last hidden state.
        """
        out = backbone.get_output_embeddings()
        if out is None or getattr(out, "weight", None) is None:
            if self.head_projection == SHARED:
                raise HeadsFormatError(
                    f"shared heads reuse the backbone's lm_head, but {type(backbone).__name__} has no output "
                    "embedding (get_output_embeddings() is None): use head_projection own or truncated"
                )
            return self
        vocab, hidden = out.weight.shape[0], hidden_width(backbone)
        if self.token_map is not None and int(self.token_map.max()) >= vocab:
            raise HeadsFormatError(
                f"the heads' token_map holds ids up to {int(self.token_map.max())}, but the backbone's vocabulary "
                f"has {vocab} tokens: these heads belong to another tokenizer"
            )
        if (self.hidden_size, self.vocab_size) != (hidden, vocab):
            raise HeadsFormatError(
                f"heads are for hidden_size={self.hidden_size}, vocab_size={self.vocab_size} but the backbone "
                f"has hidden_size={hidden}, vocab_size={vocab}"
            )
        if self.head_projection == SHARED:
            if out.weight.shape[1] != hidden:
                raise HeadsFormatError(
                    f"shared heads project with the backbone's lm_head, but {type(backbone).__name__}'s "
                    f"reads {out.weight.shape[1]}-wide vectors (a prediction head's output), not its "
                    f"{hidden}-wide last hidden state, which the heads read: use head_projection own or "
                    "truncated"
                )
            self.bind_lm_head(out)
        return self

    def init_from_lm_head(self, lm_head_weight: torch.Tensor) -> None:
        """Copy the backbone's lm_head ``(V, d)`` into every head's projection (truncated: its rows
        ``token_map``); shared heads bind it instead (:meth:`bind_lm_head`)."""
        if self.head_projection == SHARED:
            self.bind_lm_head(lm_head_weight)
            return
        if tuple(lm_head_weight.shape) != (self.vocab_size, self.hidden_size):
            raise HeadsFormatError(
                f"lm_head weight has shape {tuple(lm_head_weight.shape)}, heads expect "
                f"({self.vocab_size}, {self.hidden_size})"
            )
        with torch.no_grad():
            rows = (
                lm_head_weight
                if self.token_map is None
                else lm_head_weight[self.token_map.to(lm_head_weight.device)]
            )
            for k in range(self.num_heads):
                self.proj(k).weight.copy_(rows.to(self.proj(k).weight))

    # -- vocabularies --------------------------------------------------------------------------
    def draft_targets(self, targets: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary targets as draft-vocabulary indices: truncated heads map ids outside the
        token map (and ``IGNORE_INDEX``) to ``IGNORE_INDEX``; other heads return ``targets``."""
        if self.draft_index is None:
            return targets
        index = self.draft_index.to(targets.device)
        return torch.where(targets == IGNORE_INDEX, IGNORE_INDEX, index[targets.clamp_min(0)])

    def full_vocab_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits ``(..., V_draft)`` as full-vocabulary logits ``(..., V)``: truncated heads put
        ``-inf`` on tokens outside the map (as vLLM's Medusa does); other heads return ``logits``."""
        if self.token_map is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.token_map.to(logits.device), logits)

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
        """All own vocab projections stacked: ``(K, V_draft, d)`` (not for shared heads)."""
        return torch.stack([self.proj(k).weight for k in range(self.num_heads)], dim=0)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits of every head over the draft vocabulary.

        Args:
            hidden_states: ``(B, T, d)`` (any leading shape works).

        Returns:
            ``(K, B, T, V_draft)`` (see :meth:`full_vocab_logits` for full-vocabulary ids).
        """
        feats = self.hidden(hidden_states)  # (K, B, T, d)
        if self.head_projection == SHARED:
            weight = self.head_weight(0)  # (V, d), one matrix for every head
            return F.linear(feats.to(weight.dtype), weight)  # (K, B, T, V)
        weight = self.projection_weight()  # (K, V_draft, d)
        k, *lead, d = feats.shape
        # One batched matmul for all heads instead of K separate projections.
        logits = torch.bmm(feats.reshape(k, -1, d), weight.transpose(1, 2))  # (K, B*T, V_draft)
        return logits.reshape(k, *lead, self.draft_vocab_size)

    def fingerprint(self) -> str:
        """``sha256:<16 hex>`` of the heads' tensors (names, dtypes, shapes, bytes; truncated heads' token
        map included, which decides the tokens they draft): the heads' identity.

        Stage=eval records it with its figures and stage=export with its copy, so a model card states
        a tau only for the heads it was measured on. A cast (``export.dtype``) gives other bytes, so
        another fingerprint.
        """
        h = hashlib.sha256()
        for name, t in sorted(self.state_tensors().items()):
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return f"sha256:{h.hexdigest()[:16]}"

    # -- persistence ---------------------------------------------------------------------------
    def config_dict(self) -> dict:
        """The FasterDecoding-style config.json content (plus the projection variant)."""
        config = {
            "medusa_num_heads": self.num_heads,
            "medusa_num_layers": self.num_layers,
            "base_model_name_or_path": self.base_model_name_or_path,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "head_projection": self.head_projection,
        }
        if self.head_projection == SHARED:
            config["version"] = "2"  # FasterDecoding's marker of heads that use the base model's lm_head
        if self.head_projection == TRUNCATED:
            config["draft_vocab_size"] = self.draft_vocab_size
        return config

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """What the weights file holds: ``self.heads.state_dict()`` (+ ``token_map``), CPU, contiguous."""
        state = dict(self.heads.state_dict())
        if self.token_map is not None:
            state[TOKEN_MAP] = self.token_map
        return {name: t.detach().to("cpu").contiguous() for name, t in state.items()}

    def save_pretrained(self, directory: str | os.PathLike, extra_config: dict | None = None) -> Path:
        """Write ``config.json`` + ``medusa_lm_head.safetensors`` atomically.

        Both files are written under temporary names in the target directory and renamed into
        place, so a killed process never leaves a half-written file under the final name. The
        layout keys of :meth:`config_dict` win over ``extra_config``'s.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = self.state_tensors()
        config = self.config_dict()
        config.update({k: v for k, v in (extra_config or {}).items() if k not in config})
        atomic_write(directory / HEADS_WEIGHTS, lambda p: save_file(state, str(p), metadata={"format": "pt"}))
        atomic_write_json(directory / HEADS_CONFIG, config)
        return directory

    @classmethod
    def from_state(
        cls, config: dict, state: dict[str, torch.Tensor], where: str | os.PathLike
    ) -> MedusaHeads:
        """Heads from a FasterDecoding-layout config and weights (names as :meth:`state_tensors`).

        The variant is ``config["head_projection"]``; a file without it is ``own``, or ``shared`` when it
        has no ``{h}.{L}.weight`` and says ``"version": "2"`` (FasterDecoding's medusa2 heads). Hidden and
        vocab sizes are read off the weights where the config lacks them. Keeps the stored dtype.

        Raises:
            HeadsFormatError: missing keys, unexpected or misshaped tensors, a bad token map.
        """
        try:
            num_heads = int(config["medusa_num_heads"])
            num_layers = int(config["medusa_num_layers"])
        except KeyError as err:
            raise HeadsFormatError(f"{where}: config lacks {err.args[0]}") from None
        except (TypeError, ValueError):
            raise HeadsFormatError(
                f"{where}: config has a non-integer medusa_num_heads/medusa_num_layers"
            ) from None
        proj_key, block_key = f"0.{num_layers}.weight", "0.0.linear.weight"
        kind = config.get("head_projection")
        if kind is None:
            kind = SHARED if proj_key not in state and str(config.get("version")) == "2" else OWN
        if kind not in PROJECTIONS:
            raise HeadsFormatError(f"{where}: head_projection={kind!r}, expected one of {PROJECTIONS}")
        ref = state.get(block_key if kind == SHARED else proj_key)
        if ref is None:
            raise HeadsFormatError(f"{where}: weights lack '{block_key if kind == SHARED else proj_key}'")
        vocab_size = config.get("vocab_size")
        if vocab_size is None and kind == SHARED:
            raise HeadsFormatError(f"{where}: shared heads need vocab_size in their config")
        try:
            hidden_size = int(config.get("hidden_size", ref.shape[-1]))
            vocab_size = int(vocab_size if vocab_size is not None else ref.shape[0])
        except (TypeError, ValueError):
            raise HeadsFormatError(f"{where}: config has a non-integer hidden_size/vocab_size") from None
        token_map = state.get(TOKEN_MAP)
        if kind == TRUNCATED and token_map is None:
            raise HeadsFormatError(f"{where}: truncated heads without a '{TOKEN_MAP}' tensor")
        try:
            heads = cls(
                hidden_size=hidden_size,
                vocab_size=vocab_size,
                num_heads=num_heads,
                num_layers=num_layers,
                base_model_name_or_path=config.get("base_model_name_or_path"),
                head_projection=kind,
                token_map=token_map if kind == TRUNCATED else None,
            )
        except HeadsFormatError as err:
            raise HeadsFormatError(f"{where}: {err}") from None
        heads.load_checked({k: v for k, v in state.items() if k != TOKEN_MAP}, where)
        return heads

    def load_checked(self, state: dict[str, torch.Tensor], where: str | os.PathLike) -> None:
        """Copy ``state`` (names as :meth:`state_tensors`, no token map) into the heads, which take its dtype.

        Args:
            state: every weight of the heads, none more.
            where: the folder or file the weights came from (named in the error).

        Raises:
            HeadsFormatError: a weight missing or unexpected, or a shape other than the config implies.
        """
        expected = self.heads.state_dict()
        missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        if missing or unexpected:
            raise HeadsFormatError(
                f"{where}: weights do not match the config: missing {missing[:4]}, unexpected {unexpected[:4]}"
            )
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(expected[name].shape):
                raise HeadsFormatError(
                    f"{where}: '{name}' has shape {tuple(tensor.shape)}, config implies {tuple(expected[name].shape)}"
                )
        self.to(next(iter(state.values())).dtype)
        self.heads.load_state_dict(state, strict=True)

    @classmethod
    def from_pretrained(
        cls,
        directory: str | os.PathLike,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
    ) -> MedusaHeads:
        """Load heads saved by :meth:`save_pretrained` (or by FasterDecoding's Medusa). Shared heads
        come back unbound (:meth:`attach` them to their backbone)."""
        config, weights_path = check_heads_directory(directory)
        try:
            state = load_file(str(weights_path))
        except SafetensorError as err:
            raise HeadsFormatError(f"cannot read {weights_path}: {err}") from None
        heads = cls.from_state(config, state, directory)
        return heads.to(device=device, dtype=dtype) if dtype is not None else heads.to(device)
