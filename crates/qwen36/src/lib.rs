//! Run Qwen3.6 hybrid language models (the `qwen3_5` architecture: Gated DeltaNet + gated
//! attention) on candle.
//!
//! ```no_run
//! use qwen36::{Generator, GenerateOptions, LoadOptions};
//! let gen = Generator::load("path/to/model", LoadOptions::default())?;
//! let out = gen.generate_text("def fibonacci(n):", &GenerateOptions::default(), |_| {})?;
//! println!("{}", out.text.unwrap_or_default());
//! # Ok::<(), qwen36::Error>(())
//! ```
//!
//! The building blocks are re-exported: [`model`] (config, loading, layers, caches), [`gdn`] (the
//! Gated DeltaNet layer and its f32 state), [`kernels`], [`sampling`], [`mtp`] and [`engine`]
//! (many requests at once: continuous batching over pooled state).

mod chat;
pub mod doctor;
mod error;
mod generate;
pub mod hub;

pub use chat::{ChatMessage, ChatTemplate};
pub use error::{Error, Result};
pub use generate::{
    DrafterKind, GenerateOptions, GenerationConfig, GenerationOutput, Generator, Speculative, StopReason,
    TokenEvent,
};
pub use hub::resolve_model;
pub use qwen36_engine as engine;
pub use qwen36_gdn as gdn;
pub use qwen36_kernels as kernels;
pub use qwen36_model as model;
pub use qwen36_model::{Cache, Config, LoadOptions, Qwen36Model};
pub use qwen36_mtp as mtp;
pub use qwen36_sampling as sampling;
pub use qwen36_sampling::{Degeneration, DegenerationConfig, SamplingParams};
pub use tokenizers::Tokenizer;
