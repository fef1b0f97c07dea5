//! CUDA-graph decode against the eager path on the bundled model (GPU only: scripts/gpu-check).
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor, D};
use qwen36_model::{
    graph_device, Cache, DecodeGraph, DraftStepper, DraftVocab, LoadOptions, MtpHead, Qwen36Model, Stepper,
};
use qwen36_testutil::{bundled_dir, max_abs_diff};

fn model(dtype: DType) -> (Qwen36Model, Device) {
    model_on(dtype, graph_device(0).expect("a CUDA device"))
}

fn options(dtype: DType, dev: &Device) -> LoadOptions {
    LoadOptions {
        dtype,
        device: dev.clone(),
        ..LoadOptions::default()
    }
}

fn model_on(dtype: DType, dev: Device) -> (Qwen36Model, Device) {
    let m = Qwen36Model::load(bundled_dir(), options(dtype, &dev)).unwrap();
    (m, dev)
}

fn ids(tokens: &[u32]) -> Tensor {
    Tensor::new(tokens, &Device::Cpu).unwrap().unsqueeze(0).unwrap()
}

fn greedy(m: &Qwen36Model, h: &Tensor) -> u32 {
    let last = h.narrow(1, h.dim(1).unwrap() - 1, 1).unwrap();
    m.logits(&last)
        .unwrap()
        .argmax(D::Minus1)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<u32>()
        .unwrap()[0]
}

/// `steps` greedy steps from `tok` on both caches, eager on `a`, graphed on `b`; returns the
/// largest hidden-state difference and the last token (the paths must agree on every token).
fn steps(
    m: &Qwen36Model,
    a: &mut Cache,
    b: &mut Cache,
    g: &mut DecodeGraph,
    mut tok: u32,
    n: usize,
) -> (f32, u32) {
    let mut worst = 0f32;
    for _ in 0..n {
        let ha = m.forward_hidden(&ids(&[tok]), a).unwrap();
        let hb = m.forward_hidden_graphed(&ids(&[tok]), b, g).unwrap();
        worst = worst.max(max_abs_diff(&ha, &hb));
        let (ta, tb) = (greedy(m, &ha), greedy(m, &hb));
        assert_eq!(ta, tb);
        tok = ta;
    }
    (worst, tok)
}

/// Graphed steps equal eager ones (f32 and bf16) through: the first recording, replays, an eager
/// verify + commit in between (states stay in their buffers), graphed verify passes of two lengths
/// with commits of every kind, a growth of the KV buffers, a reset and a new sequence, and a second
/// cache (the graphs re-record for its buffers). Tolerance 0 in f32 would hold unless
/// cuBLAS picks another algorithm under capture; 1e-5 (f32) / 1e-2 (bf16, one ulp at |h|≈4) bounds that.
#[test]
fn graphed_decode_equals_eager() {
    for (dtype, tol) in [(DType::F32, 1e-5f32), (DType::BF16, 1e-2)] {
        let (m, dev) = model(dtype);
        let mut g = DecodeGraph::new(&dev, 1).unwrap();
        let prompt: Vec<u32> = (0..37).map(|i| (i * 97 + 11) % 4000).collect();
        let (mut a, mut b) = (m.new_cache(1).unwrap(), m.new_cache(1).unwrap());
        let tok = greedy(&m, &m.forward_hidden(&ids(&prompt), &mut a).unwrap());
        m.forward_hidden(&ids(&prompt), &mut b).unwrap();
        let (d1, tok) = steps(&m, &mut a, &mut b, &mut g, tok, 12);
        assert_eq!(g.recorded(), 1, "the whole stack is one graph");

        // An eager verify of 3 tokens keeping 2, on both caches.
        let v = ids(&[tok, 5, 6]);
        m.forward_verify(&v, &mut a).unwrap();
        m.forward_verify(&v, &mut b).unwrap();
        a.commit(2).unwrap();
        g.commit(&mut b, 2).unwrap(); // after an eager verify: the plain commit
        let (mut d2, mut tok) = steps(&m, &mut a, &mut b, &mut g, 6, 8);

        // Graphed verify passes (the first records, the next replay) against eager ones, each
        // followed by a commit of a different length (graphed: recorded per verify length and
        // length kept, then replayed) and a graphed step.
        for (len, keep) in [(4usize, 2usize), (4, 4), (4, 1), (2, 1), (4, 4), (4, 2), (2, 1)] {
            let v: Vec<u32> = (0..len as u32).map(|i| (tok + 7 * i) % 4000).collect();
            let ha = m.forward_verify(&ids(&v), &mut a).unwrap();
            let hb = m.forward_verify_graphed(&ids(&v), &mut b, &mut g).unwrap();
            d2 = d2.max(max_abs_diff(&ha, &hb));
            a.commit(keep).unwrap();
            g.commit(&mut b, keep).unwrap();
            assert_eq!(a.seq_len(), b.seq_len());
            let (d, t) = steps(&m, &mut a, &mut b, &mut g, v[keep - 1], 2);
            (d2, tok) = (d2.max(d), t);
        }
        // The KV buffers grew from 64 to 128 positions at the second verify (63 + 4 tokens): the
        // graphs were dropped and recorded again for the new buffers.
        assert_eq!(g.recorded(), 3, "decode, verify of 4, verify of 2");

        // Reset and a new sequence: equal to a fresh cache.
        b.reset().unwrap();
        let mut fresh = m.new_cache(1).unwrap();
        let tok = greedy(&m, &m.forward_hidden(&ids(&prompt[..20]), &mut fresh).unwrap());
        m.forward_hidden(&ids(&prompt[..20]), &mut b).unwrap();
        let (d3, _) = steps(&m, &mut fresh, &mut b, &mut g, tok, 8);

        // Another cache with the same recorder.
        let (mut c, mut e) = (m.new_cache(1).unwrap(), m.new_cache(1).unwrap());
        m.forward_hidden(&ids(&prompt), &mut c).unwrap();
        m.forward_hidden(&ids(&prompt), &mut e).unwrap();
        let (d4, _) = steps(&m, &mut e, &mut c, &mut g, tok, 8);
        assert_eq!(c.seq_len(), e.seq_len());
        for (x, y) in c.layers().iter().zip(e.layers()) {
            if let (qwen36_model::LayerCache::Gdn(x), qwen36_model::LayerCache::Gdn(y)) = (x, y) {
                assert_eq!(x.seen(), y.seen());
            }
        }
        let worst = d1.max(d2).max(d3).max(d4);
        println!("{dtype:?}: max |graphed - eager| = {d1:e} {d2:e} {d3:e} {d4:e}");
        assert!(worst <= tol, "{dtype:?}: {worst}");
    }
}

/// Prompts (more than one token per step) and non-CUDA devices are refused with typed errors.
#[test]
fn graph_misuse_is_an_error() {
    let (m, dev) = model(DType::F32);
    let mut g = DecodeGraph::new(&dev, 1).unwrap();
    let mut c = m.new_cache(1).unwrap();
    let e = m
        .forward_hidden_graphed(&ids(&[1, 2]), &mut c, &mut g)
        .unwrap_err();
    assert!(e.to_string().contains("[1, 1]"), "{e}");
    assert!(DecodeGraph::new(&Device::Cpu, 1).is_err());
    let e = DecodeGraph::new(&Device::new_cuda(0).unwrap(), 1).err().unwrap();
    assert!(e.to_string().contains("graph_device"), "{e}");
}

/// The generation loops' stepper records graphs on a graph-capable device (the one every GPU suite
/// runs on, through `test_device`), and falls back to eager passes on a plain CUDA device.
#[test]
fn stepper_uses_graphs_where_it_can() {
    let dev = qwen36_testutil::test_device();
    if dev.is_cuda() {
        let (m, _) = model_on(DType::F32, dev);
        assert!(Stepper::new(&m, 1).uses_graphs());
    }
    let (m, _) = model_on(DType::F32, Device::new_cuda(0).unwrap());
    assert!(!Stepper::new(&m, 1).uses_graphs());
}

/// Graphed MTP draft steps equal eager ones (f32 and bf16): a first step over the whole prompt
/// (too long for the decode kernel: it runs eagerly), then rounds that drop the last round's
/// chain, feed 1..4 newly committed positions and chain up to three more one-token steps, as the
/// drafter does; the MTP KV buffers grow from 64 to 128 positions on the way (the graphs
/// re-record). Tokens must agree exactly; the hidden states within the tolerances of
/// `graphed_decode_equals_eager`.
#[test]
fn graphed_drafts_equal_eager() {
    for (dtype, tol, vocab) in [
        (DType::F32, 1e-5f32, None),
        (DType::BF16, 1e-2, None),
        (DType::BF16, 1e-2, Some(1000)),
    ] {
        let (m, dev) = model(dtype);
        let head = MtpHead::load_dir(bundled_dir(), m.config(), options(dtype, &dev)).unwrap();
        // With a draft vocabulary, both sides draft over the first 1000 ids.
        let vocab = vocab.map(|n| DraftVocab::first(&m, n, &[]).unwrap());
        let vocab = vocab.as_ref();
        let mut stepper = DraftStepper::with_vocab(&m, vocab.cloned());
        assert!(stepper.uses_graphs());
        let prompt: Vec<u32> = (0..41).map(|i| (i * 53 + 7) % 4000).collect();
        let mut cache = m.new_cache(1).unwrap();
        let h = m.forward_hidden(&ids(&prompt), &mut cache).unwrap(); // [1, 41, hidden]
        let (mut a, mut b) = (head.new_cache(), head.new_cache());
        let mut worst = 0f32;
        let mut compare = |x: &(Tensor, Tensor), y: &(Tensor, Tensor)| {
            worst = worst.max(max_abs_diff(&x.0, &y.0));
            let (tx, ty) = (x.1.to_vec2::<u32>().unwrap(), y.1.to_vec2::<u32>().unwrap());
            assert_eq!(tx, ty, "{dtype:?}: draft tokens differ");
        };
        let mut committed = 24;
        let (hp, np) = (h.narrow(1, 0, committed).unwrap(), ids(&prompt[1..=committed]));
        let ea = head.draft(&m, &hp, &np, &mut a, 0, vocab).unwrap();
        let eb = stepper.draft(&head, &m, &hp, &np, &mut b, 0).unwrap();
        compare(&ea, &eb);
        for round in 0..24 {
            let (fed, chain) = (1 + round % 4, 1 + round % 3);
            a.truncate(committed);
            b.truncate(committed);
            // Newly committed pairs: hidden rows of the prompt pass (any states do), next ids.
            let at = committed % 16;
            let hp = h.narrow(1, at, fed).unwrap();
            let np = ids(&prompt[at + 1..at + 1 + fed]);
            let (mut ea, mut eb) = (
                head.draft(&m, &hp, &np, &mut a, 0, vocab).unwrap(),
                stepper.draft(&head, &m, &hp, &np, &mut b, 0).unwrap(),
            );
            compare(&ea, &eb);
            for step in 1..=chain {
                ea = head.draft(&m, &ea.0, &ea.1, &mut a, step, vocab).unwrap();
                eb = stepper.draft(&head, &m, &eb.0, &eb.1, &mut b, step).unwrap();
                compare(&ea, &eb);
            }
            assert_eq!(a.len(), b.len());
            committed += fed;
        }
        assert!(
            committed > 64,
            "the KV buffers grew past their first 64 positions"
        );
        if let Some(v) = vocab {
            // The drafts came from the vocabulary (the eager side checks the kernel's choice
            // against the full logits in the model crate's unit tests).
            assert!(stepper.vocab().is_some_and(|s| s.len() == v.len()));
        }
        println!(
            "{dtype:?} (draft vocabulary {:?}): max |graphed - eager| draft state = {worst:e}",
            vocab.map(DraftVocab::len)
        );
        assert!(worst <= tol, "{dtype:?}: {worst}");
    }
}
