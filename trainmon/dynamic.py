"""Dynamic mode, part 1: noticing that the config file changed, and staging what it now says.

Two pieces, so the logic can be driven without threads or sleeps:

* :class:`ConfigStager` -- pure state with an injected clock: ``note_change(now)`` records an
  event, ``settle(now)`` reads and validates the file once it has been quiet for ``settle_s``
  seconds, and stages a :class:`Decision` (a new version: a config to collect with, or "off").
  An invalid file is logged once and stages nothing, so the running state continues.
* :class:`ConfigWatcher` -- a watchdog observer on the file's *folders* (editors and ``sed -i``
  replace the file by rename, which a watch on the file's inode would miss; a symlinked file or
  a Kubernetes ConfigMap is watched where it resolves to, re-resolved on every change) plus one
  small thread that calls ``settle`` when a change has rested.  Nothing is applied from these
  threads: the step boundary reads the staged decision (``trainmon.runtime.dynamic_driver``).

One observer per watched folder serves every watcher of this process (:class:`_FolderObserver`,
reference-counted): a process with hundreds of monitors on one file holds one inotify instance
and one thread for that folder, not one per monitor.  On a network file system (NFS, Lustre,
GPFS, CIFS, ...; :func:`filesystem_type`), where an edit made on another host sends no inotify
event, the folder is polled by default.  Whatever the observer, the step boundary stats the file
now and then (:meth:`ConfigWatcher.check_file`), so an edit no observer reported is still read.

Settings (environment, read when ``TrainerMon`` is created) are in :class:`WatchSettings`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainmon.config import MonitorConfig
from trainmon.errors import ConfigError, Problem

__all__ = [
    "Decision",
    "ConfigStager",
    "ConfigWatcher",
    "WatchSettings",
    "dynamic_requested",
    "filesystem_type",
    "network_filesystem",
]

log = logging.getLogger(__name__)

_TRUE, _FALSE = ("true", "1"), ("false", "0", "")


def _env_flag(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError("environment", [Problem(name, f"{raw!r} is not a switch (allowed, any case: true, 1, false, 0)")])


def _env_seconds(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value < float("inf")):
        raise ConfigError("environment", [Problem(name, f"{raw!r} is not a number of seconds (finite number > 0)")])
    return value


def _env_optional_flag(env: Mapping[str, str], name: str) -> bool | None:
    """A switch, or None when unset or empty (trainmon decides)."""
    if not env.get(name, "").strip():
        return None
    return _env_flag(env, name)


def dynamic_requested(env: Mapping[str, str] | None = None) -> bool:
    """``DYNAMIC_MONITOR`` is true (``true``/``1``, any case); a value that is no switch is an error."""
    return _env_flag(os.environ if env is None else env, "DYNAMIC_MONITOR")


@dataclass(frozen=True)
class WatchSettings:
    """How the config file is watched (environment variables, documented in docs/dynamic.md).

    ``TRAINMON_WATCH_POLLING``: poll the folder instead of inotify; unset means "poll on a network
    file system, where edits made on another host send no inotify event; inotify elsewhere".
    ``TRAINMON_WATCH_INTERVAL``: seconds between polls (and between the watcher's own checks of
    the file).  ``TRAINMON_WATCH_SETTLE``: seconds a change must rest before the file is read (a
    save that arrives as several writes is read once, whole).  ``TRAINMON_WATCH_STEP_CHECK``: the
    step boundary stats the file at most this often, to catch an edit no observer reported.
    ``TRAINMON_DYNAMIC_TIMEOUT``: seconds a rank waits for the others at a step boundary before
    dynamic mode gives up.
    """

    polling: bool | None = None  # None: by the file system (see ConfigWatcher._want_polling)
    interval_s: float = 1.0
    settle_s: float = 0.2
    timeout_s: float = 1800.0
    step_check_s: float = 2.0
    # False: no observer; whoever holds the stager calls note_change/settle (tests drive it so).
    watch: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WatchSettings:
        env = os.environ if env is None else env
        return cls(
            polling=_env_optional_flag(env, "TRAINMON_WATCH_POLLING"),
            interval_s=_env_seconds(env, "TRAINMON_WATCH_INTERVAL", cls.interval_s),
            settle_s=_env_seconds(env, "TRAINMON_WATCH_SETTLE", cls.settle_s),
            timeout_s=_env_seconds(env, "TRAINMON_DYNAMIC_TIMEOUT", cls.timeout_s),
            step_check_s=_env_seconds(env, "TRAINMON_WATCH_STEP_CHECK", cls.step_check_s),
        )


@dataclass(frozen=True)
class Decision:
    """Version ``version`` of the file: collect with ``config``, or stop (``config`` None)."""

    version: int
    config: MonitorConfig | None

    @property
    def on(self) -> bool:
        return self.config is not None


class ConfigStager:
    """The newest valid state of the config file, staged for the next step boundary.

    ``validate(path)`` returns the file's ``MonitorConfig`` or raises ``ConfigError``.  Every
    settled change of a valid file is a new version, even when the text is the same as before:
    saving the file again is how a user asks for a second collection.
    """

    def __init__(self, path: Path, validate: Callable[[Path], MonitorConfig], settle_s: float = 0.2):
        self.path = Path(path)
        self._validate = validate
        self.settle_s = float(settle_s)
        self._lock = threading.Lock()
        self._decision = Decision(0, None)
        self._last_event: float | None = None  # time of the newest change not yet read
        self._generation = 0  # bumped by every change, to spot one during a read
        self.reads = 0  # times the file was read (the watcher tells a read from a deferral)
        # Called just before each read (after the change it answers was taken); what it returns
        # is kept as ``read_snapshot``: what the file was when it was read, for the watcher.  None
        # after a read that a newer change voided (that change is read next, never skipped).
        self.on_read: Callable[[], Any] | None = None
        self.read_snapshot: Any = None

    @property
    def decision(self) -> Decision:
        return self._decision  # one attribute read: the boundary never waits for the lock

    def note_change(self, now: float) -> None:
        with self._lock:
            self._last_event = now
            self._generation += 1

    def due_in(self, now: float) -> float | None:
        """Seconds until ``settle`` would read the file; None when no change is pending."""
        with self._lock:
            if self._last_event is None:
                return None
            return max(0.0, self._last_event + self.settle_s - now)

    def settle(self, now: float) -> Decision | None:
        """Read the file if a change has rested long enough; the new decision, or None."""
        with self._lock:
            if self._last_event is None or now - self._last_event < self.settle_s:
                return None
            generation = self._generation
            self.reads += 1
        if self.on_read is not None:
            self.read_snapshot = self.on_read()
        try:
            config = self._validate(self.path)
        except ConfigError as exc:
            self._read_done(generation)
            log.error(
                "trainmon: dynamic: the edited config is NOT applied; monitoring stays as it "
                "was (last valid version: %d) until the next change. %s",
                self._decision.version,
                exc,
            )
            return None
        except Exception:
            self._read_done(generation)
            log.exception("trainmon: dynamic: reading %s failed; monitoring continues as it was", self.path)
            return None
        with self._lock:
            decision = self._stage_locked(config, generation)
            if decision is None:
                self.read_snapshot = None  # voided by a newer change: read again, not "already read"
        return self._staged(decision)

    def _read_done(self, generation: int) -> None:
        """A read that staged nothing: the change is answered, unless a newer one came meanwhile."""
        with self._lock:
            if generation == self._generation:
                self._last_event = None
            else:
                self.read_snapshot = None

    def stage_now(self, fallback: MonitorConfig) -> Decision:
        """Stage the file as it is now (at ``set_monitor``), or ``fallback`` if it is invalid."""
        try:
            config = self._validate(self.path)
        except ConfigError as exc:
            log.error("trainmon: dynamic: %s; starting from the config read at TrainerMon()", exc)
            config = fallback
        with self._lock:
            decision = self._stage_locked(config, self._generation)
        assert decision is not None  # staged with the current generation: never stale
        self._staged(decision)
        return decision

    def drop_pending(self, now: float) -> bool:
        """Forget a rested change without reading (the watcher saw it brings nothing new); False
        when it has not rested yet or a newer change came meanwhile."""
        with self._lock:
            if self._last_event is None or now - self._last_event < self.settle_s:
                return False
            self._last_event = None
            return True

    def _stage_locked(self, config: MonitorConfig, generation: int) -> Decision | None:
        if generation != self._generation:
            return None  # written again while we read it: the newer text is read later
        self._last_event = None
        self._decision = Decision(self._decision.version + 1, config if config.dynamic_on else None)
        return self._decision

    def _staged(self, decision: Decision | None) -> Decision | None:
        if decision is not None:
            log.info(
                "trainmon: dynamic: config version %d staged from %s (dynamic_on: %s)",
                decision.version,
                self.path,
                str(decision.on).lower(),
            )
        return decision


# Events that mean "the text may have changed".  Opened / closed-without-writing events are
# left out on purpose: reading the file ourselves produces them.
_CHANGE_EVENTS = frozenset({"created", "modified", "moved", "deleted", "closed"})
# A folder on the way to the file matters when it appears, goes or is renamed; "modified" on a
# folder only means some file in it changed, which the file's own events already say.
_DIR_EVENTS = frozenset({"created", "moved", "deleted"})


def resolution_chain(path: str | os.PathLike[str]) -> tuple[str, ...]:
    """Every absolute path whose change can change what ``path`` reads: the path itself, each
    symlink met while resolving it (a symlinked file, a Kubernetes ConfigMap's ``..data``
    folder link) with the path it leads to, and the final real path."""
    todo = os.path.abspath(path)
    chain = [todo]
    for _ in range(40):  # the kernel's own limit on symlink hops
        parts = Path(todo).parts
        here = parts[0]
        for i, part in enumerate(parts[1:], 1):
            step = os.path.join(here, part)
            if os.path.islink(step):
                try:
                    todo = os.path.normpath(os.path.join(here, os.readlink(step), *parts[i + 1 :]))
                except OSError:
                    return tuple(chain)
                chain += [step, todo]
                break
            here = step
        else:
            break
    real = os.path.realpath(path)
    return tuple(dict.fromkeys([*chain, real]))


# File system types (as /proc/self/mountinfo names them) where an edit made on another host
# sends no inotify event to this one: network and cluster file systems, and host-shared folders
# of VMs and containers.  Polling is never wrong there, only a little costlier.
NETWORK_FILE_SYSTEMS = frozenset(
    {
        "nfs", "nfs4", "cifs", "smb3", "smbfs", "ncpfs", "afs", "lustre", "gpfs", "beegfs",
        "ceph", "glusterfs", "gfs2", "ocfs2", "panfs", "pvfs2", "orangefs", "wekafs", "quobyte",
        "davfs", "9p", "virtiofs", "vboxsf", "fuse.sshfs", "fuse.glusterfs", "fuse.ceph-fuse",
        "fuse.cephfs", "fuse.gcsfuse", "fuse.s3fs", "fuse.juicefs", "fuse.rclone", "fuse.beegfs",
    }
)  # fmt: skip
# statfs(2) f_type magic numbers of the same (used where /proc/self/mountinfo cannot be read).
_NETWORK_MAGIC = {
    0x6969: "nfs", 0xFF534D42: "cifs", 0xFE534D42: "smb3", 0x517B: "smbfs", 0x5346414F: "afs",
    0x0BD00BD0: "lustre", 0x47504653: "gpfs", 0x19830326: "beegfs", 0x00C36400: "ceph",
    0x01161970: "gfs2", 0x7461636F: "ocfs2", 0xAAD7AAEA: "panfs", 0x01021997: "9p",
    0x6A656A63: "virtiofs",
}  # fmt: skip


def _unescape_mount(field: str) -> str:
    """A mountinfo path field: spaces, tabs, newlines and backslashes are written as octal."""
    import re

    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mountinfo_type(real: str) -> str | None:
    """The type of the mount holding ``real``, from /proc/self/mountinfo; None when unreadable.
    The mount point that is the longest prefix wins; of equal ones the last (it is on top)."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    best, fstype = -1, None
    for line in lines:
        head, sep, tail = line.partition(" - ")
        fields = head.split()
        if not sep or len(fields) < 5 or not tail.split():
            continue
        point = _unescape_mount(fields[4])
        holds = real == point or real.startswith(point.rstrip("/") + "/")
        if holds and len(point) >= best:
            best, fstype = len(point), tail.split()[0]
    return fstype


def _statfs_type(real: str) -> str | None:
    """The type from libc's statfs f_type (Linux only: its first field); None when unknown."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        buf = ctypes.create_string_buffer(512)  # larger than any struct statfs
        if libc.statfs(os.fsencode(real), buf) != 0:
            return None
    except (OSError, AttributeError):
        return None
    magic = ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF
    return _NETWORK_MAGIC.get(magic, f"0x{magic:x}")


def filesystem_type(path: str | os.PathLike[str]) -> str:
    """The type of the file system holding ``path`` (``"ext4"``, ``"nfs4"``, ``"lustre"``, ...),
    ``""`` when unknown: /proc/self/mountinfo, else libc's statfs magic number."""
    real = os.path.realpath(path)
    fstype = _mountinfo_type(real)
    if fstype is None:
        fstype = _statfs_type(real)
    return fstype or ""


def network_filesystem(path: str | os.PathLike[str]) -> str:
    """The type of ``path``'s file system if it is a network one (edits from other hosts send no
    inotify event), else ``""``."""
    fstype = filesystem_type(path)
    return fstype if fstype in NETWORK_FILE_SYSTEMS or fstype.startswith("nfs") else ""


def _stat_key(path: str | os.PathLike[str], fresh: bool = False) -> tuple | None:
    """What a stat says about the file the path reads (device, inode, size, times); None when
    there is none.  ``fresh``: open it and fstat the descriptor, since opening makes an NFS
    client ask the server (close-to-open consistency) where a stat may answer from its cache."""
    try:
        if fresh:
            fd = os.open(path, os.O_RDONLY)
            try:
                info = os.fstat(fd)
            finally:
                os.close(fd)
        else:
            info = os.stat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def _fingerprint(path: Path, fresh: bool = False) -> tuple | None:
    """What the path reads now (resolved file, inode, size, times); None when there is none."""
    key = _stat_key(path, fresh)
    return None if key is None else (os.path.realpath(path), *key)


def _digest(path: Path) -> bytes | None:
    """A hash of the text the path reads now (a config file is small); None when unreadable."""
    import hashlib

    try:
        with open(path, "rb") as fh:
            return hashlib.sha256(fh.read()).digest()
    except OSError:
        return None


def _new_observer(kind: str, interval_s: float):
    if kind == "native":
        from watchdog.observers import Observer

        return Observer()
    from watchdog.observers.polling import PollingObserver

    return PollingObserver(timeout=interval_s)


class _FolderObserver:
    """One watchdog observer on one folder, shared by every ConfigWatcher of the process that
    watches that folder (one inotify instance and one thread per folder, however many monitors:
    per-monitor observers ran out of inotify instances and threads at about a hundred).  Events
    are filtered once here and handed to each subscriber's handler; the last one to leave stops
    the observer (:func:`_unsubscribe`)."""

    def __init__(self, key: tuple, observer: Any):
        self.key = key  # (kind, poll interval or None, folder, folder identity)
        self.observer = observer
        self.handlers: tuple[_Handler, ...] = ()  # replaced whole under _observers_lock

    @classmethod
    def start(cls, key: tuple) -> _FolderObserver:
        kind, interval_s, folder, _ = key
        shared = cls(key, _new_observer(kind, interval_s or 1.0))
        shared.observer.daemon = True
        shared.observer.schedule(shared, folder, recursive=False)
        try:
            shared.observer.start()
        except BaseException:
            shared.stop()
            raise
        return shared

    def dispatch(self, event: Any) -> None:
        kinds = _DIR_EVENTS if event.is_directory else _CHANGE_EVENTS
        if event.event_type not in kinds:
            return
        touched = {
            os.path.abspath(os.fsdecode(p)) for p in (event.src_path, getattr(event, "dest_path", "") or "") if p
        }
        for handler in self.handlers:
            handler.dispatch(touched)

    def stop(self) -> None:
        try:
            self.observer.stop()
            if self.observer.is_alive():
                self.observer.join(timeout=5)
        except Exception:
            log.debug("trainmon: dynamic: stopping the observer of %s failed", self.key[2], exc_info=True)


_observers: dict[tuple, _FolderObserver] = {}
_observers_lock = threading.Lock()


def _subscribe(handler: _Handler, folder: str, kind: str, interval_s: float) -> tuple:
    """Serve ``handler`` from the process's observer of ``folder`` (started on first use); the
    observer's key.  A folder removed and made again is a new folder (its old watch is dead): it
    gets a new observer."""
    key = (kind, interval_s if kind == "polling" else None, folder, _ident(folder))
    with _observers_lock:
        shared = _observers.get(key)
        if shared is None:
            shared = _observers[key] = _FolderObserver.start(key)
        shared.handlers = (*shared.handlers, handler)
    _revive(key)
    return key


def _revive(key: tuple) -> None:
    """Start the observer of ``key`` again, for all its watchers, if its thread has died."""
    with _observers_lock:
        shared = _observers.get(key)
        if shared is None or shared.observer.is_alive():
            return
        fresh = _observers[key] = _FolderObserver.start(key)
        fresh.handlers = shared.handlers
    shared.stop()
    log.warning("trainmon: dynamic: the file observer of %s had stopped; it is watching again", key[2])


def _unsubscribe(handler: _Handler, key: tuple) -> None:
    with _observers_lock:
        shared = _observers.get(key)
        if shared is None:
            return
        shared.handlers = tuple(h for h in shared.handlers if h is not handler)
        if shared.handlers:
            return
        del _observers[key]
    shared.stop()  # outside the lock: joining waits for the observer's thread


def _forget_observers_in_child() -> None:
    """After ``os.fork`` the child has none of the parent's observer threads (and maybe a lock
    held by one): start from nothing, so a watcher made in the child gets a live observer."""
    global _observers_lock
    _observers.clear()
    _observers_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_observers_in_child)


def shared_observer_count() -> int:
    """Observers running for config watchers in this process (one per watched folder)."""
    with _observers_lock:
        return len(_observers)


class ConfigWatcher:
    """Watches the folders the config path resolves through (with the process's shared
    observers), feeding a :class:`ConfigStager`.

    The watched folders follow the path: after every change (and every ``interval_s`` as a check)
    the path is resolved again and the watches are moved when a symlink now points elsewhere or a
    folder was removed (then its nearest existing parent is watched until it comes back, with one
    warning).  The same check compares what the path reads with what was last read, so a change
    that produced no event (a swap the observer could not see) is still read, once; the step
    boundary makes the same check (:meth:`check_file`) in case this watcher's thread is gone.
    """

    def __init__(self, stager: ConfigStager, settings: WatchSettings):
        self.stager = stager
        self.settings = settings
        self._target = os.path.abspath(stager.path)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._subscriptions: dict[str, tuple] = {}  # folder -> the key of its shared observer
        self._arm_lock = threading.Lock()
        self._handler = _Handler(self._on_change)
        self.network = ""  # the file system's type when it is a network one
        self.kind = ""
        self._fresh = False  # stat by open+fstat (network file systems cache attributes)
        # What the path read when it was last read: (fingerprint, content hash).
        self._seen = self._read_state()
        stager.on_read = self._read_state
        self._missing: str | None = None  # the folder reported missing, until it is back
        self._next_file_check = 0.0  # monotonic time of the next step-boundary stat

    def start(self) -> ConfigWatcher:
        self.network = network_filesystem(self._target)
        self._fresh = bool(self.network)
        self._start_observing()
        self._thread = threading.Thread(target=self._settle_loop, name="trainmon-config-settle", daemon=True)
        self._thread.start()
        return self

    def _start_observing(self) -> None:
        if not self._want_polling():
            self.kind = "native"
            try:
                self._arm()
                return
            except Exception as exc:
                self._unsubscribe_all()
                log.warning(
                    "trainmon: dynamic: the native file watcher cannot start on %s (%s); polling every %gs instead",
                    os.path.dirname(self._target),
                    exc,
                    self.settings.interval_s,
                )
        self.kind = "polling"
        self._arm()

    def _want_polling(self) -> bool:
        if self.settings.polling is not None:
            return self.settings.polling
        if self.network:
            log.info(
                "trainmon: dynamic: %s is on a network file system (%s), where an edit made on "
                "another host sends no inotify event; polling it every %gs "
                "(TRAINMON_WATCH_POLLING=false uses the native watcher anyway)",
                self._target,
                self.network,
                self.settings.interval_s,
            )
            return True
        return False

    def _arm(self) -> None:
        """Watch the folders the path now resolves through (never again once stopped: a re-arm
        racing ``stop`` would leave a subscription nobody removes)."""
        with self._arm_lock:
            if not self._stop.is_set():
                self._arm_locked()

    def _arm_locked(self) -> None:
        chain = resolution_chain(self._target)
        folders = {_existing(os.path.dirname(p)) for p in chain}
        interesting = set(chain)
        for p in chain:  # folders on the way count when they appear, go or are renamed
            interesting.update(str(a) for a in Path(p).parents if str(a) != os.sep)
        self._handler.paths = frozenset(interesting)
        for folder, key in list(self._subscriptions.items()):
            if folder not in folders or key[3] != _ident(folder):
                del self._subscriptions[folder]
                _unsubscribe(self._handler, key)
        for folder in sorted(folders - set(self._subscriptions)):
            self._subscriptions[folder] = _subscribe(self._handler, folder, self.kind, self.settings.interval_s)
        for key in self._subscriptions.values():
            _revive(key)
        self._report_missing(os.path.dirname(chain[-1]))

    def _unsubscribe_all(self) -> None:
        with self._arm_lock:
            subscriptions, self._subscriptions = self._subscriptions, {}
        for key in subscriptions.values():
            _unsubscribe(self._handler, key)

    def _report_missing(self, folder: str) -> None:
        if not os.path.isdir(folder):
            if self._missing != folder:
                self._missing = folder
                log.warning(
                    "trainmon: dynamic: the config folder %s is gone; watching %s until it comes "
                    "back (monitoring stays as it is until then)",
                    folder,
                    _existing(folder),
                )
        elif self._missing is not None:
            log.info("trainmon: dynamic: the config folder %s is back; watching it again", self._missing)
            self._missing = None

    def _on_change(self) -> None:
        self.stager.note_change(time.monotonic())
        self._wake.set()

    def _settle_loop(self) -> None:
        while not self._stop.is_set():
            due = self.stager.due_in(time.monotonic())
            self._wake.wait(self.settings.interval_s if due is None else min(due, self.settings.interval_s))
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._check()
                now = time.monotonic()
                if self.stager.due_in(now) == 0.0:
                    self._settle(now)
            except Exception:  # never let the thread die: log, and look again next time
                log.debug("trainmon: dynamic: checking the config file failed", exc_info=True)

    def _settle(self, now: float) -> None:
        """Read a rested change, unless the path still reads exactly what was read last (same
        file, times and text): then the change was already read (a polling observer reporting
        late what the check below saw first), and reading again would stage a second version.

        What the path read is remembered only when the stager did read it (a change reported
        just now, a late event of the same save, defers the read; remembering the text then
        would make the deferred read look done and drop it), and as it was at that read (taken
        by the stager after it took the change, so a write in between is not mistaken for read
        or for unread).  A read that a newer change voided (an event of the save reported during
        the read) is not remembered either: the read after it stages the edit."""
        if self._read_state() == self._seen and self.stager.drop_pending(now):
            return
        reads = self.stager.reads
        self.stager.settle(now)
        if self.stager.reads != reads and self.stager.read_snapshot is not None:
            self._seen = self.stager.read_snapshot

    def _read_state(self) -> tuple:
        """What the path reads now: (fingerprint, content hash)."""
        return (_fingerprint(self.stager.path, self._fresh), _digest(self.stager.path))

    def _check(self) -> None:
        """Move the watches if the path resolves elsewhere; note a change of the text that no
        event reported (a moved watch may have missed the very event that moved it)."""
        try:
            self._arm()
        except Exception:  # the file is still checked below, whatever became of the watches
            log.debug("trainmon: dynamic: re-arming the config watch failed", exc_info=True)
        self._note_unreported_change()

    def _note_unreported_change(self) -> bool:
        """Note a change if the file differs from what was last read (stat, then text); True if so."""
        if self.stager.due_in(time.monotonic()) is not None:
            return False  # a change is pending already
        seen_fingerprint, seen_digest = self._seen
        key = _stat_key(self.stager.path, self._fresh)
        if key == (seen_fingerprint[1:] if seen_fingerprint else None):
            return False
        if _digest(self.stager.path) == seen_digest:
            return False
        self._on_change()
        return True

    def check_file(self, now: float) -> None:
        """Called at every step boundary; at most every ``step_check_s`` seconds, one stat of the
        config catches an edit that no observer reported (an observer that stopped or never
        hears of remote edits).  When this watcher's thread is gone, the read happens here."""
        if now < self._next_file_check:
            return
        self._next_file_check = now + self.settings.step_check_s
        thread_alive = self._thread is not None and self._thread.is_alive()
        if not thread_alive and self.stager.due_in(now) == 0.0:
            self._settle(now)
            return
        if self._note_unreported_change() and not thread_alive:
            self._next_file_check = now + self.stager.settle_s  # come back to read it once it rests

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._unsubscribe_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def _ident(folder: str) -> tuple[int, int] | None:
    try:
        info = os.stat(folder)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _existing(folder: str) -> str:
    """``folder``, or its nearest parent that exists (watched until the folder comes back)."""
    path = Path(folder)
    while not path.is_dir() and path != path.parent:
        path = path.parent
    return str(path)


class _Handler:
    """One watcher's filter of its shared observers' events: only notes that a path on the way to
    its file was touched (no I/O in the observer's thread).  ``paths`` is replaced whole by the
    watcher when the path resolves anew."""

    def __init__(self, on_change: Callable[[], None]):
        self.paths: frozenset[str] = frozenset()
        self._on_change = on_change

    def dispatch(self, touched: set[str]) -> None:
        """``touched``: the absolute paths an event names (its source and destination)."""
        if not self.paths.isdisjoint(touched):
            self._on_change()
