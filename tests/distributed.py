"""Run a function on N gloo ranks (forked processes on 127.0.0.1) and fail loudly.

    run_distributed(fn, world_size=2, timeout=120, args=(...))

Each rank: one torch thread, log lines prefixed with ``[rank R]``, ``init_process_group`` with a
timeout (so a hang fails instead of blocking CI), ``fn(rank, world_size, *args)`` in try/finally,
the process group always destroyed.  The parent raises if any rank fails (with its traceback) or
if the job does not end within ``timeout`` seconds (every rank is then killed).
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Sequence

__all__ = ["run_distributed", "free_port"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn: Callable, rank: int, world_size: int, port: int, args: Sequence[Any],
               env: dict[str, str], errors: Any, init_timeout: float) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(env)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, force=True, stream=sys.stderr,
                        format=f"[rank {rank}] %(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=init_timeout))
        try:
            fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, then a non-zero exit
        errors.put((rank, traceback.format_exc()))
        errors.close()
        errors.join_thread()  # the feeder thread must deliver it before os._exit
        sys.stderr.flush()
        os._exit(1)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(0)  # skip atexit handlers inherited from the parent (pytest's)


def run_distributed(fn: Callable, world_size: int = 2, timeout: float = 120.0, args: Sequence[Any] = (),
                    env: dict[str, str] | None = None, init_timeout: float = 60.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked gloo ranks."""
    ctx = mp.get_context("fork")
    errors = ctx.Queue()
    port = free_port()
    child_env = {"OMP_NUM_THREADS": "1", **(env or {})}
    procs = [ctx.Process(target=_rank_main, name=f"rank{r}",
                         args=(fn, r, world_size, port, args, child_env, errors, init_timeout))
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [p.name for p in procs if p.is_alive()]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    failures = []
    while True:
        try:
            failures.append(errors.get(timeout=0.5))
        except queue.Empty:
            break
    if failures:
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures))
        raise AssertionError(f"{len(failures)} rank(s) failed:\n{text}")
    if hung:
        raise TimeoutError(f"distributed job did not end within {timeout}s; still running: {hung}")
    bad = [(p.name, p.exitcode) for p in procs if p.exitcode != 0]
    if bad:
        raise AssertionError(f"ranks exited abnormally: {bad}")
