//! Generate text with a Qwen3.6-architecture model.
//!
//! ```text
//! cargo run --release --example generate -- --prompt "def fibonacci(n):"   # the bundled model
//! cargo run --release --example generate -- --chat --prompt "Write a Python function to reverse a list."
//! cargo run --release --example generate -- --model DIR --prompt "def fibonacci(n):"
//! cargo run --release --example generate -- --model DIR --prompt-ids 1,2,3 --max-new-tokens 40 --json
//! cargo run --release --example generate -- --tp 2 --prompt "def fibonacci(n):"   # two ranks
//! ```
//! Without `--json` the text (or the ids, when the model has no tokenizer) streams to stdout and a
//! tokens/s line goes to stderr. With `--json` one JSON object is printed.

use std::io::Write;

#[path = "common/load.rs"]
mod load;

use clap::Parser;
use qwen36::{ChatMessage, DrafterKind, GenerateOptions, Generator, LoadOptions, Speculative};

#[derive(Parser, Debug)]
#[command(about = "Generate text with a Qwen3.6-architecture model")]
struct Args {
    /// Model directory (config.json, *.safetensors, optional tokenizer.json, tokenizer_config.json
    /// and generation_config.json). Default: the small model that ships with the repository.
    #[arg(long)]
    model: Option<String>,
    /// Wrap the prompt as a user turn with the model's chat template.
    #[arg(long)]
    chat: bool,
    /// With --chat: ask for an empty think block (Qwen's enable_thinking = false).
    #[arg(long)]
    no_think: bool,
    /// Prompt text (needs tokenizer.json).
    #[arg(long, conflicts_with = "prompt_ids")]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids (no tokenizer needed).
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    #[arg(long, default_value_t = 128)]
    max_new_tokens: usize,
    /// 0 = greedy. Default: the model's generation_config.json, else greedy.
    #[arg(long)]
    temperature: Option<f32>,
    #[arg(long)]
    top_k: Option<usize>,
    #[arg(long)]
    top_p: Option<f32>,
    #[arg(long)]
    min_p: Option<f32>,
    #[arg(long)]
    repetition_penalty: Option<f32>,
    #[arg(long)]
    presence_penalty: Option<f32>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Activation dtype: f32, bf16 or f16 (the GDN state is f32 regardless).
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Run on the first CUDA GPU (needs a build with --features cuda).
    #[arg(long)]
    cuda: bool,
    /// Speculative decoding: the most drafts per verify pass (0 = off); each round drafts what
    /// pays at the measured acceptance and costs, 0 included.
    #[arg(long, default_value_t = 0)]
    mtp: usize,
    /// Drafter for speculative decoding: mtp (the checkpoint's MTP head) or ngram (prompt lookup).
    #[arg(long, default_value = "mtp")]
    drafter: String,
    /// MTP drafts over the first N token ids instead of the whole vocabulary: cheaper draft
    /// steps, the same output, possibly lower acceptance.
    #[arg(long)]
    draft_vocab: Option<usize>,
    /// Draft the --mtp number in every round, whatever it costs (to measure a drafter).
    #[arg(long)]
    fixed_k: bool,
    /// Stop string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Print one JSON object instead of streaming.
    #[arg(long)]
    json: bool,
    /// Stop when the output degenerates (a loop of up to 32 tokens repeated over 64 or more);
    /// either way a degeneration is reported at the end.
    #[arg(long)]
    stop_on_loop: bool,
    /// Tensor parallelism: shard the model over this many ranks (threads of this process, each
    /// holding its part of every layer): on the CPU, or with --cuda one GPU each over NCCL (a
    /// build with --features nccl).
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

/// Refuses flags this combination would ignore, naming them.
fn check(args: &Args) -> Result<(), String> {
    let draft_vocab = args.draft_vocab.is_some();
    let given = [("--draft-vocab", draft_vocab), ("--fixed-k", args.fixed_k)];
    load::check_speculation(args.mtp, &args.drafter, draft_vocab, &given)?;
    if args.no_think && !args.chat {
        return Err("--no-think applies with --chat".into());
    }
    if args.chat && args.prompt.is_none() {
        return Err("--chat wraps --prompt TEXT in the chat template (not --prompt-ids)".into());
    }
    Ok(())
}

fn run(args: Args) -> Result<(), BoxError> {
    check(&args)?;
    let dtype = load::dtype(&args.dtype)?;
    // (Ranks over NCCL each compute on their own GPU.)
    let device = load::device(args.cuda && args.tp <= 1)?;
    let model_dir = load::model_dir(args.model.as_deref())?;
    let opts = |progress| LoadOptions {
        dtype,
        device: device.clone(),
        progress,
        ..LoadOptions::default()
    };
    if args.tp <= 1 {
        return generate(&args, &Generator::load(&model_dir, opts(load::progress()))?, true);
    }
    // Every rank runs the same generation on its shard (the same seed: the same tokens), one
    // thread each; the first prints.
    let comms = load::tp_group(args.tp, args.cuda)?;
    let done = qwen36::model::run_ranks(comms, |comm| -> Result<(), BoxError> {
        let first = comm.rank() == 0;
        let progress = if first { load::progress() } else { None };
        let opts = LoadOptions {
            device: load::rank_device(comm.as_ref(), &opts(None).device),
            ..opts(progress)
        };
        let loaded = Generator::load_shard(&model_dir, opts, comm.clone());
        // Every rank learns whether all loaded (a rank that failed must not leave the others
        // waiting in their first reduction).
        let all = comm.barrier(loaded.is_ok());
        let generator = loaded?;
        all?;
        let done = generate(&args, &generator, first);
        if done.is_err() {
            // (Ends the others' reductions: none waits for this rank.)
            comm.abort();
        }
        done
    })?;
    done.into_iter().collect()
}

/// Generates as `args` say with `generator`; only with `print` does it write anything.
fn generate(args: &Args, generator: &Generator, print: bool) -> Result<(), BoxError> {
    let chat_text = match (&args.prompt, args.chat) {
        (Some(text), true) => {
            Some(generator.apply_chat_template(&[ChatMessage::new("user", text)], !args.no_think)?)
        }
        _ => None,
    };
    let prompt = match (&args.prompt, &args.prompt_ids) {
        (Some(text), _) => generator.encode(chat_text.as_deref().unwrap_or(text))?,
        (None, Some(ids)) => ids.clone(),
        (None, None) => return Err("give --prompt TEXT or --prompt-ids 1,2,3".into()),
    };
    let mut sampling = generator.generation_config().sampling.clone().unwrap_or_default();
    if let Some(t) = args.temperature {
        sampling.temperature = t;
    }
    sampling.top_k = args.top_k.unwrap_or(sampling.top_k);
    sampling.top_p = args.top_p.unwrap_or(sampling.top_p);
    sampling.min_p = args.min_p.unwrap_or(sampling.min_p);
    sampling.repetition_penalty = args.repetition_penalty.unwrap_or(sampling.repetition_penalty);
    sampling.presence_penalty = args.presence_penalty.unwrap_or(sampling.presence_penalty);
    sampling.seed = args.seed;
    let drafter = match args.drafter.as_str() {
        "mtp" => DrafterKind::Mtp,
        "ngram" => DrafterKind::Ngram,
        other => return Err(format!("--drafter {other:?}: expected mtp or ngram").into()),
    };
    let opts = GenerateOptions {
        max_new_tokens: args.max_new_tokens,
        sampling: Some(sampling),
        stop_token_ids: None,
        stop_strings: args.stop.clone(),
        speculative: (args.mtp > 0).then_some(Speculative {
            k: args.mtp,
            drafter,
            draft_vocab: args.draft_vocab,
            fixed_k: args.fixed_k,
        }),
        stop_on_degeneration: args.stop_on_loop,
        ..GenerateOptions::default()
    };
    let has_text = generator.tokenizer().is_some();
    let stream = !args.json && print;
    if stream {
        if let Some(text) = chat_text.as_ref().or(args.prompt.as_ref()) {
            print!("{text}");
        }
    }
    let out = generator.generate(&prompt, &opts, |ev| {
        if stream {
            if has_text {
                print!("{}", ev.text);
            } else {
                print!("{} ", ev.token);
            }
            let _ = std::io::stdout().flush();
        }
    })?;
    if !print {
        return Ok(());
    }
    if args.json {
        let mut json = serde_json::json!({
            "prompt_tokens": out.prompt_tokens,
            "tokens": out.tokens,
            "text": out.text,
            "stop_reason": format!("{:?}", out.stop_reason),
            "prefill_secs": out.prefill_secs,
            "decode_tokens_per_sec": out.decode_tokens_per_sec(),
            "degeneration": out.degeneration.map(|d| d.to_string()),
        });
        if let Some(s) = &out.spec_stats {
            json["accepted_len_mean"] = s.accepted_len_mean().into();
            json["acceptance_by_position"] = s.acceptance_by_position().into();
            json["decode_passes"] = s.cycles.into();
            json["passes_with_drafts"] = s.reached.first().copied().unwrap_or(0).into();
        }
        println!("{json}");
    } else {
        println!();
        if let Some(s) = &out.spec_stats {
            let by_pos: Vec<String> = s
                .acceptance_by_position()
                .iter()
                .map(|x| format!("{x:.2}"))
                .collect();
            eprintln!(
                "speculative: {} decode passes ({} with drafts), accepted length {:.2}, acceptance by position [{}]",
                s.cycles,
                s.reached.first().copied().unwrap_or(0),
                s.accepted_len_mean(),
                by_pos.join(", ")
            );
        }
        if let Some(d) = out.degeneration {
            eprintln!("warning: the output degenerated: {d} (run `doctor` on the model to see why)");
        }
        eprintln!(
            "{} prompt tokens, {} generated; prefill {:.1} tok/s, decode {:.1} tok/s ({:?})",
            out.prompt_tokens,
            out.tokens.len(),
            out.prompt_tokens as f64 / out.prefill_secs.max(1e-9),
            out.decode_tokens_per_sec(),
            out.stop_reason
        );
    }
    Ok(())
}
