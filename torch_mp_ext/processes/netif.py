"""Which network interface gloo should use: ``GLOO_SOCKET_IFNAME`` from the route.

Note [Gloo's interface]
Unless ``GLOO_SOCKET_IFNAME`` (or ``GLOO_SOCKET_IFADDR``) is set, gloo binds every rank's
sockets to the address this host's *name* resolves to, and tells the other ranks to connect
there. Wherever the name resolves to a loopback address (Debian's ``127.0.1.1`` line in
``/etc/hosts``, many containers, network namespaces), that works on one machine and fails
across machines: a rank on another host connects to its own loopback and the full mesh
never forms (a timeout, or "Connection refused"). torchrun does not help; users learn to set
the variable by hand.

The interface a rank should use is the one that reaches the rendezvous: the source address
the kernel picks for a datagram to the master (``connect`` on a UDP socket sends nothing; it
only looks the route up), then the interface holding that address. On the master's own host
this is the interface holding the master address, not ``lo``. When the master address is a
loopback one the job is on one machine, and gloo's default is right: nothing is set.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct

__all__ = ["ENV_VAR", "interface_for", "is_loopback", "set_gloo_socket_ifname",
           "source_address"]

logger = logging.getLogger(__name__)

#: gloo's own variable: the interface its sockets bind to.
ENV_VAR = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915  # <linux/sockios.h>: an interface's IPv4 address
_PROBE_PORT = 9  # discard; a UDP connect sends nothing, any port routes the same


def is_loopback(host: str) -> bool:
    """True for a loopback address (``127.x``, ``::1``) or ``localhost``."""
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return host == "localhost"


def source_address(host: str) -> str | None:
    """The address this host sends from to reach ``host`` (None if ``host`` does not
    resolve or no route leads there)."""
    try:
        infos = socket.getaddrinfo(host, _PROBE_PORT, type=socket.SOCK_DGRAM)
    except socket.gaierror:
        return None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as s:
            try:
                s.connect(sockaddr)
            except OSError:
                continue
            return s.getsockname()[0]
    return None


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                 struct.pack("256s", name.encode()[:15]))
        except OSError:  # no IPv4 address on this interface
            return None
    return socket.inet_ntoa(packed[20:24])


def _ipv6_owners() -> dict[str, str]:
    owners = {}
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                fields = line.split()
                if len(fields) == 6:
                    owners[str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))] = fields[5]
    except OSError:  # no IPv6 in this kernel
        pass
    return owners


def interface_for(host: str) -> str | None:
    """The name of the interface that reaches ``host`` (None for a loopback address, an
    address that does not resolve, or an interface that cannot be found; Note [Gloo's
    interface])."""
    if is_loopback(host):
        return None
    src = source_address(host)
    if src is None or is_loopback(src):
        return None
    src = src.split("%")[0]
    if ":" in src:
        return _ipv6_owners().get(str(ipaddress.IPv6Address(src)))
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == src:
            return name
    return None


def set_gloo_socket_ifname(master_addr: str | None = None) -> str | None:
    """Sets ``GLOO_SOCKET_IFNAME`` to the interface that reaches the master, if unset.

    Call it before ``torch.distributed.init_process_group("gloo")``; :func:`launch`'s
    workers have it called for them. It changes nothing when the variable (or
    ``GLOO_SOCKET_IFADDR``) is set already, or when the master is on a loopback address
    (one machine: gloo's default is right).

    Args:
        master_addr: the rendezvous host; default ``$MASTER_ADDR`` (as torchrun and
            :func:`launch` set it).

    Returns:
        The value of ``GLOO_SOCKET_IFNAME`` now (None if it stays unset).

    Example:
        ```python
        import os
        import torch_mp_ext as mp

        # In a torchrun worker, before init_process_group("gloo"):
        print(mp.set_gloo_socket_ifname(os.environ.get("MASTER_ADDR", "127.0.0.1")))
        ```
    """
    if ENV_VAR in os.environ or "GLOO_SOCKET_IFADDR" in os.environ:
        return os.environ.get(ENV_VAR)
    master_addr = master_addr or os.environ.get("MASTER_ADDR")
    if not master_addr:
        return None
    name = interface_for(master_addr)
    if name is not None:
        os.environ[ENV_VAR] = name
        logger.debug("%s=%s: the interface that routes to the master %s (set %s to choose "
                     "another)", ENV_VAR, name, master_addr, ENV_VAR)
    return name
