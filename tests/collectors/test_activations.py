"""xy_distribution end to end: every actv/actv_grad row against stats the test takes with its own
hooks, micro-batch numbering, in-place ops, checkpointing, selection, naming, training unchanged."""
from __future__ import annotations

import logging
import math
from collections import defaultdict

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tests._support.runs import only_run_dir, read_family, reference_stats
from trainmon import ConfigError, TrainerMon
from trainmon.testing.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches
from trainmon.core.naming import squash_name

OPS = ["norm", "mean", "min", "max", "std", "zeros", "nans", "infs"]
V, D = 24, 16


class Mix(nn.Module):
    """Takes a keyword tensor, returns a tuple."""

    def forward(self, x, *, gate=None, scale=1.0):
        return x * torch.sigmoid(gate) * scale, gate.mean(-1)


class Net(nn.Module):
    """Embedding (integer input), LayerNorm, attention with a tuple output and keyword args,
    a module with a keyword tensor and tuple output, an MLP with an in-place ReLU."""

    def __init__(self, inplace: bool = True):
        super().__init__()
        self.embedding = nn.Embedding(V, D)
        self.ln = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.gate = nn.Linear(D, D)
        self.mix = Mix()
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.ReLU(inplace=inplace), nn.Linear(2 * D, D))
        self.head = nn.Linear(D, V)

    def forward(self, tokens):
        x = self.embedding(tokens)
        h = self.ln(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        x = x + a
        y, s = self.mix(x, gate=self.gate(x), scale=0.5)
        x = y + s.unsqueeze(-1)
        return self.head(x + self.mlp(x))

    def loss(self, tokens):
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, V), tokens[:, 1:].reshape(-1))


def _flat(value, out):
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _flat(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _flat(v, out)
    return out


class _Tap(torch.autograd.Function):
    """Identity that hands its gradient to ``sink``: the truth for keyword-tensor input grads
    (``register_full_backward_hook`` covers positional arguments only)."""

    @staticmethod
    def forward(ctx, x, sink):
        ctx.sink = sink
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.sink(g)
        return g, None


class Truth:
    """The test's own hooks: float64 stats of every module input/output and of its gradient.
    Output grads: tensor hooks (d loss / d output).  Input grads: the module's own ``grad_input``
    from ``register_full_backward_hook`` (keyword tensors: a tap of the test's own)."""

    def __init__(self, model: nn.Module):
        self.rows: dict[tuple, list[dict]] = defaultdict(list)  # (family, step, micro, name)
        self.step = self.micro = 0
        self._inputs: dict[str, tuple[list[str], list[int]]] = {}
        for name, m in model.named_modules():
            if name and type(m).forward is not nn.Module.forward:
                m.register_forward_pre_hook(lambda mod, a, kw, n=name: self._pre(n, a, kw), with_kwargs=True)
                m.register_forward_hook(lambda mod, a, out, n=name: self._see(n, "output", _flat(out, [])))
                m.register_full_backward_hook(lambda mod, gin, gout, n=name: self._grad_input(n, gin))

    def _names(self, module, kind, n):
        return [f"{module}.{kind}"] if n == 1 else [f"{module}.{kind}.{i}" for i in range(n)]

    def _pre(self, module, args, kwargs):
        tensors = _flat(kwargs, _flat(args, []))
        names = self._names(module, "input", len(tensors))
        positional = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        # a tensor passed several times (attention's q, k, v) is one input: its grad is the sum
        same = [[j for j, i2 in enumerate(positional) if args[i2] is args[i]] for i in positional]
        self._inputs[module] = (names, positional, same)
        self._see(module, "input", tensors, grads=False)
        step, micro, out, k = self.step, self.micro, dict(kwargs), len(positional)
        for key, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                if v.requires_grad:
                    sink = lambda g, n=names[k]: self.rows[("actv_grad", step, micro, n)].append(reference_stats(g))  # noqa: E731
                    out[key] = _Tap.apply(v, sink)
                k += 1
        return args, out

    def _grad_input(self, module, grad_input):
        names, positional, same = self._inputs[module]
        for j, i in enumerate(positional):
            if grad_input[i] is not None:
                total = sum(grad_input[positional[k]].double() for k in same[j])
                self.rows[("actv_grad", self.step, self.micro, names[j])].append(reference_stats(total))

    def _see(self, module, kind, tensors, grads=True):
        names = self._names(module, kind, len(tensors))
        step, micro = self.step, self.micro
        for n, t in zip(names, tensors):
            self.rows[("actv", step, micro, n)].append(reference_stats(t))
            if grads and t.requires_grad:
                t.register_hook(lambda g, n=n: self.rows[("actv_grad", step, micro, n)].append(reference_stats(g)))


def run(model, monitor_cfg, make_config, steps=2, acc=3, truth=True, optimizer_cls=torch.optim.SGD):
    torch.manual_seed(1)
    optimizer = optimizer_cls(model.parameters(), lr=0.05)
    monitor = TrainerMon(make_config(**monitor_cfg)) if monitor_cfg is not None else None
    if monitor:
        monitor.set_monitor(model, grad_acc_steps=acc, optimizer=optimizer)
    t = Truth(model) if truth else None
    data = synthetic_batches(GPTConfig(vocab=V, seq=8), 4, steps * acc, seed=2)
    losses = []
    for step in range(steps):
        for micro in range(acc):
            if t:
                t.step, t.micro = step, micro
            loss = model.loss(next(data)) / acc
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    if monitor:
        monitor.close()
    return t, losses


def assert_rows_match(df, truth, family, ops=OPS, rtol=1e-5):
    got = defaultdict(list)
    for row in df.itertuples(index=False):
        got[(family, row.step, row.micro_step, row.name)].append(row)
    want = {k: v for k, v in truth.rows.items() if k[0] == family}
    assert set(got) == set(want), (family, sorted(set(got) ^ set(want))[:6])
    for key, rows in got.items():
        assert len(rows) == len(want[key]), key
        for row, exp in zip(rows, want[key]):
            for op in ops:
                g, e = getattr(row, op), exp[op]
                if isinstance(e, float) and math.isnan(e):
                    assert math.isnan(g), (key, op)
                else:
                    atol = exp["_mean_atol"] if op == "mean" else 1e-30
                    assert g == pytest.approx(e, rel=rtol, abs=atol), (key, op, g, e)


def test_values_names_and_micro_steps_equal_own_hooks(output_root, make_config):
    # The truth comes from a twin run without the in-place ReLU (same values, and plain tensor
    # hooks see every gradient there); the monitored run has it.
    torch.manual_seed(0)
    truth, base_losses = run(Net(inplace=False), None, make_config)
    torch.manual_seed(0)
    _, losses = run(Net(), dict(xy_distribution=True, all_xy=True, ops=OPS), make_config, truth=False)
    assert losses == base_losses
    rank0 = only_run_dir(output_root) / "rank0"
    actv, grad = read_family(rank0, "actv"), read_family(rank0, "actv_grad")
    for df in (actv, grad):
        assert list(df.columns) == ["vpp_stage", "name", "step", "micro_step", *OPS, "shape", "dtype"]
        assert sorted(df["micro_step"].unique()) == [0, 1, 2]
        assert sorted(df["step"].unique()) == [0, 1]
    assert_rows_match(actv, truth, "actv")
    assert_rows_match(grad, truth, "actv_grad")
    names = set(actv["name"])
    # kwargs count, tuples are indexed, a single tensor is not, containers' members are named
    assert {"mix.input.0", "mix.input.1", "mix.output.0", "mix.output.1", "attn.input.0", "attn.input.2",
            "attn.output", "mlp.1.output", "embedding.input"} <= names
    assert "root.input" not in names  # root excluded by all_xy unless targeted
    emb = actv[actv["name"] == "embedding.input"]
    assert (emb["dtype"] == "torch.int64").all() and emb["max"].max() < V
    assert "embedding.input" not in set(grad["name"])  # no grad for token ids: no row, no NaNs
    assert not grad[OPS[:5]].isna().any().any()
    # in-place ReLU after the Linear: the Linear's output keeps its pre-ReLU values
    lin, relu = (actv[(actv["name"] == n) & (actv["step"] == 0)] for n in ("mlp.0.output", "mlp.1.output"))
    assert (lin["min"] < 0).all() and (relu["min"] >= 0).all()
    # and the gradient w.r.t. the Linear's (pre-ReLU) output is there although the in-place op
    # rebased that view, with the view's shape
    lin_grad = grad[grad["name"] == "mlp.0.output"]
    assert len(lin_grad) == 6 and (lin_grad["shape"] == "[4, 8, 32]").all()
    # rows come in call order: forward inputs before outputs, backward from the loss down
    first = actv[(actv.step == 0) & (actv.micro_step == 0)]["name"].tolist()
    assert first[:2] == ["embedding.input", "embedding.output"]
    assert grad[(grad.step == 0) & (grad.micro_step == 0)]["name"].iloc[0] == "head.output"


@pytest.mark.parametrize("only", ["forward_only", "backward_only"])
def test_forward_only_and_backward_only(output_root, make_config, only):
    model = Net()
    run(model, dict(xy_distribution=True, targets=["mlp"], **{only: True}), make_config, steps=1, acc=1,
        truth=False)
    rank0 = only_run_dir(output_root) / "rank0"
    assert read_family(rank0, "actv").empty == (only == "backward_only")
    assert read_family(rank0, "actv_grad").empty == (only == "forward_only")


def test_targets_select_modules_on_dotted_boundaries(output_root, make_config):
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=V, seq=8, dim=8, heads=2, layers=11))
    cfg = dict(xy_distribution=True, targets=["layers.1", "root", "layers.10.mlp.0"])
    run(model, cfg, make_config, steps=1, acc=1, truth=False)
    rank0 = only_run_dir(output_root) / "rank0"
    for family in ("actv", "actv_grad"):
        names = set(read_family(rank0, family)["name"])
        assert names == {"layers.1.input", "layers.1.output", "root.output", "layers.10.mlp.0.input",
                         "layers.10.mlp.0.output"} | ({"root.input"} if family == "actv" else set())
    with pytest.raises(ConfigError, match=r"'layers\.1\.atn' matches no module.*did you mean 'layers\.1\.attn'"):
        TrainerMon(make_config(xy_distribution=True, targets=["layers.1.atn"])).set_monitor(model)


def test_container_target_warns(output_root, make_config, caplog):
    model = TinyGPT(GPTConfig(vocab=V, seq=8, dim=8, heads=2, layers=2))
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        TrainerMon(make_config(xy_distribution=True, targets=["layers"])).set_monitor(model).close()
    assert "target 'layers' is a ModuleList, which is never called" in caplog.text


def test_step_interval_records_only_selected_steps(output_root, make_config):
    model = Net()
    run(model, dict(xy_distribution=True, all_xy=True, step_interval=2), make_config, steps=4, acc=2, truth=False)
    rank0 = only_run_dir(output_root) / "rank0"
    for family in ("actv", "actv_grad"):
        df = read_family(rank0, family)
        assert sorted(df["step"].unique()) == [0, 2]
        assert sorted(df["micro_step"].unique()) == [0, 1]
        # one row per (name, step, micro_step): nothing leaks from the skipped steps
        assert not df.duplicated(["name", "step", "micro_step"]).any()


class Checkpointed(nn.Module):
    """TinyGPT whose blocks run under torch.utils.checkpoint."""

    def __init__(self, reentrant: bool | None):
        super().__init__()
        torch.manual_seed(0)
        self.inner = TinyGPT(GPTConfig(vocab=V, seq=8, dim=16, heads=2, layers=2))
        self.reentrant = reentrant

    def forward(self, tokens):
        g = self.inner
        x = g.embedding(tokens) + g.pos[: tokens.shape[1]]
        for layer in g.layers:
            x = layer(x) if self.reentrant is None else checkpoint(layer, x, use_reentrant=self.reentrant)
        return g.output(g.final_norm(x))

    def loss(self, tokens):
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, V), tokens[:, 1:].reshape(-1))


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointing_records_each_forward_once(tmp_path, monkeypatch, make_config, reentrant):
    frames = {}
    for mode in (None, reentrant):
        monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / f"out_{mode}"))
        run(Checkpointed(mode), dict(xy_distribution=True, all_xy=True, ops=OPS), make_config,
            steps=2, acc=2, truth=False)
        rank0 = only_run_dir(tmp_path / f"out_{mode}") / "rank0"
        frames[mode] = {f: read_family(rank0, f) for f in ("actv", "actv_grad")}
    for family in ("actv", "actv_grad"):
        plain, ckpt = frames[None][family], frames[reentrant][family]
        key = ["step", "micro_step", "name"]
        assert not ckpt.duplicated(key).any(), family
        assert len(ckpt) == len(plain)
        merged = plain.merge(ckpt, on=key, suffixes=("", "_c"))
        assert len(merged) == len(plain), family
        for op in OPS[:5]:
            assert merged[op].to_numpy() == pytest.approx(merged[op + "_c"].to_numpy(), rel=1e-5, abs=1e-9)
    # blocks inside checkpoints have their gradients recorded, on the right micro-batches
    g = frames[reentrant]["actv_grad"]
    assert set(g[g.name == "inner.layers.0.attn.qkv.output"]["micro_step"]) == {0, 1}


def test_training_is_bitwise_unchanged(output_root, make_config):
    cfg = dict(xy_distribution=True, all_xy=True, wg_distribution=True, mv_distribution=True,
               param_distribution=True, ops=OPS)
    results = []
    for monitor_cfg in (None, cfg):
        torch.manual_seed(0)
        model = Net()
        _, losses = run(model, monitor_cfg, make_config, steps=3, acc=2, truth=False,
                        optimizer_cls=torch.optim.AdamW)
        results.append((losses, [p.detach().clone() for p in model.parameters()]))
    assert results[0][0] == results[1][0]
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


def test_squash_name():
    assert squash_name("module.language_model.encoder.layers.3.mlp") == "layers.3.mlp"
    assert squash_name("language_model.embedding.word_embeddings") == "embedding.word_embeddings"
    assert squash_name("language_model.encoder.final_layernorm") == "final_layernorm"
    assert squash_name("language_model.output_layer") == "output_layer"
    assert squash_name("layers.0.mlp.output_proj") == "layers.0.mlp.output_proj"  # first match wins
    assert squash_name("decoder.blocks.0") == "decoder.blocks.0"                 # nothing to squash
    assert squash_name("model.layers") == "model.layers"                         # `layers.` needs a dot


def test_squash_name_in_output_and_clashes_keep_full_names(output_root, make_config, caplog):
    outer = nn.Module()
    outer.language_model = TinyGPT(GPTConfig(vocab=V, seq=8, dim=8, heads=2, layers=1))
    outer.other = nn.Module()
    outer.other.layers = nn.ModuleList([nn.Linear(8, 8)])
    outer.forward = lambda tokens: outer.other.layers[0](outer.language_model(tokens)[..., :8])
    cfg = make_config(xy_distribution=True, squash_name=True,
                      targets=["language_model.layers.0.mlp", "language_model.output", "other.layers.0",
                               "language_model.layers.0"])
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        monitor = TrainerMon(cfg).set_monitor(outer)
    outer(torch.randint(0, V, (2, 8))).sum().backward()
    monitor.step()
    monitor.close()
    names = set(read_family(only_run_dir(output_root) / "rank0", "actv")["name"])
    assert {"layers.0.mlp.input", "output.output"} <= names
    # language_model.layers.0 and other.layers.0 would both be layers.0
    assert {"language_model.layers.0.input", "other.layers.0.input"} <= names
    assert "squash_name would give 2 modules the same name" in caplog.text


def test_print_struct_writes_the_tree_and_training_continues(output_root, make_config, caplog):
    torch.manual_seed(0)
    model = Net()
    seen = {}
    def note(name, args, kwargs, out):
        seen.setdefault(name or "root", ([list(t.shape) for t in _flat(kwargs, _flat(args, []))],
                                         [list(t.shape) for t in _flat(out, [])]))

    for name, m in model.named_modules():
        m.register_forward_hook(lambda mod, a, kw, out, n=name: note(n, a, kw, out), with_kwargs=True)
    cfg = dict(print_struct=True, xy_distribution=True, targets=["mlp"])
    with caplog.at_level(logging.INFO, logger="trainmon"):
        _, losses = run(model, cfg, make_config, steps=3, acc=1, truth=False)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)  # the run went on
    run_dir = only_run_dir(output_root)
    assert sorted(read_family(run_dir / "rank0", "actv")["step"].unique()) == [0, 1, 2]
    import json
    tree = json.loads((run_dir / "module_struct.json").read_text())["chunks"][0]["tree"]
    assert tree["name"] == "root" and tree["type"] == "Net"

    def walk(node):
        yield node
        for c in node["children"]:
            yield from walk(c)

    nodes = {n["name"]: n for n in walk(tree)}
    assert set(nodes) == {n or "root" for n, _ in model.named_modules()}
    for name, node in nodes.items():
        if name == "attn.out_proj":  # MultiheadAttention uses its weight, never calls it
            assert not node["called"] and name not in seen
            continue
        assert node["called"], name
        assert [io["shape"] for io in node["input"]] == seen[name][0], name
        assert [io["shape"] for io in node["output"]] == seen[name][1], name
    assert nodes["embedding"]["input"] == [{"name": "embedding.input", "shape": [4, 8], "dtype": "torch.int64"}]
    assert [io["name"] for io in nodes["mix"]["input"]] == ["mix.input.0", "mix.input.1"]
    assert [c["name"] for c in nodes["mlp"]["children"]] == ["mlp.0", "mlp.1", "mlp.2"]
    assert "module structure (print_struct; training continues)" in caplog.text
    assert "  mlp.1 (ReLU)  in: float32[4, 8, 32]  out: float32[4, 8, 32]" in caplog.text


@pytest.mark.slow  # torch.compile
def test_compiled_model_records_the_uncompiled_boundaries(tmp_path, monkeypatch, make_config, caplog):
    """torch.compile: hooks run eagerly at every selected module (graph breaks), so the rows are
    those of the eager model.  aot_eager exercises dynamo and AOT autograd without a C compiler."""
    frames = {}
    for backend in (None, "aot_eager"):
        out = tmp_path / f"out_{backend}"
        monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
        torch.manual_seed(0)
        net = Net()
        model = net if backend is None else torch.compile(net, backend=backend)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        with caplog.at_level(logging.WARNING, logger="trainmon"):
            monitor = TrainerMon(make_config(xy_distribution=True, all_xy=True, ops=OPS))
            monitor.set_monitor(model, grad_acc_steps=2, optimizer=optimizer)
        data = synthetic_batches(GPTConfig(vocab=V, seq=8), 4, 4, seed=2)
        for _ in range(2):
            for _ in range(2):
                tokens = next(data)
                logits = model(tokens[:, :-1])
                (F.cross_entropy(logits.reshape(-1, V), tokens[:, 1:].reshape(-1)) / 2).backward()
            optimizer.step()
            optimizer.zero_grad()
        monitor.close()
        rank0 = only_run_dir(out) / "rank0"
        frames[backend] = {f: read_family(rank0, f) for f in ("actv", "actv_grad")}
    assert "the model uses torch.compile" in caplog.text
    for family in ("actv", "actv_grad"):
        eager, compiled = frames[None][family], frames["aot_eager"][family]
        key = ["step", "micro_step", "name"]
        merged = eager.merge(compiled, on=key, suffixes=("", "_c"))
        assert len(merged) == len(eager) == len(compiled), family
        for op in OPS[:5]:
            assert merged[op].to_numpy() == pytest.approx(merged[op + "_c"].to_numpy(), rel=1e-5, abs=1e-9)
