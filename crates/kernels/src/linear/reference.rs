//! The CPU reference of a linear layer: candle's matmul, as `candle_nn::Linear` runs it.

use candle_core::{Module, Tensor};

use crate::Result;

/// `x·wᵀ (+ b)` for `x: [..., in]` through `layer` (`weight: [out, in]`), on a contiguous copy of
/// `x` where it is strided (candle's CUDA matmul rejects some strided inputs, a row view at an odd
/// offset say).
pub fn linear(layer: &candle_nn::Linear, x: &Tensor) -> Result<Tensor> {
    Ok(layer.forward(&x.contiguous()?)?)
}

/// The real weight of an FP8 block-scaled `q: [out, in]` (e4m3) with f32 `scale: [⌈out/bo⌉,
/// ⌈in/bi⌉]`: each value times its block's scale in f32 (the scales broadcast over their blocks,
/// the last ones cut to the weight), then rounded to `dtype`.
pub fn fp8_dequantize(
    q: &Tensor,
    scale: &Tensor,
    block: [usize; 2],
    dtype: candle_core::DType,
) -> Result<Tensor> {
    let (out, inp) = q.dims2()?;
    let (ob, ib) = scale.dims2()?;
    let [bo, bi] = block;
    let s = scale
        .reshape((ob, 1, ib, 1))?
        .broadcast_as((ob, bo, ib, bi))?
        .reshape((ob * bo, ib * bi))?
        .narrow(0, 0, out)?
        .narrow(1, 0, inp)?;
    Ok((q.to_dtype(candle_core::DType::F32)? * s)?.to_dtype(dtype)?)
}

/// The e4m3 byte nearest to `v` (ties to the even code, beyond ±448 the largest finite value of
/// its sign, NaN to NaN): a search over the finite codes by their decoded values, independent of
/// any converter, as the CUDA conversion (`cvt.rn.satfinite`) rounds.
pub fn e4m3_from_f32(v: f32) -> u8 {
    if v.is_nan() {
        return 0x7F;
    }
    let sign = if v.is_sign_negative() { 0x80 } else { 0 };
    let a = v.abs();
    // The non-negative finite codes 0x00..=0x7E decode to increasing values.
    let (mut lo, mut hi) = (0u8, 0x7Eu8);
    if a >= super::e4m3_to_f32(hi) {
        return sign | hi;
    }
    // Invariant: value(lo) <= a < value(hi).
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if super::e4m3_to_f32(mid) <= a {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let (dl, dh) = (a - super::e4m3_to_f32(lo), super::e4m3_to_f32(hi) - a);
    let code = if dl < dh || (dl == dh && lo % 2 == 0) {
        lo
    } else {
        hi
    };
    sign | code
}

/// Activations `x: [m, k]` (`k` a multiple of [`FP8_ACT_GROUP`]) as the FP8 GEMM quantizes them
/// (as transformers' FineGrainedFP8 does on GPU): each row in groups of [`FP8_ACT_GROUP`]
/// elements, `s = amax / 448` in f32 (1 for a group of zeros), `q = e4m3(x / s)`
/// ([`e4m3_from_f32`]). Returns `q: [m, k]` (F8E4M3) and `s: [m, k / FP8_ACT_GROUP]` (f32): the
/// value of an element is `q · s`.
///
/// [`FP8_ACT_GROUP`]: super::FP8_ACT_GROUP
pub fn fp8_quantize_activations(x: &Tensor) -> Result<(Tensor, Tensor)> {
    let (m, k) = x.dims2()?;
    let (q, s) = quantize_rows(x)?;
    let dev = x.device();
    let q = Tensor::from_raw_buffer(&q, candle_core::DType::F8E4M3, &[m, k], &candle_core::Device::Cpu)?
        .to_device(dev)?;
    let s = Tensor::from_vec(s, (m, k / super::FP8_ACT_GROUP), dev)?;
    Ok((q, s))
}

/// [`fp8_quantize_activations`] on the host: the e4m3 bytes and the scales, row-major.
fn quantize_rows(x: &Tensor) -> Result<(Vec<u8>, Vec<f32>)> {
    let group = super::FP8_ACT_GROUP;
    let (_, k) = x.dims2()?;
    if k % group != 0 {
        return Err(crate::Error::Shape {
            op: "fp8_quantize_activations",
            msg: format!("{k} columns are not a multiple of {group}"),
        });
    }
    let xs = x
        .to_dtype(candle_core::DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let mut q = Vec::with_capacity(xs.len());
    let mut s = Vec::with_capacity(xs.len() / group);
    for g in xs.chunks(group) {
        let amax = g.iter().fold(0f32, |a, v| a.max(v.abs()));
        let scale = if amax > 0.0 { amax / 448.0 } else { 1.0 };
        q.extend(g.iter().map(|v| e4m3_from_f32(v / scale)));
        s.push(scale);
    }
    Ok((q, s))
}

/// The FP8 GEMM's product in f32: `x: [m, k]` quantized by [`fp8_quantize_activations`] times the
/// FP8 weight `w: [n, k]`, each factor at its exact value (`q · s`), summed in f32: `[m, n]` on
/// x's device.
pub fn fp8_w8a8_linear(x: &Tensor, w: &super::Fp8Weight) -> Result<Tensor> {
    let group = super::FP8_ACT_GROUP;
    let (m, k) = x.dims2()?;
    let (q, s) = quantize_rows(x)?;
    let xq: Vec<f32> = q
        .iter()
        .enumerate()
        .map(|(i, &b)| super::e4m3_to_f32(b) * s[i / group])
        .collect();
    let xq = Tensor::from_vec(xq, (m, k), x.device())?;
    Ok(xq.matmul(&w.dequantize(candle_core::DType::F32)?.t()?)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linear::{e4m3_to_f32, FP8_ACT_GROUP};
    use candle_core::{DType, Device};

    /// Every finite code encodes back to itself, a value between two neighbours goes to the
    /// nearer, an exact midpoint to the even code, past ±448 to ±448, NaN to NaN.
    #[test]
    fn e4m3_encoding_rounds_to_nearest_even_and_saturates() {
        for b in (0u8..=0xFF).filter(|b| b & 0x7F != 0x7F) {
            assert_eq!(e4m3_from_f32(e4m3_to_f32(b)), b, "code {b:#04x}");
        }
        for lo in 0u8..0x7E {
            let (a, b) = (e4m3_to_f32(lo), e4m3_to_f32(lo + 1));
            let mid = (a + b) / 2.0;
            let even = if lo % 2 == 0 { lo } else { lo + 1 };
            assert_eq!(e4m3_from_f32(mid), even, "midpoint of {lo:#04x}");
            assert_eq!(e4m3_from_f32(-mid), 0x80 | even, "midpoint of -{lo:#04x}");
            let near = a + (b - a) * 0.25;
            assert_eq!(e4m3_from_f32(near), lo, "a quarter past {lo:#04x}");
            assert_eq!(
                e4m3_from_f32(a + (b - a) * 0.75),
                lo + 1,
                "three quarters past {lo:#04x}"
            );
        }
        assert_eq!(e4m3_from_f32(464.0), 0x7E, "the midpoint past 448 stays finite");
        assert_eq!(e4m3_from_f32(1e30), 0x7E);
        assert_eq!(e4m3_from_f32(f32::INFINITY), 0x7E);
        assert_eq!(e4m3_from_f32(-1e30), 0xFE);
        assert_eq!(e4m3_from_f32(f32::NAN), 0x7F);
        assert_eq!(
            e4m3_from_f32(2f32.powi(-10)),
            0x00,
            "half the smallest subnormal rounds to even zero"
        );
        assert_eq!(e4m3_from_f32(2f32.powi(-10) * 1.01), 0x01);
    }

    /// Each 128-element group of a row gets its own scale, amax / 448 (its largest element
    /// becomes ±448 exactly), a group of zeros scale 1, and every element comes back within half
    /// an e4m3 step (2⁻⁴ relative; below 2⁻⁶ of the scale, half a subnormal step).
    #[test]
    fn activations_quantize_per_row_and_group() -> Result<()> {
        let g = FP8_ACT_GROUP;
        let (m, k) = (3, 3 * g);
        let mut v: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7919 % 1013) as f32 - 506.0) * 0.01)
            .collect();
        // Row 1, group 2: zeros; row 2, group 0: a large outlier.
        v[k + 2 * g..2 * k].fill(0.0);
        v[2 * k + 5] = -3000.0;
        let x = Tensor::from_vec(v.clone(), (m, k), &Device::Cpu)?;
        let (q, s) = fp8_quantize_activations(&x)?;
        assert_eq!(
            (q.dims(), q.dtype(), s.dims()),
            (&[m, k][..], DType::F8E4M3, &[m, 3][..])
        );
        let q = q.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        let s = s.to_vec2::<f32>()?;
        for r in 0..m {
            for c in 0..3 {
                let group = &v[r * k + c * g..r * k + (c + 1) * g];
                let amax = group.iter().fold(0f32, |a, x| a.max(x.abs()));
                let want = if amax > 0.0 { amax / 448.0 } else { 1.0 };
                assert_eq!(s[r][c], want, "row {r} group {c}");
                let qs = &q[r][c * g..(c + 1) * g];
                if amax > 0.0 {
                    assert_eq!(
                        qs.iter().fold(0f32, |a, x| a.max(x.abs())),
                        448.0,
                        "row {r} group {c}"
                    );
                }
                for (x, q) in group.iter().zip(qs) {
                    let back = q * s[r][c];
                    let bound = (x.abs() / 16.0).max(2f32.powi(-10) * s[r][c]);
                    assert!(
                        (back - x).abs() <= bound * 1.0001,
                        "row {r} group {c}: {x} -> {back}"
                    );
                }
            }
        }
        assert!(q[1][2 * g..].iter().all(|&x| x == 0.0));
        assert!(fp8_quantize_activations(&Tensor::zeros((1, 100), DType::F32, &Device::Cpu)?).is_err());
        Ok(())
    }
}
