//! The engine on a thread of its own, driven through a cloneable client (what a server holds).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use crate::lockstep::Leader;
use crate::{Engine, EngineLoad, Error, Request, RequestHandle, Result, StepStats};

pub(crate) enum Command {
    Submit(Box<Request>, flume::Sender<Result<RequestHandle>>),
    Shutdown,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Command::Submit(..) => "Submit",
            Command::Shutdown => "Shutdown",
        })
    }
}

/// How the engine thread stands ([`EngineClient::status`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineStatus {
    /// Taking requests.
    Running,
    /// Shut down (or every client dropped); it takes no more requests.
    Stopped,
    /// A step panicked: every request it held was failed and the thread ended.
    Failed(String),
}

/// What the engine thread publishes between steps.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) load: EngineLoad,
    pub(crate) steps: u64,
    pub(crate) status: EngineStatus,
    /// Where each step's statistics go ([`EngineClient::step_stats`]).
    pub(crate) watchers: Vec<flume::Sender<StepStats>>,
}

impl Shared {
    pub(crate) fn new(load: EngineLoad) -> Self {
        Self {
            load,
            steps: 0,
            status: EngineStatus::Running,
            watchers: Vec::new(),
        }
    }
}

/// A handle to an engine running on its own thread ([`Engine::spawn`]): cloneable and `Send`,
/// so any thread (or async task) can submit. The engine steps while it has work and sleeps on
/// its queue otherwise.
#[derive(Debug, Clone)]
pub struct EngineClient {
    /// The engine's longest sequence ([`Engine::context`]).
    context: usize,
    /// The most requests the engine takes at once ([`Engine::capacity`]).
    capacity: usize,
    commands: Sender<Command>,
    shared: Arc<Mutex<Shared>>,
    thread: Arc<Mutex<Option<JoinHandle<()>>>>,
}

impl Engine {
    /// Moves the engine onto a thread of its own; submit through the returned client.
    pub fn spawn(self) -> EngineClient {
        let (tx, rx) = channel();
        let sizes = (self.context(), self.capacity());
        let shared = Arc::new(Mutex::new(Shared::new(self.load())));
        let published = shared.clone();
        let thread = std::thread::Builder::new()
            .name("qwen36-engine".into())
            .spawn(move || run(self, rx, &published, None))
            .expect("spawning the engine thread");
        EngineClient::new(sizes, tx, shared, Some(thread))
    }
}

impl EngineClient {
    /// A client of an engine of `(context, capacity)`.
    pub(crate) fn new(
        (context, capacity): (usize, usize),
        commands: Sender<Command>,
        shared: Arc<Mutex<Shared>>,
        thread: Option<JoinHandle<()>>,
    ) -> Self {
        Self {
            context,
            capacity,
            commands,
            shared,
            thread: Arc::new(Mutex::new(thread)),
        }
    }
}

pub(crate) fn lock(shared: &Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Makes the engine's load and step count what clients read, and hands a step's statistics
/// to the clients watching (dropping the watchers that are gone).
fn publish(engine: &Engine, steps: u64, shared: &Mutex<Shared>, step: Option<StepStats>) {
    let mut s = lock(shared);
    s.load = engine.load();
    s.steps = steps;
    if let Some(stats) = step {
        s.watchers.retain(|w| w.send(stats).is_ok());
    }
}

/// The text of a panic's payload.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// The engine thread: takes commands, steps while requests wait or run, and after a shutdown
/// (or once every client is gone) finishes what was submitted and returns. A panicking step
/// fails every request (none waits for ever on a dead engine) and ends the thread. With a
/// `leader`, the engine is the first rank of a tensor-parallel group ([`Engine::spawn_ranks`]):
/// the other ranks take its submits and step with it, and any rank's failure ends the group.
pub(crate) fn run(
    mut engine: Engine,
    commands: Receiver<Command>,
    shared: &Mutex<Shared>,
    mut leader: Option<Leader>,
) {
    engine.lockstep = leader.is_some();
    // However the thread ends, the clients watching its steps learn that no more will come.
    struct EndWatches<'a>(&'a Mutex<Shared>);
    impl Drop for EndWatches<'_> {
        fn drop(&mut self) {
            lock(self.0).watchers.clear();
        }
    }
    let _end = EndWatches(shared);
    let mut open = true;
    let mut steps = 0;
    loop {
        // Every queued command first; with nothing to do, wait for one.
        loop {
            let command = if open && engine.pending() == 0 {
                commands.recv().ok()
            } else {
                commands.try_recv().ok()
            };
            match command {
                Some(Command::Submit(req, reply)) => {
                    let answer = catch_unwind(AssertUnwindSafe(|| match (open, leader.as_mut()) {
                        (true, Some(l)) => l.submit(&mut engine, *req),
                        (true, None) => engine.submit(*req),
                        (false, _) => Err(Error::Stopped),
                    }));
                    match answer {
                        Ok(answer) => {
                            let _ = reply.send(answer);
                        }
                        // A panic in submit (a bug) ends the engine as one in a step does,
                        // this request's caller told why.
                        Err(payload) => {
                            let message = panic_message(payload.as_ref());
                            if let Some(l) = leader.as_ref() {
                                l.abort();
                            }
                            fail_after_panic(&mut engine, shared, message.clone());
                            let _ = reply.send(Err(Error::Panicked(message)));
                            return;
                        }
                    }
                }
                Some(Command::Shutdown) => open = false,
                None if open && engine.pending() == 0 => open = false, // every client is gone
                None => break,
            }
        }
        publish(&engine, steps, shared, None);
        if engine.pending() == 0 {
            lock(shared).status = EngineStatus::Stopped;
            return;
        }
        let stepped = catch_unwind(AssertUnwindSafe(|| match leader.as_mut() {
            Some(l) => {
                l.before_step(&mut engine)?;
                let stepped = engine.step();
                if stepped.is_err() {
                    l.abort();
                }
                // (Every other rank reports, failed or not, before this one goes on.)
                let others = l.after_step();
                // (This rank's error first, as the one it saw.)
                stepped.and_then(|stats| others.map(|()| stats))
            }
            None => engine.step(),
        }));
        if let (Some(l), Err(_) | Ok(Err(_))) = (leader.as_ref(), &stepped) {
            l.abort();
        }
        match stepped {
            Ok(Ok(stats)) => {
                steps += 1;
                publish(&engine, steps, shared, Some(stats));
            }
            // A failing rank of a group ends it: its reductions cannot be trusted any more.
            Ok(Err(e)) if leader.is_some() => {
                engine.fail_all(&e);
                let mut s = lock(shared);
                s.status = EngineStatus::Failed(e.to_string());
                s.load = EngineLoad::default();
                return;
            }
            // A failing step (a device error, or a bookkeeping bug) fails every request with
            // its message.
            Ok(Err(e)) => engine.fail_all(&e),
            Err(payload) => {
                fail_after_panic(&mut engine, shared, panic_message(payload.as_ref()));
                return;
            }
        }
    }
}

/// Fails every request after a panic with `message` and marks the engine failed.
fn fail_after_panic(engine: &mut Engine, shared: &Mutex<Shared>, message: String) {
    let e = Error::Panicked(message.clone());
    // The engine may be inconsistent after a panic: if failing the requests panics too,
    // dropping the engine closes their channels, which clients read as an end without a last
    // event.
    let _ = catch_unwind(AssertUnwindSafe(|| engine.fail_all(&e)));
    let mut s = lock(shared);
    s.status = EngineStatus::Failed(message);
    s.load = EngineLoad::default();
}

impl EngineClient {
    /// The longest sequence (prompt and output) its engine takes.
    pub fn context(&self) -> usize {
        self.context
    }

    /// The most requests its engine takes at once ([`Engine::capacity`]).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn send_submit(&self, req: Request) -> Result<flume::Receiver<Result<RequestHandle>>> {
        let (tx, rx) = flume::bounded(1);
        self.commands
            .send(Command::Submit(Box::new(req), tx))
            .map_err(|_| self.stopped())?;
        Ok(rx)
    }

    /// The error a submit gets from a thread that has ended.
    fn stopped(&self) -> Error {
        match self.status() {
            EngineStatus::Failed(m) => Error::Panicked(m),
            _ => Error::Stopped,
        }
    }

    /// Submits a request (see [`Engine::submit`]), waiting for the engine to take it between
    /// two steps; the error of a refused request, or [`Error::Stopped`] once the engine has shut
    /// down.
    pub fn submit(&self, req: Request) -> Result<RequestHandle> {
        let rx = self.send_submit(req)?;
        rx.recv().map_err(|_| self.stopped())?
    }

    /// [`Self::submit`] for async callers: awaits the engine's answer without blocking a thread.
    pub async fn submit_async(&self, req: Request) -> Result<RequestHandle> {
        let rx = self.send_submit(req)?;
        rx.recv_async().await.map_err(|_| self.stopped())?
    }

    /// The engine's queue, running sequences and pool use after its latest step.
    pub fn load(&self) -> EngineLoad {
        lock(&self.shared).load
    }

    /// Steps the engine has run.
    pub fn steps(&self) -> u64 {
        lock(&self.shared).steps
    }

    /// Every step's statistics from now on, each sent as the engine thread finishes the step
    /// (for benchmarks and monitoring: the receiver keeps what is not read; drop it to stop).
    /// The channel closes when the engine thread ends.
    pub fn step_stats(&self) -> flume::Receiver<StepStats> {
        let (tx, rx) = flume::unbounded();
        let mut shared = lock(&self.shared);
        // (An engine that has ended takes no watcher: the channel is closed at once.)
        if shared.status == EngineStatus::Running {
            shared.watchers.push(tx);
        }
        rx
    }

    /// Whether the engine takes requests, has stopped, or died.
    pub fn status(&self) -> EngineStatus {
        lock(&self.shared).status.clone()
    }

    /// Stops taking requests, lets every submitted one finish, and waits for the engine thread.
    pub fn shutdown(&self) {
        let _ = self.commands.send(Command::Shutdown);
        let thread = self.thread.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{EngineConfig, Event};

    /// A step that panics fails every request it held (their handles get `Failed` naming the
    /// panic), the client reports the failure, and later submits are refused with it.
    #[test]
    fn a_panicking_step_fails_every_request_and_the_client_says_so() {
        let mut engine = crate::engine::bundled_engine(EngineConfig {
            max_seqs: 1,
            ..Default::default()
        });
        let handles: Vec<RequestHandle> = (0..2)
            .map(|i| {
                engine
                    .submit(crate::Request::greedy(vec![1, 2, 3 + i], 8))
                    .unwrap()
            })
            .collect();
        engine.panic_next_step = true;
        let client = engine.spawn();
        for h in &handles {
            let last = std::iter::from_fn(|| h.recv()).last();
            assert!(
                matches!(&last, Some(Event::Failed { error }) if error.contains("injected")),
                "{last:?}"
            );
        }
        client.shutdown();
        assert!(matches!(client.status(), EngineStatus::Failed(m) if m.contains("injected")));
        assert_eq!(client.load(), EngineLoad::default());
        let refused = client.submit(crate::Request::greedy(vec![1], 1));
        assert!(
            matches!(&refused, Err(Error::Panicked(m)) if m.contains("injected")),
            "{refused:?}"
        );
    }

    /// A submit that panics ends the engine as a panicking step does: its caller gets the
    /// panic, the requests already held fail naming it, and the client reports the failure.
    #[test]
    fn a_panicking_submit_fails_every_request_and_the_client_says_so() {
        let mut engine = crate::engine::bundled_engine(EngineConfig::default());
        let held = engine.submit(crate::Request::greedy(vec![1, 2, 3], 400)).unwrap();
        engine.panic_next_submit = true;
        let client = engine.spawn();
        let refused = client.submit(crate::Request::greedy(vec![1], 1));
        assert!(
            matches!(&refused, Err(Error::Panicked(m)) if m.contains("injected")),
            "{refused:?}"
        );
        let last = std::iter::from_fn(|| held.recv()).last();
        assert!(
            matches!(&last, Some(Event::Failed { error }) if error.contains("injected")),
            "{last:?}"
        );
        assert!(matches!(client.status(), EngineStatus::Failed(m) if m.contains("injected")));
        assert_eq!(client.load(), EngineLoad::default());
    }

    /// A step that fails (a device error: here a state copy) fails the requests it held, and the
    /// engine thread goes on: a later request runs to its end and the client says it runs (only
    /// a rank of a tensor-parallel group ends the engine on an error).
    #[test]
    fn a_failing_step_fails_its_requests_and_the_engine_goes_on() {
        let mut engine = crate::engine::bundled_engine(EngineConfig {
            prefix_snapshots: 4,
            ..Default::default()
        });
        // Two whole blocks and more: the prefill keeps a snapshot of its last block boundary.
        let prompt: Vec<u32> = (1..=2 * EngineConfig::default().block_size as u32 + 3).collect();
        let failing = engine.submit(crate::Request::greedy(prompt, 4)).unwrap();
        engine.fail_next_copy = true;
        let client = engine.spawn();
        let last = std::iter::from_fn(|| failing.recv()).last();
        assert!(
            matches!(&last, Some(Event::Failed { error }) if error.contains("injected")),
            "{last:?}"
        );
        let later = client.submit(crate::Request::greedy(vec![1, 2, 3], 4)).unwrap();
        let last = std::iter::from_fn(|| later.recv()).last();
        assert!(matches!(&last, Some(Event::Finished { .. })), "{last:?}");
        assert_eq!(client.status(), EngineStatus::Running);
        client.shutdown();
        assert_eq!(client.status(), EngineStatus::Stopped);
    }

    /// A watching client gets every step's statistics from then on, one per step: their
    /// generated tokens are the requests' tokens, and each step's wall time covers its parts. A
    /// watcher that is dropped stops only its own.
    #[test]
    fn each_step_reaches_the_clients_watching() {
        let cfg = EngineConfig {
            max_seqs: 2,
            ..Default::default()
        };
        let client = crate::engine::bundled_engine(cfg).spawn();
        let (watch, gone) = (client.step_stats(), client.step_stats());
        drop(gone);
        let handles: Vec<RequestHandle> = (0..3)
            .map(|i| {
                client
                    .submit(crate::Request::greedy(vec![1, 2, 3 + i], 6))
                    .unwrap()
            })
            .collect();
        let mut tokens = 0;
        for h in &handles {
            for e in std::iter::from_fn(|| h.recv()) {
                if let Event::Token { ids, .. } = e {
                    tokens += ids.len();
                }
            }
        }
        // (The dropped watcher went at the first step.)
        assert_eq!(lock(&client.shared).watchers.len(), 1);
        client.shutdown();
        let steps: Vec<StepStats> = watch.drain().collect();
        // The engine's end closes the channel, and a later watch is closed at once.
        assert!(watch.recv().is_err());
        assert!(client.step_stats().recv().is_err());
        assert_eq!(steps.len() as u64, client.steps());
        assert_eq!(steps.iter().map(|s| s.generated).sum::<usize>(), tokens);
        assert_eq!(tokens, 18);
        for s in &steps {
            assert!(
                s.wall >= s.forward + s.sampling + s.drafting + s.committing,
                "{s:?}"
            );
        }
        assert!(steps.iter().all(|s| s.wall > std::time::Duration::ZERO));
    }

    /// An engine takes `capacity` requests before it has stepped, and refuses the next as a
    /// full queue.
    #[test]
    fn capacity_is_where_submits_are_refused() {
        let cfg = EngineConfig {
            max_seqs: 2,
            max_queue: 3,
            ..Default::default()
        };
        let mut engine = crate::engine::bundled_engine(cfg);
        let handles: Vec<_> = (0..engine.capacity())
            .map(|_| engine.submit(crate::Request::greedy(vec![1, 2], 2)).unwrap())
            .collect();
        assert_eq!(handles.len(), 5);
        let refused = engine.submit(crate::Request::greedy(vec![1, 2], 2));
        assert!(matches!(refused, Err(Error::QueueFull(3))), "{refused:?}");
    }

    /// The client's context and capacity are the engine's; its load follows the engine:
    /// requests running and waiting while they run, nothing once they end; the step count
    /// grows; a shut-down engine says so.
    #[test]
    fn the_client_reports_load_steps_and_status() {
        let cfg = EngineConfig {
            max_seqs: 1,
            max_queue: 3,
            ..Default::default()
        };
        let engine = crate::engine::bundled_engine(cfg);
        let context = engine.context();
        assert_eq!(engine.capacity(), 4);
        let client = engine.spawn();
        assert_eq!(client.status(), EngineStatus::Running);
        // The engine's context, read without a round trip to its thread.
        assert!(context > 0);
        assert_eq!(client.context(), context);
        assert_eq!(client.capacity(), 4);
        let idle = client.load();
        assert_eq!(
            (idle.waiting, idle.running, idle.slots_used, idle.slots),
            (0, 0, 0, 1 + EngineConfig::default().prefix_snapshots)
        );
        let long = client.submit(crate::Request::greedy(vec![1, 2, 3], 400)).unwrap();
        let queued = client.submit(crate::Request::greedy(vec![4, 5], 2)).unwrap();
        // While the long one runs the other waits (published after a step).
        assert!(matches!(long.recv(), Some(Event::Token { .. })));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let busy = loop {
            let l = client.load();
            if (l.running, l.waiting) == (1, 1) || std::time::Instant::now() > deadline {
                break l;
            }
            std::thread::yield_now();
        };
        // Its own slot, and the rolling snapshot of its last block boundary once it passed one.
        assert_eq!((busy.running, busy.waiting), (1, 1), "{busy:?}");
        assert!((1..=2).contains(&busy.slots_used), "{busy:?}");
        assert!(busy.blocks_used > 0);
        drop(long); // cancels
        assert!(std::iter::from_fn(|| queued.recv()).any(|e| matches!(e, Event::Finished { .. })));
        client.shutdown();
        assert_eq!(client.status(), EngineStatus::Stopped);
        assert!(client.steps() >= 2);
        let end = client.load();
        assert_eq!(
            (end.waiting, end.running, end.slots_used, end.blocks_used),
            (0, 0, 0, 0)
        );
    }
}
