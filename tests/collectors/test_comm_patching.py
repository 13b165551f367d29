"""The comm recorder's patching, in one process: installed on set_monitor, put back exactly on
close, and a wrapper someone installed over ours is left alone."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from trainmon import TrainerMon
from trainmon.collectors.comm import COMM_OPS as ALL_OPS

COMM_OPS = [n for n in ALL_OPS if hasattr(dist, n)]


def test_wrapped_on_set_monitor_restored_on_close(output_root, make_config):
    before = {n: getattr(dist, n) for n in COMM_OPS}
    c10d_before = {n: getattr(c10d, n) for n in COMM_OPS}
    model = torch.nn.Linear(2, 2)
    mon = TrainerMon(make_config(cc_distribution={"enable": True}))
    mon.set_monitor(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert all(getattr(dist, n) is not before[n] for n in COMM_OPS)
    assert all(getattr(dist, n).__trainmon_original__ is before[n] for n in COMM_OPS)
    assert c10d.isend is dist.isend and c10d.all_reduce is c10d_before["all_reduce"]
    theirs = lambda *a, **k: None  # noqa: E731 - someone else's wrapper, installed after ours
    ours = dist.broadcast
    dist.broadcast = theirs
    mon.close()
    mon.close()  # idempotent
    assert dist.broadcast is theirs
    dist.broadcast = before["broadcast"]
    assert all(getattr(dist, n) is before[n] for n in COMM_OPS)
    assert all(getattr(c10d, n) is c10d_before[n] for n in COMM_OPS)
    assert ours.__trainmon_original__ is before["broadcast"]


def test_second_set_monitor_does_not_stack_wrappers(output_root, make_config):
    before = dist.all_reduce
    model = torch.nn.Linear(2, 2)
    mon = TrainerMon(make_config(cc_distribution={"enable": True}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon.set_monitor(model, optimizer=opt)
    mon.set_monitor(model, optimizer=opt)
    assert dist.all_reduce.__trainmon_original__ is before
    mon.close()
    assert dist.all_reduce is before
