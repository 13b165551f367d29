"""Runs the engine tests share: Parquet copies and a run with every edge the readers know."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def pq_dir(tmp_path_factory) -> Path:
    """Where ``edge_rows.as_parquet`` puts the Parquet copies of runs (once per test session)."""
    return tmp_path_factory.mktemp("engine_pq")


@pytest.fixture(scope="session")
def edge_run(tmp_path_factory) -> Path:
    """Micro-steps, a NaN, repeated names in a step (comm calls), header variants, quoted names."""
    from tests._support.edge_rows import edge_rows
    from tests._support.simulate import nan_input, simulate

    run = simulate(tmp_path_factory.mktemp("edge") / "run", steps=9, micro=2, fault=nan_input)
    edge_rows(run / "rank0")
    return run


@pytest.fixture(scope="session", autouse=True)
def _simulation_warmed() -> None:
    """The first simulated run of a test process pays ~1.5 s of one-time warm-up (torch's first
    models, optimizers and backward passes) and the first staging imports DuckDB and pyarrow:
    paid here, once per process, not by whichever test happens to come first (the fast tier's
    3 s limit times the test's own call)."""
    import duckdb  # noqa: F401
    import pyarrow  # noqa: F401

    from tests._support.simulate import named_run

    named_run("healthy")
