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
