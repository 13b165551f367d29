"""set_monitor before torch.compile: no Dynamo recompiles or warnings in trainmon, one hint, eager values."""
from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.nn.functional as F

from tests._support.runs import only_run_dir, read_family
from trainmon import TrainerMon
from trainmon.output.layout import rank_dir_name
from trainmon.testing.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches

SMALL = GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=2)
OPS = ["norm", "mean", "min", "max"]
FAMILIES = ("actv", "actv_grad", "grad_reduced")


def run(tmp_path, monkeypatch, make_config, backend):
    out = tmp_path / f"out_{backend}"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    torch.manual_seed(0)
    model = TinyGPT(SMALL)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = TrainerMon(make_config(xy_distribution=True, all_xy=True, wg_distribution=True, ops=OPS))
    monitor.set_monitor(model, optimizer=optimizer)
    forward = model if backend is None else torch.compile(model, backend=backend)   # compiled AFTER set_monitor
    data = synthetic_batches(SMALL, 4, 3, seed=2)
    for _ in range(3):
        tokens = next(data)
        logits = forward(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, SMALL.vocab), tokens[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    rank0 = only_run_dir(out) / rank_dir_name(0)
    return {f: read_family(rank0, f) for f in FAMILIES}


@pytest.mark.slow
def test_compiling_after_set_monitor_gives_one_hint_no_dynamo_warning_and_the_eager_values(
        tmp_path, monkeypatch, make_config, caplog):
    torch._dynamo.reset()
    eager = run(tmp_path, monkeypatch, make_config, None)
    with caplog.at_level(logging.WARNING), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = run(tmp_path, monkeypatch, make_config, "aot_eager")
    torch._dynamo.reset()
    hints = [r for r in caplog.records if "runs under torch.compile" in r.getMessage()]
    assert len(hints) == 1, caplog.text
    others = [r.getMessage() for r in caplog.records if r not in hints]
    others += [str(w.message) for w in caught if "trainmon" in str(w.message) or "trainmon" in w.filename]
    assert not [m for m in others if "recompile" in m or "trainmon" in m or "Graph break" in m], others
    for family in FAMILIES:
        key = ["step", "name"] + (["micro_step"] if "micro_step" in eager[family] else [])
        merged = eager[family].merge(compiled[family], on=key, suffixes=("", "_c"))
        assert len(merged) == len(eager[family]) == len(compiled[family]) > 0, family
        for op in OPS:
            assert merged[op].to_numpy() == pytest.approx(merged[op + "_c"].to_numpy(), rel=1e-5, abs=1e-9), (family, op)

