//! The FP8 GEMM for many rows (prefill, batched verifies): the activations quantized to e4m3 per
//! row and 128-element group (`fp8_act_quant` in cuda/linear.cu), then cuBLASLt's block-scaled
//! FP8 matmul on the FP8 tensor cores of sm_90, with the weight's own 128×128 block scales. What
//! transformers' FineGrainedFP8 computes on GPU; the CPU reference is
//! [`reference::fp8_w8a8_linear`](super::reference::fp8_w8a8_linear).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, LazyLock, Mutex};

use candle_core::cuda::cudarc::cublas::sys::cublasOperation_t as Op;
use candle_core::cuda::cudarc::cublaslt::{result as lt, sys};
use candle_core::cuda::cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};
use candle_core::cuda::{CudaDType, WrapErr};
use candle_core::{DType, Device, Tensor};

use super::{Fp8Weight, FP8_ACT_GROUP};
use crate::cuda::{contiguous16, device, dtype_suffix, err, view, wrap, KernelCall, LaunchConfig, LINEAR};
use crate::policy::Fp8GemmPath;
use crate::{KernelPolicy, Result};

/// Whether `dev` has the block-scaled FP8 GEMM: a CUDA device of compute capability 9.x
/// (cuBLASLt's 128-element and 128×128 block scales are Hopper's).
pub fn fp8_gemm_available(dev: &Device) -> bool {
    let Ok(cuda) = dev.as_cuda_device() else {
        return false;
    };
    crate::cuda::device_setup(&cuda.cuda_stream()).major == 9
}

/// Whether [`fp8_gemm`] may take `x: [.., k]` through `w` under `policy`: the policy's
/// [`Fp8GemmPath::Auto`] (or `FromRows`), 16-bit CUDA activations, 128×128 blocks, `n` a
/// multiple of 128 and `k` of 512, an sm_90 device. cuBLASLt 13.1 reads the weight's scales with each row of blocks
/// padded to a multiple of 4 (wrong sums on the H200 for 3 blocks a row: `k` 384) and gave wrong
/// sums for a 40-column weight, so such shapes dequantize (every FP8 layer of Qwen3.6-27B, split
/// over 1, 2 or 4 ranks, has whole blocks, a multiple of 4 of them a row).
pub(crate) fn fp8_gemm_takes(x: &Tensor, w: &Fp8Weight, policy: &KernelPolicy) -> bool {
    let (n, k) = w.dims();
    matches!(policy.fp8_gemm, Fp8GemmPath::Auto | Fp8GemmPath::FromRows(_))
        && matches!(x.dtype(), DType::BF16 | DType::F16)
        && w.block() == [FP8_ACT_GROUP, FP8_ACT_GROUP]
        && k % (4 * FP8_ACT_GROUP) == 0
        && n % FP8_ACT_GROUP == 0
        && w.q().is_contiguous()
        && w.scale().is_contiguous()
        && aligned(w.q(), 1)
        && aligned(w.scale(), 4)
        && fp8_gemm_available(x.device())
}

/// Whether `t`'s data (elements of `size` bytes) starts 256 bytes into an allocation, as the
/// heuristic's algorithms assume of every operand (a layer's weight and scales are whole
/// allocations; the GEMM's other operands it allocates itself).
fn aligned(t: &Tensor, size: usize) -> bool {
    (t.layout().start_offset() * size) % 256 == 0
}

/// CUDA [`reference::fp8_quantize_activations`](super::reference::fp8_quantize_activations):
/// `x: [m, k]` (contiguous, bf16/f16, 16-byte aligned) → `q: [m16, k]` e4m3 and the scales
/// stored `[k / 128, m16]` (each group's rows contiguous, as cuBLASLt reads them), `m16` being `m`
/// rounded up to a multiple of 16: the GEMM runs whole 16-row tiles of activations (rows past
/// `m` zeros of scale 1; cuBLASLt 13.1 summed wrongly on the H200 for 49 rows unpadded).
pub(crate) fn act_quant(x: &Tensor, policy: &KernelPolicy) -> Result<(Tensor, Tensor)> {
    let op = "fp8_quantize_activations";
    let (m, k) = x.dims2()?;
    let dt = x.dtype();
    let aligned = contiguous16(x.layout(), dt.size_in_bytes());
    if k % FP8_ACT_GROUP != 0 || !aligned || !matches!(dt, DType::BF16 | DType::F16) {
        return Err(err(
            op,
            format!(
                "x {:?} {dt:?}: 16-bit, contiguous, 16-byte aligned, columns a multiple of {FP8_ACT_GROUP}",
                x.dims()
            ),
        ));
    }
    let dev = device(op, x)?;
    let groups = k / FP8_ACT_GROUP;
    let ld = m.next_multiple_of(16);
    macro_rules! go {
        ($t:ty) => {{
            let (xs, xl) = x.storage_and_layout();
            let xv = view::<$t>(op, &xs, xl)?;
            // SAFETY: uninitialised; the kernel writes every element (a warp per group of each of
            // the ld rows writes its 128 bytes of q and its scale).
            let q = unsafe { dev.alloc::<float8::F8E4M3>(ld * k)? };
            // SAFETY: as above.
            let s = unsafe { dev.alloc::<f32>(groups * ld)? };
            let func = LINEAR.func(&dev, &format!("fp8_act_quant_{}", dtype_suffix(op, dt)?))?;
            let mut lb = KernelCall::new(&dev, &func, policy);
            let (m32, k32, ld32) = (m as i32, k as i32, ld as i32);
            lb.arg(&xv).arg(&q).arg(&s).arg(&m32).arg(&k32).arg(&ld32);
            let warps = ld * groups;
            let cfg = LaunchConfig {
                grid_dim: ((warps * 32).div_ceil(256) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            if warps > 0 {
                // SAFETY: arguments match `fp8_act_quant_{sfx}` in cuda/linear.cu: x [m·k] of T,
                // contiguous and 16-byte aligned (checked above), q [ld·k] bytes, s [k/128·ld]
                // f32, i32 m, k (a multiple of 128) and ld ≥ m; one warp per group of the ld
                // rows (x read for rows below m only), whole warps past the last group return.
                unsafe { lb.launch(cfg) }.w()?;
            }
            let q = wrap(q, &dev, (ld, k));
            let s = wrap(s, &dev, (groups, ld));
            Ok((q, s))
        }};
    }
    match dt {
        DType::BF16 => go!(half::bf16),
        _ => go!(half::f16),
    }
}

/// A cuBLASLt handle, made once per device ordinal and kept for the process with a reference to
/// the context it was made in, so that the context outlives it (a handle must not outlive its
/// context; candle releases a device's context when its last `Device` drops).
struct Handle(sys::cublasLtHandle_t, #[allow(dead_code)] Arc<CudaContext>);
// SAFETY: a cuBLASLt handle may be used from any thread (cuBLASLt's handles are thread-safe;
// every call here passes its own stream and workspace).
unsafe impl Send for Handle {}

/// The handle of `ctx`'s device (the context bound to this thread by the caller).
fn handle(ctx: &Arc<CudaContext>) -> Result<sys::cublasLtHandle_t> {
    static HANDLES: Mutex<Vec<(usize, Handle)>> = Mutex::new(Vec::new());
    let mut handles = HANDLES.lock().unwrap_or_else(|p| p.into_inner());
    let ordinal = ctx.ordinal();
    if let Some((_, h)) = handles.iter().find(|(o, _)| *o == ordinal) {
        return Ok(h.0);
    }
    let h = lt::create_handle().map_err(cublas_err)?;
    handles.push((ordinal, Handle(h, ctx.clone())));
    Ok(h)
}

/// Whether cuBLASLt refused the problem itself (no kernel for it, or a combination it does not
/// take), not a failure of the device.
fn unsupported(e: &lt::CublasError) -> bool {
    matches!(
        e.0,
        sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED | sys::cublasStatus_t::CUBLAS_STATUS_INVALID_VALUE
    )
}

fn cublas_err(e: lt::CublasError) -> crate::Error {
    err("fp8_gemm", format!("cuBLASLt: {e:?}"))
}

/// The owned cuBLASLt descriptors of one call, destroyed when dropped.
struct Descriptors {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: Vec<sys::cublasLtMatrixLayout_t>,
    pref: Option<sys::cublasLtMatmulPreference_t>,
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: each was created by this call's `Descriptors` and is destroyed once; cuBLASLt
        // has already taken what a queued matmul needs (descriptors are read at the call).
        unsafe {
            let _ = lt::destroy_matmul_desc(self.desc);
            for &l in &self.layouts {
                let _ = lt::destroy_matrix_layout(l);
            }
            if let Some(p) = self.pref {
                let _ = lt::destroy_matmul_pref(p);
            }
        }
    }
}

/// Sets matmul attribute `attr` to `value` (a plain value of the attribute's C type).
///
/// # Safety
/// `T` must be the C type cuBLASLt documents for `attr`.
unsafe fn set_attr<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> Result<()> {
    lt::set_matmul_desc_attribute(desc, attr, (value as *const T).cast(), std::mem::size_of::<T>())
        .map_err(cublas_err)
}

/// A GEMM's device ordinal, rows, columns, inner size and output dtype.
type AlgoKey = (usize, usize, usize, usize, DType);
/// The algorithm cuBLASLt's heuristic picked and the workspace it needs, or `None` when it has
/// none (then the caller dequantizes).
type Algo = Option<(sys::cublasLtMatmulAlgo_t, usize)>;
/// The heuristic's answers, asked once per [`AlgoKey`].
static ALGOS: LazyLock<Mutex<HashMap<AlgoKey, Algo>>> = LazyLock::new(|| Mutex::new(HashMap::new()));

/// `x·(e4m3(w)·scale)ᵀ` for `x: [m, k]` (contiguous bf16/f16; [`fp8_gemm_takes`]) on the FP8
/// tensor cores: `[m, n]` in x's dtype, or `None` where cuBLASLt has no kernel for the shape.
pub(crate) fn fp8_gemm(x: &Tensor, w: &Fp8Weight, policy: &KernelPolicy) -> Result<Option<Tensor>> {
    match x.dtype() {
        DType::BF16 => gemm::<half::bf16>(x, w, policy, sys::cudaDataType::CUDA_R_16BF),
        _ => gemm::<half::f16>(x, w, policy, sys::cudaDataType::CUDA_R_16F),
    }
}

/// [`fp8_gemm`] with output elements `T` (cuBLASLt's `out_type`).
fn gemm<T: CudaDType + DeviceRepr>(
    x: &Tensor,
    w: &Fp8Weight,
    policy: &KernelPolicy,
    out_type: sys::cudaDataType,
) -> Result<Option<Tensor>> {
    let op = "fp8_gemm";
    let (m, k) = x.dims2()?;
    let (n, kw) = w.dims();
    let dt = x.dtype();
    if kw != k || !fp8_gemm_takes(x, w, policy) {
        return Err(err(
            op,
            format!("x {:?} {dt:?} for an FP8 weight [{n}, {kw}]", x.dims()),
        ));
    }
    let dev = device(op, x)?;
    if m == 0 || n == 0 {
        return Ok(Some(Tensor::zeros((m, n), dt, x.device())?));
    }
    let stream: Arc<CudaStream> = dev.cuda_stream();
    stream
        .context()
        .bind_to_thread()
        .map_err(candle_core::Error::wrap)?;
    let ordinal = stream.context().ordinal();
    let handle = handle(stream.context())?;
    // act_quant reads x in 16-byte vectors: a row view at an odd offset is copied first.
    let x = if contiguous16(x.layout(), dt.size_in_bytes()) {
        x.clone()
    } else {
        x.force_contiguous()?
    };
    let (xq, xs) = act_quant(&x, policy)?;
    // The GEMM's rows: m padded to whole 16-row tiles (`act_quant`), the padding's outputs dropped.
    let mp = xq.dim(0)?;
    let (n64, m64, k64) = (n as u64, mp as u64, k as u64);
    // Column-major, as cuBLASLt sees the row-major operands: D [n, m] = op(A) [n, k] · B [k, m],
    // A the weight [n, k] row-major (= [k, n] column-major, transposed), B the activations [m, k]
    // row-major (= [k, m] column-major), D the output [m, n] row-major.
    let desc = lt::create_matmul_desc(
        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        sys::cudaDataType::CUDA_R_32F,
    )
    .map_err(cublas_err)?;
    let mut d = Descriptors {
        desc,
        layouts: Vec::new(),
        pref: None,
    };
    for (ty, rows, cols, ld) in [
        (sys::cudaDataType::CUDA_R_8F_E4M3, k64, n64, k64),
        (sys::cudaDataType::CUDA_R_8F_E4M3, k64, m64, k64),
        (out_type, n64, m64, n64),
    ] {
        d.layouts
            .push(lt::create_matrix_layout(ty, rows, cols, ld as i64).map_err(cublas_err)?);
    }
    let (a_l, b_l, d_l) = (d.layouts[0], d.layouts[1], d.layouts[2]);
    let (ws, sl) = w.scale().storage_and_layout();
    let (qs, ql) = w.q().storage_and_layout();
    let (xqs, xql) = xq.storage_and_layout();
    let (xss, xsl) = xs.storage_and_layout();
    let wq = view::<float8::F8E4M3>(op, &qs, ql)?;
    let wsv = view::<f32>(op, &ws, sl)?;
    let xqv = view::<float8::F8E4M3>(op, &xqs, xql)?;
    let xsv = view::<f32>(op, &xss, xsl)?;
    let (wq_ptr, _g1) = wq.device_ptr(&stream);
    let (ws_ptr, _g2) = wsv.device_ptr(&stream);
    let (xq_ptr, _g3) = xqv.device_ptr(&stream);
    let (xs_ptr, _g4) = xsv.device_ptr(&stream);
    use sys::cublasLtMatmulDescAttributes_t as A;
    // SAFETY: each value has the C type cuBLASLt documents for its attribute: the transposes
    // `int32_t` (cublasOperation_t), the scale modes `int32_t` (cublasLtMatmulMatrixScale_t), the
    // scale pointers `const void*` to device memory that outlives the queued matmul (the tensors
    // are held until this function returns, and freed stream-ordered after it).
    unsafe {
        set_attr(desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &(Op::CUBLAS_OP_T as i32))?;
        set_attr(desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &(Op::CUBLAS_OP_N as i32))?;
        set_attr(
            desc,
            A::CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
            &(sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F as i32),
        )?;
        set_attr(
            desc,
            A::CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
            &(sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F as i32),
        )?;
        set_attr(
            desc,
            A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
            &(ws_ptr as *const c_void),
        )?;
        set_attr(
            desc,
            A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
            &(xs_ptr as *const c_void),
        )?;
    }
    let key = (ordinal, mp, n, k, dt);
    let cached = ALGOS.lock().unwrap_or_else(|p| p.into_inner()).get(&key).copied();
    let algo = match cached {
        Some(a) => a,
        None => {
            let pref = lt::create_matmul_pref().map_err(cublas_err)?;
            d.pref = Some(pref);
            let most = MAX_WORKSPACE as u64;
            // SAFETY: MAX_WORKSPACE_BYTES is a `uint64_t` attribute, read from `most`.
            unsafe {
                lt::set_matmul_pref_attribute(
                    pref,
                    sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    (&most as *const u64).cast(),
                    std::mem::size_of::<u64>(),
                )
                .map_err(cublas_err)?;
            }
            // SAFETY: the descriptors and the preference are live (owned by `d`).
            let found = match unsafe { lt::get_matmul_algo_heuristic(handle, desc, a_l, b_l, d_l, d_l, pref) }
            {
                Ok(h) => Some((h.algo, h.workspaceSize)),
                // No algorithm for the shape: remembered, the caller falls back.
                Err(e) if unsupported(&e) => None,
                Err(e) => return Err(cublas_err(e)),
            };
            ALGOS.lock().unwrap_or_else(|p| p.into_inner()).insert(key, found);
            found
        }
    };
    let Some((algo, ws_size)) = algo else {
        return Ok(None);
    };
    // SAFETY: uninitialised; the matmul writes every element of D (beta = 0: C is not read).
    let mut y = unsafe { dev.alloc::<T>(mp * n)? };
    // SAFETY: uninitialised scratch that cuBLASLt owns for the call.
    let mut workspace = unsafe { dev.alloc::<u8>(ws_size.max(1))? };
    {
        let (y_ptr, _g5) = y.device_ptr_mut(&stream);
        let (w_ptr, _g6) = workspace.device_ptr_mut(&stream);
        let (alpha, beta) = (1f32, 0f32);
        // SAFETY: the operands match the layouts above: the weight [n·k] and the activations
        // [mp·k] e4m3, contiguous (checked by `fp8_gemm_takes` and made by `act_quant`), their
        // scales [n/128·k/128] (row-major, each row's k-blocks contiguous) and [k/128·mp]
        // (`act_quant`'s layout), the output [mp·n] of `dt` (C = D, beta = 0), a workspace of the
        // size the heuristic asked for; alpha and beta are host f32 (the default pointer mode,
        // CUDA_R_32F scale type); the stream is the tensors' own.
        let status = unsafe {
            lt::matmul(
                handle,
                desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                wq_ptr as *const c_void,
                a_l,
                xq_ptr as *const c_void,
                b_l,
                y_ptr as *const c_void,
                d_l,
                y_ptr as *mut c_void,
                d_l,
                &algo,
                w_ptr as *mut c_void,
                ws_size,
                stream.cu_stream() as sys::cudaStream_t,
            )
        };
        match status {
            Ok(()) => {}
            // Nothing was queued: the shape is remembered as unsupported, the caller falls back.
            Err(e) if unsupported(&e) => {
                ALGOS.lock().unwrap_or_else(|p| p.into_inner()).insert(key, None);
                return Ok(None);
            }
            Err(e) => return Err(cublas_err(e)),
        }
    }
    drop(d);
    Ok(Some(wrap(y, &dev, (mp, n)).narrow(0, 0, m)?))
}

/// The most workspace a matmul may ask for (NVIDIA's recommendation for Hopper, as cudarc's).
const MAX_WORKSPACE: usize = 32 << 20;
