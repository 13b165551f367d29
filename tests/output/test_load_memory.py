"""``load_run`` filtered to one family: its memory follows the rows kept, not the run's size.

A fresh interpreter loads one family of a 1,008,000-row run (4 ranks x 100 steps x 420 params x 6
families, CSV) after importing what the load needs; its peak RSS growth over that baseline must stay
within a few times the frame it returns (a load that read every family would hold ~6x the rows).
The 9.6M-row figure of the issue is measured by ``benchmarks/load_run_memory.py --size 10m``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trainmon.testing.synthetic_run import SyntheticRun

pytestmark = pytest.mark.slow

_CHILD = """
import json, resource, sys
import pandas, pyarrow, trainmon
from trainmon.output import load
try:
    import duckdb
except ImportError:
    pass
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
df = trainmon.load_run(sys.argv[1], families="grad_reduced", engine=sys.argv[2])
print(json.dumps({"rows": len(df), "families": df["family"].unique().tolist(),
                  "growth_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base,
                  "frame_mb": df.memory_usage(deep=True).sum() / 2**20}))
"""


@pytest.mark.parametrize("engine", ["pandas", "duckdb"])
def test_one_family_of_a_million_row_run_holds_about_its_own_rows(tmp_path, engine):
    if engine == "duckdb":
        pytest.importorskip("duckdb")
    synth = SyntheticRun(ranks=4, steps=100, params=420, steps_per_file=10)
    run = synth.write(tmp_path / "run", "csv")
    out = subprocess.run([sys.executable, "-c", _CHILD, str(run), engine], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["rows"] == synth.ranks * synth.steps * synth.params and got["families"] == ["grad_reduced"]
    # measured 106 MB for a 26 MB frame (both engines; ~640 MB when every family is loaded)
    assert got["growth_mb"] < 5 * got["frame_mb"] + 64, got
