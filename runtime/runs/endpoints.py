"""Where an OpenAI-compatible server's other endpoints are, and how a client signs in: one
copy of both for the clients kvdeck runs (load generator, probes, attach, questions)."""

from __future__ import annotations


def server_root(url: str) -> str:
    """The server's root from its base URL, with or without `/v1` (where `/metrics`,
    `/slots` and llama-server's `/props` live)."""
    return url.rstrip("/").removesuffix("/v1")


def bearer(api_key: str | None) -> dict[str, str]:
    """The request headers for `api_key` (none without one)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}
