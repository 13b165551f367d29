"""Run a function on N gloo ranks in child processes (tests only).

``run_distributed(fn, world_size=2, timeout=120, backend="gloo", args=())`` spawns ``world_size``
processes; each initialises the default process group on a free 127.0.0.1 port, runs
``fn(rank, world_size, *args)`` and sends back its return value (which must pickle).  The list of
return values comes back in rank order.  Any rank's exception is raised here with that rank's
traceback; ranks that hang past ``timeout`` are killed and a ``TimeoutError`` is raised.  The
process group is always destroyed in the child.  ``fn`` must be importable (module level).
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import torch.multiprocessing as mp

__all__ = ["run_distributed", "DistributedTestError"]

REPO = str(Path(__file__).resolve().parents[1])


class DistributedTestError(AssertionError):
    pass


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world_size: int, port: int, backend: str, timeout: float,
           fn: Callable[..., Any], args: Sequence[Any], queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    logging.basicConfig(level=logging.WARNING, format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        queue.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, False, f"[rank{rank}] " + traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int = 2, timeout: float = 120,
                    backend: str = "gloo", args: Sequence[Any] = ()) -> list[Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = REPO + (os.pathsep + env_path if env_path else "")
    try:
        procs = [ctx.Process(target=_child, args=(r, world_size, port, backend, timeout, fn, tuple(args), queue),
                             daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
    finally:
        os.environ["PYTHONPATH"] = env_path
        if not env_path:
            del os.environ["PYTHONPATH"]
    return _collect(procs, queue, world_size, timeout)


def _collect(procs: list, queue: Any, world_size: int, timeout: float) -> list[Any]:
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world_size:
        if not queue.empty():
            rank, ok, value = queue.get()
            (results.__setitem__(rank, value) if ok else errors.append(value))
            continue
        dead = [p for p in procs if p.exitcode not in (None, 0)]
        if dead and queue.empty():
            time.sleep(0.5)  # a rank may have died after queueing its error
            if queue.empty():
                errors.append(f"a rank exited with code {dead[0].exitcode} without reporting")
                break
        if errors or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for p in procs:
        p.join(timeout=5 if not errors else 1)
        if p.is_alive():
            p.kill()
            p.join()
    if errors:
        raise DistributedTestError("\n".join(errors))
    if len(results) < world_size:
        missing = sorted(set(range(world_size)) - set(results))
        raise TimeoutError(f"ranks {missing} did not finish within {timeout} s")
    return [results[r] for r in range(world_size)]
