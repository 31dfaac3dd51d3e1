"""Step 2: data parallelism, and the model that every step of the collection trains.

    python data_parallel.py                          # 4 replicas on the CPU
    python data_parallel.py --world-size 2 --micro-batches 4 --overlap --check
    python data_parallel.py --zero 3 --check         # ZeRO-3: each replica keeps 1/4 of all
    python data_parallel.py --kv-heads 1 --qk-norm --check   # one kv head (MQA), Qwen3's norm
    torchrun --nproc-per-node 4 data_parallel.py

The model: a character-level transformer of CPython's own help text, Llama 3's block (decoder-only,
pre-norm, no biases; grouped-query attention, rotary positions, SwiGLU; Qwen3's QK-norm optional):
T characters in, the next one's V logits at every position out. Its backward is derived by hand
here, once; every later step splits these lines:

    embed      x = E[tokens]                       tokens [b, T], E [V, D], x [b, T, D]
    block      n = rmsnorm(x; g1)               rmsnorm(x; g) = x r g, r = (mean_D x^2 + eps)^-1/2
               q = n Wq  [b, T, h dh];  k, v = n Wk, n Wv  [b, T, G dh]: G kv heads, dh = D/h
               (--qk-norm: q, k = rmsnorm(q_j; gq), rmsnorm(k_c; gk), each head over its dh)
               q, k = rope(q), rope(k)          each head's pair (2i, 2i+1) at position m turned
                                                by m theta_i, theta_i = theta^(-2i/dh)
               A_j = softmax(q_j k_c^T / sqrt(dh) + mask)  [b, T, T]; query head j reads kv
               o = [A_1 v_c(1) | .. | A_h v_c(h)]          head c(j) = j // (h/G); mask: -inf
                                                           above the diagonal
               x' = x + o Wo                       the residual; then the MLP, SwiGLU, with its own:
               out = x' + (silu(n' W1) * n' W3) W2, n' = rmsnorm(x'; g2)   W1, W3 [D, F], W2 [F, D]
    head       logits = rmsnorm(x; g) H            H [D, V]: at each of the b T positions
    loss       sum over positions -log softmax(logits)[y] / n            y [b, T], n = B T
    backward   dlogits = (softmax(logits) - onehot(y)) / n
      matmul   z = x W:  dW = x^T dz (over every position), dx = dz W^T
      residual x' = x + f(x):  dx = dx' + the branch's dx: the two, summed
      rmsnorm  s = g dy:  dx = r s - x r^3 mean_D(s x)          dg = sum over positions of dy x r
      swiglu   u = silu(a) up:  dup = du silu(a),  da = du up silu'(a),
               silu'(a) = sg (1 + a (1 - sg)),  sg = sigmoid(a)
      rope     a rotation R: dx = R^T dy, the rotation by -angle
      attention, a head (S = q k^T / sqrt(dh), A = softmax(S) = exp(S - lse), o = A v), where
               lse = log rowsum exp(S) [b, h, T] is kept and A made again (FlashAttention's way):
               dv = A^T do    dA = do v^T    dS = A * (dA - delta),  delta = rowsum(dA * A)
               delta = rowsum(do * o), as attend_backward derives
               dq = dS k / sqrt(dh)     dk = dS^T q / sqrt(dh)    (masked: A = 0, so dS = 0)
               a kv head's dk and dv: the sums of these over its group's h/G query heads
      embed    dE[tokens] += dx  (index_add_)

Each part is a Block, a forward and its backward, over its weights: the embedding [E], each
block's (BLOCK_NAMES), the head [g, H]. A backward returns each weight's (x, dz), dW = x^T dz,
which the replica sums into its bucket: a gain's gradient comes ready (x None), E's as rows to add
(x the ids). --recompute's stash: x, the forward run again.

Data parallelism: d replicas, each on its slice of the batch, sum their gradients (all-reduce)
and divide by d. dp_step() reads so: forward; backward part by part, each dW into its bucket,
each bucket exchanged once final (--overlap: under the backward); divide. ZeRO (--zero 1-3):
classes, each the stage before plus its change. PyTorch's: DDP, ZeroRedundancyOptimizer, FSDP2.
"""
import warnings
warnings.filterwarnings("ignore", "Failed to initialize NumPy")   # torch warns without numpy
import math
from functools import partial
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from collectives import all_to_all, cleanup, log, run_main, setup, spawn

# Part 1: the model's pieces, and their backward by hand ------------------------------------------

EPS = 1e-5                                    # rmsnorm's, as nn.RMSNorm(D, eps=1e-5)


def wide(t):   # fp32 at least: where bf16 would round too much (float64 stays, for the tests)
    return t.to(torch.promote_types(t.dtype, torch.float32))


def rmsnorm(x, g):
    """x r g, r = (mean_D x^2 + eps)^-1/2 [.., 1], in fp32, over x's last dim; and r."""
    x32 = wide(x)
    r = torch.rsqrt(x32.square().mean(-1, keepdim=True) + EPS)
    return (x32 * r * g).to(x.dtype), r


def rmsnorm_backward(dy, x, r, g):
    """dx = r s - x r^3 mean_D(s x), s = g dy  [.., D]; dg = sum over rows of dy x r  [D]."""
    dtype = dy.dtype
    x = wide(x)
    dy = wide(dy)
    s = g * dy
    dx = r * s - x * r**3 * (s * x).mean(-1, keepdim=True)   # as written: autograd's order
    return dx.to(dtype), (dy * x * r).flatten(0, -2).sum(0)


def wide_matmul(a, b):   # [.., m, k] @ [.., k, n] summed into fp32, as FlashAttention sums S, dA
    if a.dtype != torch.bfloat16 or a.device.type == "cpu":   # the CPU has no bf16 x bf16 -> fp32
        return wide(a) @ wide(b)                              # kernel: cast (fp32 stays as it is)
    if a.dim() == 2:                                          # an expert's dW
        return torch.mm(a, b, out_dtype=torch.float32)
    out = torch.bmm(a.flatten(0, -3), b.flatten(0, -3), out_dtype=torch.float32)   # bf16 inputs
    return out.unflatten(0, a.shape[:-2])


class Rope(NamedTuple):   # RoPE's turns at a rank's places m, [T, dh/2] complex each
    turn: torch.Tensor      # e^(i m theta_i): the forward's
    back: torch.Tensor      # e^(-i m theta_i), its conjugate: the backward's


def rope_table(positions, head_dim, theta):
    """The turns by m theta_i, theta_i = theta^(-2i/dh), i < dh/2, for each place m in its
    sequence (positions [T]: step 3's --cp gives each rank its own), from float64 angles."""
    i = torch.arange(head_dim // 2, dtype=torch.float64, device=positions.device)
    angles = positions.double()[:, None] * theta ** (-2 * i / head_dim)     # [T, dh/2]
    return Rope(torch.polar(torch.ones_like(angles), angles),
                torch.polar(torch.ones_like(angles), -angles))


def rotate(x, rope, head_dim, back=False):
    """RoPE on every head of x [b, T, n dh], in fp32 at least: each pair (x[2i], x[2i+1]) read as
    the complex number x[2i] + i x[2i+1] and times e^(i m theta_i), which turns it by its angle:
    x'[2i] = x[2i] cos - x[2i+1] sin, x'[2i+1] = x[2i] sin + x[2i+1] cos (Meta's Llama code). A
    rotation R's backward is R^T, the turn by -angle: back, times e^(-i m theta_i)."""
    pairs = wide(x).unflatten(-1, (-1, head_dim // 2, 2)).contiguous()   # [b, T, n, dh/2, 2]
    turn = rope.turn
    if back:
        turn = rope.back
    turn = turn.to(torch.promote_types(pairs.dtype, torch.complex64))[:, None]   # every head's
    turned = torch.view_as_complex(pairs) * turn                     # [b, T, n, dh/2], complex
    return torch.view_as_real(turned).flatten(-3).to(x.dtype)


def heads(t, head_dim):   # [b, T, n dh] -> [b, n, T, dh]: head j's columns j dh .. (j+1) dh
    return t.unflatten(-1, (-1, head_dim)).transpose(1, 2)


def query_heads(q, kv_heads, head_dim):   # [b, T, h dh] -> [b, G, h/G, T, dh]: kv head c's group,
    return heads(q, head_dim).unflatten(1, (kv_heads, -1))   # the query heads j // (h/G) = c


def kv_head(t, head_dim):   # [b, T, G dh] -> [b, G, 1, T, dh]: read by its group, never repeated
    return heads(t, head_dim)[:, :, None]


def columns(t):   # [b, G, h/G, T, dh] -> [b, T, h dh]: the heads side by side again
    return t.flatten(1, 2).transpose(1, 2).flatten(-2)


def by_group(x, y):
    """x [.., G, h/G, s, n] @ y [.., G, 1, n, p] in fp32: the group's h/G heads' rows stacked,
    [.., G, h/G s, n], over its one y, never repeated: [.., G, h/G, s, p]."""
    return wide_matmul(x.flatten(-3, -2), y.squeeze(-3)).unflatten(-2, x.shape[-3:-1])


def over_group(x, y):
    """x^T y summed over the group's heads, inside the matmul's sum over their h/G s rows:
    x [.., G, h/G, s, t], y [.., G, h/G, s, n] -> [.., G, 1, t, n], in fp32."""
    return wide_matmul(x.flatten(-3, -2).transpose(-1, -2), y.flatten(-3, -2)).unsqueeze(-3)


def scores(q, k, head_dim, causal=True):
    """S = q k^T / sqrt(dh) [.., s, t] in fp32 (bf16's S of 500 is off by 1, A by e); causal:
    row i sees keys 0 .. i (its own block of keys: step 3's ring pairs it with others too)."""
    s = by_group(q / math.sqrt(head_dim), k.transpose(-1, -2))
    if causal:                                # + 0 on and below the diagonal, -inf above it
        s += torch.full(s.shape[-2:], float("-inf"), device=s.device).triu(1)
    return s


def attend(q, k, v, head_dim, causal=True):
    """Grouped heads, q [.., G, h/G, s, dh] over k, v [.., G, 1, t, dh]: o [.., G, h/G, s, dh] in
    fp32 and lse = log rowsum exp(S) [.., G, h/G, s], kept for A = exp(S - lse), never A."""
    s = scores(q, k, head_dim, causal)                                # [.., s, t], fp32
    m = s.amax(-1)                            # the row's max S
    a = s.softmax(-1)                         # A = e^(S - m) / rowsum e^(S - m), in one pass
    lse = m - a.amax(-1).log()                # A's largest, where S = m, is e^(m - lse)
    return by_group(a, v), lse


def attend_backward(do, q, k, v, o, lse, head_dim, causal=True):
    """dq [.., G, h/G, s, dh], and dk, dv [.., G, 1, t, dh]: each kv head's, the sum over the h/G
    query heads that read it (over_group's matmul). A made again from q, k and lse. Per head:
       dv = A^T do   dA = do v^T   dS = A * (dA - delta)   dq = dS k / sqrt(dh)
       dk = dS^T q / sqrt(dh)
    delta = rowsum(dA * A) [.., s, 1], the softmax's, needs no [s, t] pass: for row i
        delta_i = sum_j A_ij dA_ij = sum_j A_ij (do_i . v_j) = do_i . (sum_j A_ij v_j) = do_i . o_i
    (FlashAttention-2's eqs 13-19). o None: A v again, in fp32 (--bf16's o, rounded, moves
    delta)."""
    a = scores(q, k, head_dim, causal=False).sub_(lse[..., None])   # S - lse  [.., s, t]
    a = a.clamp_(max=0).exp_()                # A again: a seen key's S - lse <= 0 already; a
    if causal:                                # future key's capped (exp(-inf) is a CPU's slow
        a *= torch.ones(a.shape[-2:], device=a.device).tril()   # path), its A then zeroed
    if o is None:
        o = by_group(a, v)
    do = wide(do)
    dv = over_group(a, do)                                            # summed over the group
    da = by_group(do, v.transpose(-1, -2))                            # [.., s, t], fp32
    delta = (do * wide(o)).sum(-1, keepdim=True)                      # rowsum(do * o)
    ds = da.sub_(delta).mul_(a)                                       # in dA's memory
    dq = by_group(ds, k) / math.sqrt(head_dim)
    dk = over_group(ds, q) / math.sqrt(head_dim)
    return dq, dk, dv


def attention(q, k, v, head_dim):
    """Causal attention of every head of q [b, T, h dh] over its kv head's k, v [b, T, G dh]: o
    [b, T, h dh] and lse [b, h, T] fp32, as FlashAttention computes them (tests/test_transformer.py:
    tiles merged by running max and sum)."""
    q = query_heads(q, k.shape[-1] // head_dim, head_dim)             # [b, G, h/G, T, dh]
    k = kv_head(k, head_dim)                                          # [b, G, 1, T, dh]
    v = kv_head(v, head_dim)
    o, lse = attend(q, k, v, head_dim)
    return columns(o).to(v.dtype), lse.flatten(1, 2)


def attention_backward(do, q, k, v, o, lse, head_dim):
    """dq [b, T, h dh], dk, dv [b, T, G dh] from do, by attend_backward."""
    kv_heads = k.shape[-1] // head_dim
    do, q, o = (query_heads(t, kv_heads, head_dim) for t in (do, q, o))   # [b, G, h/G, T, dh]
    k = kv_head(k, head_dim)
    v = kv_head(v, head_dim)
    lse = lse.unflatten(1, q.shape[1:3])                              # [b, G, h/G, T]
    if o.dtype == torch.bfloat16:                                     # --bf16's o, rounded:
        o = None                                                      # A v again, in fp32
    grads = attend_backward(do, q, k, v, o, lse, head_dim)
    return [columns(t).to(q.dtype) for t in grads]


class Kernels(NamedTuple):   # the maths a block runs, chosen once where it is built: these lines,
    rmsnorm: Callable = rmsnorm                        # or a GPU's fused kernels of the same
    rmsnorm_backward: Callable = rmsnorm_backward      # maths (kernels_for, below the fold)
    attention: Callable = attention                    # the block's, over its whole T
    attention_backward: Callable = attention_backward
    attend: Callable = attend                          # grouped heads over a block of keys,
    attend_backward: Callable = attend_backward        # causal or not (step 3's ring pairs)


def swiglu(n, w1, w3, w2, split):
    """SwiGLU: y = (silu(n W1) * n W3) W2 [.., D] (step 3's: before g), and its stash."""
    a = n @ w1                                # [.., F/tp]: the gate
    up = n @ w3                               # [.., F/tp]: the same columns of W3
    u = split.gather(F.silu(a) * up)          # silu(a) = a sigmoid(a)
    return u @ w2, MLPStash(n, a, up, u)


class MLPStash(NamedTuple):   # what the MLP keeps for its backward
    n: torch.Tensor           # its input [.., D]
    a: torch.Tensor           # n W1 [.., F/tp]
    up: torch.Tensor          # n W3
    u: torch.Tensor           # silu(a) * up (gathered, where step 3 gathers it)


def swiglu_backward(dy, stash, w1, w3, w2, split):
    """dn [.., D] (step 3's: before f's backward), and the (x, dz) of W1, W3, W2."""
    n, a, up, u = stash
    du = split.gather_back(split.row_back(dy @ w2.T))        # y = u W2
    dup = du * F.silu(a)                                     # u = silu(a) up: dup = du silu(a)
    da = silu_backward(du * up, a)                           # da = du up silu'(a)
    dn = da @ w1.T + dup @ w3.T                              # a = n W1, up = n W3
    return dn, [(n, da), (n, dup), (u, dy)]


def silu_backward(g, a):   # g silu'(a), silu'(a) = sg (1 + a (1 - sg)), sg = sigmoid(a): one pass
    return torch.ops.aten.silu_backward(g, a)


class Whole:   # where step 3 puts its collectives (tensor_parallel.py): each the identity here
    f = f_back = g = g_back = gather = gather_back = row_back = staticmethod(lambda t: t)


# Part 2: the block, and the model -----------------------------------------------------------------

class BlockWeights(NamedTuple):   # a block's tensors by --save's names, in the init order
    norm1: torch.Tensor = None    # g1 [D]
    wq: torch.Tensor = None       # [D, h dh]
    wk: torch.Tensor = None       # [D, G dh]
    wv: torch.Tensor = None       # [D, G dh]
    norm_q: torch.Tensor = None   # --qk-norm: gq, gk [dh], every head's
    norm_k: torch.Tensor = None
    wo: torch.Tensor = None       # [h dh, D]
    norm2: torch.Tensor = None    # g2 [D]
    router: torch.Tensor = None   # --experts: Wr [D, E]
    w1: torch.Tensor = None       # [D, F] (--experts: [E, D, F])
    w3: torch.Tensor = None       # [D, F]
    w2: torch.Tensor = None       # [F, D]


def block_names(qk_norm=False, experts=False):   # a block's tensors, in the init order
    return [name for name in BlockWeights._fields
            if (qk_norm or name not in ("norm_q", "norm_k")) and (experts or name != "router")]


class BlockStash(NamedTuple):   # what a block keeps from its forward for its backward
    x: torch.Tensor        # [b, T, D], its input
    n1: torch.Tensor       # rmsnorm(x; g1), and r1 [b, T, 1]
    r1: torch.Tensor
    q: torch.Tensor        # [b, T, h/tp dh]: this rank's query heads, turned (RoPE)
    k: torch.Tensor        # [b, T, G/tp dh]: the kv heads they read (G < tp: one), turned
    v: torch.Tensor
    qk: object             # --qk-norm: q and k before their norms, and r (QKStash); else None
    lse: torch.Tensor      # [b, h/tp, T], fp32: A made again from it
    o: torch.Tensor        # the heads' output (gathered, where step 3 gathers it)
    x2: torch.Tensor       # x + y1, the residual, and rmsnorm(x2; g2)'s r2
    r2: torch.Tensor
    mlp: object            # the MLP's (MLPStash; --experts: ExpertsStash)


class QKStash(NamedTuple):   # --qk-norm's: q, k [b, T, n dh] before their norms, r [b, T, n, 1]
    q: torch.Tensor
    r_q: torch.Tensor
    k: torch.Tensor
    r_k: torch.Tensor


def head_norm(t, g, head_dim, norm=rmsnorm):   # Qwen3's QK-norm: each head of t [b, T, n dh]
    normed, r = norm(t.unflatten(-1, (-1, head_dim)), g)             # over its dh, one gain for
    return normed.flatten(-2), r                                      # every head


def head_norm_backward(dy, t, r, g, head_dim, norm_backward=rmsnorm_backward):   # dt; dg summed
    dt, dg = norm_backward(dy.unflatten(-1, (-1, head_dim)),         # over positions and heads
                           t.unflatten(-1, (-1, head_dim)), r, g)
    return dt.flatten(-2), dg


def block_forward(x, weights, recompute=False, head_dim=None, rope=None, qk_norm=False,
                  split=Whole, router=None, count=True, kernels=Kernels()):
    """x [b, T, D] -> x + attention + MLP [b, T, D] (router: experts'), and the block's stash."""
    w = BlockWeights(**dict(zip(block_names(qk_norm, experts=router is not None), weights)))
    n1, r1 = kernels.rmsnorm(x, w.norm1)
    n1 = split.f(n1)                          # [b, T, D]
    q = n1 @ w.wq                             # [b, T, h/tp dh]: whole heads, this rank's
    k = n1 @ w.wk                             # [b, T, G/tp dh]: the kv heads they read
    v = n1 @ w.wv
    qk = None
    if qk_norm:                               # each head of q and of k normed, before RoPE
        q_normed, r_q = head_norm(q, w.norm_q, head_dim, kernels.rmsnorm)
        k_normed, r_k = head_norm(k, w.norm_k, head_dim, kernels.rmsnorm)
        qk = QKStash(q, r_q, k, r_k)
        q = q_normed
        k = k_normed
    q = rotate(q, rope, head_dim)             # each row at its place in the sequence
    k = rotate(k, rope, head_dim)
    o, lse = kernels.attention(q, k, v, head_dim)   # [b, T, h/tp dh], lse [b, h/tp, T]: no A
    o = split.gather(o)
    y1 = split.g(o @ w.wo)                    # [b, T, D]
    x2 = x + y1                               # the residual
    n2, r2 = kernels.rmsnorm(x2, w.norm2)
    n2 = split.f(n2)
    if router is not None:
        y2, mlp = experts_forward(n2, w.router, w.w1, w.w3, w.w2, router, count, split)
    else:
        y2, mlp = swiglu(n2, w.w1, w.w3, w.w2, split)
    out = x2 + split.g(y2)
    if recompute:
        return out, (x,)
    return out, BlockStash(x, n1, r1, q, k, v, qk, lse, o, x2, r2, mlp)


def block_backward(dout, stash, weights, need_dx=True, head_dim=None, rope=None, qk_norm=False,
                   split=Whole, router=None, kernels=Kernels()):
    """dx [b, T, D] from dout, and each weight's (x, dz), dW = x^T dz, in the weights' order."""
    names = block_names(qk_norm, experts=router is not None)
    w = BlockWeights(**dict(zip(names, weights)))
    if not isinstance(stash, BlockStash):     # --recompute: the forward again, from x
        stash = block_forward(stash[0], weights, head_dim=head_dim, rope=rope, qk_norm=qk_norm,
                              split=split, router=router, count=False, kernels=kernels)[1]
    x, n1, r1, q, k, v, qk, lse, o, x2, r2, mlp = stash
    dy2 = split.g_back(dout)                  # out = x2 + y2: y2's gradient
    if router is not None:
        dn2, mlp_terms = experts_backward(dy2, mlp, w.router, w.w1, w.w3, w.w2, split)
    else:
        dn2, mlp_terms = swiglu_backward(dy2, mlp, w.w1, w.w3, w.w2, split)
    dn2 = split.f_back(dn2)
    dx2, dg2 = kernels.rmsnorm_backward(dn2, x2, r2, w.norm2)
    dx2 = dx2 + dout                          # the residual: the branch's and the skip's
    dy1 = split.g_back(dx2)                   # x2 = x + y1: y1's gradient
    do = split.row_back(dy1 @ w.wo.T)         # y1 = o Wo
    do = split.gather_back(do)
    dq, dk, dv = kernels.attention_backward(do, q, k, v, split.gather_back(o), lse, head_dim)
    dq = rotate(dq, rope, head_dim, back=True)   # q = R q': dq' = R^T dq
    dk = rotate(dk, rope, head_dim, back=True)
    terms = {}
    if qk_norm:
        dq, terms["norm_q"] = head_norm_backward(dq, qk.q, qk.r_q, w.norm_q, head_dim,
                                                 kernels.rmsnorm_backward)
        dk, terms["norm_k"] = head_norm_backward(dk, qk.k, qk.r_k, w.norm_k, head_dim,
                                                 kernels.rmsnorm_backward)
        terms = {name: (None, dg) for name, dg in terms.items()}   # ready: summed over heads
    dn1 = split.f_back(dq @ w.wq.T + dk @ w.wk.T + dv @ w.wv.T)   # q, k, v = n1 Wq, n1 Wk, n1 Wv
    dx, dg1 = kernels.rmsnorm_backward(dn1, x, r1, w.norm1)
    dx = dx + dx2
    terms.update(norm1=(None, dg1), wq=(n1, dq), wk=(n1, dk), wv=(n1, dv), wo=(o, dy1),
                 norm2=(None, dg2))
    terms.update(zip(names[-len(mlp_terms):], mlp_terms))         # (router,) w1, w3, w2
    return dx, [terms[name] for name in names]


def embedding_forward(tokens, w, recompute=False):
    e, = w
    return e[tokens], (tokens,)               # [b, T, D]: each token's row; RoPE is in the blocks


def embedding_backward(dx, stash, w, need_dx=False):
    """dE[tokens] += dx, as (ids, rows) for the replica's index_add_."""
    tokens, = stash
    return None, [(tokens, dx)]


def head_forward(x, w, recompute=False, split=Whole, kernels=Kernels()):
    gain, h = w
    n, r = kernels.rmsnorm(x, gain)
    n = split.f(n)                        # [b, T, D]
    return n.flatten(0, 1) @ h, (x, n, r)     # logits = n H   [b T, V]: a row a position


def head_backward(dlogits, stash, w, need_dx=True, split=Whole, kernels=Kernels()):
    gain, h = w
    x, n, r = stash
    dn = split.f_back((dlogits @ h.T).view_as(n))   # [b, T, D]
    dx, dgain = kernels.rmsnorm_backward(dn, x, r, gain)
    return dx, [(None, dgain), (n, dlogits)]


def cross_entropy(logits, y, n):
    """The loss sum -log softmax(logits)[y] / n and dlogits = (softmax - onehot(y)) / n, fp32"""
    y = y.reshape(-1)
    rows = torch.arange(len(y), device=y.device)
    log_p = wide(logits).log_softmax(dim=1)               # [b T, V]
    dlogits = log_p.exp()                                 # softmax
    dlogits[rows, y] -= 1.0                               # - onehot(y)
    return -log_p[rows, y].sum() / n, (dlogits / n).to(logits.dtype)


def init_params(args):
    """The parts: [E], each block's tensors (block_names), [g, H], drawn in that order from one
    generator: every rank draws them alike and keeps its part (at scale: a generator per shard, or
    the meta device). A matrix: randn / sqrt(D), but each branch's last, Wo and W2, randn / sqrt(2
    L D) and / sqrt(2 L F) (GPT-2's scaled residuals); an expert tensor [E, ..]: each in turn."""
    D, V, L, F, E = args.dim, args.vocab_size, args.num_layers, args.ffn_dim, args.experts
    kv_columns = args.kv_heads * D // args.heads                      # G dh
    gen = torch.Generator().manual_seed(args.seed)

    def matrix(rows, cols, fan=D):
        return torch.randn(rows, cols, generator=gen) / math.sqrt(fan)

    def experts(rows, cols, fan=D):   # [E, rows, cols]
        return torch.stack([matrix(rows, cols, fan) for _ in range(E)])
    parts = [[torch.randn(V, D, generator=gen)]]
    for _ in range(L):
        block = [torch.ones(D), matrix(D, D), matrix(D, kv_columns), matrix(D, kv_columns)]
        if args.qk_norm:
            block += [torch.ones(D // args.heads), torch.ones(D // args.heads)]
        block += [matrix(D, D, 2 * L * D), torch.ones(D)]
        if E:
            block += [matrix(D, E), experts(D, F), experts(D, F), experts(F, D, 2 * L * F)]
        else:
            block += [matrix(D, F), matrix(D, F), matrix(F, D, 2 * L * F)]
        parts.append(block)
    parts.append([torch.ones(D), matrix(D, V)])
    return parts


class Block(NamedTuple):   # a part's pair, as every step runs one: step 2's, and step 3's
    forward: Callable         # (x, w, recompute) -> (a, stash); w: the part's weights, a list
    backward: Callable        # (dy, stash, w, need_dx) -> (dx, [(x, dz) a weight]): dW = x^T dz


def model_blocks(args, routers=None, device=None):
    """The parts, each a Block: [E], the blocks (RoPE at places 0 .. T-1), [g, H]; on a GPU with
    its fused kernels (the written ones' maths in one pass)."""
    head_dim = args.dim // args.heads
    rope = rope_table(torch.arange(args.context, device=device), head_dim, args.rope_theta)
    kernels = kernels_for(args, device)
    shape = dict(head_dim=head_dim, rope=rope, qk_norm=args.qk_norm, kernels=kernels)
    blocks = [Block(partial(block_forward, router=router, **shape),
                    partial(block_backward, router=router, **shape))
              for router in routers or [None] * args.num_layers]
    return [Block(embedding_forward, embedding_backward), *blocks,
            Block(partial(head_forward, kernels=kernels), partial(head_backward, kernels=kernels))]


# Part 3: data parallelism, and ZeRO-1 -------------------------------------------------------------

def dp_step(replica, blocks, loss_fn, xs, ys, n, recompute=False):
    """One replica's step on micro-batches xs, ys [B/(d m), T] of tokens: its loss (n positions)."""
    loss = torch.zeros((), device=replica.device)
    buckets = list(enumerate(replica.part_buckets))   # a bucket: consecutive parts
    replica.begin_step()
    for micro_batch, (a, y) in enumerate(zip(xs, ys)):   # a: the tokens, then each part's output
        stashes = []
        for b, parts in buckets:                      # forward, bucket by bucket
            replica.gather_weights(b, prefetch=b + 1)     # ZeRO-3: the bucket's weights, whole
            for i in parts:
                a, stash = blocks[i].forward(a, replica.part(i), recompute=recompute)
                stashes.append(stash)
            replica.release_weights(b)
        micro_batch_loss, da = loss_fn(a, y, n)       # da = dlogits  [b T, V]
        loss += micro_batch_loss
        for b, parts in reversed(buckets):            # backward, from the head's bucket
            replica.gather_weights(b, prefetch=b - 1)
            for i in reversed(parts):
                da, terms = blocks[i].backward(da, stashes.pop(), replica.part(i),
                                               need_dx=i > 0)   # the tokens need none
                replica.add_grads(i, terms)           # each dW = x^T dz, summed over micro-batches
                del terms                             # gone before the next part's backward
            replica.release_weights(b)
            if micro_batch == len(xs) - 1 or replica.exchange_each_micro_batch:
                replica.reduce_gradients(b)           # final: summed over the replicas
    replica.average()                                 # every exchange done; each gradient / d
    return loss


class BucketLayout(NamedTuple):
    parts: list        # the parts of each bucket, in order
    buckets: list      # the tensors of each bucket (every part's, numbered in order)
    bucket_of: dict    # tensor -> its bucket
    offset: dict       # tensor -> where its elements start in its bucket
    lengths: list      # the elements of each bucket
    spans: list        # part -> its tensors


def make_buckets(numels, bucket_mb, chunk_starts=()):
    """Consecutive parts (numels: each part's tensors' elements) whose fp32 gradients fit in
    bucket_mb (0: a part each): a collective costs a fixed time plus bytes / bandwidth (gloo
    here: 4 KB and 1 MB both ~0.6 ms, 16 MB 11 ms). Cut from the last part, final first; the first
    bucket 1 MB at most, as DDP's, to start early. None crosses a chunk's start (3D interleaved)."""
    sizes = [sum(part) for part in numels]
    parts = [[]]
    cap = min(bucket_mb, 1.0) * 2**20
    size = 0
    for i in reversed(range(len(sizes))):
        if parts[-1] and (size + 4 * sizes[i] > cap or i + 1 in chunk_starts):
            parts.append([])
            cap = bucket_mb * 2**20
            size = 0
        parts[-1].insert(0, i)
        size += 4 * sizes[i]
    parts.reverse()
    spans = spans_of(numels)
    flat = [n for part in numels for n in part]
    buckets = [[j for i in group for j in spans[i]] for group in parts]
    bucket_of = {}
    offset = {}
    for b, tensors in enumerate(buckets):
        for j in tensors:
            bucket_of[j] = b
            offset[j] = sum(flat[tensors[0]:j])
    return BucketLayout(parts, buckets, bucket_of, offset,
                        [sum(flat[j] for j in tensors) for tensors in buckets], spans)


def tensors_of(parts):         # the parts' tensors, in order
    return [w for part in parts for w in part]


def spans_of(parts):           # part -> the indices of its tensors among tensors_of(parts)
    firsts = [0]
    for part in parts:
        firsts.append(firsts[-1] + len(part))
    return [range(first, end) for first, end in zip(firsts, firsts[1:])]


def make_optimizer(params, optimizer, lr):   # SGD; AdamW, fused off the CPU (one pass, not 5)
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr)
    return torch.optim.AdamW(params, lr=lr, fused=params[0].device.type != "cpu")


def grad_squares(grads, groups, shares=None):
    """The whole model's squared norm: each rank's squares summed over the groups that hold the
    other parts: tp (shards), pp (stages), dp where ZeRO shards, ep (experts); shares: what of
    each's squares counts here (a tensor every tp rank holds whole: 1/t of it on each)."""
    if shares is None:
        shares = [1.0] * len(grads)
    squares = torch.stack([(g.float().square() * share).sum()
                           for g, share in zip(grads, shares)]).sum()
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(squares, group=group)
    return squares


def scale_grads(grads, max_norm, squares):
    """Every gradient times min(1, max_norm / (norm + 1e-6)), as clip_grad_norm_."""
    norm = squares.sqrt()
    for g in grads:
        g.mul_((max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm                         # on the device: reading it here would stall a GPU


class DataParallel:
    """ZeRO stage 0, DDP: a replica holds all; a bucket (consecutive parts' dW) is one message."""
    exchange_each_micro_batch = False   # ZeRO-3 keeps no gradient from a micro-batch to the next
    shards_optimizer = False            # ZeRO-1 on: each replica steps its 1/d alone

    def __init__(self, parts, group, optimizer="adamw", lr=1e-2, bucket_mb=25.0, bf16=False,
                 overlap=False, chunk_starts=(), replicas=None):
        weights = tensors_of(parts)                   # every part's tensors, in order
        self.group = group
        self.overlap = overlap
        self.device = weights[0].device
        self.dp_size = dist.get_world_size(group)
        self.dp_rank = dist.get_rank(group)
        self.replicas = replicas or self.dp_size      # a gradient's mean over (--ep's: dp)
        self.dtype = torch.bfloat16 if bf16 else torch.float32
        self.shapes = [w.shape for w in weights]
        self.layout = make_buckets([[w.numel() for w in part] for part in parts], bucket_mb,
                                   chunk_starts)
        self.part_buckets = self.layout.parts         # the parts of each bucket
        self.buckets = self.layout.buckets            # the tensors of each
        self.lengths = self.layout.lengths            # the elements of each
        self.spans = self.layout.spans                # part -> its tensors' indices
        self.store_weights(weights)
        self.optimizer = make_optimizer(self.params, optimizer, lr)
        self.grad_buckets = [None] * len(self.buckets)
        self.reductions = []                          # exchanges under way

    def part(self, i):                  # part i's weights, as its Block takes them
        return [self.weights[j] for j in self.spans[i]]

    def store_weights(self, weights):   # params: the optimizer's, fp32; weights: the layers'
        self.params = weights
        self.weights = [w.to(self.dtype) for w in weights]   # --bf16: a copy

    def view(self, flat, i):            # tensor i's place in its bucket's flat buffer   [D, D]
        start = self.layout.offset[i]
        return flat[start:start + self.shapes[i].numel()].view(self.shapes[i])

    def begin_step(self):               # the buckets zeroed: each dW is added to its place
        for bucket in self.grad_buckets:
            if bucket is not None:
                bucket.zero_()

    def gather_weights(self, b, prefetch=None):   # every weight is here and stays (ZeRO-3
        pass                                      # gathers a bucket, and lets it go)

    def release_weights(self, b):
        pass

    def add_grads(self, part, terms):
        """Each tensor's dW = x^T dz summed into its bucket by the matmul itself (Megatron's
        fusion); x None: dz is the gradient; x ids: dz's rows added at them (E's)."""
        for i, (x, dz) in zip(self.spans[part], terms):
            b = self.layout.bucket_of[i]
            if self.grad_buckets[b] is None:
                self.grad_buckets[b] = torch.zeros(self.lengths[b], device=self.device)   # pad: 0
            grad = self.view(self.grad_buckets[b], i)   # fp32: its part of the bucket
            if x is None:
                grad.add_(dz)
            elif not x.is_floating_point():             # x = onehot(ids): dE[ids] += dz's rows
                grad.index_add_(0, x.reshape(-1), dz.flatten(0, -2).float())
            elif x.dtype != grad.dtype and x.device.type != "cpu":   # --bf16 on a GPU: bf16 on
                # the tensor cores into the fp32 gradient (Megatron's fused wgrad); fp32: 1/15
                torch.addmm(grad, x.flatten(0, -2).T, dz.flatten(0, -2), out_dtype=torch.float32,
                            out=grad)
            else:         # fp32; --bf16 on the CPU casts, having no bf16 x bf16 -> fp32 kernel
                grad.addmm_(x.flatten(0, -2).T.float(), dz.flatten(0, -2).float())

    def reduce_gradients(self, b):
        """Bucket b is final: summed over the replicas in place (--overlap: under the backward)."""
        if self.dp_size > 1:
            work = dist.all_reduce(self.grad_buckets[b], group=self.group, async_op=self.overlap)
            self.reductions.append(work)

    def average(self):                  # the exchanges done, each gradient / d: the mean
        self.finish_reductions()
        for grad in self.grads():
            grad.div_(self.replicas)

    def finish_reductions(self):        # started with --overlap: waited for now
        for work in filter(None, self.reductions):
            work.wait()
        self.reductions = []

    def grads(self):                    # the gradients of self.params
        return [self.view(self.grad_buckets[self.layout.bucket_of[i]], i)
                for i in range(len(self.shapes))]

    def clip(self, max_norm, groups=(), shares=None):   # clip_grad_norm_'s, over the groups
        return scale_grads(self.grads(), max_norm, self.squares(groups, shares))

    def squares(self, groups=(), shares=None):   # every replica holds the whole average; shares:
        return grad_squares(self.grads(), groups, shares)   # of each's squares, what counts here

    def update(self):                   # the optimizer's step, then the layers' weights from it
        self.step_optimizer()
        self.refresh_weights()

    def refresh_weights(self):          # --bf16: the layers' copies of the new masters
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
    shards_optimizer = True

    def store_weights(self, weights):
        lengths = [-(-n // self.dp_size) * self.dp_size for n in self.lengths]   # d S each
        flats = [torch.cat([*(weights[i].reshape(-1) for i in layers),           # [d S], its
                            weights[0].new_zeros(length - n)])                   # padding 0
                 for layers, length, n in zip(self.buckets, lengths, self.lengths)]
        self.lengths = lengths
        self.flat = [flat.to(self.dtype) for flat in flats]       # the layers' (bf16: a copy)
        self.weights = [self.view(self.flat[self.layout.bucket_of[i]], i)
                        for i in range(len(weights))]
        self.params = [self.my_shard(flat) for flat in flats]      # the optimizer's [S], fp32
        if self.dtype != torch.float32:                           # bf16: the masters alone
            self.params = [param.clone() for param in self.params]

    def my_shard(self, flat):           # this replica's 1/d of a bucket: a view [S]
        return flat.view(self.dp_size, -1)[self.dp_rank]

    def reduce_gradients(self, b):      # this replica's shard of the sum: (d-1)/d of the bytes
        bucket = self.grad_buckets[b]
        work = dist.reduce_scatter_single(self.my_shard(bucket), bucket, group=self.group,
                                          async_op=self.overlap)
        self.reductions.append(work)

    def grads(self):
        return [self.my_shard(bucket) for bucket in self.grad_buckets]

    def squares(self, groups=(), shares=None):   # each replica holds 1/d: summed over dp
        return grad_squares(self.grads(), (*groups, self.group), self.weigh(shares))

    def weigh(self, shares):            # each bucket's shard: its tensors' shares, element-wise
        if shares is None:
            return None
        buckets = [torch.ones(n, device=self.device) for n in self.lengths]
        for i, share in enumerate(shares):
            self.view(buckets[self.layout.bucket_of[i]], i).fill_(share)
        return [self.my_shard(bucket) for bucket in buckets]

    def refresh_weights(self):
        """The optimizer stepped this replica's shard of each bucket: all-gathered."""
        for flat, param in zip(self.flat, self.params):
            shard = self.my_shard(flat)
            if self.dtype != torch.float32:                   # bf16: the new shard, rounded
                shard.copy_(param)
            dist.all_gather_single(flat, shard, group=self.group)


# Part 4: ZeRO-2 and 3 -----------------------------------------------------------------------------

class ZeRO2(ZeRO1):
    """Stage 2 = stage 1, but a bucket is reduce-scattered into a shard of its own, the bucket
    let go at once; exchanged again in the step (ZeRO-3's), it adds to its shard."""

    def begin_step(self):
        super().begin_step()
        self.grad_shards = [None] * len(self.buckets)
        self.shards_in_flight = []      # (bucket, shard) of an exchange again, --overlap's

    def reduce_gradients(self, b):
        shard = self.grad_buckets[b].new_empty(self.lengths[b] // self.dp_size)   # [S]
        work = dist.reduce_scatter_single(shard, self.grad_buckets[b], group=self.group,
                                          async_op=self.overlap)
        self.reductions.append(work)
        self.grad_buckets[b] = None               # let go: the Work holds what it sends
        if self.grad_shards[b] is None:
            self.grad_shards[b] = shard
        elif self.overlap:                        # summed once it has come in (average)
            self.shards_in_flight.append((b, shard))
        else:
            self.grad_shards[b] += shard

    def average(self):
        self.finish_reductions()
        for b, shard in self.shards_in_flight:
            self.grad_shards[b] += shard
        self.shards_in_flight = []
        super().average()                         # nothing left under way: each / d

    def grads(self):                    # the shards, [S] each
        return self.grad_shards


class ZeRO3(ZeRO2):
    """Stage 3 (FSDP) = stage 2, but a replica keeps only its 1/d of the weights: a bucket is
    FSDP's unit, gathered for its forward and its backward, let go, exchanged each micro-batch."""
    exchange_each_micro_batch = True

    def store_weights(self, weights):
        super().store_weights(weights)
        self.params = [param.clone() for param in self.params]   # [S] each
        self.flat = []            # no bucket kept whole: nothing to all-gather after an update
        self.weights = [None] * len(weights)
        self.gathering = {}                               # bucket -> (Work, its flat [d S])

    def gather_weights(self, b, prefetch=None):
        """Bucket b's weights, whole ((d-1)/d of its bytes come in); the next's too: two at most."""
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


# Part 5: experts, and expert parallelism ----------------------------------------------------------

# Experts (--experts E, --top-k K): the MLP as E experts and a router (DeepSeek-V3's balance).
#   forward   gate = softmax(n Wr) [N, E] in fp32, N = b T positions; each takes the K largest
#             of gate + bias (ties: the lower index); y = sum over its K experts e of
#             gate_e y_e, y_e = swiglu(n; W1[e], W3[e], W2[e]), each expert the dense MLP
#   backward  an expert's as the MLP's over its own positions, dy scaled by gate_e. The router's
#             through gate alone: dgate_e = <dy, y_e> for a chosen e, 0 for the rest; then
#             softmax's, ds = gate (dgate - sum_e dgate_e gate_e), dWr = n^T ds, dn += ds Wr^T.
#             The choice is a step of gate: flat almost everywhere, it passes no gradient; an
#             expert no position chose is in no output, and its gradient is 0.
#   balance   bias [E] steers the choice, never the output: after a step bias_e += rate sign(mean
#             load - load_e), the loads (positions x K an expert took) over the global batch.
#   tp        (step 3) each expert's W1, W3, W2 split as the MLP's, the router whole on every
#             rank. y_e is then a sum over tp (or its columns), so each rank's dgate_e = <dy, y_e>
#             is its part: so are ds, dWr (summed over tp, as sequence parallelism's gains) and
#             ds Wr^T (summed by f's backward with the experts' dn).
# Each position's K choices are K pairs (position, expert), sorted by expert; the experts run on
# the pairs' rows: here, or, with --ep, on the rank that holds them (dispatched below).

class Router:
    """A block's bias [E], this step's loads [E] and choices (each micro-batch's [N, K])."""

    def __init__(self, num_experts, top_k, device=None, group=None):
        self.bias = torch.zeros(num_experts, device=device)
        self.loads = torch.zeros(num_experts, device=device)
        self.top_k = top_k
        self.routes = []
        self.group = group            # --ep: the ranks that hold the experts between them

    def choose(self, gate, count=True):   # [N, K]: the K largest of gate + bias, lower index first
        chosen = (gate + self.bias).sort(dim=-1, descending=True, stable=True).indices
        chosen = chosen[:, :self.top_k]
        if count:                     # the forward's; --recompute's again counts nothing
            self.loads += torch.bincount(chosen.flatten(), minlength=len(self.loads))
            self.routes.append(chosen)
        return chosen


class ExpertsStash(NamedTuple):   # what the experts keep for their backward
    x: torch.Tensor        # n [N, D]
    gate: torch.Tensor     # [N, E], fp32
    rows: torch.Tensor     # [N K]: each pair's position, the pairs sorted by expert
    expert: torch.Tensor   # [N K]: each pair's expert
    y_e: torch.Tensor      # [N K, D]: each pair's expert output (home, with --ep)
    routed: list           # each expert's (which of the rows it ran, its MLPStash), where it ran
    sent: object           # --ep's all-to-alls (Sent); None: the experts ran here


def experts_forward(n, wr, w1, w3, w2, router, count=True, split=Whole):
    """y [b, T, D] from n [b, T, D] (step 3's: before g), and the experts' stash."""
    x = n.flatten(0, -2)                                      # [N, D]
    gate = (wide(x) @ wide(wr)).softmax(-1)                   # [N, E], fp32
    chosen = router.choose(gate, count)                       # [N, K]
    expert = chosen.flatten()                                 # [N K]: each pair's expert
    order = expert.argsort(stable=True)                       # the pairs, by expert
    rows = torch.arange(len(x), device=x.device).repeat_interleave(chosen.shape[1])[order]
    expert = expert[order]
    if router.group is None:
        y_e, routed = run_experts(x[rows], expert, w1, w3, w2, split)   # [N K, D]
        sent = None
    else:                                                     # --ep: on the experts' ranks
        y_e, routed, sent = dispatched(x[rows], expert, w1, w3, w2, router.group, split)
    y = x.new_zeros((len(x), w2.shape[-1]), dtype=gate.dtype)   # the K outputs summed, fp32
    y.index_add_(0, rows, gate[rows, expert, None] * wide(y_e))
    return y.to(n.dtype).view(*n.shape[:-1], -1), ExpertsStash(x, gate, rows, expert, y_e, routed,
                                                               sent)


def run_experts(x, expert, w1, w3, w2, split=Whole):
    """Each pair's row of x [M, D] through its expert (one of w1's E' here, by expert [M]): y_e
    [M, D], and each expert's rows and MLPStash."""
    y_e = x.new_empty((len(x), w2.shape[-1]))
    routed = []
    for e in range(w1.shape[0]):
        mine = (expert == e).nonzero()[:, 0]                  # the pairs that chose e
        y_e[mine], stash = swiglu(x[mine], w1[e], w3[e], w2[e], split)   # [m_e, D]
        routed.append((mine, stash))
    return y_e, routed


def run_experts_backward(dy_e, routed, w1, w3, w2, split=Whole):
    """dx [M, D] of each pair's row, and W1's, W3's, W2's gradients [E', ..], ready, fp32."""
    ready = torch.promote_types(dy_e.dtype, torch.float32)   # fp32 at least
    grads = [torch.zeros(w.shape, dtype=ready, device=dy_e.device) for w in (w1, w3, w2)]
    dx = dy_e.new_empty((len(dy_e), w1.shape[1]))             # [M, D]
    for e, (mine, stash) in enumerate(routed):
        dx[mine], terms = swiglu_backward(dy_e[mine], stash, w1[e], w3[e], w2[e], split)
        for grad, (x, dz) in zip(grads, terms):               # dW[e] = x^T dz
            grad[e] = wide_matmul(x.T, dz)
    return dx, grads


def experts_backward(dy, stash, wr, w1, w3, w2, split=Whole):
    """dn [b, T, D] (step 3's: before f's backward), and Wr's, W1's, W3's, W2's gradients,
    ready, fp32."""
    x, gate, rows, expert, y_e, routed, sent = stash
    dy_rows = wide(dy.flatten(0, -2))[rows]                   # [N K, D]: each pair's dy
    dgate = torch.zeros_like(gate)                            # dL/dgate [N, E]: 0 unchosen
    dgate[rows, expert] = (dy_rows * wide(y_e)).sum(-1)       # <dy, y_e>: tp's part
    dy_e = (gate[rows, expert, None] * dy_rows).to(dy.dtype)  # y_e's: scaled by gate_e
    if sent is None:
        dx_e, grads = run_experts_backward(dy_e, routed, w1, w3, w2, split)
    else:                                                     # --ep: there and back again
        dx_e, grads = dispatched_backward(dy_e, routed, w1, w3, w2, sent, split)
    dx = torch.zeros(x.shape, dtype=gate.dtype, device=x.device)
    dx.index_add_(0, rows, wide(dx_e))                        # each pair's dn, home
    ds = gate * (dgate - (dgate * gate).sum(-1, keepdim=True))   # softmax's backward [N, E]
    dx += ds @ wide(wr).T                                     # gate = softmax(n Wr)
    return dx.to(dy.dtype).view(*dy.shape[:-1], -1), [(None, wide(x).T @ ds),
                                                      *[(None, grad) for grad in grads]]


# Expert parallelism (--ep P): the P ranks of an ep group hold E/P experts each (rank r: experts
# r E/P .. (r+1) E/P - 1). ZeRO-3 brings the weights to the data; EP brings the data to the weights:
#   dispatch  each pair's row of n to its expert's rank: one all-to-all, the counts exchanged
#             first, so that no position is dropped   [N K, D] -> [M, D]
#   combine   each expert's output back to the pair's rank: the all-to-all in reverse; then
#             y = sum over the pairs of gate_e y_e, as before
#   backward  gate_e dy to the experts as the dispatch went, the same experts' backward, dn of
#             each pair home as the combine; dgate_e = <dy, y_e> at home, where y_e came back
# An expert's gradient: summed over its copies (the dp/P ranks that hold it) and divided by dp,
# the replicas' count (WithExperts); the router and the rest stay data-parallel.

class Sent(NamedTuple):   # --ep's all-to-alls, as the forward made them, for the backward
    send_counts: torch.Tensor  # [P]: the pairs sent to each rank
    recv_counts: torch.Tensor  # [P]: the pairs taken from each
    group: object


def dispatched(x, expert, w1, w3, w2, group, split=Whole):
    """run_experts' y_e [N K, D] of the pairs' rows x [N K, D] (sorted by expert: by its rank),
    each sent to its expert's rank, run there, and sent back; and what the backward needs."""
    local = w1.shape[0]                                       # E/P experts here
    send_counts = torch.bincount(expert // local, minlength=dist.get_world_size(group))
    recv_counts = all_to_all(send_counts, group=group)        # each rank's, from each
    sent = Sent(send_counts, recv_counts, group)
    x_in = all_to_all(x, send_counts, recv_counts, group)     # [M, D]: rows for my experts
    e_in = all_to_all(expert % local, send_counts, recv_counts, group)   # which of mine
    y_in, routed = run_experts(x_in, e_in, w1, w3, w2, split)
    return all_to_all(y_in, recv_counts, send_counts, group), routed, sent   # home, in order


def dispatched_backward(dy_e, routed, w1, w3, w2, sent, split=Whole):
    """run_experts_backward's, each pair's dy sent to its expert as the dispatch, dx home."""
    send_counts, recv_counts, group = sent
    dy_in = all_to_all(dy_e, send_counts, recv_counts, group)
    dx_in, grads = run_experts_backward(dy_in, routed, w1, w3, w2, split)
    return all_to_all(dx_in, recv_counts, send_counts, group), grads


def balance(routers, rate, counted=True):
    """Each block's bias moved by the step's loads over every rank: one all-reduce of [L, E]
    (counted=False: a tp rank but the first, whose positions that one counts)."""
    loads = torch.stack([router.loads for router in routers])
    if not counted:
        loads.zero_()
    if dist.is_initialized():
        dist.all_reduce(loads)
    for router, load in zip(routers, loads):
        router.bias += rate * torch.sign(load.mean() - load)
        router.loads.zero_()
    return loads


class WithExperts:
    """--ep: a replica of all but the experts, and one of this rank's experts (a block's a part,
    a bucket) over their copies, the ranks that hold the same (dp/P of them), of the ZeRO stage
    asked for: the replica's part blocks[k], a block, has its W1, W3, W2 [E/P, ..] in the copies'
    part k. An expert's gradient is a sum over the positions sent to it from its ep group's
    replicas: summed over its copies, it is the sum over all dp replicas, and so divided by dp,
    not by the copies' dp/P (megablocks #86's bug): the copies' replicas=dp. held: each one's
    tensors' places in the whole, (tensors, boxes) twice, for --check and checkpoints."""

    def __init__(self, replica, experts, ep_group, blocks, held, cp_group=None):
        self.replica = replica
        self.experts = experts
        self.ep_group = ep_group
        self.blocks = blocks
        self.held = held
        self.cp_group = cp_group      # step 5's --cp: the experts saw its positions alone

    def __getattr__(self, name):        # the buckets, the exchanges: the replica's
        return getattr(self.replica, name)

    def part(self, i):
        if i not in self.blocks:
            return self.replica.part(i)
        k = self.blocks.index(i)                # its experts: a bucket of their own
        self.experts.gather_weights(k)          # ZeRO-3: whole for this pass, let go after it
        experts = self.experts.part(k)
        self.experts.release_weights(k)
        return [*self.replica.part(i), *experts]

    def add_grads(self, i, terms):
        if i in self.blocks:
            self.experts.add_grads(self.blocks.index(i), terms[-3:])   # W1, W3, W2
            terms = terms[:-3]
        self.replica.add_grads(i, terms)

    def clip(self, max_norm, groups=(), shares=None):   # each expert once: on one rank of ep's
        squares = self.replica.squares(groups, shares) + self.experts.squares([*groups,
                                                                               self.ep_group])
        return scale_grads([*self.replica.grads(), *self.experts.grads()], max_norm, squares)

    def begin_step(self):
        self.replica.begin_step()
        self.experts.begin_step()

    def average(self):
        self.replica.average()
        for b, bucket in enumerate(self.experts.grad_buckets):   # the experts': at the end
            if self.cp_group is not None:   # step 5's --cp: a part a cp rank, summed first
                dist.all_reduce(bucket, group=self.cp_group)
            self.experts.reduce_gradients(b)
        self.experts.average()              # / dp

    def update(self):
        self.replica.update()
        self.experts.update()


def ep_groups(rank, world_size, ep):
    """(this rank's ep group: P consecutive ranks; its copies: the ranks of its ep rank)."""
    mine = None
    copies = None
    for start in range(0, world_size, ep):             # every rank makes every group
        group = dist.new_group(list(range(start, start + ep)))
        if start <= rank < start + ep:
            mine = group
    for r in range(ep):
        group = dist.new_group(list(range(r, world_size, ep)))
        if rank % ep == r:
            copies = group
    return mine, copies


# Part 6: the batch, and the worker ----------------------------------------------------------------

def make_batch(args, step, text=None):
    """The step's B windows of T + 1 characters of the training text, at offsets every rank draws
    alike from (--seed, step): inputs [B, T], targets [B, T], each position's next character."""
    if text is None:
        text = text_part("training")
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    starts = torch.randint(len(text) - args.context, (args.batch_size,), generator=gen)
    windows = text[starts[:, None] + torch.arange(args.context + 1)]   # [B, T + 1]
    return windows[:, :-1], windows[:, 1:]


def replica_rows(batch_size, dp_rank, dp_size):   # by its dp rank, never the global rank (3D)
    per_replica = batch_size // dp_size
    return torch.arange(batch_size)[dp_rank * per_replica:(dp_rank + 1) * per_replica]


def global_loss(loss, group):       # the replicas' mean losses, averaged: the global mean
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=group)
    return loss.item() / dist.get_world_size(group)


def make_replica(weights, group, zero=0, **options):   # the ZeRO stage asked for (--zero)
    return [DataParallel, ZeRO1, ZeRO2, ZeRO3][zero](weights, group, **options)


def dp_worker(rank, world_size, args):
    device = setup(rank, world_size)
    m = args.micro_batches
    init = init_params(args)                            # [E], the blocks, [g, H]
    parts = [[w.to(device, copy=True) for w in part] for part in init]
    ep_group = None
    if args.ep > 1:                                     # each block's W1, W3, W2: its E/P
        ep_group, copies = ep_groups(rank, world_size, args.ep)
        experts = [part[-3:] for part in parts[1:-1]]
        parts[1:-1] = [part[:-3] for part in parts[1:-1]]
        r = dist.get_rank(ep_group)
        local = args.experts // args.ep
        mine = [[w[r * local:(r + 1) * local].clone() for w in part] for part in experts]
    replica = make_replica(parts, None, zero=args.zero, optimizer=args.optimizer, lr=args.lr,
                           bucket_mb=args.bucket_mb, bf16=args.bf16, overlap=args.overlap)
    if args.ep > 1:                                     # the experts' copies, apart
        replica = WithExperts(replica, make_replica(mine, copies, zero=args.zero, bucket_mb=0,
                                                    replicas=world_size, optimizer=args.optimizer,
                                                    lr=args.lr, bf16=args.bf16), ep_group,
                              list(range(1, args.num_layers + 1)),
                              expert_places(init, r * local, local))
    rows = replica_rows(args.batch_size, rank, world_size)   # the world's ranks are the replicas
    resumed = load_checkpoint(args, replica)            # --resume: a step's state, any layout's
    gather = partial(whole_on_rank0, replica, tensors_of(init))   # on rank 0, whole
    losses = []
    norms = []
    check = SerialCheck(args, resumed)
    routers = None
    if args.experts:                                   # each block's
        routers = [Router(args.experts, args.top_k, device, ep_group)
                   for _ in range(args.num_layers)]
    moe = MoE(args, routers)
    blocks = model_blocks(args, routers, device)
    for step in range(args.start_step, args.steps):
        inputs, targets = (t[rows].to(device) for t in make_batch(args, step))   # the text's
        loss = dp_step(replica, blocks, cross_entropy, inputs.chunk(m), targets.chunk(m),
                       len(rows) * args.context, recompute=args.recompute)   # n: its positions
        moe.gather_routes(rows)                        # --save, --check: every replica's choice
        if args.check:   # this step's weights and gradients, whole on rank 0, against serial's
            check.step(gather(grads=False), gather(grads=True), moe.step())
        if args.clip_grad:
            norms.append(replica.clip(args.clip_grad).item())    # before the update
        if routers:                                    # the loads over every replica: the bias
            moe.loads += balance(routers, args.balance_rate).cpu()
        replica.update()
        losses.append(global_loss(loss, None))
        if rank == 0:
            log_step(f"[rank {rank}]", step, losses, norms, args)
        save_checkpoint(args, step + 1, replica, routers=routers)   # --checkpoint: its pieces
    finish_replicas(replica, args, tensors_of(init), losses, check, norms, resumed, moe)
    cleanup()


def main(argv=None):
    args = parse_args(argv)
    spawn(dp_worker, args.world_size, args, backend=args.backend, timeout_s=args.timeout_s)


# Below the fold: a GPU's fused kernels; each stage's costs;
# what later steps share (training flags, --save, checkpoints, the text, --check); the memory table.
import argparse, contextlib, functools, glob, json, os, shutil, sys  # noqa


def kernels_for(args, device):
    """A block's kernels: on a GPU (meta: its stand-in) torch's fused ones, attention's at flash's
    head sizes, and a ring pair's in bf16 alone, FlashAttention's (the ring merges lse, which the
    fp32 kernel pads to 32 places)."""
    if device is None or torch.device(device).type == "cpu":
        return Kernels()
    kernels = Kernels(fused_rmsnorm, fused_rmsnorm_backward)
    head_dim = args.dim // args.heads
    if head_dim % 8 or head_dim > 256:
        return kernels
    kernels = kernels._replace(attention=fused_attention,
                               attention_backward=fused_attention_backward)
    if args.bf16:
        kernels = kernels._replace(attend=fused_attend, attend_backward=fused_attend_backward)
    return kernels


def fused_rmsnorm(x, g):   # rmsnorm() in one pass
    return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], g, EPS)


def fused_rmsnorm_backward(dy, x, r, g):   # rmsnorm_backward(), dg summed in fp32
    dx, dg = torch.ops.aten._fused_rms_norm_backward(dy, x, [x.shape[-1]], r, g, [True, True])
    return dx, wide(dg)


def fused_attention(q, k, v, head_dim):   # attention() by fused_attend
    kv_heads = k.shape[-1] // head_dim
    o, lse = fused_attend(query_heads(q, kv_heads, head_dim), kv_head(k, head_dim),
                          kv_head(v, head_dim), head_dim)
    return columns(o).to(v.dtype), lse.flatten(1, 2)


def fused_attention_backward(do, q, k, v, o, lse, head_dim):   # attention_backward() by its own
    kv_heads = k.shape[-1] // head_dim
    do, q, o = (query_heads(t, kv_heads, head_dim) for t in (do, q, o))
    grads = fused_attend_backward(do, q, kv_head(k, head_dim), kv_head(v, head_dim), o,
                                  lse.unflatten(1, q.shape[1:3]), head_dim)
    return [columns(t).to(q.dtype) for t in grads]


def fused_attend(q, k, v, head_dim, causal=True):
    """attend() by torch's fused kernel, fed heads [b, h | G, s | t, dh]: bf16's FlashAttention-2
    reads a kv head for its group; fp32's memory-efficient kernel takes each kv head repeated (its
    lse padded to 32 positions). causal: the mask of a diagonal (step 3's pairs)."""
    group = q.shape[1:3]
    q, k, v = (t.flatten(1, 2) for t in (q, k, v))
    if q.dtype == torch.float32:
        k, v = (t.repeat_interleave(group[1], dim=1) for t in (k, v))
        o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, is_causal=causal)[:2]
    else:
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, is_causal=causal)[:2]
    return o.unflatten(1, group), lse.unflatten(1, group)


def fused_attend_backward(do, q, k, v, o, lse, head_dim, causal=True):
    """attend_backward() by torch's fused backward, the kv heads as the forward fed them (a
    repeated head's dk, dv summed over its group); it makes delta and A itself. No dropout: the
    random state it takes is read by neither kernel (empty)."""
    group = q.shape[1:3]
    do, q, k, v, o = (t.flatten(1, 2).to(q.dtype) for t in (do, q, k, v, o))
    lse = lse.flatten(1, 2)
    seed = torch.empty(2, dtype=torch.uint64, device=q.device)
    offset = torch.empty((), dtype=torch.uint64, device=q.device)
    if q.dtype == torch.float32:
        k, v = (t.repeat_interleave(group[1], dim=1) for t in (k, v))
        dq, dk, dv = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            do, q, k, v, None, o, lse, seed, offset, 0.0, [True, True, True, False],
            is_causal=causal)[:3]
        dk, dv = (t.unflatten(1, group).sum(2) for t in (dk, dv))
    else:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, o, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset)
    return dq.unflatten(1, group), dk[:, :, None], dv[:, :, None]


from collectives import Parser, Stop, check_launch_args, positive_float, positive_int  # noqa


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


def in_step_bytes(chunks, dp_size, zero=0, num_micro_batches=1):
    """Bytes a replica holds in a step beyond dp_costs's (chunks: each chunk's bucket elements): a
    chunk's buckets whole (ZeRO-2, 3) until reduce-scattered, less the parts not made yet."""
    whole = 4 * sum(chunks)
    if zero < 2:
        return 0
    if zero == 2 and num_micro_batches > 1:
        return whole - whole // dp_size
    first_only = num_micro_batches == 1
    return max(4 * n - 4 * (sum(chunks[:c]) + n * first_only) // dp_size
               for c, n in enumerate(chunks))


def param_names(args):   # --save's names, each tensor's, in the init order
    names = block_names(args.qk_norm, args.experts)
    blocks = [f"blocks.{layer}.{name}" for layer in range(args.num_layers) for name in names]
    return ["embedding", *blocks, "norm", "head"]


def serial_loss(params, tokens, targets, config, bf16=False, halves=False, record=None,
                moe=None):
    """The loss with autograd, and its logits [b T, V], from torch's layers (embedding, rms_norm,
    SDPA with enable_gqa, silu) and Meta's RoPE (a pair a complex number, times e^(i m theta_i)).
    bf16: the parallel runs' casts (bf16 matmuls on fp32 masters summed in fp32; norms, RoPE,
    softmax, loss fp32). halves: each matmul sums its terms' halves apart, as two tp ranks do.
    record: gets each tensor's (input, output): (tokens, E's rows), a gain's (x r, x r g), a
    matrix's (x, x W). moe: (K, biases [L, E], routes [L, b, T, K] or None: its own choice), every
    expert at every position, weighted by gate_e where chosen."""
    dtype = torch.bfloat16 if bf16 else params[0].dtype
    head_dim = config.dim // config.heads
    w = dict(zip(param_names(config), params))
    T = tokens.shape[1]
    i = torch.arange(head_dim // 2, dtype=torch.float64, device=tokens.device)
    angles = torch.arange(T, dtype=torch.float64, device=tokens.device)[:, None] * \
        config.rope_theta ** (-2 * i / head_dim)                      # [T, dh/2]
    turn = torch.polar(torch.ones_like(angles), angles)[:, None]     # e^(i m theta_i) [T, 1, dh/2]

    def note(x, out):   # only when asked: the notes hold every activation of the pass
        if record is not None:
            record.append((x, out))

    def product(x, w):   # bf16's inputs summed in fp32, rounded once: a GPU's bf16 matmul (the
        return (wide(x) @ wide(w.to(dtype))).to(dtype)   # CPU's rounds on the way, 13x slower)

    def matmul(x, w):
        h = w.shape[-2] // 2
        z = product(x[..., :h], w[..., :h, :]) + product(x[..., h:], w[..., h:, :]) if halves \
            else product(x, w)
        note(x, z)
        return z

    def norm(x, g):
        normed = F.rms_norm(wide(x), g.shape, None, EPS)
        y = normed * wide(g.to(dtype))   # the layers hold a gain in bf16 too
        note(normed, y)
        return y.to(dtype)

    def split_heads(t):   # [b, T, n dh] -> [b, T, n, dh]
        return t.unflatten(-1, (-1, head_dim))

    def rope(t):          # [b, T, n, dh]: each pair a complex number, times e^(i m theta_i)
        pairs = torch.view_as_complex(wide(t).unflatten(-1, (-1, 2)).contiguous())
        return torch.view_as_real(pairs * turn.to(pairs.dtype)).flatten(-2).to(t.dtype)

    def swiglu(n, w1, w3, w2):
        return matmul(F.silu(matmul(n, w1)) * matmul(n, w3), w2)

    def experts(n, wr, w1, w3, w2, layer):   # n [b, T, D]; every expert everywhere, weighted
        logits = wide(n) @ wide(wr.to(dtype))                 # [b, T, E], fp32
        note(n, logits)
        gate = logits.softmax(-1)
        top_k, biases, routes = moe
        if routes is None:
            order = (gate + biases[layer]).sort(dim=-1, descending=True, stable=True).indices
            chosen = order[..., :top_k]
        else:
            chosen = routes[layer]
        weight = torch.zeros_like(gate).scatter(-1, chosen, 1.0) * gate   # gate_e where chosen
        ns = n.expand(w1.shape[0], *n.shape)                  # [E, b, T, D]
        y = swiglu(ns, *(t.to(dtype)[:, None] for t in (w1, w3, w2)))   # [E, b, T, D]
        return (wide(y) * weight.movedim(-1, 0)[..., None]).sum(0).to(dtype)
    rows = F.embedding(tokens, w["embedding"]).to(dtype)
    note(tokens, rows)
    x = rows
    for layer in range(config.num_layers):
        b = {name: w[f"blocks.{layer}.{name}"] for name in block_names(config.qk_norm, moe)}
        n = norm(x, b["norm1"])
        q, k, v = (split_heads(matmul(n, b[name])) for name in ("wq", "wk", "wv"))
        if config.qk_norm:
            q = norm(q, b["norm_q"])
            k = norm(k, b["norm_k"])
        q, k, v = (wide(t).transpose(1, 2) for t in (rope(q), rope(k), v))   # [b, n, T, dh]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + matmul(o.to(dtype).transpose(1, 2).flatten(-2), b["wo"])
        n = norm(x, b["norm2"])
        if moe:
            x = x + experts(n, b["router"], b["w1"], b["w3"], b["w2"], layer)
        else:
            x = x + swiglu(n, b["w1"], b["w3"], b["w2"])
    logits = wide(matmul(norm(x, w["norm"]), w["head"]).flatten(0, 1))
    return F.cross_entropy(logits, targets.reshape(-1)), logits


def gradient_terms(record, logits, targets, params):
    """Each tensor's scale for its gradient's rounding: the largest sum of |terms| one of its
    elements sums, dz coming down from (p + onehot(y)) / n (near convergence, or far off it, a
    small sum of larger terms): the gradient of logsumexp(logits) + logits[y]. A matrix's
    |x|^T |dz|; a gain's |x| |dz| over positions (and heads); E's rows of |dz|.
    record: serial_loss's; its graph is kept."""
    magnitude = (logits.logsumexp(dim=1) + logits.gather(1, targets.reshape(-1, 1))[:, 0]).mean()
    dzs = torch.autograd.grad(magnitude, [out for _, out in record], retain_graph=True)
    terms = []
    for (x, _), dz, w in zip(record, dzs, params):
        dz = wide(dz).abs()
        if not x.is_floating_point():                 # E: the rows its tokens picked
            term = torch.zeros_like(w).index_add_(0, x.reshape(-1), dz.flatten(0, -2))
        elif w.dim() == 1:                              # a gain: over the positions
            term = (wide(x).abs() * dz).flatten(0, -2).sum(0)
        elif w.dim() == 3:                              # experts' [E, ..]: each its own
            term = wide(x).abs().flatten(1, -2).transpose(1, 2) @ dz.flatten(1, -2)
        else:
            term = wide(x).abs().flatten(0, -2).T @ dz.flatten(0, -2)
        terms.append(term.max())
    return terms


def memory_held(replica):   # bytes held now, by kind; a view of another tensor counts once
    if hasattr(replica, "experts"):                   # --ep: the replica's and the experts'
        rest = memory_held(replica.replica)
        experts = memory_held(replica.experts)
        return {kind: rest[kind] + experts[kind] for kind in rest}
    state = [t for s in replica.optimizer.state.values() for t in s.values() if t.dim()]
    masters = replica.params if replica.params[0].dtype != replica.dtype else []   # bf16's
    gathering = [flat for _, flat in getattr(replica, "gathering", {}).values()]   # ZeRO-3's
    kinds = {"weights": [replica.weights, getattr(replica, "flat", 0), replica.params *
                         (not masters), gathering],
             "gradients": [replica.grad_buckets, getattr(replica, "grad_shards", 0),
                           [shard for _, shard in getattr(replica, "shards_in_flight", [])]],
             "optimizer state": [state, masters]}
    return {kind: sum({id(t.untyped_storage()): t.untyped_storage().nbytes()   # (the storage
                       for ts in lists if ts for t in ts if t is not None}.values())  # object:
            for kind, lists in kinds.items()}                   # a meta tensor has no address)


def show_memory(replica, args, whose):
    now, P = memory_held(replica), sum(replica.lengths)
    want = dp_costs(replica.lengths, replica.dp_size, args.zero, optimizer=args.optimizer,
                    bf16=args.bf16)[1]
    want["total"] = (sum(b for b, _ in want.values()), " + ".join(f for _, f in want.values()))
    print(f"memory held at the end of a step by {whose}: --zero {args.zero}, d={replica.dp_size}, "
          f"P = {P} parameters{' (buckets padded to a multiple of d)' * bool(args.zero)}, "
          f"{'bf16 on fp32 masters (in the optimizer state)' if args.bf16 else 'fp32'}")
    if args.bf16:
        print("  kept as Megatron and DDP keep them: the bf16 copies, the gradient buckets")
    for kind, got in [*now.items(), ("total", sum(now.values()))]:
        print(f"  {kind:<16}{got:>12} bytes   formula {want[kind][1]:<18} = {want[kind][0]:>10.0f}")


def finish_replicas(replica, args, init, losses, check, norms, resumed, moe=None):
    weights = whole_on_rank0(replica, init)
    drift = replica_drift(replica)   # every rank: the replicas must agree, bit for bit
    if dist.get_rank() == 0:
        log("[rank 0]", f"replicas identical after training: {drift == 0.0} (largest "
                        f"difference {drift:g})")
        show_memory(replica, args, "each replica")
        finish_run(args, init, weights, losses, check, norms, resumed,
                   extra={"replica_max_diff": drift}, moe=moe)


class MoE:
    """--experts' record: the bias each step began with and every replica's choices (gathered
    for --save and --check), the loads [L, E] summed over training; on rank 0, what --save
    writes (init_bias, final_bias, routes [steps, L, B, T, K]) and the loads' table."""

    def __init__(self, args, routers):
        self.args = args
        self.routers = routers
        self.biases = []
        self.routes = []
        self.loads = 0
        if routers and args.marker:                   # --resume: the bias it was at
            for router, bias in zip(routers, args.marker["bias"]):
                router.bias.copy_(torch.tensor(bias))
        if routers:
            self.init_bias = torch.stack([router.bias.cpu() for router in routers])

    def gather_routes(self, rows=None, positions=None, counted=True):
        """Every rank's choices in place in [L, B, T, K], zeros elsewhere, summed over the world:
        the blocks it holds (a stage's), its rows (a replica's: rows [b]), its positions (cp's:
        positions [t]). counted=False: a tp rank but the first, which holds the same."""
        if not self.routers:
            return
        biases = torch.stack([router.bias.cpu() for router in self.routers])   # before balance
        if self.args.save or self.args.check:
            B, T, K = self.args.batch_size, self.args.context, self.args.top_k
            device = self.routers[0].bias.device
            routes = torch.zeros(len(self.routers), B, T, K, dtype=torch.long, device=device)
            rows = torch.arange(B) if rows is None else rows
            positions = torch.arange(T) if positions is None else positions
            for layer, router in enumerate(self.routers):
                if router.routes and counted:
                    chosen = torch.cat(router.routes).view(len(rows), len(positions), K)
                    routes[layer, rows.to(device)[:, None], positions.to(device)] = chosen
            dist.all_reduce(routes)
            self.routes.append(routes.cpu())
            self.biases.append(biases)
        for router in self.routers:
            router.routes = []

    def step(self):         # serial_loss's moe for this step's check
        if not self.routers:
            return None
        return self.args.top_k, self.biases[-1], self.routes[-1]

    def final(self):        # the trained model's: its own choice, by the final bias
        if not self.routers:
            return None
        return self.args.top_k, torch.stack([router.bias.cpu() for router in self.routers]), None

    def saved(self):
        return {"init_bias": self.init_bias, "final_bias": self.final()[1], "loads": self.loads,
                **({"routes": torch.stack(self.routes)} if self.args.save else {})}

    def show_loads(self):
        """Each layer's busiest expert over the mean, the loads summed over training."""
        ratios = [f"{(load.max() / load.mean()).item():.2f}" for load in self.loads]
        print(f"experts' loads over training, busiest / mean, a layer: {' '.join(ratios)} "
              f"(--balance-rate {self.args.balance_rate:g})", flush=True)


def replica_drift(replica):
    """Largest |W - the first replica's W|, of the weights the layers compute with (--ep: the
    experts' among their copies): 0 while the replicas agree. ZeRO-3 keeps none between steps."""
    drift = torch.zeros((), device=replica.device)
    for held, _, _ in holdings(replica):
        first = dist.get_global_rank(held.group, 0) if held.group else 0
        for w in held.weights:
            if w is None:                     # ZeRO-3's, let go after its pass
                continue
            theirs = w.clone()
            dist.broadcast(theirs, src=first, group=held.group)
            drift = torch.maximum(drift, (w - theirs).abs().max().float())
    dist.all_reduce(drift, op=dist.ReduceOp.MAX)
    return drift.item()


def training_parser(description, dp=False):
    """The flags every training script takes; dp=True adds --zero and --bucket-mb."""
    p = Parser(description=description)
    for flag, kind, default, help in [
            ("--num-layers", positive_int, 4, "transformer blocks L"),
            ("--dim", positive_int, 64, "width D: the residual stream's"),
            ("--heads", positive_int, 4, "attention heads h; divides --dim"),
            ("--kv-heads", positive_int, None, "key and value heads G, each read by h/G query "
             "heads; divides --heads; None: h/2, or h where h is odd (h: multi-head attention)"),
            ("--ffn-dim", positive_int, None, "the MLP's width F; None: 8D/3 rounded up to a "
             "multiple of 48"),
            ("--rope-theta", positive_float, 10000.0, "RoPE's base (Llama 3's: 500000)"),
            ("--context", positive_int, 32, "characters T a sequence holds"),
            ("--batch-size", positive_int, 64, "global batch B: windows of the text a step"),
            ("--micro-batches", positive_int, 2, "micro-batches m"),
            ("--steps", positive_int, 200, "optimizer steps"),
            ("--lr", positive_float, 1e-2, "learning rate"),
            ("--seed", int, 0, "the weights, and each step's windows with the step"),
            ("--sample", int, 200, "characters the trained model writes at the end (0: none)"),
            ("--save", str, None, "torch.save the run: config, parameters, batches, losses"),
            ("--clip-grad", positive_float, None, "clip the gradient's 2-norm (clip_grad_norm_)"),
            *[("--bucket-mb", float, 25.0, "gradients a bucket holds, in MB (the first 1 MB at "
               "most, as DDP's); 0: one part a bucket")] * dp]:
        p.add_argument(flag, type=kind, default=default, help=help)
    p.add_argument("--checkpoint", metavar="DIR", help="write the run's state into DIR, each "
                   "rank its own pieces, after the last step")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="and after every N steps (0: the last only)")
    p.add_argument("--resume", metavar="DIR", help="continue from the newest complete checkpoint "
                   "in DIR, at any layout")
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="adamw",
                   help="plain SGD, or AdamW with PyTorch's defaults (SGD shows scale errors)")
    p.add_argument("--check", action="store_true",
                   help="check every step against serial autograd training from the same weights")
    p.add_argument("--recompute", action="store_true", help="keep each micro-batch's input "
                   "alone, and run the forward again in its backward")
    p.add_argument("--bf16", action="store_true", help="compute in bf16 on fp32 master weights, "
                   "gradients and optimizer")
    p.add_argument("--qk-norm", action="store_true", help="Qwen3's RMSNorm on each head of q and "
                   "of k, before RoPE")
    p.add_argument("--experts", type=int, default=0, help="E experts a block's MLP, and a router "
                   "(0: the dense MLP)")
    p.add_argument("--top-k", type=positive_int, default=1, help="experts K a position takes")
    p.add_argument("--balance-rate", type=float, default=1e-3, help="the routers' bias moves by "
                   "this a step toward the mean load (0: no balancing)")
    p.add_argument("--ep", type=positive_int, default=1, help="expert parallelism: the ranks P "
                   "of an ep group, each holding E/P experts (all-to-all)")
    if dp:
        p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0,
                       help="ZeRO stage over the data-parallel group: 1 shards the optimizer "
                            "state, 2 the gradients too, 3 the weights too (FSDP)")
    p.set_defaults(sequence_parallel=False)   # --save's config records it (steps 3, 5 take it)
    return p


def check_training_args(parser, args, world_size, replicas=1, replicas_flag=None,
                        ranks_flag="--world-size"):
    """The rules every training script shares, and the memory its ranks need: the model (P),
    its state (dp_costs), the logits (2 B T V), every block's stash. Reads the text."""
    args.vocab_size = VOCAB_SIZE              # the text's: printable ASCII, newline, the rest
    model_defaults(args)
    L, D, B, m, V = args.num_layers, args.dim, args.batch_size, args.micro_batches, VOCAB_SIZE
    by, rows = f"{replicas_flag} x " if replicas_flag else "", B // replicas
    bucket_mb = getattr(args, "bucket_mb", 0)
    ids, source = read_text()                       # read here, once: forked ranks share it
    args.marker = None                              # --resume DIR: its newest checkpoint's
    if args.resume is not None:
        try:
            args.marker = newest_checkpoint(args.resume)
        except ValueError as e:                     # its complete.json is no marker
            parser.refuse([(True, f"--resume {args.resume}: {e}")])
    args.start_step = args.marker["step"] if args.marker else 0
    smaller = min(len(text_part("training")), len(text_part("validation")))
    parser.refuse([
        (smaller <= args.context, f"--context {args.context}: a window is {args.context + 1} "
         f"characters, and {source} has {len(ids)} (its smaller part, {smaller})"),
        (not 0 <= args.seed < 2**32, f"--seed {args.seed}: expected 0 to {2**32 - 1}"),
        *model_rules(args),
        (args.lr > 3.4e38, f"--lr {args.lr:g}: more than a float32 holds (3.4e38)"),
        (torch.tensor(args.lr).item() == 0, f"--lr {args.lr:g}: 0 in float32, which trains "
                                            f"nothing (the smallest is 1.4e-45)"),
        (args.save is not None and not writable(args.save),
         f"--save {args.save!r}: cannot write a file there"),
        (m > rows, f"--micro-batches {m}: more micro-batches than rows per replica ({rows})"),
        (B % (replicas * m), f"--batch-size {B} is not divisible by {by}--micro-batches "
                             f"({replicas * m})"),
        (not 0 <= bucket_mb <= 1e6, f"--bucket-mb {bucket_mb:g}: expected 0 to 1e6"),
        (args.sample < 0, f"--sample {args.sample}: expected 0 (no sample) or more characters"),
        (args.checkpoint_every < 0, f"--checkpoint-every {args.checkpoint_every}: expected 0 "
                                    f"(after the last step only) or more"),
        (args.checkpoint_every and args.checkpoint is None,
         f"--checkpoint-every {args.checkpoint_every}: needs --checkpoint DIR to write into"),
        (args.checkpoint is not None and not writable_folder(args.checkpoint),
         f"--checkpoint {args.checkpoint!r}: cannot make or write a folder there"),
        *resume_rules(args, args.marker), *experts_rules(args, replicas, replicas_flag)])
    T = args.context
    F = args.ffn_dim * max(1, args.experts)
    P = L * (4 * D * D + 3 * D * F) + 2 * V * D
    held = dp_costs([P], replicas, zero=getattr(args, "zero", 0))[1]
    state = sum(size for size, _ in held.values())
    stash = L * B * T * (10 * D + 3 * F + 2 + args.heads * T)   # a block's, fp32: at most
    check_launch_args(parser, args, world_size, ranks_flag, 4 * (P + 2 * B * T * V + stash) + state,
                      f"--num-layers {L} --dim {D} --batch-size {B}")
    import torch._dynamo as dynamo  # noqa: F401  (each rank's optimizer imports it: once, here)


def model_defaults(args):   # --kv-heads and --ffn-dim, where not given
    if args.kv_heads is None:
        args.kv_heads = args.heads
        if args.heads % 2 == 0:
            args.kv_heads = args.heads // 2
    if args.ffn_dim is None:                  # 8D/3, up to a multiple of 48 (so tp 1-4, 6, 8)
        args.ffn_dim = -(-8 * args.dim // (3 * 48)) * 48


def model_rules(args):   # what the block cannot be built with, each in one line
    D, h = args.dim, args.heads
    return [(D % h, f"--dim {D} is not divisible by --heads {h}: each head has D/h columns"),
            (h % args.kv_heads, f"--kv-heads {args.kv_heads} does not divide --heads {h}: each "
                                f"kv head is read by h/G query heads"),
            (D % h == 0 and D // h % 2, f"--dim {D} / --heads {h} = {D // h} column"
                                        f"{'s' * (D // h > 1)} a head: RoPE turns them in pairs, "
                                        f"so it must be even")]


def experts_rules(args, replicas, replicas_flag):   # --experts, --top-k, --balance-rate, --ep
    E = args.experts
    return [(E < 0, f"--experts {E}: expected 0 (the dense MLP) or more"),
            (E and args.top_k > E, f"--top-k {args.top_k}: more than --experts {E}"),
            (not E and args.top_k != 1, f"--top-k {args.top_k}: needs --experts"),
            (not 0 <= args.balance_rate < 1, f"--balance-rate {args.balance_rate:g}: expected "
                                             f"0 (none) to below 1"),
            (args.ep > 1 and not E, f"--ep {args.ep}: needs --experts"),
            (E and E % args.ep, f"--ep {args.ep} does not divide --experts {E}"),
            (args.ep > 1 and replicas % args.ep, f"--ep {args.ep} does not divide {replicas_flag} "
                                                 f"{replicas} (the replicas hold the experts)")]


def writable(path):   # a regular file this process can write, or make: tried, not asked
    try:
        if os.path.exists(path):            # not a folder, a pipe or a device
            return os.path.isfile(path) and open(path, "ab").close() is None
        open(path, "ab").close()
        return os.remove(path) is None
    except OSError:                         # also: a missing folder, '' (no such file)
        return False


def writable_folder(path):   # tried, not asked (root passes os.access, /proc included)
    path = os.path.abspath(path)
    while not os.path.exists(path):   # a file made in the nearest folder that exists, and removed
        path = os.path.dirname(path)
    return os.path.isdir(path) and writable(os.path.join(path, f".parallel-{os.getpid()}"))


def parse_args(argv=None):
    parser = training_parser("Data parallelism: replicas on slices of the batch.", dp=True)
    parser.add_argument("--world-size", type=positive_int, default=4, help="replicas d")
    parser.add_argument("--overlap", action="store_true", help="exchange a bucket once final")
    args = parser.parse_args(argv)
    check_training_args(parser, args, args.world_size, args.world_size, "--world-size")
    return args


def log_step(tag, step, losses, norms, args):
    """A step's loss and grad norm: every step of a short run, else every tenth, and the last."""
    every = max(1, args.steps // 10) if args.steps > 20 else 1
    if step % every and step != args.steps - 1:
        return
    clipped = " (clipped)" if norms and norms[-1] > args.clip_grad else ""
    grad_norm = f"  grad norm {norms[-1]:.4f}{clipped}" if norms else ""
    log(tag, f"step {step:3d}  loss {losses[-1]:.6f}{grad_norm}")


def finish_run(args, init, final, losses, check, norms=(), resumed=None, extra=None, moe=None):
    """Rank 0, every tensor whole, in order: --experts' loads (moe: the run's MoE), --save (written
    beside, renamed onto it: a full disk leaves what was there; init_params: resumed's, if it
    resumed), a non-finite loss's Stop, the validation loss and a sample, --check."""
    routing = None                      # the trained model's own choice, for its validation loss
    if moe is not None and moe.routers:
        moe.show_loads()
        extra = {**(extra or {}), **moe.saved()}
        routing = moe.final()
    if args.save:
        batches = [make_batch(args, step) for step in range(args.start_step, args.steps)]
        if resumed:                     # the state it resumed from (load_checkpoint's)
            init = resumed["param"]
        init = [w.float().cpu() for w in init]
        final = [w.detach().float().cpu() for w in final]
        try:
            names = param_names(args)
            torch.save({"config": vars(args), "init_params": dict(zip(names, init)),
                        "final_params": dict(zip(names, final)),
                        "inputs": torch.stack([inputs for inputs, _ in batches]),
                        "targets": torch.stack([targets for _, targets in batches]),
                        "losses": list(losses), "grad_norms": list(norms), **(extra or {})},
                       f"{args.save}.partial")
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
    if not all(w.isfinite().all() for w in final):   # the last update's: no loss saw them
        raise Stop(f"the weights stopped being finite at the last step's update: --lr "
                   f"{args.lr:g} is too large for this model; try a smaller one")
    show_language_model([w.detach().float().cpu() for w in final], args, moe=routing)
    if args.check:
        check.finish(final, losses, norms)


# Checkpoints: --checkpoint DIR, --checkpoint-every N, --resume DIR. A run's state is its step
# (which, with --seed, decides the data: make_batch draws step s's windows from them alone), the
# fp32 parameters and AdamW's two moments and step count. No rank gathers it: each piece is
# written once, by a rank that holds it, with its place in the whole, and each rank reads back the
# pieces that overlap what it will hold, at whatever layout the resumed run has. Our tp shards are
# boxes of the whole (shard_box); ZeRO's flat buckets are no DTensor layout at all, and a
# replica's range of a bucket is a range of a box's elements (places). torch.distributed.checkpoint
# (DCP) does the same for DTensors; with DTensor, use DCP. Each function here, as DCP names it:
#   held_pieces                   the planner's local plan: what this rank writes or reads
#   gather_index, the marker      the global plan, saved as .metadata (complete.json here)
#   write_file, read_pieces       the storage writer and reader (FileSystemWriter, -Reader)
#   copy_overlaps                 resharding: the load planner's overlap of saved and wanted
CHECKPOINT_STATE = ("param", "exp_avg", "exp_avg_sq")   # a piece's tensors: fp32, AdamW's two
MARKER = "complete.json"   # written last, by rename: the checkpoint's every piece is there


class Piece(NamedTuple):   # elements [start, end) of whole tensor `tensor`'s box, row-major
    tensor: int
    box: tuple              # rows [top, bottom), columns [left, right) of the whole ([D]: a row)
    start: int
    end: int
    views: dict = None      # CHECKPOINT_STATE's, [end - start] each; None: a place alone (index)


def places(piece):   # each element's place in the whole, row r column c as r 2^32 + c: ascending
    top, bottom, left, right = piece.box
    grid = torch.arange(top, bottom)[:, None] * 2**32 + torch.arange(left, right)
    return grid.view(-1)[piece.start:piece.end]


def held_pieces(replica, tensors=None, boxes=None, grads=False):
    """What this rank's optimizer holds, as pieces of the whole model, views into what it
    steps (grads: into its gradients instead, as "param"). Its tensor i is the box boxes[i] of
    whole tensor tensors[i] (None: tensor i, whole), and [start, end) the elements of that box
    it holds: all, or under ZeRO what falls in this replica's 1/d of i's bucket. Experts
    [E', r, c]: boxes[i] a list, each held expert's box in the whole's [E R, C]."""
    held_by = replica.grads() if grads else replica.params
    pieces = []
    for i, tensor in enumerate(tensors or range(len(replica.shapes))):
        cols = replica.shapes[i][-1]                  # a gain [D]: one row; experts'
        rows = replica.shapes[i].numel() // cols      # [E, r, c]: E r rows
        box = (0, rows, 0, cols)
        if boxes and not isinstance(boxes[i], list):
            box = tuple(boxes[i])
        start = 0
        end = rows * cols
        at = 0                                        # where [start, end) begins in held
        if not replica.shards_optimizer:
            held = held_by[i]                         # the whole tensor, [rows, cols]
        else:
            held = held_by[replica.layout.bucket_of[i]]   # [S]: this replica's 1/d of the
            mine = replica.dp_rank * len(held)        # bucket: from element r S
            offset = replica.layout.offset[i]         # tensor i: from here in the bucket
            start = max(offset, mine) - offset
            end = min(offset + rows * cols, mine + len(held)) - offset
            at = offset + start - mine
            if start >= end:
                continue
        state = {"param": held, **replica.optimizer.state.get(held, {})}
        views = {name: state[name].view(-1)[at:at + end - start]
                 for name in CHECKPOINT_STATE if name in state}
        pieces.append(Piece(tensor, box, start, end, views))
        if boxes and isinstance(boxes[i], list):
            pieces[-1:] = by_expert(pieces[-1], boxes[i])
    return pieces


def by_expert(piece, boxes):
    """A piece of experts [E', r, c] (its elements [start, end) of all E' r c) as a piece a held
    expert, each of its own box: expert k's elements are k r c .. (k+1) r c."""
    top, bottom, left, right = boxes[0]
    size = (bottom - top) * (right - left)
    pieces = []
    for k, box in enumerate(boxes):
        start = max(piece.start, k * size)
        end = min(piece.end, (k + 1) * size)
        if start < end:
            views = {name: view[start - piece.start:end - piece.start]
                     for name, view in piece.views.items()}
            pieces.append(Piece(piece.tensor, tuple(box), start - k * size, end - k * size, views))
    return pieces


def holdings(replica, tensors=None, boxes=None):
    """(replica, tensors, boxes) for each optimizer this rank steps: --ep's two (WithExperts)."""
    if hasattr(replica, "experts"):
        return [(replica.replica, *replica.held[0]), (replica.experts, *replica.held[1])]
    return [(replica, tensors, boxes)]


def rank_pieces(replica, tensors=None, boxes=None, copies=(), grads=False):   # what it writes
    return [piece for held, t, b in holdings(replica, tensors, boxes)
            for piece in own_pieces(held_pieces(held, t, b, grads=grads), held, copies)]


def expert_places(init, first, count):
    """Step 2's --ep: (tensors, boxes) of the replica (all but W1, W3, W2, whole) and of the
    experts' copies (W1, W3, W2 of each block: experts first .. first + count, each a box)."""
    spans = spans_of(init)
    shapes = [w.shape for w in tensors_of(init)]
    experts = [i for part in spans[1:-1] for i in part[-3:]]
    rest = [i for i in range(len(shapes)) if i not in experts]
    return ((rest, None),
            (experts, [expert_boxes(shapes[i], range(first, first + count)) for i in experts]))


def expert_boxes(shape, experts, box=None):
    """An expert tensor [E, R, C]'s pieces: each held expert's box (box: of its [R, C], all if
    None) in the whole seen as [E R, C], where expert e's rows are e R .. (e+1) R."""
    rows = shape[-2]
    top, bottom, left, right = box or (0, rows, 0, shape[-1])
    return [(e * rows + top, e * rows + bottom, left, right) for e in experts]


def own_pieces(pieces, replica, copies=()):
    """Those no other rank writes: dp rank 0 alone a replica's (ZeRO's differ), tp rank 0 alone
    its copies (the tensors every tp rank holds whole)."""
    if replica.dp_rank > 0 and not replica.shards_optimizer:
        return []
    return [piece for piece in pieces if piece.tensor not in copies]


def whole_pieces(state):   # {name: whole tensors, in order}: each tensor as one piece, all of it
    shapes = [t.shape for t in next(iter(state.values()))]
    return [Piece(j, (0, shape.numel() // shape[-1], 0, shape[-1]), 0, shape.numel(),
                  {name: tensors[j].view(-1) for name, tensors in state.items()})
            for j, shape in enumerate(shapes)]


def copy_overlaps(mine, theirs):
    """Into my pieces, the elements of theirs at the same places of the same tensor (theirs
    without views: counted alone); returns how many. Both places ascend: searchsorted finds them
    (on the CPU; a view on a GPU is written there)."""
    copied = 0
    their_places = [places(their_piece) for their_piece in theirs]   # each once
    for piece in mine:
        wanted = places(piece)
        for their_piece, held in zip(theirs, their_places):
            if their_piece.tensor != piece.tensor:
                continue
            at = torch.searchsorted(held, wanted).clamp_(max=len(held) - 1)
            both = held[at] == wanted
            for name, view in (piece.views if their_piece.views else {}).items():
                view[both.to(view.device)] = their_piece.views[name][at[both]].to(view.device)
            copied += int(both.sum())
    return copied


def gather_on_rank0(rows):
    """Every rank's rows [n, ...], padded with -1 to the most n, stacked on rank 0; else None.
    (Torch's object collectives would need numpy.)"""
    most = torch.tensor(len(rows), device=rows.device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    padded = torch.cat([rows, rows.new_full((most.item() - len(rows), *rows.shape[1:]), -1)])
    rank0 = dist.get_rank() == 0
    parts = [torch.empty_like(padded) for _ in range(dist.get_world_size())] if rank0 else None
    dist.gather(padded, parts, dst=0)
    return torch.stack(parts) if rank0 else None


def gather_index(pieces, device):
    """Rank 0: every rank's pieces' places, {rank: [Piece without views]}, for the marker (DCP's
    .metadata): a [n, 7] tensor a rank, gathered."""
    places = torch.tensor([[p.tensor, *p.box, p.start, p.end] for p in pieces],
                          dtype=torch.int64, device=device).view(-1, 7)
    every = gather_on_rank0(places)               # [ranks, the most, 7]
    if every is None:
        return None
    return {rank: [row for row in rows.tolist() if row[0] >= 0] for rank, rows in enumerate(every)}


def save_checkpoint(args, step, replica, tensors=None, boxes=None, copies=(), routers=None):
    """--checkpoint DIR after every --checkpoint-every N steps and the last: DIR/step-00000150/, a
    file a rank with its pieces (without ZeRO, replicas beyond dp rank 0 write none: they hold the
    same; nor does a rank write its copies, tensors that tp rank 0 holds whole too), then the marker
    with every rank's pieces' places, by rename, once every rank's file is on disk. A run killed
    before that leaves the checkpoints before as they were; the two newest complete are kept."""
    due = step == args.steps or (args.checkpoint_every and step % args.checkpoint_every == 0)
    if not args.checkpoint or not due:
        return
    rank = dist.get_rank()
    folder = os.path.join(args.checkpoint, f"step-{step:08d}")
    if rank == 0:                                     # an earlier run's of this step: replaced
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
    dist.barrier()
    pieces = rank_pieces(replica, tensors, boxes, copies)
    index = gather_index(pieces, replica.device)
    if pieces:                        # plain tuples (torch.load's weights_only reads them), each
        saved = [(p.tensor, tuple(p.box), p.start, p.end,   # view's own bytes
                  {name: view.to("cpu", copy=True) for name, view in p.views.items()})
                 for p in pieces]
        write_file(os.path.join(folder, f"rank-{rank:05d}.pt"), partial(torch.save, saved), args)
    dist.barrier()
    if rank == 0:
        state = replica.optimizer.state.get(replica.params[0], {})
        marker = {"step": step, "script": os.path.basename(sys.argv[0]),
                  "optimizer_steps": state["step"].item() if "step" in state else None,
                  **{name: vars(args)[name] for name in CHECKPOINT_MODEL}, "index": index,
                  "bias": [router.bias.tolist() for router in routers or []]}   # --experts'
        writing = os.path.join(folder, MARKER + ".partial")
        write_file(writing, lambda f: f.write(json.dumps(marker).encode()), args)
        os.replace(writing, os.path.join(folder, MARKER))
        log("[rank 0]", f"checkpoint {folder}: complete")
        kept = [os.path.basename(path) for path in checkpoints(args.checkpoint)[-2:]]
        for name in os.listdir(args.checkpoint):      # the rest older than the newest go,
            if name.startswith("step-") and name < kept[-1] and name not in kept:   # complete
                shutil.rmtree(os.path.join(args.checkpoint, name), ignore_errors=True)   # or not


def write_file(path, write, args):   # write(f), on disk once this returns; a failure: one line
    try:                              # (a write's OSError names no file: not stdout's, but ours)
        with open(path, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as e:   # torch's writer: RuntimeError on a short write
        raise Stop(f"--checkpoint {args.checkpoint}: {path} could not be written "
                   f"({str(e).splitlines()[0][:80]}); the checkpoints before it are as they "
                   f"were; free some space, or choose another folder")


def load_checkpoint(args, replica, tensors=None, boxes=None):
    """--resume: this rank's parameters and AdamW's state, from the pieces of the checkpoint that
    overlap what it holds (read_pieces); then the layers' weights from them (bf16 copies; ZeRO-1, 2:
    the buckets all-gathered). Returns, on rank 0 with --check or --save, the state it resumed from,
    whole (whole_checkpoint): read now, as the checkpoint goes once two are newer."""
    if not args.resume:
        return None
    marker = args.marker
    mine = []
    for held, t, b in holdings(replica, tensors, boxes):   # --ep: the replica, the experts'
        if marker["optimizer_steps"] is not None:     # AdamW's state, filled in below
            for param in held.params:
                held.optimizer.state[param] = {
                    "step": torch.tensor(float(marker["optimizer_steps"])),
                    "exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
        mine += held_pieces(held, t, b)
    copied = read_pieces(marker, mine)
    with torch.no_grad():
        for held, _, _ in holdings(replica):
            held.refresh_weights()
    wanted = sum(piece.end - piece.start for piece in mine)
    if copied != wanted:
        raise Stop(f"--resume {args.resume}: {marker['folder']} holds {copied} of the {wanted} "
                   f"elements rank {dist.get_rank()} needs: a broken checkpoint")
    if dist.get_rank() != 0:
        return None
    log("[rank 0]", f"resumed from {marker['folder']}: step {marker['step']}, written by "
                    f"{marker['script']} on {len(marker['index'])} ranks")
    if args.check or args.save:
        return whole_checkpoint(marker, args)
    return None


def read_pieces(marker, mine):
    """Into my pieces, the checkpoint's that overlap them: only the files that hold some, by
    the marker's index, each mapped (torch.load's mmap): the bytes read are the ones used."""
    copied = 0
    for rank, places in marker["index"].items():
        if not copy_overlaps(mine, [Piece(j, box, start, end) for j, *box, start, end in places]):
            continue
        path = os.path.join(marker["folder"], f"rank-{int(rank):05d}.pt")
        try:
            saved = torch.load(path, mmap=True, weights_only=True)
            theirs = [Piece(j, box, start, end, views) for j, box, start, end, views in saved]
            copied += copy_overlaps(mine, theirs)
        except (OSError, RuntimeError, ValueError) as e:
            raise Stop(f"--resume: {broken(path, e)}") from None
    return copied


def whole_checkpoint(marker, args):
    """The checkpoint's state whole, {name: every tensor}: what --check and --save of a resumed
    run start from, on rank 0 (they hold the whole model there anyway)."""
    shapes = [w.shape for w in tensors_of(init_params(args))]
    state = {name: [torch.zeros(shape) for shape in shapes] for name in CHECKPOINT_STATE}
    if marker["optimizer_steps"] is None:
        state = {"param": state["param"]}
    read_pieces(marker, whole_pieces(state))
    return state


def whole_on_rank0(replica, full, tensors=None, boxes=None, copies=(), grads=False):
    """Rank 0: every tensor of the model whole (full: its tensors, for their shapes), fp32, from
    every rank's pieces, each rank's in one message: the weights (--bf16: the masters), or the
    averaged gradients (grads); else None. --check's and --save's, as a checkpoint's pieces."""
    pieces = rank_pieces(replica, tensors, boxes, copies, grads=grads)
    index = gather_index(pieces, replica.device)
    flat = torch.cat([replica.params[0].new_empty(0), *(p.views["param"] for p in pieces)])
    if dist.get_rank() != 0:
        if pieces:
            dist.send(flat, dst=0)
        return None
    whole = [torch.zeros(w.shape) for w in full]
    wanted = whole_pieces({"param": whole})
    for rank, places in index.items():
        theirs = [Piece(j, box, start, end) for j, *box, start, end in places]
        sizes = [piece.end - piece.start for piece in theirs]
        if not theirs:                # a replica's, or nothing but copies
            continue
        if rank != 0:                 # (rank 0's own come first: flat)
            flat = flat.new_empty(sum(sizes))
            dist.recv(flat, src=rank)
        parts = flat.cpu().split(sizes)
        copy_overlaps(wanted, [piece._replace(views={"param": part})
                               for piece, part in zip(theirs, parts)])
    return whole


def checkpoints(folder):   # the complete checkpoints in folder (step-N, its marker), oldest first
    markers = glob.glob(os.path.join(glob.escape(folder), "step-*", MARKER))
    return sorted(os.path.dirname(marker) for marker in markers)


CHECKPOINT_MODEL = ("num_layers", "dim", "heads", "kv_heads", "ffn_dim", "rope_theta", "qk_norm",
                    "context", "vocab_size", "optimizer", "seed", "experts")


def resume_rules(args, marker):
    """--resume DIR: what its newest complete checkpoint (marker) cannot carry over, refused."""
    if args.resume is None:
        return []
    if marker is None:
        return [(True, f"--resume {args.resume}: no complete checkpoint there (a step-N folder "
                       f"with its {MARKER})")]
    rules = []
    for name in CHECKPOINT_MODEL:
        flag = f"--{name.replace('_', '-')}"
        if name == "vocab_size":
            flag = "the vocabulary's classes"
        saved = marker.get(name, 0)                   # experts: 0 where a marker has none
        rules.append((saved != vars(args)[name], f"{flag} {vars(args)[name]}: the "
                      f"checkpoint in {marker['folder']} has {saved}, and a resumed run "
                      f"keeps its model, optimizer and data"))
    rules.append((args.steps <= marker["step"], f"--steps {args.steps}: the checkpoint in "
                  f"{marker['folder']} is at step {marker['step']} already; ask for more steps"))
    return rules


def newest_checkpoint(folder):   # its marker, and "folder": where it is; None: none
    found = checkpoints(folder)
    if not found:
        return None
    path = os.path.join(found[-1], MARKER)
    try:
        with open(path) as f:
            return {**json.load(f), "folder": found[-1]}
    except (OSError, ValueError, TypeError) as e:   # a disk that filled, an editor: not a marker
        raise ValueError(broken(path, e)) from None


def broken(path, e):   # what a file of a checkpoint that cannot be read says
    return (f"{path} cannot be read ({str(e).splitlines()[0][:80]}): a broken checkpoint; move "
            f"its folder aside to resume from the one before")


# The text: CPython's help, as the pydoc_data package ships it (about 465,000 characters on
# 3.11, English prose). A Python built without it falls back to the collection's own scripts,
# and says so. Characters: printable ASCII and newline; every other character is one class.
VOCAB = "".join(chr(c) for c in range(32, 127)) + "\n"
VOCAB_SIZE = len(VOCAB) + 1                   # 97: the last, any other character
PROMPT = "\nThe "                             # a sample continues it


@functools.lru_cache(maxsize=None)
def read_text():
    """(token ids [N], where they came from): the whole text, encoded."""
    try:
        from pydoc_data.topics import topics
        text = "".join(topics[name] for name in sorted(topics))
        source = "CPython's help (pydoc_data.topics)"
    except ImportError:
        folder = os.path.dirname(os.path.abspath(__file__))
        names = sorted(name for name in os.listdir(folder) if name.endswith(".py"))
        text = "".join(open(os.path.join(folder, name)).read() for name in names)
        source = "the collection's own scripts (no pydoc_data here)"
    return encode(text), source


def encode(text):   # characters -> ids: ' ' .. '~' are 0 .. 94, newline 95, the rest 96
    index = {c: i for i, c in enumerate(VOCAB)}
    return torch.tensor([index.get(c, VOCAB_SIZE - 1) for c in text])


def decode(ids):
    return "".join(VOCAB[i] if i < len(VOCAB) else "?" for i in ids)


def text_part(which):   # "training": the first 90% of the ids; "validation": the rest
    ids, _ = read_text()
    split = len(ids) * 9 // 10
    if which == "validation":
        return ids[split:]
    return ids[:split]


@functools.lru_cache(maxsize=None)
def baselines():
    """The text's entropy in nats a character: uniform ln V; unigram (no context); bigram, of a
    character given the one before (one character of context)."""
    ids, _ = read_text()
    V = VOCAB_SIZE
    unigram = torch.bincount(ids, minlength=V).double()
    unigram = unigram[unigram > 0] / unigram.sum()
    pairs = torch.bincount(ids[:-1] * V + ids[1:], minlength=V * V).double().view(V, V)
    joint = pairs / pairs.sum()
    given = pairs / pairs.sum(dim=1, keepdim=True).clamp_min(1)
    seen = pairs > 0
    return (math.log(V), -(unigram * unigram.log()).sum().item(),
            -(joint[seen] * given[seen].log()).sum().item())


def show_language_model(params, args, rows=256, moe=None):
    """The loss on windows of the validation text, beside the baselines, and a sample that
    continues PROMPT (--sample characters), drawn from --seed, each from the T before it."""
    val_args = argparse.Namespace(**{**vars(args), "batch_size": rows})
    inputs, targets = make_batch(val_args, step=0, text=text_part("validation"))
    T = args.context
    with torch.no_grad():
        loss = serial_loss(params, inputs, targets, args, moe=moe)[0].item()
        context = encode((" " * T + PROMPT)[-T:]).tolist()
        gen = torch.Generator().manual_seed(args.seed)
        for _ in range(args.sample):
            logits = serial_loss(params, torch.tensor([context[-T:]]), torch.zeros(1, T,
                                 dtype=torch.int64), args, moe=moe)[1]
            context.append(torch.multinomial(logits[-1].softmax(dim=0), 1, generator=gen).item())
    uniform, unigram, bigram = baselines()
    print(f"validation loss {loss:.3f} nats a character, on {rows} windows of {T} of "
          f"{read_text()[1]}", flush=True)
    print(f"  the text's own: uniform ln {VOCAB_SIZE} = {uniform:.2f}, unigram {unigram:.2f}, "
          f"bigram {bigram:.2f} (one character of context)", flush=True)
    print("  an MLP of the 8 characters before (Bengio et al. 2003, makemore's): 2.13", flush=True)
    if not args.sample:
        return
    print(f"a sample, {args.sample} characters drawn after the prompt {PROMPT!r}:", flush=True)
    sample = PROMPT.lstrip("\n") + decode(context[T:])
    for line in sample.splitlines():
        for start in range(0, max(len(line), 1), 100):   # at most 100 columns
            print(line[start:start + 100], flush=True)


class SerialCheck:
    """--check: each step against serial autograd's from this run's weights (--bf16: masters). If
    every step equals, the run does, by induction, and a step holds one step's rounding (two
    whole runs drift apart: chaotic training, AdamW's eps). Each figure, and its tolerance:
      gradients  each tensor's difference over its terms (gradient_terms), within 1e-4 (bf16:
                 bf16_tolerance) plus ten times what another summation order moves (bf16's);
      losses     over loss + 2 max |logits|: logits within tol m move the cross-entropy <= 2 tol m;
      weights    the optimizer's step on this run's gradients against its next weights, 2^-20.
    Rank 0 alone computes; step() takes what every rank gathered (None off rank 0)."""

    def __init__(self, args, resumed=None):   # resumed: load_checkpoint's, the whole start
        self.args, self.on = args, args.check and (not dist.is_initialized() or
                                                   dist.get_rank() == 0)
        self.worst = {}        # figure -> (difference / tolerance, difference, tolerance, where)
        self.losses, self.norms = [], []
        self.resumed = resumed
        if self.on:
            self.params = [w.requires_grad_() for w in tensors_of(init_params(args))]
            self.names = param_names(args)
            self.optimizer = make_optimizer(self.params, args.optimizer, args.lr)
            if args.resume:
                self.resume()
            self.expected = [w.detach().clone() for w in self.params]

    def resume(self):   # serial starts from the resumed run's state, AdamW's too
        state = self.resumed
        steps = self.args.marker["optimizer_steps"]
        with torch.no_grad():
            for j, param in enumerate(self.params):
                param.copy_(state["param"][j])
                if steps is not None:
                    self.optimizer.state[param] = {"step": torch.tensor(float(steps)),
                                                   "exp_avg": state["exp_avg"][j],
                                                   "exp_avg_sq": state["exp_avg_sq"][j]}

    def step(self, weights, grads, moe=None):   # moe: serial_loss's, this step's choice
        if not self.on:
            return
        weights, grads = [w.float().cpu() for w in weights], [g.float().cpu() for g in grads]
        self.compare("weights after an update", weights, self.expected,
                     [w.abs().max() for w in self.expected])
        with torch.no_grad():
            for mine, theirs in zip(self.params, weights):
                mine.copy_(theirs)
        batch = make_batch(self.args, self.args.start_step + len(self.losses))
        self.optimizer.zero_grad()
        record = []
        loss, logits = serial_loss(self.params, *batch, self.args, self.args.bf16,
                                   record=record, moe=moe)
        terms = gradient_terms(record, logits, batch[1], self.params)
        loss.backward()
        self.losses.append((loss.item(), logits.abs().max().item()))
        want = [w.grad.clone() for w in self.params]
        scales = [torch.maximum(term, g.abs().max()) for term, g in zip(terms, want)]
        spreads = [torch.zeros(()) for _ in want]   # fp32's other orders: ~1e-7, inside 1e-4
        if self.args.bf16:           # bf16's: the same step, summed in another order
            self.optimizer.zero_grad()
            serial_loss(self.params, *batch, self.args, bf16=True, halves=True,
                        moe=moe)[0].backward()
            spreads = [(w.grad - g).abs().max() / scale.clamp_min(1e-30)
                       for w, g, scale in zip(self.params, want, scales)]
        self.compare("gradients", grads, want, scales, spreads)
        with torch.no_grad():   # the optimizer's step on this run's gradients
            for mine, theirs in zip(self.params, grads):
                mine.grad.copy_(theirs)
        if self.args.clip_grad:   # the norm moves by at most the gradients' differences' norm
            room = sum(g.numel() * ((self.tolerance("gradients", i) + 10 * spread) * scale)**2
                       for i, (g, scale, spread) in enumerate(zip(grads, scales, spreads))).sqrt()
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.args.clip_grad)
            self.norms.append((norm.item(), room.item()))
        self.optimizer.step()
        self.expected = [w.detach().clone() for w in self.params]

    def compare(self, figure, got, want, scales, spreads=None):   # each part: difference / scale
        for part, (a, b, scale) in enumerate(zip(got, want, scales)):
            difference = ((a - b).abs().max() / scale.clamp_min(1e-30)).item()
            tolerance = self.tolerance(figure, part)
            if spreads is not None:
                tolerance += 10 * spreads[part].item()
            self.note(figure, difference, tolerance, f" ({self.names[part]})")

    def note(self, figure, difference, tolerance, where=""):   # the worst: the largest share
        entry = (difference / tolerance, difference, tolerance, where)
        self.worst[figure] = max(self.worst.get(figure, (0.0, 0.0, tolerance, "")), entry,
                                 key=lambda e: (e[0] != e[0], e[0]))           # a nan wins

    def tolerance(self, figure, part=None):
        """fp32: 1e-4 (summation order moves ~1e-7); an update, a few roundings: 2^-20; bf16:
        bf16_tolerance, by the parts above (the loss: every part's forward)."""
        config, L = vars(self.args), self.args.num_layers
        if figure == "weights after an update":
            return 2**-20
        if not self.args.bf16:
            return CHECK_TOLERANCE
        tp_size = config.get("tp") or (config["world_size"] if "tp_style" in config else 1)
        if figure == "losses" or part is None:
            return bf16_tolerance(tp_size, layers_above=L + 1)
        block = (part - 1) // len(block_names(self.args.qk_norm, self.args.experts)) + 1   # 0: E
        return bf16_tolerance(tp_size, layers_above=L + 1 - min(max(block, 0), L + 1))

    def finish(self, final, losses, norms):
        if not self.on:
            return
        self.compare("weights after an update", [w.detach().float().cpu() for w in final],
                     self.expected, [w.abs().max() for w in self.expected])
        tolerance = self.tolerance("losses")
        for step, (ours, (theirs, largest)) in enumerate(zip(losses, self.losses)):
            scale = theirs + 2 * largest
            self.note("losses", abs(ours - theirs) / scale, tolerance, f" (step {step})")
        for step, (ours, (theirs, room)) in enumerate(zip(norms, self.norms)):
            self.note("gradients", abs(ours - theirs) / room, 1.0, f" (the norm, step {step})")
        print(f"check against serial autograd training, each step from this run's weights "
              f"({self.args.optimizer}, {len(losses)} steps):", flush=True)
        for figure in ("gradients", "losses", "weights after an update"):
            share, difference, tolerance, where = self.worst[figure]
            print(f"  {figure:<23} largest difference {difference:.2e}  tolerance {tolerance:.1e}"
                  f"  {'ok' if share <= 1 else 'FAILED'}{where}", flush=True)     # nan: FAILED
        print("  (of each tensor's terms |x|^T |dz|; of the loss + 2 max |logits|; of its largest)",
              flush=True)
        if not all(share <= 1 for share, *_ in self.worst.values()):
            raise Stop("check FAILED: this run differs from serial autograd training (see above)")
        print("check OK", flush=True)


CHECK_TOLERANCE = 1e-4   # float32 summation order moves results by ~1e-7, a bug far more


def bf16_tolerance(tp_size=1, layers_above=0):
    """bf16 rounds to 2^-8 of a value. A dW: the reference rounds it to bf16 where we sum in fp32,
    each in its order: 4 roundings; a tp all-reduce of bf16 sums, tp - 1 more, forward and back;
    each layer above rounds as often again. (A doubled gradient differs by 1: still caught.)"""
    return 2**-8 * (4 + 2 * (tp_size - 1)) * (1 + layers_above)


if __name__ == "__main__":
    run_main(main)
