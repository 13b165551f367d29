"""trainmon: per-layer training-state monitor for PyTorch.

from trainmon import TrainerMon
monitor = TrainerMon("monitor_config.json")
monitor.set_monitor(model, grad_acc_steps=4, optimizer=optimizer)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainmon._version import __version__
from trainmon.errors import ConfigError, TrainmonError

if TYPE_CHECKING:  # type checkers see the real objects; at run time they load on first use
    from trainmon.collectors import register_collector
    from trainmon.config import load_config
    from trainmon.monitor import TrainerMon
    from trainmon.output.load import load_run
    from trainmon.runtime.seed import seed_all
    from trainmon.sinks.base import register_sink

__all__ = [
    "TrainerMon",
    "ConfigError",
    "TrainmonError",
    "seed_all",
    "load_config",
    "register_collector",
    "register_sink",
    "load_run",
    "__version__",
]


def __getattr__(name: str) -> Any:
    # Lazy: `import trainmon` (e.g. for the CLI) must not import torch.
    if name == "TrainerMon":
        from trainmon.monitor import TrainerMon

        return TrainerMon
    if name == "seed_all":
        from trainmon.runtime.seed import seed_all

        return seed_all
    if name == "load_config":
        from trainmon.config import load_config

        return load_config
    if name == "register_collector":
        from trainmon.collectors import register_collector

        return register_collector
    if name == "register_sink":
        from trainmon.sinks.base import register_sink

        return register_sink
    if name == "load_run":  # pandas is imported when it runs, not here
        from trainmon.output.load import load_run

        return load_run
    raise AttributeError(f"module 'trainmon' has no attribute {name!r}")
