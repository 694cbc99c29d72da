"""Progress on long work (compile, weight loading and packing, generation): tqdm bars on stderr,
shown only when stderr is a terminal and not quieted (`ktflow --quiet`, KTFLOW_QUIET=1, or
`progress.QUIET = True` from Python). Each bar names the phase, counts its items and shows the
elapsed time; it clears itself when done."""

from __future__ import annotations

import sys
from typing import Iterable, TypeVar

from . import env

T = TypeVar("T")

QUIET = False


def shown() -> bool:
    return not QUIET and not env.get("KTFLOW_QUIET") and sys.stderr.isatty()


def bar(items: Iterable[T], desc: str, unit: str, total: int | None = None, show: bool = True):
    """`items`, iterated with a bar named `desc` (counting `unit`s) where progress is shown and
    `show` holds (a phase too short to be worth a bar passes False)."""
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit=unit, total=total, disable=not (show and shown()), leave=False,
                file=sys.stderr, dynamic_ncols=True)
