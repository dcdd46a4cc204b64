"""Load a Hugging Face causal LM + tokenizer the same way for every backbone.

The embedded tiny model (``model=tiny``) is just a local directory written by ``stage=backbone``;
a real user passes a hub id or a directory. Both go through :func:`load_backbone`, so nothing
downstream special-cases the embedded default.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from medusa_train.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(spec: str = "auto") -> torch.device:
    """``auto`` -> this process's CUDA device (LOCAL_RANK) if CUDA is available, else CPU."""
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    return torch.device(spec)


def check_backbone_source(name_or_path: str) -> None:
    """Fail early (before any heavy import) when a local backbone directory is missing."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise UserError(f"{path} is not a Hugging Face model directory (no config.json)")
        return
    # "runs/x/backbone" style paths with several components are local paths, not hub ids.
    if (
        name_or_path.count("/") > 1
        or name_or_path.startswith((".", "/", "~"))
        or name_or_path.endswith("/backbone")
    ):
        raise UserError(
            f"no backbone at {name_or_path}: run `python -m medusa_train stage=backbone` first (model=tiny), "
            "or pass model=hf model.name_or_path=<hub id or directory>"
        )


def load_tokenizer(name_or_path: str, *, trust_remote_code: bool = False, revision: str | None = None):
    """The backbone's tokenizer, with a pad token (eos if it has none) and left padding for batched generation."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, revision=revision)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_backbone(
    name_or_path: str,
    *,
    dtype: str = "float32",
    quantization: str = "none",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    revision: str | None = None,
    trainable: bool = False,
):
    """Load ``(model, tokenizer)``.

    Args:
        name_or_path: hub id or local directory.
        dtype: float32 | bfloat16 | float16 | auto.
        quantization: none | 8bit | 4bit (bitsandbytes; nf4 with double quantization for 4bit).
        device: where to put the model (quantized models are placed by bitsandbytes).
        trainable: False puts the model in eval mode with ``requires_grad=False`` everywhere.
    """
    from transformers import AutoModelForCausalLM

    check_backbone_source(name_or_path)
    kwargs: dict = {"trust_remote_code": trust_remote_code, "revision": revision}
    torch_dtype = "auto" if dtype == "auto" else DTYPES[dtype]
    kwargs["dtype"] = torch_dtype
    if quantization != "none":
        from transformers import BitsAndBytesConfig

        if quantization == "8bit":
            kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
        else:
            compute = torch.float32 if dtype in ("float32", "auto") else DTYPES[dtype]
            kwargs["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=compute,
            )
        kwargs["device_map"] = {"": str(device)}
    try:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
        tokenizer = load_tokenizer(name_or_path, trust_remote_code=trust_remote_code, revision=revision)
    except OSError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"could not load backbone {name_or_path!r}: {first}") from None
    if quantization == "none":
        model.to(device)
    if not trainable:
        model.eval()
        model.requires_grad_(False)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


ADAPTER_CONFIG = "adapter_config.json"
"""A peft adapter directory (Medusa-2 with LoRA/QLoRA saves only the adapter) holds this file."""


def is_adapter_dir(path: str | os.PathLike) -> bool:
    """True for a peft adapter directory (no model of its own: it needs its base model)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def merge_adapter(base, adapter_dir: str | os.PathLike):
    """Apply the peft (LoRA) adapter in ``adapter_dir`` to ``base`` and merge it into the weights.

    Returns:
        ``base`` with every adapted weight replaced by ``W + scale * B @ A`` (peft's
        ``merge_and_unload``), in eval mode without gradients: a plain model again.
    """
    try:
        from peft import PeftModel
    except ImportError:
        raise UserError(f"{adapter_dir} is a LoRA adapter; merging it needs peft: pip install peft") from None
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.eval()
    merged.requires_grad_(False)
    return merged


def backbone_identity(model, name_or_path: str, revision: str | None = None) -> dict:
    """Name, architecture and a fingerprint of the weights: distill/train/export refuse to mix backbones.

    The fingerprint describes the checkpoint *files* (config.json and every weight file: name, size,
    first and last MiB), so the same checkpoint gives the same identity whatever dtype or
    quantization it was loaded with -- distilling in bf16 and training heads over an 8-bit copy
    is legitimate. A model with no files (built in memory) falls back to hashing its tensors.
    """
    source = _checkpoint_dir(name_or_path, revision)
    fingerprint = _files_fingerprint(source) if source is not None else None
    if fingerprint is None:
        fingerprint = _tensors_fingerprint(model)
    return {
        "name_or_path": str(name_or_path),
        "architecture": (model.config.architectures or [type(model).__name__])[0],
        "hidden_size": int(model.config.hidden_size),
        "vocab_size": int(model.get_output_embeddings().weight.shape[0]),
        "fingerprint": fingerprint,
    }


def checkpoint_fingerprint(name_or_path: str, revision: str | None = None) -> str | None:
    """The files part of :func:`backbone_identity` without loading the model; None if no local files."""
    source = _checkpoint_dir(name_or_path, revision)
    return _files_fingerprint(source) if source is not None else None


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def _checkpoint_dir(name_or_path: str, revision: str | None) -> Path | None:
    """The local directory holding the checkpoint: the path itself, or the hub cache snapshot."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    try:
        from transformers.utils import cached_file

        config = cached_file(
            name_or_path, "config.json", revision=revision, _raise_exceptions_for_missing_entries=False
        )
    except Exception:  # offline, gated, or not a hub id: fall back to the tensors
        return None
    return Path(config).parent if config else None


def _files_fingerprint(directory: Path) -> str | None:
    weights = sorted(p for p in directory.iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)
    if not weights:
        return None
    h = hashlib.sha256()
    mib = 1 << 20
    for path in [directory / "config.json", *weights]:
        if not path.is_file():
            continue
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as fh:
            h.update(fh.read(mib))  # safetensors: the header (every tensor's name/shape/offset) + data
            if size > 2 * mib:
                fh.seek(size - mib)
                h.update(fh.read(mib))
    return h.hexdigest()[:16]


def _tensors_fingerprint(model) -> str:
    h = hashlib.sha256()
    config = {
        k: v
        for k, v in model.config.to_diff_dict().items()
        if k not in ("dtype", "torch_dtype", "quantization_config")
    }
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(tensor.shape)}".encode())
        t = tensor.detach().reshape(-1)[:4096]
        # First 4096 values of every tensor, rounded to bfloat16 so the dtype the model was loaded
        # in does not matter (fp32/fp16 -> bf16 rounding equals loading in bf16).
        if t.is_floating_point():
            t = t.to(torch.bfloat16)
        h.update(t.float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]
