"""`python -m services.gateway` (or `kvmesh serve gateway`), configured by KVMESH_* variables."""

from __future__ import annotations

import asyncio
import sys

from engine_core.config import ConfigError
from mesh.bus import BusError
from mesh.config import SettingError, load_settings
from services.gateway.config import GatewaySettings
from services.gateway.server import serve


def main() -> None:
    try:
        settings = load_settings(GatewaySettings)
    except SettingError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        asyncio.run(serve(settings))
    except (ConfigError, BusError) as exc:  # a model that cannot be opened, NATS unreachable: say which
        print(f"gateway: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
