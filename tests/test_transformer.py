"""The transformer's hand-derived pieces (step 2) against autograd: RMSNorm, grouped-query attention
with its causal mask (lse kept, A made again), RoPE, SwiGLU, QK-norm, a whole block; and the
defects each comparison must catch. FlashAttention's tiles, and the GPU's fused kernels' glue (run
by torch's CPU kernel of the same maths), against the written-out attention."""
import argparse
import math
import types
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import data_parallel as dp
from common import FUSED_ON_CPU


@pytest.fixture(autouse=True)
def float64():   # the maths, not float32's rounding; the suite's other tests keep float32
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def rope_by_pairs(t, positions, head_dim, theta=10000.0):
    """RoPE as RoFormer writes it, t [b, T, n, dh]: (x, y) -> (x cos - y sin, x sin + y cos)."""
    i = torch.arange(head_dim // 2)
    angles = positions[:, None].double() * theta ** (-2 * i / head_dim)          # [T, dh/2]
    x, y = t[..., 0::2], t[..., 1::2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    return torch.stack([x * cos - y * sin, x * sin + y * cos], dim=-1).flatten(-2)


def autograd_block(x, w, head_dim, qk_norm=False, positions=None):
    """A pre-norm Llama block from torch's own layers: rms_norm, RoPE by pairs, SDPA with GQA,
    silu; w in block_names' order."""
    w = dp.BlockWeights(**dict(zip(dp.block_names(qk_norm), w)))
    if positions is None:
        positions = torch.arange(x.shape[1])

    def split(t):
        return t.unflatten(-1, (-1, head_dim))               # [b, T, n, dh]
    n = F.rms_norm(x, w.norm1.shape, w.norm1, dp.EPS)
    q, k, v = split(n @ w.wq), split(n @ w.wk), split(n @ w.wv)
    if qk_norm:
        q = F.rms_norm(q, w.norm_q.shape, w.norm_q, dp.EPS)
        k = F.rms_norm(k, w.norm_k.shape, w.norm_k, dp.EPS)
    q, k = rope_by_pairs(q, positions, head_dim), rope_by_pairs(k, positions, head_dim)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=True, enable_gqa=True)
    x = x + o.transpose(1, 2).flatten(-2) @ w.wo
    n = F.rms_norm(x, w.norm2.shape, w.norm2, dp.EPS)
    return x + (F.silu(n @ w.w1) * (n @ w.w3)) @ w.w2


def random_block(D=8, heads=4, kv_heads=2, ffn=12, qk_norm=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    head_dim = D // heads
    shapes = {"norm1": (D,), "wq": (D, D), "wk": (D, kv_heads * head_dim),
              "wv": (D, kv_heads * head_dim), "norm_q": (head_dim,), "norm_k": (head_dim,),
              "wo": (D, D), "norm2": (D,), "w1": (D, ffn), "w3": (D, ffn), "w2": (ffn, D)}
    return [torch.randn(*shapes[name], generator=gen) / math.sqrt(shapes[name][0]) +
            (len(shapes[name]) == 1) for name in dp.block_names(qk_norm)]


def rope(T, head_dim):   # the block's table at places 0 .. T-1
    return dp.rope_table(torch.arange(T), head_dim, 10000.0)


def weight_grads(terms):   # each (x, dz) as its dW = x^T dz, a gain's ready
    return [dz if x is None else x.flatten(0, -2).T @ dz.flatten(0, -2) for x, dz in terms]


def rmsnorm_backward_without_r3(dy, x, r, g):   # the defect: dx = r g dy alone
    return (r * g * dy), (dy * x * r).flatten(0, -2).sum(0)


@pytest.mark.parametrize("backward,agrees", [(dp.rmsnorm_backward, True),
                                             (rmsnorm_backward_without_r3, False)])
def test_rmsnorm_backward_is_autograds_and_needs_its_r_cubed_term(backward, agrees):
    x = torch.randn(3, 5, 8, requires_grad=True)
    g = torch.randn(8, requires_grad=True)
    dy = torch.randn(3, 5, 8)
    y, r = dp.rmsnorm(x.detach(), g.detach())
    F.rms_norm(x, (8,), g, dp.EPS).backward(dy)
    torch.testing.assert_close(y, F.rms_norm(x, (8,), g, dp.EPS).detach())
    dx, dg = backward(dy, x.detach(), r, g.detach())
    torch.testing.assert_close(dg, g.grad)
    assert torch.allclose(dx, x.grad) == agrees


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_gpus_fused_rmsnorm_op_is_the_written_out_norm(dtype):
    """What rmsnorm calls off the CPU, aten's _fused_rms_norm, run on the CPU (its decomposition;
    a CUDA build has the one kernel): y and r equal the written-out ones. Its backward has no CPU
    kernel to run here: the GPU's --check (make gpu-check) holds it to autograd's."""
    x = torch.randn(3, 5, 64, dtype=torch.float64).mul(3).to(dtype)
    g = torch.randn(64, dtype=torch.float64).to(dtype)
    y, r = dp.rmsnorm(x, g)
    fused_y, fused_r = torch.ops.aten._fused_rms_norm(x, [64], g, dp.EPS)
    assert fused_y.dtype == y.dtype and fused_r.dtype == r.dtype and fused_r.shape == r.shape
    torch.testing.assert_close(fused_r, r, rtol=1e-6 if dtype != torch.float64 else 1e-13, atol=0)
    torch.testing.assert_close(fused_y, y, rtol=2**-8 if dtype == torch.bfloat16 else 1e-6,
                               atol=0)


def rotated_forward_again(x, rope, head_dim, back=False):   # the defect: back turns by +angle
    return dp.rotate(x, rope, head_dim)


@pytest.mark.parametrize("rotate,agrees", [(dp.rotate, True), (rotated_forward_again, False)])
def test_rope_turns_each_pair_by_its_angle_and_back_by_minus_it(rotate, agrees):
    """rotate() equals RoFormer's pairs at every place (--cp's places too: any positions), and its
    backward, the turn by -angle (R^T), is autograd's."""
    b, T, n, head_dim = 2, 7, 3, 8
    positions = torch.tensor([0, 3, 4, 7, 9, 12, 15])
    x = torch.randn(b, T, n * head_dim, requires_grad=True)
    dy = torch.randn(b, T, n * head_dim)
    turn = dp.rope_table(positions, head_dim, 500000.0)
    want = rope_by_pairs(x.unflatten(-1, (n, head_dim)), positions, head_dim, 500000.0).flatten(-2)
    torch.testing.assert_close(dp.rotate(x.detach(), turn, head_dim), want.detach())
    want.backward(dy)
    assert torch.allclose(rotate(dy, turn, head_dim, back=True), x.grad) == agrees


def test_swiglu_backward_is_autograds():
    """y = (silu(n W1) * n W3) W2: dup = du silu(a), da = du up silu'(a) with silu'(a) =
    s (1 + a (1 - s)), against autograd's, for n and each of the three weights."""
    n = torch.randn(3, 5, 8, requires_grad=True)
    w1, w3, w2 = (torch.randn(*shape, requires_grad=True) for shape in ((8, 12), (8, 12), (12, 8)))
    dy = torch.randn(3, 5, 8)
    y, stash = dp.swiglu(n.detach(), w1.detach(), w3.detach(), w2.detach(), dp.Whole)
    want = (F.silu(n @ w1) * (n @ w3)) @ w2
    torch.testing.assert_close(y, want.detach())
    want.backward(dy)
    dn, terms = dp.swiglu_backward(dy, stash, w1.detach(), w3.detach(), w2.detach(), dp.Whole)
    torch.testing.assert_close(dn, n.grad)
    for got, w in zip(weight_grads(terms), (w1, w3, w2)):
        torch.testing.assert_close(got, w.grad)


def test_qk_norms_gain_gradient_is_summed_over_the_heads():
    """Each head of q normed over its dh with one gain [dh]: the gain's gradient sums over every
    position and every head (each head alone would be 1/h of it)."""
    heads, head_dim = 4, 6
    q = torch.randn(2, 5, heads * head_dim, requires_grad=True)
    g = torch.randn(head_dim, requires_grad=True)
    dy = torch.randn(2, 5, heads * head_dim)
    normed, r = dp.head_norm(q.detach(), g.detach(), head_dim)
    want = F.rms_norm(q.unflatten(-1, (heads, head_dim)), (head_dim,), g, dp.EPS).flatten(-2)
    torch.testing.assert_close(normed, want.detach())
    want.backward(dy)
    dq, dg = dp.head_norm_backward(dy, q.detach(), r, g.detach(), head_dim)
    torch.testing.assert_close(dq, q.grad)
    torch.testing.assert_close(dg, g.grad)


def attention_backward_without_scale(do, q, k, v, o, lse, head_dim):   # no 1/sqrt(dh)
    dq, dk, dv = dp.attention_backward(do, q, k, v, o, lse, head_dim)
    return dq * math.sqrt(head_dim), dk * math.sqrt(head_dim), dv


def attention_backward_without_mask(do, q, k, v, o, lse, head_dim):
    """The defect: the mask in the forward but not the backward (A made again, unmasked)."""
    real = dp.attend_backward

    def unmasked(do, q, k, v, o, lse, head_dim, causal=True):
        return real(do, q, k, v, o, lse, head_dim, causal=False)
    with mock.patch.object(dp, "attend_backward", unmasked):
        return dp.attention_backward(do, q, k, v, o, lse, head_dim)


def attention_backward_without_delta(do, q, k, v, o, lse, head_dim):
    """The defect: dS = A * dA, the softmax's rowsum(dA * A) = rowsum(do * o) left out."""
    real = dp.attend_backward

    def without(do, q, k, v, o, lse, head_dim, causal=True):
        return real(do, q, k, v, torch.zeros_like(do), lse, head_dim, causal)
    with mock.patch.object(dp, "attend_backward", without):
        return dp.attention_backward(do, q, k, v, o, lse, head_dim)


def attention_backward_one_query_head(do, q, k, v, o, lse, head_dim):
    """The defect: a kv head's dk and dv from the first query head of its group alone."""
    real = dp.attend_backward

    def first_only(do, q, k, v, o, lse, head_dim, causal=True):
        dq, _, _ = real(do, q, k, v, o, lse, head_dim, causal)
        _, dk, dv = real(do[:, :, :1], q[:, :, :1], k, v, o[:, :, :1], lse[:, :, :1], head_dim,
                         causal)
        return dq, dk, dv
    with mock.patch.object(dp, "attend_backward", first_only):
        return dp.attention_backward(do, q, k, v, o, lse, head_dim)


BACKWARDS = [(dp.attention_backward, True), (attention_backward_without_scale, False),
             (attention_backward_without_mask, False), (attention_backward_without_delta, False),
             (attention_backward_one_query_head, False)]
HEADS = [(1, 1), (4, 4), (4, 2), (4, 1)]


@pytest.mark.parametrize("backward,agrees,heads,kv_heads", [
    (backward, agrees, heads, kv_heads) for backward, agrees in BACKWARDS for heads, kv_heads in HEADS
    if backward is not attention_backward_one_query_head or heads > kv_heads])   # (a group of one
def test_attention_backward_is_autograds_for_every_head(backward, agrees, heads, kv_heads):   # is it)
    """o and lse = log rowsum exp(S) from the forward, each query head j reading kv head j //
    (h/G); the backward, from q, k, v, o and lse alone (A made again), equals autograd's dq, dk,
    dv (SDPA's enable_gqa): a kv head's dk, dv the sum over its group."""
    b, T, head_dim = 2, 6, 3
    q = torch.randn(b, T, heads * head_dim, requires_grad=True)
    k, v = (torch.randn(b, T, kv_heads * head_dim, requires_grad=True) for _ in range(2))
    do = torch.randn(b, T, heads * head_dim)
    o, lse = dp.attention(q.detach(), k.detach(), v.detach(), head_dim)
    split = [t.unflatten(-1, (-1, head_dim)).transpose(1, 2) for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*split, is_causal=True, enable_gqa=True)
    want = want.transpose(1, 2).flatten(-2)
    torch.testing.assert_close(o, want.detach())
    keys = split[1].repeat_interleave(heads // kv_heads, dim=1)
    s = split[0] @ keys.transpose(-1, -2) / math.sqrt(head_dim)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)          # row i sees keys 0 .. i
    torch.testing.assert_close(lse, s.masked_fill(future, -math.inf).logsumexp(-1).detach())
    assert lse.shape == (b, heads, T)
    want.backward(do)
    got = backward(do, q.detach(), k.detach(), v.detach(), o, lse, head_dim)
    matches = [torch.allclose(mine, t.grad) for mine, t in zip(got, (q, k, v))]
    assert all(matches) == agrees, matches


def tiled_attention(q, k, v, head_dim, tile):
    """FlashAttention's forward as its kernel runs it, for one head's rows of queries at a time:
    keys in tiles of `tile`, a tile wholly in the queries' future skipped; each row keeps its
    running max m, its sum l of exp(S - m) and its output acc, scaled by exp(m_old - m_new) as a
    larger max arrives; at the end o = acc / l and lse = m + log l. No [T, T] is ever whole."""
    q, k, v = (dp.heads(t, head_dim) for t in (q, k, v))           # [b, h, T, dh]
    T = q.shape[2]
    outs = []
    lses = []
    for first in range(0, T, tile):                               # a tile of queries
        rows = torch.arange(first, min(first + tile, T))
        m = torch.full((*q.shape[:2], len(rows), 1), -math.inf)
        l = torch.zeros_like(m)
        acc = torch.zeros(*q.shape[:2], len(rows), head_dim)
        for start in range(0, rows[-1].item() + 1, tile):        # keys up to the last query's
            cols = torch.arange(start, min(start + tile, T))
            s = q[:, :, rows] @ k[:, :, cols].transpose(-1, -2) / math.sqrt(head_dim)
            s = s.masked_fill(cols[None, :] > rows[:, None], -math.inf)   # by global position
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))   # never -inf: key 0 <= row
            p = (s - m_new).exp()                                 # [b, h, rows, cols], <= 1
            shrink = (m - m_new).exp()                            # the old terms, rescaled
            l = l * shrink + p.sum(-1, keepdim=True)
            acc = acc * shrink + p @ v[:, :, cols]
            m = m_new
        outs.append(acc / l)
        lses.append((m + l.log()).squeeze(-1))
    return torch.cat(outs, 2).transpose(1, 2).flatten(-2), torch.cat(lses, 2)


@pytest.mark.parametrize("tile", [1, 2, 4, 7])
def test_flash_attentions_tiles_merged_by_running_max_and_sum_are_the_written_out_attention(tile):
    b, T, heads, head_dim = 2, 7, 3, 4
    q, k, v = (torch.randn(b, T, heads * head_dim) * 3 for _ in range(3))
    o, lse = dp.attention(q, k, v, head_dim)
    tiled_o, tiled_lse = tiled_attention(q, k, v, head_dim, tile)
    torch.testing.assert_close(tiled_o, o)
    torch.testing.assert_close(tiled_lse, lse)


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])   # flash's glue; efficient's
def test_the_fused_kernels_glue_gives_the_written_out_attention_and_its_backward(dtype, kv_heads):
    """attention() and its backward as a GPU runs them (fused_attention() and its backward), with
    torch's CPU kernel in place of each CUDA one (called as its schema names its arguments): o,
    lse, dq, dk, dv equal the written-out lines' (float64: flash's call, its kv heads as they are;
    float32: the memory-efficient kernel's, each kv head repeated for its group)."""
    b, T, heads, head_dim = 2, 9, 4, 8
    q, do = (torch.randn(b, T, heads * head_dim, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(b, T, kv_heads * head_dim, dtype=dtype) for _ in range(2))
    o, lse = dp.attention(q, k, v, head_dim)
    want = dp.attention_backward(do, q, k, v, o, lse, head_dim)
    real = torch.ops
    with mock.patch.object(dp.torch, "ops", types.SimpleNamespace(aten=FUSED_ON_CPU)):
        fused_o, fused_lse = dp.fused_attention(q, k, v, head_dim)
        got = dp.fused_attention_backward(do, q, k, v, fused_o, fused_lse, head_dim)
    assert dp.torch.ops is real
    tolerance = {} if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_o, o, **tolerance)
    torch.testing.assert_close(fused_lse, lse, **tolerance)
    for mine, theirs in zip(got, want):
        torch.testing.assert_close(mine, theirs, **tolerance)


def test_a_later_position_never_changes_an_earlier_ones_output():
    q, k, v = (torch.randn(1, 5, 8) for _ in range(3))
    o, _ = dp.attention(q, k, v, 4)
    k[:, -1] += 10.0
    v[:, -1] += 10.0
    o2, _ = dp.attention(q, k, v, 4)
    torch.testing.assert_close(o[:, :-1], o2[:, :-1])
    assert not torch.allclose(o[:, -1], o2[:, -1])


def block_backward_without_the_skip(dout, stash, w, need_dx=True, **shape):
    """The defect: the residual's gradient not summed (dx the branch's alone)."""
    dx, terms = dp.block_backward(dout, stash, w, **shape)
    return dx - dout, terms


@pytest.mark.parametrize("backward,agrees", [(dp.block_backward, True),
                                             (block_backward_without_the_skip, False)])
@pytest.mark.parametrize("kv_heads,qk_norm,recompute", [(2, False, False), (1, True, False),
                                                        (4, False, True), (2, True, True)])
def test_a_whole_block_is_autograds_every_weight_and_its_input(backward, agrees, kv_heads, qk_norm,
                                                               recompute):
    D, heads, head_dim, T = 8, 4, 2, 5
    w = [t.requires_grad_() for t in random_block(D, heads, kv_heads, qk_norm=qk_norm)]
    x = torch.randn(2, T, D, requires_grad=True)
    dout = torch.randn(2, T, D)
    shape = dict(head_dim=head_dim, rope=rope(T, head_dim), qk_norm=qk_norm)
    out, stash = dp.block_forward(x.detach(), [t.detach() for t in w], recompute=recompute,
                                  **shape)
    want = autograd_block(x, w, head_dim, qk_norm)
    torch.testing.assert_close(out, want.detach())
    want.backward(dout)
    dx, terms = backward(dout, stash, [t.detach() for t in w], **shape)
    for got, t in zip(weight_grads(terms), w):
        torch.testing.assert_close(got, t.grad)
    assert torch.allclose(dx, x.grad) == agrees


@pytest.mark.parametrize("experts,qk_norm", [(0, False), (0, True), (3, False)])
def test_the_model_is_torchs_layers_from_embedding_to_loss(experts, qk_norm):
    """Step 2's parts end to end (dp_step's order, by hand) against serial_loss under autograd:
    the loss and every tensor's gradient (experts: at the choice the parts made)."""
    args = argparse.Namespace(dim=8, heads=2, kv_heads=1, ffn_dim=12, rope_theta=10000.0,
                              qk_norm=qk_norm, context=5, vocab_size=11, num_layers=2, seed=3,
                              experts=experts)
    parts = dp.init_params(args)
    params = [w.double().requires_grad_() for w in dp.tensors_of(parts)]
    tokens = torch.randint(11, (3, 5))
    targets = torch.randint(11, (3, 5))
    routers = [dp.Router(experts, 2) for _ in range(2)] if experts else None
    blocks = dp.model_blocks(args, routers)
    weights = [[w.detach() for w in params[span.start:span.stop]] for span in dp.spans_of(parts)]
    a = tokens
    stashes = []
    for block, w in zip(blocks, weights):
        a, stash = block.forward(a, w)
        stashes.append(stash)
    moe = None
    if experts:
        routes = torch.stack([router.routes[0].view(3, 5, 2) for router in routers])
        moe = (2, torch.zeros(2, experts), routes)
    loss, _ = dp.serial_loss(params, tokens, targets, args, moe=moe)
    loss.backward()
    mine, g = dp.cross_entropy(a, targets, 15)
    torch.testing.assert_close(mine, loss.detach())
    grads = []
    for block, w in reversed(list(zip(blocks, weights))):
        g, terms = block.backward(g, stashes.pop(), w)
        part = []
        for (x, dz), weight in zip(terms, w):
            if x is not None and not x.is_floating_point():   # rows added at the ids
                part.append(torch.zeros_like(weight).index_add_(0, x.reshape(-1),
                                                                dz.flatten(0, -2)))
            else:
                part.append(weight_grads([(x, dz)])[0])
        grads = part + grads
    for got, param in zip(grads, params):
        torch.testing.assert_close(got, param.grad)
