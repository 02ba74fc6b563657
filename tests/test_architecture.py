"""docs/architecture.md against the tree: the map a newcomer reads must be the house as it is.

- every path the page names (in backticks, or a table's room) exists, and so does every path of
  the README's layout block: a folder that is moved or removed fails here until the map follows;
- every top-level folder of the repository, every room of the package (a sub-folder or a
  top-level module of ``dflash_trt/``) and every room of ``dflash_trt/runtime/`` is in its table:
  a new folder is drawn, or this fails;
- the layers hold: a room imports only rooms on lower layers (imports read as
  tests/test_import_graph.py reads them: every import, function-level included).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

try:
    from tests.test_import_graph import ROOT, import_graph, modules
except ImportError:  # tests/ is not a package
    from test_import_graph import ROOT, import_graph, modules

DOC = ROOT / "docs" / "architecture.md"
PACKAGE_TABLE = "## The package, `dflash_trt/`"
RUNTIME_TABLE = "## The runtime, `dflash_trt/runtime/`"
REPOSITORY_TABLE = "## The repository"


def section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start: end if end >= 0 else len(text)]


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the first table in `text`, cells stripped."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", line.strip()):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows[1:]  # the header


def layered_rooms(heading: str, text: str | None = None) -> dict[str, int | None]:
    """{room path: layer} of one layered table (layer None: data, no code)."""
    rows = table_rows(section(text if text is not None else DOC.read_text(encoding="utf-8"), heading))
    return {row[1].strip("`"): (None if row[0] == "-" else int(row[0])) for row in rows}


def named_paths(text: str) -> set[str]:
    """Every backticked repository path of the page: a name with a slash in it, or a .py file."""
    out = set()
    for token in re.findall(r"`([^`\s]+)`", text):
        if "/" in token and not token.startswith(("http", "v1/")) and re.fullmatch(r"[\w./*-]+", token):
            out.add(token)
    return out


def resolve(path: str) -> Path | None:
    """`path` as a file of this checkout: from the root, or under dflash_trt/ or dflash_trt/runtime/
    (the page shortens paths inside the room it is describing); a glob must match something."""
    for base in (ROOT, ROOT / "dflash_trt", ROOT / "dflash_trt" / "runtime"):
        if "*" in path:
            if list(base.glob(path)):
                return base
        elif (base / path).exists():
            return base / path
    return None


def test_every_path_the_map_names_exists():
    text = DOC.read_text(encoding="utf-8")
    paths = named_paths(text)
    assert len(paths) > 40  # the reader sees the page's paths (a regex that matched nothing would pass)
    missing = sorted(p for p in paths if resolve(p) is None)
    assert not missing, f"docs/architecture.md names paths that are not in the tree: {missing}"


def test_every_path_of_the_readmes_layout_exists():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme[readme.index("## Layout"):]
    block = block[block.index("```") + 3:]
    block = block[: block.index("```")]
    names = [line.split()[0] for line in block.strip().splitlines()]
    assert "dflash_trt/runtime/" in names and len(names) >= 8
    missing = sorted(n for n in names if not (ROOT / n).exists())
    assert not missing, f"README.md's layout names paths that are not in the tree: {missing}"


def _children(folder: Path) -> set[str]:
    """The rooms of a package folder: sub-folders (not caches) and modules other than __init__."""
    out = set()
    for p in folder.iterdir():
        if p.is_dir() and p.name != "__pycache__" and any(p.iterdir()):
            out.add(f"{p.relative_to(ROOT)}/")
        elif p.suffix == ".py" and p.name != "__init__.py":
            out.add(str(p.relative_to(ROOT)))
    return out


@pytest.mark.parametrize("heading, folder", [(PACKAGE_TABLE, "dflash_trt"), (RUNTIME_TABLE, "dflash_trt/runtime")],
                         ids=["package", "runtime"])
def test_every_room_is_on_the_map(heading, folder):
    drawn = set(layered_rooms(heading))
    rooms = _children(ROOT / folder)
    assert not rooms - drawn, f"rooms of {folder}/ missing from docs/architecture.md: {sorted(rooms - drawn)}"
    assert not drawn - rooms, f"docs/architecture.md draws rooms {folder}/ does not have: {sorted(drawn - rooms)}"


def test_every_top_level_folder_is_on_the_map():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    folders = {f"{line.split('/')[0]}/" for line in tracked.splitlines() if "/" in line}
    drawn = {row[0].strip("`") for row in table_rows(section(DOC.read_text(encoding="utf-8"), REPOSITORY_TABLE))}
    assert folders == drawn, f"top-level folders: tracked {sorted(folders)}, drawn {sorted(drawn)}"


def room_of(module: str, rooms: dict[str, int | None]) -> str | None:
    """The room (a drawn path) a dotted module lives in, the longest drawn path that holds it."""
    path = module.replace(".", "/")
    best = None
    for room in rooms:
        if room.endswith("/") and (path + "/").startswith(room) or room == path + ".py":
            if best is None or len(room) > len(best):
                best = room
    return best


def layer_breaches(rooms: dict[str, int | None], graph: dict[str, set[str]]) -> list[str]:
    out = []
    for module, imported in graph.items():
        here = room_of(module, rooms)
        if here is None or rooms[here] is None:
            continue
        for other in imported:
            there = room_of(other, rooms)
            if there is None or there == here:
                continue
            if rooms[there] is None or rooms[there] >= rooms[here]:
                out.append(f"{module} ({here}, layer {rooms[here]}) imports {other} ({there}, layer {rooms[there]})")
    return sorted(out)


@pytest.mark.parametrize("heading", [PACKAGE_TABLE, RUNTIME_TABLE], ids=["package", "runtime"])
def test_every_import_goes_down_the_layers(heading):
    rooms = layered_rooms(heading)
    graph = import_graph()
    inside = {m: e for m, e in graph.items() if room_of(m, rooms) is not None}
    assert len(inside) > 30  # the rooms hold the package's modules
    assert not layer_breaches(rooms, graph), "imports that go up or across docs/architecture.md's layers:\n" + \
        "\n".join(layer_breaches(rooms, graph))


def test_the_layer_check_sees_an_import_going_up():
    """The check's own test, on the real graph: the drafters' layer moved above the batched
    runtime's, the batched runtime's imports of the drafters go up and are named."""
    rooms = layered_rooms(RUNTIME_TABLE)
    rooms["dflash_trt/runtime/drafters/"] = 9
    breaches = layer_breaches(rooms, import_graph())
    assert any(b.startswith("dflash_trt.runtime.batched.runtime ") and "drafters" in b for b in breaches)
    assert modules()["dflash_trt.runtime.batched.runtime"].is_file()
