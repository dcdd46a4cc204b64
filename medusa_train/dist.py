"""The process group and the few collective operations the stages need.

The synchronisation points distill and train use, and a launched rank's end; what the launcher
tells the process (rank, world size) is read in :mod:`medusa_train.launch`, without torch. Everything
is a no-op in a single process, so a stage never branches on "am I distributed" itself. The process
group, where one is needed outside the HF Trainer, is gloo: the collectives here move small Python
objects (counts, settings), not tensors.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from datetime import timedelta
from typing import Any, NoReturn

import torch.distributed as tdist

from medusa_train import launch

COLLECTIVE_TIMEOUT = timedelta(days=7)
"""How long a rank waits at a collective (a barrier while rank 0 generates or builds a cache for hours)."""


def init_process_group(timeout: timedelta = COLLECTIVE_TIMEOUT) -> bool:
    """Create the gloo group when several ranks run and none exists; returns whether it was created.

    The default timeout is long on purpose: a rank can generate or train for hours before the next
    collective, which must not time out meanwhile.
    """
    if launch.world_size() <= 1 or tdist.is_initialized():
        return False
    tdist.init_process_group("gloo", timeout=timeout)
    return True


def destroy_process_group(created: bool) -> None:
    """Undo :func:`init_process_group` (only the group this process created)."""
    if created and tdist.is_initialized():
        tdist.destroy_process_group()


def leave() -> None:
    """End of a launched process: leave the process group a stage left (the Trainer's, under a launcher).

    Every rank calls it before the interpreter exits. A gloo group still alive at exit can abort the
    process ("terminate called without an active exception", SIGABRT) after its work succeeded, and
    the launcher then reports the whole run failed. Destroying it is local to this rank: a rank that
    finished early leaves while rank 0 goes on publishing.
    """
    if launch.launched() and tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()


def end_process(code: int) -> NoReturn:
    """End a launched rank whose stage is over: exit with ``code`` without tearing the interpreter down.

    Leaving the group (:func:`leave`) does not always stop gloo's threads: with torch 2.13, once
    ``torch._dynamo`` is imported after the group exists (the HF Trainer's DDP wrapper imports it),
    the group outlives ``destroy_process_group`` and its worker threads run until the interpreter's
    finalization, which now and then aborts the rank under them ("terminate called without an
    active exception", SIGABRT) after its work succeeded; the launcher then fails the whole run
    (seen once in CI, on a 2-rank training that had published everything). So a rank does what
    finalization would have done for it, in order: waits for its non-daemon threads, runs the
    ``atexit`` handlers (logging's flush, wandb's, temporary directories' clean-up), flushes its
    streams, and then leaves with ``os._exit``, which finalizes nothing more. Every file the
    stages write is closed (or atomically renamed) before this point.
    """
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # the interpreter's own exit step, run while it is still whole
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be said on it
            pass
    os._exit(code)


def _active() -> bool:
    return launch.world_size() > 1 and tdist.is_initialized()


def barrier() -> None:
    """Wait for every rank (no-op in one process)."""
    if _active():
        tdist.barrier()


def broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (any picklable object)."""
    if not _active():
        return value
    box = [value]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def gather(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank."""
    if not _active():
        return [value]
    boxes: list[Any] = [None] * launch.world_size()
    tdist.all_gather_object(boxes, value)
    return boxes
