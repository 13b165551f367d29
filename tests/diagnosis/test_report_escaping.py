"""A module name holding a newline cannot forge a line of a text report (issue 34, item 17)."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from trainmon.cli import main
from trainmon.diagnosis.report import escape

FAKE = "x\nstep 0, forward, actv fake_input, rank 0: nans=1 (nonfinite)"


def test_escape_keeps_names_on_one_line():
    assert escape("layers.0.mlp") == "layers.0.mlp"
    assert escape(FAKE) == "x\\nstep 0, forward, actv fake_input, rank 0: nans=1 (nonfinite)"
    assert escape("a\rb\x1b[31m\u2028c\\d") == "a\\rb\\x1b[31m\\u2028c\\\\d"
    assert escape("grüße ok") == "grüße ok"


@pytest.mark.slow
def test_a_newline_in_a_module_name_stays_escaped_in_every_text_report(tmp_path, monkeypatch, capsys):
    from trainmon import TrainerMon, seed_all

    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"xy_distribution": True, "all_xy": True, "wg_distribution": True,
                               "ops": ["norm", "nans"]}))
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    monkeypatch.setenv("TRAINMON_RUN_ID", "crafted")
    seed_all(0)
    model = nn.Sequential()
    model.add_module(FAKE, nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with TrainerMon(cfg) as monitor:
        monitor.set_monitor(model, optimizer=opt)
        for step in range(3):
            x = torch.randn(2, 4)
            if step == 1:
                x[0, 0] = float("nan")       # a real finding on the crafted module
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    run = monitor.run_dir
    for argv in (["anomalies", str(run)], ["ranks", str(run)], ["compare", str(run), str(run)]):
        capsys.readouterr()
        assert main(argv) == 0
        out = capsys.readouterr().out
        # no printed line starts with the forged text; the name shows escaped
        assert not any(line.startswith("step 0, forward, actv fake_input") for line in out.splitlines()), out
    capsys.readouterr()
    main(["anomalies", str(run)])
    out = capsys.readouterr().out
    assert "x\\nstep 0, forward" in out and "nonfinite" in out
    capsys.readouterr()
    main(["anomalies", str(run), "--json"])
    names = {a["name"] for a in json.loads(capsys.readouterr().out)["anomalies"]}
    assert any("\n" in n for n in names)                  # JSON keeps the true name
