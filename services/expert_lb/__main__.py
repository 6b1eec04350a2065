"""`python -m services.expert_lb` (or `kvmesh serve expert_lb`): settings from KVMESH_* variables."""

from __future__ import annotations

import asyncio

from mesh.config import load_settings
from services.expert_lb.config import ExpertLBSettings
from services.expert_lb.server import serve


def main() -> None:
    asyncio.run(serve(load_settings(ExpertLBSettings)))


if __name__ == "__main__":
    main()
