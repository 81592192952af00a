"""A slow link between two loopback ranks: a TCP proxy that forwards each chunk after a delay.

Loopback collectives cost microseconds; a LAN's cost a round trip and the network stack. To
see what a cost per collective does to a step design here (no netem on this machine), a
rank reaches its peer through this proxy (its hostfile names the proxy's port for the peer):
every chunk waits ``delay`` seconds, and the proxy's own work (a Python process on the same
cores) adds about a millisecond per all-reduce on the 2-core VM, so it models a slow link,
not a particular one.

    python bench/_delayed_link.py LISTEN_PORT TARGET_PORT DELAY_SECONDS
"""

from __future__ import annotations

import asyncio
import socket
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def send() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                writer.close()
                return
            await asyncio.sleep(max(0.0, due - loop.time()))
            writer.write(data)
            await writer.drain()

    sender = asyncio.create_task(send())
    try:
        while data := await reader.read(1 << 20):
            queue.put_nowait((loop.time() + delay, data))
    finally:
        queue.put_nowait((0.0, b""))
        await sender


async def _serve(listen: int, target: int, delay: float) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(1200):  # the peer may not listen yet: MLX's ring connects early
            try:
                peer_reader, peer_writer = await asyncio.open_connection("127.0.0.1", target)
                break
            except OSError:
                await asyncio.sleep(0.05)
        else:
            writer.close()
            return
        for stream in (writer, peer_writer):
            stream.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(_pipe(reader, peer_writer, delay), _pipe(peer_reader, writer, delay))

    server = await asyncio.start_server(handle, "127.0.0.1", listen)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(_serve(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])))
