"""The GPU path, checked without a GPU: one rank's training step of any script, run on the meta
device over torch's fake process group, with what it executes recorded.

    python tests/gpu_path.py three_d --rank 229 --dp 16 --pp 8 --tp 8 --num-layers 64 --dim 8192 \\
        --batch-size 8192 --micro-batches 16 --bf16 --zero 3 --tp-style megatron \\
        --schedule interleaved --p2p-shard

Tensors on the meta device have a shape and a dtype and compute nothing. torch's fake process
group makes this one process rank r of a world of N: every group forms as usual, and each
collective and send returns at once. So one process runs, op by op, what rank 229 of 1,024
GPUs runs, in seconds. The meta device is not the CPU, and the scripts take the GPU's path
wherever the device is not the CPU: what runs here is what a GPU runs. The command line goes
through the script's own door as on a node of 8 GPUs (tests/nccl.py's fake_gpus), and the
parameters are drawn on meta by the scripts' own init_params, and each step's batch of token ids
is drawn from the text on the CPU, as a data loader does, and moved to the device before the step.

StepRecord, a TorchDispatchMode, sees every op of the step. It keeps
- each matmul as tensor_parallel.Matmul, the planner's own record: (m, k, n), the bytes of an input's
  and of an output's element, whether it adds into what its output held; from these its FLOPs,
  2 m k n, and the bytes it moves; each fused attention kernel (flash's or the memory-efficient
  one's, forward or backward) as tensor_parallel.Attention; and the dtypes of every one's inputs;
- each collective and send (comm_count's CommCounter): its group, kind and tensor bytes;
- the bytes the step allocates, at their most while alive (a storage counts from the op that
  makes it until its last reference goes; a view of one made before the step, none);
- every op's name, as often as it ran (AdamW's fused kernel, once a step, as on a GPU), the
  shape of every tensor an op made, and the bytes each memory-bound op (neither a matmul nor
  attention) reads and writes: a profile of what a GPU's HBM moves outside the matmuls;
and it ends the step at the first op that touches a tensor on another device than meta, a
CPU scalar aside (CUDA takes those, and AdamW keeps its step count there).
"""
import argparse
import collections
import contextlib
import functools
import importlib.util
import os
import sys
import warnings
import weakref
from typing import NamedTuple
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if importlib.util.find_spec("numpy") is None:   # torch's meta kernels try `import numpy` at
    sys.modules["numpy"] = None                 # every size they compare: fail it at once
warnings.filterwarnings("ignore", "Failed to initialize NumPy")   # torch's, at import: unneeded
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")   # the fake group's C++ warning as it ends

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import collectives  # noqa: E402
import data_parallel  # noqa: E402
import pipeline_parallel  # noqa: E402
import tensor_parallel  # noqa: E402
import three_d  # noqa: E402
from comm_count import CommCounter  # noqa: E402
from nccl import fake_gpus  # noqa: E402
from race import first_batch  # noqa: E402

META = torch.device("meta")
GPUS_PER_NODE = 8


def native_meta_kernels():
    """torch puts Python meta kernels (its refs, torch._meta_registrations) over the C++ ones of
    636 ops: mm, add, gelu... A structured op's C++ meta kernel is the one its CUDA kernel sizes
    its output by, and runs 100 times faster. Put those back; keep Python's where C++ has none
    (AdamW's fused kernel). A torch without this private table keeps its own: slower, the same."""
    meta = torch._meta_registrations
    registered = getattr(meta, "_meta_lib_dont_use_me_use_register_meta", None)
    if registered is None:
        return
    names = [key.split("/")[1] for key in registered._op_impls]   # "aten/mul.Tensor/Meta"
    registered._destroy()
    python_only = torch.library.Library("aten", "IMPL", "Meta")
    for name in names:
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "Meta"):
            packet, _, overload = name.partition(".")
            op = getattr(getattr(torch.ops.aten, packet), overload or "default")
            python_only.impl(op, op.py_kernels[torch._C.DispatchKey.Meta])
    meta._meta_lib_dont_use_me_use_register_meta = python_only   # kept: its kernels live with it


native_meta_kernels()


def fused_rms_norm_on_meta():
    """rms_norm's fused forward as a GPU runs it, one kernel: a CUDA build has it, but the meta
    device (as the CPU) has only its decomposition, eight elementwise passes. Its shapes alone:
    y as x, and r = rsqrt(mean x^2 + eps) [.., 1] in fp32 (x's dtype when wider)."""
    name = "aten::_fused_rms_norm"
    if torch._C._dispatch_has_kernel_for_dispatch_key(name, "Meta"):
        return

    def kernel(x, normalized_shape, weight, eps):
        kept = x.shape[:x.dim() - len(normalized_shape)]
        r = x.new_empty((*kept, *[1] * len(normalized_shape)),
                        dtype=torch.promote_types(x.dtype, torch.float32))
        return torch.empty_like(x), r
    library = torch.library.Library("aten", "IMPL", "Meta")   # (its Python check refuses an op
    library.m.impl("_fused_rms_norm", "Meta", kernel, False)  # with a decomposition: the C++ call)
    return library


FUSED_RMS_NORM = fused_rms_norm_on_meta()   # kept: the kernel lives with its library


@functools.lru_cache(maxsize=None)   # many layouts alike; callers only read the Counter
def matmuls_of(kinds, rows, tp, classes, shape, micro_batches):
    """A tp rank's {Matmul: calls} a step over parts of these kinds, as --plan prices them from
    tensor_parallel.block_matmuls: the forwards (a block's twice with --recompute), the dxs,
    and each dW added into the fp32 gradient, zeroed as the step begins."""
    m = micro_batches
    calls = collections.Counter()
    for kind in kinds:
        if kind == "embedding":
            continue
        forwards, dxs, dws = tensor_parallel.block_matmuls(kind, rows, shape, tp, classes)
        for mm in forwards:
            calls[mm] += m * (1 + (shape.recompute and kind != "head"))
        for mm in dxs:
            calls[mm] += m
        for dw in dws:
            calls[dw] += m
    return +calls


def rank_matmuls(args, stage, tp_rank=0):
    """The matmuls a rank of this stage (and tp rank) runs a step, by the plan's reckoning."""
    kinds = tuple(kind for chunk in three_d.stage_kinds(args, stage) for kind in chunk)
    rows = args.batch_size // (args.dp * args.micro_batches) * args.context // args.cp   # its
    start, end = tensor_parallel.vocab_range(args.vocab_size, tp_rank, args.tp)   # positions
    return matmuls_of(kinds, rows, args.tp, end - start, three_d.shape_of(args),
                      args.micro_batches)


def tensors_in(value):   # an op's tensors, among its arguments or outputs (pytree's, faster)
    found = []
    waiting = [value]
    while waiting:
        item = waiting.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            waiting += item
        elif isinstance(item, dict):
            waiting += item.values()
    return found


class OffDevice(RuntimeError):
    """An op of the step touched a tensor that is not on the step's device."""


MATMULS = {"mm": False, "bmm": False, "addmm": True, "addmm_": True}   # -> it adds into its output
FUSED_ATTENTION = {"_scaled_dot_product_flash_attention": False,         # -> it is a backward
                   "_scaled_dot_product_flash_attention_backward": True,
                   "_scaled_dot_product_efficient_attention": False,
                   "_scaled_dot_product_efficient_attention_backward": True}


class StepRecord(TorchDispatchMode):
    """Every op of the step, as the module's docstring says."""

    def __init__(self, device=META):
        super().__init__()
        self.device = device
        self.matmuls = collections.Counter()   # tensor_parallel.Matmul -> calls
        self.input_dtypes = collections.Counter()   # a matmul's inputs' dtype -> calls
        self.ops = collections.Counter()       # every op's name (aten's) -> calls
        self.shapes = collections.Counter()    # every tensor an op made: its shape -> how often
        self.moved = collections.Counter()     # a memory-bound op's name -> bytes read, written
        self.live = {}                         # id of a storage made in the step -> its bytes
        self.found = set()                     # ids of those made before (first seen as inputs)
        self.now = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = tensors_in((args, kwargs))
        self.check_devices(func, inputs)                  # what it takes, before it runs
        for t in inputs:                                  # (a weight's .T is no allocation)
            self.note_found(t.untyped_storage())
        out = func(*args, **kwargs)
        outputs = tensors_in(out)
        self.check_devices(func, outputs)                 # and what it makes
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if name in MATMULS:
            self.add_matmul(name, args, out, adds=MATMULS[name] and kwargs.get("beta", 1) != 0)
        if name in FUSED_ATTENTION:
            self.add_attention(func, args, kwargs, backward=FUSED_ATTENTION[name])
        if name not in MATMULS and name not in FUSED_ATTENTION:
            self.add_moved(name, inputs, outputs)
        for t in outputs:
            self.shapes[tuple(t.shape)] += 1
            self.note_alive(t.untyped_storage())
        return out

    def add_moved(self, name, inputs, outputs):
        """What an op that is neither a matmul nor attention moves: its inputs read and what it
        makes written (a view, an output in an input's storage without _, moves nothing)."""
        read = {id(t.untyped_storage()): t.numel() * t.element_size()
                for t in inputs if t.dim() > 0}
        made = [t for t in outputs if id(t.untyped_storage()) not in read]
        if made or name.endswith("_"):
            self.moved[name] += sum(read.values()) + sum(t.numel() * t.element_size()
                                                         for t in made)

    def check_devices(self, func, tensors):
        for t in tensors:
            if t.device != self.device and \
                    not (t.device.type == "cpu" and t.dim() == 0):
                raise OffDevice(f"{func}: a tensor {list(t.shape)} on {t.device}, where the step "
                                f"runs on {self.device}")

    def add_matmul(self, name, args, out, adds):   # beta = 0: what the output held is ignored
        a, b = args[1:3] if MATMULS[name] else args[:2]
        if a.dtype != b.dtype:
            raise TypeError(f"{name}: inputs of two dtypes, {a.dtype} and {b.dtype}")
        self.input_dtypes[a.dtype] += 1
        rows = a.shape[:-1].numel()          # bmm: its batch's rows, [batch m, k] x [k, n]
        self.matmuls[tensor_parallel.Matmul(rows, a.shape[-1], b.shape[-1], a.element_size(),
                                            out.element_size(), adds)] += 1

    def add_attention(self, func, args, kwargs, backward):   # q [b, h, T, dh]: do's first back
        schema = func._schema.arguments                   # (a default left out: its own)
        given = {**{a.name: a.default_value for a in schema if a.has_default_value()},
                 **dict(zip([a.name for a in schema], args)), **kwargs}
        q = given["query"]
        self.input_dtypes[q.dtype] += 1
        sequences = q.shape[0] * q.shape[1]
        self.matmuls[tensor_parallel.Attention(sequences, q.shape[2], q.shape[3],
                                               q.element_size(), backward,
                                               causal=given["is_causal"],
                                               kv_share=given["key"].shape[1] / q.shape[1],
                                               keys=given["key"].shape[2])] += 1

    def note_found(self, storage):
        key = id(storage)
        if key not in self.live and key not in self.found:
            self.found.add(key)
            weakref.finalize(storage, self.found.discard, key)

    def note_alive(self, storage):
        key = id(storage)
        if key in self.live or key in self.found:
            return
        self.live[key] = storage.nbytes()
        self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self.free, key)

    def free(self, key):
        self.now -= self.live.pop(key)

    def flops(self, element_size=None):   # of every matmul, or of those of this input size
        return sum(calls * mm.flops() for mm, calls in self.matmuls.items()
                   if element_size in (None, mm.in_bytes))


@contextlib.contextmanager
def fake_world(rank, world_size):
    """This process as rank `rank` of `world_size`, on torch's fake process group (named for
    the meta device too, or batch_isend_irecv finds no backend for meta tensors)."""
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank,
                            world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fused_on_meta():
    """AdamW's fused kernel on the meta device, as a GPU runs it: torch's check before it lists
    the devices it was built for, and meta is not among them, though the kernel has a meta form."""
    import torch.optim.adam as adam     # (the module: torch.optim's `adam` is deleted)
    with mock.patch.object(adam, "_device_dtype_check_for_fused",
                           lambda param, cuda_unsupported=False: None):
        yield


@contextlib.contextmanager
def drawn_on_meta():
    """The scripts' own init_params, drawing on the meta device: shapes and dtypes, no numbers
    (the whole model of a 1,024-GPU run fits in no CPU's memory)."""
    real = data_parallel.init_params

    def drawn(*args, **kwargs):
        with torch.device(META):
            return real(*args, **kwargs)
    with contextlib.ExitStack() as stack:
        for module in (data_parallel, tensor_parallel, pipeline_parallel, three_d):
            if hasattr(module, "init_params"):
                stack.enter_context(mock.patch.object(module, "init_params", drawn))
        yield


def gpu_node_args(script, argv):
    """The script's own parse_args, as on a node of 8 GPUs that can run bf16; --vocab-size V
    (taken out before) prices a model of another vocabulary than the text's: the tokens are
    still the text's, which every vocabulary of 97 classes or more holds."""
    vocab_size = None
    if "--vocab-size" in argv:
        at = argv.index("--vocab-size")
        vocab_size = int(argv[at + 1])
        argv = argv[:at] + argv[at + 2:]
    with fake_gpus(GPUS_PER_NODE), mock.patch.dict(os.environ,
                                                  {"LOCAL_WORLD_SIZE": str(GPUS_PER_NODE)}):
        args = SCRIPTS[script].parse_args(argv)
    if vocab_size:
        args.vocab_size = vocab_size
    return args


class Ran(NamedTuple):
    """What one rank's recorded step did."""
    script: str
    args: object
    rank: int
    stage: int               # its pipeline stage (0 without one)
    tp_rank: int             # its tensor-parallel rank (0 without one): its classes of E and H
    matmuls: collections.Counter
    comms: collections.Counter   # (group, kind, bytes of the tensor) -> calls
    peak_bytes: int          # allocated in the step, alive at once, at the most
    held: dict               # what its replica holds at the step's end {kind: bytes}
    record: StepRecord


def run_step(script, argv, rank, warm_up=True):
    """Rank `rank`'s step of script (its module's name) with these flags, on meta: built, one
    step taken (AdamW makes its state in its first), then one step recorded. warm_up=False: the
    first step recorded (its matmuls and collectives are every step's; not yet its memory)."""
    args = gpu_node_args(script, argv)
    world_size = world_of(script, args)
    with fake_world(rank, world_size), drawn_on_meta(), fused_on_meta():
        step, replica, groups, stage = BUILDERS[script](args, rank, world_size)
        if warm_up:
            with StepRecord():            # the first step, checked alike, its record let go
                step()
        counter = CommCounter(groups)
        with counter.step(), StepRecord() as record:
            step()
        held = data_parallel.memory_held(replica)
    comms = collections.Counter({key: calls for key, calls in counter.calls.items()})
    tp_rank = 0
    if script == "tensor_parallel":
        tp_rank = rank % (args.world_size // args.cp)                 # tp innermost
    if script == "three_d":
        tp_rank = three_d.coordinates(rank, three_d.rank_groups(args.dp, args.pp, args.tp,
                                                                  args.order, args.cp))[2]
    return Ran(script, args, rank, stage, tp_rank, record.matmuls, comms, record.peak, held,
               record)


def world_of(script, args):
    if script == "three_d":
        return args.dp * args.pp * args.tp * args.cp
    return args.world_size


def build_data_parallel(args, rank, world_size, device=META):
    """dp_worker's replica and step (steps 2): the world's ranks are the replicas."""
    m = args.micro_batches
    init = data_parallel.init_params(args)
    replica = data_parallel.make_replica([[w.to(device, copy=True) for w in part] for part in init],
                                         None, zero=args.zero, optimizer=args.optimizer, lr=args.lr,
                                         bucket_mb=args.bucket_mb, bf16=args.bf16,
                                         overlap=args.overlap)
    rows = data_parallel.replica_rows(args.batch_size, rank, world_size)
    inputs, targets = (t[rows] for t in first_batch(args))
    xs = inputs.to(device).chunk(m)
    ys = targets.to(device).chunk(m)
    blocks = data_parallel.model_blocks(args, device=device)

    def step():
        data_parallel.dp_step(replica, blocks, data_parallel.cross_entropy, xs, ys,
                              len(rows) * args.context, args.recompute)
        if args.clip_grad:
            replica.clip(args.clip_grad)
        replica.update()
    return step, replica, {"dp": None}, 0


def build_tensor_parallel(args, rank, world_size, device=META):
    """tp_worker's shards, replica and step (step 3)."""
    m = args.micro_batches
    kinds = tensor_parallel.part_kinds(args.num_layers)
    splits = tensor_parallel.tensor_kinds(kinds, args, world_size)
    init = data_parallel.init_params(args)
    shards = [[tensor_parallel.shard(w, k, rank, world_size, args.kv_heads).to(device)
               for w, k in zip(part, ks)] for part, ks in zip(init, splits)]
    replica = data_parallel.DataParallel(shards, dist.new_subgroups(1)[0],
                                         optimizer=args.optimizer, lr=args.lr, bf16=args.bf16)
    holders = tensor_parallel.kv_group(args.kv_heads, world_size)
    inputs, targets = (t.to(device) for t in first_batch(args))
    blocks = tensor_parallel.tp_blocks(kinds, args, positions=torch.arange(args.context,
                                                                           device=device))
    loss_fn = functools.partial(tensor_parallel.vocab_parallel_cross_entropy,
                                vocab_size=args.vocab_size)
    split = [k for ks in splits for k in ks]
    shares = tensor_parallel.clip_shares(split, world_size, args.kv_heads)

    def step():
        data_parallel.dp_step(replica, blocks, loss_fn, inputs.chunk(m), targets.chunk(m),
                              args.batch_size * args.context, recompute=args.recompute)
        summed = tensor_parallel.split_as(split, "partial")
        if args.sequence_parallel:
            summed += tensor_parallel.split_as(split, "whole")
        tensor_parallel.sum_partial_grads(replica.grads(), summed, dist.group.WORLD)
        if holders is not None:
            tensor_parallel.sum_partial_grads(replica.grads(),
                                              tensor_parallel.split_as(split, "kv"), holders)
        if args.clip_grad:
            replica.clip(args.clip_grad, [dist.group.WORLD], shares)
        replica.update()
    groups = {"tp": None}
    if holders is not None:
        groups["kv"] = holders
    return step, replica, groups, 0


def build_pipeline_parallel(args, rank, world_size, device=META):
    """pp_worker's replica, stages, action list and step (step 4)."""
    p, stage, m, v = world_size, rank, args.micro_batches, args.virtual_stages
    _, _, replica, stages = pipeline_parallel.hold_stages(args, stage, p, device)
    actions = pipeline_parallel.build_schedule(args.schedule, p, stage, m, v)
    inputs, targets = (t.to(device).chunk(m) for t in first_batch(args))

    def step():
        replica.begin_step()
        for chunk in stages:
            chunk.begin_step(targets)
        pipeline_parallel.run_schedule(actions, stages, inputs, (stage - 1) % p,
                                       (stage + 1) % p,
                                       (args.batch_size // m, args.context, args.dim))
        replica.average()
        if args.clip_grad:
            replica.clip(args.clip_grad, [dist.group.WORLD])
        replica.update()
    return step, replica, {"pp": None}, stage


def build_three_d(args, rank, world_size, device=META):
    """three_d_worker's ThreeDRank and step (step 5)."""
    me = three_d.ThreeDRank(rank, args, device)
    batch = first_batch(args)
    micro_batches = me.micro_batches(batch, args)

    def step():
        me.train_step(*micro_batches)
        if args.clip_grad:
            me.replica.clip(args.clip_grad, [me.groups["tp"], me.groups["pp"]], me.shares)
        me.replica.update()
    return step, me.replica, me.groups, me.stage


SCRIPTS = {"data_parallel": data_parallel, "tensor_parallel": tensor_parallel,
           "pipeline_parallel": pipeline_parallel, "three_d": three_d}
BUILDERS = {"data_parallel": build_data_parallel, "tensor_parallel": build_tensor_parallel,
            "pipeline_parallel": build_pipeline_parallel, "three_d": build_three_d}


def describe(ran):
    """A few lines on what the step ran."""
    fused = sum(calls for mm, calls in ran.matmuls.items()
                if isinstance(mm, tensor_parallel.Attention))
    lines = [f"rank {ran.rank} (stage {ran.stage}) of {world_of(ran.script, ran.args)}: "
             f"{sum(ran.matmuls.values()) - fused} matmuls and {fused} fused attention kernels, "
             f"{ran.record.flops() / 1e12:.3f} TFLOP, "
             f"inputs {dict((str(k), v) for k, v in ran.record.input_dtypes.items())}"]
    for mm, calls in sorted(ran.matmuls.items(), key=lambda item: -item[0].flops() * item[1]):
        if isinstance(mm, tensor_parallel.Attention):
            lines.append(f"  {calls:>4} x fused attention {'backward' * mm.backward or 'forward'}"
                         f" of {mm.sequences} heads' [{mm.context}, {mm.head_dim}] "
                         f"{SIZE_NAMES[mm.in_bytes]}, lse fp32")
            continue
        lines.append(f"  {calls:>4} x [{mm.m}, {mm.k}] x [{mm.k}, {mm.n}] "
                     f"{SIZE_NAMES[mm.in_bytes]} -> {SIZE_NAMES[mm.out_bytes]}"
                     f"{' (adds into its output)' * mm.accumulate}")
    for (group, kind, nbytes), calls in sorted(ran.comms.items()):
        lines.append(f"  {calls:>4} x {group} {kind} of {nbytes} bytes")
    if ran.record.ops["_fused_adamw_"]:
        lines.append(f"  {ran.record.ops['_fused_adamw_']:>4} x AdamW's fused kernel over the "
                     f"rank's parameters (torch._fused_adamw_)")
    lines.append(f"  held at the step's end {sum(ran.held.values())} bytes; the step's "
                 f"allocations at their most {ran.peak_bytes} bytes")
    moved = ran.record.moved
    top = ", ".join(f"{name} {nbytes / 1e9:.2f}" for name, nbytes in moved.most_common(4))
    lines.append(f"  memory-bound ops moved {sum(moved.values()) / 1e9:.2f} GB ({top})")
    return "\n".join(lines)


SIZE_NAMES = {2: "bf16", 4: "fp32"}


class Door(argparse.ArgumentParser):
    error = collectives.Parser.error      # the scripts' door: one line on stderr, exit 2


def main(argv=None):
    """The command line: a script, --rank, and the script's own flags, through its own door
    (as on a node of 8 GPUs); every refusal before any process group exists."""
    parser = Door(prog="tests/gpu_path.py", description="One rank's training step of a script, "
                  "as on GPUs, recorded on the meta device over torch's fake process group. "
                  "Every other flag is the script's own (see its --help); --vocab-size V "
                  "prices another vocabulary.")
    parser.add_argument("script", choices=sorted(SCRIPTS), help="the step one rank of runs")
    parser.add_argument("--rank", type=int, default=0,
                        help="which rank of the script's world (default 0)")
    ours, theirs = parser.parse_known_args(argv)
    args = gpu_node_args(ours.script, theirs)
    world_size = world_of(ours.script, args)
    if args.experts:
        parser.error("--experts: this harness builds no routers; the GPU path of experts is "
                     "not recorded yet")
    if ours.script == "tensor_parallel" and args.cp > 1:
        parser.error("--cp: this harness builds step 3's ranks without context parallelism; "
                     "record it as three_d --cp")
    if not 0 <= ours.rank < world_size:
        parser.error(f"--rank {ours.rank}: expected 0 to {world_size - 1}, a rank of this "
                     f"world of {world_size}")
    print(describe(run_step(ours.script, theirs, ours.rank)))


if __name__ == "__main__":
    collectives.run_main(main)
