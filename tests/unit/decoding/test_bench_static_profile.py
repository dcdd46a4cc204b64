"""scripts/bench_static_profile.py runs end to end on CPU (tiny shape): each part of the step is found."""

from __future__ import annotations

import json

import pytest

from tests.helpers.scripts import load_script


def test_tiny_cpu_profile_splits_the_step_into_its_parts(tmp_path, capsys):
    profile = load_script("bench_static_profile")
    out = tmp_path / "profile.json"
    assert (
        profile.main(["--device", "cpu", "--tiny", "--context", "32", "--steps", "6", "--json", str(out)])
        == 0
    )
    results = json.loads(out.read_text())
    plain, tree = results["cases"]
    assert (plain["nodes"], tree["nodes"]) == (1, 64) and plain["steps"] == 6 and 1 <= tree["steps"] <= 6

    def ms(case, part, kind=None):
        return sum(c["ms"] for c in case["cells"] if c["part"] == part and kind in (None, c["kind"]))

    for case in (plain, tree):  # the backbone's products and attention are found, and the parts add up
        assert (
            ms(case, "backbone forward", "weight products") > 0
            and ms(case, "backbone forward", "attention") > 0
        )
        total = sum(ms(case, part) for part in profile.PARTS)
        assert abs(total - case["ms_per_step"]) < 1e-9 * max(1.0, total)
    assert ms(plain, "heads") == 0 < ms(tree, "heads")  # a 1-node tree asks no head
    assert "| nodes | step ms (count) |" in capsys.readouterr().out
    assert profile.kind_of("void gemv2T_kernel_val<int, int, __nv_bfloat16>") == "weight products"
    assert profile.kind_of("nvjet_tst_64x8_64x16_2x1_v_bz_TNT") == "weight products"
    assert (
        profile.kind_of("tree_attn_fwd") == profile.kind_of("pytorch_flash::flash_fwd_kernel") == "attention"
    )
    assert profile.kind_of("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0") == profile.REST


def test_no_cuda_device_is_one_line_and_exit_2(capsys, monkeypatch):
    profile = load_script("bench_static_profile")
    monkeypatch.setattr(profile.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        profile.parse_args(["--device", "cuda"])
    assert exit_.value.code == 2 and "no CUDA device here" in capsys.readouterr().err
