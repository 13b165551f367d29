"""Collectors: one module per kind of training data (see ``base``)."""
from trainmon.collectors.base import Collector, CollectorContext, collector_classes, register_collector
from trainmon.collectors import (activations, comm, optimizer_state, params,  # noqa: F401  (registration)
                                 structure, weight_grads)
from trainmon.collectors import grad_probe, hyperparams, loss, model_input, model_meta  # noqa: F401  (registration)

__all__ = ["Collector", "CollectorContext", "collector_classes", "register_collector"]
