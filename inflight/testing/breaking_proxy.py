"""A TCP relay in front of a real server that breaks the first generation request's connection after
forwarding it, before any byte of the answer comes back: the failure a client sees when a server
closes a pooled keep-alive connection just as a request goes out on it."""

from __future__ import annotations

import asyncio


class BreakingProxy:
    """Relays TCP to a real server, except that the first request to `path` (the token route) is
    forwarded and then both connections are closed before any answer comes back."""

    def __init__(self, upstream_port: int, path: str) -> None:
        self.upstream_port, self.path, self.generations, self.broken = upstream_port, path, 0, 0
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        back = asyncio.create_task(self._pipe(up_reader, writer))
        try:
            while data := await reader.read(65536):
                up_writer.write(data)
                await up_writer.drain()
                if f"POST {self.path} ".encode() in data:
                    self.generations += 1
                    if self.generations == 1:
                        self.broken += 1
                        back.cancel()  # no byte of the answer reaches the client
                        await asyncio.sleep(0.05)  # the server has the request and starts it
                        break
        finally:
            back.cancel()
            for w in (writer, up_writer):
                w.close()

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
