//! What the examples share: the `--dtype`, `--cuda`, `--model` and `--tp` flags turned into load
//! options, a model directory (the bundled model by default, or a Hugging Face model id from the
//! local cache) and tensor-parallel ranks, and a progress bar while a checkpoint loads.

use candle_core::{DType, Device};

/// The activation dtype named by `--dtype`.
pub fn dtype(name: &str) -> Result<DType, String> {
    match name {
        "f32" => Ok(DType::F32),
        "bf16" => Ok(DType::BF16),
        "f16" => Ok(DType::F16),
        other => Err(format!("--dtype {other:?}: expected f32, bf16 or f16")),
    }
}

/// The first CUDA GPU (made so that graphs can record on it) with `cuda`, else the CPU.
pub fn device(cuda: bool) -> qwen36::model::Result<Device> {
    if cuda {
        qwen36::model::cuda_device(0)
    } else {
        Ok(Device::Cpu)
    }
}

/// `--model` (a directory, or a Hugging Face model id already in the local cache, e.g.
/// `Qwen/Qwen3.6-27B`), or the bundled model.
pub fn model_dir(model: Option<&str>) -> qwen36::Result<std::path::PathBuf> {
    match model {
        Some(m) => qwen36::resolve_model(m),
        None => Ok(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/qwen36-tiny")),
    }
}

/// A progress bar of the bytes a checkpoint load has read, when stderr is a terminal (`None`
/// otherwise: a log line says when loading starts and ends).
pub fn progress() -> Option<qwen36::model::LoadProgress> {
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        return None;
    }
    let bar = indicatif::ProgressBar::new(0).with_style(
        indicatif::ProgressStyle::with_template(
            "loading {bar:40} {binary_bytes}/{binary_total_bytes} {elapsed}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    Some(qwen36::model::LoadProgress(std::sync::Arc::new(
        move |done, total| {
            if bar.length() != Some(total) {
                bar.set_length(total);
            }
            bar.set_position(done);
            if done >= total {
                bar.finish_and_clear();
            }
        },
    )))
}

/// The ranks of `--tp N`, one handle each: threads of this process on the CPU, or with `cuda` one
/// GPU each (GPUs 0..N) over NCCL, in a build with `--features nccl`. A rank loads onto
/// `rank_device`.
#[allow(dead_code)] // (only the examples that take --tp)
pub fn tp_group(
    tp: usize,
    cuda: bool,
) -> Result<Vec<std::sync::Arc<dyn qwen36::model::Communicator>>, String> {
    if !cuda {
        return qwen36::model::LocalComm::group(tp).map_err(|e| e.to_string());
    }
    #[cfg(feature = "nccl")]
    {
        qwen36::model::NcclComm::group(&(0..tp).collect::<Vec<_>>())
            .map_err(|e| format!("--tp {tp} over NCCL: {e}"))
    }
    #[cfg(not(feature = "nccl"))]
    Err(format!(
        "--tp {tp} with --cuda runs over NCCL: build with --features nccl"
    ))
}

/// The device a rank of [`tp_group`] computes on: its GPU, or `device` for CPU ranks.
#[allow(dead_code)] // (only the examples that take --tp)
pub fn rank_device(comm: &dyn qwen36::model::Communicator, device: &Device) -> Device {
    comm.device().unwrap_or_else(|| device.clone())
}

/// A count flag's value: a whole number of at least 1 (for clap's `value_parser`).
#[allow(dead_code)] // (not every example has such a flag)
pub fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// A `--memory-gib` value: a finite, positive number of GiB.
#[allow(dead_code)]
pub fn gib(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(g) if g.is_finite() && g > 0.0 => Ok(g),
        Ok(g) => Err(format!("{g} GiB: expected a positive, finite size")),
        Err(e) => Err(e.to_string()),
    }
}

/// A `--accept-rates` value: a probability in [0, 1].
#[allow(dead_code)]
pub fn probability(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(p) if (0.0..=1.0).contains(&p) => Ok(p),
        Ok(p) => Err(format!("{p}: expected a probability in [0, 1]")),
        Err(e) => Err(e.to_string()),
    }
}

/// Refuses the speculation flags a run would ignore: any of `given` (flag, set) without
/// `--mtp K`, and `--draft-vocab` with a drafter other than mtp.
#[allow(dead_code)]
pub fn check_speculation(
    mtp: usize,
    drafter: &str,
    draft_vocab: bool,
    given: &[(&str, bool)],
) -> Result<(), String> {
    let set: Vec<&str> = given
        .iter()
        .filter(|(_, on)| *on)
        .map(|(flag, _)| *flag)
        .collect();
    if mtp == 0 && !set.is_empty() {
        return Err(format!(
            "{} shape speculative decoding: give --mtp K too",
            set.join(", ")
        ));
    }
    if draft_vocab && drafter != "mtp" {
        return Err("--draft-vocab applies to the mtp drafter".into());
    }
    Ok(())
}
