"""Experiment tracking with wandb (`tracking.mode=online|offline|disabled`).

Offline is the default: runs are written under ``<workdir>/wandb`` and can be uploaded later with
``wandb sync``. Nothing here ever needs a login or the network unless the user asks for online.
Only the main process (rank 0) logs. wandb is imported lazily so the decoder and heads run
without it.

A stage that resumes its work (train from a checkpoint, distill from its shards) continues its wandb
run: ``<workdir>/wandb/<stage>-run.json`` holds the run's id and the last step it logged. wandb
cannot take back a step, so the steps up to that one, which the killed run logged already, are not
logged again (offline, each attempt is a folder of its own under the one id; ``wandb sync`` uploads
them in order).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import string
from pathlib import Path
from typing import TYPE_CHECKING, Any

from medusa_train import launch
from medusa_train.errors import UserError
from medusa_train.workdir import atomic_write_json

if TYPE_CHECKING:  # annotations only: config imports Hydra, which this module must not need
    from medusa_train.config import TrackingConfig

log = logging.getLogger(__name__)


class Tracker:
    """A thin wandb run: ``log(dict, step)``, ``define_axis``, ``summary(dict)``, ``finish()``; no-op when
    disabled.

    Used as a context manager (``with tracker:``) it finishes the run on the way out, as failed when
    an exception (a crash, Ctrl-C) leaves the block: wandb itself would only learn of it at interpreter
    exit, after the run was already closed as finished.
    """

    def __init__(
        self, run: Any | None, state: Path | None = None, run_id: str = "", logged: int = -1
    ) -> None:
        """``state``: the file holding ``run_id`` and the last step logged, ``logged`` (by an earlier
        attempt of the run when resumed; -1: none)."""
        self._run = run
        self._state, self._id = state, run_id
        self._resumed_after = self._last = logged

    @property
    def enabled(self) -> bool:
        return self._run is not None

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Log ``metrics`` at ``step`` (None: wandb's next); a step the run's killed attempt logged already
        is dropped."""
        if self._run is None or (step is not None and step <= self._resumed_after):
            return
        if step is not None and step > self._last and self._state is not None:
            # Recorded before wandb gets it: a kill in between loses this step's row, never repeats it.
            atomic_write_json(self._state, {"id": self._id, "step": step})
            self._last = step
        self._run.log(metrics, step=step)

    def define_axis(self, family: str, x: str) -> None:
        """Plot every metric ``<family>/*`` against ``<family>/<x>``, which each of their rows must hold,
        rather than against wandb's step (a row number for rows logged without a step: a table's rows,
        such as eval's tree sizes or batch sizes)."""
        if self._run is not None:
            self._run.define_metric(f"{family}/{x}")  # the axis on its own: the glob is what is plotted on it
            self._run.define_metric(f"{family}/*", step_metric=f"{family}/{x}")

    def summary(self, metrics: dict[str, Any]) -> None:
        if self._run is not None:
            for key, value in metrics.items():
                self._run.summary[key] = value

    def log_image(self, key: str, path: str | os.PathLike) -> None:
        if self._run is not None:
            import wandb

            self._run.log({key: wandb.Image(str(path))})

    def finish(self, failed: bool = False) -> None:
        """Close the run: ``failed`` marks it failed in wandb (exit code 1), else finished. Once only."""
        if self._run is not None:
            self._run.finish(exit_code=1 if failed else 0)
            self._run = None

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self.finish(failed=kind is not None)


def start_tracking(
    tracking_cfg: TrackingConfig,
    workdir: str | os.PathLike,
    stage: str,
    config: dict | None = None,
    resume: bool = False,
) -> Tracker:
    """Open a wandb run for ``stage`` (or a no-op tracker when disabled or not rank 0).

    Args:
        resume: the stage continues work a killed run of it began: continue that run (the one
            ``<workdir>/wandb/<stage>-run.json`` names, if any) rather than start another.

    Raises:
        UserError: wandb is not installed, or refused to start the run (online without ``wandb
            login``, no network to the server, a project name it does not take).
    """
    if tracking_cfg.mode == "disabled" or not launch.is_main():
        return Tracker(None)
    try:
        import wandb
    except ImportError as err:
        raise UserError(
            f"tracking.mode={tracking_cfg.mode}: wandb cannot be imported ({err}): `pip install wandb`, "
            "or pass tracking=disabled to log nothing"
        ) from None

    root = Path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    state = root / "wandb" / f"{stage}-run.json"
    previous = _previous_run(state) if resume else None
    run_id, logged = previous if previous else (_new_run_id(), -1)
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        run = wandb.init(
            project=tracking_cfg.project,
            entity=tracking_cfg.entity,
            name=tracking_cfg.run_name or f"{stage}-{root.resolve().name}",
            group=root.resolve().name,
            job_type=stage,
            mode=tracking_cfg.mode,
            dir=str(root),
            config=config,
            id=run_id,
            resume="allow" if previous else None,
            reinit="finish_previous",
        )
    except wandb.errors.Error as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(
            f"tracking.mode={tracking_cfg.mode}: wandb could not start a run ({first}); "
            "tracking=offline writes it under the workdir for `wandb sync` later, tracking=disabled logs nothing"
        ) from None
    state.parent.mkdir(exist_ok=True)
    atomic_write_json(state, {"id": run_id, "step": logged})  # a kill before the first log resumes it too
    return Tracker(run, state, run_id, logged)


def _new_run_id() -> str:
    """A fresh wandb run id (8 characters of wandb's alphabet, as wandb makes them)."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def _previous_run(state: Path) -> tuple[str, int] | None:
    """The run id and last logged step ``state`` holds, or None (no run to continue: none was started,
    or the file is damaged, when a new run starts)."""
    try:
        held = json.loads(state.read_text())
        run_id, step = held["id"], held["step"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as err:
        log.warning("tracking: %s is unreadable (%s): starting another wandb run", state, type(err).__name__)
        return None
    if not isinstance(run_id, str) or not run_id or not isinstance(step, int):
        log.warning("tracking: %s is damaged: starting another wandb run", state)
        return None
    return run_id, step
