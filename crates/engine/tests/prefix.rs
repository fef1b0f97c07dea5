//! The prefix cache through the engine: multi-turn conversations and prompts sharing a system
//! prompt, one at a time or concurrent, with MTP and without, give every request its cold solo
//! tokens; the tokens served from the cache are exactly what the snapshot points allow; a tiny
//! snapshot budget and KV pool evict, stay exact and stay within the budget.

mod common;

use common::{bundled, collect, model_helpers, solo};
use qwen36_engine::{Engine, EngineConfig, Event, Request, RequestHandle, Speculation, StopReason};
use qwen36_testutil::Rng;

const BS: usize = 8;

fn random_ids(rng: &mut Rng, vocab: usize, len: usize) -> Vec<u32> {
    (0..len).map(|_| rng.below(vocab) as u32).collect()
}

/// The snapshot points of the engine's policy, stated independently: each finished request keeps
/// the state at its prompt's last block boundary, at the boundary where it branched off cached
/// blocks, and at the last boundary its decoding passed (these requests all end at `max_tokens`,
/// whose last boundary the engine keeps); a request hits the longest kept prefix of its prompt
/// that leaves a token to run.
#[derive(Default)]
struct Policy {
    /// Token prefixes whose state is kept.
    snapshots: Vec<Vec<u32>>,
}

impl Policy {
    fn hit(&self, prompt: &[u32]) -> usize {
        self.snapshots
            .iter()
            .filter(|s| s.len() < prompt.len() && prompt.starts_with(s))
            .map(Vec::len)
            .max()
            .unwrap_or(0)
    }

    /// Whole blocks of `prompt` (leaving a token) that some kept prefix covers.
    fn cached_blocks(&self, prompt: &[u32]) -> usize {
        let usable = &prompt[..prompt.len() - 1];
        self.snapshots
            .iter()
            .map(|s| {
                let common = s.iter().zip(usable).take_while(|(a, b)| a == b).count();
                common / BS * BS
            })
            .max()
            .unwrap_or(0)
    }

    /// What a request that hit `hit` tokens and generated `out` keeps.
    fn finished(&mut self, prompt: &[u32], out: &[u32], hit: usize) {
        let len = prompt.len();
        let mut points = vec![self.cached_blocks(prompt), len / BS * BS];
        // Decoding runs positions len.. one at a time; the last token is never run.
        let ran = len + out.len() - 1;
        let last = ran / BS * BS;
        if last > len {
            points.push(last);
        }
        let all: Vec<u32> = prompt.iter().chain(out).copied().collect();
        for p in points.into_iter().filter(|&p| p > hit) {
            let s = all[..p].to_vec();
            if !self.snapshots.contains(&s) {
                self.snapshots.push(s);
            }
        }
    }
}

/// Conversations taking turns one request at a time, each turn resending its history and the
/// last answer with a new message, all opening with one system prompt: every turn's tokens are
/// its cold run's, and the tokens it is served from the cache are what the policy allows (MTP
/// requests look nothing up). `spec` picks each turn's speculation.
/// Returns the tokens served from the cache, the prompt tokens, and the drafts accepted.
fn turns(
    engine: &mut Engine,
    seed: u64,
    spec: impl Fn(usize) -> Option<Speculation>,
) -> (usize, usize, usize) {
    let model = engine.model().clone();
    let vocab = model.config().vocab_size;
    let mut rng = Rng::new(seed);
    let system = random_ids(&mut rng, vocab, 21);
    let mut histories: Vec<Vec<u32>> = vec![system.clone(); 3];
    let mut policy = Policy::default();
    let (mut hits, mut prompt_tokens, mut accepted) = (0, 0, 0);
    for turn in 0..3 {
        for (c, history) in histories.iter_mut().enumerate() {
            let len = rng.range(3, 20);
            let message = random_ids(&mut rng, vocab, len);
            let prompt: Vec<u32> = history.iter().chain(&message).copied().collect();
            let max = rng.range(4, 30);
            let mut req = Request::greedy(prompt.clone(), max);
            req.speculation = spec(turn);
            let h = engine.submit(req).unwrap();
            engine.run_to_completion().unwrap();
            let o = collect(&h);
            let (reason, usage) = o.end.expect("it ended");
            assert_eq!(reason, StopReason::MaxTokens);
            assert_eq!(o.ids, solo(&model, &prompt, max).0, "turn {turn} of {c}");
            let want = match spec(turn) {
                Some(Speculation::Mtp { .. }) => 0,
                _ => policy.hit(&prompt),
            };
            assert_eq!(
                usage.cached_tokens, want,
                "turn {turn} of {c}: tokens from the cache"
            );
            policy.finished(&prompt, &o.ids, want);
            accepted += usage.accepted;
            hits += want;
            prompt_tokens += prompt.len();
            *history = [prompt, o.ids].concat();
        }
    }
    let stats = engine.prefix_stats().expect("the cache is on");
    assert_eq!(stats.hit_tokens as usize, hits);
    assert_eq!(stats.lookup_tokens as usize, prompt_tokens);
    assert_eq!(stats.evictions, 0);
    engine.clear_prefix_cache().unwrap();
    let load = engine.load();
    assert_eq!((load.cached_slots, load.cached_blocks), (0, 0));
    assert_eq!(engine.pool_use(), (0, 0));
    (hits, prompt_tokens, accepted)
}

fn turns_config() -> EngineConfig {
    EngineConfig {
        max_seqs: 4,
        block_size: BS,
        step_tokens: 48,
        prefix_snapshots: 64,
        adaptive_k: false,
        ..Default::default()
    }
}

#[test]
fn turns_hit_exactly_where_the_snapshots_allow() {
    let mut engine = Engine::new(bundled(), turns_config()).unwrap();
    let (hits, prompt_tokens, _) = turns(&mut engine, 11, |_| None);
    assert!(
        hits * 2 > prompt_tokens,
        "most of the history comes from the cache: {hits} of {prompt_tokens}"
    );
}

/// Turns decoded speculatively (MTP, then prompt lookup) keep the state at the block boundary
/// inside a verified run (from the verify's checkpoints): the next turn's hit there is exact.
#[test]
fn turns_after_speculative_decoding_hit_exactly() {
    let (model, head) = model_helpers::load_bundled();
    let mut engine = Engine::with_mtp_head(model, head, turns_config()).unwrap();
    let (hits, _, accepted) = turns(&mut engine, 12, |turn| match turn {
        0 => Some(Speculation::Mtp { k: 3 }),
        1 => Some(Speculation::ngram(3)),
        _ => None,
    });
    assert!(
        hits > 0 && accepted > 0,
        "{hits} hits, {accepted} drafts accepted"
    );
}

/// Requests sharing prefixes (continuations of earlier prompts and of their answers) arriving
/// at random steps, some cancelled, some drafting with the MTP head or n-grams: every request's
/// tokens are its cold solo run's, and the cache serves some.
fn concurrent(cfg: EngineConfig, seed: u64, n: usize) -> (usize, qwen36_engine::PrefixStats) {
    let (model, head) = model_helpers::load_bundled();
    let vocab = model.config().vocab_size;
    let snapshots = cfg.prefix_snapshots;
    let max_seqs = cfg.max_seqs;
    let mut engine = Engine::with_mtp_head(model.clone(), head, cfg).unwrap();
    let mut rng = Rng::new(seed);
    let roots: Vec<Vec<u32>> = (0..3)
        .map(|_| {
            let len = rng.range(9, 40);
            random_ids(&mut rng, vocab, len)
        })
        .collect();
    let kinds = [
        None,
        None,
        Some(Speculation::Mtp { k: 2 }),
        Some(Speculation::ngram(2)),
    ];
    let mut prompts: Vec<Vec<u32>> = roots.clone();
    let mut live: Vec<(Request, RequestHandle, Option<usize>, Vec<u32>)> = Vec::new();
    let mut finished: Vec<(Request, Vec<u32>, StopReason)> = Vec::new();
    let mut preemptions = 0;
    let mut step = 0;
    while finished.len() + live.len() < n || engine.pending() > 0 {
        if finished.len() + live.len() < n && rng.chance(0.5) {
            // A known prompt (or a finished request's prompt and answer) and a new message.
            let base = prompts[rng.below(prompts.len())].clone();
            let cut = rng.range(base.len() / 2, base.len());
            let len = rng.range(1, 12);
            let extra = random_ids(&mut rng, vocab, len);
            let prompt = [&base[..cut], &extra].concat();
            let mut req = Request::greedy(prompt, rng.range(2, 12));
            req.speculation = kinds[rng.below(kinds.len())];
            let h = engine.submit(req.clone()).unwrap();
            let cancel = rng.chance(0.15).then(|| step + rng.range(1, 5));
            live.push((req, h, cancel, Vec::new()));
        }
        for (_, h, cancel, _) in &live {
            if *cancel == Some(step) {
                h.cancel();
            }
        }
        engine.step().unwrap();
        let load = engine.load();
        assert!(load.running <= max_seqs);
        // Snapshot slots (cached, or a running request's rolling one) within their budget.
        assert!(
            load.cached_slots + load.slots_used - load.running <= snapshots,
            "{load:?}"
        );
        let mut i = 0;
        while i < live.len() {
            let mut end = None;
            while let Some(e) = live[i].1.try_recv() {
                match e {
                    Event::Token { ids, .. } => live[i].3.extend(ids),
                    Event::Finished { reason, usage } => end = Some((reason, usage)),
                    Event::Failed { error } => panic!("request failed: {error}"),
                }
            }
            match end {
                Some((reason, usage)) => {
                    let (req, _, _, ids) = live.remove(i);
                    preemptions += usage.preemptions;
                    prompts.push([&req.prompt[..], &ids].concat());
                    finished.push((req, ids, reason));
                }
                None => i += 1,
            }
        }
        step += 1;
        assert!(step < 5000, "the engine does not finish");
    }
    for (i, (req, ids, reason)) in finished.iter().enumerate() {
        let want = solo(&model, &req.prompt, req.max_tokens.unwrap()).0;
        match reason {
            StopReason::MaxTokens => assert_eq!(ids, &want, "request {i}"),
            StopReason::Cancelled => assert_eq!(ids[..], want[..ids.len()], "request {i}"),
            r => panic!("request {i} ended with {r:?}"),
        }
    }
    assert_eq!(engine.pool_use(), (0, 0), "only the cache holds anything");
    (preemptions, engine.prefix_stats().expect("on"))
}

#[test]
fn concurrent_shared_prefixes_equal_their_cold_runs() {
    let cfg = EngineConfig {
        max_seqs: 4,
        block_size: BS,
        step_tokens: 40,
        prefix_snapshots: 16,
        adaptive_k: false,
        ..Default::default()
    };
    let (_, stats) = concurrent(cfg, 7, 24);
    assert!(stats.hits > 0 && stats.hit_tokens > 0, "{stats:?}");
}

/// One snapshot slot and KV blocks for about two sequences: entries are evicted, sequences
/// preempted, and every request still gets its cold tokens.
#[test]
fn a_tiny_budget_evicts_and_stays_exact() {
    let cfg = EngineConfig {
        max_seqs: 3,
        kv_blocks: Some(14),
        block_size: BS,
        step_tokens: 32,
        prefix_snapshots: 1,
        adaptive_k: false,
        ..Default::default()
    };
    let (preemptions, stats) = concurrent(cfg, 13, 16);
    assert!(stats.evictions > 0, "{stats:?}");
    assert!(preemptions > 0, "the pool was meant to be too small");
}

/// A turn that ends at a stop id, long before its `max_tokens`: the next turn hits the state
/// kept at the last 8-block boundary (64 positions at blocks of 8) its decoding passed.
#[test]
fn a_turn_ending_early_keeps_its_last_eighth_block_boundary() {
    let model = bundled();
    let vocab = model.config().vocab_size;
    let mut engine = Engine::new(model.clone(), turns_config()).unwrap();
    let mut rng = Rng::new(21);
    let prompt = random_ids(&mut rng, vocab, 60);
    let (long, _) = solo(&model, &prompt, 120);
    // A stop id first generated at an output index past 5 (so that the run passes position 64).
    let at = (5..110)
        .rev()
        .find(|&i| !long[..i].contains(&long[i]))
        .expect("a token new to the output");
    let mut req = Request::greedy(prompt.clone(), 120);
    req.stop_ids = vec![long[at]];
    let h = engine.submit(req).unwrap();
    engine.run_to_completion().unwrap();
    let o = collect(&h);
    assert_eq!(o.end.expect("ended").0, StopReason::StopToken(long[at]));
    assert_eq!(o.ids, long[..=at]);
    // Positions run: the prompt and all but the last output token.
    let ran = prompt.len() + o.ids.len() - 1;
    let kept = ran / 64 * 64;
    assert!(kept > prompt.len(), "the turn passes an 8-block boundary");
    assert!(ran < prompt.len() + 119, "it stops early");
    let next: Vec<u32> = [&prompt[..], &o.ids, &random_ids(&mut rng, vocab, 5)].concat();
    let h = engine.submit(Request::greedy(next.clone(), 4)).unwrap();
    engine.run_to_completion().unwrap();
    let o = collect(&h);
    let (_, usage) = o.end.expect("ended");
    assert_eq!(usage.cached_tokens, kept);
    assert_eq!(o.ids, solo(&model, &next, 4).0);
}
