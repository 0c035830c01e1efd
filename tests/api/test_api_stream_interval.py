"""`--stream-interval N` (vLLM's flag): a streamed request's first token goes out at once, later ones in
chunks of N tokens (or its end), and the text, the finish and the usage are those of the same request
unstreamed. A real `lockstep serve` on the random tiny model, the official `openai` client."""

from __future__ import annotations

import pytest

from api_harness import Server

INTERVAL = 4


@pytest.fixture(scope="module")
def server():
    server = Server("random:tiny", "--stream-interval", str(INTERVAL), "--num-gpu-blocks-override", "256",
                    "--max-model-len", "512", "--skip-warmup")
    try:
        yield server.wait_healthy()
    finally:
        server.stop()


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 17, 40])
def test_chunks_hold_up_to_interval_tokens_and_the_text_is_the_unstreamed_text(server, max_tokens):
    client = server.client()
    prompt = [5, 17, 300, 42, 7]
    whole = client.completions.create(model="random:tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                      extra_body={"ignore_eos": True})
    stream = client.completions.create(model="random:tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True, stream_options={"include_usage": True}, logprobs=0,
                                       extra_body={"ignore_eos": True})
    texts, tokens_per_chunk, finish, usage = [], [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            count = len(choice.logprobs.tokens) if choice.logprobs and choice.logprobs.tokens else 0
            if count:
                tokens_per_chunk.append(count)
                texts.append(choice.text)
            finish = choice.finish_reason or finish
    assert "".join(texts) == whole.choices[0].text
    assert sum(tokens_per_chunk) == max_tokens
    assert finish == whole.choices[0].finish_reason == "length"
    assert usage.completion_tokens == max_tokens and usage.prompt_tokens == len(prompt)
    # The first token wakes the stream at once, later ones every INTERVAL tokens (test_wake_ups_follow_the_interval
    # below). The loop reads what the core sent since its last turn in one go, so a wake-up may find a few steps'
    # tokens, the first's too: chunks hold what was there, never more than an interval's worth beyond it.
    assert tokens_per_chunk[0] <= INTERVAL
    assert len(tokens_per_chunk) <= 1 + -(-(max_tokens - 1) // INTERVAL)
    if max_tokens > 1 + INTERVAL:
        assert max(tokens_per_chunk[1:]) >= INTERVAL  # chunks were joined, not one per token


def test_samples_of_one_request_all_finish_with_their_text(server):
    client = server.client()
    prompt = [9, 8, 7, 6]
    stream = client.completions.create(model="random:tiny", prompt=prompt, max_tokens=11, n=3, temperature=1.0,
                                       seed=5, stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    finishes, usage = {}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert usage.completion_tokens == 33


def test_wake_ups_follow_the_interval():
    """Which outputs wake a stream (`EngineCoreClient._announce`): the first token, then every INTERVAL-th,
    then the end or a stop string, whatever arrives between them."""
    from lockstep_engine.api.client import EngineCoreClient, Generation

    client = EngineCoreClient(config=None, stream_interval=INTERVAL)

    class State:
        finished = False

    state = State()
    generation = Generation(["r"], [state])
    woke = [client._announce(generation, stopping=False) for _ in range(9)]
    assert woke == [True, False, False, False, True, False, False, False, True]
    assert client._announce(generation, stopping=True)  # a stop string found: its text goes out now
    generation.unannounced = 0
    state.finished = True
    assert client._announce(generation, stopping=False)  # the end, whatever the count
    every = EngineCoreClient(config=None, stream_interval=1)
    assert all(every._announce(Generation(["s"], [State()]), stopping=False) for _ in range(3))
