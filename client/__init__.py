"""seqserve client library and CLI."""

from client.api import AsyncClient, Chunk, Client, Reply

__all__ = ["AsyncClient", "Chunk", "Client", "Reply"]
