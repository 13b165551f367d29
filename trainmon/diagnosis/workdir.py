"""The engine's work directories under ``TMPDIR``, and those that killed commands left behind.

A command's work directory holds DuckDB's spill files and the runs ``ranks`` and ``compare``
stage (gigabytes at 100M rows: ``docs/analysis_at_scale.md``).  It is removed when the command
ends, but a command that is killed (SIGKILL, the OOM killer, a node draining) cannot remove it,
and repeated kills would fill the disk.  So each directory holds ``owner.lock``, locked
(``flock``) by its command for as long as it runs; the kernel drops the lock when the process
dies, however it dies.  Each analysis command (``cli._engine.engine_required``, as it starts)
first removes the directories whose lock it can take:
their command is gone.  Nothing is removed on a guess: a directory without the lock file
(made by an older trainmon, or not ours), or one in a file system where ``flock`` does not work,
is left alone, and another user's directories cannot be opened at all (``mkdtemp`` makes them
private).  The lock file is locked before it gets its name, so no command can find it unlocked
while its owner lives.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: no locks, so nothing is ever taken for stale
    fcntl = None  # type: ignore[assignment]

__all__ = ["WorkDir", "PREFIX", "LOCK"]

PREFIX = "trainmon-engine-"
LOCK = "owner.lock"


class WorkDir:
    """A fresh private directory under ``TMPDIR`` (or ``parent``), locked as this process's while it is open."""

    def __init__(self, parent: str | Path | None = None) -> None:
        # ``parent``: where to make it (default TMPDIR), e.g. storage a cluster's workers see.
        self.path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=parent))
        self._lock_fd: int | None = None
        try:
            self._lock_fd = _locked_lock_file(self.path)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Remove the directory, then let the lock go (in that order: no other command may take
        the directory for stale while it is being removed)."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _locked_lock_file(path: Path) -> int | None:
    """``path/owner.lock``, created under another name, locked, then renamed, so it never exists
    unlocked while we live.  None where locks are not to be had (the directory then stays until
    its command removes it, as before)."""
    if fcntl is None:
        return None
    tmp = path / (LOCK + ".new")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # a file system without flock (some network mounts)
        os.close(fd)
        tmp.unlink(missing_ok=True)
        return None
    os.replace(tmp, path / LOCK)
    return fd


def remove_stale(tmp: str | Path | None = None) -> int:
    """Remove the work directories under ``tmp`` (default ``TMPDIR``) whose command is gone; returns
    how many.  Never raises: a directory it cannot judge or remove is left as it is."""
    if fcntl is None:
        return 0
    removed = 0
    try:
        candidates = list(Path(tmp or tempfile.gettempdir()).glob(PREFIX + "*"))
    except OSError:
        return 0
    for d in candidates:
        try:
            fd = os.open(d / LOCK, os.O_RDWR)
        except OSError:  # no lock file (an older trainmon, being made, not ours) or not readable: leave it
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its command is running
            os.close(fd)
            continue
        try:
            shutil.rmtree(d, ignore_errors=True)
            removed += not d.exists()
        finally:
            os.close(fd)
    return removed
