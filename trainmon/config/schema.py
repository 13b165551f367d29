"""The monitor config's schema: frozen dataclasses, one field per key, one docstring per key.

Key names are msprobe's.  Each top-level key is a field of :class:`MonitorConfig` made with
:func:`key` (its default and its one-line doc; docs/configuration.md has the full text, in the
same order); what the loader (``config.loading``) needs to know besides is derived from the
fields: :data:`BOOLEAN_KEYS` (the ``bool`` fields), :data:`ESCALATION_KEYS` (``escalates=True``),
:data:`TOP_KEYS` (every key, in this order).  No torch here.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trainmon.stats.table import DEFAULT_OPS

__all__ = [
    "BOOLEAN_KEYS",
    "ESCALATION_KEYS",
    "GRAD_LEVELS",
    "KNOWN_FORMATS",
    "L2_KEYS",
    "SPEC_KEYS",
    "TOP_KEYS",
    "AlertConfig",
    "AlertRule",
    "AnomalyConfig",
    "CommConfig",
    "GradProbeConfig",
    "IoSelect",
    "MonitorConfig",
    "io_select",
    "key",
    "key_doc",
]

# The built-in output formats.  ``format`` may also name a sink registered with register_sink or
# advertised by an installed package (entry-point group ``trainmon.sinks``): the loader checks a
# name's spelling only; runtime.features checks that it exists when the monitor attaches.
KNOWN_FORMATS: tuple[str, ...] = ("csv", "tensorboard", "parquet", "wandb", "mlflow")

# msprobe's per-target spec keys: which of a module's tensors ``actv`` / ``actv_grad`` record.
SPEC_KEYS: tuple[str, ...] = ("input", "output", "input_grad", "output_grad")
SPEC_VALUE = re.compile(r"^(?:tensor|tuple\[(\d+)\](?::(\d+))?)$")
SPEC_EXPECT = '"tensor", "tuple[N]" or "tuple[N]:i" with 0 <= i < N'
# msprobe's attention/linear "L2 features": accepted so its configs load, not recorded (one warning).
L2_KEYS: tuple[str, ...] = ("recording_l2_features", "l2_targets", "sa_order")
GRAD_LEVELS: tuple[str, ...] = ("L0", "L1", "L2")


def key(default: Any, doc: str, *, escalates: bool = False, **options: Any) -> Any:
    """A config key: a dataclass field with its default and its docstring (``key_doc``);
    ``escalates``: ``on_anomaly.config`` may change it (what is recorded, not when or where)."""
    return field(default=default, metadata={"doc": doc, "escalates": escalates}, **options)


def key_doc(config: type, name: str) -> str:
    """The docstring of key ``name`` of a config dataclass."""
    return next(f.metadata["doc"] for f in dataclasses.fields(config) if f.name == name)


@dataclass(frozen=True)
class IoSelect:
    """A parsed spec value: the module's tensors of that kind are ``count`` many (msprobe's
    ``tuple[N]``; ``tensor`` is one) and ``index`` is the one recorded (None: all of them)."""

    count: int
    index: int | None


def io_select(text: str) -> IoSelect:
    """``"tensor"`` -> IoSelect(1, 0); ``"tuple[2]:0"`` -> IoSelect(2, 0); ``"tuple[3]"`` -> all 3.
    ``text`` is one the loader accepted."""
    m = SPEC_VALUE.match(text)
    if m is None:
        raise ValueError(f"not a per-target spec: {text!r} ({SPEC_EXPECT})")
    if m.group(1) is None:
        return IoSelect(1, 0)
    return IoSelect(int(m.group(1)), None if m.group(2) is None else int(m.group(2)))


@dataclass(frozen=True)
class CommConfig:
    """``cc_distribution``: statistics of tensors passed to torch.distributed collectives."""

    enable: bool = key(False, "record the tensors of torch.distributed collectives (family comm)")
    cc_codeline: tuple[str, ...] = key((), "only calls whose file:line one of these regexes matches; () = all")
    cc_pre_hook: bool = key(False, "also record the tensors before the collective runs")


@dataclass(frozen=True)
class AlertRule:
    """One anomaly rule; ``args`` is a plain dict of the rule's validated arguments."""

    rule_name: str
    # A dict cannot be hashed; leaving it out of the hash keeps configs usable as dict keys.
    args: Mapping[str, object] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class AlertConfig:
    """``alert``: the run-time anomaly rules."""

    rules: tuple[AlertRule, ...] = key((), "anomaly rules applied to every recorded statistic")
    dump: bool = key(False, "msprobe's key, accepted; alerts always go to anomalies.jsonl")


@dataclass(frozen=True)
class GradProbeConfig:
    """``grad_probe`` (msprobe's gradient probe): L0 statistics, L1 + intervals, L2 + direction."""

    grad_level: str = key("L1", "L0 statistics, L1 + interval fractions, L2 + sign sample")
    param_list: tuple[str, ...] = key((), "params (or module prefixes) to probe; () = every param")
    bounds: tuple[float, ...] = key((-1.0, 0.0, 1.0), "strictly increasing finite cut points of the L1 intervals")

    @property
    def level(self) -> int:
        return GRAD_LEVELS.index(self.grad_level)


@dataclass(frozen=True)
class AnomalyConfig:
    """``on_anomaly``: what to record for ``steps`` steps after a run-time alert (docs/escalation.md).

    ``config`` holds the partial config's keys, parsed by the same section parsers as the top level
    (so ``MonitorConfig.escalated`` is ``dataclasses.replace`` of them).
    """

    config: Mapping[str, Any] = field(
        default_factory=dict, hash=False, metadata={"doc": "the partial config recorded during a window"}
    )
    steps: int = key(1, "window length in steps after the alert's step")
    max_times: int = key(1, "escalations per run at most")
    history_steps: int = key(0, "flight recorder: steps before the alert kept in memory, written on an alert")


@dataclass(frozen=True)
class MonitorConfig:
    """A validated monitor config.  The keys' order is docs/configuration.md's (a test checks)."""

    targets: tuple[str, ...] = key((), "modules and parameters to monitor; () = everything", escalates=True)
    start_step: int = key(0, "first step recorded")
    step_interval: int = key(1, "record every N-th step from start_step")
    collect_times: int | None = key(None, "stop after this many recorded steps; None = no limit")
    format: tuple[str, ...] = key(("csv",), "output sinks: each gets the same rows")
    ops: tuple[str, ...] = key(DEFAULT_OPS, "statistics per tensor, in this order", escalates=True)
    eps: float = key(1e-8, "abs below this counts as zero for 'zeros'", escalates=True)
    ndigits: int | None = key(None, "significant digits of CSV floats; None = full precision")
    wg_distribution: bool = key(False, "weight grads: grad_unreduced and grad_reduced", escalates=True)
    mv_distribution: bool = key(False, "optimizer state after the step, one family per state key", escalates=True)
    param_distribution: bool = key(False, "params: param_origin and param_updated", escalates=True)
    ur_distribution: bool = key(False, "update ratio", escalates=True)
    xy_distribution: bool = key(False, "module inputs/outputs and their grads: actv, actv_grad", escalates=True)
    forward_only: bool = key(False, "with xy_distribution: activations only", escalates=True)
    backward_only: bool = key(False, "with xy_distribution: activation grads only", escalates=True)
    all_xy: bool = key(False, "with xy_distribution: every module called", escalates=True)
    print_struct: bool = key(False, "write module_struct.json after the first forward")
    squash_name: bool = key(False, "shorten activation names from their layers./embedding* segment", escalates=True)
    module_ranks: tuple[int, ...] = key((), "ranks that write output; () = all")
    # msprobe's default is 1 (one file per family per step: a 100k-step run is 100,000 files per
    # family, hard on shared file systems and on every reader); a config that sets 1 keeps it.
    step_count_per_record: int = key(100, "steps per family file")
    global_layer_names: bool = key(False, "Megatron PP/VPP: name layers by their global layer_number")
    replicated_once: bool = key(False, "plain DDP: replicated families written on data-parallel rank 0 only")
    dynamic_on: bool = key(False, "dynamic mode: collect while true")
    monitor_mbs_grad: bool = key(False, "grad_unreduced once per micro-batch (its own local grad)")
    stack_info: bool = key(False, "stack_info.csv: where each recorded module is called from")
    recording_l2_features: bool = key(False, "msprobe's L2 features: accepted, not recorded")
    l2_targets: tuple[tuple[str, tuple[str, ...]], ...] = key((), "msprobe's L2 features: accepted, not recorded")
    sa_order: str = key("", "msprobe's L2 features: accepted, not recorded")
    # (RUF009 below: ``key`` is ``dataclasses.field``, and these defaults are frozen or None)
    cc_distribution: CommConfig = key(CommConfig(), "collective-communication statistics", escalates=True)  # noqa: RUF009
    alert: AlertConfig = key(AlertConfig(), "run-time anomaly rules")  # noqa: RUF009
    grad_probe: GradProbeConfig | None = key(None, "msprobe's gradient probe; None = off")  # noqa: RUF009
    loss_alignment: bool = key(False, "model metadata, hyperparams and model_input families")
    on_anomaly: AnomalyConfig | None = key(None, "escalation after a run-time alert; None = off")  # noqa: RUF009
    # Not keys of their own: derived by the loader.
    # (target, ((spec key, spec value), ...)) for targets written with a non-empty spec object;
    # written back under ``targets`` by to_dict.
    target_specs: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()
    # (format, its raw config block) for each top-level key named like a listed format; checked
    # against that sink's settings_schema when the monitor attaches (runtime.features)
    sink_settings: tuple[tuple[str, Mapping[str, Any]], ...] = field(default=(), hash=False)
    source: str = field(default="", compare=False)

    def to_dict(self) -> dict[str, object]:
        """The config as JSON-ready data that ``parse_config`` turns back into an equal config."""
        data = dataclasses.asdict(self)
        del data["source"]
        specs = {name: dict(spec) for name, spec in data.pop("target_specs")}
        if specs:
            data["targets"] = {name: specs.get(name, {}) for name in self.targets}
        data["l2_targets"] = {hook: list(names) for hook, names in self.l2_targets}
        data.update(dict(data.pop("sink_settings")))  # each block under its format's name
        return json.loads(json.dumps(data))  # tuples -> lists, deep copies of rule args

    def spec_of(self, target: str) -> dict[str, IoSelect]:
        """The parsed per-target spec of ``target`` as written in ``targets`` ({} when none)."""
        for name, spec in self.target_specs:
            if name == target:
                return {k: io_select(value) for k, value in spec}
        return {}

    def unrecorded_keys(self) -> tuple[str, ...]:
        """msprobe keys this config sets that trainmon accepts but records nothing for."""
        return tuple(k for k in L2_KEYS if getattr(self, k))

    def escalated(self) -> MonitorConfig:
        """This config with ``on_anomaly.config`` applied (its keys replace the base's), without
        ``on_anomaly``: what an escalation window records (its schedule is set by the window)."""
        if self.on_anomaly is None:
            return self
        return dataclasses.replace(self, **dict(self.on_anomaly.config), on_anomaly=None)


_KEY_FIELDS = [f for f in dataclasses.fields(MonitorConfig) if "doc" in f.metadata]
TOP_KEYS: tuple[str, ...] = tuple(f.name for f in _KEY_FIELDS)
BOOLEAN_KEYS: tuple[str, ...] = tuple(f.name for f in _KEY_FIELDS if f.type == "bool")
# What an escalation's partial config may change: what is recorded, not when or where (the window
# is the schedule; outputs, ranks and alert rules stay the base config's).
ESCALATION_KEYS: tuple[str, ...] = tuple(f.name for f in _KEY_FIELDS if f.metadata["escalates"])
