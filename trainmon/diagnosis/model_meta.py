"""The first two stages of ``trainmon compare``: model metadata and initial parameters.

Both come from ``rank<R>/model_meta.json`` (written once per rank with ``loss_alignment``; format
in ``trainmon.collectors.model_meta``).  Torch-free.  A missing file on both sides means "not
recorded" (``match`` None); an unreadable one is reported as such, never a traceback.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainmon.diagnosis.reader import ranked_dirs
from trainmon.output.layout import MODEL_META, rank_dir_name

__all__ = ["StageDifference", "read_model_meta", "meta_ranks", "diff_structure", "diff_initial"]

_INIT_OPS = ("norm", "mean", "min", "max")


@dataclass(frozen=True)
class StageDifference:
    """A difference of a stage that has no step (metadata, initial_params)."""

    stage: str
    rank: int
    name: str
    op: str
    base: Any
    target: Any
    rel_diff: float | None = None

    def describe(self) -> str:
        return f"{self.name}: {self.op} {self.base} -> {self.target}"

    def to_json(self) -> dict[str, object]:
        def plain(v: Any) -> Any:
            return v if not isinstance(v, float) or math.isfinite(v) else repr(v)

        return {
            "stage": self.stage,
            "step": None,
            "phase": "setup",
            "kind": "model_meta",
            "name": self.name,
            "rank": self.rank,
            "op": self.op,
            "base": plain(self.base),
            "target": plain(self.target),
            "rel_diff": plain(self.rel_diff),
            "micro_step": None,
            "vpp_stage": 0,
            "target_name": self.name,
        }


def meta_ranks(run_dir: Path) -> dict[int, Path]:
    """rank -> its ``model_meta.json`` path (whether or not it exists)."""
    dirs = dict(ranked_dirs(run_dir))
    if not dirs and (run_dir / rank_dir_name(0)).is_dir():
        dirs = {0: run_dir / rank_dir_name(0)}
    return {rank: d / MODEL_META for rank, d in dirs.items()}


def read_model_meta(path: Path) -> tuple[dict | None, str]:
    """(data, "") or (None, why): why is "" when the file simply is not there."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, ""
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"{path} is unreadable ({exc})"
    if not isinstance(data, dict) or not isinstance(data.get("chunks"), list):
        return None, f'{path} is not a trainmon model_meta.json (no "chunks" list)'
    return data, ""


def _entries(data: dict, key: str) -> dict[tuple[int, str], dict]:
    out = {}
    for chunk in data.get("chunks", []):
        if not isinstance(chunk, dict):
            continue
        vpp = int(chunk.get("vpp_stage", 0) or 0)
        for e in chunk.get(key, []) or []:
            if isinstance(e, dict) and "name" in e:
                out[(vpp, str(e["name"]))] = e
    return out


def _label(vpp: int, name: str) -> str:
    return f"{vpp}:{name}" if vpp else name


def diff_structure(base: dict, target: dict, rank: int) -> StageDifference | None:
    """The first structural difference: modules (name, type), then params (name, shape, dtype,
    requires_grad), in the base's model order."""
    for key, fields in (("modules", ("type",)), ("params", ("shape", "dtype", "requires_grad"))):
        b, t = _entries(base, key), _entries(target, key)
        what = "module" if key == "modules" else "param"
        for k, e in b.items():
            other = t.get(k)
            if other is None:
                return StageDifference("metadata", rank, _label(*k), f"{what} only in base", "present", "absent")
            for f in fields:
                if e.get(f) != other.get(f):
                    return StageDifference("metadata", rank, _label(*k), f, e.get(f), other.get(f))
        for k in t:
            if k not in b:
                return StageDifference("metadata", rank, _label(*k), f"{what} only in target", "absent", "present")
    return None


def _num(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def diff_initial(
    base: dict, target: dict, rank: int, rtol: float, atol: float, rel_diff: Callable[[Any, Any], Any]
) -> StageDifference | None:
    """The first param whose initial statistics differ beyond tolerance (``compare``'s rule,
    ``rel_diff`` its elementwise relative difference)."""
    t_params = _entries(target, "params")
    for k, e in _entries(base, "params").items():
        other = t_params.get(k)
        if other is None or e.get("shape") != other.get("shape"):
            continue
        bi, ti = e.get("init") or {}, other.get("init") or {}
        for op in _INIT_OPS:
            if op not in bi or op not in ti:
                continue
            b, t = _num(bi[op]), _num(ti[op])
            rel = float(rel_diff([b], [t])[0])
            if rel > rtol and not abs(t - b) <= atol:
                return StageDifference("initial_params", rank, _label(*k), op, b, t, rel)
    return None
