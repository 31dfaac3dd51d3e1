"""Step 1: the collective operations, a ring all-reduce built from send/recv alone, and
the launcher every later step imports.

    python collectives.py                      # every collective, on 4 ranks
    python collectives.py --world-size 8
    python collectives.py --bench              # time and bandwidth of each collective; start-up of 8 ranks
    python collectives.py --machine            # one line naming this machine, as under every bench
    torchrun --nproc-per-node 4 collectives.py # the same script under torchrun

Every rank prints its tensors before and after each collective, so the definitions
can be checked by eye: all-reduce, reduce-scatter, all-gather, broadcast, scatter,
gather, reduce, then send/recv between neighbours.

The gaps in the lecture that this step fills:
- The lecture says NCCL runs all-reduce as a ring, but never shows one.
  ring_all_reduce() builds it from point-to-point sends: a reduce-scatter around the
  ring, then an all-gather. It is checked against dist.all_reduce.
- Under a debugger, the lecture's debug mode swaps the collectives for no-ops, so a
  breakpoint sees values that no real run produces. Here rank 0 runs inside the
  debugged process and the other ranks run beside it, so every sum is real.
- --bench reports bus bandwidth as nccl-tests defines it, so numbers compare across
  collectives and world sizes.

The launcher near the bottom of this file (spawn / setup / cleanup) is the plumbing
every script shares. It starts one process per rank on this machine, or, under
torchrun, runs the one rank torchrun started, so every script runs unchanged on a
laptop's CPU, on a GPU box, and across nodes.

How the file is laid out, so that the lecture can be read first:
1. the collectives, shown on every rank, and the ring all-reduce (the lecture);
2. --bench for the collectives, then the helpers that every script's --bench uses to
   race our step against PyTorch's own, and the start-up race of three launchers;
3. main() and this step's printing;
4. --count-comm's counter, which the training scripts switch on;
5. the launcher, and the command-line checks every script shares.
"""
import argparse
import contextlib
import gc
import inspect
import math
import os
import pickle
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from datetime import timedelta
from fractions import Fraction

import warnings

warnings.filterwarnings("ignore", "Failed to initialize NumPy")  # torch's import warns without numpy; nothing here needs it
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.optim  # noqa: F401  imported once here, before forking, not once per rank

SUM = dist.ReduceOp.SUM


# The values below are chosen so that the tens digit names the rank a number came from:
# rank 2 starts with [20, 21, ...]. A collective's result can then be read off by eye.

def all_reduce_is_reduce_scatter_then_all_gather(rank, world_size, device):
    """The three collectives that data, tensor and fully sharded parallelism are made of."""
    n = world_size
    x = torch.arange(n, dtype=torch.float32, device=device) + 10 * rank  # x_r[i] = 10r + i  (n,)

    heading(rank, "all-reduce: every rank ends with the sum over ranks")
    summed = x.clone()
    show(rank, "before", tensor=summed)
    dist.all_reduce(summed, op=SUM)  # in place: sum_r x_r[i] = 10 n(n-1)/2 + n i
    show(rank, "after", tensor=summed)

    heading(rank, "reduce-scatter: rank r ends with element r of the sum")
    piece = torch.zeros(1, device=device)  # (n,) in, (1,) out: each rank keeps 1/n
    show(rank, "before", input=x, output=piece)
    # torch 2.13's name for the lecture's reduce_scatter_tensor (the old name warns)
    dist.reduce_scatter_single(piece, x, op=SUM)
    show(rank, "after", input=x, output=piece)

    heading(rank, "all-gather: every rank ends with every rank's piece")
    gathered = torch.zeros(n, device=device)  # (1,) in, (n,) out
    show(rank, "before", input=piece, output=gathered)
    dist.all_gather_single(gathered, piece)  # the lecture's all_gather_into_tensor
    show(rank, "after", input=piece, output=gathered)

    # Same bytes on the wire either way: this is how NCCL runs a large all-reduce, and
    # how ZeRO and FSDP split one into two halves with work in between.
    assert torch.equal(gathered, summed), "all-reduce != reduce-scatter + all-gather"
    if rank == 0:
        log(f"[rank {rank}]", "all-reduce == reduce-scatter then all-gather: yes")


def one_root_and_every_rank(rank, world_size, device, root=0):
    """Broadcast and scatter go from one root to every rank; gather and reduce come back."""
    n = world_size
    heading(rank, f"broadcast: every rank ends with rank {root}'s tensor")
    x = torch.arange(2, dtype=torch.float32, device=device) + 10 * rank  # (2,)
    show(rank, "before", tensor=x)
    dist.broadcast(x, src=root)
    show(rank, "after", tensor=x)

    heading(rank, f"scatter: rank {root} hands row r of its table to rank r")
    table = torch.arange(2 * n, dtype=torch.float32, device=device).view(n, 2)  # (n, 2)
    row = torch.zeros(2, device=device)
    show(rank, "before", table=table if rank == root else "-", row=row)
    dist.scatter(row, scatter_list=list(table) if rank == root else None, src=root)
    show(rank, "after", row=row)

    heading(rank, f"gather: rank {root} ends with every rank's tensor, in rank order")
    x = torch.arange(2, dtype=torch.float32, device=device) + 10 * rank  # (2,)
    rows = [torch.zeros(2, device=device) for _ in range(n)] if rank == root else None
    show(rank, "before", tensor=x)
    dist.gather(x, gather_list=rows, dst=root)
    show(rank, "after", table=torch.stack(rows) if rank == root else "-")

    heading(rank, f"reduce: rank {root} ends with the sum over ranks")
    show(rank, "before", tensor=x)
    dist.reduce(x, dst=root, op=SUM)
    # Only the root's result is defined: gloo uses the other ranks' tensors as scratch.
    show(rank, "after", tensor=x if rank == root else "(scratch)")


def point_to_point(rank, world_size, device):
    """send/recv name one peer; every collective above can be built from them."""
    if world_size == 1:
        heading(rank, "send/recv: needs two ranks, skipped")
        return
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    x = torch.arange(2, dtype=torch.float32, device=device) + 10 * rank  # (2,)

    heading(rank, "send/recv (blocking): every rank passes its tensor to the right")
    received = torch.zeros(2, device=device)
    show(rank, "before", sending=x, received=received)
    # A blocking send() returns only once the peer has received (gloo does this even
    # for one float; NCCL always does). If every rank sent first, every rank would wait
    # on a receive that nobody posts. So even ranks send first, odd ranks receive first.
    # With an odd world size ranks n-1 and 0 are both even: rank n-1 then waits until
    # rank 0 has sent to rank 1, and no more.
    if rank % 2 == 0:
        dist.send(x, dst=right)
        dist.recv(received, src=left)
    else:
        dist.recv(received, src=left)
        dist.send(x, dst=right)
    show(rank, "after", sending=x, received=received)

    heading(rank, "isend/irecv (non-blocking): every rank passes its tensor to the left")
    received = torch.zeros(2, device=device)
    show(rank, "before", sending=x, received=received)
    # Both are posted before we wait on either, so the order no longer matters. The
    # tensors must not be touched until wait() returns.
    works = [dist.isend(x, dst=left), dist.irecv(received, src=right)]
    for work in works:
        work.wait()
    show(rank, "after", sending=x, received=received)


# ----------------------------------------------------------------------------------
# The ring all-reduce: the lecture's "NCCL uses a ring", from send/recv alone
# ----------------------------------------------------------------------------------

def ring_all_reduce(tensor, group=None):
    """Sum `tensor` over the ranks of `group`, in place, like dist.all_reduce: built from
    point-to-point sends alone, as a reduce-scatter around a ring, then an all-gather.

    Rank r of the n ranks only ever sends to r+1 and receives from r-1. It sends n-1
    chunks of 1/n of the tensor in each phase: 2(n-1)/n of the tensor in all, which is
    the least any all-reduce can send per rank, whatever n is.
    """
    group = dist.group.WORLD if group is None else group
    r = dist.get_rank(group)  # rank within the group
    if r < 0:  # this rank is not in the group: like dist.all_reduce, do nothing
        return tensor
    if not tensor.is_contiguous():
        raise ValueError("ring_all_reduce needs a contiguous tensor, as dist.all_reduce does")
    n = dist.get_world_size(group)
    # send/recv name their peer by global rank, which differs from r on a sub-group
    right = dist.get_global_rank(group, (r + 1) % n)
    left = dist.get_global_rank(group, (r - 1) % n)

    # n chunks of the flattened tensor, views into it. A length that n does not divide
    # gives chunks that differ by one element, longest first (some are empty when the
    # tensor has fewer than n elements). Every rank cuts the same way.
    chunks = tensor.view(-1).tensor_split(n)
    incoming = torch.empty_like(chunks[0])  # room for the longest chunk

    # Reduce-scatter, n-1 steps. At step s rank r sends chunk (r-s) and receives the left
    # neighbour's partial sum of chunk (r-s-1), which it adds into its own. A chunk gains
    # one rank's part per hop, so after step s chunk (r-s-1) on rank r holds the sum
    # over ranks r-s-1 .. r, and the chunk sent at step s+1 is the one just completed
    # that far. After n-1 steps, chunk (r+1) mod n on rank r is the sum over all n ranks.
    for s in range(n - 1):
        to_send, to_add = chunks[(r - s) % n], chunks[(r - s - 1) % n]
        buf = incoming[:to_add.numel()]
        exchange(to_send, buf, right, left, group)
        to_add += buf

    # All-gather, n-1 steps. Each rank owns one finished chunk, (r+1) mod n, and sends
    # it first; after that it forwards the finished chunk it received the step before.
    # At step s rank r sends chunk (r+1-s) and receives chunk (r-s), straight into place.
    for s in range(n - 1):
        exchange(chunks[(r + 1 - s) % n], chunks[(r - s) % n], right, left, group)
    return tensor


def exchange(to_send, to_recv, right, left, group):
    """One ring step: send to the right and receive from the left, posted together.

    With NCCL (and gloo, see point_to_point) a send waits for its receive. If every
    rank sent first, all of them would wait forever. batch_isend_irecv posts both
    halves at once (one NCCL group call), so each send meets its receive.
    """
    ops = [dist.P2POp(dist.isend, to_send, right, group),
           dist.P2POp(dist.irecv, to_recv, left, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def ring_demo(rank, world_size, device):
    """The ring gives the same sums as dist.all_reduce, on a length n does not divide."""
    heading(rank, "ring all-reduce from send/recv: the same sums as dist.all_reduce")
    x = torch.arange(2 * world_size + 1, dtype=torch.float32, device=device) + 10 * rank
    expected = x.clone()
    dist.all_reduce(expected, op=SUM)
    show(rank, "before", tensor=x)
    ring_all_reduce(x)
    show(rank, "after", tensor=x)
    assert torch.equal(x, expected), "ring_all_reduce != dist.all_reduce"
    if rank == 0:
        log(f"[rank {rank}]", "ring_all_reduce == dist.all_reduce: yes")


# ----------------------------------------------------------------------------------
# --bench: time each collective, and report bandwidth the way nccl-tests does
# ----------------------------------------------------------------------------------
#
# For a tensor of S bytes that took t seconds, the algorithm bandwidth is algbw = S / t.
# It depends on n: an all-reduce over more ranks has more to move. The bus bandwidth
# busbw multiplies algbw by the fraction of S that each rank must send or receive at
# the least, so it can be compared with the link's speed, and across collectives and
# world sizes:
#   reduce-scatter: rank r's part of each of the n-1 other ranks' slices has to leave
#                   rank r, (n-1)/n * S bytes.            busbw = algbw * (n-1)/n
#   all-gather:     rank r has to receive the n-1 slices it lacks, (n-1)/n * S bytes.
#                                                          busbw = algbw * (n-1)/n
#   all-reduce:     a reduce-scatter, then an all-gather.  busbw = algbw * 2(n-1)/n
# S is the full tensor: the input of reduce-scatter and the output of all-gather.
# The lecture takes S for reduce-scatter to be the per-rank output, S/n, so its
# reduce-scatter figure is busbw / n, n times below its own all-reduce figure for the
# same link.

BENCH_SIZES = [4 * 1024 * 4**i for i in range(8)]  # 4 KiB, 16 KiB, ..., 64 MiB
WARMUP, REPEATS = 2, 5


def bench(rank, world_size):
    device = setup(rank, world_size)
    n = world_size
    results = []  # (collective, bytes, seconds, algbw, busbw)
    for size in BENCH_SIZES:
        numel = max(n, size // 4 // n * n)  # float32 elements; n divides it, for the slices
        # Zeros: the values do not change the time, and zeros never overflow however often
        # they are summed.
        full = torch.zeros(numel, device=device)        # (S,)
        piece = torch.zeros(numel // n, device=device)  # (S/n,)
        one_pass, two_passes = (n - 1) / n, 2 * (n - 1) / n  # busbw / algbw, derived above
        collectives = {
            "all-reduce": (lambda: dist.all_reduce(full, op=SUM), two_passes),
            "reduce-scatter": (lambda: dist.reduce_scatter_single(piece, full, op=SUM), one_pass),
            "all-gather": (lambda: dist.all_gather_single(full, piece), one_pass),
            "ring all-reduce": (lambda: ring_all_reduce(full), two_passes),
        }
        for name, (run, bus_factor) in collectives.items():
            seconds = time_collective(run, device)
            algbw = full.numel() * full.element_size() / seconds
            results.append((name, full.numel() * full.element_size(), seconds, algbw,
                            algbw * bus_factor))
    if rank == 0:
        print_bench(results, world_size, dist.get_backend())
    cleanup()


def time_collective(run, device):
    """Median over REPEATS runs of the slowest rank's time for one call, after WARMUP."""
    return race({"run": run}, device)["run"]


def race(sides, device, warmup=WARMUP, repeats=REPEATS):
    """Time one call of each side, the sides taking turns; return {name: seconds}.

    Made for a shared, noisy machine: `warmup` rounds first (the first calls open
    connections and allocate buffers), then `repeats` rounds with each side once per
    round, so a slow spell hits every side alike. Every call starts on all ranks at
    once (a barrier) and is done when the slowest rank is done: a side's figure is the
    median over the rounds of the slowest rank's time. A side may do nothing on some
    ranks (a serial reference that runs on rank 0 alone).
    """
    times = torch.zeros(len(sides), repeats, dtype=torch.float64)
    for i in range(warmup + repeats):
        for j, run in enumerate(sides.values()):
            dist.barrier()  # start together, so no rank's time includes waiting for another
            start = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # NCCL calls return before the GPU is done
            if i >= warmup:
                times[j, i - warmup] = time.perf_counter() - start
    times = times.to(device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return {name: statistics.median(row) for name, row in zip(sides, times.tolist())}


def print_bench(results, world_size, backend):
    print(f"{world_size} ranks, {backend}, float32; time is the median of {REPEATS} runs "
          f"after {WARMUP} warm-up; GB/s = 1e9 bytes/s")
    print(f"{'collective':<16}{'size':>10}{'time (us)':>12}"
          f"{'algbw (GB/s)':>14}{'busbw (GB/s)':>14}")
    for name in dict.fromkeys(row[0] for row in results):  # one block per collective
        for collective, size, seconds, algbw, busbw in results:
            if collective == name:
                print(f"{collective:<16}{human_bytes(size):>10}{seconds * 1e6:>12.1f}"
                      f"{algbw / 1e9:>14.3f}{busbw / 1e9:>14.3f}")
        print()
    if backend == "gloo" and world_size > (os.cpu_count() or 1):
        # More ranks than cores: ranks take turns on the cores, and every hop of a
        # collective can wait a scheduler tick. Small sizes then time the scheduler.
        print(f"note: {world_size} ranks share {os.cpu_count()} CPU cores; the small sizes "
              f"time the scheduler more than the collective")


def spawn_returning(fn, world_size, *args, **launch):
    """spawn(), and return what fn returned on rank 0: for the benches and tests that
    want numbers rather than printed lines. Under torchrun, what fn returned on this
    rank (a bench's results are all-reduced: the same on every rank)."""
    if under_torchrun():
        results = []
        spawn(lambda rank, size, *more: results.append(fn(rank, size, *more)), world_size, *args, **launch)
        return results[0]
    folder = tempfile.mkdtemp(prefix="parallel-result-")
    path = os.path.join(folder, "rank0.pickle")
    try:
        spawn(_save_rank0, world_size, fn, path, *args, **launch)
        if not os.path.exists(path):
            return None
        with open(path, "rb") as f:
            return pickle.load(f)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _save_rank0(rank, world_size, fn, path, *args):
    # pickle, not torch.save: in a forked child, torch.save after the parent's
    # torch.load hung (a lock held at fork time); results are plain numbers anyway
    result = fn(rank, world_size, *args)
    if rank == 0:
        with open(path, "wb") as f:
            pickle.dump(result, f)


# The training scripts' --bench ("What PyTorch gives you for this", at the end of each)
# races our step against PyTorch's own API for it. A side is (step, state): step()
# runs one training step, state() returns (weights, grads) in our layout, or state is
# None for a side that is timed but not compared (the serial reference).

def check_and_race(sides, device, steps):
    """Step every side once from the same weights and compare its gradients with ours
    (the first side); time `steps` more of each, taking turns (race); then compare the
    weights, which every side has now stepped equally often.
    Returns ({name: seconds}, {name: largest difference from ours, None if not compared})."""
    ours = next(iter(sides.values()))[1]
    compared = {name: state for name, (_, state) in sides.items() if state is not None and state is not ours}
    for step, _ in sides.values():
        step()
    diffs = dict.fromkeys(sides)
    diffs.update({name: largest_difference(ours()[1], state()[1]) for name, state in compared.items()})
    times = race({name: step for name, (step, _) in sides.items()}, device, WARMUP, steps)
    for name, state in compared.items():
        diffs[name] = max(diffs[name], largest_difference(ours()[0], state()[0]))
    return times, diffs


def largest_difference(ours, theirs):
    """max |a - b| over two lists of tensors, over every rank."""
    diff = torch.zeros((), device=ours[0].device)
    for a, b in zip(ours, theirs):
        diff = torch.maximum(diff, (a.detach() - b.detach()).abs().max())
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff.item()


def end_race(sides):
    """Free every side, then leave the group. In this order: a DDP freed after the group
    is destroyed joins gloo's threads while holding the GIL, and can hang for good."""
    sides.clear()
    gc.collect()
    cleanup()


def print_race(result):
    """The table: each side's step time, speed-up over serial, difference from ours;
    then ours / theirs. Exit 1 if a side computed something else. Under torchrun,
    rank 0 prints it."""
    if under_torchrun() and os.environ["RANK"] != "0":
        return
    times, diffs, world_size = result["times"], result["diffs"], result["world_size"]
    serial = next(name for name in times if name.startswith("serial"))
    cores = os.cpu_count()
    ideal = world_size if pick_backend(world_size) == "nccl" else min(world_size, cores)
    title, *more = result["title"].split("\n")
    print(title)
    for line in more:
        print(textwrap.fill(line, 110, subsequent_indent="    ", break_on_hyphens=False))
    print(f"  median of {result['steps']} steps after {WARMUP} warm-up, the sides taking turns; "
          f"speed-up: serial / side, ideal {ideal}x ({world_size} ranks, {cores} cores)\n"
          f"  difference: largest |ours - theirs| in the first step's gradients and in the weights after "
          f"{WARMUP + result['steps'] + 1} steps")
    print(f"  {'side':<50}{'step (ms)':>10}{'speed-up':>14}  difference")
    for name, seconds in times.items():
        diff, speedup = diffs[name], times[serial] / seconds
        verdict = "-" if diff is None else f"{diff:.1e} {'same' if diff <= result['tolerance'] else 'DIFFERENT'}"
        gain = "" if name == serial else f"{speedup:.2f}x {speedup / ideal:>4.0%}"
        print(f"  {name:<50}{seconds * 1e3:>10.2f}{gain:>14}  {verdict}")
    for ours, theirs in result["ratios"]:
        print(f"  {ours} / {theirs}: {times[ours] / times[theirs]:.2f}x")
    for note in result.get("notes", []):
        print(textwrap.fill(note, 110, initial_indent="  ", subsequent_indent="    ", break_on_hyphens=False))
    print(flush=True)
    if any(diff is not None and diff > result['tolerance'] for diff in diffs.values()):
        raise SystemExit("error: a side computed something other than ours; its time compares nothing")


def machine():
    """One line that names this machine, printed under every bench table."""
    cpu = platform.processor() or "unknown CPU"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpus = "none"
    if torch.cuda.is_available():
        gpus = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    return (f"machine: {cores} CPU cores ({cpu}), GPU: {gpus}, torch {torch.__version__}, "
            f"Python {platform.python_version()}{load}")


# Start-up: how long from "start 8 ranks" to the end of their first all-reduce. The
# three launchers do the same job; torchrun runs this tiny script.
STARTUP_SCRIPT = """\
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
    """Seconds from launch to the end of one all-reduce on world_size CPU ranks, for
    our launcher, torch.multiprocessing.spawn and torchrun: median of `repeats`, the
    launchers taking turns. {launcher: seconds}."""
    folder = tempfile.mkdtemp(prefix="parallel-startup-")
    script = os.path.join(folder, "one_all_reduce.py")
    with open(script, "w") as f:
        f.write(STARTUP_SCRIPT)

    def with_mp_spawn():
        store = os.path.join(folder, f"store-{time.monotonic_ns()}")
        mp.spawn(_mp_spawn_rank, args=(world_size, store), nprocs=world_size)

    def with_torchrun():
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc-per-node={world_size}", script],
                              capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"torchrun failed: {done.stderr.strip().splitlines()[-1:]}")

    launchers = {"collectives.spawn (fork)": lambda: spawn(one_all_reduce, world_size, backend="gloo"),
                 "torch.multiprocessing.spawn": with_mp_spawn,
                 "torchrun --standalone": with_torchrun}
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
    # Where the time goes: a forked rank starts with torch already imported by the
    # parent; mp.spawn and torchrun start fresh interpreters that each import torch,
    # world_size imports sharing the cores (and torchrun adds its own agent and store).
    print("why: fork starts each rank from this process, torch already imported; the other two start "
          f"{world_size} fresh interpreters that each import torch, sharing {os.cpu_count()} cores")


def main(argv=None):
    args = parse_args(argv)
    launch = dict(backend=args.backend, timeout_s=args.timeout_s)
    if args.bench:
        # Time all-reduce, reduce-scatter, all-gather and the ring from 4 KiB to 64 MiB
        spawn(bench, args.world_size, **launch)
        # Time to start 8 ranks and finish one all-reduce: ours, mp.spawn, torchrun
        print_startup(startup_race(8, repeats=3), 8, repeats=3)
        return
    if args.machine:
        print(machine())
        return
    spawn(tour, args.world_size, [
        # All-reduce, reduce-scatter, all-gather, and all-reduce = RS + AG
        all_reduce_is_reduce_scatter_then_all_gather,
        # From one root to every rank and back: broadcast, scatter, gather, reduce
        one_root_and_every_rank,
        # Between two ranks: blocking send/recv, non-blocking isend/irecv
        point_to_point,
        # All-reduce from send/recv alone, around a ring, as NCCL does it
        ring_demo,
    ], **launch)


# ----------------------------------------------------------------------------------
# Plumbing for this step: the command line, and printing before/after on every rank
# ----------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = Parser(description="Step 1: every collective on every rank, or --bench.")
    parser.add_argument("--world-size", type=positive_int, default=None,
                        help="number of ranks (default: 4, or WORLD_SIZE under torchrun)")
    parser.add_argument("--bench", action="store_true",
                        help="time all-reduce, reduce-scatter, all-gather and the ring "
                             "all-reduce from 4 KiB to 64 MiB; print a bandwidth table; then time "
                             "starting 8 ranks with our launcher, mp.spawn and torchrun")
    parser.add_argument("--machine", action="store_true",
                        help="print one line naming this machine (cores, GPU, torch) and exit")
    add_launch_args(parser)
    args = parser.parse_args(argv)
    if args.world_size is None:
        args.world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun() else 4
    check_launch_args(parser, args, args.world_size)
    return args


def tour(rank, world_size, sections):
    """The demo's worker: join the group, run each section, leave."""
    device = setup(rank, world_size)
    for section in sections:
        section(rank, world_size, device)
    cleanup()


def heading(rank, title):
    """Start a section: every rank has finished the previous one before the title prints."""
    dist.barrier()
    if rank == 0:
        print(f"\n== {title}", flush=True)
    dist.barrier()


def show(rank, when, **tensors):
    """Print this rank's tensors on one line. The ranks take turns, so lines come in
    rank order, and all have printed before anyone goes on."""
    for turn in range(dist.get_world_size()):
        if turn == rank:
            values = "  ".join(f"{name} = {fmt(value)}" for name, value in tensors.items())
            log(f"[rank {rank}]", f"{when:<6}", values)
        dist.barrier()


def fmt(value):
    if not isinstance(value, torch.Tensor):
        return str(value)
    if value.dim() > 1:  # a table: one bracket per row, on one line
        return "[" + " ".join(fmt(row) for row in value) + "]"
    return "[" + " ".join(f"{v:g}" for v in value.tolist()) + "]"


def human_bytes(size):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}"
        size /= 1024


# ----------------------------------------------------------------------------------
# --count-comm: the bytes each rank sends in one training step (the training scripts
# use it; the flag is in data_parallel.training_parser)
# ----------------------------------------------------------------------------------
#
# "Bytes sent" by one rank follows the ring algorithm, as --bench's busbw does, so a
# count is exact and can be derived by hand. Over a group of n ranks:
#   all-reduce of N bytes            2(n-1)/n x N   (a reduce-scatter, then an all-gather)
#   all-gather producing N bytes      (n-1)/n x N   (its own piece, to each of n-1 others)
#   reduce-scatter of N input bytes   (n-1)/n x N
#   send of N bytes                   N
# A group of one sends nothing. Fractions keep sums exact when n does not divide N.
RING_COST = {  # dist function -> (kind, the argument that holds N, factor)
    "all_reduce": ("all-reduce", "tensor", 2),
    "all_gather_single": ("all-gather", "output_tensor", 1),
    "all_gather_into_tensor": ("all-gather", "output_tensor", 1),
    "reduce_scatter_single": ("reduce-scatter", "input", 1),
    "reduce_scatter_tensor": ("reduce-scatter", "input", 1),
}


class CommCounter:
    """Counts the bytes this rank sends inside `with counter.step():`, per (dimension, kind).

    groups names this rank's group of each parallel dimension: {"tp": tp_group,
    "pp": pp_group, "dp": dp_group} in 3D, {"dp": None} when the world is the one
    dimension. A collective counts for the dimension of the group it is called on; a
    send for the dimension whose group holds the peer.

    step() swaps the functions the scripts call as dist.xxx for counting wrappers and
    puts the originals back at its end, so what runs outside it (the loss's
    all-reduce, --save's gathers, barriers) is never counted. dist.isend stays as it
    is, because P2POp accepts only the real one: sends are counted where
    batch_isend_irecv posts them. Disabled, step() does nothing.
    """

    def __init__(self, groups, enabled=True):
        self.groups, self.enabled = groups, enabled
        self.counts = {}   # (dimension, kind) -> [calls, bytes], of the last step()

    @contextlib.contextmanager
    def step(self):
        if not self.enabled:
            yield
            return
        self.counts = {}
        originals = {name: getattr(dist, name) for name in [*RING_COST, "send", "batch_isend_irecv"]}
        for name, fn in originals.items():
            setattr(dist, name, self._counting(name, fn))
        try:
            yield
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)

    def _counting(self, name, fn):
        def counted(*args, **kwargs):
            call = inspect.signature(fn).bind(*args, **kwargs).arguments
            if name == "batch_isend_irecv":
                for op in call["p2p_op_list"]:
                    if op.op is dist.isend:          # the receives send nothing
                        self._add(self._dimension(peer=op.peer), "send", _nbytes(op.tensor))
            elif name == "send":
                peer = call.get("dst")
                if peer is None:                     # named by its rank in the group
                    peer = dist.get_global_rank(call.get("group") or dist.group.WORLD, call["group_dst"])
                self._add(self._dimension(peer=peer), "send", _nbytes(call["tensor"]))
            else:
                kind, tensor, factor = RING_COST[name]
                n = dist.get_world_size(call.get("group"))
                self._add(self._dimension(group=call.get("group")), kind,
                          Fraction(factor * (n - 1) * _nbytes(call[tensor]), n))
            return fn(*args, **kwargs)
        return counted

    def _add(self, dimension, kind, nbytes):
        entry = self.counts.setdefault((dimension, kind), [0, 0])
        entry[0] += 1
        entry[1] += nbytes

    def _dimension(self, group=None, peer=None):
        """The name of the group a collective runs on, or of the group holding a peer."""
        world = dist.group.WORLD
        for name, mine in self.groups.items():
            mine = world if mine is None else mine
            if peer is None and mine is (world if group is None else group):
                return name
            if peer is not None and peer in dist.get_process_group_ranks(mine):
                return name
        return "other"   # a group nobody named: shows up in the report as unexpected


def _nbytes(tensor):
    return tensor.numel() * tensor.element_size()


def report_comm(counter, formula, notes=""):
    """On rank 0, every rank's counts from the last step() beside the analytic formula.

    formula: {(dimension, kind): (bytes, "how they add up")} for this rank. Every rank
    must call this (it gathers). Ranks whose lines are identical share one block.
    """
    lines, names = [], [*counter.groups, "other"]
    for key in sorted(set(counter.counts) | set(formula), key=lambda k: (names.index(k[0]), k[1])):
        calls, counted = counter.counts.get(key, (0, 0))
        expected, how = formula.get(key, (0, "not in the formula"))
        lines.append((*key, calls, counted, expected, how))
    everyone = _gather_text(repr(lines))
    if dist.get_rank() != 0:
        return
    everyone = [eval(text, {"Fraction": Fraction}) for text in everyone]   # our own repr() of plain values
    blocks = {}   # lines -> the ranks that have exactly those
    for rank, theirs in enumerate(everyone):
        blocks.setdefault(tuple(theirs), []).append(rank)
    print("--count-comm: bytes each rank sent in the last training step, counted and by formula\n"
          "  (ring convention over n ranks: all-reduce of N bytes 2(n-1)/n x N, all-gather and reduce-scatter\n"
          "  (n-1)/n x N, send N; the loss's all-reduce, --save and barriers are outside the count)", flush=True)
    for theirs, ranks in blocks.items():
        print(f"  ranks {','.join(map(str, ranks))}:", flush=True)
        for dimension, kind, calls, counted, expected, how in theirs:
            verdict = "ok" if counted == expected else "DIFFERENT"
            print(f"    {dimension} {kind:<15}{calls:>4} calls  counted {_exact(counted):>10}  "
                  f"formula {_exact(expected):>10} = {how}  {verdict}", flush=True)
    if notes:
        print(textwrap.fill(notes, 100, break_on_hyphens=False), flush=True)


def _gather_text(text):
    """Every rank's string, in rank order, on rank 0 (None elsewhere), as bytes in tensors:
    torch's object collectives need numpy, which nothing else here does."""
    data = torch.tensor(list(text.encode()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([len(data)]))
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:len(data)] = data
    parts = [torch.zeros(longest, dtype=torch.uint8) for _ in sizes] if dist.get_rank() == 0 else None
    dist.gather(padded, parts, dst=0)
    if parts is None:
        return None
    return [bytes(part[:int(size)].tolist()).decode() for part, size in zip(parts, sizes)]


def _exact(nbytes):
    """An integer as it is; a fraction of a byte (n does not divide N) to 2 decimals."""
    return str(nbytes) if Fraction(nbytes).denominator == 1 else f"{float(nbytes):.2f}"


# ----------------------------------------------------------------------------------
# The launcher: spawn(fn, world_size, *args) runs fn(rank, world_size, *args) on
# every rank; the worker calls setup(rank, world_size) first and cleanup() last.
# ----------------------------------------------------------------------------------

DEFAULT_TIMEOUT_S = 60.0  # the process-group timeout; PyTorch's own default (30 min) is a hang to a person


class RankFailed(RuntimeError):
    """A rank raised or died; carries the rank that failed first and its traceback."""

    def __init__(self, rank, text):
        super().__init__(f"rank {rank} failed first: {text.strip().splitlines()[-1]}")
        self.rank, self.text = rank, text


def under_torchrun():
    """torchrun (and Slurm/Ray wrappers around it) start each rank with RANK and WORLD_SIZE set."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def gpus_for_every_rank(local_world_size):
    """NCCL needs one GPU per rank on this node; otherwise we use gloo on the CPU."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size


def pick_backend(local_world_size, requested="auto"):
    if requested == "auto":
        return "nccl" if gpus_for_every_rank(local_world_size) else "gloo"
    return requested


def spawn(fn, world_size, *args, backend="auto", timeout_s=DEFAULT_TIMEOUT_S):
    """Run fn(rank, world_size, *args) on world_size ranks; raise RankFailed if any fails.

    Under torchrun this process already is one rank: call fn once and return.
    Otherwise start the ranks here, each with the environment torchrun would give
    it (RANK, WORLD_SIZE, LOCAL_RANK), so setup() reads one set of variables.

    The ranks meet through a file store in a fresh temporary directory instead of a
    TCP port: no port to choose or collide on, so two runs at once, or a run beside
    another program on port 29500, just work. (A TCP store on a free port works too,
    but here eight simultaneous connects to it stalled setup for 5 s in one run of
    five.) gloo and NCCL then open their own connections on ports the kernel picks.
    """
    if under_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world_size:
            raise SystemExit(f"error: torchrun started {os.environ['WORLD_SIZE']} ranks "
                             f"but this run needs {world_size}")
        # setup() reads the backend and timeout from the environment, as under spawn below
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        saved = dict(os.environ)
        os.environ.update(PARALLEL_BACKEND=pick_backend(local_world_size, backend),
                          PARALLEL_TIMEOUT_S=str(timeout_s))
        try:
            fn(int(os.environ["RANK"]), world_size, *args)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        return

    backend = pick_backend(world_size, backend)
    meeting_dir = tempfile.mkdtemp(prefix="parallel-")
    env = {"WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
           "PARALLEL_STORE": os.path.join(meeting_dir, "store"),
           "PARALLEL_BACKEND": backend, "PARALLEL_TIMEOUT_S": str(timeout_s)}
    # Fork costs well under a second for 8 ranks; spawn re-imports torch in every
    # rank (seconds), but CUDA cannot survive a fork, so GPUs need it.
    ctx = mp.get_context("spawn" if backend == "nccl" else "fork")
    # Under a debugger, rank 0 runs in this process so a breakpoint sees real values;
    # the other ranks still run, so every collective computes what it should.
    in_process = 0 if sys.gettrace() is not None else None
    procs, pipes, failures = {}, {}, {}
    try:
        for rank in range(world_size):
            if rank != in_process:
                pipes[rank], child_end = ctx.Pipe(duplex=False)
                procs[rank] = ctx.Process(target=_child, args=(fn, rank, world_size, args, env, child_end),
                                          daemon=True)
                procs[rank].start()
                child_end.close()
        if in_process is not None:
            saved = dict(os.environ)
            try:
                _run_rank(fn, 0, world_size, args, env)
            except BaseException as e:  # noqa: BLE001  reported like any other rank's failure
                failures[0] = (time.time(), _is_victim(e), traceback.format_exc())
            finally:
                os.environ.clear()
                os.environ.update(saved)
        _watch(procs, pipes, failures)
    finally:
        _end_all(procs)
        shutil.rmtree(meeting_dir, ignore_errors=True)
    if failures:
        rank = _culprit(failures)
        raise RankFailed(rank, failures[rank][2])


def setup(rank, world_size, backend=None, timeout_s=None):
    """Join the process group; return this rank's device (cuda:LOCAL_RANK or cpu).

    Reads what torchrun (or spawn above) put in the environment. LOCAL_RANK picks
    the GPU on this node; RANK is the global rank, and the two differ on node 2.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    backend = backend or pick_backend(local_world_size, os.environ.get("PARALLEL_BACKEND", "auto"))
    timeout_s = timeout_s or float(os.environ.get("PARALLEL_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    if backend == "nccl":
        device = torch.device(f"cuda:{local_rank}")
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # eight ranks share a few cores: one thread each
    timeout = timedelta(seconds=timeout_s)
    if dist.is_initialized():  # Ray Train's TorchTrainer joins the group before our function runs
        return device
    if "PARALLEL_STORE" in os.environ:  # started by spawn() above
        store = dist.FileStore(os.environ["PARALLEL_STORE"], world_size)
        dist.init_process_group(backend, rank=rank, world_size=world_size, store=store, timeout=timeout)
    else:  # torchrun: MASTER_ADDR and MASTER_PORT name the rendezvous
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    return device


def cleanup():
    dist.destroy_process_group()


def log(tag, *values):
    """Print one line with a rank tag in front, e.g. '[rank 2]' or '[dp0 pp1 tp0]'.

    One write per line: print() writes each piece on its own when Python runs
    unbuffered (PYTHONUNBUFFERED), and other ranks' pieces then land in between.
    """
    sys.stdout.write(" ".join(str(v) for v in (tag, *values)) + "\n")
    sys.stdout.flush()


# ---- the plumbing behind spawn --------------------------------------------------

def _run_rank(fn, rank, world_size, args, env):
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    fn(rank, world_size, *args)


def _child(fn, rank, world_size, args, env, pipe):
    """Body of a child rank: run, and report an exception with its time and traceback."""
    sys.settrace(None)  # a debugger's tracer belongs to the parent
    code = 0
    try:
        _run_rank(fn, rank, world_size, args, env)
    except SystemExit as e:  # sys.exit() and sys.exit(0) are success, sys.exit("why") is not
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        if code:
            why = f"exited with code {code}" if isinstance(e.code, int) else str(e.code)
            pipe.send((time.time(), False, why + "\n"))
    except BaseException as e:  # noqa: BLE001
        pipe.send((time.time(), _is_victim(e), traceback.format_exc()))
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a forked child would otherwise run the parent's
    # exit handlers and destructors too.
    os._exit(code)


def _is_victim(exc):
    """A rank whose peer died sees a closed connection or a timeout: not the culprit."""
    text = f"{type(exc).__name__} {exc}".lower()
    return isinstance(exc, dist.DistError) or any(
        word in text for word in ("connection", "timed out", "timeout", "broken pipe", "reset by peer"))


def _watch(procs, pipes, failures):
    """Wait for every child; at the first failure, give the others a moment to report, then stop."""
    from multiprocessing.connection import wait
    first_failure = time.time() if failures else None
    waiting = {p.sentinel: rank for rank, p in procs.items()}
    waiting.update({pipe: rank for rank, pipe in pipes.items()})
    while waiting:
        grace = None if first_failure is None else max(0.0, first_failure + 0.5 - time.time())
        if grace == 0.0:
            return
        for ready in wait(list(waiting), timeout=grace):
            rank = waiting.pop(ready)
            if ready in pipes.values():
                try:
                    failures[rank] = ready.recv()
                except EOFError:
                    pass  # it finished without reporting anything
            else:   # the process ended; a report from its pipe, if any, wins over this
                procs[rank].join()
                if procs[rank].exitcode != 0 and rank not in failures:
                    failures[rank] = (time.time(), False, _death_message(procs[rank].exitcode))
            if failures and first_failure is None:
                first_failure = time.time()


def _death_message(exitcode):
    if exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}\n"
    return f"exited with code {exitcode}\n"


def _culprit(failures):
    """The earliest failure that is not a victim's closed connection; else the earliest."""
    order = sorted(failures, key=lambda r: (failures[r][1], failures[r][0]))
    return order[0]


def _end_all(procs):
    for p in procs.values():
        if p.is_alive():
            p.terminate()
    deadline = time.time() + 2
    for p in procs.values():
        p.join(max(0.0, deadline - time.time()))
        if p.is_alive():
            p.kill()
            p.join()


# ----------------------------------------------------------------------------------
# Command-line plumbing shared by every script: bad input gets one line naming the
# flag, exit code 2, before any rank starts.
# ----------------------------------------------------------------------------------

class Parser(argparse.ArgumentParser):
    """argparse, but an error is one line on stderr (no usage block) and exit 2."""

    def error(self, message):
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def add_launch_args(parser):
    """Flags every script shares for starting its ranks."""
    parser.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                        help="auto: NCCL when every rank has its own GPU, else gloo on the CPU")
    parser.add_argument("--timeout-s", type=positive_float, default=DEFAULT_TIMEOUT_S,
                        help="process-group timeout: how long a rank waits for a peer before failing")


def check_launch_args(parser, args, world_size, flag="--world-size"):
    """The world size must fit what torchrun started, and NCCL needs a GPU per rank."""
    if under_torchrun() and int(os.environ["WORLD_SIZE"]) != world_size:
        parser.error(f"{flag}: this run needs {world_size} ranks but torchrun started "
                     f"WORLD_SIZE={os.environ['WORLD_SIZE']}")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if args.backend == "nccl" and not gpus_for_every_rank(local):
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        parser.error(f"{flag}: --backend nccl needs one GPU per rank: {local} ranks on this "
                     f"node, {gpus} GPUs")


def run_main(main):
    """Entry point: a failed rank becomes one clear message and exit 1, not a traceback
    from the launcher. Under torchrun, record() writes the failing rank's traceback into
    torchrun's failure summary."""
    if under_torchrun():
        from torch.distributed.elastic.multiprocessing.errors import record
        record(main)()
        return
    try:
        main()
    except RankFailed as e:
        sys.stderr.write(f"{e.text.rstrip()}\nerror: {e}\n")
        sys.exit(1)


if __name__ == "__main__":
    run_main(main)
