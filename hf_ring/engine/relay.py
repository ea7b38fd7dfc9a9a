"""One rank's failed check fails every rank of its group: once, readably, with the ranks named.

Under sequence parallelism no rank may raise alone while the others wait for
it in a collective. A block of local checks therefore keeps its error
(:func:`caught`), and the exchange every rank makes next carries each rank's
outcome as a fixed-size row of integers (:func:`error_row`): the agreement
before the ring, or one small all-gather of its own (:func:`raise_together`).
Every rank then raises, with one traceback and no exception chaining:

* a rank that failed raises its own error, its message prefixed with the
  ranks that failed the same way (``"rank 1: ..."``, ``"ranks 0 and 1: ..."``);
* a rank that did not fail raises the first failing rank's error type and
  message with the same prefix.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence

from .comm import RingComm, ints_text, text_ints

MESSAGE_BYTES = 480
"""Bytes of an error's type name and message a row carries (longer messages are cut there)."""

_KINDS = {"TypeError": TypeError, "ValueError": ValueError, "NotImplementedError": NotImplementedError}


def error_row(error: Optional[BaseException]) -> List[int]:
    """A local check's outcome as integers of one fixed size: failed or not, then its type and message."""
    return [int(error is not None)] + text_ints("" if error is None else f"{type(error).__name__}\0{error}",
                                                MESSAGE_BYTES)


def decode_row(row: Sequence[int]) -> Optional[tuple]:
    """``(type name, message)`` of a row that says its rank failed, else None."""
    if not row[0]:
        return None
    kind, _, message = ints_text(row[1:]).partition("\0")
    return kind, message


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 1``, ``ranks 0 and 1``, ``ranks 0, 2 and 3``."""
    ranks = list(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def raise_first(rows: Sequence[Sequence[int]], rank: int, mine: Optional[BaseException] = None) -> None:
    """Raise the error the rows (by group rank, see :func:`error_row`) report, if any; ``rank`` is this rank.

    ``mine`` is this rank's own error (its row says so): it is raised with its
    own traceback. Nothing is chained to the exception raised here, so each
    rank prints one traceback.
    """
    found = {r: got for r, got in enumerate(map(decode_row, rows)) if got is not None}
    if not found:
        return
    shown = rank if rank in found else min(found)
    same = [r for r, got in found.items() if got == found[shown]]
    others = [r for r in found if r not in same]
    message = f"{ranks_text(same)}: {found[shown][1]}"
    if others:
        message += f" ({ranks_text(others)} failed with another error: {found[others[0]][1]})"
    if mine is not None and rank in found:
        raise _retyped(mine, message).with_traceback(mine.__traceback__) from None
    raise _KINDS.get(found[shown][0], ValueError)(message) from None


def _retyped(error: BaseException, message: str) -> BaseException:
    """``error``'s type with ``message`` (ValueError where that type cannot be built from one message)."""
    try:
        return type(error)(message)
    except Exception:  # noqa: BLE001 - an exception type with a constructor of its own
        return ValueError(message)


@dataclass
class Caught:
    """What a block of local checks raised (see :func:`caught`)."""

    error: Optional[Exception] = None


@contextmanager
def caught() -> Iterator[Caught]:
    """Keep the TypeError or ValueError a block of local checks raises instead of raising it now.

    The error is handed to the exchange every rank makes next
    (:func:`fail_together`, or the ring's agreement), which raises it on all of them.
    """
    found = Caught()
    try:
        yield found
    except (TypeError, ValueError) as err:
        found.error = err


@contextmanager
def fail_together(comm: Optional[RingComm], what: str) -> Iterator[None]:
    """Run a block of local checks; an error it raises on one rank is raised on every rank of ``comm``.

    The ranks exchange the block's outcome once after it (:func:`raise_together`), whether it passed or not.
    """
    with caught() as found:
        yield
    raise_together(comm, found.error, what)


def raise_together(comm: Optional[RingComm], error: Optional[Exception], what: str) -> None:
    """Make one rank's failed local check fail every rank, with the same exception (one small all-gather).

    The ring's own agreement carries the same row, so a direct call needs no
    exchange of its own.
    """
    if comm is None or comm.world_size == 1:
        if error is not None:
            raise error.with_traceback(error.__traceback__) from None
        return
    raise_first(comm.all_gather_ints(error_row(error), what), comm.rank, error)
