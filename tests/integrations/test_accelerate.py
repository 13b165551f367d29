"""accelerate for real: a plain loop with accelerator.prepare + accumulate, monitored on what prepare returns."""
from __future__ import annotations

import logging

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

from tests._support.applied import AppliedRecorder, assert_recorded_as_applied  # noqa: E402
from trainmon import TrainerMon  # noqa: E402
from trainmon.testing.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches  # noqa: E402

pytestmark = pytest.mark.slow

SMALL = GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=1)
CFG = dict(wg_distribution=True, mv_distribution=True, param_distribution=True, ops=["norm"])


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate keeps process-wide singletons; every test starts from none."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.mark.parametrize("acc", [1, 2])
def test_accelerated_optimizer_is_the_step_boundary_and_records_what_it_applies(
        output_root, make_config, caplog, acc):
    torch.manual_seed(0)
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=acc)
    model = TinyGPT(SMALL)
    data = list(synthetic_batches(SMALL, 4, 3 * acc, seed=1))
    model, opt, loader = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                             torch.utils.data.DataLoader(data, batch_size=None))
    assert type(opt).__name__ == "AcceleratedOptimizer"
    monitor = TrainerMon(make_config(**CFG)).set_monitor(model, grad_acc_steps=acc, optimizer=opt)
    recorder = AppliedRecorder(opt.optimizer, model)
    with caplog.at_level(logging.WARNING):
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model.loss(batch))
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 0.05)
                opt.step()        # called on every micro-batch; steps only when grads are synced
                opt.zero_grad()
        monitor.close()
    assert_recorded_as_applied(output_root, recorder, steps=3)
    bad = [r.getMessage() for r in caplog.records if r.name.startswith("trainmon") and r.levelno >= logging.WARNING]
    assert not bad, bad
