"""Background streams for tests that send urgent work into a batch already decoding."""

from __future__ import annotations

import asyncio


class Background:
    """`count` streams of background work over one client; `started` is set once every one
    of them has produced `tokens` tokens, so that a request sent after it finds them all
    running."""

    def __init__(self, client, count: int, tokens: int = 5):
        self.client = client
        self.tokens = tokens
        self.started = asyncio.Event()
        self._counts = [0] * count

    async def stream(self, i: int, prompt: str, **params) -> list[int]:
        """Stream background request `i` to its end; its token ids."""
        ids = []
        async for chunk in self.client.stream(prompt, **params):
            if chunk.token_id is not None:
                ids.append(chunk.token_id)
                self._counts[i] += 1
                if min(self._counts) >= self.tokens:
                    self.started.set()
        return ids
