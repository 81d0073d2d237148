"""A cluster emulated on one machine: network namespaces joined by shaped veth links.

This is a single-machine stand-in for a cluster, used by ``bench comm`` and ``bench
train``: every process of a job (scheduler, servers, workers) runs in a network
namespace of its own, whose one interface ``eth0`` is a veth link to a bridge in a hub
namespace, a star like hosts on one switch. Both directions of every link are shaped
with ``tc tbf`` at the rate given (the role's egress on its eth0, its ingress on the
hub-side peer), so a node sends and receives at that rate at once, as on a
full-duplex switch port; ``delay`` (netem) is the one-way delay between two nodes.
The links are emulated, the CPU is not: every process shares this machine's cores,
so at high rates the CPU, not the link, bounds a step.

Nothing of the host's own network is touched. Namespace names carry ``mxhcomm<pid>-``:
parallel runs never clash and a run removes only its own (and, at start, those left
by runs that were killed). Needs root and iproute2 (``ip``, ``tc``).
"""
import ipaddress
import math
import os
import re
import shutil
import subprocess

PREFIX = "mxhcomm"
DEV = "eth0"
CMD_TIMEOUT = 20           # seconds for any one ip/tc command

_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "kibit": 1024, "mibit": 1024 ** 2, "gibit": 1024 ** 3,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


class NetnsError(RuntimeError):
    """Namespaces could not be created or used."""


def add_arguments(parser):
    """The emulated network's options (bench comm, bench train)."""
    g = parser.add_argument_group("the emulated cluster (network namespaces on this "
                                  "machine; needs root)")
    g.add_argument("-n", "--workers", type=int, default=4, help="workers (default 4)")
    g.add_argument("-s", "--servers", type=int, default=2, help="servers (default 2)")
    g.add_argument("--rate", default="1gbit",
                   help="tc rate of every link, each way (default 1gbit; 'none': unshaped);"
                        " a comma-separated list runs a bandwidth sweep")
    g.add_argument("--role-rate", default="",
                   help="some roles' links at another rate: ROLE=RATE[,...], e.g. "
                        "server1=250mbit")
    g.add_argument("--delay", default=None, help="one-way delay between nodes, e.g. 1ms")
    g.add_argument("--timeout", type=float, default=None,
                   help="seconds per job before it is stopped (default: from the model's "
                        "size and the rate)")
    g.add_argument("--keep-tmp", action="store_true",
                   help="keep the job folders (configs, logs, results)")


def topology(args, rate, tag=None):
    """The Topology of the options (-n, -s, --delay, --role-rate) at ``rate``."""
    if args.workers < 1 or args.servers < 1:
        raise ValueError("need at least one worker and one server")
    return Topology(["scheduler"] + ["server%d" % i for i in range(args.servers)]
                    + ["worker%d" % i for i in range(args.workers)], parse_rate(rate),
                    parse_time(args.delay) if args.delay else 0.0,
                    parse_role_rates(args.role_rate), tag)


def parse_rate(text):
    """A tc rate ('1gbit', '100mbit', '125mbps' = bytes/s) in bits per second; 'none':
    math.inf (unshaped: no tbf)."""
    if str(text).strip().lower() == "none":
        return math.inf
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() or "bit" if m else None
    if not m or unit not in _RATE_UNITS or float(m.group(1)) <= 0:
        raise ValueError("not a rate: %r (examples: 1gbit, 100mbit, none)" % (text,))
    return float(m.group(1)) * _RATE_UNITS[unit]


def parse_role_rates(text):
    """'server1=250mbit,worker0=100mbit' -> {role: bits per second} ('' -> {})."""
    rates = {}
    for item in filter(None, (t.strip() for t in (text or "").split(","))):
        role, sep, rate = item.partition("=")
        if not sep or not role.strip():
            raise ValueError("a role's rate is ROLE=RATE (e.g. server1=250mbit), got %r"
                             % (item,))
        rates[role.strip()] = parse_rate(rate)
    return rates


def parse_time(text):
    """A tc time ('2ms', '100us', '0.5s'; a bare number is seconds) in seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or (m.group(2).lower() or "s") not in _TIME_UNITS:
        raise ValueError("not a time: %r (examples: 1ms, 200us)" % (text,))
    return float(m.group(1)) * _TIME_UNITS[m.group(2).lower() or "s"]


def tbf_burst_bytes(rate_bps):
    """tbf's bucket: 2 ms of traffic, at least 64 KiB; None when unshaped."""
    return None if math.isinf(rate_bps) else max(int(rate_bps / 8 * 0.002), 64 * 1024)


def qdisc_commands(ns, dev, rate_bps, delay_s=0.0, queue_s=0.05):
    """tc commands shaping ``dev``'s egress in ``ns``: netem (delay) as root with tbf
    under it, or tbf alone; nothing for an infinite rate without delay."""
    add = ["tc", "-n", ns, "qdisc", "add", "dev", dev]
    netem = ["netem", "delay", "%dus" % int(round(delay_s * 1e6)), "limit", "100000"]
    cmds = [add + ["root", "handle", "1:"] + netem] if delay_s > 0 else []
    if not math.isinf(rate_bps):
        tbf = ["tbf", "rate", "%dbit" % int(rate_bps), "burst",
               str(tbf_burst_bytes(rate_bps)), "latency", "%dms" % round(queue_s * 1000)]
        cmds.append(add + (["parent", "1:1", "handle", "10:"] if cmds
                           else ["root", "handle", "1:"]) + tbf)
    return cmds


def check_capable():
    """None when namespaces can be made here, else why not (a sentence)."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return "this benchmark needs iproute2 (%s not found)" % " and ".join(missing)
    if os.geteuid() != 0:
        return ("this benchmark needs root: it emulates the cluster with network "
                "namespaces, veth links and tc qdiscs (run it with sudo)")
    return None


def _run(cmd, check=True):
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=CMD_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise NetnsError("timed out after %ds: %s" % (CMD_TIMEOUT, " ".join(cmd)))
    if check and res.returncode != 0:
        raise NetnsError("failed (%d): %s: %s" % (res.returncode, " ".join(cmd),
                                                   res.stderr.strip()))
    return res


def namespaces_usable():
    """Whether a namespace can really be made here (root in a container may lack it)."""
    if check_capable():
        return False
    name = "%s%d-probe" % (PREFIX, os.getpid())
    ok = _run(["ip", "netns", "add", name], check=False).returncode == 0
    if ok:
        _run(["ip", "netns", "del", name], check=False)
    return ok


def own_namespaces(prefix):
    names = [l.split()[0] for l in _run(["ip", "netns", "list"], check=False).stdout
             .splitlines() if l.strip()]
    return [n for n in names if n.startswith(prefix)]


def remove_stale():
    """Delete the namespaces of runs that were killed (``mxhcomm<pid>-*``, pid gone)."""
    for name in own_namespaces(PREFIX):
        m = re.match(re.escape(PREFIX) + r"(\d+)-", name)
        if m and not os.path.exists("/proc/" + m.group(1)):
            _run(["ip", "netns", "del", name], check=False)


class Topology:
    """Roles ('scheduler', 'server0', 'worker3', ...) in their own namespaces around a
    bridge, addresses .1, .2, ... in the order given. ``create()``, ``destroy()``
    (idempotent, only what this object made), ``counters(role)``: (tx, rx) bytes of
    its eth0; ``exec_prefix(role)``: argv prefix running a command in its namespace."""

    def __init__(self, roles, rate_bps, delay_s=0.0, role_rates=None, tag=None,
                 subnet="10.203.0.0/24", mtu=1500):
        self.roles, self.rate_bps, self.mtu = list(roles), float(rate_bps), int(mtu)
        self.role_rates = dict(role_rates or {})
        unknown = sorted(set(self.role_rates) - set(self.roles))
        if unknown:
            raise ValueError("rates given for roles not in the job: %s (roles: %s)"
                             % (", ".join(unknown), ", ".join(self.roles)))
        self.delay_s = float(delay_s or 0.0)
        self.prefix = "%s%d-%s" % (PREFIX, os.getpid(), (tag + "-") if tag else "")
        net = ipaddress.ip_network(subnet)
        self.prefixlen = net.prefixlen
        self._addr = {r: str(a) for r, a in zip(self.roles, net.hosts())}
        self.hub = self.prefix + "hub"
        self.created = []

    def ns(self, role):
        return self.prefix + role

    def addr(self, role):
        return self._addr[role]

    def hub_port(self, role):
        return "p%d" % self.roles.index(role)

    def setup_commands(self):
        hub = ["ip", "-n", self.hub]
        cmds = [["ip", "netns", "add", n] for n in [self.hub] + list(map(self.ns, self.roles))]
        cmds += [hub + ["link", "set", "lo", "up"],
                 hub + ["link", "add", "br0", "type", "bridge"], hub + ["link", "set", "br0", "up"]]
        for r in self.roles:
            ns, port, mtu = self.ns(r), self.hub_port(r), str(self.mtu)
            cmds += [hub + ["link", "add", port, "mtu", mtu, "type", "veth", "peer", "name",
                            DEV, "mtu", mtu, "netns", ns],
                     hub + ["link", "set", port, "master", "br0"],
                     hub + ["link", "set", port, "up"],
                     ["ip", "-n", ns, "link", "set", "lo", "up"],
                     ["ip", "-n", ns, "addr", "add", "%s/%d" % (self.addr(r), self.prefixlen),
                      "dev", DEV],
                     ["ip", "-n", ns, "link", "set", DEV, "up"]]
            rate = self.role_rates.get(r, self.rate_bps)
            cmds += qdisc_commands(ns, DEV, rate, self.delay_s / 2)
            cmds += qdisc_commands(self.hub, port, rate, self.delay_s / 2)
        return cmds

    def create(self):
        reason = check_capable()
        if reason:
            raise NetnsError(reason)
        try:
            for cmd in self.setup_commands():
                try:
                    _run(cmd)
                except NetnsError as err:
                    if "netem" in cmd:
                        raise NetnsError("--delay needs the kernel's netem qdisc (%s)" % err)
                    raise
                if cmd[:3] == ["ip", "netns", "add"]:
                    self.created.append(cmd[3])
        except BaseException:
            self.destroy()
            raise
        return self

    def destroy(self):
        """Delete what create() made; returns the errors (empty when all went)."""
        errors = []
        while self.created:
            name = self.created.pop()
            res = _run(["ip", "netns", "del", name], check=False)
            if res.returncode != 0 and name in own_namespaces(name):
                errors.append("%s: %s" % (name, res.stderr.strip()))
        return errors

    def counters(self, role):
        """(tx_bytes, rx_bytes) of the role's eth0 (``ip netns exec`` shows its /sys)."""
        base = "/sys/class/net/%s/statistics/" % DEV
        out = _run(self.exec_prefix(role) + ["cat", base + "tx_bytes", base + "rx_bytes"])
        tx, rx = out.stdout.split()
        return int(tx), int(rx)

    def all_counters(self):
        return {r: self.counters(r) for r in self.roles}

    def exec_prefix(self, role):
        return ["ip", "netns", "exec", self.ns(role)]
