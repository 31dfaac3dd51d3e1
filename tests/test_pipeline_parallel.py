"""Tests for pipeline_parallel.py: every number is compared with a single-process reference.

1. Schedules without processes: GPipe, 1F1B and ZB-H1 for every p in 1..8 and m in
   1..16, interleaved for p in 2..8, v in 2..3 and every whole number of rounds up to 16:
   each micro-batch's F, B (and W) on every chunk, in order; each schedule's warm-up and
   its bound on the micro-batches a stage holds; on every directed link the k-th send
   meets the k-th receive and they agree; a simulator that runs the lists under NCCL's
   rule (a send completes only when its receive is posted) finds no deadlock, while it
   does find one in the unfused 1F1B lists and in interleaved lists batched as 1F1B's.
2. Pipeline training (in-process main(), ranks forked) against data_parallel.serial_train,
   for every schedule; a stash taken for the wrong micro-batch or chunk is caught.
3. Stage + run_schedule driven directly: each micro-batch's stash is popped by its own
   backward, the stash never holds more than the schedule says, dW equals autograd's.
4. dW accumulates over micro-batches: m = 4 trains exactly like m = 1.
5. Messages too big for gloo's small-message buffer still do not deadlock.
6. --timeline's rows, bubble and peak stash; 7. bad flags; 8. --check from the shell.

Every multi-process run gets a 10 s process-group timeout, so a deadlock fails fast.
"""
import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import data_parallel as dp
import pipeline_parallel as pp
import three_d
from collectives import RankFailed, cleanup, setup, spawn
from common import (NO_SAMPLE, replay64, serial_train, assert_follows_the_contract, assert_check_passed, assert_clipped_some, assert_same_bits, assert_same_training, check_report,
                    clip_between, final_params, init_of)
from pipeline_parallel import RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, Action

REPO = Path(__file__).resolve().parent.parent

# Float32, differences only from summation order.
ATOL = 1e-5
RTOL = 1e-5
TIMEOUT = ["--timeout-s", "10"]   # a deadlocked rank fails in 10 s, inside the test's deadline

SCHEDULES = ["gpipe", "1f1b", "zb-h1", "interleaved"]
GRID = [(schedule, p, m, 1) for schedule in SCHEDULES[:3] for p in range(1, 9) for m in range(1, 17)] + \
       [("interleaved", p, m, v) for p in range(2, 9) for v in (2, 3) for m in range(p, 17, p)]


def all_stages(schedule, p, m, v=1):
    return [pp.build_schedule(schedule, p, s, m, v) for s in range(p)]


def compute_of(actions):
    return [(a.op, a.mb, a.chunk) for a in actions if a.op != "comm"]


def in_flight_trace(actions):
    """How many (micro-batch, chunk) a stage holds after each compute action: from its F
    until its W (ZB-H1) or its B (the others)."""
    last_op = "W" if any(a.op == "W" for a in actions) else "B"
    live, trace = set(), []
    for op, mb, chunk in compute_of(actions):
        if op == "F":
            live.add((mb, chunk))
        elif op == last_op:
            live.discard((mb, chunk))
        trace.append(len(live))
    return trace


# ----------------------------------------------------------------------------------
# 1. Schedules as data, checked without processes
# ----------------------------------------------------------------------------------

def test_every_micro_batch_has_its_forward_then_backward_then_w():
    for schedule, p, m, v in GRID:
        for s, actions in enumerate(all_stages(schedule, p, m, v)):
            where = f"{schedule} p={p} m={m} v={v} stage {s}"
            order = compute_of(actions)
            chunks = list(range(v)) if schedule == "interleaved" else [None]
            ops = ["F", "B", "W"] if schedule == "zb-h1" else ["F", "B"]
            assert len(order) == len(ops) * m * v, where
            for mb in range(m):
                for c in chunks:
                    at = [order.index((op, mb, c)) for op in ops]
                    assert all(order.count((op, mb, c)) == 1 for op in ops), where
                    assert at == sorted(at), where        # F before B, B before W
                # a micro-batch goes forward through the chunks in order, backward in reverse
                f = [order.index(("F", mb, c)) for c in chunks]
                b = [order.index(("B", mb, c)) for c in chunks]
                assert f == sorted(f) and b == sorted(b, reverse=True), where
            # the comm actions only add point-to-point: the compute order is compute_order's
            assert order == pp.compute_order(schedule, p, s, m, v), where
            for a, b in zip(actions, actions[1:]):   # fused: never two batches back to back
                assert not (a.op == "comm" and b.op == "comm"), where
            assert all(a.comms for a in actions if a.op == "comm"), where


def test_warmup_and_the_bound_on_micro_batches_held():
    for schedule, p, m, v in GRID:
        for s, actions in enumerate(all_stages(schedule, p, m, v)):
            where = f"{schedule} p={p} m={m} v={v} stage {s}"
            order, held = compute_of(actions), max(in_flight_trace(actions))
            warmup = pp.warmup_forwards(schedule, p, s, m, v)
            assert [op for op, _, _ in order[:warmup]] == ["F"] * warmup, where
            if warmup < m * v:   # the steady state opens with one forward, then one backward
                assert [op for op, _, _ in order[warmup:warmup + 2]] == ["F", "B"], where
            if schedule == "gpipe":
                assert held == m, where
            elif schedule == "1f1b":
                assert held == min(p - s, m), where
                assert warmup == min(p - s - 1, m)
            elif schedule == "zb-h1":
                # 1F1B's order of F and B, and stage s holds back s of its W passes:
                # it holds what 1F1B's first stage does, min(p, m), on every stage
                assert [a for a in order if a[0] != "W"] == pp.compute_order("1f1b", p, s, m), where
                assert held == min(p, m), where
                bs = [a[1] for a in order if a[0] == "B"]
                ws_after = [sum(1 for a in order[:order.index(("W", mb, None))] if a[0] == "B") for mb in bs]
                assert all(w == min(j + 1 + s, m) for j, w in enumerate(ws_after)), where
            else:   # interleaved: Megatron's warm-up, then one forward per backward
                want = m * v if m == p else min((v - 1) * p + 2 * (p - s - 1), m * v)
                assert warmup == want and held == min(warmup + 1, m * v), where
    # what the bound separates: 1F1B holds p - s, GPipe all m
    assert max(in_flight_trace(pp.build_schedule("1f1b", 4, 0, 16))) == 4
    assert max(in_flight_trace(pp.build_schedule("gpipe", 4, 0, 16))) == 16


def links(stages):
    """{(src, dst): ([what src sends, in its order], [what dst receives, in its order])}, each
    item (kind of tensor, micro-batch, virtual stage sending, virtual stage receiving)."""
    p, out = len(stages), {}
    for s, actions in enumerate(stages):
        for a in actions:
            for kind, mb, chunk in (a.comms if a.op == "comm" else ()):
                virtual = (chunk or 0) * p + s
                step = {SEND_ACT: 1, SEND_GRAD: -1, RECV_ACT: -1, RECV_GRAD: 1}[kind]
                tensor = "act" if kind in (SEND_ACT, RECV_ACT) else "grad"
                if kind in (SEND_ACT, SEND_GRAD):
                    out.setdefault((s, (s + step) % p), ([], []))[0].append((tensor, mb, virtual, virtual + step))
                else:
                    out.setdefault(((s + step) % p, s), ([], []))[1].append((tensor, mb, virtual + step, virtual))
    return out


def test_every_send_meets_its_receive_in_order_on_every_link():
    """NCCL matches the k-th send on a link with the k-th receive (it has no tags), so what
    the two ends expect must agree, item by item, in order."""
    for schedule, p, m, v in GRID:
        stages = all_stages(schedule, p, m, v)
        where = f"{schedule} p={p} m={m} v={v}"
        got = links(stages)
        for (src, dst), (sent, received) in got.items():
            assert sent == received, f"{where} link {src}->{dst}"
        every = sorted(item for sent, _ in got.values() for item in sent)
        want = sorted((t, mb, j, j + (1 if t == "act" else -1)) for mb in range(m) for j in range(p * v)
                      for t in ("act", "grad") if 0 <= j + (1 if t == "act" else -1) < p * v)
        assert every == want, where     # every activation forward and every gradient back, once
        if p == 1:
            assert all(a.op != "comm" for a in stages[0]), where


def test_communication_sits_next_to_its_computation():
    """A receive is in the last batch before the F or B that reads it, a send in the first
    batch after the F or B that produced it: the runner fills and pops in that order."""
    for schedule, p, m, v in GRID:
        for s, actions in enumerate(all_stages(schedule, p, m, v)):
            where = f"{schedule} p={p} m={m} v={v} stage {s}"
            batch_of = {key: i for i, a in enumerate(actions) if a.op == "comm" for key in a.comms}
            batches = [i for i, a in enumerate(actions) if a.op == "comm"]
            for i, a in enumerate(actions):
                if a.op not in ("F", "B"):
                    continue
                before = max((b for b in batches if b < i), default=None)
                after = min((b for b in batches if b > i), default=None)
                recv = (RECV_ACT if a.op == "F" else RECV_GRAD, a.mb, a.chunk)
                send = (SEND_ACT if a.op == "F" else SEND_GRAD, a.mb, a.chunk)
                if recv in batch_of:
                    assert batch_of[recv] == before, where
                if send in batch_of:
                    assert batch_of[send] == after, where


def simulate(stages):
    """Run every stage's action list under NCCL's rule; return {stage: stuck action}.

    Compute actions always proceed. A "comm" action posts all its ops at once and completes
    only when every op's counterpart, the op at the same place on the same directed link,
    is posted too: in the peer's current comm action, or one it completed. Nothing is
    buffered: a send waits for its receive, as a receive waits for its send. Empty result:
    every stage finished."""
    p = len(stages)
    place = {}     # (stage, action index, op) -> (link, end, position on the link)
    count = {}
    for s, actions in enumerate(stages):
        for i, a in enumerate(actions):
            for kind, mb, chunk in (a.comms if a.op == "comm" else ()):
                step = {SEND_ACT: 1, SEND_GRAD: -1, RECV_ACT: -1, RECV_GRAD: 1}[kind]
                end = "send" if kind in (SEND_ACT, SEND_GRAD) else "recv"
                link = (s, (s + step) % p) if end == "send" else ((s + step) % p, s)
                k = count[link, end] = count.get((link, end), -1) + 1
                place[s, i, (kind, mb, chunk)] = (link, end, k)
    pc, done = [0] * p, set()

    def posted(s):
        a = stages[s][pc[s]] if pc[s] < len(stages[s]) else None
        return {place[s, pc[s], op] for op in a.comms} if a is not None and a.op == "comm" else set()

    progress = True
    while progress:
        progress = False
        for s in range(p):
            while pc[s] < len(stages[s]):
                action = stages[s][pc[s]]
                if action.op == "comm":
                    wanted = []
                    for op in action.comms:
                        link, end, k = place[s, pc[s], op]
                        wanted.append(((link, "recv" if end == "send" else "send", k),
                                       link[1] if end == "send" else link[0]))
                    if not all(want in done or want in posted(peer) for want, peer in wanted):
                        break      # blocked: the next stage gets its turn
                    done |= posted(s)
                pc[s] += 1
                progress = True
    return {s: stages[s][pc[s]] for s in range(p) if pc[s] < len(stages[s])}


def batched_per_gap(schedule, p, s, m, v=1):
    """The same compute order with one batch between every two computations: 1F1B's
    batching, which interleaved does not use (see build_schedule)."""
    virtual, last = (lambda c: (c or 0) * p + s), p * v - 1
    actions, pending = [], []
    for op, mb, chunk in pp.compute_order(schedule, p, s, m, v):
        pending += [(RECV_ACT, mb, chunk)] if op == "F" and virtual(chunk) > 0 else []
        pending += [(RECV_GRAD, mb, chunk)] if op == "B" and virtual(chunk) < last else []
        actions += [Action("comm", comms=tuple(pending))] if pending else []
        pending = [(SEND_ACT, mb, chunk)] if op == "F" and virtual(chunk) < last else []
        pending += [(SEND_GRAD, mb, chunk)] if op == "B" and virtual(chunk) > 0 else []
        actions.append(Action(op, mb, chunk))
    return actions + ([Action("comm", comms=tuple(pending))] if pending else [])


def unfused(actions, sends_first=True):
    """The same list with every comm batch split into one blocking op per action."""
    out = []
    for a in actions:
        if a.op != "comm":
            out.append(a)
            continue
        ops = sorted(a.comms, key=lambda op: op[0] not in (SEND_ACT, SEND_GRAD)) if sends_first else a.comms
        out += [Action("comm", comms=(op,)) for op in ops]
    return out


def test_fused_schedules_never_deadlock_under_nccls_rule():
    for schedule, p, m, v in GRID:
        stuck = simulate(all_stages(schedule, p, m, v))
        assert stuck == {}, f"{schedule} p={p} m={m} v={v}: deadlock at {stuck}"


def test_simulator_finds_the_deadlocks_that_the_batching_removes():
    """Unfused 1F1B at p=2, m=2: stage 0 sends activation 1 and waits for its receive;
    stage 1 sends gradient 0 and waits for its receive. Each waits on the other."""
    fused = all_stages("1f1b", 2, 2)
    assert simulate(fused) == {}
    stuck = simulate([unfused(a) for a in fused])
    assert stuck == {0: Action("comm", comms=((SEND_ACT, 1, None),)), 1: Action("comm", comms=((SEND_GRAD, 0, None),))}
    # receives first deadlocks as well: only posting the pair together fixes it
    assert set(simulate([unfused(a, sends_first=False) for a in fused])) == {0, 1}
    # and the simulator is not against unfused lists as such: GPipe's never face each other
    assert simulate([unfused(a) for a in all_stages("gpipe", 2, 2)]) == {}
    # a receive that nobody answers is a deadlock too
    broken = [list(a) for a in fused]
    broken[1] = [a for a in broken[1] if a.comms != ((RECV_ACT, 0, None),)]
    assert simulate(broken) != {}
    # interleaved with 1F1B's batching (one batch between every F and B) deadlocks once
    # there is more than one round: Megatron's batching, one per (F, B) pair, does not
    for p, m, v in [(2, 4, 2), (4, 8, 2), (3, 9, 3)]:
        assert simulate([batched_per_gap("interleaved", p, s, m, v) for s in range(p)]) != {}
        assert simulate(all_stages("interleaved", p, m, v)) == {}


def test_stage_layers_partition_the_model_in_order():
    for num_layers, p in [(12, 1), (12, 2), (12, 3), (12, 4), (8, 8), (16, 4)]:
        ranges = [pp.stage_layers(num_layers, p, s) for s in range(p)]
        assert [i for r in ranges for i in r] == list(range(num_layers))
        assert all(len(r) == num_layers // p for r in ranges)


@pytest.mark.parametrize("num_layers,p,v", [(4, 1, 1), (12, 3, 1), (8, 8, 1), (8, 2, 2), (24, 4, 3)])
def test_stage_parts_put_the_embedding_first_and_the_head_last(num_layers, p, v):
    """Virtual stage c p + s holds its layers (part 1 + i); the first also the embedding (part
    0), the last the head (part L + 1): in virtual-stage order, the model's parts in order."""
    parts = [pp.stage_parts(num_layers, p, s, v, c) for c in range(v) for s in range(p)]
    assert [j for chunk in parts for j in chunk] == list(range(num_layers + 2))
    assert parts[0][0] == 0 and parts[-1][-1] == num_layers + 1
    for c in range(v):
        for s in range(p):
            layers = [1 + i for i in pp.stage_layers(num_layers, p, s, v, c)]
            ends = [j for j in pp.stage_parts(num_layers, p, s, v, c) if j not in layers]
            assert ends == [0] * (c * p + s == 0) + [num_layers + 1] * (c * p + s == p * v - 1)


# DualPipeV: the V's lists, checked the same ways -----------------------------------

V_GRID = [(p, m) for p in range(2, 9) for m in sorted({2 * p, 2 * p + 1, 16}) if m <= 16]


def halves_of(actions):   # the compute, each F&B as its forward, then its backward
    return [half for a in actions if a.op != "comm" for half in a.halves()]


def assert_each_micro_batch_down_the_v_and_back(p, m):
    """Every (micro-batch, chunk) has one F, one B, one W, in that order, on every stage; a
    micro-batch goes through chunk a before b forward, b before a back; an F&B pairs two."""
    for s in range(p):
        actions = pp.build_schedule("dualpipev", p, s, m, 2)
        order = halves_of(actions)
        where = f"dualpipev p={p} m={m} stage {s}"
        assert sorted(order) == sorted((op, mb, c) for op in "FBW" for mb in range(m)
                                       for c in (0, 1)), where
        for mb in range(m):
            at = {(op, c): order.index((op, mb, c)) for op in "FBW" for c in (0, 1)}
            assert at["F", 0] < at["F", 1] < at["B", 1] < at["B", 0], where
            assert at["B", 0] < at["W", 0] and at["B", 1] < at["W", 1], where
        for a in actions:
            if a.op == "F&B":
                assert [op for op, _, _ in a.halves()] == ["F", "B"], where
                assert a.mb[0] != a.mb[1] or a.chunk[0] != a.chunk[1], where


def v_links(stages):
    """{(src, dst): ([sent, in order], [received, in order])}: chunk a's activations go down the
    stages and its gradients up; chunk b's the other way; the turn's hand-overs cross no link."""
    out = {}
    for s, actions in enumerate(stages):
        for a in actions:
            for kind, mb, chunk in (a.comms if a.op == "comm" else ()):
                if kind in (pp.HAND_ACT, pp.HAND_GRAD):
                    continue
                down = (kind in (SEND_ACT, RECV_GRAD)) != (chunk == 1)   # toward s + 1
                tensor = "act" if kind in (SEND_ACT, RECV_ACT) else "grad"
                peer = s + 1 if down else s - 1
                if kind in (SEND_ACT, SEND_GRAD):
                    out.setdefault((s, peer), ([], []))[0].append((tensor, mb))
                else:
                    out.setdefault((peer, s), ([], []))[1].append((tensor, mb))
    return out


def test_dualpipev_runs_each_micro_batch_down_the_v_and_back_without_deadlock():
    """For p 2 to 8 and m from 2p to 16: the compute is DualPipeV's eight phases; on every link
    the k-th send meets the k-th receive, every tensor crosses once (2 (2p - 2) m: the V's 2p
    virtual stages less the turn's hand-overs); run under NCCL's rule, no stage deadlocks."""
    for p, m in V_GRID:
        assert_each_micro_batch_down_the_v_and_back(p, m)
        stages = all_stages("dualpipev", p, m, 2)
        for s, actions in enumerate(stages):
            assert [a for a in actions if a.op != "comm"] == \
                [Action(*entry) for entry in pp.dualpipev_order(p, s, m)]
        links = v_links(stages)
        for (src, dst), (sent, received) in links.items():
            assert sent == received and abs(src - dst) == 1, f"p={p} m={m} {src}->{dst}"
        assert sum(len(sent) for sent, _ in links.values()) == 2 * (2 * p - 2) * m
        assert all(events is not None for events in pp.simulate(stages)), f"p={p} m={m}"


def test_dualpipev_holds_2p_plus_1_micro_batches_of_a_chunk_where_1f1b_holds_2p():
    """Activations, in units of a chunk (L/2p layers) a micro-batch: DualPipeV's PP + 1 of
    DeepSeek's table, for its PP = 2p virtual stages, on every stage; 1F1B over 2p ranks of a chunk
    each holds 2p at its first."""
    for p, m in V_GRID:
        for s in range(p):
            assert max(k for k, _ in pp.held_counts("dualpipev", p, s, m, 2)) == 2 * p + 1
        assert max(k for k, _ in pp.held_counts("1f1b", 2 * p, 0, m, 1)) == 2 * p


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_dualpipevs_bubble_is_the_same_for_every_m_p_minus_1_times_two_stages_and_below_1f1bs(p):
    """Its lists simulated with a chunk's F, B, W times: the idle time a step is the same for
    every m (the warm-up and cool-down alone), p - 1 times that of 2 stages (the plan's
    v_bubble), and below 1F1B's (2p - 1)(F + B + W) on the same 2p virtual stages. DeepSeek's
    (p - 1)(F&B + B - 3W) takes F&B overlapped."""
    for times in ({"F": 1, "B": 1, "W": 1}, {"F": 1, "B": 2, "W": 1}, {"F": 1, "B": 1, "W": 0.5},
                  {"F": 1, "B": 3, "W": 2}, {"F": 0.7, "B": 0.4, "W": 0.1}):
        work = sum(times.values())
        two_stages = pp.simulate(all_stages("dualpipev", 2, 4, 2), times)
        idle = (p - 1) * (max(row[-1][4] for row in two_stages) - 8 * work)
        for m in (2 * p, 2 * p + 3, 4 * p):
            events = pp.simulate(all_stages("dualpipev", p, m, 2), times)
            span = max(row[-1][4] for row in events)
            assert span - 2 * m * work == pytest.approx(idle)
            assert pp.v_bubble(p, m, *times.values()) == pytest.approx(idle / span)
        assert idle < (2 * p - 1) * work


def w_twice(p, s, m):   # the defect: stage 0's first W run twice, its last dropped
    order = REAL_V_ORDER(p, s, m)
    ws = [k for k, entry in enumerate(order) if entry[0] == "W"]
    if s == 0:
        order[ws[-1]] = order[ws[0]]
    return order


def halves_one_micro_batch(p, s, m):   # the defect: an F&B's backward given its forward's mb
    return [("F&B", (entry[1][0], entry[1][0]), entry[2]) if entry[0] == "F&B" else entry
            for entry in REAL_V_ORDER(p, s, m)]


REAL_V_ORDER = pp.dualpipev_order


@pytest.mark.parametrize("defect", [w_twice, halves_one_micro_batch])
def test_each_defect_of_the_vs_order_fails_its_check(monkeypatch, defect):
    monkeypatch.setattr(pp, "dualpipev_order", defect)
    pp.v_schedules.cache_clear()
    try:
        with pytest.raises((AssertionError, RuntimeError, KeyError)):
            assert_each_micro_batch_down_the_v_and_back(4, 8)
    finally:
        monkeypatch.undo()
        pp.v_schedules.cache_clear()


# ----------------------------------------------------------------------------------
# 2. Pipeline training against serial autograd training
# ----------------------------------------------------------------------------------

def run_pp(tmp_path, world_size, micro_batches, schedule, num_layers=12, batch_size=None, dim=16,
           steps=3, optimizer="sgd", lr=0.1, seed=3, flags=()):
    """pipeline_parallel.main in-process (ranks forked from here); return the --save dict."""
    batch_size = batch_size or 2 * micro_batches
    save = tmp_path / f"pp{world_size}_m{micro_batches}_{schedule}.pt"
    pp.main(["--world-size", str(world_size), "--micro-batches", str(micro_batches), "--schedule", schedule,
             "--num-layers", str(num_layers), "--batch-size", str(batch_size), "--dim", str(dim),
             "--context", "4", "--steps", str(steps), "--optimizer", optimizer, "--lr", str(lr),
             "--seed", str(seed), "--save", str(save), *TIMEOUT, *NO_SAMPLE, *flags])
    return torch.load(save)


def assert_trained(result):
    """The weights moved far past the tolerance, so a gradient scale error would show."""
    moved = max((f - i).abs().max().item() for f, i in zip(final_params(result), init_of(result)))
    assert moved > 100 * ATOL


def assert_replays(result):   # the --save replayed in float64: losses and final weights
    losses, final = replay64(result)
    torch.testing.assert_close(torch.tensor(result["losses"], dtype=torch.float64),
                               torch.tensor(losses, dtype=torch.float64), atol=1e-5, rtol=1e-5)
    for got, want in zip(result["final_params"].values(), final):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def assert_matches_serial(result):
    config = result["config"]
    ref = serial_train(argparse.Namespace(**config))
    assert len(result["losses"]) == config["steps"]
    assert_same_training(result, ref)
    assert_trained(result)
    init = dp.tensors_of(dp.init_params(argparse.Namespace(**config)))
    assert all(torch.equal(a, b) for a, b in zip(init_of(result), init))


# A covering set rather than the 2 x 4 x 4 cross product: every p in 1..4 with both
# schedules, every m in {1, 2, 4, 5} at least twice, and m < p four times (2,1) (3,2)
# (4,2) (4,1), where 1F1B's warm-up is cut short by m. L = 12 is divided by every p.
@pytest.mark.parametrize("schedule,world_size,micro_batches", [
    ("gpipe", 1, 1), ("1f1b", 1, 2),
    ("gpipe", 2, 1), ("1f1b", 2, 4),
    ("gpipe", 3, 5), ("1f1b", 3, 2),
    ("gpipe", 4, 2), ("gpipe", 4, 4), ("1f1b", 4, 5), ("1f1b", 4, 1),
])
def test_pp_sgd_matches_serial(tmp_path, schedule, world_size, micro_batches):
    result = run_pp(tmp_path, world_size, micro_batches, schedule)
    config = result["config"]
    assert (config["world_size"], config["micro_batches"], config["schedule"]) == \
        (world_size, micro_batches, schedule)
    assert_follows_the_contract(result, flags=("world_size", "schedule"))
    assert_matches_serial(result)


def test_pp_adamw_matches_serial(tmp_path, capfd):
    """AdamW's eps amplifies summation order in the tiny gradients of some elements: --check, a
    step at a time from the run's own weights, as the deep runs below."""
    result = run_pp(tmp_path, 3, 3, "1f1b", optimizer="adamw", lr=0.01, flags=("--check",))
    assert result["config"]["optimizer"] == "adamw"
    assert_check_passed(capfd.readouterr().out, dp.CHECK_TOLERANCE)
    assert_trained(result)


# ZB-H1 at p = 2, 4, 8 from m = 1 up; interleaved at p = 2, 4, 8 with v = 2 and 3, from
# one round up (L = 24 divides into every p x v chunks; at D = 32 the signal lives through
# them, and the weights move); SGD and AdamW.
@pytest.mark.parametrize("schedule,world_size,micro_batches,virtual,optimizer", [
    ("zb-h1", 2, 1, None, "adamw"), ("zb-h1", 2, 3, None, "sgd"), ("zb-h1", 4, 2, None, "sgd"),
    ("zb-h1", 4, 6, None, "sgd"), ("zb-h1", 8, 8, None, "adamw"), ("zb-h1", 8, 3, None, "sgd"),
    ("interleaved", 2, 2, 2, "sgd"), ("interleaved", 2, 6, 3, "adamw"), ("interleaved", 4, 4, 3, "sgd"),
    ("interleaved", 4, 8, 2, "adamw"), ("interleaved", 8, 8, 3, "sgd"), ("interleaved", 8, 16, 3, "sgd"),
])
def test_zero_bubble_and_interleaved_match_serial(tmp_path, capfd, schedule, world_size, micro_batches, virtual,
                                                  optimizer):
    """SGD: the whole run against serial training's. AdamW, whose eps amplifies summation order
    in the deep model's tiny gradients: --check, a step at a time from the run's own weights."""
    check = ("--check",) if optimizer == "adamw" else ()
    result = run_pp(tmp_path, world_size, micro_batches, schedule, num_layers=24, dim=32, steps=2,
                    batch_size=8 * micro_batches,
                    optimizer=optimizer, lr=1.0 if optimizer == "sgd" else 0.01,
                    flags=(*check, *(("--virtual-stages", str(virtual)) if virtual else ())))
    assert result["config"]["schedule"] == schedule and result["config"]["virtual_stages"] == (virtual or 1)
    if check:
        assert_check_passed(capfd.readouterr().out, dp.CHECK_TOLERANCE)
        assert_trained(result)
    else:
        assert_matches_serial(result)


@pytest.mark.parametrize("world_size,micro_batches", [(2, 4), (4, 8), (2, 5)])
def test_dualpipev_replays_in_float64(tmp_path, world_size, micro_batches):
    """SGD, its --save replayed in float64 (the deep model's summation order stays in float32)."""
    result = run_pp(tmp_path, world_size, micro_batches, "dualpipev", num_layers=4 * world_size,
                    dim=16, steps=3, batch_size=2 * micro_batches, lr=0.3)
    assert result["config"]["schedule"] == "dualpipev" and result["config"]["virtual_stages"] == 2
    assert_replays(result)
    assert_trained(result)


@pytest.mark.parametrize("flags", [["--dp", "1", "--pp", "2", "--tp", "2", "--tp-style", "megatron"],
                                   ["--dp", "2", "--pp", "2", "--tp", "1", "--zero", "1"]])
def test_dualpipev_in_3d_replays_in_float64(tmp_path, flags):
    save = tmp_path / "run.pt"
    three_d.main([*flags, "--schedule", "dualpipev", "--num-layers", "4", "--micro-batches", "4",
                  "--batch-size", "16", "--dim", "16", "--context", "8", "--steps", "3",
                  "--optimizer", "sgd", "--lr", "0.3", "--save", str(save), *TIMEOUT, *NO_SAMPLE])
    assert_replays(torch.load(save))


def assert_the_v_holds_its_chunks(num_layers, p):
    """Chunk a of stage s is virtual stage s, chunk b 2p-1-s: stage 0 holds the embedding and the
    head, stage p-1 the two chunks around the turn; in virtual order, the model in order."""
    parts = {pp.virtual_stage("dualpipev", p, s, c): pp.stage_parts(num_layers, p, s, 2, c,
                                                                   "dualpipev")
             for s in range(p) for c in (0, 1)}
    assert [j for k in range(2 * p) for j in parts[k]] == list(range(num_layers + 2))
    assert pp.stage_parts(num_layers, p, 0, 2, 0, "dualpipev")[0] == 0
    assert pp.stage_parts(num_layers, p, 0, 2, 1, "dualpipev")[-1] == num_layers + 1
    turn = [pp.stage_parts(num_layers, p, p - 1, 2, c, "dualpipev") for c in (0, 1)]
    assert turn[1][0] == turn[0][-1] + 1                        # b takes up where a left off


def interleaved_placement(num_layers, num_stages, stage, num_chunks=1, chunk=0, schedule="1f1b"):
    return REAL_STAGE_PARTS(num_layers, num_stages, stage, num_chunks, chunk)   # c p + s


REAL_STAGE_PARTS = pp.stage_parts


@pytest.mark.parametrize("num_layers,p", [(4, 2), (8, 4), (16, 8), (24, 4)])
def test_the_v_holds_the_first_and_last_chunk_on_stage_0(monkeypatch, num_layers, p):
    assert_the_v_holds_its_chunks(num_layers, p)
    monkeypatch.setattr(pp, "stage_parts", interleaved_placement)   # the defect: c p + s
    with pytest.raises(AssertionError):
        assert_the_v_holds_its_chunks(num_layers, p)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_stash_taken_for_the_wrong_micro_batch_or_chunk_is_caught(tmp_path, monkeypatch, schedule):
    """B(mb) must take micro-batch mb's stash, of its own chunk, and W(mb) its (x, dz).

    Per chunk, every schedule here runs its backwards and its W passes in micro-batch
    order, so the stash B needs is always the oldest of its chunk's: popping the oldest
    would be no bug. Two bugs are: popping the newest, the wrong micro-batch in every
    schedule that holds two at once; and, interleaved, one stash for all of a stage's
    chunks, where chunk a's micro-batch 0 and chunk b's take the same place."""
    real_backward = pp.Stage.backward

    def backward(self, mb, g):                    # B(mb) runs on the newest stash, and the newest
        newest = next(reversed(self.stash))       # micro-batch gets mb's: nothing lost, all wrong
        self.stash[mb], self.stash[newest] = self.stash[newest], self.stash[mb]
        return real_backward(self, mb, g)
    monkeypatch.setattr(pp.Stage, "backward", backward)
    flags = ("--virtual-stages", "2") if schedule == "interleaved" else ()
    result = run_pp(tmp_path, 2, 4, schedule, num_layers=8, dim=8, steps=2, flags=flags)
    assert_wrong(result)
    if schedule == "interleaved":   # the right micro-batch, but one stash for both chunks: chunk
        monkeypatch.setattr(pp.Stage, "backward", real_backward)   # b's F(0) takes chunk a's
        shared, real_init = {}, pp.Stage.__init__                   # place, and B(0) of chunk
                                                                          # a finds nothing
        def one_stash_for_all_chunks(self, *args, **kwargs):
            real_init(self, *args, **kwargs)
            self.stash = shared
        monkeypatch.setattr(pp.Stage, "__init__", one_stash_for_all_chunks)
        with pytest.raises(RankFailed, match="KeyError: 0"):
            run_pp(tmp_path, 2, 4, schedule, num_layers=8, dim=8, steps=2, flags=flags)


def assert_wrong(result):
    """Far from serial training: correct runs stay within ATOL, float32's summation order."""
    ref = serial_train(argparse.Namespace(**result["config"]))
    worst = max((a - b).abs().max().item() for a, b in zip(final_params(result), final_params(ref)))
    assert worst > 30 * ATOL, worst


# ----------------------------------------------------------------------------------
# 3. Stage and run_schedule, driven directly
# ----------------------------------------------------------------------------------

class TracedStage(pp.Stage):
    """Stages that record which micro-batches they hold (a stash for B, or what W
    needs) around every F, B and W."""

    def __init__(self, *args, separate_w=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.trace, self.separate_w = [], separate_w

    def holding(self):
        return {("stash", mb) for mb in self.stash} | {("for W", mb) for mb in self.waiting_for_w}

    def forward(self, mb, x):
        before = self.holding()
        out = super().forward(mb, x)
        self.trace.append(("F", mb, before, self.holding()))
        return out

    def backward(self, mb, g):
        before = self.holding()
        dx = super().backward(mb, g)
        self.trace.append(("B", mb, before, self.holding()))
        return dx

    def weight_grads(self, mb):
        before = self.holding()
        super().weight_grads(mb)
        if self.separate_w:                     # ZB-H1: a W of its own
            self.trace.append(("W", mb, before, self.holding()))
        else:                                   # B's second half, run right after it
            op, b_mb, b_before, _ = self.trace.pop()
            self.trace.append((op, b_mb, b_before, self.holding()))


DIRECT = {"dim": 16, "heads": 4, "context": 3, "rows": 3, "layers_per_stage": 2, "seed": 5}
DIRECT_CASES = [(schedule, m) for schedule in SCHEDULES[:3] for m in (1, 3, 6)]   # p = 4: m < p, m > p


def direct_args(num_layers, batch_size):
    return argparse.Namespace(num_layers=num_layers, dim=DIRECT["dim"], heads=DIRECT["heads"], context=DIRECT["context"],
                              batch_size=batch_size, seed=DIRECT["seed"], vocab_size=dp.VOCAB_SIZE,
                              experts=0, kv_heads=2, ffn_dim=24, rope_theta=10000.0, qk_norm=True)


def direct_worker(rank, world_size, out_dir):
    setup(rank, world_size)
    dist.barrier()
    L = DIRECT["layers_per_stage"] * world_size
    init = dp.init_params(direct_args(L, 1))
    parts = pp.stage_parts(L, world_size, rank)
    blocks = dp.model_blocks(direct_args(L, 1))
    replica = dp.DataParallel([init[j] for j in parts], dist.new_subgroups(1)[0], optimizer="sgd", lr=0.1)
    first, last = rank == 0, rank == world_size - 1
    results = {}
    for schedule, m in DIRECT_CASES:
        batch_size = DIRECT["rows"] * m
        inputs, targets = dp.make_batch(direct_args(L, batch_size), step=0)
        layers = TracedStage(replica, range(len(parts)), blocks=[blocks[j] for j in parts], first=first,
                             last=last, num_micro_batches=m, mean_over=batch_size * DIRECT["context"],
                             separate_w=schedule == "zb-h1")
        actions = pp.build_schedule(schedule, world_size, rank, m)
        steps = []
        for _ in range(2):   # two steps on one Stage: nothing may be left over from the first
            replica.begin_step()
            layers.begin_step(targets.chunk(m))
            layers.trace = []
            recorder = pp.Recorder(inputs.device)
            pp.run_schedule(actions, [layers], inputs.chunk(m), rank - 1, rank + 1,
                            (batch_size // m, DIRECT["context"], DIRECT["dim"]),
                            recorder=recorder)
            replica.average()
            steps.append({"grads": [g.clone() for g in replica.grads()], "loss": float(layers.loss),
                          "stash_left": len(layers.stash) + len(layers.waiting_for_w),
                          "loss_grad_left": len(layers.loss_grad),
                          "peak_stash": recorder.peak, "trace": layers.trace})
        results[schedule, m] = steps
    torch.save(results, out_dir / f"rank{rank}.pt")
    cleanup()


def autograd_grads(num_layers, batch_size):
    args = direct_args(num_layers, batch_size)
    params = [w.requires_grad_() for w in dp.tensors_of(dp.init_params(args))]
    inputs, targets = dp.make_batch(args, step=0)
    loss = dp.serial_loss(params, inputs, targets, args)[0]
    loss.backward()
    return loss.item(), [w.grad for w in params]


def test_stage_stash_is_popped_by_its_own_backward_and_dw_is_autograds(tmp_path):
    world_size = 4
    spawn(direct_worker, world_size, tmp_path, timeout_s=10)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
    L = DIRECT["layers_per_stage"] * world_size
    for schedule, m in DIRECT_CASES:
        ref_loss, ref_grads = autograd_grads(L, DIRECT["rows"] * m)
        for s, results in enumerate(ranks):
            where = f"{schedule} m={m} stage {s}"
            for step in results[schedule, m]:
                assert step["stash_left"] == 0 and step["loss_grad_left"] == 0, where
                peak = {"gpipe": m, "1f1b": min(world_size - s, m), "zb-h1": min(world_size, m)}[schedule]
                assert step["peak_stash"] == peak, where
                # F(mb) stashes exactly mb; B(mb) takes exactly mb's stash, which was there, and
                # (ZB-H1) keeps what W needs; W(mb) takes exactly that
                sizes = []
                for op, mb, before, after in step["trace"]:
                    if op == "F":
                        assert ("stash", mb) not in before and after == before | {("stash", mb)}, where
                    elif op == "B" and schedule == "zb-h1":
                        assert ("stash", mb) in before, where
                        assert after == before - {("stash", mb)} | {("for W", mb)}, where
                    elif op == "B":
                        assert ("stash", mb) in before and after == before - {("stash", mb)}, where
                    else:
                        assert ("for W", mb) in before and after == before - {("for W", mb)}, where
                    sizes.append(len(after))
                assert sizes == in_flight_trace(pp.build_schedule(schedule, world_size, s, m)), where
                # dW summed over the micro-batches is autograd's gradient of the mean loss
                spans = dp.spans_of(dp.init_params(direct_args(L, 1)))
                parts = [i for j in pp.stage_parts(L, world_size, s) for i in spans[j]]   # its tensors
                assert len(step["grads"]) == len(parts), where
                for got, part in zip(step["grads"], parts):
                    torch.testing.assert_close(got, ref_grads[part], atol=ATOL, rtol=RTOL,
                                               msg=lambda msg: f"{where} part {part}: {msg}")
                if s == world_size - 1:
                    assert step["loss"] == pytest.approx(ref_loss, rel=1e-5), where
            # the two steps on one Stage (same weights) are identical: nothing carried over
            first_step, second_step = results[schedule, m]
            assert all(torch.equal(a, b) for a, b in zip(first_step["grads"], second_step["grads"])), where


# ----------------------------------------------------------------------------------
# 4, 5. dW accumulates over micro-batches; big messages do not deadlock
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", SCHEDULES)
def test_dw_accumulates_over_micro_batches(tmp_path, schedule):
    """m = 4 steps exactly like m = 1 (interleaved: 2, one round of 2 stages): dW summed,
    not overwritten, not averaged again."""
    few = 2 if schedule == "interleaved" else 1
    one = run_pp(tmp_path, 2, few, schedule, num_layers=4, batch_size=8)
    four = run_pp(tmp_path, 2, 4, schedule, num_layers=4, batch_size=8)
    assert_trained(one)
    assert_same_training(four, one)


def test_1f1b_does_not_deadlock_with_messages_past_gloos_buffer(tmp_path):
    """64 rows x 256 floats = 64 KiB per message: a blocking send would wait for its
    receive here. 1F1B's steady state then faces sends on both sides of every link."""
    result = run_pp(tmp_path, 4, 8, "1f1b", num_layers=4, batch_size=512, dim=256, steps=2)
    assert result["inputs"].shape == (2, 512, 4)
    assert_matches_serial(result)


# ----------------------------------------------------------------------------------
# 6. --timeline
# ----------------------------------------------------------------------------------

ROW = re.compile(r"^  stage (\d+) \|([^|]*)\| idle\s+([\d.]+)%$")
BLOCK = re.compile(r"^as (scheduled|measured).*: the stages idle ([\d.]+)% of the time$")
BUBBLE = re.compile(r"^bubble: theory (\S+) = ([\d.]+)%; the most micro-batches a stage held at once: ([\d, ]+)$")
LABEL = re.compile(r"([FBW])(\d*)([a-h]?)-*")
THEORY = {"gpipe": "(p-1)/(m+p-1)", "1f1b": "(p-1)/(m+p-1)", "zb-h1": "(p-1)/(3m+p-1)",
          "interleaved": "(p-1)/(vm+p-1)"}


def test_with_equal_step_times_the_schedules_idle_as_the_theory_says():
    """The schedule's own bubble, run by simulate() with F, B and W one unit each and every
    batch waited for as run_schedule() does, is the textbook's wherever its formula holds
    (ZB-H1's needs m >= p): (p-1)/(m+p-1), (p-1)/(3m+p-1), (p-1)/(vm+p-1)."""
    for schedule, p, m, v in GRID:
        rows = pp.simulate(all_stages(schedule, p, m, v))
        end = max(row[-1][4] for row in rows)
        idle = sum(1 - sum(t1 - t0 for *_, t0, t1 in row) / end for row in rows) / p
        if schedule != "zb-h1" or m >= p:
            assert idle == pytest.approx(pp.pipeline_costs(schedule, p, 0, m, v)[0], abs=1e-12), (schedule, p, m, v)
        assert [[e[:3] for e in row] for row in rows] == [
            [(op, mb, c or 0) for op, mb, c in pp.compute_order(schedule, p, s, m, v)] for s in range(p)]
    # and a list that deadlocks comes back as None for the stages that never finish
    fused = all_stages("1f1b", 2, 2)
    assert pp.simulate([[a for a in fused[0] if a.comms != ((SEND_ACT, 0, None),)], fused[1]]) == [None, None]


@pytest.mark.parametrize("schedule,world_size,micro_batches,virtual", [
    ("1f1b", 3, 4, 1), ("gpipe", 4, 2, 1), ("zb-h1", 3, 4, 1), ("interleaved", 2, 4, 2)])
def test_timeline_rows_bubble_and_peak_stash(tmp_path, capfd, schedule, world_size, micro_batches, virtual):
    result = run_pp(tmp_path, world_size, micro_batches, schedule, num_layers=world_size * virtual, steps=2,
                    flags=("--timeline", *(["--virtual-stages", str(virtual)] if virtual > 1 else [])))
    assert_matches_serial(result)     # drawing the timeline does not change training
    lines = capfd.readouterr().out.splitlines()
    p, m, v = world_size, micro_batches, virtual
    blocks = [i for i, line in enumerate(lines) if BLOCK.match(line)]
    assert [BLOCK.match(lines[i])[1] for i in blocks] == ["scheduled", "measured"]
    for i in blocks:
        rows = [ROW.match(line) for line in lines[i + 1:i + 1 + p]]
        assert [int(r[1]) for r in rows] == list(range(p))       # one row per stage, in order
        for s, row in enumerate(rows):
            assert len(lines[i + 1 + s]) <= 100 and set(row[2]) <= set("FBW0123456789ab-.")
            labels = LABEL.findall(row[2])                        # every F, B and W, in order
            order = pp.compute_order(schedule, p, s, m, v)
            assert [op for op, _, _ in labels] == [op for op, _, _ in order]
            for (op, mb, c), want in zip(labels, order):          # named in full where it fits
                assert not mb or int(mb) == want[1] and (c == "" if v == 1 else "ab".index(c) == want[2])
        idle = [float(r[3]) for r in rows]
        assert float(BLOCK.match(lines[i])[2]) == pytest.approx(sum(idle) / p, abs=0.1)
        if BLOCK.match(lines[i])[1] == "scheduled":   # equal step times: the theory's bubble
            assert float(BLOCK.match(lines[i])[2]) == pytest.approx(100 * pp.pipeline_costs(schedule, p, 0, m, v)[0],
                                                                   abs=0.05)
            assert all(mb for r in rows for _, mb, _ in LABEL.findall(r[2]))   # all in full, small sizes
    bubble = [BUBBLE.match(line) for line in lines if BUBBLE.match(line)]
    assert len(bubble) == 1 and bubble[0][1] == THEORY[schedule]
    assert float(bubble[0][2]) == pytest.approx(100 * {"zb-h1": (p - 1) / (3 * m + p - 1)}.get(
        schedule, (p - 1) / (v * m + p - 1)), abs=0.05)
    assert [int(n) for n in bubble[0][3].split(",")] == [
        max(in_flight_trace(pp.build_schedule(schedule, p, s, m, v))) for s in range(p)]
    # a legend for every glyph, and for the schedules; the load named when stages outnumber cores
    legend = " ".join(lines[:blocks[0]])
    assert all(glyph in legend for glyph in ("F3 = forward of micro-batch 3", "B3 = its backward", "W3 = its dW",
                                             "'-' the rest of a step", "'.' idle"))
    assert any("a>3 send activation 3 on, >a3 receive it, <g3 send gradient 3 back, g<3 receive it" in line
               for line in lines)
    noted = any(line.startswith(f"note: {p} stages share ") for line in lines)
    assert noted == (p > os.cpu_count())
    assert all(len(line) <= 100 for line in lines)
    # the printed schedule of every stage is the one built from the same flags (wrapped at 100
    # columns); interleaved, with each stage's layers by chunk, once
    printed = "\n".join(lines).replace("\n          ", " ").splitlines()
    for s in range(p):
        text = " ".join(map(str, pp.build_schedule(schedule, p, s, m, v)))
        assert f"[stage {s}] {text}" in printed
        if v > 1:
            owns = ", ".join(f"{'ab'[c]} {list(pp.stage_layers(p * v, p, s, v, c))}" for c in range(v))
            assert lines.count(f"[stage {s}] layers {owns}") == 1


# ----------------------------------------------------------------------------------
# 7, 8. Bad input; --check from the command line
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,flag", [
    (["--num-layers", "6", "--world-size", "4"], "--num-layers"),
    (["--batch-size", "10", "--micro-batches", "4"], "--batch-size"),
    (["--schedule", "foo"], "--schedule"),
    (["--world-size", "5", "--num-layers", "4"], "--world-size"),
    (["--micro-batches", "0"], "--micro-batches"),
    (["--schedule", "dualpipev", "--world-size", "2", "--micro-batches", "3", "--batch-size", "6"],
     "--schedule"),                                            # below 2p: no steady state
    (["--schedule", "dualpipev", "--virtual-stages", "3"], "--virtual-stages"),
    (["--schedule", "dualpipev", "--world-size", "4", "--num-layers", "4"], "--schedule"),
])
def test_bad_input_exits_2_with_one_line(argv, flag, monkeypatch, capsys):
    started = []
    monkeypatch.setattr(pp, "spawn", lambda *a, **k: started.append(a))
    with pytest.raises(SystemExit) as exited:
        pp.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.endswith("\n")
    assert "error" in err and "Traceback" not in err
    # the first flag the message names is the one at fault ("--world-size 5: more stages
    # than --num-layers (4)", not "--num-layers 4 is not divisible by --world-size (5)")
    assert re.search(r"--[a-z-]+", err.split("error:", 1)[1]).group(0) == flag
    assert started == []


def test_check_passes_a_correct_adamw_run_whose_gradient_is_near_eps(tmp_path, capfd):
    """A correct run whose final weights once ended 1.7e-3 from serial training's: one
    gradient element is below 1e-7, near AdamW's eps, and summing 7 micro-batches in another
    order moves its AdamW step by up to lr. Checked a step at a time from the run's own
    weights, the optimizer steps on the same numbers, and every figure is a rounding's."""
    pp.main(["--world-size", "1", "--num-layers", "8", "--dim", "24", "--context", "4", "--batch-size", "14",
             "--micro-batches", "7", "--optimizer", "adamw", "--lr", "0.01", "--steps", "4", "--seed", "2594",
             "--check", *TIMEOUT])
    figures, verdict = check_report(capfd.readouterr().out)
    assert verdict == "OK"
    assert figures["gradients"][0] < 1e-5 and figures["losses"][0] < 1e-5
    assert figures["weights after an update"][0] <= 2**-20


@pytest.mark.deadline(60)
def test_check_passes_from_the_command_line():
    proc = subprocess.run([sys.executable, "pipeline_parallel.py", "--world-size", "2", "--steps", "3",
                           "--check", *TIMEOUT], cwd=REPO, capture_output=True, text=True, timeout=55)
    assert proc.returncode == 0, proc.stderr
    assert_check_passed(proc.stdout, dp.CHECK_TOLERANCE)


# ----------------------------------------------------------------------------------
# 9. What real training adds: --recompute, --clip-grad over the stages, --bf16
# ----------------------------------------------------------------------------------

STASH_ROW = re.compile(r"^  (\d+) +(\d+) +(\d+) +(\d+)   \((\d+) x (\d+) \+ (\d+) x (\d+)\) x (\d+) = (\d+)"
                       r"  predicted (\d+)$")


def stash_table(out):
    """{stage: (F to B, B to W, bytes counted, bytes by the formula)} from the stash table."""
    rows = [STASH_ROW.match(line) for line in out.splitlines() if STASH_ROW.match(line)]
    assert all(r[4] == r[11] for r in rows), rows     # pipeline_costs() predicts what was counted
    return {int(r[1]): (int(r[2]), int(r[3]), int(r[4]), int(r[10])) for r in rows}


@pytest.mark.parametrize("schedule,micro_batches,flags", [
    ("1f1b", 8, ()), ("gpipe", 4, ()), ("zb-h1", 8, ()), ("interleaved", 8, ("--virtual-stages", "2"))])
def test_recompute_is_bitwise_the_same_and_its_stash_is_counted(tmp_path, capfd, schedule, micro_batches, flags):
    """--recompute: the same losses and weights, bit for bit; each stage's stash at its
    largest, counted from the tensors held, equals the formula, with and without; and it is
    smaller with it on every stage, the last one too, which holds one micro-batch at a time:
    each micro-batch keeps its layers' x alone, as step 2 does."""
    runs, tables = [], []
    for recompute in ((), ("--recompute",)):
        folder = tmp_path / str(bool(recompute))
        folder.mkdir()
        runs.append(run_pp(folder, 4, micro_batches, schedule, num_layers=8, batch_size=2 * micro_batches,
                           flags=(*flags, *recompute)))
        tables.append(stash_table(capfd.readouterr().out))
    assert_same_bits(*runs)
    assert runs[1]["config"]["recompute"]
    for table in tables:
        assert sorted(table) == [0, 1, 2, 3] and all(counted == formula for _, _, counted, formula in table.values())
    (without, with_recompute) = tables
    b, T, D, h = 2, 4, 16, 4                             # a micro-batch's rows, --context, --dim, --heads
    A = b * T * D * 4                                    # [b, T, D] of floats
    K = A // 2                                           # k, v: G = h/2 kv heads
    M = 3 * A                                            # a, up, u: F = 48 = 3 D
    kept = 6 * A + 2 * K + 3 * M + 2 * b * T * 4 + b * h * T * 4   # x n1 q o x' n2, k v, a up u; r1 r2; lse
    waiting = 6 * A + 2 * K + 3 * M + 2 * D * 4          # n1 dq o dy1 n2 dy2, dk dv, da dup u; two gains' dg
    blocks = 2 // (1 + bool(flags))                      # a stage's (interleaved: a chunk's)
    for s in range(4):
        assert without[s][2] == (without[s][0] * kept + without[s][1] * waiting) * blocks
        assert with_recompute[s][2] == (with_recompute[s][0] * A + with_recompute[s][1] * waiting) * blocks
        assert with_recompute[s][2] < without[s][2]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_clip_grad_sums_the_norm_over_the_stages(tmp_path, capfd, schedule):
    """Each stage holds its own layers' gradients: the norm's squares are summed over the
    stages, or each would clip by its own part's norm (as torchtitan once shipped)."""
    config = dict(num_layers=12, dim=16, heads=4, context=4, batch_size=8, seed=3, optimizer="sgd", lr=0.1,
                  steps=3)
    clip = clip_between(config)
    result = run_pp(tmp_path, 3, 4, schedule, flags=("--clip-grad", str(clip)))
    assert_clipped_some(capfd.readouterr().out)
    assert_matches_serial(result)


def test_bf16_pipeline_checks_within_its_tolerance(tmp_path, capfd):
    run_pp(tmp_path, 2, 4, "1f1b", optimizer="adamw", lr=0.01, flags=("--bf16", "--check"))
    assert_check_passed(capfd.readouterr().out, dp.bf16_tolerance())
