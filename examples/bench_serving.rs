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
//! # tensor parallelism over two GPUs (NCCL), the engine's ranks on threads of their own:
//! cargo run --release --features nccl --example bench_serving -- --cuda --tp 2 --concurrency 1,16
//! ```
//! Per concurrency: output tok/s, TPOT mean/p50/p99, TTFT mean/p99, the pool's peak memory, and
//! the mean decode step against the bytes it must move (weights once + each sequence's GDN
//! state read and written + its K/V read) at the copy bandwidth measured in the same run.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use clap::Parser;
use qwen36::engine::{
    Engine, EngineConfig, EngineStatus, Event, Request, RequestHandle, SpecStats, Speculation, StepStats,
};
use qwen36::model::{Communicator, MtpHead};
use qwen36::{Config, Qwen36Model};

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
    #[arg(long, default_value_t = 1024, value_parser = load::at_least_one)]
    input_len: usize,
    /// Generated tokens per request.
    #[arg(long, default_value_t = 128, value_parser = load::at_least_one)]
    output_len: usize,
    /// Requests in flight at most; one run per value.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16", value_parser = load::at_least_one)]
    concurrency: Vec<usize>,
    /// Requests per run (default: 4 × concurrency, at least 4).
    #[arg(long, value_parser = load::at_least_one)]
    num_prompts: Option<usize>,
    /// Tokens per engine step (prefill chunks and decode tokens together).
    #[arg(long, default_value_t = 2048, value_parser = load::at_least_one)]
    step_tokens: usize,
    /// MTP drafts per verify (0: plain decoding).
    #[arg(long, default_value_t = 0)]
    mtp: usize,
    /// MTP drafts choose among the first this many token ids only.
    #[arg(long)]
    draft_vocab: Option<usize>,
    /// Timing mode: accept draft j in a share rates[j] of the verifies instead of checking it
    /// (for random weights). Per position as vLLM reports them: the published Qwen3.6-27B MTP
    /// rates at k = 3 are 0.963,0.804,0.640, an accepted length of 3.41.
    #[arg(long, value_delimiter = ',', value_parser = load::probability)]
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
    #[arg(long, visible_alias = "multi-turn", default_value_t = 1, value_parser = load::at_least_one)]
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
    /// Tensor parallelism over N ranks (threads on the CPU, with --cuda one GPU each over NCCL in
    /// a build with --features nccl): the engine's ranks step in lockstep on threads of their
    /// own, driven through their client as a server drives them. The step limit then counts one
    /// rank's bytes (its shard plus the replicated embedding, norms and lm_head).
    #[arg(long, default_value_t = 1, value_parser = load::at_least_one)]
    tp: usize,
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

/// A request in flight: its handle, or (through an engine's client) its submit, which the engine
/// answers between two steps.
enum Submitted {
    Running(RequestHandle),
    Submitting(tokio::task::JoinHandle<qwen36::engine::Result<RequestHandle>>),
}

fn main() -> anyhow_like::Result<()> {
    let args = Args::parse();
    check(&args)?;
    if let Some(url) = &args.url {
        return over_http(&args, url);
    }
    if args.tp > 1 {
        return over_ranks(&args);
    }
    let (device, dtype, cfg, weights) = setup(&args.run, qwen36::kernels::KernelPolicy::from_env(), None)?;
    let cfg = with_room(&args, cfg);
    let copy_bw = copy_bandwidth(&device, dtype)?;
    eprintln!("measured: copy {:.1} GB/s (read + write)", copy_bw / 1e9);
    let model = Qwen36Model::from_weights(cfg.clone(), &weights)?;
    let head = match args.mtp {
        0 => None,
        _ => Some(MtpHead::load(&cfg, &weights)?),
    };
    let make = |engine_cfg: EngineConfig| match &head {
        Some(h) => Engine::with_mtp_head(model.clone(), h.clone(), engine_cfg),
        None => Engine::new(model.clone(), engine_cfg),
    };
    announce(&args);
    // Warm-up (kernel modules, cuBLAS handles, the memory pool) outside the timed runs.
    {
        let mut engine = make(warm_config(&args))?;
        let _warm = engine.submit(warm_request(&args, cfg.vocab_size))?;
        engine.run_to_completion()?;
    }
    let cost = Cost::with_fp8(&cfg, dtype.size_in_bytes(), args.run.fp8);
    print_header(&args, dtype);
    for &conc in &args.concurrency {
        let n = args.num_prompts.unwrap_or((4 * conc).max(4));
        let mut engine = make(engine_config(&args, conc, n))?;
        reset_peak(&device);
        let mut load = Load::new(&args, conc, n, cfg.vocab_size);
        let start = Instant::now();
        while !load.done() {
            load.fill(|reqs| {
                reqs.into_iter()
                    .map(|r| Ok(Submitted::Running(engine.submit(r)?)))
                    .collect()
            })?;
            let t0 = Instant::now();
            let stats = engine.step()?;
            device.synchronize()?;
            load.stepped(&stats, t0.elapsed());
            load.drain(None)?;
        }
        load.report(args.input_len, start.elapsed(), &cost, copy_bw, peak_gb(&device));
        report_turns(&load.timings, engine.prefix_stats());
    }
    Ok(())
}

/// `cfg` with room for a whole conversation of `args` in its context.
fn with_room(args: &Args, mut cfg: Config) -> Config {
    cfg.max_position_embeddings = cfg.max_position_embeddings.max(per_seq(args));
    cfg
}

/// The longest sequence a conversation of `args` reaches.
fn per_seq(args: &Args) -> usize {
    args.input_len + args.turns * (args.output_len + args.turn_len) + args.mtp + 1
}

/// What the runs mean, on stderr.
fn announce(args: &Args) {
    if args.mtp > 0 && args.run.model.is_none() && args.accept_rates.is_none() {
        eprintln!("note: random weights accept no drafts; pass --accept-rates to time MTP at a real head's acceptance");
    }
    if args.accept_rates.is_some() {
        eprintln!(
            "timing mode: drafts are accepted at the given rates, so the generated tokens are not meaningful"
        );
    }
}

/// The warm-up engine: one sequence, the runs' tokens per step (so that its prompt runs as one
/// sequence's prompt runs in them).
fn warm_config(args: &Args) -> EngineConfig {
    EngineConfig {
        max_seqs: 1,
        kv_blocks: Some(per_seq(args).div_ceil(16) + 1),
        step_tokens: args.step_tokens.max(args.mtp + 1),
        ..Default::default()
    }
}

/// The warm-up prompt: `--input-len` tokens (the kernels and cuBLAS's choices for a prompt of
/// that length are made before the runs' first one).
fn warm_prompt(args: &Args, vocab: usize) -> Vec<u32> {
    (0..args.input_len as u32).map(|i| i % vocab as u32).collect()
}

/// The warm-up request: [`warm_prompt`], four tokens.
fn warm_request(args: &Args, vocab: usize) -> Request {
    let mut req = Request::greedy(warm_prompt(args, vocab), 4);
    if args.mtp > 0 {
        req.speculation = Some(Speculation::Mtp { k: args.mtp });
    }
    req
}

/// The engine of one run: `conc` sequences, room for `n` queued requests.
fn engine_config(args: &Args, conc: usize, n: usize) -> EngineConfig {
    let block_size = 16;
    EngineConfig {
        max_seqs: conc,
        // Multi-turn: room for every conversation's history in the prefix cache too.
        kv_blocks: Some(
            (conc + if args.turns > 1 { n } else { 0 }) * (per_seq(args).div_ceil(block_size) + 1),
        ),
        block_size,
        max_queue: n,
        step_tokens: args.step_tokens.max(conc * (args.mtp + 1)),
        timing_accept_rates: args.accept_rates.clone(),
        adaptive_k: !args.fixed_k,
        cuda_graphs: !args.eager,
        prefix_snapshots: args.prefix_snapshots,
        draft_vocab: args.draft_vocab,
        max_model_len: None,
    }
}

fn print_header(args: &Args, dtype: DType) {
    println!(
        "input {} / output {} tokens, {dtype:?}, MTP k = {}{}{}",
        args.input_len,
        args.output_len,
        args.mtp,
        match &args.accept_rates {
            Some(r) => format!(" (accept rates {r:?})"),
            None => String::new(),
        },
        match args.tp {
            1 => String::new(),
            tp => format!(", {tp} tensor-parallel ranks (the step limit and peak GB: rank 0's)"),
        }
    );
    println!(
        "| concurrency | prompts | output tok/s | TPOT mean / p50 / p99 (ms) | TTFT mean / p99 (ms) | decode step (ms) @ batch | of which forward / sampling / drafts / commits (ms) | step limit (ms) | peak GB |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
}

/// One run's offered load: the prompts still to send, the requests in flight, what each saw,
/// and the decode steps' times.
struct Load {
    conc: usize,
    n: usize,
    /// (`--output-len`, `--mtp`, `--turns`, `--turn-len`).
    output_len: usize,
    mtp: usize,
    turns: usize,
    turn_len: usize,
    next_id: Box<dyn FnMut() -> u32>,
    /// Prompts ready to go: (turn, prompt); a finished turn queues its conversation's next.
    ready: VecDeque<(usize, Vec<u32>)>,
    /// (timing index, the request, the conversation so far).
    live: Vec<(usize, Submitted, Vec<u32>)>,
    timings: Vec<Timing>,
    /// Decode-only steps (no prefill chunk in them): their count, summed wall time (ms) and
    /// batch, and their forward, sampling, drafting and committing time (ms).
    decode_steps: usize,
    decode_ms: f64,
    decode_batch: usize,
    parts: [f64; 4],
    /// Decode-only steps whose forward replayed a CUDA graph; MTP draft steps (of every step)
    /// run and replayed.
    graphed_steps: usize,
    draft_steps: usize,
    draft_graphed: usize,
    /// The finished requests' speculation counters, summed.
    spec: SpecStats,
    /// Steps that ran prompt tokens: their count, tokens and sequences, and their wall,
    /// forward and drafting time (ms).
    prompt_steps: usize,
    prompt_step_rows: [usize; 2],
    prompt_step_ms: [f64; 3],
}

impl Load {
    fn new(args: &Args, conc: usize, n: usize, vocab: usize) -> Self {
        let mut next_id = random_ids(conc as u64, vocab);
        let shared: Vec<u32> = (0..args.shared_prefix).map(|_| next_id()).collect();
        let ready = (0..n)
            .map(|_| {
                let own = (args.shared_prefix..args.input_len).map(|_| next_id());
                (0, shared.iter().copied().chain(own).collect())
            })
            .collect();
        Self {
            conc,
            n,
            output_len: args.output_len,
            mtp: args.mtp,
            turns: args.turns,
            turn_len: args.turn_len,
            next_id: Box::new(next_id),
            ready,
            live: Vec::new(),
            timings: Vec::new(),
            decode_steps: 0,
            decode_ms: 0.0,
            decode_batch: 0,
            parts: [0.0; 4],
            graphed_steps: 0,
            draft_steps: 0,
            draft_graphed: 0,
            spec: SpecStats::default(),
            prompt_steps: 0,
            prompt_step_rows: [0; 2],
            prompt_step_ms: [0.0; 3],
        }
    }

    fn done(&self) -> bool {
        self.ready.is_empty() && self.live.is_empty()
    }

    /// Submits ready prompts (through `submit`, all at once) until `conc` are in flight.
    fn fill(
        &mut self,
        submit: impl FnOnce(Vec<Request>) -> qwen36::engine::Result<Vec<Submitted>>,
    ) -> qwen36::engine::Result<()> {
        let free = self.conc.saturating_sub(self.live.len()).min(self.ready.len());
        if free == 0 {
            return Ok(());
        }
        let batch: Vec<(usize, Vec<u32>)> = self.ready.drain(..free).collect();
        let reqs = batch
            .iter()
            .map(|(_, prompt)| {
                let mut req = Request::greedy(prompt.clone(), self.output_len);
                if self.mtp > 0 {
                    req.speculation = Some(Speculation::Mtp { k: self.mtp });
                }
                req
            })
            .collect();
        let submitted = Instant::now();
        for ((turn, prompt), handle) in batch.into_iter().zip(submit(reqs)?) {
            self.live.push((self.timings.len(), handle, prompt));
            self.timings.push(Timing {
                submitted,
                first: None,
                last: None,
                tokens: 0,
                turn,
            });
        }
        Ok(())
    }

    /// Counts a step that took `wall`: apart, those that ran decode tokens (and verifies) only
    /// and those that ran prompt tokens.
    fn stepped(&mut self, stats: &StepStats, wall: Duration) {
        self.draft_steps += stats.draft_steps;
        self.draft_graphed += stats.draft_steps_graphed;
        if stats.sequences == 0 {
            return;
        }
        if stats.tokens > stats.sequences * (self.mtp + 1) {
            self.prompt_steps += 1;
            self.prompt_step_rows[0] += stats.tokens;
            self.prompt_step_rows[1] += stats.sequences;
            for (p, d) in self
                .prompt_step_ms
                .iter_mut()
                .zip([wall, stats.forward, stats.drafting])
            {
                *p += d.as_secs_f64() * 1e3;
            }
            return;
        }
        self.graphed_steps += usize::from(stats.graphed);
        self.decode_ms += wall.as_secs_f64() * 1e3;
        self.decode_batch += stats.sequences;
        self.decode_steps += 1;
        let parts = [stats.forward, stats.sampling, stats.drafting, stats.committing];
        for (p, d) in self.parts.iter_mut().zip(parts) {
            *p += d.as_secs_f64() * 1e3;
        }
    }

    /// Takes the requests' events: tokens timed now, a finished turn queueing its
    /// conversation's next; submits the engine has answered become running requests (`rt`: the
    /// runtime their tasks run on). A refused submit ends the run with its error, as the
    /// in-process submit does.
    fn drain(&mut self, rt: Option<&tokio::runtime::Runtime>) -> anyhow_like::Result<()> {
        let now = Instant::now();
        let mut refused = None;
        let (timings, ready, next_id, spec) = (
            &mut self.timings,
            &mut self.ready,
            &mut self.next_id,
            &mut self.spec,
        );
        let (turns, turn_len) = (self.turns, self.turn_len);
        self.live.retain_mut(|(i, slot, history)| {
            if let (Submitted::Submitting(task), Some(rt)) = (&mut *slot, rt) {
                if !task.is_finished() {
                    return true;
                }
                match rt.block_on(task) {
                    Ok(Ok(h)) => *slot = Submitted::Running(h),
                    Ok(Err(e)) => {
                        refused.get_or_insert(format!("request {i} refused: {e}"));
                        return false;
                    }
                    Err(e) => {
                        refused.get_or_insert(format!("request {i}'s submit failed: {e}"));
                        return false;
                    }
                }
            }
            let Submitted::Running(h) = slot else {
                return true;
            };
            let t = &mut timings[*i];
            for e in h.drain() {
                match e {
                    Event::Token { ids, .. } => {
                        t.first.get_or_insert(now);
                        t.last = Some(now);
                        t.tokens += ids.len();
                        history.extend(ids);
                    }
                    Event::Finished { usage, .. } => {
                        spec.add(&usage.speculation);
                        if t.turn + 1 < turns {
                            history.extend((0..turn_len).map(|_| next_id()));
                            ready.push_back((t.turn + 1, std::mem::take(history)));
                        }
                        return false;
                    }
                    Event::Failed { error } => {
                        eprintln!("request {i} failed: {error}");
                        return false;
                    }
                    // (Not asked for.)
                    Event::Prompt { .. } => {}
                }
            }
            true
        });
        match refused {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// The run's row: throughput, latencies, the mean decode step against the bytes it must
    /// move (weights once, each sequence's GDN state read and written, k + 1 times in a
    /// verify, and its K/V read at the mean context of its decode) at `copy_bw`.
    fn report(&self, input_len: usize, elapsed: Duration, cost: &Cost, copy_bw: f64, peak: Option<f64>) {
        let out_tokens: usize = self.timings.iter().map(|t| t.tokens).sum();
        let (mut tpot, mut ttft) = latencies(&self.timings);
        let steps = self.decode_steps.max(1) as f64;
        let (batch, step) = match self.decode_steps {
            0 => (0.0, f64::NAN),
            s => (self.decode_batch as f64 / s as f64, self.decode_ms / s as f64),
        };
        let ctx = input_len + self.output_len / 2;
        let limit_bytes = cost.weight_bytes + batch * (cost.state_bytes(self.mtp + 1) + cost.kv_bytes(ctx));
        println!(
            "| {} | {} | {:.1} | {:.2} / {:.2} / {:.2} | {:.1} / {:.1} | {step:.2} @ {batch:.1} | {:.2} / {:.2} / {:.2} / {:.2} | {:.2} | {} |",
            self.conc,
            self.n,
            out_tokens as f64 / elapsed.as_secs_f64(),
            mean(&tpot),
            quantile(&mut tpot, 0.5),
            quantile(&mut tpot, 0.99),
            mean(&ttft),
            quantile(&mut ttft, 0.99),
            self.parts[0] / steps,
            self.parts[1] / steps,
            self.parts[2] / steps,
            self.parts[3] / steps,
            limit_bytes / copy_bw * 1e3,
            peak.map_or("-".into(), |g| format!("{g:.1}")),
        );
        eprintln!(
            "concurrency {}: {} of {} decode steps and {} of {} MTP draft steps replayed CUDA graphs",
            self.conc, self.graphed_steps, self.decode_steps, self.draft_graphed, self.draft_steps
        );
        if self.prompt_steps > 0 {
            let n = self.prompt_steps as f64;
            let [wall, forward, drafts] = self.prompt_step_ms.map(|t| t / n);
            eprintln!(
                "concurrency {}: {} steps ran prompt tokens: {wall:.2} ms each (forward {forward:.2}, drafts {drafts:.2}) for {:.0} tokens of {:.1} sequences",
                self.conc,
                self.prompt_steps,
                self.prompt_step_rows[0] as f64 / n,
                self.prompt_step_rows[1] as f64 / n
            );
        }
        // vLLM's figures: over the verifies that had drafts.
        let verifies = self.spec.verifies();
        if verifies > 0 {
            let shares: Vec<String> = self
                .spec
                .accepted_shares()
                .iter()
                .map(|a| format!("{a:.3}"))
                .collect();
            eprintln!(
                "concurrency {}: accepted length {:.3} over {verifies} verifies of {:.2} drafts each; accepted by position {}",
                self.conc,
                self.spec.accepted_len_per_verify(),
                self.spec.drafted as f64 / verifies as f64,
                shares.join(" / ")
            );
        }
    }
}

/// What one rank holds for the runs: its device, config, model and MTP head.
struct Rank {
    device: Device,
    cfg: Config,
    model: Qwen36Model,
    head: Option<MtpHead>,
}

/// `--tp N`: each rank loads its shard once (on a thread of its own); each run spawns the
/// ranks' engines in lockstep and drives them through their client: prompts submitted from
/// tasks (the loop never waits for the engine to take them), tokens timed as the client reads
/// them after each step's statistics arrive.
fn over_ranks(args: &Args) -> anyhow_like::Result<()> {
    if args.run.model.is_none() && !args.run.cuda {
        // (candle's CPU generator cannot be seeded: the replicated weights would differ.)
        return Err(
            "--tp on the CPU needs a checkpoint (--model): random CPU weights differ between ranks".into(),
        );
    }
    let comms = load::tp_group(args.tp, args.run.cuda)?;
    let policy = qwen36::kernels::KernelPolicy::from_env();
    let built = qwen36::model::run_ranks(comms.clone(), |comm: Arc<dyn Communicator>| {
        let rank = || -> anyhow_like::Result<Rank> {
            let (device, _, cfg, weights) = setup(&args.run, policy, Some(comm.clone()))?;
            let cfg = with_room(args, cfg);
            let model = Qwen36Model::from_weights(cfg.clone(), &weights)?;
            let head = match args.mtp {
                0 => None,
                _ => Some(MtpHead::load(&cfg, &weights)?),
            };
            Ok(Rank {
                device,
                cfg,
                model,
                head,
            })
        };
        rank().map_err(|e| format!("rank {}: {e}", comm.rank()))
    })?;
    let ranks: Arc<Vec<Rank>> = Arc::new(built.into_iter().collect::<Result<_, String>>()?);
    let (device, cfg) = (ranks[0].device.clone(), ranks[0].cfg.clone());
    let dtype = load::dtype(&args.run.dtype)?;
    let copy_bw = copy_bandwidth(&device, dtype)?;
    eprintln!(
        "measured: copy {:.1} GB/s (read + write) on rank 0",
        copy_bw / 1e9
    );
    let spawn = |engine_cfg: EngineConfig| {
        let ranks = ranks.clone();
        Engine::spawn_ranks(comms.clone(), move |comm| {
            let r = &ranks[comm.rank()];
            match &r.head {
                Some(h) => Engine::with_mtp_head(r.model.clone(), h.clone(), engine_cfg.clone()),
                None => Engine::new(r.model.clone(), engine_cfg.clone()),
            }
        })
    };
    let runtime = tokio::runtime::Runtime::new()?;
    announce(args);
    {
        let client = spawn(warm_config(args))?;
        let warm = client.submit(warm_request(args, cfg.vocab_size))?;
        while warm.recv().is_some() {}
        client.shutdown();
    }
    // Rank 0's bytes: its shard and the replicated tensors.
    let cost = Cost::with_fp8(&cfg, dtype.size_in_bytes(), args.run.fp8);
    print_header(args, dtype);
    for &conc in &args.concurrency {
        let n = args.num_prompts.unwrap_or((4 * conc).max(4));
        let client = spawn(engine_config(args, conc, n))?;
        let steps = client.step_stats();
        reset_peak(&device);
        let mut load = Load::new(args, conc, n, cfg.vocab_size);
        let start = Instant::now();
        while !load.done() {
            // (The submits run on the runtime; the engine answers them between two steps.)
            load.fill(|reqs| {
                Ok(reqs
                    .into_iter()
                    .map(|r| {
                        let client = client.clone();
                        Submitted::Submitting(runtime.spawn(async move { client.submit_async(r).await }))
                    })
                    .collect())
            })?;
            // The next step's end (the requests in flight keep the engine stepping; a refused
            // submit ends the run here, where no step would come).
            let stats = loop {
                match steps.recv_timeout(Duration::from_secs(1)) {
                    Ok(stats) => break Some(stats),
                    Err(_) if client.status() == EngineStatus::Running => {
                        load.drain(Some(&runtime))?;
                        if load.live.is_empty() {
                            break None;
                        }
                    }
                    Err(_) => return Err(format!("the engine ended: {:?}", client.status()).into()),
                }
            };
            for s in stats.into_iter().chain(steps.try_iter()) {
                load.stepped(&s, s.wall);
            }
            load.drain(Some(&runtime))?;
        }
        let elapsed = start.elapsed();
        // The last steps' statistics may come after their requests' last events: the engine
        // thread publishes each step's once the step ends.
        client.shutdown();
        for s in steps.try_iter() {
            load.stepped(&s, s.wall);
        }
        load.report(args.input_len, elapsed, &cost, copy_bw, peak_gb(&device));
        // (The client does not read the prefix cache's counters.)
        report_turns(&load.timings, None);
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

/// Refuses flags this combination would ignore, naming them.
fn check(args: &Args) -> Result<(), String> {
    if args.shared_prefix > args.input_len {
        return Err("--shared-prefix must be at most --input-len".into());
    }
    if args.url.is_some() {
        // The server's flags set its engine; over HTTP only the load is this run's.
        let engine_flags = [
            ("--mtp", args.mtp > 0),
            ("--tp", args.tp > 1),
            ("--eager", args.eager),
            ("--fp8", args.run.fp8),
            ("--cuda", args.run.cuda),
            ("--layers", args.run.layers.is_some()),
        ];
        if let Some((flag, _)) = engine_flags.iter().find(|(_, given)| *given) {
            return Err(format!(
                "{flag} sets the engine: give it to the server (with --url this run only offers the load)"
            ));
        }
        if args.turns > 1 || args.shared_prefix > 0 {
            return Err("--turns and --shared-prefix run in process only (not with --url)".into());
        }
    }
    let draft_vocab = args.draft_vocab.is_some();
    let given = [
        ("--draft-vocab", draft_vocab),
        ("--fixed-k", args.fixed_k),
        ("--accept-rates", args.accept_rates.is_some()),
    ];
    load::check_speculation(args.mtp, "mtp", draft_vocab, &given)
}

/// The `--url` mode: the same offered load through a running server, over HTTP with streaming.
fn over_http(args: &Args, url: &str) -> anyhow_like::Result<()> {
    // Only the vocabulary is needed, for the random prompts: that of the served model's
    // checkpoint (`--model`) or config (`--config`), else Qwen3.6-27B's.
    let cfg = match (&args.run.model, &args.run.config) {
        (Some(model), _) => qwen36::Config::from_file(qwen36::resolve_model(model)?.join("config.json"))?,
        (None, Some(path)) => qwen36::Config::from_file(path)?,
        (None, None) => qwen36::Config::from_json(&serde_json::from_str(hw::QWEN36_27B)?)?,
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
    // Warm-up: one request of `--input-len`.
    let warm = warm_prompt(args, cfg.vocab_size);
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
