//! What the benchmark examples share: the bytes and FLOPs a forward must move or do, and the
//! hardware limits measured in the same run (copy bandwidth, GEMM rate, the memory pool's peak).
//! Included by `examples/bench.rs` and `examples/bench_serving.rs` with `#[path]`.
#![allow(dead_code)]

use std::time::Instant;

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use qwen36::kernels::KernelPolicy;
use qwen36::model::{LayerType, Weights};
use qwen36::{Config, LoadOptions};

/// The Qwen3.6-27B text config (docs/MODEL.md §1.2), the benchmarks' default model; built in, so
/// the binaries run from any directory (e.g. on a GPU machine).
pub const QWEN36_27B: &str = include_str!("../configs/qwen3.6-27b.json");

/// The model a benchmark runs (flattened into its arguments).
#[derive(clap::Args, Debug)]
pub struct ModelArgs {
    /// config.json to build with random weights (default: Qwen3.6-27B's,
    /// examples/configs/qwen3.6-27b.json, built in).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// A checkpoint to load instead of random weights: a directory, or a Hugging Face model id
    /// in the local cache.
    #[arg(long, conflicts_with = "config")]
    pub model: Option<String>,
    /// Keep only the first N decoder layers (quick runs; the results then describe that model).
    #[arg(long, value_parser = crate::load::at_least_one)]
    pub layers: Option<usize>,
    /// Activation and weight dtype: bf16, f16 or f32.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Run on the first CUDA GPU (needs --features cuda).
    #[arg(long)]
    pub cuda: bool,
    /// Random weights in FP8 (e4m3, 128×128 block scales) where Qwen's FP8 checkpoints have
    /// them (every projection but the GDN's in_proj_a/b, lm_head and mtp.fc); `--dtype` sets the
    /// activations.
    #[arg(long, conflicts_with = "model")]
    pub fp8: bool,
}

/// What a benchmark runs on: the device (`--cuda`: the first GPU, made for CUDA graphs; a
/// tensor-parallel rank's own device), the dtype, and the checkpoint of `--model`, or random
/// weights for the config of `--config` (default Qwen3.6-27B's), cut to its first `--layers`
/// decoder layers; with `comm`, the rank's shard of them and its config.
pub fn setup(
    args: &ModelArgs,
    kernels: KernelPolicy,
    comm: Option<std::sync::Arc<dyn qwen36::model::Communicator>>,
) -> anyhow_like::Result<(Device, DType, Config, Weights)> {
    let (model, config, layers, dtype, cuda) = (
        args.model.as_deref(),
        args.config.as_deref(),
        args.layers,
        args.dtype.as_str(),
        args.cuda,
    );
    let device = match comm.as_ref().and_then(|c| c.device()) {
        Some(d) => d,
        None if cuda => qwen36::model::cuda_device(0)?,
        None => Device::Cpu,
    };
    let dtype = match dtype {
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        "f32" => DType::F32,
        other => return Err(format!("unknown dtype {other} (bf16, f16 or f32)").into()),
    };
    let opts = LoadOptions {
        dtype,
        device: device.clone(),
        check_finite: false,
        kernels,
        progress: crate::load::progress(),
    };
    let (mut cfg, weights) = match model {
        Some(model) => {
            let dir = qwen36::resolve_model(model)?;
            (
                Config::from_file(dir.join("config.json"))?,
                Weights::open(&dir, opts)?,
            )
        }
        None => {
            let cfg = match config {
                Some(path) => Config::from_file(path)?,
                None => Config::from_json(&serde_json::from_str(QWEN36_27B)?)?,
            };
            if !device.is_cpu() {
                // Repeatable weights on a GPU (candle's CPU generator cannot be seeded); every
                // rank draws the same tensors in the same order, so the replicated ones agree.
                device.set_seed(0)?;
            }
            let weights = if args.fp8 {
                Weights::random_fp8(opts, [128, 128])
            } else {
                Weights::random(opts)
            };
            (cfg, weights)
        }
    };
    if let Some(n) = layers {
        cfg.num_hidden_layers = n.min(cfg.num_hidden_layers);
        cfg.layer_types.truncate(cfg.num_hidden_layers);
    }
    match comm {
        Some(comm) => {
            let (rank_cfg, weights) = weights.sharded(comm, &cfg)?;
            Ok((device, dtype, rank_cfg, weights))
        }
        None => Ok((device, dtype, cfg, weights)),
    }
}

/// Bytes and FLOPs one forward must move or do, from the config alone.
pub struct Cost {
    /// Linear weights read by one forward of the main model (embedding excluded, lm_head included).
    pub weight_bytes: f64,
    /// Weights of one MTP draft step: the MTP layer, its fc, and lm_head.
    pub draft_bytes: f64,
    /// lm_head's bytes per vocabulary row (a draft vocabulary reads fewer rows).
    pub lm_head_row_bytes: f64,
    /// Linear parameters applied to every prompt token (no lm_head: prefill scores one position).
    pub prefill_params: f64,
    pub elt: f64,
    pub cfg: Config,
}

impl Cost {
    /// The costs of `cfg` with weights of `elt` bytes, or with FP8 projections (one byte each,
    /// scales negligible; lm_head, the GDN's in_proj_a/b and mtp.fc stay `elt`) when `fp8`.
    pub fn with_fp8(cfg: &Config, elt: usize, fp8: bool) -> Self {
        let mut c = Self::new(cfg, elt);
        if fp8 {
            let h = cfg.hidden_size as f64;
            let g = cfg.gdn();
            let n_gdn = cfg
                .layer_types
                .iter()
                .filter(|t| matches!(t, LayerType::LinearAttention))
                .count() as f64;
            let lm_head = cfg.vocab_size as f64 * h;
            let dense_in_layers = n_gdn * 2.0 * g.num_v_heads as f64 * h;
            let layers = c.weight_bytes / c.elt - lm_head;
            c.weight_bytes = (layers - dense_in_layers) + (dense_in_layers + lm_head) * c.elt;
            let fc = 2.0 * h * h;
            let mtp_layer = c.draft_bytes / c.elt - lm_head - fc;
            c.draft_bytes = mtp_layer + (fc + lm_head) * c.elt;
        }
        c
    }

    pub fn new(cfg: &Config, elt: usize) -> Self {
        let h = cfg.hidden_size as f64;
        let g = cfg.gdn();
        let (hv, dv, conv) = (g.num_v_heads as f64, g.v_head_dim as f64, g.conv_dim() as f64);
        let gdn = h * (conv + hv * dv + 2.0 * hv) + hv * dv * h + conv * g.conv_kernel as f64;
        let (nh, nkv, hd) = (
            cfg.num_attention_heads as f64,
            cfg.num_key_value_heads as f64,
            cfg.head_dim as f64,
        );
        let attn = h * (2.0 * nh * hd + 2.0 * nkv * hd) + nh * hd * h;
        let mlp = 3.0 * h * cfg.intermediate_size as f64;
        let n_attn = cfg
            .layer_types
            .iter()
            .filter(|t| matches!(t, LayerType::FullAttention))
            .count() as f64;
        let n_gdn = cfg.num_hidden_layers as f64 - n_attn;
        let layers = n_gdn * (gdn + mlp) + n_attn * (attn + mlp);
        let lm_head = cfg.vocab_size as f64 * h;
        let mtp_layer = 2.0 * h * h + attn + mlp;
        let elt_f = elt as f64;
        Self {
            weight_bytes: (layers + lm_head) * elt_f,
            draft_bytes: (mtp_layer + lm_head) * elt_f,
            lm_head_row_bytes: h * elt_f,
            prefill_params: layers,
            elt: elt_f,
            cfg: cfg.clone(),
        }
    }

    pub fn n_attn(&self) -> f64 {
        self.cfg
            .layer_types
            .iter()
            .filter(|t| matches!(t, LayerType::FullAttention))
            .count() as f64
    }

    /// K and V read by `tokens` new positions attending over `ctx` cached ones (all layers).
    pub fn kv_bytes(&self, ctx: usize) -> f64 {
        let c = &self.cfg;
        self.n_attn() * 2.0 * (c.num_key_value_heads * c.head_dim * ctx) as f64 * self.elt
    }

    /// f32 GDN state traffic of a pass over `t` tokens keeping `kept` states (read once, written
    /// `kept` times: 1 for decode, t for a verify).
    pub fn state_bytes(&self, kept: usize) -> f64 {
        let g = self.cfg.gdn();
        let n_gdn = self.cfg.num_hidden_layers as f64 - self.n_attn();
        n_gdn * (1 + kept) as f64 * (g.num_v_heads * g.k_head_dim * g.v_head_dim * 4) as f64
    }

    /// Bytes of one decode step at context `ctx`: weights, K/V, one GDN state update.
    pub fn decode_bytes(&self, ctx: usize) -> f64 {
        self.weight_bytes + self.kv_bytes(ctx) + self.state_bytes(1)
    }

    /// FLOPs of a `t`-token prefill: linear layers plus causal attention (QKᵀ and PV).
    pub fn prefill_flops(&self, t: usize) -> f64 {
        let c = &self.cfg;
        let t = t as f64;
        let attn = self.n_attn() * 2.0 * 2.0 * (c.num_attention_heads * c.head_dim) as f64 * t * t / 2.0;
        2.0 * self.prefill_params * t + attn
    }
}

/// Device-to-device copy rate, counting read + write, of a 2 GiB (CPU: 256 MiB) buffer: the
/// driver's memcpy on a GPU (candle's copy kernel reaches less), a tensor copy on CPU.
pub fn copy_bandwidth(dev: &Device, dtype: DType) -> candle_core::Result<f64> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cd) = dev {
        let stream = cd.cuda_stream();
        let n = 1usize << 31;
        let w = candle_core::Error::wrap;
        let src = stream.alloc_zeros::<u8>(n).map_err(w)?;
        let mut dst = stream.alloc_zeros::<u8>(n).map_err(w)?;
        let s = mean_seconds(dev, 10, || stream.memcpy_dtod(&src, &mut dst).map_err(w))?;
        return Ok(2.0 * n as f64 / s);
    }
    let n = if dev.is_cpu() { 1 << 27 } else { 1 << 30 } / dtype.size_in_bytes() * 2;
    let x = Tensor::zeros(n, dtype, dev)?;
    let s = mean_seconds(dev, 10, || x.copy().map(drop))?;
    Ok(2.0 * (n * dtype.size_in_bytes()) as f64 / s)
}

/// Mean seconds of `f` over `reps` calls after one warm-up call, synchronised before and after.
pub fn mean_seconds(
    dev: &Device,
    reps: usize,
    mut f: impl FnMut() -> candle_core::Result<()>,
) -> candle_core::Result<f64> {
    f()?;
    dev.synchronize()?;
    let start = Instant::now();
    for _ in 0..reps {
        f()?;
    }
    dev.synchronize()?;
    Ok(start.elapsed().as_secs_f64() / reps as f64)
}

/// Square GEMM rate in FLOP/s (8192³ on a GPU, 1024³ on CPU).
pub fn gemm_rate(dev: &Device, dtype: DType) -> candle_core::Result<f64> {
    let n = if dev.is_cpu() { 1024 } else { 8192 };
    let a = Tensor::randn(0f32, 1.0, (n, n), dev)?.to_dtype(dtype)?;
    let b = Tensor::randn(0f32, 1.0, (n, n), dev)?.to_dtype(dtype)?;
    let s = mean_seconds(dev, if dev.is_cpu() { 2 } else { 10 }, || a.matmul(&b).map(drop))?;
    Ok(2.0 * (n * n * n) as f64 / s)
}

/// Reads the high-water mark of the device's default memory pool (candle allocates from it),
/// or with `reset`, sets it back to 0. None on CPU.
fn pool_high_water(dev: &Device, reset: bool) -> Option<u64> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cd) = dev {
        use candle_core::cuda_backend::cudarc::driver::{result, sys};
        let stream = cd.cuda_stream();
        let ctx = stream.context();
        ctx.bind_to_thread().ok()?;
        // SAFETY: `cu_device` comes from a live context, as `get_default_mem_pool` requires.
        let pool = unsafe { result::device::get_default_mem_pool(ctx.cu_device()) }.ok()?;
        let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
        let mut v: u64 = 0;
        let value = &mut v as *mut u64 as *mut _;
        // SAFETY: the pool is valid and USED_MEM_HIGH is a u64 attribute (reset by writing 0).
        unsafe {
            if reset {
                result::mem_pool::set_attribute(pool, attr, value)
            } else {
                result::mem_pool::get_attribute(pool, attr, value)
            }
        }
        .ok()?;
        return Some(v);
    }
    let _ = (dev, reset);
    None
}

pub fn reset_peak(dev: &Device) {
    pool_high_water(dev, true);
}

/// The pool's high-water mark since the last reset, in GB.
pub fn peak_gb(dev: &Device) -> Option<f64> {
    pool_high_water(dev, false).map(|v| v as f64 / 1e9)
}

/// Errors of any kind, printed by `main`.
pub mod anyhow_like {
    pub type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;
}
