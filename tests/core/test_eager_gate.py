"""``core.hooks.eager_gate``: the one-frame gate of the activation hooks does in eager mode what
``Guard.gated`` does (run while collecting, nothing after a failure) and hands compiled runs to
the general gate."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from trainmon.core.hooks import eager_gate


def _gate(calls, general_calls, errors, clock, failed):
    def fn(x):
        calls.append(x)
        if x == "boom":
            raise ValueError(x)
        return x * 2

    def general(x):
        general_calls.append(x)

    return eager_gate(fn, general, clock, failed, "activations", lambda: errors.append(sys.exc_info()[0]))


def test_runs_while_collecting_and_not_failed():
    calls, general, errors, failed = [], [], [], set()
    clock = SimpleNamespace(collecting=True)
    hook = _gate(calls, general, errors, clock, failed)
    assert hook(2) == 4
    clock.collecting = False
    assert hook(3) is None  # not a collected step: fn not called
    clock.collecting = True
    failed.add("activations")
    assert hook(5) is None  # switched off after a failure
    assert calls == [2] and general == [] and errors == []


def test_a_failure_is_reported_not_raised():
    calls, general, errors = [], [], []
    hook = _gate(calls, general, errors, SimpleNamespace(collecting=True), set())
    assert hook("boom") is None
    assert errors == [ValueError]


def test_dynamo_never_inlines_it_and_compiled_runs_take_the_general_gate():
    calls, general, errors = [], [], []
    hook = _gate(calls, general, errors, SimpleNamespace(collecting=True), set())
    assert hook._torchdynamo_disable is True  # what torch.compiler.disable marks


@pytest.mark.slow
def test_called_from_compiled_code_it_goes_to_the_general_gate():
    calls, general, errors = [], [], []
    hook = _gate(calls, general, errors, SimpleNamespace(collecting=True), set())

    @torch.compile(backend="eager")
    def f(x):
        hook(7)
        return x + 1

    assert torch.equal(f(torch.ones(2)), torch.full((2,), 2.0))
    assert 7 in general and 7 not in calls
