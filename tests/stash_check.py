"""What a step keeps for its backward, and the most it holds at once, counted from the tensors
alive as a rank of step 2 or 3 runs its step on the CPU, for --recompute's tests.

- StashWatch wraps the layers' forwards and backwards: what each forward returns for its
  backward (the stash: a block's tensors, or x alone with --recompute) is watched by weak reference, and
  at the start of every backward the bytes of what is still alive are summed, each tensor once
  (by where it lies). The largest sum is the stash at its largest, z made again aside: that
  lives inside one block's backward, with its gradients.
- tests/gpu_path.py's StepRecord, on the CPU, counts the bytes the step allocates, alive at
  their most: the step's peak, which --recompute lowers by what the formula says.

The rank runs in this process over torch's fake process group (tests/gpu_path.py): the step's
own tensors are all there, and the collectives' scratch, gloo's and not the step's, is not.
"""
import weakref
from contextlib import ExitStack
from unittest import mock

import torch

import data_parallel
import tensor_parallel
from pipeline_parallel import opened
from gpu_path import BUILDERS, SCRIPTS, StepRecord, fake_world

CPU = torch.device("cpu")


class StashWatch:
    """The stashes the layers keep, watched (the module's docstring says how)."""

    def __init__(self):
        self.kept = {}          # (its storage's id, its offset) -> (weak reference, bytes)
        self.largest = 0
        self.backward_ran = False

    def forward(self, fn):
        def watched_forward(*args, **kwargs):
            if self.backward_ran:     # a micro-batch's forward after the one before's backward:
                self.kept = {}        # a new stash (what is still alive of the old: the batch)
                self.backward_ran = False
            out, stash = fn(*args, **kwargs)
            for t in opened(stash):       # the records in it opened (QK-norm's, the MLP's)
                where = (id(t.untyped_storage()), t.storage_offset())
                self.kept[where] = (weakref.ref(t), t.numel() * t.element_size())
            return out, stash
        return watched_forward

    def backward(self, fn):
        def watched_backward(*args, **kwargs):
            alive = sum(size for ref, size in self.kept.values() if ref() is not None)
            self.largest = max(self.largest, alive)
            self.backward_ran = True
            return fn(*args, **kwargs)
        return watched_backward


def stash_and_peak(script, argv, rank=0):
    """Rank `rank`'s second step (the first makes AdamW's state and the buckets) of step 2 or 3:
    (its stash at its largest, the most bytes its step held at once), in bytes."""
    args = SCRIPTS[script].parse_args(argv)
    watch = StashWatch()
    with ExitStack() as stack:
        # model_blocks() and tp_blocks() hand the step the module's functions, by name
        module = data_parallel if script == "data_parallel" else tensor_parallel
        names = ["block", "head"] + (["embedding"] if script == "data_parallel" else [])
        wrapped = {f"{name}_{half}": wrap for name in names
                   for half, wrap in (("forward", watch.forward), ("backward", watch.backward))}
        if script != "data_parallel":
            wrapped.update(vocab_embedding_forward=watch.forward,
                           vocab_embedding_backward=watch.backward)
        for name, wrap in wrapped.items():
            stack.enter_context(mock.patch.object(module, name, wrap(getattr(module, name))))
        stack.enter_context(fake_world(rank, args.world_size))
        step = BUILDERS[script](args, rank, args.world_size, device=CPU)[0]
        step()
        watch.largest = 0
        with StepRecord(device=CPU) as record:
            step()
    return watch.largest, record.peak
