"""Ports for the rendezvous servers miles starts (torch.distributed stores, SGLang servers)."""

from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A port no socket on ``host`` uses now ("" = every interface, the default).

    The default matters: a TCPStore listens on every interface, and a port that is free on
    127.0.0.1 can still be the local end of one of Ray's connections on the node's address;
    binding it there fails with EADDRINUSE (seen on the GPU machine). The port is free when
    this returns, not reserved: whoever binds it later can still lose a race.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
