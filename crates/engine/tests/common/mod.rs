//! Helpers of the engine's test suites: the bundled model, a request's solo greedy run, and
//! what a handle received.

#![allow(dead_code)]

use qwen36_engine::{Engine, Event, Request, RequestHandle, Speculation, StopReason, Usage};
use qwen36_model::Qwen36Model;
use qwen36_sampling::Sampled;
use qwen36_testutil::ids_tensor;

#[path = "../../../testutil/include/model.rs"]
pub mod model_helpers;

pub fn bundled() -> Qwen36Model {
    model_helpers::load_bundled().0
}

/// Greedy decoding of `n` tokens alone through a `Cache` (one token per forward after the whole
/// prompt), with each step's f32 logits.
pub fn solo(model: &Qwen36Model, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut cache = model.new_cache(1).unwrap();
    let mut logits = model.forward_last(&ids_tensor(prompt), &mut cache).unwrap();
    let (mut ids, mut rows) = (Vec::new(), Vec::new());
    loop {
        let row = logits.squeeze(0).unwrap().to_vec1::<f32>().unwrap();
        let next = logits.argmax(1).unwrap().to_vec1::<u32>().unwrap()[0];
        ids.push(next);
        rows.push(row);
        if ids.len() == n {
            return (ids, rows);
        }
        logits = model.forward_last(&ids_tensor(&[next]), &mut cache).unwrap();
    }
}

/// Everything a handle received: the prompt's log-probabilities, the ids, their text, the
/// per-token log-probabilities, and how it ended.
pub struct Outcome {
    pub prompt: Option<Vec<Sampled>>,
    pub ids: Vec<u32>,
    pub text: String,
    pub logprobs: Vec<f32>,
    pub end: Option<(StopReason, Usage)>,
}

pub fn collect(h: &RequestHandle) -> Outcome {
    let mut o = Outcome {
        prompt: None,
        ids: Vec::new(),
        text: String::new(),
        logprobs: Vec::new(),
        end: None,
    };
    for e in h.drain() {
        assert!(o.end.is_none(), "an event after the request ended: {e:?}");
        match e {
            Event::Prompt { logprobs } => {
                assert!(
                    o.prompt.is_none() && o.ids.is_empty(),
                    "prompt log-probabilities twice or late"
                );
                o.prompt = Some(logprobs);
            }
            Event::Token { ids, text, logprobs } => {
                o.ids.extend(&ids);
                o.text.push_str(&text);
                o.logprobs
                    .extend(logprobs.into_iter().flatten().map(|s| s.logprob));
            }
            Event::Finished { reason, usage } => o.end = Some((reason, usage)),
            Event::Failed { error } => panic!("request failed: {error}"),
        }
    }
    o
}

/// `log_softmax(row)` in f64, as f32.
pub fn log_softmax(row: &[f32]) -> Vec<f32> {
    let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let lse = m as f64 + row.iter().map(|&l| ((l - m) as f64).exp()).sum::<f64>().ln();
    row.iter().map(|&l| (l as f64 - lse) as f32).collect()
}

/// Checks prompt log-probabilities against one forward of the whole prompt through a `Cache`
/// (every position's logits): `got[i]` is `prompt[i + 1]`'s log-probability within `2·rel` of
/// the row's largest logit (a log-probability moves by at most twice a logit's change), with
/// `top` alternatives in descending order, each within that tolerance, none below a token left
/// out by more than it.
pub fn check_prompt_logprobs(
    model: &Qwen36Model,
    prompt: &[u32],
    got: &[Sampled],
    top: usize,
    rel: f32,
    what: &str,
) {
    assert_eq!(
        got.len(),
        prompt.len() - 1,
        "{what}: one per prompt token but the first"
    );
    let mut cache = model.new_cache(1).unwrap();
    let rows = model
        .forward(&ids_tensor(prompt), &mut cache)
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    for (i, s) in got.iter().enumerate() {
        let scale = rows[i].iter().fold(0f32, |m, v| m.max(v.abs()));
        let tol = 2.0 * rel * scale;
        let want = log_softmax(&rows[i]);
        assert_eq!(s.token, prompt[i + 1], "{what}: position {i}'s token");
        let err = (s.logprob - want[s.token as usize]).abs();
        assert!(err <= tol, "{what}: position {i}: log-probability off by {err:e}");
        // Its rank: 1 + the tokens above it, within the tolerance of the reference's.
        let own = want[s.token as usize];
        let surely_above = want.iter().filter(|&&x| x > own + tol).count() as u32;
        let maybe_above = want.iter().filter(|&&x| x >= own - tol).count() as u32 - 1;
        let rank = s.rank.expect("prompt tokens are ranked");
        assert!(
            (surely_above + 1..=maybe_above + 1).contains(&rank),
            "{what}: position {i}: rank {rank}, want {}..={}",
            surely_above + 1,
            maybe_above + 1
        );
        assert_eq!(s.top_logprobs.len(), top, "{what}: position {i}'s alternatives");
        for (j, &(t, lp)) in s.top_logprobs.iter().enumerate() {
            let err = (lp - want[t as usize]).abs();
            assert!(
                err <= tol,
                "{what}: position {i}, alternative {j}: off by {err:e}"
            );
            if j > 0 {
                assert!(
                    lp <= s.top_logprobs[j - 1].1,
                    "{what}: position {i}: not descending"
                );
            }
        }
        if let Some(&(_, last)) = s.top_logprobs.last() {
            let best_left_out = (0..want.len() as u32)
                .filter(|t| !s.top_logprobs.iter().any(|a| a.0 == *t))
                .map(|t| want[t as usize])
                .fold(f32::NEG_INFINITY, f32::max);
            assert!(
                best_left_out <= last + tol,
                "{what}: position {i}: a likelier token left out"
            );
        }
    }
}

/// Runs `prompt` alone through `engine` for its log-probabilities (`max_tokens` 0, `top`
/// alternatives, drafting with `speculation`): they and the usage, once checked that the
/// request ended at `MaxTokens` without a token.
pub fn prompt_alone(
    engine: &mut Engine,
    prompt: &[u32],
    top: usize,
    speculation: Option<Speculation>,
) -> (Vec<Sampled>, Usage) {
    let mut req = Request::greedy(prompt.to_vec(), 0);
    req.prompt_logprobs = Some(top);
    req.speculation = speculation;
    let h = engine.submit(req).unwrap();
    engine.run_to_completion().unwrap();
    let o = collect(&h);
    let (reason, usage) = o.end.expect("it ended");
    assert_eq!(
        (reason, usage.completion_tokens, o.ids.len()),
        (StopReason::MaxTokens, 0, 0)
    );
    assert_eq!(usage.prompt_tokens, prompt.len());
    (o.prompt.expect("prompt log-probabilities"), usage)
}
