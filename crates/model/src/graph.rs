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
//! [`GdnState::set_in_place`]: qwen36_gdn::GdnState::set_in_place

use std::ops::Range;
use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{sys, CudaGraph, CudaStream};
use candle_core::{Device, Tensor, TensorId};
use qwen36_gdn::GdnState;

use qwen36_gdn::VerifyCheckpoints;

use crate::attention::AttnStep;
use crate::{Cache, DraftVocab, Error, LayerCache, MtpCache, MtpHead, Qwen36Model, Result};

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
