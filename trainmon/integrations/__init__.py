"""Framework integrations (see ``base``).  Stack-specific modules are imported here lazily-safe:
each one only registers itself, and imports its framework inside ``detect``."""

from trainmon.integrations import deepspeed, fsdp1, fsdp2, megatron, torch_ddp  # noqa: F401  (registration)
from trainmon.integrations.base import Integration, View, register_integration, select_integration

__all__ = ["Integration", "View", "register_integration", "select_integration"]
