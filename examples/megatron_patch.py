"""trainmon for Megatron-LM, with a two-line edit or none at all.

Two-line insertion: in ``megatron/training/training.py``, function ``pretrain()``, right after

    model, optimizer, opt_param_scheduler = setup_model_and_optimizer(...)

add

    from megatron_patch import attach_trainmon   # this file, on PYTHONPATH
    attach_trainmon(model, optimizer)

Zero-edit launcher (wraps ``setup_model_and_optimizer``, then runs the script as ``__main__``):

    torchrun --nproc-per-node 8 examples/megatron_patch.py pretrain_gpt.py <pretrain_gpt args>

The config comes from ``config_path``, else ``$TRAINMON_CONFIG``, else ``./monitor_config.json``.
Megatron-LM itself needs CUDA: on a CPU machine only the hook points can be exercised (see
docs/megatron.md).
"""
from __future__ import annotations

import logging
import os
import runpy
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("trainmon.megatron_patch")

_MONITORS: list[Any] = []   # keep monitors alive for the whole run


def _start_iteration() -> int:
    """The iteration a resumed run starts at (``args.iteration`` after checkpoint load)."""
    try:
        from megatron.training import get_args

        return int(getattr(get_args(), "iteration", 0) or 0)
    except Exception:  # noqa: BLE001 - megatron.training absent or args not parsed: a fresh run
        return 0


def attach_trainmon(model: Any, optimizer: Any, config_path: str | os.PathLike | None = None) -> Any:
    """Monitor Megatron's model chunks and optimizer; returns the ``TrainerMon`` (None when there
    is no optimizer, e.g. ``--skip-train``).  Groups and the micro-batch count are read from
    Megatron when this is called, and the micro-batch count again at every step (it changes under
    ``--rampup-batch-size``)."""
    if optimizer is None:
        log.warning("trainmon: no optimizer (--skip-train?): nothing to monitor")
        return None
    from megatron.core import parallel_state as ps
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    from trainmon import TrainerMon

    path = config_path or os.environ.get("TRAINMON_CONFIG") or "monitor_config.json"
    monitor = TrainerMon(path, params_have_main_grad=True)
    monitor.set_monitor(model, grad_acc_steps=get_num_microbatches, optimizer=optimizer,
                        dp_group=ps.get_data_parallel_group(with_context_parallel=True),
                        tp_group=ps.get_tensor_model_parallel_group(),
                        start_iteration=_start_iteration())
    _MONITORS.append(monitor)
    return monitor


def install(config_path: str | os.PathLike | None = None) -> None:
    """Wrap ``megatron.training.training.setup_model_and_optimizer`` so its result is monitored."""
    import megatron.training.training as training

    original = training.setup_model_and_optimizer
    if getattr(original, "_trainmon_wrapped", False):
        return

    def setup_model_and_optimizer(*args, **kwargs):
        result = original(*args, **kwargs)
        attach_trainmon(result[0], result[1], config_path)
        return result

    setup_model_and_optimizer._trainmon_wrapped = True  # type: ignore[attr-defined]
    training.setup_model_and_optimizer = setup_model_and_optimizer


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2:
        raise SystemExit(f"usage: {Path(argv[0]).name} pretrain_gpt.py [args for it]")
    script = Path(argv[1]).resolve()
    sys.argv = [str(script), *argv[2:]]
    sys.path.insert(0, str(script.parent))
    install()
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
