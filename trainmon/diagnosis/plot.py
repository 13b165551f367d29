"""A layers x steps heatmap of one stat, with a per-layer profile at one step.

Layers are in model order (the row order the monitor wrote, i.e. the order inside the phase).
The figure is built on matplotlib's object API with the Agg canvas: no pyplot, no global
backend switch, nothing needs a display.  Cells without a row are light grey, NaN/Inf cells
are magenta.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap, LogNorm, Normalize, TwoSlopeNorm
from matplotlib.figure import Figure

from trainmon.diagnosis.reader import RunTable

__all__ = ["Grid", "layer_grid", "heatmap_figure", "save_figure", "HEATMAP_XLABEL", "HEATMAP_YLABEL"]

HEATMAP_XLABEL = "step"
HEATMAP_YLABEL = "layer (model order)"
_MAX_TICKS = 60
# Families whose rows are in backward order -> families with the same names in model order.
_BACKWARD_ORDERED = {
    "grad_unreduced": ("grad_reduced", "param_origin", "param_updated", "exp_avg"),
    "actv_grad": ("actv",),
}
_NONFINITE = "magenta"


@dataclass
class Grid:
    kind: str
    op: str
    rank: int
    micro_step: int | None
    layers: list[str]
    steps: np.ndarray
    values: np.ndarray  # [layers x steps]; NaN = no row, +-inf/NaN kept where recorded
    recorded: np.ndarray  # bool [layers x steps]


def _with_layer(frame: pd.DataFrame, multi_vpp: bool) -> pd.DataFrame:
    """Adds the ``layer`` label: ``[vpp:]name[#occurrence]``."""
    name = frame["name"].astype(str)
    if multi_vpp:
        name = frame["vpp_stage"].astype(str) + ":" + name
    occ = frame["occurrence"]
    return frame.assign(layer=name.where(occ == 0, name + "#" + occ.astype(str)))


def layer_grid(table: RunTable, kind: str, op: str, *, rank: int | None = None, micro_step: int | None = None) -> Grid:
    """The values of ``kind``/``op`` on one rank as a layers x steps grid (ValueError if none)."""
    if kind not in table.family_stats:
        have = ", ".join(table.families_on_disk or table.families) or "none"
        raise ValueError(f"no '{kind}' rows in {table.path} (families: {have})")
    if op not in table.family_stats[kind]:
        raise ValueError(f"'{kind}' has no '{op}' column (has: {', '.join(table.family_stats[kind])})")
    fam = table.family(kind)
    ranks = sorted(fam["rank"].unique())
    rank = int(ranks[0]) if rank is None else rank
    if rank not in ranks:
        raise ValueError(f"no '{kind}' rows for rank {rank} (ranks: {', '.join(map(str, ranks))})")
    fam = fam[fam["rank"] == rank]
    micros = sorted(m for m in fam["micro_step"].unique() if m >= 0)
    if micros:
        micro_step = micros[0] if micro_step is None else micro_step
        if micro_step not in micros:
            raise ValueError(f"no micro_step {micro_step} in '{kind}' (has {micros[0]}..{micros[-1]})")
        fam = fam[fam["micro_step"] == micro_step]
    else:
        micro_step = None
    multi_vpp = bool(fam["vpp_stage"].nunique() > 1)
    fam = _with_layer(fam, multi_vpp)
    layers = _model_order(table, kind, fam, rank, multi_vpp)
    steps = np.array(sorted(fam["step"].unique()))
    cells = fam.drop_duplicates(["layer", "step"]).pivot(index="layer", columns="step", values=op)
    cells = cells.reindex(index=layers, columns=steps)
    present = (
        fam.drop_duplicates(["layer", "step"])
        .assign(_one=True)
        .pivot(index="layer", columns="step", values="_one")
        .reindex(index=layers, columns=steps)
    )
    return Grid(kind, op, rank, micro_step, layers, steps, cells.to_numpy(dtype=float), present.notna().to_numpy())


def _norm(values: np.ndarray, log: bool | None):
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return Normalize(0, 1), "viridis", False
    lo, hi = float(finite.min()), float(finite.max())
    if log is not False and lo > 0 and (log or hi / lo > 100):
        return LogNorm(lo, hi if hi > lo else lo * 10), "viridis", True
    if lo < 0 < hi:
        return TwoSlopeNorm(0.0, lo, hi), "RdBu_r", False
    return Normalize(lo, hi if hi > lo else lo + 1), "viridis", False


def _ticks(n: int) -> np.ndarray:
    return np.arange(0, n, max(1, int(np.ceil(n / _MAX_TICKS))))


def _rows_order(fam: pd.DataFrame) -> list[str]:
    # Each layer's typical row position: a layer missing from some steps keeps its place.
    return list(fam.groupby("layer", sort=False)["position"].median().sort_values(kind="mergesort").index)


def _model_order(table: RunTable, kind: str, fam: pd.DataFrame, rank: int, multi_vpp: bool) -> list[str]:
    """Layers in model order.  Families written in backward order borrow a forward-ordered
    family's order when the run has one, else are reversed."""
    rows = _rows_order(fam)
    if kind not in _BACKWARD_ORDERED:
        return rows
    for other in _BACKWARD_ORDERED[kind]:
        if other in table.family_stats:
            ref = table.family(other)
            ref = _with_layer(ref[ref["rank"] == rank], multi_vpp)
            wanted = set(rows)
            known = [n for n in _rows_order(ref) if n in wanted]
            return known + [n for n in reversed(rows) if n not in set(known)]
    return rows[::-1]


def heatmap_figure(grid: Grid, *, step: int | None = None, log: bool | None = None) -> Figure:
    """Heatmap (left) and the per-layer profile at ``step`` (right; default the last step)."""
    n_layers, n_steps = grid.values.shape
    step = int(grid.steps[-1]) if step is None else step
    if step not in grid.steps:
        raise ValueError(f"step {step} not recorded (steps {grid.steps[0]}..{grid.steps[-1]})")
    height = float(np.clip(1.8 + 0.14 * min(n_layers, _MAX_TICKS * 2), 4.0, 22.0))
    fig = Figure(figsize=(13, height), layout="constrained")
    FigureCanvasAgg(fig)
    heat, prof = fig.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [4, 1.4]})
    norm, cmap, is_log = _norm(grid.values, log)
    finite = np.isfinite(grid.values)
    image = heat.imshow(
        np.where(finite, grid.values, np.nan),
        aspect="auto",
        interpolation="nearest",
        norm=norm,
        cmap=cmap,
        extent=(-0.5, n_steps - 0.5, n_layers - 0.5, -0.5),
    )
    heat.set_facecolor("0.88")  # cells without a row
    bad = grid.recorded & ~finite
    if bad.any():
        heat.imshow(
            np.where(bad, 1.0, np.nan),
            aspect="auto",
            interpolation="nearest",
            cmap=ListedColormap([_NONFINITE]),
            vmin=0,
            vmax=1,
            extent=(-0.5, n_steps - 0.5, n_layers - 0.5, -0.5),
        )
    rows = _ticks(n_layers)
    heat.set_yticks(rows, [grid.layers[i] for i in rows], fontsize=7 if n_layers > 30 else 9)
    cols = np.arange(0, n_steps, max(1, int(np.ceil(n_steps / 20))))
    heat.set_xticks(cols, [str(grid.steps[i]) for i in cols])
    heat.set_xlabel(HEATMAP_XLABEL)
    heat.set_ylabel(HEATMAP_YLABEL)
    micro = "" if grid.micro_step is None else f" micro_step {grid.micro_step}"
    heat.set_title(
        f"{grid.kind} {grid.op}, rank {grid.rank}{micro}"
        + (f"  ({int(bad.sum())} non-finite cells in {_NONFINITE})" if bad.any() else "")
    )
    fig.colorbar(image, ax=heat, label=grid.op + (" (log scale)" if is_log else ""), pad=0.01)
    _profile(prof, grid, step, is_log)
    return fig


def _profile(ax, grid: Grid, step: int, is_log: bool) -> None:
    col = int(np.flatnonzero(grid.steps == step)[0])
    v = grid.values[:, col]
    y = np.arange(len(v))
    ok = np.isfinite(v)
    ax.plot(v[ok], y[ok], marker="o", markersize=2.5, linewidth=0.8)
    if is_log and (v[ok] > 0).all() and ok.any():
        ax.set_xscale("log")
    bad = grid.recorded[:, col] & ~ok
    if bad.any():
        edge = ax.get_xlim()[1]
        ax.plot(np.full(bad.sum(), edge), y[bad], "x", color=_NONFINITE, label="NaN/Inf")
        ax.legend(loc="lower right", fontsize=7)
    ax.set_xlabel(f"{grid.op} at step {step}")
    ax.set_title("per-layer profile")
    ax.grid(True, linewidth=0.3)


def save_figure(fig: Figure, path: str | Path, dpi: int = 110) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path
