"""make bench's checks (tests/bench.py), at a tiny size and one timed step: our step and
PyTorch's own API for it (DDP, ColwiseParallel, torch.distributed.pipelining, and their
3D composition) must compute the same gradients and weights, or the bench's times
compare nothing. No time is asserted. And the DDP failure in PyTorch's 3D composition
that the README describes, pinned.
"""
import os
import re
from types import SimpleNamespace

import pytest

import bench
import data_parallel
import race
from race import ROOT

TOLERANCE = 1e-5   # float32 summation order gives ~1e-7 here


@pytest.fixture(autouse=True)
def no_warm_up(monkeypatch):
    monkeypatch.setattr(race, "WARMUP", 0)


def tiny(**sizes):
    # one timed step; lr 0.1: a step moves the weights visibly, so a wrong gradient shows in them too
    return SimpleNamespace(**{**dict(num_layers=4, dim=8, heads=2, kv_heads=2, ffn_dim=24, rope_theta=10000.0,
                                      qk_norm=False, context=4, vocab_size=data_parallel.VOCAB_SIZE,
                                      batch_size=8, micro_batches=2, steps=1, seed=0, lr=0.1, experts=0, ep=1,
                                      recompute=False, bf16=False, clip_grad=None, bucket_mb=25.0,
                                      sequence_parallel=False, cp=1, cp_layout="zigzag",
                                      backend="gloo", timeout_s=30.0), **sizes})


def assert_same(result, compared):
    diffs = {name: diff for name, diff in result["diffs"].items() if diff is not None}
    assert sorted(diffs) == sorted(compared)
    assert all(diff <= TOLERANCE for diff in diffs.values()), diffs
    assert all(seconds > 0 for seconds in result["times"].values())


def test_data_parallel_equals_ddp():
    result = bench.versus_ddp(tiny(world_size=2, zero=0))
    assert_same(result, ["ours --overlap", "DDP", bench.DDP_WRITTEN])


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_equals_pytorchs_own_sharding(zero):
    """ZeRO-1 against ZeroRedundancyOptimizer over DDP, ZeRO-2 and 3 against FSDP2; on 3
    ranks, so that the shards are padded (d does not divide D x D = 64)."""
    result = bench.versus_ddp(tiny(world_size=3, batch_size=12, zero=zero))
    assert_same(result, [bench.TORCH_ZERO[zero], f"ours --zero {zero} --overlap"])


def test_tensor_parallel_equals_colwise_parallel():
    result = bench.versus_colwise(tiny(world_size=2, tp_style="all-gather"))
    assert_same(result, ["ColwiseParallel, outputs all-gathered"])


@pytest.mark.parametrize("num_layers", [4, 3])   # pairs; pairs and an all-gather layer
def test_megatron_pairs_equal_colwise_then_rowwise_parallel(num_layers):
    result = bench.versus_colwise(tiny(world_size=2, tp_style="megatron", num_layers=num_layers))
    assert_same(result, ["ColwiseParallel + RowwiseParallel"])


def test_sequence_parallel_equals_torchs_sequence_parallel():
    """tensor_parallel.py --sequence-parallel against SequenceParallel norms, PrepareModuleInput
    and loss_parallel: the same gradients (the gains' included) and weights."""
    result = bench.versus_colwise(tiny(world_size=2, tp_style="megatron", sequence_parallel=True))
    assert_same(result, ["Colwise + RowwiseParallel + SequenceParallel"])


def test_pipeline_equals_pipelining_gpipe_and_1f1b():
    result = bench.versus_pipelining(tiny(world_size=2, schedule="1f1b", virtual_stages=1))
    assert_same(result, ["torch ScheduleGPipe", "ours 1f1b", "torch Schedule1F1B"])


@pytest.mark.parametrize("schedule, virtual, torch_schedule", [
    ("zb-h1", 1, "ScheduleInterleavedZeroBubble"), ("interleaved", 2, "ScheduleInterleaved1F1B")])
def test_zero_bubble_and_interleaved_equal_pytorchs(schedule, virtual, torch_schedule):
    result = bench.versus_pipelining(tiny(world_size=2, schedule=schedule, virtual_stages=virtual))
    assert_same(result, [f"torch {torch_schedule}"])


def test_three_d_equals_pytorch_composition():
    result = bench.versus_torch_3d(tiny(dp=2, pp=2, tp=2, schedule="1f1b", order="tp-pp-dp", p2p_shard=False,
                                        tp_style="all-gather", zero=0, virtual_stages=1))
    assert_same(result, [f"torch 3D, dp by {way}" for way in bench.DP_WAYS])


def test_a_wrong_gradient_is_caught_and_its_table_refused(monkeypatch, capsys):
    """The check is not vacuous: double our averaged gradients and DDP no longer matches,
    and print_race exits instead of reporting a time for different work."""
    average = data_parallel.DataParallel.average

    def average_twice_too_large(self):
        average(self)
        for grad in self.grads():
            grad.mul_(2)
    monkeypatch.setattr(data_parallel.DataParallel, "average", average_twice_too_large)
    result = bench.versus_ddp(tiny(world_size=2, zero=0))
    assert result["diffs"]["DDP"] > 1e-3 and result["diffs"][bench.DDP_WRITTEN] > 1e-3
    assert result["diffs"]["ours --overlap"] <= TOLERANCE
    with pytest.raises(SystemExit):
        race.print_race(result)
    assert "DIFFERENT" in capsys.readouterr().out


def test_ddp_in_pytorchs_3d_composition_gets_gradients_m_times_too_large():
    """What the README says of DDP in PyTorch's own composition (pipelining + TP + DDP with
    its defaults) on this torch: the first step's gradients of the tp-split weights are exactly
    m times ours, as the schedule's division by m finds none of them in DDP's module after TP
    (the gains and P, plain tensors, it finds). With the stages' shapes given up front (static
    mode), the second step runs.""" 
    args = tiny(dp=2, pp=2, tp=2, schedule="1f1b", order="tp-pp-dp", p2p_shard=False, tp_style="all-gather",
                zero=0, virtual_stages=1)
    ratio, error = bench.ddp_failure_figures(args, 8, dict(backend="gloo", timeout_s=30.0))
    assert ratio == pytest.approx(2.0, rel=1e-5)
    assert error is None


@pytest.mark.parametrize("argv, flag", [
    (["three_d", "--check"], "--check"),
    (["pipeline_parallel", "--timeline"], "--timeline"),
    (["data_parallel", "--steps", "3"], "--steps"),
    (["bubble-table", "--dim", "5"], "bubble-table"),
    (["machine", "--world-size", "2"], "machine"),
    (["no-such-step"], "no-such-step"),
])
def test_the_bench_refuses_what_it_would_ignore(argv, flag, capsys):
    with pytest.raises(SystemExit) as exited:
        bench.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and flag in err and "error" in err, err


def test_the_memory_table_holds_the_formulas_at_every_stage(capfd):
    """make bench's memory table: stages 0 to 3 in turn, each row counted from the tensors
    equal to its formula. With 3 replicas, a part a bucket, each pads to a multiple of 3: [E]
    97 x 16 = 1552 parameters to 1554, a block's 2 x 16^2 + 2 x 16 x 8 + 3 x 16 x 48 + 2 x 16 =
    3104 to 3105 (h 4, G 2, F 48), [g, H] 16 + 16 x 97 = 1568 to 1569. Stage 3's largest moment, in its second step, is
    16P/d and two gathered buckets: a block's, and the next one's, prefetched."""
    bench.main(["memory", "--world-size", "3", "--num-layers", "2", "--dim", "16", "--batch-size", "12",
                "--bucket-mb", "0", "--timeout-s", "30"])
    out = capfd.readouterr().out
    rows = re.findall(r"^  (weights|gradients|optimizer state|total) +(\d+) bytes +formula .+?= +(\d+)$",
                      out, re.MULTILINE)
    assert len(rows) == 16 and all(int(got) == int(want) for _, got, want in rows), rows
    totals = [int(got) for kind, got, _ in rows if kind == "total"]
    whole, padded, part = 1552 + 2 * 3104 + 1568, 1554 + 2 * 3105 + 1569, 518 + 2 * 1035 + 523
    assert totals == [16 * whole, 8 * padded + 8 * part, 4 * padded + 12 * part, 16 * part]
    peak = re.search(r"largest at any moment of the last step: (\d+) bytes", out)
    assert int(peak[1]) == totals[3] + 4 * 2 * 3105   # two blocks' buckets whole: one runs, one prefetched


@pytest.mark.deadline(120)
def test_plan_bench_prints_each_layout_predicted_and_measured(capsys):
    """bench.py plan at a tiny size: a row a layout, best measured first, its error the two
    times' as printed, and the last line's summary of them. No time is asserted."""
    import plan_check
    plan_check.bench(["--world-size", "2", "--num-layers", "2", "--dim", "64",
                      "--batch-size", "16", "--steps", "2"])
    lines = capsys.readouterr().out.splitlines()
    row = re.compile(r" +#(\d+) +([\d.]+) ms +#(\d+) +([\d.]+) ms +([+-]\d+)% +(dp\d pp\d tp\d.*)")
    rows = [row.match(line).groups() for line in lines if row.match(line)]
    assert len(rows) >= 3   # dp2, pp2 (each schedule), tp2 (each style)
    measured = [float(r[3]) for r in rows]
    assert measured == sorted(measured) and [int(r[2]) for r in rows] == list(range(1, len(rows) + 1))
    assert sorted(int(r[0]) for r in rows) == list(range(1, len(rows) + 1))
    for r in rows:   # the error from the times as printed, to 0.05 ms each
        predicted, got = float(r[1]), float(r[3])
        slack = 100 * 0.05 * (1 / got + predicted / got**2) + 0.5
        assert abs(100 * (predicted - got) / got - int(r[4])) <= slack, r
    summary = re.match(r"median error (\d+)%, worst ([+-]\d+)%, measured best is predicted #(\d+)$",
                       lines[-1])
    assert summary, lines[-1]
    assert int(summary[3]) == int(rows[0][0])


def test_checkpoint_bench_times_a_step_a_write_and_a_read(capsys):
    """Its table: a step, a write and a read, each a time, the write and read a speed; the
    files it names are the ones a ZeRO-1 3D checkpoint writes (every rank holds its own; tp
    rank 0 alone writes the gains and P, which a read counts once)."""
    bench.main(["checkpoint", "--dp", "2", "--pp", "1", "--tp", "2", "--zero", "1",
                "--num-layers", "4", "--dim", "16", "--batch-size", "16", "--steps", "2"])
    out = capsys.readouterr().out
    assert "; 4 files, " in out, out
    rows = re.findall(r"^  (a training step|write \(fsync'd\)|read \(page cache\)) +([\d.]+)ms +"
                      r"([\d.]+)x *([\d.]*)$", out, re.MULTILINE)
    assert [row[0] for row in rows] == ["a training step", "write (fsync'd)", "read (page cache)"]
    assert all(float(row[1]) > 0 for row in rows) and rows[0][2] == "1.00"
    assert rows[0][3] == "" and all(float(row[3]) > 0 for row in rows[1:])


def bench_lines():
    """Every `tests/bench.py` line of make bench, as its argv, $(BIG) spelled out."""
    with open(os.path.join(ROOT, "Makefile")) as f:
        makefile = f.read()
    big = re.search(r"^BIG = (.*)$", makefile, re.MULTILINE)[1].split()
    lines = re.findall(r"^\t\$\(PYTHON\) tests/bench\.py (.*)$", makefile, re.MULTILINE)
    return [[word for part in line.split() for word in (big if part == "$(BIG)" else [part])]
            for line in lines]


def test_every_line_of_make_bench_passes_its_door():
    """A line the door refuses would stop make bench half-way, after minutes of tables: each
    line's flags go through its script's door and the bench's own rules here, running nothing."""
    lines = bench_lines()
    assert len(lines) >= 35 and ["count-comm", "pipeline_parallel", "--schedule", "interleaved",
                                  "--virtual-stages", "2", "--num-layers", "8",
                                  "--micro-batches", "4"] in lines
    for argv in lines:
        assert callable(bench.parse(argv)), argv          # a refusal raises SystemExit
    with pytest.raises(SystemExit):
        bench.parse(["count-comm", "pipeline_parallel", "--schedule", "interleaved",
                     "--micro-batches", "4"])            # 8 chunks for 4 layers: refused

