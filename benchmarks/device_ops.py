"""What the accelerator statistics path asks of a device, counted through the seam.

    PYTHONPATH=. python benchmarks/device_ops.py              # default ops, then + nans, infs
    PYTHONPATH=. python benchmarks/device_ops.py --layers 4 --ops norm,mean,min,max,nans
    PYTHONPATH=. python benchmarks/device_ops.py --triton --kinds wg,xy,flat   # the Triton kernel

``--triton`` runs the Triton kernel on the CPU tensors in Triton's interpreter (slow: each program
is Python) and adds its launches per row; its aten ops are then the eager leftovers only.

``TRAINMON_DEVICE_PATH=1`` sends CPU tensors down the CUDA/NPU code path; a ``TorchDispatchMode``
(``trainmon.testing.op_counter``) counts every non-view aten op (a proxy for a kernel launch), host
syncs and host->device copies.  A Llama-shaped model (RMSNorm, SwiGLU MLP, attention, untied
head) trains with AdamW, grad_acc_steps 2; each family group runs alone against the same run
without a monitor, so the difference is the monitor's:

- monitor ops per recorded row (``ops/row``) and per step;
- host syncs and H2D copies inside forward/backward (monitored minus unmonitored);
- device->host copies per step (the step's snapshot copies);
- the largest tensor the stats path allocated while reducing (``DeviceRows.write``).

These are proxies measured on a CPU: they say nothing of kernel times (``benchmarks/gpu_check.py``
is the check for a CUDA machine).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

if "--triton" in sys.argv:  # before anything imports triton (torch may): the interpreter is chosen at its import
    os.environ.update(TRAINMON_TRITON_INTERPRET="1", TRITON_INTERPRET="1")

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainmon import TrainerMon
from trainmon.stats import device_rows
from trainmon.testing.op_counter import OpCounter

KINDS = {"wg": {"wg_distribution": True}, "mv": {"mv_distribution": True},
         "param": {"param_distribution": True}, "ur": {"ur_distribution": True},
         "xy": {"xy_distribution": True, "all_xy": True},
         # Megatron-like: every param and grad a view of one flat buffer (starts padded to 256)
         "flat": {"wg_distribution": True, "param_distribution": True}}
FLAT_DIM = 256   # the flat kind's model width: sizes that share a 256-element chunk (as Llama's do)


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(dim), RMSNorm(dim)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        hidden = int(dim * 8 / 3)
        self.gate_proj, self.up_proj = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        h = self.input_layernorm(x)
        q, k, v = (p(h).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.o_proj(att)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Layer(dim, heads) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def _flatten(model: nn.Module) -> None:
    """Params and grads as views of two flat buffers, each start padded to 256 elements."""
    params = list(model.parameters())
    sizes = [-(-p.numel() // 256) * 256 for p in params]
    pbuf, gbuf = torch.zeros(sum(sizes)), torch.zeros(sum(sizes))
    pos = 0
    for p, n in zip(params, sizes):
        p.data = pbuf[pos:pos + p.numel()].view_as(p).copy_(p.data)
        p.grad = gbuf[pos:pos + p.numel()].view_as(p)
        pos += n


def _run(args, kind: str | None, ops: list[str], root: Path, flat: bool = False) -> dict:
    torch.manual_seed(0)
    flat = flat or kind == "flat"
    model = Llama(args.vocab, FLAT_DIM if flat else args.dim, args.heads, args.layers)
    if flat:
        _flatten(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = None
    if kind is not None:
        cfg = root / f"{kind}.json"
        cfg.write_text(json.dumps({**KINDS[kind], "ops": ops}))
        os.environ["MONITOR_OUTPUT_DIR"] = str(root / "out")
        os.environ["TRAINMON_RUN_ID"] = f"{kind}-{len(ops)}"
        mon = TrainerMon(str(cfg))
        mon.set_monitor(model, grad_acc_steps=2, optimizer=opt)
    g = torch.Generator().manual_seed(1)
    fwd_bwd, step_ops = OpCounter(), OpCounter()
    for _ in range(args.steps):
        for _mb in range(2):
            ids = torch.randint(0, args.vocab, (2, args.seq), generator=g)
            with fwd_bwd:
                loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()) / 2
                loss.backward()
        with step_ops:
            opt.step()
            opt.zero_grad(set_to_none=not flat)
    rows = 0
    if mon is not None:
        mon.close()
        run = root / "out" / f"{kind}-{len(ops)}" / "rank0"
        rows = sum(max(len(p.read_text().splitlines()) - 1, 0) for p in run.glob("*.csv"))
    return {"fwd_bwd": fwd_bwd, "step": step_ops, "rows": rows}


def _count_launches() -> list[int]:
    """Count the Triton kernel's launches; the interpreter's own aten ops are not the monitor's."""
    from torch.utils._python_dispatch import _disable_current_modes

    from trainmon.stats import device_triton

    count, launch = [0], device_triton._launch

    def counted(kernel, grid, *args, **meta):
        count[0] += 1
        with _disable_current_modes():
            launch(kernel, grid, *args, **meta)

    device_triton._launch = counted
    return count


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--ops", action="append", help="comma-separated ops (repeatable); default: "
                    "norm,mean,min,max and norm,mean,min,max,nans,infs")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated kinds (default: all)")
    ap.add_argument("--triton", action="store_true", help="the Triton kernel, in Triton's interpreter")
    args = ap.parse_args(argv)
    launches = _count_launches() if args.triton else [0]
    os.environ["TRAINMON_DEVICE_PATH"] = "1"   # the seam: read by every StatsEngine built from here on
    torch.set_num_threads(1)
    op_sets = [o.split(",") for o in args.ops] if args.ops else [
        ["norm", "mean", "min", "max"], ["norm", "mean", "min", "max", "nans", "infs"]]

    largest, copies = [0], [0]
    write, copy = device_rows.DeviceRows.write, device_rows._copy_to_host

    def counted_write(self, tensors):
        with OpCounter(buffers=False) as c:   # the row buffers themselves are allocated once
            out = write(self, tensors)
        largest[0] = max(largest[0], c.largest)
        return out

    def counted_copy(flat):
        copies[0] += 1
        return copy(flat)

    device_rows.DeviceRows.write, device_rows._copy_to_host = counted_write, counted_copy
    print(f"Llama-shaped: {args.layers} layers, dim {args.dim}, seq {args.seq}, grad_acc_steps 2, {args.steps} steps; "
          f"seam on (CPU tensors on the device path); torch {torch.__version__}")
    print(f"{'ops':<34} {'kind':<6} {'rows/step':>9} {'ops/step':>9} {'ops/row':>8} {'syncs fwd/bwd':>13} "
          f"{'H2D fwd/bwd':>11} {'D2H/step':>8} {'largest B':>9} {'launches/row':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        base0 = base = _run(args, None, [], Path(tmp))
        flat_base = _run(args, None, [], Path(tmp), flat=True)
        for ops in op_sets:
            for kind in args.kinds.split(","):
                largest[0] = copies[0] = launches[0] = 0
                r = _run(args, kind, ops, Path(tmp))
                base = flat_base if kind == "flat" else base0
                extra = (r["fwd_bwd"].ops + r["step"].ops) - (base["fwd_bwd"].ops + base["step"].ops)
                syncs = r["fwd_bwd"].syncs - base["fwd_bwd"].syncs
                h2d = r["fwd_bwd"].copies - base["fwd_bwd"].copies
                rows = r["rows"] / args.steps
                print(f"{','.join(ops):<34} {kind:<6} {rows:>9.0f} {extra / args.steps:>9.0f} "
                      f"{extra / max(r['rows'], 1):>8.2f} {syncs:>13} {h2d:>11} {copies[0] / args.steps:>8.1f} "
                      f"{largest[0]:>9} {launches[0] / max(r['rows'], 1):>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
