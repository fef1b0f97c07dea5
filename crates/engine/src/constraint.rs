//! Structured output: a request's [`Constraint`] masks the tokens its output may not take next,
//! before sampling and before a verify's acceptance, so that plain and speculative decoding
//! draw from the same masked distributions (speculation stays lossless under a constraint).

use std::sync::Arc;

/// What a request's output must match (a grammar, a JSON schema): the tokens allowed next,
/// given the tokens it has followed.
pub trait Constraint: Send + std::fmt::Debug {
    /// Sets the logit of every token not allowed next to −∞ (`logits: [vocab]`); an error when
    /// the output can no longer match.
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), String>;
    /// Follows `tokens`, emitted (or, in a verify, tried) after those it has followed.
    fn consume(&mut self, tokens: &[u32]) -> Result<(), String>;
    /// Forgets the last `n` tokens it followed (a verify's tried drafts).
    fn rollback(&mut self, n: usize) -> Result<(), String>;
}

/// Makes a fresh [`Constraint`] for each request that asks for one (the choices of one HTTP
/// request share the spec, each follows its own output).
pub trait ConstraintSpec: Send + Sync + std::fmt::Debug {
    fn start(&self) -> Result<Box<dyn Constraint>, String>;
}

/// A request's constraint spec ([`crate::Request::constraint`]); two are equal when they are
/// the same spec.
#[derive(Debug, Clone)]
pub struct OutputConstraint(pub Arc<dyn ConstraintSpec>);

impl PartialEq for OutputConstraint {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// `row` masked by `c`: an error when it leaves no token (the output could not go on).
pub(crate) fn masked(c: &mut dyn Constraint, row: &[f32]) -> Result<Vec<f32>, String> {
    let mut out = row.to_vec();
    c.mask(&mut out).map_err(|e| format!("output constraint: {e}"))?;
    if out.iter().all(|&l| l == f32::NEG_INFINITY) {
        return Err("output constraint: no token is allowed".into());
    }
    Ok(out)
}

/// A verify's rows masked by `c`: row `j` after the drafts before it, tried in turn and forgotten
/// after. Rows past a draft the constraint refuses stay as they are: acceptance stops at that
/// draft (its masked row cannot give it), so they are never read. A mask that fails after tried
/// drafts ends the rows there (verifying fewer drafts): plain decoding meets that failure only
/// if those drafts are its tokens, and then at its next mask.
pub(crate) fn masked_rows(
    c: &mut dyn Constraint,
    drafts: &[u32],
    rows: &[Vec<f32>],
) -> Result<Vec<Vec<f32>>, String> {
    let mut out = Vec::with_capacity(rows.len());
    let mut tried = 0;
    let mut masking = || -> Result<(), String> {
        for (j, row) in rows.iter().enumerate() {
            if j > tried {
                out.push(row.clone());
                continue;
            }
            let m = match masked(c, row) {
                Ok(m) => m,
                Err(_) if j > 0 => return Ok(()),
                Err(e) => return Err(e),
            };
            if let Some(&d) = drafts.get(j) {
                if m.get(d as usize).is_some_and(|&l| l > f32::NEG_INFINITY) {
                    c.consume(&[d]).map_err(|e| format!("output constraint: {e}"))?;
                    tried += 1;
                }
            }
            out.push(m);
        }
        Ok(())
    };
    let done = masking();
    // (Forgotten whether masking failed or not.)
    let forgotten = match tried {
        0 => Ok(()),
        n => c.rollback(n).map_err(|e| format!("output constraint: {e}")),
    };
    done.and(forgotten).map(|()| out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Never;

    impl ConstraintSpec for Never {
        fn start(&self) -> Result<Box<dyn Constraint>, String> {
            Err("never".into())
        }
    }

    /// Allows only even tokens; fails to mask once it has followed `fail_at` tokens.
    #[derive(Debug, Default)]
    struct Evens {
        followed: Vec<u32>,
        fail_at: Option<usize>,
    }

    impl Constraint for Evens {
        fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
            if self.fail_at == Some(self.followed.len()) {
                return Err("stuck".into());
            }
            for l in logits.iter_mut().skip(1).step_by(2) {
                *l = f32::NEG_INFINITY;
            }
            Ok(())
        }

        fn consume(&mut self, tokens: &[u32]) -> Result<(), String> {
            self.followed.extend(tokens);
            Ok(())
        }

        fn rollback(&mut self, n: usize) -> Result<(), String> {
            let keep = self.followed.len().checked_sub(n).ok_or("too far")?;
            self.followed.truncate(keep);
            Ok(())
        }
    }

    const ODD: f32 = f32::NEG_INFINITY;

    /// Row `j` is masked after the drafts before it; rows past a refused draft stay as they
    /// are; a mask failing after tried drafts ends the rows there; the tried drafts are
    /// forgotten either way; a failure at the first row is an error.
    #[test]
    fn a_verifys_rows_are_masked_after_the_drafts_before_them() {
        let rows = vec![vec![1.0, 2.0, 3.0, 4.0]; 4];
        let masked = vec![1.0, ODD, 3.0, ODD];
        let mut c = Evens::default();
        // Drafts 2 (allowed), 3 (refused), 0: the row after the refused one is left.
        let out = masked_rows(&mut c, &[2, 3, 0], &rows).unwrap();
        assert_eq!(
            out,
            vec![masked.clone(), masked.clone(), rows[2].clone(), rows[3].clone()]
        );
        assert!(c.followed.is_empty(), "tried drafts forgotten");
        let mut c = Evens {
            fail_at: Some(2),
            ..Default::default()
        };
        let out = masked_rows(&mut c, &[0, 2, 4], &rows).unwrap();
        assert_eq!(
            out,
            vec![masked.clone(), masked.clone()],
            "rows up to the failing mask"
        );
        assert!(c.followed.is_empty(), "tried drafts forgotten");
        let mut c = Evens {
            fail_at: Some(0),
            ..Default::default()
        };
        assert_eq!(
            masked_rows(&mut c, &[0], &rows[..2]),
            Err("output constraint: stuck".to_string())
        );
    }

    /// Two requests' constraints are equal when they share one spec, not when their specs are
    /// alike.
    #[test]
    fn constraints_are_equal_by_their_spec() {
        let a = OutputConstraint(Arc::new(Never));
        assert_eq!(a, a.clone());
        assert_ne!(a, OutputConstraint(Arc::new(Never)));
    }
}
