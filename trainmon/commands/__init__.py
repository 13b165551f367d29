"""Subcommands of the ``trainmon`` console script (see ``trainmon.cli``)."""
