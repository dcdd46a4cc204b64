"""The export decodes through transformers' `model.generate(custom_generate=<export>, trust_remote_code=True)`:
greedy output identical to plain greedy `generate` (one prompt and a left-padded batch), sampling and
typical acceptance from the usual arguments, the static-shape decoder behind `cache_implementation="static"`,
the tree attention chosen by `medusa_attention`, and a one-line error for a base model the heads do not
belong to. A saved tiny Llama, loaded with `AutoModelForCausalLM.from_pretrained`, as a user would; the
returned cache (and going on from it) also on tiny random models with sliding-window, chunked and
KV-sharing layers, whose plain `generate` cache keeps a window's last tokens or none in those layers."""

from __future__ import annotations

import copy
import functools
import gc
import importlib.metadata
import inspect
import json
import logging
import re
import shutil
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    TextIteratorStreamer,
    masking_utils,
)
from transformers.generation.configuration_utils import CompileConfig
from transformers.generation.streamers import BaseStreamer

import medusa_train.decoding.attention as tree_attention_module
import medusa_train.decoding.attention.function as attention_function
from medusa_train.backbone import local_fingerprint
from medusa_train.card_inputs import CALIBRATION_INPUT, EXPORTED_CALIBRATION_INPUT
from medusa_train.custom_generate import _STATIC_ATTR as STATIC_ATTR
from medusa_train.custom_generate import (
    FOLDER,
    MAX_STATIC_DECODERS,
    MIN_TORCH,
    MIN_TRANSFORMERS,
    release,
    write_custom_generate,
)
from medusa_train.custom_generate import generate as generate_with_heads
from medusa_train.decoding.generate import PackedHeads
from medusa_train.errors import DamagedArtefactError
from medusa_train.formats import load_heads, save_medusa
from medusa_train.heads_layout import MEDUSA
from medusa_train.hf_compat import cache_keyword, output_cache_field
from medusa_train.stages import eval as eval_stage
from medusa_train.stages import export
from medusa_train.workdir import CHOICES, HEADS_WEIGHTS
from tests.helpers.models import random_heads, tiny_config, tiny_model
from tests.helpers.scripts import load_script
from tests.helpers.tiny_workdir import make_workdir, tiny_cfg
from tests.unit.decoding import test_decoding_architectures as architectures

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["the cat sat on", "why is the red sun a big happy moon"]  # the second reply is EOS at once


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny workdir whose heads record their base's checkpoint fingerprint (as stage=train does), exported."""
    root = make_workdir(tmp_path_factory.mktemp("custom_generate"))
    config_path = root / "heads" / "config.json"
    config = json.loads(config_path.read_text())
    config["backbone"]["fingerprint"] = local_fingerprint(str(root / "base_model"))
    config_path.write_text(json.dumps(config))
    export.run(tiny_cfg(root, "stage=export"))
    return root


@pytest.fixture(scope="module")
def model(workdir: Path):
    return AutoModelForCausalLM.from_pretrained(workdir / "base_model").eval()


@pytest.fixture(scope="module")
def tok(workdir: Path):
    tokenizer = AutoTokenizer.from_pretrained(workdir / "base_model")
    tokenizer.padding_side = "left"
    return tokenizer


def _medusa(model, export_dir: Path, **kwargs) -> torch.Tensor:
    return model.generate(**kwargs, custom_generate=str(export_dir), trust_remote_code=True)


def test_greedy_equals_plain_generate_for_a_prompt_and_a_batch(workdir: Path, model, tok) -> None:
    one = tok(PROMPTS[0], return_tensors="pt")
    ours = _medusa(model, workdir / "export", **one, max_new_tokens=30)
    assert torch.equal(ours, model.generate(**one, do_sample=False, max_new_tokens=30))
    assert ours.shape[1] == one["input_ids"].shape[1] + 30
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    ours = _medusa(model, workdir / "export", **batch, max_new_tokens=30)
    plain = model.generate(**batch, do_sample=False, max_new_tokens=30)
    assert torch.equal(ours, plain)  # prompts as given, the finished row padded with pad_token_id
    assert ours[1, batch["input_ids"].shape[1]] == tok.eos_token_id  # one row stopped at once
    # the model's generation_config decides what the call does not say (max_length 20 by default)
    assert torch.equal(_medusa(model, workdir / "export", **one), model.generate(**one, do_sample=False))


def test_a_max_length_that_leaves_no_room_is_refused_as_generate_refuses_it(
    workdir: Path, model, tok
) -> None:
    """max_length at or below the prompt's length (or, by default, a prompt that fills the model's
    positions) is a ValueError in plain generate: the same, not the prompt returned alone."""
    one = tok(PROMPTS[0], return_tensors="pt")
    width = one["input_ids"].shape[1]
    full = {"input_ids": one["input_ids"].repeat(1, 256 // width + 1)[:, :256]}  # the model's 256 positions
    for inputs, extra, length in (
        (one, {"max_length": width}, width),
        (one, {"max_length": 2}, 2),
        (full, {}, 256),
    ):
        wide = inputs["input_ids"].shape[1]
        message = rf"Input length of input_ids is {wide}, but `max_length` is set to {length}"
        with pytest.raises(ValueError, match=message):
            model.generate(**inputs, do_sample=False, **extra)
        for static in ({}, {"cache_implementation": "static"}):
            with pytest.raises(ValueError, match=message):
                _medusa(model, workdir / "export", **inputs, **extra, **static)
    one_more = {"max_length": width + 1}
    assert torch.equal(
        _medusa(model, workdir / "export", **one, **one_more), model.generate(**one, **one_more)
    )


def test_max_length_counts_the_padded_width_for_every_row_as_in_generate(workdir: Path, model, tok) -> None:
    """generate counts max_length against the batch's padded width, the default one (20 new tokens
    within the model's 256 positions) too: a short row of a left-padded batch near the positions'
    end gets as few new tokens as the longest row, not as many as its own length leaves room for."""
    ids = tok(PROMPTS[0], return_tensors="pt")["input_ids"]
    long = ids.repeat(1, 245 // ids.shape[1] + 1)[:, :245]  # 11 positions left: fewer than 20
    short = torch.cat([torch.full((1, 10), tok.pad_token_id), long[:, -235:]], dim=1)
    batch = {"input_ids": torch.cat([long, short]), "attention_mask": torch.ones(2, 245, dtype=torch.long)}
    batch["attention_mask"][1, :10] = 0
    for extra in ({}, {"max_length": 250}):
        plain = model.generate(**batch, do_sample=False, **extra)
        for static in ({}, {"cache_implementation": "static"}):
            ours = _medusa(model, workdir / "export", **batch, **extra, **static)
            assert torch.equal(ours, plain), (extra, static)
    release(model)


def test_a_batch_without_its_attention_mask_is_masked_as_generate_masks_it(workdir: Path, model, tok) -> None:
    """Without an attention_mask, generate masks every pad_token_id of the prompt (when it is no EOS
    token): the padding of a left-padded batch is not decoded as prompt tokens."""
    ids = tok(PROMPTS, return_tensors="pt", padding=True)["input_ids"]
    assert (ids[0] == tok.pad_token_id).any() and tok.pad_token_id != tok.eos_token_id
    plain = model.generate(ids, do_sample=False, max_new_tokens=20)
    for extra in ({}, {"cache_implementation": "static"}):
        assert torch.equal(
            _medusa(model, workdir / "export", input_ids=ids, max_new_tokens=20, **extra), plain
        )
    release(model)


def test_a_moved_export_is_found_from_the_custom_generate_argument(
    workdir: Path, model, tok, tmp_path
) -> None:
    """generate.py records where stage=export wrote the export; a copy elsewhere reads its own heads."""
    moved = tmp_path / "elsewhere"
    shutil.copytree(workdir / "export", moved)
    choices = json.loads((moved / "medusa_choices.json").read_text())
    (moved / "medusa_choices.json").write_text("not json")  # the copy is read, not the original
    one = tok(PROMPTS[0], return_tensors="pt")
    with pytest.raises(ValueError, match="cannot read a tree"):
        _medusa(model, moved, **one, max_new_tokens=8)
    (moved / "medusa_choices.json").write_text(json.dumps(choices[:1]))
    plain = model.generate(**one, do_sample=False, max_new_tokens=12)
    assert torch.equal(_medusa(model, moved, **one, max_new_tokens=12), plain)
    # medusa_heads= names the heads explicitly (an export or a layout folder)
    out = _medusa(model, moved, **one, max_new_tokens=12, medusa_heads=str(workdir / "export" / "vllm"))
    assert torch.equal(out, plain)


def test_an_export_written_again_into_the_same_folder_is_read_again(
    workdir: Path, model, tok, tmp_path, monkeypatch
) -> None:
    """A notebook's loop (train, export, generate, train again, export again into the same folder,
    generate): the second call decodes with the new heads and the new tree, not those the first call
    loaded, and the static decoder built for the first export is dropped."""
    import medusa_train.custom_generate as custom_generate

    model = copy.deepcopy(model)  # its own static decoders: the module-scoped model stays as it was
    root = tmp_path / "workdir"
    shutil.copytree(workdir, root, ignore=shutil.ignore_patterns("export"))
    export.run(tiny_cfg(root, "stage=export"))
    used = []  # (packed heads, tree) of each decode
    decode = custom_generate.medusa_generate

    def spy(model, packed, row, **kwargs):
        used.append((packed, kwargs["tree"]))
        return decode(model, packed, row, **kwargs)

    monkeypatch.setattr(custom_generate, "medusa_generate", spy)
    one = tok(PROMPTS[0], return_tensors="pt")
    plain = model.generate(**one, do_sample=False, max_new_tokens=12)
    for extra in ({}, {"cache_implementation": "static"}):
        assert torch.equal(_medusa(model, root / "export", **one, max_new_tokens=12, **extra), plain)
    (first_static,) = vars(model)[STATIC_ATTR].values()
    weights = root / "heads" / HEADS_WEIGHTS  # trained again: other weights
    state = load_file(weights)
    state = {name: t * 1.5 if name.endswith("linear.weight") else t for name, t in state.items()}
    save_file(state, str(weights), metadata={"format": "pt"})
    export.run(tiny_cfg(root, "stage=export", "tree=chain", "tree.chain_depth=2"))
    for extra in ({}, {"cache_implementation": "static"}):
        assert torch.equal(_medusa(model, root / "export", **one, max_new_tokens=12, **extra), plain)
    (static,) = vars(model)[STATIC_ATTR].values()
    assert static is not first_static and static.tree.num_nodes == 3
    (first, first_tree), (second, second_tree) = used
    new = PackedHeads(load_heads(root / "export"))
    assert torch.equal(second.w1t, new.w1t) and not torch.equal(first.w1t, new.w1t)
    assert (first_tree.num_nodes, second_tree.num_nodes) == (6, 3)  # the tree exported with them


def test_a_hub_export_is_fetched_with_the_arguments_its_code_was_loaded_with(
    workdir: Path, model, tok, monkeypatch
) -> None:
    """custom_generate=<Hub id>: transformers loads generate.py with the call's revision, token,
    local_files_only, proxies, repo_type, ... and passes them on; the heads and the tree are fetched with
    them too (the same revision as the code); a local export takes them and has no use for them. Stood
    in for without a network: the export on disk is the repository."""
    import huggingface_hub

    import medusa_train.custom_generate as custom_generate

    model = copy.deepcopy(model)  # its load_custom_generate replaced: the module-scoped model stays as it was
    code = model.load_custom_generate(str(workdir / "export"), trust_remote_code=True)
    loaded = []

    def load_custom_generate(repo: str, **kwargs):
        loaded.append(kwargs)
        return code

    monkeypatch.setattr(model, "load_custom_generate", load_custom_generate)
    fetched = []

    def snapshot_download(repo_id: str, **kwargs) -> str:
        fetched.append((repo_id, kwargs))
        return str(workdir / "export")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    custom_generate._hub_snapshot.cache_clear()
    one = tok(PROMPTS[0], return_tensors="pt")
    hub = dict(
        revision="v1",
        token="hf_test",
        local_files_only=True,
        proxies={"https": "http://proxy.example:3128"},
        repo_type="model",
    )
    plain = model.generate(**one, do_sample=False, max_new_tokens=8)
    out = model.generate(
        **one, max_new_tokens=8, custom_generate="acme/medusa-export", trust_remote_code=True, **hub
    )
    assert torch.equal(out, plain)
    ((repo_id, kwargs),) = fetched
    assert repo_id == "acme/medusa-export" and {name: kwargs.get(name) for name in hub} == hub
    assert "calibration.json" in kwargs["allow_patterns"]  # the tree's attention is decided from it
    assert {name: loaded[0].get(name) for name in hub} == hub  # as transformers loaded generate.py
    assert torch.equal(_medusa(model, workdir / "export", **one, max_new_tokens=8, **hub), plain)
    assert len(fetched) == 1  # a local export: nothing fetched
    for _ in range(2):  # force_download: fetched on every call, as transformers fetches generate.py again
        model.generate(**one, max_new_tokens=2, custom_generate="acme/medusa-export", force_download=True)
    assert len(fetched) == 3 and fetched[-1][1]["force_download"] is True
    custom_generate._hub_snapshot.cache_clear()


def test_sampling_and_typical_acceptance_run_from_the_usual_arguments(workdir: Path, model, tok) -> None:
    one = tok(PROMPTS[0], return_tensors="pt")
    width = one["input_ids"].shape[1]
    torch.manual_seed(0)
    sampled = _medusa(
        model, workdir / "export", **one, max_new_tokens=12, do_sample=True, temperature=0.8, top_p=0.9
    )
    torch.manual_seed(0)
    again = _medusa(
        model, workdir / "export", **one, max_new_tokens=12, do_sample=True, temperature=0.8, top_p=0.9
    )
    assert torch.equal(sampled, again) and torch.equal(sampled[:, :width], one["input_ids"])
    assert sampled.shape[1] <= width + 12
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    typical = _medusa(
        model, workdir / "export", **batch, max_new_tokens=12, do_sample=True, medusa_acceptance="typical"
    )
    assert typical.shape[0] == 2 and torch.equal(
        typical[:, : batch["input_ids"].shape[1]], batch["input_ids"]
    )
    # top_k and min_p are applied: top_k=1 or min_p=1 leaves one token, so sampling is greedy (dynamic
    # and static decoders)
    for extra in ({}, {"cache_implementation": "static"}):
        for one_token in ({"top_k": 1}, {"min_p": 1.0}):
            out = _medusa(
                model, workdir / "export", **one, max_new_tokens=12, do_sample=True, **one_token, **extra
            )
            assert torch.equal(out, model.generate(**one, do_sample=False, max_new_tokens=12)), (
                extra,
                one_token,
            )
    release(model)
    out = _medusa(model, workdir / "export", **one, max_new_tokens=5, return_dict_in_generate=True)
    assert torch.equal(out.sequences, model.generate(**one, do_sample=False, max_new_tokens=5))


def test_sampling_settings_given_as_none_are_off_as_in_generate(
    workdir: Path, model, tok, monkeypatch
) -> None:
    """temperature=None, top_p=None, top_k=None passed to generate override the model's generation config
    and turn that warper off (generate adds no processor for a None): the draws of temperature 1, top_p 1,
    top_k 0."""
    one = tok(PROMPTS[0], return_tensors="pt")
    monkeypatch.setattr(model.generation_config, "temperature", 0.5)
    monkeypatch.setattr(model.generation_config, "top_p", 0.8)
    off, unset = dict(temperature=1.0, top_p=1.0, top_k=0), dict(temperature=None, top_p=None, top_k=None)

    def draw(decode, **settings) -> torch.Tensor:
        torch.manual_seed(0)
        return decode(**one, max_new_tokens=12, do_sample=True, **settings)

    assert torch.equal(draw(model.generate, **unset), draw(model.generate, **off))  # what generate does
    for extra in ({}, {"cache_implementation": "static"}):
        medusa = functools.partial(_medusa, model, workdir / "export", **extra)
        assert torch.equal(draw(medusa, **unset), draw(medusa, **off)), extra
    release(model)


def _rows_match_their_own_generate(model, tok, export: Path, max_new_tokens: int, **settings) -> None:
    """A left-padded batch of PROMPTS through the export, static and dynamic: each row equals its own
    (unpadded) generate with the same settings (generate's batch would count the padding: penalised
    tokens, min_length), then padding."""
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    width = batch["input_ids"].shape[1]
    for extra in ({}, {"cache_implementation": "static"}):
        out = _medusa(model, export, **batch, max_new_tokens=max_new_tokens, **settings, **extra)
        for i, text in enumerate(PROMPTS):
            alone = tok(text, return_tensors="pt")
            ref = model.generate(**alone, do_sample=False, max_new_tokens=max_new_tokens, **settings)
            ref = ref[0, alone["input_ids"].shape[1] :].tolist()
            row = out[i, width:].tolist()
            assert row[: len(ref)] == ref and all(t == tok.pad_token_id for t in row[len(ref) :]), (i, extra)


def test_generate_settings_apply_as_in_generate(workdir: Path, model, tok, caplog, monkeypatch) -> None:
    """The repetition penalty and the minimum length as generate applies them; settings that change the
    output and that Medusa decoding does not apply refused (from the call or the model's generation
    config), outputs it does not return named in a warning."""
    one = tok(PROMPTS[0], return_tensors="pt")
    plain = model.generate(**one, do_sample=False, max_new_tokens=30, repetition_penalty=1.3)
    assert not torch.equal(plain, model.generate(**one, do_sample=False, max_new_tokens=30))
    with caplog.at_level(logging.WARNING):
        for extra in ({}, {"cache_implementation": "static"}):
            out = _medusa(
                model, workdir / "export", **one, max_new_tokens=30, repetition_penalty=1.3, **extra
            )
            assert torch.equal(out, plain), extra
    assert "does not apply" not in caplog.text
    _rows_match_their_own_generate(model, tok, workdir / "export", 30, repetition_penalty=0.8)
    # a minimum length: the row whose reply is EOS at once writes 6 tokens first, as its generate does
    assert model.generate(**tok(PROMPTS[1], return_tensors="pt"), max_new_tokens=4)[0, -1] == tok.eos_token_id
    _rows_match_their_own_generate(model, tok, workdir / "export", 12, min_new_tokens=6)
    # a setting that changes the output and that Medusa decoding does not apply is refused, naming the
    # value that turns it off
    with pytest.raises(ValueError, match=r"not apply bad_words_ids=\[\[5\]\]: pass bad_words_ids=None"):
        _medusa(model, workdir / "export", **one, max_new_tokens=4, bad_words_ids=[[5]])
    with pytest.raises(ValueError, match=r"not apply stop_strings=\['x'\]: pass stop_strings=None"):
        _medusa(model, workdir / "export", **one, max_new_tokens=4, stop_strings=["x"], tokenizer=tok)
    with monkeypatch.context() as patched:  # set by the model's generation config: its default overrides it
        patched.setattr(model.generation_config, "no_repeat_ngram_size", 7)
        with pytest.raises(ValueError, match="not apply no_repeat_ngram_size=7: pass no_repeat_ngram_size=0"):
            _medusa(model, workdir / "export", **one, max_new_tokens=4)
        off = dict(max_new_tokens=8, no_repeat_ngram_size=0)
        out = _medusa(model, workdir / "export", **one, **off)
        assert torch.equal(out, model.generate(**one, do_sample=False, **off))
    with caplog.at_level(logging.WARNING):  # outputs besides the sequences: named, left None
        out = _medusa(
            model,
            workdir / "export",
            **one,
            max_new_tokens=4,
            return_dict_in_generate=True,
            output_scores=True,
        )
    assert (
        out.scores is None
        and "returns the sequences and the cache only, not output_scores=True" in caplog.text
    )
    # attentions and hidden states, like scores: the sequences of plain generate, those fields named
    more = dict(output_attentions=True, output_hidden_states=True)
    out = _medusa(model, workdir / "export", **one, max_new_tokens=4, **more)
    assert torch.equal(out, model.generate(**one, do_sample=False, max_new_tokens=4))
    with caplog.at_level(logging.WARNING):
        out = _medusa(
            model, workdir / "export", **one, max_new_tokens=4, return_dict_in_generate=True, **more
        )
    assert out.attentions is None and out.hidden_states is None
    assert "not output_attentions=True, output_hidden_states=True: those fields are None" in caplog.text


def test_model_arguments_given_as_none_are_no_arguments_as_in_generate(workdir: Path, model, tok) -> None:
    """generate takes model arguments given as None (past_key_values=None, ...) as not given: so does
    Medusa decoding; one with a value is still refused, naming it."""
    one = tok(PROMPTS[0], return_tensors="pt")
    none = dict(past_key_values=None, position_ids=None, token_type_ids=None)
    plain = model.generate(**one, do_sample=False, max_new_tokens=8, **none)
    assert torch.equal(_medusa(model, workdir / "export", **one, max_new_tokens=8, **none), plain)
    with pytest.raises(ValueError, match=r"attention_mask and past_key_values only, not \['position_ids'\]"):
        positions = torch.arange(one["input_ids"].shape[1])[None]  # (1, T)
        _medusa(model, workdir / "export", **one, max_new_tokens=8, position_ids=positions)


def test_eos_given_in_any_form_generate_takes_stops_as_in_generate(workdir: Path, model, tok) -> None:
    """eos_token_id as an int, a list, a 0-d or 1-d tensor or a numpy integer: what generate accepts,
    the same output as generate's (a numpy integer was a TypeError)."""
    one = tok(PROMPTS[0], return_tensors="pt")
    eos = int(model.generate(**one, do_sample=False, max_new_tokens=8)[0, one["input_ids"].shape[1] + 3])
    plain = model.generate(**one, do_sample=False, max_new_tokens=30, eos_token_id=eos)
    assert plain.shape[1] == one["input_ids"].shape[1] + 4  # stopped at that token
    for given in (eos, [eos], torch.tensor(eos), torch.tensor([tok.eos_token_id, eos]), np.int64(eos)):
        for extra in ({}, {"cache_implementation": "static"}):
            ours = _medusa(model, workdir / "export", **one, max_new_tokens=30, eos_token_id=given, **extra)
            assert torch.equal(ours, plain), (given, extra)
    release(model)


def test_static_cache_decodes_with_the_static_decoder_kept_on_the_model(workdir: Path, model, tok) -> None:
    """cache_implementation="static" (as for plain generate's static cache) runs the static-shape
    decoder: greedy identical to plain generate, typical identical to the dynamic decoder's; one decoder
    per kind of call is kept on the model, grown when a call needs more room, dropped by a copy of the
    model and by release()."""
    model = copy.deepcopy(model)  # its own decoders: the module-scoped model stays as it was
    one = tok(PROMPTS[0], return_tensors="pt")
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    plain = model.generate(**one, do_sample=False, max_new_tokens=30)
    assert torch.equal(
        _medusa(model, workdir / "export", **one, max_new_tokens=30, cache_implementation="static"), plain
    )
    kept = vars(model)[STATIC_ATTR]
    (first,) = kept.values()
    assert (first.capture, first.batch_size, first.capacity) == ("eager", 1, 256)  # CPU: no compile asked
    again = _medusa(model, workdir / "export", **one, max_new_tokens=12, cache_implementation="static")
    assert torch.equal(again, plain[:, : one["input_ids"].shape[1] + 12])
    assert list(kept.values()) == [first]  # reused, not rebuilt
    # a call of 400 new tokens needs the prompt + 400 + the tree's 6 nodes (root included), past the
    # model's 256 positions as plain generate goes past them: a larger decoder replaces it
    long_plain = model.generate(**one, do_sample=False, max_new_tokens=400)
    long_ours = _medusa(model, workdir / "export", **one, max_new_tokens=400, cache_implementation="static")
    assert torch.equal(long_ours, long_plain)  # (the reply ends at an EOS; the room was for 400 tokens)
    (grown,) = kept.values()
    assert grown is not first and grown.capacity == 512  # the next power of two
    # a left-padded batch: its own decoder of 2 rows, each row exact
    plain_batch = model.generate(**batch, do_sample=False, max_new_tokens=30)
    ours = _medusa(model, workdir / "export", **batch, max_new_tokens=30, cache_implementation="static")
    assert torch.equal(ours, plain_batch) and sorted(d.batch_size for d in kept.values()) == [1, 2]
    two_rows = next(d for d in kept.values() if d.batch_size == 2)
    # typical acceptance: the same tokens as the dynamic decoders
    typical = dict(max_new_tokens=20, do_sample=True, medusa_acceptance="typical")
    assert torch.equal(
        _medusa(model, workdir / "export", **batch, **typical, cache_implementation="static"),
        _medusa(model, workdir / "export", **batch, **typical),
    )
    # sampling: drawn inside the static step (its distribution: test_decoding_sampling), a seed repeats it
    sample = dict(
        max_new_tokens=12, do_sample=True, temperature=0.8, top_p=0.9, cache_implementation="static"
    )
    torch.manual_seed(0)
    sampled = _medusa(model, workdir / "export", **one, **sample)
    torch.manual_seed(0)
    assert torch.equal(sampled, _medusa(model, workdir / "export", **one, **sample))
    assert torch.equal(sampled[:, : one["input_ids"].shape[1]], one["input_ids"])
    assert not torch.equal(sampled, plain[:, : sampled.shape[1]])  # drawn, not the greedy reply
    assert len(kept) == 4  # greedy 1 row, 2 rows, typical 2 rows, sampling 1 row
    del kept[next(k for k in kept if k[5] == "sample")]
    # compiled as transformers compiles a static-cache generate off accelerators: when told to
    compile_all = CompileConfig(mode="default")
    compile_all._compile_all_devices = True
    compiled = _medusa(
        model,
        workdir / "export",
        **one,
        max_new_tokens=30,
        cache_implementation="static",
        compile_config=compile_all,
    )
    assert torch.equal(compiled, plain) and "compile" in {d.capture for d in kept.values()}
    assert len(vars(copy.deepcopy(model))[STATIC_ATTR]) == 0  # a copy starts without the captures
    # at most MAX_STATIC_DECODERS kinds of call are kept: a new kind drops the least recently used
    assert len(kept) == MAX_STATIC_DECODERS == 4  # greedy 1 row, 2 rows, typical 2 rows, compiled
    _medusa(model, workdir / "export", **one, max_new_tokens=8, cache_implementation="static")  # used again
    _medusa(
        model,
        workdir / "export",
        **one,
        max_new_tokens=8,
        cache_implementation="static",
        medusa_choices=[[0]],
    )
    assert len(kept) == 4 and grown in kept.values() and two_rows not in kept.values()
    # cast (or moved), the model gets heads and a decoder to match, and the old decoders are dropped
    model.to(torch.float64)
    cast = _medusa(model, workdir / "export", **one, max_new_tokens=30, cache_implementation="static")
    assert torch.equal(cast, model.generate(**one, do_sample=False, max_new_tokens=30))
    assert [d.dtype for d in kept.values()] == [torch.float64]
    model.to(torch.float32)
    release(model)
    assert STATIC_ATTR not in vars(model)


def test_release_frees_the_heads_and_the_static_decoders_kept_for_the_model(
    workdir: Path, model, tok
) -> None:
    """release(model) drops everything generate keeps for the model (the packed heads and the static
    decoders with their KV caches): nothing of it stays alive; the next call loads them again."""
    model = copy.deepcopy(model)  # its own heads and decoders: the module-scoped model stays as it was
    one = tok(PROMPTS[0], return_tensors="pt")
    plain = model.generate(**one, do_sample=False, max_new_tokens=8)
    _medusa(model, workdir / "export", **one, max_new_tokens=8)
    _medusa(model, workdir / "export", **one, max_new_tokens=8, cache_implementation="static")
    (decoder,) = vars(model)[STATIC_ATTR].values()
    kept = [weakref.ref(decoder), weakref.ref(decoder.packed.w1t)]
    del decoder
    release(model)
    gc.collect()
    assert [ref() for ref in kept] == [None, None]
    assert torch.equal(_medusa(model, workdir / "export", **one, max_new_tokens=8), plain)


class Collect(BaseStreamer):
    """What generate's streamer protocol hands over: each put's ids, and whether end() came."""

    def __init__(self) -> None:
        self.puts: list[list[int]] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.reshape(-1).tolist())

    def end(self) -> None:
        self.ended = True


def test_a_streamer_gets_the_prompt_then_each_steps_tokens(workdir: Path, model, tok) -> None:
    one = tok(PROMPTS[0], return_tensors="pt")
    plain = Collect()
    expected = model.generate(**one, do_sample=False, max_new_tokens=24, streamer=plain)
    for extra in ({}, {"cache_implementation": "static"}):
        ours = Collect()
        out = _medusa(model, workdir / "export", **one, max_new_tokens=24, streamer=ours, **extra)
        assert torch.equal(out, expected) and ours.ended, extra
        assert ours.puts[0] == plain.puts[0] == one["input_ids"][0].tolist()  # the prompt first
        assert sum(ours.puts[1:], []) == out[0, one["input_ids"].shape[1] :].tolist()
    eos_at_once = Collect()  # the second prompt's reply is EOS at once: streamed, then end()
    out = _medusa(model, workdir / "export", **tok(PROMPTS[1], return_tensors="pt"), streamer=eos_at_once)
    assert eos_at_once.puts[1:] == [[tok.eos_token_id]] and eos_at_once.ended
    text = TextIteratorStreamer(tok, skip_prompt=True)
    out = _medusa(model, workdir / "export", **one, max_new_tokens=24, streamer=text)
    assert "".join(text) == tok.decode(out[0, one["input_ids"].shape[1] :])
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    with pytest.raises(ValueError, match="a streamer takes one prompt"):
        _medusa(model, workdir / "export", **batch, max_new_tokens=4, streamer=Collect())
    release(model)


def test_calls_on_one_model_from_two_threads_run_one_after_the_other(workdir: Path, model, tok) -> None:
    """A call keeps its heads, tree and static decoders on the model and switches the model's attention
    around its forwards: while a first call is held inside (its streamer blocks), a second call on the
    same model from another thread runs no forward; one on another model runs; released, all three give
    what one call gives alone."""
    import threading

    one = tok(PROMPTS[0], return_tensors="pt")
    alone = _medusa(model, workdir / "export", **one, max_new_tokens=8)
    other = AutoModelForCausalLM.from_pretrained(workdir / "base_model").eval()
    inside, let_go, forwarded = threading.Event(), threading.Event(), threading.Event()

    class Hold(BaseStreamer):
        def put(self, value: torch.Tensor) -> None:
            inside.set()
            assert let_go.wait(30)

        def end(self) -> None:
            pass

    results = {}

    def call(name: str, m, **extra) -> None:
        results[name] = _medusa(m, workdir / "export", **one, max_new_tokens=8, **extra)

    first = threading.Thread(target=call, args=("first", model), kwargs={"streamer": Hold()})
    second = threading.Thread(target=call, args=("second", model))
    first.start()
    assert inside.wait(30)
    hook = model.register_forward_hook(lambda *_: forwarded.set())
    try:
        second.start()
        call("other", other)  # another model: not held up
        assert not forwarded.wait(2.0)  # the same model: no forward while the first call is inside
    finally:
        let_go.set()
        first.join(60)
        second.join(60)
        hook.remove()
    assert all(torch.equal(results[name], alone) for name in ("first", "second", "other"))


def test_tree_attention_is_chosen_with_medusa_attention(workdir: Path, model, tok, monkeypatch) -> None:
    one = tok(PROMPTS[0], return_tensors="pt")
    plain = model.generate(**one, do_sample=False, max_new_tokens=16)
    calls = []
    kernel = attention_function.triton_tree_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(attention_function, "triton_tree_attention", counted)
    # the Triton kernel (triton's interpreter on a CPU), eagerly and in the static decoder; auto: sdpa here
    for extra in ({}, {"cache_implementation": "static"}):
        for attention, runs_kernel in (("triton", True), ("auto", False)):
            calls.clear()
            out = _medusa(
                model, workdir / "export", **one, max_new_tokens=16, medusa_attention=attention, **extra
            )
            assert torch.equal(out, plain), (attention, extra)
            assert bool(calls) == runs_kernel, (attention, extra)
    with pytest.raises(
        ValueError, match="medusa_attention must be one of .*'sdpa', 'triton', 'cuda', 'auto'"
    ):
        _medusa(model, workdir / "export", **one, max_new_tokens=4, medusa_attention="flash")
    release(model)


def _calibrated_export(
    workdir: Path,
    root: Path,
    attention: str,
    context: int,
    nodes: int | None = None,
    choices: list[list[int]] | None = None,
) -> Path:
    """A copy of the export whose calibration.json says its tree (of ``nodes`` nodes; None: the
    export's tree's; with ``choices``, these paths) was timed with ``attention`` at ``context`` cached
    tokens on a GPU."""
    export_dir = root / "export"
    shutil.copytree(workdir / "export", export_dir)
    if nodes is None:
        nodes = len(json.loads((export_dir / "medusa_choices.json").read_text()))
    label = {"device": "NVIDIA H100 80GB HBM3", "dtype": "bfloat16", "attention": attention}
    calibration = {"tree": {"calibrated_for": label, "context_len": context, "best": {"nodes": nodes}}}
    if choices is not None:
        calibration["tree"]["choices"] = choices
    (export_dir / "calibration.json").write_text(json.dumps(calibration))
    return export_dir


def test_the_default_attention_is_the_one_the_exported_tree_was_calibrated_with(
    workdir: Path, model, tok, tmp_path, monkeypatch
) -> None:
    """medusa_attention unset: the export's calibration.json is read with its tree, and every decoder
    (one row, a batch, the static one) decodes with the attention decided from it; on a CPU that is
    auto (SDPA), also for a tree timed with the Triton kernel (triton's interpreter runs here, but a
    kernel is the default on a CUDA device only)."""
    import medusa_train.custom_generate as custom_generate

    export_dir = _calibrated_export(workdir, tmp_path, "triton", 256)
    decide = custom_generate._calibrated_attention
    decided: list[tuple] = []  # (what the tree was calibrated with, what the default was on this CPU)
    stand_in = {"attention": "auto"}  # what the decision answers (a GPU's answer, to see it used)

    def recording(loaded, device):
        decided.append((loaded.calibrated, decide(loaded, device)))
        return stand_in["attention"]

    monkeypatch.setattr(custom_generate, "_calibrated_attention", recording)
    calls: list[int] = []
    kernel = attention_function.triton_tree_attention
    monkeypatch.setattr(
        attention_function, "triton_tree_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k)
    )
    one = tok(PROMPTS[0], return_tensors="pt")
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    for inputs, extra in ((one, {}), (batch, {}), (one, {"cache_implementation": "static"})):
        plain = model.generate(**inputs, do_sample=False, max_new_tokens=8)
        for answer in ("auto", "triton"):
            stand_in["attention"] = answer
            calls.clear()
            assert torch.equal(_medusa(model, export_dir, **inputs, max_new_tokens=8, **extra), plain)
            assert decided[-1] == (("triton", 256), "auto")
            assert bool(calls) == (answer == "triton"), (answer, extra)
    decided.clear()
    _medusa(model, export_dir, **one, max_new_tokens=4, medusa_attention="sdpa")  # named: no default
    assert decided == []
    # a tree given in the call is not the one calibrated, though of the calibrated tree's size
    nodes = len(json.loads((export_dir / "medusa_choices.json").read_text()))
    _medusa(model, export_dir, **one, max_new_tokens=4, medusa_choices=[[rank] for rank in range(nodes)])
    assert decided[-1] == (None, "auto")
    release(model)


def test_a_calibration_of_another_tree_decides_nothing(
    workdir: Path, model, tok, tmp_path, monkeypatch
) -> None:
    """An export of a pinned tree ships the calibration of the heads' own tree: a calibration.json
    whose chosen tree has other paths than the export's tree (recorded; else another size), or a
    damaged one, decides nothing (the default is auto); one written again into the export is read
    again."""
    import medusa_train.custom_generate as custom_generate

    seen: list = []
    decide = custom_generate._calibrated_attention
    monkeypatch.setattr(
        custom_generate,
        "_calibrated_attention",
        lambda loaded, device: seen.append(loaded.calibrated) or decide(loaded, device),
    )
    one = tok(PROMPTS[0], return_tensors="pt")
    nodes = len(json.loads((workdir / "export" / "medusa_choices.json").read_text()))
    _medusa(
        model, _calibrated_export(workdir, tmp_path / "a", "triton", 256, nodes + 1), **one, max_new_tokens=4
    )
    broken = _calibrated_export(workdir, tmp_path / "b", "triton", 256)
    calibration = (broken / "calibration.json").read_text()
    (broken / "calibration.json").write_text("not json")
    _medusa(model, broken, **one, max_new_tokens=4)
    assert seen == [None, None]
    (broken / "calibration.json").write_text(calibration)  # written again: read again
    _medusa(model, broken, **one, max_new_tokens=4)
    assert seen[-1] == ("triton", 256)
    # the paths it chose decide, not the size: another tree of the same size decides nothing, the
    # export's own tree (in any order) does
    shipped = json.loads((workdir / "export" / "medusa_choices.json").read_text())
    other = [[rank] for rank in range(len(shipped))]
    assert sorted(map(tuple, other)) != sorted(map(tuple, shipped))
    for root, chosen, expected in (("c", other, None), ("d", shipped[::-1], ("triton", 256))):
        export_dir = _calibrated_export(workdir, tmp_path / root, "triton", 256, choices=chosen)
        _medusa(model, export_dir, **one, max_new_tokens=4)
        assert seen[-1] == expected, root
    release(model)


EXPORT_AGAIN = EXPORTED_CALIBRATION_INPUT.repair


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        ({"tree": {"context_len": True}}, "'tree.context_len' is a JSON boolean where a number is expected"),
        ({"tree": {"context_len": "4k"}}, "'tree.context_len' is a JSON string where a number is expected"),
        ({"tree": {"best": {"nodes": True}}}, "'tree.best.nodes' is a JSON boolean where a number"),
        ({"tree": {"calibrated_for": "H100"}}, "'tree.calibrated_for' is a JSON string where an object"),
        (
            {"tree": {"calibrated_for": {"dtype": "bfloat16", "attention": "triton"}}},
            "lacks 'tree.calibrated_for.device'",
        ),
        ({"tree": {"choices": [[0], "x"]}}, "'tree.choices[1]' is a JSON string where a list is expected"),
        ({"tree": [1, 2]}, "'tree' is a JSON list where an object is expected"),
        ({"head_topk_accuracy": [[0.5, 0.6], [0.4]]}, "'head_topk_accuracy' has rows of [1, 2] entries"),
        ({"head_topk_accuracy": [[0.5, "x"]]}, "'head_topk_accuracy[0][1]' is a JSON string where a number"),
        (b"[1, 2]", "a JSON list where an object is expected"),
        (b"not json", "not valid JSON: Expecting value"),
        (b'{"tree": {"calibrated_for": {"device": "\xff"}}}', "not valid JSON: UnicodeDecodeError"),
    ],
)
def test_custom_generate_reads_a_calibration_as_eval_does(
    workdir: Path, tmp_path, monkeypatch, caplog, damage, problem
) -> None:
    """custom_generate checks the export's calibration.json as stage=eval (and the card) do: a file eval
    refuses (wrong types, a JSON boolean for a number, missing keys, ragged rows, not JSON) decides
    nothing (the default attention is auto) and is one warning with eval's problem and repair
    (stage=export: the export's copy); the same file whole is read by both."""
    import medusa_train.custom_generate as custom_generate

    monkeypatch.setattr(custom_generate, "_WARNED", set())
    export_dir = _calibrated_export(workdir, tmp_path, "triton", 256)
    path, tree_file = export_dir / "calibration.json", export_dir / "medusa_choices.json"
    choices = json.loads(tree_file.read_text())
    whole = json.loads(path.read_text())
    assert custom_generate._calibration_of(tree_file, choices) == ("triton", 256)
    assert eval_stage.read_calibration(path) == whole
    if isinstance(damage, bytes):
        path.write_bytes(damage)
    else:
        tree = damage.get("tree")
        merged = {**whole["tree"], **tree} if isinstance(tree, dict) else tree
        path.write_text(json.dumps({**whole, **damage, **({"tree": merged} if "tree" in damage else {})}))
    with pytest.raises(DamagedArtefactError) as refused:
        eval_stage.read_calibration(path)
    assert str(refused.value).startswith(f"{path} is damaged ({problem}"), refused.value
    assert EXPORT_AGAIN in str(refused.value)
    with caplog.at_level(logging.WARNING, logger="medusa_train.custom_generate"):
        assert custom_generate._calibration_of(tree_file, choices) is None
    lines = [r.getMessage() for r in caplog.records if r.name == "medusa_train.custom_generate"]
    assert len(lines) == 1 and lines[0].startswith(f"{path} is damaged ({problem}"), lines
    assert lines[0].endswith(f"): {EXPORT_AGAIN}; the Medusa tree is decoded with medusa_attention='auto'")


def test_custom_generate_names_stage_train_for_a_heads_folders_calibration(
    workdir: Path, tmp_path, monkeypatch, caplog
) -> None:
    """medusa_heads= a heads folder: its damaged calibration.json is stage=train's to write again, as
    eval says."""
    import medusa_train.custom_generate as custom_generate

    monkeypatch.setattr(custom_generate, "_WARNED", set())
    heads = Path(shutil.copytree(workdir / "heads", tmp_path / "heads"))
    path, tree_file = heads / "calibration.json", heads / "medusa_choices.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "head_topk_accuracy": [[0.5], [0.4, 0.3]]}))
    with pytest.raises(DamagedArtefactError, match=re.escape(CALIBRATION_INPUT.repair)):
        eval_stage.read_calibration(path)
    with caplog.at_level(logging.WARNING, logger="medusa_train.custom_generate"):
        assert custom_generate._calibration_of(tree_file, json.loads(tree_file.read_text())) is None
    assert f"): {CALIBRATION_INPUT.repair}; the Medusa tree" in caplog.text


@pytest.mark.parametrize(
    ("calibrated", "device", "expected"),
    [
        (("triton", 256), "cuda", "triton"),  # auto takes SDPA below 8,192 keys: the kernel timed
        (("sdpa", 256), "cuda", "auto"),  # auto takes SDPA there too (and the kernel on long calls)
        (("sdpa", 8192), "cuda", "sdpa"),  # auto would take the kernel at the context timed on SDPA
        (("triton", 8192), "cuda", "auto"),
        (("cuda", 256), "cuda", "auto"),  # the CUDA kernel cannot be built here: a warning, auto
        (("triton", 256), "cpu", "auto"),  # a kernel by default on a GPU only (not in the interpreter)
        (("sdpa", 256), "cpu", "auto"),
        (None, "cuda", "auto"),
    ],
)
def test_the_calibrated_attention_where_auto_would_take_another(
    calibrated, device, expected, monkeypatch, caplog
) -> None:
    import medusa_train.custom_generate as custom_generate

    monkeypatch.setattr(tree_attention_module, "triton_available", lambda: True)
    monkeypatch.setattr(tree_attention_module, "cuda_available", lambda: "no CUDA device")
    loaded = custom_generate._Loaded(packed=None, tree=None, key=(), calibrated=calibrated)
    with caplog.at_level(logging.WARNING, logger="medusa_train.custom_generate"):
        assert custom_generate._calibrated_attention(loaded, torch.device(device)) == expected
    if calibrated == ("cuda", 256):
        assert (
            "calibrated with the cuda tree attention, but attention=cuda cannot run here: no CUDA device"
            in caplog.text
        )


def test_a_calibrated_triton_tree_without_triton_is_decoded_with_auto(monkeypatch) -> None:
    import medusa_train.custom_generate as custom_generate

    monkeypatch.setattr(tree_attention_module, "triton_available", lambda: False)
    loaded = custom_generate._Loaded(packed=None, tree=None, key=(), calibrated=("triton", 256))
    assert custom_generate._calibrated_attention(loaded, torch.device("cuda")) == "auto"


def test_a_batch_on_a_model_spread_over_devices_is_decoded_row_by_row(
    workdir: Path, model, tok, monkeypatch
) -> None:
    """The batched and static decoders need the model on one device. On a model spread over devices
    (``device_map``; stood in for here: this machine has one device) a batch is decoded one row at a time,
    identical to plain greedy, and ``cache_implementation="static"`` is refused in one line saying what
    decodes it."""
    import medusa_train.custom_generate as custom_generate
    import medusa_train.decoding.batched as batched

    def spread(_model) -> list[str]:
        return ["cuda:0", "cuda:1"]

    def batched_decoder(*args, **kwargs):
        raise AssertionError("the batched decoder was called on a spread model")

    monkeypatch.setattr(custom_generate, "model_devices", spread)
    monkeypatch.setattr(batched, "model_devices", spread)
    monkeypatch.setattr(custom_generate, "medusa_generate_batch", batched_decoder)
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    ours = _medusa(model, workdir / "export", **batch, max_new_tokens=20)
    assert torch.equal(ours, model.generate(**batch, do_sample=False, max_new_tokens=20))
    with pytest.raises(
        ValueError, match="spread over cuda:0, cuda:1: generate without it decodes such a model"
    ):
        _medusa(model, workdir / "export", **batch, max_new_tokens=4, cache_implementation="static")


def test_a_base_model_the_heads_do_not_belong_to_is_refused(workdir: Path, model, tok, tmp_path) -> None:
    one = tok(PROMPTS[0], return_tensors="pt")
    other = tiny_model(hidden=64, vocab=model.config.vocab_size)
    with pytest.raises(ValueError, match="do not belong to this model.*hidden_size=32.*hidden_size=64"):
        _medusa(other, workdir / "export", **one, max_new_tokens=4)
    # same shapes, other checkpoint files: the fingerprint stage=train recorded tells them apart
    changed = AutoModelForCausalLM.from_pretrained(workdir / "base_model").eval()
    with torch.no_grad():
        changed.model.norm.weight.mul_(1.5)
    changed.save_pretrained(tmp_path / "changed")
    changed = AutoModelForCausalLM.from_pretrained(tmp_path / "changed").eval()
    with pytest.raises(
        ValueError, match=r"go with .*base_model \(checkpoint fingerprint .*medusa_check_base=False"
    ):
        _medusa(changed, workdir / "export", **one, max_new_tokens=4)
    out = _medusa(changed, workdir / "export", **one, max_new_tokens=6, medusa_check_base=False)
    assert torch.equal(out, changed.generate(**one, do_sample=False, max_new_tokens=6))  # exact anyway
    # an export of the vLLM layout only (truncated heads have no other) records the base there too
    vllm_only = tmp_path / "vllm_only"
    shutil.copytree(workdir / "export", vllm_only)
    shutil.rmtree(vllm_only / "medusa")
    with pytest.raises(ValueError, match=r"go with .*base_model \(checkpoint fingerprint "):
        _medusa(changed, vllm_only, **one, max_new_tokens=4)
    assert torch.equal(
        _medusa(model, vllm_only, **one, max_new_tokens=6),
        model.generate(**one, do_sample=False, max_new_tokens=6),
    )
    # an export that ships its trained backbone (Medusa-2) goes with that backbone, not the original
    medusa2 = tmp_path / "medusa2"
    shutil.copytree(workdir / "export", medusa2)
    shutil.copytree(tmp_path / "changed", medusa2 / "backbone")
    with pytest.raises(ValueError, match=r"go with .*medusa2/backbone"):
        _medusa(model, medusa2, **one, max_new_tokens=4)
    trained = AutoModelForCausalLM.from_pretrained(medusa2 / "backbone").eval()
    assert torch.equal(
        _medusa(trained, medusa2, **one, max_new_tokens=6),
        trained.generate(**one, do_sample=False, max_new_tokens=6),
    )
    right = tok(PROMPTS, return_tensors="pt", padding=True)
    right = {k: v.flip(1) for k, v in right.items()}  # padding on the right
    with pytest.raises(ValueError, match="padding_side = 'left'"):
        _medusa(model, workdir / "export", **right, max_new_tokens=4)
    with pytest.raises(ValueError, match="num_beams=1"):
        _medusa(model, workdir / "export", **one, max_new_tokens=4, num_beams=2)


def test_the_generated_files_need_no_hydra_and_name_the_supported_versions(workdir: Path) -> None:
    folder = workdir / "export" / FOLDER
    assert sorted(p.name for p in folder.iterdir()) == ["generate.py", "requirements.txt"]
    # The GPU image has none of these: a None entry in sys.modules makes them absent (import fails,
    # find_spec answers None), so the file must import without them.
    block = (
        "import sys, importlib.util\n"
        "for name in ('hydra', 'omegaconf', 'datasets', 'deepspeed', 'wandb'):\n"
        "    sys.modules[name] = None\n"
        f"spec = importlib.util.spec_from_file_location('g', {str(folder / 'generate.py')!r})\n"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        "assert callable(module.generate)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", block], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    requirements = [
        line
        for line in (folder / "requirements.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert requirements == ["medusa_train>=0.1.0", f"torch>={MIN_TORCH}", f"transformers>={MIN_TRANSFORMERS}"]
    declared = (REPO / "pyproject.toml").read_text()  # the package's own lower bounds
    for name, low in (("torch", MIN_TORCH), ("transformers", MIN_TRANSFORMERS)):
        assert re.search(rf'^\s*"{name}>={re.escape(low)}[,"]', declared, re.M), name


def test_check_script_passes_on_the_export(workdir: Path, tmp_path: Path, monkeypatch) -> None:
    """scripts/check_custom_generate.py (the GPU check, here on the CPU): every case passes, and a
    medusa_train that is importable but not pip-installed gets the distribution record transformers checks."""
    script = load_script("check_custom_generate")
    out = tmp_path / "check.json"
    assert (
        script.main(
            [
                "--export",
                str(workdir / "export"),
                "--device",
                "cpu",
                "--max-new-tokens",
                "8",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    results = json.loads(out.read_text())
    assert results["base"] == str(workdir / "base_model") and results["greedy"]["identical"] == [True] * 4
    cases = ("greedy", "batch", "sample", "typical", "mismatch", "static", "timing")
    assert all(results[case]["ok"] for case in cases)
    assert results["static"]["identical"] == [True] * 4 and len(results["timing"]["tokens_per_s"]) == 4
    # the prompts are user turns where the tokenizer has a chat template
    has_template = AutoTokenizer.from_pretrained(workdir / "base_model").chat_template is not None
    assert results["chat_template"] is has_template
    real = importlib.metadata.version

    def not_installed(name: str) -> str:
        if name == "medusa_train":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert "distribution record" in script.ensure_distribution_record(tmp_path)
    record = next((tmp_path / "site").glob("medusa_train-*.dist-info"))
    assert importlib.metadata.Distribution.at(record).version == "0.1.0"


@pytest.mark.parametrize("outcome", ["tiny", "copy", "raised"])
def test_check_script_leaves_no_temporary_folder(outcome: str, tmp_path: Path, monkeypatch, capsys) -> None:
    """The script's temporary folder (the --tiny export; the copy of an export without custom_generate/)
    is removed whether the cases ran or one raised, and the output names no path inside it. The cases
    themselves are left out (the test above runs them)."""
    script = load_script("check_custom_generate")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))

    def run_case(results: dict, name: str, case) -> None:
        if outcome == "raised":
            raise RuntimeError("injected")
        results[name] = {"ok": True}

    monkeypatch.setattr(script, "run_case", run_case)
    out = tmp_path / "check.json"
    argv = ["--device", "cpu", "--max-new-tokens", "2", "--json", str(out)]
    if outcome == "copy":
        export, base = script.tiny_export(tmp_path / "src")
        shutil.rmtree(export / FOLDER)
        argv += ["--export", str(export), "--model", str(base)]
    else:
        argv.append("--tiny")
    if outcome == "raised":
        with pytest.raises(RuntimeError, match="injected"):
            script.main(argv)
    else:
        assert script.main(argv) == 0
        results = json.loads(out.read_text())
        assert str(scratch) not in json.dumps(results)
        if outcome == "copy":
            assert results["export"] == str(export) and "temporary copy" in results["note_export"]
    assert list(scratch.iterdir()) == []
    assert str(scratch) not in capsys.readouterr().out
    assert not any(Path(entry).is_relative_to(scratch) for entry in sys.path)


def _cache_of(out):
    """The cache of a ``return_dict_in_generate`` output, in the field the installed transformers names."""
    return getattr(out, output_cache_field())


def _with_cache(model, cache) -> dict:
    """A copy of ``cache`` (generate writes into the one it gets) under the name generate takes here."""
    return {cache_keyword(model): copy.deepcopy(cache)}


@pytest.mark.parametrize("static", [{}, {"cache_implementation": "static", "max_cache_len": 64}])
def test_the_returned_cache_goes_on_as_generates_own(workdir: Path, model, tok, static: dict) -> None:
    """With return_dict_in_generate, the output carries the cache plain generate's does (dynamic, or
    static of its size): the keys and values of the sequences but the last token, the tree's other
    columns cut off; plain generate goes on from it as from its own, and so does Medusa decoding
    (dynamic: from plain generate's cache too, which it returns gone on), each reply as plain
    generate's."""
    follow = tok(" the dog", return_tensors="pt")["input_ids"]
    for prompt in PROMPTS:  # the second reply is EOS at once
        one = tok(prompt, return_tensors="pt")
        plain = model.generate(
            **one, do_sample=False, max_new_tokens=12, return_dict_in_generate=True, **static
        )
        ours = _medusa(
            model, workdir / "export", **one, max_new_tokens=12, return_dict_in_generate=True, **static
        )
        assert torch.equal(ours.sequences, plain.sequences)
        mine, theirs = _cache_of(ours), _cache_of(plain)
        assert type(mine) is type(theirs)
        assert int(mine.get_seq_length()) == int(theirs.get_seq_length()) == plain.sequences.shape[1] - 1
        for a, b in zip(mine.layers, theirs.layers, strict=True):
            torch.testing.assert_close(a.keys, b.keys)
            torch.testing.assert_close(a.values, b.values)
        ids = torch.cat([plain.sequences, follow], dim=1)
        expected = model.generate(ids, do_sample=False, max_new_tokens=10, **_with_cache(model, theirs))
        assert torch.equal(
            model.generate(ids, do_sample=False, max_new_tokens=10, **_with_cache(model, mine)), expected
        )
        if static:
            continue
        for cache in (mine, theirs):
            given = _with_cache(model, cache)
            again = _medusa(
                model,
                workdir / "export",
                input_ids=ids,
                max_new_tokens=10,
                return_dict_in_generate=True,
                **given,
            )
            assert torch.equal(again.sequences, expected)
            # the cache given, gone on in place, as generate returns the one it gets
            assert _cache_of(again) is next(iter(given.values()))
            assert _cache_of(again).get_seq_length() == expected.shape[1] - 1


@pytest.mark.parametrize("static", [{}, {"cache_implementation": "static", "max_cache_len": 64}])
def test_the_cache_of_a_left_padded_batch_is_generates(workdir: Path, model, tok, static: dict) -> None:
    """A batch's cache holds each row as generate's does, in the left-padded layout (the padding's
    entries, masked in every later forward, aside), the row that stopped at once with its EOS and the
    padding generate ran after it: plain generate goes on from it as from its own. Medusa decoding does
    not go on from a batch's cache: refused in one line."""
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    plain = model.generate(
        **batch, do_sample=False, max_new_tokens=12, return_dict_in_generate=True, **static
    )
    ours = _medusa(
        model, workdir / "export", **batch, max_new_tokens=12, return_dict_in_generate=True, **static
    )
    assert torch.equal(ours.sequences, plain.sequences)
    assert (ours.sequences[1, -1] == tok.pad_token_id).item()  # the second row stopped early
    mine, theirs = _cache_of(ours), _cache_of(plain)
    end = plain.sequences.shape[1] - 1
    assert type(mine) is type(theirs) and int(mine.get_seq_length()) == int(theirs.get_seq_length()) == end
    width = batch["input_ids"].shape[1]
    mask = torch.cat([batch["attention_mask"], torch.ones(2, end + 1 - width, dtype=torch.long)], dim=1)
    kept = mask[:, :end].bool()  # (B, S - 1) the columns a later forward reads
    for a, b in zip(mine.layers, theirs.layers, strict=True):
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            torch.testing.assert_close(
                x[:, :, :end].transpose(1, 2)[kept], y[:, :, :end].transpose(1, 2)[kept]
            )
    follow = tok([" the dog", " a cat"], return_tensors="pt", padding=True)
    ids = torch.cat([plain.sequences, follow["input_ids"]], dim=1)
    go_on = dict(attention_mask=torch.cat([mask, follow["attention_mask"]], dim=1), do_sample=False)
    expected = model.generate(ids, **go_on, max_new_tokens=10, **_with_cache(model, theirs))
    assert torch.equal(model.generate(ids, **go_on, max_new_tokens=10, **_with_cache(model, mine)), expected)
    refusal = (
        "a DynamicCache whose layers keep every token" if static else "a cache of one prompt without padding"
    )
    with pytest.raises(ValueError, match=f"Medusa decoding goes on from {refusal}.*: pass"):
        _medusa(
            model, workdir / "export", input_ids=ids, **go_on, max_new_tokens=4, **_with_cache(model, mine)
        )


def test_a_cache_medusa_decoding_cannot_go_on_from_is_refused(workdir: Path, model, tok) -> None:
    """The static decoder decodes on a cache of its own (plain generate refuses a cache with it too);
    the dynamic one goes on from a DynamicCache whose layers keep every token (or the model's window),
    shorter than the prompt: anything else is refused in one line saying what to pass."""
    one = tok(PROMPTS[0], return_tensors="pt")
    out = _medusa(model, workdir / "export", **one, max_new_tokens=6, return_dict_in_generate=True)
    ids = torch.cat([out.sequences, one["input_ids"]], dim=1)
    with pytest.raises(
        ValueError, match='static" decodes on a cache of its own .*without cache_implementation'
    ):
        _medusa(
            model,
            workdir / "export",
            input_ids=ids,
            max_new_tokens=4,
            cache_implementation="static",
            **_with_cache(model, _cache_of(out)),
        )
    static = _medusa(
        model,
        workdir / "export",
        **one,
        max_new_tokens=6,
        return_dict_in_generate=True,
        cache_implementation="static",
    )
    with pytest.raises(
        ValueError,
        match="a DynamicCache whose layers keep every token or the model.s window, not a StaticCache of",
    ):
        _medusa(
            model,
            workdir / "export",
            input_ids=ids,
            max_new_tokens=4,
            **_with_cache(model, _cache_of(static)),
        )
    cached = out.sequences.shape[1] - 1
    with pytest.raises(
        ValueError, match=f"the cache holds {cached} tokens and input_ids {cached}: pass input_ids"
    ):
        _medusa(
            model,
            workdir / "export",
            input_ids=out.sequences[:, :-1],
            max_new_tokens=4,
            **_with_cache(model, _cache_of(out)),
        )


def test_decoding_goes_past_the_positions_where_generate_does_and_stops_where_it_cannot(
    workdir: Path, model, tok, tmp_path: Path, caplog
) -> None:
    """Plain generate goes on past max_position_embeddings (a warning) on a RoPE model: so does Medusa
    decoding, the same tokens (one prompt, a batch, the static decoder). A model of learned absolute
    positions cannot index past its table (plain generate fails there): Medusa decoding stops at it,
    with a warning that says why."""
    ids = tok(PROMPTS[0], return_tensors="pt")["input_ids"]
    long = ids.repeat(1, 250 // ids.shape[1] + 1)[:, :250]  # of the model's 256 positions
    batch = {"input_ids": torch.cat([long, long]), "attention_mask": torch.ones(2, 250, dtype=torch.long)}
    batch["attention_mask"][1, :3] = 0
    with caplog.at_level(logging.WARNING):
        for inputs in ({"input_ids": long}, batch):
            plain = model.generate(**inputs, do_sample=False, max_new_tokens=20)
            assert plain.shape[1] == 270
            for extra in ({}, {"cache_implementation": "static"}):
                assert torch.equal(
                    _medusa(model, workdir / "export", **inputs, max_new_tokens=20, **extra), plain
                )
    assert "went past the model's max_position_embeddings (256), as plain generate's go on" in caplog.text
    release(model)
    gpt2 = tiny_model("gpt2", seed=3)  # 64 learned positions
    heads_dir = tmp_path / "gpt2_heads"
    save_medusa(random_heads(gpt2, num_heads=3), heads_dir / MEDUSA)
    (heads_dir / CHOICES).write_text(json.dumps([[0], [0, 0], [1], [0, 0, 0]]))
    prompt = torch.randint(1, 128, (1, 50), generator=torch.Generator().manual_seed(4))
    with pytest.raises(IndexError):
        gpt2.generate(prompt, do_sample=False, max_new_tokens=30)
    with caplog.at_level(logging.WARNING):
        ours = generate_with_heads(gpt2, prompt, medusa_heads=heads_dir, max_new_tokens=30)
    assert torch.equal(ours, gpt2.generate(prompt, do_sample=False, max_new_tokens=14))  # 64 in all
    assert (
        "stopped at the model's max_position_embeddings (64): its positions are a learned table"
        in caplog.text
    )


_TABLES = {  # 64 positions each
    "ctrl": lambda: tf.CTRLConfig(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=4, dff=64),
    "gptj": lambda: tf.GPTJConfig(
        vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=4, rotary_dim=4
    ),
    "xglm": lambda: tf.XGLMConfig(
        vocab_size=128, max_position_embeddings=64, d_model=32, num_layers=2, attention_heads=4, ffn_dim=64
    ),
}


@pytest.mark.parametrize("name", _TABLES)
def test_decoding_stops_at_a_fixed_table_of_positions_where_generate_fails(
    name, tmp_path: Path, caplog, monkeypatch
) -> None:
    """Positions read from a fixed table of max_position_embeddings rows, a buffer rather than an
    embedding (CTRL's sinusoidal ``pos_encoding``, GPT-J's rotary ``embed_positions``): plain generate fails
    past it, and Medusa decoding stops there with a warning (it failed in the tree's forward); XGLM's
    sinusoidal table grows past it (``make_weights``): generate goes on, and so does Medusa decoding."""
    config = _TABLES[name]()
    config.update(dict(bos_token_id=0, eos_token_id=None, pad_token_id=0))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    heads_dir = tmp_path / "heads"
    save_medusa(random_heads(model, num_heads=3), heads_dir / MEDUSA)
    (heads_dir / CHOICES).write_text(json.dumps([[0], [0, 0], [1], [0, 0, 0]]))
    prompt = torch.randint(1, 128, (1, 50), generator=torch.Generator().manual_seed(4))
    import medusa_train.custom_generate as custom_generate

    grows = name == "xglm"
    monkeypatch.setattr(custom_generate, "_WARNED", set())  # warned once per process
    if not grows:
        with pytest.raises((IndexError, RuntimeError), match="out of bounds"):  # 5.17: RuntimeError
            model.generate(prompt, do_sample=False, max_new_tokens=30)
    with caplog.at_level(logging.WARNING):
        ours = generate_with_heads(model, prompt, medusa_heads=heads_dir, max_new_tokens=30)
    plain = model.generate(prompt, do_sample=False, max_new_tokens=30 if grows else 14)  # 64 in all
    assert torch.equal(ours, plain)
    stopped = "stopped at the model's max_position_embeddings (64): its positions are a fixed table"
    assert (stopped in caplog.text) != grows


WINDOWED = {  # window 6 (Llama 4: chunks of 8), passed by the 9 + 12 + 4 + 10 tokens of the tests below
    "mistral": lambda: tiny_config("mistral", sliding_window=6, initializer_range=0.2),  # every layer
    "qwen2": lambda: tiny_config(  # layer 0 full, layer 1 sliding
        "qwen2", use_sliding_window=True, sliding_window=6, max_window_layers=1, initializer_range=0.2
    ),
    "gemma2": architectures.MODELS["gemma2"],
    "gemma3": architectures.MODELS["gemma3"],
    "gemma3n": architectures.MODELS["gemma3n"],  # its last two layers read the first two's KV
    "gemma4_kv_shared": architectures.MODELS["gemma4_kv_shared"],
    "llama4": lambda: architectures.llama4(chunk=8),  # a chunked layer and a global one
}
"""Models whose plain ``generate`` cache has layers that keep only their window's last tokens
(``DynamicSlidingWindowLayer``), or none (a KV-sharing layer's ``DummyLayer``, transformers 5.24)."""
STATIC_CHUNKS = "block_sequence_ids" in inspect.signature(masking_utils.create_chunked_causal_mask).parameters
"""Whether plain ``generate`` runs a static cache over chunked layers: transformers 5.17's passes its chunked
mask a ``block_sequence_ids`` it does not take (a TypeError on Llama 4's)."""


def _heads_for(model, folder: Path) -> Path:
    """``folder`` with random heads for ``model``, a tree and ``custom_generate/``, as an export has them."""
    save_medusa(random_heads(model, num_heads=3, seed=1), folder / MEDUSA)
    (folder / CHOICES).write_text(json.dumps([[0], [0, 0], [1], [0, 0, 0]]))
    write_custom_generate(folder, folder)
    return folder


@pytest.fixture(scope="module")
def windowed(tmp_path_factory: pytest.TempPathFactory):
    """``name`` -> a tiny random model of :data:`WINDOWED` and its heads folder, built once per module."""
    root, built = tmp_path_factory.mktemp("windowed"), {}

    def get(name: str) -> tuple[torch.nn.Module, Path]:
        if name not in built:
            model = architectures.build(WINDOWED[name]())
            built[name] = model, _heads_for(model, root / name)
        return built[name]

    return get


def _kinds(cache) -> list[str]:
    return [type(layer).__name__ for layer in cache.layers]


def _assert_same_entries(mine, theirs, kept: torch.Tensor | None = None) -> None:
    """The same layers, holding the same keys and values (where ``kept`` ``(B, S)`` marks the columns a
    later forward reads; a sliding-window layer holds the last of them, in no more memory than
    generate's)."""
    assert _kinds(mine) == _kinds(theirs)
    for a, b in zip(mine.layers, theirs.layers, strict=True):
        if b.keys is None:  # a layer that keeps no KV
            assert a.keys is None
            continue
        assert a.keys.shape == b.keys.shape
        if type(b).__name__ == "DynamicSlidingWindowLayer":
            held = [t.untyped_storage().nbytes() for t in (a.keys, a.values, b.keys, b.values)]
            assert held[0] <= held[2] and held[1] <= held[3]
        read = None if kept is None else kept[:, kept.shape[1] - b.keys.shape[2] :]  # (B, n)
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            if read is None:
                torch.testing.assert_close(x, y)
            else:
                torch.testing.assert_close(x.transpose(1, 2)[read], y.transpose(1, 2)[read])


@pytest.mark.parametrize("name", WINDOWED)
def test_the_cache_of_a_windowed_or_kv_sharing_model_is_generates(name: str, windowed) -> None:
    """Sliding-window and chunked layers (past their window) and layers that read an earlier layer's KV:
    the returned cache has plain generate's layers (a window layer keeps its last tokens, a KV-sharing
    layer none) and entries; plain generate goes on from it as from its own, and so does Medusa decoding
    from either, returning it gone on in the layers it came in, from which plain generate goes on again
    as from its own."""
    model, folder = windowed(name)
    gen = torch.Generator().manual_seed(5)
    prompt, follow, more = (torch.randint(1, 100, (1, n), generator=gen) for n in (9, 4, 3))
    plain = model.generate(prompt, do_sample=False, max_new_tokens=12, return_dict_in_generate=True)
    ours = _medusa(model, folder, input_ids=prompt, max_new_tokens=12, return_dict_in_generate=True)
    assert torch.equal(ours.sequences, plain.sequences)
    mine, theirs = _cache_of(ours), _cache_of(plain)
    assert type(mine) is type(theirs)
    _assert_same_entries(mine, theirs)
    ids = torch.cat([plain.sequences, follow], dim=1)
    going_on = dict(do_sample=False, max_new_tokens=10, return_dict_in_generate=True)
    expected = model.generate(ids, **going_on, **_with_cache(model, theirs))
    assert torch.equal(
        model.generate(ids, **going_on, **_with_cache(model, mine)).sequences, expected.sequences
    )
    again_ids = torch.cat([expected.sequences, more], dim=1)
    again_expected = model.generate(
        again_ids, do_sample=False, max_new_tokens=6, **_with_cache(model, _cache_of(expected))
    )
    for cache in (mine, theirs):
        given = _with_cache(model, cache)
        again = _medusa(
            model, folder, input_ids=ids, max_new_tokens=10, return_dict_in_generate=True, **given
        )
        assert torch.equal(again.sequences, expected.sequences)
        assert _cache_of(again) is next(iter(given.values()))  # gone on in place, in its own layers
        _assert_same_entries(_cache_of(again), _cache_of(expected))
        assert torch.equal(
            model.generate(
                again_ids, do_sample=False, max_new_tokens=6, **_with_cache(model, _cache_of(again))
            ),
            again_expected,
        )


@pytest.mark.parametrize("static", [{}, {"cache_implementation": "static", "max_cache_len": 64}])
@pytest.mark.parametrize("name", WINDOWED)
def test_the_cache_of_a_windowed_or_kv_sharing_models_batch_is_generates(
    name: str, static: dict, windowed
) -> None:
    """A left-padded batch (one row stopped early, by one forward for its tail) and the static cache:
    plain generate's layers and entries (dynamic: the columns a later forward reads), and plain generate
    goes on from it as from its own."""
    if static and name == "llama4" and not STATIC_CHUNKS:
        pytest.skip("plain generate of this transformers fails on a static cache over chunked layers")
    model, folder = windowed(name)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 100, (2, 9), generator=gen)
    mask = torch.ones(2, 9, dtype=torch.long)
    ids[1, :3], mask[1, :3] = 0, 0
    free = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
    eos = next(t for t in free[1, 9:12].tolist() if t not in free[0, 9:].tolist())  # ends row 1 alone
    batch = dict(attention_mask=mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    plain = model.generate(ids, **batch, do_sample=False, return_dict_in_generate=True, **static)
    ours = _medusa(model, folder, input_ids=ids, **batch, return_dict_in_generate=True, **static)
    assert torch.equal(ours.sequences, plain.sequences)
    assert ours.sequences.shape[1] == 21 and ours.sequences[1, -1] == 0  # the second row stopped early
    mine, theirs = _cache_of(ours), _cache_of(plain)
    assert type(mine) is type(theirs) and _kinds(mine) == _kinds(theirs)
    end = plain.sequences.shape[1] - 1
    whole = torch.cat([mask, torch.ones(2, end + 1 - 9, dtype=torch.long)], dim=1)  # (B, S)
    if not static:
        _assert_same_entries(mine, theirs, whole[:, :end].bool())
    follow = torch.randint(1, 100, (2, 4), generator=gen)
    go_on = dict(
        attention_mask=torch.cat([whole, torch.ones(2, 4, dtype=torch.long)], dim=1), do_sample=False
    )
    longer = torch.cat([plain.sequences, follow], dim=1)
    expected = model.generate(longer, **go_on, max_new_tokens=10, **_with_cache(model, theirs))
    assert torch.equal(
        model.generate(longer, **go_on, max_new_tokens=10, **_with_cache(model, mine)), expected
    )


def test_a_window_the_models_code_does_not_read_keeps_every_token_in_the_returned_cache(
    tmp_path: Path,
) -> None:
    """A Llama whose config carries a sliding_window (its code never reads it: it attends every token, and
    so do the decoders) gets from plain generate a cache whose layers keep the window's last tokens, which
    that Llama then attends alone. The returned cache keeps every token, as the model attends them:
    plain generate goes on from it as from a cache that keeps every token; Medusa decoding goes on from it,
    and refuses plain generate's, which lost tokens the model attends, in one line."""
    model = architectures.build(tiny_config("llama", sliding_window=6, initializer_range=0.2))
    folder = _heads_for(model, tmp_path)
    gen = torch.Generator().manual_seed(5)
    prompt, follow = (torch.randint(1, 100, (1, n), generator=gen) for n in (9, 4))
    on_full = model.generate(  # on a cache whose layers keep every token
        prompt,
        do_sample=False,
        max_new_tokens=12,
        return_dict_in_generate=True,
        **_with_cache(model, DynamicCache()),
    )
    ours = _medusa(model, folder, input_ids=prompt, max_new_tokens=12, return_dict_in_generate=True)
    assert torch.equal(ours.sequences, on_full.sequences)
    mine = _cache_of(ours)
    assert set(_kinds(mine)) == {"DynamicLayer"}
    _assert_same_entries(mine, _cache_of(on_full))
    ids = torch.cat([ours.sequences, follow], dim=1)
    expected = model.generate(
        ids, do_sample=False, max_new_tokens=10, **_with_cache(model, _cache_of(on_full))
    )
    assert torch.equal(
        model.generate(ids, do_sample=False, max_new_tokens=10, **_with_cache(model, mine)), expected
    )
    again = _medusa(model, folder, input_ids=ids, max_new_tokens=10, **_with_cache(model, mine))
    assert torch.equal(again, expected)
    plain = model.generate(prompt, do_sample=False, max_new_tokens=12, return_dict_in_generate=True)
    assert "DynamicSlidingWindowLayer" in _kinds(_cache_of(plain))
    with pytest.raises(ValueError, match="keep every token or the model's window, not a DynamicCache of Dyn"):
        _medusa(model, folder, input_ids=ids, max_new_tokens=4, **_with_cache(model, _cache_of(plain)))
    given = _with_cache(model, DynamicCache(config=model.config))  # its unread window's layers, empty
    empty = next(iter(given.values()))
    assert "DynamicSlidingWindowLayer" in _kinds(empty)
    fresh = _medusa(model, folder, input_ids=prompt, max_new_tokens=12, return_dict_in_generate=True, **given)
    assert torch.equal(fresh.sequences, on_full.sequences)
    assert _cache_of(fresh) is empty
    assert set(_kinds(empty)) == {"DynamicLayer"}  # given back keeping every token, as the model attends
    _assert_same_entries(empty, _cache_of(on_full))


def test_an_empty_cache_made_from_a_config_is_gone_on_from_in_the_models_windows(windowed) -> None:
    """``DynamicCache(config=...)`` before any token, the cache a user makes to pass to generate: Medusa
    decoding goes on from it (nothing lost to the window it was made with) and gives it back in the
    layers plain generate's own ends in, with its entries, a window other than the model's included."""
    model, folder = windowed("mistral")
    prompt = torch.randint(1, 100, (1, 9), generator=torch.Generator().manual_seed(5))
    plain = model.generate(prompt, do_sample=False, max_new_tokens=12, return_dict_in_generate=True)
    narrow = copy.deepcopy(model.config)
    narrow.sliding_window = 3
    for config in (model.config, narrow):
        given = _with_cache(model, DynamicCache(config=config))
        ours = _medusa(
            model, folder, input_ids=prompt, max_new_tokens=12, return_dict_in_generate=True, **given
        )
        assert torch.equal(ours.sequences, plain.sequences)
        empty = next(iter(given.values()))
        assert _cache_of(ours) is empty
        assert {layer.sliding_window for layer in empty.layers} == {6}
        _assert_same_entries(empty, _cache_of(plain))


def test_a_window_layer_recording_its_past_records_it_again_when_given_back(windowed) -> None:
    """A sliding-window layer that records its past (``activate_past_recording``, as assisted decoding
    leaves it) is given back recording it, holding its window's last tokens, as after its ``crop``."""
    model, folder = windowed("mistral")
    gen = torch.Generator().manual_seed(5)
    prompt, follow = (torch.randint(1, 100, (1, n), generator=gen) for n in (9, 4))
    plain = model.generate(prompt, do_sample=False, max_new_tokens=12, return_dict_in_generate=True)
    ids = torch.cat([plain.sequences, follow], dim=1)
    going_on = dict(do_sample=False, max_new_tokens=10, return_dict_in_generate=True)
    expected = model.generate(ids, **going_on, **_with_cache(model, _cache_of(plain)))
    given = _with_cache(model, _cache_of(plain))
    recording = next(iter(given.values()))
    for layer in recording.layers:
        layer.activate_past_recording()
    again = _medusa(model, folder, input_ids=ids, **going_on, **given)
    assert torch.equal(again.sequences, expected.sequences)
    assert _cache_of(again) is recording
    assert all(layer.record_past for layer in recording.layers)
    _assert_same_entries(recording, _cache_of(expected))
