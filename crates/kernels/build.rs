//! With the `cuda` feature: compiles cuda/{gdn,norm,linear,attention,argmax,activation}.cu to PTX with nvcc (from $NVCC or PATH) for
//! compute capability $CUDA_COMPUTE_CAP (default 80: the PTX then also JIT-compiles for Hopper).
use std::{env, path::PathBuf, process::Command};

/// The kernel sources, each compiled to `<name>.ptx`.
const KERNELS: [&str; 6] = ["gdn", "norm", "linear", "attention", "argmax", "activation"];

fn main() {
    println!("cargo:rerun-if-changed=cuda/common.cuh");
    println!("cargo:rerun-if-changed=cuda/mma.cuh");
    for name in KERNELS {
        println!("cargo:rerun-if-changed=cuda/{name}.cu");
    }
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=NVCC");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));
    let cap = env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".into());
    // The launcher sets the programmatic-dependent-launch attribute only for sm_90+ PTX.
    println!("cargo:rustc-env=QWEN36_PTX_CAP={cap}");
    let nvcc = env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    for name in KERNELS {
        let status = Command::new(&nvcc)
            .args([
                "--ptx",
                "-O3",
                "-std=c++17",
                &format!("-arch=compute_{cap}"),
                "-o",
            ])
            .arg(out_dir.join(format!("{name}.ptx")))
            .arg(format!("cuda/{name}.cu"))
            .status()
            .unwrap_or_else(|e| panic!("cannot run {nvcc} (the cuda feature needs a CUDA toolkit): {e}"));
        assert!(status.success(), "nvcc failed on cuda/{name}.cu");
    }
}
