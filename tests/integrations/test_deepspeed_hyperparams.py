"""loss_alignment's optimizer-wide settings on DeepSpeed ZeRO-1 (CPU/gloo, 2 ranks): the
``hyperparams`` rows of group -1 are the engine's own clip norm and loss scale, and the group
settings are the wrapped optimizer's."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests._support.distributed import run_distributed
from tests._support.runs import only_run_dir, read_family

pytest.importorskip("deepspeed", reason="DeepSpeed not installed (.ci/run installs it)")


def _body(rank, world, root):
    import deepspeed

    from trainmon import TrainerMon

    root = Path(root)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    ds_cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.5,
              "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9}
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3),
                                             config=ds_cfg)
    os.environ["MONITOR_OUTPUT_DIR"] = str(root / "out")
    cfg = root / "cfg.json"
    if rank == 0:
        cfg.write_text(json.dumps({"loss_alignment": True}))
    torch.distributed.barrier()
    monitor = TrainerMon(cfg).set_monitor(engine, optimizer=opt)
    for step in range(2):
        x = torch.randn(2, 5, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = engine(x).pow(2).mean()
        monitor.record_loss(loss)
        engine.backward(loss)
        engine.step()
    monitor.close()
    hp = read_family(only_run_dir(root / "out") / f"rank{rank}", "hyperparams")
    wide = {r.name: r.value for r in hp[(hp["group"] == -1) & (hp["step"] == 1)].itertuples(index=False)}
    assert wide["clip_grad"] == engine.gradient_clipping() == 0.5
    assert wide["loss_scale"] == float(opt.loss_scale)
    lr = hp[(hp["group"] == 0) & (hp["name"] == "lr")]["value"].tolist()
    assert lr == [3e-3, 3e-3]
    return True


@pytest.mark.slow
@pytest.mark.timeout(900)   # the first run on a machine JIT-builds DeepSpeed's shm comm op
def test_deepspeed_clip_norm_and_loss_scale_are_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert run_distributed(_body, world_size=2, timeout=840, args=(str(tmp_path),)) == [True, True]
