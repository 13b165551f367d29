"""The ``trainmon`` console script: one subcommand per module of this package.

A command module defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``
(and ``OWN_LOGGING = True`` if it sets up logging itself; the others print trainmon's warnings
as plain stderr lines).
Modules are discovered, so adding a command is adding a file.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

__all__ = ["main", "CommandError"]


class CommandError(Exception):
    """A user error in a command (bad path, bad option): printed as one line, exit code 2."""


def _command_modules():
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if not info.name.startswith("_"):
            yield info.name, importlib.import_module(f"{__name__}.{info.name}")


def build_parser() -> argparse.ArgumentParser:
    from trainmon import __version__

    parser = argparse.ArgumentParser(prog="trainmon", description="trainmon: training-state monitor tools")
    parser.add_argument("--version", action="version", version=f"trainmon {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module in _command_modules():
        cmd = sub.add_parser(name.replace("_", "-"), help=module.HELP, description=module.HELP)
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run, _own_logging=getattr(module, "OWN_LOGGING", False))
    return parser


def main(argv: list[str] | None = None) -> int:
    from trainmon.errors import TrainmonError

    args = build_parser().parse_args(argv)
    if not args._own_logging:
        _warnings_to_stderr()
    try:
        return int(args._run(args) or 0)
    except (CommandError, TrainmonError) as exc:  # bad input, or a damaged run: one line, exit 2
        print(f"trainmon {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader left (`trainmon anomalies RUN | head`): quiet, as other tools
        _stdout_to_devnull()
        return 141  # 128 + SIGPIPE, the status a shell shows for a tool its pipe's reader left
    except OSError as exc:  # an unreadable folder or file: named, not a traceback
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"trainmon {args.command}: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2


def _stdout_to_devnull() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush at exit does not fail again."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def _warnings_to_stderr() -> None:
    """trainmon's warnings (a cut line left out, ...) as plain lines on stderr, unless the caller
    set up logging itself."""
    import logging

    if not logging.getLogger().handlers and not logging.getLogger("trainmon").handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger = logging.getLogger("trainmon")
        handler.setLevel(logging.WARNING)
        logger.addHandler(handler)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
