"""Matching tensor names of two runs whose models were wrapped differently.

``module.layers.0.weight`` (DDP), ``_orig_mod.layers.0.weight`` (torch.compile) and
``layers.0._checkpoint_wrapped_module.weight`` all mean ``layers.0.weight``.  Matching goes:
exact name, then the name without wrapper segments, then a unique dotted-suffix match
(``model.layers.0.weight`` <-> ``layers.0.weight``) when exactly one name on each side fits.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["canonical", "match_names"]

_WRAPPER_SEGMENT = re.compile(
    r"(^|\.)(_orig_mod|_fsdp_wrapped_module|_checkpoint_wrapped_module|"
    r"_forward_module)(?=\.|$)"
)
_LEADING_MODULE = re.compile(r"^(module\.)+")


def canonical(name: str) -> str:
    return _LEADING_MODULE.sub("", _WRAPPER_SEGMENT.sub("", name).strip("."))


def _suffixes(name: str) -> Iterable[str]:
    parts = name.split(".")
    return (".".join(parts[i:]) for i in range(len(parts)))


def _pairs(candidates: dict[str, set[str]]) -> dict[str, str]:
    reverse: dict[str, set[str]] = {}
    for t, bs in candidates.items():
        for b in bs:
            reverse.setdefault(b, set()).add(t)
    return {t: next(iter(bs)) for t, bs in candidates.items() if len(bs) == 1 and len(reverse[next(iter(bs))]) == 1}


def match_names(base: Iterable[str], target: Iterable[str]) -> dict[str, str]:
    """``{target name: base name}`` for every target name that has a counterpart in ``base``."""
    base_set, target_set = set(base), set(target)
    mapping = {n: n for n in target_set & base_set}
    rest_b, rest_t = base_set - set(mapping.values()), target_set - set(mapping)
    by_canon: dict[str, set[str]] = {}
    for b in rest_b:
        by_canon.setdefault(canonical(b), set()).add(b)
    found = _pairs({t: by_canon.get(canonical(t), set()) for t in rest_t})
    mapping.update(found)
    rest_b -= set(found.values())
    rest_t -= set(found)
    if not rest_b or not rest_t:
        return mapping
    canon_b = {b: canonical(b) for b in rest_b}
    by_suffix: dict[str, set[str]] = {}
    for b, cb in canon_b.items():
        for s in _suffixes(cb):
            by_suffix.setdefault(s, set()).add(b)
    exact_b: dict[str, set[str]] = {}
    for b, cb in canon_b.items():
        exact_b.setdefault(cb, set()).add(b)
    candidates = {}
    for t in rest_t:
        ct = canonical(t)
        # t is a dotted suffix of some base names, or some base names are dotted suffixes of t.
        cands = set(by_suffix.get(ct, set()))
        for s in _suffixes(ct):
            cands |= exact_b.get(s, set())
        candidates[t] = cands
    mapping.update(_pairs(candidates))
    return mapping
