"""The model as monitoring began (``loss_alignment``): ``rank<R>/model_meta.json``, written once.

What ``trainmon compare`` checks first: if two runs' models differ in structure, nothing
after that can be compared meaningfully.  Format::

    {"format": 1,
     "chunks": [{"vpp_stage": 0, "type": "TinyGPT",
                 "modules": [{"name": "root", "type": "TinyGPT"}, {"name": "blocks.0", "type": "Block"}, ...],
                 "params": [{"name": "wte.weight", "shape": [32, 16], "dtype": "torch.float32",
                             "requires_grad": true,
                             "init": {"norm": ..., "mean": ..., "min": ..., "max": ...}}, ...]}]}

``init`` holds the statistics (float64) of each parameter when ``set_monitor`` ran (the
"initial params" stage); they are computed on the device and copied to the host in one copy.
Names are the ones every family uses (wrappers stripped).
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch

from trainmon.collectors.base import Collector, register_collector
from trainmon.core.naming import ROOT_NAME, clean_name, unwrap_model
from trainmon.output.layout import MODEL_META, rank_dir_name

__all__ = ["ModelMetaCollector", "model_meta", "META_FORMAT"]

log = logging.getLogger(__name__)

META_FORMAT = 1
_INIT = ("norm", "mean", "min", "max")


@torch.no_grad()
def _init_stats(params: list[torch.Tensor]) -> list[dict[str, float | str]]:
    rows = []
    for p in params:
        x = p.detach().reshape(-1)
        if x.numel() == 0 or not (x.is_floating_point() or x.is_complex()):
            rows.append(torch.full((4,), math.nan, dtype=torch.float64, device=x.device))
            continue
        x = x.double()
        rows.append(torch.stack([x.norm(), x.mean(), x.min(), x.max()]))
    by_device: dict[Any, list[int]] = {}
    for i, r in enumerate(rows):
        by_device.setdefault(r.device, []).append(i)
    host: list[list[float]] = [[]] * len(rows)
    for idx in by_device.values():
        values = torch.stack([rows[i] for i in idx]).cpu().tolist()
        for i, v in zip(idx, values):
            host[i] = v
    return [dict(zip(_INIT, (_json_float(v) for v in vals))) for vals in host]


def _json_float(v: float) -> float | str:
    return v if math.isfinite(v) else repr(v)  # JSON has no NaN/inf: "nan", "inf", "-inf"


def model_meta(chunks: list) -> dict[str, Any]:
    out = []
    for vpp, chunk in enumerate(chunks):
        model = unwrap_model(chunk)
        named = [(clean_name(n), p) for n, p in model.named_parameters()]
        init = _init_stats([p for _, p in named])
        params = [
            {
                "name": n,
                "shape": list(p.shape),
                "dtype": str(p.dtype),
                "requires_grad": bool(p.requires_grad),
                "init": s,
            }
            for (n, p), s in zip(named, init)
        ]
        modules = [{"name": clean_name(n) or ROOT_NAME, "type": type(m).__name__} for n, m in model.named_modules()]
        out.append({"vpp_stage": vpp, "type": type(model).__name__, "modules": modules, "params": params})
    return {"format": META_FORMAT, "chunks": out}


@register_collector
class ModelMetaCollector(Collector):
    name = "model_meta"
    priority = 10

    @staticmethod
    def enabled(config) -> bool:
        return config.loss_alignment

    def attach(self) -> None:
        cfg, run_dir = self.ctx.config, self.ctx.run_dir
        if run_dir is None or (cfg.module_ranks and self.ctx.rank not in cfg.module_ranks):
            return
        target = Path(run_dir) / rank_dir_name(self.ctx.rank) / MODEL_META
        if target.exists():  # written once: a dynamic-mode restart keeps the first one
            return
        data = model_meta(list(self.ctx.chunks))
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
            os.replace(tmp, target)
        except OSError as exc:
            log.warning("trainmon: could not write %s (%s); compare cannot check the model metadata", target, exc)
