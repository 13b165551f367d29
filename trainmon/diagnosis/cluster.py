"""Where the per-bucket checks run: in this process, or on a Dask cluster (``--cluster ADDRESS``).

Every analysis command cuts a staged run into buckets (``engine_buckets``) and runs the one
pandas rule set on each; ``map_buckets`` is the single place that decides where those calls run.
``fn`` must be a module-level function (or a ``functools.partial`` of one) and ``items`` plain
picklable values (paths, ranges, rules), so the same call can be shipped to workers that read the
staged Parquet files from shared storage (``TRAINMON_ENGINE_WORKDIR``: ``engine.work_root``).

Dask (``dask.distributed``), not Spark: it is pure Python and pip-installable (the ``cluster``
extra), runs the same pandas functions unchanged with no JVM and no conversion of the findings,
and its ``LocalCluster`` gives the tests a real scheduler with real worker processes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

from trainmon.errors import TrainmonError, env_int

__all__ = ["map_buckets", "ClusterError", "check_available", "connect_timeout", "CONNECT_TIMEOUT_S"]

T = TypeVar("T")
R = TypeVar("R")

# Seconds to wait for the scheduler to answer, and then for its first worker
# (TRAINMON_CLUSTER_TIMEOUT, default 30); set here (tests), it wins over the environment.
CONNECT_TIMEOUT_S: int | None = None
_INSTALL = "pip install trainmon[cluster]"


class ClusterError(TrainmonError):
    """The cluster cannot run the checks (no Dask, no scheduler, no worker, unreadable files): one line."""


def connect_timeout() -> int:
    return CONNECT_TIMEOUT_S if CONNECT_TIMEOUT_S is not None else env_int("TRAINMON_CLUSTER_TIMEOUT", 30)


def check_available() -> None:
    """A ``ClusterError`` naming the extra to install when Dask's distributed scheduler is missing."""
    try:
        import distributed  # noqa: F401
    except ImportError:
        raise ClusterError(f"--cluster needs Dask's distributed scheduler: {_INSTALL}") from None


def map_buckets(fn: Callable[[T], R], items: Iterable[T], *, cluster: str | None = None, progress=None) -> list[R]:
    """``[fn(item) for item in items]``, in order; on the Dask scheduler at ``cluster`` if given.
    ``progress`` (anything with ``advance()``) hears of each item done."""
    if cluster is None:
        out = []
        for item in items:
            out.append(fn(item))
            if progress is not None:
                progress.advance()
        return out
    return _on_dask(fn, list(items), cluster, progress)


def _on_dask(fn: Callable[[T], R], items: list[T], address: str, progress) -> list[R]:
    check_available()
    from distributed import Client, as_completed

    timeout = connect_timeout()
    try:
        client = Client(address, timeout=f"{timeout}s", set_as_default=False)
    except Exception as exc:  # OSError, TimeoutError, ValueError (a malformed address): all one line
        raise ClusterError(
            f"--cluster {address}: no Dask scheduler answered within {timeout} s ({_first_line(exc)}); "
            "start one with `dask scheduler` and give its address (tcp://HOST:8786)"
        ) from None
    with client:
        try:
            client.wait_for_workers(1, timeout=timeout)
        except Exception:
            raise ClusterError(
                f"--cluster {address}: the scheduler has no worker after {timeout} s "
                f"(start some with `dask worker {address}`)"
            ) from None
        # pure=False: every bucket is its own task, even where two look alike to Dask's hashing.
        futures = client.map(fn, items, pure=False)
        try:
            for _ in as_completed(futures, loop=client.loop):
                if progress is not None:
                    progress.advance()
            return client.gather(futures)
        except (OSError, ImportError) as exc:
            raise ClusterError(_worker_problem(address, exc)) from None


def _worker_problem(address: str, exc: BaseException) -> str:
    if isinstance(exc, ImportError):
        return f"--cluster {address}: a worker cannot import trainmon ({_first_line(exc)}): install it on every worker"
    return (
        f"--cluster {address}: a worker cannot read the staged run ({_first_line(exc)}): "
        "TRAINMON_ENGINE_WORKDIR must be a folder every worker sees at the same path"
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
