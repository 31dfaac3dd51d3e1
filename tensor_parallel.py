"""Step 3: tensor parallelism. Every layer is split across the ranks.

    python tensor_parallel.py                           # 4 ranks share each layer
    python tensor_parallel.py --world-size 2 --check
    python tensor_parallel.py --tp-style megatron       # Megatron's column-then-row pairs
    python tensor_parallel.py --embedding               # the vocab-parallel embedding
    torchrun --nproc-per-node 4 tensor_parallel.py

The lecture's column-parallel layer: rank t of T holds the columns W_t of every W
[D, D/T], computes its slice of the activations, and an all-gather rebuilds the full
activation for the next layer. The lecture stops at the forward pass ("Backward pass:
homework exercise"). Here is the backward, derived by hand:

    forward    z_t = x W_t          a_t = gelu(z_t)            [b, D/T]
               a = [a_0 | a_1 | ... | a_T-1]                   all-gather  [b, D]
    backward   g_t = g[:, cols_t]   the all-gather's backward is a slice: g is the same
                                    on every rank, so each keeps its own columns
               dz_t = g_t * gelu'(z_t)                         [b, D/T]
               dW_t = x^T dz_t      this rank's columns of dW  [D, D/T], no communication
               dx = sum_t dz_t W_t^T    each rank holds one term: all-reduce  [b, D]

Bytes each rank sends per layer and micro-batch, A for one activation [b, D]: the
all-gather (T-1)/T A forward, the all-reduce of dx 2(T-1)/T A backward. Real systems
(Megatron-LM, torchtitan) pair the layers instead and send a third less: see the
second section. The last shows Megatron's vocabulary-parallel embedding.

--recompute keeps each layer's input alone, as in step 2: z_t = x W_t again in the backward,
with no collective; a Megatron row layer's z again needs g's all-reduce again (tp_costs).

What PyTorch gives you: ColwiseParallel and RowwiseParallel on a DeviceMesh
(tests/bench.py races them against this).
"""
import warnings
from functools import partial
from typing import Callable, NamedTuple
warnings.filterwarnings("ignore", "Failed to initialize NumPy")   # torch warns without numpy
import torch
import torch.distributed as dist
import torch.nn.functional as F

from collectives import cleanup, log, run_main, setup, spawn
from data_parallel import (DataParallel, init_weights, layer_backward, layer_forward, make_batch,
                           mse_loss)


class Block(NamedTuple):   # a layer's pair, as every step runs a layer: step 2's, and three here
    forward: Callable         # (x, w, recompute) -> (a, stash)
    backward: Callable        # (g, stash, w, need_dx) -> (dx, (x, dz))


LAYER = Block(layer_forward, layer_backward)


def gather_forward(x, w_t, recompute=False, group=None):
    """All-gather in forward: x [b, D], the same on every rank -> a [b, D], the same on every
    rank. Each rank sends (T-1)/T x [b, D]."""
    a_t, stash = layer_forward(x, w_t, recompute=recompute)   # z_t = x W_t, a_t = gelu(z_t)
    return all_gather_columns(a_t, group), stash              # [b, D/T] -> [b, D]


def gather_backward(g, stash, w_t, need_dx=True, group=None):
    """Slice in backward, then the all-reduce of dx: g = dL/da [b, D], the same on every rank
    -> (dx [b, D], the (x, dz_t) of dW_t = x^T dz_t). need_dx=False skips dx and its
    all-reduce where nobody needs it: the model's first layer."""
    cols = w_t.shape[1]                       # D/T
    t = dist.get_rank(group)
    g_t = g[:, t * cols:(t + 1) * cols]       # [b, D/T]
    dx, x_dz = layer_backward(g_t, stash, w_t, need_dx=need_dx)   # dz_t = g_t gelu'(z_t)
    if need_dx and dist.get_world_size(group) > 1:
        dist.all_reduce(dx, group=group)      # dx = sum_t dz_t W_t^T   2(T-1)/T x [b, D]
    return dx, x_dz


def all_gather_columns(a_t, group=None):
    """[b, n] on each of T ranks -> [b, T n] on all: the pieces side by side, in rank order."""
    if dist.get_world_size(group) == 1:
        return a_t
    stacked = a_t.new_empty(dist.get_world_size(group) * a_t.shape[0], a_t.shape[1])   # [T b, n]
    dist.all_gather_single(stacked, a_t.contiguous(), group=group)   # rank t's rows t b ..
    return side_by_side(stacked, a_t.shape[0])


def side_by_side(stacked, b):   # [T b, n]: rank t's [b, n] in rows t b .. -> [b, T n]
    T = stacked.shape[0] // b
    n = stacked.shape[1]
    return stacked.view(T, b, n).permute(1, 0, 2).reshape(b, T * n)


def shard_columns(w, tp_rank, tp_size):
    """Rank t's columns of a full matrix, W[:, t D/T : (t+1) D/T], as a copy.

    A copy even when T = 1 (where .contiguous() would return W itself): the optimizer
    updates the shard in place, and the full matrix must stay the initial one."""
    cols = w.shape[1] // tp_size
    return w[:, tp_rank * cols:(tp_rank + 1) * cols].clone(memory_format=torch.contiguous_format)


# Megatron's pairs: a column layer whose output stays sharded, then a row layer.
#
# The column layer (rank t holds W1[:, cols_t]) does not gather its output: GELU is
# elementwise, so it runs on the shard, and the row layer (rank t holds W2[rows_t, :])
# takes that shard as it is, since a W2 = sum_t a_t W2_t:
#
#   forward   x [b, D], the same on every rank               f: the identity
#             a_t = gelu(x W1_t)                             [b, D/T], no communication
#             z = sum_t a_t W2_t                             g: all-reduce  [b, D]
#             a = gelu(z)                                    [b, D], the same on every rank
#   backward  dz = g * gelu'(z)                              the same on every rank (g: identity)
#             dW2_t = a_t^T dz  [D/T, D]    da_t = dz W2_t^T [b, D/T]: no communication
#             dz_t = da_t * gelu'(x W1_t)   dW1_t = x^T dz_t [D, D/T]
#             dx = sum_t dz_t W1_t^T                         f: all-reduce  [b, D]
#
# f and g are conjugates, a forward/backward pair each: f copies in forward and all-reduces in
# backward; g all-reduces in forward and copies in backward. Per pair and micro-batch each rank
# sends 2(T-1)/T A with g in forward and 2(T-1)/T A with f in backward: 4(T-1)/T A, where two
# all-gather layers send 2 x (T-1)/T A + 2 x 2(T-1)/T A = 6(T-1)/T A. Each layer below is its
# forward/backward pair, with its half of f or g inside.

def column_forward(x, w_t, recompute=False, group=None):
    """f in forward, the identity: x, the same on every rank, is every shard's input."""
    return layer_forward(x, w_t, recompute=recompute)   # a_t = gelu(x W_t), sharded [b, D/T]


def column_backward(g_t, stash, w_t, need_dx=True, group=None):
    """f in backward, an all-reduce: dx sums every shard's part, dz_t W_t^T."""
    dx, x_dz = layer_backward(g_t, stash, w_t, need_dx=need_dx)   # dW1_t's (x, dz_t)
    if need_dx and dist.get_world_size(group) > 1:
        dist.all_reduce(dx, group=group)      # dx = sum_t dz_t W1_t^T   2(T-1)/T x [b, D]
    return dx, x_dz


def row_forward(a_t, w_t, recompute=False, group=None):
    """g in forward, an all-reduce: each rank holds one term of z."""
    z = row_z(a_t, w_t, group)
    if recompute:                             # a_t alone kept: the backward makes z again
        return F.gelu(z), (a_t, None)
    return F.gelu(z), (a_t, z)


def row_backward(g, stash, w_t, need_dx=True, group=None):
    """g in backward, the identity: dz is the same on every rank, and da_t = dz W2_t^T is
    this rank's own: step 2's layer backward with no communication at all."""
    a_t, z = stash
    if z is None:                             # --recompute: z again, and g's all-reduce too
        z = row_z(a_t, w_t, group)
    return layer_backward(g, (a_t, z), w_t, need_dx=need_dx)   # dW2_t's (a_t, dz)


def row_z(a_t, w_t, group=None):
    z = a_t @ w_t                             # a_t W2_t, a term of z   [b, D/T] @ [D/T, D]
    if dist.get_world_size(group) > 1:
        dist.all_reduce(z, group=group)       # z = sum_t a_t W2_t       2(T-1)/T x [b, D]
    return z


BLOCKS = {"gather": Block(gather_forward, gather_backward),
          "column": Block(column_forward, column_backward),
          "row": Block(row_forward, row_backward)}


def layer_kinds(num_layers, tp_style):
    """Per layer: "gather" (the all-gather layer above) for every one, or Megatron's pairs
    ("column", "row"), with an odd last layer a "gather" one."""
    if tp_style == "all-gather":
        return ["gather"] * num_layers
    return ["column", "row"] * (num_layers // 2) + ["gather"] * (num_layers % 2)


def tp_blocks(kinds, group=None):
    """Each layer's forward and backward over group: what tp_step runs, and 3D's stages."""
    return [Block(partial(BLOCKS[kind].forward, group=group),
                  partial(BLOCKS[kind].backward, group=group)) for kind in kinds]


def tp_costs(kinds, act_bytes, num_micro_batches=1, first_stage=True, recompute=False):
    """A tp rank's collectives a step, (kind, bytes of the tensor, times), A = act_bytes for one
    activation [b, D]: each micro-batch, an all-gather layer all-gathers its A forward and
    all-reduces its dx backward; Megatron's column layer all-reduces dx (f), its row layer z
    (g), and with --recompute z again. The model's first layer needs no dx."""
    m = num_micro_batches
    reduces = len(kinds) - first_stage + kinds.count("row") * recompute   # dx, or z
    return [("all-gather", act_bytes, kinds.count("gather") * m),
            ("all-reduce", act_bytes, reduces * m)]


def tp_step(replica, blocks, xs, ys, n, recompute=False):
    """One step of the model with every layer split over the ranks: each layer's forward and
    backward pair above, with its collective; dW_t = x^T dz_t summed into step 2's replica, a
    data-parallel group of one here."""
    loss = torch.zeros((), device=replica.device)
    replica.begin_step()
    for x, y in zip(xs, ys):                  # the whole micro-batch on every rank  [b, D]
        a = x.to(replica.dtype)
        stashes = []
        for block, w_t in zip(blocks, replica.weights):
            a, stash = block.forward(a, w_t, recompute=recompute)
            stashes.append(stash)
        micro_batch_loss, g = mse_loss(a, y, n)    # a, and so the loss, on every rank
        loss += micro_batch_loss
        for i in reversed(range(len(blocks))):
            g, (x_i, dz) = blocks[i].backward(g, stashes.pop(), replica.weights[i], need_dx=i > 0)
            replica.add_grad(i, x_i, dz)      # dW_t = x^T dz_t: this rank's part of dW
    replica.average()                         # a group of one: nothing to exchange, / 1
    return loss


def shard(w, kind, tp_rank, tp_size):
    """Rank t's part of a full matrix, as a copy: its rows W[t D/T : (t+1) D/T, :] for a row
    layer, else its columns."""
    if kind == "row":
        rows = w.shape[0] // tp_size
        return w[tp_rank * rows:(tp_rank + 1) * rows].clone()
    return shard_columns(w, tp_rank, tp_size)


def unshard(w_t, kind, group=None):
    """The full matrix back from every rank's part: rows stacked, or columns side by side."""
    if kind != "row":
        return all_gather_columns(w_t, group)
    stacked = w_t.new_empty(dist.get_world_size(group) * w_t.shape[0], w_t.shape[1])  # [D, D]
    dist.all_gather_single(stacked, w_t.contiguous(), group=group)
    return stacked


def tp_worker(rank, world_size, args):
    device = setup(rank, world_size)
    tp_rank = rank
    tp_size = world_size
    kinds = layer_kinds(args.num_layers, args.tp_style)
    full = init_weights(args.num_layers, args.dim, args.seed)              # drawn whole, then cut
    shards = [shard(w, k, tp_rank, tp_size).to(device) for w, k in zip(full, kinds)]   # [D, D/T]
    inputs, targets = (t.to(device) for t in make_batch(args))             # all of it, every rank
    # The shards live in step 2's replica over a dp group of one: buckets, optimizer, no exchange.
    replica = DataParallel(shards, dist.new_subgroups(1)[0], optimizer=args.optimizer, lr=args.lr,
                           bf16=args.bf16)
    blocks = tp_blocks(kinds)                 # over the world: every rank shares every layer
    n = args.batch_size * args.dim
    m = args.micro_batches
    losses = []
    norms = []
    check = SerialCheck(args)
    if rank == 0:
        print(f"tensor parallel over {tp_size} ranks: {describe(kinds)}", flush=True)
    for step in range(args.steps):
        loss = tp_step(replica, blocks, inputs.chunk(m), targets.chunk(m), n,
                       recompute=args.recompute)
        if args.check:   # this step's weights and gradients, whole, against serial autograd's
            check.step([unshard(w_t, k) for w_t, k in zip(full_weights(replica), kinds)],
                       [unshard(g_t, k) for g_t, k in zip(full_grads(replica), kinds)])
        if args.clip_grad:     # the norm's squares summed over the shards
            norms.append(replica.clip(args.clip_grad, [dist.group.WORLD]).item())
        replica.update()
        losses.append(loss.item())
        if rank == 0:
            log(f"[rank {rank}]", step_line(step, losses, norms, args))
    final = [unshard(w_t, k) for w_t, k in zip(full_weights(replica), kinds)]   # put together
    if rank == 0:
        finish_run(args, full, final, losses, inputs, targets, check, norms)
    cleanup()
# The vocabulary-parallel embedding (Megatron's VocabParallelEmbedding)

def vocab_range(vocab_size, tp_rank, tp_size):
    """Rows [start, end) of the table that rank t holds; when T does not divide the
    vocabulary, the last ranks hold one row fewer."""
    sizes = [len(part) for part in torch.arange(vocab_size).tensor_split(tp_size)]
    start = sum(sizes[:tp_rank])
    return start, start + sizes[tp_rank]


def embedding_forward(tokens, table_t, start, group=None):
    """tokens [b, s] -> vectors [b, s, E]. Each rank looks up the tokens it owns, writes
    zeros for the rest, and an all-reduce adds the pieces: every token has one owner."""
    outside = (tokens < start) | (tokens >= start + table_t.shape[0])
    local = (tokens - start).masked_fill(outside, 0)               # any valid row; masked below
    out = table_t[local].masked_fill(outside.unsqueeze(-1), 0.0)   # [b, s, E]
    if dist.get_world_size(group) > 1:
        dist.all_reduce(out, group=group)
    return out, (local, outside)


def embedding_backward(g, stash, rows):
    """g = dL/dout [b, s, E], the same on every rank (the all-reduce's backward is the
    identity when the upstream gradient is replicated) -> d table_t [rows, E]. Only this
    rank's tokens contribute, and a repeated token adds up its gradients."""
    local, outside = stash
    g = g.masked_fill(outside.unsqueeze(-1), 0.0)
    d_table = torch.zeros(rows, g.shape[-1], dtype=g.dtype, device=g.device)
    return d_table.index_add_(0, local.reshape(-1), g.reshape(-1, g.shape[-1]))


def embedding_worker(rank, world_size, vocab_size, dim):
    """Split a table over the ranks, look up tokens at every shard's edges, and compare
    the output and the gradient with nn.Embedding's. The ranks print in turn."""
    device = setup(rank, world_size)
    tp_rank = rank
    tp_size = world_size
    table = torch.randn(vocab_size, dim, generator=torch.Generator().manual_seed(0))
    start, end = vocab_range(vocab_size, tp_rank, tp_size)
    # Every rank looks up the same tokens: the first and last row of every shard, and one
    # token three times over (cut to the row's length: one rank may hold a single row).
    edges = [row for t in range(tp_size) for row in (vocab_range(vocab_size, t, tp_size)[0],
                                                      vocab_range(vocab_size, t, tp_size)[1] - 1)]
    repeated = [min(1, vocab_size - 1)] * 3
    tokens = torch.tensor([edges, (repeated + edges[3:])[:len(edges)]], device=device)   # [2, 2T]
    out, stash = embedding_forward(tokens, table[start:end].to(device), start)
    g = torch.arange(out.numel(), dtype=out.dtype, device=device).view_as(out) / out.numel()
    d_table_t = embedding_backward(g, stash, end - start)

    reference = torch.nn.Embedding.from_pretrained(table.clone(), freeze=False)
    ref_out = reference(tokens.cpu())
    ref_out.backward(g.cpu())
    rows_with_grad = (d_table_t.abs().sum(1) > 0).nonzero().flatten().add(start).tolist()
    same_out = torch.allclose(out.cpu(), ref_out)
    same_grad = torch.allclose(d_table_t.cpu(), reference.weight.grad[start:end])
    if rank == 0:
        print(f"a table [{vocab_size}, {dim}], its rows split over {tp_size} ranks", flush=True)
    for turn in range(tp_size):
        dist.barrier()
        if turn == tp_rank:
            log(f"[rank {rank}]", f"owns rows [{start}, {end}); tokens {tokens.tolist()}")
            log(f"[rank {rank}]", f"rows with a gradient here: {rows_with_grad}")
            log(f"[rank {rank}]", f"forward matches nn.Embedding: {same_out}, "
                f"gradient of my rows matches: {same_grad}")
    cleanup()


def main(argv=None):
    args = parse_args(argv)
    if args.embedding:   # the vocab-parallel embedding, against nn.Embedding
        spawn(embedding_worker, args.world_size, args.vocab_size, args.dim, backend=args.backend,
              timeout_s=args.timeout_s)
    else:                # training with column-parallel layers
        spawn(tp_worker, args.world_size, args, backend=args.backend, timeout_s=args.timeout_s)


# Below the fold: the command line and its rules, and what the run says it ran. ---------------
from collections import Counter  # noqa: E402
from collectives import check_launch_args, positive_int  # noqa: E402
from data_parallel import (SerialCheck, check_training_args, finish_run,  # noqa: E402
                           full_grads, full_weights, step_line, training_parser)


class Matmul(NamedTuple):
    """[m, k] x [k, n], inputs of in_bytes an element into an output of out_bytes; accumulate:
    it adds into what its output held, reading that too (dW summed over micro-batches)."""
    m: int
    k: int
    n: int
    in_bytes: int
    out_bytes: int
    accumulate: bool

    def flops(self):
        return 2 * self.m * self.k * self.n

    def bytes_moved(self):   # both inputs read; the output written (and read, to add into)
        inputs = (self.m * self.k + self.k * self.n) * self.in_bytes
        return inputs + self.m * self.n * self.out_bytes * (1 + self.accumulate)


def layer_matmuls(kind, rows, dim, tp, bf16):
    """A tp rank's layer of this kind, a micro-batch: its forward z = x W, its dx = dz W^T, its
    dW = x^T dz into the fp32 gradient (the step's first; the later ones add into it): the
    matmuls three_d.py's --plan prices, as tests/gpu_path.py records them."""
    size = 2 if bf16 else 4
    n_in = dim // tp if kind == "row" else dim
    n_out = dim if kind == "row" else dim // tp
    forward = Matmul(rows, n_in, n_out, size, size, accumulate=False)   # z = x W
    dx = Matmul(rows, n_out, n_in, size, size, accumulate=False)        # dx = dz W^T
    dw = Matmul(n_in, rows, n_out, size, 4, accumulate=False)           # dW = x^T dz, fp32
    return forward, dx, dw


def tp_matmuls(kinds, rows, dim, tp, bf16=False, num_micro_batches=1, first_stage=True,
               recompute=False):
    """A tp rank's matmuls a step over layers of these kinds, {Matmul: calls}, as tp_costs()
    gives its collectives: each micro-batch, each layer's forward (again in its backward with
    --recompute), its dx (the model's first layer's none), and its dW."""
    m = num_micro_batches
    calls = Counter()
    for i, kind in enumerate(kinds):
        forward, dx, dw = layer_matmuls(kind, rows, dim, tp, bf16)
        calls[forward] += m * (1 + recompute)
        calls[dx] += m * (i > 0 or not first_stage)
        calls[dw] += 1
        calls[dw._replace(accumulate=True)] += m - 1
    return +calls


def describe(kinds):   # what ran, for the output: "3 Megatron pairs and 1 all-gather layer"
    pairs = kinds.count("row")
    gathers = kinds.count("gather")
    parts = []
    if pairs:
        parts.append(f"{pairs} Megatron pair{'s' * (pairs != 1)} (column, row)")
    if gathers:
        parts.append(f"{gathers} all-gather layer{'s' * (gathers != 1)}")
    return " and ".join(parts)


def divides(value, flag, divisor, divisor_flag):   # a rule: broken if value % divisor
    return value % divisor, f"{flag} {value} is not divisible by {divisor_flag} ({divisor})"


def refuse_unused(parser, args, used, mode):   # a flag this mode ignores is refused
    parser.refuse((name not in used and value != parser.get_default(name),
                   f"--{name.replace('_', '-')}: not used with {mode}")
                  for name, value in vars(args).items())


def parse_args(argv=None):
    parser = training_parser("Tensor parallelism: column-parallel layers with an all-gather.")
    parser.add_argument("--world-size", type=positive_int, default=4,
                        help="ranks T sharing each layer; divides --dim")
    parser.add_argument("--tp-style", choices=["all-gather", "megatron"], default="all-gather",
                        help="every layer column-parallel with an all-gather, or Megatron's pairs")
    parser.add_argument("--embedding", action="store_true",
                        help="instead of training, the vocab-parallel embedding (--dim: its width)")
    parser.add_argument("--vocab-size", type=positive_int, default=10, help="rows of the table")
    args = parser.parse_args(argv)
    if args.embedding:
        refuse_unused(parser, args, {"embedding", "vocab_size", "dim", "world_size", "backend",
                                     "timeout_s"}, "--embedding")
        parser.refuse([(args.vocab_size < args.world_size, f"--vocab-size {args.vocab_size} is "
                        f"smaller than --world-size {args.world_size}")])
        check_launch_args(parser, args, args.world_size)
        return args
    parser.refuse([divides(args.dim, "--dim", args.world_size, "--world-size"),
                   (args.tp_style == "megatron" and args.num_layers < 2,
                    f"--tp-style megatron: a pair is two layers, and --num-layers "
                    f"{args.num_layers} has none; use --tp-style all-gather")])
    check_training_args(parser, args, args.world_size)
    return args


if __name__ == "__main__":
    run_main(main)
