"""The port a local vLLM server is started on: never one the kernel may hand to another socket meanwhile.

The rule relied on is the kernel's: ip_local_port_range "defines the local port range that is used by TCP and UDP
to choose the local port" (Documentation/networking/ip-sysctl.rst), so a socket bound to port 0 or connected
without a bind is numbered inside it, never below it. A fresh-machine CI run lost every real-vLLM test to a port
picked inside the range: draft-perturbed exited with "OSError: [Errno 98] Address already in use" on 41635."""

from __future__ import annotations

import socket

from b70ctl.serve import local


def test_ports_are_below_the_ephemeral_range_free_and_never_handed_out_twice():
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = [local.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(1024 <= port < low for port in ports)
    for port in ports[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free when handed out


def test_a_port_in_use_is_not_handed_out(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(local, "_ephemeral_low", lambda: busy + 1)
        monkeypatch.setattr(local, "_HANDED_OUT", set())
        # Candidates tried from the top: the listening port comes first and is passed over.
        monkeypatch.setattr(local.random.SystemRandom, "shuffle", lambda self, items: items.reverse())
        port = local.free_port()
        assert port < busy
