"""Collectors: one module per kind of training data (see ``base``)."""
from trainmon.collectors.base import Collector, CollectorContext, collector_classes, register_collector
from trainmon.collectors import comm, optimizer_state, params, weight_grads  # noqa: F401  (registration)

__all__ = ["Collector", "CollectorContext", "collector_classes", "register_collector"]
