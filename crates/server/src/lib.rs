//! An OpenAI-compatible HTTP server on the qwen36 engine: `POST /v1/completions` and
//! `POST /v1/chat/completions` (streamed as server-sent events with `stream: true`),
//! `GET /v1/models` and `GET /health`.
//!
//! The engine runs on its own thread ([`qwen36::engine::Engine::spawn`]); each request's events
//! are read on a blocking thread of tokio's pool and turned into the response, and a client that
//! goes away cancels its request, which frees its slot and blocks at the engine's next step.

mod api;

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use qwen36::engine::{
    Canceller, EngineClient, Error as EngineError, Event, Request, RequestHandle, Speculation, StopReason,
    Usage, Wait,
};
use qwen36::{ChatTemplate, Generator, SamplingParams};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

pub use api::{ApiError, GenerateRequest, Prompt, Stop, StreamOptions};

/// How the server answers.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The name `/v1/models` lists and responses carry.
    pub model_id: String,
    /// When set, every `/v1/*` request needs `Authorization: Bearer KEY` (401 otherwise).
    pub api_key: Option<String>,
    /// Speculative decoding for every request (the tokens are the same either way).
    pub speculation: Option<Speculation>,
    /// The largest request body taken (413 past it).
    pub max_body_bytes: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            model_id: "qwen36".into(),
            api_key: None,
            speculation: None,
            max_body_bytes: 4 << 20,
        }
    }
}

/// What every handler shares: the engine's client, the tokenizer and chat template, the model's
/// stop ids and sampling defaults.
pub struct Service {
    engine: EngineClient,
    tokenizer: qwen36::Tokenizer,
    template: Option<ChatTemplate>,
    stop_ids: Vec<u32>,
    defaults: SamplingParams,
    cfg: ServerConfig,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service").field("cfg", &self.cfg).finish()
    }
}

impl Service {
    /// A service over `engine` (an engine made from `generator`'s model, with its detokenizer)
    /// reading the tokenizer, chat template, stop ids and sampling defaults of `generator`.
    pub fn new(generator: &Generator, engine: EngineClient, cfg: ServerConfig) -> Result<Self, String> {
        let tokenizer = generator
            .tokenizer()
            .cloned()
            .ok_or("the model has no tokenizer.json: the server needs one")?;
        Ok(Self {
            engine,
            tokenizer,
            template: generator.chat_template().cloned(),
            stop_ids: generator.default_stop_ids(),
            defaults: generator.generation_config().sampling.clone().unwrap_or_default(),
            cfg,
        })
    }

    /// The engine's client (to shut it down after the server).
    pub fn engine(&self) -> &EngineClient {
        &self.engine
    }

    fn authorize(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(key) = &self.cfg.api_key else {
            return Ok(());
        };
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        match given {
            Some(g) if g == key => Ok(()),
            _ => Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "a valid API key is needed: Authorization: Bearer KEY",
            )),
        }
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, ApiError> {
        let ids = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("tokenizer: {e}")))?;
        Ok(ids.get_ids().to_vec())
    }

    /// The engine request of `prompt` under `c`'s parameters (the model's sampling defaults
    /// where `c` gives none).
    fn request(
        &self,
        prompt: Vec<u32>,
        c: &GenerateRequest,
        max_tokens: Option<usize>,
    ) -> Result<Request, ApiError> {
        if let Some(model) = &c.model {
            if model != &self.cfg.model_id {
                return Err(ApiError::new(
                    StatusCode::NOT_FOUND,
                    format!(
                        "model {model:?} is not served here; this server serves {:?}",
                        self.cfg.model_id
                    ),
                ));
            }
        }
        if let Some(n) = c.n.filter(|&n| n != 1) {
            return Err(ApiError::bad_request(format!(
                "n = {n}: only one choice per request is served"
            )));
        }
        let d = &self.defaults;
        let top_k = match c.top_k {
            None => d.top_k,
            Some(k) if k <= 0 => 0,
            Some(k) => k as usize,
        };
        let sampling = SamplingParams {
            temperature: c.temperature.unwrap_or(d.temperature),
            top_k,
            top_p: c.top_p.unwrap_or(d.top_p),
            min_p: c.min_p.unwrap_or(d.min_p),
            repetition_penalty: c.repetition_penalty.unwrap_or(d.repetition_penalty),
            presence_penalty: c.presence_penalty.unwrap_or(d.presence_penalty),
            frequency_penalty: c.frequency_penalty.unwrap_or(d.frequency_penalty),
            seed: c.seed.unwrap_or(0),
            top_logprobs: 0,
        };
        let mut stop_ids = if c.ignore_eos {
            Vec::new()
        } else {
            self.stop_ids.clone()
        };
        stop_ids.extend(&c.stop_token_ids);
        Ok(Request {
            prompt,
            sampling,
            max_tokens,
            stop_ids,
            stop_strings: c.stop.clone().map(Stop::into_vec).unwrap_or_default(),
            logprobs: false,
            speculation: self.cfg.speculation,
        })
    }

    /// Submits `req` (from a blocking thread: the engine answers between its steps).
    async fn submit(self: &Arc<Self>, req: Request) -> Result<RequestHandle, ApiError> {
        let svc = self.clone();
        let submitted = tokio::task::spawn_blocking(move || svc.engine.submit(req))
            .await
            .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
        submitted.map_err(|e| match e {
            EngineError::QueueFull(_) => ApiError {
                retry_after: Some(1),
                ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
            },
            EngineError::Stopped => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
            EngineError::Request(_) | EngineError::TooLong { .. } => ApiError::bad_request(e.to_string()),
            e => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        })
    }
}

/// The server's routes over `service`.
pub fn router(service: Arc<Service>) -> Router {
    let limit = service.cfg.max_body_bytes;
    Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such endpoint") })
        .layer(DefaultBodyLimit::max(limit))
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

async fn models(State(svc): State<Arc<Service>>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    svc.authorize(&headers)?;
    Ok(Json(json!({
        "object": "list",
        "data": [{ "id": svc.cfg.model_id, "object": "model", "created": now(), "owned_by": "qwen36" }],
    })))
}

/// Which endpoint a response is for (its object names and the shape of its choices).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

/// What a finished request's response needs.
#[derive(Debug, Default)]
struct Outcome {
    text: String,
    ids: Vec<u32>,
    reason: Option<StopReason>,
    usage: Usage,
}

fn finish_reason(reason: &Option<StopReason>) -> &'static str {
    match reason {
        Some(StopReason::MaxTokens | StopReason::ContextFull) => "length",
        Some(StopReason::StopToken(_) | StopReason::StopString(_)) | None => "stop",
        Some(StopReason::Cancelled) => "abort",
    }
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

/// Cancels its request when dropped unless disarmed: a client that goes away mid-request (its
/// handler's future dropped) frees the request's slot.
struct CancelOnDrop(Option<Canceller>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(c) = self.0.take() {
            c.cancel();
        }
    }
}

/// Waits on a blocking thread for every event of `handle`.
async fn collect(handle: RequestHandle) -> Result<Outcome, ApiError> {
    let mut guard = CancelOnDrop(Some(handle.canceller()));
    let outcome = tokio::task::spawn_blocking(move || {
        let mut out = Outcome::default();
        while let Some(event) = handle.recv() {
            match event {
                Event::Token { ids, text, .. } => {
                    out.ids.extend(ids);
                    out.text.push_str(&text);
                }
                Event::Finished { reason, usage } => {
                    out.reason = Some(reason);
                    out.usage = usage;
                    return Ok(out);
                }
                Event::Failed { error } => return Err(error),
            }
        }
        Err("the engine dropped the request".to_string())
    })
    .await
    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    guard.0 = None;
    outcome.map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e))
}

/// One streamed response: chunks in OpenAI's format as the request's events arrive, a last
/// chunk with the finish reason (and one with the usage when asked), then `[DONE]`.
struct Streamer {
    kind: Kind,
    id: String,
    model: String,
    created: u64,
    include_usage: bool,
    first: bool,
}

impl Streamer {
    fn chunk(&self, text: &str, role: bool, finish: Option<&str>) -> Value {
        let choice = match self.kind {
            Kind::Completion => {
                json!({ "index": 0, "text": text, "logprobs": null, "finish_reason": finish })
            }
            Kind::Chat => {
                let mut delta = Map::new();
                if role {
                    delta.insert("role".into(), "assistant".into());
                }
                if !text.is_empty() || finish.is_none() {
                    delta.insert("content".into(), text.into());
                }
                json!({ "index": 0, "delta": delta, "logprobs": null, "finish_reason": finish })
            }
        };
        json!({
            "id": self.id,
            "object": match self.kind { Kind::Completion => "text_completion", Kind::Chat => "chat.completion.chunk" },
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        })
    }

    /// The SSE events of one engine event.
    fn events(&mut self, event: Event) -> Vec<Value> {
        match event {
            Event::Token { text, .. } if text.is_empty() && !self.first => Vec::new(),
            Event::Token { text, .. } => {
                let role = std::mem::replace(&mut self.first, false);
                vec![self.chunk(&text, role, None)]
            }
            Event::Finished { reason, usage } => {
                let role = std::mem::replace(&mut self.first, false);
                let mut out = vec![self.chunk("", role, Some(finish_reason(&Some(reason))))];
                if self.include_usage {
                    let mut last = self.chunk("", false, None);
                    last["choices"] = json!([]);
                    last["usage"] = usage_json(&usage);
                    out.push(last);
                }
                out
            }
            Event::Failed { error } => {
                vec![ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, error).body()]
            }
        }
    }
}

/// How often a streaming request's thread looks whether its client is still there.
const CLIENT_CHECK: Duration = Duration::from_millis(100);

/// Streams `handle`'s events as server-sent events; a client that goes away cancels the request
/// (noticed within [`CLIENT_CHECK`], or at its next event).
fn stream(handle: RequestHandle, mut streamer: Streamer) -> Response {
    let (tx, rx) = mpsc::unbounded_channel::<Result<SseEvent, std::convert::Infallible>>();
    tokio::task::spawn_blocking(move || loop {
        match handle.wait(CLIENT_CHECK) {
            Wait::Event(event) => {
                for chunk in streamer.events(event) {
                    if tx.send(Ok(SseEvent::default().data(chunk.to_string()))).is_err() {
                        handle.cancel();
                        return;
                    }
                }
            }
            Wait::TimedOut if tx.is_closed() => {
                handle.cancel();
                return;
            }
            Wait::TimedOut => {}
            Wait::Closed => {
                let _ = tx.send(Ok(SseEvent::default().data("[DONE]")));
                return;
            }
        }
    });
    Sse::new(UnboundedReceiverStream::new(rx))
        .keep_alive(KeepAlive::default())
        .into_response()
}

async fn completions(
    State(svc): State<Arc<Service>>,
    headers: HeaderMap,
    body: Result<Json<GenerateRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    svc.authorize(&headers)?;
    let Json(req) = body?;
    let prompt = match &req.prompt {
        Some(Prompt::Text(text)) => svc.encode(text)?,
        Some(Prompt::Ids(ids)) => ids.clone(),
        None => {
            return Err(ApiError::bad_request(
                "prompt: a text or a list of token ids is needed",
            ))
        }
    };
    let engine_req = svc.request(prompt, &req, req.max_tokens)?;
    respond(&svc, Kind::Completion, engine_req, &req).await
}

/// The roles a chat message may have.
const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

async fn chat_completions(
    State(svc): State<Arc<Service>>,
    headers: HeaderMap,
    body: Result<Json<GenerateRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    svc.authorize(&headers)?;
    let Json(req) = body?;
    let messages = match &req.messages {
        Some(m) if !m.is_empty() => m,
        _ => return Err(ApiError::bad_request("messages: at least one message is needed")),
    };
    for (i, m) in messages.iter().enumerate() {
        match m.get("role").and_then(Value::as_str) {
            Some(r) if ROLES.contains(&r) => {}
            Some(r) => {
                return Err(ApiError::bad_request(format!(
                    "messages[{i}].role {r:?}: expected one of {ROLES:?}"
                )))
            }
            None => {
                return Err(ApiError::bad_request(format!(
                    "messages[{i}]: a string role is needed"
                )))
            }
        }
    }
    let template = svc
        .template
        .as_ref()
        .ok_or_else(|| ApiError::bad_request("the model has no chat template: use /v1/completions"))?;
    let messages: Vec<Value> = messages.iter().cloned().map(Value::Object).collect();
    let text = template
        .render_json(&messages, req.tools.as_deref(), true, &req.chat_template_kwargs)
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let prompt = svc.encode(&text)?;
    let max_tokens = req.max_completion_tokens.or(req.max_tokens);
    let engine_req = svc.request(prompt, &req, max_tokens)?;
    respond(&svc, Kind::Chat, engine_req, &req).await
}

/// Submits `req` and answers: streamed, or once it has finished.
async fn respond(
    svc: &Arc<Service>,
    kind: Kind,
    req: Request,
    c: &GenerateRequest,
) -> Result<Response, ApiError> {
    let prompt = req.prompt.clone();
    let handle = svc.submit(req).await?;
    let id = match kind {
        Kind::Completion => format!("cmpl-{}", handle.id()),
        Kind::Chat => format!("chatcmpl-{}", handle.id()),
    };
    tracing::info!(request = %id, prompt_tokens = prompt.len(), stream = c.stream, "submitted");
    let created = now();
    if c.stream {
        let streamer = Streamer {
            kind,
            id,
            model: svc.cfg.model_id.clone(),
            created,
            include_usage: c.stream_options.as_ref().is_some_and(|o| o.include_usage),
            first: true,
        };
        return Ok(stream(handle, streamer));
    }
    let out = collect(handle).await?;
    tracing::info!(request = %id, completion_tokens = out.usage.completion_tokens, "finished");
    let finish = finish_reason(&out.reason);
    let choice = match kind {
        Kind::Completion => {
            let mut choice =
                json!({ "index": 0, "text": out.text, "logprobs": null, "finish_reason": finish });
            if c.return_token_ids {
                choice["prompt_token_ids"] = json!(prompt);
                choice["token_ids"] = json!(out.ids);
            }
            choice
        }
        Kind::Chat => json!({
            "index": 0,
            "message": { "role": "assistant", "content": out.text },
            "logprobs": null,
            "finish_reason": finish,
        }),
    };
    let object = match kind {
        Kind::Completion => "text_completion",
        Kind::Chat => "chat.completion",
    };
    Ok(Json(json!({
        "id": id,
        "object": object,
        "created": created,
        "model": svc.cfg.model_id,
        "choices": [choice],
        "usage": usage_json(&out.usage),
    }))
    .into_response())
}
