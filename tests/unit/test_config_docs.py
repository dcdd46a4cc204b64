"""docs/config.md documents every option and is in sync with medusa_train/config.py."""

from __future__ import annotations

from tests.helpers.scripts import load_script


def _gen():
    return load_script("gen_config_docs")


def test_every_option_is_documented() -> None:
    gen = _gen()
    import ast

    tree = ast.parse(gen.CONFIG_PY.read_text())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    undocumented = [
        f"{prefix}.{name}" if prefix else name
        for cls_name, prefix in gen.SECTIONS.items()
        for name, _, default, doc in gen._fields(classes[cls_name])
        if default != "(group)" and not doc
    ]
    assert not undocumented, f"add an attribute docstring in medusa_train/config.py for: {undocumented}"


def test_config_md_is_up_to_date() -> None:
    gen = _gen()
    assert gen.OUT.read_text() == gen.render(), "run `python scripts/gen_config_docs.py`"
