//! End-to-end speed of a Qwen3.6 model: prefill, decode and MTP cycles, each against the
//! hardware limit measured in the same run.
//!
//! ```text
//! # Qwen3.6-27B shapes, random bf16 weights made on the GPU (no files needed):
//! cargo run --release --features cuda --example bench -- --cuda
//! # a real checkpoint, or the bundled model on CPU:
//! cargo run --release --features cuda --example bench -- --cuda --model DIR
//! cargo run --release --example bench -- --model models/qwen36-tiny --prefill 64,256 --dtype f32
//! ```
//! Rows: prefill tok/s (FLOPs against the measured bf16 GEMM rate), decode ms/token at each
//! prefill's context, and the MTP cycle (k drafts + a verify of k+1 tokens) for k = 1..4 (bytes
//! against the measured copy bandwidth). Peak memory per row is the CUDA pool's high-water mark.

use std::time::Instant;

use candle_core::{Device, Tensor};
use clap::Parser;
use qwen36::model::{DraftSession, DraftVocab, MtpHead};
use qwen36::mtp::{DraftContext, Drafter, MtpDrafter};
use qwen36::{Cache, Qwen36Model};

#[path = "common/hw.rs"]
mod hw;
#[path = "common/load.rs"]
#[allow(dead_code)]
mod load;
use hw::{anyhow_like, copy_bandwidth, gemm_rate, peak_gb, reset_peak, setup, Cost, ModelArgs};

#[derive(Parser, Debug)]
#[command(about = "Time prefill, decode and MTP cycles of a Qwen3.6 model")]
struct Args {
    #[command(flatten)]
    run: ModelArgs,
    /// Prompt lengths; decode and MTP rows run at each of these contexts.
    #[arg(long, value_delimiter = ',', default_value = "1024,8192,32768", value_parser = load::at_least_one)]
    prefill: Vec<usize>,
    /// Decode steps timed per context.
    #[arg(long, default_value_t = 32, value_parser = load::at_least_one)]
    decode_steps: usize,
    /// MTP cycles timed per k (k = 1..=max_k, at the first prefill length's context).
    #[arg(long, default_value_t = 8, value_parser = load::at_least_one)]
    mtp_cycles: usize,
    #[arg(long, default_value_t = 4)]
    max_k: usize,
    /// Print the table as one JSON object too.
    #[arg(long)]
    json: bool,
    /// Experiment knob: run the GEMMs of 2..=8 rows (MTP verify) through the streaming kernel
    /// with this many columns per warp (1, 2 or 4) instead of cuBLAS.
    #[arg(long, hide = true)]
    multi_row_gemv: Option<usize>,
    /// MTP rows draft over the first N token ids (a draft vocabulary) instead of all of them.
    #[arg(long)]
    draft_vocab: Option<usize>,
    /// Tensor parallelism over N ranks: threads on the CPU, with --cuda one GPU each over NCCL
    /// (a build with --features nccl). Rows then time one rank's step, and their limits count
    /// that rank's bytes (its shard plus the replicated embedding, norms and lm_head).
    #[arg(long, default_value_t = 1, value_parser = load::at_least_one)]
    tp: usize,
}

impl Row {
    /// A memory-bound row: `bytes` moved at `copy_bw` is the limit.
    fn bytes(what: String, ms: f64, bytes: f64, copy_bw: f64, dev: &Device) -> Self {
        Self {
            what,
            ms,
            rate: None,
            limit: format!("{:.1} GB at copy bw", bytes / 1e9),
            limit_ms: bytes / copy_bw * 1e3,
            peak_gb: peak_gb(dev),
        }
    }
}

/// One table row.
struct Row {
    what: String,
    ms: f64,
    /// tok/s for prefill rows.
    rate: Option<f64>,
    /// What the limit is computed from, and the time at the limit.
    limit: String,
    limit_ms: f64,
    peak_gb: Option<f64>,
}

fn main() -> anyhow_like::Result<()> {
    let args = Args::parse();
    let mut kernels = qwen36::kernels::KernelPolicy::from_env();
    if let Some(c) = args.multi_row_gemv {
        kernels.skinny = qwen36::kernels::SkinnyPath::Multi(c);
    }
    if args.tp <= 1 {
        return bench(&args, kernels, None);
    }
    // Every rank runs the same benchmark on its shard (one thread each, in step through the
    // reductions); the first prints. Random weights draw the same values on every GPU rank.
    let comms = load::tp_group(args.tp, args.run.cuda)?;
    let done = qwen36::model::run_ranks(comms, |comm| {
        let done = bench(&args, kernels, Some(comm.clone())).map_err(|e| e.to_string());
        if done.is_err() {
            // (Ends the others' reductions: none waits for this rank.)
            comm.abort();
        }
        done
    })?;
    done.into_iter()
        .collect::<Result<(), String>>()
        .map_err(Into::into)
}

/// The longest prompt whose timed prefill follows an untimed one of the same length.
const WARM_PREFILL: usize = 2048;

/// The most positions a run reaches: each prompt, its eager (and on CUDA graphed) decode
/// loops (each two warm-up steps and the timed ones), and after the first prompt the MTP rows'
/// cycles (each k's cycles, plus one untimed, commit k + 1 tokens; eager and on CUDA graphed).
fn positions_used(args: &Args) -> usize {
    let modes = if args.run.cuda { 2 } else { 1 };
    let per_cycle: usize = (1..=args.max_k).map(|k| k + 1).sum();
    let mtp = modes * (args.mtp_cycles + 1) * per_cycle;
    args.prefill
        .iter()
        .enumerate()
        .map(|(i, &t)| t + modes * (args.decode_steps + 2) + if i == 0 { mtp } else { 0 })
        .max()
        .unwrap_or(0)
}

/// The benchmark on one device, or on one tensor-parallel rank (`comm`; only rank 0 prints).
fn bench(
    args: &Args,
    kernels: qwen36::kernels::KernelPolicy,
    comm: Option<std::sync::Arc<dyn qwen36::model::Communicator>>,
) -> anyhow_like::Result<()> {
    let print = comm.as_ref().is_none_or(|c| c.rank() == 0);
    let ready = setup(&args.run, kernels, comm.clone());
    if let Some(c) = &comm {
        // Every rank learns whether all are ready (a rank that failed must not leave the others
        // waiting in their first reduction).
        let all = c.barrier(ready.is_ok());
        ready.as_ref().map_err(|e| e.to_string())?;
        all?;
    }
    let (device, dtype, mut cfg, weights) = ready?;
    let max_ctx = positions_used(args);
    cfg.max_position_embeddings = cfg.max_position_embeddings.max(max_ctx);

    let (copy_bw, gemm_rate) = (copy_bandwidth(&device, dtype)?, gemm_rate(&device, dtype)?);
    if print {
        eprintln!(
            "measured: copy {:.2} TB/s (read + write), {dtype:?} GEMM {:.0} TFLOP/s",
            copy_bw / 1e12,
            gemm_rate / 1e12
        );
    }

    let t0 = Instant::now();
    let model = Qwen36Model::from_weights(cfg.clone(), &weights)?;
    let head = if MtpHead::present(&weights) && cfg.mtp_num_hidden_layers > 0 {
        Some(MtpHead::load(&cfg, &weights)?)
    } else {
        None
    };
    device.synchronize()?;
    if print {
        eprintln!(
            "model ready in {:.1} s ({} layers, MTP head: {})",
            t0.elapsed().as_secs_f64(),
            cfg.num_hidden_layers,
            head.is_some()
        );
    }
    let cost = Cost::with_fp8(&cfg, dtype.size_in_bytes(), args.run.fp8);
    let mut rows = Vec::new();
    let mut phases: Vec<(String, [f64; 3])> = Vec::new();
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next_id = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % cfg.vocab_size as u64) as u32
    };

    for (i, &t) in args.prefill.iter().enumerate() {
        // Prefill.
        let prompt: Vec<u32> = (0..t).map(|_| next_id()).collect();
        let ids = Tensor::new(prompt.as_slice(), &Device::Cpu)?.unsqueeze(0)?;
        let mut cache = model.new_cache(1)?;
        // Warm-up, untimed: a prefill of the same length first, so that the timed one meets no
        // first call (kernel modules loaded and JIT-compiled, cuBLAS's choice for each GEMM
        // shape, kernels that only long prompts take: 5-10 ms of a 1024-token prefill on an
        // H100). Longer prompts get none but the run's first 64 tokens (the modules): their first
        // calls are under 1%, and a warm-up just before (2048 tokens or the whole prompt) made an
        // 8192-token prefill 4-5% slower.
        let warm_len = if t <= WARM_PREFILL {
            Some(t)
        } else {
            (i == 0).then_some(64)
        };
        if let Some(w) = warm_len {
            let mut warm = model.new_cache(1)?;
            let hidden = model.forward_hidden(&ids.narrow(1, 0, w)?, &mut warm)?;
            greedy(&model, &hidden.narrow(1, w - 1, 1)?)?;
            device.synchronize()?;
        }
        reset_peak(&device);
        let start = Instant::now();
        let hidden = model.forward_hidden(&ids, &mut cache)?;
        let last = hidden.narrow(1, t - 1, 1)?;
        let mut tok = greedy(&model, &last)?;
        let ms = start.elapsed().as_secs_f64() * 1e3;
        let flops = cost.prefill_flops(t);
        rows.push(Row {
            what: format!("prefill {t}"),
            ms,
            rate: Some(t as f64 / ms * 1e3),
            limit: format!("{:.1} TFLOP at the GEMM rate", flops / 1e12),
            limit_ms: flops / gemm_rate * 1e3,
            peak_gb: peak_gb(&device),
        });
        drop(hidden);

        // Decode: a real greedy loop (the sampled id goes through the host each step), eager,
        // then with GDN layers replayed from CUDA graphs.
        let mut tokens = prompt;
        let mut last = last;
        let ms = decode_loop(&device, args.decode_steps, &mut tokens, &mut tok, |tok| {
            let (h, next) = decode_step(&model, tok, &mut cache)?;
            last = h;
            Ok(next)
        })?;
        rows.push(Row::bytes(
            format!("decode @{t}"),
            ms,
            cost.decode_bytes(t),
            copy_bw,
            &device,
        ));
        #[cfg(feature = "cuda")]
        if args.run.cuda {
            let mut graph = qwen36::model::DecodeGraph::new(&device, 1)?;
            let ms = decode_loop(&device, args.decode_steps, &mut tokens, &mut tok, |tok| {
                let ids = Tensor::new(&[[tok]], &Device::Cpu)?;
                last = model.forward_hidden_graphed(&ids, &mut cache, &mut graph)?;
                greedy(&model, &last)
            })?;
            let what = format!("decode @{t}, CUDA graphs");
            rows.push(Row::bytes(
                what,
                ms,
                cost.decode_bytes(tokens.len()),
                copy_bw,
                &device,
            ));
        }

        // MTP cycles at the first context.
        let Some(head) = head.as_ref().filter(|_| i == 0) else {
            continue;
        };
        tokens.push(tok);
        // Eager verify passes, then (CUDA) verify passes replayed from graphs.
        let mut graph = new_graph(&device, args.run.cuda)?;
        let modes = if graph.is_some() { 2 } else { 1 };
        let vocab = args
            .draft_vocab
            .map(|n| DraftVocab::first(&model, n, &[]))
            .transpose()?;
        // Bytes a draft step reads: its lm_head rows are the draft vocabulary's.
        let draft_bytes = match &vocab {
            Some(v) => cost.draft_bytes - (cfg.vocab_size - v.len()) as f64 * cost.lm_head_row_bytes,
            None => cost.draft_bytes,
        };
        let vocab_note = match &vocab {
            Some(v) => format!(", draft vocabulary {}", v.len()),
            None => String::new(),
        };
        for graphed in (0..modes).map(|m| m == 1) {
            for k in 1..=args.max_k {
                let session = DraftSession::with_vocab(&model, head, vocab.clone());
                let mut drafter = MtpDrafter::with_session(&model, head, session);
                let mut new_hidden = last.clone();
                let mut timed = 0.0;
                // Seconds in the draft chain, the verify pass and the commit, summed over cycles.
                let mut split = [0.0f64; 3];
                for cycle in 0..args.mtp_cycles + 1 {
                    device.synchronize()?;
                    if cycle == 1 {
                        reset_peak(&device);
                    }
                    let start = Instant::now();
                    let ctx = DraftContext {
                        tokens: &tokens,
                        new_hidden: &new_hidden,
                    };
                    // Both the chain and the verify end by reading tokens back: host-synchronous.
                    let drafts = drafter.propose(&ctx, k)?;
                    let drafted = start.elapsed().as_secs_f64();
                    let mut verify = vec![*tokens.last().expect("a token")];
                    verify.extend(&drafts);
                    let ids = Tensor::new(verify.as_slice(), &Device::Cpu)?.unsqueeze(0)?;
                    let g = if graphed { graph.as_mut() } else { None };
                    let h = verify_pass(&model, &ids, &mut cache, g)?;
                    let target = model.greedy_ids(&h)?.flatten_all()?.to_vec1::<u32>()?;
                    let verified = start.elapsed().as_secs_f64();
                    // Keep every draft (random weights accept nothing; the cost does not depend on it).
                    commit(
                        &mut cache,
                        verify.len(),
                        if graphed { graph.as_mut() } else { None },
                    )?;
                    tokens.extend(&drafts);
                    tokens.push(target[target.len() - 1]);
                    new_hidden = h;
                    if cycle > 0 {
                        let total = start.elapsed().as_secs_f64();
                        timed += total;
                        split[0] += drafted;
                        split[1] += verified - drafted;
                        split[2] += total - verified;
                    }
                }
                let ms = timed * 1e3 / args.mtp_cycles as f64;
                phases.push((
                    format!(
                        "k={k}{}{vocab_note}",
                        if graphed { ", verify graphed" } else { "" }
                    ),
                    split.map(|s| s * 1e3 / args.mtp_cycles as f64),
                ));
                let bytes = cost.weight_bytes
                    + cost.kv_bytes(tokens.len())
                    + cost.state_bytes(k + 1)
                    + k as f64 * draft_bytes;
                let what = format!(
                    "MTP cycle k={k} @{t}{}{vocab_note}",
                    if graphed { ", verify graphed" } else { "" }
                );
                rows.push(Row::bytes(what, ms, bytes, copy_bw, &device));
            }
        }
    }

    if !print {
        return Ok(());
    }
    print_table(&rows);
    if !phases.is_empty() {
        // The commit's device work runs behind the next chain; its host time is what it costs.
        println!("\nMTP cycle phases (wall clock; the commit: host time of Cache::commit):\n");
        println!("| cycle | draft chain | verify + read back | commit |");
        println!("|---|---|---|---|");
        for (what, [d, v, c]) in &phases {
            println!("| {what} | {d:.2} ms | {v:.2} ms | {c:.2} ms |");
        }
    }
    if args.json {
        let rows_json: Vec<_> = rows
            .iter()
            .map(|r| {
                serde_json::json!({"row": r.what, "ms": r.ms, "tok_per_s": r.rate, "limit": r.limit,
                "limit_ms": r.limit_ms, "ratio": r.ms / r.limit_ms, "peak_gb": r.peak_gb})
            })
            .collect();
        let j = serde_json::json!({"copy_tb_s": copy_bw / 1e12, "gemm_tflop_s": gemm_rate / 1e12,
            "layers": cfg.num_hidden_layers, "dtype": args.run.dtype, "rows": rows_json});
        println!("{j}");
    }
    Ok(())
}

/// Runs `steps` + 2 greedy steps through `step` (token in, next token out), appending each input to
/// `tokens`; returns the mean ms of the last `steps` (the first two warm up and record graphs).
fn decode_loop(
    dev: &Device,
    steps: usize,
    tokens: &mut Vec<u32>,
    tok: &mut u32,
    mut step: impl FnMut(u32) -> qwen36::model::Result<u32>,
) -> qwen36::model::Result<f64> {
    let mut start = Instant::now();
    for i in 0..steps + 2 {
        if i == 2 {
            dev.synchronize()?;
            reset_peak(dev);
            start = Instant::now();
        }
        tokens.push(*tok);
        *tok = step(*tok)?;
    }
    Ok(start.elapsed().as_secs_f64() * 1e3 / steps as f64)
}

#[cfg(feature = "cuda")]
type Graph = qwen36::model::DecodeGraph;
/// Without CUDA there are no graphs; the type only fills the signatures.
#[cfg(not(feature = "cuda"))]
type Graph = ();

/// A recorder of CUDA graphs for batch 1 when running on CUDA.
fn new_graph(dev: &Device, cuda: bool) -> qwen36::model::Result<Option<Graph>> {
    #[cfg(feature = "cuda")]
    if cuda {
        return Ok(Some(qwen36::model::DecodeGraph::new(dev, 1)?));
    }
    let _ = (dev, cuda);
    Ok(None)
}

/// A speculative verify pass, replayed from CUDA graphs when `graph` is given.
fn verify_pass(
    model: &Qwen36Model,
    ids: &Tensor,
    cache: &mut Cache,
    graph: Option<&mut Graph>,
) -> qwen36::model::Result<Tensor> {
    match graph {
        #[cfg(feature = "cuda")]
        Some(g) => model.forward_verify_graphed(ids, cache, g),
        _ => model.forward_verify(ids, cache),
    }
}

/// [`Cache::commit`] after a verify pass, replayed from a graph when `graph` is given.
fn commit(cache: &mut Cache, keep: usize, graph: Option<&mut Graph>) -> qwen36::model::Result<()> {
    match graph {
        #[cfg(feature = "cuda")]
        Some(g) => g.commit(cache, keep),
        _ => cache.commit(keep),
    }
}

/// One greedy decode step from host token `tok`: returns the new final-norm hidden state and token.
fn decode_step(model: &Qwen36Model, tok: u32, cache: &mut Cache) -> qwen36::model::Result<(Tensor, u32)> {
    let ids = Tensor::new(&[[tok]], &Device::Cpu)?;
    let h = model.forward_hidden(&ids, cache)?;
    let next = greedy(model, &h)?;
    Ok((h, next))
}

/// Argmax of the logits of `hidden: [1, 1, hidden]`, read back to the host.
fn greedy(model: &Qwen36Model, hidden: &Tensor) -> qwen36::model::Result<u32> {
    Ok(model.greedy_ids(hidden)?.flatten_all()?.to_vec1::<u32>()?[0])
}

fn print_table(rows: &[Row]) {
    println!("| row | time | tok/s | limit | time at limit | measured / limit | peak GB |");
    println!("|---|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {:.2} ms | {} | {} | {:.2} ms | {:.2}× | {} |",
            r.what,
            r.ms,
            r.rate.map(|x| format!("{x:.0}")).unwrap_or_else(|| "-".into()),
            r.limit,
            r.limit_ms,
            r.ms / r.limit_ms,
            r.peak_gb.map(|g| format!("{g:.1}")).unwrap_or_else(|| "-".into()),
        );
    }
    let cycles: Vec<&Row> = rows.iter().filter(|r| r.what.starts_with("MTP")).collect();
    if cycles.is_empty() {
        return;
    }
    println!("\nProjected tok/s = accepted length / cycle time:\n");
    println!("| cycle | time | at 2.0 | at 2.5 | at 3.0 |");
    println!("|---|---|---|---|---|");
    for r in cycles {
        // Labels read "MTP cycle k=K @..."; an accepted length above k + 1 cannot happen.
        let k: usize = r
            .what
            .split("k=")
            .nth(1)
            .and_then(|x| x.split(' ').next()?.parse().ok())
            .unwrap_or(0);
        let at = |a: f64| {
            if a > (k + 1) as f64 {
                "-".to_string()
            } else {
                format!("{:.0}", a / r.ms * 1e3)
            }
        };
        println!(
            "| {} | {:.2} ms | {} | {} | {} |",
            r.what,
            r.ms,
            at(2.0),
            at(2.5),
            at(3.0)
        );
    }
}
