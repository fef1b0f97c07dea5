//! The server on 127.0.0.1 (a port of its own per test) with the bundled model on the CPU,
//! driven over HTTP: results against the `Generator`, streaming against non-streaming, many
//! requests at once against each alone, cancellation by disconnecting, and the error answers.

use std::sync::Arc;
use std::time::{Duration, Instant};

use qwen36::engine::{Engine, EngineConfig};
use qwen36::{GenerateOptions, Generator, LoadOptions, SamplingParams};
use qwen36_server::{ServerConfig, Service};
use serde_json::{json, Value};

/// A running server: its base URL and the sender that shuts it down.
struct Server {
    url: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Server {
    async fn start(engine_cfg: EngineConfig, cfg: ServerConfig) -> (Self, Generator) {
        let generator = Generator::load(qwen36_testutil::bundled_dir(), LoadOptions::default()).unwrap();
        let engine = Engine::new(generator.model().clone(), engine_cfg)
            .unwrap()
            .with_detokenizer(generator.detokenizer().unwrap());
        let service = Arc::new(Service::new(&generator, engine.spawn(), cfg).unwrap());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            qwen36_server::serve(listener, service, async {
                let _ = rx.await;
            })
            .await
            .unwrap();
        });
        let server = Self {
            url,
            stop: Some(tx),
            task: Some(task),
        };
        (server, generator)
    }

    async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let r = reqwest::Client::new()
            .post(format!("{}{path}", self.url))
            .json(body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap())
    }

    /// The `data:` payloads of a streamed response, `[DONE]` included.
    async fn stream(&self, path: &str, body: &Value) -> Vec<String> {
        let mut r = reqwest::Client::new()
            .post(format!("{}{path}", self.url))
            .json(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let mut text = String::new();
        while let Some(chunk) = r.chunk().await.unwrap() {
            text.push_str(std::str::from_utf8(&chunk).unwrap());
        }
        text.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(str::to_string)
            .collect()
    }

    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.task.take().unwrap().await.unwrap();
    }
}

/// The streamed text of a response's chunks (completion `text` or chat `delta.content`).
fn streamed_text(events: &[String]) -> String {
    events
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str::<Value>(e).unwrap())
        .filter_map(|v| {
            let c = v["choices"].get(0)?.clone();
            Some(
                c["text"]
                    .as_str()
                    .or(c["delta"]["content"].as_str())
                    .unwrap_or("")
                    .to_string(),
            )
        })
        .collect()
}

/// The `Generator`'s greedy tokens (with `penalty` as the repetition penalty).
fn greedy(generator: &Generator, prompt: &[u32], n: usize, penalty: f32) -> Vec<u32> {
    let opts = GenerateOptions {
        max_new_tokens: n,
        sampling: Some(SamplingParams {
            repetition_penalty: penalty,
            ..SamplingParams::default()
        }),
        ..GenerateOptions::default()
    };
    generator.generate(prompt, &opts, |_| {}).unwrap().tokens
}

/// Completions given as token ids return the `Generator`'s greedy ids and their text; a text
/// prompt is its encoding; parameters a request leaves out come from generation_config.json (the
/// bundled model's repetition penalty 1.05); chat completions render the template; many requests
/// at once each return what they return alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_equal_the_generator_alone_and_at_once() {
    let cfg = EngineConfig {
        max_seqs: 4,
        ..EngineConfig::default()
    };
    let (server, generator) = Server::start(cfg, ServerConfig::default()).await;
    let prompt = generator.encode("def fibonacci(n):").unwrap();
    let want = greedy(&generator, &prompt, 12, 1.0);
    let body = json!({ "prompt": prompt, "max_tokens": 12, "temperature": 0, "repetition_penalty": 1,
                       "return_token_ids": true });
    let (status, v) = server.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    let choice = &v["choices"][0];
    let ids: Vec<u32> = serde_json::from_value(choice["token_ids"].clone()).unwrap();
    assert_eq!(ids, want);
    assert_eq!(choice["text"], generator.decode(&want).unwrap());
    assert_eq!(choice["prompt_token_ids"], json!(prompt));
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["completion_tokens"], ids.len());
    assert!(["length", "stop"].contains(&choice["finish_reason"].as_str().unwrap()));
    // The same prompt as text.
    let (_, t) = server
        .post(
            "/v1/completions",
            &json!({ "prompt": "def fibonacci(n):", "max_tokens": 12, "temperature": 0, "repetition_penalty": 1 }),
        )
        .await;
    assert_eq!(t["choices"][0]["text"], choice["text"]);
    // Without a repetition penalty given, the model's: a repeating greedy run changes.
    let looping = vec![10u32, 200, 31, 5];
    let (plain, penalised) = (
        greedy(&generator, &looping, 10, 1.0),
        greedy(&generator, &looping, 10, 1.05),
    );
    assert_ne!(plain, penalised, "the test prompt must repeat under plain greedy");
    let (_, d) = server
        .post(
            "/v1/completions",
            &json!({ "prompt": looping, "max_tokens": 10, "temperature": 0, "return_token_ids": true }),
        )
        .await;
    assert_eq!(d["choices"][0]["token_ids"], json!(penalised));

    // Six requests at once, each against itself alone.
    let prompts: Vec<Vec<u32>> = (0..6u32).map(|i| vec![10 + i, 200 + 7 * i, 31, 5 + i]).collect();
    let alone: Vec<Vec<u32>> = prompts.iter().map(|p| greedy(&generator, p, 10, 1.0)).collect();
    let server = Arc::new(server);
    let at_once: Vec<Vec<u32>> = futures_join(prompts.iter().map(|p| {
        let server = server.clone();
        let body = json!({ "prompt": p, "max_tokens": 10, "temperature": 0, "repetition_penalty": 1,
                           "return_token_ids": true });
        async move {
            let (status, v) = server.post("/v1/completions", &body).await;
            assert_eq!(status, 200, "{v}");
            serde_json::from_value(v["choices"][0]["token_ids"].clone()).unwrap()
        }
    }))
    .await;
    assert_eq!(at_once, alone);

    // A chat turn: the template's prompt, the assistant's message.
    let messages = json!([{ "role": "user", "content": "Say hi." }]);
    let (status, c) = server
        .post(
            "/v1/chat/completions",
            &json!({ "messages": messages, "max_tokens": 8, "temperature": 0, "repetition_penalty": 1,
                     "chat_template_kwargs": { "enable_thinking": false } }),
        )
        .await;
    assert_eq!(status, 200, "{c}");
    let rendered = generator
        .apply_chat_template(&[qwen36::ChatMessage::new("user", "Say hi.")], false)
        .unwrap();
    let want = greedy(&generator, &generator.encode(&rendered).unwrap(), 8, 1.0);
    assert_eq!(c["object"], "chat.completion");
    assert_eq!(c["choices"][0]["message"]["role"], "assistant");
    assert_eq!(
        c["choices"][0]["message"]["content"],
        generator.decode(&want).unwrap()
    );
    Arc::into_inner(server).unwrap().stop().await;
}

/// Runs the futures concurrently on the runtime and returns their outputs in order.
async fn futures_join<T: Send + 'static>(
    futs: impl Iterator<Item = impl std::future::Future<Output = T> + Send + 'static>,
) -> Vec<T> {
    let handles: Vec<_> = futs.map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

/// A streamed response's text is the non-streamed one's for the same seed (completions and
/// chat), its chunks end with a finish reason, the usage chunk when asked, and `[DONE]`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_text_equals_the_whole() {
    let (server, _) = Server::start(EngineConfig::default(), ServerConfig::default()).await;
    for (path, base) in [
        ("/v1/completions", json!({ "prompt": "Once upon a time" })),
        (
            "/v1/chat/completions",
            json!({ "messages": [{ "role": "user", "content": "Tell me a story." }] }),
        ),
    ] {
        let mut body = base.clone();
        for (k, v) in [
            ("max_tokens", json!(24)),
            ("temperature", json!(0.8)),
            ("seed", json!(7)),
        ] {
            body[k] = v;
        }
        let (status, whole) = server.post(path, &body).await;
        assert_eq!(status, 200, "{whole}");
        let whole_text = whole["choices"][0]["text"]
            .as_str()
            .or(whole["choices"][0]["message"]["content"].as_str())
            .unwrap()
            .to_string();
        body["stream"] = json!(true);
        body["stream_options"] = json!({ "include_usage": true });
        let events = server.stream(path, &body).await;
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{path}");
        assert_eq!(streamed_text(&events), whole_text, "{path}");
        let parsed: Vec<Value> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        let usage = parsed.last().unwrap();
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(usage["usage"], whole["usage"], "{path}");
        let finish = &parsed[parsed.len() - 2]["choices"][0]["finish_reason"];
        assert_eq!(finish, &whole["choices"][0]["finish_reason"], "{path}");
        assert!(parsed[..parsed.len() - 2]
            .iter()
            .all(|c| c["choices"][0]["finish_reason"].is_null()));
        if path.contains("chat") {
            assert_eq!(parsed[0]["choices"][0]["delta"]["role"], "assistant");
            assert_eq!(parsed[0]["object"], "chat.completion.chunk");
        }
    }
    server.stop().await;
}

/// A client that goes away mid-stream cancels its request: with one slot, a request queued
/// behind a long one (`ignore_eos`, thousands of tokens) finishes as soon as the long one's
/// client disconnects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_frees_its_slot() {
    let cfg = EngineConfig {
        max_seqs: 1,
        ..EngineConfig::default()
    };
    let (server, _) = Server::start(cfg, ServerConfig::default()).await;
    let long = json!({ "prompt": [1, 2, 3], "max_tokens": 4000, "ignore_eos": true, "stream": true });
    let mut r = reqwest::Client::new()
        .post(format!("{}/v1/completions", server.url))
        .json(&long)
        .send()
        .await
        .unwrap();
    assert!(r.chunk().await.unwrap().is_some(), "the long request streams");
    drop(r);
    let started = Instant::now();
    let short = reqwest::Client::new()
        .post(format!("{}/v1/completions", server.url))
        .timeout(Duration::from_secs(10))
        .json(&json!({ "prompt": [4, 5], "max_tokens": 2 }))
        .send()
        .await
        .expect("the queued request finishes once the long one is cancelled");
    assert_eq!(short.status().as_u16(), 200);
    // The long request alone takes over 10 s on this model (4000 tokens).
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    server.stop().await;
}

/// Bad input gets OpenAI's error object with its status, and the server goes on answering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_error_objects() {
    let cfg = ServerConfig {
        api_key: Some("sesame".into()),
        max_body_bytes: 1 << 16,
        ..ServerConfig::default()
    };
    let (server, _) = Server::start(EngineConfig::default(), cfg).await;
    let client = reqwest::Client::new();
    let send = |path: &str, body: String, key: Option<&str>| {
        let mut r = client
            .post(format!("{}{path}", server.url))
            .header("content-type", "application/json")
            .body(body);
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        r.send()
    };
    let ok = Some("sesame");
    let cases: Vec<(&str, String, Option<&str>, u16, &str)> = vec![
        (
            "/v1/completions",
            r#"{"prompt": [1, 2]}"#.into(),
            None,
            401,
            "API key",
        ),
        (
            "/v1/completions",
            r#"{"prompt": [1, 2]}"#.into(),
            Some("wrong"),
            401,
            "API key",
        ),
        ("/v1/completions", r#"{"prompt": [1, 2"#.into(), ok, 400, "EOF"),
        (
            "/v1/completions",
            r#"{"prompt": [1], "max_tokens": "x"}"#.into(),
            ok,
            400,
            "max_tokens",
        ),
        (
            "/v1/completions",
            r#"{"max_tokens": 3}"#.into(),
            ok,
            400,
            "prompt",
        ),
        (
            "/v1/completions",
            r#"{"prompt": [1], "temperature": -1}"#.into(),
            ok,
            400,
            "temperature",
        ),
        (
            "/v1/completions",
            r#"{"prompt": [1], "max_tokens": 5000}"#.into(),
            ok,
            400,
            "context",
        ),
        (
            "/v1/completions",
            r#"{"prompt": [], "max_tokens": 2}"#.into(),
            ok,
            400,
            "no tokens",
        ),
        (
            "/v1/completions",
            // Prompt + max_tokens past usize: refused, not wrapped around.
            r#"{"prompt": [1, 2, 3], "max_tokens": 18446744073709551614}"#.into(),
            ok,
            400,
            "context",
        ),
        (
            "/v1/completions",
            r#"{"prompt": [1], "n": 2}"#.into(),
            ok,
            400,
            "n = 2",
        ),
        (
            "/v1/completions",
            r#"{"prompt": [1], "model": "gpt-4"}"#.into(),
            ok,
            404,
            "gpt-4",
        ),
        (
            "/v1/completions",
            format!(r#"{{"prompt": "{}"}}"#, "a".repeat(1 << 17)),
            ok,
            413,
            "length limit",
        ),
        (
            "/v1/chat/completions",
            r#"{"messages": []}"#.into(),
            ok,
            400,
            "at least one",
        ),
        (
            "/v1/chat/completions",
            r#"{"messages": [{"role": "wizard", "content": "hi"}]}"#.into(),
            ok,
            400,
            "wizard",
        ),
        ("/v1/nothing", "{}".into(), ok, 404, "no such endpoint"),
    ];
    for (path, body, key, status, says) in cases {
        let r = send(path, body.clone(), key).await.unwrap();
        assert_eq!(
            r.status().as_u16(),
            status,
            "{path} {}",
            &body[..body.len().min(80)]
        );
        let v: Value = r.json().await.unwrap();
        let msg = v["error"]["message"].as_str().unwrap_or_default().to_string();
        assert!(msg.contains(says), "{path}: {msg:?} should say {says:?}");
        assert_eq!(v["error"]["code"], status);
    }
    // Still answering, with the key.
    let r = send(
        "/v1/completions",
        r#"{"prompt": [1, 2], "max_tokens": 2}"#.into(),
        ok,
    )
    .await
    .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let models: Value = client
        .get(format!("{}/v1/models", server.url))
        .bearer_auth("sesame")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "qwen36");
    let health = client.get(format!("{}/health", server.url)).send().await.unwrap();
    assert_eq!(health.status().as_u16(), 200);
    server.stop().await;
}
