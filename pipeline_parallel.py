"""Step 4: pipeline parallelism. Stages own consecutive layers; micro-batches flow through.

    python pipeline_parallel.py                                   # 4 stages, 1F1B
    python pipeline_parallel.py --micro-batches 8 --timeline      # make pp: the picture
    python pipeline_parallel.py --world-size 2 --micro-batches 8 --check
    python pipeline_parallel.py --micro-batches 8 --num-layers 8 --schedule interleaved --timeline
    python pipeline_parallel.py --micro-batches 8 --num-layers 8 --schedule dualpipev --timeline
    python pipeline_parallel.py --experts 4 --check               # each block's router, its stage's
    torchrun --nproc-per-node 4 pipeline_parallel.py

The lecture sends activations forward one micro-batch at a time and stops: "Backward pass: homework
exercise", and "Not handled: overlapping communication/computation to eliminate pipeline bubbles".
This step adds both: the backward across stages, and schedules that keep several stages busy at
once, as data: per stage, a list of actions that one runner executes, printed, tested and drawn.

    stage s of p owns blocks [s L/p, (s+1) L/p); stage 0 the embedding (it reads the tokens
    [B/m, T]), stage p-1 the final norm, the head and the loss (it reads the targets [B/m, T])
    F(i) on stage s: receive x_i [B/m, T, D] from s-1, run its parts, send its output to s+1
    B(i) on stage s: receive g_i from s+1, run its parts' backward (dW summed over
                     micro-batches), send dL/dx_i to s-1; one [B/m, T, D] each way

1F1B at p = 3, m = 4, as build_schedule() writes it: [a>0] sends activation 0 on, [>a0]
receives it, [<g0] sends gradient 0 back, [g<0] receives it; brackets post together.

    stage 0  F0 [a>0] F1 [a>1] F2 [a>2 g<0] B0 F3 [a>3 g<1] B1 [g<2] B2 [g<3] B3
    stage 1  [>a0] F0 [a>0 >a1] F1 [a>1 g<0] B0 [<g0 >a2] F2 [a>2 g<1] B1 [<g1 >a3] F3 ...
    stage 2  [>a0] F0 B0 [<g0 >a1] F1 B1 [<g1 >a2] F2 B2 [<g2 >a3] F3 B3 [<g3]

GPipe runs all m forwards, then all m backwards; 1F1B (PipeDream-flush) fills the pipe
with p-s-1 forwards, then runs one forward, one backward, then drains; ZB-H1 (zero bubble,
Qi et al. 2023) splits B into dx, which the stage before waits for, and W, dW, which nobody
waits for; interleaved 1F1B (Megatron-LM, Narayanan et al. 2021) gives stage s v chunks,
chunk c being virtual stage c p + s; DualPipeV (DeepSeek-V3) puts 2 chunks a stage in a V, so that
stage 0 holds the first and the last, and pairs one micro-batch's forward with another's
backward. pipeline_costs() gives each one's bubble and stash.

Read in parts: 1, schedules as action lists; 2, DualPipeV, the V; 3, the stages, the runner that
executes a list, and the worker.

PyTorch's: torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B,
ScheduleInterleavedZeroBubble, ScheduleDualPipeV (tests/bench.py races them).
"""
import warnings
from functools import lru_cache, partial
from typing import NamedTuple
warnings.filterwarnings("ignore", "Failed to initialize NumPy")   # torch warns without numpy
import torch
import torch.distributed as dist

from collectives import cleanup, log, run_main, setup, spawn
from data_parallel import (DataParallel, MoE, Router, balance, cross_entropy, init_params,
                           make_batch, model_blocks, spans_of, tensors_of)
from data_parallel import (SerialCheck, load_checkpoint, log_step, save_checkpoint,   # the
                           whole_on_rank0)               # worker's --check and checkpoints

# Part 1: schedules as action lists ----------------------------------------------------------------

SEND_ACT = "a>"    # an activation, on to the next stage
RECV_ACT = ">a"    # ... received from the stage before
SEND_GRAD = "<g"   # a gradient, back to the stage before
RECV_GRAD = "g<"   # ... received from the next stage
HAND_ACT = "a="    # DualPipeV's turn: chunk a's output handed to chunk b on the same stage
HAND_GRAD = "=g"   # ... and chunk b's dx handed back to chunk a


class Action(NamedTuple):
    op: str              # "F", "B", "W", "F&B" (DualPipeV's pair) or "comm"
    mb: object = -1      # the micro-batch of an F, B or W; an F&B's two, (forward's, backward's)
    chunk: object = None   # with chunks: which of the stage's (printed a, b, ...); an F&B's two
    comms: tuple = ()    # for "comm": ((kind, mb, chunk), ...), posted and waited for together

    def halves(self):    # [(op, mb, chunk)]: an F&B's forward and backward, else itself
        if self.op == "F&B":
            return [("F", self.mb[0], self.chunk[0]), ("B", self.mb[1], self.chunk[1])]
        return [(self.op, self.mb, self.chunk)]

    def __str__(self):
        def name(op, mb, chunk):
            return f"{op}{mb}{'' if chunk is None else 'abcdefgh'[chunk]}"
        if self.op != "comm":
            return "&".join(name(*half) for half in self.halves())
        return "[" + " ".join(name(*comm) for comm in self.comms) + "]"


def virtual_stage(schedule, num_stages, stage, chunk):
    """Which of the v p virtual stages chunk c of stage s is: interleaved, c p + s (each round of
    the pipe passes every stage); DualPipeV's V, chunk 0 is s, down the V, and chunk 1 is
    2p-1-s, back up it, so that stage 0 holds the first and the last."""
    if schedule == "dualpipev" and chunk == 1:
        return 2 * num_stages - 1 - stage
    return (chunk or 0) * num_stages + stage


def stage_layers(num_layers, num_stages, stage, num_chunks=1, chunk=0, schedule="1f1b"):
    """Stage s owns layers [s L/p, (s+1) L/p); with chunks, virtual stage k owns layers
    [k L/(v p), (k + 1) L/(v p))."""
    per_chunk = num_layers // (num_stages * num_chunks)
    virtual = virtual_stage(schedule, num_stages, stage, chunk)
    return range(virtual * per_chunk, (virtual + 1) * per_chunk)


def warmup_forwards(schedule, num_stages, stage, num_micro_batches, num_chunks=1):
    """Forwards before the first backward, to fill the pipe (interleaved, Megatron's rule)."""
    p, s, m, v = num_stages, stage, num_micro_batches, num_chunks
    if schedule == "gpipe" or (schedule == "interleaved" and m == p):
        return m * v
    if schedule == "interleaved":
        return min((v - 1) * p + 2 * (p - s - 1), m * v)
    return min(p - s - 1, m)


def compute_order(schedule, num_stages, stage, num_micro_batches, num_chunks=1):
    """The compute actions of one stage, in order, (op, micro-batch, chunk or None), in three
    phases: warm-up, forwards alone, to fill the pipe; steady state, one forward then one
    backward; cool-down, the backwards left. GPipe is all warm-up. Interleaved, forward k runs
    chunk (k // p) mod v of micro-batch (k // (v p)) p + k mod p: p micro-batches a chunk."""
    p, s, m, v = num_stages, stage, num_micro_batches, num_chunks
    if schedule == "dualpipev":
        return dualpipev_order(p, s, m)
    chunks = list(range(v)) if schedule == "interleaved" else [None] * v
    forwards = [("F", k // (p * v) * p + k % p, chunks[k // p % v]) for k in range(m * v)]
    backwards = [("B", k // (p * v) * p + k % p, chunks[v - 1 - k // p % v]) for k in range(m * v)]
    warmup = warmup_forwards(schedule, p, s, m, v)
    order = forwards[:warmup]                          # warm-up: fill the pipe
    for k in range(m * v - warmup):                    # steady state: one forward, one backward
        order += [forwards[warmup + k], backwards[k]]
    order += backwards[m * v - warmup:]                # cool-down: drain it
    if schedule != "zb-h1":
        return order
    with_w = []        # ZB-H1: B is dx alone; W, dW = x^T dz, waits for nobody, so stage s
    held_back = []     # runs each W s backwards late, and the last s at the end
    for action in order:
        with_w.append(action)
        if action[0] == "B":
            held_back.append(("W", *action[1:]))
            if len(held_back) > s:
                with_w.append(held_back.pop(0))
    return with_w + held_back


def build_schedule(schedule, num_stages, stage, num_micro_batches, num_chunks=1):
    """One stage's whole action list: the compute, and the point-to-point it needs.

    Before F(i) a stage receives micro-batch i's activation (but the first), after it sends
    its output on (but the last); B mirrors that with gradients; W needs neither. Sends and
    receives between the same two computations are one batch: in 1F1B's steady state stage s
    sends activation i, then waits for gradient j, while s+1 sends gradient j, then waits for
    activation i; two sends facing each other deadlock (NCCL's always, gloo's past a tiny
    buffer), where in one batch each finds its receive. Interleaved, as Megatron does, each
    steady forward and the backward after it run back to back (a batch would close a cycle)."""
    if schedule == "dualpipev":           # its point-to-point placed by the whole V's rounds
        return v_schedules(num_stages, num_micro_batches)[stage]
    p = num_stages
    last = p * num_chunks - 1

    def virtual(chunk):
        return virtual_stage(schedule, p, stage, chunk)
    order = compute_order(schedule, p, stage, num_micro_batches, num_chunks)
    warmup = warmup_forwards(schedule, p, stage, num_micro_batches, num_chunks)
    runs = []                                 # what runs back to back, no batch between
    for k, (op, mb, chunk) in enumerate(order):
        if schedule == "interleaved" and op == "B" and k > warmup and order[k - 1][0] == "F":
            runs[-1].append((op, mb, chunk))  # a steady-state backward joins its forward
        else:
            runs.append([(op, mb, chunk)])
    actions = []
    pending = []
    for run in runs:
        for op, mb, chunk in run:             # what the run needs received first
            if op == "F" and virtual(chunk) > 0:
                pending.append((RECV_ACT, mb, chunk))
            if op == "B" and virtual(chunk) < last:
                pending.append((RECV_GRAD, mb, chunk))
        if pending:                           # (a send due after B goes before a W, too)
            actions.append(Action("comm", comms=tuple(pending)))
            pending = []
        for op, mb, chunk in run:             # the compute, and what it sends after
            actions.append(Action(op, mb, chunk))
            if op == "F" and virtual(chunk) < last:
                pending.append((SEND_ACT, mb, chunk))
            if op == "B" and virtual(chunk) > 0:
                pending.append((SEND_GRAD, mb, chunk))
    if pending:
        actions.append(Action("comm", comms=tuple(pending)))
    return actions


@lru_cache(maxsize=None)
def held_counts(schedule, num_stages, stage, num_micro_batches, num_chunks):
    """(micro-batches between F and B, between B and W) after each action, those no other pair
    has as many of both (the largest stash is at one of them)."""
    kept = 0
    waiting = 0
    pairs = set()
    apart = schedule in ("zb-h1", "dualpipev")         # their W apart from B
    for entry in compute_order(schedule, num_stages, stage, num_micro_batches, num_chunks):
        for op in entry[0].split("&"):                  # an F&B: its F, then its B
            kept += (op == "F") - (op == "B")
            waiting += apart * ((op == "B") - (op == "W"))
            pairs.add((kept, waiting))
    return undominated(pairs)


def undominated(pairs):   # the (k, w) no other pair has as many of both
    kept = []
    for k, w in sorted(pairs, reverse=True):           # by k, then w, largest first
        if not kept or w > kept[-1][1]:
            kept.append((k, w))
    return kept


@lru_cache(maxsize=None)   # (a plan's layouts share many)
def pipeline_costs(schedule, num_stages, stage, num_micro_batches, num_chunks=1, *, act_bytes=0,
                   kept_bytes=0, waiting_bytes=0, times=(1, 1, 1)):
    """Stage s's costs a step: the bubble, the idle share for stages of equal speed and free
    communication (GPipe, 1F1B: (p-1)/(m+p-1); interleaved: (p-1)/(v m+p-1); ZB-H1, for times
    (T_F, T_B, T_W): (p-1)(T_F+T_B-T_W) / (m (T_F+T_B+T_W) + (p-1)(T_F+T_B-T_W)), or none);
    its stash at its largest: kept_bytes a micro-batch between its F and B (a chunk's blocks'
    stashes, --recompute: x), waiting_bytes between B and W ((x, dz)); its sends, act_bytes each."""
    p, s, m, v = num_stages, stage, num_micro_batches, num_chunks
    t_f, t_b, t_w = times
    bubble = (p - 1) / (v * m + p - 1)
    if schedule == "zb-h1":
        idle = max(0, (p - 1) * (t_f + t_b - t_w))
        bubble = idle / (m * (t_f + t_b + t_w) + idle)
    if schedule == "dualpipev":                       # as its lists run, a chunk half of each
        bubble = v_bubble(p, m, t_f / 2, t_b / 2, t_w / 2)
    most = max(kept * kept_bytes + waiting * waiting_bytes
               for kept, waiting in held_counts(schedule, p, s, m, v))
    virtual = [virtual_stage(schedule, p, s, c) for c in range(v)]
    neighbours = sum((k > 0) + (k < p * v - 1) - (k in (p - 1, p) and schedule == "dualpipev")
                     for k in virtual)                # (the V's turn: handed over, not sent)
    return bubble, most, [("send", act_bytes, neighbours * m)]


# Part 2: DualPipeV, the V -------------------------------------------------------------------------
#
# DualPipeV (DeepSeek's DualPipe cut in half; torch's ScheduleDualPipeV): 2p chunks on p stages in a
# V. Stage s holds chunk a, virtual stage s, and chunk b, virtual stage 2p-1-s: a micro-batch runs
# down the stages through the a chunks, turns at stage p-1 (a hands to b there: no send), and
# climbs back through the b chunks to stage 0, which holds the embedding and the head. So the
# first stage, which fills the pipe, also drains it: it starts the next micro-batch's forward
# beside the last one's backward, where 1F1B's first stage waits for the whole pipe to turn.
#
# Each stage's compute in DualPipeV's eight phases (F: forward, B: dx alone, W: dW; F&B: one
# micro-batch's forward beside another's backward, which a GPU overlaps, their sends and receives
# posted together; a B without its W runs W at once):
#   1 nF0       2(p-s-1) forwards of chunk a, filling the V's first arm
#   2 nF0F1     s+1 pairs F a, F b: the first micro-batches reach the turn and come back up
#   3 nB1W1F1   p-s-1 times B b (its W kept), that W, F b: the first backwards start at the top
#   4 nF0B1F1B0 m-2p+s+1 times F&B (a forward, b backward) then F&B (b forward, a backward): the
#               steady state, every stage busy (the turn's first: F a, then B b, not paired)
#   5 nB1F1B0   p-s-1 times B b, then F&B (b forward, a backward): the last forwards
#   6 nB1B0     s+1 times B b, B a; from the middle on, each W kept for the bubble after
#   7 nWB0      p-s-1 times a kept W, then B a (its W kept)
#   8 nW        s+1 kept Ws: the cool-down's bubble filled with dW
# m >= 2p: every stage reaches the steady state. At p = 4, m = 8, every F, B and W one unit of a
# chunk (L/8 layers), as simulate() runs build_schedule's lists; 1F1B's over 4 stages of L/4 below
# it, its B (dx and dW) one unit of a stage:
#   V     stage 0 FFFFFFFFBWFBWFBWFFBWFBWBW.FBWBW.FBWBW.FBWBWBWBWBWBW    3 of 51 units idle
#         stage 3 ...FFFFFFFFFBWFBWFBWFBWFBWFBWFBWFBWBWBWBWBWBBBBWWWW
#   1F1B  stage 0 FFFF...BFBFBFBFB.B.B.B                                 6 of 22 units idle
#         stage 3 ...FBFBFBFBFBFBFBFB...
# DeepSeek gives its bubble as (p - 1)(F&B + B - 3W) a step, F&B the overlapped pair's time; here
# the pair's halves run one after the other, and the lists idle p - 1 units at F = B = W (their
# bubble is the same for every m: tests/test_pipeline_parallel.py). Each stage holds two chunks'
# weights, and at most 2p + 1 micro-batches of a chunk's activations (DeepSeek's PP + 1, PP = 2p).

def dualpipev_order(num_stages, stage, num_micro_batches):
    """Stage s's compute under DualPipeV, as DeepSeek's dualpipev.py orders it: (op, mb, chunk),
    an F&B as ("F&B", (forward's mb, backward's mb), (forward's chunk, backward's chunk)). Each
    chunk runs its forwards and its backwards in micro-batch order; a kept W runs first in,
    first out."""
    p, s, m = num_stages, stage, num_micro_batches
    taken = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}
    order = []
    kept = []                              # Ws held back for a bubble, oldest first

    def next_mb(op, chunk):                # the next micro-batch this op runs on this chunk
        taken[op, chunk] += 1
        return taken[op, chunk] - 1

    def forward(chunk):
        order.append(("F", next_mb("F", chunk), chunk))

    def backward(chunk, keep_w=False):     # B; its W at once, or kept for later
        mb = next_mb("B", chunk)
        order.append(("B", mb, chunk))
        if keep_w:
            kept.append(("W", mb, chunk))
        else:
            order.append(("W", mb, chunk))

    def weights():
        order.append(kept.pop(0))

    def pair(forward_chunk, backward_chunk):   # F&B: its B's W at once
        mbs = (next_mb("F", forward_chunk), next_mb("B", backward_chunk))
        order.append(("F&B", mbs, (forward_chunk, backward_chunk)))
        order.append(("W", mbs[1], backward_chunk))
    for _ in range(2 * (p - s - 1)):                        # 1 nF0
        forward(0)
    for _ in range(s + 1):                                  # 2 nF0F1
        forward(0)
        forward(1)
    for _ in range(p - s - 1):                              # 3 nB1W1F1
        backward(1, keep_w=True)
        weights()
        forward(1)
    for i in range(m - 2 * p + s + 1):                      # 4 nF0B1F1B0
        if i == 0 and s == p - 1:          # the turn's first: its F a feeds its own B b
            forward(0)
            backward(1)
        else:
            pair(0, 1)
        pair(1, 0)
    for _ in range(p - s - 1):                              # 5 nB1F1B0
        backward(1)
        pair(1, 0)
    keep = False
    for i in range(s + 1):                                  # 6 nB1B0
        keep = keep or (i == (s + 1) // 2 and s % 2 == 1)
        backward(1, keep_w=keep)
        keep = keep or (i == (s + 1) // 2 and s % 2 == 0)
        backward(0, keep_w=keep)
    for _ in range(p - s - 1):                              # 7 nWB0
        weights()
        backward(0, keep_w=True)
    for _ in range(s + 1):                                  # 8 nW
        weights()
    return order


@lru_cache(maxsize=None)
def v_schedules(num_stages, num_micro_batches):
    """Every stage's DualPipeV action list. The V's order has sends far from their receives (stage
    0 sends micro-batch 2p-1 down in phase 2; stage 1 takes it in phase 4): a batch of one stage
    holding such a send, another's holding the receive long after, deadlock under NCCL, whose
    batches run in order. So the point-to-point is placed by the whole V at once: its compute
    timed with every F, B and W one unit, each transfer at the moment its sender's action ends
    (an F&B's two together), in a batch of that moment on both stages, after whatever began
    before it. Each stage meets its batches
    in the order of the moments, the same order on every stage, and no action waits on a later
    one."""
    p, m = num_stages, num_micro_batches
    orders = [[Action(*entry) for entry in dualpipev_order(p, s, m)] for s in range(p)]
    started = [[] for _ in range(p)]          # (the moment it begins, action)
    batches = [{} for _ in range(p)]          # moment -> [(kind, mb, chunk)]
    arrived = [{} for _ in range(p)]          # (kind, mb, chunk) -> the moment it is there
    clock = [0] * p
    done = [0] * p
    while any(done[s] < len(orders[s]) for s in range(p)):
        ran = False
        for s in range(p):
            while done[s] < len(orders[s]) and all(
                    key in arrived[s] for key in v_inputs(p, s, orders[s][done[s]])):
                action = orders[s][done[s]]
                clock[s] = max([clock[s]] + [arrived[s][key] for key in v_inputs(p, s, action)])
                started[s].append((clock[s], action))
                clock[s] += len(action.halves())
                for op, mb, chunk in action.halves():   # an F&B's sends together, at its end
                    v_send(p, s, op, mb, chunk, clock[s], batches, arrived)
                done[s] += 1
                ran = True
        if not ran:
            raise RuntimeError(f"DualPipeV at p {p}, m {m}: no stage can run")
    actions = []
    for s in range(p):                        # each batch after the actions begun before it
        timed = [(t, 0, action) for t, action in started[s]] + \
                [(t, -1, Action("comm", comms=tuple(comms))) for t, comms in batches[s].items()]
        actions.append([action for _, _, action in sorted(timed, key=lambda x: x[:2])])
    return actions


def v_send(p, s, op, mb, chunk, moment, batches, arrived):
    """What stage s's op on chunk sends, at that moment, into both ends' batches (the V's turn:
    handed over on the stage itself)."""
    virtual = virtual_stage("dualpipev", p, s, chunk) + {"F": 1, "B": -1}.get(op, 0)
    if op == "W" or not 0 <= virtual < 2 * p:
        return                                # dW, the loss's B, the embedding's B: none sent
    peer, peer_chunk = (virtual, 0) if virtual < p else (2 * p - 1 - virtual, 1)
    arrives = (RECV_ACT if op == "F" else RECV_GRAD, mb, peer_chunk)
    if peer == s:
        batches[s].setdefault(moment, []).append((HAND_ACT if op == "F" else HAND_GRAD, mb,
                                                  chunk))
    else:
        batches[s].setdefault(moment, []).append((SEND_ACT if op == "F" else SEND_GRAD, mb,
                                                  chunk))
        batches[peer].setdefault(moment, []).append(arrives)
    arrived[peer][arrives] = moment


def v_inputs(num_stages, stage, action):   # what an action's halves need come in first
    last = 2 * num_stages - 1
    return [(RECV_ACT if op == "F" else RECV_GRAD, mb, chunk) for op, mb, chunk in action.halves()
            if (op == "F" and virtual_stage("dualpipev", num_stages, stage, chunk) > 0) or
            (op == "B" and virtual_stage("dualpipev", num_stages, stage, chunk) < last)]


# Part 3: the stages, the runner, and the worker --------------------------------------------------

def stage_parts(num_layers, num_stages, stage, num_chunks=1, chunk=0, schedule="1f1b"):
    """The model's parts that chunk c of stage s holds, by index (0 the embedding, 1 + i layer
    i, L + 1 the head): its layers; the first virtual stage, the embedding too; the last, the
    head."""
    virtual = virtual_stage(schedule, num_stages, stage, chunk)
    parts = [1 + i for i in stage_layers(num_layers, num_stages, stage, num_chunks, chunk,
                                         schedule)]
    if virtual == 0:
        parts = [0] + parts
    if virtual == num_stages * num_chunks - 1:
        parts = parts + [num_layers + 1]
    return parts


class Stage:
    """A stage's parts (a chunk's): replica, step 2's holder of weights and gradients; layers,
    their indices in it; blocks, each's forward and backward (3D: step 3's). A micro-batch keeps
    each part's stash from its F to its B: a block's 16 [b, T, D] and lse, or x (--recompute)."""

    def __init__(self, replica, layers, *, blocks, first, last, num_micro_batches, mean_over=1,
                 loss_fn=cross_entropy, recompute=False, before_exchange=None):
        self.replica = replica
        self.before_exchange = before_exchange   # 3D's sequence parallelism: bucket b's dg, dP
        self.layers = list(layers)
        self.blocks = blocks
        self.first = first                    # the embedding is here: it takes token ids
        self.last = last                      # the head is here, and the loss
        self.buckets = [(b, bucket) for b, bucket in enumerate(replica.part_buckets)
                        if bucket[0] in self.layers]
        self.num_micro_batches = num_micro_batches
        self.recompute = recompute
        self.loss_fn = loss_fn
        self.mean_over = mean_over            # the loss: a mean over this many rows
        self.stash = {}                       # micro-batch -> its parts' stashes, popped by B
        self.waiting_for_w = {}               # -> its parts' (x, dz), from B to W (ZB-H1: late)
        self.loss_grad = {}                   # -> dL/dlogits of its output (the last stage)

    def begin_step(self, targets=()):         # the step's targets, a micro-batch each (the last)
        self.loss = 0.0                       # a tensor on the device once summed
        self.weight_passes = 0
        self.targets = targets

    def forward(self, mb, x):
        """F: the parts in turn on x (tokens [b, T] first, else [b, T, D]), each one's stash."""
        out = x
        stashes = []
        for b, bucket in self.buckets:
            self.replica.gather_weights(b)    # ZeRO-3 (in 3D): the bucket's weights, whole
            for i in bucket:
                block = self.blocks[i - self.layers[0]]
                out, stash = block.forward(out, self.replica.part(i), recompute=self.recompute)
                stashes.append(stash)
            self.replica.release_weights(b)
        self.stash[mb] = stashes
        if self.last:          # summed on the device: .item() here would stall a GPU
            loss, self.loss_grad[mb] = self.loss_fn(out, self.targets[mb], self.mean_over)
            self.loss = self.loss + loss
        return out

    def backward(self, mb, g):
        """B: dL/dx of this stage's input, from its last part; each part's (x, dz)s kept for W."""
        if self.last:
            g = self.loss_grad.pop(mb)
        stashes = self.stash.pop(mb)
        self.waiting_for_w[mb] = {}
        for b, bucket in reversed(self.buckets):
            self.replica.gather_weights(b)
            for i in reversed(bucket):           # (the embedding's, first: no dx, for tokens)
                block = self.blocks[i - self.layers[0]]
                g, self.waiting_for_w[mb][i] = block.backward(g, stashes.pop(),
                                                              self.replica.part(i))
            self.replica.release_weights(b)
        return g

    def weight_grads(self, mb):
        """W: dW = x^T dz, which nobody waits for; after the last micro-batch's, the exchange."""
        for i, terms in self.waiting_for_w.pop(mb).items():
            self.replica.add_grads(i, terms)      # each dW = x^T dz, summed over micro-batches
        self.weight_passes += 1
        if self.weight_passes == self.num_micro_batches or self.replica.exchange_each_micro_batch:
            for b, _ in self.buckets:
                if self.before_exchange:          # (summed over tp first: three_d.py)
                    self.before_exchange(b)
                self.replica.reduce_gradients(b)


def no_change(tensor):   # what crosses a stage boundary, as it is (but 3D's --p2p-shard)
    return tensor


def run_schedule(actions, stages, inputs, prev_rank, next_rank, buffer_shape, group=None,
                 outgoing=no_change, incoming=no_change, recorder=None, v_shape=False):
    """Execute one stage's action list on its Stages, one a chunk. inputs: the micro-batches
    (the first stage's). outgoing, incoming: 3D's --p2p-shard, 1/tp sent, all-gathered on
    arrival. recorder: told when each F, B and W starts and stops (the timeline and stash).
    v_shape: DualPipeV's, whose chunk b runs back up the stages, from next_rank to prev_rank."""
    received = {}      # (kind, mb, chunk) -> a tensor come in
    to_send = {}       # (kind, mb, chunk) -> a tensor to go out
    under_way = []     # the Works of the batch before, sends only
    defer_w = any(action.op == "W" for action in actions)
    for action in actions:
        if action.op == "comm":
            for work in under_way:      # the batch before, sends only: NCCL runs a group's
                work.wait()             # batches in order, so it finishes before this one
            ops = []
            for key in action.comms:
                kind, mb, chunk = key
                if kind == HAND_ACT:    # the V's turn: chunk a's output is chunk b's input
                    received[RECV_ACT, mb, 1] = to_send.pop((SEND_ACT, mb, 0))
                    continue
                if kind == HAND_GRAD:   # and chunk b's dx chunk a's gradient
                    received[RECV_GRAD, mb, 0] = to_send.pop((SEND_GRAD, mb, 1))
                    continue
                downstream = kind in (SEND_ACT, RECV_GRAD)
                if v_shape and chunk == 1:
                    downstream = not downstream
                peer = next_rank if downstream else prev_rank
                if kind in (RECV_ACT, RECV_GRAD):
                    received[key] = torch.empty(buffer_shape, dtype=stages[0].replica.dtype,
                                                device=stages[0].replica.device)   # [b, T, D]
                    ops.append(dist.P2POp(dist.irecv, received[key], peer, group))
                else:
                    ops.append(dist.P2POp(dist.isend, to_send.pop(key), peer, group))
            works = dist.batch_isend_irecv(ops) if ops else []   # NCCL: one Work for the
            under_way = works           # batch; gloo: one an op. Sends only: they go meanwhile
            if any(kind in (RECV_ACT, RECV_GRAD) for kind, _, _ in action.comms):
                for work in works:      # every one, before F or B reads what arrived: on a GPU,
                    work.wait()         # wait() is what makes the compute stream wait for it
                under_way = []
            continue
        for op, mb, chunk in action.halves():   # an F&B: its forward, then its backward
            stage = stages[chunk or 0]
            if recorder:
                recorder.start()
            if op == "F":
                x = inputs[mb] if stage.first else incoming(received.pop((RECV_ACT, mb, chunk)))
                out = stage.forward(mb, x)
                if not stage.last:
                    to_send[SEND_ACT, mb, chunk] = outgoing(out).contiguous()
            elif op == "B":
                g = None if stage.last else incoming(received.pop((RECV_GRAD, mb, chunk)))
                dx = stage.backward(mb, g)
                if not stage.first:
                    to_send[SEND_GRAD, mb, chunk] = outgoing(dx).contiguous()
                if not defer_w:         # dW now; ZB-H1's W comes later, in the bubble
                    stage.weight_grads(mb)
            else:
                stage.weight_grads(mb)
            if recorder:
                recorder.stop(op, mb, chunk, stages)
    for work in under_way:
        work.wait()


def hold_stages(args, stage, num_stages, device, routers=None):
    """(the whole model as drawn, this stage's parts' indices, step 2's replica holding them over a
    dp group of one, a Stage a chunk): what pp_worker trains, and tests/bench.py. routers: every
    block's (--experts), this stage's used."""
    p, v = num_stages, args.virtual_stages
    init = init_params(args)
    blocks = model_blocks(args, routers, device)
    chunks = [stage_parts(args.num_layers, p, stage, v, c, args.schedule) for c in range(v)]
    mine = [j for parts in chunks for j in parts]
    starts = [sum(map(len, chunks[:c])) for c in range(v)]   # where each chunk's parts begin
    replica = DataParallel([[w.to(device, copy=True) for w in init[j]] for j in mine],
                           dist.new_subgroups(1)[0], optimizer=args.optimizer, lr=args.lr,
                           bf16=args.bf16, chunk_starts=starts)
    virtual = [virtual_stage(args.schedule, p, stage, c) for c in range(v)]
    stages = [Stage(replica, range(start, start + len(parts)), blocks=[blocks[j] for j in parts],
                    first=virtual[c] == 0, last=virtual[c] == v * p - 1,
                    num_micro_batches=args.micro_batches,
                    mean_over=args.batch_size * args.context, recompute=args.recompute)
              for c, (start, parts) in enumerate(zip(starts, chunks))]
    return init, mine, replica, stages


def pp_worker(rank, world_size, args):
    device = setup(rank, world_size)
    dist.barrier()   # a collective on every rank before the first point-to-point (NCCL asks for it)
    p, stage, m, v = world_size, rank, args.micro_batches, args.virtual_stages
    routers = None
    if args.experts:                  # every block's: its stage's chooses, every stage's balances
        routers = [Router(args.experts, args.top_k, device) for _ in range(args.num_layers)]
    moe = MoE(args, routers)
    init, mine, replica, stages = hold_stages(args, stage, p, device, routers)   # a Stage a chunk
    held = [i for j in mine for i in spans_of(init)[j]]   # its parts' tensors, in the whole
    resumed = load_checkpoint(args, replica, held)   # --resume: its parts, any layout's pieces
    actions = build_schedule(args.schedule, p, stage, m, v)
    gather = partial(whole_on_rank0, replica, tensors_of(init), held)   # on rank 0, whole
    losses = []
    norms = []
    check = SerialCheck(args, resumed)
    for step in range(args.start_step, args.steps):
        inputs, targets = (t.to(device).chunk(m) for t in make_batch(args, step))
        replica.begin_step()
        for chunk in stages:
            chunk.begin_step(targets)         # the loss's, on the last stage
        recorder = Recorder(device) if step == args.steps - 1 else None   # its timeline, stash
        run_schedule(actions, stages, inputs, (stage - 1) % p, (stage + 1) % p,
                     (args.batch_size // m, args.context, args.dim), recorder=recorder,
                     v_shape=args.schedule == "dualpipev")
        moe.gather_routes()          # --save, --check: each block's, from its stage
        if args.check:   # this step's weights and gradients, whole on rank 0, against serial's
            check.step(gather(grads=False), gather(grads=True), moe.step())
        if args.clip_grad:      # the norm's squares summed over the stages
            norms.append(replica.clip(args.clip_grad, [dist.group.WORLD]).item())
        if routers:             # a block's loads on its stage, 0 on the rest: summed over all
            moe.loads += balance(routers, args.balance_rate).cpu()
        replica.update()
        losses.append(float(stages[-1].loss))                     # one host sync a step
        if any(chunk.last for chunk in stages):   # the loss's stage (DualPipeV's: stage 0)
            log_step(f"[stage {stage}]", step, losses, norms, args)
        save_checkpoint(args, step + 1, replica, held, routers=routers)   # its parts' pieces
    final = gather(grads=False)
    finish_stages(args, recorder, final, init, losses, check, norms, device, resumed=resumed,
                  moe=moe)
    cleanup()


def main(argv=None):
    args = parse_args(argv)
    spawn(pp_worker, args.world_size, args, backend=args.backend, timeout_s=args.timeout_s)


# Below the fold: the run's end, the schedule's print and its timeline with the bubble, the
# command line. --------------------------------------------------------------------------
import argparse, os, textwrap, time  # noqa: E401, E402

from collectives import positive_int  # noqa: E402
from data_parallel import (check_training_args, finish_run, gather_on_rank0,  # noqa: E402
                           training_parser)
from tensor_parallel import divides, kv_width  # noqa: E402


class Recorder:
    """A step of run_schedule(): each F, B and W's start and end, and the micro-batches held after
    it and their bytes. On a GPU, CUDA events recorded as actions are queued, read at the end."""

    def __init__(self, device):
        self.device, self.cuda = device, device.type == "cuda"
        self.spans, self.memory, self.peak = [], [], 0
        if self.cuda:   # a common zero: this host time is when the stream passes this event
            torch.cuda.synchronize(device)
            self.zero = (time.perf_counter(), self.now())

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self):
        self.begin = self.now()

    def stop(self, op, mb, chunk, chunks):
        self.spans.append((op, mb, chunk or 0, self.begin, self.now()))
        kept = sum(len(c.stash) for c in chunks)              # micro-batches between F and B
        waiting = sum(len(c.waiting_for_w) for c in chunks)   # between B and W
        self.peak = max(self.peak, kept + waiting)
        self.memory.append((kept, waiting, sum(map(stash_bytes, chunks))))

    def events(self):
        """(op, mb, chunk, start, end) of every F, B and W, in seconds."""
        if not self.cuda:
            return self.spans
        torch.cuda.synchronize(self.device)
        t0, zero = self.zero
        return [(op, mb, chunk, t0 + zero.elapsed_time(begin) / 1e3,
                 t0 + zero.elapsed_time(end) / 1e3) for op, mb, chunk, begin, end in self.spans]


def finish_stages(args, recorder, final, init, losses, check, norms, device, resumed=None,
                  moe=None):
    """The last step's pictures (timeline, stash table, schedules), then rank 0's end of the run
    with the losses, which the last stage alone knows."""
    p, rank = dist.get_world_size(), dist.get_rank()
    if args.timeline:
        show_timeline(recorder.events(), recorder.peak, args, p, rank, device)
    show_stash(recorder.memory, args, p, rank, device)
    losses = torch.tensor(losses, dtype=torch.float64, device=device)
    dist.broadcast(losses, src=0 if args.schedule == "dualpipev" else p - 1)   # the loss's
    if rank == 0:
        print_schedules(args.schedule, p, args.micro_batches, args.virtual_stages, args.num_layers)
        finish_run(args, tensors_of(init), final, losses.tolist(), check, norms, resumed, moe=moe)


def nbytes(tensors):   # each tensor once (a layer's output is the next one's input), by where
    return sum({(id(t.untyped_storage()), t.storage_offset()): t.numel() * t.element_size()
                for t in opened(tensors)}.values())   # it is: no address on meta


def opened(stash):   # a stash's tensors, the records in it opened (--experts': lists of them)
    for t in stash:
        if isinstance(t, torch.Tensor):
            yield t
        elif isinstance(t, (tuple, list)):
            yield from opened(t)


def stash_bytes(stage):
    """What a Stage's layers keep for B (stashes) and for W ((x, dz)), as the table's formula;
    the ends' (token ids, the head's input and dlogits) are not counted."""
    layers = stage.layers[int(stage.first):len(stage.layers) - int(stage.last)]
    offset = int(stage.first)
    kept = [t for stashes in stage.stash.values()
            for stash in stashes[offset:offset + len(layers)] for t in stash]
    kept += [t for waiting in stage.waiting_for_w.values() for i, terms in waiting.items()
             if i in layers for term in terms for t in term]
    return nbytes(kept)


def v_bubble(num_stages, num_micro_batches, t_f, t_b, t_w):
    """DualPipeV's idle share of a step, its lists run by simulate() with a chunk's F, B, W times:
    its idle time the same for every m, and p - 1 times p = 2's (tests/test_pipeline_parallel.py).
    DeepSeek's (p-1)(F&B + B - 3W) assumes each F&B overlapped, which the runner does not do."""
    idle = (num_stages - 1) * v_idle(t_f, t_b, t_w)
    return idle / (2 * num_micro_batches * (t_f + t_b + t_w) + idle)


@lru_cache(maxsize=None)
def v_idle(t_f, t_b, t_w):   # a stage's idle time a step on 2 stages (4 micro-batches)
    times = {"F": t_f, "B": t_b, "W": t_w}
    return max(events[-1][4] for events in simulate(v_schedules(2, 4), times)) - 8 * sum(
        times.values())


def simulate(stages, times=None):
    """Every stage's actions run with fixed times ({op: length}, 1 each) and free communication,
    waiting as run_schedule() does under NCCL: a batch's receives for their sends, the batch
    before's sends for their receives. Each stage's (op, mb, chunk, start, end), or None for a
    stage that never ends: a deadlock."""
    p, times = len(stages), times or {"F": 1, "B": 1, "W": 1}
    step = {SEND_ACT: (1, RECV_ACT), RECV_ACT: (-1, SEND_ACT), SEND_GRAD: (-1, RECV_GRAD),
            RECV_GRAD: (1, SEND_GRAD)}   # where the counterpart is, and its kind
    v_shape = any(action.op == "F&B" for action in stages[0])

    def counterpart(s, kind, mb, chunk):   # its virtual stage's neighbour along the pipe
        if v_shape:                        # the V: down through chunks a, back up through b
            virtual = virtual_stage("dualpipev", p, s, chunk) + step[kind][0]
            if virtual < p:
                return virtual, step[kind][1], mb, 0
            return 2 * p - 1 - virtual, step[kind][1], mb, 1
        virtual = (chunk or 0) * p + s + step[kind][0]
        return virtual % p, step[kind][1], mb, (virtual // p if chunk is not None else None)
    posted, pc, clock, sending = {}, [0] * p, [0.0] * p, [[] for _ in range(p)]
    events = [[] for _ in range(p)]
    progress = True
    while progress:
        progress = False
        for s in range(p):
            while pc[s] <= len(stages[s]):     # past the last action: its sends' wait
                action = stages[s][pc[s]] if pc[s] < len(stages[s]) else Action("comm")
                if action.op != "comm":
                    for op, mb, chunk in action.halves():   # an F&B: one, then the other
                        end = clock[s] + times[op]
                        events[s].append((op, mb, chunk or 0, clock[s], end))
                        clock[s] = end
                else:
                    for comm in action.comms:
                        posted.setdefault((s, *comm), clock[s])
                    peers = sending[s] + [counterpart(s, *comm) for comm in action.comms
                                          if comm[0] in (RECV_ACT, RECV_GRAD)]
                    if not all(peer in posted for peer in peers):
                        break                  # blocked: the next stage gets its turn
                    clock[s] = max([clock[s]] + [posted[peer] for peer in peers])
                    sending[s] = [counterpart(s, *comm) for comm in action.comms
                                  if comm[0] in (SEND_ACT, SEND_GRAD)]
                pc[s] += 1
                progress = True
    return [events[s] if pc[s] > len(stages[s]) else None for s in range(p)]


def block_stash(args, rows, tp=1, context=None, recompute=None):
    """Bytes a block keeps, a micro-batch of rows, on a tp rank: from F to B its stash (x, n1, q,
    k, v, o, x', n2, the MLP's a, up and u, F wide; r1, r2 and lse [b, h, T] in fp32, never A;
    --qk-norm: q, k before their norms and their r), or x alone with --recompute; from B to W its
    (x, dz)s and the gains' dg. A the [b, T, D]; a rank's query heads A/tp, its kv heads K; the
    MLP's M, [b, T, F/tp]. Some are whole on every tp rank, the rest split: o and u gathered in the
    all-gather style; sequence parallel splits x, x' and their r by T/tp. context, recompute: in
    place of args' (a cp rank's T/C positions; the stash --recompute rebuilds)."""
    T, D, h, F = context or args.context, args.dim, args.heads, args.ffn_dim
    if recompute is None:
        recompute = args.recompute
    size = 2 if args.bf16 else 4
    kv_heads = kv_width(D, h, args.kv_heads, tp) // (D // h)     # a rank's
    A = rows * T * D * size
    K = rows * T * kv_heads * (D // h) * size
    M = rows * T * F // tp * size
    gathers = tp > 1 and args.tp_style == "all-gather"
    o = A if gathers else A // tp
    u = M * tp if gathers else M
    x = A // tp if args.sequence_parallel else A
    r = rows * T * 4 // tp if args.sequence_parallel else rows * T * 4
    lse = rows * h // tp * T * 4
    kept = 2 * x + 2 * A + A // tp + 2 * K + o + 2 * M + u + 2 * r + lse   # x x' n1 n2 q k v o ..
    dy = A // tp if gathers else A                     # dy1, dy2: a column layer's, its columns
    waiting = 2 * A + A // tp + 2 * K + o + 2 * dy + 2 * M + u + 2 * D * 4
    if args.qk_norm:                                   # q, k before their norms, r_q, r_k
        kept += A // tp + K + lse + rows * T * kv_heads * 4
        waiting += 2 * (D // h) * 4
    if args.experts:   # estimated, balanced: a pair's rows and its a, up, u, y_e, its K choices,
        E = args.experts                               # the gates fp32, in place of a, up, u;
        pairs = args.top_k * (2 * A + 2 * M + u) + rows * T * (E * 4 + args.top_k * 16)
        kept += pairs - 2 * M - u                      # their dWs made in the backward, ready:
        waiting += -(A + 2 * M + u + dy) + 4 * D * E + 3 * 4 * E // args.ep * D * F // tp
    if recompute:
        kept = x
    return kept, waiting


def show_stash(memory, args, num_stages, rank, device):
    """Rank 0: each stage's largest stash in the last step, counted from the tensors, beside the
    formula (block_stash's, l blocks a stage) and pipeline_costs()'s, from the schedule alone."""
    peaks = gather_on_rank0(torch.tensor(max(memory, key=lambda entry: entry[2]), device=device))
    if rank != 0:
        return
    l = args.num_layers // (num_stages * args.virtual_stages)
    kept, waiting = block_stash(args, args.batch_size // args.micro_batches)
    say(f"stash at its largest, by stage: l = {l} blocks a stage"
        f"{' (a chunk)' * (args.virtual_stages > 1)}, a block's {kept} bytes from F to B"
        f"{' (--recompute: x alone)' * args.recompute}, {waiting} from B to W")
    print(f"  {'stage':<6}{'F to B':>8}{'B to W':>8}{'bytes held':>12}   formula", flush=True)
    for s, (n, w, counted) in enumerate(peaks.tolist()):
        predicted = pipeline_costs(args.schedule, num_stages, s, args.micro_batches,
                                   args.virtual_stages, kept_bytes=l * kept,
                                   waiting_bytes=l * waiting)[1]
        print(f"  {s:<6}{n:>8}{w:>8}{counted:>12}   ({n} x {kept} + {w} x {waiting}) x {l} = "
              f"{(n * kept + w * waiting) * l}  predicted {predicted}", flush=True)


def print_schedules(schedule, num_stages, num_micro_batches, num_chunks, num_layers):
    p, m, v = num_stages, num_micro_batches, num_chunks
    say(f"{schedule}, {p} stages, {m} micro-batches: every stage's actions in order. F3 forward "
        f"of micro-batch 3, B3 its backward{', W3 its dW' * (schedule in ('zb-h1', 'dualpipev'))}"
        f"; [ ] point-to-point posted together:")
    print("  a>3 send activation 3 on, >a3 receive it, <g3 send gradient 3 back, g<3 receive it")
    if schedule == "dualpipev":
        say(f"  DualPipeV's V: chunk a of stage s is virtual stage s, chunk b 2p-1-s, of "
            f"{num_layers // (p * v)} layers; F3a&B1b an F&B pair; at the turn (stage {p - 1}) "
            f"a=3 hands activation 3 from chunk a to b, =g3 gradient 3 back:")
    elif v > 1:
        say(f"  interleaved: chunk c (a, b, ...) of stage s is virtual stage c p + s, of "
            f"{num_layers // (p * v)} layers:")
    for s in range(p):
        if v > 1:
            owns = ", ".join(f"{'abcdefgh'[c]} "
                             f"{list(stage_layers(num_layers, p, s, v, c, schedule))}"
                             for c in range(v))
            log(f"[stage {s}]", f"layers {owns}")
        actions = " ".join(map(str, build_schedule(schedule, p, s, m, v)))
        print(textwrap.fill(actions, 100, initial_indent=f"[stage {s}] ",
                            subsequent_indent=" " * 10, break_on_hyphens=False), flush=True)


def draw(rows, begin, end, chunks, width=76):
    """Rows of (op, mb, chunk, start, end) in width columns from begin to end, each action as wide
    as its time (one column at least), labelled F3, else F3's chunk or last digit, else F."""
    lines, scale = [], width / (end - begin)
    for row in rows:
        line = ""
        for k, (op, mb, chunk, t0, t1) in enumerate(row):   # (a column left for each to come)
            a = max(len(line), min(round((t0 - begin) * scale), width - len(row) + k))
            b = max(a + 1, min(round((t1 - begin) * scale), width - len(row) + k + 1))
            letter = "abcdefgh"[chunk] if chunks > 1 else ""
            label = next(name for name in (f"{op}{mb}{letter}", f"{op}{letter or mb % 10}", op)
                         if len(name) <= b - a or name == op)
            line += "." * (a - len(line)) + label[:b - a].ljust(b - a, "-")
        lines.append(line.ljust(width, "."))
    return lines


def show_timeline(events, peak, args, num_stages, rank, device):
    """Rank 0 draws the last step as scheduled (equal times: the schedule's own bubble) and as
    measured, then the bubble by theory."""
    rows = torch.tensor([["FBW".index(op), mb, c, t0, t1] for op, mb, c, t0, t1 in events],
                        dtype=torch.float64)
    stages = gather_on_rank0(rows.to(device))                            # [p, actions, 5]
    peaks = gather_on_rank0(torch.tensor([peak], device=device))
    if rank != 0:
        return
    p, m, v, cores = num_stages, args.micro_batches, args.virtual_stages, os.cpu_count()
    measured = [[("FBW"[int(op)], int(mb), int(c), t0, t1) for op, mb, c, t0, t1 in row]
                for row in stages.tolist()]
    ideal = simulate([build_schedule(args.schedule, p, s, m, v) for s in range(p)])
    units = int(max(row[-1][4] for row in ideal))
    say(f"timeline of the last step: F3 = forward of micro-batch 3, B3 = its backward, W3 = its "
        f"dW{', F3a = in chunk a' if v > 1 else ''}; where a step is too short for its name, "
        f"{'Fa' if v > 1 else 'F3 for F13'}, or F alone; '-' the rest of a step longer than "
        f"its name; '.' idle.")
    across = (stages[..., 4].max() - stages[..., 3].min()).item() * 1e3
    for title, rows, width in (("as scheduled, every F, B and W one unit long", ideal,
                                units * max(1, 76 // units)),
                               (f"as measured, {across:.2f} ms across", measured, 76)):
        begin, end = min(r[0][3] for r in rows), max(r[-1][4] for r in rows)
        idle = [1 - sum(t1 - t0 for *_, t0, t1 in row) / (end - begin) for row in rows]
        say(f"{title}: the stages idle {sum(idle) / p:.1%} of the time")
        for s, line in enumerate(draw(rows, begin, end, v, width)):
            print(f"  stage {s} |{line}| idle {idle[s]:5.1%}", flush=True)
    theory = {"zb-h1": "(p-1)/(3m+p-1)", "interleaved": "(p-1)/(vm+p-1)",
              "dualpipev": "its lists, every F, B, W one unit"}.get(args.schedule, "(p-1)/(m+p-1)")
    say(f"bubble: theory {theory} = {pipeline_costs(args.schedule, p, 0, m, v)[0]:.1%}; the most "
        f"micro-batches a stage held at once: {', '.join(map(str, peaks.flatten().tolist()))}")
    if device.type == "cpu" and p > cores:
        say(f"note: {p} stages share {cores} CPU cores: the measured bubble mostly shows a stage "
            f"waiting for a core, and the schedule's own is the one above it.")


def say(text):   # prose, wrapped at 100 columns
    print(textwrap.fill(text, 100, break_on_hyphens=False), flush=True)


def add_schedule_args(parser):
    parser.add_argument("--schedule", choices=["gpipe", "1f1b", "zb-h1", "interleaved",
                                               "dualpipev"], default="1f1b")
    parser.add_argument("--virtual-stages", type=positive_int, default=argparse.SUPPRESS,
                        help="chunks v per stage, for --schedule interleaved (default: 2)")


def schedule_rules(args, num_stages, stages_flag):
    """Interleaved: whole rounds of micro-batches, v chunks of whole layers a stage; DualPipeV:
    2 chunks, 2p micro-batches at least; the others one chunk. Sets args.virtual_stages."""
    v = getattr(args, "virtual_stages", None)
    args.virtual_stages = {"interleaved": v or 2, "dualpipev": 2}.get(args.schedule, 1)
    virtual = num_stages * args.virtual_stages
    named = f"--virtual-stages {v}" if v else f"--schedule {args.schedule}"
    chunks = [(num_stages == 1, f"--schedule {args.schedule}: needs {stages_flag} of 2 or more "
                                f"(one stage's chunks would only pass activations to themselves)"),
              (virtual > args.num_layers, f"{named}: {virtual} chunks ({stages_flag} x "
                                          f"{args.virtual_stages}) for {args.num_layers} layers"),
              divides(args.num_layers, "--num-layers", virtual,
                      f"{stages_flag} x {args.virtual_stages} chunks")]
    if args.schedule == "dualpipev":
        return [(v is not None, f"--virtual-stages {v}: DualPipeV's V is 2 chunks a stage"),
                *chunks, (args.micro_batches < 2 * num_stages,
                          f"--schedule dualpipev: --micro-batches {args.micro_batches} is below "
                          f"2 x {stages_flag} ({2 * num_stages}), the V's steady state")]
    if args.schedule != "interleaved":
        return [(v not in (None, 1), f"--virtual-stages {v}: for --schedule interleaved only")]
    return [*chunks, divides(args.micro_batches, "--micro-batches", num_stages,
                             f"{stages_flag} (interleaved, as Megatron asks: whole rounds)")]


def parse_args(argv=None):
    parser = training_parser("Pipeline parallelism: GPipe, 1F1B, ZB-H1, interleaved, DualPipeV.")
    parser.add_argument("--world-size", type=positive_int, default=4, help="stages p, a rank each")
    add_schedule_args(parser)
    parser.add_argument("--timeline", action="store_true", help="draw the last step's F, B and W")
    args = parser.parse_args(argv)
    p = args.world_size
    parser.refuse([(p > args.num_layers, f"--world-size {p}: more stages than --num-layers "
                                         f"({args.num_layers})"),
                   *schedule_rules(args, p, "--world-size"),
                   divides(args.num_layers, "--num-layers", p, "--world-size")])
    parser.refuse([(args.ep > 1, f"--ep {args.ep}: step 4 has no replicas to hold the experts "
                                 f"(data_parallel.py, three_d.py)")])
    check_training_args(parser, args, p)
    return args


if __name__ == "__main__":
    run_main(main)
