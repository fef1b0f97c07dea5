//! The sampling crate's error type.

/// Errors from sampling.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A logit is NaN or +inf (a numerics bug upstream; sampling from it would hide it).
    #[error("logits row {row} has a non-finite value at token {index}: {value}")]
    NonFiniteLogits { row: usize, index: usize, value: f32 },
    /// Every token is masked out.
    #[error("logits row {row}: every token has probability zero")]
    Empty { row: usize },
    /// A parameter is out of its range.
    #[error("sampling parameter `{name}` = {value}: {msg}")]
    Param {
        name: &'static str,
        value: f64,
        msg: &'static str,
    },
    /// Inputs of mismatched sizes.
    #[error("{0}")]
    Shape(String),
    /// An error raised by candle (reading a logits tensor).
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// Result alias for sampling.
pub type Result<T> = std::result::Result<T, Error>;
