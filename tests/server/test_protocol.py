"""server/requests.py, responses.py and errors.py: request validation (OpenAI/vLLM behaviour), the error
envelope, sampling kwargs, and response shapes checked against the official openai SDK's own models."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from server.errors import ErrorResponse, ProtocolError, error_response, model_not_found
from server.requests import ChatCompletionRequest, CompletionRequest, MAX_N, MAX_STOP_STRINGS
from server.tokenize_requests import DetokenizeRequest, TokenizeRequest
from server.responses import (ChatCompletion, ChatCompletionChoice, ChatCompletionChunk, ChatCompletionDelta,
                              ChatCompletionMessage, ChatCompletionStreamChoice, ChatCompletionTokenLogprob,
                              ChoiceLogprobs, Completion, CompletionChoice, CompletionLogprobs, LOGPROB_FLOOR,
                              ModelCard, ModelList, SSE_DONE, TopLogprob, Usage, finite_logprob, sse_event)

MSGS = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return ChatCompletionRequest.model_validate({"messages": MSGS, **fields})


def envelope(cls, body) -> dict:
    """Validate `body`, expect failure, return the serialised OpenAI envelope."""
    with pytest.raises(ValidationError) as info:
        cls.model_validate(body) if not isinstance(body, str) else cls.model_validate_json(body)
    resp = error_response(info.value)
    assert resp.status_code == 400
    return json.loads(resp.model_dump_json())["error"]


def chat_error(**fields) -> dict:
    return envelope(ChatCompletionRequest, {"messages": MSGS, **fields})


# ------------------------------------------------------------------------------------- chat requests

def test_minimal_chat_and_default_sampling_kwargs():
    req = chat(model="m")
    assert req.model == "m" and req.n == 1 and not req.stream and not req.include_usage
    assert req.to_sampling_kwargs() == {
        "n": 1, "max_tokens": None, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None,
        "stop": [], "stop_token_ids": [], "ignore_eos": False, "min_tokens": 0, "presence_penalty": 0.0,
        "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": {}, "logprobs": None, "grammar": None}


def test_sampling_kwargs_carry_every_honoured_field():
    req = chat(max_completion_tokens=7, temperature=0, top_p=0.5, top_k=-1, min_p=0.1, seed=3, stop="END",
               stop_token_ids=[5], n=2, presence_penalty=1, frequency_penalty=-1.5, repetition_penalty=1.2,
               logit_bias={"17": -100, "3": 2.5}, ignore_eos=True, logprobs=True, top_logprobs=4, user="u")
    kw = req.to_sampling_kwargs()
    assert kw["max_tokens"] == 7 and kw["temperature"] == 0.0 and kw["top_p"] == 0.5 and kw["top_k"] == 0
    assert kw["min_p"] == 0.1 and kw["seed"] == 3 and kw["stop"] == ["END"] and kw["stop_token_ids"] == [5]
    assert kw["n"] == 2 and kw["presence_penalty"] == 1.0 and kw["frequency_penalty"] == -1.5
    assert kw["repetition_penalty"] == 1.2 and kw["ignore_eos"] and kw["logprobs"] == 4
    assert kw["logit_bias"] == {17: -100.0, 3: 2.5}
    assert all(type(k) is int for k in kw["logit_bias"])
    assert chat(logprobs=True).to_sampling_kwargs()["logprobs"] == 0  # sampled token only
    assert chat(max_tokens=9).to_sampling_kwargs()["max_tokens"] == 9


def test_defaults_fill_only_what_the_client_left_out():
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}
    kw = chat(temperature=0.2).to_sampling_kwargs(defaults)
    assert (kw["temperature"], kw["top_p"], kw["top_k"], kw["repetition_penalty"]) == (0.2, 0.9, 20, 1.1)


def test_null_means_not_given():
    req = chat(n=None, stream=None, temperature=None, stop=None, logit_bias=None, tools=None, user=None)
    assert req.n == 1 and req.stop == [] and req.to_sampling_kwargs()["temperature"] == 1.0


def test_stream_options():
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage
    err = chat_error(stream_options={"include_usage": True})
    assert err["param"] == "stream_options" and "stream" in err["message"]
    assert chat_error(stream=True, stream_options={"include_usage": "yes"})["param"] == "stream_options.include_usage"


def test_logprob_rules():
    err = chat_error(top_logprobs=2)
    assert err["param"] == "top_logprobs" and "logprobs" in err["message"]
    assert chat_error(logprobs=True, top_logprobs=21)["param"] == "top_logprobs"
    assert chat_error(logprobs=True, top_logprobs=2.5)["code"] == "invalid_type"
    assert chat_error(logprobs=3)["param"] == "logprobs"  # chat logprobs is a boolean


RANGE_CASES = [  # (field, bad value) -> error names the field
    ("n", 0), ("n", MAX_N + 1), ("temperature", -0.1), ("temperature", 2.5), ("top_p", 0), ("top_p", 1.5),
    ("max_tokens", 0), ("max_completion_tokens", 0), ("min_p", 2), ("presence_penalty", 3),
    ("frequency_penalty", -3), ("repetition_penalty", 0), ("top_k", -2), ("seed", 2 ** 64),
    ("stop_token_ids", [-1]), ("stop", [""]), ("stop", ["s"] * (MAX_STOP_STRINGS + 1)), ("min_tokens", -1),
]
TYPE_CASES = [("n", "2"), ("n", 1.5), ("stream", "true"), ("stream", 1), ("temperature", "0.5"),
              ("temperature", True), ("max_tokens", "10"), ("stop", 5), ("seed", 1.0), ("user", 3),
              ("logit_bias", [1]), ("ignore_eos", "no"), ("messages", "hello"), ("model", 7)]


def test_out_of_range_values_are_named():
    for field, value in RANGE_CASES:
        err = chat_error(**{field: value})
        assert err["param"].split("[")[0] == field, (field, value, err)
        assert err["type"] == "invalid_request_error" and err["message"]


def test_wrong_types_are_named():
    for field, value in TYPE_CASES:
        err = chat_error(**{field: value})
        assert err["param"].split("[")[0] == field, (field, value, err)
        assert err["code"] in ("invalid_type", "invalid_value"), err


def test_max_tokens_and_max_completion_tokens():
    assert chat(max_tokens=5, max_completion_tokens=5).to_sampling_kwargs()["max_tokens"] == 5
    assert chat_error(max_tokens=5, max_completion_tokens=6)["param"] == "max_completion_tokens"
    assert chat_error(max_tokens=5, min_tokens=6)["param"] == "min_tokens"


def test_logit_bias_keys_must_be_token_ids():
    for key in ("hello", "-1", "1.5", " 3"):
        err = chat_error(logit_bias={key: 1})
        assert err["param"] == "logit_bias" and repr(key) in err["message"], err
    assert chat_error(logit_bias={"3": 101})["param"] == "logit_bias.3"
    assert ChatCompletionRequest.model_validate({"messages": MSGS, "logit_bias": {5: 1}}).logit_bias == {"5": 1}


def test_messages_validation():
    assert chat_error(messages=[])["param"] == "messages"
    err = chat_error(messages=[{"role": "robot", "content": "x"}])
    assert err["param"] == "messages[0].role" and "'robot'" in err["message"]
    err = chat_error(messages=[{"role": "user", "content": "a"}, {"role": "tool", "content": "x"}])
    assert err["param"] == "messages[1].tool_call_id" and "tool" in err["message"]
    err = chat_error(messages=[{"role": "function", "content": "x"}])
    assert err["param"] == "messages[0].role" and "'tool'" in err["message"]
    err = chat_error(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                            {"type": "image_url", "image_url": {"url": "x"}}]}])
    assert err["param"] == "messages[0].content[1].type" and "image_url" in err["message"]
    assert chat_error(messages=[{"role": "user", "content": None}])["param"] == "messages[0].content"
    assert chat_error(messages=[{"role": "user", "content": [{"type": "text"}]}])["param"] == \
        "messages[0].content[0].text"
    assert chat_error(messages=[{"content": "x"}])["code"] == "missing_required_parameter"
    err = chat_error(messages=[{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}])
    assert err["param"] == "messages[0].tool_calls[0].function", err
    assert chat_error(messages=[{"role": "assistant", "content": None}])["param"] == "messages[0].content"
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    req = chat(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c1", "content": "2"}])
    assert [m.to_template_dict() for m in req.messages][1:] == [
        {"role": "assistant", "content": "", "tool_calls": [{**call, "function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "2", "tool_call_id": "c1"}]
    assert chat_error(messages=["hi"])["param"] == "messages[0]"


def test_message_content_forms_and_template_dicts():
    req = chat(messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "x"},
        {"role": "assistant", "content": "ok", "refusal": None, "tool_calls": None, "annotations": []},
    ])
    assert [m.to_template_dict() for m in req.messages] == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb", "name": "x"},
        {"role": "assistant", "content": "ok"}]


UNSUPPORTED_CHAT = {"functions": [{"name": "f"}], "function_call": "auto", "audio": {"voice": "x"},
                    "modalities": ["text", "audio"],
                    "prediction": {"type": "content", "content": "x"}, "guided_json": {}, "use_beam_search": True,
                    "best_of": 2, "echo": True, "prompt_logprobs": 1, "reasoning_effort": "low"}
NEUTRAL_CHAT = {"tool_choice": "none", "response_format": {"type": "text"}, "modalities": ["text"], "echo": False,
                "use_beam_search": False, "store": False}


def test_unsupported_fields_are_rejected_by_name():
    for field, value in UNSUPPORTED_CHAT.items():
        err = chat_error(**{field: value})
        assert err["param"] == field and err["code"] == "unsupported_parameter", (field, err)
        assert f"'{field}'" in err["message"]
    req = chat(**NEUTRAL_CHAT)
    assert req.ignored_fields() == []


def test_unknown_fields_are_accepted_and_listed():
    req = chat(my_extension=1, another={"a": 1})
    assert req.ignored_fields() == ["another", "my_extension"]


def test_error_envelope_shapes():
    err = envelope(ChatCompletionRequest, "{not json")
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_json"
    assert envelope(ChatCompletionRequest, [1, 2])["message"] == "Request body must be a JSON object."
    err = envelope(ChatCompletionRequest, {})
    assert err == {"message": "Missing required parameter: 'messages'.", "type": "invalid_request_error",
                   "param": "messages", "code": "missing_required_parameter"}
    err = chat_error(n=0, temperature=9)  # several errors: first one's param, all in the message
    assert err["param"] == "temperature" and "'n'" in err["message"]
    plain = error_response(ValueError("bad thing"))
    assert plain.status_code == 400 and plain.error.message == "bad thing"
    nf = model_not_found("gpt-9")
    assert nf.status_code == 404 and nf.error.param == "model" and "`gpt-9`" in nf.error.message
    assert "status_code" not in nf.model_dump()
    assert ErrorResponse.make("busy", 429).error.type == "rate_limit_error"
    assert error_response(ProtocolError("x", loc=("prompt", 2), status_code=413)).error.param == "prompt[2]"


def test_fastapi_request_validation_error_becomes_400_envelope():
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from fastapi.testclient import TestClient

    app = FastAPI()

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request, exc):
        resp = error_response(exc)
        return JSONResponse(resp.model_dump(), status_code=resp.status_code)

    @app.post("/v1/chat/completions")
    async def _chat(req: ChatCompletionRequest):
        return {"n": req.n}

    client = TestClient(app)
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "tools": [{}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("tools[0]"), r.json()
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "n": 99})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = client.post("/v1/chat/completions", content=b"{oops", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert client.post("/v1/chat/completions", json={"messages": MSGS, "n": 2}).json() == {"n": 2}


# -------------------------------------------------------------------------------- completion requests

def completion(**fields):
    return CompletionRequest.model_validate({"prompt": "x", **fields})


def completion_error(**fields) -> dict:
    return envelope(CompletionRequest, {"prompt": "x", **fields})


def test_prompt_forms():
    assert completion(prompt="a").prompts() == ["a"]
    assert completion(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert completion(prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert completion(prompt=[[1], [2, 0]]).prompts() == [[1], [2, 0]]
    for bad, param in [("", "prompt"), ([], "prompt"), ([1, "a"], "prompt"), ([1, -2], "prompt[1]"),
                       ([[1], []], "prompt[1]"), ([True, 1], "prompt"), ([[1, "a"]], "prompt[0]"), (5, "prompt"),
                       (["a", ""], "prompt[1]"), ([1.0], "prompt")]:
        err = completion_error(prompt=bad)
        assert err["param"] == param, (bad, err)


def test_completion_fields():
    req = completion()
    assert req.to_sampling_kwargs()["max_tokens"] == 16  # the legacy endpoint's default
    assert completion(logprobs=3).to_sampling_kwargs()["logprobs"] == 3
    assert completion_error(logprobs=True)["code"] == "invalid_type"
    assert completion_error(logprobs=21)["param"] == "logprobs"
    assert completion_error(echo=True, logprobs=1)["param"] == "echo"
    assert completion(echo=True).echo
    assert completion(best_of=2, n=2).n == 2  # best_of == n changes nothing
    assert completion(response_format={"type": "json_object"}).grammar()  # structured output on this endpoint too
    for field, value in [("suffix", "x"), ("best_of", 3), ("guided_regex", "a+"), ("use_beam_search", True)]:
        err = completion_error(**{field: value})
        assert err["param"] == field and err["code"] == "unsupported_parameter", (field, err)


def test_check_token_ids_against_vocabulary():
    completion(prompt=[1, 99], stop_token_ids=[5], logit_bias={"7": 1}).check_token_ids(100)
    cases = [(dict(prompt=[1, 100]), "prompt[1]"), (dict(prompt=[[1], [100]]), "prompt[1]"),
             (dict(stop_token_ids=[1, 100]), "stop_token_ids[1]"), (dict(logit_bias={"100": 1}), "logit_bias")]
    for fields, param in cases:
        with pytest.raises(ProtocolError) as info:
            completion(**fields).check_token_ids(100)
        assert error_response(info.value).error.param == param
    with pytest.raises(ProtocolError):
        DetokenizeRequest(tokens=[1, 100]).check_token_ids(100)


def test_tokenize_requests():
    assert TokenizeRequest.model_validate({"prompt": "hi"}).use_special_tokens
    assert not TokenizeRequest.model_validate({"messages": MSGS}).use_special_tokens
    assert envelope(TokenizeRequest, {"prompt": "a", "messages": MSGS})["param"] == "prompt"
    assert envelope(TokenizeRequest, {})["param"] == "prompt"
    assert envelope(DetokenizeRequest, {"tokens": [1, -1]})["param"] == "tokens[1]"
    assert DetokenizeRequest.model_validate({"tokens": [3, 4]}).tokens == [3, 4]


# -------------------------------------------------------------------------------------------- responses

def test_stream_chunks_follow_openai_framing():
    from openai.types.chat import ChatCompletionChunk as SdkChunk

    base = dict(id="chatcmpl-1", created=1, model="m")
    role = ChatCompletionChunk(**base, choices=[ChatCompletionStreamChoice(
        index=0, delta=ChatCompletionDelta(role="assistant", content=""))])
    content = ChatCompletionChunk(**base, choices=[ChatCompletionStreamChoice(
        index=0, delta=ChatCompletionDelta(content="Hel"))])
    finish = ChatCompletionChunk(**base, choices=[ChatCompletionStreamChoice(index=0, finish_reason="stop",
                                                                                 stop_reason="END")])
    usage = ChatCompletionChunk(**base, usage=Usage.of(3, 4))
    dumped = [json.loads(c.model_dump_json()) for c in (role, content, finish, usage)]
    assert dumped[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert dumped[1]["choices"][0]["delta"] == {"content": "Hel"}
    assert dumped[2]["choices"][0]["delta"] == {} and dumped[2]["choices"][0]["finish_reason"] == "stop"
    assert dumped[3]["choices"] == [] and dumped[3]["usage"]["total_tokens"] == 7
    assert dumped[1]["choices"][0]["finish_reason"] is None and "logprobs" in dumped[1]["choices"][0]
    for d in dumped:
        SdkChunk.model_validate(d)
    event = sse_event(content)
    assert event.startswith("data: {") and event.endswith("}\n\n") and "\n" not in event[:-2]
    assert SSE_DONE == "data: [DONE]\n\n"


def test_full_responses_parse_with_the_openai_sdk():
    from openai.types import Completion as SdkCompletion
    from openai.types import Model as SdkModel
    from openai.types.chat import ChatCompletion as SdkChat

    lp = ChatCompletionTokenLogprob(token="Hi", logprob=-0.5, bytes=[72, 105],
                                      top_logprobs=[TopLogprob(token="Hi", logprob=-0.5, bytes=[72, 105])])
    chat_resp = ChatCompletion(model="m", usage=Usage.of(5, 1, cached_tokens=2), choices=[
        ChatCompletionChoice(index=0, message=ChatCompletionMessage(content="Hi"), finish_reason="length",
                               logprobs=ChoiceLogprobs(content=[lp]))])
    sdk = SdkChat.model_validate(json.loads(chat_resp.model_dump_json()))
    assert sdk.id.startswith("chatcmpl-") and sdk.choices[0].logprobs.content[0].bytes == [72, 105]
    assert sdk.usage.prompt_tokens_details.cached_tokens == 2
    comp = Completion(model="m", usage=Usage.of(1, 2), choices=[CompletionChoice(
        index=0, text="ab", finish_reason="stop", logprobs=CompletionLogprobs(
            tokens=["a", "b"], token_logprobs=[-1.0, -2.0], top_logprobs=[{"a": -1.0}, {"b": -2.0}],
            text_offset=[0, 1]))])
    sdk_comp = SdkCompletion.model_validate(json.loads(comp.model_dump_json()))
    assert sdk_comp.object == "text_completion" and sdk_comp.choices[0].logprobs.text_offset == [0, 1]
    card = ModelCard(id="m", max_model_len=4096, speculative_config={"method": "ddtree", "budget": 32})
    assert SdkModel.model_validate(ModelList(data=[card]).model_dump()["data"][0]).id == "m"
    assert finite_logprob(float("-inf")) == LOGPROB_FLOOR
