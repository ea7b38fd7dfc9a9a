"""A benchmark's JSON file that runs made at different times add their rows to, with nothing merged by hand.

Each row is stamped with its settings (what it was run with: the options it
depends on and its own length, seed or ranks), the command and the commit
that made it. It takes the place of the row with the same settings, or joins
after the others, as soon as it is measured, so a sweep cut short keeps every
row it finished. What a writer derives from all the rows (a fit, an order)
is made again from them on every write. Each run's options (its defaults
included, which its command line does not show) join the file's ``runs``
with its command and commit, for as long as a row it wrote is in the file.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from .common import save

RECORDED = ("settings", "command", "commit")
"""What :class:`RowFile` adds to every row; a writer's ``WRITES`` lists them with its own fields."""


Keys = Dict[str, Tuple[Tuple[str, ...], Tuple[str, ...]]]
"""Per list of rows, what makes a row's settings: the run's options it depends on, then its own fields that tell
the rows of one run apart (its length, seed, ranks)."""


def settings(options: Dict, row: Dict, option_keys: Iterable[str], own_keys: Iterable[str]) -> Dict:
    """What ``row`` was run with: the ``option_keys`` of the run's ``options``, then its own ``own_keys``: the key a
    later run's row of the same settings replaces it by."""
    return {**{k: options[k] for k in option_keys}, **{k: row[k] for k in own_keys}}


def add_replace_unrecorded(ap: argparse.ArgumentParser, scope: str = "") -> None:
    """The ``--replace-unrecorded`` option of a command whose files are :class:`RowFile` s (``scope``: when it
    applies, e.g. "with --peers: ")."""
    ap.add_argument("--replace-unrecorded", action="store_true",
                    help=f"{scope}drop, from each list of rows this command writes to, the rows that carry no settings "
                         "(gathered by hand, or written before rows recorded them), once its first row there is "
                         "written: the list is then wholly what the benchmark made")


def runs_kept(runs: List[Dict], rows: Iterable[Dict]) -> List[Dict]:
    """The entries of ``runs`` that a row still comes from: a stamped entry while a row has its command and commit;
    the entries from before entries were stamped (options alone, which row they made unknown) while a row is left
    whose run has no stamped entry."""
    made = {(r.get("command"), r.get("commit")) for r in rows}
    stamped = {(run["command"], run["commit"]) for run in runs if "command" in run}
    orphans = bool(made - stamped)
    return [run for run in runs if ((run["command"], run["commit"]) in made if "command" in run else orphans)]


def merge(old: List[Dict], new: List[Dict]) -> List[Dict]:
    """``old`` with each row of ``new`` in the place of the row of the same settings, or after them all; rows
    written before rows recorded their settings are kept as they are."""
    out = list(old)
    for row in new:
        same = [i for i, r in enumerate(out) if r.get("settings") == row["settings"]]
        if same:
            out[same[0]] = row
        else:
            out.append(row)
    return out


class RowFile:
    """``out/name.json``, whose row lists are the keys of ``writes`` and which also holds ``beside`` keys.

    ``keys`` says what makes the settings of each list's rows (see
    :data:`Keys`). ``derive(payload)`` returns the keys made from the rows
    (written again on every row); ``plot(payload)`` returns the file's
    figure, if any. With
    ``replace_unrecorded``, the rows of a list that carry no settings (gathered
    by hand, or written before rows recorded them) are dropped when this run
    writes its first row to that list: only then, so a run that fails drops
    nothing.
    """

    def __init__(self, out: str, name: str, writes: Dict[str, Tuple[str, ...]], options: Dict, command: str,
                 made: str, *, keys: Keys, beside: Iterable[str] = (), replace_unrecorded: bool = False,
                 derive: Optional[Callable[[Dict], Dict]] = None,
                 plot: Optional[Callable[[Dict], Optional[Callable[[str], None]]]] = None):
        if set(keys) != set(writes):
            raise ValueError(f"{name}.json: keys name the lists {sorted(keys)}, its rows are {sorted(writes)}")
        self.out, self.name, self.lists, self.options, self.keys = out, name, tuple(writes), options, keys
        self.command, self.made, self.beside = command, made, tuple(beside)
        self.derive, self.plot = derive, plot
        self.unrecorded_left = set(self.lists) if replace_unrecorded else set()

    def keep(self, key: str, row: Dict, beside: Optional[Dict] = None) -> None:
        """Stamp ``row`` of list ``key`` with its settings, the command and the commit, and write it to the file;
        ``beside`` keys are written too (a dict merges into the file's dict of that key, anything else replaces
        it)."""
        if key not in self.lists:
            raise ValueError(f"{self.name}.json has no list of rows {key!r}; its lists are {list(self.lists)}")
        row.update(settings=settings(self.options, row, *self.keys[key]), command=self.command, commit=self.made)
        path = os.path.join(self.out, f"{self.name}.json")
        os.makedirs(self.out, exist_ok=True)
        folder = os.open(self.out, os.O_RDONLY)
        try:  # two runs writing to one folder at once each keep their rows
            fcntl.flock(folder, fcntl.LOCK_EX)
            payload: Dict = {"runs": [], **{k: [] for k in self.lists}}
            if os.path.exists(path):  # only what this writer makes: a key added by hand does not outlive a run
                with open(path) as f:
                    payload.update((k, v) for k, v in json.load(f).items() if k in payload or k in self.beside)
            if key in self.unrecorded_left:
                payload[key] = [r for r in payload[key] if "settings" in r]
                self.unrecorded_left.discard(key)
            payload[key] = merge(payload[key], [row])
            for k, v in (beside or {}).items():
                payload[k] = {**payload.get(k, {}), **v} if isinstance(v, dict) else v
            this = {"command": self.command, "commit": self.made, "options": self.options}
            others = [r for r in payload["runs"] if (r.get("command"), r.get("commit")) != (self.command, self.made)]
            rows = [r for k in self.lists for r in payload[k]]
            payload["runs"] = runs_kept(others + [this], rows)
            if self.derive is not None:
                payload.update(self.derive(payload))
            save(self.out, self.name, payload, self.plot(payload) if self.plot else None, command=self.command)
        finally:
            os.close(folder)  # and with it the lock
