"""A saved backbone's files made readable by transformers 4.x consumers too.

transformers 5 folds ``rope_theta`` and ``rope_scaling`` into ``rope_parameters`` and writes ``dtype``
for ``torch_dtype``: consumers on transformers 4.x (FasterDecoding's pinned 4.34, TensorRT-LLM's
converter, older vLLM and TGI images) would silently use their defaults (rope_theta 10000).
:func:`add_legacy_config_keys` writes those keys beside the new ones; :func:`add_legacy_tokenizer_keys`
makes the tokenizer files readable by transformers 4.x / tokenizers < 0.20 too (:func:`save_tokenizer`
applies it to every tokenizer the pipeline writes, the embedded backbone's included). Used by
``stage=pretrain`` (the embedded backbone), ``stage=train`` (Medusa-2's backbone beside the heads) and
``stage=export`` (the exported backbone); ``docs/pipeline.md`` tables what each consumer reads.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from medusa_train.workdir import atomic_write, atomic_write_json

log = logging.getLogger(__name__)


def legacy_config_keys(config: dict) -> dict:
    """The config.json keys transformers 4.x reads that transformers 5 no longer writes.

    transformers 5 keeps RoPE settings only in ``rope_parameters`` (``rope_theta`` and the scaling
    type and factors together) and the weights' dtype under ``dtype``. A loader on transformers 4.x
    (FasterDecoding's pinned 4.34, TensorRT-LLM's converter, older vLLM and TGI images) reads
    ``rope_theta``, ``rope_scaling``, ``partial_rotary_factor`` and ``torch_dtype`` from the top level
    and, when they are missing, takes its defaults (rope_theta 10000 where Llama-3 needs 500000, no
    scaling, float32) without a word. Returns those keys, derived from the new ones; keys already at
    the top level are kept as they are (an empty dict when there is nothing to add).

    ``rope_scaling`` is ``rope_parameters`` without ``rope_theta`` (and without a
    ``partial_rotary_factor``), or null for plain RoPE -- what 4.x LlamaConfig defaults to and what
    transformers 5 reads back into the same ``rope_parameters``. Per-layer-type RoPE (nested
    ``rope_parameters``, e.g. Gemma 3) maps to model-specific 4.x keys and is left alone, with a
    warning.
    """
    out: dict = {}
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and rope:
        if "rope_theta" not in rope and all(isinstance(v, dict) for v in rope.values()):
            log.warning(
                "config.json has per-layer-type rope_parameters %s: transformers 4.x consumers need "
                "model-specific keys for them, which are not written",
                sorted(rope),
            )
        else:
            if "rope_theta" in rope and "rope_theta" not in config:
                out["rope_theta"] = rope["rope_theta"]
            if "partial_rotary_factor" in rope and "partial_rotary_factor" not in config:
                out["partial_rotary_factor"] = rope["partial_rotary_factor"]
            if "rope_scaling" not in config:
                scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
                out["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
    if config.get("dtype") is not None and "torch_dtype" not in config:
        out["torch_dtype"] = config["dtype"]
    return out


def add_legacy_config_keys(directory: str | os.PathLike) -> dict:
    """Add :func:`legacy_config_keys` to ``directory/config.json`` (atomically); returns the keys added.

    transformers 5 reads the file back to the same config (``rope_parameters`` is rebuilt from
    ``rope_scaling`` + ``rope_theta``, ``dtype`` wins over ``torch_dtype``).
    """
    path = Path(directory) / "config.json"  # the Hugging Face model config
    config = json.loads(path.read_text())
    added = legacy_config_keys(config)
    if added:
        atomic_write_json(path, {**config, **added})
    return added


def add_legacy_tokenizer_keys(directory: str | os.PathLike) -> list[str]:
    """Make a tokenizer saved by transformers 5 readable by transformers 4.x; returns what changed.

    - ``tokenizer_config.json``: ``tokenizer_class`` ``TokenizersBackend`` (transformers 5's name) becomes
      ``PreTrainedTokenizerFast`` (the same class under its 4.x name, an alias in 5); ``chat_template``
      is copied in from ``chat_template.jinja`` (4.x before ~4.50 reads it only from there).
    - ``tokenizer.json``: BPE ``merges`` written by tokenizers >= 0.20 as pairs (``["a", "b"]``) go back
      to the ``"a b"`` strings that tokenizers < 0.20 (the one transformers 4.34 pins) requires and
      every later version reads too -- only when no merged piece contains a space (byte-level BPE
      never does), since the string form cannot express that.

    Each file is rewritten atomically; the tokens and ids are unchanged.
    """
    directory = Path(directory)
    changed: list[str] = []
    config_path, template_path = directory / "tokenizer_config.json", directory / "chat_template.jinja"
    if config_path.is_file():
        config = json.loads(config_path.read_text())
        new = dict(config)
        if new.get("tokenizer_class") == "TokenizersBackend":
            new["tokenizer_class"] = "PreTrainedTokenizerFast"
        if "chat_template" not in new and template_path.is_file():
            new["chat_template"] = template_path.read_text()
        if new != config:
            atomic_write_json(config_path, new)
            changed += [f"tokenizer_config.json:{key}" for key in new if new[key] != config.get(key)]
    tokenizer_path = directory / "tokenizer.json"
    if tokenizer_path.is_file():
        tokenizer = json.loads(tokenizer_path.read_text())
        merges = (tokenizer.get("model") or {}).get("merges")
        if merges and all(isinstance(m, list) and len(m) == 2 and " " not in m[0] + m[1] for m in merges):
            tokenizer["model"]["merges"] = [f"{a} {b}" for a, b in merges]
            atomic_write(
                tokenizer_path,
                lambda p: p.write_text(json.dumps(tokenizer, indent=2, ensure_ascii=False) + "\n"),
            )
            changed.append("tokenizer.json:merges")
    return changed


def save_tokenizer(tokenizer, directory: str | os.PathLike) -> list[str]:
    """``tokenizer.save_pretrained(directory)``, its files then made readable by transformers 4.x too
    (:func:`add_legacy_tokenizer_keys`); returns what was adapted.

    Every tokenizer the pipeline writes goes through here: the embedded backbone's (``stage=pretrain``,
    the base model a Medusa-1 export names), the Medusa-2 backbone's beside the heads and in the export.
    """
    tokenizer.save_pretrained(directory)
    return add_legacy_tokenizer_keys(directory)
