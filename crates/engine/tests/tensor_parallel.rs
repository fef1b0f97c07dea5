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
    let mut opts = model_helpers::load_options(DType::F32);
    // (An NCCL rank computes on its own GPU.)
    opts.device = comm.device().unwrap_or(opts.device);
    let model = Qwen36Model::load_shard(bundled_dir(), opts.clone(), comm.clone())?;
    let graphs = comm.graph_safe() && opts.device.is_cuda();
    let head = MtpHead::load_dir_shard(bundled_dir(), opts, comm)?;
    let engine = Engine::with_mtp_head(model, head, config())?;
    // (NCCL ranks record their batch steps in CUDA graphs.)
    assert_eq!(engine.uses_graphs(), graphs, "graphs on a rank");
    Ok(engine)
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
            Some(Event::Prompt { .. }) => panic!("prompt log-probabilities not asked for"),
            None => panic!("the request's events ended without a last one"),
        }
    }
}

/// Each request's tokens on one device, one request at a time (greedy ones checked against a
/// solo run of the model).
fn one_device_tokens(reqs: &[Request]) -> Vec<Vec<u32>> {
    let (model, head) = model_helpers::load_bundled();
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
    want
}

/// The requests through engines over `comms` (two cancelled once they have sent something):
/// every one gets `want`'s tokens (a cancelled one a prefix of them), and the engines end empty.
fn check_ranks(comms: Vec<Arc<dyn Communicator>>, reqs: &[Request], want: &[Vec<u32>]) {
    let tp = comms.len();
    let client = Engine::spawn_ranks(comms, rank_engine).unwrap();
    // The leader's sizes: its slots and queue.
    assert_eq!(client.capacity(), config().max_seqs + config().max_queue);
    let watch = client.step_stats();
    let handles: Vec<_> = reqs.iter().map(|r| client.submit(r.clone()).unwrap()).collect();
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
    // The first rank's statistics, one per step of the group.
    assert_eq!(watch.drain().count() as u64, client.steps(), "tp {tp}");
    let load = client.load();
    assert_eq!((load.running, load.waiting), (0, 0));
}

#[test]
fn sharded_engines_give_every_request_its_one_device_tokens() {
    let reqs = requests(model_helpers::load_bundled().0.config().vocab_size);
    let want = one_device_tokens(&reqs);
    for tp in [2, 4] {
        check_ranks(LocalComm::group(tp).unwrap(), &reqs, &want);
    }
}

/// Over NCCL (built with `--features nccl`, run with `QWEN36_TEST_DEVICE=cuda`): one rank per
/// GPU (two where there are two or more; one GPU makes a group of one), the engines' batch steps
/// recorded in CUDA graphs around the NCCL reductions, give the same tokens.
#[cfg(feature = "nccl")]
#[test]
fn nccl_engines_give_every_request_its_one_device_tokens() {
    use candle_core::cuda::cudarc::driver::CudaContext;
    if std::env::var("QWEN36_TEST_DEVICE").as_deref() != Ok("cuda") {
        eprintln!("NCCL runs on CUDA devices: set QWEN36_TEST_DEVICE=cuda");
        return;
    }
    let tp = if CudaContext::device_count().unwrap() >= 2 {
        2
    } else {
        1
    };
    let reqs = requests(model_helpers::load_bundled().0.config().vocab_size);
    let want = one_device_tokens(&reqs);
    let comms = qwen36_model::NcclComm::group(&(0..tp).collect::<Vec<_>>()).unwrap();
    check_ranks(comms, &reqs, &want);
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
