"""`python -m services.gateway` (or `kvmesh serve gateway`), configured by KVMESH_* variables."""

from __future__ import annotations

import asyncio
import os
import sys

from engine_core.config import ConfigError
from mesh.bus import BusError
from mesh.config import SettingError, load_settings
from services.gateway.config import GatewaySettings
from services.gateway.server import serve


def main() -> None:
    # The tokenizer threads (catalog.off_loop) are the parallelism. Left on, `tokenizers` hands every encode_batch
    # to its own thread pool and waits for it: two more thread wake-ups per request (1-2 ms on a loaded machine)
    # for nothing, as one chat is a few short texts. It still releases the GIL while it encodes.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
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
