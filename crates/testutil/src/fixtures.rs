//! Where the test fixtures are, found at run time: a test binary copied to another machine (the
//! GPU runner of scripts/gpu-check) finds them in the checkout it runs from.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use candle_core::{DType, Device, Tensor};

use crate::test_device;

/// The workspace root: `$QWEN36_WORKSPACE` if set; else the nearest directory at or above the
/// current one whose Cargo.toml declares `[workspace]` and which holds crates/testutil (`cargo
/// test` runs a test binary in its package's directory, scripts/gpu-check in the repository
/// root); else the workspace this crate was compiled in.
pub fn workspace_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        if let Some(dir) = std::env::var_os("QWEN36_WORKSPACE").filter(|d| !d.is_empty()) {
            return PathBuf::from(dir);
        }
        let cwd = std::env::current_dir().ok();
        cwd.iter()
            .flat_map(|d| d.ancestors())
            .find(|d| is_workspace_root(d))
            .map_or_else(
                || Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."),
                Path::to_path_buf,
            )
    })
}

fn is_workspace_root(dir: &Path) -> bool {
    dir.join("crates/testutil/Cargo.toml").is_file()
        && std::fs::read_to_string(dir.join("Cargo.toml"))
            .is_ok_and(|toml| toml.lines().any(|l| l.trim() == "[workspace]"))
}

/// `crates/<krate>/tests/fixtures/<file>` of the workspace (`krate` is the folder name: "model",
/// "qwen36", "sampling", ...).
pub fn crate_fixture(krate: &str, file: &str) -> PathBuf {
    workspace_dir()
        .join("crates")
        .join(krate)
        .join("tests/fixtures")
        .join(file)
}

/// The two HF-made fixture models (tools/reference/make_fixtures.py): one checkpoint in a single
/// file, one sharded with a nested (multimodal-style) config.
pub const FIXTURES: [&str; 2] = ["tiny-flat", "tiny-nested"];

/// A fixture model's directory (`crates/model/tests/fixtures/<name>`): "tiny-flat", "tiny-nested"
/// or "tiny-vocab" (16 ids).
pub fn fixture_dir(name: &str) -> PathBuf {
    crate_fixture("model", name)
}

/// HF's outputs for a fixture model (its reference.safetensors):
/// `prompt{i}.{ids,logits,hidden,greedy,greedy_margin}` and more.
pub fn fixture_reference(name: &str) -> HashMap<String, Tensor> {
    load_tensors(fixture_dir(name).join("reference.safetensors"))
}

/// The token ids stored under `key` in a fixture model's reference.
pub fn fixture_ids(name: &str, key: &str) -> Vec<u32> {
    ids_of(&fixture_reference(name)[key])
}

/// The bundled trained model (models/qwen36-tiny).
pub fn bundled_dir() -> PathBuf {
    workspace_dir().join("models/qwen36-tiny")
}

/// The PyTorch / transformers numbers recorded when the bundled model was trained
/// (models/qwen36-tiny.reference.safetensors).
pub fn bundled_reference() -> HashMap<String, Tensor> {
    load_tensors(workspace_dir().join("models/qwen36-tiny.reference.safetensors"))
}

/// A safetensors file's tensors, on the CPU; panics naming the file.
pub fn load_tensors(path: impl AsRef<Path>) -> HashMap<String, Tensor> {
    let path = path.as_ref();
    candle_core::safetensors::load(path, &Device::Cpu).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (fixtures are found through QWEN36_WORKSPACE or the current directory)",
            path.display()
        )
    })
}

/// A tensor of token ids (any integer or float dtype) as `u32`s.
pub fn ids_of(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::U32).unwrap().to_vec1::<u32>().unwrap()
}

/// One sequence of token ids, `[1, len]` `u32` on [`test_device`].
pub fn ids_tensor(ids: &[u32]) -> Tensor {
    Tensor::new(ids, &test_device()).unwrap().unsqueeze(0).unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whichever way the root was found, it holds every fixture the suites read.
    #[test]
    fn the_workspace_holds_the_fixtures() {
        let root = workspace_dir();
        assert!(is_workspace_root(root), "{}", root.display());
        for name in FIXTURES.iter().chain(&["tiny-vocab"]) {
            let f = fixture_dir(name).join("reference.safetensors");
            assert!(f.is_file(), "{}", f.display());
        }
        assert!(bundled_dir().join("config.json").is_file());
        assert!(!bundled_reference().is_empty());
        for (krate, file) in [("qwen36", "chat_templates.json"), ("sampling", "hf_sampler.json")] {
            assert!(crate_fixture(krate, file).is_file(), "{krate}/{file}");
        }
    }

    #[test]
    fn a_member_crate_is_not_the_root() {
        assert!(!is_workspace_root(&workspace_dir().join("crates/testutil")));
        assert!(!is_workspace_root(Path::new("/")));
    }
}
