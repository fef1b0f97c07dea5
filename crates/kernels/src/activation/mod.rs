//! SwiGLU on a fused `gate|up` projection: `silu(gate) ⊙ up`. The CPU reference is candle's ops
//! (SiLU, then the product, each rounded to the dtype); on CUDA one kernel does both in f32 with
//! one rounding, instead of three launches.

#[cfg(feature = "cuda")]
mod cuda;
pub mod reference;

use candle_core::{Tensor, D};

use crate::{Error, KernelPolicy, Result};

/// `x: [..., 2·I]` holding `gate` then `up` → `[..., I]` = `silu(gate) ⊙ up`, in `x`'s dtype.
pub fn swiglu(x: &Tensor, policy: &KernelPolicy) -> Result<Tensor> {
    let two_i = x.dim(D::Minus1)?;
    if two_i % 2 != 0 {
        return Err(Error::Shape {
            op: "swiglu",
            msg: format!("last dim {two_i} of {:?} is not gate|up (even)", x.dims()),
        });
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return cuda::swiglu(x, policy);
    }
    let _ = policy;
    reference::swiglu(x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn swiglu_takes_gate_then_up_and_names_odd_widths() -> Result<()> {
        let x = Tensor::new(&[[1f32, -2.0, 3.0, 0.5]], &Device::Cpu)?;
        let y = swiglu(&x, &KernelPolicy::DEFAULT)?.to_vec2::<f32>()?;
        let silu = |g: f32| g / (1.0 + (-g).exp());
        assert!((y[0][0] - silu(1.0) * 3.0).abs() < 1e-6 && (y[0][1] - silu(-2.0) * 0.5).abs() < 1e-6);
        let e = swiglu(
            &Tensor::zeros(3, candle_core::DType::F32, &Device::Cpu)?,
            &KernelPolicy::DEFAULT,
        )
        .unwrap_err();
        assert!(e.to_string().contains("gate|up"), "{e}");
        Ok(())
    }
}
