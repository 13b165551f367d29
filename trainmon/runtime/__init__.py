"""The runtime layer: sessions, their builder, the step drivers (static and dynamic), the run directory."""
