"""The distill tests' common parts (in-process and server engines alike): prompts, the overrides of a
small run, reading a distill folder back, and the CLI paused before it writes a given shard."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from medusa_train.config import compose_config
from medusa_train.data.distilled import load_distilled
from medusa_train.stages import distill

REPO = Path(__file__).resolve().parents[2]
MAX_NEW = 12
"""distill.max_new_tokens of the runs made with :func:`distill_overrides`."""
WORDS = "the cat dog sat on a mat tell me story about why how what is big small happy day night".split()


def write_prompts(path: Path, n: int = 10, seed: int = 0) -> Path:
    """Multi-turn JSONL prompts of varied lengths (so batches really pad)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        turns = [
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 14))) + "?" for _ in range(1 + i % 3)
        ]
        rows.append({"prompt": turns})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def distill_overrides(workdir: Path, backbone: Path, prompts: Path, *extra: str) -> list[str]:
    """stage=distill of ``prompts`` with ``backbone`` on the CPU: MAX_NEW tokens, batches of 4, shards of 3."""
    return [
        "stage=distill",
        f"workdir={workdir}",
        "model=hf",
        f"model.name_or_path={backbone}",
        "model.dtype=float32",
        "model.device=cpu",
        "tracking=disabled",
        "data=jsonl",
        f"data.path={prompts}",
        f"distill.max_new_tokens={MAX_NEW}",
        "distill.batch_size=4",
        "distill.shard_size=3",
        *extra,
    ]


def run_distill(workdir: Path, backbone: Path, prompts: Path, *extra: str) -> dict:
    """``distill.run`` in this process with :func:`distill_overrides`."""
    return distill.run(compose_config(distill_overrides(workdir, backbone, prompts, *extra)))


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


# The CLI, pausing before it writes shard number `pause_at` while a "hold" file exists (it touches a
# marker file first), so a kill lands at a known point: `pause_at` shards on disk, the next one
# generated but not written (a kill at any other moment leaves the same kind of state: finished shards
# only). argv: marker, hold, pause_at, then the overrides.
_PAUSING_CLI = """
import sys, time
from pathlib import Path
from medusa_train.__main__ import main
from medusa_train.stages import distill

real, written = distill.write_shard, []
marker, hold, pause_at = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])

def write_or_pause(path, rows, *extra):
    if len(written) == pause_at and hold.exists():
        marker.touch()
        deadline = time.time() + 600
        while hold.exists() and time.time() < deadline:
            time.sleep(0.05)
    real(path, rows, *extra)
    written.append(path)

distill.write_shard = write_or_pause
sys.exit(main(sys.argv[4:]))
"""


class PausingCLI:
    """``python -m medusa_train`` with ``overrides`` in a subprocess (stdout dropped, stderr piped) that
    pauses before writing shard ``pause_at`` until :meth:`go_on` (or a kill).

    Args:
        folder: where its marker (``<name>.paused``) and hold (``<name>.hold``) files go.
        name: names the two files, one pair per run.
        overrides: the CLI's arguments.
        env: the subprocess's environment.
        pause_at: shards written before the pause.
    """

    def __init__(self, folder: Path, name: str, overrides: list[str], env: dict, pause_at: int = 1) -> None:
        self.marker, self.hold = folder / f"{name}.paused", folder / f"{name}.hold"
        self.hold.touch()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _PAUSING_CLI, str(self.marker), str(self.hold), str(pause_at), *overrides],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    def wait_paused(self, timeout: float = 180.0) -> PausingCLI:
        """Wait until the run pauses; fails the test (with the run's stderr) when it ends or times out first."""
        deadline = time.time() + timeout
        while not self.marker.exists() and self.proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        if self.proc.poll() is None and self.marker.exists():
            return self
        self.proc.kill()
        _, err = self.proc.communicate()
        pytest.fail(f"the CLI did not pause: {err.decode()[-2000:]}")

    def go_on(self) -> None:
        """Let the paused run write its shard and carry on."""
        self.hold.unlink()

    def kill(self) -> None:
        """SIGKILL the run (paused: nothing of its next shard is written) and reap it."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.communicate()


def run_cli(overrides: list[str], env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m medusa_train`` with ``overrides`` to its end, from the repository (output as text)."""
    return subprocess.run(
        [sys.executable, "-m", "medusa_train", *overrides],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
