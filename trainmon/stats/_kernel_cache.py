"""Where the compiled CPU kernel lives, and the checks that make loading it safe.

Loading a shared library runs its code (its constructors run at ``dlopen``), so a library is
loaded only when nobody but the current user could have written it:

* the cache folder (``TRAINMON_CACHE_DIR``, else ``$XDG_CACHE_HOME/trainmon`` or
  ``~/.cache/trainmon``) must be owned by the current user and not group/world-writable; trainmon
  creates it (and any missing parent) with mode 0700 whatever the umask.  A folder that fails the
  check is not used: the kernel is built in a private ``$TMPDIR/trainmon-cache-<uid>`` instead,
  after one warning;
* the library file and its ``.sha256`` file (written by the build) must be regular files owned by
  the current user and not group/world-writable (created 0644 whatever the umask);
* the library's content must hash to what the build recorded.  The file is opened once, checked
  and hashed through that descriptor, and loaded through ``/proc/self/fd/<n>``, so what is loaded
  is exactly what was checked, not a file swapped in between.  A file that fails any check is
  rebuilt, never loaded.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["UnsafeCache", "cache_dir", "load"]

log = logging.getLogger(__name__)

DIGEST_SUFFIX = ".sha256"


class UnsafeCache(RuntimeError):
    """Neither the cache folder nor the private temporary one can be trusted."""


def cache_dir() -> Path:
    configured = os.environ.get("TRAINMON_CACHE_DIR")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "trainmon"


def load(name: str, build: Callable[[Path], Path]) -> ctypes.CDLL:
    """The library ``name`` from the cache, verified; else ``build(tmpdir)`` (returns the built
    file inside ``tmpdir``), which is checked, loaded and then renamed into the cache."""
    folder = _trusted_folder()
    target = folder / name
    lib = _load_verified(target)
    if lib is not None:
        return lib
    with tempfile.TemporaryDirectory(dir=folder) as tmp:  # mode 0700
        built = build(Path(tmp))
        os.chmod(built, 0o644)
        digest = _sha256_file(built)
        lib = _load_verified(built, expected=digest)
        if lib is None:
            raise UnsafeCache(f"{built} changed between the build and loading it")
        sidecar = Path(tmp) / (name + DIGEST_SUFFIX)
        _write_private(sidecar, digest + "\n")
        os.replace(built, target)
        os.replace(sidecar, folder / (name + DIGEST_SUFFIX))
    return lib


def _trusted_folder() -> Path:
    wanted = cache_dir()
    problem = _private_dir_problem(wanted, allow_link=True)
    if problem is None:
        return wanted
    fallback = Path(tempfile.gettempdir()) / f"trainmon-cache-{_uid()}"
    second = _private_dir_problem(fallback, allow_link=False)
    if second is not None:
        raise UnsafeCache(f"kernel cache {wanted} {problem}, and {fallback} {second}")
    if problem.startswith("cannot be created"):  # e.g. a read-only home
        log.warning(
            "trainmon: kernel cache %s %s; building and caching the kernel in %s instead (it is "
            "rebuilt, about 0.3 s, whenever that folder is cleared). Fix: set TRAINMON_CACHE_DIR "
            "to a writable folder of yours",
            wanted,
            problem,
            fallback,
        )
    else:
        log.warning(
            "trainmon: kernel cache %s %s, so nothing is loaded from it; building the kernel "
            "in the private folder %s instead (fix: chmod 700 the folder, or set "
            "TRAINMON_CACHE_DIR to a folder of yours)",
            wanted,
            problem,
            fallback,
        )
    return fallback


def _private_dir_problem(path: Path, allow_link: bool) -> str | None:
    """None when ``path`` is a folder of this user that nobody else can write; else why not."""
    try:
        _make_private_dirs(path)
        info = os.stat(path) if allow_link else os.lstat(path)
    except OSError as exc:
        return f"cannot be created ({exc.strerror or exc})"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a folder"
    return _ownership_problem(info)


def _ownership_problem(info: os.stat_result) -> str | None:
    if info.st_uid != _uid():
        return f"is owned by another user (uid {info.st_uid})"
    if info.st_mode & 0o022:
        return f"is writable by others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def _make_private_dirs(path: Path) -> None:
    """Like ``mkdir -p`` but every folder it creates is 0700, whatever the umask."""
    missing = []
    while not os.path.lexists(path) and path != path.parent:
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass


def _load_verified(path: Path, expected: str | None = None) -> ctypes.CDLL | None:
    """Load ``path`` if it passes every check (see the module doc), else None (after a warning
    when a file was there but failed)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:  # a symlink (ELOOP) or unreadable: not ours to load
        log.warning("trainmon: not loading %s (%s); rebuilding it", path, exc.strerror or exc)
        return None
    try:
        info = os.fstat(fd)
        problem = "is not a regular file" if not stat.S_ISREG(info.st_mode) else _ownership_problem(info)
        if problem is None:
            digest = _sha256_fd(fd)
            wanted = expected or _recorded_digest(path)
            if wanted != digest:
                problem = (
                    "does not match the hash recorded when it was built"
                    if wanted
                    else "has no valid record of its build"
                )
        if problem is not None:
            log.warning("trainmon: not loading %s: it %s; rebuilding it", path, problem)
            return None
        fd_path = f"/proc/self/fd/{fd}"
        return ctypes.CDLL(fd_path if os.path.exists(fd_path) else str(path))
    finally:
        os.close(fd)


def _recorded_digest(library: Path) -> str | None:
    sidecar = library.with_name(library.name + DIGEST_SUFFIX)
    try:
        fd = os.open(sidecar, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or _ownership_problem(info) is not None:
            return None
        text = os.read(fd, 200).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    return text if len(text) == 64 else None


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.fchmod(fd, 0o644)  # 0644 even under a umask of 000
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _sha256_fd(fd: int) -> str:
    h = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    while chunk := os.read(fd, 1 << 20):
        h.update(chunk)
    return h.hexdigest()


def _sha256_file(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY)
    try:
        return _sha256_fd(fd)
    finally:
        os.close(fd)


def _uid() -> int:
    return os.getuid() if hasattr(os, "getuid") else -1
