"""scripts/sweep_head_loss.py: the oracle-head replay behind its ``ceiling``."""

from __future__ import annotations

from tests.helpers.scripts import load_script

sweep = load_script("sweep_head_loss")
PATHS = {tuple(p) for p in sweep.MEDUSA_63 if len(p) <= 4}


def test_replay_of_argmax_tokens_accepts_the_whole_depth_until_the_budget() -> None:
    # 12 steps of root + 4 nodes, then the last 4 tokens in one step
    assert sweep.replay_tau([0] * 64, PATHS, 4, 64) == (64, 13)
    # a reply ended by EOS after 10 tokens: 5 + 5
    assert sweep.replay_tau([0] * 10, PATHS, 4, 64) == (10, 2)


def test_replay_accepts_nothing_when_no_node_holds_the_drawn_rank() -> None:
    assert sweep.replay_tau([0] + [500] * 9, PATHS, 4, 64) == (10, 10)


def test_replay_follows_the_tree_paths_of_the_ranks() -> None:
    assert (1, 0) in PATHS and (0, 1) in PATHS
    # root, then ranks (1, 0) accepted, the next token (rank 500) starts the second step
    assert sweep.replay_tau([0, 1, 0, 500], PATHS, 4, 64) == (4, 2)
    # depth 1: one node per step at most
    assert sweep.replay_tau([0] * 8, {(0,)}, 1, 64) == (8, 4)
