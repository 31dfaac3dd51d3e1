"""Step 5: 3D parallelism. Data, tensor and pipeline parallel at once, on process groups.

    python three_d.py                                   # dp=2 pp=2 tp=2: 8 ranks (make 3d)
    python three_d.py --dp 2 --pp 2 --tp 2 --check      # ...and compare with serial training
    python three_d.py --dp 1 --pp 4 --tp 2 --schedule gpipe --order tp-dp-pp
    python three_d.py --show-rank-map --dp 2 --pp 2 --tp 2
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

    def train_step(self):
        """Every micro-batch forward and backward through the pipeline, each bucket's gradient
        summed over the replicas once final (reduce-scattered, with --zero); then / dp."""
        self.replica.begin_step()
        for stage in self.stages:
            stage.begin_step()
        run_schedule(self.actions, self.stages, self.micro_inputs, self.prev_rank,
                     self.next_rank, self.buffer_shape, **self.boundary)
        self.replica.average()


def three_d_costs(args, stage):
    """What a rank of stage `stage` costs a step, from steps 2-4's costs: its collectives on
    each group, {"tp", "pp", "dp": [(kind, bytes of the tensor, times)]}; what its replica holds
    at the step's end, {kind: (bytes, formula)}; its most stash, in bytes; its stage's bubble."""
    v, m, tp = args.virtual_stages, args.micro_batches, args.tp
    per_chunk = args.num_layers // (args.pp * v)
    act = args.batch_size // (args.dp * m) * args.dim * (2 if args.bf16 else 4)   # [b, D]
    tp_runs = tp_costs(layer_kinds(per_chunk, args.tp_style) * v, act, m, stage == 0,
                       args.recompute)
    sent = act // tp if args.p2p_shard else act                 # --p2p-shard: 1/tp crosses
    bubble, stash, pp_runs = pipeline_costs(args.schedule, args.pp, stage, m, v, per_chunk, act,
                                            args.recompute)
    pp_runs = [(kind, sent, times) for kind, _, times in pp_runs]
    if args.p2p_shard:                                          # and is all-gathered on arrival
        tp_runs += [("all-gather", act, times) for _, _, times in pp_runs]
    dp_runs, held = dp_costs(replica_lengths(args), args.dp, args.zero, m, args.optimizer,
                             args.bf16, args.recompute)
    return {"tp": tp_runs, "pp": pp_runs, "dp": dp_runs}, held, stash, bubble


def three_d_worker(rank, world_size, args):
    device = setup(rank, world_size)
    me = ThreeDRank(rank, args, device)
    if rank == 0:
        show_rank_map(args.dp, args.pp, args.tp, args.order)
        print(f"each stage{' chunk' * (args.virtual_stages > 1)}: {describe(me.kinds)} over "
              f"tp={args.tp}", flush=True)
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
    elif args.ray:   # the same ranks, started by Ray instead of spawn (below)
        ray_launch(args)
    else:
        spawn(three_d_worker, args.dp * args.pp * args.tp, args, backend=args.backend,
              timeout_s=args.timeout_s)


# Below the fold: the shards put back together, the rank map's print, the command line and
# --ray. -----------------------------------------------------------------------------------
import os  # noqa: E402

from collectives import positive_int  # noqa: E402
from data_parallel import (SerialCheck, check_training_args, finish_run,  # noqa: E402
                           full_grads, full_weights, global_loss, init_weights, make_batch,
                           make_buckets, show_memory, step_line, training_parser)
from pipeline_parallel import add_schedule_args, gather_on_rank0, schedule_rules  # noqa: E402
from tensor_parallel import describe, divides, refuse_unused  # noqa: E402


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
    args = parser.parse_args(argv)
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
