//! The serving engine: many sequences at once over pooled GDN state and paged KV (issue 22,
//! built in steps).
//!
//! [`Engine`] takes [`Request`]s, schedules them by continuous batching (chunked prefill under a
//! per-step token budget, FCFS, preemption of the newest sequence when KV blocks run out) and
//! runs each step as one flat forward of every scheduled sequence
//! ([`qwen36_model::Qwen36Model::forward_batch`]); each request's [`RequestHandle`] receives
//! its tokens as [`Event`]s. [`Engine::spawn`] runs it on a thread of its own behind a cloneable
//! [`EngineClient`] (what a server holds); [`Engine::step`] drives it from the caller instead. A prefix cache
//! ([`EngineConfig::prefix_snapshots`]) shares the KV blocks of prompts' cached prefixes and
//! restores the GDN state from snapshots kept at block boundaries, so that a chat's next turn
//! runs only its new tokens. The pools' bookkeeping: a fixed set of GDN state slots and of paged
//! KV blocks, both refcounted so that the prefix cache can share them, sized from a memory
//! budget ([`PoolSizes`]). See docs/ARCHITECTURE.md.

mod constraint;
mod engine;
mod error;
mod lockstep;
mod pool;
pub mod prefix;
mod request;
mod scheduler;
mod sizes;
pub mod spec;
mod thread;

pub use constraint::{Constraint, ConstraintSpec, OutputConstraint};
pub use engine::{
    check_prompt, check_request, Engine, EngineConfig, EngineLoad, StepStats, DEFAULT_POSITIONS,
};
pub use error::{Error, Result};
pub use pool::{BlockId, BlockPool, BlockTable, SlotId, SlotPool};
pub use prefix::{PrefixCache, PrefixHit, PrefixStats};
pub use qwen36_mtp::SpecStats;
pub use qwen36_sampling::Detokenize;
pub use request::{
    Canceller, Event, Request, RequestHandle, Speculation, StopReason, Usage, Wait, MAX_DRAFTS,
    MAX_LOOP_PERIOD, MAX_NGRAM,
};
pub use sizes::{PoolSizes, StateBytes};
pub use spec::SpecCosts;
pub use thread::{EngineClient, EngineStatus};
