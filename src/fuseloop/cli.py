"""The `fuseloop` command: `fuseloop demo`, `fuseloop bench` and `fuseloop launch`."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

from ._distributed import DEFAULT_FAILURE_TIMEOUT

__all__ = ["main"]


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("fuseloop")
    except metadata.PackageNotFoundError:  # running from a source tree without install
        from . import __version__

        return __version__


def _positive_int(text: str) -> int:
    """An argparse type: an int >= 1 (a usage error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _fuse_option(text: str) -> str:
    """An argparse type: a `--fuse` value `parse_fuse` accepts, kept as written."""
    from ._demo import parse_fuse

    try:
        parse_fuse(text)
    except ValueError as error:
        # argparse names the option itself: "argument --fuse: '-3': use ..."
        raise argparse.ArgumentTypeError(str(error).removeprefix("--fuse=")) from None
    return text


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fuseloop", description=__doc__)
    parser.add_argument("--version", action="version", version=f"fuseloop {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="train an MLP on scikit-learn's digits",
        description="Trains an MLP on scikit-learn's digits and reports its held-out accuracy; "
        "exits 1 when that is below 0.9 (a smoke check: the default 20 epochs reach about "
        "0.98, a few epochs may not), 130 (143) when Ctrl-C (SIGTERM) stops it.",
    )
    demo.add_argument(
        "--epochs", type=_positive_int, default=20, help="epochs to train (default: 20)"
    )
    demo.add_argument(
        "--fuse",
        type=_fuse_option,
        default="32",
        help="a positive chunk size, 'auto', 'true' (chunks of 32) or 'false' (unfused); "
        "default: 32",
    )
    demo.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="PNG of the metric curves (default: <temp dir>/fuseloop-demo/"
        "history.png; the path is printed)",
    )
    demo.add_argument("--no-plot", action="store_true", help="write no plot")
    demo.add_argument("--no-progress", action="store_true", help="show no progress bar")
    demo.set_defaults(subparser=demo)  # its own usage in its errors
    commands.add_parser("bench", help="benchmark fused vs unfused vs peers", add_help=False)
    _add_launch(commands)
    return parser


def _add_launch(commands: Any) -> None:
    """The `launch` command's parser."""
    launch = commands.add_parser(
        "launch",
        help="run a script in N local processes under jax.distributed",
        description="Starts N local processes of `python script.py [args]` with the "
        "coordinator address, process ids and CPU collectives set; "
        "`import fuseloop` initialises jax.distributed in each.",
        # The script's arguments are whatever follows it; argparse's own usage would list
        # them as a required argument of their own.
        usage="fuseloop launch [-h] -n NPROCS [--port PORT] [--failure-timeout SECONDS]\n"
        "                       [--grace SECONDS] script [args ...]",
    )
    launch.add_argument("-n", "--nprocs", type=int, required=True, help="the number of processes")
    launch.add_argument(
        "--port", type=int, default=None, help="coordinator port on 127.0.0.1 (default: a free one)"
    )
    launch.add_argument(
        "--failure-timeout",
        type=int,
        default=None,
        metavar="SECONDS",
        help="seconds after which jax reports an unresponsive process "
        f"(default: {DEFAULT_FAILURE_TIMEOUT})",
    )
    launch.add_argument(
        "--grace",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="seconds between SIGTERM and SIGKILL when stopping the other "
        "processes after one failed (default: 5)",
    )
    # One REMAINDER for the script and its arguments: a `script` positional of its own
    # swallowed a `--` that followed it (`launch -n 2 train.py -- -5` ran `train.py -5`).
    launch.add_argument(
        "script_and_args",
        nargs=argparse.REMAINDER,
        metavar="script [args ...]",
        help="the Python script to run, then its own arguments, passed as they are",
    )
    launch.set_defaults(subparser=launch)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `fuseloop` console script.

    Example:
        >>> main(["demo", "--epochs", "1", "--no-plot", "--no-progress"])
        fuseloop demo: digits, 1437 train / 360 held-out examples, MLP 64-128-10, 1 epoch, fuse=32
        Epoch 1/1 - loss: ...
        final validation accuracy: ...
        exit status 1: the validation accuracy is below the demo's bar of 0.9
        1
    """
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        from .bench import main as bench_main

        try:
            return bench_main(rest)
        except KeyboardInterrupt as stop:
            print(f"fuseloop bench: interrupted ({stop})", file=sys.stderr)
            return 130
    parser = args.subparser  # errors show the command's own usage from here on
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "launch":
        return _launch(parser, args)
    from ._demo import demo as run_demo

    if args.no_plot and args.plot is not None:
        parser.error("--plot and --no-plot: choose one")
    if args.plot == "":
        parser.error("--plot: give a file path, or --no-plot for no figure")
    plot = False if args.no_plot else (args.plot or True)
    if isinstance(plot, str):
        from .bench._output import unplottable, unwritable

        why = unwritable(os.path.expanduser(plot)) or unplottable(plot)
        if why is not None:  # before training, not after it
            parser.error(f"--plot {plot}: {why}")
    try:
        return run_demo(
            epochs=args.epochs, fuse=args.fuse, plot=plot, progress=not args.no_progress
        )
    except KeyboardInterrupt as stop:  # before the run (data, first compile) or a second signal
        print(f"fuseloop demo: interrupted ({str(stop) or 'SIGINT'})", file=sys.stderr)
        return 143 if "SIGTERM" in str(stop) else 130


def _launch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from ._launch import launch

    command = list(args.script_and_args)
    if command[:1] == ["--"]:  # `launch -n 2 -- train.py`: the usual end of options
        command = command[1:]
    if not command:
        parser.error("the following arguments are required: script")
    script, script_args = command[0], command[1:]
    options = {} if args.failure_timeout is None else {"failure_timeout": args.failure_timeout}
    try:
        return launch(args.nprocs, script, script_args, port=args.port, grace=args.grace, **options)
    except KeyboardInterrupt:  # the processes were stopped (`_launch.launch`)
        print("[launch] interrupted: the processes were stopped", file=sys.stderr)
        return 130
    except ValueError as err:
        parser.error(_LAUNCH_NAMES.sub(lambda m: _LAUNCH_OPTIONS[m.group(1)] + " ", str(err)))
        return 2  # pragma: no cover - parser.error exits


# `launch`'s own argument names, as its options are spelt on the command line.
_LAUNCH_OPTIONS = {
    "count": "-n/--nprocs",
    "failure_timeout": "--failure-timeout",
    "grace": "--grace",
    "port": "--port",
    "script": "script",
}
_LAUNCH_NAMES = re.compile(r"\b(" + "|".join(_LAUNCH_OPTIONS) + r")=")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
