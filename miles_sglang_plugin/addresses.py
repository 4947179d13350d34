"""Network addresses as URLs: one place for the IPv6 bracket rule (a shared leaf, no imports)."""

from __future__ import annotations


def strip_brackets(host: str) -> str:
    """``[::1]`` -> ``::1``; any other host unchanged."""
    if host.startswith("[") and host.endswith("]"):
        return host[1:-1]
    return host


def host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host wrapped in ``[]`` (an already wrapped one is kept as is)."""
    host = strip_brackets(host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def http_base_url(host: str, port: int, scheme: str = "http") -> str:
    """``http://host:port``, with an IPv6 host wrapped in ``[]``."""
    return f"{scheme}://{host_port(host, port)}"
