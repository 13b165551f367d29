"""FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``): refused with one line, not measured.

FSDP1 flattens each wrapped module's params into one ``FlatParameter`` and gives every rank a
slice of it: ``named_parameters()`` yields either the flat params themselves or (with
``use_orig_params=True``, accelerate's default) views of this rank's slice, often empty or cut
mid-tensor.  Measured as they are, grad, param and moment rows would be per-rank fragments
under the full params' names: wrong numbers.  trainmon does not map FSDP1's flat params back to
the model's, so under FSDP1 it tracks no params (no ``grad_*``, ``param_*``, ``exp_avg*`` rows)
and says so once; module families (activations) are still recorded.  FSDP2 (``fully_shard``,
accelerate's ``fsdp_version=2``) is supported (``integrations.fsdp2``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch.nn as nn

from trainmon.core.naming import TrackedParam
from trainmon.integrations.base import Integration, register_integration

__all__ = ["FSDP1Integration"]

log = logging.getLogger(__name__)


def _fsdp1_class() -> type | None:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # a torch built without distributed
        return None
    return FullyShardedDataParallel


@register_integration
class FSDP1Integration(Integration):
    name = "fsdp1"
    priority = 35

    @classmethod
    def detect(cls, chunks: Sequence[nn.Module], optimizer: Any) -> bool:
        fsdp = _fsdp1_class()
        return fsdp is not None and any(isinstance(m, fsdp) for c in chunks for m in c.modules())

    def display_params(self, params: list[TrackedParam], config: Any) -> list[TrackedParam]:
        if params:
            log.warning(
                "trainmon: the model is wrapped in FSDP1 (FullyShardedDataParallel), whose per-rank flat "
                "param shards trainmon does not merge: grad, param and moment families are not recorded "
                "(use FSDP2: torch's fully_shard, or accelerate's fsdp_version=2)"
            )
        return []
