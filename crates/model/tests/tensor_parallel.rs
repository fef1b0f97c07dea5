//! Tensor parallelism over the in-process communicator (ranks as threads, each loading only its
//! shard): tp = 2 and 4 give the one-device model's logits within 1e-5 (the sums over ranks
//! add the same terms in another order) and its greedy tokens, on the HF fixtures in f32, with
//! every rank computing the same bits; the MTP head's logits too. A rank count that does not
//! split the heads is a typed error naming the field.

mod common;

use candle_core::{DType, Tensor};
use common::*;
use qwen36_model::{LocalComm, MtpHead, Qwen36Model};

/// What one model computed for a prompt: its logits `[len, vocab]`, `n` greedy tokens after it,
/// and the MTP head's logits over the prompt's pairs.
struct Run {
    logits: Tensor,
    tokens: Vec<u32>,
    mtp_logits: Tensor,
}

fn run(model: &Qwen36Model, head: &MtpHead, ids: &[u32], n: usize) -> Run {
    let mut cache = model.new_cache(1).unwrap();
    let hidden = model.forward_hidden(&ids_tensor(ids), &mut cache).unwrap();
    let logits = model.logits(&hidden).unwrap().squeeze(0).unwrap();
    let t = ids.len();
    let first = logits
        .get(t - 1)
        .unwrap()
        .argmax(0)
        .unwrap()
        .to_scalar::<u32>()
        .unwrap();
    let mut next: Vec<u32> = ids[1..].to_vec();
    next.push(first);
    let mut mcache = head.new_cache();
    let d = head
        .forward(model, &hidden, &ids_tensor(&next), &mut mcache, 0)
        .unwrap();
    let mtp_logits = model.logits(&d).unwrap().squeeze(0).unwrap();
    let mut tokens = vec![first];
    while tokens.len() < n {
        let row = model
            .forward_last(&ids_tensor(&tokens[tokens.len() - 1..]), &mut cache)
            .unwrap();
        tokens.push(row.argmax(1).unwrap().to_vec1::<u32>().unwrap()[0]);
    }
    Run {
        logits,
        tokens,
        mtp_logits,
    }
}

/// Every rank of a group of `tp` (one thread each) loading its shard of fixture `name` and its
/// MTP head, running the same prompt.
fn ranks(name: &'static str, tp: usize, ids: &[u32], n: usize) -> Vec<Run> {
    ranks_at(&fixture_dir(name), tp, ids, n)
}

/// [`ranks`] of the checkpoint in `dir`.
fn ranks_at(dir: &std::path::Path, tp: usize, ids: &[u32], n: usize) -> Vec<Run> {
    LocalComm::run_ranks(tp, |comm| {
        let opts = load_options(DType::F32);
        let model = Qwen36Model::load_shard(dir, opts.clone(), comm.clone()).unwrap();
        let head = MtpHead::load_dir_shard(dir, opts, comm).unwrap();
        run(&model, &head, ids, n)
    })
    .unwrap()
}

#[test]
fn sharded_ranks_equal_the_one_device_model() {
    for (name, tps) in [("tiny-flat", [2, 4]), ("tiny-nested", [2, 2])] {
        let (model, head) = load_with_head(name);
        let ids = ids_of(&fixture_reference(name)["prompt0.ids"]);
        let one = run(&model, &head, &ids, 24);
        for tp in tps {
            let runs = ranks(name, tp, &ids, 24);
            for (rank, r) in runs.iter().enumerate() {
                assert_eq!(
                    max_abs_diff(&r.logits, &runs[0].logits),
                    0.0,
                    "{name} tp {tp}: rank {rank}'s logits are rank 0's"
                );
                assert_eq!(r.tokens, one.tokens, "{name} tp {tp} rank {rank}: greedy tokens");
            }
            let err = max_row_rel_err(&runs[0].logits, &one.logits);
            assert!(err <= 1e-5, "{name} tp {tp}: logits {err:.2e} from one device");
            let err = max_row_rel_err(&runs[0].mtp_logits, &one.mtp_logits);
            assert!(
                err <= 1e-5,
                "{name} tp {tp}: MTP logits {err:.2e} from one device"
            );
        }
    }
}

/// `tiny-fp8` (FP8 projections in 32×32 blocks) requantized in `block`×`block` blocks: every
/// FP8 weight dequantized and quantized again (e4m3 of weight / scale, scale = the block's
/// largest magnitude / 448), everything else as it is.
fn fp8_checkpoint(block: usize) -> tempfile::TempDir {
    use candle_core::Device;
    let dir = copy_fixture("tiny-fp8");
    let cpu = Device::Cpu;
    edit_tensors(dir.path(), "model.safetensors", |map| {
        let names: Vec<String> = map
            .iter()
            .filter(|(_, t)| t.dtype() == DType::F8E4M3)
            .map(|(n, _)| n.clone())
            .collect();
        for name in names {
            let sname = format!("{name}_scale_inv");
            let q = map[&name].to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
            let scale = map[&sname]
                .to_dtype(DType::F32)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            let (r, c) = (q.len(), q[0].len());
            let w: Vec<Vec<f32>> = (0..r)
                .map(|i| (0..c).map(|j| q[i][j] * scale[i / 32][j / 32]).collect())
                .collect();
            let (br, bc) = (r.div_ceil(block), c.div_ceil(block));
            let mut s = vec![vec![0f32; bc]; br];
            for (i, row) in w.iter().enumerate() {
                for (j, x) in row.iter().enumerate() {
                    s[i / block][j / block] = s[i / block][j / block].max(x.abs() / 448.0);
                }
            }
            for v in s.iter_mut().flatten() {
                if *v == 0.0 {
                    *v = 1.0;
                }
            }
            let scaled: Vec<f32> = (0..r)
                .flat_map(|i| (0..c).map(move |j| (i, j)))
                .map(|(i, j)| w[i][j] / s[i / block][j / block])
                .collect();
            let q = Tensor::from_vec(scaled, (r, c), &cpu)
                .unwrap()
                .to_dtype(DType::F8E4M3)
                .unwrap();
            let s = Tensor::from_vec(s.concat(), (br, bc), &cpu).unwrap();
            map.insert(name, q);
            map.insert(sname, s);
        }
    });
    edit_config(dir.path(), |v| {
        let c = if v.get("text_config").is_some() {
            &mut v["text_config"]
        } else {
            v
        };
        c["quantization_config"]["weight_block_size"] = serde_json::json!([block, block]);
    });
    dir
}

/// FP8 weights shard along their scale blocks: with 8×8 blocks tp = 2 and 4 give the
/// one-device FP8 model's logits within 1e-5 and its greedy tokens; with `tiny-fp8`'s 32×32
/// blocks a rank's 16 rows of a GDN key projection would cut a block: refused naming the weight.
#[test]
fn fp8_weights_shard_along_their_blocks() {
    let dir = fp8_checkpoint(8);
    let (model, head) = load_with_head_at(dir.path());
    assert!(model.config().quantization.is_some());
    let ids = ids_of(&fixture_reference("tiny-fp8")["prompt0.ids"]);
    let one = run(&model, &head, &ids, 24);
    for tp in [2, 4] {
        let runs = ranks_at(dir.path(), tp, &ids, 24);
        for (rank, r) in runs.iter().enumerate() {
            assert_eq!(r.tokens, one.tokens, "tp {tp} rank {rank}: greedy tokens");
        }
        let err = max_row_rel_err(&runs[0].logits, &one.logits);
        assert!(err <= 1e-5, "tp {tp}: logits {err:.2e} from one device");
        let err = max_row_rel_err(&runs[0].mtp_logits, &one.mtp_logits);
        assert!(err <= 1e-5, "tp {tp}: MTP logits {err:.2e} from one device");
    }
    let comm = LocalComm::group(2).unwrap().remove(0);
    let e = Qwen36Model::load_shard(fixture_dir("tiny-fp8"), load_options(DType::F32), comm)
        .unwrap_err()
        .to_string();
    assert!(e.contains("in_proj_qkv") && e.contains("32-wide blocks"), "{e}");
}

/// Heads or an intermediate size that a rank count does not split: refused naming the field.
#[test]
fn a_rank_count_that_does_not_split_is_refused() {
    for (name, tp, field) in [
        ("tiny-flat", 3, "num_attention_heads"),
        ("tiny-nested", 4, "linear_num_value_heads"),
    ] {
        let comm = LocalComm::group(tp).unwrap().remove(0);
        let e = Qwen36Model::load_shard(fixture_dir(name), load_options(DType::F32), comm)
            .unwrap_err()
            .to_string();
        assert!(e.contains(field), "{name} tp {tp}: {e}");
    }
}

/// Ranks as threads on one device, each with a stream of its own: every rank's reduction sums
/// what every rank computed, even while a rank's kernels are still running when it reaches the
/// reduction (a long product right before it), round after round.
#[test]
fn ranks_sum_parts_their_devices_are_still_computing() {
    const N: usize = 1024;
    for tp in [2, 4] {
        let sums = LocalComm::run_ranks(tp, |comm| {
            let device = load_options(DType::F32).device;
            (0..4)
                .map(|round| {
                    // Each rank's part: an all-ones product scaled to (rank + 1) · (round + 1),
                    // known exactly in f32.
                    let ones = Tensor::ones((N, N), DType::F32, &device).unwrap();
                    let scale = ((comm.rank() + 1) * (round + 1)) as f64 / N as f64;
                    let part = ones.matmul(&ones).unwrap().affine(scale, 0.0).unwrap();
                    let sum = comm.all_reduce_sum(&part).unwrap();
                    let (lo, hi) = (sum.min_keepdim(1).unwrap(), sum.max_keepdim(1).unwrap());
                    let lo = lo
                        .min_keepdim(0)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap()[0];
                    let hi = hi
                        .max_keepdim(0)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap()[0];
                    (lo, hi)
                })
                .collect::<Vec<_>>()
        })
        .unwrap();
        for (rank, rounds) in sums.iter().enumerate() {
            for (round, &(lo, hi)) in rounds.iter().enumerate() {
                let want = ((1..=tp).sum::<usize>() * (round + 1)) as f32;
                assert_eq!((lo, hi), (want, want), "tp {tp} rank {rank} round {round}");
            }
        }
    }
}

/// Over NCCL (built with `--features nccl`, run with `QWEN36_TEST_DEVICE=cuda`): one rank per GPU
/// (every GPU there is, up to 4; one GPU makes a group of one, whose reductions are copies) gives
/// the one-device model's logits within 1e-5 and its greedy tokens, eagerly and through the
/// stepper's CUDA graphs, which record the NCCL calls.
#[cfg(feature = "nccl")]
#[test]
fn nccl_ranks_equal_the_one_device_model() {
    use candle_core::cuda::cudarc::driver::CudaContext;
    use qwen36_model::{LoadOptions, NcclComm, Stepper};
    if std::env::var("QWEN36_TEST_DEVICE").as_deref() != Ok("cuda") {
        eprintln!("NCCL runs on CUDA devices: set QWEN36_TEST_DEVICE=cuda");
        return;
    }
    let gpus = CudaContext::device_count().unwrap() as usize;
    let tp = match gpus {
        1 => 1,
        2 | 3 => 2,
        _ => 4,
    };
    let name = "tiny-flat";
    let dir = fixture_dir(name);
    let (model, head) = load_with_head(name);
    let ids = ids_of(&fixture_reference(name)["prompt0.ids"]);
    let one = run(&model, &head, &ids, 24);
    let comms = NcclComm::group(&(0..tp).collect::<Vec<_>>()).unwrap();
    let runs: Vec<(Run, Vec<u32>, bool)> = std::thread::scope(|s| {
        let threads: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (dir, ids) = (&dir, &ids);
                s.spawn(move || {
                    let opts = LoadOptions {
                        device: comm.device().unwrap(),
                        ..load_options(DType::F32)
                    };
                    let model = Qwen36Model::load_shard(dir, opts.clone(), comm.clone()).unwrap();
                    let head = MtpHead::load_dir_shard(dir, opts, comm).unwrap();
                    let eager = run(&model, &head, ids, 24);
                    // The same greedy tokens through the stepper (one-token steps replay graphs).
                    let mut stepper = Stepper::new(&model, 1);
                    let mut cache = model.new_cache(1).unwrap();
                    let mut step = |ids: &[u32]| -> u32 {
                        let h = stepper
                            .forward_hidden(&model, &ids_tensor(ids), &mut cache)
                            .unwrap();
                        let logits = model.logits(&h).unwrap().squeeze(0).unwrap();
                        let last = logits.get(ids.len() - 1).unwrap();
                        last.argmax(0).unwrap().to_scalar::<u32>().unwrap()
                    };
                    let mut tokens = vec![step(ids)];
                    while tokens.len() < 24 {
                        let t = step(&tokens[tokens.len() - 1..]);
                        tokens.push(t);
                    }
                    let graphs = stepper.uses_graphs() && stepper.recordings() > 0;
                    (eager, tokens, graphs)
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    for (rank, (eager, graphed, graphs)) in runs.iter().enumerate() {
        assert_eq!(eager.tokens, one.tokens, "tp {tp} rank {rank}: greedy tokens");
        assert_eq!(
            graphed, &one.tokens,
            "tp {tp} rank {rank}: greedy tokens through graphs"
        );
        assert!(graphs, "tp {tp} rank {rank}: the stepper recorded no graph");
        let err = max_row_rel_err(&eager.logits, &one.logits);
        assert!(
            err <= 1e-5,
            "tp {tp} rank {rank}: logits {err:.2e} from one device"
        );
        let err = max_row_rel_err(&eager.mtp_logits, &one.mtp_logits);
        assert!(
            err <= 1e-5,
            "tp {tp} rank {rank}: MTP logits {err:.2e} from one device"
        );
    }
}
