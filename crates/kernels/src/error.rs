//! The kernels' error type.

/// Errors from kernel calls: a shape that does not fit the op, or an error from candle.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An argument's shape or dtype does not fit the op; `msg` names the argument.
    #[error("{op}: {msg}")]
    Shape { op: &'static str, msg: String },
    /// An error raised by candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// Result alias for kernel calls.
pub type Result<T> = std::result::Result<T, Error>;
