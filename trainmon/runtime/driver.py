"""Step drivers: what ``TrainerMon`` delegates the step boundary to.

A driver owns the step boundary of one ``set_monitor`` call.  The static driver runs one
session for the whole job; the dynamic driver (``dynamic_driver.DynamicDriver``) starts and
stops sessions as the config file says.  ``TrainerMon`` holds one driver and never asks which.
"""

from __future__ import annotations

from typing import Protocol

from trainmon.runtime.session import StepSession

__all__ = ["StepDriver", "StaticDriver"]


class StepDriver(Protocol):
    @property
    def session(self) -> StepSession | None:
        """The session collecting now, if any."""

    @property
    def step(self) -> int | None:
        """The step that runs next (None when nothing is monitored)."""

    def before_step(self) -> None: ...

    def after_step(self) -> None: ...

    def close(self) -> None: ...


class StaticDriver:
    """One session for the whole job; the session wraps the optimizer's step itself."""

    def __init__(self, session: StepSession):
        self._session = session

    @property
    def session(self) -> StepSession:
        return self._session

    @property
    def step(self) -> int | None:
        return self._session.clock.step

    def before_step(self) -> None:
        self._session.before_step()

    def after_step(self) -> None:
        self._session.after_step()

    def close(self) -> None:
        self._session.close()
