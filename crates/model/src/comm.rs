//! Tensor parallelism's communication: every rank's partial sums added up on every rank.
//!
//! [`Communicator`] is what a sharded model calls after each row-parallel projection (the
//! attention, GDN and MLP output projections). [`LocalComm::group`] makes ranks as threads of one
//! process on any device and sums in rank order, so every rank gets the same bits; CI runs
//! tensor parallelism through it. `NcclComm::group` (feature `nccl`) puts each rank on a GPU of
//! its own and sums through NCCL.

use std::sync::{Arc, Condvar, Mutex};

use candle_core::{Device, Tensor};

use crate::{Error, Result};

/// One rank's view of a tensor-parallel group.
pub trait Communicator: Send + Sync + std::fmt::Debug {
    /// This rank, `0..size()`.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// The sum of every rank's `x` (one shape on all ranks), returned on every rank. Every rank
    /// calls it the same number of times in the same order.
    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor>;
    /// Ends the group: every rank's pending and later reductions fail (a rank that cannot go
    /// on, so that the others do not wait for it).
    fn abort(&self);
    /// The device this rank must compute on, where the communicator is bound to one (NCCL).
    fn device(&self) -> Option<Device> {
        None
    }
    /// True when a reduction is device work alone (no host wait), so a CUDA graph can record it.
    fn graph_safe(&self) -> bool {
        false
    }
    /// Every rank says whether it can go on (a rank whose load failed joins with `ok` false):
    /// an error on every rank when any one cannot, so that none is left waiting for it.
    fn barrier(&self, ok: bool) -> Result<()> {
        let device = self.device().unwrap_or(Device::Cpu);
        let flag = Tensor::new(&[if ok { 0f32 } else { 1f32 }], &device)?;
        let failed = self.all_reduce_sum(&flag)?.to_vec1::<f32>()?[0];
        if failed > 0.0 {
            return Err(Error::Comm(format!(
                "{failed} of {} ranks could not go on",
                self.size()
            )));
        }
        Ok(())
    }
}

#[derive(Debug, Default)]
struct Round {
    /// Each rank's tensor of the current round.
    parts: Vec<Option<Tensor>>,
    /// Ranks that have read the current round's parts.
    read: usize,
    /// A rank left (its handle dropped): every wait fails from then on.
    gone: Option<usize>,
}

#[derive(Debug)]
struct Shared {
    size: usize,
    state: Mutex<Round>,
    changed: Condvar,
}

/// One rank of a group of threads of one process ([`LocalComm::group`]). Dropping it (a rank's thread ending, or failing) makes every
/// other rank's pending and later reductions fail instead of waiting forever.
#[derive(Debug)]
pub struct LocalComm {
    rank: usize,
    shared: Arc<Shared>,
}

impl LocalComm {
    /// A group of `size` ranks, one handle each (`[rank 0, rank 1, …]`), to be moved to one thread
    /// each.
    pub fn group(size: usize) -> Result<Vec<Arc<dyn Communicator>>> {
        if size == 0 {
            return Err(Error::Config {
                field: "tensor_parallel_size".into(),
                msg: "must be at least 1".into(),
            });
        }
        let shared = Arc::new(Shared {
            size,
            state: Mutex::new(Round {
                parts: vec![None; size],
                ..Default::default()
            }),
            changed: Condvar::new(),
        });
        Ok((0..size)
            .map(|rank| {
                Arc::new(LocalComm {
                    rank,
                    shared: shared.clone(),
                }) as Arc<dyn Communicator>
            })
            .collect())
    }

    /// [`run_ranks`] over a new group of `size` ranks.
    pub fn run_ranks<T: Send>(size: usize, f: impl Fn(Arc<dyn Communicator>) -> T + Sync) -> Result<Vec<T>> {
        run_ranks(Self::group(size)?, f)
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Round>> {
        self.shared
            .state
            .lock()
            .map_err(|_| Error::Comm("a rank panicked during a reduction".into()))
    }

    fn wait<'a>(&self, guard: std::sync::MutexGuard<'a, Round>) -> Result<std::sync::MutexGuard<'a, Round>> {
        self.shared
            .changed
            .wait(guard)
            .map_err(|_| Error::Comm("a rank panicked during a reduction".into()))
    }

    /// Puts this rank's part in the current round and returns every rank's, in rank order, once
    /// all are in.
    fn publish(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        let mut s = self.lock()?;
        // A rank still reading the last round's parts: wait until all have read them.
        while s.parts[self.rank].is_some() {
            if let Some(r) = s.gone {
                return Err(gone(r));
            }
            s = self.wait(s)?;
        }
        s.parts[self.rank] = Some(x.clone());
        self.shared.changed.notify_all();
        // (The round cannot end before this rank has read it.)
        while s.parts.iter().any(Option::is_none) {
            if let Some(r) = s.gone {
                return Err(gone(r));
            }
            s = self.wait(s)?;
        }
        Ok(s.parts.iter().flatten().cloned().collect())
    }

    /// The parts' sum on `device`, added in rank order (the same bits on every rank), finished
    /// before it returns: the other ranks' parts are copied before they may be freed.
    fn sum_parts(parts: &[Tensor], device: &Device) -> Result<Tensor> {
        let mut sum = parts[0].to_device(device)?;
        for p in &parts[1..] {
            sum = (sum + p.to_device(device)?)?;
        }
        device.synchronize()?;
        Ok(sum)
    }
}

/// Runs `f` on every rank of a group, one scoped thread each with its rank's handle, and
/// returns their results in rank order once all have ended. A rank that panics is an error, and
/// aborts the group (the others' reductions fail rather than wait for it).
pub fn run_ranks<T: Send>(
    comms: Vec<Arc<dyn Communicator>>,
    f: impl Fn(Arc<dyn Communicator>) -> T + Sync,
) -> Result<Vec<T>> {
    let f = &f;
    std::thread::scope(|scope| {
        let threads: Vec<_> = comms
            .into_iter()
            .map(|c| {
                scope.spawn(move || {
                    let mine = c.clone();
                    // (`f` holds no state across the unwind: a panicking rank only ends.)
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(c)))
                        .inspect_err(|_| mine.abort())
                })
            })
            .collect();
        threads
            .into_iter()
            .enumerate()
            .map(|(rank, t)| match t.join() {
                Ok(Ok(v)) => Ok(v),
                _ => Err(Error::Comm(format!("rank {rank} panicked"))),
            })
            .collect()
    })
}

fn gone(rank: usize) -> Error {
    Error::Comm(format!("rank {rank} left the group"))
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor> {
        let size = self.shared.size;
        if size == 1 {
            return Ok(x.clone());
        }
        // Ranks on one GPU each run on a stream of their own, and no stream waits for another's
        // work: a part is published once its kernels have finished.
        if let Err(e) = x.device().synchronize() {
            self.abort();
            return Err(e.into());
        }
        let parts = self.publish(x)?;
        let sum = Self::sum_parts(&parts, x.device());
        drop(parts);
        // The round ends only once every rank has read it (a part is not freed or replaced while
        // another rank's stream copies it); a rank that failed to read ends the group.
        let mut s = match self.lock() {
            Ok(s) => s,
            Err(e) => {
                self.abort();
                return Err(e);
            }
        };
        s.read += 1;
        if s.read == size {
            s.parts.iter_mut().for_each(|p| *p = None);
            s.read = 0;
            self.shared.changed.notify_all();
        }
        drop(s);
        if sum.is_err() {
            self.abort();
        }
        sum
    }

    fn abort(&self) {
        // (A lock poisoned by a rank's panic: the state is still whole, set it anyway.)
        let mut s = self
            .shared
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        s.gone.get_or_insert(self.rank);
        self.shared.changed.notify_all();
    }
}

impl Drop for LocalComm {
    fn drop(&mut self) {
        self.abort();
    }
}

/// One rank of a group over several GPUs of one process, through NCCL ([`NcclComm::group`]):
/// each rank runs on its own GPU (one thread each), and its reductions are device work on its
/// stream, which CUDA graphs record.
#[cfg(feature = "nccl")]
#[derive(Debug)]
pub struct NcclComm {
    rank: qwen36_kernels::collective::NcclRank,
}

#[cfg(feature = "nccl")]
impl NcclComm {
    /// A group of one rank per CUDA device `ordinals[r]`, each on a device made by
    /// [`crate::graph_device`] (a stream of its own, graphs allowed): `[rank 0, rank 1, …]`, each
    /// to be moved to a thread of its own.
    pub fn group(ordinals: &[usize]) -> Result<Vec<Arc<dyn Communicator>>> {
        if ordinals.is_empty() {
            return Err(Error::Config {
                field: "tensor_parallel_size".into(),
                msg: "must be at least 1".into(),
            });
        }
        let devices = ordinals
            .iter()
            .map(|&o| crate::graph_device(o))
            .collect::<Result<Vec<_>>>()?;
        let ranks = qwen36_kernels::collective::NcclRank::group(devices)?;
        Ok(ranks
            .into_iter()
            .map(|rank| Arc::new(NcclComm { rank }) as Arc<dyn Communicator>)
            .collect())
    }
}

#[cfg(feature = "nccl")]
impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank.rank()
    }

    fn size(&self) -> usize {
        self.rank.size()
    }

    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.rank.all_reduce_sum(x)?)
    }

    /// Aborts every rank's communicator: collectives queued or running anywhere end without
    /// their result (a rank waiting on the GPU is released) and later reductions fail. (Dropping
    /// a rank's handle does not: its peers may still be finishing their last collectives.)
    fn abort(&self) {
        self.rank.abort_group();
    }

    fn device(&self) -> Option<Device> {
        Some(self.rank.device().clone())
    }

    fn graph_safe(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    /// Every rank gets the rank-ordered sum of all ranks' tensors, round after round, whatever
    /// order the threads arrive in.
    #[test]
    fn ranks_get_the_sum_every_round() {
        for size in [1, 2, 3, 4] {
            let comms = LocalComm::group(size).unwrap();
            let handles: Vec<_> = comms
                .into_iter()
                .map(|c| {
                    std::thread::spawn(move || {
                        (0..20)
                            .map(|round| {
                                if (round + c.rank()) % 3 == 0 {
                                    std::thread::sleep(std::time::Duration::from_millis(1));
                                }
                                let x = Tensor::new(&[c.rank() as f32 + 1.0, round as f32], &Device::Cpu)?;
                                c.all_reduce_sum(&x)?.to_vec1::<f32>().map_err(Error::from)
                            })
                            .collect::<Result<Vec<_>>>()
                    })
                })
                .collect();
            let want: Vec<Vec<f32>> = (0..20)
                .map(|round| {
                    let ranks: f32 = (1..=size).map(|r| r as f32).sum();
                    vec![ranks, (round * size) as f32]
                })
                .collect();
            for h in handles {
                assert_eq!(h.join().unwrap().unwrap(), want, "size {size}");
            }
        }
    }

    /// A rank that panics while the others wait in a reduction ends the group: the others'
    /// reductions fail instead of waiting, and the run is an error naming the rank.
    #[test]
    fn a_rank_that_panics_ends_the_run() {
        let waits = std::sync::Mutex::new(Vec::new());
        let e = LocalComm::run_ranks(3, |c| {
            if c.rank() == 1 {
                std::thread::sleep(std::time::Duration::from_millis(20));
                panic!("rank 1 fails");
            }
            let x = Tensor::new(&[1f32], &Device::Cpu).unwrap();
            waits.lock().unwrap().push(c.all_reduce_sum(&x).is_err());
        })
        .unwrap_err();
        assert!(e.to_string().contains("rank 1 panicked"), "{e}");
        assert_eq!(*waits.lock().unwrap(), [true, true]);
    }

    /// The barrier passes when every rank can go on, and fails on every rank when one cannot.
    #[test]
    fn a_barrier_fails_on_every_rank_when_one_cannot_go_on() {
        for (size, failing) in [
            (1, None),
            (2, None),
            (3, None),
            (1, Some(0)),
            (2, Some(1)),
            (3, Some(0)),
        ] {
            let done = LocalComm::run_ranks(size, |c| c.barrier(Some(c.rank()) != failing)).unwrap();
            for (rank, d) in done.iter().enumerate() {
                match failing {
                    None => assert!(d.is_ok(), "size {size} rank {rank}: {d:?}"),
                    Some(_) => {
                        let e = d.as_ref().unwrap_err().to_string();
                        assert!(
                            e.contains(&format!("1 of {size} ranks")),
                            "size {size} rank {rank}: {e}"
                        );
                    }
                }
            }
        }
    }

    /// A rank that leaves (its handle dropped) fails the others' reductions instead of leaving
    /// them waiting.
    #[test]
    fn a_rank_that_leaves_fails_the_others() {
        let mut comms = LocalComm::group(3).unwrap();
        let last = comms.pop().unwrap();
        let waiting: Vec<_> = comms
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let x = Tensor::new(&[1f32], &Device::Cpu).unwrap();
                    c.all_reduce_sum(&x)
                })
            })
            .collect();
        std::thread::sleep(std::time::Duration::from_millis(20));
        drop(last);
        for h in waiting {
            let e = h.join().unwrap().unwrap_err();
            assert!(e.to_string().contains("rank 2 left"), "{e}");
        }
        assert!(LocalComm::group(0).is_err());
    }
}
