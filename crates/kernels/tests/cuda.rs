//! CUDA kernels against the CPU references (built with `--features cuda`, run on a GPU by
//! scripts/gpu-check). f32 tolerance 1e-5: the kernels fuse multiply-adds and sum in another order
//! than the CPU loops, which moves results by a few ulps over 100+ tokens of O(1) values.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use qwen36_kernels::conv1d::causal_conv1d;
use qwen36_kernels::delta_rule::{
    chunked_gated_delta_rule, fused_gated_delta_rule, recurrent_gated_delta_rule, DeltaRuleMode, GdnHeads,
    CHUNK_SIZE,
};
use qwen36_kernels::norm::l2_norm;
use qwen36_testutil::max_abs_diff as max_diff;

fn gpu() -> Device {
    Device::new_cuda(0).expect("a CUDA device")
}

struct Inputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    s0: Tensor,
}

fn inputs(b: usize, t: usize, hk: usize, hv: usize, dk: usize, dv: usize) -> Inputs {
    let cpu = Device::Cpu;
    let g = (Tensor::rand(0f32, 1.0, (b, t, hv), &cpu).unwrap() * -1.2).unwrap();
    Inputs {
        q: l2_norm(&Tensor::randn(0f32, 1.0, (b, t, hk, dk), &cpu).unwrap(), 1e-6).unwrap(),
        k: l2_norm(&Tensor::randn(0f32, 1.0, (b, t, hk, dk), &cpu).unwrap(), 1e-6).unwrap(),
        v: Tensor::randn(0f32, 1.0, (b, t, hv, dv), &cpu).unwrap(),
        g,
        beta: Tensor::rand(0.01f32, 0.99, (b, t, hv), &cpu).unwrap(),
        s0: Tensor::randn(0f32, 0.5, (b, hv, dk, dv), &cpu).unwrap(),
    }
}

#[test]
fn recurrent_and_chunked_match_cpu_for_every_row_variant() {
    // dk covers each compiled register-row variant; dv not a multiple of 32 covers partial tiles.
    for (dk, dv) in [(8, 24), (16, 40), (64, 64), (128, 128), (256, 96)] {
        let x = inputs(2, 70, 2, 6, dk, dv);
        let d = gpu();
        let on = |t: &Tensor| t.to_device(&d).unwrap();
        let scale = (dk as f32).powf(-0.5);
        let cpu =
            recurrent_gated_delta_rule(&x.q, &x.k, &x.v, &x.g, &x.beta, Some(&x.s0), scale, true).unwrap();
        let (q, k, v, g, beta, s0) = (on(&x.q), on(&x.k), on(&x.v), on(&x.g), on(&x.beta), on(&x.s0));
        let gpu_r = recurrent_gated_delta_rule(&q, &k, &v, &g, &beta, Some(&s0), scale, true).unwrap();
        let e = max_diff(&cpu.out, &gpu_r.out);
        assert!(e < 1e-5, "dk {dk}: out {e}");
        assert!(max_diff(&cpu.state, &gpu_r.state) < 1e-5, "dk {dk}: state");
        let (ca, ga) = (cpu.all_states.unwrap(), gpu_r.all_states.unwrap());
        assert!(max_diff(&ca, &ga) < 1e-5, "dk {dk}: intermediate states");
        let ch = chunked_gated_delta_rule(&x.q, &x.k, &x.v, &x.g, &x.beta, None, scale, CHUNK_SIZE).unwrap();
        let gch = chunked_gated_delta_rule(&q, &k, &v, &g, &beta, None, scale, CHUNK_SIZE).unwrap();
        assert!(max_diff(&ch.out, &gch.out) < 1e-5, "dk {dk}: chunked out");
        assert!(max_diff(&ch.state, &gch.state) < 1e-5, "dk {dk}: chunked state");
    }
}

#[test]
fn fused_kernel_matches_cpu_composition() {
    let (b, t, hk, hv, dk, dv) = (2, 33, 2, 4, 64, 48);
    let cpu = Device::Cpu;
    let width = 2 * hk * dk + hv * dv;
    let qkv = Tensor::randn(0f32, 1.0, (b, t, width), &cpu).unwrap();
    let a = Tensor::randn(0f32, 1.0, (b, t, hv), &cpu).unwrap();
    let bb = Tensor::randn(0f32, 1.0, (b, t, hv), &cpu).unwrap();
    let a_log = Tensor::rand(0f32, 2.5, hv, &cpu).unwrap();
    let dt = (Tensor::rand(0f32, 1.0, hv, &cpu).unwrap() - 3.0).unwrap();
    let s0 = Tensor::randn(0f32, 0.5, (b, hv, dk, dv), &cpu).unwrap();
    let heads = GdnHeads {
        k_heads: hk,
        v_heads: hv,
        k_dim: dk,
        v_dim: dv,
    };
    let d = gpu();
    let on = |t: &Tensor| t.to_device(&d).unwrap();
    for (dtype, tol) in [(DType::F32, 1e-5f32), (DType::BF16, 1e-4), (DType::F16, 1e-4)] {
        for mode in [
            DeltaRuleMode::Recurrent {
                keep_all_states: true,
            },
            DeltaRuleMode::Chunked,
        ] {
            let x = qkv.to_dtype(dtype).unwrap();
            let (aa, bx) = (a.to_dtype(dtype).unwrap(), bb.to_dtype(dtype).unwrap());
            let want = fused_gated_delta_rule(&x, &aa, &bx, &a_log, &dt, Some(&s0), heads, mode).unwrap();
            let (gx, ga, gb) = (on(&x), on(&aa), on(&bx));
            let got =
                fused_gated_delta_rule(&gx, &ga, &gb, &on(&a_log), &on(&dt), Some(&on(&s0)), heads, mode)
                    .unwrap();
            // Inputs are the same rounded values on both sides; only the f32 op order differs.
            let e = max_diff(&want.out, &got.out).max(max_diff(&want.state, &got.state));
            assert!(e < tol, "{dtype:?} {mode:?}: {e}");
            if let (Some(w), Some(g)) = (&want.all_states, &got.all_states) {
                assert!(max_diff(w, g) < tol, "{dtype:?}: intermediate states");
            }
        }
    }
}

#[test]
fn conv1d_matches_cpu() {
    let cpu = Device::Cpu;
    let d = gpu();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let x = Tensor::randn(0f32, 1.0, (2, 37, 200), &cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let w = Tensor::randn(0f32, 0.5, (200, 1, 4), &cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let s = Tensor::randn(0f32, 1.0, (2, 200, 3), &cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        for state in [None, Some(&s)] {
            let (y, st) = causal_conv1d(&x, &w, state).unwrap();
            let sd = state.map(|s| s.to_device(&d).unwrap());
            let (gx, gw) = (x.to_device(&d).unwrap(), w.to_device(&d).unwrap());
            let (gy, gst) = causal_conv1d(&gx, &gw, sd.as_ref()).unwrap();
            // f32: ulps; half dtypes: at most one rounding step of the output apart.
            let tol = if dtype == DType::F32 { 1e-5 } else { 2e-2 };
            assert!(max_diff(&y, &gy) < tol, "{dtype:?}: y {}", max_diff(&y, &gy));
            assert_eq!(
                max_diff(&st, &gst),
                0.0,
                "{dtype:?}: the state is a copy of raw inputs"
            );
        }
    }
}

/// The (1+w) RMSNorm, its residual-add form and the gated norm against the CPU reference in each
/// dtype. Both compute in f32 and round once; the GPU sums in another order and uses 1/sqrtf, so
/// f32 agrees to ~1e-6 relative and half types to one ulp of the output (bf16 2^-7, f16 2^-10
/// relative). The residual sum is one rounding of an exact f32 sum on both sides: equal.
#[test]
fn norms_match_cpu() {
    use qwen36_kernels::norm::{GatedRmsNorm, RmsNorm};
    use qwen36_testutil::max_row_rel_err;
    let d = gpu();
    let cpu = Device::Cpu;
    for (dt, tol) in [
        (DType::F32, 2e-6f32),
        (DType::BF16, 2f32.powi(-7)),
        (DType::F16, 2f32.powi(-10)),
    ] {
        for dim in [64usize, 128, 5120] {
            let x = Tensor::randn(0f32, 2.0, (3, 5, dim), &cpu)
                .unwrap()
                .to_dtype(dt)
                .unwrap();
            let r = Tensor::randn(0f32, 2.0, (3, 5, dim), &cpu)
                .unwrap()
                .to_dtype(dt)
                .unwrap();
            let w = Tensor::randn(0f32, 0.3, dim, &cpu).unwrap();
            let (norm_c, norm_g) = (
                RmsNorm::zero_centred(&w, 1e-6).unwrap(),
                RmsNorm::zero_centred(&w.to_device(&d).unwrap(), 1e-6).unwrap(),
            );
            let (xg, rg) = (x.to_device(&d).unwrap(), r.to_device(&d).unwrap());
            let e = max_row_rel_err(&norm_g.forward(&xg).unwrap(), &norm_c.forward(&x).unwrap());
            assert!(e <= tol, "{dt:?} {dim}: rms_norm {e}");
            let (yc, sc) = norm_c.forward_residual(&x, &r).unwrap();
            let (yg, sg) = norm_g.forward_residual(&xg, &rg).unwrap();
            assert_eq!(max_diff(&sc, &sg), 0.0, "{dt:?} {dim}: residual sum");
            let e = max_row_rel_err(&yg, &yc);
            assert!(e <= tol, "{dt:?} {dim}: residual rms_norm {e}");

            let o = Tensor::randn(0f32, 0.1, (3, 5, dim), &cpu).unwrap();
            let (gated_c, gated_g) = (
                GatedRmsNorm::new(&w, 1e-6).unwrap(),
                GatedRmsNorm::new(&w.to_device(&d).unwrap(), 1e-6).unwrap(),
            );
            let yc = gated_c.forward(&o, &r, dt).unwrap();
            let yg = gated_g.forward(&o.to_device(&d).unwrap(), &rg, dt).unwrap();
            assert_eq!(yg.dtype(), dt);
            let e = max_row_rel_err(&yg, &yc);
            assert!(e <= tol, "{dt:?} {dim}: gated {e}");
        }
    }
}
