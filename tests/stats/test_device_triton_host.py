"""The host side of the Triton path, without Triton: the chunk descriptors of a group (built with
numpy) tile every tensor exactly, and the launch cache's specialization key separates what Triton
compiles separately (dtype, device, 16-byte alignment; ints equal to 1, multiples of 16, wider
than 32 bits)."""

from __future__ import annotations

import random
import sys

import pytest
import torch

from trainmon.stats import device_triton


def _tiles(desc: list[int], n_tensors: int, chunks: int) -> list[list[tuple[int, int]]]:
    pairs, first = desc[: 2 * chunks], desc[2 * chunks :]
    assert len(first) == n_tensors + 1 and first[0] == 0 and first[-1] == chunks
    return [[(pairs[2 * c], pairs[2 * c + 1]) for c in range(first[i], first[i + 1])] for i in range(n_tensors)]


def test_a_groups_descriptors_cover_each_tensor_once_in_chunks_of_at_most_the_chunk_size():
    rng = random.Random(0)
    for _ in range(200):
        spans = [
            (rng.randint(0, 1 << 30) * 2, rng.choice([1, 4095, 4096, 4097, rng.randint(1, 3_000_000)]))
            for _ in range(rng.randint(1, 30))
        ]
        packed, chunks, chunk = device_triton._describe([p for p, _ in spans], [n for _, n in spans], 2, lambda t: t)
        base = spans[0][0]
        for (ptr, n), tiles in zip(spans, _tiles(packed.tolist(), len(spans), chunks)):
            start = (ptr - base) // 2
            assert [s for s, _ in tiles] == list(range(start, start + n, chunk))  # in order, no gap
            assert sum(m for _, m in tiles) == n and all(0 < m <= chunk for _, m in tiles)


def test_a_group_whose_addresses_are_not_whole_elements_apart_gets_no_table():
    assert device_triton._describe([0, 6], [10, 10], 4, lambda t: t) is None


def test_the_launch_cache_key_separates_what_triton_compiles_separately():
    key = device_triton._specialization
    buf = torch.zeros(64)
    assert key([buf, 5, 0.5]) == key([torch.ones(3), 7, 1.5])
    assert key([buf]) != key([buf[1:]])  # 4 bytes off 16-byte alignment
    assert key([buf]) != key([buf.double()]) != key([buf.bfloat16()])
    assert key([1]) != key([2]) and key([16]) != key([17]) and key([2**31 + 16]) != key([16])
    assert key([True]) != key([1])


def test_the_launch_cache_passes_constexprs_as_the_installed_triton_launches_do(monkeypatch):
    # Triton 3.0-3.2 launch a compiled kernel with the non-constexpr arguments only, 3.3 on with all
    # of them; another major version's convention is unknown, so it takes Triton's own launch.
    triton = pytest.importorskip("triton")
    for version, want in (("3.2.0", False), ("3.3.1", True), ("3.9.0", True), ("4.0.0", None), ("dev", None)):
        monkeypatch.setattr(triton, "__version__", version)
        device_triton._constexprs_passed.cache_clear()
        assert device_triton._constexprs_passed() is want, version
    device_triton._constexprs_passed.cache_clear()


def _triton_write_frames(n: int, monkeypatch) -> tuple[int, list[str]]:
    """Python frames of one ``DeviceRows.write`` of ``n`` tiny tensors through the Triton route's
    host side, the launches recorded instead of run (the interpreter would run them)."""
    pytest.importorskip("triton")
    from trainmon.stats.device_rows import DeviceRows

    launched: list[str] = []
    monkeypatch.setattr(device_triton, "_launch", lambda kernel, grid, *a, **m: launched.append(kernel.__name__))
    rows = DeviceRows(torch.device("cpu"), ["count", "sum", "sumsq", "min", "max", "nans"], 1e-8)
    rows._triton = device_triton.TritonRows(rows)
    tensors = [torch.randn(4, 4) if k % 2 else torch.randn(4) for k in range(n)]
    rows.write(tensors)  # first sight: the group's descriptor table
    rows.clear()
    launched.clear()
    calls = 0

    def profile(_frame, event, _arg):
        nonlocal calls
        calls += event == "call"

    sys.setprofile(profile)
    try:
        rows.write(tensors)
    finally:
        sys.setprofile(None)
    return calls, launched


def test_the_triton_routes_host_side_takes_the_same_python_frames_for_64_or_512_tensors(monkeypatch):
    calls64, launched64 = _triton_write_frames(64, monkeypatch)
    calls512, launched512 = _triton_write_frames(512, monkeypatch)
    assert launched64 == launched512 == ["chunk_partials", "tensor_rows"]
    assert calls64 == calls512 <= 40
