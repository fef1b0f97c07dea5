"""The official `openai` client against a running qwen36 server (run by tests/server.rs).

Usage: python openai_client.py BASE_URL TOOLS_URL
BASE_URL serves the bundled model; TOOLS_URL serves it with a scripted detokenizer whose reply
reasons, writes a line and calls `get_weather` twice (see SCRIPT in tests/server.rs). Both take
the API key "sesame". Exits non-zero on the first failed check.
"""

import json
import sys

import openai
from openai import OpenAI

base, tools_base = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base + "/v1", api_key="sesame", max_retries=0)
MODEL = client.models.list().data[0].id


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAILED: {what}")
    print(f"ok: {what}")


# A wrong key is refused with the client's own error type.
try:
    OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
    check(False, "a wrong API key is refused")
except openai.AuthenticationError:
    check(True, "a wrong API key is refused (AuthenticationError)")

# Completions: streamed text equals the whole text for the same seed.
args = dict(model=MODEL, prompt="def fibonacci(n):", max_tokens=16, temperature=0.8, seed=3)
whole = client.completions.create(**args)
streamed = "".join(
    c.choices[0].text for c in client.completions.create(stream=True, **args) if c.choices
)
check(streamed == whole.choices[0].text, "completions: streamed text equals the whole")
check(whole.usage.completion_tokens > 0, "completions: usage")
ids = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4, temperature=0,
                                logprobs=2)
check(len(ids.choices[0].logprobs.tokens) == ids.usage.completion_tokens,
      "completions: token-id prompt and logprobs")
two = client.completions.create(n=2, **args)
check([c.index for c in two.choices] == [0, 1], "completions: n = 2")
# lm-eval's batches: several prompts in one request, each answered as its own.
batch = client.completions.create(model=MODEL, prompt=["def f(x):", "import os"], max_tokens=4,
                                  temperature=0)
alone = client.completions.create(model=MODEL, prompt="import os", max_tokens=4, temperature=0)
check([c.index for c in batch.choices] == [0, 1] and batch.choices[1].text == alone.choices[0].text,
      "completions: a list of prompts")
# lm-eval's loglikelihood request: the prompt alone, echoed with its log-probabilities.
ll = client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=0, echo=True,
                               logprobs=1, temperature=0)
lps = ll.choices[0].logprobs
check(ll.choices[0].text == "def fibonacci(n):" and lps.token_logprobs[0] is None
      and len(lps.tokens) == ll.usage.prompt_tokens and all(x < 0 for x in lps.token_logprobs[1:]),
      "completions: echo with max_tokens 0 (loglikelihood)")

# Chat, thinking on and off: streamed content equals the whole, usage in the last chunk.
for thinking in (True, False):
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Write a loop."}],
                max_tokens=16, temperature=0.7, seed=5,
                extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
    whole = client.chat.completions.create(**args)
    text, reasoning, usage, roles = "", "", None, []
    for chunk in client.chat.completions.create(stream=True,
                                                stream_options={"include_usage": True}, **args):
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            if choice.delta.role:
                roles.append(choice.delta.role)
    msg = whole.choices[0].message
    check(text == (msg.content or ""), f"chat (thinking {thinking}): streamed text equals the whole")
    check(reasoning == (getattr(msg, "reasoning_content", None) or ""),
          f"chat (thinking {thinking}): streamed reasoning equals the whole")
    check(len(text) + len(reasoning) > 0, f"chat (thinking {thinking}): some output")
    check(usage is not None and usage.completion_tokens == whole.usage.completion_tokens,
          f"chat (thinking {thinking}): usage chunk")
    check(roles == ["assistant"], f"chat (thinking {thinking}): one role delta")

# Logprobs in chat.
lp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
content = lp.choices[0].logprobs.content
check(len(content) == lp.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content),
      "chat: logprobs with top_logprobs")

# Structured output and a forced tool call, as the client sends them.
schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}
so = client.chat.completions.create(
    model=MODEL, messages=[{"role": "user", "content": "Answer in JSON."}], max_tokens=40,
    temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
check(json.loads(so.choices[0].message.content)["answer"] in ("yes", "no"),
      "chat: response_format json_schema")
unit = {"type": "function", "function": {"name": "set_unit", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}}}
forced = client.chat.completions.create(
    model=MODEL, messages=[{"role": "user", "content": "Use Celsius."}], max_tokens=60,
    temperature=0, tools=[unit], tool_choice={"type": "function", "function": {"name": "set_unit"}},
    parallel_tool_calls=False,
    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
call = forced.choices[0].message.tool_calls[0].function
check(forced.choices[0].finish_reason == "tool_calls" and call.name == "set_unit"
      and json.loads(call.arguments)["unit"] in ("c", "f"), "chat: a forced tool call")

# Bad input: the client's error type with the server's message.
try:
    client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])
    check(False, "an unknown role is refused")
except openai.BadRequestError as e:
    check("wizard" in str(e), "an unknown role is refused (BadRequestError)")
try:
    client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    check(False, "an unknown model is refused")
except openai.NotFoundError:
    check(True, "an unknown model is refused (NotFoundError)")

# A tool call (scripted reply): reasoning, content, two calls, whole and streamed.
tools_client = OpenAI(base_url=tools_base + "/v1", api_key="sesame", max_retries=0)
tools = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "days": {"type": "integer"}},
                   "required": ["city"]}}}]
args = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Zürich?"}], tools=tools,
            max_tokens=64, temperature=0, stop=["<END>"], extra_body={"ignore_eos": True})
r = tools_client.chat.completions.create(**args)
msg = r.choices[0].message
check(r.choices[0].finish_reason == "tool_calls", "tools: finish_reason tool_calls")
check(getattr(msg, "reasoning_content", None) == "The user wants the weather.\n",
      "tools: reasoning_content")
check(msg.content == "Checking now.", "tools: content before the calls")
calls = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]
check(calls == [("get_weather", {"city": "Zürich", "days": 2}),
                ("get_weather", {"city": "San José", "days": 3})], "tools: two typed calls")

streamed_calls, reasoning, finish = {}, "", None
for chunk in tools_client.chat.completions.create(stream=True, **args):
    for choice in chunk.choices:
        reasoning += getattr(choice.delta, "reasoning_content", None) or ""
        for tc in choice.delta.tool_calls or []:
            call = streamed_calls.setdefault(tc.index, {"name": "", "arguments": ""})
            call["name"] += tc.function.name or ""
            call["arguments"] += tc.function.arguments or ""
        finish = choice.finish_reason or finish
check(reasoning == "The user wants the weather.\n", "tools (streamed): reasoning deltas")
check([(c["name"], json.loads(c["arguments"])) for _, c in sorted(streamed_calls.items())] == calls,
      "tools (streamed): the calls add up to the whole")
check(finish == "tool_calls", "tools (streamed): finish_reason")

print(f"openai {openai.__version__}: all checks passed")
