"""NCCL's semantics on gloo, where results depend on them, so that the CPU tests see what
only a GPU run would otherwise show.

    with nccl_semantics():
        three_d.main([... "--check"])        # ranks forked inside inherit every patch

What differs, and what the harness does about it:

- torch.distributed.batch_isend_irecv returns one Work for the whole batch on a backend
  that coalesces (NCCL: `supports_coalescing`), and one per operation on gloo. Here it
  returns one Work for the batch.
- On a GPU, what a receive or an asynchronous collective (async_op=True) writes reaches
  the caller's tensor on the GPU's communication stream; Work.wait() makes the compute
  stream wait for it, and until then a kernel reads whatever the buffer held. Here the
  operation runs on private copies, the caller's output holds NaN until its Work is
  waited, and wait() copies the result in. A buffer written meanwhile is caught at wait().
- A send (or a collective's input) is read by the GPU after the call returns: a tensor
  written before the Work is waited may go out with the write. Here the harness keeps
  what the tensor held when posted and says so at wait() if it changed.
- A Work never waited before the process group is destroyed is caught there.
- A parent that initialises CUDA before its ranks fork hands them a CUDA state they
  cannot use. With fake_gpus(), the machine seems to have GPUs (a fake NVML library
  counts them) and any call that would initialise CUDA in this process raises.

The checks raise NCCLSemanticsError in the rank, which names the operation.
"""
import contextlib
import functools
import inspect
import os
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


class NCCLSemanticsError(RuntimeError):
    pass


def same_bits(a, b):
    """Equal element for element, NaN included (NaN != NaN as a number)."""
    return a.shape == b.shape and torch.equal(torch.isnan(a), torch.isnan(b)) and \
        torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def poison(tensor):
    """What a GPU buffer holds before the transfer lands, made visible: NaN."""
    if tensor.is_floating_point():
        tensor.fill_(float("nan"))
    else:
        tensor.fill_(-12345)


class Pending:
    """One posted operation: the real gloo Works it stands for, the results to deliver into the
    caller's tensors at wait(), and the caller's tensors that must not change until then."""

    def __init__(self, what, works, deliveries=(), unchanged=()):
        self.what, self.works = what, list(works)
        self.deliveries = list(deliveries)                           # (private result, caller's)
        for _, caller in self.deliveries:
            poison(caller)
        # taken after the poison: an input may hold an output (a reduce-scatter in place)
        self.unchanged = [(t, t.clone()) for t in unchanged]         # (caller's, as posted)
        self.poisoned = [(caller, caller.clone()) for _, caller in self.deliveries]
        self.waited = False
        OUTSTANDING.append(self)

    def wait(self, timeout=None):
        if self.waited:
            return True
        for work in self.works:
            work.wait()
        for tensor, posted in self.unchanged:
            if not same_bits(tensor, posted):
                raise NCCLSemanticsError(f"{self.what}: a tensor it sends was written before its "
                                         f"Work was waited; on a GPU the write may go out")
        for caller, posted in self.poisoned:
            if not same_bits(caller, posted):
                raise NCCLSemanticsError(f"{self.what}: its output was written before its Work "
                                         f"was waited; on a GPU the transfer lands over it")
        for private, caller in self.deliveries:
            caller.copy_(private)
        self.waited = True
        OUTSTANDING.remove(self)
        return True

    def is_completed(self):
        return self.waited


OUTSTANDING = []   # this process's Pending operations not yet waited


def recv_into_private(real_irecv, tensor, *args, **kwargs):
    private = torch.empty_like(tensor)
    return private, real_irecv(private, *args, **kwargs)


def emulate_batch(real):
    """batch_isend_irecv as NCCL runs it: one Work for the batch."""
    def batch_isend_irecv(p2p_op_list):
        c10d._check_p2p_op_list(p2p_op_list)
        works, deliveries, sends = [], [], []
        for op in p2p_op_list:
            kwargs = dict(group=op.group, tag=op.tag)
            if op.op in (dist.irecv, real["irecv"]):
                private, work = recv_into_private(real["irecv"], op.tensor, group_src=op.group_peer, **kwargs)
                deliveries.append((private, op.tensor))
            else:
                work = real["isend"](op.tensor, group_dst=op.group_peer, **kwargs)
                sends.append(op.tensor)
            works.append(work)
        return [Pending(f"batch_isend_irecv of {len(p2p_op_list)} operations", works, deliveries, sends)]
    return batch_isend_irecv


def emulate_isend(real_isend):
    @functools.wraps(real_isend)
    def isend(tensor, *args, **kwargs):
        return Pending("isend", [real_isend(tensor, *args, **kwargs)], unchanged=[tensor])
    return isend


def emulate_irecv(real_irecv):
    @functools.wraps(real_irecv)
    def irecv(tensor, *args, **kwargs):
        private, work = recv_into_private(real_irecv, tensor, *args, **kwargs)
        return Pending("irecv", [work], deliveries=[(private, tensor)])
    return irecv


def emulate_collective(name, real_fn, inputs, outputs):
    """An async collective on private copies: its outputs NaN until waited, its inputs unchanged
    until then. inputs, outputs: the names of the caller's tensors among the arguments."""
    signature = inspect.signature(real_fn)

    @functools.wraps(real_fn)
    def collective(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        if not call.arguments.get("async_op", False):
            return real_fn(*args, **kwargs)
        callers = dict(call.arguments)
        for arg in inputs:                          # copied before any output is poisoned
            call.arguments[arg] = callers[arg].clone()
        for arg in outputs:
            if arg not in inputs:
                call.arguments[arg] = torch.empty_like(callers[arg])
        work = real_fn(*call.args, **call.kwargs)
        return Pending(f"{name}(async_op=True)", [work],
                       [(call.arguments[arg], callers[arg]) for arg in outputs],
                       [callers[arg] for arg in inputs if arg not in outputs])
    return collective


COLLECTIVES = {   # name: (its inputs, its outputs)
    "all_reduce": (("tensor",), ("tensor",)),
    "all_gather_single": (("input_tensor",), ("output_tensor",)),
    "all_gather_into_tensor": (("input_tensor",), ("output_tensor",)),
    "reduce_scatter_single": (("input",), ("output",)),
    "reduce_scatter_tensor": (("input",), ("output",)),
}
NOT_EMULATED = ["broadcast", "reduce", "all_gather", "gather", "scatter", "reduce_scatter",
                "all_to_all", "all_to_all_single"]


def refuse_async(name, real_fn):
    @functools.wraps(real_fn)
    def collective(*args, async_op=False, **kwargs):
        if async_op:
            raise NCCLSemanticsError(f"{name}(async_op=True): the harness does not emulate it yet")
        return real_fn(*args, **kwargs)
    return collective


def check_all_waited(real_destroy):
    @functools.wraps(real_destroy)
    def destroy_process_group(*args, **kwargs):
        if OUTSTANDING:
            what = [pending.what for pending in OUTSTANDING]
            OUTSTANDING.clear()
            raise NCCLSemanticsError(f"{len(what)} Work(s) never waited: {', '.join(what)}")
        return real_destroy(*args, **kwargs)
    return destroy_process_group


MISSING = object()


@contextlib.contextmanager
def patched(module, name, value):
    """module.name = value inside; what was there (or nothing, on a CPU build) afterwards."""
    saved = getattr(module, name, MISSING)
    setattr(module, name, value)
    try:
        yield
    finally:
        if saved is MISSING:
            delattr(module, name)
        else:
            setattr(module, name, saved)


@contextlib.contextmanager
def nccl_semantics():
    """Inside, in this process and in the ranks it forks: gloo as NCCL, as the module says."""
    real = {"isend": c10d.isend, "irecv": c10d.irecv}
    isend, irecv = emulate_isend(real["isend"]), emulate_irecv(real["irecv"])
    with contextlib.ExitStack() as stack:
        # P2POp accepts only the module's own isend and irecv: patch them where it looks too
        for module in (dist, c10d):
            stack.enter_context(patched(module, "isend", isend))
            stack.enter_context(patched(module, "irecv", irecv))
        stack.enter_context(patched(dist, "batch_isend_irecv", emulate_batch(real)))
        for name, (inputs, outputs) in COLLECTIVES.items():
            stack.enter_context(patched(dist, name, emulate_collective(
                name, getattr(dist, name), inputs, outputs)))
        for name in NOT_EMULATED:
            stack.enter_context(patched(dist, name, refuse_async(name, getattr(dist, name))))
        stack.enter_context(patched(dist, "destroy_process_group",
                                    check_all_waited(dist.destroy_process_group)))
        OUTSTANDING.clear()
        yield


class CUDAInitialised(NCCLSemanticsError):
    pass


class FakeNVML:
    """libnvidia-ml.so.1 as NVML answers on a machine with `count` GPUs of one compute
    capability: the library torch.cuda.device_count() asks. Each call fills its ctypes.byref arguments and returns 0, NVML's success."""

    def __init__(self, count, capability):
        self.count, self.capability = count, capability

    def nvmlInit(self):
        return 0

    nvmlInit_v2 = nvmlShutdown = nvmlInit

    def nvmlDeviceGetCount_v2(self, count):
        count._obj.value = self.count
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index, handle):
        handle._obj.value = index + 1
        return 0 if index < self.count else 2           # NVML_ERROR_INVALID_ARGUMENT

    def nvmlDeviceGetCudaComputeCapability(self, handle, major, minor):
        major._obj.value, minor._obj.value = self.capability
        return 0


@contextlib.contextmanager
def fake_gpus(count=8, capability=(9, 0)):
    """A machine that seems to have `count` GPUs of this compute capability, as NVML reports
    them (torch.cuda.device_count() asks NVML, which starts no CUDA). Anything that would
    initialise CUDA in this process raises CUDAInitialised."""
    import ctypes
    real_cdll = ctypes.CDLL

    def cdll(name, *args, **kwargs):
        if name == "libnvidia-ml.so.1":
            return FakeNVML(count, capability)
        return real_cdll(name, *args, **kwargs)

    def initialises(what):
        def call(*args, **kwargs):
            raise CUDAInitialised(f"{what}: CUDA initialised in the launching process")
        return call
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ))   # every one of them visible (the
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)       # suite hides this machine's: conftest)
        stack.enter_context(patched(ctypes, "CDLL", cdll))
        stack.enter_context(patched(torch.cuda, "_is_compiled", lambda: True))   # a CPU build here
        stack.enter_context(patched(torch.cuda, "_lazy_init", initialises("torch.cuda._lazy_init")))
        stack.enter_context(patched(torch._C, "_cuda_getDeviceCount",
                                    initialises("cudaGetDeviceCount (cuInit)")))
        yield
