"""Test scaffolding: run dirs in the documented CSV layout, written with pandas.

``write_run`` writes rows (dicts) as ``rank<R>/<family>_<a>-<b>.csv``.  ``simulate`` trains a tiny
residual MLP in one process as ``world`` data-parallel replicas (grads averaged by hand, one Adam
per replica) and records every family the way the monitor defines them, with stats computed from
the tensors in float64.  A ``fault`` callback can tamper with the input, the pre-/post-reduce
grads or the optimizer, so tests know exactly where a problem starts.
"""
from __future__ import annotations

import copy
import math
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Iterable

import pandas as pd
import torch
import torch.nn as nn

OPS = ("norm", "mean", "min", "max", "nans", "infs")
MICRO = ("actv", "actv_grad")


def tensor_stats(t: torch.Tensor, ops=OPS) -> dict[str, float]:
    x = t.detach().double().reshape(-1)
    fin = x[torch.isfinite(x)]
    table = {
        "norm": lambda: x.norm().item(),
        "mean": lambda: x.mean().item(),
        "min": lambda: x.min().item() if x.numel() else math.nan,
        "max": lambda: x.max().item() if x.numel() else math.nan,
        "nans": lambda: int(torch.isnan(x).sum()),
        "infs": lambda: int(torch.isinf(x).sum()),
        "std": lambda: x.std().item() if fin.numel() > 1 else math.nan,
    }
    return {op: table[op]() for op in ops}


def row(rank: int, family: str, name: str, step: int, t: torch.Tensor | None = None, *,
        stats: dict | None = None, micro_step: int | None = None, ops=OPS, vpp_stage: int = 0,
        extra: dict | None = None, shape=None, dtype: str | None = None) -> dict:
    if t is not None:
        stats = tensor_stats(t, ops)
        shape = list(t.shape)
        dtype = str(t.dtype)
    return {"rank": rank, "family": family, "name": name, "step": step, "micro_step": micro_step,
            "vpp_stage": vpp_stage, "stats": dict(stats), "extra": dict(extra or {}),
            "shape": list(shape if shape is not None else [1]),
            "dtype": "torch.float32" if dtype is None else dtype}


def _cell(v) -> str:
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return str(v)
    return repr(float(v))


def write_run(run_dir: Path, rows: Iterable[dict], steps_per_file: int = 1) -> Path:
    """Write rows in the documented layout; row order inside a file is the order given."""
    groups: "OrderedDict[tuple, list[dict]]" = OrderedDict()
    for r in rows:
        a = r["step"] // steps_per_file * steps_per_file
        groups.setdefault((r["rank"], r["family"], a), []).append(r)
    for (rank, family, a), items in groups.items():
        records = []
        for r in items:
            rec = {"vpp_stage": r["vpp_stage"], "name": r["name"], "step": r["step"]}
            if family in MICRO or r["micro_step"] is not None:
                rec["micro_step"] = r["micro_step"]
            rec.update(r["extra"])
            rec.update({k: _cell(v) for k, v in r["stats"].items()})
            rec["shape"] = "[" + ", ".join(str(d) for d in r["shape"]) + "]"
            rec["dtype"] = r["dtype"]
            records.append(rec)
        rank_dir = run_dir / f"rank{rank}"
        rank_dir.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(records).to_csv(rank_dir / f"{family}_{a}-{a + steps_per_file - 1}.csv", index=False)
    return run_dir


# ----------------------------------------------------------------------------- a tiny DP run

class Block(nn.Module):
    def __init__(self, width: int, act: str):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.GELU() if act == "gelu" else (nn.ReLU() if act == "relu" else nn.Tanh())

    def forward(self, x):
        return x + self.act(self.fc(x))


class Net(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3, acts: tuple[str, ...] | None = None):
        super().__init__()
        acts = acts or ("tanh",) * depth
        self.inp = nn.Linear(8, width)
        self.layers = nn.ModuleList(Block(width, a) for a in acts)
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


# fault(stage, step, rank, obj): stage in {"input", "pre_reduce", "post_reduce"}; obj is the
# batch tensor (modify in place) or the replica model.
Fault = Callable[[str, int, int, object], None]


def _batch(step: int, rank: int, micro: int, batch: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x = torch.randn(batch, 8, generator=g)
    y = torch.randn(batch, 4, generator=g)
    return x, y


class _Hooks:
    """Forward/backward recording of module outputs of one replica, in call order."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.events: list[tuple[str, str, torch.Tensor]] = []
        self.handles = [m.register_forward_hook(self._fwd(n)) for n, m in model.named_modules() if n]

    def _fwd(self, name: str):
        def hook(_m, _inp, out):
            self.events.append(("actv", f"{name}.output", out.detach().clone()))
            if out.requires_grad:
                out.register_hook(lambda g: self.events.append(("actv_grad", f"{name}.output",
                                                                g.detach().clone())))
        return hook


def simulate(run_dir: Path, *, steps: int = 12, world: int = 2, micro: int = 1, batch: int = 8,
             lr: float = 1e-2, lrs: dict[str, float] | None = None, acts=None, seed: int = 0,
             fault: Fault | None = None, families=None, steps_per_file: int = 1,
             name_prefix: str = "") -> Path:
    """Train and record; ``lrs`` maps a param-name prefix to its own learning rate (a group)."""
    torch.manual_seed(seed)
    base = Net(acts=acts)
    replicas = [copy.deepcopy(base) for _ in range(world)]
    opts = [_optimizer(m, lr, lrs) for m in replicas]
    hooks = [_Hooks(m) for m in replicas]
    rows: list[dict] = []
    keep = set(families) if families else None

    def add(rank, family, name, step, t, micro_step=None):
        if keep is None or family in keep:
            rows.append(row(rank, family, name_prefix + name, step, t, micro_step=micro_step))

    for step in range(steps):
        local = []
        for rank, model in enumerate(replicas):
            order: list[str] = []
            handles = [p.register_post_accumulate_grad_hook(lambda p, n=n: order.append(n))
                       for n, p in model.named_parameters()]
            for m in range(micro):
                x, y = _batch(step, rank, m, batch)
                if fault:
                    fault("input", step, rank, x)
                hooks[rank].events.clear()
                order.clear()
                loss = ((model(x) - y) ** 2).mean() / micro
                loss.backward()
                for family, name, t in hooks[rank].events:
                    add(rank, family, name, step, t, micro_step=m)
            for h in handles:
                h.remove()
            if fault:
                fault("pre_reduce", step, rank, model)
            params = dict(model.named_parameters())
            for n in order:
                add(rank, "grad_unreduced", n, step, params[n].grad)
            local.append({n: p.grad.clone() for n, p in model.named_parameters()})
        mean = {n: sum(g[n] for g in local) / world for n in local[0]}
        for rank, (model, opt) in enumerate(zip(replicas, opts)):
            for n, p in model.named_parameters():
                p.grad = mean[n].clone()
            if fault:
                fault("post_reduce", step, rank, model)
            for n, p in model.named_parameters():
                add(rank, "grad_reduced", n, step, p.grad)
                add(rank, "param_origin", n, step, p)
            opt.step()
            for n, p in model.named_parameters():
                add(rank, "exp_avg", n, step, opt.state[p]["exp_avg"])
                add(rank, "exp_avg_sq", n, step, opt.state[p]["exp_avg_sq"])
            for n, p in model.named_parameters():
                add(rank, "param_updated", n, step, p)
            opt.zero_grad(set_to_none=True)
    return write_run(run_dir, rows, steps_per_file)


def _optimizer(model: nn.Module, lr: float, lrs: dict[str, float] | None):
    if not lrs:
        return torch.optim.Adam(model.parameters(), lr=lr)
    groups: dict[float, list] = {}
    for n, p in model.named_parameters():
        group_lr = next((v for k, v in lrs.items() if n.startswith(k)), lr)
        groups.setdefault(group_lr, []).append(p)
    return torch.optim.Adam([{"params": ps, "lr": v} for v, ps in groups.items()], lr=lr)


def backward_order(model_acts=None) -> list[str]:
    """Param names in the order their grads become ready (from a real backward pass)."""
    torch.manual_seed(0)
    model = Net(acts=model_acts)
    order: list[str] = []
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: order.append(n))
    x, y = _batch(0, 0, 0, 4)
    ((model(x) - y) ** 2).mean().backward()
    return order


# ----------------------------------------------------------------------------- shared fault runs

FAULT_STEP = 6
FAULT_RANK = 1
BLOW_PARAM = "layers.1.fc.weight"
CORRUPT_PARAM = "layers.2.fc.bias"
CORRUPT_RANK = 0


def nan_input(stage, step, rank, obj):
    """A NaN in one sample of one rank's input batch at FAULT_STEP."""
    if stage == "input" and step == FAULT_STEP and rank == FAULT_RANK:
        obj[0, 0] = float("nan")


def blow_grad(stage, step, rank, obj):
    """One param's local grad x1e4 on one rank, before the reduce."""
    if stage == "pre_reduce" and step == FAULT_STEP and rank == FAULT_RANK:
        dict(obj.named_parameters())[BLOW_PARAM].grad.mul_(1e4)


def corrupt_reduced(stage, step, rank, obj):
    """One param's reduced grad x3 on one rank, after the reduce."""
    if stage == "post_reduce" and step == FAULT_STEP and rank == CORRUPT_RANK:
        dict(obj.named_parameters())[CORRUPT_PARAM].grad.mul_(3)


_CACHE: dict[str, Path] = {}
_ROOT: list[Path] = []


def sim_run(name: str, **kwargs) -> Path:
    """``simulate(**kwargs)`` once per test process under a shared temp dir (runs are read-only)."""
    if name not in _CACHE:
        if not _ROOT:
            import atexit
            import shutil
            import tempfile
            _ROOT.append(Path(tempfile.mkdtemp(prefix="trainmon-sim-")))
            atexit.register(shutil.rmtree, _ROOT[0], True)
        _CACHE[name] = simulate(_ROOT[0] / name, **kwargs)
    return _CACHE[name]


SIM_RUNS = {
    "healthy": dict(steps=8),
    "nan": dict(steps=8, fault=nan_input),
    "blow": dict(steps=8, fault=blow_grad),
    "blow3": dict(steps=8, world=3, fault=blow_grad),
    "corrupt": dict(steps=8, fault=corrupt_reduced),
    "corrupt3": dict(steps=8, world=3, fault=corrupt_reduced),
    "base": dict(steps=4),
    "lr": dict(steps=4, lrs={"layers.1": 5e-2}, name_prefix="module."),
    "act": dict(steps=4, acts=("tanh", "gelu", "tanh"), name_prefix="_orig_mod."),
}


def named_run(name: str) -> Path:
    return sim_run(name, **SIM_RUNS[name])
