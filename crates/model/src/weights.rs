//! Memory-mapped safetensors checkpoints: one file or shards through `model.safetensors.index.json`.
//!
//! Language-model tensors live under `model.language_model.` (VL checkpoints) or `model.`
//! (text-only); `lm_head.weight` and `mtp.*` are top level. Vision tensors are never read.

use std::collections::BTreeSet;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::safetensors::{Load, MmapedSafetensors};
use candle_core::{DType, Device, Tensor};

use qwen36_kernels::linear::{Fp8Weight, LinearWeight};

use crate::shard::split_of;
use crate::{Communicator, Config, Error, Quantization, Result, Shard};

/// How tensors are materialised.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Activation / weight dtype: f32, bf16 or f16.
    pub dtype: DType,
    /// Where the tensors go.
    pub device: Device,
    /// Refuse tensors holding NaN or infinity (one extra pass over the weights).
    pub check_finite: bool,
    /// The CUDA kernel variants every layer runs (the measured defaults, and `QWEN36_PDL=0` read
    /// here for A/B benchmarks); held by the model, never global.
    pub kernels: qwen36_kernels::KernelPolicy,
    /// Told of the bytes loaded so far after each tensor (for a progress bar).
    pub progress: Option<LoadProgress>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            dtype: DType::F32,
            device: Device::Cpu,
            check_finite: true,
            kernels: qwen36_kernels::KernelPolicy::from_env(),
            progress: None,
        }
    }
}

/// A callback `(bytes loaded, bytes in the checkpoint's files)` run after each tensor loads;
/// the model may not read every tensor of the files (vision towers), so the count can end short
/// of the total.
#[derive(Clone)]
pub struct LoadProgress(pub std::sync::Arc<dyn Fn(u64, u64) + Send + Sync>);

impl std::fmt::Debug for LoadProgress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LoadProgress")
    }
}

/// An opened checkpoint with its language-model name prefix resolved.
pub struct Weights {
    source: Source,
    prefix: &'static str,
    opts: LoadOptions,
    /// Bytes of the checkpoint's files, and of the tensors loaded so far (for `opts.progress`).
    total_bytes: u64,
    loaded_bytes: std::sync::atomic::AtomicU64,
    /// A tensor-parallel rank's view ([`Self::sharded`]): its group and the full config.
    shard: Option<(Arc<dyn Communicator>, Config)>,
}

enum Source {
    Files(MmapedSafetensors),
    /// Every tensor exists and is made on request; `std` is the spread of the random matrices,
    /// `fp8` the block of FP8 linear weights (the ones Qwen's FP8 checkpoints quantize).
    Random {
        std: f64,
        fp8: Option<[usize; 2]>,
    },
}

const PREFIXES: [&str; 2] = ["model.language_model.", "model."];

impl Weights {
    /// Opens the safetensors files of `dir` (index first, else `model.safetensors`).
    pub fn open(dir: impl AsRef<Path>, opts: LoadOptions) -> Result<Self> {
        let dir = dir.as_ref();
        let files = checkpoint_files(dir)?;
        if files.len() > 1 {
            each_tensor_once(&files)?;
        }
        // SAFETY: the files are mapped read-only; like every mmap-based loader we rely on no other
        // process truncating them while the model is alive (documented in candle's MmapedSafetensors).
        let st = unsafe { MmapedSafetensors::multi(&files) }?;
        let prefix = PREFIXES
            .into_iter()
            .find(|p| st.get(&format!("{p}embed_tokens.weight")).is_ok())
            .ok_or_else(|| {
                Error::MissingTensor(format!(
                    "embed_tokens.weight (looked for model.language_model.embed_tokens.weight and model.embed_tokens.weight in {})",
                    dir.display()
                ))
            })?;
        let total_bytes = files
            .iter()
            .filter_map(|f| std::fs::metadata(f).ok())
            .map(|m| m.len())
            .sum();
        Ok(Self {
            source: Source::Files(st),
            prefix,
            opts,
            total_bytes,
            loaded_bytes: Default::default(),
            shard: None,
        })
    }

    /// A stand-in checkpoint with every tensor present and random, made on `opts.device` when a
    /// layer asks for it (seed the device for repeatable values). Matrices are N(0, 0.02²) like
    /// HF's initialiser; norms are the identity, `A_log` ≈ 0 and `dt_bias` = 1, so activations
    /// stay finite through any depth. For benchmarks: the outputs are meaningless.
    pub fn random(opts: LoadOptions) -> Self {
        Self {
            source: Source::Random { std: 0.02, fp8: None },
            prefix: PREFIXES[1],
            opts,
            total_bytes: 0,
            loaded_bytes: Default::default(),
            shard: None,
        }
    }

    /// [`Self::random`] with the linear weights an FP8 checkpoint quantizes (all but the GDN's
    /// `in_proj_a`/`in_proj_b`, `lm_head` and `mtp.fc`) in FP8 e4m3 with `block` scales.
    pub fn random_fp8(opts: LoadOptions, block: [usize; 2]) -> Self {
        Self {
            source: Source::Random {
                std: 0.02,
                fp8: Some(block),
            },
            ..Self::random(opts)
        }
    }

    /// This checkpoint as rank `comm.rank()` of a tensor-parallel group sees it: every tensor
    /// that is sharded ([`crate::Shard`]) is read as that rank's part only (from the mapped file,
    /// never whole); the layers ask for their parts' shapes (from `full.shard(..)`).
    /// Returns the rank's config with it; refused, naming the field, when `full` does not split
    /// over the group ([`Config::shard`]).
    pub fn sharded(mut self, comm: Arc<dyn Communicator>, full: &Config) -> Result<(Config, Self)> {
        if let Some(d) = comm.device() {
            if !d.same_device(&self.opts.device) {
                return Err(Error::Input(format!(
                    "rank {}'s communicator runs on {:?}, the load options name {:?}: load each rank on its communicator's device",
                    comm.rank(),
                    d.location(),
                    self.opts.device.location()
                )));
            }
        }
        let cfg = full.shard(Shard {
            rank: comm.rank(),
            size: comm.size(),
        })?;
        self.shard = Some((comm, full.clone()));
        Ok((cfg, self))
    }

    /// The group a sharded checkpoint's rank reduces over ([`Self::sharded`]).
    pub fn communicator(&self) -> Option<&Arc<dyn Communicator>> {
        self.shard.as_ref().map(|(c, _)| c)
    }

    /// The prefix of language-model tensors in this checkpoint.
    pub fn prefix(&self) -> &str {
        self.prefix
    }

    /// The load options.
    pub fn options(&self) -> &LoadOptions {
        &self.opts
    }

    /// Whether a top-level tensor exists (e.g. `lm_head.weight`, `mtp.fc.weight`).
    pub fn contains(&self, name: &str) -> bool {
        match &self.source {
            Source::Files(st) => st.get(name).is_ok(),
            Source::Random { .. } => true,
        }
    }

    /// The full name of a language-model tensor (`name` relative to the prefix).
    pub fn lm_name(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// A language-model tensor (`name` relative to the prefix) with the expected shape, in the model dtype.
    pub fn lm(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.get(&self.lm_name(name), shape, self.opts.dtype)
    }

    /// A tensor by its full name, checked against `shape`, converted to `dtype`. FP8 tensors
    /// are refused: their values mean nothing without their block scales ([`Self::linear`]).
    pub fn get(&self, name: &str, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let st = match &self.source {
            Source::Files(st) => st,
            Source::Random { std, .. } => return random_tensor(name, shape, dtype, *std, &self.opts.device),
        };
        let view = st.get(name).map_err(|_| Error::MissingTensor(name.to_string()))?;
        if view.dtype() == safetensors::Dtype::F8_E4M3 {
            return Err(Error::Quantized {
                name: name.to_string(),
                msg: "is float8 e4m3 where this model reads a plain tensor (FP8 is supported for linear weights only)".into(),
            });
        }
        float_stored(name, view.dtype())?;
        let stored = match self.part_of(name) {
            Some((split, shard)) => {
                let (n, keep) = split.ranges(shard);
                let mut full = shape.to_vec();
                full[split.dim] = n;
                let kept: usize = keep.iter().map(|r| r.len()).sum();
                if view.shape() != full || kept != shape[split.dim] {
                    return Err(Error::TensorShape {
                        name: name.to_string(),
                        expected: full,
                        found: view.shape().to_vec(),
                    });
                }
                let bytes = slice_bytes(
                    view.data(),
                    view.shape(),
                    view.dtype().bitsize() / 8,
                    split.dim,
                    &keep,
                );
                let part = safetensors::tensor::TensorView::new(view.dtype(), shape.to_vec(), &bytes)
                    .map_err(|e| Error::Candle(candle_core::Error::Msg(format!("{name}: {e}"))))?;
                self.count_loaded(bytes.len());
                part.load(&self.opts.device)?
            }
            None => {
                if view.shape() != shape {
                    return Err(Error::TensorShape {
                        name: name.to_string(),
                        expected: shape.to_vec(),
                        found: view.shape().to_vec(),
                    });
                }
                self.count_loaded(view.data().len());
                view.load(&self.opts.device)?
            }
        };
        let t = stored.to_dtype(dtype)?;
        // A NaN or ±inf anywhere makes the sum non-finite; finite weights cannot overflow f32 here.
        let finite = |t: &Tensor| -> Result<bool> {
            Ok(t.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()?.is_finite())
        };
        if self.opts.check_finite && !finite(&t)? {
            if finite(&stored)? {
                return Err(Error::OutOfRange {
                    name: name.to_string(),
                    dtype,
                });
            }
            return Err(Error::NonFinite(name.to_string()));
        }
        Ok(t)
    }
}

impl Weights {
    /// How a sharded checkpoint's rank cuts tensor `name`, and the rank; `None` when it reads
    /// all of it.
    fn part_of(&self, name: &str) -> Option<(crate::shard::Split, Shard)> {
        self.shard.as_ref().and_then(|(comm, full)| {
            Some((
                split_of(name, full)?,
                Shard {
                    rank: comm.rank(),
                    size: comm.size(),
                },
            ))
        })
    }

    /// The weight of linear layer `name` (a full module name; the tensor is `{name}.weight`,
    /// `[out, in]` = `shape`): dense in the model dtype, or, when the file holds it in float8
    /// e4m3, FP8 with its block scales `{name}.weight_scale_inv`, which `quant` must declare.
    pub fn linear(&self, name: &str, shape: &[usize], quant: Option<&Quantization>) -> Result<LinearWeight> {
        let wname = format!("{name}.weight");
        let dtype = self.opts.dtype;
        let st = match &self.source {
            Source::Files(st) => st,
            Source::Random {
                std,
                fp8: Some(block),
            } if random_is_fp8(name) => return random_fp8(shape, *block, *std, &self.opts.device),
            Source::Random { .. } => return Ok(LinearWeight::Dense(self.get(&wname, shape, dtype)?)),
        };
        let view = st.get(&wname).map_err(|_| Error::MissingTensor(wname.clone()))?;
        if view.dtype() != safetensors::Dtype::F8_E4M3 {
            return Ok(LinearWeight::Dense(self.get(&wname, shape, dtype)?));
        }
        let block = match quant {
            Some(Quantization::Fp8 { block, .. }) => *block,
            None => {
                return Err(Error::Quantized {
                    name: wname,
                    msg: "is float8 e4m3 but config.json declares no quantization_config".into(),
                })
            }
        };
        // A rank of a sharded checkpoint reads its rows (or columns) of the weight and of the
        // scales: whole scale blocks only.
        let part = self.part_of(&wname);
        let mut full = shape.to_vec();
        let mut keep = Vec::new();
        if let Some((split, shard)) = &part {
            let n;
            (n, keep) = split.ranges(*shard);
            full[split.dim] = n;
            let kept: usize = keep.iter().map(|r| r.len()).sum();
            let b = block[split.dim];
            // Each kept piece starts on a block and holds whole blocks, but for one that ends
            // the tensor (its last block may be short there).
            let aligned = keep
                .iter()
                .all(|r| r.start % b == 0 && (r.len() % b == 0 || r.end == n))
                && keep.iter().rev().skip(1).all(|r| r.len() % b == 0);
            if kept != shape[split.dim] || (view.shape() == full && !aligned) {
                let what = if split.dim == 0 { "rows" } else { "columns" };
                return Err(Error::Quantized {
                    name: wname,
                    msg: format!(
                        "rank {} of {} would hold {what} {keep:?} of {n}, which do not fall on the {b}-wide blocks of its scales: FP8 weights shard only over rank counts that keep whole scale blocks on every rank",
                        shard.rank, shard.size
                    ),
                });
            }
        }
        if view.shape() != full {
            return Err(Error::TensorShape {
                name: wname,
                expected: full,
                found: view.shape().to_vec(),
            });
        }
        let bytes = match &part {
            Some((split, _)) => {
                std::borrow::Cow::Owned(slice_bytes(view.data(), view.shape(), 1, split.dim, &keep))
            }
            None => std::borrow::Cow::Borrowed(view.data()),
        };
        // NaN bytes (S.1111.111) are refused whatever `check_finite` says: the CUDA kernels
        // would read them as ±480·scale where the CPU reads NaN. A scan of the mapped bytes.
        if bytes.iter().any(|&b| b & 0x7F == 0x7F) {
            return Err(Error::NonFinite(wname));
        }
        let load = |dtype, shape: Vec<usize>, bytes: &[u8], name: &str| -> Result<Tensor> {
            let view = safetensors::tensor::TensorView::new(dtype, shape, bytes)
                .map_err(|e| Error::Candle(candle_core::Error::Msg(format!("{name}: {e}"))))?;
            self.count_loaded(bytes.len());
            view.load(&self.opts.device)
                .map_err(|e| Error::Candle(candle_core::Error::Msg(format!("{name}: {e}"))))
        };
        let q = load(view.dtype(), shape.to_vec(), &bytes, &wname)?;
        let sname = format!("{name}.weight_scale_inv");
        let sview = st.get(&sname).map_err(|_| Error::Quantized {
            name: wname.clone(),
            msg: format!("is float8 e4m3 but {sname} (its block scales) is missing"),
        })?;
        float_stored(&sname, sview.dtype())?;
        let want = [full[0].div_ceil(block[0]), full[1].div_ceil(block[1])];
        if sview.shape() != want {
            return Err(Error::TensorShape {
                name: sname,
                expected: want.to_vec(),
                found: sview.shape().to_vec(),
            });
        }
        let scale = match &part {
            Some((split, _)) => {
                let b = block[split.dim];
                let blocks: Vec<Range<usize>> = keep.iter().map(|r| r.start / b..r.end.div_ceil(b)).collect();
                let elem = sview.dtype().bitsize() / 8;
                let sbytes = slice_bytes(sview.data(), sview.shape(), elem, split.dim, &blocks);
                let local = vec![shape[0].div_ceil(block[0]), shape[1].div_ceil(block[1])];
                load(sview.dtype(), local, &sbytes, &sname)?
            }
            None => load(sview.dtype(), sview.shape().to_vec(), sview.data(), &sname)?,
        };
        // (f32, bf16 and f16 scales are read as they are; f64 ones as f32.)
        let scale = match scale.dtype() {
            DType::F64 => scale.to_dtype(DType::F32)?,
            _ => scale,
        };
        if !scale
            .to_dtype(DType::F32)?
            .sum_all()?
            .to_scalar::<f32>()?
            .is_finite()
        {
            return Err(Error::NonFinite(sname));
        }
        Ok(LinearWeight::Fp8(Fp8Weight::new(q, scale, block).map_err(
            |e| Error::Quantized {
                name: wname,
                msg: e.to_string(),
            },
        )?))
    }

    /// Reports `bytes` more loaded to the progress callback.
    fn count_loaded(&self, bytes: usize) {
        if let Some(LoadProgress(progress)) = &self.opts.progress {
            let done = self
                .loaded_bytes
                .fetch_add(bytes as u64, std::sync::atomic::Ordering::Relaxed)
                + bytes as u64;
            progress(done, self.total_bytes);
        }
    }
}

/// The bytes of the ranges `keep` along `dim` of a row-major tensor of `shape` (`elem` bytes an
/// entry) held in `data`, in order: a rank's part of a sharded tensor.
fn slice_bytes(data: &[u8], shape: &[usize], elem: usize, dim: usize, keep: &[Range<usize>]) -> Vec<u8> {
    let outer: usize = shape[..dim].iter().product();
    let inner: usize = shape[dim + 1..].iter().product::<usize>() * elem;
    let kept: usize = keep.iter().map(|r| r.len()).sum();
    let mut out = Vec::with_capacity(outer * kept * inner);
    for o in 0..outer {
        let base = o * shape[dim];
        for r in keep {
            out.extend_from_slice(&data[(base + r.start) * inner..(base + r.end) * inner]);
        }
    }
    out
}

/// Whether a random FP8 checkpoint quantizes linear layer `name` (as Qwen's FP8 checkpoints do:
/// not the GDN's narrow `in_proj_a`/`in_proj_b`, nor `lm_head` or `mtp.fc`).
fn random_is_fp8(name: &str) -> bool {
    !["in_proj_a", "in_proj_b", "lm_head", "mtp.fc"]
        .iter()
        .any(|n| name.ends_with(n))
}

/// A random FP8 weight `[out, in]` with values of spread `std`: random e4m3 bytes of exponent
/// at most 7 (|value| ≤ 1.875, never NaN; RMS about 0.6) made on the host (candle cannot cast
/// to e4m3 on CUDA), every block scale `std / 0.6`.
fn random_fp8(shape: &[usize], block: [usize; 2], std: f64, dev: &Device) -> Result<LinearWeight> {
    let n: usize = shape.iter().product();
    let mut s = 0x9E37_79B9_7F4A_7C15u64 ^ (n as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
    let mut bytes = Vec::with_capacity(n + 8);
    while bytes.len() < n {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        // Bit 6 clear in every byte: the exponent stays at most 7.
        bytes.extend((s & 0xBFBF_BFBF_BFBF_BFBF).to_le_bytes());
    }
    bytes.truncate(n);
    let q = Tensor::from_raw_buffer(&bytes, DType::F8E4M3, shape, &Device::Cpu)?.to_device(dev)?;
    let blocks = (shape[0].div_ceil(block[0]), shape[1].div_ceil(block[1]));
    let scale = Tensor::full((std / 0.6) as f32, blocks, dev)?;
    Ok(LinearWeight::Fp8(Fp8Weight::new(q, scale, block)?))
}

/// Refuses a plain tensor stored in a dtype that is not a float the model reads (an integer or
/// bool tensor would load as integer-valued weights; other floats fail deep in candle without
/// the tensor's name).
fn float_stored(name: &str, stored: safetensors::Dtype) -> Result<()> {
    use safetensors::Dtype as D;
    match stored {
        D::F32 | D::F64 | D::BF16 | D::F16 => Ok(()),
        other => Err(Error::TensorDtype {
            name: name.to_string(),
            stored: format!("{other:?}"),
        }),
    }
}

/// A random stand-in for tensor `name`: (1+w) norms get w = 0, the GDN gated norm (plain w) and
/// `dt_bias` get ones, `A_log` zeros, everything else N(0, std²).
fn random_tensor(name: &str, shape: &[usize], dtype: DType, std: f64, dev: &Device) -> Result<Tensor> {
    let t = if name.ends_with("linear_attn.norm.weight") || name.ends_with("dt_bias") {
        Tensor::ones(shape, dtype, dev)?
    } else if name.contains("norm") || name.ends_with("A_log") {
        Tensor::zeros(shape, dtype, dev)?
    } else {
        Tensor::randn(0f32, std as f32, shape, dev)?.to_dtype(dtype)?
    };
    Ok(t)
}

/// Refuses a tensor stored in two shards (the mapped view would take one of them silently).
/// (Where the index places each tensor is not checked: tensors are found by the files' own
/// headers, and published indexes list tensors no shard holds, e.g. an MTP head left out.)
fn each_tensor_once(files: &[PathBuf]) -> Result<()> {
    let mut seen: std::collections::HashMap<String, usize> = Default::default();
    for (i, file) in files.iter().enumerate() {
        // SAFETY: read-only mapping of a checkpoint file, as in `Weights::open`; only the header
        // is read, and the mapping is dropped before returning.
        let st = unsafe { MmapedSafetensors::new(file) }?;
        for (name, _) in st.tensors() {
            if let Some(&j) = seen.get(&name) {
                return Err(Error::DuplicateTensor {
                    name,
                    first: files[j].clone(),
                    second: file.clone(),
                });
            }
            seen.insert(name, i);
        }
    }
    Ok(())
}

/// The weight files of a checkpoint directory, each checked to exist.
fn checkpoint_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|source| Error::Io {
            path: index.clone(),
            source,
        })?;
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|source| Error::Json {
            path: index.clone(),
            source,
        })?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::Config {
                field: format!("{}: weight_map", index.display()),
                msg: "missing or not an object".into(),
            })?;
        let mut names = BTreeSet::new();
        for (tensor, file) in map {
            // A file of this directory: a plain name (no path that leads out of it).
            let file = file
                .as_str()
                .filter(|f| Path::new(f).file_name() == Some(std::ffi::OsStr::new(f)))
                .ok_or_else(|| Error::Config {
                    field: format!("{}: weight_map.{tensor}", index.display()),
                    msg: format!("expected a file name in the checkpoint's directory, found {file}"),
                })?;
            names.insert(file.to_string());
        }
        let files: Vec<PathBuf> = names.into_iter().map(|n| dir.join(n)).collect();
        if let Some(missing) = files.iter().find(|p| !p.exists()) {
            return Err(Error::MissingFile(missing.clone()));
        }
        return Ok(files);
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    Err(Error::MissingFile(
        dir.join("model.safetensors (or model.safetensors.index.json)"),
    ))
}
