"""Run a test body on several real gloo ranks.

    from tests._support.distributed import run_distributed
    results = run_distributed(body, world_size=2)     # body(rank, world_size, *args)

Ranks are forked (gloo; spawn for other backends), join a TCP store on a free 127.0.0.1 port
with a timeout so a hang fails the test instead of blocking CI, log with a ``[rank R]`` prefix,
and always destroy their process group.  The per-rank return values come back in rank order;
the first failing rank's traceback is raised here.  A spawned job costs seconds: put many checks
in one body.
"""
from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from typing import Any, Callable, Sequence

__all__ = ["run_distributed", "DistributedFailure"]


class DistributedFailure(AssertionError):
    """A rank raised, died or timed out."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Prefixed:
    """Line-prefixing text stream, so interleaved rank output stays readable."""

    def __init__(self, stream, prefix: str):
        self._stream, self._prefix, self._at_start = stream, prefix, True

    def write(self, text: str) -> int:
        out = []
        for piece in text.splitlines(keepends=True):
            if self._at_start:
                out.append(self._prefix)
            out.append(piece)
            self._at_start = piece.endswith("\n")
        self._stream.write("".join(out))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _child(fn, rank, world_size, port, backend, timeout, args, env, results) -> None:
    # What torchrun would set: frameworks such as DeepSpeed read these.
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(env)
    sys.stdout = _Prefixed(sys.stdout, f"[rank {rank}] ")
    sys.stderr = _Prefixed(sys.stderr, f"[rank {rank}] ")
    logging.basicConfig(level=logging.WARNING, force=True, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def run_distributed(fn: Callable[..., Any], world_size: int = 2, timeout: float = 120,
                    backend: str = "gloo", args: Sequence[Any] = (), env: dict[str, str] | None = None
                    ) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` ranks; their return values, in rank order.

    ``env`` is added to each rank's environment before the process group starts.
    """
    ctx = mp.get_context("fork" if backend == "gloo" else "spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, backend, timeout, tuple(args),
                                                     dict(env or {}), results),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        return _collect(procs, results, world_size, timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)


def _collect(procs, results, world_size: int, timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    while len(values) < world_size:
        try:
            rank, ok, payload = results.get(timeout=0.5)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in values and p.exitcode not in (None, 0)]
            if dead:
                raise DistributedFailure(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(values))
                raise DistributedFailure(f"ranks {missing} did not finish within {timeout} s")
            continue
        if not ok:
            raise DistributedFailure(f"rank {rank} failed:\n{payload}")
        values[rank] = payload
    return [values[r] for r in range(world_size)]
