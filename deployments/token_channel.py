"""One message per engine step per ingress: the token channel between engine replicas and an ingress replica.

Through Serve alone, every streamed chunk of every request is its own Ray streaming item: at 32 streams on two
replicas that is 16 items per engine step per replica, each pickled, reported to the caller's core worker and
resumed on the ingress's loop. With the channel, a request still goes through Serve (its routing, back-pressure,
cancellation and failure reports are unchanged), and its Serve stream carries what is not a chunk: a refusal or a
failure (the ingress waits for the first message of either kind before it answers, so one that comes first is
still an HTTP error before any byte is sent) and, when the request ends, a `ChannelEnd` with the number of messages
the channel carried for it, so the ingress knows it has them all. Every chunk, the first included, travels over
one TCP connection per (engine replica, ingress replica) pair, and all the chunks an engine replica produced in
one turn of its event loop (one engine step) for that ingress go in one framed message. (The first chunk went
through Serve until a lone request's timeline showed that hop taking 1.4-11.8 ms, a median of 4.6, between the
replica's yield and the ingress's read, where the channel's message takes well under one.)

The ingress replica listens on Ray's node address (127.0.0.1 for a local app) on a port the OS picks; an engine
replica that cannot reach it, or whose connection breaks, falls back to Serve's stream for new requests. A
connection must open with the ingress's random token before anything is read from it.
"""
from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import os
import pickle
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

TOKEN_BYTES = 32
HANDSHAKE_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 2.0
MAX_FRAME_BYTES = 64 << 20
# An ingress that stops reading: past this many bytes waiting to be written the link is dropped.
MAX_UNSENT_BYTES = 64 << 20
# After the Serve stream said how many messages the channel carried, the rest must arrive within this.
LATE_MESSAGES_TIMEOUT_S = 30.0
RETRY_UNREACHABLE_S = 30.0  # an engine replica asks an unreachable ingress again after this long
_HEADER = struct.Struct("!I")


@dataclass(frozen=True)
class ChannelAddress:
    host: str
    port: int
    token: bytes


@dataclass
class ChannelEnd:
    """The last item of a request's Serve stream when its later chunks went over the channel."""

    num_messages: int


class ChannelBroken(ConnectionError):
    pass


# ---- the ingress side ----

class ChannelServer:
    """Listens for engine replicas and hands each message to the stream registered under its key."""

    def __init__(self, host: str, on_message: Callable[[int], None] | None = None) -> None:
        """`on_message(number of chunks)` is called for every message read (the ingress counts them)."""
        self.host = host
        self._on_message = on_message
        self.token = os.urandom(TOKEN_BYTES)
        self._streams: dict[int, ChannelledStream] = {}
        self._keys = itertools.count(1)
        self._server: asyncio.base_events.Server | None = None
        self.address: ChannelAddress | None = None
        self.num_messages = 0  # frames read: one per engine step per connected engine replica

    async def start(self) -> ChannelAddress:
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = ChannelAddress(self.host, port, self.token)
        log.info("token channel listening on %s:%d", self.host, port)
        return self.address

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def register(self, stream: ChannelledStream) -> int:
        key = next(self._keys)
        self._streams[key] = stream
        return key

    def unregister(self, key: int) -> None:
        self._streams.pop(key, None)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:
            token = await asyncio.wait_for(reader.readexactly(TOKEN_BYTES), HANDSHAKE_TIMEOUT_S)
            if not hmac.compare_digest(token, self.token):
                log.warning("token channel: %s sent a wrong token; closed", peer)
                return
            while True:
                (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
                if size > MAX_FRAME_BYTES:
                    log.warning("token channel: %s sent a %d-byte message; closed", peer, size)
                    return
                self.num_messages += 1
                items = pickle.loads(await reader.readexactly(size))
                for key, item in items:
                    stream = self._streams.get(key)
                    if stream is not None:  # else its request has ended: nobody waits for it
                        stream.arrived(item)
                if self._on_message is not None:
                    self._on_message(len(items))
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
            pass
        except Exception:
            log.exception("token channel: reading from %s failed", peer)
        finally:
            writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


class ChannelledStream:
    """A request's messages, from its Serve stream and the channel, in order; the interface of Serve's response
    generator (`__anext__`, `cancel`), so the caller reads one stream either way. It leaves the server's registry
    once it has every message, or is cancelled."""

    def __init__(self, server: ChannelServer, send: Callable[[ChannelAddress, int], Any]) -> None:
        """`send(address, key)` makes the Serve call (a DeploymentResponseGenerator)."""
        self._server = server
        self._queue: asyncio.Queue = asyncio.Queue()
        self._arrived = 0
        self._expected: int | None = None  # channel messages, once the Serve stream has said
        self._serve_ended = False
        self._key = server.register(self)
        try:
            self._responses = send(server.address, self._key)
        except BaseException:
            server.unregister(self._key)
            raise
        self._reader: asyncio.Task | None = None  # reads the Serve stream into the queue, from the first __anext__

    def __aiter__(self) -> ChannelledStream:
        return self

    def arrived(self, item: Any) -> None:
        self._arrived += 1
        self._queue.put_nowait(("channel", item))
        self._release_if_complete()

    def _release_if_complete(self) -> None:
        if self._serve_ended and (self._expected is None or self._arrived >= self._expected):
            self._server.unregister(self._key)
            self._queue.put_nowait(("end", None))

    async def __anext__(self) -> Any:
        if self._reader is None:  # whichever comes first: a chunk over the channel, or Serve's refusal or failure
            self._reader = asyncio.create_task(self._read_serve_stream())
        while True:
            try:
                if self._serve_ended:
                    source, item = await asyncio.wait_for(self._queue.get(), LATE_MESSAGES_TIMEOUT_S)
                else:
                    source, item = await self._queue.get()
            except asyncio.TimeoutError:
                self._server.unregister(self._key)
                raise ChannelBroken(f"{self._expected - self._arrived} of the request's messages never came over "
                                    f"the token channel") from None
            if source == "end":
                raise StopAsyncIteration
            if isinstance(item, BaseException):
                raise item
            return item  # from the channel, or from Serve where the replica could not use the channel

    async def _read_serve_stream(self) -> None:
        try:
            async for item in self._responses:
                if isinstance(item, ChannelEnd):
                    self._expected = item.num_messages
                else:
                    self._queue.put_nowait(("serve", item))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the reader, which raises it as Serve's own stream would have
            self._queue.put_nowait(("serve", exc))
        self._serve_ended = True
        self._release_if_complete()

    def cancel(self) -> None:
        self._server.unregister(self._key)
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
        self._responses.cancel()


# ---- the engine side ----

class _Link:
    """One engine replica's connection to one ingress replica; what is sent in one loop turn goes in one frame."""

    def __init__(self, address: ChannelAddress) -> None:
        self.address = address
        self._writer: asyncio.StreamWriter | None = None
        self._pending: list[tuple[int, Any]] = []
        self._flush_scheduled = False
        self._watcher: asyncio.Task | None = None
        self.broken = False

    async def connect(self) -> None:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(self.address.host, self.address.port), CONNECT_TIMEOUT_S)
        writer.write(self.address.token)
        self._writer = writer
        self._watcher = asyncio.get_running_loop().create_task(self._watch(reader))  # held: the loop only weakly

    async def _watch(self, reader: asyncio.StreamReader) -> None:
        """The ingress never writes: end of file or an error here means the connection is gone."""
        try:
            await reader.read()
        except Exception:
            pass
        self.broken = True

    def send(self, key: int, item: Any) -> None:
        if self.broken or self._writer is None or self._writer.is_closing():
            self.broken = True
            raise ChannelBroken(f"the token channel to {self.address.host}:{self.address.port} is closed")
        self._pending.append((key, item))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        pending, self._pending = self._pending, []
        if self.broken or self._writer is None:
            return
        try:
            frame = pickle.dumps(pending, protocol=pickle.HIGHEST_PROTOCOL)
            self._writer.write(_HEADER.pack(len(frame)) + frame)
            if self._writer.transport.get_write_buffer_size() > MAX_UNSENT_BYTES:
                raise ChannelBroken("the ingress stopped reading the token channel")
        except Exception as exc:
            log.warning("token channel to %s:%d broke: %r", self.address.host, self.address.port, exc)
            self.broken = True
            self._writer.close()

    def close(self) -> None:
        self.broken = True
        if self._writer is not None:
            self._writer.close()


def coalescing_interval(interval_s: float, min_streams: int, active_streams: int) -> float:
    """The wait after a chunk: `interval_s` while more than `min_streams` requests stream (0: always), else none."""
    return interval_s if active_streams > min_streams else 0.0


async def relay(batches: AsyncIterator[Any], link: _Link | None, key: int, lost: Callable[[], Any],
                interval_s: float | Callable[[], float] = 0.0,
                is_last: Callable[[Any], bool] = lambda batch: False) -> AsyncIterator[Any]:
    """An engine replica's side of one request: each batch goes over `link` under `key`, and what must go through
    the request's Serve stream comes out: every batch where there is no link or it broke before the first was sent
    (nothing is lost then), `lost()` and the end where it broke later (what it carried may be lost), and a
    `ChannelEnd` with the number of messages it carried. At most one batch every `interval_s` (a callable: read
    after each batch, so the wait can follow the replica's load), on ticks every stream shares; no wait after the
    batch `is_last` says ends the request (nothing follows it but the end)."""
    sent = 0
    async for batch in batches:
        if link is not None:
            try:
                link.send(key, batch)
                sent += 1
            except ChannelBroken as exc:
                log.warning("token channel, stream %d, message %d: %s", key, sent + 1, exc)
                if sent:
                    yield lost()
                    return
                link = None
        if link is None:
            yield batch
        last = is_last(batch)  # read every batch: it may count what each one carries
        wait = interval_s() if callable(interval_s) else interval_s
        if wait and not last:
            # To the interval's next tick on the loop's clock, which every stream of the replica shares: their
            # chunks leave in one turn of the loop, one message per ingress, rather than one each at its own time.
            await asyncio.sleep(wait - asyncio.get_running_loop().time() % wait)
    if sent:
        yield ChannelEnd(sent)


class ChannelLinks:
    """An engine replica's links to the ingress replicas that send it requests, opened on first use."""

    def __init__(self) -> None:
        self._links: dict[tuple[str, int], _Link] = {}
        self._connecting: dict[tuple[str, int], asyncio.Future] = {}
        self._unreachable: dict[tuple[str, int], float] = {}

    async def link(self, address: ChannelAddress) -> _Link | None:
        """The open link to `address`, or None where it cannot be reached (the caller uses Serve's stream)."""
        key = (address.host, address.port)
        link = self._links.get(key)
        if link is not None and not link.broken:
            return link
        loop = asyncio.get_running_loop()
        if loop.time() < self._unreachable.get(key, float("-inf")):
            return None
        pending = self._connecting.get(key)
        if pending is None:
            pending = self._connecting[key] = loop.create_task(self._connect(address))
        try:
            return await asyncio.shield(pending)
        finally:
            if pending.done():
                self._connecting.pop(key, None)

    async def _connect(self, address: ChannelAddress) -> _Link | None:
        key = (address.host, address.port)
        link = _Link(address)
        try:
            await link.connect()
        except Exception as exc:
            log.warning("token channel: cannot reach the ingress at %s:%d (%r); its requests stream through "
                        "Serve", address.host, address.port, exc)
            self._unreachable[key] = asyncio.get_running_loop().time() + RETRY_UNREACHABLE_S
            return None
        old = self._links.pop(key, None)
        if old is not None:
            old.close()
        self._links[key] = link
        return link

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()
