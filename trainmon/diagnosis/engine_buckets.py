"""A run's rows inside DuckDB, handed to Python one bucket of tensor names at a time.

``ranks`` and ``compare`` look at rows across ranks (per family, name, step) and along each
(rank, name) series over steps, never across names.  So they can run on all rows of a set of
names at a time, with their pandas logic unchanged:

1. **stage**: every family's files are read by DuckDB once (``engine._Family``: CSV as text with
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

__all__ = ["ROWS_PER_BUCKET", "Engine", "StagedRun", "pack_buckets"]

# Rows handed to Python at once (all families, ranks and steps of a set of names).
ROWS_PER_BUCKET = int(os.environ.get("TRAINMON_ENGINE_BUCKET_ROWS", "250000"))
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


class StagedRun:
    """The rows of one run's families (``files``) in the table ``<prefix>_rows``."""

    def __init__(self, con, files: RunFiles, prefix: str, *, families: Iterable[str] | None = None, progress=None):
        self.con, self.files, self.prefix = con, files, prefix
        chosen = set(files.family_stats if families is None else families)
        self.family_stats = {f: s for f, s in files.family_stats.items() if f in chosen}
        self.families = list(self.family_stats)
        self.stat_columns = list(dict.fromkeys(s for stats in self.family_stats.values() for s in stats))
        stats = "".join(f", {_q(s)} DOUBLE" for s in self.stat_columns)
        con.execute(f"""CREATE OR REPLACE TEMP TABLE {prefix}_staged (fam SMALLINT, rank INTEGER, vpp_stage BIGINT,
            name VARCHAR, step BIGINT, micro_step BIGINT, occurrence BIGINT, position BIGINT, shape VARCHAR,
            dtype VARCHAR, {_q(GROUP)} DOUBLE{stats})""")
        for i, family in enumerate(self.families):
            self._stage(i, family, progress)

    def _stage(self, fam_id: int, family: str, progress) -> None:
        stats = self.family_stats[family]
        fam = _Family(self.con, family, self.files.files[family], stats, texts=("shape",), numbers=("group",))
        fam.ordered_view()
        fam.check_cells()
        present = "".join(f", {_q(s)}" for s in fam.present)
        self.con.execute(f"""INSERT INTO {self.prefix}_staged BY NAME
            SELECT {fam_id}::SMALLINT AS fam, rank, vpp_stage, COALESCE(name, '') AS name, step, micro_step,
                   occurrence, {POSITION} AS position, shape, dtype, "group" AS {_q(GROUP)}{present}
            FROM o""")
        if progress is not None:
            n = self.con.execute("SELECT count(*) FROM o").fetchone()[0]
            progress.update(files=len(self.files.files[family]), rows=n)
        self.con.execute("DROP VIEW o")
        self.con.execute("DROP TABLE IF EXISTS o1")
        self.con.execute("DROP TABLE o0")

    def name_rows(self) -> dict[tuple[str, str], int]:
        """(family, name) -> its number of rows."""
        found = self.con.execute(f"SELECT fam, name, count(*) FROM {self.prefix}_staged GROUP BY fam, name").fetchall()
        return {(self.families[f], name): int(n) for f, name, n in found}

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

    def partition(self, bucket_of: Mapping[tuple[str, str], int]) -> None:
        """Keep the rows whose (family, name) has a bucket, stored in bucket order."""
        ids = {f: i for i, f in enumerate(self.families)}
        self.con.execute(f"CREATE OR REPLACE TEMP TABLE {self.prefix}_bk(fam SMALLINT, name VARCHAR, bucket INTEGER)")
        self.con.executemany(
            f"INSERT INTO {self.prefix}_bk VALUES (?, ?, ?)",
            [(ids[f], name, k) for (f, name), k in bucket_of.items() if f in ids],
        )
        self.con.execute(f"""CREATE OR REPLACE TEMP TABLE {self.prefix}_rows AS
            SELECT s.*, b.bucket FROM {self.prefix}_staged s JOIN {self.prefix}_bk b USING (fam, name)
            ORDER BY b.bucket""")
        self.con.execute(f"DROP TABLE {self.prefix}_staged")

    def bucket(self, k: int, *, all_families: bool = False) -> RunTable:
        """Bucket ``k`` as a run table (``load_run``'s columns); ``family_stats`` holds the families
        with rows in it, or every staged family with ``all_families``."""
        frame = self.con.execute(f"SELECT * EXCLUDE (bucket) FROM {self.prefix}_rows WHERE bucket = ?", [k]).fetchdf()
        fam = frame.pop("fam").to_numpy(dtype=np.int64)
        frame["family"] = np.asarray(self.families, dtype=object)[fam]
        phases = [phase_of(f) for f in self.families]
        frame["phase"] = np.asarray(phases, dtype=object)[fam]
        frame["flow"] = np.asarray([PHASES.index(p) for p in phases], dtype=np.int64)[fam]
        frame["family_order"] = fam  # families are staged in flow order (``run_files``)
        frame["numel"] = numel_column(frame["shape"])
        frame = frame.sort_values(list(FLOW_KEYS), kind="mergesort", ignore_index=True)
        present = set(self.families) if all_families else {self.families[i] for i in np.unique(fam)}
        return RunTable(
            path=self.files.path,
            frame=frame,
            family_stats={f: s for f, s in self.family_stats.items() if f in present},
            families_on_disk=self.files.families_on_disk,
            ranks_on_disk=self.files.ranks_on_disk,
        )


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


def buckets(bucket_of: Mapping[str, int]) -> Iterator[int]:
    """The bucket numbers in use, in order."""
    yield from sorted(set(bucket_of.values()))
