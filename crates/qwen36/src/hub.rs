//! Model directories from a path or a Hugging Face model id already in the local hub cache
//! (offline: nothing is downloaded).
//!
//! The cache is `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`; a model
//! `org/name` lives in `models--org--name/snapshots/<commit>/`, the commit named by
//! `refs/<revision>` (default `main`).

use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The local hub cache directory (`$HF_HUB_CACHE`, `$HF_HOME/hub`, `~/.cache/huggingface/hub`).
pub fn hub_cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("HF_HUB_CACHE") {
        return Some(dir.into());
    }
    if let Some(home) = std::env::var_os("HF_HOME") {
        return Some(Path::new(&home).join("hub"));
    }
    std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/huggingface/hub"))
}

/// The directory of `model`: an existing directory as it is, else a model id `org/name`
/// (optionally `org/name@revision`, a branch, tag or commit) resolved in the local hub cache.
pub fn resolve_model(model: &str) -> Result<PathBuf> {
    let path = Path::new(model);
    if path.is_dir() {
        return Ok(path.to_path_buf());
    }
    match hub_cache_dir() {
        Some(cache) => resolve_model_in(model, &cache),
        None => Err(not_found(
            model,
            "no directory of that name, and no hub cache ($HOME is not set)",
        )),
    }
}

/// [`resolve_model`] against the hub cache at `cache` (for an id; a directory is taken as is).
pub fn resolve_model_in(model: &str, cache: &Path) -> Result<PathBuf> {
    let path = Path::new(model);
    if path.is_dir() {
        return Ok(path.to_path_buf());
    }
    let (id, revision) = model.split_once('@').unwrap_or((model, "main"));
    let parts: Vec<&str> = id.split('/').collect();
    if parts.len() != 2 || parts.iter().any(|p| p.is_empty() || *p == "." || *p == "..") {
        return Err(not_found(
            model,
            "no directory of that name, and not a Hugging Face model id (org/name)",
        ));
    }
    let repo = cache.join(format!("models--{}--{}", parts[0], parts[1]));
    if !repo.is_dir() {
        return Err(not_found(
            model,
            &format!(
                "no directory of that name, and not in the Hugging Face cache {} (download it first, e.g. `hf download {id}`)",
                cache.display()
            ),
        ));
    }
    // A revision's path parts stay inside `refs` (branch names may hold `/`, never `..`).
    if revision.is_empty()
        || revision
            .split(['/', '\\'])
            .any(|p| p.is_empty() || p == "." || p == "..")
    {
        return Err(not_found(
            model,
            &format!("revision {revision:?} is not a branch, tag or commit name"),
        ));
    }
    let snapshots = repo.join("snapshots");
    // A revision is a ref (branch or tag) whose file holds a commit, or a commit itself.
    let commit = match std::fs::read_to_string(repo.join("refs").join(revision)) {
        Ok(c) => c.trim().to_string(),
        Err(_) => revision.to_string(),
    };
    let dir = snapshots.join(&commit);
    let plain = !matches!(commit.as_str(), "" | "." | "..") && !commit.contains(['/', '\\']);
    if plain && dir.is_dir() {
        return Ok(dir);
    }
    let available: Vec<String> = std::fs::read_dir(&snapshots)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    Err(not_found(
        model,
        &format!(
            "revision {revision:?} is not in {} (snapshots there: {})",
            snapshots.display(),
            if available.is_empty() {
                "none".into()
            } else {
                available.join(", ")
            }
        ),
    ))
}

fn not_found(model: &str, msg: &str) -> Error {
    Error::File {
        path: PathBuf::from(model),
        msg: msg.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake hub cache with one model, a `main` ref and a `v1` tag at two snapshots.
    fn cache() -> PathBuf {
        let root = std::env::temp_dir().join(format!("qwen36-hub-test-{}", std::process::id()));
        let repo = root.join("models--Qwen--Qwen3.6-27B");
        for (r, c) in [("main", "aaa111"), ("v1", "bbb222")] {
            std::fs::create_dir_all(repo.join("refs")).unwrap();
            std::fs::write(repo.join("refs").join(r), format!("{c}\n")).unwrap();
            std::fs::create_dir_all(repo.join("snapshots").join(c)).unwrap();
        }
        root
    }

    #[test]
    fn ids_resolve_to_their_snapshot() {
        let root = cache();
        let snap = root.join("models--Qwen--Qwen3.6-27B/snapshots");
        assert_eq!(
            resolve_model_in("Qwen/Qwen3.6-27B", &root).unwrap(),
            snap.join("aaa111")
        );
        assert_eq!(
            resolve_model_in("Qwen/Qwen3.6-27B@v1", &root).unwrap(),
            snap.join("bbb222")
        );
        assert_eq!(
            resolve_model_in("Qwen/Qwen3.6-27B@bbb222", &root).unwrap(),
            snap.join("bbb222")
        );
        // A directory is taken as it is.
        assert_eq!(resolve_model_in(snap.to_str().unwrap(), &root).unwrap(), snap);
        let err = |m: &str| resolve_model_in(m, &root).unwrap_err().to_string();
        assert!(
            err("Qwen/Qwen3.6-9B").contains("not in the Hugging Face cache"),
            "{}",
            err("Qwen/Qwen3.6-9B")
        );
        assert!(
            err("Qwen/Qwen3.6-27B@v2").contains("aaa111"),
            "{}",
            err("Qwen/Qwen3.6-27B@v2")
        );
        assert!(err("no-such-dir").contains("not a Hugging Face model id"));
        assert!(err("Qwen/../x").contains("not a Hugging Face model id"));
        // A revision leading out of `refs` or `snapshots` (`..` is the repository itself).
        for bad in [
            "Qwen/Qwen3.6-27B@..",
            "Qwen/Qwen3.6-27B@.",
            "Qwen/Qwen3.6-27B@../refs/main",
            "Qwen/Qwen3.6-27B@",
        ] {
            assert!(
                err(bad).contains("not a branch, tag or commit name"),
                "{bad}: {}",
                err(bad)
            );
        }
        // A ref file whose commit is `..`.
        let refs = root.join("models--Qwen--Qwen3.6-27B/refs");
        std::fs::write(refs.join("up"), "..\n").unwrap();
        assert!(
            err("Qwen/Qwen3.6-27B@up").contains("is not in"),
            "{}",
            err("Qwen/Qwen3.6-27B@up")
        );
        std::fs::remove_dir_all(root).unwrap();
    }
}
