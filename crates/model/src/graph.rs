//! CUDA-graph decode (feature `cuda`): one-token steps and speculative verify passes replayed from
//! recorded graphs, one per run of graph-safe layers (normally the whole stack: one launch per
//! token instead of ~2,500); MTP draft steps likewise ([`DraftGraph`]: head, lm_head and greedy
//! pick in one launch instead of ~60).
//!
//! A graph bakes in device addresses and shapes. GDN layers fit: their state has a fixed size and
//! is written in place ([`GdnState::set_in_place`]), and nothing in them depends on the position.
//! Attention layers fit when they run the decode kernel: the KV buffers are reserved before
//! recording, and the position-dependent inputs (RoPE angles, write positions, valid length) are
//! device buffers of the graph's [`AttnStep`], rewritten before each replay. Layers that cannot
//! (a pass too long for the kernel) run eagerly between the replays.
//!
//! The engine's flat steps over pooled caches replay [`BatchGraph`]s: one per bucket of
//! sequences, padded, with every per-step input in device buffers.
//!
//! [`GdnState::set_in_place`]: qwen36_gdn::GdnState::set_in_place

use std::ops::Range;
use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{sys, CudaGraph, CudaStream};
use candle_core::{Device, Tensor, TensorId};
use qwen36_gdn::{GdnState, VerifyCheckpoints};

use crate::attention::{AttnPart, AttnStep};
use crate::model::FlatInputs;
use crate::paged::{Padding, PagedLayer};
use crate::{
    BatchOutput, Cache, DraftVocab, Error, ForwardBatch, LayerCache, MtpCache, MtpHead, PagedCache,
    Qwen36Model, Result,
};

/// What a run of layers returns: the hidden state `[batch, len, hidden]` and, for a verify pass,
/// the checkpoints of its GDN layers in layer order.
pub(crate) type SegmentOut = (Tensor, Vec<VerifyCheckpoints>);

/// Captures the work `f` queues on `stream` into a graph (capturing runs nothing).
fn capture<T>(stream: &Arc<CudaStream>, f: impl FnOnce() -> Result<T>) -> Result<(CudaGraph, T)> {
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .map_err(candle_core::Error::wrap)?;
    let out = f();
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    let out = out?;
    let graph = graph
        .map_err(candle_core::Error::wrap)?
        .ok_or_else(|| Error::Cache("CUDA graph capture recorded nothing".into()))?;
    Ok((graph, out))
}

/// The attention inputs that graphs read for a step like `fresh`: `fresh` copied into the buffers
/// kept in `kept` for its length (which it becomes on first use).
fn kept_step(kept: &mut Vec<AttnStep>, fresh: AttnStep) -> Result<AttnStep> {
    if let Some(k) = kept.iter().find(|s| s.tokens() == fresh.tokens()) {
        k.write_from(&fresh)?;
        return Ok(k.clone());
    }
    kept.push(fresh.clone());
    Ok(fresh)
}

/// The CUDA device of `device` when graphs can record on it (made by [`graph_device`]).
fn recording_stream(device: &Device) -> Result<Arc<CudaStream>> {
    let cuda = device
        .as_cuda_device()
        .map_err(|_| Error::Input("CUDA graphs need a CUDA device".into()))?;
    let stream = cuda.cuda_stream();
    if cuda.is_event_tracking() || stream.cu_stream().is_null() {
        return Err(Error::Input(
            "this CUDA device cannot record graphs: make it with qwen36_model::graph_device".into(),
        ));
    }
    Ok(stream)
}

/// Recorded graphs for steps of one batch size (one graph per run of graph-safe layers, normally
/// the whole stack, and per step shape: a one-token decode, a verify of `len` tokens), bound to
/// one [`Cache`] (its GDN state and KV buffers). Reusing it with another cache, or after the KV
/// buffers grew, re-records; dropping it frees the graphs.
pub struct DecodeGraph {
    stream: Arc<CudaStream>,
    device: Device,
    batch: usize,
    segments: Vec<Segment>,
    /// The state tensors the graphs were recorded with (conv, recurrent per GDN layer; keys,
    /// values per attention layer).
    bound_to: Vec<TensorId>,
    /// The attention inputs the graphs read, one per step length.
    steps: Vec<AttnStep>,
    /// Recorded commits: (the first GDN checkpoint buffer of a verify segment, tokens kept).
    commits: Vec<(TensorId, usize, CudaGraph)>,
    /// Step graphs recorded so far, re-recordings included.
    recordings: usize,
}

/// One run of consecutive graph-safe layers for one step shape: `output = layers(input)`, each
/// `[batch, tokens, hidden]`; a verify also leaves its checkpoints in `checkpoints`.
struct Segment {
    layers: Range<usize>,
    tokens: usize,
    verify: bool,
    input: Tensor,
    output: Tensor,
    checkpoints: Vec<VerifyCheckpoints>,
    graph: CudaGraph,
}

/// A CUDA device that graphs can record on: its own stream (a default stream cannot be
/// captured) and no cross-stream event tracking (cudarc would otherwise make captured kernels wait
/// on events recorded outside the capture). Make it before loading anything onto it.
pub fn graph_device(ordinal: usize) -> Result<Device> {
    let device = Device::new_cuda_with_stream(ordinal)?;
    let cuda = device.as_cuda_device()?;
    // SAFETY: every tensor of this device is made and used on its single stream, so work is
    // ordered by the stream itself and the per-slice events that event tracking adds are not
    // needed for correctness.
    unsafe { cuda.disable_event_tracking() };
    Ok(device)
}

impl DecodeGraph {
    /// An empty recorder for steps of `batch` sequences on `device`, which must come from
    /// [`graph_device`].
    pub fn new(device: &Device, batch: usize) -> Result<Self> {
        Ok(Self {
            stream: recording_stream(device)?,
            device: device.clone(),
            batch,
            segments: Vec::new(),
            bound_to: Vec::new(),
            steps: Vec::new(),
            commits: Vec::new(),
            recordings: 0,
        })
    }

    /// Batch size the graphs are recorded for.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Number of recorded graphs.
    pub fn recorded(&self) -> usize {
        self.segments.len()
    }

    /// Step graphs recorded so far, re-recordings (another cache, grown KV buffers) included.
    pub fn recordings(&self) -> usize {
        self.recordings
    }

    /// Binds to `cache`: puts its GDN states in place mode and drops the graphs when they were
    /// recorded with other buffers (another cache, or KV buffers that grew: reserve first).
    pub(crate) fn bind(&mut self, cache: &mut Cache) -> Result<()> {
        let mut ids = Vec::new();
        for lc in cache.layers.iter_mut() {
            match lc {
                LayerCache::Gdn(s) => {
                    s.set_in_place()?;
                    ids.extend([s.conv().id(), s.recurrent().id()]);
                }
                LayerCache::Attention(kv) => {
                    ids.extend(kv.buffers().map(|(k, v)| [k.id(), v.id()]).into_iter().flatten())
                }
            }
        }
        if ids != self.bound_to {
            self.segments.clear();
            self.commits.clear();
            self.bound_to = ids;
        }
        Ok(())
    }

    /// [`Cache::commit`] after a graphed verify pass, its copies (each GDN layer's state and conv
    /// window from the pass's checkpoints) replayed from a graph: one launch instead of ~150
    /// small copies. Recorded per verify length and `keep` on first use; after an eager verify it
    /// is the plain commit.
    pub fn commit(&mut self, cache: &mut Cache, keep: usize) -> Result<()> {
        let key = cache
            .pending_checkpoints()
            .and_then(|cps| cps.iter().flatten().next())
            .map(|cp| cp.states().id());
        let graphed = key.is_some_and(|key| {
            self.segments
                .iter()
                .any(|s| s.checkpoints.first().map(|cp| cp.states().id()) == Some(key))
        });
        let (Some(key), true) = (key, graphed) else {
            return cache.commit(keep);
        };
        if let Some((_, _, graph)) = self.commits.iter().find(|c| c.0 == key && c.1 == keep) {
            graph.launch().map_err(candle_core::Error::wrap)?;
            return cache.commit_with(keep, false);
        }
        // The eager commit does the work (and fills candle's cache of uploaded launch parameters);
        // the captured one repeats the same copies from the same sources.
        let pending = cache.pending.clone();
        let cuda = self.device.as_cuda_device()?;
        let htod_cache = cuda.enable_cuda_graph_htod_cache();
        cache.commit(keep)?;
        let after = (cache.seq_len, cache.pending.take());
        cache.pending = pending;
        let recorded = capture(&self.stream, || cache.commit(keep));
        drop(htod_cache);
        (cache.seq_len, cache.pending) = after;
        let (graph, ()) = recorded?;
        self.commits.push((key, keep, graph));
        Ok(())
    }

    /// The graphs' attention inputs for a step like `fresh` (see [`kept_step`]).
    pub(crate) fn step(&mut self, fresh: AttnStep) -> Result<AttnStep> {
        kept_step(&mut self.steps, fresh)
    }

    /// Runs layers `layers` on `x: [batch, len, hidden]` (with per-token checkpoints when
    /// `verify`): replays their graph for this step shape, recording it first when there is none.
    /// `run` is the eager forward of those layers (it updates the states' buffers in place and
    /// their host-side token counts). The returned tensors are the graph's own buffers: valid until
    /// the next replay of the same graph.
    pub(crate) fn run_segment(
        &mut self,
        layers: Range<usize>,
        verify: bool,
        x: &Tensor,
        cache: &mut Cache,
        run: impl Fn(&Tensor, &mut Cache) -> Result<SegmentOut>,
    ) -> Result<SegmentOut> {
        let tokens = x.dim(1)?;
        if let Some(seg) = self
            .segments
            .iter()
            .find(|s| s.layers == layers && s.tokens == tokens && s.verify == verify)
        {
            seg.input.slice_set(x, 0, 0)?;
            seg.graph.launch().map_err(candle_core::Error::wrap)?;
            // The replay skipped the host-side bookkeeping of the recorded forward.
            let mut checkpoints = Vec::with_capacity(seg.checkpoints.len());
            let mut kept = seg.checkpoints.iter();
            for lc in &mut cache.layers[layers] {
                match lc {
                    LayerCache::Gdn(s) => {
                        if let Some(cp) = kept.next() {
                            checkpoints.push(cp.rebased(s.seen()));
                        }
                        s.advance(tokens);
                    }
                    LayerCache::Attention(kv) => kv.advance(tokens),
                }
            }
            return Ok((seg.output.clone(), checkpoints));
        }
        // Inputs and outputs live outside the graph, so their addresses stay valid between
        // replays; everything the layers allocate is freed inside it.
        let input = x.copy()?;
        let output = x.zeros_like()?;
        let cuda = self.device.as_cuda_device()?;
        let htod_cache = cuda.enable_cuda_graph_htod_cache();
        // Candle uploads small parameter vectors (shapes, strides) that a capture may only read
        // from its cache: run the layers once eagerly to fill it, on scratch copies of the states.
        // That run also gives the shapes of the checkpoint buffers. Attention layers write their
        // new keys and values into the real buffers (the recorded run writes the same ones again)
        // and get their lengths back.
        let mut originals = Vec::new();
        let mut kv_lens = Vec::new();
        // A verify's checkpoints go into buffers of the states' own (made here, outside the
        // capture): the graph keeps those, with no copies.
        let mut own_buffers = Vec::new();
        for l in layers.clone() {
            match &mut cache.layers[l] {
                LayerCache::Gdn(s) => {
                    if verify {
                        own_buffers.extend(s.checkpoint_buffers(tokens)?);
                    }
                    let mut scratch =
                        GdnState::from_parts(s.conv().copy()?, s.recurrent().copy()?, s.seen())?;
                    scratch.set_in_place()?;
                    originals.push((l, std::mem::replace(s, scratch)));
                }
                LayerCache::Attention(kv) => kv_lens.push((l, kv.len())),
            }
        }
        let warm = run(&input, cache);
        for (l, s) in originals {
            cache.layers[l] = LayerCache::Gdn(s);
        }
        for (l, len) in kv_lens {
            if let LayerCache::Attention(kv) = &mut cache.layers[l] {
                kv.set_len(len);
            }
        }
        let warm_cps = warm?.1;
        let kept = if own_buffers.len() == warm_cps.len() {
            own_buffers
        } else {
            warm_cps
                .iter()
                .map(|cp| Ok(cp.deep_copy()?))
                .collect::<Result<Vec<_>>>()?
        };
        // The capture below copies checkpoints into `kept` (none that already are its buffers):
        // run those copies once eagerly too.
        for (cp, dst) in warm_cps.iter().zip(&kept) {
            cp.write_into(dst)?;
        }
        drop(warm_cps);
        let recorded = capture(&self.stream, || {
            let (y, cps) = run(&input, cache)?;
            output.slice_set(&y, 0, 0)?;
            for (cp, dst) in cps.iter().zip(&kept) {
                cp.write_into(dst)?;
            }
            Ok(cps.iter().map(|cp| cp.seen_before()).collect::<Vec<_>>())
        });
        drop(htod_cache);
        let (graph, seen_before) = recorded?;
        // Capturing ran nothing: run the step now.
        graph.launch().map_err(candle_core::Error::wrap)?;
        let checkpoints = kept
            .iter()
            .zip(seen_before)
            .map(|(cp, n)| cp.rebased(n))
            .collect();
        self.recordings += 1;
        self.segments.push(Segment {
            layers,
            tokens,
            verify,
            input,
            output: output.clone(),
            checkpoints: kept,
            graph,
        });
        Ok((output, checkpoints))
    }
}

/// Recorded graphs of MTP draft steps (one per step length and MTP layer: a round's first step
/// feeds the newly accepted positions, the chained steps one each), each running the head,
/// lm_head and the greedy pick; bound to one [`MtpCache`] (its KV buffers). Reusing it with
/// another cache, or after the KV buffers grew, re-records.
pub struct DraftGraph {
    stream: Arc<CudaStream>,
    device: Device,
    recorded: Vec<DraftStep>,
    bound_to: Vec<TensorId>,
    steps: Vec<AttnStep>,
}

/// One recorded draft step of MTP layer `layer`: `(last, token) = step(hidden, ids)` for
/// `hidden: [b, len, hidden]`,
/// `ids: [b, len]`, `last: [b, 1, hidden]` and u32 `token: [b, 1]`.
struct DraftStep {
    layer: usize,
    hidden: Tensor,
    ids: Tensor,
    last: Tensor,
    token: Tensor,
    graph: CudaGraph,
}

impl DraftGraph {
    /// An empty recorder on `device`, which must come from [`graph_device`].
    pub fn new(device: &Device) -> Result<Self> {
        Ok(Self {
            stream: recording_stream(device)?,
            device: device.clone(),
            recorded: Vec::new(),
            bound_to: Vec::new(),
            steps: Vec::new(),
        })
    }

    /// Number of recorded graphs.
    pub fn recorded(&self) -> usize {
        self.recorded.len()
    }

    /// [`MtpHead::draft`] replayed from a graph (recorded on first use of its shape). Falls back to
    /// the eager step where the MTP layer cannot run inside a graph (no decode attention kernel
    /// for this shape). Drafts over `vocab` when given (the stepper's, fixed for its life, so a
    /// recorded graph never meets another).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn draft(
        &mut self,
        head: &MtpHead,
        model: &Qwen36Model,
        hidden: &Tensor,
        next_ids: &Tensor,
        cache: &mut MtpCache,
        step: usize,
        vocab: Option<&DraftVocab>,
    ) -> Result<(Tensor, Tensor)> {
        let (b, len, h) = hidden.dims3()?;
        let layer = head.layer_index(step);
        if !head.graph_safe(layer, len, model) {
            return head.draft(model, hidden, next_ids, cache, step, vocab);
        }
        // Recorded graphs write into the KV buffers they saw: make room before binding.
        let cfg = model.config();
        let kv_shape = (b, cfg.num_key_value_heads, cfg.head_dim);
        let mut ids = Vec::new();
        for lc in cache.layers.iter_mut() {
            if let LayerCache::Attention(kv) = lc {
                kv.reserve(kv.len() + len, kv_shape, model.dtype(), &self.device)?;
                ids.extend(kv.buffers().map(|(k, v)| [k.id(), v.id()]).into_iter().flatten());
            }
        }
        if ids != self.bound_to {
            self.recorded.clear();
            self.bound_to = ids;
        }
        let start = cache.len_of(layer);
        let attn = kept_step(&mut self.steps, model.attn_step(start, len)?)?;
        let next_ids = next_ids.to_device(&self.device)?;
        let fits = |r: &&DraftStep| r.layer == layer && r.hidden.dims() == hidden.dims();
        if let Some(rec) = self.recorded.iter().find(fits) {
            rec.hidden.slice_set(&hidden.to_dtype(model.dtype())?, 0, 0)?;
            rec.ids.slice_set(&next_ids, 0, 0)?;
            rec.graph.launch().map_err(candle_core::Error::wrap)?;
            cache.advance(layer, len);
            // Copies: the next replay overwrites the graph's own buffers.
            return Ok((rec.last.copy()?, rec.token.copy()?));
        }
        // Inputs and outputs live outside the graph, so their addresses stay valid between
        // replays; everything the step allocates is freed inside it.
        let hidden_in = hidden.to_dtype(model.dtype())?.copy()?;
        let ids_in = next_ids.copy()?;
        let last = Tensor::zeros((b, 1, h), model.dtype(), &self.device)?;
        let token = Tensor::zeros((b, 1), candle_core::DType::U32, &self.device)?;
        let run =
            |cache: &mut MtpCache| head.draft_with(model, &hidden_in, &ids_in, cache, step, &attn, vocab);
        let cuda = self.device.as_cuda_device()?;
        let htod_cache = cuda.enable_cuda_graph_htod_cache();
        // One eager run fills candle's cache of uploaded launch parameters, which a capture may
        // only read from. It writes the same keys and values as the recorded run will.
        let warm = run(cache);
        cache.set_len_of(layer, start);
        warm?;
        let recorded = capture(&self.stream, || {
            let (l, t) = run(cache)?;
            last.slice_set(&l, 0, 0)?;
            token.slice_set(&t, 0, 0)?;
            Ok(())
        });
        drop(htod_cache);
        cache.set_len_of(layer, start);
        let (graph, ()) = recorded?;
        // Capturing ran nothing: run the step now.
        graph.launch().map_err(candle_core::Error::wrap)?;
        cache.advance(layer, len);
        let out = (last.copy()?, token.copy()?);
        self.recorded.push(DraftStep {
            layer,
            hidden: hidden_in,
            ids: ids_in,
            last,
            token,
            graph,
        });
        Ok(out)
    }
}

/// Recorded graphs of flat forwards ([`Qwen36Model::forward_batch`]) whose sequences all decode
/// one token or all verify the same number, and of MTP draft steps: one graph per kind of step
/// (the target's layers, or a draft step of one head layer), bucket of [`crate::BATCH_BUCKETS`]
/// (at most the pool's slots), tokens per sequence, verify or not and block-table width (a power
/// of two), bound to one [`PagedCache`] (its pools and stashes). Their inputs (token ids, RoPE
/// rows, slots, replay counts, KV rows, block tables, lengths) are device buffers rewritten
/// before each replay.
pub struct BatchGraph {
    stream: Arc<CudaStream>,
    device: Device,
    /// The narrowest block tables recorded (a wider batch doubles the width as needed).
    table_blocks: usize,
    steps: Vec<BatchStep>,
    /// The pool tensors the graphs were recorded with.
    bound_to: Vec<TensorId>,
    /// Shapes whose recording failed: they run eagerly.
    refused: Vec<StepKey>,
    /// The thread that recorded the graphs (whose cache of uploaded launch parameters they read).
    thread: std::thread::ThreadId,
    recordings: usize,
    replays: usize,
}

/// A recorded graph that may move to another thread with its owner (an engine runs on a thread
/// of its own).
struct SendGraph(CudaGraph);

// SAFETY: a CUDA graph and its executable are driver handles that any thread may use: cudarc
// binds the graph's context to the calling thread on every launch (destroying them needs no
// current context). CUDA only forbids using one graph from several threads at once, which cannot
// happen here: `SendGraph` is not `Sync`, so only the thread that owns it (through its
// `BatchGraph`) can launch or drop it. What a graph reads must outlive it too: the launch
// parameters candle uploaded while recording sit in that thread's cache (a thread-local), so a
// `BatchGraph` called from another thread than the one that recorded drops its graphs first
// (`BatchGraph::run`) and never replays one that reads another thread's cache.
unsafe impl Send for SendGraph {}

/// What a recorded flat step runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StepKind {
    /// The model's layers: `[hidden]` out, the final-norm states of every row.
    Target,
    /// An MTP draft step of head layer `layer`: `[last, tokens]` out, each sequence's last row's
    /// post-norm state and its greedy token.
    Draft { layer: usize },
}

/// The shape a flat step is recorded for: `seqs` sequences (padding included) of `len` tokens,
/// block tables `width` wide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct StepKey {
    kind: StepKind,
    seqs: usize,
    len: usize,
    verify: bool,
    width: usize,
}

/// One recorded flat step: `outputs = run(ids, flat, hidden)` into the graph's own buffers.
struct BatchStep {
    key: StepKey,
    ids: Tensor,
    flat: FlatInputs,
    /// A draft step's input states `[seqs · len, hidden]`.
    hidden: Option<Tensor>,
    outputs: Vec<Tensor>,
    graph: SendGraph,
}

impl BatchStep {
    /// Copies the inputs `ids`, `fresh` and `hidden` (same shapes) into the graph's buffers.
    fn write_from(&self, ids: &Tensor, fresh: &FlatInputs, hidden: Option<&Tensor>) -> Result<()> {
        self.ids.slice_set(ids, 0, 0)?;
        if let (Some(dst), Some(src)) = (&self.hidden, hidden) {
            dst.slice_set(src, 0, 0)?;
        }
        let (a, b) = (&self.flat, fresh);
        for (dst, src) in [(&a.cos, &b.cos), (&a.sin, &b.sin), (&a.kv_rows, &b.kv_rows)] {
            dst.slice_set(src, 0, 0)?;
        }
        for (dst, src) in a.groups.iter().zip(&b.groups) {
            dst.slots.slice_set(&src.slots, 0, 0)?;
            dst.replay.slice_set(&src.replay, 0, 0)?;
        }
        for (dst, src) in a.attn.iter().zip(&b.attn) {
            if let (
                AttnPart::Decode { tables, lens, .. },
                AttnPart::Decode {
                    tables: t, lens: l, ..
                },
            ) = (dst, src)
            {
                tables.slice_set(t, 0, 0)?;
                lens.slice_set(l, 0, 0)?;
            }
        }
        Ok(())
    }
}

/// A flat step's inputs as the graphs take them: token ids `[1, rows]`, the shared layer
/// inputs, a draft step's input states.
struct StepInputs {
    ids: Tensor,
    flat: FlatInputs,
    hidden: Option<Tensor>,
}

impl BatchGraph {
    /// An empty recorder on `device`, which must come from [`graph_device`], for block tables at
    /// least `table_blocks` wide.
    pub fn new(device: &Device, table_blocks: usize) -> Result<Self> {
        Ok(Self {
            stream: recording_stream(device)?,
            device: device.clone(),
            table_blocks,
            steps: Vec::new(),
            bound_to: Vec::new(),
            refused: Vec::new(),
            thread: std::thread::current().id(),
            recordings: 0,
            replays: 0,
        })
    }

    /// Graphs recorded so far, re-recordings (another pool, grown stashes) included.
    pub fn recordings(&self) -> usize {
        self.recordings
    }

    /// Steps replayed from a recorded graph so far.
    pub fn replays(&self) -> usize {
        self.replays
    }

    /// [`Qwen36Model::forward_batch`], replayed from a graph when every chunk decodes one token or
    /// every chunk verifies (the shorter verifies padded after their tokens; none at position 0,
    /// with the paged decode kernel, at most the largest bucket of sequences); recorded on first
    /// use of its shape. Anything else runs eagerly. The results are the eager forward's for the
    /// same padded batch.
    pub(crate) fn forward(
        &mut self,
        model: &Qwen36Model,
        batch: &ForwardBatch,
        cache: &mut PagedCache,
    ) -> Result<BatchOutput> {
        let Some((seqs, len, verify, padding)) = graphed_shape(model, batch, false) else {
            return model.forward_batch(batch, cache);
        };
        model.check_batch(batch, cache)?;
        model.prepare_batch(batch, cache)?;
        let key = self.key(StepKind::Target, batch, cache, (seqs, len, verify), padding);
        let (flat, ids) = model.padded_inputs(batch, cache, (key.seqs, len, key.width), padding)?;
        let inputs = StepInputs {
            ids,
            flat,
            hidden: None,
        };
        let outputs = self.run(key, inputs, cache, |x| {
            Ok(vec![model.run_flat(&x.ids, &x.flat, cache)?])
        })?;
        cache.passed(batch);
        Ok(BatchOutput {
            hidden: batch.unpadded(&outputs[0], len, padding)?,
            pending: batch.pending(cache),
        })
    }

    /// An MTP draft step over a flat batch (see [`crate::BatchStepper::draft`]), replayed from a
    /// graph where [`graphed_shape`] allows (shorter feeds padded before their pairs); otherwise
    /// eager. Drafts over `vocab` when given (the stepper's, fixed for its life, so a recorded
    /// graph never meets another); with `ids`, one-token chunks take those device ids
    /// ([`crate::BatchStepper::draft_from`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn draft(
        &mut self,
        head: &MtpHead,
        model: &Qwen36Model,
        hidden: &Tensor,
        batch: &ForwardBatch,
        cache: &mut PagedCache,
        step: usize,
        vocab: Option<&DraftVocab>,
        ids: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        // Feeds of several tokens fit only where the head layer keeps no GDN state.
        let any_len = head.attention_only(step);
        let shape = graphed_shape(model, batch, any_len).filter(|_| head.fits_pool(cache));
        let Some((seqs, len, _, padding)) = shape else {
            return crate::stepper::draft_eager(head, model, hidden, batch, cache, step, vocab, ids);
        };
        let cfg = model.config();
        batch.check(cache, cfg.vocab_size, cfg.max_position_embeddings)?;
        if hidden.dims() != [batch.total_rows(), cfg.hidden_size] {
            return Err(Error::Input(format!(
                "draft states {:?} for a batch of {} rows of {}",
                hidden.dims(),
                batch.total_rows(),
                cfg.hidden_size
            )));
        }
        let kind = StepKind::Draft {
            layer: head.layer_index(step),
        };
        let key = self.key(kind, batch, cache, (seqs, len, false), padding);
        let seqs = key.seqs;
        let (flat, own) = model.padded_inputs(batch, cache, (seqs, len, key.width), padding)?;
        // Given ids are the one-token chunks' tokens: rows 0.. of the padded ids.
        let ids = match ids {
            None => own,
            Some(ids) => {
                own.slice_set(&crate::mtp_head::one_token_ids(ids, batch)?, 1, 0)?;
                own
            }
        };
        let padded = batch.padded(&hidden.to_dtype(model.dtype())?, seqs, len, padding)?;
        let inputs = StepInputs {
            ids,
            flat,
            hidden: Some(padded),
        };
        let outputs = self.run(key, inputs, cache, |x| {
            let h = x.hidden.as_ref().expect("a draft step's input states");
            let states = head.forward_flat(model, h, &x.ids, &x.flat, cache, step)?;
            // Each sequence's last row (its rows are consecutive).
            let last = states
                .reshape((seqs, len, cfg.hidden_size))?
                .narrow(1, len - 1, 1)?
                .squeeze(1)?
                .contiguous()?;
            let tokens = crate::stepper::draft_ids(model, &last, vocab)?;
            Ok(vec![last, tokens])
        })?;
        let n = batch.chunks.len();
        Ok((outputs[0].narrow(0, 0, n)?, outputs[1].narrow(0, 0, n)?))
    }

    /// The recording key of a step of `shape` over `cache`, binding to it first (and the
    /// block-table width: the widest table, at least `table_blocks`, to a power of two).
    fn key(
        &mut self,
        kind: StepKind,
        batch: &ForwardBatch,
        cache: &PagedCache,
        shape: (usize, usize, bool),
        padding: Padding,
    ) -> StepKey {
        self.bind(cache);
        let (seqs, len, verify) = shape;
        // A bucket past the pool's slots would pad rows that can never hold a sequence.
        let seqs = seqs.min(cache.slots).max(batch.chunks.len());
        // Tables cover every block a row's attention reads (a verify's padding may reach past
        // the chunk's blocks: the kernel reads entry 0 of the table's tail there).
        let reach = |i: usize| {
            let start = batch.padded_start(i, len, padding).unwrap_or(0);
            (start + len).div_ceil(cache.block_size)
        };
        let width = batch
            .chunks
            .iter()
            .enumerate()
            .map(|(i, c)| c.blocks.len().max(reach(i)))
            .max()
            .unwrap_or(1)
            .max(self.table_blocks)
            .next_power_of_two();
        StepKey {
            kind,
            seqs,
            len,
            verify,
            width,
        }
    }

    /// Runs the step `key` on `inputs`: replays its graph (the inputs copied into its buffers),
    /// or runs `run` eagerly and records it for the next step of this shape. Returns `run`'s
    /// outputs (copies on a replay: the next replay overwrites the graph's).
    fn run(
        &mut self,
        key: StepKey,
        inputs: StepInputs,
        cache: &PagedCache,
        run: impl Fn(&StepInputs) -> Result<Vec<Tensor>>,
    ) -> Result<Vec<Tensor>> {
        if self.thread != std::thread::current().id() {
            // Graphs read the launch parameters in the recording thread's cache: record anew.
            self.steps.clear();
            self.thread = std::thread::current().id();
        }
        if let Some(step) = self.steps.iter().find(|s| s.key == key) {
            step.write_from(&inputs.ids, &inputs.flat, inputs.hidden.as_ref())?;
            step.graph.0.launch().map_err(candle_core::Error::wrap)?;
            self.replays += 1;
            return Ok(step
                .outputs
                .iter()
                .map(Tensor::copy)
                .collect::<candle_core::Result<_>>()?);
        }
        if self.refused.contains(&key) {
            return run(&inputs);
        }
        let _ = cache;
        let cuda = self.device.as_cuda_device()?;
        let htod_cache = cuda.enable_cuda_graph_htod_cache();
        // The step runs eagerly once (which also fills candle's cache of uploaded launch
        // parameters, which a capture may only read from); the capture records the same work
        // from the same buffers for the next steps of this shape, running nothing.
        let eager = run(&inputs);
        let recorded = match &eager {
            Ok(outs) => {
                // Outputs live outside the graph, so their addresses stay valid between replays.
                let buffers = outs
                    .iter()
                    .map(Tensor::zeros_like)
                    .collect::<candle_core::Result<Vec<_>>>();
                Some(buffers.map_err(Error::from).and_then(|buffers| {
                    let graph = capture(&self.stream, || {
                        let outs = run(&inputs)?;
                        for (dst, src) in buffers.iter().zip(&outs) {
                            dst.slice_set(src, 0, 0)?;
                        }
                        Ok(())
                    });
                    Ok((graph?.0, buffers))
                }))
            }
            Err(_) => None,
        };
        drop(htod_cache);
        let out = eager?;
        // The step ran: a recording that failed leaves this shape to the eager forward.
        if let Some(recorded) = recorded {
            let Ok((graph, outputs)) = recorded else {
                self.refused.push(key);
                return Ok(out);
            };
            self.recordings += 1;
            self.steps.push(BatchStep {
                key,
                ids: inputs.ids,
                flat: inputs.flat,
                hidden: inputs.hidden,
                outputs,
                graph: SendGraph(graph),
            });
        }
        Ok(out)
    }

    /// Drops the graphs when they were recorded with other pools or stashes.
    fn bind(&mut self, cache: &PagedCache) {
        let ids: Vec<TensorId> = cache
            .layers
            .iter()
            .flat_map(|l| match l {
                PagedLayer::Gdn {
                    conv,
                    recurrent,
                    stash,
                    ..
                } => {
                    let mut ids = vec![conv.id(), recurrent.id()];
                    ids.extend(stash.iter().flat_map(|(c, r)| [c.id(), r.id()]));
                    ids
                }
                PagedLayer::Attention { k, v } => vec![k.id(), v.id()],
            })
            .collect();
        if ids != self.bound_to {
            self.steps.clear();
            self.bound_to = ids;
        }
    }
}

/// `(bucket, rows per sequence, verify, padding)` when `batch` can replay a [`BatchGraph`]: for
/// the target's layers, every chunk a one-token decode, or every chunk a verify (shorter ones
/// padded after their tokens to the longest); with `any_len` (a head layer without GDN state),
/// any feeds, padded before their tokens to the longest. Every chunk past position 0 (and past
/// its padding), within the context, with the paged decode kernel for that many rows, at most
/// the largest bucket of sequences.
fn graphed_shape(
    model: &Qwen36Model,
    batch: &ForwardBatch,
    any_len: bool,
) -> Option<(usize, usize, bool, Padding)> {
    let chunks = &batch.chunks;
    let verify = chunks.first()?.verify;
    let len = chunks.iter().map(|c| c.tokens.len()).max()?;
    let padding = if any_len { Padding::Before } else { Padding::After };
    let kinds = chunks.iter().all(|c| c.verify == verify) && (verify || len == 1 || any_len);
    let context = model.config().max_position_embeddings;
    let placed = (0..chunks.len()).all(|i| {
        chunks[i].start > 0
            && batch
                .padded_start(i, len, padding)
                .is_some_and(|f| f + len <= context)
    });
    let bucket = crate::BATCH_BUCKETS.iter().find(|&&b| b >= chunks.len())?;
    (kinds && placed && model.paged_decode(len)).then_some((*bucket, len, verify, padding))
}
