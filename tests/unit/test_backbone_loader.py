"""Loading backbones: one code path for every model; identity follows the checkpoint, not the load."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import transformers.utils
from huggingface_hub import constants
from safetensors.torch import load_file, save_file

from medusa_train.backbone import (
    TENSORS_PREFIX,
    backbone_for_heads,
    backbone_identity,
    checkpoint_fingerprint,
    load_backbone,
    load_tokenizer,
    local_fingerprint,
    older_fingerprint,
    other_code_fingerprint,
    resolve_device,
    resolve_dtype,
)
from medusa_train.backbone_source import CONFIG_NAME
from medusa_train.config import ModelConfig, compose_config
from medusa_train.data.chat import ChatRenderer
from medusa_train.data.sources import Conversation
from medusa_train.errors import DamagedArtefactError, UserError
from tests.helpers.train_workdir import make_backbone, make_tokenizer


def test_identity_is_the_checkpoint_whatever_the_dtype(tmp_path: Path) -> None:
    make_backbone(tmp_path / "a", seed=0)
    make_backbone(tmp_path / "b", seed=1)
    a32, _ = load_backbone(str(tmp_path / "a"), dtype="float32")
    a16, _ = load_backbone(str(tmp_path / "a"), dtype="bfloat16")
    b32, _ = load_backbone(str(tmp_path / "b"), dtype="float32")
    ida = backbone_identity(a32, str(tmp_path / "a"))
    assert ida == backbone_identity(a16, str(tmp_path / "a"))
    assert ida["fingerprint"] != backbone_identity(b32, str(tmp_path / "b"))["fingerprint"]
    assert ida["hidden_size"] == 32 and ida["vocab_size"] == 64


def test_frozen_load_has_no_gradients(tmp_path: Path) -> None:
    make_backbone(tmp_path / "m")
    model, tok = load_backbone(str(tmp_path / "m"))
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert tok.padding_side == "left" and tok.pad_token is not None


def test_backbone_source_looks_for_the_config_file_transformers_reads() -> None:
    """backbone_source spells out the file name transformers reads a model directory's config from."""
    assert CONFIG_NAME == transformers.utils.CONFIG_NAME


def test_missing_local_backbone_names_the_stage(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="stage=pretrain"):
        load_backbone(str(tmp_path / "runs" / "pretrain"))


@pytest.mark.parametrize("kind", ["empty dir", "file"])
def test_a_local_path_that_is_no_model_names_the_option(tmp_path: Path, kind: str) -> None:
    """An empty directory or a file as the backbone is one line naming model.name_or_path."""
    path = tmp_path / "x"
    path.mkdir() if kind == "empty dir" else path.write_text("{}")
    with pytest.raises(UserError) as err:
        load_backbone(str(path))
    assert (
        str(err.value) == f"model.name_or_path={path} is not a Hugging Face model directory (no config.json)"
    )


def test_a_checkpoint_transformers_will_not_load_as_a_causal_lm_is_one_line(tmp_path: Path) -> None:
    """An encoder-decoder, an unknown architecture and custom code without model.trust_remote_code are
    a UserError (one line, exit 2), not transformers' ValueError traceback."""
    from transformers import T5Config

    T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, vocab_size=64).save_pretrained(tmp_path / "t5")
    with pytest.raises(
        UserError, match="Unrecognized configuration class .*T5Config.*must be a decoder-only"
    ):
        load_backbone(str(tmp_path / "t5"))
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "config.json").write_text(json.dumps({"model_type": "no_such_architecture"}))
    with pytest.raises(UserError, match="could not load backbone .*model type `no_such_architecture`"):
        load_backbone(str(tmp_path / "new"))
    remote = tmp_path / "remote"
    remote.mkdir()
    auto_map = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XModel"}
    (remote / "config.json").write_text(json.dumps({"model_type": "x_custom", "auto_map": auto_map}))
    with pytest.raises(UserError, match="set model.trust_remote_code=true"):
        load_backbone(str(remote))


def test_backbone_for_heads_follows_the_recorded_base(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Medusa-2 heads bring their trained backbone when model.name_or_path is their base (by path or files)."""
    make_backbone(tmp_path / "base", seed=0)
    make_backbone(tmp_path / "other", seed=1)
    shutil.copytree(tmp_path / "base", tmp_path / "moved_base")
    record = {
        "name_or_path": str(tmp_path / "base"),
        "fingerprint": checkpoint_fingerprint(str(tmp_path / "base")),
    }
    heads = tmp_path / "heads"
    heads.mkdir()
    (heads / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "backbone": record}))

    def pick(name: str, heads_dir: Path = heads) -> Path | None:
        return backbone_for_heads(ModelConfig(name_or_path=str(tmp_path / name)), heads_dir)

    assert pick("base") is None  # Medusa-1 heads: no trained backbone beside them
    (heads / "backbone").mkdir()
    (heads / "backbone" / "config.json").write_text("{}")
    assert pick("base") == heads / "backbone"
    assert pick("moved_base") == heads / "backbone"  # same checkpoint files elsewhere
    with caplog.at_level(logging.WARNING, logger="medusa_train.backbone"):
        assert pick("other") is None  # another model asked for: used as asked, with a warning
    assert "another model than their base" in caplog.text
    export = tmp_path / "export"  # an export's layout folder finds export/backbone
    (export / "medusa").mkdir(parents=True)
    (export / "medusa" / "config.json").write_text(json.dumps({"backbone": record}))
    (export / "backbone").mkdir()
    (export / "backbone" / "config.json").write_text("{}")
    assert pick("base", export / "vllm") == export / "backbone"


def test_dtype_auto_is_float32_on_a_cpu_and_the_hf_presets_default() -> None:
    assert resolve_dtype("auto", "cpu") == "float32"  # bfloat16 only on a CUDA GPU that supports it
    assert resolve_dtype("float16", "cpu") == "float16"
    assert compose_config(["model=hf", "model.name_or_path=x"]).model.dtype == "auto"


@pytest.mark.parametrize(
    ("capability", "dtype"), [((7, 0), "float32"), ((7, 5), "float32"), ((8, 0), "bfloat16")]
)
def test_dtype_auto_is_bfloat16_only_where_the_gpu_computes_it(monkeypatch, capability, dtype) -> None:
    """V100/T4 (compute capability 7) report bf16 support (emulated, slow): ``auto`` loads them in fp32."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert resolve_dtype("auto", "cuda:0") == dtype


def test_cuda_under_a_launcher_is_this_ranks_gpu(monkeypatch) -> None:
    """With several ranks ``model.device=cuda`` (or auto) is ``cuda:LOCAL_RANK``; another rank's index is
    refused in one line (every rank would load onto that GPU); one process keeps what it asked for."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert (
        resolve_device("cuda")
        == resolve_device("auto")
        == resolve_device("cuda:2")
        == torch.device("cuda", 2)
    )
    with pytest.raises(
        UserError, match="model.device=cuda:0 under a launcher would put every rank on one GPU"
    ):
        resolve_device("cuda:0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert resolve_device("cuda:3") == torch.device("cuda", 3) and resolve_device("cuda") == torch.device(
        "cuda"
    )


def _hub_cache(hub: Path, repo_id: str, snapshots: dict[str, Path], main: str) -> None:
    """A Hugging Face cache holding ``snapshots`` (commit -> folder whose files it holds), laid out as
    huggingface_hub writes it: each snapshot file a symlink to a blob, ``refs/main`` naming ``main``."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for commit, source in snapshots.items():
        (repo / "snapshots" / commit).mkdir(parents=True)
        for f in source.iterdir():
            blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
            shutil.copyfile(f, blob)
            (repo / "snapshots" / commit / f.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(main)


def _shard(directory: Path) -> None:
    """Rewrite ``directory``'s model.safetensors as two shards and their index, as large models ship."""
    weights = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    names = sorted(weights)
    parts = {"model-00001-of-00002.safetensors": names[:5], "model-00002-of-00002.safetensors": names[5:]}
    for file, keys in parts.items():
        save_file({k: weights[k] for k in keys}, directory / file, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: file for file, keys in parts.items() for k in keys}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("sharded", [False, True])
def test_a_full_download_has_the_fingerprint_of_the_hub_cache_snapshot(
    tmp_path: Path, monkeypatch, sharded: bool
) -> None:
    """The Hub cache holds only the files ``from_pretrained`` fetched; a full download of the same
    repository (``huggingface-cli download --local-dir``) also holds its ``.bin`` copy of the weights,
    a ``consolidated.safetensors`` for another runtime and ``training_args.bin``, which transformers does
    not load: both are the same checkpoint. Another model still differs, and a snapshot missing a shard
    its index lists has no fingerprint (not one of part of the model)."""
    make_backbone(tmp_path / "fetched", seed=0)
    make_backbone(tmp_path / "other", seed=1)
    if sharded:
        _shard(tmp_path / "fetched")
        _shard(tmp_path / "other")
    full = tmp_path / "full"
    shutil.copytree(tmp_path / "fetched", full)
    weights = {k: v for f in sorted(full.glob("*.safetensors")) for k, v in load_file(f).items()}
    torch.save(weights, full / "pytorch_model.bin")
    save_file(weights, full / "consolidated.safetensors")
    torch.save({"lr": 1e-5}, full / "training_args.bin")
    _hub_cache(tmp_path / "hub", "acme/tiny", {"a" * 40: tmp_path / "fetched"}, main="a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # nothing here may reach the Hub
    hub = checkpoint_fingerprint("acme/tiny")
    assert hub is not None and hub == checkpoint_fingerprint(str(full)) == local_fingerprint(str(full))
    assert checkpoint_fingerprint(str(tmp_path / "other")) != hub
    if sharded:
        (full / "model-00002-of-00002.safetensors").unlink()
        assert checkpoint_fingerprint(str(full)) is None


def test_damaged_weights_are_one_line_naming_the_file(tmp_path: Path) -> None:
    """A truncated ``pytorch_model.bin`` (many Hub models ship only those), a git-lfs pointer where a
    clone without git-lfs leaves one, and a truncated shard of a sharded safetensors checkpoint are a
    DamagedArtefactError (one line, exit 2) naming the file, not torch's or safetensors' traceback."""
    make_backbone(tmp_path / "base")
    weights = load_file(tmp_path / "base" / "model.safetensors")
    pointer = "version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 52428800\n"

    def damaged(name: str, damage) -> Path:
        shutil.copytree(tmp_path / "base", tmp_path / name)
        damage(tmp_path / name)
        return tmp_path / name

    def as_bin(directory: Path, data: bytes | None = None) -> None:
        (directory / "model.safetensors").unlink()
        torch.save(weights, directory / "pytorch_model.bin")
        full = (directory / "pytorch_model.bin").read_bytes()
        (directory / "pytorch_model.bin").write_bytes(full[: len(full) // 2] if data is None else data)

    truncated_bin = damaged("truncated_bin", as_bin)
    with pytest.raises(
        DamagedArtefactError, match=f"cannot read {truncated_bin}/pytorch_model.bin: truncated"
    ):
        load_backbone(str(truncated_bin))
    lfs = damaged("lfs", lambda d: as_bin(d, pointer.encode()))
    with pytest.raises(DamagedArtefactError, match=f"{lfs}/pytorch_model.bin is a git-lfs pointer"):
        load_backbone(str(lfs))

    def truncate_shard(directory: Path) -> None:
        _shard(directory)
        shard = directory / "model-00002-of-00002.safetensors"
        shard.write_bytes(shard.read_bytes()[:-100])

    sharded = damaged("sharded", truncate_shard)
    with pytest.raises(
        DamagedArtefactError, match=f"are damaged .cannot read {sharded}/model-00002-of-00002.safetensors"
    ):
        load_backbone(str(sharded))


def test_a_tokenizer_without_pad_or_eos_pads_with_the_generation_configs_eos(
    tmp_path: Path, tiny_backbone_dir: Path
) -> None:
    """A tokenizer that names neither a pad nor an EOS token, the model's EOS only in its generation
    config (Qwen-1's layout): the loaded tokenizer and generation config pad with that EOS id (the
    batched engines fill padding with the pad id: distillation failed with a TypeError on None)."""
    backbone = tmp_path / "no_eos"
    shutil.copytree(tiny_backbone_dir, backbone)
    settings = json.loads((backbone / "tokenizer_config.json").read_text())
    (backbone / "tokenizer_config.json").write_text(
        json.dumps({k: v for k, v in settings.items() if k not in ("eos_token", "pad_token")})
    )
    for name in ("config.json", "generation_config.json"):
        config = json.loads((backbone / name).read_text())
        config.pop("pad_token_id", None)
        (backbone / name).write_text(json.dumps(config))
    model, tok = load_backbone(str(backbone))
    eos = model.generation_config.eos_token_id
    assert tok.eos_token is None and isinstance(eos, int)
    assert tok.pad_token_id == eos and model.generation_config.pad_token_id == eos
    assert tok(["a b", "a"], padding=True).input_ids[1][0] == eos  # left padding with it


_TEMPLATE = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"


def _mistral_config(directory: Path, vocab: int) -> None:
    """config.json of a Mistral checkpoint (no weights: only its tokenizer is loaded)."""
    from transformers import MistralConfig

    MistralConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8,
    ).save_pretrained(directory)  # fmt: skip


def test_a_mistral_checkpoint_loads_its_hugging_face_tokenizer_where_mistral_common_is_installed(
    tmp_path: Path, monkeypatch
) -> None:
    """Mistral's checkpoints ship tekken.json next to tokenizer.json and tokenizer_config.json; where
    mistral-common is installed (vLLM installs it) transformers loads a MistralCommonBackend for them
    (no chat template, no split_special_tokens), here the Hugging Face tokenizer, as without it.
    mistral-common is simulated installed as transformers sees it (its auto-tokenizer table and the
    probe for tekken.json; the package itself is no dependency), tekken.json is a placeholder: nothing
    may read it."""
    from transformers.integrations.mistral import tokenizer as mistral_integration
    from transformers.models.auto import tokenization_auto

    monkeypatch.setitem(tokenization_auto.TOKENIZER_MAPPING_NAMES, "mistral", "MistralCommonBackend")
    monkeypatch.setattr(mistral_integration, "is_mistral_common_available", lambda: True)
    backbone = tmp_path / "mistral"
    _mistral_config(backbone, vocab=64)
    hf = make_tokenizer()
    hf.chat_template = _TEMPLATE
    hf.save_pretrained(backbone)
    (backbone / "tekken.json").write_text("{}")
    assert tokenization_auto._use_mistral_format(str(backbone))  # transformers' own choice: mistral-common

    tok = load_tokenizer(str(backbone))
    assert type(tok).__name__ == "TokenizersBackend" and tok.is_fast
    assert tok.chat_template == _TEMPLATE and tok.eos_token == "<eos>"
    assert tok("w2 w3").input_ids == hf("w2 w3").input_ids


def test_a_checkpoint_with_only_tekken_json_is_refused_in_one_line(tmp_path: Path) -> None:
    """A checkpoint whose tokenizer is only Mistral's tekken.json has no chat template to render
    conversations with: one line saying which files to bring, with or without mistral-common (it gave
    a MistralCommonBackend there, and distillation said the model was no chat model)."""
    backbone = tmp_path / "tekken_only"
    _mistral_config(backbone, vocab=64)
    (backbone / "tekken.json").write_text("{}")
    with pytest.raises(UserError) as err:
        load_tokenizer(str(backbone))
    assert str(err.value) == (
        f"{backbone} ships its tokenizer only as Mistral's tekken.json (mistral-common's format, no chat "
        "template): medusa_train needs the Hugging Face tokenizer files next to it (tokenizer.json and "
        "tokenizer_config.json with a chat template): use a checkpoint or conversion that ships them"
    )


def test_with_mistral_common_a_mistral_checkpoint_renders_as_mistral_common_does(tmp_path: Path) -> None:
    """With mistral-common really installed (not a dependency: skipped without it), on Mistral's
    tekken tokenizer (the file mistral-common ships, 131072 tokens) and the chat template mistral-common
    generates for it, written as Mistral's repos ship them: transformers itself loads a
    MistralCommonBackend (what ``transformers serve`` renders with there), the loader the Hugging Face
    tokenizer, whose records' prompts are the ids MistralCommonBackend renders, over several turns and
    a system prompt; tekken.json alone is refused."""
    mistral_common = pytest.importorskip("mistral_common")
    from mistral_common.integrations.chat_templates.chat_templates import convert_tokenizer_to_chat_template
    from transformers import AutoTokenizer

    tekken = Path(mistral_common.__file__).parent / "data" / "tekken_240911.json"
    backbone = tmp_path / "mistral"
    _mistral_config(backbone, vocab=131072)
    shutil.copy(tekken, backbone / "tekken.json")
    with pytest.raises(UserError, match="only as Mistral's tekken.json"):
        load_tokenizer(str(backbone))
    hf = AutoTokenizer.from_pretrained(backbone, mistral_format=False)  # converted from tekken.json
    hf.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    hf.chat_template = convert_tokenizer_to_chat_template(tekken)
    hf.save_pretrained(backbone)

    theirs = AutoTokenizer.from_pretrained(backbone)
    assert type(theirs).__name__ == "MistralCommonBackend"
    tok = load_tokenizer(str(backbone))
    assert type(tok).__name__ == "TokenizersBackend" and tok.eos_token_id == theirs.eos_token_id == 2
    renderer = ChatRenderer(tok)
    for conv, replies in [
        (Conversation("a", ["Hello there!"]), []),
        (Conversation("b", ["What is 2+2?", "And 3+3?"], system="Be brief."), ["4."]),
        (Conversation("c", ["one", "two", "three"]), ["uno", "dos"]),
    ]:
        expected = theirs.apply_chat_template(renderer.messages(conv, replies, True), tokenize=True)
        assert renderer.turn_prompt_ids(conv, replies) == list(expected["input_ids"]), conv.source_id


def test_a_lora_adapter_is_not_merged_into_another_revision_of_its_base(
    tmp_path: Path, monkeypatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Medusa-2 LoRA heads trained on a Hub id at a pinned commit bring their adapter when evaluated at
    that commit; at main, which has moved on to other weights, the name is the base's but the model
    is not: the adapter would be merged into weights it was not trained on, so the plain model is
    used as asked, with the warning of another model. A fully tuned backbone still follows the name."""
    pinned, main = "a" * 40, "b" * 40
    make_backbone(tmp_path / "pinned", seed=0)
    make_backbone(tmp_path / "main", seed=1)
    _hub_cache(tmp_path / "hub", "acme/tiny", {pinned: tmp_path / "pinned", main: tmp_path / "main"}, main)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # nothing here may reach the Hub
    record = {"name_or_path": "acme/tiny", "fingerprint": checkpoint_fingerprint("acme/tiny", pinned)}
    assert record["fingerprint"] == checkpoint_fingerprint(str(tmp_path / "pinned"))
    heads = tmp_path / "heads"
    (heads / "backbone").mkdir(parents=True)
    (heads / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "backbone": record}))
    (heads / "backbone" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    assert backbone_for_heads(ModelConfig("acme/tiny", revision=pinned), heads) == heads / "backbone"
    with caplog.at_level(logging.WARNING, logger="medusa_train.backbone"):
        assert backbone_for_heads(ModelConfig("acme/tiny"), heads) is None
    assert "another model than their base acme/tiny (the same name, other checkpoint files" in caplog.text
    (heads / "backbone" / "adapter_config.json").unlink()
    (heads / "backbone" / "config.json").write_text("{}")
    assert backbone_for_heads(ModelConfig("acme/tiny"), heads) == heads / "backbone"


def test_identity_of_a_model_whose_config_nests_the_text_model(tmp_path: Path) -> None:
    """AutoModelForCausalLM loads Gemma 3 (4B and up) as Gemma3ForConditionalGeneration, whose config
    keeps hidden_size in its text_config only: the identity takes it from there (it raised
    AttributeError), as distill.engine=server's identity does."""
    from transformers import AutoModelForCausalLM, Gemma3Config

    text = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=64,
    )
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    config = Gemma3Config(text_config=text, vision_config=vision, image_token_index=63)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "gemma3")
    identity = backbone_identity(model, str(tmp_path / "gemma3"))
    assert identity["hidden_size"] == 32 and identity["vocab_size"] == 64
    assert identity["architecture"] == "Gemma3ForConditionalGeneration"


def test_a_local_path_under_home_loads(tmp_path: Path, tiny_backbone_dir: Path, monkeypatch) -> None:
    """``model.name_or_path='~/models/x'`` (quoted or not, no shell expands it after a dotted key), or
    ``~/...`` in a config file: the model, its tokenizer and, for distill.engine=server, its config
    load from the home directory, with the fingerprint of the expanded path (transformers took
    ``~/...`` for a malformed Hub id: a UserError)."""
    from medusa_train.stages import distill

    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(tiny_backbone_dir, tmp_path / "models" / "x")
    model, tok = load_backbone("~/models/x")
    identity = backbone_identity(model, "~/models/x")
    assert identity["fingerprint"] == local_fingerprint(str(tiny_backbone_dir)) and tok.pad_token is not None
    cfg = compose_config(
        [
            "stage=distill",
            "model=hf",
            "model.name_or_path='~/models/x'",
            "distill.engine=server",
            "distill.server.urls=[http://localhost:8000/v1]",
        ]
    )
    _, _, served = distill._served_backbone(cfg)
    assert served["fingerprint"] == identity["fingerprint"]


def test_a_lora_adapter_as_the_backbone_names_its_base(tmp_path: Path) -> None:
    """model.name_or_path naming Medusa-2's LoRA ``heads/backbone`` (an adapter, no config.json) is one
    line naming its base model, not "not a Hugging Face model directory"."""
    adapter = tmp_path / "heads" / "backbone"
    adapter.mkdir(parents=True)
    config = {"peft_type": "LORA", "base_model_name_or_path": "/models/base"}
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(
        UserError, match=r"is a LoRA adapter, not a whole model: pass its base model \(/models/base\)"
    ):
        load_backbone(str(adapter))


# -- the files fingerprint ---------------------------------------------------------------------------
def _remote_code_model(directory: Path) -> None:
    """A tiny Llama shipped as a ``trust_remote_code`` checkpoint: config.json's ``auto_map`` names its
    configuration and modeling files, and the modeling file imports a helper relatively."""
    make_backbone(directory)
    config = json.loads((directory / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "configuration_x.XConfig",
        "AutoModelForCausalLM": "modeling_x.XForCausalLM",
    }
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "configuration_x.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass XConfig(LlamaConfig):\n    model_type = 'x'\n"
    )
    (directory / "modeling_x.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .rope import THETA\n\n\n"
        "class XForCausalLM(LlamaForCausalLM):\n    pass\n"
    )
    (directory / "rope.py").write_text("THETA = 10000.0\n")


def test_the_remote_code_config_json_names_is_part_of_the_checkpoint(tmp_path: Path) -> None:
    """A ``trust_remote_code`` model computes what its code says: an edit of a file config.json's
    ``auto_map`` names, or of one that file imports relatively, is another checkpoint (the distilled
    data and heads of the old code were reused as this model's). A ``.py`` file nothing names (a
    training script), or any ``.py`` beside a model without ``auto_map``, is not loaded and does not
    count; nor does the code of a model loaded without ``trust_remote_code`` (transformers loads its
    built-in class), whose fingerprint is then the same whatever the code."""
    model = tmp_path / "remote"
    _remote_code_model(model)

    def fingerprints() -> tuple[str | None, str | None]:
        return tuple(local_fingerprint(str(model), trust_remote_code=trust) for trust in (True, False))

    before, untrusted = fingerprints()
    assert before != untrusted
    (model / "train.py").write_text("print('fine-tune')\n")
    assert fingerprints() == (before, untrusted)
    for name in ("modeling_x.py", "configuration_x.py", "rope.py"):
        original = (model / name).read_text()
        (model / name).write_text(original.replace("10000.0", "500000.0") + "# rotary base changed\n")
        trusted, without_trust = fingerprints()
        assert trusted != before and without_trust == untrusted, name
        (model / name).write_text(original)
    assert fingerprints() == (before, untrusted)
    plain = tmp_path / "plain"
    make_backbone(plain)
    without = local_fingerprint(str(plain))
    shutil.copy(model / "modeling_x.py", plain)
    assert local_fingerprint(str(plain)) == local_fingerprint(str(plain), trust_remote_code=True) == without


def test_the_fingerprint_with_the_other_trust_remote_code(tmp_path: Path) -> None:
    """What a run that set model.trust_remote_code the other way recorded for a remote-code model's
    files; None for a model without auto_map (the setting changes nothing) and without files."""
    model = tmp_path / "remote"
    _remote_code_model(model)
    trusted, untrusted = (local_fingerprint(str(model), trust_remote_code=t) for t in (True, False))
    assert other_code_fingerprint(str(model), trust_remote_code=False) == trusted
    assert other_code_fingerprint(str(model), trust_remote_code=True) == untrusted
    plain = tmp_path / "plain"
    make_backbone(plain)
    assert other_code_fingerprint(str(plain)) is None
    assert other_code_fingerprint(str(tmp_path / "absent")) is None


def _config_only_snapshot(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    """A remote-code model's full folder, and the offline Hub cache's snapshot of it holding its
    config alone (no modeling file): ``(full, snapshot)``."""
    full = tmp_path / "full"
    _remote_code_model(full)
    config_only = tmp_path / "config_only"
    shutil.copytree(full, config_only, ignore=shutil.ignore_patterns("modeling_x.py", "rope.py"))
    _hub_cache(tmp_path / "hub", "acme/remote", {"a" * 40: config_only}, main="a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # nothing here may reach the Hub
    return full, tmp_path / "hub" / "models--acme--remote" / "snapshots" / ("a" * 40)


def test_a_hub_snapshot_fetches_the_remote_code_it_lacks(tmp_path: Path, monkeypatch) -> None:
    """distill.engine=server loads a ``trust_remote_code`` model's config alone (its configuration file
    comes into the Hub cache, its modeling file does not), stage=train the model: the fingerprint
    fetches the named code the snapshot lacks, so both name the same checkpoint."""
    from medusa_train import backbone

    full, snapshot = _config_only_snapshot(tmp_path, monkeypatch)
    real, fetched = backbone.cached_file, []

    def hub(repo_id: str, name: str, **kwargs):  # the Hub serves the full repository's files
        if not (snapshot / name).exists() and (full / name).exists():
            fetched.append(name)
            shutil.copy(full / name, snapshot / name)
        return real(repo_id, name, **kwargs)

    monkeypatch.setattr(backbone, "cached_file", hub)
    fingerprint = checkpoint_fingerprint("acme/remote", trust_remote_code=True)
    assert fingerprint == local_fingerprint(str(full), trust_remote_code=True)
    assert sorted(fetched) == ["modeling_x.py", "rope.py"]


def test_remote_code_is_not_fetched_without_trust_remote_code(tmp_path: Path, monkeypatch, caplog) -> None:
    """A model with an ``auto_map`` loaded without ``model.trust_remote_code``: transformers never runs
    its code (it loads the built-in class, or refuses), so the fingerprint asks the Hub for none of it
    and says nothing of code it could not fetch. The Hub snapshot holding the config alone and a full
    folder with the code have one fingerprint: the same model loaded the same way, whatever the cache
    holds."""
    from medusa_train import backbone

    full, snapshot = _config_only_snapshot(tmp_path, monkeypatch)
    real, asked = backbone.cached_file, []

    def hub(repo_id: str, name: str, **kwargs):
        asked.append(name)
        return real(repo_id, name, **kwargs)

    monkeypatch.setattr(backbone, "cached_file", hub)
    with caplog.at_level(logging.WARNING, logger=backbone.__name__):
        fingerprint = checkpoint_fingerprint("acme/remote")
    assert asked == ["config.json"] and "could not fetch" not in caplog.text
    assert not (snapshot / "modeling_x.py").exists()
    assert fingerprint == local_fingerprint(str(full)) == local_fingerprint(str(snapshot))
    assert fingerprint != local_fingerprint(str(full), trust_remote_code=True)


def test_remote_code_that_is_not_utf8_is_fingerprinted(tmp_path: Path) -> None:
    """A remote code file that is not UTF-8 (a Latin-1 comment): its bytes count, its relative imports
    are not read (transformers reads the file as UTF-8 and fails to load the model with its own
    message; the fingerprint, taken before loading, raised UnicodeDecodeError)."""
    model = tmp_path / "remote"
    _remote_code_model(model)
    modeling = (model / "modeling_x.py").read_bytes()
    (model / "modeling_x.py").write_bytes(b"# -*- coding: latin-1 -*-\n# caf\xe9\n" + modeling)
    fingerprint = local_fingerprint(str(model), trust_remote_code=True)
    assert fingerprint is not None and fingerprint.startswith("v2-")
    (model / "modeling_x.py").write_bytes(b"# -*- coding: latin-1 -*-\n# caf\xe8\n" + modeling)
    assert local_fingerprint(str(model), trust_remote_code=True) != fingerprint


def test_remote_code_that_cannot_be_fetched_is_said(tmp_path: Path, monkeypatch, caplog) -> None:
    """A fetch that fails (rate limit, gated, network) leaves the code out of the fingerprint, which
    then differs from another stage's: one warning per file says so, naming the file and the reason."""
    from medusa_train import backbone

    _config_only_snapshot(tmp_path, monkeypatch)
    real = backbone.cached_file

    def rate_limited(repo_id: str, name: str, **kwargs):  # the cached config is read, the code fails
        if name.endswith(".py"):
            raise OSError("429 Too Many Requests\nretry later")
        return real(repo_id, name, **kwargs)

    monkeypatch.setattr(backbone, "cached_file", rate_limited)
    with caplog.at_level(logging.WARNING, logger=backbone.__name__):
        checkpoint_fingerprint("acme/remote", trust_remote_code=True)
    said = [r.getMessage() for r in caplog.records if "could not fetch" in r.getMessage()]
    assert said and all("acme/remote (429 Too Many Requests)" in m for m in said), said
    assert any(m.startswith("could not fetch modeling_x.py") for m in said)


def _ends(path: Path) -> bytes:
    data = path.read_bytes()
    return data[: 1 << 20] + data[-(1 << 20) :]


@pytest.mark.parametrize("suffix", [".safetensors", ".bin"])
@pytest.mark.parametrize(
    "name", ["model.layers.1.mlp.up_proj.weight", "model.layers.1.input_layernorm.weight"]
)
def test_a_fine_tune_of_tensors_inside_a_large_weight_file_is_another_checkpoint(
    tmp_path: Path, suffix: str, name: str
) -> None:
    """A fine-tune that trains some tensors only (a merged LoRA adapter, a few layers, a norm) writes a
    weight file of the same size; for safetensors its first and last MiB (the header, the first
    tensor's start, the last tensor's end) are the base's. The fingerprint tells the two apart: it
    reads every tensor of a safetensors file, and the CRC-32 of every tensor of a ``.bin`` file."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    from tests.helpers.models import tiny_config

    torch.manual_seed(0)
    config = tiny_config(hidden=256, intermediate=1024, layers=4, vocab=512)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "base")
    weights = load_file(tmp_path / "base" / "model.safetensors")
    tuned = {**weights, name: weights[name] + 1e-3}  # a 1 MiB matrix or a 1 KiB norm inside the file
    (tmp_path / "tuned").mkdir()
    shutil.copy(tmp_path / "base" / "config.json", tmp_path / "tuned")
    for folder, tensors in (("base", weights), ("tuned", tuned)):
        (tmp_path / folder / "model.safetensors").unlink(missing_ok=True)
        if suffix == ".bin":
            torch.save(tensors, tmp_path / folder / "pytorch_model.bin")
        else:
            save_file(tensors, tmp_path / folder / "model.safetensors", metadata={"format": "pt"})
    a, b = (next((tmp_path / folder).glob(f"*{suffix}")) for folder in ("base", "tuned"))
    assert a.stat().st_size == b.stat().st_size > 4 << 20
    if suffix == ".safetensors":
        assert _ends(a) == _ends(b)
    assert local_fingerprint(str(tmp_path / "tuned")) != local_fingerprint(str(tmp_path / "base"))


def test_a_bin_file_counts_every_tensor_by_its_crc(tmp_path: Path) -> None:
    """``torch.save``'s zip lists a CRC-32 of every tensor in its directory at the file's end: a change
    to one small tensor that the evenly spaced samples do not read, whose entry lies before the last
    sample (a directory of over a thousand tensors), is another checkpoint. The file is written as
    torch releases before ``.data/serialization_id`` wrote it (that record's CRC, at the very end,
    changes with every tensor)."""
    import zipfile

    from medusa_train.backbone import _spaced_reads

    tensors = {f"t{i:04d}": torch.full((512,), float(i)) for i in range(1200)}
    for folder, changed in (("a", tensors), ("b", {**tensors, "t0100": tensors["t0100"] + 1})):
        (tmp_path / folder).mkdir()
        torch.save(changed, tmp_path / "saved.bin")
        with (
            zipfile.ZipFile(tmp_path / "saved.bin") as saved,
            zipfile.ZipFile(tmp_path / folder / "pytorch_model.bin", "w") as out,
        ):
            for info in saved.infolist():
                if not info.filename.endswith("serialization_id"):
                    out.writestr(info, saved.read(info))
    a, b = (tmp_path / folder / "pytorch_model.bin" for folder in ("a", "b"))
    size = a.stat().st_size
    assert b.stat().st_size == size > 2 << 20

    def samples(path: Path) -> list[bytes]:
        data = path.read_bytes()
        return [data[offset : offset + length] for offset, length in _spaced_reads(size)]

    assert samples(a) == samples(b)  # what the samples alone read
    assert local_fingerprint(str(tmp_path / "a")) != local_fingerprint(str(tmp_path / "b"))


def test_a_bin_file_with_every_crc_reads_its_directory_only(tmp_path: Path) -> None:
    """A ``.bin`` whose zip records all carry a CRC-32 is fingerprinted by its directory alone (no
    samples of its data: a 70B checkpoint read ~1 GB per fingerprint); one written without CRCs
    (``set_crc32_options(False)``) is sampled through its data, so a changed tensor still counts."""
    from medusa_train.backbone import _weight_samples

    path = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.ones(1 << 20)}, path)  # 4 MiB of data
    size = path.stat().st_size
    assert sum(len(b) for b in _weight_samples(path, size)) < 4096
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({"w": torch.ones(1 << 20)}, path)
    finally:
        torch.serialization.set_crc32_options(True)
    assert sum(len(b) for b in _weight_samples(path, path.stat().st_size)) > 64 << 10


def test_a_model_saved_again_keeps_its_fingerprint(tmp_path: Path) -> None:
    """The same weights saved again by another transformers release: config.json names that release
    (and, from some releases, where the model was loaded from), with its keys in another order and
    layout. The same checkpoint, whose distilled data and heads still belong to it; a change of what
    the config says (the class that loads, a setting) is another."""
    make_backbone(tmp_path / "m")
    before = local_fingerprint(str(tmp_path / "m"))
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    resaved = {
        "_name_or_path": "/home/me/m",
        **dict(reversed(config.items())),
        "transformers_version": "5.99.0",
    }
    (tmp_path / "m" / "config.json").write_text(json.dumps(resaved, indent=4))
    assert local_fingerprint(str(tmp_path / "m")) == before
    for change in ({"architectures": ["LlamaModel"]}, {"rms_norm_eps": 1e-5}):
        (tmp_path / "m" / "config.json").write_text(json.dumps({**resaved, **change}))
        assert local_fingerprint(str(tmp_path / "m")) != before, change


def test_a_fingerprint_an_earlier_version_recorded_compares_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A fingerprint an earlier medusa_train recorded (16 hex digits: other bytes of the files) differs
    from every one computed now. The base of Medusa-2 LoRA heads that records one is known by its name,
    as without a fingerprint (it was taken for another model: the adapter was left out), and
    ``custom_generate`` does not refuse the base an earlier export names. A fingerprint of this
    version that differs is still another checkpoint."""
    from types import SimpleNamespace

    from medusa_train.custom_generate import _check_checkpoint

    make_backbone(tmp_path / "base")
    current = local_fingerprint(str(tmp_path / "base"))
    earlier = "0123456789abcdef"
    other = current[:-4] + ("0000" if not current.endswith("0000") else "1111")
    tensors = (
        TENSORS_PREFIX + earlier
    )  # a base that had no files: its tensors' fingerprint says nothing of files
    model = SimpleNamespace(name_or_path=str(tmp_path / "base"))
    for recorded, same in ((earlier, True), (other, False), (current, True), (tensors, True)):
        record = {"name_or_path": str(tmp_path / "base"), "fingerprint": recorded}
        heads = tmp_path / f"heads_{recorded}"
        (heads / "backbone").mkdir(parents=True)
        (heads / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "backbone": record}))
        (heads / "backbone" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="medusa_train.backbone"):
            picked = backbone_for_heads(ModelConfig(str(tmp_path / "base")), heads)
        assert picked == (heads / "backbone" if same else None), recorded
        assert ("another model than their base" in caplog.text) != same
        medusa1 = tmp_path / f"medusa1_{recorded}"
        medusa1.mkdir()
        shutil.copy(heads / "config.json", medusa1)
        if same:
            _check_checkpoint(model, medusa1)
        else:
            with pytest.raises(ValueError, match="medusa_check_base=False"):
                _check_checkpoint(model, medusa1)


def test_a_fingerprint_of_a_model_without_files_is_of_this_version(tmp_path: Path, monkeypatch) -> None:
    """A model with no checkpoint files (built in memory) is fingerprinted by its tensors, with this
    version's prefix: it is not read as a fingerprint of an earlier medusa_train (which compares
    nothing, so the name decided), whatever it is compared with. Another model's tensors differ; the
    dtype does not count. The digest an earlier medusa_train recorded for the same tensors (no prefix)
    is read as earlier: it compares nothing, and is never "another model"."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # "in-memory" is no Hub id to ask about
    make_backbone(tmp_path / "a", seed=0)
    make_backbone(tmp_path / "b", seed=1)
    a32, _ = load_backbone(str(tmp_path / "a"), dtype="float32")
    a16, _ = load_backbone(str(tmp_path / "a"), dtype="bfloat16")
    b32, _ = load_backbone(str(tmp_path / "b"), dtype="float32")
    tensors = backbone_identity(a32, "in-memory")["fingerprint"]
    assert (
        tensors.startswith(TENSORS_PREFIX) and tensors == backbone_identity(a16, "in-memory")["fingerprint"]
    )
    assert backbone_identity(b32, "in-memory")["fingerprint"] != tensors
    files = local_fingerprint(str(tmp_path / "a"))
    assert not older_fingerprint(tensors, files) and not older_fingerprint(files, tensors)
    earlier = tensors.removeprefix(TENSORS_PREFIX)
    assert older_fingerprint(earlier, tensors) and older_fingerprint(earlier, files)


def test_custom_generate_knows_a_remote_code_base_with_or_without_its_code(tmp_path: Path) -> None:
    """stage=train records the base's fingerprint with its remote code or without, as
    ``model.trust_remote_code`` was; the heads do not say which. ``custom_generate`` takes either as
    the base's (a record, or the shipped Medusa-2 backbone's files), and refuses another model."""
    from types import SimpleNamespace

    from medusa_train.custom_generate import _check_checkpoint

    _remote_code_model(tmp_path / "base")
    make_backbone(tmp_path / "other", seed=1)
    model = SimpleNamespace(name_or_path=str(tmp_path / "base"))
    records = [local_fingerprint(str(tmp_path / "base"), trust_remote_code=t) for t in (True, False)]
    for i, recorded in enumerate([*records, local_fingerprint(str(tmp_path / "other"))]):
        heads = tmp_path / f"heads{i}"
        heads.mkdir()
        record = {"name_or_path": str(tmp_path / "base"), "fingerprint": recorded}
        (heads / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "backbone": record}))
        if recorded in records:
            _check_checkpoint(model, heads)
        else:
            with pytest.raises(ValueError, match="medusa_check_base=False"):
                _check_checkpoint(model, heads)
    shutil.copytree(tmp_path / "base", tmp_path / "heads0" / "backbone")  # a full Medusa-2 backbone
    _check_checkpoint(model, tmp_path / "heads0")
    with pytest.raises(ValueError, match="medusa_check_base=False"):
        _check_checkpoint(SimpleNamespace(name_or_path=str(tmp_path / "other")), tmp_path / "heads0")


def test_the_base_of_lora_heads_is_fingerprinted_as_model_trust_remote_code_says(tmp_path: Path) -> None:
    """The base of Medusa-2 LoRA heads is compared by the fingerprint ``model.trust_remote_code`` gives:
    with the remote code where it is set, as stage=train recorded it then."""
    _remote_code_model(tmp_path / "base")
    base = str(tmp_path / "base")
    record = {"name_or_path": base, "fingerprint": local_fingerprint(base, trust_remote_code=True)}
    heads = tmp_path / "heads"
    (heads / "backbone").mkdir(parents=True)
    (heads / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "backbone": record}))
    (heads / "backbone" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    assert backbone_for_heads(ModelConfig(base, trust_remote_code=True), heads) == heads / "backbone"
    assert backbone_for_heads(ModelConfig(base), heads) is None  # loaded without the code it was trained on


@pytest.mark.parametrize("offsets", [[-100, 4], [8, 4]])
def test_a_safetensors_header_with_impossible_offsets_is_fingerprinted(tmp_path: Path, offsets) -> None:
    """A damaged header whose tensor starts before the data or ends before it starts: the fingerprint
    (taken before loading, by distill's check) reads the file as bytes, raising nothing; loading the
    model then fails with its own message."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": offsets}}).encode()
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
    assert local_fingerprint(str(tmp_path)).startswith("v2-")
