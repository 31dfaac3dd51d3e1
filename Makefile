# Every README command is a target here; each body is the plain command.
#
# The first `make` builds a virtual environment in .venv (no system site-packages, so
# what runs is exactly what requirements.txt installs) and installs torch and pytest
# into it: about 35 s and 200 MB here. Later calls find both and install nothing.
# Bring your own environment instead with PYTHON=...: what it lacks is installed there.
PYTHON ?= .venv/bin/python

.PHONY: deps install ray-deps collectives dp tp pp 3d 3d-ray test test-multinode test-slurm test-ray bench gpu-check

# Two `make` calls at once (make 3d and make test in two terminals) take turns here: the
# lock on .venv.lock is the kernel's, so a killed make holds it no longer.
deps:
	@python3 -c 'import fcntl, subprocess, sys; lock = open(".venv.lock", "w"); \
	    fcntl.flock(lock, fcntl.LOCK_EX); sys.exit(subprocess.call(sys.argv[1:]))' \
	    $(MAKE) --no-print-directory install PYTHON=$(PYTHON)

# .venv if it is missing, then the requirements that $(PYTHON) cannot import yet, in one pip
# call. (A torch already there is kept: asking for torch==2.13.0 would replace another.)
install:
	@[ "$(PYTHON)" != .venv/bin/python ] || [ -x .venv/bin/python ] || python3 -m venv .venv
	@missing=$$($(PYTHON) -c 'import importlib.util as u; print(*[l.strip() for l in open("requirements.txt") \
	    if l[:1].isalpha() and u.find_spec(l.split("=")[0].strip()) is None])'); \
	if [ -n "$$missing" ]; then \
	    echo "installing $$missing for $(PYTHON) (first run only)"; \
	    $(PYTHON) -m pip install -q $$missing; \
	fi

collectives: deps
	$(PYTHON) collectives.py

dp: deps
	$(PYTHON) data_parallel.py

tp: deps
	$(PYTHON) tensor_parallel.py

pp: deps
	$(PYTHON) pipeline_parallel.py --world-size 4 --micro-batches 8 --schedule 1f1b --timeline

3d: deps
	$(PYTHON) three_d.py --dp 2 --pp 2 --tp 2 --check

# Ray is optional, not in requirements.txt: installed here only if missing (about 200 MB).
# ray[train] does not depend on torch, so the installed torch stays as it is.
ray-deps: deps
	@$(PYTHON) -c "import importlib.util as u; exit(u.find_spec('ray') is None)" || $(PYTHON) -m pip install -q "ray[train]==2.60.0"

3d-ray: ray-deps
	$(PYTHON) three_d.py --ray --dp 2 --pp 2 --tp 2 --check

# The suite as two pytest runs at once, each every other test (tests/shards.py says why);
# `$(PYTHON) -m pytest tests` runs it as one.
test: deps
	$(PYTHON) tests/shards.py -q -m "not multinode and not slurm and not ray" tests

test-ray: ray-deps
	$(PYTHON) -m pytest -q -m ray tests

# A machine with GPUs (tests/gpu_check.py): each script on all of this node's GPUs with --check,
# fp32 and bf16; then one GPU's bf16 step of a large model, ours beside plain PyTorch: step time,
# MFU, peak memory, and --plan's prediction. Without a GPU: one line, exit 0.
gpu-check: deps
	$(PYTHON) tests/gpu_check.py

# Two nodes in network namespaces, as root (about a minute)
test-multinode: deps
	$(PYTHON) -m pytest -q -m multinode tests

# A Slurm cluster of two nodes in network namespaces, as root: the README's sbatch script
# for real (about three minutes; installs Slurm and munge from the system's packages if missing)
test-slurm: deps
	@command -v slurmctld >/dev/null && command -v munged >/dev/null || \
	    (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurmctld slurmd slurm-client munge)
	$(PYTHON) -m pytest -q -m slurm tests

# bench (tests/bench.py): each step against PyTorch's own API for it and against serial,
# at a compute-heavy size (D=256) and where communication dominates (the defaults, D=64);
# the collectives' bandwidth, start-up, the pipeline bubble, the bytes each rank sends, and
# three_d.py --plan's predicted step times against every shape of 4 ranks run; a checkpoint's
# write and read beside a step (about 35 minutes on a 2-core machine)
BIG = --num-layers 4 --dim 256 --heads 4 --context 64 --batch-size 32 --steps 5
bench: deps
	$(PYTHON) tests/bench.py collectives
	$(PYTHON) tests/bench.py data_parallel --world-size 2 $(BIG)
	$(PYTHON) tests/bench.py data_parallel --world-size 2
	$(PYTHON) tests/bench.py data_parallel --world-size 2 --zero 1 $(BIG)
	$(PYTHON) tests/bench.py data_parallel --world-size 2 --zero 1
	$(PYTHON) tests/bench.py data_parallel --world-size 2 --zero 3 $(BIG)
	$(PYTHON) tests/bench.py data_parallel --world-size 2 --zero 3
	$(PYTHON) tests/bench.py memory --world-size 4
	$(PYTHON) tests/bench.py tensor_parallel --world-size 2 $(BIG)
	$(PYTHON) tests/bench.py tensor_parallel --world-size 2
	$(PYTHON) tests/bench.py tensor_parallel --world-size 2 --tp-style megatron $(BIG)
	$(PYTHON) tests/bench.py tensor_parallel --world-size 2 --tp-style megatron
	$(PYTHON) tests/bench.py tensor_parallel --world-size 2 --tp-style megatron --sequence-parallel $(BIG)
	$(PYTHON) tests/bench.py tensor_parallel --world-size 2 --tp-style megatron --sequence-parallel
	$(PYTHON) tests/bench.py pipeline_parallel --world-size 2 --micro-batches 8 $(BIG)
	$(PYTHON) tests/bench.py pipeline_parallel --world-size 2 --micro-batches 4
	$(PYTHON) tests/bench.py pipeline_parallel --world-size 2 --micro-batches 8 --schedule zb-h1 $(BIG)
	$(PYTHON) tests/bench.py pipeline_parallel --world-size 2 --micro-batches 4 --schedule zb-h1
	$(PYTHON) tests/bench.py pipeline_parallel --world-size 2 --micro-batches 8 --schedule interleaved $(BIG)
	$(PYTHON) tests/bench.py pipeline_parallel --world-size 2 --micro-batches 4 --schedule interleaved
	$(PYTHON) tests/bench.py pipeline_parallel --world-size 2 --micro-batches 8 --schedule dualpipev $(BIG)
	$(PYTHON) tests/bench.py pipeline_parallel --world-size 2 --micro-batches 4 --schedule dualpipev
	$(PYTHON) tests/bench.py three_d --dp 2 --pp 2 --tp 2 --steps 10
	$(PYTHON) tests/bench.py three_d --dp 2 --pp 2 --tp 2 --dim 256 --batch-size 64 --steps 5
	$(PYTHON) tests/bench.py bubble-table
	$(PYTHON) tests/bench.py count-comm data_parallel
	$(PYTHON) tests/bench.py count-comm data_parallel --zero 1
	$(PYTHON) tests/bench.py count-comm data_parallel --zero 3
	$(PYTHON) tests/bench.py count-comm tensor_parallel
	$(PYTHON) tests/bench.py count-comm tensor_parallel --tp-style megatron
	$(PYTHON) tests/bench.py count-comm pipeline_parallel
	$(PYTHON) tests/bench.py count-comm pipeline_parallel --schedule interleaved --virtual-stages 2 --num-layers 8 --micro-batches 4
	$(PYTHON) tests/bench.py count-comm three_d
	$(PYTHON) tests/bench.py count-comm three_d --p2p-shard --tp-style megatron --zero 3
	$(PYTHON) tests/bench.py plan
	$(PYTHON) tests/bench.py plan-speed
	$(PYTHON) tests/bench.py recompute-memory
	$(PYTHON) tests/bench.py checkpoint --dp 2 --pp 1 --tp 1 --zero 1 $(BIG)
	$(PYTHON) tests/bench.py checkpoint --dp 2 --pp 2 --tp 2 --zero 1 $(BIG)
	$(PYTHON) tests/bench.py cp-balance
	$(PYTHON) tests/bench.py cp-race
	$(PYTHON) tests/bench.py cp-memory
	$(PYTHON) tests/bench.py moe-race
	$(PYTHON) tests/bench.py machine
