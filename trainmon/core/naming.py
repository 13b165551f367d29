"""Names as users see them (wrappers stripped) and target matching on dotted boundaries."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import torch.nn as nn

from trainmon.errors import ConfigError, Problem

__all__ = [
    "unwrap_model",
    "clean_name",
    "TrackedParam",
    "tracked_params",
    "selected_params",
    "frozen_params",
    "TargetMatcher",
    "ROOT_NAME",
    "squash_name",
]

# The name that selects (and reports) a chunk's root module itself; named_modules() calls it "".
ROOT_NAME = "root"
# squash_name keeps a name from the first segment that is "layers" or starts with one of these.
_SQUASH_STARTS = ("embedding", "final", "output")

# Objects whose only job is to wrap ``.module`` (their names add a ``module.`` prefix).
_WRAPPER_CLASSES = {
    "DistributedDataParallel",
    "DataParallel",
    "Float16Module",
    "FullyShardedDataParallel",
    "TorchFullyShardedDataParallel",
    "DeepSpeedEngine",
}
# Private wrapper segments that can appear anywhere in a name and never mean anything to users.
_WRAPPER_SEGMENT = re.compile(
    r"(^|\.)(_orig_mod|_fsdp_wrapped_module|_checkpoint_wrapped_module|"
    r"_forward_module)(?=\.|$)"
)
_LEADING_MODULE = re.compile(r"^(module\.)+")
_VPP_PREFIX = re.compile(r"^(\d+):")


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DDP / Float16Module / torch.compile wrappers so names match the user's model."""
    while True:
        if type(model).__name__ in _WRAPPER_CLASSES and isinstance(getattr(model, "module", None), nn.Module):
            model = cast(nn.Module, model.module)
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = cast(nn.Module, model._orig_mod)
        else:
            return model


def clean_name(name: str) -> str:
    """Drop private wrapper segments (``_orig_mod``, ``_checkpoint_wrapped_module``, ...)."""
    return _WRAPPER_SEGMENT.sub("", name).strip(".")


@dataclass(frozen=True)
class TrackedParam:
    name: str
    vpp_stage: int
    param: nn.Parameter


def tracked_params(chunks: Sequence[nn.Module]) -> list[TrackedParam]:
    """Trainable params of every chunk in model order, each once (tied weights keep the first name)."""
    seen: set[int] = set()
    out = []
    for vpp, chunk in enumerate(chunks):
        for name, p in unwrap_model(chunk).named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(TrackedParam(clean_name(name), vpp, p))
    return out


def selected_params(chunks: Sequence[nn.Module], matcher: TargetMatcher) -> list[TrackedParam]:
    """The trainable params ``matcher`` selects, in model order: the params a session tracks."""
    return [p for p in tracked_params(chunks) if matcher.matches(p.name, p.vpp_stage)]


def frozen_params(chunks: Sequence[nn.Module]) -> list[nn.Parameter]:
    """Params of every chunk with ``requires_grad`` False now, each once."""
    seen: set[int] = set()
    out = []
    for chunk in chunks:
        for p in unwrap_model(chunk).parameters():
            if not p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def module_names(chunks: Sequence[nn.Module]) -> list[tuple[int, str]]:
    """Every module of every chunk, the root as ``ROOT_NAME``."""
    return [
        (vpp, clean_name(n) or ROOT_NAME) for vpp, c in enumerate(chunks) for n, _ in unwrap_model(c).named_modules()
    ]


def squash_name(name: str) -> str:
    """Drop the framework prefix of a name: keep it from the first ``layers.`` segment, or the
    first segment starting with ``embedding``, ``final`` or ``output``; otherwise unchanged.

    ``module.language_model.encoder.layers.3.mlp`` -> ``layers.3.mlp``,
    ``language_model.embedding.word_embeddings`` -> ``embedding.word_embeddings``.
    """
    segs = name.split(".")
    for i, seg in enumerate(segs):
        if (seg == "layers" and i + 1 < len(segs)) or seg.startswith(_SQUASH_STARTS):
            return ".".join(segs[i:])
    return name


class TargetMatcher:
    """Selects names by target on dotted boundaries: ``layers.1`` selects ``layers.1.attn.weight``
    but not ``layers.10.attn.weight``.  A target may carry msprobe's ``module.`` prefixes and a
    ``<vpp>:`` chunk prefix.  No targets selects everything."""

    def __init__(self, targets: Iterable[str]):
        self.raw = tuple(targets)
        self._parsed = [self._parse(t) for t in self.raw]

    @staticmethod
    def _parse(target: str) -> tuple[int | None, str]:
        m = _VPP_PREFIX.match(target)
        vpp = int(m.group(1)) if m else None
        name = target[m.end() :] if m else target
        return vpp, clean_name(_LEADING_MODULE.sub("", name))

    @property
    def selects_all(self) -> bool:
        return not self.raw

    def matches(self, name: str, vpp_stage: int = 0) -> bool:
        return self.selects_all or any(self._hit(t, name, vpp_stage) for t in self._parsed)

    @staticmethod
    def _hit(target: tuple[int | None, str], name: str, vpp_stage: int) -> bool:
        vpp, t = target
        if vpp is not None and vpp != vpp_stage:
            return False
        return name == t or name.startswith(t + ".")

    def names_exactly(self, name: str, vpp_stage: int = 0) -> bool:
        """True when a target is this very name (modules for activations: no subtree)."""
        return any(t == name and (v is None or v == vpp_stage) for v, t in self._parsed)

    def check_all_used(
        self, names: Sequence[tuple[int, str]], source: str, key: str = "targets", what: str = "module or parameter"
    ) -> None:
        """ConfigError naming close matches for every target that selects nothing."""
        problems = []
        plain = sorted({n for _, n in names})
        for raw, parsed in zip(self.raw, self._parsed):
            if not any(self._hit(parsed, n, v) for v, n in names):
                close = difflib.get_close_matches(parsed[1], plain, n=3, cutoff=0.6)
                hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
                problems.append(
                    Problem(f"{key}[{self.raw.index(raw)}]", f"{raw!r} matches no {what} of the model{hint}")
                )
        if problems:
            raise ConfigError(source, problems)
