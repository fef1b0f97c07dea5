//! The facade's error type.

use std::path::PathBuf;

/// Errors from the high-level API.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Loading or running the model failed.
    #[error(transparent)]
    Model(#[from] qwen36_model::Error),
    /// Speculative decoding failed.
    #[error(transparent)]
    Speculative(#[from] qwen36_mtp::Error),
    /// The engine refused or failed a request (a prompt over the context, bad sampling
    /// parameters, stop strings without a tokenizer).
    #[error(transparent)]
    Engine(#[from] qwen36_engine::Error),
    /// A generation could not go on (the message names why: non-finite logits, a failed
    /// detokenization).
    #[error("generation failed: {0}")]
    Generation(String),
    /// Sampling failed (bad parameters, non-finite logits) outside a generation.
    #[error(transparent)]
    Sampling(#[from] qwen36_sampling::Error),
    /// The tokenizer could not be loaded or used.
    #[error("tokenizer {path}: {msg}")]
    Tokenizer { path: PathBuf, msg: String },
    /// Text was given but the model directory has no tokenizer.json.
    #[error("no tokenizer.json in {0}: pass token ids instead of text")]
    NoTokenizer(PathBuf),
    /// A file could not be read or parsed.
    #[error("{path}: {msg}")]
    File { path: PathBuf, msg: String },
    /// An error raised by candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// Result alias for the facade.
pub type Result<T> = std::result::Result<T, Error>;
