"""Two hosts of our own on this machine, for the two-node tests: Linux network namespaces
joined by a virtual cable (a veth pair), each with its own address, and, when asked, its
hosts file naming both (`ip netns exec` mounts /etc/netns/NAME/hosts over /etc/hosts).
Needs root and iproute2. Everything made is removed on the way out, even after a failure.
"""
import contextlib
import os
import shutil
import signal
import subprocess


class Unavailable(Exception):
    """This machine cannot make the namespaces (no root, no iproute2, no permission)."""


def sh(*argv):
    return subprocess.run(argv, capture_output=True, text=True)


def run(*argv):
    done = sh(*argv)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done.stdout


@contextlib.contextmanager
def two_hosts(tag, addrs, names=None, interface=None):
    """Yields [(namespace, interface)] for two namespaces with addresses addrs. With names,
    each resolves both names to both addresses; with interface, both ends of the cable
    carry that name (so one GLOO_SOCKET_IFNAME fits both hosts)."""
    if os.geteuid() != 0:
        raise Unavailable("network namespaces need root")
    if shutil.which("ip") is None:
        raise Unavailable("needs iproute2's ip (apt-get install -y iproute2)")
    nodes = [(f"{tag}n{i}", f"{tag}v{i}") for i in range(2)]
    made = []
    try:
        for ns, _ in nodes:
            done = sh("ip", "netns", "add", ns)
            if done.returncode:
                raise Unavailable(f"cannot create a network namespace here: {done.stderr.strip()}")
            made.append(ns)
        run("ip", "link", "add", nodes[0][1], "type", "veth", "peer", "name", nodes[1][1])
        for (ns, dev), addr in zip(nodes, addrs):
            run("ip", "link", "set", dev, "netns", ns)
            if interface:
                run("ip", "-n", ns, "link", "set", dev, "name", interface)
            run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", interface or dev)
            run("ip", "-n", ns, "link", "set", interface or dev, "up")
            run("ip", "-n", ns, "link", "set", "lo", "up")
            if names:
                os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
                with open(f"/etc/netns/{ns}/hosts", "w") as f:
                    f.write("127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for a, n in zip(addrs, names)))
        yield [(ns, interface or dev) for ns, dev in nodes]
    finally:
        for ns in made:   # end whatever still runs in it, then delete it (and the veth with it)
            for pid in sh("ip", "netns", "pids", ns).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            sh("ip", "netns", "del", ns)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
