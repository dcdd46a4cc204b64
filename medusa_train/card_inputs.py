"""The JSON files earlier stages wrote that later ones read, and the one check of their shape.

:class:`CardInput` describes what is read of such a file (entries, JSON types, the command that
writes it again); :func:`shape_problem` says what makes a parsed file other than described and
:func:`read_checked` reads and checks one. The model card (:mod:`medusa_train.report`, which also
holds eval's report.json and distill's manifest descriptions), stage=export, stage=eval,
stage=train and ``custom_generate`` all check calibration.json here, against
:data:`CALIBRATION_INPUT` (a copy inside an export: :data:`EXPORTED_CALIBRATION_INPUT`, the same
entries, another repair): a file one of them takes as damaged, each of them does.

Standard library and :mod:`medusa_train.formats` only (no datasets or pandas): ``custom_generate``
reads calibration.json inside ``model.generate``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from medusa_train.formats import layout_dir

NUMBER = (int, float)
"""A JSON number (a JSON ``true``/``false`` is not one, though Python's bool is an int)."""
NULL = type(None)


@dataclass(frozen=True)
class CardInput:
    """What the model card reads of one JSON file an earlier stage wrote (of calibration.json, also
    what export, eval, train and ``custom_generate`` read of it: one description, so a file the card
    leaves out is the one export does not ship and eval refuses, see :func:`shape_problem`).

    ``fields``: each entry read, as a dotted path (``[]`` for every item of a list; a final ``!``: the
    entry must be there when the object holding it is not empty), with the JSON types it may have; an
    absent entry is fine unless marked. ``repair``: the command that writes the file again. ``rule``:
    what the fields' types cannot say (None: nothing), the problem of a file whose fields are right or
    None.
    """

    fields: dict[str, tuple[type, ...]]
    repair: str
    rule: Callable[[dict], str | None] | None = None


def _equal_rows(calibration: dict) -> str | None:
    """The head accuracy table is one row per head, every row as long (eval stacks it into a tensor)."""
    rows = calibration.get("head_topk_accuracy") or []
    if len({len(row) for row in rows}) > 1:
        return (
            f"'head_topk_accuracy' has rows of {sorted({len(row) for row in rows})} entries, not one length"
        )
    return None


CALIBRATION_INPUT = CardInput(
    {
        "head_topk_accuracy": (list, NULL),
        "head_topk_accuracy[]": (list,),
        "head_topk_accuracy[][]": NUMBER,
        "tree": (dict, NULL),
        "tree.choices": (list, NULL),
        "tree.choices[]": (list,),
        "tree.choices[][]": (int,),
        "tree.best": (dict, NULL),
        "tree.best.nodes": (int, NULL),
        "tree.context_len": (int,),
        "tree.calibrated_for": (dict, NULL),
        "tree.calibrated_for.device!": (str,),
        "tree.calibrated_for.dtype!": (str,),
        "tree.calibrated_for.attention": (str,),
    },
    "run `python -m medusa_train stage=train` (same settings) to calibrate again",
    _equal_rows,
)
"""stage=train's calibration.json: head accuracy, the chosen tree, where it was calibrated and at which
context its latency curve was timed (stage=eval's fit of the tree to its device reads that too)."""

EXPORTED_CALIBRATION_INPUT = replace(
    CALIBRATION_INPUT,
    repair="run `python -m medusa_train stage=export` (same settings) to copy the heads' calibration.json "
    "into the export again (`python -m medusa_train stage=train` first, same settings, if the heads' "
    "own is damaged too)",
)
"""The copy of calibration.json an export ships: stage=export copies the heads' own, whole, at every
run (and leaves a damaged one out, with a warning naming stage=train)."""


def calibration_input(folder: Path) -> CardInput:
    """How the calibration.json in ``folder`` is checked and repaired: an export's copy (``folder``
    holds a serving layout) or stage=train's own."""
    return EXPORTED_CALIBRATION_INPUT if layout_dir(folder) != folder else CALIBRATION_INPUT


def read_checked(path: Path, expected: CardInput) -> tuple[dict | None, str | None]:
    """``(data, problem)`` of the JSON file at ``path``: ``(data, None)`` when it is whole, ``(None,
    None)`` when it is missing, ``(None, problem)`` when it is damaged: unreadable, not valid JSON
    (not UTF-8, nested too deep) or :func:`shape_problem`. The caller says what it does without it."""
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None, None
    except OSError as err:
        return None, f"cannot be read: {err.strerror or err}"
    except (ValueError, RecursionError) as err:  # JSONDecodeError, bad UTF-8, nesting too deep
        reason = err.msg if isinstance(err, json.JSONDecodeError) else type(err).__name__
        return None, f"not valid JSON: {reason}"
    problem = shape_problem(data, expected)
    return (data, None) if problem is None else (None, problem)


def shape_problem(data: object, expected: CardInput) -> str | None:
    """What makes the parsed JSON ``data`` other than ``expected`` describes: not an object, or the
    first entry of ``expected.fields`` it holds with another type, or lacks though required, as
    "'tree.best' is a JSON list where an object is expected"; None if nothing. A JSON ``true`` or
    ``false`` is no number.

    The one check of calibration.json's shape: the card and export leave a file with a problem out
    (:func:`~medusa_train.report.read_json`), stage=eval refuses it, stage=train calibrates again and
    ``custom_generate`` decodes without it, with a warning."""
    if not isinstance(data, dict):
        return f"{_json_kind(data)} where an object is expected"
    for spec, types in expected.fields.items():
        required = spec.endswith("!")
        *outer, last = re.findall(r"\[\]|[^.\[\]!]+", spec)  # "a[].b!" -> "a", "[]", "b"
        holders: list[tuple[object, str]] = [(data, "")]  # (value, its dotted name)
        for step in outer:  # what holds the entry; a holder of the wrong type is its own entry's problem
            holders = [child for value, where in holders for child in _children(value, where, step)]
        for holder, where in holders:
            if required and isinstance(holder, dict) and holder and last not in holder:
                return f"lacks '{_join(where, last)}'"
            for value, name in _children(holder, where, last, nulls=True):
                # bool is an int subclass: JSON true/false only where a boolean is expected
                if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                    want = _json_kind(types[0], article=True)
                    return f"'{name}' is {_json_kind(value)} where {want} is expected"
    return None if expected.rule is None else expected.rule(data)


def _children(value: object, where: str, step: str, *, nulls: bool = False) -> list[tuple[object, str]]:
    """``(child, dotted name)`` of what ``step`` ("[]": every item, else a key) reaches in ``value``
    (named ``where``); a null child only with ``nulls``."""
    if step == "[]":
        return [(v, f"{where}[{i}]") for i, v in enumerate(value)] if isinstance(value, list) else []
    if isinstance(value, dict) and step in value and (nulls or value[step] is not None):
        return [(value[step], _join(where, step))]
    return []


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _json_kind(value, *, article: bool = False) -> str:
    """``value``'s JSON kind with its article ("a JSON list", "JSON null"); of a type with ``article``
    ("an object", "a number")."""
    kind = value if isinstance(value, type) else type(value)
    name = {dict: "object", list: "list", str: "string", bool: "boolean", int: "number", float: "number"}
    noun = name.get(kind, "null" if kind is NULL else kind.__name__)
    if article:
        return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"
    return "JSON null" if noun == "null" else f"{'an' if noun[0] in 'aeiou' else 'a'} JSON {noun}"
