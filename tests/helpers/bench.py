"""GPU timing shared by the bench scripts (torch only).

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
    behind a sleep kernel between two CUDA events (CUDA only)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(SLEEP_CYCLES)  # the host queues every call below while the GPU sleeps
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def report(results: dict, json_path: str | None) -> None:
    """Print a bench script's Markdown table (``results["table"]``) and write ``results`` as JSON to
    ``json_path`` (None: no file)."""
    print(results["table"])
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2) + "\n")
