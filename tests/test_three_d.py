"""Tests for three_d.py: the rank map, and 3D training against serial training.

- rank_groups() for every factorization dp x pp x tp of world sizes 1..12, in both
  orders, against the layout computed here with plain loops; membership (every rank
  in each of its own groups, at the position of its coordinate: a well-known rank-group utility
  got 6 of 8 ranks wrong); the hard-coded 2x2x2 map and the documented tp-dp-pp groups.
- --show-rank-map prints that table and starts no rank.
- Training (three_d.main in-process, ranks forked from here) against
  data_parallel.serial_train over nine layouts, both schedules, both orders,
  --p2p-shard, SGD and AdamW, micro-batches 1 to 4; dp=2 against dp=1.
- Bad flags: one line on stderr naming the flag, exit 2, no rank started.
- `make 3d`'s command as a subprocess, its first 4 steps; serial training at its defaults learns.
"""
import argparse
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import data_parallel as dp
import three_d
from collectives import RankFailed
from common import (NO_SAMPLE, serial_train, assert_follows_the_contract, assert_check_passed, assert_clipped_some, assert_same_bits, assert_same_training, check_report, final_params, init_of,
                    clip_between)

REPO = Path(__file__).resolve().parent.parent

# Float32, differences only from summation order (all-reduce, all-gather, micro-batches).
ATOL = 1e-5
RTOL = 1e-5

TIMEOUT = ["--timeout-s", "15"]   # a deadlock fails the run in 15 s, not the default 60
KINDS = ("dp", "pp", "tp")
ORDERS = ("tp-pp-dp", "tp-dp-pp")


# ----------------------------------------------------------------------------------
# 1. The rank map, computed independently here
# ----------------------------------------------------------------------------------

def factorizations(world_size):
    return [(d, p, world_size // (d * p)) for d in range(1, world_size + 1) for p in range(1, world_size + 1)
            if world_size % (d * p) == 0]


ALL_LAYOUTS = [layout for w in range(1, 13) for layout in factorizations(w)]


def expected_rank(d, p, t, sizes, order):
    """The rank at coordinates (d, p, t), from the rank formulas, no tensors:
    tp-pp-dp is arange(W).view(dp, pp, tp): rank = (d PP + p) TP + t;
    tp-dp-pp is arange(W).view(pp, dp, tp): rank = (p DP + d) TP + t."""
    dp_size, pp_size, tp_size = sizes
    if order == "tp-pp-dp":
        return (d * pp_size + p) * tp_size + t
    assert order == "tp-dp-pp"
    return (p * dp_size + d) * tp_size + t


def expected_groups(sizes, order):
    """{kind: {coordinates of the other two axes: ranks along the kind's axis}}, by loops."""
    dp_size, pp_size, tp_size = sizes
    r = lambda d, p, t: expected_rank(d, p, t, sizes, order)  # noqa: E731
    return {
        "tp": [[r(d, p, t) for t in range(tp_size)] for d in range(dp_size) for p in range(pp_size)],
        "pp": [[r(d, p, t) for p in range(pp_size)] for d in range(dp_size) for t in range(tp_size)],
        "dp": [[r(d, p, t) for d in range(dp_size)] for p in range(pp_size) for t in range(tp_size)],
    }


def test_layouts_cover_every_factorization():
    """The list the next tests run over really is every (dp, pp, tp) of 1..12."""
    assert len(ALL_LAYOUTS) == sum(len(list(f)) for f in map(factorizations, range(1, 13)))
    for w in range(1, 13):
        brute = {(a, b, c) for a, b, c in itertools.product(range(1, w + 1), repeat=3) if a * b * c == w}
        assert set(factorizations(w)) == brute


@pytest.mark.parametrize("order", ORDERS)
def test_rank_groups_for_every_factorization(order):
    for sizes in ALL_LAYOUTS:
        world_size = sizes[0] * sizes[1] * sizes[2]
        groups = three_d.rank_groups(*sizes, order=order)
        want = expected_groups(sizes, order)
        assert set(groups) == set(KINDS), sizes
        for kind, size in zip(KINDS, sizes):
            where = f"{kind} groups at dp={sizes[0]} pp={sizes[1]} tp={sizes[2]} {order}"
            # a partition of range(W): every rank exactly once, groups of the axis' size
            flat = [rank for group in groups[kind] for rank in group]
            assert sorted(flat) == list(range(world_size)), where
            assert len(groups[kind]) == world_size // size, where
            assert all(len(group) == size for group in groups[kind]), where
            # each group in ascending rank order
            assert all(group == sorted(group) for group in groups[kind]), where
            # the same groups as arange(W).view(...) read along that axis
            assert sorted(groups[kind]) == sorted(want[kind]), where


@pytest.mark.parametrize("order", ORDERS)
def test_every_rank_is_in_each_of_its_own_groups(order):
    """Membership, the test a well-known rank-group utility fails: the rank at (d, p, t) is in the group
    that varies one coordinate and fixes the other two, at the position of its own
    coordinate, and coordinates() returns (d, p, t)."""
    for sizes in ALL_LAYOUTS:
        dp_size, pp_size, tp_size = sizes
        groups = three_d.rank_groups(*sizes, order=order)
        for d, p, t in itertools.product(range(dp_size), range(pp_size), range(tp_size)):
            rank = expected_rank(d, p, t, sizes, order)
            where = f"rank {rank} at dp={dp_size} pp={pp_size} tp={tp_size} {order}"
            mine = {}
            for kind in KINDS:
                holding = [g for g in groups[kind] if rank in g]
                assert len(holding) == 1, where
                mine[kind] = holding[0]
            assert mine["tp"] == [expected_rank(d, p, x, sizes, order) for x in range(tp_size)], where
            assert mine["pp"] == [expected_rank(d, x, t, sizes, order) for x in range(pp_size)], where
            assert mine["dp"] == [expected_rank(x, p, t, sizes, order) for x in range(dp_size)], where
            assert (mine["dp"].index(rank), mine["pp"].index(rank), mine["tp"].index(rank)) == (d, p, t), where
            # the three groups of a rank meet in that rank alone
            assert set(mine["dp"]) & set(mine["pp"]) & set(mine["tp"]) == {rank}, where
            assert set(mine["dp"]) & set(mine["tp"]) == {rank} and set(mine["pp"]) & set(mine["tp"]) == {rank}
            assert three_d.coordinates(rank, groups) == (d, p, t), where


def test_default_order_coordinates_follow_the_formula():
    """coordinates(rank) with the default order: rank = (d PP + p) TP + t."""
    for dp_size, pp_size, tp_size in ALL_LAYOUTS:
        groups = three_d.rank_groups(dp_size, pp_size, tp_size)   # the default order
        for rank in range(dp_size * pp_size * tp_size):
            d, p, t = three_d.coordinates(rank, groups)
            assert 0 <= d < dp_size and 0 <= p < pp_size and 0 <= t < tp_size
            assert (d * pp_size + p) * tp_size + t == rank, (dp_size, pp_size, tp_size, rank)


def test_2x2x2_default_is_the_seed_map():
    assert three_d.rank_groups(2, 2, 2) == three_d.HARD_CODED_MAP_2x2x2
    assert three_d.rank_groups(2, 2, 2, order="tp-pp-dp") == three_d.HARD_CODED_MAP_2x2x2
    # ...and the hard-coded map itself is the formula's
    assert three_d.HARD_CODED_MAP_2x2x2 == {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
                                      "pp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                                      "dp": [[0, 4], [1, 5], [2, 6], [3, 7]]}


def test_2x2x2_tp_dp_pp_puts_the_pipeline_outermost():
    groups = three_d.rank_groups(2, 2, 2, order="tp-dp-pp")
    assert groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]   # pipeline outermost
    assert groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]   # pipeline outermost
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]   # TP innermost in both orders


# ----------------------------------------------------------------------------------
# 2. --show-rank-map
# ----------------------------------------------------------------------------------

def no_ranks(monkeypatch):
    """Record any start of a rank or a process group (the tests assert there is none)."""
    started = []
    monkeypatch.setattr(three_d, "spawn", lambda *a, **k: started.append(("spawn", a)))
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: started.append(("init_process_group", a)))
    return started


ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\[[\d, ]*\])\s*(\[[\d, ]*\])\s*(\[[\d, ]*\])\s*$")


@pytest.mark.parametrize("sizes,order", [((2, 2, 2), "tp-pp-dp"), ((3, 2, 2), "tp-dp-pp"),
                                         ((1, 1, 1), "tp-pp-dp"), ((2, 3, 1), "tp-pp-dp")])
def test_show_rank_map_prints_the_table_and_starts_no_rank(sizes, order, monkeypatch, capsys):
    started = no_ranks(monkeypatch)
    dp_size, pp_size, tp_size = sizes
    three_d.main(["--show-rank-map", "--dp", str(dp_size), "--pp", str(pp_size), "--tp", str(tp_size),
                  "--order", order, *TIMEOUT])
    assert started == []
    out = capsys.readouterr().out.splitlines()
    assert f"dp={dp_size} pp={pp_size} tp={tp_size}" in out[0] and order in out[0]
    header = out[1].split()
    assert header[:4] == ["rank", "dp", "pp", "tp"]
    columns = [word for word in header[4:] if word != "group"]   # the order of the group columns
    assert sorted(columns) == sorted(KINDS)
    rows = [ROW.match(line) for line in out[2:]]
    assert all(rows) and len(rows) == dp_size * pp_size * tp_size
    want = expected_groups(sizes, order)
    for rank, row in enumerate(rows):
        assert int(row[1]) == rank
        d, p, t = int(row[2]), int(row[3]), int(row[4])
        assert expected_rank(d, p, t, sizes, order) == rank
        for kind, text in zip(columns, row.groups()[4:]):
            group = json.loads(text)   # "[0, 4]": the rank's own group of that kind
            assert rank in group and group in want[kind], (rank, kind, text)


# ----------------------------------------------------------------------------------
# 3, 4. 3D training against serial autograd training
# ----------------------------------------------------------------------------------

def run_3d(tmp_path, dp_size, pp_size, tp_size, schedule="1f1b", order="tp-pp-dp", p2p_shard=False,
           micro_batches=2, dim=16, num_layers=4, batch_size=16, steps=2, optimizer="sgd", lr=None, seed=3,
           tp_style="all-gather", zero=0, bucket_mb=25, heads=8, sequence_parallel=False, kv_heads=None,
           qk_norm=False, flags=()):
    """three_d.main in-process (ranks forked from here); return the --save dict. SGD's lr 1: the
    weights move well past the tolerance in two steps."""
    lr = lr or (1.0 if optimizer == "sgd" else 0.01)
    save = tmp_path / "run.pt"
    three_d.main(["--dp", str(dp_size), "--pp", str(pp_size), "--tp", str(tp_size), "--tp-style", tp_style,
                  "--zero", str(zero), "--bucket-mb", str(bucket_mb),
                  "--schedule", schedule, "--order", order, *(["--p2p-shard"] if p2p_shard else []),
                  *(["--sequence-parallel"] if sequence_parallel else []),
                  *(["--kv-heads", str(kv_heads)] if kv_heads else []), *(["--qk-norm"] if qk_norm else []),
                  "--micro-batches", str(micro_batches), "--dim", str(dim), "--context", "4", "--heads", str(heads),
                  "--num-layers", str(num_layers),
                  "--batch-size", str(batch_size), "--steps", str(steps), "--optimizer", optimizer,
                  "--lr", str(lr), "--seed", str(seed), "--save", str(save), *TIMEOUT, *NO_SAMPLE, *flags])
    return torch.load(save)


def serial_reference(result):
    return serial_train(argparse.Namespace(**result["config"]))


def assert_trained(result):
    """The weights moved far past the tolerance, so a wrong gradient scale would show."""
    moved = max((f - i).abs().max().item() for f, i in zip(final_params(result), init_of(result)))
    assert moved > 100 * ATOL


# (dp, pp, tp), then the options. Not the full cross product: (2,2,2) runs every
# schedule x order; the rest spread the schedules, orders, --p2p-shard (tp > 1 and
# tp = 1), micro-batches 1 and 4 (> pp at (1,2,4), < pp under 1F1B at (1,8,1)) and AdamW.
CASES = [
    ((1, 1, 1), dict(schedule="gpipe", micro_batches=1)),
    ((2, 2, 2), dict(schedule="gpipe", order="tp-pp-dp")),
    ((2, 2, 2), dict(schedule="1f1b", order="tp-pp-dp", p2p_shard=True)),
    ((2, 2, 2), dict(schedule="gpipe", order="tp-dp-pp", p2p_shard=True)),
    ((2, 2, 2), dict(schedule="1f1b", order="tp-dp-pp")),
    ((2, 1, 4), dict(schedule="1f1b", order="tp-dp-pp")),
    ((1, 2, 4), dict(schedule="gpipe", p2p_shard=True, micro_batches=4)),
    ((4, 2, 1), dict(schedule="1f1b", order="tp-dp-pp")),   # --p2p-shard needs tp > 1: refused
    ((1, 4, 2), dict(schedule="gpipe", micro_batches=4, p2p_shard=True, dim=32)),
    ((8, 1, 1), dict(schedule="gpipe", order="tp-dp-pp", micro_batches=1)),
    ((1, 1, 8), dict(schedule="1f1b", order="tp-dp-pp", dim=32, optimizer="adamw", lr=0.01, num_layers=8)),
    ((1, 8, 1), dict(schedule="1f1b", micro_batches=4, steps=3, num_layers=8)),   # m < pp: 1F1B's warm-up cut to m
    # Megatron's pairs: 2x2x2, 1x2x4 and 2x1x4 over both schedules, both orders, with and
    # without --p2p-shard; AdamW; and 3 layers a stage, a pair and an all-gather layer each
    ((2, 2, 2), dict(tp_style="megatron", schedule="1f1b", order="tp-pp-dp")),
    ((2, 2, 2), dict(tp_style="megatron", schedule="gpipe", order="tp-dp-pp", p2p_shard=True)),
    ((1, 2, 4), dict(tp_style="megatron", schedule="gpipe", order="tp-pp-dp", p2p_shard=True)),
    ((1, 2, 4), dict(tp_style="megatron", schedule="1f1b", order="tp-dp-pp")),
    ((2, 1, 4), dict(tp_style="megatron", schedule="1f1b", order="tp-dp-pp")),   # and pp > 1
    ((2, 1, 4), dict(tp_style="megatron", schedule="gpipe", optimizer="adamw", lr=0.01)),
    ((1, 2, 2), dict(tp_style="megatron", num_layers=6, micro_batches=4)),
    # ZeRO over each dp group, on the TP shards of each stage: every stage at 2x2x2 and 4x2x1
    ((2, 2, 2), dict(zero=1, optimizer="adamw", lr=0.01)),
    ((2, 2, 2), dict(zero=2, schedule="gpipe", order="tp-dp-pp", tp_style="megatron")),
    ((2, 2, 2), dict(zero=3, p2p_shard=True, optimizer="adamw", lr=0.01)),
    ((4, 2, 1), dict(zero=1, micro_batches=1, order="tp-dp-pp")),
    ((4, 2, 1), dict(zero=2, micro_batches=1, optimizer="adamw", lr=0.01)),
    ((4, 2, 1), dict(zero=3, micro_batches=1, schedule="gpipe")),
    # ZB-H1 and interleaved at 2x2x2 and 1x4x2, both orders, with and without --p2p-shard
    ((2, 2, 2), dict(schedule="zb-h1", order="tp-pp-dp")),
    ((2, 2, 2), dict(schedule="zb-h1", order="tp-dp-pp", p2p_shard=True, optimizer="adamw", lr=0.01)),
    ((1, 4, 2), dict(schedule="zb-h1", order="tp-dp-pp", micro_batches=4)),
    ((1, 4, 2), dict(schedule="zb-h1", p2p_shard=True, micro_batches=4, zero=3)),
    ((2, 2, 2), dict(schedule="interleaved", order="tp-pp-dp", p2p_shard=True)),
    ((2, 2, 2), dict(schedule="interleaved", order="tp-dp-pp", tp_style="megatron", optimizer="adamw", lr=0.01)),
    ((1, 4, 2), dict(schedule="interleaved", order="tp-dp-pp", p2p_shard=True, micro_batches=4, num_layers=8)),
    ((1, 4, 2), dict(schedule="interleaved", micro_batches=8, batch_size=32, zero=2, num_layers=8)),
    # buckets over the dp group: a layer each, two layers (of 16 x 16 / tp floats), the whole
    # stage (25 MB); padded where dp does not divide a bucket; never across a chunk
    ((2, 2, 2), dict(zero=0, bucket_mb=0)),
    ((2, 2, 2), dict(zero=3, bucket_mb=0.001, schedule="interleaved", p2p_shard=True)),
    ((2, 2, 2), dict(zero=3, bucket_mb=0, schedule="zb-h1", tp_style="megatron")),
    ((3, 2, 1), dict(zero=1, batch_size=12)),
    ((3, 2, 1), dict(zero=2, bucket_mb=0.002, batch_size=12, micro_batches=1)),
    ((3, 2, 1), dict(zero=3, bucket_mb=0.002, batch_size=12)),   # AdamW: elements near eps
    # sequence parallelism: T = 4 over tp 2 and 4, each ZeRO stage (the gains' sum before the
    # dp exchange), every schedule, --p2p-shard (the T/tp rows cross as they are)
    ((2, 2, 2), dict(tp_style="megatron", sequence_parallel=True)),
    ((1, 2, 4), dict(tp_style="megatron", sequence_parallel=True, schedule="gpipe", p2p_shard=True,
                     micro_batches=4)),
    ((2, 1, 4), dict(tp_style="megatron", sequence_parallel=True, zero=1, bucket_mb=0)),
    ((2, 2, 2), dict(tp_style="megatron", sequence_parallel=True, zero=2, schedule="zb-h1",
                     order="tp-dp-pp")),
    ((2, 2, 2), dict(tp_style="megatron", sequence_parallel=True, zero=3, schedule="interleaved",
                     optimizer="adamw", lr=0.01)),
    # the Llama block's splits: kv heads fewer than tp (each on the tp/G ranks that read it, its
    # Wk, Wv summed over them before the dp exchange), QK-norm's gains summed over tp (at dh 4:
    # a norm over dh 2 cancels most of its terms, and float32's rounding shows at 1e-5)
    ((2, 1, 4), dict(heads=4, kv_heads=2, qk_norm=True, zero=1, tp_style="megatron")),
    ((1, 2, 4), dict(kv_heads=1, tp_style="megatron", sequence_parallel=True, zero=3, bucket_mb=0)),
    ((2, 2, 2), dict(heads=4, kv_heads=1, qk_norm=True, schedule="interleaved", p2p_shard=True)),
]


@pytest.mark.parametrize("sizes,options", CASES, ids=lambda c: "x".join(map(str, c)) if isinstance(c, tuple)
                         else "-".join(f"{v}" if k != "p2p_shard" else "shard" for k, v in c.items() if v))
def test_3d_matches_serial(tmp_path, capfd, sizes, options):
    """SGD: the whole run against serial training's. AdamW, whose eps turns the summation order
    of a gradient near 0 into a step (one element of 1,024 once moved 1.07e-5): --check, a step
    at a time from the run's own weights."""
    check = ("--check",) if options.get("optimizer") == "adamw" else ()
    result = run_3d(tmp_path, *sizes, **options, flags=check)
    config = result["config"]
    assert (config["dp"], config["pp"], config["tp"]) == sizes
    assert all(config[k] == v for k, v in options.items())
    assert_follows_the_contract(result)
    if check:
        assert_check_passed(capfd.readouterr().out, dp.CHECK_TOLERANCE)
    else:
        assert_same_training(result, serial_reference(result))
    assert_trained(result)


@pytest.mark.parametrize("sizes", [dict(num_layers=2, dim=8, batch_size=8), dict()])
def test_check_catches_a_doubled_weight_gradient_under_adamw(monkeypatch, capfd, sizes):
    """AdamW's normalisation hides a gradient off by a constant: its final weights moved
    only 2e-6 here once. --check compares the first step's gradients too, and fails at
    any size, the smallest and the defaults (make 3d's)."""
    real = dp.DataParallel.add_grads
    monkeypatch.setattr(dp.DataParallel, "add_grads",
                        lambda self, part, terms: real(self, part, [(x, 2 * dz) for x, dz in terms]))
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in sizes.items()]
    with pytest.raises(RankFailed) as failed:
        three_d.main(["--check", "--optimizer", "adamw", "--steps", "3", *argv, *TIMEOUT])
    assert failed.value.stopped == "check FAILED: this run differs from serial autograd training (see above)"
    figures, verdict = check_report(capfd.readouterr().out)
    assert verdict == "FAILED"
    assert 0.5 < figures["gradients"][0] <= 1.0   # 2 g - g = g, of its terms (at least g)
    assert figures["gradients"][2] == "FAILED"


def test_dp2_equals_dp1_so_the_gradient_is_averaged_once(tmp_path):
    """Two replicas on halves of the batch take the same step as one replica on all of it:
    the gradient is divided by dp once, not zero times or once per micro-batch. Order
    tp-dp-pp makes a replica's DP coordinate differ from its global rank, so slicing by
    the global rank (a classic bug) would train on the wrong rows."""
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    common = dict(schedule="1f1b", order="tp-dp-pp", micro_batches=2, batch_size=16, steps=3)
    one = run_3d(tmp_path / "one", 1, 2, 2, **common)
    two = run_3d(tmp_path / "two", 2, 2, 2, **common)
    assert_trained(one)
    assert_same_training(two, one)
    assert_same_training(two, serial_reference(two))
    # dp=2 under tp-dp-pp: replica 1 holds ranks 2, 3, 6, 7, none of them rank 1
    groups = three_d.rank_groups(2, 2, 2, order="tp-dp-pp")
    assert {r for r in range(8) if three_d.coordinates(r, groups)[0] == 1} == {2, 3, 6, 7}


# ----------------------------------------------------------------------------------
# 5. Bad input
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,flag", [
    (["--dp", "0"], "--dp"),
    (["--tp", "-1"], "--tp"),
    (["--pp", "x"], "--pp"),
    (["--dim", "30", "--tp", "4"], "--dim"),
    (["--num-layers", "6", "--pp", "4"], "--num-layers"),
    (["--pp", "16", "--num-layers", "8"], "--pp"),
    (["--batch-size", "12", "--dp", "2", "--micro-batches", "4"], "--batch-size"),
    (["--order", "foo"], "--order"),
    (["--schedule", "bar"], "--schedule"),
    (["--tp-style", "rowwise"], "--tp-style"),
    (["--zero", "4"], "--zero"),
])
def test_bad_input_exits_2_with_one_line(argv, flag, monkeypatch, capsys):
    started = no_ranks(monkeypatch)
    with pytest.raises(SystemExit) as exited:
        three_d.main([*argv, *TIMEOUT])
    assert exited.value.code == 2
    captured = capsys.readouterr()
    err = captured.err
    assert len(err.splitlines()) == 1 and err.endswith("\n"), err
    assert flag in err and "error" in err and "Traceback" not in err
    assert captured.out == ""
    assert started == []


def test_world_size_mismatch_under_torchrun_exits_2_before_any_rank(monkeypatch, capsys):
    started = no_ranks(monkeypatch)
    for name, value in dict(RANK="0", WORLD_SIZE="4", LOCAL_RANK="0", LOCAL_WORLD_SIZE="4",
                            MASTER_ADDR="127.0.0.1", MASTER_PORT="29500").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited:
        three_d.main(["--dp", "2", "--pp", "2", "--tp", "2", *TIMEOUT])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "--dp" in err and "--pp" in err and "--tp" in err
    assert "8" in err and "4" in err            # what the sizes need, what torchrun started
    assert started == []
    assert not dist.is_initialized()


# ----------------------------------------------------------------------------------
# 6. `make 3d`: the defaults with --check, as a subprocess
# ----------------------------------------------------------------------------------

def without_numpy(tmp_path):
    """A folder to put first on PYTHONPATH: in it, `import numpy` fails as on a fresh machine."""
    (tmp_path / "numpy").mkdir()
    (tmp_path / "numpy" / "__init__.py").write_text('raise ModuleNotFoundError("No module named \'numpy\'")\n')
    check = subprocess.run([sys.executable, "-c", "import numpy"], env={**os.environ, "PYTHONPATH": str(tmp_path)},
                           capture_output=True, text=True)
    assert check.returncode == 1 and "No module named 'numpy'" in check.stderr
    return str(tmp_path)


LOSS_LINE = re.compile(r"^\[dp0 pp(\d+) tp0\] step\s+(\d+)\s+loss ([0-9.eE+-]+)$")
VALIDATION = re.compile(r"^validation loss ([\d.]+) nats a character, on (\d+) windows of \d+ of CPython's help")
BASELINES = re.compile(r"^  the text's own: uniform ln 97 = ([\d.]+), unigram ([\d.]+), bigram ([\d.]+)")


VALIDATION_WINDOWS = 256     # show_language_model's rows: the windows it prints its loss on


def validation_loss(config, params):
    """The loss of these weights on the validation windows the script prints its own on."""
    val_args = argparse.Namespace(**{**config, "batch_size": VALIDATION_WINDOWS})
    inputs, targets = dp.make_batch(val_args, step=0, text=dp.text_part("validation"))
    return dp.serial_loss(params, inputs, targets, argparse.Namespace(**config))[0].item()


@pytest.mark.deadline(120)
def test_make_3d_defaults_pass_check_and_learn_the_text(tmp_path):
    """`make 3d`'s command (8 ranks, 2 blocks) for its first 4 of 180 steps, on a machine
    without numpy, which torch does not depend on: --check passes with nothing on stderr, the
    printed losses are serial training's, the printed validation loss is its weights', and a
    sample follows the prompt. Serial training at the same defaults, all 180 steps, falls below
    1.9 nats (the text's bigram entropy 2.46, Bengio's MLP's 2.13). (make 3d's whole run is
    CI's, which holds its printed loss below 1.9 too: .ci/run.)"""
    save = tmp_path / "run.pt"
    env = {**os.environ, "PYTHONPATH": without_numpy(tmp_path)}
    proc = subprocess.run([sys.executable, "three_d.py", "--check", "--steps", "4", "--save", str(save), *TIMEOUT],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""        # not even torch's warning that numpy is missing
    lines = proc.stdout.splitlines()
    result = torch.load(save)
    config = result["config"]
    assert (config["dp"], config["pp"], config["tp"], config["steps"], config["num_layers"]) == (2, 2, 2, 4, 2)
    assert "rank map: dp=2 pp=2 tp=2" in proc.stdout
    assert sum(line.split()[:4] == ["rank", "dp", "pp", "tp"] for line in lines) == 1

    # a loss line every step of a short run (a longer run's cadence: test_the_loss_is_logged_every_
    # step_to_20_then_every_tenth_and_the_last), printed by the last stage; serial training's
    steps = [LOSS_LINE.match(line) for line in lines if LOSS_LINE.match(line)]
    assert [int(m[2]) for m in steps] == [0, 1, 2, 3]
    assert all(int(m[1]) == config["pp"] - 1 for m in steps)
    printed = [float(m[3]) for m in steps]
    assert printed == [pytest.approx(result["losses"][int(m[2])], abs=5e-7) for m in steps]   # as saved
    whole = serial_train(argparse.Namespace(**{**config, "steps": three_d.parse_args([]).steps}))
    assert len(whole["losses"]) == 180
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(whole["losses"][:4]),
                               atol=2e-5, rtol=1e-5)

    validation = [VALIDATION.match(line) for line in lines if VALIDATION.match(line)]
    baselines = [BASELINES.match(line) for line in lines if BASELINES.match(line)]
    assert len(validation) == len(baselines) == 1
    assert int(validation[0][2]) == VALIDATION_WINDOWS
    uniform, unigram, bigram = (float(x) for x in baselines[0].groups())
    assert (uniform, unigram, bigram) == (4.57, 3.25, 2.46)        # the text's, on 3.11
    assert float(validation[0][1]) == pytest.approx(validation_loss(config, final_params(result)), abs=1e-3)
    learned = validation_loss(config, final_params(whole))
    assert learned < 1.9 < bigram < unigram < uniform              # below Bengio's MLP's 2.13 too
    at = lines.index(next(line for line in lines if line.startswith("a sample, 200 characters")))
    assert lines[at + 1].startswith("The ")
    assert sum(len(line) + 1 for line in lines[at + 1:] if not line.startswith("check")) > 150

    figures, verdict = check_report(proc.stdout)
    assert verdict == "OK"
    assert figures["gradients"][0] <= 1e-5 and figures["losses"][0] <= 1e-5   # summation order alone
    assert figures["weights after an update"][0] <= 2**-20                    # one step's roundings


@pytest.mark.parametrize("steps, logged", [(20, list(range(20))), (30, [*range(0, 30, 3), 29]),
                                           (205, [*range(0, 205, 20), 204])])
def test_the_loss_is_logged_every_step_to_20_then_every_tenth_and_the_last(steps, logged, capsys):
    args = argparse.Namespace(steps=steps, clip_grad=None)
    for step in range(steps):
        dp.log_step("[rank 0]", step, [1.0], [], args)
    printed = [int(line.split()[3]) for line in capsys.readouterr().out.splitlines()]
    assert printed == logged


# ----------------------------------------------------------------------------------
# What real training adds: one clip across every shard, recompute, bf16
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("sizes,options", [
    ((2, 2, 2), dict()),
    ((2, 2, 2), dict(zero=3, tp_style="megatron", p2p_shard=True)),
    ((1, 4, 2), dict(schedule="interleaved", micro_batches=4, zero=2)),
    ((4, 2, 1), dict(zero=1, micro_batches=1, order="tp-dp-pp")),
], ids=str)
def test_clip_grad_covers_every_shard_once(tmp_path, capfd, sizes, options):
    """The global norm: squares summed over tp (disjoint shards) and pp (other stages), and
    over dp only under ZeRO (the replicas hold the same average otherwise), each once."""
    config = dict(num_layers=8, dim=16, heads=8, context=4, batch_size=16, seed=3, optimizer="sgd", lr=1.0,
                  steps=3)
    clip = clip_between(config)
    result = run_3d(tmp_path, *sizes, **options, steps=3, num_layers=config["num_layers"],
                    flags=("--clip-grad", str(clip)))
    assert_clipped_some(capfd.readouterr().out)
    assert result["config"]["clip_grad"] == clip
    assert_same_training(result, serial_reference(result))


def test_recompute_is_bitwise_the_same_in_3d(tmp_path):
    """Megatron's pairs, ZB-H1, ZeRO-3, --p2p-shard: the recomputed forward repeats the
    forward's all-gathers and all-reduces, and rebuilds the same stash, bit for bit."""
    runs = []
    for recompute in ((), ("--recompute",)):
        folder = tmp_path / str(bool(recompute))
        folder.mkdir()
        runs.append(run_3d(folder, 2, 2, 2, schedule="zb-h1", tp_style="megatron", zero=3, p2p_shard=True,
                           micro_batches=4, flags=recompute))
    assert_same_bits(*runs)


def test_bf16_in_3d_checks_within_its_tolerance(tmp_path, capfd):
    run_3d(tmp_path, 2, 2, 2, tp_style="megatron", zero=1, p2p_shard=True, steps=4,
           flags=("--bf16", "--check", "--recompute"))
    # within the largest the check allows: the loss's, through every part's forward (L = 4)
    assert_check_passed(capfd.readouterr().out, dp.bf16_tolerance(tp_size=2, layers_above=5))
