//! The assistant's output split the way Qwen3.6 writes it: reasoning inside `<think>…</think>`
//! (the opening tag in the prompt or at the start of the output), tool calls inside
//! `<tool_call>…</tool_call>` (a JSON object `{"name", "arguments"}`, or the XML form
//! `<function=NAME><parameter=P>value</parameter></function>` of Qwen's own templates), and the
//! rest content. It works on text as it streams: text that may begin a tag waits for the text
//! that settles it, and a tool call comes out whole once its block closes.

use serde_json::{Map, Value};

const THINK: &str = "<think>";
const THINK_END: &str = "</think>";
const TOOL: &str = "<tool_call>";
const TOOL_END: &str = "</tool_call>";

/// One parsed tool call (OpenAI's `{"id", "type": "function", "function": {"name", "arguments"}}`).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as a JSON object's text.
    pub arguments: String,
}

/// What a piece of output adds to each part of the message.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Delta {
    pub reasoning: String,
    pub content: String,
    pub tool_calls: Vec<ToolCall>,
}

impl Delta {
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_empty() && self.tool_calls.is_empty()
    }

    /// Appends `other` to `self`.
    pub fn extend(&mut self, other: Delta) {
        self.reasoning.push_str(&other.reasoning);
        self.content.push_str(&other.content);
        self.tool_calls.extend(other.tool_calls);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing emitted yet: an opening `<think>` may still come.
    Start,
    Reasoning,
    Content,
    /// Inside a `<tool_call>` block.
    Tool,
}

/// Splits a chat response into reasoning, content and tool calls as its text streams in.
#[derive(Debug, Clone)]
pub struct OutputParser {
    state: State,
    /// Tool schemas (for the argument types of XML calls); `None`: tool calls are not parsed.
    tools: Option<Vec<Value>>,
    /// Text not yet settled.
    buf: String,
    /// Newlines right after a tag are dropped (`</think>\n\n`, `<think>\n`).
    strip_newlines: bool,
    calls: usize,
    id_prefix: String,
}

impl OutputParser {
    /// A parser for one response. `reasoning`: split off `<think>` blocks; `thinking`: the prompt
    /// ends inside an open `<think>` (the output starts as reasoning); `tools`: parse tool calls
    /// against these schemas. Tool call ids are `{id_prefix}-{n}`.
    pub fn new(
        reasoning: bool,
        thinking: bool,
        tools: Option<Vec<Value>>,
        id_prefix: impl Into<String>,
    ) -> Self {
        let state = match (reasoning, thinking) {
            (true, true) => State::Reasoning,
            (true, false) => State::Start,
            (false, _) => State::Content,
        };
        Self {
            state,
            tools,
            buf: String::new(),
            strip_newlines: state == State::Reasoning,
            calls: 0,
            id_prefix: id_prefix.into(),
        }
    }

    /// Whether a rendered prompt leaves the model inside an open `<think>` block.
    pub fn prompt_is_thinking(prompt: &str) -> bool {
        match (prompt.rfind(THINK), prompt.rfind(THINK_END)) {
            (Some(open), Some(close)) => open > close,
            (Some(_), None) => true,
            _ => false,
        }
    }

    /// The parts that `text` (the next piece of output) settles.
    pub fn push(&mut self, text: &str) -> Delta {
        self.buf.push_str(text);
        let mut delta = Delta::default();
        while self.step(&mut delta, false) {}
        delta
    }

    /// The parts of whatever is still held, at the end of the output: an unclosed tool call
    /// block is a call when its body is a whole one, else content, as written.
    pub fn finish(&mut self) -> Delta {
        let mut delta = Delta::default();
        while self.step(&mut delta, true) {}
        let rest = std::mem::take(&mut self.buf);
        match self.state {
            State::Reasoning => delta.reasoning.push_str(&rest),
            State::Tool => {
                delta.content.push_str(TOOL);
                delta.content.push_str(&rest);
            }
            State::Start | State::Content => delta.content.push_str(&rest),
        }
        self.state = State::Content;
        delta
    }

    /// Moves what it can from `buf` into `delta`; true when the state changed (go again).
    fn step(&mut self, delta: &mut Delta, end: bool) -> bool {
        if self.strip_newlines {
            let kept = self.buf.trim_start_matches('\n').len();
            self.buf.drain(..self.buf.len() - kept);
            if self.buf.is_empty() {
                return false;
            }
            self.strip_newlines = false;
        }
        match self.state {
            State::Start => {
                let trimmed = self.buf.trim_start();
                if let Some(rest) = trimmed.strip_prefix(THINK) {
                    self.buf = rest.to_string();
                    self.state = State::Reasoning;
                    self.strip_newlines = true;
                    true
                } else if !end && THINK.starts_with(trimmed) {
                    false // wait: it may still become `<think>`
                } else {
                    self.state = State::Content;
                    true
                }
            }
            State::Reasoning => {
                if let Some(i) = self.buf.find(THINK_END) {
                    delta.reasoning.push_str(&self.buf[..i]);
                    self.buf.drain(..i + THINK_END.len());
                    self.state = State::Content;
                    self.strip_newlines = true;
                    true
                } else {
                    let keep = if end { 0 } else { held_prefix(&self.buf, THINK_END) };
                    delta.reasoning.push_str(&self.buf[..self.buf.len() - keep]);
                    self.buf.drain(..self.buf.len() - keep);
                    false
                }
            }
            State::Content => {
                if self.tools.is_none() {
                    delta.content.push_str(&self.buf);
                    self.buf.clear();
                    return false;
                }
                if let Some(i) = self.buf.find(TOOL) {
                    delta.content.push_str(&self.buf[..i]);
                    self.buf.drain(..i + TOOL.len());
                    self.state = State::Tool;
                    true
                } else {
                    let keep = if end { 0 } else { held_prefix(&self.buf, TOOL) };
                    delta.content.push_str(&self.buf[..self.buf.len() - keep]);
                    self.buf.drain(..self.buf.len() - keep);
                    false
                }
            }
            State::Tool => {
                // A JSON body ends where its value ends: a `</tool_call>` inside one of its
                // strings is text (a value still arriving waits for the rest); an XML body
                // after the `</function>` that `</tool_call>` follows.
                let from = match json_end(&self.buf) {
                    JsonEnd::At(at) => at,
                    JsonEnd::Incomplete if !end => return false,
                    JsonEnd::Incomplete => 0,
                    JsonEnd::NotJson => match xml_end(&self.buf) {
                        Some(at) => at,
                        None if !end => return false,
                        None => 0,
                    },
                };
                let tools = self.tools.as_deref().unwrap_or(&[]);
                let Some(i) = self.buf[from..].find(TOOL_END).map(|i| i + from) else {
                    // The output ends inside the block (a `</tool_call>` stop string cut it,
                    // say): a body that is a whole call is one (whole JSON, or one function
                    // closed by its `</function>`).
                    let whole = end && whole_body(&self.buf);
                    let Some(call) = whole.then(|| parse_tool_call(&self.buf, tools)).flatten() else {
                        return false;
                    };
                    self.buf.clear();
                    self.push_call(delta, call);
                    return true;
                };
                let block: String = self.buf.drain(..i + TOOL_END.len()).collect();
                match parse_tool_call(&block[..i], tools) {
                    Some(call) => self.push_call(delta, call),
                    // Not a call this parser can read: the text as the model wrote it.
                    None => {
                        delta.content.push_str(TOOL);
                        delta.content.push_str(&block);
                        self.state = State::Content;
                    }
                }
                true
            }
        }
    }

    /// A call read from a block (its name and arguments) into `delta`; the content follows.
    fn push_call(&mut self, delta: &mut Delta, (name, arguments): (String, String)) {
        delta.tool_calls.push(ToolCall {
            id: format!("{}-{}", self.id_prefix, self.calls),
            name,
            arguments,
        });
        self.calls += 1;
        self.strip_newlines = true;
        self.state = State::Content;
    }
}

/// Where a tool call's JSON body ends.
enum JsonEnd {
    /// The byte after its value.
    At(usize),
    /// Its value has not ended yet.
    Incomplete,
    /// It does not open a JSON object (the XML form), or is not JSON.
    NotJson,
}

/// Whether `body`, a block's text without its `</tool_call>`, is a whole call: JSON (which
/// [`parse_tool_call`] reads only whole), or one XML function that its `</function>` ends (not
/// one cut short, nor two run together).
fn whole_body(body: &str) -> bool {
    let body = body.trim();
    !body.starts_with("<function=")
        || (body.ends_with("</function>") && body.matches("<function=").count() == 1)
}

/// Where an XML body (`<function=…`) ends: after its first `</function>` that `</tool_call>`
/// follows (a value may hold either tag as text); `None` while none has; 0 for another body.
fn xml_end(body: &str) -> Option<usize> {
    if !body.trim_start().starts_with("<function=") {
        return Some(0);
    }
    body.match_indices("</function>")
        .map(|(i, tag)| i + tag.len())
        .find(|&e| body[e..].trim_start().starts_with(TOOL_END))
}

/// Where the JSON object that `body` opens (after whitespace) ends.
fn json_end(body: &str) -> JsonEnd {
    let value = body.trim_start();
    if !value.starts_with('{') {
        return JsonEnd::NotJson;
    }
    let mut values = serde_json::Deserializer::from_str(value).into_iter::<serde::de::IgnoredAny>();
    match values.next() {
        Some(Ok(_)) => JsonEnd::At(body.len() - value.len() + values.byte_offset()),
        Some(Err(e)) if e.is_eof() => JsonEnd::Incomplete,
        _ => JsonEnd::NotJson,
    }
}

/// The length of the longest end of `text` that begins `tag` (and is shorter than it): the
/// text that must wait for more before it can be emitted.
fn held_prefix(text: &str, tag: &str) -> usize {
    (1..tag.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && tag.starts_with(&text[text.len() - n..]))
        .unwrap_or(0)
}

/// The bytes of a byte-level BPE token (GPT-2's byte-to-character map, as Qwen's tokenizer
/// uses), or `None` when `piece` holds a character outside that map (an added token).
pub fn byte_level_bytes(piece: &str) -> Option<Vec<u8>> {
    piece
        .chars()
        .map(|c| {
            let c = c as u32;
            // Printable bytes map to themselves; the others to U+0100 and up, in byte order.
            let printable = |b: u32| {
                (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
            };
            if c < 0x100 && printable(c) {
                return Some(c as u8);
            }
            let k = c.checked_sub(0x100)?;
            (0u32..256)
                .filter(|&b| !printable(b))
                .nth(k as usize)
                .map(|b| b as u8)
        })
        .collect()
}

/// A tool call block's name and arguments (a JSON object's text), or `None` when it is neither
/// form.
pub fn parse_tool_call(body: &str, tools: &[Value]) -> Option<(String, String)> {
    let body = body.trim();
    if body.starts_with('{') {
        let v: Value = serde_json::from_str(body).ok()?;
        let name = v.get("name")?.as_str()?.to_string();
        let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
            None | Some(Value::Null) => "{}".to_string(),
            Some(Value::String(s)) => {
                // Arguments given as a JSON text must be one.
                serde_json::from_str::<Map<String, Value>>(s).ok()?;
                s.clone()
            }
            Some(Value::Object(m)) => Value::Object(m.clone()).to_string(),
            Some(_) => return None,
        };
        return Some((name, arguments));
    }
    let rest = body.strip_prefix("<function=")?;
    let (name, mut rest) = rest.split_once('>')?;
    let name = name.trim().to_string();
    if name.is_empty() {
        return None;
    }
    if let Some(end) = rest.rfind("</function>") {
        rest = &rest[..end];
    }
    let mut args = Map::new();
    while let Some(start) = rest.find("<parameter=") {
        let (pname, after) = rest[start + "<parameter=".len()..].split_once('>')?;
        let (value, next) = match value_end(after) {
            Some(e) => (&after[..e], &after[e + "</parameter>".len()..]),
            None => match after.find("<parameter=") {
                Some(e) => (&after[..e], &after[e..]),
                None => (after, ""),
            },
        };
        let value = value.strip_prefix('\n').unwrap_or(value);
        let value = value.strip_suffix('\n').unwrap_or(value);
        let pname = pname.trim();
        args.insert(pname.to_string(), xml_param(tools, &name, pname).read(value));
        rest = next;
    }
    Some((name, Value::Object(args).to_string()))
}

/// Where an XML parameter's value ends in `after` (the text after its `<parameter=P>`): at the
/// first `</parameter>` that the next parameter or the function's end follows (a value may
/// hold the tag as text), else at the first.
fn value_end(after: &str) -> Option<usize> {
    const CLOSE: &str = "</parameter>";
    let mut closes = after.match_indices(CLOSE).map(|(i, _)| i).peekable();
    let first = closes.peek().copied();
    closes
        .find(|&i| {
            let next = after[i + CLOSE.len()..].trim_start();
            next.is_empty() || next.starts_with("<parameter=") || next.starts_with("</function>")
        })
        .or(first)
}

/// How parameter `param` of tool `name` is written in the XML form (a string when the tools do
/// not declare it).
fn xml_param<'a>(tools: &'a [Value], name: &str, param: &str) -> XmlParam<'a> {
    let params = tools
        .iter()
        .find(|t| t.pointer("/function/name").and_then(Value::as_str) == Some(name))
        .and_then(|t| t.pointer("/function/parameters"));
    match params.and_then(|p| Some((p, p.get("properties")?.get(param)?))) {
        Some((params, schema)) => XmlParam::of(schema, params),
        None => XmlParam::Text,
    }
}

/// How an XML parameter's value is written and read back, by its schema: the forced grammar
/// writes it so and the parser reads it so.
#[derive(Debug, PartialEq)]
pub(crate) enum XmlParam<'a> {
    /// Free text: a string, or a schema that allows one or does not say.
    Text,
    /// One of these values (an `enum`, a `const`), written as a string's own text or another
    /// value's JSON (or its Python text, [`python_text`]).
    Enum(&'a [Value]),
    /// JSON matching the schema, whose types (none a string) these are; a boolean or null also
    /// as its Python text.
    Json(Vec<&'a str>),
}

impl<'a> XmlParam<'a> {
    /// The parameter of `schema`, a property of `params` (whose definitions its local `$ref`s
    /// name).
    pub(crate) fn of(schema: &'a Value, params: &'a Value) -> Self {
        let s = read_through_ref(schema, params);
        match (s.get("enum"), s.get("const")) {
            (Some(Value::Array(values)), _) if !values.is_empty() => Self::Enum(values),
            (_, Some(c)) => Self::Enum(std::slice::from_ref(c)),
            _ => match json_types(s, params) {
                Some(types) if !types.is_empty() && !types.contains(&"string") => Self::Json(types),
                _ => Self::Text,
            },
        }
    }

    /// A value's text (between the newlines around it) read back: the enum value it writes,
    /// the JSON it is (or the boolean or null whose Python text it is), else the text itself.
    fn read(&self, text: &str) -> Value {
        let t = text.trim();
        let found = match self {
            Self::Text => None,
            // (A value's own text first: `True` is the string of `["True", true]`.)
            Self::Enum(values) => values
                .iter()
                .find(|v| enum_text(v) == t)
                .or_else(|| values.iter().find(|v| python_text(v) == Some(t)))
                .cloned(),
            Self::Json(types) => serde_json::from_str(t)
                .ok()
                .or_else(|| python_values(types).find(|v| python_text(v) == Some(t))),
        };
        found.unwrap_or_else(|| Value::String(text.to_string()))
    }
}

/// An enum value's text in the XML form: a string's own, else its JSON.
pub(crate) fn enum_text(v: &Value) -> String {
    v.as_str().map_or_else(|| v.to_string(), str::to_string)
}

/// The values of `types` (JSON type names) that have a Python text: the booleans, null.
pub(crate) fn python_values<'t>(types: &'t [&str]) -> impl Iterator<Item = Value> + 't {
    [Value::Bool(true), Value::Bool(false), Value::Null]
        .into_iter()
        .filter(|v| types.contains(&if v.is_null() { "null" } else { "boolean" }))
}

/// A boolean's or null's text as Qwen's chat templates write a parameter in the XML form
/// (Jinja's `string` filter: Python's `str()`), so the model has seen it in its history.
pub(crate) fn python_text(v: &Value) -> Option<&'static str> {
    match v {
        Value::Bool(true) => Some("True"),
        Value::Bool(false) => Some("False"),
        Value::Null => Some("None"),
        _ => None,
    }
}

/// The JSON types `schema` allows (its `type`, or every `anyOf`/`oneOf` alternative's), `None`
/// when it does not say.
fn json_types<'a>(schema: &'a Value, params: &'a Value) -> Option<Vec<&'a str>> {
    match schema.get("type") {
        Some(Value::String(t)) => Some(vec![t.as_str()]),
        Some(Value::Array(types)) => types.iter().map(Value::as_str).collect(),
        Some(_) => None,
        None => {
            let alternatives = schema.get("anyOf").or_else(|| schema.get("oneOf"))?.as_array()?;
            let mut all = Vec::new();
            for a in alternatives {
                all.extend(json_types(read_through_ref(a, params), params)?);
            }
            Some(all)
        }
    }
}

/// The schema a local `$ref` in `schema` names in `root` (the tool's parameters, whose
/// `$defs` Pydantic's references name), else `schema` itself.
pub(crate) fn read_through_ref<'a>(schema: &'a Value, root: &'a Value) -> &'a Value {
    let local = schema
        .get("$ref")
        .and_then(Value::as_str)
        .and_then(|r| r.strip_prefix('#'));
    local.and_then(|r| root.pointer(r)).unwrap_or(schema)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn weather() -> Vec<Value> {
        vec![
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
                               "at": {"$ref": "#/$defs/Place"}},
                "$defs": {"Place": {"type": "object"}}
            }}}),
        ]
    }

    /// Runs `text` through a parser in pieces of `piece` bytes (on char boundaries) and returns
    /// the joined parts.
    fn parse_in_pieces(mut p: OutputParser, text: &str, piece: usize) -> Delta {
        let mut all = Delta::default();
        let mut start = 0;
        while start < text.len() {
            let mut end = (start + piece).min(text.len());
            while !text.is_char_boundary(end) {
                end += 1;
            }
            all.extend(p.push(&text[start..end]));
            start = end;
        }
        all.extend(p.finish());
        all
    }

    /// The same output split at every piece size gives the same parts.
    fn parse_all_ways(make: impl Fn() -> OutputParser, text: &str) -> Delta {
        let whole = parse_in_pieces(make(), text, text.len().max(1));
        for piece in 1..=text.len().min(24) {
            assert_eq!(parse_in_pieces(make(), text, piece), whole, "pieces of {piece}");
        }
        whole
    }

    /// Output waits only while it may still become the opening `<think>`: a start that cannot
    /// (or a `<think>` already whole) settles at once, not at the end.
    #[test]
    fn the_start_waits_only_for_what_may_open_a_think_block() {
        let mut p = OutputParser::new(true, false, None, "c");
        assert_eq!(p.push("<thi"), Delta::default());
        let d = p.push("nk>\nhm");
        assert_eq!((d.reasoning.as_str(), d.content.as_str()), ("hm", ""));
        let mut p = OutputParser::new(true, false, None, "c");
        let d = p.push("Hello");
        assert_eq!((d.reasoning.as_str(), d.content.as_str()), ("", "Hello"));
        let mut p = OutputParser::new(true, false, None, "c");
        assert_eq!(p.push("<thi").content, "");
        assert_eq!(p.push("s").content, "<this");
    }

    #[test]
    fn reasoning_then_content_whether_think_opens_in_the_prompt_or_the_output() {
        let d = parse_all_ways(
            || OutputParser::new(true, true, None, "c"),
            "\nI should say hi.\n</think>\n\nHello <b>!",
        );
        assert_eq!(d.reasoning, "I should say hi.\n");
        assert_eq!(d.content, "Hello <b>!");
        let d = parse_all_ways(
            || OutputParser::new(true, false, None, "c"),
            "<think>\nhmm</think>\n\nHi",
        );
        assert_eq!((d.reasoning.as_str(), d.content.as_str()), ("hmm", "Hi"));
        // No <think> at the start: all content, tags inside left alone.
        let d = parse_all_ways(
            || OutputParser::new(true, false, None, "c"),
            "<thin>Hi</think> there",
        );
        assert_eq!(
            (d.reasoning.as_str(), d.content.as_str()),
            ("", "<thin>Hi</think> there")
        );
        // Reasoning off: everything is content.
        let d = parse_all_ways(|| OutputParser::new(false, true, None, "c"), "a</think>b");
        assert_eq!(d.content, "a</think>b");
        // Cut off while thinking: what came is reasoning.
        let d = parse_all_ways(|| OutputParser::new(true, true, None, "c"), "still </thi");
        assert_eq!((d.reasoning.as_str(), d.content.as_str()), ("still </thi", ""));
    }

    #[test]
    fn the_prompt_says_whether_the_output_starts_thinking() {
        assert!(OutputParser::prompt_is_thinking(
            "<|im_start|>assistant\n<think>\n"
        ));
        assert!(!OutputParser::prompt_is_thinking(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        ));
        assert!(!OutputParser::prompt_is_thinking("<|im_start|>assistant\n"));
        assert!(OutputParser::prompt_is_thinking("<think>a</think> x <think>"));
    }

    /// A `</tool_call>` inside a JSON body's string is text: the call ends after the value (in
    /// every split into pieces, the value arriving in parts).
    #[test]
    fn a_closing_tag_inside_a_json_string_is_text() {
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"a</tool_call>b\"}}\n</tool_call>";
        let d = parse_all_ways(|| OutputParser::new(true, false, Some(weather()), "call"), text);
        assert_eq!((d.content.as_str(), d.tool_calls.len()), ("", 1), "{d:?}");
        let args: Value = serde_json::from_str(&d.tool_calls[0].arguments).unwrap();
        assert_eq!(args["city"], "a</tool_call>b");
    }

    #[test]
    fn json_and_xml_tool_calls_with_typed_arguments() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\", \"days\": 2}}\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan José\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=note>\n42\n</parameter>\n<parameter=at>\n{\"x\": 1}\n</parameter>\n</function>\n</tool_call>";
        let d = parse_all_ways(|| OutputParser::new(true, false, Some(weather()), "call"), text);
        assert_eq!(d.content, "Let me check.\n");
        assert_eq!(d.tool_calls.len(), 2);
        assert_eq!(d.tool_calls[0].id, "call-0");
        assert_eq!(d.tool_calls[1].id, "call-1");
        assert_eq!(d.tool_calls[0].name, "get_weather");
        let a0: Value = serde_json::from_str(&d.tool_calls[0].arguments).unwrap();
        assert_eq!(a0, json!({"city": "Zürich", "days": 2}));
        let a1: Value = serde_json::from_str(&d.tool_calls[1].arguments).unwrap();
        // Typed by the schema (through a `$ref`); an undeclared parameter stays a string.
        assert_eq!(
            a1,
            json!({"city": "San José", "days": 3, "metric": true, "note": "42", "at": {"x": 1}})
        );
    }

    /// XML parameters by their schema: free text where a string is allowed or nothing is said,
    /// JSON where no type is a string (type lists and `anyOf` alternatives, through `$ref`s),
    /// enums and consts read back as their own values.
    #[test]
    fn xml_parameters_are_read_by_their_schema() {
        let params = json!({"$defs": {"N": {"type": "integer"}}});
        let kind = |schema: Value, text: &str| {
            let p = XmlParam::of(&schema, &params);
            let read = p.read(text);
            (matches!(p, XmlParam::Text), matches!(p, XmlParam::Json(_)), read)
        };
        let text = |t: &str| (true, false, json!(t));
        let json_of = |v: Value| (false, true, v);
        assert_eq!(kind(json!({"type": "string"}), "3"), text("3"));
        assert_eq!(kind(json!({}), "3"), text("3"));
        assert_eq!(kind(json!({"type": ["string", "null"]}), "null"), text("null"));
        assert_eq!(
            kind(json!({"anyOf": [{"type": "string"}, {"type": "null"}]}), "1"),
            text("1")
        );
        assert_eq!(
            kind(json!({"anyOf": [{"$ref": "#/$defs/N"}, {}]}), "1"),
            text("1")
        );
        assert_eq!(
            kind(json!({"type": ["integer", "null"]}), " 3 "),
            json_of(json!(3))
        );
        assert_eq!(
            kind(
                json!({"oneOf": [{"$ref": "#/$defs/N"}, {"type": "null"}]}),
                "null"
            ),
            json_of(json!(null))
        );
        assert_eq!(kind(json!({"type": "integer"}), "three"), json_of(json!("three")));
        let e = json!({"enum": [1, "a", true]});
        assert_eq!(XmlParam::of(&e, &params).read("1"), json!(1));
        assert_eq!(XmlParam::of(&e, &params).read("a"), json!("a"));
        assert_eq!(XmlParam::of(&e, &params).read("true"), json!(true));
        assert_eq!(XmlParam::of(&e, &params).read("True"), json!(true));
        assert_eq!(XmlParam::of(&e, &params).read("b"), json!("b"));
        assert_eq!(XmlParam::of(&e, &params).read("False"), json!("False"));
        let maybe = json!({"type": ["boolean", "null"]});
        for (t, v) in [
            ("True", json!(true)),
            ("False", json!(false)),
            ("None", json!(null)),
        ] {
            assert_eq!(kind(maybe.clone(), t), json_of(v));
        }
        assert_eq!(kind(maybe, "TRUE"), json_of(json!("TRUE")));
        assert_eq!(kind(json!({"type": "integer"}), "None"), json_of(json!("None")));
        let both = json!({"enum": [true, "True"]});
        assert_eq!(XmlParam::of(&both, &params).read("True"), json!("True"));
        assert_eq!(XmlParam::of(&both, &params).read("true"), json!(true));
        assert_eq!(XmlParam::of(&json!({"enum": []}), &params), XmlParam::Text);
        assert_eq!(XmlParam::of(&json!({"const": 2}), &params).read("2"), json!(2));
    }

    /// A value (free text in a forced call) may hold `</parameter>` and `</tool_call>` as text:
    /// it ends at the closing tag that the next parameter or the function's end follows, the
    /// block after the `</function>` that `</tool_call>` follows.
    #[test]
    fn closing_tags_inside_an_xml_value_are_text() {
        let text = "<tool_call>\n<function=get_weather>\n<parameter=city>\na</parameter>b</tool_call>c\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\nDone.";
        let d = parse_all_ways(|| OutputParser::new(false, false, Some(weather()), "c"), text);
        assert_eq!(d.content, "Done.");
        assert_eq!(d.tool_calls.len(), 1);
        let args: Value = serde_json::from_str(&d.tool_calls[0].arguments).unwrap();
        assert_eq!(args, json!({"city": "a</parameter>b</tool_call>c", "days": 3}));
        // A block the output ends in (a `</tool_call>` stop string cut it) is a call when its
        // body is whole, in either form.
        for cut in [
            "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n",
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"days\": 3}}\n",
        ] {
            let d = parse_all_ways(|| OutputParser::new(false, false, Some(weather()), "c"), cut);
            assert_eq!((d.content.as_str(), d.tool_calls.len()), ("", 1), "{cut}");
            assert_eq!(d.tool_calls[0].arguments, r#"{"days":3}"#);
        }
        // Not when the body is cut short (by `max_tokens`, or a stop string inside a value) or
        // holds two functions: text, as written.
        for cut in [
            "<tool_call>\n<function=get_weather>\n<parameter=days>\n36",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\ns = \"",
            "<tool_call>\n<function=get_weather>\n</function>\n<tool_call>\n<function=get_weather>\n</function>\n",
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"days\": 3}",
        ] {
            let d = parse_all_ways(|| OutputParser::new(false, false, Some(weather()), "c"), cut);
            assert_eq!((d.content.as_str(), d.tool_calls.len()), (cut, 0), "{cut}");
        }
        // Without `</function>` the block still ends at the output's end.
        let open = "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</tool_call>";
        let d = parse_all_ways(|| OutputParser::new(false, false, Some(weather()), "c"), open);
        assert_eq!(d.tool_calls.len(), 1, "{d:?}");
    }

    /// A body that opens a JSON object but is not one is text from its `</tool_call>` on, as
    /// soon as that arrives (not held to the end of the output).
    #[test]
    fn a_malformed_json_body_is_text_at_once() {
        let mut p = OutputParser::new(false, false, Some(weather()), "c");
        let text = "<tool_call>{\"name\": x}</tool_call> after";
        assert_eq!(p.push(text).content, text);
    }

    #[test]
    fn blocks_that_are_not_calls_stay_content() {
        let tools = Some(weather());
        for text in [
            "<tool_call>not json</tool_call> after",
            "<tool_call>{\"arguments\": {}}</tool_call>",
            "<tool_call>{\"name\": \"f\", \"arguments\": \"[1]\"}</tool_call>",
            "a <tool_call>{\"name\": \"f\"", // never closed
        ] {
            let d = parse_all_ways(|| OutputParser::new(false, false, tools.clone(), "c"), text);
            assert_eq!(d.content, text);
            assert!(d.tool_calls.is_empty());
        }
        // Without tools the tags are plain text.
        let text = "<tool_call>{\"name\": \"f\"}</tool_call>";
        let d = parse_all_ways(|| OutputParser::new(false, false, None, "c"), text);
        assert_eq!((d.content.as_str(), d.tool_calls.len()), (text, 0));
        // A call with no arguments has an empty object.
        let d = parse_all_ways(
            || OutputParser::new(false, false, tools.clone(), "c"),
            "<tool_call>{\"name\": \"f\"}</tool_call>",
        );
        assert_eq!(d.tool_calls[0].arguments, "{}");
    }

    /// GPT-2's byte-level map: printable bytes are themselves, `Ġ` (U+0120) is a space, `Ċ`
    /// (U+010A) a newline, and a character split across tokens keeps its raw bytes.
    #[test]
    fn byte_level_pieces_give_their_bytes() {
        assert_eq!(byte_level_bytes("Hello").unwrap(), b"Hello");
        assert_eq!(byte_level_bytes("\u{120}world").unwrap(), b" world");
        assert_eq!(byte_level_bytes("\u{10A}").unwrap(), b"\n");
        assert_eq!(byte_level_bytes("\u{100}").unwrap(), [0u8]);
        // "é" is bytes C3 A9, written as the characters Ã (U+00C3) and © (U+00A9).
        assert_eq!(byte_level_bytes("\u{C3}").unwrap(), [0xC3]);
        assert_eq!(byte_level_bytes("\u{C3}\u{A9}").unwrap(), "é".as_bytes());
        assert_eq!(byte_level_bytes("<|im_end|>"), Some(b"<|im_end|>".to_vec()));
        assert_eq!(byte_level_bytes("日"), None);
        // A raw space or newline is outside the map too (it writes them as U+0120 and U+010A).
        assert_eq!(byte_level_bytes("a b"), None);
        assert_eq!(byte_level_bytes("\n"), None);
    }

    #[test]
    fn held_text_is_only_what_may_begin_the_tag() {
        assert_eq!(held_prefix("abc</th", THINK_END), 4);
        assert_eq!(held_prefix("abc<", TOOL), 1);
        assert_eq!(held_prefix("abc", TOOL), 0);
        assert_eq!(held_prefix("<tool_call", TOOL), 10);
        assert_eq!(held_prefix("é<", TOOL), 1);
        // Ends that start inside a character are skipped, not sliced.
        assert_eq!(held_prefix("aé", TOOL), 0);
        assert_eq!(held_prefix("a\u{1F600}", THINK_END), 0);
        // While streaming, text that cannot begin a tag goes out at once.
        let mut p = OutputParser::new(true, true, Some(weather()), "c");
        assert_eq!(p.push("abc</th").reasoning, "abc");
        assert_eq!(p.push("ink>x <tool").content, "x ");
        assert_eq!(p.push("s").content, "<tools");
    }
}
