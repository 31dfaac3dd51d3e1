"""Tests for data_parallel.py: every number is compared with a single-process reference.

- The hand-derived blocks (gelu', layer, embedding, head, cross-entropy) against autograd.
- init_params, the text and make_batch against what they are defined by.
- serial_train against an independent torch.nn reference.
- Data-parallel training (in-process main(), ranks forked) against serial_train, over
  world sizes, micro-batches, optimizers and --overlap.
- --check passes on a correct run and fails on a broken one; bad flags exit 2.
"""
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import data_parallel as dp
import pipeline_parallel
from collectives import RankFailed
from stash_check import stash_and_peak
from common import (NO_SAMPLE, serial_train, assert_follows_the_contract, ATOL, RTOL, assert_check_passed, assert_clipped_some, assert_same_bits, check_report, clip_between,
                    final_params, init_of)

REPO = Path(__file__).resolve().parent.parent

# A small model that trains quickly and stays far from chaos: lr 0.1, few layers.
SMALL = {"num_layers": 4, "dim": 16, "heads": 4, "context": 4, "steps": 4, "lr": 0.1, "seed": 3}
V = dp.VOCAB_SIZE

SHAPES = [(1, 1, 1), (3, 5, 7), (8, 16, 16), (4, 64, 32)]   # (batch, D_in, D_out)


def silu_grad(a):   # silu'(a) = s (1 + a (1 - s)), s = sigmoid(a): the formula step 2 writes
    s = torch.sigmoid(a)
    return s * (1 + a * (1 - s))


def _silu_points():
    """The grid the silu tests use: dense near 0 plus large |a| on both sides."""
    return torch.cat([torch.linspace(-8, 8, 2001),
                      torch.tensor([-1e4, -300.0, -50.0, -20.0, -10.0, 10.0, 20.0, 50.0, 300.0, 1e4])])


# ----------------------------------------------------------------------------------
# 1. The hand-derived blocks against autograd
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_silu_grad_is_autograds_and_the_fused_kernel_the_step_runs(dtype):
    """SwiGLU's silu'(a) = s (1 + a (1 - s)), written out, is autograd's derivative of F.silu, on
    both tails and at zero; and step 2's silu_backward(g, a), torch's one-pass kernel, is g times
    it (the defect it must not be: sigmoid(a) alone, silu's derivative taken as s)."""
    a = _silu_points().to(dtype)
    g = torch.randn(a.shape, generator=torch.Generator().manual_seed(0), dtype=dtype)
    leaf = a.clone().requires_grad_()
    F.silu(leaf).sum().backward()
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(silu_grad(a), leaf.grad, **tol)
    torch.testing.assert_close(dp.silu_backward(g, a), g * silu_grad(a), **tol)
    assert (g * torch.sigmoid(a) - dp.silu_backward(g, a)).abs().max() > 0.1


@pytest.mark.parametrize("rows,classes", [(1, 2), (5, 7), (16, 97)])
@pytest.mark.parametrize("scale", [1.0, 40.0])   # 40: logits far apart, probabilities near 0 and 1
def test_cross_entropy_matches_autograd(rows, classes, scale):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(rows, classes, generator=gen, dtype=torch.float64) * scale
    y = torch.randint(classes, (rows,), generator=gen)
    loss, dlogits = dp.cross_entropy(logits, y, rows)
    ref_logits = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits, y)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(dlogits, ref_logits.grad, atol=1e-12, rtol=1e-10)
    assert dlogits.dtype == logits.dtype     # the logits' dtype back, for the head's backward
    batched, _ = dp.cross_entropy(logits, y.view(1, rows), rows)   # targets [b, T]: flattened
    assert batched == loss


def test_cross_entropy_in_bf16_computes_in_fp32():
    """bf16 logits: the softmax in fp32 (its probabilities rounded to 8 bits would move the loss),
    dlogits handed back in bf16."""
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(8, 97, generator=gen) * 4).bfloat16()
    y = torch.randint(97, (8,), generator=gen)
    loss, dlogits = dp.cross_entropy(logits, y, 8)
    assert loss.dtype == torch.float32 and dlogits.dtype == torch.bfloat16
    ref = F.cross_entropy(logits.float(), y)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)


@pytest.mark.parametrize("sizes", [[1, 2, 5], [4, 4], [8], [1] * 8])
def test_cross_entropy_pieces_sum_to_whole_batch_mean(sizes):
    """Pieces of a batch, each divided by the whole batch's rows, sum to the mean."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(sum(sizes), 12, generator=gen)
    y = torch.randint(12, (sum(sizes),), generator=gen)
    n = len(y)
    pieces = [dp.cross_entropy(lp, yp, n) for lp, yp in zip(logits.split(sizes), y.split(sizes))]
    ref_logits = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits, y)
    ref.backward()
    torch.testing.assert_close(sum(p[0] for p in pieces), ref.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(torch.cat([p[1] for p in pieces]), ref_logits.grad, atol=1e-7, rtol=1e-6)
    if len(sizes) > 1:   # dividing each piece by its own size would be wrong
        own = sum(dp.cross_entropy(lp, yp, len(yp))[0] for lp, yp in zip(logits.split(sizes), y.split(sizes)))
        assert abs(own.item() - ref.item()) > 1e-3


@pytest.mark.parametrize("rows,context,width", [(1, 1, 3), (6, 4, 5), (32, 8, 8)])
def test_embedding_forward_and_backward_match_autograd(rows, context, width):
    """x = E[tokens], and dE summed from g by the replica's index_add_ (a repeated token adds
    up): against nn.Embedding. (Positions are RoPE's, in the blocks: no P.)"""
    gen = torch.Generator().manual_seed(3)
    table = torch.randn(V, width, generator=gen, dtype=torch.float64)
    tokens = torch.randint(V, (rows, context), generator=gen)
    tokens[0, :] = 7                                        # one token many times over
    x, stash = dp.embedding_forward(tokens, [table])
    g = torch.randn(rows, context, width, generator=gen, dtype=torch.float64)
    dx, [(ids, dz)] = dp.embedding_backward(g, stash, [table])
    d_table = torch.zeros_like(table).index_add_(0, ids.reshape(-1), dz.flatten(0, 1))
    ref = nn.Embedding.from_pretrained(table.clone(), freeze=False)
    out = ref(tokens)
    out.backward(g)
    assert dx is None and x.shape == (rows, context, width)
    torch.testing.assert_close(x, out.detach())
    torch.testing.assert_close(d_table, ref.weight.grad, atol=1e-12, rtol=1e-10)
    unused = sorted(set(range(V)) - set(tokens.reshape(-1).tolist()))
    assert (d_table[unused] == 0).all()                     # rows nobody used get no gradient


@pytest.mark.parametrize("rows,dim,classes", [(1, 4, 2), (8, 16, 97)])
def test_head_forward_and_backward_match_autograd(rows, dim, classes):
    """logits = rmsnorm(x; g) H at every position, and dx, dg and dH = n^T dlogits."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(rows, 3, dim, generator=gen, dtype=torch.float64)
    gain = torch.randn(dim, generator=gen, dtype=torch.float64)
    h = torch.randn(dim, classes, generator=gen, dtype=torch.float64)
    g = torch.randn(rows * 3, classes, generator=gen, dtype=torch.float64)
    logits, stash = dp.head_forward(x, [gain, h])
    dx, [(_, dgain), (n, dlogits)] = dp.head_backward(g, stash, [gain, h])
    xr, gr, hr = (t.clone().requires_grad_() for t in (x, gain, h))
    want = (F.rms_norm(xr, (dim,), gr, dp.EPS) @ hr).flatten(0, 1)
    want.backward(g)
    torch.testing.assert_close(logits, want.detach())
    torch.testing.assert_close(dx, xr.grad)
    torch.testing.assert_close(dgain, gr.grad)
    torch.testing.assert_close(n.flatten(0, 1).T @ dlogits, hr.grad)   # dH = n^T dlogits


def test_the_replica_sums_the_embeddings_gradient_with_index_add(tmp_path):
    """add_grads with token ids for x: dE = onehot(tokens)^T g, each micro-batch's added into a
    bucket that begin_step zeroed (it held the step before's); the one-hot matmul gives the same."""
    gen = torch.Generator().manual_seed(5)
    table = torch.randn(V, 4, generator=gen)
    tokens = torch.randint(V, (6, 2), generator=gen)
    g = torch.randn(6, 2, 4, generator=gen)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        replica = dp.DataParallel([[table.clone()]], None, optimizer="sgd")
        replica.grad_buckets[0] = torch.full((table.numel(),), 123.0)   # the step before's
        replica.begin_step()
        for _ in range(2):
            replica.add_grads(0, dp.embedding_backward(g, (tokens,), [table])[1])
    finally:
        dist.destroy_process_group()
    onehot = F.one_hot(tokens.reshape(-1), V).float()       # [b T, V]
    torch.testing.assert_close(replica.grads()[0], 2 * onehot.T @ g.flatten(0, 1), atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------------
# 2. init_params, the text and make_batch
# ----------------------------------------------------------------------------------

def test_a_pass_asked_for_no_notes_lets_each_blocks_activations_go():
    """serial_loss with no record (the end-of-run validation, the sample) holds one block's
    activations at a time: its peak, counted on the meta device, is the same at 8 blocks as
    at 1. (Noting them anyway once took the validation to 10 GB at L 16, D 256, T 128.)"""
    from gpu_path import StepRecord
    peaks = []
    for num_layers in (1, 8):
        args = _args(num_layers=num_layers, dim=64, context=32, heads=4)
        params = [w.to("meta") for w in dp.tensors_of(dp.init_params(args))]
        tokens = torch.zeros(64, 32, dtype=torch.int64, device="meta")
        with torch.no_grad(), StepRecord() as record:
            dp.serial_loss(params, tokens, tokens, args)
        peaks.append(record.peak)
    assert peaks[1] == peaks[0] > 0


def test_init_params_is_one_generator_in_order():
    """E [V, D], each block's gains (1) and matrices, the final gain and H [D, V], drawn in that
    order from one generator: randn over sqrt(D), but Wo's over sqrt(2 L D) and W2's over
    sqrt(2 L F), each residual branch's last; --qk-norm's gains 1, --kv-heads' Wk, Wv G dh wide."""
    args = _args(num_layers=3, dim=24, heads=4, kv_heads=2, ffn_dim=48, context=3, seed=7,
                 qk_norm=True)
    L, D, F, dh = 3, 24, 48, 6
    parts = dp.init_params(args)
    gen = torch.Generator().manual_seed(7)   # the reference: one generator, drawn in order

    def matrix(rows, cols, fan=D):
        return torch.randn(rows, cols, generator=gen) / math.sqrt(fan)
    ref = [torch.randn(V, D, generator=gen)]
    for _ in range(L):
        ref += [torch.ones(D), matrix(D, D), matrix(D, 2 * dh), matrix(D, 2 * dh), torch.ones(dh),
                torch.ones(dh), matrix(D, D, 2 * L * D), torch.ones(D), matrix(D, F), matrix(D, F),
                matrix(F, D, 2 * L * F)]
    ref += [torch.ones(D), matrix(D, V)]
    params = dp.tensors_of(parts)
    assert [len(part) for part in parts] == [1, *[11] * L, 2]
    assert all(w.dtype == torch.float32 and torch.equal(w, r) for w, r in zip(params, ref))
    assert len(params) == len(ref) == len(dp.param_names(args))
    wq = [parts[1 + layer][1] for layer in range(L)]   # never reseeded: every block differs
    assert all((wq[i] - wq[j]).abs().max() > 0.1 for i in range(L) for j in range(i + 1, L))
    # same seed -> bitwise the same, on every rank that calls it; another seed -> different
    assert all(torch.equal(a, b) for a, b in zip(params, dp.tensors_of(dp.init_params(args))))
    vars(args).update(seed=8)
    other = dp.tensors_of(dp.init_params(args))
    assert all((a - b).abs().max() > 0.1 for a, b in zip(params, other) if a.dim() == 2)


def test_init_params_shards_are_slices_of_one_matrix():
    """What a tensor-parallel rank t of T keeps: columns t*D/T .. of the full Wq. Each rank
    draws the full matrices itself; the pieces must tile the one full matrix."""
    args = _args(num_layers=3, dim=16, context=4, seed=11)
    T, D = 4, 16
    full = dp.init_params(args)[1][1]                       # block 0's Wq
    shards = [dp.init_params(args)[1][1][:, t * D // T:(t + 1) * D // T] for t in range(T)]
    assert torch.equal(torch.cat(shards, dim=1), full)
    # a rank that drew its shard from a reseeded generator would get another matrix
    reseeded = torch.randn(D, D // T, generator=torch.Generator().manual_seed(11)) / math.sqrt(D)
    assert not torch.equal(shards[0], reseeded)


def test_init_params_scale_is_one_over_sqrt_fan_in():
    """Wq, Wk, Wv, W1, W3: std D^-1/2; Wo (2 L D)^-1/2, W2 (2 L F)^-1/2; gains 1."""
    D, L = 512, 2
    args = _args(num_layers=L, dim=D, heads=8, context=8, seed=0)
    F = args.ffn_dim
    parts = [dict(zip(dp.block_names(), part)) for part in dp.init_params(args)[1:-1]]
    for fan, names in ((D, ("wq", "wk", "wv", "w1", "w3")), (2 * L * D, ("wo",)),
                       (2 * L * F, ("w2",))):
        w = torch.cat([part[name].reshape(-1) for part in parts for name in names])
        assert abs(w.std().item() * math.sqrt(fan) - 1) < 0.01   # the std's own spread ~0.1 %
        assert abs(w.mean().item()) < 5 / math.sqrt(fan * w.numel())
    assert all(torch.equal(part[name], torch.ones(D)) for part in parts
               for name in ("norm1", "norm2"))   # gains start at 1


def test_the_block_defaults_are_llamas_proportions():
    """--kv-heads h/2 (h odd: h); --ffn-dim 8D/3 up to a multiple of 48, so that it splits
    over tp 1, 2, 3, 4, 6 and 8; both recorded in --save's config."""
    for dim, heads, kv_heads, ffn_dim in ((64, 4, 2, 192), (256, 4, 2, 720), (48, 3, 3, 144)):
        args = _args(dim=dim, heads=heads)
        assert (args.kv_heads, args.ffn_dim) == (kv_heads, ffn_dim)
        assert all(args.ffn_dim % tp == 0 for tp in (1, 2, 3, 4, 6, 8))


def test_the_text_is_cpythons_help_in_97_classes():
    """pydoc_data.topics, every character mapped: ' ' .. '~' to 0 .. 94, newline 95, the rest
    96; the first 90% trains, the rest validates; the baselines are the text's entropies."""
    from pydoc_data.topics import topics
    text = "".join(topics[name] for name in sorted(topics))
    ids, source = dp.read_text()
    assert "pydoc_data" in source and len(ids) == len(text) > 400_000
    assert V == 97 and ids.min() >= 0 and ids.max() == V - 1
    sample = text[:2000]
    want = [ord(c) - 32 if 32 <= ord(c) < 127 else 95 if c == "\n" else 96 for c in sample]
    assert ids[:2000].tolist() == want
    assert dp.decode(ids[:2000]) == "".join(c if 32 <= ord(c) < 127 or c == "\n" else "?" for c in sample)
    train, val = dp.text_part("training"), dp.text_part("validation")
    assert len(train) == len(ids) * 9 // 10 and torch.equal(torch.cat([train, val]), ids)
    uniform, unigram, bigram = dp.baselines()
    assert uniform == pytest.approx(math.log(97))
    counts = torch.bincount(ids, minlength=V).double()
    p = counts[counts > 0] / counts.sum()
    assert unigram == pytest.approx(-(p * p.log()).sum().item())
    assert 2.2 < bigram < unigram < uniform                  # one character of context helps


def test_the_text_falls_back_to_the_scripts_without_pydoc_data(monkeypatch):
    monkeypatch.setitem(sys.modules, "pydoc_data.topics", None)   # import fails
    dp.read_text.cache_clear()
    try:
        ids, source = dp.read_text()
        scripts = "".join((REPO / name).read_text() for name in sorted(
            p.name for p in REPO.iterdir() if p.suffix == ".py"))
        assert "scripts" in source and ids.tolist() == dp.encode(scripts).tolist()
    finally:
        dp.read_text.cache_clear()


def test_a_text_shorter_than_a_window_is_refused_at_the_door_in_one_line(monkeypatch, capsys):
    """An empty (or stripped) pydoc_data.topics: one line naming the text and its length, exit 2,
    before any rank starts, not randint's error in every rank."""
    import pydoc_data.topics
    monkeypatch.setattr(pydoc_data.topics, "topics", {"stripped": "x" * 40})
    dp.read_text.cache_clear()
    try:
        with pytest.raises(SystemExit) as exited:
            dp.parse_args(["--context", "4"])
        assert exited.value.code == 2
        assert capsys.readouterr().err.splitlines() == [
            f"{os.path.basename(sys.argv[0])}: error: --context 4: a window is 5 characters, and "
            f"CPython's help (pydoc_data.topics) has 40 (its smaller part, 4)"]
        assert dp.parse_args(["--context", "2", "--dim", "8"]).context == 2   # 3 fit in 4
    finally:
        dp.read_text.cache_clear()


def test_make_batch_is_windows_of_the_text_drawn_by_seed_and_step():
    args = _args(batch_size=6, context=5, seed=5)
    text = dp.text_part("training")
    inputs, targets = dp.make_batch(args, step=3)
    gen = torch.Generator().manual_seed(5 * 1_000_003 + 3)
    starts = torch.randint(len(text) - 5, (6,), generator=gen)
    assert inputs.shape == targets.shape == (6, 5)
    for row, start in enumerate(starts.tolist()):   # T characters, and each one's next
        assert inputs[row].tolist() == text[start:start + 5].tolist()
        assert targets[row].tolist() == text[start + 1:start + 6].tolist()
    again = dp.make_batch(args, step=3)        # every rank draws the same
    assert torch.equal(again[0], inputs) and torch.equal(again[1], targets)
    assert not torch.equal(dp.make_batch(args, step=4)[0], inputs)   # a fresh batch a step
    assert not torch.equal(dp.make_batch(_args(batch_size=6, context=5, seed=6), step=3)[0], inputs)


# ----------------------------------------------------------------------------------
# 3. serial_train against an independent torch.nn reference
# ----------------------------------------------------------------------------------

def _linear(w):
    """nn.Linear computes x @ weight.T, so it holds W^T."""
    layer = nn.Linear(w.shape[0], w.shape[1], bias=False)
    with torch.no_grad():
        layer.weight.copy_(w.T)
    return layer


def _args(**overrides):
    cfg = {**SMALL, "batch_size": 8, "micro_batches": 1, "optimizer": "sgd", **overrides}
    argv = []
    for key, value in cfg.items():
        if value is True:                 # a switch
            argv += [f"--{key.replace('_', '-')}"]
        else:
            argv += [f"--{key.replace('_', '-')}", str(value)]
    args = dp.training_parser("t").parse_args(argv)
    args.vocab_size = V
    dp.model_defaults(args)
    return args


class TorchBlock(nn.Module):
    """A pre-norm Llama block in torch.nn: nn.RMSNorm, nn.Linear(bias=False), RoPE by complex
    numbers (Meta's Llama code), causal attention with grouped kv heads (enable_gqa), SwiGLU."""

    def __init__(self, weights, heads, rope_theta):
        super().__init__()
        g1, wq, wk, wv, wo, g2, w1, w3, w2 = weights
        self.heads, self.head_dim, self.theta = heads, wq.shape[1] // heads, rope_theta
        self.norm1, self.norm2 = _norm(g1), _norm(g2)
        self.wq, self.wk, self.wv, self.wo = map(_linear, (wq, wk, wv, wo))
        self.w1, self.w3, self.w2 = map(_linear, (w1, w3, w2))

    def rope(self, t):   # [b, T, n, dh]: each pair times e^(i m theta_i)
        T, dh = t.shape[1], self.head_dim
        angles = torch.outer(torch.arange(T).double(), self.theta ** (-torch.arange(0, dh, 2).double() / dh))
        turn = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)[:, None]
        return torch.view_as_real(torch.view_as_complex(t.unflatten(-1, (-1, 2))) * turn).flatten(-2)

    def forward(self, x):
        b, T, D = x.shape
        n = self.norm1(x)
        q, k, v = (layer(n).view(b, T, -1, self.head_dim) for layer in (self.wq, self.wk, self.wv))
        q, k, v = (t.transpose(1, 2) for t in (self.rope(q), self.rope(k), v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(o.transpose(1, 2).reshape(b, T, D))
        n = self.norm2(x)
        return x + self.w2(F.silu(self.w1(n)) * self.w3(n))

    def params(self):
        return [self.norm1.weight, *[layer.weight.T for layer in (self.wq, self.wk, self.wv, self.wo)],
                self.norm2.weight, *[layer.weight.T for layer in (self.w1, self.w3, self.w2)]]


def _norm(gain):
    norm = nn.RMSNorm(len(gain), eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(gain)
    return norm


class TorchModel(nn.Module):
    """The same language model in torch.nn: nn.Embedding, the blocks, the final nn.RMSNorm and
    an nn.Linear head, under F.cross_entropy at every position."""

    def __init__(self, parts, heads, rope_theta):
        super().__init__()
        (embedding,), *blocks, (gain, head) = parts
        self.embedding = nn.Embedding.from_pretrained(embedding.clone(), freeze=False)
        self.blocks = nn.ModuleList(TorchBlock(block, heads, rope_theta) for block in blocks)
        self.norm = _norm(gain)
        self.head = _linear(head)

    def forward(self, tokens):
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)).flatten(0, 1)

    def params(self):   # in our order and orientation
        params = [self.embedding.weight]
        for block in self.blocks:
            params += block.params()
        return [w.detach() for w in [*params, self.norm.weight, self.head.weight.T]]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_serial_train_matches_torch_nn(optimizer):
    args = _args(optimizer=optimizer, lr=0.1 if optimizer == "sgd" else 0.01)
    model = TorchModel(dp.init_params(args), args.heads, args.rope_theta)
    opt_cls = torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW
    opt = opt_cls(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        inputs, targets = dp.make_batch(args, step)
        loss = F.cross_entropy(model(inputs), targets.reshape(-1))
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()

    got = serial_train(args)
    assert len(got["losses"]) == args.steps
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses), atol=1e-6, rtol=1e-6)
    for w, ref in zip(final_params(got), model.params()):
        torch.testing.assert_close(w, ref, atol=1e-6, rtol=1e-6)
    _assert_trained(final_params(got), dp.tensors_of(dp.init_params(args)))


def _assert_trained(final, init):
    """The weights moved far more than the tolerance: a gradient scale error would show."""
    moved = max((f - i).abs().max().item() for f, i in zip(final, init))
    assert moved > 100 * ATOL


# ----------------------------------------------------------------------------------
# 4, 5. Data-parallel training against serial_train
# ----------------------------------------------------------------------------------

REPLICA_DRIFT = dp.replica_drift


def _spy_on_replicas(folder):
    """Wrap replica_drift so every rank also saves the weights its layers compute with (forked
    ranks inherit the wrapper): the tests can then compare the replicas themselves. ZeRO-3 keeps
    none between steps: an empty list."""
    def spy(replica):
        weights = [w.detach().float().cpu().clone() for w in replica.weights if w is not None]
        torch.save(weights, folder / f"rank{dist.get_rank()}.pt")
        return REPLICA_DRIFT(replica)
    return spy


def run_dp(tmp_path, monkeypatch, world_size, batch_size=8, micro_batches=1, optimizer="sgd",
           lr=None, flags=(), **overrides):
    """Run data_parallel.main in-process (ranks are forked from here); return the saved
    dict, with each rank's final parameters under "replicas"."""
    cfg = {**SMALL, **overrides}
    if lr is None:
        lr = cfg["lr"] if optimizer == "sgd" else 0.01
    save = tmp_path / "run.pt"
    argv = ["--world-size", str(world_size), "--batch-size", str(batch_size),
            "--micro-batches", str(micro_batches), "--optimizer", optimizer, "--lr", str(lr),
            "--num-layers", str(cfg["num_layers"]), "--dim", str(cfg["dim"]),
            "--context", str(cfg["context"]), "--heads", str(cfg["heads"]),
            "--steps", str(cfg["steps"]), "--seed", str(cfg["seed"]), "--save", str(save), *NO_SAMPLE,
            *flags]
    monkeypatch.setattr(dp, "replica_drift", _spy_on_replicas(tmp_path))
    dp.main(argv)
    result = torch.load(save)
    result["replicas"] = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]
    return result


def serial_for(config):
    args = dp.training_parser("t").parse_args([])
    for key, value in config.items():
        setattr(args, key, value)
    dp.model_defaults(args)
    return serial_train(args)


def assert_matches_serial(result):
    cfg = result["config"]
    ref = serial_for(cfg)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]),
                               atol=ATOL, rtol=RTOL)
    for got, want in zip(final_params(result), final_params(ref)):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    _assert_trained(final_params(result), init_of(result))


def assert_replicas_identical(result):
    assert result["replica_max_diff"] == 0.0
    first = result["replicas"][0]
    assert len(first) == (0 if result["config"].get("zero") == 3 else len(final_params(result)))
    for other in result["replicas"][1:]:
        assert len(other) == len(first) and all(torch.equal(a, b) for a, b in zip(first, other))
    assert all(torch.equal(a, b) for a, b in zip(first, final_params(result)))


@pytest.mark.parametrize("world_size,batch_size,micro_batches", [
    (1, 8, 1), (2, 8, 1), (2, 8, 4), (3, 24, 2), (4, 16, 2)])
def test_dp_sgd_matches_serial(tmp_path, monkeypatch, world_size, batch_size, micro_batches):
    result = run_dp(tmp_path, monkeypatch, world_size, batch_size, micro_batches)
    assert_matches_serial(result)
    assert_replicas_identical(result)


def test_dp_save_contents(tmp_path, monkeypatch):
    result = run_dp(tmp_path, monkeypatch, 2, batch_size=8, micro_batches=2)
    cfg = result["config"]
    for flag in ("num_layers", "dim", "context", "vocab_size", "batch_size", "micro_batches", "steps",
                 "lr", "optimizer", "seed", "save", "check", "world_size", "overlap"):
        assert flag in cfg
    assert (cfg["world_size"], cfg["batch_size"], cfg["micro_batches"], cfg["optimizer"]) == (2, 8, 2, "sgd")
    assert (cfg["num_layers"], cfg["dim"], cfg["context"], cfg["steps"], cfg["lr"], cfg["seed"]) == \
        (SMALL["num_layers"], SMALL["dim"], SMALL["context"], SMALL["steps"], SMALL["lr"], SMALL["seed"])
    assert cfg["vocab_size"] == V == 97
    assert cfg["save"] == str(tmp_path / "run.pt") and cfg["check"] is False

    assert_follows_the_contract(result, flags=("world_size", "overlap"))


ZERO_CASES = [(1, 1, 1, "sgd", False), (1, 3, 2, "adamw", False),
              (2, 1, 2, "sgd", False), (2, 2, 4, "adamw", True), (2, 3, 1, "sgd", True),
              (3, 1, 2, "adamw", True), (3, 2, 1, "sgd", False), (3, 3, 4, "adamw", False),
              (4, 1, 1, "adamw", False), (4, 2, 2, "sgd", False), (4, 3, 2, "sgd", False),
              (4, 3, 1, "adamw", True)]


@pytest.mark.parametrize("world_size,zero,micro_batches,optimizer,overlap", ZERO_CASES)
def test_zero_matches_serial(tmp_path, monkeypatch, world_size, zero, micro_batches, optimizer, overlap):
    result = run_dp(tmp_path, monkeypatch, world_size, batch_size=4 * world_size * micro_batches,
                    micro_batches=micro_batches, optimizer=optimizer,
                    flags=("--zero", str(zero), *(["--overlap"] if overlap else [])))
    assert (result["config"]["zero"], result["config"]["overlap"]) == (zero, overlap)
    assert_follows_the_contract(result)                 # full, gathered
    assert_matches_serial(result)
    assert_replicas_identical(result)


# Buckets: a layer each (0), two of the 16 x 16 layers (0.002 MB), the whole model (25 MB);
# every stage, with and without --overlap, with micro-batches; 3 replicas pad every bucket.
BUCKET_CASES = [(2, 0, 2, False, "0.002"), (2, 0, 2, True, "0"), (3, 0, 1, True, "0.002"),
                (3, 1, 2, False, "0.002"), (3, 1, 2, True, "25"), (2, 1, 4, True, "0"),
                (3, 2, 2, False, "25"), (3, 2, 2, True, "0.002"), (2, 2, 1, True, "0"),
                (3, 3, 2, False, "0.002"), (3, 3, 4, True, "25"), (2, 3, 2, True, "0.002")]


@pytest.mark.parametrize("world_size,zero,micro_batches,overlap,bucket_mb", BUCKET_CASES)
def test_buckets_match_serial(tmp_path, monkeypatch, world_size, zero, micro_batches, overlap, bucket_mb):
    result = run_dp(tmp_path, monkeypatch, world_size, batch_size=4 * world_size * micro_batches,
                    micro_batches=micro_batches, flags=("--zero", str(zero), "--bucket-mb", bucket_mb,
                                                        *(["--overlap"] if overlap else [])))
    assert result["config"]["bucket_mb"] == float(bucket_mb)
    assert_matches_serial(result)
    assert_replicas_identical(result)


def test_buckets_are_runs_of_parts_from_the_last_within_the_cap():
    """Cut from the last part; the first bucket (the last parts') holds 1 MB at most, the
    others bucket_mb; a part larger than the cap is a bucket alone; 0: a part each; no bucket
    spans the start of a chunk; a part's tensors stay in one bucket."""
    mb = 2**20 // 4                                   # floats in 1 MB

    def buckets(*args, **kwargs):
        return dp.make_buckets(*args, **kwargs).parts
    assert buckets([[mb // 4]] * 8, 25) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert buckets([[mb // 4]] * 8, 0.5) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert buckets([[4 * mb]] * 3, 25) == [[0, 1], [2]]       # 4 MB: alone past the first 1 MB
    assert buckets([[10]] * 4, 0) == [[0], [1], [2], [3]]
    assert buckets([[10]] * 8, 25, chunk_starts=range(0, 8, 4)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert buckets([[10]] * 6, 25, chunk_starts=range(0, 6, 2)) == [[0, 1], [2, 3], [4, 5]]
    assert buckets([[mb // 8] * 2, [mb // 8] * 4, [mb // 8] * 2], 0.5) == [[0], [1], [2]]
    # and where each tensor sits: its bucket, its offset in it, each bucket's length
    layout = dp.make_buckets([[3, 5], [7], [11]], 0.5)
    assert (layout.buckets, layout.bucket_of, layout.offset, layout.lengths) == (
        [[0, 1, 2, 3]], {0: 0, 1: 0, 2: 0, 3: 0}, {0: 0, 1: 3, 2: 8, 3: 15}, [26])
    assert [list(span) for span in layout.spans] == [[0, 1], [2], [3]]


MEMORY_ROW = re.compile(r"^  (weights|gradients|optimizer state|total)\s+(\d+) bytes\s+formula (.+?)\s*= +([\d.]+)$")


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("optimizer,bucket_mb", [("adamw", "0"), ("sgd", "0"), ("adamw", "25")])
def test_memory_each_replica_holds_is_the_formula(tmp_path, monkeypatch, capfd, zero, optimizer, bucket_mb):
    """What one replica holds at the end of a step, counted from its tensors, is ZeRO's
    formula: 16P, 8P + 8P/d, 4P + 12P/d, 16P/d bytes with AdamW (4 + 4 + 0 with SGD). With 3
    replicas each bucket is padded to a multiple of 3 (padded_buckets). (ZeRO-3's largest moment:
    tests/test_bench.py's memory table.)"""
    run_dp(tmp_path, monkeypatch, 3, batch_size=12, micro_batches=2, optimizer=optimizer,
           flags=("--zero", str(zero), "--bucket-mb", bucket_mb))
    out = capfd.readouterr().out
    rows = {m[1]: (int(m[2]), m[3], float(m[4])) for m in map(MEMORY_ROW.match, out.splitlines()) if m}
    d = 3
    units = padded_buckets(bucket_mb, pad_to=d if zero else 1)
    P = sum(units)
    adam = 8 if optimizer == "adamw" else 0
    want = {0: (4 * P, 4 * P, adam * P), 1: (4 * P, 4 * P, adam * P / d), 2: (4 * P, 4 * P / d, adam * P / d),
            3: (4 * P / d, 4 * P / d, adam * P / d)}[zero]
    assert [rows[k][0] for k in ("weights", "gradients", "optimizer state")] == list(want)
    assert rows["total"][0] == sum(want) and rows["total"][2] == sum(want)
    assert all(rows[k][0] == rows[k][2] for k in rows), rows


def padded_buckets(bucket_mb, pad_to):
    """SMALL's buckets' lengths, each padded to a multiple of pad_to (ZeRO's d S): the parts
    [E, P], four blocks and [g, H]; "0", a part each; "25", one bucket."""
    args = _args()
    numels = [[w.numel() for w in part] for part in dp.init_params(args)]
    return [-(-n // pad_to) * pad_to for n in dp.make_buckets(numels, float(bucket_mb)).lengths]


def test_gradient_scale_micro_batches_and_replicas(tmp_path, monkeypatch):
    """Summed over micro-batches, averaged over replicas once: m=4 equals m=1, dp=2 equals dp=1.
    Averaging per micro-batch, or overwriting instead of accumulating, changes the step size."""
    runs = {}
    for world_size, micro_batches in [(1, 1), (1, 4), (2, 1), (2, 4)]:
        folder = tmp_path / f"dp{world_size}m{micro_batches}"
        folder.mkdir()
        runs[world_size, micro_batches] = run_dp(folder, monkeypatch, world_size, 8, micro_batches)
    base = runs[1, 1]
    _assert_trained(final_params(base), init_of(base))
    for key, result in runs.items():
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(base["losses"]),
                                   atol=ATOL, rtol=RTOL, msg=lambda m: f"{key}: {m}")
        for got, want in zip(final_params(result), final_params(base)):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m: f"{key}: {m}")


# ----------------------------------------------------------------------------------
# 6. replica_rows
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dp_size", [1, 2, 3, 4, 8])
def test_replica_rows_partition_the_batch(dp_size):
    batch_size = 24
    per = batch_size // dp_size
    slices = [dp.replica_rows(batch_size, d, dp_size) for d in range(dp_size)]
    assert all(len(s) == per for s in slices)          # no empty slice on any replica
    assert sorted(torch.cat(slices).tolist()) == list(range(batch_size))   # each row exactly once
    for d, s in enumerate(slices):                     # replica d takes block d, by its dp rank
        assert s.tolist() == list(range(d * per, (d + 1) * per))


def test_replica_rows_are_taken_by_dp_rank_in_3d():
    """In a 3D grid (rank = (d*PP + p)*TP + t) the slice follows the dp coordinate d, so the
    tp/pp peers of a replica share its rows and the replicas cover the batch; slicing by
    the global rank (a classic bug) would leave ranks past the first dp_size empty."""
    DP, PP, TP, B = 2, 2, 2, 8
    grid = torch.arange(DP * PP * TP).view(DP, PP, TP)
    by_rank = {}
    for d in range(DP):
        for rank in grid[d].reshape(-1).tolist():
            by_rank[rank] = dp.replica_rows(B, d, DP)
    for d in range(DP):
        peers = [by_rank[r] for r in grid[d].reshape(-1).tolist()]
        assert all(torch.equal(p, peers[0]) for p in peers) and len(peers[0]) == B // DP
    assert sorted(torch.cat([by_rank[grid[d, 0, 0].item()] for d in range(DP)]).tolist()) == list(range(B))
    assert len(dp.replica_rows(B, DP * PP * TP - 1, DP)) == 0   # the global-rank mistake


# ----------------------------------------------------------------------------------
# 7. --check
# ----------------------------------------------------------------------------------

def _start(*argv):
    return subprocess.Popen([sys.executable, "data_parallel.py", *argv], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.fixture(scope="module")
def command_line_runs():
    """The two command-line runs, started together: each spends ~3 s importing torch, and
    on two cores they overlap instead of queueing."""
    procs = {"check": _start("--world-size", "2", "--steps", "3", "--check"),
             "bad flag": _start("--world-size", "3", "--batch-size", "32")}
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_check_passes_from_the_command_line(command_line_runs):
    proc = command_line_runs["check"]
    out, err = proc.communicate(timeout=55)
    assert proc.returncode == 0, err
    assert_check_passed(out, dp.CHECK_TOLERANCE)


def test_check_fails_when_the_parallel_result_is_wrong(tmp_path, monkeypatch, capfd):
    """Break the averaging (sum over replicas, no division): --check must fail, at the
    gradients, and say so as a failed check (a Stop), not as a crashed rank."""
    def average_without_division(self):        # the all-reduce as usual, then no division by dp
        self.finish_reductions()

    monkeypatch.setattr(dp.DataParallel, "average", average_without_division)
    with pytest.raises(RankFailed) as failed:
        run_dp(tmp_path, monkeypatch, 2, batch_size=8, micro_batches=1, flags=("--check",))
    assert failed.value.rank == 0 and failed.value.stopped.startswith("check FAILED")
    figures, verdict = check_report(capfd.readouterr().out)
    assert verdict == "FAILED"
    assert 0.5 < figures["gradients"][0] <= 1.0   # twice the gradient: g too many, of its terms (at least g)
    assert figures["gradients"][2] == "FAILED", figures
    # from the same weights the forward is right, and the optimizer steps as asked, on wrong gradients
    assert figures["losses"][2] == figures["weights after an update"][2] == "ok", figures
    # the run saved before checking: it is far from serial, as the check said
    saved = torch.load(tmp_path / "run.pt")
    ref = serial_for(saved["config"])
    worst = max((a - b).abs().max().item() for a, b in zip(final_params(saved), final_params(ref)))
    assert worst > 10 * dp.CHECK_TOLERANCE


def test_check_passes_in_process(tmp_path, monkeypatch, capfd):
    result = run_dp(tmp_path, monkeypatch, 2, batch_size=8, micro_batches=2, flags=("--check",))
    assert_check_passed(capfd.readouterr().out, dp.CHECK_TOLERANCE)
    assert_matches_serial(result)


# ----------------------------------------------------------------------------------
# 8. Bad input: one line on stderr naming the flag, exit 2, before any rank starts
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,flag", [
    (["--dim", "0"], "--dim"),
    (["--steps", "-1"], "--steps"),
    (["--lr", "0"], "--lr"),
    (["--lr", "abc"], "--lr"),
    (["--lr", "nan"], "--lr"),
    (["--optimizer", "adam"], "--optimizer"),
    (["--batch-size", "30", "--world-size", "4"], "--batch-size"),
    (["--batch-size", "8", "--world-size", "2", "--micro-batches", "3"], "--batch-size"),
    (["--world-size", "0"], "--world-size"),
    (["--micro-batches", "0"], "--micro-batches"),
    (["--save", "{tmp}/no/such/dir/run.pt"], "--save"),
    (["--save", "{tmp}"], "--save"),
    (["--zero", "4"], "--zero"),
    (["--zero", "-1"], "--zero"),
    (["--context", "0"], "--context"),
    (["--dim", "64", "--heads", "5"], "--dim"),
])
def test_bad_input_exits_2_with_one_line(argv, flag, tmp_path, monkeypatch, capsys):
    started = []
    monkeypatch.setattr(dp, "spawn", lambda *a, **k: started.append(a))
    with pytest.raises(SystemExit) as exited:
        dp.main([a.format(tmp=tmp_path) for a in argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.endswith("\n")
    assert flag in err and "error" in err and "Traceback" not in err
    assert started == []


def test_bad_flag_from_the_command_line(command_line_runs):
    proc = command_line_runs["bad flag"]
    out, err = proc.communicate(timeout=55)
    assert proc.returncode == 2
    assert len(err.splitlines()) == 1 and "--batch-size" in err
    assert "Traceback" not in err and out == ""


# ----------------------------------------------------------------------------------
# What real training adds: --clip-grad, --recompute, --bf16
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size,zero,micro_batches,bucket_mb", [
    (2, 0, 2, "25"), (3, 1, 2, "0.002"), (3, 2, 1, "0"), (2, 3, 2, "25"), (4, 3, 1, "0")])
def test_clip_grad_matches_serial_clip_grad_norm(tmp_path, monkeypatch, capfd, world_size, zero, micro_batches,
                                                  bucket_mb):
    """One norm over the whole model: the replicas hold the same averaged gradient (stage 0,
    nothing summed over dp) or 1/d of it (ZeRO: summed over dp, padding zero). A --clip-grad
    that clips some steps and not others; serial training calls clip_grad_norm_."""
    batch_size = 4 * world_size * micro_batches
    clip = clip_between({**SMALL, "batch_size": batch_size, "optimizer": "sgd"})
    result = run_dp(tmp_path, monkeypatch, world_size, batch_size=batch_size, micro_batches=micro_batches,
                    flags=("--zero", str(zero), "--bucket-mb", bucket_mb, "--clip-grad", str(clip)))
    assert result["config"]["clip_grad"] == clip
    assert_clipped_some(capfd.readouterr().out)
    assert_matches_serial(result)
    ref = serial_for(result["config"])
    torch.testing.assert_close(torch.tensor(result["grad_norms"]), torch.tensor(ref["grad_norms"]), atol=ATOL,
                               rtol=RTOL)


@pytest.mark.parametrize("zero,overlap", [(0, False), (3, True), (2, False)])
def test_recompute_is_bitwise_the_same_training(tmp_path, monkeypatch, zero, overlap):
    flags = ("--zero", str(zero), "--bucket-mb", "0", *(["--overlap"] if overlap else []))
    runs = []
    for recompute in (False, True):
        folder = tmp_path / str(recompute)
        folder.mkdir()
        runs.append(run_dp(folder, monkeypatch, 2, batch_size=8, micro_batches=2,
                           flags=(*flags, *(["--recompute"] if recompute else []))))
    assert runs[1]["config"]["recompute"] and not runs[0]["config"]["recompute"]
    assert_same_bits(*runs)


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_bf16_checks_within_its_tolerance_and_learns_as_fp32_does(tmp_path, monkeypatch, capfd, zero):
    """bf16 matmuls and activations on fp32 masters: --check against serial training that
    makes the same casts, within bf16_tolerance(); and the loss falls step by step as
    fp32's does, within that tolerance."""
    runs = {}
    for bf16 in (False, True):
        folder = tmp_path / str(bf16)
        folder.mkdir()
        runs[bf16] = run_dp(folder, monkeypatch, 2, batch_size=8, micro_batches=2, optimizer="adamw",
                            flags=("--zero", str(zero), "--check", "--steps", "8", *(["--bf16"] if bf16 else [])))
    out = capfd.readouterr().out
    assert out.count("check OK") == 2
    assert_check_passed(out.partition("check OK")[2], dp.bf16_tolerance())
    fp32, bf16 = torch.tensor(runs[False]["losses"]), torch.tensor(runs[True]["losses"])
    assert bf16[-1] < bf16[0] - 0.5 and ((bf16 - fp32).abs() / fp32).max() < dp.bf16_tolerance()
    assert all(w.dtype == torch.float32 for w in final_params(runs[True]))   # the masters, saved


BF16_MEMORY = {0: (2, 4, 12, 1, 1, 1), 1: (2, 4, 12, 1, 1, 3), 2: (2, 4, 12, 1, 3, 3), 3: (0, 4, 12, 1, 3, 3)}


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_bf16_memory_is_2_4_12_bytes_a_parameter_split_by_zero(tmp_path, monkeypatch, capfd, zero):
    """As held: 2 bytes of bf16 weights (none at stage 3 but while gathered), 4 of fp32
    gradients, 12 of fp32 master weights and AdamW's moments; ZeRO splits them as ever."""
    run_dp(tmp_path, monkeypatch, 3, batch_size=12, micro_batches=2, optimizer="adamw",
           flags=("--zero", str(zero), "--bucket-mb", "0", "--bf16"))
    rows = {m[1]: (int(m[2]), float(m[4])) for m in map(MEMORY_ROW.match, capfd.readouterr().out.splitlines()) if m}
    P = sum(padded_buckets("0", pad_to=3 if zero else 1))
    weights, grads, state, *split = BF16_MEMORY[zero]
    want = [weights * P / split[0], grads * P / split[1], state * P / split[2]]
    assert [rows[k][0] for k in ("weights", "gradients", "optimizer state")] == want
    assert rows["total"] == (sum(want), sum(want))


def test_a_blocks_stash_keeps_lse_not_a_at_t_512():
    """At T 512 attention's A [b, h, T, T] would be 512 times its lse [b, h, T]: the stash at its
    largest, counted from the tensors alive (tests/stash_check.py), is block_stash's formula with
    lse, and a block that kept A as well would hold 4 MB more each."""
    L, D, h, B, d, T = 2, 16, 2, 4, 2, 512
    argv = ["--world-size", str(d), "--num-layers", str(L), "--dim", str(D), "--heads", str(h),
            "--batch-size", str(B), "--micro-batches", "1", "--optimizer", "sgd", "--context", str(T)]
    stash, _ = stash_and_peak("data_parallel", argv)
    b = B // d
    A = b * T * D * 4
    K = A // 2                                           # k, v: G = h/2 kv heads
    M = 3 * A                                            # a, up, u: F = 48 = 3 D
    kept = 6 * A + 2 * K + 3 * M + 2 * b * T * 4 + b * h * T * 4   # x n1 q o x' n2; r1 r2; lse
    ends = 2 * A + b * T * 4 + b * T * 8                 # the head's x, n and r; the tokens
    assert kept == pipeline_parallel.block_stash(dp.parse_args(argv), b)[0]
    assert stash == L * kept + ends


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_recompute_keeps_each_blocks_input_and_the_peak_falls_by_the_formula(zero):
    """--recompute keeps each block's x, not its 14 tensors: a micro-batch's stash at its largest
    is L [b, T, D], not L times its x n1 q k v o x' n2 a up u and r1, r2, lse, beside the ends' (the
    embedding's int64 tokens, the head's x, n and r), counted from the tensors alive
    (tests/stash_check.py); the step's peak falls by the difference but for one block's: the
    block whose backward runs remakes its stash, beside the others' x. With ZeRO's every stage."""
    L, D, h, B, m, d, T = 4, 16, 4, 64, 2, 2, 4
    argv = ["--world-size", str(d), "--num-layers", str(L), "--dim", str(D), "--heads", str(h),
            "--batch-size", str(B), "--micro-batches", str(m), "--zero", str(zero), "--optimizer", "sgd",
            "--context", str(T)]
    plain = stash_and_peak("data_parallel", argv)
    recompute = stash_and_peak("data_parallel", [*argv, "--recompute"])
    b = B // (d * m)
    A = b * T * D * 4                                    # [b, T, D]
    K = A // 2                                           # k, v: G = h/2 kv heads
    M = 3 * A                                            # a, up, u: F = 48 = 3 D
    kept = 6 * A + 2 * K + 3 * M + 2 * b * T * 4 + b * h * T * 4   # pipeline's block_stash
    ends = 2 * A + b * T * 4 + b * T * 8                 # the head's x, n and r; the tokens
    assert plain[0] == L * kept + ends and recompute[0] == L * A + ends
    assert (L - 1) * (kept - A) <= plain[1] - recompute[1] <= L * (kept - A)
