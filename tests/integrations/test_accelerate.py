"""accelerate for real: a plain loop with accelerator.prepare + accumulate, monitored on what prepare returns."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

from tests._support.applied import AppliedRecorder, assert_recorded_as_applied  # noqa: E402
from tests._support.runs import trainmon_warnings  # noqa: E402
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


def _fsdp2_body(rank, world, config):
    """One rank of a plain accelerate loop with its FSDP plugin (``fsdp_version=2``) on CPU/gloo.

    accelerate 1.15 turns FSDP on only for accelerator devices (its FSDP branch sits under the
    MULTI_GPU/NPU/XPU/... distributed types; on CPU it runs MULTI_CPU, i.e. DDP, and ignores the
    plugin): the test sets the state's distributed type to FSDP itself, after which ``prepare``
    is accelerate's own FSDP2 path (``fully_shard`` per block, DTensor params, its optimizer
    wrapper, ``clip_grad_norm_`` over the shards)."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    torch.manual_seed(0)
    model = TinyGPT(SMALL)
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert type(model).__name__ == "FSDPTinyGPT" and type(next(model.parameters())).__name__ == "DTensor"
    with trainmon_warnings() as warned:
        monitor = TrainerMon(config).set_monitor(model, grad_acc_steps=2, optimizer=opt)
        recorder = AppliedRecorder(opt.optimizer, model)   # gathers each applied grad and moment in full
        for batch in synthetic_batches(SMALL, 4, 6, seed=1 + rank):   # each rank its own data
            with accelerator.accumulate(model):
                accelerator.backward(model.loss(batch))
                if accelerator.sync_gradients:
                    total = accelerator.clip_grad_norm_(model.parameters(), 0.05)
                    assert float(total) > 0.1   # clipping is active
                opt.step()
                opt.zero_grad()
        monitor.close()
    assert_recorded_as_applied(Path(os.environ["MONITOR_OUTPUT_DIR"]), recorder, steps=3, rank=rank)
    assert len(warned) == 1 and "grad_unreduced is not recorded" in warned[0], warned   # FSDP2 without the opt-in
    return True


def test_fsdp2_through_accelerate_records_the_full_tensors_the_optimizer_applies(output_root, make_config):
    from tests._support.distributed import run_distributed

    assert run_distributed(_fsdp2_body, world_size=2, timeout=240, args=(str(make_config(**CFG)),)) == [True, True]
