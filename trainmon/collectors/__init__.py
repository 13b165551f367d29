"""Collectors: one module per kind of training data (see ``base``)."""
from trainmon.collectors.base import Collector, CollectorContext, collector_classes, register_collector
from trainmon.collectors import (activations, comm, optimizer_state, params,  # noqa: F401  (registration)
                                 structure, weight_grads)

__all__ = ["Collector", "CollectorContext", "collector_classes", "register_collector"]
