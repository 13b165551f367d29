"""Odd parameters (issue 12, item 8): a complex parameter is recorded by its modulus |z| (norm =
the complex 2-norm, computed here in float64 from the tensor), and a zero-element parameter is
recorded but never a finding of ``anomalies`` (nor of the runtime alerts)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn

from tests._support.runs import only_run_dir, read_family
from trainmon import TrainerMon
from trainmon.cli import main


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.z = nn.Parameter(torch.randn(6, 3, dtype=torch.complex64))
        self.empty = nn.Parameter(torch.zeros(0, 4))

    def forward(self, x):
        y = self.lin(x)
        # the complex and the empty param both take part, so both get (complex / empty) grads
        return (
            y.sum()
            + (self.z.abs() ** 2).sum() * 0.01
            + (self.empty.sum() if self.empty.numel() else 0)
            + (x[:, :0] @ self.empty).sum()
        )


def _truth(t: torch.Tensor) -> dict[str, float]:
    m = t.detach().abs().double().reshape(-1) if t.is_complex() else t.detach().double().reshape(-1)
    return {"norm": m.norm().item(), "min": m.min().item(), "max": m.max().item(), "mean": m.mean().item()}


@pytest.mark.slow
def test_complex_params_are_recorded_by_their_modulus_and_empty_ones_are_never_findings(
    output_root, make_config, capsys
):
    model = Odd()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cfg = make_config(
        wg_distribution=True,
        param_distribution=True,
        mv_distribution=True,
        ur_distribution=True,
        ops=["norm", "min", "max", "mean", "nans"],
        alert={"rules": [{"rule_name": "AnomalyNan"}]},
    )
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    truth: dict[tuple[str, int], dict] = {}
    for step in range(4):
        truth[("param_origin", step)] = _truth(model.z)
        model(torch.randn(2, 4)).backward()
        truth[("grad_reduced", step)] = _truth(model.z.grad)
        opt.step()
        truth[("exp_avg", step)] = _truth(opt.state[model.z]["exp_avg"])
        opt.zero_grad()
    mon.close()
    rank0 = only_run_dir(output_root) / "rank0"
    for family in ("param_origin", "grad_reduced", "exp_avg"):
        df = read_family(rank0, family)
        z = df[df["name"].str.endswith("z")]
        assert len(z) == 4 and (z["dtype"] == "torch.complex64").all() and (z["shape"] == "[6, 3]").all()
        for _, r in z.iterrows():
            want = truth[(family, int(r["step"]))]
            for op in ("norm", "min", "max", "mean"):
                assert r[op] == pytest.approx(want[op], rel=1e-5), (family, op)
        empty = df[df["name"].str.endswith("empty")]
        assert len(empty) == 4 and (empty["shape"] == "[0, 4]").all(), "an empty param is still recorded"
        assert (empty["norm"] == 0).all() and empty["mean"].isna().all()
    capsys.readouterr()
    assert main(["anomalies", str(only_run_dir(output_root)), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["count"] == 0, doc["anomalies"][:3]
    assert not (rank0 / "anomalies.jsonl").exists() or not (rank0 / "anomalies.jsonl").read_text().strip()
    ur = read_family(rank0, "update_ratio")
    z_ratio = ur[ur["name"].str.endswith("z")]["update_ratio"]
    assert len(z_ratio) == 4 and all(math.isfinite(v) and v > 0 for v in z_ratio)


# -- issue 34, items 4-6: sparse grads, float8 outputs, a parameter without data ---------------
ALL_OPS = ["norm", "mean", "min", "max", "zeros", "nans", "infs", "std"]


def _truth_all(t: torch.Tensor) -> dict[str, float]:
    """Every statistic of ``t`` (densified when sparse) in float64: the independent truth."""
    from tests._support.runs import reference_stats

    dense = t.detach().to_dense() if t.layout != torch.strided else t.detach()
    return reference_stats(dense.to(torch.float64))


def _assert_rows(df, name: str, truth: dict[int, dict[str, float]], rel: float = 1e-5) -> None:
    rows = df[df["name"] == name]
    assert sorted(rows["step"]) == sorted(truth), (name, sorted(rows["step"]))
    for _, r in rows.iterrows():
        want = truth[int(r["step"])]
        for op in ALL_OPS:
            if isinstance(want[op], float) and math.isnan(want[op]):
                assert math.isnan(r[op]), (name, op)
            else:
                tol = max(want["_mean_atol"], 1e-9) if op == "mean" else 1e-9
                assert r[op] == pytest.approx(want[op], rel=rel, abs=tol), (name, op, r[op], want[op])


class SparseNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(12, 4, sparse=True)
        self.head = nn.Linear(4, 1)

    def forward(self, ids):
        return self.head(self.emb(ids)).square().mean()


@pytest.mark.slow
def test_a_sparse_embedding_grad_is_recorded_with_its_dense_statistics_and_the_dense_params_too(
    output_root, make_config, caplog
):
    model = SparseNet()
    sparse_opt = torch.optim.SparseAdam(list(model.emb.parameters()), lr=1e-2)
    dense_opt = torch.optim.Adam(model.head.parameters(), lr=1e-2)
    cfg = make_config(wg_distribution=True, mv_distribution=True, ops=ALL_OPS)
    mon = TrainerMon(str(cfg))
    mon.set_monitor(model, optimizer=sparse_opt)
    grads: dict[str, dict[int, dict]] = {"emb.weight": {}, "head.weight": {}, "head.bias": {}}
    moments: dict[int, dict] = {}
    for step in range(3):
        ids = torch.tensor([[1, 3, 3, 7], [3, 1, 9, 9]])  # repeated rows: an uncoalesced sparse grad
        model(ids).backward()
        assert model.emb.weight.grad.layout == torch.sparse_coo and not model.emb.weight.grad.is_coalesced()
        for name, p in model.named_parameters():
            grads[name][step] = _truth_all(p.grad)
        dense_opt.step()
        sparse_opt.step()
        moments[step] = _truth_all(sparse_opt.state[model.emb.weight]["exp_avg"])
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
    mon.close()
    assert "is switched off" not in caplog.text and "not recorded" not in caplog.text, caplog.text
    rank0 = only_run_dir(output_root) / "rank0"
    for family in ("grad_unreduced", "grad_reduced"):
        df = read_family(rank0, family)
        for name, truth in grads.items():
            _assert_rows(df, name, truth)
        emb = df[df["name"] == "emb.weight"]
        assert (emb["shape"] == "[12, 4]").all() and (emb["zeros"] > 0.5).all(), "8 of 12 rows are implicit zeros"
    _assert_rows(read_family(rank0, "exp_avg"), "emb.weight", moments)


class Float8Out(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        return x.to(self.dtype)


class QuantizedSide(nn.Module):
    """Trains through ``lin``; ``q`` casts its output to float8 on the side (a quantized copy for a
    later fp8 matmul), so the float8 tensor is a module output the monitor sees."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.q4 = Float8Out(torch.float8_e4m3fn)
        self.q5 = Float8Out(torch.float8_e5m2)
        self.seen: dict[str, torch.Tensor] = {}

    def forward(self, x):
        y = self.lin(x)
        self.seen = {"lin": y, "q4": self.q4(y), "q5": self.q5(y * 1e3)}
        return y.square().mean()


@pytest.mark.slow
@pytest.mark.parametrize("fused", ["1", "0"])
def test_a_module_that_outputs_float8_keeps_the_activations_collector_on(
    output_root, make_config, monkeypatch, caplog, fused
):
    monkeypatch.setenv("TRAINMON_FUSED_CPU", fused)
    model = QuantizedSide()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(str(make_config(xy_distribution=True, all_xy=True, ops=ALL_OPS)))
    mon.set_monitor(model, optimizer=opt)
    truth: dict[str, dict[int, dict]] = {"q4": {}, "q5": {}, "lin": {}}
    for step in range(3):
        x = torch.randn(4, 8)
        loss = model(x)
        truth["q4"][step] = _truth_all(model.seen["q4"])
        truth["q5"][step] = _truth_all(model.seen["q5"])
        truth["lin"][step] = _truth_all(model.seen["lin"])
        loss.backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    assert "switched off" not in caplog.text, caplog.text
    df = read_family(only_run_dir(output_root) / "rank0", "actv")
    for module in ("q4", "q5"):
        name = next(n for n in df["name"].unique() if n.startswith(f"{module}.output"))
        _assert_rows(df, name, truth[module])
        assert set(df[df["name"] == name]["dtype"]) == {f"torch.{'float8_e4m3fn' if module == 'q4' else 'float8_e5m2'}"}
    lin_out = next(n for n in df["name"].unique() if n.startswith("lin.output"))
    _assert_rows(df, lin_out, truth["lin"])


class WithMetaParam(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 2)
        self.lazy = nn.Parameter(torch.empty(5, 3, device="meta"))  # never materialized

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).square().mean()


@pytest.mark.slow
def test_one_meta_parameter_is_skipped_with_one_warning_and_every_other_row_is_right(output_root, make_config, caplog):
    model = WithMetaParam()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cfg = make_config(
        wg_distribution=True,
        param_distribution=True,
        mv_distribution=True,
        ur_distribution=True,
        xy_distribution=True,
        all_xy=True,
        ops=ALL_OPS,
    )
    mon = TrainerMon(str(cfg))
    mon.set_monitor(model, optimizer=opt)
    names = ["a.weight", "a.bias", "b.weight", "b.bias"]
    truth: dict[str, dict[str, dict[int, dict]]] = {
        f: {n: {} for n in names} for f in ("param_origin", "grad_reduced", "param_updated", "exp_avg", "exp_avg_sq")
    }
    ratios: dict[str, dict[int, float]] = {n: {} for n in names}
    params = dict(model.named_parameters())
    for step in range(3):
        before = {n: params[n].detach().clone() for n in names}
        model(torch.randn(3, 4)).backward()
        for n in names:
            truth["param_origin"][n][step] = _truth_all(before[n])
            truth["grad_reduced"][n][step] = _truth_all(params[n].grad)
        opt.step()
        for n in names:
            truth["param_updated"][n][step] = _truth_all(params[n])
            truth["exp_avg"][n][step] = _truth_all(opt.state[params[n]]["exp_avg"])
            truth["exp_avg_sq"][n][step] = _truth_all(opt.state[params[n]]["exp_avg_sq"])
            ratios[n][step] = ((params[n].double() - before[n].double()).norm() / before[n].double().norm()).item()
        opt.zero_grad()
    mon.close()
    rank0 = only_run_dir(output_root) / "rank0"
    assert len(list(rank0.glob("*.csv"))) > 0
    said = [r.getMessage() for r in caplog.records if "'lazy' is not recorded" in r.getMessage()]
    assert len(said) == 1 and "meta device" in said[0], caplog.text
    assert "switched off" not in caplog.text and "not recorded" not in caplog.text.replace(said[0], "")
    for family, per_name in truth.items():
        df = read_family(rank0, family)
        assert "lazy" not in set(df["name"]), family
        for n, t in per_name.items():
            _assert_rows(df, n, t)
    ur = read_family(rank0, "update_ratio")
    assert "lazy" not in set(ur["name"])
    for n in names:
        got = ur[ur["name"] == n].sort_values("step")["update_ratio"].tolist()
        assert got == pytest.approx([ratios[n][s] for s in range(3)], rel=1e-5), n
    assert len(read_family(rank0, "actv")) > 0 and len(read_family(rank0, "grad_unreduced")) == 12
