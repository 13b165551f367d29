"""``trainmon plot``: a real PNG with the expected content, JSON summary, errors."""
from __future__ import annotations

import json

from matplotlib import image as mpimg

from tests._support.simulate import named_run
from trainmon.cli import main


def _run(capsys, *argv):
    capsys.readouterr()
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_writes_a_png(tmp_path, capsys):
    out_png = tmp_path / "plots" / "g.png"
    code, out, _ = _run(capsys, "plot", str(named_run("nan")), "--kind", "grad_reduced", "--op", "norm",
                        "--rank", "1", "--step", "3", "-o", str(out_png), "--json")
    doc = json.loads(out)
    assert code == 0 and doc == {"output": str(out_png), "kind": "grad_reduced", "op": "norm", "rank": 1,
                                 "micro_step": None, "layers": 10, "steps": 8, "profile_step": 3,
                                 "bytes": out_png.stat().st_size}
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and doc["bytes"] > 20_000
    img = mpimg.imread(out_png)
    assert img.shape[1] > 1000 and img[..., :3].std() > 0.1


def test_default_name_and_activations(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, _ = _run(capsys, "plot", str(named_run("base")), "--kind", "actv", "--op", "mean",
                        "--micro-step", "0", "--linear")
    assert code == 0 and out.startswith("wrote actv_mean_rank0.png (11 layers x 4 steps")
    assert (tmp_path / "actv_mean_rank0.png").stat().st_size > 20_000


def test_errors(capsys, tmp_path):
    code, out, err = _run(capsys, "plot", str(named_run("base")), "--kind", "comm")
    assert code == 2 and out == "" and "no 'comm' rows" in err and err.count("\n") == 1
    code, _, err = _run(capsys, "plot", str(named_run("base")), "--kind", "grad_reduced", "--op", "std")
    assert code == 2 and "'grad_reduced' has no 'std' column" in err
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    code, _, err = _run(capsys, "plot", str(named_run("base")), "--kind", "grad_reduced",
                        "-o", str(blocker / "g.png"))
    assert code == 2 and err.startswith("trainmon plot: error: cannot write")
