"""`/v1/responses` through the official openai client against real SmolLM2 servers at N=8 and N=1.

The Responses API is the chat path spelled differently, so greedy text must equal the chat
endpoint's for the same conversation; streams must carry the same text in typed, numbered events;
nothing is stored, so continuing or fetching a response is refused.
"""

import json

import httpx
import jsonschema
import openai
import pytest

QUESTION = "What is the capital of France?"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                          "population": {"type": "integer", "minimum": 0}},
          "required": ["city", "population"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}
# Every streamed text response: these events in this order, deltas in between.
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta"]
CLOSING_EVENTS = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def _greedy(client, **kwargs):
    return client.responses.create(model="smollm2", temperature=0, **kwargs)


@pytest.mark.parametrize("server_name", ["smol8", "smol1"])
def test_greedy_answer_names_paris(server_name, request):
    response = _greedy(request.getfixturevalue(server_name).client(), input=QUESTION, max_output_tokens=30,
                       metadata={"run": "test"}, user="u1")
    assert "Paris" in response.output_text
    assert response.id.startswith("resp_") and response.object == "response" and response.status == "completed"
    assert response.incomplete_details is None and response.metadata == {"run": "test"} and response.user == "u1"
    assert response.model_extra["store"] is False and response.previous_response_id is None
    [message] = response.output
    assert message.type == "message" and message.id.startswith("msg_") and message.role == "assistant"
    assert message.status == "completed"
    [part] = message.content
    assert part.type == "output_text" and part.annotations == [] and part.text == response.output_text
    usage = response.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 30
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0 and usage.output_tokens_details.reasoning_tokens == 0


def test_message_items_and_instructions_render_as_the_chat_conversation(smol8):
    client = smol8.client()
    response = _greedy(client, instructions="Answer in one word.", max_output_tokens=12, input=[
        {"role": "user", "content": "Name a colour."},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Name "}, {"type": "input_text", "text": "a fruit."}]},
    ])
    chat = client.chat.completions.create(model="smollm2", temperature=0, max_completion_tokens=12, messages=[
        {"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."}, {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a fruit."}])
    assert response.output_text == chat.choices[0].message.content != ""
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens


@pytest.mark.parametrize("server_name", ["smol8", "smol1"])
def test_streamed_events_carry_the_non_streamed_text(server_name, request):
    client = request.getfixturevalue(server_name).client()
    whole = _greedy(client, input=QUESTION, max_output_tokens=30)
    events = list(_greedy(client, input=QUESTION, max_output_tokens=30, stream=True))
    kinds = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert kinds[:5] == TEXT_EVENTS and kinds[-4:] == CLOSING_EVENTS + ["response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and len(kinds) > 9  # more than one delta
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    message_id = events[2].item.id
    assert all(d.item_id == message_id and d.output_index == 0 and d.content_index == 0 for d in deltas)
    text = "".join(d.delta for d in deltas)
    assert text == whole.output_text == events[-4].text == events[-2].item.content[0].text
    final = events[-1].response
    assert final.id == events[0].response.id and final.status == "completed" and final.output_text == text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stream_helper_assembles_the_final_response(smol8):
    client = smol8.client()
    with client.responses.stream(model="smollm2", input=QUESTION, temperature=0, max_output_tokens=30) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == "".join(deltas) == _greedy(client, input=QUESTION, max_output_tokens=30).output_text


@pytest.mark.parametrize("server_name", ["smol8", "smol1"])
def test_max_output_tokens_makes_the_response_incomplete(server_name, request):
    client = request.getfixturevalue(server_name).client()
    response = _greedy(client, input=QUESTION, max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.usage.output_tokens == 3
    events = list(_greedy(client, input=QUESTION, max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete"  # OpenAI's closing event for an incomplete response
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == response.output_text


@pytest.mark.parametrize("server_name", ["smol8", "smol1"])
def test_json_schema_format_gives_matching_json(server_name, request):
    client = request.getfixturevalue(server_name).client()
    fmt = {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}
    response = client.responses.create(model="smollm2", input="Name a city and its population.", temperature=0.8,
                                       max_output_tokens=60, text={"format": fmt})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), SCHEMA)
    assert response.text.format.type == "json_schema" and response.text.format.name == "city"
    streamed = list(client.responses.create(model="smollm2", input="Name a city and its population.", stream=True,
                                            temperature=0, max_output_tokens=60, text={"format": fmt}))
    jsonschema.validate(json.loads(streamed[-1].response.output_text), SCHEMA)
    as_object = client.responses.create(model="smollm2", input="Describe Paris as JSON.", temperature=0,
                                        max_output_tokens=60, text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(as_object.output_text), dict)


def test_named_function_tool_is_called_with_valid_arguments(smol8):
    client = smol8.client()
    choice = {"type": "function", "name": "get_weather"}
    response = _greedy(client, input="What is the weather in Paris?", tools=[WEATHER], tool_choice=choice)
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert response.tool_choice.name == "get_weather" and response.tools[0].name == "get_weather"
    events = list(_greedy(client, input="What is the weather in Paris?", tools=[WEATHER], tool_choice=choice,
                          stream=True))
    done = next(event for event in events if event.type == "response.function_call_arguments.done")
    assert done.arguments == call.arguments and events[-1].response.output[0].arguments == call.arguments


def test_a_function_call_output_in_the_input_reaches_the_prompt(smol8):
    client = smol8.client()
    question = {"role": "user", "content": "What is the weather in Paris?"}
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    result = {"type": "function_call_output", "call_id": "call_1", "output": "sunny and 24 degrees all afternoon"}
    alone = _greedy(client, max_output_tokens=1, input=[question, call])
    answered = _greedy(client, max_output_tokens=1, input=[question, call, result])
    # The tool result is rendered by the chat template as a turn of its own.
    assert answered.usage.input_tokens >= alone.usage.input_tokens + 8


def test_nothing_is_stored(smol8):
    client = smol8.client()
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model="smollm2", input="Hi", previous_response_id="resp_123")
    assert error.value.body["param"] == "previous_response_id" and "not store" in error.value.body["message"]
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.retrieve("resp_123")
    assert "resp_123" in missing.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.delete("resp_123")


@pytest.mark.parametrize("fields,param", [
    ({"input": 123}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "Hi"}]}, "input.0.role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input.0.content.0"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Hi", "max_output_tokens": 100000}, "max_output_tokens"),
    ({"input": "Hi", "temperature": "hot"}, "temperature"),
    ({"input": "Hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "text.format.schema"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools.0"),
    ({"input": "Hi", "tools": [WEATHER]}, "tool_choice"),  # auto needs --enable-auto-tool-choice
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice"),
    ({"input": "Hi", "background": True}, "background"),
    ({"input": "Hi", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "Hi", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
])
def test_bad_requests_are_400s_naming_the_field(smol8, fields, param):
    with pytest.raises(openai.BadRequestError) as error:
        smol8.client().responses.create(model="smollm2", **fields)
    body = error.value.body
    assert body["param"] == param, body
    # The chat path's own message for "auto" says "tool choice"; every other one names the field.
    assert param in body["message"] or param == "tool_choice", body


def test_missing_input_is_a_400(smol8):
    response = httpx.post(f"{smol8.url}/v1/responses", json={"model": "smollm2"}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "input"
