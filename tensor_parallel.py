"""Step 3: tensor parallelism. Every layer is split across the ranks by columns.

    python tensor_parallel.py                               # 4 ranks share each layer
    python tensor_parallel.py --world-size 2 --check
    python tensor_parallel.py --embedding                   # the vocab-parallel embedding
    python tensor_parallel.py --bench --world-size 2        # ours against ColwiseParallel and serial
    torchrun --nproc-per-node 4 tensor_parallel.py

The lecture's column-parallel layer: rank t of T holds the columns W_t of every
W (D x D/T), computes its slice of the activations, and an all-gather rebuilds the
full activation for the next layer. The lecture stops at the forward pass
("Backward pass: homework exercise"). Here is the backward, derived by hand:

    forward:   z_t = x W_t          a_t = gelu(z_t)        a = [a_0 | a_1 | ... ]  (all-gather)
    backward:  g_t = g[:, cols_t]   (the all-gather's backward is a slice: g is the same on every rank)
               dz_t = g_t * gelu'(z_t)
               dW_t = x^T dz_t      (this rank's columns of dW; no communication)
               dx   = sum_t dz_t W_t^T  (each rank holds one term: all-reduce)

The same file shows Megatron's vocabulary-parallel embedding, which splits a table
by rows instead: a masked lookup, then an all-reduce.
"""
from fractions import Fraction

import warnings

warnings.filterwarnings("ignore", "Failed to initialize NumPy")  # torch's import warns without numpy; nothing here needs it
import torch
import torch.distributed as dist
import torch.nn.functional as F

from collectives import (CommCounter, check_and_race, check_launch_args, cleanup, end_race, log, positive_int,
                         print_race, report_comm, run_main, setup, spawn, spawn_returning)
from data_parallel import (CHECK_TOLERANCE, as_module, bench_sizes, check_divides, check_training_args, finish_run,
                           init_weights, layer_backward, layer_forward, make_batch, make_optimizer, mse_loss,
                           serial_side, sgd_side, training_parser)


# ----------------------------------------------------------------------------------
# The column-parallel layer with an all-gather, forward and backward
# ----------------------------------------------------------------------------------

def shard_columns(w, tp_rank, tp_size):
    """Rank t's columns of a full matrix: W[:, t D/T : (t+1) D/T], as a copy.

    A copy even when T = 1 (where .contiguous() would return W itself): the optimizer
    updates the shard in place, and the full matrix must stay the initial one."""
    cols = w.shape[1] // tp_size
    return w[:, tp_rank * cols:(tp_rank + 1) * cols].clone(memory_format=torch.contiguous_format)


def all_gather_columns(a_t, group=None):
    """[b, n] on each of T ranks -> [b, T n] on all: the shards side by side, in rank order.

    All-gather in forward, slice in backward."""
    tp_size = dist.get_world_size(group)
    if tp_size == 1:
        return a_t
    b, n = a_t.shape
    stacked = torch.empty(tp_size * b, n, dtype=a_t.dtype, device=a_t.device)  # [T b, n]: rank t's rows t b .. (t+1) b
    dist.all_gather_single(stacked, a_t.contiguous(), group=group)
    return stacked.view(tp_size, b, n).permute(1, 0, 2).reshape(b, tp_size * n)  # [b, T n]


def column_forward(x, w_t, group=None):
    """x [b, D] (the same on every rank) -> a [b, D] (the same on every rank)."""
    a_t, stash = layer_forward(x, w_t)   # z_t = x W_t, a_t = gelu(z_t)   [b, D/T]
    return all_gather_columns(a_t, group), stash


def column_backward(g, stash, w_t, group=None, need_dx=True):
    """g = dL/da [b, D], the same on every rank -> (dx [b, D], dW_t [D, D/T]).

    need_dx=False skips dx (None), and its all-reduce, where nobody uses it: the
    model's first layer."""
    tp_rank, cols = dist.get_rank(group), w_t.shape[1]
    g_t = g[:, tp_rank * cols:(tp_rank + 1) * cols]    # backward of all-gather: slice   [b, D/T]
    dx, dw_t = layer_backward(g_t, stash, w_t, need_dx)   # dW_t = x^T dz_t [D, D/T];  dz_t W_t^T [b, D]
    if need_dx and dist.get_world_size(group) > 1:
        dist.all_reduce(dx, group=group)               # dx = sum_t dz_t W_t^T
    return dx, dw_t


def tp_comm_formula(num_layers, num_dx, act_bytes, num_micro_batches, tp_size):
    """Bytes one TP rank sends per step (--count-comm), A = act_bytes of one [b, D]
    activation: per layer and micro-batch the forward's all-gather, (t-1)/t x A; per
    layer that needs dx (num_dx: all but the model's first) the backward's all-reduce,
    2(t-1)/t x A."""
    t, m, A = tp_size, num_micro_batches, act_bytes
    return {("tp", "all-gather"): (Fraction(num_layers * m * (t - 1) * A, t),
                                   f"{num_layers} layers x {m} mb x ({t}-1)/{t} x {A}"),
            ("tp", "all-reduce"): (Fraction(num_dx * m * 2 * (t - 1) * A, t),
                                   f"{num_dx} layers x {m} mb x 2({t}-1)/{t} x {A}")}


def megatron_comparison(num_layers, act_bytes, num_micro_batches, tp_size):
    """One paragraph: this layer's TP bytes against Megatron's column-then-row pairs.

    Per pair of layers and micro-batch, with A the bytes of one activation [b, D]:
      all-gather layers: 2 all-gathers (forward) + 2 all-reduces of dx (backward)
                         = 2 (t-1)/t A + 4 (t-1)/t A = 6 (t-1)/t A
      Megatron:          the row layer's all-reduce of z (forward) + the column
                         layer's all-reduce of dx (backward) = 4 (t-1)/t A
    Megatron's column layer leaves its output sharded, and the row layer takes that
    shard as it is; GELU is elementwise, so it runs on the shard in between.
    Over the model both skip the all-reduce of the model input's dx.
    """
    L, A, m, t = num_layers, act_bytes, num_micro_batches, tp_size
    if t == 1 or L % 2:
        return "Megatron comparison: needs --tp > 1 and an even number of layers (pairs)."
    ours = Fraction(m * (t - 1) * A * (L + 2 * (L - 1)), t)        # L all-gathers, L-1 all-reduces
    megatron = Fraction(m * (t - 1) * A * 2 * (L // 2 + L // 2 - 1), t)   # L/2 forward, L/2-1 backward
    return (f"Megatron's column-then-row pairs would move fewer bytes. Per pair of layers and micro-batch "
            f"the all-gather layer sends 2 x (t-1)/t A in forward and 2 x 2(t-1)/t A in backward, 6(t-1)/t A, "
            f"where Megatron sends one all-reduce of the activation each way, 4(t-1)/t A: 1.5 x. For this run "
            f"(L={L}, t={t}, m={m}, A={A} bytes; neither all-reduces the model input's dx), per TP rank and "
            f"step over the model's layers: {float(ours):.0f} bytes against {float(megatron):.0f}, "
            f"{float(ours / megatron):.3f} x.")


# ----------------------------------------------------------------------------------
# Training with it
# ----------------------------------------------------------------------------------

def tp_step(shards, xs, ys, n, group=None):
    """One step's gradients from the column-parallel blocks: each micro-batch (xs, ys)
    forward through every layer and back, dW_t summed over them. Returns (grads, loss)."""
    grads = [torch.zeros_like(w) for w in shards]
    loss = torch.zeros((), device=shards[0].device)
    for x, y in zip(xs, ys):
        stashes = []
        for w_t in shards:
            x, stash = column_forward(x, w_t, group)
            stashes.append(stash)
        mb_loss, g = mse_loss(x, y, n)        # identical on every rank: the output is replicated
        loss += mb_loss
        for i in reversed(range(len(shards))):
            g, dw_t = column_backward(g, stashes[i], shards[i], group, need_dx=i > 0)
            grads[i] += dw_t
    return grads, loss


def tp_worker(rank, world_size, args):
    device = setup(rank, world_size)
    tag = f"[rank {rank}]"
    full = init_weights(args.num_layers, args.dim, args.seed)      # drawn whole, then sliced
    shards = [shard_columns(w, rank, world_size).to(device) for w in full]   # L x [D, D/T]
    inputs, targets = (t.to(device) for t in make_batch(args))     # every rank sees the whole batch
    optimizer = make_optimizer(shards, args)
    n = args.batch_size * args.dim
    comm = CommCounter({"tp": None}, enabled=args.count_comm)
    losses = []
    for step in range(args.steps):
        with comm.step():                         # --count-comm counts what this sends
            grads, loss = tp_step(shards, inputs.chunk(args.micro_batches), targets.chunk(args.micro_batches), n)
        loss = loss.item()
        for w_t, grad in zip(shards, grads):
            w_t.grad = grad
        optimizer.step()
        losses.append(loss)
        if rank == 0:
            log(tag, f"step {step:3d}  loss {loss:.6f}")
    if args.count_comm:
        L, m = args.num_layers, args.micro_batches
        act_bytes = args.batch_size // m * args.dim * inputs.element_size()   # one micro-batch's [B/m, D]
        report_comm(comm, tp_comm_formula(L, L - 1, act_bytes, m, world_size),
                    megatron_comparison(L, act_bytes, m, world_size))
    final = [all_gather_columns(w_t) for w_t in shards]   # gather the shards back into full matrices
    if rank == 0:
        finish_run(args, full, final, losses, inputs, targets)
    cleanup()


# ----------------------------------------------------------------------------------
# The vocabulary-parallel embedding (Megatron's VocabParallelEmbedding)
# ----------------------------------------------------------------------------------

def vocab_range(vocab_size, tp_rank, tp_size):
    """Rows [start, end) of the table that rank t holds; the last ranks get one fewer
    when T does not divide the vocabulary."""
    sizes = [len(part) for part in torch.arange(vocab_size).tensor_split(tp_size)]
    start = sum(sizes[:tp_rank])
    return start, start + sizes[tp_rank]


def embedding_forward(tokens, table_t, start, group=None):
    """tokens [b, s] -> vectors [b, s, E]. Each rank looks up the tokens it owns, writes
    zeros for the rest, and an all-reduce adds the pieces: every token has one owner."""
    outside = (tokens < start) | (tokens >= start + table_t.shape[0])
    local = (tokens - start).masked_fill(outside, 0)            # any valid row; masked below
    out = table_t[local].masked_fill(outside.unsqueeze(-1), 0.0)   # [b, s, E]
    if dist.get_world_size(group) > 1:
        dist.all_reduce(out, group=group)
    return out, (local, outside)


def embedding_backward(g, stash, rows):
    """g = dL/dout [b, s, E], the same on every rank (the all-reduce's backward is the
    identity for a replicated upstream gradient) -> d table_t [rows, E]. Only this
    rank's tokens contribute; a repeated token adds up its gradients."""
    local, outside = stash
    g = g.masked_fill(outside.unsqueeze(-1), 0.0)
    d_table = torch.zeros(rows, g.shape[-1], dtype=g.dtype, device=g.device)
    return d_table.index_add_(0, local.reshape(-1), g.reshape(-1, g.shape[-1]))


def embedding_worker(rank, world_size, vocab_size, dim):
    """Show the split table on every rank and compare with nn.Embedding."""
    device = setup(rank, world_size)
    tag = f"[rank {rank}]"
    table = torch.randn(vocab_size, dim, generator=torch.Generator().manual_seed(0))
    start, end = vocab_range(vocab_size, rank, world_size)
    table_t = table[start:end].to(device)
    # Every rank looks up the same tokens: the first and last row of every shard, and
    # one token three times over (cut to the row's length: one rank has only 2 edges).
    edges = [row for r in range(world_size) for row in (vocab_range(vocab_size, r, world_size)[0],
                                                          vocab_range(vocab_size, r, world_size)[1] - 1)]
    repeated = [min(1, vocab_size - 1)] * 3
    tokens = torch.tensor([edges, (repeated + edges[3:])[:len(edges)]], device=device)   # [2, 2T]
    out, stash = embedding_forward(tokens, table_t, start)
    g = torch.arange(out.numel(), dtype=out.dtype, device=device).view_as(out) / out.numel()
    d_table_t = embedding_backward(g, stash, end - start)

    reference = torch.nn.Embedding.from_pretrained(table.clone(), freeze=False)
    ref_out = reference(tokens.cpu())
    ref_out.backward(g.cpu())
    log(tag, f"owns rows [{start}, {end}) of {vocab_size}; tokens {tokens.tolist()}")
    log(tag, f"rows with a gradient here: {(d_table_t.abs().sum(1) > 0).nonzero().flatten().add(start).tolist()}")
    log(tag, f"forward matches nn.Embedding: {torch.allclose(out.cpu(), ref_out)}, "
             f"gradient of my rows matches: {torch.allclose(d_table_t.cpu(), reference.weight.grad[start:end])}")
    cleanup()


# ----------------------------------------------------------------------------------

def main(argv=None):
    parser = training_parser("Tensor parallelism: column-parallel layers with an all-gather.")
    parser.add_argument("--world-size", type=positive_int, default=4, help="ranks sharing each layer; divides --dim")
    parser.add_argument("--embedding", action="store_true", help="show the vocab-parallel embedding instead")
    parser.add_argument("--vocab-size", type=positive_int, default=10, help="rows of the embedding table")
    args = parser.parse_args(argv)
    check_launch_args(parser, args, args.world_size)
    if args.embedding:
        if args.vocab_size < args.world_size:
            parser.error(f"--vocab-size {args.vocab_size} is smaller than --world-size {args.world_size}")
        spawn(embedding_worker, args.world_size, args.vocab_size, args.dim,
              backend=args.backend, timeout_s=args.timeout_s)
        return
    check_divides(parser, args.dim, "--dim", args.world_size, "--world-size")
    check_divides(parser, args.batch_size, "--batch-size", args.micro_batches, "--micro-batches")
    check_training_args(parser, args)
    if args.bench:
        # Our step against ColwiseParallel's: checked equal, then timed
        print_race(versus_colwise(args))
        return
    spawn(tp_worker, args.world_size, args, backend=args.backend, timeout_s=args.timeout_s)


# ----------------------------------------------------------------------------------
# What PyTorch gives you for this: ColwiseParallel on a DeviceMesh (--bench)
# ----------------------------------------------------------------------------------

def colwise_race(rank, world_size, args):
    device = setup(rank, world_size)
    inputs, targets = (t.to(device) for t in make_batch(args))
    m, n = args.micro_batches, args.batch_size * args.dim
    xs, ys = inputs.chunk(m), targets.chunk(m)                    # the whole batch on every rank
    full = init_weights(args.num_layers, args.dim, args.seed)
    shards = [shard_columns(w, rank, world_size).to(device) for w in full]
    sides = {"ours": tp_side(shards, xs, ys, n, args.lr),
             "ColwiseParallel(output_layouts=Replicate())": colwise_side(as_module(full, device), xs, ys, n, args.lr),
             "serial: our step, whole batch, 1 rank": serial_side(args, device)}
    result = check_and_race(sides, device, args.steps)
    end_race(sides)
    return result


def colwise_side(model, xs, ys, n, lr):
    """PyTorch's TP step with SGD, as (step, state): each nn.Linear made ColwiseParallel
    over a mesh of every rank, its output all-gathered (Replicate) like ours. The local
    part of its DTensor weight is W_t^T."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    mesh = init_device_mesh(xs[0].device.type, (dist.get_world_size(),))
    parallelize_module(model, mesh, {str(i): ColwiseParallel(output_layouts=Replicate())
                                     for i in range(0, len(model), 2)})
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)

    def step():
        optimizer.zero_grad()
        for x, y in zip(xs, ys):
            (F.mse_loss(model(x), y, reduction="sum") / n).backward()
        optimizer.step()
    linears = model[::2]
    return step, lambda: ([lin.weight.to_local().T for lin in linears],
                          [lin.weight.grad.to_local().T for lin in linears])


def tp_side(shards, xs, ys, n, lr, group=None):
    """Our TP step with SGD, as (step, state) for check_and_race."""
    return sgd_side(shards, lambda: tp_step(shards, xs, ys, n, group)[0], lr)


def versus_colwise(args):
    """Run the race on args.world_size ranks; return what print_race prints."""
    import torch.distributed.tensor.parallel  # noqa: F401  (~2 s) once here, before the ranks fork
    times, diffs = spawn_returning(colwise_race, args.world_size, args, backend=args.backend, timeout_s=args.timeout_s)
    return dict(title=f"tensor parallel vs torch.distributed.tensor.parallel: {bench_sizes(args, args.world_size)}",
                times=times, diffs=diffs, ratios=[("ours", "ColwiseParallel(output_layouts=Replicate())")],
                world_size=args.world_size, steps=args.steps, tolerance=CHECK_TOLERANCE)


if __name__ == "__main__":
    run_main(main)
