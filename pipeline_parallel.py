"""Step 4: pipeline parallelism. Stages own consecutive layers; micro-batches flow through.

    python pipeline_parallel.py                                   # 4 stages, 1F1B
    python pipeline_parallel.py --world-size 4 --schedule gpipe --timeline
    python pipeline_parallel.py --world-size 2 --micro-batches 8 --check
    python pipeline_parallel.py --bubble-table                    # bubble and stash, p = 2, 4 and m = 1..8
    python pipeline_parallel.py --bench --world-size 2 --micro-batches 4   # against torch.distributed.pipelining
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
import os
import tempfile
import textwrap
import time
from typing import NamedTuple

import warnings

warnings.filterwarnings("ignore", "Failed to initialize NumPy")  # torch's import warns without numpy; nothing here needs it
import torch
import torch.distributed as dist
import torch.nn.functional as F

from collectives import (CommCounter, check_and_race, check_launch_args, cleanup, end_race, log, positive_int,
                         print_race, report_comm, run_main, setup, spawn, spawn_returning)
from data_parallel import (CHECK_TOLERANCE, as_module, bench_sizes, check_divides, check_training_args,
                           finish_run, gather_on_rank0, init_weights, layer_backward, layer_forward, make_batch,
                           make_optimizer, mse_loss, serial_side, training_parser)


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
    return layer_backward(g, stash, w, need_dx)


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


def pp_comm_formula(stage, num_stages, act_bytes, num_micro_batches):
    """Bytes stage s sends per step (--count-comm): per micro-batch, its output
    activation to the next stage (unless last) and its input's gradient to the previous
    stage (unless first), act_bytes each."""
    boundaries, m = (stage > 0) + (stage < num_stages - 1), num_micro_batches
    return {("pp", "send"): (boundaries * m * act_bytes,
                             f"{m} mb x {act_bytes} x {boundaries} (one per neighbouring stage)")}


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
    comm = CommCounter({"pp": None}, enabled=args.count_comm)
    losses = []
    for step in range(args.steps):
        stage.grads = [torch.zeros_like(w) for w in weights]
        stage.loss = 0.0
        events = [] if args.timeline and step == args.steps - 1 else None
        with comm.step():           # --count-comm counts what this sends
            run_schedule(actions, stage, micro_batches, rank - 1, rank + 1, buffer_shape, events=events)
        for w, grad in zip(weights, stage.grads):
            w.grad = grad
        optimizer.step()
        losses.append(stage.loss)
        if last:
            log(tag, f"step {step:3d}  loss {stage.loss:.6f}")
        if events is not None:
            show_timeline(events, stage.peak_stash, world_size, m, rank, device)
    if args.count_comm:
        act_bytes = buffer_shape[0] * buffer_shape[1] * inputs.element_size()   # one [B/m, D] activation
        report_comm(comm, pp_comm_formula(rank, world_size, act_bytes, m))
    if rank == 0:
        log(tag, "schedule of every stage:")
        for s in range(world_size):
            log(f"[stage {s}]", " ".join(map(str, build_schedule(args.schedule, world_size, s, m))))
    # Rank 0 gathers every stage's layers, [p, L/p, D, D], which in stage order are the
    # model's layers in order; the losses come from the last stage, which alone has them.
    stages = gather_on_rank0(torch.stack(weights))
    losses = torch.tensor(losses, dtype=torch.float64, device=device)
    dist.broadcast(losses, src=world_size - 1)
    if rank == 0:
        finish_run(args, full, list(stages.flatten(0, 1)), losses.tolist(), inputs, targets)
    cleanup()


def events_tensor(events, device):
    """(op, mb, start, end) events as rows of a float64 tensor, to gather them."""
    return torch.tensor([["FB".index(op), mb, t0, t1] for op, mb, t0, t1 in events], dtype=torch.float64,
                        device=device)


def events_list(rows):
    return [("FB"[int(op)], int(mb), t0, t1) for op, mb, t0, t1 in rows.tolist()]


def show_timeline(events, peak_stash, num_stages, num_micro_batches, rank, device):
    """Rank 0 draws every stage's F and B slots on one time axis (one step)."""
    stages = gather_on_rank0(events_tensor(events, device))          # [p, 2m, 4]
    peaks = gather_on_rank0(torch.tensor(peak_stash, device=device))
    if rank != 0:
        return
    everything = [(events_list(rows), peak) for rows, peak in zip(stages, peaks.tolist())]
    begin, end, idle = idle_shares([evs for evs, _ in everything])
    width = 96
    scale = width / (end - begin)
    print(f"timeline of the last step: {(end - begin) * 1e3:.1f} ms across, F = forward, "
          f"b = backward, the digit is the micro-batch, '.' is idle", flush=True)
    for s, (evs, peak) in enumerate(everything):
        row = ["."] * width
        for op, mb, t0, t1 in evs:
            a, b = int((t0 - begin) * scale), max(int((t0 - begin) * scale) + 1, int((t1 - begin) * scale))
            for c in range(a, min(b, width)):
                row[c] = (str(mb % 10) if c > a else ("F" if op == "F" else "b"))
        print(f"  stage {s} |{''.join(row)}| idle {idle[s]:5.1%}, peak stash {peak}", flush=True)
    p, m = num_stages, num_micro_batches
    print(f"bubble: measured {sum(idle) / p:.1%} (mean idle share of the stages), "
          f"theory (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.1%}", flush=True)


def idle_shares(stage_events):
    """One step's (begin, end, [idle share of each stage]). The step spans the first F's
    start to the last B's end over all stages; a stage is busy only inside its F and B."""
    begin = min(e[2] for evs in stage_events for e in evs)
    end = max(e[3] for evs in stage_events for e in evs)
    return begin, end, [1 - sum(t1 - t0 for _, _, t0, t1 in evs) / (end - begin) for evs in stage_events]


# ----------------------------------------------------------------------------------
# --bubble-table: the measured bubble and the peak stash, for p = 2, 4 and m = 1..8
# ----------------------------------------------------------------------------------

def bubble_table(stages=(2, 4), micro_batches=range(1, 9), dim=1024, rows=64, steps=3,
                 backend="auto", timeout_s=60.0):
    """Both schedules for each p in stages and m in micro_batches: a list of dicts with
    the measured bubble of the median step ("bubble", "step_ms") and each stage's peak
    stash ("peak_stash"). One dim x dim layer per stage, rows rows per micro-batch."""
    table = []
    for p in stages:   # one run of p ranks measures every m and both schedules
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "table.pt")
            spawn(bubble_worker, p, list(micro_batches), dim, rows, steps, path,
                  backend=backend, timeout_s=timeout_s)
            table += torch.load(path)
    return table


def bubble_worker(rank, num_stages, micro_batches, dim, rows, steps, path):
    device = setup(rank, num_stages)
    dist.barrier()   # a collective on every rank before the first point-to-point (NCCL asks for it)
    p, first, last = num_stages, rank == 0, rank == num_stages - 1
    w = init_weights(p, dim, seed=0)[rank].to(device)      # one layer per stage
    table = []
    for m in micro_batches:
        x = torch.randn(m * rows, dim, generator=torch.Generator().manual_seed(m)).to(device).chunk(m)
        for schedule in ("gpipe", "1f1b"):
            stage = Stage([w], first, last, targets=x, n=m * rows * dim)   # any targets of the right shape
            actions = build_schedule(schedule, p, rank, m)
            timelines = []
            for _ in range(steps + 1):    # the first step opens the connections: not measured
                timelines.append([])
                dist.barrier()            # every stage starts the step at once
                run_schedule(actions, stage, x, rank - 1, rank + 1, (rows, dim), events=timelines[-1])
            steps_of = gather_on_rank0(torch.stack([events_tensor(tl, device) for tl in timelines[1:]]))
            peaks = gather_on_rank0(torch.tensor(stage.peak_stash, device=device))
            if rank == 0:
                everything = [([events_list(rows) for rows in stage_steps], peak)
                              for stage_steps, peak in zip(steps_of, peaks.tolist())]
                measured = sorted((idle_shares([tl[i] for tl, _ in everything]) for i in range(steps)),
                                  key=lambda step: step[1] - step[0])
                begin, end, idle = measured[steps // 2]     # the median step, by its span
                table.append({"p": p, "m": m, "schedule": schedule, "bubble": sum(idle) / p,
                              "step_ms": (end - begin) * 1e3, "peak_stash": [peak for _, peak in everything]})
    if rank == 0:
        torch.save(table, path)
    cleanup()


def print_bubble_table(table, dim, rows, steps):
    print(f"pipeline bubble and stash: one {dim} x {dim} layer per stage, {rows} rows per micro-batch, "
          f"the median step of {steps} after a warm-up step", flush=True)
    print(f"{'p':>3}{'m':>3}{'theory':>9} |{'gpipe':>8}{'ms':>7}  {'stash':<12}|{'1f1b':>8}{'ms':>7}  stash",
          flush=True)
    cells = {(r["p"], r["m"], r["schedule"]): r for r in table}
    for p, m in dict.fromkeys((r["p"], r["m"]) for r in table):
        line = f"{p:>3}{m:>3}{(p - 1) / (m + p - 1):>9.1%} "
        for schedule in ("gpipe", "1f1b"):
            r = cells[p, m, schedule]
            line += f"|{r['bubble']:>8.1%}{r['step_ms']:>7.1f}  {' '.join(map(str, r['peak_stash'])):<12}"
        print(line, flush=True)
    cores, most = os.cpu_count() or 1, max(r["p"] for r in table)
    print(textwrap.dedent(f"""\
        theory: (p-1)/(m+p-1), for stages of equal time and free communication. measured: the mean over
        stages of the share of the step (the first F's start to the last B's end, on any stage) that a stage
        spent outside its F and B: besides the bubble, the transfers of activations and gradients and the
        runner's Python between actions. ms: that step's span. stash: the most micro-batches whose
        activations a stage held at once, stage 0 first; GPipe holds all m, 1F1B min(p-s, m)."""),
          flush=True)
    # Any other work on the machine shows up too: give the reader the load to judge by.
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    print(f"machine: {cores} CPU cores{load}.", flush=True)
    if most > cores:
        print(f"note: {most} ranks shared {cores} CPU cores: a stage that waits for a core counts as idle,\n"
              f"and one that loses its core inside F or B counts as busy.", flush=True)


# ----------------------------------------------------------------------------------

def main(argv=None):
    parser = training_parser("Pipeline parallelism: GPipe and 1F1B over send/recv, backward by hand.")
    parser.add_argument("--world-size", type=positive_int, default=4, help="pipeline stages, one rank each")
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b", help="micro-batch schedule")
    parser.add_argument("--timeline", action="store_true", help="draw the last step's F/B slots per stage")
    parser.add_argument("--bubble-table", action="store_true",
                        help="measure the bubble and peak stash of both schedules for p = 2, 4 and m = 1..8 "
                             "(its own sizes: one 1024 x 1024 layer per stage, 64 rows per micro-batch)")
    args = parser.parse_args(argv)
    if args.bubble_table:
        # The measured bubble against (p-1)/(m+p-1), and each stage's peak stash
        sizes = dict(dim=1024, rows=64, steps=5)
        print_bubble_table(bubble_table(backend=args.backend, timeout_s=args.timeout_s, **sizes), **sizes)
        return
    if args.world_size > args.num_layers:
        parser.error(f"--world-size {args.world_size}: more stages than --num-layers ({args.num_layers})")
    check_divides(parser, args.num_layers, "--num-layers", args.world_size, "--world-size")
    check_divides(parser, args.batch_size, "--batch-size", args.micro_batches, "--micro-batches")
    check_training_args(parser, args)
    check_launch_args(parser, args, args.world_size)
    if args.bench:
        # Our GPipe and 1F1B against torch.distributed.pipelining's: checked equal, then timed
        print_race(versus_pipelining(args))
        return
    spawn(pp_worker, args.world_size, args, backend=args.backend, timeout_s=args.timeout_s)


# ----------------------------------------------------------------------------------
# What PyTorch gives you for this: torch.distributed.pipelining (--bench)
# ----------------------------------------------------------------------------------

def pipelining_race(rank, world_size, args):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
    device = setup(rank, world_size)
    dist.barrier()   # a collective on every rank before the first point-to-point (NCCL asks for it)
    full = init_weights(args.num_layers, args.dim, args.seed)
    layers = stage_layers(args.num_layers, world_size, rank)
    inputs, targets = (t.to(device) for t in make_batch(args))
    m = args.micro_batches
    schedules = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    if m < world_size:
        del schedules["1f1b"]          # PyTorch's 1F1B needs at least as many micro-batches as stages
    sides = {}
    for name, schedule_class in schedules.items():
        weights = [full[i].to(device, copy=True) for i in layers]
        sides[f"ours {name}"] = pp_side(weights, name, rank, world_size, inputs, targets, args)
        sides[f"torch {schedule_class.__name__}"] = pipelining_side(
            as_module([full[i] for i in layers], device), schedule_class, rank, world_size, inputs, targets, args)
    sides["serial: our step, whole batch, 1 rank"] = serial_side(args, device)
    result = check_and_race(sides, device, args.steps)
    end_race(sides)
    return result


def pp_side(weights, schedule, rank, world_size, inputs, targets, args):
    """Our stage with one schedule and SGD, as (step, state) for check_and_race."""
    m = args.micro_batches
    stage = Stage(weights, rank == 0, rank == world_size - 1, targets.chunk(m), n=args.batch_size * args.dim)
    actions = build_schedule(schedule, world_size, rank, m)
    optimizer = torch.optim.SGD(weights, lr=args.lr)

    def step():
        stage.grads = [torch.zeros_like(w) for w in weights]
        stage.loss = 0.0
        run_schedule(actions, stage, inputs.chunk(m), rank - 1, rank + 1, (args.batch_size // m, args.dim))
        for w, grad in zip(weights, stage.grads):
            w.grad = grad
        optimizer.step()
    return step, lambda: (weights, stage.grads)


def pipelining_side(module, schedule_class, rank, world_size, inputs, targets, args):
    """PyTorch's stage (this rank's layers as a module) with a schedule of the same stage
    and micro-batch counts, and SGD, as (step, state). Each micro-batch's loss is
    loss_fn(output, target), its mean squared error, and the schedule divides the
    gradients by m (scale_grads): with equal micro-batches, the gradient of the mean
    over the batch, as ours. The first stage gives the inputs, the last the targets."""
    from torch.distributed.pipelining import PipelineStage
    # Shapes given up front (static mode): inferring them sends pickled objects, which needs numpy
    # (an activation between stages requires grad: its gradient is sent back)
    example = inputs[:args.batch_size // args.micro_batches].clone().requires_grad_()   # one micro-batch [B/m, D]
    stage = PipelineStage(module, rank, world_size, inputs.device, input_args=example if rank else example.detach(),
                          output_args=example)
    schedule = schedule_class(stage, args.micro_batches, loss_fn=F.mse_loss)
    first, last = rank == 0, rank == world_size - 1
    params = list(module.parameters())                 # nn.Linear weights: W^T
    optimizer = torch.optim.SGD(params, lr=args.lr)

    def step():
        optimizer.zero_grad()
        schedule.step(*[inputs] if first else [], **dict(target=targets) if last else {}, return_outputs=False)
        optimizer.step()
    return step, lambda: ([p.T for p in params], [p.grad.T for p in params])


def versus_pipelining(args):
    """Run the race on args.world_size ranks; return what print_race prints."""
    import torch.distributed.pipelining  # noqa: F401  (~3 s) once here, before the ranks fork
    times, diffs = spawn_returning(pipelining_race, args.world_size, args, backend=args.backend,
                                   timeout_s=args.timeout_s)
    ratios = [(f"ours {s}", f"torch {c}") for s, c in (("gpipe", "ScheduleGPipe"), ("1f1b", "Schedule1F1B"))
              if f"ours {s}" in times]
    notes = [] if len(ratios) == 2 else [f"1F1B skipped: PyTorch's needs --micro-batches >= stages ({args.world_size})"]
    return dict(title=f"pipeline parallel vs torch.distributed.pipelining: {bench_sizes(args, args.world_size)}",
                times=times, diffs=diffs, ratios=ratios, notes=notes, world_size=args.world_size,
                steps=args.steps, tolerance=CHECK_TOLERANCE)


if __name__ == "__main__":
    run_main(main)
