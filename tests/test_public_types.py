"""The public types as a program uses them when it runs (tests/typed_usage.py is the same
for a type checker: CI's mypy checks it)."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import fuseloop as fl


def _public_callables() -> list[tuple[str, object]]:
    found: list[tuple[str, object]] = []
    for module in (fl, fl.models, fl.data, fl.diagnostics):
        for name in module.__all__:
            value = getattr(module, name)
            if inspect.isfunction(value) or inspect.isclass(value):
                found.append((f"{module.__name__}.{name}", value))
            if inspect.isclass(value):
                found += [
                    (f"{module.__name__}.{name}.{attribute}", method)
                    for attribute, method in vars(value).items()
                    if inspect.isfunction(method) and not attribute.startswith("_")
                ]
    return found


def test_every_public_signature_resolves_when_the_program_runs():
    """`typing.get_type_hints` (pydantic, typer, jsonargparse and sphinx read hints so)
    failed on Loop.run ("Literal" not defined) and Loop.handle_event ("Event"): the
    aliases were strings naming what the module imported only for a type checker."""
    callables = _public_callables()
    assert len(callables) > 40
    unresolved = []
    for name, value in callables:
        try:
            typing.get_type_hints(value)
        except Exception as error:  # noqa: BLE001 - collected, reported below
            unresolved.append(f"{name}: {error!r}")
    assert unresolved == []
    assert typing.get_type_hints(fl.Loop.run)["fuse"] == fl.types.Fuse


def test_the_type_aliases_are_typing_objects_a_program_can_combine():
    """`def f(fuse: fl.types.Fuse | None = None)` raised TypeError (str | None) at import."""
    assert set(typing.get_args(fl.types.Fuse)) >= {bool, int}
    assert fl.Event in typing.get_args(fl.types.EventLike)

    @dataclasses.dataclass
    class Config:
        fuse: fl.types.Fuse | None = None
        event: fl.types.EventLike = "epoch_completed"
        result: fl.types.HandlerResult = None
        filter: fl.types.FilterLike = "always"

    hints = typing.get_type_hints(Config)
    assert type(None) in typing.get_args(hints["fuse"])
    assert Config(fuse="run").fuse == "run"
