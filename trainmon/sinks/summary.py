"""A step's summary for the trainer's own loggers (Lightning ``trainer.loggers``, the HF Trainer's
``report_to`` integrations): a few numbers per step, made on the writer thread.

The framework callbacks (``trainmon.integrations.lightning`` / ``hf``) ask for it with
``forward_to_loggers=``.  :class:`SummaryBoard` is the hand-off between the threads:

* :meth:`SummaryBoard.watch` wraps the session's sink (``SessionBuilder.build_session``).  On the
  training thread its ``write`` only counts the step and hands on a ``StepRows`` whose build also
  summarizes: the summary is made where the rows are made, by the first sink that reads them (the
  writer thread), never per row on the training thread.
* The callback, on the training thread, takes the completed summaries (:meth:`SummaryBoard.take`,
  a lock and a list swap) and, for the HF Trainer, may wait a bounded time for the step just
  handed over (:meth:`SummaryBoard.wait_for_submitted`).

Keys: ``trainmon/<family>/<stat>/<tensor name>`` per tensor and ``trainmon/<family>/<stat>`` for the
whole family (``norm``: the global norm, the square root of the sum of the tensors' squared norms;
``max``/``min``: the largest/smallest; no total for other statistics).  Families recorded per
micro-batch (activations) are not summarized.
"""

from __future__ import annotations

import difflib
import logging
import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from trainmon.families import FAMILIES
from trainmon.sinks.base import Sink
from trainmon.stats.rows import RowBlock, StepRows
from trainmon.stats.table import STAT_NAMES

__all__ = ["SummarySpec", "SummaryBoard", "summary_spec"]

logger = logging.getLogger(__name__)

PREFIX = "trainmon"
# Completed summaries kept until a callback takes them; older ones are dropped (they are in the files).
MAX_PENDING = 64
_ALL_STATS = frozenset(STAT_NAMES) | {s for info in FAMILIES.values() for s in info.own_stats}


@dataclass(frozen=True)
class SummarySpec:
    """What a step's summary holds.

    Args:
        families: the families summarized (``Family`` names).
        stats: the statistics kept (``None``: every one the family records).
        names: tensor names or ``fnmatch`` patterns (``"*.mlp.*"``) kept per tensor (``None``: all).
        per_tensor: one key per tensor (``trainmon/<family>/<stat>/<name>``).
        totals: one key per family and statistic (``trainmon/<family>/<stat>``: global norm, max, min),
            over every tensor of the family (``names`` does not narrow it).
    """

    families: tuple[str, ...] = ("grad_reduced", "update_ratio")
    stats: tuple[str, ...] | None = ("norm", "update_ratio")
    names: tuple[str, ...] | None = None
    per_tensor: bool = True
    totals: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "families", tuple(self.families))
        _check("family", self.families, FAMILIES)
        if self.stats is not None:
            object.__setattr__(self, "stats", tuple(self.stats))
            _check("stat", self.stats, _ALL_STATS)
        if self.names is not None:
            names = (self.names,) if isinstance(self.names, str) else tuple(self.names)
            object.__setattr__(self, "names", names)


def _check(what: str, values: Sequence[str], allowed: Iterable[str]) -> None:
    allowed = sorted(str(a) for a in allowed)
    for value in values:
        if value not in allowed:
            close = difflib.get_close_matches(str(value), allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"trainmon: forward_to_loggers: unknown {what} {value!r}{hint}; allowed: {', '.join(allowed)}"
            )


def summary_spec(forward: Any) -> SummarySpec | None:
    """The callbacks' ``forward_to_loggers`` argument as a spec: False/None (off), True (the
    default spec), a family name or a list of them (every statistic of those families), or a
    :class:`SummarySpec`."""
    if forward is None or forward is False:
        return None
    if forward is True:
        return SummarySpec()
    if isinstance(forward, SummarySpec):
        return forward
    if isinstance(forward, str):
        return SummarySpec(families=(forward,), stats=None)
    if isinstance(forward, Iterable) and all([isinstance(f, str) for f in forward]):
        return SummarySpec(families=tuple(forward), stats=None)
    raise ValueError(
        f"trainmon: forward_to_loggers={forward!r}: must be True/False, a family name, a list of family "
        "names or a trainmon.sinks.summary.SummarySpec"
    )


class _Totals:
    """A family's running total of one statistic."""

    __slots__ = ("kind", "squares", "value")

    def __init__(self, kind: str):
        self.kind = kind
        self.squares = 0.0  # norm: the sum of the squared norms
        self.value: float | None = None  # max / min

    def add(self, v: float) -> None:
        if self.kind == "norm":
            self.squares += v * v
            return
        current = self.value
        if current is not None and current != current:  # a NaN stays: the family holds one
            return
        if current is None or v != v or (v > current if self.kind == "max" else v < current):
            self.value = v

    def result(self) -> float | None:
        if self.kind == "norm":
            return math.sqrt(self.squares)
        return self.value


_TOTAL_KINDS = frozenset({"norm", "max", "min"})


class SummaryBoard:
    """Summaries made on the writer thread, taken on the training thread (thread-safe)."""

    def __init__(self, spec: SummarySpec):
        self.spec = spec
        self._families = frozenset(spec.families)
        self._cond = threading.Condition()
        self._pending: list[tuple[int, dict[str, float]]] = []
        self._submitted = 0  # writes handed to the sink (training thread)
        self._done = 0  # of them, summarized (writer thread)
        self._name_kept: dict[str, bool] = {}
        self._warned = False

    # -- the session side --------------------------------------------------------------------

    def watch(self, sink: Sink) -> Sink:
        """``sink``, its rows summarized on their way (see the module's doc)."""
        return _Tap(sink, self)

    def _submit(self) -> int:
        with self._cond:
            self._submitted += 1
            return self._submitted

    def _publish(self, ticket: int, step: int, blocks: list[RowBlock]) -> None:
        try:
            values = self.summarize(blocks)
        except Exception as exc:  # never let the summary cost the files their rows
            values = {}
            if not self._warned:
                self._warned = True
                logger.warning(
                    "trainmon: the summary for the trainer's loggers failed (%s: %s); those loggers get no "
                    "trainmon values, the files are unaffected",
                    type(exc).__name__,
                    exc,
                )
        with self._cond:
            if values:
                if self._pending and self._pending[-1][0] == step:  # a step's late rows (record_loss)
                    self._pending[-1][1].update(values)
                else:
                    self._pending.append((step, values))
                    del self._pending[:-MAX_PENDING]
            self._done = max(self._done, ticket)
            self._cond.notify_all()

    def summarize(self, blocks: Iterable[RowBlock]) -> dict[str, float]:
        """One step's keys and values (writer thread)."""
        spec, out = self.spec, {}
        totals: dict[str, _Totals] = {}
        for block in blocks:
            if block.family not in self._families or block.micro_step is not None:
                continue
            cols = [(i, s) for i, s in enumerate(block.stats) if spec.stats is None or s in spec.stats]
            if not cols:
                continue
            base = f"{PREFIX}/{block.family}/"
            for name, vpp, vals in zip(block.names, block.vpp_stages, block.values):
                shown = name if vpp == 0 else f"vpp{vpp}.{name}"
                keep = spec.per_tensor and self._keeps(name)
                for i, stat in cols:
                    v = vals[i]
                    if not isinstance(v, (int, float)):
                        continue
                    v = float(v)
                    if keep:
                        out[f"{base}{stat}/{shown}"] = v
                    if spec.totals and stat in _TOTAL_KINDS:
                        totals.setdefault(f"{base}{stat}", _Totals(stat)).add(v)
        for key, total in totals.items():
            result = total.result()
            if result is not None:
                out[key] = result
        return out

    def _keeps(self, name: str) -> bool:
        kept = self._name_kept.get(name)
        if kept is None:
            pats = self.spec.names
            kept = self._name_kept[name] = pats is None or any([fnmatchcase(name, p) for p in pats])
        return kept

    # -- the callback side (training thread) ---------------------------------------------------

    def take(self) -> list[tuple[int, dict[str, float]]]:
        """The completed summaries not taken yet, oldest first: ``(step, {key: value})``."""
        with self._cond:
            taken, self._pending = self._pending, []
        return taken

    def wait_for_submitted(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until every step handed to the sink so far is summarized."""
        with self._cond:
            target = self._submitted
            return self._cond.wait_for(lambda: self._done >= target, timeout)


class _Tap(Sink):
    """The session's sink with the board's summary made where the rows are built."""

    def __init__(self, inner: Sink, board: SummaryBoard):
        super().__init__(inner.options)
        self.inner, self.board = inner, board

    def write(self, rows: StepRows, step: int) -> None:
        ticket = self.board._submit()
        board = self.board

        def build() -> list[RowBlock]:
            blocks = rows.blocks()
            board._publish(ticket, step, blocks)
            return blocks

        self.inner.write(StepRows(build, rows.wall_time), step)

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        self.inner.close()
