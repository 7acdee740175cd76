"""Claims the README makes about what a step costs, checked through Ray's own accounting."""

import dsgd
import model_check_models as mc
from cluster_jobs import objects_created


def test_on_one_node_a_ps_step_creates_no_ray_object_while_simple_creates_some(ray_session):
    """README: between a worker and a server on one node the bytes go through shared memory
    created once, so a step creates no Ray objects. "simple" is the control: its gradients travel
    through the object store, so the counter sees an exchange."""
    created = {}
    for strategy in ("ps", "simple"):
        with dsgd.DistributedSGD(mc.WideLinear, num_workers=2, strategy=strategy) as sgd:
            for _ in range(2):
                sgd.step()
            sgd.foreach_worker(lambda worker: None)  # waits for the steps (get_weights would return 6 MiB)
            before = objects_created()
            for i in range(10):
                sgd.step(fetch_stats=(i % 3 == 0))
            sgd.foreach_worker(lambda worker: None)
            created[strategy] = objects_created() - before
    assert created["ps"] == 0
    assert created["simple"] >= 10
