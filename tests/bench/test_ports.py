"""bench.ports: the suite's and the workbench's one source of free ports."""

from __future__ import annotations

import socket

from bench.ports import PORTS_FROM, _ephemeral_low, free_port, free_port_run, free_ports


def _bind(port: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_ports_bound_later_come_from_below_the_ephemeral_range_and_are_free() -> None:
    low = _ephemeral_low()
    base = free_port_run(6)
    assert base >= PORTS_FROM and base + 6 <= low
    for port in range(base, base + 6):
        _bind(port)
    ports = free_ports(5)
    assert len(set(ports)) == 5 and all(PORTS_FROM <= p < low for p in ports)
    for port in ports:
        _bind(port)
    _bind(free_port())


def test_a_port_handed_out_is_not_handed_out_again_while_fresh() -> None:
    # Two tests may each be given a port before either binds it.
    handed = set(free_ports(50))
    for _ in range(20):
        base = free_port_run(3)
        run = set(range(base, base + 3))
        assert not run & handed
        handed |= run
