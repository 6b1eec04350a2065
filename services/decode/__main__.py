"""`python -m services.decode` / `kvmesh serve decode`: settings from KVMESH_* variables."""

from __future__ import annotations

import asyncio

from mesh.config import load_settings
from services.decode.config import DecodeSettings
from services.decode.server import serve


def main() -> None:
    asyncio.run(serve(load_settings(DecodeSettings)))


if __name__ == "__main__":
    main()
