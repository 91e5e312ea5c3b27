"""Runs the systems side by side: interleaved repetitions, guards, ratios and targets."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax

from ._guards import Refused, Skipped, check_bitwise, check_close, check_devices, check_finite
from ._systems import Sample, System

__all__ = ["Result", "measure", "cross_check", "ratios", "targets", "RATIOS", "TARGETS"]

# (name, numerator key, denominator key, what it means)
RATIOS: tuple[tuple[str, str, str, str], ...] = (
    (
        "fused_vs_floor_transfer",
        "fl_fuse32",
        "floor_transfer",
        "fuseloop fuse=32 time / floor incl. the epoch's transfer (1.0 = the floor)",
    ),
    ("fused_vs_floor", "fl_fuse32", "floor", "fuseloop fuse=32 time / floor, data on device"),
    (
        "auto_vs_floor_transfer",
        "fl_fuseauto",
        "floor_transfer",
        "fuseloop fuse='auto' time / floor incl. the epoch's transfer",
    ),
    (
        "resident_vs_floor",
        "fl_fuse32_resident",
        "floor",
        "fuseloop fuse=32 on device-resident data / floor",
    ),
    ("unfused_over_fused", "fl_unfused", "fl_fuse32", "speedup of fuse=32 over fuse=False"),
    ("plain_over_fused", "plain", "fl_fuse32", "speedup of fuse=32 over the plain loop"),
    (
        "keras_spe1_over_fused",
        "keras_spe1",
        "fl_fuse32",
        "speedup of fuse=32 over Keras steps_per_execution=1",
    ),
    (
        "keras_spe32_over_fused",
        "keras_spe32",
        "fl_fuse32",
        "speedup of fuse=32 over Keras steps_per_execution=32",
    ),
    ("torch_over_fused", "torch", "fl_fuse32", "speedup of fuse=32 over PyTorch eager"),
    (
        "plain_over_floor_transfer",
        "plain",
        "floor_transfer",
        "ceiling of plain_over_fused for host-fed data: the floor's speedup over plain",
    ),
    (
        "keras_spe32_over_floor_transfer",
        "keras_spe32",
        "floor_transfer",
        "ceiling of keras_spe32_over_fused for host-fed data",
    ),
    (
        "plain_over_resident",
        "plain",
        "fl_fuse32_resident",
        "speedup of fuse=32 on device-resident data over the plain loop",
    ),
    (
        "io_callback_over_fused",
        "io_callback",
        "fl_fuse32",
        "speedup of fuse=32 over the host-callback design",
    ),
)

# (model, ratio, comparison, bound): the targets, reported, never asserted.
TARGETS: tuple[tuple[str, str, str, float], ...] = (
    ("mlp-tiny", "plain_over_fused", ">=", 5.0),
    ("mlp-tiny", "keras_spe32_over_fused", ">=", 4.0),
    ("mlp-tiny", "fused_vs_floor_transfer", "<=", 1.25),
    ("mlp-small", "fused_vs_floor_transfer", "<=", 1.10),
    ("mlp-large", "fused_vs_floor_transfer", "<=", 1.10),
    ("mlp-tiny", "resident_vs_floor", "<=", 1.25),
    *(
        (model, ratio, "<=", 1.10)
        for model in ("cnn", "transformer", "gru")
        for ratio in ("fused_vs_floor_transfer", "fused_vs_floor", "resident_vs_floor")
    ),
)

# Loops that run fuseloop's step compiled another way: same training, rounding may differ.
_SAME_MATH = ("floor", "floor_transfer", "plain", "io_callback")


@dataclass
class Result:
    """One system's figures for one model."""

    key: str
    label: str
    status: str = "ok"  # "ok", "refused" or "skipped"
    reason: str = ""
    samples_us: list[float] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok" and bool(self.samples_us)

    @property
    def median_us(self) -> float | None:
        return statistics.median(self.samples_us) if self.ok else None

    @property
    def min_us(self) -> float | None:
        return min(self.samples_us) if self.ok else None

    def refuse(self, reason: str) -> None:
        self.status, self.reason, self.samples_us = "refused", reason, []

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "status": self.status,
            "reason": self.reason,
            "median_us": self.median_us,
            "min_us": self.min_us,
            "samples_us": list(self.samples_us),
            "reps": len(self.samples_us),
            "info": self.info,
        }


def _guard(system: System, sample: Sample) -> None:
    check_devices(sample.devices, system.intended, "inputs/outputs")
    check_finite(sample.outputs, "the losses")
    check_finite(sample.params, "the parameters")


def _timed(system: System, epochs: int) -> Sample:
    # A collection mid-epoch would land on whichever system runs then: collect before,
    # pause the collector during the sample.
    gc.collect()
    gc.disable()
    try:
        return system.sample(epochs)
    finally:
        gc.enable()


def measure(
    builders: list[tuple[str, str, Callable[[], System]]],
    reps: int,
    iterations: int,
    epochs: int = 1,
    log: Callable[[str], None] = lambda _: None,
) -> tuple[dict[str, Result], dict[str, Any], dict[str, Any]]:
    """Sets up every system, then times `reps` interleaved rounds of `epochs` epochs each.

    Each round runs every system once, in an order rotated by one each round, so drifting
    machine load is shared. Returns the results, the last verified parameters per system,
    and the one-epoch reference parameters of the systems that have them.
    """
    results: dict[str, Result] = {}
    systems: dict[str, System] = {}
    for key, label, build in builders:
        result = results[key] = Result(key, label)
        began = time.perf_counter()
        try:
            system = build()
            system.setup()
        except Skipped as why:
            result.status, result.reason = "skipped", str(why)
            continue
        except Refused as why:
            result.refuse(str(why))
            continue
        except Exception as error:  # a peer that crashes is reported, not fatal
            result.refuse(f"failed in setup: {type(error).__name__}: {error}")
            continue
        result.info["setup_s"] = round(time.perf_counter() - began, 3)
        systems[key] = system
        log(f"  set up {key} in {result.info['setup_s']:.1f}s")
    params: dict[str, Any] = {}
    # Everything alive now (jax, keras, torch, the compiled programs) stays alive: freezing
    # it keeps the collection before each sample short.
    gc.collect()
    gc.freeze()
    try:
        _rounds(systems, results, params, reps, iterations, epochs)
    finally:
        gc.unfreeze()
    references = {
        key: s.reference_params for key, s in systems.items() if s.reference_params is not None
    }
    return results, params, references


def _rounds(
    systems: dict[str, System],
    results: dict[str, Result],
    params: dict[str, Any],
    reps: int,
    iterations: int,
    epochs: int,
) -> None:
    """Times the rounds into `results`; keeps each system's last verified params."""
    order = list(systems)
    for rep in range(reps):
        shift = rep % max(1, len(order))
        for key in order[shift:] + order[:shift]:
            result = results[key]
            if result.status != "ok":
                continue
            try:
                sample = _timed(systems[key], epochs)
                _guard(systems[key], sample)
            except Refused as why:
                result.refuse(str(why))
                continue
            result.samples_us += [s / iterations * 1e6 for s in sample.seconds]
            params[key] = sample.params
            for name, value in sample.info.items():
                result.info.setdefault(name, []).append(value)


# Off a CPU the same step compiled into two programs may round differently (a GPU's
# float32 matrix products and convolutions take TF32 by default, and each program picks its
# own algorithms): parameters after an epoch differed by up to 3e-3 on an H200. Such a
# machine's check can only tell a gross fault (other data, a lost chunk) from rounding.
OFF_CPU_ATOL = 1e-2


def cross_check(
    results: dict[str, Result],
    params: dict[str, Any],
    references: dict[str, Any],
    atol: float = 1e-4,
) -> None:
    """Refuses fused results that are not bitwise the unfused ones (off a CPU: not within
    `OFF_CPU_ATOL`), and reference loops that do not train what fuseloop trains in one
    epoch."""
    exact = jax.default_backend() == "cpu"
    atol = atol if exact else max(atol, OFF_CPU_ATOL)
    unfused_ok = results.get("fl_unfused", Result("", "")).ok
    for key, result in results.items():
        if not result.ok or key == "fl_unfused":
            continue
        is_fuseloop, same_math = key.startswith("fl_"), key in _SAME_MATH
        if not (is_fuseloop or same_math):
            continue
        reference = (params if is_fuseloop else references).get("fl_unfused")
        if not unfused_ok or reference is None:
            result.refuse("no verified fuseloop fuse=False result to check it against")
            continue
        try:
            if is_fuseloop and exact:
                check_bitwise(params[key], reference, "fused vs unfused fuseloop")
                result.info["bitwise_equal_to_unfused"] = True
            elif is_fuseloop:
                diff = check_close(params[key], reference, "fused vs unfused fuseloop", atol)
                result.info["max_abs_diff_vs_unfused"] = diff
            else:
                diff = check_close(params[key], reference, "same-step check", atol)
                result.info["max_abs_diff_vs_fuseloop"] = diff
        except Refused as why:
            result.refuse(str(why))


def ratios(results: dict[str, Result], statistic: str = "median_us") -> dict[str, float | None]:
    """The RATIOS of per-iteration times (medians by default; None where a side is
    missing)."""
    out: dict[str, float | None] = {}
    for name, top, bottom, _ in RATIOS:
        a, b = results.get(top), results.get(bottom)
        ok = a is not None and b is not None and a.ok and b.ok
        out[name] = getattr(a, statistic) / getattr(b, statistic) if ok else None
    return out


def targets(per_model: dict[str, dict[str, float | None]]) -> list[dict[str, Any]]:
    """Each target with its measured value and whether it was met."""
    out = []
    for model, name, op, bound in TARGETS:
        if model not in per_model:
            continue
        value = per_model[model].get(name)
        met = None if value is None else (value >= bound if op == ">=" else value <= bound)
        out.append(
            {"model": model, "ratio": name, "target": f"{op} {bound}", "value": value, "met": met}
        )
    return out


def _abstract_chunk(batch: Any, k: int) -> Any:
    """The shapes and dtypes of a chunk of `k` batches like `batch` (nothing allocated)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct((k, *a.shape), a.dtype), batch)


def compile_vs_k(workload: Any, ks: tuple[int, ...]) -> list[dict[str, Any]]:
    """Trace, lower and compile time of fuseloop's chunk program for each chunk size K.

    The device loop is a loop (a `lax.while_loop` on a CPU, a `lax.scan` elsewhere), not
    unrolled, so the program (and its compile time) should not grow with K.
    """
    from .. import trainer
    from .._fusion import LOOP_OPTIONS, make_chunk_fn
    from .._step import init_tail, make_carry_step
    from ..diagnostics import count_fusions
    from ..engine import conv_layout

    loop = trainer(workload.module, "sparse_categorical_cross_entropy", workload.tx)
    carry_step = make_carry_step(loop.program, loop.metrics, False)
    state = loop.program.init(workload.batches[0], workload.variables)
    tail = init_tail(loop.metrics, False)
    rows = []
    for k in ks:
        chunk = _abstract_chunk(workload.batches[0], k)
        # As the run builds and compiles it (named as fuseloop's: conv_layout.py).
        chunk_fn = conv_layout.named(make_chunk_fn(carry_step, True, False), "chunk")
        program = jax.jit(chunk_fn, compiler_options=LOOP_OPTIONS)
        began = time.perf_counter()
        lowered = program.lower(state, tail, chunk, jax.ShapeDtypeStruct((), "int32"))
        lowered_at = time.perf_counter()
        compiled = lowered.compile()
        done = time.perf_counter()
        text = compiled.as_text()
        if text is None:
            raise RuntimeError(f"K={k}: the compiled chunk program has no HLO text")
        rows.append(
            {
                "K": k,
                "trace_lower_s": lowered_at - began,
                "compile_s": done - lowered_at,
                "fusions": count_fusions(text),
                "hlo_chars": len(text),
            }
        )
    return rows
