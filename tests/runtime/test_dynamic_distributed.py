"""Dynamic mode on 2 and 4 gloo ranks: a mid-run edit switches every rank on the same step.

Ranks run at different speeds (rank r sleeps r*3 ms per step) and all-reduce their grads like
data-parallel training.  Only rank 0 watches the file; it edits it right after some step
boundaries (in place and by ``os.replace``) and waits until its watcher has staged the edit, so
the switch lands at the next boundary: the steps every rank must have collected are known.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests._support.distributed import run_distributed
from tests._support.runs import read_family
from tests.runtime.test_dynamic_e2e import write_by_replace, write_in_place
from trainmon.testing.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches

pytestmark = pytest.mark.slow   # real multi-process gloo jobs

TINY = GPTConfig(vocab=16, seq=4, dim=8, heads=2, layers=1)

# edit after the boundary of step k -> applied at the boundary after k+1 -> collected from k+2
EDITS = {
    2: (write_in_place, {"dynamic_on": True, "wg_distribution": True, "ops": ["norm"]}),
    7: (write_by_replace, {"dynamic_on": True, "param_distribution": True, "ops": ["max"]}),
    11: (write_by_replace, {"dynamic_on": False}),
    14: (write_in_place, {"dynamic_on": True, "wg_distribution": True, "collect_times": 2, "ops": ["norm"]}),
}
STEPS = 20
EXPECT = {"grad_reduced": [4, 5, 6, 7, 8, 16, 17], "param_updated": [9, 10, 11, 12]}


def _job(rank: int, world: int, config: str, desert: bool) -> None:
    from trainmon import TrainerMon

    torch.manual_seed(0)
    model = TinyGPT(TINY)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(config)
    mon.set_monitor(model, optimizer=opt)
    assert (mon._driver.watcher is not None) == (rank == 0)  # only rank 0 watches
    for step, batch in enumerate(synthetic_batches(model.cfg, 2, STEPS, seed=rank)):
        time.sleep(0.003 * rank)
        model.loss(batch).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        opt.zero_grad()
        assert mon.current_step == step + 1
        if rank == 0 and step in EDITS:
            _edit_and_wait(mon, Path(config), *EDITS[step])
    if desert:
        _one_rank_deserts(rank, mon, model, opt)
    mon.close()


def _one_rank_deserts(rank: int, mon, model, opt) -> None:
    """Rank 1 stops reaching monitor boundaries; rank 0 must not wait for it forever."""
    if rank == 0:
        t0 = time.monotonic()
        for _ in range(3):
            model.loss(next(synthetic_batches(model.cfg, 2, 1))).backward()
            opt.step()           # the boundary's broadcast fails after TRAINMON_DYNAMIC_TIMEOUT
            opt.zero_grad()
        assert mon._driver.broken and mon._driver.session is None
        assert time.monotonic() - t0 < 60
    dist.barrier()               # rank 1 waits here (outside the monitor) until rank 0 is done


def _edit_and_wait(mon, path: Path, edit, keys: dict) -> None:
    stager = mon._driver.stager
    before = stager.decision.version
    edit(path, json.dumps(keys))
    deadline = time.monotonic() + 30
    while stager.decision.version == before:
        assert time.monotonic() < deadline, "the watcher never staged the edit"
        time.sleep(0.01)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_collects_the_same_steps(tmp_path, world):
    folder = tmp_path / "conf"
    folder.mkdir()
    config = folder / "monitor_config.json"
    config.write_text(json.dumps({"dynamic_on": False}))
    out = tmp_path / "out"
    env = {"DYNAMIC_MONITOR": "1", "MONITOR_OUTPUT_DIR": str(out), "TRAINMON_RUN_ID": "run",
           "TRAINMON_WATCH_SETTLE": "0.05", "TRAINMON_DYNAMIC_TIMEOUT": "10"}
    run_distributed(_job, world, timeout=240, args=(str(config), world == 2), env=env)
    n_params = len(list(TinyGPT(TINY).parameters()))
    for rank in range(world):
        rank_dir = out / "run" / f"rank{rank}"
        for family, steps in EXPECT.items():
            df = read_family(rank_dir, family)
            assert sorted(df["step"].unique()) == steps, (rank, family)
            assert len(df) == n_params * len(steps), (rank, family)
    # one run dir for the whole job, across every on/off period
    assert sorted(p.name for p in (out / "run").iterdir()) == sorted(["run.json", *(f"rank{r}" for r in range(world))])
