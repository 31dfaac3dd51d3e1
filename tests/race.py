"""The timing machinery of make bench: run sides of a comparison on the same ranks,
check that they compute the same thing, and time them taking turns.

A side is (step, state): step() runs one training step, state() returns (weights,
grads) in our layout [D, D/T], or state is None for a side that is timed but not
compared (the serial reference). Made for a shared, noisy machine: warm-up rounds
first, then rounds in which every side runs once, so that a slow spell hits every side
alike; a side's figure is the median over the rounds of its slowest rank's time.
"""
import gc
import os
import pickle
import platform
import shutil
import statistics
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch._dynamo  # noqa: E402, F401  (the ranks' optimizers import it: once, before forking)
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from collectives import cleanup, pick_backend, spawn, under_torchrun  # noqa: E402
from data_parallel import (CHECK_TOLERANCE, cross_entropy, dp_step, init_params,  # noqa: E402
                           make_batch, make_replica, model_blocks)

WARMUP = 2


def spawn_returning(fn, world_size, *args, **launch):
    """spawn(), and return what fn returned on rank 0. Under torchrun, what it returned on
    this rank (a bench's results are all-reduced: the same on every rank)."""
    if under_torchrun():
        results = []
        spawn(lambda rank, size, *more: results.append(fn(rank, size, *more)), world_size, *args, **launch)
        return results[0]
    folder = tempfile.mkdtemp(prefix="parallel-result-")
    path = os.path.join(folder, "rank0.pickle")
    try:
        spawn(_save_rank0, world_size, fn, path, *args, **launch)
        with open(path, "rb") as f:
            return pickle.load(f)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _save_rank0(rank, world_size, fn, path, *args):
    # pickle, not torch.save: in a forked child torch.save after the parent's torch.load
    # once hung (a lock held at fork time); the results are plain numbers anyway
    result = fn(rank, world_size, *args)
    if rank == 0:
        with open(path, "wb") as f:
            pickle.dump(result, f)


def race(sides, device, warmup=None, repeats=5):
    """Time one call of each side, the sides taking turns; {name: seconds}. Every call
    starts on all ranks at once (a barrier) and ends when the slowest rank is done. A
    side may do nothing on some ranks (the serial reference runs on rank 0 alone)."""
    warmup = WARMUP if warmup is None else warmup
    times = torch.zeros(len(sides), repeats, dtype=torch.float64)
    for i in range(warmup + repeats):
        for j, run in enumerate(sides.values()):
            dist.barrier()
            start = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)   # NCCL calls return before the GPU is done
            if i >= warmup:
                times[j, i - warmup] = time.perf_counter() - start
    times = times.to(device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return {name: statistics.median(row) for name, row in zip(sides, times.tolist())}


def check_and_race(sides, device, steps):
    """Step every side once from the same weights and compare its gradients with ours
    (the first side); time `steps` more of each, taking turns; then compare the weights,
    which every side has now stepped equally often.
    Returns ({name: seconds}, {name: largest difference from ours, or None})."""
    ours = next(iter(sides.values()))[1]
    compared = {name: state for name, (_, state) in sides.items() if state is not None and state is not ours}
    for step, _ in sides.values():
        step()
    diffs = dict.fromkeys(sides)
    diffs.update({name: largest_difference(ours()[1], state()[1]) for name, state in compared.items()})
    times = race({name: step for name, (step, _) in sides.items()}, device, repeats=steps)
    for name, state in compared.items():
        diffs[name] = max(diffs[name], largest_difference(ours()[0], state()[0]))
    return times, diffs


def largest_difference(ours, theirs):
    """max |a - b| over two lists of tensors, over every rank."""
    diff = torch.zeros((), device=ours[0].device)
    for a, b in zip(ours, theirs):
        diff = torch.maximum(diff, (a.detach() - b.detach()).abs().max())
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff.item()


def end_race(sides):
    """Free every side, then leave the group. In this order: a DDP freed after the group
    is destroyed joins gloo's threads while holding the GIL, and can hang for good."""
    sides.clear()
    gc.collect()
    cleanup()


def print_race(result):
    """The table: each side's step time, speed-up over serial and difference from ours,
    then ours / theirs. Exit 1 if a side computed something else. Under torchrun, rank 0
    prints it."""
    if under_torchrun() and os.environ["RANK"] != "0":
        return
    times, diffs, world_size = result["times"], result["diffs"], result["world_size"]
    serial = next(name for name in times if name.startswith("serial"))
    cores = os.cpu_count()
    ideal = world_size if pick_backend(world_size) == "nccl" else min(world_size, cores)
    title, *more = result["title"].split("\n")
    print(title)
    for line in more:
        print(textwrap.fill(line, 110, subsequent_indent="    ", break_on_hyphens=False))
    print(f"  median of {result['steps']} steps after {WARMUP} warm-up, the sides taking turns; "
          f"speed-up: serial / side, ideal {ideal}x ({world_size} ranks, {cores} cores)\n"
          f"  difference: largest |ours - theirs| in the first step's gradients and in the weights after "
          f"{WARMUP + result['steps'] + 1} steps")
    print(f"  {'side':<50}{'step (ms)':>10}{'speed-up':>14}  difference")
    for name, seconds in times.items():
        diff, speedup = diffs[name], times[serial] / seconds
        verdict = "-" if diff is None else f"{diff:.1e} {'same' if diff <= CHECK_TOLERANCE else 'DIFFERENT'}"
        gain = "" if name == serial else f"{speedup:.2f}x {speedup / ideal:>4.0%}"
        print(f"  {name:<50}{seconds * 1e3:>10.2f}{gain:>14}  {verdict}")
    for ours, theirs in result["ratios"]:
        print(f"  {ours} / {theirs}: {times[ours] / times[theirs]:.2f}x")
    for note in result.get("notes", []):
        print(textwrap.fill(note, 110, initial_indent="  ", subsequent_indent="    ", break_on_hyphens=False))
    print(flush=True)
    if any(diff is not None and diff > CHECK_TOLERANCE for diff in diffs.values()):
        raise SystemExit("error: a side computed something other than ours; its time compares nothing")


def machine():
    """One line that names this machine, printed under every bench table."""
    cpu = platform.processor() or "unknown CPU"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpus = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "none"
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    return (f"machine: {cores} CPU cores ({cpu}), GPU: {gpus}, torch {torch.__version__}, "
            f"Python {platform.python_version()}{load}")


# ---- pieces every step's comparison uses ---------------------------------------------

class TorchEmbedding(torch.nn.Module):
    """E as nn.Embedding: x = E[tokens] (positions are RoPE's, in the blocks)."""

    def __init__(self, e, device):
        super().__init__()
        self.embedding = torch.nn.Embedding(*e.shape, device=device)
        with torch.no_grad():
            self.embedding.weight.copy_(e)

    def forward(self, tokens):
        return self.embedding(tokens)

    def ours(self):   # its parameters in our order, and whether each is held transposed
        return [(self.embedding.weight, False)]


def linear(w, device):   # nn.Linear computes x @ weight.T, so it holds W^T
    module = torch.nn.Linear(*w.shape, bias=False, device=device)
    with torch.no_grad():
        module.weight.copy_(w.T)
    return module


def rms_norm(g, device):
    module = torch.nn.RMSNorm(len(g), eps=1e-5, device=device)
    with torch.no_grad():
        module.weight.copy_(g)
    return module


class TorchBlock(torch.nn.Module):
    """A pre-norm Llama block: nn.RMSNorm, nn.Linear(bias=False), RoPE as Meta's Llama code writes
    it (each pair a complex number, times e^(i m theta_i)), causal scaled_dot_product_attention
    with enable_gqa over the heads its Linears give it (a tp rank's own, once they are split:
    torchtitan's way), --qk-norm's norms, SwiGLU. written: attention as our CPU path's maths (S,
    its causal softmax, A v) under autograd, in place of the fused kernel: a race like for like."""

    def __init__(self, w, args, device, written=False):
        super().__init__()
        self.written = written
        names = ["g1", "wq", "wk", "wv", *["gq", "gk"] * args.qk_norm, "wo", "g2", "w1", "w3", "w2"]
        w = dict(zip(names, w))
        self.head_dim = args.dim // args.heads
        self.norm1, self.norm2 = rms_norm(w["g1"], device), rms_norm(w["g2"], device)
        self.qk_norms = torch.nn.ModuleList(rms_norm(w[g], device) for g in ("gq", "gk") if g in w)
        self.wq, self.wk, self.wv, self.wo, self.w1, self.w3, self.w2 = (
            linear(w[name], device) for name in ("wq", "wk", "wv", "wo", "w1", "w3", "w2"))
        i = torch.arange(self.head_dim // 2, dtype=torch.float64)
        angles = torch.arange(args.context, dtype=torch.float64)[:, None] * args.rope_theta ** (
            -2 * i / self.head_dim)
        self.register_buffer("turn", torch.polar(torch.ones_like(angles), angles).to(device))

    def rope(self, t):   # [b, T, n, dh], in fp32
        pairs = torch.view_as_complex(t.float().unflatten(-1, (-1, 2)).contiguous())
        turned = pairs * self.turn[:t.shape[1], None].to(pairs.dtype)
        return torch.view_as_real(turned).flatten(-2).to(t.dtype)

    def forward(self, x):
        n = self.norm1(x)
        q, k, v = (layer(n).unflatten(-1, (-1, self.head_dim)) for layer in (self.wq, self.wk, self.wv))
        if self.qk_norms:
            q, k = self.qk_norms[0](q), self.qk_norms[1](k)
        q, k, v = (t.transpose(1, 2) for t in (self.rope(q), self.rope(k), v))   # [b, n, T, dh]
        if self.written:     # each kv head repeated for its group, as enable_gqa reads it
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
            s = q @ k.transpose(-1, -2) / self.head_dim**0.5   # the mask added, as ours adds it
            s = s + torch.full(s.shape[-2:], float("-inf"), device=s.device).triu(1)
            o = s.softmax(-1) @ v
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(o.transpose(1, 2).flatten(-2))
        n = self.norm2(x)
        return x + self.w2(F.silu(self.w1(n)) * self.w3(n))

    def ours(self):
        return [(self.norm1.weight, False), *[(m.weight, True) for m in (self.wq, self.wk, self.wv)],
                *[(norm.weight, False) for norm in self.qk_norms], (self.wo.weight, True),
                (self.norm2.weight, False), *[(m.weight, True) for m in (self.w1, self.w3, self.w2)]]


class TorchHead(torch.nn.Module):
    """The final nn.RMSNorm and the head's nn.Linear: logits [b, T, V]."""

    def __init__(self, g, h, device):
        super().__init__()
        self.norm = rms_norm(g, device)
        self.head = linear(h, device)

    def forward(self, x):
        return self.head(self.norm(x))

    def ours(self):
        return [(self.norm.weight, False), (self.head.weight, True)]


class TorchLM(torch.nn.Module):
    """Our model's parts as torch.nn, a copy: TorchEmbedding, TorchBlocks, TorchHead. A stage's
    module holds its parts alone: the embedding on the first, the head on the last."""

    def __init__(self, init, parts, device, args, written=False):
        super().__init__()
        self.kinds = [part_kind(j, len(init)) for j in parts]
        modules = []
        for j, kind in zip(parts, self.kinds):
            if kind == "embedding":
                modules.append(TorchEmbedding(*init[j], device))
            elif kind == "head":
                modules.append(TorchHead(*init[j], device))
            else:
                modules.append(TorchBlock(init[j], args, device, written))
        self.parts = torch.nn.ModuleList(modules)

    def forward(self, x):
        for module in self.parts:
            x = module(x)
        return x

    def weights(self):   # every parameter, in our order: (its tensor, held transposed)
        return [pair for module in self.parts for pair in module.ours()]

    def ours(self, tensors):   # these (weights, or their gradients) in our layout
        return [t.T if transposed else t for t, (_, transposed) in zip(tensors, self.weights())]

    def state(self):
        weights = [w for w, _ in self.weights()]
        return self.ours(weights), self.ours([w.grad for w in weights])


def part_kind(j, num_parts):
    if j == 0:
        return "embedding"
    if j == num_parts - 1:
        return "head"
    return "block"


def as_module(init, device, args, parts=None, written=False):
    """The whole model (or these parts of it) as a TorchLM; args: the model's flags; written: its
    attention written out (TorchBlock's)."""
    return TorchLM(init, range(len(init)) if parts is None else parts, device, args, written)


def sgd_side(weights, compute_grads, lr):
    """Our step with SGD, as (step, state): compute_grads() runs forward and backward and
    returns the gradients; state() gives (weights, grads)."""
    optimizer = torch.optim.SGD(weights, lr=lr)

    def step():
        for w, grad in zip(weights, compute_grads()):
            w.grad = grad
        optimizer.step()
    return step, lambda: (weights, [w.grad for w in weights])


def dp_side(weights, group, args, xs, ys, n, zero=0, overlap=False):
    """Our data-parallel step (step 2's DataParallel, with SGD), as (step, state); state gives
    the full weights and gradients, gathered from the shards under ZeRO."""
    replica = make_replica(weights, group, zero=zero, overlap=overlap, **replica_options(sgd(args)))
    blocks = model_blocks(args, device=weights[0][0].device)

    def step():
        dp_step(replica, blocks, cross_entropy, xs, ys, n * args.context)
        replica.update()
    return step, lambda: (whole(replica), whole(replica, grads=True))


def whole(replica, grads=False):
    """On every rank, every fp32 weight, or (grads) the averaged gradient, whole, as copies:
    ZeRO's parts all-gathered."""
    parts = replica.grads() if grads else replica.params
    if not replica.shards_optimizer:
        return [part.clone() for part in parts]
    flats = [part.new_empty(n) for part, n in zip(parts, replica.lengths)]
    for flat, part in zip(flats, parts):
        dist.all_gather_single(flat, part.contiguous(), group=replica.group)
    return [replica.view(flats[replica.layout.bucket_of[i]], i) for i in range(len(replica.shapes))]


def sgd(args, **more):
    """args for our side of a race: SGD, as every side takes."""
    return type(args)(**{**vars(args), "optimizer": "sgd", **more})


def replica_options(args):
    """Step 2's replica's options, from a script's flags (steps 3 and 4 have no --bucket-mb)."""
    return dict(optimizer=args.optimizer, lr=args.lr, bf16=getattr(args, "bf16", False),
                bucket_mb=getattr(args, "bucket_mb", 25.0))


def serial_side(args, device):
    """Our step on the whole batch on rank 0 alone: a side that is not compared (None).
    Every rank must call this: it makes rank 0's group of one."""
    alone = dist.new_group([0])
    if dist.get_rank() != 0:
        return (lambda: None), None
    inputs, targets = (t.to(device) for t in first_batch(args))
    weights = [[w.to(device) for w in part] for part in init_params(args)]
    m = args.micro_batches
    return dp_side(weights, alone, args, inputs.chunk(m), targets.chunk(m), len(inputs))[0], None


def first_batch(args):
    """The batch every step of a race trains on: step 0's, tokens and targets [B, T]."""
    return make_batch(args, step=0)


def ce_sum(n):
    """PyTorch's side of our loss: each micro-batch's cross-entropy summed over its positions /
    n, n the positions of the whole (replica's) batch, as cross_entropy: logits [b, T, V]."""
    return lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / n


def bench_sizes(args, world_size):
    backend = pick_backend(world_size, args.backend)
    return (f"{world_size} ranks ({backend}{', 1 thread each' if backend == 'gloo' else ''}), "
            f"L={args.num_layers} D={args.dim} h={args.heads} T={args.context} B={args.batch_size} "
            f"m={args.micro_batches}, SGD")
