//! Speculative acceptance (Leviathan et al.; docs/MODEL.md §4.4): lossless by construction.

use crate::sampler::{argmax, draw_index};
use crate::{Error, Result};

/// Outcome of verifying `k` drafts against `k + 1` target rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Acceptance {
    /// Drafts accepted, `0..=k`.
    pub accepted: usize,
    /// The extra token: the target's correction at the first rejection, or the bonus token.
    pub next: u32,
}

fn check(drafts: &[u32], rows: usize) -> Result<()> {
    if rows != drafts.len() + 1 {
        return Err(Error::Shape(format!(
            "{} drafts need {} target rows, found {rows}",
            drafts.len(),
            drafts.len() + 1
        )));
    }
    Ok(())
}

/// Greedy verification: accept while `draft == argmax(target row)`; the next token is the target
/// argmax at the first mismatch (or the bonus row).
pub fn accept_greedy(drafts: &[u32], target_argmax: &[u32]) -> Result<Acceptance> {
    check(drafts, target_argmax.len())?;
    let accepted = drafts
        .iter()
        .zip(target_argmax)
        .take_while(|(d, t)| d == t)
        .count();
    Ok(Acceptance {
        accepted,
        next: target_argmax[accepted],
    })
}

/// Stochastic verification. `target_probs[j]` is the processed target distribution at row j
/// (k + 1 rows); `draft_probs[j]` the drafter's distribution for draft j (`None` = the drafts were
/// argmax picks, a one-hot q). Draft `d` is accepted with probability `min(1, p(d)/q(d))`; on
/// rejection the next token is drawn from the normalised residual `max(p − q, 0)`; if every draft
/// is accepted the bonus token is drawn from the last row. `uniform(lane)` supplies the draws.
pub fn accept_stochastic(
    drafts: &[u32],
    draft_probs: Option<&[Vec<f32>]>,
    target_probs: &[Vec<f32>],
    mut uniform: impl FnMut(u64) -> f64,
) -> Result<Acceptance> {
    check(drafts, target_probs.len())?;
    if let Some(q) = draft_probs {
        if q.len() != drafts.len() {
            return Err(Error::Shape(format!(
                "{} drafts but {} draft distributions",
                drafts.len(),
                q.len()
            )));
        }
        if let Some((j, qj)) = q
            .iter()
            .enumerate()
            .find(|(j, qj)| qj.len() != target_probs[*j].len())
        {
            return Err(Error::Shape(format!(
                "draft distribution {j} has {} entries, the target's {}",
                qj.len(),
                target_probs[j].len()
            )));
        }
    }
    for (j, &d) in drafts.iter().enumerate() {
        let p = &target_probs[j];
        let pd = *p
            .get(d as usize)
            .ok_or_else(|| Error::Shape(format!("draft token {d} outside the vocabulary")))?;
        let qd = draft_probs.map_or(1.0, |q| q[j][d as usize]);
        let u = uniform(2 * j as u64);
        if qd > 0.0 && u < (pd / qd) as f64 {
            continue;
        }
        let residual: Vec<f32> = match draft_probs {
            Some(q) => p.iter().zip(&q[j]).map(|(a, b)| (a - b).max(0.0)).collect(),
            None => {
                let mut r = p.clone();
                r[d as usize] = 0.0;
                r
            }
        };
        // If the residual is empty, p ≤ q everywhere, i.e. p = q: rejection had probability 0.
        let next = match draw_index(&residual, uniform(2 * j as u64 + 1), j) {
            Ok(i) => i as u32,
            Err(_) => argmax(p) as u32,
        };
        return Ok(Acceptance { accepted: j, next });
    }
    let k = drafts.len();
    let next = draw_index(&target_probs[k], uniform(2 * k as u64 + 1), k)? as u32;
    Ok(Acceptance { accepted: k, next })
}
