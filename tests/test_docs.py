"""The README and docs/ pages link to pages and sections that exist."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                               if f.endswith(".md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: str):
    with open(path) as f:
        return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", f.read(), re.M)}


@pytest.mark.parametrize("page", PAGES)
def test_links_resolve(page):
    with open(os.path.join(ROOT, page)) as f:
        text = f.read()
    links = [m.group(1) for m in LINK.finditer(text) if not m.group(1).startswith(("http://", "https://"))]
    assert links or page == "docs/api.md"
    for link in links:
        target, _, anchor = link.partition("#")
        path = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), target)) if target else os.path.join(ROOT, page)
        assert os.path.exists(path), f"{page} links to {link}, which does not exist"
        if anchor:
            assert anchor in _anchors(path), f"{page} links to {link}: no such section in {target or page}"


PATH = re.compile(r"`([\w.\-]+(?:/[\w.\-]+)+)(?::[\w.]+)?`")
PLACES = ("hf_ring", "tests", "bench", "docs", "examples", "patches", ".ci") + tuple(
    d for d in os.listdir(os.path.join(ROOT, "hf_ring")) if os.path.isdir(os.path.join(ROOT, "hf_ring", d)))
"""Where a backticked path of the pages starts: the checkout's folders, or hf_ring's packages (the module table
names ``engine/ring.py``)."""


@pytest.mark.parametrize("page", PAGES)
def test_backticked_paths_exist(page):
    """A file or folder a page names in backticks (``hf_ring/engine/ring.py``, ``tests/test_balance.py``,
    ``engine/balance.py``) is there: a module that moved leaves no stale path behind."""
    with open(os.path.join(ROOT, page)) as f:
        text = f.read()
    named = [m.group(1) for m in PATH.finditer(text) if m.group(1).split("/")[0] in PLACES]
    def there(path):  # a file or folder, or a module's name: ``engine/recurrence.Pieces``
        module = path.rsplit("/", 1)[0] + "/" + path.rsplit("/", 1)[1].split(".")[0] + ".py"
        return any(os.path.exists(os.path.join(ROOT, base, p)) for base in ("", "hf_ring") for p in (path, module))

    missing = [p for p in named if not there(p)]
    assert not missing, f"{page} names paths that do not exist: {sorted(set(missing))}"


def test_every_page_is_linked_from_the_readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    for page in PAGES[1:]:
        assert f"]({page})" in readme or f"]({page}#" in readme, f"{page} is not linked from the README"


# --- the API reference against the code ------------------------------------------------------------------------

def _api_text() -> str:
    with open(os.path.join(ROOT, "docs", "api.md")) as f:
        return f.read()


def test_api_reference_documents_every_public_name_with_its_live_signature():
    """Each name of hf_ring.__all__ has a ``### `name` `` section holding ``name(signature)`` as inspect gives it."""
    import inspect

    import hf_ring

    text = _api_text()
    lines = {line.strip() for line in text.splitlines()}
    headings = set(re.findall(r"^#{2,4} `([^`]+)`\s*$", text, re.M))
    problems = []
    for name in hf_ring.__all__:
        obj = getattr(hf_ring, name)
        if name not in headings:
            problems.append(f"{name}: no '### `{name}`' section in docs/api.md")
            continue
        if inspect.ismodule(obj):
            continue
        try:
            signature = f"{name}{inspect.signature(obj)}"
        except (TypeError, ValueError):  # a class whose constructor is a builtin's (an exception type)
            continue
        if signature not in lines:
            problems.append(f"{name}: docs/api.md lacks the line {signature}")
    stale = sorted(headings - set(hf_ring.__all__))
    problems += [f"{n}: documented but not in hf_ring.__all__" for n in stale]
    assert not problems, "\n".join(problems)


# --- figures: rendered from docs/bench/*.json, never typed ------------------------------------------------------

def _read(page: str) -> str:
    with open(os.path.join(ROOT, page)) as f:
        return f.read()


@pytest.fixture(scope="module")
def payloads():
    from bench import tables

    return tables.load(os.path.join(ROOT, "docs", "bench"))


def test_every_row_holds_only_fields_its_benchmark_writes(payloads):
    """A field no benchmark sets could only have been typed in: ``tables --check`` refuses it too."""
    from bench import tables

    assert tables.WRITERS, "no benchmark states the fields it writes"
    assert not tables.unwritten(payloads)


def test_every_table_in_the_pages_is_one_a_benchmark_renders():
    """A table between markers no benchmark renders would keep whatever was typed there."""
    from bench import tables

    texts = {page: open(page).read() for page in tables.pages(ROOT)}
    assert tables.unrendered(texts) == []
    assert tables.unrendered({"p.md": "<!-- bench:nothing -->\n| x |\n<!-- /bench:nothing -->"}) == ["p.md: nothing"]


@pytest.mark.parametrize("page", PAGES)
def test_tables_and_figures_are_what_the_json_renders(page, payloads):
    """What ``python -m bench tables --write`` would put in the page is what the page holds."""
    from bench import tables

    text = _read(page)
    figures = [m.group(2) for m in tables.FIGURE.finditer(text)]
    shown = [m.group(3) for m in tables.FIGURE.finditer(text)]
    rendered = [tables.render_figure(spec, payloads) for spec in figures]
    wrong = [f"{spec!r} shows {got!r}, the JSON gives {want!r}" for spec, got, want in zip(figures, shown, rendered)
             if got != want]
    assert not wrong, f"{page}: run python -m bench tables --write\n" + "\n".join(wrong)
    assert tables.render_page(text, payloads) == text, f"{page}: a table differs from its JSON (tables --write)"


def test_figure_expressions_select_exactly_and_refuse_anything_else(payloads):
    from bench import tables

    def row(name, **want):
        (got,) = [r for r in payloads[name]["rows"] if all(r[k] == v for k, v in want.items())]
        return got

    two = row("ring", n=8192, impl="ring", world=2, layout="zigzag")
    assert tables.render_figure("ring[n=8192,impl=ring,world=2,layout=zigzag].speedup_over_1_rank | {:.2f}×",
                                payloads) == f"{two['speedup_over_1_rank']:.2f}×"
    depths = [v for r in payloads["demo"]["rows"] for v in r["accuracy_by_depth"].values()]
    assert tables.render_figure("min(demo.rows[*].accuracy_by_depth.*) | {:.2f}", payloads) == f"{min(depths):.2f}"
    at_16k = [r for r in payloads["linear"]["rows"] if r["n"] == 16384]
    learned = [r for r in at_16k if r["accuracy_over_depths"] >= 0.9]
    assert tables.render_figure("len(linear.rows[n=16384,accuracy_over_depths>=0.9])", payloads) == str(len(learned))
    assert tables.render_figure("len(linear.rows[n=16384,accuracy_over_depths<0.9])", payloads) == str(len(at_16k) - len(learned))
    peak = row("scale", n=1048576)["peak_mb"]
    text = "a <!-- fig:scale[n=1048576].peak_mb | {:.0f} MB -->1 MB<!-- /fig --> b"
    assert tables.rewrite_figures(text, payloads) == \
        f"a <!-- fig:scale[n=1048576].peak_mb | {{:.0f}} MB -->{peak:.0f} MB<!-- /fig --> b"
    # !k: the rows without a field, e.g. rows written before the benchmark recorded it
    toy = {"t": {"rows": [{"n": 1, "lr": 0.002}, {"n": 1}, {"n": 2}]}}
    assert tables.render_figure("len(t.rows[n=1,!lr])", toy) == "1"
    assert tables.render_figure("len(t.rows[!lr])", toy) == "2"
    # a bound no item meets is a count of 0; a name or value no item has is a typo
    assert tables.render_figure("len(t.rows[n=1,lr>=0.5])", toy) == "0"
    with pytest.raises(ValueError, match="matches nothing"):
        tables.render_figure("len(t.rows[n=3,lr>=0.5])", toy)
    with pytest.raises(ValueError, match="selects 0 values"):
        tables.render_figure("t.rows[n=1,lr<0.001].lr", toy)
    assert tables.render_figure("t.rows[!lr, n=2].n", toy) == "2"
    with pytest.raises(ValueError, match="matches nothing"):
        tables.render_figure("t.rows[!n].n", toy)
    for bad in ("ring[n=8192].speedup_over_1_rank",  # eight rows: ambiguous
                "ring[n=1].fwd_s", "ring.nope", "nope.rows", "ring[foo].n", "__import__('os')",
                "ring[n=8192,world=1,impl=ring].fwd_s ** 2"):
        with pytest.raises(ValueError):
            tables.render_figure(bad, payloads)


BENCHMARK_FIGURE = re.compile(
    r"(?<![\w.\-=/+])\d+(?:[.,]\d+)*(?:\s?[–-]\s?\d+(?:[.,]\d+)*)?\s?"
    r"(?:×(?!\s?\d)|x(?!\w)|ms\b|µs\b|s\b|min\b|minutes\b|seconds\b|hours\b|[KMGT]i?B\b|kB\b|tok/s|tokens/s|%)")
"""A speed-up, a time, a memory size, tokens per second or a percentage: how benchmark results read in prose."""

ALLOWED_FIGURES = {
    # defaults of the API (sync_gradients' bucket, the tiled loss's logits budget), not measurements
    "docs/api.md": ("25 MiB", "128 MiB"),
    "docs/training.md": ("128 MiB",),
    # targets the first GPU run is judged against
    "docs/gpu.md": ("1.15×", "1.1×", "5%"),
    # assumptions of the on-paper memory estimate: GPU size, memory kept for buffers, gathered layers
    "docs/running.md": ("80 GB", "8 GB", "1 GB"),
}
"""Figures in prose that are not benchmark results, by page (everything else is rendered from the JSON)."""


def _prose(text: str) -> str:
    """The page without fenced code, inline code, rendered marker blocks, HTML comments and link targets."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    text = re.sub(r"<!-- bench:(\w+) -->.*?<!-- /bench:\1 -->", "", text, flags=re.S)
    text = re.sub(r"<!-- fig:.*?-->.*?<!-- /fig -->", "", text, flags=re.S)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.sub(r"\]\([^)]*\)", "]", text)


@pytest.mark.parametrize("page", PAGES)
def test_no_unrendered_benchmark_figures_in_prose(page):
    """Speed, time, memory and percentage figures in prose come from the JSON through fig markers."""
    found = [m.group(0) for m in BENCHMARK_FIGURE.finditer(_prose(_read(page)))]
    loose = [f for f in found if f not in ALLOWED_FIGURES.get(page, ())]
    assert not loose, (f"{page} states {loose}: render them from docs/bench/*.json with <!-- fig:EXPR | FORMAT "
                       "-->...<!-- /fig --> (python -m bench tables --write), or drop them")


def test_the_readme_is_a_front_page():
    text = _read("README.md")
    assert len(text.splitlines()) <= 200
    assert "<!-- bench:" not in text, "tables live in docs/benchmarks.md, not in the README"
    assert 'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -q' in text
    assert "## Two commands" in text


# --- the examples' options say what they do and what they default to -------------------------------------------

EXAMPLES = sorted(f for f in os.listdir(os.path.join(ROOT, "examples")) if f.endswith(".py"))


class _Parsed(Exception):
    def __init__(self, parser):
        super().__init__("parsed")
        self.parser = parser


def _example_parser(name: str, monkeypatch):
    """The ArgumentParser an example builds: its ``main`` runs up to parsing, which is stopped there."""
    import argparse
    import importlib.util
    import sys

    monkeypatch.syspath_prepend(os.path.join(ROOT, "examples"))  # generate.py imports finetune.py
    spec = importlib.util.spec_from_file_location(f"_example_{name[:-3]}", os.path.join(ROOT, "examples", name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def stop(self, *args, **kwargs):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
    monkeypatch.setattr(sys, "argv", [name])
    with pytest.raises(_Parsed) as got:
        module.main()  # every example parses its arguments before doing anything else
    return got.value.parser


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_example_option_has_help_that_states_its_default(name, monkeypatch):
    import argparse

    parser = _example_parser(name, monkeypatch)
    parser.format_help()  # a stray % in a help text would fail here, as --help would
    formatter = parser._get_formatter()
    options = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert options, name
    bad = []
    for action in options:
        text = formatter._expand_help(action) if action.help else ""
        if not text or action.help == argparse.SUPPRESS or "default" not in text.lower():
            bad.append(f"{'/'.join(action.option_strings) or action.dest}: {text!r}")
    assert not bad, f"examples/{name}: options without help stating the default:\n" + "\n".join(bad)
