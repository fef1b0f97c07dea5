//! The OpenAI request bodies the server reads, their checks, and the error object it answers
//! with.

use crate::output::{enum_text, python_text, python_values, XmlParam};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use llguidance::api::TopLevelGrammar;
use serde::Deserialize;
use serde_json::{json, Map, Value};

/// The most stop strings a request may give, and the longest one (bytes): each is matched
/// against the text at every token.
pub const MAX_STOP_STRINGS: usize = 16;
pub const MAX_STOP_BYTES: usize = 512;
/// The most extra stop token ids a request may give.
pub const MAX_STOP_IDS: usize = 64;
/// The most choices (`n`) one request may ask for.
pub const MAX_CHOICES: usize = 16;
/// The most alternatives per token (`top_logprobs`, completions' `logprobs`), as vLLM allows.
pub const MAX_TOP_LOGPROBS: usize = 20;
/// `max_tokens` of a completion that gives none (OpenAI's default).
pub const DEFAULT_COMPLETION_TOKENS: usize = 16;

/// A prompt: text, or token ids (`/v1/completions`); or a list of either, OpenAI's batched
/// form, each prompt its own request whose choices the response lists in order.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
    Texts(Vec<String>),
    IdLists(Vec<Vec<u32>>),
    /// Anything else: refused by [`Prompt::each`] with the forms it may take.
    Other(Value),
}

/// One prompt of a request: its text or its token ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnePrompt<'a> {
    Text(&'a str),
    Ids(&'a [u32]),
}

/// The most prompts one `/v1/completions` request may batch.
pub const MAX_PROMPTS: usize = 256;

/// The most `bad_words` a request may give (each is masked at every step of its output).
pub const MAX_BAD_WORDS: usize = 256;

impl Prompt {
    /// The prompts this holds, in order: one for a text or an id list, each element of a list
    /// of them; more than `MAX_PROMPTS` and other JSON are errors naming `prompt`. (An empty
    /// list reads as an empty id list: one prompt, which the engine refuses.)
    pub fn each(&self) -> Result<Vec<OnePrompt<'_>>, ApiError> {
        let list: Vec<OnePrompt<'_>> = match self {
            Prompt::Text(t) => vec![OnePrompt::Text(t)],
            Prompt::Ids(ids) => vec![OnePrompt::Ids(ids)],
            Prompt::Texts(v) => v.iter().map(|t| OnePrompt::Text(t)).collect(),
            Prompt::IdLists(v) => v.iter().map(|ids| OnePrompt::Ids(ids)).collect(),
            Prompt::Other(v) => {
                return Err(ApiError::bad_request(format!(
                    "prompt {}: expected a text, a list of token ids (0..2^32), or a list of either",
                    short(v)
                ))
                .param("prompt"))
            }
        };
        match list.len() {
            n if n > MAX_PROMPTS => Err(ApiError::bad_request(format!(
                "prompt: {n} prompts; one request takes at most {MAX_PROMPTS}"
            ))
            .param("prompt")),
            _ => Ok(list),
        }
    }
}

/// `v` as JSON, cut to about 60 bytes for an error message.
fn short(v: &Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(60) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s,
    }
}

/// A field's default when it is absent or `null` (OpenAI marks most fields nullable, and
/// clients send unset ones as `null`).
fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Option::<T>::deserialize(d).map(Option::unwrap_or_default)
}

/// `seed`: any 64-bit integer, signed (as OpenAI's and vLLM's) or not; a negative one is taken
/// as its two's complement bits.
fn any_seed<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    let Some(n) = Option::<serde_json::Number>::deserialize(d)? else {
        return Ok(None);
    };
    match (n.as_u64(), n.as_i64()) {
        (Some(u), _) => Ok(Some(u)),
        (None, Some(i)) => Ok(Some(i as u64)),
        _ => Err(serde::de::Error::custom(format!(
            "seed {n}: expected a 64-bit integer"
        ))),
    }
}

/// `stop`: one string or several.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default, deserialize_with = "null_as_default")]
    pub include_usage: bool,
    /// vLLM's usage in every chunk (each choice's so far; with `include_usage`).
    #[serde(default, deserialize_with = "null_as_default")]
    pub continuous_usage_stats: bool,
}

/// The body of `POST /v1/completions` (which needs `prompt`) and `POST /v1/chat/completions`
/// (which needs `messages`): one struct without flattening, so that a field of the wrong type is
/// named in the error. Fields the server does not know are ignored, as OpenAI-compatible servers
/// do; fields it knows but cannot honour (`best_of`, `suffix`, ...) are refused by
/// [`GenerateRequest::check_supported`].
#[derive(Debug, Clone, Default, Deserialize)]
pub struct GenerateRequest {
    /// `/v1/completions`: text or token ids.
    pub prompt: Option<Prompt>,
    /// `/v1/chat/completions`: OpenAI messages, passed to the chat template as they are (after
    /// the role check).
    pub messages: Option<Vec<Map<String, Value>>>,
    /// Tool schemas for the chat template; the output's tool calls are parsed against them.
    pub tools: Option<Vec<Value>>,
    /// `"auto"` (the default), `"none"` (tool calls are not parsed), `"required"` or
    /// `{"type": "function", "function": {"name": ...}}` (a call forced: [`Self::tool_grammar`]).
    pub tool_choice: Option<Value>,
    /// `false`: only the first tool call of the output is returned (default `true`).
    pub parallel_tool_calls: Option<bool>,
    /// End the prompt with the template's generation prompt (vLLM's extension; default `true`,
    /// `false` with `continue_final_message`).
    pub add_generation_prompt: Option<bool>,
    /// Continue the final (assistant) message instead of starting a new one (vLLM's extension).
    pub continue_final_message: Option<bool>,
    /// A Jinja chat template for this request instead of the model's (vLLM's extension; only
    /// where the server trusts request templates: [`crate::ServerConfig`]).
    pub chat_template: Option<Value>,
    /// Chat template kwargs (`enable_thinking` for Qwen3.6).
    #[serde(default, deserialize_with = "null_as_default")]
    pub chat_template_kwargs: Map<String, Value>,
    /// Return the prompt's and the completion's token ids (vLLM's extension; completions).
    #[serde(default, deserialize_with = "null_as_default")]
    pub return_token_ids: bool,
    pub model: Option<String>,
    pub max_tokens: Option<usize>,
    /// The newer name of `max_tokens` (chat).
    pub max_completion_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// `-1` or `0`: off (vLLM's convention).
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    /// Makes sampling reproducible; without it every request draws a seed of its own.
    #[serde(default, deserialize_with = "any_seed")]
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    /// Extra stop token ids (vLLM's extension), besides the model's end-of-turn ids.
    #[serde(default, deserialize_with = "null_as_default")]
    pub stop_token_ids: Vec<u32>,
    /// Do not stop at the model's end-of-turn ids (vLLM's extension; benchmarks use it).
    #[serde(default, deserialize_with = "null_as_default")]
    pub ignore_eos: bool,
    /// The output's first `min_tokens` tokens are never an end-of-turn or stop id, and no stop
    /// string ends it there (vLLM's extension).
    #[serde(default, deserialize_with = "null_as_default")]
    pub min_tokens: usize,
    /// The text keeps the stop string that ended it (vLLM's extension).
    #[serde(default, deserialize_with = "null_as_default")]
    pub include_stop_str_in_output: bool,
    /// Scheduling priority, lower first (vLLM's extension; default 0): it is admitted before
    /// requests of a higher value and preempted after them.
    #[serde(default, deserialize_with = "null_as_default")]
    pub priority: i32,
    #[serde(default, deserialize_with = "null_as_default")]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<usize>,
    /// Chat: `true` for each token's log-probability; completions: the number of alternatives
    /// per token (0 for the token's own only).
    pub logprobs: Option<Value>,
    /// Chat: alternatives per token (needs `logprobs: true`).
    pub top_logprobs: Option<usize>,
    /// OpenAI's `{"token id": bias}` ([`Self::logit_bias`]).
    pub logit_bias: Option<Map<String, Value>>,
    /// Completions: the text starts with the prompt (and the log-probabilities with the
    /// prompt's, the first token's null); with `max_tokens: 0`, the prompt alone (lm-eval's
    /// loglikelihood requests).
    pub echo: Option<bool>,
    /// Structured output: `{"type": "json_object"}` or `{"type": "json_schema", "json_schema":
    /// {"schema": ...}}` ([`Self::grammar`]).
    pub response_format: Option<Value>,
    /// vLLM's structured-output extensions: a JSON schema, a regex, a list of choices, or a
    /// grammar (llguidance's Lark, or llama.cpp's GBNF, rewritten into Lark).
    pub guided_json: Option<Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub guided_grammar: Option<Value>,
    /// vLLM's newer structured-output field: `{"json": schema}`, `{"regex": ...}`, `{"choice":
    /// [...]}`, `{"grammar": ...}` or `{"json_object": true}`, as the `guided_*` fields.
    pub structured_outputs: Option<Map<String, Value>>,
    /// Words the output never contains (vLLM's extension): their ids as a text starts with them
    /// and inside it.
    pub bad_words: Option<Vec<String>>,
    /// Only these token ids may be generated (vLLM's extension).
    #[serde(default, deserialize_with = "null_as_default")]
    pub allowed_token_ids: Vec<u32>,
    /// Keep only the prompt's last N tokens, `-1` the last `max_model_len` (vLLM's extension).
    pub truncate_prompt_tokens: Option<i64>,
    /// `false`: the text writes special tokens out (vLLM's extension; default `true`).
    pub skip_special_tokens: Option<bool>,
    /// Log-probabilities name their tokens `token_id:ID` (vLLM's extension).
    pub return_tokens_as_token_ids: Option<bool>,
    /// Each prompt token's log-probability with this many alternatives (vLLM's extension:
    /// [`Self::prompt_logprobs`]).
    pub prompt_logprobs: Option<Value>,
    /// Known but not served: refused when set to anything but their neutral value.
    pub best_of: Option<usize>,
    pub suffix: Option<String>,
    pub functions: Option<Value>,
    pub function_call: Option<Value>,
    pub use_beam_search: Option<bool>,
}

/// How a request asked for tool calls ([`GenerateRequest::tool_choice`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// No tools, or `"none"`: tool calls stay text.
    Off,
    /// Parsed from the output when the model writes them.
    Auto,
    /// At least one call, of any tool (forced).
    Required,
    /// A call of this tool (forced).
    Named(String),
}

/// How the chat template teaches the model to write a tool call (what a forced call is made
/// to look like: [`GenerateRequest::tool_grammar`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolCallForm {
    /// `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (Qwen2.5 and Qwen3's
    /// templates, the bundled model's).
    Json,
    /// `<tool_call>\n<function=NAME>\n<parameter=P>\nvalue\n</parameter>\n</function>\n</tool_call>`
    /// (Qwen3.5 and Qwen3.6's templates).
    Xml,
}

impl ToolCallForm {
    /// The form a chat template's source teaches (XML when it writes `<function=`).
    pub fn of_template(source: &str) -> Self {
        match source.contains("<function=") {
            true => Self::Xml,
            false => Self::Json,
        }
    }
}

/// How a request asked for log-probabilities.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logprobs {
    /// Not asked for.
    Off,
    /// Each token's log-probability and this many alternatives.
    Top(usize),
}

impl Logprobs {
    pub fn on(self) -> bool {
        self != Logprobs::Off
    }

    pub fn top(self) -> usize {
        match self {
            Logprobs::Off => 0,
            Logprobs::Top(k) => k,
        }
    }
}

impl GenerateRequest {
    /// Refuses the fields the server knows but does not serve, naming each.
    pub fn check_supported(&self) -> Result<(), ApiError> {
        let refuse = |param: &str, what: &str| {
            Err(
                ApiError::bad_request(format!("{param}: {what} is not supported by this server"))
                    .param(param),
            )
        };
        if let Some(b) = self.best_of.filter(|&b| b != self.n.unwrap_or(1)) {
            return refuse("best_of", &format!("best_of = {b} (other than n)"));
        }
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return refuse("suffix", "a suffix (fill-in-the-middle)");
        }
        if self.functions.is_some() || self.function_call.is_some() {
            return refuse("functions", "the legacy functions API (use tools)");
        }
        // vLLM's fields this server does not serve, when set to anything but their neutral value.
        let unserved = [(
            self.use_beam_search == Some(true),
            "use_beam_search",
            "beam search",
        )];
        if let Some(&(_, param, what)) = unserved.iter().find(|u| u.0) {
            return refuse(param, what);
        }
        Ok(())
    }

    /// The prompt's ids after `truncate_prompt_tokens` (its last N, `-1` the last `context`),
    /// and whether any were cut.
    pub fn truncate_prompt(&self, prompt: Vec<u32>, context: usize) -> Result<(Vec<u32>, bool), ApiError> {
        let keep = match self.truncate_prompt_tokens {
            None => return Ok((prompt, false)),
            Some(-1) => context,
            Some(k) if k >= 1 && k as u64 <= context as u64 => k as usize,
            Some(k) => {
                return Err(ApiError::bad_request(format!(
                    "truncate_prompt_tokens = {k}: expected -1 (max_model_len) or 1..={context}"
                ))
                .param("truncate_prompt_tokens"))
            }
        };
        match prompt.len().checked_sub(keep) {
            Some(cut) if cut > 0 => Ok((prompt[cut..].to_vec(), true)),
            _ => Ok((prompt, false)),
        }
    }

    /// `allowed_token_ids`, sorted and each once.
    pub fn allowed_ids(&self) -> Vec<u32> {
        let mut ids = self.allowed_token_ids.clone();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// Refuses the fields the endpoint (`chat` or completions) would ignore, naming each, as
    /// OpenAI answers them.
    pub fn check_endpoint(&self, chat: bool) -> Result<(), ApiError> {
        let refuse = |param: &str, msg: &str| Err(ApiError::bad_request(msg).param(param));
        if self.stream_options.is_some() && !self.stream {
            return refuse("stream_options", "stream_options: only with stream: true");
        }
        if chat {
            if self.echo == Some(true) {
                return refuse("echo", "echo: completions only (/v1/completions)");
            }
            return Ok(());
        }
        if self.chat_template.as_ref().is_some_and(|t| !t.is_null()) {
            return refuse(
                "chat_template",
                "chat_template: a chat's (/v1/chat/completions); a completion's prompt is not rendered",
            );
        }
        if self.tools.as_ref().is_some_and(|t| !t.is_empty()) {
            return refuse(
                "tools",
                "tools: tool calls are parsed on /v1/chat/completions only",
            );
        }
        if self.top_logprobs.is_some_and(|k| k > 0) {
            return refuse(
                "top_logprobs",
                "top_logprobs: chat only (/v1/completions takes logprobs: N alternatives)",
            );
        }
        if self.add_generation_prompt.is_some() || self.continue_final_message.is_some() {
            return refuse(
                "continue_final_message",
                "add_generation_prompt and continue_final_message: chat only (/v1/chat/completions)",
            );
        }
        Ok(())
    }

    /// How tool calls are asked for: parsed from the output when tools are given and
    /// `tool_choice` is not `"none"`; `"required"` and a named function are forced by a grammar
    /// ([`Self::tool_grammar`]).
    pub fn tool_choice(&self) -> Result<ToolChoice, ApiError> {
        let tools = self.tools.as_deref().unwrap_or(&[]);
        for (i, t) in tools.iter().enumerate() {
            if t.pointer("/function/name").and_then(Value::as_str).is_none() {
                return Err(ApiError::bad_request(format!(
                    "tools[{i}]: a tool needs {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"
                ))
                .param("tools"));
            }
        }
        let bad = |msg: String| Err(ApiError::bad_request(msg).param("tool_choice"));
        let given = !tools.is_empty();
        let offered = |name: &str| {
            tools
                .iter()
                .any(|t| t.pointer("/function/name") == Some(&json!(name)))
        };
        match &self.tool_choice {
            None | Some(Value::Null) => Ok(if given { ToolChoice::Auto } else { ToolChoice::Off }),
            Some(Value::String(s)) if s == "auto" => Ok(if given { ToolChoice::Auto } else { ToolChoice::Off }),
            Some(Value::String(s)) if s == "none" => Ok(ToolChoice::Off),
            Some(Value::String(s)) if s == "required" => match given {
                true => Ok(ToolChoice::Required),
                false => bad("tool_choice \"required\": no tools are given".into()),
            },
            Some(v) => match v.pointer("/function/name").and_then(Value::as_str) {
                Some(name) if v.get("type") == Some(&json!("function")) && offered(name) => {
                    Ok(ToolChoice::Named(name.to_string()))
                }
                Some(name) if v.get("type") == Some(&json!("function")) => {
                    bad(format!("tool_choice names {name:?}, which is not among the tools"))
                }
                _ => bad(format!(
                    "tool_choice {v}: expected \"auto\", \"none\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"
                )),
            },
        }
    }

    /// The grammar that forces tool calls (`tool_choice` `"required"` or a named function):
    /// `<tool_call>` blocks in the template's `form`, one for a named function or with
    /// `parallel_tool_calls: false`, else one or more. The JSON form holds `{"name": ...,
    /// "arguments": ...}` with each tool's parameter schema (the arguments always an object);
    /// the XML form each tool's parameters (`xml_call`). Keywords llguidance cannot enforce are read
    /// leniently, as the model reads them with `"auto"`.
    pub fn tool_grammar(&self, choice: &ToolChoice, form: ToolCallForm) -> Option<TopLevelGrammar> {
        let only = match choice {
            ToolChoice::Off | ToolChoice::Auto => return None,
            ToolChoice::Required => None,
            ToolChoice::Named(name) => Some(name.as_str()),
        };
        let chosen: Vec<&Value> = self
            .tools
            .iter()
            .flatten()
            .filter(|t| only.is_none_or(|o| t.pointer("/function/name") == Some(&json!(o))))
            .collect();
        let one = self.parallel_tool_calls == Some(false) || only.is_some();
        let more = if one { "" } else { " (\"\\n\" call)*" };
        if form == ToolCallForm::Xml {
            let calls: Vec<String> = (0..chosen.len()).map(|i| format!("call{i}")).collect();
            let mut lark = format!("start: call{more}\ncall: {}\n", calls.join(" | "));
            for (i, t) in chosen.iter().enumerate() {
                lark += &xml_call(i, t);
            }
            return Some(TopLevelGrammar::from_lark(lark));
        }
        let calls: Vec<Value> = chosen
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let name = t.pointer("/function/name").cloned().unwrap_or_default();
                // (Its `#` references resolve against the whole grammar's schema: they get the
                // path to its arguments.)
                let at = match chosen.len() {
                    1 => "#/properties/arguments".to_string(),
                    _ => format!("#/anyOf/{i}/properties/arguments"),
                };
                let params = match t.pointer("/function/parameters") {
                    Some(Value::Object(p)) => {
                        let mut p = Value::Object(p.clone());
                        rebase_refs(&mut p, &at);
                        if let Some(o) = p.as_object_mut() {
                            o.entry("type").or_insert_with(|| json!("object"));
                        }
                        p
                    }
                    // No parameters: an empty object.
                    _ => json!({"type": "object", "properties": {}, "additionalProperties": false}),
                };
                json!({"type": "object", "properties": {"name": {"const": name}, "arguments": params},
                       "required": ["name", "arguments"], "additionalProperties": false})
            })
            .collect();
        let mut schema = match calls.len() {
            1 => calls.into_iter().next().unwrap_or_default(),
            _ => json!({ "anyOf": calls }),
        };
        schema["x-guidance"] = json_options(true);
        let lark =
            format!("start: call{more}\ncall: \"<tool_call>\\n\" %json {schema} \"\\n</tool_call>\"\n");
        Some(TopLevelGrammar::from_lark(lark))
    }

    /// The log-probabilities asked for: chat's `logprobs: bool` + `top_logprobs`, or
    /// completions' `logprobs: N`.
    pub fn logprobs(&self, chat: bool) -> Result<Logprobs, ApiError> {
        let bad = |msg: String| Err(ApiError::bad_request(msg).param("logprobs"));
        let top = |k: usize, name: &str| {
            if k > MAX_TOP_LOGPROBS {
                Err(ApiError::bad_request(format!("{name} = {k}: at most {MAX_TOP_LOGPROBS}")).param(name))
            } else {
                Ok(Logprobs::Top(k))
            }
        };
        if chat {
            match &self.logprobs {
                None | Some(Value::Null) | Some(Value::Bool(false)) => match self.top_logprobs {
                    None | Some(0) => Ok(Logprobs::Off),
                    Some(_) => {
                        Err(ApiError::bad_request("top_logprobs needs logprobs: true").param("top_logprobs"))
                    }
                },
                Some(Value::Bool(true)) => top(self.top_logprobs.unwrap_or(0), "top_logprobs"),
                Some(v) => bad(format!("logprobs {v}: expected true or false")),
            }
        } else {
            match &self.logprobs {
                None | Some(Value::Null) => Ok(Logprobs::Off),
                Some(Value::Number(n)) if n.as_u64().is_some() => {
                    top(n.as_u64().unwrap_or(0) as usize, "logprobs")
                }
                Some(v) => bad(format!(
                    "logprobs {v}: expected the number of alternatives per token"
                )),
            }
        }
    }

    /// vLLM's `prompt_logprobs`: each prompt token's log-probability with this many
    /// alternatives (0..=`MAX_TOP_LOGPROBS`); not streamed (as vLLM refuses it there).
    pub fn prompt_logprobs(&self) -> Result<Option<usize>, ApiError> {
        let bad = |msg: String| Err(ApiError::bad_request(msg).param("prompt_logprobs"));
        match &self.prompt_logprobs {
            None | Some(Value::Null) => Ok(None),
            Some(_) if self.stream => bad("prompt_logprobs: not with stream: true".into()),
            Some(Value::Number(n)) if n.as_u64().is_some_and(|k| k <= MAX_TOP_LOGPROBS as u64) => {
                Ok(n.as_u64().map(|k| k as usize))
            }
            Some(v) => bad(format!(
                "prompt_logprobs {v}: expected the number of alternatives per prompt token, 0..={MAX_TOP_LOGPROBS}"
            )),
        }
    }

    /// OpenAI's `logit_bias` (`{"token id": bias}`, each bias in [-100, 100]) by token id.
    pub fn logit_bias(&self) -> Result<Vec<(u32, f32)>, ApiError> {
        let bad = |msg: String| Err(ApiError::bad_request(msg).param("logit_bias"));
        let mut out = Vec::new();
        for (key, value) in self.logit_bias.iter().flatten() {
            let Ok(id) = key.parse::<u32>() else {
                return bad(format!("logit_bias: key {key:?} is not a token id"));
            };
            match value.as_f64() {
                Some(b) if (-100.0..=100.0).contains(&b) => out.push((id, b as f32)),
                _ => {
                    return bad(format!(
                        "logit_bias[{key:?}] = {value}: a bias must be a number in [-100, 100]"
                    ))
                }
            }
        }
        out.sort_by_key(|&(id, _)| id);
        // ("5" and "05" are one id: two biases would add past the range.)
        if let Some(w) = out.windows(2).find(|w| w[0].0 == w[1].0) {
            return bad(format!("logit_bias: token {} is given twice", w[0].0));
        }
        Ok(out)
    }

    /// The stop strings, bounded in count and length.
    pub fn stop_strings(&self) -> Result<Vec<String>, ApiError> {
        let stops = self.stop.clone().map(Stop::into_vec).unwrap_or_default();
        if stops.len() > MAX_STOP_STRINGS {
            return Err(ApiError::bad_request(format!(
                "stop: {} strings given, at most {MAX_STOP_STRINGS}",
                stops.len()
            ))
            .param("stop"));
        }
        if let Some(s) = stops.iter().find(|s| s.len() > MAX_STOP_BYTES || s.is_empty()) {
            return Err(ApiError::bad_request(format!(
                "stop: a stop string of {} bytes; each must have 1..={MAX_STOP_BYTES}",
                s.len()
            ))
            .param("stop"));
        }
        if self.stop_token_ids.len() > MAX_STOP_IDS {
            return Err(ApiError::bad_request(format!(
                "stop_token_ids: {} given, at most {MAX_STOP_IDS}",
                self.stop_token_ids.len()
            ))
            .param("stop_token_ids"));
        }
        Ok(stops)
    }

    /// The grammar the output must match, if any, with the field that asked for it:
    /// `response_format`'s JSON object or schema, or one of vLLM's `guided_json`, `guided_regex`,
    /// `guided_choice` (at most one of them).
    pub fn grammar(&self) -> Result<Option<(&'static str, TopLevelGrammar)>, ApiError> {
        let bad = |param: &str, msg: String| Err(ApiError::bad_request(msg).param(param));
        let mut found: Vec<(&'static str, TopLevelGrammar)> = Vec::new();
        match &self.response_format {
            None | Some(Value::Null) => {}
            Some(f) => match f.get("type").and_then(Value::as_str) {
                Some("text") => {}
                Some("json_object") => {
                    found.push(("response_format", json_grammar(json!({"type": "object"}))))
                }
                Some("json_schema") => match f.pointer("/json_schema/schema") {
                    Some(schema) if schema.is_object() || schema.is_boolean() => {
                        found.push(("response_format", json_grammar(schema.clone())))
                    }
                    _ => {
                        return bad(
                            "response_format",
                            "response_format json_schema: needs {\"json_schema\": {\"schema\": {...}}}"
                                .into(),
                        )
                    }
                },
                other => {
                    return bad(
                        "response_format",
                        format!(
                            "response_format type {}: expected \"text\", \"json_object\" or \"json_schema\"",
                            other.map_or("missing".into(), |t| format!("{t:?}"))
                        ),
                    )
                }
            },
        }
        // vLLM's `structured_outputs` keys, read as the `guided_*` fields are.
        let (mut json, mut regex, mut choice, mut grammar) = (None, None, None, None);
        for (key, value) in self.structured_outputs.iter().flatten() {
            match (key.as_str(), value) {
                (_, Value::Null) | ("json_object", Value::Bool(false)) => {}
                ("json", v) => json = Some(v.clone()),
                ("regex", v) => regex = Some(v.clone()),
                ("choice", v) => choice = Some(v.clone()),
                ("grammar", v) => grammar = Some(v.clone()),
                ("json_object", Value::Bool(true)) => {
                    found.push(("structured_outputs", json_grammar(json!({"type": "object"}))))
                }
                // Options of vLLM's grammar backends and whitespace, which change no output's
                // meaning (what the schema allows stays allowed and nothing else is).
                ("disable_fallback" | "disable_any_whitespace" | "_backend" | "_backend_was_auto", _)
                | ("disable_additional_properties", Value::Bool(false)) => {}
                (other, _) => {
                    return bad(
                        "structured_outputs",
                        format!(
                            "structured_outputs.{other}: not supported (json, regex, choice, grammar or json_object)"
                        ),
                    )
                }
            }
        }
        let text = |param: &str, v: &Value| match v {
            Value::String(s) => Ok(s.clone()),
            _ => Err(ApiError::bad_request(format!("{param}: expected a string")).param(param)),
        };
        let schemas = [
            ("guided_json", self.guided_json.clone()),
            ("structured_outputs", json),
        ];
        for (param, schema) in schemas {
            let Some(schema) = schema.filter(|s| !s.is_null()) else {
                continue;
            };
            // (A schema may come as its JSON text.)
            let schema = match schema {
                Value::String(text) => match serde_json::from_str::<Value>(&text) {
                    Ok(v) => v,
                    Err(e) => return bad(param, format!("{param}: not JSON: {e}")),
                },
                v => v,
            };
            found.push((param, json_grammar(schema)));
        }
        let regexes = [
            ("guided_regex", self.guided_regex.clone()),
            (
                "structured_outputs",
                regex.map(|v| text("structured_outputs", &v)).transpose()?,
            ),
        ];
        for (param, rx) in regexes {
            if let Some(rx) = rx {
                found.push((param, TopLevelGrammar::from_regex(&rx)));
            }
        }
        let choice_lists = [
            ("guided_choice", self.guided_choice.clone()),
            (
                "structured_outputs",
                match choice {
                    None => None,
                    Some(v) => Some(serde_json::from_value::<Vec<String>>(v).map_err(|_| {
                        ApiError::bad_request("structured_outputs.choice: expected a list of strings")
                            .param("structured_outputs")
                    })?),
                },
            ),
        ];
        for (param, choices) in choice_lists {
            let Some(choices) = choices else {
                continue;
            };
            if choices.is_empty() {
                return bad(param, format!("{param}: at least one choice"));
            }
            let alternatives: Vec<String> = choices.iter().map(|c| regex_escape(c)).collect();
            found.push((param, TopLevelGrammar::from_regex(&alternatives.join("|"))));
        }
        let grammars = [
            ("guided_grammar", self.guided_grammar.clone()),
            ("structured_outputs", grammar),
        ];
        for (param, g) in grammars {
            let Some(g) = g.filter(|g| !g.is_null()) else {
                continue;
            };
            let lark = crate::gbnf::to_lark(&text(param, &g)?)
                .map_err(|e| ApiError::bad_request(format!("{param}: {e}")).param(param))?;
            found.push((param, TopLevelGrammar::from_lark(lark)));
        }
        match found.len() {
            0 => Ok(None),
            1 => Ok(found.pop()),
            _ => {
                let names: Vec<&str> = found.iter().map(|(n, _)| *n).collect();
                bad(
                    names[1],
                    format!(
                        "{}: one structured-output constraint per request",
                        names.join(" and ")
                    ),
                )
            }
        }
    }

    /// The number of choices.
    pub fn choices(&self) -> Result<usize, ApiError> {
        match self.n.unwrap_or(1) {
            0 => Err(ApiError::bad_request("n = 0: at least one choice").param("n")),
            n if n > MAX_CHOICES => Err(ApiError::bad_request(format!(
                "n = {n}: at most {MAX_CHOICES} choices per request"
            ))
            .param("n")),
            n => Ok(n),
        }
    }
}

/// An error answered as OpenAI's error object `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The request field at fault, when one is.
    pub param: Option<String>,
    /// A machine-readable code (`invalid_api_key`, `model_not_found`, ...), when one applies.
    pub code: Option<&'static str>,
    /// Seconds a client should wait before retrying (a full queue).
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// 400: the request is malformed or cannot be served as asked.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// The same error naming the request field at fault.
    pub fn param(mut self, param: &str) -> Self {
        self.param = Some(param.to_string());
        self
    }

    /// The same error with a machine-readable code.
    pub fn code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::SERVICE_UNAVAILABLE => "service_unavailable",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// The error object's JSON.
    pub fn body(&self) -> Value {
        json!({ "error": {
            "message": self.message,
            "type": self.kind(),
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

impl From<axum::extract::rejection::JsonRejection> for ApiError {
    /// A body that is not the JSON asked for (malformed, wrong types, too large, wrong content
    /// type): its status (400, 413, 415 or 422 as 400) and what is wrong.
    fn from(r: axum::extract::rejection::JsonRejection) -> Self {
        let status = match r.status() {
            StatusCode::UNPROCESSABLE_ENTITY => StatusCode::BAD_REQUEST,
            s => s,
        };
        Self::new(status, r.body_text())
    }
}

/// The grammar of JSON matching `schema`, written as Python's `json.dumps` writes it (`", "`
/// and `": "` between items, no other whitespace: a weak or unsure model may otherwise write
/// spaces until `max_tokens`), unless the schema sets llguidance's own `x-guidance` options.
fn json_grammar(mut schema: Value) -> TopLevelGrammar {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance").or_insert_with(|| json_options(false));
    }
    TopLevelGrammar::from_json_schema(schema)
}

/// llguidance's JSON options: written as `json.dumps` writes it; `lenient`: keywords it cannot
/// enforce are ignored rather than refused.
fn json_options(lenient: bool) -> Value {
    json!({ "whitespace_flexible": false, "item_separator": ", ", "key_separator": ": ", "lenient": lenient })
}

/// Every `$ref` in `schema` that points into its own document (`#...`) pointed into it at
/// `at` instead (the schema is nested there in a larger one).
fn rebase_refs(schema: &mut Value, at: &str) {
    match schema {
        Value::Object(o) => {
            for (k, v) in o.iter_mut() {
                match (k.as_str(), v) {
                    ("$ref", Value::String(r)) if r.starts_with('#') => *r = format!("{at}{}", &r[1..]),
                    (_, v) => rebase_refs(v, at),
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(|v| rebase_refs(v, at)),
        _ => {}
    }
}

/// The lark rules `call{i}` (and its parameters' rules) of one call of `tool` in the XML form:
/// its parameters in the schema's order, the required ones always there, each value in the
/// form the output parser reads back as the parameter's type: enums as their values' text,
/// integers, numbers, booleans and null as JSON writes them, objects and arrays as JSON
/// matching their schema, anything else as free text up to `\n</parameter>`.
fn xml_call(i: usize, tool: &Value) -> String {
    let name = tool
        .pointer("/function/name")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let params = tool.pointer("/function/parameters").cloned().unwrap_or_default();
    let required: Vec<&str> = match params.get("required") {
        Some(Value::Array(r)) => r.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    let close = lark_string("\n</parameter>\n");
    let mut rules = String::new();
    let mut body = vec![lark_string(&format!("<tool_call>\n<function={name}>\n"))];
    let props = params.get("properties").and_then(Value::as_object);
    for (j, (pname, schema)) in props.into_iter().flatten().enumerate() {
        let open = lark_string(&format!("<parameter={pname}>\n"));
        let value = match xml_value(schema, &params) {
            Some(v) => format!("{v} {close}"),
            None => {
                // Free text, lazily up to the closing tag (which it then includes).
                rules += &format!("text{i}_{j}[suffix={close}]: /(?s:.*)/\n");
                format!("text{i}_{j}")
            }
        };
        rules += &format!("param{i}_{j}: {open} {value}\n");
        let optional = if required.contains(&pname.as_str()) {
            ""
        } else {
            "?"
        };
        body.push(format!("param{i}_{j}{optional}"));
    }
    body.push(lark_string("</function>\n</tool_call>"));
    rules + &format!("call{i}: {}\n", body.join(" "))
}

/// The lark expression of an XML parameter's value of `schema` (a property of `params`,
/// whose `$defs` its references name), or `None` for free text: written as
/// [`XmlParam`] reads it back.
fn xml_value(schema: &Value, params: &Value) -> Option<String> {
    match XmlParam::of(schema, params) {
        XmlParam::Text => None,
        XmlParam::Enum(values) => {
            let mut texts: Vec<String> = values.iter().map(|v| lark_string(&enum_text(v))).collect();
            for t in values.iter().filter_map(python_text).map(lark_string) {
                if !texts.contains(&t) {
                    texts.push(t);
                }
            }
            Some(format!("({})", texts.join(" | ")))
        }
        XmlParam::Json(types) => {
            // A boolean or null may be written as the chat template writes it too (`True`).
            let python: String = python_values(&types)
                .filter_map(|v| python_text(&v))
                .map(|t| format!(" | {}", lark_string(t)))
                .collect();
            let mut nested = schema.clone();
            if let Some(o) = nested.as_object_mut() {
                for defs in ["$defs", "definitions"] {
                    if let Some(d) = params.get(defs) {
                        o.entry(defs).or_insert_with(|| d.clone());
                    }
                }
                o.insert("x-guidance".into(), json_options(true));
            }
            Some(format!("(%json {nested}{python})"))
        }
    }
}

/// `text` as a lark string literal (JSON's, with DEL escaped too: lark's strings refuse it raw).
fn lark_string(text: &str) -> String {
    Value::String(text.to_string())
        .to_string()
        .replace('\u{7f}', "\\u007f")
}

/// `text` as a regex matching it literally.
fn regex_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guided::Guidance;

    /// Whether `grammar` lets the bundled tokenizer's ids of `text` through, one by one, and
    /// then the end of the turn.
    fn accepts(grammar: TopLevelGrammar, text: &str) -> bool {
        let dir = qwen36_testutil::bundled_dir();
        let tokenizer = qwen36::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
        let end = tokenizer.token_to_id("<|im_end|>").unwrap();
        let spec = Guidance::new(&tokenizer, &[end])
            .unwrap()
            .compile(grammar, None)
            .unwrap();
        let mut c = spec.0.start().unwrap();
        let ids = tokenizer.encode(text, false).unwrap().get_ids().to_vec();
        for t in ids.into_iter().chain([end]) {
            let mut row = vec![0f32; tokenizer.get_vocab_size(true)];
            if c.mask(&mut row).is_err() || row[t as usize] == f32::NEG_INFINITY {
                return false;
            }
            c.consume(&[t]).unwrap();
        }
        true
    }

    /// A forced call in the XML form: parameters in the schema's order, the required ones
    /// there and the optional ones not needed, values of their type (an enum's text, a
    /// `$ref`'d enum, an integer, JSON for an array), free text of several lines up to the
    /// closing tag; the JSON form, a missing required parameter, a value of another type or
    /// an unknown parameter are refused. One call for a named function, several with
    /// `"required"`.
    /// `truncate_prompt_tokens`: the last N ids (all when fewer), `-1` the last `context`; 0,
    /// other negatives and more than the context refused.
    #[test]
    fn prompts_are_truncated_from_the_left() {
        let req = |k: Option<i64>| GenerateRequest {
            truncate_prompt_tokens: k,
            ..Default::default()
        };
        let prompt: Vec<u32> = (0..10).collect();
        let cut = |k, context| req(k).truncate_prompt(prompt.clone(), context);
        assert_eq!(cut(None, 4).unwrap(), (prompt.clone(), false));
        assert_eq!(cut(Some(3), 8).unwrap(), (vec![7, 8, 9], true));
        assert_eq!(cut(Some(-1), 8).unwrap(), ((2..10).collect(), true));
        assert_eq!(cut(Some(-1), 10).unwrap(), (prompt.clone(), false));
        assert_eq!(cut(Some(8), 8).unwrap(), ((2..10).collect(), true));
        assert_eq!(cut(Some(10), 12).unwrap(), (prompt.clone(), false));
        for k in [0, -2, 9, i64::MIN, i64::MAX] {
            let e = cut(Some(k), 8).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("truncate_prompt_tokens"), "{k}");
        }
    }

    #[test]
    fn forced_calls_in_the_xml_form() {
        let tools = json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "required": ["city"],
                "$defs": {"Unit": {"enum": ["c", "f\u{7f}"]},
                          "Place": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                               "unit": {"$ref": "#/$defs/Unit"},
                               "hours": {"type": "array", "items": {"type": "integer"}},
                               "near": {"$ref": "#/$defs/Place"},
                               "max": {"anyOf": [{"type": "number"}, {"type": "null"}]},
                               "kind": {"const": "city"}, "alert": {"type": "boolean"},
                               "flag": {"enum": [false, null]}}}}},
            {"type": "function", "function": {"name": "ping"}},
        ]);
        let req = |choice: Value| GenerateRequest {
            tools: serde_json::from_value(tools.clone()).unwrap(),
            tool_choice: Some(choice),
            ..Default::default()
        };
        let named = req(json!({"type": "function", "function": {"name": "get_weather"}}));
        let grammar = || {
            named
                .tool_grammar(&named.tool_choice().unwrap(), ToolCallForm::Xml)
                .unwrap()
        };
        let call =
            |params: &str| format!("<tool_call>\n<function=get_weather>\n{params}</function>\n</tool_call>");
        let p = |name: &str, value: &str| format!("<parameter={name}>\n{value}\n</parameter>\n");
        let good = [
            call(&p("city", "San José\nby the lake")),
            call(&(p("city", "Zürich") + &p("days", "3") + &p("unit", "f\u{7f}") + &p("hours", "[6, 18]"))),
            call(&(p("city", "Bern") + &p("unit", "c") + &p("near", r#"{"x": -2}"#) + &p("max", "null"))),
            call(&(p("city", "Bern") + &p("max", "2.5") + &p("kind", "city"))),
            // A boolean or null as the chat template writes it (Python's `str()`) or as JSON.
            call(&(p("city", "Bern") + &p("max", "None") + &p("alert", "True") + &p("flag", "False"))),
            call(&(p("city", "Bern") + &p("alert", "false") + &p("flag", "None"))),
            call(&(p("city", "Bern") + &p("flag", "null"))),
        ];
        let typed = [
            json!({"city": "San José\nby the lake"}),
            json!({"city": "Zürich", "days": 3, "unit": "f\u{7f}", "hours": [6, 18]}),
            json!({"city": "Bern", "unit": "c", "near": {"x": -2}, "max": null}),
            json!({"city": "Bern", "max": 2.5, "kind": "city"}),
            json!({"city": "Bern", "max": null, "alert": true, "flag": false}),
            json!({"city": "Bern", "alert": false, "flag": null}),
            json!({"city": "Bern", "flag": null}),
        ];
        let listed = named.tools.clone().unwrap();
        for (text, want) in good.iter().zip(typed) {
            assert!(accepts(grammar(), text), "{text}");
            // The output parser reads each value back as its type.
            let body = &text["<tool_call>\n".len()..text.len() - "\n</tool_call>".len()];
            let (name, args) = crate::output::parse_tool_call(body, &listed).unwrap();
            assert_eq!(name, "get_weather");
            assert_eq!(serde_json::from_str::<Value>(&args).unwrap(), want, "{text}");
        }
        let bad = [
            r#"<tool_call>
{"name": "get_weather", "arguments": {"city": "Bern"}}
</tool_call>"#
                .to_string(),
            call(&p("days", "3")),
            call(&(p("city", "Bern") + &p("days", "three"))),
            call(&(p("city", "Bern") + &p("unit", "kelvin"))),
            call(&(p("unit", "c") + &p("city", "Bern"))),
            call(&(p("city", "Bern") + &p("wind", "yes"))),
            call(&(p("city", "Bern") + &p("near", r#"{"y": 1}"#))),
            call(&(p("city", "Bern") + &p("max", "many"))),
            call(&(p("city", "Bern") + &p("kind", "town"))),
            call(&(p("city", "Bern") + &p("hours", "6, 18"))),
            call(&(p("city", "Bern") + &p("days", "None"))),
            call(&(p("city", "Bern") + &p("alert", "TRUE"))),
            call(&(p("city", "Bern") + &p("alert", "None"))),
            call(&(p("city", "Bern") + &p("flag", "True"))),
            call(&p("city", "Bern")) + "\n" + &call(&p("city", "Basel")),
        ];
        for text in &bad {
            assert!(!accepts(grammar(), text), "{text}");
        }
        let required = req(json!("required"));
        let any = || {
            required
                .tool_grammar(&ToolChoice::Required, ToolCallForm::Xml)
                .unwrap()
        };
        let ping = "<tool_call>\n<function=ping>\n</function>\n</tool_call>";
        assert!(accepts(any(), &format!("{}\n{ping}", good[0])));
        assert!(!accepts(
            any(),
            "<tool_call>\n<function=pong>\n</function>\n</tool_call>"
        ));
        // The JSON form resolves a reference inside an `anyOf` too.
        let optional = GenerateRequest {
            tools: serde_json::from_value(json!([{"type": "function", "function": {"name": "set",
                "parameters": {"$defs": {"Mode": {"enum": ["on", "off"]}}, "required": ["mode"],
                               "properties": {"mode": {"anyOf": [{"$ref": "#/$defs/Mode"}, {"type": "null"}]}}}}}]))
            .unwrap(),
            ..Default::default()
        };
        let json_call =
            |args: &str| format!("<tool_call>\n{{\"name\": \"set\", \"arguments\": {args}}}\n</tool_call>");
        let json_grammar = || {
            optional
                .tool_grammar(&ToolChoice::Named("set".into()), ToolCallForm::Json)
                .unwrap()
        };
        assert!(accepts(json_grammar(), &json_call(r#"{"mode": "on"}"#)));
        assert!(accepts(json_grammar(), &json_call(r#"{"mode": null}"#)));
        assert!(!accepts(json_grammar(), &json_call(r#"{"mode": "up"}"#)));
        // A reference by `$id` (not into the document) is left as it is.
        let by_id = GenerateRequest {
            tools: serde_json::from_value(json!([{"type": "function", "function": {"name": "set",
                "parameters": {"$defs": {"Mode": {"$id": "urn:mode", "enum": ["on", "off"]}},
                               "required": ["mode"], "properties": {"mode": {"$ref": "urn:mode"}}}}}]))
            .unwrap(),
            ..Default::default()
        };
        let id_grammar = || {
            by_id
                .tool_grammar(&ToolChoice::Named("set".into()), ToolCallForm::Json)
                .unwrap()
        };
        assert!(accepts(id_grammar(), &json_call(r#"{"mode": "off"}"#)));
        assert!(!accepts(id_grammar(), &json_call(r#"{"mode": "up"}"#)));
        assert_eq!(ToolCallForm::of_template("x <function=f> y"), ToolCallForm::Xml);
        assert_eq!(
            ToolCallForm::of_template("<tool_call>{\"name\""),
            ToolCallForm::Json
        );
    }
}
