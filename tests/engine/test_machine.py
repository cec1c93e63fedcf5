"""The transition table in isolation: legal and illegal sequences, callback order. No disk."""

from __future__ import annotations

import string

import pytest
from hypothesis import given
from hypothesis import strategies as st
from transitions import MachineError

from trainjob.engine import machine
from trainjob.records import Score


class FakeJob:
    """A model with settable guards that records persistence and announcements in memory."""

    def __init__(self, resume=False, budget=True, passes=True, asynchronous=False):
        self.guards = {"should_resume": resume, "within_backoff": budget, "drift_passes": passes,
                       "completion_unannounced": False, "async_save": asynchronous, "commit_landed": False}
        self.record: list[str] = []
        self.fail_persist = False
        machine.build(self)

    def __getattr__(self, name):
        if name in ("guards", "record", "fail_persist"):
            raise AttributeError(name)
        if name in self.guards:
            return lambda ev: self.guards[name]
        if name.startswith(("persist_", "recall_", "hand_off")):
            def persist(ev):
                if self.fail_persist:
                    raise OSError("disk full")
                self.record.append(f"persist {ev.transition.dest} (state still {self.state})")
            return persist
        if name.startswith("announce"):
            return lambda ev: self.record.append(f"announce {name} in {self.state}")
        raise AttributeError(name)

    def should_checkpoint(self, ev):
        return ev.kwargs.get("force", False) or ev.kwargs["step"] % 2 == 0


def test_states_are_the_lab_states_plus_pending_resharded_snapshotted_and_refused():
    # resharded: where a `trainjob reshard` process ends (its own edge from pending);
    # snapshotted: an --async-checkpoint write in flight; refused: what the script handed over
    # (an export) cannot be kept, exit 2, the attempt in flight.
    assert set(machine.STATES) == {"pending", "started", "resumed", "checkpointed", "killed", "refused",
                                   "drift_failed", "job_failed", "completed", "resharded", "snapshotted"}


def test_every_state_but_pending_announces_an_event_with_a_detail_format():
    for state in machine.STATES[1:]:
        assert machine.EVENT_FOR_STATE[state] in machine.DETAIL
    assert set(machine.ANNOUNCED_WITHIN) <= set(machine.DETAIL)


WHOLE = st.integers(min_value=0, max_value=10**12)
# Paths, reasons, signals@ranks. An alphabet, not st.from_regex: the same strings at a tenth of the
# cost (from_regex's first use cost 1.5 s of CPU, enough to trip the fast tier's guard under load).
TEXT = st.text(alphabet=string.ascii_letters + string.digits + "_./,@:=-", min_size=1, max_size=40)


@pytest.mark.parametrize("event", sorted(machine.DETAIL))  # one case per event: its own examples, its own name
@given(data=st.data())
def test_every_detail_parses_back_to_the_facts_it_was_formatted_from(event, data):
    """One template per shape both writes a detail and reads it back, so the views read what the
    machine wrote: a field type or a literal changed on one side only cannot exist."""
    for template in machine.DETAIL[event]:
        expected = {name: data.draw(WHOLE if spec == "int" else TEXT)
                    for _, name, spec, _ in string.Formatter().parse(template) if name is not None}
        facts: dict = {"unrelated": "facts are ignored"}
        scores: dict = {}
        for name, value in expected.items():
            root, _, attr = name.partition(".")
            if attr:  # holdout.correct: an attribute of a Score
                scores.setdefault(root, {})[attr] = value
            else:
                facts[name] = value
        facts.update({root: Score(**fields) for root, fields in scores.items()})
        detail = machine.format_detail(event, facts)
        assert machine.parse_detail(event, detail) == expected, (event, detail)


@pytest.mark.parametrize("event, detail", [
    ("checkpointed", "step=4 loss=0.241"),           # a field renamed
    ("checkpointed", "step=-4 loss_milli=241"),      # not a whole number
    ("checkpointed", "STEP=4 LOSS_MILLI=241"),       # another case
    ("checkpointed", "step=4 loss_milli=241 x=1"),   # more than the machine writes
    ("job_started", "x=1"),
    ("teleported", "step=4"),                        # no such event
])
def test_a_detail_the_machine_would_not_write_parses_to_nothing(event, detail):
    assert machine.parse_detail(event, detail) is None


def test_the_optional_signal_of_a_kill_is_written_only_when_there_was_one():
    assert machine.format_detail("killed", {"at_step": 0, "signal": None}) == "at_step=0"
    assert machine.format_detail("killed", {"at_step": 4, "signal": "SIGTERM"}) == "at_step=4 signal=SIGTERM"
    assert machine.parse_detail("killed", "at_step=4 signal=SIGTERM@rank1") == {"at_step": 4,
                                                                               "signal": "SIGTERM@rank1"}


def test_walkthrough_first_process_kill_at_step_4():
    job = FakeJob(budget=True)
    job.start()
    assert job.state == "started"
    for step in range(1, 5):
        job.checkpoint(step=step)
    assert job.state == "checkpointed"
    job.kill(at_step=4)
    assert job.state == "killed"


def test_terminal_states_are_marked_final():
    m = machine.build(FakeJob())
    assert {s for s in machine.STATES if m.get_state(s).final} == set(machine.FINAL)


def test_walkthrough_second_process_resumes_and_completes():
    job = FakeJob(resume=True)
    job.start()
    assert job.state == "resumed"
    job.checkpoint(step=6)
    job.gate()
    assert job.state == "completed"


def test_start_prefers_resume_over_a_fresh_attempt():
    job = FakeJob(resume=True, budget=True)
    job.start()
    assert job.state == "resumed"


def test_unannounced_completion_is_announced_by_the_next_process():
    job = FakeJob(resume=True, budget=True)
    job.guards["completion_unannounced"] = True
    job.start()
    assert job.state == "completed"
    assert job.record[-2:] == ["announce announce_artifact in completed", "announce announce in completed"]


def test_spent_budget_ends_in_job_failed():
    job = FakeJob(resume=False, budget=False)
    job.start()
    assert job.state == "job_failed"


def test_failing_gate_ends_in_drift_failed():
    job = FakeJob(budget=True, passes=False)
    job.start()
    job.checkpoint(step=2)
    job.gate()
    assert job.state == "drift_failed"


def test_checkpoint_guard_skips_steps_that_are_not_due():
    job = FakeJob(budget=True)
    job.start()
    assert job.checkpoint(step=1) is False
    assert job.state == "started"
    assert job.checkpoint(step=1, force=True) is True
    assert job.state == "checkpointed"


@pytest.mark.parametrize(
    "path, illegal",
    [
        ([], "checkpoint"),                        # nothing before start
        ([], "gate"),
        ([], "kill"),
        (["start"], "start"),                      # one start per process
        (["start"], "gate"),                       # a fresh attempt must train first
        (["start", "kill"], "start"),              # final states are final
        (["start", "kill"], "checkpoint"),
        (["start", ("checkpoint", 2), "gate"], "kill"),
    ],
)
def test_illegal_triggers_raise(path, illegal):
    job = FakeJob(budget=True)
    for trigger in path:
        name, *step = trigger if isinstance(trigger, tuple) else (trigger,)
        getattr(job, name)(**({"step": step[0]} if step else {}))
    with pytest.raises(MachineError):
        getattr(job, illegal)(step=2)


def test_no_auto_transitions():
    job = FakeJob()
    assert not hasattr(job, "to_completed")


def test_persistence_runs_before_the_state_changes_and_announcement_after():
    job = FakeJob(budget=True)
    job.start()
    job.checkpoint(step=2)
    assert job.record == [
        # the start edge persists twice (clean up what killed writers left, then start) and
        # announces twice (the cleanup note, if any, then job_started) -- all in that order
        "persist started (state still pending)", "persist started (state still pending)",
        "announce announce_notes in started", "announce announce in started",
        "persist checkpointed (state still started)", "announce announce in checkpointed",
    ]


def test_completed_announces_the_artifact_before_completion():
    job = FakeJob(resume=True)
    job.start()
    job.record.clear()
    job.gate()
    assert job.record == [
        "persist completed (state still resumed)",
        "persist completed (state still resumed)",
        "announce announce_artifact in completed",
        "announce announce in completed",
    ]


def test_a_failed_persist_leaves_the_state_and_announces_nothing():
    job = FakeJob(budget=True)
    job.start()
    job.record.clear()
    job.fail_persist = True
    with pytest.raises(OSError):
        job.checkpoint(step=2)
    assert job.state == "started"
    assert job.record == []


# --- --async-checkpoint: the loop and the writer part at `checkpoint` and meet at `land` ---------

def test_async_checkpoint_parts_at_the_due_step_and_logs_checkpointed_only_when_the_commit_landed():
    job = FakeJob(budget=True, asynchronous=True)
    job.start()
    job.record.clear()
    assert job.checkpoint(step=1) is False and job.state == "started"  # not due: no snapshot
    job.checkpoint(step=2)
    assert job.state == "snapshotted"
    assert job.land(step=2) is False and job.state == "snapshotted"  # the write is in flight
    job.guards["commit_landed"] = True
    job.land(step=2)
    assert job.state == "checkpointed"
    assert job.record == ["persist snapshotted (state still started)", "announce announce in snapshotted",
                          "persist checkpointed (state still snapshotted)", "announce announce in checkpointed"]


@pytest.mark.parametrize("illegal", ["checkpoint", "gate", "kill"])
def test_no_second_checkpoint_gate_or_logged_kill_while_a_write_is_in_flight(illegal):
    job = FakeJob(budget=True, asynchronous=True)
    job.start()
    job.checkpoint(step=2)
    with pytest.raises(MachineError):
        getattr(job, illegal)(step=4)


def test_a_landed_write_may_be_followed_by_a_kill():
    job = FakeJob(budget=True, asynchronous=True)
    job.start()
    job.checkpoint(step=2)
    job.guards["commit_landed"] = True
    job.land(step=2)
    job.kill(at_step=3)
    assert job.state == "killed"


def test_a_failed_background_write_raised_by_the_guard_leaves_the_write_state_and_logs_nothing():
    job = FakeJob(budget=True, asynchronous=True)
    job.start()
    job.checkpoint(step=2)
    job.record.clear()

    def failed(ev):
        raise OSError("disk full")

    job.guards = {**job.guards}
    job.commit_landed = failed
    with pytest.raises(OSError):
        job.land(step=2)
    assert job.state == "snapshotted" and job.record == []


def test_the_synchronous_table_is_unchanged_for_a_synchronous_job():
    job = FakeJob(budget=True, asynchronous=False)
    job.start()
    job.checkpoint(step=2)
    assert job.state == "checkpointed"
    with pytest.raises(MachineError):
        job.land(step=2)
