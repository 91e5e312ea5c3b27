"""Values <-> JSON plus a list of arrays: how a save holds Python data without pickle.

What can be encoded:

- `None`, bools, ints, floats (NaN and infinities included) and strings, as JSON;
- lists, tuples, and dicts whose keys are strings or ints;
- numpy arrays and scalars, jax arrays and typed PRNG keys: stored in the array list, the
  JSON holds their index (and `"weak": true` for a weakly typed jax array, such as a Python
  float a run put on the device: rebuilt weak, it promotes as it did before the save);
- pytree nodes of types the program has already imported: NamedTuples (optax states),
  dataclass pytrees (equinox modules, flax struct dataclasses) and other registered nodes
  whose node data is itself encodable;
- module-level functions (an equinox MLP's activation) and types (a model's dtype field,
  `jnp.float32`), by module and name; numpy dtypes by name.

Decoding never imports a module and never unpickles: a type or function is looked up among
the modules the program has already imported, and a type is rebuilt only if jax knows it as
a pytree node (or it is a dataclass pytree). Anything else raises ValueError.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import PyTreeDef, default_registry

from ._json_names import is_named, lookup, name_of, type_name
from ._prng_keys import holds_typed_keys, is_typed_keys, raw_keys

__all__ = ["as_weak", "decode", "encode", "is_weak"]

_SCALARS = (bool, int, float, str)


# ----------------------------------------------------------------- encode
def encode(value: Any, arrays: list[Any], where: str = "value") -> Any:
    """Returns the JSON form of `value`, appending its arrays to `arrays`.

    Raises:
        ValueError: naming `where` (the path to the value) for anything not encodable.

    Example:
        >>> arrays = []
        >>> encode({"a": (1, 2.5), "b": [None, "x"]}, arrays)
        {'dict': [['a', {'tuple': [1, 2.5]}], ['b', [None, 'x']]]}
    """
    if value is None or type(value) in _SCALARS:
        return value
    if type(value) is list:
        return [encode(v, arrays, f"{where}[{i}]") for i, v in enumerate(value)]
    if type(value) is tuple:
        return {"tuple": [encode(v, arrays, f"{where}[{i}]") for i, v in enumerate(value)]}
    if type(value) is dict:
        return {
            "dict": [
                [_key(k, where), encode(v, arrays, f"{where}[{k!r}]")] for k, v in value.items()
            ]
        }
    array = _encode_array(value, arrays)
    if array is not None:
        _require_storable(value, where)
        return array
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and _is_node(value):
        return {
            "dataclass": type_name(type(value), where),
            "fields": [
                [f.name, _encode_field(value, f, arrays, where)]
                for f in dataclasses.fields(value)
                if _holds(value, f.name)
            ],
        }
    if _is_node(value):
        return _encode_node(value, arrays, where)
    if isinstance(value, np.dtype):
        return {"dtype": value.name}
    if isinstance(value, type) and is_named(value):
        return {"type": name_of(value)}  # a model's dtype field: jnp.float32, np.float32
    if callable(value) and is_named(value):
        return {"function": name_of(value)}
    raise ValueError(
        f"{where}={type(value).__name__} cannot be saved without pickle: a save holds "
        f"numbers, strings, bools, None, lists, tuples, dicts with str/int keys, numpy/jax "
        f"arrays, pytree nodes (NamedTuples, dataclass pytrees), dtypes and module-level "
        f"functions and types. " + _fix_for(value)
    )


def _encode_field(value: Any, field: dataclasses.Field[Any], arrays: list[Any], where: str) -> Any:
    """A dataclass pytree's field, encoded. Closures in a flax struct's static field
    (TrainState's apply_fn and optax's tx) are refused with the fix that works."""
    held = getattr(value, field.name)
    try:
        return encode(held, arrays, f"{where}.{field.name}")
    except ValueError:
        if field.metadata.get("pytree_node", True) or not _closures_in(held):
            raise
        raise ValueError(
            f"{where}.{field.name}: a static field of {type(value).__name__} holding a "
            f"function (as flax's TrainState keeps apply_fn and tx), which a save cannot hold."
            f" Keep the arrays as the step state, {{'params': ts.params, 'opt_state': "
            f"ts.opt_state, 'step': ts.step}}, and let the step close over the functions"
        ) from None


def _closures_in(held: Any) -> bool:
    try:  # a tree jax cannot flatten: its own refusal stands
        return any(callable(a) and not is_named(a) for a in jax.tree.leaves(held))
    except Exception:
        return False


def _fix_for(value: Any) -> str:
    if not callable(value):
        return "Convert it (e.g. to a dict of those) before saving"
    return (
        "A lambda, a nested function or a functools.partial has no name to import it by: "
        "define it with def at a module's top level (for a partial, a function calling "
        "the other with those arguments), e.g. in a model's activation field"
    )


def _holds(value: Any, name: str) -> bool:
    """Whether the dataclass `value` holds field `name` itself: a field its __init__ left
    unset reads its class default, but a pytree (equinox's) records it as missing, so it
    must come back missing."""
    own = getattr(value, "__dict__", None)
    return name in own if own is not None else hasattr(value, name)


def _key(key: Any, where: str) -> Any:
    if type(key) in (str, int):
        return key
    raise ValueError(
        f"{where} has the key {key!r} ({type(key).__name__}); a saved dict takes str or int keys"
    )


def _encode_array(value: Any, arrays: list[Any]) -> dict[str, Any] | None:
    is_key = holds_typed_keys(value)
    if isinstance(value, (jax.Array, np.ndarray)) and value.size == 0 and not is_key:
        # orbax writes no array of zero size: its shape and dtype are all there is to keep.
        kind = "jax" if isinstance(value, jax.Array) else "numpy"
        empty = {"empty": kind, "shape": list(value.shape), "dtype": str(value.dtype)}
        return {**empty, "weak": True} if is_weak(value) else empty
    if isinstance(value, jax.Array):
        arrays.append(value)
        if is_key:
            arrays[-1] = raw_keys(value)
            return {"key": len(arrays) - 1, "impl": str(jax.random.key_impl(value))}
        # Only a weak array carries the flag: a save without it (any older one) is strong.
        index = {"jax": len(arrays) - 1}
        return {**index, "weak": True} if is_weak(value) else index
    if isinstance(value, np.ndarray):
        arrays.append(value)
        return {"numpy": len(arrays) - 1}
    if isinstance(value, np.generic):
        arrays.append(np.asarray(value))
        return {"numpy_scalar": len(arrays) - 1}
    return None


def _require_storable(value: Any, where: str) -> None:
    """Raises a ValueError naming the leaf where its dtype is one the checkpoint's array
    store (tensorstore, under orbax) has no type for (uint4, uint2, float8_e4m3): its own
    error names no leaf and leaves a half-written save behind."""
    if is_typed_keys(value.dtype):
        return  # (saved as its uint32 key data)
    dtype = np.dtype(value.dtype)
    if value.size and not _storable(dtype.name):
        raise ValueError(
            f"{where}: a {dtype.name} array, which the save's array store (tensorstore) "
            f"has no type for: cast it to a type it stores before saving (e.g. "
            f"x.astype(jnp.uint8) for uint4 and uint2, float8_e4m3fn for float8_e4m3) and "
            f"back after loading"
        )


@functools.cache
def _storable(name: str) -> bool:
    import tensorstore  # noqa: PLC0415 (orbax's store: imported where a save is made)

    try:
        tensorstore.dtype(name)
    except (ValueError, TypeError):
        return False
    return True


def is_weak(value: Any) -> bool:
    """Whether `value` is a weakly typed jax array (a Python scalar put on the device)."""
    return isinstance(value, jax.Array) and bool(getattr(value, "weak_type", False))


def _one_level(value: Any) -> tuple[list[Any], PyTreeDef]:
    return jax.tree.flatten(value, is_leaf=lambda x: x is not value)


def _is_node(value: Any) -> bool:
    _, treedef = _one_level(value)
    return not (treedef.num_nodes == 1 and treedef.num_leaves == 1)


def _encode_node(value: Any, arrays: list[Any], where: str) -> dict[str, Any]:
    children, treedef = _one_level(value)
    node_type, node_data = treedef.node_data()
    try:
        data = encode(node_data, arrays, f"{where} (node data)")
    except ValueError as err:
        raise ValueError(
            f"{where}={type(value).__name__}: its pytree node data cannot be "
            f"saved without pickle ({err})"
        ) from None
    return {
        "node": type_name(node_type, where),
        "data": data,
        # Its numpy scalars are in the save's arrays (a save without the flag dropped them).
        "data_in_arrays": True,
        "children": [encode(c, arrays, f"{where}/{i}") for i, c in enumerate(children)],
    }


# ----------------------------------------------------------------- decode
def decode(encoded: Any, arrays: list[Any], where: str = "value") -> Any:
    """Rebuilds what `encode` wrote, given the arrays it collected (as numpy arrays).

    Example:
        >>> decode({'dict': [['a', {'tuple': [1, 2.5]}]]}, [])
        {'a': (1, 2.5)}
    """
    if encoded is None or type(encoded) in _SCALARS:
        return encoded
    if type(encoded) is list:
        return [decode(v, arrays, f"{where}[{i}]") for i, v in enumerate(encoded)]
    if type(encoded) is not dict or not encoded:
        raise ValueError(f"{where}: unexpected {type(encoded).__name__} in the save")
    tag = next(iter(encoded))
    decoder = _DECODERS.get(tag)
    if decoder is None:
        raise ValueError(f"{where}: unknown entry {tag!r} in the save")
    return decoder(encoded, arrays, where)


def _array(encoded: dict[str, Any], tag: str, arrays: list[Any], where: str) -> Any:
    index = encoded[tag]
    if type(index) is not int or not 0 <= index < len(arrays):
        raise ValueError(f"{where}: array index {index!r} is out of range")
    return arrays[index]


def as_weak(value: Any) -> jax.Array:
    """`value` (a numpy or jax array) as a weakly typed jax array of the same dtype and
    values, as a Python scalar becomes on the device.

    A strong copy of a weak leaf would promote differently (`bf16_param - lr * grad` turns
    float32), so a resumed run would silently compute something else.

    Example:
        >>> as_weak(np.float32(0.5))
        Array(0.5, dtype=float32, weak_type=True)
    """
    try:
        # No public JAX function makes an array of given values weak; jax.numpy uses this.
        from jax._src.lax import lax as lax_internal  # noqa: PLC0415 (private: guarded)

        convert = lax_internal._convert_element_type
    except (ImportError, AttributeError):
        warnings.warn(
            "this JAX cannot rebuild a weakly typed array: it is restored strongly typed, "
            "and arithmetic with it may promote differently than before the save",
            stacklevel=2,
        )
        return jnp.asarray(value)
    weak: jax.Array = convert(value, np.dtype(value.dtype), weak_type=True)
    return weak


def _device_array(value: Any, encoded: dict[str, Any], where: str) -> jax.Array:
    """A saved jax array on the device, weakly typed if the save says it was. One saved
    in JAX's 64-bit mode is refused while that mode is off: it would be narrowed to 32
    bits (float64 rounded, int64 wrapped) without a word."""
    dtype = np.dtype(value.dtype)
    narrowed = jax.dtypes.canonicalize_dtype(dtype) != dtype  # (jax.enable_x64 counts)
    if dtype.kind in "fiuc" and narrowed:
        raise ValueError(
            f"{where}: the save holds a {dtype} jax array, saved in JAX's 64-bit mode, "
            f"which is off now: loaded, it would be narrowed to 32 bits (float64 and "
            f"complex128 values rounded, int64 ones wrapped). Turn the mode on before loading "
            f"(jax.config.update('jax_enable_x64', True)), or cast the leaf before saving"
        )
    return as_weak(value) if encoded.get("weak") is True else jax.device_put(value)


def _decode_dict(encoded, arrays, where):
    out = {}
    for item in encoded["dict"]:
        if not (isinstance(item, list) and len(item) == 2 and type(item[0]) in (str, int)):
            raise ValueError(f"{where}: malformed dict entry in the save")
        out[item[0]] = decode(item[1], arrays, f"{where}[{item[0]!r}]")
    return out


def _decode_key(encoded, arrays, where):
    return jax.random.wrap_key_data(
        np.asarray(_array(encoded, "key", arrays, where)), impl=str(encoded["impl"])
    )


def _decode_empty(encoded, arrays, where):
    try:
        empty = np.zeros(tuple(encoded["shape"]), jnp.dtype(encoded["dtype"]))
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{where}: malformed empty array in the save ({err})") from None
    return _device_array(empty, encoded, where) if encoded["empty"] == "jax" else empty


def _decode_dataclass(encoded, arrays, where):
    cls = lookup(encoded["dataclass"], where)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ValueError(f"{where}: {encoded['dataclass']!r} is not a dataclass type")
    names = {f.name for f in dataclasses.fields(cls)}
    # Built the way equinox and flax rebuild their dataclass pytrees (no __init__ runs).
    obj = object.__new__(cls)
    for name, value in encoded["fields"]:
        if name not in names:
            raise ValueError(f"{where}: {cls.__name__} has no field {name!r}")
        object.__setattr__(obj, name, decode(value, arrays, f"{where}.{name}"))
    if not _is_node(obj):
        raise ValueError(f"{where}: {encoded['dataclass']!r} is not a pytree node type")
    return obj


def _decode_node(encoded, arrays, where):
    node_type = lookup(encoded["node"], where)
    if not isinstance(node_type, type):
        raise ValueError(f"{where}: {encoded['node']!r} is not a type")
    children = [decode(c, arrays, f"{where}/{i}") for i, c in enumerate(encoded["children"])]
    if encoded.get("data_in_arrays"):
        data = decode(encoded["data"], arrays, where)
    else:
        try:
            data = decode(encoded["data"], [], where)
        except ValueError as err:
            raise ValueError(
                f"{where}: the static data of its {encoded['node']!r} node was saved by an "
                f"earlier fuseloop, which wrote no array of it (a numpy scalar), so this save "
                f"cannot rebuild the node ({err}); save the state again with this version"
            ) from None
    leaf = jax.tree.structure(0)
    try:
        treedef = PyTreeDef.from_node_data_and_children(
            default_registry, (node_type, data), [leaf] * len(children)
        )
    except (RuntimeError, TypeError, ValueError) as err:  # RuntimeError: unregistered
        raise ValueError(
            f"{where}: {encoded['node']!r} is not a pytree node type jax knows ({err})"
        ) from None
    return treedef.unflatten(children)


def _decode_type(encoded, arrays, where):
    kind = lookup(encoded["type"], where)
    if not isinstance(kind, type):
        raise ValueError(f"{where}: {encoded['type']!r} is not a type")
    return kind


def _decode_dtype(encoded, arrays, where):
    try:
        return jnp.dtype(encoded["dtype"])
    except TypeError as err:
        raise ValueError(f"{where}: {encoded['dtype']!r} is not a dtype ({err})") from None


def _decode_function(encoded, arrays, where):
    function = lookup(encoded["function"], where)
    if not callable(function) or isinstance(function, type):
        raise ValueError(f"{where}: {encoded['function']!r} is not a function")
    return function


_DECODERS = {
    "tuple": lambda e, a, w: tuple(decode(v, a, f"{w}[{i}]") for i, v in enumerate(e["tuple"])),
    "dict": _decode_dict,
    "jax": lambda e, a, w: _device_array(_array(e, "jax", a, w), e, w),
    "numpy": lambda e, a, w: np.asarray(_array(e, "numpy", a, w)),
    "numpy_scalar": lambda e, a, w: np.asarray(_array(e, "numpy_scalar", a, w))[()],
    "key": _decode_key,
    "empty": _decode_empty,
    "dataclass": _decode_dataclass,
    "node": _decode_node,
    "function": _decode_function,
    "type": _decode_type,
    "dtype": _decode_dtype,
}
