"""The optional one-pass multi-tensor Triton path of ``stats.device_rows`` (CUDA and ROCm).

When ``triton`` is importable, the tensors of one ``DeviceRows.write`` call that are plain,
dense (see ``dense``), non-empty fp32/bf16/fp16 tensors are reduced by two kernel launches per dtype group
(``stats.triton_kernels``), whatever the ops and whatever the number of tensors:

1. ``chunk_partials`` reads every element once and writes one row of float32 partials per chunk
   (sum, sum of squares, min, max, the requested counts) into a reused per-stream scratch;
2. ``tensor_rows`` combines each tensor's chunks into its row of the device row buffer, in place.

The tensors of a group are described to the kernel like apex's ``multi_tensor_l2norm`` table,
flattened: an int64 pair per chunk (element offset from the group's first tensor, elements), then
the first chunk of every tensor.  Triton kernels take no arrays of pointers, so the offsets are
relative to one base tensor of the same dtype.  A group of five or more tensors (weight families)
builds its table at the first sight of its addresses (one small pinned asynchronous host->device
copy, cached per addresses, as the flat layouts are); fewer tensors (activations) take two
launches each and no table.

The sum of squares is overflow-safe: each chunk accumulates values scaled by a power of two at
or above its largest |x|, and the rows kernel brings every chunk to the tensor's largest scale
before adding (LAPACK's ``nrm2`` scaling, in powers of two so the scaling is exact): fp32 and bf16
norms above 1.8e19 stay finite and exact; so does the sum.

Everything else (views that do not fill one span: strided, expanded; empty, integer, bool, fp8
and fp64 tensors, tensor subclasses, ``std`` in ops) takes the eager device path; dense views in
another dim order (a transposed weight) are read as their span.  ``TRAINMON_TRITON=0`` turns the kernel
off.  For tests without a GPU, ``TRAINMON_TRITON_INTERPRET=1`` (with ``TRAINMON_DEVICE_PATH=1``)
runs the kernels on CPU tensors in Triton's interpreter; it sets ``TRITON_INTERPRET=1`` before
``triton`` is imported, for the whole process, so use it only in a process of its own.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from trainmon.stats.device_rows import DeviceRows

__all__ = ["TRITON_ENV", "INTERPRET_ENV", "FLOAT_DTYPES", "PLAIN_TENSORS", "TritonRows", "dense", "supported"]

TRITON_ENV = "TRAINMON_TRITON"  # "0": never use the Triton kernel
INTERPRET_ENV = "TRAINMON_TRITON_INTERPRET"  # "1": CPU tensors through Triton's interpreter (tests)
# Chunk, block and warps measured on an H200 (bf16 activations of 64-180 MB): 16384/2048/8 read at
# 0.76-1.04 TB/s where 4096/1024/4 read at 0.57-0.95; larger chunks helped bf16 and slowed fp32.
CHUNK_MIN = 16384  # elements a chunk at least (tests lower it to cover many chunks with small tensors)
_CHUNK_MAX = 1 << 20  # chunk counts stay exact in the float32 partials
_MAX_CHUNKS = 1 << 16  # chunks grow (powers of two) beyond this many a launch: the scratch stays small
_BLOCK = 2048  # elements a program reads at a time
_WARPS = 8  # warps a chunk program runs (Triton's launch option num_warps)
_ROWS_BLOCK = 256  # chunks the rows kernel combines at a time
_DATA_PTR, _NUMEL = torch.Tensor.data_ptr, torch.Tensor.numel
_MIN_TABLE = 5  # tensors of one dtype worth a descriptor table (activations come one or two at a time)
_UNSEEN = object()  # a group's addresses not seen yet (None is a group that has no table)
# What a kernel (Triton's, or the eager batched reductions of device_rows) may read as raw memory:
# the floating dtypes the device path reduces in place, and plain tensors (a subclass's storage
# may not be its data).
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_OFF = ("0", "false", "no", "off")
log = logging.getLogger(__name__)


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


@functools.cache
def _kernels() -> ModuleType | None:
    """``stats.triton_kernels``, or None when Triton cannot be imported (never required)."""
    if _flag(INTERPRET_ENV):
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, at their import
    try:
        from trainmon.stats import triton_kernels
    except Exception as exc:  # ImportError, or a broken install raising anything at import
        # Asked for only on a device the kernel serves (``supported``): a slower path, said once.
        log.warning(
            "trainmon: Triton cannot be imported (%s), so accelerator tensors take the eager device "
            "path: the same values, several kernel launches per tensor instead of two per group "
            "(slower). Fix: install the triton your torch build pins; TRAINMON_TRITON=0 chooses "
            "the eager path without this warning",
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
        )
        return None
    return triton_kernels


def supported(device: torch.device, values: Sequence[str]) -> bool:
    """Whether ``device``'s rows are reduced by the Triton kernel: CUDA/ROCm tensors (or CPU ones
    under ``TRAINMON_TRITON_INTERPRET=1``), Triton importable, not turned off, no ``std``."""
    if os.environ.get(TRITON_ENV, "").strip().lower() in _OFF or not set(values) <= {"sum", "sumsq", "min", "max"}:
        return False
    if device.type != "cuda" and not (device.type == "cpu" and _flag(INTERPRET_ENV)):
        return False
    return _kernels() is not None


def _launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """One kernel launch (a function of its own so tests can count and wrap launches)."""
    _LAUNCHER(kernel, grid, args, meta)


def _specialization(args: Sequence[Any]) -> tuple:
    """What Triton compiles a kernel for, of ``args``: a tensor's dtype, device (a compiled kernel
    is loaded on one) and 16-byte alignment; an int's being 1, a multiple of 16 and its width;
    anything else by type (floats are not specialized).  Equal keys run the same compiled kernel."""
    key: list[Any] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, a.device, a.data_ptr() % 16 == 0))
        elif isinstance(a, bool) or not isinstance(a, int):
            key.append(type(a))
        else:
            key.append((a == 1, a % 16 == 0, -(2**31) <= a < 2**31, a < 2**63))
    return tuple(key)


class _CachedLauncher:
    """Launches through the compiled kernel Triton returned for the same specialization.

    ``kernel[grid](...)`` binds, specializes and checks the kernel's globals on every call: about
    0.1 ms of host time per launch with Triton 3.6 (measured on an H200, where it made the
    monitored step host-bound).  The first launch of a specialization goes that way and keeps the
    ``CompiledKernel`` it returns; later ones call ``compiled[grid](*args)`` with the arguments in
    the kernel's order: constexprs included from Triton 3.3 on, the other arguments alone before
    (as Triton's own launch passes them).  Where Triton returns no compiled kernel (its interpreter)
    or is not a 3.x release, every launch takes the plain way.
    """

    def __init__(self) -> None:
        self._compiled: dict[tuple, Any] = {}
        self._order: dict[Any, tuple[str, ...] | None] = {}

    def __call__(self, kernel: Any, grid: tuple[int, ...], args: tuple, meta: dict[str, Any]) -> None:
        order = self._order.get(kernel, ())
        if order is None:
            kernel[grid](*args, **meta)
            return
        key = (id(kernel), tuple(meta.items()), _specialization(args))
        compiled = self._compiled.get(key)
        if compiled is not None:
            compiled[(*grid, 1, 1)[:3]](*args, *(meta[name] for name in order))  # it reads three grid dims
            return
        compiled = kernel[grid](*args, **meta)
        names = tuple(getattr(kernel, "arg_names", ()))[len(args) :]  # the constexprs; the rest of meta
        usable = callable(getattr(compiled, "__getitem__", None)) and hasattr(compiled, "function")
        passes = _constexprs_passed()
        if usable and passes is not None and set(names) <= set(meta):  # the rest: launch options (num_warps)
            self._order[kernel] = names if passes else ()
            self._compiled[key] = compiled
        else:
            self._order[kernel] = None


@functools.cache
def _constexprs_passed() -> bool | None:
    """Whether a compiled kernel's launcher takes the constexpr arguments too (Triton >= 3.3, read
    from 3.0-3.9's sources); None for a version outside 3.x, whose convention is not known."""
    version = str(getattr(sys.modules.get("triton"), "__version__", ""))  # imported with the kernels
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return None
    return minor >= 3 if major == 3 else None


_LAUNCHER = _CachedLauncher()


def dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one span of memory from ``data_ptr()`` on, each once: contiguous
    up to an order of its dims (a transposed weight is; a strided or expanded view is not).  The
    statistics do not depend on the order of the elements, so the kernel reads the span."""
    if t.is_contiguous():
        return True
    expected = 1
    for size, stride in sorted(((n, s) for n, s in zip(t.shape, t.stride()) if n != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _chunk_size(numel: int) -> int:
    chunk = CHUNK_MIN
    while chunk < _CHUNK_MAX and chunk * _MAX_CHUNKS < numel:
        chunk *= 2
    return chunk


class TritonRows:
    """The Triton reductions of one ``DeviceRows`` (its columns, tables and scratch)."""

    def __init__(self, rows: DeviceRows):
        self.rows = rows
        self.kernels: Any = _kernels()  # not None: ``supported`` said so
        k: Any = self.kernels
        wanted = {"sum": k.WANT_SUM, "sumsq": k.WANT_SQ, "min": k.WANT_MIN, "nans": k.WANT_NAN, "infs": k.WANT_INF,
                  "zeros": k.WANT_ZERO}  # fmt: skip
        want = sum(bit.value for c, bit in wanted.items() if c in rows.vcol or c in rows.ccol)
        self.width = k.P.value  # float32 partials per chunk (fixed columns)
        self.meta = {"WANT": want}
        self.row_meta = {
            "WANT": want,
            "V_SUM": rows.vcol.get("sum", -1),
            "V_SQ": rows.vcol.get("sumsq", -1),
            "V_MIN": rows.vcol.get("min", -1),
            "K_NAN": rows.ccol.get("nans", -1),
            "K_INF": rows.ccol.get("infs", -1),
            "K_ZERO": rows.ccol.get("zeros", -1),
        }
        self._tables: dict[tuple, tuple[torch.Tensor, int, int] | None] = {}
        self._scratch: dict[Any, torch.Tensor] = {}
        self._eps_by_dtype: dict[torch.dtype, float] = {}

    def groups(self, tensors: Sequence[torch.Tensor], rows: list[int]) -> dict[torch.dtype, list[int]]:
        """The indices of the not yet placed tensors the kernel reads, by dtype (first seen first)."""
        groups: dict[torch.dtype, list[int]] = {}
        for k, t in enumerate(tensors):
            # is_contiguous first: ``dense`` (a Python call) only for the rare non-contiguous tensor
            if (
                rows[k] < 0
                and type(t) in PLAIN_TENSORS
                and t.dtype in FLOAT_DTYPES
                and t.numel()
                and (t.is_contiguous() or dense(t))
            ):
                groups.setdefault(t.dtype, []).append(k)
        return groups

    def write(self, tensors: Sequence[torch.Tensor], rows: list[int], pos: int) -> int:
        """Reduce the eligible tensors of ``tensors`` into rows from ``pos`` on; marks them in
        ``rows`` (caller order); returns the next free row."""
        for idx in self.groups(tensors, rows).values():
            self.write_group([tensors[k] for k in idx], pos)
            for j, k in enumerate(idx):
                rows[k] = pos + j
            pos += len(idx)
        return pos

    def write_group(self, group: list[torch.Tensor], pos: int) -> None:
        """One dtype's eligible tensors (``groups``) into rows ``pos..``.  What a replayed plan
        (``DeviceRows.write_planned``) runs every step: for a group with a table, this frame,
        ``_reduce_group``'s and the two launches, whatever the number of tensors (the steps on
        the way are inline: each helper was a frame a group a step)."""
        device = self.rows.device
        # Triton launches on the current device, whatever the tensors' device: make it theirs,
        # by the calls ``torch.cuda.device`` makes (C functions on a CUDA build) without its frames
        previous = torch.cuda._exchange_device(self.rows.device_index) if device.type == "cuda" else -1
        try:
            table: Any = None
            if len(group) >= _MIN_TABLE:
                # C loops (``map`` over C methods): no Python work per tensor, cache hit or not
                key = (group[0].dtype, tuple(map(_DATA_PTR, group)), tuple(map(_NUMEL, group)))
                table = self._tables.get(key, _UNSEEN)
                if table is _UNSEEN:  # new addresses (grads after ``zero_grad``): a new table
                    if len(self._tables) > 256:
                        self._tables.clear()
                    table = _describe(key[1], key[2], group[0].element_size(), self.rows.to_device)
                    self._tables[key] = table
            if table is not None:
                self._reduce_group(group, key[2], table, pos)
            else:
                for j, t in enumerate(group):
                    self._reduce_one(t, pos + j)
        finally:
            if previous >= 0:
                torch.cuda._maybe_exchange_device(previous)

    def drop_scratch(self) -> None:
        self._scratch = {}

    # -- launches ------------------------------------------------------------------------------
    def _reduce_one(self, t: torch.Tensor, row: int) -> None:
        n = t.numel()
        chunk = _chunk_size(n)
        chunks = -(-n // chunk)
        part = self._partials(chunks)
        eps = self._eps(t.dtype)
        k = self.kernels
        _launch(
            k.chunk_partials,
            (chunks,),
            t,
            t,
            part,
            n,
            eps,
            TABLE=False,
            CHUNK=chunk,
            BLOCK=min(_BLOCK, chunk),
            num_warps=_WARPS,
            **self.meta,
        )
        self._rows_launch(part, part, chunks, 0, 1, row, table=False)
        self.rows.numels[row] = n

    def _reduce_group(
        self, tensors: list[torch.Tensor], numels: tuple[int, ...], table: tuple[torch.Tensor, int, int], row: int
    ) -> None:
        packed, chunks, chunk = table
        rows = self.rows
        # ``_partials`` and ``_eps`` inline (a frame each per group and step)
        key = None if rows.device.type == "cpu" else rows.stream_key()
        part = self._scratch.get(key)
        if part is None or part.numel() < chunks * self.width:
            part = self._partials(chunks)
        eps = self._eps_by_dtype.get(tensors[0].dtype)
        if eps is None:
            eps = self._eps(tensors[0].dtype)
        k = self.kernels
        _launch(
            k.chunk_partials,
            (chunks,),
            tensors[0],
            packed,
            part,
            0,
            eps,
            TABLE=True,
            CHUNK=chunk,
            BLOCK=min(_BLOCK, chunk),
            num_warps=_WARPS,
            **self.meta,
        )
        first = packed[2 * chunks :]
        n = len(tensors)
        done = 0
        while done < n:  # one rows launch per chunk of the row buffer it writes into
            done += self._rows_launch(part, first, chunks, done, n - done, row + done, table=True)
        rows.numels[row : row + n] = numels

    def _rows_launch(
        self, part: torch.Tensor, first: torch.Tensor, chunks: int, first_tensor: int, n: int, row: int, *, table: bool
    ) -> int:
        """Combine the chunks of ``n`` tensors (from ``first_tensor`` on) into rows ``row..``, as
        many as fit in that row's chunk of the row buffer; returns how many."""
        rows = self.rows
        c, r = divmod(row, rows.capacity)
        chunk = rows.chunks[c] if c < len(rows.chunks) else rows._chunk(row)[0]  # ``_chunk``, a frame less
        n = min(n, rows.capacity - r)
        values = chunk.values[r:]
        counts = chunk.counts[r:] if chunk.counts is not None else values
        _launch(
            self.kernels.tensor_rows,
            (n,),
            part,
            first,
            chunks,
            first_tensor,
            values,
            values.stride(0),
            counts,
            counts.stride(0),
            TABLE=table,
            BLOCK=_ROWS_BLOCK,
            **self.row_meta,
        )
        return n

    def _eps(self, dtype: torch.dtype) -> float:
        eps = self._eps_by_dtype[dtype] = self.rows._eps_in(dtype) if "zeros" in self.rows.ccol else 0.0
        return eps

    # -- buffers -------------------------------------------------------------------------------
    def _partials(self, chunks: int) -> torch.Tensor:
        """``[chunks * width]`` float32 scratch of the current stream: grown by doubling, reused by
        every launch (kernels on one stream run in order) and from step to step (``_MAX_CHUNKS``
        rows of partials at most, 2-4 MiB: allocating it again each step was a frame and an
        allocation a step); dropped by ``DeviceRows.clear``."""
        key = self.rows.stream_key()
        need = chunks * self.width
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < need:
            size = max(1024, 1 << (need - 1).bit_length(), 2 * buf.numel() if buf is not None else 0)
            buf = self._scratch[key] = torch.empty(size, dtype=torch.float32, device=self.rows.device)
        return buf


def _describe(
    addresses: Sequence[int],
    numels: Sequence[int],
    itemsize: int,
    to_device: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, int, int] | None:
    """The packed descriptors of tensors at ``addresses`` of ``numels`` elements, on the device.
    Built with numpy: a group's grads get new addresses every step when ``zero_grad`` frees them,
    and a Python loop over a 100M-parameter model's ~26k chunks cost ~8 ms a step (measured on an
    H200)."""
    # ndarray methods and ufuncs only: numpy's module functions (stack, repeat, cumsum, any) are
    # Python wrappers, a dozen frames a table
    delta = np.array(addresses, dtype=np.int64)
    delta -= delta[0]
    if np.logical_or.reduce(delta % itemsize != 0):
        return None
    offsets = delta // itemsize
    sizes = np.array(numels, dtype=np.int64)
    chunk = _chunk_size(int(np.add.reduce(sizes)))
    per_tensor = -(-sizes // chunk)
    n, chunks = len(offsets), int(np.add.reduce(per_tensor))
    packed = np.empty(2 * chunks + n + 1, dtype=np.int64)  # (start, length) per chunk, then ``first``
    first = packed[2 * chunks :]
    first[0] = 0
    per_tensor.cumsum(out=first[1:])
    owner = np.arange(n).repeat(per_tensor)
    at = (np.arange(chunks, dtype=np.int64) - first[owner]) * chunk  # element offset in its tensor
    packed[0 : 2 * chunks : 2] = offsets[owner] + at
    packed[1 : 2 * chunks : 2] = np.minimum(sizes[owner] - at, chunk)
    return to_device(torch.from_numpy(packed)), chunks, chunk
