"""Error handling shared by the diagnostics CLIs (``dapo-report``, ``dapo-tune``, ``dapo-profile``).

An error ends the command with one line ``PROG: message`` and exit status 1; the message names the
file (and line) the readers found the problem in. ``--debug`` lets the exception through instead,
with its traceback.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, TypeVar

T = TypeVar("T")


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true", help="on an error, show the full traceback")


def run(prog: str, debug: bool, fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)``; an exception becomes ``sys.exit("PROG: ...")`` unless ``debug``.

    ValueError / ImportError carry a message written for the user (the file and line, the package to
    install); any other exception is shown with its type and a pointer to ``--debug``."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        if debug:
            raise
        if isinstance(e, (ValueError, ImportError)):
            sys.exit(f"{prog}: {e}")
        sys.exit(f"{prog}: {type(e).__name__}: {e} (--debug shows the traceback)")
