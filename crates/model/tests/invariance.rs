//! Batch invariance on CUDA (issue 22): with the default kernels a token's logits are the same
//! bits whether it is decoded alone or checked in a speculative verify of several tokens, eagerly
//! or from CUDA graphs, so half-precision speculative decoding is lossless to the bit (GPU only:
//! scripts/gpu-check; on the CPU the matmul blocks several rows differently from one). Under
//! `SkinnyPath::Fastest` one row takes another kernel than several and this fails.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, IndexOp, Tensor, D};
use qwen36_model::{graph_device, Cache, DecodeGraph, LoadOptions, Qwen36Model};
use qwen36_testutil::{bundled_dir, bundled_reference, ids_of, max_abs_diff};

fn model(dtype: DType) -> (Qwen36Model, Device) {
    let dev = graph_device(0).expect("a CUDA device");
    let opts = LoadOptions {
        dtype,
        device: dev.clone(),
        ..LoadOptions::default()
    };
    (Qwen36Model::load(bundled_dir(), opts).unwrap(), dev)
}

fn ids(tokens: &[u32]) -> Tensor {
    Tensor::new(tokens, &Device::Cpu).unwrap().unsqueeze(0).unwrap()
}

/// One token's outputs: its logits `[vocab]` and the residual stream entering each layer and
/// leaving the last (`[hidden]` each).
struct Row {
    logits: Tensor,
    states: Vec<Tensor>,
}

/// The rows of a pass over `t` tokens: its final-norm hidden states `[1, t, hidden]` and its
/// residual streams `[1, t, hidden]` per layer.
fn rows(m: &Qwen36Model, h: &Tensor, states: &[Tensor]) -> Vec<Row> {
    let logits = m.logits(h).unwrap().squeeze(0).unwrap();
    (0..h.dim(1).unwrap())
        .map(|i| Row {
            logits: logits.i(i).unwrap(),
            states: states.iter().map(|s| s.i((0, i)).unwrap()).collect(),
        })
        .collect()
}

/// The prompt through `cache`; returns the greedy next token.
fn prefill(m: &Qwen36Model, cache: &mut Cache, prompt: &[u32]) -> u32 {
    let h = m.forward_hidden(&ids(prompt), cache).unwrap();
    let last = m.logits(&h.i((.., h.dim(1).unwrap() - 1..)).unwrap()).unwrap();
    last.flatten_all()
        .unwrap()
        .argmax(D::Minus1)
        .unwrap()
        .to_scalar::<u32>()
        .unwrap()
}

/// Panics unless `got` is `want` to the bit, naming the first layer whose output differs.
fn assert_same_bits(want: &Row, got: &Row, what: &str) {
    let same = |a: &Tensor, b: &Tensor| {
        let (a, b) = (a.to_dtype(DType::F32).unwrap(), b.to_dtype(DType::F32).unwrap());
        a.to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).eq(b
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits()))
    };
    if same(&want.logits, &got.logits) {
        return;
    }
    let layer = (0..want.states.len()).find(|&l| !same(&want.states[l], &got.states[l]));
    let diff = layer.map(|l| max_abs_diff(&want.states[l], &got.states[l]));
    panic!(
        "{what}: logits differ by up to {} (first differing residual stream: the output of layer {:?}, by {diff:?})",
        max_abs_diff(&want.logits, &got.logits),
        layer.map(|l| l as i64 - 1),
    );
}

/// Greedy tokens decoded one at a time after the bundled model's first prompt, eagerly: the
/// reference rows (row i is the output for input token i).
fn decoded(m: &Qwen36Model, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Row>) {
    let mut cache = m.new_cache(1).unwrap();
    let mut tokens = vec![prefill(m, &mut cache, prompt)];
    let mut out = Vec::new();
    while out.len() < n {
        let (h, states) = m
            .forward_hidden_states(&ids(&tokens[out.len()..][..1]), &mut cache)
            .unwrap();
        let row = rows(m, &h, &states).remove(0);
        tokens.push(row.logits.argmax(D::Minus1).unwrap().to_scalar::<u32>().unwrap());
        out.push(row);
    }
    (tokens, out)
}

/// Verify passes of 4, then (after keeping 2 of them) 5, then 2 tokens, eager: every row equals
/// the token decoded alone, in bf16 and f16. A verify reads the chunk of new keys and values it
/// wrote itself and walks the GDN recurrence over several tokens in one kernel, where a decode
/// step sees one; a different reduction order anywhere on the way shows as a differing bit.
#[test]
fn verify_rows_are_decode_steps_to_the_bit() {
    let prompt = ids_of(&bundled_reference()["prompt0.ids"]);
    for dtype in [DType::BF16, DType::F16] {
        let (m, _) = model(dtype);
        let (tokens, want) = decoded(&m, &prompt, 9);
        let mut cache = m.new_cache(1).unwrap();
        prefill(&m, &mut cache, &prompt);
        let mut at = 0;
        for (len, keep) in [(4, 2), (5, 5), (2, 2)] {
            let (h, states) = m
                .forward_verify_states(&ids(&tokens[at..at + len]), &mut cache)
                .unwrap();
            for (i, row) in rows(&m, &h, &states).iter().enumerate() {
                assert_same_bits(
                    &want[at + i],
                    row,
                    &format!("{dtype:?}: verify row {i} of {len} at token {}", at + i),
                );
            }
            cache.commit(keep).unwrap();
            at += keep;
        }
    }
}

/// The same through CUDA graphs: graphed decode steps and graphed verify passes (graphs of two
/// lengths, replayed) give the eager decode's bits.
#[test]
fn graphed_steps_and_verifies_are_decode_steps_to_the_bit() {
    let prompt = ids_of(&bundled_reference()["prompt0.ids"]);
    for dtype in [DType::BF16, DType::F16] {
        let (m, dev) = model(dtype);
        let (tokens, want) = decoded(&m, &prompt, 12);
        let logits_row = |h: &Tensor, i: usize| Row {
            logits: m.logits(h).unwrap().squeeze(0).unwrap().i(i).unwrap(),
            states: vec![],
        };
        let only_logits = |r: &Row| Row {
            logits: r.logits.clone(),
            states: vec![],
        };
        let mut g = DecodeGraph::new(&dev, 1).unwrap();
        let mut cache = m.new_cache(1).unwrap();
        prefill(&m, &mut cache, &prompt);
        for (i, want) in want.iter().enumerate().take(4) {
            let h = m
                .forward_hidden_graphed(&ids(&tokens[i..i + 1]), &mut cache, &mut g)
                .unwrap();
            assert_same_bits(
                &only_logits(want),
                &logits_row(&h, 0),
                &format!("{dtype:?}: graphed step {i}"),
            );
        }
        let mut at = 4;
        for (len, keep) in [(3, 1), (4, 4), (3, 3)] {
            let h = m
                .forward_verify_graphed(&ids(&tokens[at..at + len]), &mut cache, &mut g)
                .unwrap();
            for i in 0..len {
                assert_same_bits(
                    &only_logits(&want[at + i]),
                    &logits_row(&h, i),
                    &format!("{dtype:?}: graphed verify row {i} of {len} at token {}", at + i),
                );
            }
            cache.commit(keep).unwrap();
            at += keep;
        }
    }
}
