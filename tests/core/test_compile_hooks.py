"""set_monitor before torch.compile: no Dynamo recompiles or warnings in trainmon, one hint, eager values."""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import logging
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
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
    forward = model if backend is None else torch.compile(model, backend=backend)  # compiled AFTER set_monitor
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
    tmp_path, monkeypatch, make_config, caplog
):
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
            assert merged[op].to_numpy() == pytest.approx(merged[op + "_c"].to_numpy(), rel=1e-5, abs=1e-9), (
                family,
                op,
            )


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@contextlib.contextmanager
def dynamo_log():
    """Dynamo's own log records (recompile reasons included), as they reach its handlers."""
    import torch._logging

    records = _Records()
    logger = logging.getLogger("torch._dynamo")
    torch._logging.set_logs(recompiles=True)
    logger.addHandler(records)
    try:
        yield records.records
    finally:
        logger.removeHandler(records)
        torch._logging.set_logs()


def recompiles_per_frame(records) -> collections.Counter:
    """Frame id -> recompiles, from Dynamo's "Recompiling function ... - <frame>/<n>: reason"."""
    counts: collections.Counter = collections.Counter()
    for r in records:
        text = r.getMessage()
        found = re.search(r"- (\d+)/\d+:", text)
        if text.startswith("Recompiling function") and found:
            counts[found.group(1)] += 1
    return counts


def train_compiled(tmp_path, monkeypatch, make_config, monitored: bool, steps: int = 40):
    """TinyGPT compiled whole, 1-3 micro-batches per step, an evaluation under no_grad every 10
    steps, activations recorded on every other step.  Returns (Dynamo's records, frames compiled
    in the second half of the run)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / f"out_{monitored}"))
    torch.manual_seed(0)
    model = TinyGPT(SMALL)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = None
    step = [0]
    if monitored:
        # every other step collected: hooks that record and hooks that return at once alternate
        cfg = make_config(xy_distribution=True, all_xy=True, wg_distribution=True, ops=OPS, step_interval=2)
        monitor = TrainerMon(cfg)
        monitor.set_monitor(model, optimizer=optimizer, grad_acc_steps=lambda: 1 + step[0] % 3)
    forward = torch.compile(model, backend="eager")
    data = synthetic_batches(SMALL, 4, 4 * steps, seed=3)
    with dynamo_log() as records:
        for step[0] in range(steps):
            if step[0] == steps // 2:
                halfway = counters["frames"]["total"]
            for _ in range(1 + step[0] % 3):
                tokens = next(data)
                logits = forward(tokens[:, :-1])
                F.cross_entropy(logits.reshape(-1, SMALL.vocab), tokens[:, 1:].reshape(-1)).backward()
            optimizer.step()
            optimizer.zero_grad()
            if step[0] % 10 == 9:
                model.eval()
                with torch.no_grad():
                    for _ in range(3):
                        forward(next(data)[:, :-1])
                model.train()
        late = counters["frames"]["total"] - halfway
    if monitor is not None:
        monitor.close()
    torch._dynamo.reset()
    return list(records), late


@pytest.mark.slow
def test_a_compiled_model_with_activations_recompiles_no_more_than_without_trainmon(tmp_path, monkeypatch, make_config):
    """Each recorded module is a graph break, so its forward starts a frame of its own: all the
    Linears of a model share Linear.forward and its recompile_limit (8), one compile per shape and
    grad mode (nanoGPT: 'expected 32, actual 128').  One-op modules are not compiled on their own,
    so no code object recompiles more often than the plain compiled model's, and the run settles."""
    plain, plain_late = train_compiled(tmp_path, monkeypatch, make_config, monitored=False)
    watched, watched_late = train_compiled(tmp_path, monkeypatch, make_config, monitored=True)
    limit = [r.getMessage() for r in watched if "recompile_limit" in r.getMessage()]
    assert not limit, limit
    most = max(recompiles_per_frame(plain).values(), default=0)
    assert max(recompiles_per_frame(watched).values(), default=0) <= most, recompiles_per_frame(watched)
    assert plain_late == watched_late == 0  # nothing is compiled again once every pass was seen


class Widen(nn.Module):
    """A block with a child: its forward is worth compiling, and each width is one more compile."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)

    def forward(self, x):
        return torch.tanh(self.fc(x)) * 0.5


@pytest.mark.slow
def test_an_unavoidable_recompile_limit_is_one_trainmon_hint_instead_of_dynamos_warning(
    output_root, make_config, caplog
):
    """Ten recorded blocks of ten widths: Widen.forward is compiled once per width and reaches
    Dynamo's recompile_limit; one trainmon line says why instead of Dynamo's warning."""
    torch._dynamo.reset()
    widths = [4 + i for i in range(11)]
    model = nn.Sequential(*[Widen(a, b) for a, b in itertools.pairwise(widths)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = TrainerMon(make_config(xy_distribution=True, targets=[str(i) for i in range(10)], ops=OPS))
    monitor.set_monitor(model, optimizer=optimizer)
    forward = torch.compile(model, backend="eager")
    with dynamo_log() as records, caplog.at_level(logging.WARNING, logger="trainmon"):
        for _ in range(2):
            forward(torch.randn(3, widths[0])).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        monitor.close()
    torch._dynamo.reset()
    assert not [r for r in records if "hit config" in r.getMessage()]
    hints = [r.getMessage() for r in caplog.records if "reached recompile_limit" in r.getMessage()]
    assert len(hints) == 1 and "Widen" not in hints[0] and "'forward' (" in hints[0], caplog.text
    assert __file__ in hints[0]
    rows = read_family(only_run_dir(output_root) / rank_dir_name(0), "actv")
    assert set(rows["step"]) == {0, 1} and len(rows) == 2 * 10 * 2  # every block, in and out


_TRAIN_ONE_STEP = """
import sys, json
import torch, torch.nn as nn
{monitor}
model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
{attach}
loss = model(torch.randn(3, 4)).pow(2).mean()
loss.backward()
with torch.no_grad():
    for p in model.parameters():   # a hand-written SGD step: torch.optim imports Dynamo itself
        p -= 0.1 * p.grad
        p.grad = None
{step}
print(json.dumps("torch._dynamo" in sys.modules))
"""


def _dynamo_loaded(tmp_path, code: str) -> bool:
    env = dict(os.environ, MONITOR_OUTPUT_DIR=str(tmp_path / "out"), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_trainmon_does_not_import_dynamo_for_a_model_that_is_never_compiled(tmp_path, make_config):
    config = make_config(xy_distribution=True, all_xy=True, wg_distribution=True, param_distribution=True, ops=OPS)
    baseline = _dynamo_loaded(tmp_path, _TRAIN_ONE_STEP.format(monitor="", attach="", step=""))
    monitored = _dynamo_loaded(
        tmp_path,
        _TRAIN_ONE_STEP.format(
            monitor=f"import trainmon\nfrom trainmon import TrainerMon\nmonitor = TrainerMon({str(config)!r})",
            attach="monitor.set_monitor(model)",
            step="monitor.step()\nmonitor.close()\nassert list((__import__('pathlib').Path("
            f"{str(tmp_path / 'out')!r})).rglob('actv_*.csv'))",
        ),
    )
    assert baseline is False  # else this torch loads Dynamo by itself and there is nothing to test
    assert monitored is False
