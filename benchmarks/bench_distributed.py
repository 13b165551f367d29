"""Cost of trainmon under DDP and of the comm-op recorder, on 2 forked gloo ranks (CPU).

    OMP_NUM_THREADS=1 python benchmarks/bench_distributed.py [--steps 30]

Prints medians of interleaved runs as ratios to the same run without the monitor:
- DDP step time, MLP 4x512, with ``wg_distribution`` (+ ``mv``/``param``), every step collected;
- one small ``all_reduce``: unwrapped, wrapped on a step that is not collected, wrapped and recorded.
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(tmp: Path, name: str, **cfg) -> Path | None:
    if not cfg:
        return None
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return path


def _ddp_case(cfg_path, steps):
    import torch
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from trainmon import TrainerMon

    torch.manual_seed(0)
    model = DDP(nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(512, 512), nn.GELU())]))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    mon = TrainerMon(cfg_path).set_monitor(model, optimizer=opt) if cfg_path else None
    x = torch.randn(64, 512)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    if mon:
        mon.close()
    return statistics.median(times[3:])


def _comm_case(cfg_path, calls):
    import torch
    import torch.distributed as dist
    from trainmon import TrainerMon

    model = torch.nn.Linear(1, 1)
    mon = TrainerMon(cfg_path).set_monitor(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) \
        if cfg_path else None
    t = torch.ones(16)
    t0 = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(t)
    per_call = (time.perf_counter() - t0) / calls
    if mon:
        mon.close()
    return per_call


def _rank(rank, port, tmp, steps, out):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MONITOR_OUTPUT_DIR"] = str(tmp / "out")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    ddp_cfgs = {"baseline": None,
                "wg": _config(tmp, "wg", wg_distribution=True),
                "wg+mv+param": _config(tmp, "all", wg_distribution=True, mv_distribution=True,
                                       param_distribution=True)}
    comm_cfgs = {"unwrapped": None,
                 "wrapped, step not collected": _config(tmp, "cc_off", start_step=10**9,
                                                        cc_distribution={"enable": True}),
                 "wrapped, recorded": _config(tmp, "cc_on", cc_distribution={"enable": True}),
                 "wrapped, recorded + pre": _config(tmp, "cc_pre", cc_distribution={"enable": True,
                                                                                   "cc_pre_hook": True})}
    res = {k: [] for k in (*ddp_cfgs, *comm_cfgs)}
    for _ in range(3):  # interleaved repeats
        for k, c in ddp_cfgs.items():
            res[k].append(_ddp_case(c, steps))
        for k, c in comm_cfgs.items():
            res[k].append(_comm_case(c, 2000))
    dist.destroy_process_group()
    if rank == 0:
        out.put({k: statistics.median(v) for k, v in res.items()})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        port = _port()
        procs = [ctx.Process(target=_rank, args=(r, port, Path(tmp), args.steps, out)) for r in range(2)]
        for p in procs:
            p.start()
        res = out.get(timeout=900)
        for p in procs:
            p.join()
    base = res["baseline"]
    print(f"DDP step (2 ranks, MLP 4x512, batch 64): baseline {base * 1e3:.2f} ms")
    for k in ("wg", "wg+mv+param"):
        print(f"  {k:<28} {res[k] * 1e3:8.2f} ms  x{res[k] / base:.2f}")
    unw = res["unwrapped"]
    print(f"all_reduce of 16 floats: unwrapped {unw * 1e6:.1f} us")
    for k in ("wrapped, step not collected", "wrapped, recorded", "wrapped, recorded + pre"):
        print(f"  {k:<28} {res[k] * 1e6:8.1f} us  x{res[k] / unw:.2f}")


if __name__ == "__main__":
    main()
