"""What a run resumed from a State says and keeps of it: warnings where the resumed run
cannot continue as one uninterrupted run (docs/design.md §5), and the handler metadata it
starts with."""

from __future__ import annotations

import copy
from typing import Any

from .._state import (
    AHEAD_KEY,
    HELD_KEY,
    NONFINITE_KEY,
    POPULATION_KEY,
    RESTORED_KEY,
    UNFINISHED_KEY,
    without_restored,
)
from .._warn import warn

__all__ = ["opening", "resumed_metadata", "warn_on_resume"]


def resumed_metadata(given: Any) -> dict[str, Any]:
    """The handler metadata a run resumed from the State `given` starts with: without what
    `given` said of its own step state (`warn_on_resume` has said it), which a later State
    of the resumed run would otherwise repeat. Which epoch's step state a restoring
    early_stop handed back stays until the first epoch opens (`opening`): the run's
    `started` handlers (early_stop's own) see the step state it names."""
    said = (AHEAD_KEY, HELD_KEY, NONFINITE_KEY, UNFINISHED_KEY)
    kept = {k: v for k, v in given.handler_metadata.items() if k not in said}
    return _fresh_containers(kept)


def _fresh_containers(value: Any) -> Any:
    """`value` with its dicts, lists, sets and tuples (a `defaultdict`, an `OrderedDict`, a
    NamedTuple too) copied at every depth and the rest (arrays, a held step state) shared:
    a handler appending to a list it keeps there must not change the State the run resumed
    from (resuming it again would see the appends)."""
    try:
        return _fresh(value)
    except Exception:  # noqa: BLE001 - a kind that cannot be rebuilt so: shared, as before
        return value


def _fresh(value: Any) -> Any:
    if isinstance(value, dict):
        mapping = copy.copy(value)  # its kind and its defaults (a defaultdict's factory)
        for key, item in value.items():  # set, not `update`: a Counter's adds
            dict.__setitem__(mapping, key, _fresh_containers(item))
        return mapping
    if isinstance(value, list):
        sequence = copy.copy(value)
        sequence[:] = [_fresh_containers(v) for v in value]
        return sequence
    if isinstance(value, set):
        return copy.copy(value)  # its members are hashable: not containers to append to
    if isinstance(value, tuple):
        items = [_fresh_containers(v) for v in value]
        return value._make(items) if hasattr(value, "_make") else type(value)(items)
    return value


def opening(state: Any, epoch: int) -> Any:
    """`state` as `epoch` opens: no step of it taken, no metric, and no longer holding a
    restored best epoch's step state (the steps go on from it)."""
    metadata = without_restored(state.handler_metadata)
    return state.replace(
        epoch=epoch, iteration=0, metrics={}, status="running", handler_metadata=metadata
    )


def warn_on_resume(given: Any, start_epoch: int, epochs: int) -> None:
    """Warns where resuming from the State `given` cannot continue as one uninterrupted
    run: it stopped inside an epoch after stepping some of it (the run repeats that epoch
    from its first batch, on parameters that already took those steps), an epoch's end
    handlers did not finish on it (the run does not redo them), or it already ran the
    `epochs` asked for (nothing is trained)."""
    done = given.event_counts.get("iteration_completed", {})
    stepped = done.get("epoch", 0) if isinstance(done, dict) else 0
    stepped = max(stepped, given.handler_metadata.get(HELD_KEY, 0))  # a fused chunk's rest
    # restore_best handed back the end of the epoch before the one that resumes (a run
    # halted inside the epoch after its best): the resumed run starts from there cleanly.
    clean = given.handler_metadata.get(RESTORED_KEY) == start_epoch - 1
    # A halted State, or one saved while running (a checkpoint at iteration_completed).
    inside = given.status != "completed" and given.epoch == start_epoch and stepped > 0
    # A multi-epoch dispatch's step state ran past the epoch: the warning below says where.
    ahead = given.handler_metadata.get(AHEAD_KEY)
    if inside and not clean and ahead is None:
        warn(
            f"init_state stopped inside epoch {start_epoch} (status {given.status!r}) after "
            f"stepping {stepped} of its batches (its "
            f"last iteration fired: {given.iteration}; both counted from 0, the log's Epoch "
            f"{start_epoch + 1}, iteration {given.iteration + 1}; a fused run steps a "
            f"chunk whole); the resumed run starts epoch {start_epoch} again from its "
            f"first batch, so the batches already stepped train twice. For a run equal to an "
            f"uninterrupted one, resume from an epoch's end (a Loop.checkpoint at epoch_completed, "
            f"its default)",
            RuntimeWarning,
        )
    if ahead is not None:
        warn(
            f"init_state's step state is from epoch {ahead[0]}, iteration {ahead[1]} (a "
            f"dispatch of several epochs ran there before its replay raised in epoch "
            f"{given.epoch}); resuming from epoch {start_epoch} trains those epochs again. "
            f"Resume from a checkpoint written at an epoch's end, or rerun from the start",
            RuntimeWarning,
        )
    _warn_of_unfinished_epoch_end(given, start_epoch)
    restored = None if clean else _restored_phrase(_running_members_note(given))
    if restored is not None and start_epoch < epochs:
        warn(
            f"{restored} (early_stop's restore_best), while its history runs to epoch "
            f"{start_epoch - 1}: the resumed run trains epoch {start_epoch} on from that "
            f"step state, unlike the run it continues: its weights, and its optimizer "
            f"state too (a schedule's step count, a learning rate reduce_lr_on_plateau cut "
            f"later is back as it was; Keras's restore_best_weights restores the weights "
            f"alone). To continue that run, resume from its last epoch's checkpoint "
            f"(Loop.checkpoint); to fine-tune the best weights with a fresh optimizer, "
            f"pass state.params as new variables",
            RuntimeWarning,
        )
    if start_epoch >= epochs:
        warn(
            f"init_state already ran {start_epoch} epochs and epochs={epochs}: nothing is "
            f"trained. epochs counts from the first epoch (as Keras's fit with "
            f"initial_epoch), so pass epochs > {start_epoch} to train more",
            RuntimeWarning,
        )


def _running_members_note(given: Any) -> Any:
    """`given`'s note of a restored best epoch; for a population, its running members'
    only (a halted member stays frozen when the run resumes: nothing trains on from it)."""
    restored = given.handler_metadata.get(RESTORED_KEY)
    population = given.handler_metadata.get(POPULATION_KEY)
    if not isinstance(restored, list) or population is None:
        return restored
    return [None if halted else e for e, halted in zip(restored, population["halted"], strict=True)]


def _restored_phrase(restored: Any) -> str | None:
    """What a State says of the best epoch's step state it holds: an epoch (a solo run's)
    or one per member (None: that member holds its last epoch's)."""
    if restored is None:
        return None
    if not isinstance(restored, list):
        return f"init_state holds epoch {restored}'s step state"
    held = [f"member {i} holds epoch {e}'s" for i, e in enumerate(restored) if e is not None]
    return f"init_state's {', '.join(held)} step state" if held else None


def _warn_of_unfinished_epoch_end(given: Any, start_epoch: int) -> None:
    """Warns where `given` is the State an `epoch_completed` handler raised on: it and the
    handlers after it did not finish that epoch, which the resumed run does not redo."""
    unfinished = given.handler_metadata.get(UNFINISHED_KEY)
    if not isinstance(unfinished, dict) or unfinished.get("epoch") != start_epoch - 1:
        return
    epoch = start_epoch - 1
    redo = f"the checkpoint of epoch {epoch - 1}'s end (Loop.checkpoint)" if epoch else "the start"
    warn(
        f"init_state is the State handler {unfinished.get('handler')} was given at epoch "
        f"{epoch}'s epoch_completed when it raised: it and the handlers after it did not "
        f"finish epoch {epoch} (its validation, early stopping or checkpoint may be "
        f"missing), and the resumed run starts at epoch {start_epoch}. For a run equal to "
        f"an uninterrupted one, resume from {redo}, which trains epoch {epoch} again",
        RuntimeWarning,
    )
