"""``trainmon plot``: a real PNG with the expected content, JSON summary, errors."""
from __future__ import annotations

import json

import pytest
from matplotlib import image as mpimg

from tests._support.simulate import named_run
from trainmon.cli import main


def _run(capsys, *argv):
    capsys.readouterr()
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.slow  # 3.0-5.6 s on a loaded 2-core VM (2026-12-06)
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


def test_help_lists_the_kinds_and_the_default_colour_scale(capsys):
    import pytest

    from trainmon.families import Family

    with pytest.raises(SystemExit):
        main(["plot", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    kinds = text.split("--kind KIND the family to plot", 1)[1].split("--op", 1)[0]
    assert all(f.value in kinds for f in Family if f is not Family.STEPS)
    assert "default: automatic -- log when every value is > 0 and they span more than 100x" in text


class _Terminal:
    """A stderr that says it is a terminal, so the progress line is drawn."""

    def __init__(self):
        self.text = ""

    def isatty(self):
        return True

    def write(self, s):
        self.text += s

    def flush(self):
        pass


def test_progress_while_reading_on_a_terminal_only(tmp_path, monkeypatch, capsys):
    from trainmon.testing.synthetic_run import SyntheticRun

    run = SyntheticRun(ranks=2, steps=4, params=6, steps_per_file=2).write(tmp_path / "run", "csv")
    term = _Terminal()
    monkeypatch.setattr("sys.stderr", term)
    assert main(["plot", str(run), "--kind", "grad_reduced", "-o", str(tmp_path / "a.png")]) == 0
    # 2 ranks x 2 windows of one family, 2 x 4 steps x 6 params rows; the line is cleared at the end
    assert "reading [####################] 4/4 files, 48 rows" in term.text
    assert term.text.endswith("\r")
    term.text = ""
    assert main(["plot", str(run), "--kind", "grad_reduced", "-o", str(tmp_path / "b.png"), "--json"]) == 0
    assert term.text == ""  # never with --json
