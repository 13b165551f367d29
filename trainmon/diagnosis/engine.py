"""The anomaly scan inside DuckDB: the run's files are queried where they lie, only findings come back.

``scan.scan`` needs the whole run in one pandas frame (~800 bytes per CSV row).  Here the same
rules run as SQL over the CSV or Parquet files of one family at a time (DuckDB reads both
natively, multi-threaded, and spills to a temp dir beyond ``memory_limit``), so the memory a
scan needs is bounded by the engine's limit, not by the size of the run.

Exactly the same findings as ``scan.scan`` (tests compare both on the fault runs):

* values are the files' float64 values (DuckDB parses decimal text correctly rounded, as pandas'
  exact parser does; Parquet holds the bits);
* the running baseline is the median of the previous ``window`` finite values of a series
  (computed from the sorted window list: the middle value, or ``(a + b) / 2`` of the two middle
  ones, the arithmetic of pandas' rolling median), judged from ``warmup`` values on;
* training-flow order: each row's place ``g`` in the files' row order is its Parquet file's place
  and row number in it, or for CSV the ``rowid`` of the table the files were read into in order
  (DuckDB keeps it while ``preserve_insertion_order`` is on), so each row's ``position`` in its
  (rank, step, micro_step) and ``occurrence`` of its name are those of the in-memory reader;
* a stat cell holding text that is not a number is a :class:`~trainmon.output.cells.BadCellError`
  naming the file, line and column, never a silent NaN.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from trainmon.analysis.flow import family_rank
from trainmon.diagnosis.reader import FamilyStatsView, RunDirError, ranked_dirs, resolve_run_dir
from trainmon.diagnosis.workdir import WorkDir
from trainmon.errors import DamagedFileError, EnvError, env_int
from trainmon.output import runs
from trainmon.output.cells import NAN_SPELLINGS, BadCellError
from trainmon.output.layout import FamilyFile

__all__ = ["available", "RunFiles", "run_files", "Engine", "MEMORY_LIMIT"]

# The engine's working-memory cap (TRAINMON_ENGINE_MEMORY, default 256MB); beyond it DuckDB
# spills to a temp directory.  Rows of one family read into the engine at a time
# (TRAINMON_ENGINE_UNIT_ROWS, default 250,000; whole ranks: ``RunFiles.units``).  Both are read
# from the environment when used (``memory_limit()``, ``unit_rows()``), checked, never at import
# time; set here (tests), they win over the environment.
MEMORY_LIMIT: str | None = None
UNIT_ROWS: int | None = None
# The folder the engine's work directories are made in (TRAINMON_ENGINE_WORKDIR, default TMPDIR:
# ``work_root()``); set here (tests), it wins over the environment.
WORK_ROOT: str | Path | None = None
_MEMORY_DEFAULT = "256MB"
# The sizes DuckDB's memory_limit takes (decimal and binary units), in bytes.
_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]+)\s*$")
# Files one read statement scans at most: DuckDB keeps ~0.1 MB per file of a statement until it
# ends (100,000 one-row files of msprobe's per-step layout ran out of 1 GB in one read).
FILES_PER_READ = 500


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
    m = _SIZE.match(text)
    unit = _SIZE_UNITS.get(m.group(2).upper()) if m else None
    if m is None or unit is None or float(m.group(1)) <= 0:
        return None
    return int(float(m.group(1)) * unit)


def unit_rows() -> int:
    """Rows of one family the engine reads at a time (``TRAINMON_ENGINE_UNIT_ROWS``), checked."""
    return UNIT_ROWS if UNIT_ROWS is not None else env_int("TRAINMON_ENGINE_UNIT_ROWS", 250_000)


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
        with more rows in consecutive runs of its step windows.  Every check of ``anomalies`` and
        the staging of ``ranks`` and ``compare`` look within one rank and one step, except the
        spike windows, which run along a rank's steps: they carry each series' last values over
        to the next part of the same rank (``Unit.continues``).  So the engine's working memory
        follows the unit, not the run."""
        out: list[Unit] = []
        for _rank, group in itertools.groupby(self.files[family], key=lambda rf: rf[0]):
            files = list(group)
            n = self._rows_of(files)
            if n > unit_rows():
                out += [Unit(part, continues=k > 0) for k, part in enumerate(self._parts(files))]
            elif out and self._rows_of(out[-1].files) + n <= unit_rows():
                out[-1].files.extend(files)
            else:
                out.append(Unit(files))
        return out

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
    continues: bool = False  # holds later steps of the previous unit's last rank: spike windows carry over


def _parquet_rows_and_columns(f: FamilyFile) -> tuple[int, list[str]]:
    """A Parquet file's row count and column names, from one read of its footer, checked
    (``parquet_layout``: a damaged file is a DamagedFileError naming it, never skipped)."""
    from trainmon.output.parquet import parquet_layout

    return parquet_layout(f.path)


def _csv_rows(f: FamilyFile) -> int:
    """A CSV file's number of rows, estimated from its size and its first row (0: none)."""
    with open(f.path, "rb") as fh:
        header = fh.readline()
        if not header.strip():  # the sink never leaves an empty file: damage, as for the other readers
            size = os.fstat(fh.fileno()).st_size
            # the in-memory reader's words for an empty file (``output.runs``): one message per damage
            raise DamagedFileError(
                f.path, "empty file (0 bytes): no header and no rows" if size == 0 else "empty file (no header)"
            )
        first = fh.readline()
        if not first.strip():
            return 0
        return max(1, round((os.fstat(fh.fileno()).st_size - len(header)) / len(first)))


def _header_and_rows(f: FamilyFile) -> tuple[tuple[str, ...], int] | None:
    """The columns of a file that holds rows and its number of rows (exact for Parquet, estimated
    for CSV); None: no rows.  A CSV file is checked whole here (``runs._header``: NUL bytes,
    UTF-8, trainmon's header), once: the engine then reads it."""
    if f.ext == "parquet":
        n, columns = _parquet_rows_and_columns(f)
        return (tuple(columns), n) if n > 0 else None
    n = _csv_rows(f)
    return (tuple(runs._header(Path(f.path))), n) if n else None


def _header_of(f: FamilyFile) -> tuple[str, ...] | None:
    """The columns of a file that holds rows (None: no rows)."""
    found = _header_and_rows(f)
    return None if found is None else found[0]


def _roles(f: FamilyFile) -> runs.ColumnRoles:
    # The in-memory reader's own rule (it may look at dtypes), on one file of this header.
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
            found = {str(f.path): h for f in files if (h := _header_and_rows(f)) is not None}
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


# ----------------------------------------------------------------------------- SQL

# Rows of ``{}`` in the series ``s`` (rank, vpp_stage, name, micro_step, occurrence).
_SAME_SERIES = """{0}.rank = s.rank AND {0}.vpp_stage = s.vpp_stage AND {0}.name IS NOT DISTINCT FROM s.name
    AND {0}.micro_step = s.micro_step AND {0}.occurrence = s.occurrence"""

# A row's ``position`` (index in its rank's (step, micro_step), file order), as the reader numbers it.
POSITION = "row_number() OVER (PARTITION BY rank, step, micro_step ORDER BY g) - 1"


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _lit(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


# Key columns written as integers; read as numbers and cast, like the stats.
_INT_COLUMNS = ("step", "micro_step", "vpp_stage")
_TAIL = ("shape", "dtype")


class _Family:
    """The SQL of one family: a view ``t`` of its rows with rank, row order and numeric stats."""

    def __init__(
        self,
        con,
        family: str,
        files: list[tuple[int, FamilyFile]],
        stats: Sequence[str],
        *,
        texts: Sequence[str] = (),
        numbers: Sequence[str] = (),
        headers: Mapping[str, tuple[str, ...]] | None = None,
    ):
        """``texts`` / ``numbers``: more columns ``t`` carries, as text ('' where a file lacks one)
        and as float64 (NULL where absent), e.g. ``shape`` and an ``extra`` column.  ``headers``:
        the files' columns as ``run_files`` read them (``RunFiles.headers``), else read here."""
        self.con, self.family, self.stats = con, family, tuple(stats)
        self.parquet = files[0][1].ext == "parquet"
        self.rank_of = {str(f.path): rank for rank, f in files}
        groups: dict[tuple[str, ...], list[str]] = {}
        for _, f in files:
            header = headers.get(str(f.path)) if headers else None
            groups.setdefault(header or _header_of(f) or (), []).append(str(f.path))
        cols = {c for header in groups for c in header}
        self.micro = "micro_step" in cols
        self.present = [s for s in self.stats if s in cols]
        self.groups, self.cols, self.texts, self.numbers = groups, cols, tuple(texts), tuple(numbers)
        # Each file's rank and its place in the read order (headers' groups in order, files in order).
        self.file_no = {p: i for i, p in enumerate(p for paths in groups.values() for p in paths)}
        files_of = [(p, rank, self.file_no[p]) for p, rank in self.rank_of.items()]
        _fill(con, "ranks_of", {"filename": "VARCHAR", "rank": "INTEGER", "file_no": "BIGINT"}, files_of)
        # CSV is first read with its numeric columns typed (DuckDB's parser, the one TRY_CAST uses:
        # about 2x faster than text plus casts); a file with any cell that parser rejects is read
        # again as text (``_views(typed=False)``), where a bad stat cell is named exactly.
        self.typed = not self.parquet
        self._has_series = False  # the table ``series`` of this family's ``o`` (``spikes``)
        # ``extra`` columns (a comm call, a param group): part of a row's key when looking for
        # repeated keys (``duplicates``), as in ``reader.duplicate_keys``.
        self.extras = [c for c in sorted(cols) if c not in runs.KEY_COLUMNS and c not in self.stats and c not in _TAIL]
        self.duplicates: tuple | None = None  # (rows beyond the first of their key, first key..., copies)
        self._views()

    def _views(self, sources: Sequence[str] | None = None, offset: int = 0) -> None:
        """The views ``raw`` (the rows of ``sources``, some of ``_batches()``: the first by
        default, numbered in order from ``offset``) and ``t`` (their columns as the commands read
        them)."""
        con, cols, texts, numbers = self.con, self.cols, self.texts, self.numbers
        # One scan per header (the in-memory reader's grouping, in its order); no sniffing: the
        # columns are known.  UNION ALL keeps each scan's row order.
        source = " UNION ALL BY NAME ".join(self._batches()[0] if sources is None else sources)
        num = ",\n".join(f"{self._num(s)} AS {_q(s)}" for s in self.present)
        micro = self._int("micro_step") if self.micro else "-1"
        carried = [f"COALESCE(CAST({_q(c)} AS VARCHAR), '')" if c in cols else "''" for c in texts]
        carried = [f"{sql} AS {_q(c)}" for sql, c in zip(carried, texts)]
        carried += [f"{self._num(c)} AS {_q(c)}" if c in cols else f"NULL::DOUBLE AS {_q(c)}" for c in numbers]
        # Row order ``g``: Parquet rows carry their file's number and their row number in it, so
        # ``o0`` is filled in any order, by every thread (ordered, the insert ran on one thread:
        # 2x slower).  Typed CSV is read straight into ``o0`` in file order (one scan per header
        # and rank, each rank a constant), whose ``rowid`` is then the order.  A global
        # ``row_number() OVER ()`` (the text read, kept for naming a bad cell) makes the scan
        # single-threaded: 2x slower; it carries file names, joined to ranks.
        numbered = self._numbered
        g, join = {
            "parquet": ("(file_no << 32) + file_row_number AS g, r.rank", " JOIN ranks_of r USING (file_no)"),
            "text": ("g, r.rank, filename", " JOIN ranks_of r USING (filename)"),
        }.get(numbered, ("rank", ""))
        con.execute(f"""
            CREATE OR REPLACE TEMP VIEW raw AS
            SELECT {f"{int(offset)} + row_number() OVER () AS g, " if numbered == "text" else ""}* FROM ({source})""")
        con.execute(f"""
            CREATE OR REPLACE TEMP VIEW t AS
            SELECT {g}, ({self._bad_text()}) AS bad,
                   {self._int("step")} AS step,
                   COALESCE({micro}, -1) AS micro_step,
                   COALESCE({self._int("vpp_stage") if "vpp_stage" in cols else "NULL"}, 0) AS vpp_stage,
                   CAST(name AS VARCHAR) AS name,
                   COALESCE(CAST(dtype AS VARCHAR), '') AS dtype,
                   {self._extras_key()} AS xkey{"".join(", " + c for c in carried)}{"," if num else ""}
                   {num}
            FROM raw{join}""")

    def _extras_key(self) -> str:
        """One value per distinct combination of a row's ``extra`` cells (0 without extras)."""
        if not self.extras:
            return "0::UBIGINT"
        return "hash(" + ", ".join(f"CAST({_q(c)} AS VARCHAR)" for c in self.extras) + ")"

    def _batches(self) -> list[list[str]]:
        """``_sources()`` in batches of at most ``FILES_PER_READ`` files, in order: one read
        statement each (``_read``), so that the engine's memory does not grow with the number of
        files (msprobe's one file per family per step)."""
        batches: list[list[str]] = [[]]
        filled = 0
        for sql, n in self._sources():
            if batches[-1] and filled + n > FILES_PER_READ:
                batches.append([])
                filled = 0
            batches[-1].append(sql)
            filled += n
        return batches

    def _sources(self) -> list[tuple[str, int]]:
        """One scan per header (the in-memory reader's grouping, in its order) and per run of at
        most ``FILES_PER_READ`` of its files, with its number of files.  Typed CSV: one per header
        and rank, in the same order, each with its rank as a constant instead of the file name on
        every row (storing the name was a third of the read).  Each scan has every column of the
        family (NULL where its header lacks one), so any batch of scans has them all."""
        out = []
        for header, paths in self.groups.items():
            pad = self._padding(header)
            if self._numbered == "text":
                out += [(f"SELECT *{pad} FROM {self._scan(header, p)}", len(p)) for p in _chunks(paths)]
            elif self._numbered == "parquet":  # each file's number in the read order, not its name on every row
                for p in _chunks(paths):
                    number = f"{self.file_no[p[0]]} + file_index AS file_no"
                    out.append((f"SELECT {number}, *{pad} FROM {self._scan(header, p)}", len(p)))
            else:
                for rank, run in itertools.groupby(paths, key=self.rank_of.__getitem__):
                    out += [
                        (f"SELECT {int(rank)} AS rank, *{pad} FROM {self._scan(header, p, filename=False)}", len(p))
                        for p in _chunks(list(run))
                    ]
        return out

    def _padding(self, header: tuple[str, ...]) -> str:
        """``, NULL AS <column>`` for each column of the family that ``header`` lacks."""
        numeric = {*self.present, *self.numbers, *_INT_COLUMNS} if self._numbered != "text" else set()
        missing = [c for c in sorted(self.cols) if c not in header]
        return "".join(f", NULL::{'DOUBLE' if c in numeric else 'VARCHAR'} AS {_q(c)}" for c in missing)

    def _scan(self, header: tuple[str, ...], paths: list[str], *, filename: bool = True) -> str:
        listing = "[" + ", ".join(_lit(p) for p in paths) + "]"
        if self.parquet:
            return f"read_parquet({listing}, file_row_number=true)"
        # Typed: the numeric columns as DOUBLE, rejected cells recorded (``reject_errors``).  Text:
        # every column as text, so that a stat cell that is not a number is an error, not NULL.
        numeric = {*self.present, *self.numbers, *_INT_COLUMNS} if self.typed else set()
        columns = "{" + ", ".join(f"{_lit(c)}: {_lit('DOUBLE' if c in numeric else 'VARCHAR')}" for c in header) + "}"
        return (
            f"read_csv({listing}, filename={str(filename).lower()}, header=true, auto_detect=false, columns={columns}, "
            "delim=',', quote='\"', escape='\"', null_padding=false" + (", store_rejects=true)" if self.typed else ")")
        )

    def _int(self, col: str) -> str:
        if self.parquet or self.typed:
            return f"CAST({_q(col)} AS BIGINT)"
        return f"CAST(TRY_CAST({_q(col)} AS DOUBLE) AS BIGINT)"

    def _num(self, col: str) -> str:
        if self.parquet or self.typed:
            return f"CAST({_q(col)} AS DOUBLE)"
        return f"TRY_CAST(trim({_q(col)}) AS DOUBLE)"

    def _bad_text(self) -> str:
        """True for a row with a stat cell holding text other than a number (CSV read as text)."""
        if self.parquet or self.typed or not self.present:
            return "false"
        nan = ", ".join(_lit(s) for s in sorted(NAN_SPELLINGS))
        return " OR ".join(
            f"({_q(s)} IS NOT NULL AND trim({_q(s)}) NOT IN ({nan}) AND TRY_CAST(trim({_q(s)}) AS DOUBLE) IS NULL)"
            for s in self.present
        )

    def check_cells(self) -> None:
        """Raise BadCellError for the first stat cell that holds text other than a number."""
        if self._numbered != "text":
            return  # typed CSV and Parquet: numbers already (a cell the parser refused means text)
        hit = self.con.execute("SELECT filename, g FROM o WHERE bad ORDER BY g LIMIT 1").fetchone()
        if hit is None:
            return
        filename, g = hit
        first = self.con.execute("SELECT min(g) FROM o WHERE filename = ?", [filename]).fetchone()[0]
        # The row's text, read again from its file alone (``raw`` holds the last batch only).
        header = next(h for h, paths in self.groups.items() if filename in paths)
        present = [s for s in self.present if s in header]
        row = self.con.execute(
            f"SELECT {', '.join(_q(s) for s in present)} FROM {self._scan(header, [filename])} "
            f"LIMIT 1 OFFSET {int(g - first)}"
        ).fetchone()
        for col, text in zip(present, row):
            if text is not None and text.strip() not in NAN_SPELLINGS:
                try:
                    float(text.strip())
                except ValueError:
                    raise BadCellError(filename, 2 + g - first, col, text) from None

    def _v(self, s: str) -> str:
        # A stat a file lacks (another header) is NaN in the in-memory table: the same here.
        return f"COALESCE({_q(s)}, 'NaN'::DOUBLE)" if s in self.present else "'NaN'::DOUBLE"

    def _tensor_rows(self) -> str:
        all_nan = " AND ".join(f"isnan({self._v(s)})" for s in self.stats) or "true"
        return f"NOT (trim(dtype) IN ('', 'None', 'nan') AND {all_nan})"

    @property
    def _numbered(self) -> str:
        """How ``t`` numbers its rows: "parquet" (file and row number), "text" (the scan's
        order), "" (not: ``o0.rowid`` is the order)."""
        return "parquet" if self.parquet else "" if self.typed else "text"

    def _read(self) -> None:
        """``o0``: the family's rows, read once, one batch of files at a time (``_batches``);
        ``o0n``: with their order ``g`` and rank."""
        if self._numbered == "parquet":  # the order is in ``g``: no need to keep it while filling
            self.con.execute("SET preserve_insertion_order = false")
        try:
            rows = 0
            for k, batch in enumerate(self._batches()):
                self._views(batch, offset=rows)
                fill = "CREATE OR REPLACE TEMP TABLE o0 AS" if k == 0 else "INSERT INTO o0"
                self.con.execute(f"{fill} SELECT * FROM t")
                if self._numbered == "text":  # the next batch numbers its rows on from these
                    rows = self.con.execute("SELECT count(*) FROM o0").fetchone()[0]
        finally:
            self.con.execute("SET preserve_insertion_order = true")
        ordered = "*" if self._numbered else "o0.rowid AS g, *"
        self.con.execute(f"CREATE OR REPLACE TEMP VIEW o0n AS SELECT {ordered} FROM o0")

    def _find_duplicates(self) -> None:
        """``duplicates``: rows whose key (and extra cells) an earlier row has, and the first such
        key in (step, micro_step, rank, vpp_stage, name) order -- ``reader.DuplicateKeys``."""
        self.con.execute("""CREATE OR REPLACE TEMP TABLE dup AS
            SELECT rank, vpp_stage, name, step, micro_step, count(*) AS n FROM o0n
            GROUP BY rank, vpp_stage, name, step, micro_step, xkey HAVING count(*) > 1""")
        count = self.con.execute("SELECT sum(n - 1) FROM dup").fetchone()[0]
        if count:
            first = self.con.execute("""SELECT rank, vpp_stage, name, step, micro_step, n FROM dup
                ORDER BY step, micro_step, rank, vpp_stage, name LIMIT 1""").fetchone()
            self.duplicates = (int(count), *first)
        self.con.execute("DROP TABLE dup")

    def report_duplicates(self, into) -> None:
        """Add this unit's repeated keys to ``into`` (a ``reader.DuplicateKeys``, or None)."""
        if into is not None and self.duplicates is not None:
            count, rank, vpp, name, step, micro, copies = self.duplicates
            into.add(self.family, count, rank, vpp, name, step, micro, copies)

    def ordered_view(self) -> None:
        """``o``: the family's rows, read once; ``occurrence`` numbered only where names repeat in a step."""
        if self.typed:  # DuckDB appends to its reject tables: start them empty for this family
            self.con.execute("DROP TABLE IF EXISTS reject_errors")
            self.con.execute("DROP TABLE IF EXISTS reject_scans")
        self._read()
        if self.typed and self.con.execute("SELECT count(*) FROM reject_errors").fetchone()[0]:
            self.typed = False  # a cell DuckDB's number parser refused: read as text, judged there
            self._views()
            self._read()
        # Rows with equal keys have equal hashes, so as many distinct hashes as rows means no
        # repeats (a collision only sends this family down the exact path): one hash aggregate
        # on a number, ~25% cheaper than grouping by the five columns.
        repeats = self.con.execute("""
            SELECT count(*) > count(DISTINCT hash(rank, step, micro_step, vpp_stage, name)) FROM o0n""").fetchone()[0]
        if repeats:
            self._find_duplicates()
            self.con.execute("""CREATE OR REPLACE TEMP VIEW o AS SELECT *, row_number() OVER (
                PARTITION BY rank, step, micro_step, vpp_stage, name ORDER BY g) - 1 AS occurrence FROM o0n""")
            self.con.execute("CREATE OR REPLACE TEMP TABLE o1 AS SELECT * FROM o")
            self.con.execute("CREATE OR REPLACE TEMP VIEW o AS SELECT * FROM o1")
        else:  # no copy: names are unique in every step (all but comm-like families)
            self.con.execute("CREATE OR REPLACE TEMP VIEW o AS SELECT *, 0::BIGINT AS occurrence FROM o0n")


def _chunks(paths: Sequence[str]) -> list[list[str]]:
    """``paths`` in runs of at most ``FILES_PER_READ``, in order."""
    return [list(paths[i : i + FILES_PER_READ]) for i in range(0, len(paths), FILES_PER_READ)]


def _fill(con, table: str, columns: Mapping[str, str], rows: Sequence[tuple]) -> None:
    """The temp table ``table`` (``columns``: name -> SQL type) holding ``rows``, in one statement:
    ``executemany`` runs one statement per row (~0.1 ms each, seconds for thousands of rows)."""
    schema = ", ".join(f"{_q(c)} {t}" for c, t in columns.items())
    con.execute(f"CREATE OR REPLACE TEMP TABLE {table}({schema})")
    if rows:
        lists = [list(col) for col in zip(*rows)]
        con.execute(f"INSERT INTO {table} SELECT " + ", ".join(f"unnest(?::{t}[])" for t in columns.values()), lists)


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
    then ``eng.con`` and ``eng.dir``."""

    def __init__(self, threads: int | None = None):
        self.threads = threads

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
