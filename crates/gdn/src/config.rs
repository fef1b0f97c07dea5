//! Sizes of one GDN layer.

/// Sizes of one GDN layer (Qwen3.6-27B: hidden 5120, Hk 16, Hv 48, dk = dv = 128, kernel 4).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GdnConfig {
    /// Model width (input and output of the layer).
    pub hidden_size: usize,
    /// Key/query heads `Hk`.
    pub num_k_heads: usize,
    /// Value heads `Hv` (a multiple of `Hk`; value head `h` reads key head `h / (Hv/Hk)`).
    pub num_v_heads: usize,
    /// Key/query head dim `dk`.
    pub k_head_dim: usize,
    /// Value head dim `dv`.
    pub v_head_dim: usize,
    /// Causal conv kernel width `K` (the conv state keeps `K - 1` inputs).
    pub conv_kernel: usize,
    /// Epsilon of the gated RMSNorm.
    pub rms_norm_eps: f64,
}

impl GdnConfig {
    /// `Hk · dk`: width of the q block and of the k block.
    pub fn key_dim(&self) -> usize {
        self.num_k_heads * self.k_head_dim
    }
    /// `Hv · dv`: width of the v block, of z and of the layer's read-out.
    pub fn value_dim(&self) -> usize {
        self.num_v_heads * self.v_head_dim
    }
    /// Channels of the short convolution: `[q | k | v]`.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
}
