"""Step 2: data parallelism, and the model that every step of the collection trains.

    python data_parallel.py                          # 4 replicas on the CPU
    python data_parallel.py --world-size 2 --micro-batches 4 --overlap --check
    python data_parallel.py --zero 3 --check         # ZeRO-3: each replica keeps 1/4 of all
    torchrun --nproc-per-node 4 data_parallel.py

The model is an MLP of L layers, trained with mean squared error to imitate a teacher
of the same shape. Its backward is derived by hand here, once; every later step splits
these same lines across ranks:

    forward    z = x W          a = gelu(z)            x [b, D], W [D, D], z and a [b, D]
    backward   dz = g * gelu'(z)                       g = dL/da [b, D]
               dW = x^T dz      [D, D]
               dx = dz W^T      [b, D]: the g of the layer below
    loss       L = sum (a - y)^2 / n      dL/da = 2 (a - y) / n

Data parallelism: each of the d replicas holds every weight and trains on its own
slice of the batch. The replicas sum their gradients with one all-reduce, 2(d-1)/d x P
bytes each for P bytes of gradients, and divide by d: every replica takes the same step.

The gaps in the lecture that this step fills: the backward itself, checked against
autograd in the tests; micro-batches, whose gradients add up before the one all-reduce
of a step; --overlap, which starts each layer's all-reduce as soon as that gradient is
final, as DDP does, so that it runs while the layers below compute theirs; and ZeRO
(--zero 1, 2, 3), which splits that all-reduce into step 1's reduce-scatter and
all-gather, so that each replica keeps only 1/d of the optimizer state, the gradients
and the weights, for the all-reduce's bytes (stages 1 and 2) or 1.5 times them for
each micro-batch (stage 3: the weights are gathered for its forward and its backward).

What PyTorch gives you: DistributedDataParallel; for ZeRO, ZeroRedundancyOptimizer and
FSDP2's fully_shard (tests/bench.py races them against this).
"""
import math
import os
import warnings

warnings.filterwarnings("ignore", "Failed to initialize NumPy")   # torch warns without numpy
import torch
import torch.distributed as dist
import torch.nn.functional as F

from collectives import (Parser, Stop, check_launch_args, cleanup, log,
                         positive_float, positive_int, run_main, setup, spawn)


# ----------------------------------------------------------------------------------
# The model and its hand-derived backward
# ----------------------------------------------------------------------------------

def layer_forward(x, w):
    """a = gelu(x W). Returns a and what its backward needs: (x, z)."""
    z = x @ w                       # [b, D] @ [D, n] -> [b, n]
    return F.gelu(z), (x, z)


def layer_backward(g, stash, w, need_dx=True):
    """Given g = dL/da, return (dx, dW) for a = gelu(x W). need_dx=False skips dx (None)
    where nobody needs it: the model's first layer, one matmul in three."""
    dx, (x, dz) = input_backward(g, stash, w, need_dx)
    return dx, x.T @ dz                       # dW = x^T dz        [D, n]


def input_backward(g, stash, w, need_dx=True):
    """The half of the backward that the layer below waits for: dx. Returns dx and what
    the other half, dW = x^T dz, needs (step 4's zero-bubble schedule runs it later)."""
    x, z = stash
    dz = torch.ops.aten.gelu_backward(g, z)   # dz = g * gelu'(z)  [b, n], fused: see gelu_grad
    dx = dz @ w.T if need_dx else None        # dx = dz W^T        [b, D]
    return dx, (x, dz)


def gelu_grad(z):
    """gelu'(z) for the exact GELU, gelu(z) = z Phi(z):  Phi(z) + z phi(z).

    The formula, for the reader and the tests. The step runs PyTorch's fused kernel for
    the same product g * gelu'(z), which reads z once instead of six times."""
    cdf = 0.5 * (1 + torch.erf(z / math.sqrt(2)))                  # Phi(z)
    pdf = torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)         # phi(z)
    return cdf + z * pdf


def mse_loss(a, y, n):
    """This piece's squared error divided by n, and its gradient dL/da = 2 (a - y) / n.

    n is the element count of the batch whose mean we want (for a replica: its slice),
    so the pieces' losses and gradients add up to the mean's. The one place where the
    loss is scaled."""
    diff = a - y
    return diff.square().sum() / n, diff * (2.0 / n)


def model_forward(weights, x):
    """Every layer in turn; returns the output and one stash per layer."""
    stashes = []
    for w in weights:
        x, stash = layer_forward(x, w)
        stashes.append(stash)
    return x, stashes


def init_weights(num_layers, dim, seed):
    """L full D x D matrices, drawn in layer order from one generator.

    Every rank draws all of them alike and keeps its own part, so the shards of a layer
    are pieces of one matrix. (At scale that costs every rank the whole model for a
    moment; real systems draw each shard from its own seeded generator, or build the
    model on the "meta" device and initialise only their shards.) The sqrt(2/D) scale
    keeps the signal alive through many GELU layers; 1/sqrt(D) nearly silences it.
    """
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(dim, dim, generator=gen) * math.sqrt(2.0 / dim) for _ in range(num_layers)]


def make_batch(args):
    """Inputs X [B, D] and targets Y = teacher(X), a teacher of the same shape from its
    own seed: the loss can reach zero, and a falling loss means learning."""
    teacher = init_weights(args.num_layers, args.dim, args.seed + 1)
    gen = torch.Generator().manual_seed(args.seed + 2)
    inputs = torch.randn(args.batch_size, args.dim, generator=gen)
    targets, _ = model_forward(teacher, inputs)
    return inputs, targets


def make_optimizer(params, args):
    """Plain SGD, or AdamW with PyTorch's defaults; each rank steps its own tensors."""
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=args.lr)
    return torch.optim.AdamW(params, lr=args.lr)


def serial_train(args):
    """The same training in one process, with autograd: what every parallel run must equal."""
    weights = [w.requires_grad_() for w in init_weights(args.num_layers, args.dim, args.seed)]
    inputs, targets = make_batch(args)
    optimizer = make_optimizer(weights, args)
    losses, first_grads = [], None
    for _ in range(args.steps):
        out = inputs
        for w in weights:
            out = F.gelu(out @ w)
        loss = F.mse_loss(out, targets)
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        first_grads = first_grads or [w.grad.clone() for w in weights]
        optimizer.step()
    return {"final_weights": [w.detach() for w in weights], "losses": losses,
            "first_grads": first_grads}


# ----------------------------------------------------------------------------------
# Data parallelism
# ----------------------------------------------------------------------------------

def replica_rows(batch_size, dp_rank, dp_size, step=None, seed=0):
    """The rows of the global batch that replica dp_rank trains on.

    Taken by the data-parallel rank, never the global rank (in 3D the two differ). With
    a step given, the batch is first shuffled by a permutation that every rank draws
    from the same seed, so the replicas' slices still partition the batch.
    """
    rows = torch.arange(batch_size)
    if step is not None:
        gen = torch.Generator().manual_seed(seed * 100003 + step)
        rows = torch.randperm(batch_size, generator=gen)
    per_replica = batch_size // dp_size
    return rows[dp_rank * per_replica:(dp_rank + 1) * per_replica]


class DataParallel:
    """One replica's weights, gradients and optimizer, over the data-parallel group of d
    replicas, with ZeRO's stages: each replica keeps 1/d of more and more of the state.

        --zero 0   every replica holds everything; one all-reduce     16 P bytes per replica
        --zero 1   the optimizer state: reduce-scatter, then all-gather  8 P + 8 P/d
        --zero 2   the gradients too, reduce-scattered once final        4 P + 12 P/d
        --zero 3   the weights too, all-gathered layer by layer          16 P/d, + a layer

    (P bytes of float32 weights: 4 for the weights, 4 for the gradients, 8 for AdamW's two
    states.) An all-reduce is a reduce-scatter and then an all-gather, (d-1)/d of the bytes
    each: stages 1 and 2 send what stage 0 sends, 2(d-1)/d x P, split around the optimizer
    step. Stage 3 gathers each weight for every micro-batch's forward and backward and
    reduce-scatters its gradient: 3(d-1)/d x P per micro-batch. Each weight, flattened and
    padded to d x S elements, splits into d shards of S; replica r owns [r S, (r+1) S).
    """

    def __init__(self, weights, group, args, overlap=False):
        self.group, self.zero, self.overlap = group, args.zero, overlap
        self.d, self.r = dist.get_world_size(group), dist.get_rank(group)
        self.shapes, self.device = [w.shape for w in weights], weights[0].device
        self.sizes = [-(-w.numel() // self.d) for w in weights]           # S = ceil(numel / d)
        self.full = [self.padded(w, i) for i, w in enumerate(weights)] if self.zero else weights
        self.shards = [] if self.zero == 0 else [self.own(f, i) for i, f in enumerate(self.full)]
        if self.zero == 3:                      # the shards alone: weight(i) gathers the rest
            self.shards, self.full = [shard.clone() for shard in self.shards], None
        self.optimizer = make_optimizer(self.shards or weights, args)    # AdamW state: 1/d or all
        self.gathered, self.pending, self.peak = {}, [], 0

    def weight(self, i):
        """Layer i's full weight, for its forward or backward. Stage 3 all-gathers it now,
        (d-1)/d of its bytes in, and release(i) lets it go."""
        if self.zero == 0:
            return self.full[i]
        if self.zero < 3:
            return self.unpadded(self.full[i], i)
        self.gathered[i] = self.shards[i].new_empty(self.d * self.sizes[i])
        dist.all_gather_single(self.gathered[i], self.shards[i], group=self.group)
        self.peak = max(self.peak, sum(self.held().values()))
        return self.unpadded(self.gathered[i], i)

    def release(self, i):
        self.gathered.pop(i, None)              # the stash keeps x and z, never W

    def zero_grads(self, num_micro_batches):
        """This step's gradients, zeroed: full while the stage keeps them, and the shards."""
        device, numels = self.device, [shape.numel() for shape in self.shapes]
        if self.zero == 0:   # one flat buffer, as DDP's buckets: one all-reduce sends it all
            self.flat = torch.zeros(sum(numels), device=device)
            self.grads = [g.view(shape) for g, shape in zip(self.flat.split(numels), self.shapes)]
        else:                # stage 1 reduces into its own part of the full gradient, in place
            self.grads = [torch.zeros(self.d * S, device=device) if self.zero < 3 else None
                          for S in self.sizes]
            self.grad_shards = [self.own(g, i) if self.zero == 1 else torch.zeros(S, device=device)
                                for i, (g, S) in enumerate(zip(self.grads, self.sizes))]
        self.left = [num_micro_batches] * len(self.shapes)   # micro-batches until final
        self.peak = 0                                          # stage 3's largest, this step

    def add_grad(self, i, dw):
        """Layer i's dW of one micro-batch. Stage 3 reduce-scatters it at once; the others sum
        it, and once it is final stage 2 reduce-scatters it and lets the full gradient go,
        and with overlap stages 0 and 1 start sending it while the backward goes on."""
        self.left[i] -= 1
        if self.zero == 3:
            self.reduce_scatter(self.padded(dw, i), i)
            return
        grad = self.grads[i] if self.zero == 0 else self.unpadded(self.grads[i], i)
        grad += dw
        if self.left[i] == 0 and self.zero == 0 and self.overlap:
            self.pending.append((dist.all_reduce(grad, group=self.group, async_op=True), None, i))
        elif self.left[i] == 0 and (self.zero == 2 or self.overlap):
            self.reduce_scatter(self.grads[i], i)

    def reduce_scatter(self, grad, i):
        """grad [d S], summed over the replicas: this replica's shard [S] into grad_shards[i]."""
        piece = self.grad_shards[i].new_empty(self.sizes[i])
        work = dist.reduce_scatter_single(piece, grad, group=self.group, async_op=self.overlap)
        self.pending.append((work, piece, i))
        if not self.overlap:
            self.wait()

    def wait(self):
        for work, piece, i in self.pending:
            if work is not None:
                work.wait()
            if piece is None:                   # an all-reduce: nothing more to do
                continue
            if self.zero == 1:
                self.grad_shards[i].copy_(piece)   # its own part of the full gradient
            else:
                self.grad_shards[i] += piece       # stage 3: summed over micro-batches
            if self.zero == 2:
                self.grads[i] = None               # only the shard stays
        self.pending = []

    def average(self):
        """What is left of the step's gradient exchange, then / d: the sum over the replicas
        of their mean-loss gradients, / d, is the gradient of the global mean."""
        if self.zero == 0 and not self.overlap and self.d > 1:
            dist.all_reduce(self.flat, group=self.group)       # everything at once: 2(d-1)/d x P
        if self.zero == 1 and not self.overlap:
            for i, grad in enumerate(self.grads):
                self.reduce_scatter(grad, i)                   # (d-1)/d x P
        self.wait()
        for grad in (self.grads if self.zero == 0 else self.grad_shards):
            grad.div_(self.d)

    def step(self):
        """The optimizer steps what this replica owns. Stages 1 and 2 then all-gather every
        replica's updated shard into the full weights: (d-1)/d x P."""
        for w, grad in zip(self.shards or self.full, self.grad_shards if self.zero else self.grads):
            w.grad = grad
        self.optimizer.step()
        if self.zero in (1, 2):
            for i, full in enumerate(self.full):
                dist.all_gather_single(full, self.shards[i].clone(), group=self.group)

    def padded(self, tensor, i):
        """tensor flat, with zeros after it up to d S elements: a view where no zero is needed."""
        flat, extra = tensor.reshape(-1), self.d * self.sizes[i] - tensor.numel()
        return torch.cat([flat, flat.new_zeros(extra)]) if extra else flat

    def unpadded(self, flat, i):
        return flat[:self.shapes[i].numel()].view(self.shapes[i])

    def own(self, flat, i):
        return flat[self.r * self.sizes[i]:(self.r + 1) * self.sizes[i]]   # a view: [S]

    def full_grads(self):
        """The averaged gradients as full matrices (for --check); stages 1-3 gather them."""
        if self.zero == 0:
            return self.grads
        return [self.gather(g, i) for i, g in enumerate(self.grad_shards)]

    def full_weights(self):
        return [self.gather(shard, i) if self.zero == 3 else self.weight(i) for i, shard in
                enumerate(self.shards or self.full)]

    def gather(self, shard, i):
        full = shard.new_empty(self.d * self.sizes[i])
        dist.all_gather_single(full, shard.contiguous(), group=self.group)
        return self.unpadded(full, i)

    def held(self):
        """The bytes this replica holds now, of weights, gradients and optimizer state."""
        weights = self.full if self.zero < 3 else [*self.shards, *self.gathered.values()]
        grads = [self.flat] if self.zero == 0 else [g for g in self.grads if g is not None]
        grads += self.grad_shards if self.zero > 1 else []   # stage 1's are parts of the full ones
        state = [t for per_weight in self.optimizer.state.values() for t in per_weight.values()
                 if torch.is_tensor(t) and t.dim()]      # AdamW's two moments (not its step count)
        held = {"weights": weights, "gradients": grads, "optimizer state": state}
        return {name: sum(t.numel() * t.element_size() for t in ts) for name, ts in held.items()}


def dp_step(replica, xs, ys, n):
    """One replica's step: every micro-batch (xs, ys) forward and back through the hand-derived
    blocks, dW summed over them and averaged over the replicas. Returns this replica's loss."""
    L = len(replica.shapes)
    replica.zero_grads(len(xs))
    loss = torch.zeros((), device=replica.device)
    for x, y in zip(xs, ys):
        stashes = []
        for i in range(L):
            x, stash = layer_forward(x, replica.weight(i))   # stage 3: gathered for this forward
            replica.release(i)
            stashes.append(stash)
        mb_loss, g = mse_loss(x, y, n)
        loss += mb_loss
        for i in reversed(range(L)):
            w = replica.weight(i) if i > 0 else None          # layer 0 needs no W: it makes no dx
            g, dw = layer_backward(g, stashes[i], w, need_dx=i > 0)
            replica.release(i)
            replica.add_grad(i, dw)                           # summed over micro-batches
    replica.average()
    return loss


def dp_worker(rank, world_size, args):
    device = setup(rank, world_size)
    dp_rank, dp_size, m = rank, world_size, args.micro_batches
    init = init_weights(args.num_layers, args.dim, args.seed)
    replica = DataParallel([w.to(device, copy=True) for w in init], None, args, args.overlap)
    inputs, targets = (t.to(device) for t in make_batch(args))
    n = args.batch_size // dp_size * args.dim   # this replica's slice: its mean divides by n
    losses = []
    for step in range(args.steps):
        rows = replica_rows(args.batch_size, dp_rank, dp_size, step if args.shuffle else None,
                            args.seed)
        xs, ys = inputs[rows].chunk(m), targets[rows].chunk(m)   # m micro-batches of [B/(d m), D]
        loss = dp_step(replica, xs, ys, n)
        if step == 0:
            first_grads = [g.clone() for g in replica.full_grads()]
        replica.step()
        losses.append(global_loss(loss, None))
        if rank == 0:
            log(f"[rank {rank}]", f"step {step:3d}  loss {losses[-1]:.6f}")
    weights = replica.full_weights()
    drift = replica_drift(weights)
    if rank == 0:
        log(f"[rank {rank}]", f"replicas identical after training: {drift == 0.0} "
                              f"(largest difference {drift:g})")
        show_memory(replica, args)
        finish_run(args, init, weights, losses, inputs, targets, first_grads,
                   {"replica_max_diff": drift})
    cleanup()


def zero_formula(zero, num_params, dp_size, optimizer="adamw"):
    """Bytes of weights, gradients and optimizer state one replica holds in fp32 for P
    parameters: 4 + 4 + 8 a parameter with AdamW (SGD keeps no state). Stage 1 splits the
    optimizer state over the d replicas, stage 2 the gradients too, stage 3 the weights too."""
    def bytes_(per_parameter, split_from):
        return per_parameter * num_params / (dp_size if zero >= split_from else 1)
    return {"weights": bytes_(4, 3), "gradients": bytes_(4, 2),
            "optimizer state": bytes_(8 if optimizer == "adamw" else 0, 1)}


def show_memory(replica, args):
    """What one replica holds at the end of a step, beside ZeRO's formulas."""
    held, zero, d = replica.held(), args.zero, replica.d
    P = sum(d * S for S in replica.sizes) if zero else sum(s.numel() for s in replica.shapes)
    want = zero_formula(zero, P, d, args.optimizer)
    names = {0: ("4P", "4P", "8P"), 1: ("4P", "4P", "8P/d"), 2: ("4P", "4P/d", "8P/d"),
             3: ("4P/d", "4P/d", "8P/d")}[zero]
    print(f"memory of one replica at the end of a step, --zero {zero}, d={d}, P = {P} parameters\n"
          f"(each layer padded to a multiple of d), fp32: 4 + 4 + 8 bytes a parameter with AdamW, "
          f"SGD keeps no state")
    total = {0: "16P", 1: "8P + 8P/d", 2: "4P + 12P/d", 3: "16P/d"}[zero]
    for kind, got, name, formula in [*zip(held, held.values(), names, want.values()),
                                     ("total", sum(held.values()), total, sum(want.values()))]:
        print(f"  {kind:<16}{got:>12} bytes   formula {name:<11}= {formula:>12.0f}")
    if zero == 3:
        first = args.steps == 1 and args.optimizer == "adamw"
        print(f"  largest at any moment of the last step: {replica.peak} bytes, what it held then\n"
              f"  and one gathered layer ({4 * d * replica.sizes[0]} bytes)"
              + (": AdamW's state comes with the first optimizer step, after" if first else ""))
    print("bf16 weights and gradients with fp32 master weights and Adam, 2 + 2 + 12 bytes a "
          "parameter:\n  16P, 4P + 12P/d, 2P + 14P/d and 16P/d at stages 0 to 3", flush=True)


def global_loss(loss, group):
    """The mean loss over the global batch: the replicas' mean losses, averaged."""
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=group)
    return loss.item() / dist.get_world_size(group)


def replica_drift(weights, group=None):
    """Largest |W - W on the group's first rank|: zero while the replicas agree bitwise."""
    drift = torch.zeros((), device=weights[0].device)
    first = dist.get_global_rank(group, 0) if group else 0
    for w in weights:
        theirs = w.clone()
        dist.broadcast(theirs, src=first, group=group)
        drift = torch.maximum(drift, (w - theirs).abs().max())
    dist.all_reduce(drift, op=dist.ReduceOp.MAX, group=group)
    return drift.item()


def main(argv=None):
    args = parse_args(argv)
    spawn(dp_worker, args.world_size, args, backend=args.backend, timeout_s=args.timeout_s)


# ----------------------------------------------------------------------------------
# Below: the command line every training script shares, and --save / --check.
# ----------------------------------------------------------------------------------

def training_parser(description):
    p = Parser(description=description)
    p.add_argument("--num-layers", type=positive_int, default=8, help="layers L of the MLP")
    p.add_argument("--dim", type=positive_int, default=64, help="width D: every W is D x D")
    p.add_argument("--batch-size", type=positive_int, default=32, help="global batch B")
    p.add_argument("--micro-batches", type=positive_int, default=2, help="micro-batches m")
    p.add_argument("--steps", type=positive_int, default=30, help="optimizer steps")
    p.add_argument("--lr", type=positive_float, default=1e-2, help="learning rate")
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="adamw",
                   help="plain SGD, or AdamW with PyTorch's defaults (SGD shows scale errors)")
    p.add_argument("--seed", type=int, default=0,
                   help="weights from seed, teacher from seed+1, inputs from seed+2")
    p.add_argument("--save", metavar="PATH", help="torch.save config, init and final weights "
                   "(full, layer order), inputs, targets, losses")
    p.add_argument("--check", action="store_true", help="also train serially, with autograd")
    return p


def add_zero_arg(parser):
    parser.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0,
                        help="ZeRO stage over the data-parallel group: 1 shards the optimizer "
                             "state, 2 the gradients too, 3 the weights too (FSDP)")


def check_training_args(parser, args, world_size, replicas=1, replicas_flag=None):
    """The checks every training script shares, after its own: the seed, --lr and --save;
    micro-batches that cut each replica's rows evenly; and the memory the ranks need."""
    if not 0 <= args.seed < 2**32:   # torch overflows past 2**64; seed + 2 and --shuffle's too
        parser.error(f"--seed {args.seed}: expected an integer from 0 to {2**32 - 1}")
    if args.lr > 3.4e38:
        parser.error(f"--lr {args.lr:g}: more than a float32 holds (3.4e38)")
    if args.save is not None and not writable(args.save):
        parser.error(f"--save {args.save!r}: cannot write there")
    rows, m = args.batch_size // replicas, args.micro_batches
    by = f"--batch-size {args.batch_size} / {replicas_flag} {replicas} = {rows}" if replicas_flag \
        else rows
    if m > rows:
        parser.error(f"--micro-batches {m}: more micro-batches than rows per replica ({by})")
    if args.batch_size % (replicas * m):
        parser.error(f"--batch-size {args.batch_size} is not divisible by "
                     f"{replicas_flag + ' x ' if replicas_flag else ''}--micro-batches "
                     f"({replicas * m})")
    # Each rank holds at most: the whole model and the teacher as drawn (2 L D^2 floats),
    # its weights, gradients and AdamW's two states (16 bytes a parameter, or ZeRO's share
    # of them), the batch (2 B D), and the stash of every layer's input and pre-activation
    # for the whole batch (2 L B D).
    L, D, B = args.num_layers, args.dim, args.batch_size
    state = sum(zero_formula(getattr(args, "zero", 0), L * D * D, replicas).values())
    per_rank = 4 * (2 * L * D * D + 2 * B * D + 2 * L * B * D) + state
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if args.backend != "nccl" and memory and per_rank * ranks_here > memory:
        total = per_rank * ranks_here
        parser.error(f"--num-layers {L} --dim {D} --batch-size {B}: about {per_rank / 1e9:.1f} "
                     f"GB per rank, {total / 1e9:.1f} GB for the {ranks_here} ranks on this "
                     f"machine, which has {memory / 1e9:.1f} GB")


def writable(path):
    """Whether this process can write path. Tried, not asked: an immutable file refuses root."""
    existed = os.path.exists(path)
    try:
        with open(path, "ab"):   # appends nothing: an existing file stays as it is
            pass
    except OSError:              # also: a folder, a missing folder, '' (no such file)
        return False
    if not existed:
        os.remove(path)
    return True


def refuse_unused(parser, args, used, mode):
    """A flag that this mode does not use is refused, not silently dropped."""
    for name, value in vars(args).items():
        if name not in used and value != parser.get_default(name):
            parser.error(f"--{name.replace('_', '-')}: not used with {mode}")


def check_divides(parser, value, flag, divisor, divisor_flag):
    if value % divisor:
        parser.error(f"{flag} {value} is not divisible by {divisor_flag} ({divisor})")


def parse_args(argv=None):
    parser = training_parser("Data parallelism: replicas on slices of the batch.")
    parser.add_argument("--world-size", type=positive_int, default=4, help="replicas d")
    parser.add_argument("--overlap", action="store_true",
                        help="start each layer's gradient all-reduce as soon as it is final")
    parser.add_argument("--shuffle", action="store_true",
                        help="reshuffle each replica's rows every step, from a shared seed")
    add_zero_arg(parser)
    args = parser.parse_args(argv)
    check_training_args(parser, args, args.world_size, args.world_size, "--world-size")
    check_launch_args(parser, args, args.world_size)
    return args


def gather_on_rank0(tensor):
    """Every rank's tensor (one shape on all), stacked in rank order on rank 0; None elsewhere.
    Tensors, not pickled objects: torch's object collectives need numpy."""
    rank0 = dist.get_rank() == 0
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())] if rank0 else None
    dist.gather(tensor.contiguous(), parts, dst=0)
    return torch.stack(parts) if rank0 else None


def finish_run(args, init, final, losses, inputs, targets, first_grads, extra=None):
    """On rank 0, with full matrices: write --save, then --check against serial training."""
    if args.save:
        torch.save({"config": vars(args), "init_weights": [w.detach().float().cpu() for w in init],
                    "final_weights": [w.detach().float().cpu() for w in final],
                    "inputs": inputs.cpu(),
                    "targets": targets.cpu(), "losses": list(losses), **(extra or {})}, args.save)
        print(f"saved {args.save}", flush=True)
    print(f"loss {losses[0]:.6f} -> {losses[-1]:.6f} over {len(losses)} steps", flush=True)
    not_finite = [step for step, loss in enumerate(losses) if not math.isfinite(loss)]
    if not_finite:
        print(f"the loss stopped being finite at step {not_finite[0]}: --lr {args.lr:g} is too "
              f"large for this model; try a smaller one", flush=True)
    if args.check:
        check_against_serial(args, final, losses, first_grads)


def check_against_serial(args, final, losses, first_grads):
    """Compare with the same training in one process under autograd (serial_train).

    - The first step's gradients, before any optimizer touches them, each layer's relative
      to its largest: a gradient off by a constant fails here, whatever the optimizer.
    - The loss at every step, and the final weights. An SGD step is lr x gradient, so the
      weights agree to float32 summation order. AdamW divides each element's step by its
      gradient's running size: an element whose gradient is near eps (1e-8) may take a
      step of up to lr in one run and less in the other, so up to lr x steps apart.
    """
    ref = serial_train(args)
    adamw = args.optimizer == "adamw"

    def largest(differences):   # torch's max, not Python's: a nan anywhere is the answer
        return torch.stack(list(differences)).max().item()
    figures = [
        ("first step's gradients",
         largest((g.cpu() - r).abs().max() / r.abs().max().clamp_min(1e-30)
                                           for g, r in zip(first_grads, ref["first_grads"])),
         CHECK_TOLERANCE, "(of each layer's largest)"),
        ("losses", largest((torch.tensor(losses) - torch.tensor(ref["losses"])).abs()),
         CHECK_TOLERANCE, ""),
        ("final weights",
         largest((w.cpu() - r).abs().max() for w, r in zip(final, ref["final_weights"])),
         args.lr * args.steps if adamw else CHECK_TOLERANCE,
         "= lr x steps: AdamW's elements with gradients near eps" if adamw else ""),
    ]
    print(f"check against serial autograd training ({args.optimizer}):", flush=True)
    for name, difference, tolerance, why in figures:
        verdict = "ok" if difference <= tolerance else "FAILED"   # a nan is never <= anything
        print(f"  {name:<23} largest difference {difference:.2e}   tolerance {tolerance:.0e} "
              f"{why}  {verdict}",
              flush=True)
    if all(difference <= tolerance for _, difference, tolerance, _ in figures):
        print("check OK", flush=True)
    elif not all(map(math.isfinite, losses)):
        raise Stop(f"check FAILED: the loss stopped being finite; try a smaller --lr than "
                   f"{args.lr:g}")
    else:
        raise Stop("check FAILED: this run differs from serial autograd training (see above)")


CHECK_TOLERANCE = 1e-4   # float32 summation order moves results by ~1e-7; a bug moves them far more


if __name__ == "__main__":
    run_main(main)
