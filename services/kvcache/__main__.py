"""`python -m services.kvcache` (or `kvmesh serve kvcache`): settings from KVMESH_* variables."""

from __future__ import annotations

import asyncio

from mesh.config import load_settings
from services.kvcache.config import KVCacheSettings
from services.kvcache.server import serve


def main() -> None:
    asyncio.run(serve(load_settings(KVCacheSettings)))


if __name__ == "__main__":
    main()
