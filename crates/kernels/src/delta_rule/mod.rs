//! The gated delta rule (docs/MODEL.md §2.2-2.3): the GDN recurrence, in f32.
//!
//! Per value head `h` with state `S ∈ R^{dk×dv}` and for each token:
//! ```text
//! S ← exp(g) · S;   δ ← β (v − Sᵀk);   S ← S + k δᵀ;   o ← Sᵀ (scale · q)
//! ```
//! (decay first, then read: the read uses the decayed state). Value head `h` uses key head
//! `h / (Hv/Hk)`. q and k are expected L2-normalised already; `scale` is usually `dk^-1/2`.
//!
//! Two forms that agree to rounding: [`recurrent_gated_delta_rule`] (one token at a time, can keep
//! every intermediate state for speculative rollback) and [`chunked_gated_delta_rule`] (the
//! WY/UT-transform chunk form used for prefill, exact for any length).
//!
//! Shapes: `q, k: [batch, len, k_heads, dk]`, `v: [batch, len, v_heads, dv]`,
//! `g, beta: [batch, len, v_heads]`, state `[batch, v_heads, dk, dv]` (f32 only).
//!
//! [`reference`](mod@reference) holds the CPU forms; `cuda.rs` the launchers of cuda/gdn.cu.

#[cfg(feature = "cuda")]
mod cuda;
pub mod reference;

use candle_core::{DType, Tensor};

use crate::{expect_rank, Error, KernelPolicy, Result};

/// Outputs of a delta-rule call.
#[derive(Debug, Clone)]
pub struct DeltaRuleOutput {
    /// `[batch, len, v_heads, dv]`, f32.
    pub out: Tensor,
    /// The state after the last token, `[batch, v_heads, dk, dv]`, f32.
    pub state: Tensor,
    /// With `keep_all_states`: the state after every token, `[batch, len, v_heads, dk, dv]`, f32.
    pub all_states: Option<Tensor>,
}

/// The inputs of the unfused forms: `q, k: [batch, len, k_heads, dk]` (L2-normalised),
/// `v: [batch, len, v_heads, dv]`, `g` (log decays) and `beta: [batch, len, v_heads]`.
#[derive(Debug, Clone, Copy)]
pub struct DeltaRuleInputs<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub g: &'a Tensor,
    pub beta: &'a Tensor,
}

impl<'a> DeltaRuleInputs<'a> {
    /// The five tensors in the order the math names them.
    pub fn new(q: &'a Tensor, k: &'a Tensor, v: &'a Tensor, g: &'a Tensor, beta: &'a Tensor) -> Self {
        Self { q, k, v, g, beta }
    }
}

/// Sizes shared by both forms (and the CUDA launches), checked once.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dims {
    pub b: usize,
    pub t: usize,
    pub hk: usize,
    pub hv: usize,
    pub dk: usize,
    pub dv: usize,
}

fn check(op: &'static str, x: DeltaRuleInputs, state: Option<&Tensor>) -> Result<Dims> {
    let DeltaRuleInputs { q, k, v, g, beta } = x;
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        expect_rank(op, name, t, 4)?;
    }
    let (b, t, hk, dk) = q.dims4()?;
    let (_, _, hv, dv) = v.dims4()?;
    let bad = |msg: String| Err(Error::Shape { op, msg });
    if k.dims() != q.dims() {
        return bad(format!("k {:?} must match q {:?}", k.dims(), q.dims()));
    }
    if v.dim(0)? != b || v.dim(1)? != t {
        return bad(format!("v {:?} must be [{b}, {t}, v_heads, dv]", v.dims()));
    }
    for (name, x) in [("g", g), ("beta", beta)] {
        if x.dims() != [b, t, hv] {
            return bad(format!("{name} must be [{b}, {t}, {hv}], found {:?}", x.dims()));
        }
    }
    let d = Dims { b, t, hk, hv, dk, dv };
    check_heads_and_state(op, d, state)?;
    Ok(d)
}

/// The checks shared by every entry point once the dims are known: GQA head counts and the state
/// (`[b, hv, dk, dv]`, f32).
fn check_heads_and_state(op: &'static str, d: Dims, state: Option<&Tensor>) -> Result<()> {
    let Dims {
        b, hk, hv, dk, dv, ..
    } = d;
    let bad = |msg: String| Err(Error::Shape { op, msg });
    if hk == 0 || hv % hk != 0 {
        return bad(format!("v_heads {hv} must be a multiple of k_heads {hk}"));
    }
    if let Some(s) = state {
        if s.dims() != [b, hv, dk, dv] {
            return bad(format!(
                "state must be [{b}, {hv}, {dk}, {dv}], found {:?}",
                s.dims()
            ));
        }
        if s.dtype() != DType::F32 {
            return bad(format!("the recurrent state must be f32, found {:?}", s.dtype()));
        }
    }
    Ok(())
}

/// Token-by-token gated delta rule. With `keep_all_states`, also returns the state after every
/// token (what a speculative verify needs to roll back to any accepted length).
pub fn recurrent_gated_delta_rule(
    x: DeltaRuleInputs,
    initial_state: Option<&Tensor>,
    scale: f32,
    keep_all_states: bool,
    policy: &KernelPolicy,
) -> Result<DeltaRuleOutput> {
    let d = check("recurrent_gated_delta_rule", x, initial_state)?;
    #[cfg(feature = "cuda")]
    if x.q.device().is_cuda() {
        return cuda::recurrent(d, x, initial_state, scale, keep_all_states, policy);
    }
    let _ = (d, policy);
    reference::recurrent(x, initial_state, scale, keep_all_states)
}

/// Chunk length of the chunked form (fla's default), the one the CUDA kernels are built for.
pub const CHUNK_SIZE: usize = crate::consts::GDN_CHUNK;

/// Chunked (WY/UT transform) gated delta rule for prefill; exact for any length `T`
/// (the last chunk is simply shorter, which equals zero padding with β = 0, g = 0).
///
/// Per chunk with entry state `S₀`, in-chunk cumulative decay `γ`, `Γ_rs = exp(γ_r − γ_s)`:
/// `A_rs = β_r Γ_rs k_r·k_s (s < r)`, `U = (I+A)⁻¹ diag(β) V`, `W = (I+A)⁻¹ diag(β e^γ) K`,
/// `Ṽ = U − W S₀`, `o_r = e^{γ_r} q_rᵀS₀ + Σ_{s≤r} Γ_rs (q_r·k_s) ṽ_s`,
/// `S_exit = e^{γ_L} S₀ + Σ_s e^{γ_L−γ_s} k_s ṽ_sᵀ`.
///
/// On CUDA the kernels run chunks of [`CHUNK_SIZE`]; another `chunk_size` is an error there (the
/// result does not depend on it beyond rounding: the reference takes any).
pub fn chunked_gated_delta_rule(
    x: DeltaRuleInputs,
    initial_state: Option<&Tensor>,
    scale: f32,
    chunk_size: usize,
    policy: &KernelPolicy,
) -> Result<DeltaRuleOutput> {
    let op = "chunked_gated_delta_rule";
    let d = check(op, x, initial_state)?;
    if x.q.device().is_cuda() && chunk_size != CHUNK_SIZE {
        return Err(Error::Shape {
            op,
            msg: format!("the CUDA kernels run chunks of {CHUNK_SIZE} tokens, not {chunk_size}"),
        });
    }
    #[cfg(feature = "cuda")]
    if x.q.device().is_cuda() {
        return cuda::chunked(d, x, initial_state, scale, policy);
    }
    let _ = (d, policy);
    reference::chunked(x, initial_state, scale, chunk_size)
}

/// Head layout of a GDN layer: q and k have `k_heads × k_dim`, v has `v_heads × v_dim`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdnHeads {
    pub k_heads: usize,
    pub v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
}

/// The fused op's sizes from `qkv: [batch, len, width]` and `heads`, once its shapes are checked
/// (the qkv width, a and b against v's heads, the state), before any kernel runs; q, k and v are
/// views into qkv by construction.
fn check_fused(
    op: &'static str,
    qkv: &Tensor,
    a: &Tensor,
    b: &Tensor,
    heads: GdnHeads,
    state: Option<&Tensor>,
) -> Result<Dims> {
    expect_rank(op, "qkv", qkv, 3)?;
    let (bs, t, _) = qkv.dims3()?;
    let d = Dims {
        b: bs,
        t,
        hk: heads.k_heads,
        hv: heads.v_heads,
        dk: heads.k_dim,
        dv: heads.v_dim,
    };
    let width = qkv.dim(2)?;
    if width != 2 * d.hk * d.dk + d.hv * d.dv {
        return Err(Error::Shape {
            op,
            msg: format!("qkv width {width} != 2·{}·{} + {}·{}", d.hk, d.dk, d.hv, d.dv),
        });
    }
    check_heads_and_state(op, d, state)?;
    let want = [d.b, d.t, d.hv];
    if a.dims() != want || b.dims() != want {
        return Err(Error::Shape {
            op,
            msg: format!("a {:?} and b {:?} must be {want:?}", a.dims(), b.dims()),
        });
    }
    Ok(d)
}

/// A GDN layer's fixed parameters of its core: `a_log, dt_bias: [Hv]` (f32; the gates'
/// `A_log` and `dt_bias`) and the head layout.
#[derive(Debug, Clone, Copy)]
pub struct GdnParams<'a> {
    pub a_log: &'a Tensor,
    pub dt_bias: &'a Tensor,
    pub heads: GdnHeads,
}

impl<'a> GdnParams<'a> {
    /// The parameters in the order the layer's checkpoint names them.
    pub fn new(a_log: &'a Tensor, dt_bias: &'a Tensor, heads: GdnHeads) -> Self {
        Self {
            a_log,
            dt_bias,
            heads,
        }
    }
}

/// Which form of the delta rule [`fused_gated_delta_rule`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeltaRuleMode {
    /// Prefill: the chunked form (no intermediate states).
    Chunked,
    /// Decode / speculative verify: token by token, optionally keeping every state.
    Recurrent { keep_all_states: bool },
}

/// GDN's core in one call, from the conv output to the read-out: splits `qkv: [batch, len,
/// 2·Hk·dk + Hv·dv]` into q, k, v, L2-normalises q and k per head (eps 1e-6), computes the gates
/// from `a, b: [batch, len, Hv]` and the layer's `a_log, dt_bias` and runs the delta rule with scale
/// `dk^-1/2`. CPU: the composition of [`crate::norm::l2_norm`], [`crate::gating::gdn_gating`] and
/// the delta-rule forms; CUDA: one kernel for the recurrent form, two or three (prep, scan, and
/// the outputs unless the scan forms them; `policy.chunk` picks them) for the chunked form.
#[allow(clippy::too_many_arguments)]
pub fn fused_gated_delta_rule(
    qkv: &Tensor,
    a: &Tensor,
    b: &Tensor,
    layer: GdnParams,
    state: Option<&Tensor>,
    mode: DeltaRuleMode,
    policy: &KernelPolicy,
) -> Result<DeltaRuleOutput> {
    let d = check_fused("fused_gated_delta_rule", qkv, a, b, layer.heads, state)?;
    #[cfg(feature = "cuda")]
    if qkv.device().is_cuda() {
        return cuda::fused(d, qkv, a, b, layer, state, mode, policy);
    }
    let _ = (d, policy);
    reference::fused(qkv, a, b, layer, state, mode)
}

/// [`fused_gated_delta_rule`] in the recurrent form with the state updated in place: `state`
/// (`[batch, Hv, dk, dv]` f32, contiguous) holds the entry state and receives the exit state, so
/// its buffer (and any CUDA graph that recorded it) stays the same; on CUDA the kernel writes it
/// directly, with no copy. `all_states`, when given (`[batch, len, Hv, dk, dv]` f32, contiguous,
/// another buffer than `state`), receives the state after every token, as
/// `Recurrent { keep_all_states: true }` returns it: a verify pass's checkpoints, written where the
/// caller keeps them. The output's `state` and `all_states` are those tensors themselves.
///
/// With `slots` (u32 `[batch]`, distinct), `state` is a pool `[pool, Hv, dk, dv]` and sequence `i`
/// reads and writes its row `slots[i]` (a batch over pooled states, with no gather or scatter);
/// the output's `state` is then the pool. A slot outside the pool is an error on the CPU; on CUDA
/// (which does not read the slots back) that sequence runs from a zero state and keeps nothing.
#[allow(clippy::too_many_arguments)]
pub fn fused_gated_delta_rule_in_place(
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
    if !state.is_contiguous() || state.dtype() != DType::F32 {
        return Err(Error::Shape {
            op,
            msg: format!(
                "the state must be contiguous f32 to be updated in place, found {:?}",
                state.dtype()
            ),
        });
    }
    if let Some(all) = all_states {
        let heads = layer.heads;
        let want = [qkv.dim(0)?, qkv.dim(1)?, heads.v_heads, heads.k_dim, heads.v_dim];
        crate::expect_out_buffer(op, "all_states", all, DType::F32, &want, ("the state", state))?;
    }
    let keep_all_states = all_states.is_some();
    let mode = DeltaRuleMode::Recurrent { keep_all_states };
    // The shape checks of the fresh-state op, the pool's rows standing for the batch.
    let per_seq = crate::state_per_sequence(op, state, slots, qkv.dim(0)?)?;
    let d = check_fused(op, qkv, a, b, layer.heads, Some(&per_seq))?;
    #[cfg(feature = "cuda")]
    if qkv.device().is_cuda() {
        return cuda::fused_in_place(d, qkv, a, b, layer, state, slots, all_states, policy);
    }
    let _ = d;
    if let Some(slots) = slots {
        let out = crate::on_pool_rows(op, state, slots, |own| {
            fused_gated_delta_rule_in_place(qkv, a, b, layer, own, None, all_states, policy)
        })?;
        return Ok(DeltaRuleOutput {
            state: state.clone(),
            ..out
        });
    }
    let r = fused_gated_delta_rule(qkv, a, b, layer, Some(state), mode, policy)?;
    state.slice_set(&r.state, 0, 0)?;
    if let (Some(dst), Some(src)) = (all_states, &r.all_states) {
        dst.slice_set(src, 0, 0)?;
    }
    Ok(DeltaRuleOutput {
        out: r.out,
        state: state.clone(),
        all_states: all_states.cloned(),
    })
}

/// The stash of a pool of recurrent states (`[pool, Hv, dk, dv]` f32) for
/// [`fused_gated_delta_rule_pooled`], for verifies of up to `tokens` tokens over activations of
/// `dtype`: `[pool, tokens, ...]`, zeroed. On CUDA each token keeps, per (value head, tile of
/// `GDN_BV` state columns), the normalised k row, the tile's v, the decay and beta in f32 (what
/// the kernel's blocks read back, each its own); on the CPU the token's raw qkv, a and b rows in
/// `dtype`.
pub fn new_stash(pool: &Tensor, tokens: usize, heads: GdnHeads, dtype: DType) -> Result<Tensor> {
    let (dims, dtype) = new_stash_dims(pool.dim(0)?, tokens, heads, dtype, pool.device().is_cuda());
    Ok(Tensor::zeros(dims, dtype, pool.device())?)
}

/// Bytes of one slot's row of [`new_stash`] for verifies of `tokens` tokens, on CUDA (`cuda`)
/// or the CPU.
pub fn stash_bytes(heads: GdnHeads, dtype: DType, tokens: usize, cuda: bool) -> u64 {
    let (dims, dt) = new_stash_dims(1, tokens, heads, dtype, cuda);
    dims.iter().product::<usize>() as u64 * dt.size_in_bytes() as u64
}

/// [`fused_gated_delta_rule_in_place`] over rows of a pool of states with deferred commits
/// ([`crate::Deferred`]): each sequence's state first takes the tokens its slot's last verify
/// stashed (`replay` of them); a verify then leaves that state in the pool and stashes its own
/// tokens, a decode step advances it over them too. Returns the read-out `[batch, len, Hv, dv]`
/// f32 of the new tokens, from the state after the replayed ones.
#[allow(clippy::too_many_arguments)]
pub fn fused_gated_delta_rule_pooled(
    qkv: &Tensor,
    a: &Tensor,
    b: &Tensor,
    layer: GdnParams,
    pool: &Tensor,
    deferred: &crate::Deferred,
    policy: &KernelPolicy,
) -> Result<Tensor> {
    let op = "fused_gated_delta_rule_pooled";
    let (batch, t, _) = qkv.dims3()?;
    check_pool(op, pool, qkv.dtype(), layer.heads, deferred, batch, t)?;
    let per_seq = crate::state_per_sequence(op, pool, Some(deferred.slots), batch)?;
    let d = check_fused(op, qkv, a, b, layer.heads, Some(&per_seq))?;
    #[cfg(feature = "cuda")]
    if qkv.device().is_cuda() {
        return cuda::fused_pooled(d, qkv, a, b, layer, pool, deferred, policy);
    }
    let _ = d;
    let mode = DeltaRuleMode::Recurrent {
        keep_all_states: false,
    };
    let slots = deferred.slots.to_vec1::<u32>()?;
    let replay = deferred.host_replay()?;
    crate::on_pool_rows(op, pool, deferred.slots, |own| {
        replay_rows(own, deferred.stash, &slots, &replay, layer, policy)?;
        let r = fused_gated_delta_rule(qkv, a, b, layer, Some(own), mode, policy)?;
        if deferred.verify {
            let tokens = Tensor::cat(&[qkv, &a.to_dtype(qkv.dtype())?, &b.to_dtype(qkv.dtype())?], 2)?;
            for (i, &slot) in slots.iter().enumerate() {
                crate::stash_tokens(deferred.stash, slot, &tokens.get(i)?)?;
            }
        } else {
            own.slice_set(&r.state, 0, 0)?;
        }
        Ok(r.out)
    })
}

/// Applies the deferred commits of `replay` (u32 `[batch]`) to pool rows `slots` alone (no new
/// tokens): each row's state takes that many of its slot's stashed tokens.
pub fn replay_pooled(
    layer: GdnParams,
    pool: &Tensor,
    stash: &Tensor,
    slots: &Tensor,
    replay: &Tensor,
    policy: &KernelPolicy,
) -> Result<()> {
    let op = "delta_rule::replay_pooled";
    let deferred = crate::Deferred::replay_only(slots, replay, stash);
    let batch = slots.dims1()?;
    let dtype = if pool.device().is_cuda() {
        DType::F32
    } else {
        stash.dtype()
    };
    check_pool(op, pool, dtype, layer.heads, &deferred, batch, 0)?;
    #[cfg(feature = "cuda")]
    if pool.device().is_cuda() {
        let h = layer.heads;
        let d = Dims {
            b: batch,
            t: 0,
            hk: h.k_heads,
            hv: h.v_heads,
            dk: h.k_dim,
            dv: h.v_dim,
        };
        return cuda::replay_pooled(d, pool, &deferred, policy);
    }
    let ids = slots.to_vec1::<u32>()?;
    let counts = deferred.host_replay()?;
    crate::on_pool_rows(op, pool, slots, |own| {
        replay_rows(own, stash, &ids, &counts, layer, policy)
    })
}

/// The CPU form's states `own: [batch, Hv, dk, dv]` advanced, row by row, over `replay[i]` of
/// slot `slots[i]`'s stashed tokens (raw qkv|a|b rows), as the pass that stashed them ran them.
fn replay_rows(
    own: &Tensor,
    stash: &Tensor,
    slots: &[u32],
    replay: &[u32],
    layer: GdnParams,
    policy: &KernelPolicy,
) -> Result<()> {
    let h = layer.heads;
    let width = 2 * h.k_heads * h.k_dim + h.v_heads * h.v_dim;
    let mode = DeltaRuleMode::Recurrent {
        keep_all_states: false,
    };
    for (i, (&slot, &n)) in slots.iter().zip(replay).enumerate() {
        if n == 0 {
            continue;
        }
        let rows = stash.narrow(0, slot as usize, 1)?.narrow(1, 0, n as usize)?;
        let (qkv, a, b) = (
            rows.narrow(2, 0, width)?,
            rows.narrow(2, width, h.v_heads)?,
            rows.narrow(2, width + h.v_heads, h.v_heads)?,
        );
        let state = own.narrow(0, i, 1)?;
        let r = fused_gated_delta_rule(&qkv, &a, &b, layer, Some(&state), mode, policy)?;
        own.slice_set(&r.state, 0, i)?;
    }
    Ok(())
}

/// Checks a pool of states and its stash (as [`new_stash`] makes them for `heads` over
/// activations of `dtype`) for a pass of `tokens` new tokens per sequence.
fn check_pool(
    op: &'static str,
    pool: &Tensor,
    dtype: DType,
    heads: GdnHeads,
    deferred: &crate::Deferred,
    batch: usize,
    tokens: usize,
) -> Result<()> {
    if !pool.is_contiguous() || pool.dtype() != DType::F32 || pool.rank() != 4 {
        return Err(Error::Shape {
            op,
            msg: format!(
                "the pool must be contiguous f32 [pool, Hv, dk, dv], found {:?} {:?}",
                pool.dtype(),
                pool.dims()
            ),
        });
    }
    let rows = pool.dim(0)?;
    let held = deferred.check(op, batch, rows, tokens)?;
    let want = new_stash_dims(rows, held, heads, dtype, pool.device().is_cuda());
    let stash = deferred.stash;
    if stash.dims() != want.0 || stash.dtype() != want.1 {
        return Err(Error::Shape {
            op,
            msg: format!(
                "the stash must be {:?} {:?}, found {:?} {:?}",
                want.1,
                want.0,
                stash.dtype(),
                stash.dims()
            ),
        });
    }
    Ok(())
}

/// The dims and dtype [`new_stash`] gives.
fn new_stash_dims(
    rows: usize,
    tokens: usize,
    heads: GdnHeads,
    dtype: DType,
    cuda: bool,
) -> (Vec<usize>, DType) {
    if cuda {
        let tiles = heads.v_dim.div_ceil(crate::consts::GDN_BV);
        let rec = heads.k_dim + crate::consts::GDN_BV + 2;
        return (vec![rows, tokens, heads.v_heads * tiles, rec], DType::F32);
    }
    let width = 2 * heads.k_heads * heads.k_dim + heads.v_heads * heads.v_dim + 2 * heads.v_heads;
    (vec![rows, tokens, width], dtype)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    const P: &KernelPolicy = &KernelPolicy::DEFAULT;

    struct Case {
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        s0: Tensor,
    }

    impl Case {
        fn inputs(&self) -> DeltaRuleInputs<'_> {
            DeltaRuleInputs::new(&self.q, &self.k, &self.v, &self.g, &self.beta)
        }
    }

    fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn l2(x: Vec<f32>, d: usize) -> Vec<f32> {
        x.chunks(d)
            .flat_map(|r| {
                let n = r.iter().map(|v| v * v).sum::<f32>().sqrt();
                r.iter().map(move |v| v / n).collect::<Vec<_>>()
            })
            .collect()
    }

    /// Random inputs with realistic gates: g in [-1.2, -0.005], beta in (0, 1), unit q/k.
    fn case(b: usize, t: usize, hk: usize, hv: usize, dk: usize, dv: usize, seed: u64) -> Case {
        let dev = Device::Cpu;
        let mk = |v: Vec<f32>, shape: &[usize]| Tensor::from_vec(v, shape, &dev).unwrap();
        let g: Vec<f32> = rand_vec(b * t * hv, seed + 3)
            .iter()
            .map(|x| -0.005 - 0.6 * (x + 1.0))
            .collect();
        let beta: Vec<f32> = rand_vec(b * t * hv, seed + 4)
            .iter()
            .map(|x| 0.5 + 0.49 * x)
            .collect();
        Case {
            q: mk(l2(rand_vec(b * t * hk * dk, seed), dk), &[b, t, hk, dk]),
            k: mk(l2(rand_vec(b * t * hk * dk, seed + 1), dk), &[b, t, hk, dk]),
            v: mk(rand_vec(b * t * hv * dv, seed + 2), &[b, t, hv, dv]),
            g: mk(g, &[b, t, hv]),
            beta: mk(beta, &[b, t, hv]),
            s0: mk(rand_vec(b * hv * dk * dv, seed + 5), &[b, hv, dk, dv]),
        }
    }

    /// An independent naive reference in f64, in the matrix form
    /// `S_t = e^{g}(I − β k kᵀ) S_{t−1} + β k vᵀ`, `o_t = S_tᵀ q scale`.
    fn naive(c: &Case, scale: f64) -> (Vec<f64>, Vec<f64>) {
        let (b, t, hk, dk) = c.q.dims4().unwrap();
        let (_, _, hv, dv) = c.v.dims4().unwrap();
        let f = |x: &Tensor| x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (q, k, v, g, be, s0) = (f(&c.q), f(&c.k), f(&c.v), f(&c.g), f(&c.beta), f(&c.s0));
        let mut out = vec![0.0f64; b * t * hv * dv];
        let mut fin = vec![0.0f64; b * hv * dk * dv];
        for bi in 0..b {
            for h in 0..hv {
                let kh = h / (hv / hk);
                let mut s: Vec<f64> = s0[(bi * hv + h) * dk * dv..][..dk * dv]
                    .iter()
                    .map(|&x| x as f64)
                    .collect();
                for ti in 0..t {
                    let kt: Vec<f64> = k[((bi * t + ti) * hk + kh) * dk..][..dk]
                        .iter()
                        .map(|&x| x as f64)
                        .collect();
                    let qt: Vec<f64> = q[((bi * t + ti) * hk + kh) * dk..][..dk]
                        .iter()
                        .map(|&x| x as f64)
                        .collect();
                    let vt = &v[((bi * t + ti) * hv + h) * dv..][..dv];
                    let gi = (bi * t + ti) * hv + h;
                    let (e, bt) = ((g[gi] as f64).exp(), be[gi] as f64);
                    // (I − β k kᵀ) S
                    let mut ks = vec![0.0f64; dv];
                    for i in 0..dk {
                        for j in 0..dv {
                            ks[j] += kt[i] * s[i * dv + j];
                        }
                    }
                    for i in 0..dk {
                        for j in 0..dv {
                            s[i * dv + j] =
                                e * (s[i * dv + j] - bt * kt[i] * ks[j]) + bt * kt[i] * vt[j] as f64;
                        }
                    }
                    for j in 0..dv {
                        out[((bi * t + ti) * hv + h) * dv + j] =
                            (0..dk).map(|i| s[i * dv + j] * qt[i]).sum::<f64>() * scale;
                    }
                }
                fin[(bi * hv + h) * dk * dv..][..dk * dv].copy_from_slice(&s);
            }
        }
        (out, fin)
    }

    fn max_abs_diff(a: &Tensor, b: &[f64]) -> f64 {
        let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        a.iter()
            .zip(b)
            .map(|(x, y)| (*x as f64 - y).abs())
            .fold(0.0, f64::max)
    }

    use qwen36_testutil::max_abs_diff as max_diff;

    // f32 accumulation over ~150 steps of O(1) values: errors of a few 1e-6 are expected; 1e-5 bounds them.
    const TOL: f32 = 1e-5;

    #[test]
    fn recurrent_matches_naive_matrix_form() -> Result<()> {
        let c = case(2, 37, 2, 6, 8, 12, 11);
        let scale = 8f32.powf(-0.5);
        let r = recurrent_gated_delta_rule(c.inputs(), Some(&c.s0), scale, true, P)?;
        let (out, fin) = naive(&c, scale as f64);
        assert!(max_abs_diff(&r.out, &out) < TOL as f64);
        assert!(max_abs_diff(&r.state, &fin) < TOL as f64);
        // The last of the kept states is the final state; the first is the state after token 0.
        let all = r.all_states.expect("kept states");
        assert_eq!(all.dims(), &[2, 37, 6, 8, 12]);
        assert_eq!(max_diff(&all.narrow(1, 36, 1)?.squeeze(1)?, &r.state), 0.0);
        let one = recurrent_gated_delta_rule(
            DeltaRuleInputs::new(
                &c.q.narrow(1, 0, 1)?,
                &c.k.narrow(1, 0, 1)?,
                &c.v.narrow(1, 0, 1)?,
                &c.g.narrow(1, 0, 1)?,
                &c.beta.narrow(1, 0, 1)?,
            ),
            Some(&c.s0),
            scale,
            false,
            P,
        )?;
        assert_eq!(max_diff(&all.narrow(1, 0, 1)?.squeeze(1)?, &one.state), 0.0);
        Ok(())
    }

    #[test]
    fn chunked_matches_recurrent_for_lengths_around_chunks() -> Result<()> {
        // dk != dv, Hv/Hk = 3, lengths below, at and past chunk boundaries (150 = 2·64 + 22).
        for (t, seed) in [(1usize, 1u64), (63, 2), (64, 3), (65, 4), (150, 5)] {
            let c = case(1, t, 2, 6, 16, 24, seed);
            let scale = 16f32.powf(-0.5);
            let r = recurrent_gated_delta_rule(c.inputs(), Some(&c.s0), scale, false, P)?;
            let ch = chunked_gated_delta_rule(c.inputs(), Some(&c.s0), scale, CHUNK_SIZE, P)?;
            let (d_out, d_state) = (max_diff(&r.out, &ch.out), max_diff(&r.state, &ch.state));
            assert!(
                d_out < TOL && d_state < TOL,
                "T={t}: out {d_out}, state {d_state}"
            );
        }
        Ok(())
    }

    #[test]
    fn chunked_continues_from_its_own_state() -> Result<()> {
        let c = case(2, 100, 1, 2, 8, 8, 9);
        let scale = 0.35;
        let full = chunked_gated_delta_rule(c.inputs(), None, scale, 16, P)?;
        let part = |x: &Tensor, s, l| x.narrow(1, s, l).unwrap();
        let a = chunked_gated_delta_rule(
            DeltaRuleInputs::new(
                &part(&c.q, 0, 70),
                &part(&c.k, 0, 70),
                &part(&c.v, 0, 70),
                &part(&c.g, 0, 70),
                &part(&c.beta, 0, 70),
            ),
            None,
            scale,
            16,
            P,
        )?;
        let b = chunked_gated_delta_rule(
            DeltaRuleInputs::new(
                &part(&c.q, 70, 30),
                &part(&c.k, 70, 30),
                &part(&c.v, 70, 30),
                &part(&c.g, 70, 30),
                &part(&c.beta, 70, 30),
            ),
            Some(&a.state),
            scale,
            16,
            P,
        )?;
        assert!(max_diff(&Tensor::cat(&[&a.out, &b.out], 1)?, &full.out) < TOL);
        assert!(max_diff(&b.state, &full.state) < TOL);
        Ok(())
    }

    #[test]
    fn non_f32_state_is_refused() -> Result<()> {
        let c = case(1, 2, 1, 1, 4, 4, 1);
        let s = c.s0.to_dtype(DType::BF16)?;
        let err = recurrent_gated_delta_rule(c.inputs(), Some(&s), 0.5, false, P).unwrap_err();
        assert!(err.to_string().contains("must be f32"), "{err}");
        Ok(())
    }

    /// The in-place op refuses a state it cannot update in place (not f32, not contiguous) and one
    /// of the wrong shape, naming it; a good one is updated and handed back as the output's state.
    #[test]
    fn in_place_state_is_checked_and_updated() -> Result<()> {
        let dev = Device::Cpu;
        let heads = GdnHeads {
            k_heads: 1,
            v_heads: 2,
            k_dim: 4,
            v_dim: 4,
        };
        let qkv = qwen36_testutil::randn(301, 1.0, (1, 2, 2 * 4 + 2 * 4), &dev)?;
        let ab = qwen36_testutil::randn(302, 1.0, (1, 2, 2), &dev)?;
        let (a_log, dt_bias) = (
            Tensor::ones(2, DType::F32, &dev)?,
            Tensor::zeros(2, DType::F32, &dev)?,
        );
        let run = |s: &Tensor, all: Option<&Tensor>| {
            fused_gated_delta_rule_in_place(
                &qkv,
                &ab,
                &ab,
                GdnParams::new(&a_log, &dt_bias, heads),
                s,
                None,
                all,
                P,
            )
        };
        let s0 = qwen36_testutil::randn(303, 0.5, (1, 2, 4, 4), &dev)?;
        let err = run(&s0.to_dtype(DType::BF16)?, None).unwrap_err().to_string();
        assert!(err.contains("contiguous f32"), "{err}");
        let err = run(&s0.transpose(2, 3)?, None).unwrap_err().to_string();
        assert!(err.contains("contiguous f32"), "{err}");
        let err = run(&Tensor::zeros((1, 3, 4, 4), DType::F32, &dev)?, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("state"), "{err}");
        let want = fused_gated_delta_rule(
            &qkv,
            &ab,
            &ab,
            GdnParams::new(&a_log, &dt_bias, heads),
            Some(&s0),
            DeltaRuleMode::Recurrent {
                keep_all_states: true,
            },
            P,
        )?;
        let state = s0.copy()?;
        let got = run(&state, None)?;
        assert_eq!(got.state.id(), state.id());
        assert_eq!(max_diff(&state, &want.state), 0.0);
        assert_eq!(max_diff(&got.out, &want.out), 0.0);

        // Every token's state into a buffer of the caller's: it must fit and not be the state's.
        let err = run(
            &s0.copy()?,
            Some(&Tensor::zeros((1, 3, 2, 4, 4), DType::F32, &dev)?),
        )
        .unwrap_err();
        assert!(err.to_string().contains("all_states must be"), "{err}");
        let both = Tensor::zeros(3 * 32, DType::F32, &dev)?;
        let (aliased_state, aliased_all) = (
            both.narrow(0, 0, 32)?.reshape((1, 2, 4, 4))?,
            both.narrow(0, 32, 64)?.reshape((1, 2, 2, 4, 4))?,
        );
        let err = run(&aliased_state, Some(&aliased_all)).unwrap_err();
        assert!(err.to_string().contains("shares its buffer"), "{err}");
        let want_all = want.all_states.expect("kept");
        let all = Tensor::zeros((1, 2, 2, 4, 4), DType::F32, &dev)?;
        let got = run(&s0.copy()?, Some(&all))?;
        assert_eq!(got.all_states.map(|t| t.id()), Some(all.id()));
        assert_eq!(max_diff(&all, &want_all), 0.0);
        Ok(())
    }

    /// Over a pool, each sequence runs from and writes back only its slot's row, exactly as the
    /// op on those rows alone; the other rows keep their values; bad slot tables are refused.
    #[test]
    fn pooled_state_updates_only_its_slots() -> Result<()> {
        let dev = Device::Cpu;
        let heads = GdnHeads {
            k_heads: 1,
            v_heads: 2,
            k_dim: 4,
            v_dim: 4,
        };
        let (b, t) = (2, 3);
        let qkv = qwen36_testutil::randn(311, 1.0, (b, t, 2 * 4 + 2 * 4), &dev)?;
        let ab = qwen36_testutil::randn(312, 1.0, (b, t, 2), &dev)?;
        let (a_log, dt_bias) = (
            Tensor::ones(2, DType::F32, &dev)?,
            Tensor::zeros(2, DType::F32, &dev)?,
        );
        let layer = GdnParams::new(&a_log, &dt_bias, heads);
        let pool0 = qwen36_testutil::randn(313, 0.5, (5, 2, 4, 4), &dev)?;
        let slots = Tensor::new(&[4u32, 0], &dev)?;
        let own = pool0.index_select(&slots, 0)?;
        let mode = DeltaRuleMode::Recurrent {
            keep_all_states: true,
        };
        let want = fused_gated_delta_rule(&qkv, &ab, &ab, layer, Some(&own), mode, P)?;
        let pool = pool0.copy()?;
        let all = Tensor::zeros((b, t, 2, 4, 4), DType::F32, &dev)?;
        let got = fused_gated_delta_rule_in_place(&qkv, &ab, &ab, layer, &pool, Some(&slots), Some(&all), P)?;
        assert_eq!(got.state.id(), pool.id());
        assert_eq!(max_diff(&got.out, &want.out), 0.0);
        assert_eq!(max_diff(&pool.get(4)?, &want.state.get(0)?), 0.0);
        assert_eq!(max_diff(&pool.get(0)?, &want.state.get(1)?), 0.0);
        for untouched in 1..4 {
            assert_eq!(max_diff(&pool.get(untouched)?, &pool0.get(untouched)?), 0.0);
        }
        assert_eq!(max_diff(&all, &want.all_states.expect("kept")), 0.0);
        for (bad, msg) in [
            (Tensor::new(&[5u32, 0], &dev)?, "outside the pool"),
            (Tensor::new(&[1u32, 1], &dev)?, "used twice"),
            (Tensor::new(&[1u32, 2, 3], &dev)?, "slots must be u32 [2]"),
        ] {
            let err = fused_gated_delta_rule_in_place(&qkv, &ab, &ab, layer, &pool, Some(&bad), None, P)
                .unwrap_err();
            assert!(err.to_string().contains(msg), "{err}");
        }
        Ok(())
    }

    /// Deferred commits over a pool (CPU): a verify returns what the plain recurrent pass gives
    /// and leaves its slots' states as they were; the next pass, replaying the first `n` of each
    /// slot's stashed tokens, runs from exactly the state after them (bits), and so does a
    /// replay alone; other rows stay; replays past the stash and verifies longer than it are
    /// refused by name.
    #[test]
    fn deferred_commits_replay_exactly_the_accepted_tokens() -> Result<()> {
        let dev = Device::Cpu;
        let heads = GdnHeads {
            k_heads: 1,
            v_heads: 2,
            k_dim: 4,
            v_dim: 4,
        };
        let width = 2 * 4 + 2 * 4;
        let (b, t) = (2, 3);
        let qkv = qwen36_testutil::randn(321, 1.0, (b, t, width), &dev)?;
        let ab = qwen36_testutil::randn(322, 1.0, (b, t, 4), &dev)?;
        let (ga, gb) = (ab.narrow(2, 0, 2)?, ab.narrow(2, 2, 2)?);
        let (a_log, dt_bias) = (
            Tensor::new(&[0.3f32, -0.2], &dev)?,
            Tensor::new(&[0.1f32, 0.4], &dev)?,
        );
        let layer = GdnParams::new(&a_log, &dt_bias, heads);
        let pool0 = qwen36_testutil::randn(323, 0.5, (5, 2, 4, 4), &dev)?;
        let slots = Tensor::new(&[4u32, 0], &dev)?;
        let pool = pool0.copy()?;
        let stash = new_stash(&pool, 4, heads, DType::F32)?;
        let verify = |qkv: &Tensor, ga: &Tensor, gb: &Tensor, replay: &[u32], verify: bool| {
            let replay = Tensor::new(replay, &dev)?;
            let d = crate::Deferred {
                slots: &slots,
                replay: &replay,
                stash: &stash,
                verify,
            };
            fused_gated_delta_rule_pooled(qkv, ga, gb, layer, &pool, &d, P)
        };
        let all = DeltaRuleMode::Recurrent {
            keep_all_states: true,
        };
        let want = fused_gated_delta_rule(
            &qkv,
            &ga,
            &gb,
            layer,
            Some(&pool0.index_select(&slots, 0)?),
            all,
            P,
        )?;
        let out = verify(&qkv, &ga, &gb, &[0, 0], true)?;
        assert_eq!(max_diff(&out, &want.out), 0.0);
        assert_eq!(max_diff(&pool, &pool0), 0.0, "a verify leaves the states");
        // The next pass (a decode token) keeps 2 of slot 4's verified tokens and all 3 of slot 0's.
        let keep = [2usize, 3];
        let qkv2 = qwen36_testutil::randn(324, 1.0, (b, 1, width), &dev)?;
        let ab2 = qwen36_testutil::randn(325, 1.0, (b, 1, 4), &dev)?;
        let (ga2, gb2) = (ab2.narrow(2, 0, 2)?, ab2.narrow(2, 2, 2)?);
        let out2 = verify(&qkv2, &ga2, &gb2, &[2, 3], false)?;
        let plain = DeltaRuleMode::Recurrent {
            keep_all_states: false,
        };
        let states = want.all_states.expect("kept");
        for (i, (&k, slot)) in keep.iter().zip([4, 0]).enumerate() {
            let after = states.get(i)?.get(k - 1)?.unsqueeze(0)?;
            let row = |x: &Tensor| x.narrow(0, i, 1);
            let r = fused_gated_delta_rule(
                &row(&qkv2)?,
                &row(&ga2)?,
                &row(&gb2)?,
                layer,
                Some(&after),
                plain,
                P,
            )?;
            assert_eq!(max_diff(&out2.narrow(0, i, 1)?, &r.out), 0.0, "row {i}");
            assert_eq!(max_diff(&pool.get(slot)?, &r.state.get(0)?), 0.0, "slot {slot}");
        }
        for untouched in 1..4 {
            assert_eq!(max_diff(&pool.get(untouched)?, &pool0.get(untouched)?), 0.0);
        }
        // A verify, then its first token alone applied by a replay.
        let before = pool.copy()?;
        let out3 = verify(&qkv, &ga, &gb, &[0, 0], true)?;
        let want3 = fused_gated_delta_rule(
            &qkv,
            &ga,
            &gb,
            layer,
            Some(&before.index_select(&slots, 0)?),
            all,
            P,
        )?;
        assert_eq!(max_diff(&out3, &want3.out), 0.0);
        replay_pooled(layer, &pool, &stash, &slots, &Tensor::new(&[1u32, 1], &dev)?, P)?;
        let states = want3.all_states.expect("kept");
        for (i, slot) in [4usize, 0].into_iter().enumerate() {
            assert_eq!(
                max_diff(&pool.get(slot)?, &states.get(i)?.get(0)?),
                0.0,
                "slot {slot}"
            );
        }
        let err = verify(&qkv2, &ga2, &gb2, &[5, 0], false).unwrap_err();
        assert!(
            err.to_string()
                .contains("cannot replay 5 tokens from a stash of 4"),
            "{err}"
        );
        let long = qwen36_testutil::randn(326, 1.0, (b, 5, width), &dev)?;
        let ab5 = qwen36_testutil::randn(327, 1.0, (b, 5, 4), &dev)?;
        let err = verify(&long, &ab5.narrow(2, 0, 2)?, &ab5.narrow(2, 2, 2)?, &[0, 0], true).unwrap_err();
        assert!(
            err.to_string()
                .contains("a verify of 5 tokens does not fit a stash of 4"),
            "{err}"
        );
        Ok(())
    }
}
