"""The fast tier stays fast: an unmarked test over the limit fails and says what to do."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests._support.runs import REPO


@pytest.mark.slow
def test_an_unmarked_test_over_the_limit_fails_and_a_slow_one_passes(tmp_path):
    (tmp_path / "test_sleepy.py").write_text(
        "import time, pytest\n"
        "def test_unmarked():\n    time.sleep(0.5)\n"
        "@pytest.mark.slow\ndef test_marked():\n    time.sleep(0.5)\n"
        "def test_quick():\n    pass\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), TRAINMON_FAST_TEST_LIMIT_S="0.2")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-o", "addopts=", "-c", os.devnull,
         "-W", "ignore::pytest.PytestConfigWarning", "-m", "not slow or slow", str(tmp_path / "test_sleepy.py")],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=120,
    )
    assert "1 failed, 2 passed" in out.stdout, out.stdout + out.stderr
    assert "test_unmarked took" in out.stdout and "mark it @pytest.mark.slow" in out.stdout
