//! Helpers of the engine's test suites: the bundled model, a request's solo greedy run, and
//! what a handle received.

#![allow(dead_code)]

use qwen36_engine::{Event, RequestHandle, StopReason, Usage};
use qwen36_model::Qwen36Model;
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

/// Everything a handle received: the ids, their text, the per-token log-probabilities, and how
/// it ended.
pub struct Outcome {
    pub ids: Vec<u32>,
    pub text: String,
    pub logprobs: Vec<f32>,
    pub end: Option<(StopReason, Usage)>,
}

pub fn collect(h: &RequestHandle) -> Outcome {
    let mut o = Outcome {
        ids: Vec::new(),
        text: String::new(),
        logprobs: Vec::new(),
        end: None,
    };
    for e in h.drain() {
        assert!(o.end.is_none(), "an event after the request ended: {e:?}");
        match e {
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
