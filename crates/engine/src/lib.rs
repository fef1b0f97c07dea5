//! The serving engine: many sequences at once over pooled state (issue 22, built in steps).
//!
//! This step holds the pools' bookkeeping: a fixed set of GDN state slots (a running sequence's
//! recurrent state and conv window in every GDN layer) and of paged KV blocks (`block_size`
//! positions of every attention layer's K and V), both refcounted so that the prefix cache can
//! share them, and sized from a memory budget ([`PoolSizes`]). The scheduler, the batched forward
//! and the runner come next; see docs/ARCHITECTURE.md.

mod error;
mod pool;
mod sizes;

pub use error::{Error, Result};
pub use pool::{BlockId, BlockPool, BlockTable, SlotId, SlotPool};
pub use sizes::{PoolSizes, StateBytes};
