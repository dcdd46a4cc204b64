"""Reading a distill folder back in the distill tests (in-process and server engines alike)."""

from __future__ import annotations

from pathlib import Path

from medusa_train.data.distilled import load_distilled


def rows(workdir: Path) -> list[tuple[str, list[int], list[int]]]:
    """``(source_id, input_ids, loss_mask)`` of every distilled record, in shard order."""
    ds = load_distilled(workdir / "distill")
    return list(zip(ds["source_id"], ds["input_ids"], ds["loss_mask"], strict=True))


def spans(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of every run of 1s."""
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out
