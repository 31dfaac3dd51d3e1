"""Step 5: 3D parallelism. Data, tensor and pipeline parallel at once, on process groups.

    python three_d.py                                   # dp=2 pp=2 tp=2: 8 ranks (make 3d)
    python three_d.py --dp 2 --pp 2 --tp 2 --check      # ...and compare with serial training
    python three_d.py --dp 1 --pp 4 --tp 2 --schedule gpipe --order tp-dp-pp
    python three_d.py --show-rank-map --dp 2 --pp 2 --tp 2
    python three_d.py --plan --hardware h100            # which layout? 8 H100s, ranked
    torchrun --nproc-per-node 8 three_d.py              # one node; the README has two nodes
    python three_d.py --ray                             # the ranks as Ray Train workers

Nothing new is computed here: this file composes the blocks of steps 2-4.
- Every layer is one of step 3's tensor-parallel layers over the stage's TP group: the
  column layer with its all-gather, or Megatron's column-then-row pairs (--tp-style).
- The stages run step 4's schedules and runner (interleaved: several chunks a stage);
  the rank with TP coordinate t sends to the next stage's rank with the same t.
- After the last micro-batch, each shard's gradient is averaged over its DP group by
  step 2's DataParallel, once (with --zero, sharded over the replicas), and the
  optimizer steps.
What is new is the rank map: which ranks form each group. From-scratch 3D code often
hard-codes it for 8 ranks (and a rank-group utility often used with it puts 6 of 8
ranks in the wrong groups); rank_groups() derives it for any sizes and nesting order.

What PyTorch gives you: a DeviceMesh of shape (dp, pp, tp) with pipelining over pp,
ColwiseParallel over tp, and FSDP2 or DDP over dp (tests/bench.py races it against this).
"""
import warnings
from datetime import timedelta
from functools import partial
warnings.filterwarnings("ignore", "Failed to initialize NumPy")   # torch warns without numpy
import torch
import torch.distributed as dist

from collectives import cleanup, log, run_main, setup, spawn
from data_parallel import dp_costs, make_replica, replica_rows
from pipeline_parallel import Stage, build_schedule, pipeline_costs, run_schedule, stage_layers
from tensor_parallel import (all_gather_columns, layer_kinds, shard, shard_columns, tp_blocks,
                             tp_costs)

AXES = ("dp", "pp", "tp")

# The map that from-scratch 3D code hard-codes for dp = pp = tp = 2, written out by hand:
HARD_CODED_MAP_2x2x2 = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],   # neighbours share every layer
    "pp": [[0, 2], [1, 3], [4, 6], [5, 7]],   # 0 -> 2, 1 -> 3, 4 -> 6, 5 -> 7
    "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],   # replicas
}
# It is rank = (d PP + p) TP + t: arange(8).view(dp, pp, tp), read along each axis.
#   grid = arange(8).view(2, 2, 2) = [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]      [dp, pp, tp]
#   rank 6 = (1 * 2 + 1) * 2 + 0 sits at d=1, p=1, t=0, and grid[1, 1, 0] = 6. Its groups
#   vary one coordinate: tp grid[1, 1, :] = [6, 7], pp grid[1, :, 0] = [4, 6],
#   dp grid[:, 1, 0] = [2, 6].
# Which axis varies fastest is a choice (--order, fastest first, as Megatron's order
# string). TP is innermost in both orders offered: it talks at every layer, so its ranks
# should share the fastest links, inside one node.
#   tp-pp-dp (the default, as that code does): replicas outermost. DP's all-reduce, once
#     per step but as big as the model, crosses nodes.
#   tp-dp-pp (Megatron, torchtitan): stages outermost, rank = (p DP + d) TP + t. Only the
#     pipeline's point-to-point activations, the lightest traffic, cross nodes. Rank 5 =
#     (1 * 2 + 0) * 2 + 1 sits at p=1, d=0, t=1: tp [4, 5], pp [1, 5], dp [5, 7].


def rank_grid(dp, pp, tp, order="tp-pp-dp"):
    """The world as a tensor indexed [d, p, t] that holds each coordinate's rank."""
    slowest_first = order.split("-")[::-1]
    sizes = {"dp": dp, "pp": pp, "tp": tp}
    grid = torch.arange(dp * pp * tp).view(*(sizes[a] for a in slowest_first))   # laid out in order
    return grid.permute(*(slowest_first.index(a) for a in AXES))                  # [dp, pp, tp]


def rank_groups(dp, pp, tp, order="tp-pp-dp"):
    """{"dp": [...], "pp": [...], "tp": [...]}: for each kind, a partition of all ranks into
    groups, each in ascending order. A group varies one coordinate and fixes the others."""
    grid = rank_grid(dp, pp, tp, order)
    groups = {}
    for axis, name in enumerate(AXES):
        lines = grid.movedim(axis, -1).reshape(-1, grid.shape[axis])   # axis last: a row per group
        groups[name] = sorted(sorted(row) for row in lines.tolist())
    return groups


def coordinates(rank, groups):
    """(d, p, t) of a rank: its position in its own dp, pp and tp groups."""
    return tuple(next(g.index(rank) for g in groups[name] if rank in g) for name in AXES)


class ThreeDRank:
    """One rank's share of the job, composed from the earlier steps' blocks and handed down to
    them, set up in five steps: its groups; its shards, held by step 2's replica over dp; its
    replica's slice of the batch; its stages (step 4) running step 3's layers; its schedule."""

    def __init__(self, rank, args, device):
        self.join_groups(rank, args)
        self.hold_shards(args, device)
        self.take_rows(args, device)
        self.build_stages(args)
        self.plan_schedule(args)

    def join_groups(self, rank, args):
        """Every rank creates every group, in the same order, and keeps its own. (A new group
        waits PyTorch's default 30 minutes for a peer unless told otherwise: --timeout-s.)"""
        groups = rank_groups(args.dp, args.pp, args.tp, args.order)
        timeout = timedelta(seconds=args.timeout_s)
        self.groups = {name: dist.new_subgroups_by_enumeration(groups[name], timeout=timeout)[0]
                       for name in ("tp", "pp", "dp")}
        self.dp_rank, self.stage, self.tp_rank = coordinates(rank, groups)
        self.tag = f"[dp{self.dp_rank} pp{self.stage} tp{self.tp_rank}]"
        dist.barrier()   # a collective on every rank before the first point-to-point (for NCCL)

    def hold_shards(self, args, device):
        """The layers of its stage (of each of its chunks, interleaved), each cut to its tp
        part: its columns, or its rows for a Megatron row layer. Every rank draws the whole
        model to cut its shards (init_weights says what that costs). Megatron's pairs stay
        inside a chunk, where they begin and end with the whole activation on every rank.
        Step 2's replica holds them over the dp group: with --zero, 1/dp of each."""
        self.full, v = init_weights(args.num_layers, args.dim, args.seed), args.virtual_stages
        self.per_chunk = args.num_layers // (args.pp * v)
        self.kinds = layer_kinds(self.per_chunk, args.tp_style)       # the same in every chunk
        shards = [shard(self.full[i], kind, self.tp_rank, args.tp).to(device)  # [D, D/T], [D/T, D]
                  for c in range(v)
                  for i, kind in zip(stage_layers(args.num_layers, args.pp, self.stage, v, c),
                                     self.kinds)]
        self.replica = make_replica(shards, self.groups["dp"], zero=args.zero,
                                    optimizer=args.optimizer, lr=args.lr, bf16=args.bf16,
                                    bucket_mb=args.bucket_mb,      # no bucket crosses a chunk
                                    breaks=range(0, len(shards), self.per_chunk))

    def take_rows(self, args, device):
        """Its replica's slice of the batch, by its dp coordinate, the same on every tp rank."""
        self.inputs, self.targets = make_batch(args)
        self.rows, m = replica_rows(args.batch_size, self.dp_rank, args.dp), args.micro_batches
        self.micro_inputs = self.inputs[self.rows].to(device, self.replica.dtype).chunk(m)  # [b, D]
        self.micro_targets = self.targets[self.rows].to(device).chunk(m)

    def build_stages(self, args):
        """Step 4's stages, one a chunk, each handed step 3's forward and backward of its
        layers over its tp group; the loss a mean over the replica's rows."""
        v, pp, p = args.virtual_stages, args.pp, self.stage
        self.stages = [Stage(self.replica, range(c * self.per_chunk, (c + 1) * self.per_chunk),
                             c * pp + p == 0, c * pp + p == v * pp - 1, args.micro_batches,
                             self.micro_targets, len(self.rows) * args.dim,
                             tp_blocks(self.kinds, self.groups["tp"]), args.recompute)
                       for c in range(v)]

    def plan_schedule(self, args):
        """The action list of its stage, its neighbours in the pipe, and what crosses to them.
        With --p2p-shard (Megatron's scatter-gather) what crosses, the same on every tp rank,
        goes as each rank's 1/tp slice and is all-gathered on arrival: 1/tp of the bytes, for
        one all-gather more."""
        pp_ranks = dist.get_process_group_ranks(self.groups["pp"])   # the stages of this pipe
        self.prev_rank = pp_ranks[(self.stage - 1) % args.pp]        # interleaved, the last
        self.next_rank = pp_ranks[(self.stage + 1) % args.pp]        # stage's chunk c sends to
        self.actions = build_schedule(args.schedule, args.pp, self.stage, args.micro_batches,
                                      args.virtual_stages)           # the first's chunk c+1
        width, self.boundary = args.dim, {}
        if args.p2p_shard:
            width, self.boundary = args.dim // args.tp, dict(
                outgoing=partial(shard_columns, tp_rank=self.tp_rank, tp_size=args.tp),
                incoming=partial(all_gather_columns, group=self.groups["tp"]))
        self.buffer_shape = (len(self.rows) // args.micro_batches, width)   # [b, D] or [b, D/tp]

    def train_step(self, recorder=None):
        """Every micro-batch forward and backward through the pipeline, each bucket's gradient
        summed over the replicas once final (reduce-scattered, with --zero); then / dp."""
        self.replica.begin_step()
        for stage in self.stages:
            stage.begin_step()
        run_schedule(self.actions, self.stages, self.micro_inputs, self.prev_rank,
                     self.next_rank, self.buffer_shape, recorder=recorder, **self.boundary)
        self.replica.average()


def three_d_costs(args, stage, times=(1, 1, 1)):
    """What a rank of stage `stage` costs a step, from steps 2-4's costs: its collectives on
    each group, {"tp", "pp", "dp": [(kind, bytes of the tensor, times)]}; what its replica holds
    at the step's end, {kind: (bytes, formula)}; its most stash (a layer keeps one of x and z
    whole, the other's 1/tp), in bytes; its stage's bubble (ZB-H1's for times (T_F, T_B, T_W))."""
    v, m, tp = args.virtual_stages, args.micro_batches, args.tp
    per_chunk = args.num_layers // (args.pp * v)
    act = args.batch_size // (args.dp * m) * args.dim * (2 if args.bf16 else 4)   # [b, D]
    tp_runs = tp_costs(layer_kinds(per_chunk, args.tp_style) * v, act, m, stage == 0,
                       args.recompute)
    sent = act // tp if args.p2p_shard else act                 # --p2p-shard: 1/tp crosses
    bubble, stash, pp_runs = pipeline_costs(args.schedule, args.pp, stage, m, v, per_chunk, act,
                                            args.recompute, times, layer_bytes=act + act // tp)
    pp_runs = [(kind, sent, count) for kind, _, count in pp_runs]
    if args.p2p_shard:                                          # and is all-gathered on arrival
        tp_runs += [("all-gather", act, count) for _, _, count in pp_runs]
    dp_runs, held = dp_costs(replica_lengths(args), args.dp, args.zero, m, args.optimizer,
                             args.bf16, args.recompute)
    return {"tp": tp_runs, "pp": pp_runs, "dp": dp_runs}, held, stash, bubble


def three_d_worker(rank, world_size, args):
    device = setup(rank, world_size)
    me = ThreeDRank(rank, args, device)
    if rank == 0:
        show_layout(args, me.kinds)   # the rank map, and the layers of a stage (below the fold)
    last, losses, norms, check = me.stage == args.pp - 1, [], [], SerialCheck(args)
    for step in range(args.steps):
        me.train_step()
        if args.check:   # this step's weights and gradients, whole on rank 0, against serial's
            check.step(full_matrices(full_weights(me.replica), me.kinds, args),
                       full_matrices(full_grads(me.replica), me.kinds, args))
        if args.clip_grad:   # the norm's squares summed over tp and pp (and dp, if ZeRO shards)
            norms.append(me.replica.clip(args.clip_grad, [me.groups["tp"], me.groups["pp"]]))
        me.replica.update()                   # each rank's optimizer steps its own shards
        if last:   # the last stage knows the loss: the replicas' mean losses, averaged
            losses.append(global_loss(me.stages[-1].loss, me.groups["dp"]))
            if me.dp_rank == me.tp_rank == 0:
                log(me.tag, step_line(step, losses, norms, args))
    finish_ranks(me, args, losses, check, norms, device)
    cleanup()


def main(argv=None):
    args = parse_args(argv)
    if args.show_rank_map:
        show_rank_map(args.dp, args.pp, args.tp, args.order)
    elif args.plan:  # which layout? every one, costed by three_d_costs() (below)
        plan(args)
    elif args.ray:   # the same ranks, started by Ray instead of spawn (below)
        ray_launch(args)
    else:
        spawn(three_d_worker, args.dp * args.pp * args.tp, args, backend=args.backend,
              timeout_s=args.timeout_s)


# Below the fold: the shards put back together, the rank map's print, the command line and
# --ray. -----------------------------------------------------------------------------------
import argparse, itertools, json, math, os, statistics, time  # noqa: E401, E402

from collectives import (RANK_BYTES, collective_cost, positive_float, positive_int,  # noqa: E402
                         under_torchrun)
from data_parallel import (SerialCheck, check_training_args, finish_run,  # noqa: E402
                           full_grads, full_weights, global_loss, init_weights, layer_backward,
                           layer_forward, make_batch, make_buckets, mse_loss, show_memory,
                           step_line, training_parser)
from pipeline_parallel import (RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD,  # noqa: E402
                               add_schedule_args, gather_on_rank0, schedule_rules)
from tensor_parallel import describe, divides, refuse_unused, side_by_side  # noqa: E402


def full_matrices(shards, kinds, args):
    """On rank 0, the L full [D, D] matrices put back together from replica 0's shards:
    stage p holds layers p L/pp .. (p+1) L/pp - 1 (interleaved, chunk c holds those of
    virtual stage c pp + p), TP rank t their columns t D/tp .. (their rows, for a row
    layer). Every rank sends its shards flat, [L/pp, D D/tp]."""
    everyone = gather_on_rank0(torch.stack([w.reshape(-1) for w in shards]))  # [world, L/pp, D D/T]
    if everyone is None:
        return None
    grid, D = rank_grid(args.dp, args.pp, args.tp, args.order), args.dim   # [dp, pp, tp] -> rank
    full = []
    for c in range(args.virtual_stages):             # in layer order: virtual stage c pp + p
        for p in range(args.pp):
            for i, kind in enumerate(kinds):
                parts = [everyone[grid[0, p, t], c * len(kinds) + i] for t in range(args.tp)]
                if kind == "row":   # rows stacked, or columns side by side
                    full.append(torch.cat([w.view(-1, D) for w in parts], dim=0))
                else:
                    full.append(torch.cat([w.view(D, -1) for w in parts], dim=1))
    return full


def finish_ranks(me, args, losses, check, norms, device):
    """The run's end: the full matrices put back together, the losses from the last stage,
    rank 0's memory table (with --zero), --save and --check."""
    final = full_matrices(full_weights(me.replica), me.kinds, args)
    losses = torch.tensor(losses if me.stage == args.pp - 1 else [0.0] * args.steps,
                          dtype=torch.float64, device=device)
    dist.broadcast(losses, src=rank_grid(args.dp, args.pp, args.tp, args.order)[0, -1, 0].item())
    if dist.get_rank() == 0:
        if args.zero:
            show_memory(me.replica, args, f"rank 0: its replica of stage 0's layers, its tp "
                                          f"shards of them (1/{args.tp})")
        finish_run(args, me.full, final, losses.tolist(), me.inputs, me.targets, check, norms)


def replica_lengths(args):
    """The elements of each of a rank's buckets, as its replica lays them out: a stage's
    layers, each D^2/tp, cut by --bucket-mb, never across a chunk; ZeRO: padded to d S."""
    layers = args.num_layers // args.pp
    lengths = make_buckets([args.dim * args.dim // args.tp] * layers, args.bucket_mb,
                           range(0, layers, layers // args.virtual_stages))[3]
    if args.zero:
        return [-(-n // args.dp) * args.dp for n in lengths]
    return lengths


def show_layout(args, kinds):
    show_rank_map(args.dp, args.pp, args.tp, args.order)
    print(f"each stage{' chunk' * (args.virtual_stages > 1)}: {describe(kinds)} over "
          f"tp={args.tp}", flush=True)


def show_rank_map(dp, pp, tp, order):
    groups = rank_groups(dp, pp, tp, order)
    width = {name: max(len(str(groups[name][0])) + 2, 10) for name in AXES}
    print(f"rank map: dp={dp} pp={pp} tp={tp}, order {order} (fastest first)")
    print(f"{'rank':>5} {'dp':>3} {'pp':>3} {'tp':>3}   " + "".join(
        f"{name + ' group':<{width[name]}}" for name in ("tp", "pp", "dp")).rstrip())
    for rank in range(dp * pp * tp):
        mine = {name: next(g for g in groups[name] if rank in g) for name in AXES}
        coords = " ".join(f"{c:>3}" for c in coordinates(rank, groups))
        cells = "".join(f"{str(mine[name]):<{width[name]}}" for name in ("tp", "pp", "dp"))
        print(f"{rank:>5} {coords}   {cells}".rstrip(), flush=True)


# --plan: which layout? Every layout of --world-size ranks is costed by three_d_costs(), the
# steps' own cost functions, stage by stage: bytes and memory exactly (tests/test_plan.py
# counts them in real runs). Its step time is a model: each layer's matmuls at the machine's
# speed, each collective alpha (n-1) + bytes / beta (collective_cost), none overlapped with
# compute (none is, in this 3D), the pipeline's bubble; on a CPU, the ranks' compute shared
# among its cores. The README's "Which layout" says where the model is wrong, and by how much.

# H100 SXM 80 GB, as published: 989 TFLOP/s dense bf16, NVLink 450 GB/s a direction, 8 a
# node, InfiniBand NDR 400 Gb/s (50 GB/s) a GPU, HBM3 3.35 TB/s. In a node, NCCL's measured
# bus bandwidth where it differs: about 370 GB/s (the link's, less its protocol's ~20%), 480
# for an all-reduce on NVLink SHARP (nccl-tests, 8 GPUs). Latency: 2 us a ring step, a guess.
H100 = dict(flops=989e12, memory_gb=80, intra_gbps=370, all_reduce_gbps=480, inter_gbps=50,
            latency_us=2, hbm_gbps=3350)
UPDATE_BYTES = {"adamw": 36, "sgd": 20}   # a parameter's, read and written: g / d, then p
                                          # (and AdamW's m and v)


class Machine:
    """What the planner knows of a machine, from its figures: a layer's F, B and W, the loss,
    a collective, the optimizer's pass, in seconds; its memory a rank; ranks a node; cores."""

    def __init__(self, flops, memory_gb, intra_gbps, all_reduce_gbps, inter_gbps, latency_us,
                 hbm_gbps, gpus_per_node, cores):
        self.flops, self.memory, self.gpus_per_node, self.cores = (
            flops, memory_gb * 1e9, gpus_per_node, cores)
        self.intra, self.all_reduce, self.inter, self.hbm = (
            gbps * 1e9 for gbps in (intra_gbps, all_reduce_gbps, inter_gbps, hbm_gbps))
        self.alpha = latency_us * 1e-6

    def layer_s(self, kind, rows, dim, tp, bf16, need_dx=True):
        """(F, B, W) of a tp rank's layer of this kind: 2 rows dim dim/tp FLOPs each (B's dx:
        none for the model's input)."""
        t = 2 * rows * dim * dim / tp / self.flops
        return t, t * need_dx, t

    def loss_s(self, rows, dim, bf16):   # a few passes over [b, D]: memory-bound
        return 4 * rows * dim * 4 / self.hbm

    def collective_s(self, kind, nbytes, n, crosses):
        beta = self.inter if crosses else self.all_reduce if kind == "all-reduce" else self.intra
        return collective_cost(kind, nbytes, n, self.alpha, beta)[1] if n > 1 else 0.0

    def update_s(self, params, optimizer):
        return params * UPDATE_BYTES[optimizer] / self.hbm


class ThisMachine(Machine):
    """This machine, timed. Alone, on one thread as a rank runs: each layer's F, B and W at the
    shapes asked (step 3's blocks' own work: the gather layer's copies too), the loss, the
    average and the optimizer's pass. With every rank at once, as in a step: each collective
    and a send, of 1 and 16 MB, over groups of each size (beta from the difference, alpha what
    is left); and a matmul, whose slowdown over the one alone counts the cores ranks share."""
    SIZES, KINDS = (2**20, 2**24), ("all-reduce", "reduce-scatter", "all-gather")

    def __init__(self, world_size, cores):
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / world_size
        super().__init__(flops=0, memory_gb=(memory - RANK_BYTES) / 1e9, intra_gbps=1,
                         all_reduce_gbps=1, inter_gbps=1, latency_us=0, hbm_gbps=1,
                         gpus_per_node=world_size, cores=cores)   # the figures: timed below
        torch.set_num_threads(1)
        self.timed, self.flops = {}, 0.0             # (kind, rows, ...) -> (F, B, W)
        sizes = [n for n in range(2, world_size + 1) if world_size % n == 0]
        tests = [(kind, n) for n in sizes for kind in self.KINDS] + [
            ("send", 2), ("matmul then all-reduce", world_size), ("matmul", 1)]
        swept = torch.zeros(len(tests), 2, dtype=torch.float64).share_memory_()
        spawn(sweep_worker, world_size, tests, self.SIZES, swept, backend="gloo")
        self.links = {}                              # (kind, n) -> (alpha, beta)
        for (kind, n), (small, large) in zip(tests[:-2], swept.tolist()):
            steps = 1                                # ring steps: a send is one
            if kind != "send":
                steps = (n - 1) * (2 if kind == "all-reduce" else 1)
            sent = [collective_cost(kind, size, n)[0] for size in self.SIZES]
            beta = float(sent[1] - sent[0]) / max(large - small, 1e-9)
            self.links[kind, n] = (max(small - float(sent[0]) / beta, 0) / steps, beta)
        x, w = torch.randn(256, 1024), torch.randn(1024, 1024)
        self.cores = min(cores, world_size * timed(lambda: x @ w) / swept[-1, 0].item())
        # A collective waits for its last rank; sharing cores, ranks drift apart between two:
        # what a matmul then an all-reduce takes beyond the two apart.
        self.sync_s = 0.0
        if world_size > cores:
            matmul_then_all_reduce, matmul = swept[-2, 0].item(), swept[-1, 0].item()
            all_reduce = swept[tests.index(("all-reduce", world_size)), 0].item()
            self.sync_s = max(0.0, matmul_then_all_reduce - matmul - all_reduce)
        grads = torch.zeros(2**20, requires_grad=True)
        grads.grad = torch.zeros_like(grads)
        self.per_param = {}
        for name, optimizer in (("adamw", torch.optim.AdamW), ("sgd", torch.optim.SGD)):
            step = optimizer([grads], lr=1e-3).step
            self.per_param[name] = timed(lambda: (grads.grad.div_(2), step())) / grads.numel()

    def layer_s(self, kind, rows, dim, tp, bf16, need_dx=True):
        key = (kind, rows, dim, tp, bf16, need_dx)
        if key not in self.timed:
            n, dtype = dim // tp, torch.bfloat16 if bf16 else torch.float32
            inner, cols = (n, dim) if kind == "row" else (dim, n)
            x, w = torch.randn(rows, inner, dtype=dtype), torch.randn(inner, cols, dtype=dtype)
            g = torch.randn(rows, dim if kind == "gather" else cols, dtype=dtype)[:, :cols]
            stash = layer_forward(x, w)[1]
            dz = layer_backward(g, stash, w, need_dx)[1][1]

            def forward():   # the gather layer puts the pieces side by side, a copy
                a = layer_forward(x, w)[0]
                if kind == "gather" and tp > 1:
                    side_by_side(torch.cat([a] * tp), rows)
            self.timed[key] = (timed(forward),
                               timed(lambda: layer_backward(g, stash, w, need_dx)),
                               timed(lambda: torch.mm(x.T, dz)))
            self.flops = max(self.flops, 2 * rows * inner * cols / self.timed[key][2])
        return self.timed[key]

    def loss_s(self, rows, dim, bf16):
        key = ("loss", rows, dim, bf16)
        if key not in self.timed:
            a = torch.randn(rows, dim, dtype=torch.bfloat16 if bf16 else torch.float32)
            y = torch.randn(rows, dim)
            self.timed[key] = timed(lambda: mse_loss(a, y, a.numel()))
        return self.timed[key]

    def collective_s(self, kind, nbytes, n, crosses):
        if n == 1:
            return 0.0
        alpha, beta = self.links[kind, 2 if kind == "send" else n]
        return collective_cost(kind, nbytes, n, alpha, beta)[1] + self.sync_s * (kind != "send")

    def update_s(self, params, optimizer):
        return params * self.per_param[optimizer]


def timed(fn, at_least_s=0.03):
    """The median seconds of fn, run until at_least_s has passed, 3 times at least."""
    fn()
    times, start = [], time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < at_least_s:
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def sweep_worker(rank, world_size, tests, nbytes, swept):
    """Every rank at once: each (kind, n) of tests, in groups of n consecutive ranks (a send:
    both ways between pairs; a matmul: on its own). Rank 0 writes the median seconds."""
    setup(rank, world_size)
    groups = {n: dist.new_subgroups(n)[0] for n in sorted({n for _, n in tests})}
    peer = rank ^ 1 if rank ^ 1 < world_size else rank
    x, w = torch.randn(256, 1024), torch.randn(1024, 1024)
    for i, (kind, n) in enumerate(tests):
        for j, size in enumerate(nbytes):
            whole, part, came = (torch.zeros(size // 4), torch.zeros(size // 4 // n),
                                 torch.zeros(size // 4))

            def once():
                if kind.startswith("matmul"):
                    x @ w
                if kind == "matmul then all-reduce":
                    dist.all_reduce(whole[:2**18], group=groups[n])   # 1 MB
                elif kind == "all-reduce":
                    dist.all_reduce(whole, group=groups[n])
                elif kind == "reduce-scatter":
                    dist.reduce_scatter_single(part, whole, group=groups[n])
                elif kind == "all-gather":
                    dist.all_gather_single(whole, part, group=groups[n])
                elif kind == "send" and peer != rank:
                    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, whole, peer),
                                                        dist.P2POp(dist.irecv, came, peer)]):
                        work.wait()
            times = []
            for _ in range(5):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(2):
                    once()
                times.append((time.perf_counter() - start) / 2)
            if rank == 0:
                swept[i, j] = statistics.median(times[1:])
    cleanup()


def layouts(args, gpus_per_node):
    """Every layout the planner weighs, as parse_args() would leave three_d's flags: each
    (dp, pp, tp); both orders where a node is smaller than the world; each schedule, with 2
    or 4 chunks interleaved; micro-batches 1 to 8 without a pipeline, p to 8 p with one; each
    ZeRO stage; each TP style; --p2p-shard and --recompute, with and without."""
    world, L, D, B = args.world_size, args.num_layers, args.dim, args.batch_size
    for dp, pp in itertools.product(range(1, world + 1), repeat=2):
        tp = world // (dp * pp)
        if dp * pp * tp != world or D % tp or L % pp:
            continue
        orders = ["tp-pp-dp", "tp-dp-pp"][:1 + (world > gpus_per_node and dp * pp > 1)]
        schedules = [("1f1b", 1)]
        if pp > 1:
            schedules = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1),
                         *[("interleaved", v) for v in (2, 4) if L % (pp * v) == 0]]
        for order, (schedule, v), k, zero, style, p2p_shard, recompute in itertools.product(
                orders, schedules, range(4), range(4 if dp > 1 else 1),
                ["all-gather", "megatron"][:1 + (tp > 1)],
                [False, True][:1 + (tp > 1 and pp > 1)], [False, True]):
            m = pp * 2**k
            if B % (dp * m) or (style == "megatron" and L // (pp * v) < 2):
                continue
            yield argparse.Namespace(**{**vars(args), **dict(
                dp=dp, pp=pp, tp=tp, order=order, schedule=schedule, virtual_stages=v,
                micro_batches=m, zero=zero, tp_style=style, p2p_shard=p2p_shard,
                recompute=recompute)})


def layout_flags(args):
    """The three_d.py flags that run this layout."""
    flags = [f"--dp {args.dp} --pp {args.pp} --tp {args.tp} --num-layers {args.num_layers} "
             f"--dim {args.dim} --batch-size {args.batch_size} --micro-batches "
             f"{args.micro_batches} --schedule {args.schedule}",
             f"--virtual-stages {args.virtual_stages}" * (args.schedule == "interleaved"),
             f"--order {args.order}" * (args.order != "tp-pp-dp"),
             f"--zero {args.zero}" * (args.zero > 0),
             f"--tp-style {args.tp_style}" * (args.tp_style != "all-gather"),
             "--p2p-shard" * args.p2p_shard, "--recompute" * args.recompute, "--bf16" * args.bf16,
             f"--optimizer {args.optimizer}" * (args.optimizer != "adamw"),
             f"--bucket-mb {args.bucket_mb:g}" * (args.bucket_mb != 25)]
    return " ".join(flag for flag in flags if flag)


def in_step_bytes(args):
    """What a replica holds for a while within a step beyond the memory table's end. ZeRO-2 and
    3: a chunk's gradient buckets whole from its W to their reduce-scatter, 4 P/v (P: the stage's
    parameters, v chunks), with the parts of the chunks exchanged before; ZeRO-2 keeps every
    chunk's whole until the last micro-batch, and makes no part before it."""
    whole = 4 * sum(replica_lengths(args))       # the stage's gradient: 4 P
    chunk, d = whole // args.virtual_stages, args.dp
    if args.zero < 2:
        return 0
    if args.zero == 2 and args.micro_batches > 1:
        return whole - whole // d
    if args.zero == 3 and args.micro_batches > 1:  # its parts made in the first micro-batch
        return chunk
    return chunk - chunk // d


def predict(args, machine):
    """A layout's row. Stage by stage, from three_d_costs(): what a rank sends a step on each
    group, what it holds, its bubble; on machine, its compute and communication. Then the step:
    the pipeline (the slowest stage's work spread by the bubble; where ranks outnumber cores, the
    schedule played out with the cores shared), the replicas' exchange (ZeRO-3's is inside),
    the update. The step time in parts that add up to it."""
    L, D, B, dp, pp, tp, v, m = (args.num_layers, args.dim, args.batch_size, args.dp, args.pp,
                                 args.tp, args.virtual_stages, args.micro_batches)
    node = rank_grid(dp, pp, tp, args.order) // machine.gpus_per_node   # [dp, pp, tp]
    b, kinds, sizes = B // (dp * m), layer_kinds(L // (pp * v), args.tp_style), dict(
        tp=tp, pp=pp, dp=dp)
    params = sum(replica_lengths(args)) // (dp if args.zero else 1)    # a rank's optimizer's
    stages = []
    for s in range(pp):
        crosses = {"tp": bool((node[:, s] != node[:, s, :1]).any()),
                   "pp": bool((node != node[:, s:s + 1]).any()),
                   "dp": bool((node[:, s] != node[:1, s]).any())}
        chunks = []                # each chunk's (F, B, W) compute a micro-batch
        for c in range(v):
            f = bwd = w = 0.0
            for i, kind in enumerate(kinds):
                t_f, t_b, t_w = machine.layer_s(kind, b, D, tp, args.bf16, need_dx=c + s + i > 0)
                f, bwd, w = f + t_f, bwd + t_b + t_f * args.recompute, w + t_w
            last = c * pp + s == v * pp - 1            # the model's last layers: the loss
            chunks.append((f + machine.loss_s(b, D, args.bf16) * last, bwd, w))
        runs, held, stash, bubble = three_d_costs(args, s, times=[sum(t) for t in zip(*chunks)])
        sent = {group: sum(times * collective_cost(kind, nbytes, sizes[group])[0]
                           for kind, nbytes, times in runs[group]) * (sizes[group] > 1)
                for group in runs}
        comm = {group: sum(times * machine.collective_s(kind, nbytes, sizes[group],
                                                        crosses[group])
                           for kind, nbytes, times in runs[group]) for group in runs}
        memory = {"held": sum(size for size, _ in held.values()), "stash": stash,
                  "in step": in_step_bytes(args)}
        stages.append(dict(bytes={group: float(count) for group, count in sent.items()},
                           memory=memory, bubble=bubble, chunks=chunks, comm_s=comm,
                           compute_s=m * sum(sum(chunk) for chunk in chunks),
                           link_s=machine.collective_s("send", runs["pp"][0][1], 2,
                                                       crosses["pp"]),
                           crosses=[group for group in crosses if crosses[group] and
                                    sizes[group] > 1]))
    pipeline, parts = time_pipeline(args, stages, machine)
    parts["update"] = machine.update_s(params, args.optimizer)
    parts["cores shared"] = 0.0   # ranks beyond the cores: the rest of the played-out step
    if dp * pp * tp > machine.cores:   # (the update runs on every rank at once)
        parts["cores shared"] = pipeline + parts["update"] * dp * pp * tp / machine.cores - \
            sum(parts.values())
    largest = max(stages, key=lambda stage: sum(stage["memory"].values()))
    return dict(flags=layout_flags(args), memory_bytes=sum(largest["memory"].values()),
                bytes={group: max(stage["bytes"][group] for stage in stages) for group in sizes},
                bubble=stages[0]["bubble"], step_s=sum(parts.values()), parts=parts,
                crosses=sorted({group for stage in stages for group in stage["crosses"]}),
                stages=[{key: stage[key] for key in ("bytes", "memory", "crosses")}
                        for stage in stages], args=args)


def time_pipeline(args, stages, machine):
    """The pipeline's seconds and the parts of the step until the update: the slowest stage's
    compute, its communication on each group, the bubble's share of that work."""
    def inside(stage):   # a stage's time in the pipeline: ZeRO-3 exchanges there
        return stage["compute_s"] + stage["comm_s"]["tp"] + stage["comm_s"]["pp"] + \
            stage["comm_s"]["dp"] * (args.zero == 3)
    slowest = max(stages, key=inside)
    parts = dict(compute=slowest["compute_s"], **slowest["comm_s"])
    parts["bubble"] = inside(slowest) * slowest["bubble"] / (1 - slowest["bubble"])
    pipeline = inside(slowest) + parts["bubble"]
    if args.dp * args.pp * args.tp > machine.cores:
        pipeline = play_schedule(args, stages, machine.cores)
    return pipeline + slowest["comm_s"]["dp"] * (args.zero < 3), parts


def play_schedule(args, stages, cores):
    """The pipeline played out: each stage's action list as run_schedule() runs it. A transfer
    arrives a send's time after both its sides are posted; a batch with a receive waits for
    its transfers and the sends before it. Every rank computing at a moment gets an equal share
    of the cores, one at most; a stage's tp (and ZeRO-3) exchanges, a wait of their own."""
    p, v, m, width = args.pp, args.virtual_stages, args.micro_batches, args.dp * args.tp
    actions = [build_schedule(args.schedule, p, s, m, v)[::-1] for s in range(p)]   # popped
    link = max(stage["link_s"] for stage in stages)
    posted, arrives, now = set(), {}, 0.0      # a transfer: (what, micro-batch, receiver)
    waits, unwaited, running = [set() for _ in stages], [set() for _ in stages], {}
    while True:
        for s, stage in enumerate(stages):     # every stage as far as it goes without waiting
            while s not in running and all(arrives.get(key, math.inf) <= now for key in waits[s]):
                waits[s] = set()
                if not actions[s]:
                    waits[s], unwaited[s] = unwaited[s], set()   # its last sends, at the end
                    break
                action = actions[s].pop()
                if action.op != "comm":
                    f, bwd, w = stage["chunks"][action.chunk or 0]
                    talk = stage["comm_s"]["tp"] + stage["comm_s"]["dp"] * (args.zero == 3)
                    running[s] = [{"F": f, "B": bwd + w * (args.schedule != "zb-h1"), "W": w}[
                        action.op], talk / (2 * m * v) * (action.op != "W")]
                    continue
                batch = set()
                for kind, mb, chunk in action.comms:
                    k = (chunk or 0) * p + s
                    key = {SEND_ACT: ("a", mb, k + 1), RECV_ACT: ("a", mb, k),
                           SEND_GRAD: ("g", mb, k - 1), RECV_GRAD: ("g", mb, k)}[kind]
                    if key in posted:
                        arrives[key] = now + link
                    posted.add(key)
                    batch.add(key)
                if any(kind in (RECV_ACT, RECV_GRAD) for kind, _, _ in action.comms):
                    waits[s], unwaited[s] = batch | unwaited[s], set()
                else:
                    unwaited[s] |= batch
        computing = sum(left > 0 for left, _ in running.values()) * width
        rate = min(1.0, cores / computing) if computing else 1.0
        ends = [left / rate if left > 0 else talk for left, talk in running.values()]
        ends += [when - now for when in arrives.values() if when > now]
        if not ends:
            return now
        step = min(ends)
        now += step
        for s, action in list(running.items()):
            if action[0] > 0:
                action[0] -= step * rate
            else:
                action[1] -= step
            if action[0] <= 1e-12 and action[1] <= 1e-12:
                del running[s]


def plan(args):
    """Every layout that fits in a rank's memory, ranked by predicted step time: a table, or
    --json; and a line on why the winner wins."""
    if args.hardware == "cpu":
        cores = len(os.sched_getaffinity(0))
        machine = ThisMachine(args.world_size, cores)
    else:
        figures = {**H100, **{name: vars(args)[name] for name in H100 if name in vars(args)}}
        machine = Machine(**figures, gpus_per_node=args.gpus_per_node, cores=args.world_size)
    rows = [predict(layout, machine) for layout in layouts(args, machine.gpus_per_node)]
    fits = sorted((row for row in rows if row["memory_bytes"] <= machine.memory),
                  key=lambda row: row["step_s"])
    for row in fits:   # the model's FLOPs over what the ranks could do at peak (a CPU: its cores)
        peak = machine.flops * min(args.world_size, machine.cores)
        row["mfu"] = 6 * args.batch_size * args.num_layers * args.dim**2 / (row["step_s"] * peak)
    if args.json:
        print(json.dumps([{key: value for key, value in row.items() if key != "args"}
                          for row in fits], indent=1))
        return
    show_plan(args, machine, rows, fits)


def show_plan(args, machine, rows, fits):
    nodes, shown = -(-args.world_size // machine.gpus_per_node), fits[:args.top or None]
    print(f"plan: {args.world_size} ranks ({nodes} node{'s' * (nodes > 1)} of "
          f"{machine.gpus_per_node}), the MLP of {args.num_layers} layers, D={args.dim}, "
          f"B={args.batch_size}, {'bf16 on fp32 masters' if args.bf16 else 'fp32'}, "
          f"{args.optimizer}; {describe_machine(args, machine)}")
    print(f"{len(rows)} layouts weighed, {len(fits)} fit in {si(machine.memory)}B a rank; the "
          f"{'' if len(shown) == len(fits) else f'{len(shown)} '}best by predicted step time "
          f"(--top 0: all). Bytes: what the busiest rank sends a step, * across nodes")
    width = max([len(short_layout(row["args"])) for row in shown] + [6]) + 2
    print(f"{'#':>4}  {'layout':<{width}}{'memory':>9}{'tp':>9}{'pp':>9}{'dp':>9}{'bubble':>7}"
          f"{'compute':>9}{'comm':>9}{'step':>9}{'MFU':>5}")
    for k, row in enumerate(shown, 1):
        parts, sent = row["parts"], [f"{si(row['bytes'][group])}B{'*' * (group in row['crosses'])}"
                                     for group in ("tp", "pp", "dp")]
        print(f"{k:>4}  {short_layout(row['args']):<{width}}{si(row['memory_bytes']) + 'B':>9}"
              f"{sent[0]:>9}{sent[1]:>9}{sent[2]:>9}{row['bubble']:>7.1%}"
              f"{seconds(parts['compute']):>9}{seconds(parts['tp'] + parts['pp'] + parts['dp']):>9}"
              f"{seconds(row['step_s']):>9}{row['mfu']:>5.0%}")
    print(why(fits) if fits else f"no layout fits in {si(machine.memory)}B a rank: more ranks, "
                                 f"or a smaller model")


def short_layout(a):
    words = [f"dp{a.dp} pp{a.pp} tp{a.tp}", a.order * (a.order != "tp-pp-dp"),
             f"{a.schedule}{f' v{a.virtual_stages}' * (a.virtual_stages > 1)}" * (a.pp > 1),
             f"m{a.micro_batches}", f"zero{a.zero}" * (a.zero > 0),
             "megatron" * (a.tp_style == "megatron"), "p2p-shard" * a.p2p_shard,
             "recompute" * a.recompute]
    return " ".join(word for word in words if word)


def why(fits):
    """The winner against the best layout of another shape: the part of the step it saves most."""
    best = fits[0]
    other = next((row for row in fits if (row["args"].dp, row["args"].pp, row["args"].tp) !=
                  (best["args"].dp, best["args"].pp, best["args"].tp)), None)
    if other is None:
        return f"why: {short_layout(best['args'])} is the only shape that fits"
    gains = {part: other["parts"][part] - best["parts"][part] for part in best["parts"]}
    part = max(gains, key=gains.get)
    return (f"why: {short_layout(best['args'])} ({seconds(best['step_s'])}) beats the best of "
            f"another shape, {short_layout(other['args'])} ({seconds(other['step_s'])}), most on "
            f"{part}: {seconds(best['parts'][part])} against {seconds(other['parts'][part])}")


def describe_machine(args, machine):
    if args.hardware == "cpu":
        return (f"this machine, timed: {machine.cores:.3g} cores for its ranks, "
                f"{si(machine.flops)}FLOP/s a core at best, an all-reduce of 4 MB over "
                f"{args.world_size} ranks "
                f"{seconds(machine.collective_s('all-reduce', 2**22, args.world_size, False))}")
    return (f"H100 figures: {si(machine.flops)}FLOP/s, {si(machine.memory)}B, "
            f"{si(machine.intra)}B/s in a node ({si(machine.all_reduce)}B/s all-reduce), "
            f"{si(machine.inter)}B/s across")


def si(value):   # 3 significant figures and a prefix: 1.23 G
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}"
    return f"{value:.3g} "


def seconds(value):
    return f"{value * 1e3:.3g} ms" if value < 1 else f"{value:.3g} s"


PLAN_FLAGS = ["world_size", "hardware", "gpus_per_node", *H100, "json", "top"]


def add_plan_args(parser):
    plan = parser.add_argument_group("--plan: which layout? (the model's flags, and these)")
    plan.add_argument("--plan", action="store_true",
                      help="rank every layout of --world-size ranks by predicted step time")
    plan.add_argument("--world-size", type=positive_int, default=argparse.SUPPRESS,
                      help="ranks to lay out (default 8)")
    plan.add_argument("--hardware", choices=["cpu", "h100"], default="cpu",
                      help="cpu: this machine, timed at start-up; h100: the published figures "
                           "(and --bf16, which they are for), each changed by its flag below")
    plan.add_argument("--gpus-per-node", type=positive_int, default=8, help="h100: GPUs a node")
    for name, unit in [("flops", "FLOP/s a GPU"), ("memory_gb", "GB a GPU"),
                       ("intra_gbps", "GB/s in a node: collectives and sends"),
                       ("all_reduce_gbps", "GB/s in a node: an all-reduce's bus bandwidth"),
                       ("inter_gbps", "GB/s a GPU across nodes"),
                       ("latency_us", "microseconds a ring step"),
                       ("hbm_gbps", "GB/s of memory: the optimizer's pass")]:
        plan.add_argument(f"--{name.replace('_', '-')}", type=positive_float,
                          default=argparse.SUPPRESS, help=f"h100: {unit} (default {H100[name]:g})")
    plan.add_argument("--json", action="store_true", help="the rows as a JSON list, best first")
    plan.add_argument("--top", type=int, default=20, help="rows printed; 0: every one that fits")


def plan_rules(parser, args):
    """--plan takes the world, the machine and the model; it chooses the rest."""
    used = {"plan", *PLAN_FLAGS, "num_layers", "dim", "batch_size", "optimizer", "bf16",
            "bucket_mb", "backend", "timeout_s"}
    refuse_unused(parser, args, used, "--plan, which chooses it")
    told = next((name for name in H100 if name in vars(args)), "")   # a figure given
    parser.refuse([
        (args.hardware == "cpu" and told, f"--{told.replace('_', '-')}: --hardware cpu is "
                                          f"timed, not told; figures are for --hardware h100"),
        (args.hardware == "cpu" and args.gpus_per_node != 8,
         "--gpus-per-node: --hardware cpu is one node, this machine"),
        (args.top < 0, f"--top {args.top}: expected 0 (every row) or more"),
        (under_torchrun(), "--plan: run it as a plain command, not under torchrun")])
    args.world_size = getattr(args, "world_size", 8)
    if args.hardware == "h100":
        args.bf16 = True
    else:
        args.gpus_per_node = args.world_size
    parser.refuse([(next(layouts(args, args.gpus_per_node), None) is None,
                    f"--world-size {args.world_size}: no layout of it divides --num-layers "
                    f"{args.num_layers}, --dim {args.dim} and --batch-size {args.batch_size}")])


def parse_args(argv=None):
    parser = training_parser("3D parallelism: data x pipeline x tensor parallel on process groups.",
                             dp=True)
    parser.add_argument("--dp", type=positive_int, default=2, help="data-parallel replicas")
    parser.add_argument("--pp", type=positive_int, default=2, help="stages; divides --num-layers")
    parser.add_argument("--tp", type=positive_int, default=2, help="ranks per layer; divides --dim")
    add_schedule_args(parser)
    parser.add_argument("--order", choices=["tp-pp-dp", "tp-dp-pp"], default="tp-pp-dp",
                        help="nesting of the rank map, fastest-varying axis first")
    parser.add_argument("--tp-style", choices=["all-gather", "megatron"], default="all-gather",
                        help="every layer column-parallel with an all-gather, or Megatron's pairs")
    parser.add_argument("--p2p-shard", action="store_true",
                        help="send 1/tp of each activation between stages and all-gather it there")
    parser.add_argument("--show-rank-map", action="store_true", help="print the rank map and exit")
    parser.add_argument("--ray", action="store_true",
                        help="start the ranks as Ray Train workers (needs ray[train])")
    add_plan_args(parser)
    args = parser.parse_args(argv)
    plan_flags = [name for name in PLAN_FLAGS   # given: a default changed, or one suppressed
                  if getattr(args, name, None) != parser.get_default(name) and name in vars(args)]
    if args.plan:
        plan_rules(parser, args)
        return args
    flag = next(iter(plan_flags), "").replace("_", "-")
    parser.refuse([(plan_flags, f"--{flag}: only with --plan (a run's world is --dp x --pp x "
                                f"--tp)")])
    if args.show_rank_map:
        used = {"show_rank_map", "dp", "pp", "tp", "order", "backend", "timeout_s"}
        refuse_unused(parser, args, used, "--show-rank-map")
        return args
    import importlib.util
    parser.refuse([divides(args.dim, "--dim", args.tp, "--tp"),
                   (args.pp > args.num_layers, f"--pp {args.pp}: more stages than --num-layers "
                                               f"({args.num_layers})"),
                   divides(args.num_layers, "--num-layers", args.pp, "--pp"),
                   *schedule_rules(args, args.pp, "--pp")])
    per_chunk = args.num_layers // (args.pp * args.virtual_stages)
    parser.refuse([
        (args.tp_style == "megatron" and per_chunk < 2,
         f"--tp-style megatron: a pair of layers stays inside a stage, where the activation is "
         f"whole on every tp rank, as Megatron cuts stages between whole transformer layers; "
         f"--num-layers {args.num_layers} gives {per_chunk} a stage"
         f"{' chunk' * (args.virtual_stages > 1)}: use fewer stages or all-gather"),
        (args.p2p_shard and args.tp == 1, "--p2p-shard: with --tp 1 there is nothing to shard"),
        (args.p2p_shard and args.pp == 1, "--p2p-shard: with --pp 1 nothing crosses a stage"),
        (args.ray and importlib.util.find_spec("ray") is None,
         "--ray: Ray is not installed; pip install 'ray[train]' (or: make 3d-ray)")])
    check_training_args(parser, args, args.dp * args.pp * args.tp, args.dp, "--dp",
                        "--dp x --pp x --tp")
    return args


# Ray Train's TorchTrainer starts one worker process per rank, on any node of the cluster,
# gives it what torchrun would (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
# MASTER_PORT) and joins the process group before it calls ray_train_func. From there the
# path is torchrun's: spawn() sees RANK and runs this one rank; setup() finds the group joined.

def ray_train_func(config):
    """One Ray Train worker: this rank of the run that config["args"] describes."""
    args = config["args"]
    spawn(three_d_worker, args.dp * args.pp * args.tp, args, backend=config["backend"],
          timeout_s=args.timeout_s)


def ray_launch(args):
    import ray
    from ray.train import ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    world_size = args.dp * args.pp * args.tp
    ray.init()   # joins the cluster of `ray start` (RAY_ADDRESS, or one here), else starts one
    cluster = ray.cluster_resources()
    gpus = cluster.get("GPU", 0)
    use_gpu = args.backend == "nccl" or (args.backend == "auto" and gpus >= world_size)
    backend = "nccl" if use_gpu else "gloo"
    # A share of the cluster's CPUs per rank, at most one: 8 ranks fit on a 2-core laptop.
    resources = {"CPU": min(1.0, cluster.get("CPU", 1) / world_size)}
    resources.update({"GPU": 1} if use_gpu else {})
    if args.save:
        args.save = os.path.abspath(args.save)   # a worker may run in another directory
    TorchTrainer(ray_train_func, train_loop_config={"args": args, "backend": backend},
                 scaling_config=ScalingConfig(num_workers=world_size, use_gpu=use_gpu,
                                              resources_per_worker=resources),
                 torch_config=TorchConfig(backend=backend, timeout_s=args.timeout_s)).fit()


if __name__ == "__main__":
    run_main(main)
