"""NCCL's semantics, emulated on gloo (tests/nccl.py), and what they found.

1. The harness itself: one Work per batch; what a receive or an async collective writes
   lands only at wait() (NaN until then); a send's buffer or an output written early, and a
   Work never waited, are caught; CUDA started in the launching process is caught.
2. The runner's old pairing of Works (the Work beside each receive) reads NaN under the
   harness, where gloo hid it.
3. Every training script, schedule and flag family passes its --check under the harness.
4. The GPU-only fixes, with what they need mocked: the door asks NVML, never CUDA, and
   refuses bf16 by emulation and a node with fewer GPUs than ranks; a parent with CUDA
   starts its ranks by spawn; setup() passes device_id and one thread; NCCL's watchdog abort
   is a victim, not the culprit; the timeline times a GPU with CUDA events; the loss costs no
   host sync in the runner.
"""
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import collectives
import data_parallel as dp
import pipeline_parallel as pp
import tensor_parallel as tp
import three_d
from collectives import RankFailed, cleanup, setup, spawn
from common import NO_SAMPLE, check_report
from nccl import CUDAInitialised, fake_gpus, nccl_semantics
from pipeline_parallel import RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = ["--timeout-s", "15"]


# ----------------------------------------------------------------------------------
# 1. The harness
# ----------------------------------------------------------------------------------

def exchange_worker(rank, world_size):
    """Two ranks swap a tensor in one batch, then try every async collective."""
    setup(rank, world_size)
    peer = 1 - rank
    mine, theirs = torch.full((3,), 10.0 + rank), torch.zeros(3)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, theirs, peer)])
    assert len(works) == 1, works                             # one Work for the batch, as NCCL
    assert torch.isnan(theirs).all(), theirs                  # nothing lands before wait()
    works[0].wait()
    assert torch.equal(theirs, torch.full((3,), 10.0 + peer)), theirs

    summed = torch.full((4,), 1.0 + rank)
    work = dist.all_reduce(summed, async_op=True)
    assert torch.isnan(summed).all()
    work.wait()
    assert torch.equal(summed, torch.full((4,), 3.0))

    flat = torch.arange(4.0) + 10 * rank                      # a reduce-scatter in place, as ZeRO's
    piece = flat.view(2, 2)[rank]
    work = dist.reduce_scatter_single(piece, flat, async_op=True)
    assert torch.isnan(piece).all()
    work.wait()
    assert torch.equal(piece, (torch.arange(4.0) * 2 + 10).view(2, 2)[rank])

    gathered = torch.zeros(2)
    work = dist.all_gather_single(gathered, torch.tensor([5.0 + rank]), async_op=True)
    assert torch.isnan(gathered).all()
    work.wait()
    assert torch.equal(gathered, torch.tensor([5.0, 6.0]))
    cleanup()


def test_one_work_a_batch_and_nothing_lands_before_wait():
    with nccl_semantics():
        spawn(exchange_worker, 2, timeout_s=15)


def early_write_worker(rank, world_size, what):
    setup(rank, world_size)
    peer = 1 - rank
    if what == "send":
        mine, theirs = torch.ones(3), torch.zeros(3)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, theirs, peer)])
        mine.mul_(2)                                              # before its Work is waited
        for work in works:
            work.wait()
    elif what == "output":
        summed = torch.ones(4)
        work = dist.all_reduce(summed, async_op=True)
        summed.zero_()                                            # the transfer would land over this
        work.wait()
    else:                                                         # a Work nobody waits
        dist.all_reduce(torch.ones(2), async_op=True)
        dist.barrier()
    cleanup()


@pytest.mark.parametrize("what, said", [
    ("send", "a tensor it sends was written before its Work was waited"),
    ("output", "its output was written before its Work was waited"),
    ("never", "1 Work(s) never waited: all_reduce(async_op=True)")])
def test_a_buffer_written_before_wait_or_a_work_never_waited_is_caught(what, said):
    with nccl_semantics(), pytest.raises(RankFailed) as failed:
        spawn(early_write_worker, 2, what, timeout_s=15)
    assert said in failed.value.text
    # the same runs without the harness: gloo says nothing
    spawn(early_write_worker, 2, what, timeout_s=15)


def test_cuda_started_in_the_launching_process_is_caught():
    """torch.cuda.is_bf16_supported(), which the door used to call, starts CUDA; so does
    is_available(). device_count() asks NVML and starts nothing."""
    with fake_gpus(count=8):
        assert torch.cuda.device_count() == 8
        for call in (torch.cuda.is_bf16_supported, torch.cuda.is_available, torch.cuda.current_device):
            with pytest.raises(CUDAInitialised):
                call()


# ----------------------------------------------------------------------------------
# 2. The runner's old pairing of Works, caught
# ----------------------------------------------------------------------------------

def old_pairing_worker(rank, world_size, micro_batches):
    """1F1B's action lists, with the runner's old pairing: zip(ops, works), the Work beside a
    receive waited, the others one batch later. The "compute" only reads what arrived and
    sends a tensor that names it, so the test asks one thing: did the data arrive?"""
    setup(rank, world_size)
    dist.barrier()
    last = world_size - 1
    received, to_send, sending = {}, {}, []
    for action in pp.build_schedule("1f1b", world_size, rank, micro_batches):
        if action.op == "comm":
            ops = []
            for key in action.comms:
                peer = rank + 1 if key[0] in (SEND_ACT, RECV_GRAD) else rank - 1
                if key[0] in (RECV_ACT, RECV_GRAD):
                    received[key] = torch.empty(4)
                    ops.append(dist.P2POp(dist.irecv, received[key], peer))
                else:
                    ops.append(dist.P2POp(dist.isend, to_send.pop(key), peer))
            works = dist.batch_isend_irecv(ops)
            for op, work in zip(ops, works):      # the old pairing
                if op.op is dist.irecv:
                    work.wait()
            for work in sending:
                work.wait()
            sending = [work for op, work in zip(ops, works) if op.op is dist.isend]
            continue
        if action.op == "F":
            if rank > 0:
                got = received.pop((RECV_ACT, action.mb, None))
                assert torch.equal(got, torch.full((4,), 100.0 + action.mb)), f"F{action.mb} read {got.tolist()}"
            if rank < last:
                to_send[SEND_ACT, action.mb, None] = torch.full((4,), 100.0 + action.mb)
        if action.op == "B":
            if rank < last:
                got = received.pop((RECV_GRAD, action.mb, None))
                assert torch.equal(got, torch.full((4,), 200.0 + action.mb)), f"B{action.mb} read {got.tolist()}"
            if rank > 0:
                to_send[SEND_GRAD, action.mb, None] = torch.full((4,), 200.0 + action.mb)
    for work in sending:
        work.wait()
    cleanup()


def test_the_old_pairing_of_works_reads_nan_under_nccls_semantics():
    spawn(old_pairing_worker, 3, 4, timeout_s=15)                 # gloo, one Work an op: it passes
    with nccl_semantics(), pytest.raises(RankFailed) as failed:
        spawn(old_pairing_worker, 3, 4, timeout_s=15)
    assert "read [nan, nan, nan, nan]" in failed.value.text


# ----------------------------------------------------------------------------------
# 3. Every script, schedule and flag family, --check under the harness
# ----------------------------------------------------------------------------------

SIZE = ["--dim", "32", "--batch-size", "16"]      # NCCL's semantics need no more
QUICK = ["--steps", "3", *SIZE, *TIMEOUT, *NO_SAMPLE]
UNDER_NCCL = [
    (pp, ["--world-size", "2", "--micro-batches", "4", "--schedule", "gpipe"]),
    (pp, ["--world-size", "2", "--micro-batches", "4", "--schedule", "1f1b"]),
    (pp, ["--world-size", "2", "--micro-batches", "4", "--schedule", "zb-h1"]),
    (pp, ["--world-size", "2", "--micro-batches", "4", "--schedule", "interleaved"]),
    (pp, ["--world-size", "4", "--micro-batches", "8", "--schedule", "1f1b", "--recompute"]),
    (pp, ["--world-size", "2", "--micro-batches", "4", "--bf16"]),
    (dp, ["--world-size", "2", "--zero", "0"]),
    (dp, ["--world-size", "2", "--zero", "0", "--overlap", "--bucket-mb", "0"]),
    (dp, ["--world-size", "2", "--zero", "1", "--overlap"]),
    (dp, ["--world-size", "2", "--zero", "2", "--overlap", "--bucket-mb", "0"]),
    (dp, ["--world-size", "2", "--zero", "3", "--overlap", "--bucket-mb", "0"]),
    (dp, ["--world-size", "2", "--zero", "3", "--recompute", "--bf16"]),
    (tp, ["--world-size", "2", "--tp-style", "all-gather"]),
    (tp, ["--world-size", "2", "--tp-style", "megatron", "--recompute"]),
    (tp, ["--world-size", "2", "--tp-style", "megatron", "--bf16"]),
    (three_d, []),
    (three_d, ["--p2p-shard", "--tp-style", "megatron", "--zero", "3"]),
    (three_d, ["--schedule", "interleaved", "--num-layers", "4", "--zero", "1", "--bucket-mb", "0"]),
    (three_d, ["--schedule", "zb-h1", "--order", "tp-dp-pp", "--zero", "2", "--recompute"]),
    (three_d, ["--bf16", "--clip-grad", "0.5"]),
    (three_d, ["--tp-style", "megatron", "--sequence-parallel", "--zero", "3", "--p2p-shard"]),
    (tp, ["--world-size", "2", "--tp-style", "megatron", "--sequence-parallel"]),
]


@pytest.mark.deadline(90)
@pytest.mark.parametrize("script, argv", UNDER_NCCL, ids=lambda a: " ".join(a) if isinstance(a, list)
                         else a.__name__)
def test_check_passes_under_nccls_semantics(script, argv, capfd):
    with nccl_semantics():
        script.main([*argv, "--check", *QUICK])
    out = capfd.readouterr().out
    tolerance = dp.bf16_tolerance(2) if "--bf16" in argv else dp.CHECK_TOLERANCE
    figures, verdict = check_report(out)
    assert verdict == "OK", out
    assert figures["gradients"][0] <= tolerance and figures["losses"][0] <= tolerance, figures
    assert figures["weights after an update"][0] <= 2**-20, figures


@pytest.mark.deadline(90)
def test_a_checkpoint_written_and_resumed_elsewhere_under_nccls_semantics(tmp_path, capfd):
    """Written by dp2 pp2 tp2 under ZeRO-1, read back by dp1 pp2 tp4 under ZeRO-3 with Megatron's
    pairs, every collective as NCCL runs it: the resumed run passes --check."""
    with nccl_semantics():
        three_d.main(["--zero", "1", "--checkpoint", str(tmp_path), "--steps", "2", *SIZE, *TIMEOUT])
        three_d.main(["--dp", "1", "--tp", "4", "--zero", "3", "--tp-style", "megatron",
                      "--resume", str(tmp_path), "--check", *QUICK])
    out = capfd.readouterr().out
    assert f"resumed from {tmp_path / 'step-00000002'}: step 2" in out, out
    figures, verdict = check_report(out)
    assert verdict == "OK" and len(figures) == 3, out


def test_the_collectives_tour_under_nccls_semantics(capfd):
    with nccl_semantics():
        collectives.main(["--world-size", "3", *TIMEOUT])
    out = capfd.readouterr().out
    assert "ring_all_reduce == dist.all_reduce: yes" in out and "nan" not in out


# ----------------------------------------------------------------------------------
# 4. The GPU-only fixes, with what they need mocked
# ----------------------------------------------------------------------------------

SCRIPTS = {"data_parallel": dp, "tensor_parallel": tp, "pipeline_parallel": pp, "three_d": three_d}


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_door_accepts_bf16_on_gpus_without_starting_cuda(name):
    """On 8 GPUs the door accepts --bf16 and starts no CUDA (fake_gpus raises if it would)."""
    with fake_gpus(count=8):
        args = SCRIPTS[name].parse_args(["--bf16"])
    assert args.bf16


def test_fewer_gpus_than_ranks_run_on_the_cpu_and_say_so_and_nccl_is_refused(capsys):
    prog = os.path.basename(sys.argv[0])
    with fake_gpus(count=4):                                     # 8 ranks on a node of 4 GPUs
        assert three_d.parse_args([]).backend == "auto"
        assert collectives.pick_backend(8) == "gloo" and collectives.pick_backend(4) == "nccl"
    assert capsys.readouterr().out.splitlines() == [
        f"{prog}: 8 ranks on this node and 4 GPUs, and NCCL takes a GPU a rank: every rank runs "
        f"on the CPU, with gloo"]
    with fake_gpus(count=4), pytest.raises(SystemExit) as exited:
        three_d.parse_args(["--backend", "nccl"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"{prog}: error: --dp x --pp x --tp 8: 8 ranks on this node and "
                   f"4 GPUs; NCCL takes a GPU a rank: run at most 4 ranks a node, or pass --backend gloo to "
                   f"run every rank on the CPU"]
    with fake_gpus(count=4):
        assert three_d.parse_args(["--backend", "gloo"]).backend == "gloo"   # the CPU, as asked
        assert collectives.pick_backend(8, "gloo") == "gloo"
    with fake_gpus(count=0):                                     # no GPU: gloo, said by no one
        assert three_d.parse_args([]).backend == "auto" and collectives.pick_backend(8) == "gloo"
    assert capsys.readouterr().out == ""


@pytest.mark.deadline(60)
def test_make_3d_on_a_laptop_with_one_gpu_trains_on_the_cpu_and_passes_its_check(capfd):
    """The README's `make 3d` where the door sees one GPU: the ranks start by fork (no CUDA in
    this process: fake_gpus raises if any starts), on gloo, and --check passes."""
    with fake_gpus(count=1):
        three_d.main(["--dp", "2", "--pp", "2", "--tp", "2", "--check", "--steps", "3"])
    out = capfd.readouterr().out      # (the ranks' lines too: they write to this process's fd)
    assert out.splitlines()[0] == (f"{os.path.basename(sys.argv[0])}: 8 ranks on this node and "
                                   f"1 GPU, and NCCL takes a GPU a rank: every rank runs on the "
                                   f"CPU, with gloo")
    assert out.rstrip().endswith("check OK")


def test_a_parent_with_cuda_starts_its_ranks_by_spawn(monkeypatch):
    started = []

    class Started:
        processes, error_files = [], []

        def join(self, grace_period=None):
            return True

    def start_processes(fn, args, nprocs, join, start_method):
        started.append(start_method)
        return Started()
    monkeypatch.setattr(collectives.mp, "start_processes", start_processes)
    spawn(print, 2, backend="gloo")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    spawn(print, 2, backend="gloo")
    assert started == ["fork", "spawn"]


def test_setup_on_a_gpu_passes_device_id_and_one_thread(monkeypatch, tmp_path):
    calls = {}
    monkeypatch.setenv("PARALLEL_BACKEND", "nccl")
    monkeypatch.setenv("PARALLEL_STORE", str(tmp_path / "store"))
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.setdefault("set_device", device))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: calls.update(backend=backend, **kwargs))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        device = setup(11, 16)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert device == torch.device("cuda", 3) == calls["set_device"] == calls["device_id"]
    assert calls["backend"] == "nccl" and calls["rank"] == 11 and calls["world_size"] == 16


def watchdog_worker(rank, world_size):
    import faulthandler
    import time
    if rank == 1:
        time.sleep(30)                 # stalled: never reaches the collective
    time.sleep(0.3)
    faulthandler.disable()             # (pytest's: it would print this rank's stack)
    os.abort()                         # as NCCL's watchdog ends a rank whose collective timed out


@pytest.mark.deadline(30)
def test_ranks_aborted_by_the_watchdog_are_victims_of_the_stalled_one():
    with pytest.raises(RankFailed) as failed:
        spawn(watchdog_worker, 3, timeout_s=10)
    assert failed.value.rank == 1
    assert str(failed.value).startswith("rank 1 failed first: stalled: rank")


class FakeEvent:
    """torch.cuda.Event on a stream whose clock the test sets: elapsed_time in ms."""
    clock = 0.0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None

    def record(self):
        self.at = FakeEvent.clock

    def elapsed_time(self, end):
        return (end.at - self.at) * 1e3


def test_the_timeline_times_a_gpu_with_cuda_events(monkeypatch):
    """On a GPU the actions' times come from events on the stream, read after one
    synchronize at the end, not from the host's clock when the call returns."""
    syncs = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    gpu = torch.device("cuda", 0)
    FakeEvent.clock = 0.0
    recorder = pp.Recorder(gpu)
    host_zero = recorder.zero[0]
    stage = SimpleNamespace(stash={}, waiting_for_w={}, layers=[], first=False, last=False)
    for op, start, end in (("F", 0.5, 2.0), ("B", 2.0, 6.0)):
        FakeEvent.clock = start
        recorder.start()
        FakeEvent.clock = end
        recorder.stop(op, 0, None, [stage])
    assert len(syncs) == 1                                   # none while the actions are queued
    events = recorder.events()
    assert len(syncs) == 2
    assert [(op, round(t0 - host_zero, 9), round(t1 - host_zero, 9)) for op, _, _, t0, t1 in events] == \
        [("F", 0.5, 2.0), ("B", 2.0, 6.0)]


def single_stage_worker(rank, world_size):
    """One stage, four micro-batches: the runner asks nothing of the host, the loss is a tensor."""
    setup(rank, world_size)
    D, m = 8, 4
    args = SimpleNamespace(optimizer="sgd", lr=0.1, num_layers=2, dim=D, heads=2, context=4, vocab_size=dp.VOCAB_SIZE,
                           seed=0, bf16=False, recompute=False, virtual_stages=1, micro_batches=m, batch_size=8,
                           schedule="1f1b",
                           experts=0, kv_heads=1, ffn_dim=24, rope_theta=10000.0, qk_norm=False)
    _, _, replica, (stage,) = pp.hold_stages(args, 0, 1, torch.device("cpu"))   # the whole model
    x, y = dp.make_batch(args, step=0)
    syncs = []
    real = {name: getattr(torch.Tensor, name) for name in ("item", "__float__", "tolist")}
    for name, fn in real.items():
        setattr(torch.Tensor, name, lambda self, *a, _fn=fn, _name=name: syncs.append(_name) or _fn(self, *a))
    try:
        replica.begin_step()
        stage.begin_step(y.chunk(m))
        pp.run_schedule(pp.build_schedule("1f1b", 1, 0, m), [stage], x.chunk(m), 0, 0, (2, 4, D))
    finally:
        for name, fn in real.items():
            setattr(torch.Tensor, name, fn)
    assert syncs == [], syncs
    assert torch.is_tensor(stage.loss) and float(stage.loss) > 0
    cleanup()


def test_the_runner_sums_the_loss_on_the_device():
    spawn(single_stage_worker, 1, timeout_s=15)


def test_the_multinode_recipe_names_ncclsocket_ifname():
    readme = (REPO / "README.md").read_text()
    recipe = readme[readme.index("**Two nodes of 4**"):readme.index("**Under Slurm**")]
    assert "NCCL_SOCKET_IFNAME" in recipe and "GLOO_SOCKET_IFNAME" in recipe
