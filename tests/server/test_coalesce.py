"""A stream's reader that fell behind gets the deltas queued for it as one (EngineClient.generate): their tokens,
text and logprobs in order, the last one's finish, and an error queued behind them still raised after them. No
engine process: deltas are put straight into the request's queue, as the client's reader thread would."""
from __future__ import annotations

import asyncio

import pytest

from engine.config import EngineConfig
from engine.messages import Delta, RequestError
from engine.request import SamplingParams
from server.engine_client import EngineClient, EngineInternalError


def lp(token: int) -> tuple[float, list]:
    return (-0.5 * token, [(token, -0.5 * token)])


async def read_after_queueing(items: list) -> tuple[list[Delta], Exception | None]:
    """What a reader gets when `items` are all queued before it reads the request's stream."""
    client = EngineClient(EngineConfig())
    gen = client.generate("r", [1, 2], SamplingParams(max_tokens=8))
    reader = asyncio.ensure_future(anext(gen))
    await asyncio.sleep(0)  # generate() registers its queue, sends the request, and waits
    assert not reader.done()
    for item in items:
        client.streams["r"].put_nowait(item)
    got, error = [await reader], None
    try:
        async for delta in gen:
            got.append(delta)
    except Exception as e:  # noqa: BLE001 (the test looks at which)
        error = e
    return got, error


def test_queued_deltas_reach_a_late_reader_as_one():
    deltas = [Delta("r", [5], False, None, [lp(5)], num_prompt_tokens=2, text="a"),
              Delta("r", [6, 7], False, None, [lp(6), lp(7)], num_prompt_tokens=2, text="bc"),
              Delta("r", [8], True, "length", [lp(8)], num_prompt_tokens=2, queue_time=0.25, text="d")]
    got, error = asyncio.run(read_after_queueing(deltas))
    assert error is None and len(got) == 1
    (one,) = got
    assert one.new_token_ids == [5, 6, 7, 8] and one.text == "abcd"
    assert one.new_logprobs == [lp(5), lp(6), lp(7), lp(8)]
    assert one.finished and one.finish_reason == "length" and one.queue_time == 0.25 and one.num_prompt_tokens == 2


def test_an_error_queued_behind_deltas_follows_them():
    items = [Delta("r", [5], False, None, text="a"), Delta("r", [6], False, None, text="b"),
             RequestError("r", "boom", kind="internal")]
    got, error = asyncio.run(read_after_queueing(items))
    assert [d.new_token_ids for d in got] == [[5, 6]] and got[0].new_logprobs is None
    assert isinstance(error, EngineInternalError) and "boom" in str(error)


@pytest.mark.parametrize("num_queued", [1, 2])
def test_a_reader_that_keeps_up_gets_each_delta(num_queued):
    """One delta queued at each read: nothing to merge."""
    async def run():
        client = EngineClient(EngineConfig())
        gen = client.generate("r", [1], SamplingParams(max_tokens=8))
        reader = asyncio.ensure_future(anext(gen))
        await asyncio.sleep(0)
        got = []
        for i in range(num_queued):
            client.streams["r"].put_nowait(Delta("r", [i], i == num_queued - 1, "length" if i == num_queued - 1
                                                 else None))
            got.append(await reader)
            if i < num_queued - 1:
                reader = asyncio.ensure_future(anext(gen))
                await asyncio.sleep(0)
        return got

    assert [d.new_token_ids for d in asyncio.run(run())] == [[i] for i in range(num_queued)]


def test_a_delta_crosses_the_process_boundary_whole():
    """Deltas pickle by position (Delta.__reduce__): every field survives, defaults and set values alike."""
    import dataclasses
    import pickle

    full = Delta("r-0", [5, 6], True, "stop", new_logprobs=[lp(5), lp(6)], num_prompt_tokens=7, num_cached_tokens=3,
                 queue_time=0.25, accept_lengths=[2, 1], text="ab", stop_reason="</s>")
    assert {f.name for f in dataclasses.fields(Delta)} == {k for k, v in vars(full).items() if v}  # all set
    for delta in (full, Delta("r-1", [9], False, None)):
        assert pickle.loads(pickle.dumps(delta, protocol=pickle.HIGHEST_PROTOCOL)) == delta
