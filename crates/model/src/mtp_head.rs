//! The Multi-Token-Prediction head (docs/MODEL.md §4.1): `mtp.fc`, two pre-fc norms, one (or more)
//! gated-attention decoder layers with their own KV cache, `mtp.norm`; embedding and lm_head are
//! the main model's.
//!
//! Pairing: the MTP KV entry at position `i` holds `(h_i, x_{i+1})`: the target's final-norm
//! hidden state at `i` and the token that followed it. Its output at `i` predicts `x_{i+2}`.

use candle_core::{Module, Tensor, D};
use qwen36_kernels::linear::Linear;
use qwen36_kernels::norm::{RmsNorm, Stream};

use crate::attention::AttnStep;
use crate::model::{DecoderLayer, FlatInputs};
use crate::paged::PoolShape;
use crate::{
    Config, Error, ForwardBatch, KvCache, LayerCache, LayerType, PagedCache, Qwen36Model, Result, Weights,
};

/// The MTP head of a Qwen3.6 checkpoint.
#[derive(Debug, Clone)]
pub struct MtpHead {
    fc: Linear,
    norm_embedding: RmsNorm,
    norm_hidden: RmsNorm,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
}

impl MtpHead {
    /// The policies of every kernel-launching part (tests check that loading set them all).
    #[cfg(test)]
    pub(crate) fn policies(&self) -> Vec<qwen36_kernels::KernelPolicy> {
        let mut all = vec![*self.fc.policy(), *self.norm.policy()];
        all.extend([*self.norm_embedding.policy(), *self.norm_hidden.policy()]);
        for layer in &self.layers {
            all.extend(layer.policies());
        }
        all
    }
}

/// `ids` (u32 `[chunks]`) as the token ids `[1, chunks]` of a batch of one-token chunks (one
/// group: its rows in chunk order); an error naming the mismatch otherwise.
pub(crate) fn one_token_ids(ids: &Tensor, batch: &ForwardBatch) -> Result<Tensor> {
    let n = batch.chunks().len();
    if batch.total_rows() != n || ids.dims() != [n] || ids.dtype() != candle_core::DType::U32 {
        return Err(Error::Input(format!(
            "draft ids {:?} {:?} for {n} chunks of {} rows: one u32 id per one-token chunk",
            ids.dims(),
            ids.dtype(),
            batch.total_rows()
        )));
    }
    Ok(ids.unsqueeze(0)?)
}

/// A draft vocabulary: the token ids a draft step may propose, with their rows of lm_head. A
/// draft step then reads `len() / vocab_size` of lm_head (2.5 GB of its 3.4 GB per step at the
/// 27B shapes for the full vocabulary). Drafts only propose: the target verifies every token over
/// its full vocabulary, so the output is unchanged; a token outside the set is never drafted,
/// which lowers acceptance when the target picks one.
#[derive(Debug, Clone)]
pub struct DraftVocab {
    /// u32 `[n]`, ascending, on the model's device.
    ids: Tensor,
    /// lm_head's rows `ids`: `[n, hidden]`.
    lm_head: Linear,
}

impl DraftVocab {
    /// The ids `ids` of `model`'s vocabulary (sorted, duplicates dropped), with a copy of their
    /// lm_head rows (`n · hidden` elements on the model's device: 335 MB for 32768 ids at the 27B
    /// shapes in bf16); [`Error::Input`] when there are none or one is outside the vocabulary.
    pub fn new(model: &Qwen36Model, ids: &[u32]) -> Result<Self> {
        let vocab = model.config().vocab_size;
        let mut ids = ids.to_vec();
        ids.sort_unstable();
        ids.dedup();
        match ids.last() {
            None => return Err(Error::Input("empty draft vocabulary".into())),
            Some(&last) if last as usize >= vocab => {
                return Err(Error::Input(format!(
                    "draft vocabulary id {last} is outside the vocabulary of {vocab} tokens"
                )))
            }
            Some(_) => {}
        }
        let ids = Tensor::new(ids.as_slice(), model.device())?;
        let head = model.lm_head();
        let lm_head = head.select_rows(&ids, model.dtype())?;
        Ok(Self { ids, lm_head })
    }

    /// The policy of its head's kernels.
    #[cfg(test)]
    pub(crate) fn policy(&self) -> &qwen36_kernels::KernelPolicy {
        self.lm_head.policy()
    }

    /// The first `n` ids of the vocabulary plus `extra` (e.g. the stop ids). A byte-level BPE
    /// vocabulary lists its tokens in merge order, most frequent in the tokenizer's corpus first,
    /// so this is a data-free stand-in for the `n` most frequent tokens.
    pub fn first(model: &Qwen36Model, n: usize, extra: &[u32]) -> Result<Self> {
        let n = n.min(model.config().vocab_size) as u32;
        let ids: Vec<u32> = (0..n).chain(extra.iter().copied()).collect();
        Self::new(model, &ids)
    }

    /// Number of ids.
    pub fn len(&self) -> usize {
        self.ids.elem_count()
    }

    /// Never true (a draft vocabulary has at least one id).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The ids, u32 `[n]` ascending.
    pub fn ids(&self) -> &Tensor {
        &self.ids
    }

    /// Greedy ids among the vocabulary's of hidden states `[..., hidden]`, as
    /// [`Qwen36Model::greedy_ids`] over these rows only (f32 logits, ties to the lowest id), left
    /// on the device.
    pub fn greedy_ids(&self, hidden: &Tensor) -> Result<Tensor> {
        let at = crate::model::greedy_of(&self.lm_head, hidden)?;
        Ok(self
            .ids
            .index_select(&at.flatten_all()?, 0)?
            .reshape(at.shape())?)
    }
}

/// The MTP head's KV caches (one per MTP layer), `len` positions each.
#[derive(Debug, Clone)]
pub struct MtpCache {
    pub(crate) layers: Vec<LayerCache>,
}

impl MtpCache {
    /// Positions held (pairs fed).
    pub fn len(&self) -> usize {
        match self.layers.first() {
            Some(LayerCache::Attention(kv)) => kv.len(),
            _ => 0,
        }
    }

    /// True when no pair was fed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keeps the first `len` positions (drops draft-chain entries after a verify).
    pub fn truncate(&mut self, len: usize) {
        for l in &mut self.layers {
            if let LayerCache::Attention(kv) = l {
                kv.truncate(len);
            }
        }
    }

    /// Forgets everything (a new sequence).
    pub fn reset(&mut self) {
        self.truncate(0);
    }

    /// The KV cache of MTP layer `layer`.
    fn kv(&mut self, layer: usize) -> Result<&mut KvCache> {
        match self.layers.get_mut(layer) {
            Some(LayerCache::Attention(kv)) => Ok(kv),
            _ => Err(Error::Cache(format!(
                "the MTP cache has no attention layer {layer}"
            ))),
        }
    }

    /// Positions held by MTP layer `layer` (0 when it has none).
    #[cfg(feature = "cuda")]
    pub(crate) fn len_of(&self, layer: usize) -> usize {
        match self.layers.get(layer) {
            Some(LayerCache::Attention(kv)) => kv.len(),
            _ => 0,
        }
    }

    /// Sets MTP layer `layer`'s valid length (after a graph's warm-up run).
    #[cfg(feature = "cuda")]
    pub(crate) fn set_len_of(&mut self, layer: usize, len: usize) {
        if let Ok(kv) = self.kv(layer) {
            kv.set_len(len);
        }
    }

    /// Counts `new` positions of MTP layer `layer` as written (a graph replay wrote them).
    #[cfg(feature = "cuda")]
    pub(crate) fn advance(&mut self, layer: usize, new: usize) {
        if let Ok(kv) = self.kv(layer) {
            kv.advance(new);
        }
    }
}

impl MtpHead {
    /// True when the checkpoint carries an MTP head.
    pub fn present(w: &Weights) -> bool {
        w.contains("mtp.fc.weight")
    }

    /// Loads `mtp.*`; [`Error::NoMtpHead`] when the checkpoint has none.
    pub fn load(cfg: &Config, w: &Weights) -> Result<Self> {
        if !Self::present(w) {
            return Err(Error::NoMtpHead);
        }
        let (h, dt, eps) = (cfg.hidden_size, w.options().dtype, cfg.rms_norm_eps);
        let policy = w.options().kernels;
        let norm = |name: &str| -> Result<RmsNorm> {
            Ok(RmsNorm::zero_centred(&w.get(name, &[h], dt)?, eps)?.with_policy(policy))
        };
        let n = cfg.mtp_num_hidden_layers.max(1);
        let layers = (0..n)
            .map(|i| DecoderLayer::load(cfg, w, &format!("mtp.layers.{i}."), LayerType::FullAttention))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            fc: Linear::from_weight(w.linear("mtp.fc", &[h, 2 * h], cfg.quantization.as_ref())?, None)
                .with_policy(policy),
            norm_embedding: norm("mtp.pre_fc_norm_embedding.weight")?,
            norm_hidden: norm("mtp.pre_fc_norm_hidden.weight")?,
            layers,
            norm: norm("mtp.norm.weight")?,
        })
    }

    /// Loads the head of the checkpoint in `dir` (config parsed by the caller).
    pub fn load_dir(
        dir: impl AsRef<std::path::Path>,
        cfg: &Config,
        opts: crate::LoadOptions,
    ) -> Result<Self> {
        Self::load(cfg, &Weights::open(dir, opts)?)
    }

    /// [`Self::load_dir`] for rank `comm.rank()` of a tensor-parallel group: its part of the
    /// head's decoder layer (as [`Qwen36Model::load_shard`] shards the model's), the rest whole.
    pub fn load_dir_shard(
        dir: impl AsRef<std::path::Path>,
        opts: crate::LoadOptions,
        comm: std::sync::Arc<dyn crate::Communicator>,
    ) -> Result<Self> {
        let dir = dir.as_ref();
        let full = Config::from_file(dir.join("config.json"))?;
        let (cfg, w) = Weights::open(dir, opts)?.sharded(comm, &full)?;
        Self::load(&cfg, &w)
    }

    /// An empty cache.
    pub fn new_cache(&self) -> MtpCache {
        MtpCache {
            layers: self
                .layers
                .iter()
                .map(|_| LayerCache::Attention(KvCache::new()))
                .collect(),
        }
    }

    /// Feeds pairs at positions `cache.len()..`: `hidden: [batch, len, hidden]` (target final-norm
    /// hidden states, or the previous MTP output when chaining drafts) and `next_ids: [batch, len]`
    /// (u32, the token after each position; on any device). Draft step `step` uses MTP layer
    /// `step % layers`. Returns the post-`mtp.norm` states `[batch, len, hidden]`; `model.logits` scores them.
    pub fn forward(
        &self,
        model: &Qwen36Model,
        hidden: &Tensor,
        next_ids: &Tensor,
        cache: &mut MtpCache,
        step: usize,
    ) -> Result<Tensor> {
        let attn = self.step_attn(model, cache, step, hidden.dim(1)?)?;
        self.forward_with(model, hidden, next_ids, cache, step, &attn)
    }

    /// Empty pools of the head's KV for serving: `blocks` blocks of `block_size` positions per
    /// MTP layer, indexed by the same block tables as the target's KV (a sequence's MTP entry at
    /// position `i` is its pair `(h_i, x_{i+1})`); `slots` only bounds the sequences of a batch.
    pub fn new_paged_cache(
        &self,
        model: &Qwen36Model,
        slots: usize,
        blocks: usize,
        block_size: usize,
    ) -> Result<PagedCache> {
        let cfg = model.config();
        let kinds = self.layers.iter().map(|_| PoolShape::Attention {
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
        });
        PagedCache::zeros(kinds, (slots, blocks, block_size), model.dtype(), model.device())
    }

    /// [`Self::forward`] over a flat batch of several sequences with paged KV: chunk `i` of
    /// `batch` feeds pairs at MTP positions `start..` with `tokens` the next ids and `hidden`'s
    /// rows `batch.rows(i)` (`hidden: [rows, hidden]`) the states. Returns the post-`mtp.norm`
    /// states `[rows, hidden]`.
    pub fn forward_batch(
        &self,
        model: &Qwen36Model,
        hidden: &Tensor,
        batch: &ForwardBatch,
        cache: &mut PagedCache,
        step: usize,
    ) -> Result<Tensor> {
        self.forward_batch_ids(model, hidden, None, batch, cache, step)
    }

    /// [`Self::forward_batch`]; with `ids` (u32 `[chunks]` on the device), chunks of one token
    /// each take those ids instead of their own tokens.
    pub(crate) fn forward_batch_ids(
        &self,
        model: &Qwen36Model,
        hidden: &Tensor,
        ids: Option<&Tensor>,
        batch: &ForwardBatch,
        cache: &mut PagedCache,
        step: usize,
    ) -> Result<Tensor> {
        let cfg = model.config();
        batch.check(cache, cfg.vocab_size, cfg.max_position_embeddings)?;
        if cache.layers.len() != self.layers.len() || hidden.dims() != [batch.total_rows(), cfg.hidden_size] {
            return Err(Error::Cache(format!(
                "an MTP pool of {} layers and hidden states {:?} used with a head of {} layers \
                 and a batch of {} rows",
                cache.layers.len(),
                hidden.dims(),
                self.layers.len(),
                batch.total_rows()
            )));
        }
        let (flat, own) = model.flat_inputs(batch, cache)?;
        let ids = match ids {
            None => own,
            Some(ids) => one_token_ids(ids, batch)?,
        };
        self.forward_flat(model, hidden, &ids, &flat, cache, step)
    }

    /// The head over flat inputs (`ids: [1, rows]`, `hidden: [rows, hidden]`): the post-`mtp.norm`
    /// states `[rows, hidden]`.
    pub(crate) fn forward_flat(
        &self,
        model: &Qwen36Model,
        hidden: &Tensor,
        ids: &Tensor,
        flat: &FlatInputs,
        cache: &PagedCache,
        step: usize,
    ) -> Result<Tensor> {
        let e = self.norm_embedding.forward(&model.embedding().forward(ids)?)?;
        let hn = self
            .norm_hidden
            .forward(&hidden.to_dtype(e.dtype())?.unsqueeze(0)?)?;
        let x = self.fc.forward(&Tensor::cat(&[&e, &hn], D::Minus1)?)?; // embedding first
        let i = self.layer_index(step);
        let y = self.layers[i].forward_paged(&Stream::new(x), Some(&self.norm), &cache.layers[i], flat)?;
        Ok(y.normed_by(&self.norm)?.squeeze(0)?)
    }

    /// One greedy draft step: [`Self::forward`], then the post-norm state of the last position
    /// `[batch, 1, hidden]` and its greedy token, u32 `[batch, 1]` (over `vocab` when given, else
    /// the whole vocabulary), both left on the device.
    pub fn draft(
        &self,
        model: &Qwen36Model,
        hidden: &Tensor,
        next_ids: &Tensor,
        cache: &mut MtpCache,
        step: usize,
        vocab: Option<&DraftVocab>,
    ) -> Result<(Tensor, Tensor)> {
        let attn = self.step_attn(model, cache, step, hidden.dim(1)?)?;
        self.draft_with(model, hidden, next_ids, cache, step, &attn, vocab)
    }

    /// The attention inputs of draft step `step` feeding `len` positions after those its MTP layer
    /// holds.
    fn step_attn(
        &self,
        model: &Qwen36Model,
        cache: &mut MtpCache,
        step: usize,
        len: usize,
    ) -> Result<AttnStep> {
        model.attn_step(cache.kv(self.layer_index(step))?.len(), len)
    }

    /// [`Self::draft`] with the attention inputs `attn` (which must start at the layer's length).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn draft_with(
        &self,
        model: &Qwen36Model,
        hidden: &Tensor,
        next_ids: &Tensor,
        cache: &mut MtpCache,
        step: usize,
        attn: &AttnStep,
        vocab: Option<&DraftVocab>,
    ) -> Result<(Tensor, Tensor)> {
        let d = self.forward_with(model, hidden, next_ids, cache, step, attn)?;
        let last = d.narrow(1, d.dim(1)? - 1, 1)?;
        let token = match vocab {
            Some(v) => v.greedy_ids(&last)?,
            None => model.greedy_ids(&last)?,
        };
        Ok((last, token))
    }

    /// The MTP layer that draft step `step` runs.
    pub(crate) fn layer_index(&self, step: usize) -> usize {
        step % self.layers.len()
    }

    /// True when the head layer of draft step `step` keeps no GDN state (an attention layer).
    #[cfg(feature = "cuda")]
    pub(crate) fn attention_only(&self, step: usize) -> bool {
        self.layers[self.layer_index(step)].is_attention()
    }

    /// True when `cache` has one pool layer per head layer.
    #[cfg(feature = "cuda")]
    pub(crate) fn fits_pool(&self, cache: &PagedCache) -> bool {
        cache.layers.len() == self.layers.len()
    }

    /// True when MTP layer `layer` can run a `len`-token step inside a CUDA graph.
    #[cfg(feature = "cuda")]
    pub(crate) fn graph_safe(&self, layer: usize, len: usize, model: &Qwen36Model) -> bool {
        self.layers[layer].graph_safe(len, model.dtype(), model.device())
    }

    fn forward_with(
        &self,
        model: &Qwen36Model,
        hidden: &Tensor,
        next_ids: &Tensor,
        cache: &mut MtpCache,
        step: usize,
        attn: &AttnStep,
    ) -> Result<Tensor> {
        let next_ids = next_ids.to_device(model.device())?;
        let e = self
            .norm_embedding
            .forward(&model.embedding().forward(&next_ids)?)?;
        let hn = self.norm_hidden.forward(&hidden.to_dtype(e.dtype())?)?;
        let x = self.fc.forward(&Tensor::cat(&[&e, &hn], D::Minus1)?)?; // embedding first
        let i = self.layer_index(step);
        cache.kv(i)?; // a typed error, not an index panic, for a cache of another head
        let (y, _) = self.layers[i].forward(
            &Stream::new(x),
            Some(&self.norm),
            &mut cache.layers[i],
            attn,
            false,
        )?;
        Ok(y.normed_by(&self.norm)?)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::*;
    use crate::paged::SeqChunk;

    /// One u32 id per one-token chunk is taken as `[1, chunks]`; a chunk of two tokens, another
    /// count of ids or another dtype is an input error.
    #[test]
    fn one_token_ids_take_one_u32_per_one_token_chunk() -> Result<()> {
        let chunk = |slot: u32, tokens: Vec<u32>| SeqChunk {
            slot,
            start: 3,
            tokens,
            blocks: vec![0],
            verify: false,
        };
        let two = ForwardBatch::new(vec![chunk(0, vec![5]), chunk(1, vec![6])]);
        let ids = |n: usize, dtype: DType| Tensor::zeros(n, dtype, &Device::Cpu);
        assert_eq!(one_token_ids(&ids(2, DType::U32)?, &two)?.dims(), [1, 2]);
        let longer = ForwardBatch::new(vec![chunk(0, vec![5, 7])]);
        for (ids, batch) in [
            (ids(1, DType::U32)?, &longer),
            (ids(3, DType::U32)?, &two),
            (ids(2, DType::F32)?, &two),
        ] {
            assert!(
                matches!(one_token_ids(&ids, batch), Err(Error::Input(_))),
                "{ids:?}"
            );
        }
        Ok(())
    }
}
