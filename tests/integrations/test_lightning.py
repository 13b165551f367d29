"""Lightning for real: the callback records what the optimizer applies (automatic and manual)."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch

L = pytest.importorskip("lightning")

from tests._support.applied import (  # noqa: E402
    AppliedRecorder,
    LocalGradRecorder,
    assert_data_parallel_grads,
    assert_recorded_as_applied,
    recorded_norms,
)
from tests._support.distributed import run_distributed  # noqa: E402
from tests._support.runs import only_run_dir, read_family  # noqa: E402
from trainmon.integrations.lightning import TrainerMonCallback  # noqa: E402
from trainmon.output.layout import rank_dir_name  # noqa: E402
from trainmon.testing.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches  # noqa: E402

pytestmark = pytest.mark.slow

SMALL = GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=1)
CFG = dict(wg_distribution=True, mv_distribution=True, param_distribution=True, ops=["norm"])
CLIP = 0.05   # far below the grads' norm: clipping is active on every step


class LitGPT(L.LightningModule):
    def __init__(self, manual_acc: int | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.net = TinyGPT(SMALL)
        self.manual_acc = manual_acc
        self.automatic_optimization = manual_acc is None
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.net.loss(batch)
        self.losses.append(loss.item())
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        self.manual_backward(loss / self.manual_acc)
        if (batch_idx + 1) % self.manual_acc == 0:
            self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Recorder(L.Callback):
    """Runs after trainmon's callback: reads the optimizer at the moment it applies the update."""

    def on_train_start(self, trainer, pl_module):
        self.applied = AppliedRecorder(trainer.optimizers[0], pl_module)
        self.local = LocalGradRecorder(trainer.optimizers[0], pl_module)


def fit(output_root, make_config, batches, *, acc=1, manual_acc=None, devices=1, strategy="auto", **cb_kwargs):
    model = LitGPT(manual_acc)
    data = list(synthetic_batches(SMALL, 4, batches, seed=1))
    recorder = Recorder()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1,
                        accumulate_grad_batches=acc,
                        gradient_clip_val=None if manual_acc else CLIP, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[TrainerMonCallback(make_config(**CFG), **cb_kwargs), recorder])
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=None))
    trainer.losses = model.losses
    recorder.local.remove()
    trainer.local = recorder.local
    return recorder.applied, trainer


def assert_no_trainmon_warning(caplog):
    bad = [r.getMessage() for r in caplog.records if r.name.startswith("trainmon") and r.levelno >= logging.WARNING]
    assert not bad, bad


@pytest.mark.parametrize("acc,batches,steps", [(1, 3, 3), (2, 7, 4)], ids=["acc1", "acc2-short-last-step"])
def test_automatic_optimization_records_the_clipped_accumulated_grad_and_moments_it_applies(
        output_root, make_config, caplog, acc, batches, steps):
    with caplog.at_level(logging.WARNING):
        applied, trainer = fit(output_root, make_config, batches, acc=acc)
    assert trainer.global_step == steps
    assert_recorded_as_applied(output_root, applied, steps)
    rank0 = only_run_dir(output_root) / rank_dir_name(0)
    reduced, unreduced = recorded_norms(rank0, "grad_reduced"), recorded_norms(rank0, "grad_unreduced")
    for step in range(steps):
        clipped = np.sqrt(sum(v ** 2 for v in reduced[step].values()))
        before_clip = np.sqrt(sum(v ** 2 for v in unreduced[step].values()))
        np.testing.assert_allclose(clipped, CLIP, rtol=1e-3)   # the clip ran inside the closure
        assert before_clip > 2 * CLIP                          # grad_unreduced: before the clip
    # the callback hands each micro-batch's loss to record_loss: one row per batch, under its step
    loss = read_family(rank0, "loss")
    np.testing.assert_array_equal(loss["loss"].to_numpy(), np.array(trainer.losses))
    assert list(zip(loss["step"], loss["micro_step"])) == [(b // acc, b % acc) for b in range(batches)]
    assert_no_trainmon_warning(caplog)


def _ddp_body(rank, world, config):
    """One rank of ``strategy="ddp"`` on 2 CPU processes, started as torchrun would (RANK,
    LOCAL_RANK, WORLD_SIZE in the environment and the gloo group up: Lightning launches nothing
    and reuses the group); its DistributedSampler gives each rank half of the batches."""
    root = Path(os.environ["MONITOR_OUTPUT_DIR"])
    applied, trainer = fit(root, lambda **_: Path(config), 12, acc=2, devices=world, strategy="ddp")
    assert type(trainer.strategy).__name__ == "DDPStrategy" and trainer.world_size == world
    assert trainer.global_step == 3   # 6 batches per rank, 2 per step
    assert_recorded_as_applied(root, applied, 3, rank=rank)
    assert_data_parallel_grads(only_run_dir(root) / rank_dir_name(rank), trainer.local, 3, CLIP)
    return True


@pytest.mark.timeout(300)
def test_ddp_on_two_processes_records_each_ranks_local_grad_and_the_applied_grad(output_root, make_config):
    assert run_distributed(_ddp_body, world_size=2, timeout=240, args=(str(make_config(**CFG)),)) == [True, True]


def test_manual_optimization_with_accumulation_records_what_opt_step_applies(output_root, make_config, caplog):
    with caplog.at_level(logging.WARNING):
        applied, trainer = fit(output_root, make_config, 6, manual_acc=2, grad_acc_steps=2)
    assert trainer.global_step == 3
    assert_recorded_as_applied(output_root, applied, 3)
    assert_no_trainmon_warning(caplog)


def test_the_callback_leaves_no_hook_behind_and_training_unchanged(output_root, make_config):
    def final_params(monitored: bool):
        model = LitGPT()
        data = list(synthetic_batches(SMALL, 4, 4, seed=1))
        callbacks = [TrainerMonCallback(make_config(**CFG))] if monitored else []
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=2,
                            gradient_clip_val=CLIP, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=None))
        opt = trainer.optimizers[0]
        assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(final_params(False), final_params(True)):
        assert torch.equal(a, b)


def test_a_lightning_optimizer_given_to_set_monitor_is_unwrapped_to_the_torch_optimizer(output_root, make_config):
    from lightning.pytorch.core.optimizer import LightningOptimizer

    from trainmon import TrainerMon
    from trainmon.core.hooks import step_optimizer

    model = LitGPT().net
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    wrapped = LightningOptimizer(inner)
    assert isinstance(wrapped, torch.optim.Optimizer) and step_optimizer(wrapped) is inner
    monitor = TrainerMon(make_config(**CFG)).set_monitor(model, optimizer=wrapped)
    applied = AppliedRecorder(inner, model)
    for batch in synthetic_batches(SMALL, 4, 2, seed=1):
        model.loss(batch).backward()
        inner.step()
        inner.zero_grad()
    monitor.close()
    assert_recorded_as_applied(output_root, applied, 2)
