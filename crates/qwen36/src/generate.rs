//! A streaming text generator over one sequence: the engine with one sequence slot, stepped by
//! the caller's thread (prefill, sample or verify drafts, stop on tokens or strings).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use qwen36_engine::{Engine, EngineConfig, Event, Request, Speculation};
use qwen36_model::{Communicator, LoadOptions, MtpHead, Qwen36Model};
use qwen36_mtp::SpecStats;
use qwen36_sampling::{Degeneration, DegenerationConfig, SamplingParams};
use serde_json::Value;
use tokenizers::Tokenizer;

use crate::{ChatMessage, ChatTemplate, Error, Result};

/// The parts of `generation_config.json` that change decoding.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationConfig {
    /// `eos_token_id` (Qwen3.6: both `<|im_end|>` 248046 and `<|endoftext|>` 248044).
    pub eos_token_ids: Vec<u32>,
    /// The recommended sampling when `do_sample` is true (temperature, top_k, top_p, ...).
    pub sampling: Option<SamplingParams>,
}

impl GenerationConfig {
    /// Reads `generation_config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let err = |msg: String| Error::File {
            path: path.to_path_buf(),
            msg,
        };
        let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| err(format!("malformed JSON: {e}")))?;
        if !v.is_object() {
            return Err(err(format!("expected a JSON object, found {v}")));
        }
        let id = |x: &Value| x.as_u64().and_then(|x| u32::try_from(x).ok());
        let eos_token_ids = match v.get("eos_token_id") {
            None | Some(Value::Null) => vec![],
            Some(Value::Array(a)) => a
                .iter()
                .map(id)
                .collect::<Option<_>>()
                .ok_or_else(|| err("eos_token_id: expected token ids (integers below 2^32)".into()))?,
            Some(x) => {
                vec![id(x).ok_or_else(|| err(format!("eos_token_id: expected a token id, found {x}")))?]
            }
        };
        // A field of the wrong type is an error, not its default (a "0.6" temperature would
        // sample at 1.0).
        let num = |k: &str| -> Result<Option<f64>> {
            match v.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x
                    .as_f64()
                    .map(Some)
                    .ok_or_else(|| err(format!("{k}: expected a number, found {x}"))),
            }
        };
        let do_sample = match v.get("do_sample") {
            None | Some(Value::Null) => false,
            Some(x) => x
                .as_bool()
                .ok_or_else(|| err(format!("do_sample: expected true or false, found {x}")))?,
        };
        let top_k = num("top_k")?.unwrap_or(0.0);
        if !(top_k >= 0.0 && top_k.fract() == 0.0) {
            return Err(err(format!("top_k: expected a count, found {top_k}")));
        }
        let sampling = SamplingParams {
            temperature: num("temperature")?.unwrap_or(1.0) as f32,
            top_k: top_k as usize,
            top_p: num("top_p")?.unwrap_or(1.0) as f32,
            min_p: num("min_p")?.unwrap_or(0.0) as f32,
            repetition_penalty: num("repetition_penalty")?.unwrap_or(1.0) as f32,
            presence_penalty: num("presence_penalty")?.unwrap_or(0.0) as f32,
            ..Default::default()
        };
        // Checked here, where the file can be named, not at the first generation.
        if do_sample {
            sampling.validate().map_err(|e| err(e.to_string()))?;
        }
        Ok(Self {
            eos_token_ids,
            sampling: do_sample.then_some(sampling),
        })
    }
}

/// How one generation runs.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// Upper bound on generated tokens (capped by the model's context). The KV pool is sized
    /// for the prompt and this many tokens before generation starts.
    pub max_new_tokens: usize,
    /// Sampling; `None` uses the model's generation_config (or greedy when it has none).
    pub sampling: Option<SamplingParams>,
    /// Stop token ids; `None` uses the model's (generation_config, then config.json).
    pub stop_token_ids: Option<Vec<u32>>,
    /// Stop strings (may span tokens); the output text ends before the match. They need the
    /// model's tokenizer: without one they are an error.
    pub stop_strings: Vec<String>,
    /// Speculative decoding (`None`: one token per forward).
    pub speculative: Option<Speculative>,
    /// What counts as degenerate output (a loop, an entropy collapse); it is always watched for
    /// and reported in [`GenerationOutput::degeneration`].
    pub degeneration: DegenerationConfig,
    /// End generation when the output degenerates ([`StopReason::Degenerate`]); off by default.
    pub stop_on_degeneration: bool,
}

/// Which drafter proposes tokens in speculative decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrafterKind {
    /// The checkpoint's MTP head.
    Mtp,
    /// Prompt lookup (n-gram match in the context); needs no weights.
    Ngram,
}

/// Speculative decoding settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Speculative {
    /// The most drafts per verify pass: each round drafts the number (0..=k) that gives the most
    /// tokens per second at the acceptance and step costs measured so far, so that speculation
    /// never makes generation slower; with `fixed_k` (and on a tensor-parallel rank) every round
    /// drafts k. The tokens are plain decoding's whatever the number (bit for bit on the CPU; on
    /// CUDA in half precision a verify row may round otherwise than a decode row).
    pub k: usize,
    /// The drafter.
    pub drafter: DrafterKind,
    /// MTP drafts only: draft over the first `n` token ids ([`qwen36_model::DraftVocab::first`])
    /// instead of the whole vocabulary: each draft step reads that share of lm_head. The output
    /// is the same; acceptance may drop. `None`: the whole vocabulary.
    pub draft_vocab: Option<usize>,
    /// Draft `k` in every round, whatever it costs (to measure a drafter, say).
    pub fixed_k: bool,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            max_new_tokens: 256,
            sampling: None,
            stop_token_ids: None,
            stop_strings: Vec::new(),
            speculative: None,
            degeneration: DegenerationConfig::default(),
            stop_on_degeneration: false,
        }
    }
}

/// Why generation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// `max_new_tokens` reached.
    MaxTokens,
    /// A stop token was sampled (it is the last of `tokens`, not part of `text`).
    StopToken(u32),
    /// A stop string appeared in the text (index into the stop strings).
    StopString(usize),
    /// The model's context (`max_position_embeddings`) is full.
    ContextFull,
    /// The output degenerated (with [`GenerateOptions::stop_on_degeneration`]).
    Degenerate(Degeneration),
}

/// One generated token, streamed as it comes.
#[derive(Debug, Clone)]
pub struct TokenEvent<'a> {
    /// The token id.
    pub token: u32,
    /// Text that became printable with this token (may be empty: an incomplete UTF-8 sequence or
    /// a possible stop-string prefix is held back; a speculative pass's text comes with the last
    /// of its tokens that is not a stop id, and a stop id brings none).
    pub text: &'a str,
}

/// The result of one generation.
#[derive(Debug, Clone)]
pub struct GenerationOutput {
    /// Length of the prompt in tokens.
    pub prompt_tokens: usize,
    /// Generated ids (a sampled stop token included).
    pub tokens: Vec<u32>,
    /// Decoded text without stop tokens or stop strings, when a tokenizer is present.
    pub text: Option<String>,
    /// Why it ended.
    pub stop_reason: StopReason,
    /// Time to the first generated token: the prompt forward and one sampling (and, with MTP,
    /// the head's pass over the prompt and its first drafts).
    pub prefill_secs: f64,
    /// Wall time after the first token (every later step, sampling included).
    pub decode_secs: f64,
    /// Acceptance statistics when decoding speculatively.
    pub spec_stats: Option<SpecStats>,
    /// The first degeneration seen in the output (a loop or an entropy collapse), if any.
    pub degeneration: Option<Degeneration>,
}

impl GenerationOutput {
    /// Generated tokens per second after the first one (which the prefill produced).
    pub fn decode_tokens_per_sec(&self) -> f64 {
        let n = self.tokens.len().saturating_sub(1);
        if n == 0 || self.decode_secs == 0.0 {
            0.0
        } else {
            n as f64 / self.decode_secs
        }
    }
}

/// A tokenizer as an engine's detokenizer: special tokens skipped, or written out.
struct TokenizerText(Tokenizer);

impl qwen36_sampling::Detokenize for TokenizerText {
    fn decode(&self, ids: &[u32]) -> std::result::Result<String, String> {
        self.0.decode(ids, true).map_err(|e| e.to_string())
    }

    fn decode_special(&self, ids: &[u32]) -> std::result::Result<String, String> {
        self.0.decode(ids, false).map_err(|e| e.to_string())
    }
}

/// A model with its tokenizer and generation defaults, generating one sequence at a time.
///
/// Each generation is one request to an [`Engine`] with one sequence slot, stepped on the
/// caller's thread: the same loop that serves many requests at once, so a request gives here
/// what it gives a server. The engine of the last generation is kept (reset by the next one, its
/// pools and CUDA graphs reused, and the step costs it measured, which decide how many drafts a
/// speculative round makes) unless a request needs a longer KV pool or another draft
/// vocabulary; concurrent calls each get an engine of their own.
pub struct Generator {
    model: Qwen36Model,
    mtp_head: Option<MtpHead>,
    tokenizer: Option<Tokenizer>,
    chat_template: Option<ChatTemplate>,
    dir: PathBuf,
    generation_config: GenerationConfig,
    engine: Mutex<Option<Engine>>,
}

/// The fewest KV positions a generator's engine holds (a pool is sized for its request, in
/// powers of two from here, and grown when a later request needs more).
const MIN_POSITIONS: usize = 1024;

/// The most prompt tokens one forward runs (a longer prompt is prefilled in chunks of this).
const PREFILL_CHUNK: usize = 8192;

impl Generator {
    /// Loads the model in `dir`, plus `tokenizer.json` and `generation_config.json` when present.
    pub fn load(dir: impl AsRef<Path>, opts: LoadOptions) -> Result<Self> {
        Self::load_with(dir.as_ref(), opts, None, None)
    }

    /// [`Self::load`] as rank `comm.rank()` of a tensor-parallel group: its shard of the model
    /// and of the MTP head ([`Qwen36Model::load_shard`]). Every rank generates the same calls in
    /// step (give every rank the same sampling seed); their outputs are equal.
    pub fn load_shard(dir: impl AsRef<Path>, opts: LoadOptions, comm: Arc<dyn Communicator>) -> Result<Self> {
        Self::load_with(dir.as_ref(), opts, Some(comm), None)
    }

    /// [`Self::load`], or [`Self::load_shard`] with `comm`; with `chat_template`, the Jinja file
    /// used instead of the checkpoint's template (which is then not compiled: a checkpoint whose
    /// own template does not compile can still be served).
    pub fn load_with(
        dir: &Path,
        opts: LoadOptions,
        comm: Option<Arc<dyn Communicator>>,
        chat_template: Option<&Path>,
    ) -> Result<Self> {
        let dir = dir.to_path_buf();
        let full = qwen36_model::Config::from_file(dir.join("config.json"))?;
        // The small files first: a mistake in one is found before the weights load.
        let tok_path = dir.join("tokenizer.json");
        let tokenizer = if tok_path.exists() {
            Some(Tokenizer::from_file(&tok_path).map_err(|e| Error::Tokenizer {
                path: tok_path.clone(),
                msg: e.to_string(),
            })?)
        } else {
            None
        };
        let chat_template = ChatTemplate::from_dir_with(&dir, chat_template)?;
        let gc_path = dir.join("generation_config.json");
        let generation_config = if gc_path.exists() {
            GenerationConfig::from_file(&gc_path)?
        } else {
            GenerationConfig::default()
        };
        let vocab = full.vocab_size;
        if let Some(id) = generation_config
            .eos_token_ids
            .iter()
            .find(|&&id| id as usize >= vocab)
        {
            return Err(Error::File {
                path: gc_path,
                msg: format!("eos_token_id {id} is past the vocabulary ({vocab} ids): generation would never stop there"),
            });
        }
        let (cfg, weights) = match comm {
            Some(comm) => qwen36_model::Weights::open(&dir, opts)?.sharded(comm, &full)?,
            None => (full, qwen36_model::Weights::open(&dir, opts)?),
        };
        let mtp_head = if MtpHead::present(&weights) {
            Some(MtpHead::load(&cfg, &weights)?)
        } else {
            None
        };
        let model = Qwen36Model::from_weights(cfg, &weights)?;
        Ok(Self {
            model,
            mtp_head,
            tokenizer,
            chat_template,
            dir,
            generation_config,
            engine: Mutex::default(),
        })
    }

    /// The model.
    pub fn model(&self) -> &Qwen36Model {
        &self.model
    }

    /// The MTP head, if the checkpoint has one.
    pub fn mtp_head(&self) -> Option<&MtpHead> {
        self.mtp_head.as_ref()
    }

    /// The tokenizer, if the model directory has one.
    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.tokenizer.as_ref()
    }

    /// The chat template of tokenizer_config.json, if any.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// Renders `messages` with the model's chat template and opens the assistant turn.
    pub fn apply_chat_template(&self, messages: &[ChatMessage], enable_thinking: bool) -> Result<String> {
        let t = self.chat_template.as_ref().ok_or_else(|| Error::File {
            path: self.dir.join("tokenizer_config.json"),
            msg: "no chat_template".into(),
        })?;
        t.render(messages, true, enable_thinking)
    }

    /// The generation defaults read from the model directory.
    pub fn generation_config(&self) -> &GenerationConfig {
        &self.generation_config
    }

    fn tok(&self) -> Result<&Tokenizer> {
        self.tokenizer
            .as_ref()
            .ok_or_else(|| Error::NoTokenizer(self.dir.clone()))
    }

    fn tok_err(&self, e: impl ToString) -> Error {
        Error::Tokenizer {
            path: self.dir.join("tokenizer.json"),
            msg: e.to_string(),
        }
    }

    /// Token ids of `text` (no special tokens added: Qwen prepends no BOS).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .tok()?
            .encode(text, false)
            .map_err(|e| self.tok_err(e))?
            .get_ids()
            .to_vec())
    }

    /// Text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tok()?.decode(ids, true).map_err(|e| self.tok_err(e))
    }

    /// The tokenizer's decode (special tokens skipped, as [`Self::decode`], or written out for a
    /// request that keeps them) for an engine's events
    /// ([`qwen36_engine::Engine::with_detokenizer`]); `None` without a tokenizer.
    pub fn detokenizer(&self) -> Option<std::sync::Arc<dyn qwen36_sampling::Detokenize>> {
        Some(std::sync::Arc::new(TokenizerText(self.tokenizer.clone()?)))
    }

    /// The stop ids used when the options give none: generation_config's, else config.json's.
    pub fn default_stop_ids(&self) -> Vec<u32> {
        if self.generation_config.eos_token_ids.is_empty() {
            self.model.config().eos_token_ids.clone()
        } else {
            self.generation_config.eos_token_ids.clone()
        }
    }

    /// Encodes `prompt` and generates from it.
    pub fn generate_text(
        &self,
        prompt: &str,
        opts: &GenerateOptions,
        on_token: impl FnMut(TokenEvent),
    ) -> Result<GenerationOutput> {
        let ids = self.encode(prompt)?;
        self.generate(&ids, opts, on_token)
    }

    /// The kept engine when it can run a request of `positions` positions with `draft_vocab`
    /// and `adaptive_k` (`None`: either will do), else a new one sized for it.
    fn engine_for(
        &self,
        positions: usize,
        draft_vocab: Option<Option<usize>>,
        adaptive_k: Option<bool>,
    ) -> Result<Engine> {
        let kept = self.kept_engine().take();
        if let Some(e) = kept {
            let cfg = e.config();
            let pool = cfg.kv_blocks.unwrap_or(0) * cfg.block_size;
            if pool >= positions
                && draft_vocab.is_none_or(|v| v == cfg.draft_vocab)
                && adaptive_k.is_none_or(|a| a == cfg.adaptive_k)
            {
                return Ok(e);
            }
            // (Dropped before the new pools are allocated.)
        }
        let context = self.model.config().max_position_embeddings;
        let positions = positions.max(MIN_POSITIONS).next_power_of_two().min(context);
        let block_size = EngineConfig::default().block_size;
        let cfg = EngineConfig {
            max_seqs: 1,
            kv_blocks: Some(positions.div_ceil(block_size)),
            step_tokens: PREFILL_CHUNK,
            adaptive_k: adaptive_k.unwrap_or(true),
            prefix_snapshots: 0,
            draft_vocab: draft_vocab.flatten(),
            ..EngineConfig::default()
        };
        let engine = match &self.mtp_head {
            Some(head) => Engine::with_mtp_head(self.model.clone(), head.clone(), cfg)?,
            None => Engine::new(self.model.clone(), cfg)?,
        };
        Ok(match self.detokenizer() {
            Some(d) => engine.with_detokenizer(d),
            None => engine,
        })
    }

    /// The configuration of the engine kept for the next generation, if one is (its KV pool,
    /// draft vocabulary and choice of k: what a request must fit to reuse it).
    pub fn kept_engine_config(&self) -> Option<EngineConfig> {
        self.kept_engine().as_ref().map(|e| e.config().clone())
    }

    fn kept_engine(&self) -> std::sync::MutexGuard<'_, Option<Engine>> {
        // A generation that panicked left nothing half-written here: the engine is a plain take.
        self.engine.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Generates after `prompt` (token ids), calling `on_token` for every new token.
    pub fn generate(
        &self,
        prompt: &[u32],
        opts: &GenerateOptions,
        mut on_token: impl FnMut(TokenEvent),
    ) -> Result<GenerationOutput> {
        let sampling = opts
            .sampling
            .clone()
            .or_else(|| self.generation_config.sampling.clone())
            .unwrap_or_default();
        let stop_ids = opts
            .stop_token_ids
            .clone()
            .unwrap_or_else(|| self.default_stop_ids());
        let speculation = match opts.speculative {
            None => None,
            Some(Speculative { k, drafter, .. }) => Some(match drafter {
                DrafterKind::Mtp if self.mtp_head.is_none() => {
                    return Err(qwen36_model::Error::NoMtpHead.into())
                }
                DrafterKind::Mtp => Speculation::Mtp { k },
                DrafterKind::Ngram => Speculation::ngram(k),
            }),
        };
        // Only MTP requests care about the draft vocabulary, and only speculating ones about
        // choosing k (`None`: any engine will do). Each round drafts what pays, from this
        // process's timings, unless the request fixes k; tensor-parallel ranks, which time
        // themselves, draft the k asked for so that they stay in step.
        let draft_vocab = match opts.speculative {
            Some(s) if s.drafter == DrafterKind::Mtp => Some(s.draft_vocab),
            _ => None,
        };
        let adaptive_k = opts
            .speculative
            .map(|s| !s.fixed_k && self.model.communicator().is_none());
        // The context caps the output (a sequence holds prompt + max_tokens − 1 positions); a
        // prompt that leaves no room is refused before any pool is made for it.
        let context = self.model.config().max_position_embeddings;
        let room = (context + 1).saturating_sub(prompt.len());
        let max_tokens = opts.max_new_tokens.max(1).min(room.max(1));
        let request = Request {
            prompt: prompt.to_vec(),
            sampling,
            max_tokens: Some(max_tokens),
            stop_ids: stop_ids.clone(),
            stop_strings: opts.stop_strings.clone(),
            keep_stop_strings: false,
            keep_special_tokens: false,
            logprobs: false,
            prompt_logprobs: None,
            constraint: None,
            speculation,
            priority: 0,
            degeneration: Some(opts.degeneration),
            stop_on_degeneration: opts.stop_on_degeneration,
        };
        // The request's checks hold for any max_new_tokens, 0 included (the engine makes them
        // again for the others).
        qwen36_engine::check_request(&request, self.model.config().vocab_size)?;
        let positions = prompt.len() + max_tokens - 1;
        if positions > context {
            return Err(qwen36_engine::Error::TooLong {
                needed: prompt.len() + max_tokens,
                context,
                pool: context,
            }
            .into());
        }
        if opts.max_new_tokens == 0 {
            return Ok(GenerationOutput {
                prompt_tokens: prompt.len(),
                tokens: Vec::new(),
                text: self.tokenizer.as_ref().map(|_| String::new()),
                stop_reason: StopReason::MaxTokens,
                prefill_secs: 0.0,
                decode_secs: 0.0,
                spec_stats: opts.speculative.map(|_| SpecStats::default()),
                degeneration: None,
            });
        }
        let mut engine = self.engine_for(positions, draft_vocab, adaptive_k)?;
        let t0 = Instant::now();
        let handle = match engine.submit(request) {
            Ok(h) => h,
            Err(e) => {
                // (A refused request leaves the engine as it was.)
                self.kept_engine().get_or_insert(engine);
                return Err(e.into());
            }
        };
        let (mut tokens, mut text, mut first_token_secs) = (Vec::new(), String::new(), None);
        let (reason, usage) = loop {
            let stepped = engine.step();
            let mut end = None;
            for event in handle.drain() {
                match event {
                    Event::Token { ids, text: piece, .. } => {
                        if !ids.is_empty() {
                            first_token_secs.get_or_insert_with(|| t0.elapsed().as_secs_f64());
                        }
                        // The piece is the text the ids complete: it goes with the last of them
                        // that is not a stop id (a stop id adds none; a last event without ids
                        // carries the text held back to the end).
                        let last = ids
                            .iter()
                            .rposition(|t| !stop_ids.contains(t))
                            .unwrap_or(ids.len().saturating_sub(1));
                        for (j, &token) in ids.iter().enumerate() {
                            tokens.push(token);
                            let piece = if j == last { piece.as_str() } else { "" };
                            on_token(TokenEvent { token, text: piece });
                        }
                        if ids.is_empty() && !piece.is_empty() {
                            let token = tokens.last().copied().unwrap_or(0);
                            on_token(TokenEvent { token, text: &piece });
                        }
                        text.push_str(&piece);
                    }
                    Event::Finished { reason, usage } => end = Some(Ok((reason, usage))),
                    Event::Failed { error } => end = Some(Err(error)),
                    // (Not asked for.)
                    Event::Prompt { .. } => {}
                }
            }
            // (A failed step failed the request too: the step's error is the typed one.)
            stepped?;
            match end {
                Some(Ok(finished)) => break finished,
                Some(Err(error)) => return Err(Error::Generation(error)),
                None => {}
            }
        };
        // The engine is empty again: the next generation may have it.
        self.kept_engine().get_or_insert(engine);
        let total = t0.elapsed().as_secs_f64();
        let prefill_secs = first_token_secs.unwrap_or(total);
        use qwen36_engine::StopReason as Ended;
        let stop_reason = match reason {
            Ended::MaxTokens if max_tokens < opts.max_new_tokens => StopReason::ContextFull,
            Ended::MaxTokens => StopReason::MaxTokens,
            Ended::StopToken(t) => StopReason::StopToken(t),
            Ended::ContextFull => StopReason::ContextFull,
            Ended::StopString(i) => StopReason::StopString(i),
            Ended::Degenerate(d) => StopReason::Degenerate(d),
            Ended::Cancelled => return Err(Error::Generation("the request was cancelled".into())),
        };
        Ok(GenerationOutput {
            prompt_tokens: prompt.len(),
            tokens,
            text: self.tokenizer.as_ref().map(|_| text),
            stop_reason,
            prefill_secs,
            decode_secs: total - prefill_secs,
            spec_stats: opts.speculative.map(|_| usage.speculation),
            degeneration: usage.degeneration,
        })
    }
}
