"""The egress guard of remote image URLs (services/gateway/egress.py) against a real aiohttp server on 127.0.0.1:
every spelling of an internal address is refused with one fixed text, before any connection; with
KVMESH_IMAGE_FETCH_ALLOW_PRIVATE's switch on, the same server is fetched for real (the fetch path itself)."""

from __future__ import annotations

import io
import ipaddress
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from aiohttp import web
from PIL import Image

from engine_core.images import ImageLimits
from kvmesh.nats_server import free_port
from services.gateway.egress import EgressGuard, FetchRefused, is_public, literal_address
from services.gateway.errors import GatewayError
from services.gateway.images import ImagePart, ImageSettings, read_image

pytestmark = pytest.mark.asyncio(loop_scope="module")
PARAM = "messages[0].content[1]"
FIXED = f"{PARAM}.image_url could not be fetched"


def png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(out, "PNG")
    return out.getvalue()


class Server:
    def __init__(self, port: int) -> None:
        self.port = port
        self.paths: list[str] = []  # every request that reached it


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server() -> AsyncIterator[Server]:
    image = png()
    seen = Server(free_port())

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.paths.append(request.path)
        if request.path == "/cat.png":
            return web.Response(body=image, content_type="image/png")
        if request.path == "/big.png":
            return web.Response(body=image * 50, content_type="image/png")
        if request.path == "/moved.png":
            raise web.HTTPFound("/cat.png")
        return web.Response(status=404)

    runner = web.AppRunner(web.Application())
    runner.app.router.add_get("/{name}", handler)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", seen.port).start()
    try:
        yield seen
    finally:
        await runner.cleanup()


@pytest.fixture(autouse=True)
def no_requests_yet(server: Server) -> None:
    server.paths.clear()


def fake_dns(table: dict[str, list[str]]) -> EgressGuard:
    async def resolve(host: str, port: int) -> list[str]:
        if host not in table:
            raise OSError("no such name")
        return table[host]

    return EgressGuard(resolve=resolve)


def settings(guard: EgressGuard) -> ImageSettings:
    return ImageSettings(
        ImageLimits(max_bytes=1024), max_images=4, allow_remote=True, fetch_timeout_s=5.0, egress=guard
    )


async def refused_text(url: str, guard: EgressGuard) -> str:
    with pytest.raises(GatewayError) as caught:
        await read_image(ImagePart(PARAM, url), settings(guard))
    assert caught.value.param == PARAM
    return str(caught.value)


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "localhost",
        "LOCALHOST.",
        "[::1]",
        "[::ffff:127.0.0.1]",
        "[::127.0.0.1]",
        "[::ffff:7f00:1]",
        "0.0.0.0",
        "[::]",
        "2130706433",
        "0x7f.1",
        "017700000001",
        "127.1",
        "0x7f000001",
        "169.254.169.254",
        "[fd00:ec2::254]",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "100.64.0.1",
        "[fc00::1]",
        "[fe80::1]",
        "224.0.0.1",
        "240.0.0.1",
        "255.255.255.255",
        "[64:ff9b::7f00:1]",
        "[2002:7f00:1::]",
        "internal.example",  # resolves (fake DNS) to loopback
        "mixed.example",  # one public and one loopback address: every address must pass
        "nowhere.example",  # does not resolve
    ],
)
async def test_internal_addresses_are_refused_with_one_text_before_any_connection(server: Server, host: str) -> None:
    guard = fake_dns(
        {
            "localhost": ["127.0.0.1", "::1"],
            "localhost.": ["127.0.0.1"],
            "internal.example": ["127.0.0.1"],
            "mixed.example": ["93.184.215.14", "127.0.0.1"],
        }
    )
    text = await refused_text(f"http://{host}:{server.port}/cat.png", guard)
    assert text == FIXED
    assert server.paths == []  # nothing reached the server


async def test_the_system_resolver_sees_through_localhost(server: Server) -> None:
    assert await refused_text(f"http://localhost:{server.port}/cat.png", EgressGuard()) == FIXED
    assert server.paths == []


async def test_closed_ports_and_open_ports_read_the_same(server: Server) -> None:
    """With private addresses allowed (so a connection is tried), a closed port, a 404 and a redirect give the
    same text: the client learns nothing about the network behind the gateway."""
    guard = EgressGuard(allow_private=True)
    closed = await refused_text(f"http://127.0.0.1:{free_port()}/cat.png", guard)
    missing = await refused_text(f"http://127.0.0.1:{server.port}/gone.png", guard)
    redirected = await refused_text(f"http://127.0.0.1:{server.port}/moved.png", guard)
    assert closed == missing == redirected == FIXED
    assert server.paths == ["/gone.png", "/moved.png"]  # the redirect was not followed to /cat.png


async def test_an_allowed_fetch_goes_to_the_checked_address(server: Server) -> None:
    """The pinned resolver: the name resolves once, through the guard; aiohttp connects to that address."""
    lookups: list[str] = []

    async def resolve(host: str, port: int) -> list[str]:
        lookups.append(host)
        return ["127.0.0.1"]

    guard = EgressGuard(allow_private=True, resolve=resolve)
    image = await read_image(ImagePart(PARAM, f"http://images.internal:{server.port}/cat.png"), settings(guard))
    assert image == png()
    assert lookups == ["images.internal"]
    assert server.paths == ["/cat.png"]
    numeric = await read_image(ImagePart(PARAM, f"http://2130706433:{server.port}/cat.png"), settings(guard))
    assert numeric == png()
    for spelling in ("[::1]", "[fe80::1%25lo]"):  # IPv6 literals are connected to as read (nothing listens there)
        assert await refused_text(f"http://{spelling}:{server.port}/cat.png", guard) == FIXED
    with pytest.raises(GatewayError, match="over the limit of 1024 bytes"):
        await read_image(ImagePart(PARAM, f"http://127.0.0.1:{server.port}/big.png"), settings(guard))


async def test_a_rebinding_name_cannot_move_the_connection(server: Server) -> None:
    """A name whose first answer is one address and the next another (where the server listens): the guard asks
    once and pins what it checked, so the connection goes to the first (nothing listens there: the fixed text)."""
    answers = [["127.0.0.2"], ["127.0.0.1"]]

    async def resolve(host: str, port: int) -> list[str]:
        return answers.pop(0)

    guard = EgressGuard(allow_private=True, resolve=resolve)
    text = await refused_text(f"http://rebind.example:{server.port}/cat.png", guard)
    assert text == FIXED
    assert answers == [["127.0.0.1"]]  # asked once
    assert server.paths == []


async def test_error_texts_never_echo_an_address() -> None:
    guard = fake_dns({"internal.example": ["10.9.8.7"]})
    text = await refused_text("http://internal.example/x.png", guard)
    assert "10.9.8.7" not in text and "internal.example" not in text


async def test_address_classes() -> None:
    assert is_public(ipaddress.ip_address("93.184.215.14"))
    assert is_public(ipaddress.ip_address("2606:2800:21f:cb07:6820:80da:af6b:8b2c"))
    for text in ("127.0.0.1", "::ffff:8.8.8.8", "::8.8.8.8", "100.127.255.255", "169.254.169.254", "fd00:ec2::254"):
        assert not is_public(ipaddress.ip_address(text)), text
    assert literal_address("0x7f.0.0.1") == ipaddress.ip_address("127.0.0.1")
    assert literal_address("017700000001") == ipaddress.ip_address("127.0.0.1")
    assert literal_address("1.2.3.4.5") == ipaddress.ip_address("0.0.0.0")  # numeric but malformed: refused
    assert literal_address("images.example") is None


async def test_other_schemes_are_refused() -> None:
    guard = EgressGuard(allow_private=True)
    with pytest.raises(FetchRefused):
        await guard.check("file:///etc/passwd")
    with pytest.raises(FetchRefused):
        await guard.check("http:///nohost")
