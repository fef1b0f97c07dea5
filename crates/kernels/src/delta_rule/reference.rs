//! The CPU reference of the gated delta rule, in f32: the token-by-token recurrence and the chunked
//! (WY/UT transform) form, written for reading rather than speed (loops over each (sequence, value
//! head) unit, in parallel across units). Callable on its own, like fla's `naive.py`: the public
//! ops run it on the CPU and every CUDA kernel is tested against it.

use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

use super::{
    check, check_fused, DeltaRuleInputs, DeltaRuleMode, DeltaRuleOutput, Dims, GdnParams, CHUNK_SIZE,
};
use crate::{host_f32, Error, Result};

/// [`super::recurrent_gated_delta_rule`] on the host: the state after each token `S ← exp(g)·S;
/// δ ← β(v − Sᵀk); S ← S + kδᵀ; o ← Sᵀ(scale·q)`, every state kept with `keep_all_states`.
pub fn recurrent(
    inputs: DeltaRuleInputs,
    initial_state: Option<&Tensor>,
    scale: f32,
    keep_all_states: bool,
) -> Result<DeltaRuleOutput> {
    let d = check("recurrent_gated_delta_rule", inputs, initial_state)?;
    let x = Host::new(d, inputs, initial_state)?;
    let heads: Vec<HeadResult> = per_unit(d, |unit| {
        let (b, h) = (unit / d.hv, unit % d.hv);
        let mut s = x.state_of(d, b, h).to_vec();
        let mut out = vec![0.0f32; d.t * d.dv];
        let mut all = keep_all_states.then(|| Vec::with_capacity(d.t * d.dk * d.dv));
        let mut delta = vec![0.0f32; d.dv];
        for t in 0..d.t {
            let kt = &x.k[x.qk_at(d, b, t, h)];
            let qt = &x.q[x.qk_at(d, b, t, h)];
            let vt = &x.v[x.v_at(d, b, t, h)];
            let gi = x.gate_at(d, b, t, h);
            let (decay, bt) = (x.g[gi].exp(), x.beta[gi]);
            s.iter_mut().for_each(|e| *e *= decay);
            // δ = β (v − Sᵀk), read from the decayed state.
            delta.copy_from_slice(vt);
            for (i, &ki) in kt.iter().enumerate() {
                for (dj, sij) in delta.iter_mut().zip(&s[i * d.dv..(i + 1) * d.dv]) {
                    *dj -= sij * ki;
                }
            }
            delta.iter_mut().for_each(|e| *e *= bt);
            // S += k δᵀ, then o = Sᵀ (scale q).
            let o = &mut out[t * d.dv..(t + 1) * d.dv];
            for i in 0..d.dk {
                let row = &mut s[i * d.dv..(i + 1) * d.dv];
                let qi = qt[i] * scale;
                for ((sij, dj), oj) in row.iter_mut().zip(&delta).zip(o.iter_mut()) {
                    *sij += kt[i] * dj;
                    *oj += *sij * qi;
                }
            }
            if let Some(a) = all.as_mut() {
                a.extend_from_slice(&s);
            }
        }
        HeadResult { out, state: s, all }
    });
    assemble(d, heads, inputs.q.device())
}

/// [`super::chunked_gated_delta_rule`] on the host, in chunks of `chunk_size` tokens (any positive
/// size gives the same result to rounding).
pub fn chunked(
    inputs: DeltaRuleInputs,
    initial_state: Option<&Tensor>,
    scale: f32,
    chunk_size: usize,
) -> Result<DeltaRuleOutput> {
    let d = check("chunked_gated_delta_rule", inputs, initial_state)?;
    if chunk_size == 0 {
        return Err(Error::Shape {
            op: "chunked_gated_delta_rule",
            msg: "chunk_size must be positive".into(),
        });
    }
    let x = Host::new(d, inputs, initial_state)?;
    let (dk, dv) = (d.dk, d.dv);
    let heads: Vec<HeadResult> = per_unit(d, |unit| {
        let (b, h) = (unit / d.hv, unit % d.hv);
        let mut s = x.state_of(d, b, h).to_vec();
        let mut out = vec![0.0f32; d.t * dv];
        let c = chunk_size;
        let (mut gamma, mut bet) = (vec![0.0f32; c], vec![0.0f32; c]);
        let mut kk = vec![0.0f32; c * c];
        let mut a = vec![0.0f32; c * c];
        let mut u = vec![0.0f32; c * dv];
        let mut w = vec![0.0f32; c * dk];
        let mut vt = vec![0.0f32; c * dv];
        let mut start = 0;
        while start < d.t {
            let l = c.min(d.t - start);
            let kr = |r: usize| &x.k[x.qk_at(d, b, start + r, h)];
            let qr = |r: usize| &x.q[x.qk_at(d, b, start + r, h)];
            let vr = |r: usize| &x.v[x.v_at(d, b, start + r, h)];
            let dot = |p: &[f32], q: &[f32]| p.iter().zip(q).map(|(a, b)| a * b).sum::<f32>();
            let mut acc = 0.0f32;
            for r in 0..l {
                let gi = x.gate_at(d, b, start + r, h);
                acc += x.g[gi];
                gamma[r] = acc;
                bet[r] = x.beta[gi];
            }
            for r in 0..l {
                for s_ in 0..r {
                    kk[r * c + s_] = dot(kr(r), kr(s_));
                    a[r * c + s_] = bet[r] * (gamma[r] - gamma[s_]).exp() * kk[r * c + s_];
                }
            }
            // Forward substitution: rows of U and W.
            for r in 0..l {
                let (vrow, krow) = (vr(r), kr(r));
                let eg = gamma[r].exp();
                for j in 0..dv {
                    u[r * dv + j] = bet[r] * vrow[j];
                }
                for i in 0..dk {
                    w[r * dk + i] = bet[r] * eg * krow[i];
                }
                for s_ in 0..r {
                    let ars = a[r * c + s_];
                    for j in 0..dv {
                        u[r * dv + j] -= ars * u[s_ * dv + j];
                    }
                    for i in 0..dk {
                        w[r * dk + i] -= ars * w[s_ * dk + i];
                    }
                }
            }
            // Ṽ = U − W S₀ (the per-token deltas).
            for r in 0..l {
                let vrow = &mut vt[r * dv..(r + 1) * dv];
                vrow.copy_from_slice(&u[r * dv..(r + 1) * dv]);
                for i in 0..dk {
                    let wri = w[r * dk + i];
                    for (vj, sij) in vrow.iter_mut().zip(&s[i * dv..(i + 1) * dv]) {
                        *vj -= wri * sij;
                    }
                }
            }
            // Outputs: inter-chunk read of S₀ plus intra-chunk attention (diagonal included).
            for r in 0..l {
                let qrow = qr(r);
                let o = &mut out[(start + r) * dv..(start + r + 1) * dv];
                let eg = gamma[r].exp() * scale;
                for i in 0..dk {
                    let qi = qrow[i] * eg;
                    for (oj, sij) in o.iter_mut().zip(&s[i * dv..(i + 1) * dv]) {
                        *oj += qi * sij;
                    }
                }
                for s_ in 0..=r {
                    let coef = (gamma[r] - gamma[s_]).exp() * dot(qrow, kr(s_)) * scale;
                    for (oj, vj) in o.iter_mut().zip(&vt[s_ * dv..(s_ + 1) * dv]) {
                        *oj += coef * vj;
                    }
                }
            }
            // Exit state.
            let gl = gamma[l - 1];
            let chunk_decay = gl.exp();
            s.iter_mut().for_each(|e| *e *= chunk_decay);
            for s_ in 0..l {
                let f = (gl - gamma[s_]).exp();
                let krow = kr(s_);
                for i in 0..dk {
                    let ki = krow[i] * f;
                    for (sij, vj) in s[i * dv..(i + 1) * dv]
                        .iter_mut()
                        .zip(&vt[s_ * dv..(s_ + 1) * dv])
                    {
                        *sij += ki * vj;
                    }
                }
            }
            start += l;
        }
        HeadResult {
            out,
            state: s,
            all: None,
        }
    });
    assemble(d, heads, inputs.q.device())
}

/// [`super::fused_gated_delta_rule`] as the composition of [`crate::norm::l2_norm`],
/// [`crate::gating::gdn_gating`] and the two forms above.
#[allow(clippy::too_many_arguments)]
pub fn fused(
    qkv: &Tensor,
    a: &Tensor,
    b: &Tensor,
    layer: GdnParams,
    state: Option<&Tensor>,
    mode: DeltaRuleMode,
) -> Result<DeltaRuleOutput> {
    let d = check_fused("fused_gated_delta_rule", qkv, a, b, layer.heads, state)?;
    let Dims {
        b: bs,
        t,
        hk,
        hv,
        dk,
        dv,
    } = d;
    let kd = hk * dk;
    let q = qkv.narrow(2, 0, kd)?.reshape((bs, t, hk, dk))?;
    let k = qkv.narrow(2, kd, kd)?.reshape((bs, t, hk, dk))?;
    let v = qkv.narrow(2, 2 * kd, hv * dv)?.reshape((bs, t, hv, dv))?;
    let q = crate::norm::l2_norm(&q, 1e-6)?;
    let k = crate::norm::l2_norm(&k, 1e-6)?;
    let v = v.to_dtype(DType::F32)?;
    let (g, beta) = crate::gating::gdn_gating(a, b, layer.a_log, layer.dt_bias)?;
    let scale = (dk as f32).powf(-0.5);
    match mode {
        DeltaRuleMode::Chunked => chunked(
            DeltaRuleInputs::new(&q, &k, &v, &g, &beta),
            state,
            scale,
            CHUNK_SIZE,
        ),
        DeltaRuleMode::Recurrent { keep_all_states } => recurrent(
            DeltaRuleInputs::new(&q, &k, &v, &g, &beta),
            state,
            scale,
            keep_all_states,
        ),
    }
}

/// Host copies of the inputs, in the token-major layout of the tensors.
struct Host {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    state: Vec<f32>,
}

impl Host {
    fn new(d: Dims, x: DeltaRuleInputs, state: Option<&Tensor>) -> Result<Self> {
        let DeltaRuleInputs { q, k, v, g, beta } = x;
        Ok(Self {
            q: host_f32(q)?,
            k: host_f32(k)?,
            v: host_f32(v)?,
            g: host_f32(g)?,
            beta: host_f32(beta)?,
            state: match state {
                Some(s) => host_f32(s)?,
                None => vec![0.0; d.b * d.hv * d.dk * d.dv],
            },
        })
    }
    /// Range of the q/k row that value head `hv` reads at token `t`.
    fn qk_at(&self, d: Dims, b: usize, t: usize, hv: usize) -> std::ops::Range<usize> {
        let h = hv / (d.hv / d.hk);
        let off = ((b * d.t + t) * d.hk + h) * d.dk;
        off..off + d.dk
    }
    fn v_at(&self, d: Dims, b: usize, t: usize, hv: usize) -> std::ops::Range<usize> {
        let off = ((b * d.t + t) * d.hv + hv) * d.dv;
        off..off + d.dv
    }
    fn gate_at(&self, d: Dims, b: usize, t: usize, hv: usize) -> usize {
        (b * d.t + t) * d.hv + hv
    }
    fn state_of(&self, d: Dims, b: usize, hv: usize) -> &[f32] {
        let n = d.dk * d.dv;
        &self.state[(b * d.hv + hv) * n..(b * d.hv + hv + 1) * n]
    }
}

/// Runs `f` over the (batch, value head) units: in parallel when there is enough work to pay for
/// waking threads (a decode step of a tiny model has a few thousand flops per unit).
fn per_unit<F: Fn(usize) -> HeadResult + Sync + Send>(d: Dims, f: F) -> Vec<HeadResult> {
    let units = d.b * d.hv;
    if units * d.t * d.dk * d.dv < 1 << 16 {
        (0..units).map(f).collect()
    } else {
        (0..units).into_par_iter().map(f).collect()
    }
}

/// What one (batch, value head) unit produces.
struct HeadResult {
    out: Vec<f32>,         // [t, dv]
    state: Vec<f32>,       // [dk, dv]
    all: Option<Vec<f32>>, // [t, dk, dv]
}

/// Assembles per-head results (ordered by `b * hv + h`) into the output tensors.
fn assemble(d: Dims, heads: Vec<HeadResult>, device: &Device) -> Result<DeltaRuleOutput> {
    let n = d.dk * d.dv;
    let mut out = vec![0.0f32; d.b * d.t * d.hv * d.dv];
    let mut state = vec![0.0f32; d.b * d.hv * n];
    let keep = heads.first().is_some_and(|h| h.all.is_some());
    let mut all = if keep {
        vec![0.0f32; d.b * d.t * d.hv * n]
    } else {
        Vec::new()
    };
    for (unit, hr) in heads.into_iter().enumerate() {
        let (b, h) = (unit / d.hv, unit % d.hv);
        for t in 0..d.t {
            let dst = ((b * d.t + t) * d.hv + h) * d.dv;
            out[dst..dst + d.dv].copy_from_slice(&hr.out[t * d.dv..(t + 1) * d.dv]);
            if let Some(a) = &hr.all {
                let dst = ((b * d.t + t) * d.hv + h) * n;
                all[dst..dst + n].copy_from_slice(&a[t * n..(t + 1) * n]);
            }
        }
        state[unit * n..(unit + 1) * n].copy_from_slice(&hr.state);
    }
    let cpu = Device::Cpu;
    Ok(DeltaRuleOutput {
        out: Tensor::from_vec(out, (d.b, d.t, d.hv, d.dv), &cpu)?.to_device(device)?,
        state: Tensor::from_vec(state, (d.b, d.hv, d.dk, d.dv), &cpu)?.to_device(device)?,
        all_states: if keep {
            Some(Tensor::from_vec(all, (d.b, d.t, d.hv, d.dk, d.dv), &cpu)?.to_device(device)?)
        } else {
            None
        },
    })
}
