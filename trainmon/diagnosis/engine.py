"""A run's files as the analysis engine sees them, and the engine itself: one DuckDB connection
with a memory cap and a work directory.

``run_files`` lists a run's family files and their columns without reading their rows;
``RunFiles.units`` cuts each family into the units staged at a time (whole ranks while they fit
``TRAINMON_ENGINE_UNIT_ROWS``), so the engine's working memory follows the unit, not the run.
The SQL that reads a unit is ``diagnosis.sql`` (``Family``); ``engine_buckets`` stages the rows
and hands them to the one pandas rule set one bucket of names at a time (``diagnosis.cluster``:
in this process or on a Dask cluster).  The engine's settings (``TRAINMON_ENGINE_MEMORY``,
``TRAINMON_ENGINE_UNIT_ROWS``, ``TRAINMON_ENGINE_WORKDIR``) are read when used and checked.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from trainmon.analysis.flow import family_rank
from trainmon.diagnosis.reader import FamilyStatsView, RunDirError, ranked_dirs, resolve_run_dir
from trainmon.diagnosis.sql import header_and_rows
from trainmon.diagnosis.workdir import WorkDir
from trainmon.errors import EnvError, env_int
from trainmon.output import runs
from trainmon.output.layout import FamilyFile

__all__ = ["available", "RunFiles", "run_files", "Engine", "MEMORY_LIMIT"]

# The engine's working-memory cap (TRAINMON_ENGINE_MEMORY, default 256MB); beyond it DuckDB
# spills to a temp directory.  Rows of one family read into the engine at a time
# (TRAINMON_ENGINE_UNIT_ROWS, default 250,000; whole ranks: ``RunFiles.units``).  Both are read
# from the environment when used (``memory_limit()``, ``unit_rows()``), checked, never at import
# time; set here (tests), they win over the environment.
MEMORY_LIMIT: str | None = None
UNIT_ROWS: int | None = None
MEMORY_ROWS: int | None = None  # memory_rows(): TRAINMON_ENGINE_MEMORY_ROWS
# The folder the engine's work directories are made in (TRAINMON_ENGINE_WORKDIR, default TMPDIR:
# ``work_root()``); set here (tests), it wins over the environment.
WORK_ROOT: str | Path | None = None
_MEMORY_DEFAULT = "256MB"
# The sizes DuckDB's memory_limit takes (decimal and binary units), in bytes.
_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
SIZE_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]+)\s*$")


def memory_limit() -> str:
    """The engine's memory cap as DuckDB reads it (``TRAINMON_ENGINE_MEMORY``), checked."""
    if MEMORY_LIMIT is not None:
        return MEMORY_LIMIT
    text = os.environ.get("TRAINMON_ENGINE_MEMORY", "").strip() or _MEMORY_DEFAULT
    if memory_bytes(text) is None:
        raise EnvError(
            "TRAINMON_ENGINE_MEMORY",
            text,
            "must be a size such as 512MB or 2GB (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; "
            f"default {_MEMORY_DEFAULT})",
        )
    return text


def memory_bytes(text: str) -> int | None:
    """Bytes of a DuckDB size ("256MB", "1.5GiB"); None when it is not one (or not > 0)."""
    m = SIZE_PATTERN.match(text)
    unit = _SIZE_UNITS.get(m.group(2).upper()) if m else None
    if m is None or unit is None or float(m.group(1)) <= 0:
        return None
    return int(float(m.group(1)) * unit)


def unit_rows() -> int:
    """Rows of one family the engine reads at a time (``TRAINMON_ENGINE_UNIT_ROWS``), checked."""
    return UNIT_ROWS if UNIT_ROWS is not None else env_int("TRAINMON_ENGINE_UNIT_ROWS", 250_000)


def memory_rows() -> int:
    """Staged rows an engine may keep in memory as Arrow tables: a run whose rows fit is staged
    there, a larger one in files (``TRAINMON_ENGINE_MEMORY_ROWS``, default 2,000,000; ~120 bytes a
    row with six stats; 0: always files), checked."""
    return MEMORY_ROWS if MEMORY_ROWS is not None else env_int("TRAINMON_ENGINE_MEMORY_ROWS", 2_000_000, minimum=0)


def work_root() -> Path | None:
    """Where the engine makes its work directories (``TRAINMON_ENGINE_WORKDIR``), checked; None:
    under ``TMPDIR``.  With ``--cluster`` the workers read the staged files there, so it must be a
    folder every worker sees at the same path (a shared file system)."""
    if WORK_ROOT is not None:
        return Path(WORK_ROOT)
    text = os.environ.get("TRAINMON_ENGINE_WORKDIR", "").strip()
    if not text:
        return None
    if not os.path.isdir(text) or not os.access(text, os.W_OK | os.X_OK):
        raise EnvError("TRAINMON_ENGINE_WORKDIR", text, "must be an existing folder this user can write to")
    return Path(text)


def available() -> bool:
    try:
        import duckdb  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class RunFiles(FamilyStatsView):
    """What the scan needs to know about a run without reading its rows."""

    path: Path
    files: dict[str, list[tuple[int, FamilyFile]]] = field(default_factory=dict)  # family -> (rank, file)
    family_stats: dict[str, tuple[str, ...]] = field(default_factory=dict)
    ranks: tuple[int, ...] = ()
    families_on_disk: tuple[str, ...] = ()  # every family of every rank, chosen or not
    ranks_on_disk: tuple[int, ...] = ()
    headers: dict[str, tuple[str, ...]] = field(default_factory=dict)  # file path -> its columns
    rows: dict[str, int] = field(default_factory=dict)  # file path -> its rows (CSV: estimated)

    def units(self, family: str) -> list[Unit]:
        """``family``'s files in the units the engine reads one at a time, each within
        ``UNIT_ROWS`` rows where the files allow: whole ranks together while they fit, and a rank
        with more rows in consecutive runs of its step windows.  A unit is only staged: the checks
        run later, per bucket of names holding every step of its tensors (the spike rule's
        windows run along them), so the engine's working memory follows the unit, not the run."""
        out: list[Unit] = []
        for _rank, group in itertools.groupby(self.files[family], key=lambda rf: rf[0]):
            files = list(group)
            n = self._rows_of(files)
            if n > unit_rows():
                out += [Unit(part) for part in self._parts(files)]
            elif out and self._rows_of(out[-1].files) + n <= unit_rows():
                out[-1].files.extend(files)
            else:
                out.append(Unit(files))
        return out

    def family_rows(self, family: str) -> int:
        """``family``'s rows in every rank's files (CSV: estimated)."""
        return self._rows_of(self.files.get(family, []))

    def _rows_of(self, files: Sequence[tuple[int, FamilyFile]]) -> int:
        return sum(self.rows.get(str(f.path), 0) for _, f in files)

    def _parts(self, files: list[tuple[int, FamilyFile]]) -> list[list[tuple[int, FamilyFile]]]:
        """One rank's files (in step order) in consecutive runs of about ``UNIT_ROWS`` rows, cut
        only where every earlier file's window ends before the next file's starts (the windows
        the sinks name their files by), so a later part holds only later steps."""
        parts: list[list[tuple[int, FamilyFile]]] = [[]]
        filled, last_end = 0, -1
        for rank, f in files:
            n = self.rows.get(str(f.path), 0)
            if parts[-1] and filled + n > unit_rows() and last_end < f.start:
                parts.append([])
                filled = 0
            parts[-1].append((rank, f))
            filled += n
            last_end = max(last_end, f.end)
        return parts


@dataclass
class Unit:
    """Files of one family that the engine reads together (``RunFiles.units``)."""

    files: list[tuple[int, FamilyFile]]


def _roles(f: FamilyFile) -> runs.ColumnRoles:
    # ``output.runs``' own rule (it may look at dtypes), on one file of this header.
    from trainmon.output.parquet import read_parquet

    return runs.column_roles(runs.read_csv(f.path) if f.ext == "csv" else read_parquet(f.path))


def run_files(
    path: str | Path, *, families: Sequence[str] | None = None, ranks: Sequence[int] | None = None
) -> RunFiles:
    """The files of a run by family, and each family's stat columns (from one file per header)."""
    run_dir = resolve_run_dir(path)
    out = RunFiles(run_dir)
    stats: dict[str, list[str]] = {}
    seen_ranks: set[int] = set()
    roles_of: dict[tuple[str, tuple[str, ...]], runs.ColumnRoles] = {}
    every = ranked_dirs(run_dir)
    by_rank = {rank: runs.family_files(rdir) for rank, rdir in every}
    if not any(by_rank.values()):
        raise RunDirError(
            f"{run_dir}: nothing recorded (its rank folders hold no <family>_<a>-<b>.csv or .parquet file)"
        )
    out.families_on_disk = tuple(
        sorted({f for fams in by_rank.values() for f in fams}, key=lambda f: (family_rank(f), f))
    )
    out.ranks_on_disk = tuple(rank for rank, _ in every)
    for rank, _rdir in every:
        if ranks is not None and rank not in ranks:
            continue
        for family, files in by_rank[rank].items():
            if families is not None and family not in families:
                continue
            found = {str(f.path): h for f in files if (h := header_and_rows(f)) is not None}
            with_rows = [f for f in files if str(f.path) in found]
            if not with_rows:
                continue
            seen_ranks.add(rank)
            out.files.setdefault(family, []).extend((rank, f) for f in with_rows)
            headers = {path: h for path, (h, _) in found.items()}
            out.headers.update(headers)
            out.rows.update({path: n for path, (_, n) in found.items()})
            known = stats.setdefault(family, [])
            for f in with_rows:
                key = (family, headers[str(f.path)])
                if key not in roles_of:
                    roles_of[key] = _roles(f)
                known += [c for c in roles_of[key].stats if c not in known]
    ordered = sorted(stats, key=lambda fam: (family_rank(fam), fam))
    out.family_stats = {f: tuple(stats[f]) for f in ordered}
    out.ranks = tuple(sorted(seen_ranks))
    return out


def _connect(threads: int | None, spill_dir: str):
    import duckdb

    config: dict[str, str | bool | int | float | list[str]] = {
        "memory_limit": memory_limit(),
        "preserve_insertion_order": True,
        "temp_directory": spill_dir,
    }
    if threads:
        config["threads"] = int(threads)
    con = duckdb.connect(":memory:", config=config)
    # DuckDB's own bar prints to stdout once a query passes 2 s, which corrupts `--json` on a slow
    # machine; the commands draw their own progress on stderr, and only on a terminal.
    con.execute("SET enable_progress_bar = false")
    return con


class Engine:
    """One DuckDB connection and its work directory (DuckDB's spill files, staged runs' files:
    ``workdir.WorkDir``, which also removes what killed commands left); ``with Engine() as eng:``,
    then ``eng.con`` and ``eng.dir``.  ``files_only``: stage every row in files (a cluster's
    workers read them); else up to ``memory_rows()`` staged rows are held in memory (``hold``)."""

    def __init__(self, threads: int | None = None, *, files_only: bool = False):
        self.threads = threads
        self._room = 0 if files_only else memory_rows()

    def hold(self, rows: int) -> bool:
        """Whether ``rows`` more staged rows may be kept in memory (then counted as held)."""
        if rows > self._room:
            return False
        self._room -= rows
        return True

    def release(self, rows: int) -> None:
        """``rows`` held rows were let go (``hold``)."""
        self._room += rows

    def __enter__(self) -> Engine:
        self._work = WorkDir(work_root())
        self.dir = self._work.path
        try:
            self.con = _connect(self.threads, str(self.dir / "spill"))
        except BaseException:
            self._work.close()  # no connection, no __exit__: leave no directory
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.con.close()
        self._work.close()
