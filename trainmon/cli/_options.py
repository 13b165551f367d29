"""Checks of command options shared by the commands: one clear line (a ``CommandError``, exit
code 2) for a bad value, never a traceback, and never a silent no-op."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from trainmon.cli import CommandError

__all__ = ["rank_list", "non_negative", "check_recorded", "add_cluster_option", "cluster_address"]


def rank_list(text: str | None, option: str = "--ranks") -> list[int] | None:
    """``"0,2,4"`` -> [0, 2, 4]; None stays None."""
    if text is None:
        return None
    ranks = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if not part.isdigit():
            raise CommandError(f"{option}: '{part}' is not a rank number (expected a comma list like 0,2,3)")
        ranks.append(int(part))
    if not ranks:
        raise CommandError(f"{option}: no rank given (expected a comma list like 0,2,3)")
    return ranks


def non_negative(value: int | None, option: str) -> None:
    if value is not None and value < 0:
        raise CommandError(f"{option} must be >= 0 (0 = all), got {value}")


def check_recorded(wanted: Sequence | None, recorded: Sequence, what: str, path: object) -> None:
    """Every name or rank asked for is in the run; else name the first missing one and what is there."""
    for name in wanted or ():
        if name not in recorded:
            have = ", ".join(map(str, recorded)) or "none"
            raise CommandError(f"no {what} '{name}' in {path} (recorded: {have})")


def add_cluster_option(parser: argparse.ArgumentParser) -> None:
    """``--cluster ADDRESS``: run the command's per-bucket checks on a Dask scheduler
    (``diagnosis.cluster``); read it back with ``cluster_address(args)``."""
    parser.add_argument(
        "--cluster",
        metavar="ADDRESS",
        default=None,
        help="run the per-bucket checks (compare: the alignment groups) on the Dask scheduler at ADDRESS "
        "(e.g. tcp://10.0.0.5:8786); "
        "its workers read the staged files, so TRAINMON_ENGINE_WORKDIR must be a folder they see too "
        "(needs: pip install trainmon[cluster]; docs/analysis_at_scale.md)",
    )


def cluster_address(args: argparse.Namespace) -> str | None:
    """The ``--cluster`` address, checked before any work: an empty one, or no Dask installed, is
    one line (exit code 2) naming what to do, not a traceback after the run was staged."""
    address = getattr(args, "cluster", None)
    if address is None:
        return None
    from trainmon.diagnosis.cluster import ClusterError, check_available

    if not address.strip():
        raise CommandError("--cluster: empty address (expected a Dask scheduler address like tcp://host:8786)")
    try:
        check_available()
    except ClusterError as exc:
        raise CommandError(str(exc)) from None
    return address.strip()
