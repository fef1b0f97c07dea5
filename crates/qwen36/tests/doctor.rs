//! The doctor: it passes the bundled model and the HF fixtures, and fails each injected fault
//! (feature `fault-injection` of qwen36-model, enabled for tests only) with its own diagnosis;
//! the repetition detector stays quiet on held-out text and the bundled model's samples and
//! fires on loops, those of a faulty state among them.

use std::path::Path;

use std::sync::Arc;

use candle_core::Tensor;
use qwen36::doctor::{
    convention_checks, engine_checks, examine, examine_ranks, numerics_checks, speculation_checks, Check,
    DoctorOptions, Status,
};
use qwen36::model::{Communicator, Fault, LoadOptions, LocalComm, MtpHead, Qwen36Model};
use qwen36::sampling::{DegenerationConfig, RepetitionDetector};
use qwen36::{GenerateOptions, Generator};
use qwen36_testutil::{bundled_dir, bundled_reference, fixture_dir, ids_of};

fn failed<'a>(checks: &'a [Check], name: &str) -> &'a Check {
    checks
        .iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no check {name:?} in {checks:#?}"))
}

fn options() -> DoctorOptions {
    DoctorOptions {
        generate_tokens: 64,
        ..DoctorOptions::default()
    }
}

/// The tiny-flat fixture in a temporary directory (its files linked) with `edit` applied to
/// its config.json.
fn tiny_flat_with(edit: impl FnOnce(&mut serde_json::Value)) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let src = fixture_dir("tiny-flat");
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        if path.file_name().unwrap() != "config.json" {
            std::os::unix::fs::symlink(&path, dir.path().join(path.file_name().unwrap())).unwrap();
        }
    }
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    dir
}

/// Options out of range are an error naming them (no tokens gave false failures, no reference
/// layers a pass that compared nothing).
#[test]
fn options_out_of_range_are_refused() {
    for opts in [
        DoctorOptions {
            generate_tokens: 0,
            ..options()
        },
        DoctorOptions {
            reference_layers: Some(0),
            ..options()
        },
    ] {
        let e = examine(&bundled_dir(), &opts).unwrap_err().to_string();
        assert!(
            e.contains("generate_tokens") && e.contains("must be at least 1"),
            "{e}"
        );
    }
    // More tokens than the context holds after the probe: refused naming the context, not
    // reported as the model failing (the bundled model's context is 4096).
    let long = DoctorOptions {
        generate_tokens: 5000,
        ..options()
    };
    let e = examine(&bundled_dir(), &long).unwrap_err().to_string();
    assert!(e.contains("context of 4096") && e.contains("at most 4076"), "{e}");
}

/// A chat template that does not compile is named as such (with the way around it), not as
/// the weights failing: the generator reads the small files first.
#[test]
fn a_template_that_does_not_compile_is_not_called_a_weights_failure() {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(bundled_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.file_name().unwrap() != "tokenizer_config.json" {
            std::os::unix::fs::symlink(&path, dir.path().join(path.file_name().unwrap())).unwrap();
        }
    }
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"chat_template": "{% if %}"}"#,
    )
    .unwrap();
    let (checks, generator) = qwen36::doctor::checkpoint_checks(dir.path(), &options());
    assert!(generator.is_none());
    let c = failed(&checks, "tokenizer and templates");
    assert_eq!(c.status, Status::Fail);
    assert!(c.detail.contains("syntax error"), "{c:?}");
    assert!(c.advice.contains("--chat-template"), "{c:?}");
    assert!(checks.iter().all(|c| c.name != "weights"), "{checks:#?}");
}

/// Stop ids are checked without a tokenizer too (it ran only with one): none at all is a
/// warning, ids within the vocabulary pass.
#[test]
fn missing_stop_ids_are_found_without_a_tokenizer() {
    let dir = tiny_flat_with(|cfg| {
        cfg.as_object_mut().unwrap().remove("eos_token_id");
    });
    let report = examine(dir.path(), &options()).unwrap();
    let c = failed(&report.checks, "stop ids");
    assert_eq!(c.status, Status::Warn, "{}", report.render());
    let dir = tiny_flat_with(|cfg| cfg["eos_token_id"] = serde_json::json!(5));
    let report = examine(dir.path(), &options()).unwrap();
    let c = failed(&report.checks, "stop ids");
    assert_eq!((c.status, c.detail.as_str()), (Status::Pass, "[5] = 5"));
}

/// A generation that fails is a failed check naming the error, not a loop warning with loop
/// advice: here every probe prompt is longer than the model's context.
#[test]
fn a_failing_generation_is_a_failure_not_a_loop() {
    let dir = tiny_flat_with(|cfg| cfg["max_position_embeddings"] = serde_json::json!(4));
    let g = Generator::load(dir.path(), LoadOptions::default()).unwrap();
    let checks = qwen36::doctor::generation_checks(&g, 8);
    let c = failed(&checks, "greedy");
    assert_eq!(c.status, Status::Fail, "{c:?}");
    assert!(
        c.detail.contains("prompt 0 failed") && c.advice.contains("generation failed"),
        "{c:?}"
    );
}

/// The clean models pass every check (warnings allowed: the fixtures have no tokenizer and
/// random weights, whose greedy output may loop).
#[test]
fn the_doctor_passes_the_bundled_model_and_the_fixtures() {
    for dir in [
        bundled_dir(),
        fixture_dir("tiny-flat"),
        fixture_dir("tiny-nested"),
    ] {
        let report = examine(&dir, &options()).unwrap();
        eprint!("{}", report.render());
        assert!(!report.failed(), "{}", report.render());
        let json = report.to_json();
        assert_eq!(json["failed"], false);
        assert!(json["checks"].as_array().unwrap().len() >= 12);
    }
}

/// A tensor-parallel deployment of the bundled model (two ranks as threads) passes every check,
/// its ranks agreeing.
#[test]
fn a_tensor_parallel_deployment_passes_and_its_ranks_agree() {
    let report = examine_ranks(&bundled_dir(), &options(), LocalComm::group(2).unwrap()).unwrap();
    eprint!("{}", report.render());
    assert!(!report.failed(), "{}", report.render());
    assert_eq!(failed(&report.checks, "ranks agree").status, Status::Pass);
    assert!(
        report.device.starts_with("2 tensor-parallel ranks"),
        "{}",
        report.device
    );
    assert!(report.checks.len() >= 13);
}

/// A rank count that does not divide the heads: every rank's load fails naming the field, and
/// the advice is about the rank count, not the checkpoint.
#[test]
fn a_rank_count_that_does_not_split_the_heads_is_named() {
    let report = examine_ranks(&bundled_dir(), &options(), LocalComm::group(3).unwrap()).unwrap();
    let weights = failed(&report.checks, "weights");
    assert_eq!(weights.status, Status::Fail);
    assert!(weights.detail.contains("num_attention_heads"), "{weights:?}");
    assert!(weights.advice.contains("rank count"), "{weights:?}");
    assert_eq!(failed(&report.checks, "ranks agree").status, Status::Pass);
}

/// A communicator that changes some of its rank's reductions: the model's (more than 32
/// elements: the barriers' flags and the doctor's 32-bit verdict digests pass) on the ranks in
/// `ranks`, from the `after`-th on: scaled by `scale`, or failing with an error when `scale` is
/// `None`.
#[derive(Debug)]
struct Skewed {
    inner: Arc<dyn Communicator>,
    ranks: Vec<usize>,
    after: usize,
    scale: Option<f64>,
    calls: std::sync::atomic::AtomicUsize,
}

impl Communicator for Skewed {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn all_reduce_sum(&self, x: &Tensor) -> qwen36::model::Result<Tensor> {
        let hit = x.elem_count() > 32
            && self.ranks.contains(&self.rank())
            && self.calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed) >= self.after;
        match (hit, self.scale) {
            (true, None) => Err(qwen36::model::Error::Comm("a reduction failed (injected)".into())),
            (true, Some(f)) => Ok((self.inner.all_reduce_sum(x)? * f)?),
            (false, _) => self.inner.all_reduce_sum(x),
        }
    }
    fn abort(&self) {
        self.inner.abort()
    }
}

fn skewed(ranks: &[usize], after: usize, scale: Option<f64>) -> Vec<Arc<dyn Communicator>> {
    LocalComm::group(2)
        .unwrap()
        .into_iter()
        .map(|inner| {
            Arc::new(Skewed {
                inner,
                ranks: ranks.to_vec(),
                after,
                scale,
                calls: Default::default(),
            }) as Arc<dyn Communicator>
        })
        .collect()
}

/// Ranks whose reductions all give 1.5 times the sum (a sum that counts parts wrongly, alike on
/// every rank): the layers leave the reference at the first layer, and the ranks still agree.
#[test]
fn a_reduction_that_miscounts_is_found_at_the_first_layer() {
    let report = examine_ranks(&bundled_dir(), &options(), skewed(&[0, 1], 0, Some(1.5))).unwrap();
    let layers = failed(&report.checks, "layers against the CPU f32 reference");
    assert_eq!(layers.status, Status::Fail, "{}", report.render());
    assert!(layers.detail.starts_with("layer 0 "), "{layers:?}");
    assert_eq!(failed(&report.checks, "ranks agree").status, Status::Pass);
}

/// A reduction failing on rank 1 alone in the middle of the numerics: the doctor ends (rank 1
/// stops the group for both; neither waits for the other) with the error in the report.
#[test]
fn a_rank_failing_inside_a_group_stops_every_rank() {
    let report = examine_ranks(&bundled_dir(), &options(), skewed(&[1], 5, None)).unwrap();
    let render = report.render();
    assert!(report.failed(), "{render}");
    let run = failed(&report.checks, "run");
    assert_eq!((run.group, run.status), ("numerics", Status::Fail), "{render}");
    assert!(report.checks.iter().all(|c| c.group != "speculation"), "{render}");
}

fn model(dir: &Path, fault: Option<Fault>) -> Qwen36Model {
    let m = Qwen36Model::load(dir, LoadOptions::default()).unwrap();
    match fault {
        Some(f) => m.with_fault(f),
        None => m,
    }
}

fn prompt(vocab: usize) -> Vec<u32> {
    (0..80u32).map(|i| (i * 7919 + 13) % vocab as u32).collect()
}

/// A bf16 GDN state: the layer comparison over decode steps names a GDN layer before any
/// attention layer and points at the state.
#[test]
fn a_bf16_gdn_state_is_found_at_the_first_gdn_layer() {
    let dir = bundled_dir();
    let (sick, clean) = (model(&dir, Some(Fault::Bf16State)), model(&dir, None));
    let checks = numerics_checks(&sick, &clean, &prompt(4096));
    let c = failed(&checks, "layers against the CPU f32 reference");
    assert_eq!(c.status, Status::Fail, "{c:?}");
    // Layers 0-2 are GDN, 3 attention: a rounded state shows before any attention layer.
    assert!(
        ["layer 0 (GDN)", "layer 1 (GDN)", "layer 2 (GDN)"]
            .iter()
            .any(|l| c.detail.starts_with(l)),
        "{c:?}"
    );
    assert!(c.advice.contains("recurrent state must be f32"), "{c:?}");
    // The clean model against itself passes.
    let checks = numerics_checks(&clean, &clean, &prompt(4096));
    assert!(checks.iter().all(|c| c.status == Status::Pass), "{checks:#?}");
}

/// A state not reset between sequences: the reset check fails naming it.
#[test]
fn a_state_not_reset_is_found() {
    let dir = fixture_dir("tiny-flat");
    let (sick, clean) = (model(&dir, Some(Fault::NoReset)), model(&dir, None));
    let checks = numerics_checks(&sick, &clean, &prompt(384));
    let c = failed(&checks, "state reset between sequences");
    assert_eq!(c.status, Status::Fail, "{c:?}");
    assert!(c.advice.contains("not reset"), "{c:?}");
    // Everything else about this model is right.
    assert!(
        checks.iter().filter(|c| c.status == Status::Fail).count() == 1,
        "{checks:#?}"
    );
}

/// A decode step's state never written back: the layer comparison over decode steps fails (at a
/// GDN layer: the attention layers before it see the right context), and the chunked prefill no
/// longer equals token-by-token decoding.
#[test]
fn a_state_never_written_back_is_found() {
    let dir = bundled_dir();
    let (sick, clean) = (model(&dir, Some(Fault::StaleState)), model(&dir, None));
    let checks = numerics_checks(&sick, &clean, &prompt(4096));
    let c = failed(&checks, "layers against the CPU f32 reference");
    assert_eq!(c.status, Status::Fail, "{c:?}");
    assert!(c.detail.contains("(GDN)"), "{c:?}");
    let c = failed(&checks, "chunked against recurrent GDN");
    assert_eq!(c.status, Status::Fail, "{c:?}");
}

/// A wrong rollback after a verify: the rollback check fails, and MTP greedy parts from plain
/// greedy.
#[test]
fn a_wrong_rollback_is_found() {
    let dir = bundled_dir();
    let sick = model(&dir, Some(Fault::WrongRollback));
    let head = MtpHead::load_dir(&dir, sick.config(), LoadOptions::default()).unwrap();
    let checks = speculation_checks(&sick, Some(&head), &prompt(4096)[..16], 64);
    let c = failed(&checks, "rollback after a verify");
    assert_eq!(c.status, Status::Fail, "{c:?}");
    assert!(c.advice.contains("last accepted token"), "{c:?}");
    let c = failed(&checks, "MTP greedy = plain greedy");
    assert_eq!(c.status, Status::Fail, "{c:?}");
    assert!(c.detail.contains("part at token"), "{c:?}");
}

/// Faults in the engine's pooled state (what a server runs): each fails the engine check it
/// shows in, with its diagnosis, and the clean model passes them all.
#[test]
fn engine_faults_are_found_in_the_engine() {
    let dir = bundled_dir();
    let p = &prompt(4096)[..16];
    // (The solo path, which the numerics checks cover, is the clean model's: a fault that
    // reaches both paths would agree with itself.)
    let alone = model(&dir, None);
    let run = |fault| {
        let m = model(&dir, fault);
        let head = MtpHead::load_dir(&dir, m.config(), LoadOptions::default()).unwrap();
        engine_checks(&m, &alone, Some(&head), p, 64)
    };
    let clean = run(None);
    assert!(clean.iter().all(|c| c.status == Status::Pass), "{clean:#?}");
    let status = |checks: &[Check], name| failed(checks, name).status;
    // A slot not cleared for the next request: only the request in a reused slot differs.
    let checks = run(Some(Fault::NoReset));
    let c = failed(&checks, "batched = alone");
    assert_eq!(c.status, Status::Fail, "{c:?}");
    assert!(c.advice.contains("does not clear"), "{c:?}");
    assert!(c.detail.starts_with("with another: 64 tokens identical"), "{c:?}");
    // A wrong commit after a verify: plain requests are right, MTP parts from them.
    let checks = run(Some(Fault::WrongRollback));
    assert_eq!(status(&checks, "batched = alone"), Status::Pass, "{checks:#?}");
    let c = failed(&checks, "MTP = plain in the engine");
    assert_eq!(c.status, Status::Fail, "{c:?}");
    assert!(c.advice.contains("commit restores"), "{c:?}");
    // A decode step's state never written back, and a bf16 state: wrong from the first request.
    for fault in [Fault::StaleState, Fault::Bf16State] {
        let checks = run(Some(fault));
        let c = failed(&checks, "batched = alone");
        assert_eq!(c.status, Status::Fail, "{fault:?}: {c:?}");
        assert!(c.advice.contains("writes the state back"), "{fault:?}: {c:?}");
    }
    // In bf16 (the dtype most deployments run) a parting on a tie is a warning at most, and the
    // faults still fail.
    let bf16 = |fault| {
        let opts = LoadOptions {
            dtype: candle_core::DType::BF16,
            ..LoadOptions::default()
        };
        let m = Qwen36Model::load(&dir, opts.clone()).unwrap();
        let alone = m.clone();
        let m = match fault {
            Some(f) => m.with_fault(f),
            None => m,
        };
        let head = MtpHead::load_dir(&dir, m.config(), opts).unwrap();
        engine_checks(&m, &alone, Some(&head), p, 64)
    };
    let clean = bf16(None);
    assert!(clean.iter().all(|c| c.status != Status::Fail), "{clean:#?}");
    assert_eq!(
        status(&bf16(Some(Fault::StaleState)), "batched = alone"),
        Status::Fail
    );
    assert_eq!(
        status(&bf16(Some(Fault::WrongRollback)), "MTP = plain in the engine"),
        Status::Fail
    );
}

/// Norm weights shifted by +1 (a plain-RMSNorm conversion): the convention check fails.
#[test]
fn norms_shifted_by_one_are_found() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixture_dir("tiny-flat");
    for entry in std::fs::read_dir(&src).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, dir.path().join(p.file_name().unwrap())).unwrap();
    }
    let path = dir.path().join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&path, &candle_core::Device::Cpu).unwrap();
    for (name, t) in tensors.iter_mut() {
        let one_plus = [
            "input_layernorm",
            "post_attention_layernorm",
            "q_norm",
            "k_norm",
            "model.norm",
        ];
        if one_plus.iter().any(|n| name.contains(n)) && !name.contains("linear_attn") {
            *t = (&*t + 1.0).unwrap();
        }
    }
    candle_core::safetensors::save(&tensors, &path).unwrap();
    let checks = convention_checks(dir.path());
    let c = failed(&checks, "(1+w) RMSNorm weights");
    assert_eq!(c.status, Status::Fail, "{c:?}");
    assert!(c.advice.contains("1+w"), "{c:?}");
    // The original passes.
    let c = convention_checks(&src);
    assert!(c.iter().all(|c| c.status == Status::Pass), "{c:#?}");
}

/// The repetition detector's false positives and detections: quiet on 2,048 held-out tokens and
/// on the bundled model's samples at its default sampling (8 × 256 tokens); fires on the
/// looping greedy output of the bundled model and on synthetic loops.
#[test]
fn the_repetition_detector_is_quiet_on_normal_text_and_fires_on_loops() {
    let cfg = DegenerationConfig::default();
    let heldout = ids_of(&bundled_reference()["heldout.ids"]);
    let mut d = RepetitionDetector::new(cfg);
    let hits = heldout.iter().filter(|&&t| d.observe(t, None).is_some()).count();
    assert_eq!(
        hits,
        0,
        "{hits} detections over {} held-out tokens",
        heldout.len()
    );
    let g = Generator::load(bundled_dir(), LoadOptions::default()).unwrap();
    let prompts = [
        "def fibonacci(n):",
        "import os\n",
        "class Parser:",
        "# Utilities\n",
    ];
    let mut sampled = 0;
    for (i, p) in prompts.iter().enumerate() {
        for seed in 0..2 {
            let opts = GenerateOptions {
                max_new_tokens: 256,
                stop_token_ids: Some(Vec::new()),
                sampling: g
                    .generation_config()
                    .sampling
                    .clone()
                    .map(|s| qwen36::SamplingParams {
                        seed: (i * 2 + seed) as u64,
                        ..s
                    }),
                ..GenerateOptions::default()
            };
            let out = g.generate_text(p, &opts, |_| {}).unwrap();
            sampled += out.tokens.len();
            assert_eq!(out.degeneration, None, "{p:?} seed {seed}: {:?}", out.text);
        }
    }
    eprintln!(
        "no detection over {} held-out and {sampled} sampled tokens",
        heldout.len()
    );
    // Greedy without penalties on this model loops, and stopping on it ends generation there.
    let opts = GenerateOptions {
        max_new_tokens: 256,
        stop_token_ids: Some(Vec::new()),
        sampling: Some(qwen36::SamplingParams::greedy()),
        stop_on_degeneration: true,
        ..GenerateOptions::default()
    };
    let out = g.generate_text("import numpy as np\n", &opts, |_| {}).unwrap();
    assert!(
        matches!(out.stop_reason, qwen36::StopReason::Degenerate(_)),
        "{:?} {:?}",
        out.stop_reason,
        out.text
    );
    assert!(out.tokens.len() < 256);
}

/// The seed's failure on the bundled model: with a GDN state that decode steps never write back
/// (`Fault::StaleState`, in the engine's pools), generation at the model's own default sampling
/// falls into loops ("'''\n    '''\n…", "\n\n\n…") that the repetition detector stops, while the
/// clean model's same requests run to their end.
#[test]
fn the_detector_stops_the_loops_of_a_state_never_written_back() {
    use qwen36::engine::{Engine, EngineConfig, Event, Request, StopReason};
    let dir = bundled_dir();
    let g = Generator::load(&dir, LoadOptions::default()).unwrap();
    let defaults = g.generation_config().sampling.clone().unwrap();
    let prompts = [
        "def fibonacci(n):",
        "import os\n",
        "class Parser:",
        "# Utilities\n",
    ];
    let stops = |fault| {
        let cfg = EngineConfig {
            max_seqs: 8,
            prefix_snapshots: 0,
            ..EngineConfig::default()
        };
        let mut engine = Engine::new(model(&dir, fault), cfg).unwrap();
        let mut handles = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            for seed in 0..2u64 {
                let mut req = Request::greedy(g.encode(p).unwrap(), 512);
                req.sampling = qwen36::SamplingParams {
                    seed: seed + 2 * i as u64,
                    ..defaults.clone()
                };
                req.degeneration = Some(DegenerationConfig::default());
                req.stop_on_degeneration = true;
                handles.push(engine.submit(req).unwrap());
            }
        }
        engine.run_to_completion().unwrap();
        let ends: Vec<StopReason> = handles
            .iter()
            .map(|h| {
                h.drain()
                    .into_iter()
                    .find_map(|e| match e {
                        Event::Finished { reason, .. } => Some(reason),
                        _ => None,
                    })
                    .unwrap()
            })
            .collect();
        ends.iter()
            .filter(|r| matches!(r, StopReason::Degenerate(_)))
            .count()
    };
    let sick = stops(Some(Fault::StaleState));
    let clean = stops(None);
    eprintln!("stopped as degenerate: {sick} of 8 with a stale state, {clean} of 8 clean");
    assert!(sick >= 2, "{sick} of 8 faulty generations stopped");
    assert_eq!(clean, 0);
}
