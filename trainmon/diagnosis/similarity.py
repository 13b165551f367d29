"""Two runs' gradient directions, sign by sign: msprobe's ``GradComparator`` on trainmon output.

Both runs must have recorded ``grad_probe`` at level L2 (family ``grad_direction``, see
``trainmon.collectors.grad_probe``): every run samples the same positions of a param (they
depend only on its name and shape), so the similarity of a (rank, param, step) is the fraction
of sampled positions whose sign bit (grad > 0) is the same in both runs: 1.0 = identical,
about 0.5 = unrelated.  Rows are aligned by (rank, vpp_stage, name, step); a row whose sample
count ``n`` differs between the runs (another shape) gets NaN.

Writes ``similarities.csv`` (``step,name,similarity``, with ``rank`` first for multi-rank runs
and ``vpp_stage`` when a run has several chunks), one ``<name>.png`` per param (a line per
rank) and ``summary_similarities.png`` (mean over params per step).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from trainmon.diagnosis.reader import RunDirError, ranked_dirs, resolve_run_dir
from trainmon.families import Family
from trainmon.output import runs
from trainmon.output.layout import SIMILARITIES_FILE, SIMILARITY_SUMMARY_PNG

__all__ = ["Similarities", "similarities", "write_similarities", "popcount"]

_KEYS = ["rank", "vpp_stage", "name", "step"]
_WORD = re.compile(r"^w\d+$")


@dataclass
class Similarities:
    frame: pd.DataFrame  # rank, vpp_stage, name, step, similarity (+ n)
    multi_rank: bool
    multi_vpp: bool
    only_in_base: int = 0
    only_in_target: int = 0
    written: list[Path] = field(default_factory=list)

    def first_below(self, threshold: float) -> dict[str, object] | None:
        """The first (step, rank, param in model order) whose similarity is below ``threshold``
        (NaN counts as below: the rows cannot be compared)."""
        f = self.frame
        hit = f[~(f["similarity"] >= threshold)]
        if hit.empty:
            return None
        r = hit.sort_values(["step", "rank", "order"], kind="mergesort").iloc[0]
        sim = float(r["similarity"])
        return {
            "step": int(r["step"]),
            "rank": int(r["rank"]),
            "vpp_stage": int(r["vpp_stage"]),
            "name": str(r["name"]),
            "similarity": sim if math.isfinite(sim) else None,
        }


def popcount(words: np.ndarray) -> np.ndarray:
    """Set bits per uint64 element."""
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(words).astype(np.int64)
    as_bytes = words.astype("<u8").view(np.uint8).reshape(*words.shape, 8)
    return np.unpackbits(as_bytes, axis=-1).sum(-1).astype(np.int64)


def _directions(run_dir: Path) -> pd.DataFrame:
    parts = []
    for rank, rdir in ranked_dirs(run_dir):
        frame = runs.read_family(rdir, str(Family.GRAD_DIRECTION))
        if frame.empty:
            continue
        frame = frame.assign(rank=rank)
        frame["order"] = frame.groupby("step", sort=False).cumcount()
        parts.append(frame)
    if not parts:
        raise RunDirError(f'{run_dir}: no grad_direction rows (record it with "grad_probe": {{"grad_level": "L2"}})')
    frame = pd.concat(parts, ignore_index=True)
    frame["vpp_stage"] = frame["vpp_stage"].fillna(0).astype(int)
    return frame


def _word_columns(frame: pd.DataFrame) -> list[str]:
    return [c for c in frame.columns if _WORD.match(str(c))]


def similarities(base_path: str | Path, target_path: str | Path) -> Similarities:
    """Align two runs' ``grad_direction`` rows and compute each row's sign agreement."""
    base = _directions(resolve_run_dir(base_path))
    target = _directions(resolve_run_dir(target_path))
    words = [c for c in _word_columns(base) if c in set(_word_columns(target))]
    merged = base[[*_KEYS, "order", "n", *words]].merge(target[[*_KEYS, "n", *words]], on=_KEYS, suffixes=("", "@t"))
    wb = merged[words].to_numpy(np.float64).astype(np.uint64)
    wt = merged[[w + "@t" for w in words]].to_numpy(np.float64).astype(np.uint64)
    differ = popcount(wb ^ wt).sum(axis=1) if len(merged) else np.zeros(0, np.int64)
    n = merged["n"].to_numpy(np.float64)
    same_n = n == merged["n@t"].to_numpy(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        sim = np.where(same_n & (n > 0), 1.0 - differ / n, np.nan)
    frame = merged[[*_KEYS, "order", "n"]].assign(similarity=sim)
    frame = frame.sort_values(["step", "rank", "vpp_stage", "order"], kind="mergesort", ignore_index=True)
    multi_rank = max(base["rank"].nunique(), target["rank"].nunique()) > 1
    multi_vpp = bool((frame["vpp_stage"] != 0).any())
    return Similarities(
        frame, multi_rank, multi_vpp, only_in_base=len(base) - len(merged), only_in_target=len(target) - len(merged)
    )


def _file_stem(name: str, vpp: int, multi_vpp: bool) -> str:
    stem = f"{vpp}:{name}" if multi_vpp else name
    return re.sub(r"[^A-Za-z0-9._:-]", "_", stem).replace(":", "_") or "_"


def _line_chart(path: Path, title: str, series: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7, 3.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for label, (steps, values) in series.items():
        ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("similarity")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, format="png")


def write_similarities(
    result: Similarities, out_dir: str | Path, progress: Callable[[int, int], None] | None = None
) -> list[Path]:
    """The CSV and the charts into ``out_dir`` (created); returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    f = result.frame
    cols = [
        *(["rank"] if result.multi_rank else []),
        "step",
        *(["vpp_stage"] if result.multi_vpp else []),
        "name",
        "similarity",
    ]
    csv_path = out / SIMILARITIES_FILE
    f[cols].to_csv(csv_path, index=False, float_format=None)
    written = [csv_path]
    params = f.drop_duplicates(["vpp_stage", "name"])[["vpp_stage", "name"]].itertuples(index=False)
    params = list(params)
    total = len(params) + 1
    for i, (vpp, name) in enumerate(params):
        rows = f[(f["vpp_stage"] == vpp) & (f["name"] == name)]
        series = {
            f"rank {r}": (g["step"].to_numpy(), g["similarity"].to_numpy()) for r, g in rows.groupby("rank", sort=True)
        }
        path = out / f"{_file_stem(name, vpp, result.multi_vpp)}.png"
        _line_chart(path, name if not result.multi_vpp else f"{vpp}:{name}", series)
        written.append(path)
        if progress:
            progress(i + 1, total)
    mean = f.groupby(["rank", "step"], sort=True)["similarity"].mean().reset_index()
    series = {f"rank {r}": (g["step"].to_numpy(), g["similarity"].to_numpy()) for r, g in mean.groupby("rank")}
    summary = out / SIMILARITY_SUMMARY_PNG
    _line_chart(summary, "mean similarity over parameters", series)
    written.append(summary)
    if progress:
        progress(total, total)
    result.written = written
    return written
