"""Where a run's files go: ``$MONITOR_OUTPUT_DIR/<run_id>/rank<R>/``.

All ranks of one run share ``<run_id>``: rank 0 claims it (a local timestamp, suffixed
``-1``, ``-2``, ... when another run took it, or ``$TRAINMON_RUN_ID``) and the others receive it
through the process group.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from trainmon.core import dist as _dist
from trainmon.output.layout import RUN_META, rank_dir_name

__all__ = ["output_root", "create_run_dir", "rank_dir", "record_stats_path", "append_to_meta"]

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
