//! Logits processing, seeded sampling and speculative acceptance for autoregressive decoding.
//!
//! Logits in, token ids out; needs nothing of the model. The pipeline ([`SamplingParams`]) runs in
//! the order vLLM and HF use: penalties → temperature → top-k → top-p → min-p → draw. Draws come
//! from a counter-based RNG ([`rng`]) keyed by (seed, row, step), so the same seed and logits give
//! the same tokens on every run, thread count and backend.

mod accept;
mod degeneration;
mod error;
mod params;
pub mod rng;
mod sampler;
mod stop;
mod text;

pub use accept::{accept_greedy, accept_stochastic, Acceptance};
pub use degeneration::{entropy, Degeneration, DegenerationConfig, RepetitionDetector, MAX_LOOP_PERIOD};
pub use error::{Error, Result};
pub use params::SamplingParams;
pub use sampler::{logprobs_of, ranked_logprobs_of, Sampled, Sampler};
pub use stop::{StopMatch, StopStrings};
pub use text::{Detokenize, TextStream};
