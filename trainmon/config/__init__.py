"""The monitor config: the schema (``config.schema``: frozen dataclasses, one docstring per key)
and the one strict loader (``config.loading``: every problem at once, with did-you-mean).

Key names are msprobe's, so an existing msprobe ``monitor_config.json`` loads unchanged as long
as it only asks for things trainmon does.  Nothing here imports torch: the CLI and the config
watcher use it.
"""

from __future__ import annotations

from trainmon.config.loading import KNOWN_RULES, load_config, parse_config
from trainmon.config.schema import (
    BOOLEAN_KEYS,
    ESCALATION_KEYS,
    GRAD_LEVELS,
    KNOWN_FORMATS,
    L2_KEYS,
    SPEC_KEYS,
    TOP_KEYS,
    AlertConfig,
    AlertRule,
    AnomalyConfig,
    CommConfig,
    GradProbeConfig,
    IoSelect,
    MonitorConfig,
    io_select,
)

__all__ = [
    "BOOLEAN_KEYS",
    "KNOWN_FORMATS",
    "KNOWN_RULES",
    "GRAD_LEVELS",
    "L2_KEYS",
    "CommConfig",
    "AlertRule",
    "AlertConfig",
    "AnomalyConfig",
    "ESCALATION_KEYS",
    "GradProbeConfig",
    "MonitorConfig",
    "IoSelect",
    "SPEC_KEYS",
    "TOP_KEYS",
    "io_select",
    "load_config",
    "parse_config",
]
