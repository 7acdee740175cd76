"""Step results: typed values reduced as each declares, exactly, in any grouping (``dsgd.common.results``)."""

from __future__ import annotations

import itertools
import math

import pytest

from dsgd.common.results import Backup, Reduction, StepResult, Value, combine


def test_a_mean_over_workers_of_different_replica_counts_counts_every_replica_once():
    """One worker averaged three replicas, another one (e.g. a worker behind): a mean of the workers' means would
    say 2.5; every replica counted once says 1.75."""
    three = StepResult({"loss": Value.mean([1.0, 1.0, 1.0])})
    one = StepResult({"loss": Value.mean([4.0])})
    assert combine([three, one]).floats() == {"loss": 1.75}
    assert combine([three, one]).values["loss"] == Value(Reduction.MEAN, 7.0, 4)


def test_combining_is_associative_and_exact_however_results_are_grouped():
    """Float sums depend on their order ((0.1 + 0.2) + 0.3 != 0.1 + (0.2 + 0.3)); exact totals do not."""
    replicas = [0.1, 0.2, 0.3, 0.7, 1.1, 1.3]
    whole = combine([StepResult({"loss": Value.mean(replicas)})])
    for cut in itertools.combinations(range(1, len(replicas)), 2):
        a, b, c = (StepResult({"loss": Value.mean(replicas[i:j])})
                   for i, j in zip((0, *cut), (*cut, len(replicas))))
        assert combine([combine([a, b]), c]) == combine([a, combine([b, c])]) == combine([a, b, c])
        assert combine([a, b, c]).floats() == whole.floats()


def test_a_non_finite_contribution_makes_the_mean_what_float_arithmetic_makes_it():
    def mean(*workers: list[float]) -> float:
        return combine([StepResult({"loss": Value.mean(w)}) for w in workers]).floats()["loss"]

    assert math.isnan(mean([1.0, float("nan")], [2.0]))
    assert mean([1.0], [float("inf"), 2.0]) == float("inf")
    assert math.isnan(mean([float("inf")], [float("-inf")]))


def test_a_result_without_values_adds_nothing():
    """A worker that caught up without computing, or a step without stats, has no values."""
    computed = StepResult({"loss": Value.mean([2.0, 4.0])}, backup=Backup(True, (0,)))
    caught_up = StepResult(backup=Backup(False, (0,)))
    assert combine([caught_up, computed]).floats() == combine([computed]).floats() == {"loss": 3.0}
    assert combine([]) == StepResult()


def test_results_naming_different_values_are_refused_naming_both():
    with pytest.raises(ValueError, match=r"different values: \['abs_error', 'loss'\] and \['accuracy', 'loss'\]"):
        combine([StepResult({"loss": Value.mean([1.0]), "abs_error": Value.mean([4.0])}),
                 StepResult({"loss": Value.mean([3.0]), "accuracy": Value.mean([0.5])})])


def test_the_first_reason_to_skip_is_kept_and_backup_outcomes_are_not():
    results = [StepResult(backup=Backup(True, (0, 1))), StepResult(skipped="non-finite", backup=Backup(True, (0, 1)))]
    assert combine(results) == StepResult(skipped="non-finite")
