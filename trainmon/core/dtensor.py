"""DTensors (FSDP2, tensor parallelism): the local piece of a tensor and the group that holds the rest.

Every rank measures its local piece and the stats engine merges the partials over the group that
splits the tensor, so rows are the statistics of the full tensor.  A tensor split over several
mesh dimensions (FSDP2 over TP: a 2-D DTensor) is merged over the group of all of them; one
replicated over a dimension is not merged over it (replicas are not counted twice).
"""

from __future__ import annotations

from typing import Any, cast

import torch

__all__ = ["dtensor_parts", "shard_group"]


def _splits(placement: Any) -> bool:
    """Whether a placement splits the tensor over its mesh dimension: ``Shard``, and FSDP2's
    ``_StridedShard`` (dim 0 over DP when TP already split dim 0; not a ``Shard`` subclass in
    every torch).  Either way the local pieces of all ranks partition the full tensor."""
    from torch.distributed.tensor import Shard

    return isinstance(placement, Shard) or type(placement).__name__ == "_StridedShard"


def shard_group(dt: Any) -> Any:
    """The process group over which ``dt`` is split, or None when it is not split."""
    dims = tuple(i for i, p in enumerate(dt.placements) if _splits(p))
    if not dims:
        return None
    if len(dims) == 1:
        return dt.device_mesh.get_group(dims[0])
    return _flat_group(dt.device_mesh, dims)


_FLAT_GROUPS: dict[tuple[int, tuple[int, ...]], Any] = {}


def _flat_group(mesh: Any, dims: tuple[int, ...]) -> Any:
    """The process group spanning mesh dimensions ``dims``.  Building it is a collective of every
    rank of the mesh: the first capture of such a tensor happens on every rank at the same point
    (the stats of a split tensor need every rank's piece anyway)."""
    key = (id(mesh), dims)
    group = _FLAT_GROUPS.get(key)
    if group is None:
        names = mesh.mesh_dim_names
        if len(dims) < mesh.ndim and names is None:
            raise NotImplementedError(
                f"a DTensor split over mesh dimensions {dims} of a {mesh.ndim}-D mesh "
                "without dimension names; name them (init_device_mesh(mesh_dim_names=...))"
            )
        sub = mesh if len(dims) == mesh.ndim else mesh[tuple(names[d] for d in dims)]
        group = _FLAT_GROUPS[key] = sub._flatten().get_group()
    return group


def dtensor_parts(t: torch.Tensor, reduce_partial: bool = False) -> tuple[torch.Tensor, Any, tuple[int, ...] | None]:
    """(local piece, group to merge over or None, full shape or None) of a maybe-DTensor.

    ``reduce_partial``: a ``Partial`` placement (a sum not yet reduced, e.g. an activation) is
    reduced first, a collective of its mesh group (whose ranks all run the same hook)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t.detach(), None, None
    t = cast(DTensor, t.detach())  # DTensor.detach is typed as Tensor's; it returns a DTensor
    if reduce_partial:
        from torch.distributed.tensor import Partial, Replicate

        if any(isinstance(p, Partial) for p in t.placements):
            with torch.no_grad():
                t = t.redistribute(t.device_mesh, [Replicate() if isinstance(p, Partial) else p for p in t.placements])
    group = shard_group(t)
    return t.to_local().detach(), group, (tuple(t.shape) if group is not None else None)
