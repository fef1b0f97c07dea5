//! The GDN crate's error type.

use candle_core::DType;

/// Errors from building or running a GDN layer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A weight has the wrong shape; names the weight.
    #[error("GDN weight {name}: expected shape {expected:?}, found {found:?}")]
    WeightShape {
        name: &'static str,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    /// A recurrent state of a dtype other than f32 was requested or supplied.
    #[error("GDN recurrent state must be f32 (exact long-context decoding needs it), found {0:?}")]
    StateDtype(DType),
    /// A state does not fit this layer or batch.
    #[error("GDN state: {0}")]
    State(String),
    /// The input does not fit the layer.
    #[error("GDN input: {0}")]
    Input(String),
    /// A kernel call failed.
    #[error(transparent)]
    Kernel(#[from] qwen36_kernels::Error),
    /// An error raised by candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// Result alias for the GDN crate.
pub type Result<T> = std::result::Result<T, Error>;
