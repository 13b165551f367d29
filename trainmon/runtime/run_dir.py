"""Where a run's files go: ``$MONITOR_OUTPUT_DIR/<run_id>/rank<R>/``.

All ranks of one run share ``<run_id>``: rank 0 claims it (a local timestamp, suffixed
``-1``, ``-2``, ... when another run took it, or ``$TRAINMON_RUN_ID``) and the others receive it
through the process group.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from trainmon.core import dist as _dist
from trainmon.output.layout import RUN_META, FamilyFile, parse_family_file, rank_dir_name

__all__ = [
    "output_root",
    "create_run_dir",
    "rank_dir",
    "record_stats_path",
    "append_to_meta",
    "highest_recorded_step",
    "first_step",
]

log = logging.getLogger(__name__)


def output_root() -> Path:
    return Path(os.environ.get("MONITOR_OUTPUT_DIR") or "./monitor_output")


RUN_ID_ENV = "TRAINMON_RUN_ID"


def _timestamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def run_id_problem(run_id: str) -> str | None:
    """Why ``run_id`` cannot name a folder directly under the output root, or None.  A chosen id
    is one path component: a separator or ``..`` would write outside the output folder."""
    if not run_id.strip():
        return "is empty"
    if run_id in (".", ".."):
        return f"is {run_id!r}"
    bad = [c for c in ("/", "\\", os.sep, os.altsep or "/", "\0") if c in run_id]
    if bad:
        return f"contains {bad[0]!r}; it must be one folder name (no path separators)"
    return None


def _make_run_dir(root: Path) -> str:
    """Create ``root/<run_id>`` and return the id.  A chosen ``$TRAINMON_RUN_ID`` may be reused on
    purpose (a resumed run appends); a timestamp id is claimed with an atomic ``mkdir``, so runs
    started in the same second get ``-1``, ``-2``, ... and never share a folder."""
    root.mkdir(parents=True, exist_ok=True)
    chosen = os.environ.get(RUN_ID_ENV)
    if chosen:
        problem = run_id_problem(chosen)
        if problem is None:
            (root / chosen).mkdir(exist_ok=True)
            return chosen
        log.warning("trainmon: %s=%r %s; using a timestamp run id instead", RUN_ID_ENV, chosen, problem)
    base = _timestamp()
    for k in range(100_000):
        run_id = base if k == 0 else f"{base}-{k}"
        try:
            (root / run_id).mkdir()
        except FileExistsError:
            continue
        return run_id
    raise OSError(f"no free run id {base}-<k> under {root}")


def create_run_dir(root: Path, group: Any = None, meta: dict | None = None) -> Path | None:
    """Agree on the run dir across ranks and create it; None (after one warning) if unwritable.

    Rank 0 claims the folder and broadcasts its id, so all ranks of one job share it and no two
    jobs do.  This is a collective when torch.distributed is initialized: every rank must call it.
    """
    run_id = None
    if _dist.rank(group) == 0:
        try:
            run_id = _make_run_dir(root)
            _write_meta(root / run_id, meta or {}, run_id)
        except OSError as exc:
            log.warning(
                "trainmon: cannot create output directory under %s (%s); nothing will be recorded, training continues",
                root,
                exc,
            )
            run_id = None
    run_id = _dist.broadcast_object(run_id, group)
    return None if run_id is None else root / run_id


def _write_meta(run_dir: Path, meta: dict, run_id: str) -> None:
    info = {"run_id": run_id, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **meta}
    (run_dir / RUN_META).write_text(json.dumps(info, indent=1, default=str) + "\n")


def record_stats_path(run_dir: Path, paths: dict[str, str]) -> None:
    """Add ``"stats_path"`` (device type -> statistics path, e.g. ``{"cuda": "device"}``) to
    run.json, so a reader can see what produced the numbers.  Known only once tensors were seen,
    hence written at the first finished step; rewritten atomically (a reader never sees half a
    file).  A failure is a warning: the run goes on."""
    meta_path = run_dir / RUN_META
    try:
        info = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        info["stats_path"] = dict(sorted(paths.items()))
        tmp = meta_path.with_name(f".{RUN_META}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(info, indent=1, default=str) + "\n")
        os.replace(tmp, meta_path)
    except (OSError, ValueError) as exc:
        log.warning("trainmon: cannot record the statistics path in %s (%s)", meta_path, exc)


def append_to_meta(run_dir: Path, key: str, entry: dict) -> bool:
    """Append ``entry`` to the list ``key`` of ``run.json``, atomically (a reader sees the old file or
    the new one, never half of one).  Rank 0 only; False (after a warning) when it cannot."""
    path = run_dir / RUN_META
    try:
        info = json.loads(path.read_text()) if path.exists() else {}
        if not isinstance(info, dict):
            info = {}
        info.setdefault(key, []).append(entry)
        tmp = path.with_name(f".{RUN_META}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(info, indent=1, default=str) + "\n")
        os.replace(tmp, path)
        return True
    except (OSError, ValueError) as exc:
        log.warning("trainmon: cannot record %s in %s (%s); training continues", key, path, exc)
        return False


def rank_dir(run_dir: Path, rank: int) -> Path | None:
    path = run_dir / rank_dir_name(rank)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.warning(
            "trainmon: cannot create %s (%s); nothing will be recorded on this rank, training continues", path, exc
        )
        return None
    return path


_TAIL_BYTES = 64 * 1024


def highest_recorded_step(path: Path) -> int | None:
    """The highest step whose rows are in the family files of the rank folder ``path`` (None: none).

    Cheap on a long run: the file names give the last step window; only the files of that window
    are looked into, a CSV by its last rows (rows are appended in step order) and a Parquet file by
    its footer's statistics.  A file whose last step cannot be read counts as its whole window, so
    the result is never below a step on disk."""
    try:
        files = [f for f in map(parse_family_file, path.iterdir()) if f is not None]
    except OSError:
        return None
    if not files:
        return None
    last = max(f.start for f in files)
    return max(_last_step(f) for f in files if f.start == last)


def _last_step(f: FamilyFile) -> int:
    if f.end == f.start:  # a one-step window: the name says it
        return f.start
    try:
        found = _last_parquet_step(f.path) if f.ext == "parquet" else _last_csv_step(f.path)
    except (OSError, ValueError, ImportError):
        found = None
    return f.end if found is None else found


def _last_csv_step(path: Path) -> int | None:
    with open(path, "rb") as fh:
        header = next(csv.reader([fh.readline().decode("utf-8", errors="replace")]), None)
        if not header or "step" not in header:
            return None
        size = fh.seek(0, os.SEEK_END)
        fh.seek(max(0, size - _TAIL_BYTES))
        tail = fh.read().decode("utf-8", errors="replace")
    col, width = header.index("step"), len(header)
    # the last whole record: try line starts from the end (a quoted name may hold a newline)
    starts = [i + 1 for i, c in enumerate(tail) if c == "\n"][:-1]
    for start in reversed(starts):
        rows = list(csv.reader(io.StringIO(tail[start:])))
        if len(rows) == 1 and len(rows[0]) == width and rows[0][col].lstrip("-").isdigit():
            return int(rows[0][col])
    return None


def _last_parquet_step(path: Path) -> int | None:
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    meta = pq.ParquetFile(path).metadata
    names = [meta.schema.column(i).name for i in range(meta.num_columns)]
    if "step" not in names:
        return None
    col = names.index("step")
    highs = [meta.row_group(g).column(col).statistics for g in range(meta.num_row_groups)]
    if not highs or any(h is None or not h.has_min_max for h in highs):
        return None
    return int(max(h.max for h in highs))


def first_step(run_dir: Path | None, rank: int, start_iteration: int | None) -> int:
    """The step a ``set_monitor`` starts numbering at.  In a run folder that already holds this
    rank's steps (a resumed run reusing ``TRAINMON_RUN_ID``), without ``start_iteration`` the
    numbering continues after the highest step on disk, so no (name, step) is written twice; an
    explicit ``start_iteration`` is kept, with one warning if it overlaps steps on disk."""
    high = None if run_dir is None else highest_recorded_step(run_dir / rank_dir_name(rank))
    if start_iteration is None:
        if high is None:
            return 0
        log.warning(
            "trainmon: %s already holds steps up to %d of rank %d; continuing the step numbering at %d "
            "(set_monitor(..., start_iteration=N) sets it explicitly)",
            run_dir,
            high,
            rank,
            high + 1,
        )
        return high + 1
    if high is not None and start_iteration <= high:
        log.warning(
            "trainmon: start_iteration=%d overlaps steps %d..%d already recorded by rank %d in %s; "
            "those steps will have two rows per name",
            start_iteration,
            start_iteration,
            high,
            rank,
            run_dir,
        )
    return int(start_iteration)
