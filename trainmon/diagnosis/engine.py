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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from trainmon.diagnosis.flow import family_rank
from trainmon.diagnosis.reader import FamilyStatsView, RunDirError, ranked_dirs, resolve_run_dir
from trainmon.diagnosis.rules import COUNT_OPS, RATIO_FAMILIES, Anomaly, Rules
from trainmon.diagnosis.workdir import WorkDir
from trainmon.errors import DamagedFileError
from trainmon.output import runs
from trainmon.output.cells import NAN_SPELLINGS, BadCellError
from trainmon.output.layout import FamilyFile

__all__ = ["available", "RunFiles", "run_files", "engine_scan", "Engine", "MEMORY_LIMIT"]

# The engine's working-memory cap; beyond it DuckDB spills to a temp directory.
MEMORY_LIMIT = os.environ.get("TRAINMON_ENGINE_MEMORY", "256MB")
# Rows of one family read into the engine at a time (whole ranks: ``RunFiles.units``).
UNIT_ROWS = int(os.environ.get("TRAINMON_ENGINE_UNIT_ROWS", "250000"))


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
            if n > UNIT_ROWS:
                out += [Unit(part, continues=k > 0) for k, part in enumerate(self._parts(files))]
            elif out and self._rows_of(out[-1].files) + n <= UNIT_ROWS:
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
            if parts[-1] and filled + n > UNIT_ROWS and last_end < f.start:
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
    """A Parquet file's row count and column names, from one read of its footer."""
    import pyarrow.parquet as pq  # type: ignore[import-untyped]  # pyarrow ships no stubs

    meta = pq.read_metadata(f.path)
    return meta.num_rows, list(meta.schema.to_arrow_schema().names)


def _csv_rows(f: FamilyFile) -> int:
    """A CSV file's number of rows, estimated from its size and its first row (0: none)."""
    with open(f.path, "rb") as fh:
        header = fh.readline()
        if not header.strip():  # the sink never leaves an empty file: damage, as for the other readers
            raise DamagedFileError(f.path, "empty file (no header)")
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
        self._views()

    def _views(self) -> None:
        """The views ``raw`` (the files' rows, numbered in order) and ``t`` (their columns as the
        commands read them)."""
        con, cols, texts, numbers = self.con, self.cols, self.texts, self.numbers
        # One scan per header (the in-memory reader's grouping, in its order); no sniffing: the
        # columns are known.  UNION ALL keeps each scan's row order.
        source = " UNION ALL BY NAME ".join(self._sources())
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
            SELECT {"row_number() OVER () AS g, " if numbered == "text" else ""}* FROM ({source})""")
        con.execute(f"""
            CREATE OR REPLACE TEMP VIEW t AS
            SELECT {g}, ({self._bad_text()}) AS bad,
                   {self._int("step")} AS step,
                   COALESCE({micro}, -1) AS micro_step,
                   COALESCE({self._int("vpp_stage") if "vpp_stage" in cols else "NULL"}, 0) AS vpp_stage,
                   CAST(name AS VARCHAR) AS name,
                   COALESCE(CAST(dtype AS VARCHAR), '') AS dtype{"".join(", " + c for c in carried)}{"," if num else ""}
                   {num}
            FROM raw{join}""")

    def _sources(self) -> list[str]:
        """One scan per header (the in-memory reader's grouping, in its order).  Typed CSV: one
        per header and rank, in the same order, each with its rank as a constant instead of the
        file name on every row (storing the name was a third of the read)."""
        if self._numbered == "text":
            return [f"SELECT * FROM {self._scan(h, p)}" for h, p in self.groups.items()]
        if self._numbered == "parquet":  # each file's number in the read order, not its name on every row
            return [
                f"SELECT {self.file_no[p[0]]} + file_index AS file_no, * FROM {self._scan(h, p)}"
                for h, p in self.groups.items()
            ]
        out = []
        for header, paths in self.groups.items():
            for rank, run in itertools.groupby(paths, key=self.rank_of.__getitem__):
                out.append(f"SELECT {int(rank)} AS rank, * FROM {self._scan(header, list(run), filename=False)}")
        return out

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
        row = self.con.execute(f"SELECT {', '.join(_q(s) for s in self.present)} FROM raw WHERE g = ?", [g]).fetchone()
        for col, text in zip(self.present, row):
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
        """``o0``: the family's rows, read once; ``o0n``: with their order ``g`` and rank."""
        if self._numbered == "parquet":  # the order is in ``g``: no need to keep it while filling
            self.con.execute("SET preserve_insertion_order = false")
        try:
            self.con.execute("CREATE OR REPLACE TEMP TABLE o0 AS SELECT * FROM t")
        finally:
            self.con.execute("SET preserve_insertion_order = true")
        ordered = "*" if self._numbered else "o0.rowid AS g, *"
        self.con.execute(f"CREATE OR REPLACE TEMP VIEW o0n AS SELECT {ordered} FROM o0")

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
            self.con.execute("""CREATE OR REPLACE TEMP VIEW o AS SELECT *, row_number() OVER (
                PARTITION BY rank, step, micro_step, vpp_stage, name ORDER BY g) - 1 AS occurrence FROM o0n""")
            self.con.execute("CREATE OR REPLACE TEMP TABLE o1 AS SELECT * FROM o")
            self.con.execute("CREATE OR REPLACE TEMP VIEW o AS SELECT * FROM o1")
        else:  # no copy: names are unique in every step (all but comm-like families)
            self.con.execute("CREATE OR REPLACE TEMP VIEW o AS SELECT *, 0::BIGINT AS occurrence FROM o0n")

    def nonfinite(self) -> list[tuple]:
        ops = [c for c in COUNT_OPS if c in self.stats] + [c for c in self.stats if c not in COUNT_OPS]
        if not ops or self.family in RATIO_FAMILIES:
            return []
        cases = " ".join(f"WHEN {self._bad(op)} THEN {_lit(op)}" for op in ops)
        values = " ".join(f"WHEN {_lit(op)} THEN {self._v(op)}" for op in ops)
        return self.con.execute(f"""
            SELECT g, step, name, rank, op, CASE op {values} END AS value, 'nonfinite', micro_step, vpp_stage,
                   NULL, occurrence
            FROM (SELECT *, CASE {cases} END AS op FROM o WHERE {self._tensor_rows()})
            WHERE op IS NOT NULL""").fetchall()

    def _bad(self, op: str) -> str:
        # DuckDB orders NaN above every number (NaN > 0 is true there): guard it as numpy does.
        v = self._v(op)
        return f"(NOT isnan({v}) AND {v} > 0)" if op in COUNT_OPS else f"NOT isfinite({v})"

    def spikes(self, op: str, rule, *, carried: str | None = None, keep: str | None = None) -> list[tuple]:
        """Candidates from bounds on each row's windowed median (fast), then each candidate's
        baseline exactly, in pandas' arithmetic, from its window's values; the rule is applied to
        that exact baseline.  ``carried``: a table of earlier values of these series (an earlier
        part of the same ranks, all of them before this part's steps: ``RunFiles.units``) that
        the windows start from; ``keep``: the table to leave each series' last values in, for the
        next part."""
        v, w = self._v(op), int(rule.window)
        if not self._has_series:  # the same series for every op
            self._series_ids()
            self._has_series = True
        # The finite values of ``op`` with their series number: the windows sort these four
        # integer and float columns only (partitioning by the five key columns, a text one among
        # them, cost ~40% more).
        earlier = ""
        if carried is not None:
            same = _SAME_SERIES.format("c")
            earlier = f"UNION ALL SELECT c.g, c.step, s.sid, c.v, true FROM {carried} c JOIN series s ON {same}"
        self.con.execute(f"""CREATE OR REPLACE TEMP TABLE fin AS
            SELECT g, step, sid, {v} AS v, false AS carried FROM o JOIN series s ON {_SAME_SERIES.format("o")}
            WHERE {self._tensor_rows()} AND isfinite({v}) {earlier}""")
        window = f"WINDOW win AS (PARTITION BY sid ORDER BY step, g ROWS BETWEEN {w} PRECEDING AND 1 PRECEDING)"
        # The median of a window lies in [min, max] of its values, so |median| lies in [lo, hi]
        # below: a row can only fire if it would fire against one of those bounds.  min/max
        # windows cost less than a median window, and the exact check below decides.
        bounds = f"""SELECT g, step, sid, v, carried, count(v) OVER win AS n,
                     CASE WHEN min(v) OVER win > 0 THEN min(v) OVER win
                          WHEN max(v) OVER win < 0 THEN -max(v) OVER win ELSE 0 END AS lo,
                     greatest(abs(min(v) OVER win), abs(max(v) OVER win)) AS hi FROM fin {window}"""
        if self._spike_candidates(bounds, "lo", "hi", rule) > self._BOUND_CANDIDATES:
            # Bounds too loose (values around zero, wild series): the median itself.
            median = f"""SELECT g, step, sid, v, carried, count(v) OVER win AS n, abs(median(v) OVER win) AS m
                         FROM fin {window}"""
            self._spike_candidates(median, "m", "m", rule)
        if keep is not None:
            self._keep_last(keep, carried, w)
        candidates = self.con.execute("""
            SELECT c.g, o.step, o.name, o.rank, o.micro_step, o.vpp_stage, o.occurrence, c.v
            FROM spike_cand c JOIN o USING (g) ORDER BY c.g""").fetchall()
        if not candidates:
            return []
        # Each candidate's window: the ``w`` finite values before it in its series (carried ones
        # come from earlier steps).
        windows = dict(
            self.con.execute(f"""
            SELECT c.g, list(s.v ORDER BY s.step DESC, s.g DESC)[1:{w}]
            FROM spike_cand c JOIN fin s USING (sid)
            WHERE s.step < c.step OR (s.step = c.step AND s.g < c.g) GROUP BY c.g""").fetchall()
        )
        out = []
        for g, step, name, rank, micro, vpp, occ, value in candidates:
            base = _median(windows[g])
            if rule.fires(value, base):
                out.append((g, step, name, rank, op, value, "spike", micro, vpp, base, occ))
        return out

    def _keep_last(self, keep: str, carried: str | None, w: int) -> None:
        """Table ``keep``: each series' last ``w`` finite values (rows ``fin`` holds, carried ones
        included), and the carried values of series this part does not have."""
        self.con.execute(f"""CREATE OR REPLACE TEMP TABLE {keep}_next AS
            SELECT s.rank, s.vpp_stage, s.name, s.micro_step, s.occurrence, f.step, f.g, f.v
            FROM fin f JOIN series s USING (sid)
            QUALIFY row_number() OVER (PARTITION BY f.sid ORDER BY f.step DESC, f.g DESC) <= {w}""")
        if carried is not None:
            self.con.execute(f"""INSERT INTO {keep}_next SELECT * FROM {carried} c
                WHERE NOT EXISTS (SELECT 1 FROM series s WHERE {_SAME_SERIES.format("c")})""")
        self.con.execute(f"DROP TABLE IF EXISTS {keep}")
        self.con.execute(f"ALTER TABLE {keep}_next RENAME TO {keep}")

    def _series_ids(self) -> None:
        """Table ``series``: each (rank, vpp_stage, name, micro_step, occurrence) of ``o`` and its number ``sid``."""
        self.con.execute("""CREATE OR REPLACE TEMP TABLE series AS
            SELECT *, (row_number() OVER ())::INTEGER AS sid
            FROM (SELECT DISTINCT rank, vpp_stage, name, micro_step, occurrence FROM o)""")

    # Candidates per family beyond which the median bounds are given up for the median itself
    # (each candidate's exact window is a join with its series' earlier rows).
    _BOUND_CANDIDATES = 10_000

    def _spike_candidates(self, windows: str, lo: str, hi: str, rule) -> int:
        """Table ``spike_cand``: the rows (g, step, sid, v) of ``windows`` whose |baseline| in
        ``[lo, hi]`` could fire ``rule``, a little wider than the rule, since DuckDB's median
        (lo + (hi - lo) / 2) and pandas' ((lo + hi) / 2) can differ in the last bit, and the
        latter overflows near the float64 maximum (> 8e307).  Returns their number."""
        slack, floor, factor = 1.0 - 1e-9, float(rule.floor), float(rule.factor)
        f = f"{floor!r}"
        self.con.execute(f"""CREATE OR REPLACE TEMP TABLE spike_cand AS
            SELECT g, step, sid, v FROM ({windows})
            WHERE NOT carried AND n >= {int(rule.warmup)} AND ({lo} + {f} = 0 OR {hi} > 8e307
                  OR abs(v) + {f} >= {factor * slack!r} * ({lo} + {f})
                  OR (abs(v) + {f}) * {factor * slack!r} <= {hi} + {f})""")
        return self.con.execute("SELECT count(*) FROM spike_cand").fetchone()[0]

    def over_threshold(self, op: str, threshold: float) -> list[tuple]:
        v = self._v(op)
        return self.con.execute(f"""
            SELECT g, step, name, rank, {_lit(op)}, {v}, 'threshold', micro_step, vpp_stage, NULL, occurrence
            FROM o WHERE isfinite({v}) AND abs({v}) > {float(threshold)!r}""").fetchall()

    def positions(self, rows: list[tuple]) -> dict[int, int]:
        """Row ``g`` -> its index in its (rank, step, micro_step), for the found rows' groups only."""
        if not rows:
            return {}
        hits = list({(r[3], r[1], r[7]) for r in rows})
        _fill(self.con, "hit", {"rank": "INTEGER", "step": "BIGINT", "micro_step": "BIGINT"}, hits)
        wanted = {r[0] for r in rows}
        found = self.con.execute(f"""
            SELECT g, {POSITION} FROM o SEMI JOIN hit USING (rank, step, micro_step)""").fetchall()
        return {g: p for g, p in found if g in wanted}


def _median(values: list[float]) -> float:
    """pandas' rolling median: the middle value, or (a + b) / 2 of the two middle ones."""
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


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
        "memory_limit": MEMORY_LIMIT,
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
        self._work = WorkDir()
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


def engine_scan(files: RunFiles, rules: Rules = Rules(), *, threads: int | None = None, progress=None) -> list[Anomaly]:
    """Every anomaly of the run's files, in training-flow order: ``scan.scan`` of the same run."""
    # Ties in flow order keep the in-memory scan's order: every nonfinite, then spikes, then thresholds.
    found: dict[str, list[Anomaly]] = {"nonfinite": [], "spike": [], "threshold": []}
    with Engine(threads) as eng:
        for family, stats in files.family_stats.items():
            units = files.units(family)
            for k, unit in enumerate(units):
                fam = _Family(eng.con, family, unit.files, stats, headers=files.headers)
                then = k + 1 < len(units) and units[k + 1].continues  # the next part needs the windows' tails
                _scan_unit(fam, rules, found, progress, carried=unit.continues, keep=then)
    return sorted([a for part in found.values() for a in part], key=Anomaly.sort_key)


def _scan_unit(
    fam: _Family, rules: Rules, found: dict[str, list[Anomaly]], progress, *, carried: bool, keep: bool
) -> None:
    """The rules on one unit of a family's files; findings into ``found`` by rule.  ``carried``:
    the spike windows start from the series' tails the previous unit kept; ``keep``: keep this
    unit's tails for the next."""
    con = fam.con
    fam.ordered_view()
    fam.check_cells()
    rows: list[tuple] = []
    if rules.nonfinite:
        rows += fam.nonfinite()
    ops = [o for o in rules.ops if o in fam.stats]
    if rules.spike is not None:
        for i, op in enumerate(ops):
            tail = f"spike_tail_{i}"
            rows += fam.spikes(op, rules.spike, carried=tail if carried else None, keep=tail if keep else None)
            if carried and not keep:
                con.execute(f"DROP TABLE IF EXISTS {tail}")
    if rules.threshold is not None:
        for op in ops:
            rows += fam.over_threshold(op, rules.threshold)
    position = fam.positions(rows)
    for r in rows:
        found[r[6]].append(_anomaly(fam.family, r, position[r[0]]))
    if progress is not None:
        n = con.execute("SELECT count(*) FROM o").fetchone()[0]
        progress.update(files=len(fam.rank_of), rows=n)
    con.execute("DROP VIEW o")
    for table in ("o1", "fin", "series", "spike_cand"):
        con.execute(f"DROP TABLE IF EXISTS {table}")
    con.execute("DROP TABLE o0")


def _anomaly(family: str, r: tuple, position: int) -> Anomaly:
    _, step, name, rank, op, value, rule, micro, vpp, base, occurrence = r
    return Anomaly(
        step=int(step),
        kind=family,
        name=name,
        rank=int(rank),
        op=op,
        value=float("nan") if value is None else float(value),
        rule=rule,
        micro_step=None if int(micro) < 0 else int(micro),
        vpp_stage=int(vpp),
        baseline=None if base is None else float(base),
        position=int(position),
        occurrence=int(occurrence),
    )
