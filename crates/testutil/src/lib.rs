//! Helpers shared by the qwen36 test suites: the test device, tensor comparisons, seeded random
//! tensors, and the fixtures (found at run time, see [`workspace_dir`]).
//!
//! This crate depends on candle only: qwen36-kernels dev-depends on it, so it cannot depend on
//! qwen36-model (or anything else above the kernels). The helpers that need the model (loading
//! onto the test device, greedy decoding) are in `include/model.rs`, which the suites of the
//! crates that depend on qwen36-model compile into themselves with `#[path]`.

mod fixtures;

pub use fixtures::*;

use candle_core::{DType, Device, Shape, Tensor};

/// The device tests run on: the CPU, or the first CUDA GPU when `QWEN36_TEST_DEVICE=cuda`
/// (scripts/gpu-check runs every suite both ways). The GPU device is made like
/// `qwen36_model::graph_device`, so generation loops under test replay CUDA graphs.
pub fn test_device() -> Device {
    match std::env::var("QWEN36_TEST_DEVICE").as_deref() {
        Ok("cuda") => cuda_device(),
        _ => Device::Cpu,
    }
}

#[cfg(feature = "cuda")]
fn cuda_device() -> Device {
    let d = Device::new_cuda_with_stream(0).expect("QWEN36_TEST_DEVICE=cuda but no CUDA device");
    // SAFETY: every tensor of this device is made and used on its single stream (see
    // qwen36_model::graph_device).
    unsafe {
        d.as_cuda_device()
            .expect("a CUDA device")
            .disable_event_tracking()
    };
    d
}

#[cfg(not(feature = "cuda"))]
fn cuda_device() -> Device {
    Device::new_cuda(0).expect("QWEN36_TEST_DEVICE=cuda needs a build with --features cuda")
}

fn host_f32(t: &Tensor) -> Tensor {
    t.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap()
}

/// `max |a − b|` over all elements (any devices and dtypes), in f32.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    max_all(&(host_f32(a) - host_f32(b)).unwrap().abs().unwrap())
}

fn max_all(t: &Tensor) -> f32 {
    t.flatten_all().unwrap().max(0).unwrap().to_scalar().unwrap()
}

/// Max over rows (last dim) of `max_j |a_j − b_j| / max_j |b_j|`: the error relative to each row's
/// scale, which stays meaningful where single elements are near zero.
pub fn max_row_rel_err(a: &Tensor, b: &Tensor) -> f32 {
    let (a, b) = (host_f32(a), host_f32(b));
    let d = a.dims().len() - 1;
    let err = (a - &b).unwrap().abs().unwrap().max_keepdim(d).unwrap();
    let scale = b.abs().unwrap().max_keepdim(d).unwrap();
    max_all(&(err / scale).unwrap())
}

/// SplitMix64: the `i`-th 64-bit draw of stream `seed`.
fn splitmix(seed: u64, i: u64) -> u64 {
    let mut z = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(i.wrapping_add(1).wrapping_mul(0xD1B5_4A32_D192_ED03));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform draw in (0, 1) (53 bits, never 0).
fn unit(seed: u64, i: u64) -> f64 {
    ((splitmix(seed, i) >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

/// `N(0, std²)` samples of `shape` from stream `seed` (Box-Muller), f32 on `dev`. candle's CPU
/// `Tensor::randn` draws from an unseeded thread RNG; tests use this so every run sees the same
/// numbers.
pub fn randn(seed: u64, std: f32, shape: impl Into<Shape>, dev: &Device) -> candle_core::Result<Tensor> {
    let shape = shape.into();
    let v: Vec<f32> = (0..shape.elem_count() as u64)
        .map(|i| {
            let (u1, u2) = (unit(seed, 2 * i), unit(seed, 2 * i + 1));
            ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32 * std
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu)?.to_device(dev)
}

/// Uniform samples in `[lo, hi)` of `shape` from stream `seed`, f32 on `dev`.
pub fn rand_uniform(
    seed: u64,
    lo: f32,
    hi: f32,
    shape: impl Into<Shape>,
    dev: &Device,
) -> candle_core::Result<Tensor> {
    let shape = shape.into();
    let v: Vec<f32> = (0..shape.elem_count() as u64)
        .map(|i| lo + (hi - lo) * unit(seed, i) as f32)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu)?.to_device(dev)
}

/// `n` random float8 e4m3 bytes from the xorshift64 stream `state` (advanced): each keeps its
/// draw's sign bit and takes the magnitude code `(b & 0x7F) % codes`, so `codes ≤ 0x7F` never
/// gives NaN (0x50: |value| < 8, 0x58: < 16), subnormals and zeros included.
pub fn e4m3_bytes(state: &mut u64, n: usize, codes: u8) -> Vec<u8> {
    (0..n)
        .map(|_| {
            *state ^= *state << 13;
            *state ^= *state >> 7;
            *state ^= *state << 17;
            let b = (*state >> 24) as u8;
            (b & 0x80) | ((b & 0x7F) % codes)
        })
        .collect()
}

/// A seeded stream of integers for randomised tests (SplitMix64): the same seed gives the same
/// draws on every run.
#[derive(Debug, Clone)]
pub struct Rng {
    seed: u64,
    i: u64,
}

impl Rng {
    /// The stream `seed`.
    pub fn new(seed: u64) -> Self {
        Self { seed, i: 0 }
    }

    /// A draw in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        self.i += 1;
        (splitmix(self.seed, self.i) % n as u64) as usize
    }

    /// A draw in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.i += 1;
        unit(self.seed, self.i) < p
    }
}
