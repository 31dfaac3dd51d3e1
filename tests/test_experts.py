"""Experts (data_parallel.py --experts E --top-k K): the router's and each expert's backward by
hand against autograd in float64, the defects it must catch, and training against serial training.

- experts_forward and experts_backward at K 1 and 2: y, dn, dWr, dW1 and dW2 equal autograd's of
  the same choice in float64; an expert no position chose gets a zero gradient. Each defect fails:
  the softmax's backward without its sum term, dp taken for every expert (not the chosen alone),
  an expert's dy left unscaled by p_e.
- The choice: the K largest of p + bias, the lower index on a tie; the bias steers the choice
  and never the output.
- Training: --save replays in float64 within 1e-5 (SGD), the routes taken from the run, and the
  bias moved by the loads of the whole global batch equals the run's final bias; loads counted
  per replica (no all-reduce) fail that. Balancing lowers the busiest expert's load.
- Expert parallelism (--ep 2, 4): the same replay; each defect fails it: an expert's gradient
  divided by its copies' count dp/P, the router's gradient from this rank's experts alone, a
  position dropped at a full expert, the combine's backward sending a dn to the wrong rank.
- Step 3 (tensor_parallel.py --experts): each expert split over tp as the MLP's, both styles,
  sequence parallelism, --cp: the same replay; a router's gradient left unsummed over tp fails.
  Step 4 (pipeline_parallel.py): 1F1B, interleaved with --recompute: the same replay.
- Every refusal is one line naming its flag.
"""
import argparse
import math
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import data_parallel as dp
import pipeline_parallel as pp
import tensor_parallel as tp
import three_d
from collectives import cleanup, setup, spawn
from common import NO_SAMPLE, replay64

SMALL = ["--num-layers", "2", "--dim", "16", "--heads", "4", "--context", "8", "--batch-size", "8",
         "--micro-batches", "2", "--steps", "3", "--optimizer", "sgd", "--lr", "0.3", "--seed", "5",
         *NO_SAMPLE]


def weights(E, D, gen):
    wr = torch.randn(D, E, generator=gen, dtype=torch.float64)
    w1 = torch.randn(E, D, 3 * D, generator=gen, dtype=torch.float64) / math.sqrt(D)
    w3 = torch.randn(E, D, 3 * D, generator=gen, dtype=torch.float64) / math.sqrt(D)
    w2 = torch.randn(E, 3 * D, D, generator=gen, dtype=torch.float64) / math.sqrt(3 * D)
    return wr, w1, w3, w2


def every_expert(x, w1, w3, w2):   # SwiGLU of each expert at every row: [E, .., D]
    return (F.silu(x @ w1[:, None]) * (x @ w3[:, None])) @ w2[:, None]


def autograd_experts(n, wr, w1, w3, w2, chosen):
    """The same layer under autograd: every expert at every position, weighted by gate_e where
    chosen (the choice given: it is not differentiable)."""
    gate = (n @ wr).softmax(-1)                                       # [b, T, E]
    weight = torch.zeros_like(gate).scatter(-1, chosen.view(*n.shape[:-1], -1), 1.0) * gate
    y = every_expert(n, w1, w3, w2)                                   # [E, b, T, D]
    return (y * weight.movedim(-1, 0)[..., None]).sum(0)


def dgate_of(dy, stash, every=None):
    """dL/dgate [N, E]: <dy, y_e> where e was chosen (every: for each expert, [E, N, D])."""
    g = dy.flatten(0, -2)
    if every is not None:
        return (g * every).sum(-1).T
    dgate = torch.zeros_like(stash.gate)
    dgate[stash.rows, stash.expert] = (g[stash.rows] * stash.y_e).sum(-1)
    return dgate


def with_router(dy, stash, wr, w1, w3, w2, ds):
    """experts_backward's, its router's part (dWr, and ds Wr^T in dn) made from ds instead."""
    dn, terms = dp.experts_backward(dy, stash, wr, w1, w3, w2)
    dgate = dgate_of(dy, stash)
    right = stash.gate * (dgate - (dgate * stash.gate).sum(-1, keepdim=True))
    return dn + ((ds - right) @ wr.T).view_as(dn), [(None, stash.x.T @ ds), *terms[1:]]


def without_softmax_sum(dy, stash, wr, w1, w3, w2):   # the defect: ds = gate dgate
    return with_router(dy, stash, wr, w1, w3, w2, stash.gate * dgate_of(dy, stash))


def dgate_for_every_expert(dy, stash, wr, w1, w3, w2):   # the defect: the unchosen's too
    dgate = dgate_of(dy, stash, every=every_expert(stash.x[None], w1, w3, w2)[:, 0])   # [E, N, D]
    ds = stash.gate * (dgate - (dgate * stash.gate).sum(-1, keepdim=True))
    return with_router(dy, stash, wr, w1, w3, w2, ds)


def unscaled_expert_dy(dy, stash, wr, w1, w3, w2):   # the defect: an expert's dy not times gate_e
    dn, terms = dp.experts_backward(dy, stash._replace(gate=torch.ones_like(stash.gate)), wr, w1,
                                    w3, w2)
    right_terms = dp.experts_backward(dy, stash, wr, w1, w3, w2)[1]
    return dn, [right_terms[0], *terms[1:]]


@pytest.mark.parametrize("backward,agrees", [(dp.experts_backward, True),
                                             (without_softmax_sum, False),
                                             (dgate_for_every_expert, False),
                                             (unscaled_expert_dy, False)])
@pytest.mark.parametrize("top_k", [1, 2])
def test_experts_backward_is_autograds_for_the_same_choice(backward, agrees, top_k):
    gen = torch.Generator().manual_seed(top_k)
    E, D = 5, 8
    wr, w1, w3, w2 = weights(E, D, gen)
    n = torch.randn(3, 7, D, generator=gen, dtype=torch.float64)
    dy = torch.randn(3, 7, D, generator=gen, dtype=torch.float64)
    router = dp.Router(E, top_k)
    router.bias = torch.tensor([0.0, 0.0, 0.0, 0.0, -10.0], dtype=torch.float64)   # e 4: never
    y, stash = dp.experts_forward(n, wr, w1, w3, w2, router)
    chosen = router.routes[0]
    assert chosen.shape == (21, top_k) and not (chosen == 4).any()
    leaves = [t.clone().requires_grad_() for t in (n, wr, w1, w3, w2)]
    want = autograd_experts(*leaves, chosen)
    want.backward(dy)
    torch.testing.assert_close(y, want.detach(), rtol=1e-12, atol=1e-12)
    dn, terms = backward(dy, stash, wr, w1, w3, w2)
    grads = [dn, *(dz for _, dz in terms)]
    close = [torch.allclose(got, leaf.grad, rtol=1e-10, atol=1e-10)
             for got, leaf in zip(grads, leaves)]
    assert all(close) == agrees, close
    if agrees:
        assert all(terms[i][1][4].abs().max() == 0 for i in (1, 2, 3))   # unchosen


def test_the_choice_is_the_k_largest_of_p_plus_bias_the_lower_index_on_a_tie():
    router = dp.Router(4, 2)
    p = torch.tensor([[0.1, 0.4, 0.4, 0.1], [0.25, 0.25, 0.25, 0.25]])
    assert router.choose(p).tolist() == [[1, 2], [0, 1]]
    router.bias = torch.tensor([0.0, 0.0, 0.0, 0.5])
    assert router.choose(p).tolist() == [[3, 1], [3, 0]]
    assert router.loads.tolist() == [2, 3, 1, 2]                     # K a position, both calls


def test_the_bias_steers_the_choice_never_the_output():
    gen = torch.Generator().manual_seed(0)
    wr, w1, w3, w2 = weights(3, 8, gen)
    n = torch.randn(1, 4, 8, generator=gen, dtype=torch.float64)
    router = dp.Router(3, 1)
    y, stash = dp.experts_forward(n, wr, w1, w3, w2, router)
    router.bias = torch.tensor([5.0, 0.0, 0.0], dtype=torch.float64)   # every position: e 0
    y0, _ = dp.experts_forward(n, wr, w1, w3, w2, router)
    expert0 = every_expert(n, w1, w3, w2)[0]
    torch.testing.assert_close(y0, stash.gate[:, 0].view(1, 4, 1) * expert0)   # by gate_0


def replay64_with_bias(result):
    """common's replay64, each step's routes the run's, each layer's bias moved after the step
    by the loads of those routes over the whole batch (float32, as the run's): (losses, final
    params, final bias)."""
    config = argparse.Namespace(**result["config"])
    bias = result["init_bias"].clone()

    def moe_of(step):   # this step's, then the bias moved for the next
        routes = result["routes"][step]                               # [L, B, T, K]
        moe = (config.top_k, bias.double(), routes)
        for layer in range(config.num_layers):
            load = torch.bincount(routes[layer].flatten(), minlength=config.experts).float()
            bias[layer] += config.balance_rate * torch.sign(load.mean() - load)
        return moe
    losses, final = replay64(result, moe_of)
    return losses, final, bias


def train(tmp_path, flags, script=dp):
    save = tmp_path / "run.pt"
    script.main([*SMALL, "--save", str(save), *flags])
    return torch.load(save)


def assert_replays(result):
    losses, final, bias = replay64_with_bias(result)
    torch.testing.assert_close(torch.tensor(result["losses"], dtype=torch.float64),
                               torch.tensor(losses, dtype=torch.float64), atol=1e-5, rtol=1e-5)
    for got, want in zip(result["final_params"].values(), final):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(result["final_bias"], bias)


@pytest.mark.deadline(90)
@pytest.mark.parametrize("flags", [
    ["--world-size", "2", "--experts", "4", "--top-k", "1"],
    ["--world-size", "2", "--experts", "4", "--top-k", "2", "--balance-rate", "0.05"],
    ["--world-size", "4", "--experts", "3", "--top-k", "2", "--micro-batches", "1"],
    ["--world-size", "2", "--experts", "4", "--top-k", "2", "--recompute", "--zero", "3"]])
def test_training_with_experts_replays_in_float64(tmp_path, flags):
    result = train(tmp_path, flags)
    config = result["config"]
    assert (config["experts"], config["top_k"]) == (int(flags[3]), int(flags[5]))
    names = list(result["final_params"])
    assert names[1:11] == [f"blocks.0.{name}" for name in
                           ("norm1", "wq", "wk", "wv", "wo", "norm2", "router", "w1", "w3", "w2")]
    E, D, F = config["experts"], config["dim"], config["ffn_dim"]
    assert result["final_params"]["blocks.1.w1"].shape == (E, D, F)
    assert result["final_params"]["blocks.1.w3"].shape == (E, D, F)
    assert result["final_params"]["blocks.1.w2"].shape == (E, F, D)
    assert result["routes"].shape == (3, 2, 8, 8, config["top_k"])   # steps, L, B, T, K
    assert result["init_bias"].shape == result["final_bias"].shape == (2, E)
    assert_replays(result)


@pytest.mark.deadline(90)
def test_loads_counted_per_replica_move_the_bias_apart_from_the_whole_batchs(tmp_path):
    """The defect: each replica's bias moved by its own loads (no all-reduce). The replicas'
    biases differ, and rank 0's is not what the whole batch's loads give."""
    def own_loads(routers, rate, group=None):
        loads = torch.stack([router.loads for router in routers])
        for router, load in zip(routers, loads):
            router.bias += rate * torch.sign(load.mean() - load)
            router.loads.zero_()
        return loads
    flags = ["--world-size", "2", "--experts", "4", "--top-k", "1", "--balance-rate", "0.05"]
    with mock.patch.object(dp, "balance", own_loads):
        result = train(tmp_path, flags)
    with pytest.raises(AssertionError):
        assert_replays(result)


@pytest.mark.deadline(120)
def test_balancing_lowers_the_busiest_experts_load(tmp_path, capfd):
    """30 steps at E 8, top-1, with the bias off and on: the loads summed over training, the
    busiest expert over the mean, printed each run; lower with it on, in every layer."""
    ratios = {}
    for rate in ("0", "0.02"):
        dp.main([*SMALL, "--world-size", "2", "--experts", "8", "--steps", "30", "--lr", "0.05",
                 "--balance-rate", rate, "--save", str(tmp_path / f"{rate}.pt")])
        line = next(line for line in capfd.readouterr().out.splitlines()
                    if line.startswith("experts' loads"))
        ratios[rate] = [float(r) for r in line.split(":")[1].split("(")[0].split()]
        loads = torch.load(tmp_path / f"{rate}.pt")["loads"]
        assert [round((load.max() / load.mean()).item(), 2) for load in loads] == ratios[rate]
    assert all(on < off for on, off in zip(ratios["0.02"], ratios["0"])), ratios


@pytest.mark.parametrize("argv,words", [
    (["--experts", "-1"], "--experts -1: expected 0"),
    (["--experts", "2", "--top-k", "3"], "--top-k 3: more than --experts 2"),
    (["--top-k", "2"], "--top-k 2: needs --experts"),
    (["--experts", "2", "--balance-rate", "1.5"], "--balance-rate 1.5"),
    (["--ep", "2"], "--ep 2: needs --experts"),
    (["--experts", "4", "--ep", "3", "--world-size", "3", "--batch-size", "6"],
     "--ep 3 does not divide --experts 4"),
    (["--experts", "4", "--ep", "4", "--world-size", "2"], "--ep 4 does not divide --world-size")])
def test_experts_refuse_in_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        dp.parse_args(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and words in err, err


@pytest.mark.parametrize("script,argv,words", [
    ("three_d", ["--experts", "4", "--ep", "2", "--dp", "1"], "--ep 2 does not divide --dp 1"),
    ("tensor_parallel", ["--experts", "4", "--ep", "2"], "--ep 2: step 3 has no replicas"),
    ("pipeline_parallel", ["--experts", "4", "--ep", "2"], "--ep 2: step 4 has no replicas")])
def test_ep_where_no_replicas_hold_the_experts_refuses_in_one_line(script, argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        __import__(script).parse_args(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and words in err, err


TP_FLAGS = {"all-gather": ["--world-size", "2", "--experts", "4", "--top-k", "1",
                           "--balance-rate", "0.05"],
            "megatron sp": ["--world-size", "2", "--experts", "4", "--top-k", "2",
                            "--tp-style", "megatron", "--sequence-parallel", "--recompute"],
            "megatron cp": ["--world-size", "4", "--cp", "2", "--experts", "4", "--top-k", "2",
                            "--tp-style", "megatron", "--balance-rate", "0.05"]}
PP_FLAGS = {"1f1b": ["--world-size", "2", "--experts", "4", "--top-k", "2", "--schedule", "1f1b",
                     "--balance-rate", "0.05"],
            "interleaved": ["--world-size", "2", "--experts", "3", "--top-k", "1", "--schedule",
                            "interleaved", "--virtual-stages", "2", "--micro-batches", "4",
                            "--num-layers", "4", "--recompute"]}


THREE_D_FLAGS = {
    "dp2 pp2 tp2 ep2": ["--dp", "2", "--pp", "2", "--tp", "2", "--ep", "2", "--experts", "4",
                        "--top-k", "2", "--balance-rate", "0.05"],
    "megatron sp zero3 ep2": ["--dp", "2", "--pp", "1", "--tp", "2", "--ep", "2", "--experts",
                              "4", "--tp-style", "megatron", "--sequence-parallel", "--zero",
                              "3", "--recompute"],
    "ep2 zero1 clip": ["--dp", "4", "--pp", "1", "--tp", "1", "--ep", "2", "--experts", "4",
                       "--top-k", "2", "--zero", "1", "--clip-grad", "0.5"],
    "cp2": ["--dp", "1", "--pp", "2", "--tp", "1", "--cp", "2", "--experts", "4"],
    "sp cp2 ep2 zero2": ["--dp", "2", "--pp", "1", "--tp", "2", "--cp", "2", "--ep", "2",
                         "--experts", "4", "--tp-style", "megatron", "--sequence-parallel",
                         "--zero", "2"]}


@pytest.mark.deadline(90)
@pytest.mark.parametrize("script,flags", [*[(tp, flags) for flags in TP_FLAGS.values()],
                                          *[(pp, flags) for flags in PP_FLAGS.values()],
                                          *[(three_d, flags) for flags in THREE_D_FLAGS.values()]],
                         ids=[*TP_FLAGS, *PP_FLAGS, *THREE_D_FLAGS])
def test_steps_3_to_5_train_experts_as_serial_training(tmp_path, script, flags):
    """Step 3: each expert's W1, W3, W2 split over tp as the MLP's, the router whole; with --cp the
    routes gathered by position. Step 4: each block's router on its stage, every schedule's
    order. Step 5: those with --ep inside dp, ZeRO (the experts' copies sharded by 1 and 2),
    --clip-grad (each expert once), --cp (each expert's gradient summed over cp). The same replay: losses, every weight, the final bias."""
    result = train(tmp_path, flags, script=script)
    E = result["config"]["experts"]
    assert result["final_params"]["blocks.0.w2"].shape == (E, 48, 16)
    assert_replays(result)


@pytest.mark.deadline(60)
def test_a_router_gradient_left_unsummed_over_tp_fails_the_replay(tmp_path):
    """The defect: each tp rank steps its router by its own part of dp (no sum over tp). One
    step: after more, the tp ranks' routers choose apart and their collectives no longer match."""
    real = tp.sum_partial_grads

    def all_but_the_routers(grads, indices, group):
        if len(indices) == 2:                    # the two routers (SP's gains are more)
            return
        real(grads, indices, group)
    with mock.patch.object(tp, "sum_partial_grads", all_but_the_routers):
        result = train(tmp_path, [*TP_FLAGS["all-gather"], "--steps", "1"], script=tp)
    with pytest.raises(AssertionError):
        assert_replays(result)


@pytest.mark.deadline(90)
@pytest.mark.parametrize("flags", [
    ["--world-size", "2", "--experts", "4", "--top-k", "2", "--ep", "2"],
    ["--world-size", "4", "--experts", "4", "--top-k", "1", "--ep", "4"],
    ["--world-size", "4", "--experts", "4", "--top-k", "2", "--ep", "2", "--recompute"],
    ["--world-size", "4", "--experts", "8", "--top-k", "2", "--ep", "2", "--micro-batches", "1"],
    ["--world-size", "4", "--experts", "4", "--top-k", "2", "--ep", "2", "--zero", "2",
     "--clip-grad", "0.5"]])
def test_expert_parallel_training_replays_in_float64(tmp_path, flags):
    """--ep P: each rank holds E/P experts, positions travel by all-to-all; the weights after
    training (every expert's, gathered), the losses and the bias are serial training's."""
    result = train(tmp_path, flags)
    assert result["config"]["ep"] == int(flags[flags.index("--ep") + 1])
    assert result["final_params"]["blocks.0.w1"].shape[0] == result["config"]["experts"]
    assert_replays(result)


def divided_by_copies(real):
    """The defect: the experts' copies average over their own count dp/P (replicas not passed)."""
    def make(weights, group, zero=0, replicas=None, **options):
        return real(weights, group, zero=zero, **options)
    return make


def router_from_local_experts(real):
    """The defect: dgate_e = <dy, y_e> for the experts on this rank alone (the others' y_e as 0)."""
    def backward(dy, stash, wr, w1, *rest):
        mine = stash.expert // w1.shape[0] == dist.get_rank(stash.sent.group)   # w1 [E/P, ..]
        return real(dy, stash._replace(y_e=stash.y_e * mine[:, None]), wr, w1, *rest)
    return backward


def dropped_when_full(real):
    """The defect: capacity N K / E pairs an expert: a pair past it at a full expert gets
    nothing from that expert (its y_e taken as 0)."""
    def forward(x, expert, w1, *rest):
        y_e, routed, sent = real(x, expert, w1, *rest)
        capacity = len(expert) // (w1.shape[0] * dist.get_world_size(sent.group))
        for e in expert.unique():
            pairs = (expert == e).nonzero()[:, 0]
            y_e[pairs[capacity:]] = 0.0
        return y_e, routed, sent
    return forward


def combine_back_to_wrong_rank(real):
    """The defect: the combine's backward (the backward's second all-to-all) sends the dn rows
    shifted by one: the last row of each rank's span goes to the next rank, its pair's dn lost."""
    def backward(*args):
        calls = []
        send = dp.all_to_all

        def shifted(rows, *counts):
            calls.append(rows)
            if len(calls) == 2:
                rows = rows.roll(1, 0)
            return send(rows, *counts)
        with mock.patch.object(dp, "all_to_all", shifted):
            return real(*args)
    return backward


@pytest.mark.deadline(90)
@pytest.mark.parametrize("defect", ["divided_by_copies", "router_from_local_experts",
                                    "dropped_when_full", "combine_back_to_wrong_rank"])
def test_each_defect_of_expert_parallelism_fails_the_replay(tmp_path, defect):
    patches = {"divided_by_copies": (dp, "make_replica", divided_by_copies(dp.make_replica)),
               "router_from_local_experts": (dp, "experts_backward",
                                             router_from_local_experts(dp.experts_backward)),
               "dropped_when_full": (dp, "dispatched", dropped_when_full(dp.dispatched)),
               "combine_back_to_wrong_rank": (dp, "dispatched_backward",
                                              combine_back_to_wrong_rank(
                                                  dp.dispatched_backward))}
    flags = ["--world-size", "4", "--experts", "4", "--top-k", "2", "--ep", "2"]
    with mock.patch.object(*patches[defect]):
        result = train(tmp_path, flags)
    with pytest.raises(AssertionError):
        assert_replays(result)


RESULTS = None


def all_to_all_worker(rank, world_size):
    """One layer's experts over an ep group of all ranks, forward and backward: the bytes each
    all_to_all_single call sends (its input), beside the routed counts."""
    setup(rank, world_size)
    gen = torch.Generator().manual_seed(rank)
    E, D, K = 4, 8, 2
    wr, w1, w3, w2 = (w.float() for w in weights(E, D, torch.Generator().manual_seed(9)))
    local = E // world_size
    mine = [w[rank * local:(rank + 1) * local] for w in (w1, w3, w2)]
    n = torch.randn(2, 5, D, generator=gen)
    router = dp.Router(E, K, group=dist.group.WORLD)
    sent = []
    real = dist.all_to_all_single

    def counted(out, rows, *args, **kwargs):
        sent.append(rows.numel() * rows.element_size())
        return real(out, rows, *args, **kwargs)
    with mock.patch.object(dist, "all_to_all_single", counted):
        y, stash = dp.experts_forward(n, wr, *mine, router)
        forward = sum(sent)
        dp.experts_backward(torch.randn(2, 5, D, generator=gen), stash, wr, *mine)
    received = int(stash.sent.recv_counts.sum())          # M: the pairs for this rank's experts
    torch.save((forward, sum(sent) - forward, received), f"{RESULTS}/a2a-{rank}.pt")
    cleanup()


@pytest.mark.deadline(60)
@pytest.mark.parametrize("world_size", [2, 4])
def test_the_all_to_alls_send_the_bytes_of_the_formula(tmp_path, world_size):
    """N = 10 positions, K = 2, D = 8, float32, P ranks: forward, the counts (P int64), the N K
    pairs' rows and expert ids out, and the M rows this rank's experts made back; backward, the
    N K rows of gate_e dy out and the M rows of dn back: 8 P + N K (4 D + 8) + 4 M D, then
    4 D (N K + M)."""
    global RESULTS
    RESULTS = tmp_path
    spawn(all_to_all_worker, world_size, timeout_s=30)
    N, K, D, P = 10, 2, 8, world_size
    for r in range(P):
        forward, backward, M = torch.load(tmp_path / f"a2a-{r}.pt")
        assert forward == 8 * P + N * K * (4 * D + 8) + 4 * M * D
        assert backward == 4 * D * (N * K + M)


@pytest.mark.deadline(120)
def test_a_checkpoint_at_ep_4_resumes_at_ep_2_and_1_as_the_run_went_on(tmp_path):
    """AdamW, the routers' bias in the checkpoint: 3 steps at --ep 4 written, resumed for 2 more
    at --ep 2, at one replica, and in step 5 at dp2 pp2 tp2 ep2 and at tp 2 with ZeRO-2 (the
    experts' state sharded over their copies), each with --check; the last two steps' losses,
    every weight and the final bias are those of the run that went on at ep 4."""
    flags = [*SMALL, "--optimizer", "adamw", "--lr", "0.01", "--experts", "4", "--top-k", "2",
             "--balance-rate", "0.05"]
    dp.main([*flags, "--world-size", "4", "--ep", "4", "--steps", "5", "--save",
             str(tmp_path / "on.pt")])
    dp.main([*flags, "--world-size", "4", "--ep", "4", "--checkpoint", str(tmp_path / "ck")])
    went_on = torch.load(tmp_path / "on.pt")
    for script, layout in [(dp, ["--world-size", "4", "--ep", "2"]), (dp, ["--world-size", "1"]),
                           (three_d, ["--dp", "2", "--pp", "2", "--tp", "2", "--ep", "2"]),
                           (three_d, ["--dp", "4", "--pp", "1", "--tp", "2", "--ep", "4",
                                      "--zero", "2"])]:
        save = tmp_path / "resumed.pt"
        script.main([*flags, *layout, "--steps", "5", "--resume", str(tmp_path / "ck"), "--check",
                     "--save", str(save)])
        resumed = torch.load(save)
        torch.testing.assert_close(torch.tensor(resumed["losses"]),
                                   torch.tensor(went_on["losses"][3:]), atol=1e-5, rtol=1e-5)
        for name, weight in went_on["final_params"].items():
            torch.testing.assert_close(resumed["final_params"][name], weight, atol=1e-5,
                                       rtol=1e-5, msg=lambda msg: f"{layout} {name}: {msg}")
        assert torch.equal(resumed["final_bias"], went_on["final_bias"])


def held_worker(rank, world_size, args):
    """A three_d.py layout's rank after one AdamW step and its update: what its replicas hold
    (memory_held's, the experts' copies with the rest), beside what --plan prices for its stage."""
    device = setup(rank, world_size)
    me = three_d.ThreeDRank(rank, args, device)
    batch = me.micro_batches(dp.make_batch(args, 0), args)
    me.train_step(*batch)
    me.replica.update()
    held = sum(dp.memory_held(me.replica).values())
    planned = sum(size for size, _ in three_d.three_d_costs(args, me.stage,
                                                            tp_rank=me.tp_rank)[1].values())
    torch.save((held, planned), f"{RESULTS}/held-{rank}.pt")
    cleanup()


@pytest.mark.deadline(60)
@pytest.mark.parametrize("layout", [["--dp", "4", "--pp", "1", "--tp", "1", "--ep", "2",
                                     "--zero", "1"],
                                    ["--dp", "2", "--pp", "2", "--tp", "2", "--ep", "2", "--bf16"],
                                    ["--dp", "2", "--pp", "1", "--tp", "2", "--zero", "2"],
                                    ["--dp", "4", "--pp", "1", "--tp", "2", "--ep", "2",
                                     "--zero", "3"]])
def test_the_plan_prices_what_a_rank_holds_with_experts(tmp_path, layout):
    """--plan with --experts: the router in the replica; with --ep, each rank's E/P experts'
    weights, gradients and AdamW state apart, sharded over their copies by ZeRO 1 to 3. Every
    rank holds what the plan prices for its stage, to the byte. And the plan's parameters are
    the model's: total, and active (K experts of E a position)."""
    global RESULTS
    RESULTS = tmp_path
    argv = [*SMALL[:-2], "--experts", "4", "--top-k", "2", "--optimizer", "adamw", *layout,
            "--timeout-s", "30"]
    args = three_d.parse_args(argv)
    spawn(held_worker, args.dp * args.pp * args.tp, args, timeout_s=30)
    for rank in range(args.dp * args.pp * args.tp):
        held, planned = torch.load(tmp_path / f"held-{rank}.pt")
        assert held == planned, (rank, held, planned)
    assert three_d.total_params(args) == sum(w.numel() for w in dp.tensors_of(dp.init_params(args)))
    D, L, V, F, G = args.dim, args.num_layers, args.vocab_size, args.ffn_dim, args.kv_heads
    attention = 2 * D * D + 2 * D * G * (D // args.heads)          # Wq, Wo; Wk, Wv
    assert three_d.active_params(args) == L * (attention + 2 * 3 * D * F + 4 * D) + V * D   # K 2, E 4
