"""The package's import graph: no circles, and no library module that imports a command line.

Read statically (``ast``), never by importing: a circle that Python tolerates today (one side
imports inside a function, after the other finished loading) is still two modules that cannot be
understood, tested or moved one without the other, and it turns into an ImportError the day
someone hoists the import. So an edge is EVERY import of a ``dflash_trt`` module the file
writes: at module level, inside a function, under ``if TYPE_CHECKING`` or ``if __name__ ==
"__main__"``. What is not an edge: a name a registry resolves when it runs
(``importlib.import_module`` on a string, as runtime/drafters/families.py names each family's
model and proposer: that is how a registry below its families reaches them), and a module's
own parent packages (Python runs ``dflash_trt/runtime/__init__.py`` before any module under it;
these ``__init__`` files import nothing eagerly, see test_runtime_init_imports_nothing_eagerly).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dflash_trt"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package under `root` (the repository), by dotted name."""
    return {module_name(p, root): p for p in sorted((root / "dflash_trt").rglob("*.py"))}


def imported(tree: ast.AST, here: str, is_package: bool, known: set[str]) -> set[str]:
    """The dflash_trt modules a file imports, anywhere in it (`from a.b import c` names a.b.c
    where c is a module, else a.b)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                pkg = here.split(".") if is_package else here.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:  # `import a.b.c` of a name inside a module: its module
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    out.discard(here)
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = modules(root)
    known = set(mods)
    return {m: imported(ast.parse(p.read_text(encoding="utf-8")), m, p.name == "__init__.py", known)
            for m, p in mods.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def is_command(name: str, path: Path) -> bool:
    """A command-line module: named cli, cli_* or *_cli, or an entry point whose top level is only
    constants and its ``if __name__ == "__main__"`` block (train/sampled.py)."""
    leaf = name.rpartition(".")[2]
    if leaf == "cli" or leaf.startswith("cli_") or leaf.endswith("_cli"):
        return True
    body = ast.parse(path.read_text(encoding="utf-8")).body
    has_main = any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in body)
    defines = any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for n in body)
    return has_main and not defines


def test_the_graph_reader_sees_every_kind_of_import(tmp_path):
    """The reader's own check, on a made-up package: module-level, function-level, relative,
    TYPE_CHECKING and __main__ imports are all edges; a circle is found, a chain is not."""
    pkg = tmp_path / "dflash_trt"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from dflash_trt.b import f\n",
        "b.py": "def f():\n    from dflash_trt.sub import c\n",
        "sub/__init__.py": "",
        "sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import x\n",
        "d.py": "import dflash_trt.sub.c as c\n",
        "e.py": "X = 1\nif __name__ == '__main__':\n    from dflash_trt import d\n",
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    graph = import_graph(tmp_path)
    assert graph["dflash_trt.b"] == {"dflash_trt.sub.c"}
    assert graph["dflash_trt.sub.c"] == {"dflash_trt.a"}
    assert graph["dflash_trt.d"] == {"dflash_trt.sub.c"}
    assert graph["dflash_trt.e"] == {"dflash_trt.d"}
    assert circles(graph) == [["dflash_trt.a", "dflash_trt.b", "dflash_trt.sub.c"]]
    assert is_command("dflash_trt.e", pkg / "e.py") and not is_command("dflash_trt.a", pkg / "a.py")


def test_no_module_of_the_package_is_in_an_import_circle():
    found = circles(import_graph())
    assert not found, "import circles (each a set of modules that import each other, at any depth): " + \
        "; ".join(" <-> ".join(c) for c in found)


def test_no_library_module_imports_a_command_line():
    """Commands import the library, never the other way round: one owner per concept, and the
    library stays usable (and importable) without click."""
    mods = modules()
    commands = {m for m, p in mods.items() if is_command(m, p)}
    assert {"dflash_trt.cli", "dflash_trt.cli_helpers", "dflash_trt.train.cli", "dflash_trt.generation_cli",
            "dflash_trt.train.sampled"} <= commands  # the rule's reach
    graph = import_graph()
    wrong = sorted(f"{m} -> {c}" for m in graph if m not in commands for c in graph[m] & commands)
    assert not wrong, "library modules importing a command line: " + ", ".join(wrong)
    # and the commands take what they share from cli_helpers, never from the top command
    # (dflash_trt/cli.py finds theirs by name when it runs)
    assert not sorted(m for m in graph if "dflash_trt.cli" in graph[m])


@pytest.mark.parametrize("package", ["dflash_trt.runtime", *sorted(
    module_name(p.parent) for p in (PACKAGE / "runtime").glob("*/__init__.py"))])
def test_runtime_init_imports_nothing_eagerly(package):
    """The runtime's packages import nothing when imported: `dflash-trt --help`, `serve` and the
    OpenAI front import runtime/decoding/tokens.py without pulling torch in through a parent."""
    path = modules()[package]
    body = ast.parse(path.read_text(encoding="utf-8")).body
    eager = [ast.unparse(n) for n in body if isinstance(n, (ast.Import, ast.ImportFrom))
             and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")
             and not any(a.name in ("importlib", "typing") or (n.module or "") == "typing" for a in n.names)]
    assert not eager, f"{path.relative_to(ROOT)} imports at load: {eager}"
