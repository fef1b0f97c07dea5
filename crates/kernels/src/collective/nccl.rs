//! NCCL all-reduce on candle tensors.

use std::sync::Mutex;

use candle_core::cuda::cudarc::nccl::{Comm, ReduceOp};
use candle_core::{DType, Device, Tensor};

use crate::cuda::{device, err, view, wrap};
use crate::Result;

/// A communicator handle that may move to the rank's thread.
struct SendComm(Comm);

// SAFETY: an NCCL communicator is a handle that any thread may use, one call at a time (NCCL
// forbids only concurrent calls on one communicator); `NcclRank` keeps it behind a mutex, so calls
// never overlap.
unsafe impl Send for SendComm {}

/// One rank of an NCCL group of one process: its CUDA device and its communicator, bound to the
/// device's stream.
pub struct NcclRank {
    device: Device,
    comm: Mutex<SendComm>,
    rank: usize,
    size: usize,
}

impl std::fmt::Debug for NcclRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NcclRank({}/{} on {:?})",
            self.rank,
            self.size,
            self.device.location()
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
        let size = devices.len();
        Ok(devices
            .into_iter()
            .zip(comms)
            .enumerate()
            .map(|(rank, (device, comm))| NcclRank {
                device,
                comm: Mutex::new(SendComm(comm)),
                rank,
                size,
            })
            .collect())
    }

    /// This rank's device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// This rank, `0..size()`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The sum over the ranks of each rank's `x` (same shape and dtype on every rank, on the
    /// rank's device), as a new tensor on the rank's stream. No host wait: it can be recorded in
    /// a CUDA graph.
    pub fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor> {
        let op = "nccl_all_reduce";
        let dev = device(op, x)?;
        if !x.device().same_device(&self.device) {
            return Err(err(
                op,
                format!("rank {} got a tensor of another device", self.rank),
            ));
        }
        let x = x.contiguous()?;
        let n = x.elem_count();
        let comm = self.comm.lock().map_err(|_| err(op, "a reduction panicked"))?;
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
