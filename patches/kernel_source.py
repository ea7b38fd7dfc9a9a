"""What a modeling module's source says of its kernels: the kernel each module-level name was defined as, and the
global names each module function and each class method reads.

A kernel is known by the name a layer calls, not by what that name holds now.
Users and patch libraries assign into modeling modules
(``modeling_qwen3_5.torch_chunk_gated_delta_rule = my_kernel``), and the
``kernels`` package turns a decorated function into a layer object; neither
changes what the modeling file wrote. So the kinds come from the source, read
once per module: a function decorated with
``use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", ...)`` is
that kernel whatever its name holds later, and so is a name imported from a
kernel package (``from fla.ops.gated_delta_rule import chunk_gated_delta_rule``).
Which classes reach a kernel is read the same way, through the module functions
between them (transformers 5.25's ``causal_conv1d_forward`` and
``mamba_scan_forward`` call the kernels for the mixers).

Pure functions of the source text (:func:`read`); :func:`of_module` reads a
module's, or None where it has none (a module built at run time).
"""
from __future__ import annotations

import ast
import functools
import inspect
from dataclasses import dataclass
from types import ModuleType
from typing import Dict, FrozenSet, Iterable, Iterator, Optional, Tuple

KERNEL_DECORATORS = ("use_kernel_func_from_hub_with_fallback",)
"""Decorators whose first argument names the kernel a function is (the name transformers resolves it under)."""

KERNEL_PACKAGES = ("fla", "mamba_ssm", "causal_conv1d")
"""Packages whose functions, imported into a modeling module, are the kernel of their own name."""


@dataclass(frozen=True)
class Source:
    """One modeling module's source, as far as its kernels go."""

    declared: Dict[str, str]  # module-level name -> the kernel it was defined as
    functions: Dict[str, FrozenSet[str]]  # module-level function -> the global names its body reads
    methods: Dict[Tuple[str, str], FrozenSet[str]]  # (class, method) -> the global names its body reads
    parameters: Dict[object, Tuple[str, ...]]  # a function's name or (class, method) -> its named parameters

    def reached(self, names: Iterable[str]) -> FrozenSet[str]:
        """``names`` and every global name the module functions among them read, and theirs, transitively."""
        seen, todo = set(), list(names)
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            todo.extend(self.functions.get(name, ()))
        return frozenset(seen)

    def kernels_reached(self, cls: str, method: str = "forward") -> FrozenSet[str]:
        """The declared kernel names ``cls.method`` calls, directly or through module functions."""
        return frozenset(n for n in self.reached(self.methods.get((cls, method), ())) if n in self.declared)


def read(text: str) -> Source:
    """The :class:`Source` of a module's source ``text``."""
    declared: Dict[str, str] = {}
    functions: Dict[str, FrozenSet[str]] = {}
    methods: Dict[Tuple[str, str], FrozenSet[str]] = {}
    parameters: Dict[object, Tuple[str, ...]] = {}
    for node in _top_level(ast.parse(text).body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions[node.name] = _globals_read(node)
            parameters[node.name] = _named_parameters(node)
            kernel = _declared_kernel(node)
            if kernel is not None:
                declared[node.name] = kernel
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    methods[(node.name, item.name)] = _globals_read(item)
                    parameters[(node.name, item.name)] = _named_parameters(item)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in KERNEL_PACKAGES:
            declared.update({alias.asname or alias.name: alias.name for alias in node.names})
    return Source(declared, functions, methods, parameters)


@functools.lru_cache(maxsize=None)
def _of_module_named(name: str, text: str) -> Source:
    return read(text)


def of_module(module: ModuleType) -> Optional[Source]:
    """The :class:`Source` of ``module``'s file (read once), or None where it has no source to read."""
    try:
        text = inspect.getsource(module)
    except (OSError, TypeError):
        return None
    return _of_module_named(module.__name__, text)


def _top_level(body: Iterable[ast.stmt]) -> Iterator[ast.stmt]:
    """A module's statements, those inside its top-level ``if`` and ``try`` blocks included (guarded imports)."""
    for node in body:
        if isinstance(node, ast.If):
            yield from _top_level(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_level(node.body + node.orelse + node.finalbody +
                                  [s for handler in node.handlers for s in handler.body])
        else:
            yield node


def _declared_kernel(node: ast.AST) -> Optional[str]:
    for decorator in getattr(node, "decorator_list", ()):
        if isinstance(decorator, ast.Call) and _called_name(decorator.func) in KERNEL_DECORATORS and \
                decorator.args and isinstance(decorator.args[0], ast.Constant) and \
                isinstance(decorator.args[0].value, str):
            return decorator.args[0].value
    return None


def _called_name(func: ast.AST) -> Optional[str]:
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else None


def _named_parameters(fn: ast.AST) -> Tuple[str, ...]:
    """A function's parameters that have names (``*args`` and ``**kwargs`` aside), in order."""
    arguments = fn.args  # type: ignore[attr-defined]
    return tuple(a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs)


def _globals_read(fn: ast.AST) -> FrozenSet[str]:
    """The names a function's body reads that it neither takes nor assigns: the globals it reads."""
    loaded, local = set(), set()
    arguments = fn.args  # type: ignore[attr-defined]
    for arg in arguments.posonlyargs + arguments.args + arguments.kwonlyargs + \
            [a for a in (arguments.vararg, arguments.kwarg) if a is not None]:
        local.add(arg.arg)
    for node in ast.walk(fn):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else local).add(node.id)
    return frozenset(loaded - local)
