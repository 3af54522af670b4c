"""bench.processes.free_port: a port named to a process before it binds it must not be one
the kernel can hand out meanwhile (to bind(0), or as a dialling socket's source)."""

import socket

from bench.processes import _ephemeral_range, free_port


def test_free_port_lies_below_the_ephemeral_range_and_binds():
    low, high = _ephemeral_range()
    assert 1024 <= low <= high
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= port < low for port in ports), (ports, low)
    assert len(ports) > 1  # drawn, not one fixed port every caller collides on
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_free_port_skips_a_port_in_use(monkeypatch):
    taken = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", taken))
        holder.listen()
        # Two ports to draw from: the one held and the next.
        monkeypatch.setattr("bench.processes._ephemeral_range", lambda: (taken + 2, taken + 99))
        monkeypatch.setattr("bench.processes.FREE_PORTS_BELOW", 2)
        ports = {free_port() for _ in range(10)}
    assert ports == {taken + 1}
