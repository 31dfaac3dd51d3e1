"""make gpu-check: what a machine with GPUs makes of the collection, in one command.

    python tests/gpu_check.py                  # every GPU of this node
    python tests/gpu_check.py --peak-tflops 165   # a card not in CARDS: its bf16 dense peak

1. Each script at --world-size N (three_d.py at a layout of N), --backend nccl, --check, in
   fp32 and in --bf16, small and short: a few seconds each. A failed check fails the command.
2. The bf16 step of a transformer that fits one GPU (L 8, D 4096, h 32, T 512, B 16: 1.6 G
   parameters, 38 GB planned; a smaller D where that passes 60% of the card), timed as
   data_parallel.py runs it, beside the same model in plain PyTorch (tests/race.py's TorchLM under
   torch.autocast, F.cross_entropy, AdamW fused on both sides). For each, at m 1 and 4: the
   median step, MFU against the card's bf16 peak (named, with its source), the peak memory
   (torch.cuda.max_memory_allocated), and three_d.py --plan's prediction for the same layout
   with its error.

On a machine without a GPU it says so in one line and exits 0: make test is the CPU's.
"""
import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore", "Failed to initialize NumPy")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import data_parallel  # noqa: E402
import three_d  # noqa: E402
from race import as_module, race  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A card's bf16 dense peak (no sparsity), TFLOP/s, from its maker's datasheet; the first name
# that torch.cuda.get_device_name() contains is the card's. The plan's figures: three_d.GPUS.
CARDS = [
    ("H100 PCIe", 756, "https://www.nvidia.com/en-us/data-center/h100/", None),
    ("H100", 989, "https://www.nvidia.com/en-us/data-center/h100/", "h100"),   # SXM, HBM3
    ("H200", 989, "https://www.nvidia.com/en-us/data-center/h200/", "h100"),
    ("A100", 312, "https://www.nvidia.com/en-us/data-center/a100/", "a100"),
    ("L40S", 362, "https://www.nvidia.com/en-us/data-center/l40s/", None),
    ("L4", 121, "https://www.nvidia.com/en-us/data-center/l4/", None),
    ("RTX 4090", 165, "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/"
                      "nvidia-ada-gpu-architecture.pdf", None),
]
MODEL = dict(num_layers=8, dim=4096, heads=32, kv_heads=8, ffn_dim=14336, context=512,
             batch_size=16)   # Llama 3 8B's block, 8 of them; D and F fall on smaller cards


def main(argv=None):
    parser = argparse.ArgumentParser(prog="tests/gpu_check.py", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the card's bf16 dense peak, where CARDS does not name it")
    parser.add_argument("--steps", type=int, default=10, help="timed steps a side (median)")
    args = parser.parse_args(argv)
    gpus = torch.cuda.device_count()      # NVML: no CUDA starts here before the scripts run
    if gpus == 0:
        print("gpu-check: no GPU on this machine (torch.cuda.device_count() is 0): nothing to "
              "check here; make test checks the CPU's path")
        return 0
    failed = check_scripts(gpus)
    time_one_gpu(args)
    return 1 if failed else 0


def layout_of(n):
    """(dp, pp, tp) of n ranks, tp innermost: 2 each where n has the factors, dp the rest."""
    tp = 2 if n % 2 == 0 else 1
    pp = 2 if (n // tp) % 2 == 0 else 1
    return n // (tp * pp), pp, tp


def check_runs(gpus):
    """Each script's command at this world, small and short, as (name, argv): sizes that every
    split of this world divides (the layers over the stages, D and B over the ranks)."""
    dp, pp, tp = layout_of(gpus)
    small = ["--steps", "20", "--check", "--backend", "nccl", "--num-layers",
             str(math.lcm(4, gpus)), "--dim", str(16 * gpus), "--heads", str(gpus), "--kv-heads",
             str(math.gcd(gpus, 2)), "--batch-size", str(16 * gpus)]   # G 2 or 1: below every tp
    world = ["--world-size", str(gpus)]
    runs = [("data_parallel.py", world), ("data_parallel.py --zero 3", [*world, "--zero", "3"]),
            ("tensor_parallel.py megatron", [*world, "--tp-style", "megatron"]),
            ("pipeline_parallel.py 1f1b", [*world, "--schedule", "1f1b", "--micro-batches",
                                           str(max(4, gpus))]),
            (f"three_d.py dp{dp} pp{pp} tp{tp}", ["--dp", str(dp), "--pp", str(pp), "--tp",
                                                   str(tp), "--micro-batches", str(2 * pp)])]
    commands = []
    for name, flags in runs:
        script = name.split()[0]
        for precision in ([], ["--bf16"]):
            commands.append((f"{name} {'bf16' if precision else 'fp32'}",
                             [sys.executable, script, *flags, *small, *precision]))
    return commands


def check_scripts(gpus):
    print(f"gpu-check: {gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}; "
          f"each script at {gpus} rank{'s' * (gpus > 1)} on NCCL, --check, fp32 and --bf16")
    failed = 0
    for name, command in check_runs(gpus):
        start = time.perf_counter()
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
        seconds = time.perf_counter() - start
        ok = proc.returncode == 0 and proc.stdout.rstrip().endswith("check OK")
        failed += not ok
        last = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or [""]
        print(f"  {name:<32}{seconds:>6.1f} s  {'ok' if ok else 'FAILED: ' + last[0]}",
              flush=True)
    return failed


def card_peak(name, peak_tflops=None):
    """(bf16 dense FLOP/s, its source, the plan's figures' key or None) for this card."""
    if peak_tflops:
        return peak_tflops * 1e12, "--peak-tflops", None
    for part, tflops, source, plan_key in CARDS:
        if part in name:
            return tflops * 1e12, source, plan_key
    return None, None, None


def sized_for(memory_bytes):
    """MODEL, with D and F halved until the plan's memory for it at m 1 fits 60% of the card."""
    flags = dict(MODEL)
    while flags["dim"] > 1024:
        row = plan_row(flags, 1, "h100")
        if row["memory_bytes"] <= 0.6 * memory_bytes:
            break
        flags["dim"] //= 2
        flags["ffn_dim"] //= 2
    return flags


def plan_row(flags, m, plan_key):
    """three_d.py --plan's row for this model on one GPU at m micro-batches."""
    args = three_d.parse_args(["--plan", "--world-size", "1", "--gpus-per-node", "1",
                               "--vocab-size", "97", *sum(([f"--{k.replace('_', '-')}", str(v)]
                                                           for k, v in flags.items()), [])])
    machine = three_d.Machine(three_d.GPUS[plan_key], 1)
    return next(three_d.predict(layout, machine) for layout in three_d.layouts(args, 1)
                if layout.micro_batches == m and not layout.recompute)


def join_alone(device, folder):
    """This process as the one rank of a world of one (DataParallel asks its group's size)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = dist.FileStore(os.path.join(folder, "store"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1,
                            device_id=device if backend == "nccl" else None)


def side(name, flags, m, device):
    """A step on the batch of step 0: ours, data_parallel.py's (DataParallel, bf16 on fp32
    masters, AdamW), or PyTorch's (TorchLM under autocast, AdamW fused off the CPU)."""
    args = argparse.Namespace(**flags, vocab_size=data_parallel.VOCAB_SIZE, seed=0, experts=0,
                              rope_theta=10000.0, qk_norm=False)
    init = data_parallel.init_params(args)
    tokens, targets = (t.to(device) for t in data_parallel.make_batch(args, 0))
    n = tokens.numel()                    # the batch's positions
    if name == "ours":
        replica = data_parallel.make_replica([[w.to(device, copy=True) for w in part]
                                              for part in init], None,
                                             optimizer="adamw", lr=1e-4, bf16=True)
        blocks = data_parallel.model_blocks(args, device=device)

        def ours():
            data_parallel.dp_step(replica, blocks, data_parallel.cross_entropy,
                                  tokens.chunk(m), targets.chunk(m), n)
            replica.update()
        return ours
    model = as_module(init, device, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type != "cpu")

    def theirs():
        for x, y in zip(tokens.chunk(m), targets.chunk(m)):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(x)
            (F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
             / n).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return theirs


def measure(flags, m, device, steps):
    """{side: (median step seconds, peak bytes or None)}, each side built, timed and let go
    alone, so that one side's peak holds none of the other's tensors."""
    results = {}
    for name in ("ours", "PyTorch"):
        step = side(name, flags, m, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        seconds = race({name: step}, device, warmup=3, repeats=steps)[name]
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        results[name] = (seconds, peak)
        del step
    return results


def time_one_gpu(args, device=None):
    device = device or torch.device("cuda", 0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" \
        else 2 * 2**30
    peak_flops, source, plan_key = card_peak(name, args.peak_tflops)
    flags = sized_for(memory) if device.type == "cuda" else dict(MODEL, num_layers=2, dim=64,
                                                                 heads=4, kv_heads=2, ffn_dim=192,
                                                                 context=16, batch_size=8)
    folder = tempfile.mkdtemp(prefix="gpu-check-")
    join_alone(device, folder)
    try:
        L, D, T, B = flags["num_layers"], flags["dim"], flags["context"], flags["batch_size"]
        model_flops = B * T * (6 * three_d.active_params(argparse.Namespace(
            **flags, vocab_size=data_parallel.VOCAB_SIZE, experts=0)) + 12 * L * T * D)   # --plan's
        print(f"\n{name}: the transformer at L {L}, D {D}, h {flags['heads']}, "
              f"G {flags['kv_heads']}, F {flags['ffn_dim']}, T {T}, B {B}, "
              f"bf16 on fp32 masters, AdamW (fused on a GPU); medians of {args.steps} steps")
        peak = "unknown (--peak-tflops)"
        if peak_flops:
            peak = f"{peak_flops / 1e12:g} TFLOP/s bf16 dense ({source})"
        plan = "no figures for this card"
        if plan_key:
            plan = f"{three_d.GPUS[plan_key]['name']}'s figures"
        print(f"  peak: {peak}; the plan: {plan}")
        print(f"  {'m':>3} {'side':<9}{'step':>10}{'MFU':>7}{'memory':>11}{'plan: step':>13}"
              f"{'error':>8}{'memory':>10}{'error':>8}")
        for m in (1, 4):
            row = plan_row(flags, m, plan_key) if plan_key else None
            for side, (seconds, peak) in measure(flags, m, device, args.steps).items():
                print("  " + table_line(m, side, seconds, peak, model_flops, peak_flops, row),
                      flush=True)
    finally:
        dist.destroy_process_group()
        shutil.rmtree(folder, ignore_errors=True)


def table_line(m, side, seconds, peak, model_flops, peak_flops, row):
    mfu = f"{model_flops / seconds / peak_flops:.1%}" if peak_flops else "-"
    memory = f"{peak / 1e9:.2f} GB" if peak else "-"
    line = f"{m:>3} {side:<9}{seconds * 1e3:>7.1f} ms{mfu:>7}{memory:>11}"
    if row is None or side != "ours":
        return line
    step_error = (row["step_s"] - seconds) / seconds
    memory_error = f"{(row['memory_bytes'] - peak) / peak:+.0%}" if peak else "-"
    return (line + f"{row['step_s'] * 1e3:>10.1f} ms{step_error:>+8.0%}"
            f"{row['memory_bytes'] / 1e9:>7.2f} GB{memory_error:>8}")


if __name__ == "__main__":
    sys.exit(main())
