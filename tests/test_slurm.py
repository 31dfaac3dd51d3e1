"""Two nodes under a real Slurm, on this machine: slurmctld and two slurmd, each slurmd in
its own network namespace with its own hostname and address, run the README's sbatch
script, changed only in the sizes a 2-core machine can run and the interface's name.

    make test-slurm        # as root; installs Slurm and munge from the system's packages

- The job ends COMPLETED, and its --save weights are bitwise those of the same run on one
  node: the same 4 ranks compute the same sums in the same order.
- A rank that raises, or is killed, ends the job in seconds, FAILED, not at its time limit.
- Nothing is left behind, even when a step fails: no daemon, namespace or file.

The cluster: munged with a key of its own; slurmctld and node0's slurmd in one namespace
(10.79.0.1), node1's slurmd in another (10.79.0.2), each daemon in a UTS namespace that
carries its node's hostname, and both namespaces' hosts files naming both nodes. No
database: sacct reads Slurm's job completion log (JobCompType=jobcomp/filetxt, sacct
--completion). Proctrack linuxproc and task/none, so no cgroups are needed.
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch

import netns
import three_d

pytestmark = pytest.mark.slurm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADDRS, NAMES = ["10.79.0.1", "10.79.0.2"], ["node0", "node1"]
SIZES = "--dp 1 --pp 2 --tp 2 --num-layers 4 --dim 16 --batch-size 8 --steps 3"
NEEDED = ["slurmctld", "slurmd", "sbatch", "sacct", "munged", "unshare"]

SLURM_CONF = """\
ClusterName=test3d
SlurmctldHost=node0({addr0})
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={folder}/munge.sock
CredType=cred/munge
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool-%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobCompType=jobcomp/filetxt
JobCompLoc={folder}/jobcomp.txt
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
NodeName=node0 NodeAddr={addr0} CPUs=2 State=UNKNOWN
NodeName=node1 NodeAddr={addr1} CPUs=2 State=UNKNOWN
PartitionName=main Nodes=node[0-1] Default=YES MaxTime=10 State=UP
"""


class Cluster:
    def __init__(self, folder, nodes):
        self.folder, self.nodes, self.daemons = folder, nodes, []
        self.env = {**os.environ, "SLURM_CONF": os.path.join(folder, "slurm.conf"),
                    "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}   # torchrun in the job

    def start(self, argv, name, ns=None, hostname=None):
        if hostname:   # its own UTS namespace, carrying the node's hostname
            argv = ["unshare", "--uts", "sh", "-c", f"hostname {hostname} && exec {' '.join(argv)}"]
        if ns:
            argv = ["ip", "netns", "exec", ns, *argv]
        with open(os.path.join(self.folder, f"{name}.out"), "w") as out:
            self.daemons.append(subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                                 start_new_session=True))

    def on_node0(self, *argv, check=True):
        done = subprocess.run(["ip", "netns", "exec", self.nodes[0][0], *argv], env=self.env, cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 or not check, done.stderr
        return done.stdout

    def submit(self, script, deadline_s=150):
        """sbatch the script from node0; wait for the job to end. Returns (state, exit code,
        seconds it ran, its output)."""
        path = os.path.join(self.folder, f"job{time.monotonic_ns()}.sh")
        with open(path, "w") as f:
            f.write(script)
        job = self.on_node0("sbatch", "--parsable", "-o", os.path.join(self.folder, "job-%j.out"), path).strip()
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            fields = self.on_node0("sacct", "--completion", "-j", job, "-n", "-P",
                                   "--format=State,ExitCode,ElapsedRaw", check=False).split()
            if fields:
                state, exit_code, elapsed = fields[0].split("|")
                with open(os.path.join(self.folder, f"job-{job}.out")) as f:
                    return state, exit_code, int(elapsed), f.read()
            time.sleep(1)
        raise AssertionError(f"job {job} still running after {deadline_s} s: "
                             f"{self.on_node0('squeue', check=False)}")

    def stop(self):
        for daemon in self.daemons:
            if daemon.poll() is None:
                os.killpg(daemon.pid, signal.SIGTERM)
        for daemon in self.daemons:
            try:
                daemon.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(daemon.pid, signal.SIGKILL)
                daemon.wait()


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        pytest.skip("a Slurm cluster in network namespaces needs root")
    missing = [tool for tool in NEEDED if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}: make test-slurm installs them")
    folder = tempfile.mkdtemp(prefix="slurm-")
    tag = f"tsl{os.getpid() % 100000}"
    made = None
    try:
        with netns.two_hosts(tag, ADDRS, names=NAMES, interface="eth1") as nodes:
            made = Cluster(folder, nodes)
            for sub in ("state", "spool-node0", "spool-node1"):
                os.makedirs(os.path.join(folder, sub))
            with open(os.path.join(folder, "munge.key"), "wb") as f:
                f.write(os.urandom(1024))
            os.chmod(os.path.join(folder, "munge.key"), 0o400)
            with open(os.path.join(folder, "slurm.conf"), "w") as f:
                f.write(SLURM_CONF.format(folder=folder, addr0=ADDRS[0], addr1=ADDRS[1]))
            with open(os.path.join(folder, "cgroup.conf"), "w") as f:   # slurmd wants one, if unused
                f.write("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")
            made.start(["munged", "--foreground", "--force", f"--socket={folder}/munge.sock",
                        f"--key-file={folder}/munge.key", f"--pid-file={folder}/munged.pid",
                        f"--seed-file={folder}/munge.seed", f"--log-file={folder}/munged.log"], "munged")
            time.sleep(1)
            made.start(["slurmctld", "-D"], "slurmctld", nodes[0][0], "node0")
            time.sleep(2)
            for (ns, _), name in zip(nodes, NAMES):
                made.start(["slurmd", "-D", "-N", name], f"slurmd-{name}", ns, name)
            deadline = time.monotonic() + 60
            while "2 idle" not in " ".join(made.on_node0("sinfo", "-h", "-o", "%D %t", check=False).split()):
                assert time.monotonic() < deadline, open(os.path.join(folder, "slurmctld.log")).read()[-3000:]
                time.sleep(0.5)
            yield made
    except netns.Unavailable as why:
        pytest.skip(str(why))
    finally:
        if made:
            made.stop()
        shutil.rmtree(folder, ignore_errors=True)
        # nothing left behind: no daemon of ours, no namespace, no file
        assert not [p for p in os.listdir("/proc") if p.isdigit() and folder.encode() in _cmdline(p)]
        assert tag not in netns.sh("ip", "netns", "list").stdout
        assert not os.path.exists(folder) and not any(os.path.exists(f"/etc/netns/{tag}n{i}") for i in (0, 1))


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def readme_script(program, save=None):
    """The README's Slurm script, with the sizes a 2-core machine runs and our interface's
    name; every change must find its place exactly once, so the README cannot drift."""
    with open(os.path.join(ROOT, "README.md")) as f:
        script = re.search(r"\*\*Under Slurm\*\*.*?```bash\n(.*?)```", f.read(), re.S).group(1)
    for old, new in [("#SBATCH --gpus-per-node=4\n", ""),
                     ("# CPU nodes: drop --gpus-per-node, and export GLOO_SOCKET_IFNAME=<interface> here\n",
                      "export GLOO_SOCKET_IFNAME=eth1\n"),
                     ("--nproc-per-node 4", "--nproc-per-node 2"),
                     ("three_d.py --dp 2 --pp 2 --tp 2", f"{program} {SIZES} --timeout-s 20"
                                                          + (f" --save {save}" if save else ""))]:
        assert script.count(old) == 1, (old, script)
        script = script.replace(old, new)
    return script


@pytest.mark.deadline(600)
def test_the_readme_script_runs_on_two_nodes_as_on_one(cluster, tmp_path):
    save = os.path.join(cluster.folder, "two_nodes.pt")
    state, exit_code, seconds, out = cluster.submit(readme_script("three_d.py", save))
    assert (state, exit_code) == ("COMPLETED", "0:0"), out[-3000:]
    assert "saved " in out
    three_d.main([*SIZES.split(), "--timeout-s", "20", "--save", str(tmp_path / "one_node.pt")])
    two, one = torch.load(save), torch.load(tmp_path / "one_node.pt")
    assert two["losses"] == one["losses"]
    assert all(torch.equal(a, b) for a, b in zip(two["final_params"].values(), one["final_params"].values()))


@pytest.mark.deadline(600)
@pytest.mark.parametrize("action", ["raise", "kill"])
def test_a_failing_rank_ends_the_job_in_seconds(cluster, action):
    """Rank 3, on node1, fails at its 2nd layer call: in the middle of training, 10 minutes
    before the partition's time limit. Each node's torchrun reports its own ranks: a raising
    rank's traceback always reaches the job's output. A killed rank's SIGKILL does when
    node1's torchrun reports before srun ends it; the ranks on node0 always report their
    lost connection to node1's address."""
    state, exit_code, seconds, out = cluster.submit(readme_script(f"tests/faults.py 3 2 {action}"))
    assert state == "FAILED" and exit_code == "1:0", (state, exit_code, out[-3000:])
    assert seconds < 60, seconds
    if action == "raise":
        assert "[rank3]: ValueError: injected failure on rank 3" in out, out[-3000:]
    else:
        assert "(SIGKILL)" in out or f"peer [{ADDRS[1]}]" in out, out[-3000:]
