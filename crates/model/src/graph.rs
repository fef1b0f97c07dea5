//! CUDA-graph decode (feature `cuda`): one-token steps and speculative verify passes with every run
//! of consecutive GDN layers replayed from a recorded graph.
//!
//! A graph bakes in device addresses and shapes. GDN layers fit: their state has a fixed size and
//! is written in place ([`GdnState::set_in_place`]), and nothing in them depends on the position.
//! Attention layers do (the KV length and the RoPE angle change every step), so they run eagerly
//! between the replays. With Qwen3.6-27B's 3:1 layout that is 16 graph launches and 16 eager
//! attention layers per token instead of ~2,500 eager launches: the host stays ahead of the GPU.
//!
//! [`GdnState::set_in_place`]: qwen36_gdn::GdnState::set_in_place

use std::ops::Range;
use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{sys, CudaGraph, CudaStream};
use candle_core::{Device, Tensor, TensorId};
use qwen36_gdn::GdnState;

use qwen36_gdn::VerifyCheckpoints;

use crate::{Cache, Error, LayerCache, Result};

/// What a run of layers returns: the hidden state `[batch, len, hidden]` and, for a verify pass,
/// the checkpoints of its GDN layers in layer order.
pub(crate) type SegmentOut = (Tensor, Vec<VerifyCheckpoints>);

/// Recorded graphs for steps of one batch size (one graph per run of GDN layers and per step
/// shape: a one-token decode, a verify of `len` tokens), bound to one [`Cache`] (its GDN state
/// buffers). Reusing it with another cache re-records; dropping it frees the graphs.
pub struct DecodeGraph {
    stream: Arc<CudaStream>,
    device: Device,
    batch: usize,
    segments: Vec<Segment>,
    /// The state tensors the graphs were recorded with (conv, recurrent per GDN layer).
    bound_to: Vec<TensorId>,
}

/// One run of consecutive GDN layers for one step shape: `output = layers(input)`, each
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
    /// recorded with other buffers.
    pub(crate) fn bind(&mut self, cache: &mut Cache) -> Result<()> {
        let mut ids = Vec::new();
        for lc in cache.layers.iter_mut() {
            if let LayerCache::Gdn(s) = lc {
                s.set_in_place()?;
                ids.extend([s.conv().id(), s.recurrent().id()]);
            }
        }
        if ids != self.bound_to {
            self.segments.clear();
            self.bound_to = ids;
        }
        Ok(())
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
                if let LayerCache::Gdn(s) = lc {
                    if let Some(cp) = kept.next() {
                        checkpoints.push(cp.rebased(s.seen()));
                    }
                    s.advance(tokens);
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
        // That run also gives the shapes of the checkpoint buffers.
        let mut originals = Vec::new();
        for l in layers.clone() {
            if let LayerCache::Gdn(s) = &mut cache.layers[l] {
                let mut scratch = GdnState::from_parts(s.conv().copy()?, s.recurrent().copy()?, s.seen())?;
                scratch.set_in_place()?;
                originals.push((l, std::mem::replace(s, scratch)));
            }
        }
        let warm = run(&input, cache);
        for (l, s) in originals {
            cache.layers[l] = LayerCache::Gdn(s);
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
