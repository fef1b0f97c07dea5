//! An OpenAI-compatible server on the engine (`qwen36-server`): with no arguments it serves the
//! bundled model on 127.0.0.1:8000.
//!
//! ```text
//! cargo run --release --example serve -- [--model DIR] [--host 127.0.0.1 --port 8000]
//! curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
//!     -d '{"prompt": "def fibonacci(n):", "max_tokens": 32}'
//! ```

use std::sync::Arc;

#[path = "common/load.rs"]
mod load;

use clap::Parser;
use qwen36::engine::{Engine, EngineConfig, Speculation};
use qwen36::{Generator, LoadOptions};
use qwen36_server::{ServerConfig, Service};

#[derive(Parser, Debug)]
#[command(about = "Serve a Qwen3.6-architecture model over an OpenAI-compatible HTTP API")]
struct Args {
    /// Model directory (config.json, safetensors, tokenizer.json); default: the bundled model.
    #[arg(long)]
    model: Option<std::path::PathBuf>,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// The model name clients give (default: the directory's name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Require `Authorization: Bearer KEY` on every /v1 request.
    #[arg(long)]
    api_key: Option<String>,
    /// f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Run on the first CUDA GPU.
    #[arg(long)]
    cuda: bool,
    /// Sequences running at once.
    #[arg(long, default_value_t = 8)]
    max_seqs: usize,
    /// Requests that may wait for a slot (503 past them).
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// MTP drafts per verify (0: off; needs the checkpoint's MTP head).
    #[arg(long, default_value_t = 0)]
    mtp: usize,
}

fn main() {
    if let Err(e) = run(Args::parse()) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let terminal = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(terminal)
        .init();
    let dtype = load::dtype(&args.dtype)?;
    let device = load::device(args.cuda)?;
    let dir = load::model_dir(args.model.clone());
    let generator = Generator::load(
        &dir,
        LoadOptions {
            dtype,
            device,
            ..LoadOptions::default()
        },
    )?;
    let cfg = EngineConfig {
        max_seqs: args.max_seqs,
        max_queue: args.max_queue,
        ..EngineConfig::default()
    };
    let model = generator.model().clone();
    let engine = match (args.mtp, generator.mtp_head()) {
        (0, _) => Engine::new(model, cfg)?,
        (_, Some(head)) => Engine::with_mtp_head(model, head.clone(), cfg)?,
        (_, None) => return Err("--mtp needs a checkpoint with an MTP head".into()),
    };
    let engine = match generator.detokenizer() {
        Some(d) => engine.with_detokenizer(d),
        None => engine,
    };
    let model_id = args.served_model_name.clone().unwrap_or_else(|| {
        dir.canonicalize()
            .ok()
            .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "qwen36".into())
    });
    let server_cfg = ServerConfig {
        model_id,
        api_key: args.api_key.clone(),
        speculation: (args.mtp > 0).then_some(Speculation::Mtp { k: args.mtp }),
        ..ServerConfig::default()
    };
    let service = Arc::new(Service::new(&generator, engine.spawn(), server_cfg)?);
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async move {
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr).await?;
        tracing::info!("serving {} on http://{addr}", dir.display());
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
