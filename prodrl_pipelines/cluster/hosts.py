"""Several hosts on this machine: each a network, PID, mount and UTS namespace, all on one bridge.

    python -m prodrl_pipelines.cluster.hosts up --hosts 5 --root DIR    # until SIGTERM/SIGINT
    python -m prodrl_pipelines.cluster.hosts clean                      # a crashed run's leftovers

A host (``Host``) is a network namespace ``<prefix>-h<i>`` holding ``eth0`` (``10.213.0.<10+i>/24``,
a subnet that exists only inside these namespaces) and a PID namespace whose init (pid 1) is a small
reaper started with ``unshare --pid --fork --kill-child --mount-proc --uts``. The init mounts the
host's own ``/tmp`` (``ROOT/h<i>/tmp`` seen from outside) and ``/dev/shm``, and names the host: a
process on it sees only its host's processes, files in ``/tmp`` and address. The other ends of the
hosts' links sit on a bridge in a switch namespace of their own (``<prefix>-sw``), so nothing of the
test network is reachable from this machine's own namespaces (a packet sent to a host's address from
there leaves by this machine's default route: run clients on a host), and this machine's loopback
services are not reachable from a host: what the hosts share is what they serve to each other. The
software they run (this interpreter's environment, this checkout) is the machine's, as an image's is
on every machine: where it lies under /tmp, each host's init binds it back into its own /tmp.

Faults are made by the network and by hosts, never by process name:

- ``host.cut()`` / ``host.restore()``: the host's link goes down on the switch (packets to and from it
  are dropped, so calls time out as on a real partition) and comes back;
- ``hosts.partition(a, b)`` / ``hosts.heal(a, b)``: only traffic between two hosts is dropped
  (``tc`` filters on both hosts' links: silently, so connections time out);
- ``host.power_off()``: the link drops and the host's init is killed (SIGKILL, by pid): the kernel
  ends every process of its PID namespace; ``host.boot()`` starts it again, empty, at its address.

Every name carries the run's prefix ``prh-<pid>-<4 hex>``; ``stop()`` removes what the run made (its
processes first, by pid), and ``clean_leftovers()`` (called by ``start``) removes the namespaces of
runs whose process is gone, and the processes still inside them, by those names only. Namespaces need
root (CAP_SYS_ADMIN, CAP_NET_ADMIN): ``unavailable()`` says why they are refused, for a skip.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from prodrl_pipelines.deploy_targets.server_records import pid_alive

PREFIX_HEAD = "prh-"
SUBNET = "10.213.0"  # /24; host i is .<10+i>, so a run of up to 200 hosts fits
FIRST = 10

# pid 1 of a host: mounts its own /tmp (with the shared software under /tmp bound back in at the same
# paths) and /dev/shm, names the host, says so on stdout, then reaps orphans (a PID namespace's init
# adopts them) until the host is killed
INIT = r"""
import json, os, signal, socket, subprocess, sys
tmp, name, shared, names = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
for path in shared:
    inside = os.path.join(tmp, os.path.relpath(path, "/tmp"))
    os.makedirs(inside, exist_ok=True)
    subprocess.run(["mount", "--bind", path, inside], check=True)
subprocess.run(["mount", "--rbind", tmp, "/tmp"], check=True)
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8g", "tmpfs", "/dev/shm"], check=True)
# the hosts' names resolve as a cluster's DNS makes them (Gloo, for one, binds to what its own name resolves to)
with open("/tmp/.hosts", "w") as f:
    f.write(names)
subprocess.run(["mount", "--bind", "/tmp/.hosts", "/etc/hosts"], check=True)
socket.sethostname(name)
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
print("up", flush=True)
while True:
    signal.sigwait([signal.SIGCHLD])
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass
"""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({res.returncode}): {res.stderr.strip()}")
    return res


def _tc(host: "Host", *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``tc`` in the host's network namespace."""
    res = subprocess.run(["ip", "netns", "exec", host.netns, "tc", *args], capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"`tc {' '.join(args)}` on {host.name} failed ({res.returncode}): {res.stderr.strip()}")
    return res


def _drop_class(host: "Host") -> None:
    """The host's ``eth0`` sends through an ``htb`` root: class 1:10 (the default) passes everything,
    class 1:20 ends in a ``pfifo`` of length 0, which drops what it is given; a partition's ``u32``
    filter steers one destination there. (Classes and a queue, not a ``drop`` action: kernels without
    the tc action modules still have these.)"""
    for args in (("qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "10", "r2q", "100000"),
                 ("class", "add", "dev", "eth0", "parent", "1:", "classid", "1:10", "htb", "rate", "100gbit"),
                 ("class", "add", "dev", "eth0", "parent", "1:", "classid", "1:20", "htb", "rate", "100gbit"),
                 ("qdisc", "add", "dev", "eth0", "parent", "1:20", "handle", "20:", "pfifo", "limit", "0")):
        _tc(host, *args)


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def software_under_tmp() -> list[str]:
    """What every host runs from (this interpreter's environment, this package's checkout) where it
    lies under /tmp (a clone there, as CI may make): a host's own /tmp would hide it, so its init binds
    it back at the same path, as an image's software is on every machine."""
    import prodrl_pipelines

    paths = {Path(sys.prefix), Path(sys.base_prefix), Path(prodrl_pipelines.__file__).resolve().parents[1],
             Path(sys.executable).resolve().parent}
    under = sorted(str(p.resolve()) for p in paths if Path("/tmp") in p.resolve().parents)
    return [p for p in under if not any(p != q and p.startswith(q + "/") for q in under)]  # outermost only


def unavailable() -> str:
    """Why simulated hosts cannot be made here ("" when they can): not root, no ``ip``/``unshare``/
    ``nsenter``, or the kernel refuses a network or PID namespace."""
    import shutil

    if os.geteuid() != 0:
        return "simulated hosts need root (network and PID namespaces)"
    missing = [t for t in ("ip", "tc", "unshare", "nsenter", "mount") if shutil.which(t) is None]
    if missing:
        return f"simulated hosts need {', '.join(missing)} (iproute2, util-linux)"
    name = f"{PREFIX_HEAD}probe-{os.getpid()}"
    res = _ip("netns", "add", name, check=False)
    if res.returncode != 0:
        return f"network namespaces refused: {res.stderr.strip()}"
    try:
        probe = subprocess.run(["ip", "netns", "exec", name, "unshare", "--pid", "--fork", "--mount-proc", "true"],
                               capture_output=True, text=True, timeout=60)
        if probe.returncode != 0:
            return f"PID namespaces refused: {probe.stderr.strip()}"
    finally:
        _ip("netns", "del", name, check=False)
    return ""


@dataclass
class HostProcess:
    """A process started on a host: ``popen`` is the ``nsenter`` in this machine's namespaces that
    waits for it; ``pid`` is the process itself (as this machine's process table numbers it)."""

    popen: subprocess.Popen
    pid: int

    def send_signal(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.popen.wait(timeout)

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``; returns once it has exited."""
        if self.poll() is not None:
            return
        self.terminate()
        try:
            self.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait(30)


@dataclass
class Host:
    name: str  # h1, h2, ...
    index: int
    netns: str
    switch: str  # the switch namespace; the host's port on the bridge is named after the host
    root: Path  # this host's directory seen from outside; its /tmp is root/"tmp"
    names: str = ""  # its /etc/hosts: every host's name and address
    init: subprocess.Popen | None = None
    processes: list[HostProcess] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"{SUBNET}.{FIRST + self.index}"

    @property
    def tmp(self) -> Path:
        """The host's /tmp, as seen from this machine (write a file here for a process on the host)."""
        return self.root / "tmp"

    @property
    def ns_pid(self) -> int:
        """The host's pid 1, as this machine numbers it (what ``nsenter`` targets)."""
        if self.init is None or self.init.poll() is not None:
            raise RuntimeError(f"host {self.name} is not running")
        kids = _children(self.init.pid)
        if not kids:
            raise RuntimeError(f"host {self.name}: its init process is gone")
        return kids[0]

    @property
    def up(self) -> bool:
        return self.init is not None and self.init.poll() is None

    def boot(self) -> "Host":
        """Start the host's init (an empty host: no process of an earlier boot survives) and its link."""
        if self.up:
            return self
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.tmp.chmod(0o1777)  # as a machine's /tmp: services that run as their own user write there
        self.init = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, "unshare", "--pid", "--fork", "--kill-child", "--mount-proc",
             "--uts", sys.executable, "-c", INIT, str(self.tmp), self.name, json.dumps(software_under_tmp()),
             self.names or f"127.0.0.1 localhost\n{self.address} {self.name}\n"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        line = self.init.stdout.readline()  # "up" once mounted and named; "" when it died
        if line.strip() != "up":
            err = self.init.stderr.read() if self.init.poll() is not None else ""
            self.power_off()
            raise RuntimeError(f"host {self.name} did not come up: {err.strip()[-2000:]}")
        self.restore()
        return self

    def popen(self, argv: list[str], env: dict | None = None, log: Path | None = None,
              cwd: str | Path | None = None) -> HostProcess:
        """Run ``argv`` on the host (its network, processes, /tmp and name), output to ``log``."""
        out = open(log, "ab") if log is not None else subprocess.DEVNULL
        try:
            p = subprocess.Popen(["nsenter", "-t", str(self.ns_pid), "--net", "--pid", "--mount", "--uts", "--",
                                  *argv], env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            if log is not None:
                out.close()
        deadline = time.monotonic() + 30
        while not (kids := _children(p.pid)) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        proc = HostProcess(p, kids[0] if kids else p.pid)
        self.processes.append(proc)
        return proc

    def run(self, argv: list[str], timeout: float = 120.0, env: dict | None = None,
            check: bool = False) -> subprocess.CompletedProcess:
        """``argv`` on the host to its end; its output captured."""
        res = subprocess.run(["nsenter", "-t", str(self.ns_pid), "--net", "--pid", "--mount", "--uts", "--", *argv],
                             capture_output=True, text=True, timeout=timeout, env=env)
        if check and res.returncode != 0:
            raise RuntimeError(f"{argv} on {self.name} exited {res.returncode}: {(res.stdout + res.stderr)[-2000:]}")
        return res

    def pids(self) -> list[int]:
        """The host's processes, as this machine numbers them (its init included)."""
        res = _ip("netns", "pids", self.netns, check=False)
        return [int(p) for p in res.stdout.split()]

    def cut(self) -> None:
        """The host's link down: every packet to or from it is dropped (its processes keep running)."""
        _ip("-n", self.switch, "link", "set", self.name, "down")

    def restore(self) -> None:
        _ip("-n", self.switch, "link", "set", self.name, "up")

    def power_off(self, timeout_s: float = 60.0) -> None:
        """The host gone at once: its link drops and its init is killed, which ends all its processes."""
        _ip("-n", self.switch, "link", "set", self.name, "down", check=False)
        if self.init is not None and self.init.poll() is None:
            self.init.kill()  # unshare --kill-child: its child, pid 1 of the host, gets SIGKILL too
            self.init.wait(timeout_s)
        deadline = time.monotonic() + timeout_s
        while (left := [p for p in self.pids() if pid_alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in left:  # the kernel ends a PID namespace with its init; this only guards the wait
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.processes:
            try:
                p.popen.wait(10)
            except subprocess.TimeoutExpired:
                p.popen.kill()
        self.processes.clear()


class SimulatedHosts:
    """``n`` hosts (``h1`` .. ``hN``) of one run; ``start()`` makes and boots them, ``stop()`` removes them."""

    def __init__(self, n: int, root: Path, prefix: str | None = None) -> None:
        if n < 1 or n > 200:
            raise ValueError(f"hosts: {n} is not between 1 and 200")
        self.n, self.root = n, Path(root)
        self.prefix = prefix or f"{PREFIX_HEAD}{os.getpid()}-{secrets.token_hex(2)}"
        self.switch = f"{self.prefix}-sw"
        self.hosts = [Host(f"h{i}", i, f"{self.prefix}-h{i}", self.switch, self.root / f"h{i}") for i in range(1, n + 1)]
        names = "127.0.0.1 localhost\n" + "".join(f"{h.address} {h.name}\n" for h in self.hosts)
        for h in self.hosts:
            h.names = names

    def __getitem__(self, i: int) -> Host:
        """Host ``i`` (1-based, as named)."""
        return self.hosts[i - 1]

    def start(self) -> "SimulatedHosts":
        clean_leftovers()
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "set", "lo", "up")
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for h in self.hosts:
                _ip("netns", "add", h.netns)
                _ip("-n", self.switch, "link", "add", h.name, "type", "veth", "peer", "name", "eth0", "netns", h.netns)
                _ip("-n", self.switch, "link", "set", h.name, "master", "br0")
                _ip("-n", h.netns, "link", "set", "lo", "up")
                _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0")
                _ip("-n", h.netns, "link", "set", "eth0", "up")
                _drop_class(h)
                h.boot()
        except BaseException:
            self.stop()
            raise
        (self.root / "hosts.json").write_text(json.dumps(self.describe(), indent=1))
        return self

    def describe(self) -> dict:
        return {"prefix": self.prefix, "pid": os.getpid(), "subnet": f"{SUBNET}.0/24",
                "hosts": [{"name": h.name, "address": h.address, "netns": h.netns, "tmp": str(h.tmp),
                           "init": h.init.pid if h.init else None} for h in self.hosts]}

    def partition(self, a: Host, b: Host) -> None:
        """Drop the traffic between hosts ``a`` and ``b`` only: each host's link drops what it sends to
        the other (a ``tc`` filter on ``eth0`` into the dropping class, ``_drop_class``), silently, as a
        network does (a blackhole route would fail the sender at once, which no partition does)."""
        for src, dst in ((a, b), (b, a)):
            _tc(src, "filter", "replace", "dev", "eth0", "parent", "1:", "protocol", "ip", "pref", str(dst.index),
                "u32", "match", "ip", "dst", f"{dst.address}/32", "flowid", "1:20")

    def heal(self, a: Host, b: Host) -> None:
        for src, dst in ((a, b), (b, a)):
            _tc(src, "filter", "del", "dev", "eth0", "parent", "1:", "pref", str(dst.index), check=False)

    def stop(self) -> None:
        """Every host powered off (its processes killed by pid), then this run's namespaces removed."""
        for h in self.hosts:
            try:
                h.power_off()
            except Exception as e:  # noqa: BLE001 - the namespaces still go
                print(f"hosts: powering off {h.name} failed: {e}", file=sys.stderr)
        for name in [h.netns for h in self.hosts] + [self.switch]:
            _ip("netns", "del", name, check=False)

    def __enter__(self) -> "SimulatedHosts":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def clean_leftovers() -> list[str]:
    """Remove the namespaces (and the processes inside them, by pid) of runs whose process is gone:
    only names ``prh-<pid>-...`` whose ``<pid>`` no longer runs. Returns the names removed."""
    res = _ip("netns", "list", check=False)
    names = [line.split()[0] for line in res.stdout.splitlines() if line.startswith(PREFIX_HEAD)]
    removed = []
    for name in names:
        parts = name[len(PREFIX_HEAD):].split("-")
        if not parts[0].isdigit() or pid_alive(int(parts[0])):
            continue  # a running run's, or not of this form (a probe of a live process)
        for pid in (int(p) for p in _ip("netns", "pids", name, check=False).stdout.split()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _ip("netns", "del", name, check=False)
        removed.append(name)
    return removed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="make N hosts, write ROOT/hosts.json, keep them until SIGTERM/SIGINT")
    up.add_argument("--hosts", type=int, default=5)
    up.add_argument("--root", type=Path, required=True)
    sub.add_parser("clean", help="remove the namespaces of runs that are gone")
    a = ap.parse_args(argv)
    if a.cmd == "clean":
        print("\n".join(clean_leftovers()) or "nothing left over")
        return 0
    why = unavailable()
    if why:
        print(f"hosts: {why}", file=sys.stderr)
        return 2
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    with SimulatedHosts(a.hosts, a.root) as hosts:
        for h in hosts.hosts:
            print(f"{h.name} {h.address} (netns {h.netns}; run on it: nsenter -t {h.ns_pid} -n -p -m -u -- CMD)",
                  flush=True)
        while not stop:
            time.sleep(0.5)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
