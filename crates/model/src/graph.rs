//! CUDA-graph decode (feature `cuda`): one-token steps and speculative verify passes replayed from
//! recorded graphs, one per run of graph-safe layers (normally the whole stack: one launch per
//! token instead of ~2,500).
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
use crate::{Cache, Error, LayerCache, Result};

/// What a run of layers returns: the hidden state `[batch, len, hidden]` and, for a verify pass,
/// the checkpoints of its GDN layers in layer order.
pub(crate) type SegmentOut = (Tensor, Vec<VerifyCheckpoints>);

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
        let cuda = device
            .as_cuda_device()
            .map_err(|_| Error::Input("CUDA graphs need a CUDA device".into()))?;
        let stream = cuda.cuda_stream();
        if cuda.is_event_tracking() || stream.cu_stream().is_null() {
            return Err(Error::Input(
                "this CUDA device cannot record graphs: make it with qwen36_model::graph_device".into(),
            ));
        }
        Ok(Self {
            stream,
            device: device.clone(),
            batch,
            segments: Vec::new(),
            bound_to: Vec::new(),
            steps: Vec::new(),
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
            self.bound_to = ids;
        }
        Ok(())
    }

    /// The graphs' attention inputs for a step like `fresh`: `fresh` copied into the buffers kept
    /// for its length (which it becomes on first use).
    pub(crate) fn step(&mut self, fresh: AttnStep) -> Result<AttnStep> {
        if let Some(kept) = self.steps.iter().find(|s| s.tokens() == fresh.tokens()) {
            kept.write_from(&fresh)?;
            return Ok(kept.clone());
        }
        self.steps.push(fresh.clone());
        Ok(fresh)
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
        for l in layers.clone() {
            match &mut cache.layers[l] {
                LayerCache::Gdn(s) => {
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
        let kept = warm_cps
            .iter()
            .map(|cp| Ok(cp.deep_copy()?))
            .collect::<Result<Vec<_>>>()?;
        // The capture below copies checkpoints into `kept`: run those copies once eagerly too.
        for (cp, dst) in warm_cps.iter().zip(&kept) {
            cp.write_into(dst)?;
        }
        drop(warm_cps);
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(candle_core::Error::wrap)?;
        let recorded = run(&input, cache).and_then(|(y, cps)| {
            output.slice_set(&y, 0, 0)?;
            for (cp, dst) in cps.iter().zip(&kept) {
                cp.write_into(dst)?;
            }
            Ok(cps.iter().map(|cp| cp.seen_before()).collect::<Vec<_>>())
        });
        let graph = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
        drop(htod_cache);
        let seen_before = recorded?;
        let graph = graph
            .map_err(candle_core::Error::wrap)?
            .ok_or_else(|| Error::Cache("CUDA graph capture recorded nothing".into()))?;
        // Capturing ran nothing: run the step now.
        graph.launch().map_err(candle_core::Error::wrap)?;
        let checkpoints = kept
            .iter()
            .zip(seen_before)
            .map(|(cp, n)| cp.rebased(n))
            .collect();
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
