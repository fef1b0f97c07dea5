//! Block-scaled FP8 weights, the format of Qwen's `-FP8` checkpoints (HF FineGrainedFP8,
//! `quant_method: "fp8"`): `q` in float8 e4m3 `[out, in]` and `scale` (`weight_scale_inv`, a
//! multiplier despite its name) `[⌈out/bo⌉, ⌈in/bi⌉]`; the real weight is
//! `w[i, j] = f32(q[i, j]) · scale[i / bo, j / bi]`, the last blocks of a row or column partial.

use candle_core::{DType, Tensor};

use crate::{Error, Result};

/// An FP8 weight with its block scales.
#[derive(Debug, Clone)]
pub struct Fp8Weight {
    q: Tensor,
    scale: Tensor,
    block: [usize; 2],
}

/// The e4m3 value of byte `b` (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinity,
/// `S.1111.111` is NaN), decoded from its bits alone: what the CUDA kernels compute, and an
/// independent check of candle's conversion.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = ((b >> 3) & 0xF, (b & 7) as f32);
    if e == 0xF && m == 7.0 {
        return f32::NAN;
    }
    let magnitude = if e == 0 {
        m / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + m / 8.0) * 2f32.powi(e as i32 - 7)
    };
    sign * magnitude
}

impl Fp8Weight {
    /// `q: [out, in]` e4m3, `scale: [⌈out/bo⌉, ⌈in/bi⌉]` in a float dtype (kept as f32),
    /// `block = [bo, bi]`. Shapes, dtypes and the scales' finiteness are checked.
    pub fn new(q: Tensor, scale: Tensor, block: [usize; 2]) -> Result<Self> {
        let op = "Fp8Weight::new";
        let bad = |msg: String| Err(Error::Shape { op, msg });
        if q.dtype() != DType::F8E4M3 || q.rank() != 2 {
            return bad(format!(
                "q must be a 2-d f8e4m3 tensor, found {:?} {:?}",
                q.dims(),
                q.dtype()
            ));
        }
        let small = |v: usize| (1..=i32::MAX as usize).contains(&v);
        if !block.iter().all(|&b| small(b)) {
            return bad(format!("block {block:?} must be positive and below 2^31"));
        }
        let (out, inp) = q.dims2()?;
        if !small(out) || !small(inp) {
            return bad(format!(
                "a weight [{out}, {inp}] must have 1..2^31 rows and columns"
            ));
        }
        let want = [out.div_ceil(block[0]), inp.div_ceil(block[1])];
        if scale.dims() != want {
            return bad(format!(
                "scale {:?} for a weight [{out}, {inp}] in blocks {block:?}: expected {want:?}",
                scale.dims()
            ));
        }
        if !matches!(scale.dtype(), DType::F32 | DType::BF16 | DType::F16) {
            return bad(format!(
                "scale dtype {:?}: expected f32, bf16 or f16",
                scale.dtype()
            ));
        }
        let scale = scale.to_dtype(DType::F32)?;
        if !scale.sum_all()?.to_scalar::<f32>()?.is_finite() {
            return bad("scale holds NaN or infinity".into());
        }
        Ok(Self { q, scale, block })
    }

    /// The e4m3 weight `[out, in]`.
    pub fn q(&self) -> &Tensor {
        &self.q
    }

    /// The f32 block scales `[⌈out/bo⌉, ⌈in/bi⌉]`.
    pub fn scale(&self) -> &Tensor {
        &self.scale
    }

    /// `[bo, bi]`.
    pub fn block(&self) -> [usize; 2] {
        self.block
    }

    /// `(out, in)`.
    pub fn dims(&self) -> (usize, usize) {
        self.q.dims2().unwrap_or((0, 0))
    }

    /// The real weight `[out, in]` in `dtype`: each value times its block's scale in f32, rounded
    /// once to `dtype` (one kernel on CUDA).
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        self.dequantize_with(dtype, &crate::KernelPolicy::DEFAULT)
    }

    /// [`Self::dequantize`] with the CUDA kernel launched under `policy`.
    pub fn dequantize_with(&self, dtype: DType, policy: &crate::KernelPolicy) -> Result<Tensor> {
        // candle has no CUDA cast from e4m3: on CUDA only the kernel dequantizes.
        #[cfg(feature = "cuda")]
        if self.q.device().is_cuda() {
            let contiguous = Fp8Weight {
                q: self.q.contiguous()?,
                scale: self.scale.contiguous()?,
                block: self.block,
            };
            return super::cuda::fp8_dequantize(&contiguous, dtype, policy)?.ok_or_else(|| Error::Shape {
                op: "Fp8Weight::dequantize",
                msg: format!("no CUDA dequantization to {dtype:?}"),
            });
        }
        let _ = policy;
        super::reference::fp8_dequantize(&self.q, &self.scale, self.block, dtype)
    }

    /// The weights stacked along `out` as one, when they can be (same `in` and blocks, every part
    /// but the last a whole number of row blocks, so the scales stack too); `None` otherwise.
    pub fn stack(parts: &[&Fp8Weight]) -> Result<Option<Fp8Weight>> {
        let Some(first) = parts.first() else {
            return Ok(None);
        };
        let aligned = parts
            .iter()
            .all(|p| p.block == first.block && p.dims().1 == first.dims().1)
            && parts[..parts.len() - 1]
                .iter()
                .all(|p| p.dims().0 % first.block[0] == 0);
        if !aligned {
            return Ok(None);
        }
        let q = Tensor::cat(&parts.iter().map(|p| &p.q).collect::<Vec<_>>(), 0)?;
        let scale = Tensor::cat(&parts.iter().map(|p| &p.scale).collect::<Vec<_>>(), 0)?;
        Ok(Some(Fp8Weight {
            q,
            scale,
            block: first.block,
        }))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use candle_core::Device;

    /// Every byte decodes as the format says (0x7E is the largest, 448; 0x7F NaN; 0x01 the
    /// smallest subnormal, 2^-9), and candle's conversion agrees with the bits.
    #[test]
    fn every_e4m3_byte_decodes_by_its_bits() -> Result<()> {
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0xFE), -448.0);
        assert!(e4m3_to_f32(0x7F).is_nan() && e4m3_to_f32(0xFF).is_nan());
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x80), 0.0);
        let bytes: Vec<u8> = (0..=255).collect();
        let t = Tensor::from_raw_buffer(&bytes, DType::F8E4M3, &[256], &Device::Cpu)?;
        let got = t.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        for (b, g) in bytes.iter().zip(got) {
            let want = e4m3_to_f32(*b);
            assert!(
                g == want || (g.is_nan() && want.is_nan()),
                "byte {b:#04x}: candle {g}, bits {want}"
            );
        }
        Ok(())
    }

    /// Random e4m3 bytes (no NaN) of a `[rows, cols]` weight.
    pub(crate) fn random_q(seed: u64, rows: usize, cols: usize, dev: &Device) -> Result<Tensor> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        // Magnitudes below 2^4 (exponent field ≤ 10) in either sign: never NaN.
        let bytes = qwen36_testutil::e4m3_bytes(&mut s, rows * cols, 0x58);
        Ok(Tensor::from_raw_buffer(
            &bytes,
            DType::F8E4M3,
            &[rows, cols],
            dev,
        )?)
    }

    /// Dequantizing multiplies each value by its own block's scale, partial blocks included
    /// (checked element by element against the bits), and rounds once to the asked dtype.
    #[test]
    fn dequantize_scales_each_block_partial_ones_included() -> Result<()> {
        let dev = Device::Cpu;
        let (rows, cols, block) = (70, 50, [32, 16]);
        let q = random_q(1, rows, cols, &dev)?;
        let (ob, ib) = (rows.div_ceil(32), cols.div_ceil(16));
        let scales: Vec<f32> = (0..ob * ib).map(|i| 0.5 + i as f32 * 0.25).collect();
        let w = Fp8Weight::new(
            q.clone(),
            Tensor::from_vec(scales.clone(), (ob, ib), &dev)?,
            block,
        )?;
        let deq = w.dequantize(DType::F32)?.to_vec2::<f32>()?;
        let qf = q.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        for i in 0..rows {
            for j in 0..cols {
                assert_eq!(deq[i][j], qf[i][j] * scales[(i / 32) * ib + j / 16], "({i}, {j})");
            }
        }
        let bf = w.dequantize(DType::BF16)?;
        assert_eq!(bf.dtype(), DType::BF16);
        let want = Tensor::from_vec(deq.concat(), (rows, cols), &dev)?.to_dtype(DType::BF16)?;
        assert_eq!(
            bf.to_dtype(DType::F32)?.to_vec2::<f32>()?,
            want.to_dtype(DType::F32)?.to_vec2::<f32>()?
        );
        Ok(())
    }

    /// Malformed weights are refused naming what is wrong.
    #[test]
    fn malformed_weights_are_refused() -> Result<()> {
        let dev = Device::Cpu;
        let q = random_q(2, 64, 64, &dev)?;
        let ok = Tensor::ones((1, 1), DType::F32, &dev)?;
        let err =
            |q: &Tensor, s: &Tensor, b| Fp8Weight::new(q.clone(), s.clone(), b).unwrap_err().to_string();
        assert!(Fp8Weight::new(q.clone(), ok.clone(), [128, 128]).is_ok());
        assert!(err(&q, &Tensor::ones((2, 1), DType::F32, &dev)?, [128, 128]).contains("expected [1, 1]"));
        assert!(err(&q, &ok, [0, 128]).contains("positive"));
        assert!(err(&q, &ok, [1 << 32, 128]).contains("2^31"));
        assert!(err(&q.to_dtype(DType::F32)?, &ok, [128, 128]).contains("f8e4m3"));
        let nan = Tensor::new(&[[f32::NAN]], &dev)?;
        assert!(err(&q, &nan, [128, 128]).contains("NaN"));
        assert!(err(&q, &ok.to_dtype(DType::U8)?, [128, 128]).contains("scale dtype"));
        // bf16 scales are kept as f32.
        let w = Fp8Weight::new(q, ok.to_dtype(DType::BF16)?, [128, 128])?;
        assert_eq!(w.scale().dtype(), DType::F32);
        Ok(())
    }

    /// Weights stack when their row blocks line up (every part but the last whole blocks), and
    /// the stack dequantizes to the parts' rows.
    #[test]
    fn weights_stack_when_their_blocks_line_up() -> Result<()> {
        let dev = Device::Cpu;
        let part = |seed, rows: usize| -> Result<Fp8Weight> {
            let q = random_q(seed, rows, 40, &dev)?;
            let s = (Tensor::rand(0.5f32, 2.0, (rows.div_ceil(16), 40usize.div_ceil(16)), &dev))?;
            Fp8Weight::new(q, s, [16, 16])
        };
        let (a, b, c) = (part(3, 32)?, part(4, 48)?, part(5, 20)?);
        let s = Fp8Weight::stack(&[&a, &b, &c])?.expect("32 and 48 are whole blocks");
        let d = s.dequantize(DType::F32)?;
        let mut at = 0;
        for p in [&a, &b, &c] {
            let rows = p.dims().0;
            let diff = (d.narrow(0, at, rows)? - p.dequantize(DType::F32)?)?
                .abs()?
                .max_all()?;
            assert_eq!(diff.to_scalar::<f32>()?, 0.0);
            at += rows;
        }
        assert!(
            Fp8Weight::stack(&[&c, &a])?.is_none(),
            "20 rows are a partial block"
        );
        Ok(())
    }
}
