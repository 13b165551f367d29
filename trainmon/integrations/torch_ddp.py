"""torch ``DistributedDataParallel``.

Grads: the base integration is right for DDP.  ``register_post_accumulate_grad_hook`` runs
before DDP's reducer sees a grad, so the generic weight-grad hooks read this rank's own grad,
measured inside the hook (the reducer may reduce the bucket right after); ``param.grad`` at the
optimizer step is the mean over ranks.  With ``grad_acc_steps > 1`` and no ``no_sync()``, DDP
all-reduces on every micro-batch: the last micro-batch's hook then sees the mean of the earlier
micro-batches plus this rank's last micro-batch, and that is what ``grad_unreduced`` holds (a
purely local accumulated grad never exists in memory in that setup).

Comm: DDP's bucket all-reduces are issued from C++ and never pass through the Python
``torch.distributed`` functions the comm recorder wraps.  ``record_ddp_comm`` is the opt-in
alternative: it takes DDP's single comm-hook slot, calls the user's hook (default: DDP's own
reduction, ``builtin_allreduce_hook``) and records one ``ddp_bucket`` row per bucket before and after the reduce
(the Python collectives inside the hook are covered by that row, not recorded again).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

import torch.nn as nn

from trainmon.core import dist as _dist
from trainmon.errors import TrainmonError
from trainmon.integrations.base import Integration, register_integration

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

__all__ = ["TorchDDPIntegration", "record_ddp_comm", "builtin_allreduce_hook"]


def _is_ddp(module: Any) -> TypeGuard[DistributedDataParallel]:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(module, DistributedDataParallel)


@register_integration
class TorchDDPIntegration(Integration):
    """DDP needs nothing beyond plain torch; the class documents and detects it."""

    name = "torch_ddp"
    priority = 10

    @classmethod
    def detect(cls, chunks: Sequence[nn.Module], optimizer: Any) -> bool:
        return any(_is_ddp(c) for c in chunks)


def builtin_allreduce_hook(process_group: Any, bucket: Any) -> Any:
    """DDP's reduction without a comm hook, as a comm hook, bit for bit: the mean over the group as
    DDP's reducer forms it, each grad multiplied by ``1 / world_size`` (the reducer does it while
    copying the grad into the bucket) and then summed.  torch's ``allreduce_hook`` divides by the
    world size instead, which gives other bits when it is not a power of two (3 ranks: measured),
    so a monitor that took the slot with it would change training."""
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    tensor = bucket.buffer()
    tensor.mul_(1.0 / dist.get_world_size(group))
    return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


def record_ddp_comm(monitor: Any, ddp: nn.Module, hook: Callable | None = None, state: Any = None) -> None:
    """Record DDP's bucket reduces as ``comm`` rows (opt-in; call before the first backward).

    Takes DDP's one comm-hook slot: pass the hook (and state) you would have registered yourself;
    it is called unchanged and its result returned to DDP.  Without one, DDP's own reduction runs
    (``builtin_allreduce_hook``: the same bits as DDP without a hook).  Needs ``cc_distribution.enable``.
    After ``monitor.close()`` the wrapper only calls your hook.
    """
    if not _is_ddp(ddp):
        raise TypeError(f"record_ddp_comm needs a DistributedDataParallel module, got {type(ddp).__name__}")
    comm = monitor.collector("comm")
    if comm is None:
        raise TrainmonError(
            f"{monitor.config_file_path}: cc_distribution.enable must be true (and "
            "set_monitor called) to record DDP bucket reduces"
        )
    if hook is None:  # DDP's own reduction, over DDP's own group
        hook, state = builtin_allreduce_hook, ddp.process_group if state is None else state
    ref = weakref.ref(comm)

    def recording_hook(hook_state, bucket):
        rec = ref()
        if rec is None or not rec.active or not rec.ctx.clock.collecting:
            return hook(hook_state, bucket)
        meta = {"op": "ddp_bucket", "call": rec.next_call(), "caller": f"ddp:bucket{bucket.index()}"}
        if rec._pre:
            rec.ctx.guard.run(rec, rec.capture, "ddp_bucket", "pre", [(0, 0, bucket.buffer())], meta)
        with _dist.internal():  # the bucket row stands for the hook's own collectives
            fut = hook(hook_state, bucket)

        def after(done):
            value = done.value()
            reduced = value[0] if isinstance(value, (list, tuple)) else value
            rec.ctx.guard.run(rec, rec.capture, "ddp_bucket", "post", [(0, 0, reduced)], meta)
            return value

        return fut.then(after)

    ddp.register_comm_hook(state, recording_hook)
