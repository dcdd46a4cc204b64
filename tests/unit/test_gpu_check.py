"""scripts/gpu_check.sh, the one command for a GPU machine: it parses, documents itself and refuses a
bad option with one line (its full run needs a GPU, or minutes on a CPU: `--device cpu`)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_help_says_how_to_run_it():
    out = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "make gpu-wheels" in out.stdout and "--device cpu" in out.stdout


def test_an_unknown_option_is_one_line_and_exit_2(tmp_path):
    out = subprocess.run(
        ["bash", str(SCRIPT), "--devcie", "cuda", "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "--devcie" in out.stderr
    assert not (tmp_path / "out").exists()  # nothing written


def test_the_gpu_tests_step_runs_every_file_with_gpu_tests():
    """A gpu-marked test in a file the step does not name never runs on a GPU machine (the select list
    of the next GPU session names tests in five files)."""
    root = SCRIPT.parents[1]
    text = SCRIPT.read_text()
    listed = text[text.index("GPU_TEST_FILES=(") :].split(")", 1)[0].split()[1:]
    marked = {
        path.relative_to(root).as_posix()
        for path in (root / "tests").rglob("test_*.py")
        if re.search(r"pytest\.mark\.gpu\b", path.read_text())
    }
    covered = {f for f in marked if any(f == entry or f.startswith(entry + "/") for entry in listed)}
    assert marked and covered == marked, sorted(marked - covered)
    assert all((root / entry).exists() for entry in listed)
