"""Experiment tracking with wandb (`tracking.mode=online|offline|disabled`).

Offline is the default: runs are written under ``<workdir>/wandb`` and can be uploaded later with
``wandb sync``. Nothing here ever needs a login or the network unless the user asks for online.
Only the main process (rank 0) logs. wandb is imported lazily so the decoder and heads run
without it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from medusa_train import dist
from medusa_train.errors import UserError

if TYPE_CHECKING:  # annotations only: config imports Hydra, which this module must not need
    from medusa_train.config import TrackingConfig

log = logging.getLogger(__name__)


class Tracker:
    """A thin wandb run: ``log(dict, step)``, ``summary(dict)``, ``finish()``; no-op when disabled.

    Used as a context manager (``with tracker:``) it finishes the run on the way out, as failed when
    an exception (a crash, Ctrl-C) leaves the block: wandb itself would only learn of it at interpreter
    exit, after the run was already closed as finished.
    """

    def __init__(self, run: Any | None) -> None:
        self._run = run

    @property
    def enabled(self) -> bool:
        return self._run is not None

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        if self._run is not None:
            self._run.log(metrics, step=step)

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
    tracking_cfg: TrackingConfig, workdir: str | os.PathLike, stage: str, config: dict | None = None
) -> Tracker:
    """Open a wandb run for ``stage`` (or a no-op tracker when disabled or not rank 0).

    Raises:
        UserError: wandb is not installed, or refused to start the run (online without ``wandb
            login``, no network to the server, a project name it does not take).
    """
    if tracking_cfg.mode == "disabled" or not dist.is_main():
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
            reinit="finish_previous",
        )
    except wandb.errors.Error as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(
            f"tracking.mode={tracking_cfg.mode}: wandb could not start a run ({first}); "
            "tracking=offline writes it under the workdir for `wandb sync` later, tracking=disabled logs nothing"
        ) from None
    return Tracker(run)
