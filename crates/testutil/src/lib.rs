//! Helpers shared by the qwen36 test suites.

use candle_core::{DType, Device, Tensor};

/// The device tests run on: the CPU, or the first CUDA GPU when `QWEN36_TEST_DEVICE=cuda`
/// (scripts/gpu-check runs every suite both ways).
pub fn test_device() -> Device {
    match std::env::var("QWEN36_TEST_DEVICE").as_deref() {
        Ok("cuda") => Device::new_cuda(0).expect("QWEN36_TEST_DEVICE=cuda but no CUDA device"),
        _ => Device::Cpu,
    }
}

fn host_f32(t: &Tensor) -> Tensor {
    t.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap()
}

/// `max |a − b|` over all elements (any devices and dtypes), in f32.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (host_f32(a) - host_f32(b))
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar()
        .unwrap()
}

/// Max over rows (last dim) of `max_j |a_j − b_j| / max_j |b_j|`: the error relative to each row's
/// scale, which stays meaningful where single elements are near zero.
pub fn max_row_rel_err(a: &Tensor, b: &Tensor) -> f32 {
    let (a, b) = (host_f32(a), host_f32(b));
    let d = a.dims().len() - 1;
    let err = (a - &b).unwrap().abs().unwrap().max_keepdim(d).unwrap();
    let scale = b.abs().unwrap().max_keepdim(d).unwrap();
    (err / scale)
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar()
        .unwrap()
}
