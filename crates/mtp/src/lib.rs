//! Speculative decoding for Qwen3.6: draft k tokens, verify them in one target forward, accept
//! (losslessly), commit the GDN/conv state and KV length of the accepted prefix, re-feed the drafter.
//!
//! [`SpeculativeDecoder`] is generic over a [`Drafter`]: [`MtpDrafter`] uses the checkpoint's MTP
//! head, [`NgramDrafter`] looks the continuation up in the context (prompt lookup, no weights).

mod decoder;
mod drafter;
mod error;
mod stats;

pub use decoder::{accept_drafts, SpecConfig, SpecOutput, SpecStopReason, SpeculativeDecoder};
pub use drafter::{DraftContext, Drafter, MtpDrafter, NgramDrafter};
pub use error::{Error, Result};
pub use stats::SpecStats;
