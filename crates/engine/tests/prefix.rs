//! The prefix cache through the engine: multi-turn conversations and prompts sharing a system
//! prompt, one at a time or concurrent, with MTP and without, give every request its cold solo
//! tokens; the tokens served from the cache are exactly what the snapshot points allow; a tiny
//! snapshot budget and KV pool evict, stay exact and stay within the budget.

mod common;

use common::{bundled, collect, model_helpers, solo};
use qwen36_engine::{Engine, EngineConfig, Event, Request, RequestHandle, Speculation, StopReason, Usage};
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
///
/// An MTP-drafting request hits only where every block's MTP K/V is written: a finished
/// MTP-drafting request writes that of its blocks up to the furthest point it keeps, each block's
/// last pair with the token after the block, and the first such writer of a prefix's block is
/// the one kept; a hit needs the prompt's own token after each of its blocks.
#[derive(Default)]
struct Policy {
    /// Token prefixes whose state is kept.
    snapshots: Vec<Vec<u32>>,
    /// Block-aligned prefixes whose last block's MTP K/V is written, with the token after it.
    mtp: std::collections::HashMap<Vec<u32>, u32>,
}

impl Policy {
    fn hit(&self, prompt: &[u32]) -> usize {
        self.longest(prompt, |_| true)
    }

    fn mtp_hit(&self, prompt: &[u32]) -> usize {
        self.longest(prompt, |s| {
            (BS..=s.len())
                .step_by(BS)
                .all(|end| self.mtp.get(&prompt[..end]) == Some(&prompt[end]))
        })
    }

    fn longest(&self, prompt: &[u32], usable: impl Fn(&[u32]) -> bool) -> usize {
        self.snapshots
            .iter()
            .filter(|s| s.len() < prompt.len() && prompt.starts_with(s) && usable(s))
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

    /// What a request that hit `hit` tokens and generated `out` keeps (`mtp`: it drafted with
    /// the MTP head).
    fn finished(&mut self, prompt: &[u32], out: &[u32], hit: usize, mtp: bool) {
        let len = prompt.len();
        let mut points = vec![self.cached_blocks(prompt), len / BS * BS];
        // Decoding runs positions len.. one at a time; the last token is never run.
        let ran = len + out.len() - 1;
        let last = ran / BS * BS;
        if last > len {
            points.push(last);
        }
        let all: Vec<u32> = prompt.iter().chain(out).copied().collect();
        let furthest = points.iter().copied().max().unwrap_or(0);
        for end in (BS..=furthest).step_by(BS).filter(|_| mtp) {
            self.mtp.entry(all[..end].to_vec()).or_insert(all[end]);
        }
        for p in points.into_iter().filter(|&p| p > hit) {
            let s = all[..p].to_vec();
            if !self.snapshots.contains(&s) {
                self.snapshots.push(s);
            }
        }
    }
}

/// One turn, alone in `engine`: its tokens are its cold solo run's, the tokens it is served
/// from the cache are what `policy` allows (which then records what it keeps), and with `cold`
/// (an engine without a prefix cache) it drafts and accepts exactly what it does there (an MTP
/// hit's cached MTP K/V is the cold run's). Returns its output and usage.
fn turn(
    engine: &mut Engine,
    cold: Option<&mut Engine>,
    policy: &mut Policy,
    req: Request,
    what: &str,
) -> (Vec<u32>, Usage) {
    let max = req.max_tokens.expect("a max_tokens");
    let h = engine.submit(req.clone()).unwrap();
    engine.run_to_completion().unwrap();
    let o = collect(&h);
    let (reason, usage) = o.end.expect("it ended");
    assert_eq!(reason, StopReason::MaxTokens);
    assert_eq!(o.ids, solo(engine.model(), &req.prompt, max).0, "{what}");
    let mtp = matches!(req.speculation, Some(Speculation::Mtp { .. }));
    if let Some(cold) = cold {
        let h = cold.submit(req.clone()).unwrap();
        cold.run_to_completion().unwrap();
        let (_, alone) = collect(&h).end.expect("it ended");
        assert_eq!(
            (usage.speculation.drafted, usage.speculation.accepted),
            (alone.speculation.drafted, alone.speculation.accepted),
            "{what}: drafts and acceptance of its cold run"
        );
    }
    let want = match mtp {
        true => policy.mtp_hit(&req.prompt),
        false => policy.hit(&req.prompt),
    };
    assert_eq!(usage.cached_tokens, want, "{what}: tokens from the cache");
    policy.finished(&req.prompt, &o.ids, want, mtp);
    (o.ids, usage)
}

/// Conversations taking turns one request at a time ([`turn`]), each turn resending its
/// history and the last answer with a new message, all opening with one system prompt. `spec`
/// picks each turn's speculation. Returns the tokens served from the cache, the prompt tokens,
/// and the drafts accepted.
fn turns(
    engine: &mut Engine,
    seed: u64,
    spec: impl Fn(usize) -> Option<Speculation>,
    mut cold: Option<&mut Engine>,
) -> (usize, usize, usize) {
    let vocab = engine.model().config().vocab_size;
    let mut rng = Rng::new(seed);
    let system = random_ids(&mut rng, vocab, 21);
    let mut histories: Vec<Vec<u32>> = vec![system.clone(); 3];
    let mut policy = Policy::default();
    let (mut hits, mut prompt_tokens, mut accepted) = (0, 0, 0);
    for t in 0..3 {
        for (c, history) in histories.iter_mut().enumerate() {
            let len = rng.range(3, 20);
            let message = random_ids(&mut rng, vocab, len);
            let prompt: Vec<u32> = history.iter().chain(&message).copied().collect();
            let mut req = Request::greedy(prompt.clone(), rng.range(4, 30));
            req.speculation = spec(t);
            let what = format!("turn {t} of {c}");
            let (out, usage) = turn(engine, cold.as_deref_mut(), &mut policy, req, &what);
            accepted += usage.speculation.accepted;
            hits += usage.cached_tokens;
            prompt_tokens += prompt.len();
            *history = [prompt, out].concat();
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
    let (hits, prompt_tokens, _) = turns(&mut engine, 11, |_| None, None);
    assert!(
        hits * 2 > prompt_tokens,
        "most of the history comes from the cache: {hits} of {prompt_tokens}"
    );
}

/// Turns decoded speculatively (MTP, then prompt lookup) keep the state at the block boundary
/// inside a verified run (from the verify's checkpoints): the next turn's hit there is exact.
#[test]
fn turns_after_speculative_decoding_hit_exactly() {
    let (mut engine, mut cold) = mtp_engines();
    let (hits, _, accepted) = turns(
        &mut engine,
        12,
        |turn| match turn {
            0 => Some(Speculation::Mtp { k: 3 }),
            1 => Some(Speculation::ngram(3)),
            _ => None,
        },
        Some(&mut cold),
    );
    assert!(
        hits > 0 && accepted > 0,
        "{hits} hits, {accepted} drafts accepted"
    );
}

/// An engine with the MTP head and the prefix cache, and one without the cache. Both prefill
/// a block per step, so that their chunks end at the same positions and the MTP head is fed
/// bit-identical hidden states (a chunk boundary elsewhere changes their rounding, and the
/// bundled head's drafts flip on that).
fn mtp_engines() -> (Engine, Engine) {
    let (model, head) = model_helpers::load_bundled();
    let on = EngineConfig {
        step_tokens: BS,
        ..turns_config()
    };
    let off = EngineConfig {
        prefix_snapshots: 0,
        ..on.clone()
    };
    let engine = Engine::with_mtp_head(model.clone(), head.clone(), on).unwrap();
    (engine, Engine::with_mtp_head(model, head, off).unwrap())
}

/// Every turn drafting with the MTP head: the turns hit the cache as plain ones do (the MTP
/// head's K/V of each cached block is written, a finished turn's last kept block included), and
/// draft exactly as their cold runs.
#[test]
fn mtp_turns_hit_the_cache_and_draft_as_cold() {
    let (mut engine, mut cold) = mtp_engines();
    let mtp = |_| Some(Speculation::Mtp { k: 2 });
    let (hits, prompt_tokens, accepted) = turns(&mut engine, 14, mtp, Some(&mut cold));
    assert!(
        hits * 2 > prompt_tokens && accepted > 0,
        "{hits} of {prompt_tokens} from the cache, {accepted} drafts accepted"
    );
}

/// A plain turn caches blocks without the MTP head's K/V: the MTP turn after it misses them,
/// but leaves its own blocks (with the K/V) in their place, and the next MTP turn hits as a
/// plain one would, drafting exactly as cold.
#[test]
fn mtp_turns_after_a_plain_one_hit_from_the_second() {
    let (mut engine, mut cold) = mtp_engines();
    let spec = |turn| (turn > 0).then_some(Speculation::Mtp { k: 3 });
    let (hits, _, accepted) = turns(&mut engine, 15, spec, Some(&mut cold));
    assert!(hits > 0 && accepted > 0, "{hits} hits, {accepted} accepted");
}

/// An MTP turn of one token after a plain one (no decoding, so nothing kept past its prompt):
/// it misses the plain turn's blocks, then leaves its own in their place up to the furthest
/// snapshot point it passed, whether it found that snapshot kept (the plain turn's) or kept it
/// itself (a new prompt end, or where it branches inside the plain turn's blocks); the next MTP
/// turn hits there.
#[test]
fn a_one_token_mtp_turn_leaves_its_blocks_up_to_its_kept_points() {
    let vocab = bundled().config().vocab_size;
    let mut rng = Rng::new(16);
    // The plain prompt's length, and the MTP turn's prompt: the plain turn's history (prompt
    // and answer) cut to `keep` tokens, and `more` new ones.
    for (plain_len, keep, more) in [(26, 28, 3), (26, 28, 6), (34, 29, 5)] {
        let (mut engine, mut cold) = mtp_engines();
        let mut policy = Policy::default();
        let plain = Request::greedy(random_ids(&mut rng, vocab, plain_len), 2);
        let (out, _) = turn(&mut engine, None, &mut policy, plain.clone(), "plain");
        let mut history = [plain.prompt, out].concat();
        history.truncate(keep);
        for (i, more, max) in [(0, more, 1), (1, 8, 5)] {
            let prompt = [history.clone(), random_ids(&mut rng, vocab, more)].concat();
            let mut req = Request::greedy(prompt.clone(), max);
            req.speculation = Some(Speculation::Mtp { k: 2 });
            let what = format!("MTP turn {i} of case {plain_len}/{keep}/{more}");
            let (out, usage) = turn(&mut engine, Some(&mut cold), &mut policy, req, &what);
            assert_eq!(usage.cached_tokens > 0, i == 1, "{what}");
            history = [prompt, out].concat();
        }
    }
}

/// An MTP-drafting request hits a running one's prompt as soon as the running one has fed the
/// MTP head its prompt's pairs, not only once it finishes.
#[test]
fn mtp_requests_hit_a_running_requests_prompt() {
    let (mut engine, mut cold) = mtp_engines();
    let vocab = engine.model().config().vocab_size;
    let mut rng = Rng::new(17);
    let prompt = random_ids(&mut rng, vocab, 30);
    let mut long = Request::greedy(prompt.clone(), 40);
    long.speculation = Some(Speculation::Mtp { k: 2 });
    let first = engine.submit(long).unwrap();
    while collect_some(&first) < 3 {
        engine.step().unwrap();
    }
    let mut req = Request::greedy([prompt, random_ids(&mut rng, vocab, 4)].concat(), 5);
    req.speculation = Some(Speculation::Mtp { k: 2 });
    let h = engine.submit(req.clone()).unwrap();
    while h.try_recv().is_none() {
        engine.step().unwrap();
    }
    engine.run_to_completion().unwrap();
    assert!(first.drain().iter().any(|e| matches!(e, Event::Finished { .. })));
    let (_, usage) = collect(&h).end.expect("it ended");
    assert_eq!(
        usage.cached_tokens, 24,
        "the running prompt's last block boundary"
    );
    let alone = cold.submit(req).unwrap();
    cold.run_to_completion().unwrap();
    let (_, cold_usage) = collect(&alone).end.expect("it ended");
    assert_eq!(
        (usage.speculation.drafted, usage.speculation.accepted),
        (cold_usage.speculation.drafted, cold_usage.speculation.accepted)
    );
}

/// Tokens a handle has sent so far (its events consumed).
fn collect_some(h: &RequestHandle) -> usize {
    let mut n = 0;
    while let Some(e) = h.try_recv() {
        if let Event::Token { ids, .. } = e {
            n += ids.len();
        }
    }
    n
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
                    Event::Prompt { .. } => panic!("prompt log-probabilities not asked for"),
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

/// A request that recomputes blocks the cache already holds (no snapshot where they end, so no
/// hit) in a pool with room for exactly its own positions: the cache's copies give way, and the
/// request runs to its `max_tokens` as it does alone instead of ending with a full context.
#[test]
fn recomputed_cached_blocks_give_way_to_their_sequence() {
    let model = bundled();
    let vocab = model.config().vocab_size;
    let cfg = EngineConfig {
        max_seqs: 1,
        kv_blocks: Some(4),
        block_size: BS,
        ..Default::default()
    };
    let mut engine = Engine::new(model.clone(), cfg).unwrap();
    let mut rng = Rng::new(5);
    let (a, b, c) = (
        random_ids(&mut rng, vocab, BS),
        random_ids(&mut rng, vocab, BS),
        random_ids(&mut rng, vocab, BS + 1),
    );
    let first = [&a[..], &b[..]].concat();
    let h = engine.submit(Request::greedy(first, 1)).unwrap();
    engine.run_to_completion().unwrap();
    assert!(collect(&h).end.is_some());
    // 17 prompt tokens + 15: the 32 positions of the pool (the last token is never run).
    let second = [&a[..], &c[..]].concat();
    let h = engine.submit(Request::greedy(second.clone(), 15)).unwrap();
    engine.run_to_completion().unwrap();
    let o = collect(&h);
    let (reason, usage) = o.end.expect("ended");
    assert_eq!((reason, usage.cached_tokens), (StopReason::MaxTokens, 0));
    assert_eq!(o.ids, solo(&model, &second, 15).0);
}

/// A request for its prompt's log-probabilities reads the row of every prompt position, so a
/// cached prefix of its prompt is not served: its log-probabilities are a cold forward's, and
/// the same prompt without them hits the cache it warmed.
#[test]
fn prompt_logprobs_run_the_whole_prompt() {
    let mut engine = Engine::new(bundled(), turns_config()).unwrap();
    let model = engine.model().clone();
    let vocab = model.config().vocab_size;
    let mut rng = Rng::new(23);
    let first = random_ids(&mut rng, vocab, 30);
    let h = engine.submit(Request::greedy(first.clone(), 5)).unwrap();
    engine.run_to_completion().unwrap();
    let out = collect(&h).ids;
    let prompt = [first, out, random_ids(&mut rng, vocab, 4)].concat();
    let (got, usage) = common::prompt_alone(&mut engine, &prompt, 2, None);
    assert_eq!(usage.cached_tokens, 0, "a cached prefix skips rows it reads");
    let rel = if qwen36_testutil::test_device().is_cuda() {
        1e-4
    } else {
        1e-5
    };
    common::check_prompt_logprobs(&model, &prompt, &got, 2, rel, "the cached prompt");
    // Without them, the same prompt (and one token more) hits what both requests kept.
    let again = engine.submit(Request::greedy(prompt.clone(), 1)).unwrap();
    engine.run_to_completion().unwrap();
    let (_, usage) = collect(&again).end.expect("it ended");
    assert_eq!(usage.cached_tokens, 32, "the prompt's last block boundary");
}

/// A pool that the cache has filled gives way to a drafting sequence's MTP K/V as it does to
/// its own K/V: the cache's blocks are evicted, and each sequence drafts (and generates) exactly
/// as it does alone in an empty engine, not one draft a verify wherever its MTP K/V needs a
/// block. The pool holds two whole sequences and a block each (as `bench_serving` sizes it);
/// the second pair of requests finds it full of the first pair's cached blocks.
#[test]
fn the_cache_gives_way_to_mtp_drafts() {
    let (model, head) = model_helpers::load_bundled();
    let (prompt_len, max_tokens, k): (usize, usize, usize) = (32, 64, 3);
    let cfg = EngineConfig {
        max_seqs: 2,
        kv_blocks: Some(2 * (prompt_len + max_tokens + k).div_ceil(BS) + 2),
        block_size: BS,
        prefix_snapshots: 4,
        adaptive_k: false,
        ..Default::default()
    };
    let mut rng = Rng::new(61);
    let vocab = model.config().vocab_size;
    let prompts: Vec<Vec<u32>> = (0..4).map(|_| random_ids(&mut rng, vocab, prompt_len)).collect();
    let mtp = |prompt: &Vec<u32>| Request {
        speculation: Some(Speculation::Mtp { k }),
        ..Request::greedy(prompt.clone(), max_tokens)
    };
    let outcome = |h: &RequestHandle| {
        let o = collect(h);
        (o.ids, o.end.unwrap().1.speculation)
    };
    let mut engine = Engine::with_mtp_head(model.clone(), head.clone(), cfg.clone()).unwrap();
    let handles: Vec<RequestHandle> = prompts.iter().map(|p| engine.submit(mtp(p)).unwrap()).collect();
    // (Every request counted once as finished: those that end feeding their last pairs too.)
    let mut finished = 0;
    while engine.pending() > 0 {
        finished += engine.step().unwrap().finished;
    }
    assert_eq!(finished, prompts.len());
    assert!(engine.prefix_stats().unwrap().evictions > 0);
    for (p, h) in prompts.iter().zip(&handles) {
        let mut empty = Engine::with_mtp_head(model.clone(), head.clone(), cfg.clone()).unwrap();
        let alone = empty.submit(mtp(p)).unwrap();
        empty.run_to_completion().unwrap();
        let (got, want) = (outcome(h), outcome(&alone));
        assert_eq!(
            got.1.drafted, want.1.drafted,
            "drafts cut: {:?} against {:?}",
            got.1, want.1
        );
        assert_eq!(got, want);
    }
}
