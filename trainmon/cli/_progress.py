"""A one-line progress display for long commands: on a terminal only, never with ``--json``.

Written to stderr and redrawn in place (``\\r``) at most every 0.2 s, so piping a command's
output or reading its JSON never sees it.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """``update(files=..., rows=...)`` while reading files, ``phase(...)`` and ``advance()`` for a
    later step counted in other units (buckets, groups), ``done()`` at the end (clears the line)."""

    def __init__(
        self, label: str, total_files: int, *, quiet: bool = False, out: TextIO | None = None, interval_s: float = 0.2
    ):
        self.out = out or sys.stderr
        self.enabled = not quiet and bool(getattr(self.out, "isatty", lambda: False)())
        self.label, self.total = label, total_files
        self.files = self.rows = 0
        self.unit = "files"  # what ``files`` counts: the files read, or a later phase's units
        self._interval, self._last, self._width = interval_s, 0.0, 0

    def update(self, files: int = 0, rows: int = 0) -> None:
        self.files += files
        self.rows += rows
        now = time.monotonic()
        if self.enabled and (now - self._last >= self._interval or self.files == self.total):
            self._last = now
            self._draw()

    def phase(self, label: str, total: int, unit: str) -> None:
        """Count a new step of the work: ``total`` ``unit`` (e.g. "buckets") from none done."""
        self.label, self.total, self.unit, self.files, self._last = label, total, unit, 0, 0.0
        self.update()

    def advance(self, n: int = 1) -> None:
        """``n`` more units of the current phase done."""
        self.update(files=n)

    def _draw(self) -> None:
        share = self.files / self.total if self.total else 1.0
        bar = "#" * int(share * 20)
        rows = f", {self.rows:,} rows" if self.unit == "files" else ""
        text = f"{self.label} [{bar:<20}] {self.files}/{self.total} {self.unit}{rows}"
        self.out.write("\r" + text.ljust(self._width))
        self.out.flush()
        self._width = len(text)

    def done(self) -> None:
        if self.enabled and self._width:
            self.out.write("\r" + " " * self._width + "\r")
            self.out.flush()
