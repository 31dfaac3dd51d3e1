"""Step 5: 3D parallelism. Data, tensor and pipeline parallel at once, on process groups.

    python three_d.py                                   # dp=2 pp=2 tp=2: 8 ranks (make 3d)
    python three_d.py --dp 2 --pp 2 --tp 2 --check      # ...and compare with serial training
    python three_d.py --dp 1 --pp 4 --tp 2 --num-layers 4 --schedule gpipe --order tp-dp-pp
    python three_d.py --tp-style megatron --sequence-parallel --check   # T split over tp too
    python three_d.py --dp 1 --pp 2 --tp 2 --cp 2 --check   # and T over cp: ring attention
    python three_d.py --dp 1 --pp 2 --num-layers 4 --micro-batches 4 --schedule dualpipev
    python three_d.py --experts 4 --ep 2 --check        # experts: 2 of the 4 on each replica
    python three_d.py --show-rank-map --dp 2 --pp 2 --tp 2
    python three_d.py --ray                             # the ranks as Ray Train workers
    python three_d.py --plan --hardware h100            # which layout? 8 H100s, ranked
    python three_d.py --checkpoint ckpt --checkpoint-every 50   # then: --resume ckpt, any layout
    torchrun --nproc-per-node 8 three_d.py              # one node; the README has two nodes

Nothing new is computed here: this file composes the blocks of steps 2-4.
- Every layer is one of step 3's tensor-parallel layers over the stage's TP group (the
  all-gather layer, or Megatron's column-then-row pairs: --tp-style).
- The stages run step 4's schedules and runner; tp rank t sends to the next stage's t.
- After the last micro-batch step 2's DataParallel averages each shard's gradient over its
  DP group (with --zero, sharded over the replicas), and the optimizer steps.
What is new is the rank map: which ranks form each group. From-scratch 3D code often
hard-codes it for 8 ranks; rank_groups() derives it for any sizes and nesting order, with --cp
beside tp and --ep inside dp (step 2's experts, each held by the replicas of its ep rank). And a
stopped run resumes at any layout: --checkpoint has each piece written once, by the rank that
holds it (replica 0's, or each replica's range of a ZeRO bucket; its tp box: shard_box), and
--resume has each rank read what overlaps its own (data_parallel.py, below its fold: DCP's way).

Read in parts: 1, the rank map; 2, a rank's share of the job, set up in five steps; 3, the
worker that trains with them.

What PyTorch gives you: a DeviceMesh of shape (dp, pp, tp) with pipelining over pp,
ColwiseParallel over tp, and FSDP2 or DDP over dp (tests/bench.py races it against this).
"""
import argparse
import warnings
from datetime import timedelta
from functools import partial
from operator import attrgetter
warnings.filterwarnings("ignore", "Failed to initialize NumPy")   # torch warns without numpy
import torch
import torch.distributed as dist

from collectives import cleanup, ray_launch, run_main, setup, spawn
from data_parallel import (MoE, Router, WithExperts, balance, dp_costs, init_params,
                           make_batch, make_replica, replica_rows, spans_of, tensors_of)
from data_parallel import (SerialCheck, global_loss, load_checkpoint, log_step,   # the worker's
                           save_checkpoint, whole_on_rank0)       # --check, loss, checkpoints
from pipeline_parallel import (Stage, block_stash, build_schedule, pipeline_costs, run_schedule,
                               stage_parts, virtual_stage)
from tensor_parallel import (all_gather_columns, clip_shares, cp_costs,
                             cp_group_lists, cp_positions, held_boxes, kv_group, kv_width,
                             my_columns, part_kinds, reduce_over, shard, sum_partial_grads,
                             tensor_kinds, tp_blocks, tp_copies, tp_costs,
                             vocab_parallel_cross_entropy)

# Part 1: the rank map -----------------------------------------------------------------------------

AXES = ("dp", "pp", "tp")

# The map that from-scratch 3D code hard-codes for dp = pp = tp = 2, written out by hand:
HARD_CODED_MAP_2x2x2 = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],   # neighbours share every layer
    "pp": [[0, 2], [1, 3], [4, 6], [5, 7]],   # 0 -> 2, 1 -> 3, 4 -> 6, 5 -> 7
    "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],   # replicas
}
# It is rank = (d PP + s) TP + t: grid = arange(8).view(dp, pp, tp), read along each axis.
#   grid = [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]; rank 6 = (1 * 2 + 1) * 2 + 0 = grid[1, 1, 0].
#   Its groups vary one coordinate: tp grid[1, 1, :] = [6, 7], pp grid[1, :, 0] = [4, 6],
#   dp grid[:, 1, 0] = [2, 6].
# Which axis varies fastest is a choice (--order, fastest first, as Megatron's order string).
# TP is innermost in both orders offered: it talks at every layer, so it keeps to a node.
#   tp-pp-dp (the default, as that code does): replicas outermost; DP's all-reduce, once a
#     step but as big as the model, crosses nodes.
#   tp-dp-pp (Megatron, torchtitan): stages outermost, rank = (s DP + d) TP + t; only the
#     pipeline's activations, the lightest traffic, cross nodes. Rank 5 = (1 * 2 + 0) * 2 + 1
#     sits at s=1, d=0, t=1: tp [4, 5], pp [1, 5], dp [5, 7].


def rank_grid(dp, pp, tp, order="tp-pp-dp"):
    """The world as a tensor indexed [d, p, t] that holds each coordinate's rank."""
    slowest_first = order.split("-")[::-1]
    sizes = {"dp": dp, "pp": pp, "tp": tp}
    grid = torch.arange(dp * pp * tp).view(*(sizes[a] for a in slowest_first))   # laid out in order
    return grid.permute(*(slowest_first.index(a) for a in AXES))                  # [dp, pp, tp]


def rank_groups(dp, pp, tp, order="tp-pp-dp", cp=1, ep=1, args=None):
    """{"dp": [...], "pp": [...], "tp": [...]}, "cp" with --cp, "ep" and "ep_copies" with --ep:
    for each kind, a partition of all ranks into groups, each in ascending order. A group varies
    one coordinate and fixes the others. cp sits next to tp (tp-cp-pp-dp, tp-cp-dp-pp): the map
    is 3D's with tp cp ranks in tp's place, each such block cut into cp tp groups of consecutive
    ranks, and tp cp groups that take one rank of each (rank = (.. ) tp cp + c tp + t). ep sits
    inside dp: each dp group cut into ep groups of P replicas in a row; an expert's copies, the
    dp/P replicas at one place in their ep groups, hold it (step 2's ep_groups). args: the
    hybrid's "ulysses" and "ring" within each cp group (step 3's cp_group_lists)."""
    grid = rank_grid(dp, pp, tp * cp, order)
    groups = {}
    for axis, name in enumerate(AXES):
        lines = grid.movedim(axis, -1).reshape(-1, grid.shape[axis])   # axis last: a row per group
        groups[name] = sorted(sorted(row) for row in lines.tolist())
    if cp > 1:
        blocks = groups["tp"]                                  # tp cp ranks each
        groups["tp"] = sorted(block[c * tp:(c + 1) * tp] for block in blocks for c in range(cp))
        groups["cp"] = sorted(block[t::tp] for block in blocks for t in range(tp))
        if args is not None:
            groups.update(cp_group_lists(groups["cp"], args))
    if ep > 1:
        groups["ep"] = sorted(g[i:i + ep] for g in groups["dp"] for i in range(0, dp, ep))
        groups["ep_copies"] = sorted(g[r::ep] for g in groups["dp"] for r in range(ep))
    return groups


def coordinates(rank, groups):
    """(d, p, t) of a rank: its position in its own dp, pp and tp groups."""
    return tuple(next(g.index(rank) for g in groups[name] if rank in g) for name in AXES)


# Part 2: a rank's share, set up in five steps ----------------------------------------------------

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
        groups = rank_groups(args.dp, args.pp, args.tp, args.order, args.cp, args.ep, args)
        timeout = timedelta(seconds=args.timeout_s)
        names = [name for name in ("tp", "pp", "dp", "ulysses", "ring", "cp", "ep", "ep_copies")
                 if name in groups]
        self.groups = {name: dist.new_subgroups_by_enumeration(groups[name], timeout=timeout)[0]
                       for name in names}
        holders = kv_group(args.kv_heads, args.tp)           # G < tp: a kv head's holders
        if holders is not None:
            self.groups["kv"] = holders
        self.dp_rank, self.stage, self.tp_rank = coordinates(rank, groups)
        self.cp_rank = 0
        if args.cp > 1:
            self.cp_rank = next(group.index(rank) for group in groups["cp"] if rank in group)
        self.tag = f"[dp{self.dp_rank} pp{self.stage} tp{self.tp_rank}]"
        if args.cp > 1:
            self.tag = f"[dp{self.dp_rank} pp{self.stage} cp{self.cp_rank} tp{self.tp_rank}]"
        dist.barrier()   # a collective on every rank before the first point-to-point (for NCCL)

    def hold_shards(self, args, device):
        """The parts of its stage (of each of its chunks, interleaved: the embedding in the first
        chunk of stage 0, the head in the last of the last stage), each tensor cut to its tp part: a
        column layer's columns (whole heads), a row layer's rows, its classes of E and H, a gain
        whole, a kv head's columns (G < tp), from the whole model every rank draws. Step 2's replica
        holds them over dp."""
        self.init = init_params(args)
        v = args.virtual_stages
        self.part_kinds = part_kinds(args.num_layers)                 # by part, in order
        self.splits = tensor_kinds(self.part_kinds, args, args.tp)    # a part's tensors'
        G = args.kv_heads
        self.chunks = [stage_parts(args.num_layers, args.pp, self.stage, v, c, args.schedule)
                       for c in range(v)]
        self.mine = [j for parts in self.chunks for j in parts]      # its parts' indices
        shards = [[shard(w, k, self.tp_rank, args.tp, G).to(device)
                   for w, k in zip(self.init[j], self.splits[j])] for j in self.mine]
        spans = spans_of(self.init)
        self.held = [i for j in self.mine for i in spans[j]]          # its tensors' indices
        self.boxes = [held_boxes(w.shape, k, self.tp_rank, args.tp, kv_heads=G)   # where each
                      for j in self.mine for w, k in zip(self.init[j], self.splits[j])]   # sits
        split = tensors_of(self.splits)
        self.copies = {i for i in tp_copies(split, self.tp_rank, args.tp, G)   # others write
                       if i in self.held}
        if self.cp_rank > 0:                                          # cp rank 0 holds the same
            self.copies = set(self.held)
        self.kinds = [k for j in self.mine for k in self.splits[j]]   # its tensors' splits
        self.starts = [sum(map(len, self.chunks[:c])) for c in range(v)]   # a chunk's first
        experts = self.hold_experts(args, shards) if args.ep > 1 else None   # out of shards
        self.shares = clip_shares(self.kinds, args.tp, G)
        self.replica = make_replica(shards, self.groups["dp"], zero=args.zero,
                                    optimizer=args.optimizer, lr=args.lr, bf16=args.bf16,
                                    bucket_mb=args.bucket_mb,      # no bucket crosses a chunk
                                    chunk_starts=self.starts)
        self.gather = partial(whole_on_rank0, self.replica, tensors_of(self.init), self.held,
                              self.boxes, self.copies)   # rank 0: every tensor whole (--check)
        if experts is not None:      # step 2's: the experts' copies beside the replica
            self.replica = WithExperts(self.replica, experts, self.groups["ep"],
                                       [k for k, j in enumerate(self.mine)
                                        if self.part_kinds[j] == "block"],
                                       [(self.held, self.boxes), self.expert_places],
                                       self.groups.get("cp"))
            self.gather = partial(whole_on_rank0, self.replica, tensors_of(self.init),
                                  copies=self.copies)
        self.routers = None
        if args.experts:             # every block's: its stage's choose, every stage's balance
            self.routers = [Router(args.experts, args.top_k, device, self.groups.get("ep"))
                            for _ in range(args.num_layers)]

    def hold_experts(self, args, shards):
        """--ep: each block's W1 and W2 [E, ..] (tp shards) out of shards, and its ep rank's E/P
        of them held apart, over the replicas that hold the same (step 2's WithExperts)."""
        r = dist.get_rank(self.groups["ep"])
        local = args.experts // args.ep
        spans = spans_of(self.init)
        mine = []
        held = []
        boxes = []
        for k, j in enumerate(self.mine):
            if self.part_kinds[j] != "block":
                continue
            mine.append([w[r * local:(r + 1) * local].clone() for w in shards[k][-3:]])
            shards[k] = shards[k][:-3]
            for i, w, kind in zip(spans[j][-3:], self.init[j][-3:], self.splits[j][-3:]):
                held.append(i)
                boxes.append(held_boxes(w.shape, kind, self.tp_rank, args.tp,
                                        range(r * local, (r + 1) * local)))
        self.expert_places = (held, boxes)                          # in the whole
        kept = [n for n, i in enumerate(self.held) if i not in held]
        self.held = [self.held[n] for n in kept]
        self.boxes = [self.boxes[n] for n in kept]
        self.kinds = [self.kinds[n] for n in kept]
        return make_replica(mine, self.groups["ep_copies"], zero=args.zero, bucket_mb=0,
                            replicas=args.dp, optimizer=args.optimizer, lr=args.lr, bf16=args.bf16)

    def take_rows(self, args, device):
        """Its replica's slice of each step's batch, by its dp coordinate, the same on every tp
        rank (only the first stage reads the tokens, and only the last the targets); with --cp,
        its positions of each row (step 3's layout)."""
        self.rows = replica_rows(args.batch_size, self.dp_rank, args.dp)
        self.positions = cp_positions(args.context, self.cp_rank, args.cp, args.cp_layout)
        self.device = device

    def micro_batches(self, batch, args):   # [B, T] twice -> its rows, m micro-batches each
        return [t[self.rows][:, self.positions].to(self.device).chunk(args.micro_batches)
                for t in batch]

    def build_stages(self, args):
        """Step 4's stages, one a chunk, each handed step 3's forward and backward of its parts
        over its tp group, and the vocab-parallel loss; the loss a mean over the replica's rows."""
        p, v = args.pp, args.virtual_stages
        tp_group = self.groups["tp"]
        self.sequence_parallel = args.sequence_parallel
        self.stages = []
        for c in range(v):                   # chunk c of stage s: virtual stage c p + s
            virtual = virtual_stage(args.schedule, p, self.stage, c)
            kinds = [self.part_kinds[j] for j in self.chunks[c]]
            routers = None
            if self.routers:                 # part j, a block: block j - 1's router
                routers = [self.routers[j - 1] for j in self.chunks[c]
                           if self.part_kinds[j] == "block"]
            self.stages.append(Stage(
                self.replica, range(self.starts[c], self.starts[c] + len(kinds)),
                blocks=tp_blocks(kinds, args, tp_group, self.groups if args.cp > 1 else None,
                                 positions=self.positions.to(self.device), routers=routers),
                first=virtual == 0, last=virtual == v * p - 1,
                num_micro_batches=args.micro_batches, mean_over=len(self.rows) * args.context,
                loss_fn=partial(vocab_parallel_cross_entropy, vocab_size=args.vocab_size,
                                group=tp_group),
                recompute=args.recompute,
                before_exchange=self.sum_partial))

    def sum_partial(self, b):
        """Bucket b's partial gradients, each summed before the dp exchange (ZeRO's parts of a
        bucket differ by tp rank: E_t, H_t): over tp, QK-norm's gains and a router's (a rank's
        heads', its part of each dgate_e) and, under sequence parallelism, the gains (T/tp
        positions a rank); over its kv group, a kv head's Wk, Wv (G < tp: its holders' query
        heads'). --cp: every gradient of the bucket saw this rank's positions alone: over cp."""
        bucket = self.replica.grad_buckets[b]
        mine = self.replica.layout.buckets[b]
        grads = {i: self.replica.view(bucket, i) for i in mine}
        summed = [i for i in mine if self.kinds[i] == "partial" or
                  (self.sequence_parallel and self.kinds[i] == "whole")]
        sum_partial_grads(grads, summed, self.groups["tp"])
        if "kv" in self.groups:
            sum_partial_grads(grads, [i for i in mine if self.kinds[i] == "kv"], self.groups["kv"])
        if "cp" in self.groups:
            reduce_over(bucket, self.groups["cp"])

    def plan_schedule(self, args):
        """Its stage's action list, its neighbours in the pipe, and what crosses to them. With
        --p2p-shard (Megatron's scatter-gather) each tp rank sends its 1/tp of what crosses, the
        same on every tp rank, and the receivers all-gather it: 1/tp of the bytes."""
        pp_ranks = dist.get_process_group_ranks(self.groups["pp"])   # the stages of this pipe
        self.prev_rank = pp_ranks[(self.stage - 1) % args.pp]        # interleaved, the last
        self.next_rank = pp_ranks[(self.stage + 1) % args.pp]        # stage's chunk c sends to
        self.actions = build_schedule(args.schedule, args.pp, self.stage, args.micro_batches,
                                      args.virtual_stages)           # the first's chunk c+1
        self.v_shape = args.schedule == "dualpipev"                  # its chunk b flows back up
        width = args.dim
        rows = args.context // args.cp        # its own positions
        self.boundary = {}
        if args.sequence_parallel:            # each tp rank holds its T/tp rows: it sends them
            rows = rows // args.tp
        elif args.p2p_shard:
            width = args.dim // args.tp
            self.boundary = dict(outgoing=partial(my_columns, group=self.groups["tp"]),
                                 incoming=partial(all_gather_columns, group=self.groups["tp"]))
        self.buffer_shape = (len(self.rows) // args.micro_batches, rows, width)

    def train_step(self, inputs, targets, recorder=None):
        """Every micro-batch forward and backward through the pipeline; each bucket's gradient
        summed over the replicas (reduce-scattered, with --zero) once final: Stage.weight_grads
        (step 4) starts its exchange after the last micro-batch's W; then each / dp."""
        self.replica.begin_step()
        for stage in self.stages:
            stage.begin_step(targets)
        run_schedule(self.actions, self.stages, inputs, self.prev_rank, self.next_rank,
                     self.buffer_shape, recorder=recorder, v_shape=self.v_shape, **self.boundary)
        self.replica.average()                                   # waits for the exchanges


# Part 3: the worker -------------------------------------------------------------------------------

def three_d_worker(rank, world_size, args):
    device = setup(rank, world_size)
    me = ThreeDRank(rank, args, device)
    if rank == 0:   # the rank map, and what a stage's (a chunk's) layers are
        show_rank_map(args.dp, args.pp, args.tp, args.order, args=args, chunks=args.virtual_stages,
                      cp=args.cp, ep=args.ep)
    resumed = load_checkpoint(args, me.replica, me.held, me.boxes)   # --resume: any layout's
    losses = []
    norms = []
    check = SerialCheck(args, resumed)
    moe = MoE(args, me.routers)
    for step in range(args.start_step, args.steps):
        batch = make_batch(args, step)          # tokens, targets [B, T]
        me.train_step(*me.micro_batches(batch, args))
        moe.gather_routes(me.rows, me.positions, counted=me.tp_rank == 0)   # --save, --check
        if args.check:   # this step's weights and gradients, whole on rank 0, against serial's
            check.step(me.gather(grads=False), me.gather(grads=True), moe.step())
        if args.clip_grad:   # the norm's squares summed over tp and pp (and dp, if ZeRO shards)
            norms.append(me.replica.clip(args.clip_grad, [me.groups["tp"], me.groups["pp"]],
                                         me.shares).item())
        if me.routers:     # every block's loads, from its stage's ranks, tp's first alone
            moe.loads += balance(me.routers, args.balance_rate, counted=me.tp_rank == 0).cpu()
        me.replica.update()                   # each rank's optimizer steps its own shards
        if me.stage == loss_stage(args):   # the loss's stage knows it: the replicas' mean
            loss = me.stages[-1].loss
            if args.cp > 1:                   # its positions' part: summed over cp first
                loss = reduce_over(loss.detach().clone(), me.groups["cp"])
            losses.append(global_loss(loss, me.groups["dp"]))   # the replicas' losses, averaged
            if me.dp_rank == me.tp_rank == me.cp_rank == 0:
                log_step(me.tag, step, losses, norms, args)
        save_checkpoint(args, step + 1, me.replica, me.held, me.boxes, me.copies,   # its pieces
                        me.routers)
    finish_ranks(me, args, losses, check, norms, device, resumed=resumed, moe=moe)
    cleanup()


def main(argv=None):
    args = parse_args(argv)
    if args.show_rank_map:
        show_rank_map(args.dp, args.pp, args.tp, args.order, cp=args.cp, ep=args.ep)
    elif args.plan:  # which layout? every one, costed by three_d_costs() (below)
        plan(args)
    elif args.ray:   # the same ranks, started by Ray instead of spawn (step 1's launcher)
        ray_launch(three_d_worker, args.dp * args.pp * args.tp * args.cp, args)
    else:
        spawn(three_d_worker, args.dp * args.pp * args.tp * args.cp, args, backend=args.backend,
              timeout_s=args.timeout_s)


# Below the fold: the run's end, the rank map's print, --plan (a rank's costs, the search and
# the GPU figures), the command line. --------------------------------------------------------------
import collections, copy, functools, importlib.util, itertools, math, multiprocessing, os  # noqa

from collectives import (Stop, collective_cost, measured_bandwidth, positive_int,  # noqa
                         quiet_child, seconds, si, under_torchrun)
from data_parallel import (VOCAB_SIZE, check_training_args, experts_rules, finish_run,  # noqa
                           in_step_bytes, make_buckets, model_defaults, model_rules,
                           training_parser)
from pipeline_parallel import add_schedule_args, held_counts, schedule_rules, undominated  # noqa
from tensor_parallel import (Attention, add_context_parallel, add_sequence_parallel,  # noqa
                             block_matmuls, context_parallel_rules, describe, divides,
                             refuse_unused, sequence_parallel_rules, tp_model_rules, vocab_range)


def finish_ranks(me, args, losses, check, norms, device, resumed=None, moe=None):
    """The full matrices, the last stage's losses, rank 0's memory table, --save and --check."""
    final = me.gather(grads=False)
    known = losses                            # the loss's stage's; elsewhere as many zeros
    if me.stage != loss_stage(args):
        known = [0.0] * (args.steps - args.start_step)
    losses = torch.tensor(known, dtype=torch.float64, device=device)
    last = rank_grid(args.dp, args.pp, args.tp * args.cp, args.order)[0, loss_stage(args), 0]
    dist.broadcast(losses, src=last.item())
    if dist.get_rank() == 0:
        finish_run(args, tensors_of(me.init), final, losses.tolist(), check, norms, resumed,
                   moe=moe)


def stage_kinds(args, stage):
    """Its parts' kinds, chunk by chunk: E first in the first virtual stage, H in the last."""
    return chunk_kinds(args.num_layers, args.pp, args.virtual_stages, stage, args.schedule)


@functools.lru_cache(maxsize=None)   # many layouts share one
def chunk_kinds(num_layers, num_stages, num_chunks, stage, schedule):   # step 4's parts, step
    kinds = part_kinds(num_layers)                                     # 3's kinds
    return tuple(tuple(kinds[j] for j in stage_parts(num_layers, num_stages, stage, num_chunks, c,
                                                     schedule))
                 for c in range(num_chunks))


def loss_stage(args):   # the stage holding H and the loss: the last, or DualPipeV's first
    return 0 if args.schedule == "dualpipev" else args.pp - 1


def replica_lengths(args, stage=0, tp_rank=0):   # a rank's buckets' elements
    return [n for _, n in replica_buckets(args, stage, tp_rank)]


def chunk_lengths(args, stage=0, tp_rank=0):     # the elements of each of its chunks' buckets
    chunks = [0] * args.virtual_stages
    for c, n in replica_buckets(args, stage, tp_rank):
        chunks[c] += n
    return chunks


def replica_buckets(args, stage, tp_rank):
    return buckets_of(stage_kinds(args, stage), shape_of(args), args.vocab_size, args.tp,
                      tp_rank, args.bucket_mb, args.dp if args.zero else 1)


def expert_lengths(args, stage):   # --ep: the experts' copies' buckets: a block's E/P W1, W3, W2
    blocks = sum(kinds.count("block") for kinds in stage_kinds(args, stage))
    if args.ep == 1 or not blocks:
        return []
    n = args.experts // args.ep * args.dim * args.ffn_dim // args.tp
    pad = args.dp // args.ep if args.zero else 1
    return [-(-3 * n // pad) * pad] * blocks           # a block's experts a bucket


@functools.lru_cache(maxsize=None)
def buckets_of(chunks, shape, vocab_size, tp, tp_rank, bucket_mb, pad_to):
    """A rank's buckets (chunk, elements): a block's Wq and Wo D^2/tp each, Wk and Wv D G dh/tp
    (G < tp: D dh), W1, W3, W2 D F/tp each, two gains (--qk-norm: two more, dh each); its
    classes of E and H with the final gain (ZeRO: d S). Experts: the router's D E, and W1, W3,
    W2 E times the MLP's, or with --ep none (the experts' copies hold them: expert_lengths)."""
    start, end = vocab_range(vocab_size, tp_rank, tp)
    D = shape.dim
    F = shape.ffn_dim
    E = shape.experts
    kv = D * kv_width(D, shape.heads, shape.kv_heads, tp)
    mlp = [D * F // tp] * 3
    if E:
        mlp = [D * E, *[E * D * F // tp] * 3 * (shape.ep == 1)]
    attention = [D, D * D // tp, kv, kv, *[D // shape.heads] * 2 * shape.qk_norm, D * D // tp, D]
    size = {"embedding": [(end - start) * D], "head": [D, D * (end - start)],
            "block": [*attention, *mlp]}
    numels = [size[kind] for chunk in chunks for kind in chunk]
    starts = [sum(map(len, chunks[:c])) for c in range(len(chunks))]
    layout = make_buckets(numels, bucket_mb, starts)
    chunk_of = [sum(start <= parts[0] for start in starts) - 1 for parts in layout.parts]
    return [(c, -(-n // pad_to) * pad_to) for c, n in zip(chunk_of, layout.lengths)]


def show_rank_map(dp, pp, tp, order, args=None, chunks=1, cp=1, ep=1):
    groups = rank_groups(dp, pp, tp, order, cp, ep)
    names = ("tp", "cp", "pp", "dp")                 # each rank's groups, fastest first
    sizes = f"dp={dp} pp={pp} cp={cp} tp={tp}, order {order.replace('tp-', 'tp-cp-')}"
    if cp == 1:
        names = ("tp", "pp", "dp")
        sizes = f"dp={dp} pp={pp} tp={tp}, order {order}"
    if ep > 1:                                       # inside dp: its own column, last
        names = (*names, "ep")
        sizes = f"{sizes}, ep={ep} inside dp"
    width = {name: max(len(str(groups[name][0])) + 2, 10) for name in names}
    print(f"rank map: {sizes} (fastest first)")
    print(f"{'rank':>5} " + " ".join(f"{name:>3}" for name in names[::-1]) + "   " + "".join(
        f"{name + ' group':<{width[name]}}" for name in names).rstrip())
    for rank in range(dp * pp * tp * cp):
        mine = {name: next(g for g in groups[name] if rank in g) for name in names}
        coords = " ".join(f"{mine[name].index(rank):>3}" for name in names[::-1])
        cells = "".join(f"{str(mine[name]):<{width[name]}}" for name in names)
        print(f"{rank:>5} {coords}   {cells}".rstrip(), flush=True)
    if args:
        print(f"each stage{' chunk' * (chunks > 1)}: {describe(args, tp)} over tp={tp}", flush=True)


def three_d_costs(args, stage, times=(1, 1, 1), tp_rank=0):
    """A rank of this stage's costs a step, from steps 2-4's: its collectives {"tp", "pp", "dp":
    [(kind, bytes, times)]}; what its replica holds at the end {kind: (bytes, formula)}; its
    largest stash, bytes; its bubble (ZB-H1's for times (T_F, T_B, T_W)). tp_rank: whose classes."""
    v, m, tp = args.virtual_stages, args.micro_batches, args.tp
    kinds = [kind for chunk in stage_kinds(args, stage) for kind in chunk]   # the ends' too
    rows = args.batch_size // (args.dp * m) * args.context // args.cp       # its positions, b T/C
    act = rows * args.dim * (2 if args.bf16 else 4)                         # [b, T, D]
    blocks = kinds.count("block")
    head_dim = args.dim // args.heads
    exchanges = m if args.zero == 3 else 1         # dp's exchanges a step, each after tp's sums
    summed = [4 * head_dim] * 2 * blocks * args.qk_norm                  # QK-norm's gains, routers
    summed += [4 * args.dim * args.experts] * blocks * (args.experts > 0)   # over tp, once a step
    if args.sequence_parallel:                          # the gains
        summed += [4 * args.dim] * (2 * blocks + kinds.count("head"))
    tp_runs = tp_costs(kinds, act, rows, args.tp_style, num_micro_batches=m,
                       recompute=args.recompute, sequence_parallel=args.sequence_parallel,
                       summed=summed, sums=exchanges, mlp_bytes=act * args.ffn_dim // args.dim)
    sent = act // tp if args.p2p_shard or args.sequence_parallel else act   # 1/tp crosses
    kept, waiting = stash_bytes(args)
    bubble, stash, pp_runs = pipeline_costs(args.schedule, args.pp, stage, m, v, act_bytes=sent,
                                            kept_bytes=kept, waiting_bytes=waiting, times=times)
    if args.p2p_shard and not args.sequence_parallel:           # and is all-gathered on arrival
        tp_runs += [("all-gather", act, count) for _, _, count in pp_runs]
    lengths = replica_lengths(args, stage, tp_rank)
    dp_runs, held = dp_costs(lengths, args.dp, zero=args.zero, num_micro_batches=m,
                             optimizer=args.optimizer, bf16=args.bf16)
    cp_runs = cp_costs(blocks, rows, shape_of(args), tp, m, [4 * n for n in lengths], exchanges)
    runs = {"tp": tp_runs, "pp": pp_runs, "dp": dp_runs, "cp": [], **cp_runs}
    if args.kv_heads < tp:   # each kv head's Wk, Wv gradient summed over its tp/G holders
        runs["kv"] = [("all-reduce", 4 * args.dim * head_dim, 2 * blocks * exchanges)]
    if args.ep > 1:   # each block's four all-to-alls of rows K pairs (balanced), the ids and
        calls = blocks * m                                    # counts (once a forward); the
        forwards = calls * (1 + args.recompute)               # experts' copies' exchange at
        runs["ep"] = [("all-to-all", act * args.top_k, 2 * forwards + 2 * calls),   # the end
                      ("all-to-all", rows * args.top_k * 8, forwards),
                      ("all-to-all", args.ep * 8, forwards)]
        runs["copies"], experts = dp_costs(expert_lengths(args, stage), args.dp // args.ep,
                                           zero=args.zero, num_micro_batches=m,
                                           optimizer=args.optimizer, bf16=args.bf16)
        runs["copies"] = [(kind, nbytes, 1 if kind == "reduce-scatter" else times)   # once, at
                          for kind, nbytes, times in runs["copies"]]           # the step's end
        held = {kind: (size + experts[kind][0], formula) for kind, (size, formula) in held.items()}
        if args.cp > 1:                                       # their gradients summed over cp
            runs["cp"] += [("all-reduce", 4 * n, 1) for n in expert_lengths(args, stage)]
    if args.clip_grad:    # the norm's squares, one float, summed over tp, pp (and dp, if ZeRO)
        for group in ("tp", "pp", "dp")[:2 + (args.zero > 0)]:
            runs[group] = [*runs[group], ("all-reduce", 4, 1)]   # (pp's: a cached list)
    return runs, held, stash, bubble


def stash_bytes(args):
    """A micro-batch's stash in a chunk from its F to its B, and from its B to its W: each of its
    blocks' (step 4's block_stash, on this rank's shards); the ends' stashes aside (the token
    ids, the head's input), as the stash table counts."""
    blocks = args.num_layers // (args.pp * args.virtual_stages)
    kept, waiting = block_stash(args, args.batch_size // (args.dp * args.micro_batches), args.tp,
                                context=args.context // args.cp)   # its T/C positions
    return blocks * kept, blocks * waiting


# --plan: which layout? Each layout of --world-size GPUs priced as the code runs it: each
# part's matmuls by step 3's block_matmuls() (tests/gpu_path.py records a rank's on the meta
# device), its collectives, sends and memory by three_d_costs(), on a GPU's published figures.

# Each GPU's figures, with their sources. The datasheets: H100 https://www.nvidia.com/en-us/
# data-center/h100/ (SMs: the Hopper whitepaper), A100 https://www.nvidia.com/en-us/data-
# center/a100/. "nccl-tests#N": https://github.com/NVIDIA/nccl-tests/issues/N, what users of
# NVIDIA's nccl-tests measured and posted there. Bus bandwidth (the bytes a ring sends a rank,
# over the time) rises with the size, as for an all-reduce on 8 H100 SXM with NVLink SHARP
# (nccl-tests#212; GB/s at these bytes); every curve here rises so, to its own plateau.
RISE = [(4e6, 129), (16e6, 234), (64e6, 362), (256e6, 423), (1e9, 466)]
GPUS = {
    "h100": dict(name="H100 SXM 80 GB",
                 flops=989e12, fp32_flops=67e12,   # datasheet: bf16 dense; fp32 (no TF32)
                 gemm_best=0.80,   # measured: a bf16 8192^3 matmul, 796 TFLOP/s on one H100
                 attention_best=0.35,   # FlashAttention-2's share of peak on an H100 (FA3's paper)
                 sms=132, memory_gb=80, hbm_gbps=3350,          # datasheet: HBM3
                 all_reduce_gbps=466,   # RISE's; ~480 at its peak (nccl-tests#212)
                 intra_gbps=360,   # an assumption: NVLink's 450 GB/s (datasheet) less ~20%
                 latency_us=20,    # an all-reduce of 4 B to 1 MB on 8 H100s (nccl-tests#212)
                 send_gbps=180, send_latency_us=3,      # sendrecv (nccl-tests#268)
                 inter_gbps=47, inter_latency_us=30),   # NDR 400 Gb/s a NIC: 46-48 GB/s
    "a100": dict(name="A100 SXM 80 GB",                 # (nccl-tests#290); IB ~30 us (#214)
                 flops=312e12, fp32_flops=19.5e12,      # datasheet: bf16 dense; fp32
                 gemm_best=0.80, sms=108, memory_gb=80, hbm_gbps=2039,   # datasheet: HBM2e
                 attention_best=0.50,   # FlashAttention-2's paper: 50-73% of an A100's peak
                 all_reduce_gbps=208,   # 8 A100 SXM, no NVLink SHARP (nccl-tests#178)
                 intra_gbps=208,   # an assumption: NVLink 3's 300 GB/s (datasheet) less ~20%
                 latency_us=20, send_gbps=150, send_latency_us=3,   # assumed as the H100's
                 inter_gbps=24, inter_latency_us=30),   # HDR 200 Gb/s: 96% (nccl-tests#119)
}
# A parameter's bytes of the update: g / d (8), fused AdamW's pass over p, g, m, v (28) or SGD's
# over p, g (12), g zeroed for the next step (4).
UPDATE_BYTES = {"adamw": 40, "sgd": 24}
REFRESH_BYTES = 6   # --bf16's copy of the new master into the layers' weight
# A block's memory-bound passes on a GPU, in [b, T, D]s read and written: forward, the two fused
# norms (x in, y out: 2 each), the two residual adds (3 each); back, the norms' fused backward
# (dy, x in, dx out: 3 each), five adds (3 each: the residuals' two, dn1's two, dn2's). RoPE's
# and --qk-norm's, forward and back, in [b, T, D]s of q (k, v: G/h of one); SwiGLU's in [b, T, F]s.
PASSES = {"forward": 2 * 2 + 2 * 3, "backward": 2 * 3 + 5 * 3}
ROPE = {"bf16": 10, "fp32": 2}   # q, k turned (bf16: cast in, product, cast out; fp32: product)
QK_NORM = {"forward": 2, "backward": 3}
SWIGLU = {"forward": 5, "backward": 11}   # silu and product; du up, silu_backward, silu, du silu
# --experts, in [N K, D]s, a pair's (estimated, not recorded: the routing is data): the rows
# gathered (2), the gate-weighted sum into fp32 y (3); back dy's rows gathered and scaled (3), dn
# summed in (3), <dy, y_e> (2); and SwiGLU's over each pair's [F].
EXPERT_PASSES = {"forward": 2 + 3, "backward": 3 + 3 + 2}


class Machine:
    """A GPU by its figures: a matmul max(FLOPs at its shape's GEMM efficiency, bytes at HBM's
    speed); a collective NCCL's floor plus its bytes at the busbw measured for its size."""

    def __init__(self, figures, gpus_per_node):
        self.figures = figures
        self.flops = figures["flops"]
        self.memory = figures["memory_gb"] * 1e9
        self.hbm = figures["hbm_gbps"] * 1e9
        self.gpus_per_node = gpus_per_node

    def efficiency(self, m, k, n):
        """The best GEMM's share of peak times how full this shape fills 128 x 128 tiles and waves
        over the SMs, split-K (NVIDIA's "Matrix Multiplication Background")."""
        sms = self.figures["sms"]
        tiles = math.ceil(m / 128) * math.ceil(n / 128)
        splits = max(1, min(sms // tiles, k // 512))
        waves = math.ceil(tiles * splits / sms)
        return self.figures["gemm_best"] * m * n / (128 * 128) * splits / (waves * sms)

    def matmul_s(self, mm):   # a matmul, or a fused attention kernel at FlashAttention's share
        peak = self.flops if mm.in_bytes == 2 else self.figures["fp32_flops"]
        if isinstance(mm, Attention):
            share = self.figures["attention_best"]
        else:
            share = self.efficiency(mm.m, mm.k, mm.n)
        return max(mm.flops() / (peak * share), mm.bytes_moved() / self.hbm)

    def layer_s(self, kind, rows, args, tp, classes=0):   # args: a Shape
        """(F, B, W) of a tp rank's part, a micro-batch of rows positions: its matmuls and fused
        attention (block_matmuls); a block's memory-bound passes (PASSES); the head's loss fp32
        passes over [b T, classes] (6 forward, 4 back); the embedding's rows moved, no matmul."""
        size = 2 if args.bf16 else 4
        dim = args.dim
        if kind == "embedding":
            rows_bytes = rows * dim * size
            f = (2 + 2 * (tp > 1)) * rows_bytes / self.hbm
            return f, 0.0, (rows_bytes + 2 * rows * dim * 4) / self.hbm
        forwards, dxs, dws = block_matmuls(kind, rows, args, tp, classes)
        f = sum(map(self.matmul_s, forwards))
        b = sum(map(self.matmul_s, dxs))
        w = sum(map(self.matmul_s, dws))     # each adds into the gradient, zeroed as a step begins
        if kind == "head":
            loss = rows * classes * 4 / self.hbm
            return f + 6 * loss, b + 4 * loss, w
        passes = rows * dim * size / self.hbm
        qk = 1 + args.kv_heads / args.heads                  # q's and k's, in [b, T, D]s
        mlp = args.ffn_dim / dim * max(args.top_k * (args.experts > 0), 1)   # every pair's
        rope = ROPE["bf16" if args.bf16 else "fp32"]
        f += (PASSES["forward"] + (rope + QK_NORM["forward"] * args.qk_norm) * qk +
              SWIGLU["forward"] * mlp) * passes
        b += (PASSES["backward"] + (rope + QK_NORM["backward"] * args.qk_norm) * qk +
              SWIGLU["backward"] * mlp) * passes
        if args.experts:   # the pairs' gathers and sums
            f += EXPERT_PASSES["forward"] * args.top_k * passes
            b += EXPERT_PASSES["backward"] * args.top_k * passes
        return f, b + f * args.recompute, w

    def attention_s(self, rows, shape, tp):   # a block's attention kernels: (forward, back)
        forwards, dxs, _ = block_matmuls("block", rows, shape, tp)
        return [sum(self.matmul_s(mm) for mm in kernels if isinstance(mm, Attention))
                for kernels in (forwards, dxs)]

    def update_s(self, params, optimizer, bf16):
        return params * (UPDATE_BYTES[optimizer] + REFRESH_BYTES * bf16) / self.hbm

    @functools.lru_cache(maxsize=None)   # many alike
    def collective_s(self, kind, nbytes, n, per_node):
        """NCCL's floor plus a rank's ring bytes at RISE's busbw for the size; across nodes
        (per_node of the group's ranks in one), InfiniBand's floor and a link a rank there."""
        if n == 1:
            return 0.0
        figures = self.figures
        sent = float(collective_cost(kind, nbytes, n)[0])
        if kind == "send":
            link = "send" if per_node > 1 else "inter"
            return figures[f"{link}_latency_us"] * 1e-6 + sent / (figures[f"{link}_gbps"] * 1e9)
        floor = figures["latency_us"] * 1e-6
        plateau = figures["all_reduce_gbps" if kind == "all-reduce" else "intra_gbps"] * 1e9
        bandwidth = measured_bandwidth(nbytes, RISE, floor, plateau)
        if per_node < n:
            floor = figures["inter_latency_us"] * 1e-6
            bandwidth = min(bandwidth, per_node * figures["inter_gbps"] * 1e9)
        return floor + sent / bandwidth

    def pipeline_s(self, args, slowest, stages):   # the slowest stage spread by the bubble, and
        """other parts (tests' CPU machine plays the schedule out: its ranks share cores)."""
        return slowest["inside"] / (1 - slowest["bubble"]), {}


@functools.lru_cache(maxsize=None)
def members_per_node(dp, pp, tp, order, gpus_per_node, interleaved, cp=1, ep=1, ulysses=1,
                     kv=1):
    """Each stage's {kind: fewest ranks of a group in one node}; "pp": 2 if its sends stay in;
    "kv" (a kv head's holders, kv of tp's); with --ep, "ep" and "copies" (its groups, cut from
    dp's); the hybrid's "ulysses" and "ring" (cut from cp's). And the stages priced alike once:
    the first of each (the ends differ by E, H, the middle by nodes); each kind's least."""
    node = (rank_grid(dp, pp, tp * cp, order) // gpus_per_node).tolist()   # [dp][pp][tp cp]
    stages = []
    for s in range(pp):
        blocks = [node[d][s] for d in range(dp)]          # each replica's tp cp ranks' nodes
        tp_groups = [block[c * tp:(c + 1) * tp] for block in blocks for c in range(cp)]
        cp_groups = [block[t::tp] for block in blocks for t in range(tp)]
        peers = [(s + k) % pp for k in (-1, 1) if interleaved or 0 <= s + k < pp]
        stage = {"tp": min(fewest(group) for group in tp_groups),
                 "cp": min(fewest(group) for group in cp_groups),
                 "dp": min(fewest(group) for group in zip(*blocks)),
                 "pp": 1 if any(node[d][s] != node[d][k] for d in range(dp) for k in peers)
                 else 2}
        stage["kv"] = min(stage["tp"], kv)
        if ulysses > 1:
            stage.update(ulysses=min(fewest(group[i:i + ulysses])
                                     for group in cp_groups for i in range(0, cp, ulysses)),
                         ring=min(fewest(group[i::ulysses])
                                  for group in cp_groups for i in range(ulysses)))
        if ep > 1:
            stage.update(ep=min(fewest(group[i:i + ep])
                                for group in zip(*blocks) for i in range(0, dp, ep)),
                         copies=min(fewest(group[r::ep]) for group in zip(*blocks)
                                    for r in range(ep)))
        stages.append(stage)
    unlike = {(s == 0, s == pp - 1, tuple(stages[s].items())): s for s in reversed(range(pp))}
    return stages, tuple(unlike.values()), {kind: min(stage[kind] for stage in stages)
                                            for kind in stages[0]}


def fewest(group):   # a group's fewest ranks on one node: [0, 0, 1] -> 1
    return min(map(group.count, set(group)))


# What a part's price reads of the run's flags (a cache's key).
Shape = collections.namedtuple("Shape", "dim heads kv_heads ffn_dim qk_norm context tp_style bf16 "
                                        "recompute cp cp_layout cp_style ulysses experts top_k ep")


def shape_of(args, flags=attrgetter(*Shape._fields)):   # the run's flags that price a part
    return Shape(*flags(args))


@functools.lru_cache(maxsize=None)   # many layouts share one
def chunk_s(machine, kinds, rows, shape, tp, classes):
    """(F, B, W) of a chunk's parts, a micro-batch; --recompute repeats a block's forward only."""
    priced = {kind: machine.layer_s(kind, rows, shape, tp, classes=classes) for kind in set(kinds)}
    return tuple(sum(column) for column in zip(*map(priced.get, kinds)))


def tally(runs):   # [(kind, bytes, times)] as {(kind, bytes): times}
    counts = {}
    for kind, nbytes, times in runs:
        counts[kind, nbytes] = counts.get((kind, nbytes), 0) + times
    return counts


@functools.lru_cache(maxsize=None)   # runs met again (a layout's dp buckets under each schedule)
def runs_bytes(runs, n):             # priced once: what one rank sends of them (ring's), n ranks
    return sum(times * float(collective_cost(kind, nbytes, n)[0]) * (n > 1)
               for (kind, nbytes), times in tally(runs).items())


@functools.lru_cache(maxsize=None)
def runs_s(machine, runs, n, per_node):   # their seconds, on n ranks, per_node in one node
    return sum(times * machine.collective_s(kind, nbytes, n, per_node)
               for (kind, nbytes), times in tally(runs).items())


def predict(args, machine, alike=None):
    """A layout's row: its unlike stages priced (the ends make the first and last differ; nodes
    the middle ones), the step the slowest stage's pipeline plus the dp exchange (ZeRO-3's is
    inside) and the update, in parts that add up; memory, the largest. tp rank 0's figures (the
    most classes). alike: plan's, what a stage costs whatever the rank order (one layout's two
    orders differ in their nodes alone), kept by the rest of its layout."""
    dp, pp, tp, cp, m = args.dp, args.pp, args.tp, args.cp, args.micro_batches
    sizes = {"tp": tp, "pp": pp, "dp": dp, "cp": cp}
    if args.cp_style == "hybrid":                    # Ulysses' groups, and the ring across
        sizes.update(ulysses=args.ulysses, ring=cp // args.ulysses)
    if args.ep > 1:                                  # --ep's all-to-alls; the experts' copies
        sizes.update(ep=args.ep, copies=dp // args.ep)
    if args.kv_heads < tp:                           # a kv head's holders, inside a tp group
        sizes.update(kv=tp // args.kv_heads)
    per_node, unlike, least = members_per_node(dp, pp, tp, args.order, machine.gpus_per_node,
                                               args.schedule == "interleaved", cp, args.ep,
                                               args.ulysses, sizes.get("kv", 1))
    classes = -(-args.vocab_size // tp)              # tp rank 0's
    rows = args.batch_size // (dp * m) * args.context // cp   # a micro-batch's positions, a rank's
    stages = []
    helds = {}
    shape = shape_of(args)
    alike = {} if alike is None else alike
    layout = tuple(getattr(args, name) for name in LAYOUT if name != "order")
    ring = {"ring": "cp", "hybrid": "ring"}.get(args.cp_style) if cp > 1 else None
    for s in unlike:
        if (layout, s) not in alike:
            chunks = [chunk_s(machine, kinds, rows, shape, tp, classes)
                      for kinds in stage_kinds(args, s)]
            runs, held, _, bubble = three_d_costs(args, s, times=tuple(map(sum, zip(*chunks))))
            runs = {group: tuple(runs[group]) for group in runs}   # alike ones priced once
            sent = {group: runs_bytes(runs[group], sizes[group]) for group in runs}
            params = sum(replica_lengths(args, s)) // (dp if args.zero else 1) + \
                sum(expert_lengths(args, s)) // (dp // args.ep if args.zero else 1)
            travel = runs[ring][:2] if ring else None     # the ring's K, V and dK, dV sends
            alike[layout, s] = chunks, held, bubble, runs, sent, params, travel
        chunks, helds[s], bubble, runs, sent, params, travel = alike[layout, s]
        comm = {group: runs_s(machine, runs[group], sizes[group], per_node[s][group])
                for group in runs}
        if ring:   # K and V travel under the pairs' kernels, and dK, dV but the last hop
            blocks = sum(kinds.count("block") for kinds in stage_kinds(args, s))
            (kind, nbytes, times), (_, sums, hops) = travel
            sends = times * machine.collective_s(kind, nbytes, sizes[ring], per_node[s][ring]) + \
                hops * (sizes[ring] - 1) // sizes[ring] * machine.collective_s(
                    kind, sums, sizes[ring], per_node[s][ring])   # what outlasts them shows
            forward, back = machine.attention_s(rows, shape, tp)
            pairs = blocks * m * ((1 + args.recompute) * forward + back)
            comm[ring] -= min(sends, pairs)
        compute = m * sum(sum(chunk) for chunk in chunks)
        inside = compute + comm["dp"] * (args.zero == 3) + sum(
            comm.get(group, 0) for group in ("tp", "pp", "cp", "ulysses", "ring", "ep", "kv"))
        stages.append(dict(stage=s, chunks=chunks, comm=comm, compute=compute, inside=inside,
                           bubble=bubble, sent=sent, params=params))
    slowest = max(stages, key=lambda stage: stage["inside"])
    pipeline, waits = machine.pipeline_s(args, slowest, stages)
    parts = dict(compute=slowest["compute"], **slowest["comm"], **waits,
                 bubble=pipeline - slowest["inside"])
    params = max(stage["params"] for stage in stages)   # the largest optimizer's, a rank's
    parts["update"] = machine.update_s(params, args.optimizer, args.bf16)
    step = sum(parts.values())
    L, D, T = args.num_layers, args.dim, args.context   # 6 a weight a position; attention 12 T D
    model_flops = args.batch_size * T * (6 * active_params(args) + 12 * L * T * D)   # (PaLM's)
    if (layout, "memory") not in alike:
        alike[layout, "memory"] = most_memory(args, helds=helds)
    return dict(step_s=step, parts=parts, bubble=slowest["bubble"],
                memory_bytes=alike[layout, "memory"],
                bytes={group: max(stage["sent"][group] for stage in stages) for group in sizes},
                stage=slowest["stage"], args=args,
                stages={stage["stage"]: stage["inside"] for stage in stages},
                mfu=model_flops / (step * dp * pp * tp * cp * machine.flops),
                crosses=[group for group in sizes if sizes[group] > 1 and least[group] <
                         (2 if group == "pp" else sizes[group])])


def active_params(args):   # the weights a position multiplies: with experts, its K and the router
    L, D = args.num_layers, args.dim
    attention = 2 * D * D + 2 * D * args.kv_heads * (D // args.heads)   # Wq, Wo; Wk, Wv
    mlp = 3 * D * args.ffn_dim
    if args.experts:
        mlp = args.top_k * 3 * D * args.ffn_dim + D * args.experts
    return L * (attention + mlp) + args.vocab_size * D


def total_params(args):   # every weight: E, the blocks (gains, router), the final gain, H
    L, D = args.num_layers, args.dim
    gains = 2 * D + 2 * (D // args.heads) * args.qk_norm
    mlp = 3 * D * args.ffn_dim
    if args.experts:
        mlp = args.experts * 3 * D * args.ffn_dim + D * args.experts
    attention = 2 * D * D + 2 * D * args.kv_heads * (D // args.heads)
    return L * (attention + gains + mlp) + (2 * args.vocab_size + 1) * D


def most_memory(args, stages=None, helds=None):
    """The most a rank of any stage holds: its replica's state and ZeRO's in-step buckets (alike on
    the middle stages; the ends hold E and H) plus its own largest stash and its working set."""
    pp, m, v = args.pp, args.micro_batches, args.virtual_stages
    kept, waiting = stash_bytes(args)
    state = {}
    for s in {0, pp - 1, min(1, pp - 1)}:
        held = (helds or {}).get(s) or three_d_costs(args, s)[1]   # predict's, if it priced s
        state[s] = sum(size for size, _ in held.values()) + in_step_bytes(
            chunk_lengths(args, s), args.dp, zero=args.zero, num_micro_batches=m)
    loss = loss_stage(args)
    block = working_bytes(args, (loss + 1) % pp)                 # alike off the loss's stage
    working = {loss: working_bytes(args, loss)}
    if stages:
        counts = {s: held_counts(args.schedule, pp, s, m, v) for s in stages}
    else:                              # the middle stages' stashes together, as stage 1's
        stages = {0, min(1, pp - 1), pp - 1}
        counts = {0: held_counts(args.schedule, pp, 0, m, v),
                  pp - 1: held_counts(args.schedule, pp, pp - 1, m, v)}
        counts.setdefault(min(1, pp - 1), middle_counts(args.schedule, pp, m, v))
    return max(state.get(s, state[min(1, pp - 1)]) + working.get(s, block) +
               max(k * kept + w * waiting for k, w in counts[s]) for s in stages)


@functools.lru_cache(maxsize=None)
def middle_counts(schedule, pp, m, v):   # held_counts of stages 1 to pp-2, none dominated:
    middle = range(1, pp - 1)              # with W in B, stage 1's (its warm-up the longest)
    if schedule in ("gpipe", "1f1b", "interleaved"):
        middle = range(1, min(2, pp - 1))
    return undominated({pair for s in middle for pair in held_counts(schedule, pp, s, m, v)})


def working_bytes(args, stage):
    """What a step holds a moment beside state and stash: a block's backward (the MLP's du, da,
    dup, silu(a), F wide; fused attention holds no [T, T]; --cp: the ring's buffers (all-gather:
    the whole K, V and dK, dV); --recompute: the block's stash rebuilt, less the x it kept, the
    chunk's (x, dz)s until W), or the last stage's loss: logits [b T, V/tp], exps made dlogits in
    place (bf16: an fp32 copy, a cast), beside others' dlogits between F and B."""
    b = args.batch_size // (args.dp * args.micro_batches)
    act = 2 if args.bf16 else 4
    T = args.context // args.cp                                            # its positions
    A = b * T * args.dim * act                                             # [b, T, D]
    block = 4 * b * T * args.ffn_dim * act                                 # the MLP's
    if args.cp > 1:   # the ring's backward beside the MLP's dz and 3 more [b, T/C, D]: do, q, o,
        # k, v in the heads' layout, K V and the incoming; fp32 dq, dK dV, in flight and arriving
        q = b * T * args.dim // args.tp                                    # [b, T/C, h/tp dh]
        kv = b * T * kv_width(args.dim, args.heads, args.kv_heads, args.tp)
        block = max(block, 7 * A + (3 * q + 6 * kv) * act + (q + 6 * kv) * 4)
        if args.cp_style == "all-gather":   # K, V whole, gathered and in order; dK, dV whole
            block += 2 * kv * args.cp * (2 * act + 4 * 4)   # in fp32, joined, reordered, sent
    if args.recompute:   # the stash rebuilt; its n1, o, n2, u are its (x, dz)s' xs, counted with
        split = 1        # those: in the chunk's, or zb-h1's stash (held_counts)
        if args.tp > 1 and args.tp_style == "megatron":
            split = args.tp                                                # o, u by tp
        xs = 2 * A + A // split + b * T * args.ffn_dim * act // split
        whole = block_stash(args, b, args.tp, context=T, recompute=False)[0]
        block += whole - xs - block_stash(args, b, args.tp, context=T)[0]  # less the x kept
        block += stash_bytes(args)[1] * (args.schedule != "zb-h1")
    if stage != loss_stage(args):
        return block
    logits = b * T * -(-args.vocab_size // args.tp)
    in_flight = max(k for k, _ in held_counts(args.schedule, args.pp, stage, args.micro_batches,
                                              args.virtual_stages))
    return max(block, logits * (act + 4 + (4 + act) * args.bf16)) + (in_flight - 1) * logits * act


def layouts(args, gpus_per_node):
    """Every layout as parse_args() leaves it: (dp, pp, tp) (those of --dp, --pp, --tp given),
    order (past a node), schedule (v 2, 4 interleaved; DualPipeV from 2p micro-batches),
    micro-batches (p to 8 p), ZeRO, TP style, --p2p-shard, --recompute, and --sequence-parallel
    where Megatron's pairs split T (its stages send T/tp rows: no p2p-shard)."""
    world, L, B = args.world_size // args.cp, args.num_layers, args.batch_size   # cp: as given
    divisors = [n for n in range(1, world + 1) if world % n == 0]
    for dp, pp in itertools.product(divisors, repeat=2):
        tp = world // (dp * pp)
        sizes = {"dp": dp, "pp": pp, "tp": tp}
        if any(sizes[axis] != size for axis, size in args.fixed.items()):
            continue
        if dp * pp * tp != world or args.heads % tp or L % pp or B % dp or tp > args.vocab_size \
                or dp % args.ep or args.ffn_dim % tp or (args.kv_heads % tp and tp % args.kv_heads):
            continue
        orders = ["tp-pp-dp", "tp-dp-pp"][:1 + (args.world_size > gpus_per_node and dp * pp > 1)]
        schedules = [("1f1b", 1)]
        if pp > 1:
            schedules = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1),
                         *[("interleaved", v) for v in (2, 4) if L % (pp * v) == 0],
                         *[("dualpipev", 2)] * (L % (2 * pp) == 0)]
        cp_styles = [("ring", 1)]
        if args.cp > 1:               # each style the door lets by at this tp
            tried = [("ring", 1), ("all-gather", 1), ("ulysses", 1),
                     *[("hybrid", u) for u in range(2, args.cp) if args.cp % u == 0]]
            cp_styles = [(style, u) for style, u in tried if not any(
                broken for broken, _ in context_parallel_rules(argparse.Namespace(
                    **{**vars(args), "cp_style": style, "ulysses": u}), tp))]
        for order, (schedule, v), k, zero, style, p2p_shard, recompute, sequence, (cp_style, u) \
                in itertools.product(orders, schedules, range(4), range(4 if dp > 1 else 1),
                                  ["all-gather", "megatron"][:1 + (tp > 1)],
                                  [False, True][:1 + (tp > 1 and pp > 1)], [False, True],
                                  [False, True][:1 + (tp > 1 and
                                                      args.context // args.cp % tp == 0)],
                                  cp_styles):
            m = pp * 2**k
            if B % (dp * m) or sequence and (style != "megatron" or p2p_shard) or \
                    schedule == "dualpipev" and m < 2 * pp:
                continue
            layout = copy.copy(args)
            vars(layout).update(zip(LAYOUT, (dp, pp, tp, order, schedule, v, m, zero, style,
                                             p2p_shard, recompute, sequence, cp_style, u)))
            yield layout


LAYOUT = ("dp", "pp", "tp", "order", "schedule", "virtual_stages", "micro_batches", "zero",
          "tp_style", "p2p_shard", "recompute", "sequence_parallel", "cp_style", "ulysses")


def short_layout(a):   # as the table names it: dp1 pp8 tp1 zb-h1 m64 zero1 megatron ...
    words = [f"dp{a.dp} pp{a.pp} tp{a.tp}", f"cp{a.cp} {a.cp_layout} {cp_style_of(a)}" * (a.cp > 1),
             a.order * (a.order != "tp-pp-dp"),
             f"{a.schedule}{f' v{a.virtual_stages}' * (a.schedule == 'interleaved')}" * (a.pp > 1),
             f"m{a.micro_batches}", f"zero{a.zero}" * (a.zero > 0),
             "megatron" * (a.tp_style == "megatron"), "p2p-shard" * a.p2p_shard,
             "sequence-parallel" * a.sequence_parallel, "recompute" * a.recompute]
    return " ".join(word for word in words if word)


def plan(args):
    """The layouts that fit a GPU's memory by predicted step, as a table; none fitting, a Stop."""
    machine = Machine(GPUS[args.hardware], min(args.gpus_per_node, args.world_size))
    groups = [list(axes) for _, axes in itertools.groupby(layouts(args, machine.gpus_per_node),
                                                          attrgetter("dp", "pp"))]
    with multiprocessing.get_context("fork").Pool(min(len(groups), os.cpu_count() or 1),
                                                  initializer=quiet_child) as pool:   # each core
        rows = [row for priced in pool.map(partial(predict_all, machine=machine), groups,
                                           chunksize=1) for row in priced]
    fits = sorted((row for row in rows if row["memory_bytes"] <= machine.memory),
                  key=lambda row: row["step_s"])
    if not fits:
        smallest = min(row["memory_bytes"] for row in rows)
        raise Stop(f"--plan: no layout of {args.world_size} GPUs fits in {si(machine.memory)}B "
                   f"a GPU (the smallest needs {si(smallest)}B): more GPUs, or a smaller model")
    show_plan(args, machine, len(rows), fits)


def predict_all(layouts, machine):   # a dp, pp's layouts: its two rank orders price alike, but
    alike = {}                         # for their nodes
    return [predict(layout, machine, alike) for layout in layouts]


def show_plan(args, machine, weighed, fits):
    nodes = args.world_size // machine.gpus_per_node
    shown = fits[:args.top]
    small = ""
    if args.gpus_per_node > args.world_size:   # a workstation's: one node of the world's GPUs
        small = f": a world smaller than --gpus-per-node {args.gpus_per_node}"
    print(f"plan: {args.world_size} GPUs ({nodes} node{'s' * (nodes > 1)} of "
          f"{machine.gpus_per_node}{small}), a transformer of {args.num_layers} blocks, "
          f"D={args.dim}, h={args.heads}, G={args.kv_heads}, F={args.ffn_dim}, "
          f"{'QK-norm, ' * args.qk_norm}V={args.vocab_size}, T={args.context}, "
          f"B={args.batch_size}, bf16 on fp32 masters, {args.optimizer}; "
          f"{machine.figures['name']}, {si(machine.memory)}B")
    if args.experts:
        print(f"experts: {args.experts} a block, {args.top_k} a position, --ep {args.ep}: "
              f"{si(total_params(args))} parameters, {si(active_params(args))} active (the "
              f"embedding's aside); the experts' loads taken as balanced")
    print(f"{weighed} layouts weighed, {len(fits)} fit; the "
          f"{'' if len(shown) == len(fits) else f'{len(shown)} '}best by predicted step time "
          f"(--top N). Bytes: what the busiest rank sends a step, * across nodes")
    width = max([len(short_layout(row["args"])) for row in shown] + [6]) + 2
    groups = ("tp", "cp", "pp", "dp") if args.cp > 1 else ("tp", "pp", "dp")
    if args.ep > 1:
        groups = (*groups, "ep")
    print(f"{'#':>4}  {'layout':<{width}}{'memory':>10}" + "".join(f"{g:>10}" for g in groups) +
          f"{'bubble':>8}{'compute':>10}{'comm':>10}{'step':>10}{'MFU':>6}")
    for k, row in enumerate(shown, 1):
        parts = row["parts"]
        sent = ""
        for group in groups:          # the hybrid's Ulysses and ring bytes in cp's column
            inside = [g for g in (group, "ulysses", "ring")[:1 + 2 * (group == "cp")]
                      if g in row["bytes"]]
            nbytes = sum(row["bytes"][g] for g in inside)
            crosses = any(g in row["crosses"] for g in inside)
            sent += f"{si(nbytes) + 'B' + '*' * crosses:>10}"
        comm = sum(parts[group] for group in row["bytes"])
        print(f"{k:>4}  {short_layout(row['args']):<{width}}{si(row['memory_bytes']) + 'B':>10}"
              f"{sent}{row['bubble']:>8.1%}"
              f"{seconds(parts['compute']):>10}{seconds(comm):>10}"
              f"{seconds(row['step_s']):>10}{row['mfu']:>6.0%}")
    print(imbalance(fits[0]))
    if args.cp > 1:               # the best row of each style, its cp bytes and its comm
        best = {}
        for row in fits:
            best.setdefault(cp_style_of(row["args"]), row)
        said = []
        for style, row in best.items():
            on_cp = sum(row["parts"].get(group, 0) for group in ("cp", "ulysses", "ring"))
            said.append(f"{style} {seconds(row['step_s'])} ({seconds(on_cp)} on cp), "
                        f"{row['mfu']:.0%}")
        print(f"each --cp-style's best: {'; '.join(said)}")


def cp_style_of(a):   # "ring", "all-gather", "ulysses", "hybrid u8"
    return a.cp_style + f" u{a.ulysses}" * (a.cp_style == "hybrid")


def imbalance(row):   # the best layout's stages apart: the ends weigh on the first and last
    stages = row["stages"]
    if len(stages) == 1:
        return f"one stage: {seconds(stages[0])} of compute and exchanges a step"
    named = {0: " (with E)", loss_stage(row["args"]): " (with H and the loss)"}
    if loss_stage(row["args"]) == 0:
        named = {0: " (with E, H and the loss)"}
    parts = [f"stage {s}{named.get(s, '')} {seconds(t)}" for s, t in sorted(stages.items())]
    slowest = max(stages, key=stages.get)
    return (f"its stages, compute and exchanges a step: {', '.join(parts)}; the slowest, stage "
            f"{slowest}, sets the pace")


PLAN_FLAGS = ["world_size", "hardware", "gpus_per_node", "vocab_size", "top"]


def add_plan_args(parser):
    plan = parser.add_argument_group("--plan: which layout? (the model's flags, and these)")
    plan.add_argument("--plan", action="store_true", help="rank every layout of --world-size GPUs")
    plan.add_argument("--world-size", type=positive_int, default=argparse.SUPPRESS,
                      help="GPUs to lay out (default 8)")
    plan.add_argument("--hardware", choices=sorted(GPUS), default=argparse.SUPPRESS,
                      help="the GPU whose figures price a step, in bf16 (default h100)")
    plan.add_argument("--gpus-per-node", type=positive_int, default=argparse.SUPPRESS,
                      help="divides --world-size (default 8)")
    plan.add_argument("--vocab-size", type=positive_int, default=argparse.SUPPRESS,
                      help="the model's classes V (default: the text's, 97)")
    plan.add_argument("--top", type=int, default=20, help="rows printed, the best first")


def plan_rules(parser, args):
    """--plan takes the world, the machine and the model; it chooses the rest."""
    used = {"plan", *PLAN_FLAGS, "num_layers", "dim", "heads", "kv_heads", "ffn_dim",
            "rope_theta", "qk_norm", "context", "batch_size", "optimizer", "bf16", "bucket_mb",
            "backend", "timeout_s", "cp", "cp_layout", "experts", "top_k", "balance_rate", "ep",
            *AXES, "fixed"}
    refuse_unused(parser, args, used, "--plan, which chooses it")
    vars(args).update({**dict(vocab_size=VOCAB_SIZE, world_size=8, hardware="h100",
                              gpus_per_node=8), **vars(args)})   # the defaults of those not given
    args.bf16 = True                          # the GPUs' figures are bf16's
    model_defaults(args)
    parser.refuse([
        (args.top < 1, f"--top {args.top}: expected 1 or more, the rows to print"),
        *model_rules(args),
        (under_torchrun(), "--plan: run it as a plain command, not under torchrun"),
        (args.world_size % args.cp, f"--cp {args.cp} does not divide --world-size "
                                    f"{args.world_size}: the plan lays out the rest"),
        context_parallel_rules(args, 1)[0],
        *experts_rules(args, args.world_size // args.cp, "--world-size"),
        (args.world_size > args.gpus_per_node and args.world_size % args.gpus_per_node,
         f"--gpus-per-node {args.gpus_per_node} does not divide --world-size "
         f"{args.world_size}: a world larger than a node is whole nodes"),
        (args.world_size % (math.prod(args.fixed.values()) * args.cp),
         f"{fixed_flags(args)}: {math.prod(args.fixed.values()) * args.cp} GPUs, which do not "
         f"divide --world-size {args.world_size}"),
        (next(layouts(args, args.gpus_per_node), None) is None,
         f"--world-size {args.world_size}: no layout of it{' with ' * bool(args.fixed)}"
         f"{fixed_flags(args)} divides --num-layers {args.num_layers}, --heads {args.heads}, "
         f"--kv-heads {args.kv_heads} (or is divided by it), --ffn-dim {args.ffn_dim} and "
         f"--batch-size {args.batch_size}")])


def fixed_flags(args):   # --plan's axes given: "--tp 8 --pp 16" (and --cp's), or ""
    flags = [f"--{axis} {size}" for axis, size in args.fixed.items()]
    return " ".join([*flags, *[f"--cp {args.cp}"] * (args.cp > 1 and bool(flags))])


def parse_args(argv=None):
    parser = training_parser("3D parallelism: data x pipeline x tensor parallel on process groups.",
                             dp=True)
    parser.add_argument("--dp", type=positive_int, default=argparse.SUPPRESS,
                        help="data-parallel replicas (default 2; with --plan, fixes dp)")
    parser.add_argument("--pp", type=positive_int, default=argparse.SUPPRESS,
                        help="stages; divides --num-layers (default 2; with --plan, fixes pp)")
    parser.add_argument("--tp", type=positive_int, default=argparse.SUPPRESS,
                        help="ranks per block; divides --heads (default 2; with --plan, fixes tp)")
    add_schedule_args(parser)
    parser.add_argument("--order", choices=["tp-pp-dp", "tp-dp-pp", "tp-cp-pp-dp", "tp-cp-dp-pp"],
                        default="tp-pp-dp", help="nesting of the rank map, fastest-varying axis "
                        "first (cp, where there is one, next to tp)")
    parser.add_argument("--tp-style", choices=["all-gather", "megatron"], default="all-gather",
                        help="every layer column-parallel with an all-gather, or Megatron's pairs")
    parser.add_argument("--p2p-shard", action="store_true", help="send 1/tp of what crosses stages")
    add_sequence_parallel(parser)
    add_context_parallel(parser)
    parser.add_argument("--show-rank-map", action="store_true", help="print the rank map and exit")
    parser.add_argument("--ray", action="store_true",
                        help="start the ranks as Ray Train workers (make 3d-ray installs Ray)")
    add_plan_args(parser)
    # make 3d's run, measured: 2 blocks and 180 steps learn to 1.63 nats in 39 s on 2 cores (4
    # blocks and 200 steps: 1.60 in 71 s); --pp 4 or --schedule interleaved want --num-layers 4
    parser.set_defaults(num_layers=2, steps=180)
    args = parser.parse_args(argv)
    args.order = args.order.replace("cp-", "")       # cp sits next to tp in either order
    args.fixed = {axis: vars(args)[axis] for axis in AXES if axis in vars(args)}   # --plan's
    for axis in AXES:
        vars(args).setdefault(axis, 2)
    plan_flags = [name for name in PLAN_FLAGS   # given: a default changed, or one suppressed
                  if getattr(args, name, None) != parser.get_default(name) and name in vars(args)]
    if args.plan:
        plan_rules(parser, args)
        return args
    del args.fixed
    flag = next(iter(plan_flags), "").replace("_", "-")
    parser.refuse([(plan_flags, f"--{flag}: only with --plan (a run's world: --dp x --pp x --tp)")])
    if args.show_rank_map:
        used = {"show_rank_map", "dp", "pp", "tp", "cp", "ep", "order", "backend", "timeout_s"}
        refuse_unused(parser, args, used, "--show-rank-map")
        parser.refuse([(args.dp % args.ep, f"--ep {args.ep} does not divide --dp {args.dp} (the "
                                           f"replicas hold the experts)")])
        return args
    model_defaults(args)
    parser.refuse([*model_rules(args), divides(args.heads, "--heads", args.tp, "--tp"),
                   *tp_model_rules(args, args.tp, "--tp"),
                   *sequence_parallel_rules(args, args.tp, "--tp"),
                   *context_parallel_rules(args, args.tp),
                   (args.pp > args.num_layers, f"--pp {args.pp}: more stages than --num-layers "
                                               f"({args.num_layers})"),
                   divides(args.num_layers, "--num-layers", args.pp, "--pp"),
                   *schedule_rules(args, args.pp, "--pp")])
    parser.refuse([
        (args.ray and importlib.util.find_spec("ray") is None,
         "--ray: Ray is not installed; pip install 'ray[train]' (or: make 3d-ray)"),
        (args.p2p_shard and args.tp == 1, "--p2p-shard: with --tp 1 there is nothing to shard"),
        (args.p2p_shard and args.pp == 1, "--p2p-shard: with --pp 1 nothing crosses a stage")])
    world = "--dp x --pp x --tp"
    if args.cp > 1:
        world = "--dp x --pp x --tp x --cp"
    check_training_args(parser, args, args.dp * args.pp * args.tp * args.cp, args.dp, "--dp", world)
    return args


if __name__ == "__main__":
    run_main(main)
