"""Collectors: one module per kind of training data (see ``base``)."""
from trainmon.collectors.base import Collector, CollectorContext, collector_classes, register_collector
from trainmon.collectors import (activations, optimizer_state, params, structure,  # noqa: F401  (registration)
                                 weight_grads)

__all__ = ["Collector", "CollectorContext", "collector_classes", "register_collector"]
