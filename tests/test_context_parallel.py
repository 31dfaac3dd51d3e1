"""Context parallelism (tensor_parallel.py --cp): ring attention against serial causal attention in
float64, the defects it must catch, and training with --cp against serial training.

- Ring attention over C = 1 to 4 ranks, both layouts, 4 query heads on 2 kv heads: each rank's
  o, lse, dq, dk, dv for its positions equal step 2's attention over the whole sequence, to
  float64 rounding; the ring carries the kv heads alone (its bytes counted).
- Each defect, put in by hand, fails that comparison: dk and dv left where they were computed;
  the mask taken by local position (every pair masked as a diagonal one); the merge without its
  max subtracted (float32, scores reaching 100: e^lse overflows); the backward reading the keys of
  the step before; and, in training, the gradients averaged over cp instead of summed, and RoPE
  at a rank's local places (Megatron PR #5243's [0, 3, 0, 3]) instead of its global ones.
- tensor_parallel.py --cp C trains what serial training does: its --save replays in float64
  within 1e-5 (SGD) at cp 2, 3 and 4 in both layouts, with tp 2 in both styles, with sequence
  parallelism, with --recompute; a checkpoint written at cp 4 resumes at cp 1 and 2, --check OK.
- three_d.py --cp: the rank map puts cp next to tp; its --save replays in float64 with pp 2
  interleaved, ZeRO-3, tp 2 Megatron with sequence parallelism and --recompute, zb-h1 with ZeRO-1.
- The balance: the pairs each rank computes, contiguous against zigzag; the ring's bytes.
"""
import types
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import data_parallel as dp
import tensor_parallel as tp
import three_d
from collectives import RankFailed, cleanup, exchange, setup, spawn
from bench import cp_pairs
from common import FUSED_ON_CPU, NO_SAMPLE, check_report, replay64

SMALL = ["--num-layers", "2", "--dim", "16", "--heads", "4", "--context", "24", "--batch-size", "4",
         "--steps", "3", "--optimizer", "sgd", "--lr", "0.3", "--seed", "3", *NO_SAMPLE]


def backward_hops(stale_keys=False, sums_kept=False):
    """The ring backward's exchanges with a defect. They run kv, dkv a step, the last step dkv
    alone: every other one from the second, and the last, are the sums'. stale_keys: what comes
    in for the keys is the block this rank already held; sums_kept: the sums' hops send
    nothing, each rank keeps the sums it made (dk and dv left where computed)."""
    calls = []

    def exchanging(to_send, to_recv, right, left, group, wait=True):
        k = len(calls)
        calls.append(k)
        sums = k % 2 == 1 or k == 2 * (dist.get_world_size(group) - 1)
        if sums_kept if sums else stale_keys:
            to_recv.copy_(to_send)
            return []
        return exchange(to_send, to_recv, right, left, group, wait=wait)
    return mock.patch.object(tp, "exchange", exchanging)


def merge_without_max(o_a, lse_a, o_b, lse_b):   # the defect: log(e^lse_a + e^lse_b) as written
    if o_a is None:
        return o_b, lse_b
    lse = (lse_a.exp() + lse_b.exp()).log()
    return (lse_a - lse).exp()[..., None] * o_a + (lse_b - lse).exp()[..., None] * o_b, lse


def masked_by_local_position():   # every pair as if on the diagonal
    def on_diagonal(kernel):
        return lambda *args, causal: kernel(*args, causal=True)
    return dp.Kernels(attend=on_diagonal(dp.attend), attend_backward=on_diagonal(dp.attend_backward))


def on_cpu_kernels(glue):
    """A GPU's pair glue (step 2's fused_attend or its backward, as step 3 calls it), run with
    torch's CPU flash kernel in place of each CUDA op, as the op's schema names its arguments."""
    def run(*args, **kwargs):
        with mock.patch.object(torch, "ops", types.SimpleNamespace(aten=FUSED_ON_CPU)):
            return glue(*args, **kwargs)
    return run


def fused_pairs():   # the GPU's path through every pair: the glue, on the CPU's kernels
    return dp.Kernels(attend=on_cpu_kernels(dp.fused_attend),
                      attend_backward=on_cpu_kernels(dp.fused_attend_backward))


def ring_worker(rank, world_size, layout, defect, dtype, scale):
    """This rank's ring attention, forward and backward, against step 2's over the whole T."""
    setup(rank, world_size)
    gen = torch.Generator().manual_seed(0)
    b, T, heads, kv_heads, head_dim = 2, 8 * world_size, 4, 2, 4
    q, do = (torch.randn(b, T, heads * head_dim, generator=gen, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(b, T, kv_heads * head_dim, generator=gen, dtype=dtype) for _ in range(2))
    q = q * scale                                             # scores of about scale x 2
    mine = tp.cp_positions(T, rank, world_size, layout)
    forward = [q[:, mine], k[:, mine], v[:, mine], head_dim]
    put_in = mock.MagicMock()
    kernels = dp.Kernels()
    if defect == "merge_without_max":
        put_in = mock.patch.object(tp, "merge", merge_without_max)
    if defect == "masked_by_local_position":
        kernels = masked_by_local_position()
    if defect == "fused_pairs":
        kernels = fused_pairs()
    with put_in:
        o, lse = tp.ring_attention(*forward, layout=layout, kernels=kernels)
        if defect in ("stale_keys", "left_where_computed"):   # the backward's exchanges alone
            with backward_hops(stale_keys=defect == "stale_keys",
                               sums_kept=defect == "left_where_computed"):
                grads = tp.ring_attention_backward(do[:, mine], *forward[:3], o, lse, head_dim,
                                                   layout=layout, kernels=kernels)
        else:
            grads = tp.ring_attention_backward(do[:, mine], *forward[:3], o, lse, head_dim,
                                               layout=layout, kernels=kernels)
    whole_o, whole_lse = dp.attention(q.double(), k.double(), v.double(), head_dim)
    whole = dp.attention_backward(do.double(), q.double(), k.double(), v.double(), whole_o,
                                  whole_lse, head_dim)
    got = [o, lse, *grads]
    want = [whole_o[:, mine], whole_lse[:, :, mine], *(g[:, mine] for g in whole)]
    tolerance = 1e-12 if dtype == torch.float64 else 1e-4
    close = [torch.allclose(a.double(), w, rtol=tolerance, atol=tolerance * scale ** 2)
             for a, w in zip(got, want)]
    torch.save(close, f"{RESULTS}/{defect}-{world_size}-{layout}-{rank}.pt")
    cleanup()


RESULTS = None


def ring(tmp_path, world_size, layout, defect=None, dtype=torch.float64, scale=1.0):
    """Every rank's [o, lse, dq, dk, dv close to serial's]."""
    global RESULTS
    RESULTS = tmp_path
    spawn(ring_worker, world_size, layout, defect, dtype, scale, timeout_s=30)
    return [torch.load(tmp_path / f"{defect}-{world_size}-{layout}-{r}.pt")
            for r in range(world_size)]


@pytest.mark.deadline(60)
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ring_attention_is_causal_attention_over_the_whole_sequence(tmp_path, world_size, layout):
    assert ring(tmp_path, world_size, layout) == [[True] * 5] * world_size


@pytest.mark.deadline(60)
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_gpus_fused_pairs_give_the_same_ring(tmp_path, world_size, layout):
    """On a GPU each pair runs FlashAttention's kernel, causal on the diagonal alone, and its
    backward fed the merged o and lse: that glue, on torch's CPU kernel in float64, equals serial
    attention as the written-out pairs do."""
    assert ring(tmp_path, world_size, layout, "fused_pairs") == [[True] * 5] * world_size


@pytest.mark.deadline(60)
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("defect,fails", [("left_where_computed", "dk dv"),
                                          ("masked_by_local_position", "o lse dq dk dv"),
                                          ("stale_keys", "dq dk dv")])
def test_each_defect_of_the_ring_fails_it(tmp_path, layout, defect, fails):
    """Over 3 ranks: some rank's figures that the defect touches differ from serial's."""
    names = ["o", "lse", "dq", "dk", "dv"]
    results = ring(tmp_path, 3, layout, defect)
    wrong = {name for rank in results for name, ok in zip(names, rank) if not ok}
    assert wrong == set(fails.split())


@pytest.mark.deadline(60)
def test_the_merge_needs_its_max_subtracted_where_scores_reach_100(tmp_path):
    """float32, q scaled so that scores reach 100 (e^100 > float32's largest): with the max
    subtracted the ring equals float64 attention; without, it is inf or nan."""
    assert ring(tmp_path, 2, "zigzag", dtype=torch.float32, scale=30.0) == [[True] * 5] * 2
    wrong = ring(tmp_path, 2, "zigzag", "merge_without_max", dtype=torch.float32, scale=30.0)
    assert not all(all(rank) for rank in wrong)


def bytes_worker(rank, world_size, dtype, kv_heads):
    """The bytes this rank's ring sends in one attention's forward, then its backward."""
    setup(rank, world_size)
    sent = []

    def counted(to_send, *args, **kwargs):
        sent[-1] += to_send.numel() * to_send.element_size()
        return exchange(to_send, *args, **kwargs)
    b, n, heads, head_dim = 2, 8, 4, 4
    q, do = (torch.randn(b, n, heads * head_dim, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(b, n, kv_heads * head_dim, dtype=dtype) for _ in range(2))
    with mock.patch.object(tp, "exchange", counted):
        sent.append(0)
        o, lse = tp.ring_attention(q, k, v, head_dim)
        sent.append(0)
        tp.ring_attention_backward(do, q, k, v, o, lse, head_dim)
    torch.save(sent, f"{RESULTS}/bytes-{rank}.pt")
    cleanup()


def ulysses_not_put_back(t, head_dim, group, held, heads):
    """The defect for Ulysses' inverse: the chunks sent home in T's order, not put back in the
    ranks' (the inverse is then not the inverse of to_heads)."""
    real = tp.in_order
    with mock.patch.object(tp, "in_order", lambda t, held, back=False: real(t, held)):
        return REAL_TO_POSITIONS(t, head_dim, group, held, heads)


def copies_unsummed(t, head_dim, group, held, heads):
    """The defect for a kv head's copies (G < C): its gradient from the first copy alone."""
    size = torch.distributed.get_world_size(group)
    pieces = tp.in_order(t, held, back=True).unflatten(1, (size, -1))
    came = tp.all_to_all(pieces.movedim(1, 0).contiguous(), group=group).movedim(0, 2)
    if heads < size:
        came = came.unflatten(2, (heads, -1))[:, :, :, 0]
    return came.flatten(2)


def kept_where_computed(x, group):   # the defect: all-gather's dK, dV not reduce-scattered
    mine = x.shape[1] // torch.distributed.get_world_size(group)
    rank = torch.distributed.get_rank(group)
    return x[:, rank * mine:(rank + 1) * mine]


REAL_TO_POSITIONS = tp.to_positions
STYLE_DEFECTS = {"ulysses_not_put_back": ("to_positions", ulysses_not_put_back),
                 "copies_unsummed": ("to_positions", copies_unsummed),
                 "kept_where_computed": ("scatter_along_T", kept_where_computed)}


def style_worker(rank, world_size, style, ulysses, layout, kv_heads, defect):
    """This rank's attention of --cp-style, forward and backward, against step 2's over T: o, dq,
    dk, dv close (and lse where it is the rank's positions': ring, all-gather)."""
    setup(rank, world_size)
    args = types.SimpleNamespace(cp=world_size, cp_style=style, ulysses=ulysses, cp_layout=layout)
    lists = tp.cp_group_lists([list(range(world_size))], args)
    groups = {name: torch.distributed.new_subgroups_by_enumeration(lists[name])[0]
              for name in lists}
    if defect == "ring_within_ulysses":                       # the hybrid's ring over its
        groups["ring"] = groups["ulysses"]                    # Ulysses group, not across
    gen = torch.Generator().manual_seed(0)
    b, T, heads, head_dim = 2, 8 * world_size, 4, 4
    q, do = (torch.randn(b, T, heads * head_dim, generator=gen, dtype=torch.float64)
             for _ in range(2))
    k, v = (torch.randn(b, T, kv_heads * head_dim, generator=gen, dtype=torch.float64)
            for _ in range(2))
    mine = tp.cp_positions(T, rank, world_size, layout)
    put_in = mock.MagicMock()
    if defect in STYLE_DEFECTS:
        put_in = mock.patch.object(tp, *STYLE_DEFECTS[defect])
    with put_in:
        attend, attend_back = tp.context_attention(args, groups)
        o, lse = attend(q[:, mine], k[:, mine], v[:, mine], head_dim)
        grads = attend_back(do[:, mine], q[:, mine], k[:, mine], v[:, mine], o, lse, head_dim)
    whole_o, whole_lse = dp.attention(q, k, v, head_dim)
    whole = dp.attention_backward(do, q, k, v, whole_o, whole_lse, head_dim)
    got = [o, *grads]
    want = [whole_o[:, mine], *(g[:, mine] for g in whole)]
    if style in ("ring", "all-gather"):
        got.append(lse)
        want.append(whole_lse[:, :, mine])
    close = [torch.allclose(a, w, rtol=1e-12, atol=1e-12) for a, w in zip(got, want)]
    torch.save(close, f"{RESULTS}/{style}-{rank}.pt")
    cleanup()


def styled(tmp_path, world_size, style, ulysses=1, layout="zigzag", kv_heads=2, defect=None):
    """Every rank's [o, dq, dk, dv (, lse)] close to serial's, under --cp-style."""
    global RESULTS
    RESULTS = tmp_path
    spawn(style_worker, world_size, style, ulysses, layout, kv_heads, defect, timeout_s=30)
    return [torch.load(tmp_path / f"{style}-{r}.pt") for r in range(world_size)]


@pytest.mark.deadline(60)
@pytest.mark.parametrize("world_size,style,ulysses,layout,kv_heads", [
    (2, "all-gather", 1, "zigzag", 2), (3, "all-gather", 1, "contiguous", 1),
    (4, "all-gather", 1, "zigzag", 4), (2, "ulysses", 1, "zigzag", 2),
    (4, "ulysses", 1, "contiguous", 4), (4, "ulysses", 1, "zigzag", 2),    # G 2 < C 4: copied
    (4, "ulysses", 1, "zigzag", 1), (4, "hybrid", 2, "zigzag", 2),
    (4, "hybrid", 2, "contiguous", 1)])
def test_each_cp_style_is_causal_attention_over_the_whole_sequence(tmp_path, world_size, style,
                                                                    ulysses, layout, kv_heads):
    """Llama 3's all-gather, Ulysses (its kv heads split, or copied to the ranks that read them)
    and the hybrid (Ulysses in pairs, the ring across), 4 query heads, to float64 rounding."""
    results = styled(tmp_path, world_size, style, ulysses, layout, kv_heads)
    assert all(all(rank) for rank in results), results


@pytest.mark.deadline(60)
@pytest.mark.parametrize("style,ulysses,kv_heads,defect,fails", [
    ("ulysses", 1, 4, "ulysses_not_put_back", "o dq dk dv"),
    ("ulysses", 1, 2, "copies_unsummed", "dk dv"),
    ("all-gather", 1, 2, "kept_where_computed", "dk dv"),
    ("hybrid", 2, 2, "ring_within_ulysses", "o dq dk dv")])
def test_each_defect_of_the_cp_styles_fails_it(tmp_path, style, ulysses, kv_heads, defect, fails):
    """Over 4 ranks: the figures the defect touches differ from serial's on some rank."""
    names = ["o", "dq", "dk", "dv", "lse"]
    results = styled(tmp_path, 4, style, ulysses, "zigzag", kv_heads, defect)
    wrong = {name for rank in results for name, ok in zip(names, rank) if not ok}
    assert wrong == set(fails.split())


@pytest.mark.deadline(60)
@pytest.mark.parametrize("dtype,kv_heads", [(torch.float32, 4), (torch.bfloat16, 1),
                                            (torch.float32, 2)])
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_ring_sends_the_bytes_of_the_formula(tmp_path, world_size, dtype, kv_heads):
    """A layer's attention, A = a rank's [b, T/C, G dh] of its dtype, its kv heads' alone (G/h of
    its query heads': repeated to h, K and V would send h/G times the bytes, torchtitan #1283):
    forward, K and V to the next rank C-1 times, 2 (C-1) A; backward, K and V again, 2 (C-1) A,
    and dK and dV (fp32) C times. tp_costs' cp_costs says the same."""
    global RESULTS
    RESULTS = tmp_path
    spawn(bytes_worker, world_size, dtype, kv_heads, timeout_s=30)
    A = 2 * 8 * kv_heads * 4 * dtype.itemsize
    A32 = 2 * 8 * kv_heads * 4 * 4
    C = world_size
    shape = types.SimpleNamespace(dim=16, heads=4, kv_heads=kv_heads, cp=C, cp_style="ring",
                                  ulysses=1, bf16=dtype == torch.bfloat16, recompute=False)
    priced = tp.cp_costs(1, 2 * 8, shape, 1)
    assert [nbytes * times for _, nbytes, times in priced["cp"]] == [2 * (C - 1) * A * 2,
                                                                     2 * C * A32]
    for r in range(C):
        assert torch.load(tmp_path / f"bytes-{r}.pt") == [2 * (C - 1) * A,
                                                          2 * (C - 1) * A + 2 * C * A32]


def assert_replays(result):
    losses, final = replay64(result)
    torch.testing.assert_close(torch.tensor(result["losses"], dtype=torch.float64),
                               torch.tensor(losses, dtype=torch.float64), atol=1e-5, rtol=1e-5)
    for got, want in zip(result["final_params"].values(), final):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def train(tmp_path, flags):
    save = tmp_path / "run.pt"
    tp.main([*SMALL, "--save", str(save), *flags])
    return torch.load(save)


@pytest.mark.deadline(90)
@pytest.mark.parametrize("flags", [
    *[["--world-size", str(cp), "--cp", str(cp), "--cp-layout", layout]
      for cp in (2, 3, 4) for layout in ("zigzag", "contiguous")],
    ["--world-size", "4", "--cp", "2"], ["--world-size", "4", "--cp", "2", "--tp-style", "megatron"],
    ["--world-size", "4", "--cp", "2", "--tp-style", "megatron", "--sequence-parallel"],
    ["--world-size", "4", "--cp", "2", "--kv-heads", "1", "--qk-norm"],   # tp 2, G 1, zigzag
    ["--world-size", "2", "--cp", "2", "--recompute", "--micro-batches", "2"],
    ["--world-size", "2", "--cp", "2", "--cp-style", "all-gather", "--cp-layout", "contiguous"],
    ["--world-size", "4", "--cp", "4", "--cp-style", "all-gather"],
    ["--world-size", "4", "--cp", "2", "--cp-style", "all-gather", "--tp-style", "megatron",
     "--sequence-parallel"],
    ["--world-size", "2", "--cp", "2", "--cp-style", "ulysses"],
    ["--world-size", "4", "--cp", "4", "--cp-style", "ulysses"],     # G 2 < C 4: kv heads copied
    ["--world-size", "4", "--cp", "2", "--cp-style", "ulysses", "--tp-style", "megatron"],
    ["--world-size", "4", "--cp", "4", "--cp-style", "hybrid", "--ulysses", "2", "--recompute"],
    ["--world-size", "8", "--cp", "4", "--cp-style", "hybrid", "--ulysses", "2", "--heads", "8"]])
def test_training_with_cp_replays_in_float64(tmp_path, flags):
    result = train(tmp_path, flags)
    assert result["config"]["cp"] == int(flags[3])
    layout = "zigzag"
    if "--cp-layout" in flags:
        layout = flags[flags.index("--cp-layout") + 1]
    assert result["config"]["cp_layout"] == layout
    style = "ring"
    if "--cp-style" in flags:
        style = flags[flags.index("--cp-style") + 1]
    assert result["config"]["cp_style"] == style
    assert result["inputs"].shape == (3, 4, 24)                # whole, as always
    assert_replays(result)


def averaged_over_cp(grads, indices, group):   # the defect: the partial sums averaged
    for i in indices:
        tp.reduce_over(grads[i], group)
        grads[i] /= torch.distributed.get_world_size(group)


def rope_at_local_places(positions, head_dim, theta):   # the defect: 0 .. T/C-1 on every rank
    return REAL_ROPE(torch.arange(len(positions), device=positions.device), head_dim, theta)


REAL_ROPE = tp.rope_table


@pytest.mark.deadline(60)
@pytest.mark.parametrize("name,defect", [("sum_partial_grads", averaged_over_cp),
                                         ("rope_table", rope_at_local_places)])
def test_each_defect_of_cp_training_fails_the_check(tmp_path, monkeypatch, capfd, name, defect):
    """Each rank's gradients averaged over cp, not summed (Megatron #673, #906); RoPE at a rank's
    local places, zigzag's chunks 0 and 3 of 4 turned as if they were 0 and 1 (Megatron PR #5243)."""
    monkeypatch.setattr(tp, name, defect)
    with pytest.raises(RankFailed):
        tp.main([*SMALL, "--world-size", "2", "--cp", "2", "--check", "--timeout-s", "20"])
    figures, verdict = check_report(capfd.readouterr().out)
    assert verdict == "FAILED" and figures["gradients"][2] == "FAILED"


@pytest.mark.deadline(120)
def test_a_checkpoint_written_at_cp_4_resumes_at_cp_1_and_2(tmp_path, capfd):
    folder = tmp_path / "ckpt"
    tp.main([*SMALL, "--world-size", "4", "--cp", "4", "--checkpoint", str(folder)])
    for world, cp in ((1, 1), (2, 2)):
        tp.main([*SMALL, "--world-size", str(world), "--cp", str(cp), "--resume", str(folder),
                 "--steps", "5", "--check"])
        out = capfd.readouterr().out
        assert "resumed from" in out and check_report(out)[1] == "OK"


@pytest.mark.deadline(120)
def test_a_checkpoint_written_under_one_cp_style_resumes_under_another(tmp_path, capfd):
    folder = tmp_path / "ckpt"
    tp.main([*SMALL, "--world-size", "4", "--cp", "4", "--cp-style", "hybrid", "--ulysses", "2",
             "--checkpoint", str(folder)])
    tp.main([*SMALL, "--world-size", "2", "--cp", "2", "--cp-style", "all-gather", "--resume",
             str(folder), "--steps", "5", "--check"])
    out = capfd.readouterr().out
    assert "resumed from" in out and check_report(out)[1] == "OK"


@pytest.mark.parametrize("cp_size", [2, 4, 8])
def test_zigzag_balances_what_contiguous_does_not(cp_size):
    contiguous = [len(cp_pairs(r, cp_size, "contiguous")) for r in range(cp_size)]
    zigzag = [len(cp_pairs(r, cp_size, "zigzag")) for r in range(cp_size)]
    assert contiguous == list(range(1, cp_size + 1))          # rank r: r + 1 pairs
    assert max(contiguous) / (sum(contiguous) / cp_size) == 2 * cp_size / (cp_size + 1)
    assert zigzag == [2 * cp_size + 1] * cp_size              # every rank alike


@pytest.mark.parametrize("argv,words", [
    (["--world-size", "4", "--cp", "3"], "--cp 3 does not divide --world-size 4"),
    (["--world-size", "2", "--cp", "2", "--context", "6"],
     "--cp 2: --context 6 is not divisible by 4, the zigzag layout's chunks"),
    (["--world-size", "4", "--cp", "2", "--heads", "3", "--dim", "48"],
     "--heads 3 is not divisible by --world-size / --cp (2)"),
    (["--world-size", "4", "--cp", "2", "--tp-style", "megatron", "--sequence-parallel",
      "--cp-layout", "contiguous", "--context", "6"],
     "--sequence-parallel with --cp 2: a rank's 3 positions do not split over the 2 tp ranks"),
    (["--world-size", "4", "--cp", "4", "--cp-style", "ulysses", "--heads", "2", "--dim", "16"],
     "--cp-style ulysses: the 2 query heads a tp rank holds do not split over 4 ranks"),
    (["--world-size", "3", "--cp", "3", "--cp-style", "ulysses", "--heads", "6", "--dim", "24",
      "--kv-heads", "2", "--context", "36"],
     "--cp-style ulysses: the 2 kv heads a tp rank holds neither split over 3 ranks nor divide"),
    (["--world-size", "4", "--cp", "4", "--cp-style", "hybrid"],
     "--ulysses 1: a Ulysses group is 2 or more of the --cp 4 ranks, dividing them"),
    (["--world-size", "4", "--cp", "4", "--ulysses", "2"],
     "--ulysses 2: only with --cp-style hybrid"),
    (["--world-size", "2", "--cp-style", "all-gather"],
     "--cp-style all-gather: only with --cp above 1")])
def test_cp_refuses_what_it_cannot_split_in_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        tp.parse_args(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and words in err, err


@pytest.mark.parametrize("argv,words", [
    (["--world-size", "8", "--cp", "3"], "--cp 3 does not divide --world-size 8"),
    (["--world-size", "8", "--cp", "2", "--context", "6"],
     "--cp 2: --context 6 is not divisible by 4, the zigzag layout's chunks"),
    (["--world-size", "8", "--cp", "2", "--dp", "8"],
     "--dp 8 --cp 2: 16 GPUs, which do not divide --world-size 8")])
def test_the_plan_refuses_a_cp_it_cannot_lay_out_in_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        three_d.parse_args(["--plan", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and words in err, err


@pytest.mark.parametrize("sizes", [(1, 1, 1, 2), (2, 1, 2, 2), (1, 2, 2, 2), (2, 2, 1, 3), (1, 1, 3, 4)])
@pytest.mark.parametrize("order", ["tp-pp-dp", "tp-dp-pp"])
def test_the_rank_map_puts_cp_next_to_tp(sizes, order):
    """rank = (..) tp cp + c tp + t: a rank's tp group its tp neighbours, its cp group one rank of
    each tp group in its block, and every group of a partition; dp and pp as 3D's with tp cp."""
    dp_size, pp_size, tp_size, cp_size = sizes
    groups = three_d.rank_groups(dp_size, pp_size, tp_size, order, cp=cp_size)
    outer = three_d.rank_groups(dp_size, pp_size, tp_size * cp_size, order)
    world = dp_size * pp_size * tp_size * cp_size
    for kind, size in (("tp", tp_size), ("cp", cp_size)):
        assert sorted(r for g in groups[kind] for r in g) == list(range(world))
        assert all(len(g) == size for g in groups[kind])
    assert groups["dp"] == outer["dp"] and groups["pp"] == outer["pp"]
    for rank in range(world):
        block = rank // (tp_size * cp_size) * tp_size * cp_size   # its tp x cp ranks' first
        c = rank % (tp_size * cp_size) // tp_size
        t = rank % tp_size
        assert [g for g in groups["tp"] if rank in g] == [[block + c * tp_size + x
                                                           for x in range(tp_size)]]
        assert [g for g in groups["cp"] if rank in g] == [[block + x * tp_size + t
                                                           for x in range(cp_size)]]


@pytest.mark.deadline(120)
@pytest.mark.parametrize("flags", [
    ["--dp", "1", "--pp", "2", "--tp", "1", "--cp", "2", "--schedule", "interleaved",
     "--virtual-stages", "2", "--num-layers", "4", "--micro-batches", "2"],
    ["--dp", "2", "--pp", "1", "--tp", "1", "--cp", "2", "--zero", "3", "--micro-batches", "2"],
    ["--dp", "1", "--pp", "2", "--tp", "1", "--cp", "2", "--cp-style", "all-gather",
     "--micro-batches", "2"],
    ["--dp", "1", "--pp", "2", "--tp", "1", "--cp", "2", "--cp-style", "ulysses"],
    ["--dp", "1", "--pp", "2", "--tp", "1", "--cp", "4", "--cp-style", "hybrid", "--ulysses", "2",
     "--micro-batches", "2"],
    ["--dp", "1", "--pp", "2", "--tp", "2", "--cp", "2", "--tp-style", "megatron",
     "--sequence-parallel", "--recompute", "--cp-layout", "contiguous"],
    ["--dp", "2", "--pp", "2", "--tp", "1", "--cp", "2", "--schedule", "zb-h1", "--zero", "1",
     "--micro-batches", "2", "--order", "tp-cp-dp-pp"]])
def test_three_d_with_cp_replays_in_float64(tmp_path, flags):
    save = tmp_path / "run.pt"
    three_d.main([*SMALL, "--save", str(save), *flags])
    result = torch.load(save)
    assert result["config"]["cp"] == int(flags[flags.index("--cp") + 1])
    assert_replays(result)


@pytest.mark.deadline(60)
@pytest.mark.parametrize("script,argv", [(tp, ["--world-size", "2", "--context", "33"]),
                                         (three_d, ["--dp", "1", "--pp", "2", "--tp", "2",
                                                    "--context", "7"])])
def test_a_context_no_layout_divides_trains_without_cp(capfd, script, argv):
    """T must divide into the layout's chunks only under --cp; without it every rank holds all of
    T (a door once refused --context 7 at --cp 1, and its positions dropped T's last place)."""
    script.main([*argv, "--steps", "2", "--check", "--num-layers", "2", "--batch-size", "4",
                 *NO_SAMPLE])
    assert check_report(capfd.readouterr().out)[1] == "OK"
