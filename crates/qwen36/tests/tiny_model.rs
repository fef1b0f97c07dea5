//! The bundled model (models/qwen36-tiny, trained by tools/train-tiny/train.py) against the
//! PyTorch / transformers numbers recorded at training time (models/qwen36-tiny.reference.safetensors,
//! f32 from the shipped bf16 weights).

mod common;

use std::collections::HashMap;

use candle_core::{Device, Tensor, D};
use common::*;
use qwen36::mtp::{MtpDrafter, SpecConfig, SpeculativeDecoder};
use qwen36::{GenerateOptions, Generator, SamplingParams};

fn ids(r: &HashMap<String, Tensor>, key: &str) -> Vec<u32> {
    ids_of(&r[key])
}

fn scalar(r: &HashMap<String, Tensor>, key: &str) -> f64 {
    r[key].to_vec1::<f64>().unwrap()[0]
}

fn generator() -> Generator {
    load_generator(bundled_dir())
}

/// Mean next-token NLL over 4 windows of 512 held-out tokens equals PyTorch's to 1e-3 relative
/// (both f32 from the same bf16 weights; summation order differs, ~1e-6 per logit).
#[test]
fn heldout_perplexity_matches_pytorch() {
    let g = generator();
    let r = bundled_reference();
    let all = ids(&r, "heldout.ids");
    let windows = (all.len() - 1) / 512;
    let mut nll = 0.0f64;
    for w in 0..windows {
        let x = &all[w * 512..(w + 1) * 512 + 1];
        let mut cache = g.model().new_cache(1).unwrap();
        let input = Tensor::new(&x[..512], g.model().device())
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let logits = g
            .model()
            .forward(&input, &mut cache)
            .unwrap()
            .to_device(&Device::Cpu)
            .unwrap();
        let lp = candle_nn_log_softmax(&logits.squeeze(0).unwrap());
        for (t, &next) in x[1..].iter().enumerate() {
            nll -= lp[t][next as usize] as f64;
        }
    }
    let ours = nll / (windows * 512) as f64;
    let theirs = scalar(&r, "heldout.mean_nll");
    eprintln!(
        "held-out mean NLL: ours {ours:.6}, PyTorch {theirs:.6} (ppl {:.3})",
        ours.exp()
    );
    assert!(((ours - theirs) / theirs).abs() < 1e-3, "{ours} vs {theirs}");
}

fn candle_nn_log_softmax(logits: &Tensor) -> Vec<Vec<f32>> {
    let m = logits.max_keepdim(D::Minus1).unwrap();
    let z = logits.broadcast_sub(&m).unwrap();
    let lse = z.exp().unwrap().sum_keepdim(D::Minus1).unwrap().log().unwrap();
    z.broadcast_sub(&lse).unwrap().to_vec2().unwrap()
}

#[test]
fn greedy_generation_matches_transformers_for_64_tokens() {
    let g = generator();
    let r = bundled_reference();
    for p in 0..3 {
        let prompt = ids(&r, &format!("prompt{p}.ids"));
        let want = ids(&r, &format!("prompt{p}.greedy"));
        let opts = GenerateOptions {
            max_new_tokens: 64,
            sampling: Some(SamplingParams::greedy()),
            stop_token_ids: Some(vec![]),
            ..Default::default()
        };
        let out = g.generate(&prompt, &opts, |_| {}).unwrap();
        assert_eq!(out.tokens, want, "prompt {p}: {:?}", g.decode(&prompt).unwrap());
    }
}

/// Greedy speculative decoding with the trained MTP head, k = 1, on the same greedy paths PyTorch
/// measured: the acceptance rate at draft position 1 is within a few points of PyTorch's
/// teacher-forced rate (the decoder visits only the positions its accepted drafts lead to, so the
/// two estimate the same rate over different position subsets) and clearly above zero.
#[test]
fn mtp_acceptance_matches_pytorch() {
    let g = generator();
    let r = bundled_reference();
    let head = g.mtp_head().expect("the bundled model has an MTP head");
    let (mut reached, mut accepted) = (0usize, 0usize);
    for p in 0..3 {
        let prompt = ids(&r, &format!("prompt{p}.ids"));
        let mut dec = SpeculativeDecoder::new(g.model(), SamplingParams::greedy()).unwrap();
        let mut drafter = MtpDrafter::new(g.model(), head);
        let cfg = SpecConfig {
            k: 1,
            max_new_tokens: 64,
            stop_token_ids: vec![],
        };
        let out = dec.generate(&mut drafter, &prompt, &cfg, |_| true).unwrap();
        assert_eq!(
            out.tokens,
            ids(&r, &format!("prompt{p}.greedy")),
            "speculative output is not the greedy one"
        );
        reached += out.stats.reached[0];
        accepted += out.stats.accepted_at[0];
    }
    let ours = accepted as f64 / reached as f64;
    let theirs = scalar(&r, "mtp.accept_pos1");
    eprintln!("MTP acceptance at position 1: ours {ours:.3} over {reached} drafts, PyTorch {theirs:.3}");
    assert!(ours > 0.3, "acceptance {ours} is not clearly above zero");
    assert!(
        (ours - theirs).abs() < 0.08,
        "acceptance {ours} vs PyTorch {theirs}"
    );
}

/// Default sampling (generation_config.json) over 512 tokens does not fall into a loop: the last
/// 256 tokens are not periodic with any period up to 64.
#[test]
fn default_sampling_does_not_loop() {
    let g = generator();
    for seed in [0u64, 1] {
        let mut params = g
            .generation_config()
            .sampling
            .clone()
            .expect("generation_config samples");
        params.seed = seed;
        let opts = GenerateOptions {
            max_new_tokens: 512,
            sampling: Some(params),
            stop_token_ids: Some(vec![]),
            ..Default::default()
        };
        let out = g.generate_text("def fibonacci(n):", &opts, |_| {}).unwrap();
        let t = &out.tokens[out.tokens.len() - 256..];
        let looping = (1..=64).find(|&p| t[p..].iter().zip(t).all(|(a, b)| a == b));
        assert_eq!(
            looping,
            None,
            "seed {seed}: periodic tail:\n{}",
            out.text.unwrap()
        );
        let distinct: std::collections::HashSet<_> = t.iter().collect();
        assert!(
            distinct.len() > 40,
            "seed {seed}: only {} distinct tokens in the last 256",
            distinct.len()
        );
    }
}

/// Streaming: the printed pieces add up to the final text, which equals a full decode of the
/// generated tokens; a stop string cuts the text before it and ends generation.
#[test]
fn streamed_text_equals_full_decode_and_stop_strings_cut() {
    let g = generator();
    let params = SamplingParams {
        temperature: 0.8,
        top_k: 20,
        seed: 7,
        ..Default::default()
    };
    let opts = GenerateOptions {
        max_new_tokens: 200,
        sampling: Some(params),
        stop_token_ids: Some(vec![]),
        ..Default::default()
    };
    let mut streamed = String::new();
    let out = g
        .generate_text("class Stack:\n", &opts, |ev| streamed.push_str(ev.text))
        .unwrap();
    let text = out.text.clone().unwrap();
    assert_eq!(streamed, text);
    assert_eq!(text, g.decode(&out.tokens).unwrap());
    // Cut at a string that occurs in that output (spanning tokens is likely for "\n    ").
    let stop = "\n    ".to_string();
    let at = text
        .find(&stop)
        .expect("the sampled class body has an indented line");
    let mut streamed = String::new();
    let cut = g
        .generate_text(
            "class Stack:\n",
            &GenerateOptions {
                stop_strings: vec![stop],
                ..opts
            },
            |ev| streamed.push_str(ev.text),
        )
        .unwrap();
    assert_eq!(cut.text.as_deref(), Some(&text[..at]));
    assert_eq!(streamed, text[..at]);
    assert_eq!(cut.stop_reason, qwen36::StopReason::StopString(0));
}

/// The engine, given the generator's detokenizer (the real tokenizer), streams the generator's
/// greedy text, and a stop string cuts both at the same place.
#[test]
fn engine_text_equals_the_generators() {
    use qwen36::engine::{Engine, EngineConfig, Event, Request, StopReason};
    let g = generator();
    let opts = GenerateOptions {
        max_new_tokens: 60,
        sampling: Some(SamplingParams::greedy()),
        stop_token_ids: Some(vec![]),
        ..Default::default()
    };
    let prompt = g.encode("def fibonacci(n):").unwrap();
    let detok = g.detokenizer().expect("the bundled model has a tokenizer");
    let mut engine = Engine::new(g.model().clone(), EngineConfig::default())
        .unwrap()
        .with_detokenizer(detok);
    let mut run = |stops: Vec<String>| {
        let mut req = Request::greedy(prompt.clone(), 60);
        req.stop_strings = stops;
        let h = engine.submit(req).unwrap();
        engine.run_to_completion().unwrap();
        let (mut ids, mut text, mut end) = (Vec::new(), String::new(), None);
        for e in h.drain() {
            match e {
                Event::Token { ids: i, text: t, .. } => {
                    ids.extend(i);
                    text.push_str(&t);
                }
                Event::Finished { reason, .. } => end = Some(reason),
                Event::Failed { error } => panic!("{error}"),
                Event::Prompt { .. } => panic!("prompt log-probabilities not asked for"),
            }
        }
        (ids, text, end)
    };
    let out = g.generate(&prompt, &opts, |_| {}).unwrap();
    let text = out.text.clone().unwrap();
    let (ids, streamed, end) = run(vec![]);
    assert_eq!(ids, out.tokens);
    assert_eq!(streamed, text);
    assert_eq!(end, Some(StopReason::MaxTokens));
    // A stop string from the middle of that text (three characters).
    let mut mid = text.len() / 2;
    while !text.is_char_boundary(mid) {
        mid += 1;
    }
    let stop: String = text[mid..].chars().take(3).collect();
    let cut = g
        .generate(
            &prompt,
            &GenerateOptions {
                stop_strings: vec![stop.clone()],
                ..opts
            },
            |_| {},
        )
        .unwrap();
    let (ids, streamed, end) = run(vec![stop]);
    assert_eq!(ids, cut.tokens);
    assert_eq!(Some(streamed), cut.text);
    assert_eq!(end, Some(StopReason::StopString(0)));
}
