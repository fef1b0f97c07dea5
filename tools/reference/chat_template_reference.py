"""Renders chat conversations with HF transformers' `apply_chat_template`, as fixtures for Rust.

Run from the repository root with a Python that has transformers (torch is not needed):

    /work/pyenv/bin/python tools/reference/chat_template_reference.py

It loads the tokenizer of models/qwen36-tiny, renders each case below with `tokenize=False`
(the bundled `chat_template`, or the case's own `template` for cases that probe the Jinja
environment itself, or its named templates in place of the tokenizer's) and writes crates/qwen36/tests/fixtures/chat_templates.json: a list of
{name, messages, tools, add_generation_prompt, kwargs, template?, rendered | error + error_type},
checked byte for byte by crates/qwen36/tests/chat_template.rs.
"""
import json
import os
import sys

from transformers import AutoTokenizer

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MODEL = os.path.join(ROOT, "models", "qwen36-tiny")
OUT = os.path.join(ROOT, "crates", "qwen36", "tests", "fixtures", "chat_templates.json")

# Two tools with nested parameter schemas and text that JSON and HTML escaping treat differently.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city, e.g. \"Zürich\" or 日本's capital; units < 100 & > -50.",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {
                        "type": "object",
                        "description": "Where: a city and its country",
                        "properties": {
                            "city": {"type": "string", "description": "City name, like 'café town'"},
                            "country": {"type": "string", "enum": ["FR", "JP", "CH"]},
                        },
                        "required": ["city"],
                    },
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["location"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_docs",
            "description": "Search <docs> & return the top hits",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "filters": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "field": {"type": "string"},
                                "values": {"type": "array", "items": {"type": "string"}},
                            },
                        },
                    },
                    "limit": {"type": "number", "description": "max hits (0.5 = half a page)"},
                    "exact": {"type": "boolean"},
                },
                "required": ["query"],
            },
        },
    },
]

SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in English."}

# An assistant turn calling both tools: arguments as a dict and as a JSON string.
TOOL_CALLS = [
    {
        "id": "call_1",
        "type": "function",
        "function": {
            "name": "get_weather",
            "arguments": {"location": {"city": "Café de Flore", "country": "FR"}, "unit": "celsius", "days": 2},
        },
    },
    {
        "id": "call_2",
        "type": "function",
        "function": {"name": "search_docs", "arguments": "{\"query\": \"日本 <rain> & \\\"wind\\\"\", \"limit\": 3}"},
    },
]

TOOL_ROUND_TRIP = [
    SYSTEM,
    {"role": "user", "content": "Weather at Café de Flore, and any docs on 日本 rain?"},
    {"role": "assistant", "content": None, "tool_calls": TOOL_CALLS},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 18.5, \"sky\": \"clear & calm\"}"},
    {"role": "tool", "tool_call_id": "call_2", "content": "1. <b>Rainy season</b> in 日本 (tsuyu)"},
    {"role": "assistant", "content": "It is 18.5 °C and clear; tsuyu is Japan's rainy season."},
]

# Environment probes: transformers' tojson and its other Jinja settings, on a value given as a kwarg.
TOJSON_VALUE = {
    "b": [1, 2.5, -0.0, 1e-07, 1e20, 0.1, 123456789012345678, True, False, None],
    "a": {"nested": {"deep": []}, "empty": {}, "s": "quote \" backslash \\ slash / tab \t nl \n"},
    "html": "<script>&'</script>",
    "unicode": "café 日本 😀 \u0001 \u007f",
}
TOJSON_TEMPLATE = (
    "{{ value | tojson }}\n"
    "{{ value | tojson(indent=2) }}\n"
    "{{ value | tojson(indent='\\t', sort_keys=true) }}\n"
    "{{ value | tojson(separators=(',', ':')) }}\n"
    "{{ value.unicode | tojson(ensure_ascii=true) }}\n"
    "{{ value.b | tojson(indent=0) }}\n"
    "{{ value.html | tojson }}{{ 'x' | tojson }}{{ 3 | tojson }}{{ none | tojson }}\n"
)
WHITESPACE_TEMPLATE = """{# a comment on its own line #}
<start>
    {% for m in messages %}
        {% if loop.first %}first {% endif %}{{ m.role }}: {{ m.content.strip() }}
        {% if m.content.startswith('stop') %}
            {% break %}
        {% endif %}
        {% if m.role == 'system' %}{% continue %}{% endif %}
    [{{ loop.index }}/{{ loop.length }}{% if loop.last %} last{% endif %}]
    {% endfor %}
  {%+ if true %}kept indent{% endif %}
{%- set ns = namespace(n=0) %}
{% for m in messages %}{% set ns.n = ns.n + m.content | length %}{% endfor %}
total={{ ns.n }} tools={{ tools is none }} docs={{ documents is none }} x={{ x is defined }}
{{ messages[0] is mapping }} {{ messages[0].content is string }} {{ messages | length }} {{ messages[::-1][0].role }}
{{ 'a,b,,c'.split(',') | join('|') }} {{ '  pad  '.lstrip() }}| {{ 'Title'.lower() }} {{ 'x'.upper() }} {{ 'abc'.endswith('c') }}
{{ true }} {{ false }} {{ none }} {{ 1.5 }} {{ 2 }} {{ 1e-07 }} {{ 1e20 }} {{ 0.1 + 0.2 }}
{% for k, v in messages[0].items() %}{{ k }}={{ v }};{% endfor %} {{ messages[0].get('missing', 'dflt') }}
{{ messages | selectattr('role', 'equalto', 'user') | list | length }} {{ messages | map(attribute='role') | join(',') }}
{{ eos_token }} {{ pad_token }} {{ bos_token is defined }}
end
"""
# Values printed as Python's str() and the Jinja tests HF templates rely on.
PYTHON_VALUES_TEMPLATE = (
    "{{ messages[0] }}\n"
    "{{ [1, 'a', true, none, 1.5, 1e-07, 1e20, ('t',), \"it's\", 'say \"hi\"', 'both \\'\"'] }}\n"
    "{{ messages[0].extra | string }}|{{ 1e-07 | string }}|{{ none | string }}|{{ 'x' ~ true ~ none ~ [1] }}\n"
    "{{ {} is sequence }} {{ 'x' is sequence }} {{ 'x' is iterable }} {{ 1 is iterable }} {{ 'x' is mapping }}"
    " {{ messages[0] is mapping }} {{ 1.5 is integer }} {{ none is none }} {{ messages[0].missing is none }}\n"
    "[{{ nope }}][{{ messages[0].nope }}] {{ messages[5] is defined }} {{ none.x is defined }}\n"
    "{% for k, v in messages[0].extra | dictsort %}{{ k }}{% endfor %} {% for k in messages[0].extra %}{{ k }}{% endfor %}"
    " {{ 'extra' in messages[0] }} {{ messages[0] | length }} {{ 7 // 2 }} {{ 7 / 2 }} {{ 2.5 | round }} {{ 10 / 5 }}\n"
    "{{ 'xxhixx'.strip('x') }} {{ '\\n\\nhi\\n'.lstrip('\\n') }}|{{ 'a b'.split() }} {{ 'x'.join(['1', '2']) }}\n"
    "{% for m in messages %}{{ loop.index0 }}{{ loop.revindex }}{{ loop.previtem is defined }}{{ loop.nextitem is defined }} {% endfor %}\n"
)
# transformers' `{% generation %}` block (assistant masks for training) renders its body as is,
# whitespace control on its tags included.
GENERATION_TEMPLATE = """{% for m in messages %}
{{ m.role }}:
{% if m.role == 'assistant' %}
    {%- generation -%}
 [{{ m.content }}] 
    {%- endgeneration %}
{% else %}
  {% generation %}{{ m.content }}{% endgeneration %}
{% endif %}
{% endfor %}"""
# Named templates (a tokenizer_config list, or additional_chat_templates/*.jinja): a request
# with tools renders `tool_use` where there is one, else `default`.
NAMED_TEMPLATES = {
    "default": "D:{% for m in messages %}{{ m.content }};{% endfor %}{{ tools | length if tools else 'none' }}",
    "tool_use": "T:{{ tools | length }}:{% for t in tools %}{{ t.function.name }},{% endfor %}{{ messages[-1].content }}",
    "rag": "R",
}
TOOL_USE_ONLY = {"tool_use": NAMED_TEMPLATES["tool_use"], "rag": "R"}
RAISE_TEMPLATE = "{{ 'before' }}{{ raise_exception('Bad \"input\": ' ~ messages[0].role) }}"


def case(name, messages, tools=None, add_generation_prompt=False, kwargs=None, template=None):
    return {
        "name": name,
        "messages": messages,
        "tools": tools,
        "add_generation_prompt": add_generation_prompt,
        "kwargs": kwargs or {},
        **({"template": template} if template is not None else {}),
    }


CASES = [
    case("user_generation_prompt", [{"role": "user", "content": "Hello!"}], None, True),
    case(
        "system_multi_turn",
        [
            SYSTEM,
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "6"},
        ],
    ),
    case(
        "system_multi_turn_generation_prompt",
        [SYSTEM, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "Why?"}],
        None,
        True,
    ),
    case("thinking_true", [SYSTEM, {"role": "user", "content": "Think hard."}], None, True, {"enable_thinking": True}),
    case("thinking_false", [{"role": "user", "content": "Be quick."}], None, True, {"enable_thinking": False}),
    case("thinking_false_no_prompt", [{"role": "user", "content": "Be quick."}], None, False, {"enable_thinking": False}),
    case(
        "raw_content_kept",
        [
            {"role": "system", "content": "  leading and trailing space  \n"},
            {"role": "user", "content": "<b>bold</b> & \"quotes\" 'single' café 日本\n\n"},
            {"role": "assistant", "content": "\n  <think>not parsed</think>\n"},
        ],
        None,
        True,
    ),
    case("tools_without_system", [{"role": "user", "content": "Weather in 日本?"}], TOOLS, True),
    case("tools_with_system", [SYSTEM, {"role": "user", "content": "Weather in Zürich?"}], TOOLS, True, {"enable_thinking": False}),
    case("tool_call_round_trip", TOOL_ROUND_TRIP, TOOLS, False),
    case(
        "tool_call_round_trip_follow_up",
        TOOL_ROUND_TRIP + [{"role": "user", "content": "Thanks. Tomorrow?"}],
        TOOLS,
        True,
        {"enable_thinking": False},
    ),
    case(
        "assistant_content_and_tool_call",
        [
            {"role": "user", "content": "Search for café."},
            {
                "role": "assistant",
                "content": "Let me search.",
                "tool_calls": [{"type": "function", "function": {"name": "search_docs", "arguments": {"query": "café", "exact": True}}}],
            },
            {"role": "tool", "content": {"hits": ["Café <1>", "Café & co"], "total": 2}},
        ],
        TOOLS,
        True,
    ),
    case(
        "reasoning_content",
        [
            {"role": "user", "content": "What is 17*3?"},
            {"role": "assistant", "reasoning_content": "Old reasoning, dropped.", "content": "51"},
            {"role": "user", "content": "And the weather?"},
            {
                "role": "assistant",
                "reasoning_content": "\nI should call the tool.\n",
                "content": "",
                "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"location": {"city": "Paris"}}}}],
            },
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "reasoning_content": "It said sunny.", "content": "Sunny."},
        ],
        TOOLS,
        True,
        {"enable_thinking": True},
    ),
    case(
        "content_parts",
        [{"role": "user", "content": [{"type": "text", "text": "Part one, "}, {"type": "text", "text": "part two."}]}],
        None,
        True,
    ),
    case("unknown_role", [{"role": "user", "content": "hi"}, {"role": "critic", "content": "meh"}], None, True),
    case("env_tojson", [{"role": "user", "content": "x"}], None, False, {"value": TOJSON_VALUE}, TOJSON_TEMPLATE),
    case(
        "env_whitespace",
        [
            {"role": "system", "content": " sys "},
            {"role": "user", "content": "  hello\n"},
            {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "stop here"},
            {"role": "assistant", "content": "never shown"},
        ],
        None,
        True,
        {},
        WHITESPACE_TEMPLATE,
    ),
    case(
        "env_python_values",
        [
            {"role": "user", "content": "hi 'there'", "extra": {"z": 1, "a": [1.5, None, True], "s": "nbsp\u00a0zw\u200b\t"}},
            {"role": "assistant", "content": "yo"},
        ],
        None,
        False,
        {},
        PYTHON_VALUES_TEMPLATE,
    ),
    case("env_raise_exception", [{"role": "user", "content": "x"}], None, False, {}, RAISE_TEMPLATE),
    case(
        "env_generation_block",
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}],
        None,
        False,
        {},
        GENERATION_TEMPLATE,
    ),
    case("named_default", [{"role": "user", "content": "hi"}], None, False, {}, NAMED_TEMPLATES),
    case("named_tool_use", [{"role": "user", "content": "hi"}], TOOLS, False, {}, NAMED_TEMPLATES),
    case("named_empty_tools", [{"role": "user", "content": "hi"}], [], False, {}, NAMED_TEMPLATES),
    case("named_tool_use_only", [{"role": "user", "content": "hi"}], TOOLS, False, {}, TOOL_USE_ONLY),
    case("named_tool_use_only_without_tools", [{"role": "user", "content": "hi"}], None, False, {}, TOOL_USE_ONLY),
]


def main():
    tok = AutoTokenizer.from_pretrained(MODEL)
    out = []
    for c in CASES:
        rec = dict(c)
        # A dict of named templates stands for the tokenizer's own (as a list in
        # tokenizer_config.json); a string is passed as the `chat_template` argument.
        template, own = c.get("template"), tok.chat_template
        if isinstance(template, dict):
            tok.chat_template, template = template, None
        try:
            rec["rendered"] = tok.apply_chat_template(
                c["messages"],
                tools=c["tools"],
                add_generation_prompt=c["add_generation_prompt"],
                tokenize=False,
                chat_template=template,
                **c["kwargs"],
            )
        except Exception as e:  # noqa: BLE001 - the error itself is the fixture
            rec["error"] = str(e)
            rec["error_type"] = type(e).__name__
        finally:
            tok.chat_template = own
        out.append(rec)
        print(f"{c['name']}: {'error: ' + rec['error'] if 'error' in rec else repr(rec['rendered'][:60])}", file=sys.stderr)
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {len(out)} cases to {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
