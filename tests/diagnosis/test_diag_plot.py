"""Heatmap grids in model order, figure labels, the PNG itself, and large layer counts."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from matplotlib import image as mpimg

from tests._support.simulate import FAULT_RANK, FAULT_STEP, Net, named_run, row, write_run
from trainmon.diagnosis.plot import HEATMAP_XLABEL, HEATMAP_YLABEL, heatmap_figure, layer_grid, save_figure
from trainmon.diagnosis.engine_buckets import load_table


def test_grid_is_in_model_order_with_the_csv_values():
    run = named_run("nan")
    grid = layer_grid(load_table(run), "grad_unreduced", "norm", rank=FAULT_RANK)
    # grad_unreduced rows are in backward order; the plot shows model order
    assert grid.layers == [n for n, _ in Net().named_parameters()]
    files = sorted((run / f"rank{FAULT_RANK}").glob("grad_unreduced_*.csv"))
    csv = pd.concat([pd.read_csv(f) for f in files])
    for i, name in enumerate(grid.layers):
        want = csv[csv["name"] == name].sort_values("step")["norm"].to_numpy()
        np.testing.assert_array_equal(grid.values[i], want)
    assert grid.recorded.all()
    assert np.isnan(grid.values[:, FAULT_STEP:]).all() and np.isfinite(grid.values[:, :FAULT_STEP]).all()


def test_figure_labels_and_png(tmp_path):
    grid = layer_grid(load_table(named_run("nan")), "grad_unreduced", "norm", rank=FAULT_RANK)
    fig = heatmap_figure(grid, step=3)
    heat, profile = fig.axes[0], fig.axes[1]
    assert heat.get_xlabel() == HEATMAP_XLABEL == "step"
    assert heat.get_ylabel() == HEATMAP_YLABEL == "layer (model order)"
    assert profile.get_xlabel() == "norm at step 3"
    assert [t.get_text() for t in heat.get_yticklabels()] == grid.layers
    assert "non-finite" in heat.get_title()
    out = save_figure(fig, tmp_path / "g.png")
    assert out.stat().st_size > 20_000
    img = mpimg.imread(out)
    assert img.shape[0] >= 400 and img.shape[1] >= 1200
    assert img[..., :3].std() > 0.1
    magenta = (img[..., 0] > 0.9) & (img[..., 1] < 0.1) & (img[..., 2] > 0.9)
    assert magenta.sum() > 1000                                  # the NaN cells are visible


def test_hundreds_of_layers_stay_readable(tmp_path):
    rows = [row(0, "param_origin", f"layers.{i}.weight", s, stats={"norm": 1.0 + i + s}, shape=[8])
            for s in range(20) for i in range(300)]
    grid = layer_grid(load_table(write_run(tmp_path / "big", rows, steps_per_file=10)), "param_origin", "norm")
    fig = heatmap_figure(grid)
    heat = fig.axes[0]
    labels = [t.get_text() for t in heat.get_yticklabels()]
    assert 30 <= len(labels) <= 60 and labels[0] == "layers.0.weight"
    assert fig.get_size_inches()[1] <= 22
    assert heat.get_xlabel() == "step" and len(heat.get_xticklabels()) <= 30
    assert save_figure(fig, tmp_path / "big.png").stat().st_size > 20_000


def test_bad_choices_are_clear_errors():
    table = load_table(named_run("base"))
    with pytest.raises(ValueError, match="no 'comm' rows"):
        layer_grid(table, "comm", "norm")
    with pytest.raises(ValueError, match="'grad_reduced' has no 'std' column"):
        layer_grid(table, "grad_reduced", "std")
    with pytest.raises(ValueError, match="no 'grad_reduced' rows for rank 5"):
        layer_grid(table, "grad_reduced", "norm", rank=5)
    grid = layer_grid(table, "actv", "mean", micro_step=0)
    assert grid.micro_step == 0 and grid.layers[0] == "inp.output"
    with pytest.raises(ValueError, match="step 99 not recorded"):
        heatmap_figure(grid, step=99)
    assert not math.isnan(grid.values[0, 0])
