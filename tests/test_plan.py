"""Tests for three_d.py --plan: the planner's bytes and memory against real runs, its rows,
its time model on published figures worked by hand here, and its refusals.

- For every (dp, pp, tp) of 4 and 8 ranks, a layout of each flag family (every schedule,
  interleaved with 2 and 4 chunks, each ZeRO stage with one micro-batch and with more,
  Megatron's pairs, --p2p-shard, --recompute, the tp-dp-pp order, --bf16, and all at once)
  runs a step, and what each rank counts (plan_check.count_worker: the bytes it sent on each
  group, what its replica holds at the step's end, its stash at its largest, the most it
  held in the step) equals the planner's row for its stage, exactly. The layout runs from
  the row's own flags, parsed as three_d.py parses them.
- --plan --json on H100 figures: best first, the keys outside checks read, the step's parts
  adding up to it; a pure data-parallel and a pure pipeline layout's step time worked out here
  from the published figures and the formulas.
- The table: as many rows as --top, a line on why the winner wins.
- --hardware cpu times this machine and plans for it.
- Bad input: one line naming the flag, exit 2.
"""
import json
import re

import pytest

import three_d
from plan_check import count_worker
from race import spawn_returning

SMALL = ["--num-layers", "8", "--dim", "16", "--batch-size", "32"]
FIELDS = ("dp", "pp", "tp", "order", "schedule", "virtual_stages", "micro_batches", "zero",
          "tp_style", "p2p_shard", "recompute", "bf16", "num_layers", "dim", "batch_size")


def planned(world_size, bf16=False):
    """The planner's rows for SMALL on a world of two nodes (so that both orders are weighed
    and groups cross nodes), on H100 figures; bf16 as asked."""
    args = three_d.parse_args(["--plan", "--world-size", str(world_size), "--hardware", "h100",
                               "--gpus-per-node", str(world_size // 2), *SMALL])
    args.bf16 = bf16
    machine = three_d.Machine(**three_d.H100, gpus_per_node=world_size // 2, cores=world_size)
    return [three_d.predict(layout, machine) for layout in three_d.layouts(args, world_size // 2)]


PLAIN = dict(order="tp-pp-dp", zero=0, tp_style="all-gather", p2p_shard=False, recompute=False)
FAMILIES = [
    dict(PLAIN, schedule="gpipe"), dict(PLAIN, schedule="1f1b"), dict(PLAIN, schedule="zb-h1"),
    dict(PLAIN, schedule="interleaved", virtual_stages=2),
    dict(PLAIN, schedule="interleaved", virtual_stages=4),
    dict(PLAIN, schedule="1f1b", micro_batches="most"),
    *[dict(PLAIN, zero=zero, micro_batches=m) for zero in (1, 2, 3) for m in ("fewest", "most")],
    dict(PLAIN, tp_style="megatron"), dict(PLAIN, p2p_shard=True),
    dict(PLAIN, recompute=True), dict(PLAIN, recompute=True, schedule="zb-h1"),
    dict(PLAIN, order="tp-dp-pp"),
    dict(zero=3, tp_style="megatron", p2p_shard=True, recompute=True, schedule="interleaved"),
    dict(zero=2, recompute=True, schedule="zb-h1", bf16=True),
    dict(PLAIN, bf16=True),
]


def pick(rows, family):
    """The first row whose layout has every value of family; micro_batches "fewest" or "most"
    of those."""
    want = {key: value for key, value in family.items() if key != "micro_batches"}
    fits = [row for row in rows if all(getattr(row["args"], key) == value
                                       for key, value in want.items())]
    if not fits:
        return None
    how = family.get("micro_batches")
    if how in ("fewest", "most"):
        ms = [row["args"].micro_batches for row in fits]
        m = min(ms) if how == "fewest" else max(ms)
        fits = [row for row in fits if row["args"].micro_batches == m]
    return fits[0]


SHAPES = [(world, dp, pp, world // (dp * pp)) for world in (4, 8)
          for dp in (1, 2, 4, 8) for pp in (1, 2, 4, 8) if world % (dp * pp) == 0]


@pytest.mark.deadline(240)
@pytest.mark.parametrize("world,dp,pp,tp", SHAPES)
def test_planned_bytes_and_memory_are_what_a_run_counts(world, dp, pp, tp):
    rows = [row for row in planned(world) + planned(world, bf16=True)
            if (row["args"].dp, row["args"].pp, row["args"].tp) == (dp, pp, tp)]
    chosen = []
    for family in FAMILIES:
        row = pick(rows, family)
        if row is not None and row not in chosen:
            chosen.append(row)
    assert len(chosen) >= 3, [row["flags"] for row in chosen]
    layouts = []
    for row in chosen:   # the row's flags run its layout: three_d.py parses them to it
        args = three_d.parse_args([*row["flags"].split(), "--timeout-s", "30"])
        assert {key: getattr(args, key) for key in FIELDS} == \
            {key: getattr(row["args"], key) for key in FIELDS}, row["flags"]
        layouts.append(args)
    counted = spawn_returning(count_worker, world, layouts, timeout_s=30)   # [ranks, layouts, 7]
    for j, row in enumerate(chosen):
        for rank in range(world):
            stage, tp_sent, pp_sent, dp_sent, end, stash, in_step = counted[rank, j].tolist()
            want = row["stages"][int(stage)]
            assert {"tp": tp_sent, "pp": pp_sent, "dp": dp_sent} == want["bytes"], \
                (row["flags"], rank)
            assert (end, stash, in_step) == (want["memory"]["held"], want["memory"]["stash"],
                                             want["memory"]["in step"]), (row["flags"], rank)
        assert row["memory_bytes"] == max(sum(stage["memory"].values()) for stage in row["stages"])
        assert row["bytes"] == {group: max(stage["bytes"][group] for stage in row["stages"])
                                for group in ("tp", "pp", "dp")}
    # the families really differ: more than one schedule, ZeRO stage or style among them
    assert len({(row["args"].schedule, row["args"].zero, row["args"].tp_style,
                 row["args"].recompute) for row in chosen}) >= 3


def run_plan(argv, capsys):
    three_d.main(["--plan", *argv])
    return capsys.readouterr().out


def test_json_is_best_first_with_the_keys_outside_checks_read(capsys):
    rows = json.loads(run_plan(["--hardware", "h100", "--world-size", "8", *SMALL, "--json"],
                               capsys))
    assert len(rows) > 100
    steps = [row["step_s"] for row in rows]
    assert steps == sorted(steps)
    for row in rows:
        assert {"flags", "memory_bytes", "bytes", "bubble", "step_s"} <= set(row)
        assert set(row["bytes"]) == {"tp", "pp", "dp"}
        assert 0 <= row["bubble"] < 1 and row["memory_bytes"] <= 80e9
        assert sum(row["parts"].values()) == pytest.approx(row["step_s"], rel=1e-12)
        args = three_d.parse_args(row["flags"].split())   # each runs, as three_d.py reads it
        assert args.dp * args.pp * args.tp == 8 and args.bf16   # H100's figures are bf16's
    assert len({row["flags"] for row in rows}) == len(rows)


def figures_row(argv, flags):
    """The planner's row for one layout, on H100 figures."""
    args = three_d.parse_args(["--plan", "--hardware", "h100", *argv])
    machine = three_d.Machine(**three_d.H100, gpus_per_node=args.gpus_per_node,
                              cores=args.world_size)
    rows = [three_d.predict(layout, machine) for layout in three_d.layouts(args, 8)]
    return next(row for row in rows if row["flags"] == flags)


def test_data_parallel_step_time_from_the_published_figures():
    """8 replicas of 8 layers of D = 1024, B = 64: each rank 8 rows, one micro-batch."""
    L, D, B, d = 8, 1024, 64, 8
    row = figures_row(["--world-size", "8", "--num-layers", str(L), "--dim", str(D),
                       "--batch-size", str(B)],
                      f"--dp 8 --pp 1 --tp 1 --num-layers {L} --dim {D} --batch-size {B} "
                      f"--micro-batches 1 --schedule 1f1b --bf16")
    flops, hbm, alpha = 989e12, 3350e9, 2e-6
    matmul = 2 * (B // d) * D * D / flops
    compute = L * 3 * matmul - matmul                      # F, B, W a layer; no dx for the input
    loss = 4 * (B // d) * D * 4 / hbm
    # the buckets as the replica cuts them from the last layer: 1 MB first (one layer of 4 MB
    # here), then 25 MB at most (six layers)
    layers_left, sizes = L - 1, [D * D * 4]
    while layers_left:
        take = min(layers_left, 25 * 2**20 // (D * D * 4))
        sizes.append(take * D * D * 4)
        layers_left -= take
    all_reduce = sum(2 * (d - 1) * alpha + 2 * (d - 1) / d * size / 480e9 for size in sizes)
    update = L * D * D * 36 / hbm
    assert sizes == [4 * 2**20, 24 * 2**20, 4 * 2**20]
    assert row["step_s"] == pytest.approx(compute + loss + all_reduce + update, rel=1e-9)
    assert row["bubble"] == 0 and row["bytes"]["dp"] == sum(2 * (d - 1) / d * s for s in sizes)


def test_pipeline_step_time_from_the_published_figures():
    """8 stages of one layer each, GPipe, 8 micro-batches: (m + p - 1) slots of a stage's
    F, B and W and its sends, then the update; a middle stage, sending both ways, is the
    slowest (a send takes longer than the last stage's loss)."""
    L, D, B, p, m = 8, 1024, 64, 8, 8
    row = figures_row(["--world-size", "8", "--num-layers", str(L), "--dim", str(D),
                       "--batch-size", str(B)],
                      f"--dp 1 --pp 8 --tp 1 --num-layers {L} --dim {D} --batch-size {B} "
                      f"--micro-batches {m} --schedule gpipe --bf16")
    flops, hbm, alpha, b = 989e12, 3350e9, 2e-6, B // m
    matmul = 2 * b * D * D / flops
    middle = m * 3 * matmul                                # its F, B and W
    sends = 2 * m * (alpha + b * D * 2 / 370e9)            # on and back, bf16
    assert sends / (2 * m) > 4 * b * D * 4 / hbm           # more than the last stage's loss
    bubble = (p - 1) / (m + p - 1)
    update = D * D * 36 / hbm
    assert row["bubble"] == pytest.approx(bubble)
    assert row["step_s"] == pytest.approx((middle + sends) / (1 - bubble) + update, rel=1e-9)
    assert row["bytes"]["pp"] == 2 * m * b * D * 2           # a middle stage: both ways


def test_the_table_has_top_rows_and_says_why(capsys):
    out = run_plan(["--hardware", "h100", "--world-size", "16", *SMALL, "--top", "5"], capsys)
    lines = out.splitlines()
    assert lines[0].startswith("plan: 16 ranks (2 nodes of 8)")
    table = [line for line in lines if re.match(r" *\d+  dp\d", line)]
    assert [int(line.split()[0]) for line in table] == [1, 2, 3, 4, 5]
    assert lines[-1].startswith("why: ") and "beats the best of another shape" in lines[-1]
    assert "*" in out   # groups across the two nodes are marked


@pytest.mark.deadline(120)
def test_cpu_hardware_times_this_machine(capsys):
    rows = json.loads(run_plan(["--world-size", "2", "--num-layers", "2", "--dim", "64",
                                "--batch-size", "16", "--json"], capsys))
    assert rows and all(row["step_s"] > 0 for row in rows)
    for row in rows:   # its parts, each timed here, add up to its step
        assert sum(row["parts"].values()) == pytest.approx(row["step_s"], rel=1e-12)
        assert row["parts"]["compute"] > 0 and row["parts"]["update"] > 0
        dp, tp = int(row["flags"].split()[1]), int(row["flags"].split()[5])
        assert (row["parts"]["dp"] > 0) == (dp > 1) and (row["parts"]["tp"] > 0) == (tp > 1)
    assert {(row["flags"].split()[1], row["flags"].split()[3]) for row in rows} == \
        {("2", "1"), ("1", "2"), ("1", "1")}   # dp2, pp2 and tp2 (pp1, dp1)


@pytest.mark.parametrize("argv,flag", [
    (["--plan", "--dp", "4"], "--dp"),
    (["--plan", "--schedule", "gpipe"], "--schedule"),
    (["--plan", "--flops", "1e15"], "--flops"),
    (["--plan", "--gpus-per-node", "4"], "--gpus-per-node"),
    (["--plan", "--top", "-1"], "--top"),
    (["--plan", "--world-size", "7"], "--world-size"),
    (["--plan", "--hardware", "tpu"], "--hardware"),
    (["--world-size", "8"], "--world-size"),
    (["--json"], "--json"),
    (["--hardware", "h100"], "--hardware"),
])
def test_bad_plan_input_exits_2_with_one_line(argv, flag, capsys):
    with pytest.raises(SystemExit) as exited:
        three_d.main(argv)
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert len(captured.err.splitlines()) == 1 and flag in captured.err, captured.err
    assert captured.out == ""
