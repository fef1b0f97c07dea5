//! The engine sharded over ranks (threads over `LocalComm`, each rank's engine over its shard of
//! the bundled model, stepping in lockstep): a set of requests (greedy, seeded sampling, MTP
//! and n-gram speculation with the costs measured on the first rank, the prefix cache on,
//! some cancelled) gives every request what it gets on one device.

mod common;

use std::sync::Arc;

use candle_core::DType;
use common::{collect, model_helpers, solo};
use qwen36_engine::{
    Engine, EngineConfig, EngineStatus, Event, Request, RequestHandle, Speculation, StopReason,
};
use qwen36_model::{Communicator, LocalComm, MtpHead, Qwen36Model};
use qwen36_sampling::SamplingParams;
use qwen36_testutil::{bundled_dir, Rng};

fn config() -> EngineConfig {
    EngineConfig {
        max_seqs: 3,
        block_size: 8,
        step_tokens: 40,
        prefix_snapshots: 4,
        ..Default::default()
    }
}

fn rank_engine(comm: Arc<dyn Communicator>) -> qwen36_engine::Result<Engine> {
    let opts = model_helpers::load_options(DType::F32);
    let model = Qwen36Model::load_shard(bundled_dir(), opts.clone(), comm.clone())?;
    let head = MtpHead::load_dir_shard(bundled_dir(), opts, comm)?;
    Engine::with_mtp_head(model, head, config())
}

/// The requests: random prompts sharing beginnings, mixed sampling and speculation.
fn requests(vocab: usize) -> Vec<Request> {
    let mut rng = Rng::new(31);
    let base: Vec<u32> = (0..30).map(|_| rng.below(vocab) as u32).collect();
    (0..10)
        .map(|i| {
            let keep = rng.range(0, 30);
            let len = rng.range(1, 20);
            let prompt: Vec<u32> = base[..keep]
                .iter()
                .copied()
                .chain((0..len).map(|_| rng.below(vocab) as u32))
                .collect();
            let mut req = Request::greedy(prompt, rng.range(3, 40));
            req.speculation = match i % 4 {
                1 => Some(Speculation::Mtp { k: 3 }),
                2 => Some(Speculation::ngram(2)),
                _ => None,
            };
            if i % 5 == 3 {
                req.sampling = SamplingParams {
                    temperature: 0.8,
                    top_k: 20,
                    seed: 100 + i as u64,
                    ..SamplingParams::greedy()
                };
            }
            req
        })
        .collect()
}

/// A request's tokens and how it ended, waiting for its end.
fn wait_for(h: &RequestHandle) -> (Vec<u32>, StopReason) {
    let mut out = Vec::new();
    loop {
        match h.recv() {
            Some(Event::Token { ids, .. }) => out.extend(ids),
            Some(Event::Finished { reason, .. }) => return (out, reason),
            Some(Event::Failed { error }) => panic!("request failed: {error}"),
            None => panic!("the request's events ended without a last one"),
        }
    }
}

#[test]
fn sharded_engines_give_every_request_its_one_device_tokens() {
    let (model, head) = model_helpers::load_bundled();
    let reqs = requests(model.config().vocab_size);
    // One device, one request at a time: what each request gives.
    let mut one = Engine::with_mtp_head(model.clone(), head, config()).unwrap();
    let want: Vec<Vec<u32>> = reqs
        .iter()
        .map(|r| {
            let h = one.submit(r.clone()).unwrap();
            one.run_to_completion().unwrap();
            collect(&h).ids
        })
        .collect();
    for (r, w) in reqs.iter().zip(&want) {
        if r.sampling.temperature == 0.0 {
            assert_eq!(w, &solo(&model, &r.prompt, r.max_tokens.unwrap()).0);
        }
    }
    for tp in [2, 4] {
        let client = Engine::spawn_ranks(LocalComm::group(tp).unwrap(), rank_engine).unwrap();
        let handles: Vec<_> = reqs.iter().map(|r| client.submit(r.clone()).unwrap()).collect();
        // Two requests cancelled once they have sent something.
        for h in [&handles[0], &handles[5]] {
            h.cancel();
        }
        for (i, h) in handles.iter().enumerate() {
            let (ids, reason) = wait_for(h);
            match reason {
                StopReason::Cancelled => assert_eq!(ids[..], want[i][..ids.len()], "tp {tp} request {i}"),
                _ => assert_eq!(ids, want[i], "tp {tp} request {i} ({reason:?})"),
            }
        }
        client.shutdown();
        assert_eq!(client.status(), EngineStatus::Stopped);
        let load = client.load();
        assert_eq!((load.running, load.waiting), (0, 0));
    }
}

/// A rank that cannot be built (the heads do not split over 3 ranks, or its build panics) fails
/// the spawn with the reason; so does a group given in part.
#[test]
fn a_rank_that_cannot_load_fails_the_spawn() {
    let e = Engine::spawn_ranks(LocalComm::group(3).unwrap(), rank_engine)
        .unwrap_err()
        .to_string();
    assert!(e.contains("num_attention_heads"), "{e}");
    // A rank whose build panics fails the spawn too (the others do not wait for it).
    let group = || LocalComm::group(2).unwrap();
    let e = Engine::spawn_ranks(group(), |comm| {
        assert_ne!(comm.rank(), 1, "rank 1 cannot build");
        rank_engine(comm)
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("rank 1") && e.contains("cannot build"), "{e}");
    // Part of a group is refused.
    let mut part = group();
    part.truncate(1);
    assert!(Engine::spawn_ranks(part, rank_engine).is_err());
}
