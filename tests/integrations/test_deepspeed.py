"""DeepSpeed ZeRO stages 0-3 on CPU/gloo (``DS_ACCELERATOR=cpu``), 2 ranks, 2 micro-batches.

Truths: each rank's local accumulated grad from a plain copy (stages 0/1 ``grad_unreduced``), and
for stages 2/3 (which reduce every micro-batch) each micro-batch's local grad from it; the
single-process full-batch grad and a plain ``torch.optim.Adam`` on the full batch
(``grad_reduced``, ``exp_avg*``); DeepSpeed's own ``safe_get_full_fp32_param`` (``param_updated``)
and ``engine.get_global_grad_norm()`` (the norm of the merged ``grad_reduced`` rows).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from tests._support.runs import only_run_dir, read_family, reference_stats
from tests._support.distributed import run_distributed

pytest.importorskip("deepspeed", reason="DeepSpeed not installed (.ci/run installs it)")

STATS = ("norm", "mean", "min", "max")
LR, GA, MB = 1e-2, 2, 2
CLIP = 0.05


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _check(df, truth, family, step, rtol=1e-5):
    rows = df[df["step"] == step].set_index("name")
    assert set(rows.index) == set(truth), (family, step, set(rows.index) ^ set(truth))
    for name, ref in truth.items():
        for stat in STATS:
            atol = ref["_mean_atol"] if stat == "mean" else 1e-12
            assert rows.loc[name, stat] == pytest.approx(ref[stat], rel=rtol, abs=atol), (family, step, name, stat)


def _applied_sq(opt, stage: int, into: list) -> None:
    """The test's own read of what DeepSpeed applies: the sum of squares of the grads the inner
    torch optimizer holds when it steps (DeepSpeed hands it one param group at a time)."""
    inner = opt if stage == 0 else opt.optimizer

    def pre(o, *_):
        into[-1] += sum(float(p.grad.double().pow(2).sum()) for g in o.param_groups for p in g["params"]
                        if p.grad is not None)

    inner.register_step_pre_hook(pre)


def _stage(rank, world, root: Path, stage: int, clip: float = 0.0, bf16: bool = False,
           fp32_accumulation: bool = False) -> None:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    from trainmon import TrainerMon

    model, ref = _model(), _model()
    scratch = _model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=LR)
    ds_cfg = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GA,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10 ** 9, "gradient_clipping": clip, "bf16": {"enabled": bf16}}
    if fp32_accumulation:   # bf16 + ZeRO 1 + fp32 grad accumulation: DeepSpeed's BF16_Optimizer
        ds_cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=LR),
                                             config=ds_cfg)
    assert (type(opt).__name__ == "BF16_Optimizer") == fp32_accumulation, type(opt).__name__
    applied: list[float] = []
    _applied_sq(opt, stage, applied)
    case = f"stage{stage}" + (f"_clip{clip}" if clip else "") + ("_bf16" if bf16 else "") + \
        ("_fp32acc" if fp32_accumulation else "")
    out = root / case
    os.environ["MONITOR_OUTPUT_DIR"] = str(out)
    cfg = root / f"ds_{case}.json"
    if rank == 0:
        cfg.write_text(json.dumps(dict(wg_distribution=True, mv_distribution=True, param_distribution=True,
                                       ops=list(STATS))))
    torch.distributed.barrier()
    monitor = TrainerMon(cfg).set_monitor(engine, grad_acc_steps=GA, optimizer=opt)
    names = dict(ref.named_parameters())
    truth, norms, micro = {}, [], {}
    for step in range(2):
        x = torch.randn(world * GA * MB, 5, generator=torch.Generator().manual_seed(step))
        local = x.chunk(world)[rank].chunk(GA)
        with torch.no_grad():
            for p, (n, q) in zip(scratch.parameters(), ref.named_parameters()):
                p.copy_(q)
                p.grad = None
        if stage >= 2:   # reduced per micro-batch: each micro-batch's own local grad
            for k, mb in enumerate(local):
                for p in scratch.parameters():
                    p.grad = None
                (scratch(mb).pow(2).mean() / GA).backward()
                micro[(step, k)] = {n: reference_stats(p.grad) for n, p in scratch.named_parameters()}
        else:
            sum(scratch(mb).pow(2).mean() / GA for mb in local).backward()
            truth[("grad_unreduced", step)] = {n: reference_stats(p.grad) for n, p in scratch.named_parameters()}
        ref_opt.zero_grad()
        ref(x).pow(2).mean().backward()
        if clip:   # DeepSpeed's clip: grad * clip / (norm + 1e-6) when the norm is above clip
            pre_clip = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip))
            assert pre_clip > 2 * clip, pre_clip   # clipping really is active
        truth[("grad_reduced", step)] = {n: reference_stats(p.grad) for n, p in names.items()}
        ref_opt.step()
        for k in ("exp_avg", "exp_avg_sq"):
            truth[(k, step)] = {n: reference_stats(ref_opt.state[p][k]) for n, p in names.items()}
        applied.append(0.0)
        for mb in local:
            engine.backward(engine(mb.to(torch.bfloat16) if bf16 else mb).float().pow(2).mean())
            engine.step()
        norms.append(engine.get_global_grad_norm())
        truth[("param_updated", step)] = {n: reference_stats(p if stage == 0 else safe_get_full_fp32_param(p))
                                          for n, p in engine.module.named_parameters()}
    monitor.close()
    wraps = {"reduce_ipg_grads", "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"}
    assert not wraps & set(vars(opt)), (stage, wraps & set(vars(opt)))   # instance wraps undone
    rank_dir = only_run_dir(out) / f"rank{rank}"
    reduced = read_family(rank_dir, "grad_reduced")
    for step, sq in enumerate(applied):   # grad_reduced is what DeepSpeed's inner optimizer applied
        total = torch.tensor([sq], dtype=torch.float64)
        if stage > 0:
            torch.distributed.all_reduce(total)   # each rank applies its partition
        merged = math.sqrt((reduced[reduced["step"] == step]["norm"] ** 2).sum())
        assert merged == pytest.approx(math.sqrt(float(total)), rel=1e-5), (case, step)
        if clip:
            assert merged <= clip * (1 + 1e-5), (case, step, merged)
    if bf16:
        return   # bf16 grads differ from the fp32 reference; the applied-grad check above holds
    for (family, step), t in truth.items():
        _check(read_family(rank_dir, family), t, family, step, rtol=2e-5 if family == "exp_avg_sq" else 1e-5)
    unreduced = read_family(rank_dir, "grad_unreduced")
    assert ("micro_step" in unreduced.columns) == (stage >= 2), (stage, list(unreduced.columns))
    if stage >= 2:
        assert len(unreduced) == len(micro) * len(names), (stage, len(unreduced))   # once per micro-batch
        for (step, k), t in micro.items():
            _check(unreduced[unreduced["micro_step"] == k], t, f"grad_unreduced micro {k}", step)
    for step, norm in enumerate(norms):
        if clip:
            continue   # DeepSpeed reports the norm before its clip
        if norm is None:   # stage 0 with a plain torch optimizer computes no global norm
            assert stage == 0
            continue
        merged = math.sqrt((reduced[reduced["step"] == step]["norm"] ** 2).sum())
        assert merged == pytest.approx(float(norm), rel=1e-5), (stage, step)


def _body(rank, world, root):
    for stage in (0, 1, 2, 3):
        _stage(rank, world, Path(root), stage)
    return True


def _clip_body(rank, world, root):
    for stage in (0, 1, 2, 3):
        _stage(rank, world, Path(root), stage, clip=CLIP)
    for stage in (1, 2, 3):
        _stage(rank, world, Path(root), stage, clip=CLIP, bf16=True)
    _stage(rank, world, Path(root), 1, clip=CLIP, bf16=True, fp32_accumulation=True)
    return True


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_deepspeed_grad_reduced_is_the_clipped_grad_the_optimizer_applies(tmp_path, monkeypatch):
    """gradient_clipping active (grads well above it): ZeRO 0-3 fp32 against a clipped reference,
    ZeRO 1-3 fp32 and bf16 (and bf16 with fp32 accumulation: BF16_Optimizer) against what
    DeepSpeed's inner optimizer is handed."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert run_distributed(_clip_body, world_size=2, timeout=840, args=(str(tmp_path),)) == [True, True]


@pytest.mark.slow
@pytest.mark.timeout(900)   # the first run on a machine JIT-builds DeepSpeed's shm comm op
def test_deepspeed_zero_stages_0_to_3(tmp_path, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert run_distributed(_body, world_size=2, timeout=840, args=(str(tmp_path),)) == [True, True]
