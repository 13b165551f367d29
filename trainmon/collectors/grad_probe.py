"""The gradient probe (``grad_probe``, msprobe's tool of that name): per parameter and step, the
gradient the optimizer step applies, at three levels.

============ ================= ==============================================================
level        family            value (one row per selected param, per collected step)
============ ================= ==============================================================
L0           grad_reduced      the usual statistics (``ops``) of the grad, as ``wg_distribution``
L1           grad_probe        + the fraction of elements in each interval cut by ``bounds``
                               (``"(-inf, -1]"``, ``"(-1, 0]"``, ...) and ``=0``
L2           grad_direction    + the signs of a fixed sample of positions, 32 per word
============ ================= ==============================================================

Config: ``{"grad_probe": {"grad_level": "L1", "param_list": [], "bounds": [-1, 0, 1]}}``.
``param_list`` narrows the params ``targets`` selected (same dotted matching; [] = all).

Intervals are ``(lo, hi]`` (msprobe's), the first from -inf, the last ``(b, inf)``.  Every
element is counted on the tensor's device in one pass per chunk: ``bucketize`` against the
bounds (rounded down into the grad's dtype, so ``x <= b`` is decided exactly), plus ``=0``
folded into the same ``bincount``.  -inf is in the first interval, +inf in the last; NaN is in
none (the interval fractions then sum to less than 1: ``1 - sum`` is the NaN fraction).  Zeros
(``-0.0`` too) count in their interval *and* in ``=0``.

L2 samples ``min(numel, DIRECTION_SAMPLES)`` positions per param, chosen by
:func:`direction_positions` from a hash of the param's name and shape alone: every run, rank and
process samples the same positions, so two runs' rows compare sign by sign (``trainmon
similarity``).  A row is ``n`` (positions sampled) and words ``w0..w31``: bit ``j`` of word ``i``
is 1 when the grad at sample ``32*i + j`` is > 0.  Sharded grads (FSDP2, TP) get L0 and L1
(counts summed over the shard group) but no L2.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

from trainmon.collectors.base import Collector, capture_views, register_collector
from trainmon.core.naming import TargetMatcher, TrackedParam
from trainmon.families import Family
from trainmon.stats.engine import Meta

__all__ = [
    "GradProbeCollector",
    "DIRECTION_SAMPLES",
    "DIRECTION_WORDS",
    "direction_positions",
    "interval_labels",
    "direction_columns",
]

log = logging.getLogger(__name__)

DIRECTION_SAMPLES = 1024
DIRECTION_WORDS = DIRECTION_SAMPLES // 32
_CHUNK = 1 << 24  # elements counted at a time: bounds the int32 index buffer to 64 MiB
_HALF = (torch.float16, torch.bfloat16)


def _bound_text(b: float) -> str:
    return str(int(b)) if float(b).is_integer() and abs(b) < 1e16 else repr(float(b))


def interval_labels(bounds: Sequence[float]) -> tuple[str, ...]:
    """msprobe's column labels: ``(-inf, b0]``, ``(b0, b1]``, ..., ``(bn, inf)``, then ``=0``."""
    edges = ["-inf", *(_bound_text(b) for b in bounds)]
    labels = [f"({lo}, {hi}]" for lo, hi in itertools.pairwise(edges)]
    return (*labels, f"({edges[-1]}, inf)", "=0")


def direction_columns() -> tuple[str, ...]:
    return ("n", *(f"w{i}" for i in range(DIRECTION_WORDS)))


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


@lru_cache(maxsize=4096)
def direction_positions(name: str, shape: tuple[int, ...], k: int = DIRECTION_SAMPLES) -> np.ndarray:
    """The flat positions L2 samples for a param: sorted, distinct, ``min(numel, k)`` of them.

    A function of ``name`` and ``shape`` only (blake2b seed, splitmix64 stream): no RNG state,
    Python hash seed or library version enters, so every process computes the same positions.
    """
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if numel <= k:
        return np.arange(numel, dtype=np.int64)
    seed = int.from_bytes(hashlib.blake2b(f"{name}\0{list(shape)}".encode(), digest_size=8).digest(), "little")
    picked: list[np.ndarray] = []
    have = 0
    counter = 0
    while have < k:  # a few rounds at most: k is tiny next to numel
        draws = _splitmix64(np.arange(counter, counter + 2 * k, dtype=np.uint64) + np.uint64(seed)) % np.uint64(numel)
        counter += 2 * k
        picked.append(draws.astype(np.int64))
        allp = np.concatenate(picked)
        _, first = np.unique(allp, return_index=True)
        have = len(first)
    allp = np.concatenate(picked)
    _, first = np.unique(allp, return_index=True)
    return np.sort(allp[np.sort(first)[:k]])


@lru_cache(maxsize=64)
def _floored_bounds(bounds: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``bounds`` in ``dtype`` rounded toward -inf, so ``x <= b_dtype`` iff ``x <= b`` for x of dtype
    (cached: the same few tensors serve every param and step)."""
    exact = torch.tensor(list(bounds), dtype=torch.float64)
    if dtype == torch.float64:
        return exact.to(device)
    near = exact.to(dtype)
    down = torch.nextafter(near, torch.full_like(near, -float("inf")))
    return torch.where(near.double() > exact, down, near).to(device)


@torch.no_grad()
def interval_counts(grad: torch.Tensor, bounds: Sequence[float]) -> torch.Tensor:
    """int64 ``[len(bounds) + 2]`` on the grad's device: elements per interval, then ``=0``."""
    flat = grad.detach().reshape(-1)
    work = torch.float32 if flat.dtype in _HALF or not flat.is_floating_point() else flat.dtype
    cuts = _floored_bounds(tuple(bounds), work, flat.device)
    n = len(bounds) + 1  # intervals
    nan_bin = n  # NaN: counted apart, reported in no interval
    width = n + 1
    counts = torch.zeros(2 * width, dtype=torch.int64, device=flat.device)
    for chunk in flat.split(_CHUNK):
        x = chunk.to(work)
        idx = torch.bucketize(x, cuts, out_int32=True)
        idx.masked_fill_(torch.isnan(x), nan_bin)
        idx.add_((x == 0).to(torch.int32), alpha=width)  # zeros land in the upper copy of the bins
        counts += torch.bincount(idx, minlength=2 * width)
    per_interval = counts[:n] + counts[width : width + n]
    return torch.cat([per_interval, counts[width:].sum().reshape(1)])


@lru_cache(maxsize=16)
def _bit_weights(device: torch.device) -> torch.Tensor:
    return torch.tensor([1 << j for j in range(32)], dtype=torch.int64, device=device)


@torch.no_grad()
def direction_words(grad: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """float64 ``[1 + DIRECTION_WORDS]``: ``n`` then the sign bits (> 0) packed 32 per word."""
    bits = (grad.detach().reshape(-1).index_select(0, positions) > 0).to(torch.int64)
    padded = torch.zeros(DIRECTION_SAMPLES, dtype=torch.int64, device=bits.device)
    padded[: bits.numel()] = bits
    weights = _bit_weights(bits.device)
    words = (padded.view(DIRECTION_WORDS, 32) * weights).sum(1)
    n = torch.full((1,), float(bits.numel()), dtype=torch.float64, device=bits.device)
    return torch.cat([n, words.double()])


@register_collector
class GradProbeCollector(Collector):
    name = "grad_probe"
    priority = 65

    @staticmethod
    def enabled(config) -> bool:
        return config.grad_probe is not None

    def attach(self) -> None:
        probe = self.ctx.config.grad_probe
        assert probe is not None  # enabled() requires it
        matcher = TargetMatcher(probe.param_list)
        self._params: list[TrackedParam] = [tp for tp in self.ctx.params if matcher.matches(tp.name, tp.vpp_stage)]
        self._labels = interval_labels(probe.bounds)
        self._positions: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._warned_sharded = False

    def on_step_begin(self) -> None:
        probe, ctx = self.ctx.config.grad_probe, self.ctx
        assert probe is not None  # enabled() requires it
        reduced = ctx.integration.reduced_grad
        pairs = [(tp, v) for tp in self._params if (v := reduced(tp)) is not None]
        if not ctx.config.wg_distribution:  # L0: weight_grads records grad_reduced already when on
            capture_views(ctx, Family.GRAD_REDUCED, pairs)
        if probe.level >= 1:
            self._capture_intervals(pairs, probe.bounds)
        if probe.level >= 2:
            self._capture_directions(pairs)

    def _capture_intervals(self, pairs: list, bounds: Sequence[float]) -> None:
        counts = [interval_counts(v.tensor, bounds) for _, v in pairs]
        counts = _merge_counts([v for _, v in pairs], counts)
        metas, values = [], []
        for (tp, v), c in zip(pairs, counts):
            shape = tuple(v.shape) if v.shape else tuple(tp.param.shape)
            numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
            metas.append(Meta(Family.GRAD_PROBE, tp.name, tp.vpp_stage, shape, str(v.tensor.dtype)))
            values.append(c.double() / max(numel, 1))
        self.ctx.engine.capture_values(Family.GRAD_PROBE, metas, values, self._labels)

    def _capture_directions(self, pairs: list) -> None:
        metas, values = [], []
        for tp, v in pairs:
            if v.group is not None:
                self._warn_sharded(tp.name)
                continue
            shape = tuple(v.tensor.shape)
            metas.append(Meta(Family.GRAD_DIRECTION, tp.name, tp.vpp_stage, shape, str(v.tensor.dtype)))
            values.append(direction_words(v.tensor, self._positions_for(tp, v.tensor)))
        self.ctx.engine.capture_values(Family.GRAD_DIRECTION, metas, values, direction_columns())

    def _positions_for(self, tp: TrackedParam, grad: torch.Tensor) -> torch.Tensor:
        key = (id(tp.param), grad.device)
        pos = self._positions.get(key)
        if pos is None:
            pos = torch.from_numpy(direction_positions(tp.name, tuple(grad.shape))).to(grad.device)
            self._positions[key] = pos
        return pos

    def _warn_sharded(self, name: str) -> None:
        if not self._warned_sharded:
            self._warned_sharded = True
            log.warning(
                "trainmon: grad_probe L2: %s is sharded; sign samples are taken of whole "
                "grads only, so sharded params have no grad_direction rows",
                name,
            )


def _merge_counts(views: list, counts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Whole-tensor counts from shard counts: one SUM all-reduce per shard group."""
    by_group: dict[int, list[int]] = {}
    for i, v in enumerate(views):
        if v.group is not None:
            by_group.setdefault(id(v.group), []).append(i)
    if not by_group:
        return counts
    import torch.distributed as dist

    from trainmon.core import dist as _dist

    counts = list(counts)
    for idx in by_group.values():
        group = views[idx[0]].group
        stacked = torch.stack([counts[i] for i in idx])
        device = stacked.device
        if dist.get_backend(group) == "gloo":
            stacked = stacked.cpu()
        with _dist.internal():
            dist.all_reduce(stacked, group=group)
        for k, i in enumerate(idx):
            counts[i] = stacked[k].to(device)
    return counts
