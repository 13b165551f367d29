"""``"format": ["wandb"]``: each collected step's rows as Weights & Biases metrics.

Keys, selection, ranks and failure handling: :mod:`trainmon.sinks.metrics` (docs/loggers.md).
W&B specifics:

* **Which run.** The user's active run (``wandb.run``: the one ``wandb.init`` made, or the
  HF/Lightning integration's) when there is one at the first collected step; else a run of this
  sink's own, named after trainmon's run id (``<run id>-rank<R>`` in group ``<run id>`` with
  ``all_ranks``), started with ``reinit="create_new"`` so that it never becomes ``wandb.run`` and
  never finishes or replaces a run the user starts later.  Mode, project, entity and directory come
  from the user's environment (``WANDB_MODE``, ``WANDB_PROJECT``, ``WANDB_DIR``, ...) unless the
  ``"wandb"`` block sets them.  Only a run this sink started is finished at close.
* **Steps.** Rows are logged with ``step=<training step>`` and also carry ``trainmon/step``, the
  x-axis of trainmon's keys (``define_metric``).  W&B keeps a run's steps increasing and drops,
  with its own warning, a row for a step the run's counter is already past: in a user's run
  that counts its own steps ahead of training's (several ``wandb.log`` calls per step without
  ``step=``), set ``"reuse_run": false`` to give trainmon a run of its own.  Rows are never logged
  without ``step=``: that would move the user's counter and make W&B drop the user's rows.
* **Values.** Python floats, at full precision; W&B stores NaN and +-inf as they are.
* **Where W&B's Python runs.** A run of the sink's own lives in a child process
  (:mod:`trainmon.sinks.wandb_run`): W&B's ~3 µs of Python per key run there, not under the
  training process's GIL.  A user's run is theirs, in their process: logging into it costs that
  Python here, on the sink's worker thread.
* ``wandb`` is imported in the child, or (for a user's run) already by the user: never by this module.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from trainmon.sinks.base import SinkOptions, register_sink

if importlib.util.find_spec("wandb") is None:  # "format": ["wandb"] without it: a config error at attach
    raise ImportError("No module named 'wandb'")
from trainmon.sinks.metrics import MetricSettings, MetricSink
from trainmon.sinks.wandb_run import ChildRun

__all__ = ["WandbSink", "WandbSettings", "STEP_KEY"]

STEP_KEY = "trainmon/step"
# keys per run.log call: each call costs ~1 ms of fixed Python work in wandb (its publish path),
# the keys ~3 µs each; 2,048 keys a call is one call a step for most runs (measured: 1,590 keys in
# 7 calls of 256 took 5.7-8.5 ms of CPU a step, in one call 4.3-5.3 ms)
LOG_CHUNK = 2048


@dataclass(frozen=True)
class WandbSettings(MetricSettings):
    """The ``"wandb"`` config block.  ``reuse_run``: log into the user's active run when there is
    one (else always a run of trainmon's own).  ``project``, ``entity`` and ``mode`` (``"online"``,
    ``"offline"``, ``"disabled"``) apply to a run the sink starts; None leaves them to W&B (its
    environment variables, then its defaults)."""

    block: ClassVar[str] = "wandb"

    reuse_run: bool = True
    project: str | None = None
    entity: str | None = None
    mode: Literal["online", "offline", "disabled", "shared"] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.reuse_run, bool):
            raise ValueError(f"wandb.reuse_run: {self.reuse_run!r} is not true or false")
        for key in ("project", "entity"):
            value = getattr(self, key)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"wandb.{key}: {value!r} is not a non-empty string")
        if self.mode is not None and self.mode not in ("online", "offline", "disabled", "shared"):
            raise ValueError(f"wandb.mode: {self.mode!r} is not one of: online, offline, disabled, shared")


@register_sink("wandb")
class WandbSink(MetricSink):
    """Logs ``<family>/<stat>/<name>`` metrics to W&B (see the module docstring)."""

    what = "W&B"
    package = "wandb"
    settings_schema = WandbSettings

    def __init__(self, options: SinkOptions, settings: WandbSettings | None = None):
        super().__init__(options, settings)
        self.run: Any = None
        self.own_run = False
        self._axes: set[str] = set()  # families whose x-axis is set

    def _open(self) -> None:
        # A user's run exists only where the user imported wandb: no import here otherwise.
        settings, wandb = self.settings, sys.modules.get("wandb")
        assert isinstance(settings, WandbSettings)
        user_run = getattr(wandb, "run", None) if settings.reuse_run else None
        if user_run is not None:
            self.run = user_run
        else:
            self.run = ChildRun(self._init_args(), settings.timeout_s)
            self.own_run = True
        self.run.define_metric(STEP_KEY)

    def _init_args(self) -> dict[str, Any]:
        """``wandb.init``'s arguments for a run of the sink's own (``wandb_run.OwnRun`` adds the
        settings: quiet, no console capture)."""
        s = self.settings
        assert isinstance(s, WandbSettings)
        args: dict[str, Any] = {
            "name": self.run_name,
            "job_type": "trainmon",
            "config": {"trainmon_run_id": self.run_id, "trainmon_rank": self.rank},
            "reinit": "create_new",  # never wandb.run: the user's own wandb.init stays theirs
        }
        if s.all_ranks:
            args["group"] = self.run_id
        args.update({k: v for k, v in (("project", s.project), ("entity", s.entity), ("mode", s.mode)) if v})
        return args

    def _log(self, step: int, wall_time: float, metrics: dict[str, float]) -> None:
        run = self.run
        for family in self.keys.families_seen:
            if family not in self._axes:
                self._axes.add(family)
                run.define_metric(f"{family}/*", step_metric=STEP_KEY)
        items = [(STEP_KEY, step), *metrics.items()]
        # Pieces of one row for very large selections (W&B merges the logs of one step): the GIL
        # is offered between them, since wandb's log is Python work per key that the training
        # thread would wait for.
        for i in range(0, len(items), LOG_CHUNK):
            run.log(dict(items[i : i + LOG_CHUNK]), step=step)
            time.sleep(0)

    def _end(self) -> None:
        if self.own_run and self.run is not None:
            self.run.finish()
