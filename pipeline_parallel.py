"""Step 4: pipeline parallelism. Stages own consecutive layers; micro-batches flow through.

    python pipeline_parallel.py                                   # 4 stages, 1F1B
    python pipeline_parallel.py --world-size 4 --schedule gpipe --timeline
    python pipeline_parallel.py --world-size 2 --micro-batches 8 --check
    torchrun --nproc-per-node 4 pipeline_parallel.py

The lecture sends activations forward one micro-batch at a time and stops: "Backward
pass: homework exercise", and "Not handled: overlapping communication/computation to
eliminate pipeline bubbles". This step adds both:
- the backward across stages: the last stage turns the loss into dL/da, each stage runs
  step 2's hand-derived layer backward and sends dL/dx to the stage before;
- schedules that keep several stages busy at once. A schedule is data: per stage, an
  ordered list of actions (F, B, and batches of sends and receives) that one runner
  executes. The lists can be printed, tested without processes, and timed (--timeline).

    stage s of p owns layers [s L/p, (s+1) L/p); micro-batch i: x_i [B/m, D]
    F(i) on stage s:  receive x_i from s-1, run its layers, send a_i to s+1
    B(i) on stage s:  receive g_i from s+1, run its layers' backward (dW summed over
                      micro-batches), send dL/dx_i to s-1
    bytes per micro-batch and stage boundary: one [B/m, D] each way

GPipe runs all m forwards, then all m backwards: every stage stashes m micro-batches.
1F1B (PipeDream-flush) runs min(p-s-1, m) forwards to fill the pipe, then one forward,
one backward, then drains: stage s holds at most p-s micro-batches. Both leave a bubble
of (p-1)/(m+p-1) of the time, when the stages take equal time.

What PyTorch gives you: torch.distributed.pipelining's ScheduleGPipe and Schedule1F1B
(tests/bench.py races them against this).
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
                           init_weights, layer_backward, layer_forward, make_batch, make_optimizer,
                           mse_loss, training_parser)

# Point-to-point kinds: an activation goes to the next stage after F, a gradient to the
# previous stage after B. Printed as a>3 (send activation 3), >a3 (receive it), <g3, g<3.
SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD = "a>", ">a", "<g", "g<"


class Action(NamedTuple):
    op: str              # "F", "B", or "comm"
    mb: int = -1         # the micro-batch of an F or B
    comms: tuple = ()    # for "comm": ((kind, mb), ...), posted together and waited for together

    def __str__(self):
        if self.op != "comm":
            return f"{self.op}{self.mb}"
        return "[" + " ".join(f"{kind}{mb}" for kind, mb in self.comms) + "]"


def compute_order(schedule, num_stages, stage, num_micro_batches):
    """The F and B actions of one stage, in order."""
    m = num_micro_batches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(num_stages - stage - 1, m)       # fill the pipe
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):                  # steady state: one forward, one backward
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]   # drain


def build_schedule(schedule, num_stages, stage, num_micro_batches):
    """One stage's whole action list: the compute, and the point-to-point it needs.

    Before F(i) a stage receives micro-batch i's activation (unless it is first), after
    F(i) it sends its own output on (unless it is last); the backward mirrors that with
    gradients. The sends and receives that fall between the same two computations are
    fused into one batch, posted together and waited for together.

    Why fuse: in 1F1B's steady state stage s sends activation i forward and then waits
    for gradient j, while stage s+1 sends gradient j back and then waits for activation
    i. Two blocking sends facing each other deadlock (NCCL's send waits for its receive,
    and gloo's does too past a tiny buffer). Posted as one batch on each side, each send
    finds its receive already waiting.
    """
    first, last = stage == 0, stage == num_stages - 1
    actions, pending = [], []
    for op, mb in compute_order(schedule, num_stages, stage, num_micro_batches):
        if op == "F" and not first:
            pending.append((RECV_ACT, mb))
        if op == "B" and not last:
            pending.append((RECV_GRAD, mb))
        if pending:
            actions.append(Action("comm", comms=tuple(pending)))
            pending = []
        actions.append(Action(op, mb))
        if op == "F" and not last:
            pending.append((SEND_ACT, mb))
        if op == "B" and not first:
            pending.append((SEND_GRAD, mb))
    return actions + ([Action("comm", comms=tuple(pending))] if pending else [])


# ----------------------------------------------------------------------------------
# One stage's layers, and the runner that executes any schedule on them
# ----------------------------------------------------------------------------------

class StageLayers:
    """The layers one stage owns, with a stash per micro-batch in flight and dW summed
    over micro-batches. 3D's subclass makes each layer column-parallel (step 3)."""

    def __init__(self, weights, first, last, targets=None, n=1):
        self.weights, self.num_layers, self.first, self.last = weights, len(weights), first, last
        self.targets, self.n = targets, n            # targets: micro-batches of Y (last stage)
        self.grads = [torch.zeros_like(w) for w in weights]
        self.stash = {}        # micro-batch -> its layers' (x, z), popped by its own backward
        self.loss_grad = {}    # micro-batch -> dL/da of the last layer (last stage only)
        self.loss, self.peak_stash = 0.0, 0

    def layer_forward(self, i, x):
        return layer_forward(x, self.weights[i])

    def layer_backward(self, i, g, stash, need_dx):
        return layer_backward(g, stash, self.weights[i], need_dx)

    def add_grad(self, i, dw):
        self.grads[i] += dw                     # summed over micro-batches

    def forward(self, mb, x):
        stashes = []
        for i in range(self.num_layers):
            x, stash = self.layer_forward(i, x)
            stashes.append(stash)
        self.stash[mb] = stashes
        self.peak_stash = max(self.peak_stash, len(self.stash))
        if self.last:
            loss, self.loss_grad[mb] = mse_loss(x, self.targets[mb], self.n)
            self.loss += loss.item()
        return x

    def backward(self, mb, g):
        g = self.loss_grad.pop(mb) if self.last else g
        stashes = self.stash.pop(mb)
        for i in reversed(range(self.num_layers)):
            need_dx = i > 0 or not self.first       # the model's input needs no gradient
            g, dw = self.layer_backward(i, g, stashes[i], need_dx)
            self.add_grad(i, dw)
        return g

    def outgoing(self, tensor):   # what crosses to a neighbouring stage, and what arrives:
        return tensor             # 3D's --p2p-shard sends a 1/tp slice and all-gathers it

    def incoming(self, buffer):
        return buffer


def run_schedule(actions, layers, inputs, prev_rank, next_rank, buffer_shape, group=None,
                 events=None):
    """Execute one stage's action list on its StageLayers. inputs: the micro-batches (first
    stage only). events, if a list, receives (op, mb, start, end) of every F and B."""
    activations, grads = {}, {}     # received, waiting for their F / B
    outputs, input_grads = {}, {}   # computed, waiting to be sent
    device = inputs[0].device
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
                    out = layers.outgoing(outputs.pop(mb))
                    ops.append(dist.P2POp(dist.isend, out, next_rank, group))
                else:
                    out = layers.outgoing(input_grads.pop(mb))
                    ops.append(dist.P2POp(dist.isend, out, prev_rank, group))
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            continue
        start = time.perf_counter()
        if action.op == "F":
            x = inputs[action.mb] if layers.first else layers.incoming(activations.pop(action.mb))
            out = layers.forward(action.mb, x)
            if not layers.last:
                outputs[action.mb] = out.contiguous()
        else:
            g = None if layers.last else layers.incoming(grads.pop(action.mb))
            dx = layers.backward(action.mb, g)
            if not layers.first:
                input_grads[action.mb] = dx.contiguous()
        if events is not None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)   # the kernels run after the call returns
            events.append((action.op, action.mb, start, time.perf_counter()))


def stage_layers(num_layers, num_stages, stage):
    """Stage s owns layers [s L/p, (s+1) L/p)."""
    per_stage = num_layers // num_stages
    return range(stage * per_stage, (stage + 1) * per_stage)


# ----------------------------------------------------------------------------------
# Training with it
# ----------------------------------------------------------------------------------

def pp_worker(rank, world_size, args):
    device = setup(rank, world_size)
    dist.barrier()   # a collective on every rank before the first point-to-point (NCCL asks for it)
    stage, num_stages, m = rank, world_size, args.micro_batches
    first, last = stage == 0, stage == num_stages - 1
    full = init_weights(args.num_layers, args.dim, args.seed)
    layer_ids = stage_layers(args.num_layers, num_stages, stage)
    weights = [full[i].to(device, copy=True) for i in layer_ids]
    inputs, targets = make_batch(args)
    layers = StageLayers(weights, first, last, targets.to(device).chunk(m),
                         n=args.batch_size * args.dim)
    optimizer = make_optimizer(weights, args)
    actions = build_schedule(args.schedule, num_stages, stage, m)
    micro_batches = inputs.to(device).chunk(m)                    # [B/m, D] each
    losses = []
    for step in range(args.steps):
        layers.grads, layers.loss = [torch.zeros_like(w) for w in weights], 0.0
        events = [] if args.timeline and step == args.steps - 1 else None
        run_schedule(actions, layers, micro_batches, stage - 1, stage + 1,
                     (args.batch_size // m, args.dim), events=events)
        if step == 0:
            first_grads = gather_on_rank0(torch.stack(layers.grads))
        for w, grad in zip(weights, layers.grads):
            w.grad = grad
        optimizer.step()
        losses.append(layers.loss)
        if last:
            log(f"[stage {stage}]", f"step {step:3d}  loss {layers.loss:.6f}")
        if events is not None:
            show_timeline(events, layers.peak_stash, num_stages, m, rank, device)
    if rank == 0:
        print_schedules(args.schedule, num_stages, m)
    # Rank 0 gathers every stage's layers, [p, L/p, D, D]: in stage order, the model's
    # layers in order. The losses come from the last stage, which alone knows them.
    final = gather_on_rank0(torch.stack(weights))
    losses = torch.tensor(losses, dtype=torch.float64, device=device)
    dist.broadcast(losses, src=num_stages - 1)
    if rank == 0:
        finish_run(args, full, list(final.flatten(0, 1)), losses.tolist(), inputs, targets,
                   list(first_grads.flatten(0, 1)))
    cleanup()


def print_schedules(schedule, num_stages, num_micro_batches):
    print(f"{schedule}, {num_stages} stages, {num_micro_batches} micro-batches: every stage's "
          f"actions in order. F3 forward of micro-batch 3, B3 its backward; [ ] point-to-point\n"
          f"posted together: a>3 send activation 3 on, >a3 receive it, <g3 send gradient 3 back, "
          f"g<3 receive it", flush=True)
    for s in range(num_stages):
        actions = build_schedule(schedule, num_stages, s, num_micro_batches)
        log(f"[stage {s}]", " ".join(map(str, actions)))


def show_timeline(events, peak_stash, num_stages, num_micro_batches, rank, device, width=96):
    """Rank 0 draws the last step: every stage's F and B on one time axis, and the bubble."""
    rows = torch.tensor([["FB".index(op), mb, t0, t1] for op, mb, t0, t1 in events],
                        dtype=torch.float64)
    stages = gather_on_rank0(rows.to(device))                            # [p, 2m, 4]
    peaks = gather_on_rank0(torch.tensor([peak_stash], device=device))
    if rank != 0:
        return
    begin, end = stages[..., 2].min().item(), stages[..., 3].max().item()
    scale = width / (end - begin)
    print(f"timeline of the last step, {(end - begin) * 1e3:.2f} ms across: F3 = forward of "
          f"micro-batch 3, B3 = its backward (as wide as its time, at least its name), '.' idle",
          flush=True)
    idle = []
    for s, (evs, peak) in enumerate(zip(stages.tolist(), peaks.flatten().tolist())):
        line = ""
        for op, mb, t0, t1 in evs:
            label = f"{'FB'[int(op)]}{int(mb)}"
            a = max(len(line), round((t0 - begin) * scale))
            b = max(a + len(label), round((t1 - begin) * scale))
            line += "." * (a - len(line)) + label.ljust(b - a, "-")
        idle.append(1 - sum(t1 - t0 for _, _, t0, t1 in evs) / (end - begin))
        print(f"  stage {s} |{line.ljust(width, '.')}| idle {idle[-1]:5.1%}, peak stash {peak}",
              flush=True)
    p, m, cores = num_stages, num_micro_batches, os.cpu_count()
    print(f"bubble: measured {sum(idle) / p:.1%} (the stages' mean idle share), "
          f"theory (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.1%}", flush=True)
    if device.type == "cpu" and p > cores:
        print(f"note: {p} stages share {cores} CPU cores, so a stage often waits for a core, not "
              f"for its neighbour: the measured bubble mostly shows that load", flush=True)


def main(argv=None):
    args = parse_args(argv)
    spawn(pp_worker, args.world_size, args, backend=args.backend, timeout_s=args.timeout_s)


# ----------------------------------------------------------------------------------
# Below: the command line.
# ----------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = training_parser("Pipeline parallelism: GPipe and 1F1B, the backward by hand.")
    parser.add_argument("--world-size", type=positive_int, default=4, help="stages p, a rank each")
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
    parser.add_argument("--timeline", action="store_true", help="draw the last step's F and B")
    args = parser.parse_args(argv)
    if args.world_size > args.num_layers:
        parser.error(f"--world-size {args.world_size}: more stages than --num-layers "
                     f"({args.num_layers})")
    check_divides(parser, args.num_layers, "--num-layers", args.world_size, "--world-size")
    check_training_args(parser, args, args.world_size)
    check_launch_args(parser, args, args.world_size)
    return args


if __name__ == "__main__":
    run_main(main)
