//! Launchers of the delta-rule kernels in cuda/gdn.cu: token by token (optionally keeping every
//! state, optionally in place), fused with the q/k norms and gates, and chunked (prep, scan,
//! outputs) on CUDA cores in f32 or on tensor cores for bf16.

use candle_core::cuda::cudarc::driver::sys::CUdevice_attribute;
use candle_core::cuda::cudarc::driver::{CudaView, CudaViewMut, DeviceRepr};
use candle_core::cuda::{CudaDType, WrapErr};
use candle_core::{CudaDevice, DType, Tensor};

use super::{DeltaRuleInputs, DeltaRuleMode, DeltaRuleOutput, Dims as Launch, GdnParams};
use crate::consts::{
    GDN_BV as BV, GDN_CHUNK as CHUNK, GDN_CHUNK_MAX_DK as CHUNK_MAX_DK, GDN_MAX_DK, GDN_OUT_COLS as OUT_COLS,
    GDN_OUT_SMEM as OUT_SMEM, GDN_PREP_SMEM as PREP_SMEM, GDN_SCAN_SMEM_C16, GDN_SCAN_SMEM_C32,
    GDN_TC_OUT_SMEM as TC_OUT_SMEM, GDN_TC_OV as TC_OV, GDN_TC_PREP_SMEM as TC_PREP_SMEM,
    GDN_TC_SCAN_OUT_SMEM_BV64, GDN_TC_SCAN_SMEM_BV32, GDN_TC_SCAN_SMEM_BV64, GDN_THREADS,
};
use crate::cuda::{
    device, dtype_suffix, err, for_float_dtype, in_place, row_stride, rows_view, view, with_out_buffer, wrap,
    KernelCall, LaunchConfig, GDN,
};
use crate::policy::{ChunkPath, KernelPolicy};
use crate::Result;

/// Grids of the recurrent kernel from which its 64-register variant (8 blocks per SM) runs: at the
/// 27B shape B = 8 (1536 blocks) gained with it and B = 1 (192) lost
/// (docs/history/BENCHMARKS-log.md, GDN kernels).
const WIDE_MIN_BLOCKS: usize = 1024;

/// The recurrent kernel's register rows per thread for a key dim: the smallest compiled variant
/// with 16·rows ≥ dk (16 row groups, cuda/gdn.cu).
fn rows_variant(op: &'static str, dk: usize) -> Result<usize> {
    [1usize, 2, 4, 8, 16]
        .into_iter()
        .find(|&r| 16 * r >= dk)
        .ok_or_else(|| {
            err(
                op,
                format!("key head dim {dk} > {GDN_MAX_DK} is not supported on CUDA"),
            )
        })
}

/// The inputs every delta-rule kernel takes, in its argument order. `q`, `k`, `v` are
/// `(tensor, element offset)`: separate f32 tensors at offset 0, or three views into the fused
/// `qkv` rows; `strides` are the (q/k, v) row lengths. `ga`/`gb` (`[b, t, hv]`) are g/beta, or
/// the raw a/b projections when `a_log`/`dt_bias` are given (the kernel then computes the gates);
/// their rows of `hv` values sit `g_stride` apart (views into a wider projection are read in place).
struct KernelInputs<'t> {
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

/// Device views of [`KernelInputs`], alive while their storage guards are.
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
    inp: &KernelInputs,
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
        state: s0.as_ref().map(|(s, l)| view::<f32>(op, s, l)).transpose()?,
        null: 0,
    };
    f(&views)
}

/// The grid of the kernels that keep the state in registers (recurrent, fused, chunk scan): one
/// block of THREADS per (sequence, value head, BV state columns).
fn state_column_blocks(d: Launch) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((d.b * d.hv * d.dv.div_ceil(BV)) as u32, 1, 1),
        block_dim: (GDN_THREADS as u32, 1, 1),
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

/// The rows of an in-place state buffer: `rows` states, sequence `i` at row `slots[i]` (u32
/// `[b]`) or, without slots, at row `i`.
#[derive(Clone, Copy)]
struct Pool<'a> {
    slots: Option<&'a Tensor>,
    rows: usize,
}

/// The deferred-commit arguments of the recurrent kernel (see [`crate::Deferred`]): the replay
/// counts, the stash (`[rows, tmax, hv·tiles, dk + BV + 2]` f32) and whether the pass stashes its
/// tokens (a verify).
struct Stash<'a, 'v> {
    replay: &'a Tensor,
    stash: &'a mut CudaViewMut<'v, f32>,
    tmax: usize,
    verify: bool,
}

/// Runs the recurrent kernel (`gdn_recurrent_*` or `gdn_fused_*`, see [`KernelInputs`]).
/// With `in_place` (a state buffer of `[rows, hv, dk, dv]` f32 and its [`Pool`], and `inp.state`
/// None) the kernel starts from that buffer and writes the final state back into it; the
/// returned `state` is then `None`.
#[allow(clippy::too_many_arguments)]
fn launch_recurrent<T: CudaDType>(
    op: &'static str,
    name: String,
    d: Launch,
    inp: KernelInputs,
    scale: f32,
    keep: Keep,
    in_place: Option<(&mut CudaViewMut<'_, f32>, Pool)>,
    deferred: Option<Stash>,
    policy: &KernelPolicy,
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
    let pool = in_place.as_ref().map(|(_, p)| *p);
    let slot_guard = pool.and_then(|p| p.slots).map(|s| s.storage_and_layout());
    let replay_guard = deferred.as_ref().map(|d| d.replay.storage_and_layout());
    with_views::<T, _>(op, &inp, |v| {
        let func = GDN.func(&dev, &name)?;
        let mut lb = KernelCall::new(&dev, &func, policy);
        v.push_inputs(&mut lb);
        v.push_state(&mut lb);
        lb.arg(&out);
        let flag: i32 = match (&s_fresh, in_place) {
            (Some(s), _) => {
                lb.arg(s);
                0
            }
            (None, Some((s, _))) => {
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
        let slot_view = slot_guard
            .as_ref()
            .map(|(ss, sl)| view::<u32>(op, ss, sl))
            .transpose()?;
        match &slot_view {
            Some(sv) => lb.arg(sv),
            None => lb.arg(&v.null),
        };
        let rows = pool.map_or(d.b, |p| p.rows) as i32;
        lb.arg(&rows);
        let replay_view = replay_guard
            .as_ref()
            .map(|(rs, rl)| view::<u32>(op, rs, rl))
            .transpose()?;
        let (tmax, stash_new) = deferred
            .as_ref()
            .map_or((0, 0), |d| (d.tmax as i32, i32::from(d.verify)));
        match (&replay_view, deferred) {
            (Some(rv), Some(d)) => lb.arg(rv).arg(d.stash),
            _ => lb.arg(&v.null).arg(&v.null),
        };
        lb.arg(&tmax).arg(&stash_new);
        let cfg = state_column_blocks(d);
        // SAFETY: the argument list matches the kernel's signature in cuda/gdn.cu (the shared
        // input prefix, the initial state or null, then the outputs, the in-place flag, i32
        // dims, f32 scale and eps, the slots or null and i32 rows); buffers have the sizes
        // checked by the callers, outputs are fresh allocations of the sizes the kernel writes
        // or (in place, flag 1, initial state null) the caller's state buffer of rows·hv·dk·dv
        // f32, which the kernel reads before it writes (each thread its own elements; rows
        // slots[i] < rows, distinct by the caller's duty, else row i < b = rows), the caller's
        // buffer for every token's state (`Keep::Into`, b·t·hv·dk·dv f32: checked by the caller,
        // disjoint from the state), the replay counts [b] u32 and the stash (`Stash`, checked by
        // the caller: rows·tmax·hv·tiles·(dk + BV + 2) f32, replay counts and t at most tmax, each
        // block reading and writing only its own records) or nulls, and null (0) is passed only
        // where the kernel tests for it.
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

/// Shared memory of the f32 chunk scan with `cols` state columns per block.
fn scan_smem(cols: usize) -> usize {
    if cols == 16 {
        GDN_SCAN_SMEM_C16
    } else {
        GDN_SCAN_SMEM_C32
    }
}

/// Shared memory of the tensor-core scan with `bv` (32 or 64) state columns per block, and the
/// outputs formed in it (`out`, 64 columns only).
fn tc_scan_smem(bv: usize, out: bool) -> usize {
    match (bv, out) {
        (32, _) => GDN_TC_SCAN_SMEM_BV32,
        (_, false) => GDN_TC_SCAN_SMEM_BV64,
        (_, true) => GDN_TC_SCAN_OUT_SMEM_BV64,
    }
}

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
/// (docs/history/BENCHMARKS-log.md, GDN kernels) unless the policy asks for 16.
fn f32_scan_columns(policy: &KernelPolicy) -> usize {
    match policy.chunk {
        ChunkPath::CudaCores(16) => 16,
        _ => 32,
    }
}

/// The tensor-core scan on `dev`: the widest its shared memory per block holds. 64 state columns
/// with the outputs (174 KiB: sm_90) saves the output kernel and the global round trip of the
/// chunk-entry states and Vt; 64 columns without (122 KiB: sm_80) read each chunk's W and k once
/// for twice the columns of 32 (18% faster on the H200: docs/history/BENCHMARKS-log.md, GDN
/// kernels); else 32 (sm_86, sm_89: 99 KiB). [`ChunkPath::TensorCores`] may ask for the split
/// scan of 32 or 64 columns.
fn tensor_core_scan(dev: &CudaDevice, policy: &KernelPolicy) -> TensorCoreScan {
    let stream = dev.cuda_stream();
    let optin = CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN;
    let max = stream.context().attribute(optin).map_or(0, |b| b as usize);
    match policy.chunk {
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
/// the kernels copy them in 16-byte pieces), and no CUDA-core path asked for by the policy.
fn chunked_on_tensor_cores(d: Launch, dt: DType, inp: &KernelInputs, policy: &KernelPolicy) -> bool {
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
        && !matches!(policy.chunk, ChunkPath::CudaCores(_))
}

/// Runs the chunked kernels (prep per chunk, the scan over chunks, then the outputs per chunk
/// unless the scan forms them); same inputs as [`launch_recurrent`], no intermediate states. `S`
/// is the type of the intermediates (U, W, P, the chunk-entry states hs, and Qt, Kt unless
/// `raw_qk`): f32, or bf16 for the tensor-core kernels.
fn launch_chunked<T: CudaDType, S: CudaDType + DeviceRepr>(
    op: &'static str,
    kernels: &ChunkKernels,
    d: Launch,
    inp: KernelInputs,
    scale: f32,
    policy: &KernelPolicy,
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
        let func = GDN.func_with_smem(&dev, name, *smem)?;
        let mut lb = KernelCall::new(&dev, &func, policy);
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
        let func = GDN.func_with_smem(&dev, name, *smem)?;
        let mut lb = KernelCall::new(&dev, &func, policy);
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
        let func = GDN.func_with_smem(&dev, name, smem)?;
        let mut lb = KernelCall::new(&dev, &func, policy);
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
    fn new(x: DeltaRuleInputs, state: Option<&Tensor>) -> Result<Self> {
        let DeltaRuleInputs { q, k, v, g, beta } = x;
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

    fn inputs(&self, d: Launch) -> KernelInputs<'_> {
        KernelInputs {
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

/// CUDA twin of [`super::chunked_gated_delta_rule`] (f32 inputs): the chunked kernels where
/// [`chunked_supported`], the token-by-token kernel otherwise.
pub(crate) fn chunked(
    d: Launch,
    inputs: DeltaRuleInputs,
    state: Option<&Tensor>,
    scale: f32,
    policy: &KernelPolicy,
) -> Result<DeltaRuleOutput> {
    if !chunked_supported(d) {
        return recurrent(d, inputs, state, scale, false, policy);
    }
    let x = SeparateF32::new(inputs, state)?;
    let kernels = ChunkKernels::f32("gdn_chunk_prep_f32".into(), f32_scan_columns(policy));
    launch_chunked::<f32, f32>(
        "chunked_gated_delta_rule",
        &kernels,
        d,
        x.inputs(d),
        scale,
        policy,
    )
}

/// CUDA twin of [`super::recurrent_gated_delta_rule`] (f32 inputs; shapes checked by the caller).
pub(crate) fn recurrent(
    d: Launch,
    inputs: DeltaRuleInputs,
    state: Option<&Tensor>,
    scale: f32,
    keep_all_states: bool,
    policy: &KernelPolicy,
) -> Result<DeltaRuleOutput> {
    let op = "recurrent_gated_delta_rule";
    let name = format!("gdn_recurrent_f32_r{}", rows_variant(op, d.dk)?);
    let x = SeparateF32::new(inputs, state)?;
    let keep = Keep::fresh(keep_all_states);
    launch_recurrent::<f32>(op, name, d, x.inputs(d), scale, keep, None, None, policy).map(fresh_output)
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
    fn new(d: Launch, qkv: &Tensor, a: &Tensor, b: &Tensor, layer: GdnParams) -> Result<Self> {
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
            a_log: layer.a_log.to_dtype(DType::F32)?.contiguous()?,
            dt_bias: layer.dt_bias.to_dtype(DType::F32)?.contiguous()?,
        })
    }

    /// q, k, v as views into each qkv row ([Q all | K all | V all]) and the raw gates.
    fn inputs<'t>(&'t self, d: Launch, state: Option<&'t Tensor>) -> KernelInputs<'t> {
        let kd = d.hk * d.dk;
        let row = 2 * kd + d.hv * d.dv;
        KernelInputs {
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
    /// fits twice the blocks per SM (docs/history/BENCHMARKS-log.md, GDN kernels), unless the
    /// call keeps every token's state (`keep_all`: that variant stores none).
    fn recurrent_kernel(&self, op: &'static str, d: Launch, keep_all: bool) -> Result<String> {
        let rows = rows_variant(op, d.dk)?;
        let blocks = d.b * d.hv * d.dv.div_ceil(BV);
        let wide = (2..=8).contains(&rows) && blocks >= WIDE_MIN_BLOCKS && !keep_all;
        Ok(format!(
            "gdn_fused_{}_r{rows}{}",
            dtype_suffix(op, self.qkv.dtype())?,
            if wide { "_wide" } else { "" }
        ))
    }
}

/// CUDA twin of [`super::fused_gated_delta_rule`]: `qkv: [b, t, 2·hk·dk + hv·dv]` and `a, b: [b,
/// t, hv]` in one activation dtype; the layer's `a_log, dt_bias: [hv]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn fused(
    d: Launch,
    qkv: &Tensor,
    a: &Tensor,
    b: &Tensor,
    layer: GdnParams,
    state: Option<&Tensor>,
    mode: DeltaRuleMode,
    policy: &KernelPolicy,
) -> Result<DeltaRuleOutput> {
    let op = "fused_gated_delta_rule";
    let dt = qkv.dtype();
    let args = FusedArgs::new(d, qkv, a, b, layer)?;
    let state = state.map(|s| s.contiguous()).transpose()?;
    let inp = args.inputs(d, state.as_ref());
    let scale = (d.dk as f32).powf(-0.5);
    match mode {
        DeltaRuleMode::Chunked if chunked_supported(d) && chunked_on_tensor_cores(d, dt, &inp, policy) => {
            let kernels = ChunkKernels::tensor_cores(tensor_core_scan(&device(op, qkv)?, policy));
            launch_chunked::<half::bf16, half::bf16>(op, &kernels, d, inp, scale, policy)
        }
        DeltaRuleMode::Chunked if chunked_supported(d) => {
            let prep = format!("gdn_chunk_prep_fused_{}", dtype_suffix(op, dt)?);
            let kernels = ChunkKernels::f32(prep, f32_scan_columns(policy));
            macro_rules! go {
                ($t:ty) => {
                    launch_chunked::<$t, f32>(op, &kernels, d, inp, scale, policy)
                };
            }
            for_float_dtype!(op, dt)
        }
        _ => {
            let keep_all = mode
                == DeltaRuleMode::Recurrent {
                    keep_all_states: true,
                };
            let keep = Keep::fresh(keep_all);
            let name = args.recurrent_kernel(op, d, keep_all)?;
            macro_rules! go {
                ($t:ty) => {
                    launch_recurrent::<$t>(op, name, d, inp, scale, keep, None, None, policy)
                        .map(fresh_output)
                };
            }
            for_float_dtype!(op, dt)
        }
    }
}

/// CUDA twin of [`super::fused_gated_delta_rule_in_place`] (shapes checked by the caller; `state`
/// contiguous f32 `[b, hv, dk, dv]`, `all_states` contiguous f32 `[b, t, hv, dk, dv]`): the
/// recurrent kernel reads and writes `state`'s buffer and writes every token's state into
/// `all_states`'s.
#[allow(clippy::too_many_arguments)]
pub(crate) fn fused_in_place(
    d: Launch,
    qkv: &Tensor,
    a: &Tensor,
    b: &Tensor,
    layer: GdnParams,
    state: &Tensor,
    slots: Option<&Tensor>,
    all_states: Option<&Tensor>,
    policy: &KernelPolicy,
) -> Result<DeltaRuleOutput> {
    let op = "fused_gated_delta_rule_in_place";
    let args = FusedArgs::new(d, qkv, a, b, layer)?;
    let slots = slots.map(Tensor::contiguous).transpose()?;
    let pool = Pool {
        slots: slots.as_ref(),
        rows: state.dim(0)?,
    };
    let name = args.recurrent_kernel(op, d, all_states.is_some())?;
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
                    launch_recurrent::<$t>(
                        op,
                        name,
                        d,
                        inp,
                        scale,
                        keep,
                        Some((&mut view, pool)),
                        None,
                        policy,
                    )
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

/// CUDA twin of [`super::fused_gated_delta_rule_pooled`] (shapes checked by the caller): the
/// in-place recurrent kernel over the pool's rows with deferred commits. Returns the read-out.
#[allow(clippy::too_many_arguments)]
pub(crate) fn fused_pooled(
    d: Launch,
    qkv: &Tensor,
    a: &Tensor,
    b: &Tensor,
    layer: GdnParams,
    pool: &Tensor,
    deferred: &crate::Deferred,
    policy: &KernelPolicy,
) -> Result<Tensor> {
    let op = "fused_gated_delta_rule_pooled";
    let args = FusedArgs::new(d, qkv, a, b, layer)?;
    let name = args.recurrent_kernel(op, d, false)?;
    let dt = args.qkv.dtype();
    let inp = args.inputs(d, None);
    recurrent_pooled(op, name, d, Some(inp), dt, pool, deferred, policy)
}

/// CUDA twin of [`super::replay_pooled`]: the recurrent kernel with no new tokens.
pub(crate) fn replay_pooled(
    d: Launch,
    pool: &Tensor,
    deferred: &crate::Deferred,
    policy: &KernelPolicy,
) -> Result<()> {
    let op = "delta_rule::replay_pooled";
    let name = format!("gdn_fused_f32_r{}", rows_variant(op, d.dk)?);
    recurrent_pooled(op, name, d, None, DType::F32, pool, deferred, policy).map(|_| ())
}

/// The recurrent kernel `name` in place over rows `deferred.slots` of `pool` with deferred
/// commits, on `inp` (activation dtype `dt`) or, without inputs, no new tokens (`d.t` 0).
#[allow(clippy::too_many_arguments)]
fn recurrent_pooled(
    op: &'static str,
    name: String,
    d: Launch,
    inp: Option<KernelInputs>,
    dt: DType,
    pool: &Tensor,
    deferred: &crate::Deferred,
    policy: &KernelPolicy,
) -> Result<Tensor> {
    let slots = deferred.slots.contiguous()?;
    let replay = deferred.replay.contiguous()?;
    let rows = Pool {
        slots: Some(&slots),
        rows: pool.dim(0)?,
    };
    let tmax = deferred.stash.dim(1)?;
    let scale = (d.dk as f32).powf(-0.5);
    with_out_buffer::<f32, _>(op, Some(deferred.stash), |stash| {
        let stash = stash.expect("a stash buffer");
        let mut out = None;
        in_place(op, pool, |st, range| {
            let mut view = st.as_cuda_slice_mut::<f32>()?.slice_mut(range);
            let deferred = Some(Stash {
                replay: &replay,
                stash,
                tmax,
                verify: deferred.verify,
            });
            let Some(inp) = inp else {
                launch_replay(op, &name, d, scale, &mut view, rows, deferred, policy)?;
                return Ok(());
            };
            macro_rules! go {
                ($t:ty) => {
                    launch_recurrent::<$t>(
                        op,
                        name,
                        d,
                        inp,
                        scale,
                        Keep::No,
                        Some((&mut view, rows)),
                        deferred,
                        policy,
                    )
                };
            }
            out = Some(for_float_dtype!(op, dt)?.0);
            Ok(())
        })?;
        Ok(out)
    })
    .and_then(|out| match out {
        Some(out) => Ok(out),
        None => Ok(Tensor::zeros((d.b, 0, d.hv, d.dv), DType::F32, pool.device())?),
    })
}

/// The recurrent kernel with no new tokens (`d.t` 0): each row of the pool takes its replayed
/// records alone.
#[allow(clippy::too_many_arguments)]
fn launch_replay(
    op: &'static str,
    name: &str,
    d: Launch,
    scale: f32,
    state: &mut CudaViewMut<'_, f32>,
    pool: Pool,
    deferred: Option<Stash>,
    policy: &KernelPolicy,
) -> Result<()> {
    let (Some(slots), Some(deferred)) = (pool.slots, deferred) else {
        return Err(err(op, "a replay needs slots and a stash"));
    };
    let dev = device(op, slots)?;
    let func = GDN.func(&dev, name)?;
    let mut lb = KernelCall::new(&dev, &func, policy);
    let (null, zero64, zero, one) = (0u64, 0i64, 0i32, 1i32);
    // q, k, v, their strides, a, b, their stride, a_log, dt_bias, the initial state, the output.
    lb.arg(&null).arg(&null).arg(&null).arg(&zero64).arg(&zero64);
    lb.arg(&null).arg(&null).arg(&zero64).arg(&null).arg(&null);
    lb.arg(&null).arg(&null);
    lb.arg(state).arg(&null).arg(&one).arg(&zero);
    let dims = [d.hk as i32, d.hv as i32, d.dk as i32, d.dv as i32];
    for x in &dims {
        lb.arg(x);
    }
    let eps = 1e-6f32;
    lb.arg(&scale).arg(&eps);
    let (ss, sl) = slots.storage_and_layout();
    let sv = view::<u32>(op, &ss, sl)?;
    let (rs, rl) = deferred.replay.storage_and_layout();
    let rv = view::<u32>(op, &rs, rl)?;
    let (rows, tmax, stash_new) = (pool.rows as i32, deferred.tmax as i32, 0i32);
    lb.arg(&sv)
        .arg(&rows)
        .arg(&rv)
        .arg(deferred.stash)
        .arg(&tmax)
        .arg(&stash_new);
    // SAFETY: the argument list matches `gdn_fused_f32_r*` in cuda/gdn.cu with no new tokens (T
    // 0: q, k, v, a, b, a_log, dt_bias, the initial state and the output are never read or
    // written, so nulls), the pool [rows·hv·dk·dv] f32 in place (flag 1), the slots and replay
    // counts [b] u32 (rows below `rows`, distinct; counts at most tmax: the caller's duty), the
    // stash [rows·tmax·hv·tiles·(dk + BV + 2)] f32 read by each block for its own records only.
    unsafe { lb.launch(state_column_blocks(d)) }.w()?;
    Ok(())
}
