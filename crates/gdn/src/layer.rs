//! The GDN layer: projections → causal conv → gates → gated delta rule → gated norm → out_proj.

use candle_core::{DType, Tensor, D};
use qwen36_kernels::{
    conv1d::{
        causal_conv1d, causal_conv1d_in_place, causal_conv1d_pooled, new_stash as new_conv_stash,
        replay_pooled as conv1d_replay_pooled,
    },
    delta_rule::{
        fused_gated_delta_rule, fused_gated_delta_rule_in_place, fused_gated_delta_rule_pooled,
        new_stash as new_delta_rule_stash, replay_pooled as delta_rule_replay_pooled, DeltaRuleMode,
        GdnHeads, GdnParams,
    },
    linear::{Linear, LinearWeight},
    norm::{GatedRmsNorm, RmsNorm, Stream},
    Deferred, KernelPolicy,
};

use crate::{Error, GdnConfig, GdnState, Result};

/// What a verify pass keeps to roll back to any accepted prefix: the recurrent state after every
/// token and the raw conv inputs, from which the conv window after any token is a slice.
#[derive(Debug, Clone)]
pub struct VerifyCheckpoints {
    /// `[batch, len, Hv, dk, dv]` f32: the state after token `i` at index `i`.
    pub(crate) states: Tensor,
    /// `[batch, conv_dim, K-1 + len]`: the conv window before the call, then the new raw inputs.
    pub(crate) window: Tensor,
    /// Tokens the state had seen before the verify pass.
    pub(crate) seen_before: usize,
}

impl VerifyCheckpoints {
    /// A private copy (own buffers): a place to keep checkpoints that a recorded CUDA graph
    /// rewrites on every replay.
    pub fn deep_copy(&self) -> Result<Self> {
        // Contiguous buffers of their own (`copy` alone would keep a view's strides).
        let own = |t: &Tensor| -> Result<Tensor> {
            Ok(if t.is_contiguous() {
                t.copy()?
            } else {
                t.contiguous()?
            })
        };
        Ok(Self {
            states: own(&self.states)?,
            window: own(&self.window)?,
            seen_before: self.seen_before,
        })
    }

    /// Copies the tensors of `self` into the buffers of `dst` (same shapes), in place; a tensor
    /// that already is `dst`'s (checkpoints written into an in-place state's own buffers) is not
    /// copied.
    pub fn write_into(&self, dst: &Self) -> Result<()> {
        if self.states.id() != dst.states.id() {
            dst.states.slice_set(&self.states.contiguous()?, 0, 0)?;
        }
        if self.window.id() != dst.window.id() {
            dst.window.slice_set(&self.window.contiguous()?, 0, 0)?;
        }
        Ok(())
    }

    /// The same tensors (shared) for a pass that started after `seen_before` tokens.
    pub fn rebased(&self, seen_before: usize) -> Self {
        Self {
            seen_before,
            ..self.clone()
        }
    }

    /// Checkpoint buffers for a verify of `states: [batch, len, Hv, dk, dv]` f32 and `window:
    /// [batch, conv_dim, K-1 + len]` that the pass fills (kept across passes, e.g. by a recorded
    /// CUDA graph, instead of fresh ones each pass).
    pub fn from_buffers(states: Tensor, window: Tensor) -> Result<Self> {
        let fits = states.rank() == 5
            && states.dtype() == DType::F32
            && window.rank() == 3
            && states.is_contiguous()
            && window.is_contiguous()
            && states.dim(0)? == window.dim(0)?
            && window.dim(2)? > states.dim(1)?;
        if !fits {
            return Err(Error::State(format!(
                "checkpoint buffers are contiguous f32 states [batch, len, Hv, dk, dv] and a window \
                 [batch, conv_dim, K-1 + len]; found {:?} {:?} and {:?}",
                states.dims(),
                states.dtype(),
                window.dims()
            )));
        }
        Ok(Self {
            states,
            window,
            seen_before: 0,
        })
    }

    /// Batch member `i`'s checkpoints alone (views, batch 1).
    pub fn member(&self, i: usize) -> Result<Self> {
        Ok(Self {
            states: self.states.narrow(0, i, 1)?,
            window: self.window.narrow(0, i, 1)?,
            seen_before: self.seen_before,
        })
    }

    /// The state after the first `keep` tokens (1..=len): the conv window `[batch, conv_dim,
    /// K-1]` and the recurrent state `[batch, Hv, dk, dv]` f32, exactly as running only those
    /// tokens would leave them.
    pub fn state_after(&self, keep: usize) -> Result<(Tensor, Tensor)> {
        let n = self.len();
        if keep == 0 || keep > n {
            return Err(Error::State(format!(
                "cannot keep {keep} of the {n} verified tokens (need 1..={n})"
            )));
        }
        let hist = self.window.dim(2)? - n;
        let recurrent = self.states.narrow(1, keep - 1, 1)?.squeeze(1)?;
        Ok((self.window.narrow(2, keep, hist)?, recurrent))
    }

    /// The states after each token, `[batch, len, Hv, dk, dv]` f32.
    pub fn states(&self) -> &Tensor {
        &self.states
    }

    /// The raw conv window, `[batch, conv_dim, K-1 + len]`: the K-1 inputs held before the pass,
    /// then its new ones (the window after keeping `keep` tokens is columns `keep..keep + K-1`).
    pub fn window(&self) -> &Tensor {
        &self.window
    }

    /// Tokens the state had seen before the verify pass.
    pub fn seen_before(&self) -> usize {
        self.seen_before
    }

    /// Tokens the verify pass ran.
    pub fn len(&self) -> usize {
        self.states.dim(1).unwrap_or(0)
    }

    /// True when the pass ran no token.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The weights of one GDN layer in the Qwen3.5/3.6 flat layout (`[out, in]` linears, no biases;
/// the projections dense or FP8 as the checkpoint holds them).
#[derive(Debug, Clone)]
pub struct GdnWeights {
    /// `[2·Hk·dk + Hv·dv, hidden]`: rows `[Q all | K all | V all]`.
    pub in_proj_qkv: LinearWeight,
    /// `[Hv·dv, hidden]`: the output gate z.
    pub in_proj_z: LinearWeight,
    /// `[Hv, hidden]`: β logits.
    pub in_proj_b: LinearWeight,
    /// `[Hv, hidden]`: decay-rate input a.
    pub in_proj_a: LinearWeight,
    /// `[conv_dim, 1, K]`: depthwise conv, no bias.
    pub conv1d: Tensor,
    /// `[Hv]`: `log A`.
    pub a_log: Tensor,
    /// `[Hv]`: added to a before softplus.
    pub dt_bias: Tensor,
    /// `[dv]`: gated RMSNorm weight (plain, not 1+w).
    pub norm: Tensor,
    /// `[hidden, Hv·dv]`.
    pub out_proj: LinearWeight,
}

impl GdnWeights {
    /// Checkpoint names (relative to the layer's `linear_attn.`) and expected shapes.
    pub fn shapes(cfg: &GdnConfig) -> [(&'static str, Vec<usize>); 9] {
        let (h, hv) = (cfg.hidden_size, cfg.num_v_heads);
        [
            ("in_proj_qkv.weight", vec![cfg.conv_dim(), h]),
            ("in_proj_z.weight", vec![cfg.value_dim(), h]),
            ("in_proj_b.weight", vec![hv, h]),
            ("in_proj_a.weight", vec![hv, h]),
            ("conv1d.weight", vec![cfg.conv_dim(), 1, cfg.conv_kernel]),
            ("A_log", vec![hv]),
            ("dt_bias", vec![hv]),
            ("norm.weight", vec![cfg.v_head_dim]),
            ("out_proj.weight", vec![h, cfg.value_dim()]),
        ]
    }

    /// Fetches every weight through `get(name, expected_shape)` (names as in [`Self::shapes`]),
    /// the projections as dense weights.
    pub fn load<E>(
        cfg: &GdnConfig,
        mut get: impl FnMut(&'static str, &[usize]) -> std::result::Result<Tensor, E>,
    ) -> std::result::Result<Self, E> {
        let dense = std::cell::RefCell::new(&mut get);
        Self::load_with(
            cfg,
            |name, shape| (*dense.borrow_mut())(name, shape),
            |name, shape| Ok(LinearWeight::Dense((*dense.borrow_mut())(name, shape)?)),
        )
    }

    /// Fetches the projections through `linear(name, expected_shape)` (dense or FP8, as the
    /// checkpoint holds them) and the other weights through `get` (names as in [`Self::shapes`]).
    pub fn load_with<E>(
        cfg: &GdnConfig,
        mut get: impl FnMut(&'static str, &[usize]) -> std::result::Result<Tensor, E>,
        mut linear: impl FnMut(&'static str, &[usize]) -> std::result::Result<LinearWeight, E>,
    ) -> std::result::Result<Self, E> {
        let [qkv, z, b, a, conv, alog, dt, norm, out] = Self::shapes(cfg);
        Ok(Self {
            in_proj_qkv: linear(qkv.0, &qkv.1)?,
            in_proj_z: linear(z.0, &z.1)?,
            in_proj_b: linear(b.0, &b.1)?,
            in_proj_a: linear(a.0, &a.1)?,
            conv1d: get(conv.0, &conv.1)?,
            a_log: get(alog.0, &alog.1)?,
            dt_bias: get(dt.0, &dt.1)?,
            norm: get(norm.0, &norm.1)?,
            out_proj: linear(out.0, &out.1)?,
        })
    }

    fn check(&self, cfg: &GdnConfig) -> Result<()> {
        let got = [
            self.in_proj_qkv.dims(),
            self.in_proj_z.dims(),
            self.in_proj_b.dims(),
            self.in_proj_a.dims(),
            self.conv1d.dims().to_vec(),
            self.a_log.dims().to_vec(),
            self.dt_bias.dims().to_vec(),
            self.norm.dims().to_vec(),
            self.out_proj.dims(),
        ];
        for ((name, expected), found) in Self::shapes(cfg).into_iter().zip(got) {
            if found != expected {
                return Err(Error::WeightShape {
                    name,
                    expected,
                    found,
                });
            }
        }
        Ok(())
    }
}

/// One Gated DeltaNet layer. Input is the already-normalised hidden state `[batch, len, hidden]`.
#[derive(Debug, Clone)]
pub struct GatedDeltaNet {
    cfg: GdnConfig,
    /// `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` stacked: one read of the weights for
    /// all four projections of the same input; the output splits at `conv_dim`, `+ value_dim`,
    /// `+ Hv`.
    in_proj: Linear,
    /// `[conv_dim, K]`.
    conv_weight: Tensor,
    /// f32 `[Hv]`.
    a_log: Tensor,
    /// f32 `[Hv]`.
    dt_bias: Tensor,
    norm: GatedRmsNorm,
    out_proj: Linear,
    policy: KernelPolicy,
}

impl GatedDeltaNet {
    /// Builds the layer, checking every weight's shape against `cfg`.
    pub fn new(cfg: GdnConfig, w: GdnWeights) -> Result<Self> {
        if cfg.num_k_heads == 0 || cfg.num_v_heads % cfg.num_k_heads != 0 || cfg.conv_kernel < 2 {
            return Err(Error::Input(format!(
                "bad GDN config: v_heads {} must be a multiple of k_heads {} and conv kernel {} >= 2",
                cfg.num_v_heads, cfg.num_k_heads, cfg.conv_kernel
            )));
        }
        w.check(&cfg)?;
        Ok(Self {
            cfg,
            in_proj: Linear::fused(
                [w.in_proj_qkv, w.in_proj_z, w.in_proj_b, w.in_proj_a]
                    .into_iter()
                    .map(|w| Linear::from_weight(w, None))
                    .collect(),
            )?,
            conv_weight: w.conv1d.squeeze(1)?,
            a_log: w.a_log.to_dtype(DType::F32)?,
            dt_bias: w.dt_bias.to_dtype(DType::F32)?,
            norm: GatedRmsNorm::new(&w.norm, cfg.rms_norm_eps)?,
            out_proj: Linear::from_weight(w.out_proj, None),
            policy: KernelPolicy::DEFAULT,
        })
    }

    /// The layer as a tensor-parallel rank's part other than the first: its output projection
    /// gives a partial sum without the residual ([`Linear::partial_sum`]).
    pub fn partial_sum(self) -> Self {
        Self {
            out_proj: self.out_proj.partial_sum(),
            ..self
        }
    }

    /// The layer with every CUDA kernel of it (projections, conv, delta rule, norm) chosen and
    /// launched under `policy`.
    pub fn with_policy(self, policy: KernelPolicy) -> Self {
        Self {
            in_proj: self.in_proj.with_policy(policy),
            norm: self.norm.with_policy(policy),
            out_proj: self.out_proj.with_policy(policy),
            policy,
            ..self
        }
    }

    /// Whether its input and output projections hold FP8 weights.
    pub fn projections_fp8(&self) -> bool {
        self.in_proj.is_fp8() && self.out_proj.is_fp8()
    }

    /// The policy its CUDA kernels run under.
    pub fn policy(&self) -> &KernelPolicy {
        &self.policy
    }

    /// The layer's sizes.
    pub fn config(&self) -> &GdnConfig {
        &self.cfg
    }

    /// A fresh state for `batch` sequences, conv window in `dtype` (the activation dtype).
    pub fn new_state(&self, batch: usize, dtype: DType, state_dtype: DType) -> Result<GdnState> {
        GdnState::new(&self.cfg, batch, dtype, state_dtype, self.conv_weight.device())
    }

    /// Runs `x: [batch, len, hidden]` from `state` and advances it. One token uses the recurrent
    /// form; several use the chunked form (like the reference). Returns `[batch, len, hidden]`.
    pub fn forward(&self, x: &Tensor, state: &mut GdnState) -> Result<Tensor> {
        let (y, _) = self.run(&Stream::new(x.clone()), None, state, false)?;
        Ok(y.x)
    }

    /// The pre-norm residual block around the layer: `x + forward(norm(x))` for the residual
    /// stream `x` (its normalisation taken from the stream when it comes with it), as the stream
    /// entering the block whose norm is `next` ([`Linear::forward_add_norm`]). The input
    /// projection normalises `x` as it reads it and the output projection adds `x` as it writes,
    /// where the kernels allow (CUDA, one row), saving two passes.
    pub fn forward_block(
        &self,
        x: &Stream,
        norm: &RmsNorm,
        next: Option<&RmsNorm>,
        state: &mut GdnState,
    ) -> Result<Stream> {
        let (y, _) = self.run(x, Some((norm, next)), state, false)?;
        Ok(y)
    }

    /// Speculative verify: like [`Self::forward`] over the `len = k + 1` tokens, but token by token
    /// (the recurrent form, as plain decoding does) keeping the state after every token, so that
    /// [`GdnState::commit`] can restore the state after any accepted prefix exactly, without
    /// recomputing a projection. The state is left after the last token.
    pub fn forward_verify(&self, x: &Tensor, state: &mut GdnState) -> Result<(Tensor, VerifyCheckpoints)> {
        let (y, cp) = self.run(&Stream::new(x.clone()), None, state, true)?;
        Ok((y.x, cp.expect("verify keeps checkpoints")))
    }

    /// [`Self::forward_verify`] as the pre-norm residual block (see [`Self::forward_block`]).
    pub fn forward_verify_block(
        &self,
        x: &Stream,
        norm: &RmsNorm,
        next: Option<&RmsNorm>,
        state: &mut GdnState,
    ) -> Result<(Stream, VerifyCheckpoints)> {
        let (y, cp) = self.run(x, Some((norm, next)), state, true)?;
        Ok((y, cp.expect("verify keeps checkpoints")))
    }

    /// The residual block over a flat batch of several sequences: `x: [1, rows, hidden]` holds
    /// each group's rows in order (a group: `batch` sequences of `len` tokens, sequence-major), the
    /// projections read all rows at once and each group's conv and delta rule run from its states
    /// (its own, or rows of pools: [`GroupState`]), as [`Self::forward_block`] (or with `verify`,
    /// [`Self::forward_verify_block`]) runs them. Returns `[1, rows, hidden]` (as the stream
    /// entering the block whose norm is `next`) and, per group, its checkpoints when it verifies.
    pub fn forward_groups_block(
        &self,
        x: &Stream,
        norm: &RmsNorm,
        next: Option<&RmsNorm>,
        groups: &mut [GdnGroup<'_>],
    ) -> Result<(Stream, Vec<Option<VerifyCheckpoints>>)> {
        let (b, n, _) = self.check_input(&x.x)?;
        let rows: usize = groups.iter().map(|g| g.batch * g.len).sum();
        if b != 1 || rows != n || groups.iter().any(|g| g.batch * g.len == 0) {
            return Err(Error::Input(format!(
                "a flat batch is [1, rows, hidden] with non-empty groups covering its rows; found \
                 {:?} for groups of {rows} rows",
                x.x.dims()
            )));
        }
        // Every group's states are checked before any is advanced: an error leaves them all as
        // they were.
        for g in groups.iter() {
            match &g.state {
                GroupState::Own(state) => {
                    self.check_states(state.conv(), state.recurrent(), Some(g.batch), x.x.dtype())?
                }
                GroupState::Pooled {
                    conv,
                    recurrent,
                    slots,
                    ..
                } => self.check_pools((conv, recurrent, slots), g.batch, x.x.dtype())?,
            }
        }
        let proj = self.project(x, Some(norm))?;
        let (mut outs, mut checkpoints) = (Vec::with_capacity(groups.len()), Vec::new());
        let mut row = 0;
        for g in groups.iter_mut() {
            let part = proj.rows(row, g.batch, g.len)?;
            let (out, cp) = match &mut g.state {
                GroupState::Own(state) => self.mix(&part, state, g.verify)?,
                GroupState::Pooled {
                    conv,
                    recurrent,
                    slots,
                    stash,
                } => (
                    self.mix_pooled(&part, (conv, recurrent, slots), g.verify, stash.as_ref())?,
                    None,
                ),
            };
            let (_, _, hv, dv) = out.dims4()?;
            outs.push(out.reshape((1, g.batch * g.len, hv, dv))?);
            checkpoints.push(cp);
            row += g.batch * g.len;
        }
        let out = Tensor::cat(&outs, 1)?;
        Ok((self.finish(x, &proj, &out, Some(next))?, checkpoints))
    }

    /// Checks states of this layer over activations of `dtype`: conv windows `[rows, conv_dim,
    /// K-1]` in `dtype` and recurrent states `[rows, Hv, dk, dv]`, with `rows` the sequences'
    /// count (`Some`) or, for pools (`None`), any count the two share; so that a pass fails before
    /// it writes anything.
    fn check_states(
        &self,
        conv: &Tensor,
        recurrent: &Tensor,
        rows: Option<usize>,
        dtype: DType,
    ) -> Result<()> {
        let c = &self.cfg;
        let n = rows.unwrap_or_else(|| conv.dims().first().copied().unwrap_or(0));
        let want_conv = [n, c.conv_dim(), c.conv_kernel - 1];
        let want_rec = [n, c.num_v_heads, c.k_head_dim, c.v_head_dim];
        let what = if rows.is_some() { "state" } else { "pool" };
        if conv.dims() != want_conv || conv.dtype() != dtype {
            return Err(Error::State(format!(
                "conv {what} {:?} {:?} does not fit this layer over {dtype:?} activations (want \
                 {want_conv:?} {dtype:?})",
                conv.dims(),
                conv.dtype(),
            )));
        }
        if recurrent.dims() != want_rec {
            return Err(Error::State(format!(
                "recurrent {what} {:?} does not fit this layer (want {want_rec:?})",
                recurrent.dims(),
            )));
        }
        Ok(())
    }

    /// [`Self::check_states`] for pools and their `slots`, u32 `[rows]`.
    fn check_pools(
        &self,
        (conv, recurrent, slots): (&Tensor, &Tensor, &Tensor),
        rows: usize,
        dtype: DType,
    ) -> Result<()> {
        self.check_states(conv, recurrent, None, dtype)?;
        if slots.dims() != [rows] || slots.dtype() != DType::U32 {
            return Err(Error::State(format!(
                "slots {:?} {:?} for {rows} sequences (want [{rows}] u32)",
                slots.dims(),
                slots.dtype()
            )));
        }
        Ok(())
    }

    /// Checks `x: [batch, len > 0, hidden]`; returns its dims.
    fn check_input(&self, x: &Tensor) -> Result<(usize, usize, usize)> {
        let c = &self.cfg;
        match x.dims3() {
            Ok((b, t, h)) if h == c.hidden_size && t > 0 => Ok((b, t, h)),
            _ => Err(Error::Input(format!(
                "expected [batch, len>0, {}], found {:?}",
                c.hidden_size,
                x.dims()
            ))),
        }
    }

    /// The layer on `x`, or with `block` (its norm, the next block's) the residual block around
    /// it, as the stream entering the next block.
    fn run(
        &self,
        x: &Stream,
        block: Option<(&RmsNorm, Option<&RmsNorm>)>,
        state: &mut GdnState,
        verify: bool,
    ) -> Result<(Stream, Option<VerifyCheckpoints>)> {
        self.check_input(&x.x)?;
        let proj = self.project(x, block.map(|(norm, _)| norm))?;
        let (out, checkpoints) = self.mix(&proj, state, verify)?;
        Ok((
            self.finish(x, &proj, &out, block.map(|(_, next)| next))?,
            checkpoints,
        ))
    }

    /// The input projection of `x` (with `norm`, of `norm(x)`: the stream's own normalisation
    /// when it has one, else normalised as the projection reads it).
    fn project(&self, x: &Stream, norm: Option<&RmsNorm>) -> Result<Proj> {
        Proj::new(self.in_proj.forward_parts_stream(x, norm)?)
    }

    /// The conv and the delta rule of `proj: [batch, len, qkv|z|b|a]` (the input projection's
    /// output) from `state`, which it advances. Returns the read-out `[batch, len, Hv, dv]` f32
    /// and, with `verify`, the checkpoints.
    fn mix(
        &self,
        proj: &Proj,
        state: &mut GdnState,
        verify: bool,
    ) -> Result<(Tensor, Option<VerifyCheckpoints>)> {
        let c = &self.cfg;
        let (b, t) = proj.batch_len();
        let (cd, vd, hv) = (c.conv_dim(), c.value_dim(), c.num_v_heads);
        let mixed = proj.cols(0, cd)?;
        self.check_states(state.conv(), state.recurrent(), Some(b), mixed.dtype())?;
        let beta_logits = proj.cols(cd + vd, hv)?;
        let a = proj.cols(cd + vd + hv, hv)?;

        // States kept in place (the buffers a CUDA graph recorded) are written by the kernels
        // themselves for decode and verify passes, and a verify's checkpoints go straight into
        // the state's checkpoint buffers; otherwise the new states are fresh tensors that
        // `GdnState::update` stores. A verify pass keeps the raw conv inputs (window): the K-1
        // held before this call, then the t new ones.
        let in_place = state.in_place() && (verify || t == 1);
        let kept = if in_place && verify {
            state.checkpoint_buffers(t)?
        } else {
            None
        };
        let (conv_out, conv_state, window) = if in_place {
            let window = kept.as_ref().map(|cp| &cp.window);
            let y = causal_conv1d_in_place(
                &mixed,
                &self.conv_weight,
                state.conv(),
                None,
                window,
                &self.policy,
            )?;
            (y, state.conv().clone(), window.cloned())
        } else {
            let window = if verify {
                Some(Tensor::cat(&[state.conv(), &mixed.transpose(1, 2)?], 2)?)
            } else {
                None
            };
            let (y, s) = causal_conv1d(&mixed, &self.conv_weight, Some(state.conv()), &self.policy)?;
            (y, s, window)
        };
        let heads = self.heads();
        // Like the reference: one token uses the recurrent form, several the chunked form; a
        // verify pass runs token by token and keeps every state.
        let mode = if verify || t == 1 {
            DeltaRuleMode::Recurrent {
                keep_all_states: verify,
            }
        } else {
            DeltaRuleMode::Chunked
        };
        let r = if in_place {
            fused_gated_delta_rule_in_place(
                &conv_out,
                &a,
                &beta_logits,
                GdnParams::new(&self.a_log, &self.dt_bias, heads),
                state.recurrent(),
                None,
                kept.as_ref().map(|cp| &cp.states),
                &self.policy,
            )?
        } else {
            fused_gated_delta_rule(
                &conv_out,
                &a,
                &beta_logits,
                GdnParams::new(&self.a_log, &self.dt_bias, heads),
                Some(state.recurrent()),
                mode,
                &self.policy,
            )?
        };
        let checkpoints = match (window, r.all_states) {
            (Some(window), Some(states)) => Some(VerifyCheckpoints {
                window,
                states,
                seen_before: state.seen(),
            }),
            _ => None,
        };
        state.update(conv_state, r.state, t)?;
        Ok((r.out, checkpoints))
    }

    /// [`Self::mix`] for sequences whose states are rows `slots` (u32 `[batch]`) of pools (conv
    /// windows `[pool, conv_dim, K-1]` in the activation dtype, recurrent states `[pool, Hv, dk,
    /// dv]` f32), which the kernels read and write in place: one token per sequence, or with
    /// `verify` any number, token by token. With a `stash` the commits are deferred
    /// ([`qwen36_kernels::Deferred`]): each slot first takes its replayed tokens, and a verify
    /// leaves the state there and stashes its own (a verify needs a stash). The same kernels
    /// and sums as [`Self::mix`] on the gathered rows.
    fn mix_pooled(
        &self,
        proj: &Proj,
        (conv, recurrent, slots): (&Tensor, &Tensor, &Tensor),
        verify: bool,
        stash: Option<&PoolStash>,
    ) -> Result<Tensor> {
        let c = &self.cfg;
        let (_, t) = proj.batch_len();
        if t != 1 && !verify {
            return Err(Error::Input(format!(
                "pooled states run decode steps and verifies; a prefill of {t} tokens runs from its own state"
            )));
        }
        let (cd, vd, hv) = (c.conv_dim(), c.value_dim(), c.num_v_heads);
        let mixed = proj.cols(0, cd)?;
        let beta_logits = proj.cols(cd + vd, hv)?;
        let a = proj.cols(cd + vd + hv, hv)?;
        self.check_pools((conv, recurrent, slots), proj.batch_len().0, mixed.dtype())?;
        let params = GdnParams::new(&self.a_log, &self.dt_bias, self.heads());
        let Some(stash) = stash else {
            if verify {
                return Err(Error::State(
                    "a verify over pooled states needs the pool's stash (its commits are deferred)".into(),
                ));
            }
            let conv_out =
                causal_conv1d_in_place(&mixed, &self.conv_weight, conv, Some(slots), None, &self.policy)?;
            let r = fused_gated_delta_rule_in_place(
                &conv_out,
                &a,
                &beta_logits,
                params,
                recurrent,
                Some(slots),
                None,
                &self.policy,
            )?;
            return Ok(r.out);
        };
        let deferred = |of| Deferred {
            slots,
            replay: stash.replay,
            stash: of,
            verify,
        };
        let conv_out = causal_conv1d_pooled(
            &mixed,
            &self.conv_weight,
            conv,
            &deferred(stash.conv),
            &self.policy,
        )?;
        Ok(fused_gated_delta_rule_pooled(
            &conv_out,
            &a,
            &beta_logits,
            params,
            recurrent,
            &deferred(stash.recurrent),
            &self.policy,
        )?)
    }

    /// Applies each slot's deferred commits alone (no new tokens): the pools' rows `slots` take
    /// `stash.replay` of their stashed tokens, as the next pass over them would.
    pub fn replay_pooled(
        &self,
        (conv, recurrent, slots): (&Tensor, &Tensor, &Tensor),
        stash: &PoolStash,
    ) -> Result<()> {
        conv1d_replay_pooled(conv, stash.conv, slots, stash.replay, &self.policy)?;
        let params = GdnParams::new(&self.a_log, &self.dt_bias, self.heads());
        delta_rule_replay_pooled(
            params,
            recurrent,
            stash.recurrent,
            slots,
            stash.replay,
            &self.policy,
        )?;
        Ok(())
    }

    /// The stashes of pools of this layer's states (`conv` windows, `recurrent` states) for
    /// verifies of up to `tokens` tokens over activations of `dtype`: the conv's and the delta
    /// rule's ([`PoolStash`]).
    pub fn new_pool_stash(
        &self,
        conv: &Tensor,
        recurrent: &Tensor,
        tokens: usize,
        dtype: DType,
    ) -> Result<(Tensor, Tensor)> {
        Ok((
            new_conv_stash(conv, tokens)?,
            new_delta_rule_stash(recurrent, tokens, self.heads(), dtype)?,
        ))
    }

    /// The head layout of the delta rule.
    fn heads(&self) -> GdnHeads {
        let c = &self.cfg;
        GdnHeads {
            k_heads: c.num_k_heads,
            v_heads: c.num_v_heads,
            k_dim: c.k_head_dim,
            v_dim: c.v_head_dim,
        }
    }

    /// The gated norm of the read-out `out: [batch, len, Hv, dv]` with the z part of `proj`, and
    /// the output projection (with `block`, adding the residual stream `x` as the stream entering
    /// the block of the norm it holds).
    fn finish(
        &self,
        x: &Stream,
        proj: &Proj,
        out: &Tensor,
        block: Option<Option<&RmsNorm>>,
    ) -> Result<Stream> {
        let c = &self.cfg;
        let (b, t, _) = x.x.dims3()?;
        let (cd, vd) = (c.conv_dim(), c.value_dim());
        // z stays a view of the projection ([b, t, hv·dv]); the norm reads it per head.
        let z = proj.cols(cd, vd)?;
        let y = self.norm.forward(out, &z, x.x.dtype())?.reshape((b, t, vd))?;
        Ok(match block {
            Some(next) => self.out_proj.forward_add_norm(&y, &x.x, next)?,
            None => Stream::new(self.out_proj.forward(&y)?),
        })
    }
}

/// The input projection's output `[batch, len, qkv|z|b|a]` as its parts gave it
/// ([`Linear::forward_parts`]: one tensor, or an FP8 part beside a dense one), so that the
/// layer's views of it (`cols`) need no concatenation.
struct Proj(Vec<Tensor>);

impl Proj {
    /// Parts of the same `[batch, len, _]`.
    fn new(parts: Vec<Tensor>) -> Result<Self> {
        let dims: Vec<(usize, usize)> = parts
            .iter()
            .map(|p| p.dims3().map(|(b, t, _)| (b, t)))
            .collect::<candle_core::Result<_>>()?;
        if dims.is_empty() || dims.iter().any(|d| *d != dims[0]) {
            return Err(Error::Input(format!(
                "projection parts of unequal rows: {dims:?}"
            )));
        }
        Ok(Self(parts))
    }

    fn batch_len(&self) -> (usize, usize) {
        let (b, t, _) = self.0[0].dims3().expect("checked in new");
        (b, t)
    }

    /// Columns `start..start + len` (the last dim): a view of the part holding them, or their
    /// concatenation where they span parts.
    fn cols(&self, start: usize, len: usize) -> Result<Tensor> {
        let (mut pieces, mut at) = (Vec::new(), 0);
        for p in &self.0 {
            let w = p.dim(D::Minus1)?;
            let (lo, hi) = (start.max(at), (start + len).min(at + w));
            if lo < hi {
                pieces.push(p.narrow(D::Minus1, lo - at, hi - lo)?);
            }
            at += w;
        }
        if pieces
            .iter()
            .map(|p| p.dim(D::Minus1))
            .sum::<candle_core::Result<usize>>()?
            != len
        {
            return Err(Error::Input(format!(
                "columns {start}..{} of a projection of {at}",
                start + len
            )));
        }
        // (candle's cat of one tensor is that tensor: a view stays a view.)
        Ok(Tensor::cat(&pieces, D::Minus1)?)
    }

    /// Rows `row..row + batch·len` of a `[1, rows, _]` projection as `[batch, len, _]`.
    fn rows(&self, row: usize, batch: usize, len: usize) -> Result<Self> {
        let parts = self
            .0
            .iter()
            .map(|p| {
                let w = p.dim(D::Minus1)?;
                p.narrow(1, row, batch * len)?.reshape((batch, len, w))
            })
            .collect::<candle_core::Result<_>>()?;
        Ok(Self(parts))
    }
}

/// One group of a flat batch for [`GatedDeltaNet::forward_groups_block`]: `batch` sequences of
/// `len` tokens each (their rows consecutive, sequence-major) and their states.
#[derive(Debug)]
pub struct GdnGroup<'a> {
    /// Sequences in the group.
    pub batch: usize,
    /// Tokens per sequence.
    pub len: usize,
    /// Their states, advanced by the pass.
    pub state: GroupState<'a>,
    /// Run token by token keeping checkpoints (a speculative verify).
    pub verify: bool,
}

/// Where a [`GdnGroup`]'s states live.
#[derive(Debug)]
pub enum GroupState<'a> {
    /// A state of their own, `[batch, ...]`.
    Own(&'a mut GdnState),
    /// Rows `slots` (u32 `[batch]`, distinct) of pooled states: conv windows `[pool, conv_dim,
    /// K-1]` (activation dtype) and recurrent states `[pool, Hv, dk, dv]` f32, updated in place.
    /// For decode steps (`len` 1) and verifies; with the pools' `stash` their commits are
    /// deferred (a verify needs it: it keeps no checkpoints).
    Pooled {
        conv: &'a Tensor,
        recurrent: &'a Tensor,
        slots: &'a Tensor,
        stash: Option<PoolStash<'a>>,
    },
}

/// The deferred commits of pooled GDN states ([`qwen36_kernels::Deferred`]): the conv's and the
/// delta rule's stashes (`[pool, tokens, ...]`, [`GatedDeltaNet::new_pool_stash`]) and the
/// tokens each sequence of the pass replays first (u32 `[batch]`).
#[derive(Debug, Clone, Copy)]
pub struct PoolStash<'a> {
    pub conv: &'a Tensor,
    pub recurrent: &'a Tensor,
    pub replay: &'a Tensor,
}

#[cfg(test)]
mod tests_support {
    use super::*;
    use candle_core::Device;

    pub fn cfg() -> GdnConfig {
        GdnConfig {
            hidden_size: 24,
            num_k_heads: 2,
            num_v_heads: 4,
            k_head_dim: 8,
            v_head_dim: 6,
            conv_kernel: 4,
            rms_norm_eps: 1e-6,
        }
    }

    /// A layer with random weights (candle's global RNG: `seed` only labels the call site).
    pub fn layer(_seed: u64) -> GatedDeltaNet {
        let c = cfg();
        let dev = Device::Cpu;
        let w = GdnWeights::load::<candle_core::Error>(&c, |name, shape| {
            let t = qwen36_testutil::randn(101, 1.0, shape, &dev)?;
            Ok(match name {
                "A_log" => (t * 0.3)?,
                "dt_bias" => ((t * 0.5)? - 2.0)?,
                _ => (t / (*shape.last().unwrap() as f64).sqrt())?,
            })
        })
        .unwrap();
        GatedDeltaNet::new(c, w).unwrap()
    }

    pub use qwen36_testutil::max_abs_diff as max_diff;
}

#[cfg(test)]
mod tests {
    use super::tests_support::*;
    use super::*;
    use candle_core::Device;

    /// A projection's columns are read from the part holding them, across parts as their
    /// concatenation; columns past its width are an error.
    #[test]
    fn projection_columns_come_from_their_parts() -> Result<()> {
        let dev = Device::Cpu;
        let whole = Tensor::arange(0f32, 2.0 * 3.0 * 5.0, &dev)?.reshape((2, 3, 5))?;
        let parts = vec![
            whole.narrow(2, 0, 3)?.contiguous()?,
            whole.narrow(2, 3, 2)?.contiguous()?,
        ];
        let proj = Proj::new(parts)?;
        assert_eq!(proj.batch_len(), (2, 3));
        for (start, len) in [(0, 3), (0, 5), (1, 3), (3, 2), (4, 1), (2, 1)] {
            let got = proj.cols(start, len)?;
            assert_eq!(
                max_diff(&got, &whole.narrow(2, start, len)?),
                0.0,
                "{start}+{len}"
            );
        }
        // A range inside one part is a view of it (no copy): its rows keep the part's stride.
        assert_eq!(proj.cols(1, 2)?.stride(), &[9, 3, 1]);
        assert!(proj.cols(4, 2).is_err());
        let flat = Proj::new(vec![whole.reshape((1, 6, 5))?])?;
        let rows = flat.rows(2, 2, 2)?;
        assert_eq!(rows.batch_len(), (2, 2));
        let want = whole.reshape((6, 5))?.narrow(0, 2, 4)?.reshape((2, 2, 5))?;
        assert_eq!(max_diff(&rows.cols(0, 5)?, &want), 0.0);
        assert!(Proj::new(vec![whole.clone(), whole.narrow(1, 0, 2)?]).is_err());
        Ok(())
    }

    /// `with_policy` reaches every kernel-launching part: the projections, the norm and the
    /// layer's own conv and delta-rule calls.
    #[test]
    fn with_policy_reaches_every_part() {
        let policy = KernelPolicy {
            pdl: false,
            ..KernelPolicy::DEFAULT
        };
        let l = layer(1).with_policy(policy);
        for p in [
            l.in_proj.policy(),
            l.norm.policy(),
            l.out_proj.policy(),
            l.policy(),
        ] {
            assert_eq!(p, &policy);
        }
        assert_eq!(layer(1).policy(), &KernelPolicy::DEFAULT);
    }

    #[test]
    fn decode_steps_equal_prefill() -> Result<()> {
        let l = layer(1);
        let x = qwen36_testutil::randn(102, 1.0, (2, 70, 24), &Device::Cpu)?;
        let mut s_full = l.new_state(2, DType::F32, DType::F32)?;
        let full = l.forward(&x, &mut s_full)?;
        let mut s = l.new_state(2, DType::F32, DType::F32)?;
        let mut parts = vec![l.forward(&x.narrow(1, 0, 66)?, &mut s)?];
        for t in 66..70 {
            parts.push(l.forward(&x.narrow(1, t, 1)?, &mut s)?);
        }
        let stepped = Tensor::cat(&parts, 1)?;
        assert!(max_diff(&full, &stepped) < 1e-5);
        assert!(max_diff(s.recurrent(), s_full.recurrent()) < 1e-5);
        assert_eq!(s.seen(), 70);
        Ok(())
    }

    /// The residual block is `x + forward(norm(x))` (on the CPU the same ops, so equal bits) for
    /// prefill, a decode step and a verify pass, and leaves the same states; a stream that comes
    /// with its normalisation enters as that, and with a next norm the output comes with its own
    /// (the add and the norm in one pass on the CPU).
    #[test]
    fn block_is_the_residual_around_the_normalised_layer() -> Result<()> {
        let l = layer(6);
        let dev = Device::Cpu;
        let norm = RmsNorm::zero_centred(&(qwen36_testutil::randn(103, 0.3, 24, &dev)?), 1e-6)?;
        let next = RmsNorm::zero_centred(&(qwen36_testutil::randn(105, 0.3, 24, &dev)?), 1e-6)?;
        let x = qwen36_testutil::randn(104, 1.0, (2, 9, 24), &dev)?;
        let (mut s_block, mut s_plain) = (
            l.new_state(2, DType::F32, DType::F32)?,
            l.new_state(2, DType::F32, DType::F32)?,
        );
        for (t0, len, then) in [(0, 7, None), (7, 1, Some(&next))] {
            let xs = x.narrow(1, t0, len)?;
            let want = (&xs + l.forward(&norm.forward(&xs)?, &mut s_plain)?)?;
            let got = l.forward_block(&Stream::new(xs), &norm, then, &mut s_block)?;
            assert_eq!(max_diff(&got.x, &want), 0.0, "tokens {t0}..{}", t0 + len);
            match then {
                Some(n) => assert_eq!(max_diff(&got.normed.expect("normed"), &n.forward(&want)?), 0.0),
                None => assert!(got.normed.is_none()),
            }
        }
        // The stream's normalisation is the layer's input (here another one than norm(x)).
        let xs = x.narrow(1, 8, 1)?;
        let other = next.forward(&xs)?;
        let (want, cp_plain) = l.forward_verify(&other, &mut s_plain)?;
        let input = Stream::with_normed(xs.clone(), other);
        let (got, cp_block) = l.forward_verify_block(&input, &norm, None, &mut s_block)?;
        let got = got.x;
        assert_eq!(max_diff(&got, &(&xs + want)?), 0.0, "verify");
        assert_eq!(max_diff(&cp_block.states, &cp_plain.states), 0.0);
        assert_eq!(max_diff(s_block.recurrent(), s_plain.recurrent()), 0.0);
        assert_eq!(max_diff(s_block.conv(), s_plain.conv()), 0.0);
        Ok(())
    }

    #[test]
    fn reset_state_equals_fresh_state_and_snapshots_restore_exactly() -> Result<()> {
        let l = layer(2);
        let dev = Device::Cpu;
        let a = qwen36_testutil::randn(105, 1.0, (1, 9, 24), &dev)?;
        let b = qwen36_testutil::randn(106, 1.0, (1, 5, 24), &dev)?;
        let mut fresh = l.new_state(1, DType::F32, DType::F32)?;
        let b_alone = l.forward(&b, &mut fresh)?;
        let mut s = l.new_state(1, DType::F32, DType::F32)?;
        l.forward(&a, &mut s)?;
        let snapshot = s.clone();
        let after_a_then_b = l.forward(&b, &mut s)?;
        s = snapshot;
        assert_eq!(max_diff(&l.forward(&b, &mut s)?, &after_a_then_b), 0.0);
        s.reset()?;
        assert_eq!(s.recurrent().dtype(), DType::F32);
        assert_eq!(max_diff(&l.forward(&b, &mut s)?, &b_alone), 0.0);
        Ok(())
    }

    /// In-place mode (what CUDA graphs need): forward, verify + commit and reset give bit-identical
    /// results to the replacing mode, and the buffers (state and checkpoints) never move.
    #[test]
    fn in_place_state_matches_and_keeps_its_buffers() -> Result<()> {
        let l = layer(5);
        let dev = Device::Cpu;
        let x = qwen36_testutil::randn(107, 1.0, (2, 7, 24), &dev)?;
        let v = qwen36_testutil::randn(108, 1.0, (2, 3, 24), &dev)?;
        let mut plain = l.new_state(2, DType::F32, DType::F32)?;
        let mut pinned = l.new_state(2, DType::F32, DType::F32)?;
        pinned.set_in_place()?;
        let ids = |s: &GdnState| (s.conv().id(), s.recurrent().id());
        let before = ids(&pinned);
        assert_eq!(
            max_diff(&l.forward(&x, &mut plain)?, &l.forward(&x, &mut pinned)?),
            0.0
        );
        let (yp, cp) = l.forward_verify(&v, &mut plain)?;
        let (yq, cq) = l.forward_verify(&v, &mut pinned)?;
        assert_eq!(max_diff(&yp, &yq), 0.0);
        assert_eq!(max_diff(&cp.states, &cq.states), 0.0);
        assert_eq!(max_diff(&cp.window, &cq.window), 0.0);
        // The pinned state's checkpoints are its own buffers, the same on every pass of a length.
        let own = pinned.checkpoint_buffers(3)?.expect("in place");
        assert_eq!(
            (cq.states.id(), cq.window.id()),
            (own.states.id(), own.window.id())
        );
        assert!(plain.checkpoint_buffers(3)?.is_none());
        plain.commit(&cp, 2)?;
        pinned.commit(&cq, 2)?;
        assert_eq!(max_diff(plain.recurrent(), pinned.recurrent()), 0.0);
        assert_eq!(max_diff(plain.conv(), pinned.conv()), 0.0);
        assert_eq!(plain.seen(), pinned.seen());
        // A decode step (the in-place kernels' other caller).
        let one = v.narrow(1, 2, 1)?;
        assert_eq!(
            max_diff(&l.forward(&one, &mut plain)?, &l.forward(&one, &mut pinned)?),
            0.0
        );
        assert_eq!(max_diff(plain.recurrent(), pinned.recurrent()), 0.0);
        assert_eq!(max_diff(plain.conv(), pinned.conv()), 0.0);
        assert_eq!(ids(&pinned), before);
        pinned.reset()?;
        assert_eq!(pinned.recurrent().abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
        assert_eq!(ids(&pinned), before);
        Ok(())
    }

    #[test]
    fn non_f32_state_and_bad_shapes_are_errors() {
        let l = layer(3);
        let e = l.new_state(1, DType::BF16, DType::BF16).unwrap_err();
        assert!(matches!(e, Error::StateDtype(DType::BF16)), "{e}");
        let dev = Device::Cpu;
        let e = GdnState::from_parts(
            Tensor::zeros((1, 40, 3), DType::F32, &dev).unwrap(),
            Tensor::zeros((1, 4, 8, 6), DType::F16, &dev).unwrap(),
            0,
        )
        .unwrap_err();
        assert!(matches!(e, Error::StateDtype(DType::F16)), "{e}");
        // Each shape check on its own: conv rank, recurrent rank, batch sizes.
        let z = |s: &[usize]| Tensor::zeros(s, DType::F32, &dev).unwrap();
        for (conv, rec) in [
            (&[1, 40][..], &[1, 4, 8, 6][..]),
            (&[1, 40, 3], &[1, 4, 8]),
            (&[2, 40, 3], &[1, 4, 8, 6]),
        ] {
            let e = GdnState::from_parts(z(conv), z(rec), 0).unwrap_err();
            assert!(matches!(e, Error::State(_)), "{conv:?} {rec:?}: {e}");
        }
        let s = GdnState::from_parts(z(&[2, 40, 3]), z(&[2, 4, 8, 6]), 5).unwrap();
        assert_eq!(
            (s.seen(), s.conv().dims(), s.recurrent().dims()),
            (5, &[2, 40, 3][..], &[2, 4, 8, 6][..])
        );
        let mut w = GdnWeights::load::<candle_core::Error>(&cfg(), |_, s| Tensor::zeros(s, DType::F32, &dev))
            .unwrap();
        w.a_log = Tensor::zeros(3, DType::F32, &dev).unwrap();
        let e = GatedDeltaNet::new(cfg(), w).unwrap_err().to_string();
        assert!(
            e.contains("A_log") && e.contains("[4]") && e.contains("[3]"),
            "{e}"
        );
    }
}

#[cfg(test)]
mod verify_tests {
    use super::tests_support::*;
    use super::*;
    use candle_core::Device;

    /// A commit of another sequence's checkpoints (a batch-2 pass's member 1 into the batch-2
    /// state) is refused and changes nothing: it would have written row 1's state into row 0 (in
    /// place) or shrunk the state to one row.
    #[test]
    fn a_commit_of_checkpoints_of_another_shape_is_refused() -> Result<()> {
        let l = layer(7);
        let dev = Device::Cpu;
        let x = qwen36_testutil::randn(130, 1.0, (2, 3, 24), &dev)?;
        for in_place in [false, true] {
            let mut s = l.new_state(2, DType::F32, DType::F32)?;
            if in_place {
                s.set_in_place()?;
            }
            let (_, cp) = l.forward_verify(&x, &mut s)?;
            let (conv, recurrent, seen) = (s.conv().copy()?, s.recurrent().copy()?, s.seen());
            let one = cp.member(1)?.deep_copy()?;
            assert!(s.commit(&one, 2).is_err(), "in place {in_place}");
            assert_eq!(max_diff(s.conv(), &conv), 0.0);
            assert_eq!(max_diff(s.recurrent(), &recurrent), 0.0);
            assert_eq!((s.conv().dims(), s.seen()), (&[2, 56, 3][..], seen));
            s.commit(&cp, 2)?;
        }
        Ok(())
    }

    /// A state of another conv dtype than the activations, or whose recurrent state has another
    /// shape, is refused before either part moves (the in-place kernels had advanced the other
    /// part); a group of a flat batch whose state does not fit leaves every group's state as it
    /// was.
    #[test]
    fn states_that_do_not_fit_are_refused_before_anything_moves() -> Result<()> {
        let l = layer(8);
        let dev = Device::Cpu;
        let x = qwen36_testutil::randn(131, 1.0, (1, 1, 24), &dev)?;
        let zero_parts = |s: &GdnState| -> Result<(f32, f32)> {
            let sum =
                |t: &Tensor| -> Result<f32> { Ok(t.to_dtype(DType::F32)?.abs()?.sum_all()?.to_scalar()?) };
            Ok((sum(s.conv())?, sum(s.recurrent())?))
        };
        for in_place in [false, true] {
            let bf16 = l.new_state(1, DType::BF16, DType::F32)?;
            let wrong_shape = GdnState::from_parts(
                Tensor::zeros((1, 56, 3), DType::F32, &dev)?,
                Tensor::zeros((1, 4, 8, 5), DType::F32, &dev)?,
                0,
            )?;
            for mut s in [bf16.clone(), wrong_shape] {
                if in_place {
                    s.set_in_place()?;
                }
                assert!(l.forward(&x, &mut s).is_err(), "in place {in_place}");
                assert_eq!((zero_parts(&s)?, s.seen()), ((0.0, 0.0), 0));
            }
        }
        let norm = RmsNorm::zero_centred(&Tensor::zeros(24, DType::F32, &dev)?, 1e-6)?;
        let x2 = qwen36_testutil::randn(132, 1.0, (1, 2, 24), &dev)?;
        let mut s0 = l.new_state(1, DType::F32, DType::F32)?;
        let mut s1 = l.new_state(2, DType::F32, DType::F32)?;
        let mut groups = [
            GdnGroup {
                batch: 1,
                len: 1,
                state: GroupState::Own(&mut s0),
                verify: false,
            },
            GdnGroup {
                batch: 1,
                len: 1,
                state: GroupState::Own(&mut s1),
                verify: false,
            },
        ];
        assert!(l
            .forward_groups_block(&Stream::new(x2), &norm, None, &mut groups)
            .is_err());
        assert_eq!((zero_parts(&s0)?, s0.seen()), ((0.0, 0.0), 0));
        Ok(())
    }

    /// Every accepted length 0..=k: verify k+1 tokens, commit a+1, continue with one more token;
    /// output and state equal a fresh token-by-token run over exactly the kept tokens. Tolerance
    /// 4e-6: the verify pass projects all k+1 tokens in one matmul, whose blocking differs from
    /// k+1 single-row products in the last bits of f32, and the outputs reach magnitudes of ~8
    /// (f32 ulp 9.5e-7), so a few ulps (1.07e-6 was seen on a fresh CI run with these random
    /// inputs); a wrong rollback moves them by O(0.1). The rollback itself is an exact copy
    /// (committing all tokens equals the state the pass left, bit for bit).
    #[test]
    fn commit_restores_the_state_after_each_accepted_prefix() -> Result<()> {
        let l = layer(4);
        let dev = Device::Cpu;
        let prompt = qwen36_testutil::randn(109, 1.0, (1, 10, 24), &dev)?;
        let verify = qwen36_testutil::randn(110, 1.0, (1, 5, 24), &dev)?;
        let next = qwen36_testutil::randn(111, 1.0, (1, 1, 24), &dev)?;
        let mut base = l.new_state(1, DType::F32, DType::F32)?;
        l.forward(&prompt, &mut base)?;
        for keep in 1..=5 {
            let mut s = base.clone();
            let (y, cp) = l.forward_verify(&verify, &mut s)?;
            s.commit(&cp, keep)?;

            let mut fresh = base.clone();
            let mut ys = Vec::new();
            for i in 0..keep {
                ys.push(l.forward(&verify.narrow(1, i, 1)?, &mut fresh)?);
            }
            // Verify outputs equal token-by-token decoding (to matmul-blocking rounding).
            let tol = 4e-6;
            assert!(
                max_diff(&y.narrow(1, 0, keep)?, &Tensor::cat(&ys, 1)?) < tol,
                "keep {keep}"
            );
            let dr = max_diff(s.recurrent(), fresh.recurrent());
            assert!(dr < tol, "keep {keep}: recurrent {dr}");
            assert!(max_diff(s.conv(), fresh.conv()) < tol, "keep {keep}: conv");
            assert_eq!(s.seen(), fresh.seen());
            let after = l.forward(&next, &mut s)?;
            let cont = max_diff(&after, &l.forward(&next, &mut fresh)?);
            assert!(cont < tol, "keep {keep}: continuation {cont}");
        }
        // Checkpoints copied into separate buffers (as CUDA graphs keep them) commit the same.
        let mut s = base.clone();
        let (_, cp) = l.forward_verify(&verify, &mut s)?;
        let kept = cp.deep_copy()?;
        let (_, cp2) = l.forward_verify(&next, &mut base.clone())?;
        assert!(cp2.deep_copy().is_ok());
        cp.write_into(&kept)?;
        // A strided view (as a kernel may return) still gets contiguous buffers of its own.
        let strided = VerifyCheckpoints {
            states: cp.states.transpose(3, 4)?.contiguous()?.transpose(3, 4)?,
            ..cp.clone()
        };
        assert!(!strided.states.is_contiguous());
        let own = strided.deep_copy()?;
        assert!(own.states.is_contiguous() && own.window.is_contiguous());
        strided.write_into(&own)?;
        assert_eq!(max_diff(&own.states, &cp.states), 0.0);
        let mut t = base.clone();
        t.commit(&kept.rebased(cp.seen_before()), 3)?;
        let mut u = base.clone();
        u.commit(&cp, 3)?;
        assert_eq!(max_diff(t.recurrent(), u.recurrent()), 0.0);
        assert_eq!(max_diff(t.conv(), u.conv()), 0.0);
        assert_eq!(t.seen(), u.seen());
        // The committed state owns its buffers: rewriting the checkpoint buffers it came from
        // (as the next pass does) leaves it as it was. (Its recurrent state, at batch 1 a
        // contiguous row of the checkpoints, was a view of them; its conv window never is.)
        let rec = t.recurrent().force_contiguous()?;
        assert!(rec.abs()?.max_all()?.to_scalar::<f32>()? > 0.0);
        VerifyCheckpoints::from_buffers(kept.states.zeros_like()?, kept.window.zeros_like()?)?
            .write_into(&kept)?;
        assert_eq!(max_diff(t.recurrent(), &rec), 0.0);

        let mut s = base.clone();
        let (_, cp) = l.forward_verify(&verify, &mut s)?;
        let left = s.clone();
        s.commit(&cp, 5)?;
        assert_eq!(max_diff(s.recurrent(), left.recurrent()), 0.0);
        assert_eq!(max_diff(s.conv(), left.conv()), 0.0);
        assert!(s.commit(&cp, 0).is_err() && s.commit(&cp, 6).is_err());
        Ok(())
    }
}

#[cfg(test)]
mod group_tests {
    use super::tests_support::*;
    use super::*;
    use candle_core::Device;

    /// A flat batch of a decode group and a verify group whose states are rows of pools gives
    /// what the same groups give from states of their own (equal bits on the CPU): outputs, the
    /// decode rows afterwards; the verify leaves its row and, replayed for any accepted length,
    /// gives the own verify's checkpoint there; the other rows stay; a pooled prefill, a verify
    /// without a stash and one longer than the stash are refused.
    #[test]
    fn pooled_groups_equal_own_states() -> Result<()> {
        let l = layer(7);
        let dev = Device::Cpu;
        let norm = RmsNorm::zero_centred(&(qwen36_testutil::randn(120, 0.3, 24, &dev)?), 1e-6)?;
        let c = cfg();
        let pool = 5;
        let conv0 = qwen36_testutil::randn(121, 1.0, (pool, c.conv_dim(), c.conv_kernel - 1), &dev)?;
        let rec0 = qwen36_testutil::randn(122, 0.5, (pool, c.num_v_heads, c.k_head_dim, c.v_head_dim), &dev)?;
        // Group 0: two decode tokens (slots 4, 1); group 1: one verify of 3 tokens (slot 2).
        let slots = [Tensor::new(&[4u32, 1], &dev)?, Tensor::new(&[2u32], &dev)?];
        let replay = [Tensor::new(&[0u32, 0], &dev)?, Tensor::new(&[0u32], &dev)?];
        let x = qwen36_testutil::randn(123, 1.0, (1, 5, 24), &dev)?;
        let (conv, rec) = (conv0.copy()?, rec0.copy()?);
        let (cs, rs) = l.new_pool_stash(&conv, &rec, 4, DType::F32)?;
        let stash = |replay| PoolStash {
            conv: &cs,
            recurrent: &rs,
            replay,
        };
        let specs = [(2, 1, false), (1, 3, true)];
        let mut groups: Vec<GdnGroup> = specs
            .iter()
            .zip(slots.iter().zip(&replay))
            .map(|(&(batch, len, verify), (slots, replay))| GdnGroup {
                batch,
                len,
                state: GroupState::Pooled {
                    conv: &conv,
                    recurrent: &rec,
                    slots,
                    stash: Some(stash(replay)),
                },
                verify,
            })
            .collect();
        let next = RmsNorm::zero_centred(&qwen36_testutil::randn(142, 0.3, 24, &dev)?, 1e-6)?;
        let (y, cps) = l.forward_groups_block(&Stream::new(x.clone()), &norm, Some(&next), &mut groups)?;
        assert!(
            cps.iter().all(Option::is_none),
            "pooled verifies keep no checkpoints"
        );

        let own = |s: &Tensor| -> Result<GdnState> {
            GdnState::from_parts(conv0.index_select(s, 0)?, rec0.index_select(s, 0)?, 0)
        };
        let mut states = [own(&slots[0])?, own(&slots[1])?];
        let [s0, s1] = &mut states;
        let mut groups = vec![
            GdnGroup {
                batch: 2,
                len: 1,
                state: GroupState::Own(s0),
                verify: false,
            },
            GdnGroup {
                batch: 1,
                len: 3,
                state: GroupState::Own(s1),
                verify: true,
            },
        ];
        let (y_own, cps_own) = l.forward_groups_block(&Stream::new(x.clone()), &norm, None, &mut groups)?;
        assert_eq!(max_diff(&y.x, &y_own.x), 0.0);
        let normed = y.normed.expect("the next norm's pass adds the residual");
        assert_eq!(max_diff(&normed, &next.forward(&y_own.x)?), 0.0);
        assert_eq!(max_diff(&conv.index_select(&slots[0], 0)?, states[0].conv()), 0.0);
        assert_eq!(
            max_diff(&rec.index_select(&slots[0], 0)?, states[0].recurrent()),
            0.0
        );
        assert_eq!(
            max_diff(&rec.get(2)?, &rec0.get(2)?),
            0.0,
            "a verify leaves its row"
        );
        assert_eq!(
            max_diff(&conv.get(2)?, &conv0.get(2)?),
            0.0,
            "a verify leaves its row"
        );
        for untouched in [0, 3] {
            assert_eq!(max_diff(&rec.get(untouched)?, &rec0.get(untouched)?), 0.0);
            assert_eq!(max_diff(&conv.get(untouched)?, &conv0.get(untouched)?), 0.0);
        }
        let b = cps_own[1].as_ref().expect("kept");
        for keep in 1..=3u32 {
            let (cc, rc) = (conv.copy()?, rec.copy()?);
            let n = Tensor::new(&[keep], &dev)?;
            let st = PoolStash {
                conv: &cs,
                recurrent: &rs,
                replay: &n,
            };
            l.replay_pooled((&cc, &rc, &slots[1]), &st)?;
            let (cb, rb) = b.state_after(keep as usize)?;
            assert_eq!(max_diff(&cc.narrow(0, 2, 1)?, &cb), 0.0, "keep {keep}");
            assert_eq!(max_diff(&rc.narrow(0, 2, 1)?, &rb), 0.0, "keep {keep}");
        }

        let pooled = |verify, stash| GdnGroup {
            batch: 1,
            len: 5,
            state: GroupState::Pooled {
                conv: &conv,
                recurrent: &rec,
                slots: &slots[1],
                stash,
            },
            verify,
        };
        let e = l
            .forward_groups_block(&Stream::new(x.clone()), &norm, None, &mut [pooled(false, None)])
            .unwrap_err();
        assert!(e.to_string().contains("prefill of 5 tokens"), "{e}");
        let e = l
            .forward_groups_block(&Stream::new(x.clone()), &norm, None, &mut [pooled(true, None)])
            .unwrap_err();
        assert!(e.to_string().contains("needs the pool's stash"), "{e}");
        let e = l
            .forward_groups_block(
                &Stream::new(x.clone()),
                &norm,
                None,
                &mut [pooled(true, Some(stash(&replay[1])))],
            )
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("a verify of 5 tokens does not fit a stash of 4"),
            "{e}"
        );
        Ok(())
    }
}
