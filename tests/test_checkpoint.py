"""Tests for checkpoints (--checkpoint, --checkpoint-every, --resume; data_parallel.py's
machinery, used by every training script): a run stopped and resumed at any layout.

- copy_overlaps moves exactly the elements two pieces share (each a row-major range of a box
  of the whole), and counts them.
- A checkpoint of 3D training (dp2 pp2 tp2, ZeRO-1) resumed at other layouts, every flag family:
  dp, pp and tp, the rank order, the tp style, virtual stages, ZeRO's stage, the schedule,
  micro-batches, buckets, --bf16 and the script. Each resumed run loads its state, then (a
  wrapper, no hook in the scripts) writes it again at its own layout: read back whole, that
  equals the checkpoint it loaded, bitwise, parameters and AdamW's moments. Each passes
  --check; with SGD its --save (init_*: the state it resumed from) replays serially.
- Same layout, AdamW: killed by SIGKILL (the launcher and its ranks) right after a checkpoint
  completes, or half-way through writing one, the run resumes from its last complete
  checkpoint and ends bitwise equal to the run never stopped; the two newest are kept. The
  other scripts stopped and resumed, bitwise too; an incomplete folder left older is removed.
- Nothing gathers the model: while ranks write, no collective or send carries more than the
  pieces' places; resumed elsewhere, a rank opens exactly the files whose pieces overlap its own.
- The refusals: another model, optimizer or seed (naming the flag), --steps already reached,
  a folder with no complete checkpoint: exit 2, one line, no rank started. A broken file in a
  complete checkpoint, and a disk that fills up while writing one: one line, exit 1.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import collectives
import data_parallel as dp
import pipeline_parallel
import tensor_parallel
import three_d
from common import ATOL, NO_SAMPLE, RTOL, check_report, final_params, init_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = {"three_d": three_d, "data_parallel": dp, "tensor_parallel": tensor_parallel,
           "pipeline_parallel": pipeline_parallel}
TIMEOUT = ["--timeout-s", "15"]
MODEL = ["--num-layers", "8", "--dim", "16", "--context", "4", "--batch-size", "16", "--seed", "3"]
SOURCE = ["--dp", "2", "--pp", "2", "--tp", "2", "--zero", "1", "--micro-batches", "2"]
LR = {"adamw": "0.01", "sgd": "0.5"}


def test_pieces_copy_exactly_the_elements_they_share():
    """copy_overlaps puts each element of a saved piece into a wanted one at the same place of
    the same tensor, counts them, and touches no other: every pair of boxes and ranges."""
    whole = torch.arange(20 * 20, dtype=torch.float32).view(20, 20)   # each element's own id

    def ids(box, start, end):   # the box's ids, row-major, [start, end)
        return whole[box[0]:box[1], box[2]:box[3]].reshape(-1)[start:end]
    boxes = [(0, 5, 0, 7), (3, 9, 2, 6), (10, 11, 4, 9), (2, 6, 0, 1), (0, 20, 0, 20)]
    ranges = {}
    for box in boxes:
        n = (box[1] - box[0]) * (box[3] - box[2])
        ranges[box] = {(0, n), (1, max(n - 1, 1)), (n // 3, 2 * n // 3 + 1), (n - 1, n)}
    for saved_box in boxes:
        for wanted_box in boxes:
            for (s0, s1) in ranges[saved_box]:
                for (w0, w1) in ranges[wanted_box]:
                    saved = dp.Piece(0, saved_box, s0, s1,
                                     {"param": ids(saved_box, s0, s1).clone()})
                    want = ids(wanted_box, w0, w1)
                    got = torch.full_like(want, -1.0)
                    found = dp.copy_overlaps([dp.Piece(0, wanted_box, w0, w1,
                                                       {"param": got})], [saved])
                    shared = torch.isin(want, saved.views["param"])
                    assert found == shared.sum().item()
                    assert torch.equal(got[shared], want[shared])
                    assert (got[~shared] == -1).all()
                    untouched = torch.full_like(want, -1.0)   # a place alone: counted, not copied
                    assert dp.copy_overlaps([dp.Piece(0, wanted_box, w0, w1, {"param": untouched})],
                                            [saved._replace(views=None)]) == found
                    assert (untouched == -1).all()
                    other = dp.Piece(1, saved_box, s0, s1, saved.views)   # another
                    assert dp.copy_overlaps([dp.Piece(0, wanted_box, w0, w1,   # tensor
                                                      {"param": got})], [other]) == 0


def run(script, argv, optimizer, folder=None, resume=None, save=None):
    """script.main in-process (ranks forked from here); its --save, if asked for."""
    argv = [*MODEL, *argv, "--optimizer", optimizer, "--lr", LR[optimizer], *TIMEOUT, *NO_SAMPLE]
    if folder:
        argv += ["--checkpoint", str(folder)]
    if resume:
        argv += ["--resume", str(resume)]
    if save:
        argv += ["--save", str(save)]
    SCRIPTS[script].main(argv)
    return torch.load(save) if save else None


def newest(folder):   # the newest complete checkpoint's complete.json, and where it is
    return dp.newest_checkpoint(str(folder))


def whole(folder):   # the newest complete checkpoint, read whole here: {state: [E, W.., H]}
    marker = newest(folder)
    return dp.whole_checkpoint(marker, argparse.Namespace(**marker))   # its model


def names(folder):   # the checkpoints' folders, complete or not
    return sorted(name for name in os.listdir(folder) if name.startswith("step-"))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """3D training (dp2 pp2 tp2, ZeRO-1) for 2 steps, checkpointed at its end: AdamW and SGD."""
    found = {}
    for optimizer in ("adamw", "sgd"):
        folder = tmp_path_factory.mktemp(f"source-{optimizer}")
        run("three_d", [*SOURCE, "--steps", "2"], optimizer, folder=folder)
        found[optimizer] = folder
    return found


# (optimizer, script, its flags): every flag family changed from SOURCE's, and the script
LAYOUTS = [
    ("adamw", "three_d", ["--dp", "1", "--pp", "4", "--tp", "2", "--zero", "3", "--tp-style",
                          "megatron", "--schedule", "interleaved", "--micro-batches", "4"]),
    ("adamw", "data_parallel", ["--world-size", "4", "--zero", "2", "--bf16"]),
    ("sgd", "three_d", ["--dp", "4", "--pp", "1", "--tp", "2", "--order", "tp-dp-pp", "--zero",
                        "2", "--bucket-mb", "0", "--micro-batches", "1"]),
    ("sgd", "three_d", ["--dp", "1", "--pp", "2", "--tp", "4", "--schedule", "gpipe",
                        "--micro-batches", "4", "--p2p-shard", "--recompute"]),
    ("sgd", "tensor_parallel", ["--world-size", "4", "--tp-style", "megatron"]),
    ("sgd", "pipeline_parallel", ["--world-size", "2", "--schedule", "zb-h1",
                                  "--micro-batches", "4"]),
]


def replay(result):
    """A --save result's steps again, serially with autograd, from its init_*: (losses, final)."""
    config = argparse.Namespace(**result["config"])
    params = [w.clone().requires_grad_() for w in init_of(result)]
    optimizer = dp.make_optimizer(params, config.optimizer, config.lr)
    losses = []
    for step in range(config.start_step, config.steps):
        inputs, targets = dp.make_batch(config, step)
        optimizer.zero_grad()
        loss, _ = dp.serial_loss(params, inputs, targets, config)
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
    return losses, [w.detach() for w in params]


@pytest.mark.deadline(90)
@pytest.mark.parametrize("optimizer, script, layout", LAYOUTS,
                         ids=[f"{s}-{'-'.join(f).replace('--', '')}" for _, s, f in LAYOUTS])
def test_resumed_at_another_layout(sources, tmp_path, monkeypatch, capfd, optimizer, script,
                                   layout):
    """The state loaded equals the state saved, bitwise; the resumed run passes --check; with
    SGD its --save replays serially from the state it resumed from."""
    again = tmp_path / "again"
    load = dp.load_checkpoint

    def load_then_save(args, replica, tensors=None, boxes=None):   # what each rank loaded,
        resumed = load(args, replica, tensors, boxes)               # written again at this layout
        once = argparse.Namespace(**{**vars(args), "checkpoint": str(again),
                                     "steps": args.start_step, "checkpoint_every": 0})
        dp.save_checkpoint(once, args.start_step, replica, tensors, boxes)
        return resumed
    monkeypatch.setattr(SCRIPTS[script], "load_checkpoint", load_then_save)
    result = run(script, [*layout, "--steps", "4", "--check"], optimizer,
                 resume=sources[optimizer], save=tmp_path / "run.pt")
    out = capfd.readouterr().out
    assert f"resumed from {newest(sources[optimizer])['folder']}: step 2" in out
    assert check_report(out)[1] == "OK"
    saved = whole(sources[optimizer])
    loaded = whole(again)
    assert sorted(loaded) == sorted(saved) == (["exp_avg", "exp_avg_sq", "param"]
                                               if optimizer == "adamw" else ["param"])
    for name in saved:
        for part, (a, b) in enumerate(zip(loaded[name], saved[name])):
            assert torch.equal(a, b), f"{name} of part {part}"
    assert newest(again)["optimizer_steps"] == newest(sources[optimizer])["optimizer_steps"]
    assert len(result["losses"]) == 2
    assert all(torch.equal(a, b) for a, b in zip(init_of(result), saved["param"]))
    if optimizer == "sgd":
        losses, final = replay(result)
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses),
                                   atol=ATOL, rtol=RTOL)
        for a, b in zip(final_params(result), final):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


@pytest.mark.deadline(120)
def test_a_checkpoint_at_tp_4_with_2_kv_heads_resumes_at_tp_1_and_2(tmp_path, capfd):
    """G 2 at tp 4: each kv head's Wk, Wv held by two ranks and written by its first; W1 and W3
    each at its own F/tp columns. Resumed at tp 1 (every tensor whole) and at tp 2 (a kv head a
    rank, W1 and W3 resharded apart), each passes --check and ends as the run that went on."""
    flags = ["--kv-heads", "2", "--qk-norm"]
    went_on = run("tensor_parallel", [*flags, "--world-size", "4", "--steps", "4"], "sgd",
                  save=tmp_path / "on.pt")
    run("tensor_parallel", [*flags, "--world-size", "4", "--steps", "2"], "sgd",
        folder=tmp_path / "ck")
    assert newest(tmp_path / "ck")["kv_heads"] == 2
    for script, layout in (("tensor_parallel", ["--world-size", "1"]),
                           ("three_d", ["--dp", "1", "--pp", "2", "--tp", "2"])):
        resumed = run(script, [*flags, *layout, "--steps", "4", "--check"], "sgd",
                      resume=tmp_path / "ck", save=tmp_path / "resumed.pt")
        assert check_report(capfd.readouterr().out)[1] == "OK"
        torch.testing.assert_close(torch.tensor(resumed["losses"]),
                                   torch.tensor(went_on["losses"][2:]), atol=ATOL, rtol=RTOL)
        for a, b in zip(final_params(resumed), final_params(went_on)):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


RUN = [*SOURCE, "--steps", "6", "--checkpoint-every", "2"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run that is never stopped: 3D, AdamW, checkpoints every 2 of 6 steps."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    result = run("three_d", RUN, "adamw", folder=folder, save=folder / "run.pt")
    assert names(folder) == ["step-00000004", "step-00000006"]   # the two newest
    return result


@pytest.mark.deadline(120)
@pytest.mark.parametrize("when, step", [("after", 2), ("during", 4)])
def test_killed_run_resumes_bitwise(uninterrupted, tmp_path, when, step):
    """SIGKILL to the launcher and every rank, right after step 2's checkpoint completes or
    half-way through writing step 4's: the resumed run (from step 2) ends bitwise equal."""
    folder = tmp_path / "ckpt"
    argv = [*MODEL, *RUN, "--optimizer", "adamw", "--lr", LR["adamw"], *TIMEOUT,
            "--checkpoint", str(folder)]
    temp = tmp_path / "temp"          # its TMPDIR: SIGKILL leaves the ranks' meeting folder
    temp.mkdir()
    proc = subprocess.run([sys.executable, os.path.join("tests", "checkpoint_kill.py"), when,
                           str(step), "three_d.py", *argv], cwd=ROOT, capture_output=True,
                          text=True, start_new_session=True, timeout=60,
                          env={**os.environ, "TMPDIR": str(temp)})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    left = [path.name for path in temp.iterdir() if not path.name.startswith("torchinductor_")]
    assert [name.startswith("parallel-") for name in left] == [True], left
    assert [os.path.basename(path) for path in dp.checkpoints(str(folder))] == ["step-00000002"]
    if when == "during":              # step 4's pieces, some of them, and no complete.json
        assert names(folder) == ["step-00000002", "step-00000004"]
    result = run("three_d", RUN, "adamw", folder=folder, resume=folder, save=tmp_path / "run.pt")
    assert result["losses"] == uninterrupted["losses"][2:]
    assert all(torch.equal(a, b) for a, b in zip(final_params(result),
                                                 final_params(uninterrupted)))
    assert names(folder) == ["step-00000004", "step-00000006"]


def refused(argv, capsys):
    """three_d.main(argv) ends at the door: exit 2 and one line on stderr, before any rank."""
    with pytest.raises(SystemExit) as stop:
        three_d.main([*MODEL, *SOURCE, "--steps", "4", *TIMEOUT, *argv])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("change, flag", [
    (["--num-layers", "4"], "--num-layers"), (["--dim", "32"], "--dim"),
    (["--context", "8"], "--context"), (["--optimizer", "sgd"], "--optimizer"),
    (["--seed", "4"], "--seed"), (["--steps", "2"], "--steps")])
def test_refused_what_cannot_resume(sources, capsys, change, flag):
    err = refused(["--optimizer", "adamw", "--resume", str(sources["adamw"]), *change], capsys)
    assert err.split(": error: ")[1].startswith(flag), err


def test_refused_another_vocabulary_and_no_complete_checkpoint(sources, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(sources["adamw"], copy)
    marker = newest(copy)
    with open(os.path.join(marker["folder"], dp.MARKER), "w") as f:
        json.dump({**marker, "vocab_size": 98}, f)
    err = refused(["--optimizer", "adamw", "--resume", str(copy)], capsys)
    assert "vocabulary" in err and "98" in err, err
    os.remove(os.path.join(marker["folder"], dp.MARKER))   # its pieces, but not complete
    err = refused(["--optimizer", "adamw", "--resume", str(copy)], capsys)
    assert err.split(": error: ")[1].startswith("--resume"), err


SAME = [("data_parallel", ["--world-size", "2", "--zero", "3", "--bf16"]),
        ("tensor_parallel", ["--world-size", "2", "--tp-style", "megatron"]),
        ("pipeline_parallel", ["--world-size", "2", "--schedule", "interleaved"])]


@pytest.mark.deadline(90)
@pytest.mark.parametrize("script, layout", SAME, ids=[script for script, _ in SAME])
def test_resumed_at_the_same_layout_is_bitwise(tmp_path, script, layout):
    """Each other script, AdamW: 2 steps, then resumed to 5, equals 5 steps bitwise. The
    resumed run's checkpoints (4 and 5) replace the older: 2, and a folder a killed run left
    incomplete (3)."""
    never_stopped = run(script, [*layout, "--steps", "5"], "adamw", save=tmp_path / "whole.pt")
    folder = tmp_path / "ckpt"
    run(script, [*layout, "--steps", "2"], "adamw", folder=folder)
    os.makedirs(folder / "step-00000003")
    (folder / "step-00000003" / "rank-00000.pt").write_bytes(b"half a file")
    resumed = run(script, [*layout, "--steps", "5", "--checkpoint-every", "2"], "adamw",
                  folder=folder, resume=folder, save=tmp_path / "resumed.pt")
    assert resumed["losses"] == never_stopped["losses"][2:]
    assert all(torch.equal(a, b) for a, b in zip(final_params(resumed),
                                                 final_params(never_stopped)))
    assert names(folder) == ["step-00000004", "step-00000005"]


def test_a_broken_checkpoint_ends_in_one_line(sources, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(sources["adamw"], copy)
    path = os.path.join(newest(copy)["folder"], "rank-00000.pt")
    with open(path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(SystemExit) as exited:
        collectives.run_main(lambda: three_d.main([*MODEL, *SOURCE, "--steps", "4", "--optimizer",
                                                   "adamw", "--resume", str(copy), *TIMEOUT]))
    message = str(exited.value.code)
    assert message.startswith(f"error: --resume: {path} cannot be read ("), message
    assert "\n" not in message


@pytest.mark.parametrize("text", ['{"step": 4, "dim"', "", "[4]"])
def test_a_broken_marker_is_refused_at_the_door_in_one_line(sources, tmp_path, capsys, text):
    """complete.json cut short (a disk that filled), emptied, or not a marker: one line at the
    door, exit 2, as a broken rank file gets at its read."""
    copy = tmp_path / "copy"
    shutil.copytree(sources["adamw"], copy)
    path = os.path.join(newest(copy)["folder"], dp.MARKER)
    with open(path, "w") as f:
        f.write(text)
    with pytest.raises(SystemExit) as exited:
        three_d.parse_args([*MODEL, *SOURCE, "--steps", "4", "--optimizer", "adamw",
                            "--resume", str(copy)])
    assert exited.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"{os.path.basename(sys.argv[0])}: error: --resume {copy}: {path} cannot be read ("), err
    assert err[0].endswith("a broken checkpoint; move its folder aside to resume from the one "
                           "before")


@pytest.mark.parametrize("filled_by", ["a rank's file", "the marker"])
def test_a_disk_that_fills_up_at_a_checkpoint_is_one_line(tmp_path, monkeypatch, filled_by):
    """Either write names --checkpoint, not the output (a write's OSError names no file)."""
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")
    if filled_by == "the marker":
        monkeypatch.setattr(dp.json, "dumps", full_disk)
    else:
        monkeypatch.setattr(torch, "save", full_disk)
    folder = tmp_path / "ckpt"
    with pytest.raises(SystemExit) as exited:
        collectives.run_main(lambda: dp.main([*MODEL, "--world-size", "2", "--steps", "2",
                                              "--checkpoint", str(folder), *TIMEOUT]))
    message = str(exited.value.code)
    assert message.startswith(f"error: --checkpoint {folder}: "), message
    assert "(No space left on device)" in message or "[Errno 28]" in message, message
    assert "\n" not in message
    assert dp.checkpoints(str(folder)) == []


def record_inside(monkeypatch, module, function, watched, log):
    """Each rank appends a line to log/<pid> for every call of watched {name: (object, its
    function name)} made inside module.function: (the name, what describe() says of the call)."""
    inside = []
    real = getattr(module, function)

    def marked(*args, **kwargs):
        inside.append(True)
        try:
            return real(*args, **kwargs)
        finally:
            inside.pop()
    monkeypatch.setattr(module, function, marked)
    for name, (owner, attribute, describe) in watched.items():
        original = getattr(owner, attribute)

        def watching(*args, _original=original, _name=name, _describe=describe, **kwargs):
            if inside:
                with open(os.path.join(log, str(os.getpid())), "a") as f:
                    f.write(f"{_name} {_describe(*args, **kwargs)}\n")
            return _original(*args, **kwargs)
        monkeypatch.setattr(owner, attribute, watching)


def largest_tensor(*args, **kwargs):   # the most elements of a float tensor a call carries
    found = [0]
    for value in [*args, *kwargs.values()]:
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, torch.Tensor) and item.is_floating_point():
                found.append(item.numel())
    return max(found)


def lines(log):   # {pid: [(name, what), ...]}
    return {pid: [tuple(line.split(" ", 1)) for line in open(os.path.join(log, pid)).read().split("\n")
                  if line] for pid in os.listdir(log)}


def test_a_checkpoint_moves_no_weight_between_ranks(tmp_path, monkeypatch):
    """Every tensor a collective or a send carries while the ranks write a checkpoint, on every
    rank: the pieces' places alone (7 integers a piece, int64), never a float: no weight and no
    optimizer state moves."""
    log = tmp_path / "calls"
    log.mkdir()
    names = ["all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor", "gather",
             "broadcast", "reduce", "scatter", "reduce_scatter_single", "send", "recv",
             "batch_isend_irecv", "all_to_all_single", "gather_object", "all_gather_object",
             "broadcast_object_list"]   # (not isend, irecv: P2POp takes only the real ones)
    record_inside(monkeypatch, three_d, "save_checkpoint", {
        name: (dist, name, largest_tensor) for name in names if hasattr(dist, name)}, str(log))
    run("three_d", [*SOURCE, "--steps", "1", "--dim", "64"], "adamw", folder=tmp_path / "ckpt")
    calls = lines(str(log))
    assert len(calls) == 8                            # every rank wrote: ZeRO-1 shards dp too
    for pid, made in calls.items():
        assert "gather" in [name for name, _ in made]
        assert all(int(size) == 0 for _, size in made), made


def test_a_rank_opens_only_the_files_that_overlap_its_own(sources, tmp_path, monkeypatch):
    """The source (dp2 pp2 tp2, ZeRO-1) resumed at dp1 pp2 tp1: a rank of stage s holds its
    stage's parts whole, and opens the files of the ranks of stage s alone, every one of them."""
    log = tmp_path / "opened"
    log.mkdir()
    record_inside(monkeypatch, three_d, "load_checkpoint", {
        "load": (torch, "load", lambda path, *args, **kwargs: os.path.basename(str(path)))},
                  str(log))
    run("three_d", ["--dp", "1", "--pp", "2", "--tp", "1", "--steps", "3"], "adamw",
        resume=sources["adamw"])
    grid = three_d.rank_grid(2, 2, 2)                 # the source's [dp, pp, tp] -> rank
    stage_files = [sorted(f"rank-{rank:05d}.pt" for rank in grid[:, s].flatten().tolist())
                   for s in range(2)]
    opened = sorted(sorted(name for _, name in made) for made in lines(str(log)).values())
    assert opened == sorted(stage_files), opened
