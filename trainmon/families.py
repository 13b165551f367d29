"""The families trainmon records: one list, with everything the layers need to know of each.

A *family* is one kind of recorded tensor statistics (one CSV file family, one TensorBoard tag
prefix).  The collectors write them, the sinks name files after them, the diagnosis commands
order them by training flow.  Adding a family is one member here and one entry in ``FAMILIES``.
No torch here: the readers and the config loader import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = [
    "Family",
    "FamilyInfo",
    "FAMILIES",
    "MOMENTS",
    "NOT_SCALAR",
    "OPTIMIZER_STATE",
    "Phase",
    "PHASES",
]


class _StrEnum(str, Enum):
    """A str whose value is its name on disk (``enum.StrEnum`` needs Python 3.11)."""

    __hash__ = str.__hash__  # members and their strings are the same dict key

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Phase(_StrEnum):
    """Where in a step data is produced, in training-flow order."""

    SETUP = "setup"  # the step's settings (hyperparams), before any data moves
    FORWARD = "forward"
    BACKWARD = "backward"
    PRE_REDUCE = "pre_reduce"
    COMM = "comm"
    POST_REDUCE = "post_reduce"
    OPTIMIZER = "optimizer"
    OTHER = "other"  # a family trainmon does not know


PHASES: tuple[Phase, ...] = tuple(Phase)


class Family(_StrEnum):
    HYPERPARAMS = "hyperparams"
    MODEL_INPUT = "model_input"
    ACTV = "actv"
    LOSS = "loss"
    ACTV_GRAD = "actv_grad"
    GRAD_UNREDUCED = "grad_unreduced"
    COMM = "comm"
    GRAD_REDUCED = "grad_reduced"
    GRAD_PROBE = "grad_probe"
    GRAD_DIRECTION = "grad_direction"
    PARAM_ORIGIN = "param_origin"
    EXP_AVG = "exp_avg"
    EXP_AVG_SQ = "exp_avg_sq"
    MAX_EXP_AVG_SQ = "max_exp_avg_sq"
    EXP_INF = "exp_inf"
    MOMENTUM_BUFFER = "momentum_buffer"
    SQUARE_AVG = "square_avg"
    GRAD_AVG = "grad_avg"
    ACC_DELTA = "acc_delta"
    ADAGRAD_SUM = "adagrad_sum"
    RPROP_PREV = "rprop_prev"
    RPROP_STEP_SIZE = "rprop_step_size"
    ASGD_AX = "asgd_ax"
    ADAFACTOR_VARIANCE = "adafactor_variance"
    PARAM_UPDATED = "param_updated"
    UPDATE_RATIO = "update_ratio"
    STEPS = "steps"


@dataclass(frozen=True)
class FamilyInfo:
    """What one family is.

    ``config_flag``: the config key that switches it on (None: an API call writes it, such as
    ``record_loss``); ``per_micro_step``: one row per
    micro-batch (a ``micro_step`` column); ``replicated``: equal on every data-parallel rank
    under plain DDP (rank checks compare them); ``own_stats``: value columns of its own instead
    of the ``ops``; ``moment``: an optimizer state tensor (``mv_distribution``);
    ``state_key``: the key of ``torch.optim`` optimizers' per-param ``optimizer.state[param]``
    it records (the family name unless that key is a generic word such as Adagrad's ``sum``).
    """

    phase: Phase
    config_flag: str | None
    per_micro_step: bool = False
    replicated: bool = False
    own_stats: tuple[str, ...] = ()
    moment: bool = False
    ratio: bool = False
    scalar: bool = True
    state_key: str | None = None


def _state(key: str) -> FamilyInfo:
    """An optimizer state tensor of a param (same shape), read after the step."""
    return FamilyInfo(Phase.OPTIMIZER, "mv_distribution", replicated=True, moment=True, state_key=key)


# In training-flow order: the order is the tie-break between families of one phase.
FAMILIES: dict[Family, FamilyInfo] = {
    Family.HYPERPARAMS: FamilyInfo(Phase.SETUP, "loss_alignment", replicated=True, own_stats=("value",)),
    Family.MODEL_INPUT: FamilyInfo(Phase.FORWARD, "loss_alignment", per_micro_step=True),
    Family.ACTV: FamilyInfo(Phase.FORWARD, "xy_distribution", per_micro_step=True),
    # Written when the training loop (or a framework callback) calls ``monitor.record_loss``.
    Family.LOSS: FamilyInfo(Phase.FORWARD, None, per_micro_step=True, own_stats=("loss",)),
    Family.ACTV_GRAD: FamilyInfo(Phase.BACKWARD, "xy_distribution", per_micro_step=True),
    Family.GRAD_UNREDUCED: FamilyInfo(Phase.PRE_REDUCE, "wg_distribution"),
    Family.COMM: FamilyInfo(Phase.COMM, "cc_distribution"),
    Family.GRAD_REDUCED: FamilyInfo(Phase.POST_REDUCE, "wg_distribution"),
    Family.GRAD_PROBE: FamilyInfo(Phase.POST_REDUCE, "grad_probe"),
    Family.GRAD_DIRECTION: FamilyInfo(Phase.POST_REDUCE, "grad_probe", scalar=False),
    Family.PARAM_ORIGIN: FamilyInfo(Phase.OPTIMIZER, "param_distribution", replicated=True),
    # Optimizer state after the step (docs/output_files.md names the optimizers keeping each).
    Family.EXP_AVG: _state("exp_avg"),
    Family.EXP_AVG_SQ: _state("exp_avg_sq"),
    Family.MAX_EXP_AVG_SQ: _state("max_exp_avg_sq"),
    Family.EXP_INF: _state("exp_inf"),
    Family.MOMENTUM_BUFFER: _state("momentum_buffer"),
    Family.SQUARE_AVG: _state("square_avg"),
    Family.GRAD_AVG: _state("grad_avg"),
    Family.ACC_DELTA: _state("acc_delta"),
    Family.ADAGRAD_SUM: _state("sum"),
    Family.RPROP_PREV: _state("prev"),
    Family.RPROP_STEP_SIZE: _state("step_size"),
    Family.ASGD_AX: _state("ax"),
    Family.ADAFACTOR_VARIANCE: _state("variance"),
    Family.PARAM_UPDATED: FamilyInfo(Phase.OPTIMIZER, "param_distribution", replicated=True),
    Family.UPDATE_RATIO: FamilyInfo(
        Phase.OPTIMIZER, "ur_distribution", replicated=True, own_stats=("update_ratio",), ratio=True
    ),
    # One row (name "optimizer") per recorded step of a loss-scaled run: skipped 1 when the loss
    # scaler skipped the optimizer step (Inf/NaN grads), else 0; loss_scale: the scale it ran with.
    # Written whenever a GradScaler steps the optimizer (no config flag: docs/escalation.md).
    Family.STEPS: FamilyInfo(Phase.OPTIMIZER, None, replicated=True, own_stats=("skipped", "loss_scale")),
}

NOT_SCALAR: frozenset[str] = frozenset(str(f) for f, i in FAMILIES.items() if not i.scalar)
# Adam's two moments: what framework optimizers (Megatron, DeepSpeed) are asked for.
MOMENTS: tuple[Family, ...] = (Family.EXP_AVG, Family.EXP_AVG_SQ)
# Every optimizer state family (``mv_distribution``), in training-flow order.
OPTIMIZER_STATE: tuple[Family, ...] = tuple(f for f, i in FAMILIES.items() if i.moment)
