"""The on-disk contract (torch-free): run/rank dirs, family file names, TensorBoard tags, reading runs."""
