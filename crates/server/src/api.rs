//! The OpenAI request bodies the server reads and the error object it answers with.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Map, Value};

/// A prompt: text, or token ids (`/v1/completions`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
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
    #[serde(default)]
    pub include_usage: bool,
}

/// The body of `POST /v1/completions` (which needs `prompt`) and `POST /v1/chat/completions`
/// (which needs `messages`): one struct without flattening, so that a field of the wrong type is
/// named in the error. Fields the server does not know are ignored, as OpenAI-compatible servers
/// do.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct GenerateRequest {
    /// `/v1/completions`: text or token ids.
    pub prompt: Option<Prompt>,
    /// `/v1/chat/completions`: OpenAI messages, passed to the chat template as they are (after
    /// the role check).
    pub messages: Option<Vec<Map<String, Value>>>,
    /// Tool schemas for the chat template.
    pub tools: Option<Vec<Value>>,
    /// Chat template kwargs (`enable_thinking` for Qwen3.6).
    #[serde(default)]
    pub chat_template_kwargs: Map<String, Value>,
    /// Return the prompt's and the completion's token ids (vLLM's extension; completions).
    #[serde(default)]
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
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    /// Extra stop token ids (vLLM's extension), besides the model's end-of-turn ids.
    #[serde(default)]
    pub stop_token_ids: Vec<u32>,
    /// Do not stop at the model's end-of-turn ids (vLLM's extension; benchmarks use it).
    #[serde(default)]
    pub ignore_eos: bool,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<usize>,
}

/// An error answered as OpenAI's error object `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
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
            retry_after: None,
        }
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
            "param": null,
            "code": self.status.as_u16(),
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
