//! GDN gates (docs/MODEL.md §2.1 step 5): per value head, in f32,
//! `g = −exp(A_log) · softplus(a + dt_bias)` (the log decay, ≤ 0) and `β = sigmoid(b)`.

use candle_core::{Device, Tensor};

use crate::{expect_rank, host_f32, Error, Result};

/// torch's softplus (beta 1, threshold 20): linear above 20, `log1p(exp(x))` below.
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Computes `(g, beta)`, both f32 `[batch, len, v_heads]`, from the projections
/// `a, b: [batch, len, v_heads]` and the per-head parameters `a_log, dt_bias: [v_heads]`.
pub fn gdn_gating(a: &Tensor, b: &Tensor, a_log: &Tensor, dt_bias: &Tensor) -> Result<(Tensor, Tensor)> {
    expect_rank("gdn_gating", "a", a, 3)?;
    let heads = a.dim(2)?;
    if b.dims() != a.dims() || a_log.dims() != [heads] || dt_bias.dims() != [heads] {
        return Err(Error::Shape {
            op: "gdn_gating",
            msg: format!(
                "a {:?}, b {:?}, A_log {:?}, dt_bias {:?} do not agree (want b = a, params [{heads}])",
                a.dims(),
                b.dims(),
                a_log.dims(),
                dt_bias.dims()
            ),
        });
    }
    let (av, bv) = (host_f32(a)?, host_f32(b)?);
    let (al, dt) = (host_f32(a_log)?, host_f32(dt_bias)?);
    let neg_a: Vec<f32> = al.iter().map(|x| -x.exp()).collect();
    let g: Vec<f32> = av
        .iter()
        .enumerate()
        .map(|(i, &x)| neg_a[i % heads] * softplus(x + dt[i % heads]))
        .collect();
    let beta: Vec<f32> = bv.iter().map(|&x| 1.0 / (1.0 + (-x).exp())).collect();
    let dev = a.device();
    let g = Tensor::from_vec(g, a.dims(), &Device::Cpu)?.to_device(dev)?;
    let beta = Tensor::from_vec(beta, a.dims(), &Device::Cpu)?.to_device(dev)?;
    Ok((g, beta))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gating_matches_formula() -> Result<()> {
        let dev = Device::Cpu;
        let a = Tensor::new(&[[[0.5f32, -30.0], [25.0, 0.0]]], &dev)?;
        let b = Tensor::new(&[[[0.0f32, 2.0], [-1.0, 3.0]]], &dev)?;
        let a_log = Tensor::new(&[0.1f32, 1.2], &dev)?;
        let dt = Tensor::new(&[-2.0f32, 0.5], &dev)?;
        let (g, beta) = gdn_gating(&a, &b, &a_log, &dt)?;
        let g = g.flatten_all()?.to_vec1::<f32>()?;
        let beta = beta.flatten_all()?.to_vec1::<f32>()?;
        let sp = |x: f64| if x > 20.0 { x } else { x.exp().ln_1p() };
        let want_g = [
            -(0.1f64.exp()) * sp(0.5 - 2.0),
            -(1.2f64.exp()) * sp(-30.0 + 0.5),
            -(0.1f64.exp()) * sp(25.0 - 2.0),
            -(1.2f64.exp()) * sp(0.5),
        ];
        for (x, w) in g.iter().zip(want_g) {
            assert!(((*x as f64) - w).abs() <= 1e-6 * w.abs().max(1e-12), "{x} vs {w}");
        }
        for (x, bb) in beta.iter().zip([0.0f64, 2.0, -1.0, 3.0]) {
            assert!(((*x as f64) - 1.0 / (1.0 + (-bb).exp())).abs() < 1e-7);
        }
        Ok(())
    }
}
