"""Which modules activations are recorded for, what their tensors are called, and hook plumbing
shared by the activation collector and ``print_struct``.

Naming (documented for users in docs/activations.md): the tensors of a module call are its
positional args (containers walked depth-first), then its keyword args in call order, keeping
tensors only.  One tensor -> ``<module>.input``; several -> ``<module>.input.<i>`` with ``i`` the
index among those tensors.  Outputs likewise (``<module>.output[.<i>]``).
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from trainmon.config import IoSelect
from trainmon.core.naming import ROOT_NAME, TargetMatcher, clean_name, squash_name, unwrap_model

__all__ = [
    "HookedModule",
    "select_modules",
    "walk_modules",
    "tensors_of",
    "io_names",
    "in_backward",
    "is_recordable",
    "is_container",
    "uses_compile",
    "hook_fn",
    "standalone_forwards",
    "model_files",
    "replace_tensors",
    "pick",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HookedModule:
    vpp_stage: int
    name: str  # as targets spell it (wrappers stripped); ROOT_NAME for the root
    label: str  # as written to the output (squashed when squash_name is on)
    module: nn.Module
    # msprobe per-target spec: kind ("input", "output", "input_grad", "output_grad") -> which
    # of the module's tensors of that kind are recorded; a kind not in it records all of them
    spec: dict[str, IoSelect] = field(default_factory=dict, compare=False, hash=False)
    target: str = ""  # the target as the user wrote it (for messages)


def walk_modules(chunks: Sequence[nn.Module]) -> list[tuple[int, str, nn.Module]]:
    """Every module of every chunk once per name.  Wrapper modules (checkpoint wrappers,
    per-block ``torch.compile``) share their name with the module inside; the outer one is kept:
    it is called once per forward, outside the wrapper's recomputation or compiled region."""
    out, seen = [], set()
    for vpp, chunk in enumerate(chunks):
        for raw, module in unwrap_model(chunk).named_modules():
            name = clean_name(raw) or ROOT_NAME
            if (vpp, name) not in seen:
                seen.add((vpp, name))
                out.append((vpp, name, module))
    return out


def is_container(module: nn.Module) -> bool:
    """ModuleList / ModuleDict and the like: no forward of their own, never called."""
    return type(module).forward is nn.Module.forward


def select_modules(
    chunks: Sequence[nn.Module],
    matcher: TargetMatcher,
    all_xy: bool,
    squash: bool,
    specs: Sequence[tuple[str, dict[str, IoSelect]]] = (),
) -> list[HookedModule]:
    """``all_xy``: every callable module but the root; ``targets``: exactly the named modules
    (``layers.1`` is that block, not ``layers.10`` and not the blocks' children).  ``specs``:
    (target as written, parsed per-target spec) for targets that carry one."""
    picked = []
    for vpp, name, module in walk_modules(chunks):
        targeted = matcher.names_exactly(name, vpp)
        if targeted and is_container(module):
            log.warning(
                "trainmon: target %r is a %s, which is never called, so it records no "
                "activations; name its children instead (e.g. %r)",
                name,
                type(module).__name__,
                f"{name}.{next(iter(module._modules), '0')}",
            )
        if is_container(module) or not (targeted or (all_xy and name != ROOT_NAME)):
            continue
        picked.append((vpp, name, module))
    labels = _labels(picked, squash)
    parsed = [(TargetMatcher([raw]), raw, spec) for raw, spec in specs]
    out = []
    for vpp, name, m in picked:
        hit = next(((raw, spec) for one, raw, spec in parsed if one.names_exactly(name, vpp)), ("", {}))
        out.append(HookedModule(vpp, name, labels[(vpp, name)], m, hit[1], hit[0]))
    return out


def _labels(picked: list[tuple[int, str, nn.Module]], squash: bool) -> dict[tuple[int, str], str]:
    labels = {(vpp, n): (squash_name(n) if squash and n != ROOT_NAME else n) for vpp, n, _ in picked}
    owners: dict[tuple[int, str], list[str]] = {}
    for (vpp, n), label in labels.items():
        owners.setdefault((vpp, label), []).append(n)
    clashes = [names for names in owners.values() if len(names) > 1]
    if clashes:
        # Two modules written under one name would be indistinguishable: keep their full names.
        log.warning(
            "trainmon: squash_name would give %d modules the same name (e.g. %s); those keep their full names",
            sum(map(len, clashes)),
            ", ".join(clashes[0][:2]),
        )
        for names in clashes:
            for vpp_n in [(v, n) for (v, n) in labels if n in names]:
                labels[vpp_n] = vpp_n[1]
    return labels


def is_recordable(t: torch.Tensor) -> bool:
    # is_meta rather than t.device: building a device object per tensor shows up in profiles
    return t.layout == torch.strided and not t.is_meta and not t.is_complex()


def tensors_of(value: Any, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Tensors in ``value`` (tuples, lists, dicts walked depth-first, in order)."""
    if out is None:
        out = []
    if isinstance(value, torch.Tensor):
        if is_recordable(value):
            out.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            tensors_of(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            tensors_of(v, out)
    return out


def replace_tensors(value: Any, fn: Callable[[torch.Tensor, bool], torch.Tensor]) -> Any:
    """``value`` with every recordable tensor ``t`` replaced by ``fn(t, True)``, in ``tensors_of``
    order.  Plain tuples, lists and dicts are rebuilt; other containers (namedtuples, dataclasses
    of tensors...) are kept as they are and ``fn(t, False)`` is called for each of their tensors,
    so ``fn`` sees every tensor ``tensors_of`` lists, in the same order."""
    if isinstance(value, torch.Tensor):
        return fn(value, True) if is_recordable(value) else value
    if type(value) in (tuple, list):
        return type(value)(replace_tensors(v, fn) for v in value)
    if type(value) is dict:
        return {k: replace_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, (tuple, list, dict)):
        for t in tensors_of(value):
            fn(t, False)
    return value


def pick(hm: HookedModule, kind: str, n: int, warned: set) -> range | tuple[int, ...]:
    """Indices of the ``n`` tensors of ``kind`` that ``hm``'s per-target spec records (all when
    it has none for that kind).  A spec that does not fit the call warns once per module and kind."""
    sel = hm.spec.get(kind)
    if sel is None:
        return range(n)
    chosen = range(n) if sel.index is None else ((sel.index,) if sel.index < n else ())
    if (sel.count != n or not chosen) and (hm.vpp_stage, hm.name, kind) not in warned:
        warned.add((hm.vpp_stage, hm.name, kind))
        text = (
            "tensor"
            if sel.count == 1 and sel.index == 0
            else f"tuple[{sel.count}]" + ("" if sel.index is None else f":{sel.index}")
        )
        log.warning(
            "trainmon: targets[%r].%s is %r but %s was called with %d %s tensor(s); %s",
            hm.target,
            kind,
            text,
            hm.name,
            n,
            kind.replace("_grad", ""),
            f"recording {kind} {list(chosen)}" if chosen else f"no {kind} is recorded for it",
        )
    return chosen


@functools.lru_cache(maxsize=65536)
def io_names(label: str, kind: str, n: int) -> tuple[str, ...]:
    """Called by every activation hook: cached (the same few names repeat every step)."""
    base = f"{label}.{kind}"
    return (base,) if n == 1 else tuple(f"{base}.{i}" for i in range(n))


_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def in_backward() -> bool:
    """True while the autograd engine runs (forwards here are checkpoint recomputations).
    One C call: no Python stack walk."""
    return _graph_task_id() != -1


def uses_compile(chunks: Sequence[nn.Module]) -> bool:
    """Whether any chunk or module runs through ``torch.compile`` (wrapper or ``Module.compile``)."""
    for chunk in chunks:
        for m in [chunk, *unwrap_model(chunk).modules()]:
            if getattr(m, "_compiled_call_impl", None) is not None or hasattr(m, "_orig_mod"):
                return True
    return False


def _forward_code(module: nn.Module) -> types.CodeType | None:
    return getattr(getattr(type(module), "forward", None), "__code__", None)


def standalone_forwards(modules: Sequence[HookedModule]) -> list[types.CodeType]:
    """The forwards of recorded ``torch.nn`` modules without children (Linear, Conv, LayerNorm,
    GELU, Dropout, Embedding...): under ``torch.compile`` the hooks at their boundary make each
    such forward a frame of its own, which is one or two ATen kernels with nothing to fuse, yet
    takes one compile per shape against a limit that all instances of the class share (see
    ``core.hooks.skip_standalone_frames``).  Modules of the user's own classes keep their frames
    compiled: their body may hold real work to fuse (an RMSNorm, a rotary embedding)."""
    leaves: set[types.CodeType] = set()
    parents: set[types.CodeType] = set()
    for hm in modules:
        code = _forward_code(hm.module)
        if code is None:
            continue
        if next(iter(hm.module.children()), None) is None and type(hm.module).__module__.startswith("torch."):
            leaves.add(code)
        else:
            parents.add(code)
    return [c for c in leaves if c not in parents]


def model_files(chunks: Sequence[nn.Module]) -> set[str]:
    """The source files of the forwards of every module class in ``chunks`` (where Dynamo's
    frames for them, resumed ones included, say they are)."""
    return {code.co_filename for _, _, m in walk_modules(chunks) if (code := _forward_code(m)) is not None}


def hook_fn(fn: Callable[..., None], compiled: bool) -> Callable[..., None]:
    """Module hooks of a compiled model run eagerly: each one is a graph break, so the values
    are those of the uncompiled module boundary (and dynamo never guards on our state)."""
    if not compiled:
        return fn
    import torch._dynamo

    return torch._dynamo.disable(fn, recursive=True)
