"""`fuseloop launch`: process ids and coordinator in the environment, prefixed output,
non-zero exit when a process fails, the others stopped in bounded time; `--version`."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import textwrap
import time
from importlib import metadata

import pytest

from fuseloop import cli
from fuseloop._launch import launch

# Plain Python (no jax): these tests check the launcher itself, in well under a second.
_ECHO = textwrap.dedent("""
    import os, sys
    print("id", os.environ["FUSELOOP_PROCESS_ID"], "of", os.environ["FUSELOOP_NUM_PROCESSES"],
          "at", os.environ["FUSELOOP_COORDINATOR"], "args", sys.argv[1:])
    print("second line")
""")

_ONE_FAILS = textwrap.dedent("""
    import os, sys, time
    if os.environ["FUSELOOP_PROCESS_ID"] == "1":
        print("failing", flush=True)
        sys.exit(3)
    time.sleep(600)  # would hang forever without the launcher stopping it
""")

_IGNORES_SIGTERM = textwrap.dedent("""
    import os, signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.environ["FUSELOOP_PROCESS_ID"] == "0":
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)
""")


def _script(tmp_path, text):
    path = tmp_path / "script.py"
    path.write_text(text)
    return str(path)


def test_each_process_gets_its_id_and_its_output_is_prefixed(tmp_path):
    out = io.StringIO()
    code = launch(3, _script(tmp_path, _ECHO), ["--epochs", "2"], out=out)
    assert code == 0
    lines = out.getvalue().splitlines()
    address = {line.split(" at ")[1].split()[0] for line in lines if " at " in line}
    assert len(address) == 1 and address.pop().startswith("127.0.0.1:")
    for index in range(3):
        mine = [line for line in lines if line.startswith(f"[{index}] ")]
        assert mine[0].startswith(f"[{index}] id {index} of 3 at 127.0.0.1:")
        assert mine[0].endswith("args ['--epochs', '2']")
        assert mine[1] == f"[{index}] second line"


def test_a_failing_process_fails_the_launch_and_stops_the_others(tmp_path):
    out = io.StringIO()
    began = time.monotonic()
    code = launch(2, _script(tmp_path, _ONE_FAILS), out=out, grace=2.0)
    assert code == 3
    assert time.monotonic() - began < 60  # bounded: the sleeping process was stopped
    text = out.getvalue()
    assert "[1] failing" in text
    assert "[launch] process 1 exited with code 3; stopping the other processes" in text


def test_a_process_that_ignores_sigterm_is_killed(tmp_path):
    out = io.StringIO()
    code = launch(2, _script(tmp_path, _IGNORES_SIGTERM), out=out, grace=0.5)
    assert code == 128 + 9
    assert "[launch] process 0 was killed by SIGKILL" in out.getvalue()


def test_the_command_line(tmp_path):
    script = _script(tmp_path, _ECHO)
    result = subprocess.run(
        [sys.executable, "-m", "fuseloop.cli", "launch", "-n", "2", script, "--fuse", "4", "-x"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "[1] id 1 of 2" in result.stdout and "args ['--fuse', '4', '-x']" in result.stdout
    with pytest.raises(SystemExit):
        cli.main(["launch", "-n", "0", script])
    with pytest.raises(SystemExit):
        cli.main(["launch", "-n", "2", str(tmp_path / "missing.py")])


def test_bad_coordination_options_are_refused(tmp_path, capsys):
    script = _script(tmp_path, _ECHO)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    held = busy.getsockname()[1]
    for option, value, named in (
        ("--failure-timeout", "-1", "--failure-timeout -1 must be"),
        ("--failure-timeout", "1000000000", "1 to 100000000"),  # jax's C int
        ("--port", "99999", "--port 99999 must be"),
        ("--port", str(held), f"--port {held} cannot be bound here"),
    ):
        with pytest.raises(SystemExit):
            cli.main(["launch", "-n", "2", option, value, script])
        assert named in capsys.readouterr().err
    busy.close()
    # From Python, a port or timeout that is no whole number is refused, not rounded.
    for options, named in (
        ({"port": 1234.5}, "port=1234.5"),
        ({"failure_timeout": 2.5}, "failure_timeout=2.5"),
    ):
        with pytest.raises(ValueError, match=named):
            launch(2, script, **options)


def test_a_missing_script_is_the_one_thing_named_and_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["launch", "-n", "2"])
    err = capsys.readouterr().err
    assert err.rstrip().endswith("the following arguments are required: script"), err
    assert "script [args ...]" in err
    with pytest.raises(SystemExit):
        cli.main(["launch", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "(default: 10)" in shown and "(default: 5)" in shown


def test_sigterm_to_the_launcher_stops_its_processes(tmp_path):
    pids = tmp_path / "pids"
    script = _script(
        tmp_path,
        "import os, time\n"
        f"open({str(pids)!r} + os.environ['FUSELOOP_PROCESS_ID'], 'w').write(str(os.getpid()))\n"
        "time.sleep(600)\n",
    )
    launcher = subprocess.Popen(
        [sys.executable, "-m", "fuseloop.cli", "launch", "-n", "2", "--grace", "1", script]
    )
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"pids{i}").exists() for i in range(2)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    children = [int((tmp_path / f"pids{i}").read_text()) for i in range(2)]
    launcher.terminate()
    assert launcher.wait(timeout=60) == 128 + 15
    for pid in children:
        with pytest.raises(ProcessLookupError):
            for _ in range(100):  # the children may take a moment to be reaped
                os.kill(pid, 0)
                time.sleep(0.05)


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out.strip()
    assert printed == f"fuseloop {metadata.version('fuseloop')}"
