"""The package's import graph keeps the layering of docs/architecture.md.

Every module of ``medusa_train`` is parsed (nothing imported), and its imports of the project
(``import medusa_train.x``, ``from medusa_train.x import y``, relative imports) are resolved to
modules. Imports under ``if TYPE_CHECKING:`` are left out (they never run). Checked:

- no import cycle, counting imports anywhere in a file (inside functions too);
- stages never import one another (nor the ``stages`` package, the dispatcher);
- ``decoding/`` and ``heads.py`` reach nothing of ``training/``, ``stages/``, ``engines/``, nor Hydra
  or OmegaConf, following imports through other modules (a reusable part knows nothing of the CLI);
- ``engines/`` reaches nothing of ``stages/`` or ``training/``;
- ``workdir.py`` and ``errors.py`` import no project module but ``errors``;
- the project's own modules are imported at the top of each file, not inside functions (except in
  the modules of ``LAZY_PROJECT_IMPORTS``, each with its reason);
- the heavy optional dependencies (deepspeed, peft, bitsandbytes, wandb, matplotlib, triton) are imported
  lazily, where used, so that importing any module needs none of them;
- docs/architecture.md lists every module, and its "may import (project)" column is exact: each
  module imports only the project modules its row names (``training/*``: any module of ``training/``;
  "building blocks": any module but the stages and ``__main__``; "nothing": none), and imports every
  module its row names.

The checker itself is tested on a small package written to a temporary folder.
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "medusa_train"
HEAVY_OPTIONAL = ("deepspeed", "peft", "bitsandbytes", "wandb", "matplotlib", "triton")
LAZY_PROJECT_IMPORTS = {
    "medusa_train.__main__": "`--help`/`--cfg` must answer without importing torch/transformers (seconds), "
    "which report pulls in; tests/unit/test_config.py::test_help_and_cfg_import_no_torch",
}


@dataclass(frozen=True)
class Import:
    """One import statement's target, as found in ``module``."""

    module: str  # the importing module
    target: str  # a project module, or the top-level name of a third-party package
    line: int
    in_function: bool  # inside a def (runs when called), not at import time


def module_names(root: Path, package: str) -> dict[str, Path]:
    """``{dotted module name: file}`` for every ``.py`` file of ``root/package``."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Import statements with whether they sit inside a function (``if TYPE_CHECKING`` skipped)."""
    found: list[tuple[ast.Import | ast.ImportFrom, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub, in_function)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, in_function))
            visit(
                child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            )

    visit(tree, False)
    return found


def import_graph(root: Path, package: str) -> dict[str, list[Import]]:
    """``{module: its imports}``: project targets resolved to modules, others to their top-level name."""
    modules = module_names(root, package)
    graph: dict[str, list[Import]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        here = name if is_package else name.rpartition(".")[0]
        edges: list[Import] = []
        for node, in_function in _imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = here.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                # `from pkg import sub` names a module when pkg.sub is one, else an attribute of pkg
                targets = [
                    f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in modules else prefix for a in node.names
                ]
            for target in dict.fromkeys(targets):
                if target == package or target.startswith(f"{package}."):
                    while target not in modules:  # `import medusa_train.x.attr`-style: the module holding it
                        target = target.rpartition(".")[0]
                else:
                    target = target.partition(".")[0]
                edges.append(Import(name, target, node.lineno, in_function))
        graph[name] = edges
    return graph


def project_edges(graph: dict[str, list[Import]]) -> dict[str, set[str]]:
    return {m: {e.target for e in edges if e.target in graph and e.target != m} for m, edges in graph.items()}


def cycles(graph: dict[str, list[Import]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each sorted."""
    edges = project_edges(graph)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            strongconnect(v)
    return out


def reachable(graph: dict[str, list[Import]], start: str, *, top_level_only: bool = False) -> set[str]:
    """Every target (project module or third-party name) ``start`` pulls in, through project modules."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for edge in graph[todo.pop()]:
            if top_level_only and edge.in_function:
                continue
            if edge.target not in seen:
                seen.add(edge.target)
                if edge.target in graph:
                    todo.append(edge.target)
    return seen


def _in(module: str, *areas: str) -> bool:
    return any(module == a or module.startswith(f"{a}.") for a in areas)


@pytest.fixture(scope="module")
def graph() -> dict[str, list[Import]]:
    return import_graph(ROOT, PACKAGE)


def test_no_import_cycle(graph):
    assert cycles(graph) == []


def test_stages_do_not_import_each_other(graph):
    bad = [
        f"{e.module} imports {e.target} (line {e.line})"
        for m, edges in graph.items()
        if _in(m, "medusa_train.stages") and m != "medusa_train.stages"
        for e in edges
        if _in(e.target, "medusa_train.stages") and e.target != m
    ]
    assert bad == []


@pytest.mark.parametrize(
    ("areas", "forbidden"),
    [
        (
            ("medusa_train.decoding", "medusa_train.heads"),
            ("medusa_train.training", "medusa_train.stages", "medusa_train.engines", "hydra", "omegaconf"),
        ),
        (("medusa_train.engines",), ("medusa_train.stages", "medusa_train.training")),
    ],
)
def test_building_blocks_do_not_reach_up(graph, areas, forbidden):
    bad = {m: sorted(t for t in reachable(graph, m) if _in(t, *forbidden)) for m in graph if _in(m, *areas)}
    assert {m: found for m, found in bad.items() if found} == {}


@pytest.mark.parametrize("leaf", ["medusa_train.workdir", "medusa_train.errors"])
def test_leaves_import_only_errors(graph, leaf):
    project = {e.target for e in graph[leaf] if e.target in graph}
    assert project <= {"medusa_train.errors"} - {leaf}


def test_project_imports_are_at_the_top_of_each_file(graph):
    bad = [
        f"{e.module}:{e.line} imports {e.target} inside a function"
        for edges in graph.values()
        for e in edges
        if e.in_function and e.target in graph and e.module not in LAZY_PROJECT_IMPORTS
    ]
    assert bad == []


def test_heavy_optional_dependencies_are_imported_lazily(graph):
    bad = [
        f"{e.module}:{e.line} imports {e.target} at import time"
        for edges in graph.values()
        for e in edges
        if not e.in_function and e.target in HEAVY_OPTIONAL
    ]
    assert bad == []


def test_docs_architecture_lists_every_module(graph):
    """docs/architecture.md's package map names every module (package ``__init__`` files aside)."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    files = [
        str(path.relative_to(ROOT / PACKAGE))
        for path in module_names(ROOT, PACKAGE).values()
        if path.name != "__init__.py"
    ]
    assert "stages/pretrain.py" in files and "workdir.py" in files
    assert [f for f in files if f"`{f}`" not in doc] == []


TABLE_ROW = re.compile(r"^\| `(?P<file>[^`]+\.py)` \| .* \| (?P<may_import>[^|]*) \|$")
BUILDING_BLOCKS = "building blocks"


def doc_name(module: str, package: str = PACKAGE) -> str:
    """A module as docs/architecture.md's "may import" column names it: ``decoding/tree`` for
    ``medusa_train.decoding.tree``, ``decoding`` for the package ``medusa_train.decoding``, and the
    package itself by its name."""
    return module.removeprefix(f"{package}.").replace(".", "/") if module != package else package


def may_import_table(doc: str) -> dict[str, str]:
    """``{file relative to the package: its "may import (project)" cell}`` of the package map."""
    return {m["file"]: m["may_import"].strip() for m in map(TABLE_ROW.match, doc.splitlines()) if m}


def allowed_imports(
    cell: str, modules: list[str], package: str = PACKAGE
) -> tuple[set[str], set[str], list[str]]:
    """What one "may import" cell allows, as module names: ``(allowed, named, unknown)``.

    Parenthesised remarks are left out; "nothing" allows none; backticked names are modules (a
    trailing ``/*`` allows every module of that folder); "building blocks" allows every module but
    the stages and ``__main__``. ``named`` is the modules the cell names one by one (each must be
    imported: the column is exact, not a loose upper bound); ``unknown`` the backticked names that
    are no module.
    """
    text = re.sub(r"\([^()]*\)", "", cell)
    by_name = {doc_name(m, package): m for m in modules}
    allowed: set[str] = set()
    named: set[str] = set()
    unknown: list[str] = []
    for token in re.findall(r"`([^`]+)`", text):
        if token.endswith("/*"):
            allowed |= {m for n, m in by_name.items() if n.startswith(token[:-1])}
        elif token in by_name:
            named.add(by_name[token])
        else:
            unknown.append(token)
    if BUILDING_BLOCKS in text:
        allowed |= {m for m in modules if not _in(m, f"{package}.stages", f"{package}.__main__")}
    return allowed | named, named, unknown


def may_import_violations(graph: dict[str, list[Import]], doc: str, root: Path, package: str) -> list[str]:
    """One line per disagreement between the package map's "may import" column and the imports."""
    edges = project_edges(graph)
    table = may_import_table(doc)
    modules = module_names(root, package)
    by_file = {str(path.relative_to(root / package)): name for name, path in modules.items()}
    bad = [
        f"{file}: listed in docs/architecture.md but no such module" for file in table if file not in by_file
    ]
    for file, module in sorted(by_file.items()):
        if file not in table:
            if not file.endswith("__init__.py"):
                bad.append(f"{file}: no row in docs/architecture.md's package map")
            continue
        allowed, named, unknown = allowed_imports(table[file], sorted(modules), package)
        undeclared = sorted(doc_name(t, package) for t in edges[module] - allowed)
        unused = sorted(doc_name(n, package) for n in named - edges[module])
        if unknown:
            bad.append(f"{file}: its 'may import' cell names {unknown}, which are not modules")
        if undeclared:
            bad.append(
                f"{file} imports {undeclared}, not in its 'may import' cell: add them there or drop the import"
            )
        if unused:
            bad.append(
                f"{file}: its 'may import' cell names {unused}, which it does not import: remove them there"
            )
    return bad


def test_docs_architecture_may_import_column_is_exact(graph):
    """Every module imports exactly the project modules its row of the package map allows."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert "heads.py" in may_import_table(doc)
    assert may_import_violations(graph, doc, ROOT, PACKAGE) == []


# -- the checker itself ------------------------------------------------------------------------------
def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_checker_resolves_relative_imports_and_finds_cycles(tmp_path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/errors.py": "",
            "pkg/a.py": "from . import b\nfrom .errors import UserError\n",
            "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\nimport wandb\n",
            "pkg/sub/__init__.py": "from .x import f\n",
            "pkg/sub/x.py": "def f():\n    from ..a import thing\n    import deepspeed\n",
            "pkg/c.py": "import pkg.sub.x\nfrom pkg.sub import x\n",
        },
    )
    g = import_graph(tmp_path, "pkg")
    assert set(g) == {"pkg", "pkg.errors", "pkg.a", "pkg.b", "pkg.sub", "pkg.sub.x", "pkg.c"}
    assert {(e.target, e.in_function) for e in g["pkg.a"]} == {("pkg.b", False), ("pkg.errors", False)}
    assert {e.target for e in g["pkg.b"]} == {"typing", "wandb"}  # TYPE_CHECKING import left out
    assert {(e.target, e.in_function) for e in g["pkg.sub.x"]} == {("pkg.a", True), ("deepspeed", True)}
    assert {e.target for e in g["pkg.sub"]} == {"pkg.sub.x"}
    assert {e.target for e in g["pkg.c"]} == {"pkg.sub.x"}
    assert cycles(g) == []
    assert reachable(g, "pkg.c") >= {"pkg.a", "pkg.b", "wandb", "deepspeed"}
    assert "deepspeed" not in reachable(g, "pkg.c", top_level_only=True)

    (tmp_path / "pkg/b.py").write_text("import pkg.sub\n")  # b -> sub -> x -> a -> b
    assert cycles(import_graph(tmp_path, "pkg")) == [["pkg.a", "pkg.b", "pkg.sub", "pkg.sub.x"]]


def test_may_import_check_finds_undeclared_unused_and_unlisted(tmp_path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/errors.py": "",
            "pkg/a.py": "from pkg import errors\n",
            "pkg/b.py": "from pkg import a, errors\n",
            "pkg/c.py": "",
            "pkg/sub/__init__.py": "",
            "pkg/sub/x.py": "from pkg import a\n",
            "pkg/stages/__init__.py": "",
            "pkg/stages/s.py": "from pkg import b\nfrom pkg.sub import x\n",
        },
    )
    g = import_graph(tmp_path, "pkg")
    good = textwrap.dedent(
        """\
        | module | owns | may import (project) |
        |---|---|---|
        | `errors.py` | errors | nothing |
        | `a.py` | a | `errors` (its messages) |
        | `b.py` | b | `a`, `errors` |
        | `c.py` | c | nothing |
        | `sub/x.py` | x | `a` |
        | `stages/s.py` | a stage | building blocks |
        """
    )
    assert may_import_violations(g, good, tmp_path, "pkg") == []
    bad = (
        good.replace("| `a`, `errors` |", "| `errors`, `c` |")
        .replace("| `sub/x.py` | x | `a` |\n", "")
        .replace("`errors` (its messages)", "`errors`, `nope`")
    )
    assert may_import_violations(g, bad, tmp_path, "pkg") == [
        "a.py: its 'may import' cell names ['nope'], which are not modules",
        "b.py imports ['a'], not in its 'may import' cell: add them there or drop the import",
        "b.py: its 'may import' cell names ['c'], which it does not import: remove them there",
        "sub/x.py: no row in docs/architecture.md's package map",
    ]
    stage_row = "| `stages/s.py` | a stage | building blocks |"
    wildcard = good.replace(stage_row, "| `stages/s.py` | a stage | `b`, `sub/*` |")
    assert may_import_violations(g, wildcard, tmp_path, "pkg") == []
    assert may_import_violations(
        g, good.replace(stage_row, "| `stages/s.py` | a stage | `b` |"), tmp_path, "pkg"
    ) == ["stages/s.py imports ['sub/x'], not in its 'may import' cell: add them there or drop the import"]
