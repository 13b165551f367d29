"""Statistics: the table of stats (``table``) and the batched engine (``engine``)."""
