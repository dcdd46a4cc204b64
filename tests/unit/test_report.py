"""The export's model card: a Hub card (YAML front matter), what it tells a user about each engine's
loader (docs/pipeline.md), the vLLM `num_speculative_tokens` it recommends, and the check of the JSON
files it reads (a JSON boolean is no number; the speed-up's quartiles come as a pair)."""

from __future__ import annotations

from pathlib import Path

import pytest
from huggingface_hub import ModelCard
from huggingface_hub.repocard import metadata_load

from medusa_train.card_inputs import CALIBRATION_INPUT, shape_problem
from medusa_train.heads import MedusaHeads
from medusa_train.report import (
    REPORT_INPUT,
    alternatives,
    headline_speedup,
    model_card,
    recommend_speculative_tokens,
)


def _card(
    num_heads: int,
    num_layers: int = 1,
    base: str = "meta-llama/Llama-3.1-8B",
    pickle: bool = False,
    head_projection: str = "own",
) -> str:
    heads = MedusaHeads(16, 40, num_heads, num_layers, base, head_projection=head_projection)
    return model_card(
        heads=heads,
        heads_config={},
        formats=["medusa", "vllm"],
        tree_name="calibrated",
        choices=[[i] for i in range(80)],
        manifest=None,
        calibration=None,
        report=None,
        export_dir=Path("/srv/run/export"),
        pickle=pickle,
    )


@pytest.mark.parametrize(
    ("num_heads", "says"),
    [
        (4, "here head 5 stays random"),
        (3, "here heads 4..5 stay random"),
        (5, "every head loads"),
        (7, "heads 6..7 are dropped"),
    ],
)
def test_card_warns_that_fasterdecoding_assumes_five_heads(num_heads: int, says: str) -> None:
    card = _card(num_heads)
    assert says in card and "loads the weights non-strictly" in card
    assert ("Always pass `medusa_choices`" in card) == (num_heads < 5)
    assert f'"num_speculative_tokens": {num_heads}' in card and f"at most {num_heads}" in card
    assert f"--num_medusa_heads {num_heads} --max_medusa_token_len 80 " in card  # the tree has 80 nodes


def test_card_says_what_base_model_name_or_path_is_and_how_to_get_the_pickle() -> None:
    hub = _card(4)
    assert "is a Hugging Face Hub id" in hub and "--tokenizer-config-path" not in hub
    assert "re-run `python -m medusa_train stage=export export.write_pickle=true`" in hub
    local = _card(4, base="/models/llama", pickle=True)
    assert "is an absolute path on the machine that exported" in local
    assert "--tokenizer-config-path /models/llama/tokenizer_config.json" in local
    assert "which this export has" in local and "reads `medusa_lm_head.pt` when it is there" in local
    assert 'MedusaModel.from_pretrained("/srv/run/export/medusa"' in local
    assert "repeat one residual block" not in local and "repeat one residual block 2 times" in _card(4, 2)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_card_sends_shared_heads_only_to_loaders_that_use_the_base_lm_head(num_layers: int) -> None:
    """Shared heads store no projection: FasterDecoding's MedusaModel would leave its per-head projections
    random without a word (its legacy MedusaModel uses the base lm_head), TensorRT-LLM's converter needs
    them, and TGI's MedusaHeadV2 takes one block per head."""
    card = _card(4, num_layers, pickle=True, head_projection="shared")
    assert "from medusa.model.medusa_model_legacy import MedusaModel" in card
    assert "from medusa.model.medusa_model import" not in card and "stay random" not in card
    assert "convert_checkpoint.py" not in card and "it cannot convert them" in card
    assert ("text-generation-launcher" in card) == (num_layers == 1)
    assert ("TGI refuses these 2-block heads" in card) == (num_layers == 2)
    assert ("serve them with vLLM or medusa_train instead" in card) == (num_layers == 2)
    own = _card(4, num_layers, pickle=True)
    assert "from medusa.model.medusa_model import MedusaModel" in own and "convert_checkpoint.py" in own


def _chain(*taus: float) -> list[dict]:
    return [{"num_speculative_tokens": n, "tau": tau} for n, tau in enumerate(taus, start=1)]


@pytest.mark.parametrize(
    ("taus", "best"),
    [
        ((1.7, 2.1, 2.15, 2.2), 2),  # head 3 adds 0.05 < 0.1
        ((1.7, 2.3, 2.8, 3.1), 4),  # every head adds more than 0.1
        ((1.7, 1.75), 1),
        ((1.5,), 1),
    ],
)
def test_recommended_speculative_tokens_stop_where_a_head_adds_under_a_tenth(taus, best) -> None:
    assert recommend_speculative_tokens(_chain(*taus)) == best
    assert recommend_speculative_tokens([]) is None


def test_card_is_a_hub_model_card(tmp_path: Path) -> None:
    """huggingface_hub reads its YAML front matter; base_model only for a Hub id; license left to the user."""
    card = _card(4)
    path = tmp_path / "README.md"
    path.write_text(card)
    meta = metadata_load(path)
    assert meta == ModelCard(card).data.to_dict()
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert meta["base_model"] == "meta-llama/Llama-3.1-8B" and "license" not in meta
    assert {"custom_generate", "medusa", "speculative-decoding"} <= set(meta["tags"])
    assert "# license:" in card.split("---")[1]
    assert "base_model" not in ModelCard(_card(4, base="/models/llama")).data.to_dict()
    # each folder says what it is for; the custom_generate example is under 5 lines
    for folder in ("`medusa/`", "`vllm/`", "`custom_generate/`", "`medusa_choices.json`"):
        assert f"- {folder}:" in card
    example = card.split("## Decode with `model.generate`")[1].split("```python\n")[1].split("```")[0]
    assert len(example.splitlines()) < 5 and 'custom_generate="/srv/run/export"' in example


def test_card_recommends_the_measured_num_speculative_tokens() -> None:
    heads = MedusaHeads(16, 40, 4, 1, base_model_name_or_path="meta-llama/Llama-3.1-8B")
    report = {"vllm_chain": _chain(1.7, 2.1, 2.15, 2.2), "tau": 2.5, "speedup": 2.0, "tree_size": 20}
    card = model_card(
        heads=heads,
        heads_config={"backbone": {"name_or_path": "meta-llama/Llama-3.1-8B"}},
        formats=["vllm"],
        tree_name="calibrated",
        choices=[[i] for i in range(20)],
        manifest=None,
        calibration=None,
        report=report,
        backbone="/srv/run/export/backbone",
        export_dir=Path("/srv/run/export"),
    )
    spec = '{"method": "medusa", "model": "/srv/run/export/vllm", "num_speculative_tokens": 2}'
    assert f"vllm serve /srv/run/export/backbone --speculative-config '{spec}'" in card
    assert "| 2 (recommended) | 2.10 | +0.40 |" in card
    # Medusa-2: the card's example loads the shipped backbone; the Hub base is where it started
    assert (
        'from_pretrained("/srv/run/export/backbone")' in card
        and "`backbone/`: the base model trained" in card
    )
    assert ModelCard(card).data.to_dict()["base_model"] == "meta-llama/Llama-3.1-8B"


def _revision_card(
    heads_config: dict, manifest: dict | None = None, *, base: str = "org/base", backbone=None
):
    heads = MedusaHeads(16, 40, 3, 1, base_model_name_or_path=base)
    return model_card(
        heads=heads,
        heads_config=heads_config,
        formats=["medusa", "vllm"],
        tree_name="calibrated",
        choices=[[0], [1]],
        manifest=manifest,
        calibration=None,
        report=None,
        backbone=backbone,
        export_dir=Path("/srv/run/export"),
    )


def test_card_names_the_revision_the_heads_were_trained_on():
    """Heads trained on a pinned Hub revision (model.revision, recorded with their backbone identity, else
    named by their distilled data's manifest): the card's title and base model name it, and the commands
    that take a revision pass it (loading the base by name alone takes its default branch)."""
    identity = {"name_or_path": "org/base", "fingerprint": "abc", "revision": "3f2a9c1"}
    via_manifest = {
        "quick_settings": {"backbone_source": {"name_or_path": "org/base", "revision": "3f2a9c1"}}
    }
    for card in (
        _revision_card({"backbone": identity}),
        _revision_card({"backbone": {k: v for k, v in identity.items() if k != "revision"}}, via_manifest),
    ):
        assert "# Medusa heads for `org/base` at revision `3f2a9c1`" in card
        assert "- `org/base` at revision `3f2a9c1`" in card and "- revision: `3f2a9c1`" in card
        assert 'from_pretrained("org/base", revision="3f2a9c1")' in card
        assert "vllm serve org/base --revision 3f2a9c1 --speculative-config" in card
        assert 'LLM(model="org/base", revision="3f2a9c1", speculative_config=' in card
        assert "the heads were trained on revision `3f2a9c1`, which the commands below pass" in card
        assert "the base model is `org/base` at revision `3f2a9c1`." in card
    unpinned = _revision_card({"backbone": {"name_or_path": "org/base"}})
    assert "revision" not in unpinned
    # Medusa-2: the shipped backbone is loaded; the revision is that of the model training started from
    medusa2 = _revision_card({"backbone": identity}, backbone="/srv/run/export/backbone")
    assert (
        "# Medusa heads for `/srv/run/export/backbone`\n" in medusa2 and "  - revision: `3f2a9c1`" in medusa2
    )
    assert 'from_pretrained("/srv/run/export/backbone")' in medusa2 and "--revision" not in medusa2


def test_static_speedup_over_the_compiled_baseline_is_the_median_over_turns():
    """``speedup_vs_compiled`` is the median over turns of the static decoder's tokens/s over the
    compiled baseline's (as the batched rows' figure is); the summed tokens/s ratio is kept beside it."""
    turns = [
        (10, 1.0, 0.5, 0.25),
        (10, 1.0, 0.5, 0.1),
        (100, 10.0, 10.0, 5.0),
    ]  # tokens, plain/compiled/static s
    records = [
        {
            "baseline_tokens": n,
            "baseline_s": plain,
            "compiled_plain_tokens": n,
            "compiled_plain_s": compiled,
            "compiled_plain_identical": True,
            "static_medusa_tokens": n,
            "static_medusa_s": static,
            "static_medusa_identical": True,
        }  # fmt: skip
        for n, plain, compiled, static in turns
    ]
    static = alternatives(records)["static_medusa"]
    assert static["speedup_vs_compiled"] == pytest.approx(2.0)  # ratios 2, 5, 2
    assert static["speedup_vs_compiled_tokens_per_s"] == pytest.approx((120 / 5.35) / (120 / 11.0))


@pytest.mark.parametrize(
    ("tree_name", "nodes", "says"),
    [
        ("calibrated", 5, True),
        ("medusa63", 5, False),  # a tree pinned at export ships the calibration of the heads' own tree
        ("chain", 5, False),
        ("custom", 5, False),
        ("calibrated", 8, False),  # a calibration that chose a tree of another size is not this tree's
        (None, 5, False),
    ],
)
def test_card_says_where_the_tree_was_calibrated_only_for_the_calibrated_tree(
    tree_name: str | None, nodes: int, says: bool
) -> None:
    heads = MedusaHeads(16, 40, 4, 1, base_model_name_or_path="meta-llama/Llama-3.1-8B")
    label = {"device": "NVIDIA H100 80GB HBM3", "dtype": "bfloat16", "attention": "sdpa"}
    card = model_card(
        heads=heads,
        heads_config={},
        formats=["medusa"],
        tree_name=tree_name,
        choices=[[i] for i in range(5)],
        manifest=None,
        calibration={"tree": {"calibrated_for": label, "best": {"nodes": nodes}}},
        report=None,
    )
    tree_line = next(line for line in card.splitlines() if line.startswith("Tree: "))
    assert ("calibrated for NVIDIA H100 80GB HBM3 (bfloat16, sdpa attention)" in tree_line) == says, tree_line
    assert says or tree_line.endswith("5 nodes, in `medusa_choices.json`."), tree_line


REPORT = {"tau": 2.5, "speedup": 1.8, "tokens_per_s_medusa": 90, "tokens_per_s_baseline": 50}
TREE = {"context_len": 256, "best": {"nodes": 2}, "choices": [[0], [1]]}


@pytest.mark.parametrize(
    ("data", "expected", "problem"),
    [
        ({**REPORT, "speedup": True}, REPORT_INPUT, "'speedup' is a JSON boolean where a number is expected"),
        ({**REPORT, "greedy_identical": False}, REPORT_INPUT, "'greedy_identical' is a JSON boolean"),
        (
            {**REPORT, "vllm_chain": [{"num_speculative_tokens": True, "tau": 1.5}]},
            REPORT_INPUT,
            "'vllm_chain[0].num_speculative_tokens' is a JSON boolean where a number is expected",
        ),
        ({**REPORT, "tree_choices": [[0], [False]]}, REPORT_INPUT, "'tree_choices[1][0]' is a JSON boolean"),
        (
            {"tree": {**TREE, "context_len": True}},
            CALIBRATION_INPUT,
            "'tree.context_len' is a JSON boolean where a number is expected",
        ),
        (
            {"tree": {**TREE, "best": {"nodes": True}}},
            CALIBRATION_INPUT,
            "'tree.best.nodes' is a JSON boolean",
        ),
        (
            {"head_topk_accuracy": [[0.5, True]]},
            CALIBRATION_INPUT,
            "'head_topk_accuracy[0][1]' is a JSON boolean",
        ),
    ],
)
def test_a_json_boolean_is_no_number(data: dict, expected, problem: str) -> None:
    """JSON true/false where a number is expected is a damaged file (Python's bool is an int)."""
    assert shape_problem(data, expected).startswith(problem)


def test_json_numbers_pass_where_numbers_are_expected() -> None:
    assert (
        shape_problem(
            {**REPORT, "speedup": 2, "vllm_chain": [{"num_speculative_tokens": 1, "tau": 2}]}, REPORT_INPUT
        )
        is None
    )
    assert (
        shape_problem({"tree": TREE, "head_topk_accuracy": [[0, 1], [0.5, 0.75]]}, CALIBRATION_INPUT) is None
    )


def test_the_speedup_quartiles_come_as_a_pair() -> None:
    """A report.json with one quartile of the speed-up and not the other is damaged (the card prints the
    spread between them); both or neither are whole."""
    assert (
        shape_problem({**REPORT, "speedup_q25": 1.5}, REPORT_INPUT)
        == "has 'speedup_q25' without 'speedup_q75'"
    )
    assert (
        shape_problem({**REPORT, "speedup_q75": 2.1}, REPORT_INPUT)
        == "has 'speedup_q75' without 'speedup_q25'"
    )
    both = {**REPORT, "speedup_q25": 1.5, "speedup_q75": 2.1}
    assert shape_problem(both, REPORT_INPUT) is None and shape_problem(REPORT, REPORT_INPUT) is None
    assert headline_speedup(both) == "1.80x (1.50-2.10)" and headline_speedup(REPORT) == "1.80x"
