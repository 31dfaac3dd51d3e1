"""Make one rank of three_d.py fail on purpose, with no test hook in three_d.py.

    python tests/faults.py RANK CALL {raise,kill,stall} [three_d.py flags]
    torchrun --standalone --nproc-per-node 2 tests/faults.py 1 2 raise --dp 2 --pp 1 --tp 1

Every rank of three_d.py runs a block's forward, tensor_parallel.block_forward (step 3 hands
step 2's its split), once per block and micro-batch, in the middle of the pipeline schedule.
fail_at() wraps it:
on rank RANK its CALL-th call raises, kills its own process with SIGKILL (no traceback, no
report), or sleeps for a minute inside the step (a stalled rank). Run as a script, this then
runs three_d.py's command line; the in-process tests put fail_at() in its place instead, and
the ranks that spawn forks inherit it.
"""
import itertools
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tensor_parallel  # noqa: E402
import three_d  # noqa: E402


def give_up():
    raise ValueError(f"injected failure on rank {os.environ['RANK']}")


ACTIONS = {
    "raise": give_up,
    "kill": lambda: os.kill(os.getpid(), signal.SIGKILL),
    "stall": lambda: time.sleep(60),
}


def fail_at(rank, call, action):
    """tensor_parallel.block_forward, but rank `rank` runs the action (a name in ACTIONS, or a
    function) at its call-th call."""
    real = tensor_parallel.block_forward
    act = ACTIONS[action] if isinstance(action, str) else action
    calls = itertools.count(1)

    def block_forward(*args, **kwargs):
        if int(os.environ["RANK"]) == rank and next(calls) == call:
            act()
        return real(*args, **kwargs)
    return block_forward


if __name__ == "__main__":
    rank, call, action = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    tensor_parallel.block_forward = fail_at(rank, call, action)
    sys.argv = ["three_d.py", *sys.argv[4:]]
    three_d.run_main(three_d.main)
