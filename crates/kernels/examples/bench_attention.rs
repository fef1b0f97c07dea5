//! Prefill attention at the Qwen3.6-27B shapes (24 query heads, 4 KV heads, head dim 256, bf16)
//! on CUDA: the tensor-core kernel of `prefill_attention` for prompts of 1k, 8k and 32k tokens,
//! in TFLOP/s of the causal product (2 matmuls over the visible keys). tools/bench/sdpa.py times
//! torch's scaled_dot_product_attention the same way, for a side-by-side table.
//!
//! `cargo run --release -p qwen36-kernels --features cuda --example bench_attention`

#[allow(dead_code)] // the copy-bandwidth helper: attention is compute-bound
#[path = "common/mod.rs"]
mod common;

use candle_core::{DType, Device, Tensor};
use common::time;
use qwen36_kernels::attention::prefill_attention;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::new_cuda(0)?;
    let (h, kh, d) = (24, 4, 256);
    println!("| prompt | time | TFLOP/s |");
    println!("|---|---|---|");
    for t in [1024usize, 8192, 32768] {
        let q = Tensor::randn(0f32, 1.0, (1, h, t, d), &dev)?.to_dtype(DType::BF16)?;
        let k = Tensor::randn(0f32, 1.0, (1, kh, t, d), &dev)?.to_dtype(DType::BF16)?;
        let v = Tensor::randn(0f32, 1.0, (1, kh, t, d), &dev)?.to_dtype(DType::BF16)?;
        let scale = (d as f64).powf(-0.5);
        let iters = if t > 8192 { 5 } else { 20 };
        let s = time(&dev, iters, || {
            prefill_attention(&q, &k, &v, 0, scale).map(|_| ())
        })?;
        // Query i sees i + 1 keys: 2 products of 2·d flops per (query, key, head).
        let flops = 4.0 * (d * h) as f64 * (t * (t + 1) / 2) as f64;
        println!("| {t} | {:.3} ms | {:.0} |", s * 1e3, flops / s / 1e12);
    }
    Ok(())
}
