//! CUDA kernels against the CPU references (built with `--features cuda`, run on a GPU by
//! scripts/gpu-check). f32 tolerance 1e-5: the kernels fuse multiply-adds and sum in another order
//! than the CPU loops, which moves results by a few ulps over 100+ tokens of O(1) values.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use qwen36_kernels::attention::{causal_softmax, AttentionInputs};
use qwen36_kernels::conv1d::causal_conv1d;
use qwen36_kernels::delta_rule::{
    chunked_gated_delta_rule, fused_gated_delta_rule, recurrent_gated_delta_rule, DeltaRuleInputs,
    DeltaRuleMode, DeltaRuleOutput, GdnHeads, GdnParams, CHUNK_SIZE,
};
use qwen36_kernels::linear::reference::{fp8_quantize_activations as fp8_quantize_cpu, fp8_w8a8_linear};
use qwen36_kernels::linear::{fp8_gemm_available, fp8_gemm_min_rows, TILE_MAX_ROWS};
use qwen36_kernels::norm::l2_norm;
use qwen36_kernels::{ChunkPath, DecodeMergePath, Fp8GemmPath, KernelPolicy, SkinnyPath};
use qwen36_testutil::max_abs_diff as max_diff;

/// The default kernel policy (every call below passes its policy explicitly, so tests may run in
/// parallel).
const P: &KernelPolicy = &KernelPolicy::DEFAULT;

/// The default policy with the decode attention's splits merged in the kernel, then by the
/// merge kernels (the default picks one by the launch's size).
const MERGES: [KernelPolicy; 2] = [
    KernelPolicy {
        decode_merge: DecodeMergePath::InKernel,
        ..KernelPolicy::DEFAULT
    },
    KernelPolicy {
        decode_merge: DecodeMergePath::Kernels,
        ..KernelPolicy::DEFAULT
    },
];

/// The default policy with `chunk` as the chunked delta rule's kernels.
fn chunk_policy(chunk: ChunkPath) -> KernelPolicy {
    KernelPolicy {
        chunk,
        ..KernelPolicy::DEFAULT
    }
}

/// The default policy with `skinny` as the few-row linear kernel.
fn skinny_policy(skinny: SkinnyPath) -> KernelPolicy {
    KernelPolicy {
        skinny,
        ..KernelPolicy::DEFAULT
    }
}

thread_local! {
    /// The next seed of this test's draws (each test runs on its own thread, so its tensors do
    /// not depend on which other tests run).
    static NEXT_SEED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Normal samples with standard deviation `std` on the CPU, rounded to `dt`; each call draws
/// from the next seeded stream.
fn randn(std: f32, shape: impl Into<candle_core::Shape>, dt: DType) -> Tensor {
    let seed = NEXT_SEED.with(|s| s.replace(s.get() + 1));
    qwen36_testutil::randn(seed, std, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dt)
        .unwrap()
}

/// Tolerances, relative to each output row's scale, of a kernel that rounds once at its output
/// and sums in f32 in another order than the CPU reference: half an ulp of the dtype doubled
/// (2^-7 bf16, 2^-10 f16); f32 sums of a few thousand terms, 2e-6.
const ONE_ROUNDING: [(DType, f32); 3] = [
    (DType::F32, 2e-6),
    (DType::BF16, 1.0 / 128.0),
    (DType::F16, 1.0 / 1024.0),
];

/// A projection's `[out, k]` weight on the CPU, entries of scale 1/√k (unit-scale outputs for
/// unit-scale inputs), in `dt`.
fn weight(out: usize, k: usize, dt: DType) -> Tensor {
    randn((k as f32).sqrt().recip(), (out, k), dt)
}

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
    let g = (qwen36_testutil::rand_uniform(521, 0f32, 1.0, (b, t, hv), &cpu).unwrap() * -1.2).unwrap();
    Inputs {
        q: l2_norm(
            &qwen36_testutil::randn(502, 1.0, (b, t, hk, dk), &cpu).unwrap(),
            1e-6,
        )
        .unwrap(),
        k: l2_norm(
            &qwen36_testutil::randn(503, 1.0, (b, t, hk, dk), &cpu).unwrap(),
            1e-6,
        )
        .unwrap(),
        v: qwen36_testutil::randn(504, 1.0, (b, t, hv, dv), &cpu).unwrap(),
        g,
        beta: qwen36_testutil::rand_uniform(522, 0.01f32, 0.99, (b, t, hv), &cpu).unwrap(),
        s0: qwen36_testutil::randn(505, 0.5, (b, hv, dk, dv), &cpu).unwrap(),
    }
}

/// Inputs of the fused op on the CPU: the projection rows qkv [b, t, 2·hk·dk + hv·dv] and the gate
/// projections a, b [b, t, hv] (normal, in f32), a_log and dt_bias [hv], an initial state.
struct FusedInputs {
    qkv: Tensor,
    a: Tensor,
    b: Tensor,
    a_log: Tensor,
    dt_bias: Tensor,
    s0: Tensor,
    heads: GdnHeads,
}

fn fused_inputs(b: usize, t: usize, hk: usize, hv: usize, dk: usize, dv: usize) -> FusedInputs {
    let cpu = Device::Cpu;
    FusedInputs {
        qkv: qwen36_testutil::randn(506, 1.0, (b, t, 2 * hk * dk + hv * dv), &cpu).unwrap(),
        a: qwen36_testutil::randn(507, 1.0, (b, t, hv), &cpu).unwrap(),
        b: qwen36_testutil::randn(508, 1.0, (b, t, hv), &cpu).unwrap(),
        a_log: qwen36_testutil::rand_uniform(523, 0f32, 2.5, hv, &cpu).unwrap(),
        dt_bias: (qwen36_testutil::rand_uniform(524, 0f32, 1.0, hv, &cpu).unwrap() - 3.0).unwrap(),
        s0: qwen36_testutil::randn(509, 0.5, (b, hv, dk, dv), &cpu).unwrap(),
        heads: GdnHeads {
            k_heads: hk,
            v_heads: hv,
            k_dim: dk,
            v_dim: dv,
        },
    }
}

/// `fused_gated_delta_rule` with `path` as the chunked kernels.
#[allow(clippy::too_many_arguments)]
fn fused_on_path(
    path: ChunkPath,
    qkv: &Tensor,
    a: &Tensor,
    b: &Tensor,
    a_log: &Tensor,
    dt_bias: &Tensor,
    s0: &Tensor,
    heads: GdnHeads,
    mode: DeltaRuleMode,
) -> DeltaRuleOutput {
    fused_gated_delta_rule(
        qkv,
        a,
        b,
        GdnParams::new(a_log, dt_bias, heads),
        Some(s0),
        mode,
        &chunk_policy(path),
    )
    .unwrap()
}

/// The fused recurrent kernel's 64-register variants, which grids of 1024 blocks or more take
/// when they keep only the final state (batches: here 16 sequences x 32 value heads x 4 column
/// tiles, and dk 32 / 64 / 128 for each variant; more items than an H100's or H200's 132 SMs hold
/// at once, so blocks take several), against the CPU reference at the fused test's tolerances;
/// and the same grids keeping every state (the other variants: the batch ones store none).
#[test]
fn batched_recurrent_kernel_matches_cpu() {
    let d = gpu();
    let on = |t: &Tensor| t.to_device(&d).unwrap();
    for dk in [32, 64, 128] {
        let x = fused_inputs(16, 3, 4, 32, dk, 128);
        for (dtype, tol) in [(DType::F32, 1e-5f32), (DType::BF16, 1e-4)] {
            let (qkv, a, b) = (
                x.qkv.to_dtype(dtype).unwrap(),
                x.a.to_dtype(dtype).unwrap(),
                x.b.to_dtype(dtype).unwrap(),
            );
            for keep_all_states in [false, true] {
                let mode = DeltaRuleMode::Recurrent { keep_all_states };
                let want = fused_gated_delta_rule(
                    &qkv,
                    &a,
                    &b,
                    GdnParams::new(&x.a_log, &x.dt_bias, x.heads),
                    Some(&x.s0),
                    mode,
                    P,
                )
                .unwrap();
                let got = fused_gated_delta_rule(
                    &on(&qkv),
                    &on(&a),
                    &on(&b),
                    GdnParams::new(&on(&x.a_log), &on(&x.dt_bias), x.heads),
                    Some(&on(&x.s0)),
                    mode,
                    P,
                )
                .unwrap();
                let mut e = max_diff(&want.out, &got.out).max(max_diff(&want.state, &got.state));
                if keep_all_states {
                    e = e.max(max_diff(
                        want.all_states.as_ref().unwrap(),
                        got.all_states.as_ref().unwrap(),
                    ));
                }
                assert!(e < tol, "dk {dk} {dtype:?} keep {keep_all_states}: {e}");
            }
        }
    }
}

/// The CUDA kernels run chunks of `CHUNK_SIZE` tokens: another chunk size is an error naming
/// both (it was silently ignored).
#[test]
fn chunked_refuses_other_chunk_sizes_on_cuda() {
    let x = inputs(1, 10, 1, 2, 16, 16);
    let d = gpu();
    let on = |t: &Tensor| t.to_device(&d).unwrap();
    let (q, k, v, g, beta) = (on(&x.q), on(&x.k), on(&x.v), on(&x.g), on(&x.beta));
    let input = DeltaRuleInputs::new(&q, &k, &v, &g, &beta);
    let e = chunked_gated_delta_rule(input, None, 0.25, 32, P)
        .unwrap_err()
        .to_string();
    assert!(e.contains("chunks of 64") && e.contains("not 32"), "{e}");
    assert!(chunked_gated_delta_rule(input, None, 0.25, CHUNK_SIZE, P).is_ok());
}

#[test]
fn recurrent_and_chunked_match_cpu_for_every_row_variant() {
    // dk covers each compiled register-row variant; dv not a multiple of 32 covers partial tiles,
    // and one not a multiple of 4 the columns stored one by one.
    for (dk, dv) in [(8, 24), (16, 40), (32, 30), (64, 64), (128, 128), (256, 96)] {
        let x = inputs(2, 70, 2, 6, dk, dv);
        let d = gpu();
        let on = |t: &Tensor| t.to_device(&d).unwrap();
        let scale = (dk as f32).powf(-0.5);
        let cpu = recurrent_gated_delta_rule(
            DeltaRuleInputs::new(&x.q, &x.k, &x.v, &x.g, &x.beta),
            Some(&x.s0),
            scale,
            true,
            P,
        )
        .unwrap();
        let (q, k, v, g, beta, s0) = (on(&x.q), on(&x.k), on(&x.v), on(&x.g), on(&x.beta), on(&x.s0));
        let gpu_r = recurrent_gated_delta_rule(
            DeltaRuleInputs::new(&q, &k, &v, &g, &beta),
            Some(&s0),
            scale,
            true,
            P,
        )
        .unwrap();
        let e = max_diff(&cpu.out, &gpu_r.out);
        assert!(e < 1e-5, "dk {dk}: out {e}");
        assert!(max_diff(&cpu.state, &gpu_r.state) < 1e-5, "dk {dk}: state");
        let (ca, ga) = (cpu.all_states.unwrap(), gpu_r.all_states.unwrap());
        assert!(max_diff(&ca, &ga) < 1e-5, "dk {dk}: intermediate states");
        let ch = chunked_gated_delta_rule(
            DeltaRuleInputs::new(&x.q, &x.k, &x.v, &x.g, &x.beta),
            None,
            scale,
            CHUNK_SIZE,
            P,
        )
        .unwrap();
        for cols in [16, 32] {
            let policy = chunk_policy(ChunkPath::CudaCores(cols));
            let gch = chunked_gated_delta_rule(
                DeltaRuleInputs::new(&q, &k, &v, &g, &beta),
                None,
                scale,
                CHUNK_SIZE,
                &policy,
            )
            .unwrap();
            assert!(
                max_diff(&ch.out, &gch.out) < 1e-5,
                "dk {dk} cols {cols}: chunked out"
            );
            assert!(
                max_diff(&ch.state, &gch.state) < 1e-5,
                "dk {dk} cols {cols}: chunked state"
            );
        }
    }
}

#[test]
fn fused_kernel_matches_cpu_composition() {
    // 33 tokens: one partial chunk; 150 = 2·64 + 22: chunk boundaries and a partial last chunk.
    for t in [33, 150] {
        let hv = 4;
        let FusedInputs {
            qkv,
            a,
            b: bb,
            a_log,
            dt_bias: dt,
            s0,
            heads,
        } = fused_inputs(2, t, 2, hv, 64, 48);
        let d = gpu();
        let on = |t: &Tensor| t.to_device(&d).unwrap();
        for (dtype, tol) in [(DType::F32, 1e-5f32), (DType::BF16, 1e-4), (DType::F16, 1e-4)] {
            // The chunked mode runs once per compiled chunk-scan variant (16 and 32 state columns
            // per block; dv = 48 leaves the 32-column variant a partial tile).
            for (mode, cols) in [
                (
                    DeltaRuleMode::Recurrent {
                        keep_all_states: true,
                    },
                    None,
                ),
                (DeltaRuleMode::Chunked, Some(16)),
                (DeltaRuleMode::Chunked, Some(32)),
            ] {
                let x = qkv.to_dtype(dtype).unwrap();
                let (aa, bx) = (a.to_dtype(dtype).unwrap(), bb.to_dtype(dtype).unwrap());
                let want = fused_gated_delta_rule(
                    &x,
                    &aa,
                    &bx,
                    GdnParams::new(&a_log, &dt, heads),
                    Some(&s0),
                    mode,
                    P,
                )
                .unwrap();
                let gx = on(&x);
                // a and b as their own tensors, and as views into one wider row (as in the
                // model's projection), which the kernels read in place.
                let ab = on(&Tensor::cat(&[&aa, &bx, &aa.narrow(2, 0, 3).unwrap()], 2).unwrap());
                let views = (ab.narrow(2, 0, hv).unwrap(), ab.narrow(2, hv, hv).unwrap());
                for (ga, gb) in [(on(&aa), on(&bx)), views] {
                    let path = cols.map_or(ChunkPath::Auto, ChunkPath::CudaCores);
                    let got =
                        fused_on_path(path, &gx, &ga, &gb, &on(&a_log), &on(&dt), &on(&s0), heads, mode);
                    // Inputs are the same rounded values on both sides; only the f32 op order differs.
                    let e = max_diff(&want.out, &got.out).max(max_diff(&want.state, &got.state));
                    let strided = !ga.is_contiguous();
                    assert!(
                        e < tol,
                        "t {t} {dtype:?} {mode:?} {cols:?} strided {strided}: {e}"
                    );
                    if let (Some(w), Some(g)) = (&want.all_states, &got.all_states) {
                        assert!(max_diff(w, g) < tol, "{dtype:?}: intermediate states");
                    }
                }
            }
        }
    }
}

/// The bf16 chunked path on tensor cores (fla's precision: bf16 operands, f32 accumulation and f32
/// state) against the f32 CPU reference on the same bf16 inputs. Errors are measured against each
/// tensor's largest magnitude: an output row can be small where the state it reads is not, so a
/// row's own scale does not bound the rounding of the state. Each product rounds one or both
/// operands to bf16 (2^-9 relative each) and the intermediates U, W, Vt and the state copy are
/// rounded on their way, a chain of a few roundings: 2^-6 (eight of them) for the outputs and the
/// final state. Measured (H200, 2026-11-30, an earlier version of these kernels that also rounded
/// Qt and Kt): 2.2e-3 to 2.9e-3 for the outputs, 2.7e-3 to 5.7e-3 for the state, over six draws of
/// both shapes; the f32 CUDA-core path stays within 1e-4
/// (`fused_kernel_matches_cpu_composition`). Shapes: the odd ones of the fused test (dk 64, dv 48:
/// partial tiles, a partial last chunk), the model's head dims over 16 chunks (the error does
/// not grow along the sequence), and dv 256, past the tensor-core prep's tile: it must take the
/// f32 kernels, not lose the columns past 128.
#[test]
fn tensor_core_chunked_path_stays_within_bf16_rounding() {
    let shapes = [
        (2, 150, 2, 4, 64, 48),
        (1, 1000, 2, 4, 128, 128),
        (1, 100, 2, 4, 64, 256),
    ];
    for (b, t, hk, hv, dk, dv) in shapes {
        let inp = fused_inputs(b, t, hk, hv, dk, dv);
        let bf16 = |x: &Tensor| x.to_dtype(DType::BF16).unwrap();
        let (x, a, bb) = (bf16(&inp.qkv), bf16(&inp.a), bf16(&inp.b));
        let (a_log, dt, s0, heads) = (inp.a_log, inp.dt_bias, inp.s0, inp.heads);
        let mode = DeltaRuleMode::Chunked;
        let want = fused_gated_delta_rule(
            &x,
            &a,
            &bb,
            GdnParams::new(&a_log, &dt, heads),
            Some(&s0),
            mode,
            P,
        )
        .unwrap();
        let d = gpu();
        let on = |t: &Tensor| t.to_device(&d).unwrap();
        let largest = |x: &Tensor| -> f32 {
            x.abs()
                .unwrap()
                .flatten_all()
                .unwrap()
                .max(0)
                .unwrap()
                .to_scalar()
                .unwrap()
        };
        // Every scan: 32 and 64 state columns per block followed by the output kernel, and the
        // default (on sm_90 the 64-column scan that forms the outputs itself).
        let mut outs = Vec::new();
        for path in [
            ChunkPath::TensorCores(32),
            ChunkPath::TensorCores(64),
            ChunkPath::Auto,
        ] {
            let got = fused_on_path(
                path,
                &on(&x),
                &on(&a),
                &on(&bb),
                &on(&a_log),
                &on(&dt),
                &on(&s0),
                heads,
                mode,
            );
            assert_eq!(got.state.dtype(), DType::F32, "the state stays f32");
            let eo = max_diff(&got.out, &want.out) / largest(&want.out);
            let es = max_diff(&got.state, &want.state) / largest(&want.state);
            eprintln!(
                "t {t} dk {dk} dv {dv} {path:?}: out {eo:.2e}, state {es:.2e} of the largest magnitude"
            );
            let tol = 2f32.powi(-6);
            assert!(
                eo <= tol && es <= tol,
                "t {t} dk {dk} dv {dv} {path:?}: out {eo}, state {es}"
            );
            outs.push(got.out);
        }
        // The scan with the outputs forms the output kernel's products in its order, from the
        // same bf16 states and Vt: the same bits.
        assert_eq!(
            max_diff(&outs[1], &outs[2]),
            0.0,
            "t {t} dk {dk} dv {dv}: outputs formed in the scan differ from the output kernel's"
        );
    }
}

/// The fused causal softmax against the CPU composition (scale, additive mask, softmax): odd key
/// counts take the scalar kernel, multiples of 8 the vector one; rows of several query blocks.
#[test]
fn causal_softmax_matches_cpu() {
    let d = gpu();
    for (dtype, tol) in [(DType::F32, 1e-6f32), (DType::BF16, 4e-3), (DType::F16, 5e-4)] {
        for (lead, block, keys, pos0) in [(3, 5, 37, 30), (2, 16, 64, 48), (1, 1, 1000, 999), (2, 7, 8, 0)] {
            let x = randn(2.0, (lead, 2 * block, keys), dtype);
            let want = causal_softmax(&x, 0.25, pos0, block, P).unwrap();
            let got = causal_softmax(&x.to_device(&d).unwrap(), 0.25, pos0, block, P).unwrap();
            // One rounding of a probability in [0, 1] to the dtype apart at most.
            let e = max_diff(&want, &got);
            assert!(e < tol, "{dtype:?} keys {keys}: {e}");
        }
    }
}

#[test]
fn conv1d_matches_cpu() {
    let cpu = Device::Cpu;
    let d = gpu();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let x = qwen36_testutil::randn(510, 1.0, (2, 37, 200), &cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let w = qwen36_testutil::randn(511, 0.5, (200, 1, 4), &cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let s = qwen36_testutil::randn(512, 1.0, (2, 200, 3), &cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        // x also as a narrow of wider rows (a projection's conv part, read in place on CUDA).
        let wide = qwen36_testutil::randn(513, 1.0, (2, 37, 300), &cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        for (x, state) in [
            (&x, None),
            (&x, Some(&s)),
            (&wide.narrow(2, 40, 200).unwrap(), Some(&s)),
        ] {
            let (y, st) = causal_conv1d(x, &w, state, P).unwrap();
            let sd = state.map(|s| s.to_device(&d).unwrap());
            let (gx, gw) = (x.to_device(&d).unwrap(), w.to_device(&d).unwrap());
            let gx = if x.is_contiguous() {
                gx
            } else {
                wide.to_device(&d).unwrap().narrow(2, 40, 200).unwrap()
            };
            let (gy, gst) = causal_conv1d(&gx, &gw, sd.as_ref(), P).unwrap();
            // f32: ulps; half dtypes: at most one rounding step of the output apart.
            let tol = if dtype == DType::F32 { 1e-5 } else { 2e-2 };
            assert!(max_diff(&y, &gy) < tol, "{dtype:?}: y {}", max_diff(&y, &gy));
            assert_eq!(
                max_diff(&st, &gst),
                0.0,
                "{dtype:?}: the state is a copy of raw inputs"
            );
        }
        // A prompt's contiguous 16-byte rows take the kernel of a vector of channels a thread
        // (against the CPU; 300 tokens: a partial tile; 4864 channels: blocks of channels, the
        // last partial for each dtype's 4 or 8 channels a thread); the same values one element
        // off that alignment take the one of a channel a thread: equal bits.
        let c2 = 4864;
        let rand = |seed, std, shape: (usize, usize, usize)| {
            qwen36_testutil::randn(seed, std, shape, &cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
        };
        let (long, w2, s2) = (
            rand(519, 1.0, (2, 300, c2)),
            rand(520, 0.5, (c2, 1, 4)),
            rand(521, 1.0, (2, c2, 3)),
        );
        let gx = long.to_device(&d).unwrap();
        let pad = Tensor::zeros((2, 300, 1), dtype, &d).unwrap();
        let shifted = Tensor::cat(&[&pad, &gx, &pad], 2)
            .unwrap()
            .narrow(2, 1, c2)
            .unwrap();
        let (gw, gs) = (w2.to_device(&d).unwrap(), s2.to_device(&d).unwrap());
        for state in [None, Some(&gs)] {
            let (y_vec, st_vec) = causal_conv1d(&gx, &gw, state, P).unwrap();
            let (y_one, st_one) = causal_conv1d(&shifted, &gw, state, P).unwrap();
            assert_eq!(max_diff(&y_vec, &y_one), 0.0, "{dtype:?}: vector kernel y");
            assert_eq!(max_diff(&st_vec, &st_one), 0.0, "{dtype:?}: vector kernel state");
            let (y, st) = causal_conv1d(&long, &w2, state.map(|_| &s2), P).unwrap();
            let tol = if dtype == DType::F32 { 1e-5 } else { 2e-2 };
            assert!(
                max_diff(&y, &y_vec) < tol,
                "{dtype:?}: vector kernel against the CPU"
            );
            assert_eq!(max_diff(&st, &st_vec), 0.0, "{dtype:?}: vector kernel state");
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
    for (dt, tol) in ONE_ROUNDING {
        for dim in [64usize, 128, 5120] {
            let x = randn(2.0, (3, 5, dim), dt);
            let r = randn(2.0, (3, 5, dim), dt);
            let w = qwen36_testutil::randn(514, 0.3, dim, &cpu).unwrap();
            let (norm_c, norm_g) = (
                RmsNorm::zero_centred(&w, 1e-6).unwrap(),
                RmsNorm::zero_centred(&w.to_device(&d).unwrap(), 1e-6).unwrap(),
            );
            let (xg, rg) = (x.to_device(&d).unwrap(), r.to_device(&d).unwrap());
            let e = max_row_rel_err(&norm_g.forward(&xg).unwrap(), &norm_c.forward(&x).unwrap());
            assert!(e <= tol, "{dt:?} {dim}: rms_norm {e}");
            // Per-head rows inside wider rows (attention's q next to its gate): read in place on
            // CUDA (one warp per row up to 1024 bytes).
            let xw = randn(2.0, (3, 5, 2, 2 * dim), dt);
            let (xc, xgv) = (
                xw.narrow(3, 0, dim).unwrap(),
                xw.to_device(&d).unwrap().narrow(3, 0, dim).unwrap(),
            );
            let e = max_row_rel_err(&norm_g.forward(&xgv).unwrap(), &norm_c.forward(&xc).unwrap());
            assert!(e <= tol, "{dt:?} {dim}: rms_norm of a view {e}");
            let (yc, sc) = norm_c.forward_residual(&x, &r).unwrap();
            let (yg, sg) = norm_g.forward_residual(&xg, &rg).unwrap();
            assert_eq!(max_diff(&sc, &sg), 0.0, "{dt:?} {dim}: residual sum");
            let e = max_row_rel_err(&yg, &yc);
            assert!(e <= tol, "{dt:?} {dim}: residual rms_norm {e}");

            let o = qwen36_testutil::randn(515, 0.1, (3, 5, dim), &cpu).unwrap();
            let (gated_c, gated_g) = (
                GatedRmsNorm::new(&w, 1e-6).unwrap(),
                GatedRmsNorm::new(&w.to_device(&d).unwrap(), 1e-6).unwrap(),
            );
            let yc = gated_c.forward(&o, &r, dt).unwrap();
            let yg = gated_g.forward(&o.to_device(&d).unwrap(), &rg, dt).unwrap();
            assert_eq!(yg.dtype(), dt);
            let e = max_row_rel_err(&yg, &yc);
            assert!(e <= tol, "{dt:?} {dim}: gated {e}");
            // z as the projection gives it: [3, 5, 2·dim] columns 7.. of wider rows, two heads.
            let o2 = qwen36_testutil::randn(516, 0.1, (3, 5, 2, dim), &cpu).unwrap();
            let zw = randn(2.0, (3, 5, 2 * dim + 9), dt);
            let z = zw.narrow(2, 7, 2 * dim).unwrap();
            let yc = gated_c.forward(&o2, &z, dt).unwrap();
            let zg = zw.to_device(&d).unwrap().narrow(2, 7, 2 * dim).unwrap();
            let yg = gated_g.forward(&o2.to_device(&d).unwrap(), &zg, dt).unwrap();
            assert_eq!(yg.dims(), o2.dims());
            let e = max_row_rel_err(&yg, &yc);
            assert!(e <= tol, "{dt:?} {dim}: gated, z a projection view {e}");
        }
    }
}

/// The one-row SwiGLU epilogue of the streaming kernel (`Linear::forward_swiglu` over [gate; up])
/// against the CPU's two steps in f32 from the same rounded inputs: one output rounding (2^-8
/// bf16, 2^-11 f16 of the row's scale) plus f32 sums in another order; the kernel does not round
/// the gate and up halves, the CPU f32 path neither. Also a second row (the two steps on CUDA).
#[test]
fn swiglu_epilogue_matches_cpu() {
    use qwen36_kernels::linear::Linear;
    use qwen36_testutil::max_row_rel_err;
    let d = gpu();
    for (dt, tol) in ONE_ROUNDING {
        for (rows, k, i) in [(1, 5120, 1000), (1, 64, 33), (2, 512, 100)] {
            let x = randn(1.0, (1, rows, k), dt);
            let w = weight(2 * i, k, dt);
            let want = Linear::new(w.to_dtype(DType::F32).unwrap(), None)
                .forward_swiglu(&x.to_dtype(DType::F32).unwrap())
                .unwrap();
            let got = Linear::new(w.to_device(&d).unwrap(), None)
                .forward_swiglu(&x.to_device(&d).unwrap())
                .unwrap();
            assert_eq!(got.dims(), [1, rows, i]);
            let e = max_row_rel_err(&got, &want);
            // Two rows take the two steps, which round the halves first: one more rounding.
            let tol = if rows == 1 { tol } else { 3.0 * tol };
            assert!(e <= tol, "{dt:?} rows {rows} k {k} i {i}: {e}");
        }
    }
}

/// The tile kernels with the SwiGLU in their epilogue (`Linear::forward_swiglu` of a dense or
/// FP8 [gate; up] layer, 1..8 rows) against the two steps they replace, the layer's tile kernel
/// then the SwiGLU kernel: equal bit for bit (the epilogue rounds the halves as the two steps
/// do), with 8 warps (the narrow layer, FP8) and 4 (the dense 27B MLP's 34816 rows), widths not
/// multiples of 8 and past 8 rows (the two steps) included; under every policy for FP8 (those
/// whose rows take other kernels run the two steps) and, for dense layers, those without the
/// streaming kernel's one-row epilogue (which does not round the halves).
#[test]
fn swiglu_tile_epilogue_equals_the_two_steps() {
    use qwen36_kernels::activation::swiglu;
    use qwen36_kernels::linear::{Linear, LinearWeight};
    let d = gpu();
    for (k, i) in [(5120, 17408), (1040, 301)] {
        let block = if i % 64 == 0 { [128, 128] } else { [16, 64] };
        let w8 = on_gpu(&fp8_weight(2 * i, k, block), &d);
        for dt in [DType::BF16, DType::F16] {
            let wd = weight(2 * i, k, dt).to_device(&d).unwrap();
            for skinny in POLICIES {
                let policy = skinny_policy(skinny);
                let dense = Linear::new(wd.clone(), None).with_policy(policy);
                let fp8 = Linear::from_weight(LinearWeight::Fp8(w8.clone()), None).with_policy(policy);
                let streams_one_row = matches!(
                    skinny,
                    SkinnyPath::Fastest | SkinnyPath::Streaming(_) | SkinnyPath::Multi(_)
                );
                for (name, layer) in [("dense", &dense), ("fp8", &fp8)] {
                    if name == "dense" && streams_one_row {
                        continue;
                    }
                    for rows in [1, 2, 3, 5, 8, 9] {
                        let x = randn(1.0, (1, rows, k), dt).to_device(&d).unwrap();
                        let got = layer.forward_swiglu(&x).unwrap();
                        let want = swiglu(&layer.forward(&x).unwrap(), P).unwrap();
                        assert_eq!(got.dims(), [1, rows, i]);
                        assert_eq!(
                            max_diff(&got, &want),
                            0.0,
                            "{name} {dt:?} k {k} i {i} {skinny:?} rows {rows}"
                        );
                    }
                }
            }
        }
    }
}

/// The weight-streaming linear kernel (1..=8 rows; outputs narrower and wider than 8192, where
/// the default choice changes) and its matmul fallback (more rows, K not a multiple of 16 bytes,
/// unaligned x) against the CPU matmul of the same rounded inputs, with a bias, and the same
/// with a residual added (`forward_add`, with and without a bias; twice the tolerance, see there).
/// Tolerance, relative to each output row's scale: one output rounding (2^-8 bf16, 2^-11 f16)
/// plus f32 sums in another order over K ≤ 5120 terms (~1e-6 of a row's scale; f32: 2e-6).
#[test]
fn linear_matches_cpu() {
    use qwen36_kernels::linear::Linear;
    use qwen36_testutil::max_row_rel_err;
    let d = gpu();
    for (dt, tol) in ONE_ROUNDING {
        for (rows, k, n) in [
            (1, 5120, 300),
            (2, 64, 33),
            (3, 520, 17),
            (4, 5120, 96),
            (5, 2048, 64),
        ]
        .into_iter()
        .chain([
            (6, 256, 40),
            (7, 128, 9),
            (8, 1024, 70),
            (9, 512, 50),
            (4, 20, 12),
            (1, 512, 8200),
            // The tile kernel with 4 warps per 16 columns, and with k % 64 != 0 (3 rows).
            (2, 1024, 10250),
            (3, 528, 17),
        ]) {
            let x = randn(1.0, (1, rows, k + 1), dt);
            let w = weight(n, k, dt);
            let b = randn(1.0, n, dt);
            let (lc, lg) = (
                Linear::new(
                    w.to_dtype(DType::F32).unwrap(),
                    Some(b.to_dtype(DType::F32).unwrap()),
                ),
                Linear::new(w.to_device(&d).unwrap(), Some(b.to_device(&d).unwrap())),
            );
            // Without a bias the streaming kernels add the residual themselves (from two rows
            // in bf16/f16 the tile kernel).
            let lc_plain = Linear::new(w.to_dtype(DType::F32).unwrap(), None);
            let lg_plain = Linear::new(w.to_device(&d).unwrap(), None);
            let xg = x.to_device(&d).unwrap();
            // Aligned rows (a fresh contiguous copy) and, for the fallback, a view at offset 1.
            for (xc, xg) in [
                (
                    x.narrow(2, 0, k).unwrap(),
                    xg.narrow(2, 0, k).unwrap().contiguous().unwrap(),
                ),
                (x.narrow(2, 1, k).unwrap(), xg.narrow(2, 1, k).unwrap()),
            ] {
                let xc = xc.to_dtype(DType::F32).unwrap();
                let want = lc.forward(&xc).unwrap();
                let want_plain = lc_plain.forward(&xc).unwrap();
                let res = randn(1.0, (1, rows, n), dt);
                let res_g = res.to_device(&d).unwrap();
                let res = res.to_dtype(DType::F32).unwrap();
                // Every kernel variant (1, 2, 4 columns per warp; n not a multiple of 4 covers
                // the partial last warp; from two rows in bf16/f16 the tensor-core kernel, whose
                // k = 64, 128 and 520 leave partial chunks), the matmul, the default choice (in
                // bf16/f16 the tile kernel for every row count, with 4 and 8 warps per 16
                // columns; k = 520 and 20 fall back), the same under `Uniform`, and `Fastest`
                // (one row through the streaming kernel, more through the tile kernel).
                let paths = [
                    SkinnyPath::Streaming(1),
                    SkinnyPath::Streaming(2),
                    SkinnyPath::Streaming(4),
                    SkinnyPath::Matmul,
                    SkinnyPath::Auto,
                    SkinnyPath::Uniform,
                    SkinnyPath::Fastest,
                ];
                for path in paths {
                    let lg = lg.clone().with_policy(skinny_policy(path));
                    let lg_plain = lg_plain.clone().with_policy(skinny_policy(path));
                    let got = lg.forward(&xg).unwrap();
                    assert_eq!(got.dims(), [1, rows, n]);
                    assert_eq!(got.dtype(), dt);
                    let e = max_row_rel_err(&got, &want);
                    assert!(e <= tol, "{dt:?} rows {rows} k {k} n {n} {path:?}: {e}");
                    // With a residual the output can take three roundings (the product, the
                    // bias add, the residual add) of values up to about twice the row's scale
                    // (three unit-scale terms summed): twice the plain tolerance.
                    for (layer, want) in [(&lg, &want), (&lg_plain, &want_plain)] {
                        let got = layer.forward_add(&xg, &res_g).unwrap();
                        assert_eq!(got.dims(), [1, rows, n]);
                        let e = max_row_rel_err(&got, &(want + &res).unwrap());
                        assert!(
                            e <= 2.0 * tol,
                            "{dt:?} rows {rows} k {k} n {n} {path:?}: residual {e}"
                        );
                    }
                }
            }
        }
    }
}

/// An FP8 weight `[n, k]` in `block`s: random e4m3 bytes (no NaN) with block scales of about
/// 1/(4√k) (unit-scale outputs for unit-scale inputs), on the CPU.
fn fp8_weight(n: usize, k: usize, block: [usize; 2]) -> qwen36_kernels::linear::Fp8Weight {
    let seed = NEXT_SEED.with(|s| s.replace(s.get() + 1));
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let bytes = qwen36_testutil::e4m3_bytes(&mut state, n * k, 0x50); // |value| < 8: never NaN
    let q = Tensor::from_raw_buffer(&bytes, DType::F8E4M3, &[n, k], &Device::Cpu).unwrap();
    let (ob, ib) = (n.div_ceil(block[0]), k.div_ceil(block[1]));
    let scale = (randn(1.0, (ob, ib), DType::F32).abs().unwrap() * (0.25 / (k as f64).sqrt()))
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    qwen36_kernels::linear::Fp8Weight::new(q, scale, block).unwrap()
}

/// `w` on the device `d`.
fn on_gpu(w: &qwen36_kernels::linear::Fp8Weight, d: &Device) -> qwen36_kernels::linear::Fp8Weight {
    qwen36_kernels::linear::Fp8Weight::new(
        w.q().to_device(d).unwrap(),
        w.scale().to_device(d).unwrap(),
        w.block(),
    )
    .unwrap()
}

/// FP8 layers at Qwen3.6-27B's shapes in bf16 (the GDN input projection, the MLP's gate|up and
/// down, an output projection) for every kind of row count the model runs (decode, drafts,
/// verify, batched verifies of one and several n-tiles; by default the FP8 GEMM from
/// `fp8_gemm_min_rows` (12 rows of the three large weights, 48 of all), under
/// `Fp8GemmPath::Dequantize` the dequantizing path past [`TILE_MAX_ROWS`]), with PDL on and off: the tile kernel's output within one bf16 rounding of
/// the f32 product, each block's scale applied (checked against the dequantize-then-matmul path
/// in f32), the GEMM's and the dequantizing path's within two (the GEMM against the product of
/// its quantized activations).
#[test]
fn fp8_linear_at_the_27b_shapes() {
    use qwen36_kernels::linear::{Linear, LinearWeight};
    use qwen36_testutil::max_row_rel_err;
    let d = gpu();
    let mut failed = Vec::new();
    for (n, k) in [(16384, 5120), (34816, 5120), (5120, 17408), (5120, 6144)] {
        let w = fp8_weight(n, k, [128, 128]);
        let wg = on_gpu(&w, &d);
        let deq = wg.dequantize(DType::F32).unwrap();
        for rows in [1, 2, 3, 4, 5, 8, 12, 48, 64] {
            let x = randn(1.0, (1, rows, k), DType::BF16).to_device(&d).unwrap();
            let want = x
                .to_dtype(DType::F32)
                .unwrap()
                .broadcast_matmul(&deq.t().unwrap())
                .unwrap();
            // Past the tile kernel the weight dequantized to bf16 (one more rounding per term);
            // on sm_90 by default from fp8_gemm_min_rows the FP8 GEMM, against the product of the
            // activations as it quantizes them (one output rounding; FP8 sums within each
            // 128-element block).
            let streamed = rows <= TILE_MAX_ROWS;
            let gemm = rows >= fp8_gemm_min_rows(n, k) && fp8_gemm_available(&d);
            let want_w8a8 = if gemm {
                Some(fp8_w8a8_linear(&x.reshape((rows, k)).unwrap(), &wg).unwrap())
            } else {
                None
            };
            for (pdl, fp8_gemm) in [
                (false, Fp8GemmPath::Auto),
                (true, Fp8GemmPath::Auto),
                (true, Fp8GemmPath::Dequantize),
            ] {
                let policy = KernelPolicy {
                    pdl,
                    fp8_gemm,
                    ..KernelPolicy::DEFAULT
                };
                let (want, tol) = match &want_w8a8 {
                    Some(w8a8) if fp8_gemm == Fp8GemmPath::Auto => (w8a8.unsqueeze(0).unwrap(), 2.0 / 128.0),
                    _ if streamed => (want.clone(), 1.0 / 128.0),
                    _ => (want.clone(), 2.0 / 128.0),
                };
                let layer = Linear::from_weight(LinearWeight::Fp8(wg.clone()), None).with_policy(policy);
                match layer.forward(&x) {
                    Ok(got) => {
                        let e = max_row_rel_err(&got, &want);
                        if e > tol {
                            failed.push(format!("[{n}, {k}] rows {rows} pdl {pdl} {fp8_gemm:?}: {e}"));
                        }
                    }
                    Err(e) => failed.push(format!("[{n}, {k}] rows {rows} pdl {pdl} {fp8_gemm:?}: {e}")),
                }
            }
        }
    }
    assert!(failed.is_empty(), "{failed:#?}");
}

/// FP8 weights on CUDA: the dequantizing kernel equals the CPU reference bit for bit (f32, bf16,
/// f16); the FP8 GEMVs (the tile kernel for 1..=48 rows of 16-bit activations, the CUDA-core
/// kernel for 1..=8 rows; with and without a residual) and the dequantize-then-matmul path (more
/// rows under `Fp8GemmPath::Dequantize`, `k` not a multiple of 16) against the CPU's f32
/// product of the same activations and dequantized weights, for 128×128 blocks (Qwen's) and
/// smaller ones, shapes not multiples of a block included. Tolerance: one output rounding plus
/// f32 sums in another order (`ONE_ROUNDING`); the matmul path in bf16/f16 also rounds the
/// dequantized weights to the activation dtype (one more rounding of each term: twice that).
#[test]
fn fp8_linear_matches_cpu() {
    use qwen36_kernels::linear::{Linear, LinearWeight};
    use qwen36_testutil::max_row_rel_err;
    let d = gpu();
    // (rows, k, n, block, the activations' scale: 1, past f16's range, far below 1).
    for (rows, k, n, block, mag) in [
        (1, 5120, 300, [128, 128], 1.0),
        (1, 1040, 8200, [128, 128], 1.0),
        (1, 17408, 64, [128, 128], 3e5),
        (2, 336, 130, [128, 128], 1.0),
        (2, 17408, 64, [128, 128], 1e-6),
        (3, 512, 97, [32, 32], 1.0),
        (3, 6144, 200, [128, 128], 1.0),
        (4, 5120, 96, [128, 128], 1.0),
        (5, 272, 64, [16, 48], 1.0),
        (6, 256, 40, [128, 128], 1.0),
        (7, 128, 9, [128, 128], 1.0),
        (8, 1024, 70, [64, 128], 1e5),
        (8, 6144, 33, [128, 128], 1.0),
        (9, 512, 50, [128, 128], 1.0),
        (2, 100, 20, [32, 20], 1.0),
        // Several n-tiles of rows (the tile kernel; past 8 rows the CUDA-core one dequantizes),
        // and past TILE_MAX_ROWS.
        (17, 1040, 97, [32, 64], 1.0),
        (40, 336, 131, [64, 192], 1e5),
        (48, 512, 50, [8, 64], 1.0),
        (49, 1024, 40, [128, 128], 1.0),
        // Past 8 rows on a layer of more than FEW_TILES tiles: 4 warps per 16 columns.
        (12, 1024, 10256, [128, 128], 1.0),
        // Odd column counts and blocks other than 128 on the tensor-core kernel.
        (2, 336, 131, [64, 192], 1.0),
        (3, 1040, 97, [32, 64], 1.0),
        (1, 1024, 33, [16, 128], 1.0),
        // Rows n0 + g and n0 + g + 8 of a 16-column tile in different row blocks.
        (4, 1024, 40, [8, 64], 1.0),
        (2, 640, 50, [24, 128], 1.0),
    ] {
        let w = fp8_weight(n, k, block);
        let wg = on_gpu(&w, &d);
        let deq = w.dequantize(DType::F32).unwrap();
        for (dt, tol) in ONE_ROUNDING {
            let got = wg.dequantize(dt).unwrap();
            assert_eq!(got.dtype(), dt);
            let want = w.dequantize(dt).unwrap().to_dtype(DType::F32).unwrap();
            assert_eq!(
                max_diff(&got.to_dtype(DType::F32).unwrap(), &want),
                0.0,
                "dequantize {dt:?} [{n}, {k}] {block:?}"
            );
            // (f16 activations hold at most 65504.)
            let mag = if dt == DType::F16 { 1.0 } else { mag };
            let x = randn(mag, (1, rows, k), dt);
            let res = randn(mag, (1, rows, n), dt);
            let xf = x.to_dtype(DType::F32).unwrap();
            let want = xf.broadcast_matmul(&deq.t().unwrap()).unwrap();
            let want_res = (&want + res.to_dtype(DType::F32).unwrap()).unwrap();
            // Auto and Uniform: the tile kernel where it takes the operands (Uniform with 8 warps
            // per 16 columns for every row count); Streaming: the CUDA-core one.
            for path in [
                SkinnyPath::Auto,
                SkinnyPath::Uniform,
                SkinnyPath::Streaming(1),
                SkinnyPath::Matmul,
            ] {
                // The rows the kernels take: up to TILE_MAX_ROWS on tensor cores, else 8.
                let tensor = dt != DType::F32 && block[1] % 64 == 0 && path != SkinnyPath::Streaming(1);
                let most = if tensor { TILE_MAX_ROWS } else { 8 };
                let streams = rows <= most && k % 16 == 0 && block[1] % 16 == 0;
                let tol = if streams || dt == DType::F32 {
                    tol
                } else {
                    2.0 * tol
                };
                let policy = KernelPolicy {
                    fp8_gemm: Fp8GemmPath::Dequantize,
                    ..skinny_policy(path)
                };
                let layer = Linear::from_weight(LinearWeight::Fp8(wg.clone()), None).with_policy(policy);
                let (xg, rg) = (x.to_device(&d).unwrap(), res.to_device(&d).unwrap());
                let got = layer.forward(&xg).unwrap();
                assert_eq!((got.dims(), got.dtype()), (&[1, rows, n][..], dt));
                let tol = if path == SkinnyPath::Matmul && dt != DType::F32 {
                    2.0 * tol
                } else {
                    tol
                };
                let e = max_row_rel_err(&got, &want);
                assert!(e <= tol, "{dt:?} rows {rows} k {k} n {n} {block:?} {path:?}: {e}");
                let e = max_row_rel_err(&layer.forward_add(&xg, &rg).unwrap(), &want_res);
                assert!(
                    e <= 2.0 * tol,
                    "{dt:?} rows {rows} k {k} n {n} {block:?} {path:?}: residual {e}"
                );
            }
        }
    }
}

/// The FP8 GEMM's activation quantization (one warp per 128-element group) equals the CPU
/// reference bit for bit, bf16 and f16, with groups of zeros, outliers, values near e4m3's
/// subnormals and ties, and row counts not a multiple of anything.
#[test]
fn fp8_activation_quantization_matches_cpu() {
    use qwen36_kernels::linear::fp8_quantize_activations;
    let d = gpu();
    for (m, k) in [(1, 128), (61, 5120), (3, 384), (130, 256)] {
        for dt in [DType::BF16, DType::F16] {
            let mut x = randn(1.0, (m, k), DType::F32);
            // Row 0's second group zeros (where k allows), its first an outlier; the rest scaled
            // per row over 2^-8..2^8.
            let scale: Vec<f32> = (0..m).map(|r| 2f32.powi((r % 17) as i32 - 8)).collect();
            x = x
                .broadcast_mul(&Tensor::from_vec(scale, (m, 1), &Device::Cpu).unwrap())
                .unwrap();
            let mut v = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            v[3] = 1000.0;
            if k >= 256 {
                v[128..256].fill(0.0);
            }
            let x = Tensor::from_vec(v, (m, k), &Device::Cpu)
                .unwrap()
                .to_dtype(dt)
                .unwrap();
            let (want_q, want_s) = fp8_quantize_cpu(&x).unwrap();
            let (q, s) = fp8_quantize_activations(&x.to_device(&d).unwrap(), P).unwrap();
            assert_eq!((q.dims(), s.dims()), (want_q.dims(), want_s.dims()));
            let bits = |t: &Tensor| {
                t.to_device(&Device::Cpu)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect::<Vec<_>>()
            };
            assert_eq!(bits(&s), bits(&want_s), "{dt:?} [{m}, {k}] scales");
            assert_eq!(bits(&q), bits(&want_q), "{dt:?} [{m}, {k}] values");
        }
    }
}

/// The FP8 GEMM (FP8 layers of `fp8_gemm_min_rows` rows and more, by default on sm_90) against
/// the CPU's product of the activations as it quantizes them and the dequantized weights, in bf16
/// and f16 (with a bias, and closing a residual connection), for row counts of batched verifies
/// and prefill chunks (not multiples of 16 included: the GEMM pads them). Tolerance: one output
/// rounding plus FP8 sums in another order within each 128-element block (twice
/// `ONE_ROUNDING`). The output is farther from the unquantized activations' product than from
/// this one, so the GEMM did run; fewer rows, a weight whose width is not whole 128-column
/// blocks, or whose rows of blocks are not a multiple of 4, run the w8a16 kernels instead (within
/// one rounding of the unquantized product, or two where they dequantize).
#[test]
fn fp8_gemm_matches_cpu() {
    use qwen36_kernels::linear::{Linear, LinearWeight};
    use qwen36_testutil::max_row_rel_err;
    let d = gpu();
    assert!(fp8_gemm_available(&d), "the FP8 GEMM needs an sm_90 device");
    for (rows, k, n) in [
        (49, 1024, 640),
        (64, 5120, 1024),
        (200, 2560, 256),
        (1000, 2048, 512),
        (61, 512, 128),
        (17, 1536, 384),
        // A large weight from 9 rows.
        (9, 5120, 10240),
        // Fewer rows than fp8_gemm_min_rows, partial column blocks, or rows of scale blocks
        // not a multiple of 4: not the GEMM.
        (16, 1024, 640),
        (49, 1024, 40),
        (100, 512, 520),
        (200, 384, 256),
        (17, 768, 384),
        (8, 5120, 10240),
    ] {
        let w = fp8_weight(n, k, [128, 128]);
        let wg = on_gpu(&w, &d);
        let w8a16_w = w.dequantize(DType::F32).unwrap();
        for (dt, tol) in &ONE_ROUNDING[1..] {
            let x = randn(1.0, (rows, k), *dt);
            let want = fp8_w8a8_linear(&x, &w).unwrap();
            let w8a16 = f32_product(&x, &w8a16_w);
            let layer = Linear::from_weight(LinearWeight::Fp8(wg.clone()), None).with_policy(*P);
            let got = layer.forward(&x.to_device(&d).unwrap()).unwrap();
            assert_eq!((got.dims(), got.dtype()), (&[rows, n][..], *dt));
            let e = max_row_rel_err(&got, &want);
            let e16 = max_row_rel_err(&got, &w8a16);
            if !(n % 128 == 0 && k % 512 == 0 && rows >= fp8_gemm_min_rows(n, k)) {
                let tol = if rows <= TILE_MAX_ROWS { *tol } else { 2.0 * tol };
                assert!(e16 <= tol, "{dt:?} rows {rows} k {k} n {n}: {e16} from w8a16");
                continue;
            }
            assert!(e <= 2.0 * tol, "{dt:?} rows {rows} k {k} n {n}: {e}");
            assert!(
                e16 > 2.0 * e,
                "{dt:?} rows {rows} k {k} n {n}: {e16} from w8a16, {e} from w8a8"
            );
            // Through the GEMM with a bias, and closing a residual connection (one more
            // rounding each: three times `ONE_ROUNDING`).
            let (xg, bias, res) = (
                x.to_device(&d).unwrap(),
                randn(1.0, n, *dt),
                randn(1.0, (rows, n), *dt),
            );
            let biased =
                Linear::from_weight(LinearWeight::Fp8(wg.clone()), Some(bias.to_device(&d).unwrap()))
                    .with_policy(*P);
            let want_b = want.broadcast_add(&bias.to_dtype(DType::F32).unwrap()).unwrap();
            let e = max_row_rel_err(&biased.forward(&xg).unwrap(), &want_b);
            assert!(e <= 3.0 * tol, "{dt:?} rows {rows} k {k} n {n}: bias {e}");
            let got = layer.forward_add(&xg, &res.to_device(&d).unwrap()).unwrap();
            let want_r = (&want + res.to_dtype(DType::F32).unwrap()).unwrap();
            let e = max_row_rel_err(&got, &want_r);
            assert!(e <= 3.0 * tol, "{dt:?} rows {rows} k {k} n {n}: residual {e}");
        }
    }
}

/// `x · wᵀ` in f32 (`w` already f32): the unquantized activations' product, w8a16.
fn f32_product(x: &Tensor, w: &Tensor) -> Tensor {
    x.to_dtype(DType::F32).unwrap().matmul(&w.t().unwrap()).unwrap()
}

/// `Fp8GemmPath::FromRows(n)`, the knob for A/B runs of the GEMM's threshold, sends every row
/// count from n through the FP8 GEMM (w8a8: within its tolerance of the w8a8 reference and more
/// than twice as far from the dequantized weight's product) and fewer rows through the tile
/// kernel (w8a16), on a weight that by default takes the GEMM only from 17 rows.
#[test]
fn fp8_gemm_from_rows_moves_the_threshold() {
    use qwen36_kernels::linear::{Linear, LinearWeight};
    use qwen36_testutil::max_row_rel_err;
    let d = gpu();
    assert!(fp8_gemm_available(&d), "the FP8 GEMM needs an sm_90 device");
    let (k, n) = (1024, 640);
    assert!(fp8_gemm_min_rows(n, k) > 3);
    let w = fp8_weight(n, k, [128, 128]);
    let wg = on_gpu(&w, &d);
    let w8a16_w = w.dequantize(DType::F32).unwrap();
    let policy = KernelPolicy {
        fp8_gemm: Fp8GemmPath::FromRows(2),
        ..KernelPolicy::DEFAULT
    };
    let layer = Linear::from_weight(LinearWeight::Fp8(wg), None).with_policy(policy);
    for (dt, tol) in &ONE_ROUNDING[1..] {
        for rows in 1..=3 {
            let x = randn(1.0, (rows, k), *dt);
            let want = fp8_w8a8_linear(&x, &w).unwrap();
            let w8a16 = f32_product(&x, &w8a16_w);
            let got = layer.forward(&x.to_device(&d).unwrap()).unwrap();
            let (e, e16) = (max_row_rel_err(&got, &want), max_row_rel_err(&got, &w8a16));
            if rows < 2 {
                assert!(
                    e16 <= *tol,
                    "{dt:?} rows {rows}: {e16} from w8a16 (the tile kernel)"
                );
            } else {
                assert!(e <= 2.0 * tol, "{dt:?} rows {rows}: {e} from w8a8");
                assert!(
                    e16 > 2.0 * e,
                    "{dt:?} rows {rows}: {e16} from w8a16, {e} from w8a8"
                );
            }
        }
    }
}

/// The tile kernels (every row count 1..8: the default for dense and FP8 weights; up to
/// `TILE_MAX_ROWS`: `SkinnyPath::Uniform`, and FP8 rows 9..48 among themselves by default on
/// weights the FP8 GEMM does not take) are
/// batch-invariant: each row of x gets the same bits whether it is multiplied alone or with up to
/// 47 other rows (one n-tile of 8 rows or several),
/// for FP8 weights (Qwen's blocks and smaller ones) and
/// bf16/f16 weights, bf16 and f16 activations, a column count not a multiple of 16 and one past
/// `FEW_TILES` tiles, with and without a residual, and through the layers that fuse a norm or the
/// SwiGLU at one row under `Fastest`.
#[test]
fn tile_kernel_rows_are_batch_invariant() {
    use qwen36_kernels::linear::{Linear, LinearWeight};
    use qwen36_kernels::norm::RmsNorm;
    let d = gpu();
    let uniform = skinny_policy(SkinnyPath::Uniform);
    for (k, n, block) in [
        (5120, 300, [128, 128]),
        (1040, 98, [8, 64]),
        (2048, 10256, [128, 128]),
    ] {
        let w = fp8_weight(n, k, block);
        let wg = on_gpu(&w, &d);
        let fp8_auto = Linear::from_weight(LinearWeight::Fp8(wg.clone()), None).with_policy(*P);
        let fp8 = Linear::from_weight(LinearWeight::Fp8(wg), None).with_policy(uniform);
        for dt in [DType::BF16, DType::F16] {
            let wd = weight(n, k, dt).to_device(&d).unwrap();
            let dense = Linear::new(wd.clone(), None).with_policy(*P);
            let dense_uniform = Linear::new(wd, None).with_policy(uniform);
            let norm =
                RmsNorm::zero_centred(&randn(0.1, k, DType::F32).to_device(&d).unwrap(), 1e-6).unwrap();
            let x = randn(1.0, (1, TILE_MAX_ROWS, k), dt).to_device(&d).unwrap();
            let res = randn(1.0, (1, TILE_MAX_ROWS, n), dt).to_device(&d).unwrap();
            // (name, layer, the fewest and the most rows that sum alike)
            for (name, layer, least, most) in [
                ("fp8", &fp8, 1, TILE_MAX_ROWS),
                ("fp8 default", &fp8_auto, 1, 8),
                // (None of these weights takes the FP8 GEMM: widths not in whole 128-column
                // blocks, or other blocks.)
                ("fp8 default past 8 rows", &fp8_auto, 9, TILE_MAX_ROWS),
                ("dense", &dense, 1, 8),
                ("dense uniform", &dense_uniform, 1, TILE_MAX_ROWS),
            ] {
                let x = x.narrow(1, 0, most).unwrap().contiguous().unwrap();
                let res = res.narrow(1, 0, most).unwrap().contiguous().unwrap();
                let run = |x: &Tensor, res: &Tensor| {
                    let mut outs = vec![layer.forward(x).unwrap(), layer.forward_add(x, res).unwrap()];
                    if name == "dense" {
                        outs.push(layer.forward_normed(x, &norm).unwrap());
                        outs.push(layer.forward_swiglu(x).unwrap());
                        outs.push(layer.forward_swiglu_normed(x, &norm).unwrap());
                    }
                    outs
                };
                let all = run(&x, &res);
                let counts = (1..=8)
                    .chain([9, 16, 17, 40, 47, 48])
                    .filter(|&r| (least..=most).contains(&r));
                for rows in counts {
                    for start in [0, most - rows] {
                        let xs = x.narrow(1, start, rows).unwrap().contiguous().unwrap();
                        let rs = res.narrow(1, start, rows).unwrap().contiguous().unwrap();
                        for (i, (got, all)) in run(&xs, &rs).iter().zip(&all).enumerate() {
                            let want = all.narrow(1, start, rows).unwrap();
                            assert_eq!(
                                max_diff(got, &want),
                                0.0,
                                "{name} {dt:?} [{n}, {k}] {block:?} rows {start}..{} output {i}",
                                start + rows
                            );
                        }
                    }
                }
            }
        }
    }
}

/// The FP8 tile kernels that prefetch their next round (`KernelPolicy::tile_prefetch`, narrow
/// layers, 1..8 rows) give the bits of those that do not, with and without a residual, bf16 and
/// f16: the 27B's 5120-wide shape, a width not a multiple of 16 and small blocks. (Under the
/// default, `tile_kernel_rows_are_batch_invariant` compares them with the rows past 8 too.)
#[test]
fn prefetching_tile_kernels_give_the_same_bits() {
    use qwen36_kernels::linear::{Linear, LinearWeight};
    let d = gpu();
    let on = KernelPolicy {
        tile_prefetch: true,
        ..*P
    };
    let off = KernelPolicy {
        tile_prefetch: false,
        ..*P
    };
    for (k, n, block) in [
        (6144, 5120, [128, 128]),
        (1040, 98, [8, 64]),
        (5120, 300, [128, 128]),
    ] {
        let w8 = on_gpu(&fp8_weight(n, k, block), &d);
        let layer = |policy| Linear::from_weight(LinearWeight::Fp8(w8.clone()), None).with_policy(policy);
        let (with, without) = (layer(on), layer(off));
        for dt in [DType::BF16, DType::F16] {
            for rows in [1, 2, 3, 5, 8] {
                let x = randn(1.0, (1, rows, k), dt).to_device(&d).unwrap();
                let res = randn(1.0, (1, rows, n), dt).to_device(&d).unwrap();
                let run = |l: &Linear| [l.forward(&x).unwrap(), l.forward_add(&x, &res).unwrap()];
                for (i, (got, want)) in run(&with).iter().zip(run(&without)).enumerate() {
                    assert_eq!(
                        max_diff(got, &want),
                        0.0,
                        "{dt:?} [{n}, {k}] {block:?} rows {rows} output {i}"
                    );
                }
            }
        }
    }
}

/// Every few-row kernel policy: the default, batch-invariant tiles to 48 rows, the fastest one-row
/// kernels, cuBLAS, the streaming kernels.
const POLICIES: [SkinnyPath; 6] = [
    SkinnyPath::Auto,
    SkinnyPath::Uniform,
    SkinnyPath::Fastest,
    SkinnyPath::Matmul,
    SkinnyPath::Streaming(2),
    SkinnyPath::Multi(2),
];

/// A layer fused from an FP8 part and a dense one (an FP8 checkpoint's GDN input projection: FP8
/// qkv|z beside bf16 b|a) runs both parts in one launch of their tile kernels for 1..8 rows: each
/// output equals its part run alone, bit for bit, in either order and after a norm, under every
/// policy (those whose parts take other kernels run them apart); past 8 rows (one launch a part)
/// too. Shapes: the 27B's; widths not multiples of 16 with small blocks (tile counts that a grid
/// of ⌈(n8 + n16)/16⌉ blocks would cut short); a dense part wide enough for 4 warps a tile (run
/// apart).
#[test]
fn mixed_layer_parts_in_one_launch_equal_the_parts() {
    use qwen36_kernels::linear::{Linear, LinearWeight};
    use qwen36_kernels::norm::RmsNorm;
    let d = gpu();
    for (k, n8, n16, block) in [
        (5120, 16384, 96, [128, 128]),
        (1040, 300, 37, [8, 64]),
        (1040, 300, 36, [8, 64]),
        (2048, 300, 10256, [128, 128]),
    ] {
        let wg = on_gpu(&fp8_weight(n8, k, block), &d);
        for dt in [DType::BF16, DType::F16] {
            let wd = weight(n16, k, dt).to_device(&d).unwrap();
            let norm =
                RmsNorm::zero_centred(&randn(0.1, k, DType::F32).to_device(&d).unwrap(), 1e-6).unwrap();
            for skinny in POLICIES {
                let policy = skinny_policy(skinny);
                let fp8 = Linear::from_weight(LinearWeight::Fp8(wg.clone()), None).with_policy(policy);
                let dense = Linear::new(wd.clone(), None).with_policy(policy);
                for fp8_first in [true, false] {
                    let parts = match fp8_first {
                        true => vec![fp8.clone(), dense.clone()],
                        false => vec![dense.clone(), fp8.clone()],
                    };
                    let fused = Linear::fused(parts.clone()).unwrap();
                    for rows in [1, 2, 3, 4, 8, 12] {
                        let x = randn(1.0, (1, rows, k), dt).to_device(&d).unwrap();
                        let normed = norm.forward(&x).unwrap();
                        for (with_norm, input) in [(false, &x), (true, &normed)] {
                            let got = fused.forward_parts(&x, with_norm.then_some(&norm)).unwrap();
                            assert_eq!(got.len(), 2);
                            for (i, (got, part)) in got.iter().zip(&parts).enumerate() {
                                let want = part.forward(input).unwrap();
                                assert_eq!(
                                    max_diff(got, &want),
                                    0.0,
                                    "{dt:?} [{n8} + {n16}, {k}] {skinny:?} FP8 first {fp8_first} \
                                     rows {rows} norm {with_norm} part {i}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The projections that normalise their input (`Linear::forward_normed`,
/// `forward_swiglu_normed`: one row in one kernel, the RMSNorm in its prologue) against the two
/// steps on the GPU, the RMSNorm kernel then the projection: the same arithmetic in the same
/// order, so equal bit for bit, for every columns-per-warp variant and the SwiGLU epilogue. Rows
/// past the kernel's bound (8192 bf16 / 4096 f32 elements) and two rows take the two steps.
#[test]
fn normalising_projection_equals_norm_then_projection() {
    use qwen36_kernels::linear::Linear;
    use qwen36_kernels::norm::RmsNorm;
    let d = gpu();
    for (dt, _) in ONE_ROUNDING {
        for (rows, k, n) in [
            (1, 5120, 300),
            (1, 64, 33),
            (1, 4096, 8200),
            (1, 8192, 40),
            (1, 8200, 24),
            (2, 512, 48),
        ] {
            let x = randn(2.0, (1, rows, k), dt).to_device(&d).unwrap();
            let w = weight(n, k, dt).to_device(&d).unwrap();
            let norm =
                RmsNorm::zero_centred(&qwen36_testutil::randn(517, 0.3, k, &d).unwrap(), 1e-6).unwrap();
            let lin = Linear::new(w, None);
            for path in [
                SkinnyPath::Streaming(1),
                SkinnyPath::Streaming(2),
                SkinnyPath::Streaming(4),
                SkinnyPath::Fastest,
                SkinnyPath::Auto,
            ] {
                let lin = lin.clone().with_policy(skinny_policy(path));
                let want = lin.forward(&norm.forward(&x).unwrap()).unwrap();
                let got = lin.forward_normed(&x, &norm).unwrap();
                assert_eq!(got.dims(), [1, rows, n]);
                assert_eq!(
                    max_diff(&got, &want),
                    0.0,
                    "{dt:?} rows {rows} k {k} n {n} {path:?}"
                );
            }
            // The SwiGLU epilogue pairs [gate; up] rows: n even (33 covers partial warps above).
            // (`Fastest`: the default takes one 16-bit row through the tile kernel, in two steps.)
            if n % 2 == 0 {
                let lin = lin.clone().with_policy(skinny_policy(SkinnyPath::Fastest));
                let want = lin.forward_swiglu(&norm.forward(&x).unwrap()).unwrap();
                let got = lin.forward_swiglu_normed(&x, &norm).unwrap();
                assert_eq!(got.dims(), [1, rows, n / 2]);
                assert_eq!(
                    max_diff(&got, &want),
                    0.0,
                    "{dt:?} rows {rows} k {k} n {n}: swiglu"
                );
            }
        }
    }
}

/// A residual connection closed as the stream entering the next block
/// (`Linear::forward_add_norm`) gives the bits of `forward_add` then the next norm: rows that
/// the tile kernel takes (it adds the residual as it writes; no normalisation comes with them)
/// and rows through cuBLAS or the FP8 GEMM, whose residual the norm's kernel adds (outputs of
/// 2560: the block-per-row kernel; of 320, rows a warp normalises: the two steps).
#[test]
fn residual_closed_into_the_next_norm_equals_the_two_steps() {
    use qwen36_kernels::linear::{Linear, LinearWeight};
    use qwen36_kernels::norm::RmsNorm;
    let d = gpu();
    for ((dt, _), n) in ONE_ROUNDING.into_iter().flat_map(|r| [(r, 320), (r, 2560)]) {
        let k = 512;
        let norm = RmsNorm::zero_centred(&qwen36_testutil::randn(518, 0.3, n, &d).unwrap(), 1e-6).unwrap();
        let dense = Linear::new(weight(n, k, dt).to_device(&d).unwrap(), None).with_policy(*P);
        let mut layers = vec![("dense", dense)];
        if fp8_gemm_available(&d) {
            let w8 = on_gpu(&fp8_weight(n, k, [128, 128]), &d);
            layers.push((
                "fp8",
                Linear::from_weight(LinearWeight::Fp8(w8), None).with_policy(*P),
            ));
        }
        for (what, layer) in &layers {
            for rows in [1usize, 4, 16, 64] {
                let x = randn(1.0, (1, rows, k), dt).to_device(&d).unwrap();
                let res = randn(1.0, (1, rows, n), dt).to_device(&d).unwrap();
                let sum = layer.forward_add(&x, &res).unwrap();
                let got = layer.forward_add_norm(&x, &res, Some(&norm)).unwrap();
                assert_eq!(max_diff(&got.x, &sum), 0.0, "{dt:?} {what} {n} rows {rows}: sum");
                // One 16-bit row: the tile kernel adds the residual; 64 rows: a matmul.
                if rows == 1 && dt != DType::F32 {
                    assert!(got.normed.is_none(), "{dt:?} {what} rows {rows}");
                }
                if rows == 64 {
                    assert!(got.normed.is_some(), "{dt:?} {what} rows {rows}");
                }
                // A residual off a 16-byte boundary (its kernel would not take vectors): the
                // two steps, the same bits.
                if rows == 64 {
                    let flat = randn(1.0, rows * n + 1, dt).to_device(&d).unwrap();
                    let odd = flat
                        .narrow(0, 1, rows * n)
                        .unwrap()
                        .reshape((1, rows, n))
                        .unwrap();
                    let got = layer.forward_add_norm(&x, &odd, Some(&norm)).unwrap();
                    let sum = layer.forward_add(&x, &odd).unwrap();
                    assert_eq!(max_diff(&got.x, &sum), 0.0, "{dt:?} {what} {n}: off-boundary sum");
                    let normed = got.normed.expect("a matmul's residual");
                    let e = max_diff(&normed, &norm.forward(&sum).unwrap());
                    assert_eq!(e, 0.0, "{dt:?} {what} {n}: off-boundary norm");
                }
                if let Some(normed) = got.normed {
                    let want = norm.forward(&sum).unwrap();
                    assert_eq!(
                        max_diff(&normed, &want),
                        0.0,
                        "{dt:?} {what} {n} rows {rows}: norm"
                    );
                }
            }
        }
    }
}

/// A residual stream written by the tile kernels leaves the next block's norm deferred
/// (`KernelPolicy::defer_norm`), and the block's tile kernels that read it (dense, FP8, the SwiGLU
/// epilogue, a mixed layer's pair) give the projection of the stream's RMSNorm: within one
/// rounding of the f32 product of the rows they read (`x·g` rounded, each row's sums times
/// 1/rms), and within two of the f32 product of the exact normalisation (the rounding moved from
/// `x·g/rms` to `x·g`). The stream itself keeps the bits of `forward_add`; a row's outputs are
/// the same bits alone and among 8 (the sums of squares and 1/rms are per row). Stream widths of
/// 320 and 65 16-column parts (a partial last lane of the parts' sum); producers dense and FP8;
/// consumers of 8 warps a block and (10256 columns) of 4. Only bf16 streams defer (an f16 one
/// times the scale could overflow), and not under `SkinnyPath::Uniform`.
#[test]
fn deferred_norm_projections_match_the_norm_then_projection() {
    use qwen36_kernels::linear::{Linear, LinearWeight};
    use qwen36_kernels::norm::{RmsNorm, Stream};
    use qwen36_testutil::max_row_rel_err;
    let d = gpu();
    let rows_of = |t: &Tensor, r: usize| t.narrow(1, 0, r).unwrap().contiguous().unwrap();
    let tol = 1.0 / 128.0; // one bf16 rounding (ONE_ROUNDING)
    for (hidden, k_in, n, block) in [(5120, 1024, 640, [128, 128]), (1040, 512, 10256, [8, 64])] {
        for dt in [DType::BF16, DType::F16] {
            let g = qwen36_testutil::randn(519, 0.3, hidden, &d).unwrap();
            let norm = RmsNorm::zero_centred(&g, 1e-6).unwrap();
            let scale = (g.to_device(&Device::Cpu).unwrap() + 1.0).unwrap();
            let dense_in = Linear::new(weight(hidden, k_in, dt).to_device(&d).unwrap(), None).with_policy(*P);
            let fp8_in = Linear::from_weight(
                LinearWeight::Fp8(on_gpu(&fp8_weight(hidden, k_in, block), &d)),
                None,
            )
            .with_policy(*P);
            let wd = weight(n, hidden, dt);
            let w8 = fp8_weight(n, hidden, block);
            let dense = Linear::new(wd.to_device(&d).unwrap(), None).with_policy(*P);
            let fp8 = Linear::from_weight(LinearWeight::Fp8(on_gpu(&w8, &d)), None).with_policy(*P);
            let pair = Linear::fused(vec![fp8.clone(), dense.clone()]).unwrap();
            let outs = |s: &Stream| -> Vec<Tensor> {
                let d_ = s.deferred(Some(&norm)).expect("a deferred norm");
                let mut v = vec![
                    dense.forward_deferred(d_).unwrap().expect("dense tiles"),
                    fp8.forward_deferred(d_).unwrap().expect("FP8 tiles"),
                    dense.forward_swiglu_deferred(d_).unwrap().expect("SwiGLU tiles"),
                ];
                let parts = pair.forward_parts_stream(s, Some(&norm)).unwrap();
                assert_eq!(max_diff(&parts[0], &v[1]), 0.0, "the pair's FP8 part");
                assert_eq!(max_diff(&parts[1], &v[0]), 0.0, "the pair's dense part");
                v.push(parts[0].clone());
                v
            };
            for (what, producer) in [("dense", &dense_in), ("fp8", &fp8_in)] {
                let x8 = randn(1.0, (1, 8, k_in), dt).to_device(&d).unwrap();
                let res8 = randn(1.0, (1, 8, hidden), dt).to_device(&d).unwrap();
                let mut alone = None;
                for rows in [1, 3, 8] {
                    let (x, res) = (rows_of(&x8, rows), rows_of(&res8, rows));
                    let s = producer.forward_add_norm(&x, &res, Some(&norm)).unwrap();
                    let at = format!("{dt:?} {what} [{hidden}] rows {rows}");
                    let uniform = producer.clone().with_policy(skinny_policy(SkinnyPath::Uniform));
                    let u = uniform.forward_add_norm(&x, &res, Some(&norm)).unwrap();
                    assert!(u.deferred.is_none(), "{at}: Uniform");
                    if dt == DType::F16 {
                        assert!(s.deferred.is_none(), "{at}");
                        continue;
                    }
                    assert!(s.normed.is_none(), "{at}");
                    assert_eq!(
                        max_diff(&s.x, &producer.forward_add(&x, &res).unwrap()),
                        0.0,
                        "{at}: sum"
                    );
                    // The rows as the kernels read them, and the exact normalisation, in f32.
                    let y =
                        s.x.squeeze(0)
                            .unwrap()
                            .to_device(&Device::Cpu)
                            .unwrap()
                            .to_dtype(DType::F32)
                            .unwrap();
                    let inv = (y.sqr().unwrap().mean_keepdim(1).unwrap() + 1e-6)
                        .unwrap()
                        .sqrt()
                        .unwrap()
                        .recip()
                        .unwrap();
                    let scaled = y
                        .broadcast_mul(&scale)
                        .unwrap()
                        .to_dtype(dt)
                        .unwrap()
                        .to_dtype(DType::F32)
                        .unwrap();
                    let exact = y.broadcast_mul(&inv).unwrap().broadcast_mul(&scale).unwrap();
                    let got = outs(&s);
                    let wf = [
                        wd.to_dtype(DType::F32).unwrap(),
                        w8.dequantize(DType::F32).unwrap(),
                    ];
                    for (i, w) in wf.iter().enumerate() {
                        let got = got[i].squeeze(0).unwrap();
                        let read = f32_product(&scaled, w).broadcast_mul(&inv).unwrap();
                        let e = max_row_rel_err(&got, &read);
                        assert!(e <= tol, "{at} consumer {i}: {e} from the rows read");
                        let e = max_row_rel_err(&got, &f32_product(&exact, w));
                        assert!(e <= 2.0 * tol, "{at} consumer {i}: {e} from the exact norm");
                    }
                    // The SwiGLU epilogue: the dense projection's halves (checked above), then
                    // the activation, bit for bit.
                    let want = qwen36_kernels::activation::swiglu(&got[0], P).unwrap();
                    assert_eq!(max_diff(&got[2], &want), 0.0, "{at} SwiGLU");
                    match &alone {
                        None => alone = Some(got),
                        Some(first) => {
                            for (i, (a, b)) in first.iter().zip(&got).enumerate() {
                                assert_eq!(
                                    max_diff(a, &rows_of(b, 1)),
                                    0.0,
                                    "{at} consumer {i}: row 0 alone"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The in-place state updates (decode and verify passes of a model whose states live in fixed
/// buffers) against the fresh-state ops on the same GPU: the recurrent kernel is the same code
/// reading and writing one buffer, and the in-place conv kernel sums the same products in the
/// same order, so outputs, kept states and the updated buffers must match bit for bit.
#[test]
fn in_place_state_updates_equal_fresh_ones() {
    use qwen36_kernels::conv1d::causal_conv1d_in_place;
    use qwen36_kernels::delta_rule::fused_gated_delta_rule_in_place;
    let d = gpu();
    let (b, hk, hv, dk, dv) = (2, 2, 4, 64, 48);
    let heads = GdnHeads {
        k_heads: hk,
        v_heads: hv,
        k_dim: dk,
        v_dim: dv,
    };
    let width = 2 * hk * dk + hv * dv;
    let a_log = qwen36_testutil::rand_uniform(525, 0f32, 2.5, hv, &d).unwrap();
    let dt_bias = (qwen36_testutil::rand_uniform(526, 0f32, 1.0, hv, &d).unwrap() - 3.0).unwrap();
    for dtype in [DType::F32, DType::BF16] {
        for (t, keep) in [(1, false), (1, true), (4, true), (5, false)] {
            // qkv and the gates as views into one projection row, as the layer reads them.
            let proj = randn(1.0, (b, t, width + 2 * hv + 5), dtype)
                .to_device(&d)
                .unwrap();
            let qkv = proj.narrow(2, 0, width).unwrap().contiguous().unwrap();
            let (ga, gb) = (
                proj.narrow(2, width, hv).unwrap(),
                proj.narrow(2, width + hv, hv).unwrap(),
            );
            let s0 = qwen36_testutil::randn(518, 0.5, (b, hv, dk, dv), &d).unwrap();
            let mode = DeltaRuleMode::Recurrent {
                keep_all_states: keep,
            };
            let want = fused_gated_delta_rule(
                &qkv,
                &ga,
                &gb,
                GdnParams::new(&a_log, &dt_bias, heads),
                Some(&s0),
                mode,
                P,
            )
            .unwrap();
            let state = s0.copy().unwrap();
            let all = keep.then(|| Tensor::zeros((b, t, hv, dk, dv), DType::F32, &d).unwrap());
            let got = fused_gated_delta_rule_in_place(
                &qkv,
                &ga,
                &gb,
                GdnParams::new(&a_log, &dt_bias, heads),
                &state,
                None,
                all.as_ref(),
                P,
            )
            .unwrap();
            assert_eq!(
                got.state.id(),
                state.id(),
                "the output state is the caller's buffer"
            );
            assert_eq!(max_diff(&got.out, &want.out), 0.0, "{dtype:?} t {t}");
            assert_eq!(max_diff(&state, &want.state), 0.0, "{dtype:?} t {t}");
            assert_eq!(got.all_states.is_some(), keep);
            if let (Some(g), Some(w), Some(all)) = (&got.all_states, &want.all_states, &all) {
                assert_eq!(
                    g.id(),
                    all.id(),
                    "every token's state lands in the caller's buffer"
                );
                assert_eq!(max_diff(all, w), 0.0, "{dtype:?} t {t}");
            }

            let (c, k) = (200, 4);
            let x = randn(1.0, (b, t, c + 60), dtype).to_device(&d).unwrap();
            let x = x.narrow(2, 40, c).unwrap();
            let w = randn(0.5, (c, 1, k), dtype).to_device(&d).unwrap();
            let st0 = randn(1.0, (b, c, k - 1), dtype).to_device(&d).unwrap();
            let (y_want, st_want) = causal_conv1d(&x, &w, Some(&st0), P).unwrap();
            let st = st0.copy().unwrap();
            let win = keep.then(|| Tensor::zeros((b, c, k - 1 + t), dtype, &d).unwrap());
            let y = causal_conv1d_in_place(&x, &w, &st, None, win.as_ref(), P).unwrap();
            assert_eq!(max_diff(&y, &y_want), 0.0, "conv {dtype:?} t {t}");
            assert_eq!(max_diff(&st, &st_want), 0.0, "conv state {dtype:?} t {t}");
            // The kept window: the state before, then the raw inputs, channel-major.
            if let Some(win) = win {
                let want = Tensor::cat(&[&st0, &x.transpose(1, 2).unwrap()], 2).unwrap();
                assert_eq!(max_diff(&win, &want), 0.0, "conv window {dtype:?} t {t}");
            }
        }
    }
}

/// The split-K decode attention kernel against the CPU reference: one and five new tokens, six
/// query heads per KV head (Qwen3.6-27B's grouping), head dims 256 and 64, lengths inside one
/// span, across spans, filling the buffer, and buffers of more than 32 spans (the two-level
/// merge, with a partial last group), and lengths past 64 tiles of 64 keys (several tiles per
/// split in the tensor-core kernel). f32 (the general kernel): sums in another order over ≤ 8500
/// keys, 1e-5; bf16/f16 run the tensor-core kernel, which rounds P to the input dtype before P·V
/// (as flash-attn does) and the output once: the tolerance of `prefill_attention_matches_cpu`,
/// doubled where an output gate is applied (the reference rounds its sigmoid and the product,
/// the kernel neither: as in that test).
#[test]
fn decode_attention_matches_cpu() {
    use qwen36_kernels::attention::decode_attention;
    use qwen36_testutil::max_row_rel_err;
    let d = gpu();
    let cpu = Device::Cpu;
    for (dt, tol) in [
        (DType::F32, 1e-5f32),
        (DType::BF16, 2f32.powi(-6)),
        (DType::F16, 2f32.powi(-9)),
    ] {
        for (t, hd, cap, len) in [
            (1, 256, 64, 1),
            (1, 256, 300, 217),
            (5, 256, 96, 96),
            (5, 64, 80, 37),
            (2, 64, 40, 33),
            (1, 256, 2100, 2047),
            (5, 64, 1500, 1100),
            (1, 128, 9000, 8500),
            (4, 256, 6000, 5000),
            // 58 splits of 9 tiles: merged in two groups of up to 32 (the tensor-core kernel).
            (1, 64, 40000, 33001),
        ] {
            let (b, h, g) = (2, 2, 6);
            let q = randn(1.0, (b, h, g * t, hd), dt);
            let k = randn(1.0, (b, h, cap, hd), dt);
            let v = randn(1.0, (b, h, cap, hd), dt);
            let l = Tensor::new(&[len as u32], &cpu).unwrap();
            let scale = (hd as f64).powf(-0.5);
            // Odd lengths also apply an output gate read as a strided view.
            let gate =
                (len % 2 == 1).then(|| randn(1.0, (b, t, h * g, 2 * hd), dt).narrow(3, hd, hd).unwrap());
            let want =
                decode_attention(AttentionInputs::new(&q, &k, &v, gate.as_ref(), scale), &l, t, P).unwrap();
            let on = |x: &Tensor| x.to_device(&d).unwrap();
            let gate_d = gate.as_ref().map(on);
            let tol = if gate.is_some() && dt != DType::F32 {
                2.0 * tol
            } else {
                tol
            };
            let [in_kernel, kernels] = MERGES.map(|policy| {
                let got = decode_attention(
                    AttentionInputs::new(&on(&q), &on(&k), &on(&v), gate_d.as_ref(), scale),
                    &on(&l),
                    t,
                    &policy,
                )
                .unwrap();
                assert_eq!(got.dims(), want.dims());
                let e = max_row_rel_err(&got, &want);
                let merge = policy.decode_merge;
                assert!(e <= tol, "{dt:?} t {t} hd {hd} cap {cap} len {len} {merge:?}: {e}");
                eprintln!(
                    "decode_attention {dt:?} t {t} hd {hd} cap {cap} len {len} gated {} {merge:?}: max row rel err {e:.2e}",
                    gate.is_some()
                );
                got
            });
            // The merge in the kernel repeats the merge kernels' operations in their order.
            let what = format!("{dt:?} t {t} hd {hd} cap {cap} len {len}");
            assert_eq!(max_diff(&in_kernel, &kernels), 0.0, "{what}: the two merges");
        }
    }
}

/// Over a state pool, the in-place GDN kernels (delta rule and conv) with a slot table give
/// bit for bit what they give on the gathered rows alone, write back only those rows, and (a
/// slot past the pool) run that sequence from a zero state and write nothing.
#[test]
fn pooled_in_place_states_equal_gathered_ones() {
    use qwen36_kernels::conv1d::causal_conv1d_in_place;
    use qwen36_kernels::delta_rule::fused_gated_delta_rule_in_place;
    let d = gpu();
    let (b, hk, hv, dk, dv, pool) = (3, 2, 4, 128, 128, 7);
    let heads = GdnHeads {
        k_heads: hk,
        v_heads: hv,
        k_dim: dk,
        v_dim: dv,
    };
    let width = 2 * hk * dk + hv * dv;
    let a_log = qwen36_testutil::rand_uniform(527, 0f32, 2.5, hv, &d).unwrap();
    let dt_bias = (qwen36_testutil::rand_uniform(528, 0f32, 1.0, hv, &d).unwrap() - 3.0).unwrap();
    let layer = GdnParams::new(&a_log, &dt_bias, heads);
    let slots = Tensor::new(&[5u32, 0, 3], &d).unwrap();
    for dtype in [DType::F32, DType::BF16] {
        for (t, keep) in [(1, false), (4, true)] {
            let proj = randn(1.0, (b, t, width + 2 * hv), dtype).to_device(&d).unwrap();
            let qkv = proj.narrow(2, 0, width).unwrap().contiguous().unwrap();
            let (ga, gb) = (
                proj.narrow(2, width, hv).unwrap(),
                proj.narrow(2, width + hv, hv).unwrap(),
            );
            let pool0 = qwen36_testutil::randn(529, 0.5, (pool, hv, dk, dv), &d).unwrap();
            let own = pool0.index_select(&slots, 0).unwrap();
            let all = |_| Tensor::zeros((b, t, hv, dk, dv), DType::F32, &d).unwrap();
            let (all_own, all_pool) = (keep.then(|| all(0)), keep.then(|| all(1)));
            let want =
                fused_gated_delta_rule_in_place(&qkv, &ga, &gb, layer, &own, None, all_own.as_ref(), P)
                    .unwrap();
            let states = pool0.copy().unwrap();
            let got = fused_gated_delta_rule_in_place(
                &qkv,
                &ga,
                &gb,
                layer,
                &states,
                Some(&slots),
                all_pool.as_ref(),
                P,
            )
            .unwrap();
            assert_eq!(max_diff(&got.out, &want.out), 0.0, "{dtype:?} t {t}");
            assert_eq!(
                max_diff(&states.index_select(&slots, 0).unwrap(), &own),
                0.0,
                "{dtype:?} t {t}: the slots' rows"
            );
            for row in [1, 2, 4, 6] {
                assert_eq!(
                    max_diff(&states.get(row).unwrap(), &pool0.get(row).unwrap()),
                    0.0,
                    "row {row} untouched"
                );
            }
            if let (Some(a), Some(b)) = (&all_own, &all_pool) {
                assert_eq!(max_diff(a, b), 0.0, "{dtype:?} t {t}: every token's state");
            }
            // A slot past the pool: a zero state in, nothing written.
            let outside = Tensor::new(&[5u32, 9, 3], &d).unwrap();
            let states = pool0.copy().unwrap();
            let r = fused_gated_delta_rule_in_place(&qkv, &ga, &gb, layer, &states, Some(&outside), None, P)
                .unwrap();
            let zero = own.zeros_like().unwrap();
            let fresh = fused_gated_delta_rule_in_place(&qkv, &ga, &gb, layer, &zero, None, None, P).unwrap();
            assert_eq!(
                max_diff(&r.out.get(1).unwrap(), &fresh.out.get(1).unwrap()),
                0.0,
                "from a zero state"
            );
            for row in [0, 1, 2, 4, 6] {
                assert_eq!(max_diff(&states.get(row).unwrap(), &pool0.get(row).unwrap()), 0.0);
            }

            let (c, k) = (200, 4);
            let x = randn(1.0, (b, t, c + 60), dtype).to_device(&d).unwrap();
            let x = x.narrow(2, 40, c).unwrap();
            let w = randn(0.5, (c, 1, k), dtype).to_device(&d).unwrap();
            let cpool0 = randn(1.0, (pool, c, k - 1), dtype).to_device(&d).unwrap();
            let cown = cpool0.index_select(&slots, 0).unwrap();
            let win = |_| Tensor::zeros((b, c, k - 1 + t), dtype, &d).unwrap();
            let (win_own, win_pool) = (keep.then(|| win(0)), keep.then(|| win(1)));
            let y_want = causal_conv1d_in_place(&x, &w, &cown, None, win_own.as_ref(), P).unwrap();
            let cpool = cpool0.copy().unwrap();
            let y = causal_conv1d_in_place(&x, &w, &cpool, Some(&slots), win_pool.as_ref(), P).unwrap();
            assert_eq!(max_diff(&y, &y_want), 0.0, "conv {dtype:?} t {t}");
            assert_eq!(max_diff(&cpool.index_select(&slots, 0).unwrap(), &cown), 0.0);
            for row in [1, 2, 4, 6] {
                assert_eq!(max_diff(&cpool.get(row).unwrap(), &cpool0.get(row).unwrap()), 0.0);
            }
            if let (Some(a), Some(b)) = (&win_own, &win_pool) {
                assert_eq!(max_diff(a, b), 0.0, "conv window {dtype:?} t {t}");
            }
        }
    }
}

/// Deferred commits over a state pool (what the engine runs): a verify gives bit for bit the
/// in-place kernels' outputs and leaves the slots' rows; the next pass, replaying `n` of each
/// slot's stashed tokens, gives bit for bit what a pass from the verify's state after `n` tokens
/// gives (so a verified token's state is a decode step's), and a replay alone leaves exactly that
/// state; a slot past the pool (a graph's padding row) runs from zeros and writes nothing. With 4
/// value heads (48 blocks) and with 128 (1536: the batches' variant, more items than the SMs
/// hold at once, so each block takes several and prefetches the next's state and records).
#[test]
fn pooled_deferred_commits_replay_exactly() {
    for hv in [4, 128] {
        deferred_commits_replay_exactly(hv);
    }
}

fn deferred_commits_replay_exactly(hv: usize) {
    use qwen36_kernels::conv1d::{causal_conv1d_in_place, causal_conv1d_pooled, new_stash as conv_stash};
    use qwen36_kernels::delta_rule::{
        fused_gated_delta_rule_in_place, fused_gated_delta_rule_pooled, new_stash, replay_pooled,
    };
    use qwen36_kernels::Deferred;
    let d = gpu();
    let (b, hk, dk, dv, pool, t) = (3, 2, 128, 128, 7, 4);
    let heads = GdnHeads {
        k_heads: hk,
        v_heads: hv,
        k_dim: dk,
        v_dim: dv,
    };
    let width = 2 * hk * dk + hv * dv;
    let a_log = qwen36_testutil::rand_uniform(537, 0f32, 2.5, hv, &d).unwrap();
    let dt_bias = (qwen36_testutil::rand_uniform(538, 0f32, 1.0, hv, &d).unwrap() - 3.0).unwrap();
    let layer = GdnParams::new(&a_log, &dt_bias, heads);
    let slots = Tensor::new(&[5u32, 0, 3], &d).unwrap();
    let u32s = |v: &[u32]| Tensor::new(v, &d).unwrap();
    let keep = [1u32, 4, 2];
    for dtype in [DType::F32, DType::BF16] {
        let inputs = |t| {
            let proj = randn(1.0, (b, t, width + 2 * hv), dtype).to_device(&d).unwrap();
            let qkv = proj.narrow(2, 0, width).unwrap().contiguous().unwrap();
            let (ga, gb) = (
                proj.narrow(2, width, hv).unwrap(),
                proj.narrow(2, width + hv, hv).unwrap(),
            );
            (qkv, ga, gb)
        };
        let (qkv, ga, gb) = inputs(t);
        let pool0 = qwen36_testutil::randn(539, 0.5, (pool, hv, dk, dv), &d).unwrap();
        let own = pool0.index_select(&slots, 0).unwrap();
        let all = Tensor::zeros((b, t, hv, dk, dv), DType::F32, &d).unwrap();
        let want = fused_gated_delta_rule_in_place(&qkv, &ga, &gb, layer, &own, None, Some(&all), P).unwrap();
        let states = pool0.copy().unwrap();
        let stash = new_stash(&states, 8, heads, dtype).unwrap();
        let pass = |qkv: &Tensor, ga: &Tensor, gb: &Tensor, slots: &Tensor, replay: &[u32], verify: bool| {
            let replay = u32s(replay);
            let deferred = Deferred {
                slots,
                replay: &replay,
                stash: &stash,
                verify,
            };
            fused_gated_delta_rule_pooled(qkv, ga, gb, layer, &states, &deferred, P).unwrap()
        };
        let out = pass(&qkv, &ga, &gb, &slots, &[0, 0, 0], true);
        assert_eq!(max_diff(&out, &want.out), 0.0, "{dtype:?}: the verify's outputs");
        assert_eq!(
            max_diff(&states, &pool0),
            0.0,
            "{dtype:?}: a verify leaves the rows"
        );
        // A decode token after keeping 1, 4 and 2 of the verified tokens.
        let (qkv1, ga1, gb1) = inputs(1);
        let out1 = pass(&qkv1, &ga1, &gb1, &slots, &keep, false);
        for (i, (&k, slot)) in keep.iter().zip([5usize, 0, 3]).enumerate() {
            let after = all
                .get(i)
                .unwrap()
                .get(k as usize - 1)
                .unwrap()
                .unsqueeze(0)
                .unwrap()
                .copy()
                .unwrap();
            let row = |x: &Tensor| x.narrow(0, i, 1).unwrap();
            let r = fused_gated_delta_rule_in_place(
                &row(&qkv1),
                &row(&ga1),
                &row(&gb1),
                layer,
                &after,
                None,
                None,
                P,
            )
            .unwrap();
            assert_eq!(max_diff(&row(&out1), &r.out), 0.0, "{dtype:?} row {i}: output");
            assert_eq!(
                max_diff(&states.get(slot).unwrap(), &after.get(0).unwrap()),
                0.0,
                "{dtype:?} slot {slot}"
            );
        }
        for row in [1, 2, 4, 6] {
            assert_eq!(max_diff(&states.get(row).unwrap(), &pool0.get(row).unwrap()), 0.0);
        }
        // A verify, then a replay alone of each slot's first tokens; a padding row (slot 9).
        let before = states.index_select(&slots, 0).unwrap();
        let all2 = Tensor::zeros((b, t, hv, dk, dv), DType::F32, &d).unwrap();
        fused_gated_delta_rule_in_place(&qkv, &ga, &gb, layer, &before, None, Some(&all2), P).unwrap();
        pass(&qkv, &ga, &gb, &slots, &[0, 0, 0], true);
        replay_pooled(layer, &states, &stash, &slots, &u32s(&keep), P).unwrap();
        for (i, (&k, slot)) in keep.iter().zip([5usize, 0, 3]).enumerate() {
            let want = all2.get(i).unwrap().get(k as usize - 1).unwrap();
            assert_eq!(
                max_diff(&states.get(slot).unwrap(), &want),
                0.0,
                "{dtype:?} replay, slot {slot}"
            );
        }
        let kept = states.copy().unwrap();
        let padded = u32s(&[5, 9, 3]);
        let out_pad = pass(&qkv1, &ga1, &gb1, &padded, &[0, 0, 0], true);
        let zero = own.narrow(0, 0, 1).unwrap().zeros_like().unwrap();
        let row = |x: &Tensor| x.narrow(0, 1, 1).unwrap();
        let fresh =
            fused_gated_delta_rule_in_place(&row(&qkv1), &row(&ga1), &row(&gb1), layer, &zero, None, None, P)
                .unwrap();
        assert_eq!(
            max_diff(&row(&out_pad), &fresh.out),
            0.0,
            "{dtype:?}: a padding row"
        );
        assert_eq!(
            max_diff(&states, &kept),
            0.0,
            "{dtype:?}: a verify with nothing to replay writes nothing"
        );

        // The conv: the same passes against the in-place kernel with its window.
        let (c, kw) = (200, 4);
        let x = randn(1.0, (b, t, c + 60), dtype).to_device(&d).unwrap();
        let x = x.narrow(2, 40, c).unwrap();
        let w = randn(0.5, (c, 1, kw), dtype).to_device(&d).unwrap();
        let cpool0 = randn(1.0, (pool, c, kw - 1), dtype).to_device(&d).unwrap();
        let cown = cpool0.index_select(&slots, 0).unwrap();
        let win = Tensor::zeros((b, c, kw - 1 + t), dtype, &d).unwrap();
        let y_want = causal_conv1d_in_place(&x, &w, &cown, None, Some(&win), P).unwrap();
        let cpool = cpool0.copy().unwrap();
        let cstash = conv_stash(&cpool, 8).unwrap();
        let conv = |x: &Tensor, replay: &[u32], verify: bool| {
            let replay = u32s(replay);
            let deferred = Deferred {
                slots: &slots,
                replay: &replay,
                stash: &cstash,
                verify,
            };
            causal_conv1d_pooled(x, &w, &cpool, &deferred, P).unwrap()
        };
        assert_eq!(
            max_diff(&conv(&x, &[0, 0, 0], true), &y_want),
            0.0,
            "conv {dtype:?}: the verify"
        );
        assert_eq!(max_diff(&cpool, &cpool0), 0.0);
        let x1 = randn(1.0, (b, 1, c), dtype).to_device(&d).unwrap();
        let y1 = conv(&x1, &keep, false);
        for (i, (&k, slot)) in keep.iter().zip([5usize, 0, 3]).enumerate() {
            let after = win
                .get(i)
                .unwrap()
                .narrow(1, k as usize, kw - 1)
                .unwrap()
                .unsqueeze(0)
                .unwrap()
                .contiguous()
                .unwrap();
            let y = causal_conv1d_in_place(&x1.narrow(0, i, 1).unwrap(), &w, &after, None, None, P).unwrap();
            assert_eq!(
                max_diff(&y1.narrow(0, i, 1).unwrap(), &y),
                0.0,
                "conv {dtype:?} row {i}"
            );
            assert_eq!(
                max_diff(&cpool.get(slot).unwrap(), &after.get(0).unwrap()),
                0.0,
                "conv {dtype:?} slot {slot}"
            );
        }
    }
}

/// The paged decode kernels (tensor cores for bf16 at head dims 64/128/256, in tiles of 16 rows;
/// the split-K kernel for f32) against the CPU reference: sequences of different lengths in
/// shuffled blocks, one past 64 tiles (several tiles per split), gated or not; the tolerances of
/// `decode_attention_matches_cpu`.
#[test]
fn paged_decode_attention_matches_cpu() {
    use qwen36_kernels::attention::{paged_decode_attention, Pages};
    use qwen36_testutil::max_row_rel_err;
    let d = gpu();
    let cpu = Device::Cpu;
    for (dt, tol) in [(DType::F32, 1e-5f32), (DType::BF16, 2f32.powi(-6))] {
        // (The last: 36 rows per KV head, three row tiles of the tensor-core kernel in bf16; and a
        // length past the positions its table holds, which counts as the table's.)
        for (t, hd, lens) in [
            (1, 256, vec![1usize, 217, 1030]),
            (4, 256, vec![4, 64, 5000]),
            (2, 64, vec![33, 90]),
            (6, 256, vec![6, 700]),
        ] {
            let (h, g, bs) = (2, 6, 16);
            let b = lens.len();
            let maxb = lens.iter().max().unwrap().div_ceil(bs);
            let blocks = lens.iter().map(|l| l.div_ceil(bs)).sum::<usize>() + 3;
            // Every sequence's blocks, drawn from a shuffled pool; unused table entries 0.
            let mut ids: Vec<u32> = (0..blocks as u32).collect();
            let mut rng = qwen36_testutil::Rng::new(hd as u64 + t as u64);
            for i in (1..ids.len()).rev() {
                ids.swap(i, rng.below(i + 1));
            }
            let mut next = 0;
            let mut table = vec![0u32; b * maxb];
            for (i, l) in lens.iter().enumerate() {
                for j in 0..l.div_ceil(bs) {
                    table[i * maxb + j] = ids[next];
                    next += 1;
                }
            }
            let table = Tensor::from_vec(table, (b, maxb), &cpu).unwrap();
            // The last case claims 1000 more positions than its longest table holds.
            let claimed: Vec<u32> = lens
                .iter()
                .map(|&l| l as u32 + if l == 700 { 1000 } else { 0 })
                .collect();
            let lens_t = Tensor::new(claimed.as_slice(), &cpu).unwrap();
            let q = randn(1.0, (b, h, g * t, hd), dt);
            let kp = randn(1.0, (blocks * bs, h, hd), dt);
            let vp = randn(1.0, (blocks * bs, h, hd), dt);
            let gate = (t > 1).then(|| randn(1.0, (b, t, h * g, 2 * hd), dt).narrow(3, hd, hd).unwrap());
            let scale = (hd as f64).powf(-0.5);
            let pages = Pages {
                tables: &table,
                lens: &lens_t,
                block_size: bs,
            };
            let want = paged_decode_attention(
                AttentionInputs::new(&q, &kp, &vp, gate.as_ref(), scale),
                pages,
                t,
                P,
            )
            .unwrap();
            let on = |x: &Tensor| x.to_device(&d).unwrap();
            let (table_d, lens_d, gate_d) = (on(&table), on(&lens_t), gate.as_ref().map(on));
            let pages_d = Pages {
                tables: &table_d,
                lens: &lens_d,
                block_size: bs,
            };
            let got = paged_decode_attention(
                AttentionInputs::new(&on(&q), &on(&kp), &on(&vp), gate_d.as_ref(), scale),
                pages_d,
                t,
                P,
            )
            .unwrap();
            assert_eq!(got.dims(), want.dims());
            let e = max_row_rel_err(&got, &want);
            let tol = if gate.is_some() && dt != DType::F32 {
                2.0 * tol
            } else {
                tol
            };
            assert!(e <= tol, "{dt:?} t {t} hd {hd} lens {lens:?}: {e}");
            eprintln!("paged_decode_attention {dt:?} t {t} hd {hd} lens {lens:?}: max row rel err {e:.2e}");
            // Each sequence alone (a batch of one, its table only as long as its own blocks)
            // gets exactly what it gets in the batch.
            for (i, len) in lens.iter().enumerate() {
                let one = |x: &Tensor| x.narrow(0, i, 1).unwrap();
                let ti = one(&table_d)
                    .narrow(1, 0, len.div_ceil(bs))
                    .unwrap()
                    .contiguous()
                    .unwrap();
                let li = one(&lens_d);
                let gi = gate_d.as_ref().map(one);
                let alone = paged_decode_attention(
                    AttentionInputs::new(&one(&on(&q)), &on(&kp), &on(&vp), gi.as_ref(), scale),
                    Pages {
                        tables: &ti,
                        lens: &li,
                        block_size: bs,
                    },
                    t,
                    P,
                )
                .unwrap();
                assert_eq!(
                    max_diff(&alone, &one(&got)),
                    0.0,
                    "{dt:?} t {t} hd {hd} sequence {i} alone"
                );
            }
        }
    }
}

/// Batch invariance of decode attention (issue 22): each token of a pass of t new tokens (a
/// speculative verify) gets the bits that a one-token decode at its position gets, in bf16 and
/// f16 (tensor cores) and f32, through a shared-length buffer and through paged pools in a
/// batch with other sequences, whether the splits merge in the kernel or by the merge kernels
/// (the default picks by the launch's size, so a pass and its tokens alone may take different
/// ones). The cases: 6 query heads per KV head (the 27B's), so a verify of
/// 3+ tokens has more than 16 rows (more row tiles than a decode's one; 9 tokens, 54 rows: a
/// block of three row tiles, then one whose last two tiles hold no row); and lengths whose
/// tokens straddle 64, 128, 192 and 512 tiles of 64 keys, where the split of a row's keys
/// changes from two tiles each to three, four to five, six to seven, and eight to nine (the 64
/// splits full: `split_tiles` in cuda/attention.cu).
#[test]
fn decode_attention_rows_are_batch_invariant() {
    use candle_core::IndexOp;
    use qwen36_kernels::attention::{decode_attention, paged_decode_attention, Pages};
    let d = gpu();
    let on = |x: &Tensor| x.to_device(&d).unwrap();
    let bits = |x: &Tensor| {
        let v = x
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        v.iter().map(|f| f.to_bits()).collect::<Vec<_>>()
    };
    let (h, g, bs) = (2, 6, 16);
    for dt in [DType::BF16, DType::F16, DType::F32] {
        for (t, hd, len) in [
            (4, 256, 4098),
            (3, 64, 8194),
            (8, 128, 300),
            (2, 256, 4097),
            (9, 64, 700),
            (2, 64, 12289),
            (3, 64, 32770),
            // Rows of 36863..36866 keys: 64 splits of 9 tiles, then 58 of 10 (two groups).
            (4, 64, 36866),
        ] {
            let cap = (len + 256usize).next_multiple_of(256).max(8448);
            let scale = (hd as f64).powf(-0.5);
            let q = on(&randn(1.0, (1, h, g * t, hd), dt));
            let gate = on(&randn(1.0, (1, t, h * g, hd), dt));
            // Query rows member·t + i of token i: [1, h, g, hd].
            let token_q = |i: usize| {
                let rows: Vec<u32> = (0..g).map(|m| (m * t + i) as u32).collect();
                let idx = Tensor::new(rows.as_slice(), &d).unwrap();
                q.index_select(&idx, 2).unwrap().contiguous().unwrap()
            };
            let token_gate = |i: usize| gate.i((.., i..i + 1)).unwrap();
            let lens = |l: usize| on(&Tensor::new(&[l as u32], &Device::Cpu).unwrap());
            // A shared-length buffer [1, h, cap, hd].
            let k = on(&randn(1.0, (1, h, cap, hd), dt));
            let v = on(&randn(1.0, (1, h, cap, hd), dt));
            let pass = MERGES.map(|policy| {
                decode_attention(
                    AttentionInputs::new(&q, &k, &v, Some(&gate), scale),
                    &lens(len),
                    t,
                    &policy,
                )
                .unwrap()
            });
            // Paged: this sequence second in a batch of two, its blocks reversed in the pool.
            let blocks = cap / bs;
            let kp = on(&randn(1.0, (2 * blocks * bs, h, hd), dt));
            let vp = on(&randn(1.0, (2 * blocks * bs, h, hd), dt));
            let mine: Vec<u32> = (0..blocks as u32).rev().map(|b| b + blocks as u32).collect();
            let table1 = on(&Tensor::new(mine.as_slice(), &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap());
            let other: Vec<u32> = (0..blocks as u32).collect();
            let table2 = on(
                &Tensor::new([other, mine.clone()].concat().as_slice(), &Device::Cpu)
                    .unwrap()
                    .reshape((2, blocks))
                    .unwrap(),
            );
            let q2 = Tensor::cat(&[&on(&randn(1.0, (1, h, g * t, hd), dt)), &q], 0).unwrap();
            let gate2 = Tensor::cat(&[&gate, &gate], 0).unwrap();
            let lens2 = on(&Tensor::new(&[77u32, len as u32], &Device::Cpu).unwrap());
            let paged_pass = MERGES.map(|policy| {
                paged_decode_attention(
                    AttentionInputs::new(&q2, &kp, &vp, Some(&gate2), scale),
                    Pages {
                        tables: &table2,
                        lens: &lens2,
                        block_size: bs,
                    },
                    t,
                    &policy,
                )
                .unwrap()
                .i(1..2)
                .unwrap()
            });
            // Each token alone, under either merge, against the pass under either merge.
            for i in 0..t {
                let at = len - t + i + 1;
                let (qi, gi) = (token_q(i), token_gate(i));
                for policy in &MERGES {
                    let alone = decode_attention(
                        AttentionInputs::new(&qi, &k, &v, Some(&gi), scale),
                        &lens(at),
                        1,
                        policy,
                    )
                    .unwrap();
                    let paged_alone = paged_decode_attention(
                        AttentionInputs::new(&qi, &kp, &vp, Some(&gi), scale),
                        Pages {
                            tables: &table1,
                            lens: &lens(at),
                            block_size: bs,
                        },
                        1,
                        policy,
                    )
                    .unwrap();
                    let merges = MERGES.map(|p| p.decode_merge);
                    for ((pass, paged_pass), merge) in pass.iter().zip(&paged_pass).zip(merges) {
                        let what = format!(
                            "{dt:?} t {t} hd {hd} len {len} token {i}, alone {:?}, pass {merge:?}",
                            policy.decode_merge
                        );
                        assert_eq!(
                            bits(&alone),
                            bits(&pass.i((.., i..i + 1)).unwrap()),
                            "{what}: buffer"
                        );
                        assert_eq!(
                            bits(&paged_alone),
                            bits(&paged_pass.i((.., i..i + 1)).unwrap()),
                            "{what}: paged"
                        );
                    }
                }
            }
        }
    }
}

/// The pool KV write kernel against candle's scatter on the CPU: bit-exact rows, a value view
/// with strides, the rows around left alone.
#[test]
fn write_kv_rows_matches_cpu() {
    use qwen36_kernels::attention::write_kv_rows;
    let d = gpu();
    for dt in [DType::F32, DType::BF16] {
        let (h, n, hd, rows) = (4, 5, 256, 40);
        let k = randn(1.0, (h, n, hd), dt);
        let v = randn(1.0, (n, 2 * h, hd), dt)
            .narrow(1, h, h)
            .unwrap()
            .transpose(0, 1)
            .unwrap();
        let kp = randn(1.0, (rows, h, hd), dt);
        let vp = randn(1.0, (rows, h, hd), dt);
        let at = Tensor::new(&[17u32, 3, 18, 39, 0], &Device::Cpu).unwrap();
        let on = |x: &Tensor| x.to_device(&d).unwrap();
        let (kg, vg) = (on(&kp), on(&vp));
        write_kv_rows(&on(&k), &on(&v), &kg, &vg, &on(&at), P).unwrap();
        write_kv_rows(&k, &v, &kp, &vp, &at, P).unwrap();
        assert_eq!(max_diff(&kg, &kp), 0.0, "{dt:?} keys");
        assert_eq!(max_diff(&vg, &vp), 0.0, "{dt:?} values");
    }
}

/// The KV write kernel against candle's scatter on the CPU: bit-exact copies at the positions, a
/// value view with strides (as the attention layer passes it), the rows around left alone.
#[test]
fn write_kv_matches_cpu() {
    use qwen36_kernels::attention::write_kv;
    let d = gpu();
    for dt in [DType::F32, DType::BF16] {
        let (b, h, t, hd, cap) = (2, 4, 3, 256, 40);
        let k = randn(1.0, (b, h, t, hd), dt);
        let v = randn(1.0, (b, t, 2 * h, hd), dt)
            .narrow(2, h, h)
            .unwrap()
            .transpose(1, 2)
            .unwrap();
        let kc = randn(1.0, (b, h, cap, hd), dt);
        let vc = randn(1.0, (b, h, cap, hd), dt);
        let pos = Tensor::new(&[17u32, 18, 19], &Device::Cpu).unwrap();
        let on = |x: &Tensor| x.to_device(&d).unwrap();
        let (kg, vg) = (on(&kc), on(&vc));
        write_kv(&on(&k), &on(&v), &kg, &vg, &on(&pos), P).unwrap();
        write_kv(&k, &v, &kc, &vc, &pos, P).unwrap();
        assert_eq!(max_diff(&kg, &kc), 0.0, "{dt:?} keys");
        assert_eq!(max_diff(&vg, &vc), 0.0, "{dt:?} values");
    }
}

/// The tensor-core prefill attention kernel against the CPU reference (f32 loops): bf16 and f16,
/// each compiled head dim, six query heads per KV head, prompts inside one 64-row tile, at and
/// past tile edges, from position 0 and after a cached prefix (pos0 = 37), over cache views longer
/// than the keys; odd cases with an output gate read as a strided view (gated attention). Tolerance:
/// the kernel rounds P to the input dtype before P·V (as flash-attn does), a relative 2^-9 (bf16)
/// / 2^-12 (f16) per term whose errors add up like the output itself, and rounds the output once;
/// the reference rounds only the output: 2^-6 / 2^-9 of each row's scale leaves room for both
/// and still fails on any wrong key, mask or scale. Gated, the reference also rounds the gate's
/// sigmoid and the product (two more roundings at up to the row's scale; measured 1.4e-2 / 1.9e-3):
/// twice that.
#[test]
fn prefill_attention_matches_cpu() {
    use qwen36_kernels::attention::{prefill_attention, prefill_attention_fits};
    use qwen36_testutil::max_row_rel_err;
    let d = gpu();
    for (dt, tol) in [(DType::BF16, 2f32.powi(-6)), (DType::F16, 2f32.powi(-9))] {
        for (case, (hd, t, pos0)) in [
            (256, 1, 0),
            (256, 64, 0),
            (256, 130, 37),
            (128, 63, 0),
            (128, 200, 37),
            (64, 65, 37),
            (64, 300, 0),
        ]
        .into_iter()
        .enumerate()
        {
            assert!(prefill_attention_fits(hd, dt, &d));
            let (b, h, kh) = (2, 12, 2);
            let cap = pos0 + t + 5;
            let q = randn(1.0, (b, h, t, hd), dt);
            let k = randn(1.0, (b, kh, cap, hd), dt);
            let v = randn(1.0, (b, kh, cap, hd), dt);
            let keys = pos0 + t;
            let scale = (hd as f64).powf(-0.5);
            // The gate as the model reads it: every other hd-block of a wider row.
            let gate_rows = randn(1.0, (b, t, h, 2 * hd), dt);
            let gate = (case % 2 == 1).then(|| gate_rows.narrow(3, hd, hd).unwrap());
            let want = prefill_attention(
                AttentionInputs::new(
                    &q,
                    &k.narrow(2, 0, keys).unwrap(),
                    &v.narrow(2, 0, keys).unwrap(),
                    gate.as_ref(),
                    scale,
                ),
                pos0,
                P,
            )
            .unwrap();
            let on = |x: &Tensor| x.to_device(&d).unwrap();
            let (kd, vd) = (on(&k), on(&v));
            let gd = gate.as_ref().map(|_| on(&gate_rows).narrow(3, hd, hd).unwrap());
            let got = prefill_attention(
                AttentionInputs::new(
                    &on(&q),
                    &kd.narrow(2, 0, keys).unwrap(),
                    &vd.narrow(2, 0, keys).unwrap(),
                    gd.as_ref(),
                    scale,
                ),
                pos0,
                P,
            )
            .unwrap();
            assert_eq!(got.dims(), want.dims());
            let e = max_row_rel_err(&got, &want);
            let gated = gate.is_some();
            let tol = if gated { 2.0 * tol } else { tol };
            assert!(e <= tol, "{dt:?} hd {hd} t {t} pos0 {pos0} gated {gated}: {e}");
            eprintln!(
                "prefill_attention {dt:?} hd {hd} t {t} pos0 {pos0} gated {gated}: max row rel err {e:.2e}"
            );
        }
    }
}

/// The two-stage argmax against candle's CPU argmax: vocabulary-sized rows (several chunks, a
/// partial last one), short rows, ties (the lowest index wins on both sides), three dtypes.
#[test]
fn argmax_matches_cpu() {
    use qwen36_kernels::argmax::argmax_last_dim;
    let d = gpu();
    let cpu = Device::Cpu;
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for (rows, n) in [(1, 248_320), (3, 10_000), (2, 7), (4, 4096)] {
            let x = qwen36_testutil::randn(519, 1.0, (rows, n), &cpu).unwrap();
            // Rounded to steps of 1/4: many ties in every row.
            let x = (x * 4.0)
                .unwrap()
                .round()
                .unwrap()
                .affine(0.25, 0.0)
                .unwrap()
                .to_dtype(dt)
                .unwrap();
            let want = argmax_last_dim(&x, P).unwrap().to_vec1::<u32>().unwrap();
            let got = argmax_last_dim(&x.to_device(&d).unwrap(), P)
                .unwrap()
                .to_vec1::<u32>()
                .unwrap();
            assert_eq!(got, want, "{dt:?} rows {rows} n {n}");
        }
    }
}

/// SwiGLU against the CPU reference (candle's SiLU then product, each rounded to the dtype; the
/// kernel rounds once): f32 within 1e-6 relative, half types within two output ulps.
#[test]
fn swiglu_matches_cpu() {
    use qwen36_kernels::activation::swiglu;
    use qwen36_testutil::max_row_rel_err;
    let d = gpu();
    for (dt, tol) in [
        (DType::F32, 1e-6f32),
        (DType::BF16, 2f32.powi(-6)),
        (DType::F16, 2f32.powi(-9)),
    ] {
        for (rows, i) in [(1, 17408), (5, 300), (3, 7)] {
            let x = randn(2.0, (1, rows, 2 * i), dt);
            let want = swiglu(&x, P).unwrap();
            let got = swiglu(&x.to_device(&d).unwrap(), P).unwrap();
            assert_eq!(got.dims(), [1, rows, i]);
            let e = max_row_rel_err(&got, &want);
            assert!(e <= tol, "{dt:?} rows {rows} I {i}: {e}");
        }
    }
}

/// The fused per-head norm + RoPE (the attention layer's q and k preparation) against the CPU
/// composition of the same ops: q-like heads (every other head-sized slot of a wider row, as q sits
/// next to its gate) and k-like heads, inside wider projection rows; with and without the norm;
/// head dims 256 (rotary 64, Qwen3.6's) and 64 (rotary 16), and no rotation. Both sides round the
/// norm's output to the dtype before rotating; the tolerance, relative to each row's scale, allows
/// one more rounding of the result (2^-7 bf16, 2^-10 f16; f32: 1e-5).
#[test]
fn norm_rope_heads_matches_cpu() {
    use qwen36_kernels::norm::RmsNorm;
    use qwen36_kernels::rope::{norm_rope_heads, RotaryEmbedding};
    use qwen36_testutil::max_row_rel_err;
    let d = gpu();
    let cpu = Device::Cpu;
    for (dt, tol) in [
        (DType::F32, 1e-5f32),
        (DType::BF16, 2f32.powi(-7)),
        (DType::F16, 2f32.powi(-10)),
    ] {
        for (hd, rd) in [(256, 64), (64, 16), (64, 0)] {
            for (b, t, heads, stride) in [(1, 1, 3, 2 * hd), (2, 5, 3, 2 * hd), (2, 5, 2, hd), (1, 1, 4, hd)]
            {
                let width = heads * stride + 2 * hd; // more columns follow, as in the projection
                let rows = randn(1.5, (b, t, width + hd), dt);
                let x = rows.narrow(2, hd, width - 2 * hd + hd).unwrap();
                let w = qwen36_testutil::randn(520, 0.3, hd, &cpu).unwrap();
                let norm_c = RmsNorm::zero_centred(&w, 1e-6).unwrap();
                let norm_g = RmsNorm::zero_centred(&w.to_device(&d).unwrap(), 1e-6).unwrap();
                let rope = RotaryEmbedding::new(rd.max(2), 10_000_000.0).unwrap();
                let (cos, sin) = rope.cos_sin(37, t, dt, &cpu).unwrap();
                let (cos, sin) = if rd == 0 {
                    (cos.narrow(1, 0, 0).unwrap(), sin.narrow(1, 0, 0).unwrap())
                } else {
                    (cos, sin)
                };
                let xg = rows.to_device(&d).unwrap().narrow(2, hd, width - hd).unwrap();
                let (cg, sg) = (cos.to_device(&d).unwrap(), sin.to_device(&d).unwrap());
                for with_norm in [true, false] {
                    let (nc, ng) = if with_norm {
                        (Some(&norm_c), Some(&norm_g))
                    } else {
                        (None, None)
                    };
                    let want = norm_rope_heads(&x, heads, stride, hd, nc, &cos, &sin, P).unwrap();
                    let got = norm_rope_heads(&xg, heads, stride, hd, ng, &cg, &sg, P).unwrap();
                    assert_eq!(got.dims(), [b, heads, t, hd]);
                    assert_eq!(want.dims(), got.dims());
                    let e = max_row_rel_err(&got, &want);
                    let case = format!("{dt:?} hd {hd} rd {rd} b {b} t {t} heads {heads} stride {stride}");
                    assert!(e <= tol, "{case} norm {with_norm}: {e}");
                }
            }
        }
    }
}

/// The first kernel launch on a device makes its default memory pool (candle's allocations) keep
/// freed memory: its release threshold goes from the driver's 0 to u64::MAX, unless
/// `QWEN36_POOL_KEEP=0` asks for the driver's default.
#[test]
fn memory_pool_keeps_freed_memory() {
    use candle_core::cuda::cudarc::driver::{result, sys};
    let d = gpu();
    let x = randn(1.0, (4, 64), DType::F32).to_device(&d).unwrap();
    // Any kernel of ours: the RMSNorm.
    let norm = qwen36_kernels::norm::RmsNorm::zero_centred(&Tensor::zeros(64, DType::F32, &d).unwrap(), 1e-6)
        .unwrap();
    norm.forward(&x).unwrap();
    let stream = d.as_cuda_device().unwrap().cuda_stream();
    let ctx = stream.context();
    ctx.bind_to_thread().unwrap();
    let mut threshold: u64 = 0;
    // SAFETY: the device comes from a live context bound above; RELEASE_THRESHOLD is a u64.
    unsafe {
        let pool = result::device::get_default_mem_pool(ctx.cu_device()).unwrap();
        result::mem_pool::get_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
        .unwrap();
    }
    let keep = !std::env::var("QWEN36_POOL_KEEP").is_ok_and(|v| v == "0");
    assert_eq!(threshold, if keep { u64::MAX } else { 0 });
}
