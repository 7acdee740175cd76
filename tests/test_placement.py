"""Where new workers replacing dead ones go, and what a placement group (a Tune trial) reserved."""

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dsgd.cluster import room
from dsgd.cluster.placement import place_new_workers, reserved_cpus
from dsgd.cluster.server_plan import plan_servers
from dsgd_test_models import engine_options
from dsgd.errors import DSGDError

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


def test_spread_workers_go_round_robin_over_the_nodes_with_room():
    free = {"a": {"CPU": 2}, "b": {"CPU": 2}, "c": {"CPU": 1}}
    assert place_new_workers(5, ONE_CPU, free, spread=True) == ["a", "b", "c", "a", "b"]
    assert place_new_workers(5, ONE_CPU, free) == ["a", "a", "b", "b", "c"]


def _room(server_resource=None, **options):
    return room.WorkerRoom(engine_options(**{"num_workers": 4, "server_resource": server_resource, **options}))


# Two worker nodes of 2 CPUs, two server nodes of 8 CPUs marked with "dsgd_server".
NODES = {"w1": {"CPU": 2.0}, "w2": {"CPU": 2.0}, "s1": {"CPU": 8.0, "dsgd_server": 1.0},
         "s2": {"CPU": 8.0, "dsgd_server": 1.0}}


def test_with_server_nodes_workers_go_round_robin_over_the_other_nodes_only(monkeypatch):
    monkeypatch.setattr(room, "live_node_resources", lambda: NODES)
    marked = _room("dsgd_server")
    marked.check(4)
    assert marked.start_nodes(4) == ["w1", "w2", "w1", "w2"]
    assert marked.nodes_for([2], ["w1", "w2", "w1", "w2"]) == ["w1"]  # a replacement: never on s1 or s2
    assert marked.place([4], ["w1", "w2", "w1", "w2"])[0] == []  # no room to grow: the server nodes' CPUs don't count
    assert _room().start_nodes(4) == [None] * 4  # without server_resource Ray spreads them, on any node
    assert len(_room().place([4, 5], ["w1", "w2", "w1", "w2"])[0]) == 2  # and s1, s2 count as room


def test_the_cluster_cannot_hold_errors_count_room_outside_the_server_nodes(monkeypatch):
    monkeypatch.setattr(room, "live_node_resources", lambda: NODES)
    with pytest.raises(ValueError, match="needs 5 CPU in all, but the Ray cluster outside the 2 server nodes "
                                         "\\('dsgd_server'\\) has 4"):
        _room("dsgd_server").check(5)
    with pytest.raises(ValueError, match="each worker needs 3 CPU on one node, but the largest Ray node outside"):
        _room("dsgd_server", cpus_per_worker=3).check(1)
    with pytest.raises(DSGDError, match="cannot start worker 4: .* no live node without 'dsgd_server'"):
        _room("dsgd_server", num_workers=5).start_nodes(5)
    with pytest.raises(ValueError, match="server_resource='gpu_box': no live Ray node has that resource"):
        _room("gpu_box").check(2)


@ray.remote(num_cpus=1)
def plan_inside_the_group():
    """What the engine's driver sees in a trial: the CPUs its group reserved, and the servers it plans."""
    node = ray.get_runtime_context().get_node_id()
    cpus = reserved_cpus()
    return node, cpus, plan_servers([node, node], cpus, cpus_per_worker=1, requested=None)


def test_inside_a_placement_group_servers_are_planned_on_its_bundles_not_the_nodes_cpus(ray_session):
    assert reserved_cpus() is None  # the driver is in no group
    # A trial's group: its driver (bundle 0) and 2 workers of 1 CPU, on a node of 8 CPUs.
    group = placement_group([{"CPU": 1}] * 3, strategy="PACK")
    try:
        ray.get(group.ready(), timeout=60)
        node, cpus, plan = ray.get(plan_inside_the_group.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=0)).remote(), timeout=60)
    finally:
        remove_placement_group(group)
    assert cpus == {node: 3.0}
    assert plan == [node]  # 1 CPU left by the workers: one server, where the node's 8 CPUs would give 2
    assert plan_servers([node, node], {node: 8.0}, cpus_per_worker=1, requested=None) == [node, node]


class _Handle:
    """Stands in for an actor handle: ``actor_state`` reads only its ``_actor_id``."""

    def __init__(self) -> None:
        self._actor_id = ray.ActorID.from_random()


def test_actor_states_private_ray_api_is_still_there(monkeypatch):
    """``placement.actor_state`` reads Ray's actor table through ``ray._private.state`` and ``ActorHandle._actor_id``
    (the public state API needs the dashboard). What it relies on, checked against the installed Ray without a
    cluster: the names, the ``actor_id`` argument (a hex string) and the ``State`` field of the table's answer."""
    import inspect

    from ray.core.generated import gcs_pb2

    from dsgd.cluster import placement

    def check(ok: bool, what: str) -> None:
        assert ok, (f"Ray's private API changed under dsgd.cluster.placement.actor_state ({what}, as of Ray 2.60; "
                    f"installed: {ray.__version__}): read the actor's state another way there")

    state_module = getattr(getattr(ray, "_private", None), "state", None)
    check(callable(getattr(state_module, "actors", None)), "ray._private.state.actors is gone")
    check("actor_id" in inspect.signature(state_module.actors).parameters, "actors() takes no actor_id")
    check(isinstance(inspect.getattr_static(ray.actor.ActorHandle, "_actor_id", None), property),
          "ActorHandle._actor_id is no longer a property")
    check(callable(getattr(ray.ActorID, "hex", None)), "ActorID has no hex()")

    handle, asked = _Handle(), []
    for name in ("ALIVE", "DEAD"):
        class Accessor:  # the GCS's answer for one actor, as its table holds it
            def get_actor_info(self, actor_id):
                asked.append(actor_id)
                return gcs_pb2.ActorTableData(actor_id=actor_id.binary(),
                                              state=gcs_pb2.ActorTableData.ActorState.Value(name)).SerializeToString()

        check(hasattr(state_module.state, "_connect_and_get_accessor"), "no GlobalState._connect_and_get_accessor")
        monkeypatch.setattr(state_module.state, "_connect_and_get_accessor", lambda: Accessor())
        got = placement.actor_state(handle)
        check(got == name, f"an actor the table lists as {name} read as {got!r}")
    check(asked == [handle._actor_id] * 2, f"the table was asked for {asked}, not for {handle._actor_id}")


def test_only_actor_state_reads_rays_private_api():
    """``ray._private`` and an actor handle's ``_actor_id`` appear in dsgd/ in ``placement.actor_state`` alone, the
    one place to change when Ray does (the test above)."""
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parent.parent / "dsgd"
    found = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        allowed = set()
        if path.relative_to(package).as_posix() == "cluster/placement.py":
            (function,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "actor_state"]
            allowed = {id(n) for n in ast.walk(function)}
        for node in ast.walk(tree):
            private = (isinstance(node, ast.Attribute) and (node.attr == "_actor_id" or node.attr == "_private" and
                                                             isinstance(node.value, ast.Name) and node.value.id == "ray")
                       or isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                           "ray._private" in name for name in [getattr(node, "module", None) or ""]
                           + [alias.name for alias in node.names]))
            if private and id(node) not in allowed:
                found.append(f"{path.relative_to(package.parent)}:{node.lineno}")
    assert not found, f"Ray's private API read outside dsgd.cluster.placement.actor_state: {found}"
