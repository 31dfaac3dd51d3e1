"""Step 2: data parallelism, and the model every step of the collection trains.

    python data_parallel.py                                  # 4 replicas on the CPU
    python data_parallel.py --world-size 2 --micro-batches 4 --overlap --check
    python data_parallel.py --count-comm --steps 1           # bytes sent per step, against the formula
    python data_parallel.py --bench --world-size 2           # ours against DDP and serial: equal, then timed
    torchrun --nproc-per-node 4 data_parallel.py

The model is an MLP of L layers, a = gelu(x @ W_l), trained with mean squared error
to imitate a teacher of the same shape. Its backward is derived by hand here, once,
and checked against autograd in the tests; every later step imports these blocks.

Data parallelism: each replica holds every weight, trains on its own slice of the
global batch, and averages its gradients with the others before the optimizer step,
so all replicas take the same step. The lecture all-reduces after the whole
backward; `--overlap` starts each layer's all-reduce as soon as that gradient is
final, as DistributedDataParallel does, so communication hides behind the backward
of the layers below.
"""
import contextlib
import math
import os
from fractions import Fraction

import warnings

warnings.filterwarnings("ignore", "Failed to initialize NumPy")  # torch's import warns without numpy; nothing here needs it
import torch
import torch._dynamo  # noqa: F401  building any torch.optim optimizer imports it (~1 s): pay once, before forking
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from collectives import (CommCounter, Parser, add_launch_args, check_and_race, check_launch_args, cleanup, end_race,
                         log, pick_backend, positive_float, positive_int, print_race, report_comm, run_main, setup,
                         spawn, spawn_returning)


# ----------------------------------------------------------------------------------
# The model and its hand-derived backward
# ----------------------------------------------------------------------------------

def init_weights(num_layers, dim, seed):
    """L full D x D matrices, drawn in layer order from one generator.

    Every rank draws all of them identically and then keeps its own slice, so the
    shards of a tensor-parallel layer are pieces of one matrix. The sqrt(2/D) scale
    keeps the signal alive through many GELU layers (1/sqrt(D) nearly silences it).
    """
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(dim, dim, generator=gen) * math.sqrt(2.0 / dim) for _ in range(num_layers)]


def make_batch(args):
    """Inputs X [B, D] and targets Y = teacher(X): a teacher of the same shape drawn
    from its own seed, so the loss can reach zero and a falling loss means learning."""
    teacher = init_weights(args.num_layers, args.dim, args.seed + 1)
    inputs = torch.randn(args.batch_size, args.dim, generator=torch.Generator().manual_seed(args.seed + 2))
    targets = inputs
    for w in teacher:
        targets = F.gelu(targets @ w)
    return inputs, targets


def gelu_grad(z):
    """d/dz gelu(z) for the exact (erf) GELU, gelu(z) = z Phi(z):  Phi(z) + z phi(z).

    Each term's first op makes a new tensor and the rest work in place (the trailing _):
    this runs for every layer and micro-batch, and a new tensor per op made it 2x slower."""
    cdf = torch.erf(z * (1.0 / math.sqrt(2.0))).add_(1.0).mul_(0.5)              # Phi(z)
    pdf = z.square().mul_(-0.5).exp_().mul_(1.0 / math.sqrt(2.0 * math.pi))    # phi(z)
    return cdf.add_(pdf.mul_(z))


def layer_forward(x, w):
    """a = gelu(x @ W). Returns a and the stash its backward needs: (x, z)."""
    z = x @ w                                # [b, D] @ [D, n] -> [b, n]
    return F.gelu(z), (x, z)


def layer_backward(g, stash, w, need_dx=True):
    """Given g = dL/da, return (dx, dW) for a = gelu(x @ W). need_dx=False skips dx
    (None) where nobody uses it: the model's first layer, one matmul in three."""
    x, z = stash
    dz = gelu_grad(z).mul_(g)                # dz = g * gelu'(z)   [b, n]
    dw = x.T @ dz                            # dW = x^T dz         [D, n]
    dx = dz @ w.T if need_dx else None       # dx = dz W^T         [b, D]
    return dx, dw


def mse_loss(a, y, n):
    """Squared error of this piece of the batch, divided by n, and its gradient.

    n is the element count of the whole batch whose mean we want (for a replica:
    its own slice), so summing the pieces' losses and gradients gives the mean.
    This is the one place where the loss is scaled.
    """
    diff = a - y
    return diff.square().sum() / n, diff * (2.0 / n)   # dL/da = 2 (a - y) / n


def model_forward(weights, x):
    """All layers; returns the output and one stash per layer."""
    stashes = []
    for w in weights:
        x, stash = layer_forward(x, w)
        stashes.append(stash)
    return x, stashes


def make_optimizer(params, args):
    """Plain SGD, or AdamW with PyTorch's defaults; each rank steps its own tensors."""
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=args.lr)
    return torch.optim.AdamW(params, lr=args.lr)


# ----------------------------------------------------------------------------------
# Data parallelism
# ----------------------------------------------------------------------------------

def replica_rows(batch_size, dp_rank, dp_size, step=None, seed=0):
    """Indices of the global batch that replica dp_rank trains on.

    Sliced by the data-parallel rank, never the global rank (in 3D they differ).
    With a step given, the batch is first shuffled by a permutation that every rank
    draws from the same seed, so the replicas' slices still partition the batch.
    """
    rows = torch.arange(batch_size)
    if step is not None:
        rows = torch.randperm(batch_size, generator=torch.Generator().manual_seed(seed * 100003 + step))
    per_replica = batch_size // dp_size
    return rows[dp_rank * per_replica:(dp_rank + 1) * per_replica]


class GradientAverager:
    """Averages gradients over the data-parallel group, once per step.

    ready(grad) is called when a gradient is final. With overlap, its all-reduce
    starts right then and runs while the backward goes on (what DDP does); finish()
    only waits. Without overlap, finish() sends every gradient at once, flattened
    into one buffer: one collective pays the fixed latency once instead of L times.
    Either way finish() divides by the group size: the sum over replicas of their
    mean-loss gradients, / dp, is the gradient of the global mean loss.

    zeros(weights) hands out gradient buffers that already are one flat buffer (as
    DDP's buckets are), so finish() sends it as it is: no copy in and out, and no
    fresh allocation each step (on the CPU, those copies cost 10% of a D=1024 step).
    """

    def __init__(self, group, overlap=False):
        self.group, self.overlap = group, overlap
        self.size = dist.get_world_size(group)
        self.pending = []
        self.flat, self.views = None, None

    def zeros(self, weights):
        """This step's gradients, zeroed: views into one flat tensor kept from step to step."""
        if self.flat is None:
            self.flat = torch.empty(sum(w.numel() for w in weights), dtype=weights[0].dtype,
                                    device=weights[0].device)                     # [sum of numel]
            pieces = self.flat.split([w.numel() for w in weights])
            self.views = [piece.view_as(w) for piece, w in zip(pieces, weights)]
        self.flat.zero_()
        return self.views

    def ready(self, grad):
        if self.overlap and self.size > 1:
            self.pending.append(dist.all_reduce(grad, group=self.group, async_op=True))

    def finish(self, grads):
        if self.size == 1:
            return
        if self.overlap:
            for work in self.pending:
                work.wait()
            self.pending = []
            for grad in grads:
                grad.div_(self.size)
        elif grads is self.views:                          # already one flat buffer
            dist.all_reduce(self.flat, group=self.group)
            self.flat.div_(self.size)
        else:
            flat = torch.cat([g.reshape(-1) for g in grads])   # [sum of numel]
            dist.all_reduce(flat, group=self.group)
            flat.div_(self.size)
            for grad, piece in zip(grads, flat.split([g.numel() for g in grads])):
                grad.copy_(piece.view_as(grad))


def dp_step(weights, xs, ys, n, averager):
    """One replica's step from the blocks above: the forward and hand-derived backward
    of each micro-batch (xs, ys), dW summed over them, then averaged over the replicas.
    Returns (grads, this replica's loss)."""
    grads = averager.zeros(weights)
    loss = torch.zeros((), device=weights[0].device)
    for mb, (x, y) in enumerate(zip(xs, ys)):
        out, stashes = model_forward(weights, x)
        mb_loss, g = mse_loss(out, y, n)
        loss += mb_loss
        for i in reversed(range(len(weights))):
            g, dw = layer_backward(g, stashes[i], weights[i], need_dx=i > 0)
            grads[i] += dw                          # accumulate over micro-batches
            if mb == len(xs) - 1:
                averager.ready(grads[i])            # layer i's gradient is final now
    averager.finish(grads)
    return grads, loss


def dp_comm_formula(param_bytes, dp_size):
    """Bytes one replica sends per step (--count-comm): one all-reduce of all its
    gradients, 2(d-1)/d x their bytes. --overlap sends one per layer: the same bytes."""
    d = dp_size
    return {("dp", "all-reduce"): (Fraction(2 * (d - 1) * param_bytes, d),
                                   f"2({d}-1)/{d} x {param_bytes} gradient bytes")}


def dp_worker(rank, world_size, args):
    device = setup(rank, world_size)
    tag = f"[rank {rank}]"
    weights = [w.to(device) for w in init_weights(args.num_layers, args.dim, args.seed)]
    init = [w.clone() for w in weights]
    inputs, targets = (t.to(device) for t in make_batch(args))
    optimizer = make_optimizer(weights, args)
    averager = GradientAverager(group=None, overlap=args.overlap)
    local_batch = args.batch_size // world_size
    n = local_batch * args.dim  # elements in this replica's slice: its mean loss divides by n
    comm = CommCounter({"dp": None}, enabled=args.count_comm)
    losses = []
    for step in range(args.steps):
        rows = replica_rows(args.batch_size, rank, world_size, step if args.shuffle else None, args.seed)
        xs = inputs[rows].chunk(args.micro_batches)   # m micro-batches of [B/(dp m), D]
        ys = targets[rows].chunk(args.micro_batches)
        with comm.step():                               # --count-comm counts what this sends
            grads, loss = dp_step(weights, xs, ys, n, averager)
        for w, grad in zip(weights, grads):
            w.grad = grad
        optimizer.step()
        losses.append(global_loss(loss, None))
        if rank == 0:
            log(tag, f"step {step:3d}  loss {losses[-1]:.6f}")
    if args.count_comm:
        report_comm(comm, dp_comm_formula(sum(w.numel() * w.element_size() for w in weights), world_size))
    drift = replica_drift(weights)
    if rank == 0:
        log(tag, f"replicas identical after training: {drift == 0.0} (largest difference {drift:g})")
        finish_run(args, init, weights, losses, inputs, targets, extra={"replica_max_diff": drift})
    cleanup()


def global_loss(loss, group):
    """The mean loss over the global batch: the replicas' mean losses, averaged."""
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=group)
    return loss.item() / dist.get_world_size(group)


def replica_drift(weights, group=None):
    """Largest |W - W on the group's first rank|: zero when the replicas agree bitwise."""
    drift = torch.zeros(())
    for w in weights:
        first = w.clone()
        dist.broadcast(first, src=dist.get_global_rank(group, 0) if group else 0, group=group)
        drift = torch.maximum(drift, (w - first).abs().max().cpu())
    dist.all_reduce(drift, op=dist.ReduceOp.MAX, group=group)
    return drift.item()


# ----------------------------------------------------------------------------------
# The serial reference: --save writes the run, --check compares it with autograd
# ----------------------------------------------------------------------------------

CHECK_TOLERANCE = 1e-4  # float32 summation order moves results by ~1e-7; a bug moves them by far more


def serial_train(args):
    """The same training on one process with autograd: the ground truth."""
    weights = [w.requires_grad_() for w in init_weights(args.num_layers, args.dim, args.seed)]
    inputs, targets = make_batch(args)
    optimizer = make_optimizer(weights, args)
    losses = []
    for _ in range(args.steps):
        out = inputs
        for w in weights:
            out = F.gelu(out @ w)
        loss = F.mse_loss(out, targets)
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {"final_weights": [w.detach() for w in weights], "losses": losses}


def gather_on_rank0(tensor):
    """Every rank's tensor (the same shape on all), stacked in rank order on rank 0:
    [world_size, *shape]; None elsewhere. Tensors, not pickled objects: torch's object
    collectives need numpy, which nothing else here does."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
    dist.gather(tensor.contiguous(), parts, dst=0)
    return torch.stack(parts) if parts is not None else None


def finish_run(args, init_weights_, final_weights, losses, inputs, targets, extra=None):
    """On one rank, with the full weights: write --save, run --check (exit 1 past tolerance)."""
    if args.save:
        torch.save({"config": vars(args),
                    "init_weights": [w.detach().float().cpu() for w in init_weights_],
                    "final_weights": [w.detach().float().cpu() for w in final_weights],
                    "inputs": inputs.cpu(), "targets": targets.cpu(),
                    "losses": list(losses), **(extra or {})}, args.save)
        print(f"saved {args.save}", flush=True)
    print(f"loss {losses[0]:.6f} -> {losses[-1]:.6f} over {len(losses)} steps", flush=True)
    if args.check:
        ref = serial_train(args)
        loss_diff = max(abs(a - b) for a, b in zip(losses, ref["losses"]))
        weight_diff = max((w.cpu() - r).abs().max().item() for w, r in zip(final_weights, ref["final_weights"]))
        worst = max(loss_diff, weight_diff)
        verdict = "OK" if worst <= CHECK_TOLERANCE else "FAILED"
        print(f"check against serial autograd training: largest difference {worst:.2e} "
              f"(losses {loss_diff:.2e}, final weights {weight_diff:.2e}; tolerance {CHECK_TOLERANCE:g}) {verdict}",
              flush=True)
        if verdict != "OK":
            raise SystemExit(1)


# ----------------------------------------------------------------------------------
# Command line: the flags every training script shares (the contract in --help)
# ----------------------------------------------------------------------------------

def training_parser(description):
    p = Parser(description=description)
    p.add_argument("--num-layers", type=positive_int, default=8, help="layers L of the MLP")
    p.add_argument("--dim", type=positive_int, default=64, help="width D: every W is D x D")
    p.add_argument("--batch-size", type=positive_int, default=32, help="global batch B, over all replicas")
    p.add_argument("--micro-batches", type=positive_int, default=2, help="micro-batches m per replica and step")
    p.add_argument("--steps", type=positive_int, default=30, help="optimizer steps (--bench: timed steps, >= 5)")
    p.add_argument("--lr", type=positive_float, default=1e-2, help="learning rate")
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="adamw",
                   help="sgd (plain) or adamw (PyTorch defaults); use sgd to check scale errors")
    p.add_argument("--seed", type=int, default=0, help="weights from seed, teacher from seed+1, inputs from seed+2")
    p.add_argument("--save", metavar="PATH", help="torch.save config, init/final weights (full, layer order), "
                                                  "inputs, targets and per-step losses")
    p.add_argument("--check", action="store_true", help="also train serially with autograd and compare; "
                                                        "exit 1 past the tolerance")
    p.add_argument("--count-comm", action="store_true",
                   help="count the bytes each rank sends in a training step, per kind and dimension, "
                        "and print them beside the formula")
    p.add_argument("--bench", action="store_true",
                   help="instead of training: do the same step with PyTorch's own API, check the two equal, "
                        "and time them side by side and against serial (median of --steps steps, taking turns)")
    add_launch_args(p)
    return p


def check_divides(parser, value, flag, divisor, divisor_flag):
    if value % divisor:
        parser.error(f"{flag} {value} is not divisible by {divisor_flag} ({divisor})")


def check_training_args(parser, args):
    """Checks every script shares: a seed torch takes, a --save path we can write."""
    if not 0 <= args.seed < 2**32:   # torch overflows past 2**64; keep seed + 2 and --shuffle's seeds in range
        parser.error(f"--seed {args.seed}: expected an integer from 0 to {2**32 - 1}")
    if args.save:
        folder = os.path.dirname(os.path.abspath(args.save))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK) or os.path.isdir(args.save):
            parser.error(f"--save {args.save}: cannot write there")
    if args.bench and args.steps < 5:
        parser.error(f"--steps {args.steps}: --bench reports the median of at least 5 timed steps")


def main(argv=None):
    parser = training_parser("Data parallelism: replicas on slices of the batch, gradients averaged.")
    parser.add_argument("--world-size", type=positive_int, default=4, help="number of replicas")
    parser.add_argument("--overlap", action="store_true",
                        help="start each layer's gradient all-reduce as soon as it is final")
    parser.add_argument("--shuffle", action="store_true",
                        help="reshuffle which rows each replica gets, every step, from a shared seed")
    args = parser.parse_args(argv)
    check_divides(parser, args.batch_size, "--batch-size", args.world_size * args.micro_batches,
                  "--world-size x --micro-batches")
    check_training_args(parser, args)
    check_launch_args(parser, args, args.world_size)
    if args.bench:
        # Our step against DistributedDataParallel's: checked equal, then timed
        print_race(versus_ddp(args))
        return
    spawn(dp_worker, args.world_size, args, backend=args.backend, timeout_s=args.timeout_s)


# ----------------------------------------------------------------------------------
# What PyTorch gives you for this: DistributedDataParallel (--bench)
# ----------------------------------------------------------------------------------
#
# --bench, in every training script: the same step done by PyTorch's own API, on the
# same weights, data and world size, with SGD on both sides. The two must compute the
# same thing, or their times mean nothing: the first step's gradients are compared,
# and the weights after every timed step (both sides take the same steps). Then the
# sides are timed taking turns (collectives.check_and_race). Our step on the whole batch, on
# rank 0 alone with one thread, is the serial reference for the speed-up.

def as_module(weights, device):
    """Our model as nn.Sequential(Linear, GELU, ...) for PyTorch's APIs (a copy).
    nn.Linear computes x @ weight.T, so its weight is W^T."""
    layers = []
    for w in weights:
        linear = torch.nn.Linear(*w.shape, bias=False, device=device)
        with torch.no_grad():
            linear.weight.copy_(w.T)                      # [out, in] = W^T
        layers += [linear, torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def sgd_side(weights, compute_grads, lr):
    """Our step with SGD, as (step, state) for check_and_race: compute_grads() runs
    forward and backward and returns the gradients; state() gives (weights, grads)."""
    optimizer = torch.optim.SGD(weights, lr=lr)

    def step():
        for w, grad in zip(weights, compute_grads()):
            w.grad = grad
        optimizer.step()
    return step, lambda: (weights, [w.grad for w in weights])


def our_side(weights, xs, ys, n, averager, lr):
    return sgd_side(weights, lambda: dp_step(weights, xs, ys, n, averager)[0], lr)


def serial_side(args, device):
    """Our step on the whole batch on rank 0 alone: a side that is not compared (None).
    Every rank must call this: it makes rank 0's group of one."""
    alone = dist.new_group([0])
    if dist.get_rank() != 0:
        return (lambda: None), None
    inputs, targets = (t.to(device) for t in make_batch(args))
    weights = [w.to(device) for w in init_weights(args.num_layers, args.dim, args.seed)]
    m = args.micro_batches
    step, _ = our_side(weights, inputs.chunk(m), targets.chunk(m), inputs.numel(), GradientAverager(alone), args.lr)
    return step, None


def ddp_race(rank, world_size, args):
    device = setup(rank, world_size)
    inputs, targets = (t.to(device) for t in make_batch(args))
    rows = replica_rows(args.batch_size, rank, world_size)
    m = args.micro_batches
    xs, ys = inputs[rows].chunk(m), targets[rows].chunk(m)       # [B/(W m), D] each
    n = len(rows) * args.dim                                      # this replica's mean divides by n
    init = init_weights(args.num_layers, args.dim, args.seed)
    sides = {name: our_side([w.to(device, copy=True) for w in init], xs, ys, n, GradientAverager(None, overlap),
                            args.lr) for name, overlap in (("ours", False), ("ours --overlap", True))}
    sides["DDP"] = ddp_side(as_module(init, device), xs, ys, n, args.lr, device)
    sides["serial: our step, whole batch, 1 rank"] = serial_side(args, device)
    result = check_and_race(sides, device, args.steps)
    end_race(sides)
    return result


def ddp_side(model, xs, ys, n, lr, device):
    """DDP's step with SGD, as (step, state). no_sync() skips the all-reduce of every
    micro-batch but the last; each micro-batch's loss is its squared error / n, as in
    mse_loss, and DDP averages the gradients over the replicas, as ours."""
    ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)

    def step():
        optimizer.zero_grad()
        for mb, (x, y) in enumerate(zip(xs, ys)):
            with ddp.no_sync() if mb < len(xs) - 1 else contextlib.nullcontext():
                (F.mse_loss(ddp(x), y, reduction="sum") / n).backward()
        optimizer.step()
    linears = model[::2]
    return step, lambda: ([lin.weight.T for lin in linears], [lin.weight.grad.T for lin in linears])


def versus_ddp(args):
    """Run the race on args.world_size ranks; return what print_race prints."""
    times, diffs = spawn_returning(ddp_race, args.world_size, args, backend=args.backend, timeout_s=args.timeout_s)
    return dict(title=f"data parallel vs DistributedDataParallel: {bench_sizes(args, args.world_size)}",
                times=times, diffs=diffs, ratios=[("ours", "DDP"), ("ours --overlap", "DDP")],
                world_size=args.world_size, steps=args.steps, tolerance=CHECK_TOLERANCE)


def bench_sizes(args, world_size):
    backend = pick_backend(world_size, args.backend)
    return (f"{world_size} ranks ({backend}{', 1 thread each' if backend == 'gloo' else ''}), "
            f"L={args.num_layers} D={args.dim} B={args.batch_size} m={args.micro_batches}, SGD")




if __name__ == "__main__":
    run_main(main)
