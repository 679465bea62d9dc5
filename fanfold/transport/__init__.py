"""How fanfold reaches a fanfold server: an HTTP/1.1 client on asyncio streams and h11 (``h1``), under
both the SDK's HTTP transport and the engine's snapshot transfers between hosts."""
