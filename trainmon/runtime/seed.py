"""``seed_all``: make two runs comparable (the loss-alignment workflow starts here)."""

from __future__ import annotations

import functools
import os
import random

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["seed_all"]

_DROPOUT_FNS = ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout")


def seed_all(seed: int = 1234, mode: bool = False, rm_dropout: bool = True) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device), set PYTHONHASHSEED and cuDNN flags.

    Args:
        mode: also ``torch.use_deterministic_algorithms(True)`` (sets ``CUBLAS_WORKSPACE_CONFIG``).
        rm_dropout: make dropout a no-op process-wide (``torch.nn.functional`` dropouts and the
            ``dropout_p`` of ``scaled_dot_product_attention``), so two runs differ only where
            the code does.
    """
    os.environ["PYTHONHASHSEED"] = str(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    if mode:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if rm_dropout:
        _remove_dropout()


def _remove_dropout() -> None:
    for name in _DROPOUT_FNS:
        fn = getattr(F, name, None)
        if fn is not None and not getattr(fn, "_trainmon_no_dropout", False):
            setattr(F, name, _without_p(fn))
    sdpa = F.scaled_dot_product_attention
    if not getattr(sdpa, "_trainmon_no_dropout", False):

        @functools.wraps(sdpa)
        def no_dropout_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, *args, **kwargs):
            return sdpa(query, key, value, attn_mask, 0.0, *args, **kwargs)

        no_dropout_sdpa._trainmon_no_dropout = True  # type: ignore[attr-defined]
        F.scaled_dot_product_attention = no_dropout_sdpa


def _without_p(fn):
    @functools.wraps(fn)
    def no_dropout(input, p=0.5, training=True, inplace=False, *args, **kwargs):
        return fn(input, 0.0, training, inplace, *args, **kwargs)

    no_dropout._trainmon_no_dropout = True  # type: ignore[attr-defined]
    return no_dropout
