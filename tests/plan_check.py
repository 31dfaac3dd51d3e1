"""three_d.py --plan checked against real runs.

    python tests/bench.py plan [--world-size 4 --num-layers 4 --dim 1024 --batch-size 1024]

count_worker(): each layout of a world, one step, with what every rank sent on each group counted
(comm_count's CommCounter), what its replica holds at the step's end (the memory table's
count), its stash at its largest (the stash table's) and the most its replica held at any
moment; tests/test_plan.py holds them against the planner's row, stage by stage.

bench(): the planner's prediction for every shape and schedule of 4 ranks at a compute-heavy
size, then each run, taking turns, and the two side by side.
"""
import argparse
import os
import statistics
import time
from functools import partial
from unittest import mock

import torch
import torch.distributed as dist

import three_d
from collectives import cleanup, setup
from comm_count import CommCounter
from data_parallel import gather_on_rank0, memory_held
from pipeline_parallel import Recorder
from plan_machine import this_machine
from race import first_batch, race, spawn_returning


class Sampler(Recorder):
    """The stash table's Recorder, and the most the replica held: after every action, after
    every part's dWs summed into its bucket, and after every gather of ZeRO-3's weights."""

    def __init__(self, device, replica):
        super().__init__(device)
        self.replica = replica
        self.most = 0
        for name in ("add_grads", "gather_weights"):
            setattr(replica, name, self.sampling(getattr(replica, name)))

    def sampling(self, method):
        def call_and_sample(*args, **kwargs):
            method(*args, **kwargs)
            self.sample()
        return call_and_sample

    def sample(self):
        self.most = max(self.most, sum(memory_held(self.replica).values()))

    def stop(self, op, mb, chunk, chunks):
        super().stop(op, mb, chunk, chunks)
        self.sample()


def layout_flags(args):
    """The three_d.py flags that run a --plan row's layout (row["args"])."""
    flags = [f"--dp {args.dp} --pp {args.pp} --tp {args.tp} --num-layers {args.num_layers} "
             f"--dim {args.dim} --heads {args.heads} --kv-heads {args.kv_heads} --ffn-dim "
             f"{args.ffn_dim} --context {args.context} "
             f"--batch-size {args.batch_size} --micro-batches "
             f"{args.micro_batches} --schedule {args.schedule}",
             f"--virtual-stages {args.virtual_stages}" * (args.schedule == "interleaved"),
             f"--cp {args.cp} --cp-layout {args.cp_layout} --cp-style {args.cp_style}" *
             (args.cp > 1), f"--ulysses {args.ulysses}" * (args.cp_style == "hybrid"),
             f"--order {args.order}" * (args.order != "tp-pp-dp"),
             f"--zero {args.zero}" * (args.zero > 0),
             f"--tp-style {args.tp_style}" * (args.tp_style != "all-gather"),
             "--p2p-shard" * args.p2p_shard, "--sequence-parallel" * args.sequence_parallel,
             "--recompute" * args.recompute, "--bf16" * args.bf16, "--qk-norm" * args.qk_norm,
             f"--optimizer {args.optimizer}" * (args.optimizer != "adamw"),
             f"--bucket-mb {args.bucket_mb:g}" * (args.bucket_mb != 25)]
    return " ".join(flag for flag in flags if flag)


def rank_builder():
    """three_d.ThreeDRank, each process group made once for every layout that has its ranks
    (making one costs every rank a rendezvous: a quarter of the counted runs' time here)."""
    made = {}
    new_groups = dist.new_subgroups_by_enumeration

    def made_once(ranks, **kwargs):
        key = tuple(map(tuple, ranks))
        if key not in made:
            made[key] = new_groups(ranks, **kwargs)
        return made[key]

    def build(rank, args, device):
        with mock.patch.object(dist, "new_subgroups_by_enumeration", made_once):
            return three_d.ThreeDRank(rank, args, device)
    return build


def count_worker(rank, world_size, layouts):
    """Each layout (three_d's args) for one step. On rank 0, every rank's figures, [ranks,
    layouts, 9]: its stage; the bytes it sent on tp, pp, dp and kv; what its replica held at the
    step's end; its stash at its largest; the most its replica held beyond the end; its tp rank
    (whose classes of E and H it holds)."""
    device = setup(rank, world_size)
    figures = []
    build = rank_builder()
    for args in layouts:
        me = build(rank, args, device)
        batch = me.micro_batches(first_batch(args), args)
        if args.optimizer == "adamw":   # a step first: AdamW makes its state in its first one
            me.train_step(*batch)
            me.replica.update()
        counter, sampler = CommCounter(me.groups), Sampler(device, me.replica)
        with counter.step():
            me.train_step(*batch, recorder=sampler)
            me.replica.update()
        sent = [float(sum(count for (group, _), (_, count) in counter.counts.items()
                          if group == name)) for name in ("tp", "pp", "dp", "kv")]
        end = sum(memory_held(me.replica).values())
        most = sampler.most
        stash = max(entry[2] for entry in sampler.memory)
        figures.append([me.stage, *sent, end, stash, max(most - end, 0), me.tp_rank])
    everyone = gather_on_rank0(torch.tensor(figures, dtype=torch.float64))
    cleanup()
    return everyone


# ---- the bench: predicted against measured -------------------------------------------

def bench(argv):
    """Predict every shape and schedule of the world at a compute-heavy size, run each (the
    predicted best of its micro-batches, ZeRO stage, p2p and recompute choices), and print the
    two side by side."""
    parser = argparse.ArgumentParser(prog="tests/bench.py plan")
    for flag, default in [("--world-size", 4), ("--num-layers", 4), ("--dim", 256),
                          ("--batch-size", 64), ("--steps", 5)]:
        parser.add_argument(flag, type=int, default=default)
    sizes = parser.parse_args(argv)
    args = three_d.parse_args(["--plan", "--world-size", str(sizes.world_size), "--gpus-per-node",
                               str(sizes.world_size), "--num-layers", str(sizes.num_layers),
                               "--dim", str(sizes.dim), "--batch-size", str(sizes.batch_size)])
    args.bf16 = False                # the CPU's runs are fp32's (the GPUs' plans are bf16's)
    start = time.perf_counter()
    machine = this_machine(args.world_size, len(os.sched_getaffinity(0)))
    rows = [three_d.predict(layout, machine) for layout in three_d.layouts(args, args.world_size)]
    calibrated = time.perf_counter() - start
    best = {}    # one a shape, schedule, TP style and ZeRO stage: the predicted best
    for row in sorted(rows, key=lambda row: row["step_s"]):
        a = row["args"]
        best.setdefault((a.dp, a.pp, a.tp, a.schedule, a.virtual_stages, a.tp_style, a.zero), row)
    chosen = sorted(best.values(), key=lambda row: row["step_s"])
    layouts = [three_d.parse_args(layout_flags(row["args"]).split() + ["--steps", "1"]) for row in chosen]
    measured = spawn_returning(measure_worker, args.world_size, layouts, sizes.steps)
    show_bench(args, machine, chosen, measured, calibrated, sizes.steps)


def measure_worker(rank, world_size, layouts, steps):
    """Each layout in turn, built, warmed up and timed alone (race.race): its median step."""
    device = setup(rank, world_size)
    times = []
    build = rank_builder()
    for args in layouts:
        me = build(rank, args, device)
        batch = me.micro_batches(first_batch(args), args)
        times.append(race({"step": partial(train_and_update, me, batch)}, device, warmup=2,
                          repeats=steps)["step"])
        del me
    cleanup()
    return times


def train_and_update(me, batch):
    me.train_step(*batch)
    me.replica.update()


def show_bench(args, machine, chosen, measured, calibrated, steps):
    print(f"plan bench: {args.world_size} ranks on {machine.cores:.3g} cores (gloo, 1 thread "
          f"each), L={args.num_layers} D={args.dim} B={args.batch_size}, {args.optimizer}; "
          f"the planner timed this machine in {calibrated:.1f} s; each layout's step "
          f"predicted, then run (median of {steps} steps, one layout at a time)")
    order = sorted(range(len(chosen)), key=lambda j: measured[j])
    errors = [(chosen[j]["step_s"] - measured[j]) / measured[j] for j in range(len(chosen))]
    print(f"  {'predicted':>14}{'measured':>16}{'error':>7}   layout")
    for j in order:
        layout = three_d.short_layout(chosen[j]["args"])
        print(f"  #{j + 1:<3}{chosen[j]['step_s'] * 1e3:>7.1f} ms  #{order.index(j) + 1:<3}"
              f"{measured[j] * 1e3:>7.1f} ms{errors[j]:>+7.0%}   {layout}")
    worst = max(errors, key=abs)
    print(f"median error {statistics.median(map(abs, errors)):.0%}, worst {worst:+.0%}, "
          f"measured best is predicted #{order[0] + 1}")
