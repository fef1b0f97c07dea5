//! The model crate's error type: every message names the file, field or tensor at fault.

use std::path::PathBuf;

use candle_core::DType;

/// Errors from loading or running a Qwen3.6 model.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A JSON file is malformed.
    #[error("malformed JSON in {path}: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// A quantized tensor cannot be used as it is stored (no scales, no quantization config, a
    /// plain tensor stored quantized).
    #[error("tensor {name} {msg}")]
    Quantized { name: String, msg: String },
    /// A config field is missing, has the wrong type, or an impossible value.
    #[error("config field `{field}`: {msg}")]
    Config { field: String, msg: String },
    /// `layer_types` names a layer kind this model does not know.
    #[error("config field `layer_types[{index}]`: unknown layer type {value:?} (expected \"linear_attention\" or \"full_attention\")")]
    UnknownLayerType { index: usize, value: String },
    /// The config asks for a GDN recurrent state dtype other than f32.
    #[error("config field `mamba_ssm_dtype` = {0:?}: only float32 recurrent state is supported (a bf16/fp16 state drifts into repetition)")]
    StateDtype(String),
    /// A weight file named by the index or expected in the directory is absent.
    #[error("missing weight file {0}")]
    MissingFile(PathBuf),
    /// Two shards of the checkpoint hold a tensor of the same name.
    #[error("tensor {name} is stored twice, in {} and in {}: a checkpoint holds each tensor once", .first.display(), .second.display())]
    DuplicateTensor {
        name: String,
        first: PathBuf,
        second: PathBuf,
    },
    /// A tensor the model needs is in none of the checkpoint's files.
    #[error("missing tensor {0}")]
    MissingTensor(String),
    /// A tensor has the wrong shape.
    #[error("tensor {name}: expected shape {expected:?}, found {found:?}")]
    TensorShape {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    /// A tensor is stored in a dtype the model cannot read it from (integers, bool, an
    /// unsupported float).
    #[error("tensor {name} is stored as {stored}, not a float dtype this model reads (f32, f64, bf16, f16)")]
    TensorDtype { name: String, stored: String },
    /// A tensor holds NaN or infinity.
    #[error("tensor {0} contains NaN or infinite values")]
    NonFinite(String),
    /// A tensor's finite values overflow the activation dtype (beyond ±65504 in f16).
    #[error("tensor {name} holds values beyond the range of {dtype:?}: load the model in bf16 or f32")]
    OutOfRange { name: String, dtype: DType },
    /// The activation dtype is not one of f32, bf16, f16.
    #[error("unsupported activation dtype {0:?} (use f32, bf16 or f16)")]
    Dtype(DType),
    /// Input ids are malformed (wrong rank, empty, out of the vocabulary).
    #[error("input: {0}")]
    Input(String),
    /// The sequence would grow past the model's context.
    #[error("context overflow: {needed} positions needed, the model allows {max} (max_position_embeddings)")]
    ContextOverflow { needed: usize, max: usize },
    /// The cache does not belong to this model or batch.
    #[error("cache: {0}")]
    Cache(String),
    /// MTP was asked for but the checkpoint has no `mtp.*` tensors.
    #[error("the checkpoint has no MTP head (no mtp.fc.weight): run without MTP or use another drafter")]
    NoMtpHead,
    /// A tensor-parallel reduction failed (a rank left the group or panicked).
    #[error("tensor parallelism: {0}")]
    Comm(String),
    /// An error from a GDN layer.
    #[error(transparent)]
    Gdn(#[from] qwen36_gdn::Error),
    /// An error from a kernel.
    #[error(transparent)]
    Kernel(#[from] qwen36_kernels::Error),
    /// An error raised by candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// Result alias for the model crate.
pub type Result<T> = std::result::Result<T, Error>;
