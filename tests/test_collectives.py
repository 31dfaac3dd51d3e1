"""Tests for collectives.py: each collective and the ring all-reduce against the value
computed in one process, the demo's printed numbers, the launcher's failure handling,
and the command line.

Multi-process tests run their workers through spawn(). A worker checks its own numbers
with assert; a failed assert in any rank comes back as RankFailed and fails the test.
Every test has a deadline (conftest.py), so a deadlock fails in seconds.
"""
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import collectives as C
from collectives import RankFailed, cleanup, ring_all_reduce, setup, spawn
from common import child_pids, torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEEN = {}  # what a worker that ran in this process saw; forked ranks' writes stay in theirs


def rank_input(rank, numel, dtype=torch.float32):
    """Rank r's input, which any process can rebuild: the single-process reference."""
    gen = torch.Generator().manual_seed(1000 + rank)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=gen, dtype=dtype)
    return torch.randint(-1000, 1000, (numel,), generator=gen, dtype=dtype)


# ---- each collective against the single-process value --------------------------

def check_collectives(rank, world_size):
    setup(rank, world_size)
    n, root = world_size, world_size - 1  # a root other than 0 catches src/dst mix-ups
    right, left = (rank + 1) % n, (rank - 1) % n
    # Whole numbers in float32 add up exactly in any order, so torch.equal is fair
    xs = [rank_input(r, 2 * n, torch.int64).float() for r in range(n)]  # n x (2n,)
    x, total = xs[rank], torch.stack(xs).sum(0)

    summed = x.clone()
    dist.all_reduce(summed)
    assert torch.equal(summed, total), "all-reduce"

    piece = torch.empty(2)
    dist.reduce_scatter_single(piece, x)
    assert torch.equal(piece, total.view(n, 2)[rank]), "reduce-scatter"

    gathered = torch.empty(2 * n)
    dist.all_gather_single(gathered, x[:2])
    assert torch.equal(gathered, torch.cat([xr[:2] for xr in xs])), "all-gather"

    dist.all_gather_single(gathered, piece)
    assert torch.equal(gathered, summed), "all-reduce == reduce-scatter + all-gather"

    copy = x.clone()
    dist.broadcast(copy, src=root)
    assert torch.equal(copy, xs[root]), "broadcast"

    row = torch.empty(2)
    dist.scatter(row, list(x.view(n, 2)) if rank == root else None, src=root)
    assert torch.equal(row, xs[root].view(n, 2)[rank]), "scatter"

    rows = [torch.empty(2 * n) for _ in range(n)] if rank == root else None
    dist.gather(x, rows, dst=root)
    assert rank != root or torch.equal(torch.stack(rows), torch.stack(xs)), "gather"

    reduced = x.clone()
    dist.reduce(reduced, dst=root)
    assert rank != root or torch.equal(reduced, total), "reduce"

    received = torch.empty(2 * n)
    if rank % 2 == 0:  # a blocking send waits for its receive: order by parity
        dist.send(x, dst=right)
        dist.recv(received, src=left)
    else:
        dist.recv(received, src=left)
        dist.send(x, dst=right)
    assert torch.equal(received, xs[left]), "send/recv"

    works = [dist.isend(x, dst=left), dist.irecv(received, src=right)]
    for work in works:
        work.wait()
    assert torch.equal(received, xs[right]), "isend/irecv"
    cleanup()


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_collectives_match_single_process(world_size):
    spawn(check_collectives, world_size)


def test_demo_prints_the_right_numbers(capfd):
    # x_r = [10r, 10r+1, 10r+2] on 3 ranks: the sum is [30, 33, 36]
    spawn(C.tour, 3, [C.all_reduce_is_reduce_scatter_then_all_gather,
                      C.one_root_and_every_rank, C.point_to_point, C.ring_demo])
    lines = capfd.readouterr().out.splitlines()
    for expected in [
        "[rank 2] after  tensor = [30 33 36]",                        # all-reduce
        "[rank 1] after  input = [10 11 12]  output = [33]",          # reduce-scatter
        "[rank 0] after  input = [30]  output = [30 33 36]",          # all-gather
        "[rank 2] after  tensor = [0 1]",                             # broadcast from 0
        "[rank 2] after  row = [4 5]",                                # scatter
        "[rank 0] after  table = [[0 1] [10 11] [20 21]]",            # gather
        "[rank 0] after  tensor = [30 33]",                           # reduce
        "[rank 0] after  sending = [0 1]  received = [20 21]",        # send right
        "[rank 0] after  sending = [0 1]  received = [10 11]",        # isend left
        "[rank 1] after  tensor = [30 33 36 39 42 45 48]",            # ring, length 7
    ]:
        assert expected in lines, expected
    # The ranks take turns: within a section, lines come in rank order
    ring = lines.index("[rank 0] after  tensor = [30 33 36 39 42 45 48]")
    assert [line[:8] for line in lines[ring:ring + 3]] == ["[rank 0]", "[rank 1]", "[rank 2]"]


# ---- the ring all-reduce ----------------------------------------------------------

def check_ring(rank, world_size):
    setup(rank, world_size)
    n = world_size
    # Lengths n does not divide, fewer elements than ranks, and one rank's worth short
    for numel in sorted({1, 5, 13, 1000, n - 1, n + 1, 3 * n}):
        for dtype in (torch.float32, torch.int64):
            xs = [rank_input(r, numel, dtype) for r in range(n)]
            x = xs[rank].clone()
            expected = x.clone()
            dist.all_reduce(expected)
            assert ring_all_reduce(x) is x  # in place, like dist.all_reduce
            what = f"n={n} numel={numel} {dtype}"
            # Floats are summed in another order than gloo's, so equal only to rounding
            assert torch.allclose(x, expected, rtol=1e-5, atol=1e-5), what
            assert torch.allclose(x, torch.stack(xs).sum(0), rtol=1e-5, atol=1e-5), what
    # Any shape: the ring works on the flattened tensor and leaves the shape alone
    x = torch.arange(21.0).view(3, 7) + rank
    ring_all_reduce(x)
    assert torch.equal(x, n * torch.arange(21.0).view(3, 7) + n * (n - 1) / 2)
    with pytest.raises(ValueError, match="contiguous"):
        ring_all_reduce(x.t())
    cleanup()


@pytest.mark.deadline(30)
@pytest.mark.parametrize("world_size", range(2, 9))
def test_ring_all_reduce_matches_all_reduce(world_size):
    spawn(check_ring, world_size)


def check_ring_on_subgroups(rank, world_size):
    setup(rank, world_size)
    members = {"odd": [1, 3, 4], "even": [0, 2]}  # ring peers are not rank +- 1 here
    # Every rank creates every group, in the same order, and keeps its own
    groups = {name: dist.new_group(ranks) for name, ranks in members.items()}
    mine = "odd" if rank in members["odd"] else "even"
    other = "even" if mine == "odd" else "odd"
    for numel in (1, 7, 100):
        xs = [rank_input(r, numel) for r in range(world_size)]
        x = xs[rank].clone()
        expected = x.clone()
        dist.all_reduce(expected, group=groups[mine])
        ring_all_reduce(x, group=groups[mine])
        reference = torch.stack([xs[r] for r in members[mine]]).sum(0)
        assert torch.allclose(x, expected, atol=1e-5), numel
        assert torch.allclose(x, reference, atol=1e-5), numel
        # A rank outside the group is left alone, as dist.all_reduce leaves it
        y = xs[rank].clone()
        ring_all_reduce(y, group=groups[other])
        assert torch.equal(y, xs[rank])
    cleanup()


@pytest.mark.deadline(30)
def test_ring_all_reduce_on_subgroups():
    spawn(check_ring_on_subgroups, 5)


# ---- the launcher -----------------------------------------------------------------

def raise_on_rank_2(rank, world_size):
    setup(rank, world_size)
    if rank == 2:
        time.sleep(0.2)  # the others are inside the all-reduce by now
        raise ValueError("rank 2 gives up")
    dist.all_reduce(torch.ones(4))  # waits on rank 2, then sees its connection close
    cleanup()


def kill_rank_1(rank, world_size):
    setup(rank, world_size)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # no traceback, no report: only the exit code
    dist.all_reduce(torch.ones(4))
    cleanup()


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc")
@pytest.mark.parametrize("worker, culprit, why", [
    (raise_on_rank_2, 2, "rank 2 gives up"),
    (kill_rank_1, 1, "SIGKILL"),
])
def test_failed_rank_is_named_and_every_rank_ends(worker, culprit, why):
    before = child_pids()
    start = time.time()
    with pytest.raises(RankFailed) as failed:
        spawn(worker, 4)
    assert failed.value.rank == culprit
    assert why in str(failed.value)
    assert time.time() - start < 10  # seconds, not the 60 s process-group timeout
    assert multiprocessing.active_children() == []
    assert child_pids() <= before


def victim_first(rank, world_size):
    if rank == 0:  # fails first, but with what a rank whose peer died would see
        raise ConnectionResetError("Connection reset by peer")
    time.sleep(0.1)
    raise ValueError("the real cause")


def test_rank_that_sees_a_closed_connection_is_not_named():
    with pytest.raises(RankFailed) as failed:
        spawn(victim_first, 2)
    assert failed.value.rank == 1
    assert "the real cause" in str(failed.value)


def all_reduce_ranks(rank, world_size):
    setup(rank, world_size)
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    assert x.item() == world_size * (world_size + 1) / 2
    SEEN[rank] = (os.getpid(), x.item())
    cleanup()


def test_run_beside_a_program_on_port_29500():
    # torchrun's default port; spawn meets through a file instead, so a busy port is fine
    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", 29500))
        holder.listen()
    except OSError:
        pass  # someone else holds it already, which is the case under test anyway
    try:
        spawn(all_reduce_ranks, 3)
    finally:
        holder.close()


def test_debugger_runs_rank_0_in_this_process():
    SEEN.clear()
    previous = sys.gettrace()
    sys.settrace(lambda frame, event, arg: None)  # what a debugger does, minus the stopping
    try:
        spawn(all_reduce_ranks, 3)
    finally:
        sys.settrace(previous)
    # Only rank 0 wrote here, from this process, with the real sum 1 + 2 + 3
    assert SEEN == {0: (os.getpid(), 6.0)}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(monkeypatch, rank, world_size):
    for name, value in dict(RANK=rank, WORLD_SIZE=world_size, LOCAL_RANK=rank,
                            LOCAL_WORLD_SIZE=world_size, MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=free_port()).items():
        monkeypatch.setenv(name, str(value))


def record_rank(rank, world_size):
    SEEN[rank] = (os.getpid(), world_size, os.environ["PARALLEL_BACKEND"],
                  os.environ["PARALLEL_TIMEOUT_S"])


def test_under_torchrun_spawn_runs_this_rank_in_process(monkeypatch, capsys):
    SEEN.clear()
    torchrun_env(monkeypatch, rank=3, world_size=4)
    spawn(record_rank, 4, backend="gloo", timeout_s=7)
    assert SEEN == {3: (os.getpid(), 4, "gloo", "7")}  # the flags reach setup()
    assert "PARALLEL_BACKEND" not in os.environ

    # At the door: every rank exits 2, and rank 0 alone says why, in one line (not 4 times);
    # the rest first wait 10 s, for torchrun to stop them once rank 0 has said it (asked, not slept)
    parser = C.Parser(prog="collectives.py")
    slept = []
    monkeypatch.setattr(C.time, "sleep", slept.append)
    for rank, lines, waits in ((3, 0, [10]), (0, 1, [])):
        monkeypatch.setenv("RANK", str(rank))
        with pytest.raises(SystemExit) as exited:
            C.check_launch_args(parser, parser.parse_args([]), 2)
        assert exited.value.code == 2 and slept == waits
        slept.clear()
        err = capsys.readouterr().err
        assert len(err.splitlines()) == lines
    assert "--world-size" in err and "WORLD_SIZE=4" in err


def test_under_torchrun_setup_meets_at_master_port(monkeypatch):
    SEEN.clear()
    torchrun_env(monkeypatch, rank=0, world_size=1)
    spawn(all_reduce_ranks, 1)
    assert SEEN == {0: (os.getpid(), 1.0)}


# ---- the command line -------------------------------------------------------------

def run_script(*args, launcher=(sys.executable,)):
    """Start collectives.py in a clean environment (no torchrun variables)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    return subprocess.Popen([*launcher, os.path.join(ROOT, "collectives.py"), *args],
                            cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc, timeout=50):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, out, err


def test_bad_world_size_is_one_line_and_exit_2():
    # Started together: each pays for importing torch, and they overlap
    procs = {args: run_script(*args) for args in [
        ("--world-size", "0"), ("--world-size", "two"),
        ("--backend", "nccl", "--world-size", "64"),  # more ranks than GPUs, here none
    ]}
    for args, proc in procs.items():
        code, out, err = finish(proc)
        assert code == 2, (args, err)
        assert len(err.splitlines()) == 1 and "--world-size" in err, (args, err)
        assert "Traceback" not in err and out == ""


@pytest.mark.parametrize("version,refused", [("2.7.1+cu126", True), ("2.6.0", True),
                                              ("2.8.0+cu128", False), ("2.11.0+cu130", False)])
def test_a_torch_older_than_the_oldest_supported_is_refused_in_one_line(monkeypatch, capsys,
                                                                       version, refused):
    """Older than 2.8, one line naming the version found, the version needed, and how to get
    it (CI runs make 3d and tests/test_three_d.py on torch 2.8 itself: .ci/run)."""
    monkeypatch.setattr(torch, "__version__", torch.torch_version.TorchVersion(version))
    if not refused:
        assert C.parse_args(["--world-size", "2"]).world_size == 2
        return
    with pytest.raises(SystemExit) as exited:
        C.parse_args(["--world-size", "2"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"{os.path.basename(sys.argv[0])}: error: torch {version} is installed; these scripts "
        f"need torch 2.8 or newer: pip install 'torch>=2.8', or run make, which installs "
        f"requirements.txt's in .venv"]


def test_ci_runs_the_oldest_supported_torch_and_make_pins_a_newer_one():
    with open(os.path.join(os.path.dirname(C.__file__), ".ci", "run")) as f:
        ci = f.read()
    assert f"torch=={C.OLDEST_TORCH}.0" in ci and "tests/test_three_d.py" in ci
    with open(os.path.join(os.path.dirname(C.__file__), "requirements.txt")) as f:
        pinned = next(line.split("==")[1] for line in f if line.startswith("torch=="))
    assert torch.torch_version.TorchVersion(pinned) >= C.OLDEST_TORCH


ALL_REDUCE_ON_2 = ["[rank 0] after  tensor = [10 12]", "[rank 1] after  tensor = [10 12]"]


def test_script_on_two_ranks():
    code, out, err = finish(run_script("--world-size", "2"))
    assert code == 0, err
    lines = out.splitlines()
    assert all(line in lines for line in ALL_REDUCE_ON_2), out
    assert "[rank 0] ring_all_reduce == dist.all_reduce: yes" in lines


def test_under_torchrun(tmp_path):
    code, out, err = finish(run_script(launcher=torchrun(tmp_path)))
    assert code == 0, err
    lines = out.splitlines()
    assert all(line in lines for line in ALL_REDUCE_ON_2), out


def exit_quietly_or_not(rank, world_size):
    sys.exit() if rank == 0 else sys.exit("rank 1 stops: bad config")


def test_sys_exit_in_a_rank(capfd):
    # sys.exit() is success, as in any script; sys.exit("why") is a failure: the rank
    # prints its reason on stderr, as a script does, and exits with code 1
    spawn(lambda rank, world_size: sys.exit(), 2)
    with pytest.raises(RankFailed, match="rank 1 failed first: exited with code 1") as failed:
        spawn(exit_quietly_or_not, 2)
    assert failed.value.rank == 1
    assert "rank 1 stops: bad config" in capfd.readouterr().err
