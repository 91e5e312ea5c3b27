"""How a save names module-level objects (node types, functions, dtypes' types) and how
a load finds them again: by `module:qualname`, among the modules already imported, never
importing one (`_json_tree`)."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["is_named", "lookup", "name_of", "type_name"]


def name_of(obj: Any) -> str:
    return f"{obj.__module__}:{obj.__qualname__}"


def lookup(name: Any, where: str) -> Any:
    """The object called `module:qualname` in an already imported module (never imports)."""
    if not isinstance(name, str) or ":" not in name:
        raise ValueError(f"{where}: {name!r} is not a 'module:name' reference")
    module_name, qualname = name.split(":", 1)
    obj = sys.modules.get(module_name)
    if obj is None:
        raise ValueError(
            f"{where}: the save refers to {name!r}, but module {module_name!r} is not "
            f"imported; fuseloop never imports a module named by a save. Import it before "
            f"load_state"
        )
    for part in qualname.split("."):
        if part.startswith("__") or not hasattr(obj, part):
            home = f"module {module_name!r}"
            if module_name == "__main__":  # the saving script's own type
                home = "the script that loads it (it was the saving script's own)"
            raise ValueError(
                f"{where}: {name!r} does not name an object: define or import {qualname} "
                f"in {home} before load_state"
            )
        obj = getattr(obj, part)
    return obj


def type_name(cls: type, where: str) -> str:
    """`cls`'s name in a save, refused where no load could find the type by it (a type
    defined inside a function): a save it could not load would be found out too late."""
    try:
        lookup(name_of(cls), where)
    except ValueError:
        raise ValueError(
            f"{where}={cls.__qualname__}: a save names each node's type to rebuild it on "
            f"load, and no load could find {name_of(cls)!r} by that name: define "
            f"{cls.__name__} at a module's top level (a type defined inside a function has "
            f"no such name; one a helper makes needs its __module__ and __qualname__ set "
            f"to where it is found)"
        ) from None
    return name_of(cls)


def is_named(value: Any) -> bool:
    try:
        return lookup(name_of(value), "") is value
    except (AttributeError, ValueError):
        return False
