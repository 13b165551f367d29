"""``trainmon csv2tb``: turn a run's CSV (or Parquet) files into TensorBoard event files.

Every family of every rank is converted, each read once from one format: a family written in
both formats (``"format": ["csv", "parquet"]``) is read from its Parquet files when they hold
every window its CSV files hold, else from its CSV files (``runs.family_files``, the rule every
command follows); a ``.parquet`` file is never read as CSV.  Each family is converted
(activations with their micro-steps, comm with its extra columns) into
``<run>/tensorboard/rank<R>/`` -- the directory and tags the native ``tensorboard`` format uses
(:mod:`trainmon.output.tb_tags`), so the two are interchangeable.
With ``-o DIR`` the events go to ``DIR/<run_id>/rank<R>/`` instead.  The tag layout is the
native sink's (``--tags summary`` by default, ``--tags per_tensor``, ``--names``), with the same
histograms, step loss, custom-scalars layout and HParams record, and each step's events carry
the wall time the run recorded for it (``rank<R>/step_times.tsv``; the conversion's time for runs
written before step times were recorded).

Re-running never duplicates: a rank's converted events are one file with a fixed name,
written under a temporary name and moved over the previous one in one rename.  A rank whose
directory already holds native events (the run wrote ``format: tensorboard``) is skipped,
because converting would show every value twice; ``-o`` converts it elsewhere.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain, pairwise
from pathlib import Path

from trainmon.errors import DamagedFileError
from trainmon.output.runs import (
    FAMILY_STATS,
    FamilyFile,
    column_roles,
    family_files,
    find_runs,
    rank_dirs,
    rank_of,
    read_family_file,
    step_times,
)
from trainmon.output.tb_tags import (
    PER_ROW_FAMILIES,
    TAG_LAYOUTS,
    TB_DIRNAME,
    NameFilter,
    TensorBoardSettings,
    series_name,
)

HELP = "convert the CSV or Parquet files of a run (or of every run of an output dir) into TensorBoard event files"

CONVERTED_NAME = "events.out.tfevents.trainmon-csv2tb"
_TMP_PREFIX = ".csv2tb-"
PROGRESS_DELAY_S = 1.0  # the bar appears only on conversions that take longer than this

__all__ = ["HELP", "add_arguments", "run", "convert_rank", "RankResult", "CONVERTED_NAME", "native_event_files"]


def add_arguments(parser) -> None:
    parser.add_argument(
        "path",
        type=Path,
        metavar="RUN_OR_OUTPUT_DIR",
        help="a run directory (holding rank<R>/), one rank<R>/ of a run, or a directory of runs",
    )
    parser.add_argument(
        "-o",
        "--output",
        type=Path,
        metavar="DIR",
        help="write events to DIR/<run_id>/rank<R>/ instead of <run>/tensorboard/rank<R>/",
    )
    parser.add_argument(
        "--tags",
        choices=TAG_LAYOUTS,
        default="summary",
        help='tag layout, as the native sink\'s "tensorboard": {"tags": ...} (default: summary: a few '
        "series per family and statistic plus histograms; per_tensor: one series per tensor and statistic)",
    )
    parser.add_argument(
        "--names",
        action="append",
        default=[],
        metavar="PATTERN",
        help="with --tags summary, also one series per statistic for the tensors matching this glob "
        "(e.g. 'layers.0.*'); repeatable",
    )
    parser.add_argument("--no-histograms", action="store_true", help="no histograms of the per-tensor values")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


@dataclass
class RankResult:
    rank_dir: Path
    target: Path
    files: int = 0
    rows: int = 0
    scalars: int = 0
    skipped: str = ""  # why nothing was written, if so
    unreadable: list[str] = field(default_factory=list)


def native_event_files(directory: Path) -> list[Path]:
    """Event files in ``directory`` that csv2tb did not write."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if "tfevents" in p.name and p.name != CONVERTED_NAME and p.is_file())


def _targets(runs: list[Path], output: Path | None) -> list[tuple[Path, Path]]:
    jobs: list[tuple[Path, Path]] = []
    for run_dir in runs:
        base = run_dir / TB_DIRNAME if output is None else output / run_dir.name
        jobs.extend((rank, base / rank.name) for rank in rank_dirs(run_dir))
    return jobs


def run(args) -> int:
    from trainmon.cli import CommandError

    try:
        runs = find_runs(args.path)
    except OSError as exc:
        raise CommandError(str(exc)) from None
    if args.output is not None and args.output.exists() and not args.output.is_dir():
        raise CommandError(f"{args.output}: not a directory")
    if runs:
        jobs = _targets(runs, args.output)
    elif rank_of(args.path) is not None and family_files(args.path):  # one rank of a run
        run_dir = args.path.resolve().parent
        base = run_dir / TB_DIRNAME if args.output is None else args.output / run_dir.name
        runs, jobs = [run_dir], [(args.path, base / args.path.name)]
    else:
        raise CommandError(f"{args.path}: no trainmon run here (a run directory holds rank<R>/ directories)")
    try:
        settings = TensorBoardSettings(tags=args.tags, names=tuple(args.names), histograms=not args.no_histograms)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    total = sum(f.path.stat().st_size for rank, _ in jobs for fs in family_files(rank).values() for f in fs)
    started = time.perf_counter()
    results = []
    with _progress(total, disable=args.no_progress) as bar:
        for rank, target in jobs:
            try:
                results.append(convert_rank(rank, target, progress=bar.update, settings=settings))
            except OSError as exc:
                raise CommandError(f"cannot write {target}: {exc.strerror or exc}") from None
    _report(results, len(runs), time.perf_counter() - started)
    return 2 if any(r.unreadable for r in results) else 0  # bad input, as every command


def _progress(total: int, disable: bool):
    from tqdm import tqdm

    # disable=None: no bar when stderr is not a terminal (logs, CI)
    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc="csv2tb",
        file=sys.stderr,
        disable=True if disable else None,
        delay=PROGRESS_DELAY_S,
        leave=False,
    )


def _report(results: list[RankResult], n_runs: int, seconds: float) -> None:
    done = [r for r in results if not r.skipped]
    for r in results:
        if r.skipped:
            print(f"{r.rank_dir}: skipped: {r.skipped}")
        for problem in r.unreadable:
            print(f"trainmon csv2tb: warning: {problem}", file=sys.stderr)
    scalars = sum(r.scalars for r in done)
    rate = f", {scalars / seconds:,.0f} scalars/s" if seconds > 0 and scalars else ""
    where = sorted({str(r.target.parent) for r in done})
    print(
        f"converted {len(done)} rank(s) of {n_runs} run(s): {sum(r.files for r in done)} family files, "
        f"{sum(r.rows for r in done):,} rows, {scalars:,} scalars in {seconds:.1f} s{rate}"
        + (f" -> {', '.join(where)}" if where else "")
    )


def convert_rank(
    rank_dir: Path,
    target: Path,
    *,
    progress: Callable[[int], object] | None = None,
    settings: TensorBoardSettings | None = None,
) -> RankResult:
    """Convert every family of one rank dir into ``target/CONVERTED_NAME`` (replacing it), in the
    tag layout of ``settings`` (default: the native sink's default, ``summary``)."""
    from trainmon.sinks.tensorboard import EventFile

    rank_dir, target = Path(rank_dir), Path(target)
    result = RankResult(rank_dir, target)
    families = family_files(rank_dir)
    files = [f for fs in families.values() for f in fs]
    if not files:
        result.skipped = "no family files"
        return result
    native = native_event_files(target)
    if native:
        result.skipped = (
            f"{target} already holds native TensorBoard events ({native[0].name}); use -o DIR to convert anyway"
        )
        _advance(progress, files)
        return result
    target.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(target)
    tmp = target / f"{_TMP_PREFIX}{os.getpid()}.tmp"  # no "tfevents" in it: TensorBoard ignores it
    times = step_times(rank_dir)
    now = time.time()
    events = EventFile(tmp, wall_time=min(times.values(), default=now))
    try:
        converter = _Converter(events, settings or TensorBoardSettings(), times, now)
        for f in files:
            converter.convert_file(f, result)
            _advance(progress, [f])
        converter.finish(rank_dir.parent)
        events.close(sync=True)
        os.replace(tmp, target / CONVERTED_NAME)
    except BaseException:
        events.close(sync=False)
        tmp.unlink(missing_ok=True)
        raise
    return result


def _advance(progress, files: list[FamilyFile]) -> None:
    if progress is not None:
        progress(sum(f.path.stat().st_size for f in files))


def _remove_stale_temps(target: Path) -> None:
    for p in target.glob(f"{_TMP_PREFIX}*.tmp"):
        p.unlink(missing_ok=True)  # left by a conversion that was killed


class _Converter:
    """Writes the events of one rank's files into one event file, in the tag layout of
    ``settings`` (the native sink's), each step stamped with the run's recorded time."""

    def __init__(self, events, settings: TensorBoardSettings, times: dict[int, float], now: float):
        from trainmon.sinks.tensorboard import SummaryEncoder

        self.events = events
        self.settings = settings
        self.times, self.now = times, now
        self.summary = SummaryEncoder(settings.histograms)
        self.names = NameFilter(settings.names)
        self.ops_of: dict[str, tuple[str, ...]] = {}
        self.first_step: int | None = None
        self._heads: dict[tuple, dict[tuple, list[bytes]]] = {}

    def wall_time(self, step: int) -> float:
        """When the run recorded ``step`` (``step_times.tsv``); the conversion's time for runs
        written before trainmon recorded times."""
        return self.times.get(step, self.now)

    def convert_file(self, f: FamilyFile, result: RankResult) -> None:
        import pandas as pd

        try:
            df = read_family_file(f)  # by its extension: CSV or Parquet, validated
        except DamagedFileError as exc:  # names the file, line (or row) and column itself
            result.unreadable.append(f"{exc}; skipped")
            return
        except (OSError, ValueError, UnicodeDecodeError, pd.errors.ParserError) as exc:
            result.unreadable.append(f"{f.path}: unreadable, skipped ({str(exc).splitlines()[0]})")
            return
        result.files += 1
        if "step" not in df.columns or "name" not in df.columns:
            return
        keys = [c for c in ("vpp_stage", "step", "micro_step") if c in df.columns]
        df = df.dropna(subset=keys)  # a row without its step cannot be placed (never from trainmon)
        if df.empty:
            return
        roles = column_roles(df, FAMILY_STATS)
        if not roles.stats:
            return
        self._write(f.family, df.reset_index(drop=True), roles)
        result.rows += len(df)
        result.scalars += len(df) * len(roles.stats)

    def _write(self, family: str, df, roles) -> None:
        import numpy as np
        import pandas as pd

        from trainmon.sinks.tensorboard import shape_numel

        known = self.ops_of.get(family, ())
        self.ops_of[family] = (*known, *(op for op in roles.stats if op not in known))
        # a cell that is not a number becomes NaN, as in the native sink
        values = df[list(roles.stats)].apply(pd.to_numeric, errors="coerce").to_numpy(dtype=np.float64)
        steps = df["step"].to_numpy(dtype=np.int64)
        summarized = not self.settings.per_tensor and family not in PER_ROW_FAMILIES
        per_row = self._per_row_bodies(family, df, roles, values, summarized)
        numels = None
        if family == "grad_probe" and "shape" in df.columns:
            numels = np.array([shape_numel(s) for s in df["shape"].tolist()], dtype=np.float64)
        loss_col = roles.stats.index("loss") if family == "loss" and "loss" in roles.stats else None
        cuts = [0, *(np.flatnonzero(np.diff(steps)) + 1).tolist(), len(steps)]
        for a, b in pairwise(cuts):
            step = int(steps[a])
            parts = [per_row.get(step, b"")]
            if summarized:
                parts.append(
                    self.summary.family(family, roles.stats, values[a:b], None if numels is None else numels[a:b])
                )
            if loss_col is not None:
                parts.append(self.summary.step_loss(values[a:b, loss_col].tolist()))
            self.events.write_event(step, self.wall_time(step), b"".join(parts))
            self.first_step = step if self.first_step is None else min(self.first_step, step)

    def _per_row_bodies(self, family: str, df, roles, values, summarized: bool) -> dict[int, bytes]:
        """Step -> the bytes of one series per (row, statistic) of the rows written that way:
        every row in the per-tensor layout and of the few-row families, else the rows ``names``
        selects."""
        import numpy as np

        if summarized:
            if not self.names:
                return {}
            names = df["name"].astype(str)
            hits = {n: self.names(n) for n in names.unique()}
            mask = names.map(hits).to_numpy(dtype=bool)
            if not mask.any():
                return {}
            df, values = df[mask], values[mask]
        width = len(roles.stats)
        heads = self._row_heads(family, df, roles)
        with np.errstate(over="ignore"):  # beyond float32's range is +-inf, as in the native sink
            raw = values.astype("<f4").tobytes()
        steps = df["step"].to_numpy(dtype=np.int64)
        cuts = [0, *(np.flatnonzero(np.diff(steps)) + 1).tolist(), len(steps)]
        out: dict[int, bytes] = {}
        for a, b in pairwise(cuts):
            chunks = [raw[i : i + 4] for i in range(a * width * 4, b * width * 4, 4)]
            body = b"".join(chain.from_iterable(zip(chain.from_iterable(heads[a:b]), chunks)))
            out[int(steps[a])] = out.get(int(steps[a]), b"") + body
        return out

    def finish(self, run_dir: Path) -> None:
        """The run's HParams record and custom-scalars layout (as the native sink writes them)."""
        from trainmon.sinks.tensorboard import custom_scalars_value, hparams_value

        if self.first_step is None:
            return
        wall = self.wall_time(self.first_step)
        hparams = hparams_value(run_dir, wall)
        if hparams is not None:
            self.events.write_event(self.first_step, wall, hparams)
        self.events.write_event(self.first_step, wall, custom_scalars_value(self.ops_of))

    def _row_heads(self, family: str, df, roles) -> list[list[bytes]]:
        """Value prefixes of each row's statistics, in ``roles.stats`` order."""
        from trainmon.sinks.tensorboard import row_prefixes

        cache = self._heads.setdefault((family, roles.stats), {})
        n = len(df)
        columns = [
            df["vpp_stage"].tolist() if "vpp_stage" in df.columns else [0] * n,
            df["name"].tolist(),
            df["micro_step"].tolist() if "micro_step" in df.columns else [None] * n,
            *(df[c].tolist() for c in roles.extras),
        ]
        out = []
        for key in zip(*columns):
            heads = cache.get(key)
            if heads is None:
                vpp, name, micro, *extra = key
                micro = None if micro is None or micro != micro else int(micro)  # NaN: no micro-step
                series = series_name(int(vpp), str(name), zip(roles.extras, extra), micro)
                heads = cache[key] = row_prefixes(family, series, roles.stats)
            out.append(heads)
        return out
