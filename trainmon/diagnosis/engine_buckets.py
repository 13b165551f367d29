"""A run's rows inside DuckDB, handed to Python one bucket of tensor names at a time.

``anomalies`` and ``ranks`` look at rows across ranks (per family, name, step) and along each
(rank, name) series over steps, never across names.  So they run on all rows of a set of names
at a time (``compare`` stages runs here too, then groups them by rank and step:
``engine_compare``):

1. **stage**: every family's files are read by DuckDB one unit at a time (``sql.Family``:
   CSV typed, with the bad-cell check, Parquet natively), with the ordering columns
   (``position`` in the rank's (step, micro_step), ``occurrence`` of a repeated name, both from
   the files' row order: computed here only), names, shapes and dtypes as integer codes,
   and kept as an Arrow table where the whole run fits the engine's ``memory_rows`` (a run of a
   million rows: no file written and read back), else written as a Parquet file of the engine's
   work directory;
2. **partition**: buckets are runs of consecutive name codes (all families of a name in one
   bucket, so a bucket holds ``ROWS_PER_BUCKET`` rows or one name); a run staged in more than
   ``DIRECT_FILES`` files or ``SORT_ROWS`` rows is written again sorted by name, one file per run
   of buckets of about ``SORT_ROWS`` rows (a smaller one is read from its name-sorted staged files);
3. **bucket**: a :class:`Bucket` (plain values: its files, its name codes, their texts, the
   run's :class:`RunShape`) that ``read_bucket`` turns into a
   :class:`~trainmon.diagnosis.reader.RunTable` (the columns of its docstring), sorted by
   ``FLOW_KEYS`` (unique per row: the files' order, whatever order the staged files hold);
   ``scan_bucket`` / ``ranks_bucket`` check one, in this process or on a Dask worker
   (``cluster.map_buckets``); ``load_table`` reads a whole run as one bucket.

Python then holds one bucket at a time: its memory is bounded by the bucket size, not the run.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from trainmon.analysis.flow import FLOW_KEYS, phase_of, phase_rank
from trainmon.analysis.rules import Anomaly, ByDesign, Findings, Rules, Unjudged
from trainmon.diagnosis.cluster import map_buckets
from trainmon.diagnosis.engine import Engine, RunFiles, run_files
from trainmon.diagnosis.ranks import check_ranks, issue_order
from trainmon.diagnosis.reader import GROUP_COLUMN, RunTable, numel_column
from trainmon.diagnosis.scan import STEPS_FAMILY, concat_found, scan_all, skipped_steps, to_anomaly
from trainmon.diagnosis.sql import POSITION, Family, literal, quote
from trainmon.errors import env_int

__all__ = [
    "ROWS_PER_BUCKET",
    "bucket_rows",
    "sort_rows",
    "StagedRun",
    "Span",
    "consecutive_runs",
    "engine_ranks",
    "bucket_scan_all",
    "load_table",
    "Bucket",
    "RunShape",
    "read_bucket",
    "scan_bucket",
    "ranks_bucket",
    "DIRECT_FILES",
]

# Rows handed to Python at once (all families, ranks and steps of a set of names):
# TRAINMON_ENGINE_BUCKET_ROWS, default 250,000.  Rows ``ranks`` sorts at once when it stores a run
# by name (see ``StagedRun.partition``): TRAINMON_ENGINE_SORT_ROWS, default 10M.  Read from the
# environment when used (``bucket_rows()``, ``sort_rows()``), checked; set here, they win.
ROWS_PER_BUCKET: int | None = None
SORT_ROWS: int | None = None
# Staged files a bucket may read its rows from without the run being stored again by name
# (``_partition_by_name``): each file is sorted by name, so a bucket reads a row group or two of
# each; past this many, the footers and row groups read per bucket cost more than one more sort.
DIRECT_FILES = 64


def bucket_rows() -> int:
    return ROWS_PER_BUCKET if ROWS_PER_BUCKET is not None else env_int("TRAINMON_ENGINE_BUCKET_ROWS", 250_000)


def sort_rows() -> int:
    return SORT_ROWS if SORT_ROWS is not None else env_int("TRAINMON_ENGINE_SORT_ROWS", 10_000_000)


# Text columns stored as integer codes (few distinct values, many rows): the staged rows are fixed
# width, which DuckDB sorts and hands over fast; Python turns codes back into shared strings.
_CODED = ("name", "shape", "dtype")
# How staged rows are written: small row groups, so that a query for some names or some ranks
# reads little beyond them (each row group's min/max prunes it); lz4 wrote 2.5M staged rows as
# fast as snappy and faster than zstd or no compression at all (less to write).
_PARQUET = "(FORMAT parquet, COMPRESSION lz4_raw, ROW_GROUP_SIZE 16384)"


@dataclass(frozen=True, eq=False)
class HeldPart:
    """Staged rows kept in memory (``Engine.memory_rows``): an Arrow table, registered with the
    engine's connection as ``name`` so that SQL reads it like a staged file."""

    name: str
    table: object  # a pyarrow.Table


def _rows_query(con, query: str):
    """The rows of ``query`` as one Arrow table (DuckDB 2 names it ``to_arrow_table``, 1.x ``arrow``)."""
    rel = con.sql(query)
    fetch = getattr(rel, "to_arrow_table", None)
    return fetch() if fetch is not None else rel.arrow()


class StagedRun:
    """The rows of one run's families (``files``), staged unit by unit: kept as Arrow tables
    where the whole run fits the engine's ``memory_rows`` (``held_rows``), else as Parquet files
    in the engine's work directory; the view ``<prefix>_staged`` holds them all,
    ``<prefix>_f<i>`` those of family ``families[i]``.  Files, not DuckDB tables: a table keeps
    ~0.7 MB of bookkeeping per million rows in memory beyond the engine's cap (70 MB a copy at
    100M rows), a file nothing.  ``by_name``: each unit's file sorted by name code, for ``partition``."""

    def __init__(
        self,
        eng: Engine,
        files: RunFiles,
        prefix: str,
        *,
        families: Iterable[str] | None = None,
        progress=None,
        by_name: bool = False,
        duplicates=None,
    ):
        self.eng, self.con, self.files, self.prefix, self.by_name = eng, eng.con, files, prefix, by_name
        self.duplicates = duplicates  # a ``reader.DuplicateKeys`` the staging adds repeated keys to
        self.dir = eng.dir
        chosen = set(files.family_stats if families is None else families)
        self.family_stats = {f: s for f, s in files.family_stats.items() if f in chosen}
        self.families = list(self.family_stats)
        self.stat_columns = list(dict.fromkeys(s for stats in self.family_stats.values() for s in stats))
        stats = "".join(f", {quote(s)} DOUBLE" for s in self.stat_columns)
        con = self.con
        for col in _CODED:
            con.execute(f"CREATE OR REPLACE TEMP TABLE {prefix}_{col}s(text VARCHAR, code INTEGER)")
        # The schema of the staged rows, and their view while no file holds any.
        con.execute(f"""CREATE OR REPLACE TEMP TABLE {prefix}_none (fam SMALLINT, rank INTEGER, vpp_stage BIGINT,
            name INTEGER, step BIGINT, micro_step BIGINT, occurrence BIGINT, position BIGINT, shape INTEGER,
            dtype INTEGER, {quote(GROUP_COLUMN)} DOUBLE{stats})""")
        self.parts: list[list[Path | HeldPart]] = [[] for _ in self.families]
        # Each part's (first rank, last rank, first step, last step): a query for some ranks and
        # steps reads only the parts that hold them (``source``).
        self.extents: dict[Path | HeldPart, tuple[int, int, int, int]] = {}
        # The whole run in memory or the whole run in files: held only where all of it fits (a
        # large run is checked from files in buckets anyway; holding a part would only add memory),
        # and only for buckets (``by_name``: read into pandas; ``compare`` aligns in SQL, as fast
        # from files, so holding its two runs would cost memory for nothing).
        estimate = sum(files.family_rows(f) for f in self.families) if by_name else 0
        self.held_rows = estimate if estimate and eng.hold(estimate) else 0
        self._held_seen = 0  # rows staged so far: a low estimate is corrected as the units come
        for i, family in enumerate(self.families):
            self._stage(i, family, progress)
        self._views()
        self.texts = {
            col: [t for (t,) in con.execute(f"SELECT text FROM {prefix}_{col}s ORDER BY code").fetchall()]
            for col in _CODED
        }
        self.sorted: list[tuple[int, int, Path]] = []

    def _views(self) -> None:
        """The views of the staged files: ``<prefix>_f<i>`` per family, ``<prefix>_staged`` of all."""
        p = self.prefix
        for i, paths in enumerate(self.parts):
            self.con.execute(f"CREATE OR REPLACE TEMP VIEW {p}_f{i} AS {self._read(paths)}")
        every = [f for paths in self.parts for f in paths]
        self.con.execute(f"CREATE OR REPLACE TEMP VIEW {p}_staged AS {self._read(every)}")

    def _read(self, parts: Sequence[Path | HeldPart]) -> str:
        if not parts:
            return f"SELECT * FROM {self.prefix}_none"
        files = [literal(str(f)) for f in parts if isinstance(f, Path)]
        reads = [f"SELECT * FROM {f.name}" for f in parts if isinstance(f, HeldPart)]
        if files:
            reads.append("SELECT * FROM read_parquet([" + ", ".join(files) + "])")
        return " UNION ALL ".join(reads)

    def _stage(self, fam_id: int, family: str, progress) -> None:
        for unit in self.files.units(family):  # position and occurrence stay within a rank's step
            self._stage_unit(fam_id, family, unit.files, progress)

    def _stage_unit(self, fam_id: int, family: str, unit, progress) -> None:
        stats = self.family_stats[family]
        fam = Family(self.con, family, unit, stats, texts=("shape",), numbers=("group",), headers=self.files.headers)
        fam.ordered_view()
        fam.check_cells()
        fam.report_duplicates(self.duplicates)
        p = self.prefix
        for col in _CODED:  # codes for the texts this family adds
            known = self.con.execute(f"SELECT count(*) FROM {p}_{col}s").fetchone()[0]
            self.con.execute(f"""INSERT INTO {p}_{col}s SELECT text, {known} + row_number() OVER () - 1 FROM (
                SELECT DISTINCT COALESCE({col}, '') AS text FROM o EXCEPT SELECT text FROM {p}_{col}s)""")
        stats_sql = "".join(
            f", o.{quote(s)}" if s in fam.present else f", NULL::DOUBLE AS {quote(s)}" for s in self.stat_columns
        )
        position, firsts = self._position()
        ((n, r0, r1, s0, s1),) = self.con.execute(
            "SELECT count(*), min(rank), max(rank), min(step), max(step) FROM o"
        ).fetchall()  # fetched to the end: DuckDB refuses ``sql`` while a result is unfinished
        select = f"""
            SELECT {fam_id}::SMALLINT AS fam, rank::INTEGER AS rank, vpp_stage::BIGINT AS vpp_stage, n.code AS name,
                   step::BIGINT AS step, micro_step::BIGINT AS micro_step, occurrence::BIGINT AS occurrence,
                   ({position})::BIGINT AS position, s.code AS shape, d.code AS dtype,
                   "group"::DOUBLE AS {quote(GROUP_COLUMN)}{stats_sql}
            FROM o JOIN {p}_names n ON n.text = COALESCE(o.name, '') JOIN {p}_shapes s ON s.text = o.shape
                   JOIN {p}_dtypes d ON d.text = o.dtype{firsts}"""
        self._held_seen += n
        if self.held_rows and self._held_seen > self.held_rows and not self.eng.hold(self._held_seen - self.held_rows):
            self._spill()  # the estimate was low (CSV rows of unequal length) and memory_rows is reached
        elif self.held_rows:
            self.held_rows = max(self.held_rows, self._held_seen)
        part: Path | HeldPart
        if self.held_rows:  # no sort: a bucket filters a table in memory by name code
            part = HeldPart(f"{p}_m{fam_id}_{len(self.parts[fam_id])}", _rows_query(self.con, select))
            self.con.register(part.name, part.table)
        else:
            part = self.dir / f"{p}-{fam_id}-{len(self.parts[fam_id])}.parquet"
            order = " ORDER BY n.code" if self.by_name else ""
            self.con.execute(f"COPY ({select}{order}) TO {literal(str(part))} {_PARQUET}")
        self.parts[fam_id].append(part)
        self.con.execute("DROP TABLE IF EXISTS firsts")
        self.extents[part] = (r0, r1, s0, s1) if n else (0, -1, 0, -1)  # an empty part overlaps nothing
        if progress is not None:
            progress.update(files=len(unit), rows=n)
        self.con.execute("DROP VIEW o")
        self.con.execute("DROP TABLE IF EXISTS o1")
        self.con.execute("DROP TABLE o0")

    def _spill(self) -> None:
        """Write the parts held so far to files, as they would have been staged, and stage the
        rest of the run in files too."""
        order = " ORDER BY name" if self.by_name else ""
        for fam_id, parts in enumerate(self.parts):
            for k, part in enumerate(parts):
                if isinstance(part, HeldPart):
                    path = self.dir / f"{self.prefix}-{fam_id}-{k}.parquet"
                    self.con.execute(f"COPY (SELECT * FROM {part.name}{order}) TO {literal(str(path))} {_PARQUET}")
                    self.con.unregister(part.name)
                    parts[k] = path
                    self.extents[path] = self.extents.pop(part)
        self.eng.release(self.held_rows)
        self.held_rows = 0

    def _position(self) -> tuple[str, str]:
        """SQL of each row's ``position`` in its (rank, step, micro_step), and the join it needs.
        Where every such group is one unbroken run of ``g`` (as the sinks write), it is the row's
        distance from its group's first row: a small aggregate and a join, ~2x cheaper than the
        window that numbers the rows (``POSITION``), which is kept for any other layout."""
        self.con.execute("""CREATE OR REPLACE TEMP TABLE firsts AS
            SELECT rank, step, micro_step, min(g) AS first, count(*) = max(g) - min(g) + 1 AS packed
            FROM o GROUP BY rank, step, micro_step""")
        if self.con.execute("SELECT bool_and(packed) FROM firsts").fetchone()[0] is False:
            return POSITION, ""
        return "o.g - f.first", " JOIN firsts f USING (rank, step, micro_step)"

    def source(self, family: str, span: Span | None = None) -> str:
        """``family``'s staged rows: the view of them all, or a read of the parts that hold rows
        of ``span`` (which still need the span's condition, ``span.sql()``)."""
        fam_id = self.families.index(family)
        if span is None:
            return f"{self.prefix}_f{fam_id}"
        return f"({self._read([f for f in self.parts[fam_id] if span.overlaps(*self.extents[f])])})"

    def name_rows(self) -> dict[tuple[str, str], int]:
        """(family, name) -> its number of rows."""
        found = self.con.execute(f"SELECT fam, name, count(*) FROM {self.prefix}_staged GROUP BY fam, name").fetchall()
        names = self.texts["name"]
        return {(self.families[f], names[code]): int(n) for f, code, n in found}

    def code_rows(self) -> list[tuple[int, int]]:
        """(name code, its rows in every family), in code order."""
        found = self.con.execute(f"SELECT name, count(*) FROM {self.prefix}_staged GROUP BY name ORDER BY name")
        return found.fetchall()

    def names(self) -> dict[str, list[str]]:
        """family -> its distinct names."""
        out: dict[str, list[str]] = {f: [] for f in self.families}
        for family, name in self.name_rows():
            out[family].append(name)
        return out

    def grouped(self, family: str) -> bool:
        """Whether some row of ``family`` has an optimizer param group (an ``extra:group`` value)."""
        hit = self.con.execute(f"SELECT 1 FROM {self.source(family)} WHERE {quote(GROUP_COLUMN)} IS NOT NULL LIMIT 1")
        return hit.fetchone() is not None

    def partition(self, runs: Sequence[tuple[int, int]], progress=None) -> None:
        """Store the rows again, one file per run of name codes (first, last), sorted by name, so
        that ``bucket`` reads a range of names from its run's file alone.  Each run is one bounded
        sort (one sort of 100.8M rows ran out of a 256 MB cap); with ``by_name`` it reads only the
        row groups of its names from every staged file.  The staged files are removed after."""
        p = self.prefix
        for first, last in runs:
            path = self.dir / f"{p}-names-{first}-{last}.parquet"
            self.con.execute(f"""COPY (SELECT * FROM {p}_staged
                WHERE name BETWEEN {int(first)} AND {int(last)} ORDER BY name) TO {literal(str(path))} {_PARQUET}""")
            self.sorted.append((int(first), int(last), path))
            if progress is not None:
                progress.advance()
        for parts in self.parts:
            for f in parts:
                if isinstance(f, HeldPart):
                    self.con.unregister(f.name)
                else:
                    f.unlink()
            parts.clear()
        self.eng.release(self.held_rows)
        self.held_rows = 0
        self._views()

    def bucket(self, first: int, last: int) -> RunTable:
        """The rows of name codes ``first`` to ``last`` as a run table (``read_bucket``)."""
        return read_bucket(self.bucket_of(first, last))

    def shape(self) -> RunShape:
        """What every bucket of this run shares, as plain values (``read_bucket``)."""
        return RunShape(
            run_path=str(self.files.path),
            families=tuple(self.families),
            family_stats=tuple(self.family_stats.items()),
            families_on_disk=tuple(self.files.families_on_disk),
            ranks_on_disk=tuple(self.files.ranks_on_disk),
            shapes=tuple(self.texts["shape"]),
            dtypes=tuple(self.texts["dtype"]),
        )

    def bucket_of(self, first: int, last: int, shape: RunShape | None = None) -> Bucket:
        """Name codes ``first`` to ``last`` as a :class:`Bucket`: the files that hold them (their
        run's file of ``partition``, or, unpartitioned, every staged file), the names' texts."""
        if self.sorted:
            parts: list[Path | HeldPart] = [next(f for lo, hi, f in self.sorted if lo <= first and last <= hi)]
        else:
            parts = [f for part in self.parts for f in part]
        return Bucket(
            shape or self.shape(),
            tuple(str(f) for f in parts if isinstance(f, Path)),
            int(first),
            int(last),
            tuple(self.texts["name"][first : last + 1]),
            tuple(f.table for f in parts if isinstance(f, HeldPart)),
        )


@dataclass(frozen=True)
class RunShape:
    """The parts of a staged run every bucket needs, as plain picklable values: a worker of a
    cluster (``diagnosis.cluster``) rebuilds a bucket's run table from them and its files."""

    run_path: str
    families: tuple[str, ...]  # the staged ``fam`` codes' families, in flow order
    family_stats: tuple[tuple[str, tuple[str, ...]], ...]
    families_on_disk: tuple[str, ...]
    ranks_on_disk: tuple[int, ...]
    shapes: tuple[str, ...]  # shape code -> its text
    dtypes: tuple[str, ...]  # dtype code -> its text


@dataclass(frozen=True)
class Bucket:
    """One bucket: name codes ``first`` to ``last``, whose staged rows lie in ``paths`` (Parquet
    files of the engine's work directory, sorted by name code) and ``tables`` (Arrow tables held
    in memory: only where the buckets are checked in this process), and those names' texts."""

    run: RunShape
    paths: tuple[str, ...]
    first: int
    last: int
    names: tuple[str, ...]  # name code first + i -> names[i]
    tables: tuple = ()  # pyarrow.Table


def read_bucket(bucket: Bucket) -> RunTable:
    """The bucket's rows as a :class:`~trainmon.diagnosis.reader.RunTable` with the columns
    of the ``reader`` docstring, in ``FLOW_KEYS`` order (unique per row: the files' order).

    Read with pyarrow, not the engine's connection, so that it runs the same in this process and
    on a cluster's worker: each file's row groups whose name codes miss the bucket are skipped
    (their min/max), and the order is one ``lexsort`` of the key columns (a pandas sort of seven
    columns took 5x as long, an ``ORDER BY`` in DuckDB 8x)."""
    import pyarrow as pa  # type: ignore[import-untyped]  # pyarrow ships no stubs
    import pyarrow.compute as pc  # type: ignore[import-untyped]
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    run = bucket.run
    where = [("name", ">=", bucket.first), ("name", "<=", bucket.last)]
    tables = [pq.read_table(list(bucket.paths), filters=where)] if bucket.paths else []
    for held in bucket.tables:
        codes = held.column("name")
        tables.append(held.filter(pc.and_(pc.greater_equal(codes, bucket.first), pc.less_equal(codes, bucket.last))))
    # Parts differ in which columns DuckDB knew to hold no NULL: one schema, nullable where any is.
    table = pa.concat_tables(tables, promote_options="permissive") if len(tables) != 1 else tables[0]
    families = list(run.families)
    frame = table.to_pandas()
    fam = frame.pop("fam").to_numpy().astype(np.int64)
    flows = np.asarray([phase_rank(f) for f in families], dtype=np.int64)
    keys = [frame[c].to_numpy() for c in ("occurrence", "rank", "position")]
    # np.lexsort: the last key is the primary one (``FLOW_KEYS`` read backwards).
    order = np.lexsort((*keys, fam, frame["micro_step"].to_numpy(), flows[fam], frame["step"].to_numpy()))
    frame = frame.take(order)
    frame.index = pd.RangeIndex(len(frame))
    fam = fam[order]
    numels = numel_column(pd.Series(run.shapes, dtype=object)).to_numpy(dtype=float)
    frame["numel"] = numels[frame["shape"].to_numpy(dtype=np.int64)]
    frame["name"] = _texts(list(bucket.names), frame["name"].to_numpy(dtype=np.int64) - bucket.first)
    frame["shape"] = _texts(list(run.shapes), frame["shape"].to_numpy(dtype=np.int64))
    frame["dtype"] = _texts(list(run.dtypes), frame["dtype"].to_numpy(dtype=np.int64))
    frame["rank"] = frame["rank"].astype(np.int64)
    frame["family"] = _texts(families, fam)
    frame["phase"] = _texts([phase_of(f) for f in families], fam)
    frame["flow"] = flows[fam]
    frame["family_order"] = fam  # families are staged in flow order (``run_files``)
    present = {families[i] for i in np.unique(fam)}
    return RunTable(
        path=Path(run.run_path),
        frame=frame,
        family_stats={f: s for f, s in run.family_stats if f in present},
        families_on_disk=run.families_on_disk,
        ranks_on_disk=run.ranks_on_disk,
    )


def _texts(texts: list[str], codes: np.ndarray) -> pd.Series:
    # Python strings shared by every row (object dtype): converting each bucket's strings into a
    # new Arrow string column would cost time and memory that the Arrow pool keeps.
    return pd.Series(np.asarray(texts, dtype=object)[codes], dtype=object)


def consecutive_runs(counts: Iterable[tuple[int, int]], limit: int) -> list[tuple[int, int]]:
    """(first, last) key of consecutive runs of ``counts`` ((key, rows), in key order) holding
    about ``limit`` rows each: a new run once the next key would pass it (a bigger key alone)."""
    runs: list[list[int]] = []
    filled = 0
    for key, n in counts:
        if not runs or (filled and filled + n > limit):
            runs.append([key, key])
            filled = 0
        runs[-1][1] = key
        filled += n
    return [(first, last) for first, last in runs]


@dataclass(frozen=True)
class Span:
    """Ranks ``first_rank``..``last_rank`` and, where given, only steps ``first_step``..``last_step``."""

    first_rank: int
    last_rank: int
    first_step: int | None = None
    last_step: int | None = None

    def sql(self) -> str:
        ranks = f"rank BETWEEN {self.first_rank} AND {self.last_rank}"
        if self.first_step is None:
            return ranks
        return f"{ranks} AND step BETWEEN {self.first_step} AND {self.last_step}"

    def overlaps(self, first_rank: int, last_rank: int, first_step: int, last_step: int) -> bool:
        if last_rank < self.first_rank or first_rank > self.last_rank:
            return False
        if self.first_step is None or self.last_step is None:
            return True
        return not (last_step < self.first_step or first_step > self.last_step)


# ----------------------------------------------------------------------------- the commands


def bucket_scan_all(
    files: RunFiles,
    rules,
    *,
    rows_per_bucket: int = 0,
    threads: int | None = None,
    progress=None,
    duplicates=None,
    cluster: str | None = None,
):
    """``scan.scan_all`` of the run's files, one bucket of names at a time: the same findings in
    the same order (every rule looks along one name's series, never across names; the loss
    scaler's skips, which clear other names' non-finite grads, are found first from the
    ``steps`` rows).  ``cluster``: the Dask scheduler the buckets run on (``cluster.map_buckets``)."""
    anomalies: list = []
    notes: list = []
    unjudged: list[tuple[int, set[int]]] = []
    with Engine(threads, files_only=cluster is not None) as eng:
        run = StagedRun(eng, files, "a", progress=progress, by_name=True, duplicates=duplicates)
        codes: list[int] = []
        if STEPS_FAMILY in run.families:  # asked before partitioning, which replaces the staged view
            fam = run.families.index(STEPS_FAMILY)
            query = f"SELECT DISTINCT name FROM {run.prefix}_staged WHERE fam = {fam}"
            codes = [c for (c,) in run.con.execute(query).fetchall()]
        buckets = _partition_by_name(run, rows_per_bucket, progress, "anomalies")
        skips = concat_found([])
        if codes:
            parts = [skipped_steps(run.bucket(int(c), int(c))) for c in codes]
            skips = concat_found([p for p in parts if not p.empty])
        if progress is not None:
            progress.phase("anomalies: checking", len(buckets), "buckets")
        warmup = rules.spike.warmup if rules.spike is not None else 0
        check = functools.partial(scan_bucket, rules=rules, skips=skips)
        for found in map_buckets(check, buckets, cluster=cluster, progress=progress):
            anomalies += found.anomalies
            notes += found.by_design
            if found.unjudged is not None:
                unjudged.append((found.unjudged.values, set(found.unjudged.steps)))
    anomalies += [to_anomaly(r) for r in skips.itertuples(index=False)]
    return Findings(
        sorted(anomalies, key=Anomaly.sort_key),
        sorted(notes, key=ByDesign.sort_key),
        Unjudged.merge(warmup, unjudged) if rules.spike is not None else None,
    )


def scan_bucket(bucket: Bucket, *, rules: Rules, skips: pd.DataFrame) -> Findings:
    """``scan.scan_all`` of one bucket (a module-level function: a cluster's worker runs it)."""
    return scan_all(read_bucket(bucket), rules, skips=skips)


def engine_ranks(
    files: RunFiles,
    *,
    rows_per_bucket: int = 0,
    threads: int | None = None,
    progress=None,
    duplicates=None,
    cluster: str | None = None,
    **checks,
):
    """``ranks.check_ranks`` of the run's files, one bucket of names at a time (same issues, same
    order); ``duplicates``: a ``reader.DuplicateKeys`` to add the run's repeated keys to;
    ``cluster``: the Dask scheduler the buckets run on (``cluster.map_buckets``)."""
    issues = []
    with Engine(threads, files_only=cluster is not None) as eng:
        run = StagedRun(eng, files, "r", progress=progress, by_name=True, duplicates=duplicates)
        buckets = _partition_by_name(run, rows_per_bucket, progress, "ranks")
        if progress is not None:
            progress.phase("ranks: checking", len(buckets), "buckets")
        check = functools.partial(ranks_bucket, ranks=files.ranks, checks=checks)
        for found in map_buckets(check, buckets, cluster=cluster, progress=progress):
            issues += found
    return sorted(issues, key=issue_order)


def ranks_bucket(bucket: Bucket, *, ranks: tuple[int, ...], checks: dict) -> list:
    """``ranks.check_ranks`` of one bucket (a module-level function: a cluster's worker runs it)."""
    return check_ranks(read_bucket(bucket), ranks=ranks, **checks)


def load_table(
    path: str | Path,
    *,
    families: Sequence[str] | None = None,
    ranks: Sequence[int] | None = None,
    progress=None,
    duplicates=None,
) -> RunTable:
    """Every (or the chosen) family of every (or the chosen) rank of a run as one
    :class:`~trainmon.diagnosis.reader.RunTable`, in training-flow order: the run staged as the
    commands stage it, read back as one bucket holding every name.  ``progress`` hears of each
    unit staged (``update(files=, rows=)``); ``duplicates``: a ``reader.DuplicateKeys`` to add
    the run's repeated keys to."""
    files = run_files(path, families=families, ranks=ranks)
    if progress is not None:
        progress.total = sum(len(fs) for fs in files.files.values())
    if not files.files:
        frame = pd.DataFrame(columns=[*FLOW_KEYS, "family", "vpp_stage", "name", "phase", "shape", "dtype", "numel"])
        return RunTable(files.path, frame, {}, files.families_on_disk, files.ranks_on_disk)
    with Engine() as eng:
        run = StagedRun(eng, files, "l", progress=progress, by_name=True, duplicates=duplicates)
        return run.bucket(0, len(run.texts["name"]) - 1)


def _partition_by_name(run: StagedRun, rows_per_bucket: int | None, progress, command: str) -> list[Bucket]:
    """Partition a staged run by name code; returns its buckets.

    Buckets: runs of consecutive name codes (a name's rows of every family in one bucket).  A run
    staged in at most ``DIRECT_FILES`` files of at most ``SORT_ROWS`` rows in all is read from
    them as they are (each sorted by name: a bucket reads only its names' row groups of each);
    a larger one is stored again, one file per run of consecutive buckets of about ``SORT_ROWS``
    rows (``StagedRun.partition``), so that a bucket reads one file."""
    per_name = run.code_rows()
    bucket_ranges = consecutive_runs(per_name, rows_per_bucket or bucket_rows())
    rows = dict(per_name)
    sizes = [sum(rows.get(c, 0) for c in range(lo, hi + 1)) for lo, hi in bucket_ranges]
    staged = sum(isinstance(f, Path) for parts in run.parts for f in parts)  # files: each read per bucket
    if staged > DIRECT_FILES or sum(sizes) > sort_rows():
        sorts = consecutive_runs(enumerate(sizes), sort_rows())
        if progress is not None:
            progress.phase(f"{command}: sorting", len(sorts), "runs of names")
        run.partition([(bucket_ranges[a][0], bucket_ranges[b][1]) for a, b in sorts], progress)
    shape = run.shape()
    return [run.bucket_of(first, last, shape) for first, last in bucket_ranges]
