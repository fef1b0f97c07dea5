//! Attention at the Qwen3.6-27B shapes (24 query heads, 4 KV heads, head dim 256, bf16) on CUDA:
//! the tensor-core kernel of `prefill_attention` for prompts of 1k, 8k and 32k tokens, in TFLOP/s
//! of the causal product (2 matmuls over the visible keys), and `decode_attention` for 1 and 4 new
//! tokens over caches of 1k, 8k and 32k keys, in TB/s of K and V read. tools/bench/sdpa.py times
//! torch's scaled_dot_product_attention like the prefill rows, for a side-by-side table.
//!
//! `cargo run --release -p qwen36-kernels --features cuda --example bench_attention [prefill|decode]`

#[allow(dead_code)] // the copy-bandwidth helper: attention is compute-bound
#[path = "common/mod.rs"]
mod common;

use candle_core::{DType, Device, Tensor};
use common::time;
use qwen36_kernels::attention::{decode_attention, prefill_attention, AttentionInputs};
use qwen36_kernels::KernelPolicy;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::new_cuda(0)?;
    let which = std::env::args().nth(1).unwrap_or_default();
    let (h, kh, d) = (24, 4, 256);
    if which != "decode" {
        prefill(&dev, h, kh, d)?;
    }
    if which != "prefill" {
        decode(&dev, h, kh, d)?;
    }
    Ok(())
}

fn prefill(dev: &Device, h: usize, kh: usize, d: usize) -> Result<(), Box<dyn std::error::Error>> {
    let dev = dev.clone();
    println!("| prompt | time | TFLOP/s |");
    println!("|---|---|---|");
    for t in [1024usize, 8192, 32768] {
        let q = Tensor::randn(0f32, 1.0, (1, h, t, d), &dev)?.to_dtype(DType::BF16)?;
        let k = Tensor::randn(0f32, 1.0, (1, kh, t, d), &dev)?.to_dtype(DType::BF16)?;
        let v = Tensor::randn(0f32, 1.0, (1, kh, t, d), &dev)?.to_dtype(DType::BF16)?;
        let scale = (d as f64).powf(-0.5);
        let iters = if t > 8192 { 5 } else { 20 };
        let s = time(&dev, iters, || {
            prefill_attention(
                AttentionInputs::new(&q, &k, &v, None, scale),
                0,
                &KernelPolicy::from_env(),
            )
            .map(|_| ())
        })?;
        // Query i sees i + 1 keys: 2 products of 2·d flops per (query, key, head).
        let flops = 4.0 * (d * h) as f64 * (t * (t + 1) / 2) as f64;
        println!("| {t} | {:.3} ms | {:.0} |", s * 1e3, flops / s / 1e12);
    }
    Ok(())
}

fn decode(dev: &Device, h: usize, kh: usize, d: usize) -> Result<(), Box<dyn std::error::Error>> {
    println!("| new tokens | keys | time | K+V TB/s |");
    println!("|---|---|---|---|");
    for t in [1usize, 4] {
        for len in [1024usize, 8192, 32768] {
            let g = h / kh;
            let q = Tensor::randn(0f32, 1.0, (1, kh, g * t, d), dev)?.to_dtype(DType::BF16)?;
            let k = Tensor::randn(0f32, 1.0, (1, kh, len, d), dev)?.to_dtype(DType::BF16)?;
            let v = Tensor::randn(0f32, 1.0, (1, kh, len, d), dev)?.to_dtype(DType::BF16)?;
            let l = Tensor::new(&[len as u32], dev)?;
            let scale = (d as f64).powf(-0.5);
            let s = time(dev, 200, || {
                decode_attention(
                    AttentionInputs::new(&q, &k, &v, None, scale),
                    &l,
                    t,
                    &KernelPolicy::from_env(),
                )
                .map(|_| ())
            })?;
            let bytes = (2 * kh * len * d * 2) as f64;
            println!("| {t} | {len} | {:.1} µs | {:.2} |", s * 1e6, bytes / s / 1e12);
        }
    }
    paged(dev, h, kh, d)
}

/// `paged_decode_attention` as the engine runs it: 1 to 64 sequences over pools of 16-token blocks
/// (each sequence's blocks scattered through the pool), 1 new token (a decode step) or 4 (a
/// k = 3 verify), in TB/s of the K and V read.
fn paged(dev: &Device, h: usize, kh: usize, d: usize) -> Result<(), Box<dyn std::error::Error>> {
    use qwen36_kernels::attention::{paged_decode_attention, Pages};
    let (bs, g) = (16usize, h / kh);
    println!("| sequences | new tokens | keys each | time | K+V TB/s |");
    println!("|---|---|---|---|---|");
    for (b, len) in [
        (1usize, 1024usize),
        (1, 8192),
        (1, 32768),
        (4, 8192),
        (8, 1024),
        (8, 8192),
        (16, 1024),
        (16, 8192),
        (16, 32768),
        (64, 1024),
        (64, 8192),
    ] {
        let per = len.div_ceil(bs);
        // Block i of sequence j is pool block (i·b + j): neighbours in a table are b blocks apart.
        let ids: Vec<u32> = (0..b * per).map(|n| ((n % per) * b + n / per) as u32).collect();
        let tables = Tensor::from_vec(ids, (b, per), dev)?;
        let k = Tensor::randn(0f32, 1.0, (b * per * bs, kh, d), dev)?.to_dtype(DType::BF16)?;
        let v = Tensor::randn(0f32, 1.0, (b * per * bs, kh, d), dev)?.to_dtype(DType::BF16)?;
        let lens = Tensor::from_vec(vec![len as u32; b], b, dev)?;
        for t in [1usize, 4] {
            let q = Tensor::randn(0f32, 1.0, (b, kh, g * t, d), dev)?.to_dtype(DType::BF16)?;
            let scale = (d as f64).powf(-0.5);
            let s = time(dev, 100, || {
                paged_decode_attention(
                    AttentionInputs::new(&q, &k, &v, None, scale),
                    Pages {
                        tables: &tables,
                        lens: &lens,
                        block_size: bs,
                    },
                    t,
                    &KernelPolicy::from_env(),
                )
                .map(|_| ())
            })?;
            let bytes = (b * 2 * kh * len * d * 2) as f64;
            println!(
                "| {b} | {t} | {len} | {:.1} µs | {:.2} |",
                s * 1e6,
                bytes / s / 1e12
            );
        }
    }
    Ok(())
}
