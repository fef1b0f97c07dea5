//! Degenerate output as it is generated: a loop (the same tokens over and over, "prime prime
//! prime…", the signature of a mishandled GDN state or greedy decoding without penalties) or an
//! entropy collapse (a distribution that stays near one-hot for a long stretch). O(max period)
//! per token, so it can watch every step of every sequence.

use std::collections::VecDeque;

/// The longest loop period a watch may look for (it costs that much per token).
pub const MAX_LOOP_PERIOD: usize = 1024;

/// When output counts as degenerate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DegenerationConfig {
    /// Loops of 1..=`max_period` tokens are watched.
    pub max_period: usize,
    /// A loop counts once its repeating stretch holds at least `min_repeats` periods and
    /// `min_span` tokens.
    pub min_repeats: usize,
    pub min_span: usize,
    /// Entropy collapse: `entropy_window` consecutive steps whose distribution's entropy (nats)
    /// is below `entropy_floor` (steps without an entropy, such as on-device greedy picks, are
    /// not counted either way); a window of 0 turns this off.
    pub entropy_window: usize,
    pub entropy_floor: f32,
}

impl Default for DegenerationConfig {
    /// Conservative: a loop of up to 32 tokens repeated 4 times over at least 64 tokens, or 128
    /// steps below 0.001 nats (measured false-positive rates in the tests and docs/TESTING.md).
    fn default() -> Self {
        Self {
            max_period: 32,
            min_repeats: 4,
            min_span: 64,
            entropy_window: 128,
            entropy_floor: 1e-3,
        }
    }
}

impl DegenerationConfig {
    /// Checks the ranges: 1 <= `max_period` <= [`MAX_LOOP_PERIOD`], `entropy_floor` >= 0.
    pub fn validate(&self) -> crate::Result<()> {
        if !(1..=MAX_LOOP_PERIOD).contains(&self.max_period) {
            return Err(crate::Error::Param {
                name: "max_period",
                value: self.max_period as f64,
                msg: "must be in 1..=MAX_LOOP_PERIOD (1024)",
            });
        }
        if self.entropy_floor.is_nan() || self.entropy_floor < 0.0 {
            return Err(crate::Error::Param {
                name: "entropy_floor",
                value: self.entropy_floor as f64,
                msg: "must be >= 0",
            });
        }
        Ok(())
    }
}

/// What was detected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Degeneration {
    /// The last `span` tokens repeat a period of `period` tokens.
    Loop { period: usize, span: usize },
    /// `steps` consecutive near-one-hot distributions.
    EntropyCollapse { steps: usize },
}

impl std::fmt::Display for Degeneration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Degeneration::Loop { period, span } => {
                write!(
                    f,
                    "a loop of {period} token(s) repeated over the last {span} tokens"
                )
            }
            Degeneration::EntropyCollapse { steps } => {
                write!(f, "{steps} steps in a row with a near one-hot distribution")
            }
        }
    }
}

/// Watches one sequence's tokens ([`Self::observe`] each one).
#[derive(Debug, Clone)]
pub struct RepetitionDetector {
    cfg: DegenerationConfig,
    /// The last `max_period` tokens, newest last.
    recent: VecDeque<u32>,
    /// Per period p (index p − 1): how many of the latest tokens equal the token p before them.
    runs: Vec<usize>,
    low_entropy: usize,
    first: Option<Degeneration>,
}

impl RepetitionDetector {
    pub fn new(cfg: DegenerationConfig) -> Self {
        Self {
            recent: VecDeque::with_capacity(cfg.max_period + 1),
            runs: vec![0; cfg.max_period],
            low_entropy: 0,
            first: None,
            cfg,
        }
    }

    /// Takes the next token (and its step's entropy when known); returns what this token makes
    /// degenerate, if anything (the shortest loop period first).
    pub fn observe(&mut self, token: u32, entropy: Option<f32>) -> Option<Degeneration> {
        let n = self.recent.len();
        for p in 1..=self.cfg.max_period {
            let repeats = n >= p && self.recent[n - p] == token;
            self.runs[p - 1] = if repeats { self.runs[p - 1] + 1 } else { 0 };
        }
        self.recent.push_back(token);
        if self.recent.len() > self.cfg.max_period {
            self.recent.pop_front();
        }
        match entropy {
            Some(e) if e < self.cfg.entropy_floor => self.low_entropy += 1,
            Some(_) => self.low_entropy = 0,
            None => {}
        }
        let found = (1..=self.cfg.max_period)
            .find_map(|p| {
                // A run of r matches after p tokens is a periodic stretch of r + p tokens.
                let span = self.runs[p - 1] + p;
                (span >= self.cfg.min_span && span >= self.cfg.min_repeats * p)
                    .then_some(Degeneration::Loop { period: p, span })
            })
            .or_else(|| {
                (self.cfg.entropy_window > 0 && self.low_entropy >= self.cfg.entropy_window).then_some(
                    Degeneration::EntropyCollapse {
                        steps: self.low_entropy,
                    },
                )
            });
        if self.first.is_none() {
            self.first = found;
        }
        found
    }

    /// The first degeneration seen, if any.
    pub fn first(&self) -> Option<Degeneration> {
        self.first
    }
}

/// The entropy (nats) of the softmax of `logits`.
pub fn entropy(logits: &[f32]) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return 0.0;
    }
    let (mut z, mut s) = (0f64, 0f64);
    for &l in logits {
        let d = (l - max) as f64;
        let e = d.exp();
        z += e;
        s += e * d;
    }
    (z.ln() - s / z) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(tokens: &[u32], cfg: DegenerationConfig) -> Option<(usize, Degeneration)> {
        let mut d = RepetitionDetector::new(cfg);
        tokens
            .iter()
            .enumerate()
            .find_map(|(i, &t)| d.observe(t, None).map(|g| (i, g)))
    }

    /// One token repeated ("prime prime prime…") is found once the stretch is 64 tokens long;
    /// a 5-token loop likewise; a 40-token period (past max_period) is not.
    #[test]
    fn loops_are_found_when_they_are_long_enough() {
        let cfg = DegenerationConfig::default();
        let prime: Vec<u32> = [1, 2, 3].into_iter().chain(std::iter::repeat_n(7, 100)).collect();
        assert_eq!(
            run(&prime, cfg),
            Some((66, Degeneration::Loop { period: 1, span: 64 }))
        );
        let five: Vec<u32> = (0..200).map(|i| [10, 11, 12, 13, 14][i % 5]).collect();
        assert_eq!(
            run(&five, cfg),
            Some((63, Degeneration::Loop { period: 5, span: 64 }))
        );
        let long: Vec<u32> = (0..400).map(|i| (i % 40) as u32).collect();
        assert_eq!(run(&long, cfg), None);
        // Four repeats are needed even when the span is long enough: a period of 32 needs 128.
        let p32: Vec<u32> = (0..300).map(|i| (i % 32) as u32 + 100).collect();
        assert_eq!(
            run(&p32, cfg),
            Some((
                127,
                Degeneration::Loop {
                    period: 32,
                    span: 128
                }
            ))
        );
    }

    /// A repeat that breaks off starts over: stretches shorter than the span never count.
    #[test]
    fn broken_repeats_start_over() {
        let cfg = DegenerationConfig::default();
        let mut t = Vec::new();
        for k in 0..20u32 {
            t.extend(std::iter::repeat_n(5, 40));
            t.push(1000 + k);
        }
        assert_eq!(run(&t, cfg), None);
    }

    /// Entropy collapse: 128 near-one-hot steps in a row; one confident step among them resets
    /// the count, and steps without an entropy leave it.
    #[test]
    fn entropy_collapse_needs_a_long_stretch() {
        let cfg = DegenerationConfig::default();
        let mut d = RepetitionDetector::new(cfg);
        for i in 0..127u32 {
            assert_eq!(d.observe(i, Some(1e-4)), None);
        }
        assert_eq!(d.observe(1000, None), None);
        assert_eq!(
            d.observe(127, Some(1e-4)),
            Some(Degeneration::EntropyCollapse { steps: 128 })
        );
        assert_eq!(d.first(), Some(Degeneration::EntropyCollapse { steps: 128 }));
        let mut d = RepetitionDetector::new(cfg);
        for i in 0..300u32 {
            let e = if i % 100 == 99 { 0.5 } else { 1e-4 };
            assert_eq!(d.observe(i, Some(e)), None, "step {i}");
        }
    }

    #[test]
    fn entropy_of_known_distributions() {
        assert!((entropy(&[0.0; 4]) - 4f32.ln()).abs() < 1e-6);
        assert!(entropy(&[0.0, -100.0, -100.0]) < 1e-30);
        assert!((entropy(&[1.0, 1.0]) - 2f32.ln()).abs() < 1e-6);
        // An uneven distribution against -Σ p·ln p computed directly.
        let logits = [1.0f32, 2.0, 4.0, -1.0];
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        let want: f64 = logits
            .iter()
            .map(|&l| {
                let p = (l as f64).exp() / z;
                -p * p.ln()
            })
            .sum();
        assert!(
            (entropy(&logits) as f64 - want).abs() < 1e-6,
            "{} against {want}",
            entropy(&logits)
        );
        // Large logits (shifted by their maximum, so no exp overflows).
        let e = entropy(&[400.0, 399.0]);
        assert!((e - entropy(&[1.0, 0.0])).abs() < 1e-6, "{e}");
    }

    /// Exactly at the floor is not below it; a window of 0 turns the entropy watch off.
    #[test]
    fn entropy_floor_and_window_edges() {
        let cfg = DegenerationConfig {
            entropy_window: 2,
            ..DegenerationConfig::default()
        };
        let mut d = RepetitionDetector::new(cfg);
        assert_eq!(d.observe(1, Some(cfg.entropy_floor)), None);
        assert_eq!(
            d.observe(2, Some(cfg.entropy_floor)),
            None,
            "the floor itself is not low"
        );
        let off = DegenerationConfig {
            entropy_window: 0,
            ..DegenerationConfig::default()
        };
        let mut d = RepetitionDetector::new(off);
        for t in 0..10 {
            assert_eq!(d.observe(t, Some(0.0)), None);
        }
    }

    #[test]
    fn ranges_are_checked() {
        assert!(DegenerationConfig::default().validate().is_ok());
        let with = |max_period, entropy_floor| DegenerationConfig {
            max_period,
            entropy_floor,
            ..Default::default()
        };
        assert!(with(1, 0.0).validate().is_ok());
        assert!(with(MAX_LOOP_PERIOD, 0.0).validate().is_ok());
        let msg = with(0, 0.0).validate().unwrap_err().to_string();
        assert!(msg.contains(&format!("({MAX_LOOP_PERIOD})")), "{msg}");
        for (cfg, name) in [
            (with(0, 0.0), "max_period"),
            (with(MAX_LOOP_PERIOD + 1, 0.0), "max_period"),
            (with(8, -1e-9), "entropy_floor"),
            (with(8, f32::NAN), "entropy_floor"),
        ] {
            match cfg.validate() {
                Err(crate::Error::Param { name: n, .. }) => assert_eq!(n, name),
                other => panic!("{cfg:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn degenerations_say_what_they_are() {
        let l = Degeneration::Loop { period: 3, span: 64 }.to_string();
        assert_eq!(l, "a loop of 3 token(s) repeated over the last 64 tokens");
        let e = Degeneration::EntropyCollapse { steps: 128 }.to_string();
        assert_eq!(e, "128 steps in a row with a near one-hot distribution");
    }
}
