"""Step 4: pipeline parallelism. Stages own consecutive layers; micro-batches flow through.

    python pipeline_parallel.py                                   # 4 stages, 1F1B
    python pipeline_parallel.py --world-size 4 --schedule gpipe --timeline
    python pipeline_parallel.py --world-size 2 --micro-batches 8 --check
    torchrun --nproc-per-node 4 pipeline_parallel.py

The lecture sends activations forward one micro-batch at a time and stops: "Backward
pass: homework exercise" and "Not handled: overlapping communication/computation to
eliminate pipeline bubbles". This step adds both:
- the backward across stages: the last stage turns the loss into dL/da, each stage
  runs the hand-derived layer backward of step 2 and sends dL/dx to the stage before;
- schedules that keep several stages busy at once. A schedule is data: per stage, an
  ordered list of actions (F, B, and batches of sends and receives) that one runner
  executes. Lists can be printed, tested without processes, and timed (--timeline).

GPipe runs all m forwards, then all m backwards: every stage stashes m micro-batches.
1F1B (PipeDream-flush) does min(p-s-1, m) forwards to fill the pipe, then alternates
one forward, one backward, then drains: stage s holds at most p-s micro-batches. Both
leave the same bubble, (p-1)/(m+p-1) of the time, when stages take equal time.
"""
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from collectives import check_launch_args, cleanup, log, positive_int, run_main, setup, spawn
from data_parallel import (check_divides, check_training_args, collect_on_rank0, finish_run, init_weights,
                           layer_backward, layer_forward, make_batch, make_optimizer, mse_loss, training_parser)


# ----------------------------------------------------------------------------------
# Schedules as data
# ----------------------------------------------------------------------------------

# Point-to-point kinds. An activation goes to the next stage after F; a gradient
# goes to the previous stage after B.
SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD = "send_act", "recv_act", "send_grad", "recv_grad"


class Action(NamedTuple):
    op: str              # "F", "B", or "comm"
    mb: int = -1         # the micro-batch of an F or B
    comms: tuple = ()    # for "comm": ((kind, mb), ...) posted together and waited together

    def __str__(self):
        if self.op != "comm":
            return f"{self.op}{self.mb}"
        arrows = {SEND_ACT: "a>", RECV_ACT: ">a", SEND_GRAD: "<g", RECV_GRAD: "g<"}
        return "[" + " ".join(f"{arrows[k]}{mb}" for k, mb in self.comms) + "]"


def compute_order(schedule, num_stages, stage, num_micro_batches):
    """The F and B actions of one stage, in order."""
    m = num_micro_batches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(num_stages - stage - 1, m)       # fill the pipe
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):                  # steady state: one forward, one backward
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(m - warmup, m)]   # drain
    return order


def build_schedule(schedule, num_stages, stage, num_micro_batches):
    """One stage's full action list: compute, with the point-to-point it needs.

    Before F(i) a stage receives micro-batch i's activation (unless it is first),
    after F(i) it sends its own output on (unless it is last); the backward mirrors
    that with gradients. The sends and receives that fall between the same two
    computations are fused into one batch, posted together and waited together.

    Why fuse: in 1F1B's steady state stage s sends activation i forward and then
    waits for gradient j, while stage s+1 sends gradient j back and then waits for
    activation i. Two blocking sends facing each other deadlock (NCCL's send waits
    for its receive, and gloo's does too once the message is past a tiny buffer).
    Posted as one batch on each side, each send finds its receive already waiting.
    """
    first, last = stage == 0, stage == num_stages - 1
    actions, pending = [], []

    def flush():
        if pending:
            actions.append(Action("comm", comms=tuple(pending)))
            pending.clear()

    for op, mb in compute_order(schedule, num_stages, stage, num_micro_batches):
        if op == "F" and not first:
            pending.append((RECV_ACT, mb))
        if op == "B" and not last:
            pending.append((RECV_GRAD, mb))
        flush()
        actions.append(Action(op, mb))
        if op == "F" and not last:
            pending.append((SEND_ACT, mb))
        if op == "B" and not first:
            pending.append((SEND_GRAD, mb))
    flush()
    return actions


# ----------------------------------------------------------------------------------
# One stage of the model, and the runner that executes any schedule on it
# ----------------------------------------------------------------------------------

def plain_backward(g, stash, w, need_dx):
    return layer_backward(g, stash, w)


class Stage:
    """The layers one stage owns, with per-micro-batch stashes and accumulated dW.

    forward_fn(x, w) -> (a, stash) and backward_fn(g, stash, w, need_dx) -> (dx, dW)
    are the layer's blocks: the plain layer here, the column-parallel one in 3D.
    """

    def __init__(self, weights, first, last, targets=None, n=1,
                 forward_fn=layer_forward, backward_fn=plain_backward):
        self.weights, self.first, self.last = weights, first, last
        self.targets, self.n = targets, n            # targets: micro-batches of Y, on the last stage
        self.forward_fn, self.backward_fn = forward_fn, backward_fn
        self.grads = [torch.zeros_like(w) for w in weights]
        self.stash = {}        # micro-batch -> its layers' (x, z), popped by its own backward
        self.loss_grad = {}    # micro-batch -> dL/da of the last layer (last stage only)
        self.loss = 0.0
        self.peak_stash = 0

    def forward(self, mb, x):
        stashes = []
        for w in self.weights:
            x, stash = self.forward_fn(x, w)
            stashes.append(stash)
        self.stash[mb] = stashes
        self.peak_stash = max(self.peak_stash, len(self.stash))
        if self.last:
            loss, self.loss_grad[mb] = mse_loss(x, self.targets[mb], self.n)
            self.loss += loss.item()
        return x

    def backward(self, mb, g):
        if self.last:
            g = self.loss_grad.pop(mb)
        stashes = self.stash.pop(mb)
        for i in reversed(range(len(self.weights))):
            need_dx = i > 0 or not self.first      # the model's input needs no gradient
            g, dw = self.backward_fn(g, stashes[i], self.weights[i], need_dx)
            self.grads[i] += dw                    # dW accumulates over micro-batches
        return g

    # What crosses a stage boundary. 3D's --p2p-shard overrides these two to send a
    # 1/tp slice and all-gather it on arrival.
    def outgoing(self, tensor):
        return tensor

    def incoming(self, buffer):
        return buffer


def run_schedule(actions, stage, inputs, prev_rank, next_rank, buffer_shape, group=None, events=None):
    """Execute one stage's action list. inputs: the micro-batches (first stage only).

    events, if a list, receives (op, mb, start, end) for every F and B: the timeline.
    """
    activations, grads = {}, {}     # received, waiting for their F / B
    outputs, input_grads = {}, {}   # computed, waiting to be sent
    device = stage.weights[0].device
    for action in actions:
        if action.op == "comm":
            ops = []
            for kind, mb in action.comms:
                if kind == RECV_ACT:
                    activations[mb] = torch.empty(buffer_shape, device=device)
                    ops.append(dist.P2POp(dist.irecv, activations[mb], prev_rank, group))
                elif kind == RECV_GRAD:
                    grads[mb] = torch.empty(buffer_shape, device=device)
                    ops.append(dist.P2POp(dist.irecv, grads[mb], next_rank, group))
                elif kind == SEND_ACT:
                    ops.append(dist.P2POp(dist.isend, stage.outgoing(outputs.pop(mb)), next_rank, group))
                else:
                    ops.append(dist.P2POp(dist.isend, stage.outgoing(input_grads.pop(mb)), prev_rank, group))
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            continue
        start = time.perf_counter()
        if action.op == "F":
            x = inputs[action.mb] if stage.first else stage.incoming(activations.pop(action.mb))
            out = stage.forward(action.mb, x)
            if not stage.last:
                outputs[action.mb] = out.contiguous()
        else:
            g = None if stage.last else stage.incoming(grads.pop(action.mb))
            dx = stage.backward(action.mb, g)
            if not stage.first:
                input_grads[action.mb] = dx.contiguous()
        if events is not None:
            events.append((action.op, action.mb, start, time.perf_counter()))


# ----------------------------------------------------------------------------------
# Training with it
# ----------------------------------------------------------------------------------

def stage_layers(num_layers, num_stages, stage):
    """Stage s owns layers [s L/p, (s+1) L/p)."""
    per_stage = num_layers // num_stages
    return range(stage * per_stage, (stage + 1) * per_stage)


def pp_worker(rank, world_size, args):
    device = setup(rank, world_size)
    dist.barrier()   # a collective on every rank before the first point-to-point (NCCL asks for it)
    tag = f"[stage {rank}]"
    first, last = rank == 0, rank == world_size - 1
    full = init_weights(args.num_layers, args.dim, args.seed)
    layers = stage_layers(args.num_layers, world_size, rank)
    # A copy: on the CPU .to(device) returns the same tensor, and the optimizer would
    # then update `full` in place, which --save writes as the initial weights.
    weights = [full[i].to(device, copy=True) for i in layers]
    inputs, targets = make_batch(args)
    m = args.micro_batches
    stage = Stage(weights, first, last, targets.to(device).chunk(m), n=args.batch_size * args.dim)
    optimizer = make_optimizer(weights, args)
    actions = build_schedule(args.schedule, world_size, rank, m)
    micro_batches = inputs.to(device).chunk(m)                # [B/m, D] each
    buffer_shape = (args.batch_size // m, args.dim)
    losses = []
    for step in range(args.steps):
        stage.grads = [torch.zeros_like(w) for w in weights]
        stage.loss = 0.0
        events = [] if args.timeline and step == args.steps - 1 else None
        run_schedule(actions, stage, micro_batches, rank - 1, rank + 1, buffer_shape, events=events)
        for w, grad in zip(weights, stage.grads):
            w.grad = grad
        optimizer.step()
        losses.append(stage.loss)
        if last:
            log(tag, f"step {step:3d}  loss {stage.loss:.6f}")
        if events is not None:
            show_timeline(events, stage.peak_stash, world_size, m, rank)
    if rank == 0:
        log(tag, "schedule of every stage:")
        for s in range(world_size):
            log(f"[stage {s}]", " ".join(map(str, build_schedule(args.schedule, world_size, s, m))))
    pieces = collect_on_rank0({i: w.cpu() for i, w in zip(layers, weights)})
    all_losses = collect_on_rank0(losses)
    if rank == 0:
        final = [merged for piece in pieces for merged in piece.values()]
        finish_run(args, full, final, all_losses[-1], inputs, targets)
    cleanup()


def show_timeline(events, peak_stash, num_stages, num_micro_batches, rank):
    """Rank 0 draws every stage's F and B slots on one time axis (one step)."""
    everything = collect_on_rank0((events, peak_stash))
    if rank != 0:
        return
    begin = min(e[2] for evs, _ in everything for e in evs)
    end = max(e[3] for evs, _ in everything for e in evs)
    width = 96
    scale = width / (end - begin)
    print(f"timeline of the last step: {(end - begin) * 1e3:.1f} ms across, F = forward, "
          f"b = backward, the digit is the micro-batch, '.' is idle", flush=True)
    idle = []
    for s, (evs, peak) in enumerate(everything):
        row = ["."] * width
        for op, mb, t0, t1 in evs:
            a, b = int((t0 - begin) * scale), max(int((t0 - begin) * scale) + 1, int((t1 - begin) * scale))
            for c in range(a, min(b, width)):
                row[c] = (str(mb % 10) if c > a else ("F" if op == "F" else "b"))
        busy = sum(t1 - t0 for _, _, t0, t1 in evs)
        idle.append(1 - busy / (end - begin))
        print(f"  stage {s} |{''.join(row)}| idle {idle[-1]:5.1%}, peak stash {peak}", flush=True)
    p, m = num_stages, num_micro_batches
    print(f"bubble: measured {sum(idle) / p:.1%} (mean idle share of the stages), "
          f"theory (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.1%}", flush=True)


# ----------------------------------------------------------------------------------

def main(argv=None):
    parser = training_parser("Pipeline parallelism: GPipe and 1F1B over send/recv, backward by hand.")
    parser.add_argument("--world-size", type=positive_int, default=4, help="pipeline stages, one rank each")
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b", help="micro-batch schedule")
    parser.add_argument("--timeline", action="store_true", help="draw the last step's F/B slots per stage")
    args = parser.parse_args(argv)
    if args.world_size > args.num_layers:
        parser.error(f"--world-size {args.world_size}: more stages than --num-layers ({args.num_layers})")
    check_divides(parser, args.num_layers, "--num-layers", args.world_size, "--world-size")
    check_divides(parser, args.batch_size, "--batch-size", args.micro_batches, "--micro-batches")
    check_training_args(parser, args)
    check_launch_args(parser, args, args.world_size)
    spawn(pp_worker, args.world_size, args, backend=args.backend, timeout_s=args.timeout_s)


if __name__ == "__main__":
    run_main(main)
