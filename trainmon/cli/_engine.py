"""``--engine auto|duckdb|memory``: one choice for the commands that can run in the embedded engine.

``anomalies``, ``ranks`` and ``compare`` read a run either into pandas (``memory``) or through
DuckDB (``duckdb``: ``diagnosis.engine`` / ``diagnosis.engine_buckets``, bounded memory).  The
same rule picks for all three, and engine errors become one line (exit code 2).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

from trainmon.cli import CommandError
from trainmon.diagnosis import engine
from trainmon.diagnosis.workdir import remove_stale
from trainmon.output import runs
from trainmon.output.cells import BadCellError

log = logging.getLogger("trainmon")

__all__ = [
    "engine_required",
    "ENGINES",
    "AUTO_ENGINE_BYTES",
    "add_engine_argument",
    "use_engine",
    "check_settings",
    "engine_errors",
]

ENGINES = ("auto", "duckdb", "memory")
# ``--engine auto`` reads runs at least this large (bytes of family files) in DuckDB; smaller ones
# in memory, where every cell is validated as it is read (damaged files: one line naming file,
# line and column).
AUTO_ENGINE_BYTES = 256 * 2**20


def add_engine_argument(parser: argparse.ArgumentParser, work: str, *, deprecated: bool = False) -> None:
    """``deprecated``: the command always stages the run in DuckDB and runs its checks per bucket
    (one code path for every size); ``--engine`` is accepted for a release, with one warning."""
    if deprecated:
        parser.add_argument("--engine", choices=ENGINES, default=None, help="deprecated, no effect")
        return
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="auto",
        help=f"duckdb: {work} in an embedded engine, bounded memory; memory: read the "
        "whole run into pandas, every cell validated; auto (default): duckdb when installed and the "
        "run's family files hold 256 MiB or more, else memory",
    )


def use_engine(choice: str, *run_dirs: str) -> bool:
    """Whether ``--engine choice`` runs in DuckDB for these runs (auto: their files together)."""
    # Every engine-capable command starts here, whichever engine it picks: the next one a user runs
    # removes the work directories of killed ones (``workdir``), even when it reads in memory.
    remove_stale()
    check_settings()
    if choice == "duckdb" and not engine.available():
        raise CommandError("--engine duckdb needs duckdb: pip install trainmon[engine]")
    if choice != "auto":
        return choice == "duckdb"
    return engine.available() and _family_bytes(run_dirs) >= AUTO_ENGINE_BYTES


def engine_required(choice: str | None) -> None:
    """For a command that always runs in DuckDB: a clear error without it, one warning for the
    deprecated ``--engine`` flag, and the ``use_engine`` housekeeping."""
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
    engine_buckets.bucket_rows()
    engine_buckets.sort_rows()


def _family_bytes(run_dirs) -> int:
    total = 0
    for run_dir in run_dirs:
        for rank_dir in Path(run_dir).glob("**/rank*"):
            for files in runs.family_files(rank_dir).values() if rank_dir.is_dir() else ():
                total += sum(f.path.stat().st_size for f in files)
                if total >= AUTO_ENGINE_BYTES:
                    return total
    return total


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
    return f"{path}: damaged family file: {first_line} (--engine memory names the file, line and column)"


def _twice(cap: str) -> str:
    """A cap twice ``cap`` in its own unit ("256MB" -> "512MB"): a suggestion above the one that
    did not fit, whatever it was."""
    m = engine._SIZE.match(cap)
    if m is None:
        return "twice that"
    number = float(m.group(1)) * 2
    return f"{int(number) if number.is_integer() else number:g}{m.group(2)}"
