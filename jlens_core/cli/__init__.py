"""The ``jlens`` command line: ``main`` (the parser and error handling) and one module per subcommand
(``fit``, ``eval``, ``dump``, ``app``). The top of the dependency order: it may import any subpackage.
"""

from .main import CLIError, build_parser, main

__all__ = ["CLIError", "build_parser", "main"]
