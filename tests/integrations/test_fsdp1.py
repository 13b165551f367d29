"""FSDP1 (FullyShardedDataParallel) on real gloo ranks: refused with one warning, never wrong rows.

FSDP1's params are per-rank slices of flat params (with ``use_orig_params=True``, accelerate's
default, views of them under the model's names): measured as they are they would be fragments
reported as whole tensors.  trainmon says so once and writes no grad/param/moment rows."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests._support.distributed import run_distributed
from tests._support.runs import only_run_dir, trainmon_warnings
from trainmon import TrainerMon
from trainmon.output.layout import rank_dir_name
from trainmon.testing.tiny_gpt import Block, GPTConfig, TinyGPT, synthetic_batches

pytestmark = pytest.mark.slow  # a real 2-process gloo job

SMALL = GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=1)
PARAM_FAMILIES = ("grad_unreduced", "grad_reduced", "param_origin", "param_updated", "exp_avg", "exp_avg_sq")


def _body(rank, world, config):
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    root = Path(os.environ["MONITOR_OUTPUT_DIR"])
    torch.manual_seed(0)
    model = FullyShardedDataParallel(
        TinyGPT(SMALL), use_orig_params=True, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({Block})
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with trainmon_warnings() as warned:
        monitor = TrainerMon(config).set_monitor(model, optimizer=opt)
        for tokens in synthetic_batches(SMALL, 4, 2, seed=rank):
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
        monitor.close()
    assert len(warned) == 1 and "FSDP1" in warned[0] and "not recorded" in warned[0], warned
    written = {p.name for p in (only_run_dir(root) / rank_dir_name(rank)).glob("*.csv")}
    assert not {f for f in written if f.startswith(PARAM_FAMILIES)}, written
    return True


def test_fsdp1_is_refused_with_one_warning_and_no_param_rows(output_root, make_config):
    cfg = make_config(wg_distribution=True, mv_distribution=True, param_distribution=True, ops=["norm"])
    assert run_distributed(_body, world_size=2, timeout=120, args=(str(cfg),)) == [True, True]
