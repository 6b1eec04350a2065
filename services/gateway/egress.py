"""The egress guard for remote image URLs (on only with `allow_remote_images`): the gateway fetches an address a
client names, so the name is resolved here, every address it resolves to is checked, and the connection goes to a
checked address only (pinned: aiohttp asks `_PinnedResolver`, which knows nothing else), so a DNS answer that
changes between the check and the connect (a rebind) cannot send it elsewhere.

Refused: loopback, private (RFC 1918), shared (CGNAT 100.64/10), link-local (with the cloud metadata address
169.254.169.254), ULA fc00::/7 (with fd00:ec2::254), site-local, unspecified, multicast, reserved and benchmark
ranges, IPv4 inside IPv6 (mapped ::ffff:0:0/96, compatible ::/96, 6to4, Teredo, NAT64), and IPv4 spelled in
decimal, octal or hex (`2130706433`, `0x7f.1`, `017700000001`: read as the C library reads them, then checked).
Redirects are not followed. Every failure reads the same (`FetchRefused`): the client never learns whether a
port was closed, filtered, refused or slow, nor which address a name resolved to.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import aiohttp.abc
from yarl import URL

from mesh.logging import get_logger

log = get_logger(__name__)

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
# host, port -> the addresses the name resolves to (text). Injectable for tests: no DNS here.
Resolver = Callable[[str, int], Awaitable[list[str]]]

# Refused whatever `ipaddress`'s flags say (belt and braces: NAT64 and 6to4 can carry an internal IPv4 address).
REFUSED_NETWORKS = tuple(
    ipaddress.ip_network(net)
    for net in (
        "0.0.0.0/8",
        "10.0.0.0/8",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "172.16.0.0/12",
        "192.0.0.0/24",
        "192.168.0.0/16",
        "198.18.0.0/15",
        "224.0.0.0/3",
        "::/96",  # IPv4-compatible (and :: and ::1)
        "::ffff:0:0/96",  # IPv4-mapped
        "64:ff9b::/96",  # NAT64
        "64:ff9b:1::/48",
        "2001::/32",  # Teredo
        "2002::/16",  # 6to4
        "fc00::/7",  # ULA, with fd00:ec2::254 (AWS metadata over IPv6)
        "fe80::/10",
        "fec0::/10",
        "ff00::/8",
    )
)
_NUMERIC_V4 = re.compile(r"(0x[0-9a-f]*|[0-9]+)(\.(0x[0-9a-f]*|[0-9]+))*", re.IGNORECASE)


class FetchRefused(Exception):
    """The URL may not or could not be fetched. Deliberately without detail: the caller answers one fixed text."""


class FetchTooLarge(Exception):
    """The body is over the byte limit (announced or as read)."""


def is_public(address: Address) -> bool:
    """An address the gateway may connect to on a client's say-so."""
    if any(address in net for net in REFUSED_NETWORKS if net.version == address.version):
        return False
    return address.is_global and not (
        address.is_multicast or address.is_reserved or address.is_link_local or address.is_unspecified
    )


def literal_address(host: str) -> Address | None:
    """The host as an IP address if it is one, in any spelling the C library accepts (decimal, octal, hex, short
    forms like 127.1); None for a name."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        pass
    if _NUMERIC_V4.fullmatch(host):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return ipaddress.IPv4Address(0)  # numeric but malformed: refused as unspecified, never resolved
    return None


async def system_resolve(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


class _PinnedResolver(aiohttp.abc.AbstractResolver):
    """Answers the one host name it was made for with the addresses already checked, and nothing else."""

    def __init__(self, host: str, addresses: list[Address]) -> None:
        self.host = host
        self.addresses = addresses

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[aiohttp.abc.ResolveResult]:
        if host != self.host:
            raise OSError("not the checked host")
        return [
            {
                "hostname": host,
                "host": str(address),
                "port": port,
                "family": socket.AF_INET if address.version == 4 else socket.AF_INET6,
                "proto": 0,
                "flags": socket.AI_NUMERICHOST,
            }
            for address in self.addresses
        ]

    async def close(self) -> None:
        return None


@dataclass(frozen=True)
class EgressGuard:
    allow_private: bool = False  # tests and on-premises image hosts only: logs a warning when built so
    resolve: Resolver = field(default=system_resolve, compare=False)

    def __post_init__(self) -> None:
        if self.allow_private:
            log.warning(
                "remote image fetches may reach loopback, private and metadata addresses "
                "(KVMESH_IMAGE_FETCH_ALLOW_PRIVATE): only for tests and trusted networks"
            )

    async def check(self, url: str) -> tuple[URL, list[Address]]:
        """The URL and the addresses it may be fetched from; FetchRefused unless every one of them is public."""
        try:
            parsed = URL(url)
            host, port = parsed.raw_host, parsed.port
        except (ValueError, TypeError):
            raise FetchRefused() from None
        if parsed.scheme not in ("http", "https") or not host or port is None:
            raise FetchRefused()
        literal = literal_address(host)
        if literal is not None:
            addresses = [literal]
        else:
            try:
                addresses = [ipaddress.ip_address(a.split("%", 1)[0]) for a in await self.resolve(host, port)]
            except (OSError, ValueError, UnicodeError):
                raise FetchRefused() from None
        if not addresses or not (self.allow_private or all(is_public(a) for a in addresses)):
            raise FetchRefused()
        return parsed, addresses

    async def fetch(self, url: str, max_bytes: int, timeout_s: float) -> bytes:
        """GET the URL from a checked address: status 200 only (a redirect is refused), at most max_bytes (more
        raises FetchTooLarge), within timeout_s. Anything else raises FetchRefused."""
        parsed, addresses = await self.check(url)
        host = parsed.raw_host
        assert host is not None  # check() refused hostless URLs
        if literal_address(host) is not None:  # connect to the address read, not to aiohttp's reading of the text
            try:
                parsed = parsed.with_host(str(addresses[0]))
            except ValueError:
                raise FetchRefused() from None
            host = parsed.raw_host
            assert host is not None
        connector = aiohttp.TCPConnector(resolver=_PinnedResolver(host, addresses), use_dns_cache=False)
        try:
            async with (
                aiohttp.ClientSession(
                    connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s), trust_env=False
                ) as session,
                session.get(parsed, allow_redirects=False) as response,
            ):
                if response.status != 200:
                    raise FetchRefused()
                if (response.content_length or 0) > max_bytes:
                    raise FetchTooLarge()
                data = await response.content.read(max_bytes + 1)
        except (aiohttp.ClientError, OSError, TimeoutError, asyncio.TimeoutError):
            raise FetchRefused() from None
        if len(data) > max_bytes:
            raise FetchTooLarge()
        return data
