"""stage=pretrain on a tiny setting: a loadable HF model that learned, written atomically, skipped when done."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from medusa_train import __main__ as cli
from medusa_train.config import compose_config
from medusa_train.data.embedded import embedded_prompts
from medusa_train.errors import UserError
from medusa_train.stages import pretrain
from medusa_train.transformers4 import legacy_config_keys

TINY = [
    "stage=pretrain",
    "debug=fast",
    "pretrain.max_steps=40",
    "pretrain.warmup_steps=5",
    "pretrain.lr=1e-2",
    "pretrain.max_minutes=10",  # a ceiling only: 40 steps take ~20 s; a loaded machine must not cut them
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("pretrain")
    cfg = compose_config([*TINY, f"workdir={workdir}"])
    return cfg, pretrain.run(cfg)


def test_learns_and_loads(trained):
    cfg, report = trained
    out = cfg.model.name_or_path
    assert report["steps"] == 40 and not report.get("skipped")
    assert report["train_loss_last"] < report["train_loss_first"] - 0.5
    assert report["heldout_ppl"] < report["uniform_ppl"] / 3
    assert report["uniform_ppl"] == report["vocab_size"] == len(AutoTokenizer.from_pretrained(out))
    assert 0 < report["heldout_bits_per_byte"] < 8
    assert json.loads((Path(out) / "train_report.json").read_text()) == report

    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) == report["params"]
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert model.generation_config.pad_token_id == tok.pad_token_id
    conv = embedded_prompts("eval", 1, seed=0)[0]
    ids = tok.apply_chat_template(conv[:1], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out_ids = model.generate(**ids, max_new_tokens=5, do_sample=False)  # (1, P + new)
    assert out_ids.shape[1] > ids["input_ids"].shape[1]
    assert not list(Path(out).parent.glob(".pretrain.*")), "temp dirs left behind"


def test_written_for_transformers_4_consumers_too(trained):
    """A Medusa-1 export names workdir/pretrain as its base model, so its tokenizer and config
    carry what transformers 4.x reads (as the Medusa-2 export's backbone, tests/unit/test_formats.py)."""
    cfg, _ = trained
    out = Path(cfg.model.name_or_path)
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"  # not TokenizersBackend
    assert tokenizer_config["chat_template"] == (out / "chat_template.jinja").read_text()
    merges = json.loads((out / "tokenizer.json").read_text())["model"]["merges"]
    assert merges and all(isinstance(m, str) and m.count(" ") == 1 for m in merges)
    config = json.loads((out / "config.json").read_text())
    assert legacy_config_keys(config) == {}  # rope_theta, rope_scaling, torch_dtype at the top level
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]


def test_skip_if_done_and_overwrite(trained):
    cfg, report = trained
    weights = Path(cfg.model.name_or_path) / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    again = pretrain.run(cfg)
    assert again["skipped"] and again["heldout_ppl"] == report["heldout_ppl"]
    assert weights.stat().st_mtime_ns == mtime

    cfg2 = compose_config(
        [*TINY, f"workdir={Path(cfg.workdir)}", "pretrain.overwrite=true", "pretrain.max_steps=3"]
    )
    redone = pretrain.run(cfg2)
    assert not redone.get("skipped") and redone["steps"] == 3
    assert pretrain.is_complete(Path(cfg.model.name_or_path))


def test_other_settings_are_refused_not_reused(trained):
    """A complete model made with other settings is not taken for this run's (it would go on to be
    distilled and trained on as if it had them): refused, naming the setting, and left in place."""
    cfg, _ = trained
    weights = Path(cfg.model.name_or_path) / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    other = compose_config([*TINY, f"workdir={Path(cfg.workdir)}", "pretrain.hidden_size=48"])
    with pytest.raises(UserError, match=r"other settings: pretrain\.hidden_size \(64 -> 48\)"):
        pretrain.run(other)
    assert weights.stat().st_mtime_ns == mtime


def test_incomplete_dir_is_retrained(tmp_path):
    """A pretrain/ without its report (e.g. copied by hand, half-written) is not trusted. The report
    names the corpus it was trained on: the embedded one, whatever later stages read (`data=jsonl`)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    cfg = compose_config(
        [*TINY, f"workdir={tmp_path}", "pretrain.max_steps=2", "data=jsonl", f"data.path={prompts}"]
    )
    out = Path(cfg.model.name_or_path)
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    (tmp_path / ".pretrain.tmp-999999").mkdir()  # left by a killed run
    report = pretrain.run(cfg)
    assert not report.get("skipped") and pretrain.is_complete(out)
    assert report["data_format"] == "embedded"
    assert not (tmp_path / ".pretrain.tmp-999999").exists()


def test_text_format(tmp_path):
    lines = [
        f"Line {i}: the {w} sat on the mat and looked at the {w}.\n"
        for i in range(400)
        for w in ("cat", "dog")
    ]
    path = tmp_path / "tiny.txt"
    path.write_text("".join(lines))
    cfg = compose_config(
        [*TINY, f"workdir={tmp_path}", "data=text", f"data.path={path}", "pretrain.max_steps=20"]
    )
    report = pretrain.run(cfg)
    assert report["data_format"] == "text" and report["heldout_ppl"] < report["uniform_ppl"]
    assert "heldout_greedy_exact" not in report
    assert torch.isfinite(torch.tensor(report["heldout_loss"]))


def test_another_model_at_model_name_or_path_is_not_replaced(tmp_path, tiny_backbone_dir):
    """model=tiny with model.name_or_path naming a real model folder must not pretrain over it."""
    other = tmp_path / "my-model"
    other.mkdir()
    for f in tiny_backbone_dir.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    before = sorted((f.name, f.read_bytes()) for f in other.iterdir())
    cfg = compose_config([*TINY, f"workdir={tmp_path / 'run'}", f"model.name_or_path={other}"])
    with pytest.raises(UserError, match="holds files stage=pretrain did not write"):
        pretrain.run(cfg)
    assert sorted((f.name, f.read_bytes()) for f in other.iterdir()) == before


def test_text_format_drops_a_byte_order_mark(tmp_path):
    """A data=text file saved with a UTF-8 byte-order mark (Windows editors): pretrain's documents and
    tokenizer lines hold no U+FEFF, as the prompts distill reads from the same file do not."""
    path = tmp_path / "bom.txt"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(f"line {i} of the text\n" for i in range(400)).encode())
    train, heldout, lines = pretrain._text_documents(str(path), 0.1)
    assert train[0].startswith("line 0 ") and not any("\ufeff" in t for t in [*train, *heldout, *lines])


def test_text_format_not_utf8_is_one_line(tmp_path):
    """A data=text file in another encoding (Latin-1 here) is a user error, before any training."""
    path = tmp_path / "latin1.txt"
    path.write_bytes("café au lait\n".encode("latin-1") * 50)
    cfg = compose_config([*TINY, f"workdir={tmp_path}", "data=text", f"data.path={path}"])
    with pytest.raises(UserError, match="is not a UTF-8 text file"):
        pretrain.run(cfg)
    assert not (tmp_path / "pretrain").exists()


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_launch_of_several_processes_is_refused_before_any_work(tmp_path, monkeypatch, capsys, rank):
    """Under torchrun every rank would pretrain and publish workdir/pretrain at once: stage=pretrain,
    and stage=all with model=tiny, are one line and exit 2 on every rank, and nothing is written."""
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.setenv(key, "2" if key == "WORLD_SIZE" else rank)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # torchrun sets these with them
    monkeypatch.setenv("MASTER_PORT", "29500")
    for stage in ("pretrain", "all"):
        assert cli.main([f"stage={stage}", "debug=fast", "tracking=disabled", f"workdir={tmp_path}"]) == 2
        err = capsys.readouterr().err  # log lines aside: one error line, no traceback
        assert "Traceback" not in err and err.count("error: ") == 1, err
        line = err.split("error: ", 1)[1].split("\n", 1)[0]
        assert line.startswith(
            "stage=pretrain (also stage=all's first step with model=tiny) runs in one process"
        )
        assert "not the 2 of this launch" in line
    assert not (tmp_path / "pretrain").exists()
