//! The engine on a thread of its own, driven through a cloneable client (what a server holds).

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use crate::{Engine, Error, Request, RequestHandle, Result};

enum Command {
    Submit(Box<Request>, Sender<Result<RequestHandle>>),
    Shutdown,
}

/// A handle to an engine running on its own thread ([`Engine::spawn`]): cloneable and `Send`,
/// so any thread (or async task) can submit. The engine steps while it has work and sleeps on
/// its queue otherwise.
#[derive(Debug, Clone)]
pub struct EngineClient {
    commands: Sender<Command>,
    thread: Arc<Mutex<Option<JoinHandle<()>>>>,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Command::Submit(..) => "Submit",
            Command::Shutdown => "Shutdown",
        })
    }
}

impl Engine {
    /// Moves the engine onto a thread of its own; submit through the returned client.
    pub fn spawn(self) -> EngineClient {
        let (tx, rx) = channel();
        let thread = std::thread::Builder::new()
            .name("qwen36-engine".into())
            .spawn(move || run(self, rx))
            .expect("spawning the engine thread");
        EngineClient {
            commands: tx,
            thread: Arc::new(Mutex::new(Some(thread))),
        }
    }
}

/// The engine thread: takes commands, steps while requests wait or run, and after a shutdown
/// (or once every client is gone) finishes what was submitted and returns.
fn run(mut engine: Engine, commands: Receiver<Command>) {
    let mut open = true;
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
                    let answer = if open {
                        engine.submit(*req)
                    } else {
                        Err(Error::Stopped)
                    };
                    let _ = reply.send(answer);
                }
                Some(Command::Shutdown) => open = false,
                None if open && engine.pending() == 0 => open = false, // every client is gone
                None => break,
            }
        }
        if engine.pending() == 0 {
            return;
        }
        // A failing step (a device error, or a bookkeeping bug) fails every request with its
        // message: none waits for ever on a broken engine.
        if let Err(e) = engine.step() {
            engine.fail_all(&e);
        }
    }
}

impl EngineClient {
    /// Submits a request (see [`Engine::submit`]); the error of a refused request, or
    /// [`Error::Stopped`] once the engine has shut down.
    pub fn submit(&self, req: Request) -> Result<RequestHandle> {
        let (tx, rx) = channel();
        self.commands
            .send(Command::Submit(Box::new(req), tx))
            .map_err(|_| Error::Stopped)?;
        rx.recv().map_err(|_| Error::Stopped)?
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
