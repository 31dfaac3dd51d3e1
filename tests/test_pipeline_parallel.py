"""Tests for pipeline_parallel.py: every number is compared with a single-process reference.

1. Schedules without processes, for every p in 1..8, m in 1..16 and both schedules:
   one F and one B per micro-batch, B after F; 1F1B's warm-up and in-flight bound;
   sends pair in order with the neighbour's receives; and a simulator that runs the
   lists under NCCL's rule (a send completes only when its receive is posted) finds
   no deadlock, while it does find one in the unfused 1F1B lists.
2. Pipeline training (in-process main(), ranks forked) against data_parallel.serial_train.
3. StageLayers + run_schedule driven directly: each micro-batch's stash is popped by its own
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
import torch.nn.functional as F

import data_parallel as dp
import pipeline_parallel as pp
from collectives import cleanup, setup, spawn
from common import assert_check_passed, assert_same_training, check_report
from pipeline_parallel import RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, Action

REPO = Path(__file__).resolve().parent.parent

# Float32, differences only from summation order.
ATOL = 1e-5
RTOL = 1e-5
TIMEOUT = ["--timeout-s", "10"]   # a deadlocked rank fails in 10 s, inside the test's deadline

SCHEDULES = ["gpipe", "1f1b"]
GRID = [(schedule, p, m) for schedule in SCHEDULES for p in range(1, 9) for m in range(1, 17)]


def all_stages(schedule, p, m):
    return [pp.build_schedule(schedule, p, s, m) for s in range(p)]


def compute_of(actions):
    return [(a.op, a.mb) for a in actions if a.op != "comm"]


def comm_sequence(actions, kind):
    """The micro-batches of one point-to-point kind, in the order the stage posts them."""
    return [mb for a in actions if a.op == "comm" for k, mb in a.comms if k == kind]


def in_flight_trace(actions):
    """Micro-batches whose F is done and whose B is not, after each compute action."""
    live, trace = set(), []
    for op, mb in compute_of(actions):
        if op == "F":
            live.add(mb)
        else:
            live.discard(mb)
        trace.append(len(live))
    return trace


# ----------------------------------------------------------------------------------
# 1. Schedules as data, checked without processes
# ----------------------------------------------------------------------------------

def test_every_micro_batch_has_one_forward_then_one_backward():
    for schedule, p, m in GRID:
        for s, actions in enumerate(all_stages(schedule, p, m)):
            where = f"{schedule} p={p} m={m} stage {s}"
            order = compute_of(actions)
            assert len(order) == 2 * m, where
            for mb in range(m):
                assert order.count(("F", mb)) == 1 and order.count(("B", mb)) == 1, where
                assert order.index(("F", mb)) < order.index(("B", mb)), where
            # F and B each go through the micro-batches in order
            assert [mb for op, mb in order if op == "F"] == list(range(m)), where
            assert [mb for op, mb in order if op == "B"] == list(range(m)), where
            # the comm actions only add point-to-point: the compute order is compute_order's
            assert order == pp.compute_order(schedule, p, s, m), where
            for a, b in zip(actions, actions[1:]):   # fused: never two batches back to back
                assert not (a.op == "comm" and b.op == "comm"), where
            assert all(a.comms for a in actions if a.op == "comm"), where
            assert all(a.op in ("F", "B", "comm") for a in actions), where


def test_1f1b_warmup_and_in_flight_bound():
    for schedule, p, m in GRID:
        for s, actions in enumerate(all_stages(schedule, p, m)):
            where = f"{schedule} p={p} m={m} stage {s}"
            order, trace = compute_of(actions), in_flight_trace(actions)
            if schedule == "gpipe":
                assert order[:m] == [("F", mb) for mb in range(m)], where
                assert max(trace) == m, where
                continue
            warmup = min(p - s - 1, m)
            assert [op for op, _ in order[:warmup]] == ["F"] * warmup, where
            if warmup < m:   # the steady state opens with one forward, then one backward
                assert [op for op, _ in order[warmup:warmup + 2]] == ["F", "B"], where
                # ... and alternates until the forwards run out; then it only drains
                steady = [op for op, _ in order[warmup:warmup + 2 * (m - warmup)]]
                assert steady == ["F", "B"] * (m - warmup), where
                assert all(op == "B" for op, _ in order[warmup + 2 * (m - warmup):]), where
            assert max(trace) <= p - s, where
            assert max(trace) == min(p - s, m), where
    # the in-flight bound is what separates 1F1B from GPipe once m > p
    assert max(in_flight_trace(pp.build_schedule("1f1b", 4, 0, 16))) == 4
    assert max(in_flight_trace(pp.build_schedule("gpipe", 4, 0, 16))) == 16


def test_every_send_pairs_with_a_receive_on_the_neighbour():
    for schedule, p, m in GRID:
        stages = all_stages(schedule, p, m)
        where = f"{schedule} p={p} m={m}"
        assert comm_sequence(stages[0], RECV_ACT) == [] and comm_sequence(stages[0], SEND_GRAD) == [], where
        assert comm_sequence(stages[-1], RECV_GRAD) == [] and comm_sequence(stages[-1], SEND_ACT) == [], where
        for s in range(p - 1):
            sent = comm_sequence(stages[s], SEND_ACT)
            assert sent == comm_sequence(stages[s + 1], RECV_ACT), f"{where} activations {s}->{s + 1}"
            assert sorted(sent) == list(range(m)), where
            back = comm_sequence(stages[s + 1], SEND_GRAD)
            assert back == comm_sequence(stages[s], RECV_GRAD), f"{where} gradients {s + 1}->{s}"
            assert sorted(back) == list(range(m)), where
        if p == 1:
            assert all(a.op != "comm" for a in stages[0]), where


def test_communication_sits_next_to_its_computation():
    """A receive comes before the F or B that reads it, a send after the F or B that
    produced it: the runner pops outputs[mb] / fills activations[mb] in that order."""
    for schedule, p, m in GRID:
        for s, actions in enumerate(all_stages(schedule, p, m)):
            where = f"{schedule} p={p} m={m} stage {s}"
            at = {}
            for i, a in enumerate(actions):
                for key in (a.comms if a.op == "comm" else [(a.op, a.mb)]):
                    at[key] = i
            for mb in range(m):
                if s > 0:
                    assert at[RECV_ACT, mb] < at["F", mb] < at[SEND_GRAD, mb], where
                    assert at[SEND_GRAD, mb] == at["B", mb] + 1, where    # sent right after
                if s < p - 1:
                    assert at["F", mb] < at[SEND_ACT, mb] <= at[RECV_GRAD, mb] < at["B", mb], where
                    assert at[SEND_ACT, mb] == at["F", mb] + 1, where
                    assert at[RECV_GRAD, mb] == at["B", mb] - 1, where    # received right before


# Each point-to-point op and the op that completes it on the neighbour: (offset, kind).
COUNTERPART = {SEND_ACT: (+1, RECV_ACT), RECV_ACT: (-1, SEND_ACT),
               SEND_GRAD: (-1, RECV_GRAD), RECV_GRAD: (+1, SEND_GRAD)}


def simulate(stages):
    """Run every stage's action list under NCCL's rule; return {stage: stuck action}.

    Compute actions always proceed. A "comm" action posts all its ops at once and
    completes only when every op's counterpart is posted too: in the neighbour's
    current comm action, or completed already. Nothing is buffered: a send waits for
    its receive, as a receive waits for its send. Empty result: every stage finished.
    """
    p = len(stages)
    pc = [0] * p
    done = [set() for _ in range(p)]

    def posted(s):
        if pc[s] < len(stages[s]) and stages[s][pc[s]].op == "comm":
            return set(stages[s][pc[s]].comms)
        return set()

    progress = True
    while progress:
        progress = False
        for s in range(p):
            while pc[s] < len(stages[s]):
                action = stages[s][pc[s]]
                if action.op == "comm":
                    for kind, mb in action.comms:
                        offset, other = COUNTERPART[kind]
                        peer = s + offset
                        if not (0 <= peer < p and ((other, mb) in posted(peer) or (other, mb) in done[peer])):
                            break
                    else:
                        done[s].update(action.comms)
                        pc[s] += 1
                        progress = True
                        continue
                    break      # blocked: the next stage gets its turn
                pc[s] += 1     # F or B
                progress = True
    return {s: stages[s][pc[s]] for s in range(p) if pc[s] < len(stages[s])}


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
    for schedule, p, m in GRID:
        stuck = simulate(all_stages(schedule, p, m))
        assert stuck == {}, f"{schedule} p={p} m={m}: deadlock at {stuck}"


def test_simulator_finds_the_deadlock_that_fusion_removes():
    """Unfused 1F1B at p=2, m=2: stage 0 sends activation 1 and waits for its receive;
    stage 1 sends gradient 0 and waits for its receive. Each waits on the other."""
    fused = all_stages("1f1b", 2, 2)
    assert simulate(fused) == {}
    stuck = simulate([unfused(a) for a in fused])
    assert stuck == {0: Action("comm", comms=((SEND_ACT, 1),)), 1: Action("comm", comms=((SEND_GRAD, 0),))}
    # receives first deadlocks as well: only posting the pair together fixes it
    assert set(simulate([unfused(a, sends_first=False) for a in fused])) == {0, 1}
    # and the simulator is not against unfused lists as such: GPipe's never face each other
    assert simulate([unfused(a) for a in all_stages("gpipe", 2, 2)]) == {}
    # a receive that nobody answers is a deadlock too
    broken = [list(a) for a in fused]
    broken[1] = [a for a in broken[1] if a.comms != ((RECV_ACT, 0),)]
    assert simulate(broken) != {}


def test_stage_layers_partition_the_model_in_order():
    for num_layers, p in [(12, 1), (12, 2), (12, 3), (12, 4), (8, 8), (16, 4)]:
        ranges = [pp.stage_layers(num_layers, p, s) for s in range(p)]
        assert [i for r in ranges for i in r] == list(range(num_layers))
        assert all(len(r) == num_layers // p for r in ranges)


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
             "--steps", str(steps), "--optimizer", optimizer, "--lr", str(lr), "--seed", str(seed),
             "--save", str(save), *TIMEOUT, *flags])
    return torch.load(save)


def assert_trained(result):
    """The weights moved far past the tolerance, so a gradient scale error would show."""
    moved = max((f - i).abs().max().item() for f, i in zip(result["final_weights"], result["init_weights"]))
    assert moved > 100 * ATOL


def assert_matches_serial(result):
    config = result["config"]
    ref = dp.serial_train(argparse.Namespace(**config))
    assert len(result["losses"]) == config["steps"]
    assert_same_training(result, ref)
    assert_trained(result)
    init = dp.init_weights(config["num_layers"], config["dim"], config["seed"])
    assert all(torch.equal(a, b) for a, b in zip(result["init_weights"], init))


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
    assert len(result["final_weights"]) == 12 and all(w.shape == (16, 16) for w in result["final_weights"])
    assert_matches_serial(result)


def test_pp_adamw_matches_serial(tmp_path):
    result = run_pp(tmp_path, 3, 3, "1f1b", optimizer="adamw", lr=0.01)
    assert result["config"]["optimizer"] == "adamw"
    assert_matches_serial(result)


# ----------------------------------------------------------------------------------
# 3. StageLayers and run_schedule, driven directly
# ----------------------------------------------------------------------------------

class TracedStage(pp.StageLayers):
    """StageLayers that record which micro-batches its stash holds around every F and B."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trace = []

    def forward(self, mb, x):
        before = set(self.stash)
        out = super().forward(mb, x)
        self.trace.append(("F", mb, before, set(self.stash)))
        return out

    def backward(self, mb, g):
        before = set(self.stash)
        dx = super().backward(mb, g)
        self.trace.append(("B", mb, before, set(self.stash)))
        return dx


DIRECT = {"dim": 12, "rows": 3, "layers_per_stage": 2, "seed": 5}
DIRECT_CASES = [(schedule, m) for schedule in SCHEDULES for m in (1, 3, 6)]   # p = 4: m < p, m > p


def direct_batch(num_layers, batch_size):
    args = argparse.Namespace(num_layers=num_layers, dim=DIRECT["dim"], batch_size=batch_size,
                              seed=DIRECT["seed"])
    return dp.make_batch(args)


def direct_worker(rank, world_size, out_dir):
    setup(rank, world_size)
    dist.barrier()
    D, L = DIRECT["dim"], DIRECT["layers_per_stage"] * world_size
    full = dp.init_weights(L, D, DIRECT["seed"])
    weights = [full[i] for i in pp.stage_layers(L, world_size, rank)]
    first, last = rank == 0, rank == world_size - 1
    results = {}
    for schedule, m in DIRECT_CASES:
        batch_size = DIRECT["rows"] * m
        inputs, targets = direct_batch(L, batch_size)
        layers = TracedStage(weights, first, last, targets.chunk(m), n=batch_size * D)
        actions = pp.build_schedule(schedule, world_size, rank, m)
        steps = []
        for _ in range(2):   # two steps on one StageLayers: nothing may be left over from the first
            layers.grads = [torch.zeros_like(w) for w in weights]
            layers.loss, layers.trace = 0.0, []
            pp.run_schedule(actions, layers, inputs.chunk(m), rank - 1, rank + 1, (batch_size // m, D))
            steps.append({"grads": [g.clone() for g in layers.grads], "loss": layers.loss,
                          "stash_left": len(layers.stash), "loss_grad_left": len(layers.loss_grad),
                          "peak_stash": layers.peak_stash, "trace": layers.trace})
        results[schedule, m] = steps
    torch.save(results, out_dir / f"rank{rank}.pt")
    cleanup()


def autograd_grads(num_layers, batch_size):
    weights = [w.requires_grad_() for w in dp.init_weights(num_layers, DIRECT["dim"], DIRECT["seed"])]
    inputs, targets = direct_batch(num_layers, batch_size)
    out = inputs
    for w in weights:
        out = F.gelu(out @ w)
    loss = F.mse_loss(out, targets)
    loss.backward()
    return loss.item(), [w.grad for w in weights]


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
                peak = min(world_size - s, m) if schedule == "1f1b" else m
                assert step["peak_stash"] == peak, where
                # F(mb) adds exactly mb; B(mb) removes exactly mb, which was there
                sizes = []
                for op, mb, before, after in step["trace"]:
                    if op == "F":
                        assert mb not in before and after == before | {mb}, where
                    else:
                        assert mb in before and after == before - {mb}, where
                    sizes.append(len(after))
                assert sizes == in_flight_trace(pp.build_schedule(schedule, world_size, s, m)), where
                # dW summed over the micro-batches is autograd's gradient of the mean loss
                layers = pp.stage_layers(L, world_size, s)
                assert len(step["grads"]) == len(layers), where
                for got, layer in zip(step["grads"], layers):
                    torch.testing.assert_close(got, ref_grads[layer], atol=ATOL, rtol=RTOL,
                                               msg=lambda msg: f"{where} layer {layer}: {msg}")
                if s == world_size - 1:
                    assert step["loss"] == pytest.approx(ref_loss, rel=1e-5), where
            # the two steps on one StageLayers (same weights) are identical: nothing carried over
            first_step, second_step = results[schedule, m]
            assert all(torch.equal(a, b) for a, b in zip(first_step["grads"], second_step["grads"])), where


# ----------------------------------------------------------------------------------
# 4, 5. dW accumulates over micro-batches; big messages do not deadlock
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", SCHEDULES)
def test_dw_accumulates_over_micro_batches(tmp_path, schedule):
    """m = 4 steps exactly like m = 1: dW summed (not overwritten, not averaged again)."""
    one = run_pp(tmp_path, 2, 1, schedule, num_layers=4, batch_size=8)
    four = run_pp(tmp_path, 2, 4, schedule, num_layers=4, batch_size=8)
    assert_trained(one)
    assert_same_training(four, one)


def test_1f1b_does_not_deadlock_with_messages_past_gloos_buffer(tmp_path):
    """64 rows x 256 floats = 64 KiB per message: a blocking send would wait for its
    receive here. 1F1B's steady state then faces sends on both sides of every link."""
    result = run_pp(tmp_path, 4, 8, "1f1b", num_layers=4, batch_size=512, dim=256, steps=2)
    assert result["inputs"].shape == (512, 256)
    assert_matches_serial(result)


# ----------------------------------------------------------------------------------
# 6. --timeline
# ----------------------------------------------------------------------------------

ROW = re.compile(r"^  stage (\d+) \|([^|]*)\| idle\s+([\d.]+)%, peak stash (\d+)$")
BUBBLE = re.compile(r"^bubble: measured ([\d.]+)% .*theory \(p-1\)/\(m\+p-1\) = ([\d.]+)%$")
LABEL = re.compile(r"([FB])(\d+)-*")


@pytest.mark.parametrize("schedule,world_size,micro_batches", [("1f1b", 3, 4), ("gpipe", 4, 2)])
def test_timeline_rows_bubble_and_peak_stash(tmp_path, capfd, schedule, world_size, micro_batches):
    result = run_pp(tmp_path, world_size, micro_batches, schedule, num_layers=world_size, steps=2,
                    flags=("--timeline",))
    assert_matches_serial(result)     # drawing the timeline does not change training
    lines = capfd.readouterr().out.splitlines()
    rows = [ROW.match(line) for line in lines if ROW.match(line)]
    assert [int(r.group(1)) for r in rows] == list(range(world_size))     # one row per stage, in order
    for s, row in enumerate(rows):
        # every F and B of the stage, in its schedule's order, each labelled in full
        drawing = row.group(2)
        assert len(drawing) >= 96 and set(drawing) <= set("FB0123456789-.")
        labels = [(op, int(mb)) for op, mb in LABEL.findall(drawing.replace(".", " "))]
        assert labels == pp.compute_order(schedule, world_size, s, micro_batches)
        assert 0.0 <= float(row.group(3)) <= 100.0
        expected_peak = min(world_size - s, micro_batches) if schedule == "1f1b" else micro_batches
        assert int(row.group(4)) == expected_peak
    bubbles = [BUBBLE.match(line) for line in lines if BUBBLE.match(line)]
    assert len(bubbles) == 1
    p, m = world_size, micro_batches
    assert float(bubbles[0].group(2)) == pytest.approx(100 * (p - 1) / (m + p - 1), abs=0.05)
    # the measured bubble is the mean of the rows' idle shares
    idle = [float(r.group(3)) for r in rows]
    assert float(bubbles[0].group(1)) == pytest.approx(sum(idle) / p, abs=0.1)
    # a legend for the picture and for the schedules; the load named when stages outnumber cores
    assert any(line.startswith("timeline of the last step") and "F3 = forward of micro-batch 3" in line
               and "B3 = its backward" in line for line in lines)
    assert any("a>3 send activation 3 on, >a3 receive it, <g3 send gradient 3 back, g<3 receive it" in line
               for line in lines)
    noted = any(line.startswith(f"note: {p} stages share ") for line in lines)
    assert noted == (p > os.cpu_count())
    # the printed schedule of every stage is the one built from the same flags
    for s in range(p):
        text = " ".join(map(str, pp.build_schedule(schedule, p, s, m)))
        assert f"[stage {s}] {text}" in lines


# ----------------------------------------------------------------------------------
# 7, 8. Bad input; --check from the command line
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,flag", [
    (["--num-layers", "6", "--world-size", "4"], "--num-layers"),
    (["--batch-size", "10", "--micro-batches", "4"], "--batch-size"),
    (["--schedule", "foo"], "--schedule"),
    (["--world-size", "5", "--num-layers", "4"], "--world-size"),
    (["--micro-batches", "0"], "--micro-batches"),
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
    """A correct run that a final-weights-only check at 1e-4 failed (1.7e-3): one gradient
    element is below 1e-7, near AdamW's eps, and summing 7 micro-batches in another order
    moves its AdamW step by up to lr. The first step's gradients agree to float32 rounding;
    the final weights stay within lr x steps."""
    pp.main(["--world-size", "1", "--num-layers", "8", "--dim", "20", "--batch-size", "14",
             "--micro-batches", "7", "--optimizer", "adamw", "--lr", "0.01", "--steps", "4", "--seed", "2594",
             "--check", *TIMEOUT])
    figures, verdict = check_report(capfd.readouterr().out)
    assert verdict == "OK"
    assert figures["first step's gradients"][0] < 1e-5
    assert 1e-4 < figures["final weights"][0] <= 0.01 * 4 == figures["final weights"][1]


@pytest.mark.deadline(60)
def test_check_passes_from_the_command_line():
    proc = subprocess.run([sys.executable, "pipeline_parallel.py", "--world-size", "2", "--steps", "3",
                           "--check", *TIMEOUT], cwd=REPO, capture_output=True, text=True, timeout=55)
    assert proc.returncode == 0, proc.stderr
    assert_check_passed(proc.stdout, dp.CHECK_TOLERANCE)
