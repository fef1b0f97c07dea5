//! An OpenAI-compatible server on the engine (`qwen36-server`): with no arguments it serves the
//! bundled model on 127.0.0.1:8000.
//!
//! ```text
//! cargo run --release --example serve -- [--model DIR|ORG/NAME] [--host 127.0.0.1 --port 8000]
//! curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
//!     -d '{"prompt": "def fibonacci(n):", "max_tokens": 32}'
//! # a benchmark server: a config's shapes with random weights, token-id prompts only
//! cargo run --release --features qwen36-server/cuda --example serve -- --cuda --dtype bf16 \
//!     --config examples/configs/qwen3.6-27b.json
//! ```

use std::sync::{Arc, Mutex};

#[path = "common/load.rs"]
mod load;

use clap::Parser;
use qwen36::engine::{Engine, EngineConfig, PoolSizes, Speculation, StateBytes};
use qwen36::model::{Communicator, MtpHead, Weights};
use qwen36::{Config, Generator, LoadOptions, Qwen36Model, SamplingParams};
use qwen36_server::{ServerConfig, Service};

#[derive(Parser, Debug)]
#[command(about = "Serve a Qwen3.6-architecture model over an OpenAI-compatible HTTP API")]
struct Args {
    /// Model: a directory (config.json, safetensors, tokenizer.json) or a Hugging Face model id
    /// already in the local cache (e.g. Qwen/Qwen3.6-27B); default: the bundled model.
    #[arg(long, conflicts_with = "config")]
    model: Option<String>,
    /// Serve a config.json's shapes with random weights instead (benchmarks: no tokenizer, so
    /// prompts must be token ids; the output means nothing).
    #[arg(long)]
    config: Option<std::path::PathBuf>,
    /// With `--config`: random FP8 weights (e4m3, 128×128 block scales) where Qwen's FP8
    /// checkpoints have them.
    #[arg(long, requires = "config")]
    fp8: bool,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// The model name clients give (default: the directory's name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Require `Authorization: Bearer KEY` on every /v1, /tokenize and /detokenize request.
    #[arg(long)]
    api_key: Option<String>,
    /// f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Run on the first CUDA GPU.
    #[arg(long)]
    cuda: bool,
    /// Sequences running at once (GDN state slots).
    #[arg(long, default_value_t = 8, value_parser = load::at_least_one)]
    max_seqs: usize,
    /// State slots for the prefix cache's GDN snapshots (each one sequence's state; 0 turns the
    /// prefix cache off).
    #[arg(long, default_value_t = 8)]
    prefix_snapshots: usize,
    /// Requests that may wait beyond the free slots (503 past them; 0: only as many as there are
    /// free slots).
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// Bytes for the state slots and KV blocks, in GiB (default: enough KV for every slot to hold
    /// min(context, 16384) positions).
    #[arg(long, value_parser = load::gib)]
    memory_gib: Option<f64>,
    /// The most tokens one forward runs (prefill chunks and decode tokens together).
    #[arg(long, default_value_t = 512, value_parser = load::at_least_one)]
    step_tokens: usize,
    /// Speculative drafts per verify (0: off): the checkpoint's MTP head, or prompt lookup with
    /// `--drafter ngram`. The tokens are the same either way.
    #[arg(long, default_value_t = 0)]
    mtp: usize,
    /// MTP drafts choose among the first this many token ids only (cheaper drafts; the output is
    /// the same).
    #[arg(long)]
    draft_vocab: Option<usize>,
    /// The longest prompt + output taken (default: the model's context).
    #[arg(long)]
    max_model_len: Option<usize>,
    /// mtp or ngram.
    #[arg(long, default_value = "mtp")]
    drafter: String,
    /// A Jinja chat template file to use instead of the checkpoint's.
    #[arg(long, conflicts_with = "config")]
    chat_template: Option<std::path::PathBuf>,
    /// Render a chat with the request's own `chat_template` where it gives one (vLLM's flag;
    /// without it such a request is refused). A template runs sandboxed, but a client may make
    /// it slow or large: trust the clients that can reach the server.
    #[arg(long)]
    trust_request_chat_template: bool,
    /// Leave `<think>…</think>` in the content instead of `reasoning_content`.
    #[arg(long)]
    no_reasoning_parser: bool,
    /// Run every step eagerly (no CUDA graphs).
    #[arg(long)]
    eager: bool,
    /// Benchmarks only: accept draft j in a share rates[j] of the verifies (per position, as
    /// vLLM reports them) instead of checking it (with random weights, to time MTP at a real
    /// head's acceptance; the tokens then mean nothing).
    #[arg(long, value_delimiter = ',', value_parser = load::probability)]
    accept_rates: Option<Vec<f64>>,
    /// Always draft `--mtp` tokens (default: 0..=k per round, chosen from measured costs).
    #[arg(long)]
    fixed_k: bool,
    /// Tensor parallelism: one engine per rank over its shard of the model, stepping together
    /// (threads on the CPU, or with --cuda one GPU each over NCCL in a build with --features
    /// nccl). `--memory-gib` is then per rank.
    #[arg(long, default_value_t = 1, value_parser = load::at_least_one)]
    tp: usize,
}

fn main() {
    if let Err(e) = run(Args::parse()) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What the service reads from a checkpoint directory beside the engine (none for random
/// weights), and the served name.
struct Parts {
    tokenizer: Option<qwen36::Tokenizer>,
    template: Option<qwen36::ChatTemplate>,
    stop_ids: Vec<u32>,
    defaults: SamplingParams,
    name: String,
    speculation: Option<Speculation>,
}

/// The engine over the model `args` name (with `comm`, this rank's shard of it) and what the
/// service needs beside it.
fn build(
    args: &Args,
    opts: &LoadOptions,
    comm: Option<Arc<dyn Communicator>>,
) -> Result<(Engine, Parts), BoxError> {
    let started = std::time::Instant::now();
    // The model, its MTP head, and what the service reads from a checkpoint directory.
    let (model, head, generator, name) = match &args.config {
        Some(path) => {
            tracing::info!("building {} with random weights", path.display());
            let full = Config::from_file(path)?;
            let random = LoadOptions {
                check_finite: false,
                ..opts.clone()
            };
            let weights = match args.fp8 {
                true => Weights::random_fp8(random, [128, 128]),
                false => Weights::random(random),
            };
            let (cfg, weights) = match &comm {
                Some(c) => weights.sharded(c.clone(), &full)?,
                None => (full, weights),
            };
            let head = (args.mtp > 0 && args.drafter == "mtp")
                .then(|| MtpHead::load(&cfg, &weights))
                .transpose()?;
            (
                Qwen36Model::from_weights(cfg, &weights)?,
                head,
                None,
                "random".to_string(),
            )
        }
        None => {
            let dir = load::model_dir(args.model.as_deref())?;
            tracing::info!("loading {}", dir.display());
            let generator = Generator::load_with(&dir, opts.clone(), comm, args.chat_template.as_deref())?;
            let name = dir
                .canonicalize()
                .ok()
                .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
                .unwrap_or_else(|| "qwen36".into());
            let name = args
                .model
                .clone()
                .filter(|m| !std::path::Path::new(m).is_dir())
                .unwrap_or(name);
            (
                generator.model().clone(),
                generator.mtp_head().cloned(),
                Some(generator),
                name,
            )
        }
    };
    tracing::info!("model ready in {:.1} s", started.elapsed().as_secs_f64());
    let speculation = match (args.mtp, args.drafter.as_str()) {
        (0, _) => None,
        (k, "mtp") if head.is_some() => Some(Speculation::Mtp { k }),
        (_, "mtp") => return Err("--mtp needs a checkpoint with an MTP head (or --drafter ngram)".into()),
        (k, "ngram") => Some(Speculation::ngram(k)),
        (_, other) => return Err(format!("--drafter {other:?}: expected mtp or ngram").into()),
    };
    if speculation.is_some_and(|s| s.k() > qwen36::engine::MAX_DRAFTS) {
        return Err(format!(
            "--mtp {}: at most {} drafts",
            args.mtp,
            qwen36::engine::MAX_DRAFTS
        )
        .into());
    }
    let mut cfg = EngineConfig {
        max_seqs: args.max_seqs,
        max_queue: args.max_queue,
        step_tokens: args.step_tokens,
        cuda_graphs: !args.eager,
        timing_accept_rates: args.accept_rates.clone(),
        adaptive_k: !args.fixed_k,
        prefix_snapshots: args.prefix_snapshots,
        draft_vocab: args.draft_vocab,
        max_model_len: args.max_model_len,
        ..EngineConfig::default()
    };
    if let Some(gib) = args.memory_gib {
        let mtp = matches!(speculation, Some(Speculation::Mtp { .. }));
        let mut bytes = StateBytes::of(model.config(), opts.dtype, cfg.block_size, mtp);
        if let Some(sp) = &speculation {
            bytes = bytes.with_stash(model.config(), opts.dtype, sp.k() + 1);
        }
        let slots = args.max_seqs.saturating_add(args.prefix_snapshots);
        let sizes = PoolSizes::from_budget(bytes, (gib * (1u64 << 30) as f64) as u64, slots)?;
        cfg.kv_blocks = Some(sizes.blocks);
        tracing::info!(
            "{gib} GiB: {} state slots, {} KV blocks of {} positions",
            sizes.slots,
            sizes.blocks,
            cfg.block_size
        );
    }
    let engine = match (&speculation, head) {
        (Some(Speculation::Mtp { .. }), Some(head)) => Engine::with_mtp_head(model, head, cfg)?,
        _ => Engine::new(model, cfg)?,
    };
    let engine = match generator.as_ref().and_then(Generator::detokenizer) {
        Some(d) => engine.with_detokenizer(d),
        None => engine,
    };
    let parts = Parts {
        tokenizer: generator.as_ref().and_then(|g| g.tokenizer().cloned()),
        template: generator.as_ref().and_then(|g| g.chat_template().cloned()),
        stop_ids: generator
            .as_ref()
            .map(Generator::default_stop_ids)
            .unwrap_or_default(),
        defaults: match &generator {
            Some(g) => g.generation_config().sampling.clone().unwrap_or_default(),
            None => SamplingParams::greedy(),
        },
        name,
        speculation,
    };
    Ok((engine, parts))
}

/// Refuses flags this combination would ignore, naming them.
fn check(args: &Args) -> Result<(), String> {
    let draft_vocab = args.draft_vocab.is_some();
    let given = [
        ("--draft-vocab", draft_vocab),
        ("--fixed-k", args.fixed_k),
        ("--accept-rates", args.accept_rates.is_some()),
    ];
    load::check_speculation(args.mtp, &args.drafter, draft_vocab, &given)
}

fn run(args: Args) -> Result<(), BoxError> {
    check(&args)?;
    // The address first: a port in use is found before the model loads (the probe is closed
    // again, so that no client connects to a server still loading).
    let addr = format!("{}:{}", args.host, args.port);
    drop(std::net::TcpListener::bind(&addr).map_err(|e| format!("listening on {addr}: {e}"))?);
    let terminal = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(terminal)
        .init();
    let opts = LoadOptions {
        dtype: load::dtype(&args.dtype)?,
        // (Ranks over NCCL each compute on their own GPU.)
        device: load::device(args.cuda && args.tp <= 1)?,
        progress: load::progress(),
        ..LoadOptions::default()
    };
    if args.accept_rates.is_some() {
        tracing::warn!(
            "timing mode: drafts are accepted at the given rates, so the tokens are not meaningful"
        );
    }
    let args = Arc::new(args);
    let (client, parts) = if args.tp <= 1 {
        let (engine, parts) = build(&args, &opts, None)?;
        (engine.spawn(), parts)
    } else {
        if args.config.is_some() {
            // (Each rank would draw its own replicated weights: embedding, norms, lm_head.)
            return Err("--tp needs a checkpoint: random weights (--config) differ between ranks".into());
        }
        // Each rank builds its engine over its shard on its own thread; the first rank's parts
        // serve the clients.
        let first: Arc<Mutex<Option<Parts>>> = Arc::default();
        let (a, kept) = (args.clone(), first.clone());
        let client = Engine::spawn_ranks(load::tp_group(args.tp, args.cuda)?, move |comm| {
            let rank = comm.rank();
            let opts = LoadOptions {
                progress: None,
                device: load::rank_device(comm.as_ref(), &opts.device),
                ..opts.clone()
            };
            let (engine, parts) =
                build(&a, &opts, Some(comm)).map_err(|e| qwen36::engine::Error::Request(e.to_string()))?;
            if rank == 0 {
                *kept.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(parts);
            }
            Ok(engine)
        })?;
        tracing::info!("{} tensor-parallel ranks ready", args.tp);
        let parts = first
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
            .ok_or("the first rank built no engine")?;
        (client, parts)
    };
    let server_cfg = ServerConfig {
        model_id: args.served_model_name.clone().unwrap_or(parts.name),
        api_key: args.api_key.clone(),
        speculation: parts.speculation,
        reasoning: !args.no_reasoning_parser,
        trust_request_chat_template: args.trust_request_chat_template,
        ..ServerConfig::default()
    };
    let context = client.context();
    let service = Service::from_parts(
        client,
        parts.tokenizer,
        parts.template,
        parts.stop_ids,
        parts.defaults,
        context,
        server_cfg,
    );
    let service = Arc::new(service);
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .map_err(|e| std::io::Error::new(e.kind(), format!("listening on {addr}: {e}")))?;
        // (The bound address: with --port 0 the system chose the port.)
        let addr = listener.local_addr()?;
        tracing::info!("serving on http://{addr} (OpenAI API under /v1; /health, /metrics)");
        qwen36_server::serve(listener, service, shutdown_signal()).await
    })?;
    Ok(())
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            s.recv().await;
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutting down: finishing the requests in flight");
}
