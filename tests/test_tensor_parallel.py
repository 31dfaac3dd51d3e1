"""Tests for tensor_parallel.py: every number is compared with a single-process reference.

- The column-parallel layer in isolation (forked ranks, T = 1..4): forward, dW_t, dx and
  the skipped all-reduce against autograd on the full matrix; the all-gather's order.
- The vocabulary split over the ranks against nn.Embedding, a full head and F.cross_entropy:
  the embedding's outputs and gradients (tokens at every shard edge, repeated tokens), the
  logits never gathered, the loss and dlogits in pieces, at V = 97 (no T > 1 divides it);
  and the three known defects (a padded class in the softmax, gathered logits fed to the
  vocab-parallel loss, the embedding's all-reduce without its backward) each fail it.
- Tensor-parallel training (in-process main(), ranks forked) against serial_train, over
  world sizes, micro-batches and optimizers; the --save contract; each rank's own shards.
- Known from-scratch bugs stay gone: shards are slices of one matrix, dW_t is [D, D/T].
- --check from the command line, --check failing on a broken backward, bad flags exit 2.

The workers save what they computed to tmp files and the test asserts in the parent, so a
rank that never ran fails the test too (its file is missing).
"""
import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import data_parallel as dp
import tensor_parallel as tp
from collectives import RankFailed, cleanup, setup, spawn
from stash_check import stash_and_peak
from common import (serial_train, assert_check_passed, assert_clipped_some, assert_same_bits, check_report, clip_between,
                    final_params, init_of)

REPO = Path(__file__).resolve().parent.parent

# Float32, differences only from summation order.
ATOL = 1e-5
RTOL = 1e-5

# A small model that trains quickly and stays far from chaos. D = 24 divides by 1, 2, 3, 4;
# B = 12 by micro-batch counts 1, 2, 3, 4.
SMALL = {"num_layers": 4, "dim": 24, "context": 4, "batch_size": 12, "steps": 4, "seed": 3}
V = dp.VOCAB_SIZE
LR = {"sgd": 0.1, "adamw": 0.01}


def _load_ranks(folder, world_size, prefix="rank"):
    """Every rank's saved file, in rank order (a missing one fails the test)."""
    return [torch.load(folder / f"{prefix}{r}.pt") for r in range(world_size)]


def _cols(rank, world_size, dim):
    n = dim // world_size
    return slice(rank * n, (rank + 1) * n)


# ----------------------------------------------------------------------------------
# 1, 2. The column-parallel layer and the all-gather, in forked ranks
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_shard_columns_are_copies_that_tile_the_matrix(world_size):
    """The shards tile W in rank order, and training one in place leaves W alone, also at
    T = 1 (a view of W there once made the saved init weights equal the final ones)."""
    w = torch.randn(6, 6, generator=torch.Generator().manual_seed(2))
    before = w.clone()
    shards = [tp.shard_columns(w, t, world_size) for t in range(world_size)]
    assert all(s.shape == (6, 6 // world_size) and s.is_contiguous() for s in shards)
    assert torch.equal(torch.cat(shards, dim=1), w)
    for s in shards:
        s.add_(1.0)
    assert torch.equal(w, before)


def _column_worker(rank, world_size, cases, pieces, folder):
    """Run the layer on this rank's shard of each case's full W, and gather one piece per
    rank; save everything for the parent to check."""
    setup(rank, world_size)
    results = []
    for x, w, g in cases:
        w_t = tp.shard_columns(w, rank, world_size)                       # [D, D/T]
        a, stash = tp.gather_forward(x, w_t)                               # [b, D]
        dx, (x_in, dz_t) = tp.gather_backward(g, stash, w_t, need_dx=True)
        dx_local, (x_again, dz_again) = tp.gather_backward(g, stash, w_t, need_dx=False)
        dw_t, dw_t_again = x_in.T @ dz_t, x_again.T @ dz_again            # dW_t = x^T dz_t
        results.append({"w_t": w_t, "a": a, "dx": dx, "dw_t": dw_t,
                        "dx_local": dx_local, "dw_t_again": dw_t_again})
    gathered = tp.all_gather_columns(pieces[rank])
    torch.save({"cases": results, "gathered": gathered}, folder / f"rank{rank}.pt")
    cleanup()


def _column_cases():
    """(x, W, g) at two shapes; x scaled so some |z| reach gelu's flat tails."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    for b, d in [(5, 12), (2, 24)]:
        x = torch.randn(b, d, generator=gen) * 2.0
        w = torch.randn(d, d, generator=gen) * (2.0 / d) ** 0.5
        g = torch.randn(b, d, generator=gen)
        cases.append((x, w, g))
    return cases


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_column_layer_matches_autograd(tmp_path, world_size):
    cases = _column_cases()
    gen = torch.Generator().manual_seed(1)
    pieces = [torch.randn(3, 5, generator=gen) for _ in range(world_size)]   # [b, n], b != n
    spawn(_column_worker, world_size, cases, pieces, tmp_path)
    ranks = _load_ranks(tmp_path, world_size)

    # all_gather_columns: the shards side by side in rank order, the same on every rank
    want = torch.cat(pieces, dim=1)                                          # [3, 5 T]
    for r in ranks:
        assert r["gathered"].shape == (3, 5 * world_size)
        assert torch.equal(r["gathered"], want)

    for i, (x, w, g) in enumerate(cases):
        b, d = x.shape
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        a_ref = F.gelu(xr @ wr)
        a_ref.backward(g)
        full_dx, full_dw = xr.grad, wr.grad
        mine = [r["cases"][i] for r in ranks]
        # the shards tile the one matrix
        assert torch.equal(torch.cat([m["w_t"] for m in mine], dim=1), w)
        for t, m in enumerate(mine):
            # forward: every rank holds the full gelu(x @ W)
            assert m["a"].shape == (b, d)
            torch.testing.assert_close(m["a"], a_ref.detach(), atol=ATOL, rtol=RTOL)
            # dW_t: this rank's columns of autograd's dW, shape [D, D/T] (not the transposed [D/T, D])
            assert m["dw_t"].shape == (d, d // world_size)
            torch.testing.assert_close(m["dw_t"], full_dw[:, _cols(t, world_size, d)], atol=ATOL, rtol=RTOL)
            assert torch.equal(m["dw_t_again"], m["dw_t"])     # need_dx changes dx only
            # dx: the all-reduced sum equals autograd's dx on every rank
            assert m["dx"].shape == (b, d)
            torch.testing.assert_close(m["dx"], full_dx, atol=ATOL, rtol=RTOL)
        # need_dx=False (the model's first layer): no dx at all, and no all-reduce for it
        for m in mine:
            assert m["dx_local"] is None


# ----------------------------------------------------------------------------------
# Megatron's pair, piece by piece: the column layer (sharded output), f, the row layer, g
# ----------------------------------------------------------------------------------

def _pair_worker(rank, world_size, cases, folder):
    """A column layer then a row layer, on this rank's columns of W1 and rows of W2:
    forward, backward, and what each piece holds, saved for the parent."""
    setup(rank, world_size)
    results = []
    for x, w1, w2, g in cases:
        w1_t, w2_t = tp.shard(w1, "column", rank, world_size), tp.shard(w2, "row", rank, world_size)
        a_t, stash1 = tp.column_forward(x, w1_t)                    # [b, D/T], not gathered
        a, stash2 = tp.row_forward(a_t, w2_t)                       # [b, D], after g's all-reduce
        da_t, (a_in, dz) = tp.row_backward(g, stash2, w2_t)         # no communication
        dx, (x_in, dz_t) = tp.column_backward(da_t, stash1, w1_t)   # f's all-reduce of dx
        none, (x_again, dz_again) = tp.column_backward(da_t, stash1, w1_t, need_dx=False)
        dw2_t, dw1_t, dw1_again = a_in.T @ dz, x_in.T @ dz_t, x_again.T @ dz_again   # x^T dz
        results.append(dict(w1_t=w1_t, w2_t=w2_t, a_t=a_t, a=a, z=stash2[1], da_t=da_t, dw2_t=dw2_t, dx=dx,
                            dw1_t=dw1_t, none=none, dw1_again=dw1_again))
    torch.save(results, folder / f"rank{rank}.pt")
    cleanup()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_megatron_pair_matches_autograd_piece_by_piece(tmp_path, world_size):
    gen = torch.Generator().manual_seed(4)
    cases = []
    for b, d in [(5, 8), (3, 16)]:
        x = torch.randn(b, d, generator=gen) * 2.0
        w1, w2 = (torch.randn(d, d, generator=gen) * (2.0 / d) ** 0.5 for _ in range(2))
        cases.append((x, w1, w2, torch.randn(b, d, generator=gen)))
    spawn(_pair_worker, world_size, cases, tmp_path)
    ranks = _load_ranks(tmp_path, world_size)
    for i, (x, w1, w2, g) in enumerate(cases):
        d = x.shape[1]
        xr, w1r, w2r = (t.clone().requires_grad_() for t in (x, w1, w2))
        h = F.gelu(xr @ w1r)
        h.retain_grad()
        z = h @ w2r
        a = F.gelu(z)
        a.backward(g)
        for t, mine in enumerate(r[i] for r in ranks):
            cols = _cols(t, world_size, d)
            # the shards: W1's columns t, W2's rows t
            assert torch.equal(mine["w1_t"], w1[:, cols]) and torch.equal(mine["w2_t"], w2[cols])
            # column forward: this rank's columns of gelu(x W1), not gathered
            torch.testing.assert_close(mine["a_t"], h.detach()[:, cols], atol=ATOL, rtol=RTOL)
            # row forward: g's all-reduce adds every rank's a_t W2_t into the full z, on every rank
            torch.testing.assert_close(mine["z"], z.detach(), atol=ATOL, rtol=RTOL)
            torch.testing.assert_close(mine["a"], a.detach(), atol=ATOL, rtol=RTOL)
            # row backward: dW2_t = a_t^T dz, rows t of dW2; da_t = dz W2_t^T, columns t of dh
            torch.testing.assert_close(mine["dw2_t"], w2r.grad[cols], atol=ATOL, rtol=RTOL)
            torch.testing.assert_close(mine["da_t"], h.grad[:, cols], atol=ATOL, rtol=RTOL)
            # column backward: dW1_t = x^T dz_t, columns t of dW1; f's all-reduce gives the full dx
            torch.testing.assert_close(mine["dw1_t"], w1r.grad[:, cols], atol=ATOL, rtol=RTOL)
            torch.testing.assert_close(mine["dx"], xr.grad, atol=ATOL, rtol=RTOL)
            assert mine["none"] is None and torch.equal(mine["dw1_again"], mine["dw1_t"])


def test_f_and_g_are_conjugate_all_reduces(tmp_path):
    """f: the identity forward (column_forward sends nothing), the sum over ranks backward
    (column_backward's dx is every rank's term summed); g: the sum forward (row_forward's z),
    the identity backward (row_backward sends nothing). On 3 ranks, every term computed here."""
    spawn(_f_and_g_worker, 3, tmp_path)
    terms = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(3)]
    for got in terms:
        assert got["sent_by_identities"] == 0 and got["sent"] == 2
        torch.testing.assert_close(got["dx"], sum(t["dx_term"] for t in terms), atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(got["z"], sum(t["z_term"] for t in terms), atol=ATOL, rtol=RTOL)


def _f_and_g_worker(rank, world_size, folder):
    setup(rank, world_size)
    gen = torch.Generator().manual_seed(rank)                  # every rank's own inputs
    x, w1, g1 = torch.randn(2, 4, generator=gen), torch.randn(4, 3, generator=gen), torch.randn(2, 3, generator=gen)
    w2, g2 = torch.randn(3, 4, generator=gen), torch.randn(2, 4, generator=gen)
    sent, all_reduce = [], dist.all_reduce
    dist.all_reduce = lambda *a, **k: sent.append(a) or all_reduce(*a, **k)
    a_t, stash1 = tp.column_forward(x, w1)                     # f forward, the identity: nothing sent
    tp.row_backward(g2, (a_t, a_t @ w2), w2)                   # g backward, the identity: nothing sent
    sent_by_identities = len(sent)
    dx, _ = tp.column_backward(g1, stash1, w1)                 # f backward: every rank's term summed
    _, (_, z) = tp.row_forward(a_t, w2)                        # g forward: every rank's term summed
    dist.all_reduce = all_reduce
    dx_term, _ = dp.layer_backward(g1, stash1, w1)             # this rank's own terms
    torch.save({"dx": dx, "dx_term": dx_term, "z": z, "z_term": a_t @ w2, "sent": len(sent),
                "sent_by_identities": sent_by_identities}, folder / f"rank{rank}.pt")
    cleanup()


# ----------------------------------------------------------------------------------
# 5. The vocabulary over the ranks against nn.Embedding, a full head and F.cross_entropy
# ----------------------------------------------------------------------------------

def _vocab_case(world_size, rows=6, context=3, width=4, dim=8):
    """tokens [rows, k] that hold the first and last class of every rank's shard and repeat
    one; E [V, width], a [rows, dim], H [dim, V], targets at shard edges too."""
    gen = torch.Generator().manual_seed(world_size)
    edges = [c for t in range(world_size) for c in (tp.vocab_range(V, t, world_size)[0],
                                                    tp.vocab_range(V, t, world_size)[1] - 1)]
    tokens = torch.randint(V, (rows, context), generator=gen)
    tokens.view(-1)[:len(edges)] = torch.tensor(edges)
    tokens[-1] = 5                                                   # one token over and over
    targets = torch.tensor((edges * rows)[:rows])
    return dict(tokens=tokens, table=torch.randn(V, width, generator=gen),
                g=torch.randn(rows, context * width, generator=gen),
                a=torch.randn(rows, dim, generator=gen), head=torch.randn(dim, V, generator=gen) * 2,
                targets=targets)


def _vocab_worker(rank, world_size, case, folder, defect):
    """This rank's pieces of the vocabulary: the embedding's x and its rows' gradient, the
    head's logits_t, the loss and dlogits_t, and da; with one known defect put in, or none."""
    setup(rank, world_size)
    start, end = tp.vocab_range(V, rank, world_size)
    table_t = tp.shard(case["table"], "embedding", rank, world_size)
    head_t = tp.shard(case["head"], "head", rank, world_size)
    x, stash = tp.vocab_embedding_forward(case["tokens"], table_t, vocab_size=V)
    _, (local, g_t) = tp.vocab_embedding_backward(case["g"], stash, table_t)
    d_table_t = torch.zeros_like(table_t).index_add_(0, local.reshape(-1), g_t)
    if defect == "embedding all-reduce without its backward" and rank > 0:
        d_table_t.zero_()            # only the lookup autograd saw, rank 0's, gets a gradient
    logits_t, head_stash = tp.vocab_head_forward(case["a"], head_t)
    rows = len(case["targets"])
    if defect == "a padded class in the softmax":   # every shard padded to ceil(V / T) classes
        width = -(-V // world_size)
        logits_t = F.pad(logits_t, (0, width - logits_t.shape[1]))   # padding's logit: 0
        loss, dlogits_t = tp.vocab_parallel_cross_entropy(logits_t, case["targets"], rows,
                                                          vocab_size=width * world_size)
        dlogits_t = dlogits_t[:, :end - start]
    elif defect == "gathered logits fed to the vocab-parallel loss":   # [b, V] on every rank
        width = -(-V // world_size)
        pieces = [torch.empty(rows, width) for _ in range(world_size)]
        dist.all_gather(pieces, F.pad(logits_t, (0, width - logits_t.shape[1])))
        sizes = [e - s for s, e in (tp.vocab_range(V, t, world_size) for t in range(world_size))]
        logits = torch.cat([piece[:, :size] for piece, size in zip(pieces, sizes)], dim=1)
        loss, dlogits = tp.vocab_parallel_cross_entropy(logits, case["targets"], rows, vocab_size=V)
        dlogits_t = dlogits[:, start:end]
    else:
        loss, dlogits_t = tp.vocab_parallel_cross_entropy(logits_t, case["targets"], rows, vocab_size=V)
    da, (_, dlogits_again) = tp.vocab_head_backward(dlogits_t.contiguous(), head_stash, head_t)
    d_head_t = case["a"].T @ dlogits_again
    torch.save(dict(start=start, end=end, x=x, d_table_t=d_table_t, logits_t=logits_t, loss=loss,
                    dlogits_t=dlogits_t, da=da, d_head_t=d_head_t), folder / f"rank{rank}.pt")
    cleanup()


def assert_vocab_pieces_match_autograd(case, ranks):
    """The reference: nn.Embedding, then a @ H and F.cross_entropy on the whole vocabulary."""
    table = nn.Embedding.from_pretrained(case["table"].clone(), freeze=False)
    x = table(case["tokens"]).reshape(len(case["tokens"]), -1)
    x.backward(case["g"])
    a = case["a"].clone().requires_grad_()
    head = case["head"].clone().requires_grad_()
    logits = a @ head
    logits.retain_grad()
    loss = F.cross_entropy(logits, case["targets"])
    loss.backward()
    world_size = len(ranks)
    bounds = [(r["start"], r["end"]) for r in ranks]   # they tile [0, V), balanced to one class
    assert bounds[0][0] == 0 and bounds[-1][1] == V
    assert all(bounds[t][1] == bounds[t + 1][0] for t in range(world_size - 1))
    assert max(e - s for s, e in bounds) - min(e - s for s, e in bounds) <= 1
    for r in ranks:
        start, end = r["start"], r["end"]
        torch.testing.assert_close(r["x"], x.detach(), atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(r["d_table_t"], table.weight.grad[start:end], atol=ATOL, rtol=RTOL)
        assert r["logits_t"].shape == (len(case["targets"]), end - start)   # never gathered
        torch.testing.assert_close(r["logits_t"], logits.detach()[:, start:end], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(r["loss"], loss.detach(), atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(r["dlogits_t"], logits.grad[:, start:end], atol=1e-6, rtol=RTOL)
        torch.testing.assert_close(r["d_head_t"], head.grad[:, start:end], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(r["da"], a.grad, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_the_vocabulary_in_pieces_matches_autograd(tmp_path, world_size):
    """At V = 97: every tp > 1 has uneven shards; tokens and targets at every shard's edges."""
    case = _vocab_case(world_size)
    spawn(_vocab_worker, world_size, case, tmp_path, None)
    assert_vocab_pieces_match_autograd(case, _load_ranks(tmp_path, world_size))


DEFECTS = ["a padded class in the softmax", "gathered logits fed to the vocab-parallel loss",
           "embedding all-reduce without its backward"]


@pytest.mark.parametrize("defect", DEFECTS)
def test_each_known_defect_fails_the_comparison(tmp_path, defect):
    """The comparison above, with a defect put in, fails: Megatron #1754 (a padded class, logit 0,
    adds exp(-m) to every row's sum), #7452 (logits gathered before the vocab-parallel loss:
    the sum counts every class T times, loss + log T), and a forward all-reduce with no backward
    (the other shards' gradients stay zero)."""
    world_size = 3
    case = _vocab_case(world_size)
    spawn(_vocab_worker, world_size, case, tmp_path, defect)
    ranks = _load_ranks(tmp_path, world_size)
    with pytest.raises(AssertionError):
        assert_vocab_pieces_match_autograd(case, ranks)
    if defect == DEFECTS[1]:
        ref = F.cross_entropy(case["a"] @ case["head"], case["targets"])
        assert ranks[0]["loss"].item() != pytest.approx(ref.item(), abs=0.1)


def test_the_loss_sends_three_rows_not_the_logits(tmp_path):
    """vocab_parallel_cross_entropy's collectives: three all-reduces of [b] floats (the max,
    the sum of exps, the target's logit), where gathering the logits moves (T-1)/T [b, V]."""
    spawn(_loss_collectives_worker, 3, tmp_path)
    sent = torch.load(tmp_path / "rank0.pt")
    assert sent == [("all_reduce", (6,), "max"), ("all_reduce", (6,), "sum"), ("all_reduce", (6,), "sum")]


def _loss_collectives_worker(rank, world_size, folder):
    setup(rank, world_size)
    case = _vocab_case(world_size)
    logits_t = tp.shard(case["a"] @ case["head"], "head", rank, world_size)
    sent, all_reduce = [], dist.all_reduce

    def counted(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        sent.append(("all_reduce", tuple(tensor.shape), "max" if op == dist.ReduceOp.MAX else "sum"))
        return all_reduce(tensor, op=op, group=group, async_op=async_op)
    dist.all_reduce = counted
    try:
        tp.vocab_parallel_cross_entropy(logits_t, case["targets"], 6, vocab_size=V)
    finally:
        dist.all_reduce = all_reduce
    torch.save(sent, folder / f"rank{rank}.pt")
    cleanup()


# ----------------------------------------------------------------------------------
# 3, 4. Tensor-parallel training against serial_train; each rank's own shards
# ----------------------------------------------------------------------------------

def _spy_on_shards(monkeypatch, folder):
    """Every rank saves its shards when its replica is made (before any step) and again
    at cleanup (after training). Forked ranks inherit the patched names."""
    kept = {}
    make_replica, original_cleanup = tp.DataParallel, tp.cleanup

    def spy_replica(weights, *args, **kwargs):
        torch.save([p.detach().clone() for p in weights], folder / f"init{dist.get_rank()}.pt")
        kept["replica"] = make_replica(weights, *args, **kwargs)
        return kept["replica"]

    def spy_cleanup():
        torch.save([p.detach().clone() for p in kept["replica"].params], folder / f"final{dist.get_rank()}.pt")
        original_cleanup()

    monkeypatch.setattr(tp, "DataParallel", spy_replica)
    monkeypatch.setattr(tp, "cleanup", spy_cleanup)


def run_tp(tmp_path, monkeypatch, world_size, micro_batches=1, optimizer="sgd", flags=()):
    """tensor_parallel.main in-process; the saved dict plus each rank's init/final shards."""
    save = tmp_path / "run.pt"
    argv = ["--world-size", str(world_size), "--micro-batches", str(micro_batches),
            "--optimizer", optimizer, "--lr", str(LR[optimizer]), "--save", str(save), *flags]
    for key, value in SMALL.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    _spy_on_shards(monkeypatch, tmp_path)
    tp.main(argv)
    result = torch.load(save)
    result["init_shards"] = _load_ranks(tmp_path, world_size, "init")
    result["final_shards"] = _load_ranks(tmp_path, world_size, "final")
    return result


def init_params_of(cfg):
    args = argparse.Namespace(**cfg)
    return dp.init_params(args)


def assert_save_contract(result):
    cfg = result["config"]
    for flag in ("num_layers", "dim", "context", "vocab_size", "batch_size", "micro_batches", "steps", "lr",
                 "optimizer", "seed", "save", "check", "world_size"):
        assert flag in cfg
    L, D, k, steps = cfg["num_layers"], cfg["dim"], cfg["context"], cfg["steps"]
    for when in ("init", "final"):
        assert isinstance(result[f"{when}_weights"], list) and len(result[f"{when}_weights"]) == L
        assert all(w.shape == (D, D) and w.dtype == torch.float32 for w in result[f"{when}_weights"])
        assert result[f"{when}_embedding"].shape == (V, D // k) and result[f"{when}_head"].shape == (D, V)
    # the init is init_params exactly: drawn once, whole (not reseeded per layer or shard)
    init = init_of(result)
    assert all(torch.equal(a, b) for a, b in zip(init, init_params_of(cfg)))
    for step in range(steps):
        inputs, targets = dp.make_batch(argparse.Namespace(**cfg), step)
        assert torch.equal(result["inputs"][step], inputs) and torch.equal(result["targets"][step], targets)
    assert isinstance(result["losses"], list) and len(result["losses"]) == steps
    # losses[0] is the loss before any update: the initial model on the first batch
    first = dp.serial_loss(init, result["inputs"][0], result["targets"][0])[0].item()
    assert result["losses"][0] == pytest.approx(first, rel=1e-5)


def assert_shards_are_slices(result):
    """Rank t's shards are its classes' rows of E, columns t D/T .. of each layer (rows t D/T ..
    for a Megatron row layer, every second layer), its classes' columns of H: before and after
    training, pieces of the one full matrix."""
    cfg = result["config"]
    world_size, D, L = cfg["world_size"], cfg["dim"], cfg["num_layers"]
    init = init_params_of(cfg)
    final = final_params(result)
    kinds = ["embedding", *tp.layer_kinds(L, cfg.get("tp_style", "all-gather")), "head"]
    for t, (first, last) in enumerate(zip(result["init_shards"], result["final_shards"])):
        start, end = tp.vocab_range(V, t, world_size)
        part = _cols(t, world_size, D)
        for j, (w0, w1) in enumerate(zip(first, last)):
            want = {"embedding": lambda w: w[start:end], "head": lambda w: w[:, start:end],
                    "row": lambda w: w[part]}.get(kinds[j], lambda w: w[:, part])
            assert w0.shape == w1.shape == want(init[j]).shape
            assert torch.equal(w0, want(init[j]))
            assert torch.equal(w1, want(final[j]))          # gathered in rank order
    for j, kind in enumerate(kinds):
        whole = torch.cat([s[j] for s in result["init_shards"]], dim=0 if kind in ("row", "embedding") else 1)
        assert torch.equal(whole, init[j])


def assert_matches_serial(result):
    ref = serial_train(argparse.Namespace(**result["config"]))
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]), atol=ATOL, rtol=RTOL)
    for got, want in zip(final_params(result), final_params(ref)):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    # it trained: the weights moved far past the tolerance, and the loss fell
    init = init_of(result)
    moved = max((f - i).abs().max().item() for f, i in zip(final_params(result), init))
    assert moved > 100 * ATOL
    after = dp.serial_loss(final_params(result), result["inputs"][0], result["targets"][0])[0].item()
    assert after < result["losses"][0]       # on the first step's batch, the loss fell


@pytest.mark.parametrize("world_size,micro_batches,optimizer,style", [
    (1, 1, "sgd", "all-gather"), (2, 2, "sgd", "all-gather"), (3, 3, "sgd", "all-gather"),
    (4, 1, "sgd", "all-gather"), (2, 1, "adamw", "all-gather"), (4, 2, "adamw", "all-gather"),
    (1, 1, "sgd", "megatron"), (2, 2, "sgd", "megatron"), (4, 1, "sgd", "megatron"),
    (2, 3, "adamw", "megatron"), (4, 2, "adamw", "megatron")])
def test_tp_training_matches_serial(tmp_path, monkeypatch, world_size, micro_batches, optimizer, style):
    result = run_tp(tmp_path, monkeypatch, world_size, micro_batches, optimizer, flags=("--tp-style", style))
    cfg = result["config"]
    assert (cfg["world_size"], cfg["micro_batches"], cfg["optimizer"]) == (world_size, micro_batches, optimizer)
    assert cfg["tp_style"] == style
    assert_save_contract(result)
    assert_shards_are_slices(result)
    assert_matches_serial(result)


@pytest.mark.parametrize("num_layers", [3, 5])
def test_megatron_with_an_odd_layer_count_ends_with_an_all_gather_layer(tmp_path, monkeypatch, num_layers):
    assert tp.layer_kinds(num_layers, "megatron") == ["column", "row"] * (num_layers // 2) + ["gather"]
    monkeypatch.setitem(SMALL, "num_layers", num_layers)
    result = run_tp(tmp_path, monkeypatch, 2, 2, flags=("--tp-style", "megatron"))
    assert_shards_are_slices(result)
    assert_matches_serial(result)


# ----------------------------------------------------------------------------------
# 6. --check
# ----------------------------------------------------------------------------------

@pytest.mark.deadline(60)
def test_check_passes_from_the_command_line():
    proc = subprocess.run([sys.executable, "tensor_parallel.py", "--world-size", "2", "--steps", "3", "--check"],
                          cwd=REPO, capture_output=True, text=True, timeout=55)
    assert proc.returncode == 0, proc.stderr
    assert_check_passed(proc.stdout, dp.CHECK_TOLERANCE)


def test_check_fails_when_dx_is_not_all_reduced(tmp_path, monkeypatch, capfd):
    """Skip the all-reduce of dx everywhere: each rank backpropagates only its own term,
    training goes wrong, and --check must say FAILED and exit 1 (spawn: RankFailed)."""
    def backward_without_all_reduce(g, stash, w_t, need_dx=True, group=None):   # dx: this rank's term
        cols = w_t.shape[1]
        return dp.layer_backward(g[:, dist.get_rank(group) * cols:(dist.get_rank(group) + 1) * cols], stash, w_t,
                                 need_dx=need_dx)
    monkeypatch.setitem(tp.BLOCKS, "gather", tp.Block(tp.gather_forward, backward_without_all_reduce))
    with pytest.raises(RankFailed) as failed:
        run_tp(tmp_path, monkeypatch, 2, flags=("--check",))
    assert failed.value.rank == 0 and failed.value.stopped.startswith("check FAILED")
    figures, verdict = check_report(capfd.readouterr().out)
    assert verdict == "FAILED" and figures["gradients"][2] == "FAILED"
    saved = torch.load(tmp_path / "run.pt")   # saved before the check: really far from serial
    ref = serial_train(argparse.Namespace(**saved["config"]))
    assert max((a - b).abs().max().item() for a, b in zip(final_params(saved), final_params(ref))) > 1e-3


# ----------------------------------------------------------------------------------
# 7. Bad input: one line naming the flag, exit 2, before any rank starts
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,flag", [
    (["--dim", "30", "--world-size", "4"], "--dim"),
    (["--batch-size", "7", "--micro-batches", "2"], "--batch-size"),
    (["--world-size", "0"], "--world-size"),
    (["--steps", "0"], "--steps"),
    (["--lr", "-1"], "--lr"),
    (["--optimizer", "foo"], "--optimizer"),
    (["--num-layers", "x"], "--num-layers"),
    (["--world-size", "98", "--dim", "196", "--context", "2"], "--world-size"),   # more ranks than classes
])
def test_bad_flags_exit_2_with_one_line(argv, flag, capsys, monkeypatch):
    def no_spawn(*args, **kwargs):
        raise AssertionError("a worker started despite bad input")
    monkeypatch.setattr(tp, "spawn", no_spawn)
    with pytest.raises(SystemExit) as exited:
        tp.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and "error" in lines[0], err
    assert "Traceback" not in err


# ----------------------------------------------------------------------------------
# What real training adds: one clip over the tp shards, recompute, bf16
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("style", ["all-gather", "megatron"])
def test_clip_grad_sums_the_norm_over_the_tp_shards(tmp_path, monkeypatch, capfd, style):
    """Each rank holds disjoint columns (or rows) of every W: the norm's squares are summed
    over the tp group, or each rank would clip by its own shard's norm."""
    clip = clip_between({**SMALL, "optimizer": "sgd", "lr": LR["sgd"]})
    result = run_tp(tmp_path, monkeypatch, 3, micro_batches=2, flags=("--tp-style", style, "--clip-grad", str(clip),
                                                                     "--check"))
    out = capfd.readouterr().out
    assert_clipped_some(out)
    assert_check_passed(out, dp.CHECK_TOLERANCE)
    assert result["config"]["clip_grad"] == clip


def test_recompute_repeats_the_forward_bitwise(tmp_path, monkeypatch):
    runs = []
    for recompute in ((), ("--recompute",)):
        folder = tmp_path / str(bool(recompute))
        folder.mkdir()
        runs.append(run_tp(folder, monkeypatch, 2, micro_batches=2, flags=("--tp-style", "megatron", *recompute)))
    assert_same_bits(runs[0], runs[1])


def test_bf16_tensor_parallel_checks_within_its_tolerance(tmp_path, monkeypatch, capfd):
    """bf16 activations cross the tp ranks (all-gathers, and all-reduces summed in bf16 by
    gloo, which takes bf16 for every collective here: nothing is sent as int16 bits)."""
    run_tp(tmp_path, monkeypatch, 3, micro_batches=2, flags=("--bf16", "--check", "--tp-style", "megatron"))
    assert_check_passed(capfd.readouterr().out, dp.bf16_tolerance())


@pytest.mark.parametrize("style", ["all-gather", "megatron"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_recompute_keeps_each_layers_input_and_the_peak_falls_by_the_formula(style, world_size):
    """--recompute keeps each layer's input: an all-gather layer's x [b, D] (its z_t [b, D/T]
    made again in its backward), a Megatron column layer's x [b, D] and row layer's a_t
    [b, D/T] (z [b, D] made again, with g's all-reduce). The stash at its largest, counted from
    the tensors alive (tests/stash_check.py), is the sum of the x's, not of (x, z), beside the
    ends' (the embedding's token ids and mask, the head's input [b, D]); the step's peak, at
    the head's backward, falls by every layer's z."""
    L, D, B, m, t, k = 8, 16, 256, 2, world_size, 4
    argv = ["--world-size", str(t), "--num-layers", str(L), "--dim", str(D), "--batch-size", str(B),
            "--micro-batches", str(m), "--tp-style", style, "--optimizer", "sgd", "--context", str(k)]
    plain = stash_and_peak("tensor_parallel", argv)
    recompute = stash_and_peak("tensor_parallel", [*argv, "--recompute"])
    b = B // m
    A = b * D * 4                                        # [b, D], on every tp rank
    kinds = tp.layer_kinds(L, style)
    x = [A // t if kind == "row" else A for kind in kinds]
    z = [A if kind == "row" else A // t for kind in kinds]
    ends = A + b * k * (8 + 1)                           # a; the int64 ids and the bool mask
    assert plain[0] == sum(x) + sum(z) + ends and recompute[0] == sum(x) + ends
    assert plain[1] - recompute[1] == sum(z)
