//! Collectives of tensor parallelism across GPUs: the sum of every rank's tensor, through NCCL
//! (behind the `nccl` feature). The CPU twin, ranks as threads summing in rank order, is
//! `qwen36_model::LocalComm`.

#[cfg(feature = "nccl")]
mod nccl;
#[cfg(feature = "nccl")]
pub use nccl::NcclRank;
