"""Comm-op recording on real gloo ranks: every call the test makes is one set of rows with the
tensors' own stats, async ops are recorded on completion, nothing is lost at the end of the run,
the cc_codeline filter works, DDP's bucket reduces come through the opt-in comm hook, and every
torch.distributed attribute is back in place after close()."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.nn.parallel import DistributedDataParallel as DDP

from tests._support.runs import read_family, reference_stats
from tests._support.dist_checks import filtered_all_reduce, rank_dir, tiny_model, write_config
from tests._support.distributed import run_distributed
from trainmon import TrainerMon
from trainmon.collectors.comm import COMM_OPS as ALL_OPS
from trainmon.integrations.torch_ddp import record_ddp_comm

pytestmark = pytest.mark.slow   # real multi-process gloo jobs

OPS = ["norm", "mean", "min", "max"]
COMM_OPS = [n for n in ALL_OPS if hasattr(dist, n)]


class _Log:
    """What the test did: expected rows ``(step, op, call, when, arg, item) -> tensor``."""

    def __init__(self, pre: bool):
        self.rows: dict[tuple, torch.Tensor] = {}
        self.pre = pre
        self.step, self.call = 0, 0

    def around(self, op, tensors, fn):
        """``tensors``: ``(arg, item, tensor)``; records them before and after ``fn()``."""
        if self.pre:
            for arg, item, t in tensors:
                self.rows[(self.step, op, self.call, "pre", arg, item)] = t.clone()
        result = fn()
        if isinstance(result, list):
            for w in result:
                w.wait()
        elif hasattr(result, "wait"):
            result.wait()
        for arg, item, t in tensors:
            self.rows[(self.step, op, self.call, "post", arg, item)] = t.clone()
        self.call += 1

    def next_step(self):
        self.step, self.call = self.step + 1, 0


def _calls(rank, world, log: _Log):
    v = lambda k: torch.arange(4, dtype=torch.float32) * (rank + 1) + k  # noqa: E731
    a, b, c, d, e = v(1), v(2), v(3), v(4), v(5)
    log.around("all_reduce", [(0, 0, a)], lambda: dist.all_reduce(a))
    log.around("broadcast", [(0, 0, b)], lambda: dist.broadcast(b, src=0))
    log.around("all_reduce", [(0, 0, c)], lambda: dist.all_reduce(c, async_op=True))
    lst = [torch.zeros(4) for _ in range(world)]
    log.around("all_gather", [(0, i, t) for i, t in enumerate(lst)] + [(1, 0, d)],
               lambda: dist.all_gather(lst, d))
    out = torch.zeros(4 * world)
    log.around("all_gather_into_tensor", [(0, 0, out), (1, 0, e)],
               lambda: dist.all_gather_into_tensor(out, e))
    s, r = v(6), torch.zeros(4)
    ops = [dist.P2POp(dist.isend, s, (rank + 1) % world), dist.P2POp(dist.irecv, r, (rank - 1) % world)]
    log.around("batch_isend_irecv", [(0, 0, s), (0, 1, r)], lambda: dist.batch_isend_irecv(ops))
    x = v(7) if rank == 0 else torch.zeros(4)
    if rank == 0:
        log.around("send", [(0, 0, x)], lambda: dist.send(x, 1))
    else:
        log.around("recv", [(0, 0, x)], lambda: dist.recv(x, 0))
    y = v(8)
    log.around("isend" if rank == 0 else "irecv", [(0, 0, y)],
               lambda: dist.isend(y, 1) if rank == 0 else dist.irecv(y, 0))
    f = v(9)
    log.around("reduce", [(0, 0, f)], lambda: dist.reduce(f, dst=0))


def _ring(rank, world):
    send, recv = torch.full((3,), float(rank)), torch.zeros(3)
    return [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]


def _run_ring(rank, world, ops):
    ops[1].tensor.zero_()
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert ops[1].tensor.tolist() == [float((rank - 1) % world)] * 3


def _train_step(model, opt):
    torch.nn.functional.mse_loss(model(torch.ones(2, 6)), torch.zeros(2, 3)).backward()
    opt.step()
    opt.zero_grad()


def _comm_body(rank, world, tmp):
    originals = {n: getattr(dist, n) for n in COMM_OPS}
    c10d_originals = {n: getattr(c10d, n) for n in COMM_OPS}
    results = {}
    for run_id, pre, codeline in (("all-pre", True, []), ("filtered", False, [r"dist_checks\.py:\d+$"])):
        os.environ["TRAINMON_RUN_ID"] = run_id
        cfg = write_config(tmp / f"{run_id}.json", ops=OPS, cc_distribution={
            "enable": True, "cc_pre_hook": pre, "cc_codeline": codeline})
        model = tiny_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        early = _ring(rank, world)   # P2POps built before the wrap hold the original isend/irecv
        mon = TrainerMon(cfg)
        mon.set_monitor(model, optimizer=opt)
        log = _Log(pre)
        for step in range(2):
            _calls(rank, world, log)
            filtered_all_reduce(torch.ones(3) * rank)  # called in dist_checks.py (see the filter)
            log.call += 1
            _train_step(model, opt)
            log.next_step()
        if codeline:  # filtered out (called from this file): they must only work
            _run_ring(rank, world, early)
            late = _ring(rank, world)   # built while wrapped, run after close() below
        tail = torch.full((2,), float(rank))  # after the last step: must still be written
        log.around("all_reduce", [(0, 0, tail)], lambda: dist.all_reduce(tail))
        mon.close()
        assert all(getattr(dist, n) is originals[n] for n in COMM_OPS)
        assert all(getattr(c10d, n) is c10d_originals[n] for n in COMM_OPS)
        if codeline:
            _run_ring(rank, world, late)
        out = rank_dir(run_id, rank)
        if codeline:
            # the only selected call: all_reduce from dist_checks.py, call index counts every call
            df = read_family(out, "comm")
            assert len(df) == 2 and set(df["name"]) == {"all_reduce"}, df
            assert list(df["call"]) == [9, 9] and list(df["step"]) == [0, 1], df
            assert all(c.rsplit(":", 1)[0].endswith("dist_checks.py") for c in df["caller"])
            assert df["norm"].tolist() == [torch.full((3,), float(sum(range(world))), dtype=torch.float64).norm().item()] * 2
        else:
            # the filtered_all_reduce call is recorded here too: add its rows before comparing
            for step in range(2):
                total = torch.full((3,), float(sum(range(world))))
                log.rows[(step, "all_reduce", 9, "pre", 0, 0)] = torch.ones(3) * rank
                log.rows[(step, "all_reduce", 9, "post", 0, 0)] = total
            df = read_family(out, "comm")
            assert len(df[df["caller"].str.contains("dist_checks.py")]) == 4
            _check_rows(out, log)
        results[run_id] = len(read_family(out, "comm"))
    return results


def _check_rows(out_dir, log: _Log):
    df = read_family(out_dir, "comm")
    got = {(int(r.step), r.name, int(r.call), r.when, int(r.arg), int(r.item)): r for r in df.itertuples()}
    assert sorted(got) == sorted(log.rows), sorted(set(got) ^ set(log.rows))
    for key, tensor in log.rows.items():
        row, ref = got[key], reference_stats(tensor)
        for op in OPS:
            assert abs(getattr(row, op) - ref[op]) <= 1e-6 * max(1.0, abs(ref[op])), (key, op, getattr(row, op))
        assert row.shape == str(list(tensor.shape)) and row.dtype == "torch.float32"
        assert row.caller.rsplit(":", 1)[0].endswith(("test_comm.py", "dist_checks.py")), row.caller
    assert list(df.columns[:9]) == ["vpp_stage", "name", "step", "call", "when", "arg", "item", "caller",
                                    "norm"], list(df.columns)


def test_comm_rows_match_the_calls_made(output_root, tmp_path):
    counts = run_distributed(_comm_body, world_size=2, timeout=120, args=(tmp_path,))
    assert counts[0]["filtered"] == counts[1]["filtered"] == 2
    assert counts[0]["all-pre"] == counts[1]["all-pre"] > 40


def _ddp_hook_body(rank, world, tmp):
    os.environ["TRAINMON_RUN_ID"] = "ddp-hook"
    cfg = write_config(tmp / "ddp.json", ops=OPS, cc_distribution={"enable": True, "cc_pre_hook": True})
    model = tiny_model()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    mon = TrainerMon(cfg)
    mon.set_monitor(ddp, optimizer=opt)
    seen = []

    def user_hook(state, bucket):   # the user's own hook keeps running
        seen.append(bucket.index())
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        return allreduce_hook(state, bucket)

    record_ddp_comm(mon, ddp, hook=user_hook)
    try:
        ddp.register_comm_hook(None, user_hook)
        raise AssertionError("DDP accepted a second comm hook")
    except RuntimeError as exc:
        assert "only be called once" in str(exc)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    torch.nn.functional.mse_loss(ddp(x), torch.zeros(4, 3)).backward()
    local = torch.cat([p.grad.detach().reshape(-1) for p in model.parameters()])  # after reduce: mean
    opt.step()
    mon.close()
    df = read_family(rank_dir("ddp-hook", rank), "comm")
    assert seen and set(df["name"]) == {"ddp_bucket"}
    post = df[df["when"] == "post"]
    pre = df[df["when"] == "pre"]
    assert len(pre) == len(post) == len(seen)
    # one bucket holds every grad of this tiny model: post rows are the mean grads' stats
    ref = reference_stats(local)
    assert abs(post["norm"].sum() ** 2 - ref["norm"] ** 2) < 1e-5 * ref["norm"] ** 2
    return pre["norm"].tolist()


def test_ddp_comm_hook_recorder_chains_the_users_hook(output_root, tmp_path):
    pre = run_distributed(_ddp_hook_body, world_size=2, timeout=120, args=(tmp_path,))
    assert pre[0] != pre[1]   # before the reduce, each rank's bucket holds its own grads
