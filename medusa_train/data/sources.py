"""Readers for every prompt/conversation source (`data.format`), all returning the same records.

A record is a :class:`Conversation`: the USER turns of one conversation in order (plus an optional
system prompt). The original assistant turns are discarded: self-distillation regenerates them with
the backbone, and evaluation decodes them. Every record carries a stable ``source_id``
(``"<file>:<line>"``, ``"<file>:<record>"`` for a JSON array, ``"embedded:<n>"`` or
``"<dataset>:<split>:<row>"``), which decides held-out membership downstream.

Formats:
    sharegpt   JSON array or JSONL of ``{"conversations": [{"from": ..., "value": ...}, ...]}``;
               ``from`` is human | user | gpt | assistant | chatgpt | bard | bing | model | system
               (the OpenAI style ``{"messages": [{"role", "content"}]}`` is read too).
    alpaca     JSON array or JSONL of ``{"instruction", "input", "output"}``: one turn,
               ``instruction`` followed by a blank line and ``input`` when ``input`` is not empty.
    mtbench    MT-bench ``question.jsonl``: ``{"question_id", "turns": [str, ...]}``.
    jsonl      one JSON object per line, the prompt under ``prompt_key`` (a string, or a list of
               strings for several user turns).
    text       a plain text file: prompts are consecutive chunks of about ``text_prompt_chars``
               characters, cut at line boundaries (a chunk closes at the first line end at or past
               the size; blank chunks are dropped). Lines end at ``"\\n"`` only (:func:`text_lines`).
    hub        any ``datasets.load_dataset(name, subset, split=...)`` dataset (or a directory written
               by ``Dataset.save_to_disk``), each row read as ``hub_format``.
    embedded   the embedded prompt set (``medusa_train.data.embedded.embedded_prompts``).

``path`` may be a file or a directory (its ``*.json``/``*.jsonl`` files, or ``*.txt`` for text, in
name order).

Bad input (each rule counted under its reason in :attr:`ReadResult.skipped`):
    * malformed JSON line (a syntax error, nesting too deep for the parser, an integer too long to
      convert), or a record that is not an object: skipped.
    * a turn that is not valid Unicode (a lone surrogate such as ``"\\ud800"``, which JSON allows but
      no tokenizer can encode): the record is skipped.
    * a record without the expected field (``conversations``, ``instruction``, ``turns``,
      ``prompt_key``), or with a non-string turn or an unknown role: skipped.
    * a conversation that starts with the assistant: the leading assistant turns are DROPPED and
      the rest is kept (ShareGPT dumps often open with a greeting by the assistant); the record is
      listed under ``"leading assistant turns dropped"`` in :attr:`ReadResult.repaired`.
    * an empty conversation (no non-blank user turn left): skipped.
    * consecutive user turns are joined with a blank line (their answers are regenerated anyway);
      a system message is kept only as the first message.
    * prompts longer than ``data.max_prompt_tokens`` are handled by the distill stage (it needs the
      tokenizer): skipped with a count, or left-truncated (``data.long_prompts=truncate``).

Non-strict (default): bad records are skipped, and :meth:`ReadResult.log_warning` emits ONE
warning with the count per reason and the first few line numbers. ``strict=True`` raises
:class:`~medusa_train.errors.UserError` naming the file and line of the first bad record. A missing
file, an unreadable file (not UTF-8, a JSON array that does not parse) or a source that yields no
record at all fails with a one-line UserError; callers read the source before loading any model.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from medusa_train.data.embedded import embedded_prompts
from medusa_train.errors import UserError

log = logging.getLogger(__name__)

FORMATS = ("embedded", "sharegpt", "alpaca", "mtbench", "jsonl", "text", "hub")
HUB_FORMATS = ("sharegpt", "alpaca", "mtbench", "jsonl")
USER_ROLES = ("human", "user")
ASSISTANT_ROLES = ("gpt", "assistant", "chatgpt", "bard", "bing", "model")
SYSTEM_ROLES = ("system",)
_SHOW_LINES = 5  # line numbers listed per reason in the warning
_JSONL_LINE_END = re.compile(r"\r\n|[\n\r\v\f\x1c\x1d\x1e]")
"""Where a JSONL line ends: the line breaks of ``str.splitlines`` that JSON forbids inside a string.
Not U+0085, U+2028 and U+2029, which a JSON string may hold as they are (``json.dumps`` with
``ensure_ascii=False`` writes them so): ``splitlines`` would cut such a record into two malformed lines."""


@dataclass
class Conversation:
    """One source record: the user turns to answer, in order.

    Attributes:
        source_id: stable id of the record (``"<file>:<line>"``, ``"embedded:<n>"``, ...).
        turns: the user messages; the assistant answers each one in turn.
        system: optional system prompt (sent as the first message).
    """

    source_id: str
    turns: list[str]
    system: str | None = None


@dataclass
class ReadResult:
    """Records read from a source plus what was skipped or repaired on the way.

    Attributes:
        records: the usable conversations, in source order.
        skipped: reason -> line (or record / row) numbers of skipped records, 1-based.
        repaired: reason -> line numbers of records that were kept after a documented fix.
        source: a short description of the source, for messages.
    """

    records: list[Conversation]
    skipped: dict[str, list[int]] = field(default_factory=dict)
    repaired: dict[str, list[int]] = field(default_factory=dict)
    source: str = ""

    @property
    def num_skipped(self) -> int:
        return sum(len(v) for v in self.skipped.values())

    def warning_text(self, strict_option: str | None = "data.strict") -> str | None:
        """One line summarising skipped and repaired records, or None when the source was clean; it
        ends naming ``strict_option`` (the setting that makes them errors), if the reader has one."""
        if not self.skipped and not self.repaired:
            return None
        parts = []
        for label, table in (("skipped", self.skipped), ("kept", self.repaired)):
            for reason, lines in table.items():
                shown = ", ".join(map(str, lines[:_SHOW_LINES])) + (
                    ", ..." if len(lines) > _SHOW_LINES else ""
                )
                parts.append(f"{label} {len(lines)} ({reason}; lines {shown})")
        hint = f" — {strict_option}=true makes these errors" if strict_option else ""
        return f"{self.source}: " + "; ".join(parts) + hint

    def log_warning(
        self, logger: logging.Logger | None = None, strict_option: str | None = "data.strict"
    ) -> None:
        """Emit :meth:`warning_text` as ONE warning (nothing when the source was clean)."""
        text = self.warning_text(strict_option)
        if text:
            (logger or log).warning(text)


class _Bad(Exception):
    """A record-level problem (reason text); skipped or raised depending on ``strict``."""


# ----------------------------------------------------------------------------------------------
# record parsers: one raw record (dict) -> (turns, system, repairs)


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise _Bad(f"{what} is not a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate ("\ud800" in JSON): no tokenizer can encode it
        raise _Bad(f"{what} is not valid Unicode (a lone surrogate)") from None
    return value


def _from_messages(messages: Any, role_key: str, text_key: str) -> tuple[list[str], str | None, list[str]]:
    """User turns + system prompt of a role-tagged message list (ShareGPT / OpenAI style)."""
    if not isinstance(messages, list):
        raise _Bad("conversation is not a list")
    turns: list[str] = []
    system: str | None = None
    repairs: list[str] = []
    last = None  # role of the previous kept message: "user" | "assistant"
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise _Bad("message is not an object")
        role = str(msg.get(role_key, "")).lower()
        text = _text(msg.get(text_key), f"message {text_key!r}")
        if role in SYSTEM_ROLES:
            if i == 0 and text.strip():
                system = text
            continue
        if role in ASSISTANT_ROLES:
            if last is None:
                if "leading assistant turns dropped" not in repairs:
                    repairs.append("leading assistant turns dropped")
                continue
            last = "assistant"
        elif role in USER_ROLES:
            if last == "user":
                turns[-1] = f"{turns[-1]}\n\n{text}"
            else:
                turns.append(text)
            last = "user"
        else:
            raise _Bad(f"unknown role {role!r}")
    return turns, system, repairs


def _parse_sharegpt(rec: dict) -> tuple[list[str], str | None, list[str]]:
    if "conversations" in rec:
        return _from_messages(rec["conversations"], "from", "value")
    if "messages" in rec:
        return _from_messages(rec["messages"], "role", "content")
    raise _Bad("no 'conversations' field")


def _parse_alpaca(rec: dict) -> tuple[list[str], str | None, list[str]]:
    if "instruction" not in rec:
        raise _Bad("no 'instruction' field")
    instruction = _text(rec["instruction"], "'instruction'")
    extra = rec.get("input") or ""
    extra = _text(extra, "'input'")
    prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    return [prompt], None, []


def _parse_mtbench(rec: dict) -> tuple[list[str], str | None, list[str]]:
    turns = rec.get("turns")
    if not isinstance(turns, list):
        raise _Bad("no 'turns' list")
    return [_text(t, "turn") for t in turns], None, []


def _make_jsonl_parser(prompt_key: str):
    def parse(rec: dict) -> tuple[list[str], str | None, list[str]]:
        if prompt_key not in rec:
            raise _Bad(f"no {prompt_key!r} field")
        value = rec[prompt_key]
        turns = value if isinstance(value, list) else [value]
        return [_text(t, f"{prompt_key!r}") for t in turns], None, []

    return parse


def _parser(fmt: str, prompt_key: str):
    if fmt == "sharegpt":
        return _parse_sharegpt
    if fmt == "alpaca":
        return _parse_alpaca
    if fmt == "mtbench":
        return _parse_mtbench
    return _make_jsonl_parser(prompt_key)


# ----------------------------------------------------------------------------------------------
# raw record iterators: yield (source_id, number, raw record or _Bad)


TEXT_SUFFIXES = (".txt", ".text", ".md")
"""The files ``data.format=text`` reads from a directory (every other format: ``.json``, ``.jsonl``)."""


def source_files(fmt: str, path: str | Path | None) -> list[Path]:
    """The files of the ``data.format=fmt`` source at ``data.path=path`` (a format read from files: not
    embedded or hub): the file itself, or the directory's files of the format's suffixes, sorted.
    The standard library only: the CLI checks a source with it before importing a stage.

    Raises:
        UserError: no path given, nothing at ``path``, or a directory without such files.
    """
    if not path:
        raise UserError(f"data.format={fmt} needs data.path=<file>")
    return _files(Path(path).expanduser(), TEXT_SUFFIXES if fmt == "text" else (".json", ".jsonl"))


def eval_prompts(
    fmt: str, path: str, prompt_key: str, num_prompts: int
) -> tuple[list[Conversation], ReadResult]:
    """The first ``num_prompts`` usable prompts of ``eval.path`` for ``eval.prompts=mtbench|jsonl`` (a
    record without a user turn is skipped), and what was read (for its warning). Eval reads them at its
    first step; the CLI reads them before any stage too, so that ``stage=all`` does not find a
    mistyped path, a wrong ``eval.prompt_key`` or a file of no usable prompt after training.

    Raises:
        UserError: a directory or nothing at ``path``, a file :func:`read_records` refuses, or no
            usable prompt in it.
    """
    file = Path(path).expanduser()  # as read_records reads it
    if file.is_dir():
        raise UserError(f"eval.path={path} is a directory: give the prompts file itself")
    if not file.is_file():
        raise UserError(f"eval.path={path} does not exist")
    result = read_records(
        fmt, path, prompt_key=prompt_key, max_records=num_prompts, options=("eval.prompts", "eval.prompt_key")
    )
    prompts = [r for r in result.records if r.turns][:num_prompts]
    if not prompts:
        raise UserError(f"no usable evaluation prompt in eval.prompts={fmt} {path}")
    return prompts, result


def _files(path: Path, suffixes: tuple[str, ...]) -> list[Path]:
    if not path.exists():
        raise UserError(f"data.path={path} does not exist")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in suffixes)
        if not files:
            raise UserError(f"data.path={path} is a directory without {' or '.join(suffixes)} files")
        return files
    return [path]


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")  # a UTF-8 byte-order mark (Windows editors) is dropped
    except UnicodeDecodeError:
        raise UserError(f"{path} is not a UTF-8 text file") from None
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror or err}") from None


def _iter_json_records(files: list[Path], root: Path) -> Iterator[tuple[str, int, Any]]:
    """JSON array files and JSONL files alike: ``(source_id, number, record | _Bad)``."""
    for file in files:
        name = file.name if file == root else str(file.relative_to(root))
        text = _read_text(file)
        if text.lstrip().startswith("["):
            try:
                items = json.loads(text)
            except ValueError as err:  # JSONDecodeError, or an integer too long to convert
                raise UserError(f"{file} starts like a JSON array but does not parse: {err}") from None
            except RecursionError:
                raise UserError(f"{file} starts like a JSON array but nests too deeply to parse") from None
            for i, item in enumerate(items, start=1):
                yield f"{name}:{i}", i, item
            continue
        for i, line in enumerate(_JSONL_LINE_END.split(text), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:  # JSONDecodeError, or an integer too long to convert
                record = _Bad("malformed JSON")
            except RecursionError:
                record = _Bad("JSON nested too deeply")
            yield f"{name}:{i}", i, record


def text_lines(text: str) -> list[str]:
    r"""The lines of a ``data=text`` file, each with its ``"\n"`` (the last one may have none).

    A line ends at ``"\n"`` only: the file is read with universal newlines, so ``"\r\n"`` and a lone
    ``"\r"`` arrive as ``"\n"``; form feeds, vertical tabs, ``\x1c``-``\x1e``, U+0085, U+2028 and
    U+2029, which ``str.splitlines`` would also cut at, stay inside their line (a page break or a
    paragraph separator is part of the text, and a source id's line number counts line ends only).
    ``stage=pretrain`` reads the same file with the same lines.
    """
    lines = text.split("\n")
    return [line + "\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])


def _text_chunks(text: str, size: int) -> Iterator[tuple[int, str]]:
    """Consecutive chunks of about ``size`` characters cut at line ends: ``(first line number, chunk)``."""
    chunk: list[str] = []
    length = 0
    start = 1
    for i, line in enumerate(text_lines(text), start=1):
        if not chunk:
            start = i
        chunk.append(line)
        length += len(line)
        if length >= size:
            yield start, "".join(chunk).rstrip("\n")
            chunk, length = [], 0
    if chunk:
        yield start, "".join(chunk).rstrip("\n")


def _load_hub(name: str, subset: str | None, split: str, data_files: str | None):
    """A ``datasets`` split: a ``save_to_disk`` directory, or anything ``load_dataset`` accepts."""
    import datasets  # here, not at the top: the CLI checks a source's files (source_files) before any stage

    local = Path(name).expanduser()
    try:
        if local.is_dir() and (
            (local / "dataset_info.json").is_file() or (local / "dataset_dict.json").is_file()
        ):
            ds = datasets.load_from_disk(str(local))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise UserError(f"{name} has no split {split!r} (it has {', '.join(ds)})")
                ds = ds[split]
            return ds
        return datasets.load_dataset(name, subset, split=split, data_files=data_files)
    except UserError:
        raise
    except Exception as err:  # network, missing dataset, bad config: one actionable line
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(
            f"could not load dataset data.name={name!r} (subset={subset}, split={split}): {first}"
        ) from None


# ----------------------------------------------------------------------------------------------
# public entry point


def read_records(
    fmt: str,
    path: str | Path | None,
    *,
    prompt_key: str = "prompt",
    text_prompt_chars: int = 400,
    strict: bool = False,
    name: str | None = None,
    subset: str | None = None,
    split: str = "train",
    hub_format: str = "sharegpt",
    max_records: int | None = None,
    num_prompts: int = 600,
    seed: int = 0,
    options: tuple[str, str] = ("data.format", "data.prompt_key"),
) -> ReadResult:
    """Read the user turns of every record of a source (see the module docstring for the rules).

    Args:
        fmt: embedded | sharegpt | alpaca | mtbench | jsonl | text | hub.
        path: file or directory (every format but embedded and hub; for hub, optional
            ``data_files`` passed to ``load_dataset``, e.g. ``name="json", path="x.jsonl"``).
        prompt_key: jsonl (and hub_format=jsonl): the field holding the prompt.
        text_prompt_chars: text: approximate prompt size, characters.
        strict: raise on the first bad record instead of skipping it.
        name: hub: dataset id for ``load_dataset``, or a ``save_to_disk`` directory.
        subset: hub: dataset configuration name.
        split: hub: split to read (also the split of a saved ``DatasetDict``).
        hub_format: hub: how each row is read: sharegpt | alpaca | mtbench | jsonl.
        max_records: keep at most this many good records (None = all).
        num_prompts: embedded: how many prompts of the train split.
        seed: embedded: stream seed.
        options: the config keys of the format and the prompt field, as error messages name them
            (eval's prompts: ``("eval.prompts", "eval.prompt_key")``).

    Returns:
        The records in source order with the skip / repair counts.

    Raises:
        UserError: unknown format, missing or unreadable file, no usable record, or (strict) a bad record.
    """
    if fmt not in FORMATS:
        raise UserError(f"data.format={fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt == "embedded":
        return _read_embedded(num_prompts, seed, max_records)
    if fmt == "hub":
        if not name:
            raise UserError("data.format=hub needs data.name=<dataset id or saved dataset directory>")
        if hub_format not in HUB_FORMATS:
            raise UserError(f"data.hub_format={hub_format!r} is not one of {', '.join(HUB_FORMATS)}")
        ds = _load_hub(name, subset, split, str(path) if path else None)
        raw = ((f"{name}:{split}:{i}", i + 1, row) for i, row in enumerate(ds))
        return _collect(
            raw, _parser(hub_format, prompt_key), f"dataset {name} ({split})", strict, max_records
        )
    files = source_files(fmt, path)
    root = Path(path).expanduser()
    if fmt == "text":
        if text_prompt_chars <= 0:
            raise UserError(f"data.text_prompt_chars={text_prompt_chars} must be > 0")

        def chunks() -> Iterator[tuple[str, int, Any]]:
            for file in files:
                fname = file.name if file == root else str(file.relative_to(root))
                for line, chunk in _text_chunks(_read_text(file), text_prompt_chars):
                    yield f"{fname}:{line}", line, {"prompt": chunk}

        return _collect(chunks(), _make_jsonl_parser("prompt"), str(root), strict, max_records)
    records = _iter_json_records(files, root)
    return _collect(records, _parser(fmt, prompt_key), str(root), strict, max_records, fmt, options)


_FORMAT_FIELDS = (
    ("conversations", "sharegpt"),
    ("messages", "sharegpt"),
    ("instruction", "alpaca"),
    ("turns", "mtbench"),
)
"""A record field that names the format it belongs to (the first one a record has wins)."""


def _format_hint(fmt: str, first: dict | None, options: tuple[str, str]) -> str:
    """What to set when no record of a ``fmt`` source was usable: the format its first record's fields
    name (an MT-bench file has ``turns``), else the field to take the prompt from."""
    format_key, prompt_key = options
    if first is not None:
        for field, guess in _FORMAT_FIELDS:
            if field in first and guess != fmt:
                if guess not in FORMAT_CHOICES.get(format_key, FORMATS):
                    break
                return f"its records have a {field!r} field, as {guess} files do: set {format_key}={guess}"
        if fmt == "jsonl" and first:
            fields = ", ".join(map(repr, list(first)[:6]))
            return f"set {prompt_key}= to the field that holds the prompt (its records have {fields})"
    return f"check {format_key} and the file"


FORMAT_CHOICES = {"eval.prompts": ("mtbench", "jsonl")}
"""The formats an option other than ``data.format`` accepts (a hint never suggests another)."""


def _collect(
    raw,
    parse,
    source: str,
    strict: bool,
    max_records: int | None,
    fmt: str = "",
    options: tuple[str, str] = ("data.format", "data.prompt_key"),
) -> ReadResult:
    """Parse raw records, applying the skip / repair rules; fail when nothing usable remains (naming
    ``options``, the config keys of the format and the prompt field, in the hint)."""
    result = ReadResult(records=[], source=source)
    first: dict | None = None  # the first record that is a JSON object, for the hint
    for source_id, number, rec in raw:
        if max_records is not None and len(result.records) >= max_records:
            break
        if first is None and isinstance(rec, dict):
            first = rec
        try:
            if isinstance(rec, _Bad):
                raise rec
            if not isinstance(rec, dict):
                raise _Bad("record is not a JSON object")
            turns, system, repairs = parse(rec)
            if not turns or any(not t.strip() for t in turns):
                raise _Bad(
                    "empty conversation"
                    if not turns or not any(t.strip() for t in turns)
                    else "empty user turn"
                )
        except _Bad as bad:
            if strict:
                raise UserError(f"{source}: record {source_id}: {bad} (data.strict=true)") from None
            result.skipped.setdefault(str(bad), []).append(number)
            continue
        for reason in repairs:
            if strict:
                raise UserError(f"{source}: record {source_id}: {reason} (data.strict=true)")
            result.repaired.setdefault(reason, []).append(number)
        result.records.append(Conversation(source_id=source_id, turns=turns, system=system))
    if not result.records:
        why = "; ".join(f"{len(v)} x {k}" for k, v in result.skipped.items()) or "it is empty"
        raise UserError(f"no usable record in {source} ({why}): {_format_hint(fmt, first, options)}")
    return result


def _read_embedded(num_prompts: int, seed: int, max_records: int | None) -> ReadResult:
    n = num_prompts if max_records is None else min(num_prompts, max_records)
    records = []
    for i, conv in enumerate(embedded_prompts("train", n, seed)):
        turns = [m["content"] for m in conv if m["role"] == "user"]
        system = next((m["content"] for m in conv[:1] if m["role"] == "system"), None)
        records.append(Conversation(source_id=f"embedded:{i}", turns=turns, system=system))
    if not records:
        raise UserError(f"data.num_prompts={num_prompts} selects no embedded prompt")
    return ReadResult(records=records, source="embedded prompts")
