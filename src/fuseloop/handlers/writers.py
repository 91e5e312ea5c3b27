"""Metric writers: CSV files and TensorBoard event files.

Both write only what the loop already read on the host (the metrics handlers see), with the
epoch/iteration counters as their x-axis, so a fused and an unfused run write the same rows
and the same scalar events.
"""

from __future__ import annotations

import csv
import itertools
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, Self, TypeVar

import jax.numpy as jnp
import numpy as np

from .._arg_types import require_room
from .._distributed import main_process_only
from .._events import ITERATION_EVENTS, Event, Filter, closes_on_error, make_filter, normalize_event
from .._population import population_record
from .._state import POPULATION_KEY, State
from .._warn import warn


class _Registers(Protocol):
    """What `attach_writer` needs of a loop (handlers do not import the Loop builder)."""

    def handle_event(self, event: Any, handler: Any, filter: Any = ..., name: str = ...) -> Self:
        """A copy of the loop with `handler` attached to `event`."""
        ...


_LoopT = TypeVar("_LoopT", bound=_Registers)

__all__ = ["CSVWriter", "TensorBoardWriter", "attach_writer", "scalar_metrics"]

_INDEX_COLUMNS = ("epoch", "iteration", "step")
_writer_ids = itertools.count()


def scalar_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The metrics as Python floats, ready for a CSV row or TensorBoard scalars.

    Scalars keep their name; a one-dimensional array (a population's metric, one value per
    member) becomes `name[i]`; anything else is skipped.

    Example:
        >>> scalar_metrics({"loss": np.float32(0.5), "acc": np.array([1.0, 0.5]), "name": "x"})
        {'loss': 0.5, 'acc[0]': 1.0, 'acc[1]': 0.5}
        >>> scalar_metrics({"norm": jnp.bfloat16(3.0), "stopped": True})
        {'norm': 3.0, 'stopped': 1.0}
    """
    out = {}
    for name, value in metrics.items():
        try:
            array = np.asarray(value)
        except Exception:  # noqa: BLE001 - not array-like: not a scalar metric
            continue
        # (JAX's dtypes know bfloat16 and the float8s, which numpy's do not call numbers;
        # a bool is written as the log prints it, 0.0 or 1.0)
        if not (jnp.issubdtype(array.dtype, jnp.number) or array.dtype == np.bool_):
            continue
        if array.size == 1:
            out[name] = float(array.reshape(()))
        elif array.ndim == 1:  # one value per member: a column (or a tag) each
            out.update({f"{name}[{i}]": float(v) for i, v in enumerate(array)})
    return out


def _step(state: State, event: Event) -> int:
    """The x-axis value of a row or a scalar.

    It is the epoch for epoch events, and the event's total count (1-based, across epochs
    and resumed runs) for iteration events.
    """
    if event in ITERATION_EVENTS:
        return int(state.event_counts[event.value]["total"])
    return int(state.epoch)


def _first_step(state: State, event: Event) -> int:
    """The step of the first row or scalar a run resumed from `state` writes."""
    if event in ITERATION_EVENTS:
        counts = state.event_counts.get(event.value)
        return 1 + (int(counts["total"]) if isinstance(counts, dict) else 0)
    return int(state.epoch)


class CSVWriter:
    """Appends one row of `epoch, iteration, step, <metrics...>` per firing.

    A fresh run starts a new file; a run resumed from a State continues the file, dropping
    the rows of epochs the resumed run is about to redo (and warning, for epoch rows, where
    the rows it keeps are not that State's: another run wrote the file since). A metric
    that appears later (e.g. validation on some epochs only) adds a column and the file is
    rewritten with it.

    Example:
        >>> import csv, os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "metrics.csv")
        >>> state = loop.csv_log(path, event="epoch_completed").run(batches, epochs=2)
        >>> [row["epoch"] for row in csv.DictReader(open(path))]
        ['0', '1']
    """

    # One run at a time: it keeps its run's columns and last row written (engine/serving.py).
    fuseloop_serves_one_run = True

    def __init__(self, path: str | os.PathLike[str], event: Any = "epoch_completed"):
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ValueError(f"path={path!r} must be a file path")
        self.path, self.event = Path(path), normalize_event(event)
        require_room(self.path, f"path={str(path)!r}", "file")
        self.columns: list[str] = []
        self.written: int | None = None  # the epoch of the last row (`catch_up_on_halt`)

    def start(self, state: State) -> None:
        """Opens the file at run start: a fresh one, or the resumed run's rows kept."""
        self.written = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        rows: list[dict[str, str]] = []
        if state.history and self.path.exists():
            rows = [row for row in self._read() if int(row["epoch"]) < state.epoch]
            if self.event not in ITERATION_EVENTS:  # its rows are the history's epochs
                _warn_of_other_runs_rows(self.path, rows, state.history)
        self.columns = list(self._header()) if rows else []
        self._rewrite(rows)

    def _header(self) -> list[str]:
        with open(self.path, newline="") as handle:
            return next(csv.reader(handle), [])

    def _read(self) -> list[dict[str, str]]:
        with open(self.path, newline="") as handle:
            return list(csv.DictReader(handle))

    def _rewrite(self, rows: list[dict[str, str]]) -> None:
        with open(self.path, "w", newline="") as handle:
            if self.columns:
                writer = csv.DictWriter(handle, self.columns, restval="")
                writer.writeheader()
                writer.writerows(rows)

    def __call__(self, state: State) -> None:
        """Appends one row: epoch, iteration, step and the State's scalar metrics."""
        row = {
            "epoch": str(state.epoch),
            "iteration": str(state.iteration),
            "step": str(_step(state, self.event)),
        }
        metrics = scalar_metrics(state.metrics)
        _refuse_index_names(metrics, self.path)  # a handler's metric, added after attaching
        # repr is the shortest text that reads back as the same float.
        row.update({k: repr(v) for k, v in metrics.items()})
        self.written = state.epoch
        new = [name for name in row if name not in self.columns]
        if new:
            rows = self._read() if self.columns else []
            self.columns = self.columns or list(_INDEX_COLUMNS)
            self.columns += [name for name in new if name not in self.columns]
            self._rewrite(rows)
        with open(self.path, "a", newline="") as handle:
            csv.DictWriter(handle, self.columns, restval="").writerow(row)

    def close(self, state: State) -> None:
        """Nothing stays open between rows; present for a uniform writer interface."""


def _warn_of_other_runs_rows(path: Path, rows: list[dict[str, str]], history: Any) -> None:
    """Warns where the rows a resumed run keeps are not its State's own epochs.

    Another run wrote the file after that State was taken (one path for two runs).
    """
    for row in rows:
        recorded = scalar_metrics(history.get(int(row["epoch"]), {}))
        apart = [
            name for name, value in recorded.items() if row.get(name, "") not in ("", repr(value))
        ]
        if apart:
            name = apart[0]
            warn(
                f"csv_log: {str(path)!r} holds a row for epoch {row['epoch']} that is not "
                f"the resumed State's ({name} {row[name]} in the file, "
                f"{recorded[name]!r} in its history): another run wrote the file after "
                f"this State was taken, or a handler attached after csv_log changed {name} "
                "(a row holds what the writer saw). The earlier epochs' rows are kept as "
                "the file has them; give each run its own file, or resume from the State "
                "of the run that wrote it"
            )
            return


def _tag(name: str) -> tuple[str, int | None]:
    """A scalar's TensorBoard tag, and the population member it is of (None: none).

    A member's `loss[1]` is tagged `loss/member_1` (tensorboardX would write `loss_1_`).
    """
    found = re.fullmatch(r"(.*)\[(\d+)\]", name)
    if found is None:
        return name, None
    return f"{found.group(1)}/member_{found.group(2)}", int(found.group(2))


class TensorBoardWriter:
    """Writes each scalar metric as a TensorBoard scalar (tensorboardX).

    Tags are `<prefix><metric>`, with the prefix "epoch/" for epoch events and
    "iteration/" for iteration events unless given (a population member's
    `<prefix><metric>/member_<i>`, written until the member stops); the global step is the
    epoch or the iteration event's total count. One event file per run.

    Example:
        >>> import os, tempfile
        >>> logdir = tempfile.mkdtemp()
        >>> state = loop.tensorboard(logdir, event="epoch_completed").run(batches, epochs=2)
        >>> len(os.listdir(logdir))  # one event file per run
        1
    """

    # One run at a time: it keeps its run's open event file (engine/serving.py).
    fuseloop_serves_one_run = True

    def __init__(
        self,
        logdir: str | os.PathLike[str],
        event: Any = "epoch_completed",
        prefix: str | None = None,
    ):
        if not isinstance(logdir, (str, os.PathLike)) or not str(logdir):
            raise ValueError(f"logdir={logdir!r} must be a directory path")
        self.logdir, self.event = Path(logdir), normalize_event(event)
        require_room(self.logdir, f"logdir={str(logdir)!r}", "directory")
        if prefix is None:
            prefix = "iteration/" if self.event in ITERATION_EVENTS else "epoch/"
        if not isinstance(prefix, str):
            raise ValueError(f"prefix={prefix!r} must be a string")
        self.prefix = prefix
        self._summary_writer()  # a missing tensorboardX is reported at attach time
        self.beside: Event | None = None  # the event of another writer of the logdir
        self.writer: Any = None
        self.written: int | None = None  # the epoch last written (`catch_up_on_halt`)

    @staticmethod
    def _summary_writer() -> Any:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ImportError(
                "the TensorBoard writer needs tensorboardX: pip install fuseloop[tensorboard]"
            ) from None
        return SummaryWriter

    def start(self, state: State) -> None:
        """Opens a new event file in `logdir` at run start.

        A run resumed from a State purges the points of the steps it is about to redo
        (TensorBoard hides the earlier files' events from that step on), as the CSV writer
        drops their rows.
        """
        self.close(state)
        self.written = None
        suffix = f".{os.getpid()}.{next(_writer_ids)}"  # two runs in one second: two files
        purge = _first_step(state, self.event) if state.history else None
        if purge is not None and self.beside not in (None, self.event):
            warn(
                f"tensorboard({str(self.logdir)!r}): this logdir's writers count steps "
                f"apart ({self.event.value}, {self.beside.value}); a resumed run hides each "
                f"one's earlier points from the first step it redraws, and TensorBoard "
                f"hides them in every tag of the logdir, so each hides points of the other "
                f"that are not redrawn. Give each writer its own logdir, e.g. tb/epoch and "
                f"tb/iteration",
                UserWarning,
            )
        self.writer = self._summary_writer()(
            str(self.logdir), filename_suffix=suffix, purge_step=purge
        )

    def __call__(self, state: State) -> None:
        """Writes the State's scalar metrics at this event's step."""
        if self.writer is None:
            self.start(state)
        step = _step(state, self.event)
        population = POPULATION_KEY in state.handler_metadata
        halted = population_record(state)["halted"] if population else ()
        for name, value in scalar_metrics(state.metrics).items():
            tag, member = _tag(name) if population else (name, None)
            if member is not None and halted[member] and math.isnan(value):
                continue  # a member stopped: its solo run would have written nothing more
            self.writer.add_scalar(self.prefix + tag, value, global_step=step)
        self.written = state.epoch

    def close(self, state: State) -> None:
        """Closes the event file (at run end); a later event opens a new one."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def attach_writer(
    loop: _LoopT, writer: CSVWriter | TensorBoardWriter, event: Any, filter: Any, name: str
) -> _LoopT:
    """Registers `writer` on `event`, plus its start (run start) and close (run end).

    Under jax.distributed only process 0 writes (the others see the same metrics).

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "m.csv")
        >>> writing = attach_writer(loop, CSVWriter(path), "epoch_completed", "always", "csv")
        >>> [r.name for r in writing.registrations]
        ['csv:start', 'csv', 'csv:close', 'csv:halted', 'csv:close']
    """
    _check_shared_target(loop, writer, name)
    if isinstance(writer, CSVWriter):
        _refuse_index_names([m.name for m in getattr(loop, "metrics", ())], writer.path)
    start = main_process_only(writer.start)
    close = closes_on_error(main_process_only(writer.close))  # a run that raises closes it too
    loop = loop.handle_event("started", start, name=f"{name}:start")
    loop = loop.handle_event(event, main_process_only(writer), filter, name=name)
    loop = loop.handle_event("completed", close, name=f"{name}:close")
    if writer.event == Event.EPOCH_COMPLETED:
        catch_up = main_process_only(catch_up_on_halt(writer, make_filter(filter)))
        loop = loop.handle_event("halted", catch_up, name=f"{name}:halted")
    return loop.handle_event("halted", close, name=f"{name}:close")


def catch_up_on_halt(writer: Any, spec: Filter) -> Callable[[State], None]:
    """A "halted" handler writing the epoch whose end halted the run.

    Where a handler attached before the writer halted at an epoch's end, the rest of that
    event's handlers do not run; the epoch is in the history, so its row belongs in the
    file, as Keras's CSVLogger writes the epoch its EarlyStopping ends. Only where the
    writer's filter passes for that epoch.
    """

    def write_missed(state: State) -> None:
        last = max(state.history, default=None)
        if last is None or last != state.epoch or writer.written == last:
            return  # nothing complete, halted inside a later epoch, or written already
        count = state.event_counts.get(Event.EPOCH_COMPLETED.value)
        ended = state.replace(metrics=dict(state.history[last]))
        if not isinstance(count, int) or not spec.by_count(count):
            return
        if not spec.admits(ended):
            return
        writer(ended)

    return write_missed


def _refuse_index_names(names: Any, path: Path) -> None:
    """Refuses a metric named as a CSV index column.

    Its value would overwrite the column (and a resume would read the file's epochs wrong).
    """
    for name in names:
        if name in _INDEX_COLUMNS:
            raise ValueError(
                f"csv_log({str(path)!r}): a metric is named {name!r}, as the file's own "
                f"{name!r} column is, which its value would overwrite; give the metric "
                f"another name, e.g. loop.metric(fn, name='{name}_value')"
            )


def _check_shared_target(loop: Any, writer: CSVWriter | TensorBoardWriter, name: str) -> None:
    """Refuses a second CSV writer on one file; notes a TensorBoard writer's neighbour.

    Two CSV writers rewrite each other's rows; a TensorBoard resume's purge hides the other
    writer's points (TensorBoard purges every tag of a logdir from the step a file gives).
    """
    target = _target(writer)
    for registration in loop.registrations:
        other = getattr(registration.handler, "__wrapped__", None)
        if type(other) is not type(writer) or _target(other) != target:
            continue
        if isinstance(writer, TensorBoardWriter):
            writer.beside = other.event  # said when a resume purges (`TensorBoardWriter.start`)
            continue
        raise ValueError(
            f"{name}({str(target)!r}): another {name} of this loop writes that file already "
            f"(on {other.event.value}); give each writer its own file"
        )


def _target(writer: Any) -> Path:
    return Path(writer.path if isinstance(writer, CSVWriter) else writer.logdir).resolve()
