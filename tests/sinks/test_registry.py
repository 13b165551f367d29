"""A sink from a third-party package, installed for real (a dist-info with an entry point on
sys.path), selected by its ``format`` name alone; run in a subprocess so the entry-point caches and
sys.path of this process stay clean."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from trainmon.output import runs

TINYSINK = textwrap.dedent('''
    """A third-party sink: every row it receives, as JSON, at close.  It never calls register_sink."""
    import json
    from dataclasses import dataclass

    from trainmon.sinks.base import Sink


    @dataclass(frozen=True)
    class DictLogSettings:
        path: str = "dictlog.json"
        label: str | None = None


    class DictLogSink(Sink):
        settings_schema = DictLogSettings

        def __init__(self, options):
            super().__init__(options)
            self.rows = []

        def write(self, rows, step):
            for block in rows.blocks():
                for name, values in zip(block.names, block.values):
                    row = {"family": block.family, "name": name, "step": step, "micro_step": block.micro_step}
                    row.update(zip(block.stats, values))
                    self.rows.append(row)

        def close(self):
            with open(self.options.settings.path, "w") as f:
                json.dump({"label": self.options.settings.label, "rows": self.rows}, f)
''')

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    torch.set_num_threads(1)
    from trainmon.sinks import known_formats
    assert "dictlog" in known_formats(), known_formats()
    assert "tinysink" not in sys.modules  # listed, not imported, until a config asks for it
    from trainmon import TrainerMon
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    mon = TrainerMon(sys.argv[1])
    mon.set_monitor(model, optimizer=opt)
    for _ in range(4):
        model(torch.randn(8, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    assert "tinysink" in sys.modules
    print(mon.run_dir)
""")


def _install_tinysink(site) -> None:
    """What ``pip install tinysink`` leaves behind: the module and its dist-info."""
    site.mkdir()
    (site / "tinysink.py").write_text(TINYSINK)
    info = site / "tinysink-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tinysink\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[trainmon.sinks]\ndictlog = tinysink:DictLogSink\n")


@pytest.mark.slow
def test_entry_point_sink_selected_by_name_gets_the_csv_values(tmp_path):
    site = tmp_path / "site"
    _install_tinysink(site)
    out = tmp_path / "dictlog.json"
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "format": ["csv", "dictlog"],
                "dictlog": {"path": str(out), "label": "run-a"},
                "wg_distribution": True,
                "mv_distribution": True,
                "ops": ["norm", "min", "max", "mean", "nans"],
            }
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
           "MONITOR_OUTPUT_DIR": str(tmp_path / "out"), "OMP_NUM_THREADS": "1"}  # fmt: skip
    env.pop("TRAINMON_RUN_ID", None)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(config)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    run_dir = proc.stdout.strip().splitlines()[-1]
    logged = json.loads(out.read_text())
    assert logged["label"] == "run-a"
    rank_dir = runs.rank_dirs(run_dir)[0]
    families = sorted(runs.family_files(rank_dir))
    assert {"grad_reduced", "exp_avg", "exp_avg_sq"} <= set(families)
    compared = 0
    for family in families:
        csv = runs.read_family(rank_dir, family)
        mine = [r for r in logged["rows"] if r["family"] == family]
        assert len(mine) == len(csv), family
        for op in ("norm", "min", "max", "mean", "nans"):
            if op not in csv.columns:
                continue
            got = {(r["name"], r["step"]): r[op] for r in mine}
            want = np.array(csv[op], dtype=np.float64)
            np.testing.assert_array_equal(
                np.array([got[(n, s)] for n, s in zip(csv["name"], csv["step"])], dtype=np.float64), want
            )
            compared += len(want)
    assert compared >= 3 * 4 * 4 * 4  # 3 families x 4 params x 4 steps x 4+ ops


def _install(site, name: str, module_text: str, entry_points: str) -> None:
    info = site / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (site / f"{name}.py").write_text(textwrap.dedent(module_text))
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[trainmon.sinks]\n" + entry_points)


def test_module_entry_point_and_a_broken_one(tmp_path, monkeypatch):
    import trainmon.sinks.base as base
    from trainmon.config import parse_config
    from trainmon.runtime.features import unsupported_problems
    from trainmon.sinks import load_sink_class

    site = tmp_path / "site"
    _install(site, "modsink_pkg", """
        from trainmon.sinks.base import Sink, register_sink

        @register_sink("modsink")
        class ModSink(Sink):
            def write(self, rows, step):
                pass
    """, "modsink = modsink_pkg\n")  # fmt: skip
    _install(site, "brokensink_pkg", "raise RuntimeError('boom at import')\n", "brokensink = brokensink_pkg:Nope\n")
    _install(site, "notasink_pkg", "class NotASink:\n    pass\n", "notasink = notasink_pkg:NotASink\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))  # what the modules register stays here
    try:
        assert load_sink_class("modsink").__name__ == "ModSink"
        problems = unsupported_problems(parse_config({"format": ["csv", "brokensink", "notasink"]}, "c.json"))
        assert [p.key for p in problems] == ["format[1]", "format[2]"]
        assert "entry point brokensink = brokensink_pkg:Nope (group trainmon.sinks) failed to load: " \
               "RuntimeError: boom at import" in problems[0].message  # fmt: skip
        assert "is neither a Sink subclass nor a module that registers a sink named 'notasink'" in problems[1].message
    finally:
        for module in ("modsink_pkg", "brokensink_pkg", "notasink_pkg"):
            sys.modules.pop(module, None)
