"""`fuseloop bench`'s option combinations: a mode runs alone, and an option its mode does not
use is an error rather than silently dropped."""

from __future__ import annotations

import argparse

__all__ = ["check_modes"]

DEFAULT_MEMBERS = 32


def check_modes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exits with a usage error (status 2) for options that do not go together; sets the
    default `--members`.

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> args = argparse.Namespace(population=False, whole_run=False, report=False,
        ...                           zoo=False, members=None, models="mlp-tiny")
        >>> check_modes(parser, args); args.members
        32
    """
    modes = [
        name
        for name, chosen in (
            ("--population", args.population),
            ("--whole-run", args.whole_run),
            ("--report", args.report),
        )
        if chosen
    ]
    if len(modes) > 1:
        parser.error(f"{' and '.join(modes)} are separate benchmarks: choose one")
    if args.zoo and (args.population or args.whole_run):
        parser.error(f"--zoo does not apply to {modes[0]}")
    if args.whole_run and args.models is not None:
        parser.error("--models does not apply to --whole-run (its workload is fixed)")
    for option, given in (
        ("--plot", getattr(args, "plot", None) is not None),
        ("--no-peers", getattr(args, "no_peers", False)),
    ):
        if given and modes:  # the figure and the peers are the main benchmark's
            parser.error(f"{option} does not apply to {modes[0]}")
    if args.members is not None and not args.population:
        parser.error("--members applies only with --population")
    if args.models is not None and not [m for m in args.models.split(",") if m.strip()]:
        parser.error(f"--models={args.models!r} names no model")
    for option, value in (("--members", args.members), ("--reps", getattr(args, "reps", None))):
        if value is not None and value < 1:
            parser.error(f"{option}={value} must be a positive int")
    if args.members is None:
        args.members = DEFAULT_MEMBERS
