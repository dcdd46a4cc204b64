"""`stage=all` end to end through the CLI, as `make demo` runs it (at debug=fast sizes).

Tracking stays on (offline) on purpose: wandb's settings are process-wide, and a stage that opens a
run after another stage's run must still stay offline and never ask for a login.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _run(workdir: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update({"WANDB_API_KEY": "", "HOME": str(workdir.parent)})  # no login anywhere
    cmd = [
        sys.executable,
        "-m",
        "medusa_train",
        "stage=all",
        "debug=fast",
        "tracking=offline",
        f"workdir={workdir}",
    ]
    return subprocess.run([*cmd, *extra], capture_output=True, text=True, env=env, timeout=600)


def test_stage_all_end_to_end_then_resume(tmp_path: Path) -> None:
    wd = tmp_path / "run"
    first = _run(wd)
    assert first.returncode == 0, first.stderr[-3000:]
    for path in (
        "pretrain/config.json",
        "pretrain/train_report.json",
        "distill/manifest.json",
        "heads/medusa_lm_head.safetensors",
        "heads/medusa_choices.json",
        "export/medusa/medusa_lm_head.safetensors",
        "export/vllm/config.json",
        "export/medusa_choices.json",
        "export/README.md",
        "eval/report.json",
        "eval/report.md",
        "eval/generations.jsonl",
    ):
        assert (wd / path).is_file(), path
    assert not (wd / "backbone").exists()  # the embedded model lives in pretrain/, nowhere else
    report = json.loads((wd / "eval" / "report.json").read_text())
    assert report["greedy_identical"] == 1.0
    assert report["tau"] >= 1.0
    lines = [json.loads(x) for x in (wd / "eval" / "generations.jsonl").read_text().splitlines()]
    assert sum(x["tokens"] for x in lines) / sum(x["steps"] for x in lines) == pytest.approx(report["tau"])
    assert "speed-up" in first.stdout  # the summary table ends the run
    # wandb wrote offline runs for the stages that track, and nothing asked for a login
    assert list((wd / "wandb").glob("offline-run-*")), "no offline wandb run"
    assert "API key" not in first.stderr

    # Running again resumes: every stage finds its output and the heads are not retrained.
    heads_before = (wd / "heads" / "medusa_lm_head.safetensors").read_bytes()
    second = _run(wd)
    assert second.returncode == 0, second.stderr[-3000:]
    assert (wd / "heads" / "medusa_lm_head.safetensors").read_bytes() == heads_before
    assert "already" in (second.stdout + second.stderr)
