"""update_ratio on the accelerator path, through the seam (TRAINMON_DEVICE_PATH=1): float32 norms,
no fp64 on the device, values against float64 truth from the params themselves."""
from __future__ import annotations

import pytest
import torch

from tests._support.runs import only_run_dir, read_family
from tests.test_monitor import assert_matches, make_model, train_with_reference
from trainmon import TrainerMon
from trainmon.testing.op_counter import OpCounter


class _CountedStep:
    """Wraps ``optimizer.step`` (the monitor's update-ratio work runs inside it) in an OpCounter."""

    def __init__(self, optimizer):
        self.optimizer, self.counters = optimizer, []

    def step(self, *args, **kwargs):
        with OpCounter() as c:
            out = self.optimizer.step(*args, **kwargs)
        self.counters.append(c)
        return out

    def zero_grad(self, *args, **kwargs):
        return self.optimizer.zero_grad(*args, **kwargs)


def _baseline_fp64_ops(dtype) -> int:
    model = make_model(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    counted = _CountedStep(opt)
    train_with_reference(model, counted, steps=1, acc=1)
    return counted.counters[0].dtypes[torch.float64]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_ratio_on_the_device_path_is_float32_and_equals_float64_truth(output_root, make_config, monkeypatch,
                                                                              dtype):
    monkeypatch.setenv("TRAINMON_DEVICE_PATH", "1")
    model = make_model(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = TrainerMon(make_config(ur_distribution=True, ops=["norm"]))
    monitor.set_monitor(model, optimizer=opt)
    counted = _CountedStep(opt)
    truth, _ = train_with_reference(model, counted, steps=3, acc=1)
    monitor.close()
    ur = read_family(only_run_dir(output_root) / "rank0", "update_ratio")
    # bf16: the difference itself is taken in bf16 (as on the CPU path); fp32: float64 truth at 1e-5
    assert_matches(ur, truth, "update_ratio", range(3), ["update_ratio"], rtol=1e-5 if dtype == torch.float32 else 2e-2)
    # fp64 work inside the step is only the optimizer's own (none for Adam): the monitor adds none
    base = _baseline_fp64_ops(dtype)
    assert [c.dtypes[torch.float64] for c in counted.counters] == [base] * 3
    # each side's norms of every param in one multi-tensor call, whatever the number of params
    names = counted.counters[-1].names
    assert names["_foreach_norm"] == 2 and names["linalg_vector_norm"] == 0, names


@pytest.mark.slow
def test_update_ratio_beside_weight_families_of_mixed_sizes_records_every_step(output_root, make_config, monkeypatch,
                                                                              caplog):
    """Weight tensors above ``_SMALL`` elements are reduced alone, the small ones in segment
    batches, so a family's rows come back in a permuted order (a block of row numbers); with
    update_ratio's device value rows in the same step, every step used to fail ("computing the
    stats of step N failed") and was lost."""
    from trainmon.stats import device_rows
    from trainmon.testing.tiny_gpt import GPTConfig

    monkeypatch.setenv("TRAINMON_DEVICE_PATH", "1")
    model = make_model(cfg=GPTConfig(vocab=32, seq=8, dim=72, heads=2, layers=1))
    sizes = [p.numel() for p in model.parameters()]
    assert min(sizes) <= device_rows._SMALL < max(sizes)  # both routes, in one family
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = TrainerMon(make_config(wg_distribution=True, ur_distribution=True, ops=["norm", "max"]))
    monitor.set_monitor(model, optimizer=opt)
    truth, _ = train_with_reference(model, opt, steps=3, acc=1)
    monitor.close()
    assert not [r for r in caplog.records if r.levelno >= 30], [r.getMessage() for r in caplog.records]
    run = only_run_dir(output_root) / "rank0"
    assert_matches(read_family(run, "grad_reduced"), truth, "grad_reduced", range(3), ["norm", "max"])
    assert_matches(read_family(run, "update_ratio"), truth, "update_ratio", range(3), ["update_ratio"], rtol=1e-5)
