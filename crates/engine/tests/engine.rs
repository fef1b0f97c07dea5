//! The engine against each request run alone: random request sets arriving at random steps,
//! chunked prefill, cancellations and preemptions give every request the tokens (and
//! log-probabilities) of its solo greedy run; seeded sampling is reproducible whatever the batch;
//! bad requests are typed errors; the pools end empty.

mod common;

use common::{bundled, collect, model_helpers, solo, Outcome};

use candle_core::DType;
use std::sync::Arc;

use qwen36_engine::{
    Constraint, ConstraintSpec, Engine, EngineConfig, Error, Event, OutputConstraint, Request, RequestHandle,
    SpecCosts, Speculation, StopReason, MAX_DRAFTS, MAX_LOOP_PERIOD, MAX_NGRAM,
};
use qwen36_model::Qwen36Model;
use qwen36_sampling::{DegenerationConfig, SamplingParams};
use qwen36_testutil::{ids_tensor, Rng};

fn log_softmax_at(row: &[f32], i: usize) -> f32 {
    common::log_softmax(row)[i]
}

/// What a random request set went through.
#[derive(Debug, Default)]
struct Totals {
    preemptions: usize,
    cancels: usize,
    drafted: usize,
    accepted: usize,
    prompt_logprobs: usize,
    /// Requests for prompt log-probabilities that were preempted.
    prompts_preempted: usize,
}

/// A prompt in which the model's own continuation recurs: random ids, the model's greedy
/// continuation of them, then the same ids again (so that prompt lookup drafts what the model
/// is likely to say).
fn echo_prompt(model: &Qwen36Model, rng: &mut Rng, len: usize) -> Vec<u32> {
    let vocab = model.config().vocab_size;
    let seed: Vec<u32> = (0..len.div_ceil(3)).map(|_| rng.below(vocab) as u32).collect();
    let (cont, _) = solo(model, &seed, len.div_ceil(3));
    [&seed[..], &cont, &seed].concat()
}

/// Runs random requests through `engine` (arrivals at random steps, some cancelled; with
/// `speculate`, most with n-gram drafts of random k) and checks each against its solo greedy
/// run.
fn check_random(
    engine: &mut Engine,
    seed: u64,
    n: usize,
    max_prompt: usize,
    speculate: &[Speculation],
) -> Totals {
    let model = engine.model().clone();
    let vocab = model.config().vocab_size;
    let mut rng = Rng::new(seed);
    struct Planned {
        req: Request,
        arrive: usize,
        cancel_at: Option<usize>,
    }
    let planned: Vec<Planned> = (0..n)
        .map(|_| {
            let len = rng.range(1, max_prompt);
            let prompt = match speculate.is_empty() {
                false => echo_prompt(&model, &mut rng, len),
                true => (0..len).map(|_| rng.below(vocab) as u32).collect(),
            };
            let mut req = Request::greedy(prompt, rng.range(1, 20));
            // Half of them read full logits rows, half only the device's argmax; some read
            // their prompt's too.
            req.logprobs = rng.chance(0.5);
            req.prompt_logprobs = rng.chance(0.3).then(|| rng.below(4));
            if !speculate.is_empty() && rng.chance(0.8) {
                req.speculation = Some(speculate[rng.below(speculate.len())]);
            }
            Planned {
                req,
                arrive: rng.below(2 * n),
                cancel_at: rng.chance(0.2).then(|| rng.range(1, 6)),
            }
        })
        .collect();
    let mut handles: Vec<Option<RequestHandle>> = (0..n).map(|_| None).collect();
    let mut outcomes: Vec<Option<Outcome>> = (0..n).map(|_| None).collect();
    let mut step = 0;
    while step < 2 * n || engine.pending() > 0 {
        for (i, p) in planned.iter().enumerate() {
            if p.arrive == step {
                handles[i] = Some(engine.submit(p.req.clone()).unwrap());
            }
            if let (Some(at), Some(h)) = (p.cancel_at, &handles[i]) {
                if p.arrive + at == step {
                    h.cancel();
                }
            }
        }
        engine.step().unwrap();
        step += 1;
        assert!(step < 10_000, "the engine does not finish");
    }
    let mut totals = Totals::default();
    for (i, p) in planned.iter().enumerate() {
        let o = collect(handles[i].as_ref().unwrap());
        let (reason, usage) = o.end.clone().expect("every request ends");
        totals.preemptions += usage.preemptions;
        totals.drafted += usage.speculation.drafted;
        totals.accepted += usage.speculation.accepted;
        let max = p.req.max_tokens.unwrap();
        let (want, rows) = solo(&model, &p.req.prompt, max);
        assert_eq!(usage.prompt_tokens, p.req.prompt.len());
        // The engine's logits are within 1e-5 of the solo run's (CUDA: 1e-4, see
        // model/tests/batch.rs), relative to the row's largest logit.
        let rel = if qwen36_testutil::test_device().is_cuda() {
            1e-4
        } else {
            1e-5
        };
        match (&o.prompt, p.req.prompt_logprobs, &reason) {
            (Some(got), Some(top), _) => {
                totals.prompt_logprobs += 1;
                totals.prompts_preempted += usize::from(usage.preemptions > 0);
                let what = format!("request {i}'s prompt");
                common::check_prompt_logprobs(&model, &p.req.prompt, got, top, rel, &what);
            }
            (None, Some(_), StopReason::Cancelled) | (None, None, _) => {}
            _ => panic!(
                "request {i}: prompt log-probabilities asked {:?}, got {:?}",
                p.req.prompt_logprobs,
                o.prompt.is_some()
            ),
        }
        assert_eq!(usage.completion_tokens, o.ids.len());
        match reason {
            StopReason::MaxTokens => assert_eq!(o.ids, want, "request {i}: tokens differ from its solo run"),
            StopReason::Cancelled => {
                assert!(p.cancel_at.is_some(), "request {i} was cancelled unasked");
                totals.cancels += 1;
                assert_eq!(
                    o.ids,
                    want[..o.ids.len()],
                    "request {i}: tokens before the cancel differ"
                );
            }
            r => panic!("request {i} ended with {r:?}"),
        }
        // A log-probability moves by at most twice a logit's change.
        for (t, (&lp, row)) in o.logprobs.iter().zip(&rows).enumerate() {
            let scale = row.iter().fold(0f32, |m, v| m.max(v.abs()));
            let err = (lp - log_softmax_at(row, want[t] as usize)).abs();
            assert!(
                err <= 2.0 * rel * scale,
                "request {i} token {t}: log-probability off by {err:e}"
            );
        }
        outcomes[i] = Some(o);
    }
    assert_eq!(
        engine.pool_use(),
        (0, 0),
        "the pools must be empty once every request ended"
    );
    totals
}

#[test]
fn random_requests_equal_their_solo_runs() {
    let cfg = EngineConfig {
        max_seqs: 4,
        block_size: 8,
        step_tokens: 48,
        ..Default::default()
    };
    let mut engine = Engine::new(bundled(), cfg).unwrap();
    let totals = check_random(&mut engine, 3, 12, 300, &[]);
    assert!(totals.cancels > 0, "the request set was meant to cancel some");
    assert!(
        totals.prompt_logprobs > 0,
        "the request set was meant to read some prompts"
    );
}

/// KV blocks for about two sequences: the newest is preempted and recomputed, and every result
/// stays that of the solo run.
#[test]
fn preemption_keeps_every_result() {
    let cfg = EngineConfig {
        max_seqs: 4,
        kv_blocks: Some(8),
        block_size: 8,
        step_tokens: 64,
        ..Default::default()
    };
    let mut engine = Engine::new(bundled(), cfg).unwrap();
    let totals = check_random(&mut engine, 8, 8, 40, &[]);
    assert!(
        totals.preemptions > 0,
        "the pool was meant to be too small for every sequence at once"
    );
    assert!(
        totals.prompts_preempted > 0,
        "the request set was meant to preempt some that read their prompts"
    );
}

/// Priorities order admission (lower first, ties by arrival; a later request of a lower value
/// goes before those waiting, without preempting the running one) and preemption (the running
/// request of the highest value goes first, whatever its age), and change no request's tokens.
#[test]
fn priorities_order_admission_and_preemption() {
    let model = bundled();
    let request = |i: u32, priority: i32, n: usize| Request {
        priority,
        ..Request::greedy((1 + i..11 + i).collect(), n)
    };
    // One at a time: the order in which they finish is the order they ran in.
    let cfg = EngineConfig {
        max_seqs: 1,
        ..Default::default()
    };
    let mut engine = Engine::new(model.clone(), cfg).unwrap();
    let mut handles = vec![
        engine.submit(request(0, 0, 3)).unwrap(),
        engine.submit(request(1, 5, 3)).unwrap(),
    ];
    engine.step().unwrap();
    for (i, p) in [(2, -1), (3, 0), (4, -1)] {
        handles.push(engine.submit(request(i, p, 3)).unwrap());
    }
    let (mut finished, mut ids) = (Vec::new(), vec![Vec::new(); handles.len()]);
    while engine.pending() > 0 {
        engine.step().unwrap();
        for (i, h) in handles.iter().enumerate() {
            for e in h.drain() {
                match e {
                    Event::Token { ids: t, .. } => ids[i].extend(t),
                    Event::Finished { .. } => finished.push(i),
                    e => panic!("request {i}: {e:?}"),
                }
            }
        }
    }
    assert_eq!(finished, [0, 2, 4, 3, 1]);
    for (i, ids) in ids.iter().enumerate() {
        assert_eq!(
            ids,
            &solo(&model, &request(i as u32, 0, 3).prompt, 3).0,
            "request {i}"
        );
    }

    // Blocks for one of the two to the end: the older one, of the higher value, is preempted.
    let cfg = EngineConfig {
        max_seqs: 2,
        kv_blocks: Some(8),
        block_size: 8,
        step_tokens: 64,
        ..Default::default()
    };
    let mut engine = Engine::new(model.clone(), cfg).unwrap();
    let reqs = [request(7, 1, 30), request(8, 0, 30)];
    let handles: Vec<RequestHandle> = reqs.iter().map(|r| engine.submit(r.clone()).unwrap()).collect();
    engine.run_to_completion().unwrap();
    let preemptions: Vec<usize> = handles
        .iter()
        .zip(&reqs)
        .map(|(h, r)| {
            let o = collect(h);
            assert_eq!(o.ids, solo(&model, &r.prompt, 30).0);
            o.end.unwrap().1.preemptions
        })
        .collect();
    assert!(preemptions[0] > 0 && preemptions[1] == 0, "{preemptions:?}");
    assert_eq!(engine.pool_use(), (0, 0));
}

/// Greedy speculative decoding with prompt-lookup drafts, batched with plain requests: every
/// request's tokens are its plain solo greedy run's.
#[test]
fn ngram_speculation_equals_plain_greedy() {
    let cfg = EngineConfig {
        max_seqs: 4,
        block_size: 8,
        step_tokens: 40,
        adaptive_k: false,
        ..Default::default()
    };
    let mut engine = Engine::new(bundled(), cfg).unwrap();
    let ks = [1, 2, 3].map(Speculation::ngram);
    let t = check_random(&mut engine, 17, 12, 80, &ks);
    assert!(
        t.accepted > 0 && t.accepted < t.drafted,
        "drafts must be accepted and rejected: {t:?}"
    );
}

fn sampled(prompt: Vec<u32>, seed: u64) -> Request {
    Request {
        sampling: SamplingParams {
            temperature: 1.0,
            top_p: 0.9,
            seed,
            ..Default::default()
        },
        ..Request::greedy(prompt, 16)
    }
}

/// Runs `reqs` submitted in `order`, `max_seqs` at once; the tokens per request (in `reqs` order).
fn run_all(
    model: &Qwen36Model,
    reqs: &[Request],
    order: &[usize],
    max_seqs: usize,
    step_tokens: usize,
) -> Vec<Vec<u32>> {
    let cfg = EngineConfig {
        max_seqs,
        step_tokens,
        adaptive_k: false,
        ..Default::default()
    };
    let mut engine = Engine::new(model.clone(), cfg).unwrap();
    let mut handles: Vec<(usize, RequestHandle)> = order
        .iter()
        .map(|&i| (i, engine.submit(reqs[i].clone()).unwrap()))
        .collect();
    engine.run_to_completion().unwrap();
    handles.sort_by_key(|(i, _)| *i);
    handles.iter().map(|(_, h)| collect(h).ids).collect()
}

#[test]
fn seeded_sampling_is_reproducible_whatever_the_batch() {
    let model = bundled();
    let reqs: Vec<Request> = (0..5u32)
        .map(|i| {
            sampled(
                (0..(3 + 7 * i)).map(|j| (j * 31 + i * 7) % 4000).collect(),
                100 + i as u64,
            )
        })
        .collect();
    let together = run_all(&model, &reqs, &[0, 1, 2, 3, 4], 5, 512);
    let reversed = run_all(&model, &reqs, &[4, 3, 2, 1, 0], 2, 9);
    assert_eq!(together, reversed);
    let alone = run_all(&model, &reqs[2..3], &[0], 1, 512);
    assert_eq!(alone[0], together[2]);
    let mut reseeded = reqs[2].clone();
    reseeded.sampling.seed += 1;
    assert_ne!(
        run_all(&model, &[reseeded], &[0], 1, 512)[0],
        together[2],
        "another seed must draw otherwise"
    );
}

#[test]
fn stop_ids_end_a_request_on_the_id() {
    let model = bundled();
    let prompt: Vec<u32> = (1..20).collect();
    let (want, _) = solo(&model, &prompt, 6);
    let mut engine = Engine::new(model, EngineConfig::default()).unwrap();
    let mut req = Request::greedy(prompt, 6);
    req.stop_ids = vec![want[2]];
    let first = want.iter().position(|&t| t == want[2]).unwrap();
    let h = engine.submit(req).unwrap();
    engine.run_to_completion().unwrap();
    let o = collect(&h);
    assert_eq!(o.ids, want[..=first]);
    assert_eq!(o.end.unwrap().0, StopReason::StopToken(want[2]));
    assert!(h.recv().is_none(), "the sender is dropped after the last event");
}

/// Without `max_tokens` a request runs until the pool (here smaller than the context) is full.
#[test]
fn a_request_without_max_tokens_stops_when_the_pool_is_full() {
    let cfg = EngineConfig {
        max_seqs: 1,
        kv_blocks: Some(3),
        block_size: 8,
        ..mtp_config()
    };
    let mut plain = None;
    // With speculation too: drafts that would run past the pool are dropped, never the
    // sequence (it once ended up to k tokens early, or preempted itself every cycle).
    for spec in [None, Some(Speculation::ngram(3)), Some(Speculation::Mtp { k: 3 })] {
        let (model, head) = model_helpers::load_bundled();
        let mut engine = Engine::with_mtp_head(model, head, cfg.clone()).unwrap();
        let h = engine
            .submit(Request {
                max_tokens: None,
                speculation: spec,
                ..Request::greedy(vec![1, 2, 3, 4, 5], 1)
            })
            .unwrap();
        engine.run_to_completion().unwrap();
        let o = collect(&h);
        assert_eq!(o.end.as_ref().unwrap().0, StopReason::ContextFull, "{spec:?}");
        // 24 positions: the prompt, then generated tokens run up to the last position; the token
        // sampled there is sent too.
        assert_eq!(o.ids.len(), 24 - 5 + 1, "{spec:?}");
        assert_eq!(engine.pool_use(), (0, 0));
        assert_eq!(o.end.as_ref().unwrap().1.preemptions, 0, "{spec:?}");
        match &plain {
            None => plain = Some(o.ids),
            Some(p) => assert_eq!(&o.ids, p, "{spec:?}"),
        }
    }
}

#[test]
fn bad_requests_are_typed_errors() {
    let cfg = EngineConfig {
        max_seqs: 2,
        kv_blocks: Some(4),
        block_size: 8,
        max_queue: 2,
        ..Default::default()
    };
    let model = bundled();
    let vocab = model.config().vocab_size as u32;
    let mut engine = Engine::new(model, cfg).unwrap();
    let err = |e: &mut Engine, r: Request| e.submit(r).unwrap_err();
    assert!(
        matches!(err(&mut engine, Request::greedy(vec![], 4)), Error::Request(m) if m.contains("no tokens"))
    );
    assert!(
        matches!(err(&mut engine, Request::greedy(vec![vocab], 4)), Error::Request(m) if m.contains("outside the vocabulary"))
    );
    assert!(
        matches!(err(&mut engine, Request::greedy(vec![1], 0)), Error::Request(m) if m.contains("max_tokens"))
    );
    let mut hot = Request::greedy(vec![1], 4);
    hot.sampling.temperature = -1.0;
    assert!(matches!(err(&mut engine, hot), Error::Request(m) if m.contains("temperature")));
    let mut biased = Request::greedy(vec![1], 4);
    biased.sampling.logit_bias = vec![(3, 1.0), (vocab, 1.0)];
    assert!(
        matches!(err(&mut engine, biased), Error::Request(m) if m.contains(&format!("logit_bias: token {vocab}")))
    );
    let mut allowed = Request::greedy(vec![1], 4);
    allowed.sampling.allowed_ids = vec![3, vocab];
    assert!(
        matches!(err(&mut engine, allowed), Error::Request(m) if m.contains(&format!("allowed_token_ids: token {vocab}")))
    );
    let mut only_stops = Request::greedy(vec![1], 4);
    only_stops.stop_ids = vec![2, 3];
    only_stops.sampling.allowed_ids = vec![3];
    only_stops.sampling.min_tokens = 1;
    assert!(matches!(err(&mut engine, only_stops.clone()), Error::Request(m) if m.contains("only stop ids")));
    // The others masked by one-id bad words: nothing left either.
    let mut masked = only_stops.clone();
    masked.sampling.allowed_ids = vec![3, 4];
    masked.sampling.bad_words = vec![vec![4], vec![1, 5]];
    assert!(matches!(err(&mut engine, masked.clone()), Error::Request(m) if m.contains("one-id bad word")));
    // One allowed id besides the stop ids and bad words, or no min_tokens, leaves a token to
    // draw.
    let bad = masked.sampling.bad_words.clone();
    for (allowed, min_tokens, bad_words) in [
        (vec![3, 4], 1, vec![]),
        (vec![3], 0, bad.clone()),
        (vec![3, 4, 5], 1, bad.clone()),
        (vec![3, 4], 0, bad),
    ] {
        let mut r = masked.clone();
        r.sampling.allowed_ids = allowed;
        r.sampling.min_tokens = min_tokens;
        r.sampling.bad_words = bad_words;
        engine.submit(r).unwrap().cancel();
    }
    engine.run_to_completion().unwrap();
    // Draft counts, n-gram lengths and loop periods that would overflow, hang or exhaust memory
    // (they once panicked the engine thread at submit or in a step).
    let with = |speculation, degeneration| Request {
        speculation,
        degeneration,
        ..Request::greedy(vec![1], 4)
    };
    let ngram = |k, min_n, max_n| Some(Speculation::Ngram { k, min_n, max_n });
    for (r, says) in [
        (with(ngram(usize::MAX, 1, 4), None), "speculation k"),
        (with(ngram(MAX_DRAFTS + 1, 1, 4), None), "speculation k"),
        (with(ngram(2, 1, usize::MAX), None), "min_n <= max_n"),
        (with(ngram(2, 0, 4), None), "min_n <= max_n"),
        (with(ngram(2, 5, 4), None), "min_n <= max_n"),
        (
            with(
                None,
                Some(DegenerationConfig {
                    max_period: usize::MAX,
                    ..Default::default()
                }),
            ),
            "max_period",
        ),
        (
            with(
                None,
                Some(DegenerationConfig {
                    max_period: 0,
                    ..Default::default()
                }),
            ),
            "max_period",
        ),
        (
            with(
                None,
                Some(DegenerationConfig {
                    entropy_floor: f32::NAN,
                    ..Default::default()
                }),
            ),
            "entropy_floor",
        ),
    ] {
        assert!(
            matches!(err(&mut engine, r.clone()), Error::Request(m) if m.contains(says)),
            "{:?} {:?}",
            r.speculation,
            r.degeneration
        );
    }
    for r in [
        with(ngram(MAX_DRAFTS, 1, MAX_NGRAM), None),
        with(
            None,
            Some(DegenerationConfig {
                max_period: MAX_LOOP_PERIOD,
                ..Default::default()
            }),
        ),
    ] {
        engine.submit(r).unwrap().cancel();
    }
    engine.run_to_completion().unwrap();
    // 32 positions in the pool: prompt + max_tokens − 1 must fit.
    assert!(engine.submit(Request::greedy(vec![1; 30], 3)).is_ok());
    assert!(matches!(
        err(&mut engine, Request::greedy(vec![1; 30], 4)),
        Error::TooLong {
            needed: 34,
            pool: 32,
            ..
        }
    ));
    // Four wait: two for the two free slots, two beyond them; a fifth is refused.
    for _ in 0..3 {
        engine.submit(Request::greedy(vec![1], 2)).unwrap();
    }
    assert!(matches!(
        err(&mut engine, Request::greedy(vec![1], 2)),
        Error::QueueFull(2)
    ));
    assert!(Engine::new(
        bundled(),
        EngineConfig {
            step_tokens: 0,
            ..Default::default()
        }
    )
    .is_err());
    engine.run_to_completion().unwrap();
    assert_eq!(engine.pool_use(), (0, 0));
    // Timing rates that are no probabilities (percentages, NaN, none), and slot counts past
    // usize, are refused when the engine is made.
    for rates in [vec![96.0, 80.0], vec![f64::NAN], vec![]] {
        let cfg = EngineConfig {
            timing_accept_rates: Some(rates.clone()),
            ..Default::default()
        };
        let e = Engine::new(bundled(), cfg).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("[0, 1]"), "{rates:?}: {e}");
    }
    // Nor are rising ones: a draft is accepted only with every draft before it.
    let cfg = EngineConfig {
        timing_accept_rates: Some(vec![0.5, 0.8]),
        ..Default::default()
    };
    let e = Engine::new(bundled(), cfg).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("cannot increase"), "{e}");
    // Equal ones are (a later draft accepted whenever the one before it is).
    let cfg = EngineConfig {
        timing_accept_rates: Some(vec![0.5, 0.5]),
        ..Default::default()
    };
    assert!(Engine::new(bundled(), cfg).is_ok());
    let cfg = EngineConfig {
        prefix_snapshots: usize::MAX,
        ..Default::default()
    };
    assert!(Engine::new(bundled(), cfg).is_err());
    // No queue beyond the free slots: as many requests as slots are taken.
    let cfg = EngineConfig {
        max_seqs: 2,
        max_queue: 0,
        ..Default::default()
    };
    let mut engine = Engine::new(bundled(), cfg).unwrap();
    // (Handles kept: dropping one cancels its request.)
    let _running = [
        engine.submit(Request::greedy(vec![1], 8)).unwrap(),
        engine.submit(Request::greedy(vec![2], 8)).unwrap(),
    ];
    assert!(matches!(
        err(&mut engine, Request::greedy(vec![3], 2)),
        Error::QueueFull(0)
    ));
    engine.step().unwrap();
    assert_eq!(engine.pending(), 2, "both run");
    assert!(matches!(
        err(&mut engine, Request::greedy(vec![3], 2)),
        Error::QueueFull(0)
    ));
    engine.run_to_completion().unwrap();
    engine.submit(Request::greedy(vec![3], 2)).unwrap();
}

#[test]
fn over_the_context_is_refused() {
    let model = model_helpers::load("tiny-flat", DType::F32);
    let context = model.config().max_position_embeddings;
    let mut engine = Engine::new(model, EngineConfig::default()).unwrap();
    assert!(matches!(
        engine.submit(Request::greedy(vec![1; context], 2)).unwrap_err(),
        Error::TooLong { needed, context: c, .. } if needed == context + 2 && c == context
    ));
    assert!(engine.submit(Request::greedy(vec![1; context], 1)).is_ok());
    // A shorter limit of the engine's own: the same refusal at it, and it is what it reports.
    let model = model_helpers::load("tiny-flat", DType::F32);
    let cfg = EngineConfig {
        max_model_len: Some(24),
        ..Default::default()
    };
    let mut engine = Engine::new(model, cfg).unwrap();
    assert_eq!(engine.context(), 24);
    assert!(matches!(
        engine.submit(Request::greedy(vec![1; 20], 6)).unwrap_err(),
        Error::TooLong {
            needed: 26,
            context: 24,
            ..
        }
    ));
    assert!(engine.submit(Request::greedy(vec![1; 20], 5)).is_ok());
    engine.run_to_completion().unwrap();
    assert_eq!(engine.spawn().context(), 24);
}

/// The MTP suites' engine: 4 sequences, blocks of 8, 40 tokens a step, the requested k.
fn mtp_config() -> EngineConfig {
    EngineConfig {
        max_seqs: 4,
        block_size: 8,
        step_tokens: 40,
        adaptive_k: false,
        ..Default::default()
    }
}

/// Greedy MTP speculation (k = 1..3, batched draft steps) beside n-gram and plain requests:
/// every request's tokens are its plain solo greedy run's (on random-token prompts the bundled
/// model's head is accepted less than on text, but both outcomes occur).
#[test]
fn mtp_speculation_equals_plain_greedy() {
    let (model, head) = model_helpers::load_bundled();
    let mut engine = Engine::with_mtp_head(model, head, mtp_config()).unwrap();
    let kinds = [
        Speculation::Mtp { k: 1 },
        Speculation::Mtp { k: 2 },
        Speculation::Mtp { k: 3 },
        Speculation::ngram(2),
    ];
    let t = check_random(&mut engine, 29, 12, 80, &kinds);
    assert!(
        t.accepted > 0 && t.accepted < t.drafted,
        "drafts must be accepted and rejected: {t:?}"
    );
}

/// A request's MTP drafts do not depend on its batch: four greedy requests (k = 3, so every
/// round chains three draft steps, and k = 2) drafted and accepted as many tokens batched as
/// each alone. A draft step that gave one sequence's tokens to another, or a chain that pushed
/// them out of order, would move the counts (the tokens stay lossless either way).
#[test]
fn mtp_drafts_are_the_same_batched_and_alone() {
    let (model, head) = model_helpers::load_bundled();
    let mut rng = Rng::new(41);
    let reqs: Vec<Request> = (0..4)
        .map(|i| Request {
            speculation: Some(Speculation::Mtp { k: 2 + i % 2 }),
            ..Request::greedy(echo_prompt(&model, &mut rng, 9 + 5 * i), 24)
        })
        .collect();
    let run = |reqs: &[Request]| -> Vec<(Vec<u32>, usize, usize)> {
        let mut engine = Engine::with_mtp_head(model.clone(), head.clone(), mtp_config()).unwrap();
        let handles: Vec<RequestHandle> = reqs.iter().map(|r| engine.submit(r.clone()).unwrap()).collect();
        engine.run_to_completion().unwrap();
        handles
            .iter()
            .map(|h| {
                let o = collect(h);
                let spec = o.end.expect("every request ends").1.speculation;
                (o.ids, spec.drafted, spec.accepted)
            })
            .collect()
    };
    let batched = run(&reqs);
    let alone: Vec<_> = reqs
        .iter()
        .map(|r| run(std::slice::from_ref(r)).remove(0))
        .collect();
    assert_eq!(batched, alone);
    let (drafted, accepted) = batched.iter().fold((0, 0), |(d, a), x| (d + x.1, a + x.2));
    assert!(accepted > 0 && accepted < drafted, "{accepted} of {drafted}");
}

/// `max_tokens` 0 with prompt log-probabilities runs the prompt alone (in chunks, MTP set or
/// not, beside a decoding request): its log-probabilities (none for a one-token prompt), no
/// token, `MaxTokens`, and the pools empty after.
#[test]
fn a_prompt_alone_ends_after_its_logprobs() {
    let (model, head) = model_helpers::load_bundled();
    let cfg = EngineConfig {
        step_tokens: 8,
        ..mtp_config()
    };
    let mut engine = Engine::with_mtp_head(model.clone(), head, cfg).unwrap();
    let rel = if qwen36_testutil::test_device().is_cuda() {
        1e-4
    } else {
        1e-5
    };
    let long: Vec<u32> = (0..21).map(|i| 7 + 13 * i).collect();
    for (prompt, speculation) in [
        (vec![5], None),
        (vec![5, 9, 11, 300], Some(Speculation::Mtp { k: 2 })),
        (long.clone(), None),
        (long, Some(Speculation::Mtp { k: 2 })),
    ] {
        let beside = engine.submit(Request::greedy(vec![3, 4], 6)).unwrap();
        let (got, _) = common::prompt_alone(&mut engine, &prompt, 1, speculation);
        let what = format!("a prompt of {}", prompt.len());
        common::check_prompt_logprobs(&model, &prompt, &got, 1, rel, &what);
        assert_eq!(collect(&beside).ids, solo(&model, &[3, 4], 6).0);
        assert_eq!(engine.pool_use(), (0, 0));
    }
}

/// MTP drafts from a draft vocabulary (the first half of the ids): still the plain greedy
/// tokens, with drafts accepted.
#[test]
fn mtp_with_a_draft_vocabulary_equals_plain_greedy() {
    let (model, head) = model_helpers::load_bundled();
    let cfg = EngineConfig {
        draft_vocab: Some(model.config().vocab_size / 2),
        ..mtp_config()
    };
    let mut engine = Engine::with_mtp_head(model, head, cfg).unwrap();
    let t = check_random(&mut engine, 31, 8, 60, &[Speculation::Mtp { k: 2 }]);
    assert!(t.accepted > 0, "drafts must be accepted: {t:?}");
}

/// The engine on its own thread: requests submitted from several threads at once each get their
/// solo tokens; a shutdown lets submitted requests finish and refuses new ones.
#[test]
fn a_spawned_engine_serves_many_threads() {
    let model = bundled();
    let prompts: Vec<Vec<u32>> = (0..6u32)
        .map(|i| (0..5 + 11 * i).map(|j| (j * 13 + i) % 4000).collect())
        .collect();
    let want: Vec<Vec<u32>> = prompts.iter().map(|p| solo(&model, p, 8).0).collect();
    let client = Engine::new(model, EngineConfig::default()).unwrap().spawn();
    let threads: Vec<_> = prompts
        .iter()
        .cloned()
        .map(|p| {
            let client = client.clone();
            std::thread::spawn(move || {
                let h = client.submit(Request::greedy(p, 8)).unwrap();
                let mut ids = Vec::new();
                while let Some(e) = h.recv() {
                    if let Event::Token { ids: new, .. } = e {
                        ids.extend(new);
                    }
                }
                ids
            })
        })
        .collect();
    let got: Vec<Vec<u32>> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(got, want);
    let last = client.submit(Request::greedy(prompts[0].clone(), 8)).unwrap();
    client.shutdown();
    let o = collect(&last);
    assert_eq!(
        (o.ids, o.end.unwrap().0),
        (want[0].clone(), StopReason::MaxTokens)
    );
    assert!(matches!(
        client.submit(Request::greedy(vec![1], 1)),
        Err(Error::Stopped)
    ));
}

/// The benchmarks' timing mode accepts at the given rates, whatever the drafts.
#[test]
fn timing_accept_rates_set_the_acceptance() {
    let (model, head) = model_helpers::load_bundled();
    let mut rng = Rng::new(41);
    let prompts: Vec<Vec<u32>> = (0..3).map(|_| echo_prompt(&model, &mut rng, 30)).collect();
    for (rates, all) in [(vec![1.0], true), (vec![0.0], false)] {
        let cfg = EngineConfig {
            timing_accept_rates: Some(rates),
            adaptive_k: false,
            ..Default::default()
        };
        let mut engine = Engine::with_mtp_head(model.clone(), head.clone(), cfg).unwrap();
        let handles: Vec<RequestHandle> = prompts
            .iter()
            .map(|p| {
                let req = Request {
                    speculation: Some(Speculation::Mtp { k: 3 }),
                    ..Request::greedy(p.clone(), 20)
                };
                engine.submit(req).unwrap()
            })
            .collect();
        engine.run_to_completion().unwrap();
        for h in &handles {
            let o = collect(h);
            let u = o.end.unwrap().1;
            assert_eq!(o.ids.len(), 20);
            assert!(u.speculation.drafted > 0);
            assert_eq!(
                u.speculation.accepted,
                if all { u.speculation.drafted } else { 0 },
                "{u:?}"
            );
        }
    }
    // Drafts accepted by a draw could break an output constraint: refused.
    let cfg = EngineConfig {
        timing_accept_rates: Some(vec![1.0]),
        ..Default::default()
    };
    let mut engine = Engine::new(model.clone(), cfg).unwrap();
    let mut req = Request::greedy(vec![1, 2], 4);
    req.constraint = Some(thirds_constraint(None));
    assert!(matches!(engine.submit(req), Err(Error::Request(m)) if m.contains("timing_accept_rates")));
    // So could drafts of a stop id before min_tokens.
    let mut req = Request::greedy(vec![1, 2], 4);
    req.sampling.min_tokens = 2;
    assert!(matches!(engine.submit(req), Err(Error::Request(m)) if m.contains("timing_accept_rates")));
    // Or of an id not allowed.
    let mut req = Request::greedy(vec![1, 2], 4);
    req.sampling.allowed_ids = vec![3, 4];
    assert!(matches!(engine.submit(req), Err(Error::Request(m)) if m.contains("timing_accept_rates")));
}

/// With costs given, the engine's choice of k: drafts that cost more than they save fall to
/// k = 0 (MTP and prompt lookup alike), cheap ones are taken; either way the tokens are the solo
/// greedy run's. With the costs it measures itself (this CPU) too.
#[test]
fn adaptive_k_follows_the_costs_and_stays_lossless() {
    let (model, head) = model_helpers::load_bundled();
    let mut rng = Rng::new(47);
    let prompts: Vec<Vec<u32>> = (0..4).map(|_| echo_prompt(&model, &mut rng, 24)).collect();
    let want: Vec<Vec<u32>> = prompts.iter().map(|p| solo(&model, p, 16).0).collect();
    let costly = SpecCosts::fixed(8, 4, |t| 7e-3 * t as f64, 5e-3, 5e-3);
    let cheap = SpecCosts::fixed(8, 4, |_| 7e-3, 1e-4, 1e-4);
    for (costs, drafts) in [(Some(costly), false), (Some(cheap), true), (None, true)] {
        let mut engine = Engine::with_mtp_head(model.clone(), head.clone(), EngineConfig::default()).unwrap();
        let fixed = costs.is_some();
        if let Some(c) = costs {
            engine.set_spec_costs(c);
        }
        let handles: Vec<RequestHandle> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let speculation = Some(match i % 2 {
                    0 => Speculation::Mtp { k: 3 },
                    _ => Speculation::ngram(3),
                });
                let req = Request {
                    speculation,
                    ..Request::greedy(p.clone(), 16)
                };
                engine.submit(req).unwrap()
            })
            .collect();
        engine.run_to_completion().unwrap();
        for (h, want) in handles.iter().zip(&want) {
            let o = collect(h);
            assert_eq!(&o.ids, want);
            let drafted = o.end.unwrap().1.speculation.drafted;
            if fixed {
                assert_eq!(drafted > 0, drafts, "drafted {drafted}");
            }
        }
    }
}

/// Plain sampling alone through a `Cache`, as `Generator` does it: `Sampler::sample` after the
/// whole prompt, one token per forward.
fn solo_sampled(model: &Qwen36Model, req: &Request) -> Vec<u32> {
    solo_masked(model, req, |_, _| true)
}

/// [`solo_sampled`] with every token that `allowed(output, token)` refuses masked (−∞) first.
fn solo_masked(model: &Qwen36Model, req: &Request, allowed: impl Fn(&[u32], u32) -> bool) -> Vec<u32> {
    let mut sampler = qwen36_sampling::Sampler::new(req.sampling.clone()).unwrap();
    let mut cache = model.new_cache(1).unwrap();
    let mut logits = model.forward_last(&ids_tensor(&req.prompt), &mut cache).unwrap();
    let mut out = Vec::new();
    loop {
        let mut row = logits.squeeze(0).unwrap().to_vec1::<f32>().unwrap();
        for (t, l) in row.iter_mut().enumerate() {
            if !allowed(&out, t as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
        let t = sampler.sample(&row, &req.prompt, &out).unwrap().token;
        out.push(t);
        if out.len() == req.max_tokens.unwrap() {
            return out;
        }
        logits = model.forward_last(&ids_tensor(&[t]), &mut cache).unwrap();
    }
}

/// The tests' output rule: token `t` may follow `out` unless `t + len + last` is a multiple of 3
/// (a rule of the output's length and last token, so a constraint that follows the wrong
/// tokens, or forgets the wrong ones, masks the wrong rows).
fn thirds(out: &[u32], t: u32) -> bool {
    (t as usize + out.len() + out.last().map_or(0, |&l| l as usize)) % 3 != 0
}

/// [`thirds`] as a [`Constraint`], failing once it has followed `fail_at` tokens (when set):
/// with an error, or (`silent`) by masking every token.
#[derive(Debug, Default)]
struct Thirds {
    out: Vec<u32>,
    fail_at: Option<usize>,
    silent: bool,
}

impl Constraint for Thirds {
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        let failing = self.fail_at == Some(self.out.len());
        if failing && !self.silent {
            return Err(format!("no match after {} tokens", self.out.len()));
        }
        for (t, l) in logits.iter_mut().enumerate() {
            if failing || !thirds(&self.out, t as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    fn consume(&mut self, tokens: &[u32]) -> Result<(), String> {
        self.out.extend(tokens);
        Ok(())
    }

    fn rollback(&mut self, n: usize) -> Result<(), String> {
        let keep = self.out.len().checked_sub(n).ok_or("rolled back too far")?;
        self.out.truncate(keep);
        Ok(())
    }
}

#[derive(Debug, Default)]
struct ThirdsSpec {
    fail_at: Option<usize>,
    silent: bool,
    /// `start` fails.
    refuse: bool,
}

impl ConstraintSpec for ThirdsSpec {
    fn start(&self) -> Result<Box<dyn Constraint>, String> {
        if self.refuse {
            return Err("a schema it cannot compile".into());
        }
        Ok(Box::new(Thirds {
            out: Vec::new(),
            fail_at: self.fail_at,
            silent: self.silent,
        }))
    }
}

fn thirds_constraint(fail_at: Option<usize>) -> OutputConstraint {
    OutputConstraint(Arc::new(ThirdsSpec {
        fail_at,
        ..Default::default()
    }))
}

/// Constrained requests, greedy and sampled, plain and drafting (MTP, prompt lookup), batched
/// with unconstrained ones: each gives the tokens of its solo run with the refused tokens
/// masked, and drafts are accepted and rejected (a verify masks each row after the drafts
/// before it, then forgets them).
#[test]
fn constrained_requests_equal_their_masked_solo_runs() {
    let (model, head) = model_helpers::load_bundled();
    let mut rng = Rng::new(41);
    let kinds = [
        None,
        Some(Speculation::Mtp { k: 3 }),
        Some(Speculation::ngram(3)),
        Some(Speculation::Mtp { k: 1 }),
    ];
    let reqs: Vec<Request> = (0..10)
        .map(|i| {
            let prompt = echo_prompt(&model, &mut rng, 10 + 4 * i);
            let mut r = match i % 2 {
                0 => Request::greedy(prompt, 24),
                _ => sampled(prompt, 90 + i as u64),
            };
            r.speculation = kinds[i % kinds.len()];
            r.constraint = (i % 5 != 4).then(|| thirds_constraint(None));
            r
        })
        .collect();
    let want: Vec<Vec<u32>> = reqs
        .iter()
        .map(|r| match r.constraint {
            Some(_) => solo_masked(&model, r, thirds),
            None => solo_sampled(&model, r),
        })
        .collect();
    let cfg = EngineConfig {
        max_seqs: 4,
        step_tokens: 30,
        ..mtp_config()
    };
    let mut engine = Engine::with_mtp_head(model.clone(), head, cfg).unwrap();
    let handles: Vec<RequestHandle> = reqs.iter().map(|r| engine.submit(r.clone()).unwrap()).collect();
    engine.run_to_completion().unwrap();
    let (mut drafted, mut accepted) = (0, 0);
    for (i, (h, want)) in handles.iter().zip(&want).enumerate() {
        let o = collect(h);
        assert_eq!(&o.ids, want, "request {i}");
        if reqs[i].constraint.is_some() {
            let u = o.end.unwrap().1;
            (drafted, accepted) = (drafted + u.speculation.drafted, accepted + u.speculation.accepted);
        }
    }
    assert!(accepted > 0 && accepted < drafted, "{accepted} of {drafted}");
    assert_eq!(engine.pool_use(), (0, 0));
}

/// A constraint that cannot start is refused at submit; one that fails mid-output (or masks
/// every token) fails its request alone, with its message, and frees what it held.
#[test]
fn a_failing_constraint_fails_its_request_alone() {
    let (model, head) = model_helpers::load_bundled();
    let mut engine = Engine::with_mtp_head(model.clone(), head, mtp_config()).unwrap();
    let mut refused = Request::greedy(vec![5, 6], 4);
    refused.constraint = Some(OutputConstraint(Arc::new(ThirdsSpec {
        refuse: true,
        ..Default::default()
    })));
    assert!(matches!(
        engine.submit(refused),
        Err(Error::Request(m)) if m == "output constraint: a schema it cannot compile"
    ));
    for (silent, says) in [
        (false, "output constraint: no match after 3 tokens"),
        (true, "output constraint: no token is allowed"),
    ] {
        let mut failing = Request::greedy(vec![5, 6, 7], 12);
        failing.constraint = Some(OutputConstraint(Arc::new(ThirdsSpec {
            fail_at: Some(3),
            silent,
            refuse: false,
        })));
        failing.speculation = Some(Speculation::Mtp { k: 2 });
        let beside = Request::greedy(vec![8, 9], 12);
        let (f, b) = (
            engine.submit(failing).unwrap(),
            engine.submit(beside.clone()).unwrap(),
        );
        engine.run_to_completion().unwrap();
        let events = f.drain();
        let sent: usize = events
            .iter()
            .map(|e| match e {
                Event::Token { ids, .. } => ids.len(),
                _ => 0,
            })
            .sum();
        assert_eq!(sent, 3, "the tokens before the constraint failed");
        assert!(
            matches!(events.last(), Some(Event::Failed { error }) if error == says),
            "{:?}",
            events.last()
        );
        assert_eq!(collect(&b).ids, solo(&model, &beside.prompt, 12).0);
        assert_eq!(engine.pool_use(), (0, 0));
    }
}

/// Sampled speculative decoding (MTP and prompt lookup, fixed and adaptive k, batched with plain
/// requests) draws exactly the tokens of plain sampling with the same seed: acceptance is coupled
/// to the plain draw of each position (`Sampler::accept_coupled`), so drafts only decide how many
/// tokens a step yields.
#[test]
fn sampled_speculation_equals_plain_sampling() {
    let (model, head) = model_helpers::load_bundled();
    let mut rng = Rng::new(31);
    let kinds = [
        None,
        Some(Speculation::Mtp { k: 1 }),
        Some(Speculation::Mtp { k: 3 }),
        Some(Speculation::ngram(3)),
    ];
    let reqs: Vec<Request> = (0..8)
        .map(|i| {
            let mut r = sampled(echo_prompt(&model, &mut rng, 12 + 5 * i), 60 + i as u64);
            r.sampling.repetition_penalty = if i % 3 == 0 { 1.2 } else { 1.0 };
            r.speculation = kinds[i % kinds.len()];
            r
        })
        .collect();
    let want: Vec<Vec<u32>> = reqs.iter().map(|r| solo_sampled(&model, r)).collect();
    for adaptive_k in [false, true] {
        let cfg = EngineConfig {
            max_seqs: 3,
            step_tokens: 30,
            adaptive_k,
            ..Default::default()
        };
        let mut engine = Engine::with_mtp_head(model.clone(), head.clone(), cfg).unwrap();
        let handles: Vec<RequestHandle> = reqs.iter().map(|r| engine.submit(r.clone()).unwrap()).collect();
        engine.run_to_completion().unwrap();
        let (mut drafted, mut accepted) = (0, 0);
        for (h, want) in handles.iter().zip(&want) {
            let o = collect(h);
            assert_eq!(&o.ids, want, "adaptive_k {adaptive_k}");
            let u = o.end.unwrap().1;
            (drafted, accepted) = (drafted + u.speculation.drafted, accepted + u.speculation.accepted);
        }
        if !adaptive_k {
            assert!(accepted > 0 && accepted < drafted, "{accepted} of {drafted}");
        }
    }
}

/// Greedy decoding with penalties reads the full logits rows (the device's argmax would ignore
/// the penalties): each such request equals a solo greedy run through the penalising sampler.
#[test]
fn greedy_with_penalties_applies_them() {
    let model = bundled();
    let mut rng = Rng::new(54);
    let mut engine = Engine::new(model.clone(), EngineConfig::default()).unwrap();
    let reqs: Vec<Request> = [(5.0, 0.0, 0.0), (1.0, 2.0, 0.0), (1.0, 0.0, 2.0)]
        .into_iter()
        .map(|(rep, presence, frequency)| {
            let mut r = Request::greedy(echo_prompt(&model, &mut rng, 18), 24);
            r.sampling.repetition_penalty = rep;
            r.sampling.presence_penalty = presence;
            r.sampling.frequency_penalty = frequency;
            r
        })
        .collect();
    let handles: Vec<RequestHandle> = reqs.iter().map(|r| engine.submit(r.clone()).unwrap()).collect();
    engine.run_to_completion().unwrap();
    let mut changed = 0;
    for (r, h) in reqs.iter().zip(&handles) {
        let want = solo_sampled(&model, r);
        changed += (want != solo(&model, &r.prompt, 24).0) as usize;
        assert_eq!(collect(h).ids, want);
    }
    assert_eq!(
        changed, 3,
        "every penalty must change its greedy run for the test to mean anything"
    );
}

/// Logit biases (one banning a token of the plain greedy run, one raising another) give the
/// sampler's own run on the plain model, with and without drafts (MTP, n-gram), in one batch.
#[test]
fn greedy_with_logit_biases_applies_them_with_drafts_too() {
    let mut rng = Rng::new(55);
    let (model, head) = model_helpers::load_bundled();
    let prompts: Vec<Vec<u32>> = (0..2).map(|_| echo_prompt(&model, &mut rng, 18)).collect();
    let plain = solo(&model, &prompts[0], 24).0;
    let biases = [vec![(plain[3], -100.0)], vec![(plain[5], -3.0), (17, 6.5)]];
    let mut want = Vec::new();
    for (prompt, bias) in prompts.iter().zip(&biases) {
        let mut r = Request::greedy(prompt.clone(), 24);
        r.sampling.logit_bias = bias.clone();
        want.push(solo_sampled(&model, &r));
    }
    assert_ne!(
        want[0], plain,
        "the ban must change the greedy run for the test to mean anything"
    );
    assert_ne!(want[1], solo(&model, &prompts[1], 24).0);
    for spec in [None, Some(Speculation::ngram(3)), Some(Speculation::Mtp { k: 3 })] {
        let mut engine = Engine::with_mtp_head(model.clone(), head.clone(), mtp_config()).unwrap();
        let handles: Vec<RequestHandle> = prompts
            .iter()
            .zip(&biases)
            .map(|(prompt, bias)| {
                let mut r = Request::greedy(prompt.clone(), 24);
                r.sampling.logit_bias = bias.clone();
                r.speculation = spec;
                engine.submit(r).unwrap()
            })
            .collect();
        engine.run_to_completion().unwrap();
        for (h, want) in handles.iter().zip(&want) {
            assert_eq!(&collect(h).ids, want, "{spec:?}");
        }
    }
}

/// `min_tokens` keeps the stop ids out of the output's first tokens, then the first stop id
/// ends it: the tokens of a solo run with the stop ids masked that long, cut at its first stop
/// id after them; greedy and sampled, plain and drafting (a draft of a stop id too early is
/// refused). `min_tokens` over `max_tokens` is refused.
#[test]
fn min_tokens_keeps_the_stop_ids_out_until_then() {
    const MIN: usize = 9;
    let mut rng = Rng::new(67);
    let (model, head) = model_helpers::load_bundled();
    let mut reqs = Vec::new();
    for i in 0..6 {
        let prompt = echo_prompt(&model, &mut rng, 14 + 2 * i);
        // The ids the greedy run writes most (without min_tokens it would stop early).
        let plain = solo(&model, &prompt, 40).0;
        let count = |t: &u32| plain.iter().filter(|&u| u == t).count();
        let mut by_count = plain.clone();
        by_count.sort_by_key(|t| (std::cmp::Reverse(count(t)), *t));
        by_count.dedup();
        let mut r = match i % 2 {
            0 => Request::greedy(prompt, 40),
            _ => Request {
                max_tokens: Some(40),
                ..sampled(prompt, 80 + i as u64)
            },
        };
        r.stop_ids = by_count[..2].to_vec();
        r.sampling.min_tokens = MIN;
        reqs.push(r);
    }
    let want: Vec<Vec<u32>> = reqs
        .iter()
        .map(|r| {
            let mut alone = r.clone();
            alone.sampling.min_tokens = 0;
            let stops = r.stop_ids.clone();
            let out = solo_masked(&model, &alone, |out, t| out.len() >= MIN || !stops.contains(&t));
            match out[MIN..].iter().position(|t| stops.contains(t)) {
                Some(p) => out[..=MIN + p].to_vec(),
                None => out,
            }
        })
        .collect();
    let stopped = want.iter().filter(|w| w.len() < 40).count();
    assert!(stopped >= 3, "only {stopped} of the runs stop at a stop id");
    for spec in [None, Some(Speculation::ngram(3)), Some(Speculation::Mtp { k: 3 })] {
        let mut engine = Engine::with_mtp_head(model.clone(), head.clone(), mtp_config()).unwrap();
        let handles: Vec<RequestHandle> = reqs
            .iter()
            .map(|r| {
                let mut r = r.clone();
                r.speculation = spec;
                engine.submit(r).unwrap()
            })
            .collect();
        engine.run_to_completion().unwrap();
        for (i, (h, want)) in handles.iter().zip(&want).enumerate() {
            let o = collect(h);
            assert_eq!(&o.ids, want, "request {i}, {spec:?}");
            let reason = match want.len() {
                40 => StopReason::MaxTokens,
                _ => StopReason::StopToken(want[want.len() - 1]),
            };
            assert_eq!(o.end.unwrap().0, reason, "request {i}, {spec:?}");
        }
    }
    let mut engine = Engine::new(model, EngineConfig::default()).unwrap();
    let mut over = Request::greedy(vec![1, 2, 3], 4);
    over.sampling.min_tokens = 5;
    let e = engine.submit(over).unwrap_err();
    assert!(
        matches!(&e, Error::Request(m) if m.contains("min_tokens 5 is over max_tokens 4")),
        "{e}"
    );
    let mut equal = Request::greedy(vec![1, 2, 3], 4);
    equal.sampling.min_tokens = 4;
    assert!(engine.submit(equal).is_ok(), "min_tokens may equal max_tokens");
    // Without max_tokens the sequence needs min_tokens positions.
    let context = engine.context();
    for (min, fits) in [(context - 2, true), (context - 1, false)] {
        let mut long = Request::greedy(vec![1, 2, 3], 1);
        long.max_tokens = None;
        long.sampling.min_tokens = min;
        match engine.submit(long) {
            Ok(h) => assert!(fits, "min_tokens {min}: request {}", h.id()),
            Err(e) => assert!(
                !fits && matches!(e, Error::TooLong { needed, .. } if needed == 3 + min),
                "{e}"
            ),
        }
    }
    // A finished constraint allows only the stop ids, which min_tokens would mask.
    let mut constrained = Request::greedy(vec![1, 2, 3], 4);
    constrained.sampling.min_tokens = 2;
    constrained.stop_ids = vec![2];
    constrained.constraint = Some(thirds_constraint(None));
    let e = engine.submit(constrained.clone()).unwrap_err();
    constrained.sampling.min_tokens = 0;
    assert!(
        engine.submit(constrained).is_ok(),
        "a constraint with stop ids alone is served"
    );
    assert!(
        matches!(&e, Error::Request(m) if m.contains("min_tokens with an output constraint")),
        "{e}"
    );
    // So allowed ids beside a constraint must hold a stop id.
    let mut allowed = Request::greedy(vec![1, 2, 3], 4);
    allowed.stop_ids = vec![2];
    allowed.constraint = Some(thirds_constraint(None));
    allowed.sampling.allowed_ids = vec![3, 4];
    let e = engine.submit(allowed.clone()).unwrap_err();
    assert!(
        matches!(&e, Error::Request(m) if m.contains("allowed_token_ids with an output constraint")),
        "{e}"
    );
    allowed.sampling.allowed_ids = vec![2, 3, 4];
    assert!(engine.submit(allowed).is_ok());
}

/// When the step's token budget cannot hold every sequence's drafts, every decoding sequence
/// still gets its token each step: drafts take only what the decode tokens leave.
#[test]
fn drafts_never_starve_other_sequences() {
    let (model, head) = model_helpers::load_bundled();
    let cfg = EngineConfig {
        max_seqs: 4,
        step_tokens: 6,
        adaptive_k: false,
        ..Default::default()
    };
    let mut engine = Engine::with_mtp_head(model, head, cfg).unwrap();
    let handles: Vec<RequestHandle> = (0..4u32)
        .map(|i| {
            let req = Request {
                speculation: Some(Speculation::Mtp { k: 3 }),
                ..Request::greedy(vec![5 + i], 40)
            };
            engine.submit(req).unwrap()
        })
        .collect();
    // The one-token prompts take the first step; from then on each step has 4 decode tokens
    // and room for 2 drafts.
    engine.step().unwrap();
    let mut counts = vec![0usize; 4];
    for _ in 0..6 {
        engine.step().unwrap();
        for (c, h) in counts.iter_mut().zip(&handles) {
            let before = *c;
            *c += collect(h).ids.len();
            assert!(*c > before, "a sequence got no token in a step: {counts:?}");
        }
    }
}

/// A long prompt's chunks do not drop the drafts of a sequence decoding beside it: each step
/// verifies its drafts (all accepted here) and the prompt takes the rest of the budget. In a
/// small budget, drafts leave prompts at least half of what the decode tokens leave.
#[test]
fn prompt_chunks_keep_the_drafts_beside_them() {
    let (model, head) = model_helpers::load_bundled();
    let engine_of = |step_tokens| {
        let cfg = EngineConfig {
            max_seqs: 4,
            step_tokens,
            adaptive_k: false,
            timing_accept_rates: Some(vec![1.0]),
            // (No snapshot points to end chunks at.)
            prefix_snapshots: 0,
            ..Default::default()
        };
        Engine::with_mtp_head(model.clone(), head.clone(), cfg).unwrap()
    };
    let mut engine = engine_of(40);
    let mtp = |prompt: Vec<u32>| Request {
        speculation: Some(Speculation::Mtp { k: 3 }),
        ..Request::greedy(prompt, 200)
    };
    let a = engine.submit(mtp(vec![5])).unwrap();
    // Its prompt, then a verify of its first drafts.
    engine.step().unwrap();
    engine.step().unwrap();
    assert_eq!(collect(&a).ids.len(), 1 + 4);
    let b = engine
        .submit(Request::greedy((0..200).map(|i| 7 + i % 50).collect(), 2))
        .unwrap();
    // 200 prompt tokens at 36 a step, beside a verify of 4 tokens.
    let mut left = 200;
    while left > 0 {
        let stats = engine.step().unwrap();
        assert_eq!(
            collect(&a).ids.len(),
            4,
            "the decoding sequence's drafts were dropped"
        );
        assert_eq!(
            stats.tokens,
            4 + left.min(36),
            "the prompt takes what the verify leaves"
        );
        left -= left.min(36);
        assert_eq!(collect(&b).ids.is_empty(), left > 0);
    }

    let mut engine = engine_of(6);
    let decoding: Vec<RequestHandle> = [vec![5], vec![6]].map(|p| engine.submit(mtp(p)).unwrap()).into();
    engine.step().unwrap();
    // No prompt waiting: the drafts take all the decode tokens leave.
    assert_eq!(engine.step().unwrap().tokens, 6);
    let b = engine
        .submit(Request::greedy((0..20).map(|i| 7 + i).collect(), 2))
        .unwrap();
    // Two decode tokens, two drafts (half of the 4 left), then two prompt tokens a step.
    for step in 1..=10 {
        engine.step().unwrap();
        assert_eq!(collect(&b).ids.is_empty(), step < 10, "step {step}");
    }
    assert!(decoding.iter().all(|h| !collect(h).ids.is_empty()));
}

/// A byte-level test vocabulary: ids ≡ 0 (mod 5) are the lead byte of "é", ids ≡ 1 its
/// continuation byte, the others one ASCII letter; a byte sequence that is not UTF-8 decodes as
/// U+FFFD, as byte-level tokenizers give it.
fn test_decode(ids: &[u32]) -> Result<String, String> {
    let bytes: Vec<u8> = ids
        .iter()
        .map(|&i| match i % 5 {
            0 => 0xC3,
            1 => 0xA9,
            _ => b'a' + (i % 26) as u8,
        })
        .collect();
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// With a detokenizer the events' text adds up to the output's text (characters split across
/// tokens included), alone or beside other requests, plain or speculative; a stop string ends the
/// request on the token that completes it, with the text cut where it starts; stop strings
/// without a detokenizer are refused.
#[test]
fn text_streams_and_stop_strings_end_requests() {
    let model = bundled();
    let vocab = model.config().vocab_size;
    let mut plain = Engine::new(model.clone(), EngineConfig::default()).unwrap();
    let mut req = Request::greedy(vec![1, 2, 3], 4);
    req.stop_strings = vec!["ab".into()];
    assert!(matches!(plain.submit(req).unwrap_err(), Error::Request(m) if m.contains("detokenizer")));

    let mut engine = Engine::new(model.clone(), EngineConfig::default())
        .unwrap()
        .with_detokenizer(std::sync::Arc::new(test_decode));
    let mut rng = Rng::new(41);
    let (mut checked_stops, mut checked_later) = (0, 0);
    for round in 0..6 {
        let prompt: Vec<u32> = (0..rng.range(2, 30)).map(|_| rng.below(vocab) as u32).collect();
        let (ids, _) = solo(&model, &prompt, 24);
        let text = test_decode(&ids).unwrap();
        // The whole output's text, from the events.
        let mut whole = Request::greedy(prompt.clone(), 24);
        if round % 2 == 1 {
            whole.speculation = Some(Speculation::ngram(3));
        }
        let h_whole = engine.submit(whole).unwrap();
        // A stop string: two letters of the text from its middle, when it has them.
        let chars: Vec<(usize, char)> = text.char_indices().collect();
        let stop = chars
            .windows(2)
            .skip(chars.len() / 3)
            .find(|w| w.iter().all(|(_, c)| c.is_ascii_lowercase()))
            .map(|w| format!("{}{}", w[0].1, w[1].1));
        let h_stop = stop.as_ref().map(|stop| {
            let mut r = Request::greedy(prompt.clone(), 24);
            r.stop_strings = vec!["never-there".into(), stop.clone()];
            engine.submit(r).unwrap()
        });
        // The first token after which the text holds the stop string.
        let first_stop = stop.as_ref().map(|stop| {
            (1..=ids.len())
                .find(|&n| test_decode(&ids[..n]).unwrap().contains(stop))
                .expect("the stop string is in the text")
        });
        // The text's most frequent letter as a stop string, kept, and ignored until past the
        // token that first writes it (min_tokens).
        let letter = ('a'..='z').max_by_key(|&c| (text.matches(c).count(), std::cmp::Reverse(c)));
        let later = letter.filter(|&c| text.contains(c)).map(|c| {
            let stop = c.to_string();
            let n = (1..=ids.len())
                .find(|&n| test_decode(&ids[..n]).unwrap().contains(c))
                .unwrap();
            (stop, n)
        });
        let h_later = later.as_ref().map(|(stop, n)| {
            let n = *n;
            let mut r = Request::greedy(prompt.clone(), 24);
            r.stop_strings = vec![stop.clone()];
            r.keep_stop_strings = true;
            r.sampling.min_tokens = n;
            if round % 3 == 2 {
                r.speculation = Some(Speculation::ngram(3));
            }
            engine.submit(r).unwrap()
        });
        // A stop id (one not written before it) whose text is kept, or not.
        let at = (2..ids.len()).find(|&i| !ids[..i].contains(&ids[i])).unwrap();
        let h_ids = [false, true].map(|keep| {
            let mut r = Request::greedy(prompt.clone(), 24);
            r.stop_ids = vec![ids[at]];
            r.keep_stop_strings = keep;
            engine.submit(r).unwrap()
        });
        engine.run_to_completion().unwrap();
        for (h, end) in h_ids.iter().zip([at, at + 1]) {
            let o = collect(h);
            assert_eq!(o.ids, ids[..=at], "round {round}");
            assert_eq!(
                o.text,
                test_decode(&ids[..end]).unwrap(),
                "round {round}: the stop id's text"
            );
        }
        let o = collect(&h_whole);
        assert_eq!(o.ids, ids, "round {round}");
        assert_eq!(o.text, text, "round {round}: the events' text");
        assert_eq!(o.end.map(|e| e.0), Some(StopReason::MaxTokens));
        if let (Some((stop, n)), Some(later)) = (later, h_later) {
            // A match ending past the first n tokens' text, from the first token that completes
            // one; else the whole output.
            // (A character the first n tokens leave unfinished is a later token's text.)
            let quiet = test_decode(&ids[..n]).unwrap().trim_end_matches('\u{FFFD}').len();
            let ends = |m: usize| {
                let t = test_decode(&ids[..m]).unwrap();
                let mut starts = t.char_indices().map(|(i, _)| i);
                let found = starts.find(|&i| t[i..].starts_with(stop.as_str()) && i + stop.len() > quiet);
                found.map(|i| t[..i + stop.len()].to_string())
            };
            let o = collect(&later);
            match (n + 1..=ids.len()).find_map(|m| ends(m).map(|t| (m, t))) {
                Some((m, kept)) => {
                    assert_eq!(o.ids, ids[..m], "round {round}: min_tokens {n}");
                    assert_eq!(o.text, kept, "round {round}: the stop string kept");
                    assert_eq!(o.end.map(|e| e.0), Some(StopReason::StopString(0)));
                    checked_later += 1;
                }
                None => {
                    assert_eq!(o.ids, ids, "round {round}: min_tokens {n}");
                    assert_eq!(o.text, text, "round {round}");
                }
            }
        }
        if let (Some(stop), Some(h), Some(n)) = (stop, h_stop, first_stop) {
            let o = collect(&h);
            assert_eq!(o.ids, ids[..n], "round {round}: stops on the completing token");
            let full = test_decode(&ids[..n]).unwrap();
            assert_eq!(o.text, full[..full.find(&stop).unwrap()], "round {round}");
            assert_eq!(o.end.map(|e| e.0), Some(StopReason::StopString(1)));
            checked_stops += 1;
        }
    }
    assert!(
        checked_stops >= 3 && checked_later >= 2,
        "only {checked_stops} rounds had a stop string to check, {checked_later} a later one"
    );
    assert_eq!(engine.pool_use(), (0, 0));
}

/// A request that ends frees its blocks before the others' MTP drafts reserve theirs: in a pool
/// of 8 blocks of 8 (prefix cache off), a 12-token prompt that ends after 13 tokens beside a
/// 20-token one that runs 24 (both k = 3) leaves the second its solo run's tokens and drafts, no
/// preemption (it drafted 34 of 36 when the drafts reserved first: the step the first ended,
/// its MTP K/V found no free block and drafted one token); the steps count both as finished.
#[test]
fn an_ending_request_frees_its_blocks_before_the_drafts_reserve() {
    let (model, head) = model_helpers::load_bundled();
    let mut rng = Rng::new(5);
    let short = echo_prompt(&model, &mut rng, 12);
    let long = echo_prompt(&model, &mut rng, 20);
    let mtp = |prompt: &Vec<u32>, max_tokens| Request {
        speculation: Some(Speculation::Mtp { k: 3 }),
        ..Request::greedy(prompt.clone(), max_tokens)
    };
    let run = |reqs: &[Request], kv_blocks| {
        let cfg = EngineConfig {
            max_seqs: 2,
            kv_blocks,
            prefix_snapshots: 0,
            ..mtp_config()
        };
        let mut engine = Engine::with_mtp_head(model.clone(), head.clone(), cfg).unwrap();
        let handles: Vec<RequestHandle> = reqs.iter().map(|r| engine.submit(r.clone()).unwrap()).collect();
        let mut finished = 0;
        while engine.pending() > 0 {
            finished += engine.step().unwrap().finished;
        }
        assert_eq!(finished, reqs.len());
        assert_eq!(engine.pool_use(), (0, 0));
        handles
            .iter()
            .map(|h| {
                let o = collect(h);
                let usage = o.end.expect("every request ends").1;
                (o.ids, usage.speculation.drafted, usage.preemptions)
            })
            .collect::<Vec<_>>()
    };
    let both = run(&[mtp(&short, 13), mtp(&long, 24)], Some(8));
    let alone = run(&[mtp(&long, 24)], None).remove(0);
    assert_eq!(alone.1, 36);
    assert_eq!(both[1], alone);
}
