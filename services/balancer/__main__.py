"""`python -m services.balancer` (or `kvmesh serve balancer`): settings from KVMESH_* variables."""

from __future__ import annotations

import asyncio

from mesh.config import load_settings
from services.balancer.config import BalancerSettings
from services.balancer.server import serve


def main() -> None:
    asyncio.run(serve(load_settings(BalancerSettings)))


if __name__ == "__main__":
    main()
