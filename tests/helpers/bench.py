"""GPU timing shared by the bench scripts (torch, and the tuner's queued timer).

``copy_bandwidth`` is the device's device-to-device copy speed, the floor every memory-bound figure is
compared with; ``time_queued`` is GPU time per call with the launches hidden: the calls are queued
behind a sleep kernel, so the host has launched them all before the first one starts (what a replayed
CUDA graph pays); ``report`` prints a script's table and writes its JSON.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from medusa_train.decoding.attention.triton_kernel import gpu_ms

SLEEP_CYCLES = 20_000_000
"""~10 ms of GPU sleep: longer than the host takes to queue the timed calls."""


def sync(device: torch.device) -> None:
    """Wait for ``device`` (nothing to wait for off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy of ``nbytes`` (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    reps = 10
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * reps / (time.perf_counter() - t0)


def time_queued(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Milliseconds of GPU time per ``fn()``: ``warmup`` untimed calls, then ``iters`` calls queued
    behind a sleep kernel between two CUDA events (CUDA only; the tuner's timing, with a sleep long
    enough for many calls)."""
    return gpu_ms(fn, reps=iters, warmup=warmup, sleep_cycles=SLEEP_CYCLES)


def report(results: dict, json_path: str | None) -> None:
    """Print a bench script's Markdown table (``results["table"]``) and write ``results`` as JSON to
    ``json_path`` (None: no file)."""
    print(results["table"])
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2) + "\n")
