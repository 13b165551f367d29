"""What the experiment-tracker sinks (W&B, MLflow) share: metric keys, selection, rank and failure rules.

* **Keys.** One value is ``<family>/<stat>/<name>`` (``grad_reduced/norm/layers.0.weight``), then
  ``:vp<k>`` for a virtual pipeline stage other than 0, ``:<key>=<value>`` per ``extra`` column
  (``comm``, ``hyperparams``) and, with ``micro_steps: "each"``, ``:micro<k>``.  With the default
  ``micro_steps: "last"`` a per-micro-batch family (``actv``, ``actv_grad``, ``loss``) logs the value
  of the step's last micro-batch that recorded the tensor, under the key without a suffix.  A
  backend may rewrite characters it rejects (:func:`mlflow_key`).
* **Selection and cap.** ``families``, ``stats`` and ``names`` (glob patterns) choose what is
  logged (empty: everything scalar); at most ``max_metrics`` distinct keys are logged, the first
  ones seen (one warning names the cap); a key once taken stays, so every series is complete.
* **Ranks.** Rank 0 only, or every rank with ``all_ranks`` (one tracker run per rank, grouped).
* **Never in training's way.** ``write`` (on trainmon's writer thread) only turns the rows into a
  ``{key: value}`` dict and puts it on a short queue of its own; a worker thread sends it.  A
  tracker that falls behind loses its copy of some steps (one warning, counted at close), never
  the CSV's; a tracker that fails (not installed, unreachable, run finished or killed under it)
  costs one warning and switches this sink off; training and the other outputs go on.
"""

from __future__ import annotations

import atexit
import fnmatch
import hashlib
import importlib.util
import logging
import numbers
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal, SupportsFloat, cast

from trainmon.families import NOT_SCALAR, Family
from trainmon.output.tb_tags import extra_text
from trainmon.sinks.base import Sink, SinkOptions
from trainmon.stats.rows import RowBlock, StepRows, paced

__all__ = ["MetricSettings", "MetricKeys", "MetricSink", "mlflow_key", "run_id_of"]

logger = logging.getLogger(__name__)

MICRO_STEP_MODES = ("last", "each")
QUEUE_STEPS = 64  # steps a tracker may be behind before its copy of a step is dropped
_KNOWN_FAMILIES = tuple(str(f) for f in Family)


@dataclass(frozen=True)
class MetricSettings:
    """The keys every tracker block (``"wandb": {...}``, ``"mlflow": {...}``) accepts."""

    block: ClassVar[str] = "metrics"  # the config key, for messages

    all_ranks: bool = False
    families: list[str] = field(default_factory=list)
    stats: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    micro_steps: Literal["last", "each"] = "last"
    max_metrics: int = 5000
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        b = self.block
        for key in ("families", "stats", "names"):
            value = getattr(self, key)
            if not isinstance(value, (list, tuple)) or not all([isinstance(v, str) and v for v in value]):
                raise ValueError(f"{b}.{key}: {value!r} is not a list of non-empty strings")
        for fam in self.families:
            if fam not in _KNOWN_FAMILIES:
                raise ValueError(
                    f"{b}.families: unknown family {fam!r} ({_hint(fam, _KNOWN_FAMILIES)}allowed: "
                    f"{', '.join(_KNOWN_FAMILIES)})"
                )
        if self.micro_steps not in MICRO_STEP_MODES:
            raise ValueError(f"{b}.micro_steps: {self.micro_steps!r} is not one of: {', '.join(MICRO_STEP_MODES)}")
        if isinstance(self.max_metrics, bool) or not isinstance(self.max_metrics, int) or self.max_metrics < 1:
            raise ValueError(f"{b}.max_metrics: {self.max_metrics!r} is not a positive integer")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or self.timeout_s < 0:
            raise ValueError(f"{b}.timeout_s: {self.timeout_s!r} is not a number of seconds >= 0")
        if not isinstance(self.all_ranks, bool):
            raise ValueError(f"{b}.all_ranks: {self.all_ranks!r} is not true or false")


def _hint(word: str, choices: Sequence[str]) -> str:
    import difflib

    close = difflib.get_close_matches(word, choices, n=1)
    return f"did you mean {close[0]!r}? " if close else ""


def run_id_of(options: SinkOptions) -> str:
    """trainmon's run id: the name of the run directory that holds ``rank<R>``."""
    return Path(options.rank_dir).resolve().parent.name


# -- keys ------------------------------------------------------------------------------------


class _Layout:
    """The keys of one block layout (family, stats, extras, micro-step): per (vpp, name), the
    (value index, key) pairs taken, cached because names repeat every step."""

    __slots__ = ("family", "keys", "stats", "suffix")

    def __init__(self, family: str, stats: list[tuple[int, str]], suffix: str):
        self.family, self.stats, self.suffix = family, stats, suffix
        self.keys: dict[tuple[int, str], list[tuple[int, str]]] = {}


class MetricKeys:
    """Turns a step's row blocks into ``{key: float}`` under the settings' selection and cap.

    ``rewrite`` maps a key to the backend's charset (identity for W&B); distinct keys that a
    rewrite would merge are kept apart with ``_2``, ``_3``... suffixes."""

    def __init__(self, settings: MetricSettings, what: str, rewrite: Callable[[str], str] | None = None):
        self.settings = settings
        self.what = what  # "W&B", "MLflow": for the cap's warning
        self._rewrite = rewrite
        self._families = frozenset(settings.families)
        self._stats = frozenset(settings.stats)
        patterns = settings.names
        self._names = re.compile("|".join(fnmatch.translate(p) for p in patterns)) if patterns else None
        self._each_micro = settings.micro_steps == "each"
        self._layouts: dict[tuple, _Layout | None] = {}
        self._taken: dict[str, str] = {}  # rewritten key -> raw key
        self.capped = 0  # keys refused by max_metrics
        self.families_seen: list[str] = []  # in first-seen order (W&B's x-axis per family)

    def metrics(self, blocks: Sequence[RowBlock]) -> dict[str, float]:
        out: dict[str, float | None] = {}
        if not self._each_micro:  # the last micro-step's value wins: lower ones first
            blocks = sorted(blocks, key=lambda b: -1 if b.micro_step is None else b.micro_step)
        for b in paced(blocks, 4):
            layout = self._layout(b)
            if layout is None:
                continue
            cache, keys_for, number = layout.keys, self._keys_for, float if b.plain else _number
            for name, vpp, vals in zip(b.names, b.vpp_stages, b.values):
                keys = cache.get((vpp, name))
                if keys is None:
                    keys = cache[(vpp, name)] = keys_for(layout, vpp, name)
                for i, key in keys:
                    out[key] = number(vals[i])
        if None in out.values():  # only hand-built rows hold text; a tracker takes numbers
            return {k: v for k, v in out.items() if v is not None}
        return cast(dict[str, float], out)

    def _layout(self, b: RowBlock) -> _Layout | None:
        micro = b.micro_step if self._each_micro else None
        extra = tuple(b.extra.items()) if b.extra else ()
        ident = (b.family, b.stats, extra, micro)
        try:
            return self._layouts[ident]
        except KeyError:
            pass
        except TypeError:  # an unhashable extra value: no cache for this block
            return self._new_layout(b, extra, micro)
        layout = self._layouts[ident] = self._new_layout(b, extra, micro)
        return layout

    def _new_layout(self, b: RowBlock, extra: tuple, micro: int | None) -> _Layout | None:
        family = str(b.family)
        if family in NOT_SCALAR or (self._families and family not in self._families):
            return None
        stats = [(i, s) for i, s in enumerate(b.stats) if not self._stats or s in self._stats]
        if not stats:
            return None
        if family not in self.families_seen:
            self.families_seen.append(family)
        suffix = "".join([f":{k}={extra_text(v)}" for k, v in extra])
        if micro is not None:
            suffix += f":micro{int(micro)}"
        return _Layout(family, stats, suffix)

    def _keys_for(self, layout: _Layout, vpp: int, name: str) -> list[tuple[int, str]]:
        name = str(name)
        if self._names is not None and self._names.match(name) is None:
            return []
        vp = f":vp{int(vpp)}" if vpp else ""
        keys = []
        for i, stat in layout.stats:
            key = self._take(f"{layout.family}/{stat}/{name}{vp}{layout.suffix}")
            if key is not None:
                keys.append((i, key))
        return keys

    def _take(self, raw: str) -> str | None:
        if len(self._taken) >= self.settings.max_metrics:
            self.capped += 1
            if self.capped == 1:
                logger.warning(
                    "trainmon: %s gets the first %d metric keys only (%s.max_metrics); from %s on, "
                    "new keys are not logged there (the CSV has them all); choose with %s.families, "
                    ".stats and .names",
                    self.what,
                    self.settings.max_metrics,
                    self.settings.block,
                    raw,
                    self.settings.block,
                )
            return None
        key = raw if self._rewrite is None else self._rewrite(raw)
        base, n = key, 1
        while self._taken.get(key, raw) != raw:  # another raw key already has this spelling
            n += 1
            key = f"{base}_{n}"
        self._taken[key] = raw
        return key


def _number(value: object) -> float | None:
    if isinstance(value, numbers.Real):
        return float(value)
    try:
        return float(cast(SupportsFloat, value))
    except (TypeError, ValueError):
        return None


_MLFLOW_BAD = re.compile(r"[^/\w.\- :]" if os.name != "nt" else r"[^/\w.\- ]")
_MLFLOW_KEY_MAX = 250


def mlflow_key(key: str) -> str:
    """``key`` as MLflow accepts it: characters outside letters, digits, ``_ - . / :`` and space
    become ``_`` (no ``:`` on Windows); path segments that would normalise away (empty, ``.``,
    ``..``) become underscores; keys longer than 250 characters end in a hash of the whole key."""
    key = _MLFLOW_BAD.sub("_", key)
    parts = key.split("/")
    if any([p in ("", ".", "..") for p in parts]):
        key = "/".join([p if p not in ("", ".", "..") else "_" * max(1, len(p)) for p in parts])
    if len(key) > _MLFLOW_KEY_MAX:
        digest = hashlib.sha1(key.encode()).hexdigest()[:10]
        key = key[: _MLFLOW_KEY_MAX - 11] + "_" + digest
    return key


# -- the sink --------------------------------------------------------------------------------

_STOP = object()


class MetricSink(Sink):
    """A sink that hands each step's metrics to a tracker on a worker thread of its own.

    Subclasses name the tracker (``what``, ``package``) and implement, all on the worker thread:
    ``_open`` (find the user's active run or start one), ``_log(step, wall_time, metrics)`` (or
    ``_log_steps`` for the steps held together for ``hold_s``) and ``_end`` (finish a run this sink
    started; never the user's)."""

    what: ClassVar[str] = "tracker"
    package: ClassVar[str] = ""  # the import name; its absence is one warning
    settings_schema: ClassVar[type[MetricSettings]] = MetricSettings
    hold_s: float = 0.0  # how long a step may wait to be sent with the next ones (0: at once)

    def __init__(self, options: SinkOptions, settings: MetricSettings | None = None):
        super().__init__(options)
        settings = settings or getattr(options, "settings", None)
        # the config block of this format, parsed by the loader (settings_schema); absent: the defaults
        self.settings = settings if isinstance(settings, self.settings_schema) else self.settings_schema()
        self.run_id = run_id_of(options)
        self.rank = int(options.rank)
        self.keys = MetricKeys(self.settings, self.what, self._rewrite_key())
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_STEPS)
        self._lock = threading.Lock()
        self._off = not (self.settings.all_ranks or self.rank == 0)  # rank 0 logs unless all_ranks
        self._failed: str | None = None
        self._dropped = 0
        self._opened = False
        self._closed = False
        self._thread: threading.Thread | None = None
        if not self._off and importlib.util.find_spec(self.package) is None:
            self._fail(f"the {self.package} package is not installed (pip install 'trainmon[{self.package}]')")

    # -- names of this run in the tracker ---------------------------------------------------

    @property
    def run_name(self) -> str:
        """trainmon's run id; with ``all_ranks``, one run per rank: ``<run id>-rank<R>``."""
        return f"{self.run_id}-rank{self.rank}" if self.settings.all_ranks else self.run_id

    def _rewrite_key(self) -> Callable[[str], str] | None:
        return None

    # -- writer thread ------------------------------------------------------------------------

    def write(self, rows: StepRows, step: int) -> None:
        if self._off:
            return
        metrics = self.keys.metrics(rows.blocks())
        if not metrics:
            return
        with self._lock:
            if self._closed:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=f"trainmon-{self.package}", daemon=True)
                self._thread.start()
        try:
            self._queue.put_nowait((int(step), rows.wall_time, metrics))
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1:
                logger.warning(
                    "trainmon: %s is %d steps behind; steps are skipped there until it catches up "
                    "(the CSV has them all; the count is reported at close)",
                    self.what,
                    QUEUE_STEPS,
                )

    def flush(self) -> None:
        # Deliberately no wait: flush runs on the training thread (end of collection) and a slow
        # or unreachable tracker must not hold training; close() waits, bounded by timeout_s.
        pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        atexit.unregister(self.close)
        if thread is not None:
            deadline = time.monotonic() + self.settings.timeout_s
            try:  # the queue may be full behind a hung tracker: bounded too
                self._queue.put(_STOP, timeout=self.settings.timeout_s)
            except queue.Full:
                pass
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                logger.warning(
                    "trainmon: %s did not finish within %gs (%s.timeout_s); its last steps may be missing "
                    "there (the CSV has them)",
                    self.what,
                    self.settings.timeout_s,
                    self.settings.block,
                )
        if self._dropped:
            logger.warning(
                "trainmon: %s: %d step(s) were not logged there because it fell behind (the CSV has them)",
                self.what,
                self._dropped,
            )

    # -- worker thread ------------------------------------------------------------------------

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every step handed over so far was sent (or skipped); False on timeout.
        For tests and notebooks: training never waits on a tracker."""
        with self._queue.all_tasks_done:
            return self._queue.all_tasks_done.wait_for(lambda: not self._queue.unfinished_tasks, timeout)

    def _work(self) -> None:
        held: list = []  # steps taken from the queue, sent together once hold_s has passed
        send_at = 0.0
        while True:
            try:
                wait = max(0.0, send_at - time.monotonic()) if held else None
                item = self._queue.get(timeout=wait)
            except queue.Empty:  # held long enough: send them
                self._send(held)
                continue
            if item is _STOP:
                self._send(held)
                if self._opened:
                    self._guard("finishing its run", self._end)
                self._queue.task_done()
                return
            if not self._opened and not self._off:  # at the first step: a trainer's run is still active
                self._opened = True
                if self._guard("starting", self._open):
                    atexit.register(self.close)  # after the tracker's own exit hooks: runs before them
            if not held:
                send_at = time.monotonic() + self.hold_s
            held.append(item)
            if time.monotonic() >= send_at or len(held) >= QUEUE_STEPS:
                self._send(held)

    def _send(self, held: list) -> None:
        """Sends the held steps (in one go where the tracker takes several), then marks them done
        (``wait_idle``)."""
        try:
            if held and not self._off:
                steps = f"step {held[0][0]}" if len(held) == 1 else f"steps {held[0][0]}-{held[-1][0]}"
                self._guard(f"logging {steps}", self._log_steps, held)
        finally:
            for _ in held:
                self._queue.task_done()
            held.clear()

    def _guard(self, doing: str, fn: Callable[..., None], *args: object) -> bool:
        try:
            fn(*args)
            return True
        except Exception as exc:  # any failure of the tracker: this sink stops, training goes on
            self._fail(f"{doing} failed: {type(exc).__name__}: {_one_line(exc)}")
            return False

    def _fail(self, why: str) -> None:
        self._off = True
        if self._failed is None:
            self._failed = why
            logger.warning(
                "trainmon: %s output is off for the rest of this run: %s; the CSV and other outputs "
                "continue, training is unaffected",
                self.what,
                why,
            )

    @property
    def failed(self) -> str | None:
        """Why this sink switched itself off (None while it logs)."""
        return self._failed

    def _open(self) -> None:
        raise NotImplementedError

    def _log(self, step: int, wall_time: float, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def _log_steps(self, steps: list[tuple[int, float, dict[str, float]]]) -> None:
        """Several steps at once (``hold_s`` > 0); one ``_log`` each unless the tracker does better."""
        for step in steps:
            self._log(*step)

    def _end(self) -> None:
        pass


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] + ("..." if len(text) > 300 else "")
