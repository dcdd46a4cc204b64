"""Medusa heads in the layouts serving engines load, and :func:`load_heads` for either layout.

Two layouts (the names below are the ones the engines' loaders read; a wrong name loads nothing,
because vLLM skips unknown weight names without a word, so the tests pin them):

``medusa`` -- FasterDecoding Medusa, Hugging Face TGI and TensorRT-LLM's Medusa converter::

    config.json                  {medusa_num_heads, medusa_num_layers, base_model_name_or_path,
                                  hidden_size, vocab_size, ...}
    medusa_lm_head.safetensors   {h}.{l}.linear.weight (d, d)   {h}.{l}.linear.bias (d,)   l < L
                                 {h}.{L}.weight (V, d)           (head h's vocab projection)

``vllm`` -- vLLM's ``MedusaModel`` (speculative_config={"method": "medusa", "model": <dir>})::

    config.json                  {model_type: "medusa", architectures: ["MedusaModel"], hidden_size,
                                  vocab_size, num_heads, num_hidden_layers, truncated_vocab_size,
                                  medusa_fc_bias: true}
    model.safetensors            blocks.{h}.layers.{l}.weight (d, d)   blocks.{h}.layers.{l}.bias (d,)
                                 lm_heads.{h}.weight (V, d)

vLLM's ``MedusaConfig.from_pretrained`` renames every config key containing "num" and "heads" to
``num_heads`` (and "num" + "layers" to ``num_hidden_layers``), so the vLLM config carries no other
key with "num" in it. Both layouts hold exactly the same tensors; only names differ.

Torch + safetensors only (no Hydra): the decoder and the GPU image use this module.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from medusa_train.heads import HeadsFormatError, MedusaHeads
from medusa_train.workdir import HEADS_CONFIG, HEADS_WEIGHTS, atomic_write, atomic_write_json

MEDUSA = "medusa"
VLLM = "vllm"
LAYOUTS = (MEDUSA, VLLM)
VLLM_WEIGHTS_NAME = "model.safetensors"
LEGACY_WEIGHTS_NAME = "medusa_lm_head.pt"
"""FasterDecoding's published checkpoints (e.g. FasterDecoding/medusa-vicuna-7b-v1.3) ship a torch pickle."""
MEDUSA_CONFIG_KEYS = (
    "medusa_num_heads",
    "medusa_num_layers",
    "base_model_name_or_path",
    "hidden_size",
    "vocab_size",
)


# -- medusa (FasterDecoding / TGI / TensorRT-LLM) --------------------------------------------------
def save_medusa(heads: MedusaHeads, directory: str | os.PathLike, extra_config: dict | None = None) -> Path:
    """Write the FasterDecoding layout (``config.json`` + ``medusa_lm_head.safetensors``).

    Args:
        heads: the heads to write (any dtype; tensors are written as they are).
        directory: created if missing.
        extra_config: more config.json keys (training settings, backbone identity); the five layout
            keys always come from ``heads``.
    """
    extra = {k: v for k, v in (extra_config or {}).items() if k not in MEDUSA_CONFIG_KEYS}
    return heads.save_pretrained(directory, extra_config=extra)


def load_medusa(directory: str | os.PathLike) -> MedusaHeads:
    """Read the FasterDecoding layout, keeping the stored dtype.

    Also reads FasterDecoding's published ``medusa_lm_head.pt`` (a state dict with the same names).
    Hidden and vocab sizes come from the weights (not every FasterDecoding config has them).

    Raises:
        HeadsFormatError: missing files or keys, unexpected keys, shapes that contradict the config.
    """
    directory = Path(directory)
    config = _read_config(directory)
    if (directory / HEADS_WEIGHTS).is_file():
        state = _load_safetensors(directory / HEADS_WEIGHTS)
    elif (directory / LEGACY_WEIGHTS_NAME).is_file():
        state = dict(torch.load(directory / LEGACY_WEIGHTS_NAME, map_location="cpu", weights_only=True))
    else:
        raise HeadsFormatError(f"{directory} has no {HEADS_WEIGHTS}")
    try:
        num_heads, num_layers = int(config["medusa_num_heads"]), int(config["medusa_num_layers"])
    except KeyError as err:
        raise HeadsFormatError(f"{directory / HEADS_CONFIG} lacks {err.args[0]}") from None
    proj = _require(state.get(f"0.{num_layers}.weight"), f"0.{num_layers}.weight", directory)
    vocab_size, hidden_size = (int(n) for n in proj.shape)
    heads = MedusaHeads(hidden_size, vocab_size, num_heads, num_layers, config.get("base_model_name_or_path"))
    _load_state(heads, state, directory)
    return heads


# -- vLLM -----------------------------------------------------------------------------------------
def vllm_config(heads: MedusaHeads) -> dict:
    """The config.json vLLM's ``MedusaConfig`` reads (no truncated vocabulary, biased block linears)."""
    return {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": heads.hidden_size,
        "vocab_size": heads.vocab_size,
        "num_heads": heads.num_heads,
        "num_hidden_layers": heads.num_layers,
        "truncated_vocab_size": heads.vocab_size,
        "medusa_fc_bias": True,
    }


def vllm_state_dict(heads: MedusaHeads) -> dict[str, torch.Tensor]:
    """Our tensors under vLLM ``MedusaModel`` parameter names (CPU, contiguous)."""
    state: dict[str, torch.Tensor] = {}
    for h in range(heads.num_heads):
        for layer in range(heads.num_layers):
            linear = heads.blocks(h)[layer].linear
            state[f"blocks.{h}.layers.{layer}.weight"] = linear.weight  # (d, d)
            state[f"blocks.{h}.layers.{layer}.bias"] = linear.bias  # (d,)
        state[f"lm_heads.{h}.weight"] = heads.proj(h).weight  # (V, d)
    return {name: t.detach().to("cpu").contiguous() for name, t in state.items()}


def save_vllm(heads: MedusaHeads, directory: str | os.PathLike) -> Path:
    """Write the vLLM ``MedusaModel`` layout (``config.json`` + ``model.safetensors``)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = vllm_state_dict(heads)
    atomic_write(directory / VLLM_WEIGHTS_NAME, lambda p: save_file(state, str(p), metadata={"format": "pt"}))
    atomic_write_json(directory / HEADS_CONFIG, vllm_config(heads))
    return directory


def load_vllm(directory: str | os.PathLike) -> MedusaHeads:
    """Read a vLLM ``MedusaModel`` directory back into :class:`MedusaHeads`.

    Reads every ``*.safetensors`` file of the directory (as vLLM does), drops a ``medusa_heads.``
    prefix (as vLLM's loader does), fills missing block biases with zeros when ``medusa_fc_bias`` is
    false and shares ``lm_heads.0`` when ``original_lm_head`` is true.

    Raises:
        HeadsFormatError: missing files or keys, unexpected keys, a truncated vocabulary.
    """
    directory = Path(directory)
    config = _read_config(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise HeadsFormatError(f"{directory} has a vLLM Medusa config.json but no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update({k.removeprefix("medusa_heads."): v for k, v in _load_safetensors(f).items()})
    try:
        num_heads, num_layers = int(config["num_heads"]), int(config["num_hidden_layers"])
        hidden_size, vocab_size = int(config["hidden_size"]), int(config["vocab_size"])
    except KeyError as err:
        raise HeadsFormatError(f"{directory / HEADS_CONFIG} lacks {err.args[0]}") from None
    truncated = config.get("truncated_vocab_size") or vocab_size
    if int(truncated) != vocab_size or "token_map" in state:
        raise HeadsFormatError(
            f"{directory}: heads with a truncated vocabulary (token_map) are not supported"
        )
    heads = MedusaHeads(hidden_size, vocab_size, num_heads, num_layers, config.get("base_model_name_or_path"))
    if config.get("original_lm_head", False) and "lm_heads.0.weight" in state:
        for h in range(1, num_heads):
            state.setdefault(f"lm_heads.{h}.weight", state["lm_heads.0.weight"])
    ours: dict[str, torch.Tensor] = {}
    for h in range(num_heads):
        for layer in range(num_layers):
            prefix = f"blocks.{h}.layers.{layer}"
            bias = state.pop(f"{prefix}.bias", None)
            if bias is None and not config.get("medusa_fc_bias", False):
                bias = torch.zeros(hidden_size, dtype=state.get(f"{prefix}.weight", torch.empty(0)).dtype)
            ours[f"{h}.{layer}.linear.weight"] = _pop(state, f"{prefix}.weight", directory)
            ours[f"{h}.{layer}.linear.bias"] = _require(bias, f"{prefix}.bias", directory)
        ours[f"{h}.{num_layers}.weight"] = _pop(state, f"lm_heads.{h}.weight", directory)
    if state:
        raise HeadsFormatError(
            f"{directory}: unexpected weights {sorted(state)[:4]} for {num_heads} heads x {num_layers} layers"
        )
    _load_state(heads, ours, directory)
    return heads


# -- either layout --------------------------------------------------------------------------------
def detect_layout(path: str | os.PathLike) -> str:
    """``"medusa"`` or ``"vllm"`` for a heads directory.

    Raises:
        HeadsFormatError: ``path`` is not a directory of either layout (the message says what is there).
    """
    path = Path(path)
    if not path.is_dir():
        raise HeadsFormatError(f"{path} is not a directory of Medusa heads")
    config_path = path / HEADS_CONFIG
    if not config_path.is_file():
        raise HeadsFormatError(
            f"{path} has no {HEADS_CONFIG}: not a Medusa heads directory (FasterDecoding or vLLM layout)"
        )
    config = _read_config(path)
    if "medusa_num_heads" in config:
        if not any((path / name).is_file() for name in (HEADS_WEIGHTS, LEGACY_WEIGHTS_NAME)):
            raise HeadsFormatError(f"{path} has a Medusa config.json but no {HEADS_WEIGHTS}")
        return MEDUSA
    if config.get("model_type") == "medusa" or "MedusaModel" in (config.get("architectures") or []):
        return VLLM
    raise HeadsFormatError(
        f"{config_path} is neither a FasterDecoding Medusa config (medusa_num_heads) nor a vLLM one "
        "(model_type: medusa); is this the backbone's directory?"
    )


def load_heads(
    path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> MedusaHeads:
    """Load heads from a directory of either layout (or an export folder holding ``medusa/``).

    Args:
        path: a ``medusa`` or ``vllm`` layout directory, or ``workdir/export`` itself.
        device: where to put the heads.
        dtype: cast to this dtype; None keeps the stored one.

    Raises:
        HeadsFormatError: not a heads directory, or weights that do not match the config.
    """
    path = Path(path)
    if path.is_dir() and not (path / HEADS_CONFIG).exists() and (path / MEDUSA / HEADS_CONFIG).is_file():
        path = path / MEDUSA
    heads = load_vllm(path) if detect_layout(path) == VLLM else load_medusa(path)
    heads.eval()
    return heads.to(device=device, dtype=dtype) if dtype is not None else heads.to(device)


def read_heads_config(path: str | os.PathLike) -> dict:
    """The raw config.json of a heads directory (extra keys such as training settings included)."""
    return _read_config(Path(path))


# -- helpers --------------------------------------------------------------------------------------
def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; a damaged file is a :class:`HeadsFormatError`."""
    try:
        return load_file(str(path))
    except SafetensorError as err:
        raise HeadsFormatError(f"cannot read {path}: {err}") from None


def _read_config(directory: Path) -> dict:
    try:
        config = json.loads((directory / HEADS_CONFIG).read_text())
    except FileNotFoundError:
        raise HeadsFormatError(f"{directory} has no {HEADS_CONFIG}") from None
    except json.JSONDecodeError as err:
        raise HeadsFormatError(f"{directory / HEADS_CONFIG} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise HeadsFormatError(f"{directory / HEADS_CONFIG} is not a JSON object")
    return config


def _pop(state: dict[str, torch.Tensor], key: str, directory: Path) -> torch.Tensor:
    return _require(state.pop(key, None), key, directory)


def _require(tensor: torch.Tensor | None, key: str, directory: Path) -> torch.Tensor:
    if tensor is None:
        raise HeadsFormatError(f"{directory}: weights lack '{key}'")
    return tensor


def _load_state(heads: MedusaHeads, state: dict[str, torch.Tensor], directory: Path) -> None:
    """Copy ``state`` (our names) into ``heads``, checking every shape."""
    expected = heads.heads.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise HeadsFormatError(
            f"{directory}: weights do not match the config: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise HeadsFormatError(
                f"{directory}: '{name}' has shape {tuple(tensor.shape)}, config implies {tuple(expected[name].shape)}"
            )
    dtype = next(iter(state.values())).dtype
    heads.to(dtype)
    heads.heads.load_state_dict(state, strict=True)
