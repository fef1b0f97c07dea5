//! Typed errors of the engine.

/// What went wrong, naming the pool or the limit.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A pool has fewer free entries than asked for; nothing was allocated.
    #[error("the {pool} pool has {free} free of {capacity}, {wanted} wanted")]
    Exhausted {
        pool: &'static str,
        wanted: usize,
        free: usize,
        capacity: usize,
    },
    /// An index that is not allocated was retained or released (a bookkeeping bug upstream).
    #[error("{pool} {index} is not allocated")]
    NotAllocated { pool: &'static str, index: u32 },
    /// A pool cannot be made with these sizes.
    #[error("a {pool} pool {msg}")]
    Size { pool: &'static str, msg: String },
    /// The memory budget cannot hold what was asked for.
    #[error("a budget of {budget} bytes cannot hold {what}")]
    Budget { budget: u64, what: String },
    /// A request is malformed (empty prompt, ids outside the vocabulary, bad sampling).
    #[error("request: {0}")]
    Request(String),
    /// A request can never fit: it needs more positions than the context or the whole pool.
    #[error("the request needs {needed} positions (prompt + max_tokens); the model's context is {context} and the KV pool holds {pool}")]
    TooLong {
        needed: usize,
        context: usize,
        pool: usize,
    },
    /// The waiting queue is full.
    #[error("the queue is full ({0} requests may wait beyond the free slots); retry later")]
    QueueFull(usize),
    /// The engine has shut down and takes no more requests.
    #[error("the engine has shut down")]
    Stopped,
    /// The engine thread panicked (a bug): it failed every request it held and takes no more.
    #[error("the engine thread panicked: {0}")]
    Panicked(String),
    /// The ranks of a tensor-parallel engine went different ways (a bug): the engine stops
    /// rather than mix their partial sums.
    #[error("tensor-parallel ranks diverged: {0}")]
    Ranks(String),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] qwen36_model::Error),
    /// candle failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, Error>;
