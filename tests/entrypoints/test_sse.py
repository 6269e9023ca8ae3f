"""The pre-rendered stream chunks (entrypoints/openai/sse.py) are byte for byte what the pydantic models give."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from pagedserve.entrypoints.openai.protocol import (ChatCompletionStreamChoice, ChatCompletionStreamResponse,
                                                    CompletionStreamChoice, CompletionStreamResponse, DeltaMessage)
from pagedserve.entrypoints.openai.sse import StreamChunkEncoder

# any text a detokenizer can give (no lone surrogates: pydantic and json both refuse those)
texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)
finishes = st.sampled_from([None, "stop", "length", "tool_calls"])
stop_reasons = st.one_of(st.none(), st.integers(0, 200_000), texts)
ids = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(rid=ids, model=ids, created=st.integers(0, 2**40), index=st.integers(0, 64), text=texts, finish=finishes,
       stop=stop_reasons)
def test_completion_chunk_matches_the_model(rid, model, created, index, text, finish, stop):
    want = CompletionStreamResponse(id=rid, created=created, model=model, choices=[CompletionStreamChoice(
        index=index, text=text, finish_reason=finish, stop_reason=stop)]).model_dump_json()
    got = StreamChunkEncoder("text_completion", rid, created, model).completion(index, text, finish, stop)
    assert got == f"data: {want}\n\n"


@settings(max_examples=200, deadline=None)
@given(rid=ids, model=ids, created=st.integers(0, 2**40), index=st.integers(0, 64),
       content=st.one_of(st.none(), texts), finish=finishes, stop=stop_reasons)
def test_chat_chunk_matches_the_model(rid, model, created, index, content, finish, stop):
    want = ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[ChatCompletionStreamChoice(
        index=index, delta=DeltaMessage(content=content), finish_reason=finish, stop_reason=stop)]).model_dump_json()
    got = StreamChunkEncoder("chat.completion.chunk", rid, created, model).chat(index, content, finish, stop)
    assert got == f"data: {want}\n\n"


@pytest.mark.parametrize("text", ['quote " backslash \\ newline \n tab \t', "\x00\x1f\x7f", "é 😀 \u2028"])
def test_escapes(text):
    want = CompletionStreamResponse(id="c", created=1, model="m", choices=[CompletionStreamChoice(
        index=0, text=text)]).model_dump_json()
    assert StreamChunkEncoder("text_completion", "c", 1, "m").completion(0, text, None, None) == f"data: {want}\n\n"
