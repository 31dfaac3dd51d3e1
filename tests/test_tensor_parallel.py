"""Tests for tensor_parallel.py: every number is compared with a single-process reference.

- A transformer block split over the ranks (forked, T = 1..3), in both styles, with and
  without --recompute: its output, dx and every weight's gradient against autograd on the
  whole block; a head split off its boundaries fails the comparison; f and g conjugate.
- The vocabulary split over the ranks against nn.Embedding, a full head and F.cross_entropy:
  the embedding's outputs and gradients (tokens at every shard edge, repeated tokens), the
  logits never gathered, the loss and dlogits in pieces, at V = 97 (no T > 1 divides it);
  and the three known defects (a padded class in the softmax, gathered logits fed to the
  vocab-parallel loss, the embedding's all-reduce without its backward) each fail it.
- Tensor-parallel training (in-process main(), ranks forked) against serial_train, over
  world sizes, micro-batches and optimizers; the --save contract; each rank's own shards.
- Known from-scratch bugs stay gone: shards are slices of one matrix, dW_t is [D, D/T].
- --recompute's stash and peak, counted, against each block's formula.
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
import pipeline_parallel
import tensor_parallel as tp
from collectives import RankFailed, cleanup, setup, spawn
from stash_check import stash_and_peak
from common import (NO_SAMPLE, serial_train, assert_follows_the_contract, assert_check_passed, assert_clipped_some, assert_same_bits, check_report, clip_between,
                    final_params, init_of)

REPO = Path(__file__).resolve().parent.parent

# Float32, differences only from summation order.
ATOL = 1e-5
RTOL = 1e-5

# A small model that trains quickly and stays far from chaos. h = G = 12 heads divide by 1, 2, 3, 4
# ranks (tests of fewer kv heads give --kv-heads); F = 48 by all; B = 12 by micro-batch counts 1-4.
SMALL = {"num_layers": 4, "dim": 24, "heads": 12, "kv_heads": 12, "context": 4, "batch_size": 12, "steps": 4,
         "seed": 3}
V = dp.VOCAB_SIZE
LR = {"sgd": 0.1, "adamw": 0.01}


def _load_ranks(folder, world_size, prefix="rank"):
    """Every rank's saved file, in rank order (a missing one fails the test)."""
    return [torch.load(folder / f"{prefix}{r}.pt") for r in range(world_size)]


def _cols(rank, world_size, dim):
    n = dim // world_size
    return slice(rank * n, (rank + 1) * n)


# ----------------------------------------------------------------------------------
# 1, 2. A block split over the ranks, in both styles, against autograd on the whole
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_column_shards_are_copies_that_tile_the_matrix(world_size):
    """The shards tile W in rank order, and training one in place leaves W alone, also at
    T = 1 (a view of W there once made the saved init weights equal the final ones)."""
    w = torch.randn(6, 6, generator=torch.Generator().manual_seed(2))
    before = w.clone()
    shards = [tp.shard(w, "column", t, world_size) for t in range(world_size)]
    assert all(s.shape == (6, 6 // world_size) and s.is_contiguous() for s in shards)
    assert torch.equal(torch.cat(shards, dim=1), w)
    for s in shards:
        s.add_(1.0)
    assert torch.equal(w, before)


BLOCK = {"dim": 12, "heads": 6, "rows": 2, "context": 5}   # dh = 2; 1, 2, 3 ranks hold whole heads


def off_the_head_boundaries(w, kind, tp_rank, tp_size, kv_heads):
    """A defect: every tp_size-th column (a row layer: row) from tp_rank, so that a rank holds
    pieces of every head, not whole heads; the rest as shard() cuts it."""
    if kind == "column":
        return w[:, tp_rank::tp_size].contiguous()
    if kind == "row":
        return w[tp_rank::tp_size].contiguous()
    return tp.shard(w, kind, tp_rank, tp_size, kv_heads)


def _block_worker(rank, world_size, weights, x, dout, case, defect, folder):
    """Step 2's block on this rank's shards with this style's split: its output, dx, and each
    weight's dW from its (x, dz), the partial ones summed as tp_worker sums them (QK-norm's
    gains over tp; G < tp, a kv head's Wk, Wv over its holders)."""
    setup(rank, world_size)
    style, kv_heads, qk_norm, recompute = case
    args = argparse.Namespace(tp_style=style, kv_heads=kv_heads, qk_norm=qk_norm, experts=0)
    kinds = tp.tensor_kinds(["block"], args, world_size)[0]
    cut = off_the_head_boundaries if defect == "off the head boundaries" else tp.shard
    shards = [cut(w, kind, rank, world_size, kv_heads) for w, kind in zip(weights, kinds)]
    if defect == "W3 from another slice of F":    # the up projection's columns not the gate's
        shards[-2] = tp.shard(weights[-2], "column", (rank + 1) % world_size, world_size)
    holders = tp.kv_group(kv_heads, world_size)
    split = tp.GatherSplit(None) if style == "all-gather" else tp.MegatronSplit(None)
    head_dim = BLOCK["dim"] // BLOCK["heads"]
    shape = dict(head_dim=head_dim, rope=dp.rope_table(torch.arange(BLOCK["context"]), head_dim,
                                                      10000.0), qk_norm=qk_norm, split=split)
    out, stash = dp.block_forward(x, shards, recompute=recompute, **shape)
    dx, terms = dp.block_backward(dout, stash, shards, **shape)
    grads = [dz if a is None else a.flatten(0, -2).T @ dz.flatten(0, -2) for a, dz in terms]
    partial = tp.split_as(kinds, "partial")
    if defect == "QK-norm's gains averaged over tp":
        for i in partial:
            dist.all_reduce(grads[i], op=dist.ReduceOp.AVG)
    elif defect != "QK-norm's gains left unsummed":
        tp.sum_partial_grads(grads, partial, None)
    if holders is not None and defect != "a kv head's gradient left unsummed":
        tp.sum_partial_grads(grads, tp.split_as(kinds, "kv"), holders)
    torch.save(dict(out=out, dx=dx, grads=grads), folder / f"rank{rank}.pt")
    cleanup()


def run_block(tmp_path, world_size, case, defect=None):
    """(every rank's results, the whole block's weights, x, and autograd's out, dx, dWs)."""
    from test_transformer import autograd_block, random_block
    style, kv_heads, qk_norm, recompute = case
    gen = torch.Generator().manual_seed(7)
    weights = random_block(BLOCK["dim"], BLOCK["heads"], kv_heads, BLOCK["ffn"], qk_norm, seed=3)
    weights = [w.float() for w in weights]
    x = torch.randn(BLOCK["rows"], BLOCK["context"], BLOCK["dim"], generator=gen)
    dout = torch.randn(BLOCK["rows"], BLOCK["context"], BLOCK["dim"], generator=gen)
    spawn(_block_worker, world_size, weights, x, dout, case, defect, tmp_path)
    whole = [w.double().requires_grad_() for w in weights]
    xr = x.double().requires_grad_()
    out = autograd_block(xr, whole, BLOCK["dim"] // BLOCK["heads"], qk_norm)
    out.backward(dout.double())
    return (_load_ranks(tmp_path, world_size), weights, out.detach().float(), xr.grad.float(),
            [w.grad.float() for w in whole], case)


def assert_block_matches(ranks, weights, out, dx, grads, case):
    """Every rank: the whole output and dx; each weight's gradient, its own shard's (a gain's
    whole, the same on every rank with no collective; a kv head's and QK-norm's, summed)."""
    world_size = len(ranks)
    style, kv_heads, qk_norm, _ = case
    args = argparse.Namespace(tp_style=style, kv_heads=kv_heads, qk_norm=qk_norm, experts=0)
    kinds = tp.tensor_kinds(["block"], args, world_size)[0]
    for t, r in enumerate(ranks):
        torch.testing.assert_close(r["out"], out, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(r["dx"], dx, atol=ATOL, rtol=RTOL)
        for got, want, kind, name in zip(r["grads"], grads, kinds, dp.block_names(qk_norm)):
            torch.testing.assert_close(got, tp.shard(want, kind, t, world_size, kv_heads),
                                       atol=ATOL, rtol=RTOL,
                                       msg=lambda msg: f"rank {t} {name}: {msg}")


BLOCK = {"dim": 16, "heads": 4, "ffn": 12, "rows": 2, "context": 5}   # dh = 4; tp 1, 2, 4
CASES = [  # (world size, kv heads, --qk-norm, --recompute): G above, at and below tp
    (1, 2, False, False), (2, 2, False, False), (2, 4, True, True), (4, 2, True, False),
    (4, 1, False, True), (2, 1, True, False)]


@pytest.mark.parametrize("style", ["all-gather", "megatron"])
@pytest.mark.parametrize("world_size,kv_heads,qk_norm,recompute", CASES)
def test_a_block_split_over_the_ranks_matches_autograd(tmp_path, world_size, style, kv_heads,
                                                       qk_norm, recompute):
    """Heads as tp's unit: Wq cut at head boundaries, Wk, Wv at kv heads (G < tp: each kv head's
    whole on the tp/G ranks that read it, its gradient summed over them), attention on whole
    heads with no collective; W1, W3 on the same F/tp columns; Megatron's Wo and W2 row layers (g
    after), or every weight a column layer with its output all-gathered; QK-norm's gains summed
    over tp. --recompute: the forward again, its collectives too."""
    case = (style, kv_heads, qk_norm, recompute)
    assert_block_matches(*run_block(tmp_path, world_size, case))


@pytest.mark.parametrize("world_size,case,defect", [
    (2, ("all-gather", 2, False, False), "off the head boundaries"),
    (2, ("megatron", 2, False, False), "off the head boundaries"),
    (4, ("megatron", 2, False, False), "a kv head's gradient left unsummed"),
    (4, ("all-gather", 1, False, False), "a kv head's gradient left unsummed"),
    (2, ("megatron", 2, False, False), "W3 from another slice of F"),
    (2, ("all-gather", 2, False, False), "W3 from another slice of F"),
    (2, ("megatron", 2, True, False), "QK-norm's gains averaged over tp"),
    (2, ("megatron", 2, True, False), "QK-norm's gains left unsummed")])
def test_each_defect_of_a_split_block_fails_the_comparison(tmp_path, world_size, case, defect):
    """Columns dealt round the ranks (each holds pieces of every head: its softmax mixes
    columns that are no head's); a replicated kv head's Wk, Wv gradient left on its holders
    (each holds its own query heads' part); W3's columns from another F/tp slice than W1's
    (Megatron #360: silu(a_t) then multiplies the wrong up); QK-norm's gains averaged over tp
    (1/tp of the gradient, Megatron #816) or left unsummed."""
    with pytest.raises(AssertionError):
        assert_block_matches(*run_block(tmp_path, world_size, case, defect))


def test_f_and_g_are_conjugate_all_reduces(tmp_path):
    """Megatron's f: the identity forward (nothing sent), the sum over ranks backward (f_back);
    g: the sum forward, the identity backward (g_back); a row layer's dx, and the
    heads' gather, send nothing. On 3 ranks, every term computed here."""
    spawn(_f_and_g_worker, 3, tmp_path)
    terms = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(3)]
    for got in terms:
        assert got["sent_by_identities"] == 0 and got["sent"] == 2
        torch.testing.assert_close(got["dx"], sum(t["term"] for t in terms), atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(got["y"], sum(t["term"] for t in terms), atol=ATOL, rtol=RTOL)


def _f_and_g_worker(rank, world_size, folder):
    setup(rank, world_size)
    term = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(rank))   # every rank's own
    split = tp.MegatronSplit(None)
    sent, all_reduce = [], dist.all_reduce
    dist.all_reduce = lambda *a, **k: sent.append(a) or all_reduce(*a, **k)
    for identity in (split.gather, split.gather_back, split.g_back, split.row_back):
        assert torch.equal(identity(term.clone()), term)
    sent_by_identities = len(sent)
    dx = split.f_back(term.clone())                            # f backward: summed
    y = split.g(term.clone())                                # g forward: summed
    dist.all_reduce = all_reduce
    torch.save({"dx": dx, "y": y, "term": term, "sent": len(sent),
                "sent_by_identities": sent_by_identities}, folder / f"rank{rank}.pt")
    cleanup()


# ----------------------------------------------------------------------------------
# 5. The vocabulary over the ranks against nn.Embedding, a full head and F.cross_entropy
# ----------------------------------------------------------------------------------

def _vocab_case(world_size, rows=6, context=3, width=4):
    """tokens [rows, T] that hold the first and last class of every rank's shard and repeat
    one; E [V, width], x [rows, T, width], the final gain, H [width, V], targets
    [rows, T] at shard edges too."""
    gen = torch.Generator().manual_seed(world_size)
    edges = [c for t in range(world_size) for c in (tp.vocab_range(V, t, world_size)[0],
                                                    tp.vocab_range(V, t, world_size)[1] - 1)]
    tokens = torch.randint(V, (rows, context), generator=gen)
    tokens.view(-1)[:len(edges)] = torch.tensor(edges)
    tokens[-1] = 5                                                   # one token over and over
    targets = torch.tensor((edges * rows * context)[:rows * context]).view(rows, context)
    return dict(tokens=tokens, table=torch.randn(V, width, generator=gen),
                g=torch.randn(rows, context, width, generator=gen),
                x=torch.randn(rows, context, width, generator=gen), gain=torch.randn(width, generator=gen),
                head=torch.randn(width, V, generator=gen) * 2, targets=targets)


def _vocab_worker(rank, world_size, case, folder, defect):
    """This rank's pieces of the vocabulary: the embedding's x and its rows' gradient, the
    head's logits_t, the loss and dlogits_t, and dx; with one known defect put in, or none."""
    setup(rank, world_size)
    start, end = tp.vocab_range(V, rank, world_size)
    table_t = tp.shard(case["table"], "embedding", rank, world_size)
    head_t = tp.shard(case["head"], "head", rank, world_size)
    args = argparse.Namespace(tp_style="megatron", sequence_parallel=False, cp_layout="zigzag", dim=2, heads=1,
                              rope_theta=1.0, qk_norm=False, vocab_size=V)
    embedding, block, head = tp.tp_blocks(["embedding", "block", "head"], args,
                                          positions=torch.arange(case["tokens"].shape[1]))
    x, stash = embedding.forward(case["tokens"], [table_t])
    _, [(local, g_t)] = embedding.backward(case["g"], stash, [table_t])
    d_table_t = torch.zeros_like(table_t).index_add_(0, local.reshape(-1), g_t.flatten(0, 1))
    if defect == "embedding all-reduce without its backward" and rank > 0:
        d_table_t.zero_()            # only the lookup autograd saw, rank 0's, gets a gradient
    logits_t, head_stash = head.forward(case["x"], [case["gain"], head_t])
    rows = case["targets"].numel()
    if defect == "a padded class in the softmax":   # every shard padded to ceil(V / T) classes
        width = -(-V // world_size)
        logits_t = F.pad(logits_t, (0, width - logits_t.shape[1]))   # padding's logit: 0
        loss, dlogits_t = tp.vocab_parallel_cross_entropy(logits_t, case["targets"], rows,
                                                          vocab_size=width * world_size)
        dlogits_t = dlogits_t[:, :end - start]
    elif defect == "gathered logits fed to the vocab-parallel loss":   # [b T, V] on every rank
        width = -(-V // world_size)
        pieces = [torch.empty(rows, width) for _ in range(world_size)]
        dist.all_gather(pieces, F.pad(logits_t, (0, width - logits_t.shape[1])))
        sizes = [e - s for s, e in (tp.vocab_range(V, t, world_size) for t in range(world_size))]
        logits = torch.cat([piece[:, :size] for piece, size in zip(pieces, sizes)], dim=1)
        loss, dlogits = tp.vocab_parallel_cross_entropy(logits, case["targets"], rows, vocab_size=V)
        dlogits_t = dlogits[:, start:end]
    else:
        loss, dlogits_t = tp.vocab_parallel_cross_entropy(logits_t, case["targets"], rows, vocab_size=V)
    dx, [(_, d_gain), (n, dlogits_again)] = head.backward(dlogits_t.contiguous(), head_stash,
                                                          [case["gain"], head_t])
    d_head_t = n.flatten(0, 1).T @ dlogits_again
    torch.save(dict(start=start, end=end, x=x, d_table_t=d_table_t,
                    logits_t=logits_t, loss=loss, dlogits_t=dlogits_t, dx=dx, d_gain=d_gain,
                    d_head_t=d_head_t), folder / f"rank{rank}.pt")
    cleanup()


def assert_vocab_pieces_match_autograd(case, ranks):
    """The reference: nn.Embedding, then rmsnorm(x; g) H and F.cross_entropy on the whole
    vocabulary."""
    table = nn.Embedding.from_pretrained(case["table"].clone(), freeze=False)
    embedded = table(case["tokens"])
    embedded.backward(case["g"])
    x, gain, head = (case[k].clone().requires_grad_() for k in ("x", "gain", "head"))
    logits = (F.rms_norm(x, gain.shape, gain, dp.EPS) @ head).flatten(0, 1)
    logits.retain_grad()
    loss = F.cross_entropy(logits, case["targets"].reshape(-1))
    loss.backward()
    world_size = len(ranks)
    bounds = [(r["start"], r["end"]) for r in ranks]   # they tile [0, V), balanced to one class
    assert bounds[0][0] == 0 and bounds[-1][1] == V
    assert all(bounds[t][1] == bounds[t + 1][0] for t in range(world_size - 1))
    assert max(e - s for s, e in bounds) - min(e - s for s, e in bounds) <= 1
    for r in ranks:
        start, end = r["start"], r["end"]
        torch.testing.assert_close(r["x"], embedded.detach(), atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(r["d_table_t"], table.weight.grad[start:end], atol=ATOL, rtol=RTOL)
        assert r["logits_t"].shape == (case["targets"].numel(), end - start)   # never gathered
        torch.testing.assert_close(r["logits_t"], logits.detach()[:, start:end], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(r["loss"], loss.detach(), atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(r["dlogits_t"], logits.grad[:, start:end], atol=1e-6, rtol=RTOL)
        torch.testing.assert_close(r["d_head_t"], head.grad[:, start:end], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(r["d_gain"], gain.grad, atol=ATOL, rtol=RTOL)   # whole, alike
        torch.testing.assert_close(r["dx"], x.grad, atol=ATOL, rtol=RTOL)


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
        ref = F.cross_entropy((F.rms_norm(case["x"], (4,), case["gain"], dp.EPS) @ case["head"]).flatten(0, 1),
                              case["targets"].reshape(-1))
        assert ranks[0]["loss"].item() != pytest.approx(ref.item(), abs=0.1)


def test_the_loss_sends_three_rows_not_the_logits(tmp_path):
    """vocab_parallel_cross_entropy's collectives: three all-reduces of [b T] floats (the max,
    the sum of exps, the target's logit), where gathering the logits moves (T-1)/T [b T, V]."""
    spawn(_loss_collectives_worker, 3, tmp_path)
    sent = torch.load(tmp_path / "rank0.pt")
    assert sent == [("all_reduce", (18,), "max"), ("all_reduce", (18,), "sum"), ("all_reduce", (18,), "sum")]


def _loss_collectives_worker(rank, world_size, folder):
    setup(rank, world_size)
    case = _vocab_case(world_size)
    logits_t = tp.shard((case["x"] @ case["head"]).flatten(0, 1), "head", rank, world_size)
    sent, all_reduce = [], dist.all_reduce

    def counted(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        sent.append(("all_reduce", tuple(tensor.shape), "max" if op == dist.ReduceOp.MAX else "sum"))
        return all_reduce(tensor, op=op, group=group, async_op=async_op)
    dist.all_reduce = counted
    try:
        tp.vocab_parallel_cross_entropy(logits_t, case["targets"], 18, vocab_size=V)
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

    def spy_replica(parts, *args, **kwargs):
        torch.save([p.detach().clone() for part in parts for p in part], folder / f"init{dist.get_rank()}.pt")
        kept["replica"] = make_replica(parts, *args, **kwargs)
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
            "--optimizer", optimizer, "--lr", str(LR[optimizer]), "--save", str(save), *NO_SAMPLE]
    for key, value in SMALL.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    argv += flags                          # (a flag given twice: the later wins)
    _spy_on_shards(monkeypatch, tmp_path)
    tp.main(argv)
    result = torch.load(save)
    result["init_shards"] = _load_ranks(tmp_path, world_size, "init")
    result["final_shards"] = _load_ranks(tmp_path, world_size, "final")
    return result


def init_params_of(cfg):
    return dp.tensors_of(dp.init_params(argparse.Namespace(**cfg)))


def assert_save_contract(result):
    assert_follows_the_contract(result, flags=("world_size", "tp_style"))
    # losses[0] is the loss before any update: the initial model on the first batch
    cfg = result["config"]
    first = dp.serial_loss(init_of(result), result["inputs"][0], result["targets"][0],
                           argparse.Namespace(**cfg))[0].item()
    assert result["losses"][0] == pytest.approx(first, rel=1e-5)


def assert_shards_are_slices(result):
    """Rank t's shards are its classes' rows of E, its columns (whole heads) of Wq, Wk, Wv, W1,
    W3 (and of Wo, W2 in the all-gather style; their rows in Megatron's), its classes' columns of
    H, the gains whole: before and after training, pieces of the one full tensor."""
    cfg = result["config"]
    world_size = cfg["world_size"]
    init = init_params_of(cfg)
    final = final_params(result)
    kinds = dp.tensors_of(tp.tensor_kinds(tp.part_kinds(cfg["num_layers"]), argparse.Namespace(**cfg),
                                          world_size))
    G = cfg["kv_heads"]
    for t, (first, last) in enumerate(zip(result["init_shards"], result["final_shards"])):
        for j, (w0, w1) in enumerate(zip(first, last)):
            assert torch.equal(w0, tp.shard(init[j], kinds[j], t, world_size, G))
            assert torch.equal(w1, tp.shard(final[j], kinds[j], t, world_size, G))   # gathered in rank order
    for j, kind in enumerate(kinds):
        if kind not in ("whole", "partial", "kv"):
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
    cfg = result["config"]
    after = dp.serial_loss(final_params(result), result["inputs"][0], result["targets"][0],
                           argparse.Namespace(**cfg))[0].item()
    assert after < result["losses"][0]       # on the first step's batch, the loss fell


@pytest.mark.parametrize("world_size,micro_batches,optimizer,style,kv_heads", [
    (1, 1, "sgd", "all-gather", 4), (2, 2, "sgd", "all-gather", 6), (3, 3, "sgd", "all-gather", 3),
    (4, 1, "sgd", "all-gather", 2), (2, 1, "adamw", "all-gather", 1), (4, 2, "adamw", "all-gather", 12),
    (1, 1, "sgd", "megatron", 1), (2, 2, "sgd", "megatron", 4), (4, 1, "sgd", "megatron", 1),
    (2, 3, "adamw", "megatron", 6), (4, 2, "adamw", "megatron", 2)])
def test_tp_training_matches_serial(tmp_path, monkeypatch, capfd, world_size, micro_batches, optimizer, style,
                                    kv_heads):
    """G above, at and below tp (below: each kv head's Wk, Wv on the tp/G ranks that read it). SGD:
    the whole run against serial training's; AdamW, whose eps makes a near-0 gradient's summation
    order a step: --check, a step at a time from the run's own weights."""
    check = ("--check",) if optimizer == "adamw" else ()
    result = run_tp(tmp_path, monkeypatch, world_size, micro_batches, optimizer,
                    flags=("--tp-style", style, "--kv-heads", str(kv_heads), *check))
    cfg = result["config"]
    assert (cfg["world_size"], cfg["micro_batches"], cfg["optimizer"]) == (world_size, micro_batches, optimizer)
    assert cfg["tp_style"] == style
    assert_save_contract(result)
    assert_shards_are_slices(result)
    if check:
        assert_check_passed(capfd.readouterr().out, dp.CHECK_TOLERANCE)
    else:
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
    """Skip f's all-reduce of dx everywhere: each rank backpropagates only its own term,
    training goes wrong, and --check must say FAILED and exit 1 (spawn: RankFailed)."""
    monkeypatch.setattr(tp.MegatronSplit, "f_back", lambda self, dx: dx)   # the style's too
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
    (["--world-size", "98", "--dim", "196", "--heads", "98", "--ffn-dim", "196"], "--world-size"),   # more ranks
    (["--heads", "4", "--kv-heads", "3"], "--kv-heads"),                                              # than classes
    (["--dim", "24", "--heads", "12", "--kv-heads", "6", "--world-size", "4"], "--kv-heads 6 and --world-size"),
    (["--world-size", "4", "--ffn-dim", "30"], "--ffn-dim"),
    (["--dim", "24", "--heads", "8"], "--heads 8 = 3 columns a head"),                      # RoPE's pairs
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
@pytest.mark.parametrize("world_size,model", [(3, dict(heads=12, kv_heads=3)),
                                              (4, dict(heads=4, kv_heads=2, qk_norm=True))])
def test_clip_grad_sums_the_norm_over_the_tp_shards(tmp_path, monkeypatch, capfd, style, world_size, model):
    """Each rank holds disjoint columns (or rows) of every W: the norm's squares are summed
    over the tp group, or each rank would clip by its own shard's norm; a tensor every rank
    holds whole (a gain, QK-norm's) counted once, and a kv head's Wk, Wv once over its holders.
    QK-norm at dh 6: over dh 2 a head's norm divides by the RMS of two values, which turned
    float32's summation order into 0.76 of the tolerance, 1.04 with attention's one-pass
    forward; 0.006 at dh 6."""
    clip = clip_between({**SMALL, **model, "optimizer": "sgd", "lr": LR["sgd"]})
    flags = ["--heads", str(model["heads"]), "--kv-heads", str(model["kv_heads"]),
             *(["--qk-norm"] if model.get("qk_norm") else [])]
    result = run_tp(tmp_path, monkeypatch, world_size, micro_batches=2,
                    flags=("--tp-style", style, "--clip-grad", str(clip), "--check", *flags))
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
@pytest.mark.parametrize("world_size,flags", [(2, ()), (4, ("--kv-heads", "1", "--qk-norm"))])
def test_recompute_keeps_each_blocks_input_and_the_peak_falls_by_the_formula(style, world_size,
                                                                             flags):
    """--recompute keeps each block's input x [b, T, D], whole on every tp rank, where a block
    otherwise keeps x, n1, x', n2 whole; q by t, k and v its G/t kv heads (G < t: one, dh wide);
    o and u = silu(a) up by t, or gathered whole in the all-gather style; a and up [b, T, F/t];
    r1, r2 and lse by t (--qk-norm: q and k before their norms, and their r). The stash at its
    largest, counted from the tensors alive (tests/stash_check.py), is that beside the ends' (the
    embedding's local ids and mask, the head's x, n and r), and pipeline_parallel.block_stash's;
    the step's peak falls by the difference but for the one block whose backward makes its
    stash again."""
    L, D, h, B, m, t, T = 4, 16, 4, 32, 2, world_size, 4
    argv = ["--world-size", str(t), "--num-layers", str(L), "--dim", str(D), "--heads", str(h),
            "--batch-size", str(B), "--micro-batches", str(m), "--tp-style", style, "--optimizer", "sgd",
            "--context", str(T), *flags]
    plain = stash_and_peak("tensor_parallel", argv)
    recompute = stash_and_peak("tensor_parallel", [*argv, "--recompute"])
    args = tp.parse_args(argv)
    b = B // m
    G, F, dh = args.kv_heads, args.ffn_dim, D // h
    A = b * T * D * 4                                    # [b, T, D], on every tp rank
    K = b * T * max(G // t, 1) * dh * 4                  # a rank's k, v
    M = b * T * F // t * 4                               # a, up
    gathered = t if style == "all-gather" else 1         # o, u whole
    r = b * T * 4
    lse = b * h // t * T * 4
    kept = 4 * A + A // t + 2 * K + A // t * gathered + 2 * M + M * gathered + 2 * r + lse
    if args.qk_norm:                                     # q, k before their norms; r_q, r_k
        kept += A // t + K + lse + b * T * max(G // t, 1) * 4
    ends = 2 * A + b * T * 4 + b * T * (8 + 1)           # the head's x, n, r; int64 ids, bool mask
    assert kept == pipeline_parallel.block_stash(args, b, t)[0]
    assert plain[0] == L * kept + ends and recompute[0] == L * A + ends
    assert (L - 1) * (kept - A) <= plain[1] - recompute[1] <= L * (kept - A)


# ----------------------------------------------------------------------------------
# Sequence parallelism: the residual stream and its norms split along T
# ----------------------------------------------------------------------------------

SEQUENCE = ("--tp-style", "megatron", "--sequence-parallel")


@pytest.mark.parametrize("world_size,micro_batches,optimizer,flags", [
    (2, 2, "sgd", ()), (4, 1, "sgd", ("--kv-heads", "2", "--qk-norm")), (4, 3, "adamw", ()),
    (2, 1, "sgd", ("--recompute", "--kv-heads", "1"))])
def test_sequence_parallel_training_matches_serial(tmp_path, monkeypatch, capfd, world_size, micro_batches,
                                                   optimizer, flags):
    """T = 4 positions split over 2 or 4 ranks: every loss and final weight equal to serial
    training's (AdamW: --check, a step at a time); the gains whole on every rank, their gradients
    summed over tp; RoPE at the whole T's places (q, k made after f's all-gather)."""
    check = ("--check",) if optimizer == "adamw" else ()
    result = run_tp(tmp_path, monkeypatch, world_size, micro_batches, optimizer,
                    flags=(*SEQUENCE, *flags, *check))
    assert result["config"]["sequence_parallel"] and result["config"]["tp_style"] == "megatron"
    assert_save_contract(result)
    assert_shards_are_slices(result)
    if check:
        assert_check_passed(capfd.readouterr().out, dp.CHECK_TOLERANCE)
    else:
        assert_matches_serial(result)


def sums_dropped(grads, whole, group):
    pass


def sums_averaged(grads, whole, group):    # gpt-neox's: the mean over tp, 1/t of the gradient
    for i in whole:
        tp.reduce_over(grads[i], group)
        grads[i] /= dist.get_world_size(group)


def scatter_along_D(x, group):             # the reduce-scatter along D, viewed as T's shard
    b, T, D = x.shape
    mine = REAL_SCATTER(x.transpose(1, 2), group).transpose(1, 2)     # [b, T, D/t]
    return mine.reshape(b, T // dist.get_world_size(group), D)


REAL_SUM = tp.sum_partial_grads
REAL_SCATTER = tp.scatter_along_T
SP_DEFECTS = [("sum_partial_grads", sums_dropped), ("sum_partial_grads", sums_averaged),
              ("scatter_along_T", scatter_along_D)]


@pytest.mark.parametrize("name,defect", SP_DEFECTS, ids=[d.__name__ for _, d in SP_DEFECTS])
def test_each_sequence_parallel_defect_fails_the_check(tmp_path, monkeypatch, capfd, name, defect):
    """The field's bugs (Megatron #1446, gpt-neox #1259): the gains' sum over tp dropped, or a
    mean in its place; the reduce-scatter taken along D. Each run's --check says FAILED and the
    run exits 1."""
    monkeypatch.setattr(tp, name, defect)
    with pytest.raises(RankFailed) as failed:
        run_tp(tmp_path, monkeypatch, 2, flags=(*SEQUENCE, "--check"))
    assert (failed.value.stopped or "").startswith("check FAILED"), str(failed.value)
    assert check_report(capfd.readouterr().out)[1] == "FAILED"


@pytest.mark.parametrize("argv,words", [
    (["--sequence-parallel"], "--sequence-parallel: needs --tp-style megatron"),
    (["--sequence-parallel", "--tp-style", "megatron", "--context", "6"],
     "--sequence-parallel: --context 6 is not divisible by --world-size (4)")])
def test_sequence_parallel_refuses_what_it_cannot_split(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        tp.parse_args(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and words in err, err


@pytest.mark.parametrize("world_size", [2, 4])
def test_sequence_parallel_holds_the_norm_regions_by_t(world_size):
    """A block's stash under sequence parallelism: x, x' and the norms' r by 1/t (their T/t rows),
    n1 and n2 whole (gathered along T, the column layers' inputs), the rest as Megatron's (q, o,
    a, up, u by 1/t; k, v the rank's kv heads); Megatron's own holds x, n1, x', n2 and r whole.
    --recompute keeps x alone: A/t a block. The stash counted from the tensors alive
    (tests/stash_check.py) equals the formula."""
    L, D, h, B, m, t, T = 4, 16, 4, 32, 2, world_size, 4
    argv = ["--world-size", str(t), "--num-layers", str(L), "--dim", str(D), "--heads", str(h),
            "--batch-size", str(B), "--micro-batches", str(m), "--optimizer", "sgd", "--context", str(T),
            "--tp-style", "megatron"]
    megatron = stash_and_peak("tensor_parallel", argv)
    sequence = stash_and_peak("tensor_parallel", [*argv, "--sequence-parallel"])
    recompute = stash_and_peak("tensor_parallel", [*argv, "--sequence-parallel", "--recompute"])
    b = B // m
    A = b * T * D * 4
    K = b * T * max(2 // t, 1) * (D // h) * 4  # a rank's k, v: G = 2 kv heads
    M = b * T * 48 // t * 4                    # a, up, u: F = 48
    r = 2 * b * T * 4
    attention = b * h * T * 4 // t             # lse [b, h/t, T]
    kept_megatron = 4 * A + 2 * A // t + 2 * K + 3 * M + r + attention
    kept = 2 * A + 4 * A // t + 2 * K + 3 * M + r // t + attention
    ends = A // t + A + b * T * 4 // t + b * T * (8 + 1)   # the head's x (T/t), n (gathered), r
    assert megatron[0] == L * kept_megatron + 2 * A + b * T * 4 + b * T * 9
    assert sequence[0] == L * kept + ends
    assert recompute[0] == L * A // t + ends
    # what sequence parallelism saves, counted: x, x' and r of every block, the head's x and r, by t
    assert megatron[0] - sequence[0] == (L * (2 * A + r) + A + b * T * 4) * (t - 1) // t
