//! GDN kernel timings on a CUDA GPU at the Qwen3.6-27B layer shapes (Hk 16, Hv 48, dk = dv = 128),
//! with the device's copy bandwidth measured in the same run as the yardstick.
//!
//! ```text
//! cargo run --release -p qwen36-kernels --features cuda --example bench_gdn [FILTER]
//! ```
//! FILTER (optional) keeps the cases whose name contains it.
//! Times are wall-clock per call after warm-up, averaged over many calls with a device sync at the
//! end (so they include candle's host-side launch cost, as an eager decode step would).

mod common;

use candle_core::{DType, Device, Tensor};
use common::{copy_bandwidth, time};
use qwen36_kernels::conv1d::causal_conv1d;
use qwen36_kernels::delta_rule::{fused_gated_delta_rule, DeltaRuleMode, GdnHeads, GdnParams};
use qwen36_kernels::{ChunkPath, KernelPolicy};

const HK: usize = 16;
const HV: usize = 48;
const D: usize = 128;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::new_cuda(0)?;
    let copy_bw = copy_bandwidth(&dev)?;

    let heads = GdnHeads {
        k_heads: HK,
        v_heads: HV,
        k_dim: D,
        v_dim: D,
    };
    let width = 2 * HK * D + HV * D;
    let a_log = Tensor::rand(0f32, 2.5, HV, &dev)?;
    let dt_bias = (Tensor::rand(0f32, 1.0, HV, &dev)? - 3.0)?;
    println!("| case | time | state+io bytes | achieved | of copy bw |");
    println!("|---|---|---|---|---|");
    // (name, batch, tokens, keep every state, the chunked path or None for the recurrent kernel)
    let cases: [(&str, usize, usize, bool, Option<ChunkPath>); 22] = [
        ("decode B=1", 1, 1, false, None),
        ("decode B=8", 8, 1, false, None),
        ("decode B=16", 16, 1, false, None),
        ("verify B=16 T=6", 16, 6, false, None),
        ("decode B=64", 64, 1, false, None),
        ("verify B=1 T=4 (keep states)", 1, 4, true, None),
        ("verify B=8 T=4 (keep states)", 8, 4, true, None),
        ("prefill B=1 T=1024 (token-by-token kernel)", 1, 1024, false, None),
        ("prefill B=1 T=8192 (token-by-token kernel)", 1, 8192, false, None),
        (
            "prefill B=1 T=1024 (chunked, default: on sm_90 tensor cores, 64 columns, outputs in the scan)",
            1,
            1024,
            false,
            Some(ChunkPath::Auto),
        ),
        (
            "prefill B=1 T=8192 (chunked, default: on sm_90 tensor cores, 64 columns, outputs in the scan)",
            1,
            8192,
            false,
            Some(ChunkPath::Auto),
        ),
        (
            "prefill B=1 T=32768 (chunked, default: on sm_90 tensor cores, 64 columns, outputs in the scan)",
            1,
            32768,
            false,
            Some(ChunkPath::Auto),
        ),
        (
            "prefill B=1 T=1024 (chunked, tensor cores, 64 columns, output kernel)",
            1,
            1024,
            false,
            Some(ChunkPath::TensorCores(64)),
        ),
        (
            "prefill B=1 T=1024 (chunked, tensor cores, 32 columns)",
            1,
            1024,
            false,
            Some(ChunkPath::TensorCores(32)),
        ),
        (
            "prefill B=2 T=1024 (chunked, default: on sm_90 tensor cores, 64 columns, outputs in the scan)",
            2,
            1024,
            false,
            Some(ChunkPath::Auto),
        ),
        (
            "prefill B=2 T=1024 (chunked, tensor cores, 32 columns)",
            2,
            1024,
            false,
            Some(ChunkPath::TensorCores(32)),
        ),
        (
            "prefill B=1 T=8192 (chunked, tensor cores, 64 columns, output kernel)",
            1,
            8192,
            false,
            Some(ChunkPath::TensorCores(64)),
        ),
        (
            "prefill B=1 T=8192 (chunked, tensor cores, 32 columns)",
            1,
            8192,
            false,
            Some(ChunkPath::TensorCores(32)),
        ),
        (
            "prefill B=1 T=8192 (chunked, CUDA cores, 16 columns)",
            1,
            8192,
            false,
            Some(ChunkPath::CudaCores(16)),
        ),
        (
            "prefill B=1 T=8192 (chunked, CUDA cores, 32 columns)",
            1,
            8192,
            false,
            Some(ChunkPath::CudaCores(32)),
        ),
        (
            "prefill B=4 T=8192 (chunked, CUDA cores, 16 columns)",
            4,
            8192,
            false,
            Some(ChunkPath::CudaCores(16)),
        ),
        (
            "prefill B=4 T=8192 (chunked, CUDA cores, 32 columns)",
            4,
            8192,
            false,
            Some(ChunkPath::CudaCores(32)),
        ),
    ];
    let filter = std::env::args().nth(1).unwrap_or_default();
    for (name, b, t, keep, chunked) in cases {
        if !name.contains(&filter) {
            continue;
        }
        let qkv = Tensor::randn(0f32, 1.0, (b, t, width), &dev)?.to_dtype(DType::BF16)?;
        let a = Tensor::randn(0f32, 1.0, (b, t, HV), &dev)?.to_dtype(DType::BF16)?;
        let bb = Tensor::randn(0f32, 1.0, (b, t, HV), &dev)?.to_dtype(DType::BF16)?;
        let s0 = Tensor::randn(0f32, 0.1, (b, HV, D, D), &dev)?;
        let mut policy = KernelPolicy::from_env();
        let mode = match chunked {
            Some(path) => {
                policy.chunk = path;
                DeltaRuleMode::Chunked
            }
            None => DeltaRuleMode::Recurrent {
                keep_all_states: keep,
            },
        };
        let iters = if t > 1000 { 5 } else { 200 };
        let s = time(&dev, iters, || {
            fused_gated_delta_rule(
                &qkv,
                &a,
                &bb,
                GdnParams::new(&a_log, &dt_bias, heads),
                Some(&s0),
                mode,
                &policy,
            )
            .map(|_| ())
            .map_err(|e| candle_core::Error::Msg(e.to_string()))
        })?;
        let state = (b * HV * D * D * 4) as f64;
        let io = (b * t * (width * 2 + HV * 4 + HV * D * 4)) as f64;
        let bytes = 2.0 * state + io + if keep { state * t as f64 } else { 0.0 };
        let bw = bytes / s;
        println!(
            "| {name} | {:.1} µs | {:.1} MB | {:.2} TB/s | {:.0}% |",
            s * 1e6,
            bytes / 1e6,
            bw / 1e12,
            100.0 * bw / copy_bw
        );
    }
    // Short conv of one layer at decode and prefill.
    for (b, t) in [(1usize, 1usize), (1, 1024), (1, 2048), (1, 8192)] {
        if !"conv1d".contains(&filter) {
            continue;
        }
        let x = Tensor::randn(0f32, 1.0, (b, t, width), &dev)?.to_dtype(DType::BF16)?;
        let w = Tensor::randn(0f32, 0.3, (width, 4), &dev)?.to_dtype(DType::BF16)?;
        let st = Tensor::zeros((b, width, 3), DType::BF16, &dev)?;
        let s = time(&dev, 100, || {
            causal_conv1d(&x, &w, Some(&st), &KernelPolicy::from_env())
                .map(|_| ())
                .map_err(|e| candle_core::Error::Msg(e.to_string()))
        })?;
        // x read once, y written once (the state's bytes are negligible).
        let bytes = (2 * b * t * width * 2) as f64;
        let bw = bytes / s;
        println!(
            "| conv1d B={b} T={t} | {:.1} µs | {:.1} MB | {:.2} TB/s | {:.0}% |",
            s * 1e6,
            bytes / 1e6,
            bw / 1e12,
            100.0 * bw / copy_bw
        );
    }
    Ok(())
}
