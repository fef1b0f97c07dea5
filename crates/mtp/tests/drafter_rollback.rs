//! The MTP drafter's rollback: after every commit, whatever its last chain left in the head's
//! cache, its k proposals equal those of a fresh head run over the committed (hidden, token) pairs.

mod common;

use candle_core::Tensor;
use common::*;
use qwen36_model::{MtpHead, Qwen36Model};
use qwen36_mtp::{DraftContext, Drafter, MtpDrafter};
use qwen36_sampling::SamplingParams;

/// Wraps an [`MtpDrafter`] and checks each proposal against a new drafter fed every committed
/// pair at once.
struct Checked<'m> {
    model: &'m Qwen36Model,
    head: &'m MtpHead,
    inner: MtpDrafter<'m>,
    /// Target hidden states of every committed position so far, `[1, n, hidden]`.
    hidden: Option<Tensor>,
    proposals: usize,
}

impl Drafter for Checked<'_> {
    fn propose(&mut self, ctx: &DraftContext, k: usize) -> qwen36_mtp::Result<Vec<u32>> {
        let all = match &self.hidden {
            Some(h) => Tensor::cat(&[h, ctx.new_hidden], 1)?,
            None => ctx.new_hidden.clone(),
        };
        let got = self.inner.propose(ctx, k)?;
        let fresh = MtpDrafter::new(self.model, self.head).propose(
            &DraftContext {
                tokens: ctx.tokens,
                new_hidden: &all,
            },
            k,
        )?;
        assert_eq!(
            got,
            fresh,
            "proposal {} after {} tokens",
            self.proposals,
            ctx.tokens.len()
        );
        self.hidden = Some(all);
        self.proposals += 1;
        Ok(got)
    }
    fn reset(&mut self) {
        self.inner.reset();
        self.hidden = None;
    }
}

fn run(
    model: &Qwen36Model,
    head: &MtpHead,
    prompt: &[u32],
    k: usize,
    params: SamplingParams,
    n: usize,
) -> Vec<usize> {
    let mut checked = Checked {
        model,
        head,
        inner: MtpDrafter::new(model, head),
        hidden: None,
        proposals: 0,
    };
    let out = speculate(model, params, &mut checked, prompt, k, n);
    // Every cycle drafts but a last one with one token to go (a plain step: k drafts give up to
    // k + 1 tokens).
    let plain = out.stats.cycles - checked.proposals;
    assert!(
        plain <= 1,
        "{} proposals in {} cycles",
        checked.proposals,
        out.stats.cycles
    );
    out.stats.accepted_len_hist
}

/// The bundled model's trained head (drafts accepted ~60%): every accepted length 0..=k occurs,
/// so the head's cache is cut back by every possible amount.
#[test]
fn bundled_model_proposals_equal_a_fresh_head_after_every_commit() {
    let (model, head) = load_bundled();
    for (k, params) in [
        (2, SamplingParams::greedy()),
        (
            3,
            SamplingParams {
                temperature: 0.8,
                seed: 3,
                ..Default::default()
            },
        ),
    ] {
        let hist = run(&model, &head, &bundled_prompt(0), k, params, 96);
        eprintln!("bundled k={k}: accepted lengths {hist:?}");
        assert_every_accepted_length(&hist, &format!("k={k}"));
    }
}

/// The random fixtures (drafts almost always rejected: the cache is cut back every cycle).
#[test]
fn fixture_proposals_equal_a_fresh_head_after_every_commit() {
    for name in FIXTURES {
        let (model, head, p) = load_with_prompt(name, "prompt0.ids", 40);
        run(&model, &head, &p, 3, SamplingParams::greedy(), 48);
    }
}

/// Asked for no drafts, given no new hidden state, or fewer tokens than hidden states to pair them
/// with, the drafter proposes nothing.
#[test]
fn no_drafts_asked_or_nothing_new_proposes_nothing() {
    let (model, head, p) = load_with_prompt("tiny-flat", "prompt0.ids", 10);
    let mut cache = model.new_cache(1).unwrap();
    let hidden = model.forward_hidden(&ids_tensor(&p), &mut cache).unwrap();
    let mut tokens = p.clone();
    tokens.push(1);
    let mut d = MtpDrafter::new(&model, &head);
    let ctx = DraftContext {
        tokens: &tokens,
        new_hidden: &hidden,
    };
    assert!(d.propose(&ctx, 0).unwrap().is_empty());
    assert_eq!(d.propose(&ctx, 3).unwrap().len(), 3);
    let none = hidden.narrow(1, 0, 0).unwrap();
    let ctx = DraftContext {
        tokens: &tokens,
        new_hidden: &none,
    };
    assert!(d.propose(&ctx, 3).unwrap().is_empty());
    // Fewer tokens than the hidden states they should follow: nothing to pair, nothing proposed.
    let ctx = DraftContext {
        tokens: &p,
        new_hidden: &hidden,
    };
    assert!(d.propose(&ctx, 3).unwrap().is_empty());
}
