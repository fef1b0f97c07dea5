//! What the ops' CUDA launchers share, and nothing op-specific: the kernel modules build.rs makes,
//! device views of tensors, fresh outputs, in-place updates of a caller's buffer, and the launch
//! itself ([`KernelCall`], with programmatic dependent launch on Hopper). No op is imported here;
//! each op's `cuda.rs` builds on these.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, LazyLock, PoisonError, RwLock};

use candle_core::cuda::cudarc::driver::sys::CUfunction_attribute;
use candle_core::cuda::cudarc::driver::CudaFunction;
use candle_core::cuda::cudarc::driver::{CudaModule, CudaSlice, CudaView, CudaViewMut};
use candle_core::cuda::cudarc::nvrtc::Ptx;
use candle_core::cuda::{CudaDType, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Shape, Storage, Tensor};

mod launch;
pub(crate) use candle_core::cuda::cudarc::driver::LaunchConfig;
pub(crate) use launch::{device_setup, KernelCall};

use crate::{Error, Result};

/// A module that build.rs compiled from `cuda/<file>.cu`: a fat binary with the machine code of
/// the build's compute capability and its PTX, loaded into a CUDA context at its first use (the
/// modules are statics, so each image is in the binary once whichever ops use it).
pub(crate) struct Module {
    name: &'static str,
    image: &'static [u8],
}

macro_rules! module {
    ($file:literal) => {
        Module {
            name: $file,
            image: include_bytes!(concat!(env!("OUT_DIR"), "/", $file, ".fatbin")),
        }
    };
}

/// cuda/gdn.cu: the delta rule (recurrent, fused, chunked) and the causal conv1d.
pub(crate) static GDN: Module = module!("gdn");
/// cuda/norm.cu: the RMSNorm variants and the fused q/k norm + RoPE.
pub(crate) static NORM: Module = module!("norm");
/// cuda/linear.cu: the weight-streaming GEMV kernels.
pub(crate) static LINEAR: Module = module!("linear");
/// cuda/attention.cu: decode and prefill attention, the KV write, the causal softmax.
pub(crate) static ATTENTION: Module = module!("attention");
/// cuda/argmax.cu.
pub(crate) static ARGMAX: Module = module!("argmax");
/// cuda/activation.cu: SwiGLU.
pub(crate) static ACTIVATION: Module = module!("activation");

/// The modules loaded so far, by CUDA context (its handle) and name. Every `CudaDevice` of a GPU
/// shares that GPU's primary context, so a module loads once per GPU. A loaded module holds its
/// context, so the handle names that context for the life of the process: a GPU's primary
/// context, once a kernel ran there, is kept until the process exits. A load holds the lock: the
/// threads that want a module wait for its one load (a JIT compile of the PTX, tens of seconds,
/// where the build's machine code does not fit the GPU).
type Loaded = HashMap<(usize, &'static str), Arc<CudaModule>>;
static LOADED: LazyLock<RwLock<Loaded>> = LazyLock::new(RwLock::default);

impl Module {
    /// This module in `dev`'s context, loaded there at the first call.
    fn loaded(&self, dev: &CudaDevice) -> Result<Arc<CudaModule>> {
        let stream = dev.cuda_stream();
        let ctx = stream.context();
        let key = (ctx.cu_ctx() as usize, self.name);
        if let Some(module) = LOADED.read().unwrap_or_else(PoisonError::into_inner).get(&key) {
            return Ok(module.clone());
        }
        let mut loaded = LOADED.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(module) = loaded.get(&key) {
            return Ok(module.clone());
        }
        // The driver reads a fat binary's headers as 8-byte words. A copy on the heap is so
        // aligned by the system allocator (16 bytes on the platforms CUDA supports); checked.
        let image = self.image.to_vec();
        if image.as_ptr().align_offset(8) != 0 {
            return Err(candle_core::Error::Msg(format!(
                "the {} kernels' image is not 8-byte aligned in host memory",
                self.name
            ))
            .into());
        }
        let module = ctx.load_module(Ptx::from_binary(image)).w()?;
        loaded.insert(key, module.clone());
        Ok(module)
    }

    /// Kernel `name` of this module on `dev`.
    pub(crate) fn func(&self, dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
        Ok(self.loaded(dev)?.load_function(name).w()?)
    }

    /// Kernel `name`, allowed `smem` bytes of dynamic shared memory (past the default 48 KiB).
    pub(crate) fn func_with_smem(&self, dev: &CudaDevice, name: &str, smem: usize) -> Result<CudaFunction> {
        let func = self.func(dev, name)?;
        if smem > 48 * 1024 {
            // The attribute belongs to the module's function, shared by every handle to it.
            func.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .w()?;
        }
        Ok(func)
    }
}

/// Runs the calling function's local `go!` macro with the Rust element type of `$dt` (f32, bf16
/// or f16); any other dtype is an error naming `$op`.
macro_rules! for_float_dtype {
    ($op:expr, $dt:expr) => {
        match $dt {
            candle_core::DType::F32 => go!(f32),
            candle_core::DType::BF16 => go!(half::bf16),
            candle_core::DType::F16 => go!(half::f16),
            other => Err($crate::cuda::err($op, format!("unsupported dtype {other:?}"))),
        }
    };
}
pub(crate) use for_float_dtype;

/// A shape or operand error of `op`.
pub(crate) fn err(op: &'static str, msg: impl Into<String>) -> Error {
    Error::Shape { op, msg: msg.into() }
}

/// Elements `range` of a CUDA storage of `T`s (the storage guard must outlive the view).
fn elements<'a, T: CudaDType>(
    op: &'static str,
    st: &'a Storage,
    range: Range<usize>,
) -> Result<CudaView<'a, T>> {
    let Storage::Cuda(cs) = st else {
        return Err(err(op, "expected a CUDA tensor"));
    };
    Ok(cs.as_cuda_slice::<T>()?.slice(range))
}

/// The device data of a contiguous tensor (the storage guard must outlive the view).
pub(crate) fn view<'a, T: CudaDType>(
    op: &'static str,
    st: &'a Storage,
    layout: &Layout,
) -> Result<CudaView<'a, T>> {
    let (a, b) = layout
        .contiguous_offsets()
        .ok_or_else(|| err(op, "expected a contiguous tensor"))?;
    elements(op, st, a..b)
}

/// Whether a layout of elements of `size` bytes starts on a 16-byte boundary (every CUDA
/// allocation does), as the kernels' 16-byte vector loads need.
pub(crate) fn at16(layout: &Layout, size: usize) -> bool {
    (layout.start_offset() * size) % 16 == 0
}

/// Whether a layout is contiguous and starts on a 16-byte boundary ([`at16`]).
pub(crate) fn contiguous16(layout: &Layout, size: usize) -> bool {
    layout.is_contiguous() && at16(layout, size)
}

/// Row stride of `t` when its leading dims collapse into rows of contiguous last-dim elements with
/// one stride (a contiguous tensor, or a narrow of a wider projection); `None` otherwise.
pub(crate) fn row_stride(t: &Tensor) -> Option<usize> {
    let (dims, st) = (t.dims(), t.stride());
    let (&len, lead) = dims.split_last()?;
    if len > 1 && st[dims.len() - 1] != 1 {
        return None;
    }
    // Leading dims of size > 1, innermost first: each must step over the ones inside it.
    let mut rs = None;
    let mut span = 0;
    for i in (0..lead.len()).rev().filter(|&i| lead[i] > 1) {
        match rs {
            None => {
                rs = Some(st[i]);
                span = st[i] * lead[i];
            }
            Some(_) if st[i] == span => span *= lead[i],
            Some(_) => return None,
        }
    }
    let rs = rs.unwrap_or(len);
    (rs >= len).then_some(rs)
}

/// The device data of `rows` rows of `len` elements `stride` apart, starting at `layout`'s offset
/// (see [`row_stride`]; the storage guard must outlive the view).
pub(crate) fn rows_view<'a, T: CudaDType>(
    op: &'static str,
    st: &'a Storage,
    layout: &Layout,
    rows: usize,
    len: usize,
    stride: usize,
) -> Result<CudaView<'a, T>> {
    let start = layout.start_offset();
    let end = start + if rows == 0 { 0 } else { (rows - 1) * stride + len };
    elements(op, st, start..end)
}

pub(crate) fn device(op: &'static str, t: &Tensor) -> Result<CudaDevice> {
    Ok(t.device()
        .as_cuda_device()
        .map_err(|_| err(op, "expected a CUDA tensor"))?
        .clone())
}

/// Wraps a freshly written device buffer as a tensor.
pub(crate) fn wrap<T: CudaDType>(slice: CudaSlice<T>, dev: &CudaDevice, shape: impl Into<Shape>) -> Tensor {
    let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(slice, dev.clone()));
    Tensor::from_storage(storage, shape, BackpropOp::none(), false)
}

/// The kernel-name suffix of a float dtype.
pub(crate) fn dtype_suffix(op: &'static str, dt: DType) -> Result<&'static str> {
    Ok(match dt {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => return Err(err(op, format!("unsupported dtype {other:?}"))),
    })
}

/// A candle in-place op that hands `launch` the tensor's CUDA storage (mutably, as candle holds
/// it for the op) and its element range: how a kernel writes a state buffer in place. The launch
/// runs once; its own results leave through what it captures.
struct CudaInPlace<F> {
    name: &'static str,
    launch: std::cell::RefCell<Option<F>>,
}

impl<F: FnOnce(&mut CudaStorage, Range<usize>) -> Result<()>> candle_core::InplaceOp1 for CudaInPlace<F> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(&self, _: &mut candle_core::CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("{}: the CUDA op got a CPU tensor", self.name)
    }

    fn cuda_fwd(&self, st: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        let (lo, hi) = layout
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg(format!("{}: the state must be contiguous", self.name)))?;
        let launch = self.launch.borrow_mut().take();
        let launch = launch.ok_or_else(|| candle_core::Error::Msg(format!("{}: ran twice", self.name)))?;
        launch(st, lo..hi).map_err(candle_core::Error::wrap)
    }
}

/// Runs `launch` on `state`'s CUDA storage through [`CudaInPlace`].
pub(crate) fn in_place(
    op: &'static str,
    state: &Tensor,
    launch: impl FnOnce(&mut CudaStorage, Range<usize>) -> Result<()>,
) -> Result<()> {
    state.inplace_op1(&CudaInPlace {
        name: op,
        launch: std::cell::RefCell::new(Some(launch)),
    })?;
    Ok(())
}

/// Runs `launch` with `buffer`'s CUDA storage as a mutable view of its elements, or with `None`.
/// `buffer` must not share storage with a tensor that `launch` itself updates in place.
pub(crate) fn with_out_buffer<T: CudaDType, R>(
    op: &'static str,
    buffer: Option<&Tensor>,
    launch: impl FnOnce(Option<&mut CudaViewMut<'_, T>>) -> Result<R>,
) -> Result<R> {
    let Some(buffer) = buffer else {
        return launch(None);
    };
    let mut result = None;
    in_place(op, buffer, |st, range| {
        let mut view = st.as_cuda_slice_mut::<T>()?.slice_mut(range);
        result = Some(launch(Some(&mut view))?);
        Ok(())
    })?;
    result.ok_or_else(|| err(op, "the in-place launch did not run"))
}

/// The device data of `t`'s elements as its layout addresses them: from the start offset through
/// the last element (for kernels that take the strides themselves).
pub(crate) fn span_view<'a, T: CudaDType>(
    op: &'static str,
    st: &'a Storage,
    layout: &Layout,
) -> Result<CudaView<'a, T>> {
    let start = layout.start_offset();
    let dims = layout.dims();
    let last: usize = dims
        .iter()
        .zip(layout.stride())
        .map(|(&n, &s)| n.saturating_sub(1) * s)
        .sum();
    let end = if dims.contains(&0) {
        start
    } else {
        start + last + 1
    };
    elements(op, st, start..end)
}
