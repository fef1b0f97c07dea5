//! Chat templates: the Jinja `chat_template` of tokenizer_config.json rendered with minijinja,
//! set up to render like HF transformers' `apply_chat_template`.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Enumerator, Kwargs, Object, ObjectRepr, Rest, ValueKind};
use minijinja::{AutoEscape, Environment, ErrorKind, Output, State, UndefinedBehavior};
use serde_json::{Map, Value};

use crate::{Error, Result};

/// One chat turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The turn's text.
    pub content: String,
}

impl ChatMessage {
    /// A message with `role` and `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// The special-token names transformers passes to templates (its `SPECIAL_TOKENS_ATTRIBUTES`).
const SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// Template variables set by the renderer itself, which `extra` may not override.
const RESERVED: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

/// A model's chat template (Qwen's is ChatML: `<|im_start|>{role}\n{content}<|im_end|>\n`),
/// or its named templates as transformers picks them: `tool_use` for a request with tools where
/// the model has one, else `default`.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    /// The templates a request can render (`default`, `tool_use`): name, file, source.
    templates: Vec<(String, PathBuf, String)>,
    /// The file and source of the `default` template, else of the first one.
    shown: (PathBuf, String),
    /// Every template name the model has, `default` and `tool_use` among them or not.
    names: Vec<String>,
    /// Named special tokens of the tokenizer config, visible to the template as transformers does.
    special_tokens: Vec<(String, String)>,
    /// The templates compiled once, when they are read, under their names: a syntax error is
    /// found at load, not at the first chat request, and a request renders without parsing.
    env: Arc<Environment<'static>>,
}

/// The names of the templates a request can pick ([`ChatTemplate`]).
const DEFAULT: &str = "default";
const TOOL_USE: &str = "tool_use";

/// Named special tokens of a tokenizer config: (name, token).
type SpecialTokens = Vec<(String, String)>;

/// Named templates: (name, the file holding it, source).
type Named = Vec<(String, PathBuf, String)>;

/// A tokenizer_config.json's `chat_template` (a string: the `default` one, or a list of named
/// templates; a malformed one is an error of its own, which a template given instead makes
/// moot) and its named special tokens.
fn read_tokenizer_config(path: &Path) -> Result<(Result<Named>, SpecialTokens)> {
    let err = |msg: String| Error::File {
        path: path.to_path_buf(),
        msg,
    };
    let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| err(format!("malformed JSON: {e}")))?;
    let special_tokens = SPECIAL_TOKENS
        .iter()
        .filter_map(|&name| {
            // A token is a string or a serialized AddedToken `{"content": ..., ...}`.
            let tok = v.get(name)?;
            let s = tok.as_str().or_else(|| tok.get("content")?.as_str())?;
            Some((name.to_string(), s.to_string()))
        })
        .collect();
    let named = |name: &str, source: &str| (name.to_string(), path.to_path_buf(), source.to_string());
    let templates = match v.get("chat_template") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![named(DEFAULT, s)]),
        Some(Value::Array(list)) => list
            .iter()
            .map(|t| match (t.get("name"), t.get("template")) {
                (Some(Value::String(name)), Some(Value::String(source))) => Ok(named(name, source)),
                _ => Err(err(format!(
                    "chat_template: a list entry is not {{\"name\": string, \"template\": string}}: {t}"
                ))),
            })
            .collect(),
        Some(other) => Err(err(format!(
            "chat_template: expected a string or a list of {{name, template}}, found {other}"
        ))),
    };
    Ok((templates, special_tokens))
}

/// The named templates of a checkpoint directory's files, where it has any: `chat_template.jinja`
/// (`default`) and `additional_chat_templates/NAME.jinja`, as newer transformers save them.
fn read_template_files(dir: &Path) -> Result<Named> {
    let read = |name: &str, path: PathBuf| {
        std::fs::read_to_string(&path)
            .map(|source| (name.to_string(), path.clone(), source))
            .map_err(|e| Error::File {
                path,
                msg: e.to_string(),
            })
    };
    let mut out = Vec::new();
    let default = dir.join("chat_template.jinja");
    if default.exists() {
        out.push(read(DEFAULT, default)?);
    }
    let extra = dir.join("additional_chat_templates");
    if extra.is_dir() {
        let entries = std::fs::read_dir(&extra).map_err(|e| Error::File {
            path: extra.clone(),
            msg: e.to_string(),
        })?;
        let mut files: Vec<PathBuf> = entries
            .filter_map(|e| Some(e.ok()?.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "jinja"))
            .collect();
        files.sort();
        for path in files {
            let name = path
                .file_stem()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned();
            out.push(read(&name, path)?);
        }
    }
    Ok(out)
}

impl ChatTemplate {
    /// Reads `chat_template` from a tokenizer_config.json; `Ok(None)` when it has none.
    pub fn from_tokenizer_config(path: &Path) -> Result<Option<Self>> {
        let (templates, special_tokens) = read_tokenizer_config(path)?;
        Self::compile(templates?, special_tokens)
    }

    /// The templates of a checkpoint directory: `chat_template.jinja` and
    /// `additional_chat_templates/*.jinja` where any exists (where newer transformers save
    /// them), else tokenizer_config.json's `chat_template`; the special tokens from
    /// tokenizer_config.json. `Ok(None)` when none holds one.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>> {
        Self::from_dir_with(dir, None)
    }

    /// [`Self::from_dir`], or with `file` the template of that Jinja file instead of the
    /// directory's (which are then neither compiled nor required to be well formed), with the
    /// directory's special tokens.
    pub fn from_dir_with(dir: &Path, file: Option<&Path>) -> Result<Option<Self>> {
        let config = dir.join("tokenizer_config.json");
        let (in_config, special_tokens) = if config.exists() {
            read_tokenizer_config(&config)?
        } else {
            (Ok(Vec::new()), Vec::new())
        };
        let templates = match file {
            Some(file) => {
                let source = std::fs::read_to_string(file).map_err(|e| Error::File {
                    path: file.to_path_buf(),
                    msg: e.to_string(),
                })?;
                vec![(DEFAULT.to_string(), file.to_path_buf(), source)]
            }
            None => match read_template_files(dir)? {
                files if files.is_empty() => in_config?,
                files => files,
            },
        };
        Self::compile(templates, special_tokens)
    }

    /// Compiles the `default` and `tool_use` templates of `templates` (`None` when there are
    /// none at all; of two of one name, the last, as transformers keeps); a syntax error names
    /// the file and the line. Others are never rendered, and with neither every request fails
    /// as in transformers.
    fn compile(templates: Named, special_tokens: SpecialTokens) -> Result<Option<Self>> {
        let mut named: Named = Vec::with_capacity(templates.len());
        for t in templates {
            match named.iter_mut().find(|(n, _, _)| *n == t.0) {
                Some(seen) => *seen = t,
                None => named.push(t),
            }
        }
        let names: Vec<String> = named.iter().map(|(n, _, _)| n.clone()).collect();
        let mut usable: Named = named
            .iter()
            .filter(|(n, _, _)| n == DEFAULT || n == TOOL_USE)
            .cloned()
            .collect();
        usable.sort_by_key(|(n, _, _)| n != DEFAULT);
        let Some((_, path, source)) = usable.first().or(named.first()) else {
            return Ok(None);
        };
        let shown = (path.clone(), source.clone());
        let mut env = environment().map_err(|e| template_error(path, e))?;
        for (name, path, source) in &usable {
            env.add_template_owned(name.clone(), with_generation_blocks_as_ifs(source))
                .map_err(|e| template_error(path, e))?;
        }
        Ok(Some(Self {
            templates: usable,
            shown,
            names,
            special_tokens,
            env: Arc::new(env),
        }))
    }

    /// The template a request renders: `tool_use` for one with `tools` where the model has it,
    /// else `default` (transformers' `get_chat_template`).
    fn pick(&self, tools: bool) -> Result<&(String, PathBuf, String)> {
        let find = |name: &str| self.templates.iter().find(|(n, _, _)| n == name);
        tools
            .then(|| find(TOOL_USE))
            .flatten()
            .or_else(|| find(DEFAULT))
            .ok_or_else(|| {
                // transformers' message, names as a sorted Python list.
                let mut names: Vec<String> = self.names.iter().map(|n| format!("'{n}'")).collect();
                names.sort();
                Error::File {
                    path: self.path().to_path_buf(),
                    msg: format!(
                        "chat_template: This model has multiple chat templates with no default specified! \
                         Please either pass a chat template or the name of the template you wish to use to \
                         the `chat_template` argument. Available template names are [{}].",
                        names.join(", ")
                    ),
                }
            })
    }

    /// The file the `default` template (else the `tool_use` one, else the first) was read from.
    pub fn path(&self) -> &Path {
        &self.shown.0
    }

    /// The Jinja source of the `default` template (else of the `tool_use` one, else the first).
    pub fn source(&self) -> &str {
        &self.shown.1
    }

    /// The same tokenizer config with another template source, like transformers'
    /// `apply_chat_template(chat_template=...)`; an error where `source` does not compile.
    pub fn with_source(&self, source: impl Into<String>) -> Result<Self> {
        let template = (DEFAULT.to_string(), self.path().to_path_buf(), source.into());
        Self::compile(vec![template], self.special_tokens.clone()).map(|t| t.expect("one template"))
    }

    /// A template of `source` alone, without a checkpoint's special tokens (a request's own:
    /// errors name no file).
    pub fn from_source(source: impl Into<String>) -> Result<Self> {
        let template = (DEFAULT.to_string(), PathBuf::from("chat_template"), source.into());
        Self::compile(vec![template], Vec::new()).map(|t| t.expect("one template"))
    }

    /// Renders `messages`; `add_generation_prompt` opens the assistant turn, `enable_thinking =
    /// false` asks Qwen templates for an empty think block. Same as [`Self::render_json`].
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        enable_thinking: bool,
    ) -> Result<String> {
        let msgs: Vec<Value> = messages
            .iter()
            .map(|m| serde_json::json!({ "role": m.role, "content": m.content }))
            .collect();
        let mut extra = Map::new();
        extra.insert("enable_thinking".into(), Value::Bool(enable_thinking));
        self.render_json(&msgs, None, add_generation_prompt, &extra)
    }

    /// Renders OpenAI-style `messages` (any fields: `tool_calls`, `reasoning_content`, tool
    /// messages, content parts) like transformers' `apply_chat_template(tokenize=False)`.
    ///
    /// `tools` are JSON tool schemas (`None` renders as Jinja `none`); `extra` holds template
    /// kwargs such as `enable_thinking` (an OpenAI `chat_template_kwargs`) and overrides the
    /// config's special tokens. Map keys keep the order of the `serde_json` maps, so callers that
    /// must match transformers on client key order need serde_json's `preserve_order` feature.
    pub fn render_json(
        &self,
        messages: &[Value],
        tools: Option<&[Value]>,
        add_generation_prompt: bool,
        extra: &Map<String, Value>,
    ) -> Result<String> {
        let (name, path, _) = self.pick(tools.is_some())?;
        if let Some(key) = extra.keys().find(|k| RESERVED.contains(&k.as_str())) {
            return Err(Error::File {
                path: path.clone(),
                msg: format!(
                    "chat_template: `{key}` is set by the renderer and cannot be passed as a template kwarg"
                ),
            });
        }
        let mut ctx = JsonMap::default();
        let mut set = |key: &str, value: minijinja::Value| ctx.set(key, value);
        set("messages", to_jinja_seq(messages));
        set("tools", tools.map_or(minijinja::Value::from(()), to_jinja_seq));
        set("documents", minijinja::Value::from(()));
        set(
            "add_generation_prompt",
            minijinja::Value::from(add_generation_prompt),
        );
        for (name, tok) in &self.special_tokens {
            set(name, minijinja::Value::from(tok.as_str()));
        }
        for (key, value) in extra {
            set(key, to_jinja(value));
        }
        let ctx = minijinja::Value::from_object(ctx);

        self.env
            .get_template(name)
            .and_then(|t| t.render(ctx))
            .map_err(|e| template_error(path, e))
    }
}

/// transformers' `{% generation %}…{% endgeneration %}` block (its `AssistantTracker`
/// extension, which marks assistant tokens for training masks and renders the body unchanged)
/// as `{% if true %}…{% endif %}`, which minijinja knows, with the tags' whitespace control
/// (raw blocks left as they are).
fn with_generation_blocks_as_ifs(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let (before, tag) = rest.split_at(start);
        out.push_str(before);
        let body = &tag[2..];
        let control = body.starts_with(['-', '+']) as usize;
        let word = body[control..].trim_start();
        let skipped = body.len() - control - word.len();
        let is = |name: &str| {
            word.strip_prefix(name).is_some_and(|after| {
                let after = after.trim_start();
                after.starts_with("%}") || after.starts_with("-%}") || after.starts_with("+%}")
            })
        };
        if is("raw") {
            // A raw block's text is kept as it is, up to the end of its `endraw` tag.
            let end = body
                .find("endraw")
                .and_then(|i| body[i..].find("%}").map(|j| i + j + 2))
                .unwrap_or(body.len());
            out.push_str("{%");
            out.push_str(&body[..end]);
            rest = &body[end..];
            continue;
        }
        let replacement = [("endgeneration", "endif"), ("generation", "if true")]
            .into_iter()
            .find(|(name, _)| is(name));
        match replacement {
            Some((name, with)) => {
                out.push_str(&tag[..2 + control + skipped]);
                out.push_str(with);
                rest = &body[control + skipped + name.len()..];
            }
            None => {
                out.push_str("{%");
                rest = body;
            }
        }
    }
    out.push_str(rest);
    out
}

/// Maps a minijinja error of the template read from `path`; one from the template's
/// `raise_exception` carries its message.
fn template_error(path: &Path, e: minijinja::Error) -> Error {
    let error = |msg| Error::File {
        path: path.to_path_buf(),
        msg,
    };
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(cur) = src {
        if let Some(raised) = cur.downcast_ref::<Raised>() {
            let line = e.line().map(|l| format!(" (line {l})")).unwrap_or_default();
            return error(format!("chat_template raised an exception: {}{line}", raised.0));
        }
        src = cur.source();
    }
    error(format!("chat_template: {e}"))
}

/// A minijinja environment configured like transformers' `_compile_jinja_template`.
fn environment<'s>() -> std::result::Result<Environment<'s>, minijinja::Error> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()?;
    env.set_syntax(syntax);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_undefined_behavior(UndefinedBehavior::Lenient);
    // HF templates call Python string and dict methods (`.strip()`, `.startswith()`, `.items()`).
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(py_formatter);
    env.add_filter("string", py_string);
    // Jinja's `sequence` test holds for anything with a length and items: also strings and dicts.
    env.add_test("sequence", |v: &minijinja::Value| {
        matches!(
            v.kind(),
            ValueKind::String | ValueKind::Seq | ValueKind::Map | ValueKind::Bytes
        )
    });
    env.add_filter("tojson", tojson);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    Ok(env)
}

/// Marks an error as raised by the template's `raise_exception(message)`.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

/// transformers' `raise_exception`: aborts rendering with the template's message.
fn raise_exception(message: String) -> std::result::Result<minijinja::Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
}

/// transformers' `strftime_now`: the current time formatted with a C `strftime` format (in UTC).
fn strftime_now(format: String) -> String {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    strftime(&format, now.as_secs() as i64, now.subsec_micros())
}

/// Formats the UTC time `secs.micros` since the epoch with the common `strftime` directives
/// (`%a %A %b %B %d %e %f %H %I %j %m %M %p %S %y %Y %%`, `-` flag for no padding); others
/// are kept verbatim.
fn strftime(format: &str, secs: i64, micros: u32) -> String {
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    let (hour, minute, second) = (tod / 3600, tod / 60 % 60, tod % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let day = doy_mar - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(month - 1) as usize] + day + i64::from(leap && month > 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday.
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::new();
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let unpadded = chars.peek() == Some(&'-');
        if unpadded {
            chars.next();
        }
        let num = |out: &mut String, v: i64, width: usize| {
            let _ = if unpadded {
                write!(out, "{v}")
            } else {
                write!(out, "{v:0width$}")
            };
        };
        match chars.next() {
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('b') => out.push_str(&MONTHS[(month - 1) as usize][..3]),
            Some('B') => out.push_str(MONTHS[(month - 1) as usize]),
            Some('d') => num(&mut out, day, 2),
            Some('e') => {
                let _ = write!(out, "{day:2}");
            }
            Some('f') => num(&mut out, i64::from(micros), 6),
            Some('H') => num(&mut out, hour, 2),
            Some('I') => num(&mut out, hour12, 2),
            Some('j') => num(&mut out, yday, 3),
            Some('m') => num(&mut out, month, 2),
            Some('M') => num(&mut out, minute, 2),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('S') => num(&mut out, second, 2),
            Some('y') => num(&mut out, year.rem_euclid(100), 2),
            Some('Y') => num(&mut out, year, 4),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if unpadded {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// A JSON object as a minijinja map that keeps its key order (minijinja's own maps sort keys),
/// its keys indexed so that a lookup does not scan them (a client's object may have many).
#[derive(Debug, Default)]
struct JsonMap {
    entries: Vec<(Arc<str>, minijinja::Value)>,
    index: std::collections::HashMap<Arc<str>, usize>,
}

impl JsonMap {
    /// Sets `key` (in place if it is there, else at the end).
    fn set(&mut self, key: &str, value: minijinja::Value) {
        match self.index.get(key) {
            Some(&i) => self.entries[i].1 = value,
            None => {
                let key: Arc<str> = key.into();
                self.index.insert(key.clone(), self.entries.len());
                self.entries.push((key, value));
            }
        }
    }
}

impl Object for JsonMap {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &minijinja::Value) -> Option<minijinja::Value> {
        let &i = self.index.get(key.as_str()?)?;
        Some(self.entries[i].1.clone())
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Values(
            self.entries
                .iter()
                .map(|(k, _)| minijinja::Value::from(k.clone()))
                .collect(),
        )
    }

    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        Some(self.entries.len())
    }
}

/// Converts JSON to a template value, keeping object key order.
fn to_jinja(v: &Value) -> minijinja::Value {
    match v {
        Value::Null => minijinja::Value::from(()),
        Value::Bool(b) => minijinja::Value::from(*b),
        Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => minijinja::Value::from(i),
            (None, Some(u), _) => minijinja::Value::from(u),
            (None, None, f) => minijinja::Value::from(f.unwrap_or(f64::NAN)),
        },
        Value::String(s) => minijinja::Value::from(s.as_str()),
        Value::Array(items) => to_jinja_seq(items),
        Value::Object(map) => {
            let mut m = JsonMap::default();
            for (k, v) in map {
                m.set(k, to_jinja(v));
            }
            minijinja::Value::from_object(m)
        }
    }
}

fn to_jinja_seq(items: &[Value]) -> minijinja::Value {
    minijinja::Value::from(items.iter().map(to_jinja).collect::<Vec<_>>())
}

/// Writes `{{ value }}` as Python's `str()` would: floats as `repr`, lists and dicts as their
/// Python reprs; everything else as minijinja does (already Python-like: `None`, `True`).
fn py_formatter(
    out: &mut Output,
    state: &mut State,
    value: &minijinja::Value,
) -> std::result::Result<(), minijinja::Error> {
    match value.kind() {
        ValueKind::Number if !value.is_integer() => {
            let f = f64::try_from(value.clone())?;
            out.write_str(&py_float_str(f))?;
            Ok(())
        }
        ValueKind::Seq | ValueKind::Map => {
            let mut s = String::new();
            py_repr(&mut s, value)?;
            out.write_str(&s)?;
            Ok(())
        }
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// Jinja's `string` filter (Python's `str()`), with floats, lists and dicts as [`py_formatter`].
fn py_string(v: &minijinja::Value) -> std::result::Result<minijinja::Value, minijinja::Error> {
    Ok(match v.kind() {
        ValueKind::String => v.clone(),
        ValueKind::Number if !v.is_integer() => {
            minijinja::Value::from(py_float_str(f64::try_from(v.clone())?))
        }
        ValueKind::Seq | ValueKind::Map => {
            let mut s = String::new();
            py_repr(&mut s, v)?;
            minijinja::Value::from(s)
        }
        _ => minijinja::Value::from(v.to_string()),
    })
}

/// Python's `str(float)`: the shortest round-tripping digits, `1e-05` / `1e+16` outside
/// `1e-4 <= |f| < 1e16`, always a `.0` on integral values.
fn py_float_str(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f < 0.0 { "-inf".into() } else { "inf".into() };
    }
    if f == 0.0 {
        return if f.is_sign_negative() {
            "-0.0".into()
        } else {
            "0.0".into()
        };
    }
    // `{:e}` gives the shortest round-trip digits, e.g. "-1.2345e-7".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (neg, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let mut out = String::from(if neg { "-" } else { "" });
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                out.push_str(&"0".repeat(int_len - digits.len()));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..int_len]);
                out.push('.');
                out.push_str(&digits[int_len..]);
            }
        } else {
            out.push_str("0.");
            out.push_str(&"0".repeat((-exp - 1) as usize));
            out.push_str(&digits);
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
    out
}

/// Python's `repr()` of a template value (strings quoted, `[..]`, `(..)`, `{k: v}`).
fn py_repr(out: &mut String, v: &minijinja::Value) -> std::result::Result<(), minijinja::Error> {
    match v.kind() {
        ValueKind::String => py_str_repr(out, v.as_str().unwrap_or_default()),
        ValueKind::Number if !v.is_integer() => out.push_str(&py_float_str(f64::try_from(v.clone())?)),
        ValueKind::Seq => {
            let tuple = v.is_tuple();
            out.push(if tuple { '(' } else { '[' });
            let mut n = 0;
            for (i, item) in v.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(out, &item)?;
                n += 1;
            }
            if tuple && n == 1 {
                out.push(',');
            }
            out.push(if tuple { ')' } else { ']' });
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in v.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(out, &key)?;
                out.push_str(": ");
                py_repr(out, &v.get_item(&key)?)?;
            }
            out.push('}');
        }
        ValueKind::Undefined => out.push_str("Undefined"),
        _ => {
            let _ = write!(out, "{v}");
        }
    }
    Ok(())
}

/// Python's `repr(str)`: single quotes unless the text has `'` and no `"`; non-printable
/// characters escaped (printability approximated: controls, separators and format characters).
fn py_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if !py_printable(c) => {
                let cp = c as u32;
                let _ = match cp {
                    0..=0xff => write!(out, "\\x{cp:02x}"),
                    0x100..=0xffff => write!(out, "\\u{cp:04x}"),
                    _ => write!(out, "\\U{cp:08x}"),
                };
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Approximates Python's `str.isprintable` for one character (no Unicode tables: unassigned
/// code points count as printable).
fn py_printable(c: char) -> bool {
    let cp = c as u32;
    !(c.is_control()
        || matches!(cp, 0xa0 | 0xad | 0x1680 | 0x2000..=0x200f | 0x2028..=0x202f | 0x205f..=0x2064)
        || matches!(cp, 0x2066..=0x206f | 0x3000 | 0xfeff | 0xfff9..=0xfffb | 0xe000..=0xf8ff)
        || matches!(cp, 0x600..=0x605 | 0x61c | 0x6dd | 0x70f | 0x180e | 0xe0001 | 0xe0020..=0xe007f)
        || cp >= 0xf0000)
}

/// transformers' `tojson` filter: `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, arguments by position or keyword, no HTML escaping.
fn tojson(
    value: &minijinja::Value,
    args: Rest<minijinja::Value>,
    kwargs: Kwargs,
) -> std::result::Result<minijinja::Value, minijinja::Error> {
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if args.len() > NAMES.len() {
        return Err(invalid(format!(
            "tojson() takes at most 5 arguments ({} given)",
            args.len() + 1
        )));
    }
    let arg = |i: usize| -> std::result::Result<Option<minijinja::Value>, minijinja::Error> {
        let kw: Option<minijinja::Value> = kwargs.get(NAMES[i])?;
        let pos = args.get(i).cloned();
        if pos.is_some() && kw.is_some() {
            return Err(invalid(format!(
                "tojson() got multiple values for argument '{}'",
                NAMES[i]
            )));
        }
        Ok(pos.or(kw).filter(|v| !v.is_none()))
    };
    let (ensure_ascii, indent, separators, sort_keys) = (arg(0)?, arg(1)?, arg(2)?, arg(3)?);
    let ensure_ascii = ensure_ascii.is_some_and(|v| v.is_true());
    let indent = match indent {
        None => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or_default().to_string()),
        Some(v) if v.is_integer() || v.kind() == ValueKind::Bool => {
            let n =
                i64::try_from(v.clone()).or_else(|_| Ok::<_, minijinja::Error>(i64::from(v.is_true())))?;
            Some(" ".repeat(n.max(0) as usize))
        }
        Some(v) => {
            return Err(invalid(format!(
                "tojson(): indent must be an int or a string, not {}",
                v.kind()
            )))
        }
    };
    let (item_sep, key_sep) = match separators {
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
        Some(v) => {
            let parts: Vec<String> = v
                .try_iter()
                .map_err(|_| invalid("tojson(): separators must be an (item, key) pair".into()))?
                .map(|p| p.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .ok_or_else(|| invalid("tojson(): separators must be strings".into()))?;
            match <[String; 2]>::try_from(parts) {
                Ok([item, key]) => (item, key),
                Err(_) => return Err(invalid("tojson(): separators must be an (item, key) pair".into())),
            }
        }
    };
    let sort_keys = sort_keys.is_some_and(|v| v.is_true());
    kwargs.assert_all_used()?;
    let opts = JsonOpts {
        ensure_ascii,
        indent,
        item_sep,
        key_sep,
        sort_keys,
    };
    let mut out = String::new();
    write_json(&mut out, value, &opts, 0)?;
    Ok(minijinja::Value::from(out))
}

fn invalid(msg: String) -> minijinja::Error {
    minijinja::Error::new(ErrorKind::InvalidOperation, msg)
}

/// `json.dumps` options.
struct JsonOpts {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

/// Python's JSON encoder: `NaN`/`Infinity` allowed, floats as `repr`, empty containers compact.
fn write_json(
    out: &mut String,
    v: &minijinja::Value,
    o: &JsonOpts,
    level: usize,
) -> std::result::Result<(), minijinja::Error> {
    let newline = |out: &mut String, level: usize| {
        if let Some(ind) = &o.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    };
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number if v.is_integer() => {
            let _ = write!(out, "{v}");
        }
        ValueKind::Number => {
            let f = f64::try_from(v.clone())?;
            out.push_str(&if f.is_nan() {
                "NaN".to_string()
            } else if f.is_infinite() {
                if f < 0.0 { "-Infinity" } else { "Infinity" }.to_string()
            } else {
                py_float_str(f)
            });
        }
        ValueKind::String => write_json_str(out, v.as_str().unwrap_or_default(), o.ensure_ascii),
        ValueKind::Seq => {
            let items: Vec<_> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, level + 1);
                write_json(out, item, o, level + 1)?;
            }
            newline(out, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<_> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if o.sort_keys {
                keys.sort();
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, level + 1);
                let name = match key.kind() {
                    ValueKind::String => key.as_str().unwrap_or_default().to_string(),
                    ValueKind::None => "null".into(),
                    ValueKind::Bool => if key.is_true() { "true" } else { "false" }.into(),
                    ValueKind::Number if !key.is_integer() => py_float_str(f64::try_from(key.clone())?),
                    ValueKind::Number => key.to_string(),
                    kind => {
                        return Err(invalid(format!(
                            "keys must be str, int, float, bool or None, not {kind}"
                        )))
                    }
                };
                write_json_str(out, &name, o.ensure_ascii);
                out.push_str(&o.key_sep);
                write_json(out, &v.get_item(key)?, o, level + 1)?;
            }
            newline(out, level);
            out.push('}');
        }
        kind => return Err(invalid(format!("Object of type {kind} is not JSON serializable"))),
    }
    Ok(())
}

/// A JSON string as Python writes it: `\"` `\\` `\n` `\r` `\t` `\b` `\f`, other controls as
/// `\u00XX`; with `ensure_ascii` every non-ASCII character as `\uXXXX` (surrogate pairs above
/// the BMP), lowercase hex.
fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7e) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `{% generation %}` tags in every spelling become an `if` with the same whitespace
    /// control; other tags and text are left alone.
    #[test]
    fn generation_blocks_read_as_ifs() {
        let cases = [
            (
                "{% generation %}a{% endgeneration %}",
                "{% if true %}a{% endif %}",
            ),
            ("{%generation%}a{%endgeneration%}", "{%if true%}a{%endif%}"),
            (
                "x {%- generation -%} a {%+  endgeneration\n%}",
                "x {%- if true -%} a {%+  endif\n%}",
            ),
            (
                "{% generation_id %}{% if generation %}",
                "{% generation_id %}{% if generation %}",
            ),
            (
                "{{ '{%' }} generation %} {% raw",
                "{{ '{%' }} generation %} {% raw",
            ),
            ("no tags {", "no tags {"),
            (
                "{% raw %}{% generation %}{%- endraw %}{% generation %}",
                "{% raw %}{% generation %}{%- endraw %}{% if true %}",
            ),
            ("{%raw%}{% generation %}", "{%raw%}{% generation %}"),
        ];
        for (source, want) in cases {
            assert_eq!(with_generation_blocks_as_ifs(source), want, "{source}");
        }
    }

    #[test]
    fn python_float_str() {
        let cases = [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (-0.0, "-0.0"),
            (1e-7, "1e-07"),
            (1e-4, "0.0001"),
            (1.5e-5, "1.5e-05"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (123.456, "123.456"),
            (0.1 + 0.2, "0.30000000000000004"),
            (-2.5e300, "-2.5e+300"),
        ];
        for (f, want) in cases {
            assert_eq!(py_float_str(f), want, "{f:e}");
        }
    }

    #[test]
    fn strftime_known_instants() {
        assert_eq!(
            strftime("%Y-%m-%d %H:%M:%S %a %A %b %B %j", 0, 0),
            "1970-01-01 00:00:00 Thu Thursday Jan January 001"
        );
        assert_eq!(
            strftime("%d %b %Y, %I:%M %p, %-d/%-m/%y, %f %e %% %q", 1_700_000_000, 42),
            "14 Nov 2023, 10:13 PM, 14/11/23, 000042 14 % %q"
        );
        // 2024-02-29 is day 60 of a leap year.
        assert_eq!(strftime("%Y-%m-%d %j", 1_709_164_800, 0), "2024-02-29 060");
    }
}
