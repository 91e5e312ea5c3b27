"""The command line's option parsing, without training anything."""

from __future__ import annotations

import pytest

from fuseloop import cli, diagnostics
from fuseloop._demo import _plot_target, default_plot_path, parse_fuse


@pytest.mark.parametrize(
    ("text", "expected"),
    [("false", False), ("OFF", False), ("auto", "auto"), ("True", True), ("16", 16)],
)
def test_fuse_option_values(text, expected):
    assert parse_fuse(text) == expected


@pytest.mark.parametrize("text", ["sometimes", "\u00b2", "\u0663"])
def test_a_bad_fuse_option_names_the_accepted_values(text):
    # "\u00b2" (a superscript two) and "\u0663" (an Arabic-Indic three) are digits to
    # str.isdigit, but no chunk size a user meant to type.
    with pytest.raises(ValueError, match=r"--fuse=.*'auto'"):
        parse_fuse(text)


def test_plot_targets(tmp_path):
    assert _plot_target(False) is None and _plot_target(None) is None
    assert _plot_target(True) == default_plot_path()
    assert _plot_target(tmp_path / "h.png") == (tmp_path / "h.png").resolve()
    with pytest.raises(ValueError, match="plot=3 must be a file path"):
        _plot_target(3)


def test_unknown_arguments_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--epochs", "1", "--colour"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --colour" in capsys.readouterr().err


def test_bench_arguments_go_to_the_bench_parser(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--reps", "0"])
    assert exit_info.value.code == 2
    assert "--reps=0 must be a positive int" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--population", "--members", "0"])
    assert exit_info.value.code == 2
    assert "--members=0 must be a positive int" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["bench", "--models", "mlp-tiny,foo"])
    assert "--models=mlp-tiny,foo: 'foo' is not a benchmark model" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--fuse", "-3"], "--fuse"),
        (["--fuse", "0"], "--fuse"),
        (["--epochs", "0"], "--epochs"),
        (["--plot", "h.png"], "--plot and --no-plot: choose one"),
    ],
)
def test_bad_demo_options_are_usage_errors(argv, named, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["demo", *argv, "--no-plot"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and named in err


def test_a_bench_output_path_is_checked_before_anything_runs(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exited:
        cli.main(["bench", "--json", str(blocker / "out.json"), "--models", "mlp-tiny"])
    assert exited.value.code == 2
    assert "--json" in capsys.readouterr().err
    # A figure matplotlib cannot write is refused before the timing, not after it.
    with pytest.raises(SystemExit) as exited:
        cli.main(["bench", "--plot", str(tmp_path / "h.xyz"), "--models", "mlp-tiny"])
    assert exited.value.code == 2
    assert "matplotlib writes no .xyz files" in capsys.readouterr().err


def test_a_demo_plot_path_is_checked_before_training(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for target, why in (
        (blocker / "h.png", "cannot be made"),
        (tmp_path, "is a folder"),
        ("", "give a file path, or --no-plot"),
        (tmp_path / "h.xyz", "matplotlib writes no .xyz files"),
        (f"{tmp_path / 'plots'}/", "names a folder; give a file name in it"),
        (tmp_path / ("x" * 300 + ".png"), "File name too long"),
    ):
        with pytest.raises(SystemExit) as exited:
            cli.main(["demo", "--plot", str(target)])
        assert exited.value.code == 2
        err = capsys.readouterr()
        assert f"--plot {target}: its folder {why}" in err.err or why in err.err
        assert "fuseloop demo: digits" not in err.out  # nothing trained


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--members", "4"], "--members applies only with --population"),
        (["--zoo", "--population"], "--zoo does not apply"),
        (["--report", "--whole-run"], "separate benchmarks"),
        (["--models", ","], "names no model"),
        (["--whole-run", "--models", "mlp-tiny"], "--models does not apply"),
        (["--population", "--plot", "h.png"], "--plot does not apply to --population"),
        (["--whole-run", "--no-peers"], "--no-peers does not apply to --whole-run"),
        (["--population", "--models", "mlp-large"], "with --population, pick from mlp-tiny"),
    ],
)
def test_bench_options_that_do_not_go_together_are_usage_errors(argv, named, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["bench", *argv])
    assert exited.value.code == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "reps"), [([], 3), (["--quick"], 1), (["--reps", "5"], 5)])
def test_bench_report_times_the_epochs_its_options_ask_for(argv, reps, monkeypatch, capsys):
    """--report times epochs (fl.diagnostics.report's reps); --reps and --quick were refused
    as if it timed nothing."""
    asked = []
    monkeypatch.setattr(
        diagnostics, "report", lambda loop, data, fuse, reps: asked.append(reps) or "text"
    )
    assert cli.main(["bench", "--report", "--models", "mlp-tiny", *argv]) == 0
    assert asked == [reps] and "## mlp-tiny" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["launch", "-n", "0", "script.py"], "-n/--nprocs 0 must be"),
        (["launch", "-n", "100000", "script.py"], "-n/--nprocs 100000 is more than 8 processes"),
        (["launch", "-n", "2", "--grace", "-1", "script.py"], "--grace -1.0 must be"),
        (["launch", "-n", "2", "no-such-script.py"], "script 'no-such-script.py' is not"),
    ],
)
def test_launch_errors_name_its_options_under_its_own_usage(argv, named, capsys):
    """They named launch's parameters (count=0, grace=-1.0) under fuseloop's usage."""
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "usage: fuseloop launch" in err and f"fuseloop launch: error: {named}" in err
    assert "count=" not in err and "grace=" not in err


@pytest.mark.parametrize(
    ("argv", "script", "args"),
    [
        (["t.py", "--", "-5"], "t.py", ["--", "-5"]),  # its `--` was swallowed
        (["t.py", "a", "--", "b"], "t.py", ["a", "--", "b"]),
        (["--", "t.py", "-x"], "t.py", ["-x"]),  # the usual end of launch's options
        (["t.py", "-n", "3", "--port", "5"], "t.py", ["-n", "3", "--port", "5"]),
    ],
)
def test_launch_passes_the_scripts_arguments_as_they_are(argv, script, args, monkeypatch):
    import fuseloop._launch

    started = []
    monkeypatch.setattr(
        fuseloop._launch, "launch", lambda n, path, rest, **options: started.append((path, rest))
    )
    cli.main(["launch", "-n", "2", *argv])
    assert started == [(script, args)]


def test_the_demos_epoch_lines_include_the_epoch_early_stopping_halts_at(capsys):
    import numpy as np

    import fuseloop as fl
    from fuseloop._demo import _demo_loop

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype(np.float32)
    y = rng.integers(0, 3, 32).astype(np.int32)  # noise: validation soon stops improving
    model = fl.models.mlp([16, 3])
    val = [(x[:16], rng.integers(0, 3, 16).astype(np.int32))]
    state = _demo_loop(model, val, progress=False).run([(x, y)], epochs=200)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Epoch")]
    assert state.status == "halted" and len(lines) == len(state.history)


def test_a_demo_a_signal_halts_reports_its_last_validated_epoch_and_exits_130(monkeypatch, capsys):
    # As a first SIGINT leaves it: halted within an epoch, whose validation never ran.
    import fuseloop as fl
    from fuseloop import _demo

    stats = {"dispatches": 9, "chunk_size": 32, "signal": "SIGINT"}
    history = {e: {"loss": 0.5, "validation_accuracy": 0.9 + e / 100} for e in range(3)}
    halted = fl.State(epoch=3, status="halted", stats=stats, history=history)
    for metrics, signal, code in (
        ({"loss": 0.4}, "SIGINT", 130),  # halted within an epoch: never validated
        (dict(history[2]), "SIGTERM", 143),  # halted after the validation, before its end
    ):
        state = halted.replace(metrics=metrics, stats={**stats, "signal": signal})
        monkeypatch.setattr(fl.Loop, "run", lambda self, data, state=state, **options: state)
        assert _demo.demo(epochs=5, plot=False, progress=False) == code
        out = capsys.readouterr().out
        assert "final validation accuracy: 0.9200" in out, out
        assert f"interrupted by {signal}; the accuracy is epoch 3's" in out


def test_a_demo_interrupted_before_its_run_exits_130_without_a_traceback(monkeypatch, capsys):
    from fuseloop import _demo

    def interrupted(**options):
        raise KeyboardInterrupt

    monkeypatch.setattr(_demo, "demo", interrupted)
    assert cli.main(["demo", "--no-plot"]) == 130
    assert "fuseloop demo: interrupted (SIGINT)" in capsys.readouterr().err


def test_a_plot_the_demo_cannot_write_is_said_after_training(tmp_path, capsys):
    import fuseloop as fl
    from fuseloop import _demo

    _demo._write_plot(fl.State(history={0: {"loss": 1.0}}), tmp_path)  # a folder
    assert "no plot:" in capsys.readouterr().out
