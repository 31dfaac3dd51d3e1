"""This machine, as three_d.py's planner would price it: the CPU model that checks the planner's
step against measured runs (tests/bench.py plan). The GPUs' figures stay in three_d.py.

ThisMachine times, at start-up (about 9 s): alone, on one thread as a rank runs, each layer's
F, B and W at the shapes asked (step 3's blocks' own work: the gather layer's copies too), the
matmul that --recompute runs again, the loss, and the optimizer's pass; with every rank at once,
as in a step, each collective and a send, of 1 and 16 MB, over groups of each size (beta from
the difference, alpha what is left), and a matmul, whose slowdown over the one alone counts the
cores the ranks share. Where ranks outnumber cores, the step's pipeline is played out action by
action, as run_schedule() runs it, the cores shared among the ranks computing at each moment.
"""
import functools
import math
import os
import statistics
import time

import torch
import torch.distributed as dist

from collectives import RANK_BYTES, cleanup, collective_cost, setup, spawn
from data_parallel import (Whole, block_backward, block_forward, block_names, cross_entropy,
                           embedding_forward, head_backward, head_forward, rope_table)
from pipeline_parallel import (HAND_ACT, HAND_GRAD, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD,
                               build_schedule, virtual_stage)
from tensor_parallel import shard, tensor_kinds
from three_d import Machine


@functools.lru_cache(maxsize=None)
def this_machine(world_size, cores):
    """ThisMachine, timed once a process for a world and a core count: its users share it."""
    return ThisMachine(world_size, cores)


class ThisMachine(Machine):
    """This machine, timed (the module's docstring says how)."""
    SIZES = (2**20, 2**24)
    KINDS = ("all-reduce", "reduce-scatter", "all-gather")

    def __init__(self, world_size, cores):
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / world_size
        super().__init__(dict(name="this machine", flops=0.0, memory_gb=(memory - RANK_BYTES) / 1e9,
                              hbm_gbps=1), gpus_per_node=world_size)
        self.world_size = world_size
        torch.set_num_threads(1)
        self.timed = {}                              # (kind, rows, ...) -> (F, B, W)
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
        x = torch.randn(256, 1024)
        w = torch.randn(1024, 1024)
        self.cores = min(cores, world_size * timed(lambda: x @ w) / swept[-1, 0].item())
        # A collective waits for its last rank; sharing cores, ranks drift apart between two:
        # what a matmul then an all-reduce takes beyond the two apart.
        self.sync_s = 0.0
        if world_size > cores:
            matmul_then_all_reduce = swept[-2, 0].item()
            matmul = swept[-1, 0].item()
            all_reduce = swept[tests.index(("all-reduce", world_size)), 0].item()
            self.sync_s = max(0.0, matmul_then_all_reduce - matmul - all_reduce)
        grads = torch.zeros(2**20, requires_grad=True)
        grads.grad = torch.zeros_like(grads)
        self.per_param = {}
        for name, optimizer in (("adamw", torch.optim.AdamW), ("sgd", torch.optim.SGD)):
            step = optimizer([grads], lr=1e-3).step
            self.per_param[name] = timed(lambda: (grads.grad.div_(2), step(), grads.grad.zero_())
                                         ) / grads.numel()

    def layer_s(self, kind, rows, args, tp, classes=0):
        key = (kind, rows, args._replace(recompute=False), tp, classes)   # args: three_d's Shape
        if key not in self.timed:
            self.timed[key] = self.time_part(kind, rows, args, tp, classes)
        f, b, w, again = self.timed[key]
        return f, b + again * args.recompute, w

    def time_part(self, kind, rows, args, tp, classes):
        """(F, B, W, the forward again) of a tp rank's part, its own work as step 3's blocks do
        it: a block on its shards (the all-gather style's copies too, its collectives apart);
        the head and its loss over its classes; the embedding's lookup and its index_add_.
        rows: positions, b T."""
        dim = args.dim
        dtype = torch.bfloat16 if args.bf16 else torch.float32
        if kind == "embedding":
            table = torch.randn(classes, dim, dtype=dtype)
            tokens = torch.randint(classes, (rows // args.context, args.context))
            g = torch.randn(rows, dim)
            grad = torch.zeros(classes, dim)
            return (timed(lambda: embedding_forward(tokens, [table])), 0.0,
                    timed(lambda: grad.index_add_(0, tokens.reshape(-1), g)), 0.0)
        x = torch.randn(rows // args.context, args.context, dim, dtype=dtype)
        if kind == "head":
            w = [torch.ones(dim), torch.randn(dim, classes, dtype=dtype)]
            y = torch.randint(classes, (rows,))
            g = torch.randn(rows, classes, dtype=dtype)
            stash = head_forward(x, w)[1]
            forward = (lambda: cross_entropy(head_forward(x, w)[0], y, rows))
            backward = (lambda: head_backward(g, stash, w))
            terms = head_backward(g, stash, w)[1]
        else:
            kinds = tensor_kinds(["block"], args, tp)[0]
            head_dim = dim // args.heads
            F = args.ffn_dim
            kv = args.kv_heads * head_dim
            shapes = {"norm1": (dim,), "wq": (dim, dim), "wk": (dim, kv), "wv": (dim, kv),
                      "norm_q": (head_dim,), "norm_k": (head_dim,), "wo": (dim, dim),
                      "norm2": (dim,), "w1": (dim, F), "w3": (dim, F), "w2": (F, dim)}
            w = [shard(torch.randn(*shapes[name]), k, 0, tp, args.kv_heads).to(dtype)
                 for name, k in zip(block_names(args.qk_norm), kinds)]
            shape = dict(head_dim=head_dim, rope=rope_table(torch.arange(args.context), head_dim,
                                                            10000.0),
                         qk_norm=args.qk_norm, split=LocalSplit(args.tp_style, tp))
            stash = block_forward(x, w, **shape)[1]
            g = torch.randn_like(x)
            forward = (lambda: block_forward(x, w, **shape))
            backward = (lambda: block_backward(g, stash, w, **shape))
            terms = block_backward(g, stash, w, **shape)[1]
        matmuls = [(a.flatten(0, -2).T.float(), dz.flatten(0, -2).float()) for a, dz in terms
                   if a is not None]
        dw = timed(lambda: [torch.mm(a, dz) for a, dz in matmuls])
        self.flops = max(self.flops, sum(2 * a.shape[0] * a.shape[1] * dz.shape[1]
                                         for a, dz in matmuls) / dw)
        return timed(forward), timed(backward), dw, timed(forward) * (kind == "block")


    def collective_s(self, kind, nbytes, n, per_node):
        if n == 1:
            return 0.0
        alpha, beta = self.links[kind, 2 if kind == "send" else n]
        return collective_cost(kind, nbytes, n, alpha, beta)[1] + self.sync_s * (kind != "send")

    def update_s(self, params, optimizer, bf16):   # every rank's at once, on the cores they share
        return params * self.per_param[optimizer] * max(1.0, self.world_size / self.cores)

    def pipeline_s(self, args, slowest, stages):
        if args.dp * args.pp * args.tp <= self.cores:
            return super().pipeline_s(args, slowest, stages)
        return play_schedule(args, stages, self), {}


class LocalSplit:
    """A tp split whose collectives are priced apart: what a rank's own work holds of them, the
    all-gather style's copy of the pieces side by side (its own piece, tp times)."""

    def __init__(self, tp_style, tp):
        self.gathers = tp_style == "all-gather" and tp > 1
        self.tp = tp

    def gather(self, a):
        return torch.cat([a] * self.tp, dim=-1) if self.gathers else a

    def gather_back(self, dy):
        return dy[..., :dy.shape[-1] // self.tp].contiguous() if self.gathers else dy

    g = gather
    g_back = gather_back
    f = f_back = row_back = staticmethod(Whole.f)


def timed(fn, at_least_s=0.03):
    """The median seconds of fn, run until at_least_s has passed, 3 times at least."""
    fn()
    times = []
    start = time.perf_counter()
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
    x = torch.randn(256, 1024)
    w = torch.randn(1024, 1024)
    for i, (kind, n) in enumerate(tests):
        for j, size in enumerate(nbytes):
            whole = torch.zeros(size // 4)
            part = torch.zeros(size // 4 // n)
            came = torch.zeros(size // 4)

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


def play_schedule(args, stages, machine):
    """The pipeline played out: each stage's action list as run_schedule() runs it. A transfer
    arrives a send's time after both its sides are posted; a batch with a receive waits for
    its transfers and the sends before it. Every rank computing at a moment gets an equal share
    of the cores, one at most; a stage's tp (and ZeRO-3) exchanges, a wait of their own."""
    p, v, m, width = args.pp, args.virtual_stages, args.micro_batches, args.dp * args.tp
    by_kind = {(stage["stage"] == 0, stage["stage"] == p - 1): stage for stage in stages}
    stages = [by_kind[s == 0, s == p - 1] for s in range(p)]
    actions = [build_schedule(args.schedule, p, s, m, v)[::-1] for s in range(p)]   # popped
    act = args.batch_size // (args.dp * m) * args.dim * (2 if args.bf16 else 4)
    link = machine.collective_s("send", act // args.tp if args.p2p_shard else act, 2, 2)
    w_apart = args.schedule in ("zb-h1", "dualpipev")    # W an action of its own, not in B
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
                if action.op != "comm":             # an F&B: its halves, one after the other
                    talk = stage["comm"]["tp"] + stage["comm"]["dp"] * (args.zero == 3)
                    running[s] = [0.0, 0.0]
                    for op, _, chunk in action.halves():
                        f, bwd, w = stage["chunks"][chunk or 0]
                        running[s][0] += {"F": f, "B": bwd + w * (not w_apart), "W": w}[op]
                        running[s][1] += talk / (2 * m * v) * (op != "W")
                    continue
                batch = set()
                for kind, mb, chunk in action.comms:
                    if kind in (HAND_ACT, HAND_GRAD):   # the V's turn: on the stage itself
                        continue
                    k = virtual_stage(args.schedule, p, s, chunk)
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
        rate = min(1.0, machine.cores / computing) if computing else 1.0
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
