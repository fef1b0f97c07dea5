//! A tensor-parallel engine: one [`Engine`] per rank, each on a thread of its own over its
//! shard of the model ([`qwen36_model::Qwen36Model::load_shard`]), stepping in lockstep. The
//! first rank takes the clients' requests; before each step it hands every rank the same
//! submits, cancels and speculation costs, so that every rank schedules, samples and speculates
//! alike (their logits are equal: the reductions give every rank the same sums) and their
//! forwards meet in the same reductions. Only the first rank's events reach the clients.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use qwen36_model::Communicator;

use crate::spec::SpecCosts;
use crate::thread::{lock, panic_message, run, Shared};
use crate::{Engine, EngineClient, EngineLoad, Error, Request, RequestHandle, Result};

/// What every rank applies before one step.
#[derive(Debug, Clone)]
struct Control {
    submits: Vec<Request>,
    cancels: Vec<u64>,
    costs: SpecCosts,
}

/// The first rank's side of the lockstep: the other ranks' queues and their step results.
#[derive(Debug)]
pub(crate) struct Leader {
    followers: Vec<flume::Sender<Control>>,
    /// The other ranks' threads, joined once the leader is done.
    threads: Vec<std::thread::JoinHandle<()>>,
    results: flume::Receiver<std::result::Result<(), String>>,
    comm: Arc<dyn Communicator>,
    /// Requests taken since the last step, in order.
    submits: Vec<Request>,
    /// The cancel flags the clients' handles set, per live request id.
    live: Vec<(u64, Arc<AtomicBool>)>,
}

impl Leader {
    /// Takes a client's request on the first rank (the others take it before the next step).
    pub(crate) fn submit(&mut self, engine: &mut Engine, req: Request) -> Result<RequestHandle> {
        let (id, events, _) = engine.submit_parts(req.clone())?;
        let cancel = Arc::new(AtomicBool::new(false));
        self.live.push((id, cancel.clone()));
        self.submits.push(req);
        Ok(RequestHandle::new(id, events, cancel))
    }

    /// Hands every other rank this step's control and applies it here.
    pub(crate) fn before_step(&mut self, engine: &mut Engine) -> Result<()> {
        self.live.retain(|(id, _)| engine.has_request(*id));
        let cancels: Vec<u64> = self
            .live
            .iter()
            .filter(|(_, c)| c.load(Ordering::Relaxed))
            .map(|(id, _)| *id)
            .collect();
        for &id in &cancels {
            engine.cancel(id);
        }
        engine.costs = engine.measured.clone();
        let control = Control {
            submits: std::mem::take(&mut self.submits),
            cancels,
            costs: engine.costs.clone(),
        };
        for f in &self.followers {
            f.send(control.clone())
                .map_err(|_| Error::Panicked("a tensor-parallel rank's thread ended".into()))?;
        }
        Ok(())
    }

    /// Every other rank's result of the step just run.
    pub(crate) fn after_step(&mut self) -> Result<()> {
        for _ in &self.followers {
            match self.results.recv() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(Error::Panicked(format!("a tensor-parallel rank failed: {e}"))),
                Err(_) => return Err(Error::Panicked("a tensor-parallel rank's thread ended".into())),
            }
        }
        Ok(())
    }

    /// Ends the group after a failure: every rank's reductions fail, so none waits for ever.
    pub(crate) fn abort(&self) {
        self.comm.abort();
    }
}

impl Drop for Leader {
    fn drop(&mut self) {
        // Closing their queues ends the other ranks' loops; then they are waited for, so that
        // their models are freed when the engine's client says it stopped.
        self.followers.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Builds a rank's engine, a panic turned into the error it names.
fn build<F>(make: &F, comm: Arc<dyn Communicator>) -> std::result::Result<Engine, String>
where
    F: Fn(Arc<dyn Communicator>) -> Result<Engine>,
{
    match catch_unwind(AssertUnwindSafe(|| make(comm))) {
        Ok(Ok(engine)) => Ok(engine),
        Ok(Err(e)) => Err(e.to_string()),
        Err(payload) => Err(format!("panicked: {}", panic_message(payload.as_ref()))),
    }
}

/// A rank other than the first: applies each step's control, steps, reports.
fn follow(
    mut engine: Engine,
    controls: flume::Receiver<Control>,
    results: flume::Sender<std::result::Result<(), String>>,
    comm: Arc<dyn Communicator>,
) {
    engine.lockstep = true;
    for c in controls.iter() {
        let stepped = catch_unwind(AssertUnwindSafe(|| -> Result<()> {
            for req in c.submits {
                // (Its events are the first rank's to send; this rank's go nowhere.)
                engine.submit_parts(req)?;
            }
            for id in c.cancels {
                engine.cancel(id);
            }
            engine.costs = c.costs;
            engine.step().map(|_| ())
        }));
        let outcome = match stepped {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(payload) => Err(panic_message(payload.as_ref())),
        };
        let failed = outcome.is_err();
        if failed {
            comm.abort();
        }
        if results.send(outcome).is_err() || failed {
            return;
        }
    }
}

impl Engine {
    /// A tensor-parallel engine: one engine per communicator (rank), each built by `make` on its
    /// rank's own thread (so each loads its shard there), stepping in lockstep (see the module
    /// documentation); submit through the returned client, as with [`Engine::spawn`]. Every
    /// rank's engine must be built alike (the same config, the same model's shards). A rank that
    /// fails to build fails the spawn; a step failing on any rank fails every request and ends
    /// the engine.
    pub fn spawn_ranks<F>(comms: Vec<Arc<dyn Communicator>>, make: F) -> Result<EngineClient>
    where
        F: Fn(Arc<dyn Communicator>) -> Result<Engine> + Send + Sync + 'static,
    {
        let whole = comms
            .iter()
            .enumerate()
            .all(|(r, c)| c.rank() == r && c.size() == comms.len());
        if comms.is_empty() || !whole {
            return Err(Error::Request(
                "spawn_ranks needs every rank of one group, in rank order".into(),
            ));
        }
        let make = Arc::new(make);
        let (built_tx, built_rx) = flume::unbounded();
        let (results_tx, results_rx) = flume::unbounded();
        let mut followers = Vec::new();
        let mut threads = Vec::new();
        let mut go = Vec::new();
        let (commands_tx, commands_rx) = std::sync::mpsc::channel();
        let shared = Arc::new(Mutex::new(Shared::new(EngineLoad::default())));
        let mut leader_thread = None;
        let mut commands_rx = Some(commands_rx);
        for (rank, comm) in comms.iter().cloned().enumerate() {
            let (go_tx, go_rx) = flume::bounded::<Option<Leader>>(1);
            go.push(go_tx);
            let (make, built) = (make.clone(), built_tx.clone());
            let name = format!("qwen36-engine-rank{rank}");
            if rank == 0 {
                let (commands, published) = (commands_rx.take().expect("one leader"), shared.clone());
                let t = std::thread::Builder::new().name(name).spawn(move || {
                    let engine = match build(make.as_ref(), comm) {
                        Ok(e) => e,
                        Err(e) => return drop(built.send((rank, Err(e)))),
                    };
                    let _ = built.send((rank, Ok((engine.context(), engine.capacity()))));
                    lock(&published).load = engine.load();
                    if let Ok(Some(leader)) = go_rx.recv() {
                        run(engine, commands, &published, Some(leader));
                    }
                });
                leader_thread = Some(t.map_err(|e| Error::Request(format!("spawning rank 0: {e}")))?);
            } else {
                let (controls_tx, controls_rx) = flume::unbounded();
                followers.push(controls_tx);
                let results = results_tx.clone();
                let t = std::thread::Builder::new()
                    .name(name)
                    .spawn(move || {
                        let engine = match build(make.as_ref(), comm.clone()) {
                            Ok(e) => e,
                            Err(e) => return drop(built.send((rank, Err(e)))),
                        };
                        let _ = built.send((rank, Ok((engine.context(), engine.capacity()))));
                        if let Ok(None) = go_rx.recv() {
                            follow(engine, controls_rx, results, comm);
                        }
                    })
                    .map_err(|e| Error::Request(format!("spawning rank {rank}: {e}")))?;
                threads.push(t);
            }
        }
        drop(built_tx);
        let (mut context, mut capacity) = (0, 0);
        let mut failure = None;
        for _ in &comms {
            match built_rx.recv() {
                Ok((0, Ok((c, cap)))) => (context, capacity) = (c, cap),
                Ok((_, Ok(_))) => {}
                Ok((rank, Err(e))) => {
                    failure.get_or_insert(Error::Request(format!("rank {rank}: {e}")));
                }
                Err(_) => {
                    failure.get_or_insert(Error::Panicked("a rank's thread ended while building".into()));
                }
            }
        }
        if let Some(e) = failure {
            // Dropping the go channels ends every rank's thread.
            return Err(e);
        }
        let leader = Leader {
            followers,
            threads,
            results: results_rx,
            comm: comms[0].clone(),
            submits: Vec::new(),
            live: Vec::new(),
        };
        let mut leader = Some(leader);
        for (rank, g) in go.iter().enumerate() {
            let _ = g.send(if rank == 0 { leader.take() } else { None });
        }
        Ok(EngineClient::new(
            (context, capacity),
            commands_tx,
            shared,
            leader_thread,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{EngineConfig, EngineStatus, Event};

    /// Rank `comm`'s engine over its shard of the bundled model; its first step panics when
    /// `panics`.
    fn rank_engine(comm: Arc<dyn Communicator>, panics: bool) -> Result<Engine> {
        let opts = qwen36_model::LoadOptions::default();
        let model = qwen36_model::Qwen36Model::load_shard(qwen36_testutil::bundled_dir(), opts, comm)?;
        let mut engine = Engine::new(
            model,
            EngineConfig {
                max_seqs: 2,
                ..Default::default()
            },
        )?;
        engine.panic_next_step = panics;
        Ok(engine)
    }

    /// A rank whose step panics, the first or another, fails every request and ends the group:
    /// the others, waiting in a reduction for it, are released (the client's shutdown joins every
    /// rank's thread, so one left waiting would hang the test), and the client says it failed.
    #[test]
    fn a_rank_panicking_in_a_step_ends_the_group_without_a_hang() {
        for bad in [0, 1] {
            let comms = qwen36_model::LocalComm::group(2).unwrap();
            let client = Engine::spawn_ranks(comms, move |comm| {
                let panics = comm.rank() == bad;
                rank_engine(comm, panics)
            })
            .unwrap();
            let h = client.submit(crate::Request::greedy(vec![1, 2, 3], 8)).unwrap();
            let last = std::iter::from_fn(|| h.recv()).last();
            assert!(
                matches!(&last, Some(Event::Failed { .. })),
                "rank {bad}: {last:?}"
            );
            client.shutdown();
            let status = client.status();
            assert!(
                matches!(&status, EngineStatus::Failed(_)),
                "rank {bad}: {status:?}"
            );
        }
    }
}
