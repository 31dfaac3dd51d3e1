"""Tests for make gpu-check (tests/gpu_check.py) where no GPU is: its one line and exit 0, the
commands it would run passing each script's own door on a node of 1, 3, 6 and 8 GPUs, the card
table, the model sized to the card by the plan, and its timing table run through on the CPU."""
import argparse
import math
import os
import subprocess
import sys
import tempfile
from unittest import mock

import pytest
import torch

import data_parallel
import gpu_check
import pipeline_parallel
import tensor_parallel
import three_d
from nccl import fake_gpus

SCRIPTS = {"data_parallel.py": data_parallel, "tensor_parallel.py": tensor_parallel,
           "pipeline_parallel.py": pipeline_parallel, "three_d.py": three_d}


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0():
    proc = subprocess.run(["make", "--no-print-directory", "gpu-check", f"PYTHON={sys.executable}"],
                          cwd=gpu_check.ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == ("gpu-check: no GPU on this machine (torch.cuda."
                                            "device_count() is 0): nothing to check here; make "
                                            "test checks the CPU's path")
    assert proc.stderr == ""


@pytest.mark.parametrize("gpus", [1, 3, 6, 8])
def test_each_check_it_runs_passes_its_scripts_door_on_that_many_gpus(gpus):
    runs = gpu_check.check_runs(gpus)
    assert len(runs) == 10 and {name.split()[-1] for name, _ in runs} == {"fp32", "bf16"}
    for name, command in runs:
        module = SCRIPTS[command[1]]
        with fake_gpus(gpus), mock.patch.dict(os.environ, {"LOCAL_WORLD_SIZE": str(gpus)}):
            args = module.parse_args(command[2:])
        assert args.check and args.backend == "nccl" and args.bf16 == name.endswith("bf16")
        world = args.dp * args.pp * args.tp if module is three_d else args.world_size
        assert world == gpus, name
    assert gpu_check.layout_of(8) == (2, 2, 2) and gpu_check.layout_of(6) == (3, 1, 2)
    assert math.prod(gpu_check.layout_of(gpus)) == gpus


def test_a_card_is_priced_at_its_datasheets_bf16_peak_or_the_one_given():
    peak, source, plan = gpu_check.card_peak("NVIDIA H100 80GB HBM3")
    assert (peak, plan) == (989e12, "h100") and source.startswith("https://")
    assert gpu_check.card_peak("NVIDIA H100 PCIe")[0] == 756e12         # not the SXM's
    assert gpu_check.card_peak("NVIDIA A100-SXM4-80GB")[::2] == (312e12, "a100")
    assert gpu_check.card_peak("Some GPU") == (None, None, None)
    assert gpu_check.card_peak("Some GPU", 100)[:2] == (100e12, "--peak-tflops")


def test_the_model_is_the_h100s_where_it_fits_and_smaller_where_not():
    assert gpu_check.sized_for(80e9)["dim"] == 4096        # 41.5 GB planned: 52% of an H100's
    assert gpu_check.sized_for(24e9)["dim"] == 2048        # 12.9 GB: within 60% of 24
    assert gpu_check.sized_for(16e9)["dim"] == 1024        # 12.9 GB at D 2048: past 60% of 16
    assert gpu_check.sized_for(16e9)["ffn_dim"] == 3584    # F halved with D: Llama's 3.5 D
    row = gpu_check.plan_row(gpu_check.MODEL, 1, "h100")
    assert 0.5 * 80e9 < row["memory_bytes"] < 0.55 * 80e9


@pytest.mark.deadline(60)
def test_its_timing_table_runs_on_the_cpu(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))     # where its store goes, and goes
    gpu_check.time_one_gpu(argparse.Namespace(peak_tflops=50e-3, steps=2), torch.device("cpu"))
    assert list(tmp_path.glob("gpu-check-*")) == []             # (torch may leave its own)
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("the CPU: the transformer at L 2, D 64, h 4, G 2, F 192, T 16, B 8")
    rows = [line.split() for line in out[4:]]
    assert [(row[0], row[1]) for row in rows] == [("1", "ours"), ("1", "PyTorch"),
                                                   ("4", "ours"), ("4", "PyTorch")]
    for row in rows:
        assert float(row[2]) > 0 and row[3] == "ms" and row[4].endswith("%")
