//! The CPU reference of the causal conv1d + SiLU: per channel, a window of the `kernel-1` state
//! inputs and the new ones, summed in f32. Callable on its own; the public ops run it on the CPU
//! and the CUDA kernels are tested against it.

use candle_core::{Device, Tensor};

use super::check;
use crate::{host_f32, Result};

pub(super) fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// [`super::causal_conv1d`] on the host.
pub fn causal_conv1d(x: &Tensor, weight: &Tensor, state: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
    let (b, t, c, k) = check(x, weight, state)?;
    let hist = k - 1;
    let xs = host_f32(x)?;
    let w = host_f32(weight)?;
    let st = match state {
        Some(s) => host_f32(s)?,
        None => vec![0.0; b * c * hist],
    };
    let mut y = vec![0.0f32; b * t * c];
    let mut new_state = vec![0.0f32; b * c * hist];
    // The window for channel `ch`: `hist` state values then `t` inputs.
    let mut window = vec![0.0f32; hist + t];
    for bi in 0..b {
        for ch in 0..c {
            window[..hist].copy_from_slice(&st[(bi * c + ch) * hist..(bi * c + ch + 1) * hist]);
            for ti in 0..t {
                window[hist + ti] = xs[(bi * t + ti) * c + ch];
            }
            let wk = &w[ch * k..(ch + 1) * k];
            for ti in 0..t {
                let acc: f32 = wk.iter().zip(&window[ti..ti + k]).map(|(a, b)| a * b).sum();
                y[(bi * t + ti) * c + ch] = silu(acc);
            }
            new_state[(bi * c + ch) * hist..(bi * c + ch + 1) * hist].copy_from_slice(&window[t..t + hist]);
        }
    }
    let dev = x.device();
    let y = Tensor::from_vec(y, (b, t, c), &Device::Cpu)?
        .to_dtype(x.dtype())?
        .to_device(dev)?;
    let s = Tensor::from_vec(new_state, (b, c, hist), &Device::Cpu)?
        .to_dtype(x.dtype())?
        .to_device(dev)?;
    Ok((y, s))
}
