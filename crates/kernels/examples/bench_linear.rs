//! The CUDA weight-streaming linear kernel (1, 2 or 4 columns per warp) and the tile kernel against
//! candle's matmul (cuBLAS) at the Qwen3.6-27B projection shapes, for 1..=8 rows (decode and MTP
//! verify) and 16..128 (batched decode and verify), bf16. Prints the weight bytes read
//! per second of each variant; the yardstick is the device-to-device copy bandwidth measured in
//! the same run. Each call reads another copy of the weight, the copies 256 MB together (5× the
//! H200's L2), so that every call streams its weight from memory as a model's layers do.
//!
//! ```text
//! cargo run --release -p qwen36-kernels --features cuda --example bench_linear [SHAPE] [ROWS]
//! ```
//!
//! SHAPE keeps the shapes whose name contains it, ROWS the row counts up to it (1..8, then 12, 16, 24, 32,
//! 48, 64, 128, and for FP8 512, 2048, 8192; for profiling one kernel under ncu). SHAPE `fp8`
//! times the FP8 layers instead (random e4m3 weights in 128×128 blocks, bf16 activations): the
//! default (the tile kernel below `fp8_gemm_min_rows`, past 8 rows 4 warps per 16 columns on wide
//! layers; then the FP8 GEMM where it takes the layer, else the tile kernel to 48 rows), the tile kernel
//! with 8 warps for every row count to 48 (`SkinnyPath::Uniform`; the GEMM past them), the FP8
//! GEMM for every row count (`Fp8GemmPath::FromRows(1)`), and dequantize + cuBLAS.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{copy_bandwidth, time};
use qwen36_kernels::linear::Linear;
use qwen36_kernels::{Fp8GemmPath, KernelPolicy, SkinnyPath};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let only = args.next().unwrap_or_default();
    let max_rows: usize = args.next().map_or(Ok(8), |r| r.parse())?;
    let dev = Device::new_cuda(0)?;
    copy_bandwidth(&dev)?;
    // (name, in, out)
    let shapes = [
        ("GDN in_proj (qkv+z+b+a)", 5120, 16480),
        ("MLP gate+up", 5120, 34816),
        ("MLP down", 17408, 5120),
        ("GDN out_proj", 6144, 5120),
        ("attention q+k+v", 5120, 14336),
        ("lm_head", 5120, 248320),
    ];
    let paths = [
        SkinnyPath::Matmul,
        SkinnyPath::Streaming(1),
        SkinnyPath::Streaming(2),
        SkinnyPath::Streaming(4),
        SkinnyPath::Uniform,
    ];
    if only == "fp8" {
        return fp8(&dev, &shapes[..5], max_rows);
    }
    println!(
        "| shape | rows | cuBLAS | 1 col/warp | 2 col/warp | 4 col/warp | tiles | (TB/s of weights read) |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (name, k, o) in shapes.into_iter().filter(|s| s.0.contains(&only)) {
        let w = Tensor::randn(0f32, 0.02, (o, k), &dev)?.to_dtype(DType::BF16)?;
        let lins = (0..copies(2 * k * o))
            .map(|_| Ok(Linear::new(w.copy()?, None)))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let bytes = (2 * k * o) as f64;
        for rows in row_counts(max_rows) {
            let x = Tensor::randn(0f32, 1.0, (1, rows, k), &dev)?.to_dtype(DType::BF16)?;
            let mut cells = Vec::new();
            for path in paths {
                let policy = KernelPolicy {
                    skinny: path,
                    ..KernelPolicy::from_env()
                };
                let s = time_rotating(&dev, 50, &lins, policy, &x)?;
                cells.push(format!("{:.2}", bytes / s / 1e12));
            }
            println!("| {name} {k}→{o} | {rows} | {} |", cells.join(" | "));
        }
    }
    Ok(())
}

/// Copies of a weight of `bytes` that fill 256 MB, so that no call finds its weight in L2.
fn copies(bytes: usize) -> usize {
    (256usize << 20).div_ceil(bytes)
}

/// Seconds per call of `x` through `lins` under `policy`, each call the next copy.
fn time_rotating(
    dev: &Device,
    iters: usize,
    lins: &[Linear],
    policy: KernelPolicy,
    x: &Tensor,
) -> Result<f64, Box<dyn std::error::Error>> {
    let lins: Vec<_> = lins.iter().map(|l| l.clone().with_policy(policy)).collect();
    let mut i = 0;
    Ok(time(dev, iters, || {
        i += 1;
        lins[i % lins.len()].forward(x).map(|_| ())
    })?)
}

/// The row counts timed, up to `max`: each of 1..8, then the batches of 2..32 verified tokens.
fn row_counts(max: usize) -> impl Iterator<Item = usize> {
    (1..=8)
        .chain([12, 16, 24, 32, 48, 64, 128])
        .filter(move |&r| r <= max)
}

/// [`row_counts`], then prefill chunks.
fn fp8_row_counts(max: usize) -> impl Iterator<Item = usize> {
    row_counts(max).chain([512, 2048, 8192].into_iter().filter(move |&r| r <= max))
}

/// The FP8 table: weight bytes (one per weight) read per second of each path.
fn fp8(
    dev: &Device,
    shapes: &[(&str, usize, usize)],
    max_rows: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    use qwen36_kernels::linear::{Fp8Weight, LinearWeight};
    println!(
        "| shape | rows | default | tiles | FP8 GEMM | dequantize + cuBLAS | (TB/s of FP8 weights read, each call another copy; TFLOP/s of the default) |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    for &(name, k, o) in shapes {
        // Random e4m3 bytes of magnitude below 8 (never NaN).
        let bytes = qwen36_testutil::e4m3_bytes(&mut state, k * o, 0x50);
        let q = Tensor::from_raw_buffer(&bytes, DType::F8E4M3, &[o, k], &Device::Cpu)?.to_device(dev)?;
        let scale = (Tensor::rand(0.5f32, 1.5, (o.div_ceil(128), k.div_ceil(128)), dev)? * 0.01)?;
        let lins = (0..copies(k * o))
            .map(|_| {
                let w = Fp8Weight::new(q.copy()?, scale.copy()?, [128, 128])?;
                Ok(Linear::from_weight(LinearWeight::Fp8(w), None))
            })
            .collect::<Result<Vec<_>, Box<dyn std::error::Error>>>()?;
        for rows in fp8_row_counts(max_rows) {
            let x = Tensor::randn(0f32, 1.0, (1, rows, k), dev)?.to_dtype(DType::BF16)?;
            let mut cells = Vec::new();
            let mut flops = 0.0;
            for (path, fp8_gemm) in [
                (SkinnyPath::Auto, Fp8GemmPath::Auto),
                (SkinnyPath::Uniform, Fp8GemmPath::Auto),
                (SkinnyPath::Auto, Fp8GemmPath::FromRows(1)),
                (SkinnyPath::Matmul, Fp8GemmPath::Dequantize),
            ] {
                let policy = KernelPolicy {
                    skinny: path,
                    fp8_gemm,
                    ..KernelPolicy::from_env()
                };
                let iters = if rows > 512 { 10 } else { 50 };
                let s = time_rotating(dev, iters, &lins, policy, &x)?;
                cells.push(format!("{:.2}", (k * o) as f64 / s / 1e12));
                if (path, fp8_gemm) == (SkinnyPath::Auto, Fp8GemmPath::Auto) {
                    flops = 2.0 * (rows * k * o) as f64 / s / 1e12;
                }
            }
            println!("| {name} {k}→{o} | {rows} | {} | {flops:.0} |", cells.join(" | "));
        }
    }
    Ok(())
}
