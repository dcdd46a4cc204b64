"""The JSON files earlier stages wrote that later ones read, and the one check of their shape.

:class:`CardInput` describes what is read of such a file (entries, JSON types, the command that
writes it again); :func:`shape_problem` says what makes a parsed file other than described and
:func:`read_checked` reads and checks one. The model card (:mod:`medusa_train.report`, which also
holds eval's report.json and distill's manifest descriptions), stage=export, stage=eval,
stage=train and ``custom_generate`` all check calibration.json here, against
:data:`CALIBRATION_INPUT` (a copy inside an export: :data:`EXPORTED_CALIBRATION_INPUT`, the same
entries, another repair): a file one of them takes as damaged, each of them does. Eval's reading
of it is here too (:func:`stored_topk`, :func:`read_calibration`): it refuses a damaged one.

Standard library only (no torch, datasets or pandas): ``custom_generate`` reads calibration.json
inside ``model.generate``, and the CLI checks ``eval.compare``'s before it imports a stage.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from medusa_train.errors import DamagedArtefactError
from medusa_train.heads_layout import layout_dir
from medusa_train.workdir import CALIBRATION, read_json

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


def calibration_topk(calibration: dict | None) -> list[list[float]] | None:
    """The per-head cumulative top-k accuracy table ``(K, R)`` of a calibration.json, if it has one."""
    value = (calibration or {}).get("head_topk_accuracy")
    if isinstance(value, list) and value and all(isinstance(row, list) and row for row in value):
        return [[float(x) for x in row] for row in value]
    return None


_WITHOUT_CALIBRATION = "or delete it to evaluate the tree without it"


def calibration_files(heads_dir: Path) -> list[Path]:
    """The calibration.json files eval reads, in order: beside the heads, then one folder up (an
    export's, for heads in its ``medusa/`` or ``vllm/``)."""
    return [p for p in (heads_dir / CALIBRATION, heads_dir.parent / CALIBRATION) if p.is_file()]


def stored_topk(heads_dir: Path) -> tuple[list[list[float]], Path] | None:
    """The head accuracy table ``(K, R)`` of the first of :func:`calibration_files` that has one, and
    that file; None when none has. Each file read is checked (:func:`read_calibration`): the files
    it reads include the one :func:`~medusa_train.stages.eval.fit_tree_to_device` reads, so a call
    before the backbone loads refuses a damaged one there.

    Raises:
        DamagedArtefactError: a calibration.json read is damaged.
    """
    for path in calibration_files(heads_dir):
        topk = calibration_topk(read_calibration(path))
        if topk:
            return topk, path
    return None


def read_calibration(path: Path) -> dict:
    """The calibration.json at ``path`` (stage=train's, or the copy an export ships), checked entry by
    entry as the export's card checks it (:func:`calibration_input`).

    Refused, as one that does not parse is: eval can neither say where the stored tree was fitted nor
    fit it again without the file, so going on would evaluate something else than asked, silently;
    deleting the file is how to evaluate the tree without it (as eval does where there is none). The
    repair named: stage=train for the heads' own, stage=export (after stage=train where the heads'
    own is damaged too) for an export's copy.

    Raises:
        DamagedArtefactError: unreadable, not valid JSON (not UTF-8, nested too deep), not an object,
            or an entry of the wrong type or missing; one line naming the file and the repair.
    """
    expected = calibration_input(path.parent)
    repair = f"{expected.repair}, {_WITHOUT_CALIBRATION}"
    calibration = read_json(path, repair=repair)
    problem = shape_problem(calibration, expected)
    if problem is not None:
        raise DamagedArtefactError(f"{path} is damaged ({problem}): {repair}")
    return calibration


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
