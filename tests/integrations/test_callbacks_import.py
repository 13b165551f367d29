"""The framework callbacks' modules without their framework: one clear ImportError, nothing else."""
from __future__ import annotations

import importlib
import re
import sys

import pytest


@pytest.mark.parametrize("module,frameworks,extra", [
    ("trainmon.integrations.hf", ("transformers",), "trainmon[hf]"),
    ("trainmon.integrations.lightning", ("lightning", "lightning.pytorch", "lightning.pytorch.callbacks",
                                         "pytorch_lightning", "pytorch_lightning.callbacks"), "trainmon[lightning]"),
])
def test_importing_a_callback_module_without_its_framework_names_the_extra_to_install(
        monkeypatch, module, frameworks, extra):
    for name in frameworks:
        monkeypatch.setitem(sys.modules, name, None)   # None in sys.modules: "import name" fails
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError, match=re.escape(f"pip install '{extra}'")) as info:
        importlib.import_module(module)
    assert str(info.value).startswith(f"{module} needs ") and "\n" not in str(info.value)
    monkeypatch.delitem(sys.modules, module, raising=False)   # the real module loads again later
