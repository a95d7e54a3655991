"""The rich consoles the CLI prints through.

Without a terminal (a pipe, a log file, CI) rich wraps at 80 columns and squeezes tables into
columns one character wide; there the console is wide instead, so logs keep whole lines and
tables stay readable. A terminal, or an explicit COLUMNS, keeps rich's own choice.
"""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console

from . import env

# Wide enough for the registry and profile tables; a log file does not wrap.
WIDTH_WITHOUT_TERMINAL = 200


def make_console(*, stderr: bool = False, **kwargs: Any) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    isatty = getattr(stream, "isatty", None)
    terminal = bool(isatty and isatty())
    width = None if terminal or env.terminal_columns() else WIDTH_WITHOUT_TERMINAL
    return Console(stderr=stderr, width=width, **kwargs)
