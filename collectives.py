"""Step 1: the collective operations, an all-reduce built from send/recv alone, and the
launcher that every later step imports.

    python collectives.py                        # every collective, on 4 ranks
    torchrun --nproc-per-node 4 collectives.py   # the same script under torchrun

Every rank prints its tensors before and after each collective, so each definition can
be checked by eye; rank r's numbers start at 10 r, so the tens digit names their rank.

    all-reduce      every rank ends with the sum over ranks        [n] -> [n]
    reduce-scatter  rank r ends with piece r of the sum            [n] -> [n/ranks]
    all-gather      every rank ends with every rank's piece        [n/ranks] -> [n]
    broadcast, scatter, gather, reduce: one root and every rank; send/recv: two ranks
    all-to-all      rank r's piece s goes to rank s: uneven pieces, their counts sent first

The gaps in the lecture that this step fills:
- The lecture says NCCL runs an all-reduce as a ring, but never shows one.
  ring_all_reduce() builds it from point-to-point sends: a reduce-scatter around the
  ring, then an all-gather. Each rank sends 2(n-1)/n of the tensor, the least possible.
- The lecture's debug mode replaces the collectives with no-ops, so a breakpoint sees
  values that no real run produces. Here, under a debugger, rank 0 runs inside the
  debugged process and the other ranks run beside it: every sum is real.

collective_cost() says what each costs, in bytes and seconds. Below the fold, the launcher:
spawn(fn, world_size, *args) runs fn(rank, world_size, *args) on every rank, naming the first
to fail; setup(rank, world_size) joins the group, returning the device; cleanup() leaves it.

What PyTorch gives you: torch.distributed's collectives; torch.multiprocessing.spawn and
torchrun. tests/bench.py times each collective, bus bandwidth as nccl-tests defines it.
"""
import warnings
from fractions import Fraction
warnings.filterwarnings("ignore", "Failed to initialize NumPy")   # torch warns without numpy
import torch
import torch.distributed as dist


def main(argv=None):
    args = parse_args(argv)
    spawn(tour, args.world_size, [
        all_reduce_is_reduce_scatter_then_all_gather,   # all-reduce = reduce-scatter + all-gather
        one_root_and_every_rank,                        # broadcast, scatter, gather, reduce
        point_to_point,                                 # send/recv, isend/irecv
        ring_demo,                                      # all-reduce from send/recv, around a ring
        all_to_all_demo,                                # each rank's piece to each: uneven
    ], backend=args.backend, timeout_s=args.timeout_s)


def tour(rank, world_size, sections):   # this step's worker: join, run each section, leave
    device = setup(rank, world_size)
    for section in sections:
        section(rank, world_size, device)
    dist.destroy_process_group()   # leave the group: cleanup(), in the later steps


def all_reduce_is_reduce_scatter_then_all_gather(rank, world_size, device):
    """The three collectives that data, tensor and fully sharded parallelism are made of."""
    n = world_size
    x = torch.arange(n, dtype=torch.float32, device=device) + 10 * rank   # x_r[i] = 10 r + i   [n]

    heading(rank, "all-reduce: every rank ends with the sum over ranks")
    summed = x.clone()
    show(rank, "before", tensor=summed)
    dist.all_reduce(summed)               # in place: sum_r x_r[i] = 10 n(n-1)/2 + n i
    show(rank, "after", tensor=summed)

    heading(rank, "reduce-scatter: rank r ends with element r of the sum")
    piece = torch.zeros(1, device=device)                                 # [1]: each rank keeps 1/n
    show(rank, "before", input=x, output=piece)
    dist.reduce_scatter_single(piece, x)  # older torch: reduce_scatter_tensor
    show(rank, "after", input=x, output=piece)

    heading(rank, "all-gather: every rank ends with every rank's piece")
    gathered = torch.zeros(n, device=device)                              # [n]
    show(rank, "before", input=piece, output=gathered)
    dist.all_gather_single(gathered, piece)   # older torch: all_gather_into_tensor
    show(rank, "after", input=piece, output=gathered)

    # The same bytes cross the wire either way. This is how NCCL runs a large
    # all-reduce, and how ZeRO and FSDP split one in two with work in between.
    assert torch.equal(gathered, summed), "all-reduce != reduce-scatter + all-gather"
    if rank == 0:
        print(f"[rank {rank}] all-reduce == reduce-scatter then all-gather: yes", flush=True)


def one_root_and_every_rank(rank, world_size, device, root=0):
    """Broadcast and scatter go from one root to every rank; gather and reduce come back."""
    n = world_size
    heading(rank, f"broadcast: every rank ends with rank {root}'s tensor")
    x = torch.arange(2, dtype=torch.float32, device=device) + 10 * rank  # [2]
    show(rank, "before", tensor=x)
    dist.broadcast(x, src=root)
    show(rank, "after", tensor=x)

    heading(rank, f"scatter: rank {root} hands row r of its table to rank r")
    table = torch.arange(2 * n, dtype=torch.float32, device=device).view(n, 2)   # [n, 2]
    row = torch.zeros(2, device=device)
    show(rank, "before", table=table if rank == root else "-", row=row)
    dist.scatter(row, scatter_list=list(table) if rank == root else None, src=root)
    show(rank, "after", row=row)

    heading(rank, f"gather: rank {root} ends with every rank's tensor, in rank order")
    x = torch.arange(2, dtype=torch.float32, device=device) + 10 * rank
    rows = [torch.zeros(2, device=device) for _ in range(n)] if rank == root else None
    show(rank, "before", tensor=x)
    dist.gather(x, gather_list=rows, dst=root)
    show(rank, "after", table=torch.stack(rows) if rank == root else "-")

    heading(rank, f"reduce: rank {root} ends with the sum over ranks")
    show(rank, "before", tensor=x)
    dist.reduce(x, dst=root)
    # Only the root's result is defined: gloo uses the other ranks' tensors as scratch.
    show(rank, "after", tensor=x if rank == root else "(scratch)")


def point_to_point(rank, world_size, device):
    """send/recv name one peer; every collective above can be built from them."""
    if world_size == 1:
        heading(rank, "send/recv: needs two ranks, skipped")
        return
    right = (rank + 1) % world_size
    left = (rank - 1) % world_size
    x = torch.arange(2, dtype=torch.float32, device=device) + 10 * rank  # [2]

    heading(rank, "send/recv (blocking): every rank passes its tensor to the right")
    received = torch.zeros(2, device=device)
    show(rank, "before", sending=x, received=received)
    # On gloo a blocking send() returns once the peer has received, even one float; on NCCL
    # once queued, but the GPU runs nothing queued after it until the peer's receive is there.
    # If every rank sent first, each would wait on a receive nobody posts: so even ranks send
    # first, odd ranks receive first (n odd: rank n-1 waits for rank 0's send to 1, no more).
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
    # Both posted before either is waited, so their order no longer matters. Hands off until wait().
    works = [dist.isend(x, dst=left), dist.irecv(received, src=right)]
    for work in works:
        work.wait()
    show(rank, "after", sending=x, received=received)


def ring_all_reduce(tensor, group=None):
    """The lecture's "NCCL uses a ring": sum `tensor` over the ranks of `group` in place, as
    dist.all_reduce does, from send/recv alone: a reduce-scatter around a ring, then an all-gather.
    Rank r of the n ranks only ever sends to r+1 and receives from r-1: n-1 chunks of 1/n
    of the tensor in each phase, 2(n-1)/n in all, the least any all-reduce can send."""
    group = dist.group.WORLD if group is None else group
    r = dist.get_rank(group)   # rank within the group
    if r < 0:                  # this rank is not in the group: like dist.all_reduce, do nothing
        return tensor
    if not tensor.is_contiguous():
        raise ValueError("ring_all_reduce needs a contiguous tensor, as dist.all_reduce does")
    n = dist.get_world_size(group)
    # send/recv name their peer by global rank, which differs from r on a sub-group
    right = dist.get_global_rank(group, (r + 1) % n)
    left = dist.get_global_rank(group, (r - 1) % n)

    # n chunks of the flattened tensor, views into it, cut alike on every rank. When n does not
    # divide its length they differ by one element, longest first (empty ones if it is < n).
    chunks = tensor.view(-1).tensor_split(n)
    incoming = torch.empty_like(chunks[0])   # room for the longest chunk

    # Reduce-scatter, n-1 steps. At step s rank r sends chunk (r-s) and receives the left
    # neighbour's partial sum of chunk (r-s-1), which it adds into its own. A chunk gains
    # one rank's part per hop, so after step s chunk (r-s-1) on rank r holds the sum over
    # ranks r-s-1 .. r, and the chunk sent at step s+1 is the one just completed that far.
    # After n-1 steps, chunk (r+1) mod n on rank r is the sum over all n ranks.
    for s in range(n - 1):
        to_send = chunks[(r - s) % n]
        to_add = chunks[(r - s - 1) % n]
        buf = incoming[:to_add.numel()]
        exchange(to_send, buf, right, left, group)
        to_add += buf

    # All-gather, n-1 steps. Each rank owns one finished chunk, (r+1) mod n, and sends it
    # first; after that it forwards the finished chunk it received the step before. At
    # step s rank r sends chunk (r+1-s) and receives chunk (r-s), straight into place.
    for s in range(n - 1):
        exchange(chunks[(r + 1 - s) % n], chunks[(r - s) % n], right, left, group)
    return tensor


def exchange(to_send, to_recv, right, left, group, wait=True):
    """One ring step, posted together: a send waits for its receive (see point_to_point), and
    batch_isend_irecv posts both at once (one NCCL group call), so each meets its match. NCCL
    returns one Work for the whole batch, gloo one an operation: wait for every one (wait=False:
    they are returned, for the caller to compute under them and wait after)."""
    ops = [dist.P2POp(dist.isend, to_send, right, group),
           dist.P2POp(dist.irecv, to_recv, left, group)]
    works = dist.batch_isend_irecv(ops)
    if not wait:
        return works
    for work in works:
        work.wait()


def all_to_all(rows, send_counts=None, recv_counts=None, group=None):
    """Each rank's rows [M, ..] dealt out in order, send_counts[s] of them to rank s, and its own
    taken in, recv_counts[s] from rank s, in rank order: [sum recv_counts, ..]. The counts may
    differ on every rank (expert parallelism sends each position to its expert's rank), so a
    rank learns its recv_counts first, by an all-to-all of the counts: no counts, an even split,
    M/n rows to each rank and from each."""
    if send_counts is None:
        out = torch.empty_like(rows)
        dist.all_to_all_single(out, rows.contiguous(), group=group)
        return out
    out = rows.new_empty((int(recv_counts.sum()), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv_counts.tolist(),
                           input_split_sizes=send_counts.tolist(), group=group)
    return out


def all_to_all_demo(rank, world_size, device):
    """Every rank sends every rank its own piece: a transpose of who holds what."""
    heading(rank, "all-to-all: rank r sends r + 1 rows to each rank, the counts sent first")
    send_counts = torch.full((world_size,), rank + 1, device=device)        # [n]: to each rank
    recv_counts = all_to_all(send_counts)                                   # [n]: s + 1 from s
    rows = (torch.arange(world_size, device=device) + 10 * rank).repeat_interleave(rank + 1)
    show(rank, "before", rows=rows.float(), send_counts=send_counts)        # 10 r + s: for s
    got = all_to_all(rows.float(), send_counts, recv_counts)
    show(rank, "after", rows=got, recv_counts=recv_counts)   # the tens: the sender, units: mine
    sent_here = (10 * torch.arange(world_size, device=device) + rank).repeat_interleave(recv_counts)
    assert torch.equal(got, sent_here.float()), "a row reached the wrong rank"


def collective_cost(kind, nbytes, n, alpha=0.0, beta=1.0):
    """What a collective of a tensor of nbytes over n ranks costs a rank on the ring above:
    (bytes it sends, seconds). nbytes: the all-gather's output, the reduce-scatter's input.
    Each of n-1 steps sends 1/n of it: (n-1)/n x S bytes in (n-1) alpha + (n-1)/n x S / beta
    seconds, alpha a message's latency, beta the link's bytes a second; an all-reduce is a
    reduce-scatter then an all-gather, twice both; a send, S bytes in alpha + S / beta."""
    if kind == "send":
        return Fraction(nbytes), alpha + nbytes / beta
    rounds = 2 if kind == "all-reduce" else 1
    sent = Fraction(rounds * (n - 1) * nbytes, n)
    return sent, rounds * (n - 1) * alpha + float(sent) / beta


def ring_demo(rank, world_size, device):
    """The ring gives the same sums as dist.all_reduce, on a length n does not divide."""
    heading(rank, "ring all-reduce from send/recv: the same sums as dist.all_reduce")
    x = torch.arange(2 * world_size + 1, dtype=torch.float32, device=device) + 10 * rank
    expected = x.clone()
    dist.all_reduce(expected)
    show(rank, "before", tensor=x)
    ring_all_reduce(x)
    show(rank, "after", tensor=x)
    assert torch.equal(x, expected), "ring_all_reduce != dist.all_reduce"
    if rank == 0:
        print(f"[rank {rank}] ring_all_reduce == dist.all_reduce: yes", flush=True)


# Below the fold: the launcher (spawn, setup, cleanup and the process management behind
# them), the command line that every script shares, and this step's printing. ---
import argparse, contextlib, ctypes, errno, logging, math, os, pickle, re  # noqa: E401, E402
import shutil, signal, socket, sys, tempfile, threading, time  # noqa: E401, E402
from datetime import timedelta  # noqa: E402
from unittest import mock  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

# Before 2.13 (a GPU image's torch) the two collectives had older names. Before 2.8 a SIGTERM from
# no rank of ours ends some runs as the ranks finish (2 or 3 in 5 on 2.6 and 2.7.1): refused.
OLDEST_TORCH = "2.8"
if not hasattr(dist, "all_gather_single"):
    dist.all_gather_single = dist.all_gather_into_tensor
    dist.reduce_scatter_single = dist.reduce_scatter_tensor

DEFAULT_TIMEOUT_S = 60.0   # how long a rank waits for a peer (PyTorch's 30 min look like a hang)
RANK_BYTES = 50e6          # one forked CPU rank at the defaults, measured: its share of the pages
logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)   # we say who failed


class RankFailed(RuntimeError):
    """The rank that raised, died or stalled first, with its traceback (stopped: a Stop's)."""

    def __init__(self, rank, text):
        last = text.strip().splitlines()[-1]
        super().__init__(f"rank {rank} failed first: {last}")
        self.rank, self.text = rank, text
        self.stopped = (re.match(r"(?:[\w.]+\.)?Stop: (.*)", last) or [None, None])[1]


class Stop(Exception):
    """A rank ends the run on purpose, with a message for the person (a failed --check)."""


def spawn(fn, world_size, *args, backend="auto", timeout_s=DEFAULT_TIMEOUT_S):
    """fn(rank, world_size, *args) on every rank; RankFailed if one fails. Under torchrun, fn runs
    here as this rank; else ranks start by fork on the CPU (8 in under a second), by spawn with
    CUDA (a forked child cannot use it), and meet at a file store in a fresh folder: no port."""
    env = {"PARALLEL_BACKEND": pick_backend(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
                                            backend),
           "PARALLEL_TIMEOUT_S": str(timeout_s)}
    if under_torchrun():       # (the door refused a WORLD_SIZE that is not world_size)
        with mock.patch.dict(os.environ, env):
            return fn(int(os.environ["RANK"]), world_size, *args)
    folder = tempfile.mkdtemp(prefix=f"parallel-{os.getpid()}-")
    env.update(WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
               PARALLEL_STORE=os.path.join(folder, "store"))
    in_parent = int(sys.gettrace() is not None)   # 1 under a debugger: rank 0 runs in this process
    method = "spawn" if env["PARALLEL_BACKEND"] == "nccl" or torch.cuda.is_initialized() else "fork"

    def interrupt(signum, frame):   # `kill PID`, or a closing terminal: as Ctrl-C does
        raise KeyboardInterrupt(signal.Signals(signum).name)
    saved = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)
             if threading.current_thread() is threading.main_thread()}
    context = None   # the child ranks, started by torch.multiprocessing
    try:
        with mock.patch.dict(os.environ, env):
            context = mp.start_processes(_child, (in_parent, os.getpid(), fn, world_size, args),
                                         nprocs=world_size - in_parent, join=False,
                                         start_method=method)
        if in_parent:   # rank 0 in the debugger: its exception, if any, stops the debugger here
            with mock.patch.dict(os.environ, {**env, "RANK": "0", "LOCAL_RANK": "0"}):
                fn(0, world_size, *args)
        try:       # after the first failure, the others have half a second to end on their own
            while not context.join(grace_period=0.5):
                pass
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            raise RankFailed(*_culprit(context, e.error_index, in_parent)) from None
    finally:       # what still runs ends here: a stopped rank needs SIGKILL
        processes = context.processes if context else []
        for process in processes:    # all at once: a rank that outlives a peer fails, and says so
            process.kill()
        for process in processes:
            process.join()
        for error_file in context.error_files if context else []:   # a failed rank's traceback,
            with contextlib.suppress(FileNotFoundError):               # read by then
                os.remove(error_file)
        shutil.rmtree(folder, ignore_errors=True)
        for s, handler in saved.items():
            signal.signal(s, handler)


def setup(rank, world_size):
    """Join the process group; return this rank's device: cuda:LOCAL_RANK, or the CPU.
    LOCAL_RANK picks the GPU on this node; RANK, the global rank, differs on a second node."""
    backend = os.environ.get("PARALLEL_BACKEND") or pick_backend(world_size)
    torch.set_num_threads(1)        # the ranks share this machine's cores: one thread each
    joined = dist.is_initialized()  # (a caller may have joined the group already)
    store = None if joined else meet(rank, world_size)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    if not joined:                  # device_id: NCCL's communicators start now, on this GPU
        dist.init_process_group(backend, rank=rank, world_size=world_size, store=store,
                                timeout=timedelta(seconds=timeout_s()),
                                device_id=device if backend == "nccl" else None)
    return device


def timeout_s():
    return float(os.environ.get("PARALLEL_TIMEOUT_S", DEFAULT_TIMEOUT_S))


def meet(rank, world_size):
    """The store the ranks meet at: spawn()'s file store, or torchrun's at MASTER_ADDR:MASTER_PORT
    (waited for up to --timeout-s)."""
    store = os.environ.get("PARALLEL_STORE")   # None under torchrun: MASTER_ADDR:MASTER_PORT
    if store:
        return dist.FileStore(store, world_size)
    timeout = timeout_s()
    where, deadline = (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")), \
        time.time() + timeout
    try:   # a rank that joins torchrun's store, or rank 0's, first waits for it to listen
        while rank or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            with contextlib.suppress(OSError):   # (torch's own wait prints C++ stack traces)
                socket.create_connection((where[0], int(where[1])), timeout=1).close()
                break
            if time.time() > deadline:
                raise TimeoutError(f"nothing listens there after {timeout:g} s")
            time.sleep(0.2)
        store = next(dist.rendezvous("env://", rank, world_size,
                                     timeout=timedelta(seconds=timeout)))[0]
    except (RuntimeError, ValueError, OSError) as e:   # DistStoreError, DistNetworkError, ...
        raise Stop(f"RANK {rank} of WORLD_SIZE {world_size} met no peers at MASTER_ADDR:MASTER_PORT"
                   f" = {':'.join(map(str, where))} ({str(e).splitlines()[0][:100]}); if these are "
                   f"left over from another run, unset RANK, WORLD_SIZE and LOCAL_RANK") from None
    return dist.PrefixStore("default_pg", store)   # as init_process_group keeps its own keys


def cleanup():
    dist.destroy_process_group()


def under_torchrun():   # torchrun (and Slurm around it) start each rank with these
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def pick_backend(local_world_size, requested="auto"):
    """NCCL if this node has a GPU a rank, else gloo. device_count() asks NVML and starts no CUDA
    here, which ranks forked later could not use."""
    if requested != "auto":
        return requested
    if torch.cuda.device_count() >= local_world_size:
        return "nccl"
    return "gloo"


def _child(index, in_parent, parent, fn, world_size, args):
    # A child rank. If fn raises, torch.multiprocessing writes its traceback to a file.
    quiet_child()
    if os.getppid() != parent:   # it died before that line
        sys.exit(1)
    for s in (signal.SIGTERM, signal.SIGHUP):   # as Ctrl-C: the launcher ends us
        signal.signal(s, signal.SIG_IGN)
    sys.settrace(None)           # nor is a debugger's tracer ours
    os.environ.update(RANK=str(index + in_parent), LOCAL_RANK=str(index + in_parent))
    try:
        fn(index + in_parent, world_size, *args)
    except OSError as e:         # the output's reader went away, or its disk is full: a Stop
        failure = output_failure(e)
        if failure is None:
            raise
        raise Stop(failure) from None


def quiet_child():   # ours: Ctrl-C reaches the whole group, and its parent reports it (a child
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # dead of it first would be blamed); it dies
    if sys.platform == "linux":   # with its parent, even by SIGKILL (1 = PR_SET_PDEATHSIG; torch
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)   # sets SIGINT, which a background job ignores)


def _culprit(context, first, in_parent):
    """(rank, text) to blame: a rank whose peer died or stalled fails too (a closed connection, a
    timeout), a victim, blamed only if no rank failed otherwise."""
    failures, ended = {}, []   # ended: still running when we ended them, a stalled rank too
    for index, (process, error_file) in enumerate(zip(context.processes, context.error_files)):
        rank, code = index + in_parent, process.exitcode
        if os.path.exists(error_file):   # fn raised: its traceback
            with open(error_file, "rb") as f:
                failures[rank] = (os.path.getmtime(error_file), pickle.load(f))
        elif code == -signal.SIGABRT:    # NCCL's watchdog ends a rank whose collective timed out
            failures[rank] = (time.time(), "killed by SIGABRT: NCCL's watchdog, a collective "
                                           "timed out")
        elif code and (index == first or code > 0):   # a signal, or sys.exit("why")
            failures[rank] = (0.0 if index == first else time.time(), f"exited with code {code}"
                              if code > 0 else f"killed by {signal.Signals(-code).name}")
        elif code:
            ended.append(rank)
    victim = re.compile(r"^torch.distributed.dist|connection|timed out|timeout|broken pipe|reset")
    causes = [rank for rank, (_, text) in failures.items()
              if not victim.search(text.strip().splitlines()[-1].lower())]
    if not causes and ended:   # only victims failed: they waited for a rank that never did
        ranks = [f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, sorted(rs)))}" for rs in
                 (failures, ended)]
        return ended[0], f"stalled: {ranks[0]} timed out while {ranks[1]} still ran"
    rank = min(causes or failures, key=lambda rank: failures[rank][0])
    return rank, failures[rank][1]


def measured_bandwidth(nbytes, points, floor, plateau):
    """A GPU's bus bandwidth for nbytes: points' (bytes, busbw GB/s) of an 8-GPU all-reduce, scaled
    to this plateau, net of the floor (floor + bytes / it = bytes / busbw), interpolated log-log
    (past either end, the end's)."""
    net = []
    for size, busbw in points:
        ring = 2 * 7 / 8 * size                   # what an all-reduce's rank sends, of 8
        net.append((size, ring / (ring / (busbw / points[-1][1] * plateau) - floor)))
    size = min(max(nbytes, net[0][0]), net[-1][0])
    k = min(sum(at <= size for at, _ in net), len(net) - 1)
    (s0, b0), (s1, b1) = net[k - 1], net[k]
    return b0 * (b1 / b0) ** (math.log(size / s0) / math.log(s1 / s0))


def ray_launch(fn, world_size, args):
    """The ranks as Ray Train workers: TorchTrainer starts one a rank on any node of the Ray
    cluster (`ray start`'s, RAY_ADDRESS, or one started here), sets what torchrun would (RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ..) and joins the group; spawn() then runs that rank."""
    import ray
    from ray.train import ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    ray.init(runtime_env={"env_vars": {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}})
    cluster = ray.cluster_resources()
    use_gpu = args.backend == "nccl" or (args.backend == "auto" and
                                         cluster.get("GPU", 0) >= world_size)
    backend = "nccl" if use_gpu else "gloo"
    resources = {"CPU": min(1.0, cluster.get("CPU", 1) / world_size)}   # 8 ranks on 2 cores
    config = {"fn": fn, "world_size": world_size, "args": args, "backend": backend,
              "folder": os.getcwd()}     # a worker starts in another: --save's path, --resume's
    trainer = TorchTrainer(ray_worker, train_loop_config=config,
                           scaling_config=ScalingConfig(num_workers=world_size, use_gpu=use_gpu,
                                                        resources_per_worker=resources),
                           torch_config=TorchConfig(backend=backend, timeout_s=args.timeout_s))
    try:
        trainer.fit()
    except Exception as e:   # Ray's error: the failed ranks' tracebacks, printed above; its end
        raise Stop(f"a Ray worker failed: {str(e).strip().splitlines()[-1]}") from None


def ray_worker(config):   # one Ray Train worker: its rank of the run
    os.chdir(config["folder"])
    spawn(config["fn"], config["world_size"], config["args"], backend=config["backend"],
          timeout_s=config["args"].timeout_s)


def run_main(main):
    """A failed rank: one line and exit 1; Ctrl-C 130, SIGTERM 143, SIGHUP 129; the output's
    reader gone (| head) 141, quietly, as a shell reports SIGPIPE. Under torchrun, record()
    puts the failing rank's traceback into torchrun's failure summary instead."""
    try:
        if under_torchrun():
            from torch.distributed.elastic.multiprocessing.errors import record
            main = record(main)
        main()
    except OSError as e:     # this process's own output (--plan's table) failed
        failure = output_failure(e)
        if failure is None:
            raise
        sys.exit(141 if failure == OUTPUT_CLOSED else f"error: {failure}")
    except Stop as e:        # this rank (under torchrun) or the one process stopped on purpose
        sys.exit(f"error: {e}")
    except RankFailed as e:
        if e.stopped == OUTPUT_CLOSED:
            sys.exit(141)
        if e.stopped:        # a rank stopped on purpose: its message is the whole story
            sys.exit(f"error: {e.stopped}")
        sys.stderr.write(f"{e.text.rstrip()}\nerror: {e}\n")
        sys.exit(1)
    except KeyboardInterrupt as e:   # Ctrl-C, or SIGTERM or SIGHUP during spawn()
        how = e.args[0] if e.args else "Ctrl-C"
        sys.stderr.write(f"error: interrupted ({how}): every rank was stopped\n")
        sys.exit(128 + {"SIGTERM": 15, "SIGHUP": 1}.get(how, 2))


OUTPUT_CLOSED = "the output was closed"   # (| head): every rank ends, and nothing is said


def output_failure(e):
    """What an OSError says if it is our output's (a write of no named file: its reader gone, or
    no room), else None; what is printed after it then goes to /dev/null, to fail no more."""
    if e.filename is not None or e.errno not in (errno.EPIPE, errno.ENOSPC, errno.EDQUOT):
        return None
    with contextlib.suppress(OSError, ValueError):   # (a stdout with no file: nothing to do)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if e.errno == errno.EPIPE:
        return OUTPUT_CLOSED
    return f"the output could not be written ({e.strerror})"


class Parser(argparse.ArgumentParser):
    """argparse with the defaults in --help, and an error as one line on stderr, exit 2.
    Under torchrun every rank parses the same flags: rank 0 alone says what is wrong."""

    def __init__(self, **kwargs):   # with the flags every script shares for starting its ranks
        super().__init__(formatter_class=argparse.ArgumentDefaultsHelpFormatter, **kwargs)
        self.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                          help="auto: NCCL when this node has a GPU for each of its ranks; gloo "
                               "on the CPU when it has fewer (said in one line)")
        self.add_argument("--timeout-s", type=positive_float, default=DEFAULT_TIMEOUT_S,
                          help="how long a rank waits for a peer before the run fails")

    def error(self, message):   # under torchrun rank 0 says it; the rest wait, so that torchrun,
        if not (under_torchrun() and "MASTER_ADDR" in os.environ and os.environ["RANK"] != "0"):
            sys.stderr.write(f"{self.prog}: error: {message}\n")
        else:              # stopping every rank at the first exit, cannot stop rank 0 before it
            time.sleep(10)
        sys.exit(2)

    def refuse(self, rules):   # the door: (broken, message) pairs; the first broken one ends it
        for broken, message in rules:
            if broken:
                self.error(message)


def positive_int(text):
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def positive_float(text):
    with contextlib.suppress(ValueError):
        if 0 < float(text) < math.inf:      # not 0, negative, nan or inf
            return float(text)
    raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")


def check_launch_args(parser, args, world_size, flag="--world-size", tensor_bytes=0, sizes=""):
    """The timeout, torchrun's variables, a GPU a rank for NCCL, this machine's memory for its
    ranks (RANK_BYTES plus tensor_bytes each)."""
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    ranks, per_rank = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), RANK_BYTES + tensor_bytes
    gpus = torch.cuda.device_count()   # NVML: no CUDA starts in this process
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    parser.refuse([
        (torch.__version__ < OLDEST_TORCH, f"torch {torch.__version__} is installed; these scripts "
         f"need torch {OLDEST_TORCH} or newer: pip install 'torch>={OLDEST_TORCH}', or run make, "
         f"which installs requirements.txt's in .venv"),
        (args.timeout_s < 1, f"--timeout-s {args.timeout_s:g}: at least 1 s, or the ranks give "
                             f"up before they meet"),
        (args.timeout_s > 1e6, f"--timeout-s {args.timeout_s:g}: at most 1e6 s (11 days)"),
        (under_torchrun() and missing and not dist.is_initialized(),
         f"RANK, WORLD_SIZE and LOCAL_RANK are set, as torchrun sets them, but "
         f"{' and '.join(missing)} {'are' if len(missing) > 1 else 'is'} not: unset them, or "
         f"start this under torchrun"),
        (under_torchrun() and os.environ["WORLD_SIZE"] != str(world_size),
         f"{flag}: this run needs {world_size} ranks but torchrun started "
         f"WORLD_SIZE={os.environ.get('WORLD_SIZE')}"),
        (args.backend == "nccl" and gpus < ranks,
         f"{flag} {world_size}: {ranks} ranks on this node and {gpus} GPU{'s' * (gpus != 1)}; "
         f"NCCL takes a GPU a rank: run at most {gpus} ranks a node, or pass --backend gloo to "
         f"run every rank on the CPU"),
        (gpus < ranks and per_rank * ranks > memory,
         f"{sizes or f'{flag} {world_size}'}: about {per_rank / 1e9:.1f} GB per rank, "
         f"{per_rank * ranks / 1e9:.1f} GB for the {ranks} ranks on this machine, which has "
         f"{memory / 1e9:.1f} GB")])
    if args.backend == "auto" and 0 < gpus < ranks and os.environ.get("RANK", "0") == "0":
        print(f"{parser.prog}: {ranks} ranks on this node and {gpus} GPU{'s' * (gpus != 1)}, "
              f"and NCCL takes a GPU a rank: every rank runs on the CPU, with gloo", flush=True)


def parse_args(argv=None):
    parser = Parser(description="Step 1: every collective on every rank.")
    parser.add_argument("--world-size", type=positive_int, default=argparse.SUPPRESS,
                        help="number of ranks (default: 4, or WORLD_SIZE under torchrun)")
    args = parser.parse_args(argv)
    if "world_size" not in args:
        args.world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun() else 4
    check_launch_args(parser, args, args.world_size)
    return args


def log(tag, *values):   # one line with a rank tag in front, written at once: never interleaved
    sys.stdout.write(" ".join(str(v) for v in (tag, *values)) + "\n")
    sys.stdout.flush()


def heading(rank, title):   # a section starts once every rank has finished the one before
    dist.barrier()
    print(f"\n== {title}", flush=True) if rank == 0 else None
    dist.barrier()


def show(rank, when, **tensors):
    """This rank's tensors on one line; the ranks take turns, so lines come in rank order."""
    values = "  ".join(f"{name} = {fmt(v)}" for name, v in tensors.items())
    for turn in range(dist.get_world_size()):
        log(f"[rank {rank}]", f"{when:<6}", values) if turn == rank else None
        dist.barrier()


def fmt(value):   # [10 11], or a table as one bracket per row, on one line: [[0 1] [2 3]]
    if not isinstance(value, torch.Tensor):
        return str(value)
    return "[" + " ".join(fmt(row) if value.dim() > 1 else f"{row:g}" for row in
                          (value if value.dim() > 1 else value.tolist())) + "]"


def si(value):   # 3 significant figures and a prefix: 1.23 G, 4.56 m
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3),
                          ("", 1.0), ("m", 1e-3), ("u", 1e-6)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}"
    return f"{value:.3g} "


def seconds(value):   # 12.3 us, 4.56 ms, 1.23 s
    return f"{si(value)}s"


if __name__ == "__main__":
    run_main(main)
