"""Kill a training script and every rank of it with SIGKILL at a chosen moment of a checkpoint,
with no test hook in the scripts.

    python tests/checkpoint_kill.py {after,during} STEP SCRIPT [its flags]

after: the moment step STEP's checkpoint is complete (its complete.json renamed into place);
during: in the middle of writing it (rank 1's file half written, no complete.json). Run it with
a process group of its own (start_new_session): the launcher and the ranks it forks are that
group, and os.killpg(0, SIGKILL) takes them all at once, as a node going away does.
"""
import os
import runpy
import signal
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kill_everyone():
    os.killpg(0, signal.SIGKILL)


def main():
    when, step, script, *flags = sys.argv[1:]
    folder = f"step-{int(step):08d}"
    real_save = torch.save
    real_replace = os.replace

    def save_then_die(obj, f, *args, **kwargs):   # rank 1's file, half of it, then the kill
        real_save(obj, f, *args, **kwargs)
        name = getattr(f, "name", str(f))
        if os.path.join(folder, "rank-00001.pt") in name:
            f.flush()
            f.truncate(f.tell() // 2)
            f.flush()
            kill_everyone()

    def replace_then_die(source, target):         # the checkpoint's last act, then the kill
        real_replace(source, target)
        if str(target).endswith(os.path.join(folder, "complete.json")):
            kill_everyone()

    if when == "during":
        torch.save = save_then_die
    else:
        os.replace = replace_then_die
    sys.path.insert(0, ROOT)
    sys.argv = [script, *flags]
    runpy.run_path(os.path.join(ROOT, script), run_name="__main__")


if __name__ == "__main__":
    main()
