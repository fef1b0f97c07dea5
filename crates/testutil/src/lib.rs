//! Helpers shared by the qwen36 test suites.

use candle_core::{DType, Device, Tensor};

/// The device tests run on: the CPU, or the first CUDA GPU when `QWEN36_TEST_DEVICE=cuda`
/// (scripts/gpu-check runs every suite both ways). The GPU device is made like
/// `qwen36_model::graph_device`, so generation loops under test replay CUDA graphs.
pub fn test_device() -> Device {
    match std::env::var("QWEN36_TEST_DEVICE").as_deref() {
        Ok("cuda") => cuda_device(),
        _ => Device::Cpu,
    }
}

#[cfg(feature = "cuda")]
fn cuda_device() -> Device {
    let d = Device::new_cuda_with_stream(0).expect("QWEN36_TEST_DEVICE=cuda but no CUDA device");
    // SAFETY: every tensor of this device is made and used on its single stream (see
    // qwen36_model::graph_device).
    unsafe {
        d.as_cuda_device()
            .expect("a CUDA device")
            .disable_event_tracking()
    };
    d
}

#[cfg(not(feature = "cuda"))]
fn cuda_device() -> Device {
    Device::new_cuda(0).expect("QWEN36_TEST_DEVICE=cuda needs a build with --features cuda")
}

fn host_f32(t: &Tensor) -> Tensor {
    t.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap()
}

/// `max |a − b|` over all elements (any devices and dtypes), in f32.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    max_all(&(host_f32(a) - host_f32(b)).unwrap().abs().unwrap())
}

fn max_all(t: &Tensor) -> f32 {
    t.flatten_all().unwrap().max(0).unwrap().to_scalar().unwrap()
}

/// Max over rows (last dim) of `max_j |a_j − b_j| / max_j |b_j|`: the error relative to each row's
/// scale, which stays meaningful where single elements are near zero.
pub fn max_row_rel_err(a: &Tensor, b: &Tensor) -> f32 {
    let (a, b) = (host_f32(a), host_f32(b));
    let d = a.dims().len() - 1;
    let err = (a - &b).unwrap().abs().unwrap().max_keepdim(d).unwrap();
    let scale = b.abs().unwrap().max_keepdim(d).unwrap();
    max_all(&(err / scale).unwrap())
}
