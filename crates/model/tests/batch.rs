//! The flat batched forward over pooled caches (`Qwen36Model::forward_batch`) against each
//! sequence run alone through its own `Cache`: random arrivals, prefill chunks, decode tokens and
//! speculative verifies with random commits, in few slots and scattered blocks so that slots and
//! blocks are reused.

#[path = "../../testutil/include/model.rs"]
mod model_helpers;

use candle_core::{DType, Tensor};
use model_helpers::{load, load_at};
use qwen36_model::{BatchStepper, Cache, Error, ForwardBatch, PagedCache, Qwen36Model, SeqChunk};
use qwen36_testutil::{bundled_dir, ids_tensor, max_row_rel_err, Rng};

/// The bound on a batched chunk's rows against its solo run, relative to each row's scale: the
/// issue's 1e-5 in f32 on the CPU, where a chunk's rows go through the same kernels as alone but
/// the projections see more rows (the matmul may block the reduction differently; measured
/// 5.6e-6). On CUDA one row takes the streaming GEMV and several cuBLAS, whose f32 reductions
/// differ in order: measured 3.9e-5 over the HF fixture's six layers, bounded at 1e-4 until
/// the decode kernels are batch-invariant.
fn tol() -> f32 {
    if qwen36_testutil::test_device().is_cuda() {
        1e-4
    } else {
        1e-5
    }
}

struct Seq {
    prompt: Vec<u32>,
    arrive: usize,
    /// Tokens past the prompt before it leaves.
    extra: usize,
    slot: Option<u32>,
    blocks: Vec<u32>,
    /// Tokens run (committed).
    pos: usize,
    /// The greedy token after `pos`, once the prompt is in.
    next: Option<u32>,
    solo: Cache,
    done: bool,
}

/// Free ids of a pool, handed out in a scrambled order.
struct Free(Vec<u32>);

impl Free {
    fn take(&mut self, rng: &mut Rng) -> Option<u32> {
        (!self.0.is_empty()).then(|| {
            let i = rng.below(self.0.len());
            self.0.swap_remove(i)
        })
    }
}

fn argmax_rows(logits: &Tensor) -> Vec<u32> {
    logits
        .argmax(candle_core::D::Minus1)
        .unwrap()
        .to_vec1::<u32>()
        .unwrap()
}

/// Runs `n` random sequences through a pool of `slots` slots and `blocks` blocks of
/// `block_size`; returns (the largest row error against the solo runs, slot reuses, verifies).
fn run_random(
    model: &Qwen36Model,
    seed: u64,
    n: usize,
    (slots, blocks, block_size): (usize, usize, usize),
) -> (f32, usize, usize) {
    let mut rng = Rng::new(seed);
    let vocab = model.config().vocab_size;
    let mut seqs: Vec<Seq> = (0..n)
        .map(|i| {
            let len = rng.range(1, 40);
            Seq {
                prompt: (0..len).map(|_| rng.below(vocab) as u32).collect(),
                arrive: rng.below(3 * n) + i / 2,
                extra: rng.range(1, 12),
                slot: None,
                blocks: Vec::new(),
                pos: 0,
                next: None,
                solo: model.new_cache(1).unwrap(),
                done: false,
            }
        })
        .collect();
    let mut pool = model.new_paged_cache(slots, blocks, block_size).unwrap();
    let mut free_slots = Free((0..slots as u32).collect());
    let mut free_blocks = Free((0..blocks as u32).collect());
    let (mut worst, mut used_slots, mut reuses, mut verifies) = (0f32, vec![false; slots], 0, 0);
    for step in 0.. {
        if seqs.iter().all(|s| s.done) {
            break;
        }
        assert!(step < 10_000, "the schedule does not finish");
        let mut chunks = Vec::new();
        let mut members = Vec::new();
        for (i, s) in seqs.iter_mut().enumerate() {
            if s.done || s.arrive > step {
                continue;
            }
            if s.slot.is_none() {
                let Some(slot) = free_slots.take(&mut rng) else {
                    continue;
                };
                reuses += used_slots[slot as usize] as usize;
                used_slots[slot as usize] = true;
                s.slot = Some(slot);
            }
            let (tokens, verify) = match s.next {
                None => {
                    let t = rng.range(1, (s.prompt.len() - s.pos).min(13));
                    (s.prompt[s.pos..s.pos + t].to_vec(), false)
                }
                Some(next) if rng.chance(0.3) => {
                    let drafts = rng.range(1, 3);
                    let mut t = vec![next];
                    t.extend((0..drafts).map(|_| rng.below(vocab) as u32));
                    (t, true)
                }
                Some(next) => (vec![next], false),
            };
            let end = s.pos + tokens.len();
            while s.blocks.len() * block_size < end {
                match free_blocks.take(&mut rng) {
                    Some(b) => s.blocks.push(b),
                    None => break,
                }
            }
            if s.blocks.len() * block_size < end {
                continue; // no room this step
            }
            chunks.push(SeqChunk {
                slot: s.slot.unwrap(),
                start: s.pos,
                tokens,
                blocks: s.blocks.clone(),
                verify,
            });
            members.push(i);
        }
        if chunks.is_empty() {
            continue;
        }
        let batch = ForwardBatch::new(chunks);
        let out = model.forward_batch(&batch, &mut pool).unwrap();
        let logits = model.logits(&out.hidden).unwrap();
        // Every verified chunk's commit at once, after the step (as the engine commits).
        let mut keeps = Vec::new();
        for (c, &i) in members.iter().enumerate() {
            let s = &mut seqs[i];
            let chunk = &batch.chunks()[c];
            let ids = ids_tensor(&chunk.tokens);
            let mine = logits.narrow(0, batch.rows(c).start, chunk.tokens.len()).unwrap();
            let solo = if chunk.verify {
                let h = model.forward_verify(&ids, &mut s.solo).unwrap();
                model.logits(&h).unwrap().squeeze(0).unwrap()
            } else {
                model.forward(&ids, &mut s.solo).unwrap().squeeze(0).unwrap()
            };
            worst = worst.max(max_row_rel_err(&mine, &solo));
            let (greedy, solo_greedy) = (argmax_rows(&mine), argmax_rows(&solo));
            assert_eq!(
                greedy, solo_greedy,
                "sequence {i} step {step}: batched greedy ids differ from solo"
            );
            let keep = if chunk.verify {
                verifies += 1;
                let keep = rng.range(1, chunk.tokens.len());
                keeps.push((c, keep));
                s.solo.commit(keep).unwrap();
                keep
            } else {
                chunk.tokens.len()
            };
            s.pos += keep;
            if s.pos >= s.prompt.len() {
                s.next = Some(greedy[keep - 1]);
            }
            if s.pos >= s.prompt.len() + s.extra {
                s.done = true;
                free_slots.0.push(s.slot.take().unwrap());
                free_blocks.0.append(&mut s.blocks);
            }
        }
        if let Some(pending) = &out.pending {
            pool.commit_many(pending, &keeps).unwrap();
        }
    }
    (worst, reuses, verifies)
}

#[test]
fn batched_forward_equals_each_sequence_alone() {
    let (model, _) = model_helpers::load_bundled();
    let (worst, reuses, verifies) = run_random(&model, 7, 9, (3, 40, 4));
    assert!(
        worst <= tol(),
        "largest row error against the solo runs: {worst:e}"
    );
    assert!(
        reuses >= 3 && verifies >= 5,
        "the schedule must reuse slots ({reuses}) and verify ({verifies})"
    );
}

#[test]
fn batched_forward_equals_solo_on_the_hf_fixture() {
    let model = load("tiny-flat", DType::F32);
    let (worst, reuses, _) = run_random(&model, 11, 6, (2, 64, 16));
    assert!(
        worst <= tol(),
        "largest row error against the solo runs: {worst:e}"
    );
    assert!(reuses >= 2);
}

fn chunk(slot: u32, start: usize, tokens: &[u32], blocks: &[u32]) -> SeqChunk {
    SeqChunk {
        slot,
        start,
        tokens: tokens.to_vec(),
        blocks: blocks.to_vec(),
        verify: false,
    }
}

#[test]
fn bad_batches_are_typed_errors() {
    let model = load_at(bundled_dir(), DType::F32);
    let mut pool: PagedCache = model.new_paged_cache(2, 4, 4).unwrap();
    let vocab = model.config().vocab_size as u32;
    let run =
        |pool: &mut PagedCache, chunks: Vec<SeqChunk>| model.forward_batch(&ForwardBatch::new(chunks), pool);
    let cases: Vec<(Vec<SeqChunk>, &str)> = vec![
        (vec![], "empty batch"),
        (vec![chunk(0, 0, &[], &[0])], "no tokens"),
        (vec![chunk(0, 0, &[vocab], &[0])], "outside the vocabulary"),
        (vec![chunk(2, 0, &[1], &[0])], "slot 2 is outside the pool of 2"),
        (
            vec![chunk(0, 0, &[1], &[0]), chunk(0, 0, &[2], &[1])],
            "slot 0 is used twice",
        ),
        (
            vec![chunk(0, 3, &[1, 2], &[0])],
            "1 blocks of 4 positions do not hold 5",
        ),
        (vec![chunk(0, 0, &[1], &[4])], "block 4 is outside the pool of 4"),
        (vec![chunk(0, usize::MAX, &[1], &[0])], "is past any position"),
    ];
    for (chunks, want) in cases {
        let e = run(&mut pool, chunks).unwrap_err().to_string();
        assert!(e.contains(want), "{e:?} should say {want:?}");
    }
    let max = model.config().max_position_embeddings;
    let blocks: Vec<u32> = vec![0; max / 4 + 1];
    let e = run(&mut pool, vec![chunk(0, max, &[1], &blocks)]).unwrap_err();
    assert!(
        matches!(e, Error::ContextOverflow { needed, .. } if needed == max + 1),
        "{e}"
    );
    assert!(model.new_paged_cache(0, 4, 4).is_err() && model.new_paged_cache(1, 4, 0).is_err());
    // A commit needs a verified chunk of that batch.
    let out = run(&mut pool, vec![chunk(0, 0, &[1, 2], &[0])]).unwrap();
    assert!(out.pending.is_none());
    let mut verify = chunk(1, 0, &[1, 2, 3], &[1]);
    verify.verify = true;
    let out = run(&mut pool, vec![chunk(0, 2, &[3], &[0]), verify]).unwrap();
    let pending = out.pending.unwrap();
    assert!(pool
        .commit(&pending, 0, 1)
        .unwrap_err()
        .to_string()
        .contains("chunk 0 was not verified"));
    assert!(pool.commit(&pending, 1, 4).is_err() && pool.commit(&pending, 1, 0).is_err());
    pool.commit(&pending, 1, 2).unwrap();
}

/// A commit of several chunks with one bad keep changes no slot (the first chunk's keep was
/// recorded before the second was checked, and replayed on the slot's next pass).
#[test]
fn a_failed_commit_of_several_chunks_changes_nothing() {
    let model = load_at(bundled_dir(), DType::F32);
    let mut pool: PagedCache = model.new_paged_cache(2, 8, 4).unwrap();
    let run =
        |pool: &mut PagedCache, chunks: Vec<SeqChunk>| model.forward_batch(&ForwardBatch::new(chunks), pool);
    run(
        &mut pool,
        vec![chunk(0, 0, &[5, 9, 2], &[0, 1]), chunk(1, 0, &[5, 9, 2], &[2, 3])],
    )
    .unwrap();
    let layers = model.config().num_hidden_layers;
    let gdn = (0..layers)
        .find(|&l| pool.slot_state(l, 0).unwrap().is_some())
        .unwrap();
    let (_, before) = pool.slot_state(gdn, 0).unwrap().unwrap();
    let verify = |slot, blocks: &[u32]| SeqChunk {
        verify: true,
        ..chunk(slot, 3, &[7, 7, 1], blocks)
    };
    let out = run(&mut pool, vec![verify(0, &[0, 1]), verify(1, &[2, 3])]).unwrap();
    let pending = out.pending.unwrap();
    assert!(pool.commit_many(&pending, &[(0, 2), (1, 0)]).is_err());
    let (_, after) = pool.slot_state(gdn, 0).unwrap().unwrap();
    assert_eq!(max_row_rel_err(&after, &before), 0.0);
}

/// A verify's pending commits only while its slot is as the pass left it: after a later pass
/// over the slot, after its commit was settled, or after a copy into the slot, the same pending
/// is refused (its stash holds other tokens, or they were applied already) and the slot's state
/// does not move; the engine's own uses (the chunk's commit, then a snapshot of an earlier
/// boundary into a spare slot) are accepted; a pending is refused by another pool and as a
/// source for another chunk's slot; a slot listed twice in a settle takes its tokens once.
#[test]
fn stale_commits_are_refused_and_a_repeated_settle_applies_once() {
    let model = load_at(bundled_dir(), DType::F32);
    let layers = model.config().num_hidden_layers;
    let run =
        |pool: &mut PagedCache, chunks: Vec<SeqChunk>| model.forward_batch(&ForwardBatch::new(chunks), pool);
    let verify = |start, tokens: &[u32]| SeqChunk {
        verify: true,
        ..chunk(0, start, tokens, &[0, 1, 2])
    };
    let fresh = || {
        let mut pool: PagedCache = model.new_paged_cache(2, 8, 4).unwrap();
        run(&mut pool, vec![chunk(0, 0, &[5, 9, 2], &[0, 1, 2])]).unwrap();
        let pending = run(&mut pool, vec![verify(3, &[7, 7, 1])])
            .unwrap()
            .pending
            .unwrap();
        (pool, pending)
    };
    let gdn = {
        let (mut pool, _) = fresh();
        (0..layers)
            .find(|&l| pool.slot_state(l, 0).unwrap().is_some())
            .unwrap()
    };
    let state = |pool: &mut PagedCache| pool.slot_state(gdn, 0).unwrap().unwrap().1;

    // A later pass (a verify of other tokens), then the first verify's pending.
    let (mut pool, pending) = fresh();
    pool.commit(&pending, 0, 2).unwrap();
    let later = run(&mut pool, vec![verify(5, &[4, 3])]).unwrap().pending.unwrap();
    let err = pool.commit(&pending, 0, 1).unwrap_err();
    assert!(err.to_string().contains("stale"), "{err}");
    pool.commit(&later, 0, 2).unwrap();
    let want = {
        let (mut p, pd) = fresh();
        p.commit(&pd, 0, 2).unwrap();
        let l = run(&mut p, vec![verify(5, &[4, 3])]).unwrap().pending.unwrap();
        p.commit(&l, 0, 2).unwrap();
        state(&mut p)
    };
    assert_eq!(max_row_rel_err(&state(&mut pool), &want), 0.0);

    // A commit settled, then committed again.
    let (mut pool, pending) = fresh();
    pool.commit(&pending, 0, 2).unwrap();
    let settled = state(&mut pool);
    assert!(pool.commit(&pending, 0, 3).is_err());
    assert_eq!(max_row_rel_err(&state(&mut pool), &settled), 0.0);

    // A settle that finds nothing to apply changes nothing: the commit still holds.
    let (mut pool, pending) = fresh();
    pool.settle(&[0]).unwrap();
    pool.commit(&pending, 0, 2).unwrap();
    assert_eq!(max_row_rel_err(&state(&mut pool), &settled), 0.0);

    // A copy into the slot replaces what the pending's tokens were stashed over: refused, and
    // the slot keeps what was copied (slot 1's zeros).
    let (mut pool, pending) = fresh();
    pool.copy_slot(1, 0).unwrap();
    let copied = pool.slot_state(gdn, 1).unwrap().unwrap().1;
    assert!(pool.commit(&pending, 0, 2).is_err());
    assert_eq!(qwen36_testutil::max_abs_diff(&state(&mut pool), &copied), 0.0);

    // The engine's flow: the chunk's own commit, then (a rolling snapshot) its state after an
    // earlier boundary into another slot, from the same pending.
    let after_one = {
        let (mut p, pd) = fresh();
        p.commit(&pd, 0, 1).unwrap();
        state(&mut p)
    };
    let (mut pool, pending) = fresh();
    pool.commit(&pending, 0, 2).unwrap();
    pool.commit_into(&pending, &[(0, 1, 1)]).unwrap();
    assert_eq!(max_row_rel_err(&state(&mut pool), &settled), 0.0);
    let snapshot = pool.slot_state(gdn, 1).unwrap().unwrap().1;
    assert_eq!(max_row_rel_err(&snapshot, &after_one), 0.0);

    // A pending committed to another pool than its pass ran over.
    let (mut other, _) = fresh();
    let (_, pending) = fresh();
    assert!(other.commit(&pending, 0, 2).is_err());

    // A chunk's state copied into the slot another chunk of the pass runs on.
    let mut pool: PagedCache = model.new_paged_cache(2, 8, 4).unwrap();
    run(
        &mut pool,
        vec![chunk(0, 0, &[5, 9, 2], &[0, 1]), chunk(1, 0, &[5, 9, 2], &[2, 3])],
    )
    .unwrap();
    let two = |slot, blocks: &[u32]| SeqChunk {
        verify: true,
        ..chunk(slot, 3, &[7, 7, 1], blocks)
    };
    let pending = run(&mut pool, vec![two(0, &[0, 1]), two(1, &[2, 3])])
        .unwrap()
        .pending
        .unwrap();
    let err = pool.commit_into(&pending, &[(0, 2, 1), (1, 2, 1)]).unwrap_err();
    assert!(err.to_string().contains("another chunk"), "{err}");
    pool.commit_many(&pending, &[(0, 2), (1, 3)]).unwrap();

    // The slot twice in one settle: its two accepted tokens once.
    let (mut pool, pending) = fresh();
    pool.commit(&pending, 0, 2).unwrap();
    pool.settle(&[0, 0]).unwrap();
    assert_eq!(max_row_rel_err(&state(&mut pool), &settled), 0.0);
}

/// A sequence started in a slot sees nothing of the slot's last sequence, and clearing a slot
/// zeroes exactly that slot.
#[test]
fn slots_start_clean_and_clear_alone() {
    let model = load_at(bundled_dir(), DType::F32);
    let mut pool = model.new_paged_cache(2, 8, 4).unwrap();
    let prompt = [5u32, 9, 2, 7, 7, 1];
    let fresh = model
        .forward_batch(&ForwardBatch::new(vec![chunk(0, 0, &prompt, &[0, 1])]), &mut pool)
        .unwrap();
    // Dirty both slots, then start the same prompt in slot 1 over other blocks.
    let other = [3u32, 3, 8];
    model
        .forward_batch(&ForwardBatch::new(vec![chunk(1, 0, &other, &[2])]), &mut pool)
        .unwrap();
    let again = model
        .forward_batch(&ForwardBatch::new(vec![chunk(1, 0, &prompt, &[3, 4])]), &mut pool)
        .unwrap();
    assert_eq!(max_row_rel_err(&again.hidden, &fresh.hidden), 0.0);
    let gdn = (0..model.config().num_hidden_layers)
        .find(|&l| pool.slot_state(l, 0).unwrap().is_some())
        .unwrap();
    let norm = |t: Tensor| t.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
    pool.clear_slot(0).unwrap();
    let (conv0, rec0) = pool.slot_state(gdn, 0).unwrap().unwrap();
    let (_, rec1) = pool.slot_state(gdn, 1).unwrap().unwrap();
    assert_eq!(norm(conv0.to_dtype(DType::F32).unwrap()) + norm(rec0), 0.0);
    assert!(norm(rec1) > 0.0, "clearing slot 0 must leave slot 1");
    assert!(pool.clear_slot(2).is_err());
}

/// One sequence of [`stepper_steps_equal_eager_and_solo`].
struct Lived {
    slot: u32,
    blocks: Vec<u32>,
    pos: usize,
    next: u32,
    solo: Cache,
    end: usize,
}

/// Decode steps and verifies of every running sequence through a [`BatchStepper`] (recorded CUDA
/// graphs on CUDA, padded to their bucket of sequences) give the eager forward's rows over a
/// second pool (equal bits on the CPU; see `filled` for CUDA) and each sequence's solo run;
/// sequences join (prefilled eagerly) and leave between steps, reusing slots and blocks, and the
/// verifies' commits keep random prefixes.
#[test]
fn stepper_steps_equal_eager_and_solo() {
    let (model, _) = model_helpers::load_bundled();
    let (slots, per_slot, block_size) = (6usize, 16usize, 4usize);
    let new_pool = || {
        model
            .new_paged_cache(slots, slots * per_slot, block_size)
            .unwrap()
    };
    let (mut graphed, mut eager) = (new_pool(), new_pool());
    let mut stepper = BatchStepper::new(&model, true, 4);
    let mut rng = Rng::new(5);
    let vocab = model.config().vocab_size;
    let mut free: Vec<u32> = (0..slots as u32).rev().collect();
    let mut live: Vec<Lived> = Vec::new();
    let (mut filled_steps, mut sizes) = (0, std::collections::BTreeSet::new());
    // A step that fills its bucket runs the eager forward's kernels on the same rows: equal bits
    // on the CPU (the stepper is the eager forward). On CUDA a replayed graph's cuBLAS products
    // sum in another order than the same call made eagerly (measured 8.7e-7 of a row's scale on
    // the H200): bounded at 1e-5, f32 rounding and not a wrong state or position, which moves
    // rows by 1e-3 and more. Padded steps take the batched-vs-solo bound.
    let filled = if qwen36_testutil::test_device().is_cuda() {
        1e-5
    } else {
        0.0
    };
    let mut worst = [0f32; 2];
    let greedy = |logits: &Tensor, row: usize| argmax_rows(&logits.narrow(0, row, 1).unwrap())[0];
    for round in 0..14 {
        // Arrivals take free slots (their blocks interleaved with the other slots'), prefilled.
        let mut chunks = Vec::new();
        while !free.is_empty() && (live.is_empty() || rng.chance(0.4)) {
            let slot = free.pop().unwrap();
            let prompt: Vec<u32> = (0..rng.range(3, 12)).map(|_| rng.below(vocab) as u32).collect();
            let blocks: Vec<u32> = (0..per_slot).map(|j| (j * slots) as u32 + slot).collect();
            let mut solo = model.new_cache(1).unwrap();
            let solo_logits = model
                .forward(&ids_tensor(&prompt), &mut solo)
                .unwrap()
                .squeeze(0)
                .unwrap();
            chunks.push(SeqChunk {
                slot,
                start: 0,
                tokens: prompt.clone(),
                blocks: blocks.clone(),
                verify: false,
            });
            live.push(Lived {
                slot,
                blocks,
                pos: prompt.len(),
                next: greedy(&solo_logits, prompt.len() - 1),
                solo,
                end: round + rng.range(1, 6),
            });
        }
        if !chunks.is_empty() {
            let batch = ForwardBatch::new(chunks);
            stepper.forward(&model, &batch, &mut graphed).unwrap();
            model.forward_batch(&batch, &mut eager).unwrap();
        }
        // A decode step of every running sequence, then a verify of `drafts` + 1 tokens each:
        // as many for all in odd rounds, in even ones each its own (a graph pads them after
        // their tokens to the longest).
        let drafts: Vec<usize> = match round % 2 {
            1 => vec![rng.range(1, 4); live.len()],
            _ => live.iter().map(|_| rng.range(1, 4)).collect(),
        };
        let uniform = drafts.iter().all(|&d| d == drafts[0]);
        for verify in [false, true] {
            let chunks: Vec<SeqChunk> = live
                .iter()
                .zip(&drafts)
                .map(|(s, &drafts)| {
                    let mut tokens = vec![s.next];
                    if verify {
                        tokens.extend((0..drafts).map(|_| rng.below(vocab) as u32));
                    }
                    SeqChunk {
                        slot: s.slot,
                        start: s.pos,
                        tokens,
                        blocks: s.blocks.clone(),
                        verify,
                    }
                })
                .collect();
            let batch = ForwardBatch::new(chunks);
            let out = stepper.forward(&model, &batch, &mut graphed).unwrap();
            let reference = model.forward_batch(&batch, &mut eager).unwrap();
            let n = live.len();
            sizes.insert(n);
            let diff = max_row_rel_err(&out.hidden, &reference.hidden);
            let fills = qwen36_model::BATCH_BUCKETS.contains(&n) && (uniform || !verify);
            worst[fills as usize] = worst[fills as usize].max(diff);
            if fills {
                assert!(
                    diff <= filled,
                    "round {round}: {n} sequences (verify {verify}), {diff:e}"
                );
                filled_steps += 1;
            } else {
                assert!(diff <= tol(), "round {round}: padded, {diff:e}");
            }
            let logits = model.logits(&out.hidden).unwrap();
            let mut keeps = Vec::new();
            for (c, s) in live.iter_mut().enumerate() {
                let chunk = &batch.chunks()[c];
                let rows = batch.rows(c);
                let mine = logits.narrow(0, rows.start, rows.len()).unwrap();
                let ids = ids_tensor(&chunk.tokens);
                let solo = if verify {
                    let h = model.forward_verify(&ids, &mut s.solo).unwrap();
                    model.logits(&h).unwrap().squeeze(0).unwrap()
                } else {
                    model.forward(&ids, &mut s.solo).unwrap().squeeze(0).unwrap()
                };
                let err = max_row_rel_err(&mine, &solo);
                assert!(err <= tol(), "round {round} sequence {c}: {err:e} against solo");
                let keep = if verify { rng.range(1, drafts[c] + 1) } else { 1 };
                if verify {
                    keeps.push((c, keep));
                    s.solo.commit(keep).unwrap();
                }
                s.pos += keep;
                s.next = greedy(&logits, rows.start + keep - 1);
            }
            if verify {
                graphed
                    .commit_many(out.pending.as_ref().unwrap(), &keeps)
                    .unwrap();
                eager
                    .commit_many(reference.pending.as_ref().unwrap(), &keeps)
                    .unwrap();
            }
        }
        // Departures free their slots.
        live.retain(|s| {
            let stays = s.end > round;
            if !stays {
                free.push(s.slot);
            }
            stays
        });
    }
    assert!(
        filled_steps >= 6 && sizes.len() >= 4,
        "{filled_steps} filled steps, sizes {sizes:?}"
    );
    eprintln!(
        "graphed against eager: padded {:e}, filled buckets {:e}",
        worst[0], worst[1]
    );
    let (recorded, replayed) = stepper.graph_counts();
    if qwen36_testutil::test_device().is_cuda() {
        assert!(stepper.uses_graphs());
        // Every step's values are checked above; here, that graphs were both recorded and
        // replayed (a shape's first step records; verify storage growth re-records).
        assert!(
            recorded >= 4 && replayed >= 4,
            "{recorded} graphs, {replayed} replays"
        );
    } else {
        assert_eq!((recorded, replayed), (0, 0));
    }
}

/// MTP draft steps through a [`BatchStepper`] (graphs on CUDA, padded to their bucket) give each
/// chunk's last row of the head's eager forward over a second pool and its greedy token, for
/// feeds of 1 to 4 pairs per sequence and as the number of sequences changes; steps of one token
/// each take their ids from the device (`draft_from`), as a chain of draft steps does.
#[test]
fn stepper_drafts_equal_eager() {
    drafts_equal_eager(None);
}

/// With a draft vocabulary of the first third of the ids, each draft is the argmax over those
/// ids' logits (graphed and eager alike).
#[test]
fn stepper_drafts_keep_to_the_draft_vocabulary() {
    drafts_equal_eager(Some(3));
}

fn drafts_equal_eager(third: Option<usize>) {
    let (model, head) = model_helpers::load_bundled();
    let (slots, per_slot, block_size) = (5usize, 12usize, 4usize);
    let new_pool = || {
        head.new_paged_cache(&model, slots, slots * per_slot, block_size)
            .unwrap()
    };
    let (mut graphed, mut eager) = (new_pool(), new_pool());
    let mut stepper = BatchStepper::new(&model, true, 4);
    let (dev, h, vocab) = (
        model.device().clone(),
        model.config().hidden_size,
        model.config().vocab_size,
    );
    let draft_ids = third.map_or(vocab, |d| vocab / d);
    if third.is_some() {
        stepper = stepper.with_draft_vocab(qwen36_model::DraftVocab::first(&model, draft_ids, &[]).unwrap());
    }
    let mut rng = Rng::new(9);
    let mut pos = vec![0usize; slots];
    let blocks = |slot: usize| -> Vec<u32> { (0..per_slot).map(|j| (j * slots + slot) as u32).collect() };
    let filled = if qwen36_testutil::test_device().is_cuda() {
        1e-5
    } else {
        0.0
    };
    let mut chained = 0;
    for round in 0..12u64 {
        // The first round feeds every slot's first pairs; then a random subset, all with as many
        // in odd rounds (one each in every fourth), each its own count in even ones (a graph
        // pads them before their pairs).
        let n = if round == 0 { slots } else { rng.range(1, slots) };
        let lens: Vec<usize> = match round {
            0 => vec![3; n],
            r if r % 4 == 3 => vec![1; n],
            r if r % 2 == 1 => vec![rng.range(1, 4); n],
            _ => (0..n).map(|_| rng.range(1, 4)).collect(),
        };
        let uniform = lens.iter().all(|&l| l == lens[0]);
        let chunks: Vec<SeqChunk> = (0..n)
            .map(|slot| SeqChunk {
                slot: slot as u32,
                start: pos[slot],
                tokens: (0..lens[slot]).map(|_| rng.below(vocab) as u32).collect(),
                blocks: blocks(slot),
                verify: false,
            })
            .collect();
        let batch = ForwardBatch::new(chunks);
        let rows: usize = lens.iter().sum();
        let hidden = qwen36_testutil::randn(round, 1.0, (rows, h), &dev)
            .unwrap()
            .to_dtype(model.dtype())
            .unwrap();
        let step = round as usize % 3;
        // One token each: as a chain step runs, its ids on the device and the chunks' own
        // tokens placeholders (never read).
        let (last, tokens) = if lens.iter().all(|&l| l == 1) {
            chained += 1;
            let ids: Vec<u32> = batch.chunks().iter().map(|c| c.tokens[0]).collect();
            let ids = Tensor::new(ids.as_slice(), &dev).unwrap();
            let mut blank = batch.chunks().to_vec();
            blank.iter_mut().for_each(|c| c.tokens = vec![0]);
            let blank = ForwardBatch::new(blank);
            stepper
                .draft_from(&head, &model, &hidden, &ids, &blank, &mut graphed, step)
                .unwrap()
        } else {
            stepper
                .draft(&head, &model, &hidden, &batch, &mut graphed, step)
                .unwrap()
        };
        // The reference: the head's forward, each chunk's last row and its argmax.
        let out = head
            .forward_batch(&model, &hidden, &batch, &mut eager, step)
            .unwrap();
        let lasts: Vec<u32> = (0..n).map(|c| batch.rows(c).end as u32 - 1).collect();
        let last_e = out
            .index_select(&Tensor::new(lasts.as_slice(), &dev).unwrap(), 0)
            .unwrap();
        let logits = model.logits(&last_e).unwrap();
        let tokens_e = argmax_rows(&logits.narrow(1, 0, draft_ids).unwrap());
        assert_eq!(last.dims(), [n, h]);
        let diff = max_row_rel_err(&last, &last_e);
        // Padded steps (3 or 5 sequences, or feeds of several counts) take the batched bound;
        // see the test above.
        let bound = if qwen36_model::BATCH_BUCKETS.contains(&n) && uniform {
            filled
        } else {
            tol()
        };
        assert!(
            diff <= bound,
            "round {round}: {n} sequences of {lens:?}, {diff:e}"
        );
        assert_eq!(tokens.to_vec1::<u32>().unwrap(), tokens_e, "round {round}");
        for (p, len) in pos.iter_mut().zip(&lens) {
            *p += len;
        }
    }
    assert!(chained >= 2, "{chained} steps of one token each");
    let (recorded, replayed) = stepper.graph_counts();
    if qwen36_testutil::test_device().is_cuda() {
        assert!(
            recorded >= 3 && replayed >= 3,
            "{recorded} graphs, {replayed} replays"
        );
    }
}
