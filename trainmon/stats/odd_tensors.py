"""Tensors the reductions cannot take as they are, and what the statistics layer does with them.

* **Sparse layouts** (COO, CSR, CSC, BSR, BSC: ``nn.Embedding(sparse=True)`` grads) are recorded
  with the statistics of the dense tensor they represent, without densifying it: the partials of
  the explicit values (a COO tensor coalesced first: duplicates add up) merged with those of the
  implicit zeros (``with_implicit_zeros``), an exact merge like any other piece of a tensor.
* **Dtypes without reduction kernels** (float8, ...) are upcast to float32 by the paths that read
  them (``stats.partials``, ``stats.device_rows``); exact for every dtype narrower than float32.
* **Tensors without data** (the ``meta`` device, a device kind whose memory cannot be copied to
  the host) and any tensor a reduction fails on are *skipped*: their row handle is a ``Skipped``,
  the engine drops that row alone and says so once per tensor (``warn_skipped``), and every other
  row of the capture is recorded as usual.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from trainmon.stats.table import combine

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "Skipped",
    "STRIDED",
    "explicit_values",
    "explicit_elements",
    "with_implicit_zeros",
    "unreadable_device",
    "warn_skipped",
    "reason_of",
]

log = logging.getLogger(__name__)
STRIDED = torch.strided


class Skipped:
    """The row handle of a tensor whose statistics are not recorded.  ``reason``: why, for the
    one warning per tensor; None when the caller warns itself (a CUDA graph capture)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str | None):
        self.reason = reason


def reason_of(exc: BaseException) -> str:
    """A failed reduction as a short clause for the skip warning."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else "no message"
    if len(first) > 160:
        first = first[:157] + "..."
    return f"its statistics cannot be computed ({type(exc).__name__}: {first})"


# -- sparse ------------------------------------------------------------------------------------
def explicit_values(t: torch.Tensor) -> torch.Tensor:
    """The stored values of a sparse tensor, each element of the dense tensor at most once: a COO
    tensor is coalesced first (a copy; the caller's tensor is left as it is)."""
    if t.layout is torch.sparse_coo:
        return (t if t.is_coalesced() else t.coalesce()).values()
    return t.values()  # compressed layouts (CSR, CSC, BSR, BSC) store each element once


def explicit_elements(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], dict[int, int]]:
    """``tensors`` with every sparse one replaced by its stored values, and for each of those (by
    position) how many implicit zeros it holds besides them."""
    out, pads = list(tensors), {}
    for k, t in enumerate(tensors):
        if t.layout is not STRIDED:
            values = explicit_values(t)
            out[k], pads[k] = values, t.numel() - values.numel()
    return out, pads


def with_implicit_zeros(rows: np.ndarray, columns: Sequence[str], zeros: np.ndarray, eps: float) -> np.ndarray:
    """``[n, len(columns)]`` partials of the stored values of ``n`` sparse tensors merged with the
    partials of their ``zeros[i]`` implicit zeros: the partials of the dense tensors."""
    import numpy as np

    rows = np.asarray(rows, dtype=np.float64)
    zeros = np.asarray(zeros, dtype=np.float64)
    some = zeros > 0
    piece = np.zeros_like(rows)
    for j, c in enumerate(columns):
        if c == "count" or (c == "zeros" and eps > 0):  # |0| < eps
            piece[:, j] = zeros
        elif c == "min":
            piece[:, j] = np.where(some, 0.0, np.inf)
        elif c == "max":
            piece[:, j] = np.where(some, 0.0, -np.inf)
    return combine(np.stack([rows, piece]), columns)


# -- tensors without data ----------------------------------------------------------------------
# Device kinds whose tensors hold data the host can copy (no probe needed).  Any other kind is
# probed once per device with a one-element copy to the host.
_READABLE_KINDS = frozenset({"cpu", "cuda", "xpu", "mps", "npu", "hpu", "mtia", "xla", "privateuseone"})
_UNREADABLE: dict[torch.device, str | None] = {}


def unreadable_device(device: torch.device) -> str | None:
    """Why tensors on ``device`` cannot be reduced and read on the host, or None when they can."""
    kind = device.type
    if kind in _READABLE_KINDS:
        return None
    if device not in _UNREADABLE:
        if kind == "meta":
            why: str | None = "it is on the meta device, which holds no data (e.g. not materialized after a meta init)"
        else:
            try:
                torch.zeros(1, device=device).to("cpu")
                why = None
            except Exception as exc:
                why = f"its device '{device}' cannot be read on the host ({type(exc).__name__})"
        _UNREADABLE[device] = why
    return _UNREADABLE[device]


_WARNED: set[tuple[str, str]] = set()
_WARNED_LOCK = threading.Lock()


def warn_skipped(name: str, family: str, skipped: Any) -> None:
    """One warning per process per (tensor name, reason): which tensor is not recorded and why."""
    reason = skipped.reason
    if reason is None:
        return
    with _WARNED_LOCK:
        if (name, reason) in _WARNED:
            return
        _WARNED.add((name, reason))
    log.warning(
        "trainmon: %r is not recorded (%s, and any other family it appears in): %s; every other "
        "tensor is recorded as usual (said once per tensor)",
        name,
        family,
        reason,
    )
