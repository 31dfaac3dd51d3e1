"""Two nodes for real: three_d.py under torchrun --nnodes 2 --nproc-per-node 4, each
node in its own Linux network namespace, joined by a veth pair (10.77.0.1 and
10.77.0.2). Nothing is shared but the wire (and the file system, for --save).

    make test-multinode        # as root, with iproute2; not part of make test

- static rendezvous (--node-rank --master-addr --master-port) and c10d rendezvous
  both save weights bitwise equal to the same run's on one node: the same 8 ranks
  compute the same sums in the same order; only the wire between them changed.
- a worker killed on one node ends both nodes' torchrun, non-zero, within 30 s.

What it takes on CPU nodes (the README's two-node section has the same commands):
- GLOO_SOCKET_IFNAME=<the interface that reaches the other node>, or gloo binds
  to the address the hostname resolves to (here 127.0.0.1) and the nodes never meet;
- c10d: --local-addr, the address the other node can reach this one at (else the
  hostname, again loopback), and --rdzv-conf is_host=1 on the node at the endpoint
  (torchrun only hosts the store by itself when the endpoint is its hostname).
  c10d numbers the nodes as they join: the test reads each node's group_rank.
"""
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import netns
import three_d

pytestmark = pytest.mark.multinode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADDRS = ["10.77.0.1", "10.77.0.2"]
PORT = "29500"   # each namespace has its own ports: nothing else can hold this one
ARGS = ["--dp", "2", "--pp", "2", "--tp", "2", "--num-layers", "4", "--dim", "16", "--batch-size", "8",
        "--timeout-s", "20"]


@pytest.fixture
def two_nodes():
    """Two network namespaces joined by a veth pair; yields [(namespace, interface), ...]."""
    try:
        with netns.two_hosts(f"t3d{os.getpid() % 100000}", ADDRS) as nodes:   # one tag per session
            yield nodes
    except netns.Unavailable as why:
        pytest.skip(str(why))


class Node:
    """One torchrun inside a namespace; its output is read as it comes."""

    def __init__(self, ns, dev, torchrun_args, script_args):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(GLOO_SOCKET_IFNAME=dev, LOGLEVEL="INFO")   # INFO: torchrun logs each node's group_rank
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, "timeout", "-k", "5", "150",
             sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "4", *torchrun_args, "three_d.py", *script_args],
            cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.out, self.err = [], []
        self.readers = [threading.Thread(target=self._read, args=(stream, lines), daemon=True)
                        for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(stream, lines):
        for line in stream:
            lines.append(line)

    def wait(self, timeout):
        try:
            self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            for reader in self.readers:
                reader.join(5)
        return self.proc.returncode

    def group_rank(self):
        ranks = set(re.findall(r"group_rank=(\d+)", "".join(self.err)))
        assert len(ranks) == 1, "".join(self.err)[-3000:]
        return int(ranks.pop())

    def workers(self):
        """pids of this node's ranks: python processes below torchrun that run three_d.py."""
        below, frontier = set(), {self.proc.pid}
        while frontier:
            children = set()
            for pid in frontier:
                for task in os.listdir(f"/proc/{pid}/task") if os.path.exists(f"/proc/{pid}/task") else []:
                    try:
                        with open(f"/proc/{pid}/task/{task}/children") as f:
                            children.update(int(c) for c in f.read().split())
                    except OSError:
                        pass
            below |= children
            frontier = children
        ranks = []
        for pid in below:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read().split(b"\0")
            except OSError:
                continue
            if any(arg.endswith(b"three_d.py") for arg in cmdline) and b"torch.distributed.run" not in cmdline:
                ranks.append(pid)
        return ranks


def single_node(tmp_path, steps):
    path = tmp_path / "single.pt"
    three_d.main([*ARGS, "--steps", str(steps), "--save", str(path)])
    return torch.load(path)


def run_two_nodes(nodes, torchrun_args_of, script_args):
    started = [Node(ns, dev, torchrun_args_of(i), script_args) for i, (ns, dev) in enumerate(nodes)]
    codes = [node.wait(timeout=160) for node in started]
    for node, code in zip(started, codes):
        assert code == 0, "".join(node.err)[-3000:]
    return started


def assert_bitwise_equal(saved, reference):
    # Bitwise, not to a tolerance: the two nodes run the same 8 ranks, in the same
    # groups, with the same gloo algorithms, so every sum is taken in the same order.
    assert saved["losses"] == reference["losses"]
    assert all(torch.equal(a, b) for a, b in zip(saved["final_params"].values(), reference["final_params"].values()))
    assert saved["config"]["dp"] * saved["config"]["pp"] * saved["config"]["tp"] == 8


@pytest.mark.deadline(240)
def test_static_rendezvous_matches_one_node(two_nodes, tmp_path):
    save = tmp_path / "two_nodes.pt"
    static = lambda i: ["--node-rank", str(i), "--master-addr", ADDRS[0], "--master-port", PORT]
    started = run_two_nodes(two_nodes, static, [*ARGS, "--steps", "3", "--save", str(save)])
    assert [node.group_rank() for node in started] == [0, 1]
    assert any(line.startswith("saved ") for line in started[0].out)   # rank 0 lives on node 0
    assert_bitwise_equal(torch.load(save), single_node(tmp_path, 3))


@pytest.mark.deadline(240)
def test_c10d_rendezvous_matches_one_node(two_nodes, tmp_path):
    save = tmp_path / "two_nodes.pt"

    def c10d(i):
        host = ["--rdzv-conf", "is_host=1"] if i == 0 else []
        return ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{ADDRS[0]}:{PORT}", "--rdzv-id", "3d",
                *host, "--local-addr", ADDRS[i]]
    started = run_two_nodes(two_nodes, c10d, [*ARGS, "--steps", "3", "--save", str(save)])
    group_ranks = [node.group_rank() for node in started]
    assert sorted(group_ranks) == [0, 1]
    first = started[group_ranks.index(0)]   # global ranks 0-3, whichever node joined how
    assert any(line.startswith("saved ") for line in first.out)
    assert_bitwise_equal(torch.load(save), single_node(tmp_path, 3))


@pytest.mark.deadline(240)
def test_a_worker_killed_on_one_node_ends_both(two_nodes):
    static = lambda i: ["--node-rank", str(i), "--master-addr", ADDRS[0], "--master-port", PORT]
    started = [Node(ns, dev, static(i), [*ARGS, "--steps", "100000"]) for i, (ns, dev) in enumerate(two_nodes)]
    try:
        deadline = time.monotonic() + 120
        while not any("step   0 " in line for line in started[0].out):   # training is under way
            assert time.monotonic() < deadline and all(n.proc.poll() is None for n in started), \
                "".join(started[0].err)[-3000:]
            time.sleep(0.2)
        victims = started[1].workers()
        assert len(victims) == 4, victims
        killed_at = time.monotonic()
        os.kill(victims[0], signal.SIGKILL)
        codes = [node.wait(timeout=40) for node in started]
        took = time.monotonic() - killed_at
    finally:
        for node in started:
            if node.proc.poll() is None:
                node.proc.kill()
    assert all(code != 0 for code in codes), codes
    print(f"both nodes ended {took:.1f} s after the kill")
    assert took < 30, took
    assert any("Signals.SIGKILL" in line or "SIGKILL" in line for line in started[1].err), "".join(started[1].err)[-3000:]
