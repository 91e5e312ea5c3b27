"""Readable logs and progress (issue 10 item 12): newline-terminated lines with one separator,
epochs numbered from 1 for people, log lines above the bar, plain lines off a terminal."""

from __future__ import annotations

import io
import re
import sys
import tempfile
import warnings

import numpy as np
import pytest

import fuseloop as fl
from fuseloop._events import Event
from fuseloop._state import State
from fuseloop.handlers.log import format_metrics, format_value
from fuseloop.handlers.progress import ProgressBar, epoch_length_of

MODEL = fl.models.mlp([8, 3])
LOSS = "sparse_categorical_cross_entropy"
RNG = np.random.default_rng(0)
X = RNG.normal(size=(60, 4)).astype(np.float32)
Y = RNG.integers(0, 3, size=60).astype(np.int32)
TRAIN = fl.data.arrays(X, Y, batch_size=10, seed=1)
VAL = fl.data.arrays(X[:20], Y[:20], batch_size=10, shuffle=False)
NUMBER = r"-?\d+\.\d{7}"
# "adam" exposes its rate, so the trainer tracks learning_rate next to the loss.
ITERATION = re.compile(
    rf"^Epoch (\d)/3 - iteration (\d)(/\d)? - loss: {NUMBER} - "
    rf"learning_rate: {NUMBER} - accuracy: {NUMBER}$"
)
SUMMARY = re.compile(
    rf"^Epoch (\d)/3 - loss: {NUMBER} - learning_rate: {NUMBER} - "
    rf"accuracy: {NUMBER} - validation_loss: {NUMBER} - "
    rf"validation_accuracy: {NUMBER}$"
)


class Terminal(io.StringIO):
    """A stream that says it is a terminal, so tqdm draws a bar into it."""

    def isatty(self) -> bool:
        return True


def _loop(stream) -> fl.Loop:
    return (
        fl.trainer(MODEL, LOSS, "adam", log=2, log_stream=stream)
        .metric("accuracy")
        .validate(MODEL, VAL)
    )


# One Loop per configuration, shared by the tests (a new Loop traces its programs again);
# loops that only add handlers to these share their compiled programs.
LOG = io.StringIO()
LOGGED = _loop(LOG)  # log lines to LOG: `_logged` empties it before each run
PLAIN = fl.trainer(MODEL, LOSS, "adam")
GUARDED = PLAIN.terminate_on_nan()


def _logged(loop: fl.Loop, *args, **kwargs) -> tuple[State, str]:
    """`loop.run(*args, **kwargs)` (a loop writing its log lines to LOG) and its log text."""
    LOG.seek(0)
    LOG.truncate()
    state = loop.run(*args, **kwargs)
    return state, LOG.getvalue()


@pytest.mark.parametrize("iterations", [None, 4, 10])
def test_log_lines_are_whole_lines_numbered_from_1_and_fused_equals_unfused(iterations):
    texts = {}
    for fuse in (False, 3):
        state, texts[fuse] = _logged(LOGGED, TRAIN, epochs=3, fuse=fuse, iterations=iterations)
    assert texts[3] == texts[False]
    text = texts[False]
    assert "\r" not in text and text.endswith("\n")
    lines = text.splitlines()
    iteration_lines = [ITERATION.match(line) for line in lines if " - iteration " in line]
    summaries = [SUMMARY.match(line) for line in lines if " - iteration " not in line]
    assert all(iteration_lines) and all(summaries), lines
    per_epoch = min(iterations or 6, 6)  # iterations=10 bounds nothing in 6 batches
    # every=2 on the running count: counts 1, 3, 5, ... shown as 1-based iterations.
    expected = [(c // per_epoch + 1, c % per_epoch + 1) for c in range(0, 3 * per_epoch, 2)]
    assert [(int(m[1]), int(m[2])) for m in iteration_lines] == expected
    assert all(m[3] == (f"/{per_epoch}" if iterations else None) for m in iteration_lines)
    # One summary per epoch, after its last iteration line, with the validation metrics.
    assert [int(m[1]) for m in summaries] == [1, 2, 3]
    epoch_lines = [line for line in lines if " - iteration " not in line]
    for epoch, line in zip(range(3), epoch_lines, strict=True):
        assert f"validation_loss: {state.history[epoch]['validation_loss']:.7f}" in line


def test_an_early_stopped_run_summarises_every_finished_epoch():
    loop = LOGGED.early_stop("validation_accuracy", patience=1, mode="max")
    state, text = _logged(loop, TRAIN, epochs=30)
    assert state.status == "halted"
    summaries = [line for line in text.splitlines() if " - iteration " not in line]
    assert [s.split(" - ")[0] for s in summaries] == [
        f"Epoch {e + 1}/30" for e in sorted(state.history)
    ]


def test_a_resumed_run_numbers_on_and_does_not_repeat_the_last_summary():
    first, _ = _logged(LOGGED, TRAIN, epochs=1)
    _, text = _logged(LOGGED, TRAIN, first, epochs=3)
    summaries = [line.split(" - ")[0] for line in text.splitlines() if " - iteration " not in line]
    assert summaries == ["Epoch 2/3", "Epoch 3/3"]


def test_log_lines_print_above_the_bar_never_into_it(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)
    loop = _loop(None).log(lambda s: f"user line {s.epoch + 1}\n", event="epoch_completed")
    loop.run(TRAIN, epochs=3, fuse=2, progress=True)
    raw = terminal.getvalue()
    assert "Epoch 1/3:" in raw and "Epoch 3/3:" in raw  # the bar's label, from 1
    screen = _render(raw)
    logged = [line for line in screen if not _is_bar(line)]
    # 9 iteration lines, 3 summaries, 3 user lines, each whole on its own screen line:
    # a line mixed with the bar (or a bar overwritten by a shorter line) would not match.
    assert len(logged) == 15, screen
    for line in logged:
        assert (
            ITERATION.match(line) or SUMMARY.match(line) or re.fullmatch(r"user line \d", line)
        ), repr(line)


def _render(raw: str) -> list[str]:
    """What a terminal shows for `raw`: "\r" returns to the line start, later characters
    overwrite earlier ones, "\n" ends the line."""
    lines, current, column = [], [], 0
    for char in raw:
        if char == "\r":
            column = 0
        elif char == "\n":
            lines.append("".join(current).rstrip())
            current, column = [], 0
        else:
            if column < len(current):
                current[column] = char
            else:
                current.append(char)
            column += 1
    if "".join(current).strip():
        lines.append("".join(current).rstrip())
    return [line for line in lines if line]


def _is_bar(line: str) -> bool:
    return bool(re.match(r"^Epoch \d/3: ", line))


def test_off_a_terminal_progress_is_one_plain_line_per_epoch(capsys):
    state, _ = _logged(LOGGED, TRAIN, epochs=3, progress=True, fuse=4)
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert [line.split(" - ")[0] for line in lines] == ["Epoch 1/3", "Epoch 2/3", "Epoch 3/3"]
    assert lines[1].split(" - ")[1] == "6/6"  # the length is known from the first epoch on
    assert re.fullmatch(r"\d+\.\ds", lines[2].split(" - ")[2])
    assert lines[2].endswith(format_metrics(state.history[2]))


def test_a_source_of_unknown_length_shorter_than_iterations_shows_its_own_length(capsys):
    # A callable's 6 batches under iterations=10: "6/10" every epoch, as if 4 were missing.
    PLAIN.run(lambda: iter(list(TRAIN)), epochs=3, iterations=10, progress=True, fuse=2)
    totals = [line.split(" - ")[1] for line in capsys.readouterr().err.splitlines()]
    assert totals == ["6/10", "6/6", "6/6"]  # bounded by iterations until an epoch ends


def test_a_populations_bar_shows_each_members_metrics(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    PLAIN.run(TRAIN, epochs=1, progress=True, population=2)
    assert re.search(r"loss=\[\d\.\d{4}, \d\.\d{4}\]", terminal.getvalue())


@pytest.mark.parametrize("fuse", [False, 4])
def test_off_a_terminal_an_epoch_ended_by_halt_epoch_is_marked_stopped(capsys, fuse):
    def end_epoch(state):
        return "halt_epoch" if state.epoch == 0 and state.iteration == 2 else None

    loop = PLAIN.handle_event("iteration_completed", end_epoch)
    loop.run(TRAIN, epochs=2, progress=True, fuse=fuse)
    lines = capsys.readouterr().err.splitlines()
    assert " - stopped - loss: " in lines[0] and "halted" not in lines[0], lines


@pytest.mark.parametrize("fuse", [False, 4, True])
def test_off_a_terminal_an_epoch_halted_midway_still_gets_its_line(capsys, fuse):
    def stop(state):
        return "halt_loop" if state.epoch == 1 and state.iteration == 2 else None

    loop = PLAIN.handle_event("iteration_completed", stop)
    state = loop.run(TRAIN, epochs=3, progress=True, fuse=fuse)
    lines = capsys.readouterr().err.splitlines()
    assert state.status == "halted" and len(lines) == 2
    # A fused halt counts, as the unfused loop does, the iterations whose events fired,
    # and shows the metrics the handler saw.
    assert lines[1].startswith("Epoch 2/3 - 3/6 - ") and " - stopped - loss: " in lines[1]
    if fuse is False:
        capsys.readouterr()
        return
    unfused = loop.run(TRAIN, epochs=3, progress=True)
    assert _without_time(capsys.readouterr().err) == _without_time("\n".join(lines) + "\n")
    assert unfused.event_counts == state.event_counts


@pytest.mark.parametrize("event", ["iteration_started", "iteration_completed"])
def test_off_a_terminal_a_handler_error_stops_the_line_at_the_last_completed_iteration(
    capsys, event
):
    def fail(state):
        if state.epoch == 1 and state.iteration == 2:
            raise RuntimeError("my handler failed")

    loop = fl.trainer(MODEL, LOSS, "adam", log=1).handle_event(event, fail)
    completed = 3 if event == "iteration_completed" else 2  # iteration 2 counts from 0
    shown = []
    for fuse in (False, 4, "run"):
        with pytest.raises(RuntimeError, match="my handler failed"):
            loop.run(TRAIN, epochs=2, progress=True, fuse=fuse)
        captured = capsys.readouterr()
        err = (captured.out + captured.err).splitlines()
        (line,) = [line for line in err if " - stopped" in line]
        # It counted the iterations before the failing one (fused: 0/6; unfused: one short).
        assert line.startswith(f"Epoch 2/2 - {completed}/6 - "), (fuse, line)
        logged = [line for line in err if line.startswith("Epoch 2/2 - iteration ")]
        assert line.endswith(logged[completed - 1].split(" - ", 2)[2]), (fuse, line, logged)
        shown.append(_without_time(line))
    assert shown[0] == shown[1] == shown[2]


def test_an_epoch_of_unknown_length_is_learnt_from_a_complete_epoch_not_a_halted_one(capsys):
    batches = [(X[i : i + 10], Y[i : i + 10]) for i in range(0, 60, 10)]

    def halt_midway(state):
        return "halt_epoch" if state.epoch == 1 and state.iteration == 2 else None

    loop = PLAIN.handle_event("iteration_completed", halt_midway)
    loop.run(lambda: iter(batches), epochs=3, progress=True)  # a callable has no len
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" - ")[1] for line in lines] == ["6 iterations", "3/6", "6/6"]


@pytest.mark.parametrize("handled", [False, True])
def test_off_a_terminal_a_non_finite_loss_stops_the_line_where_the_unfused_loop_does(
    capsys, handled
):
    batches = [(X[i : i + 10].copy(), Y[i : i + 10]) for i in range(0, 60, 10)]
    batches[3][0][0, 0] = np.nan  # the 4th step's loss is non-finite
    loop = GUARDED
    if handled:  # an iteration handler: the guard's flag is read per chunk, not per epoch
        loop = loop.handle_event("iteration_completed", lambda s: None, {"every": 5})
    counts, shown = [], []
    for fuse in (False, 4, True):
        with pytest.warns(RuntimeWarning, match="non-finite"):
            state = loop.run(batches, progress=True, fuse=fuse)
        counts.append(state.event_counts)
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("Epoch 1/1 - 3/6 - ") and " - stopped" in line, (fuse, line)
        # The line shows the halted State's metrics (the 3 good steps'), in every mode.
        assert f" - loss: {state.metrics['loss']:.7f}" in line, (fuse, line)
        shown.append(_without_time(line))
    assert counts[0] == counts[1] == counts[2]
    assert shown[0] == shown[1] == shown[2]


def _without_time(text: str) -> str:
    return re.sub(r" - \d+\.\ds - ", " - ", text)


def _fake_state(epoch: int, max_iteration: int | None = None) -> State:
    return State(epoch=epoch, max_epoch=2, max_iteration=max_iteration)


def test_the_bar_knows_its_total_when_the_source_knows_its_length():
    assert epoch_length_of(TRAIN) == 6 and epoch_length_of(TRAIN, iterations=4) == 4
    assert epoch_length_of(iter([(0, 0)])) is None and epoch_length_of(lambda: iter([])) is None
    assert epoch_length_of(lambda: iter([]), iterations=3) is None  # at most 3: unknown
    terminal = Terminal()
    bar = ProgressBar.for_data(TRAIN, stream=terminal)
    bar.on_event(Event.EPOCH_STARTED, _fake_state(0))
    assert bar.bar.total == 6 and bar.bar.desc.startswith("Epoch 1/2")
    bar.advance(6, {"loss": 0.5})
    bar.on_event(Event.EPOCH_COMPLETED, _fake_state(0).replace(metrics={"loss": 0.25}))
    assert bar.bar is None and "6/6" in terminal.getvalue()
    bounded = ProgressBar(epoch_length=6, stream=terminal)
    bounded.on_event(Event.EPOCH_STARTED, _fake_state(1, max_iteration=4))
    assert bounded.bar.total == 4
    bounded.close()
    unknown = ProgressBar(stream=terminal)  # the loop's default: learns from the first epoch
    unknown.on_event(Event.EPOCH_STARTED, _fake_state(0))
    assert unknown.bar.total is None
    unknown.advance(5, None)
    unknown.on_event(Event.EPOCH_COMPLETED, _fake_state(0))
    unknown.on_event(Event.EPOCH_STARTED, _fake_state(1))
    assert unknown.bar.total == 5
    unknown.close()


def test_values_format_on_one_line():
    assert format_value(0.5) == "0.5000000" and format_value(-2) == "-2.0000000"
    assert format_value(2.5e-7) == "2.5000000e-07" and format_value(0.0) == "0.0000000"
    assert format_value(2.3e23) == "2.3000000e+23" and format_value(-1e8) == "-1.0000000e+08"
    assert format_value(99_999_999.5) == "99999999.5000000"
    assert format_value(float("nan")) == "nan" and format_value(np.float32(1.5)) == "1.5000000"
    assert format_value(np.array([0.5, 1.0])) == "[0.5000000, 1.0000000]"
    assert format_value("a\nb") == "a b" and format_value(None) == "None"
    assert format_metrics({"loss": 1.0, "members": np.zeros((2,))}) == (
        "loss: 1.0000000 - members: [0.0000000, 0.0000000]"
    )


def test_demo_writes_its_plot_where_it_says_without_warnings(tmp_path, monkeypatch, capsys):
    from fuseloop._demo import default_plot_path, demo

    monkeypatch.chdir(tmp_path)
    target = tmp_path / "out" / "curves.png"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        demo(epochs=1, plot=str(target), progress=False)
    out = capsys.readouterr().out
    assert target.exists() and f"written to {target}" in out
    assert list(tmp_path.iterdir()) == [tmp_path / "out"]  # nothing else in the cwd
    assert "Epoch 1/1 - loss: " in out
    assert default_plot_path().is_relative_to(tempfile.gettempdir())
    with pytest.raises(ValueError, match="plot"):
        demo(epochs=1, plot=3, progress=False)
