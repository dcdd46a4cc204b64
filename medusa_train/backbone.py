"""Load a Hugging Face causal LM + tokenizer the same way for every backbone, and pick the one that
goes with a set of heads.

The embedded tiny model (``model=tiny``) is just a local directory written by ``stage=pretrain``;
a real user passes a hub id or a directory. Both go through :func:`load_backbone`, so nothing
downstream special-cases the embedded default. :func:`load_configured_backbone` turns ``cfg.model``
(a :class:`medusa_train.config.ModelConfig`, read as a plain object) into that call.

Which backbone goes with a set of heads (:func:`backbone_for_heads`, used by export and eval):
Medusa-2 (``training=medusa2``, Cai et al., arXiv:2401.10774, section 2.2.2) trains the backbone
too and ships it next to the heads as ``backbone/`` (the full model, or a LoRA adapter):

1. the heads come with such a ``backbone/`` (``workdir/heads/backbone``, or ``backbone/`` of the
   export a ``medusa/``/``vllm/`` folder belongs to) and ``model.name_or_path`` is the base the run
   started from (the same name or directory, or the same checkpoint files by fingerprint, so a
   moved or copied base still counts; or the record is missing): that trained backbone is used;
   a LoRA adapter is merged into ``model.name_or_path`` (loaded with ``model.dtype``/``model.quantization``),
   only where its files are the base's when both have a fingerprint (the same name at another
   revision, or a directory holding another model now, is another checkpoint);
2. otherwise (Medusa-1 heads, or ``model.name_or_path`` names another checkpoint): ``model.name_or_path``
   as given.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import pickle
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from huggingface_hub import constants as hub_constants
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
from transformers.dynamic_module_utils import get_relative_imports
from transformers.utils import (
    CONFIG_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    cached_file,
)

from medusa_train.backbone_source import ADAPTER_CONFIG, check_backbone_source, is_adapter_dir
from medusa_train.errors import DamagedArtefactError, HeadsFormatError, UserError
from medusa_train.heads_layout import LAYOUTS, read_heads_config
from medusa_train.launch import local_rank, world_size
from medusa_train.safetensors_check import safetensors_shapes
from medusa_train.workdir import (
    HEADS,
    PRETRAIN,
    TRAINED_BACKBONE,
    read_json,
)

if TYPE_CHECKING:  # annotations only: config imports Hydra, which this module must not need
    from medusa_train.config import ModelConfig

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(spec: str = "auto") -> torch.device:
    """The device ``model.device`` names, checked against this machine.

    ``auto`` -> this process's CUDA device (LOCAL_RANK) if CUDA is available, else CPU. Under a
    launcher with several ranks ``cuda`` is this rank's GPU (``cuda:LOCAL_RANK``) too, and another index
    is refused (every rank would load onto that one GPU).

    Raises:
        UserError: an unknown device, or one this machine does not have (CUDA without a GPU or a
            CUDA build of torch, a GPU index beyond the visible GPUs, MPS off a Mac), or another
            rank's GPU under a launcher.
    """
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank())
        return torch.device("cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        raise UserError(f"model.device={spec!r} is not one of auto, cpu, cuda, cuda:N, mps") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch has no CUDA support" if torch.version.cuda is None else "no GPU is visible"
            raise UserError(f"model.device={spec} but {why}: use model.device=cpu (or auto)")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise UserError(
                f"model.device={spec} but this machine has {count} GPU(s) (cuda:0 .. cuda:{count - 1}): "
                "pick one of those, or model.device=cuda"
            )
        # Under a launcher each rank takes its own GPU: "cuda" means this rank's; a fixed index
        # would put every rank on one GPU.
        local = local_rank()
        if world_size() > 1:
            if device.index is not None and device.index != local:
                raise UserError(
                    f"model.device={spec} under a launcher would put every rank on one GPU: use "
                    f"model.device=cuda (or auto), each rank then takes cuda:LOCAL_RANK (here cuda:{local})"
                )
            device = torch.device("cuda", local)
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"model.device={spec} but MPS is not available here: use model.device=cpu (or auto)")
    elif device.type not in ("cpu", "mps"):
        raise UserError(f"model.device={spec!r} is not one of auto, cpu, cuda, cuda:N, mps")
    return device


def resolve_dtype(spec: str, device: str | torch.device) -> str:
    """``model.dtype`` as loaded on ``device``: ``auto`` is bfloat16 on a CUDA GPU that computes it
    natively (compute capability 8, Ampere, or later) and float32 elsewhere (a CPU, or an older GPU,
    computes bfloat16 slowly, emulated); other values as given."""
    if spec != "auto":
        return spec
    device = torch.device(device)
    if device.type != "cuda":
        return "float32"
    # Ampere (compute capability 8) and later compute bf16 natively; torch reports older GPUs as
    # bf16-capable too (emulated: slow), so the capability decides.
    return "bfloat16" if torch.cuda.get_device_capability(device)[0] >= 8 else "float32"


def frozen(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` as a fixed function, in place: eval mode (no dropout) and no parameter requiring a
    gradient. The one place a model is frozen: a backbone loaded with ``trainable=False``, a merged
    LoRA adapter, the backbone a training module holds frozen, Medusa-2's KL original.
    """
    return model.eval().requires_grad_(False)


def hf_source(name_or_path: str) -> str:
    """What to hand ``from_pretrained`` for ``model.name_or_path``: a local path with ``~`` expanded
    (transformers takes ``~/models/x`` for a malformed Hub id; no shell expands a ``~`` quoted for
    Hydra or written in a config file), else the name as given."""
    path = Path(name_or_path).expanduser()
    return str(path) if name_or_path.startswith("~") and path.exists() else name_or_path


_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""Files that make a checkpoint's tokenizer a Hugging Face one (vocabulary; class, special tokens, chat template)."""
_TEKKEN_FILE = "tekken.json"
"""Mistral's own tokenizer file (mistral-common's format), which Mistral's checkpoints ship."""


def load_tokenizer(name_or_path: str, *, trust_remote_code: bool = False, revision: str | None = None):
    """The backbone's tokenizer, with a pad token (eos if it has none) and left padding for batched generation.

    Always the Hugging Face tokenizer of the checkpoint's files (``mistral_format=False``), whatever is
    installed: for a ``mistral``, ``mixtral``, ``ministral``, ... checkpoint that also ships
    ``tekken.json``, transformers gives a ``MistralCommonBackend`` wherever the ``mistral-common``
    package is installed (vLLM installs it), which has no chat template, no ``split_special_tokens`` and
    no added-token table (what :class:`~medusa_train.data.chat.ChatRenderer` uses). So every machine,
    stage and engine renders with the same ``tokenizer.json`` and chat template, and the tokenizer the
    pipeline saves (Medusa-2's ``backbone/``, the export) is that one.

    Raises:
        UserError: the checkpoint's tokenizer is only ``tekken.json`` (no ``tokenizer.json`` or
            ``tokenizer_config.json``): there is no chat template to render conversations with.
    """
    source = hf_source(name_or_path)
    if _only_tekken(source, revision):
        raise UserError(
            f"{name_or_path} ships its tokenizer only as Mistral's {_TEKKEN_FILE} (mistral-common's format, "
            f"no chat template): medusa_train needs the Hugging Face tokenizer files next to it "
            f"({' and '.join(_HF_TOKENIZER_FILES)} with a chat template): use a checkpoint or conversion "
            "that ships them"
        )
    tok = AutoTokenizer.from_pretrained(
        source, trust_remote_code=trust_remote_code, revision=revision, mistral_format=False
    )
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def _only_tekken(source: str, revision: str | None) -> bool:
    """Whether checkpoint ``source`` has ``tekken.json`` and none of :data:`_HF_TOKENIZER_FILES`
    (looked up as transformers does: a directory, or the Hub and its cache; one that cannot be had
    counts as absent, and the load then says why)."""

    def has(name: str) -> bool:
        return (
            cached_file(
                source,
                name,
                revision=revision,
                _raise_exceptions_for_missing_entries=False,
                _raise_exceptions_for_connection_errors=False,
            )
            is not None
        )

    return not any(has(name) for name in _HF_TOKENIZER_FILES) and has(_TEKKEN_FILE)


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
        dtype: float32 | bfloat16 | float16 | auto (:func:`resolve_dtype`).
        quantization: none | 8bit | 4bit (bitsandbytes; nf4 with double quantization for 4bit).
        device: where to put the model (quantized models are placed by bitsandbytes).
        trainable: False freezes the model (:func:`frozen`).
    """
    check_backbone_source(name_or_path)
    dtype = resolve_dtype(dtype, device)
    kwargs: dict = {"trust_remote_code": trust_remote_code, "revision": revision, "dtype": DTYPES[dtype]}
    if quantization != "none":
        if quantization == "8bit":
            kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
        else:
            compute = DTYPES[dtype]
            kwargs["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=compute,
            )
        kwargs["device_map"] = {"": str(device)}
    with loading(name_or_path):
        model = AutoModelForCausalLM.from_pretrained(hf_source(name_or_path), **kwargs)
        tokenizer = load_tokenizer(name_or_path, trust_remote_code=trust_remote_code, revision=revision)
    if quantization == "none":
        model.to(device)
    if not trainable:
        frozen(model)
    pad_like_eos(model, tokenizer)
    return model, tokenizer


def pad_like_eos(model, tokenizer) -> None:
    """Give ``tokenizer`` and ``model.generation_config`` a pad token, in place, where they have none.

    A tokenizer without one pads with its EOS (:func:`load_tokenizer`); one that names no EOS either
    (the model's EOS ids live in its generation config only, as with Qwen-1) pads with the generation
    config's first EOS id, since the batched engines need an id to fill padding with (the attention
    mask hides it, so which id does not matter).
    """
    if tokenizer.pad_token_id is None:
        eos = model.generation_config.eos_token_id
        eos = eos if isinstance(eos, int) or eos is None else next(iter(eos), None)
        if eos is not None:
            tokenizer.pad_token = tokenizer.convert_ids_to_tokens(int(eos))
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id


@contextlib.contextmanager
def loading(name_or_path: str) -> Iterator[None]:
    """Around transformers' loads of the backbone ``name_or_path`` (its model, config or tokenizer):
    what they raise for a checkpoint that cannot be had becomes one line.

    Raises:
        UserError: no such checkpoint here or on the Hub (offline, a misspelt id), or one that is no
            causal LM, of an unknown architecture, or with custom code without ``model.trust_remote_code``.
        DamagedArtefactError: a truncated or damaged weights file (named when the checkpoint is a
            local directory).
    """
    try:
        yield
    except ValueError as err:  # what transformers raises for a checkpoint it cannot load as a causal LM
        raise UserError(_unloadable(name_or_path, err)) from None
    # torch.load fails on a damaged .bin with any of OSError, RuntimeError, EOFError or UnpicklingError,
    # depending on where the file ends, so the files themselves say whether they are damaged.
    except (OSError, SafetensorError, RuntimeError, EOFError, pickle.UnpicklingError) as err:
        damaged = _damaged_weights(name_or_path)
        if damaged is None and isinstance(err, SafetensorError):
            damaged = str(err)
        if damaged is not None:
            raise DamagedArtefactError(
                f"the weights of backbone {name_or_path!r} are damaged ({damaged}): "
                f"{_repair_backbone(name_or_path)}"
            ) from None
        if not isinstance(err, OSError):
            raise  # files that look whole: not a damaged checkpoint (a bug, or out of memory)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        why = _unreachable(name_or_path, first) or first
        raise UserError(f"could not load backbone {name_or_path!r}: {why}") from None


_LFS_POINTER = b"version https://git-lfs"
"""How a git-lfs pointer file begins (what a clone without git-lfs leaves in place of the weights)."""


def _damaged_weights(name_or_path: str) -> str | None:
    """What is wrong with the first damaged weight file of the local checkpoint ``name_or_path``: a
    git-lfs pointer in its place, a safetensors file short of the bytes its header announces, a
    ``.bin`` that is no complete zip archive (what ``torch.save`` writes). None for a Hub id, or when
    every file looks whole (only headers and zip directories are read)."""
    directory = Path(name_or_path).expanduser()
    if not directory.is_dir():
        return None
    for weights in _weight_files(directory) or []:
        try:
            with open(weights, "rb") as fh:
                if fh.read(len(_LFS_POINTER)) == _LFS_POINTER:
                    return f"{weights} is a git-lfs pointer, not the weights: fetch them with `git lfs pull`"
            if weights.suffix == ".safetensors":
                safetensors_shapes(weights)
            elif not zipfile.is_zipfile(weights):
                return f"cannot read {weights}: truncated, or not a PyTorch checkpoint"
        except HeadsFormatError as err:
            return str(err)
        except OSError as err:
            return f"cannot read {weights}: {err.strerror or err}"
    return None


def _unreachable(name_or_path: str, first: str) -> str | None:
    """Why the Hub id ``name_or_path`` cannot be had, and what to do, when it is neither in the Hugging
    Face cache nor reachable (``first``: transformers' line, which says "couldn't connect" in offline
    mode too, where nothing was tried); None for other load failures."""
    if "couldn't connect" not in first:
        return None
    why = (
        "HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set"
        if hub_constants.HF_HUB_OFFLINE
        else "https://huggingface.co did not answer (no network, a proxy?)"
    )
    return (
        f"it is not in the Hugging Face cache, and {why}: download it where the Hub answers (`hf download "
        f"{name_or_path}`) into the cache this run reads (HF_HOME), or pass model.name_or_path=<a directory "
        "holding it>"
    )


def _unloadable(name_or_path: str, err: ValueError) -> str:
    """The one line for a checkpoint transformers refuses: custom code without
    ``model.trust_remote_code``, a model that is no causal LM (T5, an encoder), an architecture this
    transformers does not know."""
    if "trust_remote_code" in str(err):
        return (
            f"backbone {name_or_path!r} runs its own code (its repository's modeling files): read them, "
            "then set model.trust_remote_code=true to load it"
        )
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    hint = (
        " (model.name_or_path must be a decoder-only language model, one AutoModelForCausalLM loads)"
        if "AutoModelForCausalLM" in first
        else ""
    )
    return f"could not load backbone {name_or_path!r}: {first}{hint}"


def _repair_backbone(name_or_path: str) -> str:
    if Path(name_or_path).parent.name == HEADS:  # Medusa-2's trained backbone ships with the heads
        return "run `python -m medusa_train stage=train training.overwrite=true` to train it again"
    if Path(name_or_path).name == PRETRAIN:
        return "run `python -m medusa_train stage=pretrain pretrain.overwrite=true` to pretrain it again"
    return "copy or download the checkpoint again"


RETRAIN_MEDUSA2 = (
    "run `python -m medusa_train stage=train training=medusa2 training.overwrite=true` to write it again"
)
"""What rewrites a damaged Medusa-2 backbone (``heads/backbone``): training the heads again."""


def check_trained_backbone(directory: str | os.PathLike, repair: str = RETRAIN_MEDUSA2) -> None:
    """A saved Medusa-2 backbone (LoRA adapter or full model) reads whole: ``adapter_config.json`` is a
    JSON object and every ``*.safetensors`` file holds the bytes its header announces.

    Raises:
        DamagedArtefactError: one line naming the damaged file and the command that writes it again.
    """
    directory = Path(directory)
    if (directory / ADAPTER_CONFIG).exists():
        read_json(directory / ADAPTER_CONFIG, repair=repair)
    for weights in sorted(directory.glob("*.safetensors")):
        try:
            safetensors_shapes(weights)
        except HeadsFormatError as err:
            raise DamagedArtefactError(f"{err}: {repair}") from None


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
    check_trained_backbone(adapter_dir)
    try:
        merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    except (ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as err:  # a foreign adapter
        raise DamagedArtefactError(
            f"{adapter_dir} is not a LoRA adapter of this base model ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}): {RETRAIN_MEDUSA2}"
        ) from None
    return frozen(merged)


def backbone_identity(
    model, name_or_path: str, revision: str | None = None, *, trust_remote_code: bool = False
) -> dict:
    """Name, architecture and a fingerprint of the weights: distill/train/export refuse to mix backbones.

    The fingerprint describes the checkpoint *files* (:func:`_files_fingerprint`: config.json, with
    ``trust_remote_code`` the remote code it names, and samples of every tensor of the weight files
    transformers loads), so the same checkpoint gives the same identity whatever dtype or quantization
    it was loaded with -- distilling in bf16 and training heads over an 8-bit copy is legitimate. A
    model with no files (built in memory) falls back to hashing its tensors (:func:`_tensors_fingerprint`).
    """
    fingerprint = checkpoint_fingerprint(name_or_path, revision, trust_remote_code=trust_remote_code)
    if fingerprint is None:
        fingerprint = _tensors_fingerprint(model)
    lm_head = model.get_output_embeddings().weight
    return {
        "name_or_path": str(name_or_path),
        "architecture": (model.config.architectures or [type(model).__name__])[0],
        # a multimodal model's config (Gemma 3) keeps the language model's sizes in its text config
        "hidden_size": int(model.config.get_text_config().hidden_size),
        # a ZeRO-3 partition (a backbone loaded partitioned) is an empty tensor; ds_shape is its whole shape
        "vocab_size": int(getattr(lm_head, "ds_shape", lm_head.shape)[0]),
        "fingerprint": fingerprint,
    }


def checkpoint_fingerprint(
    name_or_path: str, revision: str | None = None, *, trust_remote_code: bool = False
) -> str | None:
    """The files part of :func:`backbone_identity` without loading the model; None if no local files.

    ``trust_remote_code``: as the model is loaded (``model.trust_remote_code``); only then does the
    remote code its config.json names count. For a Hub id that code, where the Hub cache lacks it, is
    fetched first (what ``from_pretrained(trust_remote_code=True)`` fetches), so a run that loaded only
    the config (distill through a server) and one that loaded the model fingerprint the same files.
    Without it nothing is fetched: transformers never runs that code then.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return _files_fingerprint(path, remote_code=trust_remote_code)
    source = _hub_snapshot(name_or_path, revision)
    if source is None:
        return None
    return _files_fingerprint(
        source, remote_code=trust_remote_code, fetch=lambda name: _fetch(name_or_path, revision, name)
    )


def other_code_fingerprint(
    name_or_path: str, revision: str | None = None, *, trust_remote_code: bool = False
) -> str | None:
    """:func:`checkpoint_fingerprint` with ``model.trust_remote_code`` the other way: what a run that set
    it otherwise recorded for these files. None where config.json names no remote code (no
    ``auto_map``: the setting changes nothing) or there are no local files. Nothing is fetched: remote
    code the Hub cache lacks counts as absent."""
    path = Path(name_or_path).expanduser()
    source = path if path.is_dir() else _hub_snapshot(name_or_path, revision)
    if source is None:
        return None
    config = _read_config(source / CONFIG_NAME)
    if not isinstance(config, dict) or not isinstance(config.get("auto_map"), dict):
        return None
    return _files_fingerprint(source, remote_code=not trust_remote_code)


def local_fingerprint(name_or_path: str, *, trust_remote_code: bool = False) -> str | None:
    """The files fingerprint of a local checkpoint directory (cheap, no load, no network); None for
    anything else (a Hub id). The content stands in for the path: a moved or copied model is the same.
    ``trust_remote_code`` as for :func:`checkpoint_fingerprint`."""
    path = Path(name_or_path).expanduser()
    return _files_fingerprint(path, remote_code=trust_remote_code) if path.is_dir() else None


def local_fingerprints(name_or_path: str) -> set[str]:
    """The files fingerprints a record of the local checkpoint ``name_or_path`` may hold: with and
    without the remote code its config.json names (a record does not say whether the run that took it
    set ``model.trust_remote_code``; without an ``auto_map`` both are one). Empty for anything else."""
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        return set()
    config = _read_config(path / CONFIG_NAME)
    remote = isinstance(config, dict) and isinstance(config.get("auto_map"), dict)
    return {_files_fingerprint(path, remote_code=r) for r in ((False, True) if remote else (False,))} - {None}


def identity_content(identity: dict | None) -> dict | None:
    """A :func:`backbone_identity` as compared between runs: without ``name_or_path`` when a
    fingerprint says what the weights are (so a moved or copied backbone is the same backbone)."""
    if not isinstance(identity, dict) or not identity.get("fingerprint"):
        return identity
    return {k: v for k, v in identity.items() if k != "name_or_path"}


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def _hub_snapshot(name_or_path: str, revision: str | None) -> Path | None:
    """The Hub cache snapshot holding ``name_or_path``'s config.json at ``revision``, or None."""
    try:
        config = cached_file(
            name_or_path, CONFIG_NAME, revision=revision, _raise_exceptions_for_missing_entries=False
        )
    except Exception:  # offline, gated, or not a hub id: fall back to the tensors
        return None
    return Path(config).parent if config else None


def _weight_files(directory: Path) -> list[Path] | None:
    """The weight files transformers loads from ``directory``, in its order of preference:
    ``model.safetensors``, the shards ``model.safetensors.index.json`` lists, ``pytorch_model.bin``, the
    shards ``pytorch_model.bin.index.json`` lists; else every file with a weights suffix (a checkpoint
    under other names).

    Other weight files beside them are not the model: a repository's ``.bin`` copy of its
    safetensors, a ``consolidated.safetensors`` for another runtime, ``training_args.bin``. A full
    download has them, the Hub cache only what ``from_pretrained`` fetched, and both must count as the
    same checkpoint. None when an index lists a shard that is not there (no fingerprint of part of a
    model).
    """
    for single, index in ((SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME), (WEIGHTS_NAME, WEIGHTS_INDEX_NAME)):
        if (directory / single).is_file():
            return [directory / single]
        if (directory / index).is_file():
            try:
                weight_map = json.loads((directory / index).read_bytes())["weight_map"]
                shards = sorted({directory / name for name in weight_map.values()})
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                break  # a damaged index: loading it fails with its own message
            return shards if all(p.is_file() for p in shards) else None
    return sorted(p for p in directory.iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)


FINGERPRINT_PREFIX = "v2-"
"""Starts every fingerprint this medusa_train computes: of the files (:func:`_files_fingerprint`) and,
for a model without files, of the tensors (:data:`TENSORS_PREFIX`). One recorded without it was
computed by an earlier medusa_train (:func:`older_fingerprint`)."""
TENSORS_PREFIX = FINGERPRINT_PREFIX + "tensors-"
"""Starts a fingerprint of a model's tensors (:func:`_tensors_fingerprint`), never one of files (16 hex
digits follow :data:`FINGERPRINT_PREFIX` there)."""


def older_fingerprint(recorded: object, current: str | None) -> bool:
    """``recorded`` is a fingerprint of an earlier medusa_train (no :data:`FINGERPRINT_PREFIX`),
    ``current`` one of this: a comparison of the two cannot tell the checkpoints apart.

    Such a value is 16 hex digits: a files fingerprint of other bytes of the files (config.json as
    written, the first and last MiB of each weight file, no remote code), or one of the tensors of a
    model that had no files (the same digest that now follows :data:`TENSORS_PREFIX`). The two cannot
    be told apart, and the files one differs whatever the checkpoint, so either is read as one that
    says nothing: a name decides where a fingerprint only confirms one (:func:`_is_base`,
    ``custom_generate``), eval warns that it cannot say, distilled data is distilled again. Never
    "another model"."""
    return (
        isinstance(recorded, str)
        and bool(recorded)
        and not recorded.startswith(FINGERPRINT_PREFIX)
        and bool(current)
        and current.startswith(FINGERPRINT_PREFIX)
    )


_UNSAVED_CONFIG_KEYS = ("transformers_version", "_name_or_path")
"""config.json entries that say who wrote the file or where it was loaded from, never what the model
computes: a model saved again by a transformers release that writes the same settings keeps its
fingerprint. Everything else counts (``architectures`` picks the class that loads, ``auto_map`` the code)."""
_SAMPLE = 4 << 10
"""Bytes read at the start, middle and end of each tensor of a safetensors file."""
_SPACED_SAMPLE, _SPACED_STRIDE, _SPACED_MAX = 64 << 10, 1 << 20, 1024
"""Other weight files (``torch.save``'s ``.bin``): blocks of this many bytes, this far apart at most,
at most this many."""


def other_kinds(recorded: object, current: str | None) -> bool:
    """``recorded`` and ``current`` are fingerprints of this medusa_train of two kinds, one of files and
    one of a model's tensors (:data:`TENSORS_PREFIX`): they differ whatever the model, so where a
    fingerprint only confirms a name the name decides."""
    return (
        isinstance(recorded, str)
        and isinstance(current, str)
        and recorded.startswith(FINGERPRINT_PREFIX)
        and current.startswith(FINGERPRINT_PREFIX)
        and recorded.startswith(TENSORS_PREFIX) != current.startswith(TENSORS_PREFIX)
    )


def is_files_fingerprint(value: object) -> bool:
    """``value`` is a files fingerprint this medusa_train computes: one a checkpoint's files can be
    compared with (not one of an earlier medusa_train, nor of a model's tensors)."""
    return (
        isinstance(value, str)
        and value.startswith(FINGERPRINT_PREFIX)
        and not value.startswith(TENSORS_PREFIX)
    )


def _files_fingerprint(
    directory: Path, *, remote_code: bool, fetch: Callable[[str], None] | None = None
) -> str | None:
    """A digest of the checkpoint files in ``directory`` that decide what the model computes, as
    :data:`FINGERPRINT_PREFIX` and 16 hex digits; None without weight files (or with a shard missing).

    - config.json by its parsed content, less :data:`_UNSAVED_CONFIG_KEYS`;
    - with ``remote_code`` (the model is loaded with ``trust_remote_code``) and where config.json has
      an ``auto_map``: the code files it names and the files they import relatively, whole
      (:func:`_remote_code`). Only those: a ``.py`` file beside a model without ``auto_map`` (a
      training script) is never run and does not count, nor is any without ``trust_remote_code``
      (transformers then loads its built-in class or refuses; ``auto_map`` itself counts, in
      config.json). A model without ``auto_map`` has one fingerprint either way;
    - each weight file transformers loads (:func:`_weight_files`): its name and size, and samples
      (:func:`_weight_samples`): for safetensors its header (every tensor's name, dtype, shape and
      offsets) and 4 KiB at the start, middle and end of every tensor (tensors up to 12 KiB whole);
      for ``torch.save``'s ``.bin`` the CRC-32 of every tensor its zip directory lists (64 KiB every
      MiB only where a record has none).

    Samples, not a hash of every byte: SHA-256 of a 5 GB safetensors file took 5.3 s from the page
    cache and 13.5 s from disk (a 2-core AMD EPYC VM, 2026-12-07), and the fingerprint is taken several times per
    run (distill's check before it loads and after, train, eval, export's and ``custom_generate``'s
    base checks) on every rank, kept nowhere between them: minutes per run for a 70B model. A cache
    keyed by path, size and mtime would need a place outside the workdir that ``custom_generate``
    shares too. The samples of that file (300 tensors) took 0.08 s from disk, 0.014 s cached, and see
    any tensor a fine-tune changes as a whole (full tuning, a merged LoRA adapter, some layers, a norm
    or a bias): they miss a change to part of a tensor between its samples (a few rows of an embedding).

    ``fetch(name)``: puts the remote code file ``name`` into ``directory`` (a Hub snapshot) if it can;
    called only with ``remote_code``.
    """
    weights = _weight_files(directory)
    if not weights:
        return None
    h = hashlib.sha256()
    config = _read_config(directory / CONFIG_NAME)
    if isinstance(config, dict):
        content = {k: v for k, v in config.items() if k not in _UNSAVED_CONFIG_KEYS}
        h.update(f"{CONFIG_NAME}:".encode() + json.dumps(content, sort_keys=True).encode())
        if remote_code and isinstance(config.get("auto_map"), dict):
            for name, code in _remote_code(directory, config["auto_map"], fetch).items():
                h.update(
                    f"{name}:absent".encode() if code is None else f"{name}:{len(code)}:".encode() + code
                )
    elif config is not None:  # not a JSON object: loading fails with its own message
        h.update(f"{CONFIG_NAME}:".encode() + config)
    for path in weights:
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        for block in _weight_samples(path, size):
            h.update(block)
    return FINGERPRINT_PREFIX + h.hexdigest()[:16]


def _read_config(path: Path) -> dict | bytes | None:
    """config.json parsed; its bytes when it is not a JSON object; None when there is none."""
    if not path.is_file():
        return None
    raw = path.read_bytes()
    try:
        config = json.loads(raw)
    except ValueError:
        return raw
    return config if isinstance(config, dict) else raw


def _remote_code(
    directory: Path, auto_map: dict, fetch: Callable[[str], None] | None = None
) -> dict[str, bytes | None]:
    """The code files ``auto_map`` names (``"AutoModelForCausalLM": "modeling_x.XForCausalLM"``: ``modeling_x.py``)
    and those they import relatively (``from .utils import``), as transformers finds them
    (``dynamic_module_utils``), in name order: their content, or None for one not in ``directory``.
    A class of another repository (``"org/repo--modeling_x.X"``) counts by that reference: its code is
    not among these files. A file that is not UTF-8 counts by its bytes, its imports unread:
    transformers reads each file as UTF-8 to find them and fails to load such a model with its own
    message (the fingerprint, taken before loading, must not raise first)."""
    refs = {ref for value in auto_map.values() for ref in (value if isinstance(value, list) else [value])}
    refs = {ref for ref in refs if isinstance(ref, str) and ref}
    code: dict[str, bytes | None] = {ref: None for ref in refs if "--" in ref}
    todo = sorted({ref.split(".")[0] + ".py" for ref in refs if "--" not in ref})
    while todo:
        name = todo.pop()
        if name in code:
            continue
        path = directory / name
        if not path.is_file() and fetch is not None:
            fetch(name)
        if not path.is_file():
            code[name] = None
            continue
        code[name] = path.read_bytes()
        try:
            todo.extend(f"{module}.py" for module in get_relative_imports(path))
        except UnicodeDecodeError:
            continue
    return dict(sorted(code.items()))


def _fetch(repo_id: str, revision: str | None, name: str) -> None:
    """Fetch ``name`` of Hub repository ``repo_id`` into the Hub cache, if it can be (not offline)."""
    try:
        cached_file(repo_id, name, revision=revision, _raise_exceptions_for_missing_entries=False)
    except Exception as err:  # offline, gated, rate-limited: the file counts as absent, said once
        log.warning(
            "could not fetch %s of %s (%s): the backbone's fingerprint counts it as absent, and differs "
            "from one taken with it (another stage's data may then be refused): fetch it and run again",
            name,
            repo_id,
            str(err).splitlines()[0] if str(err) else type(err).__name__,
        )


def _weight_samples(path: Path, size: int) -> Iterator[bytes]:
    """The bytes of weight file ``path`` its fingerprint reads (see :func:`_files_fingerprint`).

    A safetensors file: its header, then 4 KiB at the start, middle and end of each tensor in file
    order. Any other file (or a safetensors file whose header does not parse, which fails to load
    with its own message): the CRC-32 of each record of a ``torch.save`` zip (:func:`_zip_listing`),
    and where a record has none (or the file is no zip) 64 KiB every MiB, at most 1024 blocks, evenly
    spaced from the first byte to the last (the whole file when that is all of it).
    """
    with open(path, "rb") as fh:
        reads = None
        if path.suffix == ".safetensors":
            prefix = fh.read(8)
            length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            if 0 <= length <= size - 8:
                header = fh.read(length)
                yield prefix + header
                reads = _tensor_reads(header, 8 + length)
        if reads is None:
            listing, checksummed = _zip_listing(fh)
            yield listing
            # Every record's CRC covers all its bytes: nothing more to read (a 70B .bin checkpoint
            # would otherwise read ~1 GB per fingerprint, taken several times per run on every rank).
            reads = [] if checksummed else _spaced_reads(size)
        for offset, length in reads:
            fh.seek(offset)
            yield fh.read(length)


def _zip_listing(fh) -> tuple[bytes, bool]:
    """Name, size and CRC-32 of every record of a ``torch.save`` zip file (one per tensor storage: the
    CRC is a checksum of all its bytes, unless ``torch.serialization.set_crc32_options(False)`` wrote
    zeros), read from the zip's directory at its end; nothing for a file that is not a zip. And
    whether every non-empty record has a CRC (False for a file that is not a zip)."""
    try:
        with zipfile.ZipFile(fh) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return b"", False
    listing = json.dumps([[i.filename, i.file_size, i.CRC] for i in infos]).encode()
    return listing, bool(infos) and all(i.CRC != 0 for i in infos if i.file_size)


def _tensor_reads(header: bytes, data_start: int) -> list[tuple[int, int]] | None:
    """``(offset, length)`` of the samples of each tensor of a safetensors file whose JSON header is
    ``header`` (in file order); None when it is not a safetensors header, or one with offsets before
    the data or ending before they start (such a file fails to load with its own message: the
    fingerprint must not fail first with a seek or read error)."""
    try:
        spans = sorted(
            (data_start + int(v["data_offsets"][0]), data_start + int(v["data_offsets"][1]))
            for k, v in json.loads(header).items()
            if k != "__metadata__"
        )
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
    if any(start < data_start or end < start for start, end in spans):
        return None
    reads = []
    for start, end in spans:
        if end - start <= 3 * _SAMPLE:
            reads.append((start, end - start))
        else:
            reads += [(start, _SAMPLE), ((start + end - _SAMPLE) // 2, _SAMPLE), (end - _SAMPLE, _SAMPLE)]
    return reads


def _spaced_reads(size: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of :data:`_SPACED_SAMPLE`-byte blocks of a ``size``-byte file, evenly spaced
    from its first byte to its last and at most :data:`_SPACED_STRIDE` apart (so a changed stretch that
    long is read), or :data:`_SPACED_MAX` of them; the whole file when that is all of it."""
    last = size - _SPACED_SAMPLE
    count = min(_SPACED_MAX, max(2, -(-last // _SPACED_STRIDE) + 1))
    if size <= count * _SPACED_SAMPLE:
        return [(0, size)]
    return [(last * i // (count - 1), _SPACED_SAMPLE) for i in range(count)]


def _tensors_fingerprint(model) -> str:
    """A digest of a model's config and tensors, for one with no checkpoint files: :data:`TENSORS_PREFIX`
    and 16 hex digits (the digest an earlier medusa_train recorded without a prefix)."""
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
    return TENSORS_PREFIX + h.hexdigest()[:16]


# -- cfg.model -> a loaded backbone -------------------------------------------------------------------
def load_configured_backbone(model_cfg: ModelConfig, device=None, *, trainable: bool = False):
    """``(model, tokenizer)`` as ``cfg.model`` describes them: the one place stages turn config into a load.

    Args:
        model_cfg: ``cfg.model`` (:class:`medusa_train.config.ModelConfig`).
        device: defaults to ``resolve_device(model_cfg.device)``.
        trainable: False freezes the model (eval mode, no gradients).
    """
    return load_backbone(
        model_cfg.name_or_path,
        dtype=model_cfg.dtype,
        quantization=model_cfg.quantization,
        device=device if device is not None else resolve_device(model_cfg.device),
        trust_remote_code=model_cfg.trust_remote_code,
        revision=model_cfg.revision,
        trainable=trainable,
    )


def meta_backbone(model_cfg: ModelConfig) -> torch.nn.Module | None:
    """``cfg.model``'s model built from its config on the meta device: the class and config
    :func:`load_configured_backbone` would load, without reading a weight or allocating memory, for a
    check before the load (or where the model runs elsewhere: a server). The config is read as the load
    reads it (revision, remote code), with :func:`loading`'s one-line errors.

    Returns:
        None where the model cannot be built so (remote code that computes in its ``__init__`` or needs
        a package missing here, a config no causal LM class takes), logged at debug level: nothing to
        check before the load.
    """
    m = model_cfg
    with loading(m.name_or_path):
        config = AutoConfig.from_pretrained(
            hf_source(m.name_or_path), revision=m.revision, trust_remote_code=m.trust_remote_code
        )
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=m.trust_remote_code)
    except Exception as err:  # noqa: BLE001 - whatever it is, the model is only not checked before it loads
        log.debug(
            "%s cannot be built on the meta device (%s): not checked before it loads", m.name_or_path, err
        )
        return None


# -- the backbone that goes with a set of heads (Medusa-2) -------------------------------------------
def trained_backbone_dir(heads_dir: Path) -> Path | None:
    """The Medusa-2 backbone that ships with ``heads_dir``, or None (Medusa-1 heads, heads from elsewhere).

    Looked for in ``heads_dir/backbone`` (``workdir/heads``, an export folder) and, for a
    ``medusa/``/``vllm/`` layout folder, in ``backbone/`` of the export it belongs to.
    """
    candidates = [heads_dir / TRAINED_BACKBONE]
    if heads_dir.name in LAYOUTS:
        candidates.append(heads_dir.parent / TRAINED_BACKBONE)
    return next((p for p in candidates if (p / CONFIG_NAME).is_file() or is_adapter_dir(p)), None)


def recorded_base(heads_dir: Path) -> dict | None:
    """Identity (``name_or_path``, ``fingerprint``, ...) of the backbone training started from, as
    stage=train recorded it with the heads (an export keeps it in ``medusa/config.json`` and
    ``vllm/config.json``)."""
    layouts = [heads_dir / name for name in LAYOUTS] + [heads_dir.parent / name for name in LAYOUTS]
    for directory in (heads_dir, *layouts):
        try:
            identity = read_heads_config(directory).get("backbone")
        except HeadsFormatError:
            continue
        if isinstance(identity, dict) and identity.get("name_or_path"):
            return identity
    return None


def same_path(a: str, b: str) -> bool:
    """The same hub id, or the same local directory however spelt."""
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return a == b or (pa.exists() and pb.exists() and pa.resolve() == pb.resolve())


def _is_base(model_cfg: ModelConfig, base: dict, *, by_content: bool = False) -> bool:
    """``model.name_or_path`` is the recorded base: the same name, or the same checkpoint files.

    ``by_content`` (a LoRA adapter, merged into whatever base it is given): the same name whose files
    have another fingerprint than the recorded one (another revision of a Hub id, a directory
    holding another model now) is not the base. A recorded fingerprint that is not of files
    (:func:`is_files_fingerprint`: one an earlier medusa_train recorded, :func:`older_fingerprint`, or
    one of the tensors of a base that had no files) compares nothing: the name decides, as without one.
    """
    recorded = base.get("fingerprint")
    same_name = same_path(model_cfg.name_or_path, str(base["name_or_path"]))
    if same_name and not (by_content and recorded):
        return True
    found = checkpoint_fingerprint(
        model_cfg.name_or_path, model_cfg.revision, trust_remote_code=model_cfg.trust_remote_code
    )
    # no files to compare (offline, not in the cache), or nothing to compare them with: the name decides
    if same_name and (found is None or not is_files_fingerprint(recorded)):
        return True
    return found is not None and found == recorded


def base_model_here(model_cfg: ModelConfig, heads_dir: Path, recorded: str | None) -> str:
    """The heads' base model as a path valid here: ``recorded`` (their ``base_model_name_or_path``),
    unless it is a local path that no longer exists (the workdir was moved, copied or renamed) and
    ``model.name_or_path`` holds the same checkpoint (by fingerprint): then ``model.name_or_path``.
    Without a recorded name, ``model.name_or_path``."""
    if not recorded:
        return model_cfg.name_or_path
    if recorded == model_cfg.name_or_path or Path(recorded).expanduser().exists():
        return recorded
    base = recorded_base(heads_dir)
    if base is not None and base.get("fingerprint") and _is_base(model_cfg, base):
        return model_cfg.name_or_path
    return recorded


def backbone_for_heads(model_cfg: ModelConfig, heads_dir: Path) -> Path | None:
    """The trained Medusa-2 backbone to use with ``heads_dir``, or None for ``model.name_or_path``.

    See the module docstring for the rule; a warning says when a trained backbone is passed over.
    """
    trained = trained_backbone_dir(heads_dir)
    if trained is None:
        return None
    base = recorded_base(heads_dir)
    if (
        base is None
        or _is_base(model_cfg, base, by_content=is_adapter_dir(trained))
        or same_path(model_cfg.name_or_path, str(trained))
    ):
        return trained
    log.warning(
        "the heads in %s were trained together with the backbone in %s (training=medusa2), but "
        "model.name_or_path=%s is another model than their base %s%s: using %s as asked",
        heads_dir,
        trained,
        model_cfg.name_or_path,
        base["name_or_path"],
        " (the same name, other checkpoint files: another model.revision?)"
        if same_path(model_cfg.name_or_path, str(base["name_or_path"]))
        else "",
        model_cfg.name_or_path,
    )
    return None


def load_trained_backbone(model_cfg: ModelConfig, directory: Path, device=None, *, base=None):
    """The Medusa-2 backbone saved in ``directory``: a full model, or a LoRA adapter merged into its base.

    Args:
        model_cfg: ``cfg.model``: dtype, quantization and ``trust_remote_code`` apply; for an adapter,
            ``name_or_path`` is its base.
        directory: ``heads/backbone`` (full model or adapter) or an export's ``backbone`` (full model).
        device: defaults to ``resolve_device(model_cfg.device)``.
        base: an already loaded base model to merge an adapter into (loaded from ``model_cfg`` if None).

    Returns:
        The model, in eval mode without gradients.
    """
    device = device if device is not None else resolve_device(model_cfg.device)
    if is_adapter_dir(directory):
        if base is None:
            base, _ = load_configured_backbone(model_cfg, device)
        return merge_adapter(base, directory)
    in_heads = directory.parent.name == HEADS  # else an export's backbone/
    check_trained_backbone(
        directory, RETRAIN_MEDUSA2 if in_heads else "run `python -m medusa_train stage=export`"
    )
    model, _ = load_backbone(
        str(directory),
        dtype=model_cfg.dtype,
        quantization=model_cfg.quantization,
        device=device,
        trust_remote_code=model_cfg.trust_remote_code,
    )
    return model


def load_backbone_for_heads(model_cfg: ModelConfig, heads_dir: Path, device=None, *, quantize: bool = True):
    """``(model, tokenizer, source, trained)`` for evaluating or exporting the heads in ``heads_dir``.

    ``source`` names what was loaded: the trained backbone's directory (``trained`` True: Medusa-2,
    see :func:`backbone_for_heads`) or ``model.name_or_path``. ``quantize=False`` loads without
    ``model.quantization`` (export writes full weights).
    """
    if not quantize:
        model_cfg = dataclasses.replace(model_cfg, quantization="none")
    trained = backbone_for_heads(model_cfg, heads_dir)
    if trained is None:
        model, tokenizer = load_configured_backbone(model_cfg, device)
        return model, tokenizer, str(model_cfg.name_or_path), False
    model = load_trained_backbone(model_cfg, trained, device)
    tokenizer = load_tokenizer(str(trained), trust_remote_code=model_cfg.trust_remote_code)
    pad_like_eos(model, tokenizer)
    return model, tokenizer, str(trained), True


@torch.no_grad()
def backbone_drift(original: torch.nn.Module, trained: torch.nn.Module, batches) -> dict:
    """How far a trained (Medusa-2) backbone moved from the original, on held-out token batches.

    Counted on every position whose next token is loss-masked (a token the original generated, for
    self-distilled data), i.e. where the LM was trained and where the heads' tokens come from.

    Args:
        original: the backbone the training started from.
        trained: the trained backbone (same tokenizer and vocabulary, same device).
        batches: dicts with ``input_ids``, ``attention_mask`` (0 on right padding) and ``loss_mask``,
            each ``(B, T)``.

    Returns:
        ``argmax_agreement``: share of positions where the trained greedy next token equals the
        original's; ``kl``: mean ``KL(p_original || p_trained)`` of the next-token distribution, nats;
        ``positions``: how many were counted.
    """
    device = next(trained.parameters()).device
    agree, total, kl = 0, 0, 0.0
    for batch in batches:
        ids, attn, mask = (batch[k].to(device) for k in ("input_ids", "attention_mask", "loss_mask"))
        keep = torch.zeros_like(mask, dtype=torch.bool)  # (B, T): position t predicts loss-masked t+1
        keep[:, :-1] = (mask[:, 1:].bool() & attn[:, 1:].bool()) & attn[:, :-1].bool()
        if not bool(keep.any()):
            continue
        lo = original(input_ids=ids, attention_mask=attn).logits[keep].float()  # (N, V)
        lt = trained(input_ids=ids, attention_mask=attn).logits[keep].float()  # (N, V)
        agree += int((lo.argmax(-1) == lt.argmax(-1)).sum())
        po, pt = lo.log_softmax(-1), lt.log_softmax(-1)  # (N, V)
        kl += float((po.exp() * (po - pt)).sum())
        total += int(keep.sum())
    return {
        "argmax_agreement": agree / total if total else None,
        "kl": kl / total if total else None,
        "positions": total,
    }
