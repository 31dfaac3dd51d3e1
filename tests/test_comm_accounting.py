"""Tests for make bench's count-comm: the bytes each rank sends in one training step,
counted by tests/comm_count.py's CommCounter, against formulas computed here from the
sizes alone.

Each script's step runs in-process (ranks forked from here) under the counter, with
the script's own command line; the report is read back from what the ranks print. The formulas below are written out
independently of the scripts' own formula functions, per rank, in bytes, with the
ring convention over a group of n ranks: all-reduce of N bytes sends 2(n-1)/n x N,
all-gather producing N bytes (n-1)/n x N, a send N bytes. The sizes are chosen so
that every count is a whole number, and the comparison is exact.
"""
import re
from fractions import Fraction

import pytest

import comm_count

TIMEOUT = ["--timeout-s", "15"]   # a deadlock fails in 15 s
F32 = 4                            # bytes per float32

BLOCK = re.compile(r"^  ranks ([\d,]+):$")
LINE = re.compile(r"^    (\w+) ([\w-]+)\s+(\d+) calls\s+counted\s+(\S+)\s+formula\s+(\S+) = .*  (ok|DIFFERENT)$")


def counted_per_rank(out, world_size):
    """{rank: {(dimension, kind): (calls, bytes)}} from the printed report, zeros left out."""
    per_rank, ranks = {}, None
    for line in out.splitlines():
        if BLOCK.match(line):
            ranks = [int(r) for r in BLOCK.match(line).group(1).split(",")]
            for r in ranks:
                assert r not in per_rank, f"rank {r} reported twice"
                per_rank[r] = {}
        elif LINE.match(line):
            dim, kind, calls, counted, _, _ = LINE.match(line).groups()
            assert ranks is not None
            for r in ranks:
                if int(calls):
                    per_rank[r][dim, kind] = (int(calls), int(counted))
    assert sorted(per_rank) == list(range(world_size)), out
    return per_rank


def assert_counts(capfd, world_size, expected_of_rank):
    out = capfd.readouterr().out
    assert "DIFFERENT" not in out, out
    got = counted_per_rank(out, world_size)
    for rank in range(world_size):
        want = {k: (calls, int(b)) for k, (calls, b) in expected_of_rank(rank).items() if calls}
        assert got[rank] == want, f"rank {rank}"
    return out


def all_reduce(n, nbytes):
    value = Fraction(2 * (n - 1) * nbytes, n)
    assert value.denominator == 1   # the sizes below keep it whole
    return value


def all_gather(n, nbytes):
    value = Fraction((n - 1) * nbytes, n)
    assert value.denominator == 1
    return value


COMMON = ["--steps", "1", "--optimizer", "sgd", "--context", "4", "--heads", "4", "--kv-heads", "4",
          "--ffn-dim", "24", *TIMEOUT]
V = 97                             # the text's classes
T = 4                              # --context
F = 24                             # --ffn-dim: 3 D at D 8


def model_parts(L, D, tp=1, t=0):
    """The elements of tp rank t's parts: [E's rows of its classes [V_t, D]], each block's two
    gains [D], Wq, Wk, Wv, Wo D^2 / tp each (G = h: kv heads as many as query heads) and W1, W3,
    W2 D F / tp each, [the gain, H's columns of its classes [D, V_t]]; V_t = 49 or 48 classes of 97
    at tp = 2."""
    classes = V // tp + (t < V % tp)
    return [classes * D, *[2 * D + 4 * D * D // tp + 3 * D * F // tp] * L, D + D * classes]


def block_collectives(style, t, act, m, blocks, recompute=False):
    """A tp rank's collectives for its blocks, {kind: (calls, bytes sent)}: Megatron's two g
    all-reduces forward (again with --recompute) and two f backward, of A each; the all-gather
    style's all-gathers of o, Wo's output, the MLP's F/D A and W2's (again with --recompute), and
    all-reduces of dn1, do, du (F/D A) and dn2."""
    if t == 1:
        return {}
    if style == "megatron":
        calls = blocks * m * (4 + 2 * recompute)
        return {"all-reduce": (calls, calls * all_reduce(t, act))}
    gathers = blocks * m * (1 + recompute)
    reduces = blocks * m
    mlp = act * F // 8
    return {"all-gather": (4 * gathers, gathers * (3 * all_gather(t, act) + all_gather(t, mlp))),
            "all-reduce": (4 * reduces, reduces * (3 * all_reduce(t, act) + all_reduce(t, mlp)))}


def add(counts, kind, calls, sent):
    had = counts.get(kind, (0, 0))
    counts[kind] = (had[0] + calls, had[1] + sent)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("bucket_mb", ["0", "25"])
def test_data_parallel(capfd, overlap, bucket_mb):
    d, L, D, B, m = 4, 3, 8, 16, 2
    comm_count.count("data_parallel", ["--world-size", str(d), "--num-layers", str(L), "--dim", str(D), "--batch-size", str(B),
                        "--micro-batches", str(m), "--bucket-mb", bucket_mb, *COMMON, *(["--overlap"] if overlap else [])])
    params = sum(model_parts(L, D)) * F32
    calls = L + 2 if bucket_mb == "0" else 1   # one all-reduce per part, or one for all: same bytes
    assert_counts(capfd, d, lambda rank: {("dp", "all-reduce"): (calls, all_reduce(d, params))})


@pytest.mark.parametrize("flags", [("--bf16",), ("--recompute",), ("--bf16", "--recompute")])
def test_bf16_halves_what_crosses_and_recompute_repeats_g(capfd, flags):
    """--bf16: every activation and its gradient between tp ranks in 2 bytes, not 4. --recompute:
    each block keeps its input and runs its forward again in its backward, g's two all-reduces
    with it; the backward's own collectives are unchanged."""
    t, L, D, B, m = 2, 3, 8, 12, 3
    comm_count.count("tensor_parallel", ["--world-size", str(t), "--num-layers", str(L), "--dim", str(D),
                                         "--batch-size", str(B), "--micro-batches", str(m), "--tp-style", "megatron",
                                         *flags, *COMMON])
    act = B // m * T * D * (2 if "--bf16" in flags else F32)
    counts = block_collectives("megatron", t, act, m, L, recompute="--recompute" in flags)
    add(counts, "all-reduce", 2 * m, 2 * m * all_reduce(t, act))          # the embedding's x, the head's dn
    add(counts, "all-reduce", 3 * m, 3 * m * all_reduce(t, B // m * T * F32))   # the loss's three [b T], fp32
    assert_counts(capfd, t, lambda rank: {("tp", kind): value for kind, value in counts.items()})


def test_bf16_halves_the_pipelines_messages_and_zeros_weight_gathers(capfd):
    """dp=2 pp=2 tp=1 with ZeRO-3, a part a unit: the stage boundaries send bf16; the units
    are gathered in bf16, twice a micro-batch (forward, backward), --recompute or not: the
    forward again runs on the weights the backward gathers; the gradients are reduced in fp32."""
    comm_count.count("three_d", ["--dp", "2", "--pp", "2", "--tp", "1", "--num-layers", "4", "--dim", "8",
                                 "--batch-size", "8", "--micro-batches", "2", "--zero", "3", "--bucket-mb", "0",
                                 "--bf16", "--recompute", *COMMON])
    m, d, act = 2, 2, 8 // 2 // 2 * T * 8 * 2      # [b, T, D] in bf16
    ends, block, _, _, _, head = model_parts(4, 8)
    stages = [[ends, block, block], [block, block, head]]   # each even: no padding at d = 2
    assert all(n % 2 == 0 for stage in stages for n in stage)
    out = capfd.readouterr().out
    assert "DIFFERENT" not in out
    rows = [(kind, int(counted)) for _, kind, calls, counted in
            re.findall(r"^    (\w+) ([\w-]+)\s+(\d+) calls\s+counted\s+(\S+)", out, re.MULTILINE) if int(calls)]
    assert {counted for kind, counted in rows if kind == "send"} == {m * act}   # one each way, a mb
    assert {counted for kind, counted in rows if kind == "all-gather"} == {     # bf16, twice a mb
        m * 2 * (d - 1) * 2 * sum(units) // d for units in stages}
    assert {counted for kind, counted in rows if kind == "reduce-scatter"} == {  # fp32, once a mb
        m * (d - 1) * F32 * sum(units) // d for units in stages}


def comparison(L, m, t, act):
    """Both TP styles' bytes over the model's blocks, per rank and step (block_collectives)."""
    gather, megatron = (sum(sent for _, sent in block_collectives(style, t, act, m, L).values())
                        for style in ("all-gather", "megatron"))
    return (f"the all-gather style {float(gather):.0f}, Megatron's pairs {float(megatron):.0f}, "
            f"{float(megatron / gather):.3f} of it")


@pytest.mark.parametrize("zero", [1, 2, 3])
@pytest.mark.parametrize("bucket_mb", ["0", "25"])
def test_data_parallel_with_zero(capfd, zero, bucket_mb):
    """3 replicas, D = 8. A part a bucket: each padded to a multiple of 3; ZeRO-1 and 2: one
    reduce-scatter and one all-gather a part; ZeRO-3: per micro-batch an all-gather a part for
    the forward and one for its backward, as FSDP does, and a reduce-scatter a part. One
    bucket of the five parts: one collective where there were five."""
    d, L, D, B, m = 3, 3, 8, 12, 2
    comm_count.count("data_parallel", ["--world-size", str(d), "--num-layers", str(L), "--dim", str(D),
                                       "--batch-size", str(B), "--micro-batches", str(m), "--zero", str(zero),
                                       "--bucket-mb", bucket_mb, *COMMON])
    parts = model_parts(L, D)
    if bucket_mb != "0":
        parts = [sum(parts)]
    padded = [-(-n // d) * d for n in parts]
    units = len(padded)
    each = Fraction((d - 1) * sum(padded) * F32, d)    # (d-1)/d of the units' padded bytes, all
    assert each.denominator == 1
    if zero < 3:
        want = {("dp", "reduce-scatter"): (units, each), ("dp", "all-gather"): (units, each)}
    else:
        want = {("dp", "reduce-scatter"): (m * units, m * each), ("dp", "all-gather"): (2 * m * units, 2 * m * each)}
    assert_counts(capfd, d, lambda rank: want)


@pytest.mark.parametrize("style, L", [("all-gather", 3), ("megatron", 4), ("megatron", 3)])
def test_tensor_parallel(capfd, style, L):
    t, D, B, m = 4, 8, 12, 3
    comm_count.count("tensor_parallel", ["--world-size", str(t), "--num-layers", str(L), "--dim", str(D),
                                         "--batch-size", str(B), "--micro-batches", str(m), "--tp-style", style,
                                         *COMMON])
    act = B // m * T * D * F32   # one micro-batch's activation [B/m, T, D]
    counts = block_collectives(style, t, act, m, L)
    add(counts, "all-reduce", 2 * m, 2 * m * all_reduce(t, act))          # the embedding's x, the head's dn
    add(counts, "all-reduce", 3 * m, 3 * m * all_reduce(t, B // m * T * F32))   # the loss's max, sum, l_y
    out = assert_counts(capfd, t, lambda rank: {("tp", kind): value for kind, value in counts.items()})
    assert comparison(L, m, t, act) in " ".join(out.split())
    assert "0.444 of it" in out                  # 8 against 3 (3 + F/D) = 18 units of (t-1)/t A


@pytest.mark.parametrize("recompute", [False, True])
def test_sequence_parallel_sends_megatrons_bytes_as_pairs_along_T(capfd, recompute):
    """--sequence-parallel: each of Megatron's all-reduces an all-gather and a reduce-scatter
    along T, (t-1)/t A each: the all-reduce's 2(t-1)/t A. A block, a micro-batch: f's two
    all-gathers and g's two reduce-scatters forward (again with --recompute), their two each
    backward; the embedding's reduce-scatter and its all-gather back, the head's all-gather and
    its reduce-scatter back. Once a step, each gain's gradient, all-reduced over tp."""
    t, L, D, B, m = 4, 3, 8, 12, 3
    comm_count.count("tensor_parallel", ["--world-size", str(t), "--num-layers", str(L), "--dim", str(D),
                                         "--batch-size", str(B), "--micro-batches", str(m), "--tp-style",
                                         "megatron", "--sequence-parallel", *(["--recompute"] * recompute),
                                         *COMMON])
    act = B // m * T * D * F32
    pairs = m * (L * (4 + 2 * recompute) + 2)
    counts = {"all-gather": (pairs, pairs * all_gather(t, act)),
              "reduce-scatter": (pairs, pairs * all_gather(t, act))}
    add(counts, "all-reduce", 2 * L + 1, (2 * L + 1) * all_reduce(t, D * F32))   # the gains'
    add(counts, "all-reduce", 3 * m, 3 * m * all_reduce(t, B // m * T * F32))    # the loss's
    megatron = 2 * pairs * all_gather(t, act)
    assert megatron == pairs * all_reduce(t, act)        # the same bytes as Megatron's all-reduces
    assert_counts(capfd, t, lambda rank: {("tp", kind): value for kind, value in counts.items()})


@pytest.mark.parametrize("schedule, virtual", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)])
def test_pipeline_parallel(capfd, schedule, virtual):
    p, L, D, B, m = 3, 6, 8, 12, 3
    comm_count.count("pipeline_parallel", ["--world-size", str(p), "--num-layers", str(L), "--dim", str(D),
                                           "--batch-size", str(B), "--micro-batches", str(m), "--schedule", schedule,
                                           *(["--virtual-stages", str(virtual)] if virtual > 1 else []), *COMMON])
    act = B // m * T * D * F32

    def expected(s):
        # per micro-batch, an activation forward and a gradient back at every virtual stage
        # c p + s that has a neighbour that way: interleaving, v times as many messages
        virtual_stages = [c * p + s for c in range(virtual)]
        sends = m * sum((j < p * virtual - 1) + (j > 0) for j in virtual_stages)
        return {("pp", "send"): (sends, sends * act)}
    assert_counts(capfd, p, expected)


@pytest.mark.parametrize("schedule,shard,style", [("1f1b", False, "all-gather"), ("gpipe", False, "all-gather"),
                                                  ("1f1b", True, "all-gather"), ("1f1b", True, "megatron"),
                                                  ("gpipe", False, "megatron")])
def test_three_d(capfd, schedule, shard, style):
    dp, pp, tp, L, D, B, m = 2, 2, 2, 4, 8, 8, 2
    comm_count.count("three_d", ["--dp", str(dp), "--pp", str(pp), "--tp", str(tp), "--num-layers", str(L),
                                 "--dim", str(D), "--batch-size", str(B), "--micro-batches", str(m),
                                 "--schedule", schedule, "--tp-style", style, *COMMON,
                                 *(["--p2p-shard"] if shard else [])])
    act = B // (dp * m) * T * D * F32    # one micro-batch of one replica, [B/(dp m), T, D]
    blocks = L // pp

    def expected(rank):
        p = rank // tp % pp               # rank = (d pp + p) tp + t
        t = rank % tp
        neighbours = (p > 0) + (p < pp - 1)
        counts = block_collectives(style, tp, act, m, blocks)
        add(counts, "all-reduce", m, m * all_reduce(tp, act))      # the embedding's x, or the head's dn
        if p == pp - 1:                   # the loss's [b T] rows, on the last stage
            add(counts, "all-reduce", 3 * m, 3 * m * all_reduce(tp, B // (dp * m) * T * F32))
        if shard:                         # --p2p-shard gathers what it receives
            add(counts, "all-gather", neighbours * m, neighbours * m * all_gather(tp, act))
        ends, block, _, _, _, head = model_parts(L, D, tp, t)
        held = ends + 2 * block if p == 0 else 2 * block + head
        return {**{("tp", kind): value for kind, value in counts.items()},
                ("pp", "send"): (neighbours * m, neighbours * m * (act // tp if shard else act)),
                ("dp", "all-reduce"): (1, all_reduce(dp, held * F32))}
    out = assert_counts(capfd, dp * pp * tp, expected)
    assert comparison(L, m, tp, act) in " ".join(out.split())


def test_sizes_of_one_send_nothing(capfd):
    """dp = tp = 1: the groups of one are never called, and their formulas are zero."""
    comm_count.count("three_d", ["--dp", "1", "--pp", "2", "--tp", "1", "--num-layers", "2", "--dim", "8",
                                 "--batch-size", "4", "--micro-batches", "2", *COMMON])
    act = 2 * T * 8 * F32
    assert_counts(capfd, 2, lambda rank: {("pp", "send"): (2, 2 * act)})


@pytest.mark.parametrize("qk_norm", [False, True])
def test_kv_heads_fewer_than_tp_sum_their_gradients_over_their_holders(capfd, qk_norm):
    """G 2 at tp 4: each kv head's Wk and Wv on the 2 ranks that read it, their gradients (D dh
    each, a block) all-reduced over those 2 once a step, in a group of their own; --qk-norm's two
    gains [dh] all-reduced over tp. Nothing else changes: the rest is Megatron's four all-reduces."""
    t, L, D, B, m, G = 4, 3, 8, 12, 3, 2
    comm_count.count("tensor_parallel", ["--world-size", str(t), "--num-layers", str(L), "--dim", str(D),
                                         "--batch-size", str(B), "--micro-batches", str(m), "--tp-style",
                                         "megatron", *COMMON, "--kv-heads", str(G),
                                         *(["--qk-norm"] if qk_norm else [])])
    act = B // m * T * D * F32
    head_dim = D // 4
    counts = block_collectives("megatron", t, act, m, L)
    add(counts, "all-reduce", 2 * m, 2 * m * all_reduce(t, act))          # the embedding's x, the head's dn
    add(counts, "all-reduce", 3 * m, 3 * m * all_reduce(t, B // m * T * F32))   # the loss's
    if qk_norm:
        add(counts, "all-reduce", 2 * L, 2 * L * all_reduce(t, head_dim * F32))   # QK-norm's gains
    holders = t // G
    kv = {("kv", "all-reduce"): (2 * L, 2 * L * all_reduce(holders, D * head_dim * F32))}
    assert_counts(capfd, t, lambda rank: {**{("tp", kind): value for kind, value in counts.items()}, **kv})
