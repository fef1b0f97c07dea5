//! CPU kernel benchmarks (criterion). `cargo bench -p qwen36-kernels`; CI compiles them with
//! `cargo bench --no-run`. Shapes: one Qwen3.6-27B GDN layer (Hk 16, Hv 48, dk = dv = 128) for
//! decode and verify; a shorter prefill so a run stays in seconds on a laptop.

use candle_core::{DType, Device, Tensor};
use criterion::{criterion_group, criterion_main, Criterion};
use qwen36_kernels::conv1d::causal_conv1d;
use qwen36_kernels::delta_rule::{
    chunked_gated_delta_rule, recurrent_gated_delta_rule, DeltaRuleInputs, DeltaRuleOutput, CHUNK_SIZE,
};
use qwen36_kernels::norm::{l2_norm, RmsNorm};
use qwen36_kernels::KernelPolicy;

const HK: usize = 16;
const HV: usize = 48;
const D: usize = 128;

fn rule_inputs(t: usize) -> [Tensor; 6] {
    let cpu = Device::Cpu;
    [
        l2_norm(&Tensor::randn(0f32, 1.0, (1, t, HK, D), &cpu).unwrap(), 1e-6).unwrap(),
        l2_norm(&Tensor::randn(0f32, 1.0, (1, t, HK, D), &cpu).unwrap(), 1e-6).unwrap(),
        Tensor::randn(0f32, 1.0, (1, t, HV, D), &cpu).unwrap(),
        (Tensor::rand(0f32, 1.0, (1, t, HV), &cpu).unwrap() * -0.5).unwrap(),
        Tensor::rand(0f32, 1.0, (1, t, HV), &cpu).unwrap(),
        Tensor::randn(0f32, 0.1, (1, HV, D, D), &cpu).unwrap(),
    ]
}

const P: &KernelPolicy = &KernelPolicy::DEFAULT;

/// The token-by-token form over [`rule_inputs`], keeping every state with `keep`.
fn recurrent(x: &[Tensor; 6], keep: bool) -> DeltaRuleOutput {
    let [q, k, v, g, b, s] = x;
    let scale = (D as f32).powf(-0.5);
    recurrent_gated_delta_rule(DeltaRuleInputs::new(q, k, v, g, b), Some(s), scale, keep, P).unwrap()
}

/// The chunked form over [`rule_inputs`].
fn chunked(x: &[Tensor; 6]) -> DeltaRuleOutput {
    let [q, k, v, g, b, s] = x;
    let scale = (D as f32).powf(-0.5);
    chunked_gated_delta_rule(DeltaRuleInputs::new(q, k, v, g, b), Some(s), scale, CHUNK_SIZE, P).unwrap()
}

fn delta_rule(c: &mut Criterion) {
    let x = rule_inputs(1);
    c.bench_function("recurrent decode 1 token (27B layer)", |bn| {
        bn.iter(|| recurrent(&x, false))
    });
    let x = rule_inputs(4);
    c.bench_function("recurrent verify 4 tokens, keep states (27B layer)", |bn| {
        bn.iter(|| recurrent(&x, true))
    });
    let x = rule_inputs(256);
    let mut group = c.benchmark_group("prefill 256 tokens (27B layer)");
    group.sample_size(10);
    group.bench_function("chunked", |bn| bn.iter(|| chunked(&x)));
    group.bench_function("recurrent", |bn| bn.iter(|| recurrent(&x, false)));
    group.finish();
}

fn conv_and_norms(c: &mut Criterion) {
    let cpu = Device::Cpu;
    let width = 2 * HK * D + HV * D;
    let w = Tensor::randn(0f32, 0.3, (width, 4), &cpu).unwrap();
    let st = Tensor::zeros((1, width, 3), DType::F32, &cpu).unwrap();
    let x1 = Tensor::randn(0f32, 1.0, (1, 1, width), &cpu).unwrap();
    c.bench_function("conv1d decode (27B layer)", |bn| {
        bn.iter(|| causal_conv1d(&x1, &w, Some(&st), P).unwrap())
    });
    let x = Tensor::randn(0f32, 1.0, (1, 64, 5120), &cpu).unwrap();
    let norm = RmsNorm::zero_centred(&Tensor::zeros(5120, DType::F32, &cpu).unwrap(), 1e-6).unwrap();
    c.bench_function("rms_norm (1+w) 64 x 5120", |bn| {
        bn.iter(|| norm.forward(&x).unwrap())
    });
}

criterion_group!(benches, delta_rule, conv_and_norms);
criterion_main!(benches);
