"""Step 3: tensor parallelism. Every layer is split across the ranks, and so is the vocabulary.

    python tensor_parallel.py                           # 4 ranks share each layer
    python tensor_parallel.py --world-size 2 --check
    python tensor_parallel.py --tp-style megatron       # Megatron's column-then-row pairs
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
(Megatron-LM, torchtitan) pair the layers instead and send a third less: the second
section. The third splits the vocabulary, the embedding's rows and the head's columns,
and takes the softmax in pieces (Megatron's vocab-parallel embedding and cross-entropy).

--recompute keeps each layer's input alone, as in step 2: z_t = x W_t again in the backward,
with no collective; a Megatron row layer's z again needs g's all-reduce again (tp_costs).

What PyTorch gives you: ColwiseParallel, RowwiseParallel and loss_parallel on a DeviceMesh
(tests/bench.py races them against this).
"""
import warnings
from functools import partial
from typing import NamedTuple
warnings.filterwarnings("ignore", "Failed to initialize NumPy")   # torch warns without numpy
import torch
import torch.distributed as dist
import torch.nn.functional as F

from collectives import cleanup, run_main, setup, spawn
from data_parallel import (Block, DataParallel, dp_step, embedding_backward, head_backward,
                           head_forward, init_params, layer_backward, layer_forward, make_batch)


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


# The vocabulary over the tp ranks: rank t holds the classes [v_t, v_t+1), vocab_range's.
#
#   embedding  E_t = E[v_t:v_t+1] [V_t, D/k]: each rank looks up the tokens it holds, zeros
#              for the rest, and an all-reduce adds the pieces (each token has one owner).
#              Backward: g is the same on every rank; each adds into its own rows: no collective.
#   head       H_t = H[:, v_t:v_t+1]: logits_t = a H_t [b, V_t], never gathered. f before it:
#              da = sum_t dlogits_t H_t^T, all-reduced in the backward.
#   loss       m = max of each row over all V             all-reduce MAX   [b]
#              s = sum_t sum_v exp(logits_t - m)          all-reduce SUM   [b]
#              l_y = logits[y] - m, from y's owner        all-reduce SUM   [b]
#              loss = sum_rows (log s - l_y) / n          = -log softmax(logits)[y]: m cancels
#   backward   dlogits_t = (exp(logits_t - m) / s - onehot_t(y)) / n: no collective
#
# Three [b] all-reduces, where gathering the logits moves (T-1)/T of [b, V]: at V = 128,256
# the largest activation of the model. No class is padded: when T does not divide V the shards
# differ by one class, where a padded class of logit 0 would add exp(-m) to s.

def vocab_range(vocab_size, tp_rank, tp_size):
    """Classes [start, end) of rank t: V // T each, and one more on the first V mod T ranks."""
    size = vocab_size // tp_size
    extra = vocab_size % tp_size
    start = tp_rank * size + min(tp_rank, extra)
    return start, start + size + (tp_rank < extra)


def vocab_embedding_forward(tokens, e_t, recompute=False, group=None, vocab_size=None):
    """The tokens [b, k] this rank holds, looked up; zeros for the rest; summed: x [b, D]."""
    start, end = vocab_range(vocab_size, dist.get_rank(group), dist.get_world_size(group))
    outside = (tokens < start) | (tokens >= end)                       # [b, k]
    local = (tokens - start).masked_fill(outside, 0)                   # any row: masked below
    x = e_t[local].masked_fill(outside[..., None], 0.0).reshape(len(tokens), -1)   # [b, D]
    if dist.get_world_size(group) > 1:
        dist.all_reduce(x, group=group)       # x = sum_t its tokens' rows   2(T-1)/T x [b, D]
    return x, (local, outside)


def vocab_embedding_backward(g, stash, e_t, need_dx=False, group=None):
    """g [b, D], the same on every rank: each keeps its own tokens' blocks, for dE_t[local]."""
    local, outside = stash
    g = g.reshape(*local.shape, -1).masked_fill(outside[..., None], 0.0)   # [b, k, D/k]
    return embedding_backward(g, (local, None), e_t)   # step 2's, on its local rows


def vocab_head_forward(a, h_t, recompute=False, group=None):
    """f in forward, the identity: logits_t = a H_t  [b, D] @ [D, V_t], kept sharded."""
    return head_forward(a, h_t)


def vocab_head_backward(dlogits_t, stash, h_t, need_dx=True, group=None):
    """f in backward: da = sum_t dlogits_t H_t^T, an all-reduce; dH_t = a^T dlogits_t."""
    da, a_dlogits = head_backward(dlogits_t, stash, h_t)   # one term of da  [b, D]
    if dist.get_world_size(group) > 1:
        dist.all_reduce(da, group=group)      # 2(T-1)/T x [b, D]
    return da, a_dlogits


def vocab_parallel_cross_entropy(logits_t, y, n, vocab_size=None, group=None):
    """The cross-entropy over all V classes from this rank's logits_t [b, V_t], in fp32, and its
    dlogits_t; the same loss on every rank."""
    start, end = vocab_range(vocab_size, dist.get_rank(group), dist.get_world_size(group))
    dtype = logits_t.dtype
    logits_t = logits_t.float()
    rows = torch.arange(len(y), device=y.device)
    row_max = logits_t.max(dim=1).values                               # [b]
    reduce_over(row_max, group, op=dist.ReduceOp.MAX)                  # m
    exps = (logits_t - row_max[:, None]).exp()                         # [b, V_t]
    sum_exps = exps.sum(dim=1)
    reduce_over(sum_exps, group)                                       # s
    mine = (y >= start) & (y < end)                                    # y's owner is this rank
    local = (y - start).masked_fill(~mine, 0)
    target = (logits_t[rows, local] - row_max).masked_fill(~mine, 0.0)
    reduce_over(target, group)                                         # l_y
    dlogits_t = exps / sum_exps[:, None]                               # softmax_t
    dlogits_t[rows, local] -= mine.float()                             # - onehot_t(y)
    return (sum_exps.log() - target).sum() / n, (dlogits_t / n).to(dtype)


def reduce_over(tensor, group, op=dist.ReduceOp.SUM):   # an all-reduce, where there are ranks
    if dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


BLOCKS = {"gather": Block(gather_forward, gather_backward),
          "column": Block(column_forward, column_backward),
          "row": Block(row_forward, row_backward),
          "embedding": Block(vocab_embedding_forward, vocab_embedding_backward),
          "head": Block(vocab_head_forward, vocab_head_backward)}


def layer_kinds(num_layers, tp_style):
    """Per layer: "gather" (the all-gather layer above) for every one, or Megatron's pairs
    ("column", "row"), with an odd last layer a "gather" one."""
    if tp_style == "all-gather":
        return ["gather"] * num_layers
    return ["column", "row"] * (num_layers // 2) + ["gather"] * (num_layers % 2)


def tp_blocks(kinds, group=None, vocab_size=None):
    """Each part's forward and backward over group: what tp_worker runs, and 3D's stages."""
    blocks = []
    for kind in kinds:
        forward = partial(BLOCKS[kind].forward, group=group)
        if kind == "embedding":
            forward = partial(forward, vocab_size=vocab_size)
        blocks.append(Block(forward, partial(BLOCKS[kind].backward, group=group)))
    return blocks


def tp_costs(kinds, act_bytes, rows, num_micro_batches=1, recompute=False):
    """A tp rank's collectives a step, (kind, bytes of the tensor, times), A = act_bytes for one
    activation [b, D]: each micro-batch, each part all-reduces one A: an all-gather layer its dx
    (and all-gathers its A forward), Megatron's column layer dx (f), its row layer z (g, again
    with --recompute), the embedding x, the head da; the loss three [b] of fp32."""
    m = num_micro_batches
    reduces = len(kinds) + kinds.count("row") * recompute
    runs = [("all-gather", act_bytes, kinds.count("gather") * m),
            ("all-reduce", act_bytes, reduces * m)]
    if "head" in kinds:
        runs.append(("all-reduce", 4 * rows, 3 * m))   # m, s and l_y
    return runs


def shard(w, kind, tp_rank, tp_size):   # rank t's part of a full matrix, as a copy
    row_start, row_end, col_start, col_end = shard_box(w.shape, kind, tp_rank, tp_size)
    return w[row_start:row_end, col_start:col_end].clone(memory_format=torch.contiguous_format)


def shard_box(shape, kind, tp_rank, tp_size):
    """Rank t's rows and columns of a full matrix, (row_start, row_end, col_start, col_end): its
    rows W[t D/T : (t+1) D/T, :] for a row layer, its classes' rows of E or columns of H, else
    its columns. (Where its piece sits in the whole: shard's, and a checkpoint's.)"""
    rows, cols = shape
    if kind == "row":
        return tp_rank * rows // tp_size, (tp_rank + 1) * rows // tp_size, 0, cols
    if kind == "embedding":
        return (*vocab_range(rows, tp_rank, tp_size), 0, cols)
    if kind == "head":
        return (0, rows, *vocab_range(cols, tp_rank, tp_size))
    return 0, rows, tp_rank * cols // tp_size, (tp_rank + 1) * cols // tp_size


def tp_worker(rank, world_size, args):
    device = setup(rank, world_size)
    tp_rank = rank
    tp_size = world_size
    kinds = ["embedding", *layer_kinds(args.num_layers, args.tp_style), "head"]
    full = init_params(args)                                            # drawn whole, then cut
    shards = [shard(w, k, tp_rank, tp_size).to(device) for w, k in zip(full, kinds)]
    # The shards live in step 2's replica over a dp group of one: buckets, optimizer, no exchange.
    replica = DataParallel(shards, dist.new_subgroups(1)[0], optimizer=args.optimizer, lr=args.lr,
                           bf16=args.bf16)
    boxes = [shard_box(w.shape, k, tp_rank, tp_size) for w, k in zip(full, kinds)]   # in the whole
    load_checkpoint(args, replica, range(len(full)), boxes)   # --resume: from any layout's pieces
    blocks = tp_blocks(kinds, vocab_size=args.vocab_size)   # every rank shares every part
    loss_fn = partial(vocab_parallel_cross_entropy, vocab_size=args.vocab_size)
    m = args.micro_batches
    losses = []
    norms = []
    check = SerialCheck(args)
    if rank == 0:
        print(f"tensor parallel over {tp_size} ranks: {describe(kinds)}", flush=True)
    for step in range(args.start_step, args.steps):
        inputs, targets = (t.to(device) for t in make_batch(args, step))   # every rank's
        loss = dp_step(replica, blocks, loss_fn, inputs.chunk(m), targets.chunk(m),
                       args.batch_size, recompute=args.recompute)   # step 2's, on tp blocks
        if args.check:   # this step's weights and gradients, whole, against serial autograd's
            check.step(whole_model(full_weights(replica), full, kinds),
                       whole_model(full_grads(replica), full, kinds))
        if args.clip_grad:     # the norm's squares summed over the shards
            norms.append(replica.clip(args.clip_grad, [dist.group.WORLD]).item())
        replica.update()
        losses.append(loss.item())
        if rank == 0:
            log_step(f"[rank {rank}]", step, losses, norms, args)
        save_checkpoint(args, step + 1, replica, range(len(full)), boxes)   # --checkpoint
    final = whole_model(full_weights(replica), full, kinds)   # put together on rank 0
    if rank == 0:
        finish_run(args, full, final, losses, check, norms)
    cleanup()


def main(argv=None):
    args = parse_args(argv)
    spawn(tp_worker, args.world_size, args, backend=args.backend, timeout_s=args.timeout_s)


# Below the fold: the command line and its rules, and what the run says it ran. ---------------
from collectives import positive_int  # noqa: E402
from data_parallel import (VOCAB_SIZE, SerialCheck, check_training_args, finish_run,  # noqa
                           full_grads, full_weights, load_checkpoint, log_step, save_checkpoint,
                           training_parser)


def whole_model(owned, full, kinds, owners=None):
    """Rank 0: every part whole, fp32 (else None), a piece at a time (steps 4, 5 hold parts on some
    ranks). owned: this rank's, a list or {part: tensor}; owners(j): part j's ranks in tp order."""
    if not isinstance(owned, dict):
        owned = dict(enumerate(owned))
    rank = dist.get_rank()
    device = next(iter(owned.values())).device
    parts = []
    for j, (w, kind) in enumerate(zip(full, kinds)):
        ranks = list(owners(j)) if owners else list(range(dist.get_world_size()))
        pieces = []
        for t, source in enumerate(ranks):
            if rank == source == 0:
                pieces.append(owned[j].float())
            elif rank == source:
                dist.send(owned[j].float().contiguous(), dst=0)
            elif rank == 0:
                pieces.append(torch.empty(shard(w.to("meta"), kind, t, len(ranks)).shape,
                                          device=device))
                dist.recv(pieces[-1], src=source)
        if rank == 0:
            parts.append(torch.cat(pieces, dim=0 if kind in ("row", "embedding") else 1).cpu())
    return parts if rank == 0 else None


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


def layer_matmuls(kind, rows, dim, tp, bf16, classes=0):
    """A tp rank's layer (or head, of its classes), a micro-batch: z = x W, dx = dz W^T, and dW =
    x^T dz into the fp32 gradient: what --plan prices and tests/gpu_path.py records."""
    size = 2 if bf16 else 4
    n_in = dim // tp if kind == "row" else dim
    n_out = dim if kind == "row" else dim // tp
    if kind == "head":
        n_out = classes
    forward = Matmul(rows, n_in, n_out, size, size, accumulate=False)   # z = x W
    dx = Matmul(rows, n_out, n_in, size, size, accumulate=False)        # dx = dz W^T
    dw = Matmul(n_in, rows, n_out, size, 4, accumulate=False)           # dW = x^T dz, fp32
    return forward, dx, dw


def describe(kinds):   # what ran: "the embedding by class, Megatron pairs (column, row) x2, ..."
    names = {"embedding": "the embedding by class", "row": "Megatron pairs (column, row)",
             "gather": "all-gather layers", "head": "the head by class"}
    counts = {"row": f" x{kinds.count('row')}", "gather": f" x{kinds.count('gather')}"}
    return ", ".join(names[kind] + counts.get(kind, "") for kind in names if kind in kinds)


def divides(value, flag, divisor, divisor_flag):   # a rule: broken if value % divisor
    return value % divisor, f"{flag} {value} is not divisible by {divisor_flag} ({divisor})"


def refuse_unused(parser, args, used, mode):   # a flag this mode ignores is refused
    parser.refuse((name not in used and value != parser.get_default(name),
                   f"--{name.replace('_', '-')}: not used with {mode}")
                  for name, value in vars(args).items())


def parse_args(argv=None):
    parser = training_parser("Tensor parallelism: column-parallel layers with an all-gather.")
    parser.add_argument("--world-size", type=positive_int, default=4, help="ranks T; divides --dim")
    parser.add_argument("--tp-style", choices=["all-gather", "megatron"], default="all-gather",
                        help="every layer column-parallel with an all-gather, or Megatron's pairs")
    args = parser.parse_args(argv)
    parser.refuse([divides(args.dim, "--dim", args.world_size, "--world-size"),
                   (args.tp_style == "megatron" and args.num_layers < 2,
                    f"--tp-style megatron: a pair is two layers, and --num-layers "
                    f"{args.num_layers} has none; use --tp-style all-gather"),
                   (args.world_size > VOCAB_SIZE, f"--world-size {args.world_size}: more ranks "
                                                  f"than the vocabulary's {VOCAB_SIZE} classes")])
    check_training_args(parser, args, args.world_size)
    return args


if __name__ == "__main__":
    run_main(main)
