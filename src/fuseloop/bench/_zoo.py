"""The model zoo: a CNN on digits, a causal character transformer and a character GRU.

Each is a `ZooWorkload` with the interface the systems use (`batches`, `stacked`,
`fresh_state`, `train_step`, `variables`, `compared`, `keras_model`), at batch 32:

- **cnn**: `DigitsCNN` on scikit-learn's 8x8x1 digits (1,797 images, scaled to [0, 1],
  repeated in a fixed shuffled order to fill the epoch), 10 classes.
- **transformer** / **gru**: next-character prediction on sequences of 64 characters cut at
  fixed pseudo-random offsets from a text that an installed dependency ships (its license
  files, found at run time through `importlib.metadata`); vocabulary = the text's characters.
  Without such a text the sequences are synthetic, and a note is printed.

The JAX step is fuseloop's trainer step written out by hand (the same flax forward with
`train=True` and mutable `batch_stats`, the same loss and optax update), so the floor and the
plain loop train what fuseloop trains; the guards check it.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax

from ._workload import count_params

__all__ = ["ZooSpec", "ZOO", "ZooWorkload", "char_corpus", "zoo_summary"]

SEQUENCE = 64
# (distribution, file name) pairs searched for the character corpus, in order.
_CORPUS_FILES = (
    ("jax", "LICENSE"),
    ("flax", "LICENSE"),
    ("optax", "LICENSE"),
    ("numpy", "LICENSE.txt"),
)


@dataclass(frozen=True)
class ZooSpec:
    """A zoo model: its name, kind (`cnn`, `transformer`, `gru`) and a one-line summary.

    Example:
        >>> ZOO["gru"].kind
        'gru'
    """

    name: str
    kind: str
    summary: str


ZOO: dict[str, ZooSpec] = {
    spec.name: spec
    for spec in (
        ZooSpec("cnn", "cnn", "Conv16+BN, Conv32+BN, avgpool, Dense10 on 8x8x1 digits"),
        ZooSpec(
            "transformer",
            "transformer",
            "causal transformer: 2 layers, d=64, 4 heads, sequence 64, characters",
        ),
        ZooSpec("gru", "gru", "Embed32, GRU64 (nn.RNN = lax.scan), Dense; sequence 64, characters"),
    )
}


def char_corpus(log: Callable[[str], None] | None = None) -> tuple[str, str]:
    """The text of the first license file found among `_CORPUS_FILES`, and where from.

    Returns `("", "synthetic")` when none is installed; the caller then uses synthetic
    characters (and says so).
    """
    for dist, name in _CORPUS_FILES:
        try:
            files = importlib.metadata.distribution(dist).files or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for path in files:
            if path.name == name:
                try:
                    text = path.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                if len(text) > 4 * SEQUENCE:
                    return text, f"{dist}'s {path.name}"
    (log or (lambda m: print(m, file=sys.stderr)))(
        "note: no license text found in jax/flax/optax/numpy; using synthetic characters"
    )
    return "", "synthetic"


def _digits(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, str]:
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise ImportError(
            "the zoo's cnn trains on scikit-learn's digits: pip install "
            "scikit-learn (or leave cnn out of --models)"
        ) from error

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    order = np.concatenate([rng.permutation(len(images)) for _ in range(-(-n // len(images)))])[:n]
    return images[order], digits.target.astype(np.int32)[order], "sklearn digits"


def _sequences(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, str, int]:
    text, source = char_corpus()
    if not text:
        text = "".join(rng.choice(list("abcdefghij klmnop\n"), size=20_000))
    vocab = sorted(set(text))
    ids = np.array([vocab.index(c) for c in text], dtype=np.int32)
    starts = rng.integers(0, len(ids) - SEQUENCE - 1, size=n)
    windows = np.stack([ids[s : s + SEQUENCE + 1] for s in starts])
    described = f"{source} ({len(text):,} chars, {len(vocab)} distinct)"
    return windows[:, :-1], windows[:, 1:], described, len(vocab)


def _sparse_ce(logits: Any, labels: Any) -> Any:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@dataclass
class ZooWorkload:
    """One zoo model's benchmark: data, initial variables and the shared step.

    Attributes:
        spec: The model.
        x, y: The epoch's examples (host numpy); batch `i` is rows `[i*bs, (i+1)*bs)`.
        batches: The epoch as `(x, y)` numpy batches.
        module: The flax module; `tx`: `optax.adam(1e-3)`.
        host_variables: Initial variables (host numpy), `params` and, for the CNN,
            `batch_stats`; shared by every JAX system.
        data_source: Where the examples came from.
    """

    spec: ZooSpec
    batch_size: int = 32
    n_batches: int = 100
    seed: int = 0
    x: np.ndarray = field(init=False)
    y: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        from ._zoo_models import CharGRU, CharTransformer, DigitsCNN

        rng = np.random.default_rng(self.seed)
        n = self.batch_size * self.n_batches
        self.module: nn.Module
        if self.spec.kind == "cnn":
            self.x, self.y, self.data_source = _digits(n, rng)
            self.vocab, self.module = 10, DigitsCNN()
        else:
            self.x, self.y, self.data_source, self.vocab = _sequences(n, rng)
            self.module = (
                CharTransformer(self.vocab, SEQUENCE)
                if self.spec.kind == "transformer"
                else CharGRU(self.vocab)
            )
        bs = self.batch_size
        self.batches = [
            (self.x[i * bs : (i + 1) * bs], self.y[i * bs : (i + 1) * bs])
            for i in range(self.n_batches)
        ]
        self.tx = optax.adam(1e-3)
        variables = self.module.init(jax.random.PRNGKey(self.seed), self.batches[0][0])
        self.host_variables: dict[str, Any] = jax.tree.map(np.asarray, dict(variables))
        self.n_params = count_params(self.host_variables["params"])

    @property
    def variables(self) -> dict[str, Any]:
        """The initial variables as fuseloop's trainer takes them."""
        return self.host_variables

    def describe(self) -> dict[str, Any]:
        return {"params": self.n_params, "model": self.spec.summary, "data": self.data_source}

    def compared(self, variables: Any) -> Any:
        """What the agreement guards compare: every variable, `batch_stats` included."""
        return variables

    def stacked(self) -> tuple[np.ndarray, np.ndarray]:
        """The epoch stacked on a leading batch axis: `[n_batches, batch_size, ...]`."""
        return np.stack([b[0] for b in self.batches]), np.stack([b[1] for b in self.batches])

    def fresh_state(self) -> tuple[Any, Any]:
        """Device copies of the initial variables and optimizer state (safe to donate)."""
        variables = jax.device_put(self.host_variables)
        return variables, self.tx.init(variables["params"])

    def train_step(self, variables: Any, opt_state: Any, x: Any, y: Any) -> tuple[Any, Any, Any]:
        """fuseloop's trainer step: forward with `train=True` (BatchNorm statistics
        updated), the loss, its gradient over `params`, the Adam update."""
        params = variables["params"]
        rest = {k: v for k, v in variables.items() if k != "params"}

        def objective(p: Any) -> tuple[Any, Any]:
            if not rest:
                return _sparse_ce(self.module.apply({"params": p}, x), y), {}
            logits, updates = self.module.apply(
                {"params": p, **rest}, x, train=True, mutable=list(rest)
            )
            return _sparse_ce(logits, y), dict(updates)

        (loss, updates), grads = jax.value_and_grad(objective, has_aux=True)(params)
        changes, opt_state = self.tx.update(grads, opt_state, params)
        return {"params": optax.apply_updates(params, changes), **rest, **updates}, opt_state, loss

    def keras_model(self, keras: Any) -> Any:
        """The same layer shapes in Keras 3."""
        from ._zoo_models import keras_cnn, keras_gru, keras_transformer

        if self.spec.kind == "cnn":
            return keras_cnn(keras)
        build = keras_transformer if self.spec.kind == "transformer" else keras_gru
        return build(keras, self.vocab, SEQUENCE)


def zoo_summary(results: dict[str, Any], fuse: int) -> dict[str, Any]:
    """Where fusion helps, from medians and from minima of the per-iteration times.

    `overhead_us` = fuse=False minus the floor per iteration: what running one compiled
    step per dispatch costs beyond the step inside the floor's loop; `overhead_over_step`
    = that / the floor (fusion can save at most that share). `plain_over_floor` = a
    standalone jitted step against the same step inside a compiled loop: far from 1, the
    difference is the compiled step itself, not the launch. The verdict reads the minima,
    which other processes' load inflates least.
    """
    out: dict[str, Any] = {
        stat: _figures(results, fuse, f"{stat}_us") for stat in ("median", "min")
    }
    out["verdict"] = _verdict(out["min"]) if out["min"] else "n/a: floor or fuse=False missing"
    return out


def _figures(results: dict[str, Any], fuse: int, statistic: str) -> dict[str, Any] | None:
    def time(key: str) -> float | None:
        result = results.get(key)
        return getattr(result, statistic) if result is not None and result.ok else None

    floor, unfused, plain = time("floor"), time("fl_unfused"), time("plain")
    fused, resident = time(f"fl_fuse{fuse}"), time(f"fl_fuse{fuse}_resident")
    floor_transfer = time("floor_transfer")
    if floor is None or unfused is None:
        return None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    return {
        "floor_us": floor,
        "unfused_us": unfused,
        "fused_us": fused,
        "plain_us": plain,
        "overhead_us": unfused - floor,
        "overhead_over_step": (unfused - floor) / floor,
        "plain_over_floor": ratio(plain, floor),
        "fused_vs_floor": ratio(fused, floor),
        "fused_vs_floor_transfer": ratio(fused, floor_transfer),
        "resident_vs_floor": ratio(resident, floor),
        "unfused_over_fused": ratio(unfused, fused),
    }


LOOP_EFFECT = 1.5  # plain / floor beyond this (or below its inverse): the step, not the launch


def _verdict(z: dict[str, Any]) -> str:
    share, plain_ratio = z["overhead_over_step"], z["plain_over_floor"]
    if plain_ratio is not None and plain_ratio < 1 / LOOP_EFFECT:
        return (
            f"loop-penalized: the step alone (plain jit) takes {plain_ratio:.2f}x the "
            f"floor's step: it runs slower inside a compiled loop on this backend, so "
            f"no fused loop (the floor included) can beat a per-step loop"
        )
    if plain_ratio is not None and plain_ratio > LOOP_EFFECT:
        return (
            f"loop-favoured: the step alone (plain jit) takes {plain_ratio:.2f}x the "
            f"floor's step, far more than a launch costs: the compiled step is faster "
            f"inside a loop; fusion gains that ({_x(z['unfused_over_fused'])} over "
            f"fuse=False)"
        )
    if share <= 0:
        return (
            "compute-bound: fuse=False was no slower than the floor's step (the launch "
            "overhead is lost in the step's own time and the noise); fusion cannot help"
        )
    if share < 0.10:
        return (
            f"compute-bound: fuse=False costs {share:.0%} more than the floor's step; "
            f"fusion can save at most that"
        )
    return (
        f"overhead-bound: launch overhead is {share:.0%} of the step; fusion removes "
        f"it ({_x(z['unfused_over_fused'])} over fuse=False)"
    )


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"
