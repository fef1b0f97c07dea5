//! How many slots and blocks a memory budget holds, from the model's config alone.

use candle_core::DType;
use qwen36_kernels::delta_rule::GdnHeads;
use qwen36_model::{Config, LayerType};

use crate::{Error, Result};

/// Bytes of one state slot and of one KV block of a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateBytes {
    /// One sequence's GDN state: every GDN layer's f32 recurrent state `[Hv, dk, dv]` and its conv
    /// window `[conv_dim, K − 1]` in the activation dtype.
    pub slot: u64,
    /// One block: `block_size` positions of K and V `[kv_heads, head_dim]` in the activation dtype,
    /// in every attention layer and the MTP head's layers (when `mtp`).
    pub block: u64,
}

impl StateBytes {
    /// The sizes for `cfg` with activations in `dtype`, blocks of `block_size` positions, and the
    /// MTP head's KV when `mtp`.
    pub fn of(cfg: &Config, dtype: DType, block_size: usize, mtp: bool) -> Self {
        let count = |kind| cfg.layer_types.iter().filter(|&&t| t == kind).count() as u64;
        let (gdn, attention) = (count(LayerType::LinearAttention), count(LayerType::FullAttention));
        let act = dtype.size_in_bytes() as u64;
        // The shapes GdnState allocates: [Hv, dk, dv] f32 and [conv_dim, K − 1].
        let g = cfg.gdn();
        let state = (g.num_v_heads * g.k_head_dim * g.v_head_dim) as u64 * 4;
        let window = (g.conv_dim() * g.conv_kernel.saturating_sub(1)) as u64;
        let slot = gdn * (state + window * act);
        let kv_layers = attention + if mtp { cfg.mtp_num_hidden_layers as u64 } else { 0 };
        let per_position = kv_layers * 2 * (cfg.num_key_value_heads * cfg.head_dim) as u64 * act;
        Self {
            slot,
            block: per_position * block_size as u64,
        }
    }
}

impl StateBytes {
    /// The sizes with each slot's stash of deferred commits for verifies of up to `verify`
    /// tokens (speculative decoding; the stash is made at the first verify), at its CUDA size
    /// (the larger of the two layouts).
    pub fn with_stash(self, cfg: &Config, dtype: DType, verify: usize) -> Self {
        let count = cfg
            .layer_types
            .iter()
            .filter(|&&t| t == LayerType::LinearAttention)
            .count() as u64;
        let g = cfg.gdn();
        let tokens = qwen36_model::stash_tokens(verify);
        let heads = GdnHeads {
            k_heads: g.num_k_heads,
            v_heads: g.num_v_heads,
            k_dim: g.k_head_dim,
            v_dim: g.v_head_dim,
        };
        let conv = (tokens * g.conv_dim() * dtype.size_in_bytes()) as u64;
        let state = qwen36_kernels::delta_rule::stash_bytes(heads, dtype, tokens, true);
        Self {
            slot: self.slot + count * (conv + state),
            ..self
        }
    }
}

/// Pool sizes that fit a memory budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolSizes {
    /// State slots: one per sequence that may run at once.
    pub slots: usize,
    /// KV blocks, shared by all sequences.
    pub blocks: usize,
}

impl PoolSizes {
    /// `max_seqs` slots and as many blocks as the rest of `budget` bytes holds; an error when the
    /// slots alone do not fit, or when what is left does not hold one block per sequence.
    pub fn from_budget(bytes: StateBytes, budget: u64, max_seqs: usize) -> Result<Self> {
        let slots = bytes.slot.checked_mul(max_seqs as u64);
        let left = slots
            .and_then(|s| budget.checked_sub(s))
            .ok_or_else(|| Error::Budget {
                budget,
                what: format!("{max_seqs} state slots of {} bytes", bytes.slot),
            })?;
        let blocks = left
            .checked_div(bytes.block)
            .unwrap_or(u64::MAX)
            .min(u32::MAX as u64) as usize;
        if blocks < max_seqs.max(1) {
            return Err(Error::Budget {
                budget,
                what: format!(
                    "{max_seqs} state slots of {} bytes and a KV block of {} bytes per sequence",
                    bytes.slot, bytes.block
                ),
            });
        }
        Ok(Self {
            slots: max_seqs,
            blocks,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen36_27b() -> Config {
        let path = qwen36_testutil::workspace_dir().join("examples/configs/qwen3.6-27b.json");
        Config::from_file(path).expect("the 27B config")
    }

    /// Qwen3.6-27B: a state snapshot is 146.8 MiB (48 GDN layers of a 48 × 128 × 128 f32 state and
    /// a 10240 × 3 bf16 window), the figure the prefix-cache issue plans with; K and V take 64 KiB
    /// per position (16 attention layers, 4 KV heads of 256) and 68 KiB with the MTP layer.
    #[test]
    fn sizes_of_the_27b_model() {
        let cfg = qwen36_27b();
        let b = StateBytes::of(&cfg, DType::BF16, 16, false);
        assert_eq!(b.slot, 48 * (48 * 128 * 128 * 4 + 10240 * 3 * 2));
        assert_eq!(format!("{:.1}", b.slot as f64 / (1 << 20) as f64), "146.8");
        assert_eq!(b.block, 16 * 64 * 1024);
        assert_eq!(StateBytes::of(&cfg, DType::BF16, 1, true).block, 68 * 1024);
        // The recurrent state stays f32 whatever the activations are; the window follows them.
        assert_eq!(
            StateBytes::of(&cfg, DType::F32, 16, false).slot,
            48 * (48 * 128 * 128 * 4 + 10240 * 3 * 4)
        );
        // Speculation (k = 3) adds each GDN layer's stash for 4 tokens: per (value head, tile of
        // 32 state columns) a record of 128 + 32 + 2 f32, and the conv's 10240 raw inputs.
        assert_eq!(
            b.with_stash(&cfg, DType::BF16, 4).slot - b.slot,
            48 * 4 * (48 * 4 * (128 + 32 + 2) * 4 + 10240 * 2)
        );
    }

    /// The slots come first, the blocks take the rest; a budget that cannot hold the slots, or a
    /// block per sequence after them, is refused naming the sizes.
    #[test]
    fn budgets_hold_the_slots_then_blocks() -> Result<()> {
        let bytes = StateBytes { slot: 100, block: 30 };
        assert_eq!(
            PoolSizes::from_budget(bytes, 1000, 4)?,
            PoolSizes { slots: 4, blocks: 20 }
        );
        let e = PoolSizes::from_budget(bytes, 399, 4).unwrap_err().to_string();
        assert!(e.contains("4 state slots of 100 bytes"), "{e}");
        let e = PoolSizes::from_budget(bytes, 510, 4).unwrap_err().to_string();
        assert!(e.contains("a KV block of 30 bytes per sequence"), "{e}");
        assert!(PoolSizes::from_budget(bytes, 520, 4).is_ok());
        Ok(())
    }
}
