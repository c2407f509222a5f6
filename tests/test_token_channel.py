"""The token channel: an engine replica's chunks for one ingress, one message per loop turn, in order."""
from __future__ import annotations

import asyncio

import pytest

from deployments.token_channel import (ChannelAddress, ChannelBroken, ChannelEnd, ChannelLinks, ChannelServer,
                                       ChannelledStream, coalescing_interval, relay)


class FakeServeStream:
    """What Serve's DeploymentResponseGenerator gives the ingress: items, then the end (or an error)."""

    def __init__(self) -> None:
        self.items: asyncio.Queue = asyncio.Queue()
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.items.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


def run_with_channel(test) -> None:
    """Runs `await test(server, links)` with an ingress's channel server started and an engine replica's links,
    and closes both after."""
    async def main():
        server = ChannelServer("127.0.0.1")
        await server.start()
        links = ChannelLinks()
        try:
            await test(server, links)
        finally:
            links.close()
            await server.close()

    asyncio.run(main())


def open_stream(server: ChannelServer) -> tuple[ChannelledStream, FakeServeStream, int]:
    serve_stream, seen = FakeServeStream(), {}

    def send(address: ChannelAddress, key: int) -> FakeServeStream:
        seen["address"], seen["key"] = address, key
        return serve_stream

    stream = ChannelledStream(server, send)
    assert seen["address"] == server.address
    return stream, serve_stream, seen["key"]


async def past_the_first_item(server: ChannelServer) -> tuple[ChannelledStream, FakeServeStream, int]:
    """A stream whose first item, through Serve (a replica without the channel), has been read."""
    stream, serve_stream, key = open_stream(server)
    serve_stream.items.put_nowait("first")
    assert await stream.__anext__() == "first"
    return stream, serve_stream, key


async def read_all(stream: ChannelledStream) -> list:
    return [item async for item in stream]


def test_every_chunk_comes_over_the_channel_in_order_and_the_stream_then_ends():
    async def body(server, links):
        streams = [open_stream(server) for _ in range(3)]
        link = await links.link(server.address)
        assert link is not None
        readers = [asyncio.create_task(read_all(stream)) for stream, _, _ in streams]
        for step in range(5):  # one engine step: a chunk for each of the three requests, in one loop turn
            for _, _, key in streams:
                link.send(key, f"step {step}")
            await asyncio.sleep(0.01)
        for _, serve_stream, _ in streams:
            serve_stream.items.put_nowait(ChannelEnd(5))
            serve_stream.items.put_nowait(StopAsyncIteration())  # Serve's stream ends after the ChannelEnd
        results = await asyncio.wait_for(asyncio.gather(*readers), 5)
        assert results == [[f"step {i}" for i in range(5)]] * 3
        assert server.num_messages == 5  # three requests' chunks of a step in one message
        assert server.num_streams == 0

    run_with_channel(body)


def test_the_first_chunk_does_not_wait_for_serve_and_a_refusal_through_serve_comes_first():
    async def body(server, links):
        stream, serve_stream, key = open_stream(server)
        link = await links.link(server.address)
        link.send(key, "first token")
        # Serve's stream has said nothing yet (it speaks only at the end): the chunk is read all the same.
        assert await asyncio.wait_for(stream.__anext__(), 5) == "first token"
        assert not serve_stream.cancelled
        stream.cancel()

        refused, refused_serve, _ = open_stream(server)
        refused_serve.items.put_nowait("refused: the queue is full")
        refused_serve.items.put_nowait(StopAsyncIteration())
        assert await asyncio.wait_for(read_all(refused), 5) == ["refused: the queue is full"]
        assert server.num_streams == 0

    run_with_channel(body)


def test_the_serve_stream_may_say_it_is_done_before_the_channel_delivers():
    async def body(server, links):
        stream, serve_stream, key = await past_the_first_item(server)
        serve_stream.items.put_nowait(ChannelEnd(2))
        serve_stream.items.put_nowait(StopAsyncIteration())
        await asyncio.sleep(0.05)
        assert server.num_streams == 1  # two messages still owed
        reader = asyncio.create_task(read_all(stream))
        link = await links.link(server.address)
        link.send(key, "a")
        await asyncio.sleep(0.01)
        link.send(key, "b")
        assert await asyncio.wait_for(reader, 5) == ["a", "b"]
        assert server.num_streams == 0

    run_with_channel(body)


def test_without_the_channel_every_item_comes_through_serve():
    async def body(server, links):
        stream, serve_stream, _ = open_stream(server)
        for item in ("first", "second", StopAsyncIteration()):
            serve_stream.items.put_nowait(item)
        assert await asyncio.wait_for(read_all(stream), 5) == ["first", "second"]
        assert server.num_streams == 0

    run_with_channel(body)


def test_a_failed_serve_stream_is_raised_to_the_reader_and_cancel_cancels_it():
    async def body(server, links):
        stream, serve_stream, _ = await past_the_first_item(server)
        serve_stream.items.put_nowait(RuntimeError("replica died"))
        with pytest.raises(RuntimeError, match="replica died"):
            await asyncio.wait_for(stream.__anext__(), 5)
        other, other_serve, _ = open_stream(server)
        other.cancel()
        assert other_serve.cancelled and server.num_streams == 0

    run_with_channel(body)


def test_a_connection_without_the_token_is_closed_and_delivers_nothing():
    async def body(server, links):
        stream, serve_stream, key = open_stream(server)
        wrong = ChannelAddress(server.address.host, server.address.port, b"x" * len(server.token))
        link = await links.link(wrong)
        link.send(key, "forged")
        await asyncio.sleep(0.1)
        assert server.num_messages == 0 and stream._queue.empty()
        assert link.broken  # the ingress closed it
        with pytest.raises(ChannelBroken):
            link.send(key, "again")
        stream.cancel()

    run_with_channel(body)


def test_an_unreachable_ingress_means_no_link():
    async def body(server, links):
        address = server.address
        await server.close()
        assert await links.link(address) is None
        assert await links.link(address) is None  # remembered, not retried at once

    run_with_channel(body)


async def batches_of(items: list):
    for item in items:
        yield item


def test_relay_sends_every_batch_over_a_link_and_falls_back_to_serve_only_before_the_first():
    async def body(server, links):
        def lost():
            return "lost"

        # A working link: everything over the channel, the Serve stream carries only the count.
        stream, _, key = open_stream(server)
        link = await links.link(server.address)
        through_serve = [item async for item in relay(batches_of(["a", "b", "c"]), link, key, lost)]
        assert through_serve == [ChannelEnd(3)]
        reader = asyncio.create_task(stream.__anext__())
        assert await asyncio.wait_for(reader, 5) == "a"
        stream.cancel()
        # No link: everything through Serve, and no ChannelEnd.
        assert [item async for item in relay(batches_of(["a", "b"]), None, 0, lost)] == ["a", "b"]
        # A link that broke before the first batch: nothing was lost, so the stream goes through Serve whole.
        link.close()
        assert [item async for item in relay(batches_of(["a", "b"]), link, key, lost)] == ["a", "b"]
        # One that breaks after a batch went over it: that batch may be lost, so the stream ends as a failure.
        link = await links.link(server.address)
        assert link is not None and not link.broken

        async def breaking():
            yield "a"
            link.close()
            yield "b"
            yield "c"
        assert [item async for item in relay(breaking(), link, key, lost)] == ["lost"]

    run_with_channel(body)


def test_the_wait_between_chunks_follows_the_replicas_load(monkeypatch):
    assert coalescing_interval(0.05, 0, 1) == 0.05  # no floor: always
    assert coalescing_interval(0.05, 16, 16) == 0.0  # a few streams: a chunk a step
    assert coalescing_interval(0.05, 16, 17) == 0.05  # under load: fewer, larger chunks
    assert coalescing_interval(0.0, 0, 40) == 0.0

    async def body():
        asked, slept = [], []
        real_sleep = asyncio.sleep

        async def recorded_sleep(seconds):
            slept.append(seconds)
            await real_sleep(0)

        def interval():  # read after each batch: the load changes while a request streams
            asked.append(len(asked))
            return 0.02 if len(asked) == 2 else 0.0

        monkeypatch.setattr(asyncio, "sleep", recorded_sleep)
        out = [item async for item in relay(batches_of(["a", "b", "c"]), None, 0, lambda: "lost", interval)]
        monkeypatch.undo()
        assert out == ["a", "b", "c"] and asked == [0, 1, 2] and len(slept) == 1
        # to the next tick of the loop's clock, which every stream shares, so their chunks leave together
        assert 0 < slept[0] <= 0.02

    asyncio.run(body())


def test_no_wait_after_the_batch_that_ends_the_request(monkeypatch):
    async def body():
        slept = []
        real_sleep = asyncio.sleep

        async def recorded_sleep(seconds):
            slept.append(seconds)
            await real_sleep(0)

        monkeypatch.setattr(asyncio, "sleep", recorded_sleep)
        out = [item async for item in relay(batches_of(["a", "b", "end"]), None, 0, lambda: "lost", 0.02,
                                            lambda batch: batch == "end")]
        monkeypatch.undo()
        assert out == ["a", "b", "end"] and len(slept) == 2  # after "a" and "b"; the end leaves at once

    asyncio.run(body())


def test_a_requests_last_batch_is_the_one_in_which_its_last_choice_finished():
    from types import SimpleNamespace

    from deployments.engine_replica import _ends_after

    def chunk(finished: bool):
        return SimpleNamespace(output=SimpleNamespace(finished=finished))

    one = _ends_after(1)
    assert [one([chunk(False)]), one([chunk(True)])] == [False, True]
    two = _ends_after(2)  # n=2: one choice ends first, the request only when both have
    assert [two([chunk(False), chunk(False)]), two([chunk(True)]), two([chunk(False)]), two([chunk(True)])] == [
        False, False, False, True]
