"""Collectors: one module per kind of training data (see ``base``)."""

from trainmon.collectors import (  # noqa: F401  (registration)  # noqa: F401  (registration)
    activations,
    comm,
    grad_probe,
    hyperparams,
    loss,
    model_input,
    model_meta,
    optimizer_state,
    params,
    structure,
    weight_grads,
)
from trainmon.collectors.base import Collector, CollectorContext, collector_classes, register_collector

__all__ = ["Collector", "CollectorContext", "collector_classes", "register_collector"]
