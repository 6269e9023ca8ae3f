"""A streamed response's chunks written from the engine's per-step delivery callback (RequestStream.push_to,
direct_write.ChunkPush): what reaches the client is what the response's task would have written (in order, the final
chunk, usage and [DONE] after the pushed ones), several streams in one step each get theirs, a client gone mid-stream
aborts its request, a slow reader gets the merged outputs through the task. RequestStream's side first, without HTTP;
then a real uvicorn around the fake engine (test_direct_write's harness)."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest

from pagedserve.engine.request_stream import RequestStream
from pagedserve.entrypoints.openai import direct_write
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import RequestOutputKind
from tests.entrypoints.test_direct_write import (check_client_gone_mid_stream_aborts_its_request, post, read_all,
                                                 uvicorn_server)


def output(text: str, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", None, [1], [CompletionOutput(index=0, text=text, token_ids=[ord(text[0])],
                                                          finish_reason="length" if finished else None)], finished)


# ------------------------------------------------------------------------------------------ RequestStream
def test_parked_consumer_gets_only_the_final_output_and_the_sink_the_rest_in_order():
    async def run():
        stream = RequestStream("r", asyncio.get_running_loop(), RequestOutputKind.DELTA)
        pushed: list[str] = []
        stream.push_to(lambda out: pushed.append(out.outputs[0].text) is None)
        consumer = asyncio.ensure_future(stream.get())
        await asyncio.sleep(0)  # the consumer parks in get()
        for text in "abc":
            stream._put(output(text))
        assert not consumer.done()  # not woken per token
        stream._put(output("d", finished=True))
        final = await consumer
        return pushed, final

    pushed, final = asyncio.run(run())
    assert pushed == ["a", "b", "c"]
    assert final.finished and final.outputs[0].text == "d"


def test_outputs_queue_behind_a_busy_consumer_or_a_declining_sink_and_merge_in_order():
    async def run():
        stream = RequestStream("r", asyncio.get_running_loop(), RequestOutputKind.DELTA)
        accept = {"now": False}
        pushed: list[str] = []

        def sink(out):
            if accept["now"]:
                pushed.append(out.outputs[0].text)
            return accept["now"]

        stream.push_to(sink)
        stream._put(output("a"))  # nobody parked yet: queued
        stream._put(output("b"))
        assert (await stream.get()).outputs[0].text == "ab"
        consumer = asyncio.ensure_future(stream.get())
        await asyncio.sleep(0)
        stream._put(output("c"))  # parked, but the sink declines (a full socket buffer): queued, consumer woken
        accept["now"] = True
        stream._put(output("d"))  # something is pending: behind it, not around it
        assert (await consumer).outputs[0].text == "cd"
        consumer = asyncio.ensure_future(stream.get())
        await asyncio.sleep(0)
        stream._put(output("e"))
        stream._put(output("f", finished=True))
        return pushed, await consumer

    pushed, final = asyncio.run(run())
    assert pushed == ["e"]
    assert final.outputs[0].text == "f" and final.finished


def test_a_failing_sink_fails_the_stream():
    async def run():
        stream = RequestStream("r", asyncio.get_running_loop(), RequestOutputKind.DELTA)

        def sink(out):
            raise RuntimeError("render broke")

        stream.push_to(sink)
        consumer = asyncio.ensure_future(stream.get())
        await asyncio.sleep(0)
        stream._put(output("a"))
        with pytest.raises(RuntimeError, match="render broke"):
            await consumer
        assert stream.closed

    asyncio.run(run())


# ------------------------------------------------------------------------------------------ through uvicorn
def count_pushes(monkeypatch) -> list[int]:
    """How many outputs each attached stream's sink wrote (one entry per streamed response)."""
    counts: list[int] = []
    original = direct_write.ChunkPush.attach

    def attach(self, stream, render):
        counts.append(0)
        slot = len(counts) - 1

        def counting(out):
            counts[slot] += 1
            return render(out)

        original(self, stream, counting)

    monkeypatch.setattr(direct_write.ChunkPush, "attach", attach)
    return counts


def sse_events(raw: bytes) -> list[str]:
    body = raw.split(b"\r\n\r\n", 1)[1].decode()
    return [line[6:].rstrip("\n") for line in body.split("\r\n") if line.startswith("data: ")]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 8, "stream": True,
                         "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True,
                              "stream_options": {"include_usage": True}}),
])
def test_pushed_stream_is_complete_and_in_order(monkeypatch, path, body):
    pushes = count_pushes(monkeypatch)
    with uvicorn_server(step_sleep=0.01) as (_, port):
        raw = read_all(post(port, body, path=path))
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 8 and chunks[-1]["choices"] == []
    choices = [c["choices"][0] for c in chunks[:-1]]
    if path == "/v1/chat/completions":
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        choices = choices[1:]
        texts = [c["delta"].get("content") or "" for c in choices]
    else:
        texts = [c["text"] for c in choices]
    assert "".join(texts) == "fghijklm"  # the fake engine's tokens 5, 6, ... in order, none lost or repeated
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]
    assert pushes and pushes[0] >= 1  # the non-final tokens went out from the delivery callback


def test_several_streams_in_one_step_each_get_their_chunks(monkeypatch):
    pushes = count_pushes(monkeypatch)
    results: dict[int, bytes] = {}
    with uvicorn_server(step_sleep=0.02) as (engine, port):
        def one(i: int) -> None:
            results[i] = read_all(post(port, {"prompt": "hi", "max_tokens": 6 + i, "stream": True}))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    for i in range(4):
        events = sse_events(results[i])
        chunks = [json.loads(e) for e in events[:-1]]
        assert events[-1] == "[DONE]"
        assert "".join(c["choices"][0]["text"] for c in chunks) == "fghijklmnopqrs"[:6 + i]
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
        assert len({c["id"] for c in chunks}) == 1
    assert len(pushes) == 4 and sum(pushes) > 0


def test_client_gone_mid_push_aborts_its_request(monkeypatch):
    pushes = count_pushes(monkeypatch)
    check_client_gone_mid_stream_aborts_its_request(events_before_close=4)
    assert pushes[0] >= 1
