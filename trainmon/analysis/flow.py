"""Training-flow order: where in a step each CSV family is recorded.

Within one step the data a monitor records is produced in this order (the phases):

============= ================================================ ==========================
phase         families                                         order inside the phase
============= ================================================ ==========================
setup         ``hyperparams``                                  param group, setting order
forward       ``model_input``, ``actv``, ``loss``              micro-step, then family (this
                                                               order), module call order
backward      ``actv_grad``                                    micro-step, backward order
pre_reduce    ``grad_unreduced``                               backward (grad-ready) order
comm          ``comm``                                         call order
post_reduce   ``grad_reduced``, ``grad_probe``,                family, then model parameter
              ``grad_direction``                               order
optimizer     ``param_origin``, ``exp_avg``, ``exp_avg_sq``,    family (this order), then
              ``param_updated``, ``update_ratio``               model parameter order
other         any family trainmon does not know                family name, row order
============= ================================================ ==========================

Phases and families come from ``trainmon.families``.  The order inside a phase is the row order of the CSV
files (the writer keeps it), so "the first
anomaly" is the first one a step would have produced.  Nothing computed in a later phase can
feed an earlier one in the same step, which is what makes the first entry the origin.
"""

from __future__ import annotations

from trainmon.families import FAMILIES
from trainmon.families import PHASES as _PHASES

__all__ = [
    "PHASES",
    "FAMILY_PHASE",
    "FAMILY_ORDER",
    "MICRO_FAMILIES",
    "phase_of",
    "phase_rank",
    "flow_key",
    "family_rank",
    "FLOW_KEYS",
]

PHASES: tuple[str, ...] = tuple(str(p) for p in _PHASES)

# Families in flow order; the index is the tie-break between families of one phase.
FAMILY_ORDER: tuple[str, ...] = tuple(str(f) for f in FAMILIES)

FAMILY_PHASE: dict[str, str] = {str(f): str(info.phase) for f, info in FAMILIES.items()}

# Families recorded once per micro-batch (their CSVs carry a ``micro_step`` column).
MICRO_FAMILIES: frozenset[str] = frozenset(str(f) for f, info in FAMILIES.items() if info.per_micro_step)

# Columns of a run table that sort rows in training-flow order (see reader.RunTable).
FLOW_KEYS: tuple[str, ...] = ("step", "flow", "micro_step", "family_order", "position", "rank", "occurrence")


def phase_of(family: str) -> str:
    return FAMILY_PHASE.get(family, "other")


def phase_rank(family: str) -> int:
    return PHASES.index(phase_of(family))


def family_rank(family: str) -> int:
    # Unknown families sort after the known ones (a run table numbers them by name).
    return FAMILY_ORDER.index(family) if family in FAMILY_ORDER else len(FAMILY_ORDER)


def flow_key(step: int, kind: str, micro_step: int | None, position: int) -> tuple:
    """Training-flow order of one entry: step, phase, micro-batch, family, row position."""
    micro = -1 if micro_step is None else micro_step
    return (step, phase_rank(kind), micro, family_rank(kind), kind, position)
