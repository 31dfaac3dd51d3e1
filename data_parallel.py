"""Step 2: data parallelism, and the model that every step of the collection trains.

    python data_parallel.py                          # 4 replicas on the CPU
    python data_parallel.py --world-size 2 --micro-batches 4 --overlap --check
    python data_parallel.py --zero 3 --check         # ZeRO-3: each replica keeps 1/4 of all
    torchrun --nproc-per-node 4 data_parallel.py

The model: L layers, trained with mean squared error to imitate a teacher of the same
shape. Its backward is derived by hand here, once; every later step splits these lines:

    forward    z = x W          a = gelu(z)            x [b, D], W [D, D], z and a [b, D]
    backward   dz = g * gelu'(z)                       g = dL/da [b, D], gelu' = Phi + z phi
               dW = x^T dz      [D, D]
               dx = dz W^T      [b, D]: the g of the layer below
    loss       L = sum (a - y)^2 / n      dL/da = 2 (a - y) / n

A layer keeps (x, z), its stash, for its backward. --recompute (activation checkpointing, a
layer at a time) keeps x, makes z = x W again in the backward: L [b, D], not 2 L, 4/3 the FLOPs.

Data parallelism: each of d replicas holds every weight and trains on its own slice of the
batch; they sum their gradients with an all-reduce and divide by d: the same step on each.
dp_step() reads as that: forward; backward layer by layer, each dW into its bucket; each
bucket's exchange once final (--overlap: under the backward below); divide. ZeRO (--zero 1,
2, 3): three classes, each the stage before plus its change; dp_costs their bytes and memory.
PyTorch's: DDP, ZeroRedundancyOptimizer, FSDP2 (tests/bench.py).
"""
import functools
import math
import warnings
warnings.filterwarnings("ignore", "Failed to initialize NumPy")   # torch warns without numpy
import torch
import torch.distributed as dist
import torch.nn.functional as F

from collectives import cleanup, log, run_main, setup, spawn


def layer_forward(x, w, recompute=False):
    """a = gelu(x W), and what its backward needs: (x, z); recompute: (x, None), z let go."""
    z = x @ w                                 # [b, D] @ [D, n] -> [b, n]
    if recompute:
        return F.gelu(z), (x, None)
    return F.gelu(z), (x, z)


def layer_backward(g, stash, w, need_dx=True):
    """Given g = dL/da: dx = dz W^T, and (x, dz) for dW = x^T dz, which the replica sums into
    its bucket. need_dx=False skips dx (None): the model's input needs none, a matmul saved."""
    x, z = stash
    if z is None:                             # --recompute kept x alone: z = x W again
        z = x @ w
    dz = torch.ops.aten.gelu_backward(g, z)   # dz = g * gelu'(z)  [b, n], one fused kernel
    dx = dz @ w.T if need_dx else None        # dx = dz W^T        [b, D]
    return dx, (x, dz)


def mse_loss(a, y, n):
    """This piece's squared error / n and dL/da = 2 (a - y) / n, n the batch's elements (in all)."""
    diff = a.to(y.dtype) - y
    return diff.square().sum() / n, (diff * (2.0 / n)).to(a.dtype)


def init_weights(num_layers, dim, seed):
    """L full D x D matrices from one generator, in layer order: every rank draws them alike
    and keeps its part, so a layer's shards are pieces of one matrix (at scale: a generator per
    shard, or the meta device: tests/gpu_path.py). sqrt(2/D) keeps the signal through GELUs."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(dim, dim, generator=gen) * math.sqrt(2.0 / dim) for _ in range(num_layers)]


def make_batch(args):   # X [B, D], and Y = teacher(X) from its own seed: the loss can reach 0
    inputs = torch.randn(args.batch_size, args.dim,
                         generator=torch.Generator().manual_seed(args.seed + 2))
    teacher = init_weights(args.num_layers, args.dim, args.seed + 1)
    return inputs, functools.reduce(lambda x, w: layer_forward(x, w)[0], teacher, inputs)


def replica_rows(batch_size, dp_rank, dp_size, step=None, seed=0):
    """The rows that replica dp_rank trains on: by its data-parallel rank, never the global
    rank (in 3D they differ). With a step, from a permutation that every rank draws alike."""
    rows = torch.arange(batch_size)
    if step is not None:
        shuffle = torch.Generator().manual_seed(seed * 100003 + step)
        rows = torch.randperm(batch_size, generator=shuffle)
    per_replica = batch_size // dp_size
    return rows[dp_rank * per_replica:(dp_rank + 1) * per_replica]


def dp_step(replica, xs, ys, n, recompute=False):
    """One replica's step on micro-batches xs, ys [B/(d m), D], its loss."""
    loss = torch.zeros((), device=replica.device)
    buckets = list(enumerate(replica.buckets))        # a bucket: consecutive layers
    last_micro_batch = len(xs) - 1
    replica.begin_step()
    for micro_batch, (x, y) in enumerate(zip(xs, ys)):
        a = x.to(replica.dtype)
        stashes = []
        for b, layers in buckets:                     # forward, bucket by bucket
            replica.gather_weights(b, prefetch=b + 1)     # ZeRO-3: the bucket's weights, whole
            for i in layers:
                a, stash = layer_forward(a, replica.weights[i], recompute=recompute)   # [b, D]
                stashes.append(stash)
            replica.release_weights(b)
        micro_batch_loss, g = mse_loss(a, y, n)
        loss += micro_batch_loss
        for b, layers in reversed(buckets):           # backward, from the last layer's bucket
            replica.gather_weights(b, prefetch=b - 1)
            for i in reversed(layers):
                g, (x_i, dz) = layer_backward(g, stashes.pop(), replica.weights[i], need_dx=i > 0)
                replica.add_grad(i, x_i, dz)          # dW = x^T dz, summed over micro-batches
            replica.release_weights(b)
            if micro_batch == last_micro_batch or replica.exchange_each_micro_batch:
                replica.reduce_gradients(b)           # final: summed over the replicas
    replica.average()                                 # every exchange done; each gradient / d
    return loss


class DataParallel:
    """ZeRO stage 0, DDP: a replica of d over `group` holds all weights, gradients and optimizer
    state; a bucket (consecutive layers' dW, flat) goes as one message. --bf16: bf16 copies."""
    exchange_each_micro_batch = False   # ZeRO-3 keeps no gradient from a micro-batch to the next

    def __init__(self, weights, group, optimizer="adamw", lr=1e-2, bucket_mb=25.0, bf16=False,
                 overlap=False, chunk_starts=()):
        self.group = group
        self.overlap = overlap
        self.device = weights[0].device
        self.dp_size = dist.get_world_size(group)
        self.dp_rank = dist.get_rank(group)
        self.dtype = torch.bfloat16 if bf16 else torch.float32
        self.shapes = [w.shape for w in weights]
        self.layout = make_buckets([w.numel() for w in weights], bucket_mb, chunk_starts)
        self.buckets = self.layout.buckets            # the layers of each
        self.lengths = self.layout.lengths            # the elements of each
        self.store_weights(weights)
        self.optimizer = make_optimizer(self.params, optimizer, lr)
        self.grad_buckets = [None] * len(self.buckets)
        self.reductions = []                          # exchanges under way

    def store_weights(self, weights):   # params: the optimizer's, fp32; weights: the layers'
        self.params = weights
        self.weights = [w.to(self.dtype) for w in weights]   # --bf16: a copy

    def view(self, flat, i):            # layer i's part of its bucket's flat buffer   [D, D]
        start = self.layout.offset[i]
        return flat[start:start + self.shapes[i].numel()].view(self.shapes[i])

    def begin_step(self):               # a layer's first dW of the step overwrites its part
        self.first_dw = set(range(len(self.shapes)))

    def gather_weights(self, b, prefetch=None):   # every weight is here and stays (ZeRO-3
        pass                                      # gathers a bucket, and lets it go)

    def release_weights(self, b):
        pass

    def add_grad(self, i, x, dz):
        """dW = x^T dz summed into its bucket by the matmul itself (Megatron's fusion)."""
        b = self.layout.bucket_of[i]
        if self.grad_buckets[b] is None:
            self.grad_buckets[b] = torch.zeros(self.lengths[b], device=self.device)   # padding: 0
        grad = self.view(self.grad_buckets[b], i)   # fp32 [D, D]: its part of the bucket
        keep = 0.0 if i in self.first_dw else 1.0   # the step's first dW overwrites what was there
        self.first_dw.discard(i)
        if x.dtype != grad.dtype and x.device.type != "cpu":
            # --bf16 on a GPU: bf16 inputs on the tensor cores, summed into the fp32 gradient by
            # the matmul itself (Megatron's fused wgrad); cast to fp32 they would run at 1/15
            torch.addmm(grad, x.T, dz, beta=keep, out_dtype=torch.float32, out=grad)   # dW +=
        else:             # fp32; --bf16 on the CPU casts, having no bf16 x bf16 -> fp32 kernel
            grad.addmm_(x.T.float(), dz.float(), beta=keep)                # dW += x^T dz [D, D]

    def reduce_gradients(self, b):
        """Bucket b is final: its sum over the replicas, in place. --overlap starts it and goes
        on (average() waits), so it runs under the backward below."""
        if self.dp_size > 1:
            work = dist.all_reduce(self.grad_buckets[b], group=self.group, async_op=self.overlap)
            self.reductions.append(work)

    def average(self):                  # the exchanges done, each gradient / d: the mean
        self.finish_reductions()
        for grad in self.grads():
            grad.div_(self.dp_size)

    def finish_reductions(self):        # started with --overlap: waited for now
        for work in filter(None, self.reductions):
            work.wait()
        self.reductions = []

    def grads(self):                    # the gradients of self.params
        return [self.view(self.grad_buckets[self.layout.bucket_of[i]], i)
                for i in range(len(self.shapes))]

    def clip(self, max_norm, groups=()):   # every replica holds the whole average: no dp
        return clip_grads(self.grads(), max_norm, groups)

    def update(self):                   # the optimizer's step; --bf16: the layers' copies then
        self.step_optimizer()
        for weight, param in zip(self.weights, self.params):
            if weight is not param:
                weight.copy_(param)

    def step_optimizer(self):
        for param, grad in zip(self.params, self.grads()):
            param.grad = grad
        self.optimizer.step()


class ZeRO1(DataParallel):
    """Stage 1 = stage 0, but the optimizer steps this replica's 1/d of each bucket alone: the
    all-reduce splits in two around it. A bucket: d S elements, zero-padded; r owns the r-th S."""

    def store_weights(self, weights):
        lengths = [-(-n // self.dp_size) * self.dp_size for n in self.lengths]   # d S each
        flats = [torch.cat([*(weights[i].reshape(-1) for i in layers),           # [d S], its
                            weights[0].new_zeros(length - n)])                   # padding 0
                 for layers, length, n in zip(self.buckets, lengths, self.lengths)]
        self.lengths = lengths
        self.flat = [flat.to(self.dtype) for flat in flats]       # the layers' (bf16: a copy)
        self.weights = [self.view(self.flat[self.layout.bucket_of[i]], i)
                        for i in range(len(weights))]
        self.params = [self.my_part(flat) for flat in flats]      # the optimizer's [S], fp32
        if self.dtype != torch.float32:                           # bf16: the masters alone
            self.params = [param.clone() for param in self.params]

    def my_part(self, flat):            # this replica's 1/d of a bucket: a view [S]
        return flat.view(self.dp_size, -1)[self.dp_rank]

    def reduce_gradients(self, b):      # this replica's part of the sum: (d-1)/d of the bytes
        bucket = self.grad_buckets[b]
        work = dist.reduce_scatter_single(self.my_part(bucket), bucket, group=self.group,
                                          async_op=self.overlap)
        self.reductions.append(work)

    def grads(self):
        return [self.my_part(bucket) for bucket in self.grad_buckets]

    def clip(self, max_norm, groups=()):   # each replica holds 1/d: summed over dp too
        return clip_grads(self.grads(), max_norm, (*groups, self.group))

    def update(self):
        """The optimizer's step on this replica's part of each bucket, then all-gathered."""
        self.step_optimizer()
        for flat, param in zip(self.flat, self.params):
            part = self.my_part(flat)
            if self.dtype != torch.float32:                   # bf16: the new part, rounded
                part.copy_(param)
            dist.all_gather_single(flat, part, group=self.group)


class ZeRO2(ZeRO1):
    """Stage 2 = stage 1, but a bucket is reduce-scattered into a part of its own, the bucket let
    go at once; exchanged again in the step (ZeRO-3's), it adds to its part."""

    def begin_step(self):
        super().begin_step()
        self.grad_parts = [None] * len(self.buckets)
        self.parts_in_flight = []       # (bucket, part) of an exchange again, --overlap's

    def reduce_gradients(self, b):
        part = self.grad_buckets[b].new_empty(self.lengths[b] // self.dp_size)   # [S]
        work = dist.reduce_scatter_single(part, self.grad_buckets[b], group=self.group,
                                          async_op=self.overlap)
        self.reductions.append(work)
        self.grad_buckets[b] = None               # let go: the Work holds what it sends
        if self.grad_parts[b] is None:
            self.grad_parts[b] = part
        elif self.overlap:                        # summed once it has come in (average)
            self.parts_in_flight.append((b, part))
        else:
            self.grad_parts[b] += part

    def average(self):
        self.finish_reductions()
        for b, part in self.parts_in_flight:
            self.grad_parts[b] += part
        self.parts_in_flight = []
        super().average()                         # nothing left under way: each / d

    def grads(self):                    # the parts, [S] each
        return self.grad_parts


class ZeRO3(ZeRO2):
    """Stage 3 (FSDP) = stage 2, but a replica keeps only its 1/d of the weights: a bucket is
    FSDP's unit, gathered for its forward and its backward, let go, exchanged each micro-batch."""
    exchange_each_micro_batch = True

    def store_weights(self, weights):
        super().store_weights(weights)
        self.params = [param.clone() for param in self.params]   # [S] each
        self.flat = None
        self.weights = [None] * len(weights)
        self.gathering = {}                               # bucket -> (Work, its flat [d S])

    def gather_weights(self, b, prefetch=None):
        """Bucket b's weights, whole: every replica's part, (d-1)/d of its bytes come in. The
        next bucket's all-gather starts too, to run meanwhile: two are held at most."""
        for bucket in (b, prefetch):
            if bucket in range(len(self.buckets)) and bucket not in self.gathering:
                flat = self.params[bucket].new_empty(self.lengths[bucket], dtype=self.dtype)
                work = dist.all_gather_single(flat, self.params[bucket].to(self.dtype),   # [d S]
                                              group=self.group, async_op=True)
                self.gathering[bucket] = (work, flat)
        work, flat = self.gathering.pop(b)
        work.wait()
        for i in self.buckets[b]:
            self.weights[i] = self.view(flat, i)

    def release_weights(self, b):
        for i in self.buckets[b]:
            self.weights[i] = None

    def update(self):                   # nothing to all-gather: a bucket is gathered when used
        self.step_optimizer()


def dp_worker(rank, world_size, args):
    device = setup(rank, world_size)
    m = args.micro_batches
    init = init_weights(args.num_layers, args.dim, args.seed)
    replica = make_replica([w.to(device, copy=True) for w in init], None, zero=args.zero,
                           optimizer=args.optimizer, lr=args.lr, bucket_mb=args.bucket_mb,
                           bf16=args.bf16, overlap=args.overlap)
    memory = watch_memory(replica)                      # ZeRO-3's largest moment, for its table
    inputs, targets = (t.to(device) for t in make_batch(args))
    losses = []
    norms = []
    check = SerialCheck(args)
    for step in range(args.steps):
        rows = replica_rows(args.batch_size, rank, world_size,  # the world's ranks are the
                            step=step if args.shuffle else None, seed=args.seed)   # replicas
        loss = dp_step(replica, inputs[rows].chunk(m), targets[rows].chunk(m),   # [B/(d m), D]
                       len(rows) * args.dim, recompute=args.recompute)   # n: this slice's
        if args.check:   # this step's weights and gradients, whole, against serial autograd's
            check.step(full_weights(replica), full_grads(replica))
        if args.clip_grad:
            norms.append(replica.clip(args.clip_grad).item())    # before the update
        replica.update()
        losses.append(global_loss(loss, None))
        if rank == 0:
            log(f"[rank {rank}]", step_line(step, losses, norms, args))
    finish_replicas(replica, memory, args, init, losses, inputs, targets, check, norms)
    cleanup()


def main(argv=None):
    args = parse_args(argv)
    spawn(dp_worker, args.world_size, args, backend=args.backend, timeout_s=args.timeout_s)


# Below the fold: each stage's costs, the bucket layout and the clipping norm; what later steps
# share (training flags and rules, --save, --check); the memory table.
import contextlib, os  # noqa: E401, E402
from typing import NamedTuple  # noqa: E402

from collectives import (Parser, Stop, allocator_peak, check_launch_args,  # noqa: E402
                         gpu_capabilities, pick_backend, positive_float, positive_int)


def make_replica(weights, group, zero=0, **options):   # the ZeRO stage asked for (--zero)
    return [DataParallel, ZeRO1, ZeRO2, ZeRO3][zero](weights, group, **options)


def dp_costs(lengths, dp_size, zero=0, num_micro_batches=1, optimizer="adamw", bf16=False):
    """A replica's costs a step, for buckets of these lengths (ZeRO: padded to d S): collectives
    (kind, bytes of the tensor, times), and what it holds at the step's end {kind: (bytes,
    formula)}: weights 4 P (bf16 2 P, 0 at stage 3), gradients 4 P, AdamW's state 8 P (bf16: +
    the fp32 masters' 4 P), each over d from stage 3, 2, 1 on: 16 P, 8 P + 8 P/d, 4 P + 12 P/d."""
    m = num_micro_batches
    w = 2 if bf16 else 4                      # bytes of a weight as the layers hold it
    each = [("all-reduce", 4, 1)]             # a bucket's: (kind, bytes a parameter, times)
    if zero in (1, 2):
        each = [("reduce-scatter", 4, 1), ("all-gather", w, 1)]
    if zero == 3:                             # a gather for the forward, one for the backward
        each = [("reduce-scatter", 4, m), ("all-gather", w, 2 * m)]
    runs = [(kind, size * n, times) for n in lengths for kind, size, times in each]
    size = {"weights": w * (not bf16 or zero < 3), "gradients": 4,   # bytes a parameter
            "optimizer state": 8 * (optimizer == "adamw") + 4 * bf16}
    split = {"weights": zero == 3 and not bf16, "gradients": zero >= 2, "optimizer state": zero > 0}
    holds = {kind: (size[kind] * sum(lengths) / (dp_size if split[kind] else 1),
                    f"{size[kind]}P{'/d' * split[kind]}" if size[kind] else "0") for kind in size}
    return runs, holds


def in_step_bytes(lengths, num_chunks, dp_size, zero=0, num_micro_batches=1):
    """What a replica of buckets of these lengths holds for a while within a step beyond its
    end's (dp_costs's). ZeRO-2 and 3: a chunk's gradient buckets whole from its W to their
    reduce-scatter, 4 P/v (P: the parameters, v chunks, 3D's), with the parts of the chunks
    exchanged before; ZeRO-2 keeps every chunk's whole until the last micro-batch, and makes no
    part before it."""
    whole = 4 * sum(lengths)                      # the gradient: 4 P
    chunk = whole // num_chunks
    if zero < 2:
        return 0
    if zero == 2 and num_micro_batches > 1:
        return whole - whole // dp_size
    if zero == 3 and num_micro_batches > 1:       # its parts made in the first micro-batch
        return chunk
    return chunk - chunk // dp_size


class BucketLayout(NamedTuple):
    buckets: list      # the layers of each bucket, in order
    bucket_of: dict    # layer -> its bucket
    offset: dict       # layer -> where its elements start in its bucket
    lengths: list      # the elements of each bucket


def make_buckets(numels, bucket_mb, chunk_starts=()):
    """Consecutive layers whose fp32 gradients fit in bucket_mb (0: a layer each). A collective
    costs a fixed time plus bytes / bandwidth: here (gloo, 2 ranks; tests/bench.py collectives)
    an all-reduce of 4 KB or of 1 MB takes 0.5-0.8 ms, 16 MB 11 ms, so one call for many layers
    saves. Cut from the last layer, whose gradient is final first; the first bucket holds 1 MB
    at most, as DDP's, to start early. None crosses the start of a chunk (3D's interleaving)."""
    buckets = [[]]
    cap = min(bucket_mb, 1.0) * 2**20
    size = 0
    for i in reversed(range(len(numels))):
        if buckets[-1] and (size + 4 * numels[i] > cap or i + 1 in chunk_starts):
            buckets.append([])
            cap = bucket_mb * 2**20
            size = 0
        buckets[-1].insert(0, i)
        size += 4 * numels[i]
    buckets.reverse()
    bucket_of = {}
    offset = {}
    for b, layers in enumerate(buckets):
        for i in layers:
            bucket_of[i] = b
            offset[i] = sum(numels[layers[0]:i])
    return BucketLayout(buckets, bucket_of, offset,
                        [sum(numels[i] for i in layers) for layers in buckets])


def clip_grads(grads, max_norm, groups):
    """Scale every gradient by min(1, max_norm / (norm + 1e-6)), as clip_grad_norm_ does. The
    norm is the whole model's: each rank's sum of squares, summed over the groups whose ranks
    hold the other parts: tp (other shards), pp (other stages), dp only where ZeRO shards.
    (A weight every tp rank holds whole, as LayerNorm's, would count once, not tp times.)"""
    squares = torch.stack([g.float().square().sum() for g in grads]).sum()
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(squares, group=group)
    norm = squares.sqrt()
    for g in grads:
        g.mul_((max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm                         # on the device: reading it here would stall a GPU


def make_optimizer(params, optimizer, lr):   # plain SGD, or AdamW with PyTorch's defaults
    return (torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW)(params, lr=lr)


def serial_loss(weights, inputs, targets, bf16=False, halves=False):
    """The model's loss with autograd, and its output: with bf16, the same casts as the
    parallel runs make: bf16 matmuls and activations on fp32 master weights. halves: each
    matmul sums the two halves of its D terms apart, then adds them, as two tensor-parallel
    ranks do: the same maths in another order, which moves only what rounding moves."""
    dtype = torch.bfloat16 if bf16 else torch.float32

    def layer(x, w):
        w, h = w.to(dtype), w.shape[0] // 2
        if halves:
            return F.gelu(x[:, :h] @ w[:h] + x[:, h:] @ w[h:])
        return F.gelu(x @ w)
    out = functools.reduce(layer, weights, inputs.to(dtype))
    return F.mse_loss(out.float(), targets), out.float()


def full_weights(replica):   # every layer's fp32 weight (--bf16: its master), whole, as copies
    return whole(replica, replica.params)


def full_grads(replica):     # the averaged gradients, whole
    return whole(replica, replica.grads())


def whole(replica, parts):   # a tensor per layer from the optimizer's parts: ZeRO's all-gathered
    if type(replica) is DataParallel:
        return [part.clone() for part in parts]
    flats = [part.new_empty(n) for part, n in zip(parts, replica.lengths)]
    for flat, part in zip(flats, parts):
        dist.all_gather_single(flat, part.contiguous(), group=replica.group)
    return [replica.view(flats[replica.layout.bucket_of[i]], i) for i in range(len(replica.shapes))]


def memory_held(replica):   # bytes held now, by kind; a view of another tensor counts once
    state = [t for s in replica.optimizer.state.values() for t in s.values() if t.dim()]
    masters = replica.params if replica.params[0].dtype != replica.dtype else []   # bf16's
    gathering = [flat for _, flat in getattr(replica, "gathering", {}).values()]   # ZeRO-3's
    kinds = {"weights": [replica.weights, getattr(replica, "flat", 0), replica.params *
                         (not masters), gathering],
             "gradients": [replica.grad_buckets, getattr(replica, "grad_parts", 0),
                           [part for _, part in getattr(replica, "parts_in_flight", [])]],
             "optimizer state": [state, masters]}
    return {kind: sum({id(t.untyped_storage()): t.untyped_storage().nbytes()   # (the storage
                       for ts in lists if ts for t in ts if t is not None}.values())  # object:
            for kind, lists in kinds.items()}                   # a meta tensor has no address)


class MemoryWatch:
    """The most a replica held at any moment: sampled at each ZeRO-3 gather (where it peaks),
    from outside the replica, for the memory table."""

    def __init__(self, replica):
        self.largest = 0
        self.replica = replica
        gather = replica.gather_weights

        def gather_and_sample(*args, **kwargs):
            gather(*args, **kwargs)
            self.largest = max(self.largest, sum(memory_held(replica).values()))
        replica.gather_weights = gather_and_sample


def watch_memory(replica):   # ZeRO-3's gathers watched; nothing else moves within a step
    if isinstance(replica, ZeRO3):
        return MemoryWatch(replica)
    return None


def show_memory(replica, memory, args, whose):
    now, P = memory_held(replica), sum(replica.lengths)
    want = dp_costs(replica.lengths, replica.dp_size, args.zero, optimizer=args.optimizer,
                    bf16=args.bf16)[1]
    want["total"] = (sum(b for b, _ in want.values()), " + ".join(f for _, f in want.values()))
    print(f"memory held at the end of a step by {whose}: --zero {args.zero}, d={replica.dp_size}, "
          f"P = {P} parameters{' (buckets padded to a multiple of d)' * bool(args.zero)}, "
          f"{'bf16 on fp32 masters (in the optimizer state)' if args.bf16 else 'fp32'}")
    for kind, got in [*now.items(), ("total", sum(now.values()))]:
        print(f"  {kind:<16}{got:>12} bytes   formula {want[kind][1]:<18} = {want[kind][0]:>10.0f}")
    if memory is not None:
        print(f"  largest at any moment of the last step: {memory.largest} bytes, at a bucket's "
              f"gather: the shards, the gradient buckets then, and the buckets held (two at most)")
    if allocator_peak(replica.device) is not None:
        print(f"  the CUDA allocator's peak over the run: {allocator_peak(replica.device)} bytes "
              f"(torch.cuda.max_memory_allocated: activations, the batch and workspace too)")


def finish_replicas(replica, memory, args, init, losses, inputs, targets, check, norms):
    weights = full_weights(replica)   # every rank: the replicas must agree, bit for bit
    drift = replica_drift(weights)
    if dist.get_rank() == 0:
        log("[rank 0]", f"replicas identical after training: {drift == 0.0} (largest "
                        f"difference {drift:g})")
        show_memory(replica, memory, args, "each replica")
        finish_run(args, init, weights, losses, inputs, targets, check, norms,
                   {"replica_max_diff": drift})


def global_loss(loss, group):       # the replicas' mean losses, averaged: the global mean
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=group)
    return loss.item() / dist.get_world_size(group)


def replica_drift(weights, group=None):   # largest |W - rank 0's W|: 0 while replicas agree
    drift = torch.zeros((), device=weights[0].device)
    for w in weights:
        theirs = w.clone()
        dist.broadcast(theirs, src=dist.get_global_rank(group, 0) if group else 0, group=group)
        drift = torch.maximum(drift, (w - theirs).abs().max())
    dist.all_reduce(drift, op=dist.ReduceOp.MAX, group=group)
    return drift.item()


def training_parser(description, dp=False):
    """The flags every training script takes; dp=True adds --zero and --bucket-mb."""
    p = Parser(description=description)
    for flag, kind, default, help in [
            ("--num-layers", positive_int, 8, "layers L of the MLP"),
            ("--dim", positive_int, 64, "width D: every W is D x D"),
            ("--batch-size", positive_int, 32, "global batch B"),
            ("--micro-batches", positive_int, 2, "micro-batches m"),
            ("--steps", positive_int, 30, "optimizer steps"),
            ("--lr", positive_float, 1e-2, "learning rate"),
            ("--seed", int, 0, "weights from seed, teacher from seed+1, inputs from seed+2"),
            ("--save", str, None, "torch.save config, init and final weights (full, layer "
                                  "order), inputs, targets, losses"),
            ("--clip-grad", positive_float, None, "clip the gradient's global 2-norm to this, "
                                                  "as clip_grad_norm_ (off unless given)"),
            *[("--bucket-mb", float, 25.0, "gradients a bucket holds, in MB (the first 1 MB at "
               "most, as DDP's); 0: one layer a bucket")] * dp]:
        p.add_argument(flag, type=kind, default=default, help=help)
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="adamw",
                   help="plain SGD, or AdamW with PyTorch's defaults (SGD shows scale errors)")
    p.add_argument("--check", action="store_true",
                   help="check every step against serial autograd training from the same weights")
    p.add_argument("--recompute", action="store_true", help="keep each micro-batch's input "
                   "alone, and run the forward again in its backward")
    p.add_argument("--bf16", action="store_true", help="compute in bf16 on fp32 master weights, "
                   "gradients and optimizer")
    if dp:
        p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0,
                       help="ZeRO stage over the data-parallel group: 1 shards the optimizer "
                            "state, 2 the gradients too, 3 the weights too (FSDP)")
    return p


def check_training_args(parser, args, world_size, replicas=1, replicas_flag=None,
                        ranks_flag="--world-size"):
    """The rules every training script shares, after its own, and the memory the ranks need:
    the model and teacher as drawn (2 L D^2 floats), weights, gradients and AdamW state (or
    ZeRO's share), the batch (2 B D), and every layer's stash for the batch (2 L B D)."""
    L, D, B, m = args.num_layers, args.dim, args.batch_size, args.micro_batches
    by, rows = f"{replicas_flag} x " if replicas_flag else "", B // replicas
    bucket_mb = getattr(args, "bucket_mb", 0)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    gpus = gpu_capabilities() if args.bf16 and pick_backend(local_ranks, args.backend) == "nccl" \
        else []      # (major, minor) of each GPU, asked of NVML: no CUDA starts here
    old = [(i, f"{major}.{minor}") for i, (major, minor) in enumerate(gpus) if major < 8]
    oldest = old[0] if old else ("", "")
    parser.refuse([
        (not 0 <= args.seed < 2**32, f"--seed {args.seed}: expected 0 to {2**32 - 1}"),
        (args.lr > 3.4e38, f"--lr {args.lr:g}: more than a float32 holds (3.4e38)"),
        (torch.tensor(args.lr).item() == 0, f"--lr {args.lr:g}: 0 in float32, which trains "
                                            f"nothing (the smallest is 1.4e-45)"),
        (args.save is not None and not writable(args.save),
         f"--save {args.save!r}: cannot write a file there"),
        (m > rows, f"--micro-batches {m}: more micro-batches than rows per replica ({rows})"),
        (B % (replicas * m), f"--batch-size {B} is not divisible by {by}--micro-batches "
                             f"({replicas * m})"),
        (not 0 <= bucket_mb <= 1e6, f"--bucket-mb {bucket_mb:g}: expected 0 to 1e6"),
        (old, f"--bf16: GPU {oldest[0]} has compute capability {oldest[1]} ({len(old)} of "
              f"{len(gpus)} GPUs here are older than 8.0, Ampere); bf16 needs 8.0 or newer, and "
              f"below that it is only emulated: drop --bf16")])
    held = dp_costs([L * D * D], replicas, zero=getattr(args, "zero", 0))[1]
    state = sum(size for size, _ in held.values())
    check_launch_args(parser, args, world_size, ranks_flag,
                      4 * (2 * L * D * D + 2 * B * D + 2 * L * B * D) + state,
                      f"--num-layers {L} --dim {D} --batch-size {B}")


def writable(path):   # a regular file this process can write, or make: tried, not asked
    try:
        if os.path.exists(path):            # not a folder, a pipe or a device
            return os.path.isfile(path) and open(path, "ab").close() is None
        open(path, "ab").close()
        return os.remove(path) is None
    except OSError:                         # also: a missing folder, '' (no such file)
        return False


def parse_args(argv=None):
    parser = training_parser("Data parallelism: replicas on slices of the batch.", dp=True)
    parser.add_argument("--world-size", type=positive_int, default=4, help="replicas d")
    parser.add_argument("--overlap", action="store_true",
                        help="start each bucket's exchange as soon as its gradients are final")
    parser.add_argument("--shuffle", action="store_true",
                        help="reshuffle each replica's rows every step, from a shared seed")
    args = parser.parse_args(argv)
    check_training_args(parser, args, args.world_size, args.world_size, "--world-size")
    return args


def step_line(step, losses, norms, args):   # a step's loss, and the norm it was clipped from
    clipped = " (clipped)" if norms and norms[-1] > args.clip_grad else ""
    return f"step {step:3d}  loss {losses[-1]:.6f}" + (f"  grad norm {norms[-1]:.4f}{clipped}"
                                                        if norms else "")


def finish_run(args, init, final, losses, inputs, targets, check, norms=(), extra=None):
    """On rank 0, with full matrices: --save (into a file beside it, renamed onto it: a disk
    that fills up ends the run in one line, and what was there stays), then a loss that is
    not finite ends the run, then --check."""
    if args.save:
        try:
            torch.save({"config": vars(args), "init_weights": [w.float().cpu() for w in init],
                        "final_weights": [w.detach().float().cpu() for w in final],
                        "inputs": inputs.cpu(), "targets": targets.cpu(), "losses": list(losses),
                        "grad_norms": list(norms), **(extra or {})}, f"{args.save}.partial")
            os.replace(f"{args.save}.partial", args.save)
        except (OSError, RuntimeError) as e:   # torch's writer: RuntimeError on a short write
            with contextlib.suppress(OSError):
                os.remove(f"{args.save}.partial")
            raise Stop(f"--save {args.save}: the trained weights could not be written ("
                       f"{str(e).splitlines()[0][:80]}); free some space, or choose another path")
        print(f"saved {args.save}", flush=True)
    print(f"loss {losses[0]:.6f} -> {losses[-1]:.6f} over {len(losses)} steps", flush=True)
    if args.clip_grad:
        print(f"--clip-grad {args.clip_grad:g}: the gradient's norm was clipped on "
              f"{sum(norm > args.clip_grad for norm in norms)} of {len(norms)} steps", flush=True)
    if not all(map(math.isfinite, losses)):
        step = [math.isfinite(loss) for loss in losses].index(False)
        raise Stop(f"the loss stopped being finite at step {step}: --lr {args.lr:g} is too large "
                   f"for this model; try a smaller one")
    if args.check:
        check.finish(final, losses, norms)


class SerialCheck:
    """--check: every step of this run against serial autograd training from the same weights.

    If each step equals serial training's from the same start, the whole run does, by
    induction, and one step holds one step's rounding, at any number of steps; two whole runs
    drift apart (chaotic training; AdamW's eps). At step t, from this run's W_t (--bf16: the
    fp32 masters), each figure and its tolerance:
      gradients  autograd's at W_t against this run's, each layer's difference over its terms
                 (|x|^T |dz| for the residual's terms 2 (|a| + |y|) / n: near convergence the
                 gradient is a small sum of larger terms), within 1e-4 (bf16: bf16_tolerance)
                 plus ten times what the same step summed in another order (halves) moves;
      losses     within tol of L + 2 r sqrt(L) + tol r^2, r = rms(a): how far an output that
                 agrees to tol moves the mean squared error L, and summing L in another order;
      weights    the optimizer's step from W_t with this run's gradients (clipped as it clips)
                 against its W_t+1: the same arithmetic on the same numbers, 2^-20.
    Only rank 0 computes; step() takes what every rank gathered (None off rank 0)."""

    def __init__(self, args):
        self.args, self.on = args, args.check and (not dist.is_initialized() or
                                                   dist.get_rank() == 0)
        self.worst = {}        # figure -> (difference / tolerance, difference, tolerance, where)
        self.losses, self.norms = [], []
        if self.on:
            self.inputs, self.targets = make_batch(args)
            self.weights = [w.requires_grad_() for w in init_weights(args.num_layers, args.dim,
                                                                     args.seed)]
            self.optimizer = make_optimizer(self.weights, args.optimizer, args.lr)
            self.expected = [w.detach().clone() for w in self.weights]

    def step(self, weights, grads):
        if not self.on:
            return
        weights, grads = [w.float().cpu() for w in weights], [g.float().cpu() for g in grads]
        self.compare("weights after an update", weights, self.expected,
                     [w.abs().max() for w in self.expected])
        with torch.no_grad():
            for mine, theirs in zip(self.weights, weights):
                mine.copy_(theirs)
        self.optimizer.zero_grad()
        loss, out = serial_loss(self.weights, self.inputs, self.targets, self.args.bf16)
        loss.backward()
        self.losses.append((loss.item(), out.square().mean().sqrt().item()))
        want, batch = [w.grad.clone() for w in self.weights], (self.inputs, self.targets)
        scales = [torch.maximum(terms, g.abs().max()) for terms, g in
                  zip(gradient_terms(self.weights, *batch, self.args.bf16), want)]
        self.optimizer.zero_grad()   # the same step, summed in another order
        serial_loss(self.weights, *batch, self.args.bf16, halves=True)[0].backward()
        spreads = [(w.grad - g).abs().max() / scale.clamp_min(1e-30)
                   for w, g, scale in zip(self.weights, want, scales)]
        self.compare("gradients", grads, want, scales, spreads)
        with torch.no_grad():   # the optimizer's step on this run's gradients
            for mine, theirs in zip(self.weights, grads):
                mine.grad.copy_(theirs)
        if self.args.clip_grad:   # the norm moves by at most the gradients' differences' norm
            room = sum(g.numel() * ((self.tolerance("gradients", i) + 10 * spread) * scale)**2
                       for i, (g, scale, spread) in enumerate(zip(grads, scales, spreads))).sqrt()
            norm = torch.nn.utils.clip_grad_norm_(self.weights, self.args.clip_grad)
            self.norms.append((norm.item(), room.item()))
        self.optimizer.step()
        self.expected = [w.detach().clone() for w in self.weights]

    def compare(self, figure, got, want, scales, spreads=None):   # each layer: difference / scale
        for layer, (a, b, scale) in enumerate(zip(got, want, scales)):
            difference = ((a - b).abs().max() / scale.clamp_min(1e-30)).item()
            tolerance = self.tolerance(figure, layer)
            if spreads is not None:
                tolerance += 10 * spreads[layer].item()
            self.note(figure, difference, tolerance, f" (layer {layer})")

    def note(self, figure, difference, tolerance, where=""):   # the worst: the largest share
        entry = (difference / tolerance, difference, tolerance, where)
        self.worst[figure] = max(self.worst.get(figure, (0.0, 0.0, tolerance, "")), entry,
                                 key=lambda e: (e[0] != e[0], e[0]))           # a nan wins

    def tolerance(self, figure, layer=None):
        """float32: summation order moves a result by ~1e-7, a bug by far more: 1e-4; one
        optimizer step on the same numbers, a few roundings: 2^-20. bf16: bf16_tolerance() for
        a layer's gradient, which grows with the layers above it; the loss's output has come
        through the forward of every layer."""
        config, L = vars(self.args), self.args.num_layers
        if figure == "weights after an update":
            return 2**-20
        if not self.args.bf16:
            return CHECK_TOLERANCE
        tp_size = config.get("tp") or (config["world_size"] if "tp_style" in config else 1)
        if figure == "losses" or layer is None:
            return bf16_tolerance(tp_size, layers_above=L - 1)
        return bf16_tolerance(tp_size, layers_above=L - 1 - layer)

    def finish(self, final, losses, norms):
        if not self.on:
            return
        self.compare("weights after an update", [w.detach().float().cpu() for w in final],
                     self.expected, [w.abs().max() for w in self.expected])
        tolerance = self.tolerance("losses")
        for step, (ours, (theirs, rms)) in enumerate(zip(losses, self.losses)):
            scale = theirs + 2 * rms * math.sqrt(theirs) + tolerance * rms**2
            self.note("losses", abs(ours - theirs) / scale, tolerance, f" (step {step})")
        for step, (ours, (theirs, room)) in enumerate(zip(norms, self.norms)):
            self.note("gradients", abs(ours - theirs) / room, 1.0, f" (the norm, step {step})")
        print(f"check against serial autograd training, each step from this run's weights "
              f"({self.args.optimizer}, {len(losses)} steps):", flush=True)
        for figure in ("gradients", "losses", "weights after an update"):
            share, difference, tolerance, where = self.worst[figure]
            print(f"  {figure:<23} largest difference {difference:.2e}  tolerance {tolerance:.1e}"
                  f"  {'ok' if share <= 1 else 'FAILED'}{where}", flush=True)     # nan: FAILED
        print("  (of each layer's terms |x|^T |dz|; of L + 2 r sqrt(L) + tol r^2, r = rms(a); of "
              "its largest)", flush=True)
        if not all(share <= 1 for share, *_ in self.worst.values()):
            raise Stop("check FAILED: this run differs from serial autograd training (see above)")
        print("check OK", flush=True)


def gradient_terms(weights, inputs, targets, bf16=False):
    """Each layer's scale for its gradient's rounding: the largest element of |x|^T |dz|, the
    magnitudes of the rows' terms that dW = x^T dz sums, where dz comes down from the
    residual's terms, 2 (|a| + |y|) / n, in place of 2 (a - y) / n."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    x, stashes = inputs.to(dtype), []
    with torch.no_grad():
        for w in weights:
            z = x @ w.to(dtype)
            stashes.append((x.float(), z.float(), w.float()))
            x = F.gelu(z)
        g, terms = 2 * (x.float().abs() + targets.abs()) / targets.numel(), []
        for x, z, w in reversed(stashes):
            dz = torch.ops.aten.gelu_backward(g, z)
            terms.append((x.abs().T @ dz.abs()).max())
            g = dz @ w.T
    return terms[::-1]


CHECK_TOLERANCE = 1e-4   # float32 summation order moves results by ~1e-7; a bug moves them far more


def bf16_tolerance(tp_size=1, layers_above=0):
    """bf16 keeps 8 significant bits: a rounding moves a value by up to 2^-8 of it. A layer's
    dW: the reference rounds it to bf16 where we sum the products in fp32, and both sum in
    other orders: 4 roundings apart; an all-reduce over tp ranks of bf16 partial sums rounds
    tp - 1 more times, forward (Megatron's g) and backward. Its g has come down through the
    backward of every layer above, each rounding as often again: (1 + layers above) times.
    (A doubled gradient differs by 1: caught at the last layers, whatever the depth.)"""
    return 2**-8 * (4 + 2 * (tp_size - 1)) * (1 + layers_above)


if __name__ == "__main__":
    run_main(main)
