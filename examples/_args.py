"""The examples' integer options: a bad value is refused by the command line with its usage,
not met later as a traceback. Not an example of its own (Python finds it beside the script
it runs).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse `type` accepting integers from `minimum` up."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
        return value

    return parse
