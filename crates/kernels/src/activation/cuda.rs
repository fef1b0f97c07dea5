//! Launcher of the SwiGLU kernel in cuda/activation.cu.

use candle_core::cuda::WrapErr;
use candle_core::Tensor;

use crate::cuda::{
    at16, device, dtype_suffix, for_float_dtype, view, wrap, KernelCall, LaunchConfig, ACTIVATION,
};
use crate::{KernelPolicy, Result};

/// CUDA twin of [`super::swiglu`]: `x: [..., 2·I]` → `[..., I]`.
pub(crate) fn swiglu(x: &Tensor, policy: &KernelPolicy) -> Result<Tensor> {
    let op = "swiglu";
    let dt = x.dtype();
    let dev = device(op, x)?;
    let two_i = x.dim(candle_core::D::Minus1)?;
    let i = two_i / 2;
    let rows = x.elem_count() / two_i.max(1);
    let mut shape = x.dims().to_vec();
    *shape.last_mut().expect("rank > 0") = i;
    let x = x.contiguous()?;
    macro_rules! go {
        ($t:ty) => {{
            let (xs, xl) = x.storage_and_layout();
            let xv = view::<$t>(op, &xs, xl)?;
            // SAFETY: uninitialised; the kernel writes every element (grid-stride loop).
            let y = unsafe { dev.alloc::<$t>(rows * i)? };
            if rows * i > 0 {
                // 16-byte steps when every gate, up and output row starts 16-byte aligned.
                let size = dt.size_in_bytes();
                let vec = (i * size) % 16 == 0 && at16(xl, size);
                let f = ACTIVATION.func(
                    &dev,
                    &format!(
                        "swiglu{}_{}",
                        if vec { "_vec" } else { "" },
                        dtype_suffix(op, dt)?
                    ),
                )?;
                let mut lb = KernelCall::new(&dev, &f, policy);
                let (r32, i32_) = (rows as i32, i as i32);
                lb.arg(&xv).arg(&y).arg(&r32).arg(&i32_);
                let steps = if vec { rows * i * size / 16 } else { rows * i };
                let cfg = LaunchConfig::for_num_elems(steps.min(1 << 24) as u32);
                // SAFETY: arguments match `swiglu[_vec]_*` in cuda/activation.cu: x [rows·2I]
                // contiguous, y [rows·I] (a fresh allocation: 16-byte aligned), i32 rows and I;
                // the vector variant only with 16-byte aligned rows (checked above); a grid-stride
                // loop covers every output.
                unsafe { lb.launch(cfg) }.w()?;
            }
            Ok(wrap(y, &dev, shape))
        }};
    }
    for_float_dtype!(op, dt)
}
