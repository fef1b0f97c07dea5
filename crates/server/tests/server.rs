//! The server on 127.0.0.1 (a port of its own per test) with the bundled model on the CPU,
//! driven over HTTP: results against the `Generator` and the engine, streaming against
//! non-streaming, many requests at once against each alone, choices and seeds, log-probabilities,
//! reasoning and tool calls, cancellation by disconnecting, the error answers, a fuzz loop, a
//! load test with its metrics, and the official `openai` Python client.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use qwen36::engine::{Detokenize, Engine, EngineConfig, Event, Request, Speculation};
use qwen36::{GenerateOptions, Generator, LoadOptions, SamplingParams};
use qwen36_server::{ServerConfig, Service};
use serde_json::{json, Value};

/// A running server: its base URL and the sender that shuts it down.
struct Server {
    url: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// A detokenizer that gives the n-th piece of a script for the n-th token it decodes (cycling),
/// whatever the token: it drives the server's output parsing with text the bundled model would
/// never write. Only for one request at a time, each of the script's length.
fn scripted(pieces: &[&str]) -> Arc<dyn Detokenize> {
    let pieces: Vec<String> = pieces.iter().map(|s| s.to_string()).collect();
    let next = AtomicUsize::new(0);
    Arc::new(move |ids: &[u32]| -> Result<String, String> {
        Ok(ids
            .iter()
            .map(|_| pieces[next.fetch_add(1, Ordering::SeqCst) % pieces.len()].as_str())
            .collect())
    })
}

/// A reply that reasons, says a line and calls a tool (JSON form, then XML form), then stops
/// at the stop string `<END>`.
const SCRIPT: [&str; 18] = [
    "<think>",
    "\n",
    "The user",
    " wants the weather",
    ".\n",
    "</think>",
    "\n\n",
    "Checking",
    " now.",
    "<tool_call>",
    "\n{\"name\": \"get_weather\", ",
    "\"arguments\": {\"city\": \"Zürich\", \"days\": 2}}",
    "\n</tool_call>",
    "\n<tool_call>\n<function=get_weather>\n",
    "<parameter=city>\nSan José\n</parameter>\n",
    "<parameter=days>\n3\n</parameter>\n",
    "</function>\n</tool_call>",
    "<END>",
];

fn weather_tool() -> Value {
    json!({"type": "function", "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}
        }, "required": ["city"]},
    }})
}

impl Server {
    async fn start(engine_cfg: EngineConfig, cfg: ServerConfig) -> (Self, Generator) {
        Self::start_with(engine_cfg, cfg, None).await
    }

    /// A server whose engine turns tokens into text with `detokenizer` (default: the model's).
    async fn start_with(
        engine_cfg: EngineConfig,
        cfg: ServerConfig,
        detokenizer: Option<Arc<dyn Detokenize>>,
    ) -> (Self, Generator) {
        Self::start_full(engine_cfg, cfg, detokenizer, |s| s.to_string()).await
    }

    /// [`Self::start_with`], the bundled chat template's source edited by `template`.
    async fn start_full(
        engine_cfg: EngineConfig,
        cfg: ServerConfig,
        detokenizer: Option<Arc<dyn Detokenize>>,
        template: impl Fn(&str) -> String,
    ) -> (Self, Generator) {
        let generator = Generator::load(qwen36_testutil::bundled_dir(), LoadOptions::default()).unwrap();
        let engine = Engine::new(generator.model().clone(), engine_cfg)
            .unwrap()
            .with_detokenizer(detokenizer.unwrap_or_else(|| generator.detokenizer().unwrap()));
        let bundled = generator.chat_template().unwrap();
        let client = engine.spawn();
        let context = client.context();
        let service = Arc::new(Service::from_parts(
            client,
            generator.tokenizer().cloned(),
            Some(bundled.with_source(template(bundled.source())).unwrap()),
            generator.default_stop_ids(),
            generator.generation_config().sampling.clone().unwrap_or_default(),
            context,
            cfg,
        ));
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

    /// `GET /metrics`: each sample line's value by its name and labels.
    async fn metrics(&self) -> std::collections::HashMap<String, f64> {
        let text = reqwest::get(format!("{}/metrics", self.url))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| {
                let (k, v) = l.rsplit_once(' ')?;
                Some((k.to_string(), v.parse().ok()?))
            })
            .collect()
    }

    /// Waits (at most a second) until `/metrics` shows no request waiting or running and no KV
    /// block in use.
    async fn wait_for_idle(&self) {
        let started = Instant::now();
        loop {
            let m = self.metrics().await;
            let busy = [
                "qwen36_requests_running",
                "qwen36_requests_waiting",
                "qwen36_kv_blocks_used",
            ];
            if busy.iter().all(|k| m[*k] == 0.0) {
                return;
            }
            assert!(started.elapsed() < Duration::from_secs(1), "still busy: {m:?}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.task.take().unwrap().await.unwrap();
    }
}

/// The streamed text of a response's chunks (completion `text` or chat `delta.content`).
fn streamed_text(events: &[String]) -> String {
    chunks(events)
        .iter()
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

/// The parsed chunks of a stream (without `[DONE]`).
fn chunks(events: &[String]) -> Vec<Value> {
    events
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str::<Value>(e).unwrap())
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

/// The bundled model's repetition penalty (generation_config.json).
fn model_penalty(generator: &Generator) -> f32 {
    generator
        .generation_config()
        .sampling
        .as_ref()
        .expect("sampling defaults")
        .repetition_penalty
}

/// The finish reason a greedy run of at most `max` tokens that produced `ids` must report.
fn finish_of(generator: &Generator, ids: &[u32], max: usize) -> &'static str {
    let stopped = ids
        .last()
        .is_some_and(|t| generator.default_stop_ids().contains(t));
    if ids.len() == max && !stopped {
        "length"
    } else {
        "stop"
    }
}

/// Completions given as token ids return the `Generator`'s greedy ids and their text; a text
/// prompt is its encoding; parameters a request leaves out come from generation_config.json (the
/// bundled model's repetition penalty); chat completions render the template; many requests
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
    assert_eq!(choice["finish_reason"], finish_of(&generator, &want, 12));
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    // The same prompt as text.
    let (_, t) = server
        .post(
            "/v1/completions",
            &json!({ "prompt": "def fibonacci(n):", "max_tokens": 12, "temperature": 0, "repetition_penalty": 1 }),
        )
        .await;
    assert_eq!(t["choices"][0]["text"], choice["text"]);
    // Without max_tokens a completion stops at OpenAI's default of 16 tokens.
    let (_, d) = server
        .post(
            "/v1/completions",
            &json!({ "prompt": [1, 2, 3], "temperature": 0, "ignore_eos": true }),
        )
        .await;
    assert_eq!(d["usage"]["completion_tokens"], 16, "{d}");
    assert_eq!(d["choices"][0]["finish_reason"], "length");
    // Without a repetition penalty given, the model's: a repeating greedy run changes.
    let looping = vec![10u32, 200, 31, 5];
    let (plain, penalised) = (
        greedy(&generator, &looping, 10, 1.0),
        greedy(&generator, &looping, 10, model_penalty(&generator)),
    );
    assert_ne!(plain, penalised, "the test prompt must repeat under plain greedy");
    let (_, d) = server
        .post(
            "/v1/completions",
            &json!({ "prompt": looping, "max_tokens": 10, "temperature": 0, "return_token_ids": true }),
        )
        .await;
    assert_eq!(d["choices"][0]["token_ids"], json!(penalised));
    // A logit bias of -100 bans the plain greedy run's first token; +100 forces a token.
    let biased = |bias: Value| {
        json!({ "prompt": looping, "max_tokens": 10, "temperature": 0, "repetition_penalty": 1,
                "return_token_ids": true, "logit_bias": bias })
    };
    let (_, d) = server
        .post("/v1/completions", &biased(json!({ plain[0].to_string(): -100 })))
        .await;
    assert_ne!(d["choices"][0]["token_ids"][0], json!(plain[0]), "{d}");
    let (_, d) = server
        .post("/v1/completions", &biased(json!({ "7": 100, "8": -5.5 })))
        .await;
    assert_eq!(d["choices"][0]["token_ids"], json!([7u32; 10].to_vec()), "{d}");

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
    assert!(c["choices"][0]["message"].get("reasoning_content").is_none());
    assert!(c["choices"][0]["message"].get("tool_calls").is_none());
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
            ("return_token_ids", json!(true)),
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
        let parsed = chunks(&events);
        // Each chunk's token ids add up to the whole's.
        let ids: Vec<Value> = parsed
            .iter()
            .filter_map(|c| c["choices"][0]["token_ids"].as_array().cloned())
            .flatten()
            .collect();
        assert_eq!(Value::Array(ids), whole["choices"][0]["token_ids"], "{path}");
        let usage = parsed.last().unwrap();
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(usage["usage"], whole["usage"], "{path}");
        assert!(parsed[..parsed.len() - 1]
            .iter()
            .all(|c| c.get("usage").is_none()));
        // vLLM's continuous_usage_stats: each chunk's usage counts the ids sent so far.
        body["stream_options"]["continuous_usage_stats"] = json!(true);
        let continuous = chunks(&server.stream(path, &body).await);
        assert_eq!(continuous.len(), parsed.len(), "{path}");
        let mut sent = 0;
        for c in &continuous[..continuous.len() - 1] {
            sent += c["choices"][0]["token_ids"].as_array().map_or(0, Vec::len);
            let prompt = whole["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
            let want =
                json!({ "prompt_tokens": prompt, "completion_tokens": sent, "total_tokens": prompt + sent });
            assert_eq!(c["usage"], want, "{path}: {c}");
        }
        assert_eq!(Some(sent as u64), whole["usage"]["completion_tokens"].as_u64());
        assert_eq!(continuous.last().unwrap()["usage"], whole["usage"], "{path}");
        let finish = &parsed[parsed.len() - 2]["choices"][0]["finish_reason"];
        assert_eq!(finish, &whole["choices"][0]["finish_reason"], "{path}");
        assert!(parsed[..parsed.len() - 2]
            .iter()
            .all(|c| c["choices"][0]["finish_reason"].is_null()));
        assert!(parsed
            .iter()
            .all(|c| c["id"] == whole["id"] || c["id"].is_string()));
        if path.contains("chat") {
            assert_eq!(parsed[0]["choices"][0]["delta"]["role"], "assistant");
            assert_eq!(parsed[0]["object"], "chat.completion.chunk");
        }
        // Without token ids every chunk between the first and the finishing one carries text:
        // a token that settles nothing (a tag, text held back as the start of a stop string: a
        // newline and indentation here) sends no chunk of its own.
        body["return_token_ids"] = json!(false);
        body["stop"] = json!(["\n    QQQ", " QQQ"]);
        let parsed = chunks(&server.stream(path, &body).await);
        for c in &parsed[1..parsed.len() - 2] {
            let choice = &c["choices"][0];
            let says = |v: &Value| v.as_str().is_some_and(|t| !t.is_empty());
            let carries = says(&choice["text"])
                || says(&choice["delta"]["content"])
                || says(&choice["delta"]["reasoning_content"])
                || choice["delta"]["tool_calls"].is_array();
            assert!(carries, "{path}: a chunk with nothing in it: {c}");
        }
    }
    server.stop().await;
}

/// `n` choices sample as requests with seeds `seed..seed+n` would; without a seed, two equal
/// sampled requests differ; log-probabilities are the engine's own, in each endpoint's shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn choices_seeds_and_logprobs() {
    let cfg = EngineConfig {
        max_seqs: 4,
        ..EngineConfig::default()
    };
    let (server, generator) = Server::start(cfg, ServerConfig::default()).await;
    let base = json!({ "prompt": "import numpy as np\n", "max_tokens": 16, "temperature": 1.0,
                       "return_token_ids": false });
    let mut three = base.clone();
    three["n"] = json!(3);
    three["seed"] = json!(11);
    let (status, v) = server.post("/v1/completions", &three).await;
    assert_eq!(status, 200, "{v}");
    let texts: Vec<&str> = v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    for (i, text) in texts.iter().enumerate() {
        assert_eq!(v["choices"][i]["index"], i);
        let mut one = base.clone();
        one["seed"] = json!(11 + i);
        let (_, w) = server.post("/v1/completions", &one).await;
        assert_eq!(w["choices"][0]["text"].as_str().unwrap(), *text, "choice {i}");
    }
    assert_ne!(texts[0], texts[1]);
    // The usage adds up every choice's tokens (counted through their log-probabilities).
    let mut counted = three.clone();
    counted["logprobs"] = json!(0);
    let (_, c) = server.post("/v1/completions", &counted).await;
    let per_choice: u64 = (0..3)
        .map(|i| c["choices"][i]["logprobs"]["tokens"].as_array().unwrap().len() as u64)
        .sum();
    assert_eq!(c["usage"]["completion_tokens"].as_u64().unwrap(), per_choice);
    assert!(per_choice > 3);
    // Streamed, the choices interleave and each streams what it gives whole.
    let mut streamed = three.clone();
    streamed["stream"] = json!(true);
    let events = server.stream("/v1/completions", &streamed).await;
    let mut by_choice = vec![String::new(); 3];
    for c in chunks(&events) {
        let choice = &c["choices"][0];
        by_choice[choice["index"].as_u64().unwrap() as usize].push_str(choice["text"].as_str().unwrap());
    }
    assert_eq!(by_choice, texts);
    // No seed: each request draws its own.
    let hot = json!({ "prompt": "import", "max_tokens": 32, "temperature": 1.5, "ignore_eos": true });
    let (_, a) = server.post("/v1/completions", &hot).await;
    let (_, b) = server.post("/v1/completions", &hot).await;
    assert_ne!(a["choices"][0]["text"], b["choices"][0]["text"]);

    // Log-probabilities against the engine's for the same request.
    let prompt = generator.encode("def main():").unwrap();
    let mut engine = Engine::new(generator.model().clone(), EngineConfig::default()).unwrap();
    let mut req = Request::greedy(prompt.clone(), 6);
    req.sampling.repetition_penalty = model_penalty(&generator); // the model's default
    req.sampling.top_logprobs = 3;
    req.logprobs = true;
    req.stop_ids = generator.default_stop_ids();
    let h = engine.submit(req).unwrap();
    engine.run_to_completion().unwrap();
    let want: Vec<qwen36::sampling::Sampled> = h
        .drain()
        .into_iter()
        .filter_map(|e| match e {
            Event::Token { logprobs, .. } => logprobs,
            _ => None,
        })
        .flatten()
        .collect();
    assert!(!want.is_empty());
    let (status, c) = server
        .post(
            "/v1/completions",
            &json!({ "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 3 }),
        )
        .await;
    assert_eq!(status, 200, "{c}");
    let lp = &c["choices"][0]["logprobs"];
    let text = c["choices"][0]["text"].as_str().unwrap();
    assert_eq!(lp["tokens"].as_array().unwrap().len(), want.len());
    assert_eq!(
        lp["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap())
            .collect::<String>(),
        text
    );
    for (i, s) in want.iter().enumerate() {
        assert_eq!(lp["token_logprobs"][i].as_f64().unwrap() as f32, s.logprob);
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert_eq!(top.len(), 3);
        for (t, l) in &s.top_logprobs {
            let key = generator.tokenizer().unwrap().decode(&[*t], false).unwrap();
            assert_eq!(top[&key].as_f64().unwrap() as f32, *l);
        }
    }
    let offsets: Vec<u64> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_u64().unwrap())
        .collect();
    assert_eq!(offsets[0], 0);
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]));
    // Streamed, the offsets go on from chunk to chunk.
    let events = server
        .stream(
            "/v1/completions",
            &json!({ "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 3, "stream": true }),
        )
        .await;
    let streamed: Vec<Value> = chunks(&events)
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["text_offset"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(Value::Array(streamed), lp["text_offset"]);
    // Chat: `logprobs: true` with `top_logprobs`, per token in `content`.
    let (status, c) = server
        .post(
            "/v1/chat/completions",
            &json!({ "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
                     "logprobs": true, "top_logprobs": 2 }),
        )
        .await;
    assert_eq!(status, 200, "{c}");
    let content = c["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(
        content.len() as u64,
        c["usage"]["completion_tokens"].as_u64().unwrap()
    );
    for e in content {
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        // Greedy without penalties on a fresh reply: the token is the most likely one.
        assert!(top[0]["logprob"].as_f64().unwrap() >= top[1]["logprob"].as_f64().unwrap());
        assert_eq!(e["bytes"], json!(e["token"].as_str().unwrap().as_bytes()));
    }
    // vLLM's return_tokens_as_token_ids: the same entries, each token named `token_id:ID`.
    for path in ["/v1/chat/completions", "/v1/completions"] {
        let mut body = json!({ "max_tokens": 4, "temperature": 0, "return_token_ids": true });
        if path.contains("chat") {
            body["messages"] = json!([{"role": "user", "content": "hi"}]);
            body["logprobs"] = json!(true);
            body["top_logprobs"] = json!(2);
        } else {
            body["prompt"] = json!("hi");
            body["logprobs"] = json!(2);
        }
        let (_, a) = server.post(path, &body).await;
        body["return_tokens_as_token_ids"] = json!(true);
        let (status, b) = server.post(path, &body).await;
        assert_eq!(status, 200, "{b}");
        let ids = b["choices"][0]["token_ids"].as_array().unwrap();
        assert_eq!(ids, a["choices"][0]["token_ids"].as_array().unwrap());
        let name = |id: &Value| format!("token_id:{id}");
        let (la, lb) = (&a["choices"][0]["logprobs"], &b["choices"][0]["logprobs"]);
        if path.contains("chat") {
            let (ca, cb) = (
                la["content"].as_array().unwrap(),
                lb["content"].as_array().unwrap(),
            );
            assert_eq!(cb.len(), ids.len());
            for ((ea, eb), id) in ca.iter().zip(cb).zip(ids) {
                assert_eq!(eb["token"], name(id), "{eb}");
                assert_eq!(eb["bytes"], json!(name(id).as_bytes()));
                assert_eq!(eb["logprob"], ea["logprob"]);
                for t in eb["top_logprobs"].as_array().unwrap() {
                    assert!(t["token"].as_str().unwrap().starts_with("token_id:"), "{t}");
                }
            }
        } else {
            let want: Vec<String> = ids.iter().map(name).collect();
            assert_eq!(lb["tokens"], json!(want));
            assert_eq!(lb["token_logprobs"], la["token_logprobs"]);
            let top = lb["top_logprobs"][0].as_object().unwrap();
            assert_eq!(top.len(), 2);
            assert!(top.keys().all(|k| k.starts_with("token_id:")), "{top:?}");
        }
    }
    server.stop().await;
}

/// `echo`: the text starts with the prompt's and the log-probabilities with the prompt's tokens
/// (the first one's null), equal to the engine's prompt log-probabilities, then the
/// completion's as without echo; `max_tokens: 0` returns the prompt alone (lm-eval's
/// loglikelihood request); streamed, the chunks add up to the whole response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_returns_the_prompt_and_its_logprobs() {
    let (server, generator) = Server::start(EngineConfig::default(), ServerConfig::default()).await;
    let text = "def main():\n    print(";
    let prompt = generator.encode(text).unwrap();
    let mut engine = Engine::new(generator.model().clone(), EngineConfig::default()).unwrap();
    let mut req = Request::greedy(prompt.clone(), 0);
    req.prompt_logprobs = Some(2);
    let h = engine.submit(req).unwrap();
    engine.run_to_completion().unwrap();
    let want = h
        .drain()
        .into_iter()
        .find_map(|e| match e {
            Event::Prompt { logprobs } => Some(logprobs),
            _ => None,
        })
        .expect("the prompt's log-probabilities");
    assert_eq!(want.len() + 1, prompt.len());
    let alone = json!({ "prompt": text, "echo": true, "max_tokens": 0, "logprobs": 2, "temperature": 0 });
    let (status, v) = server.post("/v1/completions", &alone).await;
    assert_eq!(status, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["text"], text);
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 0);
    assert_eq!(v["usage"]["prompt_tokens"], prompt.len());
    let lp = &choice["logprobs"];
    let tokens: Vec<String> = prompt
        .iter()
        .map(|&t| generator.tokenizer().unwrap().decode(&[t], false).unwrap())
        .collect();
    assert_eq!(lp["tokens"], json!(tokens));
    assert_eq!(
        (&lp["token_logprobs"][0], &lp["top_logprobs"][0]),
        (&Value::Null, &Value::Null)
    );
    for (i, s) in want.iter().enumerate() {
        assert_eq!(
            lp["token_logprobs"][i + 1].as_f64().unwrap() as f32,
            s.logprob,
            "token {}",
            i + 1
        );
        let top = lp["top_logprobs"][i + 1].as_object().unwrap();
        assert_eq!(top.len(), 2);
        for (t, l) in &s.top_logprobs {
            let key = generator.tokenizer().unwrap().decode(&[*t], false).unwrap();
            assert_eq!(top[&key].as_f64().unwrap() as f32, *l);
        }
    }
    // Token ids echo as their text; without logprobs the prompt is still echoed.
    let (_, ids) = server
        .post(
            "/v1/completions",
            &json!({ "prompt": prompt, "echo": true, "max_tokens": 0 }),
        )
        .await;
    assert_eq!(ids["choices"][0]["text"], text);
    assert_eq!(ids["choices"][0]["logprobs"], Value::Null);
    // With a completion: the echo, then what the request gives without it.
    let with = json!({ "prompt": text, "echo": true, "max_tokens": 5, "logprobs": 2, "temperature": 0 });
    let (_, e) = server.post("/v1/completions", &with).await;
    let mut without = with.clone();
    without["echo"] = json!(false);
    let (_, plain) = server.post("/v1/completions", &without).await;
    let completion = plain["choices"][0]["text"].as_str().unwrap();
    assert!(!completion.is_empty());
    assert_eq!(
        e["choices"][0]["text"].as_str().unwrap(),
        format!("{text}{completion}")
    );
    let elp = &e["choices"][0]["logprobs"];
    let n = prompt.len();
    assert_eq!(
        elp["token_logprobs"].as_array().unwrap()[..n],
        lp["token_logprobs"].as_array().unwrap()[..]
    );
    assert_eq!(
        elp["token_logprobs"].as_array().unwrap()[n..],
        plain["choices"][0]["logprobs"]["token_logprobs"]
            .as_array()
            .unwrap()[..]
    );
    assert_eq!(
        elp["top_logprobs"].as_array().unwrap()[n..],
        plain["choices"][0]["logprobs"]["top_logprobs"]
            .as_array()
            .unwrap()[..]
    );
    // The offsets run over the echoed prompt's tokens, then the completion's.
    let texts = elp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap().chars().count());
    let offsets: Vec<usize> = texts
        .scan(0, |at, len| Some(std::mem::replace(at, *at + len)))
        .collect();
    assert_eq!(elp["text_offset"], json!(offsets));
    // Streamed: the chunks add up to the whole.
    let mut streamed = with.clone();
    streamed["stream"] = json!(true);
    let events = server.stream("/v1/completions", &streamed).await;
    assert_eq!(streamed_text(&events), e["choices"][0]["text"].as_str().unwrap());
    for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        let parts: Vec<Value> = chunks(&events)
            .iter()
            .filter_map(|c| c["choices"][0]["logprobs"][key].as_array().cloned())
            .flatten()
            .collect();
        assert_eq!(Value::Array(parts), elp[key], "{key}");
    }
    server.stop().await;
}

/// Structured output: `guided_choice` gives one of the choices and a `response_format` JSON
/// schema an object that matches it (chat), each ending with a stop, `json_object` an object
/// (or the start of one, at `max_tokens`); the same
/// under prompt-lookup speculation (lossless) and streamed; malformed constraints are 400s
/// naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_output_matches_its_schema() {
    let (plain, _) = Server::start(EngineConfig::default(), ServerConfig::default()).await;
    let spec_cfg = ServerConfig {
        speculation: Some(Speculation::ngram(3)),
        ..ServerConfig::default()
    };
    let (drafting, _) = Server::start(EngineConfig::default(), spec_cfg).await;
    let choices = ["yes", "no", "maybe (so)"];
    let gbnf = "root ::= answer \" because \" reason \".\"\n# the verdict\nanswer ::=\n  \"yes\" |\n  \"no\"\nreason ::= [a-z]{1,12} (\" \" [a-z]{1,12}){0,3}\n";
    // The same language in llguidance's Lark.
    let lark = "start: answer \" because \" reason \".\"\nanswer: \"yes\" | \"no\"\nreason: /[a-z]{1,12}( [a-z]{1,12}){0,3}/\n";
    let schema = json!({"type": "object", "properties": {
        "answer": {"enum": ["yes", "no"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    }, "required": ["answer", "n"], "additionalProperties": false});
    let chat = |format: Value| {
        json!({ "messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 60,
                "temperature": 0, "response_format": format,
                "chat_template_kwargs": {"enable_thinking": false} })
    };
    let cases = [
        (
            "/v1/completions",
            json!({ "prompt": "The answer is", "max_tokens": 10, "temperature": 0, "guided_choice": choices }),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})),
        ),
        ("/v1/chat/completions", chat(json!({"type": "json_object"}))),
        // Sampled: the drafts' acceptance is coupled to the plain draw.
        (
            "/v1/completions",
            json!({ "prompt": "def f(x):", "max_tokens": 40, "temperature": 0.9, "seed": 7,
                    "guided_regex": "[a-z]+( [a-z]+){0,5}\\." }),
        ),
        // A grammar in llama.cpp's GBNF, its rules over several lines.
        (
            "/v1/completions",
            json!({ "prompt": "Is it true?", "max_tokens": 80, "temperature": 0, "guided_grammar": gbnf }),
        ),
    ];
    for (i, (path, body)) in cases.iter().enumerate() {
        let (status, v) = plain.post(path, body).await;
        assert_eq!(status, 200, "case {i}: {v}");
        let c = &v["choices"][0];
        let text = c["text"].as_str().or(c["message"]["content"].as_str()).unwrap();
        // (Any object may run to max_tokens: the bundled model writes long ones.)
        if i == 2 && c["finish_reason"] == "length" {
            assert!(text.starts_with('{'), "{text:?}");
        } else {
            assert_eq!(c["finish_reason"], "stop", "case {i}: {v}");
        }
        match i {
            0 => assert!(choices.contains(&text), "{text:?}"),
            2 if c["finish_reason"] == "length" => {}
            4 => {
                let (answer, reason) = text.split_once(" because ").unwrap_or_else(|| panic!("{text:?}"));
                assert!(["yes", "no"].contains(&answer), "{text:?}");
                let words = reason.strip_suffix('.').unwrap_or_else(|| panic!("{text:?}"));
                let ok = |w: &str| (1..=12).contains(&w.len()) && w.chars().all(|c| c.is_ascii_lowercase());
                assert!(
                    words.split(' ').all(ok) && words.split(' ').count() <= 4,
                    "{text:?}"
                );
            }
            3 => {
                let words = text.strip_suffix('.').unwrap_or_else(|| panic!("{text:?}"));
                let ok = |w: &str| !w.is_empty() && w.chars().all(|c| c.is_ascii_lowercase());
                assert!(
                    words.split(' ').all(ok) && words.split(' ').count() <= 6,
                    "{text:?}"
                );
            }
            _ => {
                let out: Value =
                    serde_json::from_str(text).unwrap_or_else(|e| panic!("case {i}: {e}: {text:?}"));
                assert!(out.is_object(), "{text:?}");
                if i == 1 {
                    assert!(
                        ["yes", "no"].contains(&out["answer"].as_str().unwrap()),
                        "{text:?}"
                    );
                    assert!((0..=9).contains(&out["n"].as_i64().unwrap()), "{text:?}");
                    assert_eq!(out.as_object().unwrap().len(), 2, "{text:?}");
                }
            }
        }
        let (_, d) = drafting.post(path, body).await;
        assert_eq!(
            d["choices"][0], v["choices"][0],
            "case {i}: drafts change nothing"
        );
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        assert_eq!(
            streamed_text(&plain.stream(path, &streamed).await),
            text,
            "case {i}"
        );
    }
    // vLLM's newer `structured_outputs` field gives what the older fields give.
    for (i, key, older) in [
        (0, "choice", "guided_choice"),
        (3, "regex", "guided_regex"),
        (1, "json", "response_format"),
        (2, "json_object", "response_format"),
        (4, "grammar", "guided_grammar"),
    ] {
        let (path, body) = &cases[i];
        let mut newer = body.clone();
        let old = newer.as_object_mut().unwrap().remove(older).unwrap();
        let value = match key {
            "json" => old["json_schema"]["schema"].clone(),
            "json_object" => json!(true),
            _ => old,
        };
        newer["structured_outputs"] =
            json!({ key: value, "disable_any_whitespace": false, "disable_additional_properties": false });
        let (_, a) = plain.post(path, body).await;
        let (status, b) = plain.post(path, &newer).await;
        assert_eq!(status, 200, "{key}: {b}");
        assert_eq!(a["choices"][0], b["choices"][0], "{key}");
    }
    // The grammar in Lark gives what it gives in GBNF.
    let (path, body) = &cases[4];
    let mut in_lark = body.clone();
    in_lark["guided_grammar"] = json!(lark);
    let (_, a) = plain.post(path, body).await;
    let (status, b) = plain.post(path, &in_lark).await;
    assert_eq!(status, 200, "lark: {b}");
    assert_eq!(a["choices"][0], b["choices"][0], "lark");
    let drafted = drafting.metrics().await["qwen36_spec_draft_tokens_total"];
    assert!(drafted > 0.0, "the drafting server verified no drafts");
    let c = "/v1/completions";
    let bad = [
        (
            json!({"response_format": {"type": "json_schema"}}),
            "response_format",
            "needs",
        ),
        (
            json!({"response_format": {"type": "grammar"}}),
            "response_format",
            "\"grammar\"",
        ),
        (json!({"guided_regex": "("}), "guided_regex", "guided_regex: "),
        (json!({"guided_json": "{not json"}), "guided_json", "not JSON"),
        (json!({"guided_choice": []}), "guided_choice", "at least one"),
        (
            json!({"guided_regex": "a", "guided_choice": ["b"]}),
            "guided_choice",
            "one structured-output constraint",
        ),
        (
            json!({"guided_regex": "a", "ignore_eos": true}),
            "ignore_eos",
            "not with guided_regex",
        ),
        (
            json!({"structured_outputs": {"grammar": "root ::= \"a"}}),
            "structured_outputs",
            "structured_outputs: GBNF: a string is not closed",
        ),
        (
            json!({"guided_grammar": "a ::= \"a\""}),
            "guided_grammar",
            "no root rule",
        ),
        (
            json!({"guided_grammar": 3}),
            "guided_grammar",
            "expected a string",
        ),
        // (Lark that llguidance refuses: named when compiled.)
        (
            json!({"guided_grammar": "start: undefined_rule"}),
            "guided_grammar",
            "guided_grammar: ",
        ),
        (
            json!({"structured_outputs": {"grammar": "start: \"a\""}, "guided_regex": "a"}),
            "structured_outputs",
            "one structured-output constraint",
        ),
        (
            json!({"structured_outputs": {"frobnicate": 1}}),
            "structured_outputs",
            "structured_outputs.frobnicate: not supported",
        ),
        (
            json!({"structured_outputs": {"json": {"type": "object"}, "disable_additional_properties": true}}),
            "structured_outputs",
            "structured_outputs.disable_additional_properties: not supported",
        ),
        (
            json!({"structured_outputs": {"choice": "a"}}),
            "structured_outputs",
            "a list of strings",
        ),
        (
            json!({"structured_outputs": {"regex": 3}}),
            "structured_outputs",
            "expected a string",
        ),
        (
            json!({"structured_outputs": {"choice": []}}),
            "structured_outputs",
            "at least one",
        ),
        (
            json!({"structured_outputs": {"regex": "a"}, "guided_choice": ["b"]}),
            "guided_choice",
            "one structured-output constraint",
        ),
    ];
    for (extra, param, says) in bad {
        let mut body = json!({ "prompt": "x", "max_tokens": 2 });
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let (status, v) = plain.post(c, &body).await;
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(says), "{v}");
    }
    plain.stop().await;
    drafting.stop().await;
}

/// vLLM's per-request `chat_template`, on a server that trusts them: the chat runs the prompt
/// that template renders (the completion of that text, token for token), `/tokenize` renders it
/// too, and a template that does not compile or is no string is a 400 naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_chat_template_renders_where_trusted() {
    let cfg = ServerConfig {
        trust_request_chat_template: true,
        ..ServerConfig::default()
    };
    let (server, _) = Server::start(EngineConfig::default(), cfg).await;
    // (With the model's special tokens: its eos_token is <|im_end|>.)
    let template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}\n{% endfor %}\
                    {% if add_generation_prompt %}[answer]{% endif %}";
    let messages =
        json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f(x):"}]);
    let rendered = "[system] Be brief.<|im_end|>\n[user] def f(x):<|im_end|>\n[answer]";
    let chat = json!({ "messages": messages, "chat_template": template, "max_tokens": 12, "temperature": 0,
                       "return_token_ids": true, "chat_template_kwargs": {"enable_thinking": false} });
    let (status, c) = server.post("/v1/chat/completions", &chat).await;
    assert_eq!(status, 200, "{c}");
    let (_, want) = server.post("/tokenize", &json!({ "prompt": rendered })).await;
    assert_eq!(c["prompt_token_ids"], want["tokens"], "{c}");
    let (_, t) = server
        .post(
            "/tokenize",
            &json!({ "messages": messages, "chat_template": template }),
        )
        .await;
    assert_eq!(t["tokens"], want["tokens"], "{t}");
    let (_, plain) = server
        .post(
            "/v1/completions",
            &json!({ "prompt": rendered, "max_tokens": 12, "temperature": 0, "return_token_ids": true }),
        )
        .await;
    assert_eq!(c["choices"][0]["token_ids"], plain["choices"][0]["token_ids"]);
    // Without one, the model's template: another prompt.
    let mut own = chat.clone();
    own.as_object_mut().unwrap().remove("chat_template");
    let (_, o) = server.post("/v1/chat/completions", &own).await;
    assert_ne!(o["prompt_token_ids"], c["prompt_token_ids"]);
    for (bad, says) in [
        (json!("{% if %}"), "chat_template: "),
        (json!(3), "expected a string"),
    ] {
        let mut body = chat.clone();
        body["chat_template"] = bad;
        let (status, v) = server.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["param"], "chat_template", "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(says), "{v}");
    }
    server.stop().await;
}

/// vLLM's `skip_special_tokens: false`: the same tokens, their text with the special ones
/// written out (what `/detokenize` gives for the ids), streamed as whole; by default the text
/// skips them (the tokenizer's decode).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn special_tokens_are_written_out_when_asked() {
    let (server, generator) = Server::start(EngineConfig::default(), ServerConfig::default()).await;
    let prompt = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n";
    // Turns of a chat: the only ids allowed are those of the markers, a newline and a word.
    let (_, allowed) = server
        .post(
            "/tokenize",
            &json!({ "prompt": "<|im_end|>\n<|im_start|>user hi" }),
        )
        .await;
    let body = json!({ "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": true,
                       "return_token_ids": true, "allowed_token_ids": allowed["tokens"] });
    let (status, skipped) = server.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{skipped}");
    let mut keep = body.clone();
    keep["skip_special_tokens"] = json!(false);
    let (status, kept) = server.post("/v1/completions", &keep).await;
    assert_eq!(status, 200, "{kept}");
    let ids = &kept["choices"][0]["token_ids"];
    assert_eq!(ids, &skipped["choices"][0]["token_ids"]);
    let ids: Vec<u32> = ids
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let (_, written) = server.post("/detokenize", &json!({ "tokens": ids })).await;
    let kept_text = kept["choices"][0]["text"].as_str().unwrap();
    assert_eq!(kept_text, written["prompt"].as_str().unwrap());
    let skipped_text = skipped["choices"][0]["text"].as_str().unwrap();
    assert_eq!(skipped_text, generator.decode(&ids).unwrap());
    assert!(
        kept_text.contains("<|im_") && !skipped_text.contains("<|im_"),
        "{kept_text:?}"
    );
    keep["stream"] = json!(true);
    assert_eq!(
        streamed_text(&server.stream("/v1/completions", &keep).await),
        kept_text
    );
    server.stop().await;
}

/// vLLM's `bad_words`: the output never holds a word's ids (as a text starts with it, or after
/// a space); before the first place it held them, it is the output without the ban, and there it
/// differs; prompt-lookup drafts change nothing (the ban reads each verify row's own output).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_words_never_come() {
    let (plain, _) = Server::start(EngineConfig::default(), ServerConfig::default()).await;
    let spec_cfg = ServerConfig {
        speculation: Some(Speculation::ngram(3)),
        ..ServerConfig::default()
    };
    let (drafting, _) = Server::start(EngineConfig::default(), spec_cfg).await;
    let c = "/v1/completions";
    let ids_of = |v: &Value| -> Vec<u64> {
        v["choices"][0]["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect()
    };
    let tokens = |v: Value| -> Vec<u64> {
        v["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect()
    };
    for temperature in [0.0, 0.8] {
        let body = json!({ "prompt": "def fib(n):\n    \"\"\"Return the", "max_tokens": 48, "temperature": temperature,
                           "seed": 11, "return_token_ids": true });
        let (status, free) = plain.post(c, &body).await;
        assert_eq!(status, 200, "{free}");
        let free_ids = ids_of(&free);
        // A word the output writes inside its text: a token after the first that is a space and
        // letters.
        let mut word = None;
        for &id in &free_ids[1..] {
            let (_, t) = plain.post("/detokenize", &json!({ "tokens": [id] })).await;
            let t = t["prompt"].as_str().unwrap().to_string();
            if t.len() > 2 && t.starts_with(' ') && t[1..].chars().all(|c| c.is_ascii_alphabetic()) {
                word = Some(t[1..].to_string());
                break;
            }
        }
        let word = word.unwrap_or_else(|| panic!("no word in {free}"));
        let mut banned = Vec::new();
        for text in [word.clone(), format!(" {word}")] {
            let (_, v) = plain.post("/tokenize", &json!({ "prompt": text })).await;
            banned.push(tokens(v));
        }
        let holds = |ids: &[u64], w: &[u64]| ids.windows(w.len()).position(|s| s == w);
        // Where the free output first ends a banned sequence.
        let first = banned
            .iter()
            .filter_map(|w| holds(&free_ids, w).map(|p| p + w.len() - 1))
            .min()
            .unwrap();
        let mut ban = body.clone();
        ban["bad_words"] = json!([format!("  {word}")]);
        let (status, v) = plain.post(c, &ban).await;
        assert_eq!(status, 200, "{v}");
        let ids = ids_of(&v);
        for w in &banned {
            assert_eq!(holds(&ids, w), None, "{word:?} {w:?} in {v}");
        }
        assert_eq!(ids[..first], free_ids[..first], "t {temperature}: {word:?}");
        assert_ne!(ids.get(first), free_ids.get(first), "t {temperature}: {word:?}");
        let (_, d) = drafting.post(c, &ban).await;
        assert_eq!(
            d["choices"][0], v["choices"][0],
            "t {temperature}: drafts change nothing"
        );
    }
    assert!(drafting.metrics().await["qwen36_spec_draft_tokens_total"] > 0.0);
    // As many words as a request may give (one more is a 400: bad_requests_get_error_objects).
    let words: Vec<String> = (0..256).map(|i| format!("w{i}")).collect();
    let body = json!({ "prompt": "x", "max_tokens": 2, "bad_words": words });
    let (status, v) = plain.post(c, &body).await;
    assert_eq!(status, 200, "{v}");
    plain.stop().await;
    drafting.stop().await;
}

/// `tool_choice` `"required"` or a named function forces `<tool_call>` blocks whose arguments
/// match the tool's parameters (`finish_reason: "tool_calls"`), in the form the chat template
/// teaches (JSON, or Qwen3.6's XML in a template edited to teach it: numbers, booleans and a
/// JSON array read back typed): one call for a named function (without
/// `parallel_tool_calls: false`), `$defs` references resolved, no parameters an empty object; a chat inside its think block calls after `</think>` (forced first by a logit bias:
/// were the grammar applied inside the block, it would mask `</think>`); a name not among the tools, `"required"` without tools and a forced call beside a
/// `response_format` are 400s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_tool_calls_match_their_tool() {
    let unit = json!({"type": "function", "function": {"name": "set_unit", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
        "additionalProperties": false}}});
    let mode = json!({"type": "function", "function": {"name": "set_mode", "parameters": {
        "$defs": {"Mode": {"enum": ["on", "off"]}},
        "properties": {"mode": {"$ref": "#/$defs/Mode"}}, "required": ["mode"],
        "additionalProperties": false}}});
    let ping = json!({"type": "function", "function": {"name": "ping"}});
    let limits = json!({"type": "function", "function": {"name": "set_limits", "parameters": {
        "type": "object", "properties": {"max": {"type": "number"}, "strict": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
        "required": ["max", "strict", "tags"]}}});
    let path = "/v1/chat/completions";
    let user = json!([{"role": "user", "content": "Use Celsius."}]);
    let body = |tools: Value, choice: Value| {
        json!({ "messages": user, "max_tokens": 200, "temperature": 0, "tools": tools,
                "tool_choice": choice, "chat_template_kwargs": {"enable_thinking": false},
                "logprobs": true })
    };
    let named = |name: &str| json!({"type": "function", "function": {"name": name}});
    let all = json!([weather_tool(), unit, mode, ping, limits]);
    // The bundled template teaches the JSON form; one edited to teach Qwen3.6's XML form.
    let json_form = r#"{"name": "<function name>", "arguments": {"<parameter>": <value>}}"#;
    let xml_form = r"<function=NAME>\n<parameter=PARAMETER>\nvalue\n</parameter>\n</function>";
    for xml in [false, true] {
        let edit = |s: &str| {
            assert!(s.contains(json_form));
            match xml {
                true => s.replace(json_form, xml_form),
                false => s.to_string(),
            }
        };
        let (server, generator) =
            Server::start_full(EngineConfig::default(), ServerConfig::default(), None, edit).await;
        let think_end = generator.tokenizer().unwrap().token_to_id("</think>").unwrap();
        let mut thinking = body(all.clone(), named("set_unit"));
        thinking["messages"] = json!([{"role": "user", "content": "Use Celsius."},
                                      {"role": "assistant", "content": "<think>\nCelsius, so"}]);
        thinking["continue_final_message"] = json!(true);
        thinking["add_generation_prompt"] = json!(false);
        thinking["logit_bias"] = json!({ think_end.to_string(): 100 });
        let mut required = body(json!([mode, unit]), json!("required"));
        required["parallel_tool_calls"] = json!(false);
        // A `</tool_call>` stop string ends the output inside the block: still the call.
        let mut cut = body(all.clone(), named("set_mode"));
        cut["stop"] = json!(["</tool_call>"]);
        let cases = [
            (body(all.clone(), named("set_unit")), vec!["set_unit"]),
            (body(all.clone(), named("set_mode")), vec!["set_mode"]),
            (body(all.clone(), named("ping")), vec!["ping"]),
            (thinking, vec!["set_unit"]),
            (required, vec!["set_mode", "set_unit"]),
            (body(all.clone(), named("set_limits")), vec!["set_limits"]),
            (cut, vec!["set_mode"]),
        ];
        for (i, (b, names)) in cases.into_iter().enumerate() {
            let (status, v) = server.post(path, &b).await;
            assert_eq!(status, 200, "xml {xml}, case {i}: {v}");
            let c = &v["choices"][0];
            let tokens: Vec<&str> = c["logprobs"]["content"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t["token"].as_str().unwrap())
                .collect();
            let mut text = tokens.concat();
            if i == 3 {
                // The bias forces `</think>` first: the grammar does not mask it inside the block.
                assert_eq!(tokens[0], "</think>", "case {i}: {v}");
                text = text["</think>".len()..].to_string();
            }
            let opening = if xml {
                "<tool_call>\n<function="
            } else {
                "<tool_call>\n{\"name\": "
            };
            assert!(
                text.starts_with(opening),
                "xml {xml}, case {i}: the template's form: {text:?}"
            );
            assert_eq!(c["finish_reason"], "tool_calls", "xml {xml}, case {i}: {v}");
            let calls = c["message"]["tool_calls"].as_array().unwrap();
            assert_eq!(calls.len(), 1, "xml {xml}, case {i}: {v}");
            let f = &calls[0]["function"];
            let args: Value = serde_json::from_str(f["arguments"].as_str().unwrap()).unwrap();
            let name = f["name"].as_str().unwrap();
            assert!(names.contains(&name), "xml {xml}, case {i}: {v}");
            let fine = match name {
                "set_unit" => args == json!({"unit": "c"}) || args == json!({"unit": "f"}),
                "set_mode" => args == json!({"mode": "on"}) || args == json!({"mode": "off"}),
                "set_limits" => {
                    let tags = args["tags"].as_array();
                    args["max"].is_number()
                        && args["strict"].is_boolean()
                        && tags.is_some_and(|t| t.len() <= 2 && t.iter().all(|t| t == "a" || t == "b"))
                }
                _ => args == json!({}),
            };
            assert!(fine, "xml {xml}, case {i}: {args}");
        }
        if xml {
            server.stop().await;
            continue;
        }
        let bad = [
            (
                body(all.clone(), named("nope")),
                "\"nope\", which is not among the tools",
            ),
            (
                json!({ "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required" }),
                "no tools are given",
            ),
            (
                {
                    let mut b = body(all.clone(), json!("required"));
                    b["response_format"] = json!({"type": "json_object"});
                    b
                },
                "a forced tool call and response_format",
            ),
        ];
        for (b, says) in bad {
            let (status, v) = server.post(path, &b).await;
            assert_eq!(status, 400, "{v}");
            assert_eq!(v["error"]["param"], "tool_choice", "{v}");
            assert!(v["error"]["message"].as_str().unwrap().contains(says), "{v}");
        }
        server.stop().await;
    }
}

/// Chat output is split into `reasoning_content`, `content` and `tool_calls` (JSON and XML
/// forms, arguments typed by the tool's schema), with `finish_reason: "tool_calls"`; streamed,
/// the deltas add up to the whole message; with `parallel_tool_calls: false` the first call
/// alone; with `tool_choice: "none"` the calls stay text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_and_tool_calls() {
    let cfg = EngineConfig {
        max_seqs: 1,
        ..EngineConfig::default()
    };
    let (server, _) = Server::start_with(cfg, ServerConfig::default(), Some(scripted(&SCRIPT))).await;
    let body = json!({
        "messages": [{"role": "user", "content": "Weather in Zürich and San José?"}],
        "tools": [weather_tool()],
        "max_tokens": 64, "ignore_eos": true, "stop": ["<END>"], "temperature": 0,
    });
    let (status, v) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    let m = &choice["message"];
    assert_eq!(m["reasoning_content"], "The user wants the weather.\n");
    assert_eq!(m["content"], "Checking now.");
    let calls = m["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 2);
    let args: Vec<Value> = calls
        .iter()
        .map(|c| serde_json::from_str(c["function"]["arguments"].as_str().unwrap()).unwrap())
        .collect();
    assert_eq!(args[0], json!({"city": "Zürich", "days": 2}));
    assert_eq!(args[1], json!({"city": "San José", "days": 3}));
    for (i, c) in calls.iter().enumerate() {
        assert_eq!(c["type"], "function");
        assert_eq!(c["function"]["name"], "get_weather");
        assert_eq!(c["index"], i);
        assert!(c["id"].as_str().unwrap().starts_with("call-"));
    }
    assert_eq!(v["usage"]["completion_tokens"], SCRIPT.len());

    // Streamed: the same parts, reasoning first, the calls whole with their indices.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = server.stream("/v1/chat/completions", &streamed).await;
    let (mut reasoning, mut content, mut streamed_calls) = (String::new(), String::new(), Vec::new());
    let mut finish = Value::Null;
    for c in chunks(&events) {
        let d = &c["choices"][0]["delta"];
        reasoning.push_str(d["reasoning_content"].as_str().unwrap_or(""));
        if !reasoning.is_empty() && d["reasoning_content"].is_null() {
            // Content comes after the reasoning.
            assert!(reasoning.ends_with('\n'));
        }
        content.push_str(d["content"].as_str().unwrap_or(""));
        streamed_calls.extend(d["tool_calls"].as_array().cloned().unwrap_or_default());
        if !c["choices"][0]["finish_reason"].is_null() {
            finish = c["choices"][0]["finish_reason"].clone();
        }
    }
    assert_eq!(
        (reasoning.as_str(), content.as_str()),
        ("The user wants the weather.\n", "Checking now.")
    );
    assert_eq!(finish, "tool_calls");
    assert_eq!(streamed_calls.len(), 2);
    for (s, w) in streamed_calls.iter().zip(calls) {
        assert_eq!(s["index"], w["index"]);
        assert_eq!(s["function"], w["function"]);
    }

    // parallel_tool_calls false: the first call alone, whole and streamed.
    let mut one = body.clone();
    one["parallel_tool_calls"] = json!(false);
    let (_, v) = server.post("/v1/chat/completions", &one).await;
    let only = &v["choices"][0]["message"]["tool_calls"];
    assert_eq!(only.as_array().map(Vec::len), Some(1), "{v}");
    assert_eq!(only[0]["function"], calls[0]["function"]);
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    one["stream"] = json!(true);
    let events = server.stream("/v1/chat/completions", &one).await;
    let streamed: Vec<Value> = chunks(&events)
        .iter()
        .flat_map(|c| {
            c["choices"][0]["delta"]["tool_calls"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .collect();
    assert_eq!(streamed.len(), 1);
    assert_eq!(streamed[0]["function"], calls[0]["function"]);
    assert_eq!(streamed[0]["index"], 0);

    // tool_choice "auto" is the default.
    let mut auto = body.clone();
    auto["tool_choice"] = json!("auto");
    let (_, v) = server.post("/v1/chat/completions", &auto).await;
    let auto_calls = v["choices"][0]["message"]["tool_calls"].as_array().unwrap();
    let names = |c: &[Value]| c.iter().map(|c| c["function"].clone()).collect::<Vec<_>>();
    assert_eq!(names(auto_calls), names(calls), "{v}");

    // tool_choice "none": no parsing, the blocks are content; the reasoning is still split.
    let mut none = body.clone();
    none["tool_choice"] = json!("none");
    let (_, v) = server.post("/v1/chat/completions", &none).await;
    let m = &v["choices"][0]["message"];
    assert!(m.get("tool_calls").is_none());
    assert!(m["content"].as_str().unwrap().contains("<tool_call>"));
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    server.stop().await;

    // With the reasoning parser off, everything is content.
    let cfg = EngineConfig {
        max_seqs: 1,
        ..EngineConfig::default()
    };
    let plain = ServerConfig {
        reasoning: false,
        ..ServerConfig::default()
    };
    let (server, _) = Server::start_with(cfg, plain, Some(scripted(&SCRIPT))).await;
    let mut no_tools = body.clone();
    no_tools.as_object_mut().unwrap().remove("tools");
    let (_, v) = server.post("/v1/chat/completions", &no_tools).await;
    let m = &v["choices"][0]["message"];
    assert!(m["content"].as_str().unwrap().starts_with("<think>\nThe user"));
    assert!(m.get("reasoning_content").is_none());
    server.stop().await;
}

/// A client that goes away mid-stream, or while it waits for a whole response, cancels its
/// request: its sequence is gone from
/// `/metrics` within a second and counted as aborted, and a request queued behind it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_frees_its_slot() {
    let cfg = EngineConfig {
        max_seqs: 1,
        ..EngineConfig::default()
    };
    let (server, _) = Server::start(cfg, ServerConfig::default()).await;
    // Streamed, and whole (the client leaves while the server still waits for the end).
    for (left, stream) in [(1.0, true), (2.0, false)] {
        let long = json!({ "prompt": [1, 2, 3], "max_tokens": 4000, "ignore_eos": true, "stream": stream });
        let url = format!("{}/v1/completions", server.url);
        let client = tokio::spawn(async move {
            let mut r = reqwest::Client::new().post(url).json(&long).send().await.unwrap();
            while r.chunk().await.unwrap().is_some() {}
        });
        // The engine publishes its load after its first step: wait for it.
        let shown = Instant::now();
        let mut m = server.metrics().await;
        while m["qwen36_requests_running"] != 1.0 && shown.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(Duration::from_millis(10)).await;
            m = server.metrics().await;
        }
        assert_eq!(m["qwen36_requests_running"], 1.0, "stream: {stream}");
        assert_eq!(m["qwen36_choices_finished_total{reason=\"abort\"}"], left - 1.0);
        // Its tokens count while it runs (the rate of a long generation shows before its end).
        let before = m["qwen36_generation_tokens_total"];
        while m["qwen36_generation_tokens_total"] <= before && shown.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(Duration::from_millis(10)).await;
            m = server.metrics().await;
        }
        assert!(m["qwen36_generation_tokens_total"] > before, "stream: {stream}");
        assert_eq!(
            m["vllm:generation_tokens_total{model_name=\"qwen36\"}"],
            m["qwen36_generation_tokens_total"]
        );
        client.abort();
        assert!(
            client.await.unwrap_err().is_cancelled(),
            "the client was still waiting"
        );
        let gone = Instant::now();
        loop {
            let m = server.metrics().await;
            if m["qwen36_requests_running"] == 0.0
                && m["qwen36_choices_finished_total{reason=\"abort\"}"] == left
            {
                break;
            }
            assert!(
                gone.elapsed() < Duration::from_secs(1),
                "stream: {stream}: still running {:?} after the client left",
                gone.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let (status, _) = server
        .post("/v1/completions", &json!({ "prompt": [4, 5], "max_tokens": 2 }))
        .await;
    assert_eq!(status, 200);
    server.stop().await;
}

/// Waits (up to 5 s) until the metric `name` reads `value`; returns the metrics then.
async fn until(server: &Server, name: &str, value: f64) -> std::collections::HashMap<String, f64> {
    let start = Instant::now();
    loop {
        let m = server.metrics().await;
        if m[name] == value || start.elapsed() > Duration::from_secs(5) {
            assert_eq!(m[name], value, "{name}");
            return m;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// vLLM's `priority`: behind a running request, a later request of a lower value runs before
/// an earlier one of the default 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lower_priority_value_runs_first() {
    let cfg = EngineConfig {
        max_seqs: 1,
        ..EngineConfig::default()
    };
    let (server, _) = Server::start(cfg, ServerConfig::default()).await;
    let url = format!("{}/v1/completions", server.url);
    let send = |body: Value| {
        let url = url.clone();
        tokio::spawn(async move {
            let r = reqwest::Client::new().post(url).json(&body).send().await.unwrap();
            assert_eq!(r.status().as_u16(), 200);
            let _: Value = r.json().await.unwrap();
            Instant::now()
        })
    };
    let long = send(json!({ "prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": true }));
    until(&server, "qwen36_requests_running", 1.0).await;
    // (Long enough that the urgent request's response arrives well before it ends.)
    let normal = send(json!({ "prompt": [4, 5], "max_tokens": 64, "ignore_eos": true }));
    until(&server, "qwen36_requests_waiting", 1.0).await;
    let urgent = send(json!({ "prompt": [6, 7], "max_tokens": 4, "ignore_eos": true, "priority": -1 }));
    let m = until(&server, "qwen36_requests_waiting", 2.0).await;
    assert_eq!(
        m["qwen36_requests_running"], 1.0,
        "both queued behind the long one"
    );
    let (long, normal, urgent) = (long.await.unwrap(), normal.await.unwrap(), urgent.await.unwrap());
    assert!(long < urgent && urgent < normal, "the urgent request ran second");
    server.stop().await;
}

/// A request the engine fails (here its text cannot be decoded at its fourth piece) answers 500
/// with the engine's error when whole, and an error object then `[DONE]` after the chunks it
/// had when streamed; both count as `error`, their sequences leave, and the server goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_the_engine_fails_gets_an_error_and_the_server_goes_on() {
    let calls = Arc::new(AtomicUsize::new(0));
    let fail_at = Arc::new(AtomicUsize::new(usize::MAX));
    let (c, f) = (calls.clone(), fail_at.clone());
    let failing: Arc<dyn Detokenize> = Arc::new(move |ids: &[u32]| -> Result<String, String> {
        if c.fetch_add(1, Ordering::SeqCst) == f.load(Ordering::SeqCst) {
            return Err("an injected failure".into());
        }
        Ok("x".repeat(ids.len()))
    });
    let cfg = EngineConfig {
        max_seqs: 1,
        ..EngineConfig::default()
    };
    let (server, _) = Server::start_with(cfg, ServerConfig::default(), Some(failing)).await;
    let path = "/v1/completions";
    let body =
        |stream: bool| json!({"prompt": [1, 2, 3], "max_tokens": 20, "ignore_eos": true, "stream": stream});
    let arm = || fail_at.store(calls.load(Ordering::SeqCst) + 3, Ordering::SeqCst);
    arm();
    let (status, whole) = server.post(path, &body(false)).await;
    assert_eq!(status, 500, "{whole}");
    let message = whole["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("detokenizing failed: an injected failure"),
        "{message}"
    );
    assert_eq!(whole["error"]["type"], "server_error");
    arm();
    let events = server.stream(path, &body(true)).await;
    let n = events.len();
    assert_eq!(events[n - 1], "[DONE]");
    let error: Value = serde_json::from_str(&events[n - 2]).unwrap();
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("an injected failure"),
        "{error}"
    );
    assert_eq!(
        streamed_text(&events[..n - 2]),
        "xxx",
        "the chunks before the failure"
    );
    server.wait_for_idle().await;
    let m = server.metrics().await;
    assert_eq!(m["qwen36_choices_finished_total{reason=\"error\"}"], 2.0);
    fail_at.store(usize::MAX, Ordering::SeqCst);
    let (status, ok) = server.post(path, &body(false)).await;
    assert_eq!(
        (status, ok["choices"][0]["text"].as_str()),
        (200, Some("x".repeat(20).as_str()))
    );
    server.stop().await;
}

/// A bad-input case: path, body, API key, status, what the message says, the field at fault.
type Case<'a> = (&'a str, String, Option<&'a str>, u16, &'a str, Option<&'a str>);

/// Bad input gets OpenAI's error object with its status, the field at fault and a code where
/// one applies; the API key is checked before the body is read; the server goes on answering.
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
    let c = "/v1/completions";
    let chat = "/v1/chat/completions";
    let big = format!(r#"{{"prompt": "{}"}}"#, "a".repeat(1 << 17));
    // 16 times the limit: still read (and dropped) before the answer, which the client gets
    // whole instead of a reset connection.
    let huge = format!(r#"{{"prompt": "{}"}}"#, "a".repeat((1 << 20) - 20));
    let many_stops = format!(r#"{{"prompt": [1], "stop": {}}}"#, json!(vec!["x"; 17]));
    // (A prompt of another shape is quoted, cut after 60 characters.)
    let long_prompt_says = format!(r#"prompt [1,"{}…: expected"#, "x".repeat(56));
    // (path, body, key, status, the message says, param)
    let cases: Vec<Case> = vec![
        (c, r#"{"prompt": [1, 2]}"#.into(), None, 401, "API key", None),
        (c, r#"{"prompt": [1, 2]}"#.into(), Some("wrong"), 401, "API key", None),
        // The key is checked first: a malformed or huge body without it is 401, not 400/413.
        (c, r#"{"prompt": [1, 2"#.into(), None, 401, "API key", None),
        (c, big.clone(), Some("sesamx"), 401, "API key", None),
        (c, huge.clone(), Some("sesamx"), 401, "API key", None),
        (c, huge, ok, 413, "length limit", None),
        (c, r#"{"prompt": [1, 2"#.into(), ok, 400, "EOF", None),
        (c, r#"{"prompt": [1], "max_tokens": "x"}"#.into(), ok, 400, "max_tokens", None),
        (c, r#"{"max_tokens": 3}"#.into(), ok, 400, "prompt", Some("prompt")),
        (c, r#"{"prompt": [1], "temperature": -1}"#.into(), ok, 400, "temperature", None),
        (c, r#"{"prompt": [1], "max_tokens": 5000}"#.into(), ok, 400, "context", None),
        (c, r#"{"prompt": [], "max_tokens": 2}"#.into(), ok, 400, "no tokens", None),
        (c, r#"{"prompt": [99999], "max_tokens": 2}"#.into(), ok, 400, "vocabulary", None),
        // Prompt + max_tokens past usize: refused, not wrapped around.
        (
            c,
            r#"{"prompt": [1, 2, 3], "max_tokens": 18446744073709551614}"#.into(),
            ok,
            400,
            "context",
            None,
        ),
        (c, r#"{"prompt": [1], "n": 17}"#.into(), ok, 400, "n = 17", Some("n")),
        (c, r#"{"prompt": [1], "n": 0}"#.into(), ok, 400, "n = 0", Some("n")),
        (c, r#"{"prompt": [1], "n": 2, "return_token_ids": true}"#.into(), ok, 400, "one choice", Some("n")),
        (c, r#"{"prompt": [1], "model": "gpt-4"}"#.into(), ok, 404, "gpt-4", Some("model")),
        (c, big, ok, 413, "length limit", None),
        (chat, r#"{"messages": [{"role": "user", "content": "hi"}], "echo": true}"#.into(), ok, 400, "echo: completions only", Some("echo")),
        (c, r#"{"prompt": [1], "max_tokens": 0}"#.into(), ok, 400, "only with echo", Some("max_tokens")),
        (chat, r#"{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}"#.into(), ok, 400, "at least one token", Some("max_tokens")),
        (c, r#"{"prompt": [1], "best_of": 3}"#.into(), ok, 400, "best_of", Some("best_of")),
        // vLLM's fields this server does not serve: refused, not ignored.
        (c, r#"{"prompt": [1], "bad_words": ["x", " "]}"#.into(), ok, 400, "bad_words: an empty word", Some("bad_words")),
        (c, format!(r#"{{"prompt": [1], "bad_words": {}}}"#, json!(vec!["x"; 257])), ok, 400, "bad_words: 257 words, at most 256", Some("bad_words")),
        // "x" and " x" are the bundled vocabulary's ids 92 and 915: none left to draw.
        (c, r#"{"prompt": [1], "allowed_token_ids": [92, 915], "bad_words": ["x"]}"#.into(), ok, 400, "masks every id of allowed_token_ids", None),
        (chat, r#"{"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 1 }}"}"#.into(), ok, 400, "--trust-request-chat-template", Some("chat_template")),
        (c, r#"{"prompt": "hi", "chat_template": "{{ 1 }}"}"#.into(), ok, 400, "chat_template: a chat's", Some("chat_template")),
        (c, r#"{"prompt": [1], "use_beam_search": true}"#.into(), ok, 400, "beam search", Some("use_beam_search")),
        (c, r#"{"prompt": [1], "truncate_prompt_tokens": 0}"#.into(), ok, 400, "expected -1", Some("truncate_prompt_tokens")),
        (c, r#"{"prompt": [1], "truncate_prompt_tokens": 99999999}"#.into(), ok, 400, "expected -1", Some("truncate_prompt_tokens")),
        (c, r#"{"prompt": [1], "allowed_token_ids": [3, 99999]}"#.into(), ok, 400, "allowed_token_ids: token 99999", None),
        ("/tokenize", r#"{"prompt": "hi"}"#.into(), None, 401, "API key", None),
        ("/tokenize", r#"{"prompt": "hi", "model": "gpt-4"}"#.into(), ok, 404, "gpt-4", Some("model")),
        ("/tokenize", r#"{"messages": []}"#.into(), ok, 400, "at least one message", Some("messages")),
        ("/tokenize", r#"{"max_tokens": 3}"#.into(), ok, 400, "a list of either is needed", Some("prompt")),
        ("/detokenize", r#"{"tokens": [1, 99999]}"#.into(), ok, 400, "99999 is not a token", Some("tokens")),
        ("/detokenize", r#"{"tokens": "hi"}"#.into(), ok, 400, "tokens", None),
        (c, r#"{"prompt": [1], "logit_bias": {"x": 10}}"#.into(), ok, 400, "not a token id", Some("logit_bias")),
        (c, r#"{"prompt": [1], "logit_bias": {"5": 60, "05": 60}}"#.into(), ok, 400, "token 5 is given twice", Some("logit_bias")),
        (c, r#"{"prompt": [1], "logit_bias": {"5": 101}}"#.into(), ok, 400, "[-100, 100]", Some("logit_bias")),
        (c, r#"{"prompt": [1], "logit_bias": {"5": "1"}}"#.into(), ok, 400, "[-100, 100]", Some("logit_bias")),
        (c, r#"{"prompt": [1], "logit_bias": {"4096": 1}}"#.into(), ok, 400, "logit_bias: token 4096", None),
        (c, r#"{"prompt": [1], "suffix": "x"}"#.into(), ok, 400, "suffix", Some("suffix")),
        (c, r#"{"prompt": [1], "logprobs": 21}"#.into(), ok, 400, "at most 20", Some("logprobs")),
        (c, r#"{"prompt": [1], "logprobs": true}"#.into(), ok, 400, "number of alternatives", Some("logprobs")),
        (c, many_stops, ok, 400, "at most 16", Some("stop")),
        (c, r#"{"prompt": [1], "stop": [""]}"#.into(), ok, 400, "0 bytes", Some("stop")),
        (c, r#"{"prompt": [1], "max_tokens": 3, "min_tokens": 4}"#.into(), ok, 400, "min_tokens = 4 is over max_tokens = 3", Some("min_tokens")),
        (c, r#"{"prompt": [1], "min_tokens": 2, "guided_regex": "a+"}"#.into(), ok, 400, "min_tokens: not with guided_regex", Some("min_tokens")),
        (c, r#"{"prompt": [1], "min_tokens": -1}"#.into(), ok, 400, "min_tokens", None),
        (c, r#"{"prompt": [1], "priority": 1.5}"#.into(), ok, 400, "priority", None),
        (c, r#"{"prompt": [1], "top_p": 0}"#.into(), ok, 400, "top_p", None),
        (c, r#"{"prompt": [1], "presence_penalty": -3e38}"#.into(), ok, 400, "presence_penalty", None),
        (c, r#"{"prompt": [1], "top_k": -2}"#.into(), ok, 400, "top_k = -2", Some("top_k")),
        (
            c,
            r#"{"prompt": [1], "tools": [{"type": "function", "function": {"name": "f"}}]}"#.into(),
            ok,
            400,
            "chat/completions only",
            Some("tools"),
        ),
        // Fields the endpoint would otherwise ignore without a word.
        (
            c,
            r#"{"prompt": [1], "stream_options": {"include_usage": true}}"#.into(),
            ok,
            400,
            "only with stream",
            Some("stream_options"),
        ),
        (c, r#"{"prompt": [1], "top_logprobs": 2}"#.into(), ok, 400, "chat only", Some("top_logprobs")),
        (
            c,
            r#"{"prompt": [1], "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}"#.into(),
            ok,
            400,
            "chat/completions only",
            Some("tools"),
        ),
        (c, r#"{"prompt": [1], "stop_token_ids": [4096]}"#.into(), ok, 400, "stop token 4096", None),
        (c, json!({"prompt": vec!["a"; 257]}).to_string(), ok, 400, "257 prompts; one request takes at most 256", Some("prompt")),
        (c, json!({"prompt": vec!["a"; 100], "n": 3}).to_string(), ok, 400, "n = 3 choices of 100 prompts", Some("n")),
        (c, r#"{"prompt": [[1, 2], []]}"#.into(), ok, 400, "prompt[1]: request: the prompt has no tokens", None),
        ("/tokenize", r#"{"prompt": ["a", "b"]}"#.into(), ok, 400, "2 prompts; /tokenize takes one", Some("prompt")),
        (c, r#"{"prompt": [1, "x"]}"#.into(), ok, 400, r#"prompt [1,"x"]: expected a text, a list of token ids (0..2^32), or a list of either"#, Some("prompt")),
        (
            c,
            format!(r#"{{"prompt": [1, "{}"]}}"#, "x".repeat(100)),
            ok,
            400,
            &long_prompt_says,
            Some("prompt"),
        ),
        (c, r#"{"prompt": [1], "seed": 1.5}"#.into(), ok, 400, "seed 1.5", None),
        (chat, r#"{"messages": []}"#.into(), ok, 400, "at least one", Some("messages")),
        (chat, r#"{"messages": [{"role": "wizard", "content": "hi"}]}"#.into(), ok, 400, "wizard", Some("messages")),
        (chat, r#"{"messages": [{"content": "hi"}]}"#.into(), ok, 400, "role", Some("messages")),
        (chat, r#"{"messages": "hi"}"#.into(), ok, 400, "messages", None),
        (
            chat,
            r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}, {"type": "text", "text": "what is it?"}]}]}"#.into(),
            ok,
            400,
            "content[0]: a part of type \"image_url\"",
            Some("messages"),
        ),
        (
            chat,
            r#"{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}"#.into(),
            ok,
            400,
            "needs logprobs",
            Some("top_logprobs"),
        ),
        (
            chat,
            r#"{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", "json_schema": {"schema": "x"}}}"#.into(),
            ok,
            400,
            "json_schema: needs",
            Some("response_format"),
        ),
        (
            chat,
            r#"{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "any"}"#.into(),
            ok,
            400,
            "tool_choice \"any\": expected",
            Some("tool_choice"),
        ),
        (
            chat,
            r#"{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "tool", "function": {"name": "f"}}}"#.into(),
            ok,
            400,
            "expected \"auto\", \"none\", \"required\" or",
            Some("tool_choice"),
        ),
        (
            chat,
            r#"{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}"#.into(),
            ok,
            400,
            "tools[0]",
            Some("tools"),
        ),
        ("/v1/nothing", "{}".into(), ok, 404, "no such endpoint", None),
    ];
    for (path, body, key, status, says, param) in cases {
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
        assert_eq!(v["error"]["param"].as_str(), param, "{path}: {msg}");
        let code = &v["error"]["code"];
        assert!(code.is_null() || code.is_string(), "{code}");
        if status == 401 {
            assert_eq!(code, "invalid_api_key");
        }
        if msg.contains("context is") {
            assert_eq!(code, "context_length_exceeded");
        }
    }
    // A method the route does not take: 405 with an error object.
    let r = client
        .get(format!("{}/v1/completions", server.url))
        .bearer_auth("sesame")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 405);
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("method"));
    // A repetition penalty of 1e-40 on a prompt's tokens (their logits once overflowed to inf,
    // and top-p then indexed an empty candidate list, a panic that stopped the engine): served.
    let body = r#"{"prompt": [1, 1, 2], "max_tokens": 4, "temperature": 1, "top_p": 0.5, "repetition_penalty": 1e-40}"#;
    let r = send(c, body.into(), ok).await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    // The scheme's case is free (RFC 9110): `bearer KEY` is let in, `Basic KEY` is not.
    for (auth, status) in [
        ("bearer sesame", 200),
        ("BEARER  sesame", 200),
        ("Basic sesame", 401),
    ] {
        let r = client
            .post(format!("{}{c}", server.url))
            .header("authorization", auth)
            .json(&json!({"prompt": [1, 2], "max_tokens": 2}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), status, "{auth}");
    }
    // Still answering, with the key.
    let r = send(c, r#"{"prompt": [1, 2], "max_tokens": 2}"#.into(), ok)
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
    assert_eq!(models["data"][0]["max_model_len"], 4096);
    let health = client.get(format!("{}/health", server.url)).send().await.unwrap();
    assert_eq!(health.status().as_u16(), 200);
    let m = server.metrics().await;
    assert_eq!(
        m["qwen36_http_responses_total{route=\"completions\",status=\"401\"}"],
        6.0
    );
    assert_eq!(m["qwen36_engine_up"], 1.0);
    server.stop().await;
}

/// vLLM's `/tokenize` gives the ids a completion or chat request of the same body runs (its
/// count is the request's `prompt_tokens`), and `/detokenize` turns them back into the text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_gives_the_ids_a_request_runs() {
    let (server, generator) = Server::start(EngineConfig::default(), ServerConfig::default()).await;
    let text = "def fibonacci(n):";
    let (status, t) = server.post("/tokenize", &json!({ "prompt": text })).await;
    assert_eq!(status, 200, "{t}");
    assert_eq!(t["tokens"], json!(generator.encode(text).unwrap()));
    assert_eq!(t["count"], t["tokens"].as_array().unwrap().len());
    let (_, d) = server
        .post("/v1/completions", &json!({ "prompt": text, "max_tokens": 1 }))
        .await;
    assert_eq!(t["count"], d["usage"]["prompt_tokens"]);
    assert!(t["max_model_len"].as_u64().unwrap() > 0);
    let (_, back) = server
        .post("/detokenize", &json!({ "tokens": t["tokens"] }))
        .await;
    assert_eq!(back["prompt"], text);
    // A chat: the template's rendering with the request's options, as a chat request runs it.
    let chat = json!({
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"enable_thinking": false},
    });
    let (_, t) = server.post("/tokenize", &chat).await;
    let without_tools = t["count"].as_u64().unwrap();
    let rendered = generator
        .chat_template()
        .unwrap()
        .render(&[qwen36::ChatMessage::new("user", "hi")], true, false)
        .unwrap();
    assert_eq!(t["tokens"], json!(generator.encode(&rendered).unwrap()));
    let mut asked = chat.clone();
    asked["max_tokens"] = json!(1);
    let (_, d) = server.post("/v1/chat/completions", &asked).await;
    assert_eq!(t["count"], d["usage"]["prompt_tokens"], "{d}");
    let (_, back) = server
        .post("/detokenize", &json!({ "tokens": t["tokens"] }))
        .await;
    assert_eq!(back["prompt"], rendered);
    // With tools (a chat's field) and the served model's name.
    let mut asked = chat.clone();
    asked["tools"] = json!([weather_tool()]);
    asked["model"] = json!(ServerConfig::default().model_id);
    let (status, t) = server.post("/tokenize", &asked).await;
    assert_eq!(status, 200, "{t}");
    asked["max_tokens"] = json!(1);
    let (_, d) = server.post("/v1/chat/completions", &asked).await;
    assert_eq!(t["count"], d["usage"]["prompt_tokens"], "{d}");
    assert!(
        t["count"].as_u64() > Some(without_tools + 50),
        "the tools are rendered: {t}"
    );
    // Counted by route: three answers of /tokenize, two of /detokenize.
    let m = server.metrics().await;
    let answered =
        |route: &str| m[&format!("qwen36_http_responses_total{{route=\"{route}\",status=\"200\"}}")];
    assert_eq!((answered("tokenize"), answered("detokenize")), (3.0, 2.0));
    server.stop().await;
}

/// Forms that OpenAI clients send are served as their plain equivalents: `null` for an unset
/// field, a prompt in a one-element list, a negative seed (its two's complement bits), a
/// `developer` message (OpenAI's newer `system`), `max_completion_tokens` and a zero
/// `top_logprobs` on completions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_forms_equal_their_plain_equivalents() {
    let (server, _) = Server::start(EngineConfig::default(), ServerConfig::default()).await;
    let c = "/v1/completions";
    let answer = |r: (u16, Value)| {
        assert_eq!(r.0, 200, "{}", r.1);
        let choice = &r.1["choices"][0];
        let text = choice["text"].as_str().or(choice["message"]["content"].as_str());
        // (Not `cached_tokens`: a repeated prompt hits the prefix cache.)
        let usage = &r.1["usage"];
        (
            text.unwrap().to_string(),
            usage["prompt_tokens"].clone(),
            usage["completion_tokens"].clone(),
        )
    };
    let plain = answer(
        server
            .post(
                c,
                &json!({"prompt": "def f(x):", "max_tokens": 6, "temperature": 0}),
            )
            .await,
    );
    let nulls = json!({
        "prompt": ["def f(x):"], "max_completion_tokens": 6, "temperature": 0, "stream": null,
        "stream_options": null, "stop_token_ids": null, "ignore_eos": null, "return_token_ids": null,
        "chat_template_kwargs": null, "seed": null, "n": null, "stop": null, "logprobs": null,
    });
    assert_eq!(answer(server.post(c, &nulls).await), plain);
    // vLLM's fields at their neutral values (those not served are refused otherwise).
    let neutral = json!({
        "prompt": "def f(x):", "max_tokens": 6, "temperature": 0, "skip_special_tokens": true,
        "use_beam_search": false, "bad_words": [], "prompt_logprobs": null, "allowed_token_ids": [],
        "return_tokens_as_token_ids": false, "guided_grammar": null, "chat_template": null,
        "structured_outputs": {}, "truncate_prompt_tokens": null,
    });
    assert_eq!(answer(server.post(c, &neutral).await), plain);
    // `truncate_prompt_tokens`: the prompt's last N ids (-1: the context, which keeps them all).
    let long: Vec<u32> = (10..40).collect();
    let truncated =
        |k: Value| json!({"prompt": long, "max_tokens": 6, "temperature": 0, "truncate_prompt_tokens": k});
    let last = |n: usize| json!({"prompt": long[long.len() - n..], "max_tokens": 6, "temperature": 0});
    let kept = answer(server.post(c, &truncated(json!(7))).await);
    assert_eq!(kept, answer(server.post(c, &last(7)).await));
    assert_eq!(kept.1, json!(7));
    assert_eq!(
        answer(server.post(c, &truncated(json!(-1))).await),
        answer(server.post(c, &last(long.len())).await)
    );
    assert_eq!(
        answer(server.post(c, &truncated(json!(100))).await),
        answer(server.post(c, &last(long.len())).await)
    );
    // An echo of a truncated prompt is the kept ids' text.
    let mut echoed = truncated(json!(7));
    echoed["echo"] = json!(true);
    let (_, e) = server.post(c, &echoed).await;
    let mut kept_echo = last(7);
    kept_echo["echo"] = json!(true);
    let (_, k) = server.post(c, &kept_echo).await;
    assert_eq!(e["choices"][0]["text"], k["choices"][0]["text"]);
    // A text prompt's too: the kept ids' text, not the text given.
    let text = json!({"prompt": "def f(x): return x + 1", "max_tokens": 1, "temperature": 0,
                      "echo": true, "truncate_prompt_tokens": 2, "return_token_ids": true});
    let (_, t) = server.post(c, &text).await;
    let prompt_ids: Vec<u32> = serde_json::from_value(t["choices"][0]["prompt_token_ids"].clone()).unwrap();
    assert_eq!(prompt_ids.len(), 2, "{t}");
    let (_, by_ids) = server
        .post(
            c,
            &json!({"prompt": prompt_ids, "max_tokens": 1, "temperature": 0, "echo": true}),
        )
        .await;
    assert_eq!(t["choices"][0]["text"], by_ids["choices"][0]["text"]);
    assert!(
        !t["choices"][0]["text"].as_str().unwrap().starts_with("def"),
        "{t}"
    );
    let ids = answer(
        server
            .post(
                c,
                &json!({"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0}),
            )
            .await,
    );
    let listed = json!({"prompt": [[5, 6, 7]], "max_tokens": 6, "temperature": 0});
    assert_eq!(answer(server.post(c, &listed).await), ids);
    // (A chat field at its neutral value on completions: no alternatives asked for.)
    let neutral = json!({"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "top_logprobs": 0});
    assert_eq!(answer(server.post(c, &neutral).await), ids);
    let sampled =
        |seed: Value| json!({"prompt": [5, 6, 7], "max_tokens": 12, "temperature": 1, "seed": seed});
    assert_eq!(
        answer(server.post(c, &sampled(json!(-1))).await),
        answer(server.post(c, &sampled(json!(u64::MAX))).await)
    );
    let chat = |role: &str| {
        json!({"messages": [{"role": role, "content": "Answer briefly."}, {"role": "user", "content": "hi"}],
               "max_tokens": 6, "temperature": 0})
    };
    let system = answer(server.post("/v1/chat/completions", &chat("system")).await);
    assert_eq!(
        answer(server.post("/v1/chat/completions", &chat("developer")).await),
        system
    );
    server.stop().await;
}

/// A list of prompts (OpenAI's batched form, which lm-eval sends) answers each as a request of
/// its own would: prompt p's choice j at index p·n + j, sampled with seed + j, echoed and with
/// its log-probabilities and ids; the usage counts each prompt once; streamed, the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_prompts_answer_as_requests_of_their_own() {
    let (server, _) = Server::start(EngineConfig::default(), ServerConfig::default()).await;
    let c = "/v1/completions";
    let texts = ["def f(x):", "import numpy as np\n", "class A:"];
    let body = |prompt: Value, n: usize, seed: usize| {
        json!({"prompt": prompt, "n": n, "seed": seed, "max_tokens": 8, "temperature": 1.0,
               "echo": true, "logprobs": 1})
    };
    let (status, all) = server.post(c, &body(json!(texts), 2, 7)).await;
    assert_eq!(status, 200, "{all}");
    let choices = all["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 6);
    let (mut prompt_tokens, mut completion_tokens) = (0, 0);
    for (p, text) in texts.iter().enumerate() {
        for j in 0..2 {
            let (_, one) = server.post(c, &body(json!(text), 1, 7 + j)).await;
            let (got, want) = (&choices[p * 2 + j], &one["choices"][0]);
            assert_eq!(got["index"], p * 2 + j);
            assert_eq!(got["text"], want["text"], "prompt {p}, choice {j}");
            assert!(got["text"].as_str().unwrap().starts_with(text));
            // The same tokens; log-probabilities within the engine's batch tolerance (a batch of
            // six rows runs the CPU's products in other blocks than one row: 1e-5 relative).
            let (lg, lw) = (&got["logprobs"], &want["logprobs"]);
            assert_eq!(lg["tokens"], lw["tokens"], "prompt {p}, choice {j}");
            let close = |a: &Value, b: &Value| match (a.as_f64(), b.as_f64()) {
                (Some(a), Some(b)) => (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                _ => a == b,
            };
            let (ag, aw) = (
                lg["token_logprobs"].as_array().unwrap(),
                lw["token_logprobs"].as_array().unwrap(),
            );
            assert_eq!(ag.len(), aw.len());
            assert!(
                ag.iter().zip(aw).all(|(a, b)| close(a, b)),
                "prompt {p}, choice {j}: {lg} {lw}"
            );
            assert_eq!(got["finish_reason"], want["finish_reason"]);
            if j == 0 {
                prompt_tokens += one["usage"]["prompt_tokens"].as_u64().unwrap();
            }
            completion_tokens += one["usage"]["completion_tokens"].as_u64().unwrap();
        }
    }
    assert_eq!(all["usage"]["prompt_tokens"].as_u64(), Some(prompt_tokens));
    assert_eq!(
        all["usage"]["completion_tokens"].as_u64(),
        Some(completion_tokens)
    );
    assert_eq!(
        all["usage"]["total_tokens"].as_u64(),
        Some(prompt_tokens + completion_tokens)
    );
    // Streamed: each index's chunks add up to its whole text and tokens.
    let mut streamed = body(json!(texts), 2, 7);
    streamed["stream"] = json!(true);
    let mut by_choice = vec![String::new(); 6];
    let mut tokens_by_choice = vec![Vec::new(); 6];
    for chunk in chunks(&server.stream(c, &streamed).await) {
        let choice = &chunk["choices"][0];
        let i = choice["index"].as_u64().unwrap() as usize;
        by_choice[i].push_str(choice["text"].as_str().unwrap());
        if let Some(t) = choice["logprobs"]["tokens"].as_array() {
            tokens_by_choice[i].extend(t.iter().cloned());
        }
    }
    let whole: Vec<&str> = choices.iter().map(|c| c["text"].as_str().unwrap()).collect();
    assert_eq!(by_choice, whole);
    let whole_tokens: Vec<Vec<Value>> = choices
        .iter()
        .map(|c| c["logprobs"]["tokens"].as_array().unwrap().clone())
        .collect();
    assert_eq!(tokens_by_choice, whole_tokens);
    // Without a seed each prompt draws its own, as requests of their own do.
    let hot =
        json!({"prompt": ["import", "import"], "max_tokens": 32, "temperature": 1.5, "ignore_eos": true});
    let (_, h) = server.post(c, &hot).await;
    assert_ne!(h["choices"][0]["text"], h["choices"][1]["text"], "{h}");
    // A refused prompt is named among several (prompt p of choice p·n + j), not alone.
    let (status, e) = server.post(c, &json!({"prompt": [[1], []], "n": 2})).await;
    assert_eq!(status, 400);
    assert_eq!(
        e["error"]["message"],
        "prompt[1]: request: the prompt has no tokens"
    );
    let (_, e) = server.post(c, &json!({"prompt": [[]]})).await;
    assert_eq!(e["error"]["message"], "request: the prompt has no tokens");
    // Lists of ids, greedy: each choice its own prompt's ids and answer.
    let ids = [vec![5u32, 6, 7], vec![8, 9]];
    let greedy = |prompt: Value| json!({"prompt": prompt, "max_tokens": 6, "temperature": 0, "return_token_ids": true});
    let (status, both) = server.post(c, &greedy(json!(ids))).await;
    assert_eq!(status, 200, "{both}");
    for (p, prompt) in ids.iter().enumerate() {
        let (_, one) = server.post(c, &greedy(json!(prompt))).await;
        let got = &both["choices"][p];
        assert_eq!(got["prompt_token_ids"], json!(prompt));
        assert_eq!(got["token_ids"], one["choices"][0]["token_ids"]);
        assert_eq!(got["text"], one["choices"][0]["text"]);
    }
    assert_eq!(both["usage"]["prompt_tokens"], 5);
    // Served from the prefix cache: each prompt's cached tokens, summed.
    let long = [(100..150).collect::<Vec<u32>>(), (200..240).collect()];
    let mut cached = 0;
    for prompt in &long {
        let once = json!({"prompt": prompt, "max_tokens": 1, "temperature": 0});
        server.post(c, &once).await;
        let (_, again) = server.post(c, &once).await;
        let hit = again["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert!(hit > 0, "{again}");
        cached += hit;
    }
    let (_, both) = server
        .post(c, &json!({"prompt": long, "max_tokens": 1, "temperature": 0}))
        .await;
    assert_eq!(
        both["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(cached)
    );
    server.stop().await;
    // More requests than the engine takes at once: refused, not a full queue on every retry.
    let small = EngineConfig {
        max_seqs: 2,
        max_queue: 2,
        ..EngineConfig::default()
    };
    let (server, _) = Server::start(small, ServerConfig::default()).await;
    let (status, e) = server.post(c, &json!({"prompt": ["a", "b", "c"], "n": 2})).await;
    assert_eq!(status, 400, "{e}");
    assert_eq!(
        e["error"]["message"],
        "n = 2 choices of 3 prompts: one request makes at most 4 (prompts × n)"
    );
    let (status, _) = server
        .post(c, &json!({"prompt": ["a", "b"], "n": 2, "max_tokens": 2}))
        .await;
    assert_eq!(status, 200);
    server.stop().await;
}

/// vLLM's `prompt_logprobs`: per prompt token (the first `null`) the token's own entry, with
/// the log-probability an echo gives it and its rank, and the k most likely ids ranked 1..=k;
/// completions per choice, chat once; the output's `logprobs` untouched; not streamed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_logprobs_as_vllm_gives_them() {
    let (server, generator) = Server::start(EngineConfig::default(), ServerConfig::default()).await;
    let c = "/v1/completions";
    let prompt = "def fibonacci(n):";
    let ids = generator.encode(prompt).unwrap();
    let (status, v) = server
        .post(
            c,
            &json!({"prompt": prompt, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let choice = &v["choices"][0];
    assert!(choice["logprobs"].is_null(), "{v}");
    let rows = choice["prompt_logprobs"].as_array().unwrap();
    assert_eq!(rows.len(), ids.len());
    assert!(rows[0].is_null());
    // The echo's log-probabilities of the same prompt (its first entry null too).
    let (_, echo) = server
        .post(
            c,
            &json!({"prompt": prompt, "max_tokens": 0, "echo": true, "logprobs": 2}),
        )
        .await;
    let echoed = &echo["choices"][0]["logprobs"];
    for (i, row) in rows.iter().enumerate().skip(1) {
        let row = row.as_object().unwrap();
        let own = &row[&ids[i].to_string()];
        let lp = own["logprob"].as_f64().unwrap();
        assert!(
            (lp - echoed["token_logprobs"][i].as_f64().unwrap()).abs() < 1e-4,
            "{i}: {own}"
        );
        assert_eq!(own["decoded_token"], echoed["tokens"][i], "{i}");
        let rank = own["rank"].as_u64().unwrap();
        // Two alternatives ranked 1 and 2, the own token among them or beside them.
        let mut ranked: Vec<(u64, f64)> = row
            .values()
            .map(|e| (e["rank"].as_u64().unwrap(), e["logprob"].as_f64().unwrap()))
            .collect();
        ranked.sort_by_key(|a| a.0);
        assert_eq!(row.len(), if rank <= 2 { 2 } else { 3 }, "{i}: {row:?}");
        assert_eq!((ranked[0].0, ranked[1].0), (1, 2), "{i}: {row:?}");
        assert!(ranked[0].1 >= ranked[1].1, "{i}: {row:?}");
        if rank > 2 {
            assert!(ranked[1].1 >= lp, "{i}: {row:?}");
        }
        let best = echoed["top_logprobs"][i]
            .as_object()
            .unwrap()
            .values()
            .map(|x| x.as_f64().unwrap());
        let best = best.fold(f64::NEG_INFINITY, f64::max);
        assert!((ranked[0].1 - best).abs() < 1e-4, "{i}: {row:?}");
        assert_eq!(rank == 1, (lp - best).abs() < 1e-6, "{i}: {row:?}");
    }
    // A prompt's entries in each of its choices, each prompt its own.
    let (_, two) = server
        .post(
            c,
            &json!({"prompt": [prompt, "import os"], "n": 2, "max_tokens": 2, "temperature": 0,
                    "prompt_logprobs": 2}),
        )
        .await;
    let lists: Vec<&Value> = (0..4).map(|i| &two["choices"][i]["prompt_logprobs"]).collect();
    assert_eq!(lists[0], &choice["prompt_logprobs"]);
    assert_eq!(lists[0], lists[1]);
    assert_eq!(lists[2], lists[3]);
    let os = generator.encode("import os").unwrap();
    assert_eq!(lists[2].as_array().unwrap().len(), os.len());
    // Beside an echo's log-probabilities: each keeps its own count of alternatives; an echo
    // alone gives no `prompt_logprobs`.
    let (_, both) = server
        .post(
            c,
            &json!({"prompt": prompt, "max_tokens": 1, "echo": true, "logprobs": 1, "prompt_logprobs": 3}),
        )
        .await;
    let b = &both["choices"][0];
    let tops = b["logprobs"]["top_logprobs"].as_array().unwrap();
    assert!(tops[1..].iter().all(|t| t.as_object().unwrap().len() == 1), "{b}");
    let rows = b["prompt_logprobs"].as_array().unwrap();
    assert!(
        rows[1..]
            .iter()
            .all(|r| (3..=4).contains(&r.as_object().unwrap().len())),
        "{b}"
    );
    assert!(echo["choices"][0].get("prompt_logprobs").is_none(), "{echo}");
    // Chat: once, at the top.
    let (status, chat) = server
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2,
                    "prompt_logprobs": 0}),
        )
        .await;
    assert_eq!(status, 200, "{chat}");
    // (No ids asked for: none at the top.)
    assert!(chat.get("prompt_token_ids").is_none(), "{chat}");
    let rows = chat["prompt_logprobs"].as_array().unwrap();
    assert_eq!(
        rows.len() as u64,
        chat["usage"]["prompt_tokens"].as_u64().unwrap()
    );
    assert!(rows[1..].iter().all(|r| r.as_object().unwrap().len() == 1));
    // Refused: streamed, or a count out of range.
    for (body, says) in [
        (
            json!({"prompt": prompt, "stream": true, "prompt_logprobs": 1}),
            "not with stream",
        ),
        (json!({"prompt": prompt, "prompt_logprobs": 21}), "0..=20"),
        (json!({"prompt": prompt, "prompt_logprobs": -1}), "0..=20"),
    ] {
        let (status, e) = server.post(c, &body).await;
        assert_eq!(status, 400, "{e}");
        assert!(e["error"]["message"].as_str().unwrap().contains(says), "{e}");
        assert_eq!(e["error"]["param"], "prompt_logprobs");
    }
    server.stop().await;
}

/// `X-Request-Id` (vLLM's header): a client's id names its response (header and `id`), whole
/// and streamed, on both endpoints; without one the server draws an id and sends it back; a
/// malformed one is a 400 naming the header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_ids_go_back_in_the_header() {
    let (server, _) = Server::start(EngineConfig::default(), ServerConfig::default()).await;
    let send = |path: &'static str, body: Value, id: Option<&'static str>| {
        let mut r = reqwest::Client::new()
            .post(format!("{}{path}", server.url))
            .json(&body);
        if let Some(id) = id {
            r = r.header("X-Request-Id", id);
        }
        r.send()
    };
    let completion = json!({"prompt": [1, 2, 3], "max_tokens": 2});
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    for (path, body, prefix) in [
        ("/v1/completions", completion.clone(), "cmpl-"),
        ("/v1/chat/completions", chat, "chatcmpl-"),
    ] {
        let r = send(path, body.clone(), Some("trace-42")).await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-request-id"], "trace-42");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["id"], format!("{prefix}trace-42"));
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let r = send(path, streamed, Some("trace-43")).await.unwrap();
        assert_eq!(r.headers()["x-request-id"], "trace-43");
        let text = r.text().await.unwrap();
        assert!(text.contains(&format!(r#""id":"{prefix}trace-43""#)), "{text}");
        // Drawn here: the header is the id's end.
        let r = send(path, body, None).await.unwrap();
        let drawn = r.headers()["x-request-id"].to_str().unwrap().to_string();
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["id"], format!("{prefix}{drawn}"));
        assert_eq!(drawn.len(), 16);
    }
    // An empty one is none; a malformed one (a space, 129 characters) is refused.
    let r = send("/v1/completions", completion.clone(), Some(""))
        .await
        .unwrap();
    assert_eq!(r.headers()["x-request-id"].len(), 16);
    let long: &'static str = Box::leak("x".repeat(129).into_boxed_str());
    for bad in ["two words", long] {
        let r = send("/v1/completions", completion.clone(), Some(bad))
            .await
            .unwrap();
        assert_eq!(r.status(), 400);
        let v: Value = r.json().await.unwrap();
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .starts_with("X-Request-Id:"),
            "{v}"
        );
    }
    // An error answers with the client's id too.
    let r = send(
        "/v1/completions",
        json!({"prompt": [1], "max_tokens": "x"}),
        Some("trace-44"),
    )
    .await
    .unwrap();
    assert_eq!(
        (r.status().as_u16(), &r.headers()["x-request-id"]),
        (400, &"trace-44".parse().unwrap())
    );
    let ok: &'static str = Box::leak("x".repeat(128).into_boxed_str());
    let r = send("/v1/completions", completion, Some(ok)).await.unwrap();
    assert_eq!(r.headers()["x-request-id"], ok);
    server.stop().await;
}

/// vLLM's `allowed_token_ids` keeps every generated id among them (greedy and sampled, plain
/// and with prompt-lookup drafts, which stay lossless); `/ping` answers as `/health` does and
/// `/version` names the version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allowed_token_ids_and_probes() {
    let spec_cfg = ServerConfig {
        speculation: Some(Speculation::ngram(3)),
        ..ServerConfig::default()
    };
    let (server, _) = Server::start(EngineConfig::default(), ServerConfig::default()).await;
    let (drafting, _) = Server::start(EngineConfig::default(), spec_cfg).await;
    let c = "/v1/completions";
    let allowed = [11u32, 12, 13, 220, 279];
    for temperature in [0.0, 1.0] {
        let body = json!({"prompt": "def f(x):", "max_tokens": 24, "temperature": temperature,
                          "seed": 5, "allowed_token_ids": [279, 11, 12, 13, 220, 12],
                          "return_token_ids": true});
        let (status, v) = server.post(c, &body).await;
        assert_eq!(status, 200, "{v}");
        let ids: Vec<u32> = serde_json::from_value(v["choices"][0]["token_ids"].clone()).unwrap();
        assert_eq!(ids.len(), 24, "{v}");
        assert!(ids.iter().all(|t| allowed.contains(t)), "{ids:?}");
        let (_, d) = drafting.post(c, &body).await;
        assert_eq!(d["choices"][0], v["choices"][0], "drafts change nothing");
    }
    let client = reqwest::Client::new();
    for path in ["/ping", "/health"] {
        let r = client.get(format!("{}{path}", server.url)).send().await.unwrap();
        assert_eq!(r.status(), 200, "{path}");
    }
    let r = client.post(format!("{}/ping", server.url)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = client
        .get(format!("{}/version", server.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
    server.stop().await;
    drafting.stop().await;
}

/// vLLM's `min_tokens` runs a request past the end-of-turn id it would stop at (none among its
/// first tokens, which start as the plain run's), then it stops at one; `include_stop_str_in_output`
/// ends the text after the stop string instead of before it, streamed or whole, and keeps the
/// text of a stop id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_tokens_and_kept_stop_strings() {
    let (server, generator) = Server::start(EngineConfig::default(), ServerConfig::default()).await;
    let c = "/v1/completions";
    let ids_of =
        |v: &Value| -> Vec<u32> { serde_json::from_value(v["choices"][0]["token_ids"].clone()).unwrap() };
    let prompt =
        "<|im_start|>user\nWrite a Python function `add`: Return a + b.<|im_end|>\n<|im_start|>assistant\n";
    let body = json!({ "prompt": prompt, "max_tokens": 200, "temperature": 0, "return_token_ids": true });
    let (status, plain) = server.post(c, &body).await;
    assert_eq!(status, 200, "{plain}");
    assert_eq!(plain["choices"][0]["finish_reason"], "stop");
    let plain = ids_of(&plain);
    let ends = generator.default_stop_ids();
    assert!(ends.contains(plain.last().unwrap()));
    let k = plain.len();
    let mut longer = body.clone();
    longer["min_tokens"] = json!(k + 5);
    let (status, v) = server.post(c, &longer).await;
    assert_eq!(status, 200, "{v}");
    let out = ids_of(&v);
    assert!(
        out.len() > k + 5 || v["choices"][0]["finish_reason"] == "length",
        "{v}"
    );
    assert!(!out[..k + 5].iter().any(|t| ends.contains(t)), "{v}");
    assert_eq!(out[..k - 1], plain[..k - 1]);
    if v["choices"][0]["finish_reason"] == "stop" {
        assert!(ends.contains(out.last().unwrap()), "{v}");
    }

    let body = json!({ "prompt": "def f(x):", "max_tokens": 24, "temperature": 0 });
    let (_, whole) = server.post(c, &body).await;
    let text = whole["choices"][0]["text"].as_str().unwrap();
    let mut with_ids = body.clone();
    with_ids["return_token_ids"] = json!(true);
    let ids = ids_of(&server.post(c, &with_ids).await.1);
    // A token not written before it stops the output there.
    let at = (2..ids.len()).find(|&i| !ids[..i].contains(&ids[i])).unwrap();
    let tokenizer = generator.tokenizer().unwrap();
    let decode = |ids: &[u32]| tokenizer.decode(ids, true).unwrap();
    assert_eq!(decode(&ids), text);
    for (keep, want) in [(false, decode(&ids[..at])), (true, decode(&ids[..=at]))] {
        assert_ne!(decode(&ids[..at]), decode(&ids[..=at]));
        let mut b = body.clone();
        b["stop_token_ids"] = json!([ids[at]]);
        b["include_stop_str_in_output"] = json!(keep);
        let (_, v) = server.post(c, &b).await;
        assert_eq!(
            v["choices"][0]["text"],
            want.as_str(),
            "keep {keep}: the stop id's text"
        );
    }
    let stop: String = text.chars().skip(6).take(3).collect();
    let at = text.find(&stop).unwrap();
    for (keep, want) in [(false, &text[..at]), (true, &text[..at + stop.len()])] {
        let mut b = body.clone();
        b["stop"] = json!([stop]);
        b["include_stop_str_in_output"] = json!(keep);
        let (_, v) = server.post(c, &b).await;
        assert_eq!(v["choices"][0]["text"], want, "keep {keep}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "keep {keep}");
        b["stream"] = json!(true);
        assert_eq!(streamed_text(&server.stream(c, &b).await), want, "keep {keep}");
    }
    server.stop().await;
}

/// A prefilled answer is continued (`continue_final_message`, vLLM's extension): the prompt is
/// the template's rendering cut after the final message's content, with no generation prompt;
/// `add_generation_prompt: false` alone leaves that prompt out; both true is a 400, and either
/// on completions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_final_message_is_continued() {
    let (server, generator) = Server::start(EngineConfig::default(), ServerConfig::default()).await;
    let chat = "/v1/chat/completions";
    let messages = json!([{"role": "user", "content": "Write a function."}, {"role": "assistant", "content": "def add(a, b):"}]);
    let template = generator.chat_template().unwrap();
    let none = serde_json::Map::new();
    let rendered = |add: bool| {
        template
            .render_json(messages.as_array().unwrap(), None, add, &none)
            .unwrap()
    };
    let prompt_tokens = |text: &str| json!(generator.encode(text).unwrap().len());
    let full = rendered(false);
    let cut = &full[..full.rfind("def add(a, b):").unwrap() + "def add(a, b):".len()];
    assert!(cut.len() < full.len(), "the template closes the turn: {full:?}");
    let body = |extra: Value| {
        let mut b = json!({"messages": messages, "max_tokens": 4, "temperature": 0});
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    let (status, r) = server
        .post(chat, &body(json!({"continue_final_message": true})))
        .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["usage"]["prompt_tokens"], prompt_tokens(cut));
    // The same final message as text parts: continued after its last text part.
    let mut parts = body(json!({"continue_final_message": true}));
    parts["messages"][1]["content"] = json!([{"type": "text", "text": "def add(a, b):"}]);
    let (status, r) = server.post(chat, &parts).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["usage"]["prompt_tokens"], prompt_tokens(cut));
    let (status, r) = server
        .post(chat, &body(json!({"add_generation_prompt": false})))
        .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["usage"]["prompt_tokens"], prompt_tokens(&full));
    let (status, r) = server.post(chat, &body(json!({}))).await;
    assert_eq!(
        r["usage"]["prompt_tokens"],
        prompt_tokens(&rendered(true)),
        "{status}"
    );
    let both = body(json!({"continue_final_message": true, "add_generation_prompt": true}));
    let (status, r) = server.post(chat, &both).await;
    assert_eq!(
        (status, r["error"]["param"].as_str()),
        (400, Some("continue_final_message"))
    );
    let on_completions = json!({"prompt": [1, 2], "max_tokens": 2, "continue_final_message": true});
    let (status, _) = server.post("/v1/completions", &on_completions).await;
    assert_eq!(status, 400);
    server.stop().await;
}

/// A small deterministic generator for the fuzz loop (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// A random JSON value of at most `depth` levels.
    fn value(&mut self, depth: usize) -> Value {
        match self.below(if depth == 0 { 6 } else { 8 }) {
            0 => Value::Null,
            1 => json!(self.below(2) == 0),
            2 => json!(self.next() as i64),
            3 => json!((self.next() as f64 / u64::MAX as f64 - 0.5) * 1e6),
            4 => json!(["", "a", "user", "\u{0}", "é日本", "<think>", "-1", "1e309"][self.below(8)]),
            5 => json!(self.below(40) as i64 - 5),
            6 => Value::Array((0..self.below(4)).map(|_| self.value(depth - 1)).collect()),
            _ => {
                let keys = ["role", "content", "type", "function", "name", "text", "x"];
                Value::Object(
                    (0..self.below(4))
                        .map(|_| (keys[self.below(keys.len())].to_string(), self.value(depth - 1)))
                        .collect(),
                )
            }
        }
    }
}

/// Random bodies (valid requests with fields replaced by random values, dropped or added,
/// random JSON, truncated or garbled bytes) answer 200 or a 4xx error object, never a 5xx, and
/// the server still answers afterwards. Bounded: 400 bodies or 60 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fuzzed_bodies_never_take_the_server_down() {
    let cfg = EngineConfig {
        max_seqs: 4,
        ..EngineConfig::default()
    };
    let (server, _) = Server::start(cfg, ServerConfig::default()).await;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let fields = [
        "prompt",
        "messages",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "n",
        "stream",
        "logprobs",
        "top_logprobs",
        "tools",
        "tool_choice",
        "stop_token_ids",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "chat_template_kwargs",
        "stream_options",
        "model",
        "max_completion_tokens",
        "ignore_eos",
        "response_format",
        "return_token_ids",
    ];
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let started = Instant::now();
    let mut statuses = std::collections::BTreeMap::new();
    for i in 0..400 {
        if started.elapsed() > Duration::from_secs(60) {
            break;
        }
        let chat = rng.below(2) == 0;
        let mut body = if chat {
            json!({ "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3 })
        } else {
            json!({ "prompt": "def f(", "max_tokens": 3 })
        };
        for _ in 0..1 + rng.below(3) {
            let f = fields[rng.below(fields.len())];
            match rng.below(3) {
                0 => {
                    body.as_object_mut().unwrap().remove(f);
                }
                _ => body[f] = rng.value(3),
            }
        }
        // Keep generation short whatever the fields say: the loop tests the parsing.
        if body
            .get("max_tokens")
            .is_some_and(|m| m.as_u64().is_some_and(|v| v > 8))
        {
            body["max_tokens"] = json!(8);
        }
        if body
            .get("max_completion_tokens")
            .is_some_and(|m| m.as_u64().is_some_and(|v| v > 8))
        {
            body["max_completion_tokens"] = json!(8);
        }
        // Absent or null: chat would run to the end of the context.
        if body.get("max_tokens").is_none_or(Value::is_null) {
            body["max_tokens"] = json!(4);
        }
        let mut bytes = body.to_string().into_bytes();
        match rng.below(8) {
            0 => bytes.truncate(rng.below(bytes.len() + 1)),
            1 => {
                let at = rng.below(bytes.len());
                bytes[at] = rng.next() as u8;
            }
            2 => bytes = rng.value(3).to_string().into_bytes(),
            _ => {}
        }
        let path = if chat {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        };
        let r = client
            .post(format!("{}{path}", server.url))
            .header("content-type", "application/json")
            .body(bytes.clone())
            .send()
            .await
            .unwrap_or_else(|e| panic!("body {i} got no answer: {e}"));
        let status = r.status().as_u16();
        *statuses.entry(status).or_insert(0) += 1;
        let text = r.text().await.unwrap();
        assert!(
            status == 200 || (400..500).contains(&status),
            "body {i} {}: {status} {text}",
            String::from_utf8_lossy(&bytes)
        );
        if status != 200 {
            let v: Value =
                serde_json::from_str(&text).unwrap_or_else(|_| panic!("{status}: not JSON: {text}"));
            assert!(v["error"]["message"].is_string(), "{text}");
        }
    }
    eprintln!("fuzz: {statuses:?} in {:?}", started.elapsed());
    assert!(statuses.get(&200).is_some_and(|&n| n > 20), "{statuses:?}");
    assert!(statuses.get(&400).is_some_and(|&n| n > 20), "{statuses:?}");
    let (status, _) = server
        .post("/v1/completions", &json!({ "prompt": [1, 2], "max_tokens": 2 }))
        .await;
    assert_eq!(status, 200);
    // The pools are empty once the engine has published the step that ended the last request.
    server.wait_for_idle().await;
    server.stop().await;
}

/// 200 requests at concurrency 16 (completions and chat, streamed and whole) all complete, and
/// `/metrics` accounts for every one: requests taken, choices finished, tokens generated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_of_200_requests_is_accounted_for() {
    let cfg = EngineConfig {
        max_seqs: 16,
        ..EngineConfig::default()
    };
    let (server, _) = Server::start(cfg, ServerConfig::default()).await;
    let server = Arc::new(server);
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let workers: Vec<_> = (0..16)
        .map(|_| {
            let (server, next) = (server.clone(), next.clone());
            tokio::spawn(async move {
                let mut tokens = 0u64;
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= 200 {
                        return tokens;
                    }
                    let chat = i % 2 == 0;
                    let (path, mut body) = if chat {
                        (
                            "/v1/chat/completions",
                            json!({ "messages": [{"role": "user", "content": format!("Question {i}?")}] }),
                        )
                    } else {
                        ("/v1/completions", json!({ "prompt": format!("def f{i}(x):") }))
                    };
                    body["max_tokens"] = json!(8 + i % 9);
                    body["seed"] = json!(i);
                    if i % 3 == 0 {
                        body["stream"] = json!(true);
                        body["stream_options"] = json!({ "include_usage": true });
                        let events = server.stream(path, &body).await;
                        assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
                        let usage = chunks(&events).last().unwrap()["usage"].clone();
                        tokens += usage["completion_tokens"].as_u64().unwrap();
                    } else {
                        let (status, v) = server.post(path, &body).await;
                        assert_eq!(status, 200, "{v}");
                        tokens += v["usage"]["completion_tokens"].as_u64().unwrap();
                    }
                }
            })
        })
        .collect();
    let mut tokens = 0;
    for w in workers {
        tokens += w.await.unwrap();
    }
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "load: 200 requests at concurrency 16 in {secs:.2} s: {:.1} req/s, {:.0} output tok/s",
        200.0 / secs,
        tokens as f64 / secs
    );
    let m = server.metrics().await;
    let requests =
        m["qwen36_requests_total{endpoint=\"chat\"}"] + m["qwen36_requests_total{endpoint=\"completions\"}"];
    assert_eq!(requests, 200.0);
    let finished: f64 = ["stop", "length", "tool_calls", "abort", "error"]
        .iter()
        .map(|r| m[&format!("qwen36_choices_finished_total{{reason=\"{r}\"}}")])
        .sum();
    assert_eq!(finished, 200.0);
    assert_eq!(m["qwen36_choices_finished_total{reason=\"error\"}"], 0.0);
    assert_eq!(m["qwen36_generation_tokens_total"], tokens as f64);
    assert_eq!(m["qwen36_time_to_first_token_seconds_count"], 200.0);
    // vLLM's names (what dashboards and autoscalers written for vLLM read) say the same.
    let vllm = |name: &str| m[&format!("vllm:{name}{{model_name=\"qwen36\"}}")];
    assert_eq!(vllm("generation_tokens_total"), tokens as f64);
    assert_eq!(vllm("prompt_tokens_total"), m["qwen36_prompt_tokens_total"]);
    assert_eq!(vllm("time_to_first_token_seconds_count"), 200.0);
    let succeeded: f64 = ["stop", "length", "abort", "error"]
        .iter()
        .map(|r| m[&format!("vllm:request_success_total{{model_name=\"qwen36\",finished_reason=\"{r}\"}}")])
        .sum();
    assert_eq!(succeeded, 200.0);
    // The engine's steps reach the metrics (on their own thread, as each step ends).
    assert!(m["qwen36_engine_step_seconds_count"] > 0.0);
    assert!(m["qwen36_engine_step_tokens_sum"] >= m["qwen36_engine_step_seconds_count"]);
    assert_eq!(
        m["qwen36_http_responses_total{route=\"chat\",status=\"200\"}"]
            + m["qwen36_http_responses_total{route=\"completions\",status=\"200\"}"],
        200.0
    );
    server.wait_for_idle().await;
    Arc::into_inner(server).unwrap().stop().await;
}

/// The official `openai` Python client against the server: completions and chat, streamed and
/// not, thinking on and off, and a tool call (tests/openai_client.py). It needs Python with
/// `openai` installed (`QWEN36_PYTHON`, default `python3`); CI installs it and sets
/// `QWEN36_REQUIRE_OPENAI=1`, which makes a missing client a failure instead of a skip.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_python_client_works() {
    let python = std::env::var("QWEN36_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_client = std::process::Command::new(&python)
        .args(["-c", "import openai"])
        .status()
        .is_ok_and(|s| s.success());
    if !has_client {
        assert!(
            std::env::var_os("QWEN36_REQUIRE_OPENAI").is_none(),
            "{python} cannot import openai (pip install openai, or set QWEN36_PYTHON)"
        );
        eprintln!("skipped: {python} cannot import openai (set QWEN36_PYTHON to a Python that can)");
        return;
    }
    let key = ServerConfig {
        api_key: Some("sesame".into()),
        ..ServerConfig::default()
    };
    let (server, _) = Server::start(EngineConfig::default(), key.clone()).await;
    let cfg = EngineConfig {
        max_seqs: 1,
        ..EngineConfig::default()
    };
    let (tools, _) = Server::start_with(cfg, key, Some(scripted(&SCRIPT))).await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
    let (url, tools_url) = (server.url.clone(), tools.url.clone());
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(python)
            .args(["-u", script, &url, &tools_url])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "openai client failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("all checks passed"), "{stdout}");
    eprint!("{stdout}");
    server.stop().await;
    tools.stop().await;
}
