"""Megatron-core: real DDP + GPTModel on CPU/gloo (test shim), stand-in optimizer wrappers.

Truths are computed by the test from plain copies of the model: each rank's local grad (that
rank's data only, loss / micro-batches as Megatron does) for ``grad_unreduced``; the full-batch
grad and a plain ``torch.optim.Adam`` trained on the full batch in one process for
``grad_reduced``, ``param_updated`` and ``exp_avg*``.
"""
from __future__ import annotations

import inspect
import math
import os
from pathlib import Path

import pytest
import torch

from tests._support.runs import only_run_dir, read_family, reference_stats
from tests._support.distributed import run_distributed

pytest.importorskip("megatron.core", reason="megatron-core not installed (.ci/run installs it)")

STATS = ("norm", "mean", "min", "max")
CFG = dict(wg_distribution=True, mv_distribution=True, param_distribution=True, ops=list(STATS) + ["nans"])
SEQ, VOCAB, LR = 8, 32, 1e-2


def _check(df, truth: dict, family: str, step: int, rtol: float = 1e-5, mean_slack: float = 1.0) -> None:
    rows = df[(df["step"] == step)].set_index("name")
    assert set(rows.index) == set(truth), (family, step, set(truth) ^ set(rows.index))
    for name, ref in truth.items():
        for stat in STATS:
            got = rows.loc[name, stat]
            atol = ref["_mean_atol"] * mean_slack if stat == "mean" else 1e-12
            assert got == pytest.approx(ref[stat], rel=rtol, abs=atol), (family, step, name, stat, got, ref[stat])
        assert rows.loc[name, "nans"] == 0, (family, name)


def _gpt_batch(seed: int, rows: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    return tokens


def _gpt_loss(model, tokens):
    pos = torch.arange(SEQ).expand(tokens.shape[0], SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]
    return model(tokens, pos, mask, labels=torch.roll(tokens, -1, 1)).float().mean()


def _mlp_loss(model, x):
    return model(x).pow(2).mean()


def _run_case(rank, world, root: Path, case: dict) -> None:
    """Train 2 steps under the monitor; check every family against the test's own truths."""
    from tests._support import fake_megatron as fm
    from tests._support import megatron_shim as ms
    from trainmon import TrainerMon

    def build():
        torch.manual_seed(0)   # same weights every time (models hold process groups: no deepcopy)
        if case["model"] == "gpt":
            return ms.gpt_model(hidden=case.get("hidden", 16))
        from megatron.core.transformer.transformer_config import TransformerConfig
        model = torch.nn.Sequential(fm.FusedLinear(6, 8), torch.nn.Tanh(), fm.FusedLinear(8, 3))
        return model, TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)

    if case["model"] == "gpt":
        loss_fn, batch = _gpt_loss, lambda step: _gpt_batch(step, 4 * world)
    else:
        loss_fn = _mlp_loss
        batch = lambda step: torch.randn(4 * world, 6, generator=torch.Generator().manual_seed(step))  # noqa: E731
    model, cfg = build()
    ref, scratch = build()[0], build()[0]           # ref: full batch, plain Adam, one process
    ref_opt = torch.optim.Adam(ref.parameters(), lr=LR)
    ddp = ms.megatron_ddp(model, cfg, overlap=case["overlap"], dist_opt=case["dist_opt"],
                          bucket_size=case.get("bucket_size"))
    if case["dist_opt"]:
        _check_ranges_match_real(ddp.buffers)
    scale = case.get("scale", 1.0)
    clip = case.get("clip", 0.0)
    inner = torch.optim.Adam(ddp.parameters(), lr=LR)
    if case["dist_opt"]:
        opt = fm.DistributedOptimizer(inner, fm.optimizer_config(clip_grad=clip),
                                      fm.ConstantGradScaler(scale) if scale != 1 else None,
                                      None, [ddp], {0: ddp.buffers}, ddp.buffers[0].data_parallel_group)
    else:
        opt = fm.FP32Optimizer(inner, fm.optimizer_config(clip_grad=clip))
    if case.get("chained"):
        opt = fm.ChainedOptimizer([opt])
    os.environ["MONITOR_OUTPUT_DIR"] = str(root / case["id"])
    cfg_path = root / f"{case['id']}.json"
    if rank == 0:
        cfg_path.write_text(__import__("json").dumps(CFG))
    torch.distributed.barrier()
    n_mb = case.get("micro_batches", 1)
    monitor = TrainerMon(cfg_path).set_monitor(ddp, grad_acc_steps=n_mb, optimizer=opt)
    names = dict(ref.named_parameters())
    truth: dict = {}
    for step in range(case.get("steps", 2)):
        data = batch(step)
        local = data.chunk(world)[rank].chunk(n_mb)
        # this rank's own accumulated grad, from a plain copy with the current weights
        with torch.no_grad():
            for p, q in zip(scratch.parameters(), model.parameters()):
                p.copy_(q)
                p.grad = None
        sum(loss_fn(scratch, mb) / n_mb for mb in local).backward()
        truth[("grad_unreduced", step)] = {n: reference_stats(p.grad) for n, p in scratch.named_parameters()}
        ref_opt.zero_grad()
        loss_fn(ref, data).backward()
        if clip:   # Megatron clips inside step(): the applied grad is the clipped one
            assert float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)) > 2 * clip
        truth[("grad_reduced", step)] = {n: reference_stats(p.grad) for n, p in names.items()}
        ref_opt.step()
        for k in ("exp_avg", "exp_avg_sq"):
            truth[(k, step)] = {n: reference_stats(ref_opt.state[p][k]) for n, p in names.items()}
        # Megatron's loop: zero buffers, micro-batches (no_sync on all but the last), finalize, step
        ddp.zero_grad_buffer()
        opt.zero_grad()
        for i, mb in enumerate(local):
            ctx = ddp.no_sync() if i < n_mb - 1 else __import__("contextlib").nullcontext()
            with ctx:
                (loss_fn(ddp, mb) * scale / n_mb).backward()
        ddp.finish_grad_sync()
        assert opt.step()[0]
        # Adam turns round-off in near-zero grads into whole-lr steps: the truth for the params
        # is the trained model itself (read by the test), the moments are checked against ref_opt.
        truth[("param_updated", step)] = {n: reference_stats(p) for n, p in model.named_parameters()}
    monitor.close()
    rank_dir = only_run_dir(root / case["id"]) / f"rank{rank}"
    for (family, step), t in truth.items():
        # clipped: the reference's clip coefficient comes from its own (differently rounded) norm;
        # the mean of a near-zero moment cancels and shows that 1e-7 difference at ~1e-5
        _check(read_family(rank_dir, family), t, family, step,
               rtol=1e-5 if family != "exp_avg_sq" else 2e-5, mean_slack=100.0 if clip else 1.0)


def _check_ranges_match_real(buffers) -> None:
    """The stand-in's owned ranges are the real DistributedOptimizer's, on the real buffers."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as Real

    from tests._support.fake_megatron import DistributedOptimizer as Fake

    def flat(m):
        return {(key, i, id(p)): {k: (r.start, r.end) for k, r in ranges.items()}
                for key, buckets in m.items() for i, b in enumerate(buckets)
                for p, ranges in b["param_map"].items()}

    for buf in buffers:
        real, fake = flat(Real._build_gbuf_range_map(buf)), flat(Fake._build_gbuf_range_map(buf))
        assert real and real == fake


def _pp_vpp_naming(rank, world, root: Path) -> None:
    """PP=2 x VPP=2, 4 layers: chunk c of pipeline rank r holds global layer 2c + r + 1."""
    import json

    from megatron.core import parallel_state

    from tests._support import megatron_shim as ms
    from trainmon import TrainerMon

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 2, virtual_pipeline_model_parallel_size=2)
    chunks = [ms.gpt_model(layers=4, pre_process=(rank == 0 and vp == 0), post_process=(rank == 1 and vp == 1),
                           vp_stage=vp, pipeline_model_parallel_size=2,
                           virtual_pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)[0]
              for vp in range(2)]
    assert [[layer.layer_number for layer in c.decoder.layers] for c in chunks] == [[1 + rank], [3 + rank]]
    for global_names in (False, True):
        out = root / f"pp_names_{global_names}"
        os.environ["MONITOR_OUTPUT_DIR"] = str(out)
        cfg = root / f"pp_{global_names}.json"
        if rank == 0:
            cfg.write_text(json.dumps(dict(param_distribution=True, ops=["norm"], global_layer_names=global_names)))
        torch.distributed.barrier()
        with TrainerMon(cfg).set_monitor(chunks) as monitor:
            monitor.step()
        df = read_family(only_run_dir(out) / f"rank{rank}", "param_origin")
        layers = {(int(v), n.split(".")[2]) for v, n in zip(df["vpp_stage"], df["name"]) if n.startswith("decoder.layers.")}
        expected = {(0, str(rank)), (1, str(2 + rank))} if global_names else {(0, "0"), (1, "0")}
        assert layers == expected, (global_names, layers)
        # the same param under both names: only the layer index changes
        assert df["name"].str.startswith("embedding.").any() == (rank == 0)
        assert df["name"].str.startswith("output_layer.").any() == (rank == 1)


_STUB_TRAINING = """
import json, sys, torch
from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator, get_num_microbatches
from tests._support import fake_megatron as fm, megatron_shim as ms

def setup_model_and_optimizer(*args, **kwargs):
    torch.manual_seed(0)
    model, cfg = ms.gpt_model()
    ddp = ms.megatron_ddp(model, cfg)
    return [ddp], fm.FP32Optimizer(torch.optim.Adam(ddp.parameters()), fm.optimizer_config()), None

def pretrain(out):
    rank = torch.distributed.get_rank()
    init_num_microbatches_calculator(rank, None, global_batch_size=4, micro_batch_size=1, data_parallel_size=2)
    model, optimizer, _ = setup_model_and_optimizer()
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(rank))
    pos, mask = torch.arange(8).expand(1, 8), torch.triu(torch.ones(8, 8, dtype=torch.bool), 1)[None, None]
    for step in range(2):
        model[0].zero_grad_buffer()
        for i in range(get_num_microbatches()):
            model[0](tokens[i:i + 1], pos, mask, labels=tokens[i:i + 1]).mean().backward()
        model[0].finish_grad_sync()
        optimizer.step()
    if rank == 0:
        open(out, "w").write(json.dumps(sys.argv))
"""


def _launcher_check(rank, world, root: Path) -> None:
    """The zero-edit launcher runs a script whose ``pretrain`` is monitored without any edit."""
    import json
    import sys

    from megatron.core import parallel_state

    import examples.megatron_patch as patch

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1)
    stub = root / "stub" / "megatron" / "training"
    if rank == 0:
        stub.mkdir(parents=True)
        (stub / "__init__.py").write_text("")
        (stub / "training.py").write_text(_STUB_TRAINING)
        (root / "pretrain_stub.py").write_text(
            "import sys\nfrom megatron.training.training import pretrain\npretrain(sys.argv[2])\n")
        (root / "launch.json").write_text(json.dumps(dict(wg_distribution=True, ops=["norm"])))
    torch.distributed.barrier()
    sys.path.insert(0, str(root / "stub"))
    os.environ.update(TRAINMON_CONFIG=str(root / "launch.json"), MONITOR_OUTPUT_DIR=str(root / "launch_out"))
    patch.main(["megatron_patch.py", str(root / "pretrain_stub.py"), "--out", str(root / "argv.json")])
    for monitor in patch._MONITORS:
        monitor.close()
    torch.distributed.barrier()
    assert json.loads((root / "argv.json").read_text())[1:] == ["--out", str(root / "argv.json")]
    rank_dir = only_run_dir(root / "launch_out") / f"rank{rank}"
    for family in ("grad_unreduced", "grad_reduced"):
        df = read_family(rank_dir, family)
        assert sorted(df["step"].unique()) == [0, 1] and (df["norm"] > 0).all(), family
    assert patch.attach_trainmon([], None) is None     # --skip-train


CASES = [
    dict(id="gpt_allreduce_fp32opt", model="gpt", overlap=False, dist_opt=False),
    dict(id="gpt_distopt_overlap", model="gpt", overlap=True, dist_opt=True, bucket_size=3000,
         micro_batches=2),
    dict(id="fused_distopt_scaled_chained", model="mlp", overlap=True, dist_opt=True, bucket_size=40,
         scale=1024.0, chained=True, micro_batches=2),
    # clip_grad active (grads well above it): grad_reduced and the moments are the clipped grad's
    dict(id="gpt_fp32opt_clipped", model="gpt", overlap=False, dist_opt=False, clip=0.05),
    dict(id="fused_distopt_scaled_clipped", model="mlp", overlap=True, dist_opt=True, bucket_size=40,
         scale=1024.0, micro_batches=2, clip=0.05),
]


def _real_megatron_body(rank, world, root):
    from tests._support import megatron_shim as ms

    ms.init_parallel()
    for case in CASES:
        _run_case(rank, world, Path(root), case)
    _pp_vpp_naming(rank, world, Path(root))
    _launcher_check(rank, world, Path(root))
    return True


@pytest.mark.slow
def test_real_megatron_ddp_pre_post_moments_params(tmp_path):
    assert run_distributed(_real_megatron_body, world_size=2, timeout=240, args=(str(tmp_path),)) == [True, True]


def _wide_gpt_on_the_device_path(rank, world, root):
    """Through the seam, hidden 256: Megatron's grad buffers are batched (views of one buffer)."""
    from tests._support import megatron_shim as ms
    from trainmon.stats import device_rows

    os.environ.setdefault("TRAINMON_DEVICE_PATH", "1")
    ms.init_parallel()
    batched, real = [], device_rows.DeviceRows._batch

    def counted(self, tensors, layout, row):   # a spy: the real batched reduction runs
        batched.append(len(tensors))
        return real(self, tensors, layout, row)

    device_rows.DeviceRows._batch = counted
    # one step: from the second on, Adam's round-off steps make the wide model's truths differ at ~1e-5
    _run_case(rank, world, Path(root), dict(id="gpt_wide_seam", model="gpt", hidden=256, overlap=False,
                                            dist_opt=False, steps=1))
    return batched


@pytest.mark.slow
def test_real_megatron_grad_buffers_are_batched_on_the_device_path_and_equal_the_truths(tmp_path):
    for batched in run_distributed(_wide_gpt_on_the_device_path, world_size=2, timeout=240, args=(str(tmp_path),)):
        assert batched and max(batched) >= 10, batched   # the grads of a bucket (and main_grads) at once


# -- the stand-ins cannot drift from the real classes ------------------------------------------

# attribute / method names trainmon reads, and the real class that must define them
_READ_BY_TRAINMON = {
    "DistributedOptimizer": ("model_float16_groups", "model_fp32_groups", "shard_fp32_groups",
                             "shard_fp32_from_float16_groups", "model_param_gbuf_map", "buffers",
                             "data_parallel_group", "_get_model_param_range_map", "gbuf_ranges"),
    "Float16OptimizerWithFloat16Params": ("float16_groups", "fp32_from_float16_groups", "fp32_from_fp32_groups"),
    "MixedPrecisionOptimizer": ("grad_scaler", "get_loss_scale"),
    "FP32Optimizer": ("get_loss_scale",),
    "ChainedOptimizer": ("chained_optimizers",),
    "MegatronOptimizer": ("optimizer",),
}


def test_stand_in_optimizers_match_real_megatron_names_and_contract():
    from megatron.core.optimizer import distrib_optimizer, optimizer as real_opt

    from tests._support import fake_megatron as fm

    real = {**{n: getattr(real_opt, n) for n in ("Float16OptimizerWithFloat16Params", "MixedPrecisionOptimizer",
                                                 "FP32Optimizer", "ChainedOptimizer", "MegatronOptimizer")},
            "DistributedOptimizer": distrib_optimizer.DistributedOptimizer}
    for cls_name, attrs in _READ_BY_TRAINMON.items():
        source = inspect.getsource(real[cls_name])
        for attr in attrs:
            assert f"self.{attr}" in source or f"def {attr}(" in source, (cls_name, attr)
    # constructor arguments, in order, are the real ones
    for name in ("FP32Optimizer", "Float16OptimizerWithFloat16Params", "DistributedOptimizer", "ChainedOptimizer"):
        real_cls = real[name]
        fake_args = list(inspect.signature(getattr(fm, name).__init__).parameters)
        real_args = list(inspect.signature(real_cls.__init__).parameters)
        assert fake_args == real_args, (name, fake_args, real_args)
    # step() returns (success, grad_norm, num_zeros) and (False, None, None) on overflow
    for name in ("FP32Optimizer", "MixedPrecisionOptimizer", "ChainedOptimizer"):
        src = inspect.getsource(real[name].step)
        assert "return False, None, None" in src and "num_zeros_in_grad" in src, name
    # the DDP side: bucket groups and their start_grad_sync / reset, buffers' param_index_map
    from megatron.core.distributed import distributed_data_parallel as ddp_mod, param_and_grad_buffer as pgb

    assert "self.expert_parallel_bucket_groups" in inspect.getsource(ddp_mod.DistributedDataParallel)
    group_src = inspect.getsource(pgb._ParamAndGradBucketGroup)
    for attr in ("def start_grad_sync(", "def reset(", "self.grad_reduce_handle", "self.buckets"):
        assert attr in group_src, attr
    assert "self.params_list" in inspect.getsource(pgb._ParamAndGradBucket)
    assert "self.param_index_map" in inspect.getsource(pgb._ParamAndGradBuffer)


def test_fp16_overflow_stand_in_skips_like_megatron():
    from tests._support import fake_megatron as fm

    p = torch.nn.Parameter(torch.ones(3))
    p.main_grad = torch.tensor([1.0, float("inf"), 0.0])
    opt = fm.Float16OptimizerWithFloat16Params(torch.optim.Adam([p]), fm.optimizer_config(fp16=True),
                                               fm.ConstantGradScaler(8.0))
    assert opt.step() == (False, None, None)
    assert torch.equal(p.detach(), torch.ones(3))


def test_clipped_grad_reduced_and_a_skipped_fp16_step_without_rows(tmp_path, monkeypatch, caplog):
    """Float16 stand-in with loss scale 8 and clip_grad: grad_reduced is the unscaled, clipped fp32
    main grad the inner Adam applies; on the overflow step nothing is applied, no row is written
    and the log says so."""
    import json
    import logging

    from tests._support import fake_megatron as fm
    from trainmon import TrainerMon

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    clip, scale = 0.1, 8.0
    opt = fm.Float16OptimizerWithFloat16Params(torch.optim.Adam(model.parameters(), lr=1e-3),
                                               fm.optimizer_config(clip_grad=clip, fp16=True),
                                               fm.ConstantGradScaler(scale))
    seen = {}
    opt.optimizer.register_step_pre_hook(   # the test's own read of what the inner optimizer applies
        lambda o, *_: seen.update({i: p.grad.clone() for i, p in enumerate(o.param_groups[0]["params"])}))
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"wg_distribution": True, "ops": list(STATS)}))
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        monitor = TrainerMon(cfg).set_monitor(model, optimizer=opt)
        grads = [torch.full((3, 4), 2.0 * scale), torch.tensor([1.0, float("inf"), 0.0]) * scale]
        applied = []
        for step in range(2):
            model.weight.main_grad = torch.randn(3, 4, generator=torch.Generator().manual_seed(step)) * scale
            model.bias.main_grad = grads[step] if step else torch.ones(3) * scale
            assert opt.step()[0] == (step == 0)
            applied.append(dict(seen))
            seen.clear()
        monitor.close()
    reduced = read_family(only_run_dir(tmp_path / "out") / "rank0", "grad_reduced")
    assert list(reduced["step"]) == [0, 0]   # nothing for the skipped step
    by_name = reduced.set_index("name")
    total = math.sqrt(sum(float(g.double().pow(2).sum()) for g in applied[0].values()))
    assert total == pytest.approx(clip, rel=1e-5)   # clipping was active
    for i, name in enumerate(("weight", "bias")):
        ref = reference_stats(applied[0][i])
        for stat in STATS:
            assert by_name.loc[name, stat] == pytest.approx(ref[stat], rel=1e-6, abs=1e-12), (name, stat)
    assert "the optimizer applied no update" in caplog.text
