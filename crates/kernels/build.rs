//! With the `cuda` feature: compiles cuda/*.cu to PTX with nvcc (from $NVCC or PATH) for
//! compute capability $CUDA_COMPUTE_CAP (default 80: the PTX then also JIT-compiles for Hopper).
use std::{env, path::PathBuf, process::Command};

fn main() {
    println!("cargo:rerun-if-changed=cuda/gdn.cu");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=NVCC");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR")).join("gdn.ptx");
    let cap = env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".into());
    let nvcc = env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    let status = Command::new(&nvcc)
        .args([
            "--ptx",
            "-O3",
            "-std=c++17",
            &format!("-arch=compute_{cap}"),
            "-o",
        ])
        .arg(&out)
        .arg("cuda/gdn.cu")
        .status()
        .unwrap_or_else(|e| panic!("cannot run {nvcc} (the cuda feature needs a CUDA toolkit): {e}"));
    assert!(status.success(), "nvcc failed on cuda/gdn.cu");
}
