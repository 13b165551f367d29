"""A run's rows inside DuckDB, handed to Python one bucket of tensor names at a time.

``ranks`` looks at rows across ranks (per family, name, step) and along each (rank, name) series
over steps, never across names.  So it can run on all rows of a set of names at a time, with its
pandas logic unchanged (``compare`` stages runs here too, then aligns them in SQL:
``engine_compare``):

1. **stage**: every family's files are read by DuckDB once (``engine._Family``: CSV typed, with
   the bad-cell check, Parquet natively), with the ordering columns the in-memory reader computes
   (``position`` in the rank's (step, micro_step), ``occurrence`` of a repeated name, both from the
   files' row order), into one table; DuckDB spills it beyond its memory cap;
2. **partition**: the caller gives each (family, name) a bucket (all families of a name in one
   bucket, so a bucket holds ``ROWS_PER_BUCKET`` rows or one name), the table is rewritten in
   bucket order, so a bucket's rows are one contiguous range;
3. **bucket(k)**: a :class:`~trainmon.diagnosis.reader.RunTable` of those rows with the columns and
   dtypes the checks read from ``load_run``'s table, sorted by ``FLOW_KEYS`` (unique per row, so
   the order is the in-memory one whatever order DuckDB returns).

Python then holds one bucket at a time: its memory is bounded by the bucket size, not the run.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import pandas as pd

from trainmon.diagnosis import engine
from trainmon.diagnosis.engine import POSITION, RunFiles, _Family, _q
from trainmon.diagnosis.flow import FLOW_KEYS, PHASES, phase_of
from trainmon.diagnosis.reader import EXTRA_PREFIX, RunTable, numel_column

__all__ = ["ROWS_PER_BUCKET", "GROUP", "Engine", "StagedRun", "pack_buckets", "consecutive_runs", "engine_ranks"]

# Rows handed to Python at once (all families, ranks and steps of a set of names).
ROWS_PER_BUCKET = int(os.environ.get("TRAINMON_ENGINE_BUCKET_ROWS", "250000"))
# Rows ``ranks`` sorts at once when it stores a run in bucket order (see ``StagedRun.partition``).
SORT_ROWS = int(os.environ.get("TRAINMON_ENGINE_SORT_ROWS", "10000000"))
# The ``extra`` column compare reads (a hyperparams row's optimizer param group).
GROUP = EXTRA_PREFIX + "group"


class Engine:
    """One DuckDB connection with its spill directory; ``with Engine() as con:``."""

    def __init__(self, threads: int | None = None):
        self.threads = threads

    def __enter__(self):
        self.spill_dir = tempfile.mkdtemp(prefix="trainmon-engine-")
        self.con = engine._connect(self.threads, self.spill_dir)
        return self.con

    def __exit__(self, *exc) -> None:
        self.con.close()
        shutil.rmtree(self.spill_dir, ignore_errors=True)


# Text columns stored as integer codes (few distinct values, many rows): the staged rows are fixed
# width, which DuckDB sorts and hands over fast; Python turns codes back into shared strings.
_CODED = ("name", "shape", "dtype")


class StagedRun:
    """The rows of one run's families (``files``) in the table ``<prefix>_rows``."""

    def __init__(self, con, files: RunFiles, prefix: str, *, families: Iterable[str] | None = None, progress=None):
        self.con, self.files, self.prefix = con, files, prefix
        chosen = set(files.family_stats if families is None else families)
        self.family_stats = {f: s for f, s in files.family_stats.items() if f in chosen}
        self.families = list(self.family_stats)
        self.stat_columns = list(dict.fromkeys(s for stats in self.family_stats.values() for s in stats))
        stats = "".join(f", {_q(s)} DOUBLE" for s in self.stat_columns)
        for col in _CODED:
            con.execute(f"CREATE OR REPLACE TEMP TABLE {prefix}_{col}s(text VARCHAR, code INTEGER)")
        con.execute(f"""CREATE OR REPLACE TEMP TABLE {prefix}_staged (fam SMALLINT, rank INTEGER, vpp_stage BIGINT,
            name INTEGER, step BIGINT, micro_step BIGINT, occurrence BIGINT, position BIGINT, shape INTEGER,
            dtype INTEGER, {_q(GROUP)} DOUBLE{stats})""")
        for i, family in enumerate(self.families):
            self._stage(i, family, progress)
        self.texts = {
            col: [t for (t,) in con.execute(f"SELECT text FROM {prefix}_{col}s ORDER BY code").fetchall()]
            for col in _CODED
        }

    def _stage(self, fam_id: int, family: str, progress) -> None:
        for unit in self.files.units(family):  # position and occurrence stay within a rank's step
            self._stage_unit(fam_id, family, unit.files, progress)

    def _stage_unit(self, fam_id: int, family: str, unit, progress) -> None:
        stats = self.family_stats[family]
        fam = _Family(self.con, family, unit, stats, texts=("shape",), numbers=("group",), headers=self.files.headers)
        fam.ordered_view()
        fam.check_cells()
        p = self.prefix
        for col in _CODED:  # codes for the texts this family adds
            known = self.con.execute(f"SELECT count(*) FROM {p}_{col}s").fetchone()[0]
            self.con.execute(f"""INSERT INTO {p}_{col}s SELECT text, {known} + row_number() OVER () - 1 FROM (
                SELECT DISTINCT COALESCE({col}, '') AS text FROM o EXCEPT SELECT text FROM {p}_{col}s)""")
        present = "".join(f", {_q(s)}" for s in fam.present)
        position, firsts = self._position()
        self.con.execute(f"""INSERT INTO {p}_staged BY NAME
            SELECT {fam_id}::SMALLINT AS fam, rank, vpp_stage, n.code AS name, step, micro_step, occurrence,
                   {position} AS position, s.code AS shape, d.code AS dtype, "group" AS {_q(GROUP)}{present}
            FROM o JOIN {p}_names n ON n.text = COALESCE(o.name, '') JOIN {p}_shapes s ON s.text = o.shape
                   JOIN {p}_dtypes d ON d.text = o.dtype{firsts}""")
        self.con.execute("DROP TABLE IF EXISTS firsts")
        if progress is not None:
            n = self.con.execute("SELECT count(*) FROM o").fetchone()[0]
            progress.update(files=len(unit), rows=n)
        self.con.execute("DROP VIEW o")
        self.con.execute("DROP TABLE IF EXISTS o1")
        self.con.execute("DROP TABLE o0")

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

    def name_rows(self) -> dict[tuple[str, str], int]:
        """(family, name) -> its number of rows."""
        found = self.con.execute(f"SELECT fam, name, count(*) FROM {self.prefix}_staged GROUP BY fam, name").fetchall()
        names = self.texts["name"]
        return {(self.families[f], names[code]): int(n) for f, code, n in found}

    def names(self) -> dict[str, list[str]]:
        """family -> its distinct names."""
        out: dict[str, list[str]] = {f: [] for f in self.families}
        for family, name in self.name_rows():
            out[family].append(name)
        return out

    def grouped(self, family: str) -> bool:
        """Whether some row of ``family`` has an optimizer param group (an ``extra:group`` value)."""
        hit = self.con.execute(
            f"SELECT 1 FROM {self.prefix}_staged WHERE fam = ? AND {_q(GROUP)} IS NOT NULL LIMIT 1",
            [self.families.index(family)],
        ).fetchone()
        return hit is not None

    def partition(self, bucket_of: Mapping[tuple[str, str], int], rows_of: Mapping[tuple[str, str], int]) -> None:
        """Keep the rows whose (family, name) has a bucket, stored in bucket order (``rows_of``:
        (family, name) -> rows, from ``name_rows``)."""
        ids = {f: i for i, f in enumerate(self.families)}
        code = {name: i for i, name in enumerate(self.texts["name"])}
        p = self.prefix
        engine._fill(
            self.con,
            f"{p}_bk",
            {"fam": "SMALLINT", "name": "INTEGER", "bucket": "INTEGER"},
            [(ids[f], code[name], k) for (f, name), k in bucket_of.items() if f in ids],
        )
        select = f"SELECT s.*, b.bucket FROM {p}_staged s JOIN {p}_bk b USING (fam, name)"
        self.con.execute(f"CREATE OR REPLACE TEMP TABLE {p}_rows AS {select} LIMIT 0")
        # One sort of the whole run needs memory that grows with it (DuckDB ran out of a 256 MB cap
        # sorting 100.8M rows): sort runs of consecutive buckets of about SORT_ROWS rows, appended in
        # order, so the table is still in bucket order and each sort is bounded.
        for lo, hi in _sort_runs(bucket_of, rows_of, SORT_ROWS):
            self.con.execute(f"INSERT INTO {p}_rows {select} WHERE b.bucket BETWEEN {lo} AND {hi} ORDER BY b.bucket")
        self.con.execute(f"DROP TABLE {p}_staged")

    def bucket(self, k: int) -> RunTable:
        """Bucket ``k`` as a run table (``load_run``'s columns); ``family_stats`` holds the families
        with rows in it."""
        frame = self.con.execute(f"SELECT * EXCLUDE (bucket) FROM {self.prefix}_rows WHERE bucket = ?", [k]).fetchdf()
        fam = frame.pop("fam").to_numpy(dtype=np.int64)
        numels = numel_column(pd.Series(self.texts["shape"], dtype=object)).to_numpy(dtype=float)
        frame["numel"] = numels[frame["shape"].to_numpy(dtype=np.int64)]
        for col in _CODED:
            frame[col] = _texts(self.texts[col], frame[col].to_numpy(dtype=np.int64))
        frame["rank"] = frame["rank"].astype(np.int64)
        frame["family"] = _texts(self.families, fam)
        frame["phase"] = _texts([phase_of(f) for f in self.families], fam)
        phases = [phase_of(f) for f in self.families]
        frame["flow"] = np.asarray([PHASES.index(p) for p in phases], dtype=np.int64)[fam]
        frame["family_order"] = fam  # families are staged in flow order (``run_files``)
        frame = frame.sort_values(list(FLOW_KEYS), kind="mergesort", ignore_index=True)
        present = {self.families[i] for i in np.unique(fam)}
        return RunTable(
            path=self.files.path,
            frame=frame,
            family_stats={f: s for f, s in self.family_stats.items() if f in present},
            families_on_disk=self.files.families_on_disk,
            ranks_on_disk=self.files.ranks_on_disk,
        )


def _texts(texts: list[str], codes: np.ndarray) -> pd.Series:
    # Python strings shared by every row (object dtype): converting each bucket's strings into a
    # new Arrow string column would cost time and memory that the Arrow pool keeps.
    return pd.Series(np.asarray(texts, dtype=object)[codes], dtype=object)


def pack_buckets(rows_of_key: Mapping[str, int], rows_per_bucket: int = 0) -> dict[str, int]:
    """key -> bucket: keys in sorted order, a new bucket once one would pass ``rows_per_bucket``
    (a key bigger than that gets a bucket of its own)."""
    limit = rows_per_bucket or ROWS_PER_BUCKET
    out: dict[str, int] = {}
    bucket, filled = 0, 0
    for key in sorted(rows_of_key):
        n = rows_of_key[key]
        if filled and filled + n > limit:
            bucket, filled = bucket + 1, 0
        out[key] = bucket
        filled += n
    return out


def _sort_runs(
    bucket_of: Mapping[tuple[str, str], int], rows_of: Mapping[tuple[str, str], int], limit: int
) -> list[tuple[int, int]]:
    """Consecutive bucket ranges (first, last) of about ``limit`` rows each (a bigger bucket alone)."""
    rows: dict[int, int] = {}
    for key, k in bucket_of.items():
        rows[k] = rows.get(k, 0) + rows_of.get(key, 0)
    return consecutive_runs(sorted(rows.items()), limit)


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


def _rows_by_key(counts: Mapping[tuple[str, str], int], key_of: Mapping[tuple[str, str], str | None]) -> dict[str, int]:
    """Rows per bucket key, from rows per (family, name) and each one's key (None: left out)."""
    out: dict[str, int] = {}
    for pair, n in counts.items():
        key = key_of[pair]
        if key is not None:
            out[key] = out.get(key, 0) + n
    return out


def buckets(bucket_of: Mapping[str, int]) -> Iterator[int]:
    """The bucket numbers in use, in order."""
    yield from sorted(set(bucket_of.values()))


# ----------------------------------------------------------------------------- the commands


def engine_ranks(files: RunFiles, *, rows_per_bucket: int = 0, threads: int | None = None, progress=None, **checks):
    """``ranks.check_ranks`` of the run's files, one bucket of names at a time (same issues, same order)."""
    from trainmon.diagnosis.ranks import check_ranks, issue_order

    issues = []
    with Engine(threads) as con:
        run = StagedRun(con, files, "r", progress=progress)
        counts = run.name_rows()
        bucket_of = pack_buckets(_rows_by_key(counts, {key: key[1] for key in counts}), rows_per_bucket)
        run.partition({key: bucket_of[key[1]] for key in counts}, counts)
        for k in buckets(bucket_of):
            issues += check_ranks(run.bucket(k), ranks=files.ranks, **checks)
    return sorted(issues, key=issue_order)
