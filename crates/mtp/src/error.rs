//! The speculative decoder's error type.

/// Errors from speculative decoding.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The model failed.
    #[error(transparent)]
    Model(#[from] qwen36_model::Error),
    /// Sampling or acceptance failed.
    #[error(transparent)]
    Sampling(#[from] qwen36_sampling::Error),
    /// A bad argument (an empty prompt, `max_new_tokens` = 0, a session of batch > 1, ...).
    #[error("speculative decoding: {0}")]
    Input(String),
    /// An error raised by candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// Result alias for speculative decoding.
pub type Result<T> = std::result::Result<T, Error>;
