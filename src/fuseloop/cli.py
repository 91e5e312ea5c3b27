"""The `fuseloop` command: `fuseloop demo` and `fuseloop bench`."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `fuseloop` console script.

    Example:
        >>> main(["demo", "--epochs", "1"])  # doctest: +SKIP
    """
    parser = argparse.ArgumentParser(prog="fuseloop", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train an MLP on scikit-learn's digits")
    demo.add_argument("--epochs", type=int, default=20)
    demo.add_argument("--fuse", default="32", help="chunk size, 'auto', or 'false'")
    demo.add_argument("--plot", default="demo_history.png", help="PNG of the metric curves")
    demo.add_argument("--no-progress", action="store_true")
    commands.add_parser("bench", help="benchmark fused vs unfused vs peers", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        from .bench import main as bench_main

        return bench_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    from ._demo import demo as run_demo

    return run_demo(epochs=args.epochs, fuse=args.fuse, plot=args.plot,
                    progress=not args.no_progress)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
