"""TreeBuffers: hand-checked small trees, the 63-node Medusa tree, validation, JSON round-trip."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from medusa_train.decoding import MEDUSA_63, TreeBuffers, TreeError, chain_tree, load_choices, save_choices
from medusa_train.decoding.tree import resolve_tree
from medusa_train.errors import UserError

# From the seed notes (Medusa's generate_medusa_buffers on mc_sim_7b_63).
SEED_TREE_INDICES = [
    0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 11, 12, 13, 14, 15, 16, 17,
    11, 12, 13, 11, 12, 11, 11, 11, 11, 11, 11, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 21, 22, 23, 21, 22,
    21, 21, 21, 21, 21, 21, 22, 21, 31, 32,
]  # fmt: skip
SEED_POSITIONS = [0] + [1] * 10 + [2] * 28 + [3] * 23 + [4] * 2


def test_small_tree_by_hand():
    tree = TreeBuffers.from_choices([[0, 0], [1], [0]])  # any input order
    assert tree.choices == ((0,), (1,), (0, 0))
    # nodes: 0 root, 1 (0,), 2 (1,), 3 (0, 0)
    expected_mask = torch.tensor(
        [
            [1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 0, 1, 0],
            [1, 1, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree.attn_mask, expected_mask)
    assert tree.depth.tolist() == [0, 1, 1, 2]
    assert tree.topk == 2 and tree.max_depth == 2
    # flat candidates: [root, h1 r0, h1 r1, h2 r0, h2 r1]
    assert tree.tree_indices.tolist() == [0, 1, 2, 3]
    assert tree.retrieve_indices.tolist() == [[0, 2, -1], [0, 1, 3]]
    assert tree.parents.tolist() == [-1, 0, 0, 1]
    assert tree.children.tolist() == [[1, 2], [3, -1], [-1, -1], [-1, -1]]
    assert tree.num_nodes == 4 and tree.num_leaves == 2


def test_deep_rank_indices():
    tree = TreeBuffers.from_choices([[0], [2], [2, 1]])
    assert tree.topk == 3
    # (2,) -> 1 + 0 * 3 + 2; (2, 1) -> 1 + 1 * 3 + 1
    assert tree.tree_indices.tolist() == [0, 1, 3, 5]


def test_medusa_63_matches_seed():
    tree = TreeBuffers.from_choices(MEDUSA_63)
    assert len(MEDUSA_63) == 63
    assert tree.num_nodes == 64 and tree.num_leaves == 42
    assert tree.max_depth == 4 and tree.topk == 10
    assert tree.tree_indices.tolist() == SEED_TREE_INDICES
    assert tree.depth.tolist() == SEED_POSITIONS
    assert tuple(tree.retrieve_indices.shape) == (42, 5)
    # every node attends to exactly its ancestors and itself
    assert torch.equal(tree.attn_mask.sum(dim=1), tree.depth + 1)
    for n in range(1, 64):
        assert tree.attn_mask[n, tree.parents[n]]
        assert torch.equal(
            tree.attn_mask[n] & ~tree.attn_mask[tree.parents[n]], torch.eye(64, dtype=torch.bool)[n]
        )
    # each retrieve row is a valid root-to-leaf chain
    for row in tree.retrieve_indices.tolist():
        nodes = [r for r in row if r >= 0]
        assert nodes[0] == 0
        assert all(tree.parents[b] == a for a, b in zip(nodes, nodes[1:], strict=False))
        assert (tree.children[nodes[-1]] == -1).all()


def test_canonical_order_is_deterministic():
    shuffled = list(reversed(MEDUSA_63))
    a, b = TreeBuffers.from_choices(MEDUSA_63), TreeBuffers.from_choices(shuffled)
    assert a.choices == b.choices
    assert torch.equal(a.attn_mask, b.attn_mask) and torch.equal(a.retrieve_indices, b.retrieve_indices)


def test_chain_and_prefix():
    assert chain_tree(3) == [[0], [0, 0], [0, 0, 0]]
    tree = TreeBuffers.from_choices(MEDUSA_63)
    sub = tree.prefix(2)
    assert sub.max_depth == 2 and sub.num_nodes == 1 + 10 + 28
    assert torch.equal(sub.attn_mask, tree.attn_mask[:39, :39])
    assert tree.prefix(0).num_nodes == 1
    assert tree.prefix(4) is tree
    root_only = TreeBuffers.from_choices([])
    assert root_only.num_nodes == 1 and root_only.retrieve_indices.tolist() == [[0]]


@pytest.mark.parametrize(
    ("choices", "fragment"),
    [
        ([[0], [1, 0]], "[1, 0] has no parent"),
        ([[0], [0, 0, 0]], "[0, 0, 0] has no parent"),
        ([[0], [0]], "[0] appears more than once"),
        ([[0], [-1]], "[-1] has entry -1"),
        ([[0], [0.5]], "entry 0.5"),
        ([[0], [True]], "entry True"),
        ([[0], []], "[] is not a non-empty"),
        ("[[0]]", "list of index paths"),
    ],
)
def test_bad_trees_rejected(choices, fragment):
    with pytest.raises(TreeError) as err:
        TreeBuffers.from_choices(choices)
    assert fragment in str(err.value)
    assert isinstance(err.value, ValueError)


def test_depth_checked_against_heads():
    tree = TreeBuffers.from_choices(chain_tree(5))
    tree.check_heads(5)
    with pytest.raises(TreeError, match=r"\[0, 0, 0, 0, 0\] has depth 5 but there are only 4"):
        tree.check_heads(4)


def test_json_round_trip(tmp_path):
    path = save_choices(tmp_path / "tree.json", list(reversed(MEDUSA_63)))
    loaded = load_choices(path)
    assert loaded == [list(p) for p in TreeBuffers.from_choices(MEDUSA_63).choices]
    (tmp_path / "bad.json").write_text("[[0], [2, 1]]")
    with pytest.raises(TreeError, match=r"\[2, 1\] has no parent"):
        load_choices(tmp_path / "bad.json")
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(TreeError, match="cannot read"):
        load_choices(tmp_path / "junk.json")


def test_save_choices_is_atomic(tmp_path, monkeypatch):
    """A write that fails half-way (a full disk) leaves the previous tree and no temp file."""
    path = save_choices(tmp_path / "tree.json", chain_tree(3))
    before = path.read_bytes()
    real_write_text = Path.write_text

    def half_then_full(self, text, *args, **kwargs):
        real_write_text(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_text", half_then_full)
    with pytest.raises(OSError, match="No space left"):
        save_choices(path, MEDUSA_63)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert load_choices(path) == chain_tree(3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tree.json"]


def test_package_needs_only_torch_and_transformers():
    code = (
        "import sys, medusa_train.decoding\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('hydra', 'omegaconf', 'datasets', 'deepspeed', 'wandb')"
        " or m.startswith('medusa_train.training') or m.startswith('medusa_train.stages')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[3])


def test_tree_ranks_must_fit_the_heads_vocabulary_and_errors_are_user_errors(tmp_path: Path) -> None:
    """A rank no head can give, or ints instead of paths, is one UserError line, not a traceback."""
    tree = TreeBuffers.from_choices([[0], [7], [7, 3]])
    tree.check_heads(2, vocab_size=8)  # rank 7 is the 8th candidate: fine
    with pytest.raises(TreeError, match=r"tree path \[7\] asks for rank 7 but the heads give only 7"):
        tree.check_heads(2, vocab_size=7)
    assert issubclass(TreeError, UserError)
    with pytest.raises(UserError, match=r"tree=custom: tree path 1 is not a non-empty list"):
        resolve_tree("custom", tmp_path, 3, vocab_size=100, choices=[1, 2, 3])
    with pytest.raises(UserError, match=r"rank 200"):
        resolve_tree("custom", tmp_path, 3, vocab_size=100, choices=[[0], [200]])


def test_a_damaged_calibrated_tree_names_the_stage_that_writes_it_again(tmp_path: Path) -> None:
    """stage=train writes the heads' medusa_choices.json; an export's copy (one folder up from its
    medusa/ layout) is written again by stage=export, which stage=train alone would not do."""
    heads, export = tmp_path / "heads", tmp_path / "export"
    for folder in (heads, export / "medusa"):
        folder.mkdir(parents=True)
    (heads / "medusa_choices.json").write_text("[[0], [0")
    (export / "medusa_choices.json").write_text("[[0], [0")
    with pytest.raises(UserError, match=r"run `python -m medusa_train stage=train` to calibrate again, or"):
        resolve_tree("calibrated", heads, 2)
    with pytest.raises(UserError) as refused:
        resolve_tree("calibrated", export / "medusa", 2)
    assert "run `python -m medusa_train stage=export` to copy the heads' tree into the export again" in str(
        refused.value
    )
    assert "\n" not in str(refused.value)


def test_a_damaged_tree_of_an_export_named_by_its_own_folder_names_stage_export(tmp_path: Path) -> None:
    """``eval.heads_dir=<export>`` (the export folder itself, which holds ``medusa/``): the tree beside
    it is the export's copy, which stage=export writes again, as for its ``medusa/`` folder."""
    export = tmp_path / "export"
    (export / "medusa").mkdir(parents=True)
    (export / "medusa" / "config.json").write_text("{}")
    (export / "medusa_choices.json").write_text("[[0], [0")
    with pytest.raises(UserError) as refused:
        resolve_tree("calibrated", export, 2)
    assert "run `python -m medusa_train stage=export` to copy the heads' tree into the export again" in str(
        refused.value
    )
