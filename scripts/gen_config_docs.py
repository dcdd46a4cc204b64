"""Write docs/config.md: every configuration key with its type, default and documentation.

Run as:
    python scripts/gen_config_docs.py            # rewrite docs/config.md
    python scripts/gen_config_docs.py --check    # exit 1 if docs/config.md is out of date (used by a test)

The source of truth is medusa_train/config.py: each dataclass field's attribute docstring (the
string literal right below it) is its documentation.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG_PY = ROOT / "medusa_train" / "config.py"
OUT = ROOT / "docs" / "config.md"
SECTIONS = {
    "Config": "",
    "ModelConfig": "model",
    "PretrainConfig": "pretrain",
    "DataConfig": "data",
    "DistillConfig": "distill",
    "DistillServerConfig": "distill.server",
    "TrainingConfig": "training",
    "DeepSpeedConfig": "deepspeed",
    "TreeConfig": "tree",
    "TrackingConfig": "tracking",
    "ExportConfig": "export",
    "EvalConfig": "eval",
}


def _fields(cls: ast.ClassDef) -> list[tuple[str, str, str, str]]:
    rows = []
    body = cls.body
    for i, node in enumerate(body):
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        name = node.target.id
        annotation = ast.unparse(node.annotation)
        if annotation.startswith(("ClassVar", "typing.ClassVar")):
            continue  # class attributes are not config keys
        default = ast.unparse(node.value) if node.value is not None else ""
        run_only = default.startswith("run_only(")
        if run_only:  # left out of the stage's skip/resume settings: said first in its row
            default = (
                "field(" + default[len("run_only(") :] if "default_factory=" in default else default[9:-1]
            )
        if default.startswith("field(default_factory=lambda: "):
            default = default[len("field(default_factory=lambda: ") : -1]
        elif "default_factory=" in default:
            default = "(group)"
        doc = ""
        if i + 1 < len(body):
            nxt = body[i + 1]
            if (
                isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                doc = " ".join(nxt.value.value.split())
        if run_only:
            doc = f"*Run-only* (not in the stage's skip/resume settings). {doc}"
        rows.append((name, annotation, default, doc))
    return rows


def render() -> str:
    tree = ast.parse(CONFIG_PY.read_text())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    out = [
        "# Configuration reference",
        "",
        "Generated from `medusa_train/config.py` by `python scripts/gen_config_docs.py`; do not edit by hand.",
        "Set any key on the command line (`python -m medusa_train stage=train training.lr=2e-3`); pick a",
        "preset with a group (`model=hf`, `data=sharegpt`, `training=medusa2`, `deepspeed=zero3`, `tree=chain`,",
        "`tracking=disabled`, `debug=fast`); print the composed config with `python -m medusa_train --cfg ...`.",
        "",
    ]
    for cls_name, prefix in SECTIONS.items():
        cls = classes[cls_name]
        title = f"`{prefix}.*`" if prefix else "top level"
        out += [f"## {title}", "", " ".join((ast.get_docstring(cls) or "").split()), ""]
        out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for name, annotation, default, doc in _fields(cls):
            if default == "(group)":
                continue
            key = f"{prefix}.{name}" if prefix else name
            cells = [f"`{key}`", f"`{annotation}`", f"`{default}`", doc]
            out.append("| " + " | ".join(c.replace("|", r"\|") for c in cells) + " |")
        out.append("")
    out += _presets()
    return "\n".join(out)


def _presets() -> list[str]:
    """What each `conf/<group>/<option>.yaml` sets: these override the schema defaults above."""
    from omegaconf import OmegaConf

    conf = ROOT / "conf"
    out = [
        "## Group presets",
        "",
        "Selecting an option (`training=medusa1`) applies its file, which overrides the schema defaults",
        "above. The defaults list is in `conf/config.yaml`: model=tiny, data=embedded, training=medusa1,",
        "deepspeed=none, tree=calibrated, tracking=offline.",
        "",
        "| option | sets |",
        "|---|---|",
    ]
    for group in sorted(p for p in conf.iterdir() if p.is_dir()):
        for path in sorted(group.glob("*.yaml")):
            flat = _flatten(OmegaConf.to_container(OmegaConf.load(path), resolve=False))
            prefix = "" if group.name == "debug" else f"{group.name}."
            sets = ", ".join(f"`{prefix}{k}={v}`" for k, v in flat.items())
            out.append(f"| `{group.name}={path.stem}` | {sets.replace('|', chr(92) + '|')} |")
    out.append("")
    return out


def _flatten(node, prefix: str = "") -> dict:
    flat = {}
    for key, value in (node or {}).items():
        if key == "defaults":
            continue
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if docs/config.md is stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print("docs/config.md is out of date: run `python scripts/gen_config_docs.py`", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
