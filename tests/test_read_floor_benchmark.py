"""``benchmarks/overhead.py --read-floor``: the floor reads the tensors each config records, at
the moment the monitor reads them, with the values they have then (checked against the model and
the optimizer in the same process)."""

from __future__ import annotations

import pytest
import torch

from tests._support.benchmarks import load, run
from trainmon.stats import _fused_cpu

pytestmark = pytest.mark.skipif(not _fused_cpu.enabled(), reason="the read floor needs the fused CPU kernel")


def _bench():
    return load("overhead")


def _spy(bench):
    class Spy(bench.ReadFloor):
        def __init__(self, *args):
            self.reads: list[list[torch.Tensor]] = []
            super().__init__(*args)

        def read(self, tensors):
            self.reads.append([t.detach().clone() for t in tensors])
            super().read(tensors)

    return Spy


def _equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_floor_reads_each_weight_family_as_often_and_when_the_monitor_does():
    bench = _bench()
    cfg = bench.GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=1)
    model, optimizer = bench.build(cfg)
    floor = _spy(bench)(bench.ALL, model, optimizer)
    params = list(model.parameters())
    for batch in bench.synthetic_batches(cfg, 2, 2, seed=1):
        floor.reads.clear()
        model.loss(batch).backward()
        grads = [p.grad.clone() for p in params]
        before = [p.detach().clone() for p in params]
        optimizer.step()
        state = optimizer.state
        moments = [state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")]
        assert len(floor.reads) == 5  # grad_unreduced, grad_reduced, param_origin | param_updated, moments
        assert _equal(floor.reads[0], grads) and _equal(floor.reads[1], grads)
        assert _equal(floor.reads[2], before)
        assert _equal(floor.reads[3], [p.detach() for p in params])
        assert _equal(floor.reads[4], moments)
        assert not all(_equal([a], [b]) for a, b in zip(floor.reads[2], floor.reads[3]))  # the step moved them
        optimizer.zero_grad()


def test_the_floor_reads_every_module_output_and_its_grad():
    bench = _bench()
    cfg = bench.GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=1)
    model, optimizer = bench.build(cfg)
    floor = _spy(bench)(bench.XY, model, optimizer)
    outputs, grads = [], []

    def keep(_module, _args, out):  # registered after the floor's hooks: runs after its read
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            outputs.append(out.detach().clone())
            if out.requires_grad:
                out.register_hook(lambda g: grads.append(g.clone()))

    for module in model.modules():
        module.register_forward_hook(keep)
    batch = next(iter(bench.synthetic_batches(cfg, 2, 1, seed=1)))
    model.loss(batch).backward()
    read = [t for r in floor.reads for t in r]
    assert outputs and grads
    assert all(any(t.shape == o.shape and torch.equal(t, o) for t in read) for o in outputs + grads)


def test_the_floor_reads_the_tensors_and_bytes_the_monitor_reads(tmp_path, monkeypatch):
    """Same model, same config, one step each: the kernel gets as many tensors and bytes from
    the floor as from trainmon (the floor is those reads, not fewer)."""
    bench = _bench()
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = bench.GPTConfig(vocab=64, seq=16, dim=32, heads=2, layers=2)
    seen = [0, 0]
    fill = _fused_cpu.fill_rows

    def counting(tensors, *args, **kwargs):
        seen[0] += len(tensors)
        seen[1] += sum(t.numel() * t.element_size() for t in tensors)
        return fill(tensors, *args, **kwargs)

    monkeypatch.setattr(_fused_cpu, "fill_rows", counting)
    reads = {}
    for kind in ("trainmon", "floor"):
        model, optimizer = bench.build(cfg)
        monitor = bench.attach(kind, {**bench.ALL, **bench.XY}, model, optimizer, tmp_path)
        batches = list(bench.synthetic_batches(cfg, 2, 4, seed=1))
        for batch in batches[:3]:  # the activation slots are learned batchable on the first steps
            bench._one_step(model, optimizer, batch)
        seen[:] = [0, 0]
        bench._one_step(model, optimizer, batches[3])
        reads[kind] = tuple(seen)
        if kind == "trainmon":
            monitor.close()
    assert reads["trainmon"] == reads["floor"] and reads["floor"][0] > 0, reads


@pytest.mark.slow
def test_overhead_read_floor_runs_as_documented():
    out = run("overhead", "--read-floor", "--only", "all-on", "--repeats", "1", "--steps", "2", "--warmup", "1")
    lines = [line.split() for line in out.splitlines() if line.startswith("  ")]
    assert [line[:2] for line in lines] == [["trainmon", "all-on"], ["floor", "all-on"]], out
    assert all(line[-1].endswith("x") and float(line[-1][:-1]) > 0 for line in lines)
