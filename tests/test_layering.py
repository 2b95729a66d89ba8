"""The import graph of `src/boundgen` against the layer order written in docs/architecture.md: no
cycle (lazy imports inside functions count too), and no import that goes up a layer."""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "boundgen"
DOC = ROOT / "docs" / "architecture.md"


def modules() -> dict[str, Path]:
    """`attention/backends`-style names (a package's `__init__` is its folder name) → file."""
    out = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).with_suffix("").as_posix()
        out[rel.removesuffix("/__init__") if rel != "__init__" else "__init__"] = path
    return out


def imports(path: Path, known: set[str]) -> set[str]:
    """The boundgen modules `path` imports, anywhere in the file."""

    def resolve(dotted: str) -> str | None:
        name = dotted.removeprefix("boundgen").lstrip(".").replace(".", "/") or "__init__"
        while name and name not in known:
            name = name.rpartition("/")[0]
        return name or None

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {resolve(a.name) for a in node.names if a.name.startswith("boundgen")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "boundgen":
                for a in node.names:  # `from boundgen.x import y` may import module x.y
                    found.add(resolve(f"{node.module}.{a.name}"))
    return {m for m in found if m}


def layers() -> list[list[str]]:
    """The ```layers block of docs/architecture.md: one layer per line, lowest first, each a list of
    module patterns (`compile/*`, `runner`)."""
    block = re.search(r"```layers\n(.*?)```", DOC.read_text(), re.S)
    assert block, "docs/architecture.md has no ```layers block"
    rows = []
    for line in block.group(1).splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            rows.append(line.split(":", 1)[1].split())
    return rows


def layer_of(module: str, table: list[list[str]]) -> int:
    """The layer naming `module` exactly, else the one whose pattern covers it (`pkg/*` covers the
    package's modules and the package itself)."""
    exact = [i for i, pats in enumerate(table) if module in pats]
    if exact:
        return exact[0]
    hits = [
        i
        for i, pats in enumerate(table)
        for p in pats
        if fnmatch.fnmatchcase(module, p) or (p.endswith("/*") and module == p[:-2])
    ]
    assert len(hits) == 1, f"{module}: in {len(hits)} layers of docs/architecture.md, not 1"
    return hits[0]


def test_every_module_has_a_layer_and_imports_only_go_down():
    mods = modules()
    table = layers()
    upward = []
    for name, path in sorted(mods.items()):
        mine = layer_of(name, table)
        for dep in sorted(imports(path, set(mods)) - {name}):
            if layer_of(dep, table) > mine:
                upward.append(f"{name} (layer {mine}) imports {dep} (layer {layer_of(dep, table)})")
    assert not upward, "imports that go up the layers:\n" + "\n".join(upward)


def test_no_import_cycles():
    mods = modules()
    graph = {name: imports(path, set(mods)) - {name} for name, path in mods.items()}
    # NOTE: a package's __init__ may re-export its own modules; that is not a cycle with them.
    for name in graph:
        graph[name] = {d for d in graph[name] if not d.startswith(name + "/")}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)
