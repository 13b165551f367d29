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

__all__ = ["Decision", "ConfigStager", "ConfigWatcher", "WatchSettings", "dynamic_requested"]

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


def dynamic_requested(env: Mapping[str, str] | None = None) -> bool:
    """``DYNAMIC_MONITOR`` is true (``true``/``1``, any case); a value that is no switch is an error."""
    return _env_flag(os.environ if env is None else env, "DYNAMIC_MONITOR")


@dataclass(frozen=True)
class WatchSettings:
    """How the config file is watched (environment variables, documented in docs/dynamic.md).

    ``TRAINMON_WATCH_POLLING``: poll the folder instead of inotify (cluster file systems, where
    edits made on another host send no inotify event).  ``TRAINMON_WATCH_INTERVAL``: seconds
    between polls.  ``TRAINMON_WATCH_SETTLE``: seconds a change must rest before the file is
    read (a save that arrives as several writes is read once, whole).  ``TRAINMON_DYNAMIC_TIMEOUT``:
    seconds a rank waits for the others at a step boundary before dynamic mode gives up.
    """

    polling: bool = False
    interval_s: float = 1.0
    settle_s: float = 0.2
    timeout_s: float = 1800.0
    # False: no observer; whoever holds the stager calls note_change/settle (tests drive it so).
    watch: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WatchSettings:
        env = os.environ if env is None else env
        return cls(
            polling=_env_flag(env, "TRAINMON_WATCH_POLLING"),
            interval_s=_env_seconds(env, "TRAINMON_WATCH_INTERVAL", cls.interval_s),
            settle_s=_env_seconds(env, "TRAINMON_WATCH_SETTLE", cls.settle_s),
            timeout_s=_env_seconds(env, "TRAINMON_DYNAMIC_TIMEOUT", cls.timeout_s),
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
        try:
            config = self._validate(self.path)
        except ConfigError as exc:
            with self._lock:
                if generation == self._generation:
                    self._last_event = None
            log.error(
                "trainmon: dynamic: the edited config is NOT applied; monitoring stays as it "
                "was (last valid version: %d) until the next change. %s",
                self._decision.version,
                exc,
            )
            return None
        except Exception:
            with self._lock:
                if generation == self._generation:
                    self._last_event = None
            log.exception("trainmon: dynamic: reading %s failed; monitoring continues as it was", self.path)
            return None
        with self._lock:
            decision = self._stage_locked(config, generation)
        return self._staged(decision)

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


def _fingerprint(path: Path) -> tuple | None:
    """What the path reads now (resolved file, inode, size, times); None when there is none."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (os.path.realpath(path), info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def _digest(path: Path) -> bytes | None:
    """A hash of the text the path reads now (a config file is small); None when unreadable."""
    import hashlib

    try:
        with open(path, "rb") as fh:
            return hashlib.sha256(fh.read()).digest()
    except OSError:
        return None


class ConfigWatcher:
    """Watchdog observers on the folders the config path resolves through, feeding a
    :class:`ConfigStager`.

    The watched folders follow the path: after every change (and every ``interval_s`` as a check)
    the path is resolved again and the watches are moved when a symlink now points elsewhere or a
    folder was removed (then its nearest existing parent is watched until it comes back, with one
    warning).  The same check compares what the path reads with what was last read, so a change
    that produced no event (a swap the observer could not see) is still read, once.
    """

    def __init__(self, stager: ConfigStager, settings: WatchSettings):
        self.stager = stager
        self.settings = settings
        self._target = os.path.abspath(stager.path)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._observer = None
        self._thread: threading.Thread | None = None
        self._watches: dict[str, tuple[Any, Any]] = {}  # folder -> (watchdog watch, its inode)
        self._handler = _Handler(self._on_change)
        # What the path read when it was last read: (fingerprint, content hash).
        self._seen = (_fingerprint(stager.path), _digest(stager.path))
        self._missing: str | None = None  # the folder reported missing, until it is back
        self.kind = ""

    def start(self) -> ConfigWatcher:
        self._observer = self._start_observer()
        self._thread = threading.Thread(target=self._settle_loop, name="trainmon-config-settle", daemon=True)
        self._thread.start()
        return self

    def _start_observer(self):
        from watchdog.observers.polling import PollingObserver

        if not self.settings.polling:
            from watchdog.observers import Observer

            try:
                return self._begin(Observer(), "native")
            except Exception as exc:
                log.warning(
                    "trainmon: dynamic: the native file watcher cannot start on %s (%s); polling every %gs instead",
                    os.path.dirname(self._target),
                    exc,
                    self.settings.interval_s,
                )
        return self._begin(PollingObserver(timeout=self.settings.interval_s), "polling")

    def _begin(self, observer, kind: str):
        observer.daemon = True
        self._watches = {}
        self._arm(observer)
        observer.start()
        self.kind = kind
        return observer

    def _arm(self, observer) -> None:
        """Watch the folders the path now resolves through (a folder removed and made again is a
        new folder: its old watch is dead, so it is watched anew)."""
        chain = resolution_chain(self._target)
        folders = {_existing(os.path.dirname(p)) for p in chain}
        interesting = set(chain)
        for p in chain:  # folders on the way count when they appear, go or are renamed
            interesting.update(str(a) for a in Path(p).parents if str(a) != os.sep)
        self._handler.paths = frozenset(interesting)
        for folder in [f for f, (_, ident) in self._watches.items() if f not in folders or _ident(f) != ident]:
            watch, _ = self._watches.pop(folder)
            try:
                observer.unschedule(watch)
            except Exception:
                pass
        for folder in sorted(folders - set(self._watches)):
            ident = _ident(folder)
            self._watches[folder] = (observer.schedule(self._handler, folder, recursive=False), ident)
        self._report_missing(os.path.dirname(chain[-1]))

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
            except Exception:
                log.debug("trainmon: dynamic: re-arming the config watch failed", exc_info=True)
            now = time.monotonic()
            if self.stager.due_in(now) == 0.0:
                self._settle(now)

    def _settle(self, now: float) -> None:
        """Read a rested change, unless the path still reads exactly what was read last (same
        file, times and text): then the change was already read (a polling observer reporting
        late what the check below saw first), and reading again would stage a second version."""
        seen = (_fingerprint(self.stager.path), _digest(self.stager.path))
        if seen == self._seen and self.stager.drop_pending(now):
            return
        self._seen = seen
        self.stager.settle(now)

    def _check(self) -> None:
        """Move the watches if the path resolves elsewhere; note a change of the text that no
        event reported (a moved watch may have missed the very event that moved it)."""
        if self._observer is not None:
            self._arm(self._observer)
        if self.stager.due_in(time.monotonic()) is not None:
            return
        fingerprint = _fingerprint(self.stager.path)
        if fingerprint != self._seen[0] and _digest(self.stager.path) != self._seen[1]:
            self._on_change()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._observer is not None:
            observer, self._observer = self._observer, None
            observer.stop()
            observer.join(timeout=5)
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
    """watchdog event handler: only notes that a path on the way to our file was touched (no I/O
    in this thread).  ``paths`` is replaced whole by the watcher when the path resolves anew."""

    def __init__(self, on_change: Callable[[], None]):
        self.paths: frozenset[str] = frozenset()
        self._on_change = on_change

    def dispatch(self, event) -> None:
        kinds = _DIR_EVENTS if event.is_directory else _CHANGE_EVENTS
        if event.event_type not in kinds:
            return
        paths = self.paths
        for p in (event.src_path, getattr(event, "dest_path", "") or ""):
            if p and os.path.abspath(os.fsdecode(p)) in paths:
                self._on_change()
                return
