"""vLLM's network helpers (vllm.utils.network_utils): this host's address and a free port."""

from __future__ import annotations


def get_ip() -> str:
    """This host's address as other hosts see it (the outgoing interface), else 127.0.0.1."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent for a UDP connect
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def get_open_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]
