"""The shape of the library's code: rules a change could break without any other test noticing."""
import ast
import pathlib

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
    """Options travel as one spec (hf_ring.spec.AttentionSpec), not as long lists of loose arguments."""
    found = []
    for path in _library_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _parameters(node) > MOST_PARAMETERS:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} takes {_parameters(node)}")
    assert not found, found


def test_the_parameter_count_sees_a_long_signature():
    fn = ast.parse("def f(self, " + ", ".join(f"a{i}" for i in range(13)) + "): pass").body[0]
    assert _parameters(fn) == 13


def _imports(path: pathlib.Path, package: str) -> set:
    """The library modules ``path`` imports: names of hf_ring's modules, ``patches`` for the patches package."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and package == "patches":
                continue  # inside the patches package
            parts = (node.module or "").split(".")
            if node.level == 1:
                names = parts if node.module else [a.name for a in node.names]
                found.add(names[0] if node.module else None)
                if not node.module:
                    found.update(a.name for a in node.names)
            elif parts[0] == "hf_ring" and len(parts) > 1:
                found.add(parts[1])
    return {m for m in found if m}


def _floors() -> dict:
    rooms = {p.stem: p for p in (ROOT / "hf_ring").glob("*.py")}
    deps = {name: _imports(p, "hf_ring") & (set(rooms) | {"patches"}) for name, p in rooms.items()}
    deps["patches"] = set().union(*(_imports(p, "patches") for p in (ROOT / "patches").glob("*.py"))) & set(rooms)
    floors: dict = {}

    def floor(name, seen=()):
        assert name not in seen, f"imports run in a circle through {name}"
        if name not in floors:
            floors[name] = 1 + max((floor(d, seen + (name,)) for d in deps[name] if d != name), default=0)
        return floors[name]

    for name in deps:
        floor(name)
    return floors


def test_how_it_works_gives_each_module_its_floor():
    """docs/how-it-works.md's module table states the floor each module's imports give it."""
    import re

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
