//! Timing helpers shared by the kernel benchmarks (a module, not an example: no main.rs).

use std::time::Instant;

use candle_core::{DType, Device, Tensor};

/// Wall-clock seconds per call of `f` after 3 warm-up calls, averaged over `iters` calls with one
/// device sync at the end (so host launch cost is included, as in an eager step).
pub fn time<E: From<candle_core::Error>>(
    dev: &Device,
    iters: usize,
    mut f: impl FnMut() -> Result<(), E>,
) -> Result<f64, E> {
    for _ in 0..3 {
        f()?;
    }
    dev.synchronize()?;
    let t0 = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    dev.synchronize()?;
    Ok(t0.elapsed().as_secs_f64() / iters as f64)
}

/// Copy bandwidth of candle's copy kernel (bytes read + written per second) on a 2 GiB f32
/// buffer, printed and returned: the yardstick the benchmarks report against.
pub fn copy_bandwidth(dev: &Device) -> candle_core::Result<f64> {
    let n = 512 * 1024 * 1024;
    let big = Tensor::zeros(n, DType::F32, dev)?;
    let s = time(dev, 20, || big.copy().map(|_| ()))?;
    let bw = 8.0 * n as f64 / s;
    println!("copy bandwidth (read + write): {:.2} TB/s", bw / 1e12);
    Ok(bw)
}
