"""transformers' Trainer running DeepSpeed ZeRO 0-3 through accelerate, with the callback alone.

ZeRO 0-3 in fp32 on 1 and 2 processes, ZeRO 1-3 in bf16 on 1, ZeRO 0-3 in fp16 (loss scaling) on
1, ZeRO-Offload (``offload_optimizer: cpu``, stages 1-3) on 2, on DeepSpeed's CPU accelerator
(``DS_ACCELERATOR=cpu``, gloo; ``use_cpu`` so accelerate shards the batches), 2 accumulation
steps (1 process: a short last step), the Trainer's two param groups, clipping active.

fp16: DeepSpeed's CPU accelerator says fp16 is unsupported unless oneDNN has fp16 kernels for the
CPU (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``, false on CPUs without AVX512-FP16/AMX-FP16,
as on CI's), and the engine then refuses to start ("Type fp16 is not supported on your device").
The test overrides that one capability answer; everything else is DeepSpeed's real fp16 path
(torch runs the fp16 ops on CPU).  The initial loss scale (2^20, hysteresis 1) overflows the fp16
grads of ZeRO 1-3 on the first step: skipped steps are checked too.  (Stage 0 runs DeepSpeed's
``FP16_UnfusedOptimizer``, whose loss scale ``engine.backward`` does not apply: no overflow there.)

Truths, read from DeepSpeed itself: the sum of squares of the grads its inner torch optimizer
holds when it steps (one call per param group: this rank's clipped fp32 partitions, summed over
the ranks) against the merged ``grad_reduced`` norms; after each step
``safe_get_full_optimizer_state(p, "exp_avg")`` (torch's state at stage 0) per param where
DeepSpeed links it, and the inner optimizer's flat moments for all params together; on one
process at stages 0-1 (one reduce, at the boundary), the ``grad_unreduced`` norms against
DeepSpeed's own unscaled pre-clip global norm.  A step DeepSpeed's loss scaler skips (its
optimizer's ``overflow``) has no ``grad_reduced``/``exp_avg`` rows and a ``steps`` row with
``skipped`` 1 and the loss scale it ran with.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed not installed (.ci/run installs it)")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests._support.distributed import run_distributed

pytestmark = pytest.mark.slow

CLIP = 0.05  # gradient_clipping ("auto": the Trainer's max_grad_norm), far below the grads' norm
VOCAB, SEQ, ACC, MICRO_BATCHES = 64, 12, 2, 7  # 7 micro-batches, 2 per step: the last step has 1
STAGES = (0, 1, 2, 3)


MODES = {"fp32": STAGES, "bf16": STAGES[1:], "fp16": STAGES, "offload": STAGES[1:]}


def _train(rank, world, root: str, stage: int, mode: str = "fp32"):
    import torch
    import transformers
    from deepspeed.utils import safe_get_full_optimizer_state

    from tests._support.applied import recorded_norms
    from tests._support.runs import only_run_dir, read_family, trainmon_warnings
    from trainmon.integrations.hf import TrainerMonCallback
    from trainmon.output.layout import rank_dir_name

    class Tokens(torch.utils.data.Dataset):
        ids = torch.randint(0, VOCAB, (2 * MICRO_BATCHES, SEQ), generator=torch.Generator().manual_seed(3))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    class Applied(transformers.TrainerCallback):
        """What DeepSpeed's optimizer applies: grads at its inner optimizer's step, moments after."""

        def __init__(self):
            self.sq, self.exp_avg, self.wrapper = [0.0], [], None
            self.skipped, self.scales = [], []  # per step: DeepSpeed's loss scaler skipped it; its scale

        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            self.model, self.zero = model, optimizer.optimizer  # accelerate's wrapper -> DeepSpeed's optimizer
            # the torch AdamW that applies the update (stage 0 fp16: inside DeepSpeed's FP16_UnfusedOptimizer)
            self.inner = self.zero if stage == 0 and mode != "fp16" else self.zero.optimizer
            self.inner.register_step_pre_hook(self._pre)
            dtypes = {p.dtype for p in model.parameters()}
            want = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mode, torch.float32)
            assert dtypes == {want}, dtypes  # DeepSpeed's bf16/fp16 really runs

        def on_step_begin(self, args, state, control, **kwargs):
            self.scales.append(float(getattr(self.zero, "loss_scale", 1.0)))

        def _pre(self, inner, *_):
            self.sq[-1] += sum(
                float(p.grad.double().pow(2).sum())
                for g in inner.param_groups
                for p in g["params"]
                if p.grad is not None
            )

        def on_step_end(self, args, state, control, **kwargs):
            self.skipped.append(getattr(self.zero, "overflow", False) is True)
            if self.skipped[-1]:  # nothing applied (on the first step: no moments exist yet)
                self.exp_avg.append(None)
                self.sq.append(0.0)
                return
            self.exp_avg.append(
                (
                    self._per_param(),
                    sum(  # every param together: the (flat) moments
                        float(st["exp_avg"].double().pow(2).sum()) for st in self.inner.state.values()
                    ),
                )
            )
            self.sq.append(0.0)

        def _per_param(self):
            """DeepSpeed's own per-param read (torch's at stage 0).  At stages 1-2 only where it links
            the state: it links once, after the first param group's first step."""
            params = dict(self.model.named_parameters())
            if stage == 0:  # fp16: the state of each param's fp32 master
                groups = zip(self.zero.fp16_groups, self.zero.fp32_groups) if mode == "fp16" else []
                master = {id(p16): p32 for g16, g32 in groups for p16, p32 in zip(g16, g32)}
                state = {n: self.inner.state[master.get(id(p), p)] for n, p in params.items()}
                return {n: float(st["exp_avg"].double().norm()) for n, st in state.items()}
            if stage in (1, 2):
                first = {id(p) for p in self.zero.bit16_groups[0]}  # the same params on every rank
                params = {n: p for n, p in params.items() if id(p) in first}
            return {n: float(safe_get_full_optimizer_state(p, "exp_avg").double().norm()) for n, p in params.items()}

    out = Path(root) / f"stage{stage}_{mode}"
    os.environ["MONITOR_OUTPUT_DIR"] = str(out)
    cfg = Path(root) / f"monitor{stage}.json"
    cfg.write_text(json.dumps(dict(wg_distribution=True, mv_distribution=True, ops=["norm"])))
    ds = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "bf16": {"enabled": "auto"},  # the Trainer's bf16
    }
    if mode == "fp16":
        ds["fp16"] = {"enabled": "auto", "initial_scale_power": 20, "hysteresis": 1}  # overflows at first
        from deepspeed.accelerator import get_accelerator

        type(get_accelerator()).is_fp16_supported = lambda self: True  # see the module docstring
    if mode == "offload":  # ZeRO-Offload; the Trainer's torch AdamW steps on the CPU partitions
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        ds["zero_force_ds_cpu_optimizer"] = False
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=SEQ,
        )
    )
    args = transformers.TrainingArguments(
        output_dir=str(Path(root) / f"hf{stage}"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=ACC,
        num_train_epochs=1,
        learning_rate=1e-3,
        max_grad_norm=CLIP,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        deepspeed=ds,
        bf16=mode == "bf16",
        fp16=mode == "fp16",
        use_cpu=True,  # accelerate then sees the gloo process group (MULTI_CPU) and shards the data
    )
    applied = Applied()
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(), callbacks=[TrainerMonCallback(cfg), applied]
    )
    with trainmon_warnings() as warned:
        trainer.train()
    steps = math.ceil(math.ceil(MICRO_BATCHES / world) / ACC)  # accelerate shards the batches over the ranks
    assert trainer.state.global_step == steps and len(applied.exp_avg) == steps
    skipped = [step for step in range(steps) if applied.skipped[step]]
    done = [step for step in range(steps) if not applied.skipped[step]]
    assert (skipped and done) if mode == "fp16" and stage > 0 else not skipped, applied.skipped  # fp16: both kinds
    if skipped:  # said once: the skipped steps have no grad_reduced rows
        assert len(warned) == 1 and "applied no update" in warned[0], warned
    else:
        assert not warned, warned
    raw = [h.get("grad_norm") for h in trainer.state.log_history if "loss" in h]  # DeepSpeed's, before its clip
    if stage > 0 or mode == "fp16":  # stage 0 with a torch optimizer computes no global norm
        assert len(raw) == steps and min(raw[s] for s in done) > 2 * CLIP, raw  # clipping is active every step
    rank0 = only_run_dir(out) / rank_dir_name(rank)
    reduced, moments = recorded_norms(rank0, "grad_reduced"), recorded_norms(rank0, "exp_avg")
    assert sorted(reduced) == sorted(moments) == done
    unreduced = recorded_norms(rank0, "grad_unreduced")
    assert sorted(unreduced) == list(range(steps))  # the short last step and the skipped ones too
    if world == 1 and stage <= 1 and raw[done[0]] is not None:  # on the loss's scale: DeepSpeed's unscaled norm
        for step in done:
            merged = math.sqrt(sum(v**2 for v in unreduced[step].values()))
            assert merged == pytest.approx(raw[step], rel=1e-3), (stage, step, merged, raw[step])
    if mode == "fp16":  # one row per step: skipped or not, and the loss scale the step ran with
        rows = read_family(rank0, "steps")
        assert list(rows["step"]) == list(range(steps)), rows
        assert list(rows["skipped"]) == [float(s) for s in applied.skipped], rows
        assert list(rows["loss_scale"]) == applied.scales, rows
    names = {n for n, _ in model.named_parameters()}
    for step in done:
        merged = math.sqrt(sum(v**2 for v in reduced[step].values()))
        total = torch.tensor([applied.sq[step]], dtype=torch.float64)
        if stage > 0:
            torch.distributed.all_reduce(total)  # each rank applies its partition
        assert merged == pytest.approx(math.sqrt(float(total)), rel=1e-5), (stage, step)
        assert merged <= CLIP * (1 + 1e-5), (stage, step, merged)  # the clipped grad, not the raw one
        per_param, total = applied.exp_avg[step]
        assert set(moments[step]) == names, (stage, step, set(moments[step]) ^ names)
        for name, norm in per_param.items():
            assert moments[step][name] == pytest.approx(norm, rel=1e-5), (stage, step, name)
        merged = math.sqrt(sum(v**2 for v in moments[step].values()))
        total = torch.tensor([total], dtype=torch.float64)
        if stage > 0:
            torch.distributed.all_reduce(total)  # each rank holds its partition's moments
        assert merged == pytest.approx(math.sqrt(float(total)), rel=1e-5), (stage, step)
    return True


def _body(rank, world, root, mode):
    logging.getLogger("trainmon").setLevel(logging.WARNING)
    return [_train(rank, world, root, stage, mode) for stage in MODES[mode]]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "world,mode",
    [(1, "fp32"), (2, "fp32"), (1, "bf16"), (1, "fp16"), (2, "offload")],
    ids=["1-process", "2-processes", "1-process-bf16", "1-process-fp16", "2-processes-offload"],
)
def test_trainer_running_deepspeed_zero_0_to_3_records_the_clipped_grad_and_moments_it_applies(
    tmp_path, monkeypatch, world, mode
):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    stages = len(MODES[mode])
    assert (
        run_distributed(_body, world_size=world, timeout=840, args=(str(tmp_path), mode)) == [[True] * stages] * world
    )
