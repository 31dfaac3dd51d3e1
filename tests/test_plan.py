"""Tests for three_d.py --plan: what it counts against real runs and the GPU path's record, its
prices against the published figures and physics, its table, and its refusals.

- For every (dp, pp, tp) of 8 ranks, a layout of each flag family runs a step, and what
  each rank counts (plan_check.count_worker: the bytes it sent on each group, what its replica
  holds at the step's end, its stash at its largest, the most it held in the step) equals the
  planner's figures for its stage, exactly.
- A row's FLOPs by dtype and matmul bytes are what a rank of its stage executes, recorded by
  tests/gpu_path.py on the meta device, at 8 and 1,024 GPUs; its memory, within 15% of what a
  recorded step holds (its state, and what the step allocates at its most).
- A matmul costs its FLOPs at the peak a GEMM of its shape reaches or its bytes at HBM's speed,
  whichever is longer; a collective, at each published size, the time nccl-tests measured.
- No row, on several models and worlds, is faster than its matmuls' FLOPs and HBM traffic allow
  at the best GEMM measured, nor has an MFU above it.
- The table's rows and columns; --hardware cpu is gone: this machine's model lives in
  tests/plan_machine.py, and prices every layout of 2 ranks.
- Bad input: one line naming the flag, exit 2; nothing fitting: one line, exit 1.
"""
import functools
import re
import subprocess
import sys

import pytest

import data_parallel
import pipeline_parallel
import tensor_parallel
import three_d
from gpu_path import gpu_node_args, rank_matmuls, run_step
from plan_check import count_worker, layout_flags
from plan_machine import this_machine
from race import spawn_returning
from race import ROOT as REPO

SMALL = ["--num-layers", "8", "--dim", "16", "--heads", "8", "--context", "4", "--batch-size", "32",
         "--optimizer", "sgd"]   # a step
MODEL = ["--num-layers", "32", "--dim", "4096", "--heads", "32", "--context", "8192", "--batch-size", "64"]   # Llama 3 8B's shape
FIELDS = ("dp", "pp", "tp", "order", "schedule", "virtual_stages", "micro_batches", "zero",
          "tp_style", "p2p_shard", "sequence_parallel", "recompute", "bf16", "num_layers", "dim", "heads",
          "context", "batch_size")
H100 = three_d.GPUS["h100"]


def plan_rows(argv, gpus_per_node=8, bf16=True):
    """The planner's rows for a model and world on H100 figures."""
    args = three_d.parse_args(["--plan", "--gpus-per-node", str(gpus_per_node), *argv])
    args.bf16 = bf16
    machine = three_d.Machine(H100, gpus_per_node)
    return [three_d.predict(layout, machine) for layout in three_d.layouts(args, gpus_per_node)]


@functools.lru_cache(maxsize=None)
def planned(world_size, bf16=False, num_layers=8):
    """SMALL's rows on a world of two nodes (so that both orders are weighed and groups cross
    nodes); bf16 as asked."""
    return plan_rows(["--world-size", str(world_size), *SMALL, "--num-layers", str(num_layers)],
                     world_size // 2, bf16)


PLAIN = dict(order="tp-pp-dp", zero=0, tp_style="all-gather", p2p_shard=False, recompute=False,
             sequence_parallel=False)
FAMILIES = [
    dict(PLAIN, schedule="gpipe"), dict(PLAIN, schedule="1f1b"), dict(PLAIN, schedule="zb-h1"),
    dict(PLAIN, schedule="interleaved", virtual_stages=2),
    dict(PLAIN, schedule="interleaved", virtual_stages=4),
    dict(PLAIN, schedule="1f1b", micro_batches="more"),
    dict(PLAIN, zero=1),    # its exchange is once a step at any m; ZeRO-2's and 3's vary with m
    *[dict(PLAIN, zero=zero, micro_batches=m) for zero in (2, 3) for m in ("fewest", "more")],
    dict(PLAIN, tp_style="megatron"), dict(PLAIN, p2p_shard=True),
    dict(PLAIN, recompute=True), dict(PLAIN, recompute=True, schedule="zb-h1"),
    dict(PLAIN, order="tp-dp-pp"),
    dict(zero=3, tp_style="megatron", p2p_shard=True, recompute=True, schedule="interleaved"),
    dict(zero=2, recompute=True, schedule="zb-h1", bf16=True),
    dict(zero=3, sequence_parallel=True, recompute=True), dict(zero=1, sequence_parallel=True),
    dict(PLAIN, bf16=True),
]


def pick(rows, family):
    """The first row whose layout has every value of family; micro_batches "fewest" or "more"
    of those (the next number up, 2 p: more than one, and more than the stages)."""
    want = {key: value for key, value in family.items() if key != "micro_batches"}
    fits = [row for row in rows if all(getattr(row["args"], key) == value
                                       for key, value in want.items())]
    if not fits:
        return None
    how = family.get("micro_batches")
    if how in ("fewest", "more"):
        ms = sorted({row["args"].micro_batches for row in fits})   # p, 2 p, 4 p, 8 p
        m = ms[0]
        if how == "more" and len(ms) > 1:
            m = ms[1]
        fits = [row for row in fits if row["args"].micro_batches == m]
    return fits[0]


def stage_costs(args, stage, tp_rank=0):
    """The plan's figures for a rank of this stage (and tp rank: its classes of E and H), from
    its own pieces, as predict() puts them together: {group: bytes it sends a step}, {"held",
    "stash", "in step": bytes}."""
    runs, held, stash, _ = three_d.three_d_costs(args, stage, tp_rank=tp_rank)
    sizes = {"tp": args.tp, "pp": args.pp, "dp": args.dp, "cp": args.cp, "kv": args.tp // args.kv_heads}
    sent = {group: three_d.runs_bytes(tuple(runs[group]), sizes[group]) for group in runs}
    in_step = data_parallel.in_step_bytes(three_d.chunk_lengths(args, stage, tp_rank), args.dp,
                                          zero=args.zero, num_micro_batches=args.micro_batches)
    return sent, {"held": sum(size for size, _ in held.values()), "stash": stash, "in step": in_step,
                  "working": three_d.working_bytes(args, stage)}


SHAPES = [(8, dp, pp, 8 // (dp * pp)) for dp in (1, 2, 4, 8) for pp in (1, 2, 4, 8)
          if 8 % (dp * pp) == 0]   # every degree of each axis up to 8, on two nodes of 4


def blocks_for(pp, tp):
    """Blocks enough for the chunks a shape's rows have, and no more (a block is messages): 8 at
    pp 8, and where interleaved has 8 chunks in one shape of each pp (tp 1, the cheapest): pp 4
    at v 2, pp 2 at v 4; 4 in the other shapes of pp 2 and 4 (v 2, or none); 2 with no pipeline."""
    if pp == 1:
        return 2
    if pp == 8 or tp == 1:
        return 8
    return 4


@pytest.mark.deadline(240)
@pytest.mark.parametrize("world,dp,pp,tp", SHAPES)
def test_planned_bytes_and_memory_are_what_a_run_counts(world, dp, pp, tp):
    num_layers = blocks_for(pp, tp)
    rows = [row for row in planned(world, num_layers=num_layers) +
            planned(world, bf16=True, num_layers=num_layers)
            if (row["args"].dp, row["args"].pp, row["args"].tp) == (dp, pp, tp)]
    chosen = []
    for family in FAMILIES:
        row = pick(rows, family)
        if row is not None and row not in chosen:
            chosen.append(row)
    assert len(chosen) >= 3, [layout_flags(row["args"]) for row in chosen]
    if pp in (2, 4) and tp == 1:   # the shapes that run interleaved's 8 chunks
        assert {row["args"].virtual_stages for row in chosen} == {1, 2, 8 // pp}
    layouts = []
    for row in chosen:   # the row's flags run its layout: three_d.py parses them to it
        args = three_d.parse_args([*layout_flags(row["args"]).split(), "--timeout-s", "30"])
        assert {key: getattr(args, key) for key in FIELDS} == \
            {key: getattr(row["args"], key) for key in FIELDS}, layout_flags(row["args"])
        layouts.append(args)
    counted = spawn_returning(count_worker, world, layouts, timeout_s=30)   # [ranks, layouts, 8]
    for j, row in enumerate(chosen):
        costs = [stage_costs(row["args"], s) for s in range(pp)]
        for rank in range(world):
            stage, tp_sent, pp_sent, dp_sent, kv_sent, end, stash, in_step, tp_rank = \
                counted[rank, j].tolist()
            sent, memory = stage_costs(row["args"], int(stage), int(tp_rank))
            kv = {"kv": kv_sent} if "kv" in sent else {}          # G < tp: a kv head's holders
            assert {"tp": tp_sent, "pp": pp_sent, "dp": dp_sent, "cp": 0, **kv} == sent, \
                (layout_flags(row["args"]), rank)
            assert kv or kv_sent == 0
            assert (end, stash, in_step) == (memory["held"], memory["stash"],
                                             memory["in step"]), (layout_flags(row["args"]), rank)
        assert row["memory_bytes"] == max(sum(memory.values()) for _, memory in costs)
        assert row["bytes"] == {group: max(sent[group] for sent, _ in costs)
                                for group in costs[0][0]}
    # the families really differ: more than one schedule, ZeRO stage or style among them
    assert len({(row["args"].schedule, row["args"].zero, row["args"].tp_style,
                 row["args"].recompute) for row in chosen}) >= 3


def assert_priced_as_recorded(row, rank):
    """A rank of the row's slowest stage, its step recorded on the meta device: its matmuls
    (shapes, dtypes, adding into their output or not, calls) are those the row was priced by,
    and so are its FLOPs by dtype and the bytes they move."""
    ran = run_step("three_d", layout_flags(row["args"]).split(), rank, warm_up=False)
    assert ran.stage == row["stage"]
    planned = rank_matmuls(row["args"], row["stage"], ran.tp_rank)
    assert ran.matmuls == planned
    assert {size: sum(calls * mm.flops() for mm, calls in planned.items() if mm.in_bytes == size)
            for size in (2, 4)} == {2: ran.record.flops(element_size=2),
                                    4: ran.record.flops(element_size=4)}


RECORDED = ["--num-layers", "4", "--dim", "256", "--heads", "8", "--context", "256", "--batch-size", "32",
            "--dp", "1", "--pp", "1", "--tp", "1", "--micro-batches", "1"]   # attention's T^2 is felt
V32K = ["--vocab-size", "32000"]


@pytest.mark.deadline(120)
@pytest.mark.parametrize("flags", [
    [], ["--recompute"], ["--bf16"], V32K, [*V32K, "--bf16"], [*V32K, "--context", "32"],
    ["--pp", "2", "--micro-batches", "2"], ["--pp", "2", "--micro-batches", "4", "--schedule", "zb-h1", "--recompute"],
    ["--pp", "2", "--micro-batches", "4", "--schedule", "interleaved", "--virtual-stages", "2", "--recompute"],
    ["--pp", "2", "--micro-batches", "2", "--schedule", "gpipe", *V32K, "--bf16"],
    ["--tp", "2", "--tp-style", "megatron", *V32K], ["--tp", "2", "--tp-style", "megatron", "--sequence-parallel"],
    ["--dp", "2", "--zero", "3", "--bf16"],
    ["--dp", "2", "--pp", "2", "--tp", "2", "--zero", "2", "--micro-batches", "2", "--recompute", "--bf16"],
    ["--cp", "2"], ["--cp", "4", "--recompute"], ["--cp", "2", "--cp-layout", "contiguous", "--bf16"],
    ["--tp", "2", "--cp", "2", "--tp-style", "megatron", "--sequence-parallel", "--bf16"],
    ["--pp", "2", "--cp", "2", "--micro-batches", "4", "--schedule", "interleaved", "--virtual-stages", "2",
     "--recompute"], ["--cp", "2", "--cp-style", "all-gather"],
    ["--cp", "4", "--cp-style", "all-gather", "--cp-layout", "contiguous", "--bf16"],
    ["--cp", "4", "--cp-style", "ulysses", "--bf16"], ["--cp", "4", "--cp-style", "hybrid", "--ulysses", "2",
                                                         "--recompute"]])
def test_the_plans_memory_is_what_a_recorded_step_holds_within_15_percent(flags):
    """A rank of each stage: what it holds at its step's end plus what the step allocates at its
    most (gpu_path's record, on meta), against the plan's memory for that stage. The plan prices
    attention's fp32 [b, h, T, T] temporaries, the loss's [b T, V/tp] and --recompute's rebuilt
    block beside the stash; without them it said 1.2 GB where the step at V 32,000 held 5.3 GB
    (3.4 GB once the loss made its softmax in place)."""
    argv = [*RECORDED, *flags]
    args = gpu_node_args("three_d", argv)
    groups = three_d.rank_groups(args.dp, args.pp, args.tp, args.order, args.cp, args=args)
    for stage in range(args.pp):
        rank = int(groups["pp"][0][stage])   # dp, cp and tp rank 0's
        ran = run_step("three_d", argv, rank)
        assert ran.stage == stage
        recorded = sum(ran.held.values()) + ran.peak_bytes
        planned_bytes = three_d.most_memory(args, stages=[stage])
        assert 0.85 * recorded <= planned_bytes <= 1.1 * recorded, (stage, planned_bytes, recorded)


@pytest.mark.deadline(120)
def test_a_row_prices_what_a_rank_of_8_gpus_executes():
    rows = plan_rows(["--world-size", "8", "--num-layers", "8", "--dim", "256",
                      "--batch-size", "256"])
    found = [pick(rows, {key: value for key, value in family.items() if key != "bf16"})
             for family in FAMILIES]
    assert sum(row is not None for row in found) >= len(FAMILIES) - 1   # all but order tp-dp-pp: one node
    for row in filter(None, found):
        a = row["args"]
        grid = three_d.rank_grid(a.dp, a.pp, a.tp, a.order)
        assert_priced_as_recorded(row, grid[a.dp - 1, row["stage"], 0].item())   # tp rank 0's: the most classes


@pytest.mark.deadline(120)
def test_a_row_prices_what_a_rank_of_1024_gpus_executes():
    # test_gpu_path's LARGE at the scripts' V 97: layout_flags() runs a row at the scripts' V
    flags = ("--dp 16 --pp 8 --tp 8 --num-layers 64 --dim 8192 --heads 64 --context 1024 --batch-size 1024 "
             "--micro-batches 8 --schedule interleaved --virtual-stages 2 --zero 3 --tp-style "
             "megatron --p2p-shard --bf16").split()
    args = gpu_node_args("three_d", flags)          # its door, as on a node of 8 GPUs
    row = three_d.predict(args, three_d.Machine(H100, 8))
    assert_priced_as_recorded(row, three_d.rank_grid(16, 8, 8)[5, row["stage"], 0].item())


def test_the_plan_prices_a_gpus_update_as_the_h100_measured_it():
    """What an H100 measured of the step that does not depend on the model: AdamW fused in one
    pass over the parameters, 36 bytes each with g / d, 4 more to zero g for the next step, and
    --bf16's copy of each new master into the blocks' weights, 6 more (an MLP's step at L 8, D 8192 on one H100: the fused update saved
    9.3 ms of 53.5). The transformer's whole step awaits a GPU (make gpu-check prints both)."""
    row = next(row for row in plan_rows(["--world-size", "1", "--num-layers", "2", "--dim", "4096",
                                         "--heads", "32", "--context", "2048", "--batch-size", "8",
                                         "--vocab-size", "97"], gpus_per_node=1)
               if not row["args"].recompute)
    params = sum(three_d.replica_lengths(row["args"]))
    D, F = 4096, 10944                       # G = 16 kv heads of dh 128; F = 8D/3 up to 48's
    block = 2 * D * D + 2 * D * 16 * 128 + 3 * D * F + 2 * D
    assert params == 97 * D + 2 * block + D + D * 97   # [E], blocks, [g, H]
    assert row["parts"]["update"] == pytest.approx(params * (36 + 4 + 6) / 3.35e12)   # bf16


def test_a_matmul_costs_its_flops_or_its_bytes_whichever_is_longer():
    """The issue's example: [128, 8192] x [8192, 8192] in bf16 does 17.2 GFLOP and moves 138 MB
    through HBM, 124 FLOP a byte against the H100's 295: memory-bound, 41 us. A large square
    GEMM is compute-bound, at most at the best GEMM measured, 80% of the peak."""
    machine = three_d.Machine(H100, 8)
    thin = tensor_parallel.Matmul(128, 8192, 8192, 2, 2, False)
    assert thin.bytes_moved() == (128 * 8192 + 8192 * 8192 + 128 * 8192) * 2   # x, W in; z out
    assert machine.matmul_s(thin) == pytest.approx(thin.bytes_moved() / 3.35e12)
    assert 40e-6 < machine.matmul_s(thin) < 42e-6
    square = tensor_parallel.Matmul(8192, 8192, 8192, 2, 2, False)
    assert machine.matmul_s(square) >= square.flops() / (0.80 * 989e12)
    assert machine.matmul_s(square) == pytest.approx(square.flops() / (989e12 * machine.efficiency(
        8192, 8192, 8192)))
    assert 0.7 < machine.efficiency(8192, 8192, 8192) <= 0.8
    fp32 = square._replace(in_bytes=4, out_bytes=4)   # TF32 off: the CUDA cores, 1/15 the speed
    assert machine.matmul_s(fp32) == pytest.approx(machine.matmul_s(square) * 989 / 67)
    adding = tensor_parallel.Matmul(8192, 32, 1024, 2, 4, True)   # dW += x^T dz into fp32: reads it too
    assert adding.bytes_moved() == (8192 * 32 + 32 * 1024) * 2 + 2 * 8192 * 1024 * 4


def test_a_collective_costs_the_time_nccl_tests_measured():
    """At each published size, an all-reduce over a node's 8 GPUs takes the measured time:
    the floor plus its bytes over the bus bandwidth net of the floor; below them the floor and
    a little; reduce-scatter and all-gather rise to 360 GB/s; across nodes, InfiniBand's."""
    machine = three_d.Machine(H100, 8)
    for size, busbw in three_d.RISE:
        measured = 2 * 7 / 8 * size / (busbw * 1e9)
        assert machine.collective_s("all-reduce", int(size), 8, 8) == pytest.approx(measured)
    assert 20e-6 < machine.collective_s("all-reduce", 4, 8, 8) < 21e-6
    big = 8 * 2**30                 # past the last size: its bandwidth, net of the floor
    last = 2 * 7 / 8 * 1e9
    net = last / (last / 360e9 - 20e-6)
    assert machine.collective_s("all-gather", big, 8, 8) == pytest.approx(20e-6 + 7 / 8 * big / net)
    across = machine.collective_s("all-gather", big, 16, 1)          # one GPU a node: its NIC
    assert across == pytest.approx(30e-6 + 15 / 16 * big / 47e9, rel=1e-3)
    assert machine.collective_s("send", 2**20, 2, 2) == pytest.approx(3e-6 + 2**20 / 180e9)
    assert machine.collective_s("send", 2**20, 2, 1) == pytest.approx(30e-6 + 2**20 / 47e9)


@pytest.mark.deadline(120)
@pytest.mark.parametrize("argv", [["--world-size", "8", *MODEL],
                                  ["--world-size", "16", *MODEL],
                                  ["--world-size", "8", "--num-layers", "16", "--dim", "1024",
                                   "--batch-size", "512"],
                                  ["--world-size", "8", "--hardware", "a100", *MODEL]])
def test_no_row_beats_its_matmuls_flops_and_hbm_traffic(argv):
    """Every row's step takes at least what each stage's matmuls need at the best GEMM measured
    or at HBM's speed, and no MFU passes that GEMM's share of the peak."""
    gpu = three_d.GPUS["a100" if "a100" in argv else "h100"]
    args = three_d.parse_args(["--plan", *argv])
    machine = three_d.Machine(gpu, 8)
    rows = [three_d.predict(layout, machine) for layout in three_d.layouts(args, 8)]
    for row in rows:
        bound = max(sum(calls * max(mm.flops() / (gpu["flops"] * gpu["gemm_best"]),
                                    mm.bytes_moved() / (gpu["hbm_gbps"] * 1e9))
                        for mm, calls in rank_matmuls(row["args"], s).items())
                    for s in range(row["args"].pp))
        assert row["step_s"] >= bound, layout_flags(row["args"])
        assert 0 < row["mfu"] <= gpu["gemm_best"], layout_flags(row["args"])
        assert sum(row["parts"].values()) == pytest.approx(row["step_s"], rel=1e-12)
        assert 0 <= row["bubble"] < 1


def run_plan(argv, capsys):
    three_d.main(["--plan", *argv])
    return capsys.readouterr().out


def test_every_row_runs_as_its_flags_say():
    rows = plan_rows(["--world-size", "8", *SMALL])
    assert len(rows) > 100
    for row in rows:
        kv = {"kv"} if row["args"].kv_heads < row["args"].tp else set()   # a kv head's holders
        assert set(row["bytes"]) == {"tp", "pp", "dp", "cp", *kv} and row["bytes"]["cp"] == 0
        assert 0 <= row["bubble"] < 1 and row["memory_bytes"] <= 80e9
        assert sum(row["parts"].values()) == pytest.approx(row["step_s"], rel=1e-12)
        args = three_d.parse_args(layout_flags(row["args"]).split())   # each runs, as three_d.py reads it
        assert args.dp * args.pp * args.tp == 8 and args.bf16   # the GPUs' figures are bf16's
    assert len({layout_flags(row["args"]) for row in rows}) == len(rows)


def test_a_pipeline_is_its_slowest_stage_spread_by_the_bubble():
    """GPipe, 8 stages of one layer, 8 micro-batches: the step is the slowest stage's compute and
    sends over (1 - bubble), the bubble (p-1)/(m+p-1), then the update."""
    rows = plan_rows(["--world-size", "8", "--num-layers", "8", "--dim", "1024",
                      "--batch-size", "64"])
    row = next(row for row in rows if layout_flags(row["args"]).startswith("--dp 1 --pp 8 --tp 1") and
               row["args"].schedule == "gpipe" and row["args"].micro_batches == 8 and
               not row["args"].recompute)
    parts = row["parts"]
    assert row["bubble"] == pytest.approx(7 / 15)
    inside = parts["compute"] + parts["pp"]
    assert parts["bubble"] == pytest.approx(inside * 7 / 15 / (1 - 7 / 15))
    assert row["step_s"] == pytest.approx(inside / (1 - 7 / 15) + parts["update"])
    assert row["bytes"]["pp"] == 2 * 8 * 8 * 32 * 1024 * 2     # a middle stage: both ways, [b, T, D] bf16


def test_the_middle_stages_stashes_are_every_middle_stages_counted():
    """middle_counts: the (F to B, B to W) counts no middle stage exceeds in both, as held_counts
    gives them stage by stage; GPipe's, 1F1B's and interleaved's are stage 1's alone."""
    for schedule, v in [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2),
                        ("interleaved", 4), ("dualpipev", 2)]:
        for p in (3, 4, 8, 16):
            for m in (p, 2 * p, 4 * p, 8 * p):
                every = {pair for s in range(1, p - 1)
                         for pair in pipeline_parallel.held_counts(schedule, p, s, m, v)}
                assert three_d.middle_counts(schedule, p, m, v) == \
                    pipeline_parallel.undominated(every), (schedule, p, m, v)


def test_the_table_has_top_rows_apart_columns_and_the_best_ones_stages(capsys):
    out = run_plan(["--world-size", "16", *SMALL, "--top", "5"], capsys)
    lines = out.splitlines()
    assert lines[0].startswith("plan: 16 GPUs (2 nodes of 8)")
    table = [line for line in lines if re.match(r" *\d+  dp\d", line)]
    assert [int(line.split()[0]) for line in table] == [1, 2, 3, 4, 5]
    unit = r"[\d.]+ [kMGTP]?B\*?"
    time = r"[\d.]+ (?:us|ms|s)"
    for line in table:   # memory, bytes on tp, pp, dp, bubble, compute, comm, step, MFU: apart
        assert re.search(rf" {unit} +{unit} +{unit} +{unit} +[\d.]+% +{time} +{time} +{time} +"
                         rf"\d+%$", line), line
    assert lines[-1].startswith("its stages, compute and exchanges a step: stage 0 (with E) ") or \
        lines[-1].startswith("one stage: "), lines[-1]
    assert "*" in out   # groups across the two nodes are marked


def test_the_readmes_plan_is_what_the_command_prints(capsys):
    """The README's Llama 3 8B and Mixtral 8x7B examples: each command, run, prints the README's
    table to the digit (a change to the pricing changes the README with it)."""
    with open(f"{REPO}/README.md") as f:
        readme = f.read()
    plans = [found.groups() for found in re.finditer(
        r"\n\$ python three_d.py (--plan .*)\n((?:.*\n)*?)```", readme)
        if "--tp" in found.group(1) or "--cp" not in found.group(1)]   # (an unfixed cp: minutes)
    assert len(plans) == 3                 # Llama 3 8B's, Mixtral 8x7B's, Llama 3 405B's at --cp 16
    for command, shown in plans:
        assert "layout" in shown and len(shown.splitlines()) >= 3
        assert shown in run_plan(command.split()[1:], capsys)


@pytest.mark.deadline(120)
def test_this_machine_prices_every_layout_of_2_ranks():
    """tests/plan_machine.py's CPU model: timed here, it prices each layout of 2 ranks (every
    schedule, DualPipeV's V played out too), its parts adding up to its step, each group's
    exchange where the layout has one."""
    args = three_d.parse_args(["--plan", "--world-size", "2", "--gpus-per-node", "2",
                               "--num-layers", "4", "--dim", "64", "--batch-size", "16"])
    args.bf16 = False
    machine = this_machine(2, 2)
    rows = [three_d.predict(layout, machine) for layout in three_d.layouts(args, 2)]
    assert rows and all(row["step_s"] > 0 for row in rows)
    for row in rows:
        assert sum(row["parts"].values()) == pytest.approx(row["step_s"], rel=1e-12)
        assert row["parts"]["compute"] > 0 and row["parts"]["update"] > 0
        a = row["args"]
        assert (row["parts"]["dp"] > 0) == (a.dp > 1) and (row["parts"]["tp"] > 0) == (a.tp > 1)
    assert {(row["args"].dp, row["args"].pp, row["args"].tp) for row in rows} == \
        {(2, 1, 1), (1, 2, 1), (1, 1, 2)}
    assert {row["args"].schedule for row in rows} == {"gpipe", "1f1b", "zb-h1", "interleaved",
                                                      "dualpipev"}


@pytest.mark.parametrize("argv,flag", [
    (["--plan", "--dp", "3"], "--dp 3: 3 GPUs, which do not divide --world-size 8"),
    (["--plan", "--schedule", "gpipe"], "--schedule"),
    (["--plan", "--gpus-per-node", "3"], "--gpus-per-node"),
    (["--plan", "--top", "-1"], "--top"),
    (["--plan", "--top", "0"], "--top 0"),
    (["--plan", "--world-size", "12"], "--world-size 12"),        # larger than a node: whole nodes
    (["--plan", "--world-size", "7", "--gpus-per-node", "7"], "--world-size"),
    (["--plan", "--hardware", "cpu"], "--hardware"),
    (["--plan", "--flops", "-1"], "--flops"),
    (["--world-size", "8"], "--world-size"),
    (["--plan", "--json"], "--json"),
    (["--hardware", "h100"], "--hardware"),
])
def test_bad_plan_input_exits_2_with_one_line(argv, flag, capsys):
    with pytest.raises(SystemExit) as exited:
        three_d.main(argv)
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert len(captured.err.splitlines()) == 1 and flag in captured.err, captured.err
    assert captured.out == ""


@pytest.mark.deadline(60)
def test_nothing_fitting_ends_in_one_line_and_exit_1():
    proc = subprocess.run([sys.executable, "three_d.py", "--plan", "--num-layers", "64", "--dim",
                           "65536", "--batch-size", "8192"], cwd=REPO, capture_output=True,
                          text=True, timeout=55)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and "fits" in proc.stderr


@pytest.mark.parametrize("world", [2, 4])
def test_a_world_smaller_than_a_node_plans_as_one_node_of_its_size(world, capsys):
    """A workstation of 2 or 4 GPUs: one node of that size, said in the header, its groups
    inside the node (no byte marked as crossing)."""
    out = run_plan(["--world-size", str(world), *SMALL, "--top", "500"], capsys)
    lines = out.splitlines()
    assert lines[0].startswith(f"plan: {world} GPUs (1 node of {world}: a world smaller than "
                               f"--gpus-per-node 8), ")
    table = [line for line in lines if re.match(r" *\d+  dp\d", line)]
    assert table and "*" not in "".join(table)
    assert {tuple(int(x) for x in re.match(r" *\d+  dp(\d+) pp(\d+) tp(\d+)", line).groups())
            for line in table} <= {(d, p, world // (d * p)) for d in (1, 2, 4) for p in (1, 2, 4)}


def test_the_axes_given_to_the_plan_are_fixed_in_every_row(capsys):
    """--plan --tp 8 --pp 16 (a paper's layout): every row it weighs has those, and it ranks the
    rest of the layout (schedule, micro-batches, ZeRO, style) for them."""
    rows = plan_rows(["--world-size", "64", "--tp", "4", "--pp", "2", "--num-layers", "4", "--dim", "64",
                      "--heads", "8", "--batch-size", "64"])
    assert rows and {(row["args"].tp, row["args"].pp, row["args"].dp) for row in rows} == {(4, 2, 8)}
    assert len({(row["args"].schedule, row["args"].micro_batches, row["args"].zero) for row in rows}) > 10
