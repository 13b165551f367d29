"""The on-disk contract: every name trainmon writes, built and parsed here and nowhere else.

::

    $MONITOR_OUTPUT_DIR/<run_id>/
        run.json                                  what ran (written by rank 0; its "escalations"
                                                  list is appended to, atomically, on each escalation)
        rank<R>/<family>_<a>-<b>[.<k>].csv        one file per family per step window
        rank<R>/<family>_<a>-<b>[.<k>].parquet    the same, ``"format": ["parquet"]``
        rank<R>/anomalies.jsonl                   run-time alerts
        rank<R>/model_meta.json                   the model as monitoring began (loss_alignment)
        rank<R>/stack_info.csv                    where each module is called from (stack_info)
        rank<R>/step_times.tsv                    when each recorded step was recorded (``step<TAB>unix time``)
        tensorboard/rank<R>/events.out.tfevents.* TensorBoard events (see ``tb_tags``)

``<a>-<b>`` is the window of ``step_count_per_record`` steps a file holds; ``<k>`` (1, 2, ...)
numbers the files of a window written under another header (``ops`` changed mid-run).
This module imports neither torch nor pandas.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "RUN_META",
    "RUN_ESCALATIONS",
    "TMP_SUFFIX",
    "ALERTS_FILE",
    "MODEL_META",
    "STACK_INFO_FILE",
    "STEP_TIMES_FILE",
    "step_time_line",
    "parse_step_times",
    "SIMILARITIES_FILE",
    "SIMILARITY_SUMMARY_PNG",
    "TB_DIRNAME",
    "NOT_RUNS",
    "FamilyFile",
    "rank_dir_name",
    "parse_rank_dir",
    "window_bounds",
    "family_file_name",
    "parse_family_file",
    "partial_file_name",
]

RUN_META = "run.json"
RUN_ESCALATIONS = "escalations"  # key of run.json: one object per escalation (docs/escalation.md)
ALERTS_FILE = "anomalies.jsonl"
MODEL_META = "model_meta.json"
STACK_INFO_FILE = "stack_info.csv"  # columns vpp_stage,name,stack (frames outermost first, one per line)
# One line per recorded step, ``<step>\t<wall time>`` (Unix seconds, repr of a float), appended when
# the step's rows are written (CSV and Parquet sinks).  Not ``.csv``: no reader of family files
# may take it for one.  ``csv2tb`` stamps events with these times.
STEP_TIMES_FILE = "step_times.tsv"
# ``trainmon similarity -o DIR``: the table and the charts it writes.
SIMILARITIES_FILE = "similarities.csv"
SIMILARITY_SUMMARY_PNG = "summary_similarities.png"
TB_DIRNAME = "tensorboard"
# A file being written whole (Parquet windows) is ``.<final name>`` + this until renamed: no
# family file pattern matches it, so readers never see a half-written file.
TMP_SUFFIX = ".tmp"
# Directories that hold rank<R>/ folders but are not runs (event files of a run).
NOT_RUNS = frozenset({TB_DIRNAME})

_RANK_DIR = re.compile(r"^rank(\d+)$")
_FAMILY_FILE = re.compile(
    r"^(?P<family>[A-Za-z0-9_]+?)_(?P<start>\d+)-(?P<end>\d+)(?:\.(?P<part>\d+))?"
    r"\.(?P<ext>csv|parquet)$"
)


@dataclass(frozen=True, order=True)
class FamilyFile:
    """One file of a family: the step window ``start..end`` and its header variant ``part``."""

    start: int
    part: int
    end: int
    family: str
    path: Path
    ext: str = "csv"


def rank_dir_name(rank: int) -> str:
    return f"rank{int(rank)}"


def parse_rank_dir(name: str) -> int | None:
    """``R`` of a ``rank<R>`` directory name, else None."""
    m = _RANK_DIR.match(name)
    return int(m.group(1)) if m else None


def window_bounds(step: int, steps_per_file: int) -> tuple[int, int]:
    """First and last step of the file window holding ``step``."""
    a = step // steps_per_file * steps_per_file
    return a, a + steps_per_file - 1


def family_file_name(family: str, a: int, b: int, k: int = 0, ext: str = "csv") -> str:
    """``{family}_{a}-{b}.{ext}``, or ``{family}_{a}-{b}.{k}.{ext}`` for the k-th header variant."""
    return f"{family}_{a}-{b}.{ext}" if k == 0 else f"{family}_{a}-{b}.{k}.{ext}"


def partial_file_name(name: str, pid: int, writer: int) -> str:
    """The hidden name a file is written under before it gets ``name`` (never parsed as a family
    file: a leftover after a kill is ignored by every reader).  ``writer`` tells apart the sinks of
    one process that may write the same file at once."""
    return f".{name}.{int(pid)}-{int(writer)}{TMP_SUFFIX}"


def parse_family_file(path: Path) -> FamilyFile | None:
    """The :class:`FamilyFile` a path names, else None (other files of a rank dir)."""
    m = _FAMILY_FILE.match(path.name)
    if m is None:
        return None
    return FamilyFile(int(m["start"]), int(m["part"] or 0), int(m["end"]), m["family"], path, m["ext"])


def step_time_line(step: int, wall_time: float) -> str:
    """One line of ``STEP_TIMES_FILE``: the step and its wall time at full precision."""
    return f"{int(step)}\t{float(wall_time)!r}\n"


def parse_step_times(text: str) -> dict[int, float]:
    """Step -> wall time of a ``STEP_TIMES_FILE``'s text.  The first time of a step wins (a step
    recorded again, after a resume, keeps when it was first recorded); a last line without its end
    of line (cut short by a kill) and a line that is not ``<int>\t<float>`` are skipped."""
    times: dict[int, float] = {}
    for line in text.split("\n")[:-1]:
        step, sep, wall = line.partition("\t")
        try:
            parsed = int(step), float(wall)
        except ValueError:
            continue
        if sep:
            times.setdefault(*parsed)
    return times
