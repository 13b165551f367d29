"""What ``anomalies``, ``ranks`` and ``compare`` share before and around the embedded engine.

Each stages its run(s) in DuckDB (``diagnosis.engine`` / ``diagnosis.engine_buckets``, bounded
memory) and runs the one pandas rule set per bucket, for every size: there is no in-memory path to
choose.  ``--engine`` is accepted for a release as a deprecated no-op; engine errors become one
line (exit code 2).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import Iterator

from trainmon.cli import CommandError
from trainmon.diagnosis import engine
from trainmon.diagnosis.workdir import remove_stale
from trainmon.output.cells import BadCellError

log = logging.getLogger("trainmon")

__all__ = [
    "engine_required",
    "ENGINES",
    "add_engine_argument",
    "check_settings",
    "engine_errors",
]

ENGINES = ("auto", "duckdb", "memory")  # what the deprecated --engine accepts


def add_engine_argument(parser: argparse.ArgumentParser) -> None:
    """The deprecated ``--engine``: accepted for a release, one warning, no effect."""
    parser.add_argument("--engine", choices=ENGINES, default=None, help="deprecated, no effect")


def engine_required(choice: str | None) -> None:
    """For a command that always runs in DuckDB: a clear error without it, one warning for the
    deprecated ``--engine`` flag; first the work directories of killed commands go (``workdir``)."""
    remove_stale()
    check_settings()
    if choice is not None:
        log.warning("trainmon: --engine is deprecated and has no effect: every run is staged in DuckDB")
    if not engine.available():
        raise CommandError("this command needs duckdb and pyarrow: pip install duckdb pyarrow")


def check_settings() -> None:
    """Every TRAINMON_ENGINE_* value of the environment, checked once as a command starts: a bad
    one is one line naming the variable (``errors.EnvError``, exit code 2), never a traceback nor
    a "damaged file" of the user's run."""
    from trainmon.diagnosis import engine_buckets

    engine.memory_limit()
    engine.unit_rows()
    engine.memory_rows()
    engine_buckets.bucket_rows()
    engine_buckets.sort_rows()


@contextlib.contextmanager
def engine_errors(path: object) -> Iterator[None]:
    """A bad stat cell or a file DuckDB cannot read: one line (``CommandError``), no traceback."""
    try:
        yield
    except BadCellError as exc:
        raise CommandError(str(exc)) from None
    except Exception as exc:
        if type(exc).__module__.split(".")[0] not in ("duckdb", "_duckdb"):
            raise
        raise CommandError(_engine_problem(path, type(exc).__name__, str(exc))) from None


def _engine_problem(path: object, kind: str, message: str) -> str:
    """What went wrong in DuckDB, in the user's terms: its own limits are not damaged files."""
    first_line = message.splitlines()[0] if message else kind
    full_spill = kind == "OutOfMemoryException" and "max_temp_directory_size" in message
    if full_spill or "No space left on device" in message:
        # DuckDB reports a full spill directory as out of memory ("failed to offload data block");
        # a staged run's own files that no longer fit fail as an IO error naming the errno.
        return (
            f"{path}: the analysis engine's temporary directory is full: {first_line} "
            "(it keeps staged rows under TMPDIR, 20-110 bytes per row; point TMPDIR at a disk with room)"
        )
    if kind == "OutOfMemoryException":
        cap = engine.memory_limit()
        return (
            f"{path}: the analysis engine needs more than its memory cap "
            f"(TRAINMON_ENGINE_MEMORY={cap}): {first_line} "
            f"(set TRAINMON_ENGINE_MEMORY above {cap}, e.g. {_twice(cap)}, or TRAINMON_ENGINE_UNIT_ROWS "
            f"below {engine.unit_rows()} rows)"
        )
    return f"{path}: damaged family file: {first_line}"


def _twice(cap: str) -> str:
    """A cap twice ``cap`` in its own unit ("256MB" -> "512MB"): a suggestion above the one that
    did not fit, whatever it was."""
    m = engine.SIZE_PATTERN.match(cap)
    if m is None:
        return "twice that"
    number = float(m.group(1)) * 2
    return f"{int(number) if number.is_integer() else number:g}{m.group(2)}"
