"""One Ray instance for the whole test session, sized for a 2-core machine."""

import os

import pytest
import ray

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

# Logical CPUs: enough for two 2-worker engines at once; actors mostly wait.
NUM_CPUS = 8

# Set when the tests are collected, before any test module (benchmarks' package among them) picks its own.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@pytest.fixture(scope="session")
def ray_session():
    ray.init(
        address="local",  # a new instance, even where a Ray cluster started with `ray start` runs on the machine
        num_cpus=NUM_CPUS,
        object_store_memory=1 << 30,
        include_dashboard=False,
        logging_level="ERROR",
        # Worker processes import the test models from here by name.
        runtime_env={"env_vars": {"PYTHONPATH": TESTS_DIR, "TF_CPP_MIN_LOG_LEVEL": "2"}},
    )
    yield ray
    ray.shutdown()
