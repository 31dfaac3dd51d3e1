"""Step 3: tensor parallelism. Every block is split across the ranks, a head a unit, and so is
the vocabulary.

    python tensor_parallel.py                           # 4 ranks share each block
    python tensor_parallel.py --world-size 2 --check
    python tensor_parallel.py --tp-style megatron       # Megatron's column-then-row pairs
    python tensor_parallel.py --cp 4 --check            # context parallelism: ring attention
    python tensor_parallel.py --cp 4 --cp-style ulysses # or all-gather, or hybrid --ulysses 2
    python tensor_parallel.py --experts 4 --check       # experts, each split as the MLP (step 2)
    torchrun --nproc-per-node 4 tensor_parallel.py

The lecture's column-parallel layer: rank t of the tp ranks holds the columns W_t of a weight,
computes its slice of the output, and an all-gather rebuilds the whole output for the next layer.
The lecture stops at the forward pass ("Backward pass: homework exercise"). Here is the backward,
derived by hand, for a column layer z_t = x W_t followed by the all-gather:

    forward    z_t = x W_t                                     [b, T, n/tp]
               z = [z_0 | z_1 | ... | z_tp-1]                  all-gather  [b, T, n]
    backward   g_t = g[..., cols_t]  the all-gather's backward is a slice: g is the same on every
                                     rank, so each keeps its own columns
               dW_t = x^T g_t        this rank's columns of dW, no communication
               dx = sum_t g_t W_t^T  each rank holds one term: all-reduce  [b, T, D]

In a block, heads are the unit: Wq is cut at head boundaries, so rank t holds h/tp whole query
heads, q [b, T, h/tp dh], and with them the kv heads they read (query head j reads kv head j //
(h/G)), so it runs their attention with no collective at all:
    G >= tp (tp divides G): the G/tp kv heads of its query heads: Wk, Wv cut at kv heads too
    G < tp (G divides tp): one kv head, read by the query heads of tp/G ranks: each of them holds
      its Wk, Wv columns whole and computes its k and v. Each holder's dWk = n^T dk_t is a part:
      dk_t is its own query heads' share of dk, the sum over the group (step 2). Summed over the
      tp/G holders (sum_partial_grads), as every replicated weight's partial gradient here.
SwiGLU's W1 and W3 are cut at the same F/tp columns: silu(a_t) * up_t is then this rank's columns
of the product, with no collective. Two styles then differ in what follows (GatherSplit and
MegatronSplit below; step 2's block takes either). The norms' gains are whole on every rank: each
rank's x is the whole residual stream, the same on all, and the dn its norm's backward reads comes
after f's all-reduce, the same on all too, so every rank computes the same dg with no collective.
QK-norm's gains are whole too, but each rank norms its own heads: its dg is its heads' part,
summed over tp (Megatron #816); so is a router's (step 2's experts).

Bytes each rank sends per block and micro-batch, A for one activation [b, T, D], F the MLP's
width: the all-gather style (3 + F/D)(tp-1)/tp A forward (o, its Wo, the MLP's F, its W2) and 2
x that backward; Megatron's pairs (Megatron-LM, torchtitan) 2 x 2(tp-1)/tp A each way: 8(tp-1)/tp
A. The vocabulary's ends split its rows of E and columns of H, and take the softmax in pieces
(Megatron's vocab-parallel embedding and cross-entropy).

--recompute keeps each block's input alone, as in step 2: the forward again in the backward, its
collectives too (tp_costs).

Read in parts: 1, heads over tp in two styles, and sequence parallelism; 2, the vocabulary; 3,
context parallelism (--cp): each sequence's positions over ranks, ring attention; 4, its other
forms (--cp-style): Llama 3's all-gathered K and V, Ulysses' all-to-all, the hybrid; 5, the
worker that trains with them.

What PyTorch gives you: ColwiseParallel, RowwiseParallel and loss_parallel on a DeviceMesh
(tests/bench.py races them against this).
"""
import warnings
from functools import partial
from typing import NamedTuple
warnings.filterwarnings("ignore", "Failed to initialize NumPy")   # torch warns without numpy
import torch
import torch.distributed as dist

from collectives import cleanup, run_main, setup, spawn
from collectives import all_to_all, exchange
from data_parallel import (Block, DataParallel, Kernels, MoE, Router, balance, block_backward,
                           block_forward, columns, dp_step, expert_boxes, head_backward,
                           head_forward, init_params, kernels_for, kv_head, make_batch,
                           query_heads, rope_table, tensors_of, wide)
from data_parallel import (SerialCheck, finish_run, load_checkpoint, log_step,   # the worker's
                           save_checkpoint, whole_on_rank0)       # --check, end, checkpoints

# Part 1: heads over tp, in two styles, and sequence parallelism -----------------------------------

def all_gather_columns(a_t, group=None):
    """[..., n] on each of tp ranks -> [..., tp n] on all: the pieces side by side, rank order."""
    size = dist.get_world_size(group)
    if size == 1:
        return a_t
    stacked = a_t.new_empty(size * a_t.shape[0], *a_t.shape[1:])   # rank t's from row t b
    dist.all_gather_single(stacked, a_t.contiguous(), group=group)
    return stacked.view(size, *a_t.shape).movedim(0, -2).flatten(-2)


def my_rows(x, group=None):   # rank t's T/tp rows of x [T, ..]
    rows = x.shape[0] // dist.get_world_size(group)
    t = dist.get_rank(group)
    return x[t * rows:(t + 1) * rows]


def my_columns(g, group=None):   # the all-gather's backward: this rank's slice of g's columns
    cols = g.shape[-1] // dist.get_world_size(group)
    t = dist.get_rank(group)
    return g[..., t * cols:(t + 1) * cols]


def gather_along_T(x, group):   # [b, T/tp, ..] on each rank -> [b, T, ..] on all, in rank order
    whole = x.new_empty(dist.get_world_size(group) * x.shape[1], x.shape[0], *x.shape[2:])
    dist.all_gather_single(whole, x.transpose(0, 1).contiguous(), group=group)   # T first
    return whole.transpose(0, 1)


def scatter_along_T(x, group):   # [b, T, ..] on each rank -> their sum's [b, T/tp, ..], rank t's
    mine = x.new_empty(x.shape[1] // dist.get_world_size(group), x.shape[0], *x.shape[2:])
    dist.reduce_scatter_single(mine, x.transpose(0, 1).contiguous(), group=group)
    return mine.transpose(0, 1)


def reduce_over(tensor, group, op=dist.ReduceOp.SUM):   # an all-reduce, where there are ranks
    if dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


class MegatronSplit:
    """Megatron's pairs: Wq, Wk, Wv, W1 and W3 are column layers (rank t holds W[:, cols_t])
    whose outputs stay sharded: attention runs on this rank's heads, silu(a) * up on its columns.
    Wo and W2 are row layers (rank t holds W[rows_t, :]) that take the shard as it is: o Wo =
    sum_t o_t Wo_t.

      forward   n, the same on every rank                  f: the identity
                q_t, k_t, v_t = n Wq_t ..; o_t = attention of this rank's heads   [b, T, h/tp dh]
                y = sum_t o_t Wo_t                         g: all-reduce   [b, T, D]
      backward  dy, the same on every rank                 g: the identity
                dWo_t = o_t^T dy     do_t = dy Wo_t^T      this rank's own: no communication
                dq_t, dk_t, dv_t from do_t; dWq_t = n^T dq_t ..
                dn = sum_t dq_t Wq_t^T + dk_t Wk_t^T + dv_t Wv_t^T    f: all-reduce   [b, T, D]

    and the MLP alike (W1, W3 column, SwiGLU on the shard, W2 row). f and g are conjugates, a
    forward/backward pair each: f copies in forward and all-reduces in backward; g all-reduces
    in forward and copies in backward. Per block and micro-batch: two g, two f, 8(tp-1)/tp A."""

    def __init__(self, group):
        self.group = group

    def f(self, n):                           # f forward: the identity
        return n

    def gather(self, a):                      # o_t, (silu(a) up)_t stay sharded
        return a

    def gather_back(self, dy):
        return dy

    def g(self, y):                           # g forward: y = sum_t o_t Wo_t   2(tp-1)/tp A
        return reduce_over(y, self.group)

    def g_back(self, dy):                     # g backward: the identity
        return dy

    def f_back(self, dx):                     # f backward: dx = sum_t dz_t W_t^T   2(tp-1)/tp A
        return reduce_over(dx, self.group)

    def row_back(self, dx):                   # a row layer's dx, do_t = dy Wo_t^T: this rank's
        return dx


class GatherSplit(MegatronSplit):
    """The lecture's style: every weight a column layer, each output all-gathered. q, k, v as
    above; o_t all-gathered [b, T, D], the input of Wo's column layer, whose output [b, T, D/tp]
    is all-gathered; silu(n W1_t) * n W3_t all-gathered [b, T, F]; W2's output all-gathered.
    Backward: each all-gather a slice, each column layer's dx an all-reduce (f): Wo's, W2's too."""

    def gather(self, a):                      # [b, T, n/tp] -> [b, T, n]   (tp-1)/tp of it
        return all_gather_columns(a, self.group)

    def gather_back(self, dy):                # the slice: this rank's columns, its own
        return my_columns(dy, self.group).contiguous()   # (a view would hold all of dy)

    def g(self, y):                           # Wo's, W2's outputs gathered, as SwiGLU's
        return self.gather(y)

    def g_back(self, dy):
        return self.gather_back(dy)

    def row_back(self, dx):                   # Wo, W2: column layers here, so f's all-reduce
        return self.f_back(dx)


class SequenceSplit(MegatronSplit):
    """Sequence parallelism (Korthikanti et al. 2022) on Megatron's pairs: from a row layer to
    the next column layer each rank holds rows_t of T, [b, T/tp, D], and runs the residual adds
    and the norms on them. f becomes an all-gather along T, g a reduce-scatter: an all-reduce's
    bytes, and x, x' and r held by 1/tp. A gain sees T/tp positions: dg is a partial sum, summed
    over tp after the backward (tp_worker's sum_partial_grads; an average would give 1/tp of the
    gradient). RoPE's places are the whole T's: q and k are made after f.

      forward   n = [n_0; n_1; ..], n_t = rmsnorm(x_t)   f: all-gather along T   [b, T, D]
                y_t = (sum_r o_r Wo_r)[rows_t]           g: reduce-scatter along T
      backward  dy = [dy_0; dy_1; ..]                    g's: all-gather along T
                dn_t = (sum_r dq_r Wq_r^T + ..)[rows_t]  f's: reduce-scatter along T"""

    def f(self, n):                           # f: all-gathered along T
        return gather_along_T(n, self.group)

    def g(self, y):                           # g: reduce-scattered along T
        return scatter_along_T(y, self.group)

    def g_back(self, dy):                     # g's backward: all-gathered along T
        return gather_along_T(dy, self.group)

    def f_back(self, dx):                     # f's backward: reduce-scattered along T
        return scatter_along_T(dx, self.group)


# Part 2: the vocabulary ---------------------------------------------------------------------------
#
# The vocabulary over the tp ranks: rank t holds the classes [v_t, v_t+1), vocab_range's.
#
#   embedding  E_t = E[v_t:v_t+1] [V_t, D]: each rank looks up the tokens it holds, zeros for the
#              rest, and an all-reduce adds the pieces (each token has one owner).
#              Backward: g is the same on every rank; each adds into its own rows: no collective.
#   head       n = rmsnorm(x; g), whole on every rank; H_t = H[:, v_t:v_t+1]: logits_t = n H_t
#              [b T, V_t], never gathered. f between: dn = sum_t dlogits_t H_t^T, all-reduced.
#   loss       m = max of each row over all V             all-reduce MAX   [b T]
#              s = sum_t sum_v exp(logits_t - m)          all-reduce SUM   [b T]
#              l_y = logits[y] - m, from y's owner        all-reduce SUM   [b T]
#              loss = sum_rows (log s - l_y) / n          = -log softmax(logits)[y]: m cancels
#   backward   dlogits_t = (exp(logits_t - m) / s - onehot_t(y)) / n: no collective
#
# Three [b T] all-reduces, where gathering the logits moves (tp-1)/tp of [b T, V]: at V = 128,256
# the largest activation of the model. No class is padded: when T does not divide V the shards
# differ by one class, where a padded class of logit 0 would add exp(-m) to s.

def vocab_range(vocab_size, tp_rank, tp_size):
    """Classes [start, end) of rank t: V // tp each, and one more on the first V mod tp ranks."""
    size = vocab_size // tp_size
    extra = vocab_size % tp_size
    start = tp_rank * size + min(tp_rank, extra)
    return start, start + size + (tp_rank < extra)


def vocab_embedding_forward(tokens, w, recompute=False, group=None, vocab_size=None,
                            sequence_parallel=False):
    """The tokens [b, T] this rank holds, looked up, zeros for the rest, summed: [b, T, D]
    (sequence parallel: reduce-scattered along T instead, [b, T/tp, D])."""
    e_t, = w
    start, end = vocab_range(vocab_size, dist.get_rank(group), dist.get_world_size(group))
    outside = (tokens < start) | (tokens >= end)                       # [b, T]
    local = (tokens - start).masked_fill(outside, 0)                   # any row: masked below
    x = e_t[local].masked_fill(outside[..., None], 0.0)                # [b, T, D]
    if sequence_parallel:
        return scatter_along_T(x, group), (local, outside)
    reduce_over(x, group)                     # x = sum_t its tokens' rows   2(tp-1)/tp A
    return x, (local, outside)


def vocab_embedding_backward(g, stash, w, need_dx=False, group=None, sequence_parallel=False):
    """g [b, T, D], the same on every rank: each keeps its own tokens' rows, for dE_t[local].
    Sequence parallel: g [b, T/tp, D], all-gathered along T first."""
    local, outside = stash
    if sequence_parallel:
        g = gather_along_T(g, group)
    return None, [(local, g.masked_fill(outside[..., None], 0.0))]


def vocab_parallel_cross_entropy(logits_t, y, n, vocab_size=None, group=None):
    """The cross-entropy over all V classes from this rank's logits_t [b T, V_t], in fp32, and its
    dlogits_t; the same loss on every rank. y [b, T]."""
    start, end = vocab_range(vocab_size, dist.get_rank(group), dist.get_world_size(group))
    y = y.reshape(-1)
    dtype = logits_t.dtype
    logits_t = logits_t.float()
    rows = torch.arange(len(y), device=y.device)
    row_max = logits_t.max(dim=1).values                               # [b T]
    reduce_over(row_max, group, op=dist.ReduceOp.MAX)                  # m
    exps = (logits_t - row_max[:, None]).exp_()                        # [b T, V_t]
    sum_exps = exps.sum(dim=1)
    reduce_over(sum_exps, group)                                       # s
    mine = (y >= start) & (y < end)                                    # y's owner is this rank
    local = (y - start).masked_fill(~mine, 0)
    target = (logits_t[rows, local] - row_max).masked_fill(~mine, 0.0)
    reduce_over(target, group)                                         # l_y
    dlogits_t = exps.div_(sum_exps[:, None])                           # softmax_t, in exps
    dlogits_t[rows, local] -= mine.float()                             # - onehot_t(y)
    return (sum_exps.log() - target).sum() / n, dlogits_t.div_(n).to(dtype)


def sum_partial_grads(grads, partial, group):   # each a part of the gradient: summed, never
    for i in partial:                              # averaged (a mean: 1/tp of it)
        reduce_over(grads[i], group)


def tp_blocks(kinds, args, group=None, cp_groups=None, positions=None, routers=None):
    """Each part's forward and backward over group, by kind ("embedding", "block", "head"): what
    tp_worker runs, and 3D's stages. A block is step 2's, handed this style's split (args'
    --tp-style, --sequence-parallel) and RoPE at positions, this rank's places in T. The head's
    own split gathers along T before H under sequence parallelism: the vocab-parallel loss takes
    whole rows of logits, each position's every class. Its kernels: step 2's choice (a GPU's
    fused ones); cp_groups (--cp): attention over them, by context_attention. routers: the
    blocks' in order (--experts)."""
    split = GatherSplit(group) if args.tp_style == "all-gather" else MegatronSplit(group)
    ends = MegatronSplit(group)
    if args.sequence_parallel:
        split = SequenceSplit(group)
        ends = split
    kernels = kernels_for(args, positions.device)
    if cp_groups is not None:
        attention, backward = context_attention(args, cp_groups, kernels)
        kernels = kernels._replace(attention=attention, attention_backward=backward)
    head_dim = args.dim // args.heads
    rope = rope_table(positions, head_dim, args.rope_theta)
    routers = iter(routers if routers else [])
    outer = {"embedding": Block(partial(vocab_embedding_forward, group=group,
                                        vocab_size=args.vocab_size,
                                        sequence_parallel=args.sequence_parallel),
                                partial(vocab_embedding_backward, group=group,
                                        sequence_parallel=args.sequence_parallel)),
             "head": Block(partial(head_forward, split=ends, kernels=kernels),
                           partial(head_backward, split=ends, kernels=kernels))}
    blocks = []
    for kind in kinds:
        if kind == "block":
            block = dict(head_dim=head_dim, rope=rope, qk_norm=args.qk_norm, split=split,
                         router=next(routers, None), kernels=kernels)
            blocks.append(Block(partial(block_forward, **block), partial(block_backward, **block)))
        else:
            blocks.append(outer[kind])
    return blocks


def part_kinds(num_layers):   # the model's parts, in order
    return ["embedding", *["block"] * num_layers, "head"]


def tensor_kinds(kinds, args, tp_size):
    """How each part's tensors are split: "embedding" (E's rows by class), "head" (H's columns by
    class), "column", "row", "whole" (a gain: the same on every rank), "partial" (whole, but each
    rank's gradient a part, summed over tp: QK-norm's gains, a router), "kv" (G < tp: a kv head's
    Wk, Wv columns whole on the tp/G ranks that read it, its gradient summed over them). An
    expert's W1, W3, W2 [E, ..] as the MLP's."""
    out = "column" if args.tp_style == "all-gather" else "row"          # Wo, W2
    kv = "kv" if args.kv_heads < tp_size else "column"
    block = ["whole", "column", kv, kv, *["partial"] * 2 * args.qk_norm, out, "whole",
             *["partial"] * (args.experts > 0), "column", "column", out]
    by_part = {"embedding": ["embedding"], "head": ["whole", "head"], "block": block}
    return [by_part[part] for part in kinds]


def split_as(kinds, kind):   # the tensors split as kind
    return [i for i, k in enumerate(kinds) if k == kind]


def clip_shares(kinds, tp_size, kv_heads):   # each tensor's share of its squares: once in all
    shares = {"whole": 1 / tp_size, "partial": 1 / tp_size, "kv": kv_heads / tp_size}
    return [shares.get(kind, 1.0) for kind in kinds]


def shard(w, kind, tp_rank, tp_size, kv_heads=1):
    """Rank t's part of a whole tensor, as a copy even when tp = 1 (where a slice would be W
    itself): the optimizer updates the shard in place, and the whole must stay the initial one."""
    row_start, row_end, col_start, col_end = shard_box(w.shape, kind, tp_rank, tp_size, kv_heads)
    if w.dim() == 1:                      # a gain: whole
        return w.clone()
    return w[..., row_start:row_end, col_start:col_end].clone(   # an expert's [E, ..]: each's
        memory_format=torch.contiguous_format)


def held_boxes(shape, kind, tp_rank, tp_size, experts=None, kv_heads=1):
    """shard_box's; an expert tensor [E, R, C]'s: a list, each held expert's box (experts: their
    indices, all if None) in the whole seen as [E R, C] (step 2's expert_boxes)."""
    box = shard_box(shape, kind, tp_rank, tp_size, kv_heads)
    if len(shape) < 3:
        return box
    if experts is None:
        experts = range(shape[0])
    return expert_boxes(shape, experts, box)


def shard_box(shape, kind, tp_rank, tp_size, kv_heads=1):
    """Rank t's rows and columns of a whole tensor, (row_start, row_end, col_start, col_end): its
    rows W[t D/tp : (t+1) D/tp, :] for a row layer, its classes' rows of E or columns of H, its
    columns of a column layer, the columns of the kv head its query heads read ("kv": head t //
    (tp/G) of G), else all (a gain [D]: one row). (Where its piece sits in the whole: shard's,
    and a checkpoint's.)"""
    rows, cols = (1, *shape)[-2:]
    if kind == "kv":
        head = tp_rank * kv_heads // tp_size
        return 0, rows, head * cols // kv_heads, (head + 1) * cols // kv_heads
    if kind == "row":
        return tp_rank * rows // tp_size, (tp_rank + 1) * rows // tp_size, 0, cols
    if kind == "embedding":
        return (*vocab_range(rows, tp_rank, tp_size), 0, cols)
    if kind == "head":
        return (0, rows, *vocab_range(cols, tp_rank, tp_size))
    if kind == "column":
        return 0, rows, tp_rank * cols // tp_size, (tp_rank + 1) * cols // tp_size
    return 0, rows, 0, cols


# Part 3: context parallelism ----------------------------------------------------------------------
#
# --cp C: each sequence's T positions split over the C ranks of a cp group. A rank embeds its own
# positions and runs the norms, the matmuls (RoPE at their places in T: rope_table(positions)),
# the head and the loss on them alone; only attention needs the others'. Ring attention: the
# keys and values of the rank's kv heads (G/tp of them, never repeated to its h/tp query heads)
# travel the ring, C steps, and each rank attends its queries to the block it holds, masked by
# global position, merging the partial results by their lse. The weights are replicated over cp,
# and each one's gradient is a partial sum over this rank's positions: summed.
#
# The layout: T in chunks of s positions; a pair (query chunk i, key chunk j) is computed when
# j <= i, causally masked when j = i, and never when j > i (wholly in the future).
#   contiguous  C chunks, rank r holds chunk r: it computes r + 1 pairs, rank C-1 C times rank
#               0's; the busiest over the mean: 2C / (C + 1)
#   zigzag      2C chunks, rank r holds r and 2C-1-r: each rank 2C + 1 pairs of s = T/2C, 1x
#
# The merge of two partial results over key sets a and b (o_a = softmax over a's keys of S, v):
#   lse = log(e^lse_a + e^lse_b) = m + log(e^(lse_a - m) + e^(lse_b - m)),  m = max(lse_a, lse_b)
#   o = e^(lse_a - lse) o_a + e^(lse_b - lse) o_b        (the weights: each set's share of the sum)
# m keeps each exponent <= 0: e^lse overflows fp32 once a row's scores pass 88.
# A pair is step 2's attend() over the grouped heads, causal on the diagonal alone; its backward
# step 2's attend_backward() with the merged o_i and lse_i (delta_i = rowsum(do_i o_i) needs no
# other rank's keys): A = exp(S_ij - lse_i), dv_j += A^T do_i, dS = A (dA - delta_i), dq_i += dS
# k_j, dk_j += dS^T q_i, each kv head's summed over its group. dq stays; dk and dv travel the ring
# with their block, C hops: back at its owner. Each hop runs under the next step's pairs, whose
# sums start from zero: the arriving sums are added after them (as ring-flash-attention does).

def cp_chunks(cp_rank, cp_size, layout):   # the chunks of T this rank holds, in order
    if layout == "zigzag":
        return [cp_rank, 2 * cp_size - 1 - cp_rank]
    return [cp_rank]


def cp_positions(context, cp_rank, cp_size, layout):   # [T/C]: its positions' places in T
    if cp_size == 1:                                    # all of them, in order, any T
        return torch.arange(context)
    chunks = cp_chunks(cp_rank, cp_size, layout)
    size = context // (len(chunks) * cp_size)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks])


def merge(o_a, lse_a, o_b, lse_b):
    """Two partial attentions of the same queries over two key sets, as one: o [.., s, dh] fp32,
    lse [.., s] (the comment above derives it)."""
    if o_a is None:
        return o_b, lse_b
    m = torch.maximum(lse_a, lse_b)
    lse = m + ((lse_a - m).exp() + (lse_b - m).exp()).log()
    o = (lse_a - lse).exp()[..., None] * o_a + (lse_b - lse).exp()[..., None] * o_b
    return o, lse


def ring_neighbours(group):   # the global ranks this rank sends to and receives from
    group = group or dist.group.WORLD
    r = dist.get_rank(group)
    size = dist.get_world_size(group)
    return dist.get_global_rank(group, (r + 1) % size), dist.get_global_rank(group, (r - 1) % size)


def ring_attention(q, k, v, head_dim, group=None, layout="zigzag", kernels=Kernels()):
    """Causal attention of this rank's positions over all of T: o [b, n, h dh] (n = T/C) and lse
    [b, h, n], q [b, n, h dh], k, v [b, n, G dh]. Step t holds the keys and values of cp rank r -
    t, the next block coming in (and this one leaving) under the pairs' computation: a pair is
    kernels.attend, step 2's attend() (a GPU's bf16: FlashAttention's kernel)."""
    size = dist.get_world_size(group)
    r = dist.get_rank(group)
    right, left = ring_neighbours(group)
    q = query_heads(q, k.shape[-1] // head_dim, head_dim)            # [b, G, h/G, n, dh]
    kv = torch.stack([kv_head(k, head_dim), kv_head(v, head_dim)])   # [2, b, G, 1, n, dh]
    mine = cp_chunks(r, size, layout)
    span = q.shape[-2] // len(mine)                                   # a chunk's positions
    outs = [None] * len(mine)
    lses = [None] * len(mine)
    for step in range(size):
        if step < size - 1:
            incoming = torch.empty_like(kv)
            works = exchange(kv, incoming, right, left, group, wait=False)
        for c, (i, q_i) in enumerate(zip(mine, q.split(span, -2))):
            held = zip(cp_chunks((r - step) % size, size, layout), kv[0].split(span, -2),
                       kv[1].split(span, -2))
            for j, k_j, v_j in held:
                if j > i:
                    continue
                o_ij, lse_ij = kernels.attend(q_i, k_j, v_j, head_dim, causal=i == j)
                outs[c], lses[c] = merge(outs[c], lses[c], o_ij, lse_ij)
        if step < size - 1:
            for work in works:
                work.wait()
            kv = incoming
    o = torch.cat(outs, -2).to(v.dtype)
    return columns(o), torch.cat(lses, -1).flatten(1, 2)


def ring_attention_backward(do, q, k, v, o, lse, head_dim, group=None, layout="zigzag",
                            kernels=Kernels()):
    """dq [b, n, h dh], dk, dv [b, n, G dh]: each pair's A made again from the merged lse; dk and
    dv summed into a buffer (fp32) that travels with its block, home after C hops, each hop under
    the next step's pairs: a step's sums start from zero, and the arriving ones are added after."""
    size = dist.get_world_size(group)
    r = dist.get_rank(group)
    right, left = ring_neighbours(group)
    kv_heads = k.shape[-1] // head_dim
    do, q, o = (query_heads(t, kv_heads, head_dim) for t in (do, q, o))   # [b, G, h/G, n, dh]
    lse = lse.unflatten(1, q.shape[1:3])                              # [b, G, h/G, n]
    kv = torch.stack([kv_head(k, head_dim), kv_head(v, head_dim)])   # [2, b, G, 1, n, dh]
    mine = cp_chunks(r, size, layout)
    span = q.shape[-2] // len(mine)                                   # a chunk's positions
    dq = torch.zeros(q.shape, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
    for step in range(size):
        if step < size - 1:
            incoming = torch.empty_like(kv)
            works = exchange(kv, incoming, right, left, group, wait=False)
        dkv = torch.zeros(kv.shape, dtype=dq.dtype, device=q.device)  # the held block's dk, dv
        rows = zip(mine, q.split(span, -2), do.split(span, -2), o.split(span, -2),
                   lse.split(span, -1), dq.split(span, -2))
        for i, q_i, do_i, o_i, lse_i, dq_i in rows:
            held = zip(cp_chunks((r - step) % size, size, layout), kv[0].split(span, -2),
                       kv[1].split(span, -2), dkv[0].split(span, -2), dkv[1].split(span, -2))
            for j, k_j, v_j, dk_j, dv_j in held:
                if j > i:
                    continue
                dq_ij, dk_ij, dv_ij = kernels.attend_backward(do_i, q_i, k_j, v_j, o_i, lse_i,
                                                              head_dim, causal=i == j)
                dq_i += dq_ij
                dk_j += dk_ij
                dv_j += dv_ij
        if step > 0:                     # the block's sums from its earlier holders, which
            for work in sums:            # travelled under these pairs (ring-flash-attention's)
                work.wait()
            dkv += arriving
        if size > 1:                     # on to the next holder, under its next pairs
            arriving = torch.empty_like(dkv)
            sums = exchange(dkv, arriving, right, left, group, wait=False)
        if step < size - 1:
            for work in works:
                work.wait()
            kv = incoming
    if size > 1:                         # the last hop: this rank's own block, home
        for work in sums:
            work.wait()
        dkv = arriving
    return [columns(t).to(q.dtype) for t in (dq, *dkv)]


# Part 4: context parallelism's other forms: all-gather, Ulysses, the hybrid ----------------------
#
# --cp-style all-gather (Llama 3's 131K stage; Megatron's cp_comm_type "all_gather"): with GQA
# a rank's K and V are G/h of its Q, so it gathers them whole and attends its own query chunks
# to every key, the mask by global place, the same pairs as the ring's in two kernels a chunk:
#   forward   [K | V] [b, T/C, 2 G dh] all-gathered over cp -> [b, T, 2 G dh], put in T's order;
#             query chunk i: the keys before it (no mask) and its own chunk (causal), merged
#   backward  the same gather again (nothing whole is kept); dK, dV [b, T, ..] summed from the
#             pairs in fp32; the gather's backward is a reduce-scatter: rank r gets the sum over
#             cp of its own positions' rows, its own keys' dK and dV from every rank's queries
#
# --cp-style ulysses (DeepSpeed-Ulysses; Megatron's "a2a"): heads, not positions, split
# attention. An all-to-all turns a rank's [b, T/C, H dh] (its positions, every head) into
# [b, T, H/C dh] (every position, H/C heads); attention runs whole (step 2's); the inverse turns
# o back. Rank c takes heads c H/C .. (c+1) H/C - 1 of q (H/C a rank: C divides H = h/tp) and the
# kv heads they read: G' = G/tp of them, c G'/C .. (G' >= C, C divides G'), or, fewer than C (G'
# divides C), kv head c G'/C alone, each sent to the C/G' ranks whose query heads read it:
#   position  rank r's [b, T/C, H dh] = its chunks; piece c, its heads for rank c, goes to c
#      ->     rank c's [b, C T/C, H/C dh]: every rank's piece, its chunks put in T's order
#   heads     the inverse, o: rank c's rows of rank r's chunks back to r, heads side by side
# What each rank holds, C = 2, zigzag (T in chunks 0-3), H = 4 query heads (0-3), G' = 2 kv:
#                     rank 0                          rank 1
#   before, after     chunks 0 3, heads 0-3, kv 0-1   chunks 1 2, heads 0-3, kv 0-1
#   attention         chunks 0-3, heads 0-1, kv 0     chunks 0-3, heads 2-3, kv 1
# Each all-to-all is a permutation of rows, so its backward is the other one: dq, dk, dv go back
# as o came, do forward as q went. A kv head sent to C/G' ranks is used by each: its dK, dV is the
# sum of theirs (the inverse adds the copies: index_add over the heads they came from).
#
# --cp-style hybrid --ulysses U (USP; Megatron's "a2a+p2p", hierarchical_context_parallel_sizes):
# Ulysses over U consecutive cp ranks (a node), the ring across the C/U such groups. After the
# all-to-all a rank holds its group's U ranks' chunks, H/U heads: zigzag's r and 2C-1-r for r in
# the group are two runs of U chunks, so the C/U groups hold T as zigzag of C/U ranks does, and
# the ring of Part 3 runs over the ranks at the same place in each group, unchanged.

def in_order(t, held, back=False):
    """t [b, n, ..]: the chunks held (held[c], rank c's, in rank order) one after another, put in
    T's order (back: T's order back to the ranks')."""
    chunks = [chunk for chunks in held for chunk in chunks]
    order = sorted(range(len(chunks)), key=chunks.__getitem__)   # T's k-th chunk: the order[k]-th
    if back:
        order = sorted(range(len(chunks)), key=order.__getitem__)
    order = torch.tensor(order, device=t.device)
    return t.unflatten(1, (len(chunks), -1))[:, order].flatten(1, 2)


def gathered_attention(q, k, v, head_dim, group=None, layout="zigzag", kernels=Kernels()):
    """Ring attention's o [b, n, h dh] and lse [b, h, n] from K and V gathered whole over cp."""
    size = dist.get_world_size(group)
    held = [cp_chunks(r, size, layout) for r in range(size)]
    kv = in_order(gather_along_T(torch.cat([k, v], -1), group), held)   # [b, T, 2 G dh]
    q = query_heads(q, k.shape[-1] // head_dim, head_dim)             # [b, G, h/G, n, dh]
    k, v = (kv_head(t, head_dim) for t in kv.chunk(2, -1))            # [b, G, 1, T, dh]
    mine = cp_chunks(dist.get_rank(group), size, layout)
    span = q.shape[-2] // len(mine)                                   # a chunk's positions
    outs = []
    lses = []
    for i, q_i in zip(mine, q.split(span, -2)):
        own = slice(i * span, (i + 1) * span)                         # its own chunk's keys
        o, lse = kernels.attend(q_i, k[..., own, :], v[..., own, :], head_dim, causal=True)
        if i > 0:                                                     # the keys before it
            o_before, lse_before = kernels.attend(q_i, k[..., :i * span, :],
                                                  v[..., :i * span, :], head_dim, causal=False)
            o, lse = merge(o, lse, o_before, lse_before)
        outs.append(o)
        lses.append(lse)
    return columns(torch.cat(outs, -2).to(v.dtype)), torch.cat(lses, -1).flatten(1, 2)


def gathered_attention_backward(do, q, k, v, o, lse, head_dim, group=None, layout="zigzag",
                                kernels=Kernels()):
    """dq [b, n, h dh] and this rank's dk, dv [b, n, G dh]: the whole dK, dV reduce-scattered."""
    size = dist.get_world_size(group)
    held = [cp_chunks(r, size, layout) for r in range(size)]
    kv = in_order(gather_along_T(torch.cat([k, v], -1), group), held)
    kv_heads = k.shape[-1] // head_dim
    do, q, o = (query_heads(t, kv_heads, head_dim) for t in (do, q, o))   # [b, G, h/G, n, dh]
    lse = lse.unflatten(1, q.shape[1:3])
    k, v = (kv_head(t, head_dim) for t in kv.chunk(2, -1))            # [b, G, 1, T, dh]
    mine = cp_chunks(dist.get_rank(group), size, layout)
    span = q.shape[-2] // len(mine)                                   # a chunk's positions
    dq = torch.zeros(q.shape, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
    dk = torch.zeros(k.shape, dtype=dq.dtype, device=q.device)       # every key's, from mine
    dv = torch.zeros_like(dk)
    rows = zip(mine, q.split(span, -2), do.split(span, -2), o.split(span, -2),
               lse.split(span, -1), dq.split(span, -2))
    for i, q_i, do_i, o_i, lse_i, dq_i in rows:
        own = slice(i * span, (i + 1) * span)                         # its own chunk's keys
        for keys, diagonal in ((own, True), (slice(0, i * span), False)):
            if keys.stop == 0:
                continue
            grads = kernels.attend_backward(do_i, q_i, k[..., keys, :], v[..., keys, :], o_i,
                                            lse_i, head_dim, causal=diagonal)
            dq_i += grads[0]
            dk[..., keys, :] += grads[1]
            dv[..., keys, :] += grads[2]
    dkv = torch.cat([columns(dk), columns(dv)], -1)                   # [b, T, 2 G dh], fp32
    dk, dv = scatter_along_T(in_order(dkv, held, back=True), group).chunk(2, -1)   # mine, summed
    return [t.to(q.dtype) for t in (columns(dq), dk, dv)]


def ulysses_heads(heads, size, device):   # [C, H/C]: rank c's heads (H < C: one, C/H ranks each)
    if heads >= size:
        return torch.arange(heads, device=device).view(size, -1)
    return (torch.arange(size, device=device) * heads // size)[:, None]


def to_heads(t, head_dim, group, held):
    """Ulysses' all-to-all: t [b, n, H dh], this rank's chunks, every head -> [b, C n, H/C dh],
    every rank's chunks in T's order, rank c's heads (ulysses_heads)."""
    size = dist.get_world_size(group)
    heads = ulysses_heads(t.shape[-1] // head_dim, size, t.device)
    pieces = t.unflatten(-1, (-1, head_dim))[:, :, heads]             # [b, n, C, H/C, dh]
    came = all_to_all(pieces.movedim(2, 0).contiguous(), group=group)   # [C, b, n, H/C, dh]
    return in_order(came.movedim(0, 1).flatten(1, 2), held).flatten(-2)   # from each, in order


def to_positions(t, head_dim, group, held, heads):
    """The inverse all-to-all: t [b, C n, H/C dh] -> [b, n, heads dh], this rank's chunks; a kv
    head's copies (heads < C: on consecutive ranks) added, in fp32 (the backward of to_heads)."""
    size = dist.get_world_size(group)
    pieces = in_order(t, held, back=True).unflatten(1, (size, -1))    # [b, C, n, H/C dh]
    came = all_to_all(pieces.movedim(1, 0).contiguous(), group=group)   # [C, b, n, H/C dh]
    came = came.movedim(0, 2)                                         # [b, n, C, H/C dh]
    if heads < size:
        came = wide(came).unflatten(2, (heads, -1)).sum(3)            # [b, n, heads, dh]
    return came.flatten(2).to(t.dtype)


def ulysses_attention(q, k, v, head_dim, group, held, inner):
    """o [b, n, h dh] of this rank's positions; lse [b, h/C, C n] as the heads hold it. inner:
    attention over the whole sequence (step 2's), or the hybrid's ring across the groups."""
    heads = q.shape[-1] // head_dim
    o, lse = inner(*(to_heads(t, head_dim, group, held) for t in (q, k, v)), head_dim)
    return to_positions(o, head_dim, group, held, heads), lse


def ulysses_attention_backward(do, q, k, v, o, lse, head_dim, group, held, inner):
    """dq, dk, dv: do and what attention read sent again by heads (nothing split by heads is
    kept), the inner backward, and its gradients back by positions."""
    inputs = [to_heads(t, head_dim, group, held) for t in (do, q, k, v, o)]
    grads = inner(*inputs, lse, head_dim)
    return [to_positions(g, head_dim, group, held, t.shape[-1] // head_dim)
            for g, t in zip(grads, (q, k, v))]


def context_attention(args, groups, kernels=Kernels()):
    """Step 2's block's attention and its backward for --cp-style, over this rank's groups:
    "cp"; the hybrid's "ulysses" (U consecutive cp ranks) and "ring" (across them)."""
    layout = args.cp_layout
    if args.cp_style == "ring":
        return (partial(ring_attention, group=groups["cp"], layout=layout, kernels=kernels),
                partial(ring_attention_backward, group=groups["cp"], layout=layout,
                        kernels=kernels))
    if args.cp_style == "all-gather":
        return (partial(gathered_attention, group=groups["cp"], layout=layout, kernels=kernels),
                partial(gathered_attention_backward, group=groups["cp"], layout=layout,
                        kernels=kernels))
    inner = (kernels.attention, kernels.attention_backward)
    group = groups["cp"]
    first = 0                                              # the group's first cp rank
    if args.cp_style == "hybrid":
        group = groups["ulysses"]
        first = dist.get_rank(groups["ring"]) * args.ulysses
        inner = (partial(ring_attention, group=groups["ring"], layout=layout, kernels=kernels),
                 partial(ring_attention_backward, group=groups["ring"], layout=layout,
                         kernels=kernels))
    size = dist.get_world_size(group)
    held = [cp_chunks(first + c, args.cp, layout) for c in range(size)]
    return (partial(ulysses_attention, group=group, held=held, inner=inner[0]),
            partial(ulysses_attention_backward, group=group, held=held, inner=inner[1]))


def cp_group_lists(cp_groups, args):
    """Every cp group's ranks -> {"cp": ..} and, for the hybrid, "ulysses" (U consecutive cp
    ranks) and "ring" (one of each such group): a partition of the ranks for each."""
    lists = {"cp": cp_groups}
    if args.cp_style == "hybrid":
        U = args.ulysses
        lists["ulysses"] = sorted(g[i:i + U] for g in cp_groups for i in range(0, len(g), U))
        lists["ring"] = sorted(g[i::U] for g in cp_groups for i in range(U))
    return lists


# Part 5: the worker -------------------------------------------------------------------------------

def tp_and_cp_groups(rank, args, tp_size):
    """This rank's tp group (tp_size consecutive ranks) and --cp's groups (a cp group: one rank of
    each tp group, at its tp rank; the hybrid's two within it); every rank makes every group, in
    one order. Without cp: the world's, and no others."""
    if args.cp == 1:
        return dist.group.WORLD, {}
    world = tp_size * args.cp
    tp_groups = [list(range(c * tp_size, (c + 1) * tp_size)) for c in range(args.cp)]
    lists = cp_group_lists([list(range(t, world, tp_size)) for t in range(tp_size)], args)
    tp_group = dist.new_subgroups_by_enumeration(tp_groups)[0]
    return tp_group, {name: dist.new_subgroups_by_enumeration(lists[name])[0] for name in lists}


def kv_group(kv_heads, tp_size):
    """G < tp: this rank's kv group, the tp/G ranks of its tp group (tp innermost: consecutive
    ranks) that hold one kv head; every rank makes every group. G >= tp: None."""
    if kv_heads >= tp_size:
        return None
    holders = tp_size // kv_heads
    world = dist.get_world_size()
    return dist.new_subgroups_by_enumeration([list(range(first, first + holders))
                                              for first in range(0, world, holders)])[0]


def tp_copies(split, tp_rank, tp_size, kv_heads):
    """The tensors (their indices) another tp rank holds too and writes in a checkpoint: the
    whole and partial ones (tp rank 0 writes them), a kv head's columns (its first holder)."""
    copies = {i for i, kind in enumerate(split) if kind in ("whole", "partial") and tp_rank > 0}
    if kv_heads < tp_size and tp_rank % (tp_size // kv_heads):
        copies |= set(split_as(split, "kv"))
    return copies


def tp_worker(rank, world_size, args):
    device = setup(rank, world_size)
    tp_size = world_size // args.cp
    tp_rank = rank % tp_size                                           # tp innermost
    cp_rank = rank // tp_size
    tp_group, cp_groups = tp_and_cp_groups(rank, args, tp_size)
    cp_group = cp_groups.get("cp")
    holders = kv_group(args.kv_heads, tp_size)                         # G < tp: a kv head's
    kinds = part_kinds(args.num_layers)
    splits = tensor_kinds(kinds, args, tp_size)                        # a part's tensors'
    init = init_params(args)                                           # drawn whole, then cut
    shards = [[shard(w, k, tp_rank, tp_size, args.kv_heads).to(device)
               for w, k in zip(part, part_splits)] for part, part_splits in zip(init, splits)]
    full = tensors_of(init)
    split = tensors_of(splits)
    # The shards live in step 2's replica over a dp group of one: buckets, optimizer, no exchange.
    replica = DataParallel(shards, dist.new_subgroups(1)[0], optimizer=args.optimizer, lr=args.lr,
                           bf16=args.bf16)
    boxes = [held_boxes(w.shape, k, tp_rank, tp_size, kv_heads=args.kv_heads)   # where each
             for w, k in zip(full, split)]                                      # sits
    resumed = load_checkpoint(args, replica, range(len(full)), boxes)   # --resume: any layout's
    copies = tp_copies(split, tp_rank, tp_size, args.kv_heads)         # what others write
    if cp_rank > 0:                                                    # cp rank 0 holds the same
        copies = set(range(len(full)))
    gather = partial(whole_on_rank0, replica, full, range(len(full)), boxes, copies)   # on rank 0
    positions = cp_positions(args.context, cp_rank, args.cp, args.cp_layout)   # its places in T
    routers = None
    if args.experts:                                                   # each block's, the same
        routers = [Router(args.experts, args.top_k, device) for _ in range(args.num_layers)]
    moe = MoE(args, routers)
    blocks = tp_blocks(kinds, args, tp_group, cp_groups if args.cp > 1 else None,
                       positions.to(device), routers)
    loss_fn = partial(vocab_parallel_cross_entropy, vocab_size=args.vocab_size, group=tp_group)
    m = args.micro_batches
    losses = []
    norms = []
    check = SerialCheck(args, resumed)
    if rank == 0:
        print(f"tensor parallel over {tp_size} ranks: {describe(args, tp_size)}", flush=True)
    if rank == 0 and args.cp > 1:
        print(f"context parallel over {args.cp} ranks, {args.cp_style}, {args.cp_layout}: rank 0 "
              f"holds positions {positions.tolist()}", flush=True)
    for step in range(args.start_step, args.steps):
        inputs, targets = (t[:, positions].to(device) for t in make_batch(args, step))   # its own
        loss = dp_step(replica, blocks, loss_fn, inputs.chunk(m), targets.chunk(m),
                       args.batch_size * args.context, recompute=args.recompute)   # step 2's
        if args.sequence_parallel:   # each gain saw this rank's T/tp positions alone:
            sum_partial_grads(replica.grads(), split_as(split, "whole"), tp_group)   # summed
        # QK-norm's gains, routers: a rank's heads', its dgate's part; summed over tp
        sum_partial_grads(replica.grads(), split_as(split, "partial"), tp_group)
        if holders is not None:      # G < tp: a kv head's Wk, Wv, its holders' query heads' parts
            sum_partial_grads(replica.grads(), split_as(split, "kv"), holders)
        if args.cp > 1:   # every gradient, a partial sum over this rank's positions: summed
            sum_partial_grads(replica.grads(), range(len(full)), cp_group)   # over cp
            reduce_over(loss, cp_group)                                 # so is the loss
        moe.gather_routes(positions=positions, counted=tp_rank == 0)   # --save, --check
        if args.check:   # this step's weights and gradients, whole, against serial autograd's
            check.step(gather(grads=False), gather(grads=True), moe.step())
        if args.clip_grad:     # the norm's squares summed over the shards, a whole tensor once
            norms.append(replica.clip(args.clip_grad, [tp_group],
                                      clip_shares(split, tp_size, args.kv_heads)).item())
        if routers:                  # the loads over every position (tp's ranks: the same ones)
            moe.loads += balance(routers, args.balance_rate, counted=tp_rank == 0).cpu()
        replica.update()
        losses.append(loss.item())
        if rank == 0:
            log_step(f"[rank {rank}]", step, losses, norms, args)
        save_checkpoint(args, step + 1, replica, range(len(full)), boxes, copies, routers)
    final = gather(grads=False)                                # put together on rank 0
    if rank == 0:
        finish_run(args, full, final, losses, check, norms, resumed, moe=moe)
    cleanup()


def main(argv=None):
    args = parse_args(argv)
    spawn(tp_worker, args.world_size, args, backend=args.backend, timeout_s=args.timeout_s)


# Below the fold: its costs, the command line and its rules, and what the run says it ran. -------


from collectives import positive_int  # noqa: E402
from data_parallel import (VOCAB_SIZE, check_training_args, model_defaults,  # noqa: E402
                           model_rules, training_parser)


def tp_costs(kinds, act_bytes, rows, tp_style, num_micro_batches=1, recompute=False,
             sequence_parallel=False, summed=(), sums=1, mlp_bytes=None):
    """A tp rank's collectives a step, (kind, bytes of the tensor, times), A = act_bytes for one
    activation [b, T, D], mlp_bytes the MLP's [b, T, F] (4 A where not given). A block, each
    micro-batch: Megatron two g all-reduces forward (again with --recompute) and two f backward;
    the all-gather style all-gathers o, Wo's output, the MLP's [b, T, F] and W2's (again with
    --recompute), and all-reduces dn1, do, dm ([b, T, F]), dn2. The embedding all-reduces x, the
    head dn; the loss three [b T] of fp32. Sequence parallel: each of Megatron's all-reduces a
    reduce-scatter and an all-gather along T, the same bytes. summed: the bytes of each gradient
    summed over tp (or its kv group), sums times a step: the partial ones (QK-norm's gains,
    routers, a kv head's Wk, Wv where G < tp), and under sequence parallelism the gains."""
    m = num_micro_batches
    if mlp_bytes is None:
        mlp_bytes = 4 * act_bytes
    blocks = kinds.count("block")
    ends = ("embedding" in kinds) + ("head" in kinds)
    pairs = (blocks * (4 + 2 * recompute) + ends) * m
    if sequence_parallel:
        runs = [("all-gather", act_bytes, pairs), ("reduce-scatter", act_bytes, pairs)]
    elif tp_style == "megatron":
        runs = [("all-reduce", act_bytes, pairs)]
    else:
        gathers = blocks * (1 + recompute) * m
        runs = [("all-gather", act_bytes, 3 * gathers), ("all-gather", mlp_bytes, gathers),
                ("all-reduce", act_bytes, (3 * blocks + ends) * m),
                ("all-reduce", mlp_bytes, blocks * m)]
    runs += [("all-reduce", nbytes, sums) for nbytes in summed]
    if "head" in kinds:
        runs.append(("all-reduce", 4 * rows, 3 * m))   # m, s and l_y
    return runs


def cp_costs(blocks, rows, shape, tp, num_micro_batches=1, buckets=(), reductions=1):
    """A cp rank's exchanges a step, {group: [(kind, bytes, times)]}, rows = b T/C, shape the
    run's (Shape: dim, heads, kv_heads, cp, cp_style, ulysses, bf16, recompute); each block and
    micro-batch, a forward f = 1 (2 with --recompute) times and a backward:
      ring        K and V of its kv heads [2, b, T/C, G/tp dh] (dh where G < tp; never repeated
                  to the query heads) to the next rank C-1 times a pass, and dK, dV in fp32 C
                  times (home)
      all-gather  [K | V] gathered over cp a pass; dK, dV reduce-scattered in fp32
      ulysses     all-to-alls of [b, T/C, ..]: q, k, v and o each forward; do, q, k, v, o and dq,
                  dk, dv back; k, v as sent, their copies too (G/tp < C)
      hybrid      Ulysses over "ulysses" (U), then the ring over "ring" (C/U) on U T/C positions
                  and G/tp/U kv heads
    and "cp": each gradient bucket (its bytes) summed over cp as often as the dp exchange."""
    if shape.cp == 1:
        return {}
    m = num_micro_batches
    f = 1 + shape.recompute
    s = 2 if shape.bf16 else 4
    C = shape.cp
    head_dim = shape.dim // shape.heads
    kv_heads = max(shape.kv_heads // tp, 1)
    runs = {"cp": []}
    if shape.cp_style == "all-gather":
        kv = 2 * rows * C * kv_heads * head_dim
        runs["cp"] = [("all-gather", kv * s, (f + 1) * blocks * m),
                      ("reduce-scatter", kv * 4, blocks * m)]
    U = {"ulysses": C, "hybrid": shape.ulysses}.get(shape.cp_style, 1)
    ring = C // U
    kv = rows * U * max(kv_heads // U, 1) * head_dim   # after Ulysses: U T/C positions, a head
    if U > 1:                                          # at least: as sent
        q = rows * shape.dim // tp * s                 # q's [b, T/C, h/tp dh]
        runs["cp" if ring == 1 else "ulysses"] = [("all-to-all", q, (2 * f + 4) * blocks * m),
                                                  ("all-to-all", kv * s, (2 * f + 4) * blocks * m)]
    if ring > 1 and shape.cp_style != "all-gather":
        runs["cp" if U == 1 else "ring"] = [("send", 2 * kv * s, (ring - 1) * (f + 1) * blocks * m),
                                            ("send", 2 * kv * 4, ring * blocks * m)]
    runs["cp"] += [("all-reduce", nbytes, reductions) for nbytes in buckets]
    return runs


def kv_width(dim, heads, kv_heads, tp):   # a tp rank's k [.., G/tp dh] (G < tp: one head, dh)
    return max(kv_heads // tp, 1) * (dim // heads)


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


class Attention(NamedTuple):
    """A fused attention kernel (FlashAttention's) over `sequences` query heads' [context, dh]
    each and keys [keys, dh] (0: as many), its forward or its backward: q, o of in_bytes an
    element, k and v kv_share of q's heads (G/h: each kv head read once for its group), lse fp32.
    Causal, it computes the tiles on and below the diagonal, half of a square (a pair off the
    diagonal: all of it), and writes none of them to memory."""
    sequences: int
    context: int
    head_dim: int
    in_bytes: int
    backward: bool
    accumulate: bool = False                  # as a Matmul's: nothing is added into
    causal: bool = True
    kv_share: float = 1.0
    keys: int = 0

    def flops(self):   # half of 2 s t dh a product: S, A v; back: S again, dv, dA, dq and dk
        products = 5 if self.backward else 2
        keys = self.keys or self.context
        return products * self.sequences * self.context * keys * self.head_dim * (2 - self.causal)

    def bytes_moved(self):   # q, k, v in, o out; back: q, k, v, o, do in, dq, dk, dv out; lse
        rows = self.sequences * self.head_dim * self.in_bytes
        queries = rows * self.context
        keys = rows * (self.keys or self.context) * self.kv_share
        lse = self.sequences * self.context * 4
        if self.backward:
            return 5 * queries + 4 * keys + lse
        return 2 * queries + 2 * keys + lse


def block_matmuls(kind, rows, shape, tp, classes=0):
    """A tp rank's part ("block" or "head"), a micro-batch of rows positions, shape the run's
    flags (dim, heads, kv_heads, ffn_dim, context, tp_style, bf16, cp, cp_layout, cp_style,
    ulysses, experts, top_k, ep): its matmuls' (forwards, backwards' dx, dWs into the fp32
    gradient); a block's seven weights, and its h/tp heads' attention, fused kernels forward and
    back, as a GPU runs them (attention_kernels). What --plan prices and
    tests/gpu_path.py records. --experts: the router's three fp32 matmuls, and each of the E/ep
    experts here its W1's, W3's and W2's over rows K ep / E pairs (balanced: as many as the dense
    MLP's rows K), its dWs in the backward (experts_backward's), in place of the MLP's."""
    size = 2 if shape.bf16 else 4
    D = shape.dim
    F = shape.ffn_dim
    kv = kv_width(D, shape.heads, shape.kv_heads, tp)

    def linear(n_in, n_out, m=rows):
        return (Matmul(m, n_in, n_out, size, size, accumulate=False),      # z = x W
                Matmul(m, n_out, n_in, size, size, accumulate=False),      # dx = dz W^T
                Matmul(n_in, m, n_out, size, 4, accumulate=True))          # dW += x^T dz
    if kind == "head":
        return [[m] for m in linear(D, classes)]
    row = shape.tp_style == "megatron"
    wo = linear(D // tp, D) if row else linear(D, D // tp)
    w2 = linear(F // tp, D) if row else linear(F, D // tp)
    layers = [linear(D, D // tp), linear(D, kv), linear(D, kv), wo]
    if not shape.experts:
        layers += [linear(D, F // tp), linear(D, F // tp), w2]
    forwards, dxs, dws = (list(column) for column in zip(*layers))
    if shape.experts:                    # every dW in the backward (experts_backward's)
        E = shape.experts
        routed = rows * shape.top_k * shape.ep // E                      # an expert's pairs
        w1 = linear(D, F // tp, routed)
        w2 = linear(F // tp, D, routed) if row else linear(F, D // tp, routed)
        forwards += [Matmul(rows, D, E, 4, 4, accumulate=False)]          # gate = softmax(n Wr)
        dxs += [Matmul(rows, E, D, 4, 4, accumulate=False),               # dn = ds Wr^T
                Matmul(D, rows, E, 4, 4, accumulate=False)]               # dWr = n^T ds
        for _ in range(E // shape.ep):
            forwards += [w1[0], w1[0], w2[0]]                             # W1, W3 alike
            dxs += [w1[1], w1[2], w1[1], w1[2], w2[1], w2[2]]
    kernels = attention_kernels(shape, rows * shape.cp // shape.context, tp, size)
    return forwards + kernels, dxs + [k._replace(backward=True) for k in kernels], dws


def attention_kernels(shape, b, tp, size):
    """The fused kernels of a block's attention forward on the busiest cp rank (C-1: its pairs
    the most under contiguous, the same count under zigzag), over b sequences of the h/tp heads:
    without --cp one, causal over T; ring: each pair of chunks; all-gather: each chunk's
    diagonal, and its keys before it in one; ulysses: one over T, on h/tp/C heads; hybrid: the
    ring of C/U ranks on h/tp/U. bf16's flash reads each kv head for its group (kv_share: kv heads
    over query heads); fp32's kernel takes them repeated."""
    C = shape.cp
    style = shape.cp_style if C > 1 else "ring"
    U = {"ulysses": C, "hybrid": shape.ulysses}.get(style, 1)       # the heads' split
    heads = shape.heads // tp // U
    kv_share = 1.0
    if shape.bf16:
        kv_share = max(max(shape.kv_heads // tp, 1) // U, 1) / heads
    head_dim = shape.dim // shape.heads
    ring = C // U                                                   # the ring's ranks
    chunk = shape.context // (ring * (1 + (ring > 1 and shape.cp_layout == "zigzag")))
    kernel = Attention(b * heads, chunk, head_dim, size, False, kv_share=kv_share, keys=chunk)
    if style == "all-gather":
        mine = cp_chunks(C - 1, C, shape.cp_layout)
        return [kernel] * len(mine) + [kernel._replace(causal=False, keys=i * chunk)
                                       for i in mine if i > 0]
    if style == "ulysses":
        return [kernel._replace(context=shape.context, keys=shape.context)]
    diagonal, off = cp_pair_counts(ring, shape.cp_layout)
    return [kernel] * diagonal + [kernel._replace(causal=False)] * off


def cp_pair_counts(cp, layout):   # the busiest rank's pairs: (on the diagonal, below it)
    if cp == 1:
        return 1, 0
    if layout == "zigzag":
        return 2, 2 * cp - 1
    return 1, cp - 1


def describe(args, tp_size):   # what ran: "h/tp = 2 heads a rank, Megatron's pairs, ..."
    style = {"megatron": "Megatron's pairs (Wq Wk Wv W1 W3 column, Wo W2 row)",
             "all-gather": "every weight column-parallel, each output all-gathered"}
    sequence = ", the residual stream by T/tp rows" * args.sequence_parallel
    kv = f"{args.kv_heads // tp_size} of {args.kv_heads} kv heads"
    if args.kv_heads < tp_size:
        kv = f"1 of {args.kv_heads} kv heads, on {tp_size // args.kv_heads} ranks each"
    return (f"{args.heads // tp_size} of {args.heads} query heads a rank and {kv}, "
            f"{style[args.tp_style]}{sequence}, the embedding and the head by class")


def add_context_parallel(parser):
    parser.add_argument("--cp", type=positive_int, default=1, help="context parallelism: the ranks "
                        "of a cp group C, each holding T/C positions of every sequence")
    parser.add_argument("--cp-layout", choices=["zigzag", "contiguous"], default="zigzag",
                        help="zigzag: 2C chunks of T, rank r holds r and 2C-1-r (balanced); "
                             "contiguous: rank r holds the r-th T/C (rank C-1 does C times rank "
                             "0's attention)")
    parser.add_argument("--cp-style", choices=["ring", "all-gather", "ulysses", "hybrid"],
                        default="ring", help="attention over cp: K, V around a ring; gathered "
                        "whole (Llama 3's); heads split by all-to-all (Ulysses); Ulysses in "
                        "groups of --ulysses U ranks, the ring across them")
    parser.add_argument("--ulysses", type=positive_int, default=1,
                        help="with --cp-style hybrid: the ranks of a Ulysses group, dividing C")


def context_parallel_rules(args, tp_size):   # T in the layout's chunks; SP: a rank's T/C by tp;
    chunks = args.cp * (2 if args.cp_layout == "zigzag" else 1)   # Ulysses' heads over its ranks
    U = {"ulysses": args.cp, "hybrid": args.ulysses}.get(args.cp_style, 1)
    heads = args.heads // tp_size
    kv_heads = max(args.kv_heads // tp_size, 1)
    style = f"--cp-style {args.cp_style}"
    if args.cp_style == "hybrid":
        style = f"--cp-style hybrid --ulysses {U}"
    return [(args.cp > 1 and args.context % chunks, f"--cp {args.cp}: --context {args.context} is "
             f"not divisible by {chunks}, the {args.cp_layout} layout's chunks"),
            (args.cp > 1 and args.sequence_parallel and args.context // args.cp % tp_size,
             f"--sequence-parallel with --cp {args.cp}: a rank's {args.context // args.cp} "
             f"positions do not split over the {tp_size} tp ranks"),
            (args.cp == 1 and args.cp_style != "ring", f"--cp-style {args.cp_style}: only with "
                                                       f"--cp above 1"),
            (args.ulysses > 1 and args.cp_style != "hybrid", f"--ulysses {args.ulysses}: only "
                                                             f"with --cp-style hybrid"),
            (args.cp_style == "hybrid" and (not 1 < U < args.cp or args.cp % U),
             f"--ulysses {U}: a Ulysses group is 2 or more of the --cp {args.cp} ranks, dividing "
             f"them (--cp-style ulysses: all of them)"),
            (args.cp > 1 and heads % U, f"{style}: the {heads} query heads a tp rank holds do not "
                                        f"split over {U} ranks"),
            (args.cp > 1 and kv_heads % U and U % kv_heads,
             f"{style}: the {kv_heads} kv heads a tp rank holds neither split over {U} ranks "
             f"nor divide them")]


def add_sequence_parallel(parser):
    parser.add_argument("--sequence-parallel", action="store_true", help="with --tp-style "
                        "megatron: the residual stream and its norms split along T over tp")


def sequence_parallel_rules(args, tp_size, tp_flag):   # broken with --sequence-parallel alone
    on = args.sequence_parallel
    return [(on and args.tp_style != "megatron", f"--sequence-parallel: needs --tp-style megatron "
                                                 f"(the all-gather style keeps activations whole)"),
            (on and args.context % tp_size, f"--sequence-parallel: --context {args.context} is "
                                            f"not divisible by {tp_flag} ({tp_size}), the T/tp "
                                            f"rows a rank")]


def tp_model_rules(args, tp_size, tp_flag):   # the block's cuts: whole kv heads, F/tp columns
    G = args.kv_heads
    return [(G % tp_size and tp_size % G, f"--kv-heads {G} and {tp_flag} ({tp_size}): neither "
             f"divides the other, and a rank's query heads read whole kv heads (tp dividing G: "
             f"G/tp a rank; G dividing tp: each held by the tp/G ranks that read it)"),
            divides(args.ffn_dim, "--ffn-dim", tp_size, tp_flag)]


def divides(value, flag, divisor, divisor_flag):   # a rule: broken if value % divisor
    return value % divisor, f"{flag} {value} is not divisible by {divisor_flag} ({divisor})"


def refuse_unused(parser, args, used, mode):   # a flag this mode ignores is refused
    parser.refuse((name not in used and value != parser.get_default(name),
                   f"--{name.replace('_', '-')}: not used with {mode}")
                  for name, value in vars(args).items())


def parse_args(argv=None):
    parser = training_parser("Tensor parallelism: column-parallel layers with an all-gather.")
    parser.add_argument("--world-size", type=positive_int, default=4,
                        help="ranks (tp, times --cp); tp divides --heads")
    parser.add_argument("--tp-style", choices=["all-gather", "megatron"], default="all-gather",
                        help="every layer column-parallel with an all-gather, or Megatron's pairs")
    add_sequence_parallel(parser)
    add_context_parallel(parser)
    args = parser.parse_args(argv)
    model_defaults(args)
    tp_size = args.world_size // args.cp
    parser.refuse([*model_rules(args), (args.world_size % args.cp, f"--cp {args.cp} does not "
                                                                   f"divide --world-size "
                                                                   f"{args.world_size}"),
                   *context_parallel_rules(args, tp_size)])
    tp_flag = "--world-size"
    if args.cp > 1:
        tp_flag = "--world-size / --cp"
    parser.refuse([divides(args.heads, "--heads", tp_size, tp_flag),
                   *tp_model_rules(args, tp_size, tp_flag),
                   *sequence_parallel_rules(args, tp_size, tp_flag),
                   (tp_size > VOCAB_SIZE, f"--world-size {args.world_size}: more tp ranks "
                                          f"than the vocabulary's {VOCAB_SIZE} classes")])
    parser.refuse([(args.ep > 1, f"--ep {args.ep}: step 3 has no replicas to hold the experts "
                                 f"(data_parallel.py, three_d.py)")])
    check_training_args(parser, args, args.world_size)
    return args


if __name__ == "__main__":
    run_main(main)
