"""Real monitored training runs with injected faults (TrainerMon + torch DDP on gloo).

``spawn_faults(out_root)`` starts WORLD processes once and runs every scenario in them (a spawn
costs ~20 s here).  Each rank writes what the test needs to know independently of trainmon
(the truth) to ``<out_root>/<scenario>/truth_rank<R>.json``.
"""
from __future__ import annotations

import json
import os
import random
import socket
from datetime import timedelta
from pathlib import Path

WORLD = 2
STEPS = 8
FAULT_STEP = 6
BLOW_PARAM = "layers.1.fc.weight"
CORRUPT_PARAM = "layers.2.fc.bias"
FAULT_RANK = {"nan_input": 1, "blow_grad": 1, "corrupt_reduced": 0}
SCENARIOS = tuple(FAULT_RANK)
CONFIG = {"wg_distribution": True, "mv_distribution": True, "param_distribution": True,
          "ops": ["norm", "mean", "min", "max", "nans", "infs"], "step_count_per_record": 4}


def activations_supported() -> bool:
    """Whether the monitor records actv/actv_grad yet (the config is accepted)."""
    try:
        from trainmon.config import parse_config
        from trainmon.runtime.features import unsupported_problems
    except ImportError:
        return True
    problems = unsupported_problems(parse_config({"xy_distribution": True, "all_xy": True}, "probe.json"))
    return not any(p.key.startswith("xy_distribution") for p in problems)


def free_port() -> int:
    ports = list(range(29500, 29900))
    random.shuffle(ports)
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def _run_scenario(scenario: str, rank: int, out_root: Path) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests._support.simulate import Net, _batch
    from trainmon import TrainerMon, seed_all

    run_dir = out_root / scenario
    cfg = out_root / f"{scenario}_config_{rank}.json"
    xy = activations_supported()
    cfg.write_text(json.dumps(dict(CONFIG, xy_distribution=xy, all_xy=xy)))
    os.environ["MONITOR_OUTPUT_DIR"] = str(out_root)
    os.environ["TRAINMON_RUN_ID"] = scenario
    seed_all(0)
    model = DDP(Net())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    params = dict(model.module.named_parameters())
    faulty = rank == FAULT_RANK[scenario]
    truth: dict = {"rank": rank, "nan_grad_order": []}
    state = {"step": 0}

    def note_nan(name):
        def hook(p):
            if state["step"] == FAULT_STEP and torch.isnan(p.grad).any():
                truth["nan_grad_order"].append(name)
        return hook

    hooks = [p.register_post_accumulate_grad_hook(note_nan(n)) for n, p in params.items()]
    for step in range(STEPS):
        state["step"] = step
        x, y = _batch(step, rank, 0, 8)
        at_fault = faulty and step == FAULT_STEP
        if at_fault and scenario == "nan_input":
            x[0, 0] = float("nan")
        blow = params[BLOW_PARAM].register_hook(lambda g: g * 1e4) \
            if at_fault and scenario == "blow_grad" else None
        ((model(x) - y) ** 2).mean().backward()
        if blow is not None:
            blow.remove()
        if at_fault and scenario == "corrupt_reduced":
            with torch.no_grad():
                params[CORRUPT_PARAM].grad.mul_(3)     # after DDP's all-reduce, before the step
        opt.step()
        opt.zero_grad(set_to_none=True)
    for h in hooks:
        h.remove()
    monitor.close()
    dist.barrier()
    truth["run_dir"] = str(monitor.run_dir)
    truth["params_in_model_order"] = list(params)
    (run_dir / f"truth_rank{rank}.json").write_text(json.dumps(truth))
    return truth


def _worker(rank: int, world: int, port: int, out_root: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=90))
    try:
        for scenario in SCENARIOS:
            _run_scenario(scenario, rank, Path(out_root))
    finally:
        dist.destroy_process_group()


def spawn_faults(out_root: Path, timeout: float = 240.0) -> Path:
    """Run every scenario on WORLD gloo ranks; raises if a rank fails or it takes too long."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_worker, args=(WORLD, free_port(), str(out_root)), nprocs=WORLD,
                             join=False, start_method="spawn")
    import time
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"DDP fault runs did not finish in {timeout:.0f} s")
    return out_root


def truth(out_root: Path, scenario: str, rank: int) -> dict:
    return json.loads((out_root / scenario / f"truth_rank{rank}.json").read_text())
