//! An OpenAI-compatible HTTP server on the qwen36 engine: `POST /v1/completions` and
//! `POST /v1/chat/completions` (streamed as server-sent events with `stream: true`; chat output
//! split into `reasoning_content`, `content` and `tool_calls`), `GET /v1/models`, `GET /health`
//! and `GET /metrics` (Prometheus text).
//!
//! The engine runs on its own thread ([`qwen36::engine::Engine::spawn`]); each request's events
//! are awaited (no thread blocks on them) and turned into the response. A client that goes away
//! drops its response, which drops the request's handles, which cancels them: their slots and
//! blocks are freed at the engine's next step.

mod api;
mod gbnf;
mod guided;
mod metrics;
mod output;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, MatchedPath, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use qwen36::engine::{
    EngineClient, EngineStatus, Error as EngineError, Event, OutputConstraint, Request, RequestHandle,
    Speculation, StopReason, Usage,
};
use qwen36::sampling::Sampled;
use qwen36::{ChatTemplate, Generator, SamplingParams};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;

pub use api::{
    ApiError, GenerateRequest, Logprobs, OnePrompt, Prompt, Stop, StreamOptions, ToolCallForm, ToolChoice,
};
pub use metrics::Metrics;
pub use output::{parse_tool_call, Delta, OutputParser, ToolCall};

use metrics::ChoiceTimes;

/// How the server answers.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The name `/v1/models` lists and responses carry.
    pub model_id: String,
    /// When set, every `/v1/*`, `/tokenize` and `/detokenize` request needs `Authorization:
    /// Bearer KEY` (401 otherwise).
    pub api_key: Option<String>,
    /// Speculative decoding for every request (the tokens are the same either way).
    pub speculation: Option<Speculation>,
    /// The largest request body taken (413 past it).
    pub max_body_bytes: usize,
    /// Split chat output's `<think>…</think>` into `reasoning_content` (Qwen3's reasoning
    /// parser); `false` leaves it in `content`.
    pub reasoning: bool,
    /// Render a chat with the request's own `chat_template` where it gives one (vLLM's
    /// `--trust-request-chat-template`); `false` refuses such a request.
    pub trust_request_chat_template: bool,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            model_id: "qwen36".into(),
            api_key: None,
            speculation: None,
            max_body_bytes: 4 << 20,
            reasoning: true,
            trust_request_chat_template: false,
        }
    }
}

/// What every handler shares: the engine's client, the tokenizer and chat template, the model's
/// stop ids and sampling defaults, the metrics.
pub struct Service {
    engine: EngineClient,
    tokenizer: Option<qwen36::Tokenizer>,
    template: Option<ChatTemplate>,
    stop_ids: Vec<u32>,
    defaults: SamplingParams,
    context: usize,
    cfg: ServerConfig,
    metrics: Arc<Metrics>,
    /// The grammar compiler over the tokenizer's vocabulary, built by the first request for
    /// structured output.
    guidance: std::sync::OnceLock<Result<guided::Guidance, String>>,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service").field("cfg", &self.cfg).finish()
    }
}

impl Service {
    /// A service over `engine` (an engine made from `generator`'s model, with its detokenizer)
    /// reading the tokenizer, chat template, stop ids and sampling defaults of `generator`.
    pub fn new(generator: &Generator, engine: EngineClient, cfg: ServerConfig) -> Self {
        let context = engine.context();
        Self::from_parts(
            engine,
            generator.tokenizer().cloned(),
            generator.chat_template().cloned(),
            generator.default_stop_ids(),
            generator.generation_config().sampling.clone().unwrap_or_default(),
            context,
            cfg,
        )
    }

    /// A service from its parts. Without a tokenizer only token-id prompts are served (text
    /// prompts and chat answer 400), as for a model built with random weights in a benchmark.
    pub fn from_parts(
        engine: EngineClient,
        tokenizer: Option<qwen36::Tokenizer>,
        template: Option<ChatTemplate>,
        stop_ids: Vec<u32>,
        defaults: SamplingParams,
        context: usize,
        cfg: ServerConfig,
    ) -> Self {
        let metrics = Arc::new(Metrics::default());
        // Each engine step into the metrics, on a thread of its own (it ends with the engine).
        let (steps, m) = (engine.step_stats(), metrics.clone());
        let watching = std::thread::Builder::new()
            .name("qwen36-step-metrics".into())
            .spawn(move || steps.iter().for_each(|s| m.step(&s)));
        if let Err(e) = watching {
            tracing::warn!("no engine step metrics: {e}");
        }
        Self {
            engine,
            tokenizer,
            template,
            stop_ids,
            defaults,
            context,
            cfg,
            metrics,
            guidance: std::sync::OnceLock::new(),
        }
    }

    /// `grammar` (asked for by field `param`) compiled for each choice's constraint; `thinking`:
    /// the output opens inside a `<think>` block, constrained after it closes.
    fn compile(
        &self,
        param: &str,
        grammar: llguidance::api::TopLevelGrammar,
        thinking: bool,
    ) -> Result<OutputConstraint, ApiError> {
        let tokenizer = self.tokenizer.as_ref().ok_or_else(|| {
            ApiError::bad_request(format!("{param}: structured output needs the model's tokenizer"))
                .param(param)
        })?;
        let guidance = self
            .guidance
            .get_or_init(|| guided::Guidance::new(tokenizer, &self.stop_ids))
            .as_ref()
            .map_err(|e| {
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("structured output: {e}"),
                )
            })?;
        let think_end = thinking.then(|| tokenizer.token_to_id("</think>")).flatten();
        guidance
            .compile(grammar, think_end)
            .map_err(|e| ApiError::bad_request(format!("{param}: {e}")).param(param))
    }

    /// The engine's client (to shut it down after the server).
    pub fn engine(&self) -> &EngineClient {
        &self.engine
    }

    /// The text of token `id` on its own (`token_id:ID` without a tokenizer, as vLLM writes it)
    /// and its bytes: a byte-level BPE token's own bytes (part of a character, possibly), else
    /// the text's.
    /// A token's text and bytes for log-probabilities: `token_id:ID` when `as_id` (vLLM's
    /// `return_tokens_as_token_ids`) or without a tokenizer.
    fn token_text(&self, id: u32, as_id: bool) -> (String, Vec<u8>) {
        let t = match self.tokenizer.as_ref() {
            Some(t) if !as_id => t,
            _ => {
                let text = format!("token_id:{id}");
                let bytes = text.clone().into_bytes();
                return (text, bytes);
            }
        };
        let text = t.decode(&[id], false).unwrap_or_default();
        let bytes = t
            .id_to_token(id)
            .and_then(|piece| output::byte_level_bytes(&piece))
            .unwrap_or_else(|| text.clone().into_bytes());
        (text, bytes)
    }

    fn tokenizer(&self) -> Result<&qwen36::Tokenizer, ApiError> {
        self.tokenizer.as_ref().ok_or_else(|| {
            ApiError::bad_request("this server has no tokenizer: give the prompt as token ids")
                .param("prompt")
        })
    }

    /// Checks `req` and turns it into the engine requests of its choices (tokenizing and
    /// rendering on a blocking thread).
    async fn prepare(
        self: &Arc<Self>,
        endpoint: Endpoint,
        req: GenerateRequest,
        request_id: Option<String>,
    ) -> Result<Job, ApiError> {
        let arrived = Instant::now();
        req.check_supported()?;
        self.check_model(req.model.as_deref())?;
        let chat = endpoint == Endpoint::Chat;
        let n = req.choices()?;
        let logprobs = req.logprobs(chat)?;
        let stop_strings = req.stop_strings()?;
        let tool_choice = req.tool_choice()?;
        let tools = tool_choice != ToolChoice::Off;
        req.check_endpoint(chat)?;
        if req.return_token_ids && n > 1 {
            return Err(ApiError::bad_request("return_token_ids takes one choice (n = 1)").param("n"));
        }
        let svc = self.clone();
        let req = Arc::new(req);
        let r = req.clone();
        let (prompts, thinking, form) = tokio::task::spawn_blocking(move || svc.prompts(endpoint, &r))
            .await
            .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))??;
        // (More than the engine takes at once would be refused as a full queue on every retry.)
        let most = api::MAX_PROMPTS.min(self.engine.capacity());
        if prompts.len() * n > most {
            return Err(ApiError::bad_request(format!(
                "n = {n} choices of {} prompts: one request makes at most {most} (prompts × n)",
                prompts.len(),
            ))
            .param("n"));
        }
        let prompts = prompts
            .into_iter()
            .map(|p| req.truncate_prompt(p, self.context))
            .collect::<Result<Vec<_>, _>>()?;
        let grammar = match (req.grammar()?, req.tool_grammar(&tool_choice, form)) {
            (Some((param, _)), Some(_)) => {
                return Err(ApiError::bad_request(format!(
                    "tool_choice: a forced tool call and {param} at once"
                ))
                .param("tool_choice"))
            }
            (None, Some(forced)) => Some(("tool_choice", forced)),
            (asked, None) => asked,
        };
        let constraint = match grammar {
            None => None,
            // (A finished grammar allows only the end-of-turn ids: they must end the request.)
            Some((param, _)) if req.ignore_eos || req.min_tokens > 0 => {
                let field = if req.ignore_eos {
                    "ignore_eos"
                } else {
                    "min_tokens"
                };
                return Err(ApiError::bad_request(format!(
                    "{field}: not with {param} (a finished grammar ends at the end-of-turn id)"
                ))
                .param(field));
            }
            Some((param, grammar)) => {
                let svc = self.clone();
                let compiled = tokio::task::spawn_blocking(move || svc.compile(param, grammar, thinking))
                    .await
                    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))??;
                Some(compiled)
            }
        };
        let max_tokens = match endpoint {
            Endpoint::Completions => Some(
                req.max_tokens
                    .or(req.max_completion_tokens)
                    .unwrap_or(api::DEFAULT_COMPLETION_TOKENS),
            ),
            Endpoint::Chat => req.max_completion_tokens.or(req.max_tokens),
        };
        if let Some(max) = max_tokens.filter(|&m| req.min_tokens > m) {
            return Err(ApiError::bad_request(format!(
                "min_tokens = {} is over max_tokens = {max}",
                req.min_tokens
            ))
            .param("min_tokens"));
        }
        let echo = req.echo == Some(true);
        if max_tokens == Some(0) && !echo {
            let msg = match endpoint {
                Endpoint::Chat => "max_tokens = 0: a chat completion needs at least one token",
                Endpoint::Completions => {
                    "max_tokens = 0: only with echo: true (the prompt alone, with its log-probabilities)"
                }
            };
            return Err(ApiError::bad_request(msg).param("max_tokens"));
        }
        // Each prompt with its echoed text: as given, or its (kept) ids decoded.
        let given = match (echo, &req.prompt) {
            (true, Some(p)) => p.each()?,
            _ => Vec::new(),
        };
        let prompts = prompts
            .into_iter()
            .enumerate()
            .map(|(i, (ids, truncated))| {
                let echo = match given.get(i) {
                    None => None,
                    Some(OnePrompt::Text(text)) if !truncated => Some(text.to_string()),
                    Some(_) => Some(match &self.tokenizer {
                        Some(t) => decode_all(t, &ids)?,
                        None => String::new(),
                    }),
                };
                Ok(JobPrompt { ids, echo })
            })
            .collect::<Result<Vec<_>, ApiError>>()?;
        // An echo reads the prompt's log-probabilities when they are asked for, and when the
        // prompt alone is run (which needs a reason to run); vLLM's `prompt_logprobs` asks for
        // them with its own count of alternatives.
        let echo_lps = (echo && (logprobs.on() || max_tokens == Some(0))).then(|| logprobs.top());
        let vllm_lps = req.prompt_logprobs()?;
        let prompt_logprobs = match (echo_lps, vllm_lps) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        let d = &self.defaults;
        // vLLM's convention: -1 or 0 turns it off; other negatives are mistakes.
        let top_k = match req.top_k {
            None => d.top_k,
            Some(-1 | 0) => 0,
            Some(k) if k < 0 => {
                return Err(ApiError::bad_request(format!(
                    "top_k = {k}: expected -1 or 0 (off) or a positive count"
                ))
                .param("top_k"))
            }
            Some(k) => k as usize,
        };
        // Without a seed each prompt draws its own (as requests of their own would).
        let seeds: Vec<u64> = prompts
            .iter()
            .map(|_| req.seed.unwrap_or_else(rand::random))
            .collect();
        let sampling = SamplingParams {
            temperature: req.temperature.unwrap_or(d.temperature),
            top_k,
            top_p: req.top_p.unwrap_or(d.top_p),
            min_p: req.min_p.unwrap_or(d.min_p),
            repetition_penalty: req.repetition_penalty.unwrap_or(d.repetition_penalty),
            presence_penalty: req.presence_penalty.unwrap_or(d.presence_penalty),
            frequency_penalty: req.frequency_penalty.unwrap_or(d.frequency_penalty),
            seed: 0, // (each request's, below)
            top_logprobs: logprobs.top(),
            logit_bias: req.logit_bias()?,
            min_tokens: req.min_tokens,
            allowed_ids: req.allowed_ids(),
            bad_words: self.bad_words(&req)?,
        };
        let mut stop_ids = if req.ignore_eos {
            Vec::new()
        } else {
            self.stop_ids.clone()
        };
        stop_ids.extend(&req.stop_token_ids);
        // Prompt p's choice i: samples as a request of that prompt alone with seed + i would.
        let requests = prompts
            .iter()
            .zip(&seeds)
            .flat_map(|(p, &seed)| (0..n as u64).map(move |i| (p, seed, i)))
            .map(|(p, seed, i)| Request {
                // (vLLM's prompt log-probabilities are a prompt's: its first choice reads them
                // for its siblings; an echo's are each choice's.)
                prompt_logprobs: prompt_logprobs.filter(|_| i == 0 || echo_lps.is_some()),
                prompt: p.ids.clone(),
                sampling: SamplingParams {
                    seed: seed.wrapping_add(i),
                    ..sampling.clone()
                },
                max_tokens,
                stop_ids: stop_ids.clone(),
                stop_strings: stop_strings.clone(),
                keep_stop_strings: req.include_stop_str_in_output,
                keep_special_tokens: req.skip_special_tokens == Some(false),
                logprobs: logprobs.on(),
                constraint: constraint.clone(),
                speculation: self.cfg.speculation,
                priority: req.priority,
                degeneration: None,
                stop_on_degeneration: false,
            })
            .collect();
        let request_id = request_id.unwrap_or_else(|| format!("{:016x}", rand::random::<u64>()));
        let id = format!(
            "{}-{request_id}",
            match endpoint {
                Endpoint::Completions => "cmpl",
                Endpoint::Chat => "chatcmpl",
            },
        );
        Ok(Job {
            request_id,
            endpoint,
            parser: ParserSpec {
                reasoning: chat && self.cfg.reasoning,
                thinking,
                tools: tools.then(|| req.tools.clone().unwrap_or_default()),
                one_call: req.parallel_tool_calls == Some(false),
            },
            id,
            created: now(),
            prompts,
            choices_per_prompt: n,
            prompt_logprobs: vllm_lps,
            requests,
            stream: req.stream,
            include_usage: req.stream_options.as_ref().is_some_and(|o| o.include_usage),
            continuous_usage: req
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage && o.continuous_usage_stats),
            logprobs,
            return_token_ids: req.return_token_ids,
            tokens_as_ids: req.return_tokens_as_token_ids == Some(true),
            arrived,
        })
    }

    /// Refuses a request naming another model than the one served.
    fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(model) if model != self.cfg.model_id => Err(ApiError::new(
                StatusCode::NOT_FOUND,
                format!(
                    "model {model:?} is not served here; this server serves {:?}",
                    self.cfg.model_id
                ),
            )
            .param("model")
            .code("model_not_found")),
            _ => Ok(()),
        }
    }

    /// The ids of each prompt (a chat's one), whether the model starts inside an open
    /// `<think>` block, and the tool-call form of the chat template rendered.
    fn prompts(
        &self,
        endpoint: Endpoint,
        req: &GenerateRequest,
    ) -> Result<(Vec<Vec<u32>>, bool, ToolCallForm), ApiError> {
        let form = |t: Option<&ChatTemplate>| {
            t.map_or(ToolCallForm::Json, |t| ToolCallForm::of_template(t.source()))
        };
        match endpoint {
            Endpoint::Completions => match &req.prompt {
                Some(p) => {
                    let ids = p.each()?.into_iter().map(|one| match one {
                        OnePrompt::Text(text) => self.encode(text),
                        OnePrompt::Ids(ids) => Ok(ids.to_vec()),
                    });
                    Ok((
                        ids.collect::<Result<_, _>>()?,
                        false,
                        form(self.template.as_ref()),
                    ))
                }
                None => Err(ApiError::bad_request(
                    "prompt: a text, a list of token ids, or a list of either is needed",
                )
                .param("prompt")),
            },
            Endpoint::Chat => {
                let own = self.request_template(req)?;
                let template = own.as_ref().or(self.template.as_ref());
                let text = self.render(req, template)?;
                Ok((
                    vec![self.encode(&text)?],
                    OutputParser::prompt_is_thinking(generation_prompt(&text)),
                    form(template),
                ))
            }
        }
    }

    /// The request's own `chat_template`, compiled, where it gives one (vLLM's extension, which
    /// the server takes only when it trusts request templates).
    fn request_template(&self, req: &GenerateRequest) -> Result<Option<ChatTemplate>, ApiError> {
        let bad = |msg: String| ApiError::bad_request(msg).param("chat_template");
        let source = match &req.chat_template {
            None | Some(Value::Null) => return Ok(None),
            Some(Value::String(s)) => s,
            Some(_) => return Err(bad("chat_template: expected a string (a Jinja template)".into())),
        };
        if !self.cfg.trust_request_chat_template {
            return Err(bad(
                "chat_template: a template per request is taken only by a server started with \
                 --trust-request-chat-template"
                    .into(),
            ));
        }
        // (With the model's special tokens, as transformers renders a template it is given.)
        let compiled = match &self.template {
            Some(t) => t.with_source(source.as_str()),
            None => ChatTemplate::from_source(source.as_str()),
        };
        compiled.map(Some).map_err(|e| {
            bad(match e {
                qwen36::Error::File { msg, .. } => msg,
                e => format!("chat_template: {e}"),
            })
        })
    }

    /// `template` applied to the request's messages and tools.
    fn render(&self, req: &GenerateRequest, template: Option<&ChatTemplate>) -> Result<String, ApiError> {
        let messages = match &req.messages {
            Some(m) if !m.is_empty() => m,
            _ => {
                return Err(
                    ApiError::bad_request("messages: at least one message is needed").param("messages")
                )
            }
        };
        for (i, m) in messages.iter().enumerate() {
            match m.get("role").and_then(Value::as_str) {
                Some(r) if ROLES.contains(&r) => {}
                Some(r) => {
                    return Err(ApiError::bad_request(format!(
                        "messages[{i}].role {r:?}: expected one of {ROLES:?}"
                    ))
                    .param("messages"))
                }
                None => {
                    return Err(
                        ApiError::bad_request(format!("messages[{i}]: a string role is needed"))
                            .param("messages"),
                    )
                }
            }
            // The model reads text only: an image or audio part would be dropped, or rendered
            // as placeholders with nothing behind them.
            if let Some(parts) = m.get("content").and_then(Value::as_array) {
                for (j, part) in parts.iter().enumerate() {
                    match part.get("type").and_then(Value::as_str) {
                        Some("text") => {}
                        other => {
                            return Err(ApiError::bad_request(format!(
                                "messages[{i}].content[{j}]: a part of type {} (this model reads text parts only)",
                                other.map_or("none".to_string(), |t| format!("{t:?}"))
                            ))
                            .param("messages"))
                        }
                    }
                }
            }
        }
        let template = template
            .ok_or_else(|| ApiError::bad_request("the model has no chat template: use /v1/completions"))?;
        let messages: Vec<Value> = messages
            .iter()
            .cloned()
            .map(|m| Value::Object(with_object_arguments(developer_as_system(m))))
            .collect();
        // vLLM's extensions: an open final message to continue (a prefilled answer), without
        // the generation prompt, which it leaves out unless asked for.
        let continued = req.continue_final_message.unwrap_or(false);
        let generation_prompt = req.add_generation_prompt.unwrap_or(!continued);
        if continued && generation_prompt {
            return Err(ApiError::bad_request(
                "continue_final_message and add_generation_prompt cannot both be true",
            )
            .param("continue_final_message"));
        }
        let text = template
            .render_json(
                &messages,
                req.tools.as_deref(),
                generation_prompt,
                &req.chat_template_kwargs,
            )
            .map_err(|e| ApiError::bad_request(e.to_string()).param("messages"))?;
        if !continued {
            return Ok(text);
        }
        // The rendered prompt ends where the final message's content does (transformers' rule:
        // its last occurrence, else that of its trimmed form).
        let last = messages.last().and_then(|m| m.get("content"));
        let content = match last {
            Some(Value::String(c)) => c.clone(),
            Some(Value::Array(parts)) => parts
                .iter()
                .rev()
                .find_map(|p| p.get("text").and_then(Value::as_str))
                .unwrap_or_default()
                .to_string(),
            _ => String::new(),
        };
        let cut = [content.as_str(), content.trim()]
            .into_iter()
            .filter(|c| !c.is_empty())
            .find_map(|c| text.rfind(c).map(|i| i + c.len()));
        match cut {
            Some(end) => Ok(text[..end].to_string()),
            None => Err(ApiError::bad_request(
                "continue_final_message: the final message needs text content the template renders",
            )
            .param("messages")),
        }
    }

    /// vLLM's `bad_words` as id sequences: each word's ids (leading whitespace dropped), and
    /// those of the word after a space (the word inside a text) where they differ. (vLLM takes
    /// the latter only when they are as many ids: with a byte-level vocabulary, where a word
    /// after a space is often one id and alone two, it would let the word through mid-text.)
    fn bad_words(&self, req: &GenerateRequest) -> Result<Vec<Vec<u32>>, ApiError> {
        let words = req.bad_words.as_deref().unwrap_or_default();
        if words.len() > api::MAX_BAD_WORDS {
            return Err(ApiError::bad_request(format!(
                "bad_words: {} words, at most {}",
                words.len(),
                api::MAX_BAD_WORDS
            ))
            .param("bad_words"));
        }
        let mut out: Vec<Vec<u32>> = Vec::new();
        for word in words {
            let word = word.trim_start();
            if word.is_empty() {
                return Err(ApiError::bad_request("bad_words: an empty word").param("bad_words"));
            }
            let tokenizer = self.tokenizer().map_err(|_| {
                ApiError::bad_request("bad_words: this server has no tokenizer").param("bad_words")
            })?;
            let encode = |text: &str| {
                tokenizer
                    .encode(text, false)
                    .map(|e| e.get_ids().to_vec())
                    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("tokenizer: {e}")))
            };
            let alone = encode(word)?;
            let spaced = encode(&format!(" {word}"))?;
            for ids in [alone, spaced] {
                if !out.contains(&ids) {
                    out.push(ids);
                }
            }
        }
        Ok(out)
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, ApiError> {
        let ids = self
            .tokenizer()?
            .encode(text, false)
            .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("tokenizer: {e}")))?;
        Ok(ids.get_ids().to_vec())
    }

    /// Submits every choice of `job` (all or none: a refused one cancels the others); with
    /// several prompts a refusal of the request names its prompt (`prompt[i]: ...`).
    async fn submit(&self, job: &mut Job) -> Result<Vec<RequestHandle>, ApiError> {
        let mut handles = Vec::with_capacity(job.requests.len());
        for (k, req) in std::mem::take(&mut job.requests).into_iter().enumerate() {
            let named = |e: EngineError| job.named(k, e.to_string());
            let handle = self.engine.submit_async(req).await.map_err(|e| match e {
                EngineError::QueueFull(_) => ApiError {
                    retry_after: Some(1),
                    ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
                },
                EngineError::Stopped | EngineError::Panicked(_) => {
                    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
                }
                EngineError::TooLong { .. } => {
                    ApiError::bad_request(named(e)).code("context_length_exceeded")
                }
                EngineError::Request(_) => ApiError::bad_request(named(e)),
                e => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, named(e)),
            })?;
            handles.push(handle);
        }
        Ok(handles)
    }
}

/// The text after the last assistant turn's start (`<|im_start|>assistant`), where a chat
/// template opens or closes the model's `<think>` block; the whole prompt when it has none.
fn generation_prompt(prompt: &str) -> &str {
    prompt
        .rfind("<|im_start|>assistant")
        .map_or(prompt, |i| &prompt[i..])
}

/// An assistant message whose tool calls give `function.arguments` as a JSON text (as OpenAI
/// clients send them) with the arguments as an object, which chat templates iterate (vLLM does
/// the same); `null` or empty arguments as `{}`; others that are not a JSON object stay as they are.
fn with_object_arguments(mut message: Map<String, Value>) -> Map<String, Value> {
    if let Some(Value::Array(calls)) = message.get_mut("tool_calls") {
        for call in calls {
            let path = if call.pointer("/function/arguments").is_some() {
                "/function/arguments"
            } else {
                "/arguments"
            };
            let args = call.pointer_mut(path);
            if let Some(a) = args {
                // (No arguments, `null` or an empty text, are an empty object, as vLLM reads them.)
                let empty = a.is_null() || a.as_str().is_some_and(|t| t.trim().is_empty());
                if empty {
                    *a = Value::Object(Map::new());
                } else if let Some(obj) = a
                    .as_str()
                    .and_then(|t| serde_json::from_str::<Map<String, Value>>(t).ok())
                {
                    *a = Value::Object(obj);
                }
            }
        }
    }
    message
}

/// The roles a chat message may have (`developer`: OpenAI's newer name of `system`).
const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// A `developer` message as the `system` one it stands for (the chat template knows only that).
fn developer_as_system(mut message: Map<String, Value>) -> Map<String, Value> {
    if message.get("role").and_then(Value::as_str) == Some("developer") {
        message.insert("role".into(), Value::from("system"));
    }
    message
}

/// Which endpoint a request came to (its object names and the shape of its choices).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Completions,
    Chat,
}

impl Endpoint {
    fn name(self) -> &'static str {
        match self {
            Endpoint::Completions => "completions",
            Endpoint::Chat => "chat",
        }
    }
}

/// How a response's output is split ([`OutputParser::new`]'s arguments).
#[derive(Debug, Clone)]
struct ParserSpec {
    reasoning: bool,
    thinking: bool,
    tools: Option<Vec<Value>>,
    /// `parallel_tool_calls: false`: the first call alone is returned (as vLLM does; the
    /// model may still write more, which are dropped).
    one_call: bool,
}

/// A checked request: its engine requests (one per choice) and how to answer.
#[derive(Debug)]
struct Job {
    endpoint: Endpoint,
    parser: ParserSpec,
    /// The client's `X-Request-Id`, or one drawn here: the response's header and its `id`'s end.
    request_id: String,
    id: String,
    created: u64,
    /// The prompts (a chat's one), each with `choices_per_prompt` choices, listed in order:
    /// choice i is prompt i / choices_per_prompt's.
    prompts: Vec<JobPrompt>,
    choices_per_prompt: usize,
    /// vLLM's `prompt_logprobs`: the alternatives each prompt token's entry lists.
    prompt_logprobs: Option<usize>,
    requests: Vec<Request>,
    stream: bool,
    include_usage: bool,
    /// vLLM's `continuous_usage_stats` (with `include_usage`): each chunk carries its choice's
    /// usage so far.
    continuous_usage: bool,
    logprobs: Logprobs,
    return_token_ids: bool,
    /// Log-probabilities name tokens `token_id:ID` (vLLM's `return_tokens_as_token_ids`).
    tokens_as_ids: bool,
    arrived: Instant,
}

/// One prompt of a job.
#[derive(Debug)]
struct JobPrompt {
    ids: Vec<u32>,
    /// Completions' `echo`: the prompt's text, which each of its choices' text starts with.
    echo: Option<String>,
}

/// One choice's output so far.
#[derive(Debug)]
struct Choice {
    parser: OutputParser,
    /// Everything parsed so far (for a whole response).
    message: Delta,
    ids: Vec<u32>,
    /// The prompt's log-probabilities (`echo`), from its second token on.
    prompt_logprobs: Vec<Sampled>,
    logprobs: Vec<Sampled>,
    /// Log-probabilities not yet sent in a chunk.
    unsent_logprobs: Vec<Sampled>,
    /// Characters of the completion's tokens before the next streamed one (`text_offset`).
    text_offset: usize,
    tool_calls: usize,
    /// The most tool calls returned.
    max_tool_calls: usize,
    first_token: Option<Duration>,
    finish: Option<&'static str>,
    usage: Option<Usage>,
    error: Option<String>,
}

/// What one event adds to a choice.
#[derive(Debug, Default)]
struct Update {
    delta: Delta,
    /// The event's token ids.
    ids: Vec<u32>,
    /// Set when the choice has ended.
    finish: Option<&'static str>,
}

impl Choice {
    fn new(spec: &ParserSpec, id: &str, index: usize) -> Self {
        Self {
            parser: OutputParser::new(
                spec.reasoning,
                spec.thinking,
                spec.tools.clone(),
                format!("call-{id}-{index}"),
            ),
            message: Delta::default(),
            ids: Vec::new(),
            prompt_logprobs: Vec::new(),
            logprobs: Vec::new(),
            unsent_logprobs: Vec::new(),
            text_offset: 0,
            tool_calls: 0,
            max_tool_calls: if spec.one_call { 1 } else { usize::MAX },
            first_token: None,
            finish: None,
            usage: None,
            error: None,
        }
    }

    /// Takes the next event (`None`: the engine closed the request without ending it).
    fn apply(&mut self, event: Option<Event>, since: Instant) -> Update {
        let mut up = Update::default();
        match event {
            // (Before any token.)
            Some(Event::Prompt { logprobs }) => {
                self.unsent_logprobs.extend(logprobs.iter().cloned());
                self.prompt_logprobs = logprobs;
            }
            Some(Event::Token { ids, text, logprobs }) => {
                if !ids.is_empty() && self.first_token.is_none() {
                    self.first_token = Some(since.elapsed());
                }
                self.ids.extend(&ids);
                up.ids = ids;
                if let Some(lp) = logprobs {
                    self.logprobs.extend(lp.iter().cloned());
                    self.unsent_logprobs.extend(lp);
                }
                up.delta = self.parser.push(&text);
            }
            Some(Event::Finished { reason, usage }) => {
                up.delta = self.parser.finish();
                self.usage = Some(usage);
                let calls = self.tool_calls + up.delta.tool_calls.len();
                up.finish = Some(match reason {
                    StopReason::MaxTokens | StopReason::ContextFull => "length",
                    StopReason::StopToken(_) | StopReason::StopString(_) if calls > 0 => "tool_calls",
                    StopReason::StopToken(_) | StopReason::StopString(_) | StopReason::Degenerate(_) => {
                        "stop"
                    }
                    StopReason::Cancelled => "abort",
                });
            }
            Some(Event::Failed { error }) => {
                self.error = Some(error);
                up.finish = Some("error");
            }
            None => {
                self.error = Some("the engine stopped before the request ended".into());
                up.finish = Some("error");
            }
        }
        let room = self.max_tool_calls - self.tool_calls;
        up.delta.tool_calls.truncate(room);
        self.tool_calls += up.delta.tool_calls.len();
        self.message.extend(up.delta.clone());
        self.finish = up.finish.or(self.finish);
        up
    }
}

/// Records every choice's end in the metrics, and as `abort` those a dropped response left
/// unfinished.
struct Tracker {
    svc: Arc<Service>,
    arrived: Instant,
    ended: Vec<bool>,
}

impl Tracker {
    fn end(&mut self, index: usize, choice: &Choice) {
        if !std::mem::replace(&mut self.ended[index], true) {
            let times = ChoiceTimes {
                first_token: choice.first_token,
                total: self.arrived.elapsed(),
            };
            let reason = choice.finish.unwrap_or("abort");
            self.svc.metrics.finished(reason, choice.usage.as_ref(), times);
        }
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        for ended in &self.ended {
            if !ended {
                self.svc.metrics.finished("abort", None, ChoiceTimes::default());
            }
        }
    }
}

/// Awaits the events of every handle and sends them, tagged with the handle's index, to one
/// receiver (`None` when a handle closed without a last event). When the receiver is dropped
/// the handles are dropped, which cancels their requests.
fn forward(handles: Vec<RequestHandle>) -> mpsc::UnboundedReceiver<(usize, Option<Event>)> {
    let (tx, rx) = mpsc::unbounded_channel();
    for (i, h) in handles.into_iter().enumerate() {
        let tx = tx.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tx.closed() => return,
                    e = h.recv_async() => {
                        let last = matches!(e, None | Some(Event::Finished { .. } | Event::Failed { .. }));
                        if tx.send((i, e)).is_err() || last {
                            return;
                        }
                    }
                }
            }
        });
    }
    rx
}

/// The usage object of a response: each prompt once, every choice's tokens.
fn usage_json(job: &Job, choices: &[Choice]) -> Value {
    let prompt_tokens = job.prompt_tokens();
    let completion: usize = choices
        .iter()
        .map(|c| c.usage.as_ref().map_or(c.ids.len(), |u| u.completion_tokens))
        .sum();
    // Each choice is a request of its own: per prompt, the most any of its choices was served
    // from the cache.
    let cached: usize = choices
        .chunks(job.choices_per_prompt)
        .map(|cs| {
            cs.iter()
                .filter_map(|c| c.usage.as_ref().map(|u| u.cached_tokens))
                .max()
                .unwrap_or(0)
        })
        .sum();
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": { "cached_tokens": cached },
    })
}

/// vLLM's `prompt_logprobs`: `null` for the first prompt token, then per token an object by
/// token id of `{logprob, rank, decoded_token}`: its `top` most likely ids (ranks 1..=top) and
/// the prompt's own token (its rank).
fn prompt_logprobs_json(svc: &Service, lps: &[Sampled], top: usize) -> Value {
    let entry = |id: u32, lp: f32, rank: Option<u32>| json!({ "logprob": lp, "rank": rank, "decoded_token": svc.token_text(id, false).0 });
    let rows = lps.iter().map(|s| {
        let mut m = Map::new();
        m.insert(s.token.to_string(), entry(s.token, s.logprob, s.rank));
        for (i, &(t, lp)) in s.top_logprobs.iter().take(top).enumerate() {
            m.insert(t.to_string(), entry(t, lp, Some(i as u32 + 1)));
        }
        Value::Object(m)
    });
    Value::Array(std::iter::once(Value::Null).chain(rows).collect())
}

fn tool_calls_json(calls: &[ToolCall], first_index: usize) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                json!({
                    "index": first_index + i,
                    "id": c.id,
                    "type": "function",
                    "function": { "name": c.name, "arguments": c.arguments },
                })
            })
            .collect(),
    )
}

impl Job {
    /// The log-probabilities object of `lps` (chat's `{"content": [...]}` or completions'
    /// token arrays, after `lead`: an echoed prompt's first token, whose entries are null), or
    /// null when none were asked for.
    fn logprobs_json(
        &self,
        svc: &Service,
        lead: Option<u32>,
        lps: &[Sampled],
        text_offset: &mut usize,
    ) -> Value {
        if !self.logprobs.on() || (lps.is_empty() && lead.is_none()) {
            return Value::Null;
        }
        // (An echo's prompt entries may hold more alternatives, for `prompt_logprobs`.)
        let top = self.logprobs.top();
        match self.endpoint {
            Endpoint::Chat => {
                let entry = |id: u32, lp: f32| {
                    let (token, bytes) = svc.token_text(id, self.tokens_as_ids);
                    json!({ "token": token, "logprob": lp, "bytes": bytes })
                };
                let content: Vec<Value> = lps
                    .iter()
                    .map(|s| {
                        let mut e = entry(s.token, s.logprob);
                        e["top_logprobs"] = s
                            .top_logprobs
                            .iter()
                            .take(top)
                            .map(|&(t, lp)| entry(t, lp))
                            .collect();
                        e
                    })
                    .collect();
                json!({ "content": content })
            }
            Endpoint::Completions => {
                let ids = lead.into_iter().chain(lps.iter().map(|s| s.token));
                let tokens: Vec<String> = ids.map(|t| svc.token_text(t, self.tokens_as_ids).0).collect();
                // Offsets count from the completion's start, across chunks.
                let offsets: Vec<usize> = tokens
                    .iter()
                    .map(|t| {
                        let o = *text_offset;
                        *text_offset += t.chars().count();
                        o
                    })
                    .collect();
                let nulls = || lead.map(|_| Value::Null);
                let top: Vec<Value> = nulls()
                    .into_iter()
                    .chain(lps.iter().map(|s| {
                        let m: Map<String, Value> = s
                            .top_logprobs
                            .iter()
                            .take(top)
                            .map(|&(t, lp)| (svc.token_text(t, self.tokens_as_ids).0, json!(lp)))
                            .collect();
                        Value::Object(m)
                    }))
                    .collect();
                let token_logprobs: Vec<Value> = nulls()
                    .into_iter()
                    .chain(lps.iter().map(|s| json!(s.logprob)))
                    .collect();
                json!({
                    "tokens": tokens,
                    "token_logprobs": token_logprobs,
                    "top_logprobs": top,
                    "text_offset": offsets,
                })
            }
        }
    }

    /// Which prompt choice `index` is of (`choices_per_prompt` is at least 1: `n` is checked).
    fn prompt_index(&self, index: usize) -> usize {
        index / self.choices_per_prompt
    }

    /// The prompt whose choice `index` is.
    fn prompt_of(&self, index: usize) -> &JobPrompt {
        &self.prompts[self.prompt_index(index)]
    }

    /// `msg` about choice `index`, naming its prompt when there are several (`prompt[i]: msg`).
    fn named(&self, index: usize, msg: String) -> String {
        if self.prompts.len() > 1 {
            format!("prompt[{}]: {msg}", self.prompt_index(index))
        } else {
            msg
        }
    }

    /// Prompt tokens over every prompt.
    fn prompt_tokens(&self) -> usize {
        self.prompts.iter().map(|p| p.ids.len()).sum()
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
        }
    }

    /// One streamed chunk of choice `index`, or `None` when the update has nothing to send.
    fn chunk(
        &self,
        svc: &Service,
        index: usize,
        choice: &mut Choice,
        up: &Update,
        first: bool,
    ) -> Option<Value> {
        let d = &up.delta;
        let ids = self.return_token_ids && !up.ids.is_empty();
        if d.is_empty() && up.finish.is_none() && !first && !ids {
            return None;
        }
        let unsent = std::mem::take(&mut choice.unsent_logprobs);
        // An echo goes first: the prompt's text and first token.
        let prompt = self.prompt_of(index);
        let echo = prompt.echo.as_deref().filter(|_| first);
        let lead = echo.map(|_| prompt.ids[0]);
        let logprobs = self.logprobs_json(svc, lead, &unsent, &mut choice.text_offset);
        let mut body = match self.endpoint {
            Endpoint::Completions => {
                let text = format!("{}{}", echo.unwrap_or(""), d.content);
                json!({ "index": index, "text": text, "logprobs": logprobs, "finish_reason": up.finish })
            }
            Endpoint::Chat => {
                let mut delta = Map::new();
                if first {
                    delta.insert("role".into(), "assistant".into());
                }
                if !d.reasoning.is_empty() {
                    delta.insert("reasoning_content".into(), d.reasoning.clone().into());
                }
                if !d.content.is_empty() || (first && d.reasoning.is_empty() && d.tool_calls.is_empty()) {
                    delta.insert("content".into(), d.content.clone().into());
                }
                if !d.tool_calls.is_empty() {
                    let before = choice.tool_calls - d.tool_calls.len();
                    delta.insert("tool_calls".into(), tool_calls_json(&d.tool_calls, before));
                }
                json!({ "index": index, "delta": delta, "logprobs": logprobs, "finish_reason": up.finish })
            }
        };
        if self.return_token_ids {
            // vLLM's extension, streamed: each chunk's new ids (a chunk per token even while
            // the text waits, or without a tokenizer).
            body["token_ids"] = json!(up.ids);
        }
        let mut out = json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": svc.cfg.model_id,
            "choices": [body],
        });
        if self.continuous_usage {
            let (p, c) = (prompt.ids.len(), choice.ids.len());
            out["usage"] = json!({ "prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c });
        }
        Some(out)
    }

    /// The whole response once every choice has ended.
    fn response(&self, svc: &Service, choices: &[Choice]) -> Value {
        let list: Vec<Value> = choices
            .iter()
            .enumerate()
            .map(|(index, c)| {
                let prompt = self.prompt_of(index);
                let lead = prompt.echo.as_ref().map(|_| prompt.ids[0]);
                let lps = match prompt.echo {
                    Some(_) => [&c.prompt_logprobs[..], &c.logprobs].concat(),
                    None => c.logprobs.clone(),
                };
                let logprobs = self.logprobs_json(svc, lead, &lps, &mut 0);
                let m = &c.message;
                let mut choice = match self.endpoint {
                    Endpoint::Completions => {
                        let text = format!("{}{}", prompt.echo.as_deref().unwrap_or(""), m.content);
                        json!({ "index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish })
                    }
                    Endpoint::Chat => {
                        let mut message = json!({ "role": "assistant", "content": m.content });
                        if m.content.is_empty() && !m.tool_calls.is_empty() {
                            message["content"] = Value::Null;
                        }
                        if !m.reasoning.is_empty() {
                            message["reasoning_content"] = m.reasoning.clone().into();
                        }
                        if !m.tool_calls.is_empty() {
                            message["tool_calls"] = tool_calls_json(&m.tool_calls, 0);
                        }
                        json!({ "index": index, "message": message, "logprobs": logprobs, "finish_reason": c.finish })
                    }
                };
                if let (Some(k), Endpoint::Completions) = (self.prompt_logprobs, self.endpoint) {
                    let first = &choices[self.prompt_index(index) * self.choices_per_prompt];
                    choice["prompt_logprobs"] = prompt_logprobs_json(svc, &first.prompt_logprobs, k);
                }
                if self.return_token_ids {
                    choice["token_ids"] = json!(c.ids);
                    if self.endpoint == Endpoint::Completions {
                        choice["prompt_token_ids"] = json!(prompt.ids);
                    }
                }
                choice
            })
            .collect();
        let mut out = json!({
            "id": self.id,
            "object": self.object(false),
            "created": self.created,
            "model": svc.cfg.model_id,
            "choices": list,
            "usage": usage_json(self, choices),
        });
        if self.return_token_ids && self.endpoint == Endpoint::Chat {
            out["prompt_token_ids"] = json!(self.prompts[0].ids);
        }
        // (A chat's one prompt: its entries are the same in every choice.)
        if let (Some(k), Endpoint::Chat, Some(c)) = (self.prompt_logprobs, self.endpoint, choices.first()) {
            out["prompt_logprobs"] = prompt_logprobs_json(svc, &c.prompt_logprobs, k);
        }
        out
    }
}

/// Submits `job` and answers: streamed, or once every choice has ended.
async fn run(svc: Arc<Service>, mut job: Job) -> Result<Response, ApiError> {
    let handles = svc.submit(&mut job).await?;
    svc.metrics.admitted(job.endpoint.name(), job.prompt_tokens());
    tracing::info!(
        request = %job.id,
        prompts = job.prompts.len(),
        prompt_tokens = job.prompt_tokens(),
        choices = handles.len(),
        stream = job.stream,
        "submitted"
    );
    let n = handles.len();
    // Tool-call ids: drawn per response (a client's `X-Request-Id` may repeat).
    let calls = format!("{:016x}", rand::random::<u64>());
    let mut choices: Vec<Choice> = (0..n).map(|i| Choice::new(&job.parser, &calls, i)).collect();
    let mut tracker = Tracker {
        svc: svc.clone(),
        arrived: job.arrived,
        ended: vec![false; n],
    };
    let mut events = forward(handles);
    if job.stream {
        let request_id = job.request_id.clone();
        let (tx, rx) = mpsc::unbounded_channel::<Result<SseEvent, Infallible>>();
        tokio::spawn(async move {
            let send = |v: Value| tx.send(Ok(SseEvent::default().data(v.to_string()))).is_ok();
            let mut first = vec![true; n];
            let mut open = n;
            while open > 0 {
                let next = tokio::select! {
                    _ = tx.closed() => None,
                    e = events.recv() => e,
                };
                // The client is gone: dropping `events` cancels the requests.
                let Some((i, event)) = next else { return };
                let up = choices[i].apply(event, job.arrived);
                svc.metrics.generated(up.ids.len());
                if let Some(error) = &choices[i].error {
                    tracker.end(i, &choices[i]);
                    let error = job.named(i, error.clone());
                    let _ = send(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, error).body());
                    let _ = tx.send(Ok(SseEvent::default().data("[DONE]")));
                    return;
                }
                // A choice that ended is counted before its last chunk goes (a client that
                // leaves right then does not turn it into an abort).
                if up.finish.is_some() {
                    tracker.end(i, &choices[i]);
                    open -= 1;
                }
                if let Some(chunk) = job.chunk(&svc, i, &mut choices[i], &up, first[i]) {
                    first[i] = false;
                    if !send(chunk) {
                        return;
                    }
                }
            }
            tracing::info!(request = %job.id, "finished");
            if job.include_usage {
                let _ = send(json!({
                    "id": job.id,
                    "object": job.object(true),
                    "created": job.created,
                    "model": svc.cfg.model_id,
                    "choices": [],
                    "usage": usage_json(&job, &choices),
                }));
            }
            let _ = tx.send(Ok(SseEvent::default().data("[DONE]")));
        });
        let sse = Sse::new(UnboundedReceiverStream::new(rx))
            .keep_alive(KeepAlive::new().interval(Duration::from_secs(5)));
        return Ok(with_request_id(sse.into_response(), &request_id));
    }
    let mut open = n;
    while open > 0 {
        let Some((i, event)) = events.recv().await else {
            break;
        };
        let up = choices[i].apply(event, job.arrived);
        svc.metrics.generated(up.ids.len());
        if up.finish.is_some() {
            tracker.end(i, &choices[i]);
            open -= 1;
        }
        if let Some(error) = &choices[i].error {
            return Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                job.named(i, error.clone()),
            ));
        }
    }
    let completion: usize = choices.iter().map(|c| c.ids.len()).sum();
    tracing::info!(request = %job.id, completion_tokens = completion, "finished");
    Ok(with_request_id(
        Json(job.response(&svc, &choices)).into_response(),
        &job.request_id,
    ))
}

/// The server's routes over `service`.
pub fn router(service: Arc<Service>) -> Router {
    let limit = service.cfg.max_body_bytes;
    let checked = |routes: Router<Arc<Service>>| {
        routes
            .route_layer(middleware::from_fn_with_state(service.clone(), take_body))
            .route_layer(middleware::from_fn_with_state(service.clone(), authorize))
    };
    let v1 = checked(
        Router::new()
            .route("/models", get(models))
            .route("/completions", post(completions))
            .route("/chat/completions", post(chat_completions)),
    );
    let tokens = checked(
        Router::new()
            .route("/tokenize", post(tokenize))
            .route("/detokenize", post(detokenize)),
    );
    Router::new()
        .route("/health", get(health))
        // vLLM's liveness probe for load balancers (SageMaker's `/ping`), as `/health`.
        .route("/ping", get(health).post(health))
        .route("/version", get(version))
        .route("/metrics", get(metrics_text))
        .merge(tokens)
        .nest("/v1", v1)
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such endpoint") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "this endpoint does not take that method",
            )
        })
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn_with_state(service.clone(), count_responses))
        .layer(middleware::from_fn(echo_request_id))
        .with_state(service)
}

/// Serves `router(service)` on `listener` until `shutdown` resolves, then lets the engine finish
/// what it was given.
pub async fn serve(
    listener: tokio::net::TcpListener,
    service: Arc<Service>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = router(service.clone());
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await?;
    let engine = service.engine.clone();
    let _ = tokio::task::spawn_blocking(move || engine.shutdown()).await;
    Ok(())
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Whether two byte strings are equal, in a time that depends on their lengths alone.
fn same_key(given: &[u8], key: &[u8]) -> bool {
    given.len() == key.len() && given.iter().zip(key).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

/// The token of an `Authorization: Bearer TOKEN` header value (the scheme's case is free, as
/// RFC 9110 says).
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim_start_matches(' '))
}

/// Lets a `/v1` or (de)tokenize request through only with the API key (when one is set), before its body is
/// read.
async fn authorize(State(svc): State<Arc<Service>>, req: axum::extract::Request, next: Next) -> Response {
    if let Some(key) = &svc.cfg.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(bearer_token);
        if !given.is_some_and(|g| same_key(g.as_bytes(), key.as_bytes())) {
            drain(req.into_body(), svc.cfg.max_body_bytes.saturating_mul(16)).await;
            return ApiError::new(
                StatusCode::UNAUTHORIZED,
                "a valid API key is needed: Authorization: Bearer KEY",
            )
            .code("invalid_api_key")
            .into_response();
        }
    }
    next.run(req).await
}

/// Reads and drops up to about `cap` bytes of a body that gets an early answer: closing a
/// connection with unread bytes resets it, and a client still sending would lose the answer.
async fn drain(body: axum::body::Body, cap: usize) {
    let mut stream = body.into_data_stream();
    let mut seen = 0;
    while seen <= cap {
        match stream.next().await {
            Some(Ok(bytes)) => seen += bytes.len(),
            _ => break,
        }
    }
}

/// Takes a request's body whole, up to `max_body_bytes`: a larger one is answered 413 once up to
/// 16 times the limit of it is read and dropped (past that the connection closes).
async fn take_body(State(svc): State<Arc<Service>>, req: axum::extract::Request, next: Next) -> Response {
    let limit = svc.cfg.max_body_bytes;
    let (parts, body) = req.into_parts();
    let mut stream = body.into_data_stream();
    let mut whole = Vec::new();
    while let Some(chunk) = stream.next().await {
        let bytes = match chunk {
            Ok(b) => b,
            Err(e) => {
                return ApiError::new(StatusCode::BAD_REQUEST, format!("reading the request body: {e}"))
                    .into_response()
            }
        };
        if whole.len() + bytes.len() > limit {
            let cap = limit.saturating_mul(16);
            drain(axum::body::Body::from_stream(stream), cap).await;
            return ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the request body is over the length limit of {limit} bytes"),
            )
            .into_response();
        }
        whole.extend_from_slice(&bytes);
    }
    next.run(axum::extract::Request::from_parts(parts, whole.into()))
        .await
}

/// Sends a valid `X-Request-Id` a client gave back on every response, errors included (a
/// completion's handler sets its own, drawn when none was given).
async fn echo_request_id(req: axum::extract::Request, next: Next) -> Response {
    let id = client_request_id(req.headers()).ok().flatten();
    let response = next.run(req).await;
    match id {
        Some(id) if !response.headers().contains_key(REQUEST_ID) => with_request_id(response, &id),
        _ => response,
    }
}

/// Counts every response by route and status.
async fn count_responses(
    State(svc): State<Arc<Service>>,
    req: axum::extract::Request,
    next: Next,
) -> Response {
    let route = match req.extensions().get::<MatchedPath>().map(MatchedPath::as_str) {
        Some("/v1/completions") => "completions",
        Some("/v1/chat/completions") => "chat",
        Some("/v1/models") => "models",
        Some("/tokenize") => "tokenize",
        Some("/detokenize") => "detokenize",
        Some("/health") => "health",
        Some("/metrics") => "metrics",
        _ => "other",
    };
    let response = next.run(req).await;
    svc.metrics.response(route, response.status().as_u16());
    response
}

/// `{"version": ...}`: this server's crate version (vLLM's `/version`).
async fn version() -> Response {
    Json(json!({ "version": env!("CARGO_PKG_VERSION") })).into_response()
}

async fn health(State(svc): State<Arc<Service>>) -> Response {
    match svc.engine.status() {
        EngineStatus::Running => "ok".into_response(),
        EngineStatus::Stopped => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped").into_response()
        }
        EngineStatus::Failed(m) => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, format!("the engine failed: {m}")).into_response()
        }
    }
}

async fn metrics_text(State(svc): State<Arc<Service>>) -> Response {
    let load = svc.engine.load();
    let mut text = svc.metrics.render(load, &svc.engine.status(), svc.engine.steps());
    text.push_str(&svc.metrics.render_vllm(load, &svc.cfg.model_id));
    let mut r = text.into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    r
}

async fn models(State(svc): State<Arc<Service>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": svc.cfg.model_id,
            "object": "model",
            "created": now(),
            "owned_by": "qwen36",
            "max_model_len": svc.context,
        }],
    }))
}

/// `X-Request-Id`: the id a client gives its request (vLLM's header), up to 128 visible ASCII
/// characters (empty: none); the response's header carries it back, and its `id` ends with it.
fn client_request_id(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(v) = headers.get(REQUEST_ID).filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    match v.to_str() {
        Ok(id) if (1..=128).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_graphic()) => {
            Ok(Some(id.to_string()))
        }
        _ => Err(ApiError::bad_request(
            "X-Request-Id: expected 1 to 128 visible ASCII characters",
        )),
    }
}

/// The header naming a request (in and out).
const REQUEST_ID: &str = "x-request-id";

/// `response` with its request's `X-Request-Id` header.
fn with_request_id(mut response: Response, id: &str) -> Response {
    if let Ok(v) = HeaderValue::from_str(id) {
        response.headers_mut().insert(REQUEST_ID, v);
    }
    response
}

async fn completions(
    State(svc): State<Arc<Service>>,
    headers: HeaderMap,
    body: Result<Json<GenerateRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body?;
    let job = svc
        .prepare(Endpoint::Completions, req, client_request_id(&headers)?)
        .await?;
    run(svc, job).await
}

async fn chat_completions(
    State(svc): State<Arc<Service>>,
    headers: HeaderMap,
    body: Result<Json<GenerateRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body?;
    let job = svc
        .prepare(Endpoint::Chat, req, client_request_id(&headers)?)
        .await?;
    run(svc, job).await
}

/// vLLM's `/tokenize`: the ids a completion (`prompt`) or chat (`messages`, with its template
/// options) request of the same body would run.
async fn tokenize(
    State(svc): State<Arc<Service>>,
    body: Result<Json<GenerateRequest>, JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    let Json(req) = body?;
    svc.check_model(req.model.as_deref())?;
    let endpoint = match req.messages {
        Some(_) => Endpoint::Chat,
        None => Endpoint::Completions,
    };
    req.check_endpoint(endpoint == Endpoint::Chat)?;
    let s = svc.clone();
    let (mut prompts, _, _) = tokio::task::spawn_blocking(move || s.prompts(endpoint, &req))
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))??;
    if prompts.len() != 1 {
        return Err(
            ApiError::bad_request(format!("prompt: {} prompts; /tokenize takes one", prompts.len()))
                .param("prompt"),
        );
    }
    let ids = prompts.remove(0);
    Ok(Json(json!({
        "count": ids.len(),
        "max_model_len": svc.context,
        "tokens": ids,
    })))
}

/// The body of vLLM's `/detokenize`.
#[derive(Debug, serde::Deserialize)]
struct DetokenizeRequest {
    #[serde(default)]
    model: Option<String>,
    tokens: Vec<u32>,
}

/// vLLM's `/detokenize`: the text of `tokens` (special tokens kept).
async fn detokenize(
    State(svc): State<Arc<Service>>,
    body: Result<Json<DetokenizeRequest>, JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    let Json(req) = body?;
    svc.check_model(req.model.as_deref())?;
    let t = svc.tokenizer.as_ref().ok_or_else(|| {
        ApiError::bad_request("this server has no tokenizer to detokenize with").param("tokens")
    })?;
    if let Some(id) = req.tokens.iter().find(|&&id| t.id_to_token(id).is_none()) {
        return Err(
            ApiError::bad_request(format!("tokens: {id} is not a token of the tokenizer")).param("tokens"),
        );
    }
    Ok(Json(json!({ "prompt": decode_all(t, &req.tokens)? })))
}

/// The text of `ids`, special tokens included (an echoed or detokenized prompt).
fn decode_all(t: &qwen36::Tokenizer, ids: &[u32]) -> Result<String, ApiError> {
    t.decode(ids, false)
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("tokenizer: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only the last assistant turn says whether the model starts thinking: a `<think>` in a
    /// user's text does not.
    #[test]
    fn thinking_is_read_from_the_generation_prompt() {
        let prompt = "<|im_start|>user\nwhat does <think> do?<|im_end|>\n<|im_start|>assistant\n";
        assert!(
            OutputParser::prompt_is_thinking(prompt),
            "the whole prompt would say so"
        );
        assert!(!OutputParser::prompt_is_thinking(generation_prompt(prompt)));
        let thinking = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n";
        assert!(OutputParser::prompt_is_thinking(generation_prompt(thinking)));
        assert_eq!(generation_prompt("no turns"), "no turns");
    }

    /// Tool-call arguments sent as JSON text reach the template as objects, none (`null`, an
    /// empty or blank text) as an empty one; other text stays.
    #[test]
    fn string_tool_arguments_become_objects() {
        let m = json!({"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{\"city\": \"Paris\"}"}},
            {"type": "function", "function": {"name": "g", "arguments": "not json"}},
            {"type": "function", "function": {"name": "h", "arguments": ""}},
            {"type": "function", "function": {"name": "i", "arguments": null}},
            {"type": "function", "function": {"name": "j", "arguments": " "}},
        ]});
        let out = with_object_arguments(m.as_object().unwrap().clone());
        assert_eq!(
            out["tool_calls"][0]["function"]["arguments"],
            json!({"city": "Paris"})
        );
        assert_eq!(out["tool_calls"][1]["function"]["arguments"], "not json");
        for i in 2..5 {
            assert_eq!(out["tool_calls"][i]["function"]["arguments"], json!({}), "{i}");
        }
    }

    #[test]
    fn keys_compare_whole() {
        assert!(same_key(b"sesame", b"sesame"));
        assert!(!same_key(b"sesamf", b"sesame"));
        assert!(!same_key(b"sesam", b"sesame"));
        assert!(!same_key(b"", b"sesame"));
    }

    /// A choice's finish reason follows the engine's stop reason, `tool_calls` when it called a
    /// tool; a request the engine dropped without a last event is an error.
    #[test]
    fn finish_reasons() {
        let spec = ParserSpec {
            reasoning: true,
            thinking: false,
            tools: Some(vec![json!({"type": "function", "function": {"name": "f"}})]),
            one_call: false,
        };
        let t0 = Instant::now();
        let finished = |reason| {
            Some(Event::Finished {
                reason,
                usage: Usage::default(),
            })
        };
        let token = |text: &str| {
            Some(Event::Token {
                ids: vec![1],
                text: text.into(),
                logprobs: None,
            })
        };
        for (reason, text, want) in [
            (StopReason::MaxTokens, "hi", "length"),
            (StopReason::ContextFull, "hi", "length"),
            (StopReason::StopToken(7), "hi", "stop"),
            (StopReason::StopString(0), "hi", "stop"),
            (StopReason::Cancelled, "hi", "abort"),
            (
                StopReason::StopToken(7),
                "<tool_call>{\"name\": \"f\"}</tool_call>",
                "tool_calls",
            ),
            (
                StopReason::MaxTokens,
                "<tool_call>{\"name\": \"f\"}</tool_call>",
                "length",
            ),
        ] {
            let mut c = Choice::new(&spec, "x", 0);
            c.apply(token(text), t0);
            let up = c.apply(finished(reason.clone()), t0);
            assert_eq!(
                (up.finish, c.finish),
                (Some(want), Some(want)),
                "{reason:?} {text}"
            );
            assert!(c.first_token.is_some());
        }
        let mut c = Choice::new(&spec, "x", 0);
        assert_eq!(c.apply(None, t0).finish, Some("error"));
        assert!(c.error.as_deref().unwrap().contains("engine stopped"));
        let mut c = Choice::new(&spec, "x", 0);
        c.apply(Some(Event::Failed { error: "boom".into() }), t0);
        assert_eq!((c.finish, c.error.as_deref()), (Some("error"), Some("boom")));
    }
}
