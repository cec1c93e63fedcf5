"""The background saver: one write in flight, on a copy, its error never lost, its wait bounded."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from trainjob.checkpoint.background import BackgroundSaver
from trainjob.errors import NoSpace, TryAgainLater, UsageError, WriteTimeout


def live_state() -> dict[str, np.ndarray]:
    return {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, dtype=np.float64)}


def test_hand_off_returns_while_the_write_runs_on_another_thread():
    saver, release, seen = BackgroundSaver(timeout=5), threading.Event(), {}

    def write(arrays):
        seen["thread"] = threading.current_thread()
        release.wait(5)
        return "committed"

    saver.hand_off(live_state(), 2, write)
    assert saver.in_flight and not saver.done() and not saver.landed()  # the loop goes on meanwhile
    release.set()
    saver.wait()
    assert seen["thread"] is not threading.main_thread()
    assert saver.landed() and saver.take() == "committed" and not saver.in_flight


def test_the_write_sees_the_state_as_it_was_at_the_hand_off_not_as_training_changed_it():
    saver, release, seen = BackgroundSaver(timeout=5), threading.Event(), {}
    state = live_state()

    def write(arrays):
        release.wait(5)
        seen.update({n: a.copy() for n, a in arrays.items()})

    saver.hand_off(state, 2, write)
    state["w"] += 100  # the trainer steps on in place while the write is in flight
    release.set()
    saver.wait()
    saver.take()
    np.testing.assert_array_equal(seen["w"], np.arange(6, dtype=np.float32).reshape(2, 3))


def test_staging_buffers_are_reused_by_every_checkpoint():
    saver, state, held = BackgroundSaver(timeout=5), live_state(), []
    for step in (2, 4, 6):
        state["w"] += 1
        saver.hand_off(state, step, lambda arrays: held.append({n: a.ctypes.data for n, a in arrays.items()}))
        saver.wait()
        saver.take()
    assert held[0] == held[1] == held[2]  # one staging copy of the state, not one per checkpoint
    assert not any(np.shares_memory(saver.host.buffers[n], state[n]) for n in state)


def test_prepare_allocates_the_buffers_the_first_checkpoint_then_uses():
    saver, held = BackgroundSaver(timeout=5), []
    saver.prepare(live_state())
    prepared = {n: b.ctypes.data for n, b in saver.host.buffers.items()}
    saver.hand_off(live_state(), 2, lambda arrays: held.append({n: a.ctypes.data for n, a in arrays.items()}))
    saver.wait()
    saver.take()
    assert held == [prepared]


def test_a_second_checkpoint_cannot_start_while_one_is_in_flight():
    saver, release = BackgroundSaver(timeout=5), threading.Event()
    saver.hand_off(live_state(), 2, lambda arrays: release.wait(5))
    with pytest.raises(RuntimeError, match="in flight"):
        saver.hand_off(live_state(), 4, lambda arrays: None)
    release.set()
    saver.wait()


def test_a_writer_error_is_raised_once_at_the_boundary_that_asks_then_the_slot_is_free():
    saver = BackgroundSaver(timeout=5)

    def write(arrays):
        raise NoSpace("/pvc/checkpoints: 0 bytes free")

    saver.hand_off(live_state(), 2, write)
    saver.wait()  # waiting does not raise it: the boundary that asks does
    with pytest.raises(NoSpace, match="0 bytes free"):
        saver.landed()
    assert not saver.in_flight and not saver.landed()  # reported once, not again
    saver.hand_off(live_state(), 4, lambda arrays: "ok")  # and the next checkpoint may start
    saver.wait()
    assert saver.take() == "ok"


def test_the_wait_is_bounded_and_says_so_with_exit_75():
    saver, release = BackgroundSaver(timeout=0.05), threading.Event()
    saver.hand_off(live_state(), 2, lambda arrays: release.wait(5))
    began = time.monotonic()
    with pytest.raises(WriteTimeout, match="checkpoint step 2 did not end within 0.05s") as caught:
        saver.wait()
    assert time.monotonic() - began < 2 and isinstance(caught.value, TryAgainLater)
    release.set()
    saver.close(5)


def test_back_pressure_wait_is_counted_as_stall():
    saver = BackgroundSaver(timeout=5)
    saver.hand_off(live_state(), 2, lambda arrays: time.sleep(0.2))
    copy_only = saver.stall_seconds
    saver.wait()
    assert copy_only < 0.1 <= saver.stall_seconds


def test_a_state_that_changed_shape_is_refused_before_any_write_starts():
    saver, state, started = BackgroundSaver(timeout=5), live_state(), []
    saver.hand_off(state, 2, started.append)
    saver.wait()
    saver.take()
    state["w"] = np.zeros((3, 3), dtype=np.float32)
    with pytest.raises(UsageError, match="step 4"):
        saver.hand_off(state, 4, started.append)
    assert len(started) == 1 and not saver.in_flight


def test_a_write_staged_without_start_waits_for_start_and_close_drops_it_if_never_started():
    """The engine logs ``snapshotted`` between the copy and the write's start (overlap.py)."""
    saver, seen = BackgroundSaver(timeout=5), []
    saver.hand_off(live_state(), 2, lambda arrays: seen.append(threading.current_thread()), start=False)
    time.sleep(0.05)
    assert seen == [] and saver.in_flight and not saver.done()
    with pytest.raises(RuntimeError, match="never started"):
        saver.wait()
    saver.start()
    with pytest.raises(RuntimeError, match="start"):
        saver.start()  # once
    saver.wait()
    assert saver.take() is None and len(seen) == 1 and seen[0] is not threading.main_thread()
    saver.hand_off(live_state(), 4, lambda arrays: seen.append(threading.current_thread()), start=False)
    began = time.perf_counter()
    saver.close(timeout=5)  # an error ended the run between the copy and the start: nothing to wait for
    assert time.perf_counter() - began < 1 and not saver.in_flight
    seen[0].join(5)
    assert len(seen) == 1 and not seen[0].is_alive()


def test_release_drops_the_staging_copy_but_never_under_a_write_in_flight():
    saver, release = BackgroundSaver(timeout=5), threading.Event()
    saver.hand_off(live_state(), 2, lambda arrays: release.wait(5))
    with pytest.raises(RuntimeError, match="in flight"):
        saver.release()
    release.set()
    saver.wait()
    saver.take()
    saver.release()
    assert saver.host.buffers == {}


def test_every_write_runs_on_the_one_writer_thread_prepare_started_and_release_ends_it():
    """Starting a thread per checkpoint stalled the loop until it was scheduled (5 ms median on 2
    loaded cores, a third of an async checkpoint's stall at 1.5 MiB): the writer is started before
    the loop and handed each write."""
    saver, state, seen = BackgroundSaver(timeout=5), live_state(), []
    saver.prepare(state)
    for step in (2, 4, 6):
        saver.hand_off(state, step, lambda arrays: seen.append(threading.current_thread()))
        saver.wait()
        saver.take()
    assert len(seen) == 3 and seen[0] is seen[1] is seen[2] and seen[0] is not threading.main_thread()
    saver.release()
    assert not seen[0].is_alive()


def test_a_saver_dropped_without_release_leaves_no_thread_behind():
    import gc

    saver, seen = BackgroundSaver(timeout=5), []
    saver.hand_off(live_state(), 2, lambda arrays: seen.append(threading.current_thread()))
    saver.wait()
    saver.take()
    del saver
    gc.collect()
    seen[0].join(5)
    assert not seen[0].is_alive()
