"""scripts/fault_sweep.py: its classification and its leftover scan see what the pipeline leaves."""

from __future__ import annotations

import os
from pathlib import Path

from medusa_train.workdir import atomic_write, staging_dir
from tests.helpers.scripts import load_script

sweep = load_script("fault_sweep")


def test_leftover_scan_finds_the_temp_names_the_workdir_module_uses(tmp_path: Path) -> None:
    wd = tmp_path / "wd"
    (wd / "heads").mkdir(parents=True)
    (wd / "heads" / "config.json").write_text("{}")
    assert sweep.leftovers(wd) == []
    staged = staging_dir(wd / "export")  # a killed export's folder
    old = wd / f".eval.old-{os.getpid()}"  # a kill between publish_dir's two renames
    old.mkdir()
    names: list[Path] = []  # atomic_write's temp file, as a kill mid-write leaves it
    atomic_write(wd / "heads" / "config.json", lambda tmp: names.append(tmp) or tmp.write_text("{}"))
    names[0].write_text("{")
    half = str(names[0])
    assert sweep.leftovers(wd) == sorted([str(staged), str(old), half])


def test_outcomes_are_classified_by_exit_code_and_stderr() -> None:
    assert sweep.Run(0, "INFO done\n", "", 1.0).kind() == "ok"
    assert (
        sweep.Run(2, "INFO x\nerror: heads/config.json is damaged: run stage=train\n", "", 1.0).kind()
        == "refused"
    )
    assert (
        sweep.Run(1, 'Traceback (most recent call last):\n  File "x"\nValueError: y\n', "", 1).kind()
        == "traceback"
    )
    assert sweep.Run(2, "error: one\nerror: two\n", "", 1.0).kind() == "exit 2"  # two lines: not a refusal
    assert sweep.Run(-9, "", "", 1.0).kind() == "exit -9"


def test_every_case_has_a_unique_name_and_an_expectation(tmp_path: Path) -> None:
    base = tmp_path / "base"
    (base / "heads").mkdir(parents=True)
    (base / "heads" / "medusa_lm_head.safetensors").write_bytes(b"x")
    (base / "eval").mkdir()
    (base / "eval" / "report.json").write_text('{"tau": 2.0}')
    cases = sweep.cases(base, tmp_path / "cases")
    names = [c.name for c in cases]
    assert len(names) == len(set(names)) and len(names) >= 96
    assert {c.expect for c in cases} == {"ok", "refuse"}
    assert {c.group for c in cases} >= {
        "config",
        "data",
        "workdir",
        "artefact",
        "kill",
        "environment",
        "wrong",
        "server",
    }
    server = [c for c in cases if c.group == "server"]
    assert len(server) >= 7 and {c.expect for c in server} == {"ok", "refuse"}
    assert all(c.check is not None for c in server if c.expect == "ok")  # checked against a clean run


def test_the_stand_in_server_starts_answers_and_is_stopped() -> None:
    """The server cases' stand-in runs as its own process, serves the model, and run_case's stop ends it."""
    import json
    import urllib.request

    url = sweep.start_server()
    try:
        with urllib.request.urlopen(url + "/models", timeout=10) as resp:
            assert json.loads(resp.read())["data"][0]["id"] == "fake"
        (proc,) = sweep.SERVERS.values()
    finally:
        sweep.stop_servers()
    assert proc.poll() is not None and not sweep.SERVERS
