//! The Qwen3.6 (`qwen3_5` architecture) hybrid language model on candle.
//!
//! [`Config`] reads config.json (flat or nested), [`Weights`] maps the safetensors checkpoint,
//! [`Qwen36Model`] stacks Gated DeltaNet and gated-attention decoder layers, and [`Cache`] holds one
//! batch's KV caches and GDN states. See docs/MODEL.md for the math this follows.

mod attention;
mod cache;
mod comm;
mod config;
mod error;
#[cfg(feature = "cuda")]
mod graph;
mod kv_cache;
mod model;
mod mtp_head;
mod paged;
mod shard;
mod stepper;
mod weights;

pub use attention::GatedAttention;
pub use cache::{Cache, LayerCache};
#[cfg(feature = "nccl")]
pub use comm::NcclComm;
pub use comm::{run_ranks, Communicator, LocalComm};
pub use config::{Config, LayerType, Quantization};
pub use error::{Error, Result};
#[cfg(feature = "cuda")]
pub use graph::{graph_device, BatchGraph, DecodeGraph, DraftGraph};
pub use kv_cache::KvCache;
pub use model::{Mlp, Qwen36Model};
pub use mtp_head::{DraftVocab, MtpCache, MtpHead};
pub use paged::{stash_tokens, BatchOutput, BatchPending, ForwardBatch, PagedCache, SeqChunk};
pub use shard::Shard;
pub use stepper::{
    cuda_device, BatchStepper, DeviceClock, DraftSession, DraftStepper, Session, Stepper, BATCH_BUCKETS,
};
pub use weights::{LoadOptions, LoadProgress, Weights};

/// Faults a test can give a model, to check that the doctor diagnoses them (feature
/// `fault-injection`, for tests only).
#[cfg(feature = "fault-injection")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The GDN recurrent state is rounded to bf16 after every eager step and every commit (a
    /// bf16 state), in a `Cache` and in the engine's pools.
    Bf16State,
    /// `Cache::reset` leaves the GDN states as they are, and a sequence starting in a pool slot
    /// does not clear it (a state not reset between sequences).
    NoReset,
    /// `Cache::commit(keep)` and the pools' commits keep one token more than asked (a wrong
    /// rollback after a verify).
    WrongRollback,
    /// A decode step's GDN state is not written back: every decode step reads the state the
    /// prompt left (a state buffer a graph or an engine never updates), in a `Cache` and in the
    /// engine's pools.
    StaleState,
}
