"""Network namespaces joined by shaped veth links, for the ``comm`` benchmark.

Topology (a star, like hosts on one switch): a hub namespace holds a Linux bridge;
every role (scheduler, each server, each worker) gets its own namespace with one
interface ``eth0`` whose veth peer sits in the hub, attached to the bridge. Both
directions of every link are shaped with ``tc tbf`` (the role's egress on its
``eth0``, the role's ingress on the hub-side peer), so each node can send and receive
``rate`` at the same time, as on a full-duplex switch port. ``delay`` (netem) is split
in halves over the two egress points of a path: one-way delay between two nodes is
``delay``, the round trip twice that.

Everything lives inside namespaces created here; no interface, address or route of the
host namespace is touched. Namespace names carry ``mxhcomm<pid>-`` so parallel runs
never clash and :meth:`Topology.destroy` removes only this process's namespaces
(deleting a namespace deletes the veth ends and qdiscs in it).

Needs root and iproute2 (``ip``, ``tc``); :func:`check_capable` says why not.
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

_RATE_UNITS = {            # tc(8) units, to bits per second (SI prefixes as tc uses them)
    "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "kibit": 1024, "mibit": 1024 ** 2, "gibit": 1024 ** 3, "tibit": 1024 ** 4,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
    "kibps": 8 * 1024, "mibps": 8 * 1024 ** 2, "gibps": 8 * 1024 ** 3, "tibps": 8 * 1024 ** 4,
}
_TIME_UNITS = {"s": 1.0, "sec": 1.0, "secs": 1.0, "ms": 1e-3, "msec": 1e-3, "msecs": 1e-3,
               "us": 1e-6, "usec": 1e-6, "usecs": 1e-6}


class NetnsError(RuntimeError):
    """Namespaces could not be created or used (not root, no iproute2, a command failed)."""


# ----------------------------------------------------------------------------- parsing

def parse_rate(text):
    """A tc rate ('1gbit', '100mbit', '10Gbit', '125mbps' = bytes/s) in bits per second;
    'none': unshaped links (math.inf: no tbf, only the veths' and CPUs' own speed)."""
    if str(text).strip().lower() == "none":
        return math.inf
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m:
        raise ValueError("not a rate: %r (examples: 1gbit, 100mbit)" % (text,))
    value, unit = float(m.group(1)), m.group(2).lower() or "bit"
    if unit not in _RATE_UNITS:
        raise ValueError("unknown rate unit %r in %r (tc units: bit kbit mbit gbit, "
                         "bps = bytes/s)" % (unit, text))
    bps = value * _RATE_UNITS[unit]
    if bps <= 0:
        raise ValueError("rate must be positive: %r" % (text,))
    return bps


def parse_role_rates(text):
    """'server1=250mbit,worker0=100mbit' -> {role: bits per second} ('' -> {})."""
    rates = {}
    for item in filter(None, (t.strip() for t in (text or "").split(","))):
        role, sep, rate = item.partition("=")
        if not sep or not role.strip():
            raise ValueError("a role's rate is ROLE=RATE (e.g. server1=250mbit), got %r"
                             % (item,))
        rates[role.strip()] = parse_rate(rate.strip())
    return rates


def parse_time(text):
    """A tc time ('2ms', '100us', '0.5s'; a bare number is seconds) in seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or (m.group(2).lower() or "s") not in _TIME_UNITS:
        raise ValueError("not a time: %r (examples: 1ms, 200us)" % (text,))
    return float(m.group(1)) * _TIME_UNITS[m.group(2).lower() or "s"]


def parse_counters(text):
    """``(tx_bytes, rx_bytes)`` from the output of ``cat .../tx_bytes .../rx_bytes``."""
    fields = text.split()
    if len(fields) != 2 or not all(f.isdigit() for f in fields):
        raise ValueError("expected two byte counters (tx rx), got %r" % (text,))
    return int(fields[0]), int(fields[1])


def counters_command(ns, dev=DEV):
    """Reads an interface's counters inside ``ns`` (``ip netns exec`` mounts that
    namespace's /sys, so /sys/class/net shows its interfaces)."""
    base = "/sys/class/net/%s/statistics/" % dev
    return ["ip", "netns", "exec", ns, "cat", base + "tx_bytes", base + "rx_bytes"]


def tbf_burst_bytes(rate_bps):
    """Bucket size for tbf: 2 ms of traffic, at least 64 KiB (one GSO packet fits, and
    the bucket refills within a timer tick at any rate)."""
    if math.isinf(rate_bps):
        return None                     # unshaped: no tbf
    return max(int(rate_bps / 8 * 0.002), 64 * 1024)


def qdisc_commands(ns, dev, rate_bps, delay_s=0.0, queue_s=0.05):
    """tc commands shaping ``dev``'s egress in ``ns``: netem delay (if any) as root
    with tbf below it, else tbf as root. ``queue_s``: tbf's 'latency' (queue bound).
    An infinite rate (parse_rate('none')) adds no tbf."""
    if math.isinf(rate_bps):
        if delay_s and delay_s > 0:
            return [["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:",
                     "netem", "delay", "%dus" % int(round(delay_s * 1e6)), "limit", "100000"]]
        return []
    rate = "%dbit" % int(rate_bps)
    tbf = ["tbf", "rate", rate, "burst", str(tbf_burst_bytes(rate_bps)),
           "latency", "%dms" % max(1, int(round(queue_s * 1000)))]
    if delay_s and delay_s > 0:
        return [["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                 "delay", "%dus" % int(round(delay_s * 1e6)), "limit", "100000"],
                ["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:"]
                + tbf]
    return [["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:"] + tbf]


# ----------------------------------------------------------------------------- checks

def check_capable():
    """None when namespaces can be made here, else the reason (a sentence)."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return ("the comm benchmark needs iproute2 (%s not found on PATH)"
                % " and ".join(missing))
    if os.geteuid() != 0:
        return ("the comm benchmark needs root: it creates network namespaces, veth links "
                "and tc qdiscs (run it as root, e.g. with sudo)")
    return None


def namespaces_usable():
    """Whether a network namespace can really be made here: check_capable() passes and
    a probe namespace is created and deleted (root in a container may lack the right)."""
    if check_capable():
        return False
    name = "mxhcomm%d-probe" % os.getpid()
    try:
        ok = _run(["ip", "netns", "add", name], check=False).returncode == 0
    except NetnsError:
        return False
    if ok:
        _run(["ip", "netns", "del", name], check=False)
    return ok


def _run(cmd, check=True):
    try:
        res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             timeout=CMD_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise NetnsError("timed out after %ds: %s" % (CMD_TIMEOUT, " ".join(cmd)))
    if check and res.returncode != 0:
        raise NetnsError("failed (%d): %s: %s" % (res.returncode, " ".join(cmd),
                                                   res.stderr.strip()))
    return res


def own_namespaces(prefix):
    """Names of existing namespaces starting with ``prefix``."""
    res = _run(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in res.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix)]


def stale_namespaces():
    """Namespaces of this benchmark whose creating process is gone (a run killed with
    SIGKILL leaves them): ``mxhcomm<pid>-...`` with no live ``pid``."""
    stale = []
    for name in own_namespaces(PREFIX):
        m = re.match(re.escape(PREFIX) + r"(\d+)-", name)
        if m and not os.path.exists("/proc/%s" % m.group(1)):
            stale.append(name)
    return stale


# ----------------------------------------------------------------------------- topology

class Topology:
    """Scheduler, servers and workers in their own namespaces around a bridge.

    roles: names like 'scheduler', 'server0', 'worker3' (in that order addresses are
    given: .1, .2, ...). ``ns(role)``, ``addr(role)``; ``counters(role)`` reads eth0.
    Use as a context manager, or call create()/destroy() (destroy is idempotent and
    removes only namespaces this object created).
    """

    def __init__(self, roles, rate_bps, delay_s=0.0, subnet="10.203.0.0/24", mtu=1500,
                 tag=None, role_rates=None):
        self.roles = list(roles)
        self.rate_bps = float(rate_bps)
        # {role: bits per second} of links slower or faster than rate_bps (both ways)
        self.role_rates = {r: float(b) for r, b in (role_rates or {}).items()}
        unknown = sorted(set(self.role_rates) - set(self.roles))
        if unknown:
            raise ValueError("rates given for roles not in the topology: %s (roles: %s)"
                             % (", ".join(unknown), ", ".join(self.roles)))
        self.delay_s = float(delay_s or 0.0)
        self.mtu = int(mtu)
        self.prefix = "%s%d-%s" % (PREFIX, os.getpid(), (tag + "-") if tag else "")
        net = ipaddress.ip_network(subnet)
        hosts = list(net.hosts())
        if len(self.roles) > len(hosts):
            raise ValueError("subnet %s too small for %d roles" % (subnet, len(self.roles)))
        self.prefixlen = net.prefixlen
        self._addr = {r: str(hosts[i]) for i, r in enumerate(self.roles)}
        self._ns = {r: self.prefix + r for r in self.roles}
        self.hub = self.prefix + "hub"
        self.created = []            # namespaces made, in order

    def ns(self, role):
        return self._ns[role]

    def addr(self, role):
        return self._addr[role]

    def hub_port(self, role):
        return "p%d" % self.roles.index(role)

    def setup_commands(self):
        """Every ip/tc command create() runs, in order (namespaces are added first)."""
        cmds = [["ip", "netns", "add", self.hub]]
        cmds += [["ip", "netns", "add", self._ns[r]] for r in self.roles]
        cmds += [["ip", "-n", self.hub, "link", "set", "lo", "up"],
                 ["ip", "-n", self.hub, "link", "add", "br0", "type", "bridge"],
                 ["ip", "-n", self.hub, "link", "set", "br0", "up"]]
        half = self.delay_s / 2.0
        for r in self.roles:
            ns, port = self._ns[r], self.hub_port(r)
            cmds += [
                ["ip", "-n", self.hub, "link", "add", port, "mtu", str(self.mtu), "type",
                 "veth", "peer", "name", DEV, "mtu", str(self.mtu), "netns", ns],
                ["ip", "-n", self.hub, "link", "set", port, "master", "br0"],
                ["ip", "-n", self.hub, "link", "set", port, "up"],
                ["ip", "-n", ns, "link", "set", "lo", "up"],
                ["ip", "-n", ns, "addr", "add", "%s/%d" % (self._addr[r], self.prefixlen),
                 "dev", DEV],
                ["ip", "-n", ns, "link", "set", DEV, "up"],
            ]
            rate = self.role_rates.get(r, self.rate_bps)
            cmds += qdisc_commands(ns, DEV, rate, half)
            cmds += qdisc_commands(self.hub, port, rate, half)
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
                    if "netem" in cmd and "unknown" in str(err):
                        raise NetnsError("--delay needs the netem qdisc, which this kernel "
                                         "does not have (%s)" % err)
                    raise
                if cmd[:3] == ["ip", "netns", "add"]:
                    self.created.append(cmd[3])
        except BaseException:
            self.destroy()
            raise
        return self

    def destroy(self):
        """Delete the namespaces this object created (their links and qdiscs go with
        them). Returns the list of errors (empty when all went)."""
        errors = []
        while self.created:
            name = self.created.pop()
            res = _run(["ip", "netns", "del", name], check=False)
            if res.returncode != 0 and name in own_namespaces(name):
                errors.append("%s: %s" % (name, res.stderr.strip()))
        return errors

    def counters(self, role):
        """(tx_bytes, rx_bytes) of the role's eth0."""
        return parse_counters(_run(counters_command(self._ns[role])).stdout)

    def all_counters(self):
        return {r: self.counters(r) for r in self.roles}

    def exec_prefix(self, role):
        """argv prefix running a command inside the role's namespace."""
        return ["ip", "netns", "exec", self._ns[role]]

    def __enter__(self):
        return self.create()

    def __exit__(self, *exc):
        self.destroy()
        return False
