//! Kernel launches through `cuLaunchKernelEx`, with programmatic dependent launch (PDL) on Hopper.
//!
//! With PDL a kernel may start while the kernel before it in the stream is still finishing: its
//! blocks become resident once every block of the previous kernel has started (each of our kernels
//! calls `griddepcontrol.launch_dependents` first thing), do what does not depend on earlier
//! kernels (the GEMV loads its first weights), then block in `griddepcontrol.wait` until the
//! previous grid has completed and its writes are visible (which, as that grid waited in turn,
//! orders the whole chain). Measured on an H200 (docs/history/BENCHMARKS-log.md, the PDL A/B
//! runs): 0.3-0.7 ms off an eager decode step of Qwen3.6-27B, nothing measurable inside a CUDA
//! graph.
//!
//! Every kernel in `cuda/*.cu` calls `pdl_wait()` (common.cuh) before it reads or writes global
//! memory that another kernel touches; that is what makes the attribute safe for all of them. The
//! attribute is set where the [`KernelPolicy`] asks for it, the device is sm_90+ and the kernels
//! were built for it (in an older build the wait compiles to nothing).
//!
//! cudarc's `LaunchArgs` cannot pass launch attributes, so this replaces it for our kernels. What
//! it leaves out is cudarc's per-buffer events, which only act when a context runs several
//! streams with event tracking on; candle runs all of a device's work on its one stream, whose
//! order is the synchronisation.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU8, Ordering};

use candle_core::cuda::cudarc::driver::sys::{
    self, CUdevice_attribute, CUlaunchAttribute, CUlaunchAttributeID, CUlaunchAttributeValue, CUlaunchConfig,
};
use candle_core::cuda::cudarc::driver::{
    result, CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DriverError,
    LaunchConfig,
};
use candle_core::CudaDevice;

use crate::KernelPolicy;

/// Compute capability the kernels were built for (build.rs's `CUDA_COMPUTE_CAP`, e.g. `90` or `90a`).
const BUILD_CAP: &str = env!("QWEN36_CUDA_CAP");
/// Most arguments of any kernel in `cuda/*.cu` (the recurrent GDN kernels: 28).
const MAX_ARGS: usize = 32;

/// One kernel argument as the 8-byte word the kernel parameter points to.
pub(crate) trait KernelArg {
    fn word(&self, stream: &CudaStream) -> u64;
}

impl<T> KernelArg for CudaSlice<T> {
    fn word(&self, stream: &CudaStream) -> u64 {
        self.device_ptr(stream).0
    }
}
impl<T> KernelArg for CudaView<'_, T> {
    fn word(&self, stream: &CudaStream) -> u64 {
        self.device_ptr(stream).0
    }
}
impl<T> KernelArg for CudaViewMut<'_, T> {
    fn word(&self, stream: &CudaStream) -> u64 {
        self.device_ptr(stream).0
    }
}
// Scalars sit in the word's low bytes: the kernel reads size_of::<T>() bytes from its start
// (little-endian hosts, as CUDA requires).
macro_rules! scalar_arg {
    ($($t:ty => |$v:ident| $w:expr),*) => {$(
        impl KernelArg for $t {
            fn word(&self, _: &CudaStream) -> u64 {
                let $v = *self;
                $w
            }
        }
    )*};
}
scalar_arg!(i32 => |v| v as u32 as u64, u32 => |v| v as u64, i64 => |v| v as u64, u64 => |v| v,
            f32 => |v| v.to_bits() as u64);

/// The arguments of one launch, pushed in the kernel's parameter order.
pub(crate) struct KernelCall<'a> {
    func: &'a CudaFunction,
    stream: std::sync::Arc<CudaStream>,
    words: [u64; MAX_ARGS],
    n: usize,
    pdl: bool,
}

impl<'a> KernelCall<'a> {
    /// A launch of `func` on `dev`'s stream, with PDL where `policy` and the device allow it.
    pub(crate) fn new(dev: &CudaDevice, func: &'a CudaFunction, policy: &KernelPolicy) -> Self {
        let stream = dev.cuda_stream();
        // Every launch sets the device up (its first also configures the memory pool), whatever
        // the policy says about PDL.
        let setup = device_setup(&stream);
        Self {
            func,
            pdl: policy.pdl && setup.pdl,
            stream,
            words: [0; MAX_ARGS],
            n: 0,
        }
    }

    /// Appends one argument (a device buffer's address or a scalar).
    pub(crate) fn arg<A: KernelArg + ?Sized>(&mut self, a: &A) -> &mut Self {
        assert!(self.n < MAX_ARGS, "more than {MAX_ARGS} kernel arguments");
        self.words[self.n] = a.word(&self.stream);
        self.n += 1;
        self
    }

    /// Launches the kernel on the device's stream.
    ///
    /// # Safety
    /// The pushed arguments must match the kernel's parameters in number, order and size, and
    /// the buffers must be as large as the kernel indexes them (as for cudarc's `launch`).
    pub(crate) unsafe fn launch(&mut self, cfg: LaunchConfig) -> Result<(), DriverError> {
        self.stream.context().bind_to_thread()?;
        let mut params: [*mut c_void; MAX_ARGS] = [std::ptr::null_mut(); MAX_ARGS];
        for (p, w) in params.iter_mut().zip(self.words.iter_mut()).take(self.n) {
            *p = (w as *mut u64).cast();
        }
        let mut attr = CUlaunchAttribute {
            id: CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            // SAFETY: a plain-old-data union; zero is a valid value of every field.
            value: unsafe { std::mem::zeroed::<CUlaunchAttributeValue>() },
        };
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(self.pdl),
        };
        // SAFETY: `params` holds one pointer per pushed argument, each to its word in
        // `self.words`, which outlives the call (the driver copies the values at launch); the
        // caller vouches for the arguments matching the kernel (this function's contract).
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                self.func.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
    }
}

/// What one device supports of our launches.
#[derive(Clone, Copy)]
pub(crate) struct DeviceSetup {
    /// Launches may carry the PDL attribute (an sm_90+ device and kernels built for it).
    pdl: bool,
    /// The device's compute capability major version (0 where it could not be read).
    pub(crate) major: u8,
}

/// What `stream`'s device supports, found at its first use and cached per device ordinal (a
/// fact of the hardware and the build, the same for every policy); that first use also makes
/// the device's memory pool keep freed memory ([`keep_freed_memory`]).
pub(crate) fn device_setup(stream: &CudaStream) -> DeviceSetup {
    // Per ordinal: 0 unknown, else the major version + 1.
    static CACHE: [AtomicU8; 16] = [const { AtomicU8::new(0) }; 16];
    let ctx = stream.context();
    let slot = CACHE.get(ctx.ordinal());
    // The number before any feature suffix (`90a`: 90).
    let build_cap: u32 = BUILD_CAP
        .trim_end_matches(|c: char| c.is_ascii_alphabetic())
        .parse()
        .unwrap_or(0);
    let setup = |major: u8| DeviceSetup {
        pdl: major >= 9 && build_cap >= 90,
        major,
    };
    if let Some(cached) = slot.map(|s| s.load(Ordering::Relaxed)).filter(|&c| c > 0) {
        return setup(cached - 1);
    }
    keep_freed_memory(ctx);
    let major = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        .unwrap_or(0)
        .clamp(0, 254) as u8;
    if let Some(s) = slot {
        s.store(major + 1, Ordering::Relaxed);
    }
    setup(major)
}

/// Lets the device's default memory pool, which candle allocates from (`cuMemAllocAsync`), keep the
/// memory freed into it instead of returning it to the driver at every synchronisation (the
/// pool's default release threshold is 0): the buffers a pass allocates and frees (the chunked
/// GDN scratch is ~0.5 GB at 8k tokens) are then mapped once per process, not once per call, as
/// PyTorch's caching allocator does. The memory stays reserved by the process until it exits;
/// `QWEN36_POOL_KEEP=0` leaves the driver's default (for A/B benchmarks). Best effort: an error
/// here only costs speed.
fn keep_freed_memory(ctx: &CudaContext) {
    if std::env::var("QWEN36_POOL_KEEP").is_ok_and(|v| v == "0") || ctx.bind_to_thread().is_err() {
        return;
    }
    // SAFETY: `cu_device` comes from a live context, bound to this thread above.
    let Ok(pool) = (unsafe { result::device::get_default_mem_pool(ctx.cu_device()) }) else {
        return;
    };
    let mut keep = u64::MAX;
    // SAFETY: the pool is valid and RELEASE_THRESHOLD is a u64 attribute, read from `keep`.
    let _ = unsafe {
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut keep as *mut u64).cast(),
        )
    };
}
