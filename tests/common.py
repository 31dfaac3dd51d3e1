"""Helpers that several test files share."""
import os

import torch

# float32 results that differ only in summation order agree to about this
ATOL = RTOL = 1e-5


def assert_same_training(got, want):
    """Two --save results (or serial_train's): the same loss at every step, the same final weights."""
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), atol=ATOL, rtol=RTOL)
    assert len(got["final_weights"]) == len(want["final_weights"])
    for layer, (a, b) in enumerate(zip(got["final_weights"], want["final_weights"])):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda msg: f"layer {layer}: {msg}")


def child_pids():
    """This process's live children, as the kernel sees them."""
    pids = set()
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            pids.update(int(pid) for pid in f.read().split())
    return pids
