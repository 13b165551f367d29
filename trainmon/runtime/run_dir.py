"""Where a run's files go: ``$MONITOR_OUTPUT_DIR/<run_id>/rank<R>/``.

All ranks of one run share ``<run_id>``: rank 0 picks it (a local timestamp, or
``$TRAINMON_RUN_ID``) and the others receive it through the process group.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from trainmon.output.layout import RUN_META, rank_dir_name
from trainmon.core import dist as _dist

__all__ = ["output_root", "create_run_dir", "rank_dir", "append_to_meta"]

log = logging.getLogger(__name__)


def output_root() -> Path:
    return Path(os.environ.get("MONITOR_OUTPUT_DIR") or "./monitor_output")


def _new_run_id(root: Path) -> str:
    base = os.environ.get("TRAINMON_RUN_ID") or time.strftime("%Y%m%d-%H%M%S")
    if os.environ.get("TRAINMON_RUN_ID"):
        return base  # a chosen id may be reused on purpose (resumed runs append)
    run_id, k = base, 1
    while (root / run_id).exists():
        run_id, k = f"{base}-{k}", k + 1
    return run_id


def create_run_dir(root: Path, group: Any = None, meta: dict | None = None) -> Path | None:
    """Agree on the run dir across ranks and create it; None (after one warning) if unwritable.

    This is a collective when torch.distributed is initialized: every rank must call it.
    """
    run_id = None
    if _dist.rank(group) == 0:
        try:
            run_id = _new_run_id(root)
            (root / run_id).mkdir(parents=True, exist_ok=True)
            _write_meta(root / run_id, meta or {}, run_id)
        except OSError as exc:
            log.warning("trainmon: cannot create output directory under %s (%s); nothing will be "
                        "recorded, training continues", root, exc)
            run_id = None
    run_id = _dist.broadcast_object(run_id, group)
    return None if run_id is None else root / run_id


def _write_meta(run_dir: Path, meta: dict, run_id: str) -> None:
    info = {"run_id": run_id, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **meta}
    (run_dir / RUN_META).write_text(json.dumps(info, indent=1, default=str) + "\n")


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
        log.warning("trainmon: cannot create %s (%s); nothing will be recorded on this rank, "
                    "training continues", path, exc)
        return None
    return path
