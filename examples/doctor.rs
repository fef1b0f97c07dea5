//! Is this model running correctly here? Checks a model directory (or a Hugging Face id in the
//! local cache) on a device and dtype and prints one line per check (pass / warn / FAIL, and what
//! to do), or `--json`. Exits with status 1 when a check fails.
//!
//! ```text
//! cargo run --release --example doctor                      # the bundled model, CPU f32
//! cargo run --release --features qwen36/cuda --example doctor -- --model Qwen/Qwen3.6-27B --cuda --dtype bf16
//! # a tensor-parallel deployment: two ranks (threads here; with --cuda two GPUs over NCCL)
//! cargo run --release --example doctor -- --tp 2
//! ```

#[path = "common/load.rs"]
#[allow(dead_code)]
mod load;

use clap::Parser;
use qwen36::doctor::{examine, examine_ranks, DoctorOptions};

#[derive(Parser, Debug)]
#[command(about = "Find out whether a Qwen3.6 model runs correctly, and why not")]
struct Args {
    /// Model directory or Hugging Face id in the local cache; default: the bundled model.
    #[arg(long)]
    model: Option<String>,
    /// f32, bf16 or f16: the dtype the model under test runs in (the reference is CPU f32).
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Run the model under test on the first CUDA GPU.
    #[arg(long)]
    cuda: bool,
    /// Compare only the first N layers with the CPU f32 reference (default: all for models
    /// whose f32 copy takes under 8 GB, else 8).
    #[arg(long)]
    reference_layers: Option<usize>,
    /// Tokens per generation in the speculation and generation checks.
    #[arg(long, default_value_t = 96)]
    tokens: usize,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Check a tensor-parallel deployment: the model sharded over this many ranks (threads on
    /// the CPU, with --cuda one GPU each over NCCL in a build with --features nccl), every check
    /// run on the ranks together, and whether they agree.
    #[arg(long, default_value_t = 1, value_parser = load::at_least_one)]
    tp: usize,
}

fn main() {
    match run(Args::parse()) {
        Ok(failed) => std::process::exit(i32::from(failed)),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    }
}

fn run(args: Args) -> Result<bool, Box<dyn std::error::Error>> {
    let dir = load::model_dir(args.model.as_deref())?;
    let opts = DoctorOptions {
        // (Ranks over NCCL each run on their own GPU.)
        device: load::device(args.cuda && args.tp <= 1)?,
        dtype: load::dtype(&args.dtype)?,
        reference_layers: args.reference_layers,
        generate_tokens: args.tokens,
    };
    let report = match args.tp {
        0 | 1 => examine(&dir, &opts)?,
        tp => examine_ranks(&dir, &opts, load::tp_group(tp, args.cuda)?)?,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report.to_json())?);
    } else {
        print!("{}", report.render());
    }
    Ok(report.failed())
}
