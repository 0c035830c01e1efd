"""Many concurrent streams, and clients that hang up mid-stream, against a tiny random model."""

import asyncio

import httpx

from polling import wait_until


def test_100_concurrent_streams_get_every_token(tiny):
    lengths = [8 + (i * 7) % 57 for i in range(100)]

    async def one(client, i: int, max_tokens: int):
        stream = await client.completions.create(
            model="random:tiny", prompt=[1 + i % 50, 7, 9, 11 + i], max_tokens=max_tokens, temperature=0.8, seed=i,
            logprobs=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        tokens, usage, finish = 0, None, None
        async for chunk in stream:
            if chunk.choices:
                tokens += len(chunk.choices[0].logprobs.tokens)
                finish = chunk.choices[0].finish_reason or finish
            else:
                usage = chunk.usage
        return tokens, usage.completion_tokens, finish

    async def run():
        client = tiny.async_client()
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i, n) for i, n in enumerate(lengths))), 240)
        finally:
            await client.close()

    results = asyncio.run(run())
    assert [r[0] for r in results] == lengths
    assert [r[1] for r in results] == lengths
    assert {r[2] for r in results} == {"length"}


def test_disconnected_clients_free_their_requests_and_blocks(tiny):
    aborted_before = tiny.metric("lockstep_requests_finished_total", reason="abort")
    num_clients = 20

    async def hang_up_after_first_chunk(http: httpx.AsyncClient, i: int) -> None:
        body = {"model": "random:tiny", "prompt": [3, 4, 5 + i], "max_tokens": 1000, "ignore_eos": True,
                "stream": True}
        async with http.stream("POST", f"{tiny.url}/v1/completions", json=body, headers=tiny.headers()) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    return  # leaving the block closes the connection mid-stream

    async def run():
        async with httpx.AsyncClient(timeout=60) as http:
            await asyncio.gather(*(hang_up_after_first_chunk(http, i) for i in range(num_clients)))

    asyncio.run(run())

    def drained():
        return all(tiny.metric(name) == 0 for name in
                   ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"))

    wait_until(drained, 30, what="no running requests and no KV blocks in use")
    aborted = tiny.metric("lockstep_requests_finished_total", reason="abort") - aborted_before
    assert aborted == num_clients  # they were cut off, not finished
