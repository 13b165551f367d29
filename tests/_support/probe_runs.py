"""Small real TinyGPT runs with grad_probe / loss_alignment on, and what the test saw itself."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainmon import TrainerMon
from trainmon.testing.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches

SMALL = GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=2)


@dataclass
class Truth:
    run_dir: Path
    grads: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)     # step -> name -> grad
    losses: dict[int, list[float]] = field(default_factory=dict)                # step -> per call
    groups: dict[int, list[dict]] = field(default_factory=dict)                 # step -> param_groups copy


def train_run(root: Path, config: dict, *, steps: int = 4, acc: int = 2, lr: float = 1e-3,
              change_data_at: int | None = None, model_cfg: GPTConfig = SMALL, schedule: bool = False,
              seed: int = 0, dtype: torch.dtype = torch.float32) -> Truth:
    """Train ``steps`` steps under TrainerMon, recording the truth the test checks against.

    ``change_data_at``: from that step on the batches come from another seed (the runs diverge
    there, not before); ``schedule``: a StepLR halving lr every step.
    """
    root.mkdir(parents=True, exist_ok=True)
    cfg_path = root / "config.json"
    cfg_path.write_text(json.dumps(config))
    old = os.environ.get("MONITOR_OUTPUT_DIR")
    os.environ["MONITOR_OUTPUT_DIR"] = str(root / "out")
    try:
        torch.manual_seed(seed)
        model = TinyGPT(model_cfg).to(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if schedule else None
        monitor = TrainerMon(cfg_path).set_monitor(model, grad_acc_steps=acc, optimizer=opt)
        data = synthetic_batches(model_cfg, 4, steps * acc, seed=1)
        other = synthetic_batches(model_cfg, 4, steps * acc, seed=2)
        truth = Truth(run_dir=monitor.run_dir)
        names = {p: n for n, p in model.named_parameters()}
        for step in range(steps):
            losses = truth.losses.setdefault(step, [])
            for _ in range(acc):
                batch, alt = next(data), next(other)
                loss = model.loss(alt if change_data_at is not None and step >= change_data_at else batch) / acc
                monitor.record_loss(loss)
                losses.append(loss.item())
                loss.backward()
            truth.grads[step] = {n: p.grad.detach().clone() for p, n in names.items()}
            truth.groups[step] = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
            opt.step()
            opt.zero_grad()
            if sched is not None:
                sched.step()
        monitor.close()
    finally:
        if old is None:
            os.environ.pop("MONITOR_OUTPUT_DIR", None)
        else:
            os.environ["MONITOR_OUTPUT_DIR"] = old
    return truth
