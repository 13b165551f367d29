"""The value type that flows from the stats engine to the sinks."""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["StatRow"]


@dataclass(frozen=True, slots=True)
class StatRow:
    """One CSV row: the statistics of one tensor at one (step, micro_step).

    ``stats`` is ordered (the config's ``ops`` order, or a family's own columns such as
    ``update_ratio``); counts (``nans``, ``infs``) are ints, everything else floats.
    ``micro_step`` is set only for families recorded per micro-batch (activations).
    """

    family: str
    name: str
    step: int
    stats: dict[str, float | int]
    shape: tuple[int, ...] = ()
    dtype: str = ""
    vpp_stage: int = 0
    micro_step: int | None = None
    extra: dict[str, object] = field(default_factory=dict)
