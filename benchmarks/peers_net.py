"""The network of benchmarks/peers.py: every rank in its own network namespace, joined to one
bridge in the root namespace by its own veth pair, and both ends of every veth shaped by
`tc qdisc tbf` at the same rate, as a host's NIC and its switch port would be. Needs root.

    rank r: namespace gift-peer<r>, interface gift0 (the same name in every namespace, so one
            btl_tcp_if_include / GLOO_SOCKET_IFNAME fits all ranks), address 10.77.0.<r+1>/24
    host:   veth gpeer<r>h on bridge gift-peerbr, which has address 10.77.0.254: mpirun's PMIx
            server (PMIx 4 has only a TCP transport, on 127.0.0.1 by default, which a rank in its
            own namespace cannot reach) listens there instead (pmix_env()); it carries only the
            wire-up and the final fence, none of the training traffic

MTU 1500 on both ends. Segmentation offloads (GSO/TSO/GRO) stay on by default: tbf counts every
segment of a 64 KB super-packet with its headers, so the rate holds (measured: 96 / 957 / 9450
Mbit/s of TCP payload at 100mbit / 1gbit / 10gbit), while with them off (offloads=False: ethtool
when installed, else `ip link set gso_max_size 1500`) the per-packet cost on a 2-core VM caps a
veth near 0.8 Gbit/s unshaped, below the rates under test.
`python benchmarks/peers_net.py RANKS RATE [--no-offloads]` builds it, measures the rate between
rank 0 and 1 in both directions with plain TCP sockets, and removes it.
"""
import json
import shutil
import socket
import subprocess
import sys
import time

PREFIX, BRIDGE, IFNAME = "gift-peer", "gift-peerbr", "gift0"
PORT = 5301
BRIDGE_ADDRESS = "10.77.0.254"


def address(rank):
    return f"10.77.0.{rank + 1}"


def namespace(rank):
    return f"{PREFIX}{rank}"


def sh(*cmd, check=True):
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if check and done.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")
    return done.stdout


def rate_bits(rate):
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    return float(rate[:-4]) * units[rate[-4:]]


def available():
    """Why the shaped network cannot be built here, or None."""
    import os
    if os.geteuid() != 0:
        return "it needs root (network namespaces, veth, tc)"
    missing = [tool for tool in ("ip", "tc") if not shutil.which(tool)]
    if missing:
        return f"iproute2 is missing ({', '.join(missing)} not found)"
    return None


def pmix_env():
    """Environment for mpirun: its PMIx server listens on the bridge, reachable from every
    namespace, not on the root namespace's loopback."""
    return {"PMIX_MCA_ptl_tcp_remote_connections": "1", "PMIX_MCA_ptl_tcp_if_include": BRIDGE}


def no_offloads(device, netns=None):
    prefix = ["ip", "netns", "exec", netns] if netns else []
    if shutil.which("ethtool"):
        sh(*prefix, "ethtool", "-K", device, "tso", "off", "gso", "off", "gro", "off", check=False)
    where = ["-n", netns] if netns else []
    sh("ip", *where, "link", "set", "dev", device, "gso_max_size", "1500", "gro_max_size", "1500")


def shape(device, rate, netns=None):
    # bucket: 1 ms of traffic (at least 10 packets): enough for the timer to keep up with the rate,
    # small enough that a step's gradients cannot pass as one unshaped burst
    burst = max(15000, int(rate_bits(rate) / 8 / 1000))
    where = ["-n", netns] if netns else []
    sh("tc", *where, "qdisc", "replace", "dev", device, "root", "tbf", "rate", rate,
       "burst", str(burst), "latency", "50ms")


def remove_all():
    """Remove this network's namespaces and bridge, including leftovers of a killed run."""
    for line in sh("ip", "netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(PREFIX):
            sh("ip", "netns", "del", name, check=False)   # deletes the veths inside with it
    for line in sh("ip", "-o", "link", "show", check=False).splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith("gpeer"):       # a host end whose namespace is still going away
            sh("ip", "link", "del", name, check=False)
    sh("ip", "link", "del", BRIDGE, check=False)


class Network:
    """`with Network(ranks, rate):` builds it and always removes it; rate None: not shaped.
    per_node: ranks that share a namespace (a node of benchmarks/cluster.py: they talk over its
    own loopback, unshaped, and its one veth carries what leaves or enters the node); rank r
    lives in namespace(r // per_node)."""

    def __init__(self, ranks, rate, offloads=True, per_node=1):
        self.ranks, self.rate, self.offloads = ranks // per_node, rate, offloads

    def __enter__(self):
        remove_all()
        try:
            sh("ip", "link", "add", BRIDGE, "type", "bridge")
            sh("ip", "addr", "add", f"{BRIDGE_ADDRESS}/24", "dev", BRIDGE)
            sh("ip", "link", "set", BRIDGE, "up")
            for r in range(self.ranks):
                self._attach(r)
        except BaseException:
            remove_all()
            raise
        return self

    def _attach(self, r):
        ns, host, inner = namespace(r), f"gpeer{r}h", f"gpeer{r}n"
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", host, "type", "veth", "peer", "name", inner)
        sh("ip", "link", "set", inner, "netns", ns)
        sh("ip", "-n", ns, "link", "set", inner, "name", IFNAME)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns, "addr", "add", f"{address(r)}/24", "dev", IFNAME)
        for device, netns in ((host, None), (IFNAME, ns)):
            where = ["-n", netns] if netns else []
            sh("ip", *where, "link", "set", "dev", device, "mtu", "1500")
            if not self.offloads:
                no_offloads(device, netns)
            if self.rate:
                shape(device, self.rate, netns)      # host end: toward the rank; inner: from it
        sh("ip", "link", "set", host, "master", BRIDGE, "up")
        sh("ip", "-n", ns, "link", "set", IFNAME, "up")

    def __exit__(self, *_):
        remove_all()

    def measure(self, src, dst, seconds=3.0):
        """Bits per second of one TCP stream from rank src to rank dst, as the receiver saw it."""
        py = sys.executable
        receiver = subprocess.Popen(["ip", "netns", "exec", namespace(dst), py, __file__,
                                     "recv", address(dst)], stdout=subprocess.PIPE, text=True)
        try:
            time.sleep(1.0)                       # the receiver is listening
            sh("ip", "netns", "exec", namespace(src), py, __file__, "send", address(dst),
               str(seconds))
            out, _ = receiver.communicate(timeout=60)
        finally:
            if receiver.poll() is None:
                receiver.kill()
        return json.loads(out)["bits_per_second"]


def receive(host):
    with socket.create_server((host, PORT)) as server:
        conn, _ = server.accept()
        with conn:
            buf, total, first = bytearray(1 << 20), 0, None
            while n := conn.recv_into(buf):
                first = first or time.perf_counter()
                total += n
            last = time.perf_counter()
    print(json.dumps({"bits_per_second": 8 * total / max(last - first, 1e-9)}))


def send(host, seconds):
    block = b"\0" * (1 << 20)
    with socket.create_connection((host, PORT)) as conn:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            conn.sendall(block)


if __name__ == "__main__":
    if sys.argv[1] == "recv":
        receive(sys.argv[2])
    elif sys.argv[1] == "send":
        send(sys.argv[2], float(sys.argv[3]))
    else:
        reason = available()
        if reason:
            print(f"peers_net.py: {reason}: nothing measured")
            sys.exit(0)
        with Network(int(sys.argv[1]), None if sys.argv[2] == "none" else sys.argv[2],
                     offloads="--no-offloads" not in sys.argv) as net:
            for a, b in ((0, 1), (1, 0)):
                print(f"rank {a} -> {b}: {net.measure(a, b) / 1e6:.1f} Mbit/s")
