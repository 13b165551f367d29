"""EpochAccumulation: the micro-batches of each step when an epoch ends with a shorter step."""
from __future__ import annotations

from trainmon.core.schedule import EpochAccumulation


def test_the_last_step_of_every_epoch_has_the_remaining_micro_batches():
    step = [None]
    acc = EpochAccumulation(3, batches_per_epoch=7, next_step=lambda: step[0], first_step=0)
    seen = []
    for s in range(6):   # 7 batches, 3 per step: steps of 3, 3, 1 in every epoch
        step[0] = s
        seen.append(acc())
    assert seen == [3, 3, 1, 3, 3, 1]


def test_before_the_monitor_knows_its_step_the_first_step_is_used_and_resuming_keeps_the_epoch_place():
    acc = EpochAccumulation(2, batches_per_epoch=5, next_step=lambda: None, first_step=5)
    assert acc() == 1          # step 5 is the third (last, 1 micro-batch) step of the second epoch
    assert EpochAccumulation(4, None, lambda: 3)() == 4   # no length (an iterable dataset): always acc
    assert EpochAccumulation(2, 4, lambda: 1)() == 2      # divisible: never shorter
