"""Step 3: tensor parallelism. Every block is split across the ranks, a head a unit, and so is
the vocabulary.

    python tensor_parallel.py                           # 4 ranks share each block
    python tensor_parallel.py --world-size 2 --check
    python tensor_parallel.py --tp-style megatron       # Megatron's column-then-row pairs
    python tensor_parallel.py --cp 4 --check            # context parallelism: ring attention
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

In a block, heads are the unit: Wq, Wk and Wv are cut at head boundaries, so rank t holds h/tp
whole heads, q, k and v [b, T, D/tp], and runs their attention with no collective at all. Two
styles then differ in what follows (GatherSplit and MegatronSplit below; step 2's block takes
either). The norms' gains and P are whole on every rank: each rank's x is the whole residual
stream, the same on all, and the dn its norm's backward reads comes after f's all-reduce, the
same on all too, so every rank computes the same dg and dP with no collective.

Bytes each rank sends per block and micro-batch, A for one activation [b, T, D]: the all-gather
style 7(tp-1)/tp A forward (o, its Wo, the MLP's 4D, its W2) and 2 x 7(tp-1)/tp A backward;
Megatron's pairs (Megatron-LM, torchtitan) 2 x 2(tp-1)/tp A each way: 8(tp-1)/tp A, where the
all-gather style sends 21(tp-1)/tp A. The vocabulary's ends split its rows of E and columns of H,
and take the softmax in pieces (Megatron's vocab-parallel embedding and cross-entropy).

--recompute keeps each block's input alone, as in step 2: the forward again in the backward, its
collectives too (tp_costs).

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
from collectives import exchange
from data_parallel import (Block, DataParallel, MoE, Router, attention, attention_backward,
                           balance, block_backward, block_forward, dp_step, expert_boxes, fused,
                           fused_attention, fused_attention_backward, head_backward, head_forward,
                           heads, init_params, make_batch, scores, tensors_of, wide, wide_matmul)
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


def my_rows(x, group=None):   # rank t's T/tp rows of x [T, ..]: its positions' P
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
    """Megatron's pairs: Wq, Wk, Wv and W1 are column layers (rank t holds W[:, cols_t]) whose
    outputs stay sharded: attention runs on this rank's heads, GELU on its columns. Wo and W2 are
    row layers (rank t holds W[rows_t, :]) that take the shard as it is: o Wo = sum_t o_t Wo_t.

      forward   n, the same on every rank                  f: the identity
                q_t, k_t, v_t = n Wq_t ..; o_t = attention of this rank's heads   [b, T, D/tp]
                y = sum_t o_t Wo_t                         g: all-reduce   [b, T, D]
      backward  dy, the same on every rank                 g: the identity
                dWo_t = o_t^T dy     do_t = dy Wo_t^T      this rank's own: no communication
                dq_t, dk_t, dv_t from do_t; dWq_t = n^T dq_t ..
                dn = sum_t dq_t Wq_t^T + dk_t Wk_t^T + dv_t Wv_t^T    f: all-reduce   [b, T, D]

    and the MLP alike (W1 column, GELU on the shard, W2 row). f and g are conjugates, a
    forward/backward pair each: f copies in forward and all-reduces in backward; g all-reduces
    in forward and copies in backward. Per block and micro-batch: two g, two f, 8(tp-1)/tp A."""

    def __init__(self, group):
        self.group = group

    def f(self, n):                           # f forward: the identity
        return n

    def gather(self, a):                      # o_t, gelu(z)_t stay sharded
        return a

    def gather_back(self, dy):
        return dy

    def g(self, y):                           # g forward: y = sum_t o_t Wo_t   2(tp-1)/tp A
        return reduce_over(y, self.group)

    def g_back(self, dy):                     # g backward: the identity
        return dy

    def f_back(self, dx):                     # f backward: dx = sum_t dz_t W_t^T   2(tp-1)/tp A
        return reduce_over(dx, self.group)

    attend = staticmethod(attention)          # this rank's heads, alone (--cp: over the ring)
    attend_back = staticmethod(attention_backward)

    def row_back(self, dx):                   # a row layer's dx, do_t = dy Wo_t^T: this rank's
        return dx


class GatherSplit(MegatronSplit):
    """The lecture's style: every weight a column layer, each output all-gathered. q, k, v as
    above; o_t all-gathered [b, T, D], the input of Wo's column layer, whose output [b, T, D/tp]
    is all-gathered; GELU(n W1_t) all-gathered [b, T, 4D]; W2's output all-gathered. Backward:
    each all-gather a slice, each column layer's dx an all-reduce (f): Wo's, W2's too."""

    def gather(self, a):                      # [b, T, n/tp] -> [b, T, n]   (tp-1)/tp of it
        return all_gather_columns(a, self.group)

    def gather_back(self, dy):                # the slice: this rank's columns, its own
        return my_columns(dy, self.group).contiguous()   # (a view would hold all of dy)

    def g(self, y):                           # Wo's, W2's outputs gathered, as gelu's
        return self.gather(y)

    def g_back(self, dy):
        return self.gather_back(dy)

    def row_back(self, dx):                   # Wo, W2: column layers here, so f's all-reduce
        return self.f_back(dx)


class SequenceSplit(MegatronSplit):
    """Sequence parallelism (Korthikanti et al. 2022) on Megatron's pairs: from a row layer to
    the next column layer each rank holds rows_t of T, [b, T/tp, D], and runs the residual adds
    and the norms on them. f becomes an all-gather along T, g a reduce-scatter: an all-reduce's
    bytes, and x, x' and r held by 1/tp. A gain sees T/tp positions, P its rows_t: dg and dP
    are partial sums, summed over tp after the backward (tp_worker's sum_partial_grads; an
    average would give 1/tp of the gradient).

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
#              rest, and an all-reduce adds the pieces (each token has one owner); P after it.
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
                            sequence_parallel=False, positions=None):
    """The tokens [b, T] this rank holds, looked up, zeros for the rest, summed; + P: [b, T, D]
    (sequence parallel: reduce-scattered along T instead, + P's rows of this rank's T/tp).
    positions: --cp's, this rank's places in T [T/C], P's rows at them."""
    e_t, p = w
    if positions is not None:
        p = p[positions]
    start, end = vocab_range(vocab_size, dist.get_rank(group), dist.get_world_size(group))
    outside = (tokens < start) | (tokens >= end)                       # [b, T]
    local = (tokens - start).masked_fill(outside, 0)                   # any row: masked below
    x = e_t[local].masked_fill(outside[..., None], 0.0)                # [b, T, D]
    if sequence_parallel:
        return scatter_along_T(x, group) + my_rows(p, group), (local, outside)
    reduce_over(x, group)                     # x = sum_t its tokens' rows   2(tp-1)/tp A
    return x + p, (local, outside)


def vocab_embedding_backward(g, stash, w, need_dx=False, group=None, sequence_parallel=False,
                             positions=None):
    """g [b, T, D], the same on every rank: each keeps its own tokens' rows, for dE_t[local];
    dP from the whole g, step 2's. Sequence parallel: g [b, T/tp, D], all-gathered along T for
    dE_t; dP from g alone, P's rows of this rank's T/tp (partial: summed over tp). --cp: dP's
    rows at this rank's places in T."""
    local, outside = stash
    places = torch.arange(local.shape[1], device=local.device)        # [T]: P's rows, in order
    if positions is not None:                                         # --cp: its places in T
        places = positions
    g_all = g
    if sequence_parallel:
        places = my_rows(places, group)                               # its T/tp rows' places
        g_all = gather_along_T(g, group)
    places = places.expand(g.shape[0], -1)                            # [b, T(/tp)]: a row each
    return None, [(local, g_all.masked_fill(outside[..., None], 0.0)), (places, g)]


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


def sum_partial_grads(grads, whole, group):   # sequence parallel: dg, dP summed (not averaged)
    for i in whole:
        reduce_over(grads[i], group)


def tp_blocks(kinds, tp_style, head_dim, group=None, vocab_size=None, sequence_parallel=False,
              cp_group=None, cp_layout="zigzag", positions=None, routers=None):
    """Each part's forward and backward over group, by kind ("embedding", "block", "head"): what
    tp_worker runs, and 3D's stages. A block is step 2's, handed this style's split. The head's
    own split gathers along T before H under sequence parallelism: the vocab-parallel loss takes
    whole rows of logits, each position's every class. cp_group: attention over its ring, P's
    rows at this rank's positions. routers: the blocks' in order (--experts)."""
    split = GatherSplit(group) if tp_style == "all-gather" else MegatronSplit(group)
    ends = MegatronSplit(group)
    if sequence_parallel:
        split = SequenceSplit(group)
        ends = split
    if cp_group is not None:
        split.attend = partial(ring_attention, group=cp_group, layout=cp_layout)
        split.attend_back = partial(ring_attention_backward, group=cp_group, layout=cp_layout)
    routers = iter(routers if routers else [])
    outer = {"embedding": Block(partial(vocab_embedding_forward, group=group,
                                        vocab_size=vocab_size,
                                        sequence_parallel=sequence_parallel,
                                        positions=positions),
                                partial(vocab_embedding_backward, group=group,
                                        sequence_parallel=sequence_parallel,
                                        positions=positions)),
             "head": Block(partial(head_forward, split=ends), partial(head_backward, split=ends))}
    blocks = []
    for kind in kinds:
        if kind == "block":
            block = dict(head_dim=head_dim, split=split, router=next(routers, None))
            blocks.append(Block(partial(block_forward, **block), partial(block_backward, **block)))
        else:
            blocks.append(outer[kind])
    return blocks


def part_kinds(num_layers):   # the model's parts, in order
    return ["embedding", *["block"] * num_layers, "head"]


def tensor_kinds(kinds, tp_style, experts=0):
    """How each part's tensors are split: "embedding" (E's rows by class), "head" (H's
    columns by class), "column", "row", "whole" (a gain, P): the same on every rank, or
    "router" (whole, its gradient a sum over tp). An expert's W1, W2 [E, ..] as the MLP's."""
    mlp_out = "column" if tp_style == "all-gather" else "row"          # Wo, W2
    mlp = ["router", "column", mlp_out] if experts else ["column", mlp_out]
    by_part = {"embedding": ["embedding", "whole"], "head": ["whole", "head"],
               "block": ["whole", "column", "column", "column", mlp_out, "whole", *mlp]}
    return [by_part[part] for part in kinds]


def split_as(kinds, kind):   # the tensors split as kind
    return [i for i, k in enumerate(kinds) if k == kind]


def clip_shares(kinds, tp_size):   # each tensor's share of its squares: a whole one's, 1/tp
    return [1 / tp_size if kind in ("whole", "router") else 1.0 for kind in kinds]


def shard(w, kind, tp_rank, tp_size):
    """Rank t's part of a whole tensor, as a copy even when tp = 1 (where a slice would be W
    itself): the optimizer updates the shard in place, and the whole must stay the initial one."""
    row_start, row_end, col_start, col_end = shard_box(w.shape, kind, tp_rank, tp_size)
    if w.dim() == 1:                      # a gain: whole
        return w.clone()
    return w[..., row_start:row_end, col_start:col_end].clone(   # an expert's [E, ..]: each's
        memory_format=torch.contiguous_format)


def held_boxes(shape, kind, tp_rank, tp_size, experts=None):
    """shard_box's; an expert tensor [E, R, C]'s: a list, each held expert's box (experts: their
    indices, all if None) in the whole seen as [E R, C] (step 2's expert_boxes)."""
    box = shard_box(shape, kind, tp_rank, tp_size)
    if len(shape) < 3:
        return box
    if experts is None:
        experts = range(shape[0])
    return expert_boxes(shape, experts, box)


def shard_box(shape, kind, tp_rank, tp_size):
    """Rank t's rows and columns of a whole tensor, (row_start, row_end, col_start, col_end): its
    rows W[t D/tp : (t+1) D/tp, :] for a row layer, its classes' rows of E or columns of H, its
    columns of a column layer, else all (a gain [D]: one row). (Where its piece sits in the
    whole: shard's, and a checkpoint's.)"""
    rows, cols = (1, *shape)[-2:]
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
# positions (E's rows, P's at their global places) and runs the norms, the matmuls, the head and
# the loss on them alone; only attention needs the others'. Ring attention: the keys and values
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
# Backward, per pair, with the merged lse_i and D_i = rowsum(do_i o_i) (step 2's identity: D needs
# no other rank's keys): A = exp(S_ij - lse_i), dv_j += A^T do_i, dS = A (dA - D_i), dq_i += dS k_j,
# dk_j += dS^T q_i. dq stays; dk and dv travel the ring with their block, C hops: back at its owner.

def cp_chunks(cp_rank, cp_size, layout):   # the chunks of T this rank holds, in order
    if layout == "zigzag":
        return [cp_rank, 2 * cp_size - 1 - cp_rank]
    return [cp_rank]


def cp_positions(context, cp_rank, cp_size, layout):   # [T/C]: its positions' places in T
    chunks = cp_chunks(cp_rank, cp_size, layout)
    size = context // (len(chunks) * cp_size)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks])


def pair_scores(q, k, head_dim, diagonal):   # S of a chunk pair: causal on the diagonal alone
    if diagonal:
        return scores(q, k, head_dim)
    return wide_matmul(q / head_dim ** 0.5, k.transpose(-1, -2))


def pair_attention(q_i, k_j, v_j, head_dim, diagonal):
    """A pair's partial attention: o_ij [b, h, s, dh] fp32 and lse_ij [b, h, s] (a GPU: the
    fused kernel's, causal on the diagonal, the same two)."""
    if fused(q_i, head_dim, flash_only=True):     # a GPU's bf16: flash's kernel (fp32: as below)
        return fused_attention(q_i, k_j, v_j, causal=diagonal)
    s_ij = pair_scores(q_i, k_j, head_dim, diagonal)
    lse_ij = s_ij.logsumexp(-1)
    return (s_ij - lse_ij[..., None]).exp() @ wide(v_j), lse_ij


def pair_attention_backward(do_i, q_i, k_j, v_j, o_i, lse_i, d_i, head_dim, diagonal):
    """The pair's share of dq_i, dk_j, dv_j, from the merged o_i, lse_i and D_i = rowsum(do o):
    A = exp(S_ij - lse_i), dv = A^T do, dS = A (dA - D_i), dq = dS k / sqrt(dh), dk = dS^T q."""
    if fused(q_i, head_dim, flash_only=True):
        return fused_attention_backward(do_i, q_i, k_j, v_j, o_i.to(q_i.dtype), lse_i,
                                        causal=diagonal)
    a = pair_scores(q_i, k_j, head_dim, diagonal).sub_(lse_i[..., None]).exp_()
    dv = a.transpose(-1, -2) @ wide(do_i)
    ds = a * (wide_matmul(do_i, v_j.transpose(-1, -2)) - d_i)
    return ds @ wide(k_j) / head_dim ** 0.5, ds.transpose(-1, -2) @ wide(q_i) / head_dim ** 0.5, dv


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


def ring_attention(q, k, v, head_dim, group=None, layout="zigzag"):
    """Causal attention of this rank's positions over all of T: o [b, n, h dh] (n = T/C) and lse
    [b, h, n]. Step t holds the keys and values of cp rank r - t, the next block coming in (and
    this one leaving) under the pairs' computation."""
    size = dist.get_world_size(group)
    r = dist.get_rank(group)
    right, left = ring_neighbours(group)
    q, k, v = (heads(t, head_dim).contiguous() for t in (q, k, v))   # [b, h, n, dh]
    mine = cp_chunks(r, size, layout)
    s = q.shape[2] // len(mine)
    outs = [None] * len(mine)
    lses = [None] * len(mine)
    kv = torch.stack([k, v])                                          # [2, b, h, n, dh]
    for step in range(size):
        if step < size - 1:
            incoming = torch.empty_like(kv)
            works = exchange(kv, incoming, right, left, group, wait=False)
        for a, (i, q_i) in enumerate(zip(mine, q.split(s, 2))):
            held = zip(cp_chunks((r - step) % size, size, layout), kv[0].split(s, 2),
                       kv[1].split(s, 2))
            for j, k_j, v_j in held:
                if j > i:
                    continue
                o_ij, lse_ij = pair_attention(q_i, k_j, v_j, head_dim, diagonal=i == j)
                outs[a], lses[a] = merge(outs[a], lses[a], o_ij, lse_ij)
        if step < size - 1:
            for work in works:
                work.wait()
            kv = incoming
    o = torch.cat(outs, 2).to(v.dtype)
    return o.transpose(1, 2).flatten(-2), torch.cat(lses, 2)


def ring_attention_backward(do, q, k, v, o, lse, head_dim, group=None, layout="zigzag"):
    """dq, dk, dv [b, n, h dh]: each pair's A made again from the merged lse; dk and dv summed
    into a buffer that travels with its block (fp32), home after C hops."""
    size = dist.get_world_size(group)
    r = dist.get_rank(group)
    right, left = ring_neighbours(group)
    do, q, k, v, o = (heads(t, head_dim).contiguous() for t in (do, q, k, v, o))
    d = (wide(do) * wide(o)).sum(-1, keepdim=True)                    # D = rowsum(do * o)
    mine = cp_chunks(r, size, layout)
    s = q.shape[2] // len(mine)
    dq = torch.zeros_like(q, dtype=wide(q).dtype)
    kv = torch.stack([k, v])
    dkv = torch.zeros_like(kv, dtype=dq.dtype)                        # this block's dk, dv
    for step in range(size):
        if step < size - 1:
            incoming = torch.empty_like(kv)
            works = exchange(kv, incoming, right, left, group, wait=False)
        rows = zip(mine, q.split(s, 2), do.split(s, 2), o.split(s, 2), d.split(s, 2),
                   lse.split(s, 2), dq.split(s, 2))
        for i, q_i, do_i, o_i, d_i, lse_i, dq_i in rows:
            held = zip(cp_chunks((r - step) % size, size, layout), kv[0].split(s, 2),
                       kv[1].split(s, 2), dkv[0].split(s, 2), dkv[1].split(s, 2))
            for j, k_j, v_j, dk_j, dv_j in held:
                if j > i:
                    continue
                dq_ij, dk_ij, dv_ij = pair_attention_backward(do_i, q_i, k_j, v_j, o_i, lse_i,
                                                              d_i, head_dim, diagonal=i == j)
                dq_i += dq_ij
                dk_j += dk_ij
                dv_j += dv_ij
        if size > 1:                                                  # the block's sums, on
            arriving = torch.empty_like(dkv)
            exchange(dkv, arriving, right, left, group)
            dkv = arriving
        if step < size - 1:
            for work in works:
                work.wait()
            kv = incoming
    grads = (dq, *dkv)
    return [t.to(q.dtype).transpose(1, 2).flatten(-2) for t in grads]


def tp_and_cp_groups(rank, tp_size, cp_size):
    """This rank's tp group (tp_size consecutive ranks) and cp group (one rank of each tp group,
    at its tp rank); every rank makes every group, in one order. Without cp: the world's, none."""
    if cp_size == 1:
        return dist.group.WORLD, None
    world = tp_size * cp_size
    tp_groups = [dist.new_group(list(range(c * tp_size, (c + 1) * tp_size)))
                 for c in range(cp_size)]
    cp_groups = [dist.new_group(list(range(t, world, tp_size))) for t in range(tp_size)]
    return tp_groups[rank // tp_size], cp_groups[rank % tp_size]


def tp_worker(rank, world_size, args):
    device = setup(rank, world_size)
    tp_size = world_size // args.cp
    tp_rank = rank % tp_size                                           # tp innermost
    cp_rank = rank // tp_size
    tp_group, cp_group = tp_and_cp_groups(rank, tp_size, args.cp)
    kinds = part_kinds(args.num_layers)
    splits = tensor_kinds(kinds, args.tp_style, args.experts)          # a part's tensors'
    init = init_params(args)                                           # drawn whole, then cut
    shards = [[shard(w, k, tp_rank, tp_size).to(device) for w, k in zip(part, part_splits)]
              for part, part_splits in zip(init, splits)]
    full = tensors_of(init)
    split = tensors_of(splits)
    # The shards live in step 2's replica over a dp group of one: buckets, optimizer, no exchange.
    replica = DataParallel(shards, dist.new_subgroups(1)[0], optimizer=args.optimizer, lr=args.lr,
                           bf16=args.bf16)
    boxes = [held_boxes(w.shape, k, tp_rank, tp_size) for w, k in zip(full, split)]   # where
    resumed = load_checkpoint(args, replica, range(len(full)), boxes)   # --resume: any layout's
    whole = split_as(split, "whole")                                   # the gains and P
    copies = set()                                                     # rank 0 writes them:
    if tp_rank > 0:                                                    # the gains, P, routers
        copies = {*whole, *split_as(split, "router")}
    if cp_rank > 0:                                                    # cp rank 0 holds the same
        copies = set(range(len(full)))
    gather = partial(whole_on_rank0, replica, full, range(len(full)), boxes, copies)   # on rank 0
    positions = cp_positions(args.context, cp_rank, args.cp, args.cp_layout)   # its places in T
    routers = None
    if args.experts:                                                   # each block's, the same
        routers = [Router(args.experts, args.top_k, device) for _ in range(args.num_layers)]
    moe = MoE(args, routers)
    blocks = tp_blocks(kinds, args.tp_style, args.dim // args.heads, tp_group, args.vocab_size,
                       args.sequence_parallel, cp_group, args.cp_layout, positions.to(device),
                       routers)
    loss_fn = partial(vocab_parallel_cross_entropy, vocab_size=args.vocab_size, group=tp_group)
    m = args.micro_batches
    losses = []
    norms = []
    check = SerialCheck(args, resumed)
    if rank == 0:
        print(f"tensor parallel over {tp_size} ranks: {describe(args, tp_size)}", flush=True)
    if rank == 0 and args.cp > 1:
        print(f"context parallel over {args.cp} ranks, {args.cp_layout}: rank 0 holds positions "
              f"{positions.tolist()}", flush=True)
    for step in range(args.start_step, args.steps):
        inputs, targets = (t[:, positions].to(device) for t in make_batch(args, step))   # its own
        loss = dp_step(replica, blocks, loss_fn, inputs.chunk(m), targets.chunk(m),
                       args.batch_size * args.context, recompute=args.recompute)   # step 2's
        if args.sequence_parallel:   # each gain and P saw this rank's T/tp positions alone:
            sum_partial_grads(replica.grads(), whole, tp_group)        # summed over tp
        if routers:                  # each router's, from its part of every dp_e: summed over tp
            sum_partial_grads(replica.grads(), split_as(split, "router"), tp_group)
        if args.cp > 1:   # every gradient, a partial sum over this rank's positions: summed
            sum_partial_grads(replica.grads(), range(len(full)), cp_group)   # over cp
            reduce_over(loss, cp_group)                                 # so is the loss
        moe.gather_routes(positions=positions, counted=tp_rank == 0)   # --save, --check
        if args.check:   # this step's weights and gradients, whole, against serial autograd's
            check.step(gather(grads=False), gather(grads=True), moe.step())
        if args.clip_grad:     # the norm's squares summed over the shards, a whole tensor once
            norms.append(replica.clip(args.clip_grad, [tp_group],
                                      clip_shares(split, tp_size)).item())
        if routers:                  # the loads over every position (tp's ranks: the same ones)
            moe.loads += balance(routers, args.balance_rate, counted=tp_rank == 0).cpu()
        replica.update()
        losses.append(loss.item())
        if rank == 0:
            log_step(f"[rank {rank}]", step, losses, norms, args)
        save_checkpoint(args, step + 1, replica, range(len(full)), boxes, copies, routers)
    final = gather(grads=False)                                # put together on rank 0
    if rank == 0:
        extra = None
        if routers:
            moe.show_loads()
            extra = moe.saved()
        finish_run(args, full, final, losses, check, norms, resumed, extra=extra, moe=moe.final())
    cleanup()


def main(argv=None):
    args = parse_args(argv)
    spawn(tp_worker, args.world_size, args, backend=args.backend, timeout_s=args.timeout_s)


# Below the fold: its costs, the command line and its rules, and what the run says it ran. -------


from collectives import positive_int  # noqa: E402
from data_parallel import VOCAB_SIZE, check_training_args, training_parser  # noqa: E402


def tp_costs(kinds, act_bytes, rows, tp_style, num_micro_batches=1, recompute=False,
             sequence_parallel=False, replicated=()):
    """A tp rank's collectives a step, (kind, bytes of the tensor, times), A = act_bytes for one
    activation [b, T, D]. A block, each micro-batch: Megatron two g all-reduces forward (again
    with --recompute) and two f backward; the all-gather style all-gathers o, Wo's output, the
    MLP's [b, T, 4D] and W2's (again with --recompute), and all-reduces dn1, do, du (4 A), dn2.
    The embedding all-reduces x, the head dn; the loss three [b T] of fp32. Sequence parallel:
    each of Megatron's all-reduces a reduce-scatter and an all-gather along T, the same bytes;
    and once a step an all-reduce of each gain's and P's gradient (replicated: their bytes)."""
    m = num_micro_batches
    blocks = kinds.count("block")
    ends = ("embedding" in kinds) + ("head" in kinds)
    pairs = (blocks * (4 + 2 * recompute) + ends) * m
    if sequence_parallel:
        runs = [("all-gather", act_bytes, pairs), ("reduce-scatter", act_bytes, pairs),
                *[("all-reduce", nbytes, 1) for nbytes in replicated]]
    elif tp_style == "megatron":
        runs = [("all-reduce", act_bytes, pairs)]
    else:
        gathers = blocks * (1 + recompute) * m
        runs = [("all-gather", act_bytes, 3 * gathers), ("all-gather", 4 * act_bytes, gathers),
                ("all-reduce", act_bytes, (3 * blocks + ends) * m),
                ("all-reduce", 4 * act_bytes, blocks * m)]
    if "head" in kinds:
        runs.append(("all-reduce", 4 * rows, 3 * m))   # m, s and l_y
    return runs


def cp_costs(blocks, rows, dim, tp, cp, bf16, num_micro_batches=1, recompute=False,
             buckets=(), reductions=1):
    """A cp rank's exchanges a step: each block and micro-batch, K and V (stacked, [2, b, T/C,
    D/tp], rows = b T/C) to the next rank C-1 times forward (again with --recompute) and C-1
    back, and dK, dV in fp32 C times (home); each gradient bucket (its bytes) summed over cp as
    often as the dp exchange takes it (reductions)."""
    if cp == 1:
        return []
    m = num_micro_batches
    kv = 2 * rows * dim // tp
    return [("send", kv * (2 if bf16 else 4), (cp - 1) * (2 + recompute) * blocks * m),
            ("send", kv * 4, cp * blocks * m),
            *[("all-reduce", nbytes, reductions) for nbytes in buckets]]


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
    """A fused attention kernel (FlashAttention's) over `sequences` heads' [T, dh] each, its
    forward or its backward: q, k, v, o of in_bytes an element, lse fp32. Causal, it computes the
    tiles on and below the diagonal, half of each [T, T] (a ring's pair off the diagonal: all of
    it), and writes none of them to memory."""
    sequences: int
    context: int
    head_dim: int
    in_bytes: int
    backward: bool
    accumulate: bool = False                  # as a Matmul's: nothing is added into
    causal: bool = True

    def flops(self):   # half of 2 T T dh a product: S, A v; back: S again, dv, dA, dq and dk
        products = 5 if self.backward else 2
        return products * self.sequences * self.context ** 2 * self.head_dim * (2 - self.causal)

    def bytes_moved(self):   # q, k, v in, o out; back: q, k, v, o, do in, dq, dk, dv out; lse
        tensor = self.sequences * self.context * self.head_dim * self.in_bytes
        lse = self.sequences * self.context * 4
        if self.backward:
            return 8 * tensor + lse
        return 4 * tensor + lse


def block_matmuls(kind, rows, dim, tp, bf16, classes=0, tp_style="megatron", context=1, heads=1,
                  cp=1, cp_layout="zigzag", experts=0, top_k=1, ep=1):
    """A tp rank's part ("block" or "head"), a micro-batch of rows positions: its matmuls'
    (forwards, backwards' dx, dWs into the fp32 gradient); a block's six weights, and its h/tp
    heads' attention, one fused kernel forward and one back, as a GPU runs them (--cp: a kernel a
    pair of chunks, the busiest rank's). What --plan prices and tests/gpu_path.py records.
    --experts: the router's three fp32 matmuls, and each of the E/ep experts here its W1's and
    W2's over rows K ep / E pairs (balanced: as many as the dense MLP's rows K), its dWs in the
    backward (experts_backward's), in place of the MLP's."""
    size = 2 if bf16 else 4
    D = dim

    def linear(n_in, n_out, m=rows):
        return (Matmul(m, n_in, n_out, size, size, accumulate=False),      # z = x W
                Matmul(m, n_out, n_in, size, size, accumulate=False),      # dx = dz W^T
                Matmul(n_in, m, n_out, size, 4, accumulate=True))          # dW += x^T dz
    if kind == "head":
        return [[m] for m in linear(D, classes)]
    row = tp_style == "megatron"
    wo = linear(D // tp, D) if row else linear(D, D // tp)
    w2 = linear(4 * D // tp, D) if row else linear(4 * D, D // tp)
    layers = [linear(D, D // tp)] * 3 + [wo, linear(D, 4 * D // tp), w2]
    if experts:                          # the MLP's two out: the router's and the experts' in
        layers = layers[:4]
    sequences = rows * cp // context * (heads // tp)   # b h/tp
    head_dim = D // heads
    forwards, dxs, dws = (list(column) for column in zip(*layers))
    if experts:                          # every dW in the backward (experts_backward's)
        routed = rows * top_k * ep // experts                            # an expert's pairs
        w1 = linear(D, 4 * D // tp, routed)
        w2 = linear(4 * D // tp, D, routed) if row else linear(4 * D, D // tp, routed)
        forwards += [Matmul(rows, D, experts, 4, 4, accumulate=False)]    # p = softmax(n Wr)
        dxs += [Matmul(rows, experts, D, 4, 4, accumulate=False),         # dn = ds Wr^T
                Matmul(D, rows, experts, 4, 4, accumulate=False)]         # dWr = n^T ds
        for _ in range(experts // ep):
            forwards += [w1[0], w2[0]]
            dxs += [w1[1], w1[2], w2[1], w2[2]]
    chunk = context // (cp * (1 + (cp > 1 and cp_layout == "zigzag")))   # s: a pair's side
    diagonal, off = cp_pair_counts(cp, cp_layout)
    pairs = [Attention(sequences, chunk, head_dim, size, backward=False)] * diagonal + [
        Attention(sequences, chunk, head_dim, size, backward=False, causal=False)] * off
    return forwards + pairs, dxs + [pair._replace(backward=True) for pair in pairs], dws


def cp_pair_counts(cp, layout):   # the busiest rank's pairs: (on the diagonal, below it)
    if cp == 1:
        return 1, 0
    if layout == "zigzag":
        return 2, 2 * cp - 1
    return 1, cp - 1


def describe(args, tp_size):   # what ran: "h/tp = 2 heads a rank, Megatron's pairs, ..."
    style = {"megatron": "Megatron's pairs (Wq Wk Wv W1 column, Wo W2 row)",
             "all-gather": "every weight column-parallel, each output all-gathered"}
    sequence = ", the residual stream by T/tp rows" * args.sequence_parallel
    return (f"{args.heads // tp_size} of {args.heads} heads a rank, {style[args.tp_style]}"
            f"{sequence}, the embedding and the head by class")


def add_context_parallel(parser):
    parser.add_argument("--cp", type=positive_int, default=1, help="context parallelism: the ranks "
                        "of a cp group C, each holding T/C positions of every sequence (ring "
                        "attention)")
    parser.add_argument("--cp-layout", choices=["zigzag", "contiguous"], default="zigzag",
                        help="zigzag: 2C chunks of T, rank r holds r and 2C-1-r (balanced); "
                             "contiguous: rank r holds the r-th T/C (rank C-1 does C times rank "
                             "0's attention)")


def context_parallel_rules(args, tp_size):   # T in the layout's chunks; SP: a rank's T/C by tp
    chunks = args.cp * (2 if args.cp_layout == "zigzag" else 1)
    return [(args.context % chunks, f"--cp {args.cp}: --context {args.context} is not divisible "
                                    f"by {chunks}, the {args.cp_layout} layout's chunks"),
            (args.cp > 1 and args.sequence_parallel and args.context // args.cp % tp_size,
             f"--sequence-parallel with --cp {args.cp}: a rank's {args.context // args.cp} "
             f"positions do not split over the {tp_size} tp ranks")]


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


def divides(value, flag, divisor, divisor_flag):   # a rule: broken if value % divisor
    return value % divisor, f"{flag} {value} is not divisible by {divisor_flag} ({divisor})"


def refuse_unused(parser, args, used, mode):   # a flag this mode ignores is refused
    parser.refuse((name not in used and value != parser.get_default(name),
                   f"--{name.replace('_', '-')}: not used with {mode}")
                  for name, value in vars(args).items())


def parse_args(argv=None):
    parser = training_parser("Tensor parallelism: column-parallel layers with an all-gather.")
    parser.add_argument("--world-size", type=positive_int, default=4,
                        help="ranks T; divides --heads")
    parser.add_argument("--tp-style", choices=["all-gather", "megatron"], default="all-gather",
                        help="every layer column-parallel with an all-gather, or Megatron's pairs")
    add_sequence_parallel(parser)
    add_context_parallel(parser)
    args = parser.parse_args(argv)
    tp_size = args.world_size // args.cp
    parser.refuse([(args.world_size % args.cp, f"--cp {args.cp} does not divide --world-size "
                                               f"{args.world_size}"),
                   *context_parallel_rules(args, tp_size)])
    tp_flag = "--world-size"
    if args.cp > 1:
        tp_flag = "--world-size / --cp"
    parser.refuse([divides(args.heads, "--heads", tp_size, tp_flag),
                   *sequence_parallel_rules(args, tp_size, tp_flag),
                   (tp_size > VOCAB_SIZE, f"--world-size {args.world_size}: more tp ranks "
                                          f"than the vocabulary's {VOCAB_SIZE} classes")])
    parser.refuse([(args.ep > 1, f"--ep {args.ep}: step 3 has no replicas to hold the experts "
                                 f"(data_parallel.py, three_d.py)")])
    check_training_args(parser, args, args.world_size)
    return args


if __name__ == "__main__":
    run_main(main)
