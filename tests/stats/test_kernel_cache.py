"""The kernel cache never loads code that someone else could have written (issue 12, item 1).

Each case plants a real shared library whose constructor writes a marker file and whose
``trainmon_partials`` returns fake statistics, then runs a fresh process that computes partials:
the marker must not appear and the values must be the tensor's own (float64 truth).
"""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from trainmon.stats import _fused_cpu

REPO = Path(__file__).resolve().parents[2]
OTHER_UID = 65534  # "nobody"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")]

PLANT = r"""
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
__attribute__((constructor)) static void planted(void) {
  const char* p = getenv("PLANT_MARKER"); if (p) { FILE* f = fopen(p, "w"); if (f) { fputs("ran", f); fclose(f); } }
}
int trainmon_partials(const void* d, int64_t n, int kind, double* row, int64_t width, const int64_t* cols) {
  for (int64_t j = 0; j < width; ++j) row[j] = 42.0;
  return 0;
}
"""

SCRIPT = """
import logging, torch
logging.basicConfig(level=logging.INFO)
from trainmon.stats import _fused_cpu as f
t = torch.arange(1000, dtype=torch.float32) / 7
row = f.partials_f32([t])[0].tolist()
d = t.double()
truth = [1000.0, d.sum().item(), (d * d).sum().item(), d.min().item(), d.max().item()]
assert all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for a, b in zip(row, truth)), (row, truth)
print("ok")
"""


def _plant(path: Path, tmp_path: Path) -> None:
    src = tmp_path / "plant.c"
    src.write_text(PLANT)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(path), str(src)], check=True, capture_output=True)


def _run(tmp_path: Path, cache: Path, umask: int | None = None, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRAINMON_FUSED_CPU", "CC")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), TRAINMON_FUSED_CPU="1", TRAINMON_CACHE_DIR=str(cache),
               PLANT_MARKER=str(tmp_path / "planted-code-ran"), TMPDIR=str(tmp_path / "tmp"), **extra)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    preexec = (lambda: os.umask(umask)) if umask is not None else None
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=180, check=False,
                          preexec_fn=preexec)


def _assert_not_loaded(proc: subprocess.CompletedProcess, tmp_path: Path) -> None:
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
    assert not (tmp_path / "planted-code-ran").exists(), "the planted library's constructor ran"


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_library_in_a_world_writable_cache_folder_is_never_loaded(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o777)
    if os.getuid() == 0:
        os.chown(cache, OTHER_UID, OTHER_UID)  # as in the report: someone else's 0777 folder
    _plant(cache / _fused_cpu._library_name(), tmp_path)
    proc = _run(tmp_path, cache)
    _assert_not_loaded(proc, tmp_path)
    assert proc.stderr.count("nothing is loaded from it") == 1, proc.stderr
    private = tmp_path / "tmp" / f"trainmon-cache-{os.getuid()}"
    assert (private / _fused_cpu._library_name()).exists() and _mode(private) == 0o700


def test_a_replaced_library_in_the_own_cache_is_rebuilt_not_loaded(tmp_path):
    cache = tmp_path / "cache"
    assert _run(tmp_path, cache).returncode == 0
    target = cache / _fused_cpu._library_name()
    good = target.read_bytes()
    target.unlink()
    _plant(target, tmp_path)
    target.chmod(0o644)  # owned by this user and not writable by others: only the hash can tell
    proc = _run(tmp_path, cache)
    _assert_not_loaded(proc, tmp_path)
    assert "does not match the hash" in proc.stderr
    assert target.read_bytes() == good, "the planted file was replaced by a fresh build"
    again = _run(tmp_path, cache, CC=str(tmp_path / "no-compiler"))
    assert again.returncode == 0 and "not loading" not in again.stderr, "the rebuilt library loads cleanly"


def test_a_library_owned_by_another_user_or_writable_by_others_is_rebuilt(tmp_path):
    cache = tmp_path / "cache"
    assert _run(tmp_path, cache).returncode == 0
    target = cache / _fused_cpu._library_name()
    target.chmod(0o666)
    proc = _run(tmp_path, cache)
    assert proc.returncode == 0 and "is writable by others" in proc.stderr, proc.stderr
    assert _mode(target) == 0o644
    if os.getuid() == 0:
        target.unlink()
        _plant(target, tmp_path)
        os.chown(target, OTHER_UID, OTHER_UID)
        target.chmod(0o644)
        proc = _run(tmp_path, cache)
        _assert_not_loaded(proc, tmp_path)
        assert "is owned by another user" in proc.stderr


def test_a_symlinked_library_is_not_followed(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    _plant(tmp_path / "elsewhere.so", tmp_path)
    (cache / _fused_cpu._library_name()).symlink_to(tmp_path / "elsewhere.so")
    _assert_not_loaded(_run(tmp_path, cache), tmp_path)


def test_under_umask_000_the_folders_are_0700_and_the_files_0644(tmp_path):
    cache = tmp_path / "deep" / "cache"
    proc = _run(tmp_path, cache, umask=0)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    assert _mode(tmp_path / "deep") == 0o700 and _mode(cache) == 0o700
    files = sorted(cache.iterdir())
    assert [p.suffix for p in files] == [".so", ".sha256"] or [p.suffix for p in files] == [".sha256", ".so"]
    assert all(_mode(p) == 0o644 for p in files), [(p.name, oct(_mode(p))) for p in files]
