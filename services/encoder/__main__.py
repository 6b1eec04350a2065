"""`python -m services.encoder` (or `kvmesh serve encoder`): settings from KVMESH_* variables."""

from __future__ import annotations

import asyncio

from mesh.config import load_settings
from services.encoder.config import EncoderSettings
from services.encoder.server import serve


def main() -> None:
    asyncio.run(serve(load_settings(EncoderSettings)))


if __name__ == "__main__":
    main()
