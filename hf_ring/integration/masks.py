"""What a model's mask function asks of its attention, read into what the ring computes, or refused.

transformers builds a decoder's mask from a *mask function* of ``(batch, head,
q_idx, kv_idx)``, composed in ``masking_utils`` from a few pieces: causality
(or none), a sliding window, chunks (Llama 4), bidirectional blocks (Gemma 3's
images, PaliGemma's and GIT's prefix), packed documents, and whatever a model
adds as its own ``or_mask_function`` / ``and_mask_function``. The
``ring_dilated`` mask hook receives that function, and this module reads it
back into the ring's terms: causal or not, the window, chunk starts,
documents and spans (:mod:`hf_ring.engine.spans`).

A piece is recognised by the code of the closures transformers' own factories
make, and each factory is checked once per process against what its piece is
taken to mean, so a release that changes one is not read blindly. The
composition is then compared, as a boolean function of its pieces, with what
the ring computes from the same pieces, on every combination of pieces the
call's rows can produce: any composition transformers or a model writes is
either reproduced exactly or refused, whatever its shape. A piece it does not
know is kept only where it is constant on the call's positions (then it is
that constant), or where the whole function equals what the ring computes
without it, pair by pair on those positions; otherwise the call is refused,
naming the piece.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from transformers import masking_utils

from ..engine.documents import chunk_ids
from ..engine.spans import spans_of_ids

Tensor = torch.Tensor

PROBE_PAIRS = 1 << 26
"""Most (query, key) pairs a mask function with a piece hf_ring does not know is evaluated on (in row tiles) to
compare it with what the ring computes; a longer call with such a piece is refused."""
PROBE_ROWS = 256
"""Query rows per tile of that evaluation."""


@dataclass(frozen=True)
class Piece:
    """One leaf of a mask function: ``kind`` is ``causal`` (k <= q), ``window`` (k > q - value), ``chunk``
    (one chunk of ``value`` rows counted from ``data``, the rows where each batch row's chunks start), ``blocks``
    (one bidirectional block of ``data``, ids per row, -1 none), ``documents`` (one packed document of ``data``),
    ``true``, ``false``, ``mirror`` (|q - k| <= value, a bidirectional window) or ``unknown`` (``data`` is the
    function)."""

    kind: str
    value: Any = None
    data: Any = field(default=None, compare=False)
    positions: Optional[Tensor] = field(default=None, compare=False)
    """Under transformers' remap of packed rows: the ``(B, n)`` position ids the piece is evaluated at."""

    @property
    def in_documents(self) -> bool:
        return self.positions is not None

    @property
    def key(self) -> Tuple:
        return (self.kind, self.value, id(self.data), id(self.positions))


@dataclass(frozen=True)
class Node:
    op: str  # "and", "or"
    children: Tuple[Any, ...]


def _cells(fn: Callable) -> Dict[str, Any]:
    """The closure variables of ``fn`` by name."""
    cells = fn.__closure__ or ()
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in cells)))


def _factory_codes() -> Dict[Any, str]:
    """The code of each closure transformers' mask factories make, by what hf_ring reads it as (those the
    installed release has)."""
    mu, one, ids = masking_utils, (lambda *a: True), torch.zeros(1, 1, dtype=torch.long)
    made = {
        "and": lambda: mu.and_masks(one), "or": lambda: mu.or_masks(one),
        "window": lambda: mu.sliding_window_overlay(1), "chunk": lambda: mu.chunked_overlay(1, ids[0]),
        "blocks": lambda: getattr(mu, "blockwise_overlay")(ids),
        "documents": lambda: mu.packed_sequence_mask_function(ids),
        "remap": lambda: getattr(mu, "remap_positions_for_packed_sequence")(one, ids),
        "offsets": lambda: mu.add_offsets_to_mask_function(one, 0, 0),
        "mirror": lambda: mu.sliding_window_bidirectional_overlay(1),
        "padding": lambda: mu.padding_mask_function(ids.bool()),
    }
    codes: Dict[Any, str] = {mu.causal_mask_function.__code__: "causal",
                             mu.bidirectional_mask_function.__code__: "true"}
    for kind, make in made.items():
        try:
            codes[make().__code__] = kind
        except AttributeError:  # a factory this release does not have
            continue
    return codes


def grid(fn: Callable, batch: int, q_rows: Sequence[int], k_rows: int) -> Tensor:
    """``(batch, len(q_rows), k_rows)`` bool: ``fn`` on every pair, evaluated as transformers' index-based mask
    creation does (broadcast indices, head 0)."""
    b = torch.arange(batch).view(-1, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    q = torch.as_tensor(list(q_rows), dtype=torch.long).view(1, 1, -1, 1)
    k = torch.arange(k_rows).view(1, 1, 1, -1)
    out = torch.as_tensor(fn(b, h, q, k))
    return torch.broadcast_to(out.to("cpu", torch.bool), (batch, 1, len(q_rows), k_rows))[:, 0]


def _meaning(kind: str, value: Any, data: Any, q: Tensor, k: Tensor, b: Tensor) -> Tensor:
    """What hf_ring takes piece ``kind`` to mean at broadcast indices ``b, q, k``."""
    if kind == "causal":
        return k <= q
    if kind == "window":
        return k > q - value
    if kind == "mirror":
        return (q - k).abs() <= value
    if kind == "chunk":
        start = data[b]
        return torch.div(k - start, value, rounding_mode="floor") == torch.div(q - start, value, rounding_mode="floor")
    if kind in ("blocks", "documents"):
        same = data[b, q] == data[b, k]
        return same & (data[b, q] >= 0) if kind == "blocks" else same
    raise ValueError(kind)


@lru_cache(maxsize=1)
def known_codes() -> Dict[Any, str]:
    """:func:`_factory_codes`, less every factory whose closures do not mean what hf_ring reads them as on a small
    grid (a release that changed one): its pieces are then read as unknown."""
    codes = dict(_factory_codes())
    mu = masking_utils
    ids = torch.tensor([[0, 0, -1, 1, 1, 1, -1, 2], [-1, 3, 3, 3, 3, -1, -1, -1]])
    start = torch.tensor([0, 3])
    samples = {"window": (mu.sliding_window_overlay, (3,), 3, None),
               "chunk": (mu.chunked_overlay, (3, start), 3, start),
               "blocks": (getattr(mu, "blockwise_overlay", None), (ids,), None, ids),
               "documents": (mu.packed_sequence_mask_function, (ids,), None, ids),
               "mirror": (mu.sliding_window_bidirectional_overlay, (2,), 2, None)}
    b, q, k = torch.arange(2).view(-1, 1, 1), torch.arange(8).view(1, -1, 1), torch.arange(8).view(1, 1, -1)
    for kind, (factory, args, value, data) in samples.items():
        if factory is None:
            continue
        fn = factory(*args)
        meant = torch.broadcast_to(_meaning(kind, value, data, q, k, b), (2, 8, 8))
        if not torch.equal(grid(fn, 2, range(8), 8), meant):
            codes.pop(fn.__code__, None)
    causal = grid(mu.causal_mask_function, 1, range(8), 8)
    if not torch.equal(causal, torch.ones(8, 8, dtype=torch.bool).tril()[None]):
        codes.pop(mu.causal_mask_function.__code__, None)
    return codes


def parse(fn: Callable, positions: Optional[Tensor] = None) -> Any:
    """``fn`` as a tree of :class:`Node` over :class:`Piece` leaves (``positions``: inside transformers' remap of
    packed rows, the position ids its pieces are evaluated at)."""
    kind = known_codes().get(getattr(fn, "__code__", None))
    cells = _cells(fn) if kind is not None else {}
    if kind in ("and", "or"):
        return Node(kind, tuple(parse(f, positions) for f in cells["mask_functions"]))
    if kind == "remap":
        return parse(cells["mask_function"], cells["position_ids"])
    if kind in ("causal", "true"):
        return Piece(kind)
    if kind in ("window", "mirror"):
        return Piece(kind, int(cells["sliding_window"]), fn if kind == "mirror" else None, positions)
    if kind == "chunk":
        return Piece("chunk", int(cells["chunk_size"]), cells["left_padding"], positions)
    if kind == "blocks":
        return Piece("blocks", None, cells["block_sequence_ids"], positions)
    if kind == "documents":
        return Piece("documents", None, cells["packed_sequence_mask"])
    return Piece("unknown", getattr(fn, "__qualname__", type(fn).__name__), fn)


def pieces(tree: Any) -> List[Piece]:
    """The distinct leaves of ``tree``, in order."""
    found: Dict[Tuple, Piece] = {}

    def walk(node):
        if isinstance(node, Node):
            for child in node.children:
                walk(child)
        else:
            found.setdefault(node.key, node)

    walk(tree)
    return list(found.values())


def evaluate(tree: Any, values: Dict[Tuple, bool]) -> bool:
    """``tree`` under a truth value for each piece (``true``/``false`` are constants)."""
    if isinstance(tree, Node):
        results = [evaluate(child, values) for child in tree.children]
        return all(results) if tree.op == "and" else any(results)
    if tree.kind == "true":
        return True
    if tree.kind == "false":
        return False
    return values[tree.key]


@dataclass(frozen=True)
class MaskRead:
    """What a mask function asks for, in the ring's terms; ``refusal`` says why it cannot be computed (else None).

    ``chunk``: chunked attention of that many rows (Llama 4), chunks counted
    from ``chunk_start`` ``(B,)`` (each batch row's left padding), or, when
    ``chunk_positions`` ``(B, n)`` is given (transformers' remap of packed
    rows), where those position ids are multiples of ``chunk``; ``blocks``:
    ``(B, n)`` ids of bidirectional blocks, -1 outside; ``documents``:
    ``(B, n)`` packed-document ids. The tensors are the call's own (a shard's
    rows on a rank of a sequence split, where only the settings are read).
    """

    causal: bool = True
    window: Optional[int] = None
    chunk: Optional[int] = None
    chunk_start: Optional[Tensor] = field(default=None, compare=False)
    chunk_positions: Optional[Tensor] = field(default=None, compare=False)
    blocks: Optional[Tensor] = field(default=None, compare=False)
    documents: Optional[Tensor] = field(default=None, compare=False)
    refusal: Optional[str] = None


def _ring_rule(causal: bool, atoms: Dict[str, Optional[Piece]], values: Callable[[str, Any], Any]) -> Any:
    """What the ring computes from its pieces: documents and chunks bound every pair; inside them causality with
    the window, or one bidirectional block. ``values(kind, default)`` gives a piece's truth (a bool, or a tensor
    of them on a grid)."""
    inside = values("documents", True) & values("chunk", True)
    if not causal:
        return inside
    return inside & ((values("causal", True) & values("window", True)) | values("blocks", False))


def _constant(fn: Callable, batch: int, rows: int, cols: int) -> Optional[bool]:
    """The value ``fn`` takes on every pair of a ``rows x cols`` call, or None when it varies (or cannot be
    evaluated by index, or the call is too long to look at every pair)."""
    if rows * cols * batch > PROBE_PAIRS:
        return None
    seen = set()
    try:
        for first in range(0, rows, PROBE_ROWS):
            tile = grid(fn, batch, range(first, min(rows, first + PROBE_ROWS)), cols)
            seen.update({bool(tile.all()), bool(tile.any())})
            if len(seen) > 1:
                return None
    except Exception:  # noqa: BLE001 -- a function that cannot be evaluated by index is one hf_ring cannot read
        return None
    return seen.pop() if seen else None


def _substitute(tree: Any, key: Tuple, value: bool) -> Any:
    if isinstance(tree, Node):
        return Node(tree.op, tuple(_substitute(child, key, value) for child in tree.children))
    return Piece("true" if value else "false") if tree.key == key else tree


def _matches_on_grid(fn: Callable, causal: bool, atoms: Dict[str, Optional[Piece]], batch: int, n: int) -> bool:
    """Whether ``fn`` equals the ring's rule over ``atoms`` on every pair of a whole ``n``-row call."""
    if n * n * batch > PROBE_PAIRS or any(p is not None and p.in_documents for p in atoms.values()):
        return False
    b = torch.arange(batch).view(-1, 1, 1)
    k = torch.arange(n).view(1, 1, -1)
    for first in range(0, n, PROBE_ROWS):
        rows = range(first, min(n, first + PROBE_ROWS))
        q = torch.as_tensor(list(rows)).view(1, -1, 1)

        def values(kind, default):
            p = atoms.get(kind)
            return torch.tensor(default) if p is None else _meaning(kind, p.value, p.data, q, k, b)

        try:
            if not torch.equal(grid(fn, batch, rows, n), torch.broadcast_to(_ring_rule(causal, atoms, values),
                                                                             (batch, len(rows), n))):
                return False
        except Exception:  # noqa: BLE001 -- see _constant
            return False
    return True


def _block_facts(blocks: Optional[Piece], window: Optional[Piece], bounds: List[Optional[Tensor]],
                 n: int) -> Tuple[bool, bool, Optional[str]]:
    """Whether the call's blocks fit the window, whether one crosses a chunk or document border (``bounds``:
    ``(B, n)`` chunk and document ids), and why they cannot be read (else None)."""
    if blocks is None:
        return True, False, None
    try:
        spans = spans_of_ids(blocks.data)
    except ValueError as err:
        return True, False, str(err)
    fit = window is None or all(stop - start <= window.value for row in spans for start, stop in row)
    cross = False
    for ids in bounds:
        if ids is not None:
            cross |= any(bool((ids[b, start:stop] != ids[b, start]).any())
                         for b, row in enumerate(spans) for start, stop in row)
    return fit, cross, None


def read(fn: Callable, batch: int, n: int, sharded: bool = False) -> MaskRead:
    """Read mask function ``fn`` of a whole ``n``-row call (``sharded``: one rank's rows of a split sequence,
    whose data pieces hold only its rows and are not read) into the ring's terms."""
    tree = parse(fn)
    for p in pieces(tree):
        if p.kind in ("unknown", "mirror"):  # a piece constant on the call is that constant
            value = _constant(p.data, batch, n, n)
            if value is not None:
                tree = _substitute(tree, p.key, value)
        elif p.kind == "blocks" and not bool((p.data >= 0).any()):
            tree = _substitute(tree, p.key, False)
    found = pieces(tree)
    by_kind: Dict[str, List[Piece]] = {}
    for p in found:
        by_kind.setdefault(p.kind, []).append(p)
    for kind in ("window", "chunk", "blocks", "documents"):
        if len(by_kind.get(kind, ())) > 1:
            return MaskRead(refusal=f"its mask function combines {len(by_kind[kind])} different {kind} pieces")
    atoms = {kind: by_kind[kind][0] if by_kind.get(kind) else None
             for kind in ("causal", "window", "chunk", "blocks", "documents")}
    # The ring's causality is a piece of its rule whether or not the function reads it.
    atoms["causal"] = atoms["causal"] or Piece("causal")
    blocks = atoms["blocks"]
    if blocks is not None and (sharded or blocks.in_documents):
        why = ("bidirectional blocks (e.g. from token_type_ids) on one rank's rows of a split sequence" if sharded
               else "bidirectional blocks looked up at positions inside packed documents")
        return MaskRead(refusal=f"its mask function holds {why}")
    chunk = atoms["chunk"]
    bounds = [None if chunk is None else chunk_ids(chunk.value, chunk.data, chunk.positions, n),
              None if atoms["documents"] is None else atoms["documents"].data]
    fit, cross, why = _block_facts(blocks, atoms["window"], bounds, n)
    if why is not None:
        return MaskRead(refusal=why)

    def impossible(v: Dict[str, bool]) -> bool:
        if v.get("causal") is False and v.get("window") is False:
            return True  # a later key is inside every window
        if v.get("blocks") and ((v.get("window") is False and fit) or (
                (v.get("chunk") is False or v.get("documents") is False) and not cross)):
            return True
        return False

    variables = [p for p in found if p.kind not in ("true", "false", "causal")] + [atoms["causal"]]
    table = []
    for bits in itertools.product((False, True), repeat=len(variables)):
        if not impossible({p.kind: bit for p, bit in zip(variables, bits)}):
            table.append({p.key: bit for p, bit in zip(variables, bits)})
    unknown = [p for p in found if p.kind in ("unknown", "mirror")]
    for causal in (True, False):
        if not causal and (atoms["window"] is not None or blocks is not None):
            continue  # the ring has no window or blocks without causality
        same = all(evaluate(tree, values) == _ring_rule(
            causal, atoms, lambda kind, default: default if atoms[kind] is None else values[atoms[kind].key])
            for values in table)
        if same or (unknown and not sharded and _matches_on_grid(fn, causal, atoms, batch, n)):
            return MaskRead(causal, None if atoms["window"] is None else atoms["window"].value,
                            None if chunk is None else chunk.value, None if chunk is None else chunk.data,
                            None if chunk is None else chunk.positions, None if blocks is None else blocks.data,
                            None if atoms["documents"] is None else atoms["documents"].data)
    if unknown:
        names = ", ".join(sorted({p.value if p.kind == "unknown" else f"a bidirectional window of {p.value}"
                                  for p in unknown}))
        return MaskRead(refusal=f"its mask function holds pieces ring_dilated does not compute ({names})")
    if blocks is not None and not fit:
        return MaskRead(refusal=f"a bidirectional block is longer than the sliding window ({atoms['window'].value}), "
                                "which its mask function applies to the block's pairs too")
    return MaskRead(refusal="its mask function composes its pieces in a way ring_dilated does not compute "
                            f"({', '.join(sorted(by_kind))})")



def remaps_packed_rows() -> bool:
    """Whether the installed transformers evaluates a packed row's mask at positions inside each document (its
    chunks then restart with every document)."""
    return "remap" in known_codes().values()


class MaskUseError(AttributeError, TypeError):
    """A model used the mask ``ring_dilated`` handed it as a tensor, in code of its own (an attribute error for
    ``hasattr``, a type error for arithmetic)."""


def _refuse_use(what: str):
    def refuse(self, *args: Any) -> Any:
        raise MaskUseError(
            f"this model uses its attention mask as a tensor ({what}) in code of its own, beside the attention "
            "function ring_dilated replaces; ring_dilated applies the mask inside that function, so it cannot run "
            "this model: use attn_implementation='sdpa' (or 'eager')")

    return refuse


@dataclass(frozen=True)
class RingMask:
    """What ``ring_dilated``'s mask hook hands the attention of a whole-sequence forward: the ``(B, keys)`` key
    padding of the rows the attention sees (None: none) and the model's mask function, read on first use.

    ``size`` is ``(batch, rows)`` of the call the function was made for: the
    rows its data pieces (token types, document ids) describe. A multimodal
    forward makes its masks over the whole sequence and splits them where its
    decoder starts (:meth:`rows`): the padding becomes the shard's, the function
    still describes every row, so its blocks are read on each rank whole.

    It is no tensor: a model whose own code adds the mask to scores or reads it
    as one gets a :class:`MaskUseError` saying so, instead of a mask that says
    less than the model's. To transformers' own mask creation, handed it again
    (a multimodal model passes its mask on to its language model, ``generate``
    builds a static cache's masks before the model does), it is what a
    prepared 4-D mask is: kept as it is (``ndim``, ``shape``).
    """

    padding: Optional[Tensor]
    function: Callable
    size: Tuple[int, int] = (0, 0)
    held: Optional[int] = None  # rows of a split sequence the attention sees (None: all of ``size``)
    _reads: Dict[bool, MaskRead] = field(default_factory=dict, compare=False, repr=False)

    def read(self, partial: bool = False) -> MaskRead:
        """The function read into the ring's terms (once per mask); ``partial``: the rows it describes are one
        rank's of a split sequence, so its data pieces are not read."""
        if partial not in self._reads:
            self._reads[partial] = read(self.function, self.size[0], self.size[1], sharded=partial)
        return self._reads[partial]

    def rows(self, positions: Tensor) -> "RingMask":
        """This mask for the rows at ``positions`` of a split sequence: their padding, the same function."""
        padding = None if self.padding is None else self.padding[:, positions]
        return RingMask(padding, self.function, self.size, len(positions), self._reads)

    @property
    def rows_seen(self) -> Tuple[int, int]:
        """``(batch, rows)`` of the calls this mask is for: the whole sequence's, or one rank's after a split."""
        return (self.size[0], self.size[1] if self.held is None else self.held)

    ndim = 4

    @property
    def shape(self) -> Tuple[int, int, int, int]:
        b, rows = self.rows_seen
        return (b, 1, rows, rows)

    def contiguous(self, *args: Any, **kwargs: Any) -> "RingMask":
        """Itself: a memory-layout request reads nothing of the mask (transformers 5.18 to 5.21's ``generate``
        makes every mask of a static cache contiguous before the model sees it)."""
        return self

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _refuse_use(f".{name}")(self)

    for _op in ("add", "radd", "sub", "rsub", "mul", "rmul", "and", "rand", "or", "ror", "getitem", "invert"):
        locals()[f"__{_op}__"] = _refuse_use(f"'{_op}'")
    del _op
