"""Helpers that several test files share."""
import functools
import math
import os
import re
import sys
import types

import torch

# float32 results that differ only in summation order agree to about this
ATOL = RTOL = 1e-5
NO_SAMPLE = ["--sample", "0"]   # a run's sample takes 200 forwards: tests that do not read it skip it


def torchrun(log_dir, nproc=2):
    """torchrun on this machine (--standalone: its rendezvous on a free port), as `python -m
    torch.distributed.run`, found in any environment; its ranks' error files in log_dir, not a
    torchelastic_* folder that it would leave in /tmp."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "--log-dir", str(log_dir)]


def final_params(result):
    """A --save result's (or serial_train's) final parameters, every tensor in the init order."""
    return list(result["final_params"].values())


def init_of(result):
    """A --save result's initial parameters, every tensor in the init order."""
    return list(result["init_params"].values())


def assert_same_training(got, want):
    """Two --save results (or serial_train's): the same loss at every step, the same final parameters."""
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), atol=ATOL, rtol=RTOL)
    assert list(got["final_params"]) == list(want["final_params"])
    for name, a in got["final_params"].items():
        torch.testing.assert_close(a, want["final_params"][name], atol=ATOL, rtol=RTOL,
                                   msg=lambda msg: f"{name}: {msg}")


def child_pids():
    """This process's live children, as the kernel sees them."""
    pids = set()
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            pids.update(int(pid) for pid in f.read().split())
    return pids


CHECK_LINE = re.compile(r"^  (.+?) +largest difference (\S+) +tolerance (\S+) +(ok|FAILED)( \(.*\))?$")


def serial_train(args):
    """The same training in one process, with autograd, as a whole run: what the tests
    compare every parallel run's --save with (--check compares each step instead). With
    --bf16 the same casts: bf16 matmuls and activations on fp32 master weights."""
    from data_parallel import (VOCAB_SIZE, init_params, make_batch, make_optimizer, model_defaults,
                               param_names, serial_loss, tensors_of)
    if "vocab_size" not in vars(args):
        args.vocab_size = VOCAB_SIZE
    for name, default in MODEL_DEFAULTS.items():
        vars(args).setdefault(name, default)
    model_defaults(args)
    assert not vars(args).setdefault("experts", 0), "experts: tests/test_experts.py replays them"
    params = [w.requires_grad_() for w in tensors_of(init_params(args))]
    optimizer = make_optimizer(params, args.optimizer, args.lr)
    losses, norms, first_grads = [], [], None
    for step in range(args.steps):
        inputs, targets = make_batch(args, step)
        optimizer.zero_grad()
        loss, _ = serial_loss(params, inputs, targets, args, args.bf16)
        loss.backward()
        losses.append(loss.item())
        first_grads = first_grads or [w.grad.clone() for w in params]
        if args.clip_grad:
            norms.append(torch.nn.utils.clip_grad_norm_(params, args.clip_grad).item())
        optimizer.step()
    final = [w.detach() for w in params]
    return {"final_params": dict(zip(param_names(args), final)), "losses": losses, "first_grads": first_grads, "grad_norms": norms}


def check_report(out):
    """--check's report in a run's output: ({figure: (difference, tolerance, verdict)}, verdict).
    Exactly one report, with its three figures, each within its tolerance if and only if ok."""
    lines = out.splitlines()
    heads = [i for i, line in enumerate(lines)
             if line.startswith("check against serial autograd training, each step from this run's weights (")]
    assert len(heads) == 1, out
    figures = {}
    for line in lines[heads[0] + 1:heads[0] + 4]:
        name, difference, tolerance, verdict, _ = CHECK_LINE.match(line).groups()
        figures[name] = (float(difference), float(tolerance), verdict)
        assert (verdict == "ok") == (float(difference) <= float(tolerance)), line
    assert sorted(figures) == ["gradients", "losses", "weights after an update"], out
    verdict = "OK" if "check OK" in lines[heads[0] + 5:heads[0] + 6] else "FAILED"
    return figures, verdict


def assert_check_passed(out, tolerance):
    figures, verdict = check_report(out)
    assert verdict == "OK", out
    assert all(difference <= tolerance for difference, _, _ in figures.values()), figures


def clip_between(config):
    """A --clip-grad for config that clips some steps and not others: the median of the
    norms that serial training (never clipping) meets."""
    import argparse
    norms = serial_train(argparse.Namespace(**{**config, "clip_grad": 1e9, "bf16": False}))["grad_norms"]
    return sorted(norms)[len(norms) // 2]


CLIPPED = re.compile(r"^--clip-grad (\S+): the gradient's norm was clipped on (\d+) of (\d+) steps$", re.MULTILINE)


def assert_clipped_some(out):
    (_, clipped, steps), = CLIPPED.findall(out)
    assert 0 < int(clipped) < int(steps), out


def assert_same_bits(a, b):
    """Two --save results, bitwise: the same losses and the same final parameters."""
    assert a["losses"] == b["losses"]
    assert all(torch.equal(x, y) for x, y in zip(final_params(a), final_params(b)))


MODEL_DEFAULTS = dict(kv_heads=None, ffn_dim=None, rope_theta=10000.0, qk_norm=False, experts=0)


def contract_shapes(config):
    """--save's names and shapes, in the init order (DESIGN.md's contract), from a run's config."""
    L, D, V, F = config["num_layers"], config["dim"], config["vocab_size"], config["ffn_dim"]
    head_dim = D // config["heads"]
    kv = config["kv_heads"] * head_dim
    block = {"norm1": (D,), "wq": (D, D), "wk": (D, kv), "wv": (D, kv),
             **({"norm_q": (head_dim,), "norm_k": (head_dim,)} if config["qk_norm"] else {}),
             "wo": (D, D), "norm2": (D,), "w1": (D, F), "w3": (D, F), "w2": (F, D)}
    return {"embedding": (V, D),
            **{f"blocks.{l}.{name}": shape for l in range(L) for name, shape in block.items()},
            "norm": (D,), "head": (D, V)}


def assert_follows_the_contract(result, flags=()):
    """--save: every flag (and these), init_params and final_params as full float32 tensors under
    the contract's names and shapes, the initial ones init_params' own; each step's global batch,
    inputs and targets [steps, B, T], make_batch's; one loss a step."""
    import argparse
    import data_parallel as dp
    config = result["config"]
    for flag in ("num_layers", "dim", "heads", "kv_heads", "ffn_dim", "rope_theta", "qk_norm", "context",
                 "vocab_size", "batch_size", "micro_batches", "steps", "lr", "optimizer", "seed", "save",
                 "check", *flags):
        assert flag in config, flag
    shapes = contract_shapes(config)
    for when in ("init", "final"):
        params = result[f"{when}_params"]
        assert list(params) == list(shapes), when
        assert all(tuple(w.shape) == shapes[name] and w.dtype == torch.float32
                   for name, w in params.items()), when
    init = dp.tensors_of(dp.init_params(argparse.Namespace(**config)))
    assert all(torch.equal(a, b) for a, b in zip(init_of(result), init))
    args = argparse.Namespace(**config)
    steps = config["steps"] - config.get("start_step", 0)
    shape = (steps, config["batch_size"], config["context"])
    assert result["inputs"].shape == shape and result["targets"].shape == shape
    for step in range(steps):
        inputs, targets = dp.make_batch(args, config.get("start_step", 0) + step)
        assert torch.equal(result["inputs"][step], inputs) and torch.equal(result["targets"][step], targets)
    assert len(result["losses"]) == steps


ATEN = torch.ops.aten   # the real ops, before a test puts stand-ins in their place


def cpu_kernels_for(op, *args, **kwargs):
    """What a GPU's fused attention op returns, computed by torch's CPU kernel of the same maths,
    its arguments read by the names the op's own schema gives them (a call that puts one in the
    wrong place fails here as it would on a GPU). Fewer key heads than query heads (GQA), as
    FlashAttention-2 takes them: each read by its group (repeated for the CPU's kernel), its dk,
    dv the group's sum."""
    names = [argument.name for argument in op.default._schema.arguments]
    given = {**dict(zip(names, args)), **kwargs}
    assert set(given) <= set(names), given.keys()
    assert given.get("dropout_p", 0.0) == 0.0 and isinstance(given["is_causal"], bool)
    q = given["query"]
    group = q.shape[1] // given["key"].shape[1]
    k, v = (given[name].repeat_interleave(group, dim=1) for name in ("key", "value"))
    if "grad_out" in given or "grad_out_" in given:              # a backward
        grad = given.get("grad_out", given.get("grad_out_"))
        lse = given["logsumexp"][..., :q.shape[2]]                # (the efficient one's: padded)
        dq, dk, dv = ATEN._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, given["out"], lse, 0.0, given["is_causal"])
        return dq, *(t.unflatten(1, (-1, group)).sum(2) for t in (dk, dv))
    o, lse = ATEN._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, given["is_causal"])
    return o, lse, None, None


FUSED_ON_CPU = types.SimpleNamespace(**{   # torch.ops.aten's fused attention ops, on the CPU
    name: functools.partial(cpu_kernels_for, getattr(ATEN, name)) for name in [
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_efficient_attention_backward"]})


def replay64(result, moe_of=None):
    """A --save result's SGD steps again, serially with autograd in float64: (losses, final).
    moe_of(step): serial_loss's moe for that step (--experts), called once a step, in order."""
    import argparse
    import data_parallel as dp
    config = argparse.Namespace(**result["config"])
    params = [w.double().requires_grad_() for w in init_of(result)]
    losses = []
    for step in range(config.steps):
        moe = moe_of(step) if moe_of else None
        loss, _ = dp.serial_loss(params, result["inputs"][step], result["targets"][step], config,
                                 moe=moe)
        loss.backward()
        losses.append(loss.item())
        if vars(config).get("clip_grad"):
            torch.nn.utils.clip_grad_norm_(params, config.clip_grad)
        with torch.no_grad():
            for w in params:
                w -= config.lr * w.grad
                w.grad = None
    return losses, [w.detach() for w in params]
