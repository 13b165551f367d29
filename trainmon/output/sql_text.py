"""SQL text for DuckDB's reads of the run files, shared by ``trainmon.load_run``
(``output.load``) and the analysis engine (``diagnosis.sql``): quoting, and how many files one
read statement scans."""

from __future__ import annotations

__all__ = ["quote", "literal", "FILES_PER_READ"]

# Files one read statement scans at most: DuckDB keeps ~0.1 MB per file of a statement until it
# ends (100,000 one-row files of msprobe's per-step layout ran out of 1 GB in one read).
FILES_PER_READ = 500


def quote(name: str) -> str:
    """An identifier (a column name), quoted for SQL."""
    return '"' + name.replace('"', '""') + '"'


def literal(text: str) -> str:
    """A text value (a path, a name), quoted for SQL."""
    return "'" + text.replace("'", "''") + "'"
