"""transformers' Trainer for real (tiny Llama and GPT-2 built from configs, no downloads)."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests._support.applied import (  # noqa: E402
    AppliedRecorder,
    LocalGradRecorder,
    assert_data_parallel_grads,
    assert_recorded_as_applied,
    recorded_norms,
)
from tests._support.distributed import run_distributed  # noqa: E402
from tests._support.runs import only_run_dir, read_family, trainmon_warnings  # noqa: E402
from trainmon.integrations.hf import TrainerMonCallback  # noqa: E402
from trainmon.output.layout import rank_dir_name  # noqa: E402

pytestmark = pytest.mark.slow

CFG = dict(wg_distribution=True, mv_distribution=True, param_distribution=True, ops=["norm"])
CLIP = 0.05   # the Trainer's max_grad_norm, far below the grads' norm: clipping is active every step
VOCAB, SEQ = 64, 12


def tiny_llama():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(cfg)


def tiny_gpt2():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(cfg)


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int):
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Recorder(transformers.TrainerCallback):
    """Runs after trainmon's callback; reads the Trainer-created optimizer when it applies a step."""

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.applied = AppliedRecorder(optimizer.optimizer, model)   # the torch AdamW inside accelerate's
        self.local = LocalGradRecorder(optimizer.optimizer, model)


def train(tmp_path, make_config, build, acc, micro_batches, setup=None, **training_args):
    torch.manual_seed(0)
    model = build()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), per_device_train_batch_size=2, gradient_accumulation_steps=acc,
        num_train_epochs=1, learning_rate=1e-3, max_grad_norm=CLIP, report_to="none", use_cpu=True,
        save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0, seed=0, **training_args)
    recorder = Recorder()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=RandomTokens(2 * micro_batches),
                                   callbacks=[TrainerMonCallback(make_config(**CFG)), recorder])
    if setup is not None:
        setup(trainer)
    trainer.train()
    recorder.local.remove()
    trainer.local = recorder.local
    return recorder.applied, trainer


@pytest.mark.parametrize("build,acc,micro_batches,steps", [
    (tiny_llama, 2, 7, 4),   # 7 micro-batches, 2 per step: the epoch's last step has 1
    (tiny_gpt2, 1, 3, 3),
], ids=["llama-acc2", "gpt2-acc1"])
def test_trainer_records_the_clipped_grad_and_the_moments_its_optimizer_applies(
        tmp_path, output_root, make_config, caplog, build, acc, micro_batches, steps):
    with caplog.at_level(logging.WARNING):
        applied, trainer = train(tmp_path, make_config, build, acc, micro_batches)
    assert trainer.state.global_step == steps
    assert_recorded_as_applied(output_root, applied, steps)
    rank0 = only_run_dir(output_root) / rank_dir_name(0)
    reduced, unreduced = recorded_norms(rank0, "grad_reduced"), recorded_norms(rank0, "grad_unreduced")
    assert sorted(unreduced) == list(range(steps))   # the short last step too
    for step in range(steps):
        np.testing.assert_allclose(np.sqrt(sum(v ** 2 for v in reduced[step].values())), CLIP, rtol=1e-3)
        assert np.sqrt(sum(v ** 2 for v in unreduced[step].values())) > 2 * CLIP   # before the clip
    # logging_steps=1: the Trainer logs each step's loss and the callback records it under that step
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    loss = read_family(rank0, "loss")
    assert list(loss["step"]) == list(range(steps)) and len(logged) == steps
    np.testing.assert_allclose(loss["loss"].to_numpy(), logged, rtol=1e-12)
    bad = [r.getMessage() for r in caplog.records if r.name.startswith("trainmon") and r.levelno >= logging.WARNING]
    assert not bad, bad
    applied.remove()
    opt = applied.optimizer
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks   # on_train_end closed it


def _ddp_body(rank, world, tmp, config):
    """One rank of a 2-process DDP Trainer (gloo, CPU): accelerate wraps the model in DDP and
    accumulates under ``no_sync``; the callback is handed the bare model."""
    applied, trainer = train(Path(tmp), lambda **_: Path(config), tiny_llama, acc=2, micro_batches=12)
    assert type(trainer.model_wrapped).__name__ == "DistributedDataParallel"
    assert trainer.state.global_step == 3   # 24 samples over 2 ranks, 2 per micro-batch, 2 per step
    assert_recorded_as_applied(Path(os.environ["MONITOR_OUTPUT_DIR"]), applied, 3, rank=rank)
    rank_dir = only_run_dir(Path(os.environ["MONITOR_OUTPUT_DIR"])) / rank_dir_name(rank)
    assert_data_parallel_grads(rank_dir, trainer.local, 3, CLIP)
    return True


@pytest.mark.timeout(300)
def test_trainer_on_two_ddp_processes_records_each_ranks_local_grad_and_the_applied_grad(
        tmp_path, output_root, make_config):
    assert run_distributed(_ddp_body, world_size=2, timeout=240, args=(str(tmp_path), str(make_config(**CFG)))) == [
        True, True]


def _turn_fsdp_on(trainer):
    """accelerate 1.15 enables FSDP only on accelerator devices: on CPU it runs DDP and drops the
    plugin.  Set the one gate the Trainer reads (the state's distributed type and plugin, from the
    Trainer's own ``fsdp_plugin_args``); from there on it is the Trainer's and accelerate's FSDP path."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    trainer.accelerator.state.distributed_type = DistributedType.FSDP
    trainer.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
    trainer.is_fsdp_enabled = True


def _fsdp2_body(rank, world, tmp, config):
    """One rank of a 2-process Trainer with FSDP2 (``fsdp_config={"version": 2}``) on CPU/gloo."""
    fsdp_config = {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
    with trainmon_warnings() as warned:
        applied, trainer = train(Path(tmp), lambda **_: Path(config), tiny_llama, acc=2, micro_batches=12,
                                 setup=_turn_fsdp_on, fsdp=True, fsdp_config=fsdp_config)
    assert type(trainer.model).__name__ == "FSDPLlamaForCausalLM", type(trainer.model)
    assert type(next(trainer.model.parameters())).__name__ == "DTensor"
    assert trainer.state.global_step == 3
    assert_recorded_as_applied(Path(os.environ["MONITOR_OUTPUT_DIR"]), applied, 3, rank=rank)
    for step in range(3):   # the Trainer's clip ran over the shards: the applied full grads have norm CLIP
        np.testing.assert_allclose(np.sqrt(sum(v ** 2 for v in applied.grad[step].values())), CLIP, rtol=1e-3)
    assert len(warned) == 1 and "grad_unreduced is not recorded" in warned[0], warned   # FSDP2 without the opt-in
    return True


@pytest.mark.timeout(300)
def test_trainer_with_fsdp2_on_two_processes_records_the_full_tensors_the_optimizer_applies(
        tmp_path, output_root, make_config):
    assert run_distributed(_fsdp2_body, world_size=2, timeout=240, args=(str(tmp_path), str(make_config(**CFG)))) == [
        True, True]
