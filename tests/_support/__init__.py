"""Test helpers (not tests): run readers, a CLI runner, the multi-process harness, framework shims."""
