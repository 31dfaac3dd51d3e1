"""The transformer's hand-derived pieces (step 2) against autograd: RMSNorm, attention with its
causal mask and every head (lse kept, A made again), a whole block; and the defects each
comparison must catch. FlashAttention's tiles, and the GPU's fused kernels' glue (run by torch's
CPU kernel of the same maths), against the written-out attention."""
import functools
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


def autograd_block(x, w, head_dim):
    """A pre-norm block from torch's own layers: rms_norm, scaled_dot_product_attention, gelu."""
    g1, wq, wk, wv, wo, g2, w1, w2 = w

    def split(t):
        return t.unflatten(-1, (-1, head_dim)).transpose(1, 2)
    n = F.rms_norm(x, g1.shape, g1, dp.EPS)
    o = F.scaled_dot_product_attention(split(n @ wq), split(n @ wk), split(n @ wv), is_causal=True)
    x = x + o.transpose(1, 2).flatten(-2) @ wo
    return x + F.gelu(F.rms_norm(x, g2.shape, g2, dp.EPS) @ w1) @ w2


def random_block(D=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(D,), (D, D), (D, D), (D, D), (D, D), (D,), (D, 4 * D), (4 * D, D)]
    return [torch.randn(*shape, generator=gen) / math.sqrt(shape[0]) + (len(shape) == 1)
            for shape in shapes]


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


def attention_backward_without_scale(do, q, k, v, o, lse, head_dim):   # no 1/sqrt(dh)
    dq, dk, dv = dp.attention_backward(do, q, k, v, o, lse, head_dim)
    return dq * math.sqrt(head_dim), dk * math.sqrt(head_dim), dv


def unmasked_scores(q, k, head_dim):
    return q @ k.transpose(-1, -2) / math.sqrt(head_dim)


def attention_backward_without_mask(do, q, k, v, o, lse, head_dim):
    """The defect: the mask in the forward but not the backward (A made again, unmasked)."""
    with mock.patch.object(dp, "scores", unmasked_scores):
        return dp.attention_backward(do, q, k, v, o, lse, head_dim)


def attention_backward_without_d(do, q, k, v, o, lse, head_dim):
    """The defect: dS = A * dA, the softmax's rowsum(dA * A) = rowsum(do * o) left out."""
    do, q, k, v = (dp.heads(t, head_dim) for t in (do, q, k, v))
    a = dp.scores(q, k, head_dim).sub_(lse[..., None]).exp_()
    ds = a * (do @ v.transpose(-1, -2))
    dq = ds @ k / math.sqrt(head_dim)
    dk = ds.transpose(-1, -2) @ q / math.sqrt(head_dim)
    return [t.transpose(1, 2).flatten(-2) for t in (dq, dk, a.transpose(-1, -2) @ do)]


@pytest.mark.parametrize("backward,agrees", [(dp.attention_backward, True),
                                             (attention_backward_without_scale, False),
                                             (attention_backward_without_mask, False),
                                             (attention_backward_without_d, False)])
@pytest.mark.parametrize("heads", [1, 4])
def test_attention_backward_is_autograds_for_every_head(backward, agrees, heads):
    """o and lse = log rowsum exp(S) from the forward; the backward, from q, k, v, o and lse
    alone (A made again), equals autograd's dq, dk, dv."""
    b, T, head_dim = 2, 6, 3
    q, k, v = (torch.randn(b, T, heads * head_dim, requires_grad=True) for _ in range(3))
    do = torch.randn(b, T, heads * head_dim)
    o, lse = dp.attention(q.detach(), k.detach(), v.detach(), head_dim)
    split = [t.unflatten(-1, (heads, head_dim)).transpose(1, 2) for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*split, is_causal=True).transpose(1, 2).flatten(-2)
    torch.testing.assert_close(o, want.detach())
    s = split[0] @ split[1].transpose(-1, -2) / math.sqrt(head_dim)
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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])   # flash's glue; efficient's
def test_the_fused_kernels_glue_gives_the_written_out_attention_and_its_backward(dtype):
    """attention() and its backward as a GPU runs them (fused_attention() and its backward), with
    torch's CPU kernel in place of each CUDA one (called as its schema names its arguments): o,
    lse, dq, dk, dv equal the written-out lines' (float64: flash's call; float32: the
    memory-efficient kernel's)."""
    b, T, heads, head_dim = 2, 9, 2, 8
    q, k, v, do = (torch.randn(b, T, heads * head_dim, dtype=dtype) for _ in range(4))
    o, lse = dp.attention(q, k, v, head_dim)
    want = dp.attention_backward(do, q, k, v, o, lse, head_dim)
    real = torch.ops
    with mock.patch.object(dp.torch, "ops", types.SimpleNamespace(aten=FUSED_ON_CPU)), \
            mock.patch.object(dp, "fused", lambda q, head_dim: True):
        fused_o, fused_lse = dp.attention(q, k, v, head_dim)
        got = dp.attention_backward(do, q, k, v, fused_o, fused_lse, head_dim)
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


def block_backward_without_the_skip(dout, stash, w, need_dx=True, head_dim=None):
    """The defect: the residual's gradient not summed (dx the branch's alone)."""
    dx, terms = dp.block_backward(dout, stash, w, head_dim=head_dim)
    return dx - dout, terms


@pytest.mark.parametrize("backward,agrees", [(dp.block_backward, True),
                                             (block_backward_without_the_skip, False)])
@pytest.mark.parametrize("recompute", [False, True])
def test_a_whole_block_is_autograds_every_weight_and_its_input(backward, agrees, recompute):
    D, head_dim = 8, 2
    w = [t.requires_grad_() for t in random_block(D)]
    x = torch.randn(2, 5, D, requires_grad=True)
    dout = torch.randn(2, 5, D)
    out, stash = dp.block_forward(x.detach(), [t.detach() for t in w], recompute=recompute,
                                  head_dim=head_dim)
    want = autograd_block(x, w, head_dim)
    torch.testing.assert_close(out, want.detach())
    want.backward(dout)
    dx, terms = backward(dout, stash, [t.detach() for t in w], head_dim=head_dim)
    for got, t in zip(weight_grads(terms), w):
        torch.testing.assert_close(got, t.grad)
    assert torch.allclose(dx, x.grad) == agrees


def test_the_model_is_torchs_layers_from_embedding_to_loss():
    """Step 2's parts end to end (dp_step's order, by hand) against serial_loss under autograd:
    the loss and every tensor's gradient."""
    import argparse
    args = argparse.Namespace(dim=8, heads=2, context=5, vocab_size=11, num_layers=2, seed=3,
                              experts=0)
    parts = dp.init_params(args)
    params = [w.double().requires_grad_() for w in dp.tensors_of(parts)]
    tokens = torch.randint(11, (3, 5))
    targets = torch.randint(11, (3, 5))
    loss, _ = dp.serial_loss(params, tokens, targets, head_dim=4)
    loss.backward()
    blocks = dp.model_blocks(2, head_dim=4)
    weights = [[w.detach() for w in params[span.start:span.stop]] for span in dp.spans_of(parts)]
    a = tokens
    stashes = []
    for block, w in zip(blocks, weights):
        a, stash = block.forward(a, w)
        stashes.append(stash)
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
