from __future__ import annotations

import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from trainmon import seed_all


def draw():
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_seed_all_makes_draws_repeatable_and_removes_dropout(monkeypatch):
    saved = {name: getattr(F, name) for name in ("dropout", "dropout1d", "dropout2d", "dropout3d",
                                                   "alpha_dropout", "feature_alpha_dropout",
                                                   "scaled_dot_product_attention")}
    for name, fn in saved.items():
        monkeypatch.setattr(F, name, fn)  # restored after the test: seed_all patches process-wide
    seed_all(7, rm_dropout=True)
    first = draw()
    seed_all(7)
    assert draw() == first
    x = torch.ones(1000)
    assert torch.equal(nn.Dropout(0.5).train()(x), x)
    q = torch.randn(1, 2, 4, 8)
    with_p = F.scaled_dot_product_attention(q, q, q, dropout_p=0.9)
    assert torch.allclose(with_p, saved["scaled_dot_product_attention"](q, q, q))
    import os
    assert os.environ["PYTHONHASHSEED"] == "7" and torch.backends.cudnn.deterministic


def test_seed_all_mode_turns_on_deterministic_algorithms():
    try:
        seed_all(1, mode=True, rm_dropout=False)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
