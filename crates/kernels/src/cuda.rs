//! CUDA launches of `cuda/*.cu` (PTX from build.rs). Same signatures as the CPU
//! references; the dispatch happens in the op functions when the inputs live on a CUDA device.

use candle_core::cuda::cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use candle_core::cuda::cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DeviceRepr, LaunchConfig};
use candle_core::cuda::{CudaDType, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Shape, Storage, Tensor};

mod launch;
use launch::KernelCall;

use crate::delta_rule::{ChunkPath, DeltaRuleMode, DeltaRuleOutput, Dims as Launch};
use crate::{Error, Result};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gdn.ptx"));
const MODULE: &str = "qwen36_gdn";
/// Threads per block of the delta-rule kernels (4 warps), and state columns per block.
const THREADS: u32 = 128;
const BV: usize = 32;
/// Grids of the recurrent kernel from which its 64-register variant (8 blocks per SM) runs: at the
/// 27B shape B = 8 (1536 blocks) gained with it and B = 1 (192) lost (GDN kernels run 9 (c)).
const WIDE_MIN_BLOCKS: usize = 1024;

/// Runs the calling function's local `go!` macro with the Rust element type of `$dt` (f32, bf16
/// or f16); any other dtype is an error naming `$op`.
macro_rules! for_float_dtype {
    ($op:expr, $dt:expr) => {
        match $dt {
            DType::F32 => go!(f32),
            DType::BF16 => go!(half::bf16),
            DType::F16 => go!(half::f16),
            other => Err(err($op, format!("unsupported dtype {other:?}"))),
        }
    };
}

fn err(op: &'static str, msg: impl Into<String>) -> Error {
    Error::Shape { op, msg: msg.into() }
}

/// The device data of a contiguous tensor (the storage guard must outlive the view).
fn view<'a, T: CudaDType>(op: &'static str, st: &'a Storage, layout: &Layout) -> Result<CudaView<'a, T>> {
    let Storage::Cuda(cs) = st else {
        return Err(err(op, "expected a CUDA tensor"));
    };
    let (a, b) = layout
        .contiguous_offsets()
        .ok_or_else(|| err(op, "expected a contiguous tensor"))?;
    Ok(cs.as_cuda_slice::<T>()?.slice(a..b))
}

/// Row stride of `t` when its leading dims collapse into rows of contiguous last-dim elements with
/// one stride (a contiguous tensor, or a narrow of a wider projection); `None` otherwise.
fn row_stride(t: &Tensor) -> Option<usize> {
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
fn rows_view<'a, T: CudaDType>(
    op: &'static str,
    st: &'a Storage,
    layout: &Layout,
    rows: usize,
    len: usize,
    stride: usize,
) -> Result<CudaView<'a, T>> {
    let Storage::Cuda(cs) = st else {
        return Err(err(op, "expected a CUDA tensor"));
    };
    let start = layout.start_offset();
    let end = start + if rows == 0 { 0 } else { (rows - 1) * stride + len };
    Ok(cs.as_cuda_slice::<T>()?.slice(start..end))
}

fn device(op: &'static str, t: &Tensor) -> Result<CudaDevice> {
    Ok(t.device()
        .as_cuda_device()
        .map_err(|_| err(op, "expected a CUDA tensor"))?
        .clone())
}

/// Wraps a freshly written device buffer as a tensor.
fn wrap<T: CudaDType>(slice: CudaSlice<T>, dev: &CudaDevice, shape: impl Into<Shape>) -> Tensor {
    let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(slice, dev.clone()));
    Tensor::from_storage(storage, shape, BackpropOp::none(), false)
}

/// Register rows per thread for a key dim: the smallest compiled variant with 4·rows ≥ dk.
fn rows_variant(op: &'static str, dk: usize) -> Result<usize> {
    [2usize, 4, 8, 16, 32, 64]
        .into_iter()
        .find(|&r| 4 * r >= dk)
        .ok_or_else(|| err(op, format!("key head dim {dk} > 256 is not supported on CUDA")))
}

fn dtype_suffix(op: &'static str, dt: DType) -> Result<&'static str> {
    Ok(match dt {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => return Err(err(op, format!("unsupported dtype {other:?}"))),
    })
}

/// The inputs every delta-rule kernel takes, in its argument order. `q`, `k`, `v` are
/// `(tensor, element offset)`: separate f32 tensors at offset 0, or three views into the fused
/// `qkv` rows; `strides` are the (q/k, v) row lengths. `ga`/`gb` (`[b, t, hv]`) are g/beta, or
/// the raw a/b projections when `a_log`/`dt_bias` are given (the kernel then computes the gates);
/// their rows of `hv` values sit `g_stride` apart (views into a wider projection are read in place).
struct DeltaRuleInputs<'t> {
    q: (&'t Tensor, usize),
    k: (&'t Tensor, usize),
    v: (&'t Tensor, usize),
    strides: (usize, usize),
    ga: &'t Tensor,
    gb: &'t Tensor,
    g_stride: usize,
    gate_params: Option<(&'t Tensor, &'t Tensor)>,
    state: Option<&'t Tensor>,
}

/// Device views of [`DeltaRuleInputs`], alive while their storage guards are.
struct DeltaRuleViews<'a, T> {
    q: CudaView<'a, T>,
    k: CudaView<'a, T>,
    v: CudaView<'a, T>,
    strides: (i64, i64),
    ga: CudaView<'a, T>,
    gb: CudaView<'a, T>,
    g_stride: i64,
    gate_params: Option<(CudaView<'a, f32>, CudaView<'a, f32>)>,
    state: Option<CudaView<'a, f32>>,
    /// A null pointer for absent optional buffers.
    null: u64,
}

impl<'a, T: CudaDType> DeltaRuleViews<'a, T> {
    /// Pushes the argument prefix shared by `gdn_recurrent_*`, `gdn_fused_*` and
    /// `gdn_chunk_prep_*`: q, k, v, the two i64 row strides, ga, gb, their i64 row stride, a_log
    /// and dt_bias (or nulls).
    fn push_inputs(&self, lb: &mut KernelCall) {
        lb.arg(&self.q)
            .arg(&self.k)
            .arg(&self.v)
            .arg(&self.strides.0)
            .arg(&self.strides.1)
            .arg(&self.ga)
            .arg(&self.gb)
            .arg(&self.g_stride);
        match &self.gate_params {
            Some((a, b)) => lb.arg(a).arg(b),
            None => lb.arg(&self.null).arg(&self.null),
        };
    }

    /// Pushes the initial state, or null for a zero state.
    fn push_state(&self, lb: &mut KernelCall) {
        match &self.state {
            Some(s) => lb.arg(s),
            None => lb.arg(&self.null),
        };
    }
}

/// Locks the inputs' storage and hands their device views to `f`.
fn with_views<T: CudaDType, R>(
    op: &'static str,
    inp: &DeltaRuleInputs,
    f: impl FnOnce(&DeltaRuleViews<T>) -> Result<R>,
) -> Result<R> {
    let (qs, ql) = inp.q.0.storage_and_layout();
    let (ks, kl) = inp.k.0.storage_and_layout();
    let (vs, vl) = inp.v.0.storage_and_layout();
    let (gas, gal) = inp.ga.storage_and_layout();
    let (gbs, gbl) = inp.gb.storage_and_layout();
    let params = inp
        .gate_params
        .map(|(a, b)| (a.storage_and_layout(), b.storage_and_layout()));
    let s0 = inp.state.map(|s| s.storage_and_layout());
    let hv = inp.ga.dims().last().copied().unwrap_or(0);
    let g_rows = inp.ga.elem_count() / hv.max(1);
    let views = DeltaRuleViews {
        q: view::<T>(op, &qs, ql)?.slice(inp.q.1..),
        k: view::<T>(op, &ks, kl)?.slice(inp.k.1..),
        v: view::<T>(op, &vs, vl)?.slice(inp.v.1..),
        strides: (inp.strides.0 as i64, inp.strides.1 as i64),
        ga: rows_view::<T>(op, &gas, gal, g_rows, hv, inp.g_stride)?,
        gb: rows_view::<T>(op, &gbs, gbl, g_rows, hv, inp.g_stride)?,
        g_stride: inp.g_stride as i64,
        gate_params: match &params {
            Some(((as_, al), (bs, bl))) => Some((view::<f32>(op, as_, al)?, view::<f32>(op, bs, bl)?)),
            None => None,
        },
        state: match &s0 {
            Some((s, l)) => Some(view::<f32>(op, s, l)?),
            None => None,
        },
        null: 0,
    };
    f(&views)
}

/// The grid of the kernels that keep the state in registers (recurrent, fused, chunk scan): one
/// block of THREADS per (sequence, value head, BV state columns).
fn state_column_blocks(d: Launch) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((d.b * d.hv * d.dv.div_ceil(BV)) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Where the recurrent kernel writes the state after every token (a verify pass's checkpoints).
enum Keep<'a, 'v> {
    /// Nowhere.
    No,
    /// A fresh buffer, returned.
    Fresh,
    /// The caller's `[b, t, hv, dk, dv]` buffer.
    Into(&'a mut CudaViewMut<'v, f32>),
}

impl Keep<'_, '_> {
    fn fresh(keep_all_states: bool) -> Self {
        if keep_all_states {
            Self::Fresh
        } else {
            Self::No
        }
    }
}

/// Runs the recurrent kernel (`gdn_recurrent_*` or `gdn_fused_*`, see [`DeltaRuleInputs`]).
/// With `in_place` (a state buffer of `[b, hv, dk, dv]` f32, and `inp.state` None) the kernel
/// starts from that buffer and writes the final state back into it; the returned `state` is then
/// `None`.
fn launch_recurrent<T: CudaDType>(
    op: &'static str,
    name: String,
    d: Launch,
    inp: DeltaRuleInputs,
    scale: f32,
    keep: Keep,
    in_place: Option<&mut CudaViewMut<'_, f32>>,
) -> Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
    let dev = device(op, inp.q.0)?;
    let n_out = d.b * d.t * d.hv * d.dv;
    let n_state = d.b * d.hv * d.dk * d.dv;
    // SAFETY: uninitialised (no memset per call): the kernels write every element. Blocks cover
    // every (sequence, value head, column tile); in each, the threads of columns j < dv write
    // `out` at every token (warp 0), and every state row r < dk of their column into `s_all` at
    // every token and into `s_final` at the end (cuda/gdn.cu, `gdn_recurrent`).
    let out = unsafe { dev.alloc::<f32>(n_out)? };
    let s_fresh = match in_place {
        Some(_) => None,
        None => Some(unsafe { dev.alloc::<f32>(n_state)? }),
    };
    let s_all = match keep {
        Keep::Fresh => Some(unsafe { dev.alloc::<f32>(n_state * d.t)? }),
        _ => None,
    };
    with_views::<T, _>(op, &inp, |v| {
        let func = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
        let mut lb = KernelCall::new(&dev, &func);
        v.push_inputs(&mut lb);
        v.push_state(&mut lb);
        lb.arg(&out);
        let flag: i32 = match (&s_fresh, in_place) {
            (Some(s), _) => {
                lb.arg(s);
                0
            }
            (None, Some(s)) => {
                lb.arg(s);
                1
            }
            (None, None) => unreachable!("a fresh state buffer is allocated without in_place"),
        };
        match (&s_all, keep) {
            (Some(s), _) => lb.arg(s),
            (None, Keep::Into(s)) => lb.arg(s),
            (None, _) => lb.arg(&v.null),
        };
        lb.arg(&flag);
        let dims = [d.t as i32, d.hk as i32, d.hv as i32, d.dk as i32, d.dv as i32];
        for x in &dims {
            lb.arg(x);
        }
        let eps = 1e-6f32;
        lb.arg(&scale).arg(&eps);
        let cfg = state_column_blocks(d);
        // SAFETY: the argument list matches the kernel's signature in cuda/gdn.cu (the shared
        // input prefix, the initial state or null, then the outputs, the in-place flag, i32
        // dims, f32 scale and eps); buffers have the sizes checked by the callers, outputs are
        // fresh allocations of the sizes the kernel writes or (in place, flag 1, initial state
        // null) the caller's state buffer of that size, which the kernel reads before it writes
        // (each thread its own elements), the caller's buffer for every token's state (`Keep::
        // Into`, b·t·hv·dk·dv f32: checked by the caller, disjoint from the state), and null (0)
        // is passed only where the kernel tests for it.
        unsafe { lb.launch(cfg) }.w()?;
        Ok(())
    })?;
    Ok((
        wrap(out, &dev, (d.b, d.t, d.hv, d.dv)),
        s_fresh.map(|s| wrap(s, &dev, (d.b, d.hv, d.dk, d.dv))),
        s_all.map(|s| wrap(s, &dev, (d.b, d.t, d.hv, d.dk, d.dv))),
    ))
}

/// The outputs of a fresh-state recurrent launch as a [`DeltaRuleOutput`].
fn fresh_output(r: (Tensor, Option<Tensor>, Option<Tensor>)) -> DeltaRuleOutput {
    let (out, state, all_states) = r;
    DeltaRuleOutput {
        out,
        state: state.expect("a launch without in_place returns its fresh state"),
        all_states,
    }
}

/// Chunk length of the chunked kernels (cuda/gdn.cu `CH`) and their largest key dim.
const CHUNK: usize = 64;
const CHUNK_MAX_DK: usize = 128;
/// Shared memory of `gdn_chunk_prep_*` (cuda/gdn.cu `PREP_SMEM_FLOATS`): transposed q and k tiles
/// with rows of CHUNK + 4 floats, the [CHUNK, CHUNK] A, six per-row vectors.
const PREP_SMEM: usize = 4 * (2 * CHUNK_MAX_DK * (CHUNK + 4) + CHUNK * CHUNK + 6 * CHUNK);

/// Shared memory of `gdn_chunk_scan_c{cols}` (cuda/gdn.cu `scan_smem_floats`): the W and Kt
/// tiles [CHUNK, dk + 4], the [dk, cols] state tile, [CHUNK, cols] Vt.
fn scan_smem(cols: usize) -> usize {
    4 * (2 * CHUNK * (CHUNK_MAX_DK + 4) + CHUNK_MAX_DK * cols + CHUNK * cols)
}
/// Output columns per block of `gdn_chunk_out` and its shared memory: the Qt tile, a
/// [dk, 32] state tile, [CHUNK, CHUNK + 4] P, [CHUNK, 32] Vt.
const OUT_COLS: usize = 32;
const OUT_SMEM: usize =
    4 * (CHUNK * (CHUNK_MAX_DK + 4) + CHUNK_MAX_DK * OUT_COLS + CHUNK * (CHUNK + 4) + CHUNK * OUT_COLS);

/// The tensor-core kernels' bf16 tiles (cuda/gdn.cu `TC_*`): rows padded by 8 elements; the scan
/// keeps 32 or 64 state columns per block, the output kernel writes 64 columns per block.
const TC_S: usize = CHUNK_MAX_DK + 8;
const TC_OV: usize = 64;
/// Shared memory of the tensor-core scan with `bv` state columns per block (cuda/gdn.cu
/// `tc_scan_smem`): W and raw k [2, CHUNK, TC_S], U [2, CHUNK, bv + 8], the bf16 state
/// [dk, bv + 8], Vt and fk Vt [CHUNK, bv + 8]; when it forms the outputs (`out`) also raw q
/// [2, CHUNK, TC_S] and P [2, CHUNK, TC_OV + 8].
const fn tc_scan_smem(bv: usize, out: bool) -> usize {
    let outputs = if out { 2 * CHUNK * (TC_S + TC_OV + 8) } else { 0 };
    2 * (4 * CHUNK * TC_S + (2 * CHUNK + CHUNK_MAX_DK + 2 * CHUNK) * (bv + 8) + outputs)
}
/// `TC_PREP_SMEM`: raw k and v [CHUNK, TC_S] bf16, a region for raw q and A, later the two bf16
/// pairs of [CHUNK, CHUNK + 8], six f32 row vectors.
const TC_PREP_SMEM: usize = 2 * 2 * CHUNK * TC_S + 2 * 4 * CHUNK * (CHUNK + 8) + 4 * 6 * CHUNK;
/// `TC_OUT_SMEM`: raw q [CHUNK, TC_S], the hs tile [dk, 72], P and Vt [CHUNK, 72].
const TC_OUT_SMEM: usize = 2 * (CHUNK * TC_S + (CHUNK_MAX_DK + 2 * CHUNK) * (TC_OV + 8));

/// The kernels of one chunked path: their names, threads per block, state or output columns per
/// block, and dynamic shared memory; `out` is `None` where the scan forms the outputs itself;
/// `raw_qk`: the scan and output kernels read the raw k and q rows with the prep's row factors
/// (tensor cores) instead of the prep's Kt and Qt.
struct ChunkKernels {
    prep: (String, usize),
    scan: (String, usize, usize, usize),
    out: Option<(&'static str, usize, usize, usize)>,
    raw_qk: bool,
}

/// The tensor-core scan: 64 state columns per block with each chunk's outputs formed in it, or
/// 32 or 64 columns followed by the output kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TensorCoreScan {
    WithOutputs,
    Split(usize),
}

impl ChunkKernels {
    /// The f32 path on CUDA cores: f32 intermediates, `cols` state columns per scan block.
    fn f32(prep: String, cols: usize) -> Self {
        Self {
            prep: (prep, PREP_SMEM),
            scan: (format!("gdn_chunk_scan_c{cols}"), 8 * cols, cols, scan_smem(cols)),
            out: Some(("gdn_chunk_out", 256, OUT_COLS, OUT_SMEM)),
            raw_qk: false,
        }
    }

    /// The tensor-core path of bf16 activations: bf16 intermediates, f32 state, the scan
    /// [`tensor_core_scan`] picks.
    fn tensor_cores(scan: TensorCoreScan) -> Self {
        let (scan, out) = match scan {
            TensorCoreScan::WithOutputs => (
                (
                    "gdn_chunk_scan_out_tc_bv64".into(),
                    256,
                    64,
                    tc_scan_smem(64, true),
                ),
                None,
            ),
            TensorCoreScan::Split(bv) => (
                (
                    format!("gdn_chunk_scan_tc_bv{bv}"),
                    256,
                    bv,
                    tc_scan_smem(bv, false),
                ),
                Some(("gdn_chunk_out_tc", 128, TC_OV, TC_OUT_SMEM)),
            ),
        };
        Self {
            prep: ("gdn_chunk_prep_tc".into(), TC_PREP_SMEM),
            scan,
            out,
            raw_qk: true,
        }
    }
}

/// State columns per block of the f32 chunk scan: 32 measured faster than 16 at B = 1 and 4
/// (docs/BENCHMARKS.md) unless a benchmark forces 16.
fn f32_scan_columns() -> usize {
    match crate::delta_rule::chunk_path() {
        ChunkPath::CudaCores(16) => 16,
        _ => 32,
    }
}

/// The tensor-core scan on `dev`: the widest its shared memory per block holds. 64 state columns
/// with the outputs (174 KiB: sm_90) saves the output kernel and the global round trip of the
/// chunk-entry states and Vt; 64 columns without (122 KiB: sm_80) read each chunk's W and k once
/// for twice the columns of 32 (run 9 of the GDN table: 18% faster on the H200); else 32 (sm_86,
/// sm_89: 99 KiB). [`ChunkPath::TensorCores`] may ask for the split scan of 32 or 64 columns.
fn tensor_core_scan(dev: &CudaDevice) -> TensorCoreScan {
    let stream = dev.cuda_stream();
    let optin = CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN;
    let max = stream.context().attribute(optin).map_or(0, |b| b as usize);
    match crate::delta_rule::chunk_path() {
        ChunkPath::TensorCores(32) => TensorCoreScan::Split(32),
        ChunkPath::TensorCores(64) if max >= tc_scan_smem(64, false) => TensorCoreScan::Split(64),
        _ if max >= tc_scan_smem(64, true) => TensorCoreScan::WithOutputs,
        _ if max >= tc_scan_smem(64, false) => TensorCoreScan::Split(64),
        _ => TensorCoreScan::Split(32),
    }
}

/// Whether the chunked kernels take this shape (else the token-by-token kernel runs).
fn chunked_supported(d: Launch) -> bool {
    d.dk <= CHUNK_MAX_DK && d.dk % 4 == 0 && d.dv % 4 == 0
}

/// Whether the fused chunked op of dtype `dt` runs on tensor cores: bf16 activations, dv at most
/// 128 like dk (the prep holds a chunk's v rows in one [CHUNK, 128] tile), q, k and v head rows
/// that start 16 bytes apart and aligned (dk, dv, row strides and offsets multiples of 8 elements:
/// the kernels copy them in 16-byte pieces), and no CUDA-core path forced by
/// [`crate::delta_rule::force_chunk_path`].
fn chunked_on_tensor_cores(d: Launch, dt: DType, inp: &DeltaRuleInputs) -> bool {
    let aligned = |(t, off): (&Tensor, usize)| (t.layout().start_offset() + off) % 8 == 0;
    dt == DType::BF16
        && d.dv <= CHUNK_MAX_DK
        && d.dk % 8 == 0
        && d.dv % 8 == 0
        && inp.strides.0 % 8 == 0
        && inp.strides.1 % 8 == 0
        && aligned(inp.q)
        && aligned(inp.k)
        && aligned(inp.v)
        && !matches!(crate::delta_rule::chunk_path(), ChunkPath::CudaCores(_))
}

/// Lets kernel `name` of `module` take `smem` bytes of dynamic shared memory (past the default
/// 48 KiB).
fn allow_smem(dev: &CudaDevice, name: &str, smem: usize, module: &str, ptx: &'static str) -> Result<()> {
    if smem > 48 * 1024 {
        // The attribute belongs to the module's function, shared by every handle to it.
        dev.get_or_load_custom_func(name, module, ptx)?
            .into_cuda_function()
            .set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .w()?;
    }
    Ok(())
}

/// Runs the chunked kernels (prep per chunk, the scan over chunks, then the outputs per chunk
/// unless the scan forms them); same inputs as [`launch_recurrent`], no intermediate states. `S`
/// is the type of the intermediates (U, W, P, the chunk-entry states hs, and Qt, Kt unless
/// `raw_qk`): f32, or bf16 for the tensor-core kernels.
fn launch_chunked<T: CudaDType, S: CudaDType + DeviceRepr>(
    op: &'static str,
    kernels: &ChunkKernels,
    d: Launch,
    inp: DeltaRuleInputs,
    scale: f32,
) -> Result<DeltaRuleOutput> {
    let dev = device(op, inp.q.0)?;
    let nc = d.t.div_ceil(CHUNK);
    let nb = d.b * d.hv * nc;
    let rows = nb * CHUNK;
    // Scratch: U [rows, dv] (a split scan overwrites it with Vt), W [rows, dk], P [rows, CHUNK],
    // the chunk-entry states hs [nb, dk, dv] (none when the scan forms the outputs), then Qt and
    // Kt [rows, dk] (without raw_qk); in f32: gL [nb], then the row factors fq and fk [rows] (with
    // raw_qk). Every part of the first spans a multiple of 64 rows, so each starts 16-byte aligned
    // for the kernels' vector loads; the f32 parts are read one value at a time.
    let (u, w, p, hs, qt, kt) = (0, 1, 2, 3, 4, 5);
    let hs_size = if kernels.out.is_some() {
        nb * d.dk * d.dv
    } else {
        0
    };
    let mut sizes = vec![rows * d.dv, rows * d.dk, rows * CHUNK, hs_size];
    if !kernels.raw_qk {
        sizes.extend([rows * d.dk, rows * d.dk]);
    }
    let f32_sizes = if kernels.raw_qk {
        vec![nb, rows, rows]
    } else {
        vec![nb]
    };
    // SAFETY: uninitialised; the prep kernel writes every element of U, W, P, Qt, Kt and the f32
    // parts (rows past the sequence end as zeros) before the scan reads them, and the scan writes
    // all of hs before the output kernel reads it.
    let scratch = unsafe { dev.alloc::<S>(sizes.iter().sum())? };
    let scratch32 = unsafe { dev.alloc::<f32>(f32_sizes.iter().sum())? };
    let split = |n: &[usize]| {
        let mut off = 0;
        n.iter()
            .map(|&n| {
                off += n;
                off - n..off
            })
            .collect::<Vec<_>>()
    };
    let parts: Vec<_> = split(&sizes).into_iter().map(|r| scratch.slice(r)).collect();
    let parts32: Vec<_> = split(&f32_sizes)
        .into_iter()
        .map(|r| scratch32.slice(r))
        .collect();
    // SAFETY: uninitialised; the output kernel writes every output row, the scan the whole final
    // state.
    let out = unsafe { dev.alloc::<f32>(d.b * d.t * d.hv * d.dv)? };
    let s_final = unsafe { dev.alloc::<f32>(d.b * d.hv * d.dk * d.dv)? };
    with_views::<T, _>(op, &inp, |v| {
        let eps = 1e-6f32;
        let dims = [d.t as i32, d.hk as i32, d.hv as i32, d.dk as i32, d.dv as i32];
        let (name, smem) = &kernels.prep;
        allow_smem(&dev, name, *smem, MODULE, PTX)?;
        let func = dev.get_or_load_custom_func(name, MODULE, PTX)?;
        let mut lb = KernelCall::new(&dev, &func);
        v.push_inputs(&mut lb);
        lb.arg(&parts[u]).arg(&parts[w]);
        if kernels.raw_qk {
            lb.arg(&parts[p])
                .arg(&parts32[0])
                .arg(&parts32[1])
                .arg(&parts32[2]);
        } else {
            lb.arg(&parts[qt]).arg(&parts[kt]).arg(&parts[p]).arg(&parts32[0]);
        }
        for x in &dims {
            lb.arg(x);
        }
        lb.arg(&scale).arg(&eps);
        let cfg = LaunchConfig {
            grid_dim: (nb as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: *smem as u32,
        };
        // SAFETY: arguments match `gdn_chunk_prep_*` in cuda/gdn.cu: the shared input prefix, U,
        // W, then P, gL, fq, fk (gdn_chunk_prep_tc) or Qt, Kt, P, gL (the f32 preps), i32 dims,
        // f32 scale and eps, with the sizes above; the dynamic shared memory is the size the kernel
        // lays out, its limit raised above.
        unsafe { lb.launch(cfg) }.w()?;

        let (name, threads, cols, smem) = &kernels.scan;
        allow_smem(&dev, name, *smem, MODULE, PTX)?;
        let func = dev.get_or_load_custom_func(name, MODULE, PTX)?;
        let mut lb = KernelCall::new(&dev, &func);
        // U (a split scan overwrites it with Vt), W, then raw k with its row stride and fk, or
        // Kt; the scan with the outputs also takes raw q between k and the stride, fq after fk,
        // then P; gL, the state, then hs or the outputs, the final state.
        lb.arg(&parts[u]).arg(&parts[w]);
        let fused = kernels.out.is_none();
        if fused {
            lb.arg(&v.k)
                .arg(&v.q)
                .arg(&v.strides.0)
                .arg(&parts32[2])
                .arg(&parts32[1])
                .arg(&parts[p]);
        } else if kernels.raw_qk {
            lb.arg(&v.k).arg(&v.strides.0).arg(&parts32[2]);
        } else {
            lb.arg(&parts[kt]);
        }
        lb.arg(&parts32[0]);
        v.push_state(&mut lb);
        if fused {
            lb.arg(&out);
        } else {
            lb.arg(&parts[hs]);
        }
        lb.arg(&s_final);
        let tail_dims = if kernels.raw_qk {
            vec![
                d.b as i32,
                d.t as i32,
                d.hk as i32,
                d.hv as i32,
                d.dk as i32,
                d.dv as i32,
            ]
        } else {
            vec![d.b as i32, d.t as i32, d.hv as i32, d.dk as i32, d.dv as i32]
        };
        for x in &tail_dims {
            lb.arg(x);
        }
        let cfg = LaunchConfig {
            grid_dim: ((d.b * d.hv * d.dv.div_ceil(*cols)) as u32, 1, 1),
            block_dim: (*threads as u32, 1, 1),
            shared_mem_bytes: *smem as u32,
        };
        // SAFETY: arguments match `gdn_chunk_scan_*`: the scratch parts written above (and the
        // raw k view, and q for gdn_chunk_scan_out_tc_bv64, with their i64 row stride for the
        // tensor-core scans), the initial state or null, hs (or the fresh outputs [b, t, hv, dv]
        // f32) and the final state (sizes it writes), then i32 dims; one block of `threads` per
        // (sequence, value head, cols state columns), as the kernel expects.
        unsafe { lb.launch(cfg) }.w()?;

        let Some((name, threads, cols, smem)) = kernels.out else {
            return Ok(());
        };
        allow_smem(&dev, name, smem, MODULE, PTX)?;
        let func = dev.get_or_load_custom_func(name, MODULE, PTX)?;
        let mut lb = KernelCall::new(&dev, &func);
        // Vt (in U's place), then raw q with its row stride and fq, or Qt; P, hs
        lb.arg(&parts[u]);
        if kernels.raw_qk {
            lb.arg(&v.q).arg(&v.strides.0).arg(&parts32[1]);
        } else {
            lb.arg(&parts[qt]);
        }
        lb.arg(&parts[p]).arg(&parts[hs]).arg(&out);
        for x in &tail_dims {
            lb.arg(x);
        }
        let cfg = LaunchConfig {
            grid_dim: ((nb * d.dv.div_ceil(cols)) as u32, 1, 1),
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: arguments match `gdn_chunk_out*`: Vt, q or Qt, P and hs as written by the two
        // kernels before it on this stream (raw q as given), the fresh output, i32 dims; one block
        // of `threads` per (sequence, value head, chunk, cols output columns).
        unsafe { lb.launch(cfg) }.w()?;
        Ok(())
    })?;
    Ok(DeltaRuleOutput {
        out: wrap(out, &dev, (d.b, d.t, d.hv, d.dv)),
        state: wrap(s_final, &dev, (d.b, d.hv, d.dk, d.dv)),
        all_states: None,
    })
}

/// Separate q, k, v, g, beta and initial state as contiguous f32 tensors: the inputs of the
/// unfused kernels (q, k already normalised, gates already computed).
struct SeparateF32 {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Option<Tensor>,
}

impl SeparateF32 {
    fn new(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        g: &Tensor,
        beta: &Tensor,
        state: Option<&Tensor>,
    ) -> Result<Self> {
        let f = |t: &Tensor| -> Result<Tensor> { Ok(t.to_dtype(DType::F32)?.contiguous()?) };
        Ok(Self {
            q: f(q)?,
            k: f(k)?,
            v: f(v)?,
            g: f(g)?,
            beta: f(beta)?,
            state: state.map(f).transpose()?,
        })
    }

    fn inputs(&self, d: Launch) -> DeltaRuleInputs<'_> {
        DeltaRuleInputs {
            q: (&self.q, 0),
            k: (&self.k, 0),
            v: (&self.v, 0),
            strides: (d.hk * d.dk, d.hv * d.dv),
            ga: &self.g,
            gb: &self.beta,
            g_stride: d.hv,
            gate_params: None,
            state: self.state.as_ref(),
        }
    }
}

/// CUDA twin of `chunked_gated_delta_rule` (f32 inputs): the chunked kernels where
/// [`chunked_supported`], the token-by-token kernel otherwise.
#[allow(clippy::too_many_arguments)]
pub(crate) fn chunked(
    d: Launch,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    state: Option<&Tensor>,
    scale: f32,
) -> Result<DeltaRuleOutput> {
    if !chunked_supported(d) {
        return recurrent(d, q, k, v, g, beta, state, scale, false);
    }
    let x = SeparateF32::new(q, k, v, g, beta, state)?;
    let kernels = ChunkKernels::f32("gdn_chunk_prep_f32".into(), f32_scan_columns());
    launch_chunked::<f32, f32>("chunked_gated_delta_rule", &kernels, d, x.inputs(d), scale)
}

/// CUDA twin of `recurrent_gated_delta_rule` (f32 inputs; shapes checked by the caller).
#[allow(clippy::too_many_arguments)]
pub(crate) fn recurrent(
    d: Launch,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    state: Option<&Tensor>,
    scale: f32,
    keep_all_states: bool,
) -> Result<DeltaRuleOutput> {
    let op = "recurrent_gated_delta_rule";
    let name = format!("gdn_recurrent_f32_r{}", rows_variant(op, d.dk)?);
    let x = SeparateF32::new(q, k, v, g, beta, state)?;
    let keep = Keep::fresh(keep_all_states);
    launch_recurrent::<f32>(op, name, d, x.inputs(d), scale, keep, None).map(fresh_output)
}

/// The fused kernels' inputs in the layout they read: `qkv` contiguous, `a`/`b` as rows
/// `g_stride` apart in the activation dtype, `a_log`/`dt_bias` in f32.
struct FusedArgs {
    qkv: Tensor,
    a: Tensor,
    b: Tensor,
    g_stride: usize,
    a_log: Tensor,
    dt_bias: Tensor,
}

impl FusedArgs {
    fn new(
        d: Launch,
        qkv: &Tensor,
        a: &Tensor,
        b: &Tensor,
        a_log: &Tensor,
        dt_bias: &Tensor,
    ) -> Result<Self> {
        let dt = qkv.dtype();
        // a and b are normally views into the projection rows: read in place when they share a
        // row stride, else copied.
        let (a, b, g_stride) = match (row_stride(a), row_stride(b)) {
            (Some(sa), Some(sb)) if sa == sb && a.dtype() == dt && b.dtype() == dt => {
                (a.clone(), b.clone(), sa)
            }
            _ => (a.to_dtype(dt)?.contiguous()?, b.to_dtype(dt)?.contiguous()?, d.hv),
        };
        Ok(Self {
            qkv: qkv.contiguous()?,
            a,
            b,
            g_stride,
            a_log: a_log.to_dtype(DType::F32)?.contiguous()?,
            dt_bias: dt_bias.to_dtype(DType::F32)?.contiguous()?,
        })
    }

    /// q, k, v as views into each qkv row ([Q all | K all | V all]) and the raw gates.
    fn inputs<'t>(&'t self, d: Launch, state: Option<&'t Tensor>) -> DeltaRuleInputs<'t> {
        let kd = d.hk * d.dk;
        let row = 2 * kd + d.hv * d.dv;
        DeltaRuleInputs {
            q: (&self.qkv, 0),
            k: (&self.qkv, kd),
            v: (&self.qkv, 2 * kd),
            strides: (row, row),
            ga: &self.a,
            gb: &self.b,
            g_stride: self.g_stride,
            gate_params: Some((&self.a_log, &self.dt_bias)),
            state,
        }
    }

    /// The recurrent kernel's name for this dtype and key dim: for grids of at least
    /// [`WIDE_MIN_BLOCKS`] blocks (batches) and dk ≤ 128 the variant held to 64 registers, which
    /// fits twice the blocks per SM (docs/BENCHMARKS.md, GDN kernels run 9 (c)).
    fn recurrent_kernel(&self, op: &'static str, d: Launch) -> Result<String> {
        let rows = rows_variant(op, d.dk)?;
        let blocks = d.b * d.hv * d.dv.div_ceil(BV);
        let wide = (8..=32).contains(&rows) && blocks >= WIDE_MIN_BLOCKS;
        Ok(format!(
            "gdn_fused_{}_r{rows}{}",
            dtype_suffix(op, self.qkv.dtype())?,
            if wide { "_wide" } else { "" }
        ))
    }
}

/// CUDA twin of `fused_gated_delta_rule`: `qkv: [b, t, 2·hk·dk + hv·dv]` and `a, b: [b, t, hv]` in
/// one activation dtype; `a_log, dt_bias: [hv]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn fused(
    d: Launch,
    qkv: &Tensor,
    a: &Tensor,
    b: &Tensor,
    a_log: &Tensor,
    dt_bias: &Tensor,
    state: Option<&Tensor>,
    mode: DeltaRuleMode,
) -> Result<DeltaRuleOutput> {
    let op = "fused_gated_delta_rule";
    let dt = qkv.dtype();
    let args = FusedArgs::new(d, qkv, a, b, a_log, dt_bias)?;
    let state = state.map(|s| s.contiguous()).transpose()?;
    let inp = args.inputs(d, state.as_ref());
    let scale = (d.dk as f32).powf(-0.5);
    match mode {
        DeltaRuleMode::Chunked if chunked_supported(d) && chunked_on_tensor_cores(d, dt, &inp) => {
            let kernels = ChunkKernels::tensor_cores(tensor_core_scan(&device(op, qkv)?));
            launch_chunked::<half::bf16, half::bf16>(op, &kernels, d, inp, scale)
        }
        DeltaRuleMode::Chunked if chunked_supported(d) => {
            let prep = format!("gdn_chunk_prep_fused_{}", dtype_suffix(op, dt)?);
            let kernels = ChunkKernels::f32(prep, f32_scan_columns());
            macro_rules! go {
                ($t:ty) => {
                    launch_chunked::<$t, f32>(op, &kernels, d, inp, scale)
                };
            }
            for_float_dtype!(op, dt)
        }
        _ => {
            let keep = Keep::fresh(
                mode == DeltaRuleMode::Recurrent {
                    keep_all_states: true,
                },
            );
            let name = args.recurrent_kernel(op, d)?;
            macro_rules! go {
                ($t:ty) => {
                    launch_recurrent::<$t>(op, name, d, inp, scale, keep, None).map(fresh_output)
                };
            }
            for_float_dtype!(op, dt)
        }
    }
}

/// A candle in-place op that hands `launch` the tensor's CUDA storage (mutably, as candle holds
/// it for the op) and its element range: how a kernel writes a state buffer in place. The launch
/// runs once; its own results leave through what it captures.
struct CudaInPlace<F> {
    name: &'static str,
    launch: std::cell::RefCell<Option<F>>,
}

impl<F: FnOnce(&mut CudaStorage, std::ops::Range<usize>) -> Result<()>> candle_core::InplaceOp1
    for CudaInPlace<F>
{
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
fn in_place(
    op: &'static str,
    state: &Tensor,
    launch: impl FnOnce(&mut CudaStorage, std::ops::Range<usize>) -> Result<()>,
) -> Result<()> {
    state.inplace_op1(&CudaInPlace {
        name: op,
        launch: std::cell::RefCell::new(Some(launch)),
    })?;
    Ok(())
}

/// Runs `launch` with `buffer`'s CUDA storage as a mutable view of its elements, or with `None`.
/// `buffer` must not share storage with a tensor that `launch` itself updates in place.
fn with_out_buffer<T: CudaDType, R>(
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

/// CUDA twin of `fused_gated_delta_rule_in_place` (shapes checked by the caller; `state`
/// contiguous f32 `[b, hv, dk, dv]`, `all_states` contiguous f32 `[b, t, hv, dk, dv]`): the
/// recurrent kernel reads and writes `state`'s buffer and writes every token's state into
/// `all_states`'s.
#[allow(clippy::too_many_arguments)]
pub(crate) fn fused_in_place(
    d: Launch,
    qkv: &Tensor,
    a: &Tensor,
    b: &Tensor,
    a_log: &Tensor,
    dt_bias: &Tensor,
    state: &Tensor,
    all_states: Option<&Tensor>,
) -> Result<DeltaRuleOutput> {
    let op = "fused_gated_delta_rule_in_place";
    let args = FusedArgs::new(d, qkv, a, b, a_log, dt_bias)?;
    let name = args.recurrent_kernel(op, d)?;
    let scale = (d.dk as f32).powf(-0.5);
    let dt = args.qkv.dtype();
    let out = with_out_buffer::<f32, _>(op, all_states, |all| {
        let mut out = None;
        in_place(op, state, |st, range| {
            let mut view = st.as_cuda_slice_mut::<f32>()?.slice_mut(range);
            let inp = args.inputs(d, None);
            let keep = all.map_or(Keep::No, Keep::Into);
            macro_rules! go {
                ($t:ty) => {
                    launch_recurrent::<$t>(op, name, d, inp, scale, keep, Some(&mut view))
                };
            }
            out = Some(for_float_dtype!(op, dt)?.0);
            Ok(())
        })?;
        out.ok_or_else(|| err(op, "the in-place launch did not run"))
    })?;
    Ok(DeltaRuleOutput {
        out,
        state: state.clone(),
        all_states: all_states.cloned(),
    })
}

/// Tokens per thread of the prefill conv kernel (`CONV_TT` in cuda/gdn.cu).
const CONV_TOKENS: usize = 16;

/// CUDA twin of `causal_conv1d`: `x: [b, t, c]`, `weight: [c, k]`, `state: [b, c, k-1]`.
pub(crate) fn conv1d(
    x: &Tensor,
    weight: &Tensor,
    state: Option<&Tensor>,
    k: usize,
) -> Result<(Tensor, Tensor)> {
    let op = "causal_conv1d";
    if k > 8 {
        return Err(err(op, format!("kernel width {k} > 8 is not supported on CUDA")));
    }
    let dt = x.dtype();
    let dev = device(op, x)?;
    let (b, t, c) = x.dims3()?;
    // Rows of a wider projection are read in place.
    let (x, xs) = match row_stride(x) {
        Some(rs) => (x.clone(), rs),
        None => (x.contiguous()?, c),
    };
    let w = weight.reshape((c, k))?.to_dtype(dt)?.contiguous()?;
    let state = state.map(|s| s.to_dtype(dt)?.contiguous()).transpose()?;
    macro_rules! go {
        ($t:ty) => {{
            let (xst, xl) = x.storage_and_layout();
            let (ws, wl) = w.storage_and_layout();
            let xv = rows_view::<$t>(op, &xst, xl, b * t, c, xs)?;
            let wv = view::<$t>(op, &ws, wl)?;
            let st = state.as_ref().map(|s| s.storage_and_layout());
            let stv = match &st {
                Some((s, l)) => Some(view::<$t>(op, s, l)?),
                None => None,
            };
            // SAFETY: uninitialised; the kernel writes every element of y and of the new state.
            let y = unsafe { dev.alloc::<$t>(b * t * c)? };
            let st_out = unsafe { dev.alloc::<$t>(b * c * (k - 1))? };
            let func =
                dev.get_or_load_custom_func(&format!("conv1d_{}", dtype_suffix(op, dt)?), MODULE, PTX)?;
            let mut lb = KernelCall::new(&dev, &func);
            let null = 0u64;
            let xs64 = xs as i64;
            lb.arg(&xv).arg(&xs64).arg(&wv);
            match &stv {
                Some(s) => lb.arg(s),
                None => lb.arg(&null),
            };
            lb.arg(&y).arg(&st_out);
            let dims = [b as i32, t as i32, c as i32, k as i32];
            for v in &dims {
                lb.arg(v);
            }
            let cfg = LaunchConfig {
                grid_dim: (
                    (b * t.div_ceil(CONV_TOKENS) + b) as u32,
                    c.div_ceil(256) as u32,
                    1,
                ),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: arguments match `conv1d_*` in cuda/gdn.cu: x as b·t rows of c elements xs
            // apart (the view spans exactly them), i64 xs, w [c·k], state [b·c·(k-1)] or null,
            // fresh outputs of the sizes it writes, then i32 dims; one block row per tile of
            // CONV_TOKENS tokens of a sequence (y), then one per sequence (the new state), one
            // thread per channel.
            unsafe { lb.launch(cfg) }.w()?;
            Ok((wrap(y, &dev, (b, t, c)), wrap(st_out, &dev, (b, c, k - 1))))
        }};
    }
    for_float_dtype!(op, dt)
}

/// Threads per block of the few-token conv kernel: small blocks spread its one thread per
/// channel over many SMs (a decode step has ~10k channels, a latency-bound handful of loads each).
const CONV_SEQ_THREADS: u32 = 128;

/// CUDA twin of `causal_conv1d_in_place` (shapes checked by the caller; `state` and `window`
/// contiguous in `x`'s dtype, `window` `[b, c, k-1+t]`): `x: [b, t, c]`, `weight: [c, k]`;
/// returns y, overwrites `state` and writes the window into `window`.
pub(crate) fn conv1d_in_place(
    x: &Tensor,
    weight: &Tensor,
    state: &Tensor,
    k: usize,
    window: Option<&Tensor>,
) -> Result<Tensor> {
    let op = "causal_conv1d_in_place";
    if k > 8 {
        return Err(err(op, format!("kernel width {k} > 8 is not supported on CUDA")));
    }
    let (b, t, c) = x.dims3()?;
    let (x, xs) = match row_stride(x) {
        Some(rs) => (x.clone(), rs),
        None => (x.contiguous()?, c),
    };
    let dt = x.dtype();
    let w = weight.reshape((c, k))?.to_dtype(dt)?.contiguous()?;
    let dev = device(op, &x)?;
    let name = format!("conv1d_{}_in_place", dtype_suffix(op, dt)?);
    macro_rules! go {
        ($t:ty) => {
            with_out_buffer::<$t, _>(op, window, |win| {
                let mut y = None;
                in_place(op, state, |st, range| {
                    let mut state = st.as_cuda_slice_mut::<$t>()?.slice_mut(range);
                    let (xst, xl) = x.storage_and_layout();
                    let (ws, wl) = w.storage_and_layout();
                    let xv = rows_view::<$t>(op, &xst, xl, b * t, c, xs)?;
                    let wv = view::<$t>(op, &ws, wl)?;
                    // SAFETY: uninitialised; the kernel writes every element of y.
                    let out = unsafe { dev.alloc::<$t>(b * t * c)? };
                    let func = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
                    let mut lb = KernelCall::new(&dev, &func);
                    let (xs64, null) = (xs as i64, 0u64);
                    lb.arg(&xv).arg(&xs64).arg(&wv).arg(&out).arg(&mut state);
                    match win {
                        Some(wb) => lb.arg(wb),
                        None => lb.arg(&null),
                    };
                    let dims = [b as i32, t as i32, c as i32, k as i32];
                    for v in &dims {
                        lb.arg(v);
                    }
                    let cfg = LaunchConfig {
                        grid_dim: ((b * c).div_ceil(CONV_SEQ_THREADS as usize) as u32, 1, 1),
                        block_dim: (CONV_SEQ_THREADS, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    // SAFETY: arguments match `conv1d_*_in_place` in cuda/gdn.cu: x as b·t rows of
                    // c elements xs apart (the view spans exactly them), i64 xs, w [c·k], a fresh
                    // y [b·t·c], the state [b·c·(k-1)] (checked by the caller), the caller's
                    // window [b·c·(k-1+t)] (checked by the caller, disjoint from the state) or
                    // null, i32 dims; one thread per (sequence, channel), each reading its state
                    // entries before writing them.
                    unsafe { lb.launch(cfg) }.w()?;
                    y = Some(wrap(out, &dev, (b, t, c)));
                    Ok(())
                })?;
                y.ok_or_else(|| err(op, "the in-place launch did not run"))
            })
        };
    }
    for_float_dtype!(op, dt)
}

const NORM_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/norm.ptx"));
const NORM_MODULE: &str = "qwen36_norm";
/// Threads per block of the norm kernels (one block per row).
const NORM_THREADS: u32 = 256;

fn norm_launch(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (NORM_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// CUDA twin of `RmsNorm::forward` (`residual: None`) and `RmsNorm::forward_residual`: rows of
/// `x` (plus `residual`, same shape and dtype), f32 `scale: [D]`. Returns `(y, Some(x + residual))`.
pub(crate) fn rms_norm(
    x: &Tensor,
    residual: Option<&Tensor>,
    scale: &Tensor,
    eps: f64,
) -> Result<(Tensor, Option<Tensor>)> {
    let op = "rms_norm";
    let dt = x.dtype();
    let dev = device(op, x)?;
    let d = x.dim(candle_core::D::Minus1)?;
    let rows = x.elem_count() / d.max(1);
    if let Some(r) = residual {
        if r.dims() != x.dims() || r.dtype() != dt {
            return Err(err(
                op,
                format!(
                    "residual {:?} {:?} must match x {:?} {dt:?}",
                    r.dims(),
                    r.dtype(),
                    x.dims()
                ),
            ));
        }
    }
    let scale = scale.to_dtype(DType::F32)?.contiguous()?;
    if scale.elem_count() != d {
        return Err(err(
            op,
            format!("scale has {} elements for rows of {d}", scale.elem_count()),
        ));
    }
    if residual.is_none() {
        // Short rows (per-head norms): a warp per row, reading a view of wider rows in place.
        let size = dt.size_in_bytes();
        if let Some(rs) = row_stride(x).filter(|&rs| {
            (d * size) % 16 == 0
                && d * size <= 1024
                && (rs * size) % 16 == 0
                && (x.layout().start_offset() * size) % 16 == 0
        }) {
            return Ok((rms_norm_warp(x, rs, &scale, eps, rows, d)?, None));
        }
    }
    let x = x.contiguous()?;
    let res = residual.map(|r| r.contiguous()).transpose()?;
    macro_rules! go {
        ($t:ty) => {{
            let (xs, xl) = x.storage_and_layout();
            let (ss, sl) = scale.storage_and_layout();
            let xv = view::<$t>(op, &xs, xl)?;
            let sv = view::<f32>(op, &ss, sl)?;
            let rs = res.as_ref().map(|r| r.storage_and_layout());
            let rv = match &rs {
                Some((s, l)) => Some(view::<$t>(op, s, l)?),
                None => None,
            };
            // SAFETY: uninitialised; the kernel writes every element of y (and of sum).
            let y = unsafe { dev.alloc::<$t>(rows * d)? };
            let sum = match rv {
                Some(_) => Some(unsafe { dev.alloc::<$t>(rows * d)? }),
                None => None,
            };
            let func = dev.get_or_load_custom_func(
                &format!("rms_norm_{}", dtype_suffix(op, dt)?),
                NORM_MODULE,
                NORM_PTX,
            )?;
            let mut lb = KernelCall::new(&dev, &func);
            let null = 0u64;
            lb.arg(&xv);
            match (&rv, &sum) {
                (Some(r), Some(s)) => lb.arg(r).arg(s),
                _ => lb.arg(&null).arg(&null),
            };
            // The vectorised path: 16-byte rows (fresh buffers and contiguous views at a
            // 16-byte offset) of at most NORM_THREADS · NORM_VECS vectors (cuda/norm.cu).
            let size = dt.size_in_bytes();
            let at16 = |l: &Layout| (l.start_offset() * size) % 16 == 0;
            let vec = (d * size) % 16 == 0
                && d * size <= NORM_THREADS as usize * 4 * 16
                && at16(xl)
                && rs.as_ref().is_none_or(|(_, l)| at16(l));
            let (d32, eps32, vec32) = (d as i32, eps as f32, vec as i32);
            lb.arg(&sv).arg(&y).arg(&d32).arg(&eps32).arg(&vec32);
            if rows > 0 {
                // SAFETY: arguments match `rms_norm_*` in cuda/norm.cu: x [rows·d], residual and
                // sum [rows·d] (or both null), scale [d] f32, y [rows·d], i32 d, f32 eps, i32
                // vec (set only for 16-byte aligned rows that fit the registers, checked above;
                // y and sum are fresh allocations); one block per row.
                unsafe { lb.launch(norm_launch(rows)) }.w()?;
            }
            let shape = x.shape().clone();
            Ok((wrap(y, &dev, shape.clone()), sum.map(|s| wrap(s, &dev, shape))))
        }};
    }
    for_float_dtype!(op, dt)
}

/// [`rms_norm`] without a residual for rows of at most 1024 bytes in 16-byte vectors: `x` as `rows`
/// rows of `d` elements `rs` apart (16-byte aligned), one warp per row.
fn rms_norm_warp(x: &Tensor, rs: usize, scale: &Tensor, eps: f64, rows: usize, d: usize) -> Result<Tensor> {
    let op = "rms_norm";
    let dt = x.dtype();
    let dev = device(op, x)?;
    macro_rules! go {
        ($t:ty) => {{
            let (xs, xl) = x.storage_and_layout();
            let (ss, sl) = scale.storage_and_layout();
            let xv = rows_view::<$t>(op, &xs, xl, rows, d, rs)?;
            let sv = view::<f32>(op, &ss, sl)?;
            // SAFETY: uninitialised; the kernel writes every element of y (a warp per row).
            let y = unsafe { dev.alloc::<$t>(rows * d)? };
            if rows > 0 {
                let func = dev.get_or_load_custom_func(
                    &format!("rms_norm_warp_{}", dtype_suffix(op, dt)?),
                    NORM_MODULE,
                    NORM_PTX,
                )?;
                let mut lb = KernelCall::new(&dev, &func);
                let (rs64, r32, d32, eps32) = (rs as i64, rows as i32, d as i32, eps as f32);
                lb.arg(&xv)
                    .arg(&rs64)
                    .arg(&sv)
                    .arg(&y)
                    .arg(&r32)
                    .arg(&d32)
                    .arg(&eps32);
                let cfg = LaunchConfig {
                    grid_dim: (rows.div_ceil(NORM_THREADS as usize / 32) as u32, 1, 1),
                    block_dim: (NORM_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: arguments match `rms_norm_warp_*` in cuda/norm.cu: x as rows rows of d
                // elements rs apart (the view spans exactly them; rows 16-byte aligned and at most
                // 1024 bytes, checked by the caller), i64 rs, scale [d] f32, y [rows·d], i32 rows
                // and d, f32 eps.
                unsafe { lb.launch(cfg) }.w()?;
            }
            Ok(wrap(y, &dev, x.shape().clone()))
        }};
    }
    for_float_dtype!(op, dt)
}

/// CUDA twin of `GatedRmsNorm::forward` for an f32 `x` and a gate `z` (same shape) already in the
/// output dtype; `weight: [D]` f32.
pub(crate) fn gated_rms_norm(x: &Tensor, z: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let op = "gated_rms_norm";
    let dt = z.dtype();
    let dev = device(op, x)?;
    let d = x.dim(candle_core::D::Minus1)?;
    let rows = x.elem_count() / d.max(1);
    let zw = z.dim(candle_core::D::Minus1)?;
    if x.dtype() != DType::F32
        || z.elem_count() != x.elem_count()
        || zw % d.max(1) != 0
        || weight.elem_count() != d
    {
        return Err(err(
            op,
            format!(
                "x {:?} {:?} must be f32, z {:?} the same shape or [..., heads·{d}], weight [{d}]",
                x.dims(),
                x.dtype(),
                z.dims()
            ),
        ));
    }
    let x = x.contiguous()?;
    // z rows: `zh` rows of x per row of z (a projection's token row), `zs` apart, read in place.
    let zh = zw / d.max(1);
    let (z, zs) = match row_stride(z) {
        Some(rs) => (z.clone(), rs),
        None => (z.contiguous()?, zw),
    };
    let w = weight.to_dtype(DType::F32)?.contiguous()?;
    macro_rules! go {
        ($t:ty) => {{
            let (xs, xl) = x.storage_and_layout();
            let (zst, zl) = z.storage_and_layout();
            let (ws, wl) = w.storage_and_layout();
            let xv = view::<f32>(op, &xs, xl)?;
            let zv = rows_view::<$t>(op, &zst, zl, rows / zh.max(1), zw, zs)?;
            let wv = view::<f32>(op, &ws, wl)?;
            // SAFETY: uninitialised; the kernel writes every element.
            let y = unsafe { dev.alloc::<$t>(rows * d)? };
            let func = dev.get_or_load_custom_func(
                &format!("gated_rms_norm_{}", dtype_suffix(op, dt)?),
                NORM_MODULE,
                NORM_PTX,
            )?;
            let mut lb = KernelCall::new(&dev, &func);
            let (r32, d32, eps32, zh32, zs64) = (rows as i32, d as i32, eps as f32, zh as i32, zs as i64);
            lb.arg(&xv)
                .arg(&zv)
                .arg(&wv)
                .arg(&y)
                .arg(&r32)
                .arg(&d32)
                .arg(&eps32)
                .arg(&zh32)
                .arg(&zs64);
            if rows > 0 {
                let warps = NORM_THREADS as usize / 32;
                let cfg = LaunchConfig {
                    grid_dim: (rows.div_ceil(warps) as u32, 1, 1),
                    block_dim: (NORM_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: arguments match `gated_rms_norm_*` in cuda/norm.cu: x [rows·d] f32, z as
                // rows/zh rows of zh·d elements zs apart (the view spans exactly them), w [d] f32,
                // y [rows·d], i32 rows and d, f32 eps, i32 zh, i64 zs; one warp per row.
                unsafe { lb.launch(cfg) }.w()?;
            }
            Ok(wrap(y, &dev, x.shape().clone()))
        }};
    }
    for_float_dtype!(op, dt)
}

/// Warps (rows) per block of `norm_rope_heads_*` and the most 16-byte vectors per lane.
const ROPE_WARPS: usize = 4;
const ROPE_MAX_VECS: usize = 2;

/// CUDA twin of `rope::norm_rope_heads` (arguments checked there): `None` when the kernel cannot
/// take the rows (not 16-byte aligned, a head wider than 64 vectors, no single row stride).
#[allow(clippy::too_many_arguments)]
pub(crate) fn norm_rope_heads(
    x: &Tensor,
    heads: usize,
    head_stride: usize,
    head_dim: usize,
    scale: Option<&Tensor>,
    eps: f64,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<Option<Tensor>> {
    let op = "norm_rope_heads";
    let dt = x.dtype();
    let (b, t, _) = x.dims3()?;
    let size = dt.size_in_bytes();
    let Some(xs) = row_stride(x) else {
        return Ok(None);
    };
    let fits = (head_dim * size) % 16 == 0
        && (head_stride * size) % 16 == 0
        && (xs * size) % 16 == 0
        && (x.layout().start_offset() * size) % 16 == 0
        && head_dim * size <= ROPE_MAX_VECS * 32 * 16
        && cos.dtype() == dt
        && sin.dtype() == dt;
    if !fits {
        return Ok(None);
    }
    let (cos, sin) = (cos.contiguous()?, sin.contiguous()?);
    let dev = device(op, x)?;
    let rows = b * t * heads;
    let null: u64 = 0;
    macro_rules! go {
        ($t:ty) => {{
            let (xst, xl) = x.storage_and_layout();
            let xv = rows_view::<$t>(op, &xst, xl, b * t, heads * head_stride, xs)?;
            let (cst, cl) = cos.storage_and_layout();
            let (sst, sl) = sin.storage_and_layout();
            let (cv, sv) = (view::<$t>(op, &cst, cl)?, view::<$t>(op, &sst, sl)?);
            let scale_guard = scale.map(|s| s.storage_and_layout());
            let scv = match &scale_guard {
                Some((st, l)) => Some(view::<f32>(op, st, l)?),
                None => None,
            };
            // SAFETY: uninitialised; the kernel writes every element (a warp per row, every
            // 16-byte vector of it).
            let y = unsafe { dev.alloc::<$t>(rows * head_dim)? };
            if rows > 0 {
                let func = dev.get_or_load_custom_func(
                    &format!("norm_rope_heads_{}", dtype_suffix(op, dt)?),
                    NORM_MODULE,
                    NORM_PTX,
                )?;
                let mut lb = KernelCall::new(&dev, &func);
                let (xs64, hs32) = (xs as i64, head_stride as i32);
                lb.arg(&xv).arg(&xs64).arg(&hs32);
                match &scv {
                    Some(v) => lb.arg(v),
                    None => lb.arg(&null),
                };
                let dims = [t as i32, heads as i32, head_dim as i32, 2 * cos.dim(1)? as i32];
                lb.arg(&cv).arg(&sv).arg(&y);
                for d in &dims {
                    lb.arg(d);
                }
                let (eps32, rows32) = (eps as f32, rows as i32);
                lb.arg(&eps32).arg(&rows32);
                let cfg = LaunchConfig {
                    grid_dim: (rows.div_ceil(ROPE_WARPS) as u32, 1, 1),
                    block_dim: ((ROPE_WARPS * 32) as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: arguments match `norm_rope_heads_*` in cuda/norm.cu: x as b·t rows of
                // heads·head_stride elements xs apart (the view spans exactly them; rows, heads and
                // head_dim 16-byte aligned, head_dim at most ROPE_MAX_VECS vectors per lane, checked
                // above), i64 xs, i32 head stride, scale [head_dim] f32 or null, cos/sin [t,
                // rotary/2] contiguous, y [rows·head_dim] fresh, i32 t, heads, head_dim, rotary
                // dims, f32 eps, i32 rows; one warp per row.
                unsafe { lb.launch(cfg) }.w()?;
            }
            Ok(Some(wrap(y, &dev, (b, heads, t, head_dim))))
        }};
    }
    for_float_dtype!(op, dt)
}

const LINEAR_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/linear.ptx"));
const LINEAR_MODULE: &str = "qwen36_linear";
/// Threads per block of the skinny linear kernel: 8 warps.
const LINEAR_THREADS: usize = 256;

/// What the skinny kernel writes: `x·wᵀ (+ res)` with `columns` ∈ {1, 2, 4} outputs per warp,
/// or, for `w = [gate; up]`, the MLP activation `silu(x·gateᵀ) · (x·upᵀ)` (one row).
#[derive(Clone, Copy)]
pub(crate) enum Skinny<'a> {
    Linear { res: Option<&'a Tensor>, columns: usize },
    SwiGlu,
}

/// Rows the normalising skinny kernels take: at most `NORM_THREADS · NORM_VECS` 16-byte vectors
/// (cuda/norm.cu), the rows of the RMSNorm kernel's register path, whose bits they repeat (the
/// kernel's other path sums in another order), with the same thread to vector map.
const NORM_MAX_VECS: usize = NORM_THREADS as usize * 4;
const _: () = assert!(
    LINEAR_THREADS == NORM_THREADS as usize,
    "the normalising GEMV repeats the norm's threads"
);

/// CUDA weight-streaming `x·wᵀ` for `x: [m, k]` (contiguous, 1 ≤ m ≤ 8) and `w: [n, k]` of the
/// same dtype, with the epilogue of `what`: `res: [m, n]` (same dtype) added as the output is
/// written when given, or the SwiGLU of the two halves (`[1, n / 2]`). With `norm` (the RMSNorm's
/// f32 `[k]` scale `1 + w` and eps), `x` is normalised on the way in: the product equals the
/// RMSNorm kernel's output times `wᵀ`, bit for bit. `None` when the kernel cannot take the
/// operands (rows not 16-byte multiples or not 16-byte aligned, `w` or `res` not contiguous; with
/// `norm`, more than one row, rows past the RMSNorm kernel's register path, a strided or non-f32
/// scale):
/// the caller falls back to the matmul (after the separate norm).
pub(crate) fn skinny_linear(
    x: &Tensor,
    w: &Tensor,
    what: Skinny,
    norm: Option<(&Tensor, f64)>,
) -> Result<Option<Tensor>> {
    let op = "skinny_linear";
    let dt = x.dtype();
    let (m, k) = x.dims2()?;
    let (n, kw) = w.dims2()?;
    let (res, columns) = match what {
        Skinny::Linear { res, columns } => (res, columns),
        Skinny::SwiGlu => (None, 2),
    };
    let swiglu = matches!(what, Skinny::SwiGlu);
    if kw != k
        || w.dtype() != dt
        || !(1..=crate::linear::SKINNY_MAX_ROWS).contains(&m)
        || ![1, 2, 4].contains(&columns)
        || (swiglu && (m != 1 || n % 2 != 0))
    {
        return Err(err(
            op,
            format!(
                "x {:?} {dt:?} and w {:?} {:?} do not fit ({columns} columns per warp)",
                x.dims(),
                w.dims(),
                w.dtype()
            ),
        ));
    }
    if let Some(r) = res {
        if r.dims() != [m, n] || r.dtype() != dt {
            return Err(err(
                op,
                format!(
                    "residual {:?} {:?}, expected [{m}, {n}] {dt:?}",
                    r.dims(),
                    r.dtype()
                ),
            ));
        }
    }
    let size = dt.size_in_bytes();
    let aligned = |l: &Layout| l.is_contiguous() && (l.start_offset() * size) % 16 == 0;
    if (k * size) % 16 != 0
        || !aligned(x.layout())
        || !aligned(w.layout())
        || res.is_some_and(|r| !r.is_contiguous())
    {
        return Ok(None);
    }
    if let Some((scale, _)) = norm {
        if m != 1
            || k * size > NORM_MAX_VECS * 16
            || scale.dims() != [k]
            || scale.dtype() != DType::F32
            || !scale.is_contiguous()
        {
            return Ok(None);
        }
    }
    let dev = device(op, x)?;
    let null: u64 = 0;
    let norm_guard = norm.map(|(s, eps)| (s.storage_and_layout(), eps as f32));
    macro_rules! go {
        ($t:ty) => {{
            let (xs, xl) = x.storage_and_layout();
            let (ws, wl) = w.storage_and_layout();
            let xv = view::<$t>(op, &xs, xl)?;
            let wv = view::<$t>(op, &ws, wl)?;
            let res_guard = res.map(|r| r.storage_and_layout());
            let rv = match &res_guard {
                Some((rs, rl)) => Some(view::<$t>(op, rs, rl)?),
                None => None,
            };
            // Output columns: the SwiGLU epilogue writes one per gate/up pair.
            let out_n = if swiglu { n / 2 } else { n };
            // SAFETY: uninitialised; the kernel writes every element (each warp its `columns`
            // columns, or its one pair, for every row m).
            let y = unsafe { dev.alloc::<$t>(m * out_n)? };
            let sfx = dtype_suffix(op, dt)?;
            let name = match (swiglu, &norm_guard) {
                (true, None) => format!("skinny_swiglu_{sfx}"),
                (true, Some(_)) => format!("skinny_swiglu_norm_{sfx}"),
                // Two rows and more in 16-bit types: the tensor-core twin (same arguments).
                (false, None) if m > 1 && dt != DType::F32 => {
                    format!("skinny_linear_tc_{sfx}_m{m}_r{columns}")
                }
                (false, None) => format!("skinny_linear_{sfx}_m{m}_r{columns}"),
                (false, Some(_)) => format!("skinny_linear_norm_{sfx}_r{columns}"),
            };
            let func = dev.get_or_load_custom_func(&name, LINEAR_MODULE, LINEAR_PTX)?;
            let mut lb = KernelCall::new(&dev, &func);
            let (n32, k32) = (out_n as i32, k as i32);
            lb.arg(&xv);
            let scale_view = match &norm_guard {
                Some(((ss, sl), eps)) => Some((view::<f32>(op, ss, sl)?, *eps)),
                None => None,
            };
            if let Some((sv, eps)) = &scale_view {
                lb.arg(sv).arg(eps);
            }
            lb.arg(&wv);
            if !swiglu {
                match &rv {
                    Some(rv) => lb.arg(rv),
                    None => lb.arg(&null),
                };
            }
            lb.arg(&y).arg(&n32).arg(&k32);
            let warps = if swiglu { out_n } else { n.div_ceil(columns) };
            let cfg = LaunchConfig {
                grid_dim: ((warps * 32).div_ceil(LINEAR_THREADS) as u32, 1, 1),
                block_dim: (LINEAR_THREADS as u32, 1, 1),
                // The normalised row.
                shared_mem_bytes: if scale_view.is_some() {
                    (k * size) as u32
                } else {
                    0
                },
            };
            if n > 0 {
                // SAFETY: arguments match `skinny_linear_*_m{m}_r{columns}` or its tensor-core
                // twin `skinny_linear_tc_*` (the same signature; res [m·n] contiguous
                // or a null pointer, 0u64) or `skinny_swiglu_*` (no res; m = 1, n even) in
                // cuda/linear.cu, or their `_norm_` twins, which also take the f32 scale [k]
                // (contiguous) and eps after x, one row of at most NORM_MAX_VECS vectors and k·size
                // bytes of dynamic shared memory (≤ 16 KiB, under the default 48 KiB): x [m·k] and
                // w [n·k] contiguous and 16-byte aligned with k·size a multiple of 16 (checked
                // above), y [m·out_n], i32 out_n and k; one warp per `columns` columns or per
                // gate/up pair.
                unsafe { lb.launch(cfg) }.w()?;
            }
            Ok(Some(wrap(y, &dev, (m, out_n))))
        }};
    }
    match dt {
        DType::F32 => go!(f32),
        DType::BF16 => go!(half::bf16),
        DType::F16 => go!(half::f16),
        _ => Ok(None),
    }
}

const ATTENTION_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attention.ptx"));
const ATTENTION_MODULE: &str = "qwen36_attention";
/// Threads per block of the attention kernels.
const ATTENTION_THREADS: u32 = 128;
/// Spans one block of the first merge level combines (`GROUP` in cuda/attention.cu).
const ATTENTION_GROUP: usize = 32;
/// Keys per tile of the tensor-core attention kernels (`FA_BK` in cuda/attention.cu).
const FLASH_TILE: usize = 64;
/// Most splits per KV head of the tensor-core decode kernel: at one sequence and 4 KV heads, 256
/// blocks (two per SM on an H200) each walking consecutive tiles.
const FLASH_DECODE_SPLITS: usize = 64;

/// CUDA twin of `write_kv` (shapes checked by the caller): one kernel writes the new rows of both
/// buffers at the positions `positions` holds.
pub(crate) fn write_kv(
    k: &Tensor,
    v: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    positions: &Tensor,
) -> Result<()> {
    let op = "write_kv";
    let (b, h, t, d) = k.dims4()?;
    let cap = k_cache.dim(2)?;
    let ((k, ks), (v, vs)) = (strided_rows(k)?, strided_rows(v)?);
    let positions = positions.contiguous()?;
    let dt = k.dtype();
    let dev = device(op, &k)?;
    let name = format!("kv_write_b{}", dt.size_in_bytes());
    macro_rules! go {
        ($t:ty) => {
            // Both buffers are written: one in-place op inside the other.
            in_place(op, v_cache, |vst, vrange| {
                let mut vc = vst.as_cuda_slice_mut::<$t>()?.slice_mut(vrange);
                in_place(op, k_cache, |kst, krange| {
                    let mut kc = kst.as_cuda_slice_mut::<$t>()?.slice_mut(krange);
                    let (kg, kl) = k.storage_and_layout();
                    let (vg, vl) = v.storage_and_layout();
                    let (pg, pl) = positions.storage_and_layout();
                    let kv = span_view::<$t>(op, &kg, kl)?;
                    let vv = span_view::<$t>(op, &vg, vl)?;
                    let pv = view::<u32>(op, &pg, pl)?;
                    let f = dev.get_or_load_custom_func(&name, ATTENTION_MODULE, ATTENTION_PTX)?;
                    let mut lb = KernelCall::new(&dev, &f);
                    lb.arg(&kv).arg(&vv);
                    for s in ks.iter().chain(&vs) {
                        lb.arg(s);
                    }
                    let (cap32, d32) = (cap as i32, d as i32);
                    lb.arg(&pv).arg(&mut kc).arg(&mut vc).arg(&cap32).arg(&d32);
                    let cfg = LaunchConfig {
                        grid_dim: (t as u32, h as u32, b as u32),
                        block_dim: (d.min(256) as u32, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    // SAFETY: arguments match `kv_write_b{2,4}` in cuda/attention.cu for this
                    // dtype's size: k and v [b, h, t, d] with contiguous rows, each view spanning
                    // every element its three i64 strides address, positions [t] u32, the cache
                    // buffers [b, h, cap, d] contiguous (checked by the caller; distinct storages,
                    // checked too), i32 cap, d; grid (t, h, b); positions ≥ cap are skipped.
                    if b * h * t * d > 0 {
                        unsafe { lb.launch(cfg) }.w()?;
                    }
                    Ok(())
                })
            })
        };
    }
    for_float_dtype!(op, dt)
}

/// A `[d0, d1, d2, n]` tensor as the kernels read it through strides: rows of `n` contiguous
/// elements (a strided view stays in place, anything else is copied) and the strides of its
/// first three dims.
fn strided_rows(t: &Tensor) -> Result<(Tensor, [i64; 3])> {
    let t = if t.stride()[3] == 1 {
        t.clone()
    } else {
        t.contiguous()?
    };
    let st = t.stride();
    let strides = [st[0], st[1], st[2]].map(|s| s as i64);
    Ok((t, strides))
}

/// An attention output gate `[b, t, heads, hd]` through [`strided_rows`]; `(None, zeros)` without
/// one.
fn gate_rows(gate: Option<&Tensor>) -> Result<(Option<Tensor>, [i64; 3])> {
    Ok(match gate.map(strided_rows).transpose()? {
        Some((g, strides)) => (Some(g), strides),
        None => (None, [0; 3]),
    })
}

/// CUDA twin of `decode_attention` (shapes checked by the caller): the split-K partial kernel
/// over spans of `KEYS_PER_SPAN` keys, then the merge, which writes the output token-major and
/// applies the gate. Grids cover the whole buffer (`cap`); spans past the device-side length
/// return at once, so a recorded graph stays valid as `len` grows.
pub(crate) fn decode_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    len: &Tensor,
    t: usize,
    scale: f64,
    gate: Option<&Tensor>,
) -> Result<Tensor> {
    use crate::attention::{decode_attention_fits, KEYS_PER_SPAN};
    let op = "decode_attention";
    let dt = q.dtype();
    let dev = device(op, q)?;
    let (b, h, r, d) = q.dims4()?;
    let cap = k.dim(2)?;
    if !decode_attention_fits(r, d, dt) || k.dtype() != dt || v.dtype() != dt {
        return Err(err(
            op,
            format!(
                "{r} rows of head dim {d} in {dt:?} (k {:?}, v {:?}) do not fit the kernel",
                k.dtype(),
                v.dtype()
            ),
        ));
    }
    // The tensor-core kernel (bf16/f16, its head dims, up to 32 rows) or the general one. Their
    // partials (one per split of a KV head: `spans` of them, each over `unit`-key units) go
    // through the same merge kernels.
    let tensor_cores =
        matches!(dt, DType::BF16 | DType::F16) && crate::attention::PREFILL_HEAD_DIMS.contains(&d) && r <= 32;
    let (spans, unit) = if tensor_cores {
        (cap.div_ceil(FLASH_TILE).clamp(1, FLASH_DECODE_SPLITS), FLASH_TILE)
    } else {
        (cap.div_ceil(KEYS_PER_SPAN).max(1), KEYS_PER_SPAN)
    };
    if spans * 4 > 48 * 1024 {
        return Err(err(
            op,
            format!("a buffer of {cap} keys is longer than the merge kernel takes"),
        ));
    }
    let (q, k, v, len) = (
        q.contiguous()?,
        k.contiguous()?,
        v.contiguous()?,
        len.contiguous()?,
    );
    let (gate, g_strides) = gate_rows(gate)?;
    macro_rules! go {
        ($t:ty) => {{
            let (qs, ql) = q.storage_and_layout();
            let (ks, kl) = k.storage_and_layout();
            let (vs, vl) = v.storage_and_layout();
            let (ls, ll) = len.storage_and_layout();
            let qv = view::<$t>(op, &qs, ql)?;
            let kv = view::<$t>(op, &ks, kl)?;
            let vv = view::<$t>(op, &vs, vl)?;
            let lv = view::<u32>(op, &ls, ll)?;
            let gate_guard = gate.as_ref().map(|g| g.storage_and_layout());
            let gv = match &gate_guard {
                Some((gs, gl)) => Some(span_view::<$t>(op, gs, gl)?),
                None => None,
            };
            let bh = b * h;
            // SAFETY: uninitialised scratch and output. The partial kernel writes every span below
            // the device-side length, which is all the merge reads; the merge writes every output.
            let part_o = unsafe { dev.alloc::<f32>(bh * spans * r * d)? };
            let part_ml = unsafe { dev.alloc::<f32>(bh * spans * r * 2)? };
            let out = unsafe { dev.alloc::<$t>(bh * r * d)? };
            let sfx = dtype_suffix(op, dt)?;
            let (r32, d32, cap32, t32, s32, scale32) = (
                r as i32,
                d as i32,
                cap as i32,
                t as i32,
                spans as i32,
                scale as f32,
            );
            let (unit32, s0) = (unit as i32, spans as i32);
            if tensor_cores {
                let mt = if r <= 16 { 1 } else { 2 };
                let name = format!("flash_decode_{sfx}_d{d}_m{mt}");
                // Q rows (16 per row tile), then one K and one V tile of FLASH_TILE rows.
                let smem = (16 * mt + 2 * FLASH_TILE) * (d + 8) * dt.size_in_bytes();
                allow_smem(&dev, &name, smem, ATTENTION_MODULE, ATTENTION_PTX)?;
                let f = dev.get_or_load_custom_func(&name, ATTENTION_MODULE, ATTENTION_PTX)?;
                let mut lb = KernelCall::new(&dev, &f);
                let sl2 = (scale * std::f64::consts::LOG2_E) as f32;
                lb.arg(&qv).arg(&kv).arg(&vv).arg(&lv).arg(&part_o).arg(&part_ml);
                lb.arg(&r32).arg(&cap32).arg(&t32).arg(&sl2);
                let cfg = LaunchConfig {
                    grid_dim: (spans as u32, bh as u32, 1),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: smem as u32,
                };
                // SAFETY: arguments match `flash_decode_*` in cuda/attention.cu: q [bh·r·d] with
                // r ≤ 16·mt, k and v [bh·cap·d] contiguous, len [1] u32 (clamped to cap by the
                // kernel), scratch of bh·spans·r·(d | 2) f32 (the grid's x is spans), i32 r, cap,
                // t, f32 scale·log2 e; 128 threads and the shared memory the kernel lays out.
                unsafe { lb.launch(cfg) }.w()?;
            } else {
                let partial = dev.get_or_load_custom_func(
                    &format!("attn_decode_partial_{sfx}"),
                    ATTENTION_MODULE,
                    ATTENTION_PTX,
                )?;
                let mut lb = KernelCall::new(&dev, &partial);
                lb.arg(&qv).arg(&kv).arg(&vv).arg(&lv).arg(&part_o).arg(&part_ml);
                lb.arg(&r32).arg(&d32).arg(&cap32).arg(&t32).arg(&scale32);
                let cfg = LaunchConfig {
                    grid_dim: (spans as u32, bh as u32, 1),
                    block_dim: (ATTENTION_THREADS, 1, 1),
                    shared_mem_bytes: (r * (d + KEYS_PER_SPAN) * 4) as u32,
                };
                // SAFETY: arguments match `attn_decode_partial_*` in cuda/attention.cu: q [bh·r·d],
                // k and v [bh·cap·d] contiguous (16-byte rows: `decode_attention_fits`), len [1] u32
                // (the kernel clamps it to cap), scratch of bh·spans·r·(d | 2) f32, i32 r, d, cap, t,
                // f32 scale; shared memory r·(d + KEYS_PER_SPAN) f32 ≤ 48 KiB (checked above).
                unsafe { lb.launch(cfg) }.w()?;
            }
            // Long buffers: merge groups of ATTENTION_GROUP spans first, in parallel, so that the
            // final merge reads few entries.
            let grouped = if spans > ATTENTION_GROUP {
                let groups = spans.div_ceil(ATTENTION_GROUP);
                // SAFETY: uninitialised; the group kernel writes every group below the
                // device-side length, which is all the final merge reads.
                let o2 = unsafe { dev.alloc::<f32>(bh * groups * r * d)? };
                let ml2 = unsafe { dev.alloc::<f32>(bh * groups * r * 2)? };
                let f =
                    dev.get_or_load_custom_func("attn_decode_merge_group", ATTENTION_MODULE, ATTENTION_PTX)?;
                let mut lb = KernelCall::new(&dev, &f);
                let one = 1i32;
                lb.arg(&part_o).arg(&part_ml).arg(&lv).arg(&o2).arg(&ml2);
                lb.arg(&r32).arg(&d32).arg(&s32).arg(&one).arg(&unit32).arg(&s0);
                let cfg = LaunchConfig {
                    grid_dim: (r as u32, bh as u32, groups as u32),
                    block_dim: (ATTENTION_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: arguments match `attn_decode_merge_group`: the scratch written above,
                // len [1] u32, outputs of bh·groups·r·(d | 2) f32, i32 r, d, spans, 1 span per
                // input entry, the partial kernel's unit and split count; grid (r, bh, groups).
                unsafe { lb.launch(cfg) }.w()?;
                Some((o2, ml2, groups))
            } else {
                None
            };
            let (o_in, ml_in, entries, per) = match &grouped {
                Some((o2, ml2, groups)) => (o2, ml2, *groups, ATTENTION_GROUP),
                None => (&part_o, &part_ml, spans, 1),
            };
            let merge = dev.get_or_load_custom_func(
                &format!("attn_decode_merge_{sfx}"),
                ATTENTION_MODULE,
                ATTENTION_PTX,
            )?;
            let mut lb = KernelCall::new(&dev, &merge);
            let (e32, per32, h32) = (entries as i32, per as i32, h as i32);
            lb.arg(o_in)
                .arg(ml_in)
                .arg(&lv)
                .arg(&out)
                .arg(&r32)
                .arg(&d32)
                .arg(&e32)
                .arg(&per32)
                .arg(&unit32)
                .arg(&s0);
            let null = 0u64;
            match &gv {
                Some(g) => lb.arg(g),
                None => lb.arg(&null),
            };
            for s in &g_strides {
                lb.arg(s);
            }
            lb.arg(&h32).arg(&t32);
            let cfg = LaunchConfig {
                grid_dim: (r as u32, bh as u32, 1),
                block_dim: (ATTENTION_THREADS, 1, 1),
                shared_mem_bytes: (entries * 4) as u32,
            };
            // SAFETY: arguments match `attn_decode_merge_*`: entries written above (spans, or
            // groups of ATTENTION_GROUP spans), len [1] u32, out [bh·r·d] (written as [b, t,
            // h·r/t, d]: the same elements), i32 r, d, entries, spans per entry, unit and split
            // count, the gate [b, t, h·r/t, d] with contiguous rows (its view spans every element
            // its three i64 strides address) or null and zeros, i32 h, t (r % t == 0: checked
            // by the caller); shared memory one f32 per entry (≤ 48 KiB: checked above).
            unsafe { lb.launch(cfg) }.w()?;
            Ok(wrap(out, &dev, (b, t, h * r / t, d)))
        }};
    }
    for_float_dtype!(op, dt)
}

const ARGMAX_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/argmax.ptx"));
const ARGMAX_MODULE: &str = "qwen36_argmax";
const ARGMAX_THREADS: u32 = 256;

/// CUDA twin of `argmax_last_dim`: chunks of each row in parallel, then one block per row.
pub(crate) fn argmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let op = "argmax_last_dim";
    let dt = x.dtype();
    let dev = device(op, x)?;
    let n = x.dim(candle_core::D::Minus1)?;
    let rows = x.elem_count() / n.max(1);
    let out_shape: Vec<usize> = x.dims()[..x.rank() - 1].to_vec();
    if n == 0 || n > i32::MAX as usize {
        return Err(err(op, format!("rows of {n} elements")));
    }
    let chunks = n.div_ceil(crate::argmax::CHUNK);
    let x = x.contiguous()?;
    macro_rules! go {
        ($t:ty) => {{
            let (xs, xl) = x.storage_and_layout();
            let xv = view::<$t>(op, &xs, xl)?;
            // SAFETY: uninitialised; stage 1 writes every (row, chunk) pair, stage 2 every row.
            let pv = unsafe { dev.alloc::<f32>(rows * chunks)? };
            let pi = unsafe { dev.alloc::<i32>(rows * chunks)? };
            let out = unsafe { dev.alloc::<u32>(rows)? };
            if rows > 0 {
                let f = dev.get_or_load_custom_func(
                    &format!("argmax_chunks_{}", dtype_suffix(op, dt)?),
                    ARGMAX_MODULE,
                    ARGMAX_PTX,
                )?;
                let mut lb = KernelCall::new(&dev, &f);
                let (n32, c32) = (n as i32, crate::argmax::CHUNK as i32);
                lb.arg(&xv).arg(&pv).arg(&pi).arg(&n32).arg(&c32);
                let cfg = LaunchConfig {
                    grid_dim: (chunks as u32, rows as u32, 1),
                    block_dim: (ARGMAX_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: arguments match `argmax_chunks_*` in cuda/argmax.cu: x [rows·n]
                // contiguous, pv and pi [rows·chunks], i32 n and chunk; grid (chunks, rows).
                unsafe { lb.launch(cfg) }.w()?;
                let f = dev.get_or_load_custom_func("argmax_merge", ARGMAX_MODULE, ARGMAX_PTX)?;
                let mut lb = KernelCall::new(&dev, &f);
                let c32 = chunks as i32;
                lb.arg(&pv).arg(&pi).arg(&out).arg(&c32);
                let cfg = LaunchConfig {
                    grid_dim: (rows as u32, 1, 1),
                    block_dim: (ARGMAX_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: arguments match `argmax_merge`: the pairs written above, out [rows] u32,
                // i32 chunks; one block per row.
                unsafe { lb.launch(cfg) }.w()?;
            }
            Ok(wrap(out, &dev, out_shape))
        }};
    }
    for_float_dtype!(op, dt)
}

const ACTIVATION_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/activation.ptx"));
const ACTIVATION_MODULE: &str = "qwen36_activation";

/// CUDA twin of `swiglu`: `x: [..., 2·I]` → `[..., I]`.
pub(crate) fn swiglu(x: &Tensor) -> Result<Tensor> {
    let op = "swiglu";
    let dt = x.dtype();
    let dev = device(op, x)?;
    let two_i = x.dim(candle_core::D::Minus1)?;
    let i = two_i / 2;
    let rows = x.elem_count() / two_i.max(1);
    let mut shape = x.dims().to_vec();
    *shape.last_mut().expect("rank > 0") = i;
    let x = x.contiguous()?;
    macro_rules! go {
        ($t:ty) => {{
            let (xs, xl) = x.storage_and_layout();
            let xv = view::<$t>(op, &xs, xl)?;
            // SAFETY: uninitialised; the kernel writes every element (grid-stride loop).
            let y = unsafe { dev.alloc::<$t>(rows * i)? };
            if rows * i > 0 {
                // 16-byte steps when every gate, up and output row starts 16-byte aligned.
                let size = dt.size_in_bytes();
                let vec = (i * size) % 16 == 0 && (xl.start_offset() * size) % 16 == 0;
                let f = dev.get_or_load_custom_func(
                    &format!(
                        "swiglu{}_{}",
                        if vec { "_vec" } else { "" },
                        dtype_suffix(op, dt)?
                    ),
                    ACTIVATION_MODULE,
                    ACTIVATION_PTX,
                )?;
                let mut lb = KernelCall::new(&dev, &f);
                let (r32, i32_) = (rows as i32, i as i32);
                lb.arg(&xv).arg(&y).arg(&r32).arg(&i32_);
                let steps = if vec { rows * i * size / 16 } else { rows * i };
                let cfg = LaunchConfig::for_num_elems(steps.min(1 << 24) as u32);
                // SAFETY: arguments match `swiglu[_vec]_*` in cuda/activation.cu: x [rows·2I]
                // contiguous, y [rows·I] (a fresh allocation: 16-byte aligned), i32 rows and I;
                // the vector variant only with 16-byte aligned rows (checked above); a grid-stride
                // loop covers every output.
                unsafe { lb.launch(cfg) }.w()?;
            }
            Ok(wrap(y, &dev, shape))
        }};
    }
    for_float_dtype!(op, dt)
}

/// CUDA twin of `causal_softmax` (shapes checked by the caller): one block per score row.
pub(crate) fn causal_softmax(scores: &Tensor, scale: f64, pos0: usize, block: usize) -> Result<Tensor> {
    let op = "causal_softmax";
    let dt = scores.dtype();
    let dev = device(op, scores)?;
    let keys = scores.dim(candle_core::D::Minus1)?;
    let rows = scores.elem_count() / keys.max(1);
    let x = scores.contiguous()?;
    let to_i32 = |v: usize| i32::try_from(v).map_err(|_| err(op, format!("{v} does not fit in i32")));
    let (keys32, block32, pos32) = (to_i32(keys)?, to_i32(block)?, to_i32(pos0)?);
    macro_rules! go {
        ($t:ty) => {{
            let (xs, xl) = x.storage_and_layout();
            let xv = view::<$t>(op, &xs, xl)?;
            // SAFETY: uninitialised; the kernel writes every element (one block per row, its
            // threads stride over every key).
            let y = unsafe { dev.alloc::<$t>(rows * keys)? };
            if rows * keys > 0 {
                // 16-byte vectors when every row starts 16-byte aligned.
                let vec = (keys * dt.size_in_bytes()) % 16 == 0
                    && (xl.start_offset() * dt.size_in_bytes()) % 16 == 0;
                let name = format!(
                    "causal_softmax{}_{}",
                    if vec { "_vec" } else { "" },
                    dtype_suffix(op, dt)?
                );
                let f = dev.get_or_load_custom_func(&name, ATTENTION_MODULE, ATTENTION_PTX)?;
                let mut lb = KernelCall::new(&dev, &f);
                let sc = scale as f32;
                lb.arg(&xv)
                    .arg(&y)
                    .arg(&keys32)
                    .arg(&block32)
                    .arg(&pos32)
                    .arg(&sc);
                let cfg = LaunchConfig {
                    grid_dim: (rows as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: arguments match `causal_softmax[_vec]_*` in cuda/attention.cu: x and y
                // [rows, keys] contiguous, i32 keys, block, pos0, f32 scale; the vector variant
                // only with 16-byte aligned rows (checked above).
                unsafe { lb.launch(cfg) }.w()?;
            }
            Ok(wrap(y, &dev, scores.dims()))
        }};
    }
    for_float_dtype!(op, dt)
}

/// The device data of `t`'s elements as its layout addresses them: from the start offset through
/// the last element (for kernels that take the strides themselves).
fn span_view<'a, T: CudaDType>(
    op: &'static str,
    st: &'a Storage,
    layout: &Layout,
) -> Result<CudaView<'a, T>> {
    let Storage::Cuda(cs) = st else {
        return Err(err(op, "expected a CUDA tensor"));
    };
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
    Ok(cs.as_cuda_slice::<T>()?.slice(start..end))
}

/// `t` itself when its rows (last dim) are contiguous and `t.dim(2)` steps over one row, else a
/// contiguous copy: the layout the prefill kernel reads through batch and head strides.
fn with_row_layout(t: &Tensor) -> Result<Tensor> {
    let (st, d) = (t.stride(), t.dim(3)?);
    Ok(if st[3] == 1 && st[2] == d {
        t.clone()
    } else {
        t.contiguous()?
    })
}

/// CUDA twin of `prefill_attention` for bf16/f16 and the head dims of `prefill_attention_fits`
/// (checked by the caller): one FlashAttention-2 kernel, tiles of 64 queries per (head, batch).
pub(crate) fn prefill_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    gate: Option<&Tensor>,
    pos0: usize,
    scale: f64,
) -> Result<Tensor> {
    let op = "prefill_attention";
    let dt = q.dtype();
    let dev = device(op, q)?;
    let (b, h, t, d) = q.dims4()?;
    let kh = k.dim(1)?;
    let (q, mut k, mut v) = (with_row_layout(q)?, with_row_layout(k)?, with_row_layout(v)?);
    if k.stride() != v.stride() {
        (k, v) = (k.contiguous()?, v.contiguous()?);
    }
    let to_i32 = |x: usize| i32::try_from(x).map_err(|_| err(op, format!("{x} does not fit in i32")));
    let (t32, h32, kh32, pos32) = (to_i32(t)?, to_i32(h)?, to_i32(kh)?, to_i32(pos0)?);
    let strides = [q.stride()[0], q.stride()[1], k.stride()[0], k.stride()[1]].map(|s| s as i64);
    let (gate, g_strides) = gate_rows(gate)?;
    // Q, K and V tiles of 64 rows of d + 8 elements.
    let smem = 3 * 64 * (d + 8) * dt.size_in_bytes();
    let sl2 = (scale * std::f64::consts::LOG2_E) as f32;
    macro_rules! go {
        ($t:ty) => {{
            let (qs, ql) = q.storage_and_layout();
            let (ks, kl) = k.storage_and_layout();
            let (vs, vl) = v.storage_and_layout();
            let qv = span_view::<$t>(op, &qs, ql)?;
            let kv = span_view::<$t>(op, &ks, kl)?;
            let vv = span_view::<$t>(op, &vs, vl)?;
            let gate_guard = gate.as_ref().map(|g| g.storage_and_layout());
            let gv = match &gate_guard {
                Some((gs, gl)) => Some(span_view::<$t>(op, gs, gl)?),
                None => None,
            };
            let null = 0u64;
            // SAFETY: uninitialised; the kernel writes every (row < t, head, batch) output row.
            let out = unsafe { dev.alloc::<$t>(b * t * h * d)? };
            if b * t * h > 0 {
                let name = format!("flash_prefill_{}_d{d}", dtype_suffix(op, dt)?);
                allow_smem(&dev, &name, smem, ATTENTION_MODULE, ATTENTION_PTX)?;
                let f = dev.get_or_load_custom_func(&name, ATTENTION_MODULE, ATTENTION_PTX)?;
                let mut lb = KernelCall::new(&dev, &f);
                lb.arg(&qv).arg(&kv).arg(&vv);
                match &gv {
                    Some(g) => lb.arg(g),
                    None => lb.arg(&null),
                };
                lb.arg(&out);
                lb.arg(&t32).arg(&h32).arg(&kh32);
                for s in strides.iter().chain(&g_strides) {
                    lb.arg(s);
                }
                lb.arg(&pos32).arg(&sl2);
                let cfg = LaunchConfig {
                    grid_dim: (t.div_ceil(64) as u32, h as u32, b as u32),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: smem as u32,
                };
                // SAFETY: arguments match `flash_prefill_*_d*` in cuda/attention.cu: q [b, h, t,
                // d] and k, v [b, kh, ≥ pos0 + t, d] with rows of d contiguous elements d apart
                // (`with_row_layout`) and the batch/head strides passed (k and v share them), each
                // view spanning every element its layout addresses; the gate [b, t, h, d] with
                // contiguous rows and its three strides (or null and zeros); out [b, t, h, d]
                // contiguous; i32 t, h, kh, i64 strides, i32 pos0, f32 scale·log2 e. The caller
                // checked h % kh
                // == 0 and pos0 + t ≤ the key count, so every key row read exists; 128 threads and
                // the kernel's 3·64·(d + 8) elements of shared memory, its limit raised above.
                unsafe { lb.launch(cfg) }.w()?;
            }
            Ok(wrap(out, &dev, (b, t, h, d)).transpose(1, 2)?)
        }};
    }
    match dt {
        DType::BF16 => go!(half::bf16),
        DType::F16 => go!(half::f16),
        other => Err(err(op, format!("unsupported dtype {other:?}"))),
    }
}
