"""Every test gets a deadline, so a deadlock fails in seconds instead of hanging CI.

SIGALRM raises in the test's main thread; spawn() then ends every rank it started.

The suite is the CPU's wherever it runs: this machine's GPUs, if any, are hidden from every test
and from every process a test starts (before torch is imported), so a laptop with one GPU runs
what CI runs. tests/nccl.py's fake_gpus() shows a door as many GPUs as a test asks for; a real
GPU is make gpu-check's.

--shard I/N keeps every N-th test from the I-th (tests/shards.py runs the N at once).

The suite is batch work, and so is every rank and command it starts: under SCHED_BATCH the
scheduler lets a process run until it blocks, where it would switch to each rank a message wakes.
Eight ranks a test on two cores wake each other at every message: the suite took an eighth less
time (its system time a third less), with every test as it was.
"""
import contextlib
import os
import signal
import sys
import warnings

import pytest

os.environ["CUDA_VISIBLE_DEVICES"] = ""
if hasattr(os, "sched_setscheduler"):   # Linux's; a sandbox may refuse it: then as before
    with contextlib.suppress(OSError):
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore", "Failed to initialize NumPy")   # torch's, without numpy

DEADLINE_S = 60


@pytest.fixture(autouse=True, scope="session")
def optimizer_imports():
    """Every rank's optimizer imports torch._dynamo (1-2 s): once, here, before a rank is forked.
    Only where the tests imported torch (a suite of plain tests, as the shards' test runs, not)."""
    if "torch" in sys.modules:
        import torch._dynamo  # noqa: F401


class Deadline(Exception):
    pass


@pytest.fixture(autouse=True)
def deadline(request):
    seconds = getattr(request.node.get_closest_marker("deadline"), "args", [DEADLINE_S])[0]

    def expire(signum, frame):
        raise Deadline(f"test ran past its {seconds} s deadline (a deadlock?)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run the I-th of N shares of the tests, every N-th from the I-th (0 <= I < N)")


def pytest_collection_modifyitems(config, items):
    """--shard I/N: a parametrized family's cases alternate between the shares, so each share's
    time is about 1/N of the whole."""
    shard = config.getoption("--shard")
    if shard is None:
        return
    mine, shares = (int(part) for part in shard.split("/"))
    keep = items[mine::shares]
    kept = set(map(id, keep))
    config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
    items[:] = keep


def pytest_configure(config):
    # torch's import warns when numpy is missing (a fresh environment); nothing needs numpy
    config.addinivalue_line("filterwarnings", "ignore:Failed to initialize NumPy")
    config.addinivalue_line("markers", "deadline(seconds): fail the test after this many seconds")
    config.addinivalue_line("markers", "multinode: two nodes in network namespaces, as root (make test-multinode)")
    config.addinivalue_line("markers", "slurm: a Slurm cluster of two nodes in network namespaces (make test-slurm)")
    config.addinivalue_line("markers", "ray: Ray Train's workers, once Ray is installed (make test-ray)")
