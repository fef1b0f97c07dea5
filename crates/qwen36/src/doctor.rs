//! The doctor: checks that say whether a model runs correctly on this device and dtype, and what
//! to do when it does not. Built for the failure this project started from, a deployment that
//! answered "prime prime prime…" with 100% MTP acceptance because its GDN state was mishandled.
//!
//! [`examine`] runs every check on a model directory ([`examine_ranks`] on a tensor-parallel
//! deployment of it); the groups are public too, so a test can
//! give them a model with a fault injected: [`checkpoint_checks`], [`convention_checks`],
//! [`numerics_checks`], [`speculation_checks`], [`engine_checks`], [`generation_checks`].

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use qwen36_model::{Communicator, Config, LayerCache, LayerType, LoadOptions, MtpHead, Qwen36Model, Weights};
use qwen36_mtp::{MtpDrafter, SpecConfig, SpeculativeDecoder};
use qwen36_sampling::{DegenerationConfig, RepetitionDetector, SamplingParams};
use serde_json::{json, Value};

use crate::{GenerateOptions, Generator, Result};

/// A check's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Pass,
    /// Works, but something deserves a look.
    Warn,
    /// Wrong: the model will not run correctly as it is.
    Fail,
    /// Could not be run here (what it needs is missing).
    Skip,
}

impl Status {
    fn word(self) -> &'static str {
        match self {
            Status::Pass => "pass",
            Status::Warn => "warn",
            Status::Fail => "FAIL",
            Status::Skip => "skip",
        }
    }
}

/// One check's result: what was found and, unless it passed, what to do.
#[derive(Debug, Clone)]
pub struct Check {
    pub group: &'static str,
    pub name: &'static str,
    pub status: Status,
    pub detail: String,
    pub advice: String,
}

fn check(group: &'static str, name: &'static str, status: Status, detail: impl Into<String>) -> Check {
    Check {
        group,
        name,
        status,
        detail: detail.into(),
        advice: String::new(),
    }
}

impl Check {
    fn advise(mut self, advice: impl Into<String>) -> Self {
        self.advice = advice.into();
        self
    }
}

/// Every check's result.
#[derive(Debug, Clone)]
pub struct Report {
    pub model: String,
    pub device: String,
    pub dtype: String,
    pub checks: Vec<Check>,
}

impl Report {
    /// Whether any check failed.
    pub fn failed(&self) -> bool {
        self.checks.iter().any(|c| c.status == Status::Fail)
    }

    /// The report as one line per check, then a summary.
    pub fn render(&self) -> String {
        let mut out = format!(
            "qwen36 doctor: {} on {} in {}\n",
            self.model, self.device, self.dtype
        );
        let mut group = "";
        for c in &self.checks {
            if c.group != group {
                group = c.group;
                out.push_str(&format!("\n{group}\n"));
            }
            out.push_str(&format!("  [{}] {}: {}\n", c.status.word(), c.name, c.detail));
            if !c.advice.is_empty() {
                out.push_str(&format!("         -> {}\n", c.advice));
            }
        }
        let count = |s| self.checks.iter().filter(|c| c.status == s).count();
        out.push_str(&format!(
            "\n{} passed, {} warnings, {} failed, {} skipped\n",
            count(Status::Pass),
            count(Status::Warn),
            count(Status::Fail),
            count(Status::Skip)
        ));
        out
    }

    /// The report as JSON (`checks`: `group`, `name`, `status`, `detail`, `advice`).
    pub fn to_json(&self) -> Value {
        json!({
            "model": self.model,
            "device": self.device,
            "dtype": self.dtype,
            "failed": self.failed(),
            "checks": self.checks.iter().map(|c| json!({
                "group": c.group, "name": c.name, "status": c.status.word().to_lowercase(),
                "detail": c.detail, "advice": c.advice,
            })).collect::<Vec<_>>(),
        })
    }
}

/// How the doctor runs.
#[derive(Debug, Clone)]
pub struct DoctorOptions {
    /// Where and in what dtype the model under test runs (the reference is always the CPU in
    /// f32).
    pub device: Device,
    pub dtype: DType,
    /// Compare only the first N decoder layers with the reference (a large model's f32 copy
    /// may not fit the CPU's memory); `None`: all when the f32 model takes under 8 GB, else 8.
    pub reference_layers: Option<usize>,
    /// Tokens per generation in the speculation and generation checks.
    pub generate_tokens: usize,
}

impl Default for DoctorOptions {
    fn default() -> Self {
        Self {
            device: Device::Cpu,
            dtype: DType::F32,
            reference_layers: None,
            generate_tokens: 96,
        }
    }
}

/// Every check on the model in `dir`. Fails only on options out of range (no tokens to generate,
/// or more than the model's context holds; a reference of no layers); a model that does not
/// load is a failed check in the report.
pub fn examine(dir: &Path, opts: &DoctorOptions) -> Result<Report> {
    check_options(dir, opts)?;
    let mut report = Report {
        model: dir.display().to_string(),
        device: format!("{:?}", opts.device),
        dtype: format!("{:?}", opts.dtype),
        checks: Vec::new(),
    };
    let (checks, loaded) = checkpoint_checks(dir, opts);
    report.checks.extend(checks);
    let Some(generator) = loaded else {
        return Ok(report);
    };
    // (One user: the f32 copy is freed after the numerics, before the engines allocate pools.)
    let reference = SharedReference::new(1);
    run_groups(&mut report, dir, opts, &generator, &reference, |_, _| true);
    Ok(report)
}

/// [`examine`] on a tensor-parallel deployment of the model in `dir`: rank `r` of `comms` loads
/// its shard (on its communicator's device, else `opts.device`) and every rank runs the checks in
/// step, their reductions meeting, against one CPU f32 reference that they share (loaded by the
/// first rank that needs it, freed once every rank has used it). After each group the ranks
/// check that their verdicts so far agree; a rank whose checks fail with an error ends the group
/// for all (none waits in a reduction for it), and the ranks stop there. Returns the first rank's
/// report, closed by a check that every rank reached the same verdicts.
pub fn examine_ranks(dir: &Path, opts: &DoctorOptions, comms: Vec<Arc<dyn Communicator>>) -> Result<Report> {
    check_options(dir, opts)?;
    if comms.is_empty() {
        return Err(qwen36_model::Error::Input("doctor: a tensor-parallel group of no ranks".into()).into());
    }
    let tp = comms.len();
    let reference = SharedReference::new(tp);
    let reports = qwen36_model::run_ranks(comms, |comm| {
        let rank_opts = DoctorOptions {
            device: comm.device().unwrap_or_else(|| opts.device.clone()),
            ..opts.clone()
        };
        examine_rank(dir, &rank_opts, comm, &reference, tp)
    })?;
    let mut reports = reports.into_iter().collect::<Result<Vec<_>>>()?;
    let agree = ranks_agree(&reports);
    let mut report = reports.swap_remove(0);
    report.checks.push(agree);
    Ok(report)
}

/// The CPU f32 reference of the numerics, loaded when first needed and freed once each of its
/// users (one, or the ranks of [`examine_ranks`]) has run its numerics against it.
struct SharedReference {
    model: std::sync::Mutex<Option<std::result::Result<Qwen36Model, String>>>,
    /// Ranks that have run their numerics against it.
    users: std::sync::atomic::AtomicUsize,
    ranks: usize,
}

impl SharedReference {
    fn new(ranks: usize) -> Self {
        Self {
            model: std::sync::Mutex::new(None),
            users: std::sync::atomic::AtomicUsize::new(0),
            ranks,
        }
    }

    /// The numerics group of one rank against the reference (loaded by the first rank here).
    fn numerics(&self, dir: &Path, opts: &DoctorOptions, model: &Qwen36Model, prompt: &[u32]) -> Vec<Check> {
        let reference = {
            let mut slot = self
                .model
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            slot.get_or_insert_with(|| {
                Config::from_file(dir.join("config.json"))
                    .map_err(crate::Error::from)
                    .and_then(|cfg| reference_model(dir, &cfg, opts))
                    .map_err(|e| e.to_string())
            })
            .clone()
        };
        let checks = numerics_or_skip(model, &reference, prompt);
        drop(reference);
        if self.users.fetch_add(1, std::sync::atomic::Ordering::AcqRel) + 1 == self.ranks {
            *self
                .model
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
        }
        checks
    }
}

/// The group of [`examine_ranks`]' own checks.
const TP: &str = "tensor parallelism";

/// Whether every rank's report reached rank 0's verdicts (the same checks, the same statuses);
/// a rank apart is named with its first check that differs.
fn ranks_agree(reports: &[Report]) -> Check {
    let verdicts =
        |r: &Report| -> Vec<(&'static str, Status)> { r.checks.iter().map(|c| (c.name, c.status)).collect() };
    let first = verdicts(&reports[0]);
    let apart: Vec<String> = (1..reports.len())
        .filter(|&r| verdicts(&reports[r]) != first)
        .map(|r| {
            let differs = reports[r]
                .checks
                .iter()
                .enumerate()
                .find(|(i, c)| first.get(*i) != Some(&(c.name, c.status)));
            match differs {
                Some((_, c)) => format!(
                    "rank {r}: {} / {}: {} ({})",
                    c.group,
                    c.name,
                    c.status.word(),
                    c.detail
                ),
                None => format!("rank {r}: fewer checks than rank 0"),
            }
        })
        .collect();
    if apart.is_empty() {
        return check(
            TP,
            "ranks agree",
            Status::Pass,
            format!("{} ranks reached the same verdicts", reports.len()),
        );
    }
    check(TP, "ranks agree", Status::Fail, apart.join("; ")).advise(
        "the ranks must compute the same logits: a rank that failed (named here) stopped the others; otherwise check that every rank holds the same replicated tensors (embedding, norms, lm_head) and gets the same sums from its reductions",
    )
}

/// Whether a check records an error of the model, the engine or a generation (the rank could
/// not run the group to its end), not a verdict on its results.
fn is_error(c: &Check) -> bool {
    c.status == Status::Fail && (c.name == "run" || c.detail.contains(" failed: "))
}

/// Whether every rank's verdicts so far equal this rank's: a 32-bit digest of the checks' names
/// and statuses, its bits summed over the ranks (each sum 0 or the rank count when they agree).
fn verdicts_agree(comm: &dyn Communicator, checks: &[Check]) -> Result<bool> {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for c in checks {
        (c.name, c.status.word()).hash(&mut h);
    }
    let digest = h.finish() as u32;
    let bits: Vec<f32> = (0..32).map(|b| ((digest >> b) & 1) as f32).collect();
    let device = comm.device().unwrap_or(Device::Cpu);
    let sums = comm
        .all_reduce_sum(&Tensor::new(bits.as_slice(), &device)?)?
        .to_vec1::<f32>()?;
    let n = comm.size() as f32;
    Ok(sums.iter().all(|&s| s == 0.0 || s == n))
}

/// One rank's share of [`examine_ranks`]: the groups of [`examine`] on its shard, the ranks
/// checking after each that they still agree.
fn examine_rank(
    dir: &Path,
    opts: &DoctorOptions,
    comm: Arc<dyn Communicator>,
    reference: &SharedReference,
    tp: usize,
) -> Result<Report> {
    let mut report = Report {
        model: dir.display().to_string(),
        device: format!("{tp} tensor-parallel ranks, rank 0 on {:?}", opts.device),
        dtype: format!("{:?}", opts.dtype),
        checks: Vec::new(),
    };
    let (checks, loaded) = checkpoint_checks_with(dir, opts, Some(comm.clone()));
    report.checks.extend(checks);
    // Every rank learns whether all loaded (one that failed must not leave the others waiting
    // in their first reduction; its own failed check is in its report).
    let all = comm.barrier(loaded.is_some());
    let generator = match (loaded, all) {
        (Some(g), Ok(())) => g,
        (None, _) => return Ok(report),
        (Some(_), Err(e)) => {
            report.checks.push(
                check(TP, "every rank loaded", Status::Fail, e.to_string()).advise(
                    "a rank could not load its shard: the ranks' agreement below names its failed check",
                ),
            );
            return Ok(report);
        }
    };
    run_groups(
        &mut report,
        dir,
        opts,
        &generator,
        reference,
        |report, errored| {
            if errored {
                // Ends every rank's pending and later reductions: the others' groups end with an
                // error too, none waiting for this rank.
                comm.abort();
                return false;
            }
            let stopped = match verdicts_agree(comm.as_ref(), &report.checks) {
                Ok(true) => return true,
                Ok(false) => "the ranks' verdicts parted in the group above".to_string(),
                Err(e) => format!("another rank's checks failed with an error: {e}"),
            };
            report.checks.push(
            check(TP, "ranks in step", Status::Fail, format!("{stopped}; the ranks stopped there"))
                .advise("the ranks must compute the same logits: see the checks above and the ranks' agreement below"),
        );
            false
        },
    );
    Ok(report)
}

/// The groups after the checkpoint, in order (conventions, numerics, speculation, engine,
/// generation) on `generator`'s model; after each, `go_on(report, errored)` says whether to run
/// the next (`errored`: a check of the group records an error, not a verdict).
fn run_groups(
    report: &mut Report,
    dir: &Path,
    opts: &DoctorOptions,
    generator: &Generator,
    reference: &SharedReference,
    mut go_on: impl FnMut(&mut Report, bool) -> bool,
) {
    let model = generator.model();
    let prompt = probe_prompt(model.config().vocab_size, 80);
    let groups: [&dyn Fn() -> Vec<Check>; 5] = [
        &|| convention_checks(dir),
        &|| reference.numerics(dir, opts, model, &prompt),
        &|| speculation_checks(model, generator.mtp_head(), &prompt[..16], opts.generate_tokens),
        &|| {
            engine_checks(
                model,
                model,
                generator.mtp_head(),
                &prompt[..16],
                opts.generate_tokens,
            )
        },
        &|| generation_checks(generator, opts.generate_tokens),
    ];
    for group in groups {
        let checks = group();
        let errored = checks.iter().any(is_error);
        report.checks.extend(checks);
        if !go_on(report, errored) {
            return;
        }
    }
}

/// The most drafts a check verifies at once (the rollback check's 4 tokens; MTP at k = 3).
const MAX_CHECK_DRAFTS: usize = 4;

/// Refuses options out of range, before any loading: among them more tokens than the context
/// of the model in `dir` holds after the probe (the speculation and engine checks run 16 probe
/// tokens, the tokens asked for and up to [`MAX_CHECK_DRAFTS`] drafts). A config that does not
/// parse is left to the checkpoint checks to report.
fn check_options(dir: &Path, opts: &DoctorOptions) -> Result<()> {
    if opts.generate_tokens == 0 || opts.reference_layers == Some(0) {
        return Err(qwen36_model::Error::Input(format!(
            "doctor: generate_tokens ({}) and reference_layers ({:?}) must be at least 1",
            opts.generate_tokens, opts.reference_layers
        ))
        .into());
    }
    match Config::from_file(dir.join("config.json")) {
        Ok(cfg) => tokens_fit(opts.generate_tokens, cfg.max_position_embeddings),
        Err(_) => Ok(()),
    }
}

/// Refuses `tokens` to generate past what a `context` holds after the probe's 16 tokens and
/// [`MAX_CHECK_DRAFTS`] drafts.
fn tokens_fit(tokens: usize, context: usize) -> Result<()> {
    let room = context.saturating_sub(16 + MAX_CHECK_DRAFTS);
    if tokens > room {
        return Err(qwen36_model::Error::Input(format!(
            "doctor: {tokens} tokens to generate do not fit the model's context of {context} after the probe (at most {room})"
        ))
        .into());
    }
    Ok(())
}

/// The numerics group against `reference`, or why it could not run.
fn numerics_or_skip(
    model: &Qwen36Model,
    reference: &std::result::Result<Qwen36Model, String>,
    prompt: &[u32],
) -> Vec<Check> {
    match reference {
        Ok(r) => numerics_checks(model, r, prompt),
        Err(e) => vec![check(
            "numerics",
            "reference",
            Status::Skip,
            format!("no CPU f32 reference: {e}"),
        )
        .advise("run on a machine with the memory for the f32 model, or pass --reference-layers N")],
    }
}

/// Deterministic probe ids below `vocab` (a fixed xorshift stream).
fn probe_prompt(vocab: usize, len: usize) -> Vec<u32> {
    let mut s = 0x2545_f491_4f6c_dd1du64;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab as u64) as u32
        })
        .collect()
}

/// The CPU f32 model of `dir`, cut to the layers the options allow.
fn reference_model(dir: &Path, cfg: &Config, opts: &DoctorOptions) -> Result<Qwen36Model> {
    let mut cfg = cfg.clone();
    let params = 4.0 * (cfg.hidden_size * cfg.hidden_size) as f64 * 12.0 * cfg.num_hidden_layers as f64
        + (cfg.vocab_size * cfg.hidden_size) as f64;
    let layers = opts.reference_layers.unwrap_or(if params * 4.0 < 8e9 {
        cfg.num_hidden_layers
    } else {
        8
    });
    cfg.num_hidden_layers = layers.min(cfg.num_hidden_layers);
    cfg.layer_types.truncate(cfg.num_hidden_layers);
    let w = Weights::open(dir, LoadOptions::default())?;
    Ok(Qwen36Model::from_weights(cfg, &w)?)
}

/// The checkpoint: config, weights (shapes, NaN/inf, layer kinds against the tensors present),
/// the MTP head, the tokenizer against the vocabulary, the stop ids, the chat template. Returns
/// the loaded generator when the model loads.
pub fn checkpoint_checks(dir: &Path, opts: &DoctorOptions) -> (Vec<Check>, Option<Generator>) {
    checkpoint_checks_with(dir, opts, None)
}

/// [`checkpoint_checks`], loading the shard of tensor-parallel rank `comm` when given.
fn checkpoint_checks_with(
    dir: &Path,
    opts: &DoctorOptions,
    comm: Option<Arc<dyn Communicator>>,
) -> (Vec<Check>, Option<Generator>) {
    const G: &str = "checkpoint";
    let mut out = Vec::new();
    let cfg = match Config::from_file(dir.join("config.json")) {
        Ok(c) => {
            out.push(check(
                G,
                "config.json",
                Status::Pass,
                format!(
                    "{} layers ({} GDN, {} attention), hidden {}, vocab {}, GDN state {:?}",
                    c.num_hidden_layers,
                    c.layer_types
                        .iter()
                        .filter(|t| **t == LayerType::LinearAttention)
                        .count(),
                    c.layer_types
                        .iter()
                        .filter(|t| **t == LayerType::FullAttention)
                        .count(),
                    c.hidden_size,
                    c.vocab_size,
                    c.mamba_ssm_dtype
                ),
            ));
            c
        }
        Err(e) => {
            out.push(check(G, "config.json", Status::Fail, e.to_string()).advise(
                "fix config.json: the GDN state must be float32 (mamba_ssm_dtype), layer_types must name every layer",
            ));
            return (out, None);
        }
    };
    let load = LoadOptions {
        dtype: opts.dtype,
        device: opts.device.clone(),
        ..LoadOptions::default()
    };
    let sharded = comm.is_some();
    let loaded = match comm {
        Some(comm) => Generator::load_shard(dir, load, comm),
        None => Generator::load(dir, load),
    };
    let generator = match loaded {
        Ok(g) => {
            out.push(check(
                G,
                "weights",
                Status::Pass,
                "every tensor the config implies is present, shaped as it says, and finite",
            ));
            g
        }
        // The tokenizer, the chat template or generation_config.json, read before the weights.
        Err(e @ (crate::Error::File { .. } | crate::Error::Tokenizer { .. })) => {
            out.push(check(G, "tokenizer and templates", Status::Fail, e.to_string()).advise(
                "fix the named file (a chat template that does not compile can be replaced: serve --chat-template FILE); the weights were not read",
            ));
            return (out, None);
        }
        Err(e) => {
            // (A config field that does not split over the ranks: the rank count is wrong, not
            // the checkpoint.)
            let split = sharded && matches!(&e, crate::Error::Model(qwen36_model::Error::Config { .. }));
            out.push(check(G, "weights", Status::Fail, e.to_string()).advise(if split {
                "choose a tensor-parallel rank count that divides the named field (its heads split over the ranks)"
            } else {
                "the named tensor is missing, misshapen or not finite: re-download or re-convert the checkpoint (a missing layer's tensors usually mean layer_types does not match it)"
            }));
            return (out, None);
        }
    };
    out.push(match (generator.mtp_head(), cfg.mtp_num_hidden_layers) {
        (Some(_), n) => check(G, "MTP head", Status::Pass, format!("present ({} layer(s))", n.max(1))),
        (None, 0) => check(G, "MTP head", Status::Warn, "none in this checkpoint")
            .advise("speculative decoding needs the MTP head (mtp.*); prompt lookup (--drafter ngram) works without it"),
        (None, n) => check(
            G,
            "MTP head",
            Status::Warn,
            format!("config.json declares {n} MTP layer(s) but the checkpoint has no mtp.* tensors"),
        )
        .advise("quantization and conversion pipelines often drop mtp.* (transformers ignores them on load): take the MTP tensors from the original checkpoint"),
    });
    let stop_ids = generator.default_stop_ids();
    match generator.tokenizer() {
        None => out.push(
            check(G, "tokenizer", Status::Warn, "no tokenizer.json")
                .advise("text prompts and stop strings need tokenizer.json"),
        ),
        Some(t) => {
            let size = t.get_vocab_size(true);
            out.push(if size <= cfg.vocab_size {
                check(
                    G,
                    "tokenizer",
                    Status::Pass,
                    format!("{size} ids, within the model's {}", cfg.vocab_size),
                )
            } else {
                check(
                    G,
                    "tokenizer",
                    Status::Fail,
                    format!("{size} ids but the embedding has {} rows", cfg.vocab_size),
                )
                .advise("the tokenizer belongs to another model: use the checkpoint's own tokenizer.json")
            });
        }
    }
    // (Stop ids are checked with or without a tokenizer; it only names them.)
    let tokenizer = generator.tokenizer();
    let named: Vec<String> = stop_ids
        .iter()
        .map(|&i| match tokenizer {
            Some(t) => t
                .id_to_token(i)
                .unwrap_or_else(|| format!("<{i}: not in the tokenizer>")),
            None => format!("{i}"),
        })
        .collect();
    let unknown =
        |i: u32| i as usize >= cfg.vocab_size || tokenizer.is_some_and(|t| t.id_to_token(i).is_none());
    out.push(if stop_ids.is_empty() {
        check(G, "stop ids", Status::Warn, "none in generation_config.json or config.json")
            .advise("generation never stops at the end of a turn: add eos_token_id (Qwen3.6: 248046 <|im_end|> and 248044)")
    } else if stop_ids.iter().any(|&i| unknown(i)) {
        check(G, "stop ids", Status::Fail, format!("{stop_ids:?} ({})", named.join(", ")))
            .advise("a stop id is outside the vocabulary: fix eos_token_id")
    } else {
        check(G, "stop ids", Status::Pass, format!("{stop_ids:?} = {}", named.join(", ")))
    });
    out.push(match generator.chat_template() {
        Some(t) => check(
            G,
            "chat template",
            Status::Pass,
            format!(
                "present ({})",
                t.path().file_name().unwrap_or_default().to_string_lossy()
            ),
        ),
        None => check(G, "chat template", Status::Warn, "none")
            .advise("chat requests need a chat template (chat_template.jinja, or tokenizer_config.json's chat_template)"),
    });
    (out, Some(generator))
}

/// Statistics of a tensor's values: mean and mean absolute deviation from it.
fn mean_and_spread(t: &Tensor) -> Result<(f32, f32)> {
    let t = t.to_dtype(DType::F32)?.flatten_all()?;
    let mean = t.mean_all()?.to_scalar::<f32>()?;
    let spread = (t - mean as f64)?.abs()?.mean_all()?.to_scalar::<f32>()?;
    Ok((mean, spread))
}

/// Weight conventions, read on the CPU: Qwen3.5/3.6's (1+w) RMSNorm weights are centred on 0 (a
/// checkpoint converted with the plain-w convention has them near 1, which doubles every layer's
/// scale), the GDN's gated norm is plain w (near 1), `A_log` and `dt_bias` in a plausible range.
pub fn convention_checks(dir: &Path) -> Vec<Check> {
    const G: &str = "conventions";
    let run = || -> Result<Vec<Check>> {
        let cfg = Config::from_file(dir.join("config.json"))?;
        let w = Weights::open(dir, LoadOptions::default())?;
        let (h, hd, dv, hv) = (
            cfg.hidden_size,
            cfg.head_dim,
            cfg.linear_value_head_dim,
            cfg.linear_num_value_heads,
        );
        // (name, its length)
        let mut one_plus = vec![(w.lm_name("norm.weight"), h)];
        let mut gated = Vec::new();
        let (mut a_logs, mut dt_biases) = (Vec::new(), Vec::new());
        for (i, kind) in cfg.layer_types.iter().enumerate() {
            let l = w.lm_name(&format!("layers.{i}."));
            one_plus.push((format!("{l}input_layernorm.weight"), h));
            one_plus.push((format!("{l}post_attention_layernorm.weight"), h));
            match kind {
                LayerType::FullAttention => {
                    one_plus.push((format!("{l}self_attn.q_norm.weight"), hd));
                    one_plus.push((format!("{l}self_attn.k_norm.weight"), hd));
                }
                LayerType::LinearAttention => {
                    gated.push((format!("{l}linear_attn.norm.weight"), dv));
                    a_logs.push((format!("{l}linear_attn.A_log"), hv));
                    dt_biases.push((format!("{l}linear_attn.dt_bias"), hv));
                }
            }
        }
        let load =
            |(name, len): &(String, usize)| -> Result<Tensor> { Ok(w.get(name, &[*len], DType::F32)?) };
        let mut out = Vec::new();
        // (1+w) norms: the mean of each tensor's values; converted wrongly, they sit near 1.
        let means: Vec<(String, f32)> = one_plus
            .iter()
            .map(|n| Ok((n.0.clone(), mean_and_spread(&load(n)?)?.0)))
            .collect::<Result<_>>()?;
        let near_one: Vec<&(String, f32)> = means.iter().filter(|(_, m)| (*m - 1.0).abs() < 0.5).collect();
        let avg = means.iter().map(|(_, m)| m).sum::<f32>() / means.len() as f32;
        out.push(if near_one.len() * 2 > means.len() {
            check(
                G,
                "(1+w) RMSNorm weights",
                Status::Fail,
                format!(
                    "{} of {} norm weights are centred near 1 (mean {avg:.3}, e.g. {} = {:.3})",
                    near_one.len(),
                    means.len(),
                    near_one[0].0,
                    near_one[0].1
                ),
            )
            .advise("Qwen3.5/3.6 stores w and computes x·(1+w): this checkpoint holds 1+w (a plain-RMSNorm conversion), so every norm scales by about 2. Subtract 1 from these weights or re-convert")
        } else {
            check(
                G,
                "(1+w) RMSNorm weights",
                Status::Pass,
                format!("{} norm weights centred on 0 (mean {avg:.3})", means.len()),
            )
        });
        if !gated.is_empty() {
            let gm: Vec<f32> = gated
                .iter()
                .map(|n| Ok(mean_and_spread(&load(n)?)?.0))
                .collect::<Result<_>>()?;
            let avg = gm.iter().sum::<f32>() / gm.len() as f32;
            out.push(if avg.abs() < 0.5 {
                check(G, "GDN gated norm", Status::Fail, format!("centred on {avg:.3}, expected near 1"))
                    .advise("the GDN output norm is a plain weight (not 1+w): this looks like a (1+w) conversion applied to it")
            } else {
                check(G, "GDN gated norm", Status::Pass, format!("plain weights centred on {avg:.3}"))
            });
            let values = |names: &[(String, usize)]| -> Result<Vec<f32>> {
                let mut v = Vec::new();
                for n in names {
                    v.extend(load(n)?.flatten_all()?.to_vec1::<f32>()?);
                }
                Ok(v)
            };
            let a = values(&a_logs)?;
            let dt = values(&dt_biases)?;
            let (amin, amax) = a
                .iter()
                .fold((f32::MAX, f32::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));
            // softplus(dt_bias) is the base step size: Mamba-style inits put it in [1e-3, 1e-1].
            let softplus = |x: f32| if x > 20.0 { x } else { x.exp().ln_1p() };
            let (dmin, dmax) = dt.iter().fold((f32::MAX, f32::MIN), |(lo, hi), &x| {
                (lo.min(softplus(x)), hi.max(softplus(x)))
            });
            let plausible = (-10.0..=10.0).contains(&amin)
                && (-10.0..=10.0).contains(&amax)
                && dmin > 1e-6
                && dmax < 100.0;
            out.push(if plausible {
                check(
                    G,
                    "GDN gates",
                    Status::Pass,
                    format!("A_log in [{amin:.2}, {amax:.2}], softplus(dt_bias) in [{dmin:.2e}, {dmax:.2e}]"),
                )
            } else {
                check(
                    G,
                    "GDN gates",
                    Status::Warn,
                    format!("A_log in [{amin:.2}, {amax:.2}], softplus(dt_bias) in [{dmin:.2e}, {dmax:.2e}]"),
                )
                .advise("implausible decay gates: check that A_log holds log(A) (not A or -A) and dt_bias is the raw bias")
            });
        }
        Ok(out)
    };
    run().unwrap_or_else(|e| {
        vec![check(
            G,
            "weights",
            Status::Skip,
            format!("could not read the weights: {e}"),
        )]
    })
}

/// Last-position logits of `ids` through `model` from a fresh cache (or `cache`).
fn last_logits(model: &Qwen36Model, cache: &mut qwen36_model::Cache, ids: &[u32]) -> Result<Tensor> {
    let t = Tensor::new(ids, model.device())?.unsqueeze(0)?;
    Ok(model
        .forward_last(&t, cache)?
        .to_dtype(DType::F32)?
        .to_device(&Device::Cpu)?)
}

/// The largest difference between two rows relative to the second's largest magnitude.
fn rel_err(a: &Tensor, b: &Tensor) -> Result<f32> {
    let a = a.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
    let b = b.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
    let diff = (&a - &b)?.abs()?;
    // (candle's max skips NaN; a sum does not: a NaN or inf anywhere is an infinite error.)
    if !diff.sum_all()?.to_scalar::<f32>()?.is_finite() {
        return Ok(f32::INFINITY);
    }
    let diff = diff.max_all()?.to_scalar::<f32>()?;
    let scale = b.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-30);
    Ok(diff / scale)
}

/// The bound a numerics comparison holds for the model's dtype: f32 sums in another order (the
/// bound the tests against transformers hold, 1e-4 of a row's scale), or bf16/f16 rounding
/// through the layers.
fn tolerance(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 1e-4,
        DType::F16 => 5e-2,
        _ => 1.5e-1,
    }
}

/// Numerics on the model's device and dtype: every layer's output against the CPU f32
/// `reference` (the first layer where the error jumps past the dtype's bound is named, with its
/// kind), chunked against token-by-token GDN, the recurrent state's dtype as allocated, a
/// prefill against a prefill one shorter plus a decode step, and a cache reset between
/// sequences.
pub fn numerics_checks(model: &Qwen36Model, reference: &Qwen36Model, prompt: &[u32]) -> Vec<Check> {
    const G: &str = "numerics";
    let tol = tolerance(model.dtype());
    let mut out = Vec::new();
    let run = |out: &mut Vec<Check>| -> Result<()> {
        // A prefill, then decode steps: a state carried wrongly from one call to the next shows
        // in the steps.
        let steps = 8.min(prompt.len() - 1);
        let split = prompt.len() - steps;
        let (mut cache, mut ref_cache) = (model.new_cache(1)?, reference.new_cache(1)?);
        let mut errs: Vec<f32> = Vec::new();
        for (i, part) in std::iter::once(&prompt[..split])
            .chain(prompt[split..].chunks(1))
            .enumerate()
        {
            let ids = Tensor::new(part, model.device())?.unsqueeze(0)?;
            let (_, states) = model.forward_hidden_states(&ids, &mut cache)?;
            let (_, ref_states) =
                reference.forward_hidden_states(&ids.to_device(&Device::Cpu)?, &mut ref_cache)?;
            let n = ref_states.len() - 1;
            if i == 0 {
                errs = vec![0.0; n];
            }
            for l in 0..n {
                errs[l] = errs[l].max(rel_err(&states[l + 1], &ref_states[l + 1])?);
            }
        }
        let n = errs.len();
        let kinds = &model.config().layer_types;
        let worst = errs.iter().copied().fold(0f32, f32::max);
        out.push(match errs.iter().position(|&e| e > tol) {
            None => check(
                G,
                "layers against the CPU f32 reference",
                Status::Pass,
                format!("{n} layers over a prefill and {steps} decode steps, largest relative error {worst:.2e} (bound {tol:.0e})"),
            ),
            Some(l) => {
                let kind = match kinds[l] {
                    LayerType::LinearAttention => "GDN",
                    LayerType::FullAttention => "attention",
                };
                let advice = match kinds[l] {
                    LayerType::LinearAttention => "a GDN layer goes wrong first: the recurrent state must be f32 end to end (a bf16 state, or a kernel that rounds it, drifts and ends in loops); check the delta-rule kernels and the state's dtype",
                    LayerType::FullAttention => "an attention layer goes wrong first: check the attention backend (gating, partial RoPE, q/k norms) and the KV cache",
                };
                check(
                    G,
                    "layers against the CPU f32 reference",
                    Status::Fail,
                    format!(
                        "layer {l} ({kind}) is the first past the bound: error {:.2e} (bound {tol:.0e}); before it at most {:.2e}",
                        errs[l],
                        errs[..l].iter().copied().fold(0f32, f32::max)
                    ),
                )
                .advise(advice)
            }
        });
        // Chunked prefill against token-by-token recurrence.
        let whole = last_logits(model, &mut model.new_cache(1)?, prompt)?;
        let mut cache = model.new_cache(1)?;
        let mut stepped = None;
        for &t in prompt {
            stepped = Some(last_logits(model, &mut cache, &[t])?);
        }
        let e = rel_err(&whole, &stepped.expect("a prompt"))?;
        out.push(if e <= tol {
            check(G, "chunked against recurrent GDN", Status::Pass, format!("{} tokens: error {e:.2e}", prompt.len()))
        } else {
            check(G, "chunked against recurrent GDN", Status::Fail, format!("{} tokens: error {e:.2e} (bound {tol:.0e})", prompt.len()))
                .advise("the prefill (chunked) and decode (recurrent) paths of the GDN disagree: one of them carries the state wrongly")
        });
        let dtypes: Vec<DType> = cache
            .layers()
            .iter()
            .filter_map(|l| match l {
                LayerCache::Gdn(s) => Some(s.recurrent().dtype()),
                LayerCache::Attention(_) => None,
            })
            .collect();
        out.push(if dtypes.iter().all(|d| *d == DType::F32) {
            check(G, "GDN state dtype", Status::Pass, format!("f32 in all {} GDN layers", dtypes.len()))
        } else {
            check(G, "GDN state dtype", Status::Fail, format!("{dtypes:?}"))
                .advise("the recurrent state must be f32 (mamba_ssm_dtype float32): a half-precision state degenerates into loops")
        });
        let mut cache = model.new_cache(1)?;
        last_logits(model, &mut cache, &prompt[..prompt.len() - 1])?;
        let split = last_logits(model, &mut cache, &prompt[prompt.len() - 1..])?;
        let e = rel_err(&split, &whole)?;
        out.push(if e <= tol {
            check(G, "prefill(T) = prefill(T-1) + decode(1)", Status::Pass, format!("error {e:.2e}"))
        } else {
            check(G, "prefill(T) = prefill(T-1) + decode(1)", Status::Fail, format!("error {e:.2e} (bound {tol:.0e})"))
                .advise("a decode step after a prefill does not continue it: the state or KV handed from prefill to decode is wrong")
        });
        // A second sequence after a reset equals the same sequence in a fresh cache.
        let other: Vec<u32> = prompt.iter().rev().copied().collect();
        let mut cache = model.new_cache(1)?;
        last_logits(model, &mut cache, &other)?;
        cache.reset()?;
        let after = last_logits(model, &mut cache, prompt)?;
        let e = rel_err(&after, &whole)?;
        out.push(if e <= tol / 10.0 {
            check(G, "state reset between sequences", Status::Pass, format!("error {e:.2e}"))
        } else {
            check(G, "state reset between sequences", Status::Fail, format!("a sequence after another differs from itself alone by {e:.2e}"))
                .advise("the GDN state is not reset (or freed) when a sequence ends: the next one starts from the last one's state")
        });
        Ok(())
    };
    if let Err(e) = run(&mut out) {
        out.push(check(G, "run", Status::Fail, format!("the model failed: {e}")));
    }
    out
}

/// Whether `tokens` loop (the repetition detector's default).
fn loops(tokens: &[u32]) -> Option<qwen36_sampling::Degeneration> {
    let mut d = RepetitionDetector::new(DegenerationConfig::default());
    tokens.iter().find_map(|&t| d.observe(t, None))
}

/// Speculation: greedy decoding with the MTP head (k = 3) must give plain greedy's tokens; each
/// commit of a verify must restore the state of a fresh run over the kept tokens; acceptance per
/// position is reported, and near-perfect acceptance on a looping output is diagnosed as what it
/// is (a corrupted state feeding the drafter's guess back), not a good drafter.
pub fn speculation_checks(
    model: &Qwen36Model,
    head: Option<&MtpHead>,
    prompt: &[u32],
    n: usize,
) -> Vec<Check> {
    const G: &str = "speculation";
    let mut out = Vec::new();
    let run = |out: &mut Vec<Check>| -> Result<()> {
        // Rollback: verify 4 tokens, keep a of them, then the next logits against a fresh run.
        let drafts: Vec<u32> = prompt.iter().rev().take(4).copied().collect();
        let mut worst = 0f32;
        for keep in 1..=drafts.len() {
            let mut cache = model.new_cache(1)?;
            last_logits(model, &mut cache, prompt)?;
            let ids = Tensor::new(drafts.as_slice(), model.device())?.unsqueeze(0)?;
            model.forward_verify(&ids, &mut cache)?;
            cache.commit(keep)?;
            let next = last_logits(model, &mut cache, &[drafts[0]])?;
            let mut kept = prompt.to_vec();
            kept.extend(&drafts[..keep]);
            kept.push(drafts[0]);
            let fresh = last_logits(model, &mut model.new_cache(1)?, &kept)?;
            worst = worst.max(rel_err(&next, &fresh)?);
        }
        let tol = tolerance(model.dtype());
        out.push(if worst <= tol {
            check(G, "rollback after a verify", Status::Pass, format!("keeping 1..4 of 4 verified tokens: error {worst:.2e}"))
        } else {
            check(G, "rollback after a verify", Status::Fail, format!("a commit differs from a fresh run over the kept tokens by {worst:.2e}"))
                .advise("the state restored after a partial acceptance is not the one after the last accepted token: speculative decoding then corrupts the sequence")
        });
        let Some(head) = head else {
            out.push(check(G, "MTP greedy = plain greedy", Status::Skip, "no MTP head"));
            return Ok(());
        };
        let plain = solo_greedy(model, prompt, n)?;
        let mut dec = SpeculativeDecoder::new(model, SamplingParams::greedy())?;
        let cfg = SpecConfig {
            k: 3,
            max_new_tokens: n,
            stop_token_ids: Vec::new(),
        };
        let spec = dec.generate(&mut MtpDrafter::new(model, head), prompt, &cfg, |_| true)?;
        out.extend(speculative_verdicts(
            (G, "MTP greedy = plain greedy"),
            &spec.tokens,
            &plain,
            &spec.stats,
            model.dtype(),
            "speculative decoding must not change greedy output: the verify's rollback or the MTP head's cache is wrong",
        ));
        Ok(())
    };
    if let Err(e) = run(&mut out) {
        out.push(check(G, "run", Status::Fail, format!("the model failed: {e}")));
    }
    out
}

/// One step of a greedy run: the token, its log-probability, the likeliest tokens with theirs,
/// and the largest logit magnitude of its row (the scale its rounding is relative to).
#[derive(Debug, Clone)]
struct Step {
    token: u32,
    logprob: f32,
    top: Vec<(u32, f32)>,
    scale: f32,
}

/// How far two greedy runs of one model may be apart in `dtype`: a token's log-probability by
/// `2·rel·scale` (a logit moved by `rel` of its row's scale moves a log-probability by at most
/// twice that), and two tokens count as tied where their log-probabilities are within
/// `max(tie·scale, 4 × the largest difference seen before)` of each other (and within that
/// bound): sums in another order may then pick either. `tie` is four units in the last place of
/// a logit of the row's scale in half precision (bf16 logits near 15 are 1/16 apart; on the
/// bundled model in bf16, batched and solo runs part where the two tokens were 0.06 and 0.25
/// apart); in f32 only the differences seen count. Returns `(rel, tie)`.
fn run_bounds(dtype: DType) -> (f32, f32) {
    match dtype {
        DType::F32 => (1e-4, 0.0),
        DType::F16 => (2f32.powi(-7), 2f32.powi(-8)),
        _ => (2f32.powi(-5), 2f32.powi(-5)),
    }
}

/// Where the `tokens` of a run part from `reference`'s, if they do.
enum Parting {
    Agree,
    /// At `at`, where the reference's token and this run's are `gap` apart in log-probability:
    /// within the tie bound.
    Tie {
        at: usize,
        gap: f32,
    },
    /// At `at`, `gap` apart where the reference's likeliest tokens show this run's.
    Apart {
        at: usize,
        gap: Option<f32>,
    },
}

/// Where `tokens` part from `reference` (`seen`: the largest log-probability difference
/// between the runs before that point, 0 when unknown), and whether the reference's choice
/// there was tied with this run's.
fn parting(tokens: &[u32], reference: &[Step], seen: f32, dtype: DType) -> Parting {
    let (rel, tie) = run_bounds(dtype);
    let Some(at) = tokens.iter().zip(reference).position(|(a, b)| *a != b.token) else {
        return match tokens.len() == reference.len() {
            true => Parting::Agree,
            false => Parting::Apart {
                at: tokens.len().min(reference.len()),
                gap: None,
            },
        };
    };
    let r = &reference[at];
    let gap = r
        .top
        .iter()
        .find(|(t, _)| *t == tokens[at])
        .map(|(_, l)| r.logprob - l);
    match gap {
        Some(g) if g <= (2.0 * rel * r.scale).min((tie * r.scale).max(4.0 * seen)) => {
            Parting::Tie { at, gap: g }
        }
        _ => Parting::Apart { at, gap },
    }
}

/// How far apart two parting tokens were, for a check's detail.
fn apart(gap: Option<f32>) -> String {
    match gap {
        Some(g) => format!(" (the reference put this run's token {g:.2e} below its own)"),
        None => String::new(),
    }
}

/// Greedy decoding of `n` tokens after `prompt` through a `Cache` (the solo path), each step
/// with its log-probability and 5 likeliest tokens.
fn solo_greedy(model: &Qwen36Model, prompt: &[u32], n: usize) -> Result<Vec<Step>> {
    // (The engine's log-probabilities come from the same function.)
    let sampler = qwen36_sampling::Sampler::new(SamplingParams {
        top_logprobs: 5,
        ..SamplingParams::greedy()
    })?;
    let mut cache = model.new_cache(1)?;
    let mut logits = last_logits(model, &mut cache, prompt)?;
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let row = logits.squeeze(0)?.to_vec1::<f32>()?;
        let s = sampler.sample_at(&row, prompt, &[], 0, 0)?;
        let scale = row.iter().fold(0f32, |m, x| m.max(x.abs()));
        out.push(Step {
            token: s.token,
            logprob: s.logprob,
            top: s.top_logprobs,
            scale,
        });
        if out.len() < n {
            logits = last_logits(model, &mut cache, &[s.token])?;
        }
    }
    Ok(out)
}

/// A speculative greedy run against the plain one (`plain`, with its log-probabilities): the
/// same tokens (the check `name`, with the acceptance per position; where they part on a tie
/// in half precision a warning, else `advice`), and near-perfect acceptance on a looping output
/// named for what it is: a corrupted GDN state feeding the drafter's guess back, not a good
/// drafter.
fn speculative_verdicts(
    (group, name): (&'static str, &'static str),
    spec: &[u32],
    plain: &[Step],
    stats: &qwen36_mtp::SpecStats,
    dtype: DType,
    advice: &str,
) -> Vec<Check> {
    let rates = stats.acceptance_by_position();
    let by_pos = rates
        .iter()
        .map(|x| format!("{x:.2}"))
        .collect::<Vec<_>>()
        .join(", ");
    let mut out = vec![match parting(spec, plain, 0.0, dtype) {
        Parting::Agree => check(
            group,
            name,
            Status::Pass,
            format!("{} tokens identical; acceptance by position [{by_pos}]", spec.len()),
        ),
        Parting::Tie { at, gap } => check(
            group,
            name,
            Status::Warn,
            format!("the outputs part at token {at} on a near-tie (the two tokens {gap:.2e} apart in log-probability); acceptance by position [{by_pos}]"),
        )
        .advise("in half precision a verify row still sums in another order than a decode row, so greedy outputs may part where two tokens are tied: rounding, not state; an f32 run should show none"),
        Parting::Apart { at, gap } => check(
            group,
            name,
            Status::Fail,
            format!("the outputs part at token {at}{}; acceptance by position [{by_pos}]", apart(gap)),
        )
        .advise(advice),
    }];
    let rate = rates.first().copied().unwrap_or(0.0);
    if let (Some(d), true) = (loops(spec), rate > 0.9) {
        out.push(
            check(group, "acceptance on a loop", Status::Fail, format!("acceptance {rate:.2} while the output has {d}"))
                .advise("near-perfect acceptance of a looping output is the signature of a corrupted GDN state (the target repeats what the drafter guesses), not a good drafter: see the numerics checks"),
        );
    }
    out
}

/// A request's greedy steps (log-probabilities with the 5 likeliest; the rows' scales those of
/// the same prompt's solo run) and its usage, from the engine.
type EngineRun = (Vec<Step>, qwen36_engine::Usage);

/// Runs `requests` through `engine` together, each with the solo run of its prompt (whose
/// rows' scales its steps take), and collects each one's steps.
fn engine_runs(
    engine: &mut qwen36_engine::Engine,
    requests: Vec<(qwen36_engine::Request, &[Step])>,
) -> Result<Vec<EngineRun>> {
    use qwen36_engine::Event;
    let (requests, solos): (Vec<_>, Vec<_>) = requests.into_iter().unzip();
    let handles = requests
        .into_iter()
        .map(|r| engine.submit(r))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    engine.run_to_completion()?;
    handles
        .iter()
        .zip(solos)
        .map(|(h, solo)| {
            let (mut steps, mut usage) = (Vec::new(), None);
            for e in h.drain() {
                match e {
                    Event::Token { logprobs, .. } => {
                        for s in logprobs.unwrap_or_default() {
                            let scale = solo.get(steps.len()).map_or(0.0, |r| r.scale);
                            steps.push(Step {
                                token: s.token,
                                logprob: s.logprob,
                                top: s.top_logprobs,
                                scale,
                            });
                        }
                    }
                    Event::Finished { usage: u, .. } => usage = Some(u),
                    Event::Failed { error } => return Err(crate::Error::Generation(error)),
                    // (Not asked for.)
                    Event::Prompt { .. } => {}
                }
            }
            Ok((steps, usage.unwrap_or_default()))
        })
        .collect()
}

/// How a run's steps compare with the solo path's (`solo`) in `dtype`: pass when the tokens
/// agree and each log-probability lies within the bound of [`run_bounds`]; a warning where they
/// part on a tie; a failure otherwise.
fn compare_runs(run: &[Step], solo: &[Step], dtype: DType) -> (Status, String) {
    let (rel, _) = run_bounds(dtype);
    let tokens: Vec<u32> = run.iter().map(|s| s.token).collect();
    let upto = tokens
        .iter()
        .zip(solo)
        .position(|(a, b)| *a != b.token)
        .unwrap_or(tokens.len().min(solo.len()));
    let diff = |i: usize| (run[i].logprob - solo[i].logprob).abs();
    let bound = |i: usize| 2.0 * rel * solo[i].scale;
    let seen = (0..upto).map(diff).fold(0f32, f32::max);
    if let Some(i) = (0..upto).find(|&i| diff(i) > bound(i)) {
        return (
            Status::Fail,
            format!(
                "log-probabilities differ from the solo path's by {:.2e} at token {i} (bound {:.2e})",
                diff(i),
                bound(i)
            ),
        );
    }
    match parting(&tokens, solo, seen, dtype) {
        Parting::Agree => (
            Status::Pass,
            format!("{} tokens identical, log-probabilities within {seen:.2e}", tokens.len()),
        ),
        Parting::Tie { at, gap } => (
            Status::Warn,
            format!("the outputs part at token {at} on a near-tie (the two tokens {gap:.2e} apart in log-probability; before it within {seen:.2e}): rounding, not state"),
        ),
        Parting::Apart { at, gap } => (Status::Fail, format!("the outputs part at token {at}{}", apart(gap))),
    }
}

/// The engine (what a server runs): `model`'s engine runs the same prompts two at a time over
/// pooled state, a third request taking a slot another left, and must give the greedy tokens
/// and log-probabilities of `alone`'s solo path (`Cache`; the same model, whose solo path the
/// numerics checks test); with the MTP head, speculation in a fresh engine must give the plain
/// tokens. A state carried wrongly between requests, a commit that restores the wrong state, or
/// a state never written back show here even where the solo path is right.
pub fn engine_checks(
    model: &Qwen36Model,
    alone: &Qwen36Model,
    head: Option<&MtpHead>,
    prompt: &[u32],
    n: usize,
) -> Vec<Check> {
    use qwen36_engine::{Engine, EngineConfig, Request, Speculation};
    const G: &str = "engine";
    let dtype = model.dtype();
    let mut out = Vec::new();
    let run = |out: &mut Vec<Check>| -> Result<()> {
        let other: Vec<u32> = prompt.iter().rev().copied().collect();
        let block_size = EngineConfig::default().block_size;
        let engine = || -> Result<Engine> {
            let cfg = EngineConfig {
                max_seqs: 2,
                kv_blocks: Some(2 * (prompt.len() + n).div_ceil(block_size) + 2),
                max_queue: 4,
                adaptive_k: false,
                prefix_snapshots: 0,
                ..EngineConfig::default()
            };
            Ok(match head {
                Some(h) => Engine::with_mtp_head(model.clone(), h.clone(), cfg)?,
                None => Engine::new(model.clone(), cfg)?,
            })
        };
        let request = |p: &[u32], speculation| Request {
            logprobs: true,
            sampling: SamplingParams {
                top_logprobs: 5,
                ..SamplingParams::greedy()
            },
            speculation,
            ..Request::greedy(p.to_vec(), n)
        };
        let solo_a = solo_greedy(alone, prompt, n)?;
        let solo_b = solo_greedy(alone, &other, n)?;
        // Two at once, then a third in a slot one of them left.
        let runs = engine_runs(
            &mut engine()?,
            vec![
                (request(prompt, None), &solo_a),
                (request(&other, None), &solo_b),
                (request(prompt, None), &solo_a),
            ],
        )?;
        let verdicts = [
            ("with another", compare_runs(&runs[0].0, &solo_a, dtype)),
            ("beside it", compare_runs(&runs[1].0, &solo_b, dtype)),
            ("in a reused slot", compare_runs(&runs[2].0, &solo_a, dtype)),
        ];
        let rank = |s: Status| match s {
            Status::Fail => 3,
            Status::Warn => 2,
            _ => 1,
        };
        let worst = verdicts.iter().map(|v| v.1 .0).max_by_key(|&s| rank(s));
        let detail = verdicts
            .iter()
            .map(|(what, (_, d))| format!("{what}: {d}"))
            .collect::<Vec<_>>()
            .join("; ");
        let c = check(G, "batched = alone", worst.unwrap_or(Status::Pass), detail);
        out.push(match c.status {
            Status::Fail if verdicts[2].1 .0 == Status::Fail && verdicts[0].1 .0 != Status::Fail => c.advise(
                "a request in a slot another one left differs from itself alone: the engine does not clear a sequence's GDN state (or KV) when a new one takes its slot",
            ),
            Status::Fail => c.advise(
                "the engine's pooled, batched forward does not give what the model gives one sequence alone: check the state pool's slot indexing, that each decode step writes the state back, and the paged KV",
            ),
            Status::Warn => c.advise("half-precision sums in another order part greedy outputs where two tokens are tied; an f32 run should show none"),
            _ => c,
        });
        if head.is_none() {
            out.push(check(G, "MTP = plain in the engine", Status::Skip, "no MTP head"));
            return Ok(());
        }
        // (A fresh engine: a slot carried over must not be taken for a wrong commit.)
        let spec = engine_runs(
            &mut engine()?,
            vec![(request(prompt, Some(Speculation::Mtp { k: 3 })), &solo_a)],
        )?;
        let ids: Vec<u32> = spec[0].0.iter().map(|s| s.token).collect();
        out.extend(speculative_verdicts(
            (G, "MTP = plain in the engine"),
            &ids,
            &runs[0].0,
            &spec[0].1.speculation,
            dtype,
            "speculation in the engine changes greedy output: the state its commit restores after a verify is not the one after the last accepted token",
        ));
        Ok(())
    };
    if let Err(e) = run(&mut out) {
        out.push(check(G, "run", Status::Fail, format!("the engine failed: {e}")));
    }
    out
}

/// Generation health: a few generations at the model's default sampling, watched by the
/// repetition detector; a loop there is a failure (the model or its settings degenerate), a loop
/// of plain greedy decoding a warning (a known weakness of greedy decoding without penalties).
pub fn generation_checks(generator: &Generator, n: usize) -> Vec<Check> {
    const G: &str = "generation";
    let mut out = Vec::new();
    let vocab = generator.model().config().vocab_size;
    let prompts: Vec<Vec<u32>> = match generator.tokenizer() {
        Some(_) => [
            "def fibonacci(n):",
            "The history of the city",
            "import numpy as np\n",
        ]
        .iter()
        .filter_map(|p| generator.encode(p).ok())
        .filter(|p| !p.is_empty())
        .collect(),
        None => (0..3).map(|i| probe_prompt(vocab, 8 + i)).collect(),
    };
    let defaults = generator.generation_config().sampling.clone();
    for (label, sampling, status) in [
        (
            "sampled at the model's defaults",
            defaults.clone().unwrap_or_default(),
            Status::Fail,
        ),
        ("greedy", SamplingParams::greedy(), Status::Warn),
    ] {
        if label.starts_with("sampled") && defaults.is_none() {
            out.push(check(G, "sampled at the model's defaults", Status::Warn, "generation_config.json gives no sampling: requests run greedy unless they say otherwise")
                .advise("greedy decoding without penalties loops on long outputs: ship the recommended sampling (Qwen3.6: temperature 1.0, top_p 0.95, top_k 20, presence_penalty 1.5) in generation_config.json"));
            continue;
        }
        let (mut found, mut failed) = (Vec::new(), Vec::new());
        for (i, p) in prompts.iter().enumerate() {
            let opts = GenerateOptions {
                max_new_tokens: n,
                sampling: Some(SamplingParams {
                    seed: i as u64,
                    ..sampling.clone()
                }),
                stop_token_ids: Some(Vec::new()),
                ..GenerateOptions::default()
            };
            match generator.generate(p, &opts, |_| {}) {
                Ok(o) => {
                    if let Some(d) = o.degeneration {
                        found.push(format!("prompt {i}: {d}"));
                    }
                }
                Err(e) => {
                    failed.push(format!("prompt {i} failed: {e}"));
                    // A tensor-parallel rank goes no further: the others may wait in a
                    // reduction of this generation ([`examine_ranks`] ends the group).
                    if generator.model().communicator().is_some() {
                        break;
                    }
                }
            }
        }
        let name = if label == "greedy" {
            "greedy"
        } else {
            "sampled at the model's defaults"
        };
        out.push(if !failed.is_empty() {
            // Not a loop: the generation itself failed (the error names the cause).
            check(G, name, Status::Fail, [failed, found].concat().join("; "))
                .advise("a generation failed: the error names the cause (the checks above may too)")
        } else if found.is_empty() {
            check(G, name, Status::Pass, format!("{} generations of {n} tokens, no loop", prompts.len()))
        } else {
            let advice = if status == Status::Fail {
                "the output loops at the model's own settings: if the numerics checks pass, raise the penalties (presence_penalty 1.5) or the temperature in generation_config.json"
            } else {
                "greedy decoding without penalties loops (a known weakness, Qwen's model card): sample, or add a presence penalty"
            };
            check(G, name, status, found.join("; ")).advise(advice)
        });
    }
    // The detector itself on a synthetic loop: it must fire (a detector that never fires
    // would pass every model).
    let synthetic: Vec<u32> = std::iter::repeat_n([1u32, 2, 3], 40).flatten().collect();
    if loops(&synthetic).is_none() {
        out.push(check(
            G,
            "repetition detector",
            Status::Fail,
            "did not detect a synthetic loop",
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A NaN or inf anywhere is an infinite error (candle's max skips NaN, which passed a layer
    /// that output NaN).
    #[test]
    fn non_finite_values_are_an_infinite_error() {
        let r = Tensor::new(&[1f32, 2.0, 4.0], &Device::Cpu).unwrap();
        let close = Tensor::new(&[1f32, 2.0, 4.5], &Device::Cpu).unwrap();
        assert_eq!(rel_err(&close, &r).unwrap(), 0.125);
        for bad in [f32::NAN, f32::INFINITY] {
            let t = Tensor::new(&[1f32, bad, 4.0], &Device::Cpu).unwrap();
            assert_eq!(rel_err(&t, &r).unwrap(), f32::INFINITY, "{bad}");
            assert_eq!(rel_err(&r, &t).unwrap(), f32::INFINITY, "{bad}");
        }
    }

    /// The tokens asked for fit a context up to the last position the probe and the drafts
    /// leave, and a tiny context refuses any.
    #[test]
    fn tokens_fit_the_context_after_the_probe() {
        assert!(tokens_fit(4076, 4096).is_ok());
        let e = tokens_fit(4077, 4096).unwrap_err().to_string();
        assert!(e.contains("at most 4076"), "{e}");
        assert!(tokens_fit(1, 20).is_err());
    }

    /// Ranks agree when every report lists the same checks with the same statuses (details may
    /// differ); a rank with another status, or another list of checks, is named.
    #[test]
    fn ranks_agree_when_their_verdicts_do() {
        let report = |checks: Vec<Check>| Report {
            model: String::new(),
            device: String::new(),
            dtype: String::new(),
            checks,
        };
        let a = || check("g", "a", Status::Pass, "x");
        let b = |status| check("g", "b", status, "y");
        let same = report(vec![a(), b(Status::Warn)]);
        let detail = report(vec![check("g", "a", Status::Pass, "other"), b(Status::Warn)]);
        let agree = ranks_agree(&[same.clone(), detail.clone(), same.clone()]);
        assert_eq!(agree.status, Status::Pass, "{agree:?}");
        assert!(agree.detail.starts_with("3 ranks"), "{agree:?}");
        for other in [
            report(vec![a(), b(Status::Fail)]),
            report(vec![a()]),
            report(vec![b(Status::Warn), a()]),
        ] {
            let apart = ranks_agree(&[same.clone(), detail.clone(), other]);
            assert_eq!(apart.status, Status::Fail, "{apart:?}");
            assert!(apart.detail.starts_with("rank 2: "), "{apart:?}");
            assert!(!apart.advice.is_empty());
        }
        // The first check that differs is named with its status and detail.
        let failing = ranks_agree(&[same.clone(), report(vec![a(), b(Status::Fail)])]);
        assert_eq!(failing.detail, "rank 1: g / b: FAIL (y)");
        let short = ranks_agree(&[same.clone(), report(vec![a()])]);
        assert_eq!(short.detail, "rank 1: fewer checks than rank 0");
    }

    /// Ranks whose verdicts so far are equal agree (details may differ); a rank with another
    /// status or another check makes every rank see the parting.
    #[test]
    fn the_ranks_see_whether_their_verdicts_agree() {
        let verdicts = |rank: usize, status: Status| match rank {
            0 => vec![
                check("g", "a", Status::Pass, "x"),
                check("g", "b", Status::Warn, "y"),
            ],
            _ => vec![
                check("g", "a", Status::Pass, "other"),
                check("g", "b", status, "z"),
            ],
        };
        for (status, want) in [(Status::Warn, true), (Status::Fail, false), (Status::Pass, false)] {
            let seen = qwen36_model::run_ranks(qwen36_model::LocalComm::group(3).unwrap(), |comm| {
                verdicts_agree(comm.as_ref(), &verdicts(comm.rank(), status)).unwrap()
            })
            .unwrap();
            assert_eq!(seen, vec![want; 3], "{status:?}");
        }
        let fewer = qwen36_model::run_ranks(qwen36_model::LocalComm::group(2).unwrap(), |comm| {
            let mut checks = verdicts(0, Status::Warn);
            checks.truncate(2 - comm.rank());
            verdicts_agree(comm.as_ref(), &checks).unwrap()
        })
        .unwrap();
        assert_eq!(fewer, vec![false; 2]);
    }
}
