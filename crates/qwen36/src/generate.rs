//! A streaming text generator over one sequence: prefill, sample, stop on tokens or strings.

use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::{Device, Tensor};
use qwen36_model::{LoadOptions, Qwen36Model};
use qwen36_sampling::{Sampler, SamplingParams, StopStrings};
use serde_json::Value;
use tokenizers::Tokenizer;

use crate::{Error, Result};

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
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            max_new_tokens: 256,
            sampling: None,
            stop_token_ids: None,
            stop_strings: Vec::new(),
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
    /// Wall time of the prompt forward.
    pub prefill_secs: f64,
    /// Wall time of every later step (sampling included).
    pub decode_secs: f64,
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
pub struct Generator {
    model: Qwen36Model,
    tokenizer: Option<Tokenizer>,
    dir: PathBuf,
    generation_config: GenerationConfig,
}

impl Generator {
    /// Loads the model in `dir`, plus `tokenizer.json` and `generation_config.json` when present.
    pub fn load(dir: impl AsRef<Path>, opts: LoadOptions) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let model = Qwen36Model::load(&dir, opts)?;
        let tok_path = dir.join("tokenizer.json");
        let tokenizer = if tok_path.exists() {
            Some(Tokenizer::from_file(&tok_path).map_err(|e| Error::Tokenizer {
                path: tok_path.clone(),
                msg: e.to_string(),
            })?)
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
            tokenizer,
            dir,
            generation_config,
        })
    }

    /// The model.
    pub fn model(&self) -> &Qwen36Model {
        &self.model
    }

    /// The tokenizer, if the model directory has one.
    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.tokenizer.as_ref()
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
        let mut sampler = Sampler::new(params)?;
        let stop_ids = opts
            .stop_token_ids
            .clone()
            .unwrap_or_else(|| self.default_stop_ids());
        let stops = StopStrings::new(opts.stop_strings.iter().cloned());
        let max_ctx = self.model.config().max_position_embeddings;
        let dev = self.model.device().clone();
        let ids = |t: &[u32], dev: &Device| -> Result<Tensor> { Ok(Tensor::new(t, dev)?.unsqueeze(0)?) };

        let mut cache = self.model.new_cache(1)?;
        let t0 = Instant::now();
        let mut logits = self.model.forward_last(&ids(prompt, &dev)?, &mut cache)?;
        let prefill_secs = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();

        let mut tokens = Vec::new();
        let mut emitted = 0usize; // bytes of text already streamed
        let mut text = self.tokenizer.as_ref().map(|_| String::new());
        let mut stop_reason = StopReason::MaxTokens;
        while tokens.len() < opts.max_new_tokens {
            let row = logits.squeeze(0)?.to_vec1::<f32>()?;
            let token = sampler.sample(&row, prompt, &tokens)?.token;
            tokens.push(token);
            if stop_ids.contains(&token) {
                on_token(TokenEvent { token, text: "" });
                stop_reason = StopReason::StopToken(token);
                break;
            }
            let mut piece = "";
            if let Some(t) = text.as_mut() {
                *t = self.decode(&tokens)?;
                if let Some(m) = stops.find(t) {
                    t.truncate(m.start);
                    stop_reason = StopReason::StopString(m.index);
                }
                // Hold back a possible stop-string prefix and an incomplete UTF-8 sequence.
                let mut end = t.len() - stops.holdback(t);
                while t[..end].ends_with('\u{FFFD}') {
                    end -= '\u{FFFD}'.len_utf8();
                }
                if end > emitted {
                    piece = &t[emitted..end];
                    emitted = end;
                }
            }
            on_token(TokenEvent { token, text: piece });
            if matches!(stop_reason, StopReason::StopString(_)) || tokens.len() >= opts.max_new_tokens {
                break;
            }
            if cache.seq_len() >= max_ctx {
                stop_reason = StopReason::ContextFull;
                break;
            }
            logits = self.model.forward_last(&ids(&[token], &dev)?, &mut cache)?;
        }
        if let Some(t) = text.as_ref() {
            if t.len() > emitted {
                // Generation is over: the held-back tail is final text.
                on_token(TokenEvent {
                    token: *tokens.last().unwrap_or(&0),
                    text: &t[emitted..],
                });
            }
        }
        Ok(GenerationOutput {
            prompt_tokens: prompt.len(),
            tokens,
            text,
            stop_reason,
            prefill_secs,
            decode_secs: t1.elapsed().as_secs_f64(),
        })
    }
}
