"""Step 5: 3D parallelism. Data, tensor and pipeline parallel at once, on process groups.

    python three_d.py                                   # dp=2 pp=2 tp=2: 8 ranks (make 3d)
    python three_d.py --dp 2 --pp 2 --tp 2 --check      # ...and compare with serial training
    python three_d.py --dp 1 --pp 4 --tp 2 --schedule gpipe --order tp-dp-pp
    python three_d.py --show-rank-map --dp 2 --pp 2 --tp 2
    python three_d.py --count-comm --p2p-shard --steps 1  # bytes each rank sends, per dimension
    python three_d.py --bench --steps 5                 # against serial and PyTorch's own 3D composition
    torchrun --nproc-per-node 8 three_d.py              # one node; the README has two nodes
    python three_d.py --ray                             # the ranks as Ray Train workers (make 3d-ray)

Nothing new is computed here: this file composes the blocks of steps 2-4.
- Every layer is the column-parallel layer of step 3, over the stage's TP group.
- The stages run the schedules and the runner of step 4; the rank with TP
  coordinate t sends to the next stage's rank with the same t.
- After all micro-batches, each shard's gradient is averaged over its DP group with
  the averager of step 2, once, and the optimizer steps.
What is new is the rank map: which ranks form each group. The from-scratch 3D code
that the lecture inspired hard-codes it for 8 ranks (and a rank-group utility often
used with it picks the wrong groups for 6 of 8 ranks); rank_groups() derives it for
any sizes and any nesting order.
"""
import os
import re
import shutil
import tempfile
from fractions import Fraction

import warnings

warnings.filterwarnings("ignore", "Failed to initialize NumPy")  # torch's import warns without numpy; nothing here needs it
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from collectives import (CommCounter, RankFailed, check_and_race, check_launch_args,
                         cleanup, end_race, log, positive_int, print_race, report_comm, run_main, setup, spawn,
                         spawn_returning, under_torchrun)
from data_parallel import (CHECK_TOLERANCE, GradientAverager, as_module, bench_sizes, check_divides,
                           check_training_args, dp_comm_formula, finish_run, gather_on_rank0, global_loss,
                           init_weights, make_batch, make_optimizer, replica_rows, serial_side, sgd_side,
                           training_parser)
from pipeline_parallel import Stage, build_schedule, pp_comm_formula, run_schedule, stage_layers
from tensor_parallel import (all_gather_columns, column_backward, column_forward, megatron_comparison, shard_columns,
                             tp_comm_formula)


# ----------------------------------------------------------------------------------
# The rank map
# ----------------------------------------------------------------------------------

# The map that from-scratch 3D code hard-codes for dp = pp = tp = 2, written out by hand:
HARD_CODED_MAP_2x2x2 = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],   # neighbours share every layer
    "pp": [[0, 2], [1, 3], [4, 6], [5, 7]],   # 0 -> 2, 1 -> 3, 4 -> 6, 5 -> 7
    "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],   # replicas
}
# ...which is the formula rank = (d * PP + p) * TP + t, i.e. arange(8).view(dp, pp, tp)
# read along each axis. rank_groups() computes it for any sizes.
#
# Which axis varies fastest is a choice (--order, named fastest first, as Megatron's
# order string). TP goes innermost in both orders we offer: it talks at every layer,
# so its ranks should share the fastest links, inside one node.
#   tp-pp-dp (default, as that code does): replicas outermost. DP's all-reduce, once per
#     step but as big as the model, crosses nodes.
#   tp-dp-pp (Megatron, torchtitan): stages outermost. Only the pipeline's
#     point-to-point activations cross nodes: the lightest traffic of the three.

AXES = ("dp", "pp", "tp")


def rank_grid(dp, pp, tp, order="tp-pp-dp"):
    """The world as a tensor indexed [d, p, t] holding each coordinate's rank."""
    fastest_first = order.split("-")
    sizes = {"dp": dp, "pp": pp, "tp": tp}
    slowest_first = fastest_first[::-1]
    grid = torch.arange(dp * pp * tp).view(*(sizes[a] for a in slowest_first))   # ranks laid out in order
    return grid.permute(*(slowest_first.index(a) for a in AXES))                  # [dp, pp, tp]


def rank_groups(dp, pp, tp, order="tp-pp-dp"):
    """{"dp": [...], "pp": [...], "tp": [...]}: for each kind, a partition of all ranks
    into groups, each group in ascending rank order. A group varies one coordinate and
    fixes the other two."""
    grid = rank_grid(dp, pp, tp, order)
    groups = {}
    for axis, name in enumerate(AXES):
        lines = grid.movedim(axis, -1).reshape(-1, grid.shape[axis])   # one row per group
        groups[name] = sorted(sorted(row) for row in lines.tolist())
    return groups


def coordinates(rank, groups):
    """(d, p, t) of a rank: its position in its own dp, pp and tp group."""
    return tuple(next(g.index(rank) for g in groups[name] if rank in g) for name in AXES)


def show_rank_map(dp, pp, tp, order):
    groups = rank_groups(dp, pp, tp, order)
    width = {name: len(str(groups[name][0])) + 2 for name in ("tp", "pp", "dp")}
    print(f"rank map: dp={dp} pp={pp} tp={tp}, order {order} (fastest first)")
    print(f"{'rank':>5} {'dp':>3} {'pp':>3} {'tp':>3}   " + "".join(
        f"{name + ' group':<{max(width[name], 10)}}" for name in ("tp", "pp", "dp")))
    for rank in range(dp * pp * tp):
        d, p, t = coordinates(rank, groups)
        mine = {name: next(g for g in groups[name] if rank in g) for name in AXES}
        print(f"{rank:>5} {d:>3} {p:>3} {t:>3}   " + "".join(
            f"{str(mine[name]):<{max(width[name], 10)}}" for name in ("tp", "pp", "dp")))


# ----------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------

class ShardedP2PStage(Stage):
    """--p2p-shard (Megatron's scatter-gather): what crosses a stage boundary is the
    same on every TP rank, so each rank sends only its 1/tp slice and the receiving
    stage all-gathers it. 1/tp of the point-to-point bytes, one all-gather more."""

    def __init__(self, *args, tp_group, **kwargs):
        super().__init__(*args, **kwargs)
        self.tp_group = tp_group

    def outgoing(self, tensor):
        tp_rank, tp_size = dist.get_rank(self.tp_group), dist.get_world_size(self.tp_group)
        cols = tensor.shape[1] // tp_size
        return tensor[:, tp_rank * cols:(tp_rank + 1) * cols].contiguous()   # [b, D/T]

    def incoming(self, buffer):
        return all_gather_columns(buffer, self.tp_group)                      # [b, D]


def three_d_comm_formula(args, p, act_bytes, param_bytes):
    """Bytes one rank of stage p sends per step (--count-comm), from the blocks'
    formulas: tp for its stage's layers, pp for its stage boundaries, dp for its shards
    (param_bytes). act_bytes: one micro-batch's activation [B/(dp m), D]."""
    m, t, layers = args.micro_batches, args.tp, args.num_layers // args.pp
    formula = tp_comm_formula(layers, layers - (p == 0), act_bytes, m, t)   # the model's first layer needs no dx
    formula.update(pp_comm_formula(p, args.pp, act_bytes // t if args.p2p_shard else act_bytes, m))
    formula.update(dp_comm_formula(param_bytes, args.dp))
    if args.p2p_shard:   # every tensor received from a neighbouring stage is all-gathered over tp
        received = (p > 0) + (p < args.pp - 1)
        gathered, how = formula[("tp", "all-gather")]
        formula[("tp", "all-gather")] = (gathered + Fraction(received * m * (t - 1) * act_bytes, t),
                                         f"{how} + {received} received x {m} mb x ({t}-1)/{t} x {act_bytes}")
    return formula


class ThreeDRank:
    """One rank's share of the 3D job: its groups and coordinates, its shards of its
    stage's layers, its replica's micro-batches, and the stage and schedule that run them."""

    def __init__(self, rank, args, device):
        groups = rank_groups(args.dp, args.pp, args.tp, args.order)
        mine = {}
        for name in ("tp", "pp", "dp"):            # every rank creates every group, in the same order
            for ranks in groups[name]:
                handle = dist.new_group(ranks)
                if rank in ranks:
                    mine[name] = (handle, ranks)
        self.groups = {name: handle for name, (handle, _) in mine.items()}
        self.d, self.p, self.t = d, p, t = coordinates(rank, groups)
        self.tag = f"[dp{d} pp{p} tp{t}]"
        tp_group, pp_ranks = self.groups["tp"], mine["pp"][1]
        dist.barrier()   # a collective on every rank before the first point-to-point (NCCL asks for it)
        first, last = p == 0, p == args.pp - 1

        # This rank's weights: the layers of stage p, each sliced to TP rank t's columns.
        self.full = init_weights(args.num_layers, args.dim, args.seed)
        self.layers = stage_layers(args.num_layers, args.pp, p)
        self.shards = [shard_columns(self.full[i], t, args.tp).to(device) for i in self.layers]   # [D, D/T] each

        # This replica's slice of the batch, by its DP coordinate; the same on every TP rank.
        self.inputs, self.targets = make_batch(args)
        rows = replica_rows(args.batch_size, d, args.dp)
        self.replica_inputs, self.replica_targets = self.inputs[rows].to(device), self.targets[rows].to(device)
        m = args.micro_batches
        self.micro_inputs = self.replica_inputs.chunk(m)         # [B/(dp m), D] each
        n = len(rows) * args.dim                                  # the replica's mean loss divides by n

        def tp_forward(x, w):
            return column_forward(x, w, tp_group)

        def tp_backward(g, stash, w, need_dx):
            return column_backward(g, stash, w, tp_group, need_dx)

        kind = dict(cls=ShardedP2PStage, tp_group=tp_group) if args.p2p_shard else dict(cls=Stage)
        self.stage = kind.pop("cls")(self.shards, first, last, self.replica_targets.chunk(m), n,
                                     forward_fn=tp_forward, backward_fn=tp_backward, **kind)
        self.buffer_shape = (len(rows) // m, args.dim // args.tp if args.p2p_shard else args.dim)
        self.actions = build_schedule(args.schedule, args.pp, p, m)
        self.prev_rank = pp_ranks[p - 1] if not first else None
        self.next_rank = pp_ranks[p + 1] if not last else None
        self.averager = GradientAverager(self.groups["dp"])

    def gradients(self):
        """Every micro-batch forward and backward through the pipeline, then the
        gradients averaged over the replicas, once. Returns them, one per shard."""
        self.stage.grads = [torch.zeros_like(w) for w in self.shards]
        self.stage.loss = 0.0
        run_schedule(self.actions, self.stage, self.micro_inputs, self.prev_rank, self.next_rank, self.buffer_shape)
        self.averager.finish(self.stage.grads)
        return self.stage.grads


def three_d_worker(rank, world_size, args):
    device = setup(rank, world_size)
    me = ThreeDRank(rank, args, device)
    if rank == 0:
        show_rank_map(args.dp, args.pp, args.tp, args.order)
    last = me.p == args.pp - 1
    optimizer = make_optimizer(me.shards, args)
    comm = CommCounter(me.groups, enabled=args.count_comm)
    losses = []
    for step in range(args.steps):
        with comm.step():                     # --count-comm counts what this sends
            grads = me.gradients()
        for w, grad in zip(me.shards, grads):
            w.grad = grad
        optimizer.step()
        if last:                              # the last stage knows the loss; average it over replicas
            losses.append(global_loss(torch.tensor(me.stage.loss, device=device), me.groups["dp"]))
            if me.d == 0 and me.t == 0:
                log(me.tag, f"step {step:3d}  loss {losses[-1]:.6f}")
    if args.count_comm:
        act_bytes = me.buffer_shape[0] * args.dim * me.shards[0].element_size()
        param_bytes = sum(w.numel() * w.element_size() for w in me.shards)
        report_comm(comm, three_d_comm_formula(args, me.p, act_bytes, param_bytes),
                    megatron_comparison(args.num_layers, act_bytes, args.micro_batches, args.tp))

    # Rank 0 gathers every rank's shards, [world, L/pp, D, D/tp], and rebuilds the full
    # matrices from replica 0's: stage p holds layers p L/pp.., TP rank t their columns t.
    shards = gather_on_rank0(torch.stack(me.shards))
    grid = rank_grid(args.dp, args.pp, args.tp, args.order)               # [dp, pp, tp] -> rank
    losses = torch.tensor(losses if last else [0.0] * args.steps, dtype=torch.float64, device=device)
    dist.broadcast(losses, src=grid[0, args.pp - 1, 0].item())            # the last stage has them
    if rank == 0:
        stages = [torch.cat([shards[grid[0, p, t]] for t in range(args.tp)], dim=2) for p in range(args.pp)]
        final = list(torch.cat(stages))                                   # L x [D, D]
        finish_run(args, me.full, final, losses.tolist(), me.inputs, me.targets)
    cleanup()


# ----------------------------------------------------------------------------------

def main(argv=None):
    parser = training_parser("3D parallelism: data x pipeline x tensor parallel on process groups.")
    parser.add_argument("--dp", type=positive_int, default=2, help="data-parallel replicas")
    parser.add_argument("--pp", type=positive_int, default=2, help="pipeline stages; divides --num-layers")
    parser.add_argument("--tp", type=positive_int, default=2, help="tensor-parallel ranks per layer; divides --dim")
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b", help="pipeline schedule")
    parser.add_argument("--order", choices=["tp-pp-dp", "tp-dp-pp"], default="tp-pp-dp",
                        help="nesting of the rank map, fastest-varying axis first (see rank_groups)")
    parser.add_argument("--p2p-shard", action="store_true",
                        help="send 1/tp of each activation between stages and all-gather it there")
    parser.add_argument("--show-rank-map", action="store_true", help="print the rank map and exit")
    parser.add_argument("--ray", action="store_true",
                        help="start the ranks as Ray Train workers, on the Ray cluster if one runs (needs ray[train])")
    args = parser.parse_args(argv)
    if args.show_rank_map:
        show_rank_map(args.dp, args.pp, args.tp, args.order)
        return
    world_size = args.dp * args.pp * args.tp
    check_divides(parser, args.dim, "--dim", args.tp, "--tp")
    if args.pp > args.num_layers:
        parser.error(f"--pp {args.pp}: more stages than --num-layers ({args.num_layers})")
    check_divides(parser, args.num_layers, "--num-layers", args.pp, "--pp")
    check_divides(parser, args.batch_size, "--batch-size", args.dp * args.micro_batches, "--dp x --micro-batches")
    check_training_args(parser, args)
    check_launch_args(parser, args, world_size, flag="--dp x --pp x --tp")
    if args.ray:   # the same ranks, started by Ray instead of spawn (the section below)
        ray_launch(parser, args, world_size)
        return
    if args.bench:   # ours against serial and PyTorch's own composition (the last section)
        print_race(versus_torch_3d(args))
        return
    spawn(three_d_worker, world_size, args, backend=args.backend, timeout_s=args.timeout_s)


# ----------------------------------------------------------------------------------
# --ray: the same ranks as Ray Train workers
# ----------------------------------------------------------------------------------
#
# Ray's TorchTrainer starts one worker process per rank, on any node of the cluster,
# gives it what torchrun would (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
# MASTER_ADDR, MASTER_PORT) and joins the process group before it calls
# ray_train_func. From there the path is torchrun's: spawn() sees RANK and runs this
# one rank, and setup() finds the group already joined.

def ray_train_func(config):
    """Body of one Ray Train worker: this rank of the run that config["args"] describes."""
    args = config["args"]
    spawn(three_d_worker, args.dp * args.pp * args.tp, args, backend=config["backend"], timeout_s=args.timeout_s)


def ray_launch(parser, args, world_size):
    import importlib.util
    import os
    if importlib.util.find_spec("ray") is None:
        parser.error("--ray: Ray is not installed; pip install 'ray[train]' (or: make 3d-ray)")
    import ray
    from ray.train import ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init()   # joins the cluster of `ray start` (RAY_ADDRESS, or one on this machine), else starts one here
    cluster = ray.cluster_resources()
    use_gpu = args.backend == "nccl" or (args.backend == "auto" and cluster.get("GPU", 0) >= world_size)
    backend = "nccl" if use_gpu else "gloo"
    # A share of the cluster's CPUs per rank, at most one: 8 ranks fit on a 2-core laptop.
    resources = {"CPU": min(1.0, cluster.get("CPU", 1) / world_size), **({"GPU": 1} if use_gpu else {})}
    if args.save:
        args.save = os.path.abspath(args.save)   # a worker may run in another directory
    trainer = TorchTrainer(ray_train_func, train_loop_config={"args": args, "backend": backend},
                           scaling_config=ScalingConfig(num_workers=world_size, use_gpu=use_gpu,
                                                        resources_per_worker=resources),
                           torch_config=TorchConfig(backend=backend, timeout_s=args.timeout_s))
    trainer.fit()


# ----------------------------------------------------------------------------------
# What PyTorch gives you for this: DeviceMesh (dp, pp, tp) composed (--bench)
# ----------------------------------------------------------------------------------
#
# PyTorch's own pieces on the same rank map: torch.distributed.pipelining over the pp
# groups, ColwiseParallel inside each stage over the tp groups, and one of three ways
# across dp: a manual all-reduce of the gradients, FSDP2 (fully_shard), or DDP.
# DDP with its defaults goes wrong in this composition on torch 2.13 (gloo): its first
# step's gradients are m times too large (after TP, DDP's module lists no parameters,
# so the schedule's division by m finds none), and its second step fails (see
# ddp_as_composed). DDP runs here with find_unused_parameters=True, scale_grads=False,
# and the division by m done by hand, on our own references to the parameters.

DP_WAYS = ("all-reduce", "FSDP2", "DDP")


def torch_3d_race(rank, world_size, args):
    device = setup(rank, world_size)
    quiet_dtensor_warnings()
    mesh = torch_mesh(args, device)
    ours, full, inputs, targets = our_3d_side(rank, args, device)
    sides = {"ours": ours, "serial: our step, whole batch, 1 rank": serial_side(args, device)}
    for dp_way in DP_WAYS:
        sides[f"torch 3D, dp by {dp_way}"] = torch_3d_side(args, mesh, device, dp_way, full, inputs, targets)
    result = check_and_race(sides, device, args.steps)
    end_race(sides)
    return result


def torch_3d_side(args, mesh, device, dp_way, full, inputs, targets, ddp_fixed=True):
    """PyTorch's composition on this rank, with SGD, as (step, state) in our layout."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    d, p, t = (mesh[name].get_local_rank() for name in AXES)
    first, last, m = p == 0, p == args.pp - 1, args.micro_batches
    model = as_module([full[i] for i in stage_layers(args.num_layers, args.pp, p)], device)
    parallelize_module(model, mesh["tp"], {str(i): ColwiseParallel(output_layouts=Replicate())
                                           for i in range(0, len(model), 2)})
    if dp_way == "FSDP2":
        fully_shard(model, mesh=mesh["dp"])         # reduce-scatters the gradients, averaged over dp
    if dp_way == "DDP":
        model = DistributedDataParallel(model, device_mesh=mesh["dp"], find_unused_parameters=ddp_fixed)
    params = list(model.parameters())               # ours to keep: after DDP's first forward it has none
    # Shapes given up front (static mode): inferring them sends pickled objects, which needs numpy;
    # an activation between stages requires grad, as its gradient is sent back. [B/(dp m), D]
    example = inputs[:len(inputs) // m].clone().requires_grad_()
    scale_grads = dp_way != "DDP" or not ddp_fixed  # the schedule's division by m misses DDP's parameters
    schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule](
        PipelineStage(model, p, args.pp, device, group=mesh["pp"].get_group(),   # shapes given: static mode
                      input_args=example if p else example.detach(), output_args=example),
        m, loss_fn=F.mse_loss,
        scale_grads=scale_grads)
    optimizer = torch.optim.SGD(params, lr=args.lr)

    def step():
        optimizer.zero_grad()
        schedule.step(*[inputs] if first else [], **dict(target=targets) if last else {}, return_outputs=False)
        if not scale_grads:
            for q in params:
                q.grad.div_(m)
        if dp_way == "all-reduce":
            for q in params:
                dist.all_reduce(q.grad.to_local(), op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
        optimizer.step()

    def our_layout(tensors):
        """Each weight or gradient as our shard W_t [D, D/T]: the local part of a DTensor
        sharded over tp is W_t^T; FSDP2's is cut over dp too, so gather it whole first."""
        shards = []
        for x in tensors:
            if getattr(x, "device_mesh", None) is not None and x.device_mesh.ndim > 1:
                x = x.full_tensor()[t * args.dim // args.tp:(t + 1) * args.dim // args.tp]
            shards.append((x.to_local() if hasattr(x, "to_local") else x).T)
        return shards
    return step, lambda: (our_layout(params), our_layout([q.grad for q in params]))


def our_3d_side(rank, args, device):
    """Our step (three_d_worker's, with SGD) as (step, state); and the full weights and
    this replica's batch, for the other sides."""
    me = ThreeDRank(rank, args, device)
    return sgd_side(me.shards, me.gradients, args.lr), me.full, me.replica_inputs, me.replica_targets


def ddp_as_composed(rank, world_size, args, path):
    """DDP in the composition with its defaults (find_unused_parameters=False, the
    schedule's scale_grads): rank 0 saves how its first step's gradients compare with
    ours, then a second step runs, and fails on this torch."""
    device = setup(rank, world_size)
    quiet_dtensor_warnings()
    mesh = torch_mesh(args, device)
    (ours, ours_state), full, inputs, targets = our_3d_side(rank, args, device)
    theirs, theirs_state = torch_3d_side(args, mesh, device, "DDP", full, inputs, targets, ddp_fixed=False)
    sides = {"ours": (ours, ours_state), "DDP": (theirs, theirs_state)}
    ours()
    theirs()
    norms = torch.tensor([sum(g.square().sum() for g in state()[1]).item() for state in (ours_state, theirs_state)],
                         device=device)
    dist.all_reduce(norms)                                     # squared norms of the whole model's gradients
    if rank == 0:
        with open(path, "w") as f:                             # text: torch.save can hang in a forked rank
            f.write(str((norms[1] / norms[0]).sqrt().item()))
    del ours, ours_state, theirs, theirs_state
    sides["DDP"][0]()                                          # the second step
    end_race(sides)


def torch_mesh(args, device):
    """PyTorch's DeviceMesh over our rank map: the grid [dp, pp, tp] of ranks."""
    from torch.distributed.device_mesh import DeviceMesh
    return DeviceMesh(device.type, rank_grid(args.dp, args.pp, args.tp, args.order), mesh_dim_names=AXES)


def quiet_dtensor_warnings():
    """Gathering an FSDP2 + TP weight whole (for the check, not timed) warns on every rank."""
    import logging
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def versus_torch_3d(args):
    """Run the race, then DDP with its defaults; return what print_race prints."""
    import torch.distributed.fsdp  # noqa: F401  (~5 s with the two below) once, before the ranks fork
    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401
    world_size, launch = args.dp * args.pp * args.tp, dict(backend=args.backend, timeout_s=args.timeout_s)
    times, diffs = spawn_returning(torch_3d_race, world_size, args, **launch)
    failure = "not run under torchrun (its failure would end the ranks)" if under_torchrun() else \
        ddp_failure(args, world_size, launch)
    notes = [f"DDP with its defaults (find_unused_parameters=False) and the schedule's (scale_grads=True): {failure}"]
    return dict(title=f"3D (dp={args.dp} pp={args.pp} tp={args.tp}, {args.schedule}) vs serial and PyTorch's own "
                      f"composition: {bench_sizes(args, world_size)}\n  torch 3D is DeviceMesh (dp, pp, tp), "
                      f"torch.distributed.pipelining over pp, ColwiseParallel over tp, and across dp: "
                      f"{', '.join(DP_WAYS)} (DDP: find_unused_parameters=True, scale_grads=False, / m by hand)",
                times=times, diffs=diffs, world_size=world_size, steps=args.steps, tolerance=CHECK_TOLERANCE,
                notes=notes,
                ratios=[("ours", name) for name in times if name.startswith("torch")])


def ddp_failure(args, world_size, launch):
    """What goes wrong with DDP composed with its defaults, in one line."""
    folder = tempfile.mkdtemp(prefix="parallel-ddp-")
    path = os.path.join(folder, "ratio")
    try:
        try:
            spawn(ddp_as_composed, world_size, args, path, **launch)
            error = "the second step ran"
        except RankFailed as e:
            # The root cause: the first "SomethingError: ..." line of the failing rank's traceback
            error = next((line for line in e.text.splitlines() if re.match(r"\w+(Error|Exception): \S", line)),
                         str(e))
        ratio = None
        if os.path.exists(path):
            with open(path) as f:
                ratio = float(f.read())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    first = "no first step" if ratio is None else f"first step's gradients {ratio:.2f}x ours (m = {args.micro_batches})"
    return f"{first}; second step: {error}"


if __name__ == "__main__":
    run_main(main)
