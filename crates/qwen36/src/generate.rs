//! A streaming text generator over one sequence: prefill, sample, stop on tokens or strings.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use candle_core::Tensor;
use qwen36_model::{Communicator, DraftSession, DraftVocab, LoadOptions, MtpHead, Qwen36Model, Session};
use qwen36_mtp::{MtpDrafter, NgramDrafter, SpecConfig, SpecStats, SpecStopReason, SpeculativeDecoder};
use qwen36_sampling::{
    Degeneration, DegenerationConfig, RepetitionDetector, Sampler, SamplingParams, TextStream,
};
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
        let eos_token_ids = match v.get("eos_token_id") {
            None | Some(Value::Null) => vec![],
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| x.as_u64().map(|x| x as u32))
                .collect::<Option<_>>()
                .ok_or_else(|| err("eos_token_id: expected integers".into()))?,
            Some(x) => vec![x
                .as_u64()
                .ok_or_else(|| err(format!("eos_token_id: expected an integer, found {x}")))?
                as u32],
        };
        let num = |k: &str| v.get(k).and_then(Value::as_f64);
        let sampling = (v.get("do_sample").and_then(Value::as_bool) == Some(true)).then(|| SamplingParams {
            temperature: num("temperature").unwrap_or(1.0) as f32,
            top_k: num("top_k").unwrap_or(0.0) as usize,
            top_p: num("top_p").unwrap_or(1.0) as f32,
            min_p: num("min_p").unwrap_or(0.0) as f32,
            repetition_penalty: num("repetition_penalty").unwrap_or(1.0) as f32,
            presence_penalty: num("presence_penalty").unwrap_or(0.0) as f32,
            ..Default::default()
        });
        Ok(Self {
            eos_token_ids,
            sampling,
        })
    }
}

/// How one generation runs.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// Upper bound on generated tokens.
    pub max_new_tokens: usize,
    /// Sampling; `None` uses the model's generation_config (or greedy when it has none).
    pub sampling: Option<SamplingParams>,
    /// Stop token ids; `None` uses the model's (generation_config, then config.json).
    pub stop_token_ids: Option<Vec<u32>>,
    /// Stop strings (may span tokens); the output text ends before the match.
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
    /// Drafts per verify pass.
    pub k: usize,
    /// The drafter.
    pub drafter: DrafterKind,
    /// MTP drafts only: draft over the first `n` token ids plus the stop ids
    /// ([`qwen36_model::DraftVocab::first`]) instead of the whole vocabulary: each draft step
    /// reads that share of lm_head. The output is the same; acceptance may drop. `None`: the whole
    /// vocabulary.
    pub draft_vocab: Option<usize>,
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
    /// a possible stop-string prefix is held back).
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
    /// Time to the first generated token: the prompt forward and one sampling.
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

/// A model with its tokenizer and generation defaults, generating one sequence at a time.
///
/// The caches of the last generation are kept (and reset before the next one), so the CUDA
/// graphs recorded for them are replayed by later generations instead of recorded again.
pub struct Generator {
    model: Qwen36Model,
    mtp_head: Option<MtpHead>,
    tokenizer: Option<Tokenizer>,
    chat_template: Option<ChatTemplate>,
    dir: PathBuf,
    generation_config: GenerationConfig,
    sessions: Mutex<Sessions>,
}

/// What a kept draft session's vocabulary was made from: `None` for the whole vocabulary, else
/// the size and the stop ids ([`DraftVocab::first`]).
type DraftVocabKey = Option<(usize, Vec<u32>)>;

/// What a finished generation leaves for the next one (taken while a generation runs, so
/// concurrent calls each get their own).
#[derive(Default)]
struct Sessions {
    target: Option<Session>,
    /// With what its draft vocabulary was made from (size, stop ids; its graphs score those rows).
    draft: Option<(DraftVocabKey, DraftSession)>,
}

impl Generator {
    /// Loads the model in `dir`, plus `tokenizer.json` and `generation_config.json` when present.
    pub fn load(dir: impl AsRef<Path>, opts: LoadOptions) -> Result<Self> {
        Self::load_with(dir.as_ref(), opts, None)
    }

    /// [`Self::load`] as rank `comm.rank()` of a tensor-parallel group: its shard of the model
    /// and of the MTP head ([`Qwen36Model::load_shard`]). Every rank generates the same calls in
    /// step (give every rank the same sampling seed); their outputs are equal.
    pub fn load_shard(dir: impl AsRef<Path>, opts: LoadOptions, comm: Arc<dyn Communicator>) -> Result<Self> {
        Self::load_with(dir.as_ref(), opts, Some(comm))
    }

    fn load_with(dir: &Path, opts: LoadOptions, comm: Option<Arc<dyn Communicator>>) -> Result<Self> {
        let dir = dir.to_path_buf();
        let full = qwen36_model::Config::from_file(dir.join("config.json"))?;
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
        let tok_path = dir.join("tokenizer.json");
        let tokenizer = if tok_path.exists() {
            Some(Tokenizer::from_file(&tok_path).map_err(|e| Error::Tokenizer {
                path: tok_path.clone(),
                msg: e.to_string(),
            })?)
        } else {
            None
        };
        let tc_path = dir.join("tokenizer_config.json");
        let chat_template = if tc_path.exists() {
            ChatTemplate::from_tokenizer_config(&tc_path)?
        } else {
            None
        };
        let gc_path = dir.join("generation_config.json");
        let generation_config = if gc_path.exists() {
            GenerationConfig::from_file(&gc_path)?
        } else {
            GenerationConfig::default()
        };
        Ok(Self {
            model,
            mtp_head,
            tokenizer,
            chat_template,
            dir,
            generation_config,
            sessions: Mutex::default(),
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

    fn sessions(&self) -> std::sync::MutexGuard<'_, Sessions> {
        // A generation that panicked left nothing half-written here: the state is a plain take.
        self.sessions.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The kept target session or a new one (whoever runs in it resets it first).
    fn target_session(&self) -> Result<Session> {
        let kept = self.sessions().target.take();
        match kept {
            Some(s) => Ok(s),
            None => Ok(Session::new(&self.model, 1)?),
        }
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

    /// The tokenizer's decode (special tokens skipped, as [`Self::decode`]) for an engine's
    /// events ([`qwen36_engine::Engine::with_detokenizer`]); `None` without a tokenizer.
    pub fn detokenizer(&self) -> Option<std::sync::Arc<dyn qwen36_sampling::Detokenize>> {
        let tok = self.tokenizer.clone()?;
        Some(std::sync::Arc::new(move |ids: &[u32]| {
            tok.decode(ids, true).map_err(|e| e.to_string())
        }))
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

    /// Generates after `prompt` (token ids), calling `on_token` for every new token.
    pub fn generate(
        &self,
        prompt: &[u32],
        opts: &GenerateOptions,
        mut on_token: impl FnMut(TokenEvent),
    ) -> Result<GenerationOutput> {
        let params = opts
            .sampling
            .clone()
            .or_else(|| self.generation_config.sampling.clone())
            .unwrap_or_default();
        let stop_ids = opts
            .stop_token_ids
            .clone()
            .unwrap_or_else(|| self.default_stop_ids());
        // The text as it streams (none without a tokenizer).
        let mut stream = self
            .tokenizer
            .as_ref()
            .map(|_| TextStream::new(&opts.stop_strings));
        // Self::decode's, on the tokenizer alone (a CUDA generator is not Sync: its graphs).
        let tokenizer = self.tokenizer.as_ref();
        let decode = |ids: &[u32]| match tokenizer {
            Some(t) => t.decode(ids, true).map_err(|e| e.to_string()),
            None => Err("no tokenizer".to_string()),
        };
        let mut failure = None;
        let t0 = Instant::now();
        let mut first_token_secs = None;
        let mut detector = RepetitionDetector::new(opts.degeneration);
        let mut degenerate = None;
        // Called for every token; false ends generation (a stop string matched, decoding failed,
        // or the output degenerated and that stops it).
        let mut push = |token: u32| -> bool {
            first_token_secs.get_or_insert_with(|| t0.elapsed().as_secs_f64());
            if stop_ids.contains(&token) {
                on_token(TokenEvent { token, text: "" });
                return false;
            }
            let go_on = match stream.as_mut() {
                None => {
                    on_token(TokenEvent { token, text: "" });
                    true
                }
                Some(stream) => match stream.push(token, &decode) {
                    Ok((piece, go_on)) => {
                        on_token(TokenEvent { token, text: &piece });
                        go_on
                    }
                    Err(e) => {
                        failure = Some(self.tok_err(e));
                        false
                    }
                },
            };
            match detector.observe(token, None) {
                Some(d) if go_on && opts.stop_on_degeneration => {
                    degenerate = Some(d);
                    false
                }
                _ => go_on,
            }
        };
        let ((tokens, reason), spec_stats) = match &opts.speculative {
            None => (self.plain(prompt, params, opts, &stop_ids, &mut push)?, None),
            Some(spec) => {
                let (tokens, reason, stats) =
                    self.speculative(prompt, params, opts, spec, &stop_ids, &mut push)?;
                ((tokens, reason), Some(stats))
            }
        };
        let total = t0.elapsed().as_secs_f64();
        let prefill_secs = first_token_secs.unwrap_or(total);
        if let Some(e) = failure {
            return Err(e);
        }
        let stop_reason = match (reason, degenerate) {
            (StopReason::StopString(_), Some(d)) => StopReason::Degenerate(d),
            (StopReason::StopString(_), None) => {
                StopReason::StopString(stream.as_ref().and_then(TextStream::stopped_by).unwrap_or(0))
            }
            (r, _) => r,
        };
        let tail = stream.as_mut().map(TextStream::finish).unwrap_or_default();
        if !tail.is_empty() {
            on_token(TokenEvent {
                token: *tokens.last().unwrap_or(&0),
                text: &tail,
            });
        }
        Ok(GenerationOutput {
            prompt_tokens: prompt.len(),
            tokens,
            text: stream.map(TextStream::into_text),
            stop_reason,
            prefill_secs,
            decode_secs: total - prefill_secs,
            spec_stats,
            degeneration: detector.first(),
        })
    }

    /// One token per forward. Returns the tokens and why it stopped.
    fn plain(
        &self,
        prompt: &[u32],
        params: SamplingParams,
        opts: &GenerateOptions,
        stop_ids: &[u32],
        push: &mut dyn FnMut(u32) -> bool,
    ) -> Result<(Vec<u32>, StopReason)> {
        let mut sampler = Sampler::new(params)?;
        // One-token steps replay CUDA graphs where the device allows.
        let mut session = self.target_session()?;
        let out = self.plain_in(&mut session, &mut sampler, prompt, opts, stop_ids, push)?;
        self.sessions().target = Some(session);
        Ok(out)
    }

    fn plain_in(
        &self,
        session: &mut Session,
        sampler: &mut Sampler,
        prompt: &[u32],
        opts: &GenerateOptions,
        stop_ids: &[u32],
        push: &mut dyn FnMut(u32) -> bool,
    ) -> Result<(Vec<u32>, StopReason)> {
        let max_ctx = self.model.config().max_position_embeddings;
        let dev = self.model.device().clone();
        let ids = |t: &[u32]| -> Result<Tensor> { Ok(Tensor::new(t, &dev)?.unsqueeze(0)?) };
        session.reset()?;
        let Session { cache, stepper } = session;
        let mut logits = self.model.forward_last(&ids(prompt)?, cache)?;
        let mut tokens = Vec::new();
        while tokens.len() < opts.max_new_tokens {
            let row = logits.squeeze(0)?.to_vec1::<f32>()?;
            let token = sampler.sample(&row, prompt, &tokens)?.token;
            tokens.push(token);
            if !push(token) {
                let reason = if stop_ids.contains(&token) {
                    StopReason::StopToken(token)
                } else {
                    StopReason::StopString(0)
                };
                return Ok((tokens, reason));
            }
            if tokens.len() >= opts.max_new_tokens {
                break;
            }
            if cache.seq_len() >= max_ctx {
                return Ok((tokens, StopReason::ContextFull));
            }
            let h = stepper.forward_hidden(&self.model, &ids(&[token])?, cache)?;
            logits = self.model.logits(&h.squeeze(1)?)?;
        }
        Ok((tokens, StopReason::MaxTokens))
    }

    /// Speculative decoding with the chosen drafter.
    fn speculative(
        &self,
        prompt: &[u32],
        params: SamplingParams,
        opts: &GenerateOptions,
        spec: &Speculative,
        stop_ids: &[u32],
        push: &mut dyn FnMut(u32) -> bool,
    ) -> Result<(Vec<u32>, StopReason, SpecStats)> {
        let mut decoder = SpeculativeDecoder::with_session(&self.model, params, self.target_session()?)?;
        let cfg = SpecConfig {
            k: spec.k,
            max_new_tokens: opts.max_new_tokens,
            stop_token_ids: stop_ids.to_vec(),
        };
        let out = match spec.drafter {
            DrafterKind::Mtp => {
                let head = self.mtp_head.as_ref().ok_or(qwen36_model::Error::NoMtpHead)?;
                let key: DraftVocabKey = spec.draft_vocab.map(|n| (n, stop_ids.to_vec()));
                let kept = self.sessions().draft.take();
                let session = match kept {
                    Some((k, session)) if k == key => session,
                    _ => {
                        let vocab = key
                            .as_ref()
                            .map(|(n, stops)| DraftVocab::first(&self.model, *n, stops))
                            .transpose()?;
                        DraftSession::with_vocab(&self.model, head, vocab)
                    }
                };
                let mut mtp = MtpDrafter::with_session(&self.model, head, session);
                let out = decoder.generate(&mut mtp, prompt, &cfg, push)?;
                self.sessions().draft = Some((key, mtp.into_session()));
                out
            }
            DrafterKind::Ngram => decoder.generate(&mut NgramDrafter::default(), prompt, &cfg, push)?,
        };
        self.sessions().target = Some(decoder.into_session());
        let reason = match out.stop_reason {
            SpecStopReason::MaxTokens => StopReason::MaxTokens,
            SpecStopReason::StopToken(t) => StopReason::StopToken(t),
            SpecStopReason::ContextFull => StopReason::ContextFull,
            SpecStopReason::Callback => StopReason::StopString(0),
        };
        Ok((out.tokens, reason, out.stats))
    }
}
