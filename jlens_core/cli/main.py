"""The ``jlens`` command line: ``jlens fit | merge | tune | weigh | eval | study | inspect | intervene | say | dump | diff | check | export | app``.

Each subcommand lives in its own module with ``register(subparsers)``, which adds its parser and
sets ``func``; a module whose docstring opens with the command's description passes it through
:func:`command_description`. Bad input raises :class:`CLIError` (or ``ValueError`` / ``FileNotFoundError``) and is
shown as one sentence; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from .._extras import MissingExtraError
from .._version import __version__

log = logging.getLogger("jlens")

SUBCOMMAND_MODULES = ("fit", "tune", "weigh", "eval", "study", "inspect", "intervene", "say", "jspace", "dump", "check",
                      "export", "experiment", "app")


class CLIError(Exception):
    """A user error: printed as one sentence, exit code 2."""


def say(message: str) -> None:
    """Progress of slow one-off steps (the default model's first conversion), on stderr."""
    print(f"jlens: {message}", file=sys.stderr, flush=True)


def command_description(module_doc: str | None) -> str:
    """The first paragraph of a subcommand module's docstring: the command's ``--help`` description, written
    once (argparse refolds its lines)."""
    return (module_doc or "").strip().split("\n\n")[0]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jlens", description="Fit, inspect and evaluate Jacobian lenses.")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--version", action="version", version=f"jlens {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(f"jlens_core.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"jlens_core.cli.{name}":
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("jlens: interrupted.", file=sys.stderr)
        return 130
    except (CLIError, MissingExtraError, ValueError, FileNotFoundError, KeyError, OSError) as exc:
        if args.debug:
            raise
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        print(f"jlens {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
