"""Every script in examples/ runs (a smoke test with a tiny budget) and does what it says."""

from __future__ import annotations

import math
import os
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import fuseloop as fl
from conftest import with_compilation_cache

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(autouse=True)
def _examples_on_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # Python puts a script's folder first on sys.path when it runs it; runpy does not, and
    # the digits examples import their shared `_digits` module from there.
    monkeypatch.syspath_prepend(str(EXAMPLES))


def _quick(name: str, *flags: str) -> dict:
    namespace = runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name="example")
    return namespace["main"](["--quick", *flags])


def _finite_history(state: fl.State) -> None:
    assert len(state.history) == 2
    for metrics in state.history.values():
        assert all(math.isfinite(v) for v in metrics.values()), metrics


def test_every_example_has_a_test():
    tested = {
        "linen_cnn_digits",
        "nnx_cnn_digits",
        "equinox_cnn_digits",
        "autoencoder",
        "two_networks_gan",
        "char_transformer",
        "regression",
    }
    # What the examples share (the digits splits, the integer options); not examples.
    shared = {"_digits", "_args"}
    assert {p.stem for p in EXAMPLES.glob("*.py")} == tested | shared


# equinox_cnn_digits runs as a user starts it, in its own process (below).
@pytest.mark.parametrize("name", ["linen_cnn_digits", "nnx_cnn_digits"])
def test_digits_cnn_trains_validates_and_predicts(name, capsys):
    result = _quick(name)
    state = result["state"]
    _finite_history(state)
    assert "validation_accuracy" in state.history[1]
    assert state.history[1]["loss"] < state.history[0]["loss"]  # it learns, even in 8 steps
    predicted = result["predicted"]
    assert predicted.shape == (360,) and set(np.unique(predicted)) <= set(range(10))
    assert result["test_accuracy"] > 0.15  # above chance (0.1) after 8 steps
    assert "test accuracy" in capsys.readouterr().out


def test_autoencoder_resumes_and_reports_its_baseline():
    result = _quick("autoencoder")
    state, first = result["state"], result["first"]
    _finite_history(state)
    assert sorted(first.history) == [0] and sorted(state.history) == [0, 1]
    assert state.history[0] == first.history[0]  # the resumed run kept the first epoch
    assert "validation_mean_absolute_error" in state.history[1]
    assert 0 < result["pca_mse"] < 0.05 and math.isfinite(result["test_mse"])


def test_gan_steps_two_networks():
    result = _quick("two_networks_gan")
    _finite_history(result["state"])
    assert set(result["state"].history[1]) == {"d_loss", "g_loss"}
    assert result["samples"].shape == (2000, 2) and 0 <= result["modes"] <= 8


def test_char_transformer_reads_an_installed_text_and_samples():
    result = _quick("char_transformer")
    _finite_history(result["state"])
    assert 1 < result["perplexity"] < 200 and 10 < result["baseline"] < 60
    assert len(result["sample"]) == 20


def _run_script(name: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python examples/<name>.py --quick` in a fresh process, as a user would run it."""
    # The session's compilation cache: the programs a test above compiled are read from it.
    env = with_compilation_cache(
        {**os.environ, "PYTHONPATH": str(Path(fl.__file__).resolve().parent.parent)}
    )
    return subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), "--quick"],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )


def test_a_digits_example_runs_from_the_command_line_in_another_folder(tmp_path):
    # Run as a user would, in a fresh process, to check the script itself (its imports and
    # its __main__ block), not only its main(); it finds its shared `_digits` module beside
    # it, wherever it is started from.
    done = _run_script("equinox_cnn_digits", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (line,) = [s for s in done.stdout.splitlines() if s.startswith("test accuracy: ")]
    assert float(line.split()[2]) > 0.15  # above chance (0.1) after 8 steps
    assert "last validation accuracy" in done.stdout


def test_regression_compares_the_mlp_with_least_squares(capsys):
    result = _quick("regression")
    _finite_history(result["state"])
    assert "validation_mean_absolute_error" in result["state"].history[1]
    assert 0.3 < result["linear_r2"] < 0.6 and math.isfinite(result["mlp_r2"])
    assert "test R^2: MLP" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["regression", "autoencoder", "char_transformer", "_digits"])
@pytest.mark.parametrize("given", [["--epochs", "0"], ["--fuse", "-1"], ["--epochs", "two"]])
def test_a_bad_count_is_refused_by_the_command_line(name, given, capsys):
    parse = runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name="example")["parse"]
    with pytest.raises(SystemExit):
        parse("An example.", given) if name == "_digits" else parse(given)
    assert f"argument {given[0]}:" in capsys.readouterr().err
