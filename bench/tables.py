"""``python -m bench tables``: the documentation's benchmark tables and figures, rendered from JSON.

Each table sits in the page that shows it (README.md or a page of docs/)
between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``; ``--write``
replaces what is there with the rows of ``DIR/NAME.json`` (as
``python -m bench NAME --out DIR`` wrote it), in every page that has
the markers, so the figures shown are the ones the benchmarks measured. A few
tables are made from another file's JSON (``DERIVED``: ``generate_decode_parts``
from ``generate.json``, ``linear_timing`` from ``linear.json``).

A figure in prose sits between ``<!-- fig:EXPR | FORMAT -->`` and
``<!-- /fig -->``: ``--write`` puts ``FORMAT.format(value of EXPR)`` there.
``EXPR`` is arithmetic (``+ - * /``, parentheses, numbers, and ``min``,
``max``, ``len``, ``sum``, ``abs``) over references into the JSON files of
``DIR``: a reference starts with a file's name (``ring`` for ``ring.json``)
and goes on with ``.key`` (a dict's entry; ``.'a key'`` when it holds other
characters; ``.*`` every value of a dict), ``[k=v,...]`` (the items of a list,
or of a file's ``rows``, whose entries ``k`` read as ``v``, or begin with it
for ``k^=v``, or are numbers of at least ``v`` for ``k>=v``, below it for
``k<v``; ``v`` may be quoted; ``!k``: the items without an entry ``k``), ``[*]`` (every item) and ``[i]`` (item ``i``).
A selection's ``=``, ``^=`` and ``!k`` conditions must match at least one
item, while its ``>=`` and ``<`` bounds may leave none (``len`` is then 0); a reference used outside
``min``/``max``/``len``/``sum`` must come to exactly one value. ``FORMAT`` is a ``str.format`` string with one field (default
``{}``). For example::

    <!-- fig:ring[n=8192,impl=ring,world=2,layout=zigzag].speedup_over_1_rank | {:.2f}× -->1.85×<!-- /fig -->

``--check`` exits non-zero when a page differs from what ``--write`` would
make of it, when a page has a table no benchmark renders, or when a row
holds a field its benchmark never writes (``WRITES`` in the benchmark's
module) or lacks the command and commit its benchmark stamps every row
with, which only an edit by hand could have made.
"""
from __future__ import annotations

import argparse
import ast
import glob
import json
import operator
import os
import re
import sys
from typing import Any, Callable, Dict, List, Tuple

import importlib

from . import BENCHES

COLUMNS: Dict[str, Any] = {}
"""Every table's columns, as each benchmark module states its own (``TABLES``)."""
WRITERS: Dict[str, Dict[str, Tuple[str, ...]]] = {}
"""Per JSON file, per list of rows, the fields its benchmark can write, where the module states them (``WRITES``)."""
BESIDE: Dict[str, Tuple[str, ...]] = {}
"""Per JSON file of those, what its benchmark writes beside the rows and the stamps (``BESIDE``)."""
for _name in sorted(set(BENCHES.values()) - {__name__}):
    _module = importlib.import_module(_name)
    COLUMNS.update(getattr(_module, "TABLES", {}))
    WRITERS.update(getattr(_module, "WRITES", {}))
    BESIDE.update(getattr(_module, "BESIDE", {}))


STAMPS = ("runs", "command", "commit")
"""What every writer that states its rows puts beside them: the runs' options, the command, the commit."""


ROW_STAMPS = ("command", "commit")
"""What a writer that stamps each row (it lists them in ``WRITES``) puts in every row it writes."""


def unwritten(payloads: Dict[str, Any]) -> List[str]:
    """Rows holding a field their benchmark never writes or lacking the stamps it always writes, and keys beside the
    rows it never writes: no command could have made them."""
    found = []
    for name, lists in WRITERS.items():
        extra = sorted(set(payloads.get(name, {})) - set(lists) - set(STAMPS) - set(BESIDE.get(name, ())))
        if extra:
            found.append(f"{name}.json: {', '.join(extra)}")
        for key, fields in lists.items():
            stamps = [s for s in ROW_STAMPS if s in fields]
            for i, row in enumerate(payloads.get(name, {}).get(key, [])):
                extra = sorted(set(row) - set(fields))
                if extra:
                    found.append(f"{name}.json {key}[{i}]: {', '.join(extra)}")
                missing = [s for s in stamps if s not in row]
                if missing:
                    found.append(f"{name}.json {key}[{i}]: no {' or '.join(missing)}")
    return found


def unrendered(texts: Dict[str, str]) -> List[str]:
    """Table markers of the pages (``{page: text}``) that no benchmark renders: a table there is typed in by hand."""
    known = set(COLUMNS) | set(DERIVED)
    return [f"{page}: {m.group(1)}" for page, text in texts.items()
            for m in re.finditer(r"<!-- bench:(\w+) -->", text) if m.group(1) not in known]


def _cell(value) -> str:
    if value is None or value == "":
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def render(name: str, payload: Dict) -> str:
    """The markdown table of one benchmark's JSON."""
    rows: List[Dict] = [dict(r) for r in payload["rows"]]
    if "fits" in payload:  # bench scale's files: each row beside its group's fit
        for r in rows:
            f = payload.get("fits", {}).get(f"{r['attention']} tiling={r['tiling']}")
            if f:
                pred = f["a_mb"] + f["b_mb_per_token"] * r["n"] / r["world"]
                r["fit_mb"], r["fit_off"] = round(pred), f"{100 * (r['peak_mb'] - pred) / pred:+.1f}%"
    cols = [(k, h) for k, h in COLUMNS[name] if any(k in r for r in rows)]
    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(_cell(r.get(k)) for k, _ in cols) + " |" for r in rows]
    if "fits" in payload:
        for key, f in payload["fits"].items():
            # the worst point as the "fit off by" column counts it (against the fit), so the two always agree
            offs = [abs(r["peak_mb"] - (f["a_mb"] + f["b_mb_per_token"] * r["n"] / r["world"]))
                    / (f["a_mb"] + f["b_mb_per_token"] * r["n"] / r["world"])
                    for r in payload["rows"] if f"{r['attention']} tiling={r['tiling']}" == key]
            worst = max(offs) if offs else f["max_rel_err"]
            lines.append("")
            lines.append(f"Fit ({key}): peak MB per rank = {f['a_mb']} + {f['b_kib_per_token']} KiB × n/p "
                         f"(worst point off by {100 * worst:.1f}%, {f['points']} points).")
    return "\n".join(lines)


def render_decode_parts(payload: Dict) -> str:
    """Where a decoded token's time goes, rank 0, from ``bench generate``'s ``decode_ms_per_token_parts``; beside
    it one merge's all-gather and one merge's arithmetic, each alone and back to back (milliseconds per call)."""
    parts = ("attention over the local cache", "merging partials (exchange and waits included)",
             "rest of the model and generate")
    exchange = "of it the all-gather (posting and waiting)"
    lines = ["| prompt | ranks | attention over the local cache | merging the partials (exchange, waits included) "
             "| of it the all-gather | rest of the model and `generate` | total "
             "| one all-gather alone: median / mean | one merge's arithmetic alone |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in payload["rows"]:
        got = (r.get("decode_ms_per_token_parts") or [None])[0]
        if not got:
            continue
        cells = [round(got[p], 1) for p in parts]
        cells.insert(2, round(got[exchange], 1) if exchange in got else "-")
        total = round(sum(got[p] for p in parts), 1)
        alone = r.get("merge_allgather_alone_ms")
        floor = f"{alone['median'][0]:.2f} / {alone['mean'][0]:.2f}" if alone else "-"
        arithmetic = r.get("merge_arithmetic_alone_ms")
        own = f"{arithmetic[0]:.2f}" if arithmetic else "-"
        lines.append("| " + " | ".join(_cell(c) for c in [r["n"], r["world"], *cells, total, floor, own]) + " |")
    return "\n".join(lines)


DERIVED: Dict[str, Tuple[str, Callable[[Dict], str]]] = {
    "generate_decode_parts": ("generate", render_decode_parts),
    "quality_timing": ("quality", lambda payload: render("quality_timing", {"rows": payload.get("timing", [])})),
    "quality_convert": ("quality", lambda payload: render("quality_convert", {"rows": payload.get("converted", [])})),
    "linear_extension": ("linear", lambda payload: render("linear_extension", {"rows": payload.get("extension", [])})),
    "fixed_exchanges": ("fixed", lambda payload: render("fixed_exchanges", {"rows": payload.get("exchanges", [])})),
    "vision_curve": ("vision", lambda payload: render("vision_curve", {"rows": payload.get("curve", [])})),
    "linear_timing": ("linear", lambda payload: render("linear_timing", {"rows": payload.get("timing", [])})),
    "packed_counted": ("packed", lambda payload: render("packed_counted", {"rows": payload.get("counted", [])})),
    "packed_timed": ("packed", lambda payload: render("packed_timed", {"rows": payload.get("timed", [])})),
}
"""Tables made from another benchmark's JSON: NAME -> (the JSON's name, its renderer)."""


def rewrite(text: str, tables: Dict[str, str]) -> str:
    """``text`` with the content between each ``<!-- bench:NAME -->`` marker pair replaced."""
    for name, table in tables.items():
        pattern = re.compile(rf"(<!-- bench:{name} -->\n)(.*?)(<!-- /bench:{name} -->)", re.S)
        text = pattern.sub(lambda m: m.group(1) + table + "\n" + m.group(3), text)
    return text


FIGURE = re.compile(r"(<!-- fig:(.*?) -->)(.*?)(<!-- /fig -->)", re.S)
_REF = re.compile(r"""[A-Za-z_]\w*(?:\.(?:\w+|'[^']*'|\*)|\[(?:[^\]']|'[^']*')*\])+""")
_ACCESSOR = re.compile(r"""\.(\w+|'[^']*'|\*)|\[((?:[^\]']|'[^']*')*)\]""")
_CONDITION = re.compile(r"""\s*(?:!\s*(\w+)|(\w+)\s*(\^?=|>=|<)\s*('[^']*'|[^,]*?))\s*(?:,|$)""")
_ONE = r"""\s*(?:!\s*\w+|\w+\s*(?:\^?=|>=|<)\s*(?:'[^']*'|[^,']*?))\s*"""
_SELECTOR = re.compile(rf"{_ONE}(?:,{_ONE})*")
_FUNCTIONS: Dict[str, Callable] = {"min": min, "max": max, "len": len, "sum": sum, "abs": abs}
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.USub: operator.neg, ast.UAdd: operator.pos}


class _Many(list):
    """The values a reference selected (a selection may match several items)."""


def _unquote(text: str) -> str:
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] == "'" else text


_BOUNDS = (">=", "<")
"""The conditions on a number: a selection that names items may have none within its bounds."""


def _holds(value: Any, op: str, want: str) -> bool:
    """Whether an item's ``value`` meets one condition of a selection: ``=``, ``^=`` (begins with), ``>=`` or ``<``
    (a number)."""
    if op == "=":
        return str(value) == want
    if op == "^=":
        return str(value).startswith(want)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    return value >= float(want) if op == ">=" else value < float(want)


def _meets(item: Any, conditions: List[Tuple[str, str, str]]) -> bool:
    """Whether a list's ``item`` meets every one of a selection's ``conditions`` (``!`` for an absent entry)."""
    return all(isinstance(item, dict) and (k not in item if op == "!" else k in item and _holds(item[k], op, want))
               for k, op, want in conditions)


def resolve(ref: str, payloads: Dict[str, Any]) -> Any:
    """The value (or, after a selection, the ``_Many`` values) a reference names."""
    name = re.match(r"[A-Za-z_]\w*", ref).group(0)
    if name not in payloads:
        raise ValueError(f"{ref}: no {name}.json among the benchmarks' JSON ({', '.join(sorted(payloads))})")
    values, many = [payloads[name]], False
    for m in _ACCESSOR.finditer(ref, len(name)):
        key, selector = m.group(1), m.group(2)
        if key is not None:
            out = []
            for v in values:
                if key == "*":
                    if not isinstance(v, dict):
                        raise ValueError(f"{ref}: .* needs a dict, got {type(v).__name__}")
                    out.extend(v.values())
                    many = True
                else:
                    k = _unquote(key)
                    if not isinstance(v, dict) or k not in v:
                        raise ValueError(f"{ref}: no key {k!r}")
                    out.append(v[k])
            values = out
        else:
            index, conditions = None, []
            if re.fullmatch(r"\s*-?\d+\s*", selector):
                index = int(selector)
            elif selector.strip() != "*":
                if not _SELECTOR.fullmatch(selector):
                    raise ValueError(f"{ref}: cannot read the selection [{selector}] "
                                     "(k=v, k^=v, k>=number, k<number, !k, *, or an index)")
                conditions = [(c.group(1), "!", "") if c.group(1) else (c.group(2), c.group(3), _unquote(c.group(4)))
                              for c in _CONDITION.finditer(selector) if c.group(1) or c.group(2)]
            names = [c for c in conditions if c[1] not in _BOUNDS]
            bounds = [c for c in conditions if c[1] in _BOUNDS]
            out, named = [], False
            for v in values:
                items = v["rows"] if isinstance(v, dict) and "rows" in v else v
                if not isinstance(items, list):
                    raise ValueError(f"{ref}: [{selector}] needs a list, got {type(items).__name__}")
                if index is not None:
                    out.extend(items[index:index + 1] if -len(items) <= index < len(items) else [])
                    named = named or bool(out)
                    continue
                found = [i for i in items if _meets(i, names)]
                named = named or bool(found)
                out.extend(i for i in found if _meets(i, bounds))
            if not named:  # a typo in a name or value; a bound that no item meets is a count of 0
                raise ValueError(f"{ref}: [{selector}] matches nothing")
            values, many = out, True
    return _Many(values) if many else values[0]


def _one(value: Any, ref: str) -> Any:
    if isinstance(value, _Many):
        if len(value) != 1:
            raise ValueError(f"{ref} selects {len(value)} values where one is needed (use min, max, len or sum)")
        return value[0]
    return value


def evaluate(expr: str, payloads: Dict[str, Any]) -> Any:
    """The value of a figure's expression (see the module's docstring)."""
    refs: Dict[str, str] = {}

    def hold(m):
        refs[f"_ref{len(refs)}"] = m.group(0)
        return f"_ref{len(refs) - 1}"

    try:
        tree = ast.parse(_REF.sub(hold, expr.strip()), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"cannot read the figure expression {expr!r}: {err}") from None

    def run(node, whole=False):
        if isinstance(node, ast.Expression):
            return run(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.Name) and node.id in refs:
            value = resolve(refs[node.id], payloads)
            return value if whole else _one(value, refs[node.id])
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](run(node.left), run(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](run(node.operand))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS \
                and not node.keywords and node.args:
            args = [run(a, whole=True) for a in node.args]
            if len(args) == 1 and isinstance(args[0], list):
                return _FUNCTIONS[node.func.id](list(args[0]))
            return _FUNCTIONS[node.func.id](*[_one(a, expr) for a in args])
        raise ValueError(f"the figure expression {expr!r} may hold only references, numbers, + - * /, parentheses "
                         f"and {', '.join(_FUNCTIONS)}; found {ast.dump(node)[:80]}")

    return _one(run(tree), expr)


def render_figure(spec: str, payloads: Dict[str, Any]) -> str:
    """The text of one ``<!-- fig:SPEC -->`` marker: ``EXPR | FORMAT`` (FORMAT defaults to ``{}``)."""
    expr, sep, fmt = spec.rpartition(" | ")
    if not sep:
        expr, fmt = spec, "{}"
    return fmt.strip().format(evaluate(expr, payloads))


def rewrite_figures(text: str, payloads: Dict[str, Any]) -> str:
    """``text`` with the value between each ``<!-- fig:... -->`` and ``<!-- /fig -->`` rendered anew."""
    def one(m):
        try:
            return m.group(1) + render_figure(m.group(2), payloads) + m.group(4)
        except (ValueError, KeyError, TypeError, IndexError, ZeroDivisionError) as err:
            raise ValueError(f"figure {m.group(1)}: {err}") from None

    return FIGURE.sub(one, text)


def load(directory: str) -> Dict[str, Any]:
    """Every ``NAME.json`` of ``directory``, by NAME."""
    payloads = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        with open(path) as f:
            payloads[os.path.splitext(os.path.basename(path))[0]] = json.load(f)
    return payloads


def tables_of(payloads: Dict[str, Any]) -> Dict[str, str]:
    """Every table the JSON at hand gives, by marker name."""
    tables = {name: render(name, payloads[name]) for name in COLUMNS if name in payloads}
    tables.update({name: fn(payloads[source]) for name, (source, fn) in DERIVED.items() if source in payloads})
    return tables


def render_page(text: str, payloads: Dict[str, Any]) -> str:
    """A page with its tables and figures rendered from ``payloads``."""
    return rewrite_figures(rewrite(text, tables_of(payloads)), payloads)


def pages(root: str = ".") -> List[str]:
    """The pages that may hold tables: README.md and docs/*.md."""
    return [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "*.md")))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench tables", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="docs/bench", help="where the benchmarks' JSON files are (default: %(default)s)")
    ap.add_argument("--root", default=".",
                    help="the checkout whose README.md and docs/*.md get the tables (default: %(default)s)")
    ap.add_argument("--write", action="store_true",
                    help="rewrite the tables and figures in the pages (default: print them)")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 when a page's tables or figures differ from the JSON's (nothing is written)")
    args = ap.parse_args(argv)
    payloads = load(args.dir)
    if not (args.write or args.check):
        for name, table in tables_of(payloads).items():
            print(f"{name}:\n{table}\n")
        for page in pages(args.root):
            with open(page) as f:
                for m in FIGURE.finditer(f.read()):
                    print(f"{page}: {m.group(2)} -> {render_figure(m.group(2), payloads)}")
        return
    stale, texts = [], {}
    for page in pages(args.root):
        with open(page) as f:
            text = texts[page] = f.read()
        new = render_page(text, payloads)
        if new == text:
            continue
        stale.append(page)
        if args.write:
            with open(page, "w") as f:
                f.write(new)
            print(f"wrote the tables and figures of {page}")
    if args.check and stale:
        sys.exit(f"tables or figures differ from {args.dir}: {', '.join(stale)} (run with --write)")
    typed_in = unrendered(texts)
    if args.check and typed_in:
        sys.exit("tables no benchmark renders (state their columns in the benchmark's TABLES):\n  "
                 + "\n  ".join(typed_in))
    made_by_hand = unwritten(payloads)
    if args.check and made_by_hand:
        sys.exit("rows with fields no benchmark writes (rerun the benchmark that makes them):\n  "
                 + "\n  ".join(made_by_hand))
