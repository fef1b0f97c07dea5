//! The hybrid decoder stack: embedding → layers (GDN or gated attention, each + SwiGLU MLP) →
//! final (1+w) norm → lm_head.

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::Embedding;
use qwen36_gdn::{GatedDeltaNet, GdnGroup, GdnState, GdnWeights, GroupState, PoolStash, VerifyCheckpoints};
use qwen36_kernels::linear::{Linear, LinearWeight};
use qwen36_kernels::norm::{RmsNorm, Stream};
use qwen36_kernels::rope::RotaryEmbedding;

use crate::attention::{AttnPart, AttnStep};
use crate::paged::{Padding, PagedLayer, PoolShape};
use crate::{
    BatchOutput, Cache, Communicator, Config, Error, ForwardBatch, GatedAttention, LayerCache, LayerType,
    LoadOptions, PagedCache, Result, Weights,
};

/// SwiGLU MLP: `down(silu(gate(x)) ⊙ up(x))`.
#[derive(Debug, Clone)]
pub struct Mlp {
    /// `gate_proj` and `up_proj` stacked (`[2·intermediate, hidden]`): one read for both.
    gate_up: Linear,
    down: Linear,
}

impl Mlp {
    /// Loads `{prefix}{gate,up,down}_proj.weight` (`prefix` a full name ending in `mlp.`).
    pub fn load(cfg: &Config, w: &Weights, prefix: &str) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let lin = |name: &str, shape: [usize; 2]| -> Result<Linear> {
            let weight = w.linear(&format!("{prefix}{name}"), &shape, cfg.quantization.as_ref())?;
            Ok(Linear::from_weight(weight, None).with_policy(w.options().kernels))
        };
        Ok(Self {
            gate_up: Linear::fused(vec![lin("gate_proj", [i, h])?, lin("up_proj", [i, h])?])?,
            down: lin("down_proj", [h, i])?,
        })
    }

    /// The MLP as a tensor-parallel rank's part other than the first: its down projection gives
    /// a partial sum without the residual.
    pub fn partial_sum(self) -> Self {
        Self {
            down: self.down.partial_sum(),
            ..self
        }
    }

    /// `x: [..., hidden]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.down.forward(&self.gate_up.forward_swiglu(x)?)?)
    }

    /// The pre-norm residual block around the MLP: `x + forward(norm(x))` for the residual
    /// stream `x` (its normalisation taken from the stream when it comes with it), as the stream
    /// entering the block whose norm is `next`. The gate|up projection normalises `x` as it reads
    /// it and the down projection adds `x` as it writes, where the kernels allow (CUDA: one row;
    /// the residual add for a few rows too); otherwise separate passes, the add in `next`'s.
    pub fn forward_block(&self, x: &Stream, norm: &RmsNorm, next: Option<&RmsNorm>) -> Result<Stream> {
        let h = self.gate_up.forward_swiglu_stream(x, Some(norm))?;
        Ok(self.down.forward_add_norm(&h, &x.x, next)?)
    }
}

#[derive(Debug, Clone)]
enum Mixer {
    Gdn(GatedDeltaNet),
    Attention(GatedAttention),
}

#[derive(Debug, Clone)]
pub(crate) struct DecoderLayer {
    input_norm: RmsNorm,
    post_norm: RmsNorm,
    mixer: Mixer,
    mlp: Mlp,
    /// A tensor-parallel rank's group: the mixer's and the MLP's residual blocks are partial
    /// sums, added up over the ranks.
    comm: Option<Arc<dyn Communicator>>,
}

impl DecoderLayer {
    /// Loads `{prefix}{input_layernorm,post_attention_layernorm,linear_attn|self_attn,mlp}`;
    /// `prefix` is a full name prefix (main layers and the MTP layer share this).
    pub(crate) fn load(cfg: &Config, w: &Weights, prefix: &str, kind: LayerType) -> Result<Self> {
        let dtype = w.options().dtype;
        let norm = |name: &str| -> Result<RmsNorm> {
            let t = w.get(&format!("{prefix}{name}.weight"), &[cfg.hidden_size], dtype)?;
            Ok(RmsNorm::zero_centred(&t, cfg.rms_norm_eps)?.with_policy(w.options().kernels))
        };
        let mixer = match kind {
            LayerType::LinearAttention => {
                let gdn_cfg = cfg.gdn();
                let gdn_w = GdnWeights::load_with(
                    &gdn_cfg,
                    |name, shape| {
                        // A_log and dt_bias feed the f32 gate math; keep them f32 like vLLM.
                        let dt = if matches!(name, "A_log" | "dt_bias") {
                            DType::F32
                        } else {
                            dtype
                        };
                        w.get(&format!("{prefix}linear_attn.{name}"), shape, dt)
                    },
                    |name, shape| {
                        let module = name.strip_suffix(".weight").unwrap_or(name);
                        w.linear(
                            &format!("{prefix}linear_attn.{module}"),
                            shape,
                            cfg.quantization.as_ref(),
                        )
                    },
                )?;
                Mixer::Gdn(GatedDeltaNet::new(gdn_cfg, gdn_w)?.with_policy(w.options().kernels))
            }
            LayerType::FullAttention => {
                Mixer::Attention(GatedAttention::load(cfg, w, &format!("{prefix}self_attn."))?)
            }
        };
        let mut mlp = Mlp::load(cfg, w, &format!("{prefix}mlp."))?;
        let comm = w.communicator().cloned();
        // The first rank's parts add the residual stream; the others' are partial sums.
        let mut mixer = mixer;
        if comm.as_ref().is_some_and(|c| c.rank() > 0) {
            mlp = mlp.partial_sum();
            mixer = match mixer {
                Mixer::Gdn(g) => Mixer::Gdn(g.partial_sum()),
                Mixer::Attention(a) => Mixer::Attention(a.partial_sum()),
            };
        }
        Ok(Self {
            input_norm: norm("input_layernorm")?,
            post_norm: norm("post_attention_layernorm")?,
            mixer,
            mlp,
            comm,
        })
    }

    /// A residual block's output: on a tensor-parallel rank, the sum over the ranks (each rank's
    /// is a partial sum, so it comes without a normalisation: see [`Self::norms`]).
    fn reduce(&self, r: Stream) -> Result<Stream> {
        match &self.comm {
            Some(c) => Ok(Stream::new(c.all_reduce_sum(&r.x)?)),
            None => Ok(r),
        }
    }

    /// The norms whose passes close this layer's residual connections (the MLP's, then `next`,
    /// the norm after the layer), or none on a tensor-parallel rank, whose closes are partial
    /// sums until reduced.
    fn norms<'a>(&'a self, next: Option<&'a RmsNorm>) -> (Option<&'a RmsNorm>, Option<&'a RmsNorm>) {
        match self.comm {
            Some(_) => (None, None),
            None => (Some(&self.post_norm), next),
        }
    }

    /// True when a pass of `tokens` tokens through this layer can be recorded in a CUDA graph: GDN
    /// layers always, attention layers when they run the decode kernel.
    #[cfg(feature = "cuda")]
    pub(crate) fn graph_safe(&self, tokens: usize, dtype: DType, device: &Device) -> bool {
        // (A tensor-parallel rank's reductions, unless they are device work alone, synchronise
        // with the other ranks' threads.)
        if self.comm.as_ref().is_some_and(|c| !c.graph_safe()) {
            return false;
        }
        match &self.mixer {
            Mixer::Gdn(_) => true,
            Mixer::Attention(a) => a.uses_decode_kernel(tokens, dtype, device),
        }
    }

    /// The policies of every kernel-launching part (tests check that loading set them all).
    #[cfg(test)]
    pub(crate) fn policies(&self) -> Vec<qwen36_kernels::KernelPolicy> {
        let mut all = vec![*self.input_norm.policy(), *self.post_norm.policy()];
        all.extend([*self.mlp.gate_up.policy(), *self.mlp.down.policy()]);
        match &self.mixer {
            Mixer::Gdn(g) => all.push(*g.policy()),
            Mixer::Attention(a) => all.extend(a.policies()),
        }
        all
    }

    /// `x + mixer(norm(x))`, then `+ mlp(norm(·))`, as the stream entering the block whose norm
    /// is `next` (the next layer's input norm, or the final norm). With `verify`, a GDN layer runs
    /// token by token and returns its per-token checkpoints.
    pub(crate) fn forward(
        &self,
        x: &Stream,
        next: Option<&RmsNorm>,
        cache: &mut LayerCache,
        step: &AttnStep,
        verify: bool,
    ) -> Result<(Stream, Option<VerifyCheckpoints>)> {
        // r: the residual stream after the mixer's block.
        let norm = &self.input_norm;
        let (post, next) = self.norms(next);
        let (r, checkpoints) = match (&self.mixer, cache) {
            (Mixer::Gdn(g), LayerCache::Gdn(s)) if verify => {
                let (r, cp) = g.forward_verify_block(x, norm, post, s)?;
                (r, Some(cp))
            }
            (Mixer::Gdn(g), LayerCache::Gdn(s)) => (g.forward_block(x, norm, post, s)?, None),
            (Mixer::Attention(a), LayerCache::Attention(kv)) => {
                (a.forward_step_block(x, (norm, post), step, kv)?, None)
            }
            _ => return Err(Error::Cache("layer kinds of cache and model differ".into())),
        };
        let r = self.reduce(r)?;
        Ok((
            self.reduce(self.mlp.forward_block(&r, &self.post_norm, next)?)?,
            checkpoints,
        ))
    }
}

impl DecoderLayer {
    /// True for a gated-attention layer (no GDN state).
    #[cfg(feature = "cuda")]
    pub(crate) fn is_attention(&self) -> bool {
        matches!(self.mixer, Mixer::Attention(_))
    }

    /// [`Self::forward`] over a flat batch (`x: [1, rows, hidden]`) with pooled caches: a GDN
    /// layer runs decode and verify groups on their slots in place (with the pool's stash, its
    /// commits deferred: each slot first replays its accepted tokens, a verify stashes its own),
    /// and each prefill group from its slots' states gathered (written back after); an
    /// attention layer reads and writes paged K/V.
    pub(crate) fn forward_paged(
        &self,
        x: &Stream,
        next: Option<&RmsNorm>,
        pool: &PagedLayer,
        flat: &FlatInputs,
    ) -> Result<Stream> {
        let norm = &self.input_norm;
        let (post, next) = self.norms(next);
        let r = match (&self.mixer, pool) {
            (
                Mixer::Gdn(g),
                PagedLayer::Gdn {
                    conv,
                    recurrent,
                    stash,
                    ..
                },
            ) => {
                let mut own = flat
                    .groups
                    .iter()
                    .map(|g| {
                        if g.pooled() {
                            return Ok(None);
                        }
                        let c = conv.index_select(&g.slots, 0)?;
                        let r = recurrent.index_select(&g.slots, 0)?;
                        Ok(Some(GdnState::from_parts(c, r, 0)?))
                    })
                    .collect::<Result<Vec<_>>>()?;
                let mut groups: Vec<GdnGroup> = flat
                    .groups
                    .iter()
                    .zip(own.iter_mut())
                    .map(|(g, state)| GdnGroup {
                        batch: g.batch,
                        len: g.len,
                        state: match state {
                            Some(state) => GroupState::Own(state),
                            None => GroupState::Pooled {
                                conv,
                                recurrent,
                                slots: &g.slots,
                                stash: stash.as_ref().map(|(c, r)| PoolStash {
                                    conv: c,
                                    recurrent: r,
                                    replay: &g.replay,
                                }),
                            },
                        },
                        verify: g.verify,
                    })
                    .collect();
                let (r, _) = g.forward_groups_block(x, norm, post, &mut groups)?;
                for (g, state) in flat.groups.iter().zip(&own) {
                    let Some(state) = state else { continue };
                    for (i, &slot) in g.host_slots.iter().enumerate() {
                        let slot = slot as usize;
                        conv.slice_set(&state.conv().narrow(0, i, 1)?.contiguous()?, 0, slot)?;
                        let rec = state.recurrent().narrow(0, i, 1)?.contiguous()?;
                        recurrent.slice_set(&rec, 0, slot)?;
                    }
                }
                r
            }
            (Mixer::Attention(a), PagedLayer::Attention { k, v }) => {
                let rope = (&flat.cos, &flat.sin);
                let parts = (&flat.kv_rows, flat.attn.as_slice());
                a.forward_paged_block(x, (norm, post), rope, parts, (k, v))?
            }
            _ => {
                return Err(Error::Cache(
                    "layer kinds of the pool and the model differ".into(),
                ))
            }
        };
        let r = self.reduce(r)?;
        self.reduce(self.mlp.forward_block(&r, &self.post_norm, next)?)
    }
}

/// What every layer of one flat forward shares: each row's RoPE angles, the groups, each row's
/// KV pool row and the attention parts. Built from a [`ForwardBatch`] each step, or kept in
/// device buffers that a recorded CUDA graph reads.
#[derive(Debug, Clone)]
pub(crate) struct FlatInputs {
    pub(crate) cos: Tensor,
    pub(crate) sin: Tensor,
    pub(crate) groups: Vec<FlatGroup>,
    /// u32 `[rows]`: the pool row each row's key and value go to.
    pub(crate) kv_rows: Tensor,
    pub(crate) attn: Vec<AttnPart>,
}

/// One group of a flat forward: `batch` sequences of `len` tokens each, their rows consecutive.
#[derive(Debug, Clone)]
pub(crate) struct FlatGroup {
    pub(crate) batch: usize,
    pub(crate) len: usize,
    pub(crate) verify: bool,
    /// u32 `[batch]`: their GDN slots (a slot outside the pool: a padding row on CUDA).
    pub(crate) slots: Tensor,
    /// u32 `[batch]`: the stashed tokens each applies first (its deferred commit; 0 for padding
    /// and prefill rows).
    pub(crate) replay: Tensor,
    /// The same slots on the host (a prefill group writes its states back to them).
    pub(crate) host_slots: Vec<u32>,
}

impl FlatGroup {
    /// Runs on the pools in place (a decode or verify group); a prefill group gathers its states.
    fn pooled(&self) -> bool {
        self.verify || self.len == 1
    }
}

/// A loaded Qwen3.6 text model (no MTP head).
#[derive(Debug, Clone)]
pub struct Qwen36Model {
    cfg: Config,
    embed: Embedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Linear,
    rope: RotaryEmbedding,
    dtype: DType,
    device: Device,
    /// A tensor-parallel rank's group ([`Self::load_shard`]).
    comm: Option<Arc<dyn Communicator>>,
    /// Tests only: the fault its caches carry.
    #[cfg(feature = "fault-injection")]
    fault: Option<crate::Fault>,
}

impl Qwen36Model {
    /// The model with `fault` injected into every cache it makes (tests of the doctor only).
    #[cfg(feature = "fault-injection")]
    pub fn with_fault(mut self, fault: crate::Fault) -> Self {
        self.fault = Some(fault);
        self
    }

    /// Whether its steps may replay CUDA graphs: on a CUDA device, sharded only where the
    /// reductions are device work (NCCL, not `LocalComm`'s threads), and never with an injected
    /// fault (the faults act in the eager passes).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn can_record_graphs(&self) -> bool {
        #[cfg(feature = "fault-injection")]
        if self.fault.is_some() {
            return false;
        }
        self.device.is_cuda() && self.comm.as_ref().is_none_or(|c| c.graph_safe())
    }

    /// Loads `dir/config.json` and the checkpoint in `dir`.
    pub fn load(dir: impl AsRef<Path>, opts: LoadOptions) -> Result<Self> {
        let dir = dir.as_ref();
        let cfg = Config::from_file(dir.join("config.json"))?;
        let w = Weights::open(dir, opts)?;
        Self::from_weights(cfg, &w)
    }

    /// Loads rank `comm.rank()`'s part of the model in `dir` for tensor parallelism over
    /// `comm.size()` ranks ([`crate::Shard`] says what each holds; only that part is read).
    /// Every rank runs the same calls in step (one thread or process each); their outputs are
    /// equal. Refused, naming the config field, when the model does not split that way.
    pub fn load_shard(dir: impl AsRef<Path>, opts: LoadOptions, comm: Arc<dyn Communicator>) -> Result<Self> {
        let dir = dir.as_ref();
        let full = Config::from_file(dir.join("config.json"))?;
        let (cfg, w) = Weights::open(dir, opts)?.sharded(comm, &full)?;
        Self::from_weights(cfg, &w)
    }

    /// Builds the model from a parsed config and an opened checkpoint.
    pub fn from_weights(cfg: Config, w: &Weights) -> Result<Self> {
        let dtype = w.options().dtype;
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(Error::Dtype(dtype));
        }
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let policy = w.options().kernels;
        let norm = |name: &str| -> Result<RmsNorm> {
            Ok(RmsNorm::zero_centred(&w.lm(name, &[h])?, eps)?.with_policy(policy))
        };
        let embed_w = w.lm("embed_tokens.weight", &[cfg.vocab_size, h])?;
        let lm_head_w = if cfg.tie_word_embeddings {
            LinearWeight::Dense(embed_w.clone())
        } else {
            w.linear("lm_head", &[cfg.vocab_size, h], cfg.quantization.as_ref())?
        };
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| DecoderLayer::load(&cfg, w, &w.lm_name(&format!("layers.{i}.")), cfg.layer_types[i]))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            embed: Embedding::new(embed_w, h),
            norm: norm("norm.weight")?,
            lm_head: Linear::from_weight(lm_head_w, None).with_policy(policy),
            rope: RotaryEmbedding::new(cfg.rotary_dim(), cfg.rope_theta)?,
            layers,
            dtype,
            device: w.options().device.clone(),
            comm: w.communicator().cloned(),
            cfg,
            #[cfg(feature = "fault-injection")]
            fault: None,
        })
    }

    /// The tensor-parallel group this rank's part of the model belongs to, when sharded.
    pub fn communicator(&self) -> Option<&Arc<dyn Communicator>> {
        self.comm.as_ref()
    }

    /// The model's configuration (a rank's part's, when sharded).
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Activation dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Device holding the weights.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The token embedding table `[vocab, hidden]` (shared with the MTP head).
    pub fn embedding(&self) -> &Embedding {
        &self.embed
    }

    /// The rotary embedding of the attention layers (shared with the MTP head).
    pub fn rope(&self) -> &RotaryEmbedding {
        &self.rope
    }

    /// An empty cache for `batch` sequences.
    pub fn new_cache(&self, batch: usize) -> Result<Cache> {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(match &l.mixer {
                    Mixer::Gdn(g) => {
                        LayerCache::Gdn(g.new_state(batch, self.dtype, self.cfg.mamba_ssm_dtype)?)
                    }
                    Mixer::Attention(_) => LayerCache::Attention(Default::default()),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Cache {
            layers,
            batch,
            seq_len: 0,
            pending: None,
            #[cfg(feature = "fault-injection")]
            fault: self.fault,
        })
    }

    /// Empty pools for serving: `slots` GDN states (every GDN layer's conv window and f32
    /// recurrent state) and `blocks` KV blocks of `block_size` positions (every attention
    /// layer's keys and values).
    pub fn new_paged_cache(&self, slots: usize, blocks: usize, block_size: usize) -> Result<PagedCache> {
        let kinds = self.layers.iter().map(|l| match &l.mixer {
            Mixer::Gdn(g) => {
                let c = g.config();
                PoolShape::Gdn {
                    conv: vec![c.conv_dim(), c.conv_kernel - 1],
                    recurrent: vec![c.num_v_heads, c.k_head_dim, c.v_head_dim],
                    layer: Box::new(g.clone()),
                }
            }
            Mixer::Attention(_) => PoolShape::Attention {
                kv_heads: self.cfg.num_key_value_heads,
                head_dim: self.cfg.head_dim,
            },
        });
        #[allow(unused_mut)]
        let mut cache = PagedCache::zeros(kinds, (slots, blocks, block_size), self.dtype, &self.device)?;
        #[cfg(feature = "fault-injection")]
        {
            cache.fault = self.fault;
        }
        Ok(cache)
    }

    /// Runs every chunk of `batch` (prefill chunks, decode tokens, verifies) in one pass over
    /// the pools of `cache`, each from its slot's state and its blocks' K/V, and advances them.
    /// Each chunk's hidden states are what it gets run alone through a [`Cache`] (the same
    /// kernels for its token count, from the same state). Returns the final-norm hidden states
    /// of every row and, when a chunk verifies, what [`PagedCache::commit`] takes.
    pub fn forward_batch(&self, batch: &ForwardBatch, cache: &mut PagedCache) -> Result<BatchOutput> {
        self.check_batch(batch, cache)?;
        self.prepare_batch(batch, cache)?;
        // Decode steps' slots as they were, for a state that is never written back.
        #[cfg(feature = "fault-injection")]
        let stale: Vec<(u32, PagedCache)> = match self.fault {
            Some(crate::Fault::StaleState) => batch
                .chunks
                .iter()
                .filter(|c| c.tokens.len() == 1 && !c.verify)
                .map(|c| Ok((c.slot, cache.slot_copy(c.slot)?)))
                .collect::<Result<_>>()?,
            _ => Vec::new(),
        };
        let (flat, ids) = self.flat_inputs(batch, cache)?;
        let hidden = self.run_flat(&ids, &flat, cache)?;
        cache.passed(batch);
        #[cfg(feature = "fault-injection")]
        {
            for (slot, old) in stale {
                cache.restore_slot(slot, &old)?;
            }
            if self.fault == Some(crate::Fault::Bf16State) {
                for c in batch.chunks.iter().filter(|c| !c.verify) {
                    cache.round_slot_to_bf16(c.slot)?;
                }
            }
        }
        Ok(BatchOutput {
            hidden,
            pending: batch.pending(cache),
        })
    }

    /// Readies `cache` for a flat forward of `batch`: each chunk starting a sequence gets a
    /// zeroed slot, the stashes room for its verifies, and a prefill chunk's slot (which runs
    /// from its gathered state) its deferred commits applied.
    pub(crate) fn prepare_batch(&self, batch: &ForwardBatch, cache: &mut PagedCache) -> Result<()> {
        #[cfg(feature = "fault-injection")]
        let no_reset = self.fault == Some(crate::Fault::NoReset);
        #[cfg(not(feature = "fault-injection"))]
        let no_reset = false;
        for c in batch.chunks.iter().filter(|c| c.start == 0) {
            if no_reset {
                #[cfg(feature = "fault-injection")]
                cache.forget_only(c.slot);
            } else {
                cache.clear_slot(c.slot)?;
            }
        }
        let verify = batch
            .chunks
            .iter()
            .filter(|c| c.verify)
            .map(|c| c.tokens.len())
            .max();
        if let Some(len) = verify.filter(|&len| len > cache.stash_tokens()) {
            cache.reserve_stash(crate::paged::stash_tokens(len))?;
        }
        let gathered: Vec<u32> = batch
            .chunks
            .iter()
            .filter(|c| !c.verify && c.tokens.len() > 1)
            .map(|c| c.slot)
            .collect();
        cache.settle(&gathered)?;
        cache.passing(batch);
        Ok(())
    }

    /// The layers over flat inputs: `ids: [1, rows]` → the final-norm hidden states `[rows,
    /// hidden]`.
    pub(crate) fn run_flat(&self, ids: &Tensor, flat: &FlatInputs, cache: &PagedCache) -> Result<Tensor> {
        let mut x = Stream::new(self.embed.forward(ids)?);
        for (i, (layer, pool)) in self.layers.iter().zip(&cache.layers).enumerate() {
            x = layer.forward_paged(&x, Some(self.norm_after(i)), pool, flat)?;
        }
        Ok(x.normed_by(&self.norm)?.squeeze(0)?)
    }

    /// Whether layer `i` passes the next block's norm along with its output in a pass of `t`
    /// tokens: on CUDA not into or out of a layer that a graphed pass runs outside its graphs
    /// (`DecoderLayer::graph_safe`), whose segments pass the stream alone, so that a graphed and
    /// an eager pass give the same bits (a deferred norm rounds where the norm kernel does not).
    fn joins(&self, i: usize, t: usize) -> bool {
        #[cfg(feature = "cuda")]
        if self.device.is_cuda() {
            let safe = |l: usize| {
                self.layers
                    .get(l)
                    .is_none_or(|layer| layer.graph_safe(t, self.dtype, &self.device))
            };
            return safe(i) && safe(i + 1);
        }
        let _ = (i, t);
        true
    }

    /// The norm that opens the block after layer `i`: the next layer's input norm, or the final
    /// norm after the last.
    fn norm_after(&self, i: usize) -> &RmsNorm {
        self.layers.get(i + 1).map_or(&self.norm, |l| &l.input_norm)
    }

    /// Checks `batch` against `cache`, the vocabulary and the context.
    pub(crate) fn check_batch(&self, batch: &ForwardBatch, cache: &PagedCache) -> Result<()> {
        batch.check(cache, self.cfg.vocab_size, self.cfg.max_position_embeddings)?;
        if cache.layers.len() != self.layers.len() {
            return Err(Error::Cache(format!(
                "a pool of {} layers used with a model of {}",
                cache.layers.len(),
                self.layers.len()
            )));
        }
        Ok(())
    }

    /// True when the attention layers run a flat batch's sequences of `tokens` new tokens each
    /// as one paged decode launch (where the decode kernel takes them: CUDA, few tokens).
    pub(crate) fn paged_decode(&self, tokens: usize) -> bool {
        self.layers.iter().any(|l| match &l.mixer {
            Mixer::Attention(a) => a.uses_decode_kernel(tokens, self.dtype, &self.device),
            Mixer::Gdn(_) => false,
        })
    }

    /// What every layer of a flat forward over `batch` shares, and the batch's token ids
    /// `[1, rows]` in row order.
    pub(crate) fn flat_inputs(
        &self,
        batch: &ForwardBatch,
        cache: &PagedCache,
    ) -> Result<(FlatInputs, Tensor)> {
        let order: Vec<usize> = batch.row_order().collect();
        let ids: Vec<u32> = order
            .iter()
            .flat_map(|&i| batch.chunks[i].tokens.iter().copied())
            .collect();
        let positions = order.iter().flat_map(|&i| {
            let c = &batch.chunks[i];
            c.start..c.start + c.tokens.len()
        });
        let (cos, sin) = self.rope.cos_sin_at(positions, self.dtype, &self.device)?;
        let groups = batch
            .groups
            .iter()
            .map(|members| {
                let first = &batch.chunks[members[0]];
                let host_slots: Vec<u32> = members.iter().map(|&i| batch.chunks[i].slot).collect();
                let replay: Vec<u32> = host_slots.iter().map(|&s| cache.replay[s as usize]).collect();
                Ok(FlatGroup {
                    batch: members.len(),
                    len: first.tokens.len(),
                    verify: first.verify,
                    slots: Tensor::new(host_slots.as_slice(), &self.device)?,
                    replay: Tensor::new(replay.as_slice(), &self.device)?,
                    host_slots,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let decode = |t: usize| self.paged_decode(t);
        let (kv_rows, attn) = batch.attention_parts(cache, decode)?;
        let flat = FlatInputs {
            cos,
            sin,
            groups,
            kv_rows,
            attn,
        };
        Ok((flat, Tensor::new(ids.as_slice(), &self.device)?.unsqueeze(0)?))
    }

    /// The flat inputs of a one-kind `batch` (all verifies, or all single tokens, or any feeds
    /// of a layer without GDN state) padded to `seqs` sequences of `len` rows each (at least
    /// every chunk's tokens), placed as `padding` says, and block tables `width` wide (covering
    /// every row's position); and its token ids `[1, seqs · len]`. Padding rows of a chunk sit at
    /// the positions next to its tokens with no KV row (`u32::MAX`, past every pool); padding
    /// sequences take token 0 at position 0, a slot outside the pool, no KV row and length 0.
    /// Sequence `i`'s length is its last row's position + 1.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn padded_inputs(
        &self,
        batch: &ForwardBatch,
        cache: &PagedCache,
        (seqs, len, width): (usize, usize, usize),
        padding: Padding,
    ) -> Result<(FlatInputs, Tensor)> {
        let chunks = &batch.chunks;
        let verify = chunks[0].verify;
        let mut ids = vec![0u32; seqs * len];
        let mut positions = vec![0usize; seqs * len];
        let mut kv_rows = vec![u32::MAX; seqs * len];
        let mut tables = vec![0u32; seqs * width];
        let mut lens = vec![0u32; seqs];
        let mut slots = vec![cache.slots as u32; seqs];
        let mut replay = vec![0u32; seqs];
        for (i, c) in chunks.iter().enumerate() {
            let m = c.tokens.len();
            let first = batch
                .padded_start(i, len, padding)
                .filter(|&f| {
                    let bs = cache.block_size;
                    (c.start + m).div_ceil(bs) <= c.blocks.len()
                        && c.blocks.len() <= width
                        && (f + len).div_ceil(bs) <= width
                })
                .ok_or_else(|| Error::Input(format!("chunk {i} does not fit a padded step of {len} rows")))?;
            for (p, pos) in positions[i * len..(i + 1) * len].iter_mut().enumerate() {
                *pos = first + p;
            }
            let at = batch.padded_row(i, 0, len, padding);
            ids[at..at + m].copy_from_slice(&c.tokens);
            kv_rows[at..at + m].copy_from_slice(&cache.position_rows(&c.blocks, c.start..c.start + m));
            tables[i * width..i * width + c.blocks.len()].copy_from_slice(&c.blocks);
            lens[i] = (first + len) as u32;
            slots[i] = c.slot;
            replay[i] = cache.replay[c.slot as usize];
        }
        let dev = &self.device;
        let (cos, sin) = self.rope.cos_sin_at(positions, self.dtype, dev)?;
        let flat = FlatInputs {
            cos,
            sin,
            groups: vec![FlatGroup {
                batch: seqs,
                len,
                verify,
                slots: Tensor::new(slots.as_slice(), dev)?,
                replay: Tensor::new(replay.as_slice(), dev)?,
                host_slots: slots,
            }],
            kv_rows: Tensor::new(kv_rows.as_slice(), dev)?,
            attn: vec![AttnPart::Decode {
                batch: seqs,
                t: len,
                tables: Tensor::from_vec(tables, (seqs, width), dev)?,
                lens: Tensor::new(lens.as_slice(), dev)?,
                block_size: cache.block_size,
            }],
        };
        Ok((flat, Tensor::new(ids.as_slice(), dev)?.unsqueeze(0)?))
    }

    /// Checks ids `[batch, len]` (u32) against the vocabulary, the cache and the context.
    fn check_input(&self, ids: &Tensor, cache: &Cache) -> Result<(usize, usize)> {
        let (b, t) = ids
            .dims2()
            .map_err(|_| Error::Input(format!("token ids must be [batch, len], found {:?}", ids.dims())))?;
        if t == 0 {
            return Err(Error::Input("no tokens given".into()));
        }
        if ids.dtype() != DType::U32 {
            return Err(Error::Input(format!(
                "token ids must be u32, found {:?}",
                ids.dtype()
            )));
        }
        if cache.layers.len() != self.layers.len() || cache.batch != b {
            return Err(Error::Cache(format!(
                "cache for {} layers and batch {} used with a model of {} layers and batch {b}",
                cache.layers.len(),
                cache.batch,
                self.layers.len()
            )));
        }
        let max_id = ids.flatten_all()?.max(0)?.to_scalar::<u32>()?;
        if max_id as usize >= self.cfg.vocab_size {
            return Err(Error::Input(format!(
                "token id {max_id} is outside the vocabulary of {}",
                self.cfg.vocab_size
            )));
        }
        let needed = cache.seq_len + t;
        if needed > self.cfg.max_position_embeddings {
            return Err(Error::ContextOverflow {
                needed,
                max: self.cfg.max_position_embeddings,
            });
        }
        Ok((b, t))
    }

    /// Runs `ids: [batch, len]` (u32) after what `cache` holds; returns the final-norm hidden
    /// states `[batch, len, hidden]` (what lm_head and the MTP head read) and advances the cache.
    pub fn forward_hidden(&self, ids: &Tensor, cache: &mut Cache) -> Result<Tensor> {
        self.run(ids, cache, None)
    }

    /// Like [`Self::forward_hidden`], also returning the residual stream entering each layer and
    /// leaving the last one (HF's `output_hidden_states` minus its final-norm entry):
    /// `num_hidden_layers + 1` tensors `[batch, len, hidden]`.
    pub fn forward_hidden_states(&self, ids: &Tensor, cache: &mut Cache) -> Result<(Tensor, Vec<Tensor>)> {
        let mut states = Vec::with_capacity(self.layers.len() + 1);
        let h = self.run(ids, cache, Some(&mut states))?;
        Ok((h, states))
    }

    /// Speculative verify: runs `ids: [batch, k+1]` like [`Self::forward_hidden`] (the cache is left
    /// after all of them) but keeps per-token GDN checkpoints, so that [`Cache::commit`] can keep
    /// any prefix exactly. Returns the final-norm hidden states `[batch, k+1, hidden]`.
    pub fn forward_verify(&self, ids: &Tensor, cache: &mut Cache) -> Result<Tensor> {
        self.verify(ids, cache, None)
    }

    /// [`Self::forward_verify`], also returning the residual streams of
    /// [`Self::forward_hidden_states`]: what each layer gives a verified token, to compare with
    /// the same token decoded alone.
    pub fn forward_verify_states(&self, ids: &Tensor, cache: &mut Cache) -> Result<(Tensor, Vec<Tensor>)> {
        let mut states = Vec::with_capacity(self.layers.len() + 1);
        let h = self.verify(ids, cache, Some(&mut states))?;
        Ok((h, states))
    }

    fn verify(&self, ids: &Tensor, cache: &mut Cache, states: Option<&mut Vec<Tensor>>) -> Result<Tensor> {
        let base = cache.seq_len;
        let mut checkpoints = Vec::with_capacity(self.layers.len());
        let h = self.run_layers(ids, cache, states, Some(&mut checkpoints))?;
        cache.pending = Some(crate::cache::Pending {
            base,
            len: ids.dim(1)?,
            checkpoints,
        });
        Ok(h)
    }

    fn run(&self, ids: &Tensor, cache: &mut Cache, states: Option<&mut Vec<Tensor>>) -> Result<Tensor> {
        self.run_layers(ids, cache, states, None)
    }

    fn run_layers(
        &self,
        ids: &Tensor,
        cache: &mut Cache,
        mut states: Option<&mut Vec<Tensor>>,
        mut checkpoints: Option<&mut Vec<Option<VerifyCheckpoints>>>,
    ) -> Result<Tensor> {
        let (_, t) = self.check_input(ids, cache)?;
        cache.pending = None;
        // Token ids may come from the host whatever the model's device.
        let ids = ids.to_device(&self.device)?;
        let mut x = Stream::new(self.embed.forward(&ids)?);
        let step = self.attn_step(cache.seq_len, t)?;
        for (i, (layer, lc)) in self.layers.iter().zip(cache.layers.iter_mut()).enumerate() {
            if let Some(s) = states.as_deref_mut() {
                s.push(x.x.clone());
            }
            #[cfg(feature = "fault-injection")]
            let stale = match (cache.fault, &*lc) {
                (Some(crate::Fault::StaleState), LayerCache::Gdn(s)) if t == 1 => Some(
                    qwen36_gdn::GdnState::from_parts(s.conv().copy()?, s.recurrent().copy()?, s.seen())?,
                ),
                _ => None,
            };
            let next = Some(self.norm_after(i)).filter(|_| self.joins(i, t));
            let (y, cp) = layer.forward(&x, next, lc, &step, checkpoints.is_some())?;
            #[cfg(feature = "fault-injection")]
            if let (Some(old), LayerCache::Gdn(s)) = (stale, &mut *lc) {
                *s = old;
            }
            if let Some(c) = checkpoints.as_deref_mut() {
                c.push(cp);
            }
            #[cfg(feature = "fault-injection")]
            if let (Some(crate::Fault::Bf16State), LayerCache::Gdn(s)) = (cache.fault, &mut *lc) {
                let rounded = s.recurrent().to_dtype(DType::BF16)?.to_dtype(DType::F32)?;
                *s = qwen36_gdn::GdnState::from_parts(s.conv().clone(), rounded, s.seen())?;
            }
            x = y;
        }
        cache.seq_len += t;
        if let Some(s) = states {
            s.push(x.x.clone());
        }
        Ok(x.normed_by(&self.norm)?)
    }

    /// The attention layers' shared inputs for `tokens` new positions after `start`.
    pub(crate) fn attn_step(&self, start: usize, tokens: usize) -> Result<AttnStep> {
        AttnStep::new(&self.rope, start, tokens, self.dtype, &self.device)
    }

    /// [`Self::forward_hidden`] for one-token steps (`ids: [batch, 1]`) replayed from a CUDA graph
    /// of the layer stack that `graph` records on first use (see [`DecodeGraph`]). Same kernels as
    /// the eager path; the cache's GDN states switch to in-place updates and its KV buffers are
    /// reserved ahead.
    ///
    /// [`DecodeGraph`]: crate::DecodeGraph
    #[cfg(feature = "cuda")]
    pub fn forward_hidden_graphed(
        &self,
        ids: &Tensor,
        cache: &mut Cache,
        graph: &mut crate::DecodeGraph,
    ) -> Result<Tensor> {
        if ids.dims() != [graph.batch(), 1] {
            return Err(Error::Input(format!(
                "a graphed step takes ids [{}, 1], found {:?}",
                graph.batch(),
                ids.dims()
            )));
        }
        Ok(self.run_graphed(ids, cache, graph, false)?.0)
    }

    /// [`Self::forward_verify`] replayed from a CUDA graph of the layer stack (one per verify
    /// length, recorded on first use). [`Cache::commit`] works as after the eager pass.
    #[cfg(feature = "cuda")]
    pub fn forward_verify_graphed(
        &self,
        ids: &Tensor,
        cache: &mut Cache,
        graph: &mut crate::DecodeGraph,
    ) -> Result<Tensor> {
        let base = cache.seq_len;
        let (h, checkpoints) = self.run_graphed(ids, cache, graph, true)?;
        cache.pending = Some(crate::cache::Pending {
            base,
            len: ids.dim(1)?,
            checkpoints,
        });
        Ok(h)
    }

    /// The layer loop of the graphed passes: each run of graph-safe layers (GDN layers, attention
    /// layers that use the decode kernel: normally all) through `graph`, any other layer eagerly.
    /// Returns the final-norm hidden states and, per layer, the verify checkpoints.
    #[cfg(feature = "cuda")]
    fn run_graphed(
        &self,
        ids: &Tensor,
        cache: &mut Cache,
        graph: &mut crate::DecodeGraph,
        verify: bool,
    ) -> Result<(Tensor, Vec<Option<VerifyCheckpoints>>)> {
        let (b, t) = self.check_input(ids, cache)?;
        if b != graph.batch() {
            return Err(Error::Input(format!(
                "graphs recorded for batch {} used with batch {b}",
                graph.batch()
            )));
        }
        // Recorded graphs write into the KV buffers they saw: make room before binding.
        let kv_shape = (b, self.cfg.num_key_value_heads, self.cfg.head_dim);
        for lc in cache.layers.iter_mut() {
            if let LayerCache::Attention(kv) = lc {
                kv.reserve(cache.seq_len + t, kv_shape, self.dtype, &self.device)?;
            }
        }
        graph.bind(cache)?;
        cache.pending = None;
        let step = graph.step(self.attn_step(cache.seq_len, t)?)?;
        let ids = ids.to_device(&self.device)?;
        let mut x = self.embed.forward(&ids)?;
        let graphable = |l: usize| self.layers[l].graph_safe(t, self.dtype, &self.device);
        let n = self.layers.len();
        let mut checkpoints = Vec::with_capacity(n);
        let mut i = 0;
        while i < n {
            let end = (i..n).find(|&l| !graphable(l)).unwrap_or(n);
            // (Segments pass the stream alone: a layer's output carries no normalisation past
            // a segment's end.)
            if end == i {
                let x_in = Stream::new(x);
                let (y, cp) = self.layers[i].forward(&x_in, None, &mut cache.layers[i], &step, verify)?;
                (x, i) = (y.x, i + 1);
                checkpoints.push(cp);
                continue;
            }
            let (y, cps) = graph.run_segment(i..end, verify, &x, cache, |x, cache| {
                let mut x = Stream::new(x.clone());
                let mut cps = Vec::new();
                for l in i..end {
                    let next = (l + 1 < end).then(|| self.norm_after(l));
                    let (y, cp) = self.layers[l].forward(&x, next, &mut cache.layers[l], &step, verify)?;
                    x = y;
                    cps.extend(cp);
                }
                Ok((x.x, cps))
            })?;
            // The segment's checkpoints are its GDN layers', in order.
            let mut cps = cps.into_iter();
            for l in i..end {
                let gdn = matches!(self.layers[l].mixer, Mixer::Gdn(_));
                checkpoints.push(if gdn && verify { cps.next() } else { None });
            }
            (x, i) = (y, end);
        }
        cache.seq_len += t;
        Ok((self.norm.forward(&x)?, checkpoints))
    }

    /// The output projection `[vocab, hidden]` (the embedding when tied).
    pub fn lm_head(&self) -> &Linear {
        &self.lm_head
    }

    /// lm_head over hidden states `[..., hidden]`; logits in f32.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        logits_of(&self.lm_head, hidden)
    }

    /// Greedy token ids of hidden states `[..., hidden]`: the argmax of their logits, u32 `[...]`,
    /// left on the device (ties to the lowest id).
    pub fn greedy_ids(&self, hidden: &Tensor) -> Result<Tensor> {
        greedy_of(&self.lm_head, hidden)
    }

    /// Logits for every new position, `[batch, len, vocab]` f32.
    pub fn forward(&self, ids: &Tensor, cache: &mut Cache) -> Result<Tensor> {
        let h = self.forward_hidden(ids, cache)?;
        self.logits(&h)
    }

    /// Logits for the last new position only, `[batch, vocab]` f32 (prefill without a
    /// `[len, vocab]` matrix).
    pub fn forward_last(&self, ids: &Tensor, cache: &mut Cache) -> Result<Tensor> {
        let h = self.forward_hidden(ids, cache)?;
        let t = h.dim(1)?;
        self.logits(&h.narrow(1, t - 1, 1)?.squeeze(1)?)
    }
}

/// An output projection's logits for hidden states `[..., hidden]`, in f32 (lm_head, or the rows
/// of a draft vocabulary).
pub(crate) fn logits_of(head: &Linear, hidden: &Tensor) -> Result<Tensor> {
    Ok(head.forward(hidden)?.to_dtype(DType::F32)?)
}

/// The argmax of [`logits_of`] over the last dim, u32, on the device (ties to the lowest index;
/// under the head's kernel policy), taken on the logits in the activation dtype: widening to
/// f32 is exact and keeps their order, so the ids are the same without the cast's pass.
pub(crate) fn greedy_of(head: &Linear, hidden: &Tensor) -> Result<Tensor> {
    let logits = head.forward(hidden)?;
    Ok(qwen36_kernels::argmax::argmax_last_dim(&logits, head.policy())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Greedy ids taken on bf16 logits are the argmax of the f32 logits, ties (two equal rows of
    /// the head, so equal logits) to the lowest index.
    #[test]
    fn greedy_ids_on_half_logits_equal_those_on_f32() -> Result<()> {
        let dev = Device::Cpu;
        let w = qwen36_testutil::randn(711, 0.5, (64, 16), &dev)?;
        // Rows 9 and 30 both four times the first row 30: equal logits that win, tied to 9.
        let big = (w.narrow(0, 30, 1)? * 4.0)?;
        let w = Tensor::cat(
            &[
                &w.narrow(0, 0, 9)?,
                &big,
                &w.narrow(0, 10, 20)?,
                &big,
                &w.narrow(0, 31, 33)?,
            ],
            0,
        )?;
        let head = Linear::new(w.to_dtype(DType::BF16)?, None);
        let hidden = qwen36_testutil::randn(712, 1.0, (5, 16), &dev)?.to_dtype(DType::BF16)?;
        let got = greedy_of(&head, &hidden)?.to_vec1::<u32>()?;
        let want = logits_of(&head, &hidden)?
            .argmax(candle_core::D::Minus1)?
            .to_vec1::<u32>()?;
        assert_eq!(got, want);
        assert!(got.contains(&9), "{got:?}");
        assert!(!got.contains(&30), "{got:?}");
        Ok(())
    }

    /// The MLP's residual block is `x + forward(norm(x))`: on the CPU the same ops, equal bits; a
    /// stream that comes with its normalisation enters as that, and with a next norm the output
    /// comes with its own.
    #[test]
    fn mlp_block_is_the_residual_around_the_normalised_mlp() -> Result<()> {
        let dev = Device::Cpu;
        let (h, i) = (16, 24);
        let mlp = Mlp {
            gate_up: Linear::new(qwen36_testutil::randn(701, 0.25, (2 * i, h), &dev)?, None),
            down: Linear::new(qwen36_testutil::randn(702, 0.2, (h, i), &dev)?, None),
        };
        let norm = RmsNorm::zero_centred(&qwen36_testutil::randn(703, 0.3, h, &dev)?, 1e-6)?;
        let x = qwen36_testutil::randn(704, 1.0, (2, 3, h), &dev)?;
        let want = (&x + mlp.forward(&norm.forward(&x)?)?)?;
        let got = mlp.forward_block(&Stream::new(x.clone()), &norm, None)?;
        assert_eq!(qwen36_testutil::max_abs_diff(&got.x, &want), 0.0);
        assert!(got.normed.is_none());
        let next = RmsNorm::zero_centred(&qwen36_testutil::randn(705, 0.3, h, &dev)?, 1e-6)?;
        let other = next.forward(&x)?;
        let want = (&x + mlp.forward(&other)?)?;
        let input = Stream::with_normed(x.clone(), other);
        let got = mlp.forward_block(&input, &norm, Some(&next))?;
        assert_eq!(qwen36_testutil::max_abs_diff(&got.x, &want), 0.0);
        let normed = got.normed.expect("the next norm's pass adds the residual");
        assert_eq!(qwen36_testutil::max_abs_diff(&normed, &next.forward(&want)?), 0.0);
        Ok(())
    }

    /// The policy of `LoadOptions::kernels` reaches every layer of the model, its MTP head and a
    /// draft vocabulary's head: a load site that forgot it would run the default kernels.
    #[test]
    fn every_layer_runs_under_the_loaded_policy() -> Result<()> {
        use qwen36_kernels::{ChunkPath, KernelPolicy, SkinnyPath};
        let cfg = Config::from_file(qwen36_testutil::bundled_dir().join("config.json"))?;
        let policy = KernelPolicy {
            chunk: ChunkPath::CudaCores(16),
            skinny: SkinnyPath::Matmul,
            fp8_gemm: qwen36_kernels::Fp8GemmPath::Dequantize,
            decode_merge: qwen36_kernels::DecodeMergePath::Kernels,
            pdl: false,
            tile_prefetch: false,
            defer_norm: false,
        };
        let w = Weights::random(LoadOptions {
            kernels: policy,
            ..LoadOptions::default()
        });
        let model = Qwen36Model::from_weights(cfg.clone(), &w)?;
        let mut all = vec![*model.norm.policy(), *model.lm_head.policy()];
        for layer in &model.layers {
            all.extend(layer.policies());
        }
        let head = crate::MtpHead::load(&cfg, &w)?;
        all.extend(head.policies());
        all.push(*crate::DraftVocab::new(&model, &[0, 5, 9])?.policy());
        // At least the two norms, the MLP's two projections and the mixer per layer.
        assert!(all.len() > 5 * cfg.num_hidden_layers, "{} parts", all.len());
        assert!(all.iter().all(|p| p == &policy), "{all:?}");
        Ok(())
    }

    /// Random FP8 weights (the benchmarks' `--fp8`) make a model whose projections are FP8 where
    /// Qwen's checkpoints have them (not the GDN's in_proj_a/b or lm_head) and whose logits are
    /// finite.
    #[test]
    fn random_fp8_weights_make_a_working_model() -> Result<()> {
        let cfg = Config::from_file(qwen36_testutil::bundled_dir().join("config.json"))?;
        let w = Weights::random_fp8(LoadOptions::default(), [128, 128]);
        let model = Qwen36Model::from_weights(cfg, &w)?;
        assert!(!model.lm_head.is_fp8());
        let gdn = model
            .layers
            .iter()
            .find_map(|l| match &l.mixer {
                Mixer::Gdn(g) => Some(g.clone()),
                Mixer::Attention(_) => None,
            })
            .expect("a GDN layer");
        assert!(gdn.projections_fp8(), "qkv|z and out_proj in FP8");
        let ids = Tensor::new(&[[1u32, 2, 3]], model.device())?;
        let logits = model.forward(&ids, &mut model.new_cache(1)?)?;
        assert!(logits
            .to_dtype(DType::F32)?
            .sum_all()?
            .to_scalar::<f32>()?
            .is_finite());
        Ok(())
    }

    /// On the CPU every residual connection closes in the next block's norm pass: each layer's
    /// output comes normalised by the norm given for after it, the bits of that norm's own pass,
    /// and the stack's streams are those of layers run with every norm separate.
    #[test]
    fn layers_hand_the_next_block_its_normalised_input() -> Result<()> {
        let cfg = Config::from_file(qwen36_testutil::bundled_dir().join("config.json"))?;
        let model = Qwen36Model::from_weights(cfg, &Weights::random(LoadOptions::default()))?;
        let ids = Tensor::new(&[[1u32, 2, 3, 4]], model.device())?;
        let x0 = model.embed.forward(&ids)?;
        let (mut fused, mut plain) = (Stream::new(x0.clone()), Stream::new(x0));
        let (mut ca, mut cb) = (model.new_cache(1)?, model.new_cache(1)?);
        let step = model.attn_step(0, 4)?;
        let diff = qwen36_testutil::max_abs_diff;
        for (i, layer) in model.layers.iter().enumerate() {
            let next = model.norm_after(i);
            (fused, _) = layer.forward(&fused, Some(next), &mut ca.layers[i], &step, false)?;
            (plain, _) = layer.forward(&plain, None, &mut cb.layers[i], &step, false)?;
            assert_eq!(diff(&fused.x, &plain.x), 0.0, "layer {i}");
            assert!(plain.normed.is_none(), "layer {i}");
            let normed = fused.normed.clone().expect("closed in the next norm's pass");
            assert_eq!(diff(&normed, &next.forward(&plain.x)?), 0.0, "layer {i}");
        }
        Ok(())
    }

    /// The bundled model and its MTP head on the test device (f32), pools of 3 slots.
    fn bundled_pools() -> Result<(Qwen36Model, crate::MtpHead)> {
        let dir = qwen36_testutil::bundled_dir();
        let opts = LoadOptions {
            device: qwen36_testutil::test_device(),
            ..LoadOptions::default()
        };
        let model = Qwen36Model::load(&dir, opts.clone())?;
        let head = crate::MtpHead::load_dir(&dir, model.config(), opts)?;
        Ok((model, head))
    }

    fn chunk(slot: u32, start: usize, tokens: Vec<u32>, verify: bool) -> crate::SeqChunk {
        crate::SeqChunk {
            slot,
            start,
            tokens,
            // Slot s holds blocks s, s + 3, s + 6, ... (interleaved with the others').
            blocks: (0..6).map(|j| 3 * j + slot).collect(),
            verify,
        }
    }

    /// Every attention layer's K and V pools of `a` and `b`, the largest difference.
    fn kv_pools_diff(a: &PagedCache, b: &PagedCache) -> f32 {
        let mut worst = 0f32;
        for (x, y) in a.layers.iter().zip(&b.layers) {
            if let (PagedLayer::Attention { k, v }, PagedLayer::Attention { k: k2, v: v2 }) = (x, y) {
                worst = worst
                    .max(qwen36_testutil::max_abs_diff(k, k2))
                    .max(qwen36_testutil::max_abs_diff(v, v2));
            }
        }
        worst
    }

    /// Verifies of 3, 1 and 2 tokens run as one step of 3 rows each, padded after their tokens
    /// (as a recorded graph runs them), give the unpadded forward's rows and K/V (padding rows
    /// write none), and leave the GDN states as it does: the decode step after the same commits
    /// gives the same rows (padding whose stashed tokens were replayed would move them).
    #[test]
    fn verifies_padded_after_their_tokens_equal_the_unpadded_step() -> Result<()> {
        let (model, _) = bundled_pools()?;
        let new_pool = || model.new_paged_cache(3, 18, 4);
        let (mut plain, mut padded) = (new_pool()?, new_pool()?);
        let prompts: [&[u32]; 3] = [&[5, 9, 14, 2, 7], &[3, 8], &[11, 4, 6, 1]];
        let prefill = ForwardBatch::new(
            (0..3)
                .map(|i| chunk(i as u32, 0, prompts[i].to_vec(), false))
                .collect(),
        );
        model.forward_batch(&prefill, &mut plain)?;
        model.forward_batch(&prefill, &mut padded)?;
        let drafts: [&[u32]; 3] = [&[21, 30, 12], &[17], &[40, 2]];
        let verify = ForwardBatch::new(
            (0..3)
                .map(|i| chunk(i as u32, prompts[i].len(), drafts[i].to_vec(), true))
                .collect(),
        );
        assert_eq!(verify.groups.len(), 3, "three lengths, three groups unpadded");
        let want = model.forward_batch(&verify, &mut plain)?;
        model.check_batch(&verify, &padded)?;
        model.prepare_batch(&verify, &mut padded)?;
        let (flat, ids) = model.padded_inputs(&verify, &padded, (3, 3, 8), Padding::After)?;
        assert_eq!(ids.dims(), [1, 9]);
        let out = model.run_flat(&ids, &flat, &padded)?;
        padded.passed(&verify);
        let got = verify.unpadded(&out, 3, Padding::After)?;
        let tol = 1e-5;
        let err = qwen36_testutil::max_row_rel_err(&got, &want.hidden);
        assert!(err <= tol, "verify rows: {err:e}");
        let kv = kv_pools_diff(&plain, &padded);
        assert!(kv <= 1e-4, "K/V pools: {kv:e}");
        // Keep 2 of sequence 0's tokens, 1 of 1's, 2 of 2's; then one decode step each.
        let keeps = [(0, 2), (1, 1), (2, 2)];
        plain.commit_many(want.pending.as_ref().expect("verifies pend"), &keeps)?;
        let pending = verify.pending(&padded).expect("verifies pend");
        padded.commit_many(&pending, &keeps)?;
        let decode = ForwardBatch::new(
            (0..3)
                .map(|i| {
                    chunk(
                        i as u32,
                        prompts[i].len() + keeps[i].1,
                        vec![33 + i as u32],
                        false,
                    )
                })
                .collect(),
        );
        let want = model.forward_batch(&decode, &mut plain)?;
        let got = model.forward_batch(&decode, &mut padded)?;
        let err = qwen36_testutil::max_row_rel_err(&got.hidden, &want.hidden);
        assert!(err <= tol, "the decode step after: {err:e}");
        Ok(())
    }

    /// MTP feeds of 1, 3 and 2 pairs run as one draft step of 3 rows each, padded before their
    /// pairs, give the unpadded step's rows (each chunk's last row is its sequence's last), and
    /// write the same K/V (padding rows that wrote theirs over the positions before a chunk
    /// would move the pools and the next step's rows).
    #[test]
    fn draft_feeds_padded_before_their_pairs_equal_the_unpadded_step() -> Result<()> {
        let (model, head) = bundled_pools()?;
        let h = model.config().hidden_size;
        let dev = model.device().clone();
        let new_pool = || head.new_paged_cache(&model, 3, 18, 4);
        let (mut plain, mut padded) = (new_pool()?, new_pool()?);
        let states = |seed: u64, rows: usize| qwen36_testutil::randn(seed, 1.0, (rows, h), &dev);
        let first = ForwardBatch::new((0..3).map(|i| chunk(i, 0, vec![4 + i, 9, 2], false)).collect());
        let x = states(1, 9)?;
        head.forward_batch(&model, &x, &first, &mut plain, 0)?;
        head.forward_batch(&model, &x, &first, &mut padded, 0)?;
        let feeds: [&[u32]; 3] = [&[7], &[12, 5, 30], &[8, 19]];
        let mixed = ForwardBatch::new(
            (0..3)
                .map(|i| chunk(i, 3, feeds[i as usize].to_vec(), false))
                .collect(),
        );
        let x = states(2, 6)?;
        let want = head.forward_batch(&model, &x, &mixed, &mut plain, 0)?;
        let (flat, ids) = model.padded_inputs(&mixed, &padded, (3, 3, 8), Padding::Before)?;
        let xp = mixed.padded(&x, 3, 3, Padding::Before)?;
        assert_eq!(xp.dims(), [9, h]);
        let out = head.forward_flat(&model, &xp, &ids, &flat, &padded, 0)?;
        let got = mixed.unpadded(&out, 3, Padding::Before)?;
        let tol = 1e-5;
        let err = qwen36_testutil::max_row_rel_err(&got, &want);
        assert!(err <= tol, "feed rows: {err:e}");
        let kv = kv_pools_diff(&plain, &padded);
        assert!(kv <= 1e-4, "K/V pools: {kv:e}");
        // Each sequence's last row is its padded step's last row.
        for i in 0..3 {
            let last = mixed.rows(i).end - 1;
            let err =
                qwen36_testutil::max_row_rel_err(&out.narrow(0, 3 * i + 2, 1)?, &want.narrow(0, last, 1)?);
            assert!(err <= tol, "sequence {i}'s last row: {err:e}");
        }
        let next = ForwardBatch::new(
            (0..3)
                .map(|i| chunk(i, 3 + feeds[i as usize].len(), vec![15], false))
                .collect(),
        );
        let x = states(3, 3)?;
        let want = head.forward_batch(&model, &x, &next, &mut plain, 0)?;
        let got = head.forward_batch(&model, &x, &next, &mut padded, 0)?;
        let err = qwen36_testutil::max_row_rel_err(&got, &want);
        assert!(err <= tol, "the step after: {err:e}");
        Ok(())
    }

    /// A padded step refuses a chunk its rows cannot place: more tokens than rows, padding
    /// before position 0, or tables too narrow for its positions.
    #[test]
    fn padded_inputs_refuse_what_does_not_fit() -> Result<()> {
        let (model, _) = bundled_pools()?;
        let pool = model.new_paged_cache(3, 18, 4)?;
        let batch = |start: usize, n: usize| {
            let mut c = chunk(0, start, vec![1; n], false);
            c.blocks.truncate(2);
            ForwardBatch::new(vec![c])
        };
        let fits = |b: &ForwardBatch, len: usize, width: usize, p: Padding| {
            model.padded_inputs(b, &pool, (1, len, width), p).is_ok()
        };
        assert!(fits(&batch(2, 2), 3, 8, Padding::Before));
        assert!(
            !fits(&batch(0, 2), 3, 8, Padding::Before),
            "padding before position 0"
        );
        assert!(!fits(&batch(2, 4), 3, 8, Padding::After), "more tokens than rows");
        // Positions 4..8 need two blocks of 4; a row of 8 more needs three.
        assert!(fits(&batch(4, 4), 4, 2, Padding::After));
        assert!(
            !fits(&batch(4, 2), 5, 2, Padding::After),
            "padding past the table"
        );
        assert!(!fits(&batch(2, 1), 1, 1, Padding::After), "blocks past the table");
        assert!(!fits(&batch(4, 3), 2, 2, Padding::Before), "more pairs than rows");
        assert!(
            !fits(&batch(6, 4), 4, 4, Padding::After),
            "tokens past the chunk's blocks"
        );
        Ok(())
    }
}
