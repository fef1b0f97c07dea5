//! Serving throughput and latency of the engine under an offered load, in the form of SGLang's
//! `bench_serving --dataset-name random`: `--num-prompts` requests of `--input-len` random
//! tokens, each generating `--output-len` tokens (no stop ids), at most `--concurrency` in flight.
//!
//! ```text
//! # Qwen3.6-27B shapes, random bf16 weights made on the GPU:
//! cargo run --release --features cuda --example bench_serving -- --cuda --concurrency 1,4,16
//! # with MTP at the published acceptance of the real head (tokens then mean nothing):
//! cargo run --release --features cuda --example bench_serving -- --cuda --mtp 3 \
//!     --accept-rates 0.963,0.804,0.640
//! # the bundled model on CPU:
//! cargo run --release --example bench_serving -- --model models/qwen36-tiny --dtype f32 \
//!     --input-len 128 --output-len 64 --concurrency 1,4
//! # a running server (examples/serve) over HTTP, streamed:
//! cargo run --release --example bench_serving -- --url http://127.0.0.1:8000 --concurrency 1,16
//! # multi-turn chats through the prefix cache (each turn resends the history and 100 new tokens):
//! cargo run --release --features cuda --example bench_serving -- --cuda --concurrency 1 \
//!     --input-len 8000 --turns 2 --turn-len 100
//! ```
//! Per concurrency: output tok/s, TPOT mean/p50/p99, TTFT mean/p99, the pool's peak memory, and
//! the mean decode step against the bytes it must move (weights once + each sequence's GDN
//! state read and written + its K/V read) at the copy bandwidth measured in the same run.

use std::time::Instant;

use clap::Parser;
use qwen36::engine::{Engine, EngineConfig, Event, Request, RequestHandle, Speculation};
use qwen36::model::MtpHead;
use qwen36::Qwen36Model;

#[path = "common/hw.rs"]
mod hw;
#[path = "common/load.rs"]
#[allow(dead_code)]
mod load;
use hw::{anyhow_like, copy_bandwidth, peak_gb, reset_peak, setup, Cost, ModelArgs};

#[derive(Parser, Debug)]
#[command(about = "Serving throughput and latency of the qwen36 engine under an offered load")]
struct Args {
    #[command(flatten)]
    run: ModelArgs,
    /// Prompt tokens per request.
    #[arg(long, default_value_t = 1024)]
    input_len: usize,
    /// Generated tokens per request.
    #[arg(long, default_value_t = 128)]
    output_len: usize,
    /// Requests in flight at most; one run per value.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    concurrency: Vec<usize>,
    /// Requests per run (default: 4 × concurrency, at least 4).
    #[arg(long)]
    num_prompts: Option<usize>,
    /// Tokens per engine step (prefill chunks and decode tokens together).
    #[arg(long, default_value_t = 2048)]
    step_tokens: usize,
    /// MTP drafts per verify (0: plain decoding).
    #[arg(long, default_value_t = 0)]
    mtp: usize,
    /// MTP drafts choose among the first this many token ids only.
    #[arg(long)]
    draft_vocab: Option<usize>,
    /// Timing mode: accept draft j with probability rates[j] instead of checking it (for random
    /// weights; the published Qwen3.6-27B MTP rates at k = 3 are 0.963,0.804,0.640).
    #[arg(long, value_delimiter = ',')]
    accept_rates: Option<Vec<f64>>,
    /// Always draft `--mtp` tokens (default: the engine picks 0..=k per round from the measured
    /// costs and acceptance).
    #[arg(long)]
    fixed_k: bool,
    /// Run every step eagerly (no CUDA graphs).
    #[arg(long)]
    eager: bool,
    /// Drive a running server (`examples/serve`) at this base URL over HTTP instead: streamed
    /// `/v1/completions` requests of random token ids (`ignore_eos`, greedy), timed as they
    /// arrive, as SGLang's bench_serving drives SGLang. The server's own flags set MTP.
    #[arg(long)]
    url: Option<String>,
    /// The API key for `--url`.
    #[arg(long)]
    api_key: Option<String>,
    /// Conversations of this many turns: each later turn resends the last prompt and its answer
    /// with `--turn-len` new tokens (the first prompt has `--input-len`); TTFT is reported per
    /// turn, with the prefix cache's hit rate.
    #[arg(long, visible_alias = "multi-turn", default_value_t = 1)]
    turns: usize,
    /// New tokens per later turn.
    #[arg(long, default_value_t = 100)]
    turn_len: usize,
    /// Every first prompt opens with the same this many tokens (a shared system prompt).
    #[arg(long, default_value_t = 0)]
    shared_prefix: usize,
    /// State slots for the prefix cache's GDN snapshots (0: no prefix cache).
    #[arg(long, default_value_t = 8)]
    prefix_snapshots: usize,
}

/// What one request saw.
struct Timing {
    submitted: Instant,
    first: Option<Instant>,
    last: Option<Instant>,
    tokens: usize,
    /// Its turn in its conversation (0: the first).
    turn: usize,
}

fn main() -> anyhow_like::Result<()> {
    let args = Args::parse();
    if let Some(url) = &args.url {
        return over_http(&args, url);
    }
    let random = args.run.model.is_none();
    let (device, dtype, mut cfg, weights) =
        setup(&args.run, qwen36::kernels::KernelPolicy::from_env(), None)?;
    if args.turns == 0 || args.shared_prefix > args.input_len {
        return Err("--turns must be at least 1 and --shared-prefix at most --input-len".into());
    }
    let per_seq = args.input_len + args.turns * (args.output_len + args.turn_len) + args.mtp + 1;
    cfg.max_position_embeddings = cfg.max_position_embeddings.max(per_seq);
    let copy_bw = copy_bandwidth(&device, dtype)?;
    eprintln!("measured: copy {:.1} GB/s (read + write)", copy_bw / 1e9);
    let model = Qwen36Model::from_weights(cfg.clone(), &weights)?;
    let head = match args.mtp {
        0 => None,
        _ => Some(MtpHead::load(&cfg, &weights)?),
    };
    if args.mtp > 0 && random && args.accept_rates.is_none() {
        eprintln!("note: random weights accept no drafts; pass --accept-rates to time MTP at a real head's acceptance");
    }
    if args.accept_rates.is_some() {
        eprintln!(
            "timing mode: drafts are accepted at the given rates, so the generated tokens are not meaningful"
        );
    }
    let cost = Cost::with_fp8(&cfg, dtype.size_in_bytes(), args.run.fp8);
    let vocab = cfg.vocab_size;
    // Warm-up (kernel modules, cuBLAS handles, the memory pool) outside the timed runs.
    {
        let warm_cfg = EngineConfig {
            max_seqs: 1,
            kv_blocks: Some(per_seq.div_ceil(16) + 1),
            ..Default::default()
        };
        let mut engine = match &head {
            Some(h) => Engine::with_mtp_head(model.clone(), h.clone(), warm_cfg)?,
            None => Engine::new(model.clone(), warm_cfg)?,
        };
        let mut req = Request::greedy(
            (0..args.input_len.min(256) as u32)
                .map(|i| i % vocab as u32)
                .collect(),
            4,
        );
        if args.mtp > 0 {
            req.speculation = Some(Speculation::Mtp { k: args.mtp });
        }
        let _warm = engine.submit(req)?;
        engine.run_to_completion()?;
    }
    println!(
        "input {} / output {} tokens, {dtype:?}, MTP k = {}{}",
        args.input_len,
        args.output_len,
        args.mtp,
        match &args.accept_rates {
            Some(r) => format!(" (accept rates {r:?})"),
            None => String::new(),
        }
    );
    println!(
        "| concurrency | prompts | output tok/s | TPOT mean / p50 / p99 (ms) | TTFT mean / p99 (ms) | decode step (ms) @ batch | of which forward / sampling / drafts / commits (ms) | step limit (ms) | peak GB |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for &conc in &args.concurrency {
        let n = args.num_prompts.unwrap_or((4 * conc).max(4));
        let block_size = 16;
        let engine_cfg = EngineConfig {
            max_seqs: conc,
            // Multi-turn: room for every conversation's history in the prefix cache too.
            kv_blocks: Some((conc + if args.turns > 1 { n } else { 0 }) * (per_seq.div_ceil(block_size) + 1)),
            block_size,
            max_queue: n,
            step_tokens: args.step_tokens.max(conc * (args.mtp + 1)),
            timing_accept_rates: args.accept_rates.clone(),
            adaptive_k: !args.fixed_k,
            cuda_graphs: !args.eager,
            prefix_snapshots: args.prefix_snapshots,
            draft_vocab: args.draft_vocab,
            max_model_len: None,
        };
        let mut engine = match &head {
            Some(h) => Engine::with_mtp_head(model.clone(), h.clone(), engine_cfg)?,
            None => Engine::new(model.clone(), engine_cfg)?,
        };
        reset_peak(&device);
        let mut next_id = random_ids(conc as u64, vocab);
        let shared: Vec<u32> = (0..args.shared_prefix).map(|_| next_id()).collect();
        // Prompts ready to go: (turn, prompt); a finished turn queues its conversation's next.
        let mut ready: std::collections::VecDeque<(usize, Vec<u32>)> = (0..n)
            .map(|_| {
                let own = (args.shared_prefix..args.input_len).map(|_| next_id());
                (0, shared.iter().copied().chain(own).collect())
            })
            .collect();
        let mut live: Vec<(usize, RequestHandle, Vec<u32>)> = Vec::new();
        let mut timings: Vec<Timing> = Vec::new();
        let (mut decode_ms, mut decode_batch, mut decode_steps) = (0.0, 0usize, 0usize);
        // Of the decode steps: forward, sampling, drafting and committing time.
        let mut parts = [0.0f64; 4];
        let start = Instant::now();
        while !ready.is_empty() || !live.is_empty() {
            while live.len() < conc {
                let Some((turn, prompt)) = ready.pop_front() else {
                    break;
                };
                let mut req = Request::greedy(prompt.clone(), args.output_len);
                if args.mtp > 0 {
                    req.speculation = Some(Speculation::Mtp { k: args.mtp });
                }
                live.push((timings.len(), engine.submit(req)?, prompt));
                timings.push(Timing {
                    submitted: Instant::now(),
                    first: None,
                    last: None,
                    tokens: 0,
                    turn,
                });
            }
            let t0 = Instant::now();
            let stats = engine.step()?;
            device.synchronize()?;
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            // A step of decode tokens (and verifies) only: no prefill chunk in it.
            if stats.sequences > 0 && stats.tokens <= stats.sequences * (args.mtp + 1) {
                decode_ms += ms;
                decode_batch += stats.sequences;
                decode_steps += 1;
                for (p, d) in
                    parts
                        .iter_mut()
                        .zip([stats.forward, stats.sampling, stats.drafting, stats.committing])
                {
                    *p += d.as_secs_f64() * 1e3;
                }
            }
            let now = Instant::now();
            live.retain_mut(|(i, h, history)| {
                let t = &mut timings[*i];
                for e in h.drain() {
                    match e {
                        Event::Token { ids, .. } => {
                            t.first.get_or_insert(now);
                            t.last = Some(now);
                            t.tokens += ids.len();
                            history.extend(ids);
                        }
                        Event::Finished { .. } => {
                            if t.turn + 1 < args.turns {
                                history.extend((0..args.turn_len).map(|_| next_id()));
                                ready.push_back((t.turn + 1, std::mem::take(history)));
                            }
                            return false;
                        }
                        Event::Failed { error } => {
                            eprintln!("request {i} failed: {error}");
                            return false;
                        }
                    }
                }
                true
            });
        }
        let secs = start.elapsed().as_secs_f64();
        let out_tokens: usize = timings.iter().map(|t| t.tokens).sum();
        let (mut tpot, mut ttft) = latencies(&timings);
        let (batch, step) = match decode_steps {
            0 => (0.0, f64::NAN),
            s => (decode_batch as f64 / s as f64, decode_ms / s as f64),
        };
        // Weights once, each sequence's GDN state read and written (k + 1 times in a verify),
        // and its K/V read at the mean context of its decode.
        let ctx = args.input_len + args.output_len / 2;
        let limit_bytes = cost.weight_bytes + batch * (cost.state_bytes(args.mtp + 1) + cost.kv_bytes(ctx));
        println!(
            "| {conc} | {n} | {:.1} | {:.2} / {:.2} / {:.2} | {:.1} / {:.1} | {step:.2} @ {batch:.1} | {:.2} / {:.2} / {:.2} / {:.2} | {:.2} | {} |",
            out_tokens as f64 / secs,
            mean(&tpot),
            quantile(&mut tpot, 0.5),
            quantile(&mut tpot, 0.99),
            mean(&ttft),
            quantile(&mut ttft, 0.99),
            parts[0] / decode_steps.max(1) as f64,
            parts[1] / decode_steps.max(1) as f64,
            parts[2] / decode_steps.max(1) as f64,
            parts[3] / decode_steps.max(1) as f64,
            limit_bytes / copy_bw * 1e3,
            peak_gb(&device).map_or("-".into(), |g| format!("{g:.1}")),
        );
        report_turns(&timings, engine.prefix_stats());
    }
    Ok(())
}

/// TTFT by turn (first turns against later ones) and the prefix cache's hit rate.
fn report_turns(timings: &[Timing], prefix: Option<qwen36::engine::PrefixStats>) {
    let ttft = |first: bool| -> Vec<f64> {
        timings
            .iter()
            .filter(|t| (t.turn == 0) == first)
            .filter_map(|t| t.first.map(|f| (f - t.submitted).as_secs_f64() * 1e3))
            .collect()
    };
    let (cold, warm) = (ttft(true), ttft(false));
    if !warm.is_empty() {
        println!(
            "  TTFT: first turns {:.1} ms, later turns {:.1} ms ({:.1}% of the first)",
            mean(&cold),
            mean(&warm),
            100.0 * mean(&warm) / mean(&cold)
        );
    }
    if let Some(p) = prefix {
        println!(
            "  prefix cache: {} of {} prompt tokens served from it ({:.1}%), {} hits of {} requests, {} snapshots, {} evictions",
            p.hit_tokens,
            p.lookup_tokens,
            100.0 * p.hit_tokens as f64 / p.lookup_tokens.max(1) as f64,
            p.hits,
            p.lookups,
            p.snapshots,
            p.evictions
        );
    }
}

/// Random prompt ids below `vocab` (xorshift), reproducible per run.
fn random_ids(seed: u64, vocab: usize) -> impl FnMut() -> u32 {
    let mut rng = 0x2545_f491_4f6c_dd1du64 ^ seed;
    move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % vocab as u64) as u32
    }
}

/// TPOT (ms) of each request with more than one token, and TTFT (ms) of each with one.
fn latencies(timings: &[Timing]) -> (Vec<f64>, Vec<f64>) {
    let ttft = timings
        .iter()
        .filter_map(|t| t.first.map(|f| (f - t.submitted).as_secs_f64() * 1e3))
        .collect();
    let tpot = timings
        .iter()
        .filter(|t| t.tokens > 1)
        .map(|t| (t.last.unwrap() - t.first.unwrap()).as_secs_f64() * 1e3 / (t.tokens - 1) as f64)
        .collect();
    (tpot, ttft)
}

/// One streamed completion of `prompt` through the server at `url`, timed as its tokens arrive.
async fn one_over_http(
    client: reqwest::Client,
    url: String,
    key: Option<String>,
    prompt: Vec<u32>,
    output_len: usize,
) -> Result<Timing, String> {
    let mut r = client
        .post(format!("{url}/v1/completions"))
        .json(&serde_json::json!({
            "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": true,
            "stream": true, "return_token_ids": true,
        }));
    if let Some(k) = &key {
        r = r.bearer_auth(k);
    }
    let mut t = Timing {
        submitted: Instant::now(),
        first: None,
        last: None,
        tokens: 0,
        turn: 0,
    };
    let mut resp = r.send().await.map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        return Err(format!(
            "{}: {}",
            resp.status(),
            resp.text().await.unwrap_or_default()
        ));
    }
    let mut pending = String::new();
    while let Some(bytes) = resp.chunk().await.map_err(|e| e.to_string())? {
        let now = Instant::now();
        pending.push_str(&String::from_utf8_lossy(&bytes));
        // Server-sent events end with a blank line; each carries one `data:` chunk.
        while let Some(end) = pending.find("\n\n") {
            let event: String = pending.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(data).map_err(|e| e.to_string())?;
            if v.get("error").is_some() {
                return Err(data.to_string());
            }
            let n = v["choices"][0]["token_ids"].as_array().map_or(0, Vec::len);
            if n > 0 {
                t.first.get_or_insert(now);
                t.last = Some(now);
                t.tokens += n;
            }
        }
    }
    Ok(t)
}

/// The `--url` mode: the same offered load through a running server, over HTTP with streaming.
fn over_http(args: &Args, url: &str) -> anyhow_like::Result<()> {
    if args.turns > 1 || args.shared_prefix > 0 {
        return Err("--turns and --shared-prefix run in process only (not with --url)".into());
    }
    // Only the vocabulary is needed, for the random prompts: the config's (default Qwen3.6-27B).
    let cfg = match &args.run.config {
        Some(path) => qwen36::Config::from_file(path)?,
        None => qwen36::Config::from_json(&serde_json::from_str(hw::QWEN36_27B)?)?,
    };
    let runtime = tokio::runtime::Runtime::new()?;
    println!(
        "input {} / output {} tokens, over HTTP at {url} (streamed /v1/completions)",
        args.input_len, args.output_len
    );
    println!("| concurrency | prompts | output tok/s | TPOT mean / p50 / p99 (ms) | TTFT mean / p99 (ms) |");
    println!("|---|---|---|---|---|");
    let client = reqwest::Client::new();
    let (url, key, output_len) = (url.to_string(), args.api_key.clone(), args.output_len);
    // Warm-up: one short request.
    let warm = (0..args.input_len.min(256) as u32).collect();
    runtime.block_on(one_over_http(client.clone(), url.clone(), key.clone(), warm, 4))?;
    for &conc in &args.concurrency {
        let n = args.num_prompts.unwrap_or((4 * conc).max(4));
        let mut next_id = random_ids(conc as u64, cfg.vocab_size);
        let prompts: Vec<Vec<u32>> = (0..n)
            .map(|_| (0..args.input_len).map(|_| next_id()).collect())
            .collect();
        let prompts = std::sync::Arc::new(std::sync::Mutex::new(prompts.into_iter()));
        let start = Instant::now();
        let timings: Vec<Timing> = runtime.block_on(async {
            // `conc` workers, each sending its next prompt when its last request ends.
            let workers: Vec<_> = (0..conc)
                .map(|_| {
                    let (client, url, key, prompts) =
                        (client.clone(), url.clone(), key.clone(), prompts.clone());
                    tokio::spawn(async move {
                        let mut done = Vec::new();
                        loop {
                            let next = prompts.lock().unwrap().next();
                            let Some(p) = next else {
                                return Ok::<_, String>(done);
                            };
                            done.push(
                                one_over_http(client.clone(), url.clone(), key.clone(), p, output_len)
                                    .await?,
                            );
                        }
                    })
                })
                .collect();
            let mut all = Vec::new();
            for w in workers {
                all.extend(w.await.map_err(|e| e.to_string())??);
            }
            Ok::<_, String>(all)
        })?;
        let secs = start.elapsed().as_secs_f64();
        let out_tokens: usize = timings.iter().map(|t| t.tokens).sum();
        let (mut tpot, mut ttft) = latencies(&timings);
        println!(
            "| {conc} | {n} | {:.1} | {:.2} / {:.2} / {:.2} | {:.1} / {:.1} |",
            out_tokens as f64 / secs,
            mean(&tpot),
            quantile(&mut tpot, 0.5),
            quantile(&mut tpot, 0.99),
            mean(&ttft),
            quantile(&mut ttft, 0.99),
        );
    }
    Ok(())
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// The `q` quantile (nearest rank) of `v`.
fn quantile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1]
}
