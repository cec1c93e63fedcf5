"""The pure decisions, including the lab's boundary cases, checked exhaustively or by property."""

from fractions import Fraction

from hypothesis import given
from hypothesis import strategies as st

from trainjob.engine.decisions import (MAX_COUNT, METRIC_PARTS, completion_announced, completion_unannounced,
                                      drift_passes, loss_milli, metric_counts, should_checkpoint, should_resume,
                                      within_backoff)

counts = st.integers(min_value=0, max_value=10_000)
percent = st.integers(min_value=0, max_value=100)


class TestDriftPasses:
    def test_lab_numbers(self):
        assert drift_passes(20, 20, 20, 20)
        assert drift_passes(16, 20, 20, 20)  # exactly on the boundary: 1600 >= 1600
        assert not drift_passes(15, 20, 20, 20)
        assert not drift_passes(14, 20, 20, 20)  # the forced-zero model

    def test_max_drop_zero_needs_the_baseline_count(self):
        assert drift_passes(20, 20, 20, 0)
        assert not drift_passes(19, 20, 20, 0)

    @given(counts, percent)
    def test_empty_holdout_never_passes(self, bcorrect, max_drop):
        assert not drift_passes(0, 0, bcorrect, max_drop)

    @given(counts, counts, percent)
    def test_agrees_with_exact_rational_rule(self, correct, bcorrect, max_drop):
        exact = Fraction(correct) >= Fraction(bcorrect) * Fraction(100 - max_drop, 100)
        assert drift_passes(correct, max(correct, 1), bcorrect, max_drop) == exact

    @given(counts, counts, percent)
    def test_more_correct_never_turns_pass_into_fail(self, correct, bcorrect, max_drop):
        if drift_passes(correct, correct + 1, bcorrect, max_drop):
            assert drift_passes(correct + 1, correct + 1, bcorrect, max_drop)


LARGEST = MAX_COUNT / METRIC_PARTS  # the largest metric Run.gate accepts
metrics = st.floats(min_value=0, max_value=LARGEST, allow_nan=False)
baselines = st.floats(min_value=1e-9, max_value=LARGEST, allow_nan=False)


def metric_passes(value: float, baseline: float, higher_is_better: bool, max_drop: int) -> bool:
    return drift_passes(*metric_counts(value, baseline, higher_is_better), max_drop)


class TestMetricCounts:
    """A metric against its frozen baseline, judged by the Score rule on whole millionths."""

    def test_a_loss_and_an_accuracy_on_and_around_the_boundary(self):
        assert metric_passes(0.625, 0.5, False, 20)  # 0.625 less 20% of itself is 0.5: on the boundary
        assert not metric_passes(0.626, 0.5, False, 20)
        assert metric_passes(0.8, 1.0, True, 20) and not metric_passes(0.799999, 1.0, True, 20)
        assert metric_counts(0.41, 0.52, False) == (1268293, METRIC_PARTS, METRIC_PARTS)  # 0.52 / 0.41

    @given(metrics, baselines, st.booleans(), percent)
    def test_counts_are_whole_numbers_a_log_and_json_keep_exact(self, value, baseline, higher, max_drop):
        correct, total, bcorrect = metric_counts(value, baseline, higher)
        assert total == METRIC_PARTS and all(isinstance(n, int) and 0 <= n <= MAX_COUNT for n in (correct, bcorrect))

    @given(metrics, baselines, st.booleans(), percent)
    def test_a_metric_as_good_as_its_baseline_always_passes(self, value, baseline, higher, max_drop):
        as_good = value >= baseline if higher else value <= baseline
        if as_good:
            assert metric_passes(value, baseline, higher, max_drop)

    @given(metrics, metrics, baselines, st.booleans(), percent)
    def test_a_better_metric_never_turns_pass_into_fail(self, value, other, baseline, higher, max_drop):
        worse, better = sorted((value, other), reverse=not higher)
        if metric_passes(worse, baseline, higher, max_drop):
            assert metric_passes(better, baseline, higher, max_drop)

    @given(metrics, baselines, st.booleans(), percent, percent)
    def test_more_tolerance_never_turns_pass_into_fail(self, value, baseline, higher, drop, more):
        if metric_passes(value, baseline, higher, min(drop, more)):
            assert metric_passes(value, baseline, higher, max(drop, more))

    @given(st.floats(min_value=1e-3, max_value=1e6), st.floats(min_value=1e-3, max_value=1e6), st.booleans(), percent)
    def test_agrees_with_the_exact_rule_away_from_its_rounding(self, value, baseline, higher, max_drop):
        """Higher is better: value >= baseline * (100 - d) / 100. Lower: value * (100 - d) / 100 <=
        baseline. Exactly, in rationals, wherever the two sides are more than the millionths'
        rounding apart."""
        v, b, keep = Fraction(value), Fraction(baseline), Fraction(100 - max_drop, 100)
        margin = (v - b * keep) / b if higher else (b - v * keep) / v
        if abs(margin) > Fraction(1, 10**5):
            assert metric_passes(value, baseline, higher, max_drop) == (margin >= 0)


class TestWithinBackoff:
    @given(st.integers(min_value=0, max_value=1000))
    def test_limit_b_allows_b_plus_one_attempts(self, limit):
        allowed = [n for n in range(limit + 5) if within_backoff(n, limit)]
        assert allowed == list(range(limit + 1))

    def test_lab_case(self):
        assert within_backoff(1, 1)
        assert not within_backoff(2, 1)


class TestShouldResume:
    def test_an_attempt_cut_short_is_resumed_even_before_its_first_checkpoint(self):
        for state in ("started", "resumed", "checkpointed", "killed"):
            assert should_resume(state, None, 10)
            assert should_resume(state, 4, 10)
            assert should_resume(state, 10, 10)  # killed after the last checkpoint, before the gate

    def test_an_attempt_that_ended_is_never_resumed(self):
        for state in ("completed", "drift_failed", "job_failed"):
            assert not should_resume(state, 4, 10)
            assert not should_resume(state, 10, 10)

    def test_without_a_run_record_the_lab_rule_applies(self):
        assert should_resume(None, 4, 10)
        assert not should_resume(None, 10, 10)  # a finished-but-failed attempt is not a resume
        assert not should_resume(None, None, 10)


class TestShouldCheckpoint:
    @given(st.integers(1, 500), st.integers(1, 50), st.integers(1, 500))
    def test_every_k_steps_and_always_the_last(self, step, every, steps):
        assert should_checkpoint(step, every, steps) == (step % every == 0 or step == steps)

    def test_lab_schedule(self):
        assert [s for s in range(1, 11) if should_checkpoint(s, 2, 10)] == [2, 4, 6, 8, 10]
        assert [s for s in range(1, 8) if should_checkpoint(s, 3, 7)] == [3, 6, 7]


def test_loss_milli_rounds_half_away_from_zero():
    assert loss_milli(0.2405) == 241  # Python's round() would give 240 (banker's rounding)
    assert loss_milli(0.2404) == 240
    assert loss_milli(0.0) == 0


def test_completion_is_unannounced_only_when_committed_but_not_logged():
    assert completion_unannounced("completed", log_says_completed=False)
    assert not completion_unannounced("completed", log_says_completed=True)
    for state in (None, "checkpointed", "killed", "drift_failed"):
        assert not completion_unannounced(state, log_says_completed=False)


@given(state=st.sampled_from([None, "started", "resumed", "checkpointed", "killed", "drift_failed", "job_failed",
                              "completed"]),
       logged=st.booleans())
def test_a_completed_job_is_announced_or_unannounced_never_both(state, logged):
    # The two ways a start can find "completed" in state.json: only logged is the job over; the
    # other is the table's completion_unannounced edge, which still has the announcement to make.
    announced, unannounced = completion_announced(state, logged), completion_unannounced(state, logged)
    assert not (announced and unannounced)
    assert announced or unannounced or state != "completed"
    assert announced == (state == "completed" and logged)
