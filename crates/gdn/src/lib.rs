//! The Gated DeltaNet (GDN) linear-attention layer and its per-sequence state.
//!
//! Reusable by any GDN model: fill a [`GdnConfig`] and a [`GdnWeights`] (the Qwen3.5/3.6 flat layout:
//! `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, `conv1d`, `A_log`, `dt_bias`, `norm`,
//! `out_proj`) and run [`GatedDeltaNet::forward`] with a [`GdnState`]. The recurrent state is f32
//! by construction; see docs/MODEL.md §2 for the math.

mod config;
mod error;
mod layer;
mod state;

pub use config::GdnConfig;
pub use error::{Error, Result};
pub use layer::{GatedDeltaNet, GdnGroup, GdnWeights, GroupState, PoolStash, VerifyCheckpoints};
pub use state::GdnState;
