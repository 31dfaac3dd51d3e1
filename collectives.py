"""Step 1: the collective operations, and the launcher every later step imports.

    python collectives.py                      # every collective, on 4 ranks
    python collectives.py --world-size 8
    python collectives.py --bench              # bandwidth table
    torchrun --nproc-per-node 4 collectives.py # the same script under torchrun

The launcher at the bottom of this file (spawn / setup / cleanup) is the only
plumbing in the collection. It starts one process per rank on this machine, or,
under torchrun, runs the one rank torchrun started, so every script runs unchanged
on a laptop's CPU, on a GPU box, and across nodes.
"""
import argparse
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.optim  # noqa: F401  imported once here, before forking, not once per rank


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
            elif procs[rank].join() or procs[rank].exitcode != 0 and rank not in failures:
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
