//! Decode steps, verify passes and MTP draft steps for a generation loop: through CUDA graphs
//! where the model's device can record them, eagerly everywhere else, with one call site either
//! way.

use candle_core::Tensor;

use crate::{
    BatchOutput, Cache, DraftVocab, ForwardBatch, MtpCache, MtpHead, PagedCache, Qwen36Model, Result,
};

/// A cache and the [`Stepper`] bound to it: what generating one sequence at a time needs, kept
/// across sequences so that CUDA graphs are recorded once ([`Self::reset`] clears the cache but
/// keeps its buffers, which the graphs read and write).
pub struct Session {
    /// The sequence's KV and GDN state.
    pub cache: Cache,
    /// Runs the passes over `cache` (its graphs are bound to the cache's buffers).
    pub stepper: Stepper,
}

impl Session {
    /// A fresh cache for `batch` sequences of `model`, and its stepper.
    pub fn new(model: &Qwen36Model, batch: usize) -> Result<Self> {
        Ok(Self {
            cache: model.new_cache(batch)?,
            stepper: Stepper::new(model, batch),
        })
    }

    /// Starts a new sequence: KV lengths to 0, GDN states to zero, in the same buffers.
    pub fn reset(&mut self) -> Result<()> {
        self.cache.reset()
    }
}

/// The MTP head's cache and the [`DraftStepper`] bound to it, kept across sequences like
/// [`Session`].
pub struct DraftSession {
    /// The MTP layer's KV cache.
    pub cache: MtpCache,
    /// Runs the draft steps over `cache`.
    pub stepper: DraftStepper,
}

impl DraftSession {
    /// A fresh cache for `head` and its draft stepper (drafts over the whole vocabulary).
    pub fn new(model: &Qwen36Model, head: &MtpHead) -> Self {
        Self::with_vocab(model, head, None)
    }

    /// As [`Self::new`], drafting over `vocab` when given.
    pub fn with_vocab(model: &Qwen36Model, head: &MtpHead, vocab: Option<DraftVocab>) -> Self {
        Self {
            cache: head.new_cache(),
            stepper: DraftStepper::with_vocab(model, vocab),
        }
    }

    /// Starts a new sequence (the cache's buffers stay).
    pub fn reset(&mut self) {
        self.cache.reset();
    }
}

/// Runs the per-token passes of one generation. On a CUDA device made by
/// `graph_device` (feature `cuda`) one-token steps and verify passes replay
/// recorded graphs (`DecodeGraph`); on any other device they run eagerly.
/// Graphs are bound to one [`Cache`]: keep the stepper and the cache together (a new cache
/// re-records, which costs two eager passes of the stack).
pub struct Stepper {
    #[cfg(feature = "cuda")]
    graph: Option<crate::DecodeGraph>,
}

impl Stepper {
    /// A stepper for `batch` sequences of `model`.
    pub fn new(model: &Qwen36Model, batch: usize) -> Self {
        #[cfg(feature = "cuda")]
        {
            let graph = model
                .can_record_graphs()
                .then(|| crate::DecodeGraph::new(model.device(), batch).ok())
                .flatten();
            Self { graph }
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (model, batch);
            Self {}
        }
    }

    /// Whether passes replay CUDA graphs.
    pub fn uses_graphs(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.graph.is_some();
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// How many step graphs this stepper has recorded (0 when it runs eagerly): a second
    /// sequence through the same [`Session`] adds none unless its prompt outgrows the KV buffers.
    pub fn recordings(&self) -> usize {
        #[cfg(feature = "cuda")]
        return self.graph.as_ref().map_or(0, |g| g.recordings());
        #[cfg(not(feature = "cuda"))]
        0
    }

    /// [`Qwen36Model::forward_hidden`]; one-token steps replay graphs when available.
    pub fn forward_hidden(&mut self, model: &Qwen36Model, ids: &Tensor, cache: &mut Cache) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(g) = self.graph.as_mut() {
            if ids.dims() == [g.batch(), 1] {
                return model.forward_hidden_graphed(ids, cache, g);
            }
        }
        model.forward_hidden(ids, cache)
    }

    /// [`Qwen36Model::forward_verify`], replaying graphs when available.
    pub fn forward_verify(&mut self, model: &Qwen36Model, ids: &Tensor, cache: &mut Cache) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(g) = self.graph.as_mut() {
            if ids.rank() == 2 && ids.dim(0)? == g.batch() {
                return model.forward_verify_graphed(ids, cache, g);
            }
        }
        model.forward_verify(ids, cache)
    }

    /// [`Cache::commit`] after [`Self::forward_verify`], its copies replayed from a graph when
    /// the verify was graphed.
    pub fn commit(&mut self, cache: &mut Cache, keep: usize) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(g) = self.graph.as_mut() {
            return g.commit(cache, keep);
        }
        cache.commit(keep)
    }
}

/// Runs MTP draft steps ([`MtpHead::draft`]): replayed from CUDA graphs where the model's device
/// can record them (feature `cuda`, a device from `graph_device`),
/// eagerly elsewhere, with the same results. Graphs are bound to one [`MtpCache`]: keep the
/// stepper and the cache together.
pub struct DraftStepper {
    #[cfg(feature = "cuda")]
    graph: Option<crate::graph::DraftGraph>,
    /// Fixed for the stepper's life, so its recorded graphs always score these rows.
    vocab: Option<DraftVocab>,
}

impl DraftStepper {
    /// A stepper for drafts of `model`'s head over the whole vocabulary.
    pub fn new(model: &Qwen36Model) -> Self {
        Self::with_vocab(model, None)
    }

    /// A stepper for drafts of `model`'s head over `vocab` when given.
    pub fn with_vocab(model: &Qwen36Model, vocab: Option<DraftVocab>) -> Self {
        #[cfg(feature = "cuda")]
        {
            let graph = model
                .can_record_graphs()
                .then(|| crate::graph::DraftGraph::new(model.device()).ok())
                .flatten();
            Self { graph, vocab }
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = model;
            Self { vocab }
        }
    }

    /// The draft vocabulary, when the steps are restricted to one.
    pub fn vocab(&self) -> Option<&DraftVocab> {
        self.vocab.as_ref()
    }

    /// Whether draft steps replay CUDA graphs.
    pub fn uses_graphs(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.graph.is_some();
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// [`MtpHead::draft`] over the stepper's vocabulary, replayed from a graph when available.
    pub fn draft(
        &mut self,
        head: &MtpHead,
        model: &Qwen36Model,
        hidden: &Tensor,
        next_ids: &Tensor,
        cache: &mut MtpCache,
        step: usize,
    ) -> Result<(Tensor, Tensor)> {
        #[cfg(feature = "cuda")]
        if let Some(g) = self.graph.as_mut() {
            return g.draft(head, model, hidden, next_ids, cache, step, self.vocab.as_ref());
        }
        head.draft(model, hidden, next_ids, cache, step, self.vocab.as_ref())
    }
}

/// Times between marks in a device's queue of work, read once the work has run: CUDA events
/// on a CUDA device (each span the device's own time from one mark to the next, taken without
/// waiting for it), host instants elsewhere (where work runs as it is issued).
pub struct DeviceClock {
    #[cfg(feature = "cuda")]
    stream: Option<std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>>,
    marks: Vec<Mark>,
}

enum Mark {
    Host(std::time::Instant),
    #[cfg(feature = "cuda")]
    Event(candle_core::cuda_backend::cudarc::driver::CudaEvent),
    /// An event that could not be recorded: no span ends or starts here.
    #[cfg(feature = "cuda")]
    Missed,
}

impl DeviceClock {
    /// A clock for the work queued on `device` (its stream, on CUDA).
    pub fn new(device: &candle_core::Device) -> Self {
        #[cfg(feature = "cuda")]
        return Self {
            stream: device.as_cuda_device().ok().map(|d| d.cuda_stream()),
            marks: Vec::new(),
        };
        #[cfg(not(feature = "cuda"))]
        {
            let _ = device;
            Self { marks: Vec::new() }
        }
    }

    /// Marks the point the queued work has reached.
    pub fn mark(&mut self) {
        #[cfg(feature = "cuda")]
        if let Some(stream) = &self.stream {
            use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
            let event = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT));
            self.marks.push(event.map_or(Mark::Missed, Mark::Event));
            return;
        }
        self.marks.push(Mark::Host(std::time::Instant::now()));
    }

    /// Seconds from each mark to the next (waiting for the last one's work); `None` for a span
    /// the device could not time (a timing is worth no failed step).
    pub fn spans(&self) -> Vec<Option<f64>> {
        self.marks
            .windows(2)
            .map(|w| match (&w[0], &w[1]) {
                (Mark::Host(a), Mark::Host(b)) => Some(b.duration_since(*a).as_secs_f64()),
                #[cfg(feature = "cuda")]
                (Mark::Event(a), Mark::Event(b)) => a.elapsed_ms(b).ok().map(|ms| ms as f64 / 1e3),
                #[cfg(feature = "cuda")]
                _ => None,
            })
            .collect()
    }
}

/// Sequence counts that flat decode and verify steps are recorded for; a step of fewer sequences
/// replays the next larger one with padding rows (a slot outside the pool, no KV row, length 0:
/// the kernels read and write nothing for them).
pub const BATCH_BUCKETS: [usize; 10] = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64];

/// Runs flat batches over pooled caches for an engine ([`Qwen36Model::forward_batch`]): steps
/// whose sequences all decode one token or all verify as many replay recorded CUDA graphs where
/// the model's device can record them (feature `cuda`, a device from `graph_device`), everything
/// else runs eagerly, with the same results. Graphs are bound to one [`PagedCache`]: keep the
/// stepper and the pools together.
pub struct BatchStepper {
    #[cfg(feature = "cuda")]
    graph: Option<crate::graph::BatchGraph>,
    /// The ids MTP draft steps choose among (all when `None`).
    vocab: Option<DraftVocab>,
}

impl BatchStepper {
    /// A stepper for `model`'s flat batches; `graphs: false` always runs eagerly. Graphs read
    /// block tables at least `table_blocks` wide (wider when a sequence holds more blocks), so
    /// sequences within `table_blocks` never make them re-record as they grow.
    pub fn new(model: &Qwen36Model, graphs: bool, table_blocks: usize) -> Self {
        #[cfg(feature = "cuda")]
        {
            let graph = (graphs && model.can_record_graphs())
                .then(|| crate::graph::BatchGraph::new(model.device(), table_blocks).ok())
                .flatten();
            Self { graph, vocab: None }
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (model, graphs, table_blocks);
            Self { vocab: None }
        }
    }

    /// The stepper with its MTP draft steps choosing among `vocab`'s ids only (a draft
    /// vocabulary: cheaper drafts, verified as any).
    pub fn with_draft_vocab(mut self, vocab: DraftVocab) -> Self {
        self.vocab = Some(vocab);
        self
    }

    /// Whether decode and verify steps replay CUDA graphs.
    pub fn uses_graphs(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.graph.is_some();
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// Graphs recorded so far (re-recordings included) and steps replayed from them.
    pub fn graph_counts(&self) -> (usize, usize) {
        #[cfg(feature = "cuda")]
        return self
            .graph
            .as_ref()
            .map_or((0, 0), |g| (g.recordings(), g.replays()));
        #[cfg(not(feature = "cuda"))]
        (0, 0)
    }

    /// [`Qwen36Model::forward_batch`] of `batch` over `cache`, replayed from a graph when it can.
    /// Commit its verifies ([`PagedCache::commit_many`]) before the next forward.
    pub fn forward(
        &mut self,
        model: &Qwen36Model,
        batch: &ForwardBatch,
        cache: &mut PagedCache,
    ) -> Result<BatchOutput> {
        #[cfg(feature = "cuda")]
        if let Some(g) = self.graph.as_mut() {
            return g.forward(model, batch, cache);
        }
        model.forward_batch(batch, cache)
    }
}

impl BatchStepper {
    /// One MTP draft step of `head` over a flat batch of its pool `cache` (chunk `i` feeds the
    /// pairs of `batch.rows(i)`: next ids and the rows of `hidden: [rows, hidden]`, as
    /// [`MtpHead::forward_batch`]): per chunk, in chunk order, its last row's post-norm state
    /// `[chunks, hidden]` and that row's greedy token (among the draft vocabulary's ids, when
    /// set), u32 `[chunks]`. Replayed from a graph where one fits (feeds of up to the decode
    /// kernel's rows a sequence, the shorter padded before their pairs).
    pub fn draft(
        &mut self,
        head: &MtpHead,
        model: &Qwen36Model,
        hidden: &Tensor,
        batch: &ForwardBatch,
        cache: &mut PagedCache,
        step: usize,
    ) -> Result<(Tensor, Tensor)> {
        self.draft_ids(head, model, hidden, None, batch, cache, step)
    }

    /// [`Self::draft`] of a batch of one-token chunks whose tokens are `ids` (u32 `[chunks]`,
    /// on the device: the last step's greedy tokens) rather than the chunks' own, which are not
    /// read: a chain of draft steps needs nothing back from the device between its steps.
    #[allow(clippy::too_many_arguments)]
    pub fn draft_from(
        &mut self,
        head: &MtpHead,
        model: &Qwen36Model,
        hidden: &Tensor,
        ids: &Tensor,
        batch: &ForwardBatch,
        cache: &mut PagedCache,
        step: usize,
    ) -> Result<(Tensor, Tensor)> {
        self.draft_ids(head, model, hidden, Some(ids), batch, cache, step)
    }

    #[allow(clippy::too_many_arguments)]
    fn draft_ids(
        &mut self,
        head: &MtpHead,
        model: &Qwen36Model,
        hidden: &Tensor,
        ids: Option<&Tensor>,
        batch: &ForwardBatch,
        cache: &mut PagedCache,
        step: usize,
    ) -> Result<(Tensor, Tensor)> {
        let vocab = self.vocab.as_ref();
        #[cfg(feature = "cuda")]
        if let Some(g) = self.graph.as_mut() {
            return g.draft(head, model, hidden, batch, cache, step, vocab, ids);
        }
        draft_eager(head, model, hidden, batch, cache, step, vocab, ids)
    }
}

/// [`BatchStepper::draft`] without graphs (`ids`: see [`BatchStepper::draft_from`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn draft_eager(
    head: &MtpHead,
    model: &Qwen36Model,
    hidden: &Tensor,
    batch: &ForwardBatch,
    cache: &mut PagedCache,
    step: usize,
    vocab: Option<&DraftVocab>,
    ids: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let out = head.forward_batch_ids(model, hidden, ids, batch, cache, step)?;
    let lasts: Vec<u32> = (0..batch.chunks().len())
        .map(|c| batch.rows(c).end as u32 - 1)
        .collect();
    let last = out.index_select(&Tensor::new(lasts.as_slice(), out.device())?, 0)?;
    let tokens = draft_ids(model, &last, vocab)?;
    Ok((last, tokens))
}

/// Greedy ids of draft states `[n, hidden]`, among `vocab`'s ids when given.
pub(crate) fn draft_ids(model: &Qwen36Model, last: &Tensor, vocab: Option<&DraftVocab>) -> Result<Tensor> {
    match vocab {
        Some(v) => v.greedy_ids(last),
        None => model.greedy_ids(last),
    }
}

impl std::fmt::Debug for BatchStepper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchStepper")
            .field("graphs", &self.uses_graphs())
            .finish()
    }
}

/// CUDA device `ordinal`, made so that [`Stepper`] can record graphs on it (see
/// `graph_device`); without the `cuda` feature, candle's error saying so.
pub fn cuda_device(ordinal: usize) -> Result<candle_core::Device> {
    #[cfg(feature = "cuda")]
    return crate::graph_device(ordinal);
    #[cfg(not(feature = "cuda"))]
    Ok(candle_core::Device::new_cuda(ordinal)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A clock's spans are the times between consecutive marks, one fewer than the marks; on the
    /// CPU they are the host's (work runs as it is issued).
    #[test]
    fn spans_are_the_times_between_marks() {
        let mut clock = DeviceClock::new(&candle_core::Device::Cpu);
        assert!(clock.spans().is_empty());
        clock.mark();
        std::thread::sleep(std::time::Duration::from_millis(3));
        clock.mark();
        clock.mark();
        let spans = clock.spans();
        assert_eq!(spans.len(), 2);
        assert!(spans[0].is_some_and(|s| s >= 0.003), "{spans:?}");
        assert!(spans[1].is_some_and(|s| s >= 0.0), "{spans:?}");
    }
}
