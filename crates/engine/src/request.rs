//! What a client submits and what it gets back: a request, its handle and its events.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use qwen36_mtp::SpecStats;
use qwen36_sampling::{Degeneration, DegenerationConfig, Sampled, SamplingParams};

use crate::OutputConstraint;

/// One generation request, in token ids.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// The prompt (at least one id).
    pub prompt: Vec<u32>,
    /// How tokens are drawn; its seed makes the request reproducible whatever else runs.
    pub sampling: SamplingParams,
    /// Upper bound on generated tokens; `None`: until a stop id or the context is full. `0`
    /// (with `prompt_logprobs`) runs the prompt alone.
    pub max_tokens: Option<usize>,
    /// Generation stops after any of these ids (the id is the last token sent).
    pub stop_ids: Vec<u32>,
    /// Generation stops once the text contains any of these (it ends where the match starts;
    /// needs [`crate::Engine::with_detokenizer`]). Neither they nor the stop ids end the output
    /// before `sampling.min_tokens` tokens (the stop ids are masked until then).
    pub stop_strings: Vec<String>,
    /// The text ends after a matched stop string rather than where it starts, and a stop id's
    /// text (when it has any) is kept.
    pub keep_stop_strings: bool,
    /// The text writes special tokens out (vLLM's `skip_special_tokens: false`; needs a
    /// detokenizer that can: [`qwen36_sampling::Detokenize::decode_special`]).
    pub keep_special_tokens: bool,
    /// Send each token's log-probability (and `sampling.top_logprobs` alternatives).
    pub logprobs: bool,
    /// Send each prompt token's log-probability given the tokens before it, with this many
    /// alternatives, in an [`Event::Prompt`] before any token (`None`: not asked). The whole
    /// prompt then runs: the prefix cache serves only positions whose rows were read already.
    pub prompt_logprobs: Option<usize>,
    /// What the output must match (structured output): tokens it does not allow are masked
    /// before sampling and before a verify's acceptance.
    pub constraint: Option<OutputConstraint>,
    /// Speculative decoding (`None`: one token per step). The tokens are the same either way.
    pub speculation: Option<Speculation>,
    /// Scheduling priority, lower first (vLLM's convention; 0 by default): a waiting request
    /// is admitted before those of a higher value, and when the pool runs out the running
    /// request of the highest value is preempted first. Ties go by arrival.
    pub priority: i32,
    /// Watch the output for degeneration (loops, entropy collapse; reported in [`Usage`]) with
    /// this config; `None` does not watch.
    pub degeneration: Option<DegenerationConfig>,
    /// End the request when its output degenerates ([`StopReason::Degenerate`]; needs
    /// `degeneration`).
    pub stop_on_degeneration: bool,
}

/// How a request drafts tokens for a speculative verify.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Speculation {
    /// Prompt lookup: up to `k` drafts continuing the latest earlier occurrence of the context's
    /// longest recurring suffix of `min_n..=max_n` tokens (no weights, no state).
    Ngram { k: usize, min_n: usize, max_n: usize },
    /// The checkpoint's MTP head: a greedy chain of up to `k` draft steps per verify, every
    /// sequence's steps batched (needs [`crate::Engine::with_mtp_head`]).
    Mtp { k: usize },
}

/// The most drafts a request may ask for per verify (each one is a verify row and a record in
/// its slot's stash).
pub const MAX_DRAFTS: usize = 16;
/// The longest suffix prompt lookup may match.
pub const MAX_NGRAM: usize = 64;
pub use qwen36_sampling::MAX_LOOP_PERIOD;

impl Speculation {
    /// Its parameters' ranges, as an error message naming the one out of range.
    pub(crate) fn check(&self) -> std::result::Result<(), String> {
        if self.k() > MAX_DRAFTS {
            return Err(format!("speculation k = {} is over {MAX_DRAFTS}", self.k()));
        }
        if let Self::Ngram { min_n, max_n, .. } = *self {
            if !(1..=max_n).contains(&min_n) || max_n > MAX_NGRAM {
                return Err(format!(
                    "n-gram speculation needs 1 <= min_n <= max_n <= {MAX_NGRAM}, got {min_n} and {max_n}"
                ));
            }
        }
        Ok(())
    }

    /// The most drafts per verify.
    pub fn k(&self) -> usize {
        match *self {
            Self::Ngram { k, .. } | Self::Mtp { k } => k,
        }
    }

    /// Prompt lookup with `k` drafts and suffixes of 1..=4 tokens.
    pub fn ngram(k: usize) -> Self {
        Self::Ngram {
            k,
            min_n: 1,
            max_n: 4,
        }
    }
}

impl Request {
    /// Greedy decoding of `prompt` for at most `max_tokens` tokens.
    pub fn greedy(prompt: Vec<u32>, max_tokens: usize) -> Self {
        Self {
            prompt,
            sampling: SamplingParams::greedy(),
            max_tokens: Some(max_tokens),
            stop_ids: Vec::new(),
            stop_strings: Vec::new(),
            keep_stop_strings: false,
            keep_special_tokens: false,
            logprobs: false,
            prompt_logprobs: None,
            constraint: None,
            speculation: None,
            priority: 0,
            degeneration: None,
            stop_on_degeneration: false,
        }
    }
}

/// Why a request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// `max_tokens` generated.
    MaxTokens,
    /// A stop id was generated (the last token sent).
    StopToken(u32),
    /// The client cancelled (or dropped its handle).
    Cancelled,
    /// The model's context, or the whole KV pool, is full.
    ContextFull,
    /// A stop string appeared in the text (its index in the request's list).
    StopString(usize),
    /// The output degenerated ([`Request::stop_on_degeneration`]).
    Degenerate(Degeneration),
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache (their state and K/V restored, not run).
    pub cached_tokens: usize,
    /// Times the request was preempted (its state freed and recomputed later).
    pub preemptions: usize,
    /// Speculative decoding: drafts verified and accepted, acceptance per draft position,
    /// accepted lengths (its decode steps without drafts count as passes of length 1).
    pub speculation: SpecStats,
    /// The first degeneration seen in the output, when the request watched for it.
    pub degeneration: Option<Degeneration>,
}

/// What a request's handle receives, in order: its prompt's log-probabilities (when asked),
/// tokens, then exactly one `Finished` or `Failed`.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The log-probability of each prompt token but the first (which has no context) under the
    /// raw distribution after the tokens before it: `logprobs[i]` is `prompt[i + 1]`'s
    /// ([`Request::prompt_logprobs`]).
    Prompt { logprobs: Vec<Sampled> },
    /// New tokens (one per decode step; several when a speculative verify accepts drafts).
    Token {
        ids: Vec<u32>,
        /// The text they complete, with a detokenizer (else empty): a character split across
        /// tokens, or text that may begin a stop string, waits for the tokens that settle it; a
        /// stop id adds none; what is still held when the request ends comes in a last `Token`
        /// with no ids.
        text: String,
        /// Per id, when the request asked for log-probabilities.
        logprobs: Option<Vec<Sampled>>,
    },
    /// The request ended normally.
    Finished { reason: StopReason, usage: Usage },
    /// The request could not go on (the message names why); nothing more follows.
    Failed { error: String },
}

/// The client's side of a submitted request: its events, and cancellation. Dropping the handle
/// cancels the request (nobody is left to read its tokens).
#[derive(Debug)]
pub struct RequestHandle {
    id: u64,
    events: flume::Receiver<Event>,
    cancel: Arc<AtomicBool>,
}

impl Drop for RequestHandle {
    fn drop(&mut self) {
        self.cancel();
    }
}

impl RequestHandle {
    pub(crate) fn new(id: u64, events: flume::Receiver<Event>, cancel: Arc<AtomicBool>) -> Self {
        Self { id, events, cancel }
    }

    /// The request's id (unique per engine, in submission order).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Asks the engine to stop the request; its slot and blocks are freed at the next step and it
    /// ends with [`StopReason::Cancelled`].
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }

    /// A cloneable, `Sync` way to cancel the request from elsewhere (a task that notices its
    /// client has gone while another thread waits on the events).
    pub fn canceller(&self) -> Canceller {
        Canceller(self.cancel.clone())
    }

    /// The next event, waiting for it; `None` once the engine has dropped the request's sender
    /// (after its last event, or when the engine itself is gone).
    pub fn recv(&self) -> Option<Event> {
        self.events.recv().ok()
    }

    /// The next event, awaited (for async callers: no thread blocks); `None` as for
    /// [`Self::recv`].
    pub async fn recv_async(&self) -> Option<Event> {
        self.events.recv_async().await.ok()
    }

    /// The next event if one is ready.
    pub fn try_recv(&self) -> Option<Event> {
        self.events.try_recv().ok()
    }

    /// The next event, waiting at most `timeout`.
    pub fn recv_timeout(&self, timeout: Duration) -> Option<Event> {
        self.events.recv_timeout(timeout).ok()
    }

    /// The next event, waiting at most `timeout`: [`Wait::TimedOut`] when none came in time,
    /// [`Wait::Closed`] once the engine has dropped the request's sender.
    pub fn wait(&self, timeout: Duration) -> Wait {
        match self.events.recv_timeout(timeout) {
            Ok(e) => Wait::Event(e),
            Err(flume::RecvTimeoutError::Timeout) => Wait::TimedOut,
            Err(flume::RecvTimeoutError::Disconnected) => Wait::Closed,
        }
    }

    /// Every event already sent, without waiting.
    pub fn drain(&self) -> Vec<Event> {
        std::iter::from_fn(|| self.try_recv()).collect()
    }
}

/// Cancels one request ([`RequestHandle::canceller`]), as [`RequestHandle::cancel`] does.
#[derive(Debug, Clone)]
pub struct Canceller(Arc<AtomicBool>);

impl Canceller {
    /// Asks the engine to stop the request (see [`RequestHandle::cancel`]).
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// What [`RequestHandle::wait`] got.
#[derive(Debug, Clone, PartialEq)]
pub enum Wait {
    /// The next event.
    Event(Event),
    /// None came in time.
    TimedOut,
    /// The engine has dropped the request's sender (after its last event).
    Closed,
}
