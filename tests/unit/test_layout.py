"""The dependency rule of `agentloop/__init__.py`, read from its table and checked on every import.

Every `import` and `from ... import` in every module counts, function-local ones included (ast, so
nothing is executed). An import of `pkg.sub` also runs the `__init__` of each package on the way that
the importer is not already inside; those implicit edges count for cycles (Python runs them), not
for the layer rule (a vocabulary leaf such as tools/config.py lives in a folder of a higher layer).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import agentloop

PKG = Path(agentloop.__file__).resolve().parent


# ---------------------------------------------------------------- reading the rule and the code


def rule() -> tuple[list[str], dict[str, str], dict[str, str]]:
    """(layers from lowest to highest, folder -> layer, single module file -> layer) from the docstring."""
    doc = agentloop.__doc__ or ""
    rows = re.findall(r"^    (\w+) +(\S.*?)\s{2,}\S.*$|^    (vocabulary) +(.*)$", doc, re.M)
    layers: list[str] = []
    folders: dict[str, str] = {}
    files: dict[str, str] = {}
    for name, where, vname, vwhere in rows:
        name, where = (name, where) if name else (vname, vwhere)
        if name == "layer":
            continue
        layers.append(name)
        for token in where.split():
            if token.endswith("/"):
                folders[token.rstrip("/")] = name
            elif token.endswith(".py"):
                files[token[:-3].replace("/", ".")] = name
    assert layers and "vocabulary" in layers, "the dependency table is missing from agentloop/__init__.py"
    return layers[::-1], folders, files


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PKG.rglob("*.py") if "site" not in p.relative_to(PKG).parts}


def is_package(mod: str, modules: dict[str, Path]) -> bool:
    return mod in modules and modules[mod].name == "__init__.py"


def imports_of(mod: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """agentloop modules that `mod` names in an import statement (anywhere in the file)."""
    pkg = mod if is_package(mod, modules) else mod.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "agentloop"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "agentloop":
                continue
            for a in node.names:  # `from pkg import submodule` names the submodule
                sub = f"{target}.{a.name}"
                out.add(sub if sub in modules else target)
    return {m for m in out if m in modules}


def owner(mod: str, folders: dict[str, str], files: dict[str, str]) -> str | None:
    rel = mod.split(".")[1:]
    for k in range(len(rel), 0, -1):
        dotted = ".".join(rel[:k])
        if dotted in files:
            return files[dotted]
    return folders.get(rel[0]) if rel else None


def graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(explicit import edges, explicit + implicit package-__init__ edges) over agentloop modules."""
    modules = all_modules()
    explicit = {m: imports_of(m, p, modules) - {m} for m, p in modules.items()}
    full: dict[str, set[str]] = {}
    for m, targets in explicit.items():
        edges = set(targets)
        own = set(m.split(".")[:i] and ".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 2))
        for t in targets:
            parts = t.split(".")
            for i in range(2, len(parts)):  # ancestors of t below the root package
                anc = ".".join(parts[:i])
                if anc not in own and is_package(anc, modules):
                    edges.add(anc)
        full[m] = edges - {m}
    return explicit, full


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


# ---------------------------------------------------------------- the checks


def layer_violations() -> list[str]:
    layers, folders, files = rule()
    rank = {name: i for i, name in enumerate(layers)}
    explicit, _ = graph()
    bad = []
    for m, targets in sorted(explicit.items()):
        if m == "agentloop":
            continue
        lm = owner(m, folders, files)
        if lm is None:
            bad.append(f"{m}: in no layer of the table")
            continue
        for t in sorted(targets):
            if t == "agentloop":
                bad.append(f"{m} imports the package root (the public API is for users only)")
                continue
            lt = owner(t, folders, files)
            if lt is None:
                bad.append(f"{t}: in no layer of the table")
            elif lm == "vocabulary" and lt != "vocabulary":
                bad.append(f"{m} (vocabulary) imports {t} ({lt})")
            elif rank[lt] > rank[lm]:
                bad.append(f"{m} ({lm}) imports {t} ({lt}), a higher layer")
    return bad


def test_the_table_names_every_folder_of_the_package():
    _, folders, files = rule()
    subdirs = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert subdirs <= set(folders), f"folders missing from the dependency table: {subdirs - set(folders)}"
    top = {p.stem for p in PKG.glob("*.py")} - {"__init__"}
    assert top <= set(files), f"top-level modules missing from the dependency table: {top - set(files)}"


def test_every_import_points_down_the_layers():
    assert layer_violations() == []


def test_no_import_cycles_function_local_imports_included():
    _, full = graph()
    assert cycles(full) == []


def test_bench_report_and_cli_are_leaves_of_the_core():
    explicit, _ = graph()
    for m, targets in explicit.items():
        for t in targets:
            if t.startswith("agentloop.bench"):
                assert m == "agentloop.cli" or m.startswith("agentloop.bench"), f"{m} imports {t}"
            if t == "agentloop.cli":
                pytest.fail(f"{m} imports the command line")


def train_rooms() -> dict[str, set[str]]:
    """room -> the rooms it may import, from the "Rooms" table of agentloop/train/__init__.py."""
    import agentloop.train

    doc = agentloop.train.__doc__ or ""
    table = doc.split("Rooms (checked by", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^    (\w+)  +(\S.*)$", table, re.M)
    rooms = {room: (set() if may.strip() == "-" else set(may.split())) for room, may in rows if room != "room"}
    assert rooms and "shared" in rooms, "the rooms table is missing from agentloop/train/__init__.py"
    return rooms


def room_of(mod: str) -> str | None:
    """A module's room: the train sub-package it is in, "shared" for the modules of agentloop/train itself."""
    parts = mod.split(".")
    if parts[:2] != ["agentloop", "train"]:
        return None
    if len(parts) == 2 or (len(parts) == 3 and not is_package(mod, all_modules())):
        return "shared"
    return parts[2]


def room_order(rooms: dict[str, set[str]]) -> list[str]:
    """Problems with the table itself: a row naming an unknown room, or one above it (the arrows must point one
    way: down the table)."""
    names = list(rooms)
    bad = []
    for i, room in enumerate(names):
        for other in sorted(rooms[room]):
            if other not in rooms:
                bad.append(f"{room} may import {other}, which is no room")
            elif names.index(other) <= i:
                bad.append(f"{room} may import {other}, which is not below it")
    return bad


def room_violations(rooms: dict[str, set[str]] | None = None) -> list[str]:
    rooms = train_rooms() if rooms is None else rooms
    explicit, _ = graph()
    bad = []
    for m in sorted(explicit):
        rm = room_of(m)
        if rm is None or m == "agentloop.train":
            continue
        if rm not in rooms:
            bad.append(f"{m}: in no room of the table")
            continue
        for t in sorted(explicit[m]):
            rt = room_of(t)
            if rt is not None and rt != rm and rt not in rooms[rm]:
                bad.append(f"{m} ({rm}) imports {t} ({rt})")
    return bad


def test_train_rooms_point_one_way():
    rooms = train_rooms()
    folders = {p.name for p in (PKG / "train").iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(rooms) - {"shared"}, f"train's folders and the rooms table differ: {folders ^ set(rooms)}"
    assert room_order(rooms) == []
    assert room_violations(rooms) == []
    # the orchestrator and the trainer never import each other, whichever way round
    assert "trainer" not in rooms["orchestrator"] and "orchestrator" not in rooms["trainer"]


def test_the_room_checker_can_fail():
    rooms = train_rooms()
    # the step loop imports the batch room: forbidding that is reported
    no_batch = {**rooms, "orchestrator": rooms["orchestrator"] - {"batch"}}
    assert any(v.startswith("agentloop.train.orchestrator.loop (orchestrator) imports agentloop.train.batch.")
               for v in room_violations(no_batch))
    # a room allowed to import one above it breaks the one direction
    assert room_order({**rooms, "batch": {"shared", "trainer"}}) == ["batch may import trainer, which is not below it"]


def test_every_folder_says_what_it_is_for():
    for init in PKG.rglob("__init__.py"):
        if "site" in init.relative_to(PKG).parts:
            continue
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.split()) >= 8, f"{init.relative_to(PKG.parent)} has no docstring saying its role"


# ---------------------------------------------------------------- the checker itself can fail


def test_checker_catches_an_upward_import_and_a_local_cycle(tmp_path, monkeypatch):
    """A fake package where a low layer imports a high one inside a function, and two modules import
    each other inside functions: both must be reported."""
    pkg = tmp_path / "agentloop"
    (pkg / "util").mkdir(parents=True)
    (pkg / "train").mkdir()
    (pkg / "__init__.py").write_text('"""x\n\n    layer       where       role\n'
                                     "    train       train/      the trainer\n"
                                     "    util        util/       helpers\n"
                                     '    vocabulary  errors.py\n"""\n')
    (pkg / "errors.py").write_text("")
    (pkg / "util" / "__init__.py").write_text('"""helpers for everyone, importing only the vocabulary."""\n')
    (pkg / "util" / "a.py").write_text("def f():\n    from agentloop.train import b\n")
    (pkg / "train" / "__init__.py").write_text('"""the trainer, which may import util and the vocabulary."""\n')
    (pkg / "train" / "b.py").write_text("def g():\n    from agentloop.train import c\n")
    (pkg / "train" / "c.py").write_text("def h():\n    import agentloop.train.b\n")
    fake = type(agentloop)("agentloop")
    fake.__file__ = str(pkg / "__init__.py")
    fake.__doc__ = (pkg / "__init__.py").read_text().strip().strip('"')
    monkeypatch.setattr(__import__(__name__, fromlist=["x"]), "agentloop", fake)
    monkeypatch.setattr(__import__(__name__, fromlist=["x"]), "PKG", pkg)
    assert layer_violations() == ["agentloop.util.a (util) imports agentloop.train.b (train), a higher layer"]
    assert cycles(graph()[1]) == [["agentloop.train.b", "agentloop.train.c"]]
