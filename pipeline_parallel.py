"""Step 4: pipeline parallelism. Stages own consecutive layers; micro-batches flow through.

    python pipeline_parallel.py                                   # 4 stages, 1F1B
    python pipeline_parallel.py --world-size 4 --schedule gpipe --timeline
    python pipeline_parallel.py --world-size 2 --micro-batches 8 --check
    python pipeline_parallel.py --schedule zb-h1 --timeline       # zero bubble: W fills it
    python pipeline_parallel.py --schedule interleaved --virtual-stages 2 --micro-batches 4
    torchrun --nproc-per-node 4 pipeline_parallel.py

The lecture sends activations forward one micro-batch at a time and stops: "Backward
pass: homework exercise", and "Not handled: overlapping communication/computation to
eliminate pipeline bubbles". This step adds both:
- the backward across stages: the last stage turns the loss into dL/da, each stage runs
  step 2's hand-derived layer backward and sends dL/dx to the stage before;
- schedules that keep several stages busy at once. A schedule is data: per stage, an
  ordered list of actions (F, B, W, and batches of sends and receives) that one runner
  executes. The lists can be printed, tested without processes, and timed (--timeline).

    stage s of p owns layers [s L/p, (s+1) L/p); micro-batch i: x_i [B/m, D]
    F(i) on stage s:  receive x_i from s-1, run its layers, send a_i to s+1
    B(i) on stage s:  receive g_i from s+1, run its layers' backward (dW summed over
                      micro-batches), send dL/dx_i to s-1
    bytes per micro-batch and stage boundary: one [B/m, D] each way

GPipe runs all m forwards, then all m backwards: every stage stashes m micro-batches.
1F1B (PipeDream-flush) runs min(p-s-1, m) forwards to fill the pipe, then one forward,
one backward, then drains: stage s holds at most p-s micro-batches. Both leave a bubble
of (p-1)/(m+p-1) of the time, when the stages take equal time. Two schedules shrink it:
- ZB-H1 (zero bubble, Qi et al. 2023) splits B into B, dx = dz W^T, which the stage
  before waits for, and W, dW = x^T dz, which nobody waits for: stage s holds back s of
  its W passes to fill the bubble at its end. With F, B and W equally long the bubble is
  (p-1)/(3m+p-1), a third of 1F1B's.
- Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): each stage holds v chunks of
  L/(v p) layers, chunk c of stage s being virtual stage c p + s, and the micro-batches
  go round the stages v times: a bubble of (p-1)/(v m + p-1), for v times the messages.

What PyTorch gives you: torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble (tests/bench.py races them).
"""
import os
import time
import warnings
from typing import NamedTuple

warnings.filterwarnings("ignore", "Failed to initialize NumPy")   # torch warns without numpy
import torch
import torch.distributed as dist

from collectives import check_launch_args, cleanup, log, positive_int, run_main, setup, spawn
from data_parallel import (check_divides, check_training_args, finish_run, gather_on_rank0,
                           init_weights, input_backward, layer_forward, make_batch, make_optimizer,
                           mse_loss, training_parser)

# Point-to-point kinds: an activation goes to the next stage after F, a gradient to the
# previous stage after B. Printed as a>3 (send activation 3), >a3 (receive it), <g3, g<3.
SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD = "a>", ">a", "<g", "g<"


class Action(NamedTuple):
    op: str              # "F", "B", "W" or "comm"
    mb: int = -1         # the micro-batch of an F, B or W
    chunk: int = None    # interleaved: which of the stage's chunks (printed a, b, ...)
    comms: tuple = ()    # for "comm": ((kind, mb, chunk), ...), posted and waited for together

    def __str__(self):
        def name(op, mb, chunk):
            return f"{op}{mb}{'' if chunk is None else 'abcdefgh'[chunk]}"
        if self.op != "comm":
            return name(self.op, self.mb, self.chunk)
        return "[" + " ".join(name(*comm) for comm in self.comms) + "]"


def warmup_forwards(schedule, num_stages, stage, num_micro_batches, num_chunks=1):
    """How many forwards a stage runs before its first backward: enough to fill the pipe.
    Interleaved (Megatron's rule): 2 (p-s-1) + (v-1) p, or all of them when m = p."""
    p, s, m, v = num_stages, stage, num_micro_batches, num_chunks
    if schedule == "gpipe" or (schedule == "interleaved" and m == p):
        return m * v
    return min((v - 1) * p + 2 * (p - s - 1) if schedule == "interleaved" else p - s - 1, m * v)


def compute_order(schedule, num_stages, stage, num_micro_batches, num_chunks=1):
    """The compute actions of one stage, in order: (op, micro-batch, chunk or None).

    1F1B's shape: forwards to fill the pipe, then one forward and one backward, then the
    backwards that are left (GPipe: all forwards first). Interleaved, forward k runs chunk
    (k // p) mod v of micro-batch (k // (v p)) p + k mod p: p micro-batches through one
    chunk, then the same p through the next; the backwards run the chunks in reverse."""
    p, s, m, v = num_stages, stage, num_micro_batches, num_chunks
    warmup = warmup_forwards(schedule, p, s, m, v)
    chunk = (lambda c: c) if schedule == "interleaved" else (lambda c: None)
    fwd = [("F", k // (p * v) * p + k % p, chunk(k // p % v)) for k in range(m * v)]
    bwd = [("B", k // (p * v) * p + k % p, chunk(v - 1 - k // p % v)) for k in range(m * v)]
    order, held_back = fwd[:warmup], []
    for j, backward in enumerate(bwd):
        order += fwd[warmup + j:warmup + j + 1] + [backward]
        if schedule == "zb-h1":               # ZB-H1: stage s runs the W of B j - s after B j
            held_back.append(("W", *backward[1:]))
            order += [held_back.pop(0)] if j >= s else []
    return order + held_back                  # ZB-H1: the held-back W fill the end


def build_schedule(schedule, num_stages, stage, num_micro_batches, num_chunks=1):
    """One stage's whole action list: the compute, and the point-to-point it needs.

    Before F(i) a stage receives micro-batch i's activation (unless it is the first stage,
    virtual stage 0 when interleaved), after F(i) it sends its own output on (unless it
    is the last); the backward mirrors that with gradients, and W needs neither. The sends
    and receives that fall between the same two computations are fused into one batch,
    posted together and waited for together.

    Why fuse: in 1F1B's steady state stage s sends activation i forward and then waits
    for gradient j, while stage s+1 sends gradient j back and then waits for activation
    i. Two blocking sends facing each other deadlock (NCCL's send waits for its receive,
    and gloo's does too past a tiny buffer). Posted as one batch on each side, each send
    finds its receive already waiting.

    Interleaved, the chunks' dependencies cross the stages twice, and a batch between F and
    B closes a cycle of waits. Megatron runs each steady-state forward and the backward
    after it back to back, with one batch for their four transfers: so do we.
    """
    def virtual(chunk):   # chunk c of stage s is virtual stage c p + s
        return (chunk or 0) * num_stages + stage
    last = num_stages * num_chunks - 1
    order = compute_order(schedule, num_stages, stage, num_micro_batches, num_chunks)
    warmup, units = warmup_forwards(schedule, num_stages, stage, num_micro_batches, num_chunks), []
    for k, (op, mb, chunk) in enumerate(order):   # units: steady (F, B) pairs interleaved, else ops
        steady = k > warmup and op == "B" and order[k - 1][0] == "F" and schedule == "interleaved"
        units[-1:] = [units[-1] + [(op, mb, chunk)]] if steady else units[-1:] + [[(op, mb, chunk)]]
    actions, pending = [], []
    for unit in units:
        for op, mb, chunk in unit:
            if op == "F" and virtual(chunk) > 0:
                pending.append((RECV_ACT, mb, chunk))
            if op == "B" and virtual(chunk) < last:
                pending.append((RECV_GRAD, mb, chunk))
        if pending:                           # (a send due after B goes before a W, too)
            actions.append(Action("comm", comms=tuple(pending)))
            pending = []
        for op, mb, chunk in unit:
            actions.append(Action(op, mb, chunk))
            if op == "F" and virtual(chunk) < last:
                pending.append((SEND_ACT, mb, chunk))
            if op == "B" and virtual(chunk) > 0:
                pending.append((SEND_GRAD, mb, chunk))
    return actions + ([Action("comm", comms=tuple(pending))] if pending else [])


# ----------------------------------------------------------------------------------
# One stage's layers, and the runner that executes any schedule on them
# ----------------------------------------------------------------------------------

class StageLayers:
    """The layers of one stage (or one chunk of it), with the stash of each micro-batch in
    flight and dW summed over micro-batches. 3D's subclass makes each layer tensor-parallel
    (step 3), its weights and gradients the replica's (step 2)."""

    def __init__(self, weights, first, last, targets=None, n=1):
        self.weights, self.num_layers, self.first, self.last = weights, len(weights), first, last
        self.targets, self.n = targets, n            # targets: micro-batches of Y (last stage)
        self.grads = [torch.zeros_like(w) for w in weights]
        self.stash = {}        # micro-batch -> its layers' (x, z), popped by its own backward
        self.for_w = {}        # ZB-H1: micro-batch -> its layers' (x, dz), popped by its W
        self.loss_grad = {}    # micro-batch -> dL/da of the last layer (last stage only)
        self.loss = 0.0

    def layer_forward(self, i, x):
        return layer_forward(x, self.weights[i])

    def input_backward(self, i, g, stash, need_dx):
        return input_backward(g, stash, self.weights[i], need_dx)

    def add_grad(self, i, dw):
        self.grads[i] += dw                     # summed over micro-batches

    def forward(self, mb, x):
        stashes = []
        for i in range(self.num_layers):
            x, stash = self.layer_forward(i, x)
            stashes.append(stash)
        self.stash[mb] = stashes
        if self.last:
            loss, self.loss_grad[mb] = mse_loss(x, self.targets[mb], self.n)
            self.loss += loss.item()
        return x

    def backward(self, mb, g, defer_w=False):
        """B: dL/dx of this stage's input. dW too, unless defer_w: then W(mb) computes it."""
        g = self.loss_grad.pop(mb) if self.last else g
        stashes, x_dz = self.stash.pop(mb), {}
        for i in reversed(range(self.num_layers)):
            need_dx = i > 0 or not self.first       # the model's input needs no gradient
            g, x_dz[i] = self.input_backward(i, g, stashes[i], need_dx)
        self.for_w[mb] = x_dz
        if not defer_w:
            self.weight_grads(mb)
        return g

    def weight_grads(self, mb):
        """W: dW = x^T dz of every layer, from what B left: nobody waits for it."""
        for i, (x, dz) in self.for_w.pop(mb).items():
            self.add_grad(i, x.T @ dz)

    def held(self):
        return len(self.stash) + len(self.for_w)   # micro-batches whose activations it keeps

    def outgoing(self, tensor):   # what crosses to a neighbouring stage, and what arrives:
        return tensor             # 3D's --p2p-shard sends a 1/tp slice and all-gathers it

    def incoming(self, buffer):
        return buffer


def run_schedule(actions, chunks, inputs, prev_rank, next_rank, buffer_shape, group=None,
                 events=None):
    """Execute one stage's action list on its StageLayers, one per chunk. inputs: the
    micro-batches (first stage only). events, if a list, receives (op, mb, chunk, start,
    end) of every F, B and W. Returns the most micro-batches held at once."""
    received, to_send = {}, {}      # (kind, mb, chunk) -> a tensor on its way
    device, peak = inputs[0].device, 0
    defer_w = any(action.op == "W" for action in actions)
    for action in actions:
        if action.op == "comm":
            ops = []
            for key in action.comms:
                kind, peer = key[0], next_rank if key[0] in (SEND_ACT, RECV_GRAD) else prev_rank
                if kind in (RECV_ACT, RECV_GRAD):
                    received[key] = torch.empty(buffer_shape, device=device)
                    ops.append(dist.P2POp(dist.irecv, received[key], peer, group))
                else:
                    ops.append(dist.P2POp(dist.isend, to_send.pop(key), peer, group))
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            continue
        mb, chunk, layers = action.mb, action.chunk, chunks[action.chunk or 0]
        start = time.perf_counter()
        if action.op == "F":
            x = inputs[mb] if layers.first else layers.incoming(received.pop((RECV_ACT, mb, chunk)))
            out = layers.forward(mb, x)
            if not layers.last:
                to_send[SEND_ACT, mb, chunk] = layers.outgoing(out.contiguous())
        elif action.op == "B":
            g = None if layers.last else layers.incoming(received.pop((RECV_GRAD, mb, chunk)))
            dx = layers.backward(mb, g, defer_w)
            if not layers.first:
                to_send[SEND_GRAD, mb, chunk] = layers.outgoing(dx.contiguous())
        else:
            layers.weight_grads(mb)
        peak = max(peak, sum(c.held() for c in chunks))
        if events is not None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)   # the kernels run after the call returns
            events.append((action.op, mb, chunk or 0, start, time.perf_counter()))
    return peak


def stage_layers(num_layers, num_stages, stage, num_chunks=1, chunk=0):
    """Stage s owns layers [s L/p, (s+1) L/p); interleaved, chunk c of stage s is virtual
    stage c p + s, which owns layers [(c p + s) L/(v p), (c p + s + 1) L/(v p))."""
    per_stage = num_layers // (num_stages * num_chunks)
    virtual = chunk * num_stages + stage
    return range(virtual * per_stage, (virtual + 1) * per_stage)


# ----------------------------------------------------------------------------------
# Training with it
# ----------------------------------------------------------------------------------

def pp_worker(rank, world_size, args):
    device = setup(rank, world_size)
    dist.barrier()   # a collective on every rank before the first point-to-point (NCCL asks for it)
    p, stage, m, v = world_size, rank, args.micro_batches, args.virtual_stages
    full = init_weights(args.num_layers, args.dim, args.seed)
    inputs, targets = make_batch(args)
    chunks = []      # this stage's layers: one chunk, or v when interleaved
    for c in range(v):
        layers, virtual = stage_layers(args.num_layers, p, stage, v, c), c * p + stage
        chunks.append(StageLayers([full[i].to(device, copy=True) for i in layers], virtual == 0,
                                  virtual == v * p - 1, targets.to(device).chunk(m),
                                  n=args.batch_size * args.dim))
    optimizer = make_optimizer([w for chunk in chunks for w in chunk.weights], args)
    actions = build_schedule(args.schedule, p, stage, m, v)
    micro_batches = inputs.to(device).chunk(m)                    # [B/m, D] each
    losses = []
    for step in range(args.steps):
        for chunk in chunks:
            chunk.grads, chunk.loss = [torch.zeros_like(w) for w in chunk.weights], 0.0
        events = [] if args.timeline and step == args.steps - 1 else None
        peak = run_schedule(actions, chunks, micro_batches, (stage - 1) % p, (stage + 1) % p,
                            (args.batch_size // m, args.dim), events=events)
        if step == 0:
            first_grads = in_layer_order([g for chunk in chunks for g in chunk.grads], args, p)
        for chunk in chunks:
            for w, grad in zip(chunk.weights, chunk.grads):
                w.grad = grad
        optimizer.step()
        losses.append(chunks[-1].loss)
        if stage == p - 1:
            log(f"[stage {stage}]", f"step {step:3d}  loss {losses[-1]:.6f}")
        if events is not None:
            show_timeline(events, peak, args, p, rank, device)
    if rank == 0:
        print_schedules(args.schedule, p, m, v, args.num_layers)
    final = in_layer_order([w for chunk in chunks for w in chunk.weights], args, p)
    losses = torch.tensor(losses, dtype=torch.float64, device=device)
    dist.broadcast(losses, src=p - 1)    # the last stage alone knows them
    if rank == 0:
        finish_run(args, full, final, losses.tolist(), inputs, targets, first_grads)
    cleanup()


def in_layer_order(tensors, args, num_stages):
    """On rank 0, every stage's layers (each stage's chunks in turn), put in the model's
    layer order: [p, v L/(v p), D, D] gathered, then layer by virtual stage. None elsewhere."""
    everyone = gather_on_rank0(torch.stack(tensors))
    if everyone is None:
        return None
    v, per_chunk = args.virtual_stages, args.num_layers // (num_stages * args.virtual_stages)
    return [everyone[s, c * per_chunk + i]
            for c in range(v) for s in range(num_stages) for i in range(per_chunk)]


def bubble_theory(schedule, num_stages, num_micro_batches, num_chunks=1, times=(1, 1, 1)):
    """The idle share of a step, for stages of equal speed and free communication. times:
    (T_F, T_B, T_W) of one micro-batch; B is the whole backward except in ZB-H1."""
    p, m, v = num_stages, num_micro_batches, num_chunks
    if schedule == "zb-h1":   # the bubble: (p-1)(T_F + T_B + T_W) shrinks to (p-1)(T_F + T_B - T_W)
        t_f, t_b, t_w = times
        return (p - 1) * (t_f + t_b - t_w) / (m * (t_f + t_b + t_w) + (p - 1) * (t_f + t_b - t_w))
    return (p - 1) / (v * m + p - 1)


def print_schedules(schedule, num_stages, num_micro_batches, num_chunks, num_layers):
    p, m, v = num_stages, num_micro_batches, num_chunks
    print(f"{schedule}, {p} stages, {m} micro-batches: every stage's actions in order. F3 forward "
          f"of micro-batch 3, B3 its backward{', W3 its dW' if schedule == 'zb-h1' else ''}; [ ] "
          f"point-to-point posted together:\n  a>3 send activation 3 on, >a3 receive it, <g3 send "
          f"gradient 3 back, g<3 receive it", flush=True)
    if v > 1:
        print(f"  interleaved: chunk c (a, b, ...) of stage s is virtual stage c p + s, of "
              f"{num_layers // (p * v)} layers:", flush=True)
    for s in range(p):
        if v > 1:
            owns = ", ".join(f"{'abcdefgh'[c]} {list(stage_layers(num_layers, p, s, v, c))}"
                             for c in range(v))
            log(f"[stage {s}]", f"layers {owns}")
        log(f"[stage {s}]", " ".join(map(str, build_schedule(schedule, p, s, m, v))))


def show_timeline(events, peak, args, num_stages, rank, device, width=96):
    """Rank 0 draws the last step: every stage's F, B and W on one time axis, and the bubble."""
    rows = torch.tensor([["FBW".index(op), mb, c, t0, t1] for op, mb, c, t0, t1 in events],
                        dtype=torch.float64)
    stages = gather_on_rank0(rows.to(device))                            # [p, actions, 5]
    peaks = gather_on_rank0(torch.tensor([peak], device=device))
    if rank != 0:
        return
    begin, end = stages[..., 3].min().item(), stages[..., 4].max().item()
    scale, v = width / (end - begin), args.virtual_stages
    chunk_names = ", a/b: the chunk" if v > 1 else ""
    print(f"timeline of the last step, {(end - begin) * 1e3:.2f} ms across: F3 = forward of micro-"
          f"batch 3, B3 = its backward, W3 = its dW{chunk_names} (as wide as its time, at least "
          f"its name), '.' idle", flush=True)
    idle = []
    for s, (evs, held) in enumerate(zip(stages.tolist(), peaks.flatten().tolist())):
        line = ""
        for op, mb, c, t0, t1 in evs:
            label = f"{'FBW'[int(op)]}{int(mb)}{'abcdefgh'[int(c)] if v > 1 else ''}"
            a = max(len(line), round((t0 - begin) * scale))
            b = max(a + len(label), round((t1 - begin) * scale))
            line += "." * (a - len(line)) + label.ljust(b - a, "-")
        idle.append(1 - sum(t1 - t0 for _, _, _, t0, t1 in evs) / (end - begin))
        print(f"  stage {s} |{line.ljust(width, '.')}| idle {idle[-1]:5.1%}, peak stash {held}",
              flush=True)
    p, m, cores = num_stages, args.micro_batches, os.cpu_count()
    theory = {"zb-h1": "(p-1)/(3m+p-1)", "interleaved": "(p-1)/(vm+p-1)"}.get(args.schedule,
                                                                             "(p-1)/(m+p-1)")
    print(f"bubble: measured {sum(idle) / p:.1%} (the stages' mean idle share), theory {theory} = "
          f"{bubble_theory(args.schedule, p, m, v):.1%}", flush=True)
    if device.type == "cpu" and p > cores:
        print(f"note: {p} stages share {cores} CPU cores, so a stage often waits for a core, not "
              f"for its neighbour: the measured bubble mostly shows that load", flush=True)


def main(argv=None):
    args = parse_args(argv)
    spawn(pp_worker, args.world_size, args, backend=args.backend, timeout_s=args.timeout_s)


# ----------------------------------------------------------------------------------
# Below: the command line.
# ----------------------------------------------------------------------------------

def add_schedule_args(parser):
    parser.add_argument("--schedule", choices=["gpipe", "1f1b", "zb-h1", "interleaved"],
                        default="1f1b")
    parser.add_argument("--virtual-stages", type=positive_int, default=None,
                        help="chunks v per stage, for --schedule interleaved (default 2)")


def check_schedule_args(parser, args, num_stages, stages_flag):
    """Interleaved needs whole rounds of micro-batches and v chunks of whole layers per stage;
    the other schedules take one chunk."""
    if args.schedule != "interleaved":
        if args.virtual_stages not in (None, 1):
            parser.error(f"--virtual-stages {args.virtual_stages}: only --schedule interleaved "
                         f"has chunks")
        args.virtual_stages = 1
        return
    args.virtual_stages = args.virtual_stages or 2
    if num_stages == 1:
        parser.error(f"--schedule interleaved: needs {stages_flag} of 2 or more (one stage's "
                     f"chunks would only pass activations to themselves)")
    virtual = num_stages * args.virtual_stages
    if virtual > args.num_layers:
        parser.error(f"--virtual-stages {args.virtual_stages}: {stages_flag} x --virtual-stages = "
                     f"{virtual} chunks for {args.num_layers} layers")
    check_divides(parser, args.num_layers, "--num-layers", virtual,
                  f"{stages_flag} x --virtual-stages")
    check_divides(parser, args.micro_batches, "--micro-batches", num_stages,
                  f"{stages_flag} (interleaved, as Megatron asks: whole rounds)")


def parse_args(argv=None):
    parser = training_parser("Pipeline parallelism: GPipe, 1F1B, ZB-H1 and interleaved 1F1B.")
    parser.add_argument("--world-size", type=positive_int, default=4, help="stages p, a rank each")
    add_schedule_args(parser)
    parser.add_argument("--timeline", action="store_true", help="draw the last step's F, B and W")
    args = parser.parse_args(argv)
    if args.world_size > args.num_layers:
        parser.error(f"--world-size {args.world_size}: more stages than --num-layers "
                     f"({args.num_layers})")
    check_schedule_args(parser, args, args.world_size, "--world-size")
    check_divides(parser, args.num_layers, "--num-layers", args.world_size, "--world-size")
    check_training_args(parser, args, args.world_size)
    check_launch_args(parser, args, args.world_size)
    return args


if __name__ == "__main__":
    run_main(main)
