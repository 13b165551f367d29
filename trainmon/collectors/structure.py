"""``print_struct``: the model's module tree with the shapes and dtypes of each module's inputs
and outputs, taken from the first forward pass, then training simply continues.

Written to ``<run_dir>/module_struct.json`` by rank 0 (``<run_dir>/rank<R>/module_struct.json``
by other ranks, whose pipeline stages may hold other modules) and logged as a readable tree.
Every module gets a forward hook for the first forward pass only; the hooks are removed as soon
as every chunk has run once, so the cost is one forward's worth of shape reads.

JSON: ``{"chunks": [{"vpp_stage": 0, "tree": NODE}]}`` with ``NODE = {"name", "type",
"called", "input": [IO], "output": [IO], "children": [NODE]}`` and ``IO = {"name", "shape",
"dtype"}``; ``name`` of a node is what ``targets`` take, ``name`` of an IO is the row name of
``actv``/``actv_grad``.

``stack_info`` (:class:`StackInfoCollector`): ``rank<R>/stack_info.csv`` with the Python call
stack of each module's first forward in the first collected step (the ``xy_distribution``
modules, or every called module when none are selected), outermost frame first, PyTorch's and
trainmon's own frames left out.  One ``traceback.extract_stack`` per module, once: the hooks are
removed at the end of that step.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import logging
import os
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from trainmon.collectors.base import Collector, register_collector
from trainmon.collectors.module_io import (
    hook_fn,
    in_backward,
    io_names,
    is_container,
    select_modules,
    tensors_of,
    uses_compile,
    walk_modules,
)
from trainmon.core.hooks import Handle
from trainmon.core.naming import ROOT_NAME, squash_name
from trainmon.output.layout import STACK_INFO_FILE, rank_dir_name

__all__ = ["ModuleStructCollector", "StackInfoCollector", "STRUCT_FILE"]

log = logging.getLogger(__name__)

STRUCT_FILE = "module_struct.json"


@register_collector
class ModuleStructCollector(Collector):
    name = "module_struct"
    priority = 50

    @staticmethod
    def enabled(config) -> bool:
        return config.print_struct

    def attach(self) -> None:
        self._seen: dict[tuple[int, str], dict[str, Any]] = {}
        self._pending = set(range(len(self.ctx.chunks)))
        self._written = False
        compiled = uses_compile(self.ctx.chunks)
        wrap = lambda fn: hook_fn(self.ctx.guard.wrap(self, fn), compiled)  # noqa: E731
        self._modules = walk_modules(self.ctx.chunks)
        self._by_name = {(vpp, name): module for vpp, name, module in self._modules}
        for vpp, name, module in self._modules:
            h = module.register_forward_hook(wrap(functools.partial(self._record, vpp, name)), with_kwargs=True)
            self.handles.append(Handle(h.remove))
        for vpp, chunk in enumerate(self.ctx.chunks):
            h = chunk.register_forward_hook(wrap(functools.partial(self._chunk_done, vpp)))
            self.handles.append(Handle(h.remove))

    def _record(self, vpp: int, name: str, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if (vpp, name) in self._seen or in_backward() or module is not self._by_name[(vpp, name)]:
            return  # seen already, a checkpoint recompute, or a copy of the model (copy.deepcopy)
        label = squash_name(name) if self.ctx.config.squash_name and name != ROOT_NAME else name
        self._seen[(vpp, name)] = {
            "input": _io(label, "input", tensors_of(kwargs, tensors_of(args))),
            "output": _io(label, "output", tensors_of(output)),
        }

    def _chunk_done(self, vpp: int, module: nn.Module, _args: Any, _output: Any) -> None:
        if module is not self.ctx.chunks[vpp]:
            return  # a copy of the model (copy.deepcopy) carries the hook
        self._pending.discard(vpp)
        if not self._pending:
            self._finish()

    def _finish(self) -> None:
        if self._written:
            return
        self._written = True
        super().detach()  # hooks off: the structure is taken from the first forward only
        chunks: list[dict[str, Any]] = [
            {"vpp_stage": vpp, "tree": self._tree(vpp, chunk)} for vpp, chunk in enumerate(self.ctx.chunks)
        ]
        self._write({"chunks": chunks})
        if self.ctx.rank == 0:
            lines = [line for c in chunks for line in _render(c["tree"], 0, c["vpp_stage"], len(chunks))]
            log.info("trainmon: module structure (print_struct; training continues):\n%s", "\n".join(lines))

    def _tree(self, vpp: int, chunk: nn.Module) -> dict[str, Any]:
        nodes: dict[str, dict[str, Any]] = {}
        for v, name, module in self._modules:
            if v != vpp:
                continue
            seen = self._seen.get((v, name))
            nodes[name] = {
                "name": name,
                "type": type(module).__name__,
                "called": seen is not None,
                "input": seen["input"] if seen else [],
                "output": seen["output"] if seen else [],
                "children": [],
            }
        root = nodes.pop(ROOT_NAME)
        for name, node in nodes.items():  # named_modules order: a parent comes before its children
            parent = name.rpartition(".")[0]
            while parent and parent not in nodes:
                parent = parent.rpartition(".")[0]
            (nodes[parent] if parent else root)["children"].append(node)
        return root

    def _write(self, data: dict[str, Any]) -> None:
        cfg, run_dir = self.ctx.config, self.ctx.run_dir
        if run_dir is None or (cfg.module_ranks and self.ctx.rank not in cfg.module_ranks):
            return
        target = Path(run_dir) / (
            STRUCT_FILE if self.ctx.rank == 0 else f"{rank_dir_name(self.ctx.rank)}/{STRUCT_FILE}"
        )
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
            os.replace(tmp, target)
        except OSError as exc:
            log.warning("trainmon: could not write %s (%s); the structure is only in the log", target, exc)

    def detach(self) -> None:
        if not self._written and self._seen:
            self._finish()  # a chunk never ran: write what was seen
        super().detach()


# PyTorch's frames (module call plumbing) and trainmon's own hook frames are not the user's stack
_TRAINMON = Path(__file__).resolve().parents[1]
_SKIP_FRAMES = tuple(
    os.path.join(str(d), "")
    for d in (Path(torch.__file__).resolve().parent, _TRAINMON / "collectors", _TRAINMON / "runtime")
)


@register_collector
class StackInfoCollector(Collector):
    name = "stack_info"
    priority = 55

    @staticmethod
    def enabled(config) -> bool:
        return config.stack_info

    def attach(self) -> None:
        cfg = self.ctx.config
        self._stacks: dict[tuple[int, str], str] = {}
        self._done = False
        if cfg.xy_distribution:
            picked = [
                (hm.vpp_stage, hm.label, hm.module)
                for hm in select_modules(self.ctx.chunks, self.ctx.matcher, cfg.all_xy, cfg.squash_name)
            ]
        else:
            picked = [
                (vpp, squash_name(n) if cfg.squash_name and n != ROOT_NAME else n, m)
                for vpp, n, m in walk_modules(self.ctx.chunks)
                if not is_container(m)
            ]
        compiled = uses_compile(self.ctx.chunks)
        for vpp, label, module in picked:
            hook = self.ctx.guard.gated(self, functools.partial(self._see, vpp, label, module), self.ctx.clock)
            self.handles.append(Handle(module.register_forward_pre_hook(hook_fn(hook, compiled)).remove))

    def _see(self, vpp: int, label: str, monitored: nn.Module, module: nn.Module, _args: Any) -> None:
        if module is not monitored or (vpp, label) in self._stacks or in_backward():
            return  # a copy of the model (copy.deepcopy), seen already, or a checkpoint recompute
        frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.startswith(_SKIP_FRAMES)]
        self._stacks[(vpp, label)] = "\n".join(f"{f.filename}:{f.lineno} in {f.name}" for f in frames)

    def on_step_end(self) -> None:
        if self._stacks and not self._done:
            self._done = True
            super().detach()  # the stacks of one step are enough: hooks off
            self._write()

    def _write(self) -> None:
        cfg, run_dir = self.ctx.config, self.ctx.run_dir
        if run_dir is None or (cfg.module_ranks and self.ctx.rank not in cfg.module_ranks):
            return
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(["vpp_stage", "name", "stack"])
        writer.writerows([vpp, name, stack] for (vpp, name), stack in self._stacks.items())
        target = Path(run_dir) / rank_dir_name(self.ctx.rank) / STACK_INFO_FILE
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(".csv.tmp")
            tmp.write_text(buf.getvalue(), encoding="utf-8")
            os.replace(tmp, target)
        except OSError as exc:
            log.warning("trainmon: could not write %s (%s); stack_info is not recorded", target, exc)

    def detach(self) -> None:
        if self._stacks and not self._done:
            self._done = True
            self._write()
        super().detach()


def _io(label: str, kind: str, tensors: list) -> list[dict[str, Any]]:
    return [
        {"name": n, "shape": list(t.shape), "dtype": str(t.dtype)}
        for n, t in zip(io_names(label, kind, len(tensors)), tensors)
    ]


def _render(node: dict[str, Any], depth: int, vpp: int, n_chunks: int) -> list[str]:
    prefix = f"{vpp}:" if n_chunks > 1 else ""
    if node["called"]:

        def fmt(ios: list) -> str:
            return ", ".join(f"{io['dtype'].replace('torch.', '')}{io['shape']}" for io in ios) or "-"

        info = f"in: {fmt(node['input'])}  out: {fmt(node['output'])}"
    else:
        info = "not called"
    lines = [f"{'  ' * depth}{prefix}{node['name']} ({node['type']})  {info}"]
    for child in node["children"]:
        lines.extend(_render(child, depth + 1, vpp, n_chunks))
    return lines
