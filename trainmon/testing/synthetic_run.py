"""Consistent synthetic data-parallel runs of any size, in the sinks' layout, with planted faults.

For benchmarks and bounded-memory tests of the analysis commands: ``ranks x steps x params x
families`` rows, written as CSV (the CSV sink's columns and float spelling) and optionally as
Parquet.  Consistent like a real DDP run: the replicated families (``grad_reduced``, params,
moments) are the same on every rank; ``grad_unreduced`` differs per rank.  Planted faults, so
the first findings are known:

* a NaN in ``grad_unreduced`` of param ``nan_param`` on rank ``nan_rank`` at step ``nan_step``;
* a x1e4 spike in ``grad_reduced`` (every rank) of param ``spike_param`` at step ``spike_step``;
* with ``drift_step`` set (a second run to ``compare`` with the first): ``param_updated`` of param
  ``spike_param`` 1% larger (``norm``) from that step on, on every rank.

``grad_reduced``'s mean is the average of the ranks' ``grad_unreduced`` means (of the finite ones:
the planted NaN stays on its rank), so ``ranks`` finds only the planted NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainmon.output.layout import family_file_name, rank_dir_name

__all__ = ["SyntheticRun", "FAMILIES", "OPS"]

FAMILIES = ("grad_unreduced", "grad_reduced", "param_origin", "exp_avg", "exp_avg_sq", "param_updated")
OPS = ("norm", "mean", "min", "max", "nans", "infs")
_PER_RANK = {"grad_unreduced"}


@dataclass(frozen=True)
class SyntheticRun:
    ranks: int = 2
    steps: int = 50
    params: int = 40
    steps_per_file: int = 10
    families: tuple[str, ...] = FAMILIES
    seed: int = 0
    drift_step: int | None = None

    @property
    def rows(self) -> int:
        return self.ranks * self.steps * self.params * len(self.families)

    @property
    def nan_step(self) -> int:
        return self.steps // 2

    @property
    def spike_step(self) -> int:
        return self.steps // 3

    nan_rank = property(lambda self: self.ranks - 1)
    nan_param = property(lambda self: self.params // 2)
    spike_param = property(lambda self: self.params // 3)

    def names(self) -> list[str]:
        return [f"layers.{i // 2}.{'weight' if i % 2 == 0 else 'bias'}" for i in range(self.params)]

    def _block(self, family: str, rank: int, steps: np.ndarray) -> dict[str, np.ndarray]:
        """Stats of one family, ``len(steps) * params`` rows, step-major (file order)."""
        fam = self.families.index(family)
        rng = np.random.default_rng([self.seed, fam, rank + 1 if family in _PER_RANK else 0, int(steps[0])])
        scale = np.random.default_rng([self.seed, fam]).uniform(0.1, 2.0, self.params)
        n = len(steps) * self.params
        t = np.repeat(steps, self.params).astype(float)
        p = np.tile(np.arange(self.params), len(steps))
        noise = rng.standard_normal(n) * 0.01
        norm = scale[p] * (1.0 + 0.05 * np.sin(t / 7.0 + p)) * (1.0 + noise)
        out = {
            "norm": norm,
            "mean": norm * 1e-3 * np.cos(p + t),
            "min": -norm * 0.1,
            "max": norm * 0.1,
            "nans": np.zeros(n, dtype=np.int64),
            "infs": np.zeros(n, dtype=np.int64),
        }
        if family == "grad_reduced":
            if "grad_unreduced" in self.families:  # the reduce averages the ranks' grads: their means' mean
                pre = np.stack([self._block("grad_unreduced", r, steps)["mean"] for r in range(self.ranks)])
                out["mean"] = np.nanmean(pre, axis=0)
            hit = (np.repeat(steps, self.params) == self.spike_step) & (p == self.spike_param)
            out["norm"] = np.where(hit, out["norm"] * 1e4, out["norm"])
        if family == "grad_unreduced" and rank == self.nan_rank:
            hit = (np.repeat(steps, self.params) == self.nan_step) & (p == self.nan_param)
            for op in ("norm", "mean", "min", "max"):
                out[op] = np.where(hit, np.nan, out[op])
            out["nans"] = np.where(hit, 3, out["nans"])
        if family == "param_updated" and self.drift_step is not None:
            hit = (np.repeat(steps, self.params) >= self.drift_step) & (p == self.spike_param)
            out["norm"] = np.where(hit, out["norm"] * 1.01, out["norm"])
        return out

    def frames(self):
        """``(rank, family, window start, window end, DataFrame)`` of every file, in the sinks' columns."""
        for rank, family, a, b, frame, _ in self._files():
            yield rank, family, a, b, frame

    def _files(self):
        """``frames`` plus a key shared by files with equal contents: the replicated families'
        frames are built once per window and shared by every rank (they are equal by design)."""
        import pandas as pd

        names = np.array(self.names(), dtype=object)
        shapes = np.array(
            [f"[{64 + i % 7}, {32 + i % 5}]" if i % 2 == 0 else f"[{64 + i % 7}]" for i in range(self.params)],
            dtype=object,
        )
        for a in range(0, self.steps, self.steps_per_file):
            steps = np.arange(a, min(a + self.steps_per_file, self.steps))
            n = len(steps) * self.params
            shared: dict[str, pd.DataFrame] = {}
            for rank in range(self.ranks):
                for family in self.families:
                    key = None if family in _PER_RANK else (family, a)
                    frame = shared.get(family) if key is not None else None
                    if frame is None:
                        stats = self._block(family, rank, steps)
                        frame = pd.DataFrame(
                            {
                                "vpp_stage": np.zeros(n, dtype=np.int64),
                                "name": np.tile(names, len(steps)),
                                "step": np.repeat(steps, self.params).astype(np.int64),
                                **{op: stats[op] for op in OPS},
                                "shape": np.tile(shapes, len(steps)),
                                "dtype": "torch.float32",
                            }
                        )
                        if key is not None:
                            shared[family] = frame
                    yield rank, family, a, a + self.steps_per_file - 1, frame, key

    def write(self, run_dir: str | Path, fmt: str = "csv") -> Path:
        """Write the run as ``fmt`` ("csv" or "parquet") under ``run_dir``; returns it."""
        run_dir = Path(run_dir)
        encoded: dict[tuple[str, int], bytes] = {}  # a replicated file's bytes, written to every rank
        for rank, family, a, b, frame, key in self._files():
            rdir = run_dir / rank_dir_name(rank)
            rdir.mkdir(parents=True, exist_ok=True)
            path = rdir / family_file_name(family, a, b, ext=fmt)
            if key is not None and key in encoded:
                path.write_bytes(encoded[key])
                continue
            if fmt == "csv":
                # pandas writes float64 with repr: the CSV sink's full-precision spelling.
                frame.to_csv(path, index=False)
            else:
                import pyarrow as pa  # type: ignore[import-untyped]  # pyarrow ships no stubs
                import pyarrow.parquet as pq  # type: ignore[import-untyped]  # pyarrow ships no stubs

                pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), path, compression="zstd")
            if key is not None:
                encoded = {k: v for k, v in encoded.items() if k[1] == a}  # only this window's files
                encoded[key] = path.read_bytes()
        return run_dir
