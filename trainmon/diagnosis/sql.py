"""The engine's SQL toolkit: how a run's family files are read into DuckDB, and the few helpers
every engine module writes its SQL with.

* :func:`quote` / :func:`literal`: an identifier / a text value, safely quoted for SQL
  (``output.sql_text``, which ``trainmon.load_run`` shares);
* :func:`fill_table`: a temp table holding Python rows, in one statement;
* :class:`Family`: the SQL of one family's files (CSV typed, with the bad-cell check, or
  Parquet natively): the view ``o`` of its rows with rank, row order ``g``, ``occurrence`` and
  numeric stats, which ``engine_buckets`` stages and ``engine_compare`` aligns;
* :data:`POSITION`: a row's ``position`` in its rank's (step, micro_step), as the reader numbers it;
* :data:`FILES_PER_READ`: files one read statement scans at most.

Training-flow order: each row's place ``g`` in the files' row order is its Parquet file's place
and row number in it, or for CSV the ``rowid`` of the table the files were read into in order
(DuckDB keeps it while ``preserve_insertion_order`` is on): each row's ``position`` and
``occurrence`` follow the order the sinks wrote (files grouped by header as ``output.runs``
reads them, then in order).  A stat cell holding text that is not a number
is a :class:`~trainmon.output.cells.BadCellError` naming the file, line and column.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from trainmon.errors import DamagedFileError
from trainmon.output import runs
from trainmon.output.cells import NAN_SPELLINGS, BadCellError
from trainmon.output.layout import FamilyFile
from trainmon.output.sql_text import FILES_PER_READ, literal, quote

__all__ = [
    "quote",
    "literal",
    "fill_table",
    "Family",
    "POSITION",
    "FILES_PER_READ",
    "chunks",
    "header_of",
    "header_and_rows",
]

# A row's ``position`` (index in its rank's (step, micro_step), file order), as the reader numbers it.
POSITION = "row_number() OVER (PARTITION BY rank, step, micro_step ORDER BY g) - 1"


# Key columns written as integers; read as numbers and cast, like the stats.
INT_COLUMNS = ("step", "micro_step", "vpp_stage")
TAIL_COLUMNS = ("shape", "dtype")


class Family:
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
            groups.setdefault(header or header_of(f) or (), []).append(str(f.path))
        cols = {c for header in groups for c in header}
        self.micro = "micro_step" in cols
        self.present = [s for s in self.stats if s in cols]
        self.groups, self.cols, self.texts, self.numbers = groups, cols, tuple(texts), tuple(numbers)
        # Each file's rank and its place in the read order (headers' groups in order, files in order).
        self.file_no = {p: i for i, p in enumerate(p for paths in groups.values() for p in paths)}
        files_of = [(p, rank, self.file_no[p]) for p, rank in self.rank_of.items()]
        fill_table(con, "ranks_of", {"filename": "VARCHAR", "rank": "INTEGER", "file_no": "BIGINT"}, files_of)
        # CSV is first read with its numeric columns typed (DuckDB's parser, the one TRY_CAST uses:
        # about 2x faster than text plus casts); a file with any cell that parser rejects is read
        # again as text (``_views(typed=False)``), where a bad stat cell is named exactly.
        self.typed = not self.parquet
        # ``extra`` columns (a comm call, a param group): part of a row's key when looking for
        # repeated keys (``duplicates``).
        self.extras = [
            c for c in sorted(cols) if c not in runs.KEY_COLUMNS and c not in self.stats and c not in TAIL_COLUMNS
        ]
        self.duplicates: tuple | None = None  # (rows beyond the first of their key, first key..., copies)
        # No views yet: ``_read`` makes them per batch of files (binding a read of many files
        # costs ~20 ms a view; made here too, they were 12% of staging a 1M-row run).

    def _views(self, sources: Sequence[str] | None = None, offset: int = 0) -> None:
        """The views ``raw`` (the rows of ``sources``, some of ``_batches()``: the first by
        default, numbered in order from ``offset``) and ``t`` (their columns as the commands read
        them)."""
        con, cols, texts, numbers = self.con, self.cols, self.texts, self.numbers
        # One scan per header (``output.runs``' grouping, in its order); no sniffing: the
        # columns are known.  UNION ALL keeps each scan's row order.
        source = " UNION ALL BY NAME ".join(self._batches()[0] if sources is None else sources)
        num = ",\n".join(f"{self._num(s)} AS {quote(s)}" for s in self.present)
        micro = self._int("micro_step") if self.micro else "-1"
        carried = [f"COALESCE(CAST({quote(c)} AS VARCHAR), '')" if c in cols else "''" for c in texts]
        carried = [f"{sql} AS {quote(c)}" for sql, c in zip(carried, texts)]
        carried += [f"{self._num(c)} AS {quote(c)}" if c in cols else f"NULL::DOUBLE AS {quote(c)}" for c in numbers]
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
        return "hash(" + ", ".join(f"CAST({quote(c)} AS VARCHAR)" for c in self.extras) + ")"

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
        """One scan per header (``output.runs``' grouping, in its order) and per run of at
        most ``FILES_PER_READ`` of its files, with its number of files.  Typed CSV: one per header
        and rank, in the same order, each with its rank as a constant instead of the file name on
        every row (storing the name was a third of the read).  Each scan has every column of the
        family (NULL where its header lacks one), so any batch of scans has them all."""
        out = []
        for header, paths in self.groups.items():
            pad = self._padding(header)
            if self._numbered == "text":
                out += [(f"SELECT *{pad} FROM {self._scan(header, p, limit=n)}", len(p)) for p, n in self._reads(paths)]
            elif self._numbered == "parquet":  # each file's number in the read order, not its name on every row
                for p in chunks(paths):
                    number = f"{self.file_no[p[0]]} + file_index AS file_no"
                    out.append((f"SELECT {number}, *{pad} FROM {self._scan(header, p)}", len(p)))
            else:
                for rank, run in itertools.groupby(paths, key=self.rank_of.__getitem__):
                    out += [
                        (f"SELECT {int(rank)} AS rank, *{pad} FROM {self._scan(header, p, False, n)}", len(p))
                        for p, n in self._reads(list(run))
                    ]
        return out

    @staticmethod
    def _reads(paths: list[str]) -> list[tuple[list[str], int | None]]:
        """``chunks(paths)``, except that a CSV file whose last line was cut short (a run killed
        while writing) is read alone, up to its last whole row (``runs.whole_rows``: the reader's
        rule and warning): a cut row's numbers may be cut too."""
        out: list[tuple[list[str], int | None]] = []
        whole: list[str] = []
        for path in paths:
            rows = runs.whole_rows(path)
            if rows is None:
                whole.append(path)
                continue
            out += [(p, None) for p in chunks(whole)] + [([path], rows)]
            whole = []
        return out + [(p, None) for p in chunks(whole)]

    def _padding(self, header: tuple[str, ...]) -> str:
        """``, NULL AS <column>`` for each column of the family that ``header`` lacks."""
        numeric = {*self.present, *self.numbers, *INT_COLUMNS} if self._numbered != "text" else set()
        missing = [c for c in sorted(self.cols) if c not in header]
        return "".join(f", NULL::{'DOUBLE' if c in numeric else 'VARCHAR'} AS {quote(c)}" for c in missing)

    def _scan(self, header: tuple[str, ...], paths: list[str], filename: bool = True, limit: int | None = None) -> str:
        if limit is not None:  # the whole rows of a file cut short (``_reads``)
            return f"(SELECT * FROM {self._scan(header, paths, filename)} LIMIT {int(limit)})"
        listing = "[" + ", ".join(literal(p) for p in paths) + "]"
        if self.parquet:
            return f"read_parquet({listing}, file_row_number=true)"
        # Typed: the numeric columns as DOUBLE, rejected cells recorded (``reject_errors``).  Text:
        # every column as text, so that a stat cell that is not a number is an error, not NULL.
        numeric = {*self.present, *self.numbers, *INT_COLUMNS} if self.typed else set()
        columns = (
            "{" + ", ".join(f"{literal(c)}: {literal('DOUBLE' if c in numeric else 'VARCHAR')}" for c in header) + "}"
        )
        return (
            f"read_csv({listing}, filename={str(filename).lower()}, header=true, auto_detect=false, columns={columns}, "
            "delim=',', quote='\"', escape='\"', null_padding=false" + (", store_rejects=true)" if self.typed else ")")
        )

    def _int(self, col: str) -> str:
        if self.parquet or self.typed:
            return f"CAST({quote(col)} AS BIGINT)"
        return f"CAST(TRY_CAST({quote(col)} AS DOUBLE) AS BIGINT)"

    def _num(self, col: str) -> str:
        if self.parquet or self.typed:
            return f"CAST({quote(col)} AS DOUBLE)"
        return f"TRY_CAST(trim({quote(col)}) AS DOUBLE)"

    def _bad_text(self) -> str:
        """True for a row with a stat cell holding text other than a number (CSV read as text)."""
        if self.parquet or self.typed or not self.present:
            return "false"
        nan = ", ".join(literal(s) for s in sorted(NAN_SPELLINGS))
        return " OR ".join(
            f"({quote(s)} IS NOT NULL AND trim({quote(s)}) NOT IN ({nan}) "
            f"AND TRY_CAST(trim({quote(s)}) AS DOUBLE) IS NULL)"
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
            f"SELECT {', '.join(quote(s) for s in present)} FROM {self._scan(header, [filename])} "
            f"LIMIT 1 OFFSET {int(g - first)}"
        ).fetchone()
        for col, text in zip(present, row):
            if text is not None and text.strip() not in NAN_SPELLINGS:
                try:
                    float(text.strip())
                except ValueError:
                    raise BadCellError(filename, 2 + g - first, col, text) from None

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


def chunks(paths: Sequence[str]) -> list[list[str]]:
    """``paths`` in runs of at most ``FILES_PER_READ``, in order."""
    return [list(paths[i : i + FILES_PER_READ]) for i in range(0, len(paths), FILES_PER_READ)]


def fill_table(con, table: str, columns: Mapping[str, str], rows: Sequence[tuple]) -> None:
    """The temp table ``table`` (``columns``: name -> SQL type) holding ``rows``, in one statement:
    ``executemany`` runs one statement per row (~0.1 ms each, seconds for thousands of rows)."""
    schema = ", ".join(f"{quote(c)} {t}" for c, t in columns.items())
    con.execute(f"CREATE OR REPLACE TEMP TABLE {table}({schema})")
    if rows:
        lists = [list(col) for col in zip(*rows)]
        con.execute(f"INSERT INTO {table} SELECT " + ", ".join(f"unnest(?::{t}[])" for t in columns.values()), lists)


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
            # ``output.runs``' words for an empty file (``output.runs``): one message per damage
            raise DamagedFileError(
                f.path, "empty file (0 bytes): no header and no rows" if size == 0 else "empty file (no header)"
            )
        first = fh.readline()
        if not first.strip():
            return 0
        return max(1, round((os.fstat(fh.fileno()).st_size - len(header)) / len(first)))


def header_and_rows(f: FamilyFile) -> tuple[tuple[str, ...], int] | None:
    """The columns of a file that holds rows and its number of rows (exact for Parquet, estimated
    for CSV); None: no rows.  A CSV file is checked whole here (``runs.file_header``: NUL bytes,
    UTF-8, trainmon's header), once: the engine then reads it."""
    if f.ext == "parquet":
        n, columns = _parquet_rows_and_columns(f)
        return (tuple(columns), n) if n > 0 else None
    n = _csv_rows(f)
    return (tuple(runs.file_header(Path(f.path))), n) if n else None


def header_of(f: FamilyFile) -> tuple[str, ...] | None:
    """The columns of a file that holds rows (None: no rows)."""
    found = header_and_rows(f)
    return None if found is None else found[0]
