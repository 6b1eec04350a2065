"""`python -m services.prefill` / `kvmesh serve prefill`: settings from KVMESH_* variables."""

from __future__ import annotations

import asyncio

from mesh.config import load_settings
from services.prefill.config import PrefillSettings
from services.prefill.server import serve


def main() -> None:
    asyncio.run(serve(load_settings(PrefillSettings)))


if __name__ == "__main__":
    main()
