"""The GPU path, without a GPU: every script's step, each flag family, run as a rank of 8 and of
1,024 GPUs on the meta device over torch's fake process group (tests/gpu_path.py).

Each recorded step must
- touch no tensor on the CPU, nor mix devices (the harness fails the step at once);
- under --bf16, give every matmul bf16 inputs (dW summed into the fp32 gradient by the matmul,
  out_dtype, not by casting its inputs: fp32 matmuls run at 1/15 of bf16's speed on a GPU);
- run exactly the matmuls that three_d.py --plan prices for the same layout (gpu_path.rank_matmuls():
  shapes, dtypes, whether each adds into its output), the collectives and sends that its cost
  functions give (three_d_costs(): group, kind, bytes, calls), and hold at its end what they
  say (dp_costs() through three_d_costs()). Steps 2, 3 and 4 are 3D with two of dp, pp, tp
  at 1, so the plan's functions speak for them too.
"""
import argparse
import collections
import os
import subprocess
import sys

from unittest import mock

import pytest
import torch

import data_parallel
import tensor_parallel
import three_d
import gpu_path
from gpu_path import OffDevice, rank_matmuls, run_step
from plan_check import layout_flags

SMALL = {   # small enough to record fast: a block or two a stage (16 layers for 8 interleaved stages)
    "data_parallel": ["--num-layers", "2", "--dim", "64", "--batch-size", "64"],
    "tensor_parallel": ["--num-layers", "2", "--dim", "64", "--heads", "8", "--batch-size", "64"],
    "pipeline_parallel": ["--num-layers", "8", "--dim", "64", "--batch-size", "64", "--micro-batches", "8"],
    "three_d": ["--num-layers", "4", "--dim", "64", "--batch-size", "64", "--micro-batches", "4"]}
FAMILIES = {
    "data_parallel": [["--zero", str(zero)] for zero in range(4)] + [
        ["--overlap"], ["--zero", "2", "--overlap"], ["--recompute"], ["--bf16"],
        ["--zero", "3", "--bf16", "--recompute"], ["--clip-grad", "0.5", "--zero", "1"],
        ["--bucket-mb", "0", "--zero", "3"]],
    "tensor_parallel": [[], ["--tp-style", "megatron"], ["--recompute"],
                        ["--tp-style", "megatron", "--recompute", "--bf16"], ["--bf16"],
                        ["--clip-grad", "0.5"], ["--tp-style", "megatron", "--sequence-parallel", "--bf16"],
                        ["--kv-heads", "8", "--qk-norm", "--bf16"],
                        ["--kv-heads", "1", "--qk-norm", "--tp-style", "megatron", "--bf16"]],
    "pipeline_parallel": [["--schedule", schedule] for schedule in ("gpipe", "1f1b", "zb-h1")] + [
        ["--schedule", "interleaved", "--virtual-stages", "2", "--num-layers", "16"], ["--recompute"],
        ["--schedule", "zb-h1", "--recompute", "--bf16"], ["--bf16"], ["--clip-grad", "0.5"]],
    "three_d": [["--schedule", schedule] for schedule in ("gpipe", "1f1b", "zb-h1")] + [
        ["--schedule", "interleaved", "--virtual-stages", "2"], ["--tp-style", "megatron"],
        ["--p2p-shard"], *[["--zero", str(zero)] for zero in (1, 2, 3)], ["--recompute"],
        ["--bf16"], ["--clip-grad", "0.5"], ["--order", "tp-dp-pp", "--zero", "3"],
        ["--zero", "3", "--tp-style", "megatron", "--p2p-shard", "--recompute", "--bf16",
         "--schedule", "interleaved", "--virtual-stages", "2", "--clip-grad", "0.5"],
        ["--tp-style", "megatron", "--sequence-parallel", "--zero", "2", "--recompute", "--bf16"],
        ["--kv-heads", "1", "--qk-norm", "--zero", "1", "--bf16"]],
}
WORLD = {"data_parallel": ["--world-size", "8"], "tensor_parallel": ["--world-size", "8"],
         "pipeline_parallel": ["--world-size", "8"], "three_d": ["--dp", "2", "--pp", "2", "--tp", "2"]}
RANKS = {"data_parallel": [0, 7], "tensor_parallel": [0, 5], "pipeline_parallel": [0, 3, 7],
         "three_d": [0, 3, 6]}
CASES = [(script, flags) for script, families in FAMILIES.items() for flags in families]


def as_three_d(script, args):
    """The 3D layout a script's step is: its world on one axis, the others 1."""
    world = args.dp * args.pp * args.tp * args.cp if script == "three_d" else args.world_size
    layout = dict(dp=1, pp=1, tp=1, order="tp-pp-dp", schedule="1f1b", virtual_stages=1,
                  tp_style="all-gather", p2p_shard=False, zero=0, bucket_mb=25.0, cp=1,
                  cp_layout="zigzag", cp_style="ring", ulysses=1)
    if script == "three_d":
        return args
    if script == "data_parallel":
        layout.update(dp=world, zero=args.zero, bucket_mb=args.bucket_mb)
    if script == "tensor_parallel":
        layout.update(tp=world, tp_style=args.tp_style)
    if script == "pipeline_parallel":
        layout.update(pp=world, schedule=args.schedule, virtual_stages=args.virtual_stages)
    return argparse.Namespace(**{**vars(args), **layout})


def planned(layout, stage, tp_rank):
    """What the plan's functions say a rank of this stage (and tp rank) runs: its matmuls, its
    collectives {(group, kind, bytes): calls} on groups of more than one rank, and its memory at
    the end."""
    runs, held, _, _ = three_d.three_d_costs(layout, stage, tp_rank=tp_rank)
    sizes = {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "cp": layout.cp,
             "kv": layout.tp // layout.kv_heads, "ulysses": layout.ulysses,
             "ring": layout.cp // layout.ulysses}
    comms = collections.Counter()
    for group, group_runs in runs.items():
        for kind, nbytes, calls in group_runs:
            if sizes[group] > 1 and calls:
                comms[group, kind, nbytes] += calls
    return rank_matmuls(layout, stage, tp_rank), comms, sum(size for size, _ in held.values())


def assert_as_planned(ran):
    bf16 = ran.args.bf16
    want = {torch.bfloat16} if bf16 else {torch.float32}
    assert set(ran.record.input_dtypes) == want, ran.record.input_dtypes   # no fp32 matmul in bf16
    assert {mm.out_bytes for mm in ran.matmuls if mm.accumulate} == {4}     # dW: into fp32
    layout = as_three_d(ran.script, ran.args)
    matmuls, comms, held = planned(layout, ran.stage, ran.tp_rank)
    assert ran.matmuls == matmuls
    assert ran.comms == comms
    assert sum(ran.held.values()) == held
    flops = ran.record.flops()
    b = layout.batch_size // (layout.dp * layout.micro_batches)          # a micro-batch's rows
    T, D, m, tp, cp = layout.context, layout.dim, layout.micro_batches, layout.tp, layout.cp
    kv = max(layout.kv_heads // tp, 1) * D // layout.heads   # a rank's k, v columns
    matrices = 2 * D * D // tp + 2 * D * kv + 3 * D * layout.ffn_dim // tp   # Wq Wo, Wk Wv, W1 W3 W2
    weights = 2 * b * T // cp * matrices * m             # a block's seven matmuls, a position's
    U = {"ulysses": cp, "hybrid": layout.ulysses}.get(layout.cp_style, 1)   # heads split by U,
    ring = cp // U                  # positions by the ring's: of attention's causal FLOPs,
    share = (2 * ring - 1, ring * ring * U)   # contiguous: its rank C-1's
    if layout.cp_layout == "zigzag":
        share = (1, cp)             # each rank's (2 diagonal pairs of T/2C and 2C-1 whole ones)
    product = b * T * T * D // tp * m * share[0] // share[1]   # half of S = q k^T, or of A v
    blocks = layout.num_layers // layout.pp
    start, end = tensor_parallel.vocab_range(layout.vocab_size, ran.tp_rank, layout.tp)
    head = 3 * 2 * b * T // cp * D * (end - start) * m  # F, dx, dW; the last stage's
    attention = product * (2 * (1 + layout.recompute) + 5)   # F: S, A v; back: S, dv, dA, dq, dk
    per_block = weights * (3 + layout.recompute) + attention
    assert flops == per_block * blocks + head * (ran.stage == layout.pp - 1)


@pytest.mark.deadline(120)
@pytest.mark.parametrize("script,flags", CASES)
def test_a_rank_of_8_gpus_runs_as_planned(script, flags):
    for rank in RANKS[script]:
        ran = run_step(script, [*WORLD[script], *SMALL[script], *flags], rank)
        assert_as_planned(ran)


@pytest.mark.parametrize("script", ["data_parallel", "three_d"])
@pytest.mark.parametrize("flags,kernel", [([], "_scaled_dot_product_efficient_attention"),
                                          (["--bf16"], "_scaled_dot_product_flash_attention"),
                                          (["--recompute", "--bf16"],
                                           "_scaled_dot_product_flash_attention")])
def test_a_gpu_step_runs_fused_attention_and_makes_no_t_by_t_tensor(script, flags, kernel):
    """A block's attention on a GPU is torch's fused kernel, forward and backward, once a block and
    micro-batch each (the forward twice with --recompute); no op of the step makes a [.., T, T]
    tensor, so none is held from the forward to the backward either (T 80; D 64, F 192)."""
    T = 80
    argv = [*WORLD[script], *SMALL[script], "--context", str(T), *flags]
    ran = run_step(script, argv, 0)
    blocks = ran.args.num_layers // (ran.args.pp if script == "three_d" else 1)
    runs = blocks * ran.args.micro_batches
    assert ran.record.ops[kernel] == runs * (1 + ran.args.recompute)
    assert ran.record.ops[kernel + "_backward"] == runs
    head_dim = ran.args.dim // ran.args.heads
    assert any(shape[-2:] == (T, head_dim) for shape in ran.record.shapes)   # o: it sees them
    assert not [shape for shape in ran.record.shapes if shape[-2:] == (T, T)]


def test_fused_attention_moves_no_t_by_t_pass_through_memory():
    """What the memory-bound ops of a bf16 step move (gpu_path's profile), at T 512: with the
    written-out attention on the GPU, its [b, h, T, T] softmaxes, exps, masks and casts; with the
    fused kernel none of those, and less than half the bytes."""
    argv = ["--world-size", "1", "--num-layers", "2", "--dim", "256", "--heads", "4", "--context",
            "512", "--batch-size", "4", "--micro-batches", "1", "--bf16"]
    fused = run_step("data_parallel", argv, 0).record.moved
    real = data_parallel.kernels_for
    with mock.patch.object(data_parallel, "kernels_for", lambda args, device: real(args, device)._replace(
            attention=data_parallel.attention, attention_backward=data_parallel.attention_backward)):
        written = run_step("data_parallel", argv, 0).record.moved
    square = 4 * 4 * 512 * 512 * 4                    # one fp32 [b, h, T, T]
    assert written["_softmax"] >= 2 * square and written["exp_"] >= 2 * square   # F, B: a block's
    assert written["clamp_"] > 0
    assert fused["_softmax"] == 0 and fused["exp_"] == 0 and fused["clamp_"] == 0
    assert 2 * sum(fused.values()) < sum(written.values())


@pytest.mark.parametrize("bf16", [[], ["--bf16"]])
def test_a_blocks_memory_bound_passes_are_the_plans_norms_fused_no_dtype_copies(bf16):
    """What two more blocks move outside the matmuls and attention (L 4 against L 2, the same
    step otherwise): exactly the plan's PASSES [b, T, D]s each, forward and back, with RoPE's and
    SwiGLU's (F = 720 at D 256), the norms in torch's fused kernels, and no copy of an activation
    to another dtype but RoPE's fp32 (fp32 norms written out: eight passes each way, and a cast of
    x and dy; each other op grows by the gains' bytes). fp32's attention, the memory-efficient
    kernel, repeats the kv heads and sums their dk, dv (clone, sum): not in a bf16 plan."""
    def moved(layers):
        argv = ["--world-size", "1", "--num-layers", str(layers), "--dim", "256", "--heads", "4",
                "--context", "128", "--batch-size", "8", "--micro-batches", "1", *bf16]
        return run_step("data_parallel", argv, 0).record
    small, large = moved(2), moved(4)
    activation = 8 * 128 * 256 * (2 if bf16 else 4)           # one [b, T, D]
    kinds = ("_fused_rms_norm", "_fused_rms_norm_backward", "add", "silu", "silu_backward", "mul",
             "_to_copy")
    per_block = sum(large.moved[kind] - small.moved[kind] for kind in kinds) / 2
    rope = three_d.ROPE["bf16" if bf16 else "fp32"] * 2 * (1 + 2 / 4)    # q and k (G 2 of h 4)
    swiglu = (three_d.SWIGLU["forward"] + three_d.SWIGLU["backward"]) * 720 / 256
    planned = (three_d.PASSES["forward"] + three_d.PASSES["backward"] + rope + swiglu) * activation
    assert planned <= per_block <= 1.01 * planned             # and the norms' r [b, T, 1], g, dg
    assert large.ops["_fused_rms_norm"] - small.ops["_fused_rms_norm"] == 2 * 2
    assert large.ops["_fused_rms_norm_backward"] - small.ops["_fused_rms_norm_backward"] == 2 * 2
    update = ("_fused_adamw_", "copy_", "div_", "zero_")     # the update's passes, not these
    if not bf16:                                             # fp32's kernel: kv heads repeated
        update += ("clone", "sum")
    grown = {kind: large.moved[kind] - small.moved[kind] for kind in large.moved
             if kind not in kinds and kind not in update}
    assert max(grown.values()) < activation / 16, grown        # gains' bytes: no [b, T, D]


@pytest.mark.parametrize("flags", [["--bf16"], ["--tp-style", "megatron", "--sequence-parallel",
                                              "--recompute", "--zero", "3", "--dp", "2", "--bf16"]])
def test_a_cp_step_on_the_gpu_path_keeps_to_its_device_and_rings_its_cp_group(flags):
    """three_d --cp on meta: no tensor on the CPU (its positions, RoPE's turns, the ring's
    buffers), and the ring's sends on the cp group: 2 (C-1) blocks of K and V (the rank's kv
    heads alone) forward, as many back, and C of dK and dV, a block and micro-batch (plus
    --recompute's forward again)."""
    argv = ["--dp", "1", "--pp", "2", "--tp", "2", "--cp", "2", "--num-layers", "4", "--dim", "64",
            "--batch-size", "8", "--micro-batches", "2", "--context", "16", *flags]
    ran = run_step("three_d", argv, 5)
    args = ran.args
    sends = {nbytes: calls for (group, kind, nbytes), calls in ran.comms.items()
             if kind == "send" and group == "cp"}
    runs = args.num_layers // args.pp * args.micro_batches           # a block and micro-batch
    rows = args.batch_size // (args.dp * args.micro_batches)
    kv = tensor_parallel.kv_width(args.dim, args.heads, args.kv_heads, args.tp)   # G/tp dh: 16
    block = 2 * rows * (args.context // 2) * kv                      # K and V: [b, T/C, G/tp dh]
    pairs = 2 + 3                                                      # zigzag C 2: 2 diagonal
    assert ran.record.ops["_scaled_dot_product_flash_attention"] == runs * pairs * (
        1 + args.recompute)                                           # FlashAttention's, a pair
    assert_as_planned(ran)
    assert sends == {block * 2: runs * (2 + args.recompute),          # K, V in bf16: C-1 = 1
                     block * 4: runs * 2}, ran.comms                   # dK, dV in fp32: C = 2


def busiest_cp_rank(args, stage):
    """A rank of this stage at tp rank 0 (the most classes) and cp rank C-1 (contiguous: the
    most pairs)."""
    groups = three_d.rank_groups(args.dp, args.pp, args.tp, args.order, args.cp)
    for rank in range(args.dp * args.pp * args.tp * args.cp):
        d, p, t = three_d.coordinates(rank, groups)
        c = next(g.index(rank) for g in groups["cp"] if rank in g)
        if p == stage and t == 0 and c == args.cp - 1:
            return rank


@pytest.mark.deadline(120)
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_a_cp_plans_rows_price_what_ranks_of_8_gpus_run(layout):
    """--plan --cp 2 on 8 GPUs: rows of several families, each one's slowest stage recorded on
    meta at its busiest cp rank: its matmuls (a fused kernel a pair of chunks), collectives and
    sends (the ring's K, V and dK, dV; each bucket summed over cp), what it holds at the end and
    its FLOPs are the row's."""
    args = three_d.parse_args(["--plan", "--world-size", "8", "--cp", "2", "--cp-layout", layout,
                               "--num-layers", "4", "--dim", "64", "--context", "32",
                               "--batch-size", "32"])
    machine = three_d.Machine(three_d.GPUS["h100"], 8)
    rows = [three_d.predict(layout, machine) for layout in three_d.layouts(args, 8)]
    families = [dict(tp=2, tp_style="megatron", sequence_parallel=True), dict(zero=3),
                dict(schedule="interleaved"), dict(recompute=True, pp=2), dict(p2p_shard=True),
                dict(cp_style="all-gather", pp=2), dict(cp_style="ulysses", tp=2)]
    for family in families:
        row = next(row for row in rows if row["args"].micro_batches > 1 and all(
            getattr(row["args"], key) == value for key, value in family.items()))
        a = row["args"]
        assert a.cp == 2 and a.dp * a.pp * a.tp == 4
        ran = run_step("three_d", layout_flags(a).split(), busiest_cp_rank(a, row["stage"]))
        assert_as_planned(ran)


@pytest.mark.deadline(120)
@pytest.mark.parametrize("flags", [["--cp-style", "hybrid", "--ulysses", "2", "--recompute"],
                                   ["--cp-style", "hybrid", "--ulysses", "2", "--cp-layout",
                                    "contiguous"],
                                   ["--cp-style", "ulysses", "--kv-heads", "2"],   # copied
                                   ["--cp-style", "all-gather", "--cp-layout", "contiguous"]])
def test_each_cp_style_at_cp_4_runs_as_planned(flags):
    """Its busiest rank's kernels (all-gather: a chunk's diagonal and its keys before; Ulysses:
    one over T on h/C heads; the hybrid: the ring of C/U on h/U), its all-gathers, all-to-alls
    (on the Ulysses group) and sends (on the ring across) are the plan's."""
    argv = ["--dp", "1", "--pp", "2", "--tp", "1", "--cp", "4", "--num-layers", "4", "--dim",
            "64", "--context", "32", "--batch-size", "32", "--micro-batches", "2", "--bf16", *flags]
    args = three_d.parse_args(argv)
    assert_as_planned(run_step("three_d", argv, busiest_cp_rank(args, 1)))


LARGE = ["--dp", "16", "--pp", "8", "--tp", "8", "--num-layers", "64", "--dim", "8192", "--heads", "64",
         "--context", "1024", "--vocab-size", "128256", "--batch-size", "1024", "--micro-batches", "8", "--bf16",
         "--zero", "3",
         "--tp-style", "megatron", "--schedule", "interleaved", "--p2p-shard"]


@pytest.mark.deadline(120)
@pytest.mark.parametrize("rank", [0, 229, 1023])      # stages 0, 4 and 7 of dp16 pp8 tp8
def test_a_rank_of_1024_gpus_runs_as_planned(rank):
    ran = run_step("three_d", LARGE, rank)
    assert ran.stage == {0: 0, 229: 4, 1023: 7}[rank]
    assert_as_planned(ran)
    # 8 micro-batches through 2 chunks of 4 blocks: 7 weights' F, dx and dW, attention's fused
    # kernel F and back each; the head's F, dx and dW, last
    assert sum(ran.matmuls.values()) == 8 * 8 * (7 * 3 + 2) + 8 * 3 * (ran.stage == 7)


@pytest.mark.deadline(120)
def test_a_cp_rank_of_1024_gpus_runs_as_planned():
    """The same world with cp 2 beside tp 8 (dp 8): rank 229, stage 6 of 8, cp rank 0, runs
    what the plan prices: 2 + 3 pairs' kernels a block, micro-batch and direction."""
    large = [*LARGE[LARGE.index("--pp"):], "--dp", "8", "--cp", "2"]
    ran = run_step("three_d", large, 229)
    assert (ran.stage, ran.tp_rank) == (6, 5)
    assert_as_planned(ran)
    assert sum(ran.matmuls.values()) == 8 * 8 * (7 * 3 + 2 * 5)


ON_THE_CPU = torch.ones(97)      # made outside the step, as a CPU tensor left in a script


FOREACH_ADAMW = {"_foreach_lerp_", "_foreach_mul_", "_foreach_addcmul_", "_foreach_sqrt",
                 "_foreach_addcdiv_", "_foreach_div_"}   # foreach AdamW's passes (torch's default)


@pytest.mark.parametrize("script,flags", [
    ("data_parallel", ["--world-size", "4", "--bf16"]),
    ("data_parallel", ["--world-size", "4", "--zero", "1", "--bf16"]),
    ("data_parallel", ["--world-size", "4", "--zero", "3"]),
    ("three_d", ["--dp", "2", "--pp", "2", "--tp", "2", "--zero", "2", "--bf16"]),
])
def test_a_gpu_step_updates_with_adamws_fused_kernel_once(script, flags):
    """Off the CPU, AdamW is one fused kernel a step over the rank's parameters or ZeRO's shard
    (its step count bumped beside it), none of foreach's passes; on the CPU, torch's default."""
    ran = run_step(script, flags, 0, warm_up=False)   # the first step: AdamW's state made too
    assert ran.record.ops["_fused_adamw_"] == 1
    assert not FOREACH_ADAMW & set(ran.record.ops), ran.record.ops
    sgd = run_step(script, [*flags, "--optimizer", "sgd"], 0, warm_up=False)
    assert sgd.record.ops["_fused_adamw_"] == 0
    on_cpu = data_parallel.make_optimizer([torch.zeros(2, requires_grad=True)], "adamw", 1e-3)
    assert not on_cpu.defaults["fused"]
    on_meta = data_parallel.make_optimizer([torch.zeros(2, device="meta", requires_grad=True)],
                                           "adamw", 1e-3)
    assert on_meta.defaults["fused"] is True


@pytest.mark.parametrize("make", [lambda a: torch.zeros(a.shape),      # made on the CPU
                                  lambda a: a + ON_THE_CPU])           # devices mixed
def test_a_step_that_leaves_a_tensor_on_the_cpu_fails(monkeypatch, make):
    """The harness stops the step at the first op that makes or takes a tensor off meta."""
    real = data_parallel.cross_entropy

    def loss_beside_a_cpu_tensor(logits, y, n):
        make(logits)
        return real(logits, y, n)
    monkeypatch.setattr(data_parallel, "cross_entropy", loss_beside_a_cpu_tensor)
    with pytest.raises(OffDevice, match="on cpu"):
        run_step("data_parallel", ["--world-size", "8", *SMALL["data_parallel"]], 0)


def test_the_record_counts_what_the_step_allocates_not_views_of_what_it_found():
    """A weight's .T, or a bucket's slice, shares the storage made before the step: no bytes."""
    w = torch.empty(64, 32, device="meta")
    with gpu_path.StepRecord() as record:
        made = w.T @ w                # [32, 32]: 4 KB made
        w.view(-1)[:8]                # a slice, as of a bucket
    assert record.peak == made.nbytes == 32 * 32 * 4


@pytest.mark.parametrize("argv, named", [
    ([], "script"), (["nonsense"], "'nonsense'"), (["three_d", "--rank", "8"], "--rank 8"),
    (["three_d", "--rank", "-1"], "--rank -1"), (["pipeline_parallel", "--world-size", "4", "--rank", "4"], "--rank 4"),
    (["three_d", "--dp", "3"], "--dp")])
def test_the_harness_refuses_bad_input_in_one_line_before_any_group(argv, named, capsys):
    with pytest.raises(SystemExit) as exited:
        gpu_path.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and named in err, err
    assert not torch.distributed.is_initialized()


@pytest.mark.deadline(60)
def test_the_harness_from_the_shell_prints_its_record_and_nothing_on_stderr():
    """As the README runs it: no torch warning (numpy's, the fake group's) before the record."""
    proc = subprocess.run([sys.executable, os.path.join("tests", "gpu_path.py"), "data_parallel",
                           "--world-size", "2"], cwd=os.path.dirname(os.path.dirname(
                               os.path.abspath(__file__))), capture_output=True, text=True,
                          timeout=50)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    # 4 blocks x 2 micro-batches x (7 forward + 7 backward + 7 dW); the head's 6; and attention's
    # fused kernel, forward and back, a block and micro-batch
    assert proc.stdout.startswith("rank 0 (stage 0) of 2: 174 matmuls and 16 fused attention kernels")


def test_the_harness_help_lists_the_scripts_it_runs(capsys):
    with pytest.raises(SystemExit) as exited:
        gpu_path.main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("data_parallel", "tensor_parallel", "pipeline_parallel", "three_d"))
