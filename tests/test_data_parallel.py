"""Tests for data_parallel.py: every number is compared with a single-process reference.

- The hand-derived blocks (gelu', layer backward, MSE) against autograd.
- init_weights and make_batch against the generator they are defined by.
- serial_train against an independent torch.nn reference.
- Data-parallel training (in-process main(), ranks forked) against serial_train, over
  world sizes, micro-batches, optimizers, --overlap and --shuffle.
- --check passes on a correct run and fails on a broken one; bad flags exit 2.
"""
import math
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
from collectives import RankFailed
from stash_check import stash_and_peak
from common import (serial_train, ATOL, RTOL, assert_check_passed, assert_clipped_some, assert_same_bits, check_report, clip_between,
                    gelu_grad, model_forward)

REPO = Path(__file__).resolve().parent.parent

# Float32, differences only from summation order.
ATOL = 1e-5
RTOL = 1e-5

# A small model that trains quickly and stays far from chaos: lr 0.1, few layers.
SMALL = {"num_layers": 4, "dim": 16, "steps": 4, "lr": 0.1, "seed": 3}

SHAPES = [(1, 1, 1), (3, 5, 7), (8, 16, 16), (4, 64, 32)]   # (batch, D_in, D_out)


def tanh_gelu_grad(z):
    """Derivative of gelu(approximate="tanh"): the formula a known from-scratch implementation wrongly pairs with the erf GELU."""
    c = math.sqrt(2.0 / math.pi)
    u = c * (z + 0.044715 * z ** 3)
    t = torch.tanh(u)
    return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * c * (1 + 3 * 0.044715 * z * z)


def autograd_gelu_grad(z, approximate="none"):
    z = z.detach().clone().requires_grad_()
    F.gelu(z, approximate=approximate).sum().backward()
    return z.grad


def _gelu_points():
    """The grid the gelu tests use: dense near 0 plus large |z| on both sides."""
    return torch.cat([torch.linspace(-8, 8, 2001),
                      torch.tensor([-1e4, -300.0, -50.0, -20.0, -10.0, 10.0, 20.0, 50.0, 300.0, 1e4])])


# ----------------------------------------------------------------------------------
# 1. The hand-derived blocks against autograd
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gelu_grad_matches_autograd_of_erf_gelu(dtype):
    z = _gelu_points().to(dtype)
    mine, ref = gelu_grad(z), autograd_gelu_grad(z)
    assert torch.isfinite(mine).all()
    torch.testing.assert_close(mine, ref, atol=1e-6 if dtype == torch.float32 else 1e-12, rtol=1e-6)
    # and against the closed form in float64, computed independently of both
    z64 = z.double()
    exact = 0.5 * (1 + torch.erf(z64 / math.sqrt(2))) + z64 * torch.exp(-z64 * z64 / 2) / math.sqrt(2 * math.pi)
    torch.testing.assert_close(mine.double(), exact, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_fused_kernel_the_step_runs_is_g_times_the_formula(dtype):
    """layer_backward runs torch.ops.aten.gelu_backward(g, z) for dz = g * gelu'(z): the
    same numbers as the written formula, on both tails and at zero, and not the tanh
    GELU's (its own approximate='tanh' variant)."""
    z = _gelu_points().to(dtype)
    g = torch.randn(z.shape, generator=torch.Generator().manual_seed(0), dtype=dtype)
    fused = torch.ops.aten.gelu_backward(g, z)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(fused, g * gelu_grad(z), **tol)
    tanh = torch.ops.aten.gelu_backward(g, z, approximate="tanh")
    assert (tanh - g * gelu_grad(z)).abs().max() > 1e-4


def test_tanh_derivative_would_fail_the_gelu_test():
    """The tanh formula is the derivative of the tanh GELU, not of the erf GELU we run:
    the comparison above would reject it (the tanh-derivative bug)."""
    z = _gelu_points().double()
    tanh = tanh_gelu_grad(z)
    # the helper is right for what it claims to be ...
    torch.testing.assert_close(tanh, autograd_gelu_grad(z, approximate="tanh"), atol=1e-12, rtol=1e-10)
    # ... and it is wrong for the erf GELU, by far more than the tolerance used above
    gap = (tanh - autograd_gelu_grad(z)).abs().max().item()
    assert gap > 5e-4                       # ~8.7e-4 near |z| = 2.2; the tolerance is 1e-6
    assert not torch.allclose(tanh.float(), autograd_gelu_grad(z.float()), atol=1e-6, rtol=1e-6)


def _layer_inputs(b, d_in, d_out, scale, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, d_in, generator=gen, dtype=dtype) * scale
    w = torch.randn(d_in, d_out, generator=gen, dtype=dtype) * math.sqrt(2.0 / d_in)
    g = torch.randn(b, d_out, generator=gen, dtype=dtype)
    return x, w, g


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scale", [1.0, 30.0])   # 30: |z| up to ~100, both tails of gelu'
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_layer_forward_and_backward_match_autograd(shape, scale, dtype):
    b, d_in, d_out = shape
    x, w, g = _layer_inputs(b, d_in, d_out, scale, dtype)
    a, stash = dp.layer_forward(x, w)
    dx, (x_again, dz) = dp.layer_backward(g, stash, w)
    dw = x_again.T @ dz                                     # dW = x^T dz, as the replica sums it

    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ar = F.gelu(xr @ wr)
    ar.backward(g)

    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-10, rtol=1e-10)
    if scale > 1:   # large |z| really happened
        assert (stash[1].abs() > 8).any()
    assert stash[0] is x and torch.equal(stash[1], x @ w)   # the stash is (input, pre-activation)
    assert a.shape == (b, d_out) and dx.shape == (b, d_in) and dw.shape == (d_in, d_out)
    torch.testing.assert_close(a, ar.detach(), **tol)
    torch.testing.assert_close(dx, xr.grad, **tol)
    torch.testing.assert_close(dw, wr.grad, **tol)


def test_layer_backward_with_tanh_derivative_would_fail():
    """The same comparison catches the tanh derivative in a real layer."""
    x, w, g = _layer_inputs(8, 16, 16, 1.0, torch.float64)
    _, (_, z) = dp.layer_forward(x, w)
    dz_wrong = g * tanh_gelu_grad(z)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    F.gelu(xr @ wr).backward(g)
    assert (x.T @ dz_wrong - wr.grad).abs().max() > 1e-4


@pytest.mark.parametrize("shape", SHAPES)
def test_mse_loss_matches_autograd(shape):
    b, _, d = shape
    gen = torch.Generator().manual_seed(1)
    a, y = torch.randn(b, d, generator=gen), torch.randn(b, d, generator=gen)
    loss, grad = dp.mse_loss(a, y, a.numel())

    ar = a.clone().requires_grad_()
    ref = F.mse_loss(ar, y, reduction="mean")
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad, ar.grad, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("sizes", [[1, 2, 5], [4, 4], [8], [1] * 8])
def test_mse_loss_pieces_sum_to_whole_batch_mean(sizes):
    """Pieces of a batch, each divided by the whole batch's element count, sum to the mean."""
    gen = torch.Generator().manual_seed(2)
    a, y = torch.randn(sum(sizes), 12, generator=gen), torch.randn(sum(sizes), 12, generator=gen)
    n = a.numel()
    pieces = [dp.mse_loss(ap, yp, n) for ap, yp in zip(a.split(sizes), y.split(sizes))]

    ar = a.clone().requires_grad_()
    ref = F.mse_loss(ar, y)
    ref.backward()
    torch.testing.assert_close(sum(p[0] for p in pieces), ref.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(torch.cat([p[1] for p in pieces]), ar.grad, atol=1e-7, rtol=1e-6)
    if len(sizes) > 1:   # dividing each piece by its own size would be wrong
        own = sum(dp.mse_loss(ap, yp, ap.numel())[0] for ap, yp in zip(a.split(sizes), y.split(sizes)))
        assert abs(own.item() - ref.item()) > 1e-3


def test_full_model_backward_matches_autograd():
    """Chained layer_backward through model_forward and the MSE: the whole hand-made gradient."""
    weights = [w.double() for w in dp.init_weights(5, 12, seed=4)]
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 12, generator=gen, dtype=torch.float64)
    y = torch.randn(6, 12, generator=gen, dtype=torch.float64)
    out, stashes = model_forward(weights, x)
    loss, g = dp.mse_loss(out, y, out.numel())
    grads = [None] * len(weights)
    for i in reversed(range(len(weights))):
        g, (x_i, dz) = dp.layer_backward(g, stashes[i], weights[i])
        grads[i] = x_i.T @ dz

    ref_w = [w.clone().requires_grad_() for w in weights]
    h = x
    for w in ref_w:
        h = F.gelu(h @ w)
    ref = F.mse_loss(h, y)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), atol=1e-12, rtol=1e-10)
    for mine, w in zip(grads, ref_w):
        torch.testing.assert_close(mine, w.grad, atol=1e-12, rtol=1e-9)


# ----------------------------------------------------------------------------------
# 2. init_weights and make_batch
# ----------------------------------------------------------------------------------

def test_init_weights_is_one_generator_in_layer_order():
    L, D, seed = 4, 24, 7
    weights = dp.init_weights(L, D, seed)
    gen = torch.Generator().manual_seed(seed)   # the reference: one generator, drawn in order
    ref = [torch.randn(D, D, generator=gen) * math.sqrt(2.0 / D) for _ in range(L)]
    assert len(weights) == L
    for w, r in zip(weights, ref):
        assert w.shape == (D, D) and w.dtype == torch.float32
        assert torch.equal(w, r)
    # never reseeded per layer: every layer differs from every other
    for i in range(L):
        for j in range(i + 1, L):
            assert (weights[i] - weights[j]).abs().max() > 0.1
    # same seed -> bitwise the same, on every rank that calls it; another seed -> different
    assert all(torch.equal(a, b) for a, b in zip(weights, dp.init_weights(L, D, seed)))
    assert all((a - b).abs().max() > 0.1 for a, b in zip(weights, dp.init_weights(L, D, seed + 1)))
    # a shorter model is a prefix: layer l does not depend on how many layers follow
    assert all(torch.equal(a, b) for a, b in zip(weights[:2], dp.init_weights(2, D, seed)))


def test_init_weights_shards_are_slices_of_one_matrix():
    """What a tensor-parallel rank t of T keeps: columns t*D/T .. of the full matrix. Each
    rank draws the full matrices itself; the pieces must tile the one full matrix."""
    L, D, T, seed = 3, 16, 4, 11
    full = dp.init_weights(L, D, seed)
    for layer in range(L):
        shards = [dp.init_weights(L, D, seed)[layer][:, t * D // T:(t + 1) * D // T] for t in range(T)]
        assert torch.equal(torch.cat(shards, dim=1), full[layer])
        # a rank that drew its shard from a reseeded generator would get another matrix
        reseeded = (torch.randn(D, D // T, generator=torch.Generator().manual_seed(seed)) * math.sqrt(2.0 / D))
        assert not torch.equal(shards[0], reseeded)


def test_init_weights_scale_is_sqrt_2_over_d():
    D = 512
    w = torch.cat([x.reshape(-1) for x in dp.init_weights(2, D, seed=0)])   # 524288 samples
    target = math.sqrt(2.0 / D)
    assert abs(w.std().item() / target - 1) < 0.01      # the std's own spread here is ~0.1 %
    assert abs(w.mean().item()) < 5 * target / math.sqrt(w.numel())
    assert abs(w.std().item() * math.sqrt(D) - 1) > 0.3                # not the 1/sqrt(D) scale


def test_make_batch_is_a_teacher_of_the_same_shape():
    args = dp.training_parser("t").parse_args(["--num-layers", "3", "--dim", "8", "--batch-size", "6",
                                               "--seed", "5"])
    inputs, targets = dp.make_batch(args)
    ref_x = torch.randn(6, 8, generator=torch.Generator().manual_seed(7))
    teacher = nn.Sequential(*[m for w in dp.init_weights(3, 8, 6) for m in (_linear(w), nn.GELU())])
    assert torch.equal(inputs, ref_x)
    torch.testing.assert_close(targets, teacher(ref_x).detach(), atol=1e-6, rtol=1e-6)
    # the teacher is not the student: the loss starts away from zero
    out, _ = model_forward(dp.init_weights(3, 8, 5), inputs)
    assert F.mse_loss(out, targets) > 1e-2


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
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return dp.training_parser("t").parse_args(argv)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_serial_train_matches_torch_nn(optimizer):
    args = _args(optimizer=optimizer, lr=0.1 if optimizer == "sgd" else 0.01)
    layers = [_linear(w) for w in dp.init_weights(args.num_layers, args.dim, args.seed)]
    model = nn.Sequential(*[m for layer in layers for m in (layer, nn.GELU())])
    inputs, targets = dp.make_batch(args)
    opt_cls = torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW
    opt = opt_cls(model.parameters(), lr=args.lr)
    losses = []
    for _ in range(args.steps):
        loss = nn.MSELoss()(model(inputs), targets)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()

    got = serial_train(args)
    assert len(got["losses"]) == args.steps
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses), atol=1e-6, rtol=1e-6)
    for w, layer in zip(got["final_weights"], layers):
        torch.testing.assert_close(w, layer.weight.detach().T, atol=1e-6, rtol=1e-6)
    _assert_trained(got["final_weights"], dp.init_weights(args.num_layers, args.dim, args.seed))


def _assert_trained(final, init):
    """The weights moved far more than the tolerance: a gradient scale error would show."""
    moved = max((f - i).abs().max().item() for f, i in zip(final, init))
    assert moved > 100 * ATOL


# ----------------------------------------------------------------------------------
# 4, 5. Data-parallel training against serial_train
# ----------------------------------------------------------------------------------

REPLICA_DRIFT = dp.replica_drift


def _spy_on_replicas(folder):
    """Wrap replica_drift so every rank also saves its own final weights (forked ranks
    inherit the wrapper): the tests can then compare the replicas themselves."""
    def spy(weights, group=None):
        torch.save([w.detach().cpu().clone() for w in weights], folder / f"rank{dist.get_rank()}.pt")
        return REPLICA_DRIFT(weights, group)
    return spy


def run_dp(tmp_path, monkeypatch, world_size, batch_size=8, micro_batches=1, optimizer="sgd",
           lr=None, flags=(), **overrides):
    """Run data_parallel.main in-process (ranks are forked from here); return the saved
    dict, with each rank's final weights under "replicas"."""
    cfg = {**SMALL, **overrides}
    if lr is None:
        lr = cfg["lr"] if optimizer == "sgd" else 0.01
    save = tmp_path / "run.pt"
    argv = ["--world-size", str(world_size), "--batch-size", str(batch_size),
            "--micro-batches", str(micro_batches), "--optimizer", optimizer, "--lr", str(lr),
            "--num-layers", str(cfg["num_layers"]), "--dim", str(cfg["dim"]),
            "--steps", str(cfg["steps"]), "--seed", str(cfg["seed"]), "--save", str(save), *flags]
    monkeypatch.setattr(dp, "replica_drift", _spy_on_replicas(tmp_path))
    dp.main(argv)
    result = torch.load(save)
    result["replicas"] = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]
    return result


def serial_for(config):
    args = dp.training_parser("t").parse_args([])
    for key, value in config.items():
        setattr(args, key, value)
    return serial_train(args)


def assert_matches_serial(result):
    cfg = result["config"]
    ref = serial_for(cfg)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]),
                               atol=ATOL, rtol=RTOL)
    for got, want in zip(result["final_weights"], ref["final_weights"]):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    _assert_trained(result["final_weights"], result["init_weights"])


def assert_replicas_identical(result):
    assert result["replica_max_diff"] == 0.0
    first = result["replicas"][0]
    for other in result["replicas"][1:]:
        assert all(torch.equal(a, b) for a, b in zip(first, other))
    assert all(torch.equal(a, b) for a, b in zip(first, result["final_weights"]))


@pytest.mark.parametrize("world_size,batch_size,micro_batches", [
    (1, 8, 1), (2, 8, 1), (2, 8, 4), (3, 24, 2), (4, 16, 2)])
def test_dp_sgd_matches_serial(tmp_path, monkeypatch, world_size, batch_size, micro_batches):
    result = run_dp(tmp_path, monkeypatch, world_size, batch_size, micro_batches)
    assert_matches_serial(result)
    assert_replicas_identical(result)


def test_dp_save_contents(tmp_path, monkeypatch):
    result = run_dp(tmp_path, monkeypatch, 2, batch_size=8, micro_batches=2)
    cfg = result["config"]
    for flag in ("num_layers", "dim", "batch_size", "micro_batches", "steps", "lr", "optimizer",
                 "seed", "save", "check", "world_size", "overlap", "shuffle"):
        assert flag in cfg
    assert (cfg["world_size"], cfg["batch_size"], cfg["micro_batches"], cfg["optimizer"]) == (2, 8, 2, "sgd")
    assert (cfg["num_layers"], cfg["dim"], cfg["steps"], cfg["lr"], cfg["seed"]) == \
        (SMALL["num_layers"], SMALL["dim"], SMALL["steps"], SMALL["lr"], SMALL["seed"])
    assert cfg["save"] == str(tmp_path / "run.pt") and cfg["check"] is False

    L, D = SMALL["num_layers"], SMALL["dim"]
    for key in ("init_weights", "final_weights"):
        assert isinstance(result[key], list) and len(result[key]) == L
        assert all(w.shape == (D, D) and w.dtype == torch.float32 for w in result[key])
    assert all(torch.equal(a, b) for a, b in zip(result["init_weights"], dp.init_weights(L, D, SMALL["seed"])))
    args = dp.training_parser("t").parse_args([])
    vars(args).update(cfg)
    inputs, targets = dp.make_batch(args)
    assert torch.equal(result["inputs"], inputs) and torch.equal(result["targets"], targets)
    assert result["inputs"].shape == (8, D)
    assert isinstance(result["losses"], list) and len(result["losses"]) == SMALL["steps"]
    # losses[0] is the loss before any update: the initial model on the whole batch
    out, _ = model_forward(result["init_weights"], inputs)
    assert result["losses"][0] == pytest.approx(F.mse_loss(out, targets).item(), rel=1e-5)
    assert_matches_serial(result)


def test_dp_adamw_matches_serial(tmp_path, monkeypatch):
    result = run_dp(tmp_path, monkeypatch, 4, batch_size=16, micro_batches=2, optimizer="adamw")
    assert result["config"]["optimizer"] == "adamw"
    assert_matches_serial(result)
    assert_replicas_identical(result)


@pytest.mark.parametrize("flags", [("--overlap",), ("--shuffle",), ("--overlap", "--shuffle")])
def test_dp_overlap_and_shuffle_match_serial(tmp_path, monkeypatch, flags):
    result = run_dp(tmp_path, monkeypatch, 4, batch_size=16, micro_batches=2, flags=flags)
    assert all(result["config"][f[2:]] for f in flags)
    assert_matches_serial(result)
    assert_replicas_identical(result)


# ZeRO: (world size, stage, micro-batches, optimizer, --overlap). Every stage at world
# sizes 1 to 4; 3 replicas of D = 16 pad every layer (256 = 3 x 85 + 1); both optimizers;
# micro-batches 1 to 4; --overlap, which starts reduce-scatters during the backward.
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
    assert all(w.shape == (SMALL["dim"], SMALL["dim"]) for w in result["final_weights"])   # full, gathered
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


def test_buckets_are_runs_of_layers_from_the_last_within_the_cap():
    """Cut from the last layer; the first bucket (the last layers') holds 1 MB at most, the
    others bucket_mb; a layer larger than the cap is a bucket alone; 0: a layer each; no
    bucket spans the start of a chunk."""
    mb = 2**20 // 4                                   # floats in 1 MB

    def buckets(*args, **kwargs):
        return dp.make_buckets(*args, **kwargs).buckets
    assert buckets([mb // 4] * 8, 25) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert buckets([mb // 4] * 8, 0.5) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert buckets([4 * mb] * 3, 25) == [[0, 1], [2]]       # 4 MB: alone past the first 1 MB
    assert buckets([10] * 4, 0) == [[0], [1], [2], [3]]
    assert buckets([10] * 8, 25, chunk_starts=range(0, 8, 4)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert buckets([10] * 6, 25, chunk_starts=range(0, 6, 2)) == [[0, 1], [2, 3], [4, 5]]
    # and where each layer sits: its bucket, its offset in it, each bucket's length
    layout = dp.make_buckets([3, 5, 7, 11], 0.5)
    assert (layout.bucket_of, layout.offset, layout.lengths) == ({0: 0, 1: 0, 2: 0, 3: 0},
                                                                 {0: 0, 1: 3, 2: 8, 3: 15}, [26])


MEMORY_ROW = re.compile(r"^  (weights|gradients|optimizer state|total)\s+(\d+) bytes\s+formula (.+?)\s*= +([\d.]+)$")


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("optimizer,bucket_mb", [("adamw", "0"), ("sgd", "0"), ("adamw", "25")])
def test_memory_each_replica_holds_is_the_formula(tmp_path, monkeypatch, capfd, zero, optimizer, bucket_mb):
    """What one replica holds at the end of a step, counted from its tensors, is ZeRO's
    formula: 16P, 8P + 8P/d, 4P + 12P/d, 16P/d bytes with AdamW (4 + 4 + 0 with SGD). With 3
    replicas and D = 16 each bucket is padded: a layer a bucket, from 256 to 3 x 86 = 258
    parameters; the whole model in one bucket (25 MB), from 4 x 256 to 3 x 342 = 1026.
    ZeRO-3 is at its largest at a unit's gather, while the unit before is in use: the shards
    and two units, whole."""
    run_dp(tmp_path, monkeypatch, 3, batch_size=12, micro_batches=2, optimizer=optimizer,
           flags=("--zero", str(zero), "--bucket-mb", bucket_mb))
    out = capfd.readouterr().out
    rows = {m[1]: (int(m[2]), m[3], float(m[4])) for m in map(MEMORY_ROW.match, out.splitlines()) if m}
    L, d = SMALL["num_layers"], 3
    unit, units = (258, L) if bucket_mb == "0" else (1026, 1)
    P = unit * units if zero else L * 256
    adam = 8 if optimizer == "adamw" else 0
    want = {0: (4 * P, 4 * P, adam * P), 1: (4 * P, 4 * P, adam * P / d), 2: (4 * P, 4 * P / d, adam * P / d),
            3: (4 * P / d, 4 * P / d, adam * P / d)}[zero]
    assert [rows[k][0] for k in ("weights", "gradients", "optimizer state")] == list(want)
    assert rows["total"][0] == sum(want) and rows["total"][2] == sum(want)
    assert all(rows[k][0] == rows[k][2] for k in rows), rows
    if zero == 3:
        peak = re.search(r"largest at any moment of the last step: (\d+) bytes", out)
        assert int(peak[1]) == sum(want) + 4 * unit * min(units, 2)


def test_gradient_scale_micro_batches_and_replicas(tmp_path, monkeypatch):
    """Summed over micro-batches, averaged over replicas once: m=4 equals m=1, dp=2 equals dp=1.
    Averaging per micro-batch, or overwriting instead of accumulating, changes the step size."""
    runs = {}
    for world_size, micro_batches in [(1, 1), (1, 4), (2, 1), (2, 4)]:
        folder = tmp_path / f"dp{world_size}m{micro_batches}"
        folder.mkdir()
        runs[world_size, micro_batches] = run_dp(folder, monkeypatch, world_size, 8, micro_batches)
    base = runs[1, 1]
    _assert_trained(base["final_weights"], base["init_weights"])
    for key, result in runs.items():
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(base["losses"]),
                                   atol=ATOL, rtol=RTOL, msg=lambda m: f"{key}: {m}")
        for got, want in zip(result["final_weights"], base["final_weights"]):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m: f"{key}: {m}")


# ----------------------------------------------------------------------------------
# 6. replica_rows
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dp_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("shuffle", [False, True])
def test_replica_rows_partition_the_batch(dp_size, shuffle):
    batch_size = 24
    per = batch_size // dp_size
    for step in range(3):
        slices = [dp.replica_rows(batch_size, d, dp_size, step if shuffle else None, seed=5)
                  for d in range(dp_size)]
        assert all(len(s) == per for s in slices)          # no empty slice on any replica
        assert sorted(torch.cat(slices).tolist()) == list(range(batch_size))   # each row exactly once
        if not shuffle:   # replica d takes block d, by its dp rank
            for d, s in enumerate(slices):
                assert s.tolist() == list(range(d * per, (d + 1) * per))
        # every rank computes the same thing for a given dp rank (no per-rank randomness)
        again = [dp.replica_rows(batch_size, d, dp_size, step if shuffle else None, seed=5)
                 for d in range(dp_size)]
        assert all(torch.equal(a, b) for a, b in zip(slices, again))


def test_replica_rows_shuffle_changes_with_step_and_seed():
    whole = lambda step, seed: dp.replica_rows(64, 0, 1, step, seed)   # noqa: E731
    assert not torch.equal(whole(0, 0), whole(1, 0))
    assert not torch.equal(whole(0, 0), whole(0, 1))
    assert not torch.equal(whole(0, 0), torch.arange(64))


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
    worst = max((a - b).abs().max().item() for a, b in zip(saved["final_weights"], ref["final_weights"]))
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
    assert bf16[-1] < bf16[0] / 2 and (bf16 - fp32).abs().max() < dp.bf16_tolerance()
    assert all(w.dtype == torch.float32 for w in runs[True]["final_weights"])   # the masters, saved


BF16_MEMORY = {0: (2, 4, 12, 1, 1, 1), 1: (2, 4, 12, 1, 1, 3), 2: (2, 4, 12, 1, 3, 3), 3: (0, 4, 12, 1, 3, 3)}


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_bf16_memory_is_2_4_12_bytes_a_parameter_split_by_zero(tmp_path, monkeypatch, capfd, zero):
    """As held: 2 bytes of bf16 weights (none at stage 3 but while gathered), 4 of fp32
    gradients, 12 of fp32 master weights and AdamW's moments; ZeRO splits them as ever."""
    run_dp(tmp_path, monkeypatch, 3, batch_size=12, micro_batches=2, optimizer="adamw",
           flags=("--zero", str(zero), "--bucket-mb", "0", "--bf16"))
    rows = {m[1]: (int(m[2]), float(m[4])) for m in map(MEMORY_ROW.match, capfd.readouterr().out.splitlines()) if m}
    P = SMALL["num_layers"] * (258 if zero else 256)
    weights, grads, state, *split = BF16_MEMORY[zero]
    want = [weights * P / split[0], grads * P / split[1], state * P / split[2]]
    assert [rows[k][0] for k in ("weights", "gradients", "optimizer state")] == want
    assert rows["total"] == (sum(want), sum(want))


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_recompute_keeps_each_layers_input_and_the_peak_falls_by_the_formula(zero):
    """--recompute keeps each layer's x, not (x, z): a micro-batch's stash at its largest is
    L [b, D], not 2 L, counted from the tensors alive (tests/stash_check.py); a layer's backward
    makes its z again, so the step's peak, at the last layer's backward, falls by the z of every
    layer but that one: (L - 1) [b, D]. With ZeRO's every stage. (In bf16 the step peaks at
    the loss instead, where its fp32 copies of the output outweigh a z.)"""
    L, D, B, m, d = 8, 16, 256, 2, 2
    argv = ["--world-size", str(d), "--num-layers", str(L), "--dim", str(D), "--batch-size", str(B),
            "--micro-batches", str(m), "--zero", str(zero), "--optimizer", "sgd"]
    plain = stash_and_peak("data_parallel", argv)
    recompute = stash_and_peak("data_parallel", [*argv, "--recompute"])
    A = B // (d * m) * D * 4                             # [b, D]
    assert plain[0] == 2 * L * A and recompute[0] == L * A
    assert plain[1] - recompute[1] == (L - 1) * A
