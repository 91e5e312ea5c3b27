"""fuse="auto" (the chunk-size cost model) and fl.diagnostics.report."""

from __future__ import annotations

import functools
import warnings

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import fuseloop as fl
from fuseloop import diagnostics
from fuseloop.engine import auto_chunk

BATCH, FEATURES, N_BATCHES = 8, 4, 40


def _batches(n: int = N_BATCHES, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        (
            rng.standard_normal((BATCH, FEATURES)).astype(np.float32),
            rng.integers(0, 3, BATCH).astype(np.int32),
        )
        for _ in range(n)
    ]


MODEL, LOSS, OPTIMIZER = fl.models.mlp([8, 3]), "sparse_categorical_cross_entropy", optax.adam(1e-2)


def _new_loop() -> fl.Loop:
    """A Loop of its own (its program cache empty: the probe runs and the report compiles),
    of the file's one configuration (its programs are read from the persistent cache)."""
    return fl.trainer(MODEL, LOSS, OPTIMIZER)


@functools.cache
def _loop() -> fl.Loop:
    """The file's shared trainer, for tests whose claim does not need an empty program
    cache (a fixed K, or a timing taken once per loop): traced and lowered once."""
    return _new_loop()


def _batch_bytes(batch: tuple[np.ndarray, np.ndarray]) -> int:
    return sum(a.nbytes for a in batch)


def _assert_bitwise(a: object, b: object) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


class FakeProbe:
    """Stands in for the timing probe: fixed (step, overhead) seconds, calls counted."""

    def __init__(self) -> None:
        self.value, self.calls = (1e-5, 1e-4), 0

    def __call__(self, *args: object, **kwargs: object) -> tuple[float, float]:
        self.calls += 1
        return self.value


@pytest.fixture
def fake_probe(monkeypatch: pytest.MonkeyPatch) -> FakeProbe:
    probe = FakeProbe()
    monkeypatch.setattr(auto_chunk, "probe", probe)
    return probe


# ----------------------------------------------------------------- run(fuse="auto")
def test_auto_picks_at_least_16_for_a_tiny_mlp() -> None:
    state = _loop().run(_batches(), fuse="auto")
    chunk = state.stats["chunk_size"]
    assert isinstance(chunk, int) and chunk >= 16


def test_auto_run_equals_unfused_bitwise() -> None:
    loop, data = _loop(), _batches()
    fused = loop.run(data, fuse="auto", epochs=2)
    plain = loop.run(data, fuse=False, epochs=2)
    _assert_bitwise(fused.step_state, plain.step_state)
    assert fused.history == plain.history


def test_auto_consumes_no_extra_batch() -> None:  # its probe runs: a loop of its own
    pulled = []

    def generator():  # noqa: ANN202
        for i, batch in enumerate(_batches(24)):
            pulled.append(i)
            yield batch

    state = _new_loop().run(generator(), fuse="auto")
    assert len(pulled) == 24 and state.iteration == 23


def test_auto_with_a_handler_that_may_halt_warns_that_its_halt_moves_with_the_timing():
    halts = lambda s: "halt_epoch" if s.iteration == 4 else None  # noqa: E731
    moving = r"fuse='auto' picks its chunk size by timing.*<lambda>' on iteration_completed"
    with pytest.warns(UserWarning, match=moving):
        _loop().handle_event("iteration_completed", halts).run(_batches(), fuse="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an observer cannot halt; a fixed K repeats its halt
        _loop().observe("iteration_completed", lambda s: None).run(_batches(), fuse="auto")
        _loop().handle_event("iteration_completed", halts).run(_batches(), fuse=4)


# ----------------------------------------------------------------- choose_chunk_size
def test_result_is_an_int_of_at_least_one() -> None:
    loop, batch = _new_loop(), _batches(1)[0]
    k = diagnostics.choose_chunk_size(loop, loop.program.init(batch, None), batch)
    assert type(k) is int and k >= 1


def test_probe_leaves_the_step_state_usable() -> None:
    loop, data = _new_loop(), _batches()
    step_state = loop.program.init(data[0], None)
    before = jax.device_get(step_state)
    diagnostics.choose_chunk_size(loop, step_state, data[0])
    _assert_bitwise(jax.device_get(step_state), before)  # not donated, not changed


def test_a_tiny_budget_caps_k() -> None:
    loop, batch = _new_loop(), _batches(1)[0]
    state = loop.program.init(batch, None)
    k = diagnostics.choose_chunk_size(loop, state, batch, budget_bytes=3 * _batch_bytes(batch))
    assert 1 <= k <= 3


def test_a_batch_larger_than_the_budget_gives_one() -> None:
    loop, batch = _new_loop(), _batches(1)[0]
    state = loop.program.init(batch, None)
    assert diagnostics.choose_chunk_size(loop, state, batch, budget_bytes=16) == 1


def test_k_amortizes_the_overhead_to_the_tolerance(fake_probe: FakeProbe) -> None:
    # overhead 100 us, step 10 us, 2%: K >= 100 / (0.02 * 10) = 500 -> 512
    fake_probe.value = (1e-5, 1e-4)
    loop, batch = _new_loop(), _batches(1)[0]
    assert diagnostics.choose_chunk_size(loop, None, batch) == 512
    decision = diagnostics.decide_chunk_size(loop, None, batch)
    assert decision.bound == "tolerance" and decision.wanted == 500
    # a compute-bound step needs few steps per dispatch
    fake_probe.value = (1e-3, 1e-4)
    assert diagnostics.choose_chunk_size(_new_loop(), None, batch) == 8


def test_caps_max_chunk_memory_and_epoch_length(fake_probe: FakeProbe) -> None:
    fake_probe.value = (1e-6, 1e-3)  # wants K = 50000
    batch = _batches(1)[0]
    size = _batch_bytes(batch)
    choose = diagnostics.choose_chunk_size
    assert choose(_new_loop(), None, batch) == diagnostics.DEFAULT_MAX_CHUNK
    assert choose(_new_loop(), None, batch, max_chunk=64) == 64
    assert choose(_new_loop(), None, batch, budget_bytes=100 * size) == 100
    assert choose(_new_loop(), None, batch, epoch_length=100) == 100
    # 1500 batches in chunks of at most 1024: two balanced chunks of 750
    assert choose(_new_loop(), None, batch, epoch_length=1500) == 750
    k = choose(_new_loop(), None, batch, budget_bytes=7 * size + size // 2)
    assert k * size <= 7 * size + size // 2


def test_measures_once_per_loop_and_batch_shape(fake_probe: FakeProbe) -> None:
    loop, batch = _new_loop(), _batches(1)[0]
    for _ in range(3):
        diagnostics.choose_chunk_size(loop, None, batch)
    assert fake_probe.calls == 1
    wider = (np.zeros((BATCH * 2, FEATURES), np.float32), np.zeros(BATCH * 2, np.int32))
    diagnostics.choose_chunk_size(loop, None, wider)
    assert fake_probe.calls == 2
    # A run's mesh is a probe of its own (it was taken only as a run's internal placement).
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
    diagnostics.choose_chunk_size(loop, None, batch, placement=mesh)
    assert fake_probe.calls == 3


@pytest.mark.parametrize(
    "argument, value",
    [
        ("budget_bytes", 0),
        ("max_chunk", -1),
        ("tolerance", 0.0),
        ("tolerance", float("nan")),
        ("epoch_length", 0),
        ("placement", "data"),  # anything but a mesh was ignored: the probe ran on one device
    ],
)
def test_bad_arguments_name_themselves(argument: str, value: float) -> None:
    loop, batch = _loop(), _batches(1)[0]
    with pytest.raises(ValueError, match=argument):
        diagnostics.choose_chunk_size(loop, None, batch, **{argument: value})


# ----------------------------------------------------------------- fusion count
def test_count_fusions_counts_fusion_instructions_only() -> None:
    text = "\n".join(
        [
            "%fused_computation (p: f32[4]) -> f32[4] {",
            "  ROOT %add.0 = f32[4]{0} add(%p, %p)",
            "}",
            "ENTRY %main (a: f32[4]) -> (f32[4], f32[]) {",
            "  %fusion.1 = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_computation",
            "  %neg = f32[4]{0} negate(%fusion.1)",
            "  ROOT %tuple_fusion = (f32[4]{0}, f32[]) fusion(%neg), kind=kInput, calls=%c2",
            "}",
        ]
    )
    assert diagnostics.count_fusions(text) == 2
    assert (
        diagnostics.count_fusions(
            "ENTRY %m (a: f32[]) -> f32[] {\n ROOT %a = f32[] parameter(0)\n}"
        )
        == 0
    )


def test_count_fusions_refuses_what_is_not_hlo_text() -> None:
    f = jax.jit(lambda a: a + 1.0)
    with pytest.raises(TypeError, match=r"got Compiled: pass .*as_text\(\)"):
        diagnostics.count_fusions(f.lower(np.ones(2, np.float32)).compile())
    with pytest.raises(TypeError, match="got NoneType"):
        diagnostics.count_fusions(None)


def test_count_fusions_on_a_compiled_program() -> None:
    f = jax.jit(lambda a: jax.numpy.tanh(a * 2.0 + 1.0))
    assert diagnostics.count_fusions(f.lower(np.ones(8, np.float32)).compile().as_text()) >= 1


# ----------------------------------------------------------------- report
def test_report_counts_an_epoch_fused_and_unfused() -> None:
    data = _batches(8)
    result = diagnostics.report(_new_loop(), data, fuse=4, reps=1)  # it compiles: its own
    size = _batch_bytes(data[0])
    assert result.chunk_size == 4 and result.iterations == 8
    assert result.fused["dispatches"] == 2 and result.unfused["dispatches"] == 8
    assert result.fused["h2d_transfers"] == 2
    assert result.fused["h2d_bytes"] == 2 * 4 * size  # a chunk's count moves no bytes
    assert result.unfused["h2d_bytes"] == result.unfused["h2d_transfers"] * size
    assert result.fused["compiles"] >= 1
    assert result.step_fusions >= 1 and result.chunk_fusions >= 1
    assert result.step_us > 0 and result.fused["us_per_iteration"] > 0
    text = str(result)
    assert 4 <= len(text.splitlines()) <= 10
    assert "dispatches/epoch   2 (unfused 8)" in text


def test_report_from_a_state_runs_an_epoch_on_from_it() -> None:
    """A notebook profiles from where its State is: `run`'s default epochs=1 trained
    nothing past a State's two epochs, and the report was of no step at all."""
    data, loop = _batches(8), _loop()
    state = loop.run(data, epochs=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "nothing is trained" was warned
        result = diagnostics.report(loop, data, fuse=4, reps=1, init_state=state)
    assert result.iterations == 8
    assert result.fused["dispatches"] == 2 and result.unfused["dispatches"] == 8
    assert result.fused["us_per_iteration"] > 0 and result.unfused["us_per_iteration"] > 0
    # An evaluator takes only a State's params and runs from epoch 0: one epoch, as before.
    evaluator = fl.evaluator(MODEL, LOSS)
    found = diagnostics.report(evaluator, data, fuse=4, reps=1, init_state=state)
    assert found.iterations == 8 and found.fused["dispatches"] == 2


def test_a_resident_sources_one_transfer_is_not_charged_to_an_epoch() -> None:
    # On a fresh source the fused run, run first, placed the dataset: its one transfer
    # read as the fused epoch's, so a second report on the same source disagreed.
    x = np.concatenate([b[0] for b in _batches(8)])
    y = np.concatenate([b[1] for b in _batches(8)])
    source = fl.data.arrays(x, y, batch_size=len(x) // 8, device=True)
    loop = _loop()
    first, again = (diagnostics.report(loop, source, fuse=4, reps=1) for _ in range(2))
    for result in (first, again):
        assert result.fused["h2d_transfers"] == result.unfused["h2d_transfers"] == 0
        assert result.fused["dataset_bytes"] == x.nbytes + y.nbytes
    assert str(first).splitlines()[2] == str(again).splitlines()[2]
    assert "the resident dataset, " in str(first)


def test_report_takes_a_keras_style_sequence_as_run_does() -> None:
    data = _batches(8)

    class Batches:  # keras.utils.PyDataset's shape: batches by index, an epoch hook
        def __len__(self) -> int:
            return len(data)

        def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
            return data[i]

        def on_epoch_end(self) -> None:
            pass

    result = diagnostics.report(_loop(), Batches(), fuse=4, reps=1)
    assert result.iterations == 8 and result.fused["dispatches"] == 2


def test_report_auto_shows_the_decision(fake_probe: FakeProbe) -> None:
    result = diagnostics.report(_new_loop(), _batches(), fuse="auto", reps=1)
    assert result.auto is not None and result.auto.chunk_size == result.chunk_size
    assert "auto" in str(result)


def test_report_takes_a_callable_as_run_does() -> None:
    data = _batches(8)  # the other reports' data and K: their programs
    result = diagnostics.report(_loop(), lambda: iter(data), fuse=4, reps=1)
    assert (result.iterations, result.fused["dispatches"]) == (8, 2)


def test_report_rejects_one_shot_data_and_fuse_false() -> None:
    with pytest.raises(ValueError, match="re-iterable"):
        diagnostics.report(_loop(), iter(_batches(4)), fuse=2)
    with pytest.raises(ValueError, match=r"re-iterable data .*, not int"):
        diagnostics.report(_loop(), 5, fuse=2)
    with pytest.raises(ValueError, match="fuse"):
        diagnostics.report(_loop(), _batches(4), fuse=False)


def test_auto_runs_under_a_transfer_guard() -> None:
    # The probe's own transfers are allowed; the user's guard still governs the run.
    with jax.transfer_guard("disallow"):
        state = _new_loop().run(_batches(), fuse="auto")  # its probe runs: a loop of its own
    assert state.stats["chunk_size"] >= 1


def test_the_diagnostics_name_bad_inputs_as_a_run_does() -> None:
    """They raised ZeroDivisionError, a model library's shape error, a message naming a
    tracer type, and AttributeErrors."""
    loop = _loop()
    x, y = _batches(1)[0]
    state = loop.run(_batches(2))
    with pytest.raises(ValueError, match="first_batch: holds no examples"):
        diagnostics.choose_chunk_size(loop, state.step_state, (x[:0], y[:0]))
    with pytest.raises(ValueError, match="x does not fit the model"):
        diagnostics.choose_chunk_size(loop, state.step_state, (x[:, :2], y))
    with pytest.raises(ValueError, match="first batch is a ndarray of shape") as error:
        diagnostics.choose_chunk_size(loop, state.step_state, x)
    assert "Tracer" not in str(error.value)
    with pytest.raises(ValueError, match="loop: expected a fuseloop Loop"):
        diagnostics.report("loop", _batches(2))
    with pytest.raises(ValueError, match="loop: expected a fuseloop Loop"):
        diagnostics.choose_chunk_size(None, state.step_state, (x, y))
    with pytest.raises(ValueError, match="state: expected a fuseloop State"):
        diagnostics.explain_dispatches(None)
    with pytest.raises(ValueError, match=r"step_state: .*got a State: pass state.step_state"):
        diagnostics.choose_chunk_size(loop, state, (x, y))
    evaluator = fl.evaluator(fl.models.mlp([3]), "sparse_categorical_cross_entropy")
    with pytest.raises(ValueError, match=r"step_state=None: an evaluator has no step state"):
        diagnostics.choose_chunk_size(evaluator, None, (x, y))


def test_an_evaluators_chunk_size_is_decided_from_what_its_run_takes():
    """The variables it evaluates (or the State), as the refusal of None advises: they
    were refused as not fitting the model."""
    x, y = _batches(1)[0]
    evaluator = fl.evaluator(MODEL, LOSS)
    state = _loop().run([(x, y)])
    for given in (state.params, state):
        assert diagnostics.choose_chunk_size(evaluator, given, (x, y), epoch_length=3) == 3
    found = diagnostics.report(evaluator, _batches(4), "auto", init_state=state.params, reps=1)
    assert found.auto is not None and found.auto.chunk_size == 4
    module = nnx.Linear(FEATURES, 3, rngs=nnx.Rngs(0))  # its run takes the module itself
    nnx_evaluator = fl.evaluator(module, "sparse_categorical_cross_entropy")
    assert diagnostics.choose_chunk_size(nnx_evaluator, module, (x, y), epoch_length=3) == 3


def test_auto_does_not_time_a_step_with_side_effects():
    """The probe behind fuse="auto" runs some 50 steps on copies of the first batch: a
    step's callback (a per-step logger) saw them as training steps. Such a step is not
    timed; K is fuse=True's, balanced to the epoch, and the callback sees the run's steps."""
    seen: list[int] = []

    def step(batch, s):
        jax.debug.callback(lambda n: seen.append(int(n)), s["n"])
        return {"n": s["n"] + 1}

    loop = fl.loop(step)
    state = loop.run(_batches(40), {"n": np.int32(0)}, epochs=2, fuse="auto")
    jax.effects_barrier()
    assert sorted(seen) == list(range(80)) and state.stats["chunk_size"] == 20
    decision = fl.diagnostics.decide_chunk_size(loop, state.step_state, _batches(1)[0])
    assert (decision.bound, decision.step_us, decision.chunk_size) == ("side effects", None, 32)
    assert len(seen) == 80  # deciding ran nothing either


def test_diagnostics_run_under_a_guard_on_host_to_device_transfers():
    """As a run does: their own values (a fresh init's key, the accumulators) were moved
    implicitly, and jax refused them."""
    batches = _batches(4)
    loop = _new_loop()  # its own: the fresh init and the probe run under the guard
    with jax.transfer_guard_host_to_device("disallow"):
        decision = diagnostics.decide_chunk_size(loop, None, batches[0], epoch_length=4)
        found = diagnostics.report(loop, _batches(8), fuse=4, reps=1)  # the other reports' K
    assert decision.chunk_size == 4 and found.chunk_size == 4
    # A custom loop's init_fn is the user's code: its own implicit transfer is refused, as
    # in a run (the diagnostics allow only the trainer's).
    custom = fl.loop(lambda b, s: s, lambda b, seed: {"n": jax.numpy.asarray(np.zeros(2))})
    with jax.transfer_guard_host_to_device("disallow"), pytest.raises(Exception, match="ransfer"):
        diagnostics.decide_chunk_size(custom, None, batches[0], epoch_length=4)
