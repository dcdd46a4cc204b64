"""Head projection variants: shared lm_head and truncated draft vocabulary.

Greedy parity with ``generate``; candidates mapped through the token map (a permuted full map decodes
exactly like own heads); the losses and held-out accuracy over full-vocabulary targets; the files
each variant writes (our layout and vLLM's, names pinned against vLLM's Medusa loader); bad inputs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from medusa_train.config import TreeConfig
from medusa_train.custom_generate import generate as custom_generate
from medusa_train.decoding import (
    MEDUSA_63,
    PackedHeads,
    StaticDecoder,
    TreeBuffers,
    TreeError,
    chain_tree,
    medusa_generate,
    medusa_generate_batch,
)
from medusa_train.decoding.calibrate import head_topk_counts
from medusa_train.decoding.tree import tree_for_heads
from medusa_train.draft_vocab import check_token_map, draft_token_map
from medusa_train.errors import HeadsFormatError, UserError
from medusa_train.formats import (
    VLLM_WEIGHTS_NAME,
    load_heads,
    save_medusa,
    save_vllm,
    vllm_config,
)
from medusa_train.head_targets import IGNORE_INDEX
from medusa_train.heads import MedusaHeads
from medusa_train.training.losses import medusa_head_loss, naive_medusa_head_loss
from medusa_train.workdir import HEADS_CONFIG, HEADS_WEIGHTS
from tests.helpers.models import VOCAB, random_heads, tiny_model
from tests.helpers.numerics import FP32

D = 32


def _randomise(heads: MedusaHeads, seed: int, std: float = 0.5) -> MedusaHeads:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0.0, std)
    return heads.eval()


def _truncated_from(own: MedusaHeads, token_map: torch.Tensor) -> MedusaHeads:
    """Truncated heads with ``own``'s blocks and the ``token_map`` rows of its projections."""
    heads = MedusaHeads(
        D, own.vocab_size, own.num_heads, own.num_layers, head_projection="truncated", token_map=token_map
    )
    state = {
        k: v[token_map] if k.endswith(f".{own.num_layers}.weight") else v
        for k, v in own.heads.state_dict().items()
    }
    heads.heads.load_state_dict(state)
    return heads.eval()


def _shared_from(own: MedusaHeads, model) -> MedusaHeads:
    """Shared heads with ``own``'s blocks, bound to ``model``'s lm_head."""
    heads = MedusaHeads(D, own.vocab_size, own.num_heads, own.num_layers, head_projection="shared")
    heads.heads.load_state_dict({k: v for k, v in own.heads.state_dict().items() if "linear" in k})
    return heads.attach(model).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3)


# -- decoding -------------------------------------------------------------------------------------
def test_packed_truncated_logits_are_full_vocabulary_with_minus_inf_outside(model):
    own = random_heads(model, seed=1)
    token_map = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:40]
    heads = _truncated_from(own, token_map)
    hidden = torch.randn(D)
    full = PackedHeads(heads).logits(hidden)  # (K, V)
    ref = PackedHeads(own).logits(hidden)
    torch.testing.assert_close(full[:, token_map], ref[:, token_map], rtol=1e-5, atol=1e-5)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[token_map] = False
    assert torch.isneginf(full[:, outside]).all()
    torch.testing.assert_close(heads.full_vocab_logits(heads(hidden[None, None]))[:, 0, 0], full)


def test_truncated_heads_built_under_a_device_keep_their_token_map_there():
    # On one H100 the static decoder failed on heads built under `with torch.device("cuda")`: their
    # token map stayed on the CPU and index_copy_ into CUDA logits refused it. The meta device stands
    # in for the GPU here: every buffer and the packed map must follow the parameters.
    token_map = torch.tensor([5, 1, 9])
    with torch.device("meta"):
        heads = MedusaHeads(D, VOCAB, num_heads=2, head_projection="truncated", token_map=token_map)
    assert {t.device.type for t in (*heads.parameters(), heads.token_map, heads.draft_index)} == {"meta"}
    assert PackedHeads(heads).token_map.device.type == "meta"
    assert MedusaHeads(D, VOCAB, head_projection="truncated", token_map=token_map).token_map.tolist() == [
        5,
        1,
        9,
    ]


@pytest.mark.parametrize("tree", [MEDUSA_63, chain_tree(4)], ids=["medusa63", "chain4"])
def test_variants_decode_exactly_like_equivalent_own_heads(model, tree):
    """A truncated head over a permuted full map and a shared head over the lm_head propose the same
    full-vocabulary candidates as the own heads they are built from: same tokens, same step lengths.
    A mapping bug (candidates left as draft indices) changes the accepted lengths."""
    blocks = random_heads(model, seed=4, std=0.3)  # random blocks; projections replaced below
    own = random_heads(model, seed=4, std=0.3)
    own.init_from_lm_head(model.get_output_embeddings().weight)
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))
    variants = {
        "own": own,
        "truncated-full": _truncated_from(own, perm),
        "shared": _shared_from(own, model),
        "own-random": blocks,
        "truncated-random": _truncated_from(blocks, perm),
    }
    prompt = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    ref = model.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=0)[0, 9:].tolist()
    tree = TreeBuffers.from_choices(tree)
    outs = {
        name: medusa_generate(model, h, prompt, max_new_tokens=40, tree=tree) for name, h in variants.items()
    }
    for name, out in outs.items():
        assert out.tokens.tolist() == ref, name  # greedy parity with generate
    assert outs["truncated-full"].accepted_lengths == outs["own"].accepted_lengths
    assert outs["shared"].accepted_lengths == outs["own"].accepted_lengths
    assert outs["truncated-random"].accepted_lengths == outs["own-random"].accepted_lengths


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("kind", ["shared", "truncated"])
def test_greedy_parity_with_generate(arch, kind):
    model = tiny_model(arch, seed=5)
    own = random_heads(model, seed=6)
    heads = (
        _shared_from(own, model)
        if kind == "shared"
        else _truncated_from(own, torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:16])
    )
    gen = torch.Generator().manual_seed(7)
    for prompt_len in (1, 6, 17):
        prompt = torch.randint(1, VOCAB, (1, prompt_len), generator=gen)
        ref = model.generate(prompt, max_new_tokens=30, do_sample=False, pad_token_id=0)[0, prompt_len:]
        out = medusa_generate(model, heads, prompt, max_new_tokens=30, tree=MEDUSA_63)
        assert out.tokens.tolist() == ref.tolist(), (arch, kind, prompt_len)
        assert sum(out.accepted_lengths) == 30


def test_batched_decoder_maps_candidates_too(model):
    """medusa_generate_batch reads the same full-vocabulary logits (PackedHeads.logits_rows): every row
    equals plain greedy, and each row's accepted lengths equal the equivalent own heads'."""
    own = random_heads(model, seed=4, std=0.3)
    own.init_from_lm_head(model.get_output_embeddings().weight)
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))
    hidden = torch.randn(3, D)
    for heads in (_truncated_from(own, perm[:40]), _shared_from(own, model)):
        rows = PackedHeads(heads).logits_rows(hidden)  # (3, K, V)
        for b in range(3):  # batched vs one-row products: equal to float rounding, -inf where truncated
            torch.testing.assert_close(rows[b], PackedHeads(heads).logits(hidden[b]), **FP32)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen) for n in (3, 9, 5)]
    variants = {"own": own, "truncated": _truncated_from(own, perm), "shared": _shared_from(own, model)}
    outs = {
        name: medusa_generate_batch(model, h, prompts, max_new_tokens=24, tree=MEDUSA_63)
        for name, h in variants.items()
    }
    for b, prompt in enumerate(prompts):
        ref = model.generate(prompt[None], max_new_tokens=24, do_sample=False, pad_token_id=0)[
            0, len(prompt) :
        ]
        for name, out in outs.items():
            assert out.rows[b].tokens.tolist() == ref.tolist(), (name, b)
        assert outs["truncated"].rows[b].accepted_lengths == outs["own"].rows[b].accepted_lengths
        assert outs["shared"].rows[b].accepted_lengths == outs["own"].rows[b].accepted_lengths


def test_a_tree_ranked_past_a_truncated_draft_vocabulary_is_refused_before_any_work(tmp_path: Path, model):
    """Truncated heads propose N tokens (their logits are -inf elsewhere): a rank >= N is refused by the
    stages' tree check and by every decoder in one line, not checked against V and then decoded with
    nodes that are never a draft."""
    heads = _truncated_from(random_heads(model, seed=2), torch.arange(8) * 3)  # N = 8 < V
    fits, past = [[0], [7], [7, 0]], [[0], [8]]
    assert tree_for_heads(TreeConfig(name="custom", choices=fits), tmp_path, heads) == fits
    with pytest.raises(UserError, match=r"asks for rank 8 but the heads give only 8 candidates") as err:
        tree_for_heads(TreeConfig(name="custom", choices=past), tmp_path, heads)
    assert "\n" not in str(err.value)
    prompt = torch.tensor([[3, 17, 9]])
    for h in (heads, PackedHeads(heads)):
        assert len(medusa_generate(model, h, prompt, max_new_tokens=4, tree=fits).tokens) == 4
        with pytest.raises(TreeError, match="rank 8 but the heads give only 8"):
            medusa_generate(model, h, prompt, max_new_tokens=4, tree=past)
        with pytest.raises(TreeError, match="rank 8 but the heads give only 8"):
            medusa_generate_batch(model, h, [prompt[0], prompt[0, 1:]], max_new_tokens=4, tree=past)
        with pytest.raises(TreeError, match="rank 8 but the heads give only 8"):
            StaticDecoder(model, h, past, capacity=32)
    heads.save_pretrained(tmp_path / "heads")
    with pytest.raises(ValueError, match="bad Medusa tree: .*rank 8 but the heads give only 8"):
        custom_generate(
            model, input_ids=prompt, max_new_tokens=4, medusa_heads=tmp_path / "heads", medusa_choices=past,
            medusa_check_base=False,
        )  # fmt: skip


def test_shared_packed_heads_hold_no_copy_of_the_lm_head(model):
    heads = _shared_from(random_heads(model, seed=1), model)
    packed = PackedHeads(heads)
    assert packed.w2t is None
    assert packed.shared.data_ptr() == model.get_output_embeddings().weight.data_ptr()


# -- training and calibration ----------------------------------------------------------------------
def _rows_and_targets(n: int = 50, k: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, D, generator=gen)
    targets = torch.randint(0, VOCAB, (n, k), generator=gen)
    targets[torch.rand(n, k, generator=gen) < 0.2] = IGNORE_INDEX
    return hidden, targets


def test_truncated_loss_counts_only_targets_in_the_map():
    own = _randomise(MedusaHeads(D, VOCAB, 3, 1), 0, std=0.2)
    token_map = torch.arange(0, VOCAB, 2)  # even ids only
    heads = _truncated_from(own, token_map)
    hidden, targets = _rows_and_targets()
    out = medusa_head_loss(heads, hidden, targets, decay=0.8, chunk_size=7)
    torch.testing.assert_close(
        out.loss, naive_medusa_head_loss(heads, hidden, targets, 0.8), rtol=1e-5, atol=1e-6
    )
    # By hand for head 1: CE over the 64-way draft softmax, rows whose target is even only.
    y = targets[:, 0]
    keep = (y != IGNORE_INDEX) & (y % 2 == 0)
    logits = heads(hidden)[0]  # (N, 64)
    torch.testing.assert_close(out.ce[0], F.cross_entropy(logits[keep], y[keep] // 2), rtol=1e-5, atol=1e-6)
    assert (
        out.count.tolist() == (targets != IGNORE_INDEX).sum(0).tolist()
    )  # every target counted for accuracy
    out.loss.backward()
    assert all(p.grad is not None for p in heads.parameters())


def test_shared_loss_trains_blocks_only():
    model = tiny_model("llama", seed=1)
    lm_head = model.get_output_embeddings().weight
    lm_head.requires_grad_(True)
    heads = _shared_from(_randomise(MedusaHeads(D, VOCAB, 3, 1), 1, std=0.2), model).train()
    hidden, targets = _rows_and_targets(seed=1)
    out = medusa_head_loss(heads, hidden, targets, decay=0.8, chunk_size=9)
    torch.testing.assert_close(
        out.loss, naive_medusa_head_loss(heads, hidden, targets, 0.8), rtol=1e-5, atol=1e-6
    )
    out.loss.backward()
    assert lm_head.grad is None  # bound detached: the heads' loss never trains the lm_head
    assert [n for n, _ in heads.named_parameters()] == [
        f"heads.{h}.0.linear.{p}" for h in range(3) for p in ("weight", "bias")
    ]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in heads.parameters())


def test_calibration_scores_full_vocabulary_targets(model):
    """Truncated heads: same count as own, a target outside the map is a miss; a permuted full map
    scores exactly like the own heads."""
    own = random_heads(model, seed=2)
    ids = torch.randint(1, VOCAB, (3, 20), generator=torch.Generator().manual_seed(4))
    batches = [ids]
    hits_own, count_own = head_topk_counts(model, own, batches, max_k=10)
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))
    hits_full, count_full = head_topk_counts(model, _truncated_from(own, perm), batches, max_k=10)
    assert torch.equal(hits_full, hits_own) and torch.equal(count_full, count_own)
    hits_half, count_half = head_topk_counts(model, _truncated_from(own, perm[:32]), batches, max_k=10)
    assert torch.equal(count_half, count_own)
    assert (hits_half[:, -1] <= count_half).all()
    in_map = torch.isin(ids[:, 2:], perm[:32]).sum()  # head 1's targets: positions 2.. of each row
    assert hits_half[0, -1] <= in_map


def test_draft_token_map_is_most_frequent_ties_to_smaller_ids():
    counts = torch.tensor([5, 0, 9, 5, 1, 5, 0, 2])
    token_map, coverage = draft_token_map(counts, 3)
    assert token_map.tolist() == [0, 2, 3]  # 9, then the two smallest ids of the 5s
    assert coverage == pytest.approx(19 / 27)
    assert draft_token_map(counts, 8)[1] == 1.0
    with pytest.raises(HeadsFormatError, match="does not fit"):
        draft_token_map(counts, 9)


# -- files ------------------------------------------------------------------------------------------
def test_truncated_heads_round_trip_our_layout_and_vllm(tmp_path: Path, model):
    token_map = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(8))[:48]
    heads = _truncated_from(random_heads(model, num_heads=3, seed=9), token_map)
    heads.save_pretrained(tmp_path / "ours")
    tensors = load_file(str(tmp_path / "ours" / HEADS_WEIGHTS))
    assert torch.equal(tensors["token_map"], token_map) and tensors["token_map"].dtype == torch.int64
    assert tensors["0.1.weight"].shape == (48, D)
    config = json.loads((tmp_path / "ours" / HEADS_CONFIG).read_text())
    assert (config["head_projection"], config["draft_vocab_size"], config["vocab_size"]) == (
        "truncated",
        48,
        VOCAB,
    )
    hidden = torch.randn(2, 3, D)
    for back in (MedusaHeads.from_pretrained(tmp_path / "ours"), load_heads(tmp_path / "ours")):
        assert torch.equal(back.token_map, token_map) and torch.equal(back(hidden), heads(hidden))
    # vLLM: exactly the names and config keys vllm/model_executor/models/medusa.py reads.
    save_vllm(heads, tmp_path / "vllm")
    tensors = load_file(str(tmp_path / "vllm" / VLLM_WEIGHTS_NAME))
    assert set(tensors) == {"token_map"} | {f"lm_heads.{h}.weight" for h in range(3)} | {
        f"blocks.{h}.layers.0.{p}" for h in range(3) for p in ("weight", "bias")
    }
    assert tensors["lm_heads.0.weight"].shape == (48, D) and tensors["token_map"].dtype == torch.int64
    config = json.loads((tmp_path / "vllm" / HEADS_CONFIG).read_text())
    assert config["truncated_vocab_size"] == 48 and config["vocab_size"] == VOCAB
    assert "original_lm_head" not in config
    back = load_heads(tmp_path / "vllm")
    assert torch.equal(back(hidden), heads(hidden))
    # vLLM's compute_logits: -inf everywhere, the draft logits scattered to token_map.
    draft = hidden @ tensors["lm_heads.1.weight"].t()  # blocks ignored: compare the projection only
    vllm_logits = torch.full((2, 3, VOCAB), float("-inf"))
    vllm_logits[..., tensors["token_map"]] = draft
    assert torch.equal(heads.full_vocab_logits(draft), vllm_logits)
    with pytest.raises(HeadsFormatError, match="export.formats=\\[vllm\\]"):
        save_medusa(heads, tmp_path / "medusa")


def test_vllm_refuses_a_token_map_of_the_whole_vocabulary(tmp_path: Path, model):
    """vLLM keeps a token_map only when truncated_vocab_size < vocab_size: with N = V it would read the
    rows of a permuted map as full-vocabulary rows, so such heads are refused, not written."""
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))
    heads = _truncated_from(random_heads(model, num_heads=2, seed=12), perm)
    with pytest.raises(HeadsFormatError, match=f"all {VOCAB} tokens.*training.head_projection=own"):
        save_vllm(heads, tmp_path / "vllm")
    assert not (tmp_path / "vllm" / VLLM_WEIGHTS_NAME).exists()


def test_the_fingerprint_tells_token_maps_apart(tmp_path: Path, model):
    """Truncated heads with the same tensors but another token map draft other tokens: other heads, so
    another fingerprint (a model card states an eval's tau only for heads of the fingerprint it
    measured); the fingerprint survives both layouts' round trip."""
    first = _truncated_from(random_heads(model, num_heads=2, seed=11), torch.arange(40))
    flipped = torch.arange(40).flip(0)  # the same projection rows for other token ids
    second = MedusaHeads(D, VOCAB, 2, 1, head_projection="truncated", token_map=flipped)
    second.heads.load_state_dict(first.heads.state_dict())
    assert first.fingerprint() != second.fingerprint()
    save_vllm(second, tmp_path / "vllm")
    assert load_heads(tmp_path / "vllm").fingerprint() == second.fingerprint()
    second.save_pretrained(tmp_path / "ours")
    assert MedusaHeads.from_pretrained(tmp_path / "ours").fingerprint() == second.fingerprint()


def test_shared_heads_files(tmp_path: Path, model):
    heads = _shared_from(random_heads(model, num_heads=3, seed=10), model)
    save_medusa(heads, tmp_path / "medusa")
    tensors = load_file(str(tmp_path / "medusa" / HEADS_WEIGHTS))
    assert set(tensors) == {f"{h}.0.linear.{p}" for h in range(3) for p in ("weight", "bias")}  # no lm_head
    config = json.loads((tmp_path / "medusa" / HEADS_CONFIG).read_text())
    assert config["head_projection"] == "shared" and config["version"] == "2"
    back = load_heads(tmp_path / "medusa")
    assert back.head_projection == "shared" and not back.is_bound
    hidden = torch.randn(2, 3, D)
    assert torch.equal(back.attach(model)(hidden), heads(hidden))
    # FasterDecoding's medusa2 heads (PR #97) carry no head_projection key: version 2 + no projection.
    del config["head_projection"]
    (tmp_path / "medusa" / HEADS_CONFIG).write_text(json.dumps(config))
    assert load_heads(tmp_path / "medusa").head_projection == "shared"
    # vLLM: original_lm_head and ONE lm_heads.0.weight, the backbone's lm_head.
    save_vllm(heads, tmp_path / "vllm")
    tensors = load_file(str(tmp_path / "vllm" / VLLM_WEIGHTS_NAME))
    assert [k for k in tensors if k.startswith("lm_heads")] == ["lm_heads.0.weight"]
    assert torch.equal(tensors["lm_heads.0.weight"], model.get_output_embeddings().weight)
    config = json.loads((tmp_path / "vllm" / HEADS_CONFIG).read_text())
    assert config == {**vllm_config(heads), "original_lm_head": True}
    assert config["truncated_vocab_size"] == VOCAB
    back = load_heads(tmp_path / "vllm")  # bound to the file's lm_heads.0
    assert back.is_bound and torch.equal(back(hidden), heads(hidden))


def test_heads_fit_the_last_hidden_state_not_what_the_lm_head_reads():
    """ELECTRA's causal LM: its LM head reads a prediction head's 16-wide output of the 32-wide last
    hidden state the heads read. Heads 32 wide fit it, in ``attach`` (export, custom_generate, train) and
    in stage=eval's check (16-wide ones were the ones taken); shared heads, which would project that last
    hidden state with its LM head, are refused."""
    from medusa_train.stages.eval import check_heads_match

    model = tiny_model("electra")
    MedusaHeads(D, VOCAB, 2, 1).attach(model)
    check_heads_match(MedusaHeads(D, VOCAB, 2, 1), model, Path("heads"), "electra")
    with pytest.raises(
        HeadsFormatError,
        match=f"heads are for hidden_size=16, vocab_size={VOCAB} but the backbone has hidden_size=32",
    ):
        MedusaHeads(16, VOCAB, 2, 1).attach(model)
    with pytest.raises(UserError, match="trained for hidden_size=16"):
        check_heads_match(MedusaHeads(16, VOCAB, 2, 1), model, Path("heads"), "electra")
    shared = (
        "shared heads project with the backbone's lm_head, but ElectraForCausalLM's reads 16-wide vectors "
        "(a prediction head's output), not its 32-wide last hidden state, which the heads read: use "
        "head_projection own or truncated"
    )
    with pytest.raises(HeadsFormatError) as err:
        MedusaHeads(D, VOCAB, 2, 1, head_projection="shared").attach(model)
    assert str(err.value) == shared


# -- bad input --------------------------------------------------------------------------------------
def test_bad_token_maps_and_backbones_are_refused(model):
    with pytest.raises(HeadsFormatError, match="outside the vocabulary"):
        check_token_map(torch.tensor([0, 5, VOCAB]), VOCAB)
    with pytest.raises(HeadsFormatError, match="repeats"):
        check_token_map(torch.tensor([3, 3]), VOCAB)
    with pytest.raises(HeadsFormatError, match="more than"):
        check_token_map(torch.arange(VOCAB + 1), VOCAB)
    # Heads for a larger vocabulary than the backbone's: a token map beyond the backbone.
    big = MedusaHeads(
        D, 2 * VOCAB, 2, 1, head_projection="truncated", token_map=torch.tensor([1, 2 * VOCAB - 1])
    )
    with pytest.raises(HeadsFormatError, match="token_map holds ids up to"):
        big.attach(model)

    class NoLMHead(torch.nn.Module):
        def get_output_embeddings(self):
            return None

    with pytest.raises(HeadsFormatError, match="no output embedding"):
        MedusaHeads(D, VOCAB, 2, 1, head_projection="shared").attach(NoLMHead())
    with pytest.raises(HeadsFormatError, match="not bound"):
        MedusaHeads(D, VOCAB, 2, 1, head_projection="shared")(torch.randn(1, D))
    with pytest.raises(HeadsFormatError, match="num_layers >= 1"):
        MedusaHeads(D, VOCAB, 2, 0, head_projection="shared")
