"""Where new workers replacing dead ones go (no Ray needed)."""

from dsgd.placement import place_new_workers

ONE_CPU = {"CPU": 1}


def test_new_workers_go_beside_the_survivors_first_and_on_the_dead_workers_nodes_last():
    free = {"lost": {"CPU": 2}, "idle": {"CPU": 2}, "survivor": {"CPU": 1}}
    # Ray may still list a lost node as alive: it is the last choice, a node where a worker answered the first.
    assert place_new_workers(1, ONE_CPU, free, first=["survivor"], last=["lost"]) == ["survivor"]
    assert place_new_workers(3, ONE_CPU, free, first=["survivor"], last=["lost"]) == ["survivor", "idle", "idle"]
    # The lost node only when nothing else has room.
    assert place_new_workers(4, ONE_CPU, free, first=["survivor"], last=["lost"]) == [
        "survivor", "idle", "idle", "lost"]


def test_fewer_nodes_than_workers_means_the_next_one_fits_nowhere():
    free = {"a": {"CPU": 3, "GPU": 1}, "b": {"CPU": 1, "GPU": 2}}
    needs = {"CPU": 2, "GPU": 1}
    assert place_new_workers(2, needs, free) == ["a"]  # b has the GPUs but not the CPUs
    assert place_new_workers(1, {"CPU": 1}, {"a": {"CPU": 0}}) == []
    assert place_new_workers(1, {"CPU": 1}, {}) == []
    assert free["a"] == {"CPU": 3, "GPU": 1}  # the caller's view is left as it was
