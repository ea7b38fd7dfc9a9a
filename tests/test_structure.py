"""The shape of the library's code: rules a change could break without any other test noticing."""
import ast
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
MOST_PARAMETERS = 12


def _library_files():
    files = list((ROOT / "hf_ring").rglob("*.py")) + list((ROOT / "patches").rglob("*.py"))
    return [p for p in files if "bench" not in p.relative_to(ROOT).parts]


def _parameters(fn: ast.FunctionDef) -> int:
    a = fn.args
    count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    first = (a.posonlyargs + a.args)[:1]
    return count - (1 if first and first[0].arg in ("self", "cls", "ctx") else 0)


def test_no_library_function_takes_more_than_twelve_parameters():
    """Options travel as one spec (hf_ring.engine.spec.AttentionSpec), not as long lists of loose arguments."""
    found = []
    for path in _library_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _parameters(node) > MOST_PARAMETERS:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} takes {_parameters(node)}")
    assert not found, found


def test_the_parameter_count_sees_a_long_signature():
    fn = ast.parse("def f(self, " + ", ".join(f"a{i}" for i in range(13)) + "): pass").body[0]
    assert _parameters(fn) == 13


def _room(dotted: str):
    """The room of a module of the library: ``engine/ring`` for ``hf_ring.engine.ring``, ``patches`` for anything of
    ``hf_ring.patches``, ``__init__`` for the package itself; None outside the library."""
    parts = dotted.split(".")
    if parts[0] != "hf_ring":
        return None
    if len(parts) == 1:
        return "__init__"
    if parts[1] == "patches":
        return "patches"
    return "/".join(parts[1:])


def _module_of(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "patches":
        parts = ["hf_ring"] + parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: pathlib.Path) -> set:
    """The dotted names of every module ``path`` imports (relative imports resolved, ``from X import module`` too)."""
    module = _module_of(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            if node.module:  # a bare "from .. import x" names modules of its package, not the package itself
                found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)
    return found


def _rooms() -> dict:
    rooms = {}
    for path in _library_files():
        room = _room(_module_of(path))
        if room == "patches":
            continue
        if path.name == "__init__.py" and room != "__init__":
            continue  # a subpackage's face: it defines nothing
        rooms[room] = [path]
    rooms["patches"] = list((ROOT / "patches").glob("*.py"))
    return rooms


def _floors() -> dict:
    rooms = _rooms()
    deps = {}
    for name, paths in rooms.items():
        found = {_room(m) for p in paths for m in _imported(p)}
        deps[name] = {d for d in found if d in rooms and d != name}
    floors: dict = {}

    def floor(name, seen=()):
        assert name not in seen, f"imports run in a circle through {name}"
        if name not in floors:
            floors[name] = 1 + max((floor(d, seen + (name,)) for d in deps[name]), default=0)
        return floors[name]

    for name in deps:
        floor(name)
    return floors


FOLDERS = ("engine", "integration", "patches", "entry", "generation", "training")
"""The library's folders from the ground up (docs/how-it-works.md): a module imports from its own folder and the
folders below it, never from one above (``versions.py`` stands with the engine, the package's ``__init__`` above
all)."""


def _folder(room: str) -> int:
    """The floor of a room's folder in :data:`FOLDERS` (0 for ``versions``, one above the last for ``__init__``)."""
    if room == "__init__":
        return len(FOLDERS)
    top = room.split("/")[0]
    return 0 if top == "versions" else FOLDERS.index(top)


def _upward_imports(rooms: dict) -> list:
    found = []
    for name, paths in rooms.items():
        for path in paths:
            for target in {_room(m) for m in _imported(path)} & set(rooms):
                if _folder(target) > _folder(name):
                    found.append(f"{path.relative_to(ROOT)} imports {target} (a folder above its own)")
    return found


def test_folders_import_only_their_own_and_the_ones_below():
    assert not _upward_imports(_rooms())


def test_the_folder_check_sees_an_import_from_above(tmp_path, monkeypatch):
    low = tmp_path / "hf_ring" / "integration" / "low.py"
    low.parent.mkdir(parents=True)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    low.write_text("from ..entry.backend import register\nfrom ..patches import registry\n")
    found = _upward_imports({"integration/low": [low], "entry/backend": [], "patches": []})
    assert len(found) == 2, found


def test_how_it_works_gives_the_folder_order():
    """docs/how-it-works.md names the folders in the order the imports give them."""
    text = (ROOT / "docs" / "how-it-works.md").read_text()
    line = next(line for line in text.splitlines() if line.startswith("Folders, from the ground up:"))
    named = re.findall(r"`(?:hf_ring/)?(\w+)/`", line)
    assert tuple(named) == FOLDERS, named


def test_the_engine_imports_nothing_but_torch_and_itself():
    """The engine takes a spec and a communicator and knows nothing of models: no transformers, no accelerate,
    no other part of hf_ring."""
    found = []
    for path in (ROOT / "hf_ring" / "engine").glob("*.py"):
        for name in _imported(path):
            top = name.split(".")[0]
            if top in ("transformers", "accelerate", "peft", "trl", "deepspeed") or (
                    top == "hf_ring" and not name.startswith("hf_ring.engine")):
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not found, found


def test_the_engine_check_sees_a_forbidden_import(tmp_path, monkeypatch):
    leak = tmp_path / "hf_ring" / "engine" / "leak.py"
    leak.parent.mkdir(parents=True)
    leak.write_text("from ..integration.config import parse\nimport transformers\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert {"hf_ring.integration.config", "transformers"} <= _imported(leak)


def test_the_installed_package_holds_no_benchmark():
    """Benchmarks and the docs' renderer live in bench/ beside the package, run from a checkout."""
    packages = re.search(r"^packages = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.S | re.M).group(1)
    assert not (ROOT / "hf_ring" / "bench").exists() and "bench" not in packages, packages


def test_how_it_works_gives_each_module_its_floor():
    """docs/how-it-works.md's module table states the floor each module's imports give it."""
    floors = _floors()
    stated = {}
    for line in (ROOT / "docs" / "how-it-works.md").read_text().splitlines():
        m = re.match(r"\| (\d+) \| (.*?) \|", line)
        if m:
            for mod in re.findall(r"`([\w/]+?)(?:\.py|/)`", m.group(2)):
                stated[mod] = int(m.group(1))
    stated["__init__"] = stated.pop("__init__", None)
    assert set(stated) == set(floors), (set(floors) ^ set(stated))
    wrong = {m: (stated[m], floors[m]) for m in floors if stated[m] != floors[m]}
    assert not wrong, f"module: (stated, actual) {wrong}"
