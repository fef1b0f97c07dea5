//! NCCL all-reduce on candle tensors.

use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::cuda::cudarc::nccl::{Comm, ReduceOp};
use candle_core::{DType, Device, Tensor};

use crate::cuda::{device, err, view, wrap};
use crate::Result;

/// A communicator handle that may move between threads.
struct SendComm(Comm);

// SAFETY: an NCCL communicator is a handle that any thread may use, one call at a time (NCCL
// forbids only concurrent calls on one communicator, and allows `ncclCommAbort` from another
// thread); `Group` keeps each behind a mutex, so calls never overlap.
unsafe impl Send for SendComm {}

/// Every rank's communicator and device; `None` once the group is aborted.
struct Group {
    comms: Vec<Mutex<Option<SendComm>>>,
    devices: Vec<Device>,
}

impl Group {
    fn slot(&self, rank: usize) -> MutexGuard<'_, Option<SendComm>> {
        // (A panic while holding the lock leaves the slot whole: take it anyway.)
        self.comms[rank]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        // The last rank is gone: let every rank's queued collectives finish before the
        // communicators are torn down (cudarc aborts them on drop).
        for d in &self.devices {
            let _ = d.synchronize();
        }
    }
}

/// One rank of an NCCL group of one process: its CUDA device and its communicator, bound to the
/// device's stream.
pub struct NcclRank {
    group: Arc<Group>,
    rank: usize,
}

impl std::fmt::Debug for NcclRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NcclRank({}/{} on {:?})",
            self.rank,
            self.size(),
            self.device().location()
        )
    }
}

impl NcclRank {
    /// A group over `devices` (`ncclCommInitAll`), rank `r` on `devices[r]`: CUDA devices of
    /// distinct GPUs (NCCL refuses two ranks on one GPU), each with a stream of its own.
    pub fn group(devices: Vec<Device>) -> Result<Vec<NcclRank>> {
        let op = "nccl_group";
        let streams = devices
            .iter()
            .map(|d| {
                Ok(d.as_cuda_device()
                    .map_err(|_| err(op, "expected CUDA devices"))?
                    .cuda_stream())
            })
            .collect::<Result<Vec<_>>>()?;
        let comms = Comm::from_devices(streams).map_err(|e| err(op, format!("NCCL init: {e:?}")))?;
        let group = Arc::new(Group {
            comms: comms.into_iter().map(|c| Mutex::new(Some(SendComm(c)))).collect(),
            devices,
        });
        Ok((0..group.devices.len())
            .map(|rank| NcclRank {
                group: group.clone(),
                rank,
            })
            .collect())
    }

    /// This rank's device.
    pub fn device(&self) -> &Device {
        &self.group.devices[self.rank]
    }

    /// This rank, `0..size()`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.group.devices.len()
    }

    /// Aborts every rank's communicator (`ncclCommAbort`): collectives queued or running on any
    /// rank end without their result, and every later call fails. For a rank that cannot go on,
    /// so that the others do not wait on the GPU for it.
    pub fn abort_group(&self) {
        for rank in 0..self.size() {
            drop(self.group.slot(rank).take());
        }
    }

    /// The sum over the ranks of each rank's `x` (same shape and dtype on every rank, on the
    /// rank's device), as a new tensor on the rank's stream. No host wait: it can be recorded in
    /// a CUDA graph.
    pub fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor> {
        let op = "nccl_all_reduce";
        let dev = device(op, x)?;
        if !x.device().same_device(self.device()) {
            return Err(err(
                op,
                format!("rank {} got a tensor of another device", self.rank),
            ));
        }
        let x = x.contiguous()?;
        let n = x.elem_count();
        let slot = self.group.slot(self.rank);
        let Some(comm) = slot.as_ref() else {
            return Err(err(op, format!("rank {}: the group was aborted", self.rank)));
        };
        macro_rules! go {
            ($t:ty) => {{
                let (xs, xl) = x.storage_and_layout();
                let xv = view::<$t>(op, &xs, xl)?;
                // SAFETY: uninitialised; the all-reduce writes every element.
                let mut y = unsafe { dev.alloc::<$t>(n)? };
                if n > 0 {
                    comm.0
                        .all_reduce(&xv, &mut y, &ReduceOp::Sum)
                        .map_err(|e| err(op, format!("{e:?}")))?;
                }
                Ok(wrap(y, &dev, x.shape().clone()))
            }};
        }
        match x.dtype() {
            DType::F32 => go!(f32),
            DType::BF16 => go!(half::bf16),
            DType::F16 => go!(half::f16),
            other => Err(err(op, format!("unsupported dtype {other:?}"))),
        }
    }
}
