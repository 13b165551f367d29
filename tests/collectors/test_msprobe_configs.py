"""Every example config of msprobe's monitor guide (examples/configs/msprobe/, copied unchanged)
loads and runs a few steps on TinyGPT, and records what it asks for.  The two configs that name
Megatron modules run on a TinyGPT whose modules carry those names."""
from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests._support.runs import only_run_dir, read_family, reference_stats
from trainmon import TrainerMon, load_config
from trainmon.testing.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs" / "msprobe"
CFG = GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=2)
ACC = 2


class _Layer(nn.Module):
    """Megatron's TransformerLayer signature: (hidden_states, attention_mask) in, one tensor out."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.mlp = block.mlp   # first, so that this is its name (msprobe's guide targets it)
        self.block = block

    def forward(self, hidden_states, attention_mask):
        return self.block(hidden_states) * attention_mask


class MegatronNamed(nn.Module):
    """TinyGPT's modules under Megatron-style names: ``[language_model.]embedding.word_embedding``,
    ``[language_model.]encoder.layers.<i>`` (taking a mask), ``...encoder.layers.<i>.mlp``."""

    def __init__(self, prefix: str):
        super().__init__()
        torch.manual_seed(0)
        gpt = TinyGPT(CFG)
        root = nn.Module()
        root.embedding = nn.Module()
        root.embedding.word_embedding = gpt.embedding
        root.encoder = nn.Module()
        root.encoder.layers = nn.ModuleList(_Layer(b) for b in gpt.layers)
        root.encoder.final_norm, root.encoder.output = gpt.final_norm, gpt.output
        self.pos = gpt.pos
        if prefix:
            setattr(self, prefix, root)
        else:
            self.embedding, self.encoder = root.embedding, root.encoder
        self._root = [root]
        self.cfg = CFG

    def forward(self, tokens):
        r = self._root[0]
        x = r.embedding.word_embedding(tokens) + self.pos[: tokens.shape[1]]
        mask = torch.ones(1, tokens.shape[1], 1)
        for layer in r.encoder.layers:
            x = layer(x, mask)
        return r.encoder.output(r.encoder.final_norm(x))

    def loss(self, tokens):
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _model_for(path: Path) -> nn.Module:
    text = path.read_text()
    if "language_model." in text:
        return MegatronNamed("language_model")
    if "module.encoder" in text:
        return MegatronNamed("")
    torch.manual_seed(0)
    return TinyGPT(CFG)


def _train(model, path: Path, steps: int = 3) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = TrainerMon(path).set_monitor(model, optimizer=opt, grad_acc_steps=ACC)
    data = synthetic_batches(CFG, 4, steps * ACC, seed=1)
    for _ in range(steps):
        for _ in range(ACC):
            (model.loss(next(data)) / ACC).backward()
        opt.step()
        opt.zero_grad()
    monitor.close()


def test_the_fifteen_guide_configs_are_all_here_unchanged():
    names = sorted(p.name for p in CONFIGS.glob("*.json"))
    assert len(names) == 15
    reference = Path("/work/shared/reference/msprobe_configs")
    if reference.is_dir():   # the copy is the guide's text, byte for byte
        for name in names:
            assert (CONFIGS / name).read_bytes() == (reference / name).read_bytes(), name


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.json")))
def test_each_guide_config_loads_and_runs_on_tiny_gpt(name, output_root, caplog):
    path = CONFIGS / name
    cfg = load_config(path)
    model = _model_for(path)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        _train(model, path)
    rank0 = only_run_dir(output_root) / "rank0"
    families = {"wg_distribution": ("grad_unreduced", "grad_reduced"), "mv_distribution": ("exp_avg", "exp_avg_sq"),
                "param_distribution": ("param_origin", "param_updated"), "xy_distribution": ("actv", "actv_grad")}
    for flag, fams in families.items():
        for family in fams:
            df = read_family(rank0, family)
            assert (not df.empty) == getattr(cfg, flag), (name, family)
            if not df.empty:
                assert sorted(df["step"].unique()) == [0, 1, 2], (name, family)
    l2 = [r for r in caplog.records if "L2 attention/linear features" in r.getMessage()]
    assert len(l2) == (1 if name.startswith("10_") else 0), name
    if cfg.print_struct:
        assert json.loads((only_run_dir(output_root) / "module_struct.json").read_text())["chunks"]
    if cfg.stack_info:
        with open(rank0 / "stack_info.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        assert {r["name"] for r in rows} >= {"layers.0", "layers.0.mlp", "output"}
        # the user's own frames are there (this test's _train), torch's are not
        assert all("in _train" in r["stack"] and "torch/nn/modules" not in r["stack"] for r in rows)
    if cfg.target_specs:   # 15: layers.0 records hidden_states (not the mask) and its one output
        layer0 = "language_model.encoder.layers.0"
        for family in ("actv", "actv_grad"):
            got = {n for n in read_family(rank0, family)["name"] if n.startswith(layer0 + ".")
                   and n.count(".") == layer0.count(".") + (2 if n.split(".")[-1].isdigit() else 1)}
            assert got == {f"{layer0}.input.0", f"{layer0}.output"}, (family, got)
        assert "language_model.encoder.layers.1.input.1" in set(read_family(rank0, "actv")["name"])
        assert not [r for r in caplog.records if "targets[" in r.getMessage()]   # the spec fits the calls
    if cfg.monitor_mbs_grad:
        unreduced = read_family(rank0, "grad_unreduced")
        assert sorted(unreduced["micro_step"].unique()) == list(range(ACC)), name


def _grads_per_micro_batch(steps: int = 2):
    """The test's own truth: each micro-batch's grad of every param (``autograd.grad``), summed
    into ``.grad`` in the order autograd accumulates them, so the training matches the real run."""
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    names, params = zip(*model.named_parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    data = synthetic_batches(CFG, 4, steps * ACC, seed=1)
    truth = {}
    for step in range(steps):
        for k in range(ACC):
            grads = torch.autograd.grad(model.loss(next(data)) / ACC, params)
            for n, p, g in zip(names, params, grads):
                truth[(step, k, n)] = reference_stats(g)
                p.grad = g if p.grad is None else p.grad + g
        opt.step()
        opt.zero_grad()
    return truth


@pytest.mark.slow
def test_monitor_mbs_grad_rows_are_each_micro_batchs_own_grad(output_root, make_config):
    truth = _grads_per_micro_batch()
    torch.manual_seed(0)
    _train(TinyGPT(CFG), make_config(wg_distribution=True, monitor_mbs_grad=True, ops=["norm", "max", "min"]), steps=2)
    df = read_family(only_run_dir(output_root) / "rank0", "grad_unreduced")
    assert len(df) == len(truth)
    for row in df.itertuples(index=False):
        ref = truth[(row.step, row.micro_step, row.name)]
        for op in ("norm", "max", "min"):
            assert getattr(row, op) == pytest.approx(ref[op], rel=1e-6, abs=1e-12), (row.name, row.step, op)
