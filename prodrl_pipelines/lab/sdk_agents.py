"""Agent SDK episodes, unpatched, against an OpenAI-compatible base URL (a recorder's or a server's).

One function per SDK runs one multi-turn tool episode with a single Python ``add(a, b)`` tool: each
question of ``questions`` is a user turn the SDK answers through its own loop (model call, tool,
model call, ...), the history carried over from one question to the next as the SDK keeps it. The
episode is grouped by a constant ``X-Trajectory-Id`` in the SDK client's default headers (the
recorder's trajectory key; no SDK is patched). Each returns the ``Episode``: the arguments the SDK
executed the tool with, the bodies its HTTP client sent (seen through an httpx event hook, ordinary
client configuration), how many model calls it made and its text answers.

* ``openai_agents``: openai-agents in its chat-completions mode (reasoning not echoed back unless
  ``replay_reasoning``), or its default Responses mode (``responses=True``, streamed with
  ``Runner.run_streamed``);
* ``pydantic_ai``: pydantic-ai's ``OpenAIChatModel`` (echoes the call's reasoning as ``reasoning``);
* ``langgraph``: a LangGraph ReAct agent over langchain-openai's ``ChatOpenAI``, streamed;
* ``anthropic_messages``: the official ``anthropic`` client's tool-use loop on the Messages API
  (streamed or not), and ``pydantic_ai_anthropic``: pydantic-ai's ``AnthropicModel`` over it.

The SDKs (and ``openai``) are the ``test`` extra's: imported inside the functions only. What
tests/test_agent_sdks.py checks on these episodes, and bench/agent_traffic.py measures.
"""

from __future__ import annotations

import asyncio
import json
import os

__all__ = ["QUESTIONS", "SDKS", "SEED", "TEMPERATURE", "Episode", "anthropic_messages", "langgraph", "openai_agents",
           "pydantic_ai", "pydantic_ai_anthropic"]

QUESTIONS = ("5+3", "then -2")  # two user turns: each an add call, its result, a text answer
# recordable sampling (not greedy: temperature 0 is not recorded), seeded, so an episode is the same run to run
TEMPERATURE, SEED = 0.5, 7


def _quiet_sdks() -> None:
    os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")  # no trace export to api.openai.com
    os.environ["LANGSMITH_TRACING"] = "false"


class Episode:
    """One SDK run: the Python behind its ``add`` tool (what the SDK executed), the bodies its client
    sent (``(path after /v1, body)``), how many model calls it made and its text answers."""

    def __init__(self, tid: str) -> None:
        self.tid = tid
        self.executed: list[dict] = []
        self.sent: list[tuple[str, dict]] = []
        self.n_calls = 0
        self.answers: list[str] = []
        self.headers = {"X-Trajectory-Id": tid}

    def add(self, a: int, b: int) -> int:
        self.executed.append({"a": a, "b": b})
        return a + b

    def _seen(self, request) -> None:
        if request.method == "POST":
            self.sent.append((request.url.path.rsplit("/v1", 1)[-1], json.loads(request.content)))

    async def _aseen(self, request) -> None:
        self._seen(request)

    def async_http(self):
        import openai

        return openai.DefaultAsyncHttpxClient(event_hooks={"request": [self._aseen]})

    def sync_http(self):
        import openai

        return openai.DefaultHttpxClient(event_hooks={"request": [self._seen]})


def openai_agents(base_url: str, tid: str, *, api_key: str, model: str, responses: bool = False,
                  replay_reasoning: bool = False, questions=QUESTIONS, temperature: float = TEMPERATURE,
                  seed: int = SEED, max_turns: int = 10) -> Episode:
    """openai-agents: chat completions (``Runner.run``), or its default Responses API streamed."""
    _quiet_sdks()
    import openai
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool

    ep = Episode(tid)

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return ep.add(a, b)

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, default_headers=ep.headers,
                                    http_client=ep.async_http())
        try:
            if responses:
                llm = OpenAIResponsesModel(model, openai_client=client)
            else:  # the SDK echoes reasoning only to DeepSeek models unless told to
                llm = OpenAIChatCompletionsModel(model, openai_client=client, should_replay_reasoning_content=(
                    (lambda ctx: True) if replay_reasoning else None))
            agent = Agent(name="calc", model=llm, tools=[add],
                          model_settings=ModelSettings(temperature=temperature, extra_body={"seed": seed}))
            items: list = []
            for q in questions:
                items = items + [{"role": "user", "content": q}]
                if responses:  # streamed
                    result = Runner.run_streamed(agent, items, max_turns=max_turns)
                    async for _ in result.stream_events():
                        pass
                else:
                    result = await Runner.run(agent, items, max_turns=max_turns)
                ep.n_calls += len(result.raw_responses)
                ep.answers.append(str(result.final_output).strip())
                items = result.to_input_list()
        finally:
            await client.close()

    asyncio.run(run())
    return ep


def _pydantic_ai_episode(ep: Episode, connect, model_settings: dict, questions) -> Episode:
    """pydantic-ai's agent loop (``agent.run``, not streamed), the history carried as ``all_messages``;
    ``connect()`` -> (the pydantic-ai model, its SDK client), called inside the episode's event loop."""
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelResponse

    async def run() -> None:
        model, client = connect()
        try:
            agent = Agent(model, model_settings=model_settings)

            @agent.tool_plain
            def add(a: int, b: int) -> int:
                """Add two integers."""
                return ep.add(a, b)

            history = None
            for q in questions:
                result = await agent.run(q, message_history=history)
                ep.answers.append(str(result.output).strip())
                history = result.all_messages()
                ep.n_calls = sum(isinstance(m, ModelResponse) for m in history)
        finally:
            await client.close()

    asyncio.run(run())
    return ep


def pydantic_ai(base_url: str, tid: str, *, api_key: str, model: str, questions=QUESTIONS,
                temperature: float = TEMPERATURE, seed: int = SEED) -> Episode:
    """pydantic-ai's ``OpenAIChatModel``."""
    _quiet_sdks()
    import openai
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    ep = Episode(tid)

    def connect():
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, default_headers=ep.headers,
                                    http_client=ep.async_http())
        return OpenAIChatModel(model, provider=OpenAIProvider(openai_client=client)), client

    return _pydantic_ai_episode(ep, connect, {"temperature": temperature, "seed": seed}, questions)


def langgraph(base_url: str, tid: str, *, api_key: str, model: str, questions=QUESTIONS,
              temperature: float = TEMPERATURE, seed: int = SEED) -> Episode:
    """A LangGraph ReAct agent over langchain-openai, streamed token by token (``stream_mode`` messages)."""
    _quiet_sdks()
    from langchain_core.messages import AIMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    ep = Episode(tid)

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return ep.add(a, b)

    llm = ChatOpenAI(model=model, base_url=base_url, api_key=api_key, default_headers=ep.headers,
                     temperature=temperature, seed=seed, http_client=ep.sync_http())
    agent = create_react_agent(llm, [add])
    messages: list = []
    for q in questions:  # streamed, as a LangGraph app shows its agent's progress
        for mode, chunk in agent.stream({"messages": messages + [("user", q)]}, stream_mode=["messages", "values"]):
            if mode == "values":
                messages = chunk["messages"]
                ep.n_calls = sum(isinstance(m, AIMessage) for m in messages)
        ep.answers.append(str(messages[-1].content).strip())
    return ep


ADD_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
MAX_TOKENS = 64  # the Messages API requires it: the turns are shorter, and the lab policies have 256 positions


def anthropic_messages(base_url: str, tid: str, *, api_key: str, model: str, questions=QUESTIONS,
                       temperature: float = TEMPERATURE, seed: int = SEED, max_turns: int = 10,
                       stream: bool = False) -> Episode:
    """The official ``anthropic`` client and the tool-use loop of Anthropic's docs: a call; while it
    answers with ``tool_use`` blocks, its whole content goes back as the assistant turn (thinking
    included) and the tools' results as a user turn of ``tool_result`` blocks. ``stream``: each call
    through ``messages.stream`` (as Claude Code streams). The base URL is the recorder's root (the
    client adds ``/v1/messages``); sampling fields go as extra body, as this client version sends them."""
    import anthropic

    ep = Episode(tid)
    client = anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key, default_headers=ep.headers,
                                 max_retries=0, http_client=anthropic.DefaultHttpxClient(event_hooks={"request": [ep._seen]}))
    tools = [{"name": "add", "description": "Add two integers.", "input_schema": ADD_SCHEMA}]
    messages: list[dict] = []
    try:
        for q in questions:
            messages.append({"role": "user", "content": q})
            for _ in range(max_turns):
                kw = dict(model=model, max_tokens=MAX_TOKENS, tools=tools, messages=messages,
                          extra_body={"temperature": temperature, "seed": seed})
                if stream:
                    with client.messages.stream(**kw) as s:
                        msg = s.get_final_message()
                else:
                    msg = client.messages.create(**kw)
                ep.n_calls += 1
                messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]})
                uses = [b for b in msg.content if b.type == "tool_use"]
                if not uses:
                    ep.answers.append("".join(b.text for b in msg.content if b.type == "text").strip())
                    break
                messages.append({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": b.id, "content": str(ep.add(**b.input))} for b in uses]})
    finally:
        client.close()
    return ep


def pydantic_ai_anthropic(base_url: str, tid: str, *, api_key: str, model: str, questions=QUESTIONS,
                          temperature: float = TEMPERATURE, seed: int = SEED) -> Episode:
    """pydantic-ai's ``AnthropicModel`` over the official ``anthropic`` client: an agent framework built
    on Anthropic's SDK."""
    _quiet_sdks()
    import anthropic
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.providers.anthropic import AnthropicProvider

    ep = Episode(tid)

    def connect():
        client = anthropic.AsyncAnthropic(
            base_url=base_url.removesuffix("/v1"), api_key=api_key, default_headers=ep.headers, max_retries=0,
            http_client=anthropic.DefaultAsyncHttpxClient(event_hooks={"request": [ep._aseen]}))
        return AnthropicModel(model, provider=AnthropicProvider(anthropic_client=client)), client

    return _pydantic_ai_episode(ep, connect, {"temperature": temperature, "max_tokens": MAX_TOKENS,
                                              "extra_body": {"seed": seed}}, questions)


# name -> episode function (base_url, tid, *, api_key, model, ...) -> Episode
SDKS = {
    "openai-agents-chat": openai_agents,
    "openai-agents-chat-replay": lambda url, tid, **kw: openai_agents(url, tid, replay_reasoning=True, **kw),
    "openai-agents-responses": lambda url, tid, **kw: openai_agents(url, tid, responses=True, **kw),
    "pydantic-ai": pydantic_ai,
    "langgraph": langgraph,
    "anthropic": anthropic_messages,
    "anthropic-stream": lambda url, tid, **kw: anthropic_messages(url, tid, stream=True, **kw),
    "pydantic-ai-anthropic": pydantic_ai_anthropic,
}
