"""make bench: each step of the collection beside what PyTorch gives for it, and the
figures that are not the lecture. The scripts never import this; it imports them.

    python tests/bench.py collectives [--world-size N]   # time and bus bandwidth of each collective;
                                                        # the start-up of 8 ranks by three launchers
    python tests/bench.py data_parallel [its flags]      # ours against DistributedDataParallel and serial
    python tests/bench.py tensor_parallel [its flags]    # against ColwiseParallel and RowwiseParallel
    python tests/bench.py pipeline_parallel [its flags]  # against ScheduleGPipe and Schedule1F1B
    python tests/bench.py three_d [its flags]            # against PyTorch's own 3D composition
    python tests/bench.py memory [data_parallel's flags] # ZeRO's memory table, stages 0 to 3
    python tests/bench.py bubble-table                   # pipeline bubble and stash, p = 2, 4 and m = 4, 8
    python tests/bench.py count-comm SCRIPT [its flags]  # bytes sent per step, counted, beside the formula
    python tests/bench.py plan [--world-size --num-layers --dim --batch-size --steps]
                                                        # three_d.py --plan's step times against runs
    python tests/bench.py plan-speed                     # --plan's own time, 8 to 1,024 GPUs
    python tests/bench.py recompute-memory [its sizes]   # steps 2, 3: peak memory, --recompute or not
    python tests/bench.py checkpoint [three_d's flags]   # a checkpoint's write and read beside a step
    python tests/bench.py cp-balance                     # --cp's attention pairs and time a rank
    python tests/bench.py cp-race                        # each --cp-style against the others, serial
    python tests/bench.py cp-memory                      # a rank's memory as --cp grows, at T 16,384
    python tests/bench.py moe-race                       # --ep's experts against an nn.Module MoE
    python tests/bench.py machine                        # one line naming this machine

Each comparison takes the script's own flags (--steps: the timed steps, at least 5), runs
the same step with PyTorch's API on the same model, sizes, data and world size, with SGD,
checks that the two compute the same thing, then times them taking turns (race.py).
"""
import contextlib
import functools
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import warnings
from types import SimpleNamespace

warnings.filterwarnings("ignore", "Failed to initialize NumPy")   # torch warns without numpy; unneeded
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import collectives  # noqa: E402
import data_parallel  # noqa: E402
import pipeline_parallel  # noqa: E402
import tensor_parallel  # noqa: E402
import three_d  # noqa: E402
from collectives import RankFailed, cleanup, ring_all_reduce, setup, spawn, under_torchrun  # noqa: E402
from data_parallel import init_params, model_blocks, replica_rows  # noqa: E402
from pipeline_parallel import Recorder, build_schedule, run_schedule, stage_parts, virtual_stage  # noqa: E402
from race import (ROOT, as_module, bench_sizes, ce_sum, check_and_race, dp_side, end_race, first_batch,  # noqa: E402
                  machine, replica_options, print_race, race, serial_side, sgd, spawn_returning)
from tensor_parallel import part_kinds, shard, tensor_kinds, tp_blocks  # noqa: E402


# ----------------------------------------------------------------------------------
# Step 1: time each collective, and report bandwidth the way nccl-tests does
# ----------------------------------------------------------------------------------
#
# For a tensor of S bytes that took t seconds, the algorithm bandwidth is algbw = S / t.
# It depends on n: an all-reduce over more ranks has more to move. The bus bandwidth
# busbw multiplies algbw by the fraction of S that each rank must send or receive at the
# least, so it can be compared with the link's speed, and across collectives and sizes:
#   reduce-scatter: rank r's part of each of the n-1 other slices has to leave rank r,
#                   (n-1)/n x S bytes.                        busbw = algbw x (n-1)/n
#   all-gather:     rank r has to receive the n-1 slices it lacks, (n-1)/n x S bytes.
#                                                             busbw = algbw x (n-1)/n
#   all-reduce:     a reduce-scatter, then an all-gather.     busbw = algbw x 2(n-1)/n
# S is the full tensor: the input of reduce-scatter and the output of all-gather. The
# lecture takes S for reduce-scatter to be the per-rank output, S/n, so its
# reduce-scatter figure is busbw / n, n times below its all-reduce figure for one link.

BENCH_SIZES = [4 * 1024 * 4**i for i in range(8)]   # 4 KiB, 16 KiB, ..., 64 MiB
REPEATS = 5


def bandwidth(rank, world_size):
    device = setup(rank, world_size)
    n, results = world_size, []   # (collective, bytes, seconds, algbw, busbw)
    for size in BENCH_SIZES:
        numel = max(n, size // 4 // n * n)   # float32 elements; n divides it, for the slices
        # Zeros: the values do not change the time, and zeros never overflow, however often summed.
        full, piece = torch.zeros(numel, device=device), torch.zeros(numel // n, device=device)
        one_pass, two_passes = (n - 1) / n, 2 * (n - 1) / n   # busbw / algbw, derived above
        calls = {"all-reduce": (lambda: dist.all_reduce(full), two_passes),
                 "reduce-scatter": (lambda: dist.reduce_scatter_single(piece, full), one_pass),
                 "all-gather": (lambda: dist.all_gather_single(full, piece), one_pass),
                 "ring all-reduce": (lambda: ring_all_reduce(full), two_passes)}
        for name, (run, bus_factor) in calls.items():
            seconds = race({name: run}, device, repeats=REPEATS)[name]
            algbw = full.numel() * 4 / seconds
            results.append((name, full.numel() * 4, seconds, algbw, algbw * bus_factor))
    if rank == 0:
        print_bandwidth(results, world_size, dist.get_backend())
    cleanup()


def print_bandwidth(results, world_size, backend):
    print(f"{world_size} ranks, {backend}, float32; time is the median of {REPEATS} runs after 2 warm-up; "
          f"GB/s = 1e9 bytes/s")
    print(f"{'collective':<16}{'size':>10}{'time (us)':>12}{'algbw (GB/s)':>14}{'busbw (GB/s)':>14}")
    for name in dict.fromkeys(row[0] for row in results):   # one block per collective
        for collective, size, seconds, algbw, busbw in results:
            if collective == name:
                print(f"{collective:<16}{human_bytes(size):>10}{seconds * 1e6:>12.1f}"
                      f"{algbw / 1e9:>14.3f}{busbw / 1e9:>14.3f}")
        print()
    if backend == "gloo" and world_size > (os.cpu_count() or 1):
        print(f"note: {world_size} ranks share {os.cpu_count()} CPU cores; the small sizes time the "
              f"scheduler more than the collective")


def human_bytes(size):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}"
        size /= 1024


# Start-up: from "start 8 ranks" to the end of their first all-reduce. The three
# launchers do the same job; torchrun runs this tiny script.
STARTUP_SCRIPT = """\
import warnings
warnings.filterwarnings("ignore", "Failed to initialize NumPy")
import torch, torch.distributed as dist
dist.init_process_group("gloo")
one = torch.ones(1)
dist.all_reduce(one)
assert one.item() == dist.get_world_size()
dist.destroy_process_group()
"""


def one_all_reduce(rank, world_size):
    """The whole job of a rank in the start-up race: join, one all-reduce, leave."""
    setup(rank, world_size)
    one = torch.ones(1)
    dist.all_reduce(one)
    assert one.item() == world_size
    cleanup()


def _mp_spawn_rank(rank, world_size, store_path):
    """mp.spawn's rank: the same job, meeting at a file store as ours do."""
    os.environ.update(PARALLEL_STORE=store_path, PARALLEL_BACKEND="gloo")
    one_all_reduce(rank, world_size)


def startup_race(world_size=8, repeats=3):
    """Seconds from launch to the end of one all-reduce on world_size CPU ranks, for our
    launcher, torch.multiprocessing.spawn and torchrun: median of `repeats`, the launchers
    taking turns. {launcher: seconds}."""
    folder = tempfile.mkdtemp(prefix="parallel-startup-")
    script = os.path.join(folder, "one_all_reduce.py")
    with open(script, "w") as f:
        f.write(STARTUP_SCRIPT)

    def with_mp_spawn():
        mp.spawn(_mp_spawn_rank, args=(world_size, os.path.join(folder, f"store-{time.monotonic_ns()}")),
                 nprocs=world_size)

    def with_torchrun():   # its ranks' error files in our folder (else a torchelastic_* left in /tmp)
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc-per-node={world_size}", f"--log-dir={folder}", script],
                              capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"torchrun failed: {done.stderr.strip().splitlines()[-1:]}")

    launchers = {"collectives.spawn (fork)": lambda: spawn(one_all_reduce, world_size, backend="gloo"),
                 "torch.multiprocessing.spawn": with_mp_spawn, "torchrun --standalone": with_torchrun}
    times = {name: [] for name in launchers}
    try:
        for _ in range(repeats):
            for name, launch in launchers.items():
                start = time.perf_counter()
                launch()
                times[name].append(time.perf_counter() - start)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {name: statistics.median(t) for name, t in times.items()}


def print_startup(times, world_size, repeats):
    print(f"start-up: {world_size} CPU ranks, from the launch to the end of one all-reduce (gloo); "
          f"median of {repeats}, the launchers taking turns")
    print(f"{'launcher':<30}{'seconds':>9}{'x ours':>9}")
    ours = times["collectives.spawn (fork)"]
    for name, seconds in times.items():
        print(f"{name:<30}{seconds:>9.2f}{seconds / ours:>9.1f}")
    print("why: fork starts each rank from this process, torch already imported; the other two start "
          f"{world_size} fresh interpreters that each import torch, sharing {os.cpu_count()} cores")


# ----------------------------------------------------------------------------------
# Step 2 against DistributedDataParallel
# ----------------------------------------------------------------------------------

TORCH_ZERO = {1: "ZeroRedundancyOptimizer + DDP", 2: "FSDP2, reshard_after_forward=False",
              3: "FSDP2 (fully_shard)"}


def versus_ddp(args):
    """Ours against DDP; with --zero N, ours with ZeRO-N against PyTorch's own sharding."""
    if args.zero:
        import torch.distributed.fsdp  # noqa: F401  (~2 s) once here, before the ranks fork
    times, diffs = spawn_returning(ddp_race, args.world_size, args, backend=args.backend, timeout_s=args.timeout_s)
    theirs = TORCH_ZERO[args.zero] if args.zero else "DDP"
    ratios = [(f"ours --zero {args.zero}", theirs), (f"ours --zero {args.zero} --overlap", theirs)] if args.zero \
        else [("ours", "DDP"), ("ours --overlap", "DDP"), ("ours --overlap", DDP_WRITTEN)]
    return dict(title=f"data parallel{f' with ZeRO-{args.zero}' if args.zero else ''} vs {theirs}: "
                      f"{bench_sizes(args, args.world_size)}",
                times=times, diffs=diffs, ratios=ratios, world_size=args.world_size, steps=args.steps)


DDP_WRITTEN = "DDP, attention written out"   # S, softmax, A v under autograd: no fused kernel


def ddp_race(rank, world_size, args):
    device = setup(rank, world_size)
    inputs, targets = (t.to(device) for t in first_batch(args))
    rows = replica_rows(args.batch_size, rank, world_size)
    m = args.micro_batches
    xs, ys = inputs[rows].chunk(m), targets[rows].chunk(m)       # [B/(d m), T] each
    n = len(rows)                                                 # this replica's mean: n T positions
    init = init_params(args)

    def ours(zero=0, overlap=False):
        parts = [[w.to(device, copy=True) for w in part] for part in init]
        return dp_side(parts, None, args, xs, ys, n, zero, overlap)
    model = as_module(init, device, args)
    if args.zero:
        sides = {f"ours --zero {args.zero}": ours(args.zero), f"ours --zero {args.zero} --overlap": ours(args.zero, True),
                 TORCH_ZERO[args.zero]: zero_side(args.zero, model, xs, ys, n * args.context, args.lr, device)}
    else:
        written = as_module(init, device, args, written=True)   # like for like: our attention's
        sides = {"ours": ours(), "ours --overlap": ours(overlap=True),   # maths, under autograd
                 "DDP": ddp_side(model, xs, ys, n * args.context, args.lr, device),
                 DDP_WRITTEN: ddp_side(written, xs, ys, n * args.context, args.lr, device)}
    sides["serial: our step, whole batch, 1 rank"] = serial_side(args, device)
    result = check_and_race(sides, device, args.steps)
    end_race(sides)
    return result


def zero_side(zero, model, xs, ys, n, lr, device):
    """PyTorch's own sharded data parallelism with SGD, as (step, state) in our layout.
    ZeRO-1: ZeroRedundancyOptimizer (each rank steps 1/d of the parameters, then broadcasts
    them) over DDP's all-reduced gradients. ZeRO-2 and 3: FSDP2's fully_shard, which
    reduce-scatters the gradients and gathers the weights, part by part; ZeRO-2 keeps
    the weights gathered after the forward (reshard_after_forward=False)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
    if zero == 1:
        wrapped = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=lr)
    else:
        for part in model.parts:
            fully_shard(part, reshard_after_forward=zero == 3)
        wrapped = fully_shard(model, reshard_after_forward=zero == 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)

    def step():
        optimizer.zero_grad()
        for mb, (x, y) in enumerate(zip(xs, ys)):
            if zero == 1 and mb < len(xs) - 1:
                with wrapped.no_sync():
                    ce_sum(n)(wrapped(x), y).backward()
            else:
                ce_sum(n)(wrapped(x), y).backward()
        optimizer.step()

    def whole(tensor):   # FSDP2's are DTensors, cut over the ranks: gathered whole
        return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    weights = [w for w, _ in model.weights()]
    return step, lambda: (model.ours([whole(w) for w in weights]), model.ours([whole(w.grad) for w in weights]))


def ddp_side(model, xs, ys, n, lr, device):
    """DDP's step with SGD, as (step, state). no_sync() skips the all-reduce of every
    micro-batch but the last; each micro-batch's loss is its rows' cross-entropy / n, as in
    cross_entropy, and DDP averages the gradients over the replicas, as ours."""
    from torch.nn.parallel import DistributedDataParallel
    ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)

    def step():
        optimizer.zero_grad()
        for mb, (x, y) in enumerate(zip(xs, ys)):
            if mb < len(xs) - 1:
                with ddp.no_sync():
                    ce_sum(n)(ddp(x), y).backward()
            else:
                ce_sum(n)(ddp(x), y).backward()
        optimizer.step()
    return step, model.state


def memory_table(args):
    """ZeRO's memory table for stages 0 to 3 in turn: what one replica holds after a step,
    counted from its tensors, beside the formulas (data_parallel.show_memory)."""
    for zero in range(4):
        args.zero = zero
        spawn(memory_worker, args.world_size, args, backend=args.backend, timeout_s=args.timeout_s)


def memory_worker(rank, world_size, args):
    device = setup(rank, world_size)
    init = init_params(args)
    replica = data_parallel.make_replica([[w.to(device, copy=True) for w in part] for part in init], None,
                                         zero=args.zero, **replica_options(args))
    inputs, targets = (t.to(device) for t in first_batch(args))
    rows, m = replica_rows(args.batch_size, rank, world_size), args.micro_batches
    blocks = model_blocks(args, device=device)
    largest = []
    for step in range(2):   # AdamW's state is made in the first step: the second holds it throughout
        if step == 1 and args.zero == 3:
            largest = watch_gathers(replica)
        data_parallel.dp_step(replica, blocks, data_parallel.cross_entropy, inputs[rows].chunk(m),
                              targets[rows].chunk(m), len(rows) * args.context)
        replica.update()
    if rank == 0:
        data_parallel.show_memory(replica, args, "each replica")
        if largest:
            print(f"  largest at any moment of the last step: {max(largest)} bytes, at a bucket's gather: "
                  f"the shards, the gradient buckets then, and the buckets held (two at most)")
    cleanup()


def watch_gathers(replica):
    """What the replica holds after each of ZeRO-3's gathers, where it is at its largest: a list
    that fills as the step runs."""
    held = []
    gather = replica.gather_weights

    def gather_and_count(*args, **kwargs):
        gather(*args, **kwargs)
        held.append(sum(data_parallel.memory_held(replica).values()))
    replica.gather_weights = gather_and_count
    return held

# ----------------------------------------------------------------------------------
# Step 3 against ColwiseParallel on a DeviceMesh
# ----------------------------------------------------------------------------------

TORCH_TP = {"all-gather": "ColwiseParallel, outputs all-gathered",
            "megatron": "ColwiseParallel + RowwiseParallel",
            "sequence": "Colwise + RowwiseParallel + SequenceParallel"}


def torch_tp_name(args):
    return TORCH_TP["sequence" if args.sequence_parallel else args.tp_style]


def versus_colwise(args):
    import torch.distributed.tensor.parallel  # noqa: F401  (~2 s) once here, before the ranks fork
    times, diffs = spawn_returning(colwise_race, args.world_size, args, backend=args.backend,
                                   timeout_s=args.timeout_s)
    style = args.tp_style + ", sequence parallel" * args.sequence_parallel
    return dict(title=f"tensor parallel ({style}) vs torch.distributed.tensor.parallel: "
                      f"{bench_sizes(args, args.world_size)}\n  torch: the embedding RowwiseParallel, the head "
                      f"ColwiseParallel with its logits left sharded, and loss_parallel()",
                times=times, diffs=diffs, ratios=[("ours", torch_tp_name(args))],
                world_size=args.world_size, steps=args.steps)


def colwise_race(rank, world_size, args):
    device = setup(rank, world_size)
    inputs, targets = (t.to(device) for t in first_batch(args))
    m, n = args.micro_batches, args.batch_size * args.context
    xs, ys = inputs.chunk(m), targets.chunk(m)                   # the whole batch on every rank
    init = init_params(args)
    kinds = part_kinds(args.num_layers)
    splits = tensor_kinds(kinds, args, world_size)
    shards = [[shard(w, k, rank, world_size, args.kv_heads).to(device) for w, k in zip(part, ks)]
              for part, ks in zip(init, splits)]
    replica = data_parallel.DataParallel(shards, dist.new_subgroups(1)[0], **replica_options(sgd(args)))
    blocks = tp_blocks(kinds, args, positions=torch.arange(args.context, device=device))
    loss_fn = functools.partial(tensor_parallel.vocab_parallel_cross_entropy, vocab_size=args.vocab_size)
    split = [k for ks in splits for k in ks]
    summed = tensor_parallel.split_as(split, "partial")          # QK-norm's gains
    if args.sequence_parallel:
        summed += tensor_parallel.split_as(split, "whole")

    def step():                       # as tp_worker's
        data_parallel.dp_step(replica, blocks, loss_fn, xs, ys, n)
        tensor_parallel.sum_partial_grads(replica.grads(), summed, dist.group.WORLD)
        replica.update()
    model = as_module(init, device, args)
    sides = {"ours": (step, lambda: (replica.params, replica.grads())),
             torch_tp_name(args): colwise_side(model, xs, ys, n, args),
             "serial: our step, whole batch, 1 rank": serial_side(args, device)}
    result = check_and_race(sides, device, args.steps)
    end_race(sides)
    return result


def torch_tp_plan(model, style, head_logits, sequence=False):
    """parallelize_module's plan for a TorchLM over tp: the embedding RowwiseParallel (each rank
    its classes' rows, the lookups all-reduced); Wq, Wk, Wv ColwiseParallel, at head
    boundaries (kv heads as many as tp or more: torch has no replicated kv head); Megatron: W1
    and W3 too, Wo and W2 RowwiseParallel; the all-gather style: Wo, W1, W3, W2 ColwiseParallel,
    the heads' outputs and SwiGLU's all-gathered into Wo and W2, their outputs all-gathered
    (Replicate); the head ColwiseParallel, its logits as head_logits says. sequence:
    torchtitan's sequence parallelism on Megatron's: each block's input cut along T
    (PrepareModuleInput; the embedding's output is whole), the norms SequenceParallel, Wq, Wk,
    Wv, W1 and W3 gathering along T, Wo and W2 reduce-scattering to it. (Its q, k and v each
    gather n: no module holds the three together.)"""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    gathered = ColwiseParallel(input_layouts=Shard(-1), output_layouts=Replicate())
    block = {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(), "w1": ColwiseParallel(),
             "w3": ColwiseParallel(), "wo": RowwiseParallel() if style == "megatron" else gathered,
             "w2": RowwiseParallel() if style == "megatron" else gathered}
    if sequence:
        column = ColwiseParallel(input_layouts=Shard(1))
        row = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
        block = {"norm1": SequenceParallel(), "norm2": SequenceParallel(), "wq": column, "wk": column,
                 "wv": column, "w1": column, "w3": column, "wo": row, "w2": row}
    plan = {}
    first_block = True
    for i, kind in enumerate(model.kinds):
        if kind == "embedding":
            plan[f"parts.{i}.embedding"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        elif kind == "head":
            plan[f"parts.{i}.head"] = head_logits
            if sequence:
                plan[f"parts.{i}.norm"] = SequenceParallel()
        else:
            plan.update((f"parts.{i}.{name}", layer) for name, layer in block.items())
            if sequence and first_block:
                plan[f"parts.{i}"] = PrepareModuleInput(input_layouts=(Replicate(),),
                                                        desired_input_layouts=(Shard(1),),
                                                        use_local_output=False)
            first_block = False
    return plan


def colwise_side(model, xs, ys, n, args):
    """PyTorch's TP step with SGD, as (step, state): torch_tp_plan, the head's logits left
    sharded by class, and the loss under loss_parallel(): the vocab-parallel cross-entropy.
    A block runs its rank's h/t heads and G/t kv heads (torchtitan's way). nn.Linear holds W^T, so a weight's
    local part is W_t^T. Each of its shards is ours where T divides V, and where T = 2 (torch
    cuts 97 classes 49, 48, as vocab_range does; at T = 3, 33, 33, 31)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module
    tp = dist.get_world_size()
    mesh = init_device_mesh(xs[0].device.type, (tp,))
    head = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    if args.sequence_parallel:
        head = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, mesh, torch_tp_plan(model, args.tp_style, head, args.sequence_parallel))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)

    def step():
        optimizer.zero_grad()
        for x, y in zip(xs, ys):
            with loss_parallel():     # the softmax over the sharded logits, never gathered
                (F.cross_entropy(model(x).transpose(1, 2), y) * (y.numel() / n)).backward()
        optimizer.step()
    weights = [w for w, _ in model.weights()]

    def local(tensor, weight):   # a gradient may come back laid out otherwise; a gain: plain
        if not hasattr(weight, "to_local"):
            return tensor
        return tensor.redistribute(weight.device_mesh, weight.placements).to_local()
    return step, lambda: (model.ours([local(w, w) for w in weights]),
                          model.ours([local(w.grad, w) for w in weights]))


# ----------------------------------------------------------------------------------
# Step 4 against torch.distributed.pipelining
# ----------------------------------------------------------------------------------

TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "zb-h1": "ScheduleInterleavedZeroBubble",
                   "interleaved": "ScheduleInterleaved1F1B", "dualpipev": "ScheduleDualPipeV"}


def versus_pipelining(args):
    """GPipe and 1F1B (--schedule gpipe or 1f1b: both), or ZB-H1, or interleaved, each
    against torch.distributed.pipelining's schedule for it."""
    import torch.distributed.pipelining  # noqa: F401  (~3 s) once here, before the ranks fork
    times, diffs = spawn_returning(pipelining_race, args.world_size, args, backend=args.backend,
                                   timeout_s=args.timeout_s)
    ratios = [(f"ours {s}", f"torch {TORCH_SCHEDULES[s]}") for s in TORCH_SCHEDULES if f"ours {s}" in times]
    notes = [] if ratios else ["no PyTorch schedule ran: see above"]
    if args.schedule in ("gpipe", "1f1b") and len(ratios) == 1:
        notes = [f"1F1B skipped: PyTorch's needs --micro-batches >= stages ({args.world_size})"]
    return dict(title=f"pipeline parallel vs torch.distributed.pipelining: {bench_sizes(args, args.world_size)}"
                      + (f", v={args.virtual_stages}" if args.schedule == "interleaved" else ""),
                times=times, diffs=diffs, ratios=ratios, notes=notes, world_size=args.world_size, steps=args.steps)


def pipelining_race(rank, world_size, args):
    import torch.distributed.pipelining as pipelining
    device = setup(rank, world_size)
    dist.barrier()   # a collective on every rank before the first point-to-point (NCCL asks for it)
    full = init_params(args)
    inputs, targets = (t.to(device) for t in first_batch(args))
    schedules = ["gpipe", "1f1b"] if args.schedule in ("gpipe", "1f1b") else [args.schedule]
    if args.micro_batches < world_size and "1f1b" in schedules:
        schedules.remove("1f1b")       # PyTorch's 1F1B needs at least as many micro-batches as stages
    v = args.virtual_stages
    sides = {}
    for name in schedules:
        chunk_parts = [stage_parts(args.num_layers, world_size, rank, v, c, name) for c in range(v)]
        sides[f"ours {name}"] = pp_side(name, rank, world_size, inputs, targets, args)
        sides[f"torch {TORCH_SCHEDULES[name]}"] = pipelining_side(
            [as_module(full, device, args, parts) for parts in chunk_parts],
            getattr(pipelining, TORCH_SCHEDULES[name]), rank, world_size, inputs, targets, args)
    sides["serial: our step, whole batch, 1 rank"] = serial_side(args, device)
    result = check_and_race(sides, device, args.steps)
    end_race(sides)
    return result


def pp_side(schedule, stage, num_stages, inputs, targets, args):
    """Our stage (its chunks' parts) with one schedule and SGD, as (step, state)."""
    m, p, v = args.micro_batches, num_stages, args.virtual_stages
    _, _, replica, chunks = pipeline_parallel.hold_stages(sgd(args), stage, p, inputs.device)
    actions = build_schedule(schedule, p, stage, m, v)

    def step():
        begin_step(replica, chunks, targets.chunk(m))
        run_schedule(actions, chunks, inputs.chunk(m), (stage - 1) % p, (stage + 1) % p,
                     (args.batch_size // m, args.context, args.dim), v_shape=schedule == "dualpipev")
        replica.average()
        replica.update()
    return step, lambda: (replica.weights, replica.grads())


def begin_step(replica, stages, targets):
    """What a worker does before its schedule runs: the replica's and every stage's step begin."""
    replica.begin_step()
    for stage in stages:
        stage.begin_step(targets)


def mean_cross_entropy(logits, y):   # a micro-batch's mean over its positions: [b, T, V], [b, T]
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def pipelining_side(modules, schedule_class, rank, num_stages, inputs, targets, args):
    """PyTorch's stages (this rank's chunks of parts, each a module; chunk c is stage c p +
    rank, the embedding in stage 0's, the head in the last's) with a schedule of the same stage
    and micro-batch counts, and SGD, as (step, state). Each micro-batch's loss is its mean
    cross-entropy on the last stage, and the schedule divides the gradients by m (scale_grads):
    with equal micro-batches, the gradient of the mean over the batch, as ours."""
    from torch.distributed.pipelining import PipelineStage
    # Shapes given up front (static mode): inferring them sends pickled objects, which needs
    # numpy. An activation between stages requires grad: its gradient is sent back.
    b = args.batch_size // args.micro_batches
    activation = torch.zeros(b, args.context, args.dim, device=inputs.device, requires_grad=True)   # [B/m, T, D]
    logits = torch.zeros(b, args.context, args.vocab_size, device=inputs.device)                     # [B/m, T, V]
    v = len(modules)
    stages = []
    v_shape = schedule_class.__name__ == "ScheduleDualPipeV"
    for c, module in enumerate(modules):
        virtual = virtual_stage("dualpipev" if v_shape else "interleaved", num_stages, rank, c)
        stages.append(PipelineStage(module, virtual, v * num_stages, inputs.device,
                                    input_args=inputs[:b] if virtual == 0 else activation,
                                    output_args=logits if virtual == v * num_stages - 1 else activation))
    single = schedule_class.__name__ in ("ScheduleGPipe", "Schedule1F1B")
    schedule = schedule_class(stages[0] if single else stages, args.micro_batches, loss_fn=mean_cross_entropy)
    first, last = rank == 0, rank == (0 if v_shape else num_stages - 1)   # the V: both on 0
    optimizer = torch.optim.SGD([q for module in modules for q in module.parameters()], lr=args.lr)

    def step():
        optimizer.zero_grad()
        schedule.step(*[inputs] if first else [], **dict(target=targets) if last else {}, return_outputs=False)
        optimizer.step()

    def state():
        weights, grads = [], []
        for module in modules:
            w, g = module.state()
            weights += w
            grads += g
        return weights, grads
    return step, state


# ----------------------------------------------------------------------------------
# Step 5 against DeviceMesh (dp, pp, tp) composed
# ----------------------------------------------------------------------------------
#
# PyTorch's own pieces on the same rank map: torch.distributed.pipelining over the pp
# groups, ColwiseParallel inside each stage over the tp groups, and one of three ways
# across dp: a manual all-reduce of the gradients, FSDP2 (fully_shard), or DDP. DDP with
# its defaults goes wrong in this composition on torch 2.13 (gloo): its first step's
# gradients are m times too large (after TP, DDP's module lists no parameters, so the
# schedule's division by m finds none; ddp_as_composed, and the README's "Measured").
# DDP runs here with scale_grads=False and the division by m done by hand, on our own
# references to the parameters.

DP_WAYS = ("all-reduce", "FSDP2", "DDP")


def versus_torch_3d(args):
    """Run the race, then DDP with its defaults; return what print_race prints."""
    import torch.distributed.fsdp  # noqa: F401  (~5 s with the two below) once, before the ranks fork
    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401
    world_size, launch = args.dp * args.pp * args.tp, dict(backend=args.backend, timeout_s=args.timeout_s)
    times, diffs = spawn_returning(torch_3d_race, world_size, args, **launch)
    failure = "not run under torchrun (its failure would end the ranks)" if under_torchrun() else \
        ddp_failure(args, world_size, launch)
    notes = [f"DDP with the schedule's default scale_grads=True: {failure}"]
    return dict(title=f"3D (dp={args.dp} pp={args.pp} tp={args.tp}, {args.schedule}) vs serial and PyTorch's own "
                      f"composition: {bench_sizes(args, world_size)}\n  torch 3D is DeviceMesh (dp, pp, tp), "
                      f"torch.distributed.pipelining over pp, ColwiseParallel over tp (the embedding "
                      f"RowwiseParallel, the head's logits gathered), and across dp: "
                      f"{', '.join(DP_WAYS)} (DDP: scale_grads=False, / m by hand)",
                times=times, diffs=diffs, world_size=world_size, steps=args.steps, notes=notes,
                ratios=[("ours", name) for name in times if name.startswith("torch")])


def torch_3d_race(rank, world_size, args):
    device = setup(rank, world_size)
    quiet_dtensor_warnings()
    mesh = torch_mesh(args, device)
    ours, full, inputs, targets = our_3d_side(rank, args, device)
    sides = {"ours": ours, "serial: our step, whole batch, 1 rank": serial_side(args, device)}
    for dp_way in DP_WAYS:
        sides[f"torch 3D, dp by {dp_way}"] = torch_3d_side(args, mesh, device, dp_way, full, inputs, targets)
    result = check_and_race(sides, device, args.steps)
    end_race(sides)
    return result


def our_3d_side(rank, args, device):
    """Our 3D step with SGD as (step, state) in our layout (this rank's shards); and the
    full parameters and this replica's batch, for PyTorch's sides."""
    me = three_d.ThreeDRank(rank, sgd(args, zero=0), device)
    batch = first_batch(args)
    micro_batches = me.micro_batches(batch, args)
    rows = replica_rows(args.batch_size, me.dp_rank, args.dp)

    def step():
        me.train_step(*micro_batches)
        me.replica.update()
    return ((step, lambda: (me.replica.weights, me.replica.grads())), me.init, batch[0][rows].to(device),
            batch[1][rows].to(device))


def torch_3d_side(args, mesh, device, dp_way, full, inputs, targets, ddp_divide_by_hand=True):
    """PyTorch's composition on this rank, with SGD, as (step, state) in our layout."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel
    d, p, t = (mesh[name].get_local_rank() for name in three_d.AXES)
    first, last, m = p == 0, p == args.pp - 1, args.micro_batches
    parts = stage_parts(args.num_layers, args.pp, p)
    model = lm = as_module(full, device, args, parts)   # its rank's heads, once split
    parallelize_module(model, mesh["tp"], torch_tp_plan(model, args.tp_style,
                                                        ColwiseParallel(output_layouts=Replicate())))
    splits = [k for j in parts for k in tensor_kinds(part_kinds(args.num_layers), args, args.tp)[j]]
    names = [name for name, _ in lm.named_parameters()]        # model.parameters()'s order
    where = {id(q): i for i, q in enumerate(lm.parameters())}
    ours = [where[id(w)] for w, _ in lm.weights()]             # our order, as indices into it
    transposed = [t for _, t in lm.weights()]
    if dp_way == "FSDP2":
        fully_shard(model, mesh=mesh["dp"])         # reduce-scatters the gradients, averaged over dp
    if dp_way == "DDP":
        model = DistributedDataParallel(model, device_mesh=mesh["dp"])
    params = list(model.parameters())               # ours to keep: after DDP's first forward it has none
    scale_grads = dp_way != "DDP" or not ddp_divide_by_hand  # the schedule's division by m misses DDP's parameters
    # Shapes given up front (static mode): inferring them sends pickled objects, which needs
    # numpy. An activation between stages requires grad: its gradient is sent back.
    b = len(inputs) // m
    activation = torch.zeros(b, args.context, args.dim, device=device, requires_grad=True)   # [B/(dp m), T, D]
    logits = torch.zeros(b, args.context, args.vocab_size, device=device)
    stage_module = PipelineStage(model, p, args.pp, device, group=mesh["pp"].get_group(),
                                 input_args=inputs[:b] if first else activation,
                                 output_args=logits if last else activation)
    schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule](
        stage_module, m, loss_fn=mean_cross_entropy, scale_grads=scale_grads)
    optimizer = torch.optim.SGD(params, lr=args.lr)

    def step():
        optimizer.zero_grad()
        schedule.step(*[inputs] if first else [], **dict(target=targets) if last else {}, return_outputs=False)
        if not scale_grads:
            for q in params:
                q.grad.div_(m)
        if dp_way == "all-reduce":
            for q in params:
                grad = q.grad.to_local() if hasattr(q.grad, "to_local") else q.grad
                dist.all_reduce(grad, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
        optimizer.step()

    def our_layout(tensors):
        """Each weight or gradient as our shard (shard_box's), tensors in params' order: the
        local part of a DTensor split over tp is ours (W_t^T where nn.Linear holds W^T; torch
        cuts the classes as vocab_range does at tp = 2); FSDP2's is cut over dp too: gathered
        whole, cut ours."""
        shards = []
        for i, flip, kind in zip(ours, transposed, splits):
            x = tensors[i]
            if dp_way == "FSDP2" and hasattr(x, "full_tensor"):
                whole = x.full_tensor()
                shards.append(tensor_parallel.shard(whole.T if flip else whole, kind, t, args.tp,
                                                    args.kv_heads))
                continue
            if hasattr(x, "to_local"):   # a gradient may come back laid out otherwise
                x = x.redistribute(params[i].device_mesh, params[i].placements).to_local()
            shards.append(x.T if flip else x)
        return shards
    assert len(names) == len(params)
    return step, lambda: (our_layout(params), our_layout([q.grad for q in params]))


def ddp_as_composed(rank, world_size, args, path):
    """DDP in the composition with the schedule's default scale_grads: rank 0 writes how
    its first step's gradients of the tp-split weights (DTensors) compare with ours, then a second step runs (it failed in
    DDP's bucket rebuild while the stages inferred their shapes at run time)."""
    device = setup(rank, world_size)
    quiet_dtensor_warnings()
    mesh = torch_mesh(args, device)
    (ours, ours_state), full, inputs, targets = our_3d_side(rank, args, device)
    theirs, theirs_state = torch_3d_side(args, mesh, device, "DDP", full, inputs, targets, ddp_divide_by_hand=False)
    sides = {"ours": (ours, ours_state), "DDP": (theirs, theirs_state)}
    ours()
    theirs()
    stage = three_d.coordinates(rank, three_d.rank_groups(args.dp, args.pp, args.tp, args.order))[1]
    kinds = [k for j in stage_parts(args.num_layers, args.pp, stage)
             for k in tensor_kinds(part_kinds(args.num_layers), args, args.tp)[j]]
    norms = torch.tensor([sum(g.square().sum() for g, kind in zip(state()[1], kinds) if kind != "whole").item()
                          for state in (ours_state, theirs_state)], device=device)   # the tp-split weights'

    dist.all_reduce(norms)                                     # squared norms of the whole model's gradients
    if rank == 0:
        with open(path, "w") as f:                             # text: torch.save can hang in a forked rank
            f.write(str((norms[1] / norms[0]).sqrt().item()))
    del ours, ours_state, theirs, theirs_state
    sides["DDP"][0]()                                          # the second step
    end_race(sides)


def ddp_failure(args, world_size, launch):
    """What goes wrong with DDP composed with its defaults: (first step's gradient ratio
    to ours, or None; the second step's error, or None), and the line that says it."""
    ratio, error = ddp_failure_figures(args, world_size, launch)
    first = "no first step" if ratio is None else f"first step's gradients {ratio:.2f}x ours (m = {args.micro_batches})"
    return f"{first}; second step: {error or 'it ran'}"


def ddp_failure_figures(args, world_size, launch):
    folder = tempfile.mkdtemp(prefix="parallel-ddp-")
    path = os.path.join(folder, "ratio")
    error = ratio = None
    try:
        try:
            spawn(ddp_as_composed, world_size, args, path, **launch)
        except RankFailed as e:
            # The root cause: the first "SomethingError: ..." line of the failing rank's traceback
            error = next((line for line in e.text.splitlines() if re.match(r"\w+(Error|Exception): \S", line)),
                         str(e))
        if os.path.exists(path):
            with open(path) as f:
                ratio = float(f.read())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return ratio, error


def torch_mesh(args, device):
    """PyTorch's DeviceMesh over our rank map: the grid [dp, pp, tp] of ranks."""
    from torch.distributed.device_mesh import DeviceMesh
    return DeviceMesh(device.type, three_d.rank_grid(args.dp, args.pp, args.tp, args.order),
                      mesh_dim_names=three_d.AXES)


def quiet_dtensor_warnings():
    """Gathering an FSDP2 + TP weight whole (for the check, not timed) warns on every rank."""
    import logging
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


# ----------------------------------------------------------------------------------
# The pipeline bubble and the peak stash, measured for p = 2, 4 and m = 1..8
# ----------------------------------------------------------------------------------

def bubble_table(stages=(2, 4), micro_batches=(4, 8), dim=1024, rows=64, steps=3, backend="auto",
                 timeout_s=60.0):
    """Every schedule for each p in stages and m in micro_batches: a list of dicts with the
    measured bubble of the median step ("bubble", "step_ms"), the mean time of one F, B and
    W ("times"), and each stage's peak stash ("peak_stash"). Each stage holds two dim x dim
    layers (interleaved: two chunks of one); rows rows per micro-batch."""
    table = []
    for p in stages:   # one run of p ranks measures every m and every schedule
        table += spawn_returning(bubble_worker, p, list(micro_batches), dim, rows, steps,
                                 backend=backend, timeout_s=timeout_s)
    return table


def bubble_worker(rank, num_stages, micro_batches, dim, rows, steps):
    device = setup(rank, num_stages)
    dist.barrier()   # a collective on every rank before the first point-to-point (NCCL asks for it)
    p, stage = num_stages, rank
    model = SimpleNamespace(num_layers=2 * p, dim=dim, heads=4, kv_heads=2, ffn_dim=3 * dim, rope_theta=10000.0,
                            qk_norm=False, context=8, vocab_size=data_parallel.VOCAB_SIZE, seed=0, optimizer="sgd",
                            lr=0.0, bf16=False, recompute=False, experts=0)   # two blocks a stage
    table = []
    for m in micro_batches:
        batch = data_parallel.make_batch(SimpleNamespace(**vars(model), batch_size=m * rows), step=m)
        x, y = (t.to(device).chunk(m) for t in batch)
        for schedule in ("gpipe", "1f1b", "zb-h1", "interleaved", "dualpipev")[:4 + (m >= 2 * p)]:
            v = 2 if schedule in ("interleaved", "dualpipev") else 1
            _, _, replica, chunks = pipeline_parallel.hold_stages(
                SimpleNamespace(**vars(model), micro_batches=m, virtual_stages=v, batch_size=m * rows,
                                schedule=schedule), stage, p, device)
            actions = build_schedule(schedule, p, stage, m, v)
            spans, times = [], []
            for i in range(steps + 1):    # the first step opens the connections: not measured
                dist.barrier()            # every stage starts the step at once
                begin_step(replica, chunks, y)
                recorder = Recorder(device)
                run_schedule(actions, chunks, x, (stage - 1) % p, (stage + 1) % p, (rows, model.context, dim),
                             recorder=recorder, v_shape=schedule == "dualpipev")
                events, peak = recorder.events(), recorder.peak
                busy = torch.tensor([sum(e[4] - e[3] for e in events), min(e[3] for e in events),
                                     max(e[4] for e in events)], dtype=torch.float64, device=device)
                everyone = [torch.empty_like(busy) for _ in range(p)]
                dist.all_gather(everyone, busy)
                if i:   # the step spans the first F's start to the last B's or W's end, on any stage
                    begin, end = min(e[1].item() for e in everyone), max(e[2].item() for e in everyone)
                    spans.append((end - begin, sum(1 - e[0].item() / (end - begin) for e in everyone) / p))
                    times += [(op, end - start) for op, _, _, start, end in events]
            peaks = [torch.empty(1, dtype=torch.long, device=device) for _ in range(p)]
            dist.all_gather(peaks, torch.tensor([peak], device=device))
            per_op = torch.tensor([statistics.mean(t for op, t in times if op == kind) if kind in
                                   {op for op, _ in times} else 0.0 for kind in "FBW"], dtype=torch.float64,
                                  device=device)
            dist.all_reduce(per_op)       # the mean over the stages of one F, B and W
            span, bubble = sorted(spans)[steps // 2]          # the median step, by its span
            table.append({"p": p, "m": m, "schedule": schedule, "bubble": bubble, "step_ms": span * 1e3,
                          "times": (per_op / p).tolist(), "peak_stash": [int(x) for x in peaks]})
    cleanup()
    return table


def peak_bound(schedule, p, s, m, v=2):
    """The most micro-batches a stage can hold under each schedule (tests check it exactly)."""
    return {"gpipe": m, "1f1b": min(p - s, m), "zb-h1": min(p, m), "dualpipev": 2 * p + 1,
            "interleaved": min(pipeline_parallel.warmup_forwards("interleaved", p, s, m, v) + 1, v * m)}[schedule]


def print_bubble_table(table, dim, rows, steps):
    print(f"pipeline bubble and stash: two blocks of D={dim} per stage (interleaved: two chunks of one), "
          f"{rows} rows per micro-batch, the median step of {steps} after a warm-up step")
    print(f"{'p':>3}{'m':>3}  {'schedule':<12}{'theory':>8}{'measured':>10}{'ms':>8}   stash per stage, bound")
    for r in table:
        p, m, schedule = r["p"], r["m"], r["schedule"]
        t_f, t_b, t_w = r["times"]
        theory = pipeline_parallel.pipeline_costs(schedule, p, 0, m, 2 if schedule == "interleaved" else 1,
                                                  times=(t_f, t_b, t_w) if schedule == "zb-h1" else (1, 1, 1))[0]
        extra = f"   T_F {t_f * 1e3:.2f} T_B {t_b * 1e3:.2f} T_W {t_w * 1e3:.2f} ms" if schedule == "zb-h1" else ""
        if schedule == "dualpipev":   # DeepSeek's (p-1)(F&B+B-3W), F&B = F + B run one after the other
            idle = max(0.0, (p - 1) * (t_f + 2 * t_b - 3 * t_w))
            theory = idle / (2 * m * (t_f + t_b + t_w) + idle)
            ours = pipeline_parallel.v_bubble(p, m, t_f, t_b, t_w)
            extra = f"   T_F {t_f * 1e3:.2f} T_B {t_b * 1e3:.2f} T_W {t_w * 1e3:.2f} ms; its lists simulated: {ours:.1%}"
        bound = [peak_bound(schedule, p, s, m) for s in range(p)]
        print(f"{p:>3}{m:>3}  {schedule:<12}{theory:>8.1%}{r['bubble']:>10.1%}{r['step_ms']:>8.1f}   "
              f"{' '.join(map(str, r['peak_stash']))}, {' '.join(map(str, bound))}{extra}")
    cores, most = os.cpu_count() or 1, max(r["p"] for r in table)
    print(textwrap.dedent("""\
        theory, for stages of equal speed and free communication: (p-1)/(m+p-1) for GPipe and 1F1B,
        (p-1)/(vm+p-1) for interleaved (v=2), and for ZB-H1 (p-1)(T_F+T_B-T_W)/(m(T_F+T_B+T_W)+(p-1)(T_F+T_B-T_W))
        with the measured times of one F, B (dx alone) and W (dW); for DualPipeV DeepSeek's (p-1)(F&B+B-3W)
        over 2m(T_F+T_B+T_W) plus it, with a chunk's times and F&B = T_F + T_B (not overlapped here). measured: the mean over stages of the share
        of the step (the first F's start to the last B's or W's end, on any stage) that a stage spent outside
        its F, B and W: besides the bubble, the transfers and the runner's Python between actions.
        stash: the most micro-batches whose activations a stage held at once (interleaved, DualPipeV: micro-batches
        times chunks, each half a stage's layers), stage 0 first; then the bound the schedule promises."""))
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    print(f"machine: {cores} CPU cores{load}.")
    if most > cores:
        print(f"note: {most} ranks shared {cores} CPU cores: a stage that waits for a core counts as idle,\n"
              f"and one that loses its core inside F or B counts as busy. There, the figure measures the load.",
              flush=True)


# ----------------------------------------------------------------------------------

# ----------------------------------------------------------------------------------
# Checkpoints: a checkpoint's write and read beside a training step, at one layout
# ----------------------------------------------------------------------------------

def checkpoint_bench(args):
    """three_d's flags: medians of --steps training steps, checkpoint writes and reads."""
    world_size = args.dp * args.pp * args.tp
    folder = tempfile.mkdtemp(prefix="parallel-checkpoint-")
    try:
        args.checkpoint = folder
        times, nbytes = spawn_returning(checkpoint_worker, world_size, args, backend=args.backend,
                                        timeout_s=args.timeout_s)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    step = statistics.median(times["step"])
    print(f"checkpoint beside a training step: {bench_sizes(args, world_size)[:-5]}, "
          f"{args.optimizer}, --zero {args.zero}; {world_size} files, {human_bytes(nbytes)} "
          f"(fp32 parameters{' and AdamW moments' * (args.optimizer == 'adamw')})")
    print(f"  {'':<22}{'median':>10}{'x a step':>10}{'MB/s':>8}   (the slowest rank's, of "
          f"{len(times['step'])})")
    for name, label in [("step", "a training step"), ("write", "write (fsync'd)"),
                        ("read", "read (page cache)")]:
        median = statistics.median(times[name])
        speed = f"{nbytes / median / 1e6:>8.1f}" if name != "step" else f"{'':>8}"
        print(f"  {label:<22}{median * 1e3:>8.1f}ms{median / step:>9.2f}x{speed}", flush=True)


def checkpoint_worker(rank, world_size, args):
    device = setup(rank, world_size)
    me = three_d.ThreeDRank(rank, args, device)
    micro_batches = me.micro_batches(first_batch(args), args)
    resume = SimpleNamespace(resume=args.checkpoint, marker=None, check=False, save=None)
    times = {"step": [], "write": [], "read": []}

    def timed(name, work):   # the slowest rank's time
        dist.barrier()
        start = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        took = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        times[name].append(took.item())

    def step():
        me.train_step(*micro_batches)
        me.replica.update()
    step()                                        # AdamW's state made; one step's warm-up
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        for k in range(1, args.steps + 1):
            timed("step", step)
            once = SimpleNamespace(**{**vars(args), "steps": k, "checkpoint_every": 0})
            timed("write", lambda: data_parallel.save_checkpoint(once, k, me.replica, me.held,
                                                                  me.boxes, me.copies))
            resume.marker = data_parallel.newest_checkpoint(args.checkpoint)
            timed("read", lambda: data_parallel.load_checkpoint(resume, me.replica, me.held,
                                                                 me.boxes))
    newest = data_parallel.checkpoints(args.checkpoint)[-1]
    nbytes = sum(os.path.getsize(os.path.join(newest, name)) for name in os.listdir(newest))
    cleanup()
    return times, nbytes


COMPARISONS = {"data_parallel": (data_parallel, versus_ddp), "tensor_parallel": (tensor_parallel, versus_colwise),
               "pipeline_parallel": (pipeline_parallel, versus_pipelining), "three_d": (three_d, versus_torch_3d)}


def cp_balance(context=2048, dim=256, heads=4, cp_sizes=(2, 4, 8)):
    """--cp's balance: the attention pairs each cp rank computes over the ring (tensor_parallel.py's
    schedule: query chunk i against key chunk j when j <= i), contiguous against zigzag; then each
    rank's pairs timed on this process, one rank after another (one thread, a sequence of T)."""
    torch.set_num_threads(1)
    head_dim = dim // heads
    print(f"context parallelism's balance: T={context} D={dim} h={heads}, one sequence; a rank's "
          f"pairs from the schedule, and their forward timed (median), rank by rank")
    print(f"  {'C':>2} {'layout':<11} {'pairs a rank':<28} {'max/mean':>8}   {'ms a rank':<44} "
          f"{'max/mean':>8}")
    for cp_size in cp_sizes:
        for layout in ("contiguous", "zigzag"):
            chunks = cp_size * (2 if layout == "zigzag" else 1)
            s = context // chunks
            q, k, v = (torch.randn(1, heads, 1, s, head_dim) for _ in range(3))   # MHA
            counts = []
            times = []
            for r in range(cp_size):
                pairs = cp_pairs(r, cp_size, layout)
                counts.append(len(pairs))

                def rank_work():
                    for i, j in pairs:
                        data_parallel.attend(q, k, v, head_dim, causal=i == j)
                times.append(statistics.median(race_times(rank_work)))
            print(f"  {cp_size:>2} {layout:<11} {' '.join(map(str, counts)):<28} "
                  f"{max(counts) / statistics.mean(counts):>8.2f}   "
                  f"{' '.join(f'{t * 1e3:.1f}' for t in times):<44} "
                  f"{max(times) / statistics.mean(times):>8.2f}")
    print("  contiguous: max/mean = 2C/(C+1) (rank C-1 computes C pairs, rank 0 one); zigzag: 1")


CP_RACE = dict(context=2048, dim=256, heads=4, kv_heads=2, batch=1)


def cp_race(cp_sizes=(2, 4), steps=5):
    """One layer's attention, forward and backward, over C ranks in each --cp-style (zigzag):
    the ring, all-gathered K and V (Llama 3's), Ulysses' all-to-alls, the hybrid (Ulysses in
    pairs, the ring across; C 4), and serial attention over the whole T on one rank; each rank's
    o, dq, dk, dv compared with serial's first. PyTorch's context_parallel is tried first: its
    error, where it has no CPU path."""
    print(f"context parallelism, one layer's attention forward and backward: T={CP_RACE['context']} "
          f"D={CP_RACE['dim']} h={CP_RACE['heads']} G={CP_RACE['kv_heads']}, one sequence, "
          f"float32, zigzag; ms, the median of {steps}")
    print(f"  PyTorch's context_parallel on the CPU: {torch_context_parallel_error()}")
    print(f"  {'C':>2}" + "".join(f"{name:>12}" for name in CP_STYLES) +
          f"{'serial, 1 rank':>16}{'largest difference':>20}")
    worst = 0.0
    for cp_size in cp_sizes:
        times, diff = spawn_returning(cp_race_rank, cp_size, steps, timeout_s=300)
        worst = max(worst, diff)
        print(f"  {cp_size:>2}" + "".join(f"{times[name] * 1e3:>12.1f}" if name in times else
                                          f"{'-':>12}" for name in CP_STYLES) +
              f"{times['serial'] * 1e3:>16.1f}{diff:>20.1e}", flush=True)
    print(f"  ({os.cpu_count()} cores; the ranks share them: serial's time is one process alone)")
    if worst > 1e-4:
        raise SystemExit("error: a style computed other attention than serial's")


CP_STYLES = ["ring", "all-gather", "ulysses", "hybrid u2"]


def cp_memory(cp_sizes=(1, 2, 4, 8)):
    """A rank's memory as C grows, at a long T: one rank's bf16 step recorded on the meta device
    (tests/gpu_path.py: its activations at their most, and what its replica holds) beside the
    plan's most_memory, and the stash a block keeps (the plan's)."""
    import gpu_path
    sizes = "--dp 1 --pp 1 --tp 1 --num-layers 2 --dim 1024 --heads 8 --context 16384 " \
            "--batch-size 1 --micro-batches 1 --bf16"
    print(f"context parallelism's memory, a rank's: {sizes} (the GPU's step, recorded on meta)")
    print(f"  {'C':>2} {'activations at most':>20} {'replica':>10} {'sum':>10} {'plan':>10} "
          f"{'stash a block':>14}")
    for cp_size in cp_sizes:
        argv = [*sizes.split(), "--cp", str(cp_size)]
        ran = gpu_path.run_step("three_d", argv, 0)
        args = gpu_path.gpu_node_args("three_d", argv)
        held = sum(ran.held.values())
        stash = three_d.stash_bytes(args)[0] // args.num_layers
        print(f"  {cp_size:>2} {ran.peak_bytes / 1e9:>17.2f} GB {held / 1e9:>7.2f} GB "
              f"{(ran.peak_bytes + held) / 1e9:>7.2f} GB {three_d.most_memory(args) / 1e9:>7.2f} GB "
              f"{stash / 1e6:>11.0f} MB", flush=True)


def torch_context_parallel_error():
    """What torch.distributed.tensor.experimental.context_parallel says on a CPU group of one."""
    folder = tempfile.mkdtemp(prefix="cp-race-")
    try:
        return spawn_returning(torch_cp_rank, 1, folder, timeout_s=60)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def torch_cp_rank(rank, world_size, folder):
    setup(rank, world_size)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        mesh = init_device_mesh("cpu", (world_size,))
        q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        said = "it ran"
    except Exception as error:   # what it raises is the answer
        said = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
    cleanup()
    return said


def cp_race_rank(rank, world_size, steps):
    setup(rank, world_size)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    T, D, heads, G, b = (CP_RACE[key] for key in ("context", "dim", "heads", "kv_heads", "batch"))
    head_dim = D // heads
    q, do = (torch.randn(b, T, D, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, T, G * head_dim, generator=gen) for _ in range(2))
    mine = tensor_parallel.cp_positions(T, rank, world_size, "zigzag")
    local = [t[:, mine] for t in (q, k, v, do)]
    sides = {}
    for name in CP_STYLES:
        style, _, u = name.partition(" u")
        args = SimpleNamespace(cp=world_size, cp_style=style, ulysses=int(u or 1),
                               cp_layout="zigzag")
        if style == "hybrid" and world_size <= args.ulysses:
            continue
        lists = tensor_parallel.cp_group_lists([list(range(world_size))], args)
        groups = {key: dist.new_subgroups_by_enumeration(lists[key])[0] for key in lists}
        attend, attend_back = tensor_parallel.context_attention(args, groups)

        def side(attend=attend, attend_back=attend_back):
            o, lse = attend(*local[:3], head_dim)
            return (o, *attend_back(local[3], *local[:3], o, lse, head_dim))
        sides[name] = side

    def serial():
        o, lse = data_parallel.attention(q, k, v, head_dim)
        return (o, *data_parallel.attention_backward(do, q, k, v, o, lse, head_dim))
    whole = serial()
    diff = torch.tensor(max((a - w[:, mine]).abs().max().item() for side in sides.values()
                            for a, w in zip(side(), whole)))
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)                 # every rank's, against serial's
    times = race({**sides, "serial": serial if rank == 0 else (lambda: None)},
                 torch.device("cpu"), repeats=steps)
    cleanup()
    return times, diff.item()


MOE_RACE = dict(positions=2048, dim=256, experts=8, top_k=2)


def moe_race(ep_sizes=(2, 4), steps=15):
    """One experts layer, forward and backward, over an ep group of P ranks: ours (the
    all-to-alls and every backward by hand) against an nn.Module under autograd, dispatching
    with torch's autograd-aware all-to-all (all_to_all_autograd); the same
    choice, each rank's dn, dWr, dW1, dW3, dW2 compared first."""
    print(f"experts, one layer forward and backward over --ep P ranks: N={MOE_RACE['positions']} "
          f"positions a rank, D={MOE_RACE['dim']}, E={MOE_RACE['experts']}, "
          f"K={MOE_RACE['top_k']}, float32")
    print(f"  {'P':>2} {'ours (ms)':>10} {'nn.Module + autograd':>21} {'ours / theirs':>14} "
          f"{'difference / largest':>21}")
    worst = 0.0
    for ep in ep_sizes:
        times, diff = spawn_returning(moe_race_rank, ep, steps, timeout_s=300)
        worst = max(worst, diff)
        print(f"  {ep:>2} {times['ours'] * 1e3:>10.1f} {times['theirs'] * 1e3:>21.1f} "
              f"{times['ours'] / times['theirs']:>13.2f}x {diff:>21.1e}", flush=True)
    if worst > 1e-4:
        raise SystemExit("error: the two sides computed other gradients")


def all_to_all_autograd(rows, output_splits, input_splits, group):
    """torch's all_to_all_single with a backward (the reverse all-to-all): the functional
    collectives' (torch.distributed.nn.functional's, which the docs name, is deprecated for it)."""
    from torch.distributed import _functional_collectives as functional
    out = functional.all_to_all_single_autograd(rows, output_splits, input_splits, group)
    return functional.wait_tensor(out)


class TorchExperts(torch.nn.Module):
    """The experts layer as nn.Modules: a Linear router, this rank's E/P experts as Parameters;
    the pairs dispatched and combined by autograd's all_to_all_single."""

    def __init__(self, wr, w1, w3, w2, group):
        super().__init__()
        self.router = torch.nn.Linear(*wr.shape, bias=False)
        with torch.no_grad():
            self.router.weight.copy_(wr.T)
        self.w1 = torch.nn.Parameter(w1.clone())
        self.w3 = torch.nn.Parameter(w3.clone())
        self.w2 = torch.nn.Parameter(w2.clone())
        self.group = group

    def forward(self, x, chosen):
        p = self.router(x).softmax(-1)
        local = self.w1.shape[0]
        expert = chosen.flatten()
        order = expert.argsort(stable=True)
        rows = torch.arange(len(x)).repeat_interleave(chosen.shape[1])[order]
        expert = expert[order]
        sends = torch.bincount(expert // local, minlength=dist.get_world_size(self.group))
        recvs = torch.empty_like(sends)
        dist.all_to_all_single(recvs, sends, group=self.group)
        x_in = all_to_all_autograd(x[rows], recvs.tolist(), sends.tolist(), self.group)
        e_in = torch.empty(int(recvs.sum()), dtype=torch.int64)
        dist.all_to_all_single(e_in, expert % local, recvs.tolist(), sends.tolist(),
                               group=self.group)
        y_in = torch.zeros_like(x_in)
        for e in range(local):
            mine = (e_in == e).nonzero()[:, 0]
            swiglu = F.silu(x_in[mine] @ self.w1[e]) * (x_in[mine] @ self.w3[e])
            y_in = y_in.index_add(0, mine, swiglu @ self.w2[e])
        y_e = all_to_all_autograd(y_in, sends.tolist(), recvs.tolist(), self.group)
        return torch.zeros_like(x).index_add(0, rows, p[rows, expert, None] * y_e)


def moe_race_rank(rank, world_size, steps):
    setup(rank, world_size)
    torch.set_num_threads(1)
    N, D, E, K = (MOE_RACE[key] for key in ("positions", "dim", "experts", "top_k"))
    gen = torch.Generator().manual_seed(0)
    F_ = 3 * D                                                  # each expert's width
    wr = torch.randn(D, E, generator=gen) / D ** 0.5
    w1 = torch.randn(E, D, F_, generator=gen) / D ** 0.5
    w3 = torch.randn(E, D, F_, generator=gen) / D ** 0.5
    w2 = torch.randn(E, F_, D, generator=gen) / F_ ** 0.5
    local = E // world_size
    mine = [w[rank * local:(rank + 1) * local] for w in (w1, w3, w2)]
    mine_gen = torch.Generator().manual_seed(1 + rank)
    n = torch.randn(1, N, D, generator=mine_gen)
    dy = torch.randn(1, N, D, generator=mine_gen)
    router = data_parallel.Router(E, K, group=dist.group.WORLD)
    module = TorchExperts(wr, *mine, dist.group.WORLD)

    def ours():
        y, stash = data_parallel.experts_forward(n, wr, *mine, router, count=False)
        dn, terms = data_parallel.experts_backward(dy, stash, wr, *mine)
        return [dn.flatten(0, 1), *(dz for _, dz in terms)]

    def theirs():
        x = n[0].clone().requires_grad_()
        chosen = router.choose((x.detach() @ wr).softmax(-1), count=False)
        module.zero_grad()
        module(x, chosen).backward(dy[0])
        return [x.grad, module.router.weight.grad.T, module.w1.grad, module.w3.grad, module.w2.grad]
    diff = torch.tensor(max(((a - b).abs().max() / b.abs().max()).item()   # of the largest
                            for a, b in zip(ours(), theirs())))
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    times = race({"ours": ours, "theirs": theirs}, torch.device("cpu"), repeats=steps)
    cleanup()
    return times, diff.item()


def cp_pairs(cp_rank, cp_size, layout):
    """The (query chunk, key chunk) pairs a cp rank computes over the ring's C steps: each chunk
    it holds against every chunk at or before it (a diagonal pair, masked, counted as one)."""
    held = [j for src in range(cp_size) for j in tensor_parallel.cp_chunks(src, cp_size, layout)]
    return [(i, j) for i in tensor_parallel.cp_chunks(cp_rank, cp_size, layout) for j in held
            if j <= i]


def race_times(fn, repeats=5):   # fn's seconds, repeats times after one warm-up
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def refuse(message):
    sys.stderr.write(f"tests/bench.py: error: {message}\n")
    sys.exit(2)


# ----------------------------------------------------------------------------------
# three_d.py --plan's own time, and --recompute's memory, each a fresh process
# ----------------------------------------------------------------------------------

PLAN_MODEL = ["--num-layers", "32", "--dim", "4096", "--heads", "32", "--kv-heads", "8",   # the README's:
              "--ffn-dim", "14336", "--context", "8192", "--batch-size", "512",       # Llama 3 8B's
              "--vocab-size", "128256"]


def plan_speed(argv):
    """Seconds that `three_d.py --plan` takes (start-up included) for 8 to 1,024 GPUs on the
    README's model, and for a world of 100,000, as a user runs it."""
    print("three_d.py --plan, Llama 3 8B's shape at B=512, H100: seconds to the answer")
    for world in (8, 64, 256, 1024, 100000):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "three_d.py", "--plan", "--world-size", str(world),
                               *PLAN_MODEL, "--top", "1", *argv], cwd=ROOT, capture_output=True,
                              text=True, timeout=600)
        seconds = time.perf_counter() - start
        answer = (proc.stdout.strip().splitlines() or proc.stderr.strip().splitlines())[-1]
        print(f"  {world:>6} GPUs {seconds:6.1f} s  (exit {proc.returncode}) {answer[:60]}")


RECOMPUTE_SIZES = ["--world-size", "1", "--num-layers", "16", "--dim", "256", "--heads", "4", "--context",
                   "128", "--batch-size", "64", "--micro-batches", "1", "--steps", "1", "--optimizer", "sgd"]
MEASURE = """import resource, sys, time
sys.argv = sys.argv[1:]
script = __import__(sys.argv[0].removesuffix(".py"))
start = time.perf_counter()
script.main(sys.argv[1:])
peak = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
print(f"{peak * 1024} {time.perf_counter() - start}")"""


def recompute_memory(argv):
    """Steps 2 and 3 with and without --recompute, at one rank's sizes (default: L=16 D=256
    T=128 B=64, one micro-batch, one step): each run's peak resident memory (its largest
    process, the rank) and its time, in a fresh process."""
    sizes = argv or RECOMPUTE_SIZES
    print(f"--recompute, {' '.join(sizes)}: peak resident memory and time, each run alone")
    print(f"  {'script':<20}{'plain':>10}{'--recompute':>13}{'less':>9}{'time, plain':>13}"
          f"{'--recompute':>13}")
    for script in ("data_parallel.py", "tensor_parallel.py"):
        runs = []
        for flags in ([], ["--recompute"]):
            proc = subprocess.run([sys.executable, "-c", MEASURE, script, *sizes, *flags],
                                  cwd=ROOT, capture_output=True, text=True, timeout=600)
            if proc.returncode:
                raise SystemExit(f"{script} {' '.join(flags)} failed: {proc.stderr[-400:]}")
            peak, seconds = proc.stdout.split()[-2:]
            runs.append((int(peak), float(seconds)))
        (plain, t_plain), (again, t_again) = runs
        print(f"  {script:<20}{plain / 1e9:>8.2f} GB{again / 1e9:>11.2f} GB{(plain - again) / 1e9:>7.2f} GB"
              f"{t_plain:>11.1f} s{t_again:>11.1f} s")


def parse(argv):
    """The bench named by argv's first word, its flags through its script's door and the bench's
    own rules (each refusal one line, exit 2), as a call that runs it: nothing runs here."""
    what, rest = (argv[0], argv[1:]) if argv else ("", [])
    if what in ("bubble-table", "machine", "cp-balance", "cp-race", "cp-memory", "moe-race") and rest:
        refuse(f"{what} takes no flags (the bubble table has its own sizes), got {' '.join(rest)}")
    if what == "collectives":
        args = collectives.parse_args(rest)
        return functools.partial(bench_collectives, args)
    if what in COMPARISONS:
        script, versus = COMPARISONS[what]
        args = script.parse_args(rest)
        if args.steps < 5:
            refuse(f"--steps {args.steps}: the bench reports the median of at least 5 timed steps")
        for flag in ("check", "save", "timeline", "checkpoint", "resume"):
            if getattr(args, flag, None):
                refuse(f"--{flag}: not used by the bench, which checks ours against PyTorch's API "
                       f"and times both")
        tp = getattr(args, "tp", args.world_size if what == "tensor_parallel" else 1)
        if args.kv_heads < tp:
            refuse(f"--kv-heads {args.kv_heads}: fewer than tp ({tp}), which PyTorch's TP plan "
                   f"(ColwiseParallel) cannot split: a kv head would be cut")
        return lambda: print_race(versus(args))
    if what == "memory":
        args = data_parallel.parse_args(rest)
        if args.zero or args.save or args.check or args.overlap:
            refuse("memory runs --zero 0 to 3 in turn, for one step each: it takes the sizes, "
                   "--optimizer and the launch flags")
        return functools.partial(memory_table, args)
    if what == "bubble-table":
        sizes = dict(dim=512, rows=32, steps=3)   # within two minutes here (D 1024: over five)
        return lambda: print_bubble_table(bubble_table(**sizes), **sizes)
    if what == "count-comm":
        import comm_count
        return comm_count.parse(rest)
    if what == "plan":
        import plan_check
        return functools.partial(plan_check.bench, rest)
    if what == "plan-speed":
        return functools.partial(plan_speed, rest)
    if what == "recompute-memory":
        return functools.partial(recompute_memory, rest)
    if what == "checkpoint":
        args = three_d.parse_args(rest)
        if args.check or args.save or args.checkpoint or args.resume:
            refuse("checkpoint writes and reads its own, in a temporary folder: it takes "
                   "three_d's layout, sizes and --steps (the repetitions)")
        return functools.partial(checkpoint_bench, args)
    if what == "machine":
        return lambda: print(machine())
    if what == "cp-balance":
        return cp_balance
    if what == "cp-race":
        return cp_race
    if what == "cp-memory":
        return cp_memory
    if what == "moe-race":
        return moe_race
    refuse(f"the first word names what to bench: collectives, {', '.join(COMPARISONS)}, "
           f"memory, bubble-table, count-comm, plan, plan-speed, recompute-memory, "
           f"checkpoint, cp-balance, cp-race, cp-memory, moe-race or machine; got {what!r}")


def bench_collectives(args):
    spawn(bandwidth, args.world_size, backend=args.backend, timeout_s=args.timeout_s)
    print_startup(startup_race(8, repeats=3), 8, repeats=3)


HEARTBEAT_S = 50   # no bench line is silent for a minute: the user can tell slow from hung


def heartbeat(what, every=HEARTBEAT_S):
    """A daemon thread that says, every `every` seconds, that `what` still runs (os.write: no
    Python lock that a forked rank could inherit held)."""
    start = time.monotonic()

    def beat():
        while True:
            time.sleep(every)
            os.write(2, f"  tests/bench.py {what}: still running, {time.monotonic() - start:.0f} s\n"
                     .encode())
    threading.Thread(target=beat, daemon=True).start()


def main(argv):
    run = parse(argv)                  # the door first: a refusal prints nothing else
    what = " ".join(argv[:1])
    print(f"tests/bench.py {' '.join(argv)}", flush=True)
    heartbeat(what)
    run()


if __name__ == "__main__":
    collectives.run_main(lambda: main(sys.argv[1:]))
